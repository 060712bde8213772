//! The staging layer: a commit's writes held pending ([`StagedStore`]) until the commit
//! protocol says they may land, sealed while a commit is in flight, withdrawn when the
//! record they stand for is dead-lettered.

use super::*;

/// The writes of one commit: the ops in first-write order (a withdrawn op is replaced by
/// the last one), each key once with its last value, and an index from key to op.
/// Iterating and committing walk the ops in order without a lookup per key. The index holds
/// op positions only (the key lives once, in its op).
#[derive(Debug, Default)]
pub(super) struct Staged {
    /// Position in `ops` of each key's op, by the key's hash.
    index: hashbrown::HashTable<usize>,
    // ahash: keys come from the input, so a keyed hash, but faster than SipHash.
    hash: ahash::RandomState,
    pub(super) ops: Vec<(Bytes, Option<Bytes>)>,
    /// The write number of each op's value (see [`StagedStore::stage_for`]), by position.
    writes: Vec<u32>,
}

impl Staged {
    pub(super) fn with_capacity(n: usize) -> Staged {
        Staged {
            index: hashbrown::HashTable::with_capacity(n),
            hash: ahash::RandomState::new(),
            ops: Vec::with_capacity(n),
            writes: Vec::with_capacity(n),
        }
    }

    /// Position of `key`'s op.
    pub(super) fn find(&self, key: &[u8]) -> Option<usize> {
        let ops = &self.ops;
        self.index
            .find(self.hash.hash_one(key), |&i| ops[i].0[..] == *key)
            .copied()
    }

    pub(super) fn get(&self, key: &[u8]) -> Option<&Option<Bytes>> {
        self.find(key).map(|i| &self.ops[i].1)
    }

    /// Give the op at position `i` the value of write number `write`; returns the value
    /// and write number it held.
    pub(super) fn set(
        &mut self,
        i: usize,
        value: Option<Bytes>,
        write: u32,
    ) -> (Option<Bytes>, u32) {
        let old = std::mem::replace(&mut self.ops[i].1, value);
        (old, std::mem::replace(&mut self.writes[i], write))
    }

    /// The write number of the op at position `i`, if there is one.
    pub(super) fn write_at(&self, i: usize) -> Option<u32> {
        self.writes.get(i).copied()
    }

    /// Add the op of a key not in the batch, the value of write number `write`; returns
    /// its position.
    pub(super) fn insert_new(&mut self, key: Bytes, value: Option<Bytes>, write: u32) -> usize {
        let (ops, hash) = (&self.ops, &self.hash);
        let at = ops.len();
        self.index.insert_unique(hash.hash_one(&key[..]), at, |&i| {
            hash.hash_one(&ops[i].0[..])
        });
        self.ops.push((key, value));
        self.writes.push(write);
        at
    }

    pub(super) fn len(&self) -> usize {
        self.ops.len()
    }

    /// Take `key` out of the batch (its op is replaced by the last one: keys are unique
    /// in a batch, so their order carries no meaning).
    #[cfg(test)]
    pub(super) fn remove(&mut self, key: &[u8]) {
        if let Some(i) = self.find(key) {
            self.remove_at(i);
        }
    }

    /// Take the op at position `i` out of the batch: the last op moves to `i`. Returns the
    /// position the moved op had.
    pub(super) fn remove_at(&mut self, i: usize) -> usize {
        let ops = &self.ops;
        if let Ok(entry) = self
            .index
            .find_entry(self.hash.hash_one(&ops[i].0[..]), |&j| j == i)
        {
            entry.remove();
        }
        let last = self.ops.len() - 1;
        self.ops.swap_remove(i);
        self.writes.swap_remove(i);
        if i < last {
            // The last op moved to `i`: point its key there.
            let ops = &self.ops;
            if let Some(slot) = self
                .index
                .find_mut(self.hash.hash_one(&ops[i].0[..]), |&j| j == last)
            {
                *slot = i;
            }
        }
        last
    }

    pub(super) fn clear(&mut self) {
        self.index.clear();
        self.ops.clear();
        self.writes.clear();
    }
}

