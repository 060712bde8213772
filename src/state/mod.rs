//! State stores: the [`KeyValueStore`] trait, its engines (memory, sled), and the staging
//! layer that keeps a commit's writes pending until the commit protocol says they may land.
//!
//! Layering, as in Kafka Streams: an engine (`memory`, `sled`) under a [`StagedStore`] that
//! buffers the writes of the open commit. A write reaches the engine only through
//! [`StagedStore::commit`], which the runtime calls after the outputs those writes stand for
//! are durable. Engines write one batch atomically, together with the changelog offset the
//! batch reached, so a crash leaves either the whole batch or none of it.
//!
//! Files, one concept each: this one (the store traits), `lock` (the state-dir lock),
//! `staged` (the staging layer), `writer` (the write-behind writer thread), `behind` (a
//! store's write-behind side), `resident` (the resident index and key filter), `memory` and
//! `sled` (the engines), `warm` (read-ahead of engine lookups), `restore` (changelog restore)
//! and `table` (lookup tables).

mod behind;
mod lock;
mod memory;
mod resident;
pub(crate) mod restore;
mod sled;
mod slots;
mod staged;
pub(crate) mod table;
mod warm;
mod writer;
pub(crate) use writer::set_before_chunk;

pub(crate) use self::lock::StateDirLock;
pub(crate) use self::memory::MemoryBackend;
pub(crate) use self::sled::SledBackend;
pub(crate) use self::staged::{Arena, StagedStore, Withdrawn};
pub(crate) use self::warm::{WarmBatch, Warmed, Warmer};
pub(crate) use self::writer::{Writer, WriterHold};
use self::{behind::*, resident::*, writer::*};

use crate::error::Result;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

/// The writes of one commit to one store, applied atomically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct WriteBatch {
    /// Puts (`Some`) and deletes (`None`) in order; a later op on a key wins.
    pub(crate) ops: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    /// The changelog offset these writes reached, stored in the same batch (restore resumes
    /// from it). `None` leaves the stored offset as it was.
    pub(crate) changelog_offset: Option<i64>,
}

/// The key count that goes with a [`KeyValueStore::write_ops`], when the caller knows it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counted<'a> {
    /// Keys the store holds after the ops.
    pub(crate) after: u64,
    /// Each op's change to the count, one per op: `1` is a put of a key the store did not
    /// hold just before it (so an engine need not look for an older copy, unless an earlier
    /// op of the same key is among these ops), `-1` a delete of a key it held, `0` anything
    /// else.
    pub(crate) deltas: &'a [i8],
}

/// A partition-local key-value store engine. Keys and values are raw bytes. Engines are
/// shared between the processing thread (reads) and the [`Writer`] (batches).
pub(crate) trait KeyValueStore: Send + Sync {
    /// Store name and partition, for messages, e.g. `dedup/3`.
    fn name(&self) -> &str;

    /// Bytes of memory the engine holds for its entries and its index, without the
    /// allocator's rounding: the memory store, all of it; sled, the index of key hashes
    /// (its page cache, bounded by `state.cache.bytes`, is not counted). Walks those
    /// structures: for a summary or a periodic gauge, not per record. Without `wait`,
    /// `None` when the engine is busy (a batch being written holds its index).
    fn memory_bytes(&self, wait: bool) -> Option<usize> {
        let _ = wait;
        Some(0)
    }

    /// The value stored under `key`.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to read.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;

    /// Apply `batch` atomically, with its changelog offset.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to write; nothing was applied then.
    fn write(&self, batch: WriteBatch) -> Result<()>;

