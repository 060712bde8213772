//! The reservation protocol for effects that are not transactional with their store (HTTP,
//! Redis, files): reserve the key (in flight, with a lease) → run the effect → mark it
//! completed with its result.
//!
//! Guarantees, each with its test below:
//! - a completed key is never run again (its stored result is returned as a duplicate);
//! - a failed effect releases its reservation, and a failure never marks a key completed;
//! - a concurrent twin (same key, in flight elsewhere) waits for the result
//!   ([`InFlight::Wait`], bounded) or raises "in progress" and is retried after a backoff
//!   ([`InFlight::Raise`]) until the key completes (then skipped) or is free (then run);
//! - an expired lease (its holder died) lets the next attempt run;
//! - store unreachable: [`OnStoreError::FailClosed`] retries for `store_retry_for`, then
//!   fails the record (dead letter), never running the effect unprotected;
//!   [`OnStoreError::FailOpen`] runs the effect unprotected and says so in the outcome.
//!
//! The one window left: the process dies after the effect and before the completed mark.
//! The key stays in flight until its lease expires, then the effect runs again; HTTP sinks
//! send the same `Idempotency-Key` so the receiver can tell.

use super::store::{Claim, Completion, IdempotencyStore, Reservation, StoreError};
use std::future::Future;
use std::time::{Duration, Instant};

/// What a twin does when it finds its key in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    /// Poll for the result up to this long, then behave as `Raise`.
    Wait(Duration),
    /// Give up at once: the record is retried after `raise_backoff`.
    Raise,
}

/// What to do when the idempotency store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnStoreError {
    /// Retry; after `store_retry_for`, dead-letter the record. Never run unprotected.
    #[default]
    FailClosed,
    /// Run the effect without protection, counted as `unprotected` and logged.
    FailOpen,
}

/// Protocol settings of one sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationPolicy {
    /// How long a reservation holds before another attempt may take the key (default 5 min).
    /// It must outlast the effect with its retries (checked for HTTP sinks at build time).
    pub lease: Duration,
    /// How long a completed record is kept (default 7 days).
    pub completed_ttl: Duration,
    /// Twin behaviour (default `Wait(30 s)`).
    pub in_flight: InFlight,
    /// Pause before a raised ("in progress") record is tried again (default 500 ms).
    pub raise_backoff: Duration,
    /// How long a record keeps being retried while its key is in flight elsewhere; past it
    /// the record is dead-lettered. `None` (the default): `lease` × 2, whatever `lease` is
    /// set to (see [`ReservationPolicy::give_up`]).
    pub in_flight_give_up: Option<Duration>,
    /// Store failure policy (default fail_closed).
    pub on_store_error: OnStoreError,
    /// How long store operations are retried before `on_store_error` applies (default 30 s).
    pub store_retry_for: Duration,
}

impl Default for ReservationPolicy {
    fn default() -> Self {
        ReservationPolicy {
            lease: Duration::from_secs(300),
            completed_ttl: Duration::from_secs(7 * 24 * 3600),
            in_flight: InFlight::Wait(Duration::from_secs(30)),
            raise_backoff: Duration::from_millis(500),
            in_flight_give_up: None,
            on_store_error: OnStoreError::FailClosed,
            store_retry_for: Duration::from_secs(30),
        }
    }
}

impl ReservationPolicy {
    /// How long a record keeps being retried while its key is in flight elsewhere:
    /// `in_flight_give_up`, else `lease` × 2 (10 min with the default lease).
    pub fn give_up(&self) -> Duration {
        self.in_flight_give_up
            .unwrap_or_else(|| self.lease.saturating_mul(2))
    }
}

/// Why an effect did not end as done.
///
/// `unknown` marks an effect whose outcome cannot be known: a command that is not
/// idempotent was sent, and the connection failed before its reply came back. Such an
/// effect is neither retried nor released: the record goes to the dead-letter topic with
/// `reason`, counted as `unknown`, and its key stays in flight until its lease expires, so
/// a redelivery inside the lease does not run it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EffectError {
    /// A sentence for the dead-letter topic.
    pub reason: String,
    /// The effect may or may not have run.
    pub unknown: bool,
}

