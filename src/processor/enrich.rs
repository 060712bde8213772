//! The enrich stage: a lookup join of each record against a table materialized from a
//! compacted topic (see [`crate::state::table`]).
//!
//! The lookup key is taken from the record like a dedup key (a JSON pointer, a header, the
//! Kafka key, or a composite), as raw bytes, and must equal the table topic's record key
//! byte for byte: a JSON string field gives its UTF-8 bytes, a number its decimal text.
//! A matching row (its JSON view) is set into the record view at the `into` pointer,
//! creating objects on the way; with `into` empty the row's fields are merged into the
//! record's top level, overwriting fields of the same name.
//!
//! A record with no lookup key (missing field, null, wrong type) goes to the dead-letter
//! topic. A record with a key but no row follows [`MissingPolicy`]. The lookup sees the
//! table as loaded at that moment: the table follows its topic in the background, so an
//! update changes later joins, never earlier ones (no re-join of past records).

use super::codec::{view_mut, Format};
use super::key::KeySource;
use super::{Context, Processor, Record, StageError};
use crate::error::{Error, RecordError};
use serde_json::Value;

/// A lookup table: its name (also its sled tree, `table-<name>`), its compacted topic
/// and the codec of that topic's values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSpec {
    /// Table name, referenced by enrich stages.
    pub name: String,
    /// The compacted topic the table is read from (and restored from).
    pub topic: String,
    /// Codec of the topic's values (default JSON).
    pub format: Format,
}

impl TableSpec {
    /// Table `name` read from `topic`, JSON values.
    pub fn new(name: impl Into<String>, topic: impl Into<String>) -> Self {
        TableSpec {
            name: name.into(),
            topic: topic.into(),
            format: Format::Json,
        }
    }

    /// Set the codec of the table topic's values.
    pub fn format(mut self, format: Format) -> Self {
        self.format = format;
        self
    }
}

/// What an enrich stage does with a record whose key has no row in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingPolicy {
    /// Drop the record (counted as `missing`).
    Drop,
    /// Send it on unchanged; the default.
    #[default]
    Pass,
    /// Send it to the dead-letter topic, the reason naming table and key.
    DeadLetter,
}

impl MissingPolicy {
    /// Name as written in topology files.
    pub fn name(self) -> &'static str {
        match self {
            MissingPolicy::Drop => "drop",
            MissingPolicy::Pass => "pass",
            MissingPolicy::DeadLetter => "dead_letter",
        }
    }
}

/// Settings of an enrich stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnrichSpec {
    /// Name of the table to look up.
    pub table: String,
    /// Where the lookup key comes from.
    pub key: KeySource,
    /// JSON pointer where the row goes (`/customer`); empty merges the row's fields into
    /// the record's top level.
    pub into: String,
    /// What to do when no row matches (default pass).
    pub on_missing: MissingPolicy,
}

impl EnrichSpec {
    /// Look `key` up in `table` and set the row at `into`; a missing row passes.
    pub fn new(table: impl Into<String>, key: KeySource, into: impl Into<String>) -> Self {
        EnrichSpec {
            table: table.into(),
            key,
            into: into.into(),
            on_missing: MissingPolicy::Pass,
        }
    }

    /// Set the missing-match policy.
    pub fn on_missing(mut self, policy: MissingPolicy) -> Self {
        self.on_missing = policy;
        self
    }
}

/// The enrich processor (one per task).
pub struct Enrich {
    name: String,
    spec: EnrichSpec,
    into: Vec<String>,
    key_buf: Vec<u8>,
    matched: metrics::Counter,
    missing: metrics::Counter,
    error: metrics::Counter,
}

impl Enrich {
    /// The stage `name` of topology `topology`.
    pub fn new(topology: &str, name: &str, spec: EnrichSpec) -> Self {
        let c = |result: &'static str| {
            metrics::counter!(crate::metrics::ENRICH_LOOKUPS,
                "topology" => topology.to_string(), "stage" => name.to_string(), "result" => result)
        };
        Enrich {
            name: name.to_string(),
            into: super::json_scan::tokens(&spec.into),
            spec,
            key_buf: Vec::with_capacity(64),
            matched: c("matched"),
            missing: c("missing"),
            error: c("error"),
        }
    }

    fn fail(&self, reason: String) -> StageError {
        self.error.increment(1);
        RecordError::new(&self.name, reason).into()
    }
}

