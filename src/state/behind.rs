//! The write-behind side of a store: committed writes readable in memory until the writer
//! has persisted them.

use super::*;

/// The write-behind side of a store: committed writes readable in memory until the writer
/// has persisted them (and, up to [`RESIDENT_ENTRIES`], after).
pub(super) struct Behind {
    pub(super) writer: Arc<Writer>,
    pub(super) shared: Arc<Shared>,
    /// Committed batches in order, oldest first, until evicted, and the latest committed
    /// value of each resident key.
    pub(super) resident: Resident,
    /// Sequence number of the last batch handed to the writer.
    pub(super) seq: u64,
    /// Which keys not held in memory may be in the engine.
    pub(super) filter: KeyFilter,
    pub(super) filter_hash: ahash::RandomState,
    /// Number of keys in the committed state, when known (the engine was empty at open).
    pub(super) known_len: Option<u64>,
    /// [`RESIDENT_ENTRIES`] and [`UNPERSISTED_OPS`] (smaller in tests).
    pub(super) resident_max: usize,
    pub(super) unpersisted_max: usize,
    /// [`FILTER_SLACK`] (0 in tests, so that the model tests rebuild the filter often).
    pub(super) filter_slack: usize,
    /// Batches that left memory (evicted, or all of them at a reload), counted: engine
    /// reads done ahead ([`super::Warmer`]) are good while it stays as it was when they
    /// were asked for (see [`StagedStore::lookup`]).
    pub(super) evictions: u64,
}

impl Behind {
    pub(super) fn new(writer: Arc<Writer>, engine: &dyn KeyValueStore) -> Behind {
        let mut b = Behind {
            writer,
            shared: Arc::new(Shared::default()),
            resident: Resident::new(),
            seq: 0,
            filter: KeyFilter::Unknown,
            filter_hash: ahash::RandomState::new(),
            known_len: None,
            resident_max: RESIDENT_ENTRIES,
            unpersisted_max: UNPERSISTED_OPS,
            filter_slack: FILTER_SLACK,
            evictions: 0,
        };
        b.reload(engine);
        b
    }

    /// Forget the memory copy (everything must be persisted) and look at the engine again.
    pub(super) fn reload(&mut self, engine: &dyn KeyValueStore) {
        self.resident = Resident::new();
        self.evictions += 1;
        let empty = matches!(engine.scan(None, 1), Ok(v) if v.is_empty());
        self.filter = if empty {
            KeyFilter::Overlay
        } else {
            KeyFilter::Unknown
        };
        self.known_len = if empty {
            Some(0)
        } else {
            engine.key_count().ok().flatten()
        };
    }

    /// Hint that `key` is looked up soon: fetch its place in the resident index and the key
    /// filter into the cache.
    pub(super) fn prefetch(&self, key: &[u8]) {
        self.resident.prefetch(key);
        if let KeyFilter::Hashes(f) = &self.filter {
            f.prefetch(filter_key(&self.filter_hash, key));
        }
    }

    /// Whether any key not held in memory may be in the engine (not while the engine was
    /// empty at open and every key put since is held in memory).
    pub(super) fn may_use_engine(&self) -> bool {
        !matches!(self.filter, KeyFilter::Overlay)
    }

    /// Whether `key`, not held in memory, may be in the engine.
    pub(super) fn may_be_in_engine(&self, key: &[u8]) -> bool {
        match &self.filter {
            KeyFilter::Unknown => true,
            KeyFilter::Overlay => false,
            KeyFilter::Hashes(f) => f.contains(filter_key(&self.filter_hash, key)),
        }
    }

    pub(super) fn error(&self, store: &str) -> Result<()> {
        match &self.shared.lock().error {
            None => Ok(()),
            Some(e) => Err(crate::Error::state(
                store,
                format!("the background write to the store failed: {e}"),
            )),
        }
    }

