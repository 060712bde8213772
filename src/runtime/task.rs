//! A task: one source partition's processors and state stores, driven one record at a time.
//!
//! The same `Task` runs under the Kafka runtime and under the broker-free
//! [`crate::TestDriver`]. It never writes to a store directly: stages stage their
//! writes, and [`Task::commit_state`] applies them only when the caller says the outputs
//! they stand for are durable. [`Task::abort`] drops them.

use crate::error::{Error, RecordError, Result};
use crate::processor::{Context, Counts, OutRecord, Processor, Record, StageError, Stores};
use crate::state::restore::{ChangelogRecord, Restorer};
use crate::state::{StagedStore, StateBackend};
use crate::topology::{Format, Topology};
use bytes::Bytes;

// External effects in flight: `Task::flush_effects` (kept in its own file).
/// The [`Context`] of a stage call on `$task` (a `Task`), borrowing its stores, counts and
/// tables field by field (so its nodes can be borrowed mutably next to it).
macro_rules! task_context {
    ($task:ident, $forwarded:expr, $emitted:expr, $wall_ms:expr) => {
        Context {
            stores: &mut $task.stores,
            forwarded: $forwarded,
            emitted: $emitted,
            counts: &mut $task.counts,
            tables: &$task.tables,
            wall_clock_ms: $wall_ms,
            max_record_bytes: $task.max_record_bytes,
            topic_limits: &$task.topic_limits,
        }
    };
}

#[path = "effects.rs"]
mod effects;

/// Header names of a dead-letter record; the original headers come first.
pub mod dlq_headers {
    /// The prefix of every header onceflow writes on a dead letter.
    pub const PREFIX: &str = "onceflow.dlq.";
    /// Source topic of the dead record.
    pub const TOPIC: &str = "onceflow.dlq.source.topic";
    /// Source partition (decimal text).
    pub const PARTITION: &str = "onceflow.dlq.source.partition";
    /// Source offset (decimal text).
    pub const OFFSET: &str = "onceflow.dlq.source.offset";
    /// Name of the stage that refused it (`source` for decoding errors).
    pub const STAGE: &str = "onceflow.dlq.stage";
    /// The reason, a sentence.
    pub const REASON: &str = "onceflow.dlq.reason";
}

/// One source partition's processors and stores.
pub(crate) struct Task {
    topic: std::sync::Arc<str>,
    partition: i32,
    format: Format,
    nodes: Vec<(String, Box<dyn Processor>)>,
    stores: Stores,
    dlq_topic: String,
    position: Option<i64>,
    counts: Counts,
    /// The counts as of each sealed commit, until it commits (then they are `committed`).
    sealed_counts: Vec<(u64, Counts)>,
    /// The counts as of the last commit: what an abort rolls `counts` back to, as the
    /// records after it are read and counted again.
    committed_counts: Counts,
    cur: Vec<Record>,
    next: Vec<Record>,
    /// `onceflow_dead_letters_total` by stage: `[0]` for `source` (undecodable values),
    /// `[i + 1]` for stage `i`.
    dlq_counters: Vec<metrics::Counter>,
    /// The task's span: topology, partition and stores, entered around its restore and
    /// commit work and its log lines.
    span: tracing::Span,
    restorers: Vec<Restorer>,
    pointers: std::sync::Arc<[String]>,
    pointer_tokens: Vec<Vec<String>>,
    tables: crate::state::table::Tables,
    /// An external sink may fail a record at the commit (when its effects are flushed), so
    /// the marks staged for each record stay withdrawable until then.
    fails_late: bool,
    /// A router task (the source partition of a repartition hop): no stores; its stages
    /// are the stateless ones before the hop, and each record they pass becomes its
    /// repartition record.
    router: Option<crate::processor::repartition::Router>,
    /// A router whose stages rewrite the value (a map) of a source whose format is not
    /// JSON: what they pass is encoded in the source format again before it is routed.
    reencode: bool,
    /// A router task: the name of the dedup stage after its hop (it names the records whose
    /// key the stages before the hop made unusable, see [`Task::process`]).
    hop_stage: String,
    /// The largest record the producer accepts (see [`Task::with_max_record_bytes`]).
    max_record_bytes: usize,
    /// Sink topics with a lower limit of their own (see [`Task::with_topic_limits`]).
    topic_limits: std::sync::Arc<std::collections::HashMap<String, usize>>,
    /// The task reads a repartition topic: each record's source header is taken off into
    /// its origin ([`crate::processor::repartition::take_source`]).
    reads_hop: bool,
    /// A buffer for [`Task::hop_stage`]'s key check.
    key_check: Vec<u8>,
    /// The last origin topic seen, shared by the records that name it.
    origin_topic: Option<std::sync::Arc<str>>,
    /// Behind a hop whose dedup key is read from a JSON value: the pointers (and tokens)
    /// the stages read besides that key. A record the router keyed
    /// ([`Record::keyed`](crate::Record)) was scanned by the router, which read its key
    /// from these very bytes, so its value is valid JSON: it is scanned for these only, and
    /// not at all when there are none (the dedup takes its Kafka key).
    keyed_pointers: Option<KeyedPointers>,
}

