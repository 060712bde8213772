//! Engine lookups read ahead, on a thread of their own.
//!
//! A lookup that reaches sled (a far repeat: its key is no longer held in memory) reads and
//! decodes the sled leaf that holds the key's segment, ~8–16 segments of a few KiB each.
//! The run loop knows a batch's keys before it processes them: it hands those whose lookups
//! would read the engine ([`StagedStore::warm_into`](super::StagedStore::warm_into)) to a
//! [`Warmer`], whose thread reads them while the run loop works through the batch, and
//! leaves each value in its store's [`Warmed`], where the lookup takes it.
//!
//! A value read ahead is the engine's value when the lookup comes, as long as no batch
//! left the store's memory since the key was handed over: a key handed over was neither
//! staged nor in memory, so the engine held its latest committed write; any later write of
//! it is staged, then held in memory until it is evicted. The lookup finds such a write
//! there first; with none, the engine has not changed for this key. So each value carries
//! the store's eviction count at hand-over, and one with another count is not used.
//! A key read ahead too late (or not at all) costs the run loop the read it would have
//! done anyway.

use super::KeyValueStore;
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

/// Values read ahead by key: the store's eviction count when the key was handed over,
/// and the value (`None`: the engine does not hold the key).
type Values = hashbrown::HashMap<Box<[u8]>, (u64, Option<Bytes>), ahash::RandomState>;

/// Values of one store read ahead. Holds the keys of the batch read ahead last (at most).
#[derive(Default)]
pub(crate) struct Warmed {
    values: Mutex<Values>,
}

impl Warmed {
    fn lock(&self) -> std::sync::MutexGuard<'_, Values> {
        self.values.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take the value of `key` read ahead, if it was handed over at eviction count
    /// `evictions`: `Some(None)` for a key the engine does not hold.
    pub(super) fn take(&self, key: &[u8], evictions: u64) -> Option<Option<Bytes>> {
        let mut m = self.lock();
        if m.is_empty() {
            return None;
        }
        match m.remove(key) {
            Some((at, v)) if at == evictions => Some(v),
            _ => None,
        }
    }

    fn put(&self, key: &[u8], evictions: u64, value: Option<Bytes>) {
        self.lock().insert(key.into(), (evictions, value));
    }

    fn clear(&self) {
        self.lock().clear();
    }
}

/// The keys of one batch to read ahead, in the order the run loop reaches them.
#[derive(Default)]
pub(crate) struct WarmBatch {
    /// The stores named by `keys`: the engine, and where its values read ahead go.
    stores: Vec<(Arc<dyn KeyValueStore>, Arc<Warmed>)>,
    /// `(index in stores, start, end in bytes, the store's eviction count, the record's
    /// index in the run loop's batch)` of each key.
    keys: Vec<(u32, u32, u32, u64, u32)>,
    bytes: Vec<u8>,
    /// The index of the record whose keys are pushed now ([`WarmBatch::record`]).
    record: u32,
}

impl WarmBatch {
    /// The keys pushed from now on are those of record `i` of the run loop's batch (0 until
    /// told).
    pub(crate) fn record(&mut self, i: usize) {
        self.record = u32::try_from(i).unwrap_or(u32::MAX);
    }

    /// Add `key` of `engine` (its values go to `warmed`), handed over at the store's
    /// eviction count `evictions`.
    pub(super) fn push(
        &mut self,
        engine: &Arc<dyn KeyValueStore>,
        warmed: &Arc<Warmed>,
        key: &[u8],
        evictions: u64,
    ) {
        let s = match self.stores.iter().position(|(_, w)| Arc::ptr_eq(w, warmed)) {
            Some(s) => s,
            None => {
                self.stores.push((engine.clone(), warmed.clone()));
                self.stores.len() - 1
            }
        };
        let start = self.bytes.len();
        self.bytes.extend_from_slice(key);
        // A batch holds at most a few thousand keys: its offsets fit u32 by far.
        self.keys.push((
            s as u32,
            start as u32,
            self.bytes.len() as u32,
            evictions,
            self.record,
        ));
    }

    /// Number of keys added.
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Read the keys in order, leaving each value in its store's [`Warmed`] (emptied
    /// first: the run loop is past the batch read before). `next` tells the first record of
    /// the batch whose lookups the run loop has not started (`None` once it is past the
    /// batch): keys of records before it are skipped.
    pub(super) fn read(&self, next: impl Fn() -> Option<u32>) {
        for (_, w) in &self.stores {
            w.clear();
        }
        for &(s, a, b, evictions, record) in &self.keys {
            match next() {
                None => return,
                Some(next) if record < next => continue,
                Some(_) => {}
            }
            let (engine, warmed) = &self.stores[s as usize];
            let key = &self.bytes[a as usize..b as usize];
            // A failed read is left to the lookup, which reports it.
            if let Ok(v) = engine.get(key) {
                warmed.put(key, evictions, v.map(Bytes::from));
            }
        }
    }
}

