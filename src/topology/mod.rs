//! The plain topology: a source, a chain of named stages, and the stores they use.
//!
//! [`TopologyBuilder`] is the Rust API; topology files (`dsl`) compile to builder calls.
//! [`TopologyBuilder::build`] validates and returns a [`Topology`] or every error found,
//! each naming the stage and the field. [`Topology::describe`] prints it.

use crate::error::Error;
use crate::processor::stages::{Dedup, DedupSpec, SinkSpec, TopicSink};
use crate::processor::Processor;
use std::fmt::Write as _;

pub use crate::processor::codec::{Format, ProtoFormat};
pub use crate::processor::enrich::{EnrichSpec, MissingPolicy, TableSpec};

/// The source of a topology: one topic and its value format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Topic name.
    pub topic: String,
    /// Value format.
    pub format: Format,
}

/// What a stage does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageKind {
    /// Drop repeated records by key within a TTL.
    Dedup(DedupSpec),
    /// Write records to a topic.
    Sink(SinkSpec),
    /// Join records with a lookup table.
    Enrich(EnrichSpec),
    /// An effect outside Kafka (HTTP, PostgreSQL, Redis, file) with keyed idempotency.
    External(Box<crate::sink::ExternalSinkSpec>),
}

impl StageKind {
    fn kind_name(&self) -> &'static str {
        match self {
            StageKind::Dedup(_) => "dedup",
            StageKind::Sink(_) => "sink",
            StageKind::Enrich(_) => "enrich",
            StageKind::External(_) => "external sink",
        }
    }
}

/// A named stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// Unique name; also the name of the stage's state store, if it has one.
    pub name: String,
    /// What it does.
    pub kind: StageKind,
}

/// A validated topology, ready to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    name: String,
    source: Source,
    stages: Vec<Stage>,
    tables: Vec<TableSpec>,
    topic_formats: std::collections::BTreeMap<String, Format>,
}

impl Topology {
    /// The topology's name (a metric label).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its source.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Its stages in order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Names of the state stores, one per dedup stage.
    pub fn stores(&self) -> Vec<String> {
        self.stages
            .iter()
            .filter(|s| matches!(s.kind, StageKind::Dedup(_)))
            .map(|s| s.name.clone())
            .collect()
    }

    /// The JSON pointers the stages read, for decoding without a tree.
    pub fn json_pointers(&self) -> Vec<String> {
        let mut out = Vec::new();
        for s in &self.stages {
            match &s.kind {
                StageKind::Dedup(d) => d.key.json_pointers(&mut out),
                StageKind::Enrich(e) => {
                    e.key.json_pointers(&mut out);
                    // The enrich fast path needs to know the target field is absent.
                    if crate::processor::enrich::splice_field(&e.into).is_some()
                        && !out.contains(&e.into)
                    {
                        out.push(e.into.clone());
                    }
                }
                StageKind::Sink(_) => {}
                StageKind::External(e) => e.json_pointers(&mut out),
            }
        }
        out
    }

    /// Topics written by sinks, in order, without repeats.
    pub fn sink_topics(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in &self.stages {
            if let StageKind::Sink(k) = &s.kind {
                if !out.contains(&k.topic) {
                    out.push(k.topic.clone());
                }
            }
        }
        out
    }