impl EffectError {
    /// An effect whose outcome is unknown (see the type's documentation).
    pub(crate) fn unknown(reason: impl Into<String>) -> Self {
        EffectError {
            reason: reason.into(),
            unknown: true,
        }
    }
}

impl From<String> for EffectError {
    /// A failed effect: it did not take place.
    fn from(reason: String) -> Self {
        EffectError {
            reason,
            unknown: false,
        }
    }
}

impl From<&str> for EffectError {
    fn from(reason: &str) -> Self {
        EffectError::from(reason.to_string())
    }
}

impl std::fmt::Display for EffectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// How an effect ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EffectOutcome {
    /// The effect ran now; its result.
    Done(Vec<u8>),
    /// The key was completed before (a redelivery or a twin); the stored result.
    SkippedDuplicate(Vec<u8>),
    /// The effect ran with no idempotency record: the sink has `store: none`, or the store
    /// was unreachable and the policy is fail_open. A redelivery may run it again.
    Unprotected(Vec<u8>),
}

impl EffectOutcome {
    /// The metric label: `done`, `skipped_duplicate` or `unprotected`.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            EffectOutcome::Done(_) => "done",
            EffectOutcome::SkippedDuplicate(_) => "skipped_duplicate",
            EffectOutcome::Unprotected(_) => "unprotected",
        }
    }

    /// The effect's result (run now or stored).
    pub(crate) fn result(&self) -> &[u8] {
        match self {
            EffectOutcome::Done(r)
            | EffectOutcome::SkippedDuplicate(r)
            | EffectOutcome::Unprotected(r) => r,
        }
    }
}

