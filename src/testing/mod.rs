//! A broker-free test driver: pipe records into a topology, read what it wrote, move a mock
//! clock, look into its stores, and simulate crashes and restarts.
//!
//! ```
//! use onceflow::prelude::*;
//! let t = TopologyBuilder::new("t").source("in", Format::Json)
//!     .dedup("dedup", DedupSpec::new(KeySource::JsonPointer("/id".into())))
//!     .sink("out", "out").build().unwrap();
//! let mut d = TestDriver::new(t);
//! d.pipe(TestRecord::json(r#"{"id":1}"#).timestamp(0)).unwrap();
//! d.pipe(TestRecord::json(r#"{"id":1}"#).timestamp(5)).unwrap();
//! assert_eq!(d.output("out").len(), 1);
//! ```

use crate::config::Guarantee;
use crate::error::Result;
use crate::processor::dedup::DedupEntry;
use crate::processor::{Counts, OutRecord, Record, SourceMeta};
use crate::runtime::commit::{self, CommitLog, Outcome, Protocol};
use crate::runtime::Task;
use crate::state::restore::ChangelogRecord;
use crate::state::{MemoryBackend, StateBackend};
use crate::topology::Topology;
use bytes::Bytes;
use std::collections::BTreeMap;

mod log;
use log::MemoryLog;

/// A record to pipe into the driver.
#[derive(Debug, Clone, Default)]
pub struct TestRecord {
    key: Option<Bytes>,
    value: Option<Bytes>,
    headers: Vec<(String, Option<Bytes>)>,
    timestamp: Option<i64>,
    partition: i32,
}

impl TestRecord {
    /// A record with `value` as its bytes (JSON text or anything else).
    pub fn json(value: impl Into<Vec<u8>>) -> Self {
        TestRecord {
            value: Some(Bytes::from(value.into())),
            ..Default::default()
        }
    }

    /// A record with a null value.
    pub fn null_value() -> Self {
        TestRecord::default()
    }

