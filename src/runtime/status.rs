//! What the run loop publishes for `/health` and `/ready` (see [`crate::http`]).
//!
//! The run loop owns its state; it hands a copy of what an operator needs to a
//! [`Status`]: an atomic heartbeat per loop turn, and a snapshot of the partitions
//! (assigned, waiting to restore, restoring with progress) behind a lock taken at
//! assignment, at each restore step and when a restore ends, never per record.

use crate::state::restore::Progress;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Default of how long the run loop may go without a turn before `/health` reports it
/// stuck: 60 s (longer than any bounded wait inside one turn: a commit, a flush, a
/// metadata request).
pub(crate) const DEFAULT_STUCK_AFTER: Duration = Duration::from_secs(60);

/// The phase of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Phase {
    /// Connecting, preparing topics, joining the group.
    Starting = 0,
    /// The run loop turns.
    Running = 1,
    /// Stopped gracefully.
    Stopped = 2,
    /// Stopped by a fatal error.
    Failed = 3,
}

/// One store partition being restored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Restoring {
    /// The store (dedup stage) name.
    pub(crate) store: String,
    /// The partition.
    pub(crate) partition: i32,
    /// Records done / total, rate, ETA.
    pub(crate) progress: Progress,
}

/// The partitions as the run loop last published them.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Partitions {
    /// Whether the group has given this instance an assignment yet (maybe empty).
    pub(crate) assigned_once: bool,
    /// Assigned partitions that run the topology: of the source topic, or of the
    /// repartition topic with a repartition hop.
    pub(crate) assigned: Vec<i32>,
    /// With a repartition hop: the assigned source partitions whose records are routed to
    /// the repartition topic, as (source topic, partition).
    pub(crate) routing: Vec<(String, i32)>,
    /// Assigned partitions (as in `assigned`) whose restore has not started (waiting for a
    /// previous owner's open transaction to end, or not planned yet).
    pub(crate) waiting: Vec<i32>,
    /// Routed source partitions (as in `routing`) not resumed yet (until the next plan).
    pub(crate) routing_waiting: Vec<(String, i32)>,
    /// Store partitions being restored.
    pub(crate) restoring: Vec<Restoring>,
}

impl Partitions {
    /// Ready: an assignment was received and every assigned partition is restored and
    /// processing.
    pub(crate) fn ready(&self) -> bool {
        self.assigned_once
            && self.waiting.is_empty()
            && self.routing_waiting.is_empty()
            && self.restoring.is_empty()
    }
}

/// Shared between the run loop (writer) and the HTTP listener (reader).
#[derive(Debug)]
pub(crate) struct Status {
    started: Instant,
    stuck_after: Duration,
    /// Milliseconds since `started` of the last loop turn.
    last_turn_ms: AtomicU64,
    phase: AtomicU8,
    failure: Mutex<Option<String>>,
    partitions: Mutex<Partitions>,
}

impl Default for Status {
    fn default() -> Self {
        Status::new(DEFAULT_STUCK_AFTER)
    }
}

/// What `/health` answers.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Health {
    /// 200 when true, 503 otherwise.
    pub(crate) healthy: bool,
    /// The phase.
    pub(crate) phase: Phase,
    /// Milliseconds since the run loop's last turn (`None` before the first).
    pub(crate) since_last_turn_ms: Option<u64>,
    /// The fatal error, if the run failed.
    pub(crate) failure: Option<String>,
}

impl Status {
    /// A status in phase [`Phase::Starting`]; the loop counts as stuck once it has not
    /// turned for `stuck_after`.
    pub(crate) fn new(stuck_after: Duration) -> Status {
        Status {
            started: Instant::now(),
            stuck_after,
            last_turn_ms: AtomicU64::new(u64::MAX),
            phase: AtomicU8::new(Phase::Starting as u8),
            failure: Mutex::new(None),
            partitions: Mutex::new(Partitions::default()),
        }
    }

