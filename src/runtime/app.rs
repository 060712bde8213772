//! The Kafka run loop: assignment and restore, processing, and the at_least_once commit
//! protocol.
//!
//! # Commit protocol (at_least_once), in this order, per commit interval
//! 1. process records: each task's stages stage their state writes (lookups see the
//!    staged writes of the same batch) and their outputs are queued on the producer;
//! 2. flush the producer: wait until every output and dead letter is acknowledged;
//! 3. run the stages' periodic work (the expiry sweep), staging its deletes;
//! 4. produce the staged writes to the stores' changelog topics (tombstones for deletes),
//!    each record stamped with the wall-clock time it is written, and flush again;
//! 5. apply each task's staged writes to its sled tree in one batch together with the
//!    changelog offset they reached, and fsync;
//! 6. commit the consumer offsets of the processed records.
//!
//! A crash anywhere before 6 replays the batch from the last committed offsets: its outputs
//! may appear twice, never get lost. Because 4 and 5 follow 2, a dedup mark (in the
//! changelog or in sled) is never written for an output that is not durable, so a replayed
//! record whose mark exists truly was emitted; and because 5 follows 4, the changelog always
//! holds at least what the local store holds. A crash after 4 repeats nothing: the restore
//! brings the marks of the batch back from the changelog.
//!
//! # Assignment and restore
//! On assignment the new partitions are paused at once (in the callback, which does
//! nothing slow). The run loop then captures each changelog partition's end offset and
//! restores the stores with a separate restore consumer, a bounded batch per loop turn,
//! while the other partitions keep processing; a partition is resumed only when all its
//! stores are restored. On revocation the work of all partitions is committed (the
//! producer flush covers them all), then the revoked tasks are closed; their sled trees stay
//! on disk and are reused, from their stored changelog offset, if the partitions return.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kafka::admin::Admin;
use crate::kafka::batch::consume_batch;
use crate::kafka::consumer::{self, RebalanceListener, SourceConsumer};
use crate::kafka::producer::OutputProducer;
use crate::processor::{Counts, OutRecord, Record, SourceMeta};
use crate::runtime::task::RestoreRecord;
use crate::runtime::{failpoint, Task};
use crate::state::restore::changelog_topic;
use crate::state::{SledBackend, StateBackend, StateDirLock};
use crate::topology::{StageKind, Topology};
use bytes::Bytes;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Options of one run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Stop (committing everything) once every assigned partition has been read to its end.
    pub stop_at_end: bool,
    /// Set to true to stop gracefully (SIGTERM/SIGINT): finish the record in hand, commit,
    /// close the stores.
    pub shutdown: Arc<AtomicBool>,
    /// Where the run publishes its health and restore progress (for `/health` and
    /// `/ready`); none by default.
    pub status: Option<Arc<super::Status>>,
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
            "summary: records_in={} passed={} duplicates={} conflicts={} dead_lettered={} records_out={} effects_done={} effects_skipped={} effects_unprotected={} restored={} commits={} seconds={:.3} records_per_second={:.0}",
            c.records_in, c.passed, c.duplicates, c.conflicts, c.dead_lettered, c.records_out,
            c.effects_done, c.effects_skipped, c.effects_unprotected,
            self.restored, self.commits, self.seconds, self.records_per_second()
        )
    }
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

struct Engine {
    /// processing.guarantee is exactly_once_v2.
    eos: bool,
    /// A transaction is open (exactly_once_v2).
    txn_open: bool,
    topology: Topology,
    config: Config,
    source_topic: String,
    backend: SledBackend,
    producer: OutputProducer,
    /// Destroys the restore consumer's batches in the background; declared before the
    /// restore consumer so that it is dropped (and done) first.
    batch_freer: crate::kafka::batch::Freer,
    restore_consumer: BaseConsumer,
    /// read_uncommitted client for changelog high watermarks (see [`Engine::plan_restores`]).
    watermarks: BaseConsumer,
    /// The consumer group metadata of the current assignment, captured when it was made
    /// (exactly_once_v2): offsets sent with it are refused by the group coordinator once
    /// the group has moved to a newer generation (KIP-447), so an instance that lost its
    /// partitions cannot commit offsets for them.
    group_meta: Option<rdkafka::consumer::ConsumerGroupMetadata>,
    /// When planning was last tried for partitions whose changelog held open transactions.
    last_plan: Option<Instant>,
    /// Partitions waiting for an open changelog transaction to end (logged once each).
    open_txn_waits: BTreeSet<i32>,
    /// Changelog topic of each store.
    changelogs: BTreeMap<String, String>,
    /// Published for `/health` and `/ready` (see [`Engine::publish_status`]).
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
    at_end: BTreeSet<i32>,
    closed_counts: Counts,
    last_commit: Instant,
    last_restore_log: Instant,
    uncommitted: usize,
    commits: u64,
    restored: u64,
    failed: Option<Error>,
    out: Vec<OutRecord>,
    first_record: Option<Instant>,
    /// Lookup tables, loaded before the consumer subscribes (runtime/table.rs).
    tables: crate::state::table::Tables,
    /// Held while any partition is restoring: the state writer then writes only what a
    /// store waits for, leaving the CPU to the restore (see [`crate::state::Writer`]).
    writer_hold: Option<crate::state::WriterHold>,
}

