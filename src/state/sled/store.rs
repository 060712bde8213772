//! The sled tree of one (store, partition): entries packed into segments, with an index in
//! memory.
//!
//! sled's cost is per sled key: its leaves hold at most 16 entries and every insert copies
//! its leaf, so one sled key per dedup mark held the state writer at ~50k marks/s here
//! (`bench_sled`). Entries are therefore packed, up to [`SEGMENT_ENTRIES`] a segment, into
//! segments written whole: sled key `b's' ++ segment id (u32, big-endian)`, value a run of
//! entries `xxh3(key) (u64 LE) ++ key length (u32 LE) ++ key ++ value length (u32 LE) ++
//! value`. A batch's new entries go into new segments; an entry it overwrites or deletes is
//! removed from its old segment, which is rewritten (or removed once empty) in the same
//! sled batch. A key lives in at most one segment.
//!
//! The index maps the hash of each key to its segment (two keys with one hash: both
//! segments, read in turn). It lives in memory, built from the segments when the tree is
//! opened (they carry their keys' hashes, so no key is hashed again), and is changed only
//! after sled applied the batch, under the lock that lookups take, so a lookup sees either
//! the state before a batch or after it.
//!
//! Order: [`KeyValueStore::scan`] lists entries by `(xxh3(key), key)`, an order that a key
//! alone locates, so a scan continues after a key that has been deleted meanwhile.
//!
//! The changelog offset is stored under `b"m:changelog"` and the key count under
//! `b"m:keys"`, in the batch of the data they go with. Trees written by older versions (one
//! sled key `b'd' ++ key` per entry) are packed into segments when opened.

use super::super::{Counted, KeyValueStore, WriteBatch};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::Mutex;

/// Entries a new segment holds at most: fewer sled keys per entry written, against the
/// bytes a lookup reads and a delete rewrites (64 entries of a dedup mark: ~4 KiB).
pub(crate) const SEGMENT_ENTRIES: usize = 64;

const SEGMENT: u8 = b's';
/// The prefix of entries written by versions before segments.
const LEGACY_DATA: u8 = b'd';
pub(super) const META_CHANGELOG: &[u8] = b"m:changelog";
const META_KEYS: &[u8] = b"m:keys";
/// `by_hash` value of a hash shared by keys in several segments (see `collided`).
const SHARED: u32 = u32::MAX;

fn hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key)
}

fn segment_key(id: u32) -> [u8; 5] {
    let b = id.to_be_bytes();
    [SEGMENT, b[0], b[1], b[2], b[3]]
}

fn encode_entry(out: &mut Vec<u8>, h: u64, key: &[u8], value: &[u8]) {
    out.extend_from_slice(&h.to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
}

/// The entries of an encoded segment: `(hash, key, value)`, or an error naming what is
/// malformed (never a panic on damaged bytes).
struct Entries<'a> {
    rest: &'a [u8],
}

fn entries(segment: &[u8]) -> Entries<'_> {
    Entries { rest: segment }
}

impl<'a> Entries<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.rest.len() < n {
            return None;
        }
        let (a, b) = self.rest.split_at(n);
        self.rest = b;
        Some(a)
    }

    fn next_entry(&mut self) -> Option<(u64, &'a [u8], &'a [u8])> {
        let h = u64::from_le_bytes(self.take(8)?.try_into().ok()?);
        let klen = u32::from_le_bytes(self.take(4)?.try_into().ok()?) as usize;
        let key = self.take(klen)?;
        let vlen = u32::from_le_bytes(self.take(4)?.try_into().ok()?) as usize;
        let value = self.take(vlen)?;
        Some((h, key, value))
    }
}

impl<'a> Iterator for Entries<'a> {
    type Item = std::result::Result<(u64, &'a [u8], &'a [u8]), &'static str>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        match self.next_entry() {
            Some(e) => Some(Ok(e)),
            None => {
                self.rest = &[];
                Some(Err("a segment ends inside an entry"))
            }
        }
    }
}

/// A map from key hash to segment, in hash order (what [`KeyValueStore::scan`] walks),
/// without a tree walk per lookup: buckets by the hash's top bits, so that bucket order is
/// hash order, each a sorted run that a lookup binary-searches. The buckets double when they
/// hold [`BUCKET_FILL`] entries on average. A lookup reads one bucket (a `BTreeMap` of 750,000
/// random hashes took a cache miss per level: the state writer's hottest code in `perf`).
/// Keys crafted so that their hashes share their top bits make one bucket long: lookups in
/// it stay logarithmic, an insert into it moves its tail. A run grows by a quarter and is
/// trimmed when split: ~1.1 slots of 12 bytes a key, where doubling held ~1.7.
#[derive(Default)]
struct ByHash {
    /// `1 << bits` buckets (none before the first insert).
    buckets: Vec<Vec<HashEntry>>,
    bits: u32,
    len: usize,
}