    /// The run loop turned (one relaxed atomic store).
    pub(crate) fn beat(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.last_turn_ms.store(ms, Ordering::Relaxed);
        if self.phase() == Phase::Starting {
            self.phase.store(Phase::Running as u8, Ordering::Relaxed);
        }
    }

    /// The run ended: gracefully (`None`) or with a fatal error.
    pub(crate) fn finish(&self, failure: Option<String>) {
        let phase = if failure.is_some() {
            Phase::Failed
        } else {
            Phase::Stopped
        };
        if let Ok(mut f) = self.failure.lock() {
            *f = failure;
        }
        self.phase.store(phase as u8, Ordering::Relaxed);
    }

    /// Replace the partitions snapshot.
    pub(crate) fn publish(&self, partitions: Partitions) {
        if let Ok(mut p) = self.partitions.lock() {
            *p = partitions;
        }
    }

    /// The current phase.
    pub(crate) fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Relaxed) {
            0 => Phase::Starting,
            1 => Phase::Running,
            2 => Phase::Stopped,
            _ => Phase::Failed,
        }
    }

    /// The last published partitions.
    pub(crate) fn partitions(&self) -> Partitions {
        self.partitions
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default()
    }

    /// Healthy while starting or while the run loop turns; not when it has not turned for
    /// the stuck limit, nor once the run stopped or failed.
    pub(crate) fn health(&self) -> Health {
        let phase = self.phase();
        let last = self.last_turn_ms.load(Ordering::Relaxed);
        let since = (last != u64::MAX)
            .then(|| (self.started.elapsed().as_millis() as u64).saturating_sub(last));
        let turning = since.is_none_or(|ms| ms <= self.stuck_after.as_millis() as u64);
        Health {
            healthy: matches!(phase, Phase::Starting | Phase::Running) && turning,
            phase,
            since_last_turn_ms: since,
            failure: self.failure.lock().ok().and_then(|f| f.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_follows_the_loop_and_the_end_of_the_run() {
        let s = Status::new(Duration::from_millis(50));
        assert!(s.health().healthy, "starting is healthy");
        s.beat();
        assert_eq!(s.phase(), Phase::Running);
        assert!(s.health().healthy);
        std::thread::sleep(Duration::from_millis(120));
        let h = s.health();
        assert!(!h.healthy, "stuck: {h:?}");
        assert!(h.since_last_turn_ms.unwrap() >= 100);
        s.beat();
        assert!(s.health().healthy);
        s.finish(Some("kafka commit failed".into()));
        let h = s.health();
        assert!(!h.healthy);
        assert_eq!(h.phase, Phase::Failed);
        assert_eq!(h.failure.as_deref(), Some("kafka commit failed"));
    }

    #[test]
    fn ready_only_when_assigned_and_nothing_restores() {
        let s = Status::default();
        assert!(!s.partitions().ready(), "no assignment yet");
        s.publish(Partitions {
            assigned_once: true,
            assigned: vec![0, 1],
            waiting: vec![1],
            ..Partitions::default()
        });
        assert!(!s.partitions().ready());
        // A routed source partition not resumed yet holds readiness back too.
        s.publish(Partitions {
            assigned_once: true,
            assigned: vec![0],
            routing_waiting: vec![("in".into(), 0)],
            ..Partitions::default()
        });
        assert!(!s.partitions().ready());
        s.publish(Partitions {
            assigned_once: true,
            assigned: vec![0, 1],
            restoring: vec![Restoring {
                store: "dedup".into(),
                partition: 0,
                progress: Progress {
                    done: 10,
                    total: 100,
                    remaining: 90,
                    rate: 5.0,
                    eta_seconds: 18.0,
                },
            }],
            ..Partitions::default()
        });
        assert!(!s.partitions().ready());
        s.publish(Partitions {
            assigned_once: true,
            assigned: vec![0, 1],
            ..Partitions::default()
        });
        assert!(s.partitions().ready());
    }
}