impl Processor for Enrich {
    fn process(&mut self, mut record: Record, ctx: &mut Context<'_>) -> Result<(), StageError> {
        if let Err(e) = self.spec.key.extract_into(&record, &mut self.key_buf) {
            return Err(self.fail(format!("lookup key: {e}")));
        }
        let table = ctx
            .tables
            .get(&self.spec.table)
            .ok_or_else(|| Error::Topology {
                node: self.name.clone(),
                reason: format!(
                    "table {} is not loaded in this task (internal error)",
                    self.spec.table
                ),
            })?;
        let Some(row) = table.get(&self.key_buf)? else {
            self.missing.increment(1);
            return match self.spec.on_missing {
                MissingPolicy::Drop => Ok(()),
                MissingPolicy::Pass => {
                    ctx.forward(record);
                    Ok(())
                }
                MissingPolicy::DeadLetter => Err(RecordError::new(
                    &self.name,
                    format!(
                        "no row in table {} for key \"{}\"",
                        self.spec.table,
                        self.key_buf.escape_ascii()
                    ),
                )
                .into()),
            };
        };
        let row: Value = serde_json::from_slice(&row).map_err(|e| {
            Error::state(
                format!("table {}", self.spec.table),
                format!("stored row is not JSON: {e}"),
            )
        })?;
        let view = match view_mut(&mut record) {
            Ok(v) => v,
            Err(e) => return Err(self.fail(e)),
        };
        if let Err(e) = place(view, &self.into, &self.spec.into, row) {
            return Err(self.fail(e));
        }
        // The view is now what sinks write (see `codec`); fields scanned from the source
        // bytes no longer describe it.
        record.fields = None;
        self.matched.increment(1);
        ctx.forward(record);
        Ok(())
    }
}

/// Set `row` at the pointer `tokens` (`pointer` for messages) in `view`, creating objects
/// for missing steps; the empty pointer merges an object row into the top level.
fn place(view: &mut Value, tokens: &[String], pointer: &str, row: Value) -> Result<(), String> {
    let Value::Object(map) = view else {
        return Err(format!(
            "the record is {}, enrich needs a JSON object",
            type_name(view)
        ));
    };
    let Some((last, path)) = tokens.split_last() else {
        return match row {
            Value::Object(fields) => {
                for (k, v) in fields {
                    map.insert(k, v);
                }
                Ok(())
            }
            other => Err(format!(
                "the table row is {}; merging into the top level (into \"\") needs an object row",
                type_name(&other)
            )),
        };
    };
    let mut cur = map;
    for (i, t) in path.iter().enumerate() {
        let next = cur
            .entry(t.clone())
            .or_insert_with(|| Value::Object(Default::default()));
        match next {
            Value::Object(m) => cur = m,
            other => {
                let at: Vec<&str> = path[..=i].iter().map(String::as_str).collect();
                return Err(format!(
                    "cannot set {pointer}: /{} is {}, not an object",
                    at.join("/"),
                    type_name(other)
                ));
            }
        }
    }
    cur.insert(last.clone(), row);
    Ok(())
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn put(v: Value, p: &str, row: Value) -> Result<Value, String> {
        let mut v = v;
        place(&mut v, &super::super::json_scan::tokens(p), p, row)?;
        Ok(v)
    }

    #[test]
    fn place_sets_merges_and_refuses() {
        assert_eq!(
            put(json!({"a":1}), "/c/d", json!({"n":2})).unwrap(),
            json!({"a":1,"c":{"d":{"n":2}}})
        );
        assert_eq!(
            put(json!({"a":1,"n":0}), "", json!({"n":2,"m":3})).unwrap(),
            json!({"a":1,"n":2,"m":3})
        );
        assert_eq!(
            put(json!({"c":"x"}), "/c/d", json!(1)).unwrap_err(),
            "cannot set /c/d: /c is a string, not an object"
        );
        assert_eq!(
            put(json!([1]), "/c", json!(1)).unwrap_err(),
            "the record is an array, enrich needs a JSON object"
        );
        assert_eq!(
            put(json!({}), "", json!(7)).unwrap_err(),
            "the table row is a number; merging into the top level (into \"\") needs an object row"
        );
    }
}
