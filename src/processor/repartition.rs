//! The repartition hop of a dedup stage with `partitioning: repartition`.
//!
//! A dedup store is partition-local, so all copies of a key must reach one partition. When
//! the source does not promise that, the stage's input is written to the internal topic
//! `<application.id>-<stage>-repartition` (see [`super::stages::repartition_topic`]), keyed
//! by the dedup key bytes as extracted (raw, never decoded), on the partition Kafka's
//! default partitioner gives that key (murmur2, as a Java or librdkafka producer would), with
//! the original value, timestamp and headers, plus one header naming the source coordinates
//! ([`SOURCE`]: topic, partition, offset), which the task reading the repartition topic takes
//! off again ([`take_source`]), so that dead letters and dedup entries further down name the
//! original record while the stages see the headers as the source had them.
//! The stateless stages before the dedup (filter, map) run before routing, in the router
//! task (`runtime::Task::router`): the value routed is the one they made, and a record they
//! drop is not routed. The stages from the dedup on read the repartition topic.
//!
//! Nothing here does I/O: [`route`] is a pure function of the record.

use super::key::{KeyError, KeySource};
use super::{OutRecord, Record};
use bytes::Bytes;

/// Header a repartition record carries naming its source record: `<topic>/<partition>/<offset>`
/// (decimal; a Kafka topic name holds no `/`), e.g. `events/3/17`. The task reading the
/// repartition topic takes it off the record: the stages after the hop
/// see the headers as the source had them, while dead letters and dedup entries name the
/// source record.
pub const SOURCE: &str = "onceflow.source";

/// Header (null value) of a repartition record the router could not key (a value without
/// the key, or not decodable): it travels with its Kafka key, which is then not the dedup
/// key, and the dedup stage after the hop reads the key from the value again (and
/// dead-letters the record). A record without it is keyed by its dedup key. Taken off
/// with [`SOURCE`].
pub(crate) const UNKEYED: &str = "onceflow.source.unkeyed";

/// Header (null value) of a repartition record whose source record had no timestamp
/// (Kafka's -1): the producer stamps the repartition record with the time it is sent, and
/// the task reading it takes that stamp off again, so the dedup stage after the hop sees a
/// record without a timestamp, as the source had it. Taken off with [`SOURCE`].
pub(crate) const UNTIMED: &str = "onceflow.source.untimed";

/// Whether `name` is a header the router adds (and the reading task takes off).
fn is_router_mark(name: &str) -> bool {
    name == SOURCE || name == UNKEYED || name == UNTIMED || LEGACY.contains(&name)
}

/// The three headers that named the source record before [`SOURCE`] (topic, partition,
/// offset as text); still read, so records routed by an earlier version are processed
/// alike.
const LEGACY: [&str; 3] = [
    "onceflow.source.topic",
    "onceflow.source.partition",
    "onceflow.source.offset",
];

/// Kafka's murmur2 hash (the Java client's `Utils.murmur2`, also librdkafka's
/// `murmur2_random` partitioner).
pub(crate) fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition of `key` among `partitions` (≥ 1), as Kafka's default partitioner picks it:
/// `(murmur2(key) & 0x7fffffff) % partitions`.
pub(crate) fn partition_for(key: &[u8], partitions: i32) -> i32 {
    let n = partitions.max(1);
    (murmur2(key) & 0x7fff_ffff) % n
}

/// The source coordinates a repartitioned record carries (topic, partition, offset), or
/// `None` when the headers are absent or not well formed.
pub(crate) fn source_of(headers: &[(String, Option<Bytes>)]) -> Option<(String, i32, i64)> {
    if headers.is_empty() {
        return None;
    }
    if let Some(v) = header_text(headers, SOURCE) {
        let (t, p, o) = parse_source(v)?;
        return Some((t.to_string(), p, o));
    }
    Some((
        header_text(headers, LEGACY[0])?.to_string(),
        header_text(headers, LEGACY[1])?.parse().ok()?,
        header_text(headers, LEGACY[2])?.parse().ok()?,
    ))
}

/// `<topic>/<partition>/<offset>` split and parsed.
fn parse_source(v: &str) -> Option<(&str, i32, i64)> {
    let mut parts = v.rsplitn(3, '/');
    let offset = parts.next()?.parse().ok()?;
    let partition = parts.next()?.parse().ok()?;
    let topic = parts.next().filter(|t| !t.is_empty())?;
    Some((topic, partition, offset))
}

