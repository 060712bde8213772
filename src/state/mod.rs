//! State stores: the [`KeyValueStore`] trait, its engines (memory, sled), and the staging
//! layer that keeps a commit's writes pending until the commit protocol says they may land.
//!
//! Layering, as in Kafka Streams: an engine (`memory`, `sled`) under a [`StagedStore`] that
//! buffers the writes of the open commit. A write reaches the engine only through
//! [`StagedStore::commit`], which the runtime calls after the outputs those writes stand for
//! are durable. Engines write one batch atomically, together with the changelog offset the
//! batch reached, so a crash leaves either the whole batch or none of it.

mod memory;
pub mod restore;
mod sled;
pub mod table;

pub use self::memory::{MemoryBackend, MemoryStore};
pub use self::sled::{SledBackend, SledStore, SledTable};

use crate::error::Result;
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};

/// The writes of one commit to one store, applied atomically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteBatch {
    /// Puts (`Some`) and deletes (`None`) in order; a later op on a key wins.
    pub ops: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    /// The changelog offset these writes reached, stored in the same batch (restore resumes
    /// from it). `None` leaves the stored offset as it was.
    pub changelog_offset: Option<i64>,
}

impl WriteBatch {
    /// Whether the batch has nothing to write.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.changelog_offset.is_none()
    }
}

/// A partition-local key-value store engine. Keys and values are raw bytes. Engines are
/// shared between the processing thread (reads) and the [`Writer`] (batches).
pub trait KeyValueStore: Send + Sync {
    /// Store name and partition, for messages, e.g. `dedup/3`.
    fn name(&self) -> &str;

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

