//! The driver's log: what a broker holds, in memory, under the runtime's commit protocol.

use super::*;
use crate::state::restore::ChangelogWrite;

/// A changelog record sent and not yet durable: (store, partition), key, value.
pub(super) type InFlightChangelog = ((String, i32), Vec<u8>, Option<Vec<u8>>);

/// The driver's log: what a broker holds, in memory.
///
/// Outputs and changelog records sent are in flight until acknowledged (at_least_once) or
/// until their transaction commits (exactly_once_v2); a crash loses what is in flight, an
/// abort drops the transaction.
#[derive(Default)]
pub(super) struct MemoryLog {
    pub(super) outputs: Vec<OutRecord>,
    pub(super) changelog: BTreeMap<(String, i32), Vec<ChangelogRecord>>,
    pub(super) committed: BTreeMap<i32, i64>,
    /// Outputs sent and not durable, with their commit epoch.
    pub(super) in_flight: Vec<(u64, OutRecord)>,
    /// The epoch outputs are sent under now.
    pub(super) epoch: u64,
    /// Acknowledge nothing unless a commit waits for it ([`TestDriver::pipelined`]).
    pub(super) hold_acks: bool,
    pub(super) in_flight_changelog: Vec<InFlightChangelog>,
    pub(super) txn_offsets: Vec<(i32, i64)>,
    pub(super) armed: Option<String>,
    /// Refuse the next transaction commit with an abortable error.
    pub(super) fail_commit: bool,
    /// Lose the answer of the next transaction commit: `Some(true)` after it committed,
    /// `Some(false)` before it reached the coordinator.
    pub(super) lose_commit_answer: Option<bool>,
    /// Refuse the next re-creation of the producer with this reason (a broker error).
    pub(super) refuse_recreation: Option<String>,
    /// A transaction's commit was started and has not ended.
    pub(super) committing: bool,
    /// [`CommitLog::ack_timeout`] (`None`: never overdue).
    pub(super) ack_timeout: Option<std::time::Duration>,
}

impl MemoryLog {
    /// Make what is in flight durable (an acknowledgement, or a transaction's commit).
    pub(super) fn land(&mut self) {
        self.land_outputs(u64::MAX);
        self.land_changelog();
    }

    /// Make the outputs of epochs up to `epoch` durable, in send order.
    pub(super) fn land_outputs(&mut self, epoch: u64) {
        let (landed, kept): (Vec<_>, Vec<_>) =
            self.in_flight.drain(..).partition(|(e, _)| *e <= epoch);
        self.in_flight = kept;
        self.outputs.extend(landed.into_iter().map(|(_, r)| r));
    }

    /// Make the changelog records in flight durable.
    pub(super) fn land_changelog(&mut self) {
        for (at, key, value) in self.in_flight_changelog.drain(..) {
            let l = self.changelog.entry(at).or_default();
            let offset = l.len() as i64;
            l.push(ChangelogRecord { key, value, offset });
        }
    }

    /// The process died: nothing in flight arrives, an open transaction is gone.
    pub(super) fn lose_in_flight(&mut self) {
        self.committing = false;
        self.in_flight.clear();
        self.in_flight_changelog.clear();
        self.txn_offsets.clear();
    }
}

impl CommitLog for MemoryLog {
    fn send_output(&mut self, rec: &OutRecord) -> Result<()> {
        self.in_flight.push((self.epoch, rec.clone()));
        Ok(())
    }

    fn open_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    fn outputs_acked(&mut self, epoch: u64, wait: bool) -> Result<bool> {
        if self.hold_acks && !wait {
            return Ok(!self.in_flight.iter().any(|(e, _)| *e <= epoch));
        }
        self.land_outputs(epoch);
        Ok(true)
    }

    fn ack_timeout(&self) -> Option<std::time::Duration> {
        self.ack_timeout
    }

    fn changelog_acked(&mut self, wait: bool) -> Result<bool> {
        if self.hold_acks && !wait {
            return Ok(self.in_flight_changelog.is_empty());
        }
        self.land_changelog();
        Ok(true)
    }

    fn send_changelog(&mut self, write: ChangelogWrite<'_>) -> Result<()> {
        self.in_flight_changelog.push((
            (write.store.to_string(), write.partition),
            write.key.to_vec(),
            write.value.map(<[u8]>::to_vec),
        ));
        Ok(())
    }

    fn changelog_end(&self, store: &str, partition: i32) -> Option<i64> {
        self.changelog
            .get(&(store.to_string(), partition))
            .filter(|l| !l.is_empty())
            .map(|l| l.len() as i64)
    }

    fn begin_transaction(&mut self) -> Result<()> {
        Ok(())
    }

    fn send_offsets(&mut self, offsets: &[(i32, i64)]) -> Result<()> {
        self.txn_offsets.extend_from_slice(offsets);
        Ok(())
    }

    fn start_commit_transaction(&mut self) -> Result<()> {
        self.committing = true;
        Ok(())
    }

    /// The commit ends when asked, or (with [`TestDriver::pipelined`]) only when a step
    /// waits for it, so that records are processed while it is in flight.
    fn transaction_committed(&mut self, wait: bool) -> Result<bool> {
        if !self.committing {
            return Ok(true);
        }
        if self.hold_acks && !wait {
            return Ok(false);
        }
        self.committing = false;
        if std::mem::take(&mut self.fail_commit) {
            return Err(crate::Error::Broker(
                "transaction commit refused (injected by the test driver)".into(),
            ));
        }
        let lost = self.lose_commit_answer.take();
        if lost != Some(false) {
            self.land();
            for (p, o) in std::mem::take(&mut self.txn_offsets) {
                self.committed.insert(p, o);
            }
        }
        match lost {
            Some(committed) => Err(crate::Error::TransactionOutcomeUnknown(format!(
                "commit answer lost (injected by the test driver; it {} committed)",
                if committed { "had" } else { "had not" }
            ))),
            None => Ok(true),
        }
    }

    fn recreate_producer(&mut self) -> Result<()> {
        if let Some(reason) = self.refuse_recreation.take() {
            return Err(crate::Error::Broker(reason));
        }
        // The new producer's initialisation aborts a transaction that never committed.
        self.lose_in_flight();
        Ok(())
    }

    fn abort_transaction(&mut self) -> Result<()> {
        self.lose_in_flight();
        Ok(())
    }

    fn commit_offsets(&mut self, offsets: &[(i32, i64)]) -> Result<()> {
        self.committed.extend(offsets.iter().copied());
        Ok(())
    }

    fn committed_offsets(&mut self, partitions: &[i32]) -> Result<BTreeMap<i32, Option<i64>>> {
        Ok(partitions
            .iter()
            .map(|p| (*p, self.committed.get(p).copied()))
            .collect())
    }

    fn failpoint(&mut self, name: &'static str) -> bool {
        if self.armed.as_deref() == Some(name) {
            self.armed = None;
            return true;
        }
        false
    }
}