    /// As [`KeyValueStore::write`], from borrowed buffers (puts and deletes in order, a later
    /// op on a key wins), with the key count when the caller knows it ([`Counted`]: the
    /// number of keys the store holds after the ops, stored in the same batch by engines
    /// that keep it, see [`KeyValueStore::key_count`]; and each op's change to it, which
    /// tells an engine which keys are new). The default copies the ops into a
    /// [`WriteBatch`] and ignores the count.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to write; nothing was applied then.
    fn write_ops(
        &self,
        ops: &[(&[u8], Option<&[u8]>)],
        changelog_offset: Option<i64>,
        count: Option<Counted<'_>>,
    ) -> Result<()> {
        let _ = count;
        self.write(WriteBatch {
            ops: ops
                .iter()
                .map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec)))
                .collect(),
            changelog_offset,
        })
    }

    /// The key count stored by the last [`KeyValueStore::write_ops`] that carried one
    /// (`None` when never stored, made stale by a write without one, or not kept by this
    /// engine). The default keeps none.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to read.
    fn key_count(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// The changelog offset stored by the last batch that carried one.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to read.
    fn changelog_offset(&self) -> Result<Option<i64>>;

    /// Remove every entry and the changelog offset.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to write.
    fn clear(&self) -> Result<()>;

    /// Up to `limit` entries after `after` (from the start if `None`), in the engine's own
    /// total order, in which a key locates its successor even if it was deleted since: key
    /// order for the memory engine, `(xxh3(key), key)` for sled.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to read.
    fn scan(&self, after: Option<&[u8]>, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>>;

    /// Whether a read is worth doing ahead, on another thread, of the lookup that needs
    /// it ([`Warmer`]): it leaves memory (sled: a leaf read and decoded). The default: no.
    fn warms(&self) -> bool {
        false
    }
}

/// Opens the engine of a (store, partition) pair and makes written batches durable.
pub(crate) trait StateBackend: Send + Sync {
    /// Open (or create) the store `store` for `partition`.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine cannot open it.
    fn open(&self, store: &str, partition: i32) -> Result<Arc<dyn KeyValueStore>>;

    /// The background writer for committed batches, if this engine wants one.
    fn writer(&self) -> Option<Arc<Writer>> {
        None
    }

    /// Make every batch written so far durable (an fsync for sled; nothing in memory).
    ///
    /// # Errors
    /// [`crate::Error::State`] when the flush fails.
    fn flush(&self) -> Result<()>;
}

/// Memory held by state stores in the process, in bytes, by part: what grows with the
/// number of keys (see [`crate::RunSummary::state_memory`]). Counted as the structures'
/// sizes (capacity of tables, bytes of entries), without the allocator's rounding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateMemory {
    /// Committed entries held readable in memory by write-behind stores (until persisted,
    /// and after that the most recent ones, up to a bound per partition), with their index.
    pub resident: u64,
    /// The key filter of a write-behind store opened over an empty engine, once keys have
    /// left memory: 32-bit hashes of every key put since it opened, so that a new key is
    /// known new without reading the engine (0 for a store opened over existing data).
    pub key_filter: u64,
    /// The engine's own memory (see `KeyValueStore::memory_bytes`): the memory store's
    /// entries, sled's index of key hashes.
    pub engine: u64,
}

impl StateMemory {
    /// Add `other`'s parts to these.
    pub(crate) fn add(&mut self, other: StateMemory) {
        self.resident += other.resident;
        self.key_filter += other.key_filter;
        self.engine += other.engine;
    }
}

/// `ops` as the borrowed slices [`KeyValueStore::write_ops`] takes.
pub(crate) fn slices(ops: &[(Bytes, Option<Bytes>)]) -> Vec<(&[u8], Option<&[u8]>)> {
    ops.iter().map(|(k, v)| (&k[..], v.as_deref())).collect()
}

/// Ops per engine write of the background writer: unbounded, so that the writes of one
/// commit go into one sled batch together with the changelog offset they reached (issue 3).
/// sled's `apply_batch` holds a lock that sled reads wait on, but lookups of committed
/// entries are answered from memory first (see [`RESIDENT_ENTRIES`]). A smaller value
/// splits a batch into chunks, only the last one carrying the offset (see [`Writer`]).
const WRITE_CHUNK: usize = usize::MAX;

/// Committed entries a write-behind store keeps readable in memory (per store partition)
/// once they are persisted; beyond it the oldest persisted batches leave memory and are
/// read from the engine again. An entry costs its key and value, about 6 bytes of
/// bookkeeping (see [`resident::Packed`]) and about 12 of index: ~45 bytes for the bench's
/// dedup entries (13-byte keys).
pub(crate) const RESIDENT_ENTRIES: usize = 262_144;

/// Committed ops a write-behind store lets wait for the engine (per store partition);
/// beyond it [`StagedStore::commit`] waits for the writer, so the engine's write rate
/// bounds a sustained run while bursts up to this size run at memory speed.
pub(crate) const UNPERSISTED_OPS: usize = 262_144;

#[cfg(test)]
mod tests {
    use super::*;

