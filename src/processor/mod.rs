//! Records, the [`Processor`] trait, and the built-in stages.
//!
//! A processor gets one record at a time with a [`Context`] through which it forwards
//! records downstream, emits records to topics, and reads and stages writes to the
//! partition's state stores. Processors are created per task (per source partition), so
//! they may keep scratch buffers without locks.

pub(crate) mod codec;
pub(crate) mod dedup;
pub(crate) mod enrich;
pub(crate) mod expr;
pub(crate) mod fingerprint;
mod json_fast;
pub(crate) mod json_scan;
pub(crate) mod key;
pub(crate) mod record;
pub(crate) mod repartition;
pub(crate) mod route;
pub(crate) mod stages;
pub(crate) mod transform;

pub(crate) use record::{OutRecord, Record, SourceMeta};

use crate::error::{Error, RecordError};
use crate::state::StagedStore;
use std::collections::BTreeMap;

/// Why a processor stopped on a record.
#[derive(Debug)]
pub(crate) enum StageError {
    /// Something about this record: it is dead-lettered and processing goes on.
    Record(RecordError),
    /// Something about the system (a store failed): processing of the batch stops.
    Fatal(Error),
}

impl From<RecordError> for StageError {
    fn from(e: RecordError) -> Self {
        StageError::Record(e)
    }
}

impl From<Error> for StageError {
    fn from(e: Error) -> Self {
        StageError::Fatal(e)
    }
}

/// Per-run totals by outcome, kept for the end-of-run summary (the metrics carry the same
/// counts per stage).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Source records read.
    pub records_in: u64,
    /// Records that passed a dedup stage as first occurrences.
    pub passed: u64,
    /// Records dropped as duplicates.
    pub duplicates: u64,
    /// Records with a known key and a different fingerprint.
    pub conflicts: u64,
    /// Records sent to the dead-letter topic.
    pub dead_lettered: u64,
    /// Records written to sink topics.
    pub records_out: u64,
    /// External effects (http, postgres, redis, file sinks) run and marked done under their
    /// idempotency key. Counted when the effect's record moves on: an effect that finished
    /// while its batch was aborted (a crash, a rewind) is counted as skipped on the replay.
    pub effects_done: u64,
    /// External effects skipped because their idempotency key was already done.
    pub effects_skipped: u64,
    /// External effects run without protection (store unreachable, `on_store_error:
    /// fail_open`). Failed effects are counted in `dead_lettered`.
    pub effects_unprotected: u64,
}

impl Counts {
    /// Add another set of counts into this one.
    pub(crate) fn add(&mut self, o: &Counts) {
        self.records_in += o.records_in;
        self.passed += o.passed;
        self.duplicates += o.duplicates;
        self.conflicts += o.conflicts;
        self.dead_lettered += o.dead_lettered;
        self.records_out += o.records_out;
        self.effects_done += o.effects_done;
        self.effects_skipped += o.effects_skipped;
        self.effects_unprotected += o.effects_unprotected;
    }
}

/// The state stores of one task, by store name.
pub(crate) type Stores = BTreeMap<String, StagedStore>;

/// What a processor may touch while it handles a record.
pub(crate) struct Context<'a> {
    pub(crate) stores: &'a mut Stores,
    pub(crate) forwarded: &'a mut Vec<Record>,
    pub(crate) emitted: &'a mut Vec<OutRecord>,
    pub(crate) counts: &'a mut Counts,
    /// The instance's lookup tables (enrich stages read them).
    pub(crate) tables: &'a crate::state::table::Tables,
    /// Wall-clock time in ms (the test driver's mock clock under test).
    pub(crate) wall_clock_ms: i64,
    /// The largest record the producer accepts, in bytes (librdkafka's
    /// `message.max.bytes`, default [`DEFAULT_MAX_RECORD_BYTES`]); see [`Context::emit`].
    pub(crate) max_record_bytes: usize,
    /// Sink topics whose own `max.message.bytes` admits less than `max_record_bytes`: the
    /// largest record each takes (read at start-up; usually empty).
    pub(crate) topic_limits: &'a std::collections::HashMap<String, usize>,
}

pub(crate) use crate::config::DEFAULT_MAX_RECORD_BYTES;

/// The size librdkafka counts against `message.max.bytes` for `record` (value, key and
/// headers; each header counted with a few bytes of framing, so slightly over).
pub(crate) fn record_bytes(record: &OutRecord) -> usize {
    let headers: usize = record
        .headers
        .iter()
        .map(|(k, v)| k.len() + v.as_ref().map_or(0, |v| v.len()) + 10)
        .sum();
    record.value.as_ref().map_or(0, |v| v.len())
        + record.key.as_ref().map_or(0, |k| k.len())
        + headers
}