async fn with_retry<T, F, Fut>(deadline: Instant, what: &str, mut op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut pause = Duration::from_millis(50);
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                if Instant::now() + pause > deadline {
                    return Err(StoreError(format!("{what}: {e}")));
                }
                tracing::warn!(error = %e, op = what, "idempotency store failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Run `effect` at most once for `key` under `policy`.
///
/// `effect` does its own retries (HTTP backoff); an `Err` from it is final for this attempt:
/// the reservation is released and the reason returned, except when the effect's outcome
/// is unknown ([`EffectError::unknown`]): then the reservation is kept until its lease
/// expires, since the effect may have run.
///
/// # Errors
/// A sentence for the dead-letter topic: the effect failed or its outcome is unknown, the
/// store stayed unreachable (fail_closed), or the key stayed in flight elsewhere past
/// `in_flight_give_up`.
pub(crate) async fn run_once<F, Fut>(
    store: &dyn IdempotencyStore,
    key: &[u8],
    policy: &ReservationPolicy,
    mut effect: F,
) -> Result<EffectOutcome, EffectError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Vec<u8>, EffectError>>,
{
    let started = Instant::now();
    let token: u64 = rand::random();
    loop {
        let deadline = Instant::now() + policy.store_retry_for;
        let r = with_retry(deadline, "reserve", || {
            store.reserve(
                key,
                Claim {
                    token,
                    lease: policy.lease,
                },
            )
        })
        .await;
        match r {
            Err(e) => match policy.on_store_error {
                OnStoreError::FailClosed => {
                    return Err(format!(
                        "idempotency store unreachable for {:?} (fail_closed; effect not run): {e}",
                        policy.store_retry_for
                    )
                    .into())
                }
                OnStoreError::FailOpen => {
                    tracing::warn!(error = %e, "idempotency store unreachable: running the effect unprotected (fail_open)");
                    return effect().await.map(EffectOutcome::Unprotected);
                }
            },
            Ok(Reservation::Completed(r)) => return Ok(EffectOutcome::SkippedDuplicate(r)),
            Ok(Reservation::Acquired) => {
                return match effect().await {
                    Ok(result) => {
                        let deadline = Instant::now() + policy.store_retry_for;
                        if let Err(e) = with_retry(deadline, "complete", || {
                            store.complete(
                                key,
                                Completion {
                                    result: &result,
                                    ttl: policy.completed_ttl,
                                },
                            )
                        })
                        .await
                        {
                            // The effect ran: failing the record now would not undo it. The key
                            // stays in flight until its lease expires.
                            tracing::error!(error = %e, "effect done but its completed mark could not be stored; a redelivery after the lease may repeat it");
                        }
                        Ok(EffectOutcome::Done(result))
                    }
                    Err(e) if e.unknown => {
                        tracing::error!(reason = %e, "effect outcome unknown: its key stays in flight until the lease expires");
                        Err(e)
                    }
                    Err(reason) => {
                        let deadline = Instant::now() + policy.store_retry_for;
                        if let Err(e) =
                            with_retry(deadline, "release", || store.release(key, token)).await
                        {
                            tracing::warn!(error = %e, "could not release a failed reservation; it expires with its lease");
                        }
                        Err(reason)
                    }
                };
            }
            Ok(Reservation::InFlight) => {
                if let InFlight::Wait(max) = policy.in_flight {
                    let until = Instant::now() + max;
                    let mut pause = Duration::from_millis(20);
                    loop {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(250));
                        match store.lookup(key).await {
                            Ok(Some(Reservation::Completed(r))) => {
                                return Ok(EffectOutcome::SkippedDuplicate(r))
                            }
                            Ok(None) => break, // released or expired: try to reserve
                            Ok(_) | Err(_) if Instant::now() < until => continue,
                            _ => break,
                        }
                    }
                    if Instant::now() < until {
                        continue;
                    }
                }
                tracing::info!(
                    in_flight = ?policy.in_flight,
                    "effect key in progress elsewhere: the record is retried after the backoff"
                );
                if started.elapsed() >= policy.give_up() {
                    return Err(format!(
                        "effect key still in flight elsewhere after {:?}",
                        policy.give_up()
                    )
                    .into());
                }
                tokio::time::sleep(policy.raise_backoff).await;
            }
        }
    }
}

/// A two-thread runtime for the tests below.
/// A reservation policy with short times for tests: `lease`, waiting up to `wait` for a
/// key in flight elsewhere, giving up after `give_up`.
#[cfg(test)]
fn test_policy(lease: Duration, wait: Duration, give_up: Duration) -> ReservationPolicy {
    ReservationPolicy {
        lease,
        in_flight: InFlight::Wait(wait),
        raise_backoff: Duration::from_millis(30),
        in_flight_give_up: Some(give_up),
        store_retry_for: Duration::from_millis(300),
        ..ReservationPolicy::default()
    }
}

#[cfg(test)]
fn test_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::store::MemoryIdempotencyStore;

    /// The claim of attempt `token` for `lease`.
    pub(super) fn claim(token: u64, lease: Duration) -> Claim {
        Claim { token, lease }
    }
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::test_runtime as rt;

    fn quick() -> ReservationPolicy {
        super::test_policy(
            Duration::from_millis(300),
            Duration::from_secs(2),
            Duration::from_secs(3),
        )
    }

    /// An effect that counts its runs in `n` and answers `reply`.
    fn counted<'a>(
        n: &'a AtomicUsize,
        reply: &'static [u8],
    ) -> impl Fn() -> std::future::Ready<Result<Vec<u8>, EffectError>> + Copy + 'a {
        move || {
            n.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok(reply.to_vec()))
        }
    }

    #[test]
    fn completed_key_is_never_run_again() {
        rt().block_on(async {
            let s = MemoryIdempotencyStore::new();
            let n = AtomicUsize::new(0);
            let eff = counted(&n, b"r1");
            assert_eq!(
                run_once(&s, b"k", &quick(), eff).await,
                Ok(EffectOutcome::Done(b"r1".to_vec()))
            );
            let again = run_once(&s, b"k", &quick(), eff).await;
            assert_eq!(again, Ok(EffectOutcome::SkippedDuplicate(b"r1".to_vec())));
            assert_eq!(n.load(Ordering::SeqCst), 1);
            // A different key runs.
            run_once(&s, b"k2", &quick(), eff).await.unwrap();
            assert_eq!(n.load(Ordering::SeqCst), 2);
        });
    }

    #[test]
    fn failure_releases_and_never_marks_done() {
        rt().block_on(async {
            let s = MemoryIdempotencyStore::new();
            let r = run_once(&s, b"k", &quick(), || async {
                Err::<Vec<u8>, _>("boom".into())
            })
            .await;
            assert_eq!(r, Err("boom".into()));
            assert_eq!(s.lookup(b"k").await.unwrap(), None);
            let r = run_once(&s, b"k", &quick(), || async { Ok(b"ok".to_vec()) }).await;
            assert_eq!(r, Ok(EffectOutcome::Done(b"ok".to_vec())));
        });
    }

    #[test]
    fn an_unknown_outcome_keeps_the_reservation_until_its_lease() {
        rt().block_on(async {
            let s = MemoryIdempotencyStore::new();
            let r = run_once(&s, b"k", &quick(), || async {
                Err::<Vec<u8>, _>(EffectError::unknown("reply lost"))
            })
            .await;
            assert_eq!(r, Err(EffectError::unknown("reply lost")));
            // Not released (it may have run), not completed (it may not have).
            assert_eq!(s.lookup(b"k").await.unwrap(), Some(Reservation::InFlight));
        });
    }

    #[test]
    fn expired_lease_lets_the_next_attempt_run() {
        rt().block_on(async {
            let s = MemoryIdempotencyStore::new();
            // A holder that died: reserved, never completed nor released.
            assert_eq!(
                s.reserve(b"k", claim(1, Duration::from_millis(100)))
                    .await
                    .unwrap(),
                Reservation::Acquired
            );
            let p = ReservationPolicy {
                in_flight: InFlight::Raise,
                ..quick()
            };
            let t = Instant::now();
            let r = run_once(&s, b"k", &p, || async { Ok(b"x".to_vec()) }).await;
            assert_eq!(r, Ok(EffectOutcome::Done(b"x".to_vec())));
            assert!(
                t.elapsed() >= Duration::from_millis(60),
                "ran before the lease expired"
            );
        });
    }

    async fn twins(
        policy: ReservationPolicy,
    ) -> (
        Result<EffectOutcome, EffectError>,
        Result<EffectOutcome, EffectError>,
        usize,
    ) {
        let s = MemoryIdempotencyStore::new();
        let n = Arc::new(AtomicUsize::new(0));
        let slow = {
            let n = n.clone();
            move || {
                let n = n.clone();
                async move {
                    n.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    Ok(b"result-1".to_vec())
                }
            }
        };
        let (a, b) = tokio::join!(run_once(&s, b"twin", &policy, slow.clone()), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            run_once(&s, b"twin", &policy, slow.clone()).await
        });
        (a, b, n.load(Ordering::SeqCst))
    }

    /// Twins under `in_flight`: one effect; the first is done, the second skipped with its
    /// result.
    fn twins_make_one_effect(in_flight: InFlight) {
        rt().block_on(async {
            let p = ReservationPolicy {
                lease: Duration::from_secs(5),
                in_flight,
                ..quick()
            };
            let (a, b, n) = twins(p).await;
            assert_eq!(a, Ok(EffectOutcome::Done(b"result-1".to_vec())));
            assert_eq!(b, Ok(EffectOutcome::SkippedDuplicate(b"result-1".to_vec())));
            assert_eq!(n, 1);
        });
    }

    #[test]
    fn twin_waits_for_the_result() {
        twins_make_one_effect(quick().in_flight);
    }

    #[test]
    fn twin_raises_then_is_skipped_as_completed() {
        twins_make_one_effect(InFlight::Raise);
    }

    #[test]
    fn twin_gives_up_when_in_flight_too_long() {
        rt().block_on(async {
            let s = MemoryIdempotencyStore::new();
            s.reserve(b"k", claim(1, Duration::from_secs(60)))
                .await
                .unwrap();
            let p = ReservationPolicy {
                in_flight: InFlight::Raise,
                in_flight_give_up: Some(Duration::from_millis(200)),
                ..quick()
            };
            let r = run_once(&s, b"k", &p, || async { Ok(b"x".to_vec()) }).await;
            assert!(r.unwrap_err().reason.contains("still in flight"));
        });
    }

    #[test]
    fn store_errors_fail_closed_or_open() {
        rt().block_on(async {
            let s = MemoryIdempotencyStore::new();
            let n = AtomicUsize::new(0);
            let eff = counted(&n, b"r");
            // A short outage is retried through.
            s.fail_next(2);
            assert_eq!(
                run_once(&s, b"a", &quick(), eff).await,
                Ok(EffectOutcome::Done(b"r".to_vec()))
            );
            // A long one: closed never runs the effect.
            s.fail_next(1000);
            let r = run_once(&s, b"b", &quick(), eff).await;
            assert!(r.unwrap_err().reason.contains("fail_closed"));
            assert_eq!(n.load(Ordering::SeqCst), 1);
            // Open runs it, unprotected.
            let p = ReservationPolicy {
                on_store_error: OnStoreError::FailOpen,
                ..quick()
            };
            assert_eq!(
                run_once(&s, b"b", &p, eff).await,
                Ok(EffectOutcome::Unprotected(b"r".to_vec()))
            );
            assert_eq!(n.load(Ordering::SeqCst), 2);
        });
    }
}