/// A thread that reads engine lookups ahead of the run loop (see the module doc).
/// Dropping it stops the thread and waits for it (it holds the stores of its queued
/// batches).
pub(crate) struct Warmer {
    tx: Option<mpsc::Sender<(u64, WarmBatch)>>,
    /// The run loop's batch number (high 32 bits; a queued batch with a lower one is
    /// skipped) and the first record of it whose lookups it has not started (low 32 bits,
    /// see [`Warmer::reached`]).
    turn: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Warmer {
    /// Start the thread (named `onceflow-warm`).
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub(crate) fn spawn() -> std::io::Result<Warmer> {
        let (tx, rx) = mpsc::channel::<(u64, WarmBatch)>();
        let turn = Arc::new(AtomicU64::new(0));
        let now = turn.clone();
        let thread = std::thread::Builder::new()
            .name("onceflow-warm".into())
            .spawn(move || {
                while let Ok((at, batch)) = rx.recv() {
                    batch.read(|| {
                        let now = now.load(Ordering::Relaxed);
                        (now >> 32 == at).then_some(now as u32)
                    });
                }
            })?;
        Ok(Warmer {
            tx: Some(tx),
            turn,
            thread: Some(thread),
        })
    }

    /// Read `batch`'s keys ahead, in order, until the run loop calls
    /// [`Warmer::next_turn`].
    pub(crate) fn send(&self, batch: WarmBatch) {
        if let Some(tx) = &self.tx {
            // A send fails only once the thread is gone (it never panics on its own).
            let _ = tx.send((self.turn.load(Ordering::Relaxed) >> 32, batch));
        }
    }

    /// The run loop has reached record `i` of its batch (its lookups are about to be
    /// done): keys up to it are no longer read ahead.
    pub(crate) fn reached(&self, i: usize) {
        let turn = self.turn.load(Ordering::Relaxed) >> 32;
        let i = u32::try_from(i.saturating_add(1)).unwrap_or(u32::MAX);
        self.turn
            .store(turn << 32 | u64::from(i), Ordering::Relaxed);
    }

    /// The run loop is done with the batch sent last: whatever of it is still queued is
    /// dropped.
    pub(crate) fn next_turn(&self) {
        let turn = self.turn.load(Ordering::Relaxed) >> 32;
        self.turn.store((turn + 1) << 32, Ordering::Relaxed);
    }
}

impl Drop for Warmer {
    fn drop(&mut self) {
        self.next_turn();
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;

    /// A store that records the keys it was asked to read; it holds key `b"a"`.
    #[derive(Default)]
    struct Recording {
        read: Mutex<Vec<Vec<u8>>>,
    }

    impl KeyValueStore for Recording {
        fn name(&self) -> &str {
            "recording/0"
        }
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
            self.read.lock().unwrap().push(key.to_vec());
            Ok((key == b"a").then(|| b"1".to_vec()))
        }
        fn write(&self, _: super::super::WriteBatch) -> Result<()> {
            Ok(())
        }
        fn changelog_offset(&self) -> Result<Option<i64>> {
            Ok(None)
        }
        fn clear(&self) -> Result<()> {
            Ok(())
        }
        fn scan(&self, _: Option<&[u8]>, _: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn a_batch_is_read_in_order_and_its_values_taken_once_at_their_eviction_count() {
        let rec = Arc::new(Recording::default());
        let engine: Arc<dyn KeyValueStore> = rec.clone();
        let warmed = Arc::new(Warmed::default());
        let w = Warmer::spawn().unwrap();
        let mut b = WarmBatch::default();
        for (k, at) in [(&b"a"[..], 7), (b"bb", 7), (b"", 7), (b"ccc", 6)] {
            b.push(&engine, &warmed, k, at);
        }
        assert_eq!(b.len(), 4);
        w.send(b);
        // The thread reads what it is sent; wait for it (bounded).
        let t = std::time::Instant::now();
        while rec.read.lock().unwrap().len() < 4 && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            *rec.read.lock().unwrap(),
            vec![b"a".to_vec(), b"bb".to_vec(), Vec::new(), b"ccc".to_vec()]
        );
        // The last value lands just after the last read: wait for it too.
        while warmed.lock().len() < 4 && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(warmed.take(b"a", 7), Some(Some(Bytes::from_static(b"1"))));
        assert_eq!(warmed.take(b"a", 7), None, "taken once");
        assert_eq!(
            warmed.take(b"bb", 7),
            Some(None),
            "the engine does not hold it"
        );
        assert_eq!(
            warmed.take(b"", 8),
            None,
            "a batch left memory since: not used"
        );
        assert_eq!(warmed.take(b"ccc", 6), Some(None));
        assert_eq!(warmed.take(b"zz", 7), None, "never read ahead");
        // A batch sent for a turn the run loop has already left is not read.
        let mut old = WarmBatch::default();
        old.push(&engine, &warmed, b"stale", 7);
        let at = w.turn.load(Ordering::Relaxed) >> 32;
        w.next_turn();
        w.tx.as_ref().unwrap().send((at, old)).unwrap();
        drop(w); // joins the thread: everything sent was taken
        assert_eq!(rec.read.lock().unwrap().len(), 4);
        assert_eq!(warmed.take(b"stale", 7), None);
    }

    #[test]
    fn keys_of_records_the_run_loop_has_reached_are_not_read() {
        let rec = Arc::new(Recording::default());
        let engine: Arc<dyn KeyValueStore> = rec.clone();
        let warmed = Arc::new(Warmed::default());
        let mut b = WarmBatch::default();
        for (i, k) in [b"w", b"x", b"y", b"z"].iter().enumerate() {
            b.record(i);
            b.push(&engine, &warmed, *k, 0);
        }
        b.read(|| Some(2));
        assert_eq!(
            *rec.read.lock().unwrap(),
            vec![b"y".to_vec(), b"z".to_vec()]
        );
        // Through the thread: the run loop at record 1 (its lookups about to be done).
        let w = Warmer::spawn().unwrap();
        w.reached(1);
        w.send(b);
        let t = std::time::Instant::now();
        while rec.read.lock().unwrap().len() < 4 && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        drop(w);
        assert_eq!(
            *rec.read.lock().unwrap(),
            vec![b"y".to_vec(), b"z".to_vec(), b"y".to_vec(), b"z".to_vec()]
        );
    }
}
