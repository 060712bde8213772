//! Rebalance handling: the run loop carries out the assignments and revocations the
//! consumer context announced over the channel (see `kafka::consumer`).
//!
//! - **Assigned**: assign, pause at once (nothing is processed before the restore), create
//!   the tasks; the restore is planned by the loop (`restore.rs`).
//! - **Revoked**: commit the work of every partition (the producer flush covers them all;
//!   under exactly_once_v2 the open transaction holds them all), close the revoked tasks,
//!   unassign them. Under the cooperative protocol (the default, `kafka::consumer`) an
//!   event names only the partitions that move: the others keep their tasks, stores and
//!   position and go on processing right after this commit. Under exactly_once_v2, partitions *lost* (the group
//!   moved on without this instance, e.g. after a long stop) are not committed: other
//!   instances may own them already, so the open transaction is aborted and the staged
//!   state dropped.

use super::{KafkaLog, RunLoop};
use crate::config::Guarantee;
use crate::error::Result;
use crate::kafka::consumer::{apply_assign, apply_revoke, RebalanceEvent, SourceConsumer};
use crate::runtime::commit::Outcome;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::TopicPartitionList;
use std::sync::mpsc;

impl RunLoop {
    /// Carry out every rebalance announced so far.
    ///
    /// # Errors
    /// A failed commit on revocation, or a client or store error; the assignment change
    /// itself is carried out either way.
    pub(super) fn handle_events(
        &mut self,
        consumer: &SourceConsumer,
        events: &mpsc::Receiver<RebalanceEvent>,
    ) -> Result<()> {
        while let Ok(ev) = events.try_recv() {
            // Task ids: partitions, or routers' ids with a repartition hop (`hop.rs`).
            let parts = self.ids_of(&ev);
            match ev {
                RebalanceEvent::Assigned(tpl) => {
                    // Their records go to the source queue, read in batches (forwarded
                    // before the assignment, so no record goes to the consumer's queue).
                    if let Some(q) = &self.source_queue {
                        q.forward(&tpl);
                    }
                    apply_assign(consumer, &tpl)?;
                    self.on_assign(consumer, &parts)?;
                }
                RebalanceEvent::Revoked { partitions, lost } => {
                    let done = self.on_revoke(consumer, &parts, lost);
                    let unassigned = apply_revoke(consumer, &partitions);
                    done.and(unassigned)?;
                }
            }
        }
        Ok(())
    }

    fn on_revoke(
        &mut self,
        consumer: &SourceConsumer,
        partitions: &[i32],
        lost: bool,
    ) -> Result<()> {
        if self.protocol.guarantee() == Guarantee::ExactlyOnceV2 && lost {
            // Committing now would put this instance's outputs next to the new owners'.
            tracing::warn!(
                partitions = %self.topics.show(partitions),
                "partitions lost (this instance left the group): aborting the open transaction"
            );
            let kept: Vec<i32> = (self.tasks.keys())
                .filter(|p| !partitions.contains(p))
                .copied()
                .collect();
            let mut log = kafka_log!(self, consumer, CommitMode::Sync);
            if kept.is_empty() {
                self.protocol.abort_lost(&mut log, &mut self.tasks)?;
            } else {
                // librdkafka loses the whole assignment at once; should it ever lose a
                // part, the partitions kept rewind to their committed offsets (or, after a
                // transaction of unknown outcome, are opened again), once the lost ones
                // are closed.
                let outcome = match self.protocol.abort(&mut log, &mut self.tasks)? {
                    Outcome::Aborted(seek) => Outcome::Aborted(
                        seek.into_iter().filter(|(p, _)| kept.contains(p)).collect(),
                    ),
                    other => other,
                };
                self.status_dirty = true;
                self.close_tasks(partitions);
                return self.carry_out(consumer, outcome, CommitMode::Sync);
            }
        } else {
            tracing::info!(
                partitions = %self.topics.show(partitions),
                "partitions revoked: committing their work"
            );
            self.commit(consumer, CommitMode::Sync)?;
        }
        self.status_dirty = true;
        self.close_tasks(partitions);
        Ok(())
    }