impl Engine {
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

    fn process(&mut self, consumer: &SourceConsumer, m: &BorrowedMessage<'_>) -> Result<()> {
        let p = m.partition();
        self.first_record.get_or_insert_with(Instant::now);
        self.at_end.remove(&p);
        let Some(task) = self.tasks.get_mut(&p) else {
            // Not ours (any more): never process a record without its task and stores.
            return Ok(());
        };
        if task.is_restoring() || self.unplanned.contains(&p) {
            // Fetched before the pause took effect: read it again once restored.
            self.replay_from.entry(p).or_insert(m.offset());
            consumer
                .pause(&Self::tpl_one(&self.source_topic, p, None)?)
                .map_err(Error::kafka("pause"))?;
            return Ok(());
        }
        let record = to_record(m, &self.source_topic);
        task.process(record, wall_clock_ms(), &mut self.out)?;
        if !self.out.is_empty() {
            self.ensure_txn()?;
            let mut out = std::mem::take(&mut self.out);
            let sent = out.iter().try_for_each(|o| self.producer.send(o));
            out.clear();
            self.out = out;
            sent.map_err(|e| self.fenced_or(e))?;
        }
        self.uncommitted += 1;
        Ok(())
    }

    fn commit_due(&self) -> bool {
        self.uncommitted > 0
            && (self.last_commit.elapsed() >= Duration::from_millis(self.config.commit_interval_ms)
                || self.uncommitted >= 200_000)
    }

    /// Wait for every task's external effects in flight; send what they output.
    fn flush_effects(&mut self) -> Result<()> {
        let now = wall_clock_ms();
        for t in self.tasks.values_mut() {
            t.flush_effects(now, &mut self.out)?;
        }
        if !self.out.is_empty() {
            self.ensure_txn()?;
            let out = std::mem::take(&mut self.out);
            for o in &out {
                self.producer.send(o).map_err(|e| self.fenced_or(e))?;
            }
        }
        Ok(())
    }

    /// Begin the transaction of this commit interval if none is open (exactly_once_v2).
    fn ensure_txn(&mut self) -> Result<()> {
        if self.eos && !self.txn_open {
            self.producer
                .begin_transaction()
                .map_err(|e| self.fenced_or(e))?;
            self.txn_open = true;
        }
        Ok(())
    }

    /// A fatal transactional error becomes [`Error::Fenced`]; others pass through.
    fn fenced_or(&self, e: Error) -> Error {
        if e.is_fatal_transaction_error() {
            Error::Fenced(format!(
                "transactional.id {} was taken over by another instance ({e}); this instance stops",
                self.config.transactional_id()
            ))
        } else {
            e
        }
    }

    /// Run the sweep, then send every staged write as a changelog record stamped `now`
    /// (straight from the staged buffers). Returns the number of records sent.
    fn send_changelog(&mut self, now: i64) -> Result<usize> {
        for t in self.tasks.values_mut() {
            t.punctuate(now)?;
        }
        let mut sent = 0;
        let mut result = Ok(());
        for (p, t) in &self.tasks {
            t.for_each_staged_write(|store, k, v| {
                if result.is_ok() {
                    result = self
                        .producer
                        .send_changelog(&self.changelogs[store], *p, k, v, now);
                    sent += 1;
                }
            });
        }
        result.map(|()| sent)
    }

    /// Apply every task's staged writes with the changelog offsets they reached; return the
    /// source offsets to commit.
    fn apply_state(&mut self) -> Result<TopicPartitionList> {
        for (p, t) in self.tasks.iter_mut() {
            let _span = t.span().clone().entered();
            let producer = &self.producer;
            let changelogs = &self.changelogs;
            t.commit_state(|store| producer.changelog_next_offset(&changelogs[store], *p))?;
        }
        self.processed_offsets()
    }

    fn processed_offsets(&self) -> Result<TopicPartitionList> {
        let mut tpl = TopicPartitionList::new();
        for (p, t) in &self.tasks {
            if let Some(pos) = t.position() {
                tpl.add_partition_offset(&self.source_topic, *p, Offset::Offset(pos))
                    .map_err(Error::kafka("build offsets"))?;
            }
        }
        Ok(tpl)
    }

    /// The commit protocol (see the module docs).
    fn commit(&mut self, consumer: &SourceConsumer, mode: CommitMode) -> Result<()> {
        // The interval runs from the end of the last commit, so a slow commit never leaves
        // the next interval without time to process.
        let result = self.commit_inner(consumer, mode);
        self.last_commit = Instant::now();
        result
    }