    /// As [`KeyValueStore::write`], from shared buffers (puts and deletes in order, a later
    /// op on a key wins), with the number of keys the store holds after them when the
    /// caller knows it (stored in the same batch by engines that keep it, see
    /// [`KeyValueStore::key_count`]). The default copies the ops into a [`WriteBatch`] and
    /// ignores the count.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to write; nothing was applied then.
    fn write_ops(
        &self,
        ops: &[(Bytes, Option<Bytes>)],
        changelog_offset: Option<i64>,
        key_count: Option<u64>,
    ) -> Result<()> {
        let _ = key_count;
        self.write(WriteBatch {
            ops: ops
                .iter()
                .map(|(k, v)| (k.to_vec(), v.as_ref().map(|v| v.to_vec())))
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

    /// Up to `limit` entries in key order starting after `after` (from the start if `None`).
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to read.
    fn scan(&self, after: Option<&[u8]>, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>>;
}

/// Opens the engine of a (store, partition) pair and makes written batches durable.
pub trait StateBackend: Send + Sync {
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

/// An exclusive lock on a state dir (`<state.dir>/onceflow.lock`, flock), held for the life
/// of the value, so two processes on one state dir fail fast instead of sharing stores.
pub struct StateDirLock {
    _file: std::fs::File,
}

impl StateDirLock {
    /// Create `dir` if needed and lock it.
    ///
    /// # Errors
    /// [`crate::Error::State`] naming the dir and the pid holding it, when another process
    /// has it; [`crate::Error::Io`] when the dir or lock file cannot be created.
    pub fn acquire(dir: &std::path::Path) -> Result<StateDirLock> {
        use std::io::{Read, Seek, Write};
        use std::os::unix::io::AsRawFd;
        let io = |e: std::io::Error| crate::Error::Io {
            path: dir.display().to_string(),
            source: e,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let path = dir.join("onceflow.lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        // SAFETY: flock on a file descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(crate::Error::state(
                dir.display().to_string(),
                format!(
                    "state.dir is locked by another onceflow process (pid {}); give each instance its own state.dir",
                    holder.trim()
                ),
            ));
        }
        file.set_len(0).map_err(io)?;
        file.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
        write!(file, "{}", std::process::id()).map_err(io)?;
        Ok(StateDirLock { _file: file })
    }
}

/// Ops per engine write of the background writer: unbounded, so that the writes of one
/// commit go into one sled batch together with the changelog offset they reached (issue 3).
/// sled's `apply_batch` holds a lock that sled reads wait on, but lookups of committed
/// entries are answered from memory first (see [`RESIDENT_ENTRIES`]). A smaller value
/// splits a batch into chunks, only the last one carrying the offset (see [`Writer`]).
const WRITE_CHUNK: usize = usize::MAX;

/// Committed entries a write-behind store keeps readable in memory (per store partition)
/// once they are persisted; beyond it the oldest persisted batches leave memory and are
/// read from the engine again. About 200 bytes an entry for dedup entries.
pub const RESIDENT_ENTRIES: usize = 262_144;

/// Committed ops a write-behind store lets wait for the engine (per store partition);
/// beyond it [`StagedStore::commit`] waits for the writer, so the engine's write rate
/// bounds a sustained run while bursts up to this size run at memory speed.
pub const UNPERSISTED_OPS: usize = 262_144;

/// The writes of one commit: the ops in first-write order (a withdrawn op is replaced by
/// the last one), each key once with its last value, and an index from key to op. Iterating and committing walk the ops in order
/// without a lookup per key.
#[derive(Debug, Default)]
struct Staged {
    // ahash: keys come from the input, so a keyed hash, but faster than SipHash.
    index: HashMap<Bytes, usize, ahash::RandomState>,
    ops: Vec<(Bytes, Option<Bytes>)>,
}

impl Staged {
    fn with_capacity(n: usize) -> Staged {
        Staged {
            index: HashMap::with_capacity_and_hasher(n, ahash::RandomState::new()),
            ops: Vec::with_capacity(n),
        }
    }

    fn get(&self, key: &[u8]) -> Option<&Option<Bytes>> {
        self.index.get(key).map(|i| &self.ops[*i].1)
    }

    fn get_mut(&mut self, key: &[u8]) -> Option<&mut Option<Bytes>> {
        self.index.get(key).map(|i| &mut self.ops[*i].1)
    }

    fn insert_new(&mut self, key: Bytes, value: Option<Bytes>) {
        self.index.insert(key.clone(), self.ops.len());
        self.ops.push((key, value));
    }

    fn len(&self) -> usize {
        self.ops.len()
    }

    /// Take `key` out of the batch (its op is replaced by the last one: keys are unique
    /// in a batch, so their order carries no meaning).
    fn remove(&mut self, key: &[u8]) {
        let Some(i) = self.index.remove(key) else {
            return;
        };
        self.ops.swap_remove(i);
        if let Some((moved, _)) = self.ops.get(i) {
            if let Some(slot) = self.index.get_mut(moved) {
                *slot = i;
            }
        }
    }

    fn clear(&mut self) {
        self.index.clear();
        self.ops.clear();
    }
}

/// A staged write that stands for one source record (a dedup mark), kept until the commit
/// so that [`StagedStore::withdraw`] can take it back if that record is dead-lettered.
#[derive(Debug)]
struct Owned {
    /// Source offset of the record the write stands for.
    owner: i64,
    key: Bytes,
    /// The value staged.
    written: Option<Bytes>,
    /// What the batch held for the key before: `None` if nothing was staged for it.
    before: Option<Option<Bytes>>,
}

/// A staged write taken back by [`StagedStore::withdraw`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Withdrawn {
    /// Source offset of the record the write stood for.
    pub owner: i64,
    /// The key.
    pub key: Bytes,
    /// The value that was staged (`None`: a delete).
    pub written: Option<Bytes>,
}

/// How far the writer got with one store's batches.
#[derive(Debug, Default)]
struct Progress {
    /// Sequence number of the last batch fully written to the engine.
    persisted: u64,
    /// The writer is writing a chunk of this store now.
    busy: bool,
    /// The store was closed: the writer skips its remaining batches.
    stopped: bool,
    /// The first write failure; the writer writes nothing more of this store after it.
    error: Option<String>,
}

/// Progress shared between a store and the writer.
#[derive(Debug, Default)]
struct Shared {
    state: Mutex<Progress>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        // A panic while holding this lock leaves plain numbers behind: keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One committed batch for the writer.
struct Job {
    engine: Arc<dyn KeyValueStore>,
    shared: Arc<Shared>,
    seq: u64,
    ops: Ops,
    changelog_offset: Option<i64>,
    /// The store's key count before the batch and each op's change to it, when known.
    count: Option<(u64, Vec<i8>)>,
}

/// The background thread of a backend that writes committed batches to their engines, in
/// commit order per store, so neither processing nor restore waits on the engine's write
/// cost (sled: several microseconds a key here).
///
/// Durability: a batch is written as one engine batch (chunks of `WRITE_CHUNK` ops, only
/// the last chunk storing the batch's changelog offset), so the stored offset never runs
/// ahead of the data it stands for. A crash (or a closed store, whose remaining batches are
/// skipped) leaves the engine with a prefix of the batches and an older offset; the
/// restore replays the changelog from that offset in log order.
/// The thread runs at a lower CPU priority (nice 10) than processing and restore.
///
/// While a [`WriterHold`] is alive (the runtime takes one while any restore is in
/// progress) the writer starts no new batch unless some store waits for it (a store over
/// [`UNPERSISTED_OPS`], or a sync): on a small machine the restore then has the CPU, and
/// the backlog is written once the restore is done. Holding never changes what is
/// written or in which order, only when.
pub struct Writer {
    tx: Mutex<std::sync::mpsc::Sender<Job>>,
    gate: Arc<Gate>,
}

/// Holds and demands on the writer (see [`Writer`]).
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    /// Live [`WriterHold`]s.
    holds: usize,
    /// Stores waiting for the writer now.
    demand: usize,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Block while held and nobody waits for the writer.
    fn pass(&self) {
        let mut st = self.lock();
        while st.holds > 0 && st.demand == 0 {
            st = self
                .changed
                .wait_timeout(st, std::time::Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    fn add(&self, holds: isize, demand: isize) {
        let mut st = self.lock();
        st.holds = st.holds.saturating_add_signed(holds);
        st.demand = st.demand.saturating_add_signed(demand);
        drop(st);
        self.changed.notify_all();
    }
}

/// Keeps the [`Writer`] from starting batches nobody waits for, until dropped.
pub struct WriterHold {
    gate: Arc<Gate>,
}

impl Drop for WriterHold {
    fn drop(&mut self) {
        self.gate.add(-1, 0);
    }
}

/// A store waiting for the writer: overrides holds until dropped.
struct Demand<'a>(&'a Gate);

impl Drop for Demand<'_> {
    fn drop(&mut self) {
        self.0.add(0, -1);
    }
}

impl Writer {
    /// Start the writer thread; it ends when the last handle is dropped.
    ///
    /// # Panics
    /// When the OS refuses to start a thread.
    pub fn spawn() -> Arc<Writer> {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let gate = Arc::new(Gate::default());
        let g = gate.clone();
        std::thread::Builder::new()
            .name("onceflow-state-writer".into())
            .spawn(move || {
                lower_thread_priority();
                for job in rx {
                    g.pass();
                    write_job(job);
                }
            })
            .expect("spawn the state writer thread");
        Arc::new(Writer {
            tx: Mutex::new(tx),
            gate,
        })
    }

    /// Hold the writer back until the returned guard is dropped (see [`Writer`]).
    pub fn hold(&self) -> WriterHold {
        self.gate.add(1, 0);
        WriterHold {
            gate: self.gate.clone(),
        }
    }

    /// Whether any [`WriterHold`] is alive.
    pub fn is_held(&self) -> bool {
        self.gate.lock().holds > 0
    }

    fn demand(&self) -> Demand<'_> {
        self.gate.add(0, 1);
        Demand(&self.gate)
    }

    fn submit(&self, job: Job) -> std::result::Result<(), ()> {
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| ())
    }
}

#[cfg(target_os = "linux")]
fn lower_thread_priority() {
    // SAFETY: plain syscalls on this thread's own id; a failure only keeps the priority.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_thread_priority() {}

fn write_job(job: Job) {
    let n = job.ops.len();
    let mut at: usize = 0;
    loop {
        let end = at.saturating_add(WRITE_CHUNK).min(n);
        let last = end == n;
        {
            let mut st = job.shared.lock();
            if st.stopped || st.error.is_some() {
                return;
            }
            st.busy = true;
        }
        let offset = if last { job.changelog_offset } else { None };
        // The count after this chunk, stored with it: always consistent with the data.
        let count = job.count.as_ref().map(|(base, deltas)| {
            let d: i64 = deltas[..end].iter().map(|d| i64::from(*d)).sum();
            base.saturating_add_signed(d)
        });
        let result = job.engine.write_ops(&job.ops[at..end], offset, count);
        let mut st = job.shared.lock();
        st.busy = false;
        if let Err(e) = result {
            st.error = Some(e.to_string());
        } else if last {
            st.persisted = job.seq;
        }
        drop(st);
        job.shared.changed.notify_all();
        if last {
            return;
        }
        at = end;
    }
}

/// Identity hasher for the key-hash filter (its values are already hashes).
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type HashFilter = std::collections::HashSet<u64, std::hash::BuildHasherDefault<IdHasher>>;

/// Which keys that are not held in memory a write-behind store's engine may hold.
enum Filter {
    /// The engine had data when the store was opened: any key.
    Unknown,
    /// The engine was empty when opened and no batch has left memory since: every key put
    /// since is held in memory, so none.
    Overlay,
    /// The engine was empty when opened and batches have left memory since: hashes of
    /// every key put since, so a key never put is answered without reading the engine. No
    /// false negatives (deletes leave their hash; a hash collision only costs an engine
    /// read). Built from the keys in memory when the first batch leaves it.
    Hashes(HashFilter),
}

/// Hashes the key filter may hold beyond four times the store's keys before it is rebuilt.
const FILTER_SLACK: usize = 1024;

/// The ops of one committed batch, shared by the writer and the eviction bookkeeping.
type Ops = Arc<Vec<(Bytes, Option<Bytes>)>>;

/// A committed batch still tracked in memory: its ops, for eviction once persisted.
struct Tracked {
    seq: u64,
    ops: Ops,
}

/// Where the latest committed op of a resident key is: its batch (the batch's number in
/// [`Resident`], which counts resident batches only, wrapping) and its position in that
/// batch's ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    seq: u32,
    idx: u32,
}

/// The committed batches held in memory, oldest first, and an index from each resident
/// key to its latest op. The index holds 8 bytes a key; keys and values stay in their
/// batch's ops (shared with the writer), so a restore writes each record once.
///
/// A batch without ops (a commit that only moves the changelog offset) is not held: it
/// has no key to index, and an instance commits one per interval for every partition
/// that had nothing new to write, forever.
struct Resident {
    batches: VecDeque<Tracked>,
    /// Number of the front batch (the next one pushed when empty); batches are numbered
    /// consecutively in push order, wrapping at u32::MAX.
    first: u32,
    index: hashbrown::HashTable<Slot>,
    hash: ahash::RandomState,
    /// Ops held by `batches`.
    ops: usize,
}

impl Resident {
    fn new() -> Resident {
        Resident {
            batches: VecDeque::new(),
            first: 0,
            index: hashbrown::HashTable::new(),
            hash: ahash::RandomState::new(),
            ops: 0,
        }
    }

    /// The op a slot points at (`first`: the front batch's number). Slots only point into
    /// resident batches, whose numbers are consecutive.
    fn op(batches: &VecDeque<Tracked>, first: u32, s: Slot) -> &(Bytes, Option<Bytes>) {
        &batches[s.seq.wrapping_sub(first) as usize].ops[s.idx as usize]
    }

    fn find(&self, key: &[u8]) -> Option<&(Bytes, Option<Bytes>)> {
        let h = self.hash.hash_one(key);
        let (batches, first) = (&self.batches, self.first);
        self.index
            .find(h, |s| Self::op(batches, first, *s).0[..] == *key)
            .map(|s| Self::op(batches, first, *s))
    }

    /// The latest committed value of `key` if it is resident (`Some(None)`: deleted).
    fn get(&self, key: &[u8]) -> Option<&Option<Bytes>> {
        self.find(key).map(|(_, v)| v)
    }

    fn contains(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }

    /// Resident keys.
    fn len(&self) -> usize {
        self.index.len()
    }

    /// Every resident key with its latest value.
    fn iter(&self) -> impl Iterator<Item = &(Bytes, Option<Bytes>)> {
        let (batches, first) = (&self.batches, self.first);
        self.index.iter().map(move |s| Self::op(batches, first, *s))
    }

    fn reserve(&mut self, n: usize) {
        let (batches, first, hash) = (&self.batches, self.first, &self.hash);
        self.index
            .reserve(n, |s| hash.hash_one(&Self::op(batches, first, *s).0[..]));
    }

    /// Append batch `seq` and point its keys at it; `each` sees every op in order with
    /// whether its key was resident before and then held a value.
    fn push(
        &mut self,
        seq: u64,
        ops: Ops,
        mut each: impl FnMut(&Bytes, &Option<Bytes>, Option<bool>) -> Result<()>,
    ) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let no = self.first.wrapping_add(self.batches.len() as u32);
        self.ops += ops.len();
        self.batches.push_back(Tracked {
            seq,
            ops: ops.clone(),
        });
        let (batches, first) = (&self.batches, self.first);
        let (hash, index) = (&self.hash, &mut self.index);
        for (i, (k, v)) in ops.iter().enumerate() {
            let slot = Slot {
                seq: no,
                idx: i as u32,
            };
            let h = hash.hash_one(&k[..]);
            let old = match index.find_mut(h, |s| Self::op(batches, first, *s).0 == *k) {
                Some(s) => {
                    let was = Self::op(batches, first, *s).1.is_some();
                    *s = slot;
                    Some(was)
                }
                None => {
                    index.insert_unique(h, slot, |s| {
                        hash.hash_one(&Self::op(batches, first, *s).0[..])
                    });
                    None
                }
            };
            each(k, v, old)?;
        }
        Ok(())
    }

    /// Drop the oldest batch, and the keys whose latest op is in it.
    fn pop_front(&mut self) {
        let Some(b) = self.batches.front() else {
            return;
        };
        let (hash, index) = (&self.hash, &mut self.index);
        let seq = self.first;
        for (i, (k, _)) in b.ops.iter().enumerate() {
            let at = Slot { seq, idx: i as u32 };
            if let Ok(e) = index.find_entry(hash.hash_one(&k[..]), |s| *s == at) {
                e.remove();
            }
        }
        if let Some(b) = self.batches.pop_front() {
            self.ops -= b.ops.len();
            self.first = self.first.wrapping_add(1);
        }
    }
}

/// The write-behind side of a store: committed writes readable in memory until the writer
/// has persisted them (and, up to [`RESIDENT_ENTRIES`], after).
struct Behind {
    writer: Arc<Writer>,
    shared: Arc<Shared>,
    /// Committed batches in order, oldest first, until evicted, and the latest committed
    /// value of each resident key.
    resident: Resident,
    /// Sequence number of the last batch handed to the writer.
    seq: u64,
    /// Which keys not held in memory may be in the engine.
    filter: Filter,
    filter_hash: ahash::RandomState,
    /// Number of keys in the committed state, when known (the engine was empty at open).
    known_len: Option<u64>,
    /// [`RESIDENT_ENTRIES`] and [`UNPERSISTED_OPS`] (smaller in tests).
    resident_max: usize,
    unpersisted_max: usize,
    /// [`FILTER_SLACK`] (0 in tests, so that the model tests rebuild the filter often).
    filter_slack: usize,
}

impl Behind {
    fn new(writer: Arc<Writer>, engine: &dyn KeyValueStore) -> Behind {
        let mut b = Behind {
            writer,
            shared: Arc::new(Shared::default()),
            resident: Resident::new(),
            seq: 0,
            filter: Filter::Unknown,
            filter_hash: ahash::RandomState::new(),
            known_len: None,
            resident_max: RESIDENT_ENTRIES,
            unpersisted_max: UNPERSISTED_OPS,
            filter_slack: FILTER_SLACK,
        };
        b.reload(engine);
        b
    }

