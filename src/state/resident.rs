//! The resident index of a write-behind store: committed entries kept readable in memory,
//! and the key-hash filter that answers "not here" without a lookup.

pub(super) use super::slots::HashFilter;
use super::slots::{Probe, SlotTable};
use super::*;

/// The filter entry of `key`: the low 32 bits of its hash by `state` (one per store).
pub(super) fn filter_key(state: &ahash::RandomState, key: &[u8]) -> u32 {
    state.hash_one(key) as u32
}

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
pub(super) type Ops = Arc<Packed>;

/// The ops of one committed batch, packed for the time they stay in memory (until the
/// writer has persisted them, and then while resident): every key and value copied into
/// one buffer, each preceded by its length as a LEB128 varint (a value's length plus one,
/// 0 for a delete), and 4 bytes of bookkeeping an op (its start in the buffer), where a
/// pair of [`Bytes`] takes 64 and holds on to the staging arena's blocks. For dedup
/// entries of the bench (13-byte keys, ~13-byte values) that is ~32 bytes an op in place
/// of ~90.
pub(crate) struct Packed {
    data: Bytes,
    /// Where each op starts in `data`.
    ops: Vec<u32>,
}

/// The varint at `at` in `data` (written by `prost::encoding::encode_varint`) and the
/// position after it.
fn get_len(data: &[u8], mut at: usize) -> (usize, usize) {
    let (mut n, mut shift) = (0usize, 0);
    loop {
        let b = data[at];
        at += 1;
        n |= usize::from(b & 0x7f) << shift;
        if b < 0x80 {
            return (n, at);
        }
        shift += 7;
    }
}

impl Packed {
    /// `ops` (puts and deletes in order) copied into one buffer.
    ///
    /// # Errors
    /// [`crate::Error::State`] naming `store` when the batch's keys and values take 4 GiB or
    /// more.
    pub(crate) fn pack(store: &str, ops: &[(Bytes, Option<Bytes>)]) -> Result<Packed> {
        let size: usize = ops
            .iter()
            .map(|(k, v)| k.len() + v.as_ref().map_or(0, |v| v.len()) + 2)
            .sum();
        let mut data = Vec::with_capacity(size);
        let mut packed = Vec::with_capacity(ops.len());
        use prost::encoding::encode_varint;
        for (k, v) in ops {
            // Checked below: every start is at most the buffer's length.
            packed.push(data.len() as u32);
            encode_varint(k.len() as u64, &mut data);
            data.extend_from_slice(k);
            match v {
                Some(v) => {
                    encode_varint(v.len() as u64 + 1, &mut data);
                    data.extend_from_slice(v);
                }
                None => encode_varint(0, &mut data),
            }
        }
        if u32::try_from(data.len()).is_err() {
            return Err(crate::Error::state(
                store,
                "a committed batch of 4 GiB or more cannot be held in memory",
            ));
        }
        Ok(Packed {
            data: Bytes::from(data),
            ops: packed,
        })
    }

    /// Number of ops.
    pub(crate) fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether there is no op.
    pub(crate) fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Where op `i` starts in the buffer (what [`Packed::op_at`] takes).
    pub(crate) fn start(&self, i: usize) -> u32 {
        self.ops[i]
    }

    /// Key of the op starting at `at`.
    pub(crate) fn key_at(&self, at: u32) -> &[u8] {
        let (len, at) = get_len(&self.data, at as usize);
        &self.data[at..at + len]
    }

    fn value_range(&self, at: u32) -> Option<std::ops::Range<usize>> {
        let (key_len, at) = get_len(&self.data, at as usize);
        let (n, start) = get_len(&self.data, at + key_len);
        (n != 0).then(|| start..start + n - 1)
    }

    /// Value of the op starting at `at` (`None`: a delete), sharing the buffer.
    pub(crate) fn value_bytes_at(&self, at: u32) -> Option<Bytes> {
        self.value_range(at).map(|r| self.data.slice(r))
    }

    /// The op starting at `at`, as key and value.
    pub(crate) fn op_at(&self, at: u32) -> (&[u8], Option<&[u8]>) {
        (self.key_at(at), self.value_range(at).map(|r| &self.data[r]))
    }

    /// Op `i` as key and value.
    #[cfg(test)]
    pub(crate) fn op(&self, i: usize) -> (&[u8], Option<&[u8]>) {
        self.op_at(self.start(i))
    }

