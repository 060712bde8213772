//! The dedup decision: a pure function of (previous entry, observation, policy).
//!
//! Nothing here does I/O or knows about Kafka, sled or tokio. The stateful dedup stage
//! (`processor::stages::Dedup`) looks the entry up, calls [`decide`], and stages the new
//! entry in the partition's pending batch; the runtime applies that batch only once the
//! output it stands for is durable (see `runtime::task`).
//!
//! Contract (DESIGN.md, "The dedup stage"):
//! - an entry expires when `record_time - first_seen > ttl`, judged per key: a record whose
//!   time is earlier than the entry's first-seen time is a duplicate, never "expired";
//! - a duplicate never rewrites the entry, so first-seen time and source position stay those
//!   of the first occurrence;
//! - with fingerprints on, the same key with a different payload hash is a conflict.

/// The stored state of one dedup key, prost-encoded in the store and the changelog.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct DedupEntry {
    /// Time of the first occurrence, ms since the epoch (record time or processing time).
    #[prost(int64, tag = "1")]
    pub first_seen_ms: i64,
    /// Source partition of the first occurrence.
    #[prost(int32, tag = "2")]
    pub source_partition: i32,
    /// Source offset of the first occurrence.
    #[prost(int64, tag = "3")]
    pub source_offset: i64,
    /// Payload fingerprint (xxh3-64 of the value) when fingerprints are on.
    #[prost(uint64, optional, tag = "4")]
    pub fingerprint: Option<u64>,
    /// The partition's stream time (ms) when the entry was written, when it was later than
    /// `first_seen_ms` (a late first occurrence). The sweep counts the expiry from the
    /// later of the two, so a late first occurrence keeps its entry for a full window after
    /// it arrived. `None` in entries written before this field existed (and when stream
    /// time was not ahead): the sweep then counts from `first_seen_ms` alone.
    #[prost(int64, optional, tag = "5")]
    pub written_stream_ms: Option<i64>,
    /// `first_seen_ms` is not the record's own time: under event time its record had no
    /// timestamp (Kafka's -1), so it took the partition's stream time (or, before any, the
    /// wall clock). Such entries, and seeded ones, do not set stream time after a restart.
    #[prost(bool, tag = "6")]
    pub untimed: bool,
}

impl DedupEntry {
    /// The time the sweep counts this entry's expiry from, in ms: the later of its
    /// first-seen time and the stream time when it was written.
    pub(crate) fn sweep_base_ms(&self) -> i64 {
        self.written_stream_ms
            .map_or(self.first_seen_ms, |w| w.max(self.first_seen_ms))
    }
}

/// What the dedup stage knows about the record being judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Observation {
    /// The record's time in ms: its timestamp (event time) or the wall clock (processing time).
    pub(crate) time_ms: i64,
    /// Source partition.
    pub(crate) partition: i32,
    /// Source offset.
    pub(crate) offset: i64,
    /// Payload fingerprint, when fingerprints are on.
    pub(crate) fingerprint: Option<u64>,
}

/// The dedup window and options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Policy {
    /// Time to live of an entry, in ms (default 24 h).
    pub(crate) ttl_ms: i64,
}

/// The verdict on one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Decision {
    /// No live entry: the first occurrence; it goes on and its entry is written.
    First,
    /// An entry existed but had expired: treated as a first occurrence again.
    Renewed,
    /// A live entry exists (and the fingerprint, if any, matches): dropped.
    Duplicate,
    /// A live entry exists with a different fingerprint: same key, other payload.
    Conflict,
}

impl Decision {
    /// Whether the record goes on downstream as a first occurrence.
    pub(crate) fn passes(self) -> bool {
        matches!(self, Decision::First | Decision::Renewed)
    }
}

/// Whether `entry` is expired for a record at `time_ms` under `policy`.
pub(crate) fn is_expired(entry: &DedupEntry, time_ms: i64, policy: &Policy) -> bool {
    time_ms.saturating_sub(entry.first_seen_ms) > policy.ttl_ms
}

