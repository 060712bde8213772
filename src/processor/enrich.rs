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
//! Into one top-level field of a JSON object no earlier stage decoded, the result is
//! written from the record's text and the row's, so numbers keep their digits whatever
//! their size, whether the field was there or not. Into a nested field, into the top level,
//! or after a `map`, the join goes through a JSON tree, which holds numbers as 64-bit
//! integers or `f64` (an integer beyond 64 bits becomes a float).
//!
//! A record with no lookup key (missing field, null, wrong type) goes to the dead-letter
//! topic. A record with a key but no row follows [`MissingPolicy`]. The lookup sees the
//! table as loaded at that moment: the table follows its topic in the background, so an
//! update changes later joins, never earlier ones (no re-join of past records).

use super::codec::view_mut;
use super::key::KeySource;
use super::{Context, Processor, Record, StageError};
use crate::codec::json_type;
use crate::codec::Format;
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
    pub(crate) fn name(self) -> &'static str {
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
pub(crate) struct Enrich {
    name: String,
    spec: EnrichSpec,
    into: Vec<String>,
    /// `"<field>":` when `into` names one top-level field (the text path).
    splice_key: Option<Vec<u8>>,
    key_buf: Vec<u8>,
    matched: metrics::Counter,
    missing: metrics::Counter,
    error: metrics::Counter,
}

impl Enrich {
    /// The stage `name` of topology `topology`.
    pub(crate) fn new(topology: &str, name: &str, spec: EnrichSpec) -> Self {
        let c = |result: &'static str| {
            metrics::counter!(crate::metrics::ENRICH_LOOKUPS,
                "topology" => topology.to_string(), "stage" => name.to_string(), "result" => result)
        };
        Enrich {
            name: name.to_string(),
            into: super::json_scan::tokens(&spec.into),
            splice_key: splice_field(&spec.into).map(|f| {
                let mut k = serde_json::to_vec(f).expect("a string serializes");
                k.push(b':');
                k
            }),
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
        if let Some(v) = self.splice(&record, &row) {
            record.value = Some(v);
            record.fields = None;
            self.matched.increment(1);
            ctx.forward(record);
            return Ok(());
        }
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
        record.view_edited = true;
        record.fields = None;
        self.matched.increment(1);
        ctx.forward(record);
        Ok(())
    }
}

impl Enrich {
    /// The text path for a JSON object not decoded yet, joined into one top-level field:
    /// the result is written from the record's own text and the row's, so both keep their
    /// number forms (an integer beyond 64 bits stays itself), with no tree built. When the
    /// source scan found the field absent, the row is appended to the object's text
    /// (`{...,"field":row}`); otherwise the object is rewritten member by member from their
    /// raw texts, a repeated name kept once at its first place with its last value, as the
    /// tree path does. `None` when the path does not apply (a view exists, `into` is nested
    /// or empty) or the value is not a JSON object; the tree path then decides.
    fn splice(&self, record: &Record, row: &[u8]) -> Option<bytes::Bytes> {
        let key = self.splice_key.as_ref()?;
        if record.json.is_some() {
            return None;
        }
        let v = record.value.as_deref()?;
        let absent = record.fields.as_ref().is_some_and(|(ptrs, vals)| {
            ptrs.iter()
                .position(|p| *p == self.spec.into)
                .is_some_and(|i| vals[i] == super::json_scan::Scalar::Missing)
        });
        if !absent {
            return rewrite_members(v, &self.into[0], row).map(Into::into);
        }
        let end = v.iter().rposition(|b| !b.is_ascii_whitespace())?;
        let start = v.iter().position(|b| !b.is_ascii_whitespace())?;
        if v[start] != b'{' || v[end] != b'}' {
            return None;
        }
        let empty = v[start + 1..end].iter().all(u8::is_ascii_whitespace);
        let mut out = Vec::with_capacity(end + key.len() + row.len() + 2);
        out.extend_from_slice(&v[..end]);
        if !empty {
            out.push(b',');
        }
        out.extend_from_slice(key);
        out.extend_from_slice(row);
        out.push(b'}');
        Some(out.into())
    }
}

/// The JSON object `value` with its member `field` set to the JSON text `row`, written from
/// the members' raw texts (numbers keep their digits); a repeated member name is kept once,
/// at its first place with its last value. `None` when `value` is not one JSON object or
/// `row` is not JSON.
fn rewrite_members(value: &[u8], field: &str, row: &[u8]) -> Option<Vec<u8>> {
    use serde::de::{Deserializer as _, MapAccess, Visitor};
    use serde_json::value::RawValue;

    struct Members<'a>(std::marker::PhantomData<&'a ()>);
    impl<'de> Visitor<'de> for Members<'de> {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out: Vec<(String, &'de RawValue)> = Vec::new();
            let mut at = std::collections::HashMap::new();
            while let Some(k) = map.next_key::<String>()? {
                let v: &'de RawValue = map.next_value()?;
                match at.get(&k) {
                    Some(&i) => out[i] = (k, v),
                    None => {
                        at.insert(k.clone(), out.len());
                        out.push((k, v));
                    }
                }
            }
            Ok(out)
        }
    }
    let row: &RawValue = serde_json::from_slice(row).ok()?;
    let mut de = serde_json::Deserializer::from_slice(value);
    let mut members = de.deserialize_map(Members(std::marker::PhantomData)).ok()?;
    de.end().ok()?;
    match members.iter_mut().find(|(k, _)| k == field) {
        Some(m) => m.1 = row,
        None => members.push((field.to_string(), row)),
    }
    let mut out = Vec::with_capacity(value.len() + row.get().len() + field.len() + 4);
    out.push(b'{');
    for (i, (k, v)) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, k).ok()?;
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
    }
    out.push(b'}');
    Some(out)
}

