//! A broker-free test driver: pipe records into a topology, read what it wrote, move a mock
//! clock, look into its stores, and simulate crashes and restarts.
//!
//! ```
//! use onceflow::testing::{TestDriver, TestRecord};
//! use onceflow::topology::{TopologyBuilder, Format};
//! use onceflow::processor::{key::KeySource, stages::DedupSpec};
//! let t = TopologyBuilder::new("t").source("in", Format::Json)
//!     .dedup("dedup", DedupSpec::new(KeySource::JsonPointer("/id".into())))
//!     .sink("out", "out").build().unwrap();
//! let mut d = TestDriver::new(t);
//! d.pipe(TestRecord::json(r#"{"id":1}"#).timestamp(0)).unwrap();
//! d.pipe(TestRecord::json(r#"{"id":1}"#).timestamp(5)).unwrap();
//! assert_eq!(d.output("out").len(), 1);
//! ```

use crate::error::Result;
use crate::processor::dedup::DedupEntry;
use crate::processor::{Counts, OutRecord, Record, SourceMeta};
use crate::runtime::Task;
use crate::state::restore::ChangelogRecord;
use crate::state::{MemoryBackend, StateBackend};
use crate::topology::Topology;
use bytes::Bytes;
use std::collections::BTreeMap;

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
}

/// Runs a topology without a broker. Each partition gets a [`Task`] over in-memory stores;
/// outputs become visible when committed (by default after every piped record).
pub struct TestDriver {
    topology: Topology,
    backend: MemoryBackend,
    tasks: BTreeMap<i32, Task>,
    next_offset: BTreeMap<i32, i64>,
    committed_offset: BTreeMap<i32, i64>,
    clock_ms: i64,
    pending: Vec<OutRecord>,
    outputs: Vec<OutRecord>,
    auto_commit: bool,
    dlq_topic: String,
    counts: Counts,
    changelog: BTreeMap<(String, i32), Vec<ChangelogRecord>>,
    restored: u64,
    uncommitted: usize,
    tables: TableState,
}

impl TestDriver {
    /// A driver for `topology`; the dead-letter topic is `test.dlq`, the clock starts at 0.
    pub fn new(topology: Topology) -> Self {
        TestDriver {
            topology,
            backend: MemoryBackend::default(),
            tasks: BTreeMap::new(),
            next_offset: BTreeMap::new(),
            committed_offset: BTreeMap::new(),
            clock_ms: 0,
            pending: Vec::new(),
            outputs: Vec::new(),
            auto_commit: true,
            dlq_topic: "test.dlq".into(),
            counts: Counts::default(),
            changelog: BTreeMap::new(),
            restored: 0,
            uncommitted: 0,
            tables: TableState::default(),
        }
        .with_tables()
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

    /// Name of the dead-letter topic.
    pub fn dlq_topic(&self) -> &str {
        &self.dlq_topic
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

    /// The in-memory changelog of `store`'s `partition`.
    pub fn changelog(&self, store: &str, partition: i32) -> &[ChangelogRecord] {
        self.changelog
            .get(&(store.to_string(), partition))
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// Pipe one record; returns its offset.
    ///
    /// # Errors
    /// A store failure from the task.
    pub fn pipe(&mut self, r: TestRecord) -> Result<i64> {
        let offset = *self.next_offset.entry(r.partition).or_insert(0);
        self.next_offset.insert(r.partition, offset + 1);
        let rec = Record {
            key: r.key,
            value: r.value,
            headers: r.headers,
            timestamp: r.timestamp,
            json: None,
            fields: None,
            source: SourceMeta {
                topic: self.topology.source().topic.as_str().into(),
                partition: r.partition,
                offset,
            },
        };
        let clock = self.clock_ms;
        let mut out = Vec::new();
        self.sync_tables()?;
        self.task(r.partition)?.process(rec, clock, &mut out)?;
        self.pending.extend(out);
        self.uncommitted += 1;
        if self.auto_commit {
            self.commit()?;
        }
        Ok(offset)
    }

    /// Commit, in the runtime's order: outputs become visible, the sweep runs, staged writes
    /// go to the in-memory changelog, state is applied with its changelog offset, offsets are
    /// recorded.
    ///
    /// # Errors
    /// A store failure.
    pub fn commit(&mut self) -> Result<()> {
        // As the runtime: no record since the last commit, nothing to do.
        if self.uncommitted == 0 {
            return Ok(());
        }
        self.uncommitted = 0;
        let clock = self.clock_ms;
        for t in self.tasks.values_mut() {
            t.flush_effects(clock, &mut self.pending)?;
            t.punctuate(clock)?;
        }
        self.outputs.append(&mut self.pending);
        for (p, t) in self.tasks.iter_mut() {
            let mut written = std::collections::BTreeSet::new();
            let log = &mut self.changelog;
            t.for_each_staged_write(|store, k, v| {
                let l = log.entry((store.to_string(), *p)).or_default();
                l.push(ChangelogRecord {
                    key: k.to_vec(),
                    value: v.map(<[u8]>::to_vec),
                    offset: l.len() as i64,
                });
                written.insert(store.to_string());
            });
            let ends: BTreeMap<String, i64> = written
                .into_iter()
                .map(|s| {
                    let end = log.get(&(s.clone(), *p)).map_or(0, |l| l.len() as i64);
                    (s, end)
                })
                .collect();
            t.commit_state(|s| ends.get(s).copied())?;
            if let Some(pos) = t.position() {
                self.committed_offset.insert(*p, pos);
            }
        }
        self.backend.flush()
    }

    /// Simulate a crash before the commit: staged state and unwritten outputs are lost and
    /// the tasks are closed; the next record reopens them from the stores.
    pub fn crash(&mut self) {
        self.pending.clear();
        self.uncommitted = 0;
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

    /// The mock wall clock (ms).
    pub fn wall_clock_ms(&self) -> i64 {
        self.clock_ms
    }

    /// Committed outputs written to `topic`, in order.
    pub fn output(&self, topic: &str) -> Vec<&OutRecord> {
        self.outputs.iter().filter(|r| r.topic == topic).collect()
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
        self.output(&self.dlq_topic.clone())
            .into_iter()
            .collect::<Vec<_>>()
    }

    /// The committed offset of `partition` (offset of the next record to read).
    pub fn committed_offset(&self, partition: i32) -> Option<i64> {
        self.committed_offset.get(&partition).copied()
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

    /// Totals over all tasks alive now.
    pub fn counts(&self) -> Counts {
        let mut c = self.counts;
        for t in self.tasks.values() {
            c.add(t.counts());
        }
        c
    }
}

// ---- Lookup tables (enrich): an in-memory table topic per table, loaded like the runtime
// loads a table topic (from the stored offsets to the end, before each piped record). ----

/// The driver's tables: engines, their topics' records, and load counts.
#[derive(Default)]
struct TableState {
    handles: crate::state::table::Tables,
    engines: BTreeMap<String, std::sync::Arc<crate::state::table::MemoryTable>>,
    logs: BTreeMap<String, BTreeMap<i32, Vec<crate::state::table::TableRecord>>>,
    loaded: u64,
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
    pub fn sync_tables(&mut self) -> Result<()> {
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
                self.tables.loaded += batch.len() as u64;
                crate::state::table::apply_records(engine.as_ref(), &spec.format, &batch)?;
            }
        }
        Ok(())
    }

    /// Table topic records applied to tables so far (a wiped table loads its topic again).
    pub fn table_records_loaded(&self) -> u64 {
        self.tables.loaded
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

pub mod gharchive;
pub mod harness;
pub mod kafka;
