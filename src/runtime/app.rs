//! The Kafka runtime's wiring: clients, tasks and the run loop that owns them.
//!
//! One thread runs the loop and owns every piece of state (`RunLoop`): tasks, stores,
//! clients, the commit protocol. Nothing is shared with callbacks, so no lock is taken per
//! record: rebalances arrive as events over a channel (`kafka::consumer`) and are carried
//! out between two turns (`rebalance.rs`). Source records are read in batches from a queue
//! of their own (`kafka::batch::SourceQueue`), without a `poll` or an allocation per
//! record; the consumer's queue, polled once per turn, carries rebalances and errors. The
//! ordered steps of a commit, for both
//! guarantees, live in `runtime::commit`; the loop decides when to commit (every
//! `commit.interval.ms`, or after 50,000 records), advances the at_least_once commits in
//! flight every turn (waiting for all of them before partitions go and at a stop), and
//! carries out a rewind after an aborted transaction.
//!
//! Around the loop: topic preparation (`topics.rs`) before the run, restore on
//! assignment (`restore.rs`: planning, then bounded steps while the partitions already
//! restored keep processing), and on revocation a commit of all partitions' work before
//! the revoked tasks close; their stores stay on disk and are reused, from their stored
//! changelog offset, if the partitions return.
//!
//! With a repartition hop (`runtime::hop`, `routing.rs`), the consumer also reads the
//! repartition topic: source partitions are router tasks, the repartition topic's
//! partitions run the stages; both go through the same commit.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kafka::batch::{BatchRecord, SourceQueue};
use crate::kafka::consumer::{self, RebalanceEvent, SourceConsumer};
use crate::kafka::producer::OutputProducer;
use crate::processor::{Counts, OutRecord, Record, SourceMeta};
use crate::runtime::commit::{Outcome, Protocol, Routed};
use crate::runtime::log::KafkaLog;
use crate::runtime::task::RestoreRecord;
use crate::runtime::Task;
use crate::state::{SledBackend, StateBackend, StateDirLock};
use crate::topology::Topology;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Options of one run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Stop (committing everything) once every assigned partition has been read to its end.
    pub stop_at_end: bool,
    /// Set to true to stop gracefully (SIGTERM/SIGINT): finish the record in hand, commit,
    /// close the stores.
    pub shutdown: Arc<AtomicBool>,
}

/// What a run did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RunSummary {
    /// Totals by outcome.
    pub counts: Counts,
    /// Wall-clock seconds from the first record to the end of the run.
    pub seconds: f64,
    /// Commits made.
    pub commits: u64,
    /// Changelog records applied by restores.
    pub restored: u64,
    /// Memory the state stores of the partitions assigned at the end held in the process
    /// then (before a graceful stop persisted them), by part: what grows with the keys.
    pub state_memory: crate::state::StateMemory,
}

