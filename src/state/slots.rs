//! The resident index's table: open addressing with linear probing over 12-byte
//! [`Slot`]s, where a probe's first read is the slot itself (a SwissTable such as
//! `hashbrown` reads a control byte first, then the slot: two cache misses a lookup in a
//! table far larger than the cache), and the address a key probes first is known before
//! the probe, so a loop over a batch's keys can prefetch it a few keys ahead.

use super::resident::Slot;

/// A slot no key holds: no op starts at `u32::MAX` (a batch's buffer is under 4 GiB, and
/// an op takes at least two bytes).
const EMPTY: Slot = Slot {
    seq: 0,
    at: u32::MAX,
    hash: 0,
};

fn is_empty(s: &Slot) -> bool {
    s.at == u32::MAX
}

/// Where a probe for a key ended: at its slot, or at the empty slot it would take.
pub(super) enum Probe {
    Found(usize),
    Vacant(usize),
}

/// Slots by the 32 hash bits each keeps ([`Slot::hash`]): a slot's first probe is at
/// `hash & mask`, and a key is in the run of occupied slots from there. At most three
/// quarters of the slots are occupied (an absent key reads ~8 slots, ~100 bytes, at that
/// load; a present one ~2.5). Removal shifts the run back (no tombstones).
#[derive(Default)]
pub(super) struct SlotTable {
    /// A power of two of them, or none before the first insert.
    slots: Vec<Slot>,
    len: usize,
}

impl SlotTable {
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
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; cap]);
        let mask = cap - 1;
        for s in old.into_iter().filter(|s| !is_empty(s)) {
            let mut i = s.hash as usize & mask;
            while !is_empty(&self.slots[i]) {
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
    pub(super) fn probe(&self, hash: u32, mut eq: impl FnMut(&Slot) -> bool) -> Probe {
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            let s = &self.slots[i];
            if is_empty(s) {
                return Probe::Vacant(i);
            }
            if s.hash == hash && eq(s) {
                return Probe::Found(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of the key with `hash` for which `eq` holds.
    pub(super) fn find(&self, hash: u32, eq: impl FnMut(&Slot) -> bool) -> Option<Slot> {
        if self.len == 0 {
            return None;
        }
        match self.probe(hash, eq) {
            Probe::Found(i) => Some(self.slots[i]),
            Probe::Vacant(_) => None,
        }
    }

    /// The slot at `at` (from [`SlotTable::probe`]).
    pub(super) fn get(&self, at: usize) -> Slot {
        self.slots[at]
    }

    /// Put `slot` at `at`: a [`Probe::Found`] position (replaced) or the
    /// [`Probe::Vacant`] one of a probe for `slot.hash` with no insert since.
    pub(super) fn set(&mut self, at: usize, slot: Slot) {
        debug_assert!(!is_empty(&slot), "an empty slot is not a key's");
        if is_empty(&self.slots[at]) {
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
            if is_empty(&s) {
                break;
            }
            // `s` may move to the hole if the hole is between its first probe and `j`.
            let home = s.hash as usize & mask;
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(at) & mask {
                self.slots[at] = s;
                at = j;
            }
        }
        self.slots[at] = EMPTY;
        self.len -= 1;
    }

    /// Every occupied slot, in table order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().filter(|s| !is_empty(s))
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
