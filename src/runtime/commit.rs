//! The commit protocol: its ordered steps, written once for both guarantees.
//!
//! [`Protocol`] drives the tasks ([`Task`]) and a log ([`CommitLog`]) through one commit.
//! The Kafka runtime's log is the output producer and the source consumer
//! (`runtime::log::KafkaLog`); the broker-free [`crate::TestDriver`] has an
//! in-memory log. Both run this code, so the driver tests check the protocol the runtime
//! runs, and the driver can crash at every failpoint ([`TestDriver::crash_at`]).
//!
//! # The steps of one commit
//! Between commits each processed record's outputs and dead letters are sent at once
//! ([`Protocol::send`]); under exactly_once_v2 the first send opens the transaction. Then:
//!
//! 1. **sinks**: every task finishes its external effects in flight; their dead letters
//!    and downstream outputs are sent too, so no offset is committed ahead of its effect;
//! 2. **sweep**: the stages' periodic work (the expiry sweep) stages its deletes;
//!
//! at_least_once, **pipelined**: the commit is *sealed* (`commit.before_flush`): each
//! store's staged writes become the commit's batch, still read by lookups (a mark in flight
//! still dedups) but no longer withdrawn; the source positions are taken; outputs sent from
//! now on belong to the next commit. Processing goes on at once. Up to [`MAX_IN_FLIGHT`]
//! commits are in flight; the oldest does its steps, in order, as each becomes ready
//! ([`Protocol::advance`], called every turn of the run loop; [`Protocol::drain`] waits for
//! all before partitions go and at a stop):
//!
//! 3. **outputs acknowledged** (every output of this commit's epoch) — `commit.after_flush`;
//! 4. **changelog**: the sealed writes are sent to their changelog topics (tombstones for
//!    deletes), stamped with the seal's wall-clock time, and acknowledged —
//!    `commit.after_changelog`. Only the oldest commit sends changelog records, so the
//!    changelog offsets a store checkpoints are its own commit's;
//! 5. **state, then offsets**: the sealed batches are applied to the stores, one batch per
//!    store with the changelog offset reached (`commit.after_state`), then the source
//!    offsets taken at the seal are committed.
//!
//! exactly_once_v2, one transaction at a time: the outputs are in the open transaction
//! (`eos.after_produce`); the sweep stages its deletes and the staged writes are sealed
//! (still read by lookups) and sent to the changelog in it (`eos.after_changelog`); the
//! source offsets are sent to it with the group metadata (KIP-447; `eos.before_commit`);
//! the transaction commits **in the background** ([`CommitLog::start_commit_transaction`]):
//! processing goes on meanwhile, staging into fresh batches and holding its outputs, as no
//! transaction is open to send them in. When the commit has ended (`eos.after_commit`,
//! checked every turn by [`Protocol::advance`]; the next commit, a revocation or a stop
//! waits for it), the sealed writes are applied and the held outputs are sent in the next
//! transaction. If it failed, the held outputs and every staged write are dropped with the
//! rest of the transaction. Each commit's per-step times are logged at debug.
//!
//! # Guarantees, and the tests that fail when they break
//! - **A mark never hides a lost output.** State (changelog record or store write) is
//!   written only after the outputs it stands for are durable: at_least_once by the order
//!   3 → 4 → 5 of each commit in flight, exactly_once_v2 because everything commits in one
//!   transaction and the store is written after it. Tests:
//!   `a_mark_never_hides_a_lost_output` and `a_crash_at_every_failpoint_loses_nothing`
//!   (tests/driver_dedup.rs), `commits_in_flight_complete_in_order_and_their_marks_still_count`
//!   (tests/driver_pipeline.rs).
//! - **Pipelined (at_least_once)**: a crash repeats at most the records of the commits in
//!   flight (their offsets were not committed), never loses one. Test:
//!   `a_crash_with_commits_in_flight_repeats_at_most_them_and_loses_nothing`
//!   (tests/driver_pipeline.rs, every failpoint with two commits in flight).
//! - **The changelog holds at least what the store holds** (4 before 5), so a lost state
//!   dir, or a store write lost in a crash, is restored. Test:
//!   `a_crash_at_every_failpoint_loses_nothing` (`commit.after_changelog`,
//!   `eos.after_commit`).
//! - **at_least_once**: a crash anywhere before the offsets are committed replays the
//!   records since the last commit: their outputs may repeat, never get lost. Test:
//!   `a_crash_at_every_failpoint_loses_nothing`.
//! - **exactly_once_v2**: read_committed readers see each output once, whatever failpoint
//!   the instance dies at. Tests: `a_crash_at_every_failpoint_loses_nothing` (driver,
//!   exactly once checked) and, on the broker, tests/kafka_crash_harness.rs.
//! - **Processing while a transaction commits** (exactly_once_v2): the outputs of records
//!   processed meanwhile go out only in the next transaction, and the committing
//!   transaction's marks still dedup them; if it fails, is lost in a crash or ends with an
//!   unknown outcome, they are read again and nothing repeats. Tests (tests/driver_pipeline.rs):
//!   `records_processed_while_a_transaction_commits_go_out_in_the_next_one`,
//!   `a_failed_transaction_behind_which_records_were_processed_repeats_and_loses_nothing`,
//!   `a_crash_while_a_transaction_commits_repeats_nothing_and_loses_nothing`,
//!   `a_transaction_failing_under_the_commit_before_a_revocation_repeats_and_loses_nothing`
//!   (the commit before a revocation or a stop, [`Protocol::commit_and_drain`], carries out
//!   how the background commit ended); and for an abort on a loss of partitions,
//!   `an_abort_for_lost_partitions_carries_out_how_the_background_commit_ended`
//!   (src/testing/tests.rs).
//! - **Abort and rewind** (exactly_once_v2): a failed transaction (not fenced) is aborted,
//!   every staged write dropped, and each partition rewinds to its committed offset
//!   ([`Outcome::Aborted`]). Test: `an_aborted_transaction_rewinds_and_repeats_nothing`
//!   (tests/driver_dedup.rs). A fenced producer (another instance took the
//!   transactional.id, or the group moved on) is [`crate::Error::Fenced`]: the instance
//!   stops. Test: `a_zombie_is_fenced_and_its_late_writes_never_appear`
//!   (tests/kafka_eos.rs).
//! - **Unknown outcome** (exactly_once_v2): a commit or abort that got no answer (lost or
//!   late) may have committed or not; a transaction whose offsets were not added in time
//!   is in a state librdkafka no longer reports. Neither is retried blindly (librdkafka
//!   does not implement KIP-890, and a retry after an unknown outcome can lose or repeat
//!   writes):
//!   the producer is re-created ([`CommitLog::recreate_producer`]: its initialisation
//!   fences the old one and settles the transaction), the staged writes are dropped, and
//!   every partition is opened again ([`Outcome::Unknown`]: stores restored from the
//!   changelog, records read again from the committed offsets). Tests:
//!   `a_transaction_of_unknown_outcome_repeats_nothing_and_loses_nothing`
//!   (tests/driver_dedup.rs) and the fault-proxy scenarios of tests/kafka_faults.rs.
//! - **A store failure stops the instance** (a full or broken state dir): retrying cannot
//!   help, so the open transaction is aborted and the error returned; a restart restores
//!   from the changelog. Test: tests/kafka_state_faults.rs.

