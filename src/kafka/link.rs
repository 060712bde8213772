//! Whether this process reaches the Kafka cluster, for `/ready`.
//!
//! Two ways to lose the cluster, two signals:
//! - Every connection down: librdkafka reports it through a client's error callback
//!   (`AllBrokersDown`); both the source consumer and the output producer pass such
//!   reports to [`note_error`]. Nothing reports the way back, so the run loop, while the
//!   link is down, asks the cluster for metadata about once a second and calls
//!   [`note_up`] when an answer comes.
//! - Connections up but nothing answers (a broker frozen, e.g. stopped by SIGSTOP or
//!   stuck, or a network that drops replies): its TCP listener still accepts, so no
//!   connection fails and nothing is reported for up to `socket.timeout.ms`, and again
//!   after each reconnect. The source consumer's librdkafka statistics (every
//!   [`STATS_INTERVAL_MS`], passed to [`note_stats`]) show it: requests wait for a reply
//!   ([`StatsView::waiting`]) while no broker has sent anything for [`STALL_AFTER`].
//!   A source consumer in a group always has a request out (a fetch, which a live broker
//!   answers within `fetch.wait.max.ms`, or a heartbeat every few seconds), so a live
//!   cluster never goes that long without a reply; a rebalance that keeps a member with
//!   no partitions waiting in JoinGroup longer than that shows it not ready meanwhile.
//!
//! The state is per process (every client of it talks to the same cluster).

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the source consumer emits librdkafka statistics for [`note_stats`]:
/// `statistics.interval.ms` (a user's `kafka.consumer.statistics.interval.ms` wins; `0`
/// turns the stall check off).
pub(crate) const STATS_INTERVAL_MS: &str = "1000";

/// How long no broker may send anything while requests wait for a reply before the
/// cluster counts as unreachable: 15 s, longer than any reply a live broker delays (a
/// fetch waits at most `fetch.wait.max.ms`, 500 ms by default; a heartbeat is answered at
/// once) and shorter than librdkafka's `socket.timeout.ms` (60 s).
pub(crate) const STALL_AFTER: Duration = Duration::from_secs(15);

/// What [`note_stats`] reads from one librdkafka statistics report (see librdkafka's
/// STATISTICS.md): over the client's brokers, whether any has requests awaiting a reply
/// (`waitresp_cnt`), and the least time since any of them last sent something
/// (`rxidle`, µs; a broker that never sent anything is left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StatsView {
    /// Some broker has requests awaiting a reply.
    pub(crate) waiting: bool,
    /// Microseconds since the last receive from any broker; `None` when none has sent
    /// anything yet.
    pub(crate) rx_idle_us: Option<i64>,
}

impl StatsView {
    /// Read a statistics report (the JSON librdkafka emits); `None` when it is not one.
    pub(crate) fn parse(json: &[u8]) -> Option<StatsView> {
        #[derive(serde::Deserialize)]
        struct Report {
            brokers: std::collections::HashMap<String, Broker>,
        }
        // Both fields required: a librdkafka without them must not read as "never stalled"
        // silently (a unit test parses this librdkafka's own report).
        #[derive(serde::Deserialize)]
        struct Broker {
            waitresp_cnt: i64,
            rxidle: i64,
        }
        let r: Report = serde_json::from_slice(json).ok()?;
        Some(StatsView {
            waiting: r.brokers.values().any(|b| b.waitresp_cnt > 0),
            rx_idle_us: r
                .brokers
                .values()
                .filter(|b| b.rxidle >= 0)
                .map(|b| b.rxidle)
                .min(),
        })
    }
}

/// The reachability state (one per process: [`LINK`]).
pub(crate) struct Link {
    down: AtomicBool,
    /// How many times every broker went unreachable since the process started.
    outages: AtomicU64,
    /// From the last statistics report: whether requests were waiting.
    stats_waiting: AtomicBool,
    /// From the last statistics report: when (ms on [`Link::clock`]) some broker last sent
    /// something; `i64::MIN` when unknown.
    last_rx_ms: AtomicI64,
    /// Whether the last look found the cluster stalled (to log the changes once).
    stalled: AtomicBool,
}

/// Milliseconds since the first call in this process: the clock of [`Link`]'s times.
fn clock_ms() -> i64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as i64
}

/// This process's link to the cluster.
pub(crate) static LINK: Link = Link::new();

