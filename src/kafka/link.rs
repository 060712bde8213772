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
//!   after each reconnect. The librdkafka statistics of the source consumer and of the
//!   output producer (every [`STATS_INTERVAL_MS`], passed to [`note_stats`]) show it:
//!   in two reports in a row, a client has requests waiting for a reply
//!   ([`StatsView::waiting`]) while none of its brokers has sent anything for
//!   [`STALL_AFTER`] (or, when it has heard nothing on its current connections, while it
//!   is that old); it stays stalled until a report shows a receive less than that old (a
//!   reconnect to the frozen broker, past `socket.timeout.ms`, shows none). Only the
//!   newest live client of each kind counts: a transactional producer re-created while
//!   the cluster is away reports beside the old one until that goes, and their reports
//!   must not take turns in one verdict. A live broker never keeps a client
//!   waiting that long: a fetch waits at most `fetch.wait.max.ms`, a heartbeat or a
//!   produce is answered at once. The producer's statistics are served by its own
//!   thread, so they tell even while the run loop waits on the stalled cluster (for a
//!   commit's acknowledgements); the consumer's are served by the run loop's polls, so
//!   they tell when the loop is idle, and the ones that queued up while it was blocked
//!   are ignored when read more than [`STALE_REPORT_S`] after they were taken. A
//!   rebalance that keeps a member with no partitions waiting in JoinGroup longer than
//!   [`STALL_AFTER`] shows it not ready meanwhile.
//!
//! The state is per process (every client of it talks to the same cluster).

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How often the source consumer and the output producer emit librdkafka statistics for
/// [`note_stats`]: `statistics.interval.ms` (a user's `kafka.consumer.*` or
/// `kafka.producer.*` setting wins; `0` turns that client's stall check off).
pub(crate) const STATS_INTERVAL_MS: &str = "1000";

/// How long no broker may send anything while requests wait for a reply before the
/// cluster counts as unreachable: 15 s, longer than any reply a live broker delays (a
/// fetch waits at most `fetch.wait.max.ms`, 500 ms by default; a heartbeat is answered at
/// once) and shorter than librdkafka's `socket.timeout.ms` (60 s).
pub(crate) const STALL_AFTER: Duration = Duration::from_secs(15);

/// A statistics report read more than this long after it was taken is ignored, in
/// seconds: the consumer's reports wait in its queue while the run loop is blocked (in a
/// commit), and the ones taken during a broker freeze, read after the thaw, would make the
/// consumer read as stalled for the moment until the newest report (~30 ms here).
const STALE_REPORT_S: i64 = 5;

/// What [`note_stats`] reads from one librdkafka statistics report (see librdkafka's
/// STATISTICS.md): over the client's brokers, whether any has requests awaiting a reply
/// (`waitresp_cnt`), and the least time since any of them last sent something
/// (`rxidle`, µs; a broker that sent nothing on its current connection is left out); and
/// the client's age (`age`, µs since it was created).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StatsView {
    /// Some broker has requests awaiting a reply.
    pub(crate) waiting: bool,
    /// Microseconds since the last receive from any broker; `None` when none has received
    /// anything on its current connection (or none is up).
    pub(crate) rx_idle_us: Option<i64>,
    /// Microseconds since the client was created.
    pub(crate) age_us: i64,
    /// When the report was taken, wall-clock seconds since the epoch (`None`: the report
    /// does not say).
    pub(crate) time_s: Option<i64>,
}

impl StatsView {
    /// How long the client has heard nothing, in µs: since the last receive from any
    /// broker, or, with none on its current connections, since it was created (a client
    /// that never reached a broker, or reconnected to one that does not answer, has
    /// heard nothing for at least that long as far as its connections tell).
    fn unheard_us(&self) -> i64 {
        self.rx_idle_us.unwrap_or(self.age_us)
    }
}

impl StatsView {
    /// Read a statistics report (the JSON librdkafka emits); `None` when it is not one.
    pub(crate) fn parse(json: &[u8]) -> Option<StatsView> {
        #[derive(serde::Deserialize)]
        struct Report {
            age: i64,
            #[serde(default)]
            time: Option<i64>,
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
            age_us: r.age,
            time_s: r.time,
        })
    }
}

/// A client whose statistics [`note_stats`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Client {
    /// The source consumer.
    Source = 0,
    /// The output producer.
    Output = 1,
}