    /// Forget the memory copy (everything must be persisted) and look at the engine again.
    fn reload(&mut self, engine: &dyn KeyValueStore) {
        self.resident = Resident::new();
        let empty = matches!(engine.scan(None, 1), Ok(v) if v.is_empty());
        self.filter = if empty {
            Filter::Overlay
        } else {
            Filter::Unknown
        };
        self.known_len = if empty {
            Some(0)
        } else {
            engine.key_count().ok().flatten()
        };
    }

    /// Whether `key`, not held in memory, may be in the engine.
    fn may_be_in_engine(&self, key: &[u8]) -> bool {
        match &self.filter {
            Filter::Unknown => true,
            Filter::Overlay => false,
            Filter::Hashes(f) => f.contains(&self.filter_hash.hash_one(key)),
        }
    }

    fn error(&self, store: &str) -> Result<()> {
        match &self.shared.lock().error {
            None => Ok(()),
            Some(e) => Err(crate::Error::state(
                store,
                format!("the background write to the store failed: {e}"),
            )),
        }
    }

    /// Make `ops` the committed state in memory and hand them to the writer.
    fn submit(
        &mut self,
        engine: &Arc<dyn KeyValueStore>,
        ops: Vec<(Bytes, Option<Bytes>)>,
        changelog_offset: Option<i64>,
    ) -> Result<()> {
        self.error(engine.name())?;
        self.seq += 1;
        let seq = self.seq;
        let mut count = self.known_len.map(|n| (n, Vec::with_capacity(ops.len())));
        let ops = Arc::new(ops);
        let (filter, filter_hash) = (&mut self.filter, &self.filter_hash);
        self.resident.push(seq, ops.clone(), |k, v, old| {
            if let Some((_, deltas)) = &mut count {
                let existed = match old {
                    Some(was) => Some(was),
                    None => match filter {
                        // Every key put since the engine was empty is in memory.
                        Filter::Overlay => Some(false),
                        // Hashes of every key put since the engine was empty: a miss is
                        // exact; a hit (a key already written behind) reads the engine.
                        Filter::Hashes(f) => Some(
                            f.contains(&filter_hash.hash_one(&k[..])) && engine.get(k)?.is_some(),
                        ),
                        // An engine with older data: knowing would take an engine read per
                        // op (a restore into it would crawl), so the count becomes unknown
                        // (a caller that needs it scans the engine after a sync).
                        Filter::Unknown => None,
                    },
                };
                match existed {
                    Some(existed) => deltas.push(i8::from(v.is_some()) - i8::from(existed)),
                    None => count = None,
                }
            }
            if v.is_some() {
                if let Filter::Hashes(f) = filter {
                    f.insert(filter_hash.hash_one(&k[..]));
                }
            }
            Ok(())
        })?;
        self.known_len = count.as_ref().map(|(base, deltas)| {
            let d: i64 = deltas.iter().map(|d| i64::from(*d)).sum();
            base.saturating_add_signed(d)
        });
        let job = Job {
            engine: engine.clone(),
            shared: self.shared.clone(),
            seq,
            ops,
            changelog_offset,
            count,
        };
        if self.writer.submit(job).is_err() {
            return Err(crate::Error::state(
                engine.name(),
                "the state writer thread is gone",
            ));
        }
        self.maintain(engine.name())?;
        self.trim_filter(engine.as_ref())
    }

