//! Built-in stages: dedup and topic sink.

use super::dedup::{decide, Decision, DedupEntry, Observation, Policy};
use super::key::KeySource;
use super::{Context, OutRecord, Processor, Record, StageError};
use crate::error::RecordError;
use prost::Message;

/// Which clock a dedup stage judges the TTL by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TimeSource {
    /// The record timestamp (event time); the default. A record without a timestamp falls
    /// back to the wall clock.
    #[default]
    Event,
    /// The wall clock when the record is processed.
    Processing,
}

/// What a dedup stage does with a record whose key is known with another payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConflictPolicy {
    /// Let it through as if it were new (the entry keeps the first payload's fingerprint).
    Pass,
    /// Drop it like a duplicate (counted as a conflict).
    #[default]
    Drop,
    /// Send it to the dead-letter topic.
    DeadLetter,
}

/// Settings of a dedup stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupSpec {
    /// Where the dedup key comes from.
    pub key: KeySource,
    /// Window length in ms (default 24 h).
    pub ttl_ms: i64,
    /// Event time (default) or processing time.
    pub time: TimeSource,
    /// Store a payload fingerprint and report same-key-other-payload as a conflict.
    pub fingerprint: bool,
    /// What to do with a conflict.
    pub on_conflict: ConflictPolicy,
    /// Grace after the TTL, in ms (default 1 h): the sweep deletes an entry once the
    /// partition's stream time passes first-seen + TTL + grace, and the changelog keeps
    /// records for TTL + grace (`retention.ms`).
    pub grace_ms: i64,
    /// Keys kept per partition at most (default unlimited); the oldest are evicted.
    pub max_keys: Option<u64>,
}

impl DedupSpec {
    /// A dedup on `key` with a 24 h TTL on event time, no fingerprint.
    pub fn new(key: KeySource) -> Self {
        DedupSpec {
            key,
            ttl_ms: 24 * 3600 * 1000,
            time: TimeSource::Event,
            fingerprint: false,
            on_conflict: ConflictPolicy::Drop,
            grace_ms: 3600 * 1000,
            max_keys: None,
        }
    }

    /// Limit the keys kept per partition (default none); past it, the entries with the
    /// oldest first-seen time are evicted (with a changelog tombstone), counted in
    /// `onceflow_dedup_evicted_total`.
    pub fn with_max_keys(mut self, max: u64) -> Self {
        self.max_keys = Some(max);
        self
    }

    /// `retention.ms` of the changelog: TTL + grace.
    pub fn changelog_retention_ms(&self) -> i64 {
        self.ttl_ms.saturating_add(self.grace_ms)
    }
}

/// Entries the expiry sweep looks at per commit and store partition.
pub const SWEEP_BATCH: usize = 1000;

struct StageMetrics {
    passed: metrics::Counter,
    duplicate: metrics::Counter,
    conflict: metrics::Counter,
    error: metrics::Counter,
    check: metrics::Histogram,
}

impl StageMetrics {
    fn new(topology: &str, stage: &str) -> Self {
        let c = |result: &'static str| {
            metrics::counter!(crate::metrics::RECORDS_PROCESSED,
                "topology" => topology.to_string(), "stage" => stage.to_string(), "result" => result)
        };
        StageMetrics {
            passed: c("passed"),
            duplicate: c("duplicate"),
            conflict: c("conflict"),
            error: c("error"),
            check: metrics::histogram!(crate::metrics::DEDUP_CHECK_SECONDS,
                "topology" => topology.to_string(), "stage" => stage.to_string()),
        }
    }
}

/// The stateful dedup stage: looks the key up in its store, applies [`decide`], stages the
/// new entry (applied by the runtime only once the output is durable), forwards firsts.
pub struct Dedup {
    name: String,
    store: String,
    spec: DedupSpec,
    key_buf: Vec<u8>,
    value_buf: Vec<u8>,
    metrics: StageMetrics,
    sweep_after: Option<Vec<u8>>,
    swept: metrics::Counter,
    /// The two highest record times seen (highest first). The sweep goes by the second:
    /// stream time that one far-future timestamp alone cannot move.
    top_times: [i64; 2],
    topology: String,
    book: Option<KeyBook>,
    checks: u64,
}

/// The keys of one dedup store partition: their count (the `onceflow_dedup_keys` gauge)
/// and, with `max_keys`, the keys by first-seen time for eviction. Built by one scan of
/// the store when the task processes its first record (after its restore), then kept up
/// to date by the stage's own writes.
struct KeyBook {
    count: u64,
    by_age: Option<std::collections::BTreeSet<(i64, Vec<u8>)>>,
    gauge: metrics::Gauge,
    evicted: metrics::Counter,
}

