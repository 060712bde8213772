//! Topology files (YAML): serde structs that compile to [`TopologyBuilder`] calls only.
//!
//! ```yaml
//! name: gharchive-dedup
//! source: { topic: gharchive.events, format: json }
//! stages:
//!   - dedup: { name: dedup, key: { json_pointer: /id }, ttl: 24h }
//!   - sink: { topic: gharchive.unique }
//! ```
//!
//! Unknown fields and stage kinds are errors. Every error names the file, and the stage and
//! field where it knows them; parse errors carry the line and column.

pub mod sinks;

use crate::error::Error;
use crate::processor::key::KeySource;
use crate::processor::stages::{ConflictPolicy, DedupSpec, TimeSource};
use crate::topology::{Format, Topology, TopologyBuilder};
use serde::Deserialize;
use std::path::Path;

pub mod tables;

/// A topology file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyFile {
    /// Topology name (a metric label).
    pub name: String,
    /// The source topic.
    pub source: SourceDef,
    /// Lookup tables (see [`tables`]).
    #[serde(default)]
    pub tables: Vec<tables::TableDef>,
    /// Stages in order.
    pub stages: Vec<StageDef>,
}

/// `source:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceDef {
    /// Topic to consume.
    pub topic: String,
    /// `json` (default), `bytes`, `string` or `{ protobuf: {...} }`.
    #[serde(default)]
    pub format: tables::CodecDef,
}

/// One item of `stages:`, a map with one key naming the stage kind.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageDef {
    /// `- dedup: {...}`
    Dedup(DedupDef),
    /// `- sink: {...}`
    Sink(SinkDef),
    /// `- enrich: {...}` (see [`tables`])
    Enrich(tables::EnrichDef),
    /// `- http: {...}` (external sink, see [`sinks`])
    Http(sinks::HttpDef),
    /// `- postgres: {...}` (external sink)
    Postgres(sinks::PostgresDef),
    /// `- redis: {...}` (external sink)
    Redis(sinks::RedisDef),
    /// `- file: {...}` (external sink)
    File(sinks::FileDef),
}

/// `dedup:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedupDef {
    /// Stage and store name (default `dedup`).
    pub name: Option<String>,
    /// Where the key comes from.
    pub key: KeyDef,
    /// Window, a duration like `24h` or `90s` (default `24h`).
    pub ttl: Option<String>,
    /// `event` (record timestamp, default) or `processing` (wall clock).
    pub time: Option<TimeDef>,
    /// Grace after the TTL before the sweep deletes an entry (default `1h`); the changelog
    /// keeps records for TTL + grace.
    pub grace: Option<String>,
    /// Keys kept per partition at most; past it the oldest are evicted (default unlimited).
    pub max_keys: Option<u64>,
    /// Store a payload hash and count same-key-other-payload as a conflict (default false).
    #[serde(default)]
    pub fingerprint: bool,
    /// `drop` (default), `pass` or `dead_letter`.
    pub on_conflict: Option<ConflictDef>,
}

/// `key:` values.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyDef {
    /// `{ json_pointer: /id }`
    JsonPointer(String),
    /// `{ header: msg-id }`
    Header(String),
    /// `kafka_key`
    KafkaKey,
    /// `value_hash`
    ValueHash,
    /// `{ composite: [ {header: ce_id}, {header: ce_source} ] }`
    Composite(Vec<KeyDef>),
}

/// `time:` values.
#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum TimeDef {
    /// Record timestamp.
    Event,
    /// Wall clock.
    Processing,
}

/// `on_conflict:` values.
#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum ConflictDef {
    /// Let through.
    Pass,
    /// Drop.
    Drop,
    /// Dead-letter.
    DeadLetter,
}

/// `sink:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkDef {
    /// Stage name (default `sink-<topic>`).
    pub name: Option<String>,
    /// Destination topic.
    pub topic: String,
    /// Codec of the topic's values (default: the source's).
    pub format: Option<tables::CodecDef>,
}