use crate::config::Guarantee;
use crate::error::{Error, Result};
use crate::processor::OutRecord;
use crate::runtime::Task;
use crate::state::restore::ChangelogWrite;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

#[cfg(doc)]
use crate::TestDriver;

/// Failpoint: at_least_once, outputs sent, not yet acknowledged.
pub const BEFORE_FLUSH: &str = "commit.before_flush";
/// Failpoint: at_least_once, outputs durable; no changelog, no offsets.
pub const AFTER_FLUSH: &str = "commit.after_flush";
/// Failpoint: at_least_once, changelog durable; store not written, no offsets.
pub const AFTER_CHANGELOG: &str = "commit.after_changelog";
/// Failpoint: at_least_once, store written; offsets not committed.
pub const AFTER_STATE: &str = "commit.after_state";
/// Failpoint: exactly_once_v2, outputs in the open transaction, changelog not sent.
pub const EOS_AFTER_PRODUCE: &str = "eos.after_produce";
/// Failpoint: exactly_once_v2, changelog sent in the transaction, offsets not added.
pub const EOS_AFTER_CHANGELOG: &str = "eos.after_changelog";
/// Failpoint: exactly_once_v2, offsets added, transaction not committed.
pub const EOS_BEFORE_COMMIT: &str = "eos.before_commit";
/// Failpoint: exactly_once_v2, transaction committed, store not written.
pub const EOS_AFTER_COMMIT: &str = "eos.after_commit";
/// Failpoint of the restore (not of a commit): a restore batch applied, the restore not
/// finished.
pub const RESTORE_DURING: &str = "restore.during";
/// Failpoint of the state writer (not of a commit): a chunk of a committed batch about to be
/// written to the engine. With `delay` the writer falls behind processing, so that a stop
/// leaves committed marks unpersisted.
pub const STATE_WRITE: &str = "state.write";

/// Every failpoint name, to validate `ONCEFLOW_FAILPOINTS`.
pub(crate) const FAILPOINTS: &[&str] = &[
    BEFORE_FLUSH,
    AFTER_FLUSH,
    AFTER_CHANGELOG,
    AFTER_STATE,
    EOS_AFTER_PRODUCE,
    EOS_AFTER_CHANGELOG,
    EOS_BEFORE_COMMIT,
    EOS_AFTER_COMMIT,
    RESTORE_DURING,
    STATE_WRITE,
];

/// The failpoints of one guarantee's commit, in the order a commit passes them.
pub fn commit_failpoints(g: Guarantee) -> &'static [&'static str] {
    match g {
        Guarantee::AtLeastOnce => &[BEFORE_FLUSH, AFTER_FLUSH, AFTER_CHANGELOG, AFTER_STATE],
        Guarantee::ExactlyOnceV2 => &[
            EOS_AFTER_PRODUCE,
            EOS_AFTER_CHANGELOG,
            EOS_BEFORE_COMMIT,
            EOS_AFTER_COMMIT,
        ],
    }
}

/// The log a commit writes to: output and changelog topics, transactions, source offsets.
///
/// Offsets are `(source partition, offset of the next record to read)`.
/// A repartition record made of borrowed parts: a source message the Kafka run loop routes
/// in place, without copying it into a [`Record`](crate::Record) and an [`OutRecord`].
pub(crate) struct Routed<'a> {
    /// The repartition topic.
    pub(crate) topic: &'a str,
    pub(crate) partition: i32,
    pub(crate) key: Option<&'a [u8]>,
    pub(crate) value: Option<&'a [u8]>,
    /// The source's headers followed by the router's (`None`: a null value).
    pub(crate) headers: &'a [(&'a str, Option<&'a [u8]>)],
    /// Milliseconds since the epoch (`None`: the producer stamps it).
    pub(crate) timestamp: Option<i64>,
}