    fn commit_inner(&mut self, consumer: &SourceConsumer, mode: CommitMode) -> Result<()> {
        if self.uncommitted == 0 {
            return Ok(());
        }
        // 1. Sinks: external effects in flight finish (their dead letters and downstream
        // outputs join the commit), so no offset is committed ahead of its effect.
        self.flush_effects()?;
        if self.eos {
            return self.commit_transaction(consumer);
        }
        let now = wall_clock_ms();
        // 2. Outputs and dead letters durable.
        failpoint::hit("commit.before_flush");
        self.producer.flush(Duration::from_secs(600))?;
        failpoint::hit("commit.after_flush");
        // 3-4. Sweep, then the changelog records of every staged write, durable. Only now:
        // a changelog record is state, and state may not run ahead of its outputs.
        if self.send_changelog(now)? > 0 {
            self.producer.flush(Duration::from_secs(600))?;
        }
        failpoint::hit("commit.after_changelog");
        // 5. State with its changelog offsets. No fsync: the changelog is durable, and sled
        // recovers a prefix of atomic batches, each with its checkpoint, so a lost tail is
        // restored from the changelog.
        let tpl = self.apply_state()?;
        failpoint::hit("commit.after_state");
        // 6. Offsets.
        if tpl.count() > 0 {
            consumer
                .commit(&tpl, mode)
                .map_err(Error::kafka("commit offsets"))?;
        }
        self.uncommitted = 0;
        self.commits += 1;
        metrics::counter!(crate::metrics::COMMITS, "topology" => self.topology.name().to_string())
            .increment(1);
        Ok(())
    }

    /// exactly_once_v2: outputs (already in the open transaction), changelog records and
    /// consumed offsets commit in one transaction; the sled batch is applied only after the
    /// commit succeeded. An abortable failure aborts and rewinds; a fatal one (fenced)
    /// stops the instance.
    fn commit_transaction(&mut self, consumer: &SourceConsumer) -> Result<()> {
        self.ensure_txn()?;
        failpoint::hit("eos.after_produce");
        let attempt = (|| -> Result<()> {
            self.send_changelog(wall_clock_ms())?;
            failpoint::hit("eos.after_changelog");
            let offsets = self.processed_offsets()?;
            if offsets.count() > 0 {
                let cgm = self.group_meta.as_ref().ok_or_else(|| {
                    Error::Broker("the consumer has no group metadata (not in a group)".into())
                })?;
                self.producer.send_offsets_to_transaction(&offsets, cgm)?;
            }
            failpoint::hit("eos.before_commit");
            self.producer.commit_transaction()
        })();
        if let Err(e) = attempt {
            let e = self.fenced_or(e);
            if matches!(e, Error::Fenced(_)) {
                return Err(e);
            }
            tracing::warn!(error = %e, "transaction failed: aborting and rewinding to the committed offsets");
            return self.abort_and_rewind(consumer);
        }
        self.txn_open = false;
        metrics::counter!(crate::metrics::TRANSACTIONS, "result" => "committed").increment(1);
        failpoint::hit("eos.after_commit");
        self.apply_state()?;
        self.uncommitted = 0;
        self.commits += 1;
        metrics::counter!(crate::metrics::COMMITS, "topology" => self.topology.name().to_string())
            .increment(1);
        Ok(())
    }

    /// Abort the open transaction, drop every staged write, and seek every partition back
    /// to its committed offset: the records are processed again in a new transaction.
    fn abort_and_rewind(&mut self, consumer: &SourceConsumer) -> Result<()> {
        self.abort_open_transaction()?;
        let mut tpl = TopicPartitionList::new();
        for p in self.tasks.keys() {
            tpl.add_partition(&self.source_topic, *p);
        }
        let committed = crate::kafka::retry::retry("committed offsets", || {
            consumer
                .committed_offsets(tpl.clone(), Duration::from_secs(30))
                .map_err(Error::kafka("committed offsets"))
        })?;
        let mut seek = TopicPartitionList::new();
        for (p, t) in self.tasks.iter_mut() {
            let off = match committed
                .find_partition(&self.source_topic, *p)
                .map(|e| e.offset())
            {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            };
            let processed = t.position().is_some();
            t.abort(off);
            if processed && !t.is_restoring() {
                seek.add_partition_offset(
                    &self.source_topic,
                    *p,
                    off.map_or(Offset::Beginning, Offset::Offset),
                )
                .map_err(Error::kafka("build offsets"))?;
            }
        }
        if seek.count() > 0 {
            consumer
                .seek_partitions(seek, Duration::from_secs(30))
                .map_err(Error::kafka("seek"))?;
        }
        self.uncommitted = 0;
        Ok(())
    }

