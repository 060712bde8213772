//! The dedup stage: its spec and its processor (a dedup store per partition, an optional
//! duplicate topic).

use super::*;

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

impl TimeSource {
    /// Name as written in topology files: `event`, `processing`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            TimeSource::Event => "event",
            TimeSource::Processing => "processing",
        }
    }
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
    /// Send it to the stage's `duplicates_to` topic, with the header
    /// `onceflow.duplicate.kind: conflict` (duplicates there carry `duplicate`).
    DuplicatesTo,
}

impl ConflictPolicy {
    /// Name as written in topology files: `drop`, `pass`, `dead_letter`, `duplicates_to`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ConflictPolicy::Pass => "pass",
            ConflictPolicy::Drop => "drop",
            ConflictPolicy::DeadLetter => "dead_letter",
            ConflictPolicy::DuplicatesTo => "duplicates_to",
        }
    }
}

/// How a dedup stage's key meets the source's partitioning.
///
/// A dedup store is partition-local: a copy is caught only on the partition that holds the
/// first copy's mark. Either the source already puts every copy of a key on one partition
/// (`Source`, the user's promise) or onceflow routes the records by the dedup key through
/// the internal topic `<application.id>-<stage>-repartition` first (`Repartition`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partitioning {
    /// The user's promise: all copies of a key already share a source partition (the Kafka
    /// key is the dedup key, or determines it). Copies on different partitions each pass.
    Source,
    /// Route the stage's input by the dedup key (raw bytes) through the repartition topic,
    /// so that all copies of a key meet on one partition whatever their Kafka key.
    Repartition,
}

impl Partitioning {
    /// Name as written in topology files: `source` or `repartition`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Partitioning::Source => "source",
            Partitioning::Repartition => "repartition",
        }
    }
}

/// The internal topic a repartitioned dedup stage routes its input through:
/// `<application.id>-<stage>-repartition`.
pub(crate) fn repartition_topic(application_id: &str, stage: &str) -> String {
    format!("{application_id}-{stage}-repartition")
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
    /// What the fingerprint is taken over: `None` (the default), the value bytes as read;
    /// otherwise the JSON fields covered or ignored (see [`FingerprintFields`]), so that a
    /// re-serialized copy, or one differing only in an ignored field, is a duplicate. Needs
    /// `fingerprint` and a source whose values are objects (json, protobuf; `build` refuses bytes and string).
    pub fingerprint_fields: Option<FingerprintFields>,
    /// What to do with a conflict.
    pub on_conflict: ConflictPolicy,
    /// Grace after the TTL, in ms (default 1 h): the sweep deletes an entry (with a
    /// changelog tombstone) once the partition's stream time passes its expiry base + TTL +
    /// grace, the base being the later of its first-seen time and the stream time when it
    /// was written. The changelog has no time-based retention.
    pub grace_ms: i64,
    /// Keys kept per partition at most (default unlimited; 0 is refused at build); past it,
    /// the entries the sweep would delete first (the oldest expiry base, see `grace_ms`)
    /// are evicted.
    pub max_keys: Option<u64>,
    /// Topic that receives duplicates (key, value, headers and timestamp as read, plus
    /// the `onceflow.duplicate.of.*` headers naming the first occurrence); default none:
    /// duplicates are dropped.
    pub duplicates_to: Option<String>,
    /// How the key meets the partitioning; `None` (the default) means `Source` for
    /// `key: kafka_key` and `Repartition` for every other key ([`Topology::describe`](crate::Topology::describe)
    /// shows the partitioning in effect and why).
    pub partitioning: Option<Partitioning>,
    /// Set by the topology's build when an external sink after this stage takes its key as
    /// the idempotency key: each record forwarded then carries the key it was decided by.
    #[doc(hidden)]
    pub(crate) keep_key: bool,
}

