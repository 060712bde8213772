//! Topology files (YAML or TOML) compiled to [`TopologyBuilder`] calls.
//!
//! ```yaml
//! name: gharchive-dedup
//! source: { topic: gharchive.events, format: json }
//! stages:
//!   - filter: { name: pushes, when: 'value.type == "PushEvent"' }
//!   - map:
//!       name: shape
//!       rename: { actor: user }            # a field name, or a JSON pointer (/a/b)
//!       set: { repo: 'value.repo.name' }   # computed fields: CEL expressions
//!       drop: [payload]
//!   - dedup: { name: dedup, key: { json_pointer: /id }, ttl: 24h, duplicates_to: gh.dups }
//!   - route:
//!       routes: [ { when: 'value.public', to: gh.public } ]
//!       default: gh.private
//!   - sink: { topics: [a, b], key: 'value.repo', headers: { kind: 'value.type' } }
//! ```
//!
//! Lookup tables and codecs (the enrichment side of the language):
//!
//! ```yaml
//! source: { topic: orders, format: { protobuf: { descriptor_set: shop.desc, message: shop.Order } } }
//! tables:
//!   - { name: customers, topic: customers, format: json }
//! stages:
//!   - enrich: { name: join, table: customers, key: { json_pointer: /customer_id }, into: /customer, on_missing: dead_letter }
//!   - sink: { topic: orders.enriched, format: json }
//! ```
//!
//! `format` is `json` (default), `bytes`, `string` or `{ protobuf: { descriptor_set,
//! message } }`, a descriptor set path being relative to the topology file's directory.
//!
//! The same document in TOML uses `[source]` and one `[[stages]]` table per stage
//! (`[stages.filter]` ...). A file whose name ends in `.toml` is read as TOML, any other as
//! YAML. Expressions are CEL (`processor::expr`).
//!
//! Each stage kind's fields are read by its module under `topology::stage` (external
//! sinks: `topology/stage/external.rs`, with the `http`, `postgres`, `redis` and `file` keys), with the
//! located readers of `crate::schema` (strings, durations, expressions, keys, codecs), so
//! that every field of every kind is reported at its own line and column.
//!
//! Validation happens before anything connects, and every problem is reported, not only
//! the first: unknown fields, wrong types, unknown stage kinds, missing fields, duplicate
//! stage names, expressions that do not parse, bad topic names, and the builder's checks.
//! Each error reads ``file:line:column: WHERE, field `FIELD`: WHAT``, where WHERE names
//! the stage (``stage `dedup` (dedup)``) or the top-level section.

mod compile;

use crate::error::Error;
use crate::schema::node::{self, Node, Pos, Val};
use crate::schema::{Located, Reader};
use crate::topology::{Format, StageKind, TableSpec, Topology, TopologyBuilder};
use std::collections::HashMap;
use std::path::Path;

/// Errors of one topology file, one line each, every line naming file, line and column.
#[derive(Debug)]
pub struct FileErrors {
    /// The file.
    pub file: String,
    /// One message per problem, each starting with `file:line:column:` (or `file:` when
    /// the file could not be read).
    pub errors: Vec<String>,
}

impl std::fmt::Display for FileErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.errors.join("\n"))
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

/// Read and compile a topology file (`.toml`: TOML, otherwise YAML).
///
/// # Errors
/// [`FileErrors`] listing every problem: an unreadable file, a syntax error, and all
/// validation errors (see the module docs).
pub fn load(path: &Path) -> Result<Topology, FileErrors> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| FileErrors {
        file: file.clone(),
        errors: vec![format!("{file}: cannot read: {e}")],
    })?;
    let text = String::from_utf8(bytes).map_err(|e| FileErrors {
        file: file.clone(),
        errors: vec![not_utf8(&file, e.as_bytes(), e.utf8_error())],
    })?;
    parse(&file, &text)
}

/// `file:line:column: ...` naming the first byte of `bytes` that is not UTF-8 (lines and
/// columns from 1, the column counting characters).
fn not_utf8(file: &str, bytes: &[u8], e: std::str::Utf8Error) -> String {
    let at = e.valid_up_to();
    let valid = std::str::from_utf8(&bytes[..at]).unwrap_or_default();
    let line = valid.matches('\n').count() + 1;
    let column = valid.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!(
        "{file}:{line}:{column}: the file is not UTF-8 (byte 0x{:02X}); save it as UTF-8",
        bytes[at]
    )
}