impl KeyDef {
    pub(crate) fn compile(&self) -> KeySource {
        match self {
            KeyDef::JsonPointer(p) => KeySource::JsonPointer(p.clone()),
            KeyDef::Header(h) => KeySource::Header(h.clone()),
            KeyDef::KafkaKey => KeySource::KafkaKey,
            KeyDef::ValueHash => KeySource::ValueHash,
            KeyDef::Composite(parts) => {
                KeySource::Composite(parts.iter().map(|p| p.compile()).collect())
            }
        }
    }
}

/// Errors of one topology file, each line naming the file and where.
#[derive(Debug)]
pub struct FileErrors {
    /// The file.
    pub file: String,
    /// One message per problem.
    pub errors: Vec<String>,
}

impl std::fmt::Display for FileErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}: {e}", self.file)?;
        }
        Ok(())
    }
}

impl std::error::Error for FileErrors {}

impl From<FileErrors> for Error {
    fn from(e: FileErrors) -> Self {
        Error::Topology {
            node: e.file.clone(),
            reason: e.errors.join("; "),
        }
    }
}

/// Read and compile a topology file.
///
/// # Errors
/// [`FileErrors`] listing every problem: unreadable file, YAML syntax, unknown fields or
/// stage kinds (with line and column), bad durations, and the builder's validation errors.
pub fn load(path: &Path) -> Result<Topology, FileErrors> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| FileErrors {
        file: file.clone(),
        errors: vec![format!("cannot read: {e}")],
    })?;
    parse(&file, &text)
}

