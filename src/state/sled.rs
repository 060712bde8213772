//! The sled engine: one tree per (store, partition) in one sled database per state dir.
//!
//! Data keys are stored as `b'd' ++ key` and the changelog offset under `b"m:changelog"`,
//! so any raw key (empty, binary, one that looks like metadata) stays distinct and a batch's
//! data and offset land in one atomic `apply_batch`. sled holds an exclusive file lock on its
//! database, so a second process opening the same state dir fails at start-up.

use super::{KeyValueStore, StateBackend, WriteBatch};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

const DATA: u8 = b'd';
const META_CHANGELOG: &[u8] = b"m:changelog";
const META_KEYS: &[u8] = b"m:keys";

fn data_key(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(DATA);
    k.extend_from_slice(key);
    k
}

/// A [`KeyValueStore`] on one sled tree.
pub struct SledStore {
    name: String,
    tree: ::sled::Tree,
}

impl KeyValueStore for SledStore {
    fn name(&self) -> &str {
        &self.name
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        // Prefix the key on the stack when it is short (no allocation on the hot path).
        let mut stack = [0u8; 128];
        let heap;
        let full: &[u8] = if key.len() < stack.len() {
            stack[0] = DATA;
            stack[1..=key.len()].copy_from_slice(key);
            &stack[..=key.len()]
        } else {
            heap = data_key(key);
            &heap
        };
        self.tree
            .get(full)
            .map(|v| v.map(|iv| iv.to_vec()))
            .map_err(|e| Error::state(&self.name, e))
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        let mut b = ::sled::Batch::default();
        for (k, v) in batch.ops {
            match v {
                Some(v) => b.insert(data_key(&k), v),
                None => b.remove(data_key(&k)),
            }
        }
        if let Some(off) = batch.changelog_offset {
            b.insert(META_CHANGELOG, &off.to_be_bytes()[..]);
        }
        // Written without a count: a stored count is stale now.
        b.remove(META_KEYS);
        self.tree
            .apply_batch(b)
            .map_err(|e| Error::state(&self.name, e))
    }

    fn write_ops(
        &self,
        ops: &[(bytes::Bytes, Option<bytes::Bytes>)],
        changelog_offset: Option<i64>,
        key_count: Option<u64>,
    ) -> Result<()> {
        let mut b = ::sled::Batch::default();
        // Prefix short keys on the stack: sled keeps keys of up to 22 bytes inline.
        let mut stack = [0u8; 64];
        for (k, v) in ops {
            let full: ::sled::IVec = if k.len() < stack.len() {
                stack[0] = DATA;
                stack[1..=k.len()].copy_from_slice(k);
                (&stack[..=k.len()]).into()
            } else {
                data_key(k).into()
            };
            match v {
                Some(v) => b.insert(full, &v[..]),
                None => b.remove(full),
            }
        }
        if let Some(off) = changelog_offset {
            b.insert(META_CHANGELOG, &off.to_be_bytes()[..]);
        }
        match key_count {
            Some(n) => b.insert(META_KEYS, &n.to_be_bytes()[..]),
            // A write without a count makes a stored count stale.
            None => b.remove(META_KEYS),
        }
        self.tree
            .apply_batch(b)
            .map_err(|e| Error::state(&self.name, e))
    }

    fn key_count(&self) -> Result<Option<u64>> {
        let v = self
            .tree
            .get(META_KEYS)
            .map_err(|e| Error::state(&self.name, e))?;
        Ok(v.and_then(|b| <[u8; 8]>::try_from(b.as_ref()).ok().map(u64::from_be_bytes)))
    }

    fn clear(&self) -> Result<()> {
        self.tree.clear().map_err(|e| Error::state(&self.name, e))
    }

    fn changelog_offset(&self) -> Result<Option<i64>> {
        let v = self
            .tree
            .get(META_CHANGELOG)
            .map_err(|e| Error::state(&self.name, e))?;
        match v {
            None => Ok(None),
            Some(b) => {
                let arr: [u8; 8] = b.as_ref().try_into().map_err(|_| {
                    Error::state(&self.name, "stored changelog offset is not 8 bytes")
                })?;
                Ok(Some(i64::from_be_bytes(arr)))
            }
        }
    }

