//! Bounded retries of transient broker errors.
//!
//! A broker that was just started or just created a topic answers some requests with
//! errors that go away by themselves: its group coordinator is not elected or still loading
//! (`NotCoordinator`, `CoordinatorLoadInProgress`, `CoordinatorNotAvailable`), a partition
//! has no leader yet (`LeaderNotAvailable`, `NotLeaderForPartition`), a request timed out.
//! Every admin call of onceflow and its tools goes through [`retry`], which repeats the
//! call with a doubling backoff (100 ms up to 2 s) for at most [`DEFAULT_BUDGET`] (2 min), then
//! returns the last error. Errors that are not transient return at once. Each retry is
//! logged (they are rare: a broker starting, a coordinator moving).

use crate::error::{Error, Result};
use rdkafka::types::RDKafkaErrorCode;
use std::time::{Duration, Instant};

/// How long [`retry`] keeps trying a transient error: 120 s (a just-formatted broker on a
/// busy 2-core machine took over a minute to elect its first group coordinator).
pub(crate) const DEFAULT_BUDGET: Duration = Duration::from_secs(120);

/// Whether a broker or client error code is transient, i.e. the same request may succeed
/// when sent again a little later.
pub(crate) fn is_retriable_code(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::NotCoordinator
            | C::CoordinatorLoadInProgress
            | C::CoordinatorNotAvailable
            | C::WaitingForCoordinator
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::ReplicaNotAvailable
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::RequestTimedOut
            | C::NetworkException
            | C::BrokerNotAvailable
            | C::KafkaStorageError
            | C::FetchSessionIdNotFound
            | C::UnknownLeaderEpoch
            | C::FencedLeaderEpoch
            | C::RebalanceInProgress
            | C::OperationTimedOut
            | C::TimedOutQueue
            | C::BrokerTransportFailure
            | C::AllBrokersDown
            | C::Retry
    )
}

/// Whether `e` is a transient broker error (see [`is_retriable_code`]).
pub(crate) fn is_retriable(e: &Error) -> bool {
    code_of(e).is_some_and(is_retriable_code)
}

/// The librdkafka or broker error code of `e`, if it has one.
fn code_of(e: &Error) -> Option<RDKafkaErrorCode> {
    match e {
        Error::Kafka { source, .. } => source.rdkafka_error_code(),
        Error::BrokerCode { code, .. } => Some(*code),
        _ => None,
    }
}

/// Run `f` until it succeeds, fails with an error that is not transient, or
/// `DEFAULT_BUDGET` has passed; each transient failure is logged (at info level) with
/// `what` and waited out with a doubling backoff from 100 ms to 2 s.
///
/// # Errors
/// The first error that is not transient, or the last transient one once the budget is
/// spent.
pub(crate) fn retry<T>(what: &str, f: impl FnMut() -> Result<T>) -> Result<T> {
    retry_for(what, DEFAULT_BUDGET, f)
}

std::thread_local! {
    /// The stop flag of the run on this thread, set by [`cancellable`].
    static CANCEL: std::cell::RefCell<Option<std::sync::Arc<std::sync::atomic::AtomicBool>>> =
        const { std::cell::RefCell::new(None) };
}

/// Run `f` with `stop` as this thread's stop flag: a [`retry`] loop in it gives up (with
/// the last transient error) as soon as `stop` is set, instead of retrying out its budget.
/// So a SIGTERM while the broker is unreachable at start-up stops the run at once.
pub(crate) fn cancellable<T>(
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    f: impl FnOnce() -> T,
) -> T {
    let before = CANCEL.with(|c| c.replace(Some(stop.clone())));
    let out = f();
    CANCEL.with(|c| *c.borrow_mut() = before);
    out
}

fn cancelled() -> bool {
    CANCEL.with(|c| {
        c.borrow()
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst))
    })
}

/// How long [`retry_known_topic`] waits for a client to learn a topic's partitions.
pub(crate) const KNOWN_TOPIC_BUDGET: Duration = Duration::from_secs(30);

/// Whether `e` is transient for a request about a topic known to exist (checked or created
/// at start-up): as [`is_retriable`], and also "unknown partition / topic", which a client
/// answers until its metadata shows a topic another instance (or this one) just created.
pub(crate) fn is_retriable_for_known_topic(e: &Error) -> bool {
    use RDKafkaErrorCode as C;
    let unknown = |c: RDKafkaErrorCode| {
        matches!(
            c,
            C::UnknownPartition | C::UnknownTopic | C::UnknownTopicOrPartition
        )
    };
    is_retriable(e) || code_of(e).is_some_and(unknown)
}

