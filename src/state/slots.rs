//! The tables of a write-behind store's memory: the resident index (12-byte [`Slot`]s)
//! and the key filter (4-byte hashes, [`HashFilter`]). Open addressing with linear
//! probing, where a probe's first read is the entry itself (a SwissTable such as
//! `hashbrown` reads a control byte first, then the entry: two cache misses a lookup in a
//! table far larger than the cache), and the address a key probes first is known before
//! the probe, so a loop over a batch's keys can prefetch it a few keys ahead.

use super::resident::Slot;

/// An entry of a [`SlotTable`].
pub(super) trait Entry: Copy {
    /// The entry of an empty slot.
    const EMPTY: Self;
    fn is_empty(&self) -> bool;
    /// The 32 hash bits the entry keeps: its first probe is at `hash & mask`.
    fn hash(&self) -> u32;
}

impl Entry for Slot {
    /// No op starts at `u32::MAX` (a batch's buffer is under 4 GiB, and an op takes at
    /// least two bytes).
    const EMPTY: Slot = Slot {
        seq: 0,
        at: u32::MAX,
        hash: 0,
    };
    fn is_empty(&self) -> bool {
        self.at == u32::MAX
    }
    fn hash(&self) -> u32 {
        self.hash
    }
}

impl Entry for u32 {
    /// [`HashFilter`] holds a hash of 0 as 1.
    const EMPTY: u32 = 0;
    fn is_empty(&self) -> bool {
        *self == 0
    }
    fn hash(&self) -> u32 {
        *self
    }
}

/// Where a probe for a key ended: at its slot, or at the empty slot it would take.
pub(super) enum Probe {
    Found(usize),
    Vacant(usize),
}

/// Entries by the 32 hash bits each keeps ([`Entry::hash`]): an entry's first probe is at
/// `hash & mask`, and a key is in the run of occupied slots from there. At most three
/// quarters of the slots are occupied (an absent key reads ~8 slots at that load, a
/// present one ~2.5). Removal shifts the run back (no tombstones).
pub(super) struct SlotTable<T = Slot> {
    /// A power of two of them, or none before the first insert.
    slots: Vec<T>,
    len: usize,
}

impl<T> Default for SlotTable<T> {
    fn default() -> Self {
        SlotTable {
            slots: Vec::new(),
            len: 0,
        }
    }
}

impl<T: Entry> SlotTable<T> {
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// Occupied slots.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Make room for `additional` more slots without growing while they are inserted (so a
    /// [`Probe::Vacant`] taken between inserts stays right).
    pub(super) fn reserve(&mut self, additional: usize) {
        let need = self.len.saturating_add(additional);
        if need <= self.slots.len() - self.slots.len() / 4 {
            return;
        }
        let mut cap = self.slots.len().max(16);
        while need > cap - cap / 4 {
            cap *= 2;
        }
        let old = std::mem::replace(&mut self.slots, vec![T::EMPTY; cap]);
        let mask = cap - 1;
        for s in old.into_iter().filter(|s| !s.is_empty()) {
            let mut i = s.hash() as usize & mask;
            while !self.slots[i].is_empty() {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }

    /// Hint that a probe for `hash` comes soon: fetch its first slot's cache line.
    #[inline]
    pub(super) fn prefetch(&self, hash: u32) {
        if !self.slots.is_empty() {
            crate::prefetch::prefetch(
                self.slots
                    .as_ptr()
                    .wrapping_add(hash as usize & self.mask()),
            );
        }
    }

    /// The slot of the key with `hash` for which `eq` holds, or the empty slot it would
    /// take. The table must have a free slot ([`SlotTable::reserve`]).
    pub(super) fn probe(&self, hash: u32, mut eq: impl FnMut(&T) -> bool) -> Probe {
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            let s = &self.slots[i];
            if s.is_empty() {
                return Probe::Vacant(i);
            }
            if s.hash() == hash && eq(s) {
                return Probe::Found(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of the key with `hash` for which `eq` holds.
    pub(super) fn find(&self, hash: u32, eq: impl FnMut(&T) -> bool) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        match self.probe(hash, eq) {
            Probe::Found(i) => Some(self.slots[i]),
            Probe::Vacant(_) => None,
        }
    }

    /// The slot at `at` (from [`SlotTable::probe`]).
    pub(super) fn get(&self, at: usize) -> T {
        self.slots[at]
    }

    /// Put `slot` at `at`: a [`Probe::Found`] position (replaced) or the
    /// [`Probe::Vacant`] one of a probe for `slot.hash` with no insert since.
    pub(super) fn set(&mut self, at: usize, slot: T) {
        debug_assert!(!slot.is_empty(), "an empty slot is not a key's");
        if self.slots[at].is_empty() {
            self.len += 1;
        }
        self.slots[at] = slot;
    }

    /// Empty the slot at `at`, moving the slots after it in its run back so that every key
    /// stays reachable from its first probe.
    pub(super) fn remove(&mut self, mut at: usize) {
        let mask = self.mask();
        let mut j = at;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.is_empty() {
                break;
            }
            // `s` may move to the hole if the hole is between its first probe and `j`.
            let home = s.hash() as usize & mask;
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(at) & mask {
                self.slots[at] = s;
                at = j;
            }
        }
        self.slots[at] = T::EMPTY;
        self.len -= 1;
    }

    /// Bytes of the slots (the table's capacity).
    pub(super) fn memory_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<T>()
    }

    /// Every occupied slot, in table order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter(|s| !s.is_empty())
    }
}

/// The key filter's set of 32-bit key hashes ([`super::resident::filter_key`]), 4 bytes a
/// slot: 5.3 to 10.7 bytes a hash held, by the table's load. A hash of 0 is held as 1 (a
/// filter may answer "maybe" for a key never put: it costs an engine read).
#[derive(Default)]
pub(super) struct HashFilter(SlotTable<u32>);

impl HashFilter {
    fn held(h: u32) -> u32 {
        h.max(1)
    }