    fn scan(&self, after: Option<&[u8]>, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        use std::ops::Bound;
        let lower = match after {
            Some(a) => Bound::Excluded(data_key(a)),
            None => Bound::Included(vec![DATA]),
        };
        let mut out = Vec::new();
        for item in self.tree.range((lower, Bound::Unbounded)).take(limit) {
            let (k, v) = item.map_err(|e| Error::state(&self.name, e))?;
            if k.first() != Some(&DATA) {
                break;
            }
            out.push((k[1..].to_vec(), v.to_vec()));
        }
        Ok(out)
    }
}

/// One sled database in a state dir; opens a tree per (store, partition).
pub struct SledBackend {
    db: ::sled::Db,
    path: PathBuf,
    writer: std::sync::Arc<super::Writer>,
}

impl SledBackend {
    /// Open the sled database under `dir` (created if missing).
    ///
    /// # Errors
    /// [`Error::State`] when the directory cannot be created or sled cannot open it, in
    /// particular when another process holds its lock.
    pub fn open(dir: &Path) -> Result<SledBackend> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io {
            path: dir.display().to_string(),
            source: e,
        })?;
        let db = ::sled::Config::new()
            .path(dir)
            .cache_capacity(256 * 1024 * 1024)
            .mode(::sled::Mode::LowSpace)
            .flush_every_ms(Some(1000))
            .open()
            .map_err(|e| {
                let hint = if e.to_string().contains("lock") {
                    " (is another onceflow process using this state.dir?)"
                } else {
                    ""
                };
                Error::state(
                    dir.display().to_string(),
                    format!("cannot open sled database: {e}{hint}"),
                )
            })?;
        Ok(SledBackend {
            db,
            path: dir.to_path_buf(),
            writer: super::Writer::spawn(),
        })
    }

    /// Path of the database directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The partitions of `store` that have a tree in this database, ascending. Read-only:
    /// for inspection tools, which must not create trees.
    pub fn stored_partitions(&self, store: &str) -> Vec<i32> {
        let prefix = format!("{store}-");
        let mut out: Vec<i32> = self
            .db
            .tree_names()
            .iter()
            .filter_map(|n| {
                let rest = n.strip_prefix(prefix.as_bytes())?;
                std::str::from_utf8(rest).ok()?.parse::<i32>().ok()
            })
            .filter(|p| *p >= 0)
            .collect();
        out.sort_unstable();
        out
    }
}

impl StateBackend for SledBackend {
    fn writer(&self) -> Option<std::sync::Arc<super::Writer>> {
        Some(self.writer.clone())
    }

    fn open(&self, store: &str, partition: i32) -> Result<std::sync::Arc<dyn KeyValueStore>> {
        let name = format!("{store}/{partition}");
        let tree = self
            .db
            .open_tree(format!("{store}-{partition}"))
            .map_err(|e| Error::state(&name, e))?;
        Ok(std::sync::Arc::new(SledStore { name, tree }))
    }

    fn flush(&self) -> Result<()> {
        self.db
            .flush()
            .map(|_| ())
            .map_err(|e| Error::state(self.path.display().to_string(), e))
    }
}

// ---- lookup tables (one tree per table; see `state::table`) ----

const META_TABLE_OFFSET: &[u8] = b"m:offset:";

/// Rows (and known-absent keys) a table keeps in memory in front of sled; past it the
/// cache is emptied and fills again.
const TABLE_CACHE_ENTRIES: usize = 100_000;