/// As [`retry`], for a request about a topic known to exist (see
/// [`is_retriable_for_known_topic`]); an unknown partition is retried for at most
/// [`KNOWN_TOPIC_BUDGET`] (30 s).
///
/// # Errors
/// As [`retry`].
pub(crate) fn retry_known_topic<T>(what: &str, f: impl FnMut() -> Result<T>) -> Result<T> {
    retry_when(what, KNOWN_TOPIC_BUDGET, is_retriable_for_known_topic, f)
}

/// As [`retry`], with a budget of `budget`.
///
/// # Errors
/// As [`retry`].
pub(crate) fn retry_for<T>(
    what: &str,
    budget: Duration,
    f: impl FnMut() -> Result<T>,
) -> Result<T> {
    retry_when(what, budget, is_retriable, f)
}

/// As [`retry_for`], retrying the errors `transient` accepts.
fn retry_when<T>(
    what: &str,
    budget: Duration,
    transient: fn(&Error) -> bool,
    mut f: impl FnMut() -> Result<T>,
) -> Result<T> {
    let deadline = Instant::now() + budget;
    let mut backoff = Duration::from_millis(100);
    let mut attempt = 1u32;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if transient(&e) && Instant::now() + backoff < deadline && !cancelled() => {
                tracing::info!(what, attempt, error = %e, backoff_ms = backoff.as_millis() as u64,
                    "transient broker error: retrying");
                // In steps, so that a stop is seen within 100 ms.
                let until = Instant::now() + backoff;
                while Instant::now() < until && !cancelled() {
                    std::thread::sleep((until - Instant::now()).min(Duration::from_millis(100)));
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(c: RDKafkaErrorCode) -> Error {
        Error::BrokerCode {
            what: "delete group g".into(),
            code: c,
        }
    }

    #[test]
    fn a_transient_error_is_retried_until_it_passes() {
        let mut calls = 0;
        let r = retry_for("t", Duration::from_secs(5), || {
            calls += 1;
            if calls < 3 {
                Err(code(RDKafkaErrorCode::NotCoordinator))
            } else {
                Ok(calls)
            }
        });
        assert_eq!(r.unwrap(), 3);
    }

    #[test]
    fn a_permanent_error_is_not_retried() {
        let mut calls = 0;
        let r: Result<()> = retry_for("t", Duration::from_secs(5), || {
            calls += 1;
            Err(code(RDKafkaErrorCode::TopicAuthorizationFailed))
        });
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }

    #[test]
    fn retries_are_bounded_by_the_budget() {
        let started = Instant::now();
        let mut calls = 0;
        let r: Result<()> = retry_for("t", Duration::from_millis(500), || {
            calls += 1;
            Err(code(RDKafkaErrorCode::CoordinatorLoadInProgress))
        });
        let e = r.unwrap_err();
        assert!(
            e.to_string().contains("CoordinatorLoadInProgress") || e.to_string().contains("load"),
            "{e}"
        );
        assert!(calls >= 2, "{calls}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    /// A client that has not yet learnt of a just-created topic answers "unknown
    /// partition": retried for a topic known to exist, not for others. (A crash-harness run
    /// lost an instance to it: the restore's watermarks of a changelog another instance had
    /// just created.)
    #[test]
    fn an_unknown_partition_is_transient_only_for_a_known_topic() {
        let local = || Error::Kafka {
            op: "changelog offsets",
            source: rdkafka::error::KafkaError::MetadataFetch(RDKafkaErrorCode::UnknownPartition),
        };
        assert!(!is_retriable(&local()));
        assert!(is_retriable_for_known_topic(&local()));
        assert!(is_retriable_for_known_topic(&code(
            RDKafkaErrorCode::UnknownTopicOrPartition
        )));
        assert!(!is_retriable_for_known_topic(&code(
            RDKafkaErrorCode::TopicAuthorizationFailed
        )));
        let mut calls = 0;
        let r = retry_known_topic("t", || {
            calls += 1;
            if calls < 3 {
                Err(local())
            } else {
                Ok(calls)
            }
        });
        assert_eq!(r.unwrap(), 3);
    }
}
