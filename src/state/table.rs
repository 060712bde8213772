//! Lookup tables materialized from a compacted topic (a Kafka Streams GlobalKTable).
//!
//! Every instance keeps the whole table: all partitions of the table topic in one engine
//! (one sled tree per table), with the next offset to read of each partition stored in the
//! same atomic batch as the rows those offsets cover. The table topic is its own changelog:
//! a wiped table is loaded again from the topic's start, a kept one resumes from its
//! stored offsets. Rows are stored as the JSON text of their record view, whatever the
//! topic's codec, so a lookup costs one JSON parse.
//!
//! Records of the topic apply in log order per partition: a value puts the row under the
//! record key (raw bytes, never decoded), a null value (tombstone) deletes it. A record with
//! no key is skipped; one whose value does not decode deletes the key's row (the newest
//! value for that key is unusable, so no stale row is served) and is counted and logged.

use crate::codec::Format;
use crate::error::Result;
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

/// The engine of one table: rows by key plus the next offset of each topic partition.
pub(crate) trait TableEngine: Send + Sync {
    /// The table name.
    fn name(&self) -> &str;

    /// The row stored under `key` (JSON text).
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to read.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;

    /// Apply puts (`Some`) and deletes (`None`) in order, together with the next offset to
    /// read of each partition listed, atomically.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to write; nothing was applied then.
    fn apply(&self, ops: Vec<(Vec<u8>, Option<Vec<u8>>)>, offsets: &[(i32, i64)]) -> Result<()>;

    /// The stored next offset of each partition (empty for a new or wiped table).
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to read.
    fn offsets(&self) -> Result<BTreeMap<i32, i64>>;

    /// Remove every row and offset.
    ///
    /// # Errors
    /// [`crate::Error::State`] when the engine fails to write.
    fn clear(&self) -> Result<()>;
}

/// The tables of an instance by name, shared by all its tasks.
pub(crate) type Tables = BTreeMap<String, Arc<dyn TableEngine>>;

/// An in-memory [`TableEngine`] (test driver, benchmarks).
#[derive(Default)]
pub(crate) struct MemoryTable {
    name: String,
    #[allow(clippy::type_complexity)]
    data: RwLock<(ahash::AHashMap<Vec<u8>, Vec<u8>>, BTreeMap<i32, i64>)>,
}

impl MemoryTable {
    /// An empty table called `name`.
    pub(crate) fn new(name: &str) -> Self {
        MemoryTable {
            name: name.to_string(),
            data: RwLock::default(),
        }
    }
}

impl TableEngine for MemoryTable {
    fn name(&self) -> &str {
        &self.name
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.data.read().expect("table lock").0.get(key).cloned())
    }

    fn apply(&self, ops: Vec<(Vec<u8>, Option<Vec<u8>>)>, offsets: &[(i32, i64)]) -> Result<()> {
        let mut d = self.data.write().expect("table lock");
        for (k, v) in ops {
            match v {
                Some(v) => d.0.insert(k, v),
                None => d.0.remove(&k),
            };
        }
        for (p, o) in offsets {
            d.1.insert(*p, *o);
        }
        Ok(())
    }

    fn offsets(&self) -> Result<BTreeMap<i32, i64>> {
        Ok(self.data.read().expect("table lock").1.clone())
    }

    fn clear(&self) -> Result<()> {
        let mut d = self.data.write().expect("table lock");
        d.0.clear();
        d.1.clear();
        Ok(())
    }
}

/// One record of a table topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableRecord {
    /// Topic partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Record key (the row key); `None` records are skipped.
    pub key: Option<Vec<u8>>,
    /// Value in the table topic's codec; `None` is a tombstone.
    pub value: Option<Vec<u8>>,
}

/// What applying a batch of table records did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Applied {
    /// Rows put.
    pub puts: u64,
    /// Rows deleted by tombstones.
    pub deletes: u64,
    /// Records skipped: no key, or a value that did not decode (its key's row deleted).
    pub skipped: u64,
}