    /// A state.dir that is a file (or under one) is the user's to fix: exit 2, naming it.
    #[test]
    fn a_state_dir_that_is_a_file_is_a_config_fault() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        for d in [file.clone(), file.join("below")] {
            let err = StateDirLock::acquire(&d).err().expect("refused");
            let msg = err.to_string();
            assert_eq!(err.fault(), crate::error::Fault::User, "{msg}");
            assert!(msg.contains("not-a-dir is a file"), "{msg}");
        }
    }

    #[test]
    fn a_locked_state_dir_fails_fast() {
        let dir = tempfile::tempdir().unwrap();
        let held = StateDirLock::acquire(dir.path()).unwrap();
        // flock locks belong to open file descriptions: a second open conflicts even in
        // one process, as it would across two.
        let err = StateDirLock::acquire(dir.path())
            .err()
            .expect("second lock must fail");
        let msg = err.to_string();
        assert!(msg.contains("locked by another onceflow process"), "{msg}");
        // A fault to fix, as a port in use: exit code 2.
        assert_eq!(err.fault(), crate::error::Fault::User, "{msg}");
        assert!(
            msg.contains(&std::process::id().to_string()),
            "names the holder: {msg}"
        );
        drop(held);
        StateDirLock::acquire(dir.path()).expect("free again once released");
    }

    #[test]
    fn withdrawn_writes_leave_nothing_to_commit_and_later_writes_stand() {
        let backend = MemoryBackend::default();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), None);
        s.stage(b"old".to_vec(), Some(b"0".to_vec()));
        s.commit(Some(0)).unwrap();
        // Owner 1 marks a and renews old; owner 2 marks b; owner 3 marks a again.
        s.stage_for(1, b"a", Some(b"1a"));
        s.stage_for(1, b"old", Some(b"1old"));
        s.stage_for(2, b"b", Some(b"2b"));
        s.stage(b"swept".to_vec(), None);
        s.stage_for(3, b"a", Some(b"3a"));
        // Owner 1: `a` was replaced by owner 3 (stays), `old` goes back to its committed value.
        let w = s.withdraw(1);
        assert_eq!(w.len(), 1);
        assert_eq!(&w[0].key[..], b"old");
        assert_eq!(s.get(b"old").unwrap(), Some(b"0".to_vec()));
        assert_eq!(s.get(b"a").unwrap(), Some(b"3a".to_vec()));
        // Owner 3 stood on owner 1's write, which is gone: `a` goes back to nothing.
        assert_eq!(s.withdraw(3).len(), 1);
        assert_eq!(s.get(b"a").unwrap(), None);
        assert!(s.withdraw(3).is_empty(), "nothing left to take back");
        let staged: Vec<(Vec<u8>, Option<Vec<u8>>)> = s
            .pending()
            .map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec)))
            .collect();
        assert_eq!(
            staged,
            vec![
                (b"b".to_vec(), Some(b"2b".to_vec())),
                (b"swept".to_vec(), None)
            ]
        );
        s.commit(Some(1)).unwrap();
        assert_eq!(s.engine().get(b"b").unwrap(), Some(b"2b".to_vec()));
        assert_eq!(s.engine().get(b"a").unwrap(), None);
        assert_eq!(s.engine().get(b"old").unwrap(), Some(b"0".to_vec()));
        // After the commit nothing is withdrawable.
        assert!(s.withdraw(2).is_empty());
        assert_eq!(s.engine().get(b"b").unwrap(), Some(b"2b".to_vec()));
    }

    #[test]
    fn staged_writes_are_visible_but_not_applied_until_commit() {
        let backend = MemoryBackend::default();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), None);
        s.stage(b"a".to_vec(), Some(b"1".to_vec()));
        assert_eq!(s.get(b"a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(
            s.engine().get(b"a").unwrap(),
            None,
            "not applied before commit"
        );
        s.abort();
        assert_eq!(s.get(b"a").unwrap(), None, "abort drops staged writes");
        s.stage(b"a".to_vec(), Some(b"2".to_vec()));
        s.stage(b"b".to_vec(), Some(b"3".to_vec()));
        s.stage(b"b".to_vec(), None);
        s.commit(Some(41)).unwrap();
        assert_eq!(s.engine().get(b"a").unwrap(), Some(b"2".to_vec()));
        assert_eq!(s.engine().get(b"b").unwrap(), None);
        assert_eq!(s.engine().changelog_offset().unwrap(), Some(41));
        assert_eq!(s.pending_len(), 0);
    }

    #[test]
    fn sealed_batches_stay_readable_and_commit_oldest_first() {
        let backend = MemoryBackend::default();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), None);
        s.stage(b"a".to_vec(), Some(b"1".to_vec()));
        s.stage(b"b".to_vec(), Some(b"1".to_vec()));
        s.seal(7);
        // Sealed: read, not staged, not applied.
        assert_eq!(s.get(b"a").unwrap(), Some(b"1".to_vec()));
        assert!(!s.is_staged(b"a"));
        assert_eq!(s.engine().get(b"a").unwrap(), None);
        // The next commit's writes shadow the sealed ones.
        s.stage(b"a".to_vec(), Some(b"2".to_vec()));
        s.stage(b"b".to_vec(), None);
        s.seal(8);
        assert_eq!(s.get(b"a").unwrap(), Some(b"2".to_vec()));
        assert_eq!(s.get(b"b").unwrap(), None);
        assert_eq!(s.sealed_len(), 2);
        // Only the oldest batch is the one of its epoch.
        assert_eq!(s.sealed(8).count(), 0);
        assert_eq!(s.sealed(7).count(), 2);
        s.commit_sealed(7, Some(10)).unwrap();
        assert_eq!(s.engine().get(b"a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(s.engine().changelog_offset().unwrap(), Some(10));
        assert_eq!(
            s.get(b"b").unwrap(),
            None,
            "the newer sealed delete still shadows"
        );
        s.commit_sealed(8, Some(12)).unwrap();
        assert_eq!(s.engine().get(b"a").unwrap(), Some(b"2".to_vec()));
        assert_eq!(s.engine().get(b"b").unwrap(), None);
        assert_eq!(s.sealed_len(), 0);
        // An abort drops sealed batches too.
        s.stage(b"c".to_vec(), Some(b"1".to_vec()));
        s.seal(9);
        s.abort();
        assert_eq!(s.get(b"c").unwrap(), None);
    }

    #[test]
    fn a_written_batch_leaves_its_buffers_empty_for_the_next_one() {
        let backend = MemoryBackend::default();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), None);
        for i in 0..5000u32 {
            s.stage(i.to_be_bytes().to_vec(), Some(b"v".to_vec()));
        }
        s.seal(1);
        let grown = s.sealed.front().unwrap().1.ops.capacity();
        assert!(grown >= 5000);
        s.commit_sealed(1, Some(5000)).unwrap();
        let spare = s
            .spare
            .as_ref()
            .expect("the written batch's buffers are kept");
        assert!(
            spare.ops.is_empty(),
            "emptied: nothing of the old batch stays"
        );
        assert_eq!(spare.ops.capacity(), grown);
        // The batch staged meanwhile is sealed; the spare becomes the next one, and
        // nothing of the old batch shows through.
        s.stage(b"new".to_vec(), Some(b"1".to_vec()));
        s.seal(2);
        assert!(s.spare.is_none());
        assert_eq!(s.pending.ops.capacity(), grown);
        assert_eq!(s.pending.len(), 0);
        s.stage(b"newer".to_vec(), Some(b"2".to_vec()));
        assert_eq!(s.pending.len(), 1);
        assert!(!s.is_staged(&0u32.to_be_bytes()));
        assert_eq!(s.get(&0u32.to_be_bytes()).unwrap(), Some(b"v".to_vec()));
        s.commit_sealed(2, Some(5001)).unwrap();
        assert_eq!(s.engine().get(b"new").unwrap(), Some(b"1".to_vec()));
        assert_eq!(s.engine().changelog_offset().unwrap(), Some(5001));
        s.commit(Some(5002)).unwrap();
        assert_eq!(s.engine().get(b"newer").unwrap(), Some(b"2".to_vec()));
        assert_eq!(s.engine().scan(None, usize::MAX).unwrap().len(), 5002);
    }
    #[derive(Debug, Clone)]
    enum Op {
        Stage(u8, Option<u8>),
        Commit,
        Abort,
        Restore(Vec<(u8, Option<u8>)>),
        SyncAndReopen,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0u8..24, proptest::option::of(any::<u8>())).prop_map(|(k, v)| Op::Stage(k, v)),
            2 => Just(Op::Commit),
            1 => Just(Op::Abort),
            1 => proptest::collection::vec((0u8..24, proptest::option::of(any::<u8>())), 0..12)
                .prop_map(Op::Restore),
            1 => Just(Op::SyncAndReopen),
        ]
    }

    /// Runs `ops` on a write-behind store over `backend` (tiny memory bounds, so eviction
    /// and waiting for the writer happen) against a model. `keeps_count`: the engine
    /// stores the key count, so a reopened store still knows it.
    fn check_write_behind(
        backend: &dyn StateBackend,
        ops: Vec<Op>,
        keeps_count: bool,
        first_seq: u64,
    ) -> std::result::Result<(), proptest::test_runner::TestCaseError> {
        let writer = Writer::spawn();
        let open = || {
            StagedStore::new(backend.open("s", 0).unwrap(), Some(writer.clone()))
                .with_limits(3, 4)
                .with_seq(first_seq)
        };
        let mut s = open();
        let mut committed: std::collections::BTreeMap<u8, u8> = Default::default();
        let mut staged: std::collections::BTreeMap<u8, Option<u8>> = Default::default();
        let mut offset = 0i64;
        // The changelog offset the engine must hold after a sync.
        let mut stored: Option<i64> = None;
        for op in ops {
            match op {
                Op::Stage(k, v) => {
                    s.stage(vec![k], v.map(|v| vec![v]));
                    staged.insert(k, v);
                }
                Op::Commit => {
                    offset += 1;
                    s.commit(Some(offset)).unwrap();
                    // A commit with nothing staged writes no changelog record: the stored
                    // offset stays.
                    if !staged.is_empty() {
                        stored = Some(offset);
                    }
                    for (k, v) in std::mem::take(&mut staged) {
                        match v {
                            Some(v) => {
                                committed.insert(k, v);
                            }
                            None => {
                                committed.remove(&k);
                            }
                        }
                    }
                }
                Op::Abort => {
                    s.abort();
                    staged.clear();
                }
                Op::Restore(batch) => {
                    offset += 1;
                    stored = Some(offset);
                    for (k, v) in &batch {
                        match v {
                            Some(v) => {
                                committed.insert(*k, *v);
                            }
                            None => {
                                committed.remove(k);
                            }
                        }
                    }
                    s.write_restored(WriteBatch {
                        ops: batch
                            .into_iter()
                            .map(|(k, v)| (vec![k], v.map(|v| vec![v])))
                            .collect(),
                        changelog_offset: Some(offset),
                    })
                    .unwrap();
                }
                Op::SyncAndReopen => {
                    s.abort();
                    staged.clear();
                    s.sync().unwrap();
                    let engine = backend.open("s", 0).unwrap();
                    let mut all: Vec<(Vec<u8>, Vec<u8>)> = engine.scan(None, usize::MAX).unwrap();
                    all.sort(); // the engine's order is its own
                    let want: Vec<(Vec<u8>, Vec<u8>)> = committed
                        .iter()
                        .map(|(k, v)| (vec![*k], vec![*v]))
                        .collect();
                    proptest::prop_assert_eq!(all, want);
                    proptest::prop_assert_eq!(engine.changelog_offset().unwrap(), stored);
                    // A count known when closing survives a reopen where the engine keeps
                    // it; an empty engine always has a known count.
                    let known_before = s.known_len().is_some();
                    drop(s);
                    s = open();
                    if (keeps_count && known_before) || committed.is_empty() {
                        proptest::prop_assert_eq!(s.known_len(), Some(committed.len() as u64));
                    }
                }
            }
            for k in 0u8..24 {
                let want = match staged.get(&k) {
                    Some(v) => *v,
                    None => committed.get(&k).copied(),
                };
                proptest::prop_assert_eq!(s.get(&[k]).unwrap(), want.map(|v| vec![v]), "key {}", k);
            }
            if let Some(n) = s.known_len() {
                proptest::prop_assert_eq!(n, committed.len() as u64);
            }
            let mut visited: Vec<(u8, u8)> = Vec::new();
            s.for_each_committed(|k, v| {
                visited.push((k[0], v[0]));
                Ok(())
            })
            .unwrap();
            visited.sort_unstable();
            let want: Vec<(u8, u8)> = committed.iter().map(|(k, v)| (*k, *v)).collect();
            proptest::prop_assert_eq!(visited, want, "committed entries visited once each");
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// A write-behind store over the memory engine against a model: reads see staged,
        /// then committed writes; aborts drop staged ones; restored batches apply in order;
        /// the key count it keeps is exact; after a sync the engine holds exactly the
        /// committed state and the last offset.
        #[test]
        fn write_behind_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
            check_write_behind(&MemoryBackend::default(), ops, false, 0)?;
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(16))]
        /// The same over sled, which also keeps the key count across a reopen.
        #[test]
        fn write_behind_over_sled_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
            let dir = tempfile::tempdir().unwrap();
            let backend = SledBackend::open(dir.path()).unwrap();
            check_write_behind(&backend, ops, true, 0)?;
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// The same with batch numbers crossing u32::MAX: resident slots keep only the low
        /// 32 bits of their batch's number, so the wrap must neither misplace nor keep a
        /// key (long runs of batches, keys repeated within and across them).
        #[test]
        fn write_behind_matches_model_across_the_slot_wrap(
            ops in proptest::collection::vec(op(), 1..120),
            back in 0u64..40,
        ) {
            let first = (1u64 << 32) - back;
            check_write_behind(&MemoryBackend::default(), ops.clone(), false, first)?;
            let dir = tempfile::tempdir().unwrap();
            let backend = SledBackend::open(dir.path()).unwrap();
            check_write_behind(&backend, ops, true, first)?;
        }
    }

    /// The run loop reads ahead (on another thread) exactly the keys whose lookups would
    /// read the engine: not a key staged, held in memory or never written, and nothing
    /// while every key is in memory. A value read ahead is what the lookup returns, unless
    /// a batch left memory since: then the key may have been written meanwhile.
    #[test]
    fn a_read_ahead_is_asked_only_for_engine_reads_and_never_returns_a_stale_value() {
        let dir = tempfile::tempdir().unwrap();
        let backend = SledBackend::open(dir.path()).unwrap();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), Some(Writer::spawn()))
            .with_limits(4, 8);
        let asks = |s: &StagedStore, k: u8| {
            let mut b = WarmBatch::default();
            s.warm_into(&[k], &mut b);
            b
        };
        let mut offset = 0;
        let mut commit = |s: &mut StagedStore| {
            offset += 1;
            s.commit(Some(offset)).unwrap();
            s.sync().unwrap();
        };
        s.stage(vec![0], Some(vec![0]));
        commit(&mut s);
        assert!(!s.warms(), "every key is in memory: nothing to read ahead");
        assert_eq!(asks(&s, 0).len(), 0);
        for i in 1..40u8 {
            s.stage(vec![i], Some(vec![i]));
            if i % 4 == 3 {
                commit(&mut s);
            }
        }
        assert!(s.warms(), "keys have left memory");
        assert_eq!(
            asks(&s, 0).len(),
            1,
            "an evicted key is read from the engine"
        );
        assert_eq!(asks(&s, 39).len(), 0, "the last batch is in memory");
        assert_eq!(asks(&s, 200).len(), 0, "never written: the filter says so");
        s.stage(vec![1], Some(vec![9]));
        assert_eq!(asks(&s, 1).len(), 0, "staged");
        s.abort();

        // Read ahead, then looked up: the engine's value, taken once.
        let mut b = asks(&s, 2);
        s.warm_into(&[3], &mut b);
        b.read(|| Some(0));
        assert_eq!(s.get(&[2]).unwrap(), Some(vec![2]));
        assert_eq!(s.get(&[2]).unwrap(), Some(vec![2]));
        // Read ahead, then written and evicted before the lookup: the new value.
        let b = asks(&s, 5);
        b.read(|| Some(0));
        s.stage(vec![5], Some(vec![55]));
        commit(&mut s);
        for i in 100..120u8 {
            s.stage(vec![i], Some(vec![i]));
            if i % 4 == 3 {
                commit(&mut s);
            }
        }
        assert_eq!(asks(&s, 5).len(), 1, "the write of key 5 has left memory");
        assert_eq!(s.get(&[5]).unwrap(), Some(vec![55]));
        // A batch left memory since key 3 was read ahead: read again, same value.
        assert_eq!(s.get(&[3]).unwrap(), Some(vec![3]));
        // The memory engine's reads stay in memory: nothing to read ahead.
        let mem = StagedStore::new(
            MemoryBackend::default().open("m", 0).unwrap(),
            Some(Writer::spawn()),
        );
        assert!(!mem.warms());
    }

    /// The memory a run's summary reports grows where the keys go: in memory while they
    /// fit, then in the key filter and the engine's index once they leave it; the resident
    /// part stays bounded. The memory engine counts its entries' bytes.
    #[test]
    fn state_memory_follows_the_keys_by_part() {
        let dir = tempfile::tempdir().unwrap();
        let backend = SledBackend::open(dir.path()).unwrap();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), Some(Writer::spawn()))
            .with_limits(64, 64);
        assert_eq!(s.memory(true).0, StateMemory::default(), "nothing held yet");
        let mut offset = 0;
        let mut put = |s: &mut StagedStore, range: std::ops::Range<u32>| {
            for i in range {
                s.stage(i.to_be_bytes().to_vec(), Some(vec![7; 16]));
                if i % 32 == 31 {
                    offset += 1;
                    s.commit(Some(offset)).unwrap();
                    s.sync().unwrap();
                }
            }
        };
        put(&mut s, 0..32);
        let fits = s.memory(true).0;
        assert!(fits.resident >= 32 * 20, "32 entries of 20 bytes: {fits:?}");
        assert_eq!(fits.key_filter, 0, "no key has left memory: {fits:?}");
        put(&mut s, 32..4096);
        let left = s.memory(true).0;
        assert!(left.key_filter >= 4096 * 4, "a 4-byte hash a key: {left:?}");
        assert!(
            left.engine >= 4000 * 12,
            "sled's index: 12 bytes a key: {left:?}"
        );
        assert!(
            left.resident < 8 * fits.resident,
            "resident entries are bounded: {left:?} against {fits:?}"
        );
        put(&mut s, 4096..16384);
        let more = s.memory(true).0;
        assert!(
            more.key_filter > left.key_filter && more.engine > left.engine,
            "{more:?}"
        );

        let mem = MemoryBackend::default().open("m", 0).unwrap();
        mem.write(WriteBatch {
            ops: (0..1000u32)
                .map(|i| (i.to_be_bytes().to_vec(), Some(vec![1; 100])))
                .collect(),
            changelog_offset: None,
        })
        .unwrap();
        let bytes = mem.memory_bytes(true).unwrap();
        assert!(bytes >= 1000 * 104, "{bytes}");
    }

    #[test]
    fn closing_a_store_skips_unwritten_batches_and_never_stores_an_offset_ahead_of_its_data() {
        let backend = MemoryBackend::default();
        let writer = Writer::spawn();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), Some(writer.clone()));
        assert_eq!(
            s.known_len(),
            Some(0),
            "an empty engine: the count is known"
        );
        for i in 0..50u32 {
            for j in 0..2_500u32 {
                s.stage((i * 10_000 + j).to_be_bytes().to_vec(), Some(vec![1]));
            }
            s.commit(Some(i64::from(i) + 1)).unwrap();
        }
        assert_eq!(s.known_len(), Some(125_000));
        drop(s);
        let e = backend.open("s", 0).unwrap();
        let n = e.scan(None, usize::MAX).unwrap().len();
        let off = e.changelog_offset().unwrap().unwrap_or(0);
        assert!(n as i64 >= off * 2_500, "offset {off} ahead of {n} keys");
        // Reopened over a non-empty engine the count is unknown, and reads fall through.
        let s = StagedStore::new(backend.open("s", 0).unwrap(), Some(writer));
        if n > 0 {
            assert_eq!(s.known_len(), None);
            assert_eq!(s.get(&0u32.to_be_bytes()).unwrap(), Some(vec![1]));
        }
    }
}