impl Link {
    /// Reachable until a client reports every broker down.
    pub(crate) const fn new() -> Link {
        Link {
            down: AtomicBool::new(false),
            outages: AtomicU64::new(0),
            stats_waiting: AtomicBool::new(false),
            last_rx_ms: AtomicI64::new(i64::MIN),
            stalled: AtomicBool::new(false),
        }
    }

    /// As [`note_stats`], the report read at `now_ms` (on the [`clock_ms`] clock).
    pub(crate) fn note_stats_at(&self, view: StatsView, now_ms: i64) {
        let last = view.rx_idle_us.map_or(i64::MIN, |us| now_ms - us / 1000);
        self.last_rx_ms.store(last, Ordering::SeqCst);
        self.stats_waiting.store(view.waiting, Ordering::SeqCst);
        self.stalled_at(now_ms);
    }

    /// Whether, at `now_ms`, requests wait while no broker has sent anything for
    /// [`STALL_AFTER`] (as of the last statistics report, aged to `now_ms`: a run loop
    /// blocked on the stalled cluster serves no further report). Logs the changes.
    pub(crate) fn stalled_at(&self, now_ms: i64) -> bool {
        let last = self.last_rx_ms.load(Ordering::SeqCst);
        let stalled = self.stats_waiting.load(Ordering::SeqCst)
            && last != i64::MIN
            && now_ms.saturating_sub(last) >= STALL_AFTER.as_millis() as i64;
        if stalled != self.stalled.swap(stalled, Ordering::SeqCst) {
            if stalled {
                tracing::warn!(
                    silent_ms = now_ms.saturating_sub(last),
                    "requests are waiting and no broker has answered for {} s: not ready until one does",
                    STALL_AFTER.as_secs()
                );
            } else {
                tracing::info!("a broker answers again: ready once the partitions are");
            }
        }
        stalled
    }

    /// As [`note_error`].
    pub(crate) fn note_error(&self, error: &KafkaError) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown)
            && !self.down.swap(true, Ordering::SeqCst)
        {
            self.outages.fetch_add(1, Ordering::SeqCst);
            tracing::warn!("every broker is unreachable: not ready until one answers");
        }
    }

    /// As [`note_up`].
    pub(crate) fn note_up(&self) {
        if self.down.swap(false, Ordering::SeqCst) {
            tracing::info!("a broker answers again: ready once the partitions are");
        }
    }

    /// As [`reachable`].
    pub(crate) fn reachable(&self) -> bool {
        !self.is_down() && !self.stalled_at(clock_ms())
    }

    /// As [`is_down`].
    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    /// As [`outages`].
    pub(crate) fn outages(&self) -> u64 {
        self.outages.load(Ordering::SeqCst)
    }
}

impl Default for Link {
    fn default() -> Self {
        Link::new()
    }
}

/// Take note of a client error: `AllBrokersDown` marks the cluster unreachable.
pub(crate) fn note_error(error: &KafkaError) {
    LINK.note_error(error);
}

/// A request that needs a broker found none to answer it within its time (a start-up
/// metadata request failing with a transport error): the cluster is unreachable, as when a
/// client reports every broker down. Start-up's admin client needs this: librdkafka's
/// error reports reach only clients whose main queue is polled, and the admin client's is
/// not.
pub(crate) fn note_down() {
    LINK.note_error(&KafkaError::Global(RDKafkaErrorCode::AllBrokersDown));
}

/// A broker answered: the cluster is reachable again.
pub(crate) fn note_up() {
    LINK.note_up();
}

/// A statistics report of the source consumer (librdkafka's JSON, every
/// [`STATS_INTERVAL_MS`]): the stall check's input. A report that does not parse is
/// ignored.
pub(crate) fn note_stats(json: &[u8]) {
    if let Some(view) = StatsView::parse(json) {
        LINK.note_stats_at(view, clock_ms());
    }
}

/// Whether the cluster is reachable: no client has reported every broker down since a
/// broker last answered, and the source consumer's requests are not stalled (see the
/// module doc).
pub(crate) fn reachable() -> bool {
    LINK.reachable()
}

/// Whether a client reported every broker down and no broker has answered since (the run
/// loop then probes with metadata requests).
pub(crate) fn is_down() -> bool {
    LINK.is_down()
}