/// The protocol's guarantees against the real stores (sled always; Redis when
/// ONCEFLOW_REDIS_URL is set).
#[cfg(test)]
mod real_store_tests {
    use super::tests::claim;
    use super::*;
    use crate::sink::store::{RedisIdempotencyStore, SledIdempotencyStore};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    async fn suite(s: Arc<dyn IdempotencyStore>, ns: &str) {
        let p = super::test_policy(
            Duration::from_millis(400),
            Duration::from_secs(3),
            Duration::from_secs(5),
        );
        let k = |s: &str| format!("{ns}{s}").into_bytes();
        let n = Arc::new(AtomicUsize::new(0));
        let eff = |r: &'static str| {
            let n = n.clone();
            move || {
                let n = n.clone();
                async move {
                    n.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    Ok(r.as_bytes().to_vec())
                }
            }
        };
        // Done once, then a duplicate with the stored result; raw bytes keys.
        let key = [k("order-9:invoice"), vec![0xff, 0x00, 0x80]].concat();
        assert_eq!(
            run_once(&*s, &key, &p, eff("r1")).await,
            Ok(EffectOutcome::Done(b"r1".to_vec()))
        );
        assert_eq!(
            run_once(&*s, &key, &p, eff("r2")).await,
            Ok(EffectOutcome::SkippedDuplicate(b"r1".to_vec()))
        );
        // A failure releases and never marks done.
        let f = k("fails");
        let r = run_once(&*s, &f, &p, || async { Err::<Vec<u8>, _>("boom".into()) }).await;
        assert_eq!(r, Err("boom".into()));
        assert_eq!(s.lookup(&f).await.unwrap(), None);
        // A dead holder's lease expires; the next attempt runs.
        let e = k("expired");
        let reserve = |token| s.reserve(&e, claim(token, Duration::from_millis(200)));
        assert_eq!(reserve(7).await.unwrap(), Reservation::Acquired);
        assert_eq!(reserve(8).await.unwrap(), Reservation::InFlight);
        // A retry of the holder's own call (its first reply lost) finds the key its own.
        assert_eq!(reserve(7).await.unwrap(), Reservation::Acquired);
        assert_eq!(
            run_once(&*s, &e, &p, eff("r3")).await,
            Ok(EffectOutcome::Done(b"r3".to_vec()))
        );
        // Twins: one effect, both see its result.
        let t = k("twin");
        let (a, b) = tokio::join!(run_once(&*s, &t, &p, eff("t1")), async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            run_once(&*s, &t, &p, eff("t2")).await
        });
        assert_eq!(a, Ok(EffectOutcome::Done(b"t1".to_vec())));
        assert_eq!(b, Ok(EffectOutcome::SkippedDuplicate(b"t1".to_vec())));
        assert_eq!(n.load(Ordering::SeqCst), 3);
    }

    use super::test_runtime as rt;

    #[test]
    fn sled_store_keeps_the_protocol() {
        let dir = tempfile::tempdir().unwrap();
        let s = SledIdempotencyStore::open(&dir.path().join("db"), "t").unwrap();
        rt().block_on(suite(Arc::new(s), ""));
    }

    #[test]
    fn redis_store_keeps_the_protocol() {
        let Ok(url) = std::env::var("ONCEFLOW_REDIS_URL") else {
            eprintln!("\n*** SKIPPED: ONCEFLOW_REDIS_URL is not set (run scripts/test, or scripts/redis start) ***\n");
            return;
        };
        rt().block_on(async {
            let s = RedisIdempotencyStore::connect(&url, b"unit:", Duration::from_secs(2))
                .await
                .unwrap();
            let ns = format!("{}-{}:", std::process::id(), rand::random::<u32>());
            suite(Arc::new(s), &ns).await;
        });
    }
}
