//! In-memory store engine, for the test driver and for comparison benchmarks.

use super::{KeyValueStore, StateBackend, WriteBatch};
use crate::error::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A store's entries by key, and its changelog offset.
type Entries = hashbrown::HashMap<Box<[u8]>, Box<[u8]>, ahash::RandomState>;
type Shared = Arc<Mutex<(Entries, Option<i64>)>>;

/// A [`KeyValueStore`] over a hash map (a lookup is one probe, where a `BTreeMap` of byte
/// keys compared keys through a pointer at every level). Its scan order is key order, as
/// before: a scan page selects the smallest keys after the cursor, O(entries) a page,
/// which suits the test driver and the benchmarks it serves. Clones of one backend share
/// their stores, so a store reopened after a simulated restart sees what was committed
/// before.
pub(crate) struct MemoryStore {
    name: String,
    data: Shared,
}

impl KeyValueStore for MemoryStore {
    fn name(&self) -> &str {
        &self.name
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self
            .data
            .lock()
            .expect("memory store lock")
            .0
            .get(key)
            .map(|v| v.to_vec()))
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        let mut d = self.data.lock().expect("memory store lock");
        for (k, v) in batch.ops {
            match v {
                Some(v) => {
                    d.0.insert(k.into_boxed_slice(), v.into_boxed_slice());
                }
                None => {
                    d.0.remove(k.as_slice());
                }
            }
        }
        if batch.changelog_offset.is_some() {
            d.1 = batch.changelog_offset;
        }
        Ok(())
    }

    fn clear(&self) -> Result<()> {
        let mut d = self.data.lock().expect("memory store lock");
        d.0.clear();
        d.1 = None;
        Ok(())
    }

    fn changelog_offset(&self) -> Result<Option<i64>> {
        Ok(self.data.lock().expect("memory store lock").1)
    }

    fn scan(&self, after: Option<&[u8]>, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let d = self.data.lock().expect("memory store lock");
        let mut keys: Vec<&[u8]> =
            d.0.keys()
                .map(|k| &**k)
                .filter(|k| after.is_none_or(|a| *k > a))
                .collect();
        if keys.len() > limit {
            keys.select_nth_unstable(limit);
            keys.truncate(limit);
        }
        keys.sort_unstable();
        Ok(keys
            .into_iter()
            .map(|k| (k.to_vec(), d.0[k].to_vec()))
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
}
