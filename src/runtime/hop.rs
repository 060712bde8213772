//! The repartition hop in the Kafka runtime: which topic a task reads, and the purge of
//! consumed repartition records.
//!
//! With a dedup stage that repartitions (`partitioning: repartition`; the first stage, or
//! one after filter and map stages only, see `Topology::hop`), one consumer reads
//! two topics in one group:
//! - the **source** topic's partitions are *router* tasks ([`crate::runtime::Task::router`]):
//!   each record goes through the stages before the dedup (filter, map; a record they drop
//!   is not routed, one they refuse is dead-lettered from here, as read), and what they
//!   pass is written to the repartition topic `<application.id>-<stage>-repartition`,
//!   keyed by its dedup key, through the same commit protocol as any output (under
//!   exactly_once_v2 in the transaction that also commits the source offsets; under
//!   at_least_once the source offsets are committed only once the repartition records are
//!   acknowledged);
//! - the **repartition** topic's partitions run the rest of the topology (the dedup and
//!   every stage after it), with their stores and changelogs per repartition partition, restored
//!   and revoked as source partitions are without a hop. The consumer is read_committed,
//!   so under exactly_once_v2 it never sees the records of an aborted router transaction.
//!
//! A task is named by one `i32` id throughout the runtime and the commit protocol: a
//! stateful task by its partition number (of the repartition topic with a hop, of the
//! source without), a router by [`ROUTER_BASE`] + its source partition. [`Topics`] maps
//! between ids and (topic, partition).
//!
//! Consumed repartition records are purged ([`Purger`]): after a commit, at most every
//! [`PURGE_INTERVAL`], DeleteRecords moves each repartition partition's log start up to the
//! offset its task committed, as Kafka Streams does. The topic has no time or size
//! retention, so nothing is deleted before it is processed.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kafka::admin::Admin;
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::Duration;

/// The id of the router task of source partition `p` is `ROUTER_BASE + p` (with a hop).
pub(crate) const ROUTER_BASE: i32 = 1 << 20;

/// How often, at most, consumed repartition records are purged (plus once at a graceful
/// stop or revocation, after its synchronous commit).
pub(crate) const PURGE_INTERVAL: Duration = Duration::from_secs(5);

/// The topics of an instance's tasks, and the mapping between task ids and (topic,
/// partition).
#[derive(Debug, Clone)]
pub(crate) struct Topics {
    source: String,
    repartition: Option<String>,
}

impl Topics {
    /// The topics of a run: `source`, and the repartition topic when the topology has a hop.
    pub(crate) fn new(source: &str, repartition: Option<String>) -> Topics {
        Topics {
            source: source.to_string(),
            repartition,
        }
    }

    /// The source topic.
    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    /// The topics the consumer subscribes to.
    pub(crate) fn subscription(&self) -> Vec<&str> {
        std::iter::once(self.source.as_str())
            .chain(self.repartition.as_deref())
            .collect()
    }

    /// Whether task `id` is a router (a source partition of a hop).
    pub(crate) fn is_router(&self, id: i32) -> bool {
        self.repartition.is_some() && id >= ROUTER_BASE
    }

    /// The (topic, partition) task `id` reads.
    pub(crate) fn tp(&self, id: i32) -> (&str, i32) {
        match &self.repartition {
            Some(_) if id >= ROUTER_BASE => (&self.source, id - ROUTER_BASE),
            Some(r) => (r, id),
            None => (&self.source, id),
        }
    }

    /// Task ids as a log shows them: `[0, 1]` without a hop (the source partitions);
    /// with one, each as `topic/partition`, since ids of router tasks are not partitions.
    pub(crate) fn show(&self, ids: &[i32]) -> String {
        if self.repartition.is_none() {
            return format!("{ids:?}");
        }
        let names: Vec<String> = ids
            .iter()
            .map(|id| {
                let (t, p) = self.tp(*id);
                format!("{t}/{p}")
            })
            .collect();
        format!("[{}]", names.join(", "))
    }

    /// The task id of `partition` of `topic` (one of [`Topics::subscription`]).
    pub(crate) fn id(&self, topic: &str, partition: i32) -> i32 {
        match &self.repartition {
            Some(r) if topic != r => ROUTER_BASE + partition,
            _ => partition,
        }
    }
}

/// Purges consumed repartition records in the background: DeleteRecords up to the given
/// offsets. Errors are logged, never fatal (the next purge asks again).
pub(crate) struct Purger {
    tx: Option<mpsc::Sender<Vec<(i32, i64)>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Purger {
    /// Start the purger of `topic`.
    ///
    /// # Errors
    /// The admin client cannot be created (a bad `kafka.*` property).
    pub(crate) fn spawn(config: &Config, topic: &str) -> Result<Purger> {
        let admin = Admin::new(config)?;
        let (tx, rx) = mpsc::channel::<Vec<(i32, i64)>>();
        let topic = topic.to_string();
        let thread = std::thread::Builder::new()
            .name("onceflow-purge".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    // Only the latest offset of each partition matters.
                    let mut upto: BTreeMap<i32, i64> = first.into_iter().collect();
                    while let Ok(more) = rx.try_recv() {
                        upto.extend(more);
                    }
                    let offsets: Vec<(i32, i64)> = upto.into_iter().collect();
                    match admin.delete_records(&topic, &offsets) {
                        Ok(()) => {
                            tracing::debug!(topic = %topic, ?offsets, "repartition records purged")
                        }
                        Err(e) => {
                            tracing::warn!(topic = %topic, error = %e, "purging repartition records failed (retried at the next purge)")
                        }
                    }
                }
            })
            .map_err(|e| Error::Config(format!("cannot start the purge thread: {e}")))?;
        Ok(Purger {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Ask for the records before `offsets` (`(partition, offset)`, committed) to be
    /// deleted; returns at once.
    pub(crate) fn purge(&self, offsets: Vec<(i32, i64)>) {
        if offsets.is_empty() {
            return;
        }
        if let Some(tx) = &self.tx {
            let _ = tx.send(offsets);
        }
    }

    /// Finish the purges asked for, then stop.
    pub(crate) fn finish(mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Purger {
    fn drop(&mut self) {
        // Dropped without `finish` (an error stop): the thread ends after its purges.
        self.tx = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_ids_map_both_ways() {
        let plain = Topics::new("in", None);
        assert_eq!(plain.tp(3), ("in", 3));
        assert_eq!(plain.id("in", 3), 3);
        assert!(!plain.is_router(ROUTER_BASE + 3));
        assert_eq!(plain.subscription(), vec!["in"]);

        let hop = Topics::new("in", Some("app-d-repartition".into()));
        assert_eq!(hop.subscription(), vec!["in", "app-d-repartition"]);
        for p in [0, 1, 7] {
            let r = hop.id("in", p);
            assert!(hop.is_router(r));
            assert_eq!(hop.tp(r), ("in", p));
            let s = hop.id("app-d-repartition", p);
            assert!(!hop.is_router(s));
            assert_eq!(s, p, "a stateful task keeps its partition number");
            assert_eq!(hop.tp(s), ("app-d-repartition", p));
        }
        // Logs name topics and partitions, not task ids.
        assert_eq!(plain.show(&[0, 3]), "[0, 3]");
        assert_eq!(
            hop.show(&[1, hop.id("in", 2)]),
            "[app-d-repartition/1, in/2]"
        );
    }
}