/// Compile topology text; `file` names it in errors, and a name ending in `.toml` selects
/// TOML (otherwise YAML).
///
/// # Errors
/// As [`load`]. Never panics, whatever the text.
pub fn parse(file: &str, text: &str) -> Result<Topology, FileErrors> {
    let root = if file.ends_with(".toml") {
        node::load_toml(text)
    } else {
        node::load_yaml(text)
    };
    let root = root.map_err(|e| FileErrors {
        file: file.to_string(),
        errors: vec![format!("{file}:{}: {}", e.pos, e.message)],
    })?;
    let mut c = Compiler {
        r: Reader::new(
            Path::new(file)
                .parent()
                .unwrap_or(Path::new("."))
                .to_path_buf(),
        ),
        stage_pos: Vec::new(),
        top_pos: HashMap::new(),
        builder_index: Vec::new(),
        top_place: HashMap::new(),
        incomplete: false,
        source_failed: false,
        name_failed: false,
    };
    let built = c.topology(&root);
    let mut errors = c.r.errors;
    if let Some(b) = built {
        match b.build_detailed() {
            Ok(t) if errors.is_empty() => return Ok(t),
            Ok(_) => {}
            Err(es) => {
                for e in es {
                    let consequence = match (e.stage, e.node.as_str()) {
                        (None, "stages") => c.incomplete,
                        (None, "source") => c.source_failed,
                        (None, "topology") => c.name_failed,
                        _ => false,
                    };
                    if consequence {
                        // Follows from an error already reported.
                        continue;
                    }
                    let mut field = e.field.clone();
                    let (pos, place) = match e.stage {
                        Some(i) => {
                            let (stage_pos, label, fields) = &c.stage_pos[c.builder_index[i]];
                            // A sink's topics are checked under the name `topic`; name the
                            // field as the file wrote it.
                            if field.as_deref() == Some("topic")
                                && !fields.contains_key("topic")
                                && fields.contains_key("topics")
                            {
                                field = Some("topics".to_string());
                            }
                            let pos = field
                                .as_deref()
                                .and_then(|f| field_pos(fields, f))
                                .unwrap_or(*stage_pos);
                            (pos, label.clone())
                        }
                        None => {
                            let pos = e
                                .field
                                .as_deref()
                                .and_then(|f| c.top_pos.get(&format!("{}.{f}", e.node)).copied())
                                .or_else(|| c.top_pos.get(&e.node).copied())
                                .unwrap_or(root.pos);
                            let place = c.top_place.get(&e.node).cloned().unwrap_or(e.node.clone());
                            (pos, place)
                        }
                    };
                    errors.push(Located {
                        pos,
                        place,
                        field,
                        message: e.reason,
                    });
                }
            }
        }
    }
    errors.sort_by_key(|e| e.pos);
    Err(FileErrors {
        file: file.to_string(),
        errors: errors.iter().map(|e| e.render(file)).collect(),
    })
}

/// Where field `field` of a stage is: its own noted position, else its parent's
/// (`idempotency.lease` -> `idempotency`, `params[1]` -> `params`).
fn field_pos(fields: &HashMap<String, Pos>, field: &str) -> Option<Pos> {
    let mut f = field;
    loop {
        if let Some(p) = fields.get(f) {
            return Some(*p);
        }
        f = match f.rfind(['.', '[']) {
            Some(i) => &f[..i],
            None => return None,
        };
    }
}

/// Walks the document, collecting every error with its position; it reads fields with its
/// [`Reader`] (which it derefs to), as the stage kinds do.
struct Compiler {
    /// The typed field readers and the problems found.
    r: Reader,
    /// Per stage: its position, its label in messages, and its fields' positions.
    stage_pos: Vec<(Pos, String, HashMap<String, Pos>)>,
    /// Positions of top-level things, by `section` or `section.field`.
    top_pos: HashMap<String, Pos>,
    /// Labels of top-level nodes the builder names (`table x` -> "table `x`").
    top_place: HashMap<String, String>,
    /// For each stage given to the builder, its index in the file.
    builder_index: Vec<usize>,
    /// Some stage did not compile (or `stages` is missing): "no sink" is not reported.
    incomplete: bool,
    /// `source` did not compile: the builder's source errors are not reported.
    source_failed: bool,
    /// `name` did not compile: the builder's name error is not reported.
    name_failed: bool,
}

