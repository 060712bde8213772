//! The `dedup` kind: drop (or side-output) records whose key was seen within the TTL.
//! Spec [`DedupSpec`] and processor `Dedup` in `processor/stages/dedup_stage.rs`; the
//! decision itself is `processor/dedup.rs`.
//!
//! ```yaml
//! - dedup: { name: dedup, key: { json_pointer: /id }, ttl: 24h, duplicates_to: gh.dups }
//! ```

use super::{BuildCx, CheckCx, FieldError, FileKind, Link, ReadStage, StageKind, StageKindSpec};
use crate::codec::Format;
use crate::names::check_topic_name;
use crate::processor::fingerprint::FingerprintFields;
use crate::processor::key::KeySource;
use crate::processor::stages::{
    repartition_topic, ConflictPolicy, Dedup, DedupSpec, Partitioning, TimeSource,
};
use crate::processor::Processor;
use crate::schema::node::{Node, Val};
use crate::schema::{Fields, Reader};
use crate::topology::TopologyBuilder;
use std::fmt::Write as _;

impl StageKindSpec for DedupSpec {
    fn settings(&self) -> String {
        let d = self;
        let mut s = format!(
            "key={} ttl={} time={} grace={}",
            d.key.describe(),
            crate::schema::duration_text(d.ttl_ms),
            d.time.name(),
            crate::schema::duration_text(d.grace_ms)
        );
        if d.fingerprint {
            match &d.fingerprint_fields {
                Some(f) => {
                    let _ = write!(s, " fingerprint({})", f.describe());
                }
                None => s.push_str(" fingerprint"),
            }
            let _ = write!(s, " on_conflict={}", d.on_conflict.name());
        }
        if let Some(m) = d.max_keys {
            let _ = write!(s, " max_keys={m}");
        }
        if let Some(t) = &d.duplicates_to {
            let _ = write!(s, " duplicates_to={t}");
        }
        let (p, why) = d.effective_partitioning();
        let _ = write!(s, " partitioning={} ({why})", p.name());
        s
    }

    fn describe_before(&self, app: &str, name: &str) -> Vec<String> {
        if self.effective_partitioning().0 != Partitioning::Repartition {
            return Vec::new();
        }
        vec![format!(
            "Repartition: topic {} keyed by {}",
            repartition_topic(app, name),
            self.key.describe()
        )]
    }

    fn output_topics(&self) -> Vec<String> {
        self.duplicates_to.iter().cloned().collect()
    }

    fn links(&self) -> Vec<Link> {
        self.duplicates_to
            .iter()
            .map(|t| Link::ToTopic(t.clone(), Some("duplicates".into())))
            .collect()
    }

    fn stores(&self, name: &str) -> Vec<String> {
        vec![name.to_string()]
    }

    fn json_pointers(&self, out: &mut Vec<String>) {
        self.key.json_pointers(out);
    }

    fn check(&mut self, cx: &CheckCx<'_>, errors: &mut Vec<FieldError>) {
        let d = &*self;
        let mut err = |field: &str, reason: String| errors.push(FieldError::at(field, reason));
        if d.ttl_ms <= 0 {
            err("ttl", "must be positive".into());
        }
        if d.key.needs_json()
            && cx
                .source
                .is_some_and(|s| matches!(s.format, Format::Bytes | Format::String))
        {
            err(
                "key",
                format!(
                    "{} needs a json source, but the source format is {}",
                    d.key.describe(),
                    cx.format_name()
                ),
            );
        }
        if d.grace_ms < 0 {
            err("grace", "must not be negative".into());
        }
        // Every pointer of the key, a composite's parts too.
        for p in d.key.problems() {
            err("key", p);
        }
        if d.max_keys == Some(0) {
            err(
                "max_keys",
                "must be positive (0 would evict every entry as it is written: no dedup)".into(),
            );
        }
        if let Some(t) = &d.duplicates_to {
            if let Err(r) = check_topic_name(t) {
                err("duplicates_to", r);
            }
        }
        if let Some(f) = &d.fingerprint_fields {
            if let Err(r) = f.validate() {
                err("fingerprint", r);
            } else if !d.fingerprint {
                err(
                    "fingerprint",
                    "fingerprint fields are given but the fingerprint is off".into(),
                );
            }
            if let Some(s) = cx
                .source
                .filter(|s| matches!(s.format, Format::Bytes | Format::String))
            {
                err(
                    "fingerprint",
                    format!(
                        "fingerprint fields need a source with fields (json, protobuf), but the source format is {}",
                        s.format.name()
                    ),
                );
            }
        }
        if d.on_conflict == ConflictPolicy::DuplicatesTo && d.duplicates_to.is_none() {
            err(
                "on_conflict",
                "duplicates_to needs a duplicates_to topic".into(),
            );
        }
    }

    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor> {
        let n = cx.name;
        Box::new(
            Dedup::new(cx.topology_name(), n, n, self.clone())
                .holding_twins(
                    cx.downstream()
                        .iter()
                        .any(|s| s.kind.spec().external_effect()),
                )
                .keyed_by_hop(cx.topology.hop_stage_index() == Some(cx.index)),
        )
    }
}