/// The JSON pointers the stages after a repartition hop read (shared by the tasks), each
/// also split into its reference tokens.
type KeyedPointers = (std::sync::Arc<[String]>, Vec<Vec<String>>);

/// A changelog record handed to [`Task::restore_records`]: key, value (`None`: a
/// tombstone) and changelog offset.
pub(crate) type RestoreRecord<'a> = (&'a [u8], Option<&'a [u8]>, i64);

impl Task {
    /// Create the task for `partition` of the topology's source, opening its stores. With
    /// a repartition hop ([`Topology::hop`](crate::Topology)) `partition` is one of the
    /// repartition topic's, and the task runs the stages from the hop's dedup on (those
    /// before it run in the router tasks, [`Task::router`]).
    ///
    /// # Errors
    /// [`Error::State`] when a store cannot be opened.
    pub(crate) fn new(
        topology: &Topology,
        partition: i32,
        backend: &dyn StateBackend,
        dlq_topic: &str,
    ) -> Result<Task> {
        let mut stores = Stores::new();
        let store_names = topology.stores().join(",");
        let span = tracing::info_span!("task", topology = topology.name(), partition, stores = %store_names);
        for s in topology.stores() {
            let engine = backend.open(&s, partition)?;
            stores.insert(s, StagedStore::new(engine, backend.writer()));
        }
        let first = topology.hop_stage();
        let nodes = topology.instantiate(first..topology.stages().len());
        let dlq_counters = dead_letter_counters(topology, &nodes);
        Ok(Task {
            topic: topology.source().topic.as_str().into(),
            partition,
            format: topology.source().format.clone(),
            nodes,
            stores,
            dlq_topic: dlq_topic.to_string(),
            position: None,
            counts: Counts::default(),
            sealed_counts: Vec::new(),
            committed_counts: Counts::default(),
            cur: Vec::with_capacity(4),
            next: Vec::with_capacity(4),
            dlq_counters,
            span,
            restorers: Vec::new(),
            pointers: topology.json_pointers().into(),
            pointer_tokens: topology
                .json_pointers()
                .iter()
                .map(|p| crate::processor::json_scan::tokens(p))
                .collect(),
            tables: Default::default(),
            fails_late: topology.stages()[first..]
                .iter()
                .any(|s| matches!(s.kind, crate::topology::StageKind::External(_))),
            router: None,
            reencode: false,
            hop_stage: String::new(),
            max_record_bytes: crate::processor::DEFAULT_MAX_RECORD_BYTES,
            topic_limits: std::sync::Arc::default(),
            reads_hop: topology.hop().ok().flatten().is_some(),
            key_check: Vec::new(),
            origin_topic: None,
            keyed_pointers: keyed_pointers(topology),
        })
    }

