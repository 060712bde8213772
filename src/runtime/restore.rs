//! Restore on assignment: planning (when a partition's changelog may be read, and to
//! which end) and the bounded restore steps of the run loop.

use super::{RestoreRecord, RunLoop, RESTORE_BATCH};
use crate::error::{Error, Result};
use crate::kafka::batch::consume_batch;
use crate::kafka::consumer::SourceConsumer;
use crate::runtime::{commit, failpoint};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

impl RunLoop {
    /// Capture the changelog ends of newly assigned partitions and start their restores.
    ///
    /// A partition's previous owner may still have a transaction open: an instance still
    /// committing its revocation, or a zombie (stopped past its session timeout) that may
    /// yet commit it. That transaction holds the source offsets (sent with
    /// `send_offsets_to_transaction`) and changelog records that may not even have reached
    /// the broker yet. Its dedup marks must be restored too, or the records it processed
    /// would pass again when repeated later. So a partition is planned only when
    /// 1. its committed source offset is stable: the committed-offset fetch of a
    ///    read_committed consumer asks for stable offsets (KIP-447 `require_stable`), which
    ///    the group coordinator holds back while a transactional offset commit is pending,
    ///    i.e. until the transaction ended (committed, aborted, or aborted by the
    ///    coordinator after `transaction.timeout.ms`); and
    /// 2. the changelog's last stable offset (the restore consumer is read_committed)
    ///    equals its high watermark (read_uncommitted), so no transaction is open on it:
    ///    the commit markers of 1 may land on the changelog after the offsets.
    ///
    /// The end of the restore is then that offset. Until then the partition stays
    /// unplanned, and paused; planning is retried every 100 ms.
    pub(super) fn plan_restores(&mut self, consumer: &SourceConsumer) -> Result<()> {
        if self
            .last_plan
            .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return Ok(());
        }
        self.last_plan = None;
        let partitions: Vec<i32> = std::mem::take(&mut self.unplanned)
            .into_iter()
            .filter(|p| self.tasks.contains_key(p))
            .collect();
        // Routers (a repartition hop's source partitions) have no state: they go at once.
        let (routers, partitions): (Vec<i32>, Vec<i32>) = partitions
            .into_iter()
            .partition(|p| self.topics.is_router(*p));
        for p in routers {
            self.resume(consumer, p)?;
        }
        if partitions.is_empty() {
            return Ok(());
        }
        // 1. Committed source offsets stable: one request for all partitions; when it
        //    fails (some partition's offsets are held back), one per partition.
        let mut ready = Vec::with_capacity(partitions.len());
        if self.changelogs.is_empty() {
            ready = partitions;
        } else {
            let all = self.tpl_ids(&partitions, None)?;
            if consumer
                .committed_offsets(all, Duration::from_millis(300))
                .is_ok()
            {
                ready = partitions;
            } else {
                for p in partitions {
                    let stable = consumer
                        .committed_offsets(self.tpl_id(p, None)?, Duration::from_millis(300));
                    match stable {
                        Ok(_) => ready.push(p),
                        Err(err) => {
                            if self.open_txn_waits.insert(p) {
                                tracing::info!(
                                    partition = p,
                                    error = %err,
                                    "committed offset not stable (the previous owner's transaction is open): waiting for it to end before restoring"
                                );
                            }
                            self.unplanned.insert(p);
                            self.last_plan = Some(Instant::now());
                        }
                    }
                }
            }
        }
        if ready.is_empty() {
            return Ok(());
        }
        // A partition its changelog lacks (the source topic grew while running): a config
        // fault a restart cannot fix, said at once (its offsets would be retried as a
        // topic still being created, holding the run loop).
        for (store, topic) in &self.changelogs {
            let m = Self::partition_count(&self.restore_consumer, topic)?;
            if let Some(&id) = ready
                .iter()
                .find(|id| usize::try_from(**id).unwrap_or(0) >= m)
            {
                let (src, p) = self.topics.tp(id);
                let n = Self::partition_count(&self.restore_consumer, src)?;
                return Err(Error::Config(format!(
                    "partition {p} of {src} was assigned, but {}",
                    super::topics::changelog_count_advice(store, topic, m, src, n)
                )));
            }
        }
        // 2. Per changelog: log start, last stable offset (the restore consumer is
        //    read_committed) and high watermark (read_uncommitted) of every ready partition,
        //    one ListOffsets request each.
        let mut ends: BTreeMap<i32, Vec<(String, String, i64, i64)>> = BTreeMap::new();
        let mut waiting: BTreeSet<i32> = BTreeSet::new();
        for (store, topic) in &self.changelogs {
            let lows =
                Self::list_offsets(&self.restore_consumer, topic, &ready, Offset::Beginning)?;
            let stables = Self::list_offsets(&self.restore_consumer, topic, &ready, Offset::End)?;
            let highs = Self::list_offsets(&self.watermarks, topic, &ready, Offset::End)?;
            for (i, p) in ready.iter().enumerate() {
                let (low, stable, high) = (lows[i], stables[i], highs[i]);
                if stable < high {
                    if self.open_txn_waits.insert(*p) {
                        tracing::info!(
                            store = store.as_str(),
                            partition = *p,
                            stable,
                            high,
                            "changelog holds an open transaction of the previous owner: waiting for it to end before restoring"
                        );
                    }
                    waiting.insert(*p);
                }
                ends.entry(*p)
                    .or_default()
                    .push((store.clone(), topic.clone(), low, stable));
            }
        }
        let mut assign = TopicPartitionList::new();
        let mut resume = Vec::new();
        for p in ready {
            if waiting.contains(&p) {
                self.unplanned.insert(p);
                self.last_plan = Some(Instant::now());
                continue;
            }
            self.open_txn_waits.remove(&p);
            let task = self.tasks.get_mut(&p).expect("filtered above");
            let _span = task.span().clone().entered();
            for (store, topic, low, end) in ends.remove(&p).unwrap_or_default() {
                if let Some(start) = task.plan_restore(&store, low, end)? {
                    assign
                        .add_partition_offset(&topic, p, Offset::Offset(start))
                        .map_err(Error::kafka("partition list"))?;
                }
            }
            if !task.is_restoring() {
                resume.push(p);
            }
        }
        if assign.count() > 0 {
            self.restore_consumer
                .incremental_assign(&assign)
                .map_err(Error::kafka("assign changelog"))?;
        }
        for p in resume {
            self.resume(consumer, p)?;
        }
        Ok(())
    }

    /// The partition count of `topic` from a metadata request; `usize::MAX` when the
    /// broker does not know it (yet): nothing to judge by.
    fn partition_count(client: &BaseConsumer, topic: &str) -> Result<usize> {
        let n = crate::kafka::admin::partition_count_of(
            client.client(),
            topic,
            Duration::from_secs(10),
        )?;
        Ok(n.unwrap_or(usize::MAX))
    }

    /// The offsets of `partitions` of `topic` at `at` (`Offset::Beginning`: log start;
    /// `Offset::End`: the end as `client`'s isolation.level sees it, the last stable offset
    /// when read_committed, the high watermark when read_uncommitted), in one ListOffsets
    /// request; a partition the answer leaves out is asked on its own.
    fn list_offsets(
        client: &BaseConsumer,
        topic: &str,
        partitions: &[i32],
        at: Offset,
    ) -> Result<Vec<i64>> {
        let timeout = Duration::from_secs(30);
        let answer = client
            .offsets_for_times(Self::tpl_of(topic, partitions, Some(at))?, timeout)
            .ok();
        partitions
            .iter()
            .map(|p| {
                let found = answer
                    .as_ref()
                    .and_then(|a| a.find_partition(topic, *p))
                    .filter(|e| e.error().is_ok())
                    .and_then(|e| match e.offset() {
                        Offset::Offset(o) if o >= 0 => Some(o),
                        _ => None,
                    });
                match found {
                    Some(o) => Ok(o),
                    None => {
                        let (low, high) =
                            crate::kafka::retry::retry_known_topic("changelog offsets", || {
                                client
                                    .fetch_watermarks(topic, *p, timeout)
                                    .map_err(Error::kafka("changelog offsets"))
                            })?;
                        Ok(if at == Offset::Beginning { low } else { high })
                    }
                }
            })
            .collect()
    }

    fn resume(&mut self, consumer: &SourceConsumer, p: i32) -> Result<()> {
        let tpl = self.tpl_id(p, None)?;
        if let Some(off) = self.replay_from.remove(&p) {
            // The records from `off` are read again first.
            consumer
                .seek_partitions(self.tpl_id(p, Some(off))?, Duration::from_secs(10))
                .map_err(Error::kafka("seek"))?;
        }
        consumer.resume(&tpl).map_err(Error::kafka("resume"))
    }

    pub(super) fn any_restoring(&self) -> bool {
        !self.unplanned.is_empty() || self.tasks.values().any(|t| t.is_restoring())
    }

    /// One bounded step of every restore in progress: read up to [`RESTORE_BATCH`]
    /// changelog records in batches (what is queued; when nothing is, wait up to `timeout`
    /// for one), apply each partition's share in log order, then record the positions
    /// reached. The batches are returned to librdkafka in the background.
    pub(super) fn restore_step(
        &mut self,
        consumer: &SourceConsumer,
        timeout: Duration,
    ) -> Result<()> {
        if !self.tasks.values().any(|t| t.is_restoring()) {
            return Ok(());
        }
        let mut batches = Vec::new();
        let mut n = 0;
        let mut waited = false;
        while n < RESTORE_BATCH {
            let mut b = consume_batch(&self.restore_consumer, Duration::ZERO, RESTORE_BATCH - n)
                .map_err(Error::kafka("restore read"))?;
            if b.is_empty() && n == 0 && !waited {
                waited = true;
                b = consume_batch(&self.restore_consumer, timeout, 1)
                    .map_err(Error::kafka("restore read"))?;
            }
            if b.is_empty() {
                break;
            }
            n += b.len();
            batches.push(b);
        }
        // The positions after what was read: each restore's step ends there.
        let positions = self
            .restore_consumer
            .position()
            .map_err(Error::kafka("restore position"))?;
        // The records of each (partition, store), in log order, borrowed from the batches.
        let single = match self.changelogs.len() {
            1 => self.changelogs.keys().next().map(String::as_str),
            _ => None,
        };
        let mut records: BTreeMap<i32, Vec<(&str, Vec<RestoreRecord<'_>>)>> = BTreeMap::new();
        for b in &batches {
            for r in b.records() {
                let m = match r {
                    Ok(m) => m,
                    Err(rdkafka::error::KafkaError::PartitionEOF(_)) => continue,
                    Err(e) => {
                        // Consumer errors are reports (a leader moved, a fetch failed);
                        // librdkafka retries by itself. The restore waits for its position
                        // either way.
                        tracing::warn!(error = %e, "restore consumer error");
                        continue;
                    }
                };
                // One store (the usual case): every changelog record is its own, no topic
                // name to read and compare per record.
                let store = match single {
                    Some(s) => Some(s),
                    None => m.topic().and_then(|topic| {
                        self.changelogs
                            .iter()
                            .find(|(_, t)| t.as_str() == topic)
                            .map(|(s, _)| s.as_str())
                    }),
                };
                let Some(store) = store else { continue };
                let per = records.entry(m.partition()).or_default();
                let rec = (m.key().unwrap_or_default(), m.payload(), m.offset());
                match per.iter_mut().find(|(s, _)| *s == store) {
                    Some((_, v)) => v.push(rec),
                    None => per.push((store, vec![rec])),
                }
            }
        }
        // Apply each restoring task's records, then end its steps at the positions read.
        let log_now = self.last_restore_log.elapsed() >= Duration::from_secs(2);
        let mut finished = Vec::new();
        for (p, task) in self.tasks.iter_mut().filter(|(_, t)| t.is_restoring()) {
            let _span = task.span().clone().entered();
            let recs = records.remove(p).unwrap_or_default();
            for (store, rs) in &recs {
                self.restored += task.restore_records(store, rs);
            }
            let stores: Vec<String> = task
                .restorers()
                .iter()
                .map(|r| r.store().to_string())
                .collect();
            for store in stores {
                let topic = &self.changelogs[&store];
                let Some(Offset::Offset(end)) =
                    positions.find_partition(topic, *p).map(|e| e.offset())
                else {
                    continue;
                };
                let done = task.finish_restore_step(&store, end)?;
                if recs.iter().any(|(s, v)| *s == store && !v.is_empty()) {
                    failpoint::hit(commit::RESTORE_DURING);
                }
                if done {
                    self.restore_consumer
                        .incremental_unassign(&Self::tpl_one(topic, *p, None)?)
                        .map_err(Error::kafka("unassign changelog"))?;
                } else if log_now {
                    for r in task.restorers().iter().filter(|r| r.store() == store) {
                        r.log_progress();
                    }
                }
            }
            if !task.is_restoring() {
                finished.push(*p);
            }
        }
        drop(records);
        self.batch_freer.free(batches);
        if log_now {
            self.last_restore_log = Instant::now();
        }
        // Restored partitions were paused at assignment: let them go.
        for p in finished {
            self.resume(consumer, p)?;
        }
        Ok(())
    }

    /// Publish the partitions to the status when something changed: at assignment and
    /// revocation, after each restore step, and once when the restores ended.
    pub(super) fn publish_status(&mut self) {
        let restoring = self.any_restoring();
        let Some(status) = &self.status else { return };
        if !(self.status_dirty || restoring || self.status_restoring) {
            return;
        }
        // Router tasks (internal ids) are named by their source topic and partition.
        let topics = &self.topics;
        let split = |ids: &mut dyn Iterator<Item = i32>| {
            let (routers, stateful): (Vec<i32>, Vec<i32>) = ids.partition(|p| topics.is_router(*p));
            let named = routers
                .into_iter()
                .map(|p| {
                    let (t, q) = topics.tp(p);
                    (t.to_string(), q)
                })
                .collect::<Vec<_>>();
            (stateful, named)
        };
        let (assigned, routing) = split(&mut self.tasks.keys().copied());
        let (waiting, routing_waiting) = split(&mut self.unplanned.iter().copied());
        let mut snapshot = crate::runtime::status::Partitions {
            assigned_once: self.assigned_once,
            assigned,
            routing,
            waiting,
            routing_waiting,
            restoring: Vec::new(),
        };
        for (p, t) in &self.tasks {
            for r in t.restorers() {
                snapshot.restoring.push(crate::runtime::status::Restoring {
                    store: r.store().to_string(),
                    partition: *p,
                    progress: r.progress(),
                });
            }
        }
        status.publish(snapshot);
        self.status_dirty = false;
        self.status_restoring = restoring;
    }
}
