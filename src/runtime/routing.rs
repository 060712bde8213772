//! The run loop's side of the repartition hop (see `runtime::hop`): task ids of a rebalance,
//! creating router or stateful tasks, the end of input with two topics, the purge.

use super::RunLoop;
use crate::error::{Error, Result};
use crate::kafka::consumer::{RebalanceEvent, SourceConsumer};
use crate::runtime::hop::{Purger, PURGE_INTERVAL};
use crate::runtime::Task;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The state of a run with a repartition hop.
pub(super) struct Hop {
    /// Routes the source records (each router task holds a copy).
    pub(crate) router: crate::processor::repartition::Router,
    /// The repartition topic, shared by every record read from it.
    pub(crate) name: Arc<str>,
    pub(crate) purger: Purger,
    pub(crate) last_purge: Instant,
    /// at_least_once: the offsets of the last purge tick, purged at the next one (their
    /// asynchronous offset commit is done by then).
    pub(crate) pending: Vec<(i32, i64)>,
}

impl RunLoop {
    /// The task ids of a rebalance event's partitions.
    pub(super) fn ids_of(&self, ev: &RebalanceEvent) -> Vec<i32> {
        let tpl = match ev {
            RebalanceEvent::Assigned(t) => t,
            RebalanceEvent::Revoked { partitions, .. } => partitions,
        };
        tpl.elements()
            .iter()
            .map(|e| self.topics.id(e.topic(), e.partition()))
            .collect()
    }

    /// The partition list of task `ids`, each at `at` (none: no offset).
    pub(super) fn tpl_ids(&self, ids: &[i32], at: Option<Offset>) -> Result<TopicPartitionList> {
        let mut tpl = TopicPartitionList::new();
        for id in ids {
            let (topic, p) = self.topics.tp(*id);
            match at {
                Some(o) => {
                    tpl.add_partition_offset(topic, p, o)
                        .map_err(Error::kafka("partition list"))?;
                }
                None => {
                    tpl.add_partition(topic, p);
                }
            }
        }
        Ok(tpl)
    }

    /// The partition list of task `id`, at `offset` if given.
    pub(super) fn tpl_id(&self, id: i32, offset: Option<i64>) -> Result<TopicPartitionList> {
        self.tpl_ids(&[id], offset.map(Offset::Offset))
    }

    /// The task of `id`: a router for a source partition of a hop (the stages before the
    /// hop), else the topology's stages (from the hop on) and stores.
    pub(super) fn new_task(&self, id: i32) -> Result<Task> {
        if let (Some(hop), true) = (&self.hop, self.topics.is_router(id)) {
            let (_, p) = self.topics.tp(id);
            return Ok(Task::router(
                &self.topology,
                p,
                hop.router.clone(),
                &self.config.dlq_topic,
            )
            .with_max_record_bytes(self.config.max_record_bytes())
            .with_topic_limits(self.topic_limits.clone()));
        }
        Ok(
            Task::new(&self.topology, id, &self.backend, &self.config.dlq_topic)?
                .with_tables(self.tables.clone())
                .with_max_record_bytes(self.config.max_record_bytes())
                .with_topic_limits(self.topic_limits.clone()),
        )
    }

    /// The topic name records of task `id` carry.
    pub(super) fn record_topic(&self, id: i32) -> &Arc<str> {
        match &self.hop {
            Some(hop) if !self.topics.is_router(id) => &hop.name,
            _ => &self.source_name,
        }
    }

