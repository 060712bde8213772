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
//! | `protobuf` | the message in the protobuf JSON mapping with the `.proto` field names, 64-bit integers as numbers, every field present (defaults included) | the binary message; a field the message type does not have is an error |
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
    DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor, SerializeOptions,
};
use serde_json::Value;

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
        Ok(ProtoFormat {
            message: desc,
            origin: origin.to_string(),
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
        msg.serialize_with_options(serde_json::value::Serializer, &opts)
            .map_err(|e| {
                format!(
                    "protobuf {} has no JSON view: {e}",
                    self.message.full_name()
                )
            })
    }

    /// Encode a JSON view as a binary message of this type.
    ///
    /// # Errors
    /// The view has a field the type lacks, or a value of the wrong type.
    pub(crate) fn encode(&self, view: &Value) -> Result<Vec<u8>, String> {
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