    /// New processor instances for one task (one source partition), in stage order.
    pub fn instantiate(&self) -> Vec<(String, Box<dyn Processor>)> {
        let last = self.stages.len().saturating_sub(1);
        self.stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let p: Box<dyn Processor> = match &s.kind {
                    StageKind::Dedup(spec) => {
                        Box::new(Dedup::new(&self.name, &s.name, &s.name, spec.clone()))
                    }
                    StageKind::Sink(spec) => Box::new(
                        TopicSink::new(spec, i != last)
                            .with_codec(self.source.format.clone(), self.topic_format(&spec.topic)),
                    ),
                    StageKind::Enrich(spec) => Box::new(crate::processor::enrich::Enrich::new(
                        &self.name,
                        &s.name,
                        spec.clone(),
                    )),
                    StageKind::External(spec) => Box::new(crate::sink::stage::ExternalSink::new(
                        &self.name,
                        &s.name,
                        spec,
                        i != last,
                    )),
                };
                (s.name.clone(), p)
            })
            .collect()
    }

    /// A text description: source, stages with their settings, stores.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "Topology: {}", self.name);
        let _ = writeln!(
            s,
            "  Source: topic {} (format {})",
            self.source.topic,
            self.source.format.describe()
        );
        for t in &self.tables {
            let _ = writeln!(
                s,
                "  Table: {} topic={} (format {}) store=table-{}",
                t.name,
                t.topic,
                t.format.describe(),
                t.name
            );
        }
        for st in &self.stages {
            match &st.kind {
                StageKind::Dedup(d) => {
                    let _ = writeln!(
                        s,
                        "  Dedup: {} key={} ttl={} time={:?} store={}",
                        st.name,
                        d.key.describe(),
                        humantime::format_duration(std::time::Duration::from_millis(
                            d.ttl_ms as u64
                        )),
                        d.time,
                        st.name
                    );
                }
                StageKind::Sink(k) => {
                    let _ = writeln!(
                        s,
                        "  Sink: {} topic={} (format {})",
                        st.name,
                        k.topic,
                        self.topic_format(&k.topic).describe()
                    );
                }
                StageKind::Enrich(e) => {
                    let _ = writeln!(
                        s,
                        "  Enrich: {} table={} key={} into={:?} on_missing={}",
                        st.name,
                        e.table,
                        e.key.describe(),
                        e.into,
                        e.on_missing.name()
                    );
                }
                StageKind::External(e) => {
                    let _ = writeln!(s, "{}", e.describe(&st.name));
                }
            }
        }
        s
    }
}

/// Builds a [`Topology`] stage by stage.
///
/// ```
/// use onceflow::topology::{TopologyBuilder, Format};
/// use onceflow::processor::{key::KeySource, stages::DedupSpec};
/// let t = TopologyBuilder::new("dedup-demo")
///     .source("events", Format::Json)
///     .dedup("dedup", DedupSpec::new(KeySource::JsonPointer("/id".into())))
///     .sink("out", "events.unique")
///     .build()
///     .unwrap();
/// assert_eq!(t.stores(), vec!["dedup".to_string()]);
/// ```
#[derive(Debug, Default)]
pub struct TopologyBuilder {
    name: String,
    source: Option<Source>,
    stages: Vec<Stage>,
    tables: Vec<TableSpec>,
    topic_formats: std::collections::BTreeMap<String, Format>,
}

impl TopologyBuilder {
    /// Start a topology called `name`.
    pub fn new(name: impl Into<String>) -> Self {
        TopologyBuilder {
            name: name.into(),
            ..Default::default()
        }
    }

    /// Set the source topic and its format.
    pub fn source(mut self, topic: impl Into<String>, format: Format) -> Self {
        self.source = Some(Source {
            topic: topic.into(),
            format,
        });
        self
    }