    /// Create the router task of `partition` of the topology's source for a repartition
    /// hop ([`Topology::hop`](crate::Topology)): it has no store and runs the stateless
    /// stages before the hop's dedup (filter, map; none when the dedup is the first stage).
    /// Each record they pass becomes one repartition record
    /// ([`Router::route`](crate::processor::repartition::Router::route)) of the value they
    /// made (encoded in the source format), sent and committed like any output; a record
    /// a filter drops is not routed, and one a stage refuses goes to the dead-letter topic
    /// `dlq_topic` from here, as read. The stages from the dedup on run on the repartition
    /// topic's partitions ([`Task::new`]).
    pub(crate) fn router(
        topology: &Topology,
        partition: i32,
        router: crate::processor::repartition::Router,
        dlq_topic: &str,
    ) -> Task {
        let span = tracing::info_span!(
            "router",
            topology = topology.name(),
            partition,
            topic = router.topic()
        );
        let prefix = 0..topology.hop_stage();
        let reencode = topology.source().format != Format::Json
            && topology.stages()[prefix.clone()]
                .iter()
                .any(|s| matches!(s.kind, crate::topology::StageKind::Map(_)));
        let nodes = topology.instantiate(prefix);
        let dlq_counters = dead_letter_counters(topology, &nodes);
        // Without stages the router reads only the dedup key (`Router::route`).
        let pointers = if nodes.is_empty() {
            Vec::new()
        } else {
            topology.json_pointers()
        };
        Task {
            topic: topology.source().topic.as_str().into(),
            partition,
            format: topology.source().format.clone(),
            nodes,
            stores: Stores::new(),
            dlq_topic: dlq_topic.to_string(),
            position: None,
            counts: Counts::default(),
            sealed_counts: Vec::new(),
            committed_counts: Counts::default(),
            cur: Vec::new(),
            next: Vec::new(),
            dlq_counters,
            span,
            restorers: Vec::new(),
            pointer_tokens: pointers
                .iter()
                .map(|p| crate::processor::json_scan::tokens(p))
                .collect(),
            pointers: pointers.into(),
            tables: Default::default(),
            fails_late: false,
            router: Some(router),
            reencode,
            hop_stage: topology.stages()[topology.hop_stage()].name.clone(),
            max_record_bytes: crate::processor::DEFAULT_MAX_RECORD_BYTES,
            topic_limits: std::sync::Arc::default(),
            reads_hop: false,
            key_check: Vec::new(),
            origin_topic: None,
            keyed_pointers: None,
        }
    }

    /// The largest record (value, key and headers, in bytes) the task's producer accepts
    /// (librdkafka's `message.max.bytes`; default 1,000,000): a stage that would write a
    /// larger one refuses its source record, which goes to the dead-letter topic.
    pub(crate) fn with_max_record_bytes(mut self, bytes: usize) -> Self {
        self.max_record_bytes = bytes;
        self
    }

    /// The largest record (value, key and headers, in bytes) each sink topic whose own
    /// `max.message.bytes` is the lower bound takes: a stage that would write a larger one
    /// refuses its source record, which goes to the dead-letter topic, rather than the
    /// broker refusing the send at every restart.
    pub(crate) fn with_topic_limits(
        mut self,
        limits: std::sync::Arc<std::collections::HashMap<String, usize>>,
    ) -> Self {
        self.topic_limits = limits;
        self
    }

    /// Give the task the instance's lookup tables (for enrich stages); they are shared by
    /// all tasks and loaded before any task processes a record.
    pub(crate) fn with_tables(mut self, tables: crate::state::table::Tables) -> Self {
        self.tables = tables;
        self
    }

    /// Offset of the next record to process: what the next commit stores for this partition.
    pub(crate) fn position(&self) -> Option<i64> {
        self.position
    }

    /// Totals since the task started, less those of records an abort rolled back.
    pub(crate) fn counts(&self) -> &Counts {
        &self.counts
    }

    /// The task's span (`task{topology, partition, stores}`).
    pub(crate) fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// Count one dead letter of stage `stage` (`0`: the source, `i + 1`: stage `i`).
    pub(crate) fn count_dead_letter(&self, stage: usize) {
        if let Some(c) = self.dlq_counters.get(stage) {
            c.increment(1);
        }
    }

    /// Whether this task only routes: a router task without stages before the hop, whose
    /// records become repartition records as they are ([`Task::routed`]).
    pub(crate) fn routes_only(&self) -> bool {
        self.router.is_some() && self.nodes.is_empty()
    }

    /// A [routes-only](Task::routes_only) task's record at `offset` was routed in place by
    /// the run loop (as [`Task::process`] would route it; counted where the stages read it).
    pub(crate) fn routed(&mut self, offset: i64) {
        self.position = Some(offset + 1);
    }

    /// Hint that a source record with Kafka key `key` and value `value` comes soon: when
    /// the first stage looks up a store by a key it says where to read cheaply
    /// ([`Processor::key_hint`]), fetch that key's place in the store into the cache.
    /// Changes nothing a stage sees.
    pub(crate) fn prefetch(&self, key: Option<&[u8]>, value: Option<&[u8]>) {
        let Some((store, hint)) = self.nodes.first().and_then(|(_, n)| n.key_hint()) else {
            return;
        };
        if let (Some(k), Some(s)) = (hint.peek(key, value), self.stores.get(store)) {
            s.prefetch(k);
        }
    }

