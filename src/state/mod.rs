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
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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

/// The writes of one commit: last value per key, and the keys in first-write order.
#[derive(Debug, Default)]
struct Staged {
    // ahash: keys come from the input, so a keyed hash, but faster than SipHash.
    map: HashMap<Vec<u8>, Option<Vec<u8>>, ahash::RandomState>,
    order: Vec<Vec<u8>>,
}

impl Staged {
    fn into_batch(self, changelog_offset: Option<i64>) -> WriteBatch {
        let Staged { mut map, order } = self;
        let ops = order
            .into_iter()
            .map(|k| {
                let v = map.remove(&k).unwrap_or(None);
                (k, v)
            })
            .collect();
        WriteBatch {
            ops,
            changelog_offset,
        }
    }
}

/// A committed batch on its way to the engine: readable until the writer confirms it.
struct Applying {
    view: Arc<Staged>,
    done: std::sync::mpsc::Receiver<Result<()>>,
}

/// A background thread that applies committed batches to their engines in order, so the
/// processing thread does not wait on the engine's write cost (sled: microseconds a key).
pub struct Writer {
    tx: Mutex<std::sync::mpsc::Sender<WriterJob>>,
}

/// What the writer applies: a commit's staged writes (readable meanwhile) or a plain batch.
enum Job {
    Staged(Arc<Staged>, Option<i64>),
    Batch(WriteBatch),
}

type WriterJob = (
    Arc<dyn KeyValueStore>,
    Job,
    std::sync::mpsc::SyncSender<Result<()>>,
);

impl Writer {
    /// Start the writer thread; it ends when the last handle is dropped.
    pub fn spawn() -> Arc<Writer> {
        let (tx, rx) = std::sync::mpsc::channel::<WriterJob>();
        std::thread::Builder::new()
            .name("onceflow-state-writer".into())
            .spawn(move || {
                for (engine, job, reply) in rx {
                    let batch = match job {
                        // The processing thread reads `staged` until the reply: copy it.
                        Job::Staged(staged, offset) => WriteBatch {
                            ops: staged
                                .order
                                .iter()
                                .map(|k| (k.clone(), staged.map.get(k).cloned().unwrap_or(None)))
                                .collect(),
                            changelog_offset: offset,
                        },
                        Job::Batch(b) => b,
                    };
                    let _ = reply.send(engine.write(batch));
                }
            })
            .expect("spawn the state writer thread");
        Arc::new(Writer { tx: Mutex::new(tx) })
    }

    fn submit(
        &self,
        engine: Arc<dyn KeyValueStore>,
        job: Job,
    ) -> std::sync::mpsc::Receiver<Result<()>> {
        let (reply, done) = std::sync::mpsc::sync_channel(1);
        let sent = self
            .tx
            .lock()
            .expect("writer lock")
            .send((engine, job, reply.clone()));
        if sent.is_err() {
            let _ = reply.send(Err(crate::Error::state(
                "writer",
                "the state writer thread is gone",
            )));
        }
        done
    }
}

/// A store with the writes of the open commit kept pending in memory.
///
/// Reads see pending writes first, so lookups within a batch see the batch's own entries;
/// then the last committed batch while the writer is still applying it; then the engine.
/// [`StagedStore::commit`] hands the pending writes to the engine as one batch (through the
/// background [`Writer`] when there is one, at most one batch in flight per store);
/// [`StagedStore::abort`] drops them.
pub struct StagedStore {
    inner: Arc<dyn KeyValueStore>,
    pending: Staged,
    applying: Option<Applying>,
    writer: Option<Arc<Writer>>,
}

impl StagedStore {
    /// Wrap an engine; batches are applied by `writer` if given, else synchronously.
    pub fn new(inner: Arc<dyn KeyValueStore>, writer: Option<Arc<Writer>>) -> Self {
        StagedStore {
            inner,
            pending: Staged {
                map: HashMap::with_capacity_and_hasher(4096, ahash::RandomState::new()),
                order: Vec::with_capacity(4096),
            },
            applying: None,
            writer,
        }
    }

