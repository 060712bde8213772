//! The `enrich` kind: a lookup join of each record with a row of a declared table (see
//! `state::table`). Spec [`EnrichSpec`] and processor `Enrich` in `processor/enrich.rs`.
//!
//! ```yaml
//! tables:
//!   - { name: customers, topic: customers, format: json }
//! stages:
//!   - enrich: { name: join, table: customers, key: { json_pointer: /customer_id }, into: /customer, on_missing: dead_letter }
//! ```

use super::{BuildCx, CheckCx, FieldError, FileKind, Link, ReadStage, StageKind, StageKindSpec};
use crate::processor::enrich::{splice_field, Enrich, EnrichSpec, MissingPolicy};
use crate::processor::Processor;
use crate::schema::node::Node;
use crate::schema::{Fields, Reader};
use crate::topology::TopologyBuilder;

impl StageKindSpec for EnrichSpec {
    fn settings(&self) -> String {
        format!(
            "table={} key={} into={:?} on_missing={}",
            self.table,
            self.key.describe(),
            self.into,
            self.on_missing.name()
        )
    }

    fn links(&self) -> Vec<Link> {
        vec![Link::FromTable(self.table.clone(), "lookup")]
    }

    fn json_pointers(&self, out: &mut Vec<String>) {
        self.key.json_pointers(out);
        // The enrich fast path needs to know the target field is absent.
        if splice_field(&self.into).is_some() && !out.contains(&self.into) {
            out.push(self.into.clone());
        }
    }

    fn check(&mut self, _cx: &CheckCx<'_>, _errors: &mut Vec<FieldError>) {}

    fn check_tables(&self, cx: &CheckCx<'_>, errors: &mut Vec<FieldError>) {
        if !cx.tables.iter().any(|t| t.name == self.table) {
            let have: Vec<&str> = cx.tables.iter().map(|t| t.name.as_str()).collect();
            errors.push(FieldError::at(
                "table",
                format!(
                    "no table named {:?} (declared: {})",
                    self.table,
                    if have.is_empty() {
                        "none".to_string()
                    } else {
                        have.join(", ")
                    }
                ),
            ));
        }
        if cx.source.is_some_and(|s| !s.format.has_view()) {
            errors.push(FieldError::whole(
                "enrich needs a source with a record view (json, string or protobuf), but the source format is bytes",
            ));
        }
        for p in self.key.problems() {
            errors.push(FieldError::at("key", p));
        }
        // (A bytes source is refused above, for the whole stage.)
        if self.key.needs_json()
            && cx
                .source
                .is_some_and(|s| matches!(s.format, crate::Format::String))
        {
            errors.push(FieldError::at(
                "key",
                format!(
                    "{} needs a json source, but the source format is {}",
                    self.key.describe(),
                    cx.format_name()
                ),
            ));
        }
        let p = &self.into;
        if !p.is_empty() && !p.starts_with('/') {
            errors.push(FieldError::at(
                "into",
                format!("JSON pointer {p:?} must start with '/'"),
            ));
        }
    }

    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor> {
        Box::new(Enrich::new(cx.topology_name(), cx.name, self.clone()))
    }
}

/// `- enrich: {...}` in topology files.
pub(super) const FILE_KINDS: &[FileKind] = &[FileKind {
    key: "enrich",
    fields: &["name", "table", "key", "into", "on_missing"],
    default_name,
    read,
}];

/// `enrich-<table>`, or `enrich-<n>` without a table.
fn default_name(body: &Node, index: usize) -> String {
    match body.str_field("table") {
        Some(t) => format!("enrich-{t}"),
        None => super::numbered("enrich", index),
    }
}

fn read(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let table = c
        .required(f, "table", place)
        .and_then(|n| c.string(n, place, "table"));
    let key = c.required(f, "key", place).and_then(|n| c.key(n, place));
    let into = match f.get("into") {
        None => table.as_ref().map(|t| format!("/{t}")),
        Some(n) => c.string(n, place, "into"),
    };
    let policy = match f.get("on_missing") {
        None => Some(MissingPolicy::Pass),
        Some(n) => c
            .choice(n, place, "on_missing", &["drop", "pass", "dead_letter"])
            .map(|s| match s.as_str() {
                "drop" => MissingPolicy::Drop,
                "dead_letter" => MissingPolicy::DeadLetter,
                _ => MissingPolicy::Pass,
            }),
    };
    let spec = EnrichSpec::new(table?, key?, into?).on_missing(policy?);
    Some((StageKind::Enrich(spec), None))
}

impl TopologyBuilder {
    /// Add an enrich stage: a lookup join against a table declared with
    /// [`TopologyBuilder::table`] (naming an undeclared one is a build error).
    ///
    /// ```
    /// use onceflow::prelude::*;
    /// let join = EnrichSpec::new("customers", KeySource::JsonPointer("/customer_id".into()), "/customer")
    ///     .on_missing(MissingPolicy::DeadLetter);
    /// let t = TopologyBuilder::new("orders")
    ///     .source("orders", Format::Json)
    ///     .table(TableSpec::new("customers", "customers"))
    ///     .enrich("join", join)
    ///     .sink("out", "orders.enriched")
    ///     .build()
    ///     .unwrap();
    /// assert!(t.describe().contains("Enrich: join table=customers"));
    /// ```
    pub fn enrich(self, name: impl Into<String>, spec: EnrichSpec) -> Self {
        self.stage(name, StageKind::Enrich(spec))
    }
}
