//! Codecs: how the value bytes of a topic are read into the record view and written back.
//!
//! Every topic a topology touches has a [`Format`]: the source, each sink topic, each table
//! topic. The *record view* is a `serde_json::Value` ([`Record::json`](crate::processor::Record::json)) that stages such as
//! enrich read and change:
//!
//! | format | view of the value | on the way out |
//! |---|---|---|
//! | `json` | the parsed JSON | compact JSON text, fields in their order |
//! | `string` | a JSON string holding the UTF-8 text | the string's bytes (any other view is an error) |
//! | `protobuf` | the message in the protobuf JSON mapping with the `.proto` field names, 64-bit integers as numbers, `float`s as the shortest decimal of the `f32`, every field present (defaults included; a key field without presence at its default is no key, see [`UnsetDefaults`]) | the binary message; a field the message type does not have is an error, so is an integer field holding an integer beyond 64 bits (read as `f64`, its digits lost) |
//! | `bytes` | none: the bytes pass through untouched | the bytes as they came (a changed view cannot be written as `bytes`) |
//!
//! A source value that does not decode (bad JSON, bad UTF-8, a protobuf message that does
//! not parse, a null value) goes to the dead-letter topic with the reason in the
//! `onceflow.dlq.reason` header; so does a record whose view cannot be encoded for its sink
//! topic. Decoding never panics on any input.
//!
//! The contract between stages and sinks: a stage that changes a record changes its view
//! ([`view_mut`](crate::processor::codec::view_mut) parses a JSON value on first use) and clears [`Record::fields`](crate::processor::Record::fields) (they
//! described the bytes as read); a sink writes the view, encoded in its topic's format, when
//! there is one, and otherwise the value bytes as read ([`encode_for_sink`](crate::processor::codec::encode_for_sink)). A stage may
//! instead write new value bytes in the source's format and leave no view (the enrich fast
//! path does, for JSON).
//!
//! Keys are never decoded: codecs apply to record values only.

use crate::error::Error;
use prost::Message as _;
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, Kind, MessageDescriptor, SerializeOptions,
};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;

/// The JSON pointers of a protobuf message type's fields without presence (proto3 scalars
/// not declared `optional`, through singular message fields) and the view value each holds
/// when the field is not set: on the wire such a field at its default is the field absent.
pub(crate) type UnsetDefaults = Arc<HashMap<String, Value>>;

/// The codec of a topic's record values.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Format {
    /// JSON text; a value that does not parse goes to the dead-letter topic.
    #[default]
    Json,
    /// Raw bytes, never decoded; no record view.
    Bytes,
    /// UTF-8 text; a value that is not valid UTF-8 goes to the dead-letter topic.
    String,
    /// A protobuf message of one type, described by a descriptor set.
    Protobuf(ProtoFormat),
}

impl Format {
    /// Name as written in topology files: `json`, `bytes`, `string`, `protobuf`.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Bytes => "bytes",
            Format::String => "string",
            Format::Protobuf(_) => "protobuf",
        }
    }

    /// The protobuf fields without presence and their defaults (see [`UnsetDefaults`]);
    /// `None` for the other formats, where an absent field is simply missing.
    pub(crate) fn unset_defaults(&self) -> Option<&UnsetDefaults> {
        match self {
            Format::Protobuf(p) => Some(p.unset_defaults()),
            _ => None,
        }
    }

    /// The name plus the message type for protobuf, e.g. `protobuf shop.Order`.
    pub(crate) fn describe(&self) -> String {
        match self {
            Format::Protobuf(p) => format!("protobuf {}", p.message_name()),
            other => other.name().to_string(),
        }
    }

    /// Whether records of this format have a view (all but `bytes`).
    pub(crate) fn has_view(&self) -> bool {
        !matches!(self, Format::Bytes)
    }

    /// Decode value bytes into the record view.
    ///
    /// # Errors
    /// A sentence naming the format and what is wrong (not JSON, not UTF-8, not a valid
    /// protobuf message of the type); `bytes` has no view and always fails.
    pub(crate) fn decode(&self, bytes: &[u8]) -> Result<Value, String> {
        match self {
            Format::Json => {
                serde_json::from_slice(bytes).map_err(|e| format!("value is not valid JSON: {e}"))
            }
            Format::String => std::str::from_utf8(bytes)
                .map(|s| Value::String(s.to_string()))
                .map_err(|e| format!("value is not valid UTF-8: {e}")),
            Format::Protobuf(p) => p.decode(bytes),
            Format::Bytes => Err("a bytes value has no record view".into()),
        }
    }

    /// Encode a record view into value bytes.
    ///
    /// # Errors
    /// `string` given a view that is not a string; `protobuf` given a view that does not
    /// fit the message type (an unknown field, a wrong type); `bytes` always (a view
    /// cannot be turned back into raw bytes).
    pub(crate) fn encode(&self, view: &Value) -> Result<Vec<u8>, String> {
        match self {
            Format::Json => serde_json::to_vec(view).map_err(|e| format!("cannot write JSON: {e}")),
            Format::String => match view {
                Value::String(s) => Ok(s.as_bytes().to_vec()),
                other => Err(format!(
                    "the string codec needs a string value, the record is {}",
                    json_type(other)
                )),
            },
            Format::Protobuf(p) => p.encode(view),
            Format::Bytes => Err(
                "the record was changed by a stage, and a bytes topic cannot hold a changed record; give the topic a json, string or protobuf codec"
                    .into(),
            ),
        }
    }
}

