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

pub use self::memory::{MemoryBackend, MemoryStore};
pub use self::sled::{SledBackend, SledStore};

use crate::error::Result;
use std::collections::HashMap;

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

/// A partition-local key-value store engine. Keys and values are raw bytes.
pub trait KeyValueStore: Send {
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
    fn write(&mut self, batch: WriteBatch) -> Result<()>;

    /// The changelog offset stored by the last batch that carried one.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to read.
    fn changelog_offset(&self) -> Result<Option<i64>>;

    /// Remove every entry and the changelog offset.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to write.
    fn clear(&mut self) -> Result<()>;

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
    fn open(&self, store: &str, partition: i32) -> Result<Box<dyn KeyValueStore>>;

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

/// A store with the writes of the open commit kept pending in memory.
///
/// Reads see pending writes first, so lookups within a batch see the batch's own entries.
/// [`StagedStore::commit`] applies the pending writes to the engine in one batch;
/// [`StagedStore::abort`] drops them.
pub struct StagedStore {
    inner: Box<dyn KeyValueStore>,
    pending: HashMap<Vec<u8>, Option<Vec<u8>>>,
    order: Vec<Vec<u8>>,
}

impl StagedStore {
    /// Wrap an engine.
    pub fn new(inner: Box<dyn KeyValueStore>) -> Self {
        StagedStore {
            inner,
            pending: HashMap::with_capacity(4096),
            order: Vec::with_capacity(4096),
        }
    }

    /// Name of the underlying store.
    pub fn name(&self) -> &str {
        self.inner.name()
    }

    /// Read `key`, pending writes first.
    ///
    /// # Errors
    /// As [`KeyValueStore::get`].
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match self.pending.get(key) {
            Some(v) => Ok(v.clone()),
            None => self.inner.get(key),
        }
    }

    /// Stage a put (`Some`) or delete (`None`) of `key`.
    pub fn stage(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        if !self.pending.contains_key(&key) {
            self.order.push(key.clone());
        }
        self.pending.insert(key, value);
    }

    /// Number of staged keys.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// The staged writes in first-write order, without removing them.
    pub fn pending(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        self.order.iter().map(move |k| {
            let v = self.pending.get(k).and_then(|v| v.as_deref());
            (k.as_slice(), v)
        })
    }

    /// Apply the staged writes to the engine in one batch with `changelog_offset`.
    ///
    /// # Errors
    /// As [`KeyValueStore::write`]; the staged writes are dropped either way, since the
    /// runtime rewinds to the committed offsets on any failure.
    pub fn commit(&mut self, changelog_offset: Option<i64>) -> Result<()> {
        let mut ops = Vec::with_capacity(self.order.len());
        for k in self.order.drain(..) {
            let v = self.pending.remove(&k).unwrap_or(None);
            ops.push((k, v));
        }
        self.pending.clear();
        let batch = WriteBatch {
            ops,
            changelog_offset,
        };
        if batch.is_empty() {
            return Ok(());
        }
        self.inner.write(batch)
    }

    /// Drop the staged writes (the commit failed or was aborted).
    pub fn abort(&mut self) {
        self.pending.clear();
        self.order.clear();
    }

    /// The engine under the staging layer.
    pub fn engine(&self) -> &dyn KeyValueStore {
        self.inner.as_ref()
    }

    /// The engine under the staging layer, mutably (restore writes here directly).
    pub fn engine_mut(&mut self) -> &mut dyn KeyValueStore {
        self.inner.as_mut()
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
    fn staged_writes_are_visible_but_not_applied_until_commit() {
        let backend = MemoryBackend::default();
        let mut s = StagedStore::new(backend.open("s", 0).unwrap());
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
}