impl KeyBook {
    fn build(
        store: &mut crate::state::StagedStore,
        with_index: bool,
        gauge: metrics::Gauge,
        evicted: metrics::Counter,
    ) -> Result<KeyBook, crate::error::Error> {
        let mut book = KeyBook {
            count: 0,
            by_age: with_index.then(Default::default),
            gauge,
            evicted,
        };
        // Without max_keys only the count is needed: a store that knows it (its engine was
        // empty when opened, e.g. after a restore into a fresh state dir) spares the scan.
        if !with_index {
            if let Some(n) = store.known_len() {
                book.count = n;
                book.gauge.set(n as f64);
                return Ok(book);
            }
        }
        // One pass over the committed state (no wait for writes still going to the engine).
        let name = store.name().to_string();
        store.for_each_committed(|k, v| {
            book.count += 1;
            if let Some(idx) = &mut book.by_age {
                let e = DedupEntry::decode(v).map_err(|e| {
                    crate::error::Error::state(&name, format!("corrupt dedup entry: {e}"))
                })?;
                idx.insert((e.first_seen_ms, k.to_vec()));
            }
            Ok(())
        })?;
        book.gauge.set(book.count as f64);
        Ok(book)
    }

    fn added(&mut self, key: &[u8], prev: Option<&DedupEntry>, new: &DedupEntry) {
        match prev {
            None => self.count += 1,
            Some(p) => {
                if let Some(idx) = &mut self.by_age {
                    idx.remove(&(p.first_seen_ms, key.to_vec()));
                }
            }
        }
        if let Some(idx) = &mut self.by_age {
            idx.insert((new.first_seen_ms, key.to_vec()));
        }
        self.gauge.set(self.count as f64);
    }

    fn removed(&mut self, key: &[u8], entry: &DedupEntry) {
        self.count = self.count.saturating_sub(1);
        if let Some(idx) = &mut self.by_age {
            idx.remove(&(entry.first_seen_ms, key.to_vec()));
        }
        self.gauge.set(self.count as f64);
    }
}

fn decode_entry(
    store: &crate::state::StagedStore,
    v: &[u8],
) -> Result<DedupEntry, crate::error::Error> {
    DedupEntry::decode(v)
        .map_err(|e| crate::error::Error::state(store.name(), format!("corrupt dedup entry: {e}")))
}

impl Dedup {
    /// A dedup stage `name` keeping its entries in store `store`.
    pub fn new(topology: &str, name: &str, store: &str, spec: DedupSpec) -> Self {
        Dedup {
            name: name.to_string(),
            store: store.to_string(),
            spec,
            key_buf: Vec::with_capacity(64),
            value_buf: Vec::with_capacity(64),
            metrics: StageMetrics::new(topology, name),
            sweep_after: None,
            top_times: [i64::MIN; 2],
            topology: topology.to_string(),
            book: None,
            checks: 0,
            swept: metrics::counter!(crate::metrics::EXPIRED, "topology" => topology.to_string(), "store" => store.to_string()),
        }
    }
}

impl Processor for Dedup {
    fn on_abort(&mut self) {
        // The key book counted staged writes that are gone: rebuild it from the store.
        self.book = None;
    }

    /// The expiry sweep: looks at up to [`SWEEP_BATCH`] entries from where the last sweep
    /// stopped, and deletes (with a changelog tombstone) each entry whose first-seen time
    /// plus TTL plus grace lies before the stream time. Stream time only moves with records,
    /// so downtime never expires state; and the sweep takes the second-highest record time
    /// as stream time, so one far-future timestamp cannot sweep entries that are live for
    /// the records around it.
    fn punctuate(&mut self, ctx: &mut Context<'_>) -> Result<(), crate::error::Error> {
        let stream_time = self.top_times[1];
        if stream_time == i64::MIN {
            return Ok(());
        }
        let horizon = self.spec.ttl_ms.saturating_add(self.spec.grace_ms);
        let store = ctx.store(&self.store)?;
        let batch = store
            .engine()
            .scan(self.sweep_after.as_deref(), SWEEP_BATCH)?;
        self.sweep_after = if batch.len() < SWEEP_BATCH {
            None
        } else {
            batch.last().map(|(k, _)| k.clone())
        };
        for (k, _) in batch {
            // Judge the current value: a staged renewal must not be swept.
            let Some(v) = store.get(&k)? else { continue };
            let entry = decode_entry(store, &v)?;
            if stream_time.saturating_sub(entry.first_seen_ms) > horizon {
                if let Some(book) = &mut self.book {
                    book.removed(&k, &entry);
                }
                store.stage(k, None);
                self.swept.increment(1);
            }
        }
        Ok(())
    }

