//! In-memory store engine, for the test driver and for comparison benchmarks.

use super::{Counted, KeyValueStore, StateBackend, WriteBatch};
use crate::error::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// An entry: its key's hash (by [`Entries::hash`]), the key, the value.
type Entry = (u64, Box<[u8]>, Box<[u8]>);

/// A store's entries, each with its key's hash: growing the table rehashes from the stored
/// hashes, not by reading every key through its pointer again (a cache miss per entry, a
/// fifth of the dedup stage's time at 750,000 keys), and a probe compares hashes before
/// keys.
#[derive(Default)]
struct Entries {
    table: hashbrown::HashTable<Entry>,
    // ahash: keys come from the input, so a keyed hash, but faster than SipHash.
    hash: ahash::RandomState,
}

impl Entries {
    fn get(&self, key: &[u8]) -> Option<&[u8]> {
        let h = self.hash.hash_one(key);
        self.table
            .find(h, |e| e.0 == h && *e.1 == *key)
            .map(|e| &*e.2)
    }

    fn put(&mut self, key: &[u8], value: &[u8]) {
        let h = self.hash.hash_one(key);
        match self.table.entry(h, |e| e.0 == h && *e.1 == *key, |e| e.0) {
            hashbrown::hash_table::Entry::Occupied(mut o) => o.get_mut().2 = value.into(),
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert((h, key.into(), value.into()));
            }
        }
    }

    fn delete(&mut self, key: &[u8]) {
        let h = self.hash.hash_one(key);
        if let Ok(o) = self.table.find_entry(h, |e| e.0 == h && *e.1 == *key) {
            o.remove();
        }
    }
}

type Shared = Arc<Mutex<(Entries, Option<i64>)>>;

/// A [`KeyValueStore`] over a hash table (a lookup is one probe, where a `BTreeMap` of
/// byte keys compared keys through a pointer at every level). Its scan order is key order,
/// as before: a scan page selects the smallest keys after the cursor, O(entries) a page,
/// which suits the test driver and the benchmarks it serves. Clones of one backend share
/// their stores, so a store reopened after a simulated restart sees what was committed
/// before.
pub(crate) struct MemoryStore {
    name: String,
    data: Shared,
}

impl MemoryStore {
    /// Puts (`Some`) and deletes (`None`) in order, then the changelog offset if given.
    fn apply<'a>(
        &self,
        ops: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
        changelog_offset: Option<i64>,
    ) {
        let mut d = self.data.lock().expect("memory store lock");
        for (k, v) in ops {
            match v {
                Some(v) => d.0.put(k, v),
                None => d.0.delete(k),
            }
        }
        if changelog_offset.is_some() {
            d.1 = changelog_offset;
        }
    }
}

impl KeyValueStore for MemoryStore {
    fn name(&self) -> &str {
        &self.name
    }

    fn memory_bytes(&self, _wait: bool) -> Option<usize> {
        let d = self.data.lock().expect("memory store lock");
        let table = &d.0.table;
        // The table (slots and control bytes), then each entry's key and value.
        Some(table.allocation_size() + table.iter().map(|e| e.1.len() + e.2.len()).sum::<usize>())
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self
            .data
            .lock()
            .expect("memory store lock")
            .0
            .get(key)
            .map(<[u8]>::to_vec))
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        let ops = batch.ops.iter().map(|(k, v)| (&k[..], v.as_deref()));
        self.apply(ops, batch.changelog_offset);
        Ok(())
    }

    fn write_ops(
        &self,
        ops: &[(&[u8], Option<&[u8]>)],
        changelog_offset: Option<i64>,
        _count: Option<Counted<'_>>,
    ) -> Result<()> {
        self.apply(ops.iter().copied(), changelog_offset);
        Ok(())
    }

    fn clear(&self) -> Result<()> {
        let mut d = self.data.lock().expect("memory store lock");
        d.0.table.clear();
        d.1 = None;
        Ok(())
    }

    fn changelog_offset(&self) -> Result<Option<i64>> {
        Ok(self.data.lock().expect("memory store lock").1)
    }

    fn scan(&self, after: Option<&[u8]>, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let d = self.data.lock().expect("memory store lock");
        let mut entries: Vec<(&[u8], &[u8])> =
            d.0.table
                .iter()
                .map(|e| (&*e.1, &*e.2))
                .filter(|(k, _)| after.is_none_or(|a| *k > a))
                .collect();
        if entries.len() > limit {
            entries.select_nth_unstable(limit);
            entries.truncate(limit);
        }
        entries.sort_unstable();
        Ok(entries
            .into_iter()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect())
    }
}

