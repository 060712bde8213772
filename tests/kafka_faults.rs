//! Faults of the broker and the network, under exactly_once_v2, through a Kafka-protocol
//! fault proxy (tests/fault_proxy) in front of a dedicated broker: responses dropped or
//! delayed by API, all connections cut. Each scenario runs the main job on the real GH
//! Archive data with its delivery-fault duplicates and checks, read_committed, that every
//! distinct id is in the output exactly once.
//!
//! librdkafka does not implement KIP-890: a transaction call whose outcome is unknown (the
//! EndTxn response lost) must not be retried blindly; onceflow must end with every id once
//! whatever it does (go on, or exit non-zero so that a restart completes the work).

mod common;
mod fault_proxy;

use common::*;
use fault_proxy::{api, ProxiedBroker};
use onceflow::Config;
use onceflow_testkit::kafka::Admin;
use onceflow_testkit::{gharchive, kafka};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(240);
/// The dedicated brokers' first port (client, controller, inter-broker of the first test;
/// the others at +5 and +10): 29260 (below Linux's ephemeral range, where a client's
/// outgoing connection could hold the port), or `FAULT_BASE_PORT` to keep parallel runs apart.
fn base_port() -> u16 {
    std::env::var("FAULT_BASE_PORT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(29260)
}

fn admin(bootstrap: &str) -> Admin {
    let cfg = Config::load(&[], &[("bootstrap.servers".into(), bootstrap.into())]).unwrap();
    Admin::new(&cfg).unwrap()
}

/// Output ids with their counts, read_committed.
fn output_counts(bootstrap: &str, topic: &str) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in kafka::read_topic(bootstrap, topic, true, T).unwrap() {
        *m.entry(json_id(r.value.as_deref())).or_default() += 1;
    }
    m
}

/// Wait until `f` holds, or panic with `what` after `timeout`.
fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One scenario's outcome, summed over its runs.
struct Outcome {
    fault: &'static str,
    guarantee: &'static str,
    runs: usize,
    duplicates: usize,
    losses: usize,
    restarts: usize,
    /// The log of a run whose outcome was wrong (or of the last run).
    log: String,
}

/// What a fault is injected into: the broker and the running instance's HTTP listener.
struct Target<'a> {
    broker: &'a ProxiedBroker,
    /// `host:port` of the instance's `/health`, `/ready` and `/metrics`.
    http: String,
    /// The instance's log so far.
    log: std::sync::Arc<std::sync::Mutex<String>>,
    /// The instance's process id.
    pid: u32,
    /// The scenario requires the process to ride the fault out (see [`Scenario::stays_up`]).
    stays_up: bool,
}

impl Target<'_> {
    /// The status code of `GET /ready`; `None` when the listener does not answer (the
    /// process is gone).
    fn ready(&self) -> Option<u16> {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&self.http).ok()?;
        c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        c.write_all(b"GET /ready HTTP/1.0\r\nHost: x\r\n\r\n")
            .ok()?;
        let mut answer = String::new();
        c.read_to_string(&mut answer).ok()?;
        answer.split_whitespace().nth(1)?.parse().ok()
    }
}

/// The listener's address from the `http listening` log line (tests use port 0).
fn http_address(run: &mut Running) -> String {
    run.wait_for_log("http listening", T);
    let log = run.stderr.lock().unwrap().clone();
    let line = log.lines().find(|l| l.contains("http listening")).unwrap();
    let at = line.find("address=").expect("address field") + "address=".len();
    line[at..]
        .split(|c: char| c.is_whitespace() || c == '"' || c == ',')
        .find(|s| !s.is_empty())
        .unwrap()
        .to_string()
}

/// Injects a fault into a [`Target`]; `Err` names what went wrong meanwhile.
type Inject = dyn Fn(&Target) -> Result<(), String>;