    /// Make `ops` the committed state in memory and hand them to the writer.
    pub(super) fn submit(
        &mut self,
        engine: &Arc<dyn KeyValueStore>,
        ops: &[(Bytes, Option<Bytes>)],
        changelog_offset: Option<i64>,
    ) -> Result<()> {
        self.error(engine.name())?;
        // The batch stays in memory long after its commit: packed (see `Packed`), so the
        // caller can let go of the staging arena's blocks (and reuse its buffers).
        let ops = Arc::new(Packed::pack(engine.name(), ops)?);
        self.seq += 1;
        let seq = self.seq;
        let mut count = self.known_len.map(|n| (n, Vec::with_capacity(ops.len())));
        // The ops' filter entries, each prefetched a few ops before it is read.
        let entries: Vec<u32> = match &self.filter {
            KeyFilter::Hashes(_) => ops
                .iter()
                .map(|(k, _)| filter_key(&self.filter_hash, k))
                .collect(),
            _ => Vec::new(),
        };
        let mut at = 0;
        let filter = &mut self.filter;
        self.resident.push(seq, ops.clone(), |k, v, old| {
            let entry = entries.get(at).copied();
            if let (KeyFilter::Hashes(f), Some(ahead)) =
                (&*filter, entries.get(at + super::resident::PREFETCH_AHEAD))
            {
                f.prefetch(*ahead);
            }
            at += 1;
            if let Some((_, deltas)) = &mut count {
                let existed = match old {
                    Some(was) => Some(was),
                    None => match filter {
                        // Every key put since the engine was empty is in memory.
                        KeyFilter::Overlay => Some(false),
                        // Hashes of every key put since the engine was empty: a miss is
                        // exact; a hit (a key already written behind) reads the engine.
                        KeyFilter::Hashes(f) => {
                            Some(entry.is_some_and(|e| f.contains(e)) && engine.get(k)?.is_some())
                        }
                        // An engine with older data: knowing would take an engine read per
                        // op (a restore into it would crawl), so the count becomes unknown
                        // (a caller that needs it scans the engine after a sync).
                        KeyFilter::Unknown => None,
                    },
                };
                match existed {
                    Some(existed) => deltas.push(i8::from(v.is_some()) - i8::from(existed)),
                    None => count = None,
                }
            }
            if let (Some(_), KeyFilter::Hashes(f), Some(e)) = (v, &mut *filter, entry) {
                f.insert(e);
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
    pub(super) fn trim_filter(&mut self, engine: &dyn KeyValueStore) -> Result<()> {
        let KeyFilter::Hashes(f) = &self.filter else {
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
            fresh.insert(filter_key(&self.filter_hash, k));
        }
        let mut after: Option<Vec<u8>> = None;
        loop {
            let chunk = engine.scan(after.as_deref(), 10_000)?;
            for (k, _) in &chunk {
                fresh.insert(filter_key(&self.filter_hash, &k[..]));
            }
            if chunk.len() < 10_000 {
                break;
            }
            after = chunk.last().map(|(k, _)| k.clone());
        }
        self.filter = KeyFilter::Hashes(fresh);
        Ok(())
    }

    /// Evict persisted batches past the memory bound; wait for the writer while too much
    /// is unpersisted.
    pub(super) fn maintain(&mut self, store: &str) -> Result<()> {
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
                if matches!(self.filter, KeyFilter::Overlay) {
                    // Keys are about to leave memory: from now on remember their hashes
                    // (read from the batches in order, see `Resident::op_keys`).
                    let mut f = HashFilter::default();
                    f.reserve(self.resident.len());
                    for k in self.resident.op_keys() {
                        f.insert(filter_key(&self.filter_hash, k));
                    }
                    self.filter = KeyFilter::Hashes(f);
                }
                self.resident.pop_front();
                self.evictions += 1;
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
    pub(super) fn sync(&self, store: &str) -> Result<()> {
        self.sync_until(store, None).map(|_| ())
    }

    /// Wait until every submitted batch is persisted, or until `deadline`; true when all
    /// are.
    pub(super) fn sync_until(
        &self,
        store: &str,
        deadline: Option<std::time::Instant>,
    ) -> Result<bool> {
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
                return Ok(true);
            }
            let mut wait = std::time::Duration::from_millis(100);
            if let Some(d) = deadline {
                match d.checked_duration_since(std::time::Instant::now()) {
                    Some(left) if !left.is_zero() => wait = wait.min(left),
                    _ => return Ok(false),
                }
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, wait)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Stop the writer on this store: its unwritten batches are skipped; returns once no
    /// chunk of this store is being written.
    pub(super) fn stop(&self) {
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