impl Context<'_> {
    /// Send `record` on to the next stage.
    pub(crate) fn forward(&mut self, record: Record) {
        self.forwarded.push(record);
    }

    /// Write `record` to a topic; it becomes durable with the task's next commit.
    ///
    /// # Errors
    /// The reason, when the record is larger than the producer accepts
    /// (`message.max.bytes`): the stage refuses its source record, which goes to the
    /// dead-letter topic (its marks withdrawn), instead of the send failing and stopping
    /// the instance on every restart.
    pub(crate) fn emit(&mut self, record: OutRecord) -> Result<(), String> {
        let size = record_bytes(&record);
        if size > self.max_record_bytes {
            return Err(format!(
                "the record for topic {:?} is {size} bytes, over the producer's message.max.bytes ({}); raise kafka.producer.message.max.bytes (and the topic's max.message.bytes) to let it through",
                record.topic, self.max_record_bytes
            ));
        }
        if let Some(limit) = self.topic_limits.get(&*record.topic) {
            if size > *limit {
                return Err(format!(
                    "the record for topic {:?} is {size} bytes, over what the topic's max.message.bytes admits ({limit} bytes of key, value and headers); raise the topic's max.message.bytes to let it through",
                    record.topic
                ));
            }
        }
        self.counts.records_out += 1;
        self.emitted.push(record);
        Ok(())
    }

    /// The task's store named `name`.
    ///
    /// # Errors
    /// [`Error::Topology`] when no such store was declared (a topology bug, caught by
    /// `build()` for built-in stages).
    pub(crate) fn store(&mut self, name: &str) -> Result<&mut StagedStore, Error> {
        self.stores.get_mut(name).ok_or_else(|| Error::Topology {
            node: name.to_string(),
            reason: "no such state store in this task".into(),
        })
    }

    /// Totals for the run summary.
    pub(crate) fn counts(&mut self) -> &mut Counts {
        self.counts
    }
}

/// A stage of a topology: one required method, called once per record.
pub(crate) trait Processor: Send {
    /// Handle `record`: forward, emit, or drop it.
    ///
    /// # Errors
    /// [`StageError::Record`] sends the record to the dead-letter topic with the reason;
    /// [`StageError::Fatal`] stops the batch (the runtime rewinds to the committed offsets).
    fn process(&mut self, record: Record, ctx: &mut Context<'_>) -> Result<(), StageError>;

    /// The store this stage looks up by a key, and where that key is read from a source
    /// record as consumed: the runtime then prefetches the key's place in that store a few
    /// records ahead (a hint only: it changes nothing the stage sees). Default: none.
    fn key_hint(&self) -> Option<(&str, &key::KeyHint)> {
        None
    }

    /// Periodic work before each commit (expiry sweeps); bounded so it never stalls
    /// processing. Default: nothing.
    ///
    /// # Errors
    /// A store failure.
    fn punctuate(&mut self, _ctx: &mut Context<'_>) -> Result<(), Error> {
        Ok(())
    }

    /// The open commit was aborted: its staged writes are gone and its records will be
    /// processed again. Drop anything derived from them. Default: nothing.
    fn on_abort(&mut self) {}

    /// The open commit's staged writes were applied (its outputs are durable). Drop
    /// anything kept for that commit only. Default: nothing.
    fn on_commit(&mut self) {}

    /// Writes staged in `store` for source records that were then dead-lettered further
    /// down were taken back ([`crate::state::StagedStore::withdraw`]): the marks of failed
    /// effects. Called on every stage; a stage may send records on again with
    /// [`Context::forward`] (they run through the stages after it, in this commit).
    /// Returns the records it meant to send on again that failed, with the reason, for the
    /// dead-letter topic. Default: nothing.
    ///
    /// # Errors
    /// A system failure (a store failure) that must stop the commit.
    fn on_withdrawn(
        &mut self,
        _store: &str,
        _withdrawn: &[crate::state::Withdrawn],
        _ctx: &mut Context<'_>,
    ) -> Result<Vec<(Record, RecordError)>, Error> {
        Ok(Vec::new())
    }

    /// Finish the work still running for records already handed to [`Processor::process`]
    /// (external effects in flight), forwarding the records that may go on. Called before
    /// every commit, so no offset is committed ahead of its record's effect. Returns the
    /// records whose work failed, with the reason, for the dead-letter topic. Default: nothing.
    ///
    /// # Errors
    /// A system failure that must stop the commit.
    fn flush(&mut self, _ctx: &mut Context<'_>) -> Result<Vec<(Record, RecordError)>, Error> {
        Ok(Vec::new())
    }
}
