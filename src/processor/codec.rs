//! The record side of the codecs ([`crate::codec`]): a record's view, and the value bytes a
//! sink writes for it.

use super::record::Record;
use crate::codec::Format;
use bytes::Bytes;
use serde_json::Value;

/// The record view of `record`, parsing its value as JSON first if no stage or source
/// decoder did (sources of format `string` and `protobuf` are decoded when read; a `json`
/// source only when a stage asks, here).
///
/// # Errors
/// The value is null or not JSON (it is then not from a JSON source: the topology checks
/// that view-using stages follow a source with a view).
pub(crate) fn view_mut(record: &mut Record) -> Result<&mut Value, String> {
    if record.json.is_none() {
        let v = match record.value.as_deref() {
            None => return Err("value is null, the stage needs a record value".into()),
            Some(b) => Format::Json.decode(b)?,
        };
        record.json = Some(v);
    }
    Ok(record.json.as_mut().expect("set above"))
}

/// Whether a value read in `source` format and not decoded into a view goes to a sink of
/// `sink` format as its bytes were read (same format, or raw bytes).
pub(crate) fn written_as_read(source: &Format, sink: &Format) -> bool {
    sink == source || matches!(sink, Format::Bytes)
}

/// The value bytes to write for `record` to a topic of format `sink`, the source being of
/// format `source`: the value bytes as read when no stage edited the view
/// ([`Record::view_edited`]) and the formats agree, or when the sink is `bytes`; the view
/// encoded when a stage edited it or when a view exists and the formats differ; otherwise
/// decoded with `source` and encoded with `sink`.
///
/// # Errors
/// The view does not encode in `sink` format, or the source value does not decode.
pub(crate) fn encode_for_sink(
    record: &Record,
    source: &Format,
    sink: &Format,
) -> Result<Option<Bytes>, String> {
    if let Some(view) = &record.json {
        if matches!(sink, Format::Bytes) && !matches!(source, Format::Bytes) {
            // Decoded but the sink wants raw bytes: write what was read.
            return Ok(record.value.clone());
        }
        if !record.view_edited && sink == source {
            // Decoded only to be read: the bytes say the same, and more exactly.
            return Ok(record.value.clone());
        }
        return sink.encode(view).map(|b| Some(Bytes::from(b)));
    }
    let Some(value) = record.value.as_ref() else {
        return Ok(None);
    };
    if written_as_read(source, sink) {
        return Ok(Some(value.clone()));
    }
    let view = source.decode(value)?;
    sink.encode(&view).map(|b| Some(Bytes::from(b)))
}