/// Opens `MemoryStore`s; stores live as long as the backend (and its clones).
#[derive(Clone, Default)]
pub(crate) struct MemoryBackend {
    stores: Arc<Mutex<HashMap<(String, i32), Shared>>>,
}

impl MemoryBackend {
    /// Forget every store, as if the state dir were deleted.
    pub(crate) fn wipe(&self) {
        self.stores.lock().expect("memory backend lock").clear();
    }
}

impl StateBackend for MemoryBackend {
    fn open(&self, store: &str, partition: i32) -> Result<Arc<dyn KeyValueStore>> {
        let data = self
            .stores
            .lock()
            .expect("memory backend lock")
            .entry((store.to_string(), partition))
            .or_default()
            .clone();
        Ok(Arc::new(MemoryStore {
            name: format!("{store}/{partition}"),
            data,
        }))
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_pages_in_key_order_and_resumes_after_a_deleted_key() {
        let backend = MemoryBackend::default();
        let store = backend.open("s", 0).unwrap();
        let mut batch = WriteBatch::default();
        for k in [5u8, 1, 9, 3, 7, 2, 8] {
            batch.ops.push((vec![k], Some(vec![k * 10])));
        }
        store.write(batch).unwrap();
        let page = store.scan(None, 3).unwrap();
        assert_eq!(
            page,
            vec![
                (vec![1], vec![10]),
                (vec![2], vec![20]),
                (vec![3], vec![30])
            ]
        );
        // The cursor's key deleted between pages: the next page starts after it all the same.
        let mut batch = WriteBatch::default();
        batch.ops.push((vec![3], None));
        store.write(batch).unwrap();
        let keys: Vec<u8> = store
            .scan(Some(&[3]), 10)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k[0])
            .collect();
        assert_eq!(keys, vec![5, 7, 8, 9]);
        assert!(store.scan(Some(&[9]), 10).unwrap().is_empty());
        assert_eq!(store.get(&[7]).unwrap(), Some(vec![70]));
        assert_eq!(store.get(&[3]).unwrap(), None);
    }

    /// Overwrites replace, and every entry stays found across the table's growth (which
    /// rehashes from the stored hashes).
    #[test]
    fn entries_survive_growth_and_overwrites_replace() {
        let store = MemoryBackend::default().open("s", 0).unwrap();
        let key = |i: u32| format!("key-{i}").into_bytes();
        let ops: Vec<(Vec<u8>, Option<Vec<u8>>)> = (0..20_000u32)
            .map(|i| (key(i), Some(i.to_le_bytes().to_vec())))
            .collect();
        let slices: Vec<(&[u8], Option<&[u8]>)> =
            ops.iter().map(|(k, v)| (&k[..], v.as_deref())).collect();
        store.write_ops(&slices, Some(7), None).unwrap();
        store
            .write_ops(&[(&key(5), Some(b"new")), (&key(6), None)], None, None)
            .unwrap();
        for i in (0..20_000u32).filter(|i| ![5, 6].contains(i)) {
            assert_eq!(store.get(&key(i)).unwrap(), Some(i.to_le_bytes().to_vec()));
        }
        assert_eq!(store.get(&key(5)).unwrap(), Some(b"new".to_vec()));
        assert_eq!(store.get(&key(6)).unwrap(), None);
        assert_eq!(store.scan(None, usize::MAX).unwrap().len(), 19_999);
        assert_eq!(store.changelog_offset().unwrap(), Some(7));
    }
}