    /// Set the Kafka key.
    pub fn key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(Bytes::from(key.into()));
        self
    }

    /// Add a header.
    pub fn header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Self {
        self.headers
            .push((name.to_string(), Some(Bytes::from(value.into()))));
        self
    }

    /// Set the record timestamp (ms).
    pub fn timestamp(mut self, ms: i64) -> Self {
        self.timestamp = Some(ms);
        self
    }

    /// Set the source partition (default 0).
    pub fn partition(mut self, p: i32) -> Self {
        self.partition = p;
        self
    }

    /// This record as the source record at `offset` of its partition of `topic`.
    pub(crate) fn into_record(self, topic: std::sync::Arc<str>, offset: i64) -> Record {
        Record {
            key: self.key,
            value: self.value,
            headers: self.headers,
            timestamp: self.timestamp,
            json: None,
            fields: None,
            source: SourceMeta {
                topic,
                partition: self.partition,
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

    /// The source partition.
    pub(crate) fn source_partition(&self) -> i32 {
        self.partition
    }
}

/// Runs a topology without a broker. Each partition gets a task (its processors, as
/// under [`App::run`](crate::App::run)) over in-memory stores;
/// outputs become visible when committed (by default after every piped record).
///
/// The driver commits with the runtime's own commit protocol (`runtime/commit.rs`; its failpoints are [`crate::failpoints`])
/// over an in-memory log, under at_least_once (default) or exactly_once_v2
/// ([`TestDriver::guarantee`]), and can die at any failpoint of a commit
/// ([`TestDriver::crash_at`]) and come back ([`TestDriver::restart`]).
pub struct TestDriver {
    topology: Topology,
    backend: MemoryBackend,
    tasks: BTreeMap<i32, Task>,
    /// Every piped record per partition (offset = index), to replay after a crash.
    inputs: BTreeMap<i32, Vec<Record>>,
    clock_ms: i64,
    log: MemoryLog,
    protocol: Protocol,
    out: Vec<OutRecord>,
    auto_commit: bool,
    dlq_topic: String,
    counts: Counts,
    restored: u64,
    crashed_at: Option<&'static str>,
    tables: TableState,
    /// The repartition hop of a dedup stage with `partitioning: repartition`, if any.
    hop: Option<Hop>,
    /// With a hop: the next offset per source partition (`inputs` then holds the
    /// repartition topic, which the tasks read).
    source_offsets: BTreeMap<i32, i64>,
    /// Whether the start-up check of the external sinks passed (run at the first record).
    preflighted: bool,
}

/// The driver's repartition topic: piped records go through a router task of their source
/// partition (the stages before the hop, then routing by the dedup key) onto its
/// partitions, and the tasks run on those (see [`TestDriver::source_partitions`]).
struct Hop {
    topic: String,
    key: crate::processor::key::KeySource,
    partitions: i32,
    /// The router task of each source partition, made at its first record.
    routers: BTreeMap<i32, Task>,
}

impl TestDriver {
    /// A driver for `topology`; the dead-letter topic is `test.dlq`, the clock starts at 0,
    /// the guarantee is at_least_once.
    pub fn new(topology: Topology) -> Self {
        let protocol = Protocol::new(Guarantee::AtLeastOnce, topology.name());
        TestDriver {
            topology,
            backend: MemoryBackend::default(),
            tasks: BTreeMap::new(),
            inputs: BTreeMap::new(),
            clock_ms: 0,
            log: MemoryLog::default(),
            protocol,
            out: Vec::new(),
            auto_commit: true,
            dlq_topic: "test.dlq".into(),
            counts: Counts::default(),
            restored: 0,
            crashed_at: None,
            tables: TableState::default(),
            hop: None,
            source_offsets: BTreeMap::new(),
            preflighted: false,
        }
        .with_tables()
        .with_hop()
    }

    /// Set up the repartition hop when a dedup stage has `partitioning: repartition` with
    /// only filter and map stages before it, as `onceflow run` does (application id
    /// `test`, 1 partition until [`Self::source_partitions`]); a topology whose hop is
    /// refused gets none, and [`Self::pipe`] refuses its records.
    fn with_hop(mut self) -> Self {
        self.hop = self.topology.hop().ok().flatten().map(|(_, name, d)| Hop {
            topic: crate::processor::stages::repartition_topic("test", name),
            key: d.key.clone(),
            partitions: 1,
            routers: BTreeMap::new(),
        });
        self
    }

    /// The source's partition count, which the repartition topic of a dedup stage with
    /// `partitioning: repartition` gets (default 1; set it before piping). Records are
    /// routed onto those partitions by Kafka's default partitioner over the dedup key.
    pub fn source_partitions(mut self, n: i32) -> Self {
        if let Some(h) = self.hop.as_mut() {
            h.partitions = n.max(1);
        }
        self
    }

    /// The driver's repartition topic (`test-<stage>-repartition`), when a dedup stage has
    /// `partitioning: repartition` (after no stage, or after filter and map stages only).
    pub fn repartition_topic(&self) -> Option<&str> {
        self.hop.as_ref().map(|h| h.topic.as_str())
    }

    /// Commit under `guarantee` (default at_least_once). Under exactly_once_v2 outputs,
    /// changelog records and offsets commit in one transaction; set it before piping.
    pub fn guarantee(mut self, guarantee: Guarantee) -> Self {
        self.protocol = Protocol::new(guarantee, self.topology.name());
        self
    }

    /// Bind the topology's local sink stores (the sled idempotency store) to state dir
    /// `dir`, as `App::run` does with `state.dir`, with application id `test`. Without it a
    /// sled store with no explicit absolute path fails its records (dead letter).
    pub fn state_dir(mut self, dir: &std::path::Path) -> Self {
        self.topology = self.topology.with_state_dir(dir, "test");
        self
    }

    /// Commit after every piped record (default `true`); with `false`, call [`Self::commit`].
    pub fn auto_commit(mut self, on: bool) -> Self {
        self.auto_commit = on;
        self
    }

    /// The task of `partition`; a new task is first restored from the in-memory changelog,
    /// from its store's checkpoint to the changelog's end, as on assignment.
    fn task(&mut self, partition: i32) -> Result<&mut Task> {
        if !self.tasks.contains_key(&partition) {
            let t = self.restored_task(partition, usize::MAX)?;
            self.tasks.insert(partition, t);
        }
        Ok(self.tasks.get_mut(&partition).expect("inserted above"))
    }

    fn restored_task(&mut self, partition: i32, limit: usize) -> Result<Task> {
        let mut t = Task::new(&self.topology, partition, &self.backend, &self.dlq_topic)?
            .with_tables(self.tables.handles.clone());
        for store in self.topology.stores() {
            let log = self
                .log
                .changelog
                .get(&(store.clone(), partition))
                .cloned()
                .unwrap_or_default();
            let end = log.len() as i64;
            if let Some(start) = t.plan_restore(&store, 0, end)? {
                let upto = (start as usize).saturating_add(limit).min(log.len());
                let batch = &log[start as usize..upto];
                self.restored += batch.len() as u64;
                t.apply_restore(&store, batch.to_vec(), upto as i64)?;
            }
        }
        Ok(t)
    }

    /// Simulate a rebalance in the middle of a restore: `partition`'s task is (re)created,
    /// restores at most `limit` changelog records per store, and is revoked.
    ///
    /// # Errors
    /// A store failure.
    pub fn restore_partially(&mut self, partition: i32, limit: usize) -> Result<()> {
        if let Some(t) = self.tasks.remove(&partition) {
            self.counts.add(t.counts());
        }
        let t = self.restored_task(partition, limit)?;
        assert!(limit == 0 || t.is_restoring() || t.restorers().is_empty());
        Ok(())
    }

    /// Changelog records applied by restores so far.
    pub fn restored_records(&self) -> u64 {
        self.restored
    }

    /// The in-memory changelog of `store`'s `partition` (durable records only).
    pub fn changelog(&self, store: &str, partition: i32) -> &[ChangelogRecord] {
        self.log
            .changelog
            .get(&(store.to_string(), partition))
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// `r` as the source record at `offset` of its partition.
    fn source_record(&self, r: TestRecord, offset: i64) -> Record {
        r.into_record(self.topology.source().topic.as_str().into(), offset)
    }

    /// Pipe one record; returns its offset in its source partition.
    ///
    /// With a repartition hop (a dedup stage with `partitioning: repartition`), the record
    /// first goes through the router task of its source partition, as in `onceflow run`:
    /// the stages before the dedup (filter, map) run on it, and what they pass is routed by
    /// its dedup key onto a partition of the repartition topic
    /// ([`Self::source_partitions`]), whose task processes it; what they refuse goes to
    /// the dead-letter topic from the router.
    ///
    /// The first record runs the start-up check of the external sinks first, as
    /// `onceflow run` does before processing ([`Topology::preflight`]).
    ///
    /// # Errors
    /// A store failure from the task; [`crate::Error::Config`] when a repartitioning dedup
    /// stage has a stage other than a filter or a map before it (refused by `onceflow run`
    /// too), naming both, or when the start-up check of an external sink fails (a secret
    /// not set, a file sink's path that cannot be opened, ...).
    pub fn pipe(&mut self, r: TestRecord) -> Result<i64> {
        self.topology.hop().map_err(crate::Error::Config)?;
        if !self.preflighted {
            self.topology.preflight()?;
            self.preflighted = true;
        }
        if self.hop.is_some() {
            let n = self.source_offsets.entry(r.partition).or_default();
            let offset = *n;
            *n += 1;
            let rec = self.source_record(r, offset);
            for routed in self.route(rec)? {
                self.process(routed)?;
            }
            return Ok(offset);
        }
        let offset = self.inputs.get(&r.partition).map_or(0, |i| i.len() as i64);
        let partition = r.partition;
        let rec = self.source_record(r, offset);
        self.inputs.entry(partition).or_default().push(rec.clone());
        self.process(rec)?;
        Ok(offset)
    }

    /// Route a source record through the repartition hop with the router task of its
    /// source partition ([`Task::router`]): what the stages before the hop pass is appended
    /// to the repartition topic's partition that its dedup key hashes to (a record without
    /// a key keeps its Kafka key, and the dedup stage dead-letters it there); what they
    /// refuse is a dead letter. Returns the repartition records, to process. The hop and
    /// its dead letters are durable at once here; in the runtime they are part of the
    /// commit.
    ///
    /// # Errors
    /// A system failure of a stage before the hop.
    fn route(&mut self, rec: Record) -> Result<Vec<Record>> {
        let clock = self.clock_ms;
        let hop = self.hop.as_mut().expect("called with a hop");
        let router = match hop.routers.entry(rec.source.partition) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let r = crate::processor::repartition::Router::new(
                    hop.key.clone(),
                    self.topology.source().format.clone(),
                    &hop.topic,
                    hop.partitions,
                );
                e.insert(Task::router(
                    &self.topology,
                    rec.source.partition,
                    r,
                    &self.dlq_topic,
                ))
            }
        };
        let mut out = Vec::new();
        router.process(rec, clock, &mut out)?;
        let topic = hop.topic.clone();
        let mut routed = Vec::new();
        for o in out {
            if o.topic == topic {
                routed.push(self.append_routed(o));
            } else {
                self.log.outputs.push(o);
            }
        }
        Ok(routed)
    }

    /// Append a repartition record to its partition of the driver's repartition topic;
    /// returns it as the record its task reads.
    fn append_routed(&mut self, out: OutRecord) -> Record {
        let p = out.partition.unwrap_or(0);
        let log = self.inputs.entry(p).or_default();
        let routed = Record {
            key: out.key,
            value: out.value,
            headers: out.headers,
            timestamp: out.timestamp,
            json: None,
            fields: None,
            source: SourceMeta {
                topic: out.topic.as_str().into(),
                partition: p,
                offset: log.len() as i64,
            },
            origin: None,
            keyed: false,
            dedup_key: None,
            as_read: None,
            view_edited: false,
            unset: None,
        };
        log.push(routed.clone());
        routed
    }

    /// Process one source record and send its outputs; commit if auto-commit is on.
    fn process(&mut self, rec: Record) -> Result<()> {
        let clock = self.clock_ms;
        self.sync_tables()?;
        let mut out = std::mem::take(&mut self.out);
        let done = self
            .task(rec.source.partition)
            .and_then(|t| t.process(rec, clock, &mut out))
            .and_then(|()| self.protocol.processed(&mut self.log, &mut out));
        self.out = out;
        done?;
        if self.auto_commit {
            self.commit()?;
        }
        Ok(())
    }

    /// Commit with the runtime's commit protocol (`runtime/commit.rs`): external
    /// effects finish, outputs become durable (visible), the sweep runs, staged writes go to
    /// the in-memory changelog, state is applied with its changelog offset, offsets are
    /// recorded (under exactly_once_v2 in one transaction). If a failpoint armed with
    /// [`Self::crash_at`] is reached, the driver dies there, as [`Self::crash`] describes,
    /// and [`Self::crashed_at`] names the point.
    ///
    /// # Errors
    /// A store failure.
    pub fn commit(&mut self) -> Result<()> {
        let clock = self.clock_ms;
        let outcome = self
            .protocol
            .commit(&mut self.log, &mut self.tasks, clock)?;
        self.settle(outcome)
    }

    /// Commit as the runtime does before partitions are revoked or at a stop: the commit,
    /// then every commit in flight completes ([`Self::acknowledge`]). Under exactly_once_v2
    /// the transaction committing in the background may fail only now; its abort (a rewind
    /// to the committed offsets) or unknown outcome (a restart) is carried out.
    ///
    /// # Errors
    /// A store failure.
    pub fn commit_and_wait(&mut self) -> Result<()> {
        let clock = self.clock_ms;
        let outcome = self
            .protocol
            .commit_and_drain(&mut self.log, &mut self.tasks, clock)?;
        self.settle(outcome)
    }

    /// The broker acknowledges everything in flight, and every commit in flight does its
    /// remaining steps ([`Self::pipelined`]): under exactly_once_v2 the transaction
    /// committing ends, and the outputs held meanwhile are sent in the next one.
    ///
    /// # Errors
    /// A store failure.
    pub fn acknowledge(&mut self) -> Result<()> {
        let outcome = self.protocol.drain(&mut self.log, &mut self.tasks)?;
        self.settle(outcome)
    }

    /// Hold every acknowledgement until a commit must wait for it or [`Self::acknowledge`]
    /// is called, so commits stay in flight, sealed, while records go on being processed,
    /// as in the runtime (default off: each commit completes at once). at_least_once: a
    /// commit waits when more are in flight than the runtime allows (`MAX_IN_FLIGHT` in
    /// `runtime/commit.rs`); exactly_once_v2: the next commit waits for the transaction
    /// committing, and records processed meanwhile hold their outputs until it has.
    pub fn pipelined(mut self, on: bool) -> Self {
        self.log.hold_acks = on;
        self
    }

    /// Commits in flight: at_least_once commits sealed with steps still to do, or the
    /// exactly_once_v2 transaction committing.
    pub fn in_flight_commits(&self) -> usize {
        self.protocol.in_flight()
    }

    /// The offsets (partition, next offset) of the last commit that completed every step:
    /// what the runtime purges consumed repartition records up to, never the positions of
    /// commits still in flight.
    pub fn last_committed_offsets(&self) -> Vec<(i32, i64)> {
        self.protocol.last_committed_offsets().to_vec()
    }

    /// Carry out what a commit step ended with, as the runtime does.
    fn settle(&mut self, outcome: Outcome) -> Result<()> {
        match outcome {
            Outcome::Nothing => return Ok(()),
            Outcome::Committed => {}
            Outcome::Crashed(name) => {
                self.crash();
                self.crashed_at = Some(name);
            }
            Outcome::Unknown => {
                // As the runtime: every partition opened again, its stores restored from
                // the changelog, its records read again from the committed offsets.
                for t in std::mem::take(&mut self.tasks).into_values() {
                    self.counts.add(t.counts());
                }
                self.restart()?;
            }
            Outcome::Aborted(seek) => {
                // As the runtime: read again from the committed offsets.
                for (p, off) in seek {
                    self.replay(p, off.unwrap_or(0))?;
                }
            }
        }
        self.backend.flush()
    }

    /// Arm failpoint `name` of the commit protocol: the next commit that reaches it dies
    /// there (once). Names: [`crate::runtime::commit::commit_failpoints`] of the driver's
    /// guarantee.
    ///
    /// # Errors
    /// [`crate::Error::Config`] for a name that is not a commit failpoint of the guarantee.
    pub fn crash_at(&mut self, name: &str) -> Result<()> {
        let known = commit::commit_failpoints(self.protocol.guarantee());
        if !known.contains(&name) {
            return Err(crate::Error::Config(format!(
                "failpoint {name:?} is not a commit failpoint of {:?}; known: {}",
                self.protocol.guarantee(),
                known.join(", ")
            )));
        }
        self.log.armed = Some(name.to_string());
        Ok(())
    }

    /// exactly_once_v2: the next transaction commit fails with an abortable error, so the
    /// protocol aborts it, drops the staged state and reads again from the committed
    /// offsets (as the runtime seeks back).
    pub fn fail_next_transaction(&mut self) {
        self.log.fail_commit = true;
    }

    /// exactly_once_v2: the answer to the next transaction commit is lost, after the
    /// commit took effect (`committed`) or before; the protocol cannot know which, so it
    /// re-creates the producer, drops its staged state, restores and reads again from the
    /// committed offsets.
    pub fn lose_next_commit_answer(&mut self, committed: bool) {
        self.log.lose_commit_answer = Some(committed);
    }

    /// exactly_once_v2: the next re-creation of the producer (after an unknown outcome)
    /// fails with a broker error saying `reason`, as the Kafka runtime's does when the
    /// brokers stay away or too many calls are stuck in old producers: the instance stops.
    pub fn fail_next_producer_recreation(&mut self, reason: &str) {
        self.log.refuse_recreation = Some(reason.to_string());
    }

    /// The failpoint the driver last died at ([`Self::crash_at`]).
    pub fn crashed_at(&self) -> Option<&'static str> {
        self.crashed_at
    }

    /// Come back after a crash, as a restarted instance: every partition reads again from
    /// its committed offset to the last piped record (its tasks restore their stores from
    /// the changelog first). With auto-commit each record is committed; otherwise call
    /// [`Self::commit`].
    ///
    /// # Errors
    /// A store failure.
    pub fn restart(&mut self) -> Result<()> {
        let parts: Vec<i32> = self.inputs.keys().copied().collect();
        for p in parts {
            let from = self.log.committed.get(&p).copied().unwrap_or(0);
            self.replay(p, from)?;
        }
        Ok(())
    }

    fn replay(&mut self, partition: i32, from: i64) -> Result<()> {
        let records: Vec<Record> = self
            .inputs
            .get(&partition)
            .map(|v| v.iter().skip(from.max(0) as usize).cloned().collect())
            .unwrap_or_default();
        for r in records {
            self.process(r)?;
        }
        Ok(())
    }

    /// Simulate a crash before the commit: staged state, unacknowledged outputs and an
    /// open transaction are lost and the tasks are closed; the next record reopens them
    /// from the stores (restoring from the changelog what they miss).
    pub fn crash(&mut self) {
        self.out.clear();
        self.protocol.forget();
        self.log.lose_in_flight();
        for t in self.tasks.values_mut() {
            t.abort(None);
            self.counts.add(t.counts());
        }
        self.tasks.clear();
    }

    /// Delete every store, as if the state dir were removed; the changelog stays, and the
    /// next record of a partition restores its stores from it.
    pub fn wipe_state(&mut self) {
        self.crash();
        self.backend.wipe();
        for t in self.tables.engines.values() {
            let _ = crate::state::table::TableEngine::clear(t.as_ref());
        }
    }

    /// Move the mock wall clock forward.
    pub fn advance_wall_clock(&mut self, by: std::time::Duration) {
        self.clock_ms += by.as_millis() as i64;
    }

    /// Durable outputs written to `topic`, in order (at_least_once: acknowledged;
    /// exactly_once_v2: committed, what a read_committed consumer sees).
    pub fn output(&self, topic: &str) -> Vec<&OutRecord> {
        self.log
            .outputs
            .iter()
            .filter(|r| r.topic == topic)
            .collect()
    }

    /// Committed outputs' values written to `topic`, as UTF-8 text (lossy: for assertions).
    pub fn output_values(&self, topic: &str) -> Vec<String> {
        self.output(topic)
            .iter()
            .map(|r| String::from_utf8_lossy(r.value.as_deref().unwrap_or_default()).into_owned())
            .collect()
    }

    /// Committed dead letters.
    pub fn dead_letters(&self) -> Vec<&OutRecord> {
        self.output(&self.dlq_topic)
    }

    /// The committed offset of `partition` (offset of the next record to read).
    pub fn committed_offset(&self, partition: i32) -> Option<i64> {
        self.log.committed.get(&partition).copied()
    }

    /// The dedup entry of `key` in `store` for `partition`, as committed or staged.
    ///
    /// # Errors
    /// Unknown store, a store failure, or an entry that does not decode.
    pub fn dedup_entry(
        &mut self,
        store: &str,
        partition: i32,
        key: &[u8],
    ) -> Result<Option<DedupEntry>> {
        use prost::Message;
        let v = self.task(partition)?.store_get(store, key)?;
        v.map(|b| {
            DedupEntry::decode(b.as_slice())
                .map_err(|e| crate::Error::state(store, format!("corrupt entry: {e}")))
        })
        .transpose()
    }

    /// Totals over all tasks alive now (the routers of a repartition hop included).
    pub fn counts(&self) -> Counts {
        let mut c = self.counts;
        let routers = self.hop.iter().flat_map(|h| h.routers.values());
        for t in self.tasks.values().chain(routers) {
            c.add(t.counts());
        }
        c
    }
}

