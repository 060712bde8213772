//! Where a dedup key comes from, and how it is taken from a record as raw bytes.

use super::record::Record;
use crate::codec::json_type;

/// The source of a dedup (or idempotency) key.
///
/// Keys are raw bytes: a header or Kafka key is taken byte for byte, never decoded. A JSON
/// string is taken as its UTF-8 bytes; a JSON number as its exact text as written, whatever
/// its size (so `"42"` and `42` name the same key, while `1`, `1.0` and `1e0` are three
/// keys, and `18446744073709551616` and `18446744073709551617` are two). Any other JSON type
/// is an error, as is a missing field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A JSON pointer (RFC 6901) into the decoded value, e.g. `/id`.
    JsonPointer(String),
    /// A record header by name, e.g. `msg-id` or `ce_id`.
    Header(String),
    /// The Kafka record key.
    KafkaKey,
    /// A 128-bit hash (xxh3) of the value bytes: identical payloads are duplicates.
    ValueHash,
    /// Several parts, each length-prefixed so that no two different part lists collide
    /// (`["a:", "b"]` and `["a", ":b"]` are different keys).
    Composite(Vec<KeySource>),
}

/// Where a key can be read from a source record as consumed, without decoding it: for a
/// prefetch hint ([`crate::processor::Processor::key_hint`]), a guess that may be wrong
/// (a wrong one costs a wasted prefetch), never a key to decide by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyHint {
    /// The Kafka key.
    KafkaKey,
    /// A top-level member of a JSON object value, by name (a one-token JSON pointer).
    TopField(String),
}

impl KeyHint {
    /// The hint for keys taken from `source`, when there is a cheap one.
    pub(crate) fn of(source: &KeySource) -> Option<KeyHint> {
        match source {
            KeySource::KafkaKey => Some(KeyHint::KafkaKey),
            KeySource::JsonPointer(p) => match super::json_scan::tokens(p).as_slice() {
                [name] => Some(KeyHint::TopField(name.clone())),
                _ => None,
            },
            _ => None,
        }
    }

    /// The key a record with Kafka key `key` and value `value` probably has.
    pub(crate) fn peek<'a>(
        &self,
        key: Option<&'a [u8]>,
        value: Option<&'a [u8]>,
    ) -> Option<&'a [u8]> {
        match self {
            KeyHint::KafkaKey => key,
            KeyHint::TopField(name) => super::json_fast::peek_member(value?, name.as_bytes()),
        }
    }
}

/// Why no key could be taken from a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyError {
    /// The key is absent: no such field, header, or a null Kafka key.
    Missing(String),
    /// The field exists but is not a string or a number.
    WrongType(String),
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyError::Missing(what) | KeyError::WrongType(what) => f.write_str(what),
        }
    }
}