/// A fault scenario: the main job runs through the proxy under `guarantee`, slowed down
/// (every Fetch response held 50 ms, small fetches) so that it is mid-run for several
/// seconds; `inject` is called once it has committed once. A run that exits non-zero is
/// restarted (at most twice; counted), unless the scenario must be ridden out in one
/// process (`stays_up`): then a restart fails the test.
struct Scenario {
    fault: &'static str,
    guarantee: &'static str,
    sets: Vec<(&'static str, String)>,
    /// Injects the fault; an `Err` is a wrong observation during it (the test fails with
    /// the instance's log).
    inject: Box<Inject>,
    stays_up: bool,
}

impl Scenario {
    fn new(
        fault: &'static str,
        guarantee: &'static str,
        inject: impl Fn(&ProxiedBroker) + 'static,
    ) -> Scenario {
        Scenario::on_target(fault, guarantee, move |t| {
            inject(t.broker);
            Ok(())
        })
    }

    fn on_target(
        fault: &'static str,
        guarantee: &'static str,
        inject: impl Fn(&Target) -> Result<(), String> + 'static,
    ) -> Scenario {
        Scenario {
            fault,
            guarantee,
            sets: Vec::new(),
            inject: Box::new(inject),
            stays_up: false,
        }
    }

    /// The process must ride the fault out: no exit, no restart.
    fn stays_up(mut self) -> Scenario {
        self.stays_up = true;
        self
    }

    fn set(mut self, k: &'static str, v: &str) -> Scenario {
        self.sets.push((k, v.to_string()));
        self
    }