/// Entries a bucket of [`ByHash`] holds on average before the buckets double.
const BUCKET_FILL: usize = 16;

/// Cache lines of a bucket's run [`ByHash::prefetch_run`] fetches: a run holds 8 to 16
/// entries of 12 bytes on average ([`BUCKET_FILL`]), at most 192 bytes over up to 4 lines
/// (runs are not aligned to lines).
const PREFETCH_LINES: usize = 4;

/// How many keys ahead the index's insert loop fetches a key's bucket (then its run,
/// at half the distance): far enough for the fetch to arrive, near enough to stay cached.
const INDEX_AHEAD: usize = 16;

/// The old segments a batch takes keys out of, by id: each one's bytes and the `(hash,
/// key)` pairs to drop from it.
type Touched<'a> = HashMap<u32, (::sled::IVec, Vec<(u64, &'a [u8])>)>;

/// A hash and its segment in 12 bytes (a `(u64, u32)` takes 16).
#[derive(Clone, Copy)]
struct HashEntry([u32; 3]);

impl HashEntry {
    fn new(h: u64, segment: u32) -> HashEntry {
        HashEntry([(h >> 32) as u32, h as u32, segment])
    }
    fn hash(self) -> u64 {
        (u64::from(self.0[0]) << 32) | u64::from(self.0[1])
    }
    fn segment(self) -> u32 {
        self.0[2]
    }
}

impl ByHash {
    fn bucket(&self, h: u64) -> usize {
        if self.bits == 0 {
            0
        } else {
            (h >> (64 - self.bits)) as usize
        }
    }

    /// Hint that `h` is placed or looked up soon: fetch its bucket's place in the bucket
    /// list into the cache. Changes nothing a read sees.
    fn prefetch_bucket(&self, h: u64) {
        if let Some(bucket) = self.buckets.get(self.bucket(h)) {
            crate::prefetch::prefetch(bucket);
        }
    }

    /// As [`ByHash::prefetch_bucket`], for the bucket's run: its first lines, found through
    /// the bucket list (whose line should be in the cache by then).
    fn prefetch_run(&self, h: u64) {
        let Some(bucket) = self.buckets.get(self.bucket(h)) else {
            return;
        };
        let bytes = bucket.len() * std::mem::size_of::<HashEntry>();
        let start = bucket.as_ptr().cast::<u8>();
        // A binary search reads a few entries spread over the run: fetch all of a run at
        // the average fill.
        for line in 0..bytes.div_ceil(64).min(PREFETCH_LINES) {
            crate::prefetch::prefetch(start.wrapping_add(line * 64));
        }
    }

    /// Position of `h` in its bucket, or where it would go.
    fn locate(&self, h: u64) -> (usize, std::result::Result<usize, usize>) {
        let b = self.bucket(h);
        (b, self.buckets[b].binary_search_by_key(&h, |e| e.hash()))
    }

    fn get(&self, h: u64) -> Option<u32> {
        if self.buckets.is_empty() {
            return None;
        }
        let (b, at) = self.locate(h);
        at.ok().map(|i| self.buckets[b][i].segment())
    }

    fn insert(&mut self, h: u64, segment: u32) {
        self.place(h, segment, true);
    }

    /// Map `h` to `segment` if `h` has no segment yet (`None`); else leave it and return
    /// its segment.
    fn insert_absent(&mut self, h: u64, segment: u32) -> Option<u32> {
        self.place(h, segment, false)
    }

    /// Map `h` to `segment` (a mapped `h` only when `replace`), with one search of the
    /// bucket (the state writer's hottest code in `perf`, once done twice per new key: to
    /// look, then to insert); `h`'s segment before, if any.
    fn place(&mut self, h: u64, segment: u32, replace: bool) -> Option<u32> {
        if self.buckets.is_empty() {
            self.buckets.push(Vec::new());
        }
        let (b, at) = self.locate(h);
        match at {
            Ok(i) => {
                let old = self.buckets[b][i].segment();
                if replace {
                    self.buckets[b][i] = HashEntry::new(h, segment);
                }
                return Some(old);
            }
            Err(i) => {
                let run = &mut self.buckets[b];
                if run.len() == run.capacity() {
                    // A quarter more, not twice: the index is 12 bytes a key of the store.
                    run.reserve_exact((run.len() / 4).max(4));
                }
                run.insert(i, HashEntry::new(h, segment));
                self.len += 1;
                if self.len > BUCKET_FILL << self.bits && self.bits < 40 {
                    self.grow();
                }
            }
        }
        None
    }

