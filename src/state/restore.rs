//! Restore of one (store, partition) from its changelog: an explicit state machine.
//!
//! ```text
//!   plan(checkpoint, low, end) ──▶ Restoring{position} ──apply()*──▶ Done (position >= end)
//! ```
//! - The end is captured once, when the restore starts (the changelog's end offset read
//!   `read_committed`); later writes belong to whoever owns the partition now.
//! - Done is judged by the *position* reached (the next offset to read), never by having
//!   seen a record at `end - 1`: transaction markers take offsets and are never delivered.
//! - Records apply in log order, puts and tombstones alike, each batch written atomically
//!   with the position it reached, so a restore cut short (a rebalance, a crash) resumes
//!   where it stopped.
//! - A local checkpoint beyond the changelog's end means the changelog was recreated: the
//!   local store is cleared and restored from the start.
//! - A log start beyond the local checkpoint (or beyond 0 for an empty store) means records
//!   were deleted under the store (time or size retention, DeleteRecords): entries written
//!   there cannot be restored, and duplicates of them may pass. Onceflow's changelogs never
//!   delete by time or size (`kafka::admin::CHANGELOG_CONFIGS`), so this is logged as a
//!   warning naming the offsets lost.

use super::{KeyValueStore, WriteBatch};
use crate::error::Result;
use std::time::Instant;

/// One changelog record: raw key, value (`None` = tombstone), and its offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangelogRecord {
    /// The store key, raw bytes.
    pub key: Vec<u8>,
    /// The encoded value, `None` for a tombstone.
    pub value: Option<Vec<u8>>,
    /// Offset in the changelog partition.
    pub offset: i64,
}

/// One changelog record a commit sends, borrowed from a staged write: `store`'s
/// `partition`, raw key, encoded value (`None`: a tombstone), stamped `timestamp_ms` (the
/// commit's time, in ms since the epoch).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChangelogWrite<'a> {
    /// The store the write belongs to (its changelog topic is derived from it).
    pub(crate) store: &'a str,
    /// The store's partition, which is also the changelog partition.
    pub(crate) partition: i32,
    /// The store key, raw bytes.
    pub(crate) key: &'a [u8],
    /// The encoded value, `None` for a tombstone.
    pub(crate) value: Option<&'a [u8]>,
    /// The record timestamp, ms since the epoch.
    pub(crate) timestamp_ms: i64,
}

/// Name of the changelog topic of `store` in application `app`.
pub(crate) fn changelog_topic(app: &str, store: &str) -> String {
    format!("{app}-{store}-changelog")
}

/// Progress of a restore, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Progress {
    /// Records applied so far.
    pub(crate) done: u64,
    /// Offsets to cover in all (`end - start`; markers and compacted gaps count too).
    pub(crate) total: u64,
    /// Offsets left.
    pub(crate) remaining: u64,
    /// Records per second so far.
    pub(crate) rate: f64,
    /// Seconds left at that rate.
    pub(crate) eta_seconds: f64,
}

/// The restore of one store partition.
#[derive(Debug)]
pub(crate) struct Restorer {
    store: String,
    partition: i32,
    start: i64,
    end: i64,
    position: i64,
    applied: u64,
    started: Instant,
    #[cfg_attr(not(test), allow(dead_code))] // read by `deleted_range`, which only tests call
    deleted: Option<(i64, i64)>,
}