    /// Whether [`Task::warm_into`] may find keys to warm: the first stage looks up a store
    /// by a key it says where to read, the task is not restoring, and that store may read
    /// its engine ([`StagedStore::warms`](crate::state::StagedStore::warms)).
    pub(crate) fn warms(&self) -> bool {
        let Some((store, _)) = self.nodes.first().and_then(|(_, n)| n.key_hint()) else {
            return false;
        };
        !self.is_restoring() && self.stores.get(store).is_some_and(|s| s.warms())
    }

    /// Add to `batch` the key of a source record with Kafka key `key` and value `value`
    /// when the first stage's lookup of it would read the store's engine (a far repeat), to
    /// be read ahead ([`crate::state::Warmer`]). Changes nothing a stage sees: a value read
    /// ahead is the one the lookup would read.
    pub(crate) fn warm_into(
        &self,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        batch: &mut crate::state::WarmBatch,
    ) {
        let Some((store, hint)) = self.nodes.first().and_then(|(_, n)| n.key_hint()) else {
            return;
        };
        if let (Some(k), Some(s)) = (hint.peek(key, value), self.stores.get(store)) {
            s.warm_into(k, batch);
        }
    }

    /// Process one source record; outputs and dead letters are appended to `out`.
    ///
    /// # Errors
    /// Only system failures ([`Error::State`]); bad records become dead letters.
    pub(crate) fn process(
        &mut self,
        mut record: Record,
        wall_ms: i64,
        out: &mut Vec<OutRecord>,
    ) -> Result<()> {
        if self.is_restoring() {
            return Err(Error::Internal(format!(
                "a record of {}/{} reached it while it is still restoring",
                self.topic, self.partition
            )));
        }
        let offset = record.source.offset;
        if self.reads_hop && record.origin.is_none() {
            crate::processor::repartition::take_source(&mut record, &mut self.origin_topic);
        }
        if let (Some(r), true) = (&self.router, self.nodes.is_empty()) {
            // Counted where the stages read it (the repartition topic), not twice.
            out.push(r.route(record));
            self.position = Some(offset + 1);
            return Ok(());
        }
        // A router counts it too; one it routes is uncounted below (counted again where
        // the stages after the hop read it).
        self.counts.records_in += 1;
        // The source record as read, kept for the dead-letter topic (clones share bytes).
        let original = (record.key.clone(), record.value.clone(), record.timestamp);
        let headers = record.headers.clone();
        // Behind a hop, the source record it was routed from (no copy without a hop).
        let origin = record.origin.clone();
        let dead = |err: RecordError, out: &mut Vec<OutRecord>, counts: &mut Counts| {
            counts.dead_lettered += 1;
            out.push(dead_letter(
                &self.dlq_topic,
                &origin.as_ref().map_or_else(
                    || (self.topic.to_string(), self.partition, offset),
                    |o| (o.topic.to_string(), o.partition, o.offset),
                ),
                original.0.clone(),
                original.1.clone(),
                headers.clone(),
                original.2,
                &err,
            ));
        };
        let decoded = match (&self.format, &self.keyed_pointers) {
            // Routed by a key the router read from this value: valid JSON (see
            // `keyed_pointers`).
            (Format::Json, Some((ptrs, tokens))) if record.keyed => match record.value.as_deref() {
                Some(_) if ptrs.is_empty() => Ok(()),
                Some(v) => crate::processor::json_scan::scan(v, tokens)
                    .map(|vals| record.fields = Some((ptrs.clone(), vals)))
                    .map_err(|e| format!("value is not valid JSON: {e}")),
                None => Err("value is null, expected JSON".to_string()),
            },
            // One validating pass that picks the fields the stages read; no tree is built
            // (a stage that needs the view parses it, see `codec::view_mut`).
            (Format::Json, _) => match record.value.as_deref() {
                Some(v) => crate::processor::json_scan::scan(v, &self.pointer_tokens)
                    .map(|vals| record.fields = Some((self.pointers.clone(), vals)))
                    .map_err(|e| format!("value is not valid JSON: {e}")),
                None => Err("value is null, expected JSON".to_string()),
            },
            (Format::Bytes, _) => Ok(()),
            // String and protobuf values are decoded into the record view when read.
            (other, _) => match record.value.as_deref() {
                Some(v) => other.decode(v).map(|view| {
                    record.json = Some(view);
                    record.unset = other.unset_defaults().cloned();
                }),
                None => Err(format!("value is null, expected {}", other.describe())),
            },
        };
        if let Err(reason) = decoded {
            self.dlq_counters[0].increment(1);
            dead(RecordError::new("source", reason), out, &mut self.counts);
            self.position = Some(offset + 1);
            return Ok(());
        }
        if self.fails_late {
            // An external sink may fail it at the commit, after a stage rewrote it.
            record.as_read = Some(std::sync::Arc::new(crate::processor::record::AsRead {
                key: original.0.clone(),
                value: original.1.clone(),
                headers: headers.clone(),
                timestamp: original.2,
            }));
        }
        self.cur.clear();
        self.cur.push(record);
        // All or nothing per source record: if a stage refuses it, the outputs earlier
        // stages emitted for it (a route or sink before the failing stage) are withdrawn,
        // and its dead letter is its only output.
        let mark = out.len();
        let mut refused = false;
        'stages: for (i, (_, node)) in self.nodes.iter_mut().enumerate() {
            self.next.clear();
            for rec in self.cur.drain(..) {
                let mut ctx = task_context!(self, &mut self.next, out, wall_ms);
                match node.process(rec, &mut ctx) {
                    Ok(()) => {}
                    Err(StageError::Record(e)) => {
                        let withdrawn = out.len() - mark;
                        out.truncate(mark);
                        self.counts.records_out -= withdrawn as u64;
                        self.dlq_counters[i + 1].increment(1);
                        dead(e, out, &mut self.counts);
                        // Leaving the loop drops the drain, and with it any other record
                        // of this source record.
                        self.next.clear();
                        refused = true;
                        break 'stages;
                    }
                    Err(StageError::Fatal(e)) => return Err(e),
                }
            }
            std::mem::swap(&mut self.cur, &mut self.next);
            if self.cur.is_empty() {
                break;
            }
        }
        if let Some(r) = &self.router {
            // What the stages before the hop passed is routed, as they made it.
            let mut routed = false;
            for mut rec in self.cur.drain(..) {
                if self.reencode {
                    match crate::processor::codec::encode_for_sink(&rec, &self.format, &self.format)
                    {
                        Ok(v) => rec.value = v,
                        Err(e) => {
                            // Refused by the last stage before the hop, whose value it is.
                            let last = self.nodes.len();
                            self.dlq_counters[last].increment(1);
                            let reason = format!(
                                "cannot encode the value in the source format ({}) for the repartition topic: {e}",
                                self.format.describe()
                            );
                            dead(
                                RecordError::new(&self.nodes[last - 1].0, reason),
                                out,
                                &mut self.counts,
                            );
                            continue;
                        }
                    }
                }
                // A stage rewrote the value: the dedup key read from what it made must be
                // one the dedup would take without the hop. A number whose digits the
                // rewrite lost (an integer beyond 64 bits, now a float) is refused as the
                // dedup refuses it; routed by the float's text, two ids would become one.
                if rec.json.is_some() {
                    self.key_check.clear();
                    if let Err(e @ crate::processor::key::KeyError::WrongType(_)) =
                        r.key().extract_into(&rec, &mut self.key_check)
                    {
                        self.dlq_counters[self.nodes.len()].increment(1);
                        let err = RecordError::new(&self.hop_stage, e.to_string());
                        dead(err, out, &mut self.counts);
                        continue;
                    }
                }
                routed = true;
                out.push(r.route(rec));
            }
            if routed {
                self.counts.records_in -= 1;
            }
        }
        self.cur.clear();
        if refused {
            // Its dedup marks stand for nothing: withdrawn in this commit (a twin judged
            // again may run on).
            self.drive(
                std::collections::VecDeque::from([effects::Work::Withdraw(offset)]),
                wall_ms,
                out,
            )?;
        }
        if !self.fails_late {
            // Nothing can dead-letter this record any more: its marks stand.
            for s in self.stores.values_mut() {
                s.settle();
            }
        }
        self.position = Some(offset + 1);
        Ok(())
    }

    /// Run every stage's periodic work (the expiry sweep), staging its writes.
    ///
    /// # Errors
    /// A store failure.
    pub(crate) fn punctuate(&mut self, wall_ms: i64) -> Result<()> {
        if self.is_restoring() {
            return Ok(());
        }
        let mut out = Vec::new();
        let mut sink = Vec::new();
        for (_, node) in self.nodes.iter_mut() {
            let mut ctx = task_context!(self, &mut sink, &mut out, wall_ms);
            node.punctuate(&mut ctx)?;
        }
        Ok(())
    }

    /// Apply every store's staged writes, one batch per store, each with the changelog
    /// offset `changelog_offset(store)` returns (`None`: no changelog, or nothing written).
    /// Call only once the outputs produced since the last commit, and the changelog records
    /// of these writes, are durable: that is what makes a dedup mark never hide a lost
    /// output.
    ///
    /// # Errors
    /// [`Error::State`] when a store write fails.
    pub(crate) fn commit_state(
        &mut self,
        changelog_offset: impl Fn(&str) -> Option<i64>,
    ) -> Result<()> {
        for (name, s) in self.stores.iter_mut() {
            s.commit(changelog_offset(name))?;
        }
        for (_, n) in self.nodes.iter_mut() {
            n.on_commit();
        }
        Ok(())
    }

    /// Seal every store's staged writes as the batch of commit `epoch`, which is now in
    /// flight (an at_least_once commit, or an exactly_once_v2 transaction committing): they
    /// stay readable and can no longer be withdrawn; the next records stage into fresh
    /// batches. [`Task::commit_sealed`] applies them.
    pub(crate) fn seal(&mut self, epoch: u64) {
        for s in self.stores.values_mut() {
            s.seal(epoch);
        }
        self.sealed_counts.push((epoch, self.counts));
        for (_, n) in self.nodes.iter_mut() {
            n.on_commit();
        }
    }

    /// Visit every write sealed for commit `epoch`, store by store, in first-write order:
    /// that commit's changelog records.
    pub(crate) fn for_each_sealed_write<'s>(
        &'s self,
        epoch: u64,
        mut f: impl FnMut(&'s str, &'s [u8], Option<&'s [u8]>),
    ) {
        for (name, s) in &self.stores {
            for (k, v) in s.sealed(epoch) {
                f(name, k, v);
            }
        }
    }

    /// Apply every store's batch sealed for commit `epoch`, each with the changelog offset
    /// `changelog_offset(store)` returns; as [`Task::commit_state`], only once that
    /// commit's outputs and changelog records are durable.
    ///
    /// # Errors
    /// [`Error::State`] when a store write fails.
    pub(crate) fn commit_sealed(
        &mut self,
        epoch: u64,
        changelog_offset: impl Fn(&str) -> Option<i64>,
    ) -> Result<()> {
        for (name, s) in self.stores.iter_mut() {
            s.commit_sealed(epoch, changelog_offset(name))?;
        }
        if let Some(i) = self.sealed_counts.iter().position(|(e, _)| *e == epoch) {
            self.committed_counts = self.sealed_counts[i].1;
            self.sealed_counts.drain(..=i);
        }
        Ok(())
    }

    /// Start restoring `store` from its changelog, whose offsets are `low..end` now.
    /// Returns the first changelog offset to read, or `None` if nothing is to be restored.
    ///
    /// # Errors
    /// [`Error::Topology`] for an unknown store; a store failure.
    pub(crate) fn plan_restore(&mut self, store: &str, low: i64, end: i64) -> Result<Option<i64>> {
        let partition = self.partition;
        let s = self.stores.get_mut(store).ok_or_else(|| Error::Topology {
            node: store.to_string(),
            reason: "no such state store".into(),
        })?;
        s.sync()?;
        let r = Restorer::plan(store, partition, s.engine(), low, end)?;
        // The plan may have cleared the engine (a changelog that was recreated).
        s.reload();
        s.reserve(usize::try_from(end - r.start_offset()).unwrap_or(0));
        if r.is_done() {
            return Ok(None);
        }
        let start = r.start_offset();
        tracing::info!(
            store,
            partition,
            start,
            end,
            total = end - start,
            "restore starting"
        );
        self.restorers.push(r);
        Ok(Some(start))
    }

    /// Apply changelog `records` of `store`, the restore consumer's position now being
    /// `position`. Returns true when that store's restore just finished.
    ///
    /// # Errors
    /// A store failure.
    pub(crate) fn apply_restore(
        &mut self,
        store: &str,
        records: Vec<ChangelogRecord>,
        position: i64,
    ) -> Result<bool> {
        for r in &records {
            self.restore_record(store, &r.key, r.value.as_deref(), r.offset);
        }
        self.finish_restore_step(store, position)
    }

    /// Add one changelog record of `store` (in log order) to the restore step in progress;
    /// the key and value are copied. Records outside the restore's range (before its
    /// position or at or beyond its captured end) and records of a store not restoring are
    /// ignored. [`Task::finish_restore_step`] applies the step. Returns whether the record
    /// was taken.
    pub(crate) fn restore_record(
        &mut self,
        store: &str,
        key: &[u8],
        value: Option<&[u8]>,
        offset: i64,
    ) -> bool {
        self.restore_records(store, &[(key, value, offset)]) == 1
    }

    /// As [`Task::restore_record`] for each of `records` (key, value, offset; in log
    /// order), finding the store once. Returns how many were taken.
    pub(crate) fn restore_records(&mut self, store: &str, records: &[RestoreRecord<'_>]) -> u64 {
        let Some(r) = self.restorers.iter().find(|r| r.store() == store) else {
            return 0;
        };
        let Some(s) = self.stores.get_mut(store) else {
            return 0;
        };
        let mut taken = 0;
        for (key, value, offset) in records {
            if r.accepts(*offset) {
                s.push_restored(key, *value);
                taken += 1;
            }
        }
        taken
    }

    /// Apply the records added by [`Task::restore_record`] for `store` as one batch, the
    /// restore consumer's position now being `position`. Returns true when that store's
    /// restore just finished.
    ///
    /// # Errors
    /// A store failure.
    pub(crate) fn finish_restore_step(&mut self, store: &str, position: i64) -> Result<bool> {
        let Some(i) = self.restorers.iter().position(|r| r.store() == store) else {
            return Ok(false);
        };
        let staged = self
            .stores
            .get_mut(store)
            .expect("restorers exist only for known stores");
        let applied = staged.restored_len() as u64;
        let position = self.restorers[i].step(applied, position);
        staged.flush_restored(Some(position))?;
        if self.restorers[i].is_done() {
            // Every restored batch is committed (readable) before the first record is
            // processed; a write-behind store persists the tail in the background.
            let r = self.restorers.remove(i);
            let p = r.progress();
            tracing::info!(
                store,
                partition = self.partition,
                done = p.done,
                total = p.total,
                rate = format!("{:.0}/s", p.rate),
                "restore complete"
            );
            return Ok(true);
        }
        Ok(false)
    }

    /// Whether any store of this task is still restoring; the task must not process
    /// records until it is not.
    pub(crate) fn is_restoring(&self) -> bool {
        !self.restorers.is_empty()
    }

    /// The restores in progress.
    pub(crate) fn restorers(&self) -> &[Restorer] {
        &self.restorers
    }

    /// Drop every store's staged writes and forget the position: the caller rewinds the
    /// partition to its committed offset.
    pub(crate) fn abort(&mut self, committed: Option<i64>) {
        for s in self.stores.values_mut() {
            s.abort();
        }
        for (_, n) in self.nodes.iter_mut() {
            n.on_abort();
        }
        self.position = committed;
        // The records since the last commit are read again (or, lost, are another
        // instance's): counted when they are processed again.
        self.counts = self.committed_counts;
        self.sealed_counts.clear();
    }

    /// Memory the task's stores hold in the process, summed by part.
    pub(crate) fn state_memory(&self) -> crate::state::StateMemory {
        let mut m = crate::state::StateMemory::default();
        for s in self.stores.values() {
            m.add(s.memory(true).0);
        }
        m
    }

    /// Set the [`STATE_MEMORY`](crate::metrics::STATE_MEMORY) gauges of the task's stores;
    /// false when an engine was busy writing a batch (its part is left as it was).
    pub(crate) fn report_state_memory(&self) -> bool {
        let mut all = true;
        for (store, s) in &self.stores {
            // An engine busy writing a batch keeps its last value: not waited for on the
            // run loop.
            let (m, engine) = s.memory(false);
            all &= engine.is_some();
            let parts = [
                ("resident", Some(m.resident)),
                ("key_filter", Some(m.key_filter)),
                ("engine", engine),
            ];
            for (part, bytes) in parts.into_iter().filter_map(|(p, b)| Some((p, b?))) {
                metrics::gauge!(crate::metrics::STATE_MEMORY,
                    "store" => store.clone(),
                    "partition" => self.partition.to_string(),
                    "part" => part)
                .set(bytes as f64);
            }
        }
        all
    }

    /// Wait until every committed write of this task's stores is in the engine (sled), or
    /// until `deadline`: true when all are, so that a restart resumes from the latest
    /// changelog offset; what is not written is restored from the changelog at the next
    /// start.
    ///
    /// # Errors
    /// A store's background write error.
    pub(crate) fn sync_stores_until(&mut self, deadline: std::time::Instant) -> Result<bool> {
        let mut all = true;
        for s in self.stores.values_mut() {
            all &= s.sync_until(deadline)?;
        }
        Ok(all)
    }

    /// Read a committed-or-staged value from store `store`.
    ///
    /// # Errors
    /// [`Error::Topology`] for an unknown store; [`Error::State`] when the read fails.
    pub(crate) fn store_get(&self, store: &str, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.stores
            .get(store)
            .ok_or_else(|| Error::Topology {
                node: store.to_string(),
                reason: "no such state store".into(),
            })?
            .get(key)
    }
}