/// A protobuf message type from a descriptor set (`protoc --descriptor_set_out`, or a
/// `FileDescriptorSet` built with prost-types), decoded and encoded with prost-reflect.
#[derive(Clone)]
pub struct ProtoFormat {
    message: MessageDescriptor,
    origin: String,
    unset: UnsetDefaults,
    /// The type has `float` fields (at any depth): their view values are rewritten.
    has_float: bool,
}

impl std::fmt::Debug for ProtoFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ProtoFormat({} from {})",
            self.message.full_name(),
            self.origin
        )
    }
}

impl PartialEq for ProtoFormat {
    fn eq(&self, other: &Self) -> bool {
        self.message == other.message
    }
}

impl Eq for ProtoFormat {}

impl ProtoFormat {
    /// The message type `message` (full name, e.g. `shop.Order`) from the encoded
    /// `FileDescriptorSet` in `set`; `origin` names where the set came from, for messages.
    ///
    /// # Errors
    /// [`Error::Config`] when the set does not decode or lacks the message type (the error
    /// lists the types it has).
    pub(crate) fn from_descriptor_set(
        set: &[u8],
        message: &str,
        origin: &str,
    ) -> Result<Self, Error> {
        let pool = DescriptorPool::decode(set).map_err(|e| {
            Error::Config(format!(
                "{origin}: not a valid protobuf descriptor set: {e}"
            ))
        })?;
        let desc = pool.get_message_by_name(message).ok_or_else(|| {
            let mut have: Vec<String> = pool
                .all_messages()
                .map(|m| m.full_name().to_string())
                .collect();
            have.sort();
            Error::Config(format!(
                "{origin}: no message type {message:?} in the descriptor set (it has: {})",
                have.join(", ")
            ))
        })?;
        let mut unset = HashMap::new();
        unset_defaults(&desc, "", 0, &mut unset);
        Ok(ProtoFormat {
            has_float: has_float(&desc, 0),
            message: desc,
            origin: origin.to_string(),
            unset: Arc::new(unset),
        })
    }