    /// Rebuild the key-hash filter from the keys the store holds (engine and memory) once it
    /// holds more than four times as many hashes as there are keys (and the resident
    /// bound): deleted keys leave their hash behind, so a store that puts new keys and
    /// sweeps old ones would otherwise grow it forever. One engine scan of the live keys per
    /// three times as many new puts: amortised constant work per put. No false negatives: a key not in memory has its latest write
    /// persisted, so the scan sees it; one written meanwhile is in memory.
    ///
    /// # Errors
    /// The engine's read error.
    fn trim_filter(&mut self, engine: &dyn KeyValueStore) -> Result<()> {
        let Filter::Hashes(f) = &self.filter else {
            return Ok(());
        };
        let Some(live) = self.known_len else {
            return Ok(());
        };
        let live = usize::try_from(live).unwrap_or(usize::MAX);
        let bound = live
            .max(self.resident_max)
            .saturating_mul(4)
            .saturating_add(self.filter_slack);
        if f.len() <= bound {
            return Ok(());
        }
        let mut fresh = HashFilter::default();
        fresh.reserve(live.saturating_add(self.resident.len()));
        for (k, _) in self.resident.iter() {
            fresh.insert(self.filter_hash.hash_one(&k[..]));
        }
        let mut after: Option<Vec<u8>> = None;
        loop {
            let chunk = engine.scan(after.as_deref(), 10_000)?;
            for (k, _) in &chunk {
                fresh.insert(self.filter_hash.hash_one(&k[..]));
            }
            if chunk.len() < 10_000 {
                break;
            }
            after = chunk.last().map(|(k, _)| k.clone());
        }
        self.filter = Filter::Hashes(fresh);
        Ok(())
    }