/// A [`super::table::TableEngine`] on one sled tree: rows under `b'd' ++ key`, the next
/// offset of partition `p` under `b"m:offset:" ++ p (big-endian i32)`, written in one batch.
///
/// Lookups go through a bounded in-memory cache of rows and absent keys. Every write goes
/// through [`super::table::TableEngine::apply`], which updates the cache entries of the keys
/// it writes under the cache's lock and bumps a version, and a lookup that read sled caches
/// its result only if no write happened meanwhile, so the cache never serves a stale row.
pub struct SledTable {
    name: String,
    tree: ::sled::Tree,
    cache: std::sync::RwLock<TableCache>,
}

#[derive(Default)]
struct TableCache {
    rows: ahash::AHashMap<Vec<u8>, Option<Vec<u8>>>,
    version: u64,
}

impl super::table::TableEngine for SledTable {
    fn name(&self) -> &str {
        &self.name
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let version = {
            let c = self.cache.read().expect("table cache lock");
            if let Some(hit) = c.rows.get(key) {
                return Ok(hit.clone());
            }
            c.version
        };
        let v = self
            .tree
            .get(data_key(key))
            .map(|v| v.map(|iv| iv.to_vec()))
            .map_err(|e| Error::state(&self.name, e))?;
        let mut c = self.cache.write().expect("table cache lock");
        if c.version == version {
            if c.rows.len() >= TABLE_CACHE_ENTRIES {
                c.rows.clear();
            }
            c.rows.insert(key.to_vec(), v.clone());
        }
        Ok(v)
    }

    fn apply(&self, ops: Vec<(Vec<u8>, Option<Vec<u8>>)>, offsets: &[(i32, i64)]) -> Result<()> {
        // Hold the cache lock across the write: no lookup caches what this batch replaces.
        let mut cache = self.cache.write().expect("table cache lock");
        cache.version += 1;
        let mut b = ::sled::Batch::default();
        for (k, v) in ops {
            if let Some(entry) = cache.rows.get_mut(&k) {
                entry.clone_from(&v);
            }
            match v {
                Some(v) => b.insert(data_key(&k), v),
                None => b.remove(data_key(&k)),
            }
        }
        for (p, o) in offsets {
            let mut k = META_TABLE_OFFSET.to_vec();
            k.extend_from_slice(&p.to_be_bytes());
            b.insert(k, &o.to_be_bytes()[..]);
        }
        self.tree
            .apply_batch(b)
            .map_err(|e| Error::state(&self.name, e))
    }

    fn offsets(&self) -> Result<std::collections::BTreeMap<i32, i64>> {
        let mut out = std::collections::BTreeMap::new();
        for item in self.tree.scan_prefix(META_TABLE_OFFSET) {
            let (k, v) = item.map_err(|e| Error::state(&self.name, e))?;
            let p: [u8; 4] = k[META_TABLE_OFFSET.len()..]
                .try_into()
                .map_err(|_| Error::state(&self.name, "corrupt stored table offset key"))?;
            let o: [u8; 8] = v
                .as_ref()
                .try_into()
                .map_err(|_| Error::state(&self.name, "stored table offset is not 8 bytes"))?;
            out.insert(i32::from_be_bytes(p), i64::from_be_bytes(o));
        }
        Ok(out)
    }

    fn clear(&self) -> Result<()> {
        let mut cache = self.cache.write().expect("table cache lock");
        cache.version += 1;
        cache.rows.clear();
        self.tree.clear().map_err(|e| Error::state(&self.name, e))
    }
}