    fn remove(&mut self, h: u64) {
        if self.buckets.is_empty() {
            return;
        }
        if let (b, Ok(i)) = self.locate(h) {
            self.buckets[b].remove(i);
            self.len -= 1;
        }
    }

    /// Twice the buckets: each splits in two by the next bit, in order.
    fn grow(&mut self) {
        self.bits += 1;
        let old = std::mem::take(&mut self.buckets);
        self.buckets = Vec::with_capacity(1 << self.bits);
        for mut run in old {
            let cut = run.partition_point(|e| (e.hash() >> (64 - self.bits)) & 1 == 0);
            let upper = run.split_off(cut);
            // The lower half would keep the whole run's room.
            run.shrink_to_fit();
            self.buckets.push(run);
            self.buckets.push(upper);
        }
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The hashes from `from` on, in order.
    fn hashes_from(&self, from: u64) -> impl Iterator<Item = u64> + '_ {
        let first = if self.buckets.is_empty() {
            0
        } else {
            self.bucket(from)
        };
        self.buckets[first..]
            .iter()
            .flat_map(|run| run.iter().map(|e| e.hash()))
            .filter(move |h| *h >= from)
    }
}

/// The segments that may hold a key with one hash ([`Index::segments`]).
enum Segments<'a> {
    One([u32; 1]),
    Shared(&'a [u32]),
}

impl std::ops::Deref for Segments<'_> {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        match self {
            Segments::One(s) => s,
            Segments::Shared(s) => s,
        }
    }
}

/// Which segment holds each key, by key hash.
#[derive(Default)]
struct Index {
    /// Hash → segment, or [`SHARED`] when keys with this hash are in `collided`.
    by_hash: ByHash,
    /// Hash → the segment of each key with that hash (one per key), for shared hashes.
    collided: HashMap<u64, Vec<u32>>,
    /// Id of the next new segment.
    next_segment: u32,
}

impl Index {
    /// The segments that may hold a key with hash `h` (one per key with that hash).
    fn segments(&self, h: u64) -> Segments<'_> {
        match self.by_hash.get(h) {
            None => Segments::Shared(&[]),
            Some(SHARED) => Segments::Shared(self.collided.get(&h).map_or(&[], |v| &v[..])),
            Some(s) => Segments::One([s]),
        }
    }

    fn insert(&mut self, h: u64, segment: u32) {
        match self.by_hash.insert_absent(h, segment) {
            None => {}
            Some(SHARED) => self.collided.entry(h).or_default().push(segment),
            Some(other) => {
                self.by_hash.insert(h, SHARED);
                self.collided.insert(h, vec![other, segment]);
            }
        }
    }

    /// Forget one key with hash `h` in `segment`.
    fn remove(&mut self, h: u64, segment: u32) {
        match self.by_hash.get(h) {
            Some(SHARED) => {
                let Some(list) = self.collided.get_mut(&h) else {
                    return;
                };
                if let Some(i) = list.iter().position(|s| *s == segment) {
                    list.swap_remove(i);
                }
                match list.len() {
                    0 => {
                        self.collided.remove(&h);
                        self.by_hash.remove(h);
                    }
                    1 => {
                        let last = list[0];
                        self.collided.remove(&h);
                        self.by_hash.insert(h, last);
                    }
                    _ => {}
                }
            }
            Some(s) if s == segment => {
                self.by_hash.remove(h);
            }
            _ => {}
        }
    }

    fn clear(&mut self) {
        self.by_hash = ByHash::default();
        self.collided.clear();
    }
}

/// A [`KeyValueStore`] on one sled tree, its entries packed into segments (see the module
/// doc).
pub(crate) struct SledStore {
    name: String,
    tree: ::sled::Tree,
    /// Taken by lookups and writes alike: a write changes sled and the index under it.
    index: Mutex<Index>,
}

impl SledStore {
    /// The store of `tree`, its index built from the tree's segments; entries of the
    /// legacy layout are packed into segments first.
    ///
    /// # Errors
    /// [`Error::State`] when sled fails, or a segment is malformed.
    pub(crate) fn open(name: String, tree: ::sled::Tree) -> Result<SledStore> {
        let store = SledStore {
            name,
            tree,
            index: Mutex::new(Index::default()),
        };
        store.pack_legacy()?;
        {
            let mut ix = store.lock();
            for item in store.tree.scan_prefix([SEGMENT]) {
                let (k, v) = item.map_err(|e| store.err(e))?;
                let id = segment_id(&k).ok_or_else(|| store.err("malformed segment key"))?;
                for e in entries(&v) {
                    let (h, _, _) = e.map_err(|why| store.err(format!("segment {id}: {why}")))?;
                    ix.insert(h, id);
                }
                ix.next_segment = ix.next_segment.max(id.saturating_add(1));
            }
        }
        Ok(store)
    }