    /// The ops in `range`, in order, as borrowed slices (what
    /// [`KeyValueStore::write_ops`] takes).
    pub(crate) fn slices(&self, range: std::ops::Range<usize>) -> Vec<(&[u8], Option<&[u8]>)> {
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "ops {range:?} of a batch of {}",
            self.len()
        );
        let at = self
            .ops
            .get(range.start)
            .map_or(self.data.len(), |a| *a as usize);
        PackedIter {
            data: &self.data,
            at,
        }
        .take(range.len())
        .collect()
    }

    /// Every op in order, read front to back (each length decoded once, no lookup in the
    /// op starts).
    pub(crate) fn iter(&self) -> PackedIter<'_> {
        PackedIter {
            data: &self.data,
            at: 0,
        }
    }
}

/// The ops of a [`Packed`] in order from a position, as key and value (`None`: a delete).
pub(crate) struct PackedIter<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Iterator for PackedIter<'a> {
    type Item = (&'a [u8], Option<&'a [u8]>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.data.len() {
            return None;
        }
        let (key_len, at) = get_len(self.data, self.at);
        let key = &self.data[at..at + key_len];
        let (n, start) = get_len(self.data, at + key_len);
        let value = (n != 0).then(|| &self.data[start..start + n - 1]);
        self.at = start + n.saturating_sub(1);
        Some((key, value))
    }
}

/// A committed batch still tracked in memory: its ops, for eviction once persisted.
pub(super) struct Tracked {
    pub(super) seq: u64,
    pub(super) ops: Ops,
}

/// Where the latest committed op of a resident key is: its batch (the batch's number in
/// [`Resident`], which counts resident batches only, wrapping) and where the op starts in
/// that batch's buffer (so a probe reads the key without reading the op starts first);
/// with 32 bits of the key's hash, so that growing the index rehashes without reading a
/// key, and a probe reads a key only when these bits match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) seq: u32,
    pub(super) at: u32,
    pub(super) hash: u32,
}

/// The 32 bits of a key's 64-bit hash that its [`Slot`] keeps.
fn short(h: u64) -> u32 {
    (h >> 32) as u32
}

/// How many keys ahead of the one it inserts or removes a loop over a batch prefetches
/// the first slot of (in the resident index, and in the key filter when a batch goes in).
pub(super) const PREFETCH_AHEAD: usize = 8;

/// The 32 kept bits of each key's hash of `ops`, in order.
fn key_hashes(hash: &ahash::RandomState, ops: &Packed) -> Vec<u32> {
    ops.iter().map(|(k, _)| short(hash.hash_one(k))).collect()
}

/// The committed batches held in memory, oldest first, and an index from each resident
/// key to its latest op. The index holds a 12-byte slot a key, in a table at most three
/// quarters full ([`SlotTable`]); keys and values stay in their batch's ops (shared with the
/// writer), so a restore writes each record once.
///
/// A batch without ops (a commit that only moves the changelog offset) is not held: it
/// has no key to index, and an instance commits one per interval for every partition
/// that had nothing new to write, forever.
pub(super) struct Resident {
    pub(super) batches: VecDeque<Tracked>,
    /// Number of the front batch (the next one pushed when empty); batches are numbered
    /// consecutively in push order, wrapping at u32::MAX.
    pub(super) first: u32,
    index: SlotTable,
    pub(super) hash: ahash::RandomState,
    /// Ops held by `batches`.
    pub(super) ops: usize,
}

impl Resident {
    /// Bytes of the resident batches (their packed ops) and of the index.
    pub(super) fn memory_bytes(&self) -> usize {
        let batches: usize = self
            .batches
            .iter()
            .map(|t| t.ops.data.len() + t.ops.ops.capacity() * 4)
            .sum();
        batches + self.index.memory_bytes()
    }

    pub(super) fn new() -> Resident {
        Resident {
            batches: VecDeque::new(),
            first: 0,
            index: SlotTable::default(),
            hash: ahash::RandomState::new(),
            ops: 0,
        }
    }

    /// The batch a slot points into (`first`: the front batch's number). Slots only point
    /// into resident batches, whose numbers are consecutive.
    fn batch(batches: &VecDeque<Tracked>, first: u32, s: Slot) -> &Packed {
        &batches[s.seq.wrapping_sub(first) as usize].ops
    }

