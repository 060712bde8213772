//! The record that flows through a topology.

use bytes::Bytes;
use std::sync::Arc;

/// Where a record was read from: source topic, partition and offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceMeta {
    /// Source topic name.
    pub topic: Arc<str>,
    /// Source partition.
    pub partition: i32,
    /// Offset of the record in its partition.
    pub offset: i64,
}

/// One record: raw key and value bytes, headers, timestamp, and its source position.
///
/// Keys and header values are raw bytes and are never decoded lossily; clones share the
/// bytes (`Bytes`), so a copy kept for the dead-letter topic costs no allocation. When the source
/// format is JSON the decoded value is kept in [`Record::json`] next to the original bytes,
/// so a stage that only reads it costs one parse and the sink writes the bytes unchanged.
#[derive(Debug, Clone)]
pub struct Record {
    /// Kafka key, `None` for a null key.
    pub key: Option<Bytes>,
    /// Kafka value, `None` for a tombstone / null value.
    pub value: Option<Bytes>,
    /// Headers in order; a header value may be null.
    pub headers: Vec<(String, Option<Bytes>)>,
    /// Record timestamp in milliseconds since the epoch (event time), if the record had one.
    pub timestamp: Option<i64>,
    /// Decoded JSON value, when the source format is `json` and a stage needs the tree.
    pub json: Option<serde_json::Value>,
    /// Values picked by JSON pointer when the source was decoded without a tree: the
    /// pointers (shared by all records of a task) and the value found at each.
    pub(crate) fields: Option<(Arc<[String]>, Vec<super::json_scan::Scalar>)>,
    /// Where the record came from.
    pub source: SourceMeta,
    /// Behind a repartition hop: the source record this one was routed from (see
    /// [`Record::origin`]).
    pub(crate) origin: Option<SourceMeta>,
    /// Read from a repartition topic, routed by its dedup key: its Kafka key is the key the
    /// hop's dedup stage takes, and its value was read as valid by the router when that key
    /// came from it (see [`crate::processor::repartition::UNKEYED`]).
    pub(crate) keyed: bool,
    /// The key a dedup stage upstream decided this record by, byte for byte, when an
    /// external sink after it takes that key as its idempotency key (its default): the sink
    /// uses it rather than reading the key again from a value a `map` may have rewritten.
    pub(crate) dedup_key: Option<Bytes>,
    /// The record as its task read it, kept when an external sink may fail it late (at the
    /// commit, after stages such as a `map` rewrote it): its dead letter carries this.
    pub(crate) as_read: Option<Arc<AsRead>>,
    /// A stage changed [`Record::json`] (a `map`, an `enrich` through the tree): sinks
    /// encode the view. While false, the view (when one was made, to read it) says what the
    /// value bytes say, and a sink of the source's format writes those bytes as read, so
    /// reading a value never changes it (number forms, spacing, protobuf unknown fields).
    pub(crate) view_edited: bool,
    /// Read from a protobuf source: its fields without presence and the value each reads
    /// as when not set; while the view is as read, a key field holding that value is absent
    /// (see [`crate::processor::key::KeyInput::unset`]).
    pub(crate) unset: Option<crate::codec::UnsetDefaults>,
}

/// Key, value, headers and timestamp of a record as its task read it (clones of the
/// record's own bytes: no copy).
#[derive(Debug, Clone)]
pub(crate) struct AsRead {
    pub(crate) key: Option<Bytes>,
    pub(crate) value: Option<Bytes>,
    pub(crate) headers: Vec<(String, Option<Bytes>)>,
    pub(crate) timestamp: Option<i64>,
}

impl Record {
    /// The source record this record stands for: behind a repartition hop, the record the
    /// router read from the source topic (its topic, partition and offset); otherwise
    /// [`Record::source`]. Dead letters and dedup entries name it.
    pub fn origin(&self) -> &SourceMeta {
        self.origin.as_ref().unwrap_or(&self.source)
    }

    /// The first header named `name`, as raw bytes (`Some(None)` for a null header value).
    pub fn header(&self, name: &str) -> Option<Option<&[u8]>> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_deref())
    }
}

#[cfg(test)]
impl Record {
    /// A record for unit tests: `key`, `value` and `headers` as given, read from
    /// `(topic, partition, offset)` with timestamp `timestamp`, no decoded view.
    pub(crate) fn for_test(
        key: &[u8],
        value: &str,
        headers: &[(&str, &[u8])],
        (topic, partition, offset): (&str, i32, i64),
        timestamp: i64,
    ) -> Record {
        Record {
            key: Some(Bytes::copy_from_slice(key)),
            value: Some(Bytes::from(value.to_string())),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), Some(Bytes::copy_from_slice(v))))
                .collect(),
            timestamp: Some(timestamp),
            json: None,
            fields: None,
            source: SourceMeta {
                topic: topic.into(),
                partition,
                offset,
            },
            origin: None,
            keyed: false,
            dedup_key: None,
            as_read: None,
            view_edited: false,
            unset: None,
        }
    }
}

/// A record bound for a Kafka topic (a sink output, a dead letter or a changelog write).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutRecord {
    /// Destination topic.
    pub topic: String,
    /// Destination partition; `None` lets the producer's partitioner choose by key.
    pub partition: Option<i32>,
    /// Key bytes.
    pub key: Option<Bytes>,
    /// Value bytes.
    pub value: Option<Bytes>,
    /// Headers.
    pub headers: Vec<(String, Option<Bytes>)>,
    /// Timestamp in ms; `None` lets the producer stamp wall-clock time.
    pub timestamp: Option<i64>,
}