    /// Capture the changelog ends of newly assigned partitions and start their restores.
    ///
    /// A partition's previous owner may still have a transaction open: an instance still
    /// committing its revocation, or a zombie (stopped past its session timeout) that may
    /// yet commit it. That transaction holds the source offsets (sent with
    /// `send_offsets_to_transaction`) and changelog records that may not even have reached
    /// the broker yet. Its dedup marks must be restored too, or the records it processed
    /// would pass again when repeated later. So a partition is planned only when
    /// 1. its committed source offset is stable: the committed-offset fetch of a
    ///    read_committed consumer asks for stable offsets (KIP-447 `require_stable`), which
    ///    the group coordinator holds back while a transactional offset commit is pending,
    ///    i.e. until the transaction ended (committed, aborted, or aborted by the
    ///    coordinator after `transaction.timeout.ms`); and
    /// 2. the changelog's last stable offset (the restore consumer is read_committed)
    ///    equals its high watermark (read_uncommitted), so no transaction is open on it:
    ///    the commit markers of 1 may land on the changelog after the offsets.
    ///
    /// The end of the restore is then that offset. Until then the partition stays
    /// unplanned, and paused; planning is retried every 100 ms.
    fn plan_restores(&mut self, consumer: &SourceConsumer) -> Result<()> {
        if self
            .last_plan
            .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return Ok(());
        }
        self.last_plan = None;
        let partitions: Vec<i32> = std::mem::take(&mut self.unplanned)
            .into_iter()
            .filter(|p| self.tasks.contains_key(p))
            .collect();
        if partitions.is_empty() {
            return Ok(());
        }
        // 1. Committed source offsets stable: one request for all partitions; when it
        //    fails (some partition's offsets are held back), one per partition.
        let mut ready = Vec::with_capacity(partitions.len());
        if self.changelogs.is_empty() {
            ready = partitions;
        } else {
            let all = Self::tpl_of(&self.source_topic, &partitions, None)?;
            if consumer
                .committed_offsets(all, Duration::from_millis(300))
                .is_ok()
            {
                ready = partitions;
            } else {
                for p in partitions {
                    let stable = consumer.committed_offsets(
                        Self::tpl_one(&self.source_topic, p, None)?,
                        Duration::from_millis(300),
                    );
                    match stable {
                        Ok(_) => ready.push(p),
                        Err(err) => {
                            if self.open_txn_waits.insert(p) {
                                tracing::info!(
                                    partition = p,
                                    error = %err,
                                    "committed offset not stable (the previous owner's transaction is open): waiting for it to end before restoring"
                                );
                            }
                            self.unplanned.insert(p);
                            self.last_plan = Some(Instant::now());
                        }
                    }
                }
            }
        }
        if ready.is_empty() {
            return Ok(());
        }
        // 2. Per changelog: log start, last stable offset (the restore consumer is
        //    read_committed) and high watermark (read_uncommitted) of every ready partition,
        //    one ListOffsets request each.
        let mut ends: BTreeMap<i32, Vec<(String, String, i64, i64)>> = BTreeMap::new();
        let mut waiting: BTreeSet<i32> = BTreeSet::new();
        for (store, topic) in &self.changelogs {
            let lows =
                Self::list_offsets(&self.restore_consumer, topic, &ready, Offset::Beginning)?;
            let stables = Self::list_offsets(&self.restore_consumer, topic, &ready, Offset::End)?;
            let highs = Self::list_offsets(&self.watermarks, topic, &ready, Offset::End)?;
            for (i, p) in ready.iter().enumerate() {
                let (low, stable, high) = (lows[i], stables[i], highs[i]);
                if stable < high {
                    if self.open_txn_waits.insert(*p) {
                        tracing::info!(
                            store = store.as_str(),
                            partition = *p,
                            stable,
                            high,
                            "changelog holds an open transaction of the previous owner: waiting for it to end before restoring"
                        );
                    }
                    waiting.insert(*p);
                }
                ends.entry(*p)
                    .or_default()
                    .push((store.clone(), topic.clone(), low, stable));
            }
        }
        let mut assign = TopicPartitionList::new();
        let mut resume = Vec::new();
        for p in ready {
            if waiting.contains(&p) {
                self.unplanned.insert(p);
                self.last_plan = Some(Instant::now());
                continue;
            }
            self.open_txn_waits.remove(&p);
            let task = self.tasks.get_mut(&p).expect("filtered above");
            let _span = task.span().clone().entered();
            for (store, topic, low, end) in ends.remove(&p).unwrap_or_default() {
                if let Some(start) = task.plan_restore(&store, low, end)? {
                    assign
                        .add_partition_offset(&topic, p, Offset::Offset(start))
                        .map_err(Error::kafka("partition list"))?;
                }
            }
            if !task.is_restoring() {
                resume.push(p);
            }
        }
        if assign.count() > 0 {
            self.restore_consumer
                .incremental_assign(&assign)
                .map_err(Error::kafka("assign changelog"))?;
        }
        for p in resume {
            self.resume(consumer, p)?;
        }
        Ok(())
    }

    /// The offsets of `partitions` of `topic` at `at` (`Offset::Beginning`: log start;
    /// `Offset::End`: the end as `client`'s isolation.level sees it, the last stable offset
    /// when read_committed, the high watermark when read_uncommitted), in one ListOffsets
    /// request; a partition the answer leaves out is asked on its own.
    fn list_offsets(
        client: &BaseConsumer,
        topic: &str,
        partitions: &[i32],
        at: Offset,
    ) -> Result<Vec<i64>> {
        let timeout = Duration::from_secs(30);
        let answer = client
            .offsets_for_times(Self::tpl_of(topic, partitions, Some(at))?, timeout)
            .ok();
        partitions
            .iter()
            .map(|p| {
                let found = answer
                    .as_ref()
                    .and_then(|a| a.find_partition(topic, *p))
                    .filter(|e| e.error().is_ok())
                    .and_then(|e| match e.offset() {
                        Offset::Offset(o) if o >= 0 => Some(o),
                        _ => None,
                    });
                match found {
                    Some(o) => Ok(o),
                    None => {
                        let (low, high) = crate::kafka::retry::retry("changelog offsets", || {
                            client
                                .fetch_watermarks(topic, *p, timeout)
                                .map_err(Error::kafka("changelog offsets"))
                        })?;
                        Ok(if at == Offset::Beginning { low } else { high })
                    }
                }
            })
            .collect()
    }

    fn resume(&mut self, consumer: &SourceConsumer, p: i32) -> Result<()> {
        let tpl = Self::tpl_one(&self.source_topic, p, None)?;
        if let Some(off) = self.replay_from.remove(&p) {
            consumer
                .seek_partitions(
                    Self::tpl_one(&self.source_topic, p, Some(off))?,
                    Duration::from_secs(10),
                )
                .map_err(Error::kafka("seek"))?;
        }
        consumer.resume(&tpl).map_err(Error::kafka("resume"))
    }

    /// Abort the open transaction, if any (counted), and forget the producer's failed
    /// deliveries, which belonged to it.
    fn abort_open_transaction(&mut self) -> Result<()> {
        if self.txn_open {
            self.producer
                .abort_transaction()
                .map_err(|e| self.fenced_or(e))?;
            self.txn_open = false;
            metrics::counter!(crate::metrics::TRANSACTIONS, "result" => "aborted").increment(1);
        }
        self.producer.reset_failures();
        Ok(())
    }

    /// exactly_once_v2, partitions lost: abort the open transaction and drop every staged
    /// write, so that the following commit finds nothing to commit.
    fn abort_lost(&mut self) -> Result<()> {
        self.abort_open_transaction()?;
        for t in self.tasks.values_mut() {
            t.abort(None);
        }
        self.uncommitted = 0;
        Ok(())
    }

    fn any_restoring(&self) -> bool {
        !self.unplanned.is_empty() || self.tasks.values().any(|t| t.is_restoring())
    }

    /// One bounded step of every restore in progress: read up to [`RESTORE_BATCH`]
    /// changelog records in batches (what is queued; when nothing is, wait up to `timeout`
    /// for one), apply each partition's share in log order, then record the positions
    /// reached. The batches are returned to librdkafka in the background.
    fn restore_step(&mut self, consumer: &SourceConsumer, timeout: Duration) -> Result<()> {
        if !self.tasks.values().any(|t| t.is_restoring()) {
            return Ok(());
        }
        let mut batches = Vec::new();
        let mut n = 0;
        let mut waited = false;
        while n < RESTORE_BATCH {
            let mut b = consume_batch(&self.restore_consumer, Duration::ZERO, RESTORE_BATCH - n)
                .map_err(Error::kafka("restore read"))?;
            if b.is_empty() && n == 0 && !waited {
                waited = true;
                b = consume_batch(&self.restore_consumer, timeout, 1)
                    .map_err(Error::kafka("restore read"))?;
            }
            if b.is_empty() {
                break;
            }
            n += b.len();
            batches.push(b);
        }
        // The positions after what was read: each restore's step ends there.
        let positions = self
            .restore_consumer
            .position()
            .map_err(Error::kafka("restore position"))?;
        // The records of each (partition, store), in log order, borrowed from the batches.
        let single = match self.changelogs.len() {
            1 => self.changelogs.keys().next().map(String::as_str),
            _ => None,
        };
        let mut records: BTreeMap<i32, Vec<(&str, Vec<RestoreRecord<'_>>)>> = BTreeMap::new();
        for b in &batches {
            for r in b.records() {
                let m = match r {
                    Ok(m) => m,
                    Err(rdkafka::error::KafkaError::PartitionEOF(_)) => continue,
                    Err(e) => {
                        // Consumer errors are reports (a leader moved, a fetch failed);
                        // librdkafka retries by itself. The restore waits for its position
                        // either way.
                        tracing::warn!(error = %e, "restore consumer error");
                        continue;
                    }
                };
                // One store (the usual case): every changelog record is its own, no topic
                // name to read and compare per record.
                let store = match single {
                    Some(s) => Some(s),
                    None => m.topic().and_then(|topic| {
                        self.changelogs
                            .iter()
                            .find(|(_, t)| t.as_str() == topic)
                            .map(|(s, _)| s.as_str())
                    }),
                };
                let Some(store) = store else { continue };
                let per = records.entry(m.partition()).or_default();
                let rec = (m.key().unwrap_or_default(), m.payload(), m.offset());
                match per.iter_mut().find(|(s, _)| *s == store) {
                    Some((_, v)) => v.push(rec),
                    None => per.push((store, vec![rec])),
                }
            }
        }
        // Apply each restoring task's records, then end its steps at the positions read.
        let log_now = self.last_restore_log.elapsed() >= Duration::from_secs(2);
        let mut finished = Vec::new();
        for (p, task) in self.tasks.iter_mut().filter(|(_, t)| t.is_restoring()) {
            let _span = task.span().clone().entered();
            let recs = records.remove(p).unwrap_or_default();
            for (store, rs) in &recs {
                self.restored += task.restore_records(store, rs);
            }
            let stores: Vec<String> = task
                .restorers()
                .iter()
                .map(|r| r.store().to_string())
                .collect();
            for store in stores {
                let topic = &self.changelogs[&store];
                let Some(Offset::Offset(end)) =
                    positions.find_partition(topic, *p).map(|e| e.offset())
                else {
                    continue;
                };
                let done = task.finish_restore_step(&store, end)?;
                if recs.iter().any(|(s, v)| *s == store && !v.is_empty()) {
                    failpoint::hit("restore.during");
                }
                if done {
                    self.restore_consumer
                        .incremental_unassign(&Self::tpl_one(topic, *p, None)?)
                        .map_err(Error::kafka("unassign changelog"))?;
                } else if log_now {
                    for r in task.restorers().iter().filter(|r| r.store() == store) {
                        r.log_progress();
                    }
                }
            }
            if !task.is_restoring() {
                finished.push(*p);
            }
        }
        drop(records);
        self.batch_freer.free(batches);
        if log_now {
            self.last_restore_log = Instant::now();
        }
        // Restored partitions were paused at assignment: let them go.
        for p in finished {
            self.resume(consumer, p)?;
        }
        Ok(())
    }

    /// Publish the partitions to the status when something changed: at assignment and
    /// revocation, after each restore step, and once when the restores ended.
    fn publish_status(&mut self) {
        let restoring = self.any_restoring();
        let Some(status) = &self.status else { return };
        if !(self.status_dirty || restoring || self.status_restoring) {
            return;
        }
        let mut snapshot = super::status::Partitions {
            assigned_once: self.assigned_once,
            assigned: self.tasks.keys().copied().collect(),
            waiting: self.unplanned.iter().copied().collect(),
            restoring: Vec::new(),
        };
        for (p, t) in &self.tasks {
            for r in t.restorers() {
                snapshot.restoring.push(super::status::Restoring {
                    store: r.store().to_string(),
                    partition: *p,
                    progress: r.progress(),
                });
            }
        }
        status.publish(snapshot);
        self.status_dirty = false;
        self.status_restoring = restoring;
    }

    fn all_at_end(&self) -> bool {
        !self.tasks.is_empty()
            && !self.any_restoring()
            && self.tasks.keys().all(|p| self.at_end.contains(p))
    }
}