impl DedupSpec {
    /// A dedup on `key` with a 24 h TTL on event time, no fingerprint.
    pub fn new(key: KeySource) -> Self {
        DedupSpec {
            key,
            ttl_ms: 24 * 3600 * 1000,
            time: TimeSource::Event,
            fingerprint: false,
            fingerprint_fields: None,
            on_conflict: ConflictPolicy::Drop,
            grace_ms: 3600 * 1000,
            max_keys: None,
            duplicates_to: None,
            partitioning: None,
            keep_key: false,
        }
    }

    /// State how the key meets the source's partitioning (default: `Source` for the Kafka
    /// key, `Repartition` otherwise; see [`Partitioning`]).
    pub fn with_partitioning(mut self, partitioning: Partitioning) -> Self {
        self.partitioning = Some(partitioning);
        self
    }

    /// The partitioning that applies, and why (for `validate` and `describe`).
    pub(crate) fn effective_partitioning(&self) -> (Partitioning, &'static str) {
        match (self.partitioning, &self.key) {
            (Some(Partitioning::Source), KeySource::KafkaKey) => (
                Partitioning::Source,
                "stated; the Kafka key is the dedup key",
            ),
            (Some(Partitioning::Source), _) => (
                Partitioning::Source,
                "stated: the user's promise that copies of a key share a partition",
            ),
            (Some(Partitioning::Repartition), _) => (Partitioning::Repartition, "stated"),
            (None, KeySource::KafkaKey) => (Partitioning::Source, "default for key kafka_key"),
            (None, _) => (
                Partitioning::Repartition,
                "default for a key other than kafka_key",
            ),
        }
    }

    /// Send duplicates to `topic` instead of dropping them.
    pub fn with_duplicates_to(mut self, topic: impl Into<String>) -> Self {
        self.duplicates_to = Some(topic.into());
        self
    }

    /// Turn the fingerprint on, taken over `fields` (see [`FingerprintFields`]).
    pub fn with_fingerprint_fields(mut self, fields: FingerprintFields) -> Self {
        self.fingerprint = true;
        self.fingerprint_fields = Some(fields);
        self
    }

    /// Limit the keys kept per partition (default none; `build` refuses 0); past it, the
    /// entries with the oldest expiry base (the later of first-seen time and the stream time
    /// when written: those the sweep would delete first) are evicted, with a changelog
    /// tombstone, counted in `onceflow_dedup_evicted_total`.
    pub fn with_max_keys(mut self, max: u64) -> Self {
        self.max_keys = Some(max);
        self
    }
}

/// Entries the expiry sweep looks at per commit and store partition.
pub(crate) const SWEEP_BATCH: usize = 1000;

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
/// new entry (applied by the runtime only once the output is durable, and withdrawn if the
/// record is dead-lettered further down), forwards firsts.
pub(crate) struct Dedup {
    name: String,
    store: String,
    spec: DedupSpec,
    key_buf: Vec<u8>,
    value_buf: Vec<u8>,
    metrics: StageMetrics,
    sweep_after: Option<Vec<u8>>,
    swept: metrics::Counter,
    /// Entries the expiry sweep read.
    sweep_read: metrics::Counter,
    /// The two highest times of records that wrote an entry, by their own timestamps
    /// (highest first). The sweep goes by the second: stream time that one far-future
    /// timestamp alone (delivered once or many times) cannot move.
    top_times: [i64; 2],
    topology: String,
    book: Option<KeyBook>,
    checks: u64,
    /// Keep the twins dropped against a mark staged in the open commit (an external sink
    /// further down can fail that mark's record only at the commit).
    hold_twins: bool,
    /// Twins held. Cleared at every commit and abort.
    held: Vec<Held>,
    /// With `hold_twins`, the task offset of each mark staged in the open commit (behind a
    /// hop an entry names the original source offset, not the one a withdrawal names).
    /// Cleared at every commit and abort.
    mark_owners: std::collections::HashMap<Vec<u8>, i64>,
    /// Judging a held twin again: the decision it got when it came (counted then).
    reviving: Option<Decision>,
    /// Compiled `fingerprint_fields`.
    fingerprinter: Option<Fingerprinter>,
    /// The stage is the repartition hop's: a record the router keyed by its dedup key
    /// ([`Record::keyed`](crate::Record)) is judged by its Kafka key, which holds exactly
    /// the bytes the key source gave the router, without reading the value again.
    keyed_by_hop: bool,
    /// Where this stage's key is read from a record as consumed (see
    /// [`Processor::key_hint`]).
    hint: Option<crate::processor::key::KeyHint>,
}