/// Apply `records` (in log order per partition) of a table topic with codec `format` to
/// `engine` in one atomic batch, with each partition's next offset.
///
/// # Errors
/// [`crate::Error::State`] when the engine write fails.
pub(crate) fn apply_records(
    engine: &dyn TableEngine,
    format: &Format,
    records: &[TableRecord],
) -> Result<Applied> {
    let mut applied = Applied::default();
    let mut ops = Vec::with_capacity(records.len());
    let mut offsets: BTreeMap<i32, i64> = BTreeMap::new();
    for r in records {
        let next = offsets.entry(r.partition).or_insert(r.offset + 1);
        *next = (*next).max(r.offset + 1);
        let Some(key) = &r.key else {
            applied.skipped += 1;
            tracing::warn!(
                table = engine.name(),
                partition = r.partition,
                offset = r.offset,
                "table record without a key skipped"
            );
            continue;
        };
        match &r.value {
            None => {
                applied.deletes += 1;
                ops.push((key.clone(), None));
            }
            Some(v) => match row_bytes(format, v) {
                Ok(row) => {
                    applied.puts += 1;
                    ops.push((key.clone(), Some(row)));
                }
                Err(reason) => {
                    applied.skipped += 1;
                    tracing::warn!(table = engine.name(), partition = r.partition, offset = r.offset,
                        %reason, "table record does not decode: its key's row is removed");
                    ops.push((key.clone(), None));
                }
            },
        }
    }
    let offsets: Vec<(i32, i64)> = offsets.into_iter().collect();
    if !ops.is_empty() || !offsets.is_empty() {
        engine.apply(ops, &offsets)?;
    }
    metrics::counter!(crate::metrics::TABLE_RECORDS, "table" => engine.name().to_string())
        .increment(records.len() as u64);
    Ok(applied)
}

/// The stored form of a row: JSON text of its view (JSON values are kept as they are,
/// after checking they parse).
fn row_bytes(format: &Format, v: &[u8]) -> std::result::Result<Vec<u8>, String> {
    match format {
        Format::Json => {
            serde_json::from_slice::<serde::de::IgnoredAny>(v)
                .map_err(|e| format!("value is not valid JSON: {e}"))?;
            Ok(v.to_vec())
        }
        other => {
            let view = other.decode(v)?;
            serde_json::to_vec(&view).map_err(|e| e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(p: i32, o: i64, k: Option<&str>, v: Option<&str>) -> TableRecord {
        TableRecord {
            partition: p,
            offset: o,
            key: k.map(|k| k.as_bytes().to_vec()),
            value: v.map(|v| v.as_bytes().to_vec()),
        }
    }

    #[test]
    fn puts_tombstones_bad_values_and_offsets() {
        let t = MemoryTable::new("c");
        let a = apply_records(
            &t,
            &Format::Json,
            &[
                rec(0, 0, Some("a"), Some(r#"{"n":1}"#)),
                rec(1, 7, Some("b"), Some(r#"{"n":2}"#)),
                rec(0, 1, Some("a"), Some(r#"{"n":3}"#)),
                rec(1, 8, None, Some(r#"{"n":4}"#)),
            ],
        )
        .unwrap();
        assert_eq!(
            a,
            Applied {
                puts: 3,
                deletes: 0,
                skipped: 1
            }
        );
        assert_eq!(t.get(b"a").unwrap(), Some(br#"{"n":3}"#.to_vec()));
        assert_eq!(t.offsets().unwrap(), BTreeMap::from([(0, 2), (1, 9)]));
        let a = apply_records(
            &t,
            &Format::Json,
            &[
                rec(0, 2, Some("a"), None),
                rec(1, 9, Some("b"), Some("{oops")),
            ],
        )
        .unwrap();
        assert_eq!(
            a,
            Applied {
                puts: 0,
                deletes: 1,
                skipped: 1
            }
        );
        assert_eq!(t.get(b"a").unwrap(), None);
        assert_eq!(t.get(b"b").unwrap(), None);
        assert_eq!(t.offsets().unwrap(), BTreeMap::from([(0, 3), (1, 10)]));
    }
}