struct Listener {
    engine: Arc<Mutex<Engine>>,
}

impl RebalanceListener for Listener {
    fn on_revoke(&self, consumer: &SourceConsumer, partitions: &[i32]) {
        let mut e = self.engine.lock().expect("engine lock");
        if e.eos && consumer.assignment_lost() {
            // The group moved on without us (session timeout, e.g. after a long stop):
            // other instances may own these partitions already. Committing now would put
            // this instance's outputs next to theirs; abort and drop the staged state.
            tracing::warn!(
                ?partitions,
                "partitions lost (this instance left the group): aborting the open transaction"
            );
            if let Err(err) = e.abort_lost() {
                e.failed.get_or_insert(err);
                return;
            }
        } else {
            tracing::info!(?partitions, "partitions revoked: committing their work");
        }
        e.status_dirty = true;
        if let Err(err) = e.commit(consumer, CommitMode::Sync) {
            tracing::error!(error = %err, "commit on revocation failed");
            e.failed.get_or_insert(err);
            return;
        }
        for p in partitions {
            if let Some(t) = e.tasks.remove(p) {
                let _span = t.span().clone().entered();
                tracing::info!("task closed");
                let c = *t.counts();
                e.closed_counts.add(&c);
                for r in t.restorers() {
                    let topic = e.changelogs[r.store()].clone();
                    if let Ok(tpl) = Engine::tpl_one(&topic, *p, None) {
                        let _ = e.restore_consumer.incremental_unassign(&tpl);
                    }
                }
            }
            e.unplanned.remove(p);
            e.open_txn_waits.remove(p);
            e.replay_from.remove(p);
            e.at_end.remove(p);
        }
    }