/// The keys of one dedup store partition: their count (the `onceflow_dedup_keys` gauge)
/// and, with `max_keys`, the keys by age for eviction: by [`DedupEntry::sweep_base_ms`],
/// the time the sweep counts expiry from, so a late first occurrence counts as written
/// when it arrived and is not evicted by the write that made it. Built by one scan of
/// the store when the task processes its first record (after its restore), then kept up
/// to date by the stage's own writes.
struct KeyBook {
    count: u64,
    /// The two highest [`DedupEntry::sweep_base_ms`] among the committed entries (highest
    /// first; `i64::MIN` when fewer): where stream time was, at least, when they were
    /// written. See [`Dedup::fold_time`].
    top_bases: [i64; 2],
    /// A lower bound of the [`DedupEntry::sweep_base_ms`] of every entry in the store: the
    /// lowest among the committed entries when the book was built and among every entry
    /// staged since (`i64::MAX` when none). Removals leave it as it is (it stays a lower
    /// bound). The sweep reads no entry while stream time is within the horizon of it:
    /// nothing can have expired.
    low_base: i64,
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
            top_bases: [i64::MIN; 2],
            low_base: i64::MAX,
            by_age: with_index.then(Default::default),
            gauge,
            evicted,
        };
        // One pass over the committed state (no wait for writes still going to the engine).
        let name = store.name().to_string();
        store.for_each_committed(|k, v| {
            book.count += 1;
            let e = DedupEntry::decode(v).map_err(|e| {
                crate::error::Error::state(&name, format!("corrupt dedup entry: {e}"))
            })?;
            let base = e.sweep_base_ms();
            book.low_base = book.low_base.min(base);
            // Seeded and untimed entries carry no record's time: not stream time.
            if !e.untimed && e.source_offset != crate::tools::SEEDED_OFFSET {
                fold_time(&mut book.top_bases, base);
            }
            if let Some(idx) = &mut book.by_age {
                idx.insert((base, k.to_vec()));
            }
            Ok(())
        })?;
        book.gauge.set(book.count as f64);
        Ok(book)
    }

    fn added(&mut self, key: &[u8], prev: Option<&DedupEntry>, new: &DedupEntry) {
        self.low_base = self.low_base.min(new.sweep_base_ms());
        match prev {
            None => self.count += 1,
            Some(p) => {
                if let Some(idx) = &mut self.by_age {
                    idx.remove(&(p.sweep_base_ms(), key.to_vec()));
                }
            }
        }
        if let Some(idx) = &mut self.by_age {
            idx.insert((new.sweep_base_ms(), key.to_vec()));
        }
        self.gauge.set(self.count as f64);
    }

    fn removed(&mut self, key: &[u8], entry: &DedupEntry) {
        self.count = self.count.saturating_sub(1);
        if let Some(idx) = &mut self.by_age {
            idx.remove(&(entry.sweep_base_ms(), key.to_vec()));
        }
        self.gauge.set(self.count as f64);
    }
}