/// Compile topology text; `file` names it in errors.
///
/// # Errors
/// As [`load`].
pub fn parse(file: &str, text: &str) -> Result<Topology, FileErrors> {
    let fail = |errors: Vec<String>| FileErrors {
        file: file.to_string(),
        errors,
    };
    // Stage kinds and key sources are written as one-key maps (`- dedup: {...}`).
    let def: TopologyFile = serde_yaml::with::singleton_map_recursive::deserialize(
        serde_yaml::Deserializer::from_str(text),
    )
    .map_err(|e| fail(vec![e.to_string()]))?;
    let mut errors = Vec::new();
    let base = Path::new(file).parent().unwrap_or(Path::new("."));
    let format = def.source.format.compile(base).unwrap_or_else(|e| {
        errors.push(format!("source: field `format`: {e}"));
        Format::Bytes
    });
    let mut b = TopologyBuilder::new(def.name).source(def.source.topic, format);
    b = tables::add_tables(b, &def.tables, base, &mut errors);
    for (i, st) in def.stages.iter().enumerate() {
        match st {
            StageDef::Dedup(d) => {
                let name = d.name.clone().unwrap_or_else(|| "dedup".into());
                let mut spec = DedupSpec::new(d.key.compile());
                if let Some(ttl) = &d.ttl {
                    match humantime::parse_duration(ttl) {
                        Ok(t) => spec.ttl_ms = t.as_millis().min(i64::MAX as u128) as i64,
                        Err(e) => errors.push(format!(
                            "stages[{i}] (dedup `{name}`): field `ttl`: {ttl:?} is not a duration like 24h or 90s: {e}"
                        )),
                    }
                }
                if let Some(grace) = &d.grace {
                    match humantime::parse_duration(grace) {
                        Ok(t) => spec.grace_ms = t.as_millis().min(i64::MAX as u128) as i64,
                        Err(e) => errors.push(format!(
                            "stages[{i}] (dedup `{name}`): field `grace`: {grace:?} is not a duration like 1h or 0s: {e}"
                        )),
                    }
                }
                spec.time = match d.time {
                    None | Some(TimeDef::Event) => TimeSource::Event,
                    Some(TimeDef::Processing) => TimeSource::Processing,
                };
                spec.fingerprint = d.fingerprint;
                spec.max_keys = d.max_keys;
                spec.on_conflict = match d.on_conflict {
                    None | Some(ConflictDef::Drop) => ConflictPolicy::Drop,
                    Some(ConflictDef::Pass) => ConflictPolicy::Pass,
                    Some(ConflictDef::DeadLetter) => ConflictPolicy::DeadLetter,
                };
                b = b.dedup(name, spec);
            }
            StageDef::Sink(s) => {
                let name = s
                    .name
                    .clone()
                    .unwrap_or_else(|| format!("sink-{}", s.topic));
                b = b.sink(name.clone(), s.topic.clone());
                if let Some(f) = &s.format {
                    match f.compile(base) {
                        Ok(f) => b = b.topic_format(s.topic.clone(), f),
                        Err(e) => {
                            errors.push(format!("stages[{i}] (sink `{name}`): field `format`: {e}"))
                        }
                    }
                }
            }
            StageDef::Enrich(e) => b = tables::add_enrich(b, e),
            StageDef::Http(_) | StageDef::Postgres(_) | StageDef::Redis(_) | StageDef::File(_) => {
                let mut errs = Vec::new();
                let (name, spec) = match st {
                    StageDef::Http(d) => sinks::http(d, &mut errs),
                    StageDef::Postgres(d) => sinks::postgres(d, &mut errs),
                    StageDef::Redis(d) => sinks::redis(d, &mut errs),
                    StageDef::File(d) => sinks::file(d, &mut errs),
                    _ => unreachable!("matched above"),
                };
                errors.extend(
                    errs.into_iter()
                        .map(|e| format!("stages[{i}] (`{name}`): {e}")),
                );
                b = b.external_sink(name, spec);
            }
        }
    }
    match b.build() {
        Ok(t) if errors.is_empty() => Ok(t),
        Ok(_) => Err(fail(errors)),
        Err(es) => {
            for e in es {
                errors.push(match e {
                    Error::Topology { node, reason } => format!("stage `{node}`: {reason}"),
                    other => other.to_string(),
                });
            }
            Err(fail(errors))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_gharchive_topology_compiles() {
        let t = load(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/topologies/gharchive-dedup.yaml"
        )))
        .unwrap();
        assert_eq!(t.source().topic, "gharchive.events");
        assert_eq!(t.sink_topics(), vec!["gharchive.unique".to_string()]);
        assert_eq!(t.stores(), vec!["dedup".to_string()]);
        match &t.stages()[0].kind {
            crate::topology::StageKind::Dedup(d) => {
                assert_eq!(d.key, KeySource::JsonPointer("/id".into()));
                assert_eq!(d.ttl_ms, 24 * 3600 * 1000);
                assert_eq!(d.time, TimeSource::Event);
            }
            other => panic!("first stage should be dedup, is {other:?}"),
        }
    }

    #[test]
    fn errors_name_file_stage_and_field() {
        let cases = [
            (
                "name: t\nsource: {topic: a}\nstages:\n  - dedup: {key: {json_pointer: /id}, ttll: 1h}\n  - sink: {topic: b}\n",
                "t.yaml: stages[0].dedup: unknown field `ttll`, expected one of `name`, `key`, `ttl`, `time`, `grace`, `max_keys`, `fingerprint`, `on_conflict` at line 4 column 39",
            ),
            (
                "name: t\nsource: {topic: a}\nstages:\n  - dedup: {name: d, key: {json_pointer: /id}, ttl: 2 parsecs}\n  - sink: {topic: b}\n",
                "t.yaml: stages[0] (dedup `d`): field `ttl`: \"2 parsecs\" is not a duration like 24h or 90s: unknown time unit \"parsecs\", supported units: ns, us/µs, ms, sec, min, hours, days, weeks, months, years (and few variations)",
            ),
            (
                "name: t\nsource: {topic: a}\nstages:\n  - map: {}\n",
                "t.yaml: stages[0]: unknown variant `map`, expected one of `dedup`, `sink`, `enrich`, `http`, `postgres`, `redis`, `file` at line 4 column 5",
            ),
            (
                "name: t\nsource: {topic: a, format: bytes}\nstages:\n  - dedup: {key: {json_pointer: /id}}\n",
                "t.yaml: stage `dedup`: field `key`: json pointer /id needs a json source, but the source format is bytes\nt.yaml: stage `stages`: a topology needs at least one sink",
            ),
        ];
        for (text, want) in cases {
            let got = parse("t.yaml", text).unwrap_err().to_string();
            assert_eq!(got, want);
        }
    }
}