impl RunSummary {
    /// Source records per second.
    pub fn records_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.counts.records_in as f64 / self.seconds
        } else {
            0.0
        }
    }

    /// One line, `key=value` pairs, printed by `onceflow run` at exit.
    pub fn line(&self) -> String {
        let c = &self.counts;
        format!(
            "summary: records_in={} passed={} duplicates={} conflicts={} dead_lettered={} records_out={} effects_done={} effects_skipped={} effects_unprotected={} restored={} commits={} seconds={:.3} records_per_second={:.0} state_memory_mib=resident:{:.1},key_filter:{:.1},engine:{:.1}",
            c.records_in, c.passed, c.duplicates, c.conflicts, c.dead_lettered, c.records_out,
            c.effects_done, c.effects_skipped, c.effects_unprotected,
            self.restored, self.commits, self.seconds, self.records_per_second(),
            mib(self.state_memory.resident), mib(self.state_memory.key_filter),
            mib(self.state_memory.engine)
        )
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// A topology bound to a config, ready to run against Kafka.
pub struct App {
    config: Config,
    topology: Topology,
}

/// Restore records taken per loop turn, so a restore never stalls the other partitions.
const RESTORE_BATCH: usize = 20_000;

/// Source records processed (when available) after each restore step, so partitions that
/// are restored keep processing while others restore.
const RECORDS_PER_RESTORE_STEP: usize = 1_000;

/// Source records one turn of the run loop takes at most (when they are queued) before it
/// looks at rebalance events, restores and its status again.
const RECORDS_PER_TURN: usize = 1_000;

/// Records between two checks whether a commit is due (or the commits in flight can take
/// their next steps) within a turn.
const CHECK_EVERY: usize = 64;

/// Source records after which a commit is due whatever the interval.
const MAX_UNCOMMITTED: usize = 50_000;

/// Everything the run loop owns.
struct RunLoop {
    /// The commit protocol (guarantee, open transaction, records since the last commit).
    protocol: Protocol,
    /// Sink topics whose own `max.message.bytes` admits less than the producer's limit,
    /// with the largest record each takes (see `App::topic_record_limits`).
    topic_limits: Arc<std::collections::HashMap<String, usize>>,
    topology: Topology,
    config: Config,
    /// The topics the tasks read, and the task id of each partition (`runtime::hop`).
    topics: super::hop::Topics,
    /// The repartition hop, when a dedup stage repartitions (after no stage, or after
    /// filter and map stages only, which the routers run; `routing.rs`).
    hop: Option<routing::Hop>,
    /// The source topic, shared by every record read (no copy per record).
    source_name: Arc<str>,
    /// `<application.id>-<instance id>`, for error messages.
    transactional_id: String,
    backend: SledBackend,
    producer: Arc<OutputProducer>,
    /// The transaction committing in the background (exactly_once_v2; `runtime::log`).
    committing: Option<std::thread::JoinHandle<Result<()>>>,
    /// Destroys the restore consumer's batches in the background; declared before the
    /// restore consumer so that it is dropped (and done) first.
    batch_freer: crate::kafka::batch::Freer,
    restore_consumer: BaseConsumer,
    /// read_uncommitted client for changelog high watermarks (see [`RunLoop::plan_restores`]).
    watermarks: BaseConsumer,
    /// The consumer group metadata of the current assignment, captured when it was made
    /// (exactly_once_v2): offsets sent with it are refused by the group coordinator once
    /// the group has moved to a newer generation (KIP-447), so an instance that lost its
    /// partitions cannot commit offsets for them.
    group_meta: Option<std::sync::Arc<rdkafka::consumer::ConsumerGroupMetadata>>,
    /// When planning was last tried for partitions whose changelog held open transactions.
    last_plan: Option<Instant>,
    /// Partitions waiting for an open changelog transaction to end (logged once each).
    open_txn_waits: BTreeSet<i32>,
    /// Changelog topic of each store.
    changelogs: BTreeMap<String, String>,
    /// Published for `/health` and `/ready` (see [`RunLoop::publish_status`]).
    status: Option<Arc<super::Status>>,
    /// The assignment changed since the status was last published.
    status_dirty: bool,
    /// The last published status showed a restore or a wait.
    status_restoring: bool,
    /// An assignment was received (maybe empty).
    assigned_once: bool,
    tasks: BTreeMap<i32, Task>,
    /// Assigned partitions whose restore is not planned yet.
    unplanned: BTreeSet<i32>,
    /// Offset to seek back to when a restoring partition resumes (a record slipped in).
    replay_from: BTreeMap<i32, i64>,
    closed_counts: Counts,
    /// When the state-memory gauges were last set, and the commits made then.
    memory_reported: Option<(Instant, u64)>,
    /// When the last commit ended.
    last_commit: Instant,
    /// When the last commit started.
    last_commit_start: Instant,
    /// Time the loop waited for source records since the last commit ended.
    idle: Duration,
    last_restore_log: Instant,
    restored: u64,
    out: Vec<OutRecord>,
    first_record: Option<Instant>,
    /// Lookup tables, loaded before the consumer subscribes (runtime/table.rs).
    tables: crate::state::table::Tables,
    /// The last origin topic of a repartition record (shared by the records naming it).
    origin_topic: Option<Arc<str>>,
    /// Blocks the fetched records' keys, values and header values are copied into (see
    /// [`to_record`]).
    arena: crate::state::Arena,
    /// The dedup key of the record last routed in place (reused; see
    /// [`Router::route_parts`](crate::processor::repartition::Router::route_parts)).
    route_key: Vec<u8>,
    /// The source header's value of the record last routed in place (reused).
    route_text: Vec<u8>,
    /// With a hop: the task id of partition 0 of each topic read (see
    /// [`RunLoop::task_base`]), by the address of its librdkafka topic handle.
    task_bases: Vec<(usize, i32)>,
    /// `--stop-at-end`: the end last read of each task's partition (see
    /// [`RunLoop::input_at_end`]). An end only grows, so a position below it is not at the
    /// end, asked of no broker.
    stop_ends: BTreeMap<i32, i64>,
    /// Held while any partition is restoring: the state writer then writes only what a
    /// store waits for, leaving the CPU to the restore (see [`crate::state::Writer`]).
    writer_hold: Option<crate::state::WriterHold>,
    /// The queue the source records are read from in batches (set once the consumer
    /// exists; dropped before it closes).
    source_queue: Option<SourceQueue>,
    /// Reads a batch's far repeats ahead of the run loop (see [`crate::state::Warmer`]);
    /// `None` when its thread could not be started. Stopped before the stores are synced.
    warmer: Option<crate::state::Warmer>,
    /// Task ids seeked (rewound or reopened) since the current batch was taken: the rest
    /// of the batch's records of these partitions are stale and skipped (librdkafka reads
    /// them again from the new position).
    seeked: BTreeSet<i32>,
}

/// The [`KafkaLog`] of a run loop, borrowing its fields one by one (so the protocol and the
/// tasks can be borrowed mutably next to it).
macro_rules! kafka_log {
    ($e:expr, $consumer:expr, $mode:expr) => {
        KafkaLog {
            producer: &mut $e.producer,
            committing: &mut $e.committing,
            config: &$e.config,
            consumer: $consumer,
            topics: &$e.topics,
            changelogs: &$e.changelogs,
            group_meta: $e.group_meta.as_ref(),
            mode: $mode,
            transactional_id: &$e.transactional_id,
        }
    };
}

#[path = "rebalance.rs"]
mod rebalance;
#[path = "restore.rs"]
mod restore;
#[path = "routing.rs"]
mod routing;
#[path = "topics.rs"]
mod topics;

impl RunLoop {
    fn tpl_of(topic: &str, partitions: &[i32], at: Option<Offset>) -> Result<TopicPartitionList> {
        let mut tpl = TopicPartitionList::new();
        for p in partitions {
            match at {
                Some(o) => {
                    tpl.add_partition_offset(topic, *p, o)
                        .map_err(Error::kafka("partition list"))?;
                }
                None => {
                    tpl.add_partition(topic, *p);
                }
            }
        }
        Ok(tpl)
    }

    fn tpl_one(topic: &str, p: i32, offset: Option<i64>) -> Result<TopicPartitionList> {
        Self::tpl_of(topic, &[p], offset.map(Offset::Offset))
    }

    /// With a hop, the task id of partition 0 of `m`'s topic ([`Topics::id`](super::hop::Topics::id)), to which its
    /// partition is added. Told by the topic handle's address: the consumer keeps one handle
    /// per topic it reads for as long as it lives, and the name (a C string to measure and
    /// check) is then read once per topic, not once per record.
    fn task_base(&mut self, m: &BatchRecord<'_>) -> i32 {
        let handle = m.topic_handle();
        if let Some((_, base)) = self.task_bases.iter().find(|(h, _)| *h == handle) {
            return *base;
        }
        let base = self.topics.id(m.topic().unwrap_or_default(), 0);
        self.task_bases.push((handle, base));
        base
    }

    /// The task id of `m` (`runtime::hop`): its partition, or a router's id with a hop.
    fn task_id(&mut self, m: &BatchRecord<'_>) -> i32 {
        match &self.hop {
            None => m.partition(),
            Some(_) => self.task_base(m) + m.partition(),
        }
    }

    /// Hand the keys of `batch` whose lookups would read a store's engine (far repeats) to
    /// the warmer, which reads them while the batch is processed. Only when some task's
    /// store may read its engine ([`Task::warms`]): nothing is done while every key is in
    /// memory. Whether it went over the batch.
    fn warm(&mut self, batch: &crate::kafka::batch::Batch) -> bool {
        if self.warmer.is_none() {
            return false;
        }
        let warming: Vec<i32> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.warms())
            .map(|(p, _)| *p)
            .collect();
        if warming.is_empty() {
            return false;
        }
        let mut keys = crate::state::WarmBatch::default();
        for (i, m) in batch.records().enumerate() {
            self.prefetch_ahead(batch, i, true);
            let Ok(m) = m else { continue };
            let p = self.task_id(&m);
            if !warming.contains(&p) {
                continue;
            }
            if let Some(task) = self.tasks.get(&p) {
                keys.record(i);
                task.warm_into(m.key(), m.payload(), &mut keys);
            }
        }
        if keys.len() > 0 {
            if let Some(w) = &self.warmer {
                w.send(keys);
            }
        }
        true
    }

    /// Before record `i` of `batch`: fetch into the cache, in steps ahead, a message's
    /// header, then (read from it) its key and value, then (with `store`) its key's place
    /// in the store, so none is a cache miss the record waits on.
    fn prefetch_ahead(&mut self, batch: &crate::kafka::batch::Batch, i: usize, store: bool) {
        batch.prefetch(i + 3 * PREFETCH_AHEAD);
        batch.prefetch_data(i + 2 * PREFETCH_AHEAD);
        if store {
            if let Some(m) = batch.get(i + PREFETCH_AHEAD) {
                self.prefetch(&m);
            }
        }
    }

    /// Hint that record `m` is processed soon (see [`Task::prefetch`]).
    fn prefetch(&mut self, m: &BatchRecord<'_>) {
        let p = self.task_id(m);
        if let Some(task) = self.tasks.get(&p) {
            task.prefetch(m.key(), m.payload());
        }
    }

    /// Process one source record; `wall_ms` is the wall clock read once per burst of
    /// records (see [`run_loop`]).
    fn process(
        &mut self,
        consumer: &SourceConsumer,
        m: &BatchRecord<'_>,
        wall_ms: i64,
    ) -> Result<()> {
        // The task id (`runtime::hop`): the partition, or a router's id with a hop.
        let p = self.task_id(m);
        self.first_record.get_or_insert_with(Instant::now);
        let Some(task) = self.tasks.get_mut(&p) else {
            // Not ours (any more): never process a record without its task and stores.
            return Ok(());
        };
        if task.is_restoring() || self.unplanned.contains(&p) {
            // Fetched before the pause took effect: read it again once restored.
            self.replay_from.entry(p).or_insert(m.offset());
            consumer
                .pause(&self.tpl_id(p, None)?)
                .map_err(Error::kafka("pause"))?;
            return Ok(());
        }
        if let (Some(hop), true) = (&self.hop, task.routes_only()) {
            // Routed in place, without copying the message into a record.
            use crate::processor::repartition::is_hop_header;
            let names: Vec<_> = m.headers().collect();
            let mut headers: Vec<(&str, Option<&[u8]>)> = Vec::new();
            if !names.is_empty() {
                headers.reserve(names.len() + 2);
                headers.extend(names.iter().map(|(k, v)| (&k[..], *v)));
            }
            if !headers.iter().any(|(k, _)| is_hop_header(k)) {
                let (partition, keyed) = hop.router.route_parts(
                    (m.key(), m.payload(), m.timestamp()),
                    &mut headers,
                    // The source topic's name, shared: `m.topic()` measures the C
                    // string of every message.
                    (&self.source_name, m.partition(), m.offset()),
                    &mut self.route_key,
                    &mut self.route_text,
                );
                task.routed(m.offset());
                let rec = Routed {
                    topic: &hop.name,
                    partition,
                    key: if keyed {
                        Some(&self.route_key[..])
                    } else {
                        m.key()
                    },
                    value: m.payload(),
                    headers: &headers,
                    timestamp: m.timestamp(),
                };
                let mut log = kafka_log!(self, consumer, CommitMode::Async);
                return self.protocol.processed_routed(&mut log, &rec);
            }
        }
        let reads_hop = self.hop.is_some() && !self.topics.is_router(p);
        let topic = self.record_topic(p).clone();
        let record = to_record(
            m,
            &topic,
            reads_hop.then_some(&mut self.origin_topic),
            &mut self.arena,
        );
        let Some(task) = self.tasks.get_mut(&p) else {
            return Ok(());
        };
        task.process(record, wall_ms, &mut self.out)?;
        let mut log = kafka_log!(self, consumer, CommitMode::Async);
        self.protocol.processed(&mut log, &mut self.out)
    }

    /// Do the steps of the commits in flight that are ready (no wait): at_least_once, the
    /// next step of each; exactly_once_v2, the end of the transaction committing in the
    /// background (its state applied, the outputs held meanwhile sent), or its failure
    /// carried out.
    fn advance(&mut self, consumer: &SourceConsumer) -> Result<()> {
        if self.protocol.in_flight() == 0 {
            return Ok(());
        }
        let mut log = kafka_log!(self, consumer, CommitMode::Async);
        let outcome = self.protocol.advance(&mut log, &mut self.tasks)?;
        if self.protocol.guarantee() == crate::config::Guarantee::AtLeastOnce {
            // Purged after the commits of the loop's own (see `commit`).
            return Ok(());
        }
        self.carry_out(consumer, outcome, CommitMode::Async)
    }

    /// A commit is due every `commit.interval.ms`: busy (a backlog), counted from the end
    /// of the last commit, so a slow commit never leaves the next interval without time to
    /// process; caught up (the loop waited for records at least half the time since), from
    /// its start, so a record waits about one interval plus one commit, not two commits.
    fn commit_due(&self) -> bool {
        let n = self.protocol.uncommitted();
        if n == 0 {
            return false;
        }
        let interval = Duration::from_millis(self.config.commit_interval_ms);
        let since_end = self.last_commit.elapsed();
        n >= MAX_UNCOMMITTED
            || since_end >= interval
            || (self.last_commit_start.elapsed() >= interval && self.idle * 2 >= since_end)
    }

    /// Run one commit (`runtime::commit`); after an aborted transaction, seek the
    /// partitions back to their committed offsets.
    fn commit(&mut self, consumer: &SourceConsumer, mode: CommitMode) -> Result<()> {
        if self.protocol.guarantee() == crate::config::Guarantee::ExactlyOnceV2 {
            // The group metadata of now, not of the last assignment (as Kafka Streams
            // does): under the cooperative protocol the generation can move on between two
            // assignments of this instance (a revocation comes after the new generation's
            // SyncGroup), and offsets sent with an older generation may be refused. A
            // member that lost its partitions gets no newer generation before the run loop
            // has carried out the loss (librdkafka waits for the unassign), so a zombie's
            // offsets are still refused (KIP-447).
            self.group_meta = consumer.group_metadata().map(std::sync::Arc::new);
        }
        self.last_commit_start = Instant::now();
        let mut log = kafka_log!(self, consumer, mode);
        let result = if matches!(mode, CommitMode::Sync) {
            // Before partitions go or the instance stops: every commit in flight completes.
            self.protocol
                .commit_and_drain(&mut log, &mut self.tasks, wall_clock_ms())
        } else {
            self.protocol
                .commit(&mut log, &mut self.tasks, wall_clock_ms())
        };
        self.last_commit = Instant::now();
        self.idle = Duration::ZERO;
        self.carry_out(consumer, result?, mode)
    }

    /// Carry out what a commit (or a step of one in flight) ended with: after an aborted
    /// transaction, seek the partitions back to their committed offsets; after one of
    /// unknown outcome, open every partition again; after a commit, purge the consumed
    /// repartition records.
    fn carry_out(
        &mut self,
        consumer: &SourceConsumer,
        outcome: Outcome,
        mode: CommitMode,
    ) -> Result<()> {
        match outcome {
            Outcome::Aborted(seek) => self.rewind(consumer, &seek),
            Outcome::Unknown => self.reopen_all(consumer),
            Outcome::Committed => {
                self.purge(mode, true);
                Ok(())
            }
            Outcome::Nothing => {
                self.purge(mode, false);
                Ok(())
            }
            Outcome::Crashed(_) => Ok(()),
        }
    }

    /// Seek `partitions` back to the given offsets (`None`: the beginning); they are no
    /// longer at their end.
    fn rewind(
        &mut self,
        consumer: &SourceConsumer,
        partitions: &[(i32, Option<i64>)],
    ) -> Result<()> {
        let mut seek = TopicPartitionList::new();
        for (p, off) in partitions {
            self.seeked.insert(*p);
            let (topic, partition) = self.topics.tp(*p);
            seek.add_partition_offset(
                topic,
                partition,
                off.map_or(Offset::Beginning, Offset::Offset),
            )
            .map_err(Error::kafka("build offsets"))?;
        }
        if seek.count() > 0 {
            consumer
                .seek_partitions(seek, Duration::from_secs(30))
                .map_err(Error::kafka("seek"))?;
        }
        Ok(())
    }
}

fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The record of `m`; the topic name is shared, not copied. With `origin` (a record of a
/// repartition topic), its [`SOURCE`](crate::processor::repartition::SOURCE) header becomes
/// the record's origin without being copied (`origin` caches the topic name). Key, value
/// and header values are copied into `arena`: no allocation per record, and the task's
/// dead-letter copy of them is a reference count.
fn to_record(
    m: &BatchRecord<'_>,
    topic: &Arc<str>,
    mut origin: Option<&mut Option<Arc<str>>>,
    arena: &mut crate::state::Arena,
) -> Record {
    use crate::processor::repartition::{origin_of, SOURCE, UNKEYED, UNTIMED};
    let mut from = None;
    let mut unkeyed = false;
    let mut untimed = false;
    let headers = m
        .headers()
        .filter(|(key, value)| {
            let Some(last) = origin.as_deref_mut() else {
                return true;
            };
            if key == UNKEYED {
                unkeyed = true;
                return false;
            }
            if key == UNTIMED {
                untimed = true;
                return false;
            }
            if from.is_some() || key != SOURCE {
                return true;
            }
            // Kept as a header when it does not parse (the task names the record by its
            // repartition coordinates then).
            from = value.and_then(|v| origin_of(v, last));
            from.is_none()
        })
        .map(|(key, value)| (key.into_owned(), value.map(|v| arena.copy(v))))
        .collect();
    let keyed = from.is_some() && !unkeyed;
    Record {
        key: m.key().map(|k| arena.copy(k)),
        value: m.payload().map(|v| arena.copy(v)),
        headers,
        // The repartition record's stamp when the source record had none (see UNTIMED).
        timestamp: m.timestamp().filter(|_| !untimed),
        json: None,
        fields: None,
        source: SourceMeta {
            topic: topic.clone(),
            partition: m.partition(),
            offset: m.offset(),
        },
        origin: from,
        keyed,
        dedup_key: None,
        as_read: None,
        view_edited: false,
        unset: None,
    }
}

impl App {
    /// Bind `topology` to `config`.
    pub fn new(config: Config, topology: Topology) -> App {
        App { config, topology }
    }

    /// Run until shutdown is requested (or, with `stop_at_end`, the input is exhausted).
    ///
    /// With the `mimalloc` feature on Linux it first turns transparent huge pages off for
    /// the process, unless `MIMALLOC_ALLOW_THP` is set, and sets the allocator's purge
    /// delay to 100 ms, unless `MIMALLOC_PURGE_DELAY` is set (see the README,
    /// Configuration).
    ///
    /// # Errors
    /// Start-up errors (state dir locked, source topic missing, changelog partition count
    /// wrong, bad `kafka.*` property) and fatal run errors (a delivery that failed for
    /// good, a store failure, [`Error::Fenced`]). Nothing of the failed batch is committed:
    /// a restart processes it again.
    pub fn run(&self, opts: RunOptions) -> Result<RunSummary> {
        self.run_with_status(opts, None)
    }

    /// As [`App::run`], publishing the run's health and restore progress to `status` (for
    /// `/health` and `/ready`).
    pub(crate) fn run_with_status(
        &self,
        opts: RunOptions,
        status: Option<Arc<super::Status>>,
    ) -> Result<RunSummary> {
        if crate::limit_huge_pages() {
            tracing::debug!("transparent huge pages off for this process");
        }
        if let Some(ms) = crate::limit_retained_memory() {
            tracing::debug!(ms, "allocator purge delay");
        }
        let result = self.run_inner(opts, status.clone());
        if let Some(s) = status {
            s.finish(result.as_ref().err().map(|e| e.to_string()));
        }
        result
    }

    fn run_inner(
        &self,
        opts: RunOptions,
        status: Option<Arc<super::Status>>,
    ) -> Result<RunSummary> {
        let _lock = StateDirLock::acquire(&self.config.state_dir)?;
        // Local sink stores live under the locked state dir.
        let topology = self
            .topology
            .clone()
            .with_state_dir(&self.config.state_dir, &self.config.application_id);
        self.topology.preflight()?;
        // A stop asked for while the broker is still out of reach ends the run here.
        let prepared = match crate::kafka::retry::cancellable(&opts.shutdown, || {
            self.prepare_topics()
        }) {
            Err(e) if opts.shutdown.load(Ordering::SeqCst) => {
                tracing::info!(error = %e, "shutdown requested while preparing topics: stopping");
                return Ok(RunSummary::default());
            }
            r => r?,
        };
        let dir = self.config.state_dir.join(&self.config.application_id);
        // A corrupted database is set aside and its stores restore from the changelogs.
        let cache = self
            .config
            .sled_cache_bytes(!self.topology.tables().is_empty());
        let backend = SledBackend::open_checked(&dir, cache)?;
        let table_set =
            super::table::TableSet::start(&self.config, &self.topology, &backend, &opts.shutdown)?;
        let changelogs: BTreeMap<String, String> = self.changelog_topics();
        let partitions = prepared.partitions;
        let topic_limits = Arc::new(prepared.record_limits);
        // A batch of small records must fit the smallest of those topics too.
        let mut config = self.config.clone();
        if let Some(min) = topic_limits.values().min() {
            let batch = config
                .kafka_producer
                .get("batch.size")
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(crate::config::DEFAULT_MAX_RECORD_BYTES);
            if *min < batch {
                config
                    .kafka_producer
                    .insert("batch.size".into(), min.max(&1).to_string());
            }
        }
        let producer = OutputProducer::new(&config)?;
        let restore_consumer = consumer::create_restore_consumer(&self.config)?;
        let watermarks = consumer::create_watermark_client(&self.config)?;
        if self.config.exactly_once() {
            producer.init_transactions()?;
            tracing::info!(transactional_id = %self.config.transactional_id(), "transactions initialised");
        }
        let hop = self.hop(partitions)?;
        let mut e = RunLoop {
            protocol: Protocol::new(self.config.processing_guarantee, self.topology.name()),
            topic_limits,
            topology,
            config,
            topics: super::hop::Topics::new(
                &self.topology.source().topic,
                hop.as_ref().map(|h| h.name.to_string()),
            ),
            hop,
            source_name: self.topology.source().topic.as_str().into(),
            transactional_id: self.config.transactional_id(),
            backend,
            producer: Arc::new(producer),
            committing: None,
            batch_freer: crate::kafka::batch::Freer::spawn(),
            restore_consumer,
            watermarks,
            group_meta: None,
            last_plan: None,
            open_txn_waits: BTreeSet::new(),
            changelogs,
            status,
            status_dirty: true,
            status_restoring: false,
            assigned_once: false,
            tasks: BTreeMap::new(),
            unplanned: BTreeSet::new(),
            replay_from: BTreeMap::new(),
            closed_counts: Counts::default(),
            last_commit: Instant::now(),
            last_commit_start: Instant::now(),
            idle: Duration::ZERO,
            last_restore_log: Instant::now(),
            restored: 0,
            out: Vec::with_capacity(16),
            first_record: None,
            memory_reported: None,
            tables: table_set.handles(),
            writer_hold: None,
            origin_topic: None,
            arena: crate::state::Arena::new(),
            route_key: Vec::new(),
            route_text: Vec::new(),
            task_bases: Vec::new(),
            stop_ends: BTreeMap::new(),
            source_queue: None,
            warmer: crate::state::Warmer::spawn()
                .map_err(|err| tracing::warn!(error = %err, "no read-ahead thread: far repeats are read on the run loop alone"))
                .ok(),
            seeked: BTreeSet::new(),
        };
        let (events_tx, events) = mpsc::channel();
        let consumer = consumer::create(&self.config, events_tx)?;
        e.source_queue = Some(SourceQueue::new(&consumer).map_err(Error::kafka("source queue"))?);
        consumer.context().defer_rebalances(true);
        // Dropped before the consumer, also when the run loop panics: unwinding closes the
        // consumer, and the close waits for rebalances only the context can then carry out.
        let deferring = Undefer(&consumer);
        consumer
            .subscribe(&e.topics.subscription())
            .map_err(Error::kafka("subscribe"))?;
        tracing::info!(topology = self.topology.name(), source = %self.topology.source().topic,
            state = %dir.display(), "running");
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_loop(&consumer, &mut e, &events, &opts).and_then(|_| {
                // Graceful stop: carry out the rebalances already announced, commit what
                // was processed, then leave the group.
                e.handle_events(&consumer, &events)?;
                e.commit(&consumer, CommitMode::Sync)
            })
        }));
        // Nothing is read from the source queue any more; it goes before the consumer
        // (librdkafka's destroy waits for it), whatever the outcome, a panic too.
        e.source_queue = None;
        // The read-ahead thread holds stores of queued batches: stopped before they sync.
        e.warmer = None;
        let result = result.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        // From here on (leaving the group, closing) the context carries out rebalances
        // itself; an announced one the loop did not carry out is done now.
        drop(deferring);
        rebalance::settle(&consumer, &events);
        if result.is_ok() && !consumer::is_static_member(&self.config) {
            consumer.unsubscribe();
        }
        // A static member does not leave: closing the consumer (on drop) sends no
        // LeaveGroup (KIP-345), so the group keeps its partitions for it until
        // `session.timeout.ms` and a restart within that time moves nothing. (An
        // unsubscribe would leave the group and move every partition twice.)
        let mut counts = e.closed_counts;
        let mut state_memory = crate::state::StateMemory::default();
        for t in e.tasks.values() {
            counts.add(t.counts());
            if result.is_ok() {
                // For the summary, which only a run that ends well returns.
                state_memory.add(t.state_memory());
            }
        }
        if result.is_ok() {
            // Graceful stop: let the background writer finish, so a restart resumes from
            // the last committed changelog offset instead of restoring it again.
            // At most `state.stop.persist.ms`: what is left is restored from the changelog
            // at the next start (the engine holds a prefix of the batches, with the
            // changelog offset of the last one), so a stop after a long backlog stays short.
            let t0 = Instant::now();
            let deadline = t0 + Duration::from_millis(self.config.stop_persist_ms);
            let mut synced = Ok(true);
            for t in e.tasks.values_mut() {
                synced = match synced {
                    Ok(all) => t.sync_stores_until(deadline).map(|a| a && all),
                    err => err,
                };
            }
            let ms = t0.elapsed().as_millis() as u64;
            match synced {
                Ok(true) => tracing::info!(ms, "stop: state persisted"),
                Ok(false) => tracing::info!(
                    ms,
                    "stop: state partly persisted within state.stop.persist.ms; the next start restores the rest from the changelog"
                ),
                Err(err) => tracing::warn!(error = %err, "state not fully persisted at stop: the next start restores the rest from the changelog"),
            }
        }
        e.tasks.clear();
        if let Some(hop) = e.hop.take() {
            // The last purge (after the final commit) completes before the exit.
            hop.purger.finish();
        }
        e.backend.flush()?;
        if result.is_ok() {
            // What the next start checks the stores against.
            if let Err(err) = e.backend.seal() {
                tracing::warn!(error = %err, "state dir not sealed: the next start cannot check it");
            }
        }
        let seconds = e
            .first_record
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        let summary = RunSummary {
            counts,
            seconds,
            commits: e.protocol.commits(),
            restored: e.restored,
            state_memory,
        };
        close_within(CLOSE_TIMEOUT, consumer);
        result.map(|_| summary)
    }
}