/// The field of a pointer naming one top-level field (`/customer`), else `None`.
pub(crate) fn splice_field(pointer: &str) -> Option<&str> {
    let f = pointer.strip_prefix('/')?;
    (!f.contains('/') && !f.contains('~')).then_some(f)
}

/// Set `row` at the pointer `tokens` (`pointer` for messages) in `view`, creating objects
/// for missing steps; the empty pointer merges an object row into the top level.
fn place(view: &mut Value, tokens: &[String], pointer: &str, row: Value) -> Result<(), String> {
    let Value::Object(map) = view else {
        return Err(format!(
            "the record is {}, enrich needs a JSON object",
            json_type(view)
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
                json_type(&other)
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
                    json_type(other)
                ));
            }
        }
    }
    cur.insert(last.clone(), row);
    Ok(())
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

    fn record(value: &[u8], pointers: &[String]) -> Record {
        let toks: Vec<Vec<String>> = pointers
            .iter()
            .map(|p| super::super::json_scan::tokens(p))
            .collect();
        let fields = super::super::json_scan::scan(value, &toks).ok();
        Record {
            key: None,
            value: Some(bytes::Bytes::copy_from_slice(value)),
            headers: Vec::new(),
            timestamp: None,
            json: None,
            fields: fields.map(|f| (pointers.to_vec().into(), f)),
            source: super::super::SourceMeta {
                topic: "t".into(),
                partition: 0,
                offset: 0,
            },
            origin: None,
            keyed: false,
            dedup_key: None,
            as_read: None,
            view_edited: false,
            unset: None,
        }
    }

    proptest::proptest! {
        /// The text path gives the same JSON as the tree path, present field or not.
        #[test]
        fn splice_agrees_with_the_tree_path(
            fields in proptest::collection::vec((0usize..4, 0i64..100), 0..5),
            ws in proptest::collection::vec(0usize..3, 8),
            row_n in 0i64..9,
        ) {
            let names = ["a", "customer", "customers", "c"];
            let sp = |i: usize| [" ", "", "\n "][ws[i % ws.len()]];
            let body: Vec<String> = fields
                .iter()
                .enumerate()
                .map(|(i, (n, v))| format!("{}\"{}\"{}:{}{}", sp(i), names[*n], sp(i + 1), sp(i + 2), v))
                .collect();
            let text = format!("{}{{{}{}}}{}", sp(0), body.join(","), sp(3), sp(4));
            let row = format!("{{\"n\": {row_n}}}");
            let spec = EnrichSpec::new("t", KeySource::KafkaKey, "/customer");
            let e = Enrich::new("t", "e", spec);
            let rec = record(text.as_bytes(), &["/customer".to_string()]);
            let mut tree: Value = serde_json::from_str(&text).unwrap();
            place(&mut tree, &e.into, "/customer", serde_json::from_str(&row).unwrap()).unwrap();
            let out = e.splice(&rec, row.as_bytes());
            proptest::prop_assert!(out.is_some(), "an object always takes the text path");
            let got: Value = serde_json::from_slice(&out.unwrap()).unwrap();
            proptest::prop_assert_eq!(got, tree);
        }
    }

    /// Into a top-level field, big numbers in the record and the row keep their digits
    /// whether the field was absent, null or an object, and a repeated member is kept once.
    #[test]
    fn the_text_path_keeps_numbers_present_field_or_not() {
        let spec = EnrichSpec::new("t", KeySource::KafkaKey, "/customer");
        let e = Enrich::new("t", "e", spec);
        let row = br#"{"acct": 18446744073709551617, "r": 1.50}"#;
        let cases = [
            (
                r#"{"id":18446744073709551616}"#,
                r#"{"id":18446744073709551616,"customer":{"acct": 18446744073709551617, "r": 1.50}}"#,
            ),
            (
                r#"{"id":18446744073709551616,"customer":null}"#,
                r#"{"id":18446744073709551616,"customer":{"acct": 18446744073709551617, "r": 1.50}}"#,
            ),
            (
                r#" { "customer" : {"x":1}, "id" : 1e400 } "#,
                r#"{"customer":{"acct": 18446744073709551617, "r": 1.50},"id":1e400}"#,
            ),
            (
                r#"{"a":1,"customer":2,"a":3}"#,
                r#"{"a":3,"customer":{"acct": 18446744073709551617, "r": 1.50}}"#,
            ),
            (
                r#"{"a\u0041":1,"customer":2}"#,
                r#"{"aA":1,"customer":{"acct": 18446744073709551617, "r": 1.50}}"#,
            ),
        ];
        for (input, want) in cases {
            let rec = record(input.as_bytes(), &["/customer".to_string()]);
            let got = e.splice(&rec, row).expect(input);
            assert_eq!(std::str::from_utf8(&got).unwrap(), want, "{input}");
        }
        for not_an_object in [&b"[1]"[..], b"{\"a\":1} x", b"\"s\"", b"{"] {
            let rec = record(not_an_object, &["/customer".to_string()]);
            assert!(
                e.splice(&rec, row).is_none(),
                "{:?}",
                std::str::from_utf8(not_an_object)
            );
        }
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