// ---- Lookup tables (enrich): an in-memory table topic per table, loaded like the runtime
// loads a table topic (from the stored offsets to the end, before each piped record). ----

/// The driver's tables: engines and their topics' records.
#[derive(Default)]
struct TableState {
    handles: crate::state::table::Tables,
    engines: BTreeMap<String, std::sync::Arc<crate::state::table::MemoryTable>>,
    logs: BTreeMap<String, BTreeMap<i32, Vec<crate::state::table::TableRecord>>>,
}

impl TestDriver {
    fn with_tables(mut self) -> Self {
        for t in self.topology.tables() {
            let engine = std::sync::Arc::new(crate::state::table::MemoryTable::new(&t.name));
            self.tables.handles.insert(t.name.clone(), engine.clone());
            self.tables.engines.insert(t.name.clone(), engine);
        }
        self
    }

    /// Write a record to the topic of table `table` (key = row key, null value = delete);
    /// the table picks it up before the next piped record. Returns its offset.
    ///
    /// # Errors
    /// [`crate::Error::Topology`] when the topology has no such table.
    pub fn pipe_table(&mut self, table: &str, r: TestRecord) -> Result<i64> {
        if !self.tables.engines.contains_key(table) {
            return Err(crate::Error::Topology {
                node: table.to_string(),
                reason: "no such table in this topology".into(),
            });
        }
        let log = self
            .tables
            .logs
            .entry(table.to_string())
            .or_default()
            .entry(r.partition)
            .or_default();
        let offset = log.len() as i64;
        log.push(crate::state::table::TableRecord {
            partition: r.partition,
            offset,
            key: r.key.map(|k| k.to_vec()),
            value: r.value.map(|v| v.to_vec()),
        });
        Ok(offset)
    }