    /// Evict persisted batches past the memory bound; wait for the writer while too much
    /// is unpersisted.
    fn maintain(&mut self, store: &str) -> Result<()> {
        loop {
            let persisted = {
                let st = self.shared.lock();
                if let Some(e) = &st.error {
                    return Err(crate::Error::state(
                        store,
                        format!("the background write to the store failed: {e}"),
                    ));
                }
                st.persisted
            };
            while self.resident.len() > self.resident_max
                || self.resident.ops > 2 * self.resident_max
            {
                match self.resident.batches.front() {
                    Some(b) if b.seq <= persisted => {}
                    _ => break,
                }
                if matches!(self.filter, Filter::Overlay) {
                    // Keys are about to leave memory: from now on remember their hashes.
                    let mut f = HashFilter::default();
                    f.reserve(self.resident.len());
                    for (k, _) in self.resident.iter() {
                        f.insert(self.filter_hash.hash_one(&k[..]));
                    }
                    self.filter = Filter::Hashes(f);
                }
                self.resident.pop_front();
            }
            let unpersisted: usize = self
                .resident
                .batches
                .iter()
                .rev()
                .take_while(|b| b.seq > persisted)
                .map(|b| b.ops.len())
                .sum();
            if unpersisted <= self.unpersisted_max {
                return Ok(());
            }
            let _demand = self.writer.demand();
            let st = self.shared.lock();
            if st.persisted == persisted && st.error.is_none() {
                let _ = self
                    .shared
                    .changed
                    .wait_timeout(st, std::time::Duration::from_millis(100));
            }
        }
    }