/// The reachability state (one per process: [`LINK`]).
pub(crate) struct Link {
    down: AtomicBool,
    /// How many times every broker went unreachable since the process started.
    outages: AtomicU64,
    /// Per [`Client`]: whether its last statistics report showed requests waiting and no
    /// receive for [`STALL_AFTER`].
    silent: [AtomicBool; 2],
    /// Per [`Client`]: stalled since two reports in a row were silent, until a report
    /// shows a receive less than [`STALL_AFTER`] old. One silent report is not enough: a
    /// client silent for a long while because it asked nothing (a producer without
    /// records) shows the same in a report taken while its next request waits for its
    /// answer.
    stalled: [AtomicBool; 2],
    /// Whether the last look found some client stalled (to log the changes once).
    reported: AtomicBool,
    /// Per [`Client`]: the generation of the newest live client of that kind; reports of
    /// older ones are ignored while it lives. 0: none registered, or the newest was
    /// released (then every live client of the kind counts, older ones included).
    newest: [AtomicU64; 2],
    /// The last generation handed out by [`Link::register`].
    generations: AtomicU64,
}

/// A client whose statistics reports count (see [`register`]); dropped with the client.
pub(crate) struct Registration {
    client: Client,
    generation: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        LINK.release(self.client, self.generation);
    }
}

/// This process's link to the cluster.
pub(crate) static LINK: Link = Link::new();

impl Link {
    /// Reachable until a client reports every broker down.
    pub(crate) const fn new() -> Link {
        Link {
            down: AtomicBool::new(false),
            outages: AtomicU64::new(0),
            silent: [AtomicBool::new(false), AtomicBool::new(false)],
            stalled: [AtomicBool::new(false), AtomicBool::new(false)],
            reported: AtomicBool::new(false),
            newest: [AtomicU64::new(0), AtomicU64::new(0)],
            generations: AtomicU64::new(0),
        }
    }

    /// A new client of kind `client`: its generation, from now on the only one whose
    /// reports count for that kind until it is released.
    pub(crate) fn register(&self, client: Client) -> u64 {
        let generation = self.generations.fetch_add(1, Ordering::SeqCst) + 1;
        self.newest[client as usize].fetch_max(generation, Ordering::SeqCst);
        generation
    }