    /// `FAULT_SCENARIOS=<substring>` runs only the scenarios whose `<name> (<guarantee>)`
    /// contains it;
    /// `FAULT_RUNS=<n>` runs each n times (default 1); `FAULT_SHOW_LOGS=1` prints each
    /// run's log.
    fn run(&self, broker: &ProxiedBroker) -> Option<Outcome> {
        if let Ok(only) = std::env::var("FAULT_SCENARIOS") {
            let name = format!("{} ({})", self.fault, self.guarantee);
            if !name.contains(only.as_str()) {
                return None;
            }
        }
        let runs: usize = std::env::var("FAULT_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let mut total = self.run_once(broker);
        for _ in 1..runs {
            let o = self.run_once(broker);
            total.runs += 1;
            total.duplicates += o.duplicates;
            total.losses += o.losses;
            total.restarts += o.restarts;
            if o.duplicates + o.losses > 0 {
                total.log = o.log;
            }
        }
        Some(total)
    }

    fn run_once(&self, broker: &ProxiedBroker) -> Outcome {
        let boot = broker.bootstrap();
        let names = gharchive_names_on(&boot, 4);
        let p = kafka::TestProducer::new(&boot).unwrap();
        let rep = gharchive::publish(&p, &names.input, 2000, 11).unwrap();
        p.flush().unwrap();
        drop(p);
        let mut all: Vec<(&str, String)> = vec![
            ("bootstrap.servers", boot.clone()),
            ("processing.guarantee", self.guarantee.into()),
            ("kafka.consumer.max.partition.fetch.bytes", "16384".into()),
        ];
        all.extend(self.sets.iter().cloned());

        let proxy = &broker.proxy;
        let commits = || proxy.requests(api::END_TXN) + proxy.requests(api::OFFSET_COMMIT);
        let before = commits();
        proxy.delay_all(api::FETCH, Duration::from_millis(50));
        let mut run = start(&names, &all, &[], &["--stop-at-end"]);
        let http = http_address(&mut run);
        wait_until("a first commit", T, || commits() > before);
        assert!(
            run.child.try_wait().unwrap().is_none(),
            "{}: the job ended before the fault",
            self.fault
        );
        let injected = (self.inject)(&Target {
            broker,
            http,
            log: run.stderr.clone(),
            pid: run.child.id(),
            stays_up: self.stays_up,
        });
        let mut restarts = 0;
        let mut log = String::new();
        let mut stderr = run.stderr.clone();
        let (mut st, _) = run.wait(T);
        while !st.success() && restarts < 2 {
            log.push_str(&stderr.lock().unwrap());
            eprintln!("{}: onceflow exited {st:?}; restarting", self.fault);
            restarts += 1;
            run = start(&names, &all, &[], &["--stop-at-end"]);
            stderr = run.stderr.clone();
            (st, _) = run.wait(T);
        }
        log.push_str(&stderr.lock().unwrap());
        if let Err(wrong) = injected {
            panic!("{} ({}): {wrong}\n{log}", self.fault, self.guarantee);
        }
        let fired = proxy.rules_used_up();
        proxy.clear();
        assert!(fired, "{}: the fault never fired", self.fault);
        assert!(
            st.success(),
            "{}: the job did not complete after {restarts} restarts:\n{log}",
            self.fault
        );
        assert!(
            !self.stays_up || restarts == 0,
            "{} ({}): the process exited instead of riding the fault out:\n{log}",
            self.fault,
            self.guarantee
        );

        let counts = output_counts(&boot, &names.output);
        let ids = gharchive_distinct_ids();
        assert_eq!(ids.len(), rep.distinct);
        let duplicates: usize = counts.values().map(|n| n - 1).sum();
        let losses = ids.iter().filter(|id| !counts.contains_key(*id)).count();
        // `FAULT_SHOW_LOGS=1`: every run's log, also when it went right (to see how the
        // instance rode the fault out).
        if std::env::var("FAULT_SHOW_LOGS").is_ok_and(|v| v == "1") {
            eprintln!("--- log of {} ({}):\n{log}", self.fault, self.guarantee);
        }
        // One row per run, as soon as it is known: scripts/fault-matrix sums these, so a
        // later run that fails does not take the earlier ones with it.
        eprintln!(
            "fault: {:<48} {:<16} {:>4} {duplicates:>10} {losses:>6} {restarts:>8}",
            self.fault, self.guarantee, 1
        );
        Outcome {
            fault: self.fault,
            guarantee: self.guarantee,
            runs: 1,
            duplicates,
            losses,
            restarts,
            log,
        }
    }
}

/// Print the fault table; show the log of each wrong outcome.
fn report(table: &[Outcome]) {
    eprintln!(
        "{:<48} {:<16} {:>4} {:>10} {:>6} {:>8}",
        "fault", "guarantee", "runs", "duplicates", "losses", "restarts"
    );
    for o in table {
        eprintln!(
            "total: {:<48} {:<16} {:>4} {:>10} {:>6} {:>8}",
            o.fault, o.guarantee, o.runs, o.duplicates, o.losses, o.restarts
        );
    }
    for o in table {
        let wrong = o.losses > 0 || (o.guarantee == "exactly_once_v2" && o.duplicates > 0);
        if wrong {
            eprintln!("--- log of {} ({}):\n{}", o.fault, o.guarantee, o.log);
        }
    }
}

/// As `common::gharchive_names`, with the topics created on `bootstrap`.
fn gharchive_names_on(bootstrap: &str, partitions: usize) -> Names {
    let names = gharchive_names_no_topics();
    let a = admin(bootstrap);
    for t in [&names.input, &names.output, &names.dlq] {
        a.ensure_topic(
            t,
            partitions,
            &[("retention.ms", "-1"), ("retention.bytes", "-1")],
        )
        .unwrap();
    }
    names
}

#[test]
fn the_proxy_passes_traffic_and_counts_it_and_a_dropped_produce_response_is_retried_once() {
    let broker = ProxiedBroker::start(base_port() + 5);
    let boot = broker.bootstrap();
    let topic = unique("proxy");
    admin(&boot).ensure_topic(&topic, 2, &[]).unwrap();
    assert!(
        broker.proxy.requests(api::METADATA) > 0,
        "metadata went through the proxy"
    );

    let p = kafka::TestProducer::new(&boot).unwrap();
    for i in 0..50 {
        let v = format!("{{\"id\":\"r{i}\"}}");
        p.send(&topic, Some(i % 2), None, Some(v.as_bytes()), &[], None)
            .unwrap();
    }
    p.flush().unwrap();
    assert!(
        broker.proxy.requests(api::PRODUCE) > 0,
        "produce went through the proxy"
    );

    // The idempotent producer retries a produce whose response was lost; the broker drops
    // the retried batch as a duplicate: every record once.
    broker.proxy.drop_next(api::PRODUCE, 1);
    for i in 50..100 {
        let v = format!("{{\"id\":\"r{i}\"}}");
        p.send(&topic, Some(0), None, Some(v.as_bytes()), &[], None)
            .unwrap();
    }
    p.flush().unwrap();
    assert_eq!(broker.proxy.dropped(api::PRODUCE), 1);

    let counts = output_counts(&boot, &topic);
    assert_eq!(counts.len(), 100);
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
}

#[test]
fn exactly_once_v2_keeps_every_id_once_through_lost_and_late_responses() {
    let broker = ProxiedBroker::start(base_port());
    const EOS: &str = "exactly_once_v2";
    let scenarios = [
        Scenario::new("EndTxn response dropped", EOS, |b| {
            b.proxy.drop_after(api::END_TXN, 1)
        }),
        Scenario::new("TxnOffsetCommit response dropped", EOS, |b| {
            b.proxy.drop_after(api::TXN_OFFSET_COMMIT, 1)
        }),
        Scenario::new(
            "EndTxn answer delayed past the transaction timeout",
            EOS,
            |b| {
                b.proxy
                    .delay_after(api::END_TXN, 1, Duration::from_secs(15))
            },
        )
        .set("kafka.producer.transaction.timeout.ms", "10000"),
        // The coordinator aborts the transaction on its timeout before the commit arrives.
        Scenario::new(
            "EndTxn request delayed past the transaction timeout",
            EOS,
            |b| {
                b.proxy
                    .delay_request_after(api::END_TXN, 1, Duration::from_secs(15))
            },
        )
        .set("kafka.producer.transaction.timeout.ms", "10000"),
        Scenario::new("Produce delayed past delivery.timeout.ms", EOS, |b| {
            b.proxy.delay_after(api::PRODUCE, 1, Duration::from_secs(8))
        })
        .set("kafka.producer.transaction.timeout.ms", "10000")
        .set("kafka.producer.delivery.timeout.ms", "5000"),
        Scenario::new("all connections cut for 10 s", EOS, |b| {
            b.proxy.cut_for(Duration::from_secs(10))
        }),
    ];
    let table: Vec<Outcome> = scenarios.iter().filter_map(|s| s.run(&broker)).collect();
    report(&table);
    for o in &table {
        assert_eq!((o.duplicates, o.losses), (0, 0), "{}", o.fault);
    }
}

/// Take the broker away mid-run with `go`, for `away`, then bring it back with `back`.
/// `/ready` answers 200 before, 503 at some point while the broker is away (polled
/// through it), and 200 again once it is back (or the process has ended: after seeing the
/// broker back, or, where the scenario allows an exit, at all).
fn broker_away_for(
    away: Duration,
    go: fn(&ProxiedBroker),
    back: fn(&ProxiedBroker),
) -> impl Fn(&Target) -> Result<(), String> {
    move |t: &Target| {
        let before = t.ready();
        if before != Some(200) {
            return Err(format!("/ready before the broker went: {before:?}"));
        }
        go(t.broker);
        let back_at = Instant::now() + away;
        let mut answers = Vec::new();
        while Instant::now() < back_at {
            answers.push(t.ready());
            std::thread::sleep(Duration::from_millis(250));
        }
        back(t.broker);
        if !answers.contains(&Some(503)) {
            return Err(format!(
                "/ready never said not-ready while the broker was away: {answers:?}"
            ));
        }
        let deadline = Instant::now() + T;
        loop {
            match t.ready() {
                Some(200) => return Ok(()),
                // The job may have finished meanwhile: it must have seen the broker back.
                None if t.log.lock().unwrap().contains("a broker answers again") => return Ok(()),
                // A scenario that allows an exit (the records' delivery timed out before the
                // broker answered again, e.g. on a loaded machine): the restart must
                // complete the work, which the scenario checks.
                None if !t.stays_up && exited(t.pid) => return Ok(()),
                None => return Err("the process went away after the outage".into()),
                _ if Instant::now() > deadline => {
                    return Err(format!(
                        "/ready did not come back after the outage; {}",
                        thread_stacks(t.pid)
                    ))
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

/// Whether process `pid` (a child not yet waited for) has exited: it is gone or a zombie.
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which ends at the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// SIGKILL the broker mid-run and start it again after `down` (see [`broker_away_for`]).
fn broker_killed_for(down: Duration) -> impl Fn(&Target) -> Result<(), String> {
    broker_away_for(
        down,
        |b| b.kill(),
        |b| {
            b.kafka(&["start"]);
        },
    )
}

/// Freeze the broker (SIGSTOP) mid-run for `frozen`, then resume it (see
/// [`broker_away_for`]). Its listener still accepts connections and nothing answers, so
/// no client reports a broker down: `/ready` must say not-ready from the stalled requests
/// alone (kafka::link: two statistics reports showing no reply for 15 s).
fn broker_frozen_for(frozen: Duration) -> impl Fn(&Target) -> Result<(), String> {
    broker_away_for(
        frozen,
        |b| b.signal(libc::SIGSTOP),
        |b| b.signal(libc::SIGCONT),
    )
}

#[test]
fn a_broker_killed_and_restarted_mid_run_loses_nothing_and_repeats_nothing_under_eos() {
    let broker = ProxiedBroker::start(base_port() + 10);
    // The 60 s outages take minutes: scripts/fault-matrix runs them (FAULT_LONG=1), the
    // default test run only the 5 s ones.
    let long = std::env::var("FAULT_LONG").is_ok_and(|v| v == "1");
    let scenarios = [
        Scenario::on_target(
            "broker SIGKILLed, back after 5 s",
            "at_least_once",
            broker_killed_for(Duration::from_secs(5)),
        )
        .stays_up(),
        Scenario::on_target(
            "broker SIGKILLed, back after 5 s",
            "exactly_once_v2",
            broker_killed_for(Duration::from_secs(5)),
        )
        .stays_up(),
        // Not `stays_up`: in about one run in six here (until 2026-12-05; none in the 16
        // runs of that day), after the thaw librdkafka's producer no longer sends the
        // records of the partitions whose metadata showed no leader for a moment ("new
        // leader-1"; the controller fenced the broker whose session lapsed while it was
        // frozen), and the commit waits for them until their delivery times out
        // (`message.timeout.ms`, 300 s by default, 40 s here); the instance then stops
        // with the delivery error and the restart resumes from the last commit. Upstream
        // this looks like librdkafka issue #5430 (open), but the 2.12.1 source skips a
        // leader hint of -1 and keeps re-querying leaderless partitions every second, so
        // the hint alone does not explain it; more likely a broker hand-off or the
        // idempotent producer's wait for in-flight requests never ends (not yet confirmed
        // by a debug log). No client setting would help.
        Scenario::on_target(
            "broker frozen (SIGSTOP) for 22 s",
            "at_least_once",
            broker_frozen_for(Duration::from_secs(22)),
        )
        .set("kafka.producer.message.timeout.ms", "40000"),
        // A transaction in flight when the broker freezes: the commit waits, the
        // transactional producer may be re-created meanwhile (its reports and the old
        // one's must not take turns in the stall verdict).
        Scenario::on_target(
            "broker frozen (SIGSTOP) for 22 s",
            "exactly_once_v2",
            broker_frozen_for(Duration::from_secs(22)),
        ),
        Scenario::on_target(
            "broker SIGKILLed, back after 60 s",
            "at_least_once",
            broker_killed_for(Duration::from_secs(60)),
        )
        .stays_up(),
        Scenario::on_target(
            "broker SIGKILLed, back after 60 s",
            "exactly_once_v2",
            broker_killed_for(Duration::from_secs(60)),
        )
        .stays_up(),
    ];
    let table: Vec<Outcome> = scenarios
        .iter()
        .filter(|s| long || !s.fault.contains("60 s"))
        .filter_map(|s| s.run(&broker))
        .collect();
    report(&table);
    for o in &table {
        assert_eq!(o.losses, 0, "{} ({})", o.fault, o.guarantee);
        if o.guarantee == "exactly_once_v2" {
            assert_eq!(o.duplicates, 0, "{} ({})", o.fault, o.guarantee);
        }
    }
}