impl Restorer {
    /// Plan the restore of `engine` given the changelog's `low` and `end` offsets.
    ///
    /// # Errors
    /// A store failure while reading the checkpoint or clearing a store that is ahead of
    /// its changelog.
    pub(crate) fn plan(
        store: &str,
        partition: i32,
        engine: &dyn KeyValueStore,
        low: i64,
        end: i64,
    ) -> Result<Restorer> {
        let checkpoint = engine.changelog_offset()?;
        let start = match checkpoint {
            Some(c) if c > end => {
                tracing::warn!(store, partition, checkpoint = c, end,
                    "local state is ahead of its changelog (was the changelog deleted and recreated?): clearing it, as after `onceflow reset`; its marks are gone and copies of their records will pass");
                engine.clear()?;
                low
            }
            Some(c) => c.max(low),
            None => low,
        };
        let from = match checkpoint {
            Some(c) if c <= end => c,
            _ => 0,
        };
        let deleted = (low > from).then_some((from, low));
        if deleted.is_some() {
            tracing::warn!(
                store,
                partition,
                checkpoint = from,
                log_start = low,
                lost = low - from,
                "changelog records were deleted before this store read them (retention or DeleteRecords): \
                 entries written at offsets {from}..{low} cannot be restored and their duplicates may pass"
            );
        }
        Ok(Restorer {
            store: store.to_string(),
            partition,
            start,
            end,
            position: start,
            applied: 0,
            started: Instant::now(),
            deleted,
        })
    }

    /// The store name.
    pub(crate) fn store(&self) -> &str {
        &self.store
    }

    /// The partition.
    pub(crate) fn partition(&self) -> i32 {
        self.partition
    }

    /// First offset to read.
    pub(crate) fn start_offset(&self) -> i64 {
        self.start
    }

    #[cfg(test)]
    /// The offsets `[from, to)` of changelog records deleted before this store read them
    /// (the log start was beyond the store's checkpoint), if any; logged as a warning when
    /// planned.
    pub(crate) fn deleted_range(&self) -> Option<(i64, i64)> {
        self.deleted
    }

    /// Whether the position has reached the end.
    pub(crate) fn is_done(&self) -> bool {
        self.position >= self.end
    }

    /// Apply `records` (in log order) and record that the reader's position is now
    /// `position`, in one atomic batch. Records at or beyond the captured end are ignored.
    ///
    /// # Errors
    /// A store failure; nothing of this batch is applied then.
    pub(crate) fn apply(
        &mut self,
        engine: &dyn KeyValueStore,
        records: Vec<ChangelogRecord>,
        position: i64,
    ) -> Result<()> {
        engine.write(self.take(records, position))
    }

    /// As [`Restorer::apply`], but return the batch for the caller to write (through the
    /// background writer, so reading the next batch overlaps writing this one). The caller
    /// must write every batch, in order.
    pub(crate) fn take(&mut self, records: Vec<ChangelogRecord>, position: i64) -> WriteBatch {
        let ops: Vec<_> = records
            .into_iter()
            .filter(|r| self.accepts(r.offset))
            .map(|r| (r.key, r.value))
            .collect();
        let position = self.step(ops.len() as u64, position);
        WriteBatch {
            ops,
            changelog_offset: Some(position),
        }
    }

    /// Whether the record at changelog `offset` belongs to this restore (at or after the
    /// position reached, before the captured end).
    pub(crate) fn accepts(&self, offset: i64) -> bool {
        offset >= self.position && offset < self.end
    }

    /// Record a step: `applied` accepted records were written (in log order, see
    /// [`Restorer::accepts`]) and the reader's position is now `position`. Returns the
    /// position to store with them (clamped to the captured end).
    pub(crate) fn step(&mut self, applied: u64, position: i64) -> i64 {
        let position = position.min(self.end).max(self.position);
        let n = applied;
        self.applied += n;
        self.position = position;
        metrics::counter!(crate::metrics::RESTORE_RECORDS,
            "store" => self.store.clone(), "partition" => self.partition.to_string())
        .increment(n);
        metrics::gauge!(crate::metrics::RESTORE_REMAINING,
            "store" => self.store.clone(), "partition" => self.partition.to_string())
        .set((self.end - self.position).max(0) as f64);
        position
    }

    /// Records done / total, rate and ETA.
    pub(crate) fn progress(&self) -> Progress {
        let secs = self.started.elapsed().as_secs_f64().max(1e-6);
        let rate = self.applied as f64 / secs;
        let total = (self.end - self.start).max(0) as u64;
        let remaining = (self.end - self.position).max(0) as u64;
        Progress {
            done: self.applied,
            total,
            remaining,
            rate,
            eta_seconds: if rate > 0.0 {
                remaining as f64 / rate
            } else {
                0.0
            },
        }
    }