/// The [`SOURCE`] header's value for a record at `topic`/`partition`/`offset`, written to
/// `out` (cleared first).
pub(crate) fn source_text(topic: &str, partition: i32, offset: i64, out: &mut Vec<u8>) {
    // Written by hand: `format!` was a visible share of routing.
    out.clear();
    out.reserve(topic.len() + 32);
    out.extend_from_slice(topic.as_bytes());
    out.push(b'/');
    push_decimal(out, i64::from(partition));
    out.push(b'/');
    push_decimal(out, offset);
}

/// Whether a header named `name` is one the router writes ([`SOURCE`], [`UNKEYED`], or the
/// legacy three): a record that already carries one is routed as a [`Record`], which keeps
/// a source header as it is.
pub(crate) fn is_hop_header(name: &str) -> bool {
    name.starts_with("onceflow.source") && is_router_mark(name)
}

/// Append `n` in decimal.
fn push_decimal(out: &mut Vec<u8>, n: i64) {
    if n < 0 {
        out.push(b'-');
    }
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut m = n.unsigned_abs();
    loop {
        i -= 1;
        digits[i] = b'0' + (m % 10) as u8;
        m /= 10;
        if m == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// The first header `name` as UTF-8 text.
fn header_text<'h>(headers: &'h [(String, Option<Bytes>)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.as_deref())
        .and_then(|v| std::str::from_utf8(v).ok())
}

/// Take the source-coordinate header(s) off a record read from a repartition topic and
/// keep them as its [`Record::origin`]; `last` caches the topic name, so records of one
/// source share it. A record without well-formed coordinates keeps its headers and gets
/// no origin (it is then named by its repartition coordinates).
pub(crate) fn take_source(record: &mut Record, last: &mut Option<std::sync::Arc<str>>) {
    let Some((topic, partition, offset)) = source_of(&record.headers) else {
        return;
    };
    // Only the one-header form promises the key (the three-header form came before
    // [`UNKEYED`] did).
    let current = record.headers.iter().any(|(n, _)| n == SOURCE);
    let unkeyed = record.headers.iter().any(|(n, _)| n == UNKEYED);
    if record.headers.iter().any(|(n, _)| n == UNTIMED) {
        record.timestamp = None;
    }
    record.headers.retain(|(n, _)| !is_router_mark(n));
    record.origin = Some(origin(&topic, partition, offset, last));
    record.keyed = current && !unkeyed;
}

/// The origin named by a [`SOURCE`] header's value, or `None` when it is not well formed;
/// `last` as in [`take_source`]. For readers that see the header before it becomes part of
/// a record (the Kafka run loop: no copy of the header is made).
pub(crate) fn origin_of(
    value: &[u8],
    last: &mut Option<std::sync::Arc<str>>,
) -> Option<super::SourceMeta> {
    let (topic, partition, offset) = parse_source(std::str::from_utf8(value).ok()?)?;
    Some(origin(topic, partition, offset, last))
}

fn origin(
    topic: &str,
    partition: i32,
    offset: i64,
    last: &mut Option<std::sync::Arc<str>>,
) -> super::SourceMeta {
    let topic = match last {
        Some(t) if **t == *topic => t.clone(),
        _ => {
            let t: std::sync::Arc<str> = topic.into();
            *last = Some(t.clone());
            t
        }
    };
    super::SourceMeta {
        topic,
        partition,
        offset,
    }
}

/// The repartition record for `record`: to `topic`, keyed by the dedup key `key` takes from
/// it, on [`partition_for`] that key among `partitions`, with value, timestamp and headers as
/// read plus the [`SOURCE`] header (kept as it is when the record already
/// carries one, so the first source is named).
///
/// # Errors
/// The [`KeyError`] of a record without a usable key: such a record is not routed (the
/// caller keeps it on its source partition, where the dedup stage dead-letters it).
pub(crate) fn route(
    record: &Record,
    key: &KeySource,
    topic: &str,
    partitions: i32,
) -> Result<OutRecord, KeyError> {
    let mut k = Vec::with_capacity(32);
    key.extract_into(record, &mut k)?;
    let partition = partition_for(&k, partitions);
    Ok(with_source(
        record,
        topic,
        partition,
        Some(Bytes::from(k)),
        true,
    ))
}

/// The repartition record for `record` with its Kafka key `key` on `partition`, with value,
/// timestamp and headers as read plus the [`SOURCE`] header (kept as it is when
/// the record already carries one). [`route`] builds on it; a caller uses it directly for
/// a record without a dedup key, which the dedup stage then dead-letters.
pub(crate) fn unrouted(
    record: &Record,
    topic: &str,
    partition: i32,
    key: Option<Bytes>,
) -> OutRecord {
    with_source(record, topic, partition, key, false)
}

/// [`unrouted`], or with `keyed` the record [`route`] keyed by its dedup key (else it
/// carries [`UNKEYED`]).
fn with_source(
    record: &Record,
    topic: &str,
    partition: i32,
    key: Option<Bytes>,
    keyed: bool,
) -> OutRecord {
    // The coordinates of the record read (its origin), always: a header of these names
    // that the source record carried itself is replaced, never trusted (it would name
    // another record, and without [`UNKEYED`] make an unkeyed record keyed).
    let mut headers = record.headers.clone();
    let s = record.origin();
    let mut text = Vec::new();
    source_text(&s.topic, s.partition, s.offset, &mut text);
    headers.retain(|(n, _)| !is_router_mark(n));
    headers.push((SOURCE.into(), Some(Bytes::from(text))));
    if !keyed {
        headers.push((UNKEYED.into(), None));
    }
    if record.timestamp.is_none() {
        headers.push((UNTIMED.into(), None));
    }
    OutRecord {
        topic: topic.to_string(),
        partition: Some(partition),
        key,
        value: record.value.clone(),
        headers,
        timestamp: record.timestamp,
    }
}

/// A source message's parts as a key reads them, with what the router read from the value
/// (see [`Router::route_parts`]).
struct PartsView<'p> {
    key: Option<&'p [u8]>,
    value: Option<&'p [u8]>,
    headers: &'p [(&'p str, Option<&'p [u8]>)],
    pointers: &'p [String],
    fields: Option<Vec<super::json_scan::Scalar>>,
    json: Option<serde_json::Value>,
    /// The source's fields without presence, for a protobuf source.
    unset: Option<&'p crate::codec::UnsetDefaults>,
}