#[cfg(test)]
mod empty_commit_tests {
    use super::*;

    /// A commit with no writes (every commit of a partition whose records were all
    /// duplicates, or that got none) must hold no memory once persisted: a long-running
    /// instance commits every 100 ms (exactly_once_v2), forever. It leaves the stored
    /// changelog offset alone: it wrote no changelog record.
    #[test]
    fn empty_commits_leave_nothing_in_memory_and_the_offset_alone() {
        let backend = MemoryBackend::default();
        let writer = Writer::spawn();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), Some(writer));
        s.stage(b"k".to_vec(), Some(b"v".to_vec()));
        s.commit(Some(1)).unwrap();
        for off in 2..20_000 {
            s.commit(Some(off)).unwrap();
        }
        s.sync().unwrap();
        s.commit(Some(20_000)).unwrap();
        let b = s.behind.as_ref().unwrap();
        assert!(
            b.resident.batches.len() <= 2,
            "{} batches held for 1 key",
            b.resident.batches.len()
        );
        assert_eq!(s.get(b"k").unwrap(), Some(b"v".to_vec()));
        assert_eq!(s.known_len(), Some(1));
        s.sync().unwrap();
        assert_eq!(s.engine().changelog_offset().unwrap(), Some(1));
    }

    /// The bug the zombie crash test caught (exactly_once_v2, two instances): a partition
    /// revoked right after a commit closes its store before the writer persisted that
    /// commit's batch, so the batch is skipped and the engine keeps the older offset (the
    /// next restore replays it). The partition comes back, and while it waits for its
    /// restore, the other partitions' commits commit its store too, with nothing staged
    /// and the producer's last changelog offset of that partition, from before the
    /// revocation. Storing that offset would skip the lost batch at the restore: its marks
    /// gone, its duplicates passing again.
    #[test]
    fn an_empty_commit_never_moves_the_offset_over_a_skipped_batch() {
        for engine in ["memory", "sled"] {
            let dir = tempfile::tempdir().unwrap();
            let backend: Box<dyn StateBackend> = match engine {
                "memory" => Box::new(MemoryBackend::default()),
                _ => Box::new(SledBackend::open(dir.path()).unwrap()),
            };
            let writer = Writer::spawn();
            let mut s = StagedStore::new(backend.open("s", 0).unwrap(), Some(writer.clone()));
            s.stage(b"a".to_vec(), Some(b"1".to_vec()));
            s.commit(Some(10)).unwrap();
            s.sync().unwrap();
            // The revocation's commit, never written: the store closes first.
            let hold = writer.hold();
            s.stage(b"b".to_vec(), Some(b"1".to_vec()));
            s.commit(Some(20)).unwrap();
            drop(s);
            drop(hold);
            // Back again; a commit of the other partitions, nothing staged here.
            let mut s = StagedStore::new(backend.open("s", 0).unwrap(), Some(writer.clone()));
            s.commit(Some(20)).unwrap();
            s.sync().unwrap();
            assert_eq!(
                s.engine().changelog_offset().unwrap(),
                Some(10),
                "{engine}: the offset must stay before the skipped batch, so the restore replays it"
            );
            assert_eq!(s.get(b"b").unwrap(), None, "{engine}");
        }
    }
}

