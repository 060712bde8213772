//! `Task::flush_effects`: finish the external effects in flight before a commit; and the
//! withdrawal of the dedup marks of dead-lettered records.
//!
//! External sink stages ([`crate::sink`]) run their effects asynchronously. Before the
//! runtime commits source offsets it calls [`Task::flush_effects`]: every stage's
//! [`crate::processor::Processor::flush`] waits for its effects; records whose effect failed
//! become dead letters (appended to `out`, sent before the offsets), and records that go on
//! run through the rest of the stages. So an offset is committed only once its record's
//! effect is done or dead-lettered.
//!
//! Failed effects leave no mark: whenever a record is dead-lettered (here or while it is
//! processed), the writes staged for its source record with
//! [`crate::state::StagedStore::stage_for`] (its dedup marks) are withdrawn before the
//! commit, so no changelog record and no store write stands for it and a later delivery
//! runs the effect. A dedup stage then judges again the twins it dropped against such a
//! mark in this commit; the first passes and runs through the stages after it.

use super::{dead_letter, Task};
use crate::error::{RecordError, Result};
use crate::processor::{Context, OutRecord, Record, StageError};
use std::collections::VecDeque;

/// One step of [`Task::drive`].
pub(super) enum Work {
    /// Run the record through the stages from this index on.
    Run(usize, Record),
    /// Dead-letter the record (as read: [`Record::as_read`] when set), then withdraw its
    /// marks. The index is the refusing stage's in the dead-letter counters (0: source,
    /// node i: i + 1).
    Fail(usize, Record, RecordError),
    /// Withdraw the marks staged for the source record at this offset.
    Withdraw(i64),
}

impl Task {
    /// Wait for the external effects in flight; dead letters and downstream outputs are
    /// appended to `out`. Call before committing offsets (and before flushing the producer).
    /// The marks of records dead-lettered here are withdrawn in the same commit.
    ///
    /// # Errors
    /// A system failure of a stage (a store failure downstream).
    pub(crate) fn flush_effects(&mut self, wall_ms: i64, out: &mut Vec<OutRecord>) -> Result<()> {
        let mut i = 0;
        while i < self.nodes.len() {
            let mut forwarded = Vec::new();
            let failed = {
                let mut ctx = task_context!(self, &mut forwarded, out, wall_ms);
                self.nodes[i].1.flush(&mut ctx)?
            };
            let mut work: VecDeque<Work> = failed
                .into_iter()
                .map(|(rec, err)| Work::Fail(i + 1, rec, err))
                .collect();
            // Records released by stage i go through stages i+1.. now.
            work.extend(forwarded.into_iter().map(|rec| Work::Run(i + 1, rec)));
            // A twin judged again after a withdrawal may have reached a stage up to i (an
            // effect in flight again): flush again from there.
            i = match self.drive(work, wall_ms, out)? {
                Some(j) if j <= i => j,
                _ => i + 1,
            };
        }
        Ok(())
    }

    /// Do `work` and whatever it leads to, depth first; returns the lowest stage index a
    /// record was run at (`None`: none was).
    ///
    /// # Errors
    /// A system failure of a stage.
    pub(super) fn drive(
        &mut self,
        mut work: VecDeque<Work>,
        wall_ms: i64,
        out: &mut Vec<OutRecord>,
    ) -> Result<Option<usize>> {
        let mut lowest: Option<usize> = None;
        while let Some(w) = work.pop_front() {
            match w {
                Work::Run(j, rec) => {
                    if j >= self.nodes.len() {
                        continue;
                    }
                    lowest = Some(lowest.map_or(j, |l| l.min(j)));
                    let keep = rec.clone();
                    let mut next = Vec::new();
                    let r = {
                        let mut ctx = task_context!(self, &mut next, out, wall_ms);
                        self.nodes[j].1.process(rec, &mut ctx)
                    };
                    match r {
                        Ok(()) => {
                            for rec in next.into_iter().rev() {
                                work.push_front(Work::Run(j + 1, rec));
                            }
                        }
                        Err(StageError::Record(e)) => work.push_front(Work::Fail(j + 1, keep, e)),
                        Err(StageError::Fatal(e)) => return Err(e),
                    }
                }
                Work::Fail(stage, rec, err) => {
                    self.count_dead_letter(stage);
                    self.counts.dead_lettered += 1;
                    let offset = rec.source.offset;
                    let o = rec.origin();
                    let src = (o.topic.to_string(), o.partition, o.offset);
                    // The record as read, not as the stages before the failing one left it.
                    let (key, value, headers, timestamp) = match rec.as_read {
                        Some(r) => {
                            let r = std::sync::Arc::unwrap_or_clone(r);
                            (r.key, r.value, r.headers, r.timestamp)
                        }
                        None => (rec.key, rec.value, rec.headers, rec.timestamp),
                    };
                    out.push(dead_letter(
                        &self.dlq_topic,
                        &src,
                        key,
                        value,
                        headers,
                        timestamp,
                        &err,
                    ));
                    work.push_front(Work::Withdraw(offset));
                }
                Work::Withdraw(owner) => {
                    let mut then = Vec::new();
                    let withdrawn: Vec<_> = self
                        .stores
                        .iter_mut()
                        .map(|(name, s)| (name.clone(), s.withdraw(owner)))
                        .filter(|(_, w)| !w.is_empty())
                        .collect();
                    for (store, w) in &withdrawn {
                        for k in 0..self.nodes.len() {
                            let mut revived = Vec::new();
                            let failed = {
                                let mut ctx = task_context!(self, &mut revived, out, wall_ms);
                                self.nodes[k].1.on_withdrawn(store, w, &mut ctx)?
                            };
                            then.extend(failed.into_iter().map(|(r, e)| Work::Fail(k + 1, r, e)));
                            then.extend(revived.into_iter().map(|r| Work::Run(k + 1, r)));
                        }
                    }
                    for w in then.into_iter().rev() {
                        work.push_front(w);
                    }
                }
            }
        }
        Ok(lowest)
    }
}