impl super::key::KeyInput for PartsView<'_> {
    fn fields(&self) -> Option<(&[String], &[super::json_scan::Scalar])> {
        self.fields.as_deref().map(|v| (self.pointers, v))
    }
    fn json(&self) -> Option<&serde_json::Value> {
        self.json.as_ref()
    }
    fn header(&self, name: &str) -> Option<Option<&[u8]>> {
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| *v)
    }
    fn kafka_key(&self) -> Option<&[u8]> {
        self.key
    }
    fn value(&self) -> Option<&[u8]> {
        self.value
    }
    fn unset(&self, ptr: &str, v: &serde_json::Value) -> bool {
        self.unset.is_some_and(|u| u.get(ptr) == Some(v))
    }
}

/// The router of a repartition hop: turns each source record into its repartition record.
///
/// It reads only the dedup key (a JSON value is scanned for the key's pointers, no tree is
/// built), and never refuses a record: one whose key cannot be read (a missing field, a
/// value that does not decode) is written to the partition its Kafka key hashes to (or
/// its source partition, modulo the count, without a Kafka key), with its Kafka key, and
/// the dedup stage on the repartition topic dead-letters it there, naming the original
/// source record.
#[derive(Debug, Clone)]
pub(crate) struct Router {
    key: KeySource,
    format: crate::codec::Format,
    topic: String,
    partitions: i32,
    pointers: std::sync::Arc<[String]>,
    tokens: Vec<Vec<String>>,
}

impl Router {
    /// The router for a dedup stage keyed by `key`, reading `format` values, writing to
    /// `topic` with `partitions` partitions (≥ 1).
    pub(crate) fn new(
        key: KeySource,
        format: crate::codec::Format,
        topic: &str,
        partitions: i32,
    ) -> Self {
        let mut pointers = Vec::new();
        key.json_pointers(&mut pointers);
        let tokens = pointers
            .iter()
            .map(|p| super::json_scan::tokens(p))
            .collect();
        Router {
            key,
            format,
            topic: topic.to_string(),
            partitions: partitions.max(1),
            pointers: pointers.into(),
            tokens,
        }
    }

