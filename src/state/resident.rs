//! The resident index of a write-behind store: committed entries kept readable in memory,
//! and the key-hash filter that answers "not here" without a lookup.

use super::*;

/// Identity hasher for the key-hash filter (its values are already hashes).
#[derive(Default)]
pub(super) struct IdHasher(pub(super) u64);

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

pub(super) type HashFilter =
    std::collections::HashSet<u64, std::hash::BuildHasherDefault<IdHasher>>;

/// Which keys that are not held in memory a write-behind store's engine may hold.
pub(super) enum KeyFilter {
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
pub(super) const FILTER_SLACK: usize = 1024;

/// The ops of one committed batch, shared by the writer and the eviction bookkeeping.
pub(super) type Ops = Arc<Vec<(Bytes, Option<Bytes>)>>;

/// A committed batch still tracked in memory: its ops, for eviction once persisted.
pub(super) struct Tracked {
    pub(super) seq: u64,
    pub(super) ops: Ops,
}

/// Where the latest committed op of a resident key is: its batch (the batch's number in
/// [`Resident`], which counts resident batches only, wrapping) and its position in that
/// batch's ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) seq: u32,
    pub(super) idx: u32,
}

/// The committed batches held in memory, oldest first, and an index from each resident
/// key to its latest op. The index holds 8 bytes a key; keys and values stay in their
/// batch's ops (shared with the writer), so a restore writes each record once.
///
/// A batch without ops (a commit that only moves the changelog offset) is not held: it
/// has no key to index, and an instance commits one per interval for every partition
/// that had nothing new to write, forever.
pub(super) struct Resident {
    pub(super) batches: VecDeque<Tracked>,
    /// Number of the front batch (the next one pushed when empty); batches are numbered
    /// consecutively in push order, wrapping at u32::MAX.
    pub(super) first: u32,
    pub(super) index: hashbrown::HashTable<Slot>,
    pub(super) hash: ahash::RandomState,
    /// Ops held by `batches`.
    pub(super) ops: usize,
}

impl Resident {
    pub(super) fn new() -> Resident {
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
    pub(super) fn op(batches: &VecDeque<Tracked>, first: u32, s: Slot) -> &(Bytes, Option<Bytes>) {
        &batches[s.seq.wrapping_sub(first) as usize].ops[s.idx as usize]
    }

    pub(super) fn find(&self, key: &[u8]) -> Option<&(Bytes, Option<Bytes>)> {
        let h = self.hash.hash_one(key);
        let (batches, first) = (&self.batches, self.first);
        self.index
            .find(h, |s| Self::op(batches, first, *s).0[..] == *key)
            .map(|s| Self::op(batches, first, *s))
    }

    /// The latest committed value of `key` if it is resident (`Some(None)`: deleted).
    pub(super) fn get(&self, key: &[u8]) -> Option<&Option<Bytes>> {
        self.find(key).map(|(_, v)| v)
    }

    pub(super) fn contains(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }

    /// Resident keys.
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Every resident key with its latest value.
    pub(super) fn iter(&self) -> impl Iterator<Item = &(Bytes, Option<Bytes>)> {
        let (batches, first) = (&self.batches, self.first);
        self.index.iter().map(move |s| Self::op(batches, first, *s))
    }

    pub(super) fn reserve(&mut self, n: usize) {
        let (batches, first, hash) = (&self.batches, self.first, &self.hash);
        self.index
            .reserve(n, |s| hash.hash_one(&Self::op(batches, first, *s).0[..]));
    }

    /// Append batch `seq` and point its keys at it; `each` sees every op in order with
    /// whether its key was resident before and then held a value.
    pub(super) fn push(
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
    pub(super) fn pop_front(&mut self) {
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