#[cfg(test)]
mod filter_growth_tests {
    use super::*;

    /// The key-hash filter keeps the hash of every key put since the engine was empty,
    /// deleted ones included. A dedup store with distinct keys and a TTL (every key is put
    /// once and swept later) keeps few live keys but puts new ones forever: the filter must
    /// stay in proportion to the keys the store holds, not to every key it ever saw.
    #[test]
    fn the_key_filter_stays_bounded_by_the_live_keys() {
        let backend = MemoryBackend::default();
        let writer = Writer::spawn();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap(), Some(writer)).with_limits(3, 4);
        for i in 0u32..20_000 {
            s.stage(i.to_be_bytes().to_vec(), Some(vec![1]));
            if i >= 10 {
                s.stage((i - 10).to_be_bytes().to_vec(), None);
            }
            s.commit(Some(i64::from(i) + 1)).unwrap();
        }
        let held = match &s.behind.as_ref().unwrap().filter {
            KeyFilter::Hashes(f) => f.len(),
            _ => 0,
        };
        assert!(held <= 64, "{held} hashes held for 10 live keys");
        // Still exact: live keys found, swept ones gone.
        for i in 0u32..20_000 {
            let want = (i >= 19_990).then(|| vec![1]);
            assert_eq!(s.get(&i.to_be_bytes()).unwrap(), want, "key {i}");
        }
        assert_eq!(s.known_len(), Some(10));
    }
}