impl Routed<'_> {
    /// The same record, owned.
    pub(crate) fn to_out(&self) -> OutRecord {
        OutRecord {
            topic: self.topic.to_string(),
            partition: Some(self.partition),
            key: self.key.map(bytes::Bytes::copy_from_slice),
            value: self.value.map(bytes::Bytes::copy_from_slice),
            headers: self
                .headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.map(bytes::Bytes::copy_from_slice)))
                .collect(),
            timestamp: self.timestamp,
        }
    }
}

pub(crate) trait CommitLog {
    /// Queue one output or dead-letter record (inside the open transaction, if any),
    /// counted towards the commit epoch last opened ([`CommitLog::open_epoch`]).
    ///
    /// # Errors
    /// The record is refused (unknown topic, too large; fenced under exactly_once_v2).
    fn send_output(&mut self, rec: &OutRecord) -> Result<()>;

    /// Queue one repartition record given by borrowed parts, as [`CommitLog::send_output`]
    /// queues an output (the default makes it one).
    ///
    /// # Errors
    /// As [`CommitLog::send_output`].
    fn send_routed(&mut self, rec: &Routed<'_>) -> Result<()> {
        self.send_output(&rec.to_out())
    }

    /// Count the outputs sent from now on towards at_least_once commit `epoch` (epochs
    /// grow by one; the first is 0).
    fn open_epoch(&mut self, epoch: u64);

    /// Whether every output of commit `epoch` is acknowledged (asked in epoch order, once
    /// the earlier epochs' are); with `wait`, wait until it is.
    ///
    /// # Errors
    /// A record that could not be delivered (the commit stops: nothing after it happens).
    fn outputs_acked(&mut self, epoch: u64, wait: bool) -> Result<bool>;