/// Fold `time_ms` into `top`, the two highest times (highest first). Stream time is the
/// second: one far-future timestamp alone cannot move it. Folding the committed entries'
/// two highest sweep bases never moves it past where it was: each base is a record's time
/// or a past stream time, and two entries are two records.
fn fold_time(top: &mut [i64; 2], time_ms: i64) {
    if time_ms > top[0] {
        *top = [time_ms, top[0]];
    } else if time_ms > top[1] {
        top[1] = time_ms;
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
    pub(crate) fn new(topology: &str, name: &str, store: &str, spec: DedupSpec) -> Self {
        let fingerprinter = spec
            .fingerprint_fields
            .as_ref()
            .map(FingerprintFields::compile);
        let hint = crate::processor::key::KeyHint::of(&spec.key);
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
            hold_twins: false,
            keyed_by_hop: false,
            hint,
            held: Vec::new(),
            mark_owners: std::collections::HashMap::new(),
            reviving: None,
            fingerprinter,
            swept: metrics::counter!(crate::metrics::EXPIRED, "topology" => topology.to_string(), "store" => store.to_string()),
            sweep_read: metrics::counter!(crate::metrics::SWEEP_READ, "topology" => topology.to_string(), "store" => store.to_string()),
        }
    }
}

/// A twin dropped against a mark staged in the open commit.
struct Held {
    key: Vec<u8>,
    /// Source offset of the record the mark stands for.
    owner: i64,
    record: Record,
    /// Duplicate, or a conflict dropped.
    decision: Decision,
}

impl Dedup {
    /// Keep the twins (duplicates and dropped conflicts) of a mark staged in the open
    /// commit until the commit, so that if the mark is withdrawn (its record failed in an
    /// external sink further down, known only when the sink is flushed) the first twin is
    /// judged again and passes in its place. Default off: without an external sink after
    /// the stage a record fails while it is processed, before any twin arrives.
    pub(crate) fn holding_twins(mut self, on: bool) -> Self {
        self.hold_twins = on;
        self
    }

    /// The stage right after a repartition hop (see `keyed_by_hop`).
    pub(crate) fn keyed_by_hop(mut self, on: bool) -> Self {
        self.keyed_by_hop = on;
        if on {
            // A routed record's Kafka key is its dedup key.
            self.hint = Some(crate::processor::key::KeyHint::KafkaKey);
        }
        self
    }
}

impl Processor for Dedup {
    fn key_hint(&self) -> Option<(&str, &crate::processor::key::KeyHint)> {
        self.hint.as_ref().map(|h| (&self.store[..], h))
    }

    fn on_abort(&mut self) {
        // The key book counted staged writes that are gone: rebuild it from the store.
        self.book = None;
        // The dropped records are read again; until they have been, stream time is what
        // the committed entries and they move it to, as after a restart: a sweep by the
        // time they had reached would delete entries still live for the records before
        // them. The sweep's cursor starts over (its staged deletes are gone).
        self.top_times = [i64::MIN; 2];
        self.sweep_after = None;
        self.held.clear();
        self.mark_owners.clear();
    }

    fn on_commit(&mut self) {
        self.held.clear();
        self.mark_owners.clear();
    }