    /// The repartition topic.
    /// The dedup key it routes by.
    pub(crate) fn key(&self) -> &KeySource {
        &self.key
    }

    pub(crate) fn topic(&self) -> &str {
        &self.topic
    }

    /// What the key reads from `value`: its scanned JSON fields (a `json` source) or its
    /// decoded view (another decoding format); neither when the key reads no field or the
    /// value does not decode.
    fn read_value(
        &self,
        value: Option<&[u8]>,
    ) -> (
        Option<Vec<super::json_scan::Scalar>>,
        Option<serde_json::Value>,
    ) {
        use crate::codec::Format;
        if !self.key.needs_json() {
            return (None, None);
        }
        match (&self.format, value) {
            (Format::Json, Some(v)) => (super::json_scan::scan(v, &self.tokens).ok(), None),
            (Format::Bytes, _) | (_, None) => (None, None),
            (other, Some(v)) => (None, other.decode(v).ok()),
        }
    }

    /// The partition of a record whose dedup key could not be read: its Kafka key's, or
    /// without one its source partition's (modulo the count).
    fn unkeyed_partition(&self, kafka_key: Option<&[u8]>, source_partition: i32) -> i32 {
        match kafka_key {
            Some(k) => partition_for(k, self.partitions),
            None => source_partition.rem_euclid(self.partitions),
        }
    }