    fn on_assign(&self, consumer: &SourceConsumer, partitions: &[i32]) {
        let mut e = self.engine.lock().expect("engine lock");
        tracing::info!(?partitions, "partitions assigned");
        e.assigned_once = true;
        e.status_dirty = true;
        e.group_meta = consumer.group_metadata();
        let mut tpl = TopicPartitionList::new();
        for p in partitions {
            tpl.add_partition(&e.source_topic, *p);
        }
        // Nothing is processed before the restore: pause first, plan in the run loop.
        if let Err(err) = consumer.pause(&tpl) {
            e.failed.get_or_insert(Error::Kafka {
                op: "pause",
                source: err,
            });
            return;
        }
        for p in partitions {
            if e.tasks.contains_key(p) {
                continue;
            }
            match Task::new(&e.topology, *p, &e.backend, &e.config.dlq_topic)
                .map(|t| t.with_tables(e.tables.clone()))
            {
                Ok(t) => {
                    e.tasks.insert(*p, t);
                    e.unplanned.insert(*p);
                }
                Err(err) => {
                    e.failed.get_or_insert(err);
                }
            }
        }
    }
}

fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn to_record(m: &BorrowedMessage<'_>, topic: &str) -> Record {
    let headers = match m.headers() {
        None => Vec::new(),
        Some(h) => h
            .iter()
            .map(|h| (h.key.to_string(), h.value.map(Bytes::copy_from_slice)))
            .collect(),
    };
    Record {
        key: m.key().map(Bytes::copy_from_slice),
        value: m.payload().map(Bytes::copy_from_slice),
        headers,
        timestamp: m.timestamp().to_millis(),
        json: None,
        fields: None,
        source: SourceMeta {
            topic: topic.into(),
            partition: m.partition(),
            offset: m.offset(),
        },
    }
}