    /// Wait until every submitted batch is persisted.
    fn sync(&self, store: &str) -> Result<()> {
        let _demand = self.writer.demand();
        let mut st = self.shared.lock();
        loop {
            if let Some(e) = &st.error {
                return Err(crate::Error::state(
                    store,
                    format!("the background write to the store failed: {e}"),
                ));
            }
            if st.persisted >= self.seq {
                return Ok(());
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, std::time::Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Stop the writer on this store: its unwritten batches are skipped; returns once no
    /// chunk of this store is being written.
    fn stop(&self) {
        let mut st = self.shared.lock();
        st.stopped = true;
        while st.busy {
            st = self
                .shared
                .changed
                .wait(st)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A store with the writes of the open commit kept pending in memory.
///
/// Reads see pending writes first, so lookups within a batch see the batch's own entries;
/// then the committed state: with a background [`Writer`] (write-behind), committed batches
/// stay readable in memory while the writer persists them, in order, and a key never put
/// since the engine was found empty is answered from memory alone; then the engine.
/// [`StagedStore::commit`] makes the pending writes committed (through the writer, or by a
/// synchronous engine write without one); [`StagedStore::abort`] drops them.
///
/// Write-behind keeps the commit protocol: a batch becomes committed only when the runtime
/// commits it (after its outputs and changelog records are durable), and the engine gets
/// committed batches only, in order, each chunk's checkpoint never ahead of its data. What
/// the engine has not persisted at a crash or when the store is closed is restored from the
/// changelog (its stored offset is older). Memory: at most [`UNPERSISTED_OPS`] ops wait
/// for the engine (then commit waits), and persisted entries stay resident up to
/// [`RESIDENT_ENTRIES`].
pub struct StagedStore {
    inner: Arc<dyn KeyValueStore>,
    pending: Staged,
    behind: Option<Behind>,
    arena: Arena,
    /// Changelog records of the restore step in progress.
    restored: Vec<(Bytes, Option<Bytes>)>,
    /// The staged writes that stand for a source record, in staging order.
    owned: Vec<Owned>,
    /// Sealed batches (commits in flight, oldest first) with their commit epoch: no longer
    /// staged, not yet committed, readable.
    sealed: std::collections::VecDeque<(u64, Staged)>,
}

/// Keys and values copied into shared blocks: one allocation per block instead of one per
/// buffer, and clones (pending map, in-memory state, writer) are reference counts. A block
/// lives while any buffer cut from it does.
struct Arena {
    block: bytes::BytesMut,
}

/// Size of an arena block.
const ARENA_BLOCK: usize = 64 * 1024;

impl Arena {
    fn new() -> Arena {
        Arena {
            block: bytes::BytesMut::new(),
        }
    }

    fn copy(&mut self, data: &[u8]) -> Bytes {
        if self.block.capacity() - self.block.len() < data.len() {
            self.block = bytes::BytesMut::with_capacity(ARENA_BLOCK.max(data.len()));
        }
        self.block.extend_from_slice(data);
        self.block.split().freeze()
    }
}

impl StagedStore {
    /// Wrap an engine; committed batches are written behind by `writer` if given, else
    /// synchronously.
    pub fn new(inner: Arc<dyn KeyValueStore>, writer: Option<Arc<Writer>>) -> Self {
        let behind = writer.map(|w| Behind::new(w, inner.as_ref()));
        StagedStore {
            inner,
            pending: Staged::with_capacity(4096),
            behind,
            arena: Arena::new(),
            restored: Vec::new(),
            owned: Vec::new(),
            sealed: std::collections::VecDeque::new(),
        }
    }

    /// Name of the underlying store.
    pub fn name(&self) -> &str {
        self.inner.name()
    }

    #[cfg(test)]
    fn with_limits(mut self, resident: usize, unpersisted: usize) -> Self {
        if let Some(b) = &mut self.behind {
            b.resident_max = resident;
            b.unpersisted_max = unpersisted;
            b.filter_slack = 0;
        }
        self
    }

    /// Start the write-behind batch numbering (the writer's and the resident one) at `seq`
    /// (tests of its wrap-around in [`Slot`]); nothing must have been committed yet. A
    /// reopen starts the resident numbering at 0 again.
    #[cfg(test)]
    fn with_seq(mut self, seq: u64) -> Self {
        if let Some(b) = &mut self.behind {
            b.seq = seq;
            b.shared.lock().persisted = seq;
            b.resident.first = seq as u32;
        }
        self
    }

    /// Read `key`: pending writes, then sealed batches (newest first), then committed
    /// writes in memory, then the engine.
    ///
    /// # Errors
    /// As [`KeyValueStore::get`].
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.lookup(key)?.map(|b| b.to_vec()))
    }

    /// As [`StagedStore::get`], without copying values held in memory.
    ///
    /// # Errors
    /// As [`KeyValueStore::get`].
    pub fn lookup(&self, key: &[u8]) -> Result<Option<Bytes>> {
        if let Some(v) = self.pending.get(key) {
            return Ok(v.clone());
        }
        for (_, s) in self.sealed.iter().rev() {
            if let Some(v) = s.get(key) {
                return Ok(v.clone());
            }
        }
        if let Some(b) = &self.behind {
            if let Some(v) = b.resident.get(key) {
                return Ok(v.clone());
            }
            if !b.may_be_in_engine(key) {
                return Ok(None);
            }
        }
        Ok(self.inner.get(key)?.map(Bytes::from))
    }

    /// Stage a put (`Some`) or delete (`None`) of `key`.
    pub fn stage(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        self.stage_copy(&key, value.as_deref());
    }

    /// As [`StagedStore::stage`], copying `key` and `value` into the store's own buffers.
    pub fn stage_copy(&mut self, key: &[u8], value: Option<&[u8]>) {
        let value = value.map(|v| self.arena.copy(v));
        if let Some(v) = self.pending.get_mut(key) {
            *v = value;
            return;
        }
        let key = self.arena.copy(key);
        self.pending.insert_new(key, value);
    }

    /// As [`StagedStore::stage`], with shared buffers.
    pub fn stage_bytes(&mut self, key: Bytes, value: Option<Bytes>) {
        match self.pending.get_mut(&key) {
            Some(v) => *v = value,
            None => self.pending.insert_new(key, value),
        }
    }

    /// As [`StagedStore::stage_copy`], for a write that stands for the source record at
    /// offset `owner` (a dedup mark): until the commit, [`StagedStore::withdraw`] can take
    /// it back if that record ends in the dead-letter topic.
    pub fn stage_for(&mut self, owner: i64, key: &[u8], value: Option<&[u8]>) {
        let written = value.map(|v| self.arena.copy(v));
        let (key, before) = match self.pending.index.get(key) {
            Some(&i) => {
                let op = &mut self.pending.ops[i];
                let before = std::mem::replace(&mut op.1, written.clone());
                (op.0.clone(), Some(before))
            }
            None => {
                let key = self.arena.copy(key);
                self.pending.insert_new(key.clone(), written.clone());
                (key, None)
            }
        };
        self.owned.push(Owned {
            owner,
            key,
            written,
            before,
        });
    }

    /// Take back the writes staged with [`StagedStore::stage_for`] for the source record
    /// at offset `owner`, which was dead-lettered: each key gets back what the batch held
    /// for it before (nothing staged, or the earlier staged value), so the commit writes
    /// no changelog record and no engine write for it. A write that a later one replaced
    /// (the key written again since) stays replaced, and the later write, if withdrawn in
    /// turn, goes back to what the key held before both. Returns the writes taken back.
    pub fn withdraw(&mut self, owner: i64) -> Vec<Withdrawn> {
        let mut out = Vec::new();
        if !self.owned.iter().any(|o| o.owner == owner) {
            return out;
        }
        let mut i = self.owned.len();
        while i > 0 {
            i -= 1;
            if self.owned[i].owner != owner {
                continue;
            }
            let o = self.owned.remove(i);
            if self.pending.get(&o.key) == Some(&o.written) {
                match &o.before {
                    None => self.pending.remove(&o.key),
                    Some(v) => {
                        if let Some(slot) = self.pending.get_mut(&o.key) {
                            *slot = v.clone();
                        }
                    }
                }
                out.push(Withdrawn {
                    owner,
                    key: o.key,
                    written: o.written,
                });
            } else {
                // Replaced since: the later writes of the key now stand on what this one
                // stood on.
                for later in self.owned[i..].iter_mut() {
                    if later.key == o.key && later.before.as_ref() == Some(&o.written) {
                        later.before = o.before.clone();
                    }
                }
            }
        }
        out
    }

    /// Forget which source records the staged writes stand for: they can no longer be
    /// withdrawn (the task calls it after each record when no stage can fail a record
    /// later, at the commit).
    pub fn settle(&mut self) {
        self.owned.clear();
    }

    /// Whether a write of `key` is staged (in the open commit).
    pub fn is_staged(&self, key: &[u8]) -> bool {
        self.pending.get(key).is_some()
    }

    /// Number of staged keys.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Number of keys in the committed state, when the store knows it without a scan (a
    /// write-behind store whose engine was empty when opened, or keeps the count with its
    /// data as sled does).
    pub fn known_len(&self) -> Option<u64> {
        self.behind.as_ref().and_then(|b| b.known_len)
    }

    /// The staged writes in first-write order (but see [`StagedStore::withdraw`]), without
    /// removing them.
    pub fn pending(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        self.pending.ops.iter().map(|(k, v)| (&k[..], v.as_deref()))
    }

    /// Visit every entry of the committed state once (staged writes excluded): the
    /// engine's entries not changed since they were written, then the newer ones held in
    /// memory. Needs no wait for the writer: an entry it writes meanwhile is still held in
    /// memory (nothing leaves memory during the visit), so it is visited from there.
    ///
    /// # Errors
    /// An engine read failure, or the first error `f` returns.
    pub fn for_each_committed(&self, mut f: impl FnMut(&[u8], &[u8]) -> Result<()>) -> Result<()> {
        let shadowed = |k: &[u8]| self.behind.as_ref().is_some_and(|b| b.resident.contains(k));
        let mut after: Option<Vec<u8>> = None;
        loop {
            let chunk = self.inner.scan(after.as_deref(), 10_000)?;
            for (k, v) in &chunk {
                if !shadowed(k) {
                    f(k, v)?;
                }
            }
            if chunk.len() < 10_000 {
                break;
            }
            after = chunk.last().map(|(k, _)| k.clone());
        }
        if let Some(b) = &self.behind {
            for (k, v) in b.resident.iter() {
                if let Some(v) = v {
                    f(k, v)?;
                }
            }
        }
        Ok(())
    }

    /// Wait until every committed batch is written to the engine (so
    /// [`StagedStore::engine`] shows the whole committed state).
    ///
    /// # Errors
    /// The engine's write error.
    pub fn sync(&mut self) -> Result<()> {
        match &self.behind {
            None => Ok(()),
            Some(b) => b.sync(self.inner.name()),
        }
    }

    /// Make the staged writes committed, as one batch with `changelog_offset`.
    ///
    /// # Errors
    /// As [`KeyValueStore::write`] (for this batch or, written behind, an earlier one); the
    /// staged writes are dropped either way, since the runtime stops or rewinds on any
    /// failure.
    pub fn commit(&mut self, changelog_offset: Option<i64>) -> Result<()> {
        let cap = self.pending.len().clamp(4096, 1 << 20);
        let staged = std::mem::replace(&mut self.pending, Staged::with_capacity(cap));
        self.owned.clear();
        if staged.ops.is_empty() && changelog_offset.is_none() {
            return match &self.behind {
                Some(b) => b.error(self.inner.name()),
                None => Ok(()),
            };
        }
        let ops = staged.ops;
        match &mut self.behind {
            Some(b) => b.submit(&self.inner, ops, changelog_offset),
            None => self.inner.write_ops(&ops, changelog_offset, None),
        }
    }

    /// Seal the staged writes as the batch of commit `epoch` (a commit in flight, see
    /// `runtime::commit`): they stay readable, can no longer be withdrawn, and are written
    /// by [`StagedStore::commit_sealed`] once their changelog records are durable; new
    /// writes are staged in a fresh batch meanwhile. Nothing staged: nothing sealed.
    pub fn seal(&mut self, epoch: u64) {
        self.owned.clear();
        if self.pending.ops.is_empty() {
            return;
        }
        let cap = self.pending.len().clamp(4096, 1 << 20);
        let staged = std::mem::replace(&mut self.pending, Staged::with_capacity(cap));
        self.sealed.push_back((epoch, staged));
    }

    /// The writes sealed for commit `epoch` (none unless it is the oldest sealed batch), in
    /// first-write order.
    pub fn sealed(&self, epoch: u64) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        self.sealed
            .front()
            .filter(|(e, _)| *e == epoch)
            .into_iter()
            .flat_map(|(_, s)| s.ops.iter().map(|(k, v)| (&k[..], v.as_deref())))
    }

    /// Make the batch sealed for commit `epoch` (if any: it must be the oldest) committed,
    /// as one batch with `changelog_offset`; as [`StagedStore::commit`].
    ///
    /// # Errors
    /// As [`StagedStore::commit`].
    pub fn commit_sealed(&mut self, epoch: u64, changelog_offset: Option<i64>) -> Result<()> {
        let ops = match self.sealed.front() {
            Some((e, _)) if *e == epoch => self.sealed.pop_front().map(|(_, s)| s.ops),
            _ => None,
        }
        .unwrap_or_default();
        if ops.is_empty() && changelog_offset.is_none() {
            return match &self.behind {
                Some(b) => b.error(self.inner.name()),
                None => Ok(()),
            };
        }
        match &mut self.behind {
            Some(b) => b.submit(&self.inner, ops, changelog_offset),
            None => self.inner.write_ops(&ops, changelog_offset, None),
        }
    }

    /// Number of sealed batches (commits in flight holding writes of this store).
    pub fn sealed_len(&self) -> usize {
        self.sealed.len()
    }

    /// Write a restored batch (changelog records in log order, with the position reached):
    /// committed at once, and persisted by the writer when there is one, else written now.
    /// Nothing must be staged meanwhile.
    ///
    /// # Errors
    /// The engine's write error (for this batch or, written behind, an earlier one).
    pub fn write_restored(&mut self, batch: WriteBatch) -> Result<()> {
        for (k, v) in &batch.ops {
            self.push_restored(k, v.as_deref());
        }
        self.flush_restored(batch.changelog_offset)
    }

    /// Add one changelog record (in log order) to the restored batch being built; copied.
    /// Nothing must be staged meanwhile.
    pub fn push_restored(&mut self, key: &[u8], value: Option<&[u8]>) {
        if self.restored.capacity() == 0 {
            self.restored.reserve(4096);
        }
        let k = self.arena.copy(key);
        let v = value.map(|v| self.arena.copy(v));
        self.restored.push((k, v));
    }

    /// Number of records added by [`StagedStore::push_restored`] since the last flush.
    pub fn restored_len(&self) -> usize {
        self.restored.len()
    }

    /// Write the records added by [`StagedStore::push_restored`] as one restored batch
    /// with `changelog_offset` (the position reached): see [`StagedStore::write_restored`].
    ///
    /// # Errors
    /// As [`StagedStore::write_restored`].
    pub fn flush_restored(&mut self, changelog_offset: Option<i64>) -> Result<()> {
        // The next step is likely as big as this one: no regrowing while it is read.
        let cap = self.restored.len();
        let ops = std::mem::replace(&mut self.restored, Vec::with_capacity(cap));
        match &mut self.behind {
            Some(b) => b.submit(&self.inner, ops, changelog_offset),
            None => self.inner.write_ops(&ops, changelog_offset, None),
        }
    }

    /// Make room in memory for `n` more committed keys (a restore about to write them).
    pub fn reserve(&mut self, n: usize) {
        if let Some(b) = &mut self.behind {
            let n = n.min(b.resident_max);
            b.resident.reserve(n);
            if let Filter::Hashes(f) = &mut b.filter {
                f.reserve(n);
            }
        }
    }

    /// Drop the staged and sealed writes (the commit failed or was aborted).
    pub fn abort(&mut self) {
        self.pending.clear();
        self.owned.clear();
        self.sealed.clear();
    }

    /// Forget what is held in memory of the committed state and look at the engine again;
    /// call after [`StagedStore::sync`] when the engine was changed directly (a restore
    /// plan that cleared it).
    pub fn reload(&mut self) {
        if let Some(b) = &mut self.behind {
            b.reload(self.inner.as_ref());
        }
    }

    /// The engine under the staging layer (restore and scans use it directly; call
    /// [`StagedStore::sync`] first to see every committed batch).
    pub fn engine(&self) -> &dyn KeyValueStore {
        self.inner.as_ref()
    }
}

impl Drop for StagedStore {
    fn drop(&mut self) {
        // Closing never waits for the engine: batches not yet written are skipped (the
        // engine's offset is older, so the next restore replays them from the changelog).
        if let Some(b) = &self.behind {
            b.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        for op in ops {
            match op {
                Op::Stage(k, v) => {
                    s.stage(vec![k], v.map(|v| vec![v]));
                    staged.insert(k, v);
                }
                Op::Commit => {
                    offset += 1;
                    s.commit(Some(offset)).unwrap();
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
                    let all: Vec<(Vec<u8>, Vec<u8>)> = engine.scan(None, usize::MAX).unwrap();
                    let want: Vec<(Vec<u8>, Vec<u8>)> = committed
                        .iter()
                        .map(|(k, v)| (vec![*k], vec![*v]))
                        .collect();
                    proptest::prop_assert_eq!(all, want);
                    if offset > 0 {
                        proptest::prop_assert_eq!(engine.changelog_offset().unwrap(), Some(offset));
                    }
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

    /// A commit with no writes but a changelog offset (every commit of a partition whose
    /// records were all duplicates, or that got none, once it has written a changelog
    /// record) stores the offset, but must hold no memory once persisted: a long-running
    /// instance commits every 100 ms (exactly_once_v2), forever.
    #[test]
    fn empty_commits_leave_nothing_in_memory() {
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
        assert_eq!(s.engine().changelog_offset().unwrap(), Some(20_000));
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
            Filter::Hashes(f) => f.len(),
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