/// A staged write that stands for one source record (a dedup mark), kept until the commit
/// so that [`StagedStore::withdraw`] can take it back if that record is dead-lettered.
#[derive(Debug)]
pub(super) struct Owned {
    /// Source offset of the record the write stands for.
    pub(super) owner: i64,
    /// Position of the key's op in the open batch.
    pub(super) op: u32,
    /// The write number of the value staged: the op still holds it while its write
    /// number is this one (numbers are unique within a batch).
    pub(super) write: u32,
    /// What the batch held for the key before, with its write number: `None` if nothing
    /// was staged for it.
    pub(super) before: Option<(Option<Bytes>, u32)>,
}

/// A staged write taken back by [`StagedStore::withdraw`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Withdrawn {
    /// Source offset of the record the write stood for.
    pub(crate) owner: i64,
    /// The key.
    pub(crate) key: Bytes,
    /// The value that was staged (`None`: a delete).
    pub(crate) written: Option<Bytes>,
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
pub(crate) struct StagedStore {
    pub(super) inner: Arc<dyn KeyValueStore>,
    pub(super) pending: Staged,
    pub(super) behind: Option<Behind>,
    pub(super) arena: Arena,
    /// Changelog records of the restore step in progress.
    pub(super) restored: Vec<(Bytes, Option<Bytes>)>,
    /// The staged writes that stand for a source record, in staging order.
    pub(super) owned: Vec<Owned>,
    /// Sealed batches (commits in flight, oldest first) with their commit epoch: no longer
    /// staged, not yet committed, readable.
    pub(super) sealed: std::collections::VecDeque<(u64, Staged)>,
    /// The buffers of the last batch handed to the engine, emptied, for the next batch:
    /// memory already mapped, so staging does not fault in fresh pages every commit.
    pub(super) spare: Option<Staged>,
    /// Engine values read ahead by a [`Warmer`](super::Warmer) (see
    /// [`StagedStore::warm_into`]).
    pub(super) warmed: Arc<super::Warmed>,
    /// The number of the last staged write ([`Staged`]'s write numbers). It wraps after
    /// 2^32 writes, far more than one open batch takes: owned writes last until the batch
    /// is sealed or committed, which the runtime does every commit (at most 50,000 source
    /// records apart).
    pub(super) last_write: u32,
}

/// Byte strings copied into shared blocks: one allocation per block instead of one per
/// buffer, and clones (pending map, in-memory state, writer; a record's dead-letter copy)
/// are reference counts. A block lives while any buffer cut from it does, so an arena
/// suits buffers that are dropped about as soon as their neighbours.
pub(crate) struct Arena {
    pub(super) block: bytes::BytesMut,
}

/// Size of an arena block.
pub(super) const ARENA_BLOCK: usize = 64 * 1024;

impl Arena {
    /// An arena with no block yet.
    pub(crate) fn new() -> Arena {
        Arena {
            block: bytes::BytesMut::new(),
        }
    }

    /// `data` copied into the current block (a new one when it does not fit).
    pub(crate) fn copy(&mut self, data: &[u8]) -> Bytes {
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
    pub(crate) fn new(inner: Arc<dyn KeyValueStore>, writer: Option<Arc<Writer>>) -> Self {
        let behind = writer.map(|w| Behind::new(w, inner.as_ref()));
        StagedStore {
            inner,
            pending: Staged::with_capacity(4096),
            behind,
            arena: Arena::new(),
            restored: Vec::new(),
            owned: Vec::new(),
            sealed: std::collections::VecDeque::new(),
            spare: None,
            warmed: Arc::default(),
            last_write: 0,
        }
    }

    /// Memory this store holds in the process, by part (see [`super::StateMemory`]), and
    /// the engine's part alone: `None` without `wait` while the engine is busy writing a
    /// batch (then counted as 0 in the parts).
    pub(crate) fn memory(&self, wait: bool) -> (super::StateMemory, Option<u64>) {
        let engine = self.inner.memory_bytes(wait).map(|b| b as u64);
        let mut m = super::StateMemory {
            engine: engine.unwrap_or(0),
            ..Default::default()
        };
        if let Some(b) = &self.behind {
            m.resident = b.resident.memory_bytes() as u64;
            if let super::resident::KeyFilter::Hashes(f) = &b.filter {
                m.key_filter = f.memory_bytes() as u64;
            }
        }
        (m, engine)
    }

    /// Name of the underlying store.
    pub(crate) fn name(&self) -> &str {
        self.inner.name()
    }

    #[cfg(test)]
    pub(super) fn with_limits(mut self, resident: usize, unpersisted: usize) -> Self {
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
    pub(super) fn with_seq(mut self, seq: u64) -> Self {
        if let Some(b) = &mut self.behind {
            b.seq = seq;
            b.shared.lock().persisted = seq;
            b.resident.first = seq as u32;
        }
        self
    }

    /// Read `key`: pending writes, then sealed batches (newest first), then committed
    /// writes in memory, then the engine (or its value read ahead by a
    /// [`Warmer`](super::Warmer), which is the same).
    ///
    /// # Errors
    /// As [`KeyValueStore::get`].
    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.lookup(key)?.map(|b| b.to_vec()))
    }