    /// Read the descriptor set file at `path` and take the message type `message`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read; [`Error::Config`] when it does not
    /// decode as a `FileDescriptorSet` or lacks the message type (the error lists the
    /// types it has).
    pub fn from_file(path: impl AsRef<std::path::Path>, message: &str) -> Result<Self, Error> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        Self::from_descriptor_set(&bytes, message, &path.display().to_string())
    }

    /// Full name of the message type.
    pub(crate) fn message_name(&self) -> &str {
        self.message.full_name()
    }

    /// The message type's descriptor.
    pub fn descriptor(&self) -> &MessageDescriptor {
        &self.message
    }

    /// The fields without presence and the view value each reads as when not set (see
    /// [`UnsetDefaults`]).
    pub(crate) fn unset_defaults(&self) -> &UnsetDefaults {
        &self.unset
    }

    /// Decode a binary message into its JSON view.
    ///
    /// # Errors
    /// The bytes are not a valid message of this type.
    pub(crate) fn decode(&self, bytes: &[u8]) -> Result<Value, String> {
        let msg = DynamicMessage::decode(self.message.clone(), bytes).map_err(|e| {
            format!(
                "value is not a valid protobuf {}: {e}",
                self.message.full_name()
            )
        })?;
        let opts = SerializeOptions::new()
            .use_proto_field_name(true)
            .stringify_64_bit_integers(false)
            .skip_default_fields(false);
        let mut view = msg
            .serialize_with_options(serde_json::value::Serializer, &opts)
            .map_err(|e| {
                format!(
                    "protobuf {} has no JSON view: {e}",
                    self.message.full_name()
                )
            })?;
        if self.has_float {
            shortest_floats(&self.message, &mut view, 0);
        }
        Ok(view)
    }

    /// Encode a JSON view as a binary message of this type.
    ///
    /// # Errors
    /// The view has a field the type lacks, or a value of the wrong type.
    pub(crate) fn encode(&self, view: &Value) -> Result<Vec<u8>, String> {
        exact_integers(&self.message, view, "", 0).map_err(|e| {
            format!(
                "the record does not fit protobuf {}: {e}",
                self.message.full_name()
            )
        })?;
        let opts = DeserializeOptions::new().deny_unknown_fields(true);
        let msg = DynamicMessage::deserialize_with_options(self.message.clone(), view, &opts)
            .map_err(|e| {
                format!(
                    "the record does not fit protobuf {}: {e}",
                    self.message.full_name()
                )
            })?;
        Ok(msg.encode_to_vec())
    }
}

/// Collect into `out` the fields of `desc` without presence, by JSON pointer under
/// `prefix`, with the view value of each when not set; singular message fields are
/// followed (up to 8 levels: a recursive type stops there), repeated and map fields not
/// (an element is never absent).
fn unset_defaults(
    desc: &MessageDescriptor,
    prefix: &str,
    depth: usize,
    out: &mut HashMap<String, Value>,
) {
    if depth >= 8 {
        return;
    }
    let opts = SerializeOptions::new()
        .use_proto_field_name(true)
        .stringify_64_bit_integers(false)
        .skip_default_fields(false);
    let Ok(Value::Object(default_view)) = DynamicMessage::new(desc.clone())
        .serialize_with_options(serde_json::value::Serializer, &opts)
    else {
        return;
    };
    for field in desc.fields() {
        if field.is_list() || field.is_map() {
            continue;
        }
        let pointer = format!("{prefix}/{}", field.name());
        match field.kind() {
            Kind::Message(m) => unset_defaults(&m, &pointer, depth + 1, out),
            _ if !field.supports_presence() => {
                if let Some(v) = default_view.get(field.name()) {
                    out.insert(pointer, v.clone());
                }
            }
            _ => {}
        }
    }
}

/// Whether `desc` has a `float` field, at any depth (8 levels at most).
fn has_float(desc: &MessageDescriptor, depth: usize) -> bool {
    depth < 8
        && desc.fields().any(|f| match f.kind() {
            Kind::Float => true,
            Kind::Message(m) => has_float(&m, depth + 1),
            _ => false,
        })
}

/// The values of `float` fields in `view` (of message type `desc`) rewritten as the
/// shortest decimal that reads back as the same `f32` (`0.1`, as the protobuf JSON mapping
/// writes it), where the serializer widened the `f32` (`0.10000000149011612`).
fn shortest_floats(desc: &MessageDescriptor, view: &mut Value, depth: usize) {
    let Value::Object(fields) = view else { return };
    if depth >= 8 {
        return;
    }
    for f in desc.fields() {
        let Some(v) = fields.get_mut(f.name()) else {
            continue;
        };
        match (v, f.kind()) {
            (Value::Array(items), kind) if f.is_list() => {
                items.iter_mut().for_each(|v| fix_value(&kind, v, depth));
            }
            (Value::Object(entries), Kind::Message(entry)) if f.is_map() => {
                let kind = entry.map_entry_value_field().kind();
                entries
                    .values_mut()
                    .for_each(|v| fix_value(&kind, v, depth));
            }
            (v, kind) => fix_value(&kind, v, depth),
        }
    }
}