/// `- dedup: {...}` in topology files.
pub(super) const FILE_KINDS: &[FileKind] = &[FileKind {
    key: "dedup",
    fields: &[
        "name",
        "key",
        "ttl",
        "time",
        "grace",
        "max_keys",
        "fingerprint",
        "on_conflict",
        "duplicates_to",
        "partitioning",
    ],
    default_name: |_, _| "dedup".to_string(),
    read,
}];

fn read(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let key = c.required(f, "key", place).and_then(|n| c.key(n, place));
    let mut ok = key.is_some();
    let mut spec = DedupSpec::new(key.unwrap_or(KeySource::KafkaKey));
    ok &= c.opt(
        f,
        "ttl",
        |c, n| c.duration_ms(n, place, "ttl"),
        |ms| spec.ttl_ms = ms,
    );
    ok &= c.opt(
        f,
        "grace",
        |c, n| c.duration_ms(n, place, "grace"),
        |ms| spec.grace_ms = ms,
    );
    if let Some(n) = f.get("time") {
        match c
            .choice(n, place, "time", &["event", "processing"])
            .as_deref()
        {
            Some("processing") => spec.time = TimeSource::Processing,
            Some(_) => spec.time = TimeSource::Event,
            None => ok = false,
        }
    }
    if let Some(n) = f.get("max_keys") {
        match &n.val {
            Val::Int(i) if *i > 0 => spec.max_keys = Some(*i as u64),
            other => {
                ok = false;
                c.err(
                    n.pos,
                    place,
                    Some("max_keys"),
                    format!(
                        "expected a positive integer, found {}",
                        match other {
                            Val::Int(i) => i.to_string(),
                            o => o.type_name().to_string(),
                        }
                    ),
                );
            }
        }
    }
    if let Some(n) = f.get("fingerprint") {
        match fingerprint(c, n, place) {
            Some((on, fields)) => {
                spec.fingerprint = on;
                spec.fingerprint_fields = fields;
            }
            None => ok = false,
        }
    }
    if let Some(n) = f.get("on_conflict") {
        match c
            .choice(
                n,
                place,
                "on_conflict",
                &["drop", "pass", "dead_letter", "duplicates_to"],
            )
            .as_deref()
        {
            Some("pass") => spec.on_conflict = ConflictPolicy::Pass,
            Some("dead_letter") => spec.on_conflict = ConflictPolicy::DeadLetter,
            Some("duplicates_to") => spec.on_conflict = ConflictPolicy::DuplicatesTo,
            Some(_) => spec.on_conflict = ConflictPolicy::Drop,
            None => ok = false,
        }
    }
    ok &= c.opt(
        f,
        "duplicates_to",
        |c, n| c.string(n, place, "duplicates_to"),
        |t| spec.duplicates_to = Some(t),
    );
    if let Some(n) = f.get("partitioning") {
        match c
            .choice(n, place, "partitioning", &["source", "repartition"])
            .as_deref()
        {
            Some("source") => spec.partitioning = Some(Partitioning::Source),
            Some(_) => spec.partitioning = Some(Partitioning::Repartition),
            None => ok = false,
        }
    }
    ok.then_some((StageKind::Dedup(spec), None))
}

/// `fingerprint: true | false | { cover: [pointers], ignore: [pointers] }`: whether it is
/// on, and the fields it is taken over (`None`: the value bytes).
fn fingerprint(c: &mut Reader, n: &Node, place: &str) -> Option<(bool, Option<FingerprintFields>)> {
    const FIELD: &str = "fingerprint";
    let entries = match &n.val {
        Val::Bool(b) => return Some((*b, None)),
        Val::Map(es) => es,
        other => {
            c.wrong_type(
                n.pos,
                place,
                Some(FIELD),
                "true, false or { cover: [json pointers], ignore: [json pointers] }",
                other,
            );
            return None;
        }
    };
    let mut fields = FingerprintFields::default();
    for (k, _, v) in entries {
        let list = match k.as_str() {
            "cover" => &mut fields.cover,
            "ignore" => &mut fields.ignore,
            other => {
                c.err(
                    n.pos,
                    place,
                    Some(FIELD),
                    format!("unknown field `{other}`, expected cover or ignore"),
                );
                return None;
            }
        };
        let Val::Seq(items) = &v.val else {
            c.err(
                n.pos,
                place,
                Some(FIELD),
                format!(
                    "{k}: expected a list of JSON pointers, found {}",
                    v.val.type_name()
                ),
            );
            return None;
        };
        for item in items {
            match &item.val {
                Val::Str(p) => list.push(p.clone()),
                other => {
                    c.err(
                        n.pos,
                        place,
                        Some(FIELD),
                        format!("{k}: expected a JSON pointer, found {}", other.type_name()),
                    );
                    return None;
                }
            }
        }
    }
    if let Err(r) = fields.validate() {
        c.err(n.pos, place, Some(FIELD), r);
        return None;
    }
    Some((true, Some(fields)))
}

impl TopologyBuilder {
    /// Add a dedup stage: records whose key was seen within the TTL are dropped (or sent
    /// to `duplicates_to`); its store is named after the stage.
    pub fn dedup(self, name: impl Into<String>, spec: DedupSpec) -> Self {
        self.stage(name, StageKind::Dedup(spec))
    }
}