/// `onceflow_dead_letters_total` of a task running `nodes`: `[0]` for `source`, `[i + 1]`
/// for `nodes[i]` (labelled by stage name, so a task running the stages after a hop counts
/// under the same labels as one running all of them).
fn dead_letter_counters(
    topology: &Topology,
    nodes: &[(String, Box<dyn Processor>)],
) -> Vec<metrics::Counter> {
    std::iter::once("source")
        .chain(nodes.iter().map(|(name, _)| name.as_str()))
        .map(|stage| {
            metrics::counter!(crate::metrics::DEAD_LETTERS,
                "topology" => topology.name().to_string(),
                "topic" => topology.source().topic.clone(),
                "stage" => stage.to_string())
        })
        .collect()
}

/// [`Task::keyed_pointers`] of the tasks on a repartition topic: `None` without a hop, or
/// when the hop's dedup key is not read from the value (the router did not scan it).
fn keyed_pointers(topology: &Topology) -> Option<KeyedPointers> {
    let (k, _, d) = topology.hop().ok().flatten()?;
    if !d.key.needs_json() {
        return None;
    }
    let mut ptrs = Vec::new();
    for s in &topology.stages()[k + 1..] {
        s.kind.spec().json_pointers(&mut ptrs);
    }
    let tokens = ptrs
        .iter()
        .map(|p| crate::processor::json_scan::tokens(p))
        .collect();
    Some((ptrs.into(), tokens))
}

