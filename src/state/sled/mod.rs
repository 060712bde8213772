//! The sled engine: one tree per (store, partition) in one sled database per state dir.
//!
//! A store tree packs its entries into segments with an index in memory (`store.rs`); a
//! batch's data and its changelog offset land in one atomic `apply_batch`. Lookup tables
//! keep one sled key per row (`b'd' ++ key`, [`SledTable`]). sled holds an exclusive file
//! lock on its database, so a second process opening the same state dir fails at start-up.

#[cfg(test)]
use super::WriteBatch;
use super::{KeyValueStore, StateBackend};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

mod store;

pub(crate) use self::store::SledStore;
#[cfg(test)]
use self::store::META_CHANGELOG;

/// The prefix of lookup-table rows (`SledTable`).
const DATA: u8 = b'd';

fn data_key(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(DATA);
    k.extend_from_slice(key);
    k
}

/// The seal of a gracefully stopped database, inside its directory (see
/// [`SledBackend::seal`]): one line per store tree, `<name as hex> <entries> <checksum>`.
const SEAL_FILE: &str = "onceflow.sealed";

/// How long [`SledBackend::open`] waits for sled's file lock (see `open_sled`).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Why a database could not be opened by [`SledBackend::open_checked`].
enum Damage {
    /// Its content is damaged: set it aside.
    Corrupt(String),
    /// Anything else (a lock, no space): report it.
    Other(Error),
}

fn open_error(dir: &Path, e: ::sled::Error) -> Error {
    let hint = if e.to_string().contains("lock") {
        " (is another onceflow process using this state.dir?)"
    } else {
        ""
    };
    Error::state(
        dir.display().to_string(),
        format!("cannot open sled database: {e}{hint}"),
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Entry count and an xxh3 checksum (over length-prefixed sled keys and values, in sled key order)
/// of every store tree, by tree name; lookup tables (`table-*`, written by their own
/// threads) and sled's default tree are left out.
fn store_checksums(
    db: &::sled::Db,
) -> std::result::Result<std::collections::BTreeMap<Vec<u8>, (u64, u64)>, ::sled::Error> {
    let mut out = std::collections::BTreeMap::new();
    for name in db.tree_names() {
        if name.starts_with(b"table-") || name.starts_with(b"__sled__") {
            continue;
        }
        let tree = db.open_tree(&name)?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut n = 0u64;
        for item in tree.iter() {
            let (k, v) = item?;
            h.update(&(k.len() as u64).to_le_bytes());
            h.update(&k);
            h.update(&(v.len() as u64).to_le_bytes());
            h.update(&v);
            n += 1;
        }
        out.insert(name.to_vec(), (n, h.digest()));
    }
    Ok(out)
}

/// What differs between a seal's `text` and the checksums `now`; `None` when nothing
/// does.
fn seal_mismatch(
    text: &str,
    now: &std::collections::BTreeMap<Vec<u8>, (u64, u64)>,
) -> Option<String> {
    let mut sealed = std::collections::BTreeMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let parsed = match f.as_slice() {
            [name, n, sum] => n
                .parse::<u64>()
                .ok()
                .zip(u64::from_str_radix(sum, 16).ok())
                .map(|v| (name.to_string(), v)),
            _ => None,
        };
        match parsed {
            Some((name, v)) => sealed.insert(name, v),
            None => return Some(format!("the seal is unreadable (line {line:?})")),
        };
    }
    for (name, (n, sum)) in &sealed {
        let shown = now
            .iter()
            .find(|(k, _)| hex(k) == *name)
            .map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), *v));
        match shown {
            None => return Some(format!("store tree {name} (hex) is missing")),
            Some((tree, (m, s))) if (m, s) != (*n, *sum) => {
                return Some(format!(
                    "store tree {tree} holds {m} entries (checksum {s:016x}), {n} (checksum {sum:016x}) at the last graceful stop"
                ))
            }
            Some(_) => {}
        }
    }
    None
}