    /// The marks of dead-lettered records were withdrawn: the key book forgets them, and
    /// the twins held against each are judged again, in order: the first passes (a new
    /// mark, forwarded), the others are its duplicates.
    fn on_withdrawn(
        &mut self,
        store_name: &str,
        withdrawn: &[crate::state::Withdrawn],
        ctx: &mut Context<'_>,
    ) -> Result<Vec<(Record, RecordError)>, crate::error::Error> {
        if store_name != self.store {
            return Ok(Vec::new());
        }
        let mut failed = Vec::new();
        for w in withdrawn {
            let store = ctx.store(&self.store)?;
            if let Some(book) = &mut self.book {
                if let Some(v) = &w.written {
                    book.removed(&w.key, &decode_entry(store, v)?);
                }
                if let Some(v) = store.lookup(&w.key)? {
                    book.added(&w.key, None, &decode_entry(store, &v)?);
                }
            }
            tracing::debug!(store = %self.store, offset = w.owner, "dedup mark withdrawn: its record was dead-lettered");
            if self.held.is_empty() {
                continue;
            }
            let (twins, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
                .into_iter()
                .partition(|h| h.owner == w.owner && h.key[..] == w.key[..]);
            self.held = rest;
            for h in twins {
                self.reviving = Some(h.decision);
                let keep = h.record.clone();
                let r = self.process(h.record, ctx);
                self.reviving = None;
                match r {
                    Ok(()) => {}
                    Err(StageError::Record(e)) => failed.push((keep, e)),
                    Err(StageError::Fatal(e)) => return Err(e),
                }
            }
        }
        Ok(failed)
    }

    /// The expiry sweep: looks at up to [`SWEEP_BATCH`] entries from where the last sweep
    /// stopped, and deletes (with a changelog tombstone) each entry whose expiry base plus
    /// TTL plus grace lies before the stream time. The base is the later of the entry's
    /// first-seen time and the stream time when it was written
    /// ([`DedupEntry::sweep_base_ms`]): a late first occurrence keeps its entry for a full
    /// window after it arrived, so its own duplicates are still caught. Stream time only
    /// moves with records, so downtime never expires state; and the sweep takes the
    /// second-highest record time as stream time, so one far-future timestamp cannot sweep
    /// entries that are live for the records around it. While stream time is within the
    /// horizon of the lowest base in the store (`KeyBook::low_base`), nothing can have
    /// expired and the sweep reads nothing.
    fn punctuate(&mut self, ctx: &mut Context<'_>) -> Result<(), crate::error::Error> {
        let stream_time = self.top_times[1];
        if stream_time == i64::MIN {
            return Ok(());
        }
        let horizon = self.spec.ttl_ms.saturating_add(self.spec.grace_ms);
        if self
            .book
            .as_ref()
            .is_some_and(|b| stream_time.saturating_sub(b.low_base) <= horizon)
        {
            // No entry is older than the horizon: none to read.
            return Ok(());
        }
        let store = ctx.store(&self.store)?;
        let batch = store
            .engine()
            .scan(self.sweep_after.as_deref(), SWEEP_BATCH)?;
        self.sweep_after = if batch.len() < SWEEP_BATCH {
            None
        } else {
            batch.last().map(|(k, _)| k.clone())
        };
        self.sweep_read.increment(batch.len() as u64);
        for (k, _) in batch {
            // Judge the current value: a staged renewal must not be swept.
            let Some(v) = store.get(&k)? else { continue };
            let entry = decode_entry(store, &v)?;
            if stream_time.saturating_sub(entry.sweep_base_ms()) > horizon {
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
        if let (true, true, Some(k)) = (self.keyed_by_hop, record.keyed, &record.key) {
            self.key_buf.clear();
            self.key_buf.extend_from_slice(k);
        } else if let Err(e) = self.spec.key.extract_into(&record, &mut self.key_buf) {
            self.metrics.error.increment(1);
            return Err(RecordError::new(&self.name, e.to_string()).into());
        }
        // Time one decision in 64 for the histogram (the first of each 64, so a short run
        // has a sample too): clock reads cost more than the check.
        self.checks = self.checks.wrapping_add(1);
        let started = (self.checks % 64 == 1).then(std::time::Instant::now);
        // Event time is the record's timestamp; a record without one (Kafka's -1) has no
        // time of its own: it never moves stream time nor expires an entry (below).
        let own_time = match self.spec.time {
            TimeSource::Event => record.timestamp,
            TimeSource::Processing => Some(ctx.wall_clock_ms),
        };
        let wall_clock_ms = ctx.wall_clock_ms;
        let fingerprint = match (self.spec.fingerprint, &self.fingerprinter) {
            (false, _) => None,
            (true, None) => Some(xxhash_rust::xxh3::xxh3_64(
                record.value.as_deref().unwrap_or_default(),
            )),
            (true, Some(f)) => match fields_fingerprint(f, &record) {
                Ok(h) => Some(h),
                Err(e) => {
                    self.metrics.error.increment(1);
                    return Err(RecordError::new(&self.name, e).into());
                }
            },
        };
        let store = ctx.store(&self.store)?;
        if self.book.is_none() {
            let labels = [
                ("topology", self.topology.clone()),
                ("store", self.store.clone()),
                ("partition", record.source.partition.to_string()),
            ];
            let book = KeyBook::build(
                store,
                self.spec.max_keys.is_some(),
                metrics::gauge!(crate::metrics::DEDUP_KEYS, &labels),
                metrics::counter!(crate::metrics::EVICTED, &labels),
            )?;
            // After a restart (or an abort) stream time starts from the committed entries,
            // not from nothing: a late first occurrence among the first records is known
            // as late, and keeps its entry a full window after it arrived.
            for base in book.top_bases {
                fold_time(&mut self.top_times, base);
            }
            self.book = Some(book);
        }
        let prev = match store.lookup(&self.key_buf)? {
            None => None,
            Some(bytes) => Some(decode_entry(store, &bytes)?),
        };
        // A record without a time of its own is judged at its entry's first-seen time (a
        // duplicate: it cannot expire the entry); a first one takes stream time, or before
        // any, the wall clock, and its entry is marked `untimed`.
        let time_ms = match (own_time, &prev) {
            (Some(t), _) => t,
            (None, Some(e)) => e.first_seen_ms,
            (None, None) if self.top_times[1] != i64::MIN => self.top_times[1],
            (None, None) => wall_clock_ms,
        };
        // Behind a repartition hop the entry names the original source record.
        let (partition, offset) = (record.origin().partition, record.origin().offset);
        let obs = Observation {
            time_ms,
            partition,
            offset,
            fingerprint,
        };
        let policy = Policy {
            ttl_ms: self.spec.ttl_ms,
        };
        let (decision, new) = decide(prev.as_ref(), &obs, &policy);
        if let Some(mut entry) = new {
            entry.untimed = own_time.is_none();
            // A late first occurrence (stream time already past its own time): record the
            // stream time, from which the sweep then counts its expiry.
            let stream_time = self.top_times[1];
            if stream_time > entry.first_seen_ms {
                entry.written_stream_ms = Some(stream_time);
            }
            // Stream time moves with the records that write an entry, by their own time
            // only: a redelivered copy (a duplicate) does not confirm a far-future time.
            if own_time.is_some() {
                fold_time(&mut self.top_times, time_ms);
            }
            let book = self.book.as_mut().expect("built above");
            book.added(&self.key_buf, prev.as_ref(), &entry);
            self.value_buf.clear();
            entry
                .encode(&mut self.value_buf)
                .expect("a Vec grows to fit any entry");
            // A mark that stands for this source record: withdrawn if it is dead-lettered
            // further down (see `Processor::on_withdrawn`).
            store.stage_for(record.source.offset, &self.key_buf, Some(&self.value_buf));
            if self.hold_twins {
                self.mark_owners
                    .insert(self.key_buf.clone(), record.source.offset);
            }
            // Bound the keys: evict the oldest entries past max_keys.
            if let (Some(max), Some(idx)) = (self.spec.max_keys, book.by_age.as_mut()) {
                while book.count > max {
                    let Some((since_ms, k)) = idx.pop_first() else {
                        break;
                    };
                    book.count -= 1;
                    book.evicted.increment(1);
                    tracing::debug!(store = %self.store, since_ms, "evicting the oldest key (max_keys)");
                    store.stage(k, None);
                }
                book.gauge.set(book.count as f64);
            }
        }
        // A twin of a mark staged in this commit: kept until the commit, in case that mark
        // is withdrawn.
        let hold = self.hold_twins
            && match decision {
                Decision::Duplicate => true,
                Decision::Conflict => self.spec.on_conflict == ConflictPolicy::Drop,
                _ => false,
            }
            && store.is_staged(&self.key_buf);
        if hold {
            if let Some(first) = &prev {
                self.held.push(Held {
                    key: self.key_buf.clone(),
                    owner: self
                        .mark_owners
                        .get(&self.key_buf)
                        .copied()
                        .unwrap_or(first.source_offset),
                    record: record.clone(),
                    decision: self.reviving.unwrap_or(decision),
                });
            }
        }
        if let Some(t) = started {
            self.metrics.check.record(t.elapsed().as_secs_f64());
        }
        let mut record = record;
        if self.spec.keep_key {
            record.dedup_key = Some(bytes::Bytes::copy_from_slice(&self.key_buf));
        }
        if let Some(first) = self.reviving {
            // Counted as a duplicate (or conflict) when it came, and sent to the duplicates
            // topic then, if any: only a pass is news (the run totals move it over; the
            // metric counters only count up).
            if decision.passes() {
                self.metrics.passed.increment(1);
                let c = ctx.counts();
                c.passed += 1;
                match first {
                    Decision::Conflict => c.conflicts = c.conflicts.saturating_sub(1),
                    _ => c.duplicates = c.duplicates.saturating_sub(1),
                }
                ctx.forward(record);
            }
            return Ok(());
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
                if let Some(side) = &self.spec.duplicates_to {
                    side_output(side, record, prev.as_ref(), "duplicate", ctx)
                        .map_err(|e| RecordError::new(&self.name, e))?;
                }
            }
            Decision::Conflict => {
                self.metrics.conflict.increment(1);
                ctx.counts().conflicts += 1;
                match self.spec.on_conflict {
                    ConflictPolicy::Pass => ctx.forward(record),
                    ConflictPolicy::Drop => {}
                    ConflictPolicy::DuplicatesTo => {
                        // build() refuses this policy without a duplicates_to topic.
                        if let Some(side) = &self.spec.duplicates_to {
                            side_output(side, record, prev.as_ref(), "conflict", ctx)
                                .map_err(|e| RecordError::new(&self.name, e))?;
                        }
                    }
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

/// The fingerprint of `record` over chosen fields: of its view when a stage made one (the
/// view is what the record says now), else of its value bytes.
fn fields_fingerprint(f: &Fingerprinter, record: &Record) -> Result<u64, String> {
    if let Some(v) = &record.json {
        return Ok(f.of_value(v));
    }
    match record.value.as_deref() {
        None => Err("fingerprint: the value is null".into()),
        Some(b) => f
            .of_bytes(b)
            .map_err(|e| format!("fingerprint: the value is not JSON: {e}")),
    }
}

/// Write `record` to the duplicate topic `side` as read, with headers naming the first
/// occurrence and `kind` (`duplicate` or `conflict`).
fn side_output(
    side: &str,
    record: Record,
    first: Option<&DedupEntry>,
    kind: &'static str,
    ctx: &mut Context<'_>,
) -> Result<(), String> {
    let mut headers = record.headers;
    let h = |s: String| Some(bytes::Bytes::from(s.into_bytes()));
    headers.push((
        DUPLICATE_KIND.into(),
        Some(bytes::Bytes::from_static(kind.as_bytes())),
    ));
    if let Some(first) = first {
        headers.push((
            DUPLICATE_OF_PARTITION.into(),
            h(first.source_partition.to_string()),
        ));
        headers.push((
            DUPLICATE_OF_OFFSET.into(),
            h(first.source_offset.to_string()),
        ));
    }
    ctx.emit(OutRecord {
        topic: side.to_string(),
        partition: None,
        key: record.key,
        value: record.value,
        headers,
        timestamp: record.timestamp,
    })
}

/// Header of a record on a dedup stage's duplicate topic: `duplicate` (same key, same
/// payload or no fingerprint) or `conflict` (same key, other fingerprint; with
/// `on_conflict: duplicates_to`).
pub const DUPLICATE_KIND: &str = "onceflow.duplicate.kind";
/// Header of a record on a dedup stage's duplicate topic: the source partition of the
/// first occurrence (decimal text).
pub const DUPLICATE_OF_PARTITION: &str = "onceflow.duplicate.of.partition";
/// Header of a record on a dedup stage's duplicate topic: the source offset of the first
/// occurrence (decimal text).
pub const DUPLICATE_OF_OFFSET: &str = "onceflow.duplicate.of.offset";