impl App {
    /// Bind `topology` to `config`.
    pub fn new(config: Config, topology: Topology) -> App {
        App { config, topology }
    }

    /// The changelog topic of each store, with its `retention.ms` (TTL + grace).
    pub fn changelog_topics(&self) -> BTreeMap<String, (String, i64)> {
        self.topology
            .stages()
            .iter()
            .filter_map(|s| match &s.kind {
                StageKind::Dedup(d) => Some((
                    s.name.clone(),
                    (
                        changelog_topic(&self.config.application_id, &s.name),
                        d.changelog_retention_ms(),
                    ),
                )),
                _ => None,
            })
            .collect()
    }

    /// Check the topics before the run: the source must exist; missing sink topics and the
    /// dead-letter topic are created with the source's partition count; changelog topics
    /// are created (`cleanup.policy=compact,delete`, `retention.ms` = TTL + grace) or
    /// checked to have the source's partition count.
    ///
    /// # Errors
    /// [`Error::Broker`] when the source topic is missing, a changelog has another partition
    /// count than the source, or topics cannot be created.
    pub fn prepare_topics(&self) -> Result<usize> {
        let admin = Admin::new(&self.config)?;
        let src = &self.topology.source().topic;
        let n = admin.partition_count(src)?.ok_or_else(|| {
            Error::Broker(format!(
                "source topic {src} does not exist on {}; create it first",
                self.config.bootstrap_servers
            ))
        })?;
        // Metadata per topic (cheap), then one CreateTopics request for the missing ones.
        let mut missing: Vec<crate::kafka::admin::TopicSpec<'_>> = Vec::new();
        let mut topics = self.topology.sink_topics();
        topics.push(self.config.dlq_topic.clone());
        for t in topics {
            if admin.partition_count(&t)?.is_none() && !missing.iter().any(|m| m.0 == t) {
                missing.push((t, n, Vec::new()));
            }
        }
        for (store, (topic, retention)) in self.changelog_topics() {
            match admin.partition_count(&topic)? {
                Some(m) if m != n => {
                    return Err(Error::Broker(format!(
                        "changelog topic {topic} of store {store} has {m} partitions, but source topic {src} has {n}; \
                         they must match (delete the changelog to rebuild it, or use a new application.id)"
                    )))
                }
                Some(_) => {}
                None => missing.push((
                    topic,
                    n,
                    vec![
                        ("cleanup.policy", "compact,delete".to_string()),
                        ("retention.ms", retention.to_string()),
                    ],
                )),
            }
        }
        for t in admin.ensure_topics(&missing)? {
            match missing.iter().find(|m| m.0 == t) {
                Some((_, _, c)) if !c.is_empty() => {
                    tracing::info!(topic = %t, partitions = n, retention_ms = %c[1].1, "created changelog topic")
                }
                _ => tracing::info!(topic = %t, partitions = n, "created topic"),
            }
        }
        Ok(n)
    }

    /// Run until shutdown is requested (or, with `stop_at_end`, the input is exhausted).
    ///
    /// # Errors
    /// Start-up errors (state dir locked, source topic missing, changelog partition count
    /// wrong, bad `kafka.*` property) and fatal run errors (a delivery that failed for
    /// good, a store failure). Nothing of the failed batch is committed: a restart
    /// processes it again.
    pub fn run(&self, opts: RunOptions) -> Result<RunSummary> {
        let status = opts.status.clone();
        let result = self.run_inner(opts);
        if let Some(s) = status {
            s.finish(result.as_ref().err().map(|e| e.to_string()));
        }
        result
    }