    /// Queue one changelog record: `write.store`'s changelog, partition `write.partition`.
    ///
    /// # Errors
    /// As [`CommitLog::send_output`].
    fn send_changelog(&mut self, write: ChangelogWrite<'_>) -> Result<()>;

    /// Queue a run of changelog records of `store`'s `partition`, in order, stamped
    /// `timestamp_ms` (a log may stamp them with the time it queues them instead); the
    /// default sends each with [`CommitLog::send_changelog`].
    ///
    /// # Errors
    /// As [`CommitLog::send_changelog`], for the first write refused.
    fn send_changelog_run(
        &mut self,
        store: &str,
        partition: i32,
        writes: &[(&[u8], Option<&[u8]>)],
        timestamp_ms: i64,
    ) -> Result<()> {
        for (key, value) in writes {
            self.send_changelog(ChangelogWrite {
                store,
                partition,
                key,
                value: *value,
                timestamp_ms,
            })?;
        }
        Ok(())
    }

    /// Whether every changelog record sent is acknowledged; with `wait`, wait until it is.
    ///
    /// # Errors
    /// As [`CommitLog::outputs_acked`].
    fn changelog_acked(&mut self, wait: bool) -> Result<bool>;

    /// How long an at_least_once commit may stay in flight, sealed, before its next step
    /// waits for its acknowledgements (and so fails when the log's own bound on that wait
    /// passes) instead of checking and moving on; `None` (the default): never overdue.
    /// Without it, a commit whose reports never come would stay in flight for good while
    /// fewer than [`MAX_IN_FLIGHT`] are.
    fn ack_timeout(&self) -> Option<Duration> {
        None
    }

    /// The changelog offset after the last acknowledged (or committed) record of `store`'s
    /// `partition`: what the store checkpoints; `None` when nothing was written.
    fn changelog_end(&self, store: &str, partition: i32) -> Option<i64>;

    /// Begin a transaction.
    ///
    /// # Errors
    /// [`Error::Fenced`] when another instance took over.
    fn begin_transaction(&mut self) -> Result<()>;

    /// Add the consumed source `offsets` to the open transaction (with the group metadata).
    ///
    /// # Errors
    /// Abortable errors, [`Error::Fenced`], or [`Error::TransactionOutcomeUnknown`] when
    /// the offsets were not added in time (the Kafka log gives the call 75 s).
    fn send_offsets(&mut self, offsets: &[(i32, i64)]) -> Result<()>;

    /// Start committing the open transaction (its records acknowledged first); the commit
    /// goes on in the background while the caller processes the next records, without
    /// sending any. [`CommitLog::transaction_committed`] tells when it is done.
    ///
    /// # Errors
    /// When the commit cannot be started (abortable errors, or [`Error::Fenced`]).
    fn start_commit_transaction(&mut self) -> Result<()>;

    /// Whether the commit started by [`CommitLog::start_commit_transaction`] is done; with
    /// `wait`, wait until it is.
    ///
    /// # Errors
    /// The commit failed: abortable errors, [`Error::Fenced`], or
    /// [`Error::TransactionOutcomeUnknown`].
    fn transaction_committed(&mut self, wait: bool) -> Result<bool>;

    /// Abort the open transaction: none of its records is ever visible read_committed.
    ///
    /// # Errors
    /// [`Error::Fenced`] or a broker error.
    fn abort_transaction(&mut self) -> Result<()>;

    /// After a transaction of unknown outcome ([`Error::TransactionOutcomeUnknown`]):
    /// replace the transactional producer by a new one with the same transactional.id,
    /// whose initialisation fences the old one and lets the coordinator finish the old
    /// transaction (committed if its commit reached the coordinator, else aborted). Never a
    /// blind retry of the commit (librdkafka does not implement KIP-890).
    ///
    /// # Errors
    /// [`Error::Fenced`] or a broker error: the instance stops.
    fn recreate_producer(&mut self) -> Result<()>;

    /// Commit source `offsets` outside a transaction (at_least_once).
    ///
    /// # Errors
    /// A broker error.
    fn commit_offsets(&mut self, offsets: &[(i32, i64)]) -> Result<()>;

    /// The committed source offsets of `partitions` (`None` where nothing is committed),
    /// where an aborted transaction rewinds to.
    ///
    /// # Errors
    /// A broker error.
    fn committed_offsets(&mut self, partitions: &[i32]) -> Result<BTreeMap<i32, Option<i64>>>;

    /// Pass failpoint `name`. Returns true when the instance dies here (the in-memory log
    /// of the test driver); the Kafka log runs [`crate::runtime::failpoint::hit`], which
    /// kills or stops the process itself and returns false.
    fn failpoint(&mut self, name: &'static str) -> bool {
        crate::runtime::failpoint::hit(name);
        false
    }
}

/// How a commit ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Nothing was processed since the last commit.
    Nothing,
    /// Outputs, changelog, state and offsets committed.
    Committed,
    /// exactly_once_v2: the transaction failed and was aborted; every task's staged writes
    /// were dropped and its position reset. The source must seek each listed partition to
    /// the given offset (`None`: from the beginning / the reset policy).
    Aborted(Vec<(i32, Option<i64>)>),
    /// The instance died at this failpoint (only a test log says so).
    Crashed(&'static str),
    /// exactly_once_v2: the transaction's outcome is unknown (its commit or abort got no
    /// answer). The producer was re-created (which settled the transaction one way or the
    /// other) and every staged write dropped. The stores may now lack the marks of a
    /// transaction that did commit, so every partition must be opened again as after an
    /// assignment: stores restored from the changelog, records read again from the
    /// committed offsets.
    Unknown,
}

/// at_least_once commits in flight at most; sealing one more first waits for the oldest.
pub(crate) const MAX_IN_FLIGHT: usize = 4;

/// An exactly_once_v2 transaction committing in the background: its writes sealed as
/// batch `epoch`, its offsets added.
struct Committing {
    epoch: u64,
    offsets: Vec<(i32, i64)>,
    /// When the commit started (its sinks step).
    started: Instant,
    /// When the transaction's commit was started.
    commit_started: Instant,
    steps: EosSteps,
}

/// An at_least_once commit in flight: sealed, its steps not all done.
struct InFlight {
    epoch: u64,
    /// Source offsets it commits, taken when it was sealed.
    offsets: Vec<(i32, i64)>,
    /// Wall-clock time of the seal: its changelog records' timestamp.
    now_ms: i64,
    /// Its changelog records are sent (its outputs were acknowledged).
    changelog_sent: bool,
    sealed_at: Instant,
    /// Milliseconds from the seal to the outputs' acknowledgement.
    outputs_ms: f64,
    changelog_records: usize,
}

/// The commit protocol of one instance: the guarantee, the open transaction, what was
/// processed since the last commit, and (at_least_once) the commits in flight.
pub(crate) struct Protocol {
    guarantee: Guarantee,
    txn_open: bool,
    processed: usize,
    commits: u64,
    out: Vec<OutRecord>,
    topology: String,
    /// The epoch of the outputs sent now (at_least_once; the next commit seals it).
    epoch: u64,
    /// at_least_once commits in flight, oldest first; each completes its steps in order.
    pipeline: VecDeque<InFlight>,
    /// The offsets of the last commit that completed every step (per task), e.g. for the
    /// purge of consumed repartition records: never ahead of what a restart resumes from.
    committed: Vec<(i32, i64)>,
    /// exactly_once_v2: the transaction committing in the background, if any.
    committing: Option<Committing>,
    /// exactly_once_v2: outputs of the records processed while a transaction commits, sent
    /// in the next transaction once it has committed.
    held: Vec<OutRecord>,
}

/// Why a step stopped: an error, or a crash at a failpoint.
enum Stop {
    Error(Error),
    Crash(&'static str),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Stop::Error(e)
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

impl Protocol {
    /// The protocol for `guarantee`, counting commits under topology name `topology`.
    pub(crate) fn new(guarantee: Guarantee, topology: &str) -> Protocol {
        Protocol {
            guarantee,
            txn_open: false,
            processed: 0,
            commits: 0,
            out: Vec::with_capacity(16),
            topology: topology.to_string(),
            epoch: 0,
            pipeline: VecDeque::new(),
            committed: Vec::new(),
            committing: None,
            held: Vec::new(),
        }
    }

    /// The offsets (task, next offset) of the last commit that completed every step:
    /// under at_least_once the commits still in flight are not in them. Under
    /// at_least_once the offset commit itself is asynchronous: these offsets may reach the
    /// group coordinator a little later.
    pub(crate) fn last_committed_offsets(&self) -> &[(i32, i64)] {
        &self.committed
    }

    /// The guarantee.
    pub(crate) fn guarantee(&self) -> Guarantee {
        self.guarantee
    }

    /// Source records processed since the last commit (at_least_once: since the last seal).
    pub(crate) fn uncommitted(&self) -> usize {
        self.processed
    }

    /// Commits made (at_least_once: completed).
    pub(crate) fn commits(&self) -> u64 {
        self.commits
    }

    /// Commits in flight: at_least_once commits sealed with steps still to do, or the
    /// exactly_once_v2 transaction committing in the background.
    pub(crate) fn in_flight(&self) -> usize {
        self.pipeline.len() + usize::from(self.committing.is_some())
    }

    fn eos(&self) -> bool {
        self.guarantee == Guarantee::ExactlyOnceV2
    }

    /// Count one processed source record that became the one repartition record `rec`
    /// (routed in place, see [`Routed`]) and send it, as [`Protocol::processed`] does.
    ///
    /// # Errors
    /// As [`Protocol::processed`].
    pub(crate) fn processed_routed(
        &mut self,
        log: &mut dyn CommitLog,
        rec: &Routed<'_>,
    ) -> Result<()> {
        self.processed += 1;
        if self.committing.is_some() {
            self.held.push(rec.to_out());
            return Ok(());
        }
        self.release_held(log)?;
        self.open(log)?;
        log.send_routed(rec)
    }

    /// Count one processed source record and send its outputs (`out` is drained); under
    /// exactly_once_v2 the transaction is opened first if none is.
    ///
    /// # Errors
    /// A record refused by the log, or [`Error::Fenced`].
    pub(crate) fn processed(
        &mut self,
        log: &mut dyn CommitLog,
        out: &mut Vec<OutRecord>,
    ) -> Result<()> {
        self.processed += 1;
        self.send(log, out)
    }

    /// Send `out` (drained), opening the transaction first under exactly_once_v2.
    ///
    /// # Errors
    /// As [`Protocol::processed`].
    pub(crate) fn send(&mut self, log: &mut dyn CommitLog, out: &mut Vec<OutRecord>) -> Result<()> {
        if self.committing.is_some() {
            // No transaction to send in until this one has committed.
            self.held.append(out);
            return Ok(());
        }
        self.release_held(log)?;
        if out.is_empty() {
            return Ok(());
        }
        self.open(log)?;
        let sent = out.iter().try_for_each(|o| log.send_output(o));
        out.clear();
        sent
    }

    /// Send the outputs held while the last transaction committed (it has), in the next.
    fn release_held(&mut self, log: &mut dyn CommitLog) -> Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        self.open(log)?;
        let mut held = std::mem::take(&mut self.held);
        let sent = held.iter().try_for_each(|o| log.send_output(o));
        held.clear();
        // Keep the buffer for the next commit.
        self.held = held;
        sent
    }

    fn open(&mut self, log: &mut dyn CommitLog) -> Result<()> {
        if self.eos() && !self.txn_open {
            log.begin_transaction()?;
            self.txn_open = true;
        }
        Ok(())
    }

    fn point(log: &mut dyn CommitLog, name: &'static str) -> Result<(), Stop> {
        if log.failpoint(name) {
            Err(Stop::Crash(name))
        } else {
            Ok(())
        }
    }

    /// Run one commit over `tasks` (by source partition) at wall-clock time `now_ms`,
    /// in the order the module docs state. at_least_once: seal the commit and do every
    /// step of the commits in flight that is ready, waiting only while more than
    /// [`MAX_IN_FLIGHT`] are in flight ([`Protocol::drain`] waits for all).
    ///
    /// # Errors
    /// A store failure, an output that could not be delivered (at_least_once: nothing is
    /// committed, a restart replays), [`Error::Fenced`].
    pub(crate) fn commit(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        now_ms: i64,
    ) -> Result<Outcome> {
        if self.eos() {
            // One transaction at a time: the one committing in the background ends first.
            let before = self.finish_transaction(log, tasks, true)?;
            if !matches!(before, Outcome::Nothing | Outcome::Committed) {
                return Ok(before);
            }
            if self.processed == 0 && self.held.is_empty() {
                return Ok(before);
            }
        } else if self.processed == 0 {
            return self.advance(log, tasks);
        }
        let started = Instant::now();
        // 1. Sinks.
        for t in tasks.values_mut() {
            t.flush_effects(now_ms, &mut self.out)?;
        }
        let mut out = std::mem::take(&mut self.out);
        let sent = self.send(log, &mut out);
        self.out = out;
        sent?;
        if !self.eos() {
            return match self.seal(log, tasks, now_ms, started) {
                Ok(()) => self.run_pipeline(log, tasks, MAX_IN_FLIGHT),
                Err(Stop::Crash(name)) => Ok(Outcome::Crashed(name)),
                Err(Stop::Error(e)) => Err(e),
            };
        }
        self.open(log)?;
        let steps = EosSteps {
            sinks_ms: ms_since(started),
            ..EosSteps::default()
        };
        match self.eos_steps(log, tasks, now_ms, started, steps) {
            Ok(c) => self.committing = Some(c),
            Err(stop) => return self.failed(log, tasks, stop),
        }
        self.processed = 0;
        // Done at once if the log is quick (the test driver); else in the background while
        // the run loop processes on ([`Protocol::advance`]).
        self.finish_transaction(log, tasks, false)
    }

    /// exactly_once_v2: carry out a failure of the transaction's steps (before or during
    /// its commit): a fenced producer or a store failure stops the instance; an unknown
    /// outcome re-creates the producer; any other failure aborts and rewinds.
    fn failed(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        stop: Stop,
    ) -> Result<Outcome> {
        match stop {
            Stop::Crash(name) => Ok(Outcome::Crashed(name)),
            Stop::Error(e) if matches!(e, Error::Fenced(_)) => Err(e),
            Stop::Error(e) if e.is_store_failure() => {
                // Not the transaction's fault: aborting and trying again would fail the
                // same way forever. Nothing of this commit becomes visible; the instance
                // stops, and a restart restores from the changelog.
                tracing::error!(error = %e, "state store failed: aborting the transaction and stopping");
                if let Err(a) = self.abort_transaction(log) {
                    tracing::warn!(error = %a, "the abort after a store failure failed too");
                }
                Err(e)
            }
            Stop::Error(e @ Error::TransactionOutcomeUnknown(_)) => self.recover(log, tasks, &e),
            Stop::Error(e) => {
                tracing::warn!(error = %e, "transaction failed: aborting and rewinding to the committed offsets");
                match self.abort(log, tasks) {
                    Err(a @ Error::TransactionOutcomeUnknown(_)) => self.recover(log, tasks, &a),
                    aborted => aborted,
                }
            }
        }
    }

    /// exactly_once_v2: if the transaction committing in the background is done (or, with
    /// `wait`, once it is), apply its sealed writes to the stores: [`Outcome::Committed`].
    /// [`Outcome::Nothing`] while it goes on (or when none is committing); a failure is
    /// carried out as [`Protocol::commit`] does.
    ///
    /// # Errors
    /// As [`Protocol::commit`].
    fn finish_transaction(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        wait: bool,
    ) -> Result<Outcome> {
        if self.committing.is_none() {
            return Ok(Outcome::Nothing);
        }
        match log.transaction_committed(wait) {
            Ok(false) => return Ok(Outcome::Nothing),
            Ok(true) => {}
            Err(e) => {
                self.committing = None;
                return self.failed(log, tasks, Stop::Error(e));
            }
        }
        let Some(mut c) = self.committing.take() else {
            return Ok(Outcome::Nothing);
        };
        self.txn_open = false;
        c.steps.commit_ms = ms_since(c.commit_started);
        metrics::counter!(crate::metrics::TRANSACTIONS, "result" => "committed").increment(1);
        if let Err(Stop::Crash(n)) = Self::point(log, EOS_AFTER_COMMIT) {
            return Ok(Outcome::Crashed(n));
        }
        let t = Instant::now();
        for (p, task) in tasks.iter_mut() {
            let _span = task.span().clone().entered();
            task.commit_sealed(c.epoch, |store| log.changelog_end(store, *p))?;
        }
        c.steps.state_ms = ms_since(t);
        let steps = &c.steps;
        tracing::debug!(
            sinks_ms = steps.sinks_ms,
            changelog_ms = steps.changelog_ms,
            changelog_records = steps.changelog_records,
            send_offsets_ms = steps.send_offsets_ms,
            commit_transaction_ms = steps.commit_ms,
            state_ms = steps.state_ms,
            total_ms = ms_since(c.started),
            "exactly_once_v2 commit steps"
        );
        self.committed = c.offsets;
        self.commits += 1;
        metrics::counter!(crate::metrics::COMMITS, "topology" => self.topology.clone())
            .increment(1);
        Ok(Outcome::Committed)
    }

    /// at_least_once: do every step of the commits in flight that is ready, without
    /// waiting. Call it often (the run loop does, every turn).
    ///
    /// # Errors
    /// As [`Protocol::commit`].
    pub(crate) fn advance(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
    ) -> Result<Outcome> {
        if self.eos() {
            return self.end_transaction(log, tasks, false);
        }
        self.run_pipeline(log, tasks, usize::MAX)
    }

    /// [`Protocol::commit`], then [`Protocol::drain`]: the commit before partitions go or
    /// the instance stops. The commit's outcome stands when it has something to carry out
    /// (an abort, an unknown outcome: nothing is in flight after it); else the drain's does
    /// (the transaction committing in the background may fail only now).
    ///
    /// # Errors
    /// As [`Protocol::commit`].
    pub(crate) fn commit_and_drain(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        now_ms: i64,
    ) -> Result<Outcome> {
        let first = self.commit(log, tasks, now_ms)?;
        if !matches!(first, Outcome::Nothing | Outcome::Committed) {
            return Ok(first);
        }
        Ok(match self.drain(log, tasks)? {
            Outcome::Nothing => first,
            later => later,
        })
    }

    /// Wait until every commit in flight has done all its steps (at_least_once) or the
    /// transaction committing in the background has ended and the outputs held meanwhile
    /// are sent in the next (exactly_once_v2): before partitions go, at a stop, and in the
    /// test driver.
    ///
    /// # Errors
    /// As [`Protocol::commit`].
    pub(crate) fn drain(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
    ) -> Result<Outcome> {
        if self.eos() {
            return self.end_transaction(log, tasks, true);
        }
        self.run_pipeline(log, tasks, 0)
    }

    /// exactly_once_v2: [`Protocol::finish_transaction`], then the outputs held meanwhile
    /// go out in the next transaction.
    fn end_transaction(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        wait: bool,
    ) -> Result<Outcome> {
        let outcome = self.finish_transaction(log, tasks, wait)?;
        if outcome == Outcome::Committed {
            self.release_held(log)?;
        }
        Ok(outcome)
    }

    /// at_least_once step 2 (sweep) and the seal: the commit is in flight.
    fn seal(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        now_ms: i64,
        started: Instant,
    ) -> Result<(), Stop> {
        for t in tasks.values_mut() {
            t.punctuate(now_ms)?;
        }
        let epoch = self.epoch;
        for t in tasks.values_mut() {
            t.seal(epoch);
        }
        let offsets = tasks
            .iter()
            .filter_map(|(p, t)| t.position().map(|o| (*p, o)))
            .collect();
        self.pipeline.push_back(InFlight {
            epoch,
            offsets,
            now_ms,
            changelog_sent: false,
            sealed_at: started,
            outputs_ms: 0.0,
            changelog_records: 0,
        });
        self.epoch += 1;
        log.open_epoch(self.epoch);
        self.processed = 0;
        Self::point(log, BEFORE_FLUSH)
    }

    /// Do the steps of the commits in flight, oldest first, each in order; wait while
    /// more than `keep` are in flight, else stop at the first step not ready.
    fn run_pipeline(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        keep: usize,
    ) -> Result<Outcome> {
        let mut outcome = Outcome::Nothing;
        loop {
            let wait = self.pipeline.len() > keep;
            match self.step(log, tasks, wait) {
                Ok(Progress::Idle) => return Ok(outcome),
                Ok(Progress::Stepped) => {}
                Ok(Progress::Completed) => outcome = Outcome::Committed,
                Err(Stop::Crash(name)) => return Ok(Outcome::Crashed(name)),
                Err(Stop::Error(e)) => return Err(e),
            }
        }
    }

    /// One step of the oldest commit in flight, if ready (or `wait`).
    fn step(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        wait: bool,
    ) -> Result<Progress, Stop> {
        let Some(head) = self.pipeline.front_mut() else {
            return Ok(Progress::Idle);
        };
        // Overdue: wait (the log's wait is bounded) rather than check again for good.
        let wait = wait
            || log
                .ack_timeout()
                .is_some_and(|t| head.sealed_at.elapsed() >= t);
        if !head.changelog_sent {
            // 4. Outputs durable; then the changelog, as state may not run ahead of them.
            if !log.outputs_acked(head.epoch, wait)? {
                return Ok(Progress::Idle);
            }
            head.outputs_ms = ms_since(head.sealed_at);
            Self::point(log, AFTER_FLUSH)?;
            let (epoch, now_ms) = (head.epoch, head.now_ms);
            let sent = send_changelogs(log, tasks, now_ms, |t, f| {
                t.for_each_sealed_write(epoch, f);
            })?;
            head.changelog_sent = true;
            head.changelog_records = sent;
            return Ok(Progress::Stepped);
        }
        // 5. Changelog durable; then the store, then the offsets.
        if !log.changelog_acked(wait)? {
            return Ok(Progress::Idle);
        }
        let changelog_ms = ms_since(head.sealed_at);
        Self::point(log, AFTER_CHANGELOG)?;
        let epoch = head.epoch;
        // No fsync: the changelog is durable, and the store recovers a prefix of atomic
        // batches, each with its checkpoint; a lost tail is restored.
        for (p, t) in tasks.iter_mut() {
            let _span = t.span().clone().entered();
            t.commit_sealed(epoch, |store| log.changelog_end(store, *p))?;
        }
        Self::point(log, AFTER_STATE)?;
        let done = self.pipeline.pop_front().expect("the head exists");
        if !done.offsets.is_empty() {
            log.commit_offsets(&done.offsets)?;
            self.committed = done.offsets.clone();
        }
        tracing::debug!(
            epoch,
            outputs_ms = done.outputs_ms,
            changelog_ms,
            changelog_records = done.changelog_records,
            total_ms = ms_since(done.sealed_at),
            in_flight = self.pipeline.len(),
            "at_least_once commit steps"
        );
        self.commits += 1;
        metrics::counter!(crate::metrics::COMMITS, "topology" => self.topology.clone())
            .increment(1);
        Ok(Progress::Completed)
    }

    /// exactly_once_v2 steps up to the start of the transaction's commit: a failure here
    /// aborts it. The staged writes are sealed (the next records stage into fresh batches
    /// while the transaction commits) and sent to the changelog; the positions are added as
    /// offsets.
    fn eos_steps(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        now_ms: i64,
        started: Instant,
        mut steps: EosSteps,
    ) -> Result<Committing, Stop> {
        // 2. Outputs: in the open transaction.
        Self::point(log, EOS_AFTER_PRODUCE)?;
        // 3. Sweep. 4. Changelog.
        let t0 = Instant::now();
        for t in tasks.values_mut() {
            t.punctuate(now_ms)?;
        }
        let epoch = self.epoch;
        self.epoch += 1;
        for t in tasks.values_mut() {
            t.seal(epoch);
        }
        let sent = send_changelogs(log, tasks, now_ms, |t, f| {
            t.for_each_sealed_write(epoch, f);
        })?;
        steps.changelog_ms = ms_since(t0);
        steps.changelog_records = sent;
        Self::point(log, EOS_AFTER_CHANGELOG)?;
        // 5. Offsets, then the transaction's commit.
        let offsets: Vec<(i32, i64)> = tasks
            .iter()
            .filter_map(|(p, t)| t.position().map(|o| (*p, o)))
            .collect();
        let t1 = Instant::now();
        if !offsets.is_empty() {
            log.send_offsets(&offsets)?;
        }
        steps.send_offsets_ms = ms_since(t1);
        Self::point(log, EOS_BEFORE_COMMIT)?;
        let commit_started = Instant::now();
        log.start_commit_transaction()?;
        Ok(Committing {
            epoch,
            offsets,
            started,
            commit_started,
            steps,
        })
    }

    /// Abort the open transaction (if any), drop every task's staged writes and reset its
    /// position to the committed offset: [`Outcome::Aborted`] with the partitions the
    /// source must seek back (those that processed records and are not restoring) and
    /// their offsets. A transaction committing in the background ends first; if it failed,
    /// its own outcome is returned, carried out as by [`Protocol::commit`] (aborted and
    /// rewound, or [`Outcome::Unknown`]: every partition must be opened again).
    ///
    /// # Errors
    /// [`Error::Fenced`] or a broker error from the abort or the offset fetch.
    pub(crate) fn abort(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
    ) -> Result<Outcome> {
        match self.finish_transaction(log, tasks, true)? {
            Outcome::Nothing | Outcome::Committed => {}
            // Already aborted (the partitions to rewind are in it), or of unknown outcome:
            // the positions were reset, so a second abort would rewind nothing.
            ended => return Ok(ended),
        }
        self.held.clear();
        self.abort_transaction(log)?;
        let parts: Vec<i32> = tasks.keys().copied().collect();
        let committed = log.committed_offsets(&parts)?;
        let mut seek = Vec::new();
        for (p, t) in tasks.iter_mut() {
            let off = committed.get(p).copied().flatten();
            let processed = t.position().is_some();
            t.abort(off);
            if processed && !t.is_restoring() {
                seek.push((*p, off));
            }
        }
        self.processed = 0;
        Ok(Outcome::Aborted(seek))
    }

    /// A transaction of unknown outcome: drop every staged write, forget the transaction,
    /// re-create the producer ([`CommitLog::recreate_producer`]); the caller opens every
    /// partition again ([`Outcome::Unknown`]).
    ///
    /// # Errors
    /// As [`CommitLog::recreate_producer`].
    fn recover(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
        e: &Error,
    ) -> Result<Outcome> {
        tracing::warn!(error = %e, "transaction outcome unknown: re-creating the producer (never a blind retry), then restoring and reading again from the committed offsets");
        self.txn_open = false;
        self.processed = 0;
        self.out.clear();
        self.held.clear();
        self.committing = None;
        for t in tasks.values_mut() {
            t.abort(None);
        }
        log.recreate_producer()?;
        metrics::counter!(crate::metrics::TRANSACTIONS, "result" => "unknown").increment(1);
        Ok(Outcome::Unknown)
    }

    /// Partitions lost (exactly_once_v2: the group moved on without this instance): abort
    /// the open transaction and drop every staged write, so the next commit finds nothing.
    ///
    /// # Errors
    /// As [`Protocol::abort`].
    pub(crate) fn abort_lost(
        &mut self,
        log: &mut dyn CommitLog,
        tasks: &mut BTreeMap<i32, Task>,
    ) -> Result<()> {
        self.finish_transaction(log, tasks, true)?;
        self.held.clear();
        self.abort_transaction(log)?;
        for t in tasks.values_mut() {
            t.abort(None);
        }
        self.processed = 0;
        Ok(())
    }

    /// Abort the open transaction, if any (counted).
    ///
    /// # Errors
    /// As [`CommitLog::abort_transaction`].
    pub(crate) fn abort_transaction(&mut self, log: &mut dyn CommitLog) -> Result<()> {
        if self.txn_open {
            self.txn_open = false;
            log.abort_transaction()?;
            metrics::counter!(crate::metrics::TRANSACTIONS, "result" => "aborted").increment(1);
        }
        Ok(())
    }

    /// Forget the open transaction, the commits in flight and the uncommitted records
    /// without telling the log (the test driver's crash: the process is gone).
    pub(crate) fn forget(&mut self) {
        self.txn_open = false;
        self.processed = 0;
        self.out.clear();
        self.pipeline.clear();
        self.committing = None;
        self.held.clear();
    }
}

/// What one step of the pipeline did.
enum Progress {
    /// Nothing was ready (or nothing is in flight).
    Idle,
    /// A step was done; the commit is still in flight.
    Stepped,
    /// The oldest commit did its last step.
    Completed,
}

/// Milliseconds of each step of one exactly_once_v2 commit (logged at debug).
#[derive(Default)]
struct EosSteps {
    sinks_ms: f64,
    changelog_ms: f64,
    changelog_records: usize,
    send_offsets_ms: f64,
    commit_ms: f64,
    state_ms: f64,
}

/// Send every write that `writes` yields for each task to the changelog of the task's
/// partition (the changelog step of both protocols), in runs of one store and partition
/// stamped `now_ms` (see [`CommitLog::send_changelog_run`]); returns how many.
///
/// # Errors
/// The first write the log refuses; nothing after it is sent.
fn send_changelogs<'t>(
    log: &mut dyn CommitLog,
    tasks: &'t BTreeMap<i32, Task>,
    now_ms: i64,
    writes: impl Fn(&'t Task, &mut dyn FnMut(&'t str, &'t [u8], Option<&'t [u8]>)),
) -> Result<usize> {
    /// Writes handed to the log at once (see `send_changelog_run`).
    const RUN: usize = 1024;
    let mut sent = 0usize;
    let mut run: Vec<(&[u8], Option<&[u8]>)> = Vec::with_capacity(RUN);
    let mut result = Ok(());
    for (p, t) in tasks {
        let mut store: Option<&str> = None;
        let mut flush = |store: &str, run: &mut Vec<(&[u8], Option<&[u8]>)>| {
            if result.is_ok() && !run.is_empty() {
                result = log.send_changelog_run(store, *p, run, now_ms);
                sent += run.len();
            }
            run.clear();
        };
        writes(t, &mut |name, key, value| {
            if let Some(s) = store.filter(|s| *s != name || run.len() == RUN) {
                flush(s, &mut run);
            }
            store = Some(name);
            run.push((key, value));
        });
        if let Some(s) = store {
            flush(s, &mut run);
        }
    }
    result.map(|()| sent)
}