    /// The client of `generation` is gone: if it was the newest of its kind, the reports
    /// of any client of that kind count again (an older one still alive).
    pub(crate) fn release(&self, client: Client, generation: u64) {
        let _ = self.newest[client as usize].compare_exchange(
            generation,
            0,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    /// As [`Link::note_stats_view`], for a report read at `now_s` (wall-clock seconds): one
    /// taken more than [`STALE_REPORT_S`] before is ignored.
    pub(crate) fn note_stats_read(
        &self,
        client: Client,
        generation: u64,
        view: StatsView,
        now_s: i64,
    ) {
        if view.time_s.is_some_and(|t| now_s - t > STALE_REPORT_S) {
            return;
        }
        self.note_stats_view(client, generation, view);
    }

    /// Whether a client of kind `client` newer than `generation` lives: what the client of
    /// `generation` reports is then ignored.
    fn superseded(&self, client: Client, generation: u64) -> bool {
        generation < self.newest[client as usize].load(Ordering::SeqCst)
    }

    /// As [`note_stats`], from the report read, of the client of `generation`. A report of
    /// a client older than the newest live one of its kind is ignored; a newer client takes
    /// over its kind's state as it stands (a stall goes on until the new client hears
    /// from a broker).
    pub(crate) fn note_stats_view(&self, client: Client, generation: u64, view: StatsView) {
        if self.superseded(client, generation) {
            return;
        }
        let silent = view.waiting && view.unheard_us() >= STALL_AFTER.as_micros() as i64;
        let before = self.silent[client as usize].swap(silent, Ordering::SeqCst);
        // A stall ends with a receive less than STALL_AFTER old, not with a report that
        // shows none: past `socket.timeout.ms` librdkafka drops the connection and
        // connects again to the still frozen broker, whose report then reads "nothing
        // received yet" (rxidle -1) with only the ApiVersion request waiting.
        let fresh = view
            .rx_idle_us
            .is_some_and(|us| us < STALL_AFTER.as_micros() as i64);
        let was = self.stalled[client as usize].load(Ordering::SeqCst);
        let stalled = if was { !fresh } else { silent && before };
        self.stalled[client as usize].store(stalled, Ordering::SeqCst);
        let any = self.stalled();
        if any != self.reported.swap(any, Ordering::SeqCst) {
            if any {
                tracing::warn!(
                    client = ?client,
                    silent_ms = view.unheard_us() / 1000,
                    "requests are waiting and no broker has answered for {} s: not ready until one does",
                    STALL_AFTER.as_secs()
                );
            } else {
                tracing::info!("a broker answers again: ready once the partitions are");
            }
        }
    }

    /// Whether some client is stalled (see [`Link::note_stats_view`]).
    pub(crate) fn stalled(&self) -> bool {
        self.stalled.iter().any(|s| s.load(Ordering::SeqCst))
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

    /// As [`Link::note_error`], from the client of `generation`: ignored when a newer
    /// client of its kind lives (see [`note_error`]).
    pub(crate) fn note_error_of(&self, client: Client, generation: u64, error: &KafkaError) {
        if self.superseded(client, generation) {
            return;
        }
        self.note_error(error);
    }

    /// As [`note_up`].
    pub(crate) fn note_up(&self) {
        if self.down.swap(false, Ordering::SeqCst) {
            tracing::info!("a broker answers again: ready once the partitions are");
        }
    }

    /// As [`reachable`].
    pub(crate) fn reachable(&self) -> bool {
        !self.is_down() && !self.stalled()
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

/// Take note of an error of the client registered as `who`: `AllBrokersDown` marks the
/// cluster unreachable, unless a newer client of that kind lives (a producer left behind
/// by a re-creation, stuck in a librdkafka call, whose idle connections the broker closed,
/// must not mark the cluster down nor count as an outage in the new producer's
/// transaction).
pub(crate) fn note_error(who: &Registration, error: &KafkaError) {
    LINK.note_error_of(who.client, who.generation, error);
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

/// Register a new client of kind `client` (at its creation; its context keeps the
/// registration): from now on only its statistics reports count for that kind, until the
/// registration is dropped.
pub(crate) fn register(client: Client) -> Registration {
    Registration {
        client,
        generation: LINK.register(client),
    }
}

/// A statistics report of the client registered as `who` (librdkafka's JSON, every
/// [`STATS_INTERVAL_MS`]): the stall check's input. A report that does not parse is
/// ignored.
pub(crate) fn note_stats(who: &Registration, json: &[u8]) {
    if let Some(view) = StatsView::parse(json) {
        let now_s = crate::tools::now_ms() / 1000;
        LINK.note_stats_read(who.client, who.generation, view, now_s);
    }
}

/// Whether the cluster is reachable: no client has reported every broker down since a
/// broker last answered, and neither the source consumer's nor the output producer's
/// requests are stalled (see the module doc).
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

    fn stats(waiting: bool, rx_idle_us: Option<i64>, age_us: i64) -> StatsView {
        StatsView {
            waiting,
            rx_idle_us,
            age_us,
            time_s: None,
        }
    }

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
        serde_json::to_vec(
            &serde_json::json!({"name": "c", "type": "consumer", "age": 600_000_000, "time": 1_796_000_000, "brokers": b}),
        )
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
                rx_idle_us: Some(40_000),
                age_us: 600_000_000,
                time_s: Some(1_796_000_000),
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
        use std::time::Instant;
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
        let now_s = crate::tools::now_ms() / 1000;
        let taken = view.and_then(|v| v.time_s);
        assert!(
            taken.is_some_and(|t| (now_s - t).abs() <= 2),
            "the report's time is not the wall clock: {taken:?}, now {now_s}"
        );
        assert!(text.contains("\"127.0.0.1:1/bootstrap\""), "{text}");
    }

    /// A broker that accepts connections but answers nothing (frozen): a client's requests
    /// wait and nothing arrives for STALL_AFTER, then the cluster is unreachable until a
    /// reply; either client's report tells.
    #[test]
    fn waiting_requests_without_a_reply_for_the_stall_time_make_the_cluster_unreachable() {
        let link = Link::new();
        let stall_us = STALL_AFTER.as_micros() as i64;
        let view = |waiting, idle_us| stats(waiting, Some(idle_us), 600_000_000);
        // A reply 200 ms ago, a fetch out: live.
        link.note_stats_view(Client::Source, 0, view(true, 200_000));
        assert!(link.reachable());
        // Silent but nothing asked (an idle producer): not a stall.
        link.note_stats_view(Client::Output, 0, view(false, stall_us * 2));
        assert!(link.reachable());
        // Asked and silent just short of the stall time: still live.
        link.note_stats_view(Client::Output, 0, view(true, stall_us - 1));
        assert!(link.reachable());
        // One report with a request out after a long silence: the request may be a second
        // old (a producer that had nothing to send); not yet.
        link.note_stats_view(Client::Output, 0, view(true, stall_us));
        assert!(link.reachable());
        // The next report still without a reply: stalled (the run loop, waiting for the
        // acknowledgements, serves no consumer report meanwhile).
        link.note_stats_view(Client::Output, 0, view(true, stall_us + 1_000_000));
        assert!(!link.reachable());
        assert!(
            !link.is_down(),
            "a stall is not an outage of every connection"
        );
        // The consumer's report does not clear the producer's stall...
        link.note_stats_view(Client::Source, 0, view(true, 1_000));
        assert!(!link.reachable());
        // ...the producer's next one does, once a reply came.
        link.note_stats_view(Client::Output, 0, view(true, 5_000));
        assert!(link.reachable());
        // A client that has heard nothing yet but is younger than the stall time: not
        // silent.
        let young = stats(true, None, 1_000_000);
        link.note_stats_view(Client::Source, 0, young);
        link.note_stats_view(Client::Source, 0, young);
        assert!(link.reachable());
    }

    /// Reports taken during a freeze and read after the thaw (queued behind a blocked run
    /// loop) are ignored: they would make the consumer read as stalled after a broker
    /// answered again.
    #[test]
    fn reports_read_long_after_they_were_taken_are_ignored() {
        let link = Link::new();
        let stall_us = STALL_AFTER.as_micros() as i64;
        let now_s = 1_796_000_000;
        let taken = |at_s, idle_us| StatsView {
            time_s: Some(at_s),
            ..stats(true, Some(idle_us), 600_000_000)
        };
        // Read after a 75 s block: reports taken during the freeze.
        link.note_stats_read(Client::Source, 0, taken(now_s - 40, stall_us + 1), now_s);
        link.note_stats_read(Client::Source, 0, taken(now_s - 39, stall_us + 2), now_s);
        assert!(link.reachable(), "old reports of silence are ignored");
        // Fresh ones of silence still count.
        link.note_stats_read(Client::Source, 0, taken(now_s - 1, stall_us + 1), now_s);
        link.note_stats_read(Client::Source, 0, taken(now_s, stall_us + 2), now_s);
        assert!(!link.reachable(), "recent reports of silence make a stall");
        // A report without a time is not judged stale.
        let untimed = stats(true, Some(1_000), 600_000_000);
        link.note_stats_read(Client::Source, 0, untimed, now_s);
        assert!(link.reachable());
    }

    /// A client that has heard nothing on its connections (created while the broker was
    /// already frozen: it connected, its ApiVersion request waits) is silent once it is
    /// older than the stall time.
    #[test]
    fn a_client_that_never_heard_a_broker_stalls_once_older_than_the_stall_time() {
        let link = Link::new();
        let stall_us = STALL_AFTER.as_micros() as i64;
        let unheard = |age_us| stats(true, None, age_us);
        link.note_stats_view(Client::Output, 0, unheard(stall_us - 2_000_000));
        link.note_stats_view(Client::Output, 0, unheard(stall_us - 1_000_000));
        assert!(link.reachable(), "younger than the stall time");
        link.note_stats_view(Client::Output, 0, unheard(stall_us));
        link.note_stats_view(Client::Output, 0, unheard(stall_us + 1_000_000));
        assert!(!link.reachable(), "waited the stall time, heard nothing");
        // Nothing waiting, nothing heard (between reconnects): still stalled.
        link.note_stats_view(
            Client::Output,
            0,
            StatsView {
                waiting: false,
                ..unheard(stall_us + 2_000_000)
            },
        );
        assert!(!link.reachable());
        link.note_stats_view(
            Client::Output,
            0,
            StatsView {
                rx_idle_us: Some(2_000),
                ..unheard(stall_us + 3_000_000)
            },
        );
        assert!(link.reachable(), "a reply came");
    }

    /// A transactional producer re-created while the brokers do not answer: the old one
    /// reports beside the new one until it goes. Only the newest client of a kind counts,
    /// so the two cannot take turns in one verdict; once the newest goes, an older one
    /// still alive counts again.
    #[test]
    fn only_the_newest_live_client_of_a_kind_counts() {
        let link = Link::new();
        let stall_us = STALL_AFTER.as_micros() as i64;
        let silent = |idle_us| stats(true, Some(idle_us), 600_000_000);
        let old = link.register(Client::Output);
        link.note_stats_view(Client::Output, old, silent(stall_us));
        link.note_stats_view(Client::Output, old, silent(stall_us + 1_000_000));
        assert!(!link.reachable(), "the old producer stalled");
        let new = link.register(Client::Output);
        assert!(new > old);
        // The old producer still has a live connection to some other broker: its report
        // shows a fresh receive, but it no longer counts.
        link.note_stats_view(Client::Output, old, silent(1_000));
        assert!(
            !link.reachable(),
            "an older client's report must not end the stall"
        );
        // The new producer, connected to the frozen broker, heard nothing: still stalled
        // (it takes the state over as it stands).
        let unheard = stats(true, None, 2_000_000);
        link.note_stats_view(Client::Output, new, unheard);
        assert!(!link.reachable());
        // The source consumer's registration is another kind: it does not hide the
        // producer's reports.
        let source = link.register(Client::Source);
        link.note_stats_view(Client::Output, new, unheard);
        assert!(!link.reachable());
        link.release(Client::Source, source);
        // The new producer hears from a broker: reachable; the old one's silence is
        // ignored.
        link.note_stats_view(Client::Output, new, silent(3_000));
        assert!(link.reachable());
        link.note_stats_view(Client::Output, old, silent(stall_us + 5_000_000));
        link.note_stats_view(Client::Output, old, silent(stall_us + 6_000_000));
        assert!(link.reachable(), "the old producer's reports are ignored");
        // The new one goes first (its creation failed): the old one counts again.
        link.release(Client::Output, new);
        link.note_stats_view(Client::Output, old, silent(stall_us + 7_000_000));
        link.note_stats_view(Client::Output, old, silent(stall_us + 8_000_000));
        assert!(!link.reachable(), "the old producer is the one alive");
    }

    /// A freeze longer than a request timeout (the producer's `request.timeout.ms`, 30 s;
    /// the consumer's `socket.timeout.ms`, 60 s): librdkafka tears the connection down as a
    /// *planned* failure (`rd_kafka_broker_planned_fail`: no `AllBrokersDown`), zeroes the
    /// broker's `ts_recv` and reconnects; the frozen broker's listener still accepts, so the
    /// client sits in `APIVERSION_QUERY` with the ApiVersion request waiting and `rxidle`
    /// -1 ("no receive yet" on this connection), then times that out too and again. The
    /// broker still answers nothing: the cluster must stay unreachable.
    #[test]
    fn a_freeze_past_the_request_timeout_stays_unreachable_after_the_reconnect() {
        let link = Link::new();
        let stall_us = STALL_AFTER.as_micros() as i64;
        let frozen = |idle_us| {
            report(&[
                ("127.0.0.1:39292/bootstrap", 0, -1),
                ("localhost:39292/1", 1, idle_us),
            ])
        };
        link.note_stats_view(
            Client::Output,
            0,
            StatsView::parse(&frozen(stall_us)).unwrap(),
        );
        link.note_stats_view(
            Client::Output,
            0,
            StatsView::parse(&frozen(stall_us + 1_000_000)).unwrap(),
        );
        assert!(!link.reachable(), "frozen for 16 s");
        // 30 s in: the produce request timed out, the connection was torn down and made
        // again to the still frozen broker; the ApiVersion request waits, nothing arrived.
        let reconnected = report(&[
            ("127.0.0.1:39292/bootstrap", 0, -1),
            ("localhost:39292/1", 1, -1),
        ]);
        for _ in 0..3 {
            link.note_stats_view(Client::Output, 0, StatsView::parse(&reconnected).unwrap());
            assert!(
                !link.reachable(),
                "the broker is still frozen (reconnected, nothing received)"
            );
        }
        // Between attempts (reconnect backoff): nothing waits, nothing received.
        let between = report(&[
            ("127.0.0.1:39292/bootstrap", 0, -1),
            ("localhost:39292/1", 0, -1),
        ]);
        link.note_stats_view(Client::Output, 0, StatsView::parse(&between).unwrap());
        assert!(
            !link.reachable(),
            "the broker is still frozen (between attempts)"
        );
        // Thawed: a reply.
        link.note_stats_view(Client::Output, 0, StatsView::parse(&frozen(3_000)).unwrap());
        assert!(link.reachable());
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

    /// A producer left behind by a re-creation (stuck in a librdkafka call) whose
    /// connections go down must not mark the cluster unreachable, nor count as an outage
    /// (which would turn a real fencing of the new producer into an unknown outcome).
    #[test]
    fn an_older_clients_all_brokers_down_is_ignored_while_a_newer_one_lives() {
        let link = Link::new();
        let down = KafkaError::Global(RDKafkaErrorCode::AllBrokersDown);
        let old = link.register(Client::Output);
        let new = link.register(Client::Output);
        link.note_error_of(Client::Output, old, &down);
        assert!(link.reachable());
        assert_eq!(link.outages(), 0);
        // The source consumer's generation is older, but it is another kind: it counts.
        let source = link.register(Client::Source);
        link.note_error_of(Client::Source, source, &down);
        assert!(!link.reachable());
        assert_eq!(link.outages(), 1);
        link.note_up();
        link.note_error_of(Client::Output, new, &down);
        assert!(!link.reachable(), "the newest producer counts");
        assert_eq!(link.outages(), 2);
    }
}
