//! In-memory store engine, for the test driver and for comparison benchmarks.

use super::{KeyValueStore, StateBackend, WriteBatch};
use crate::error::Result;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

type Shared = Arc<Mutex<(BTreeMap<Vec<u8>, Vec<u8>>, Option<i64>)>>;

/// A [`KeyValueStore`] over a `BTreeMap`. Clones of one backend share their stores, so a
/// store reopened after a simulated restart sees what was committed before.
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
            .cloned())
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        let mut d = self.data.lock().expect("memory store lock");
        for (k, v) in batch.ops {
            match v {
                Some(v) => d.0.insert(k, v),
                None => d.0.remove(&k),
            };
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
        use std::ops::Bound;
        let d = self.data.lock().expect("memory store lock");
        let lower = match after {
            Some(a) => Bound::Excluded(a.to_vec()),
            None => Bound::Unbounded,
        };
        Ok(d.0
            .range((lower, Bound::Unbounded))
            .take(limit)
            .map(|(k, v)| (k.clone(), v.clone()))
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