    /// Close the tasks of `partitions` (their staged writes are gone or committed), and
    /// forget their restore and end-of-input state.
    fn close_tasks(&mut self, partitions: &[i32]) {
        for p in partitions {
            if let Some(t) = self.tasks.remove(p) {
                let _span = t.span().clone().entered();
                tracing::info!("task closed");
                let c = *t.counts();
                self.closed_counts.add(&c);
                for r in t.restorers() {
                    let topic = self.changelogs[r.store()].clone();
                    if let Ok(tpl) = RunLoop::tpl_one(&topic, *p, None) {
                        let _ = self.restore_consumer.incremental_unassign(&tpl);
                    }
                }
            }
            self.unplanned.remove(p);
            self.open_txn_waits.remove(p);
            self.replay_from.remove(p);
        }
    }

    /// After a transaction of unknown outcome (the producer re-created, staged writes
    /// dropped): open every partition again as on an assignment. Its task restores its
    /// stores from the changelog (which holds the transaction's marks if it committed),
    /// and its records are read again from the committed offset, fetched stable now that
    /// the re-created producer's initialisation has settled the transaction.
    ///
    /// # Errors
    /// A broker error fetching the committed offsets or seeking, or a store error.
    pub(super) fn reopen_all(&mut self, consumer: &SourceConsumer) -> Result<()> {
        let parts: Vec<i32> = self.tasks.keys().copied().collect();
        self.close_tasks(&parts);
        self.seeked.extend(parts.iter().copied());
        let tpl = self.tpl_ids(&parts, None)?;
        let committed = crate::kafka::retry::retry("committed offsets", || {
            consumer
                .committed_offsets(tpl.clone(), std::time::Duration::from_secs(30))
                .map_err(crate::Error::kafka("committed offsets"))
        })?;
        let mut seek = TopicPartitionList::new();
        for p in &parts {
            let (topic, partition) = self.topics.tp(*p);
            let at = match committed
                .find_partition(topic, partition)
                .map(|e| e.offset())
            {
                Some(rdkafka::Offset::Offset(o)) => {
                    // Where a record fetched before the seek would otherwise resume it.
                    self.replay_from.insert(*p, o);
                    rdkafka::Offset::Offset(o)
                }
                _ => rdkafka::Offset::Beginning,
            };
            seek.add_partition_offset(topic, partition, at)
                .map_err(crate::Error::kafka("build offsets"))?;
        }
        self.on_assign(consumer, &parts)?;
        for p in &parts {
            if let Some(o) = self.replay_from.get(p) {
                tracing::info!(
                    partition = *p,
                    offset = *o,
                    "reading again from the committed offset"
                );
            }
        }
        if seek.count() > 0 {
            consumer
                .seek_partitions(seek, std::time::Duration::from_secs(30))
                .map_err(crate::Error::kafka("seek"))?;
        }
        Ok(())
    }

    fn on_assign(&mut self, consumer: &SourceConsumer, partitions: &[i32]) -> Result<()> {
        tracing::info!(
            partitions = %self.topics.show(partitions),
            "partitions assigned"
        );
        self.assigned_once = true;
        self.status_dirty = true;
        self.group_meta = consumer.group_metadata().map(std::sync::Arc::new);
        let tpl = self.tpl_ids(partitions, None)?;
        // Nothing is processed before the restore: pause first, plan in the run loop.
        consumer.pause(&tpl).map_err(crate::Error::kafka("pause"))?;
        for p in partitions {
            if self.tasks.contains_key(p) {
                continue;
            }
            let t = self.new_task(*p)?;
            self.tasks.insert(*p, t);
            self.unplanned.insert(*p);
        }
        Ok(())
    }
}

/// Carry out, without the run loop, the rebalances announced and not handled (the loop
/// ended on an error): librdkafka waits for them, and closing the consumer would too.
pub(super) fn settle(consumer: &SourceConsumer, events: &mpsc::Receiver<RebalanceEvent>) {
    while let Ok(ev) = events.try_recv() {
        let done = match &ev {
            RebalanceEvent::Assigned(tpl) => apply_assign(consumer, tpl),
            RebalanceEvent::Revoked { partitions, .. } => apply_revoke(consumer, partitions),
        };
        if let Err(e) = done {
            tracing::warn!(error = %e, "rebalance at stop");
        }
    }
}