#[cfg(test)]
mod hold_tests {
    use super::*;

    /// A held writer writes nothing nobody waits for; a store over its backlog bound, or a
    /// sync, still gets its batches written (no deadlock); dropping the hold writes the rest.
    #[test]
    fn a_held_writer_writes_only_what_a_store_waits_for() {
        let backend = MemoryBackend::default();
        let writer = Writer::spawn();
        let hold = writer.hold();
        assert!(writer.is_held());
        let mut a = StagedStore::new(backend.open("a", 0).unwrap(), Some(writer.clone()))
            .with_limits(4, 100);
        a.stage(b"k1".to_vec(), Some(b"v".to_vec()));
        a.commit(Some(1)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let engine = backend.open("a", 0).unwrap();
        assert_eq!(engine.get(b"k1").unwrap(), None, "held: not written yet");
        assert_eq!(
            a.get(b"k1").unwrap(),
            Some(b"v".to_vec()),
            "readable from memory"
        );
        // Over the backlog bound: the commit waits, and the writer serves it.
        for i in 0..150u32 {
            a.stage(i.to_be_bytes().to_vec(), Some(vec![1]));
        }
        a.commit(Some(2)).unwrap();
        assert_eq!(
            engine.get(b"k1").unwrap(),
            Some(b"v".to_vec()),
            "written on demand"
        );
        a.stage(b"k2".to_vec(), Some(b"w".to_vec()));
        a.commit(Some(3)).unwrap();
        a.sync().unwrap();
        assert_eq!(
            engine.get(b"k2").unwrap(),
            Some(b"w".to_vec()),
            "a sync is served"
        );
        assert_eq!(engine.changelog_offset().unwrap(), Some(3));
        a.stage(b"k3".to_vec(), Some(b"x".to_vec()));
        a.commit(Some(4)).unwrap();
        drop(hold);
        assert!(!writer.is_held());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while engine.get(b"k3").unwrap().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(engine.get(b"k3").unwrap(), Some(b"x".to_vec()), "released");
    }
}

#[cfg(test)]
mod batch_per_commit_tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    /// An engine that records every engine write: its op count and changelog offset.
    struct Recording {
        inner: Arc<dyn KeyValueStore>,
        writes: StdMutex<Vec<(usize, Option<i64>)>>,
    }