/// Build the dead-letter record for a refused source record: its key, value, timestamp and
/// headers as read, plus the `onceflow.dlq.*` headers naming `source` and the reason; any
/// `onceflow.dlq.*` headers the record already had (a dead letter replayed into the source)
/// are replaced, so each names this failure once. Callers pass the record's
/// [`Record::origin`](crate::Record::origin), so a record read from a repartition topic is
/// named by its original source, not by its repartition coordinates. Headers the record
/// carries are never read for that: a source record's own `onceflow.source` header would
/// name another record.
pub(crate) fn dead_letter(
    dlq_topic: &str,
    source: &(String, i32, i64),
    key: Option<Bytes>,
    value: Option<Bytes>,
    mut headers: Vec<(String, Option<Bytes>)>,
    timestamp: Option<i64>,
    err: &RecordError,
) -> OutRecord {
    let h = |s: String| Some(Bytes::from(s.into_bytes()));
    headers.retain(|(k, _)| !k.starts_with(dlq_headers::PREFIX));
    headers.push((dlq_headers::TOPIC.into(), h(source.0.clone())));
    headers.push((dlq_headers::PARTITION.into(), h(source.1.to_string())));
    headers.push((dlq_headers::OFFSET.into(), h(source.2.to_string())));
    headers.push((dlq_headers::STAGE.into(), h(err.stage.clone())));
    headers.push((dlq_headers::REASON.into(), h(err.reason.clone())));
    OutRecord {
        topic: dlq_topic.to_string(),
        partition: None,
        key,
        value,
        headers,
        timestamp,
    }
}