    /// Bring every table up to the end of its topic, from its stored offsets.
    ///
    /// # Errors
    /// A table engine failure.
    pub(crate) fn sync_tables(&mut self) -> Result<()> {
        for spec in self.topology.tables() {
            let engine = &self.tables.engines[&spec.name];
            let offsets = crate::state::table::TableEngine::offsets(engine.as_ref())?;
            let Some(parts) = self.tables.logs.get(&spec.name) else {
                continue;
            };
            let mut batch = Vec::new();
            for (p, log) in parts {
                let from = offsets.get(p).copied().unwrap_or(0).max(0) as usize;
                batch.extend(log.iter().skip(from).cloned());
            }
            if !batch.is_empty() {
                crate::state::table::apply_records(engine.as_ref(), &spec.format, &batch)?;
            }
        }
        Ok(())
    }

    /// The row of `key` in table `table`, as JSON text.
    ///
    /// # Errors
    /// Unknown table or a table engine failure.
    pub fn table_row(&mut self, table: &str, key: &[u8]) -> Result<Option<String>> {
        self.sync_tables()?;
        let engine = self
            .tables
            .engines
            .get(table)
            .ok_or_else(|| crate::Error::Topology {
                node: table.to_string(),
                reason: "no such table in this topology".into(),
            })?;
        Ok(crate::state::table::TableEngine::get(engine.as_ref(), key)?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }
}

#[cfg(test)]
mod tests;