/// How many times every broker went unreachable since the process started: a change
/// between two readings means an outage began in between (the producer compares the
/// readings at a transaction's begin and at its fencing).
pub(crate) fn outages() -> u64 {
    LINK.outages()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(brokers: &[(&str, i64, i64)]) -> Vec<u8> {
        let b: serde_json::Map<String, serde_json::Value> = brokers
            .iter()
            .map(|(name, waiting, rxidle)| {
                (
                    name.to_string(),
                    serde_json::json!({"name": name, "state": "UP", "waitresp_cnt": waiting, "rxidle": rxidle, "rx": 10}),
                )
            })
            .collect();
        serde_json::to_vec(&serde_json::json!({"name": "c", "type": "consumer", "brokers": b}))
            .unwrap()
    }

    #[test]
    fn a_report_gives_waiting_and_the_least_receive_idle_time() {
        let v = StatsView::parse(&report(&[
            ("a:1/1", 0, 9_000_000),
            ("b:1/2", 2, 40_000),
            (":0/internal", 0, -1),
        ]))
        .unwrap();
        assert_eq!(
            v,
            StatsView {
                waiting: true,
                rx_idle_us: Some(40_000)
            }
        );
        let v = StatsView::parse(&report(&[(":0/internal", 0, -1)])).unwrap();
        assert_eq!(v.rx_idle_us, None);
        assert!(!v.waiting);
        assert_eq!(StatsView::parse(b"not json"), None);
    }

    /// The bundled librdkafka's own statistics report has the fields the stall check
    /// reads (no broker needed: the report lists the unreachable bootstrap broker).
    #[test]
    fn this_librdkafkas_statistics_report_parses() {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use std::sync::Mutex;
        struct Keep(Mutex<Option<Vec<u8>>>);
        impl rdkafka::ClientContext for Keep {
            fn stats_raw(&self, statistics: &[u8]) {
                *self.0.lock().unwrap() = Some(statistics.to_vec());
            }
        }
        impl rdkafka::consumer::ConsumerContext for Keep {}
        let c: BaseConsumer<Keep> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("group.id", "link-stats-test")
            .set("statistics.interval.ms", "100")
            .set("log_level", "0")
            .create_with_context(Keep(Mutex::new(None)))
            .unwrap();
        c.subscribe(&["t"]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let json = loop {
            let _ = c.poll(Duration::from_millis(100));
            if let Some(j) = c.context().0.lock().unwrap().clone() {
                break j;
            }
            assert!(Instant::now() < deadline, "no statistics report in 10 s");
        };
        let text = String::from_utf8_lossy(&json);
        let view = StatsView::parse(&json);
        assert!(view.is_some(), "the report does not parse: {text}");
        assert!(text.contains("\"127.0.0.1:1/bootstrap\""), "{text}");
    }

    /// A broker that accepts connections but answers nothing (frozen): requests wait and
    /// nothing arrives for STALL_AFTER, then the cluster is unreachable until a reply.
    #[test]
    fn waiting_requests_without_a_reply_for_the_stall_time_make_the_cluster_unreachable() {
        let link = Link::new();
        let stall = STALL_AFTER.as_millis() as i64;
        let at = 1_000_000;
        // Answered 200 ms ago, a fetch out: live.
        link.note_stats_at(
            StatsView {
                waiting: true,
                rx_idle_us: Some(200_000),
            },
            at,
        );
        assert!(!link.stalled_at(at + 1_000));
        // The last report ages: the loop that would serve the next one may be blocked.
        assert!(link.stalled_at(at - 200 + stall));
        // Silent but nothing asked (an idle client): not a stall.
        link.note_stats_at(
            StatsView {
                waiting: false,
                rx_idle_us: Some(stall * 2_000),
            },
            at,
        );
        assert!(!link.stalled_at(at));
        // Asked and silent for longer than the stall time.
        link.note_stats_at(
            StatsView {
                waiting: true,
                rx_idle_us: Some(stall * 1_000 + 1_000),
            },
            at,
        );
        assert!(link.stalled_at(at));
        assert!(
            !link.is_down(),
            "a stall is not an outage of every connection"
        );
        // A reply: reachable again.
        link.note_stats_at(
            StatsView {
                waiting: true,
                rx_idle_us: Some(5_000),
            },
            at + 1_000,
        );
        assert!(!link.stalled_at(at + 1_000));
    }

    #[test]
    fn all_brokers_down_makes_the_cluster_unreachable_until_one_answers() {
        let link = Link::new();
        assert!(link.reachable());
        link.note_error(&KafkaError::Global(
            RDKafkaErrorCode::BrokerTransportFailure,
        ));
        assert!(
            link.reachable(),
            "one connection lost is not the cluster gone"
        );
        link.note_error(&KafkaError::Global(RDKafkaErrorCode::AllBrokersDown));
        assert!(!link.reachable());
        link.note_up();
        assert!(link.reachable());
    }
}