    fn err(&self, e: impl std::fmt::Display) -> Error {
        Error::state(&self.name, e)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Move the entries of the legacy layout (one sled key per entry) into segments, a
    /// segment at a time, each in one batch with the removal of the keys it took.
    fn pack_legacy(&self) -> Result<()> {
        let mut next = self
            .tree
            .scan_prefix([SEGMENT])
            .keys()
            .next_back()
            .transpose()
            .map_err(|e| self.err(e))?
            .and_then(|k| segment_id(&k))
            .map_or(0, |id| id.saturating_add(1));
        loop {
            let mut chunk = Vec::with_capacity(SEGMENT_ENTRIES);
            for item in self.tree.scan_prefix([LEGACY_DATA]).take(SEGMENT_ENTRIES) {
                chunk.push(item.map_err(|e| self.err(e))?);
            }
            if chunk.is_empty() {
                return Ok(());
            }
            let mut seg = Vec::new();
            let mut b = ::sled::Batch::default();
            for (k, v) in &chunk {
                encode_entry(&mut seg, hash(&k[1..]), &k[1..], v);
                b.remove(k.clone());
            }
            b.insert(&segment_key(next)[..], seg);
            self.tree.apply_batch(b).map_err(|e| self.err(e))?;
            next += 1;
        }
    }

    fn read_segment(&self, id: u32) -> Result<Option<::sled::IVec>> {
        self.tree.get(segment_key(id)).map_err(|e| self.err(e))
    }

    /// The value of `key` in segment `bytes` (hash `h`).
    fn find<'a>(&self, bytes: &'a [u8], h: u64, key: &[u8]) -> Result<Option<&'a [u8]>> {
        for e in entries(bytes) {
            let (eh, k, v) = e.map_err(|why| self.err(why))?;
            if eh == h && k == key {
                return Ok(Some(v));
            }
        }
        Ok(None)
    }

    /// Find the segment that holds `key` (hash `h`) before a batch, if any, and note in
    /// `touched` that the batch takes it out of there.
    fn find_older<'k>(
        &self,
        ix: &Index,
        h: u64,
        key: &'k [u8],
        touched: &mut Touched<'k>,
    ) -> Result<()> {
        for &s in ix.segments(h).iter() {
            let bytes = match touched.get(&s) {
                Some((b, _)) => b.clone(),
                None => match self.read_segment(s)? {
                    Some(b) => b,
                    None => continue,
                },
            };
            if self.find(&bytes, h, key)?.is_some() {
                touched
                    .entry(s)
                    .or_insert_with(|| (bytes, Vec::new()))
                    .1
                    .push((h, key));
                break;
            }
        }
        Ok(())
    }

    /// Apply `ops` (a later op on a key wins) and the metadata in one sled batch, then the
    /// index. A put whose `count` delta is `1` (a key the store did not hold) is not looked
    /// for in the index, unless an earlier op of the batch has the same key.
    fn apply<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        ops: &[(K, Option<V>)],
        changelog_offset: Option<i64>,
        count: Option<Counted<'_>>,
    ) -> Result<()> {
        let mut ix = self.lock();
        // The last op of each key, newest first, and whether its key was looked for in the
        // index (an older copy to take out of its segment).
        let mut seen: hashbrown::HashMap<&[u8], bool, ahash::RandomState> =
            hashbrown::HashMap::with_capacity_and_hasher(ops.len(), ahash::RandomState::new());
        let mut puts: Vec<(u64, &[u8], &[u8])> = Vec::with_capacity(ops.len());
        // Old segments an op takes a key out of: the segment's bytes and the keys to drop.
        let mut touched: Touched<'_> = HashMap::new();
        for (i, (k, v)) in ops.iter().enumerate().rev() {
            let k = k.as_ref();
            match seen.get_mut(k) {
                // An earlier op on a key whose last op was taken as new: the key may have
                // been held before the batch after all.
                Some(looked) if !*looked => {
                    *looked = true;
                    self.find_older(&ix, hash(k), k, &mut touched)?;
                    continue;
                }
                Some(_) => continue,
                None => {}
            }
            let h = hash(k);
            let new = v.is_some() && count.is_some_and(|c| c.deltas.get(i) == Some(&1));
            if !new {
                self.find_older(&ix, h, k, &mut touched)?;
            }
            seen.insert(k, !new);
            if let Some(v) = v {
                puts.push((h, k, v.as_ref()));
            }
        }
        puts.reverse();
        let mut b = ::sled::Batch::default();
        for (&s, (bytes, drops)) in &touched {
            let mut kept = Vec::with_capacity(bytes.len());
            for e in entries(bytes) {
                let (h, k, v) = e.map_err(|why| self.err(format!("segment {s}: {why}")))?;
                if !drops.iter().any(|(dh, dk)| *dh == h && *dk == k) {
                    encode_entry(&mut kept, h, k, v);
                }
            }
            if kept.is_empty() {
                b.remove(&segment_key(s)[..]);
            } else {
                b.insert(&segment_key(s)[..], kept);
            }
        }
        let first_new = ix.next_segment;
        let new_segments = puts.len().div_ceil(SEGMENT_ENTRIES);
        let Some(next) = u32::try_from(new_segments)
            .ok()
            .and_then(|n| first_new.checked_add(n))
            .filter(|n| *n < SHARED)
        else {
            return Err(self.err("segment ids exhausted"));
        };
        for (i, chunk) in puts.chunks(SEGMENT_ENTRIES).enumerate() {
            let mut seg =
                Vec::with_capacity(chunk.iter().map(|(_, k, v)| 16 + k.len() + v.len()).sum());
            for (h, k, v) in chunk {
                encode_entry(&mut seg, *h, k, v);
            }
            b.insert(&segment_key(first_new + i as u32)[..], seg);
        }
        if let Some(off) = changelog_offset {
            b.insert(META_CHANGELOG, &off.to_be_bytes()[..]);
        }
        match count {
            Some(c) => b.insert(META_KEYS, &c.after.to_be_bytes()[..]),
            // A write without a count makes a stored count stale.
            None => b.remove(META_KEYS),
        }
        self.tree.apply_batch(b).map_err(|e| self.err(e))?;
        // sled holds the batch: now the index (removals first, so that a key moved to a new
        // segment is not taken for a second key with its hash).
        for (&s, (_, drops)) in &touched {
            for (h, _) in drops {
                ix.remove(*h, s);
            }
        }
        // Each key's bucket is fetched INDEX_AHEAD keys before its insert and its run
        // half as many: the runs of a large store are far larger than the cache.
        for (i, (h, _, _)) in puts.iter().enumerate() {
            if let Some((ahead, _, _)) = puts.get(i + INDEX_AHEAD) {
                ix.by_hash.prefetch_bucket(*ahead);
            }
            if let Some((ahead, _, _)) = puts.get(i + INDEX_AHEAD / 2) {
                ix.by_hash.prefetch_run(*ahead);
            }
            ix.insert(*h, first_new + (i / SEGMENT_ENTRIES) as u32);
        }
        ix.next_segment = next;
        Ok(())
    }
}