    /// Name of the underlying store.
    pub fn name(&self) -> &str {
        self.inner.name()
    }

    /// Read `key`: pending writes, then the batch being applied, then the engine.
    ///
    /// # Errors
    /// As [`KeyValueStore::get`].
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        if let Some(v) = self.pending.map.get(key) {
            return Ok(v.clone());
        }
        if let Some(a) = &self.applying {
            if let Some(v) = a.view.map.get(key) {
                return Ok(v.clone());
            }
        }
        self.inner.get(key)
    }

    /// Stage a put (`Some`) or delete (`None`) of `key`.
    pub fn stage(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        match self.pending.map.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                e.insert(value);
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                self.pending.order.push(e.key().clone());
                e.insert(value);
            }
        }
    }

    /// Number of staged keys.
    pub fn pending_len(&self) -> usize {
        self.pending.map.len()
    }

    /// The staged writes in first-write order, without removing them.
    pub fn pending(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        self.pending.order.iter().map(move |k| {
            let v = self.pending.map.get(k).and_then(|v| v.as_deref());
            (k.as_slice(), v)
        })
    }

    /// Wait until the batch in flight (if any) is applied.
    ///
    /// # Errors
    /// The engine's write error for that batch.
    pub fn sync(&mut self) -> Result<()> {
        match self.applying.take() {
            None => Ok(()),
            Some(a) => a.done.recv().unwrap_or_else(|_| {
                Err(crate::Error::state(
                    self.inner.name(),
                    "the state writer thread is gone",
                ))
            }),
        }
    }

    /// Apply the staged writes to the engine as one batch with `changelog_offset`.
    ///
    /// # Errors
    /// As [`KeyValueStore::write`] (for this batch, or, with a writer, the previous one);
    /// the staged writes are dropped either way, since the runtime stops or rewinds on any
    /// failure.
    pub fn commit(&mut self, changelog_offset: Option<i64>) -> Result<()> {
        let staged = std::mem::take(&mut self.pending);
        self.sync()?;
        if staged.order.is_empty() && changelog_offset.is_none() {
            return Ok(());
        }
        match &self.writer {
            Some(w) => {
                let view = Arc::new(staged);
                let done = w.submit(
                    self.inner.clone(),
                    Job::Staged(view.clone(), changelog_offset),
                );
                self.applying = Some(Applying { view, done });
                Ok(())
            }
            None => self.inner.write(staged.into_batch(changelog_offset)),
        }
    }

    /// Write a restored batch to the engine: through the writer when there is one (so the
    /// next changelog batch is read while this one is written; at most one in flight), else
    /// at once. Nothing must be staged meanwhile; call [`StagedStore::sync`] before reads.
    ///
    /// # Errors
    /// The engine's write error for the previous (or, without a writer, this) batch.
    pub fn write_restored(&mut self, batch: WriteBatch) -> Result<()> {
        self.sync()?;
        match &self.writer {
            Some(w) => {
                let done = w.submit(self.inner.clone(), Job::Batch(batch));
                self.applying = Some(Applying {
                    view: Arc::new(Staged::default()),
                    done,
                });
                Ok(())
            }
            None => self.inner.write(batch),
        }
    }

    /// Drop the staged writes (the commit failed or was aborted).
    pub fn abort(&mut self) {
        self.pending.map.clear();
        self.pending.order.clear();
    }

    /// The engine under the staging layer (restore and scans use it directly; call
    /// [`StagedStore::sync`] first to see every committed batch).
    pub fn engine(&self) -> &dyn KeyValueStore {
        self.inner.as_ref()
    }
}

impl Drop for StagedStore {
    fn drop(&mut self) {
        if let Err(e) = self.sync() {
            tracing::error!(store = self.inner.name(), error = %e, "applying the last batch failed");
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
}