    /// Log a progress line.
    pub(crate) fn log_progress(&self) {
        let p = self.progress();
        tracing::info!(store = %self.store, partition = self.partition, done = p.done, total = p.total,
            remaining = p.remaining, rate = format!("{:.0}/s", p.rate), eta = format!("{:.1}s", p.eta_seconds),
            "restoring");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{MemoryBackend, StateBackend};

    fn rec(k: &str, v: Option<&str>, offset: i64) -> ChangelogRecord {
        ChangelogRecord {
            key: k.into(),
            value: v.map(Into::into),
            offset,
        }
    }

    #[test]
    fn applies_in_log_order_and_finishes_by_position_not_by_record() {
        let b = MemoryBackend::default();
        let e = b.open("s", 0).unwrap();
        // Offsets 0..3 hold records; 3 is a transaction marker: no record, end = 4.
        let mut r = Restorer::plan("s", 0, e.as_ref(), 0, 4).unwrap();
        r.apply(
            e.as_ref(),
            vec![
                rec("k", Some("1"), 0),
                rec("k", None, 1),
                rec("k", Some("2"), 2),
            ],
            3,
        )
        .unwrap();
        assert!(!r.is_done(), "position 3 < end 4");
        r.apply(e.as_ref(), vec![], 4).unwrap();
        assert!(
            r.is_done(),
            "the marker's offset is reached by position alone"
        );
        assert_eq!(e.get(b"k").unwrap(), Some(b"2".to_vec()));
        assert_eq!(e.changelog_offset().unwrap(), Some(4));
        assert_eq!(r.progress().done, 3);
    }

    #[test]
    fn resumes_from_the_checkpoint_and_clears_a_store_ahead_of_its_changelog() {
        let b = MemoryBackend::default();
        let e = b.open("s", 0).unwrap();
        let mut r = Restorer::plan("s", 0, e.as_ref(), 0, 10).unwrap();
        r.apply(e.as_ref(), vec![rec("a", Some("1"), 0)], 5)
            .unwrap();
        let r2 = Restorer::plan("s", 0, e.as_ref(), 0, 10).unwrap();
        assert_eq!(r2.start_offset(), 5, "a cut-short restore resumes");
        let r3 = Restorer::plan("s", 0, e.as_ref(), 7, 10).unwrap();
        assert_eq!(
            r3.start_offset(),
            7,
            "records before the log start are gone: start there"
        );
        assert_eq!(
            r3.deleted_range(),
            Some((5, 7)),
            "and that loss is reported"
        );
        assert_eq!(r2.deleted_range(), None);
        let r4 = Restorer::plan("s", 0, e.as_ref(), 0, 3).unwrap();
        assert_eq!(r4.start_offset(), 0);
        assert_eq!(
            e.get(b"a").unwrap(),
            None,
            "cleared: the changelog was recreated"
        );
    }

    #[test]
    fn a_log_start_beyond_an_empty_store_is_reported() {
        let b = MemoryBackend::default();
        let e = b.open("s", 0).unwrap();
        let r = Restorer::plan("s", 0, e.as_ref(), 5, 5).unwrap();
        assert!(r.is_done());
        assert_eq!(r.deleted_range(), Some((0, 5)), "5 records deleted unread");
        let fresh = Restorer::plan("s", 0, e.as_ref(), 0, 5).unwrap();
        assert_eq!(fresh.deleted_range(), None);
    }

    #[test]
    fn records_beyond_the_captured_end_are_not_applied() {
        let b = MemoryBackend::default();
        let e = b.open("s", 0).unwrap();
        let mut r = Restorer::plan("s", 0, e.as_ref(), 0, 1).unwrap();
        r.apply(
            e.as_ref(),
            vec![rec("a", Some("1"), 0), rec("b", Some("2"), 1)],
            2,
        )
        .unwrap();
        assert!(r.is_done());
        assert_eq!(e.get(b"b").unwrap(), None);
        assert_eq!(e.changelog_offset().unwrap(), Some(1));
    }
}