    fn process(&mut self, record: Record, ctx: &mut Context<'_>) -> Result<(), StageError> {
        if let Err(e) = self.spec.key.extract_into(&record, &mut self.key_buf) {
            self.metrics.error.increment(1);
            return Err(RecordError::new(&self.name, e.to_string()).into());
        }
        // Time one decision in 64 for the histogram: clock reads cost more than the check.
        self.checks = self.checks.wrapping_add(1);
        let started = (self.checks % 64 == 0).then(std::time::Instant::now);
        let time_ms = match self.spec.time {
            TimeSource::Event => record.timestamp.unwrap_or(ctx.wall_clock_ms),
            TimeSource::Processing => ctx.wall_clock_ms,
        };
        if time_ms > self.top_times[0] {
            self.top_times = [time_ms, self.top_times[0]];
        } else if time_ms > self.top_times[1] {
            self.top_times[1] = time_ms;
        }
        let obs = Observation {
            time_ms,
            partition: record.source.partition,
            offset: record.source.offset,
            fingerprint: self
                .spec
                .fingerprint
                .then(|| xxhash_rust::xxh3::xxh3_64(record.value.as_deref().unwrap_or_default())),
        };
        let policy = Policy {
            ttl_ms: self.spec.ttl_ms,
        };
        let store = ctx.store(&self.store)?;
        if self.book.is_none() {
            let labels = [
                ("topology", self.topology.clone()),
                ("store", self.store.clone()),
                ("partition", record.source.partition.to_string()),
            ];
            self.book = Some(KeyBook::build(
                store,
                self.spec.max_keys.is_some(),
                metrics::gauge!(crate::metrics::DEDUP_KEYS, &labels),
                metrics::counter!(crate::metrics::EVICTED, &labels),
            )?);
        }
        let prev = match store.lookup(&self.key_buf)? {
            None => None,
            Some(bytes) => Some(decode_entry(store, &bytes)?),
        };
        let (decision, new) = decide(prev.as_ref(), &obs, &policy);
        if let Some(entry) = new {
            let book = self.book.as_mut().expect("built above");
            book.added(&self.key_buf, prev.as_ref(), &entry);
            self.value_buf.clear();
            entry
                .encode(&mut self.value_buf)
                .expect("a Vec grows to fit any entry");
            store.stage_copy(&self.key_buf, Some(&self.value_buf));
            // Bound the keys: evict the oldest first-seen entries past max_keys.
            if let (Some(max), Some(idx)) = (self.spec.max_keys, book.by_age.as_mut()) {
                while book.count > max {
                    let Some((first_seen, k)) = idx.pop_first() else {
                        break;
                    };
                    book.count -= 1;
                    book.evicted.increment(1);
                    tracing::debug!(store = %self.store, first_seen, "evicting the oldest key (max_keys)");
                    store.stage(k, None);
                }
                book.gauge.set(book.count as f64);
            }
        }
        if let Some(t) = started {
            self.metrics.check.record(t.elapsed().as_secs_f64());
        }
        match decision {
            Decision::First | Decision::Renewed => {
                self.metrics.passed.increment(1);
                ctx.counts().passed += 1;
                ctx.forward(record);
            }
            Decision::Duplicate => {
                self.metrics.duplicate.increment(1);
                ctx.counts().duplicates += 1;
            }
            Decision::Conflict => {
                self.metrics.conflict.increment(1);
                ctx.counts().conflicts += 1;
                match self.spec.on_conflict {
                    ConflictPolicy::Pass => ctx.forward(record),
                    ConflictPolicy::Drop => {}
                    ConflictPolicy::DeadLetter => {
                        return Err(RecordError::new(
                            &self.name,
                            "conflict: key seen before with a different payload",
                        )
                        .into())
                    }
                }
            }
        }
        Ok(())
    }
}

/// Settings of a topic sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkSpec {
    /// Destination topic.
    pub topic: String,
}

/// Writes each record to a topic with its key, value, headers and timestamp, and forwards
/// it, so several sinks in a row write one record to several topics.
pub struct TopicSink {
    topic: String,
    forward: bool,
    codec: Option<(super::codec::Format, super::codec::Format)>,
}

impl TopicSink {
    /// A sink to `spec.topic`; `forward` is false for the last stage, which then moves the
    /// record out instead of copying it.
    pub fn new(spec: &SinkSpec, forward: bool) -> Self {
        TopicSink {
            topic: spec.topic.clone(),
            forward,
            codec: None,
        }
    }

    /// Write values in the `sink` format, the source being in `source` format (see
    /// [`super::codec::encode_for_sink`]); without this the value bytes pass as they are.
    /// A record whose view does not encode goes to the dead-letter topic.
    pub fn with_codec(mut self, source: super::codec::Format, sink: super::codec::Format) -> Self {
        self.codec = Some((source, sink));
        self
    }
}

impl Processor for TopicSink {
    fn process(&mut self, record: Record, ctx: &mut Context<'_>) -> Result<(), StageError> {
        let timestamp = record.timestamp;
        let encoded = match &self.codec {
            None => None,
            Some((source, sink)) => Some(
                super::codec::encode_for_sink(&record, source, sink)
                    .map_err(|e| RecordError::new(format!("sink-{}", self.topic), e))?,
            ),
        };
        let out = |key, value, headers| OutRecord {
            topic: self.topic.clone(),
            partition: None,
            key,
            value,
            headers,
            timestamp,
        };
        if self.forward {
            let value = encoded.unwrap_or_else(|| record.value.clone());
            ctx.emit(out(record.key.clone(), value, record.headers.clone()));
            ctx.forward(record);
        } else {
            let value = encoded.unwrap_or(record.value);
            ctx.emit(out(record.key, value, record.headers));
        }
        Ok(())
    }
}