/// Judge one record against the previous entry of its key.
///
/// Returns the decision and, when the record passes, the entry to write once its output is
/// durable. Duplicates and conflicts return `None`: the stored entry stays as it was.
pub(crate) fn decide(
    prev: Option<&DedupEntry>,
    obs: &Observation,
    policy: &Policy,
) -> (Decision, Option<DedupEntry>) {
    let fresh = || DedupEntry {
        first_seen_ms: obs.time_ms,
        source_partition: obs.partition,
        source_offset: obs.offset,
        fingerprint: obs.fingerprint,
        written_stream_ms: None,
        untimed: false,
    };
    match prev {
        None => (Decision::First, Some(fresh())),
        Some(e) if is_expired(e, obs.time_ms, policy) => (Decision::Renewed, Some(fresh())),
        Some(e) => match (e.fingerprint, obs.fingerprint) {
            (Some(a), Some(b)) if a != b => (Decision::Conflict, None),
            _ => (Decision::Duplicate, None),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    const MIN: i64 = 60_000;

    fn obs(t: i64, fp: Option<u64>) -> Observation {
        Observation {
            time_ms: t,
            partition: 1,
            offset: t,
            fingerprint: fp,
        }
    }

    fn entry(t: i64, fp: Option<u64>) -> DedupEntry {
        DedupEntry {
            first_seen_ms: t,
            source_partition: 0,
            source_offset: 7,
            fingerprint: fp,
            written_stream_ms: None,
            untimed: false,
        }
    }

    #[test]
    fn decision_table() {
        let p = Policy { ttl_ms: 10 * MIN };
        // (previous entry, record time, fingerprint, expected decision)
        let cases: Vec<(Option<DedupEntry>, i64, Option<u64>, Decision)> = vec![
            (None, 0, None, Decision::First),
            (Some(entry(0, None)), 0, None, Decision::Duplicate),
            (Some(entry(0, None)), 10 * MIN, None, Decision::Duplicate), // exactly ttl: live
            (Some(entry(0, None)), 10 * MIN + 1, None, Decision::Renewed),
            (Some(entry(0, None)), 11 * MIN, None, Decision::Renewed),
            (Some(entry(60 * MIN, None)), 0, None, Decision::Duplicate), // late record: not expired
            (Some(entry(0, Some(1))), MIN, Some(1), Decision::Duplicate),
            (Some(entry(0, Some(1))), MIN, Some(2), Decision::Conflict),
            (
                Some(entry(0, Some(1))),
                11 * MIN,
                Some(2),
                Decision::Renewed,
            ),
            (Some(entry(0, None)), MIN, Some(2), Decision::Duplicate), // no stored fingerprint
            (
                Some(entry(i64::MIN, None)),
                i64::MAX,
                None,
                Decision::Renewed,
            ), // no overflow
        ];
        for (i, (prev, t, fp, want)) in cases.into_iter().enumerate() {
            let (got, new) = decide(prev.as_ref(), &obs(t, fp), &p);
            assert_eq!(got, want, "case {i}");
            assert_eq!(
                new.is_some(),
                want.passes(),
                "case {i}: entry written iff passed"
            );
            if let Some(n) = new {
                assert_eq!(
                    n.first_seen_ms, t,
                    "case {i}: first-seen is the record time"
                );
                assert_eq!((n.source_partition, n.source_offset), (1, t));
            }
        }
    }

    #[test]
    fn entries_without_the_write_stream_time_decode_and_sweep_by_first_seen() {
        use prost::Message;
        // An entry as encoded before `written_stream_ms` existed: tags 1-4 only.
        #[derive(Clone, PartialEq, prost::Message)]
        struct OldEntry {
            #[prost(int64, tag = "1")]
            first_seen_ms: i64,
            #[prost(int32, tag = "2")]
            source_partition: i32,
            #[prost(int64, tag = "3")]
            source_offset: i64,
            #[prost(uint64, optional, tag = "4")]
            fingerprint: Option<u64>,
        }
        let old = OldEntry {
            first_seen_ms: 5 * MIN,
            source_partition: 2,
            source_offset: 9,
            fingerprint: Some(3),
        };
        let e = DedupEntry::decode(old.encode_to_vec().as_slice()).unwrap();
        assert_eq!(e.written_stream_ms, None);
        assert_eq!(e.sweep_base_ms(), 5 * MIN, "old entries keep today's rule");
        let late = DedupEntry {
            written_stream_ms: Some(180 * MIN),
            ..e.clone()
        };
        assert_eq!(late.sweep_base_ms(), 180 * MIN);
        let back = OldEntry::decode(late.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back, old, "an older reader skips the new field");
    }

    #[test]
    fn entry_roundtrips_through_prost() {
        use prost::Message;
        let mut e = entry(1_420_070_400_000, Some(u64::MAX));
        e.written_stream_ms = Some(1_420_080_400_000);
        let bytes = e.encode_to_vec();
        assert_eq!(DedupEntry::decode(bytes.as_slice()).unwrap(), e);
    }

    proptest! {
        /// The decision over a stream equals a HashMap model of "first time of each key,
        /// reset when the record time passes first + ttl".
        #[test]
        fn matches_hashmap_model(
            ttl in 1i64..50,
            events in proptest::collection::vec((0u8..8, 0i64..200), 0..300),
        ) {
            let p = Policy { ttl_ms: ttl };
            let mut store: HashMap<u8, DedupEntry> = HashMap::new();
            let mut model: HashMap<u8, i64> = HashMap::new();
            for (i, (k, t)) in events.into_iter().enumerate() {
                let o = Observation { time_ms: t, partition: 0, offset: i as i64, fingerprint: None };
                let (d, new) = decide(store.get(&k), &o, &p);
                if let Some(n) = new { store.insert(k, n); }
                let model_passes = match model.get(&k) {
                    None => true,
                    Some(first) => t - first > ttl,
                };
                if model_passes { model.insert(k, t); }
                prop_assert_eq!(d.passes(), model_passes);
                prop_assert_eq!(store.get(&k).map(|e| e.first_seen_ms), model.get(&k).copied());
            }
        }
    }
}
