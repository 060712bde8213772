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
//! YAML. Expressions are CEL (see [`crate::processor::expr`]).
//!
//! Validation happens before anything connects, and every problem is reported, not only
//! the first: unknown fields, wrong types, unknown stage kinds, missing fields, duplicate
//! stage names, expressions that do not parse, bad topic names, and the builder's checks.
//! Each error reads `file:line:column: <where>, field `<field>`: <what>`, where `<where>`
//! names the stage (`stage `dedup` (dedup)`) or the top-level section.

pub mod node;
pub mod sinks;

use crate::error::Error;
use crate::processor::expr::{BytesFn, Computed, Predicate};
use crate::processor::key::KeySource;
use crate::processor::route::{RouteBranch, RouteSpec};
use crate::processor::stages::{ConflictPolicy, DedupSpec, Partitioning, SinkSpec, TimeSource};
use crate::processor::transform::{FilterSpec, MapSpec};
use crate::topology::{
    EnrichSpec, Format, MissingPolicy, ProtoFormat, StageKind, TableSpec, Topology, TopologyBuilder,
};
use node::{Node, Pos, Val};
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
    let text = std::fs::read_to_string(path).map_err(|e| FileErrors {
        file: file.clone(),
        errors: vec![format!("{file}: cannot read: {e}")],
    })?;
    parse(&file, &text)
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
        base: Path::new(file)
            .parent()
            .unwrap_or(Path::new("."))
            .to_path_buf(),
        errors: Vec::new(),
        stage_pos: Vec::new(),
        top_pos: HashMap::new(),
        builder_index: Vec::new(),
        top_place: HashMap::new(),
        incomplete: false,
        source_failed: false,
        name_failed: false,
    };
    let built = c.topology(&root);
    let mut errors = c.errors;
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
                                .and_then(|f| fields.get(f).copied())
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

/// One problem found in a file.
struct Located {
    pos: Pos,
    place: String,
    field: Option<String>,
    message: String,
}

impl Located {
    fn render(&self, file: &str) -> String {
        match &self.field {
            Some(f) => format!(
                "{file}:{}: {}, field `{f}`: {}",
                self.pos, self.place, self.message
            ),
            None => format!("{file}:{}: {}: {}", self.pos, self.place, self.message),
        }
    }
}

/// The stage kinds a file may use.
const STAGE_KINDS: [&str; 10] = [
    "dedup", "enrich", "file", "filter", "http", "map", "postgres", "redis", "route", "sink",
];

/// External sink kinds (see [`sinks`]): read with their own serde definitions.
const EXTERNAL_KINDS: [&str; 4] = ["file", "http", "postgres", "redis"];

/// A node as JSON, for the serde definitions of external sinks.
fn to_json(n: &Node) -> serde_json::Value {
    use serde_json::Value as J;
    match &n.val {
        Val::Null => J::Null,
        Val::Bool(b) => J::Bool(*b),
        Val::Int(i) => J::from(*i),
        Val::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        Val::Str(s) => J::String(s.clone()),
        Val::Seq(items) => J::Array(items.iter().map(to_json).collect()),
        Val::Map(es) => J::Object(es.iter().map(|(k, _, v)| (k.clone(), to_json(v))).collect()),
    }
}

/// A map's fields, after the unknown ones were reported.
struct Fields<'a> {
    pos: Pos,
    entries: Vec<(&'a str, Pos, &'a Node)>,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Node> {
        self.entries
            .iter()
            .find(|(k, _, _)| *k == name)
            .map(|(_, _, n)| *n)
    }
}