    /// The key and value a slot points at.
    pub(super) fn op(batches: &VecDeque<Tracked>, first: u32, s: Slot) -> (&[u8], Option<&[u8]>) {
        Self::batch(batches, first, s).op_at(s.at)
    }

    fn key_at(batches: &VecDeque<Tracked>, first: u32, s: Slot) -> &[u8] {
        Self::batch(batches, first, s).key_at(s.at)
    }

    fn find(&self, key: &[u8]) -> Option<Slot> {
        let h = short(self.hash.hash_one(key));
        let (batches, first) = (&self.batches, self.first);
        self.index
            .find(h, |s| Self::key_at(batches, first, *s) == key)
    }

    /// The latest committed value of `key` if it is resident (`Some(None)`: deleted),
    /// sharing its batch's buffer.
    pub(super) fn get(&self, key: &[u8]) -> Option<Option<Bytes>> {
        self.find(key)
            .map(|s| Self::batch(&self.batches, self.first, s).value_bytes_at(s.at))
    }

    /// Hint that `key` is looked up soon: fetch the cache line its probe starts at.
    pub(super) fn prefetch(&self, key: &[u8]) {
        self.index.prefetch(short(self.hash.hash_one(key)));
    }

    pub(super) fn contains(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }

    /// Resident keys.
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Every resident key with its latest value.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        let (batches, first) = (&self.batches, self.first);
        self.index.iter().map(move |s| Self::op(batches, first, *s))
    }

    /// The key of every op the resident batches hold, oldest batch first, each batch read
    /// front to back: the keys of [`Resident::iter`] (batches leave oldest first, so a key
    /// with an op here has its latest op here too), each once per op on it, read without
    /// the cache miss per key of reading each where the index points.
    pub(super) fn op_keys(&self) -> impl Iterator<Item = &[u8]> {
        self.batches
            .iter()
            .flat_map(|b| b.ops.iter().map(|(k, _)| k))
    }

    pub(super) fn reserve(&mut self, n: usize) {
        self.index.reserve(n);
    }

    /// Append batch `seq` and point its keys at it; `each` sees every op in order with
    /// whether its key was resident before and then held a value.
    pub(super) fn push(
        &mut self,
        seq: u64,
        ops: Ops,
        mut each: impl FnMut(&[u8], Option<&[u8]>, Option<bool>) -> Result<()>,
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
        // No growth while the batch's keys go in: the slots prefetched stay where they are.
        self.index.reserve(ops.len());
        let hashes = key_hashes(&self.hash, &ops);
        let (batches, first) = (&self.batches, self.first);
        let index = &mut self.index;
        for (i, (k, v)) in ops.iter().enumerate() {
            if let Some(ahead) = hashes.get(i + PREFETCH_AHEAD) {
                index.prefetch(*ahead);
            }
            let h = hashes[i];
            let slot = Slot {
                seq: no,
                at: ops.start(i),
                hash: h,
            };
            let old = match index.probe(h, |s| Self::key_at(batches, first, *s) == k) {
                Probe::Found(at) => {
                    let was = Self::op(batches, first, index.get(at)).1.is_some();
                    index.set(at, slot);
                    Some(was)
                }
                Probe::Vacant(at) => {
                    index.set(at, slot);
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
        let hashes = key_hashes(&self.hash, &b.ops);
        let index = &mut self.index;
        let seq = self.first;
        for (i, h) in hashes.iter().enumerate() {
            if let Some(ahead) = hashes.get(i + PREFETCH_AHEAD) {
                index.prefetch(*ahead);
            }
            let at = Slot {
                seq,
                at: b.ops.start(i),
                hash: *h,
            };
            if let Probe::Found(pos) = index.probe(*h, |s| *s == at) {
                index.remove(pos);
            }
        }
        if let Some(b) = self.batches.pop_front() {
            self.ops -= b.ops.len();
            self.first = self.first.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A filter answers every key put into it, and (but for a 32-bit collision) no other.
    #[test]
    fn the_filter_holds_what_was_put() {
        let state = ahash::RandomState::new();
        let mut f = HashFilter::default();
        for i in 0u32..10_000 {
            f.insert(filter_key(&state, &i.to_le_bytes()));
        }
        assert!((0u32..10_000).all(|i| f.contains(filter_key(&state, &i.to_le_bytes()))));
        // 10,000 strangers against 10,000 entries of 32 bits: 0.02 expected to collide.
        let strangers = (10_000u32..20_000)
            .filter(|i| f.contains(filter_key(&state, &i.to_le_bytes())))
            .count();
        assert!(
            strangers <= 2,
            "{strangers} keys never put answered as held"
        );
    }

    #[test]
    fn packed_ops_read_back_as_given_in_order() {
        let ops: Vec<(Bytes, Option<Bytes>)> = vec![
            (
                Bytes::from_static(b"k1"),
                Some(Bytes::from_static(b"value one")),
            ),
            (Bytes::from_static(b"k2"), None),
            (Bytes::from_static(b""), Some(Bytes::from_static(b""))),
            (Bytes::from_static(b"k1"), Some(Bytes::from_static(b"v"))),
            (Bytes::from_static(b"key three"), None),
            // Lengths of two and three varint bytes.
            (
                Bytes::from(vec![7u8; 200]),
                Some(Bytes::from(vec![9u8; 70_000])),
            ),
            (
                Bytes::from(vec![1u8; 127]),
                Some(Bytes::from(vec![2u8; 127])),
            ),
        ];
        let p = Packed::pack("s/0", &ops).unwrap();
        assert_eq!(p.len(), ops.len());
        let back: Vec<(Vec<u8>, Option<Vec<u8>>)> = p
            .iter()
            .map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec)))
            .collect();
        let want: Vec<(Vec<u8>, Option<Vec<u8>>)> = ops
            .iter()
            .map(|(k, v)| (k.to_vec(), v.as_ref().map(|v| v.to_vec())))
            .collect();
        assert_eq!(back, want);
        assert_eq!(
            p.value_bytes_at(p.start(0)).as_deref(),
            Some(&b"value one"[..])
        );
        assert_eq!(p.value_bytes_at(p.start(1)), None);
        // An empty value is a value, not a delete.
        assert_eq!(p.op(2).1, Some(&b""[..]));
        assert_eq!(p.key_at(p.start(4)), b"key three");
        assert_eq!(
            p.slices(1..3),
            vec![(&b"k2"[..], None), (&b""[..], Some(&b""[..]))]
        );
        // Read in order, each op as read by its position; a range from any start.
        for (i, op) in p.iter().enumerate() {
            assert_eq!(op, p.op(i), "op {i}");
        }
        let n = p.len();
        assert_eq!(p.slices(n - 1..n), vec![p.op(n - 1)]);
        assert!(p.slices(n..n).is_empty());
        assert_eq!(Packed::pack("s/0", &[]).unwrap().iter().count(), 0);
        assert!(Packed::pack("s/0", &[]).unwrap().is_empty());
    }

    #[test]
    fn a_resident_key_answers_its_latest_value_until_its_batch_leaves() {
        let mut r = Resident::new();
        let b1 = vec![
            (Bytes::from_static(b"a"), Some(Bytes::from_static(b"1"))),
            (Bytes::from_static(b"b"), Some(Bytes::from_static(b"2"))),
        ];
        let b2 = vec![
            (Bytes::from_static(b"a"), None),
            (Bytes::from_static(b"c"), Some(Bytes::from_static(b"3"))),
        ];
        let mut seen = Vec::new();
        for (seq, b) in [(1, b1), (2, b2)] {
            let ops = Arc::new(Packed::pack("s/0", &b).unwrap());
            r.push(seq, ops, |k, v, old| {
                seen.push((k.to_vec(), v.is_some(), old));
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(
            seen,
            vec![
                (b"a".to_vec(), true, None),
                (b"b".to_vec(), true, None),
                (b"a".to_vec(), false, Some(true)),
                (b"c".to_vec(), true, None),
            ]
        );
        assert_eq!(r.get(b"a"), Some(None));
        assert_eq!(r.get(b"b"), Some(Some(Bytes::from_static(b"2"))));
        assert_eq!(r.get(b"c"), Some(Some(Bytes::from_static(b"3"))));
        assert_eq!(r.get(b"d"), None);
        assert_eq!(r.len(), 3);
        // The first batch leaves: "b" with it; "a" stays (its latest op is in batch 2).
        r.pop_front();
        assert_eq!(r.get(b"b"), None);
        assert_eq!(r.get(b"a"), Some(None));
        assert_eq!(r.len(), 2);
    }
}