    /// Whether every assigned partition has been read to its end (`--stop-at-end`): each
    /// partition's consumer position (past transaction markers; the committed offset when
    /// nothing was read since the assignment) is compared with its end, read now (a
    /// repartition topic grows while the routers run). The end of a source partition is
    /// its last stable offset (read_committed), so a transaction an upstream producer left
    /// open is not waited for; that of a repartition partition is its high watermark, so
    /// routed records in another instance's open transaction are. The source consumer has
    /// no partition-end events (see `kafka::consumer::create`). A partition whose position
    /// is below the end read at an earlier call is not at its end, without asking the
    /// broker (both ends only grow): while the input is behind, a check costs no request.
    pub(super) fn input_at_end(&mut self, consumer: &SourceConsumer) -> bool {
        if self.tasks.is_empty() || self.any_restoring() {
            return false;
        }
        let Ok(positions) = consumer.position() else {
            return false;
        };
        let timeout = Duration::from_secs(5);
        let mut unread = Vec::new();
        for (id, t) in &self.tasks {
            let (topic, p) = self.topics.tp(*id);
            let pos = match positions.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => t.position(),
            };
            if let (Some(o), Some(&known)) = (pos, self.stop_ends.get(id)) {
                if o < known {
                    return false;
                }
            }
            let Ok((low, high)) = self.end_marks(*id, timeout) else {
                return false;
            };
            self.stop_ends.insert(*id, high);
            match pos {
                Some(o) if o < high => return false,
                Some(_) => {}
                None if high > low => unread.push((*id, high)),
                None => {}
            }
        }
        if unread.is_empty() {
            return true;
        }
        let ids: Vec<i32> = unread.iter().map(|(id, _)| *id).collect();
        let Ok(tpl) = self.tpl_ids(&ids, None) else {
            return false;
        };
        let Ok(committed) = consumer.committed_offsets(tpl, timeout) else {
            return false;
        };
        unread.iter().all(|(id, high)| {
            let (topic, p) = self.topics.tp(*id);
            matches!(committed.find_partition(topic, p).map(|e| e.offset()),
                Some(Offset::Offset(o)) if o >= *high)
        })
    }

    /// The low offset and the end of task `id`'s partition for [`RunLoop::input_at_end`]:
    /// asked through the restore consumer (read_committed: the end is the last stable
    /// offset) for a partition of the source topic, through the read_uncommitted client
    /// (the high watermark) for one of the repartition topic. Not through the source
    /// consumer: the broker answers a connection's requests in order, so the query would
    /// wait behind its fetch (up to `fetch.wait.max.ms`, 500 ms); the restore consumer
    /// fetches nothing once no partition is restoring.
    fn end_marks(&self, id: i32, timeout: Duration) -> rdkafka::error::KafkaResult<(i64, i64)> {
        let (topic, p) = self.topics.tp(id);
        if self.hop.is_none() || self.topics.is_router(id) {
            self.restore_consumer.fetch_watermarks(topic, p, timeout)
        } else {
            self.watermarks.fetch_watermarks(topic, p, timeout)
        }
    }

    /// After a commit (`committed`: it committed something) in `mode`: purge the consumed
    /// repartition records, at most every [`PURGE_INTERVAL`] (at once after a synchronous
    /// commit: a graceful stop or a revocation). Under exactly_once_v2 a committed offset
    /// is final once the transaction committed; under at_least_once the offsets of the
    /// previous tick are purged (their asynchronous commit is done), or the current ones
    /// after a synchronous commit.
    pub(super) fn purge(&mut self, mode: CommitMode, committed: bool) {
        let eos = self.protocol.guarantee() == crate::config::Guarantee::ExactlyOnceV2;
        let Some(hop) = &mut self.hop else { return };
        let sync = matches!(mode, CommitMode::Sync);
        if !(sync || committed && hop.last_purge.elapsed() >= PURGE_INTERVAL) {
            return;
        }
        hop.last_purge = Instant::now();
        // Only what a completed commit covers: with pipelined at_least_once commits a
        // task's position runs ahead of its committed offset.
        let now: Vec<(i32, i64)> = self
            .protocol
            .last_committed_offsets()
            .iter()
            .filter(|(id, _)| !self.topics.is_router(*id) && self.tasks.contains_key(id))
            .copied()
            .collect();
        let offsets = if eos || sync {
            hop.pending.clear();
            now
        } else {
            std::mem::replace(&mut hop.pending, now)
        };
        hop.purger.purge(offsets);
    }
}