impl KeySource {
    /// Describe the source for messages, e.g. `json pointer /id`.
    pub(crate) fn describe(&self) -> String {
        match self {
            KeySource::JsonPointer(p) => format!("json pointer {p}"),
            KeySource::Header(h) => format!("header {h}"),
            KeySource::KafkaKey => "kafka key".into(),
            KeySource::ValueHash => "value hash".into(),
            KeySource::Composite(parts) => format!(
                "composite({})",
                parts
                    .iter()
                    .map(|p| p.describe())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// The JSON pointers this key reads.
    pub(crate) fn json_pointers(&self, out: &mut Vec<String>) {
        match self {
            KeySource::JsonPointer(p) if !out.contains(p) => {
                out.push(p.clone());
            }
            KeySource::Composite(parts) => parts.iter().for_each(|p| p.json_pointers(out)),
            _ => {}
        }
    }

    /// What makes this key unusable, for build errors: a JSON pointer without a leading
    /// `/`, a composite without parts (every record would have one key, the empty one).
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.collect_problems(&mut out);
        out
    }

    fn collect_problems(&self, out: &mut Vec<String>) {
        match self {
            KeySource::JsonPointer(p) if !p.is_empty() && !p.starts_with('/') => {
                out.push(format!("JSON pointer {p:?} must start with '/'"))
            }
            KeySource::Composite(parts) if parts.is_empty() => out.push(
                "a composite key needs at least one part (without parts every record has the same empty key)"
                    .into(),
            ),
            KeySource::Composite(parts) => parts.iter().for_each(|p| p.collect_problems(out)),
            _ => {}
        }
    }

    /// Whether this key needs the decoded JSON value.
    pub(crate) fn needs_json(&self) -> bool {
        match self {
            KeySource::JsonPointer(_) => true,
            KeySource::Composite(parts) => parts.iter().any(|p| p.needs_json()),
            _ => false,
        }
    }

    /// Take the key from `record`, appending its bytes to `out` (cleared first).
    ///
    /// # Errors
    /// [`KeyError::Missing`] when the field, header or Kafka key is absent or null;
    /// [`KeyError::WrongType`] when a JSON field is not a string or number.
    pub(crate) fn extract_into<R: KeyInput + ?Sized>(
        &self,
        record: &R,
        out: &mut Vec<u8>,
    ) -> Result<(), KeyError> {
        out.clear();
        self.append(record, out)
    }

    fn append<R: KeyInput + ?Sized>(&self, record: &R, out: &mut Vec<u8>) -> Result<(), KeyError> {
        match self {
            KeySource::JsonPointer(ptr) => {
                if let Some((ptrs, vals)) = record.fields() {
                    if let Some(i) = ptrs.iter().position(|p| p == ptr) {
                        use super::json_scan::Scalar;
                        return match &vals[i] {
                            Scalar::Missing => {
                                Err(KeyError::Missing(format!("key field {ptr} is missing")))
                            }
                            Scalar::Null => {
                                Err(KeyError::Missing(format!("key field {ptr} is null")))
                            }
                            Scalar::Str(s) | Scalar::Num(s) => {
                                out.extend_from_slice(s.as_bytes());
                                Ok(())
                            }
                            Scalar::Other(t) => Err(KeyError::WrongType(format!(
                                "key field {ptr} is {t}, expected a string or a number"
                            ))),
                        };
                    }
                }
                let Some(json) = record.json() else {
                    return Err(KeyError::Missing(format!(
                        "key field {ptr}: the value is not decoded JSON (source format must be json)"
                    )));
                };
                match json.pointer(ptr) {
                    None => Err(KeyError::Missing(format!("key field {ptr} is missing"))),
                    Some(v) if record.unset(ptr, v) => Err(KeyError::Missing(format!(
                        "key field {ptr} is not set (a protobuf field without presence reads as its default {v} when absent; declare it `optional` to key by that value)"
                    ))),
                    Some(serde_json::Value::Null) => {
                        Err(KeyError::Missing(format!("key field {ptr} is null")))
                    }
                    Some(serde_json::Value::String(s)) => {
                        out.extend_from_slice(s.as_bytes());
                        Ok(())
                    }
                    Some(serde_json::Value::Number(n)) => number_text(ptr, n, out),
                    Some(other) => Err(KeyError::WrongType(format!(
                        "key field {ptr} is {}, expected a string or a number",
                        json_type(other)
                    ))),
                }
            }
            KeySource::Header(name) => match record.header(name) {
                None => Err(KeyError::Missing(format!("key header {name} is missing"))),
                Some(None) => Err(KeyError::Missing(format!("key header {name} is null"))),
                Some(Some(bytes)) => {
                    out.extend_from_slice(bytes);
                    Ok(())
                }
            },
            KeySource::KafkaKey => match record.kafka_key() {
                None => Err(KeyError::Missing("the Kafka key is null".into())),
                Some(k) => {
                    out.extend_from_slice(k);
                    Ok(())
                }
            },
            // A null value (a tombstone) has no key: hashing it as empty bytes would make
            // every tombstone one key. An empty value is a value, and has one.
            KeySource::ValueHash => match record.value() {
                None => Err(KeyError::Missing(
                    "the value is null (a tombstone): value_hash has nothing to hash".into(),
                )),
                Some(bytes) => {
                    out.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(bytes).to_be_bytes());
                    Ok(())
                }
            },
            KeySource::Composite(parts) => {
                let mut part = Vec::new();
                for p in parts {
                    p.extract_into(record, &mut part)?;
                    out.extend_from_slice(&(part.len() as u32).to_be_bytes());
                    out.extend_from_slice(&part);
                }
                Ok(())
            }
        }
    }
}

/// What a key is read from: a [`Record`], or the parts of a message read in place (the
/// repartition router reads a source message without copying it into a record).
pub(crate) trait KeyInput {
    /// The JSON fields scanned from the value: the pointers and their values.
    fn fields(&self) -> Option<(&[String], &[super::json_scan::Scalar])>;
    /// The decoded value (a non-JSON source, or a value a stage rewrote).
    fn json(&self) -> Option<&serde_json::Value>;
    /// The first header named `name` (`Some(None)`: a null value).
    fn header(&self, name: &str) -> Option<Option<&[u8]>>;
    /// The Kafka key.
    fn kafka_key(&self) -> Option<&[u8]>;
    /// The value bytes.
    fn value(&self) -> Option<&[u8]>;
    /// Whether the view's `v` at `ptr` is a protobuf field without presence that was not
    /// set (it reads as its default, which on the wire is the field absent): no key, as a
    /// missing JSON field is none. Only while the view is the value as read.
    fn unset(&self, _ptr: &str, _v: &serde_json::Value) -> bool {
        false
    }
}

impl KeyInput for Record {
    fn fields(&self) -> Option<(&[String], &[super::json_scan::Scalar])> {
        self.fields.as_ref().map(|(p, v)| (&p[..], &v[..]))
    }
    fn json(&self) -> Option<&serde_json::Value> {
        self.json.as_ref()
    }
    fn header(&self, name: &str) -> Option<Option<&[u8]>> {
        Record::header(self, name)
    }
    fn kafka_key(&self) -> Option<&[u8]> {
        self.key.as_deref()
    }
    fn value(&self) -> Option<&[u8]> {
        self.value.as_deref()
    }
    fn unset(&self, ptr: &str, v: &serde_json::Value) -> bool {
        !self.view_edited && self.unset.as_ref().is_some_and(|u| u.get(ptr) == Some(v))
    }
}

/// Append the text of number `n`, found at `ptr` in the record view (a view exists when
/// the source is not JSON, or a stage such as `map` rewrote the value; otherwise keys come
/// from the scanned fields, with their exact text).
///
/// A 64-bit integer has one text. Any other number went through `f64` when the view was
/// made: a fraction is written as `f64` prints it; an integer beyond 64 bits is refused, as
/// its digits are lost (`2^64 + 1` reads as `2^64`) and two ids must not become one key.
///
/// # Errors
/// [`KeyError::WrongType`] for an integer beyond 64 bits.
/// Whether the double `f` is integral and at or past 2^53, where f64 no longer tells
/// neighbouring integers apart: an integer beyond 64 bits read from JSON (or a float such
/// as 1e20) whose exact digits are lost. Keys, CEL key text and protobuf integer fields
/// refuse such a number rather than merge ids.
pub(crate) fn digits_lost(f: f64) -> bool {
    f.fract() == 0.0 && f.abs() >= 9_007_199_254_740_992.0
}

fn number_text(ptr: &str, n: &serde_json::Number, out: &mut Vec<u8>) -> Result<(), KeyError> {
    use std::io::Write;
    // Not a 64-bit integer, yet integral past 2^53.
    if !(n.is_i64() || n.is_u64()) && digits_lost(n.as_f64().unwrap_or(0.0)) {
        return Err(KeyError::WrongType(format!(
            "key field {ptr} is an integer beyond 64 bits, whose exact digits an earlier stage lost when it rewrote the value; dedup before that stage, or send the id as a string"
        )));
    }
    let _ = write!(out, "{n}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::record::SourceMeta;

    /// A hint reads the key where the key source takes it from a record as consumed, and
    /// there is none where that would take decoding.
    #[test]
    fn a_hint_reads_the_key_where_its_source_does() {
        let value = br#"{"id":"e-1","a":{"b":2}}"#;
        let peek = |s: KeySource| {
            KeyHint::of(&s).and_then(|h| h.peek(Some(b"k"), Some(value)).map(<[u8]>::to_vec))
        };
        assert_eq!(peek(KeySource::KafkaKey), Some(b"k".to_vec()));
        assert_eq!(
            peek(KeySource::JsonPointer("/id".into())),
            Some(b"e-1".to_vec())
        );
        assert_eq!(KeyHint::of(&KeySource::JsonPointer("/a/b".into())), None);
        assert_eq!(KeyHint::of(&KeySource::Header("h".into())), None);
        assert_eq!(KeyHint::of(&KeySource::ValueHash), None);
    }

    fn rec(json: serde_json::Value) -> Record {
        Record {
            key: None,
            value: Some(json.to_string().into()),
            headers: vec![("msg-id".into(), Some(vec![0xff, 0x00].into()))],
            timestamp: Some(0),
            json: Some(json),
            fields: None,
            source: SourceMeta {
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

    fn key(src: &KeySource, r: &Record) -> Result<Vec<u8>, KeyError> {
        let mut out = Vec::new();
        src.extract_into(r, &mut out).map(|_| out)
    }

    #[test]
    fn json_pointer_string_and_number() {
        let p = KeySource::JsonPointer("/id".into());
        assert_eq!(
            key(&p, &rec(serde_json::json!({"id": "abc"}))).unwrap(),
            b"abc"
        );
        assert_eq!(key(&p, &rec(serde_json::json!({"id": 42}))).unwrap(), b"42");
    }

    #[test]
    fn numbers_in_a_view_beyond_64_bits_are_refused() {
        let p = KeySource::JsonPointer("/id".into());
        let k = |v: serde_json::Value| key(&p, &rec(v));
        assert_eq!(
            k(serde_json::json!({"id": u64::MAX})).unwrap(),
            b"18446744073709551615"
        );
        assert_eq!(
            k(serde_json::json!({"id": i64::MIN})).unwrap(),
            b"-9223372036854775808"
        );
        assert_eq!(k(serde_json::json!({"id": 2.5})).unwrap(), b"2.5");
        assert_eq!(k(serde_json::json!({"id": 1.0})).unwrap(), b"1.0");
        for big in [18446744073709551616.0, -9223372036854775809.0, 1e20, 1e300] {
            assert!(
                matches!(
                    k(serde_json::json!({"id": big})),
                    Err(KeyError::WrongType(_))
                ),
                "{big}"
            );
        }
    }

    #[test]
    fn json_pointer_errors_name_the_field() {
        let p = KeySource::JsonPointer("/id".into());
        let e = key(&p, &rec(serde_json::json!({"x": 1}))).unwrap_err();
        assert_eq!(e, KeyError::Missing("key field /id is missing".into()));
        let e = key(&p, &rec(serde_json::json!({"id": null}))).unwrap_err();
        assert!(matches!(e, KeyError::Missing(_)));
        let e = key(&p, &rec(serde_json::json!({"id": {"a": 1}}))).unwrap_err();
        assert_eq!(
            e,
            KeyError::WrongType("key field /id is an object, expected a string or a number".into())
        );
        assert!(matches!(
            key(&p, &rec(serde_json::json!({"id": true}))),
            Err(KeyError::WrongType(_))
        ));
    }

    #[test]
    fn header_bytes_are_raw() {
        let h = KeySource::Header("msg-id".into());
        assert_eq!(
            key(&h, &rec(serde_json::json!({}))).unwrap(),
            vec![0xff, 0x00]
        );
    }

    #[test]
    fn composite_parts_do_not_collide() {
        let c = KeySource::Composite(vec![
            KeySource::JsonPointer("/a".into()),
            KeySource::JsonPointer("/b".into()),
        ]);
        let k1 = key(&c, &rec(serde_json::json!({"a": "x:", "b": "y"}))).unwrap();
        let k2 = key(&c, &rec(serde_json::json!({"a": "x", "b": ":y"}))).unwrap();
        assert_ne!(k1, k2);
    }

    #[test]
    fn null_kafka_key_is_missing_not_a_key() {
        let r = rec(serde_json::json!({}));
        assert!(matches!(
            key(&KeySource::KafkaKey, &r),
            Err(KeyError::Missing(_))
        ));
    }
}