    /// Route a source message given by its parts, in place (the Kafka run loop routes a
    /// message without copying it into a [`Record`] when no stage runs before the hop),
    /// exactly as [`Router::route`] routes the record made of them: `headers` holds the
    /// message's headers, and gets the [`SOURCE`] header (its value written to `text`) and
    /// [`UNKEYED`] as `route` adds them. Returns the partition and whether the message is
    /// keyed by its dedup key, which is then in `key_out`; otherwise it keeps its Kafka key.
    /// A message that already carries a [hop header](is_hop_header) is routed as a record.
    pub(crate) fn route_parts<'a>(
        &self,
        (kafka_key, value, timestamp): (Option<&[u8]>, Option<&[u8]>, Option<i64>),
        headers: &mut Vec<(&'a str, Option<&'a [u8]>)>,
        (topic, partition, offset): (&str, i32, i64),
        key_out: &mut Vec<u8>,
        text: &'a mut Vec<u8>,
    ) -> (i32, bool) {
        let (fields, json) = self.read_value(value);
        let view = PartsView {
            key: kafka_key,
            value,
            headers,
            pointers: &self.pointers,
            fields,
            json,
            unset: self.format.unset_defaults(),
        };
        let (to, keyed) = match self.key.extract_into(&view, key_out) {
            Ok(()) => (partition_for(key_out, self.partitions), true),
            Err(_) => (self.unkeyed_partition(kafka_key, partition), false),
        };
        source_text(topic, partition, offset, text);
        headers.push((SOURCE, Some(&text[..])));
        if !keyed {
            headers.push((UNKEYED, None));
        }
        if timestamp.is_none() {
            headers.push((UNTIMED, None));
        }
        (to, keyed)
    }

    /// The repartition record of `record` (see [`route`] and the type's docs). The key is
    /// always read from the value bytes routed, as the dedup stage after the hop reads it,
    /// never from a view or fields the stages before the hop left: the two can differ (a
    /// map re-encodes numbers beyond 64 bits as floats), and a key read here but not there
    /// (or the reverse) would split the copies of an id over partitions.
    pub(crate) fn route(&self, mut record: Record) -> OutRecord {
        let (fields, json) = self.read_value(record.value.as_deref());
        record.fields = fields.map(|vals| (self.pointers.clone(), vals));
        record.json = json;
        record.unset = self.format.unset_defaults().cloned();
        route(&record, &self.key, &self.topic, self.partitions).unwrap_or_else(|_| {
            let p = self.unkeyed_partition(record.key.as_deref(), record.source.partition);
            unrouted(&record, &self.topic, p, record.key.clone())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values from the Java client (`Utils.murmur2` / `DefaultPartitioner`), as published
    /// in Kafka's own partitioner tests.
    #[test]
    fn murmur2_matches_kafka() {
        assert_eq!(murmur2(b"21"), -973_932_308);
        assert_eq!(murmur2(b"foobar"), -790_332_482);
        assert_eq!(murmur2(b"a-little-bit-long-string"), -985_981_536);
        assert_eq!(murmur2(b"a-little-bit-longer-string"), -1_486_304_829);
        assert_eq!(
            murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8"),
            -58_897_971
        );
        assert_eq!(murmur2(b"abc"), 479_470_107);
    }

    #[test]
    fn decimals_are_written_as_rust_writes_them() {
        for n in [
            0,
            7,
            -1,
            10,
            99,
            -100,
            i64::from(i32::MAX),
            i64::MIN,
            i64::MAX,
        ] {
            let mut v = Vec::new();
            push_decimal(&mut v, n);
            assert_eq!(String::from_utf8(v).unwrap(), n.to_string());
        }
    }

    #[test]
    fn partition_is_stable_and_in_range() {
        for n in 1..9 {
            for k in [&b""[..], b"a", b"\xff\x00binary", b"event-42"] {
                let p = partition_for(k, n);
                assert!((0..n).contains(&p));
                assert_eq!(p, partition_for(k, n));
            }
        }
    }

    #[test]
    fn source_headers_round_trip_and_are_kept_once() {
        let rec = Record {
            key: Some(Bytes::from_static(b"user-1")),
            value: Some(Bytes::from_static(br#"{"id":"x"}"#)),
            headers: vec![("h".into(), Some(Bytes::from_static(b"v")))],
            timestamp: Some(42),
            json: Some(serde_json::json!({"id": "x"})),
            fields: None,
            source: crate::processor::SourceMeta {
                topic: "events".into(),
                partition: 3,
                offset: 17,
            },
            origin: None,
            keyed: false,
            dedup_key: None,
            as_read: None,
            view_edited: false,
            unset: None,
        };
        let key = KeySource::JsonPointer("/id".into());
        let out = route(&rec, &key, "app-d-repartition", 4).unwrap();
        assert_eq!(out.key.as_deref(), Some(&b"x"[..]));
        assert_eq!(out.partition, Some(partition_for(b"x", 4)));
        assert_eq!(out.timestamp, Some(42));
        assert_eq!(out.headers[0].0, "h");
        assert_eq!(out.headers.len(), 2, "one header names the source");
        assert_eq!(out.headers[1].0, SOURCE);
        assert_eq!(out.headers[1].1.as_deref(), Some(&b"events/3/17"[..]));
        assert_eq!(source_of(&out.headers), Some(("events".into(), 3, 17)));
        // Read back: the task takes the header off and keeps it as the origin.
        let mut back = rec.clone();
        back.headers = out.headers.clone();
        back.source.topic = "app-d-repartition".into();
        back.source.offset = 5;
        let mut last = None;
        take_source(&mut back, &mut last);
        assert_eq!(
            back.headers, rec.headers,
            "the source's headers, as they were"
        );
        assert_eq!(
            (
                &*back.origin().topic,
                back.origin().partition,
                back.origin().offset
            ),
            ("events", 3, 17)
        );
        assert_eq!(back.source.offset, 5, "the position read stays");
        // Three headers, as written before the one header: read alike.
        let mut legacy = back.clone();
        legacy.origin = None;
        let t = |v: &str| Some(Bytes::from(v.to_string()));
        legacy
            .headers
            .push(("onceflow.source.topic".into(), t("events")));
        legacy
            .headers
            .push(("onceflow.source.partition".into(), t("3")));
        legacy
            .headers
            .push(("onceflow.source.offset".into(), t("17")));
        take_source(&mut legacy, &mut last);
        assert_eq!(legacy.headers, rec.headers);
        assert_eq!(legacy.origin(), back.origin());
        // Malformed: kept as it is, no origin.
        let mut bad = back.clone();
        bad.origin = None;
        bad.headers.push((SOURCE.into(), t("events/x/17")));
        take_source(&mut bad, &mut last);
        assert_eq!(bad.headers.len(), 2);
        assert_eq!(bad.origin(), &bad.source);
        // A second hop keeps the first source: the record read back has it as its origin.
        let mut again = back.clone();
        again.source.offset = 99;
        let out2 = route(&again, &key, "t", 4).unwrap();
        assert_eq!(source_of(&out2.headers), Some(("events".into(), 3, 17)));
        assert_eq!(out2.headers.len(), out.headers.len());
        // Hop headers a source record carried itself are replaced, never trusted.
        let mut carried = rec.clone();
        carried.headers = out.headers.clone();
        carried.source.offset = 99;
        let out3 = route(&carried, &key, "t", 4).unwrap();
        assert_eq!(source_of(&out3.headers), Some(("events".into(), 3, 99)));
        assert_eq!(out3.headers.len(), out.headers.len());
        // The router: keyed by the scanned key; a record without one keeps its Kafka key.
        let router = Router::new(key.clone(), crate::codec::Format::Json, "t", 4);
        let mut raw = rec.clone();
        raw.json = None;
        let r = router.route(raw.clone());
        assert_eq!(r.key.as_deref(), Some(&b"x"[..]));
        assert_eq!(r.partition, Some(partition_for(b"x", 4)));
        raw.value = Some(Bytes::from_static(b"not json"));
        let r = router.route(raw);
        assert_eq!(r.key.as_deref(), Some(&b"user-1"[..]));
        assert_eq!(r.partition, Some(partition_for(b"user-1", 4)));
        assert_eq!(source_of(&r.headers), Some(("events".into(), 3, 17)));
        // No key: not routed.
        let mut none = rec;
        none.json = Some(serde_json::json!({}));
        assert!(route(&none, &key, "t", 4).is_err());
    }

    /// The run loop routes a message in place ([`Router::route_parts`]) when no stage runs
    /// before the hop; it must write exactly the record [`Router::route`] writes for the
    /// same message, or copies of an id could land on two partitions.
    #[test]
    fn routing_in_place_writes_what_routing_a_record_writes() {
        use crate::codec::Format;
        let json = KeySource::JsonPointer("/id".into());
        let keys = [
            (json.clone(), Format::Json),
            (json.clone(), Format::String),
            (json.clone(), Format::Bytes),
            (KeySource::Header("msg-id".into()), Format::Json),
            (KeySource::KafkaKey, Format::Json),
            (KeySource::ValueHash, Format::Bytes),
            (
                KeySource::Composite(vec![json, KeySource::Header("msg-id".into())]),
                Format::Json,
            ),
        ];
        let values = [
            r#"{"id":"a-1","n":1}"#,
            r#"{"id":18446744073709551617}"#,
            r#"{"id":null}"#,
            r#"{"n":2}"#,
            r#"{"id":{"x":1}}"#,
            "not json",
        ];
        let headers: [&[(&str, &[u8])]; 3] =
            [&[], &[("msg-id", b"m7")], &[("a", b"1"), ("msg-id", b"")]];
        let mut checked = 0;
        for (key, format) in &keys {
            let router = Router::new(key.clone(), format.clone(), "app-d-repartition", 6);
            for value in values {
                for hs in headers {
                    for kafka_key in [Some(&b"k9"[..]), None] {
                        let mut rec = Record::for_test(b"", value, hs, ("events", 5, 1234), 42);
                        rec.key = kafka_key.map(Bytes::copy_from_slice);
                        let want = router.route(rec.clone());
                        let mut borrowed: Vec<(&str, Option<&[u8]>)> =
                            hs.iter().map(|(k, v)| (*k, Some(*v))).collect();
                        let (mut key_out, mut text) = (Vec::new(), Vec::new());
                        let (partition, keyed) = router.route_parts(
                            (kafka_key, rec.value.as_deref(), rec.timestamp),
                            &mut borrowed,
                            ("events", 5, 1234),
                            &mut key_out,
                            &mut text,
                        );
                        let got = super::super::OutRecord {
                            topic: router.topic().to_string(),
                            partition: Some(partition),
                            key: if keyed {
                                Some(Bytes::from(key_out.clone()))
                            } else {
                                kafka_key.map(Bytes::copy_from_slice)
                            },
                            value: rec.value.clone(),
                            headers: borrowed
                                .iter()
                                .map(|(k, v)| (k.to_string(), v.map(Bytes::copy_from_slice)))
                                .collect(),
                            timestamp: rec.timestamp,
                        };
                        assert_eq!(got, want, "{key:?} {format:?} {value} {hs:?} {kafka_key:?}");
                        checked += usize::from(keyed);
                    }
                }
            }
        }
        assert!(
            checked > 20,
            "most cases are keyed by the dedup key: {checked}"
        );
    }
}