    /// Add a dedup stage.
    pub fn dedup(mut self, name: impl Into<String>, spec: DedupSpec) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            kind: StageKind::Dedup(spec),
        });
        self
    }

    /// Add a sink stage writing to `topic`.
    pub fn sink(mut self, name: impl Into<String>, topic: impl Into<String>) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            kind: StageKind::Sink(SinkSpec {
                topic: topic.into(),
            }),
        });
        self
    }

    // ---- External sinks (issue 6: effects outside Kafka with keyed idempotency) ----

    /// Add an external sink stage: an HTTP call, a PostgreSQL statement, a Redis command or
    /// a file line per record, made once per idempotency key (see [`crate::sink`]). Its key
    /// template and settings are checked by [`TopologyBuilder::build`].
    pub fn external_sink(
        mut self,
        name: impl Into<String>,
        spec: crate::sink::ExternalSinkSpec,
    ) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            kind: StageKind::External(Box::new(spec)),
        });
        self
    }

    // ---- end of external sinks ----

    /// Validate and build.
    ///
    /// # Errors
    /// Every problem found, each an [`Error::Topology`] naming the stage and field: no
    /// source, an empty or invalid topic name, duplicate stage names, a TTL that is not
    /// positive, a JSON-pointer key on a non-JSON source, no sink.
    pub fn build(mut self) -> Result<Topology, Vec<Error>> {
        let mut errors = Vec::new();
        let err = |node: &str, reason: String| Error::Topology {
            node: node.to_string(),
            reason,
        };
        if self.name.trim().is_empty() {
            errors.push(err("topology", "field `name`: must not be empty".into()));
        }
        let fmt = self.source.as_ref().map(|s| s.format.clone());
        for i in 0..self.stages.len() {
            for r in crate::sink::validate(&mut self.stages, i, fmt.as_ref()) {
                errors.push(err(&self.stages[i].name, r));
            }
        }
        let source = match self.source.clone() {
            Some(s) => {
                if let Err(r) = check_topic_name(&s.topic) {
                    errors.push(err("source", format!("field `topic`: {r}")));
                }
                Some(s)
            }
            None => {
                errors.push(err(
                    "source",
                    "missing: a topology needs a source topic".into(),
                ));
                None
            }
        };
        let mut seen = std::collections::HashSet::new();
        for st in &self.stages {
            if st.name.is_empty() {
                errors.push(err(
                    st.kind.kind_name(),
                    "field `name`: must not be empty".into(),
                ));
            } else if !st
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
            {
                errors.push(err(
                    &st.name,
                    "field `name`: use only ASCII letters, digits, '-', '_' and '.' (it names a store and its changelog topic)"
                        .into(),
                ));
            }
            if !seen.insert(st.name.clone()) {
                errors.push(err(&st.name, "field `name`: duplicate stage name".into()));
            }
            match &st.kind {
                StageKind::Dedup(d) => {
                    if d.ttl_ms <= 0 {
                        errors.push(err(&st.name, "field `ttl`: must be positive".into()));
                    }
                    if let Some(src) = &source {
                        if d.key.needs_json()
                            && matches!(src.format, Format::Bytes | Format::String)
                        {
                            errors.push(err(
                                &st.name,
                                format!(
                                    "field `key`: {} needs a json source, but the source format is {}",
                                    d.key.describe(),
                                    src.format.name()
                                ),
                            ));
                        }
                    }
                    if let crate::processor::key::KeySource::JsonPointer(p) = &d.key {
                        if !p.is_empty() && !p.starts_with('/') {
                            errors.push(err(
                                &st.name,
                                format!("field `key`: JSON pointer {p:?} must start with '/'"),
                            ));
                        }
                    }
                }
                StageKind::Sink(k) => {
                    if let Err(r) = check_topic_name(&k.topic) {
                        errors.push(err(&st.name, format!("field `topic`: {r}")));
                    }
                }
                StageKind::Enrich(_) => {}
                StageKind::External(_) => {}
            }
        }
        self.validate_tables(source.as_ref(), &mut errors);
        if !self
            .stages
            .iter()
            .any(|s| matches!(s.kind, StageKind::Sink(_) | StageKind::External(_)))
        {
            errors.push(err("stages", "a topology needs at least one sink".into()));
        }
        match (errors.is_empty(), source) {
            (true, Some(source)) => Ok(Topology {
                name: self.name,
                source,
                stages: self.stages,
                tables: self.tables,
                topic_formats: self.topic_formats,
            }),
            _ => Err(errors),
        }
    }
}

// ---- Lookup tables, enrich and per-topic codecs (issue 5). Kept in one block. ----

impl Topology {
    /// The lookup tables, in declaration order.
    pub fn tables(&self) -> &[TableSpec] {
        &self.tables
    }

    /// The codec of `topic`'s values: as set with [`TopologyBuilder::topic_format`], else the
    /// source's format (so a pipeline writes what it reads unless told otherwise).
    pub fn topic_format(&self, topic: &str) -> Format {
        self.topic_formats
            .get(topic)
            .cloned()
            .unwrap_or_else(|| self.source.format.clone())
    }
}

impl TopologyBuilder {
    /// Declare a lookup table materialized from a compacted topic (see
    /// [`crate::state::table`]); enrich stages refer to it by name.
    pub fn table(mut self, spec: TableSpec) -> Self {
        self.tables.push(spec);
        self
    }