fn segment_id(key: &[u8]) -> Option<u32> {
    match key {
        [SEGMENT, rest @ ..] => rest.try_into().ok().map(u32::from_be_bytes),
        _ => None,
    }
}

impl KeyValueStore for SledStore {
    fn name(&self) -> &str {
        &self.name
    }

    fn memory_bytes(&self, wait: bool) -> Option<usize> {
        let ix = match self.index.try_lock() {
            Ok(ix) => ix,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) if wait => self.lock(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        let buckets = &ix.by_hash.buckets;
        let entry = std::mem::size_of::<HashEntry>();
        // The shared hashes' map: its slots (a control byte each) and their lists.
        let shared: usize = ix.collided.capacity() * (std::mem::size_of::<(u64, Vec<u32>)>() + 1)
            + ix.collided
                .values()
                .map(|v| v.capacity() * 4)
                .sum::<usize>();
        Some(
            buckets.capacity() * std::mem::size_of::<Vec<HashEntry>>()
                + buckets.iter().map(|b| b.capacity() * entry).sum::<usize>()
                + shared,
        )
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let ix = self.lock();
        let h = hash(key);
        for &s in ix.segments(h).iter() {
            if let Some(bytes) = self.read_segment(s)? {
                if let Some(v) = self.find(&bytes, h, key)? {
                    return Ok(Some(v.to_vec()));
                }
            }
        }
        Ok(None)
    }

    fn warms(&self) -> bool {
        true
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        self.apply(&batch.ops, batch.changelog_offset, None)
    }

    fn write_ops(
        &self,
        ops: &[(&[u8], Option<&[u8]>)],
        changelog_offset: Option<i64>,
        count: Option<Counted<'_>>,
    ) -> Result<()> {
        self.apply(ops, changelog_offset, count)
    }

    fn key_count(&self) -> Result<Option<u64>> {
        let v = self.tree.get(META_KEYS).map_err(|e| self.err(e))?;
        Ok(v.and_then(|b| <[u8; 8]>::try_from(b.as_ref()).ok().map(u64::from_be_bytes)))
    }

    fn clear(&self) -> Result<()> {
        let mut ix = self.lock();
        self.tree.clear().map_err(|e| self.err(e))?;
        ix.clear();
        Ok(())
    }

    fn changelog_offset(&self) -> Result<Option<i64>> {
        let v = self.tree.get(META_CHANGELOG).map_err(|e| self.err(e))?;
        match v {
            None => Ok(None),
            Some(b) => {
                let arr: [u8; 8] = b
                    .as_ref()
                    .try_into()
                    .map_err(|_| self.err("stored changelog offset is not 8 bytes"))?;
                Ok(Some(i64::from_be_bytes(arr)))
            }
        }
    }

    /// Entries in `(xxh3(key), key)` order (see the module doc), after `after`.
    fn scan(&self, after: Option<&[u8]>, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let ix = self.lock();
        let start = after.map(|a| (hash(a), a));
        let mut read: HashMap<u32, Option<::sled::IVec>> = HashMap::new();
        let mut out = Vec::new();
        for h in ix.by_hash.hashes_from(start.map_or(0, |(h, _)| h)) {
            if out.len() >= limit {
                break;
            }
            let mut found: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
            let mut segs = ix.segments(h).to_vec();
            segs.sort_unstable();
            segs.dedup();
            for s in segs {
                let bytes = match read.get(&s) {
                    Some(b) => b.clone(),
                    None => {
                        let b = self.read_segment(s)?;
                        read.insert(s, b.clone());
                        b
                    }
                };
                let Some(bytes) = bytes else { continue };
                for e in entries(&bytes) {
                    let (eh, k, v) = e.map_err(|why| self.err(format!("segment {s}: {why}")))?;
                    if eh == h {
                        found.push((k.to_vec(), v.to_vec()));
                    }
                }
            }
            found.sort_unstable();
            for (k, v) in found {
                if let Some((ah, ak)) = start {
                    if h == ah && k.as_slice() <= ak {
                        continue;
                    }
                }
                if out.len() >= limit {
                    break;
                }
                out.push((k, v));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    proptest::proptest! {
        /// `ByHash` answers and orders as a `BTreeMap` does, through growth, with hashes
        /// spread or sharing their top bits.
        #[test]
        fn by_hash_matches_an_ordered_map(
            ops in proptest::collection::vec(
                (proptest::prelude::any::<bool>(), 0u64..3000, proptest::prelude::any::<bool>(), 0u32..9),
                0..2000,
            ),
            from in proptest::prelude::any::<u64>(),
        ) {
            let mut ix = ByHash::default();
            let mut model: BTreeMap<u64, u32> = BTreeMap::new();
            for (put, n, spread, seg) in ops {
                // Spread: all over the hash space; else close together (one bucket).
                let h = if spread { n.wrapping_mul(0x9E37_79B9_7F4A_7C15) } else { n };
                if put {
                    ix.insert(h, seg);
                    model.insert(h, seg);
                } else {
                    ix.remove(h);
                    model.remove(&h);
                }
            }
            proptest::prop_assert_eq!(ix.len, model.len());
            for (&h, &seg) in &model {
                proptest::prop_assert_eq!(ix.get(h), Some(seg));
            }
            proptest::prop_assert_eq!(ix.get(from), model.get(&from).copied());
            let all: Vec<u64> = ix.hashes_from(0).collect();
            proptest::prop_assert_eq!(all, model.keys().copied().collect::<Vec<_>>());
            for start in [from, 0, 1, u64::MAX, 1500] {
                let got: Vec<u64> = ix.hashes_from(start).collect();
                let want: Vec<u64> = model.range(start..).map(|(h, _)| *h).collect();
                proptest::prop_assert_eq!(got, want, "from {}", start);
            }
        }
    }
    use proptest::prelude::*;

    fn tree(dir: &std::path::Path) -> ::sled::Tree {
        let db = ::sled::Config::new().path(dir).open().unwrap();
        db.open_tree("t-0").unwrap()
    }

    /// Every entry, by following the scan cursor `limit` entries at a time.
    fn scan_all(s: &SledStore, limit: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut out = Vec::new();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let chunk = s.scan(after.as_deref(), limit).unwrap();
            out.extend(chunk.iter().cloned());
            if chunk.len() < limit {
                return out;
            }
            after = chunk.last().map(|(k, _)| k.clone());
        }
    }

    #[test]
    fn a_tree_of_the_legacy_layout_is_packed_into_segments_when_opened() {
        let dir = tempfile::tempdir().unwrap();
        let t = tree(dir.path());
        for i in 0..1000u32 {
            let mut k = vec![LEGACY_DATA];
            k.extend_from_slice(format!("key-{i}").as_bytes());
            t.insert(k, &i.to_be_bytes()[..]).unwrap();
        }
        t.insert(META_CHANGELOG, &41i64.to_be_bytes()[..]).unwrap();
        let s = SledStore::open("t/0".into(), t.clone()).unwrap();
        assert_eq!(
            t.scan_prefix([LEGACY_DATA]).count(),
            0,
            "nothing left unpacked"
        );
        assert_eq!(
            t.scan_prefix([SEGMENT]).count(),
            1000usize.div_ceil(SEGMENT_ENTRIES)
        );
        assert_eq!(
            s.get(b"key-999").unwrap(),
            Some(999u32.to_be_bytes().to_vec())
        );
        assert_eq!(s.changelog_offset().unwrap(), Some(41));
        assert_eq!(scan_all(&s, 7).len(), 1000);
    }

    /// The index's memory: 12 bytes a key at least; not waited for while a batch being
    /// written holds the index (the run loop's gauge), waited for otherwise.
    #[test]
    fn index_memory_is_counted_and_not_waited_for_when_asked_not_to() {
        let dir = tempfile::tempdir().unwrap();
        let s = SledStore::open("t/0".into(), tree(dir.path())).unwrap();
        assert_eq!(s.memory_bytes(false), Some(0));
        let ops: Vec<(Vec<u8>, Option<Vec<u8>>)> = (0..1000u32)
            .map(|i| (i.to_be_bytes().to_vec(), Some(vec![1; 8])))
            .collect();
        s.write(WriteBatch {
            ops,
            changelog_offset: Some(1),
        })
        .unwrap();
        let bytes = s.memory_bytes(false).unwrap();
        assert!(bytes >= 1000 * 12, "{bytes}");
        let held = s.lock();
        assert_eq!(s.memory_bytes(false), None, "busy: not waited for");
        drop(held);
        assert_eq!(s.memory_bytes(true), Some(bytes));
    }

    #[test]
    fn writes_touch_one_sled_key_per_segment_not_per_entry() {
        let dir = tempfile::tempdir().unwrap();
        let s = SledStore::open("t/0".into(), tree(dir.path())).unwrap();
        let ops: Vec<(Vec<u8>, Option<Vec<u8>>)> = (0..1000u32)
            .map(|i| (i.to_be_bytes().to_vec(), Some(vec![1u8; 20])))
            .collect();
        s.write(WriteBatch {
            ops,
            changelog_offset: Some(1),
        })
        .unwrap();
        let sled_keys = s.tree.iter().count();
        // The segments plus the changelog offset.
        assert_eq!(sled_keys, 1000usize.div_ceil(SEGMENT_ENTRIES) + 1);
        // The index points each key at the segment it went into.
        for i in 0..1000u32 {
            assert_eq!(
                s.get(&i.to_be_bytes()).unwrap(),
                Some(vec![1u8; 20]),
                "key {i}"
            );
        }
        // Overwriting and deleting rewrites the old segments: each key stays in one.
        let ops: Vec<(Vec<u8>, Option<Vec<u8>>)> = (0..1000u32)
            .step_by(2)
            .map(|i| (i.to_be_bytes().to_vec(), (i % 4 == 0).then(|| vec![2u8; 5])))
            .collect();
        s.write(WriteBatch {
            ops,
            changelog_offset: Some(2),
        })
        .unwrap();
        let stored: usize = s
            .tree
            .scan_prefix([SEGMENT])
            .map(|e| entries(&e.unwrap().1).count())
            .sum();
        assert_eq!(stored, 750);
        assert_eq!(s.get(&0u32.to_be_bytes()).unwrap(), Some(vec![2u8; 5]));
        assert_eq!(s.get(&2u32.to_be_bytes()).unwrap(), None);
        assert_eq!(s.get(&3u32.to_be_bytes()).unwrap(), Some(vec![1u8; 20]));
    }

    #[test]
    fn keys_sharing_a_hash_are_kept_apart() {
        let mut ix = Index::default();
        ix.insert(7, 1);
        ix.insert(7, 2);
        ix.insert(7, 2);
        assert_eq!(&*ix.segments(7), &[1, 2, 2]);
        ix.remove(7, 2);
        assert_eq!(&*ix.segments(7), &[1, 2]);
        ix.remove(7, 1);
        assert_eq!(&*ix.segments(7), &[2]);
        assert!(ix.collided.is_empty());
        ix.remove(7, 2);
        assert!(ix.segments(7).is_empty());
        assert!(ix.by_hash.is_empty());
    }

    #[test]
    fn a_malformed_segment_is_an_error_naming_the_store_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let t = tree(dir.path());
        let mut seg = Vec::new();
        encode_entry(&mut seg, hash(b"a"), b"a", b"1");
        seg.extend_from_slice(&[1, 2, 3]);
        t.insert(segment_key(0), seg).unwrap();
        let err = SledStore::open("dedup/3".into(), t).err().expect("refused");
        let msg = err.to_string();
        assert!(
            msg.contains("dedup/3") && msg.contains("segment 0"),
            "{msg}"
        );
    }

    /// The index holds a key in about 12 bytes and its share of a bucket: runs grow by a
    /// quarter and are trimmed when split, where doubling left half of them empty.
    #[test]
    fn the_hash_index_keeps_little_room_unused() {
        let mut ix = ByHash::default();
        let n = 200_000u64;
        for i in 0..n {
            ix.insert(xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()), i as u32);
        }
        let room: usize = ix.buckets.iter().map(Vec::capacity).sum();
        let used = room as f64 / n as f64;
        assert!(used <= 1.4, "{used:.2} slots held a key");
        assert!(
            (0..n).all(|i| ix.get(xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes())) == Some(i as u32))
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// The segmented store against a map, reopened between batches: any raw keys (a few
        /// bytes, so overwrites and deletes are common), a later op on a key winning, and
        /// scans continued from any cursor, including one deleted since. Every other batch
        /// comes with its key count ([`Counted`], as the write-behind writer sends it), whose
        /// new-key deltas let the store skip looking for older copies: a key deleted and put
        /// again in one batch must still leave its old segment.
        #[test]
        fn matches_a_map_model_across_reopens(
            batches in proptest::collection::vec(
                proptest::collection::vec(
                    (proptest::collection::vec(0u8..4, 0..3), proptest::option::of(any::<u8>())),
                    0..150),
                1..6),
            limit in 1usize..9,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let db = ::sled::Config::new().path(dir.path()).open().unwrap();
            let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
            for (i, ops) in batches.into_iter().enumerate() {
                let s = SledStore::open("p/0".into(), db.open_tree("p-0").unwrap()).unwrap();
                let ops: Vec<_> = ops.into_iter().map(|(k, v)| (k, v.map(|b| vec![b]))).collect();
                let mut deltas: Vec<i8> = Vec::new();
                for (k, v) in &ops {
                    let held = model.contains_key(k);
                    deltas.push(i8::from(v.is_some()) - i8::from(held));
                    match v { Some(v) => { model.insert(k.clone(), v.clone()); } None => { model.remove(k); } }
                }
                let cursor = s.scan(None, 1).unwrap().pop();
                if i % 2 == 1 {
                    let slices: Vec<(&[u8], Option<&[u8]>)> =
                        ops.iter().map(|(k, v)| (&k[..], v.as_deref())).collect();
                    let count = Counted { after: model.len() as u64, deltas: &deltas };
                    s.write_ops(&slices, Some(i as i64), Some(count)).unwrap();
                    prop_assert_eq!(s.key_count().unwrap(), Some(model.len() as u64));
                } else {
                    s.write(WriteBatch { ops, changelog_offset: Some(i as i64) }).unwrap();
                }
                for (k, v) in &model {
                    prop_assert_eq!(s.get(k).unwrap(), Some(v.clone()));
                }
                let all = scan_all(&s, limit);
                let mut sorted = all.clone();
                sorted.sort();
                prop_assert_eq!(sorted, model.clone().into_iter().collect::<Vec<_>>());
                // The order is (hash, key), so a cursor continues where it would have.
                if let Some((c, _)) = cursor {
                    let rest = s.scan(Some(&c), usize::MAX).unwrap();
                    let want: Vec<_> = all
                        .iter()
                        .filter(|(k, _)| (hash(k), k) > (hash(&c), &c))
                        .cloned()
                        .collect();
                    prop_assert_eq!(rest, want);
                }
            }
        }
    }
}