impl SledBackend {
    /// Open (or create) the tree of lookup table `name` (tree `table-<name>`).
    ///
    /// # Errors
    /// [`Error::State`] when sled cannot open the tree.
    pub fn open_table(&self, name: &str) -> Result<std::sync::Arc<SledTable>> {
        let tree = self
            .db
            .open_tree(format!("table-{name}"))
            .map_err(|e| Error::state(format!("table {name}"), e))?;
        Ok(std::sync::Arc::new(SledTable {
            name: name.to_string(),
            tree,
            cache: Default::default(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn second_open_of_a_state_dir_fails_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let _a = SledBackend::open(dir.path()).unwrap();
        let err = SledBackend::open(dir.path())
            .err()
            .expect("second open must fail");
        assert!(
            err.to_string().contains("another onceflow process"),
            "{err}"
        );
    }

    #[test]
    fn survives_reopen_with_offset() {
        let dir = tempfile::tempdir().unwrap();
        {
            let b = SledBackend::open(dir.path()).unwrap();
            let s = b.open("dedup", 3).unwrap();
            s.write(WriteBatch {
                ops: vec![(vec![0xff, 0x00], Some(b"v".to_vec()))],
                changelog_offset: Some(99),
            })
            .unwrap();
            b.flush().unwrap();
        }
        let b = SledBackend::open(dir.path()).unwrap();
        let s = b.open("dedup", 3).unwrap();
        assert_eq!(s.get(&[0xff, 0x00]).unwrap(), Some(b"v".to_vec()));
        assert_eq!(s.changelog_offset().unwrap(), Some(99));
        assert_eq!(
            b.open("dedup", 2).unwrap().get(&[0xff, 0x00]).unwrap(),
            None
        );
    }

    #[test]
    fn table_rows_and_offsets_survive_reopen() {
        use crate::state::table::TableEngine;
        let dir = tempfile::tempdir().unwrap();
        {
            let b = SledBackend::open(dir.path()).unwrap();
            let t = b.open_table("customers").unwrap();
            t.apply(
                vec![
                    (b"c1".to_vec(), Some(b"{}".to_vec())),
                    (b"c2".to_vec(), None),
                ],
                &[(0, 5), (3, 1)],
            )
            .unwrap();
            b.flush().unwrap();
        }
        let b = SledBackend::open(dir.path()).unwrap();
        let t = b.open_table("customers").unwrap();
        assert_eq!(t.get(b"c1").unwrap(), Some(b"{}".to_vec()));
        assert_eq!(t.offsets().unwrap(), BTreeMap::from([(0, 5), (3, 1)]));
        // Cached rows and cached absences follow later writes.
        assert_eq!(t.get(b"c2").unwrap(), None);
        t.apply(
            vec![
                (b"c1".to_vec(), None),
                (b"c2".to_vec(), Some(b"2".to_vec())),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(t.get(b"c1").unwrap(), None);
        assert_eq!(t.get(b"c2").unwrap(), Some(b"2".to_vec()));
        t.clear().unwrap();
        assert!(t.offsets().unwrap().is_empty());
        assert_eq!(t.get(b"c1").unwrap(), None);
        assert_eq!(t.get(b"c2").unwrap(), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// The sled store against a BTreeMap model: any raw keys, including ones that look
        /// like the metadata key, puts and deletes in batches, and a bounded scan.
        #[test]
        fn matches_btreemap_model(
            batches in proptest::collection::vec(
                proptest::collection::vec(
                    (proptest::collection::vec(any::<u8>(), 0..4), proptest::option::of(any::<u8>())),
                    0..20),
                1..8),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let b = SledBackend::open(dir.path()).unwrap();
            let s = b.open("p", 0).unwrap();
            let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
            let meta_like = META_CHANGELOG.to_vec();
            for (i, ops) in batches.into_iter().enumerate() {
                let mut ops: Vec<_> = ops.into_iter().map(|(k, v)| (k, v.map(|b| vec![b]))).collect();
                ops.push((meta_like.clone(), Some(vec![i as u8])));
                for (k, v) in &ops {
                    match v { Some(v) => { model.insert(k.clone(), v.clone()); } None => { model.remove(k); } }
                }
                s.write(WriteBatch { ops, changelog_offset: Some(i as i64) }).unwrap();
                prop_assert_eq!(s.changelog_offset().unwrap(), Some(i as i64));
            }
            for (k, v) in &model {
                prop_assert_eq!(s.get(k).unwrap(), Some(v.clone()));
            }
            let all = s.scan(None, usize::MAX).unwrap();
            let want: Vec<_> = model.into_iter().collect();
            prop_assert_eq!(all, want);
        }
    }
}