/// Walks the document, collecting every error with its position.
struct Compiler {
    /// The file's directory: descriptor set paths are relative to it.
    base: std::path::PathBuf,
    errors: Vec<Located>,
    /// Per stage: its position, its label in messages, and its fields' positions.
    stage_pos: Vec<(Pos, String, HashMap<&'static str, Pos>)>,
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

fn list(names: &[&str]) -> String {
    names.join(", ")
}

impl Compiler {
    fn err(&mut self, pos: Pos, place: &str, field: Option<&str>, message: impl Into<String>) {
        self.errors.push(Located {
            pos,
            place: place.to_string(),
            field: field.map(str::to_string),
            message: message.into(),
        });
    }

    /// Report a value of the wrong type: "expected `what`, found <its type>".
    fn wrong_type(&mut self, pos: Pos, place: &str, field: Option<&str>, what: &str, found: &Val) {
        self.err(
            pos,
            place,
            field,
            format!("expected {what}, found {}", found.type_name()),
        );
    }

    /// `node` as a map with only `allowed` fields (unknown ones are reported).
    fn fields<'a>(
        &mut self,
        node: &'a Node,
        place: &str,
        field: Option<&str>,
        allowed: &[&str],
    ) -> Option<Fields<'a>> {
        let Val::Map(entries) = &node.val else {
            self.wrong_type(node.pos, place, field, "a map", &node.val);
            return None;
        };
        let mut out = Fields {
            pos: node.pos,
            entries: Vec::new(),
        };
        for (k, kpos, v) in entries {
            if allowed.contains(&k.as_str()) {
                out.entries.push((k.as_str(), *kpos, v));
            } else {
                self.err(
                    *kpos,
                    place,
                    Some(k),
                    format!("unknown field, expected one of {}", list(allowed)),
                );
            }
        }
        Some(out)
    }