    /// Hashes held.
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    /// Bytes of the table.
    pub(super) fn memory_bytes(&self) -> usize {
        self.0.memory_bytes()
    }

    /// Make room for `additional` more hashes.
    pub(super) fn reserve(&mut self, additional: usize) {
        self.0.reserve(additional);
    }

    /// Hold `h`.
    pub(super) fn insert(&mut self, h: u32) {
        let h = Self::held(h);
        self.0.reserve(1);
        if let Probe::Vacant(at) = self.0.probe(h, |_| true) {
            self.0.set(at, h);
        }
    }

    /// Whether `h` is held.
    pub(super) fn contains(&self, h: u32) -> bool {
        self.0.find(Self::held(h), |_| true).is_some()
    }

    /// Hint that `h` is looked up soon.
    pub(super) fn prefetch(&self, h: u32) {
        self.0.prefetch(Self::held(h));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn slot(key: u16) -> Slot {
        Slot {
            seq: u32::from(key),
            at: u32::from(key),
            // Few distinct hashes: long runs, shared first probes, wrap-around.
            hash: u32::from(key % 7) * 9 + 13,
        }
    }

    proptest! {
        /// A filter holds every hash put (0 too, held as 1) across its growth, and answers
        /// "no" for hashes never put but for 0 and 1, which share a slot.
        #[test]
        fn a_filter_holds_what_was_put(put in proptest::collection::vec(0u32..64, 0..200), probe in 0u32..64) {
            let mut f = HashFilter::default();
            for h in &put {
                f.insert(*h);
                prop_assert!(f.contains(*h));
            }
            let held = |h: u32| put.iter().any(|p| (*p).max(1) == h.max(1));
            prop_assert_eq!(f.contains(probe), held(probe));
            let distinct: std::collections::HashSet<u32> = put.iter().map(|h| (*h).max(1)).collect();
            prop_assert_eq!(f.len(), distinct.len());
        }

        /// Inserts, replacements and removes agree with a set model, across growth, runs
        /// that wrap around the end and removals inside runs.
        #[test]
        fn a_table_matches_a_set_model(steps in proptest::collection::vec((any::<bool>(), 0u16..40), 0..300)) {
            let mut t = SlotTable::default();
            let mut model = std::collections::BTreeSet::new();
            for (put, key) in steps {
                let s = slot(key);
                let same = |x: &Slot| x.at == s.at;
                if put {
                    t.reserve(1);
                    match t.probe(s.hash, same) {
                        Probe::Found(at) => { prop_assert!(model.contains(&key)); t.set(at, s) }
                        Probe::Vacant(at) => { prop_assert!(!model.contains(&key)); t.set(at, s) }
                    }
                    model.insert(key);
                } else if let Probe::Found(at) = { t.reserve(1); t.probe(s.hash, same) } {
                    prop_assert!(model.remove(&key));
                    t.remove(at);
                } else {
                    prop_assert!(!model.contains(&key));
                }
                prop_assert_eq!(t.len(), model.len());
                for k in 0u16..40 {
                    let s = slot(k);
                    prop_assert_eq!(t.find(s.hash, |x| x.at == s.at), model.contains(&k).then_some(s), "key {}", k);
                }
                let mut listed: Vec<u16> = t.iter().map(|s| s.at as u16).collect();
                listed.sort_unstable();
                prop_assert_eq!(listed, model.iter().copied().collect::<Vec<_>>());
            }
        }
    }
}