/// Turns the deferral of rebalances off when dropped. A panic in the run loop unwinds
/// through the consumer's drop, whose close waits for the group's last rebalance: with
/// deferral on, that rebalance waits for a run loop that is gone, and the process hung
/// instead of exiting (test `kafka_ops::a_panic_in_the_run_loop_ends_the_process…`).
struct Undefer<'a>(&'a SourceConsumer);

impl Drop for Undefer<'_> {
    fn drop(&mut self) {
        self.0.context().defer_rebalances(false);
    }
}

/// How long closing the source consumer may take once the run is over: see
/// [`close_within`].
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Close the source consumer (it leaves the group), waiting at most `timeout`. Nothing is
/// left to commit by then; a close that takes longer (librdkafka's consumer close waits for
/// a rebalance the group is in the middle of, which can last until the rebalance timeout)
/// goes on in the background, with a warning, and the run returns: the group gives the
/// member's partitions to the others after `session.timeout.ms` at the latest.
fn close_within(timeout: Duration, consumer: SourceConsumer) {
    let (done_tx, done) = mpsc::channel::<()>();
    let closing = std::thread::Builder::new()
        .name("onceflow-close".into())
        .spawn(move || {
            drop(consumer);
            drop(done_tx);
        });
    if closing.is_err() {
        tracing::warn!(
            "stop: could not start a thread to close the source consumer: it is left open"
        );
        return;
    }
    let t0 = Instant::now();
    if let Err(mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(timeout) {
        tracing::warn!(
            timeout_ms = timeout.as_millis() as u64,
            "stop: the source consumer did not close in time (leaving the group); the run ends without waiting, with offsets committed and state persisted"
        );
    } else {
        tracing::info!(
            ms = t0.elapsed().as_millis() as u64,
            "stop: source consumer closed"
        );
    }
}

/// While every broker is unreachable, how often (and how long) the run loop asks for
/// metadata to learn that one answers again.
const LINK_PROBE_EVERY: Duration = Duration::from_secs(1);

/// The run loop: restore steps, polls, processing, rebalances and commits, until shutdown
/// (or, with `stop_at_end`, the end of every assigned partition).
fn run_loop(
    consumer: &SourceConsumer,
    e: &mut RunLoop,
    events: &mpsc::Receiver<RebalanceEvent>,
    opts: &RunOptions,
) -> Result<()> {
    let mut last_probe = Instant::now();
    loop {
        if opts.shutdown.load(Ordering::SeqCst) {
            tracing::info!("shutdown requested: committing and closing");
            return Ok(());
        }
        if let Some(s) = &e.status {
            s.beat();
        }
        if crate::kafka::link::is_down() && last_probe.elapsed() >= LINK_PROBE_EVERY {
            // Nothing reports the way back from "every broker down": ask (kafka::link).
            last_probe = Instant::now();
            let md = consumer
                .client()
                .fetch_metadata(Some(e.topics.source()), LINK_PROBE_EVERY);
            if md.is_ok() {
                crate::kafka::link::note_up();
            }
        }
        e.handle_events(consumer, events)?;
        if !e.unplanned.is_empty() {
            e.plan_restores(consumer)?;
        }
        e.publish_status();
        e.report_state_memory();
        let restoring = e.any_restoring();
        if restoring != e.writer_hold.is_some() {
            e.writer_hold = if restoring {
                e.backend.writer().map(|w| w.hold())
            } else {
                None
            };
        }
        let (wait, burst) = if e.tasks.values().any(|t| t.is_restoring()) {
            e.restore_step(consumer, Duration::from_millis(5))?;
            (Duration::ZERO, RECORDS_PER_RESTORE_STEP)
        } else if !e.unplanned.is_empty() {
            // Waiting for an open changelog transaction: poll briefly, plan again.
            (Duration::from_millis(20), 1)
        } else if e.protocol.in_flight() > 0 {
            // Commits in flight: come back soon to do their next steps.
            (Duration::from_millis(2), RECORDS_PER_TURN)
        } else {
            (EVENT_SLICE, RECORDS_PER_TURN)
        };
        // One turn: serve the consumer's queue (rebalances, errors; records only of a
        // partition not forwarded to the source queue), then take a batch of records from
        // the source queue; with neither, wait for a record (in slices, so rebalances are
        // served) and end the turn. The clock is read once per turn (for processing time)
        // and the commit checked every `CHECK_EVERY` records: per record, clock reads cost
        // more than the dedup check. While restores run, the partitions already restored
        // get a share of each turn.
        let wall_ms = wall_clock_ms();
        let mut polled = 0;
        while polled < burst {
            match consumer.poll(Duration::ZERO) {
                None => break,
                Some(m) => {
                    polled += 1;
                    if !e.consumed(consumer, m.map(|m| (m, wall_ms)))? {
                        break;
                    }
                }
            }
        }
        e.handle_events(consumer, events)?;
        let Some(queue) = &e.source_queue else {
            return Err(Error::Internal("the run loop has no source queue".into()));
        };
        let mut batch = queue
            .take(Duration::ZERO, burst - polled.min(burst))
            .map_err(Error::kafka("read the source"))?;
        if batch.is_empty() && polled == 0 {
            if !wait.is_zero() {
                // Returns at the first record: no wait added to a record's latency.
                let t = Instant::now();
                batch = queue
                    .take(wait.min(EVENT_SLICE), 1)
                    .map_err(Error::kafka("read the source"))?;
                e.idle += t.elapsed();
            }
            if batch.is_empty() {
                if opts.stop_at_end && e.input_at_end(consumer) {
                    // Commit first: a failed transaction rewinds its partitions (their
                    // positions fall behind the end again); their records are processed
                    // again before stopping.
                    e.commit(consumer, CommitMode::Sync)?;
                    if e.input_at_end(consumer) {
                        tracing::info!("every assigned partition is at its end: stopping");
                        return Ok(());
                    }
                }
                e.check_commit(consumer)?;
                continue;
            }
        }
        e.seeked.clear();
        // With a pass over the batch for reads ahead, its keys' places in the stores were
        // just fetched (a batch's lines fit the core's cache): not again.
        let passed = e.warm(&batch);
        for (i, r) in batch.records().enumerate() {
            e.prefetch_ahead(&batch, i, !passed);
            if let Some(w) = &e.warmer {
                w.reached(i);
            }
            e.consumed_record(consumer, r, wall_ms)?;
            if i % CHECK_EVERY == CHECK_EVERY - 1 {
                e.check_commit(consumer)?;
            }
        }
        drop(batch);
        if let Some(w) = &e.warmer {
            w.next_turn();
        }
        e.check_commit(consumer)?;
    }
}

/// How many records of a batch ahead of the one processed the run loop prefetches the
/// store place of (see [`Task::prefetch`]); twice as far ahead, their keys and values,
/// and three times as far, their messages' headers.
const PREFETCH_AHEAD: usize = 4;

/// The longest the run loop waits on the source queue at a time when it is idle: rebalances
/// and errors on the consumer's queue wait at most this long to be served.
const EVENT_SLICE: Duration = Duration::from_millis(10);

impl RunLoop {
    /// Set the state-memory gauges once a commit was made since they were last set, at
    /// most every [`STATE_MEMORY_EVERY`](crate::metrics::STATE_MEMORY_EVERY); again at
    /// the next turns while an engine was busy writing a batch (its part not set).
    fn report_state_memory(&mut self) {
        let commits = self.protocol.commits();
        let due = match self.memory_reported {
            None => commits > 0,
            Some((at, then)) => {
                commits > then && at.elapsed() >= crate::metrics::STATE_MEMORY_EVERY
            }
        };
        if due {
            let mut all = true;
            for t in self.tasks.values() {
                all &= t.report_state_memory();
            }
            if all {
                self.memory_reported = Some((Instant::now(), commits));
            }
        }
    }

    /// A commit if one is due, else the next steps of the commits in flight.
    fn check_commit(&mut self, consumer: &SourceConsumer) -> Result<()> {
        if self.commit_due() {
            self.commit(consumer, CommitMode::Async)
        } else {
            self.advance(consumer)
        }
    }

    /// Handle what `poll` returned from the consumer's queue; false when the turn should
    /// stop taking from it.
    fn consumed(
        &mut self,
        consumer: &SourceConsumer,
        polled: rdkafka::error::KafkaResult<(rdkafka::message::BorrowedMessage<'_>, i64)>,
    ) -> Result<bool> {
        match polled {
            Ok((m, wall_ms)) => {
                self.seeked.clear();
                self.consumed_record(consumer, Ok(BatchRecord::of(&m)), wall_ms)?;
                self.check_commit(consumer)?;
                Ok(true)
            }
            Err(err) => {
                self.consumed_record(consumer, Err(err), 0)?;
                Ok(false)
            }
        }
    }

    /// Handle one entry of the source stream: process a record (unless its partition was
    /// seeked since it was fetched) or report an error.
    fn consumed_record(
        &mut self,
        consumer: &SourceConsumer,
        r: std::result::Result<BatchRecord<'_>, rdkafka::error::KafkaError>,
        wall_ms: i64,
    ) -> Result<()> {
        match r {
            Ok(m) => {
                if !self.seeked.is_empty() {
                    let p = self.task_id(&m);
                    if self.seeked.contains(&p) {
                        return Ok(());
                    }
                }
                self.process(consumer, &m, wall_ms)
            }
            Err(err) => {
                if let Some((code, reason)) = consumer.client().fatal_error() {
                    return Err(fatal_consumer_error(code, &reason));
                }
                tracing::warn!(error = %err, "consumer error");
                Ok(())
            }
        }
    }
}

/// The error that stops an instance whose consumer failed for good. The one such failure
/// to expect is a static member fenced (KIP-345): another running instance joined with the
/// same `group.instance.id`, i.e. the same `application.id` and `instance.id`.
fn fatal_consumer_error(code: rdkafka::types::RDKafkaErrorCode, reason: &str) -> Error {
    if code == rdkafka::types::RDKafkaErrorCode::FencedInstanceId {
        Error::Fenced(format!(
            "another instance joined the consumer group with this instance's group.instance.id ({reason}); \
             every running instance needs its own instance.id: this instance stops"
        ))
    } else {
        Error::Fenced(format!(
            "the source consumer failed for good ({code:?}: {reason}): this instance stops"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_line_reports_external_effects() {
        let s = RunSummary {
            counts: Counts {
                records_in: 10,
                passed: 8,
                duplicates: 2,
                dead_lettered: 1,
                effects_done: 6,
                effects_skipped: 3,
                effects_unprotected: 1,
                ..Counts::default()
            },
            seconds: 2.0,
            commits: 4,
            restored: 0,
            state_memory: crate::state::StateMemory {
                resident: 3 * 1024 * 1024 / 2,
                key_filter: 0,
                engine: 64 * 1024 * 1024,
            },
        };
        let line = s.line();
        for kv in [
            "records_in=10",
            "records_out=0",
            "effects_done=6",
            "effects_skipped=3",
            "effects_unprotected=1",
            "records_per_second=5",
            "state_memory_mib=resident:1.5,key_filter:0.0,engine:64.0",
        ] {
            assert!(line.split_whitespace().any(|w| w == kv), "{kv} in {line}");
        }
    }
}