    fn required<'a>(&mut self, f: &Fields<'a>, name: &str, place: &str) -> Option<&'a Node> {
        let n = f.get(name);
        if n.is_none() {
            self.err(f.pos, place, Some(name), "missing field");
        }
        n
    }

    fn string(&mut self, n: &Node, place: &str, field: &str) -> Option<String> {
        match &n.val {
            Val::Str(s) => Some(s.clone()),
            other => {
                self.wrong_type(n.pos, place, Some(field), "a string", other);
                None
            }
        }
    }

    fn duration_ms(&mut self, n: &Node, place: &str, field: &str) -> Option<i64> {
        let Val::Str(s) = &n.val else {
            self.wrong_type(
                n.pos,
                place,
                Some(field),
                "a duration such as 24h or 90s",
                &n.val,
            );
            return None;
        };
        match humantime::parse_duration(s) {
            Ok(d) => Some(d.as_millis().min(i64::MAX as u128) as i64),
            Err(e) => {
                self.err(
                    n.pos,
                    place,
                    Some(field),
                    format!("{s:?} is not a duration such as 24h or 90s: {e}"),
                );
                None
            }
        }
    }

    fn choice(&mut self, n: &Node, place: &str, field: &str, allowed: &[&str]) -> Option<String> {
        let s = self.string(n, place, field)?;
        if allowed.contains(&s.as_str()) {
            Some(s)
        } else {
            self.err(
                n.pos,
                place,
                Some(field),
                format!("unknown value {s:?}, expected one of {}", list(allowed)),
            );
            None
        }
    }

    /// An expression: a string (or a bool or number, taken as its text).
    fn expr_text(&mut self, n: &Node, place: &str, field: &str) -> Option<String> {
        match &n.val {
            Val::Str(s) => Some(s.clone()),
            Val::Bool(b) => Some(b.to_string()),
            Val::Int(i) => Some(i.to_string()),
            Val::Float(f) => Some(f.to_string()),
            other => {
                self.wrong_type(n.pos, place, Some(field), "an expression (a string)", other);
                None
            }
        }
    }

    fn func<T: crate::processor::expr::FromCel>(
        &mut self,
        n: &Node,
        place: &str,
        field: &str,
    ) -> Option<crate::processor::expr::Func<T>> {
        let text = self.expr_text(n, place, field)?;
        match crate::processor::expr::Func::<T>::expr(&text) {
            Ok(f) => Some(f),
            Err(e) => {
                self.err(n.pos, place, Some(field), e);
                None
            }
        }
    }

    /// A field path: a JSON pointer (`/a/b`) or a top-level field name.
    fn field_path(&mut self, text: &str, pos: Pos, place: &str, field: &str) -> Option<String> {
        if text.is_empty() {
            self.err(pos, place, Some(field), "a field name must not be empty");
            return None;
        }
        if text.starts_with('/') {
            return Some(text.to_string());
        }
        Some(format!("/{}", text.replace('~', "~0").replace('/', "~1")))
    }

    fn topology(&mut self, root: &Node) -> Option<TopologyBuilder> {
        let f = self.fields(
            root,
            "top level",
            None,
            &["name", "source", "tables", "stages"],
        )?;
        for (k, p, _) in &f.entries {
            self.top_pos.insert(format!("topology.{k}"), *p);
            self.top_pos.insert(k.to_string(), *p);
        }
        let name = self
            .required(&f, "name", "top level")
            .and_then(|n| self.string(n, "top level", "name"));
        self.name_failed = name.is_none();
        let source = self
            .required(&f, "source", "top level")
            .and_then(|n| self.source(n));
        self.source_failed = source.is_none();
        let mut stages = Vec::new();
        self.incomplete = true;
        if let Some(sn) = self.required(&f, "stages", "top level") {
            match &sn.val {
                Val::Seq(items) => {
                    self.incomplete = false;
                    for (i, item) in items.iter().enumerate() {
                        stages.push(self.stage(i, item));
                    }
                }
                other => self.err(
                    sn.pos,
                    "top level",
                    Some("stages"),
                    format!("expected a list of stages, found {}", other.type_name()),
                ),
            }
        }
        let mut b = TopologyBuilder::new(name.unwrap_or_default());
        if let Some((topic, format)) = source {
            b = b.source(topic, format);
        }
        if let Some(tn) = f.get("tables") {
            match &tn.val {
                Val::Seq(items) => {
                    for (i, item) in items.iter().enumerate() {
                        if let Some(t) = self.table(i, item) {
                            b = b.table(t);
                        }
                    }
                }
                other => self.err(
                    tn.pos,
                    "top level",
                    Some("tables"),
                    format!("expected a list of tables, found {}", other.type_name()),
                ),
            }
        }
        // The stages that compiled go to the builder, so its checks (duplicate names, topic
        // names, ...) are reported with the file's own errors.
        for (i, st) in stages.into_iter().enumerate() {
            match st {
                Some((name, kind, format)) => {
                    self.builder_index.push(i);
                    if let (Some(f), StageKind::Sink(k)) = (format, &kind) {
                        for t in &k.topics {
                            b = b.topic_format(t.clone(), f.clone());
                        }
                    }
                    b = b.stage(name, kind);
                }
                None => self.incomplete = true,
            }
        }
        Some(b)
    }

    /// A codec: `json`, `bytes`, `string` or `{ protobuf: { descriptor_set, message } }`.
    fn codec(&mut self, n: &Node, place: &str, field: &str) -> Option<Format> {
        const NAMES: [&str; 4] = [
            "json",
            "bytes",
            "string",
            "{ protobuf: { descriptor_set, message } }",
        ];
        match &n.val {
            Val::Str(s) if s == "json" => Some(Format::Json),
            Val::Str(s) if s == "bytes" => Some(Format::Bytes),
            Val::Str(s) if s == "string" => Some(Format::String),
            Val::Map(es) if es.len() == 1 && es[0].0 == "protobuf" => {
                let inner = &es[0].2;
                let f = self.fields(inner, place, Some(field), &["descriptor_set", "message"])?;
                let ds = self
                    .required(&f, "descriptor_set", place)
                    .and_then(|n| self.string(n, place, "descriptor_set"));
                let msg = self
                    .required(&f, "message", place)
                    .and_then(|n| self.string(n, place, "message"));
                let (ds, msg) = (ds?, msg?);
                match ProtoFormat::from_file(self.base.join(&ds), &msg) {
                    Ok(p) => Some(Format::Protobuf(p)),
                    Err(e) => {
                        self.err(inner.pos, place, Some(field), e.to_string());
                        None
                    }
                }
            }
            Val::Str(s) => {
                self.err(
                    n.pos,
                    place,
                    Some(field),
                    format!("unknown format {s:?}, expected one of {}", list(&NAMES)),
                );
                None
            }
            other => {
                self.err(
                    n.pos,
                    place,
                    Some(field),
                    format!(
                        "expected one of {}, found {}",
                        list(&NAMES),
                        other.type_name()
                    ),
                );
                None
            }
        }
    }

    /// An external sink stage, read with its serde definition (see [`sinks`]); its errors
    /// are placed at the stage.
    fn external(&mut self, kind: &str, body: &Node, place: &str) -> Option<(String, StageKind)> {
        fn read<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, String> {
            serde_json::from_value(v).map_err(|e| e.to_string())
        }
        let v = to_json(body);
        let mut errs = Vec::new();
        let built = match kind {
            "http" => read::<sinks::HttpDef>(v).map(|d| sinks::http(&d, &mut errs)),
            "postgres" => read::<sinks::PostgresDef>(v).map(|d| sinks::postgres(&d, &mut errs)),
            "redis" => read::<sinks::RedisDef>(v).map(|d| sinks::redis(&d, &mut errs)),
            _ => read::<sinks::FileDef>(v).map(|d| sinks::file(&d, &mut errs)),
        };
        let (name, spec) = match built {
            Ok(x) => x,
            Err(e) => {
                self.err(body.pos, place, None, e);
                return None;
            }
        };
        for e in errs {
            let (field, msg) = match e.strip_prefix("field `").and_then(|r| r.split_once("`: ")) {
                Some((f, m)) => (Some(f.to_string()), m.to_string()),
                None => (None, e),
            };
            self.errors.push(Located {
                pos: body.pos,
                place: place.to_string(),
                field,
                message: msg,
            });
        }
        Some((name, StageKind::External(Box::new(spec))))
    }

    /// One item of `tables:`.
    fn table(&mut self, i: usize, item: &Node) -> Option<TableSpec> {
        let anon = format!("table #{}", i + 1);
        let name = match &item.val {
            Val::Map(es) => es
                .iter()
                .find(|(k, _, _)| k == "name")
                .and_then(|(_, _, n)| match &n.val {
                    Val::Str(s) => Some(s.clone()),
                    _ => None,
                }),
            _ => None,
        };
        let place = name.as_ref().map_or(anon, |n| format!("table `{n}`"));
        let f = self.fields(item, &place, None, &["name", "topic", "format"])?;
        if let Some(n) = &name {
            // The builder names a table's errors `table <name>`.
            self.top_pos.insert(format!("table {n}"), f.pos);
            for (k, _, v) in &f.entries {
                self.top_pos.insert(format!("table {n}.{k}"), v.pos);
            }
            self.top_place.insert(format!("table {n}"), place.clone());
        }
        let name = self
            .required(&f, "name", &place)
            .and_then(|n| self.string(n, &place, "name"));
        let topic = self
            .required(&f, "topic", &place)
            .and_then(|n| self.string(n, &place, "topic"));
        let format = match f.get("format") {
            None => Some(Format::Json),
            Some(n) => self.codec(n, &place, "format"),
        };
        Some(TableSpec::new(name?, topic?).format(format?))
    }

    fn enrich(&mut self, f: &Fields<'_>, place: &str) -> Option<EnrichSpec> {
        let table = self
            .required(f, "table", place)
            .and_then(|n| self.string(n, place, "table"));
        let key = self
            .required(f, "key", place)
            .and_then(|n| self.key(n, place));
        let into = match f.get("into") {
            None => table.as_ref().map(|t| format!("/{t}")),
            Some(n) => self.string(n, place, "into"),
        };
        let policy = match f.get("on_missing") {
            None => Some(MissingPolicy::Pass),
            Some(n) => self
                .choice(n, place, "on_missing", &["drop", "pass", "dead_letter"])
                .map(|s| match s.as_str() {
                    "drop" => MissingPolicy::Drop,
                    "dead_letter" => MissingPolicy::DeadLetter,
                    _ => MissingPolicy::Pass,
                }),
        };
        Some(EnrichSpec::new(table?, key?, into?).on_missing(policy?))
    }

    fn source(&mut self, n: &Node) -> Option<(String, Format)> {
        let place = "source";
        self.top_pos.insert("source".into(), n.pos);
        let f = self.fields(n, place, None, &["topic", "format"])?;
        for (k, _, v) in &f.entries {
            self.top_pos.insert(format!("source.{k}"), v.pos);
        }
        let topic = self
            .required(&f, "topic", place)
            .and_then(|n| self.string(n, place, "topic"));
        let format = match f.get("format") {
            None => Some(Format::Json),
            Some(n) => self.codec(n, place, "format"),
        };
        Some((topic?, format?))
    }

    /// One item of `stages:`. Always records the stage's position (so builder errors can be
    /// placed), and returns the stage if it compiled.
    fn stage(&mut self, i: usize, item: &Node) -> Option<(String, StageKind, Option<Format>)> {
        let anon = format!("stage #{}", i + 1);
        self.stage_pos
            .push((item.pos, anon.clone(), HashMap::new()));
        let Val::Map(entries) = &item.val else {
            self.err(
                item.pos,
                &anon,
                None,
                format!(
                    "expected a map with one key naming the stage kind ({}), found {}",
                    list(&STAGE_KINDS),
                    item.val.type_name()
                ),
            );
            return None;
        };
        if entries.len() != 1 {
            self.err(
                item.pos,
                &anon,
                None,
                format!(
                    "expected one key naming the stage kind ({}), found {}",
                    list(&STAGE_KINDS),
                    if entries.is_empty() {
                        "none".to_string()
                    } else {
                        entries
                            .iter()
                            .map(|(k, _, _)| format!("`{k}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ),
            );
            return None;
        }
        let (kind, kpos, body) = &entries[0];
        if !STAGE_KINDS.contains(&kind.as_str()) {
            self.err(
                *kpos,
                &anon,
                None,
                format!(
                    "unknown stage kind `{kind}`, expected one of {}",
                    list(&STAGE_KINDS)
                ),
            );
            return None;
        }
        let allowed: &[&str] = match kind.as_str() {
            "dedup" => &[
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
            "filter" => &["name", "when"],
            "map" => &["name", "set", "rename", "drop"],
            "route" => &["name", "routes", "default"],
            "enrich" => &["name", "table", "key", "into", "on_missing"],
            _ => &["name", "topic", "topics", "key", "headers", "format"],
        };
        // The stage's name first, so every later message can use it.
        let name = match body.val.clone() {
            Val::Map(es) => es
                .iter()
                .find(|(k, _, _)| k == "name")
                .and_then(|(_, _, n)| match &n.val {
                    Val::Str(s) => Some(s.clone()),
                    _ => None,
                }),
            _ => None,
        };
        let default_name = match kind.as_str() {
            "dedup" => "dedup".to_string(),
            "enrich" => match &body.val {
                Val::Map(es) => es
                    .iter()
                    .find(|(k, _, _)| k == "table")
                    .and_then(|(_, _, n)| match &n.val {
                        Val::Str(s) => Some(format!("enrich-{s}")),
                        _ => None,
                    })
                    .unwrap_or_else(|| format!("enrich-{}", i + 1)),
                _ => format!("enrich-{}", i + 1),
            },
            "sink" => match &body.val {
                Val::Map(es) => es
                    .iter()
                    .find(|(k, _, _)| k == "topic")
                    .and_then(|(_, _, n)| match &n.val {
                        // Characters a stage name may not hold become `_`: a bad topic is
                        // reported once, under `topic`.
                        Val::Str(s) => Some(format!(
                            "sink-{}",
                            s.replace(
                                |c: char| !(c.is_ascii_alphanumeric() || "-_.".contains(c)),
                                "_"
                            )
                        )),
                        _ => None,
                    })
                    .unwrap_or_else(|| format!("sink-{}", i + 1)),
                _ => format!("sink-{}", i + 1),
            },
            k if EXTERNAL_KINDS.contains(&k) => k.to_string(),
            k => format!("{k}-{}", i + 1),
        };
        let name = name.unwrap_or(default_name);
        let place = format!("stage `{name}` ({kind})");
        if EXTERNAL_KINDS.contains(&kind.as_str()) {
            self.stage_pos.last_mut().expect("pushed above").1 = place.clone();
            return self.external(kind, body, &place).map(|(n, k)| (n, k, None));
        }
        let f = self.fields(body, &place, None, allowed)?;
        {
            let entry = self.stage_pos.last_mut().expect("pushed above");
            entry.1 = place.clone();
            for (k, _, v) in &f.entries {
                if let Some(a) = allowed.iter().find(|a| **a == *k) {
                    entry.2.insert(*a, v.pos);
                }
            }
        }
        if let Some(n) = f.get("name") {
            self.string(n, &place, "name");
        }
        let mut format = None;
        let kind = match kind.as_str() {
            "dedup" => StageKind::Dedup(self.dedup(&f, &place)?),
            "filter" => StageKind::Filter(self.filter(&f, &place)?),
            "map" => StageKind::Map(self.map(&f, &place)?),
            "route" => StageKind::Route(self.route(&f, &place)?),
            "enrich" => StageKind::Enrich(self.enrich(&f, &place)?),
            _ => {
                if let Some(n) = f.get("format") {
                    format = Some(self.codec(n, &place, "format")?);
                }
                StageKind::Sink(self.sink(&f, &place)?)
            }
        };
        Some((name, kind, format))
    }

    fn key(&mut self, n: &Node, place: &str) -> Option<KeySource> {
        const KINDS: [&str; 5] = [
            "json_pointer",
            "header",
            "kafka_key",
            "value_hash",
            "composite",
        ];
        let bad = |c: &mut Compiler, what: &str| {
            c.err(
                n.pos,
                place,
                Some("key"),
                format!(
                    "expected kafka_key, value_hash, or a map with one of {}; found {what}",
                    list(&KINDS)
                ),
            );
            None
        };
        match &n.val {
            Val::Str(s) if s == "kafka_key" => Some(KeySource::KafkaKey),
            Val::Str(s) if s == "value_hash" => Some(KeySource::ValueHash),
            Val::Str(s) => bad(self, &format!("{s:?}")),
            Val::Map(es) if es.len() == 1 => {
                let (k, kpos, v) = &es[0];
                match k.as_str() {
                    "json_pointer" => self.string(v, place, "key").map(KeySource::JsonPointer),
                    "header" => self.string(v, place, "key").map(KeySource::Header),
                    "kafka_key" => Some(KeySource::KafkaKey),
                    "value_hash" => Some(KeySource::ValueHash),
                    "composite" => match &v.val {
                        Val::Seq(parts) if !parts.is_empty() => {
                            let parts: Vec<Option<KeySource>> =
                                parts.iter().map(|p| self.key(p, place)).collect();
                            parts
                                .into_iter()
                                .collect::<Option<Vec<_>>>()
                                .map(KeySource::Composite)
                        }
                        other => {
                            self.err(
                                v.pos,
                                place,
                                Some("key"),
                                format!(
                                    "composite expects a non-empty list of keys, found {}",
                                    other.type_name()
                                ),
                            );
                            None
                        }
                    },
                    other => {
                        self.err(
                            *kpos,
                            place,
                            Some("key"),
                            format!(
                                "unknown key source `{other}`, expected one of {}",
                                list(&KINDS)
                            ),
                        );
                        None
                    }
                }
            }
            other => bad(self, other.type_name()),
        }
    }

    fn dedup(&mut self, f: &Fields<'_>, place: &str) -> Option<DedupSpec> {
        let key = self
            .required(f, "key", place)
            .and_then(|n| self.key(n, place));
        let mut ok = key.is_some();
        let mut spec = DedupSpec::new(key.unwrap_or(KeySource::KafkaKey));
        if let Some(n) = f.get("ttl") {
            match self.duration_ms(n, place, "ttl") {
                Some(ms) => spec.ttl_ms = ms,
                None => ok = false,
            }
        }
        if let Some(n) = f.get("grace") {
            match self.duration_ms(n, place, "grace") {
                Some(ms) => spec.grace_ms = ms,
                None => ok = false,
            }
        }
        if let Some(n) = f.get("time") {
            match self
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
                    self.err(
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
            match self.fingerprint(n, place) {
                Some((on, fields)) => {
                    spec.fingerprint = on;
                    spec.fingerprint_fields = fields;
                }
                None => ok = false,
            }
        }
        if let Some(n) = f.get("on_conflict") {
            match self
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
        if let Some(n) = f.get("duplicates_to") {
            match self.string(n, place, "duplicates_to") {
                Some(t) => spec.duplicates_to = Some(t),
                None => ok = false,
            }
        }
        if let Some(n) = f.get("partitioning") {
            match self
                .choice(n, place, "partitioning", &["source", "repartition"])
                .as_deref()
            {
                Some("source") => spec.partitioning = Some(Partitioning::Source),
                Some(_) => spec.partitioning = Some(Partitioning::Repartition),
                None => ok = false,
            }
        }
        ok.then_some(spec)
    }

    /// `fingerprint: true | false | { cover: [pointers], ignore: [pointers] }`: whether it is
    /// on, and the fields it is taken over (`None`: the value bytes).
    fn fingerprint(
        &mut self,
        n: &Node,
        place: &str,
    ) -> Option<(
        bool,
        Option<crate::processor::fingerprint::FingerprintFields>,
    )> {
        const FIELD: &str = "fingerprint";
        let entries = match &n.val {
            Val::Bool(b) => return Some((*b, None)),
            Val::Map(es) => es,
            other => {
                self.wrong_type(
                    n.pos,
                    place,
                    Some(FIELD),
                    "true, false or { cover: [json pointers], ignore: [json pointers] }",
                    other,
                );
                return None;
            }
        };
        let mut fields = crate::processor::fingerprint::FingerprintFields::default();
        for (k, _, v) in entries {
            let list = match k.as_str() {
                "cover" => &mut fields.cover,
                "ignore" => &mut fields.ignore,
                other => {
                    self.err(
                        n.pos,
                        place,
                        Some(FIELD),
                        format!("unknown field `{other}`, expected cover or ignore"),
                    );
                    return None;
                }
            };
            let Val::Seq(items) = &v.val else {
                self.err(
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
                        self.err(
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
            self.err(n.pos, place, Some(FIELD), r);
            return None;
        }
        Some((true, Some(fields)))
    }

    fn filter(&mut self, f: &Fields<'_>, place: &str) -> Option<FilterSpec> {
        let n = self.required(f, "when", place)?;
        let predicate: Predicate = self.func(n, place, "when")?;
        Some(FilterSpec { predicate })
    }

    fn map(&mut self, f: &Fields<'_>, place: &str) -> Option<MapSpec> {
        let mut spec = MapSpec::new();
        let mut ok = true;
        if f.get("set").is_none() && f.get("rename").is_none() && f.get("drop").is_none() {
            self.err(
                f.pos,
                place,
                None,
                "a map stage needs at least one of set, rename, drop",
            );
            return None;
        }
        if let Some(n) = f.get("set") {
            match &n.val {
                Val::Map(es) => {
                    for (k, kpos, v) in es {
                        let path = self.field_path(k, *kpos, place, "set");
                        let func: Option<Computed> = self.func(v, place, "set");
                        match (path, func) {
                            (Some(p), Some(fun)) => spec.set.push((p, fun)),
                            _ => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.wrong_type(
                        n.pos,
                        place,
                        Some("set"),
                        "a map of field to expression",
                        other,
                    );
                }
            }
        }
        if let Some(n) = f.get("rename") {
            match &n.val {
                Val::Map(es) => {
                    for (k, kpos, v) in es {
                        let from = self.field_path(k, *kpos, place, "rename");
                        let to = self
                            .string(v, place, "rename")
                            .and_then(|t| self.field_path(&t, v.pos, place, "rename"));
                        match (from, to) {
                            (Some(a), Some(b)) => spec.rename.push((a, b)),
                            _ => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.wrong_type(
                        n.pos,
                        place,
                        Some("rename"),
                        "a map of old name to new name",
                        other,
                    );
                }
            }
        }
        if let Some(n) = f.get("drop") {
            match &n.val {
                Val::Seq(items) => {
                    for it in items {
                        match self
                            .string(it, place, "drop")
                            .and_then(|t| self.field_path(&t, it.pos, place, "drop"))
                        {
                            Some(p) => spec.drop.push(p),
                            None => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.wrong_type(n.pos, place, Some("drop"), "a list of field names", other);
                }
            }
        }
        ok.then_some(spec)
    }

    fn route(&mut self, f: &Fields<'_>, place: &str) -> Option<RouteSpec> {
        let mut spec = RouteSpec::new();
        let mut ok = true;
        if let Some(n) = self.required(f, "routes", place) {
            match &n.val {
                Val::Seq(items) => {
                    for it in items {
                        let Some(bf) = self.fields(it, place, Some("routes"), &["when", "to"])
                        else {
                            ok = false;
                            continue;
                        };
                        let when: Option<Predicate> = match bf.get("when") {
                            Some(w) => self.func(w, place, "when"),
                            None => {
                                self.err(bf.pos, place, Some("when"), "missing field (in a route)");
                                None
                            }
                        };
                        let to = match bf.get("to") {
                            Some(t) => self.string(t, place, "to"),
                            None => {
                                self.err(bf.pos, place, Some("to"), "missing field (in a route)");
                                None
                            }
                        };
                        match (when, to) {
                            (Some(when), Some(topic)) => {
                                spec.branches.push(RouteBranch { when, topic })
                            }
                            _ => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.err(
                        n.pos,
                        place,
                        Some("routes"),
                        format!(
                            "expected a list of {{when, to}} maps, found {}",
                            other.type_name()
                        ),
                    );
                }
            }
        } else {
            ok = false;
        }
        if let Some(n) = f.get("default") {
            match self.string(n, place, "default") {
                Some(t) => spec.default = Some(t),
                None => ok = false,
            }
        }
        ok.then_some(spec)
    }

    fn sink(&mut self, f: &Fields<'_>, place: &str) -> Option<SinkSpec> {
        let mut ok = true;
        let mut topics = Vec::new();
        match (f.get("topic"), f.get("topics")) {
            (Some(_), Some(n)) => {
                ok = false;
                self.err(
                    n.pos,
                    place,
                    Some("topics"),
                    "give either topic or topics, not both",
                );
            }
            (None, None) => {
                ok = false;
                self.err(f.pos, place, Some("topic"), "missing field (or topics)");
            }
            (Some(n), None) => match self.string(n, place, "topic") {
                Some(t) => topics.push(t),
                None => ok = false,
            },
            (None, Some(n)) => match &n.val {
                Val::Seq(items) => {
                    for it in items {
                        match self.string(it, place, "topics") {
                            Some(t) => topics.push(t),
                            None => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.wrong_type(n.pos, place, Some("topics"), "a list of topics", other);
                }
            },
        }
        let mut spec = SinkSpec {
            topics,
            key: None,
            headers: Vec::new(),
        };
        if let Some(n) = f.get("key") {
            let k: Option<BytesFn> = self.func(n, place, "key");
            match k {
                Some(k) => spec.key = Some(k),
                None => ok = false,
            }
        }
        if let Some(n) = f.get("headers") {
            match &n.val {
                Val::Map(es) => {
                    for (h, _, v) in es {
                        let func: Option<BytesFn> = self.func(v, place, "headers");
                        match func {
                            Some(fun) => spec.headers.push((h.clone(), fun)),
                            None => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.wrong_type(
                        n.pos,
                        place,
                        Some("headers"),
                        "a map of header name to expression",
                        other,
                    );
                }
            }
        }
        ok.then_some(spec)
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
            StageKind::Dedup(d) => {
                assert_eq!(d.key, KeySource::JsonPointer("/id".into()));
                assert_eq!(d.ttl_ms, 24 * 3600 * 1000);
                assert_eq!(d.time, TimeSource::Event);
            }
            other => panic!("first stage should be dedup, is {other:?}"),
        }
    }

    #[test]
    fn errors_name_file_line_column_stage_and_field() {
        let cases = [
            (
                "name: t\nsource: {topic: a}\nstages:\n  - dedup: {key: {json_pointer: /id}, ttll: 1h}\n  - sink: {topic: b}\n",
                "t.yaml:4:39: stage `dedup` (dedup), field `ttll`: unknown field, expected one of name, key, ttl, time, grace, max_keys, fingerprint, on_conflict, duplicates_to, partitioning",
            ),
            (
                "name: t\nsource: {topic: a}\nstages:\n  - dedup: {name: d, key: {json_pointer: /id}, ttl: 2 parsecs}\n  - sink: {topic: b}\n",
                "t.yaml:4:53: stage `d` (dedup), field `ttl`: \"2 parsecs\" is not a duration such as 24h or 90s: unknown time unit \"parsecs\", supported units: ns, us/µs, ms, sec, min, hours, days, weeks, months, years (and few variations)",
            ),
            (
                "name: t\nsource: {topic: a}\nstages:\n  - mapp: {}\n",
                "t.yaml:4:5: stage #1: unknown stage kind `mapp`, expected one of dedup, enrich, file, filter, http, map, postgres, redis, route, sink",
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
}