    /// As [`StagedStore::get`], without copying values held in memory.
    ///
    /// # Errors
    /// As [`KeyValueStore::get`].
    pub(crate) fn lookup(&self, key: &[u8]) -> Result<Option<Bytes>> {
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
                return Ok(v);
            }
            if !b.may_be_in_engine(key) {
                return Ok(None);
            }
            if let Some(v) = self.warmed.take(key, b.evictions) {
                return Ok(v);
            }
        }
        Ok(self.inner.get(key)?.map(Bytes::from))
    }

    /// Whether reading ahead ([`StagedStore::warm_into`]) may spare lookups of this store
    /// an engine read: its engine's reads are worth it ([`KeyValueStore::warms`]), it is
    /// written behind, and keys not held in memory may be in the engine (not while every
    /// key written since the engine was empty is in memory).
    pub(crate) fn warms(&self) -> bool {
        self.inner.warms() && self.behind.as_ref().is_some_and(|b| b.may_use_engine())
    }

    /// Add `key` to `batch` when [`StagedStore::lookup`] of it would read the engine now
    /// (the key is neither staged nor held in memory, and may be in the engine), so that a
    /// [`Warmer`](super::Warmer) reads it ahead. Checks what a lookup reads before the
    /// engine, in the cheapest order for a key that is not there (the key filter, the
    /// resident index, the staged batches). Only with write-behind (see the `warm` module
    /// for why its values stay good).
    pub(crate) fn warm_into(&self, key: &[u8], batch: &mut super::WarmBatch) {
        let Some(b) = &self.behind else { return };
        if !b.may_be_in_engine(key)
            || b.resident.get(key).is_some()
            || self.pending.get(key).is_some()
            || self.sealed.iter().any(|(_, s)| s.get(key).is_some())
        {
            return;
        }
        batch.push(&self.inner, &self.warmed, key, b.evictions);
    }

    /// Hint that `key` is looked up soon ([`StagedStore::lookup`]): with write-behind, fetch
    /// the start of its probes in the resident index and the key filter into the cache (a
    /// miss per lookup in tables far larger than the cache). Changes nothing a read sees.
    pub(crate) fn prefetch(&self, key: &[u8]) {
        if let Some(b) = &self.behind {
            b.prefetch(key);
        }
    }

    /// Stage a put (`Some`) or delete (`None`) of `key`.
    pub(crate) fn stage(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        self.stage_copy(&key, value.as_deref());
    }

    /// As [`StagedStore::stage`], copying `key` and `value` into the store's own buffers.
    pub(crate) fn stage_copy(&mut self, key: &[u8], value: Option<&[u8]>) {
        let value = value.map(|v| self.arena.copy(v));
        let write = self.next_write();
        match self.pending.find(key) {
            Some(i) => drop(self.pending.set(i, value, write)),
            None => {
                let key = self.arena.copy(key);
                self.pending.insert_new(key, value, write);
            }
        }
    }

    fn next_write(&mut self) -> u32 {
        self.last_write = self.last_write.wrapping_add(1);
        self.last_write
    }

    /// As [`StagedStore::stage_copy`], for a write that stands for the source record at
    /// offset `owner` (a dedup mark): until the commit, [`StagedStore::withdraw`] can take
    /// it back if that record ends in the dead-letter topic.
    pub(crate) fn stage_for(&mut self, owner: i64, key: &[u8], value: Option<&[u8]>) {
        let written = value.map(|v| self.arena.copy(v));
        let write = self.next_write();
        let (op, before) = match self.pending.find(key) {
            Some(i) => (i, Some(self.pending.set(i, written, write))),
            None => {
                let key = self.arena.copy(key);
                (self.pending.insert_new(key, written, write), None)
            }
        };
        self.owned.push(Owned {
            owner,
            op: op as u32,
            write,
            before,
        });
    }

    /// Take back the writes staged with [`StagedStore::stage_for`] for the source record
    /// at offset `owner`, which was dead-lettered: each key gets back what the batch held
    /// for it before (nothing staged, or the earlier staged value), so the commit writes
    /// no changelog record and no engine write for it. A write that a later one replaced
    /// (the key written again since) stays replaced, and the later write, if withdrawn in
    /// turn, goes back to what the key held before both. Returns the writes taken back.
    pub(crate) fn withdraw(&mut self, owner: i64) -> Vec<Withdrawn> {
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
            let op = o.op as usize;
            if self.pending.write_at(op) == Some(o.write) {
                let (key, written) = self.pending.ops[op].clone();
                match o.before {
                    None => {
                        let moved = self.pending.remove_at(op);
                        for e in self.owned.iter_mut().filter(|e| e.op as usize == moved) {
                            e.op = o.op;
                        }
                    }
                    Some((v, w)) => drop(self.pending.set(op, v, w)),
                }
                out.push(Withdrawn {
                    owner,
                    key,
                    written,
                });
            } else {
                // Replaced since: the later writes of the key now stand on what this one
                // stood on.
                for later in self.owned[i..].iter_mut() {
                    if later.before.as_ref().is_some_and(|(_, w)| *w == o.write) {
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
    pub(crate) fn settle(&mut self) {
        self.owned.clear();
    }

    /// Whether a write of `key` is staged (in the open commit).
    pub(crate) fn is_staged(&self, key: &[u8]) -> bool {
        self.pending.get(key).is_some()
    }

    #[cfg(test)]
    /// Number of staged keys.
    pub(crate) fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Number of keys in the committed state, when the store knows it without a scan (a
    /// write-behind store whose engine was empty when opened, or keeps the count with its
    /// data as sled does).
    #[cfg(test)]
    pub(crate) fn known_len(&self) -> Option<u64> {
        self.behind.as_ref().and_then(|b| b.known_len)
    }

    #[cfg(test)]
    /// The staged writes in first-write order (but see [`StagedStore::withdraw`]), without
    /// removing them.
    pub(crate) fn pending(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        self.pending.ops.iter().map(|(k, v)| (&k[..], v.as_deref()))
    }

    /// Visit every entry of the committed state once (staged writes excluded): the
    /// engine's entries not changed since they were written, then the newer ones held in
    /// memory. Needs no wait for the writer: an entry it writes meanwhile is still held in
    /// memory (nothing leaves memory during the visit), so it is visited from there.
    ///
    /// # Errors
    /// An engine read failure, or the first error `f` returns.
    pub(crate) fn for_each_committed(
        &self,
        mut f: impl FnMut(&[u8], &[u8]) -> Result<()>,
    ) -> Result<()> {
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
    pub(crate) fn sync(&mut self) -> Result<()> {
        match &self.behind {
            None => Ok(()),
            Some(b) => b.sync(self.inner.name()),
        }
    }

    /// [`StagedStore::sync`], waiting at most until `deadline`: true when every committed
    /// batch is written. Batches left unwritten are skipped when the store closes; the
    /// engine then holds a prefix of the batches with the changelog offset of the last
    /// one written, and a restore replays the changelog from there.
    ///
    /// # Errors
    /// The engine's write error.
    pub(crate) fn sync_until(&mut self, deadline: std::time::Instant) -> Result<bool> {
        match &self.behind {
            None => Ok(true),
            Some(b) => b.sync_until(self.inner.name(), Some(deadline)),
        }
    }

    /// Make the staged writes committed, as one batch with `changelog_offset` (the
    /// changelog position after this batch's records).
    ///
    /// Nothing staged: nothing is written and the stored offset stays, whatever
    /// `changelog_offset` says. The batch wrote no changelog record, and an offset from
    /// elsewhere could skip a batch that was never persisted (one skipped when the store
    /// closed on a revocation): the restore must replay it.
    ///
    /// # Errors
    /// As [`KeyValueStore::write`] (for this batch or, written behind, an earlier one); the
    /// staged writes are dropped either way, since the runtime stops or rewinds on any
    /// failure.
    pub(crate) fn commit(&mut self, changelog_offset: Option<i64>) -> Result<()> {
        self.owned.clear();
        if self.pending.ops.is_empty() {
            return self.nothing_written();
        }
        let fresh = self.fresh_batch();
        let staged = std::mem::replace(&mut self.pending, fresh);
        self.hand_over(staged, changelog_offset)
    }

    /// An empty batch for the next writes: the spare buffers if any, else new ones sized
    /// for a batch like the current one.
    fn fresh_batch(&mut self) -> Staged {
        match self.spare.take() {
            Some(s) => s,
            None => Staged::with_capacity(self.pending.len().clamp(4096, 1 << 20)),
        }
    }

    /// A commit that wrote nothing: only an earlier background write failure to report.
    fn nothing_written(&self) -> Result<()> {
        match &self.behind {
            Some(b) => b.error(self.inner.name()),
            None => Ok(()),
        }
    }

    /// Write a committed batch (through the writer, or synchronously), then keep its
    /// emptied buffers as the spare.
    fn hand_over(&mut self, mut staged: Staged, changelog_offset: Option<i64>) -> Result<()> {
        let done = write_batch(&mut self.behind, &self.inner, &staged.ops, changelog_offset);
        staged.clear();
        self.spare = Some(staged);
        done
    }

    /// Seal the staged writes as the batch of commit `epoch` (a commit in flight, see
    /// `runtime::commit`): they stay readable, can no longer be withdrawn, and are written
    /// by [`StagedStore::commit_sealed`] once their changelog records are durable; new
    /// writes are staged in a fresh batch meanwhile. Nothing staged: nothing sealed.
    pub(crate) fn seal(&mut self, epoch: u64) {
        self.owned.clear();
        if self.pending.ops.is_empty() {
            return;
        }
        let fresh = self.fresh_batch();
        let staged = std::mem::replace(&mut self.pending, fresh);
        self.sealed.push_back((epoch, staged));
    }

    /// The writes sealed for commit `epoch` (none unless it is the oldest sealed batch), in
    /// first-write order.
    pub(crate) fn sealed(&self, epoch: u64) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        self.sealed
            .front()
            .filter(|(e, _)| *e == epoch)
            .into_iter()
            .flat_map(|(_, s)| s.ops.iter().map(|(k, v)| (&k[..], v.as_deref())))
    }

    /// Make the batch sealed for commit `epoch` (if any: it must be the oldest) committed,
    /// as one batch with `changelog_offset`; as [`StagedStore::commit`] (nothing sealed:
    /// the stored offset stays).
    ///
    /// # Errors
    /// As [`StagedStore::commit`].
    pub(crate) fn commit_sealed(
        &mut self,
        epoch: u64,
        changelog_offset: Option<i64>,
    ) -> Result<()> {
        let staged = match self.sealed.front() {
            Some((e, _)) if *e == epoch => self.sealed.pop_front().map(|(_, s)| s),
            _ => None,
        };
        match staged {
            Some(staged) if !staged.ops.is_empty() => self.hand_over(staged, changelog_offset),
            _ => self.nothing_written(),
        }
    }

    #[cfg(test)]
    /// Number of sealed batches (commits in flight holding writes of this store).
    pub(crate) fn sealed_len(&self) -> usize {
        self.sealed.len()
    }

    #[cfg(test)]
    /// Write a restored batch (changelog records in log order, with the position reached):
    /// committed at once, and persisted by the writer when there is one, else written now.
    /// Nothing must be staged meanwhile.
    ///
    /// # Errors
    /// The engine's write error (for this batch or, written behind, an earlier one).
    pub(crate) fn write_restored(&mut self, batch: WriteBatch) -> Result<()> {
        for (k, v) in &batch.ops {
            self.push_restored(k, v.as_deref());
        }
        self.flush_restored(batch.changelog_offset)
    }

    /// Add one changelog record (in log order) to the restored batch being built; copied.
    /// Nothing must be staged meanwhile.
    pub(crate) fn push_restored(&mut self, key: &[u8], value: Option<&[u8]>) {
        if self.restored.capacity() == 0 {
            self.restored.reserve(4096);
        }
        let k = self.arena.copy(key);
        let v = value.map(|v| self.arena.copy(v));
        self.restored.push((k, v));
    }

    /// Number of records added by [`StagedStore::push_restored`] since the last flush.
    pub(crate) fn restored_len(&self) -> usize {
        self.restored.len()
    }

    /// Write the records added by [`StagedStore::push_restored`] as one restored batch
    /// with `changelog_offset` (the position reached): see [`StagedStore::write_restored`].
    ///
    /// # Errors
    /// As [`StagedStore::write_restored`].
    pub(crate) fn flush_restored(&mut self, changelog_offset: Option<i64>) -> Result<()> {
        // Emptied after, keeping its capacity: the next step is likely as big as this one.
        let done = write_batch(
            &mut self.behind,
            &self.inner,
            &self.restored,
            changelog_offset,
        );
        self.restored.clear();
        done
    }

    /// Make room in memory for `n` more committed keys (a restore about to write them).
    pub(crate) fn reserve(&mut self, n: usize) {
        if let Some(b) = &mut self.behind {
            let n = n.min(b.resident_max);
            b.resident.reserve(n);
            if let KeyFilter::Hashes(f) = &mut b.filter {
                f.reserve(n);
            }
        }
    }

    /// Drop the staged and sealed writes (the commit failed or was aborted).
    pub(crate) fn abort(&mut self) {
        self.pending.clear();
        self.owned.clear();
        self.sealed.clear();
    }

    /// Forget what is held in memory of the committed state and look at the engine again;
    /// call after [`StagedStore::sync`] when the engine was changed directly (a restore
    /// plan that cleared it).
    pub(crate) fn reload(&mut self) {
        if let Some(b) = &mut self.behind {
            b.reload(self.inner.as_ref());
        }
    }

    /// The engine under the staging layer (restore and scans use it directly; call
    /// [`StagedStore::sync`] first to see every committed batch).
    pub(crate) fn engine(&self) -> &dyn KeyValueStore {
        self.inner.as_ref()
    }
}

/// Hand committed `ops` to the writer (`behind`), or write them to `engine` now without one.
fn write_batch(
    behind: &mut Option<Behind>,
    engine: &Arc<dyn KeyValueStore>,
    ops: &[(Bytes, Option<Bytes>)],
    changelog_offset: Option<i64>,
) -> Result<()> {
    match behind {
        Some(b) => b.submit(engine, ops, changelog_offset),
        None => engine.write_ops(&slices(ops), changelog_offset, None),
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
    use proptest::prelude::*;

    proptest! {
        /// A batch's lookups, ops and their order agree with a map model across inserts,
        /// overwrites and removes (a remove moves the last op into the hole).
        #[test]
        fn a_batch_matches_a_map_model(steps in proptest::collection::vec((0u8..3, 0u8..12, any::<u8>()), 0..80)) {
            let mut staged = Staged::with_capacity(2);
            let mut model: std::collections::HashMap<Vec<u8>, Option<Vec<u8>>> = Default::default();
            for (op, k, v) in steps {
                let key = vec![b'k', k];
                let value = (v % 4 != 0).then(|| vec![v]);
                match op {
                    0 | 1 => {
                        let value_b = value.clone().map(Bytes::from);
                        match staged.find(&key) {
                            Some(i) => drop(staged.set(i, value_b, 0)),
                            None => drop(staged.insert_new(Bytes::from(key.clone()), value_b, 0)),
                        }
                        model.insert(key, value);
                    }
                    _ => {
                        staged.remove(&key);
                        model.remove(&key);
                    }
                }
                prop_assert_eq!(staged.len(), model.len());
                for k in 0u8..12 {
                    let key = vec![b'k', k];
                    let got = staged.get(&key).map(|v| v.as_deref().map(<[u8]>::to_vec));
                    prop_assert_eq!(got, model.get(&key).cloned(), "key {}", k);
                }
                for (i, (k, v)) in staged.ops.iter().enumerate() {
                    prop_assert_eq!(staged.find(k), Some(i));
                    prop_assert_eq!(model.get(&k[..]).cloned(), Some(v.as_deref().map(<[u8]>::to_vec)));
                }
            }
        }

        /// Withdrawing agrees with a model that keeps each owned write's key, value and
        /// what it replaced, and tells writes apart by value (every value written here is
        /// unique): across owned puts, plain puts and deletes, settling, sealed, committed
        /// and dropped batches, and withdrawals in any order.
        #[test]
        fn withdrawals_match_a_model(steps in proptest::collection::vec((0u8..8, 0u8..6, 0i64..5), 0..80)) {
            type Model = (Vec<u8>, Option<Vec<u8>>, Option<Option<Vec<u8>>>);
            let backend = MemoryBackend::default();
            let mut s = StagedStore::new(backend.open("s", 0).unwrap(), None);
            let mut pending: std::collections::HashMap<Vec<u8>, Option<Vec<u8>>> = Default::default();
            let mut owned: Vec<(i64, Model)> = Vec::new();
            for (n, (op, k, owner)) in steps.into_iter().enumerate() {
                let key = vec![b'k', k];
                // Unique values; every third plain write a delete (an owned write is a
                // put: two deletes are not told apart by value).
                let value = Some(format!("v{n}").into_bytes());
                match op {
                    0 | 1 => {
                        s.stage_for(owner, &key, value.as_deref());
                        let before = pending.insert(key.clone(), value.clone());
                        owned.push((owner, (key, value, before)));
                    }
                    2 => {
                        let value = value.filter(|_| n % 3 != 0);
                        s.stage_copy(&key, value.as_deref());
                        pending.insert(key, value);
                    }
                    3 => {
                        s.settle();
                        owned.clear();
                    }
                    // The batch ends (sealed, committed or dropped): nothing of it can be
                    // withdrawn, and the next batch starts empty.
                    5 => {
                        s.seal(n as u64);
                        owned.clear();
                        pending.clear();
                    }
                    6 => {
                        s.commit(None).unwrap();
                        owned.clear();
                        pending.clear();
                    }
                    7 => {
                        s.abort();
                        owned.clear();
                        pending.clear();
                    }
                    _ => {
                        let got = s.withdraw(owner);
                        let mut want = Vec::new();
                        let mut i = owned.len();
                        while i > 0 {
                            i -= 1;
                            if owned[i].0 != owner {
                                continue;
                            }
                            let (_, (key, written, before)) = owned.remove(i);
                            if pending.get(&key) == Some(&written) {
                                match &before {
                                    None => drop(pending.remove(&key)),
                                    Some(v) => drop(pending.insert(key.clone(), v.clone())),
                                }
                                want.push((key, written));
                            } else {
                                for later in owned[i..].iter_mut() {
                                    if later.1.0 == key && later.1.2.as_ref() == Some(&written) {
                                        later.1.2 = before.clone();
                                    }
                                }
                            }
                        }
                        let got: Vec<(Vec<u8>, Option<Vec<u8>>)> = got
                            .into_iter()
                            .map(|w| (w.key.to_vec(), w.written.map(|v| v.to_vec())))
                            .collect();
                        prop_assert_eq!(got, want);
                    }
                }
                prop_assert_eq!(s.pending.writes.len(), s.pending.ops.len());
                let mut staged: Vec<(Vec<u8>, Option<Vec<u8>>)> = s
                    .pending()
                    .map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec)))
                    .collect();
                staged.sort();
                let mut model: Vec<_> = pending.clone().into_iter().collect();
                model.sort();
                prop_assert_eq!(staged, model);
            }
        }
    }
}