impl std::ops::Deref for Compiler {
    type Target = Reader;
    fn deref(&self) -> &Reader {
        &self.r
    }
}

impl std::ops::DerefMut for Compiler {
    fn deref_mut(&mut self) -> &mut Reader {
        &mut self.r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::key::KeySource;
    use crate::sink::{EffectSpec, KeyRule, StoreSpec};

    /// A file that is not UTF-8 is refused at the line and column of its first bad byte
    /// (found by a review helper: the error named no place).
    #[test]
    fn a_file_that_is_not_utf8_names_where() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("latin1.yaml");
        std::fs::write(&f, b"name: t\nsource: { topic: caf\xe9 }\n").unwrap();
        let e = load(&f).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "{}:2:21: the file is not UTF-8 (byte 0xE9)",
                f.display()
            )),
            "{e}"
        );
        std::fs::write(&f, b"\xff").unwrap();
        let e = load(&f).unwrap_err().to_string();
        assert!(e.contains(":1:1: the file is not UTF-8 (byte 0xFF)"), "{e}");
    }

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
            StageKind::Dedup(d) => {
                assert_eq!(d.key, KeySource::JsonPointer("/id".into()));
                assert_eq!(d.ttl_ms, 24 * 3600 * 1000);
                assert_eq!(d.time, crate::processor::stages::TimeSource::Event);
            }
            other => panic!("first stage should be dedup, is {other:?}"),
        }
    }

    #[test]
    fn errors_name_file_line_column_stage_and_field() {
        let cases = [
            (
                "name: t\nsource: {topic: a}\nstages:\n  - dedup: {key: {json_pointer: /id}, ttll: 1h}\n  - sink: {topic: b}\n",
                "t.yaml:4:39: stage `dedup` (dedup), field `ttll`: unknown field, did you mean `ttl`? expected one of name, key, ttl, time, grace, max_keys, fingerprint, on_conflict, duplicates_to, partitioning",
            ),
            (
                "name: t\nsource: {topic: a}\nstages:\n  - dedup: {name: d, key: {json_pointer: /id}, ttl: 2 parsecs}\n  - sink: {topic: b}\n",
                "t.yaml:4:53: stage `d` (dedup), field `ttl`: \"2 parsecs\" is not a duration such as 24h or 90s: unknown time unit \"parsecs\", supported units: ns, us/µs, ms, sec, min, hours, days, weeks, months, years (and few variations)",
            ),
            (
                "name: t\nsource: {topic: a}\nstages:\n  - mapp: {}\n",
                "t.yaml:4:5: stage #1: unknown stage kind `mapp`, did you mean `map`? expected one of dedup, enrich, file, filter, http, map, postgres, redis, route, sink",
            ),
            (
                "name: t\nsource: {topic: a, format: bytes}\nstages:\n  - dedup: {key: {json_pointer: /id}}\n",
                "t.yaml:3:1: stages: a topology needs at least one sink, route or external sink\nt.yaml:4:18: stage `dedup` (dedup), field `key`: json pointer /id needs a json source, but the source format is bytes",
            ),
        ];
        for (text, want) in cases {
            let got = parse("t.yaml", text).unwrap_err().to_string();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn a_duration_past_100_years_is_an_error_not_an_overflow() {
        for (text, field) in [
            (
                "  - http: {url: 'http://127.0.0.1:1/', timeout: 100000000000y, retries: 10}\n",
                "timeout",
            ),
            (
                "  - file: {path: /tmp/x, idempotency: {lease: 400000000000y}}\n",
                "idempotency.lease",
            ),
            (
                "  - dedup: {key: kafka_key, ttl: 101y}\n  - sink: {topic: b}\n",
                "ttl",
            ),
        ] {
            let text = format!("name: t\nsource: {{topic: a}}\nstages:\n{text}");
            let e = parse("t.yaml", &text).unwrap_err().to_string();
            assert!(
                e.contains(&format!("field `{field}`: ")) && e.contains("100 years"),
                "{e}"
            );
        }
        // Long but sane: accepted, and the lease check's sum does not overflow.
        let text = "name: t\nsource: {topic: a}\nstages:\n  - http: {url: 'http://127.0.0.1:1/', timeout: 99y, retries: 4000000000, idempotency: {lease: 1s}}\n";
        let e = parse("t.yaml", text).unwrap_err().to_string();
        assert!(e.contains("idempotency.lease"), "{e}");
    }

    #[test]
    fn sink_settings_that_would_be_ignored_or_fail_later_stop_start_up() {
        let stage = |s: &str| format!("name: t\nsource: {{topic: a}}\nstages:\n  - {s}\n");
        for (text, want) in [
            (
                "file: {path: /tmp/x, idempotency: {url: 'redis://127.0.0.1:6379'}}",
                "field `idempotency.url`: belongs to store redis, but the store is sled",
            ),
            (
                "file: {path: /tmp/x, idempotency: {ttl: 0s}}",
                "field `idempotency.ttl`: must be positive",
            ),
            (
                "http: {url: 'http://127.0.0.1:1/', headers: {'Bad Header': x}, idempotency: {store: none}}",
                "field `headers.Bad Header`: \"Bad Header\" is not a valid header name",
            ),
        ] {
            let e = parse("t.yaml", &stage(text)).unwrap_err().to_string();
            assert!(e.contains(want), "{e}\n  lacks\n{want}");
        }
        // Checked when starting: a file path that does not open, a sled path that is a file.
        let file = tempfile::NamedTempFile::new().unwrap();
        for (text, want) in [
            (
                "file: {path: /nonexistent-dir/out.jsonl, idempotency: {store: none}}".to_string(),
                "field `path`: cannot open /nonexistent-dir/out.jsonl for appending",
            ),
            (
                format!(
                    "file: {{path: {}, idempotency: {{store: sled, path: {}}}}}",
                    file.path().display(),
                    file.path().display()
                ),
                "field `idempotency.path`: ",
            ),
        ] {
            let t = parse("t.yaml", &stage(&text)).unwrap();
            let e = t.preflight().unwrap_err().to_string();
            assert!(e.contains(want), "{e}\n  lacks\n{want}");
        }
    }

    #[test]
    fn a_misspelt_name_gets_the_nearest_known_one() {
        let text = "name: t\nsource: {topic: a, format: jsn}\nstages:\n  - dedup: {key: {json_pointr: /id}, time: evnt}\n  - sink: {topic: b}\n";
        let e = parse("t.yaml", text).unwrap_err().to_string();
        for want in [
            "field `format`: unknown format \"jsn\", did you mean `json`? expected one of",
            "field `key`: unknown key source `json_pointr`, did you mean `json_pointer`? expected one of",
            "field `time`: unknown value \"evnt\", did you mean `event`? expected one of event, processing",
        ] {
            assert!(e.contains(want), "{e}\n  lacks\n{want}");
        }
        // No hint when nothing is near.
        let text = "name: t\nsource: {topic: a}\nstages:\n  - dedup: {key: kafka_key, colour: red}\n  - sink: {topic: b}\n";
        let e = parse("t.yaml", text).unwrap_err().to_string();
        assert!(
            e.contains("field `colour`: unknown field, expected one of"),
            "{e}"
        );
    }

    // External sinks (`topology/stage/external.rs`): read with positions, described
    // without secrets.

    #[test]
    fn sink_stages_compile_and_describe_without_secrets() {
        let text = r#"
name: t
source: { topic: orders }
stages:
  - dedup: { key: { json_pointer: /id } }
  - http:
      name: notify
      url: { env: HOOK_URL }
      headers: { Authorization: { env: HOOK_TOKEN }, X-Plain: "visible" }
      idempotency: { store: redis, url: { env: ONCEFLOW_REDIS_URL }, in_flight: raise }
  - postgres: { url: "postgres://u:hunter2@h/db", sql: "INSERT INTO t VALUES ($1)", params: ["{value./id}"] }
  - file: { path: /tmp/x.jsonl, idempotency: { key: "{topic}-{offset}", store: none } }
"#;
        let t = parse("t.yaml", text).unwrap();
        let d = t.describe();
        assert!(!d.contains("hunter2"), "{d}");
        assert!(
            d.contains("env:HOOK_URL") && d.contains("Authorization=env:HOOK_TOKEN"),
            "{d}"
        );
        let StageKind::External(h) = &t.stages()[1].kind else {
            panic!()
        };
        assert!(matches!(h.resolved_key, Some(KeyRule::Dedup(_))));
        assert!(matches!(h.store, StoreSpec::Redis { .. }));
        let StageKind::External(p) = &t.stages()[2].kind else {
            panic!()
        };
        assert!(matches!(p.effect, EffectSpec::Postgres(_)));
        assert_eq!(
            p.store,
            StoreSpec::Postgres {
                table: "onceflow_inbox".into()
            }
        );
        assert_eq!(t.json_pointers(), vec!["/id".to_string()]);
    }

    #[test]
    fn bad_templates_fail_validation() {
        let text = r#"
name: t
source: { topic: orders, format: bytes }
stages:
  - http: { url: "http://x", idempotency: { key: "{value./order_id}" } }
  - redis: { url: "redis://x", command: [SET, "{nope}"], idempotency: { store: redisx } }
"#;
        let e = parse("t.yaml", text).unwrap_err().to_string();
        // The key template is placed at `idempotency.key` itself.
        assert!(e.contains("t.yaml:5:50: stage `http` (http), field `key`: template \"{value./order_id}\" reads field /order_id, but the source format is bytes"), "{e}");
        assert!(e.contains("unknown placeholder {nope}"), "{e}");
        assert!(
            e.contains("t.yaml:6:80: stage `redis` (redis), field `idempotency.store`: \"redisx\"; use sled, redis, postgres or none"),
            "{e}"
        );
    }

    #[test]
    fn external_fields_are_located() {
        let text = r#"
name: t
source: { topic: orders }
stages:
  - http:
      url: 42
      timeout: soon
      idempotency: { lease: 1s, colour: red }
  - file: { line: "{value}" }
"#;
        let e = parse("t.yaml", text).unwrap_err().to_string();
        let want = [
            "t.yaml:6:12: stage `http` (http), field `url`: expected a string or { env: VAR }, found an integer",
            "t.yaml:7:16: stage `http` (http), field `timeout`: \"soon\" is not a duration such as 24h or 90s",
            "t.yaml:8:33: stage `http` (http), field `idempotency.colour`: unknown field, expected one of",
            "t.yaml:9:11: stage `file` (file), field `path`: missing field",
        ];
        let lines: Vec<&str> = e.lines().collect();
        assert_eq!(lines.len(), want.len(), "{e}");
        for (got, want) in lines.iter().zip(want) {
            assert!(
                got.starts_with(want),
                "{got}\n  does not start with\n{want}"
            );
        }
    }

    #[test]
    fn a_postgres_sink_reads_its_timeout_and_refuses_zero() {
        let sink = |t: &str| {
            format!(
                "name: t\nsource: {{topic: a}}\nstages:\n  - postgres: {{url: \"postgres://x@h/d\", sql: \"SELECT 1\"{t}}}\n"
            )
        };
        let d = parse("t.yaml", &sink(", timeout: 2s")).unwrap().describe();
        assert!(d.contains("timeout=2s"), "{d}");
        let d = parse("t.yaml", &sink("")).unwrap().describe();
        assert!(d.contains("timeout=30s"), "the default: {d}");
        let e = parse("t.yaml", &sink(", timeout: 0s"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("field `timeout`: must be positive"), "{e}");
        // A sled store's lease must outlast store_retry_for (30 s) + 3 x timeout.
        let lease = ", idempotency: {key: \"{value./id}\", store: sled, lease: 1m}";
        let e = parse("t.yaml", &sink(lease)).unwrap_err().to_string();
        assert!(
            e.contains("field `idempotency.lease`: 60s is not longer"),
            "{e}"
        );
        assert!(parse("t.yaml", &sink(&format!("{lease}, timeout: 5s"))).is_ok());
    }

    #[test]
    fn an_external_sink_field_out_of_range_is_an_error() {
        let text = "name: t\nsource: {topic: a}\nstages:\n  - http: {url: \"http://x\", retries: 99999999999}\n";
        let e = parse("t.yaml", text).unwrap_err().to_string();
        assert_eq!(
            e,
            "t.yaml:4:38: stage `http` (http), field `retries`: 99999999999 retries is too many"
        );
    }
}