    impl KeyValueStore for Recording {
        fn name(&self) -> &str {
            self.inner.name()
        }
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
            self.inner.get(key)
        }
        fn write(&self, batch: WriteBatch) -> Result<()> {
            let n = batch.ops.len();
            let off = batch.changelog_offset;
            self.inner.write(batch)?;
            self.writes.lock().unwrap().push((n, off));
            Ok(())
        }
        fn changelog_offset(&self) -> Result<Option<i64>> {
            self.inner.changelog_offset()
        }
        fn clear(&self) -> Result<()> {
            self.inner.clear()
        }
        fn scan(&self, after: Option<&[u8]>, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
            self.inner.scan(after, limit)
        }
    }

    /// DESIGN.md: the writes of one commit go into one engine batch together with the
    /// changelog offset they reached, written behind or not, and restored batches too.
    #[test]
    fn each_commit_is_one_engine_batch_carrying_its_offset() {
        for behind in [false, true] {
            let backend = MemoryBackend::default();
            let engine = Arc::new(Recording {
                inner: backend.open("s", 0).unwrap(),
                writes: StdMutex::new(Vec::new()),
            });
            let writer = behind.then(Writer::spawn);
            let mut s = StagedStore::new(engine.clone(), writer);
            let sizes = [5_000u32, 1, 12_345];
            for (i, n) in sizes.iter().enumerate() {
                for j in 0..*n {
                    s.stage(
                        (i as u32 * 100_000 + j).to_be_bytes().to_vec(),
                        Some(vec![1]),
                    );
                }
                s.commit(Some(i as i64 + 1)).unwrap();
            }
            for j in 0..3_000u32 {
                s.push_restored(&(900_000 + j).to_be_bytes(), Some(&[2]));
            }
            s.flush_restored(Some(10)).unwrap();
            s.sync().unwrap();
            let writes = engine.writes.lock().unwrap().clone();
            assert_eq!(
                writes,
                vec![
                    (5_000, Some(1)),
                    (1, Some(2)),
                    (12_345, Some(3)),
                    (3_000, Some(10))
                ],
                "write-behind: {behind}"
            );
        }
    }
}