    /// Add an enrich stage: a lookup join against a declared table.
    pub fn enrich(mut self, name: impl Into<String>, spec: EnrichSpec) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            kind: StageKind::Enrich(spec),
        });
        self
    }

    /// Set the codec of a sink topic's values (default: the source's format).
    pub fn topic_format(mut self, topic: impl Into<String>, format: Format) -> Self {
        self.topic_formats.insert(topic.into(), format);
        self
    }

    /// Checks of tables, enrich stages and codecs, appended to `errors`.
    fn validate_tables(&self, source: Option<&Source>, errors: &mut Vec<Error>) {
        let err = |node: &str, reason: String| Error::Topology {
            node: node.to_string(),
            reason,
        };
        let mut names = std::collections::HashSet::new();
        for t in &self.tables {
            let node = format!("table {}", t.name);
            if t.name.is_empty()
                || !t
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
            {
                errors.push(err(
                    &node,
                    "field `name`: use only ASCII letters, digits, '-', '_' and '.' (it names the table's store), at least one".into(),
                ));
            }
            if !names.insert(t.name.as_str()) {
                errors.push(err(&node, "field `name`: duplicate table name".into()));
            }
            if let Err(r) = check_topic_name(&t.topic) {
                errors.push(err(&node, format!("field `topic`: {r}")));
            }
            if !t.format.has_view() {
                errors.push(err(
                    &node,
                    "field `format`: a table needs rows with a view (json, string or protobuf), not bytes".into(),
                ));
            }
            if source.is_some_and(|s| s.topic == t.topic) {
                errors.push(err(
                    &node,
                    format!(
                        "field `topic`: {} is the source topic; a table needs its own topic",
                        t.topic
                    ),
                ));
            }
        }
        for st in &self.stages {
            let StageKind::Enrich(e) = &st.kind else {
                continue;
            };
            if !self.tables.iter().any(|t| t.name == e.table) {
                let have: Vec<&str> = self.tables.iter().map(|t| t.name.as_str()).collect();
                errors.push(err(
                    &st.name,
                    format!(
                        "field `table`: no table named {:?} (declared: {})",
                        e.table,
                        if have.is_empty() {
                            "none".to_string()
                        } else {
                            have.join(", ")
                        }
                    ),
                ));
            }
            if let Some(src) = source {
                if !src.format.has_view() {
                    errors.push(err(
                        &st.name,
                        "enrich needs a source with a record view (json, string or protobuf), but the source format is bytes".into(),
                    ));
                }
            }
            for (field, p) in [
                ("key", key_pointer(&e.key)),
                ("into", Some(e.into.as_str())),
            ] {
                if let Some(p) = p {
                    if !p.is_empty() && !p.starts_with('/') {
                        errors.push(err(
                            &st.name,
                            format!("field `{field}`: JSON pointer {p:?} must start with '/'"),
                        ));
                    }
                }
            }
        }
        for (topic, f) in &self.topic_formats {
            let written = self
                .stages
                .iter()
                .any(|s| matches!(&s.kind, StageKind::Sink(k) if &k.topic == topic));
            if !written {
                errors.push(err(
                    &format!("topic {topic}"),
                    format!(
                        "a format ({}) is set for a topic no sink writes",
                        f.describe()
                    ),
                ));
            }
            if let Some(src) = source {
                if !src.format.has_view() && !matches!(f, Format::Bytes) {
                    errors.push(err(
                        &format!("topic {topic}"),
                        format!(
                            "the source format is bytes, which cannot be written as {}",
                            f.describe()
                        ),
                    ));
                }
            }
        }
    }
}

fn key_pointer(k: &crate::processor::key::KeySource) -> Option<&str> {
    match k {
        crate::processor::key::KeySource::JsonPointer(p) => Some(p),
        _ => None,
    }
}

/// Check a Kafka topic name: 1..=249 chars of `[a-zA-Z0-9._-]`, not `.` or `..`.
///
/// # Errors
/// A sentence saying what is wrong.
pub fn check_topic_name(t: &str) -> Result<(), String> {
    if t.is_empty() {
        return Err("topic name must not be empty".into());
    }
    if t.len() > 249 {
        return Err(format!("topic name is {} characters, at most 249", t.len()));
    }
    if t == "." || t == ".." {
        return Err(format!("{t:?} is not a valid topic name"));
    }
    if let Some(c) = t
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "topic name {t:?} holds {c:?}; use only ASCII letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::key::KeySource;

    #[test]
    fn build_reports_every_error() {
        let mut bad = DedupSpec::new(KeySource::JsonPointer("id".into()));
        bad.ttl_ms = 0;
        let errs = TopologyBuilder::new("t")
            .source("in put", Format::Bytes)
            .dedup("d", bad)
            .dedup("d", DedupSpec::new(KeySource::KafkaKey))
            .build()
            .unwrap_err();
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        let want = [
            "topology error in source: field `topic`: topic name \"in put\" holds ' '; use only ASCII letters, digits, '.', '_' and '-'",
            "topology error in d: field `ttl`: must be positive",
            "topology error in d: field `key`: json pointer id needs a json source, but the source format is bytes",
            "topology error in d: field `key`: JSON pointer \"id\" must start with '/'",
            "topology error in d: field `name`: duplicate stage name",
            "topology error in stages: a topology needs at least one sink",
        ];
        assert_eq!(text, want);
    }
}