/// [`shortest_floats`] for one value of kind `kind`.
fn fix_value(kind: &Kind, v: &mut Value, depth: usize) {
    match (kind, &mut *v) {
        (Kind::Float, Value::Number(n)) => {
            let short = n.as_f64().map(|x| (x as f32).to_string());
            if let Some(n) = short
                .and_then(|t| t.parse::<f64>().ok())
                .and_then(serde_json::Number::from_f64)
            {
                *v = Value::Number(n);
            }
        }
        (Kind::Message(m), v) => shortest_floats(m, v, depth + 1),
        _ => {}
    }
}

/// Check that every integer field of `view` (of message type `desc`) holds an exact
/// integer: a JSON integer beyond 64 bits was read as `f64` and would be written as
/// another number (2^64 as `u64::MAX`), so an integral number past 2^53 that is not a
/// 64-bit integer is refused; ranges are then checked by the protobuf decoder.
///
/// # Errors
/// The field (by JSON pointer) and the number.
fn exact_integers(
    desc: &MessageDescriptor,
    view: &Value,
    prefix: &str,
    depth: usize,
) -> Result<(), String> {
    let Value::Object(fields) = view else {
        return Ok(());
    };
    if depth >= 8 {
        return Ok(());
    }
    for f in desc.fields() {
        let Some(v) = fields.get(f.name()) else {
            continue;
        };
        let pointer = format!("{prefix}/{}", f.name());
        let kind = if f.is_map() {
            match f.kind() {
                Kind::Message(entry) => entry.map_entry_value_field().kind(),
                _ => continue,
            }
        } else {
            f.kind()
        };
        let values: Vec<&Value> = match v {
            Value::Array(items) if f.is_list() => items.iter().collect(),
            Value::Object(entries) if f.is_map() => entries.values().collect(),
            v => vec![v],
        };
        for v in values {
            exact_integer(&kind, v, &pointer, depth)?;
        }
    }
    Ok(())
}

/// [`exact_integers`] for one value of kind `kind` at `pointer`.
fn exact_integer(kind: &Kind, v: &Value, pointer: &str, depth: usize) -> Result<(), String> {
    match (kind, v) {
        (Kind::Message(m), v) => exact_integers(m, v, pointer, depth + 1),
        (
            Kind::Int32
            | Kind::Int64
            | Kind::Uint32
            | Kind::Uint64
            | Kind::Sint32
            | Kind::Sint64
            | Kind::Fixed32
            | Kind::Fixed64
            | Kind::Sfixed32
            | Kind::Sfixed64,
            Value::Number(n),
        ) if !(n.is_i64() || n.is_u64()) => {
            if crate::processor::key::digits_lost(n.as_f64().unwrap_or(f64::NAN)) {
                Err(format!(
                    "field {pointer} is {n}, an integer beyond 64 bits or past 2^53 as a float, whose exact digits are lost"
                ))
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

/// The JSON type name of a value, for error messages.
pub(crate) fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_codec_checks_utf8_and_type() {
        assert_eq!(
            Format::String.decode(b"hi").unwrap(),
            Value::String("hi".into())
        );
        let e = Format::String.decode(&[0xff, 0xfe]).unwrap_err();
        assert_eq!(
            e,
            "value is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 0"
        );
        assert_eq!(
            Format::String
                .encode(&serde_json::json!({"a": 1}))
                .unwrap_err(),
            "the string codec needs a string value, the record is an object"
        );
    }

    #[test]
    fn json_codec_keeps_field_order() {
        let v = Format::Json.decode(br#"{"z":1,"a":[true,null]}"#).unwrap();
        assert_eq!(
            Format::Json.encode(&v).unwrap(),
            br#"{"z":1,"a":[true,null]}"#
        );
    }

    #[test]
    fn bytes_has_no_view() {
        assert_eq!(
            Format::Bytes.decode(b"x").unwrap_err(),
            "a bytes value has no record view"
        );
        assert!(!Format::Bytes.has_view());
    }

    #[test]
    fn bad_descriptor_set_is_a_config_error() {
        let e = ProtoFormat::from_descriptor_set(b"\xff\xff", "a.B", "x.desc").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("config error: x.desc: not a valid protobuf descriptor set"),
            "{e}"
        );
    }
}