/// One sled database in a state dir; opens a tree per (store, partition).
pub(crate) struct SledBackend {
    db: ::sled::Db,
    path: PathBuf,
    writer: std::sync::Arc<super::Writer>,
    /// The open stores by tree name: a tree has one index in memory, so a store opened
    /// again while open is the same store.
    open_stores: std::sync::Mutex<std::collections::HashMap<String, std::sync::Weak<SledStore>>>,
}

impl SledBackend {
    /// Open the sled database under `dir` (created if missing), with the page cache of a
    /// run whose topology has no lookup table ([`crate::config::STATE_CACHE_BYTES`]).
    ///
    /// # Errors
    /// [`Error::State`] when the directory cannot be created or sled cannot open it, in
    /// particular when another process holds its lock.
    pub(crate) fn open(dir: &Path) -> Result<SledBackend> {
        Self::open_cached(dir, crate::config::STATE_CACHE_BYTES)
    }

    /// As [`SledBackend::open`], with a page cache of `cache_bytes` (sled's
    /// `cache_capacity`; onceflow picks it by `state.cache.bytes`).
    ///
    /// # Errors
    /// As [`SledBackend::open`].
    pub(crate) fn open_cached(dir: &Path, cache_bytes: u64) -> Result<SledBackend> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io {
            path: dir.display().to_string(),
            source: e,
        })?;
        let db = Self::open_sled(dir, cache_bytes).map_err(|e| open_error(dir, e))?;
        Ok(SledBackend {
            db,
            path: dir.to_path_buf(),
            writer: super::Writer::spawn(),
            open_stores: Default::default(),
        })
    }

    /// Open the sled database under `dir` as [`SledBackend::open`] does, and check it: sled
    /// must open it without an error or a panic of its own, and when the last run stopped
    /// gracefully (it left a seal, see [`SledBackend::seal`]) every store tree must hold
    /// what it held then (entry count and checksum). A database that fails the check is
    /// corrupted: it is moved aside (renamed `<dir>.corrupt-<UTC timestamp>`, never
    /// deleted) with a WARN log line naming the path and the error, and an empty database is
    /// opened in its place, so that every store restores from its changelog.
    ///
    /// The check reads every store tree once (lookup tables are not checked: they reload
    /// from their topics).
    ///
    /// # Errors
    /// As [`SledBackend::open`] for failures that are not corruption (a lock held, no
    /// space, no permission); [`Error::Io`] when the corrupted database cannot be renamed.
    pub(crate) fn open_checked(dir: &Path, cache_bytes: u64) -> Result<SledBackend> {
        let why = match Self::open_and_check(dir, cache_bytes) {
            Ok(b) => return Ok(b),
            Err(Damage::Other(e)) => return Err(e),
            Err(Damage::Corrupt(why)) => why,
        };
        let stamp: String = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
            .to_string()
            .chars()
            .filter(|c| *c != '-' && *c != ':')
            .collect();
        let mut name = dir.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".corrupt-{stamp}"));
        let aside = dir.with_file_name(name);
        std::fs::rename(dir, &aside).map_err(|e| Error::Io {
            path: dir.display().to_string(),
            source: e,
        })?;
        tracing::warn!(
            path = %dir.display(),
            moved_to = %aside.display(),
            error = %why,
            "sled database corrupted: moved aside (not deleted); its stores restore from their changelogs"
        );
        Self::open_cached(dir, cache_bytes)
    }

    fn open_and_check(dir: &Path, cache_bytes: u64) -> std::result::Result<SledBackend, Damage> {
        let opened = std::panic::catch_unwind(|| Self::open_sled(dir, cache_bytes));
        let db = match opened {
            Err(panic) => {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into());
                return Err(Damage::Corrupt(format!("sled failed opening it: {what}")));
            }
            Ok(Err(e @ (::sled::Error::Corruption { .. } | ::sled::Error::ReportableBug(_)))) => {
                return Err(Damage::Corrupt(format!("sled cannot read it: {e}")));
            }
            Ok(Err(e)) => return Err(Damage::Other(open_error(dir, e))),
            Ok(Ok(db)) => db,
        };
        let seal = dir.join(SEAL_FILE);
        match std::fs::read_to_string(&seal) {
            Ok(text) => {
                // The seal describes the database only until it is written again.
                std::fs::remove_file(&seal).map_err(|e| {
                    Damage::Other(Error::Io {
                        path: seal.display().to_string(),
                        source: e,
                    })
                })?;
                let now =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store_checksums(&db)));
                let differs = match now {
                    Err(_) => Some("sled failed reading a tree".to_string()),
                    Ok(Err(e)) => Some(format!("sled cannot read a tree: {e}")),
                    Ok(Ok(now)) => seal_mismatch(&text, &now),
                };
                if let Some(why) = differs {
                    drop(db);
                    return Err(Damage::Corrupt(format!(
                        "{why} (checked against {}, written at the last graceful stop)",
                        seal.display()
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Damage::Other(Error::Io {
                    path: seal.display().to_string(),
                    source: e,
                }))
            }
        }
        Ok(SledBackend {
            db,
            path: dir.to_path_buf(),
            writer: super::Writer::spawn(),
            open_stores: Default::default(),
        })
    }

    /// Record, at a graceful stop (every store write applied and flushed), each store
    /// tree's entry count and checksum in `<dir>/onceflow.sealed`, which the next
    /// [`SledBackend::open_checked`] compares with what it finds.
    ///
    /// # Errors
    /// [`Error::State`] when a tree cannot be read; [`Error::Io`] when the seal cannot be
    /// written.
    pub(crate) fn seal(&self) -> Result<()> {
        self.db
            .flush()
            .map_err(|e| Error::state(self.path.display().to_string(), e))?;
        let sums = store_checksums(&self.db)
            .map_err(|e| Error::state(self.path.display().to_string(), e))?;
        let mut text = String::new();
        for (tree, (n, sum)) in &sums {
            text.push_str(&format!("{} {n} {sum:016x}\n", hex(tree)));
        }
        let seal = self.path.join(SEAL_FILE);
        let tmp = self.path.join(format!("{SEAL_FILE}.tmp"));
        let io = |e: std::io::Error| Error::Io {
            path: seal.display().to_string(),
            source: e,
        };
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, &seal).map_err(io)
    }

    /// Open sled in `dir`. sled's file lock is released only when the last handle of a
    /// database closed in this process is gone, which its background threads may hold for
    /// a moment after the database was dropped: a lock held is tried again for up to
    /// [`LOCK_WAIT`]. Another process holding the state dir is refused before this, by
    /// the state-dir lock ([`crate::state::StateDirLock`]).
    fn open_sled(dir: &Path, cache_bytes: u64) -> std::result::Result<::sled::Db, ::sled::Error> {
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        loop {
            let opened = ::sled::Config::new()
                .path(dir)
                .cache_capacity(cache_bytes)
                .mode(::sled::Mode::LowSpace)
                .flush_every_ms(Some(1000))
                .open();
            match opened {
                Err(e)
                    if e.to_string().contains("could not acquire lock")
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => return other,
            }
        }
    }

    /// The partitions of `store` that have a tree in this database, ascending. Read-only:
    /// for inspection tools, which must not create trees.
    pub(crate) fn stored_partitions(&self, store: &str) -> Vec<i32> {
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
        let tree_name = format!("{store}-{partition}");
        let mut open = self.open_stores.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = open.get(&tree_name).and_then(std::sync::Weak::upgrade) {
            return Ok(s);
        }
        let tree = self
            .db
            .open_tree(&tree_name)
            .map_err(|e| Error::state(&name, e))?;
        let s = std::sync::Arc::new(SledStore::open(name, tree)?);
        open.retain(|_, w| w.strong_count() > 0);
        open.insert(tree_name, std::sync::Arc::downgrade(&s));
        Ok(s)
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
pub(crate) struct SledTable {
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
    pub(crate) fn open_table(&self, name: &str) -> Result<std::sync::Arc<SledTable>> {
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

    /// A database of `n` entries in store tree `s/0`, stopped gracefully (sealed) under
    /// `dir/db`; returns the path of its largest file.
    fn sealed_db(dir: &Path, n: usize) -> PathBuf {
        let db = dir.join("db");
        let b = SledBackend::open_checked(&db, crate::config::STATE_CACHE_BYTES).unwrap();
        let s = b.open("s", 0).unwrap();
        for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
            s.write(WriteBatch {
                ops: chunk
                    .iter()
                    .map(|i| (format!("key-{i}").into_bytes(), Some(vec![7u8; 100])))
                    .collect(),
                changelog_offset: Some(*chunk.last().unwrap() as i64),
            })
            .unwrap();
        }
        b.seal().unwrap();
        drop(s);
        drop(b);
        let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(&db)
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.metadata().unwrap().is_file())
            .map(|e| (e.metadata().unwrap().len(), e.path()))
            .collect();
        files.sort();
        files.pop().unwrap().1
    }

    fn set_aside(dir: &Path) -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("db.corrupt-"))
            .collect()
    }

    #[test]
    fn a_sealed_database_reopens_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        sealed_db(dir.path(), 2000);
        let b = SledBackend::open_checked(&dir.path().join("db"), crate::config::STATE_CACHE_BYTES)
            .unwrap();
        let s = b.open("s", 0).unwrap();
        assert_eq!(s.changelog_offset().unwrap(), Some(1999));
        assert_eq!(s.get(b"key-1234").unwrap(), Some(vec![7u8; 100]));
        assert!(set_aside(dir.path()).is_empty());
        // The seal is used up: writes after it are no damage at the next open.
        s.write(WriteBatch {
            ops: vec![(b"late".to_vec(), Some(b"1".to_vec()))],
            changelog_offset: Some(2000),
        })
        .unwrap();
        drop(s);
        b.flush().unwrap();
        drop(b);
        let b = SledBackend::open_checked(&dir.path().join("db"), crate::config::STATE_CACHE_BYTES)
            .unwrap();
        assert_eq!(
            b.open("s", 0).unwrap().changelog_offset().unwrap(),
            Some(2000)
        );
        assert!(set_aside(dir.path()).is_empty());
    }

    #[test]
    fn a_truncated_database_is_moved_aside_and_replaced_by_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let f = sealed_db(dir.path(), 20_000);
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let b = SledBackend::open_checked(&dir.path().join("db"), crate::config::STATE_CACHE_BYTES)
            .unwrap();
        let s = b.open("s", 0).unwrap();
        assert_eq!(
            s.changelog_offset().unwrap(),
            None,
            "an empty store restores"
        );
        assert_eq!(s.get(b"key-1").unwrap(), None);
        let aside = set_aside(dir.path());
        assert_eq!(aside.len(), 1, "moved aside once: {aside:?}");
        assert!(
            aside[0].join(f.file_name().unwrap()).exists(),
            "kept, not deleted"
        );
    }

    #[test]
    fn a_garbled_database_is_moved_aside_and_replaced_by_an_empty_one() {
        use std::io::{Seek, SeekFrom, Write};
        let dir = tempfile::tempdir().unwrap();
        let f = sealed_db(dir.path(), 20_000);
        let len = std::fs::metadata(&f).unwrap().len();
        // 256 bytes of every 4 KiB past the first eighth: live data is hit wherever the log
        // keeps it (one garbled stretch may fall on obsolete page versions only).
        let mut file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
        for at in (len / 8..len).step_by(4096) {
            file.seek(SeekFrom::Start(at)).unwrap();
            file.write_all(&[0xab; 256]).unwrap();
        }
        drop(file);
        let b = SledBackend::open_checked(&dir.path().join("db"), crate::config::STATE_CACHE_BYTES)
            .unwrap();
        assert_eq!(b.open("s", 0).unwrap().changelog_offset().unwrap(), None);
        assert_eq!(set_aside(dir.path()).len(), 1);
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
            // Scans list entries in the store's own order (see `store.rs`).
            let mut all = s.scan(None, usize::MAX).unwrap();
            all.sort();
            let want: Vec<_> = model.into_iter().collect();
            prop_assert_eq!(all, want);
        }
    }
}