    fn run_inner(&self, opts: RunOptions) -> Result<RunSummary> {
        let _lock = StateDirLock::acquire(&self.config.state_dir)?;
        // Local sink stores live under the locked state dir.
        let topology = self
            .topology
            .clone()
            .with_state_dir(&self.config.state_dir, &self.config.application_id);
        crate::sink::preflight(&self.topology)?;
        self.prepare_topics()?;
        let dir = self.config.state_dir.join(&self.config.application_id);
        let backend = SledBackend::open(&dir)?;
        let table_set =
            super::table::TableSet::start(&self.config, &self.topology, &backend, &opts.shutdown)?;
        let changelogs: BTreeMap<String, String> = self
            .changelog_topics()
            .into_iter()
            .map(|(s, (t, _))| (s, t))
            .collect();
        let producer = OutputProducer::new(&self.config, changelogs.values().cloned().collect())?;
        let restore_consumer = consumer::create_restore_consumer(&self.config)?;
        let watermarks = consumer::create_watermark_client(&self.config)?;
        if self.config.exactly_once() {
            producer.init_transactions()?;
            tracing::info!(transactional_id = %self.config.transactional_id(), "transactions initialised");
        }
        let engine = Arc::new(Mutex::new(Engine {
            eos: self.config.exactly_once(),
            txn_open: false,
            topology,
            config: self.config.clone(),
            source_topic: self.topology.source().topic.clone(),
            backend,
            producer,
            batch_freer: crate::kafka::batch::Freer::spawn(),
            restore_consumer,
            watermarks,
            group_meta: None,
            last_plan: None,
            open_txn_waits: BTreeSet::new(),
            changelogs,
            status: opts.status.clone(),
            status_dirty: true,
            status_restoring: false,
            assigned_once: false,
            tasks: BTreeMap::new(),
            unplanned: BTreeSet::new(),
            replay_from: BTreeMap::new(),
            at_end: BTreeSet::new(),
            closed_counts: Counts::default(),
            last_commit: Instant::now(),
            last_restore_log: Instant::now(),
            uncommitted: 0,
            commits: 0,
            restored: 0,
            failed: None,
            out: Vec::with_capacity(16),
            first_record: None,
            tables: table_set.handles(),
            writer_hold: None,
        }));
        let consumer = consumer::create(
            &self.config,
            opts.stop_at_end,
            Arc::new(Listener {
                engine: engine.clone(),
            }),
        )?;
        consumer
            .subscribe(&[self.topology.source().topic.as_str()])
            .map_err(Error::kafka("subscribe"))?;
        tracing::info!(topology = self.topology.name(), source = %self.topology.source().topic,
            state = %dir.display(), "running");
        let result = self.run_loop(&consumer, &engine, &opts);
        let mut e = engine.lock().expect("engine lock");
        let result = result.and_then(|_| {
            // Graceful stop: commit what was processed, then leave the group.
            e.commit(&consumer, CommitMode::Sync)
        });
        drop(e);
        if result.is_ok() {
            consumer.unsubscribe();
        }
        let mut e = engine.lock().expect("engine lock");
        let mut counts = e.closed_counts;
        for t in e.tasks.values() {
            counts.add(t.counts());
        }
        if result.is_ok() {
            // Graceful stop: let the background writer finish, so a restart resumes from
            // the last committed changelog offset instead of restoring it again.
            let mut synced = Ok(());
            for t in e.tasks.values_mut() {
                synced = synced.and(t.sync_stores());
            }
            if let Err(err) = synced {
                tracing::warn!(error = %err, "state not fully persisted at stop: the next start restores the rest from the changelog");
            }
        }
        e.tasks.clear();
        e.backend.flush()?;
        let seconds = e
            .first_record
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        let summary = RunSummary {
            counts,
            seconds,
            commits: e.commits,
            restored: e.restored,
        };
        result.map(|_| summary)
    }

    fn run_loop(
        &self,
        consumer: &SourceConsumer,
        engine: &Arc<Mutex<Engine>>,
        opts: &RunOptions,
    ) -> Result<()> {
        loop {
            if opts.shutdown.load(Ordering::SeqCst) {
                tracing::info!("shutdown requested: committing and closing");
                return Ok(());
            }
            if let Some(s) = &opts.status {
                s.beat();
            }
            let (wait, burst) = {
                let mut e = engine.lock().expect("engine lock");
                if !e.unplanned.is_empty() {
                    e.plan_restores(consumer)?;
                }
                e.publish_status();
                let restoring = e.any_restoring();
                if restoring != e.writer_hold.is_some() {
                    e.writer_hold = if restoring {
                        e.backend.writer().map(|w| w.hold())
                    } else {
                        None
                    };
                }
                if e.tasks.values().any(|t| t.is_restoring()) {
                    e.restore_step(consumer, Duration::from_millis(5))?;
                    (Duration::ZERO, RECORDS_PER_RESTORE_STEP)
                } else if !e.unplanned.is_empty() {
                    // Waiting for an open changelog transaction: poll briefly, plan again.
                    (Duration::from_millis(20), 1)
                } else {
                    (Duration::from_millis(100), 1)
                }
            };
            // While restores run, the partitions already restored get a share of each turn.
            for i in 0..burst {
                let polled = consumer.poll(if i == 0 { wait } else { Duration::ZERO });
                let mut e = engine.lock().expect("engine lock");
                if let Some(err) = e.failed.take() {
                    return Err(err);
                }
                let more = match polled {
                    None => {
                        if opts.stop_at_end && e.all_at_end() {
                            tracing::info!("every assigned partition is at its end: stopping");
                            return Ok(());
                        }
                        false
                    }
                    Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                        e.at_end.insert(p);
                        true
                    }
                    Some(Err(err)) => {
                        tracing::warn!(error = %err, "consumer error");
                        false
                    }
                    Some(Ok(m)) => {
                        e.process(consumer, &m)?;
                        true
                    }
                };
                if e.commit_due() {
                    e.commit(consumer, CommitMode::Async)?;
                }
                if !more {
                    break;
                }
            }
        }
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
        };
        let line = s.line();
        for kv in [
            "records_in=10",
            "records_out=0",
            "effects_done=6",
            "effects_skipped=3",
            "effects_unprotected=1",
            "records_per_second=5",
        ] {
            assert!(line.split_whitespace().any(|w| w == kv), "{kv} in {line}");
        }
    }
}
