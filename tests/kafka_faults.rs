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
use fault_proxy::{api, KafkaProxy, ProxiedBroker};
use onceflow::config::Config;
use onceflow::kafka::admin::Admin;
use onceflow::testing::{gharchive, kafka};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(240);
/// The dedicated broker's ports: client 39260, controller 39261, inter-broker 39262.
const BASE_PORT: u16 = 39260;

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

/// One scenario's outcome.
struct Outcome {
    fault: &'static str,
    runs: usize,
    duplicates: usize,
    losses: usize,
    restarts: usize,
    /// The log of every run, shown when the outcome is wrong.
    log: String,
}

/// Run the main job under exactly_once_v2 through the proxy; `inject` is called once the job
/// has committed a few transactions and sets up the fault. A run that exits non-zero is
/// restarted (at most twice).
fn eos_scenario(
    broker: &ProxiedBroker,
    fault: &'static str,
    sets: &[(&str, String)],
    inject: impl Fn(&KafkaProxy),
) -> Option<Outcome> {
    // FAULT_SCENARIOS=<substring>: run only the scenarios whose name contains it;
    // FAULT_RUNS=<n>: runs of each (default 1).
    if let Ok(only) = std::env::var("FAULT_SCENARIOS") {
        if !fault.contains(only.as_str()) {
            return None;
        }
    }
    let runs: usize = std::env::var("FAULT_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut total = eos_run(broker, fault, sets, &inject);
    for _ in 1..runs {
        let o = eos_run(broker, fault, sets, &inject);
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

/// One run of [`eos_scenario`].
fn eos_run(
    broker: &ProxiedBroker,
    fault: &'static str,
    sets: &[(&str, String)],
    inject: &impl Fn(&KafkaProxy),
) -> Outcome {
    let boot = broker.bootstrap();
    let names = gharchive_names_on(&boot, 4);
    let p = kafka::TestProducer::new(&boot).unwrap();
    let rep = gharchive::publish(&p, &names.input, 2000, 11).unwrap();
    p.flush().unwrap();
    let mut all: Vec<(&str, String)> = vec![
        ("bootstrap.servers", boot.clone()),
        ("processing.guarantee", "exactly_once_v2".into()),
        ("commit.interval.ms", "100".into()),
    ];
    all.extend(sets.iter().cloned());

    let proxy = &broker.proxy;
    let before = proxy.requests(api::END_TXN);
    let mut run = start(&names, &all, &[], &["--stop-at-end"]);
    wait_until("three transactions", T, || {
        proxy.requests(api::END_TXN) >= before + 3
    });
    inject(proxy);
    let mut restarts = 0;
    let mut log = String::new();
    let mut stderr = run.stderr.clone();
    let (mut st, _) = run.wait(T);
    while !st.success() && restarts < 2 {
        log.push_str(&stderr.lock().unwrap());
        eprintln!("{fault}: onceflow exited {st:?}; restarting");
        restarts += 1;
        run = start(&names, &all, &[], &["--stop-at-end"]);
        stderr = run.stderr.clone();
        (st, _) = run.wait(T);
    }
    log.push_str(&stderr.lock().unwrap());
    assert!(proxy.rules_used_up(), "{fault}: the fault never fired");
    proxy.clear();
    assert!(
        st.success(),
        "{fault}: the job did not complete after {restarts} restarts"
    );

    let counts = output_counts(&boot, &names.output);
    let ids = gharchive_distinct_ids();
    assert_eq!(ids.len(), rep.distinct);
    let duplicates: usize = counts.values().map(|n| n - 1).sum();
    let losses = ids.iter().filter(|id| !counts.contains_key(*id)).count();
    Outcome {
        fault,
        runs: 1,
        duplicates,
        losses,
        restarts,
        log,
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
    let broker = ProxiedBroker::start(BASE_PORT + 5);
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
    let broker = ProxiedBroker::start(BASE_PORT);
    let tx_timeout = ("kafka.producer.transaction.timeout.ms", "10000".to_string());
    let mut table: Vec<Option<Outcome>> = Vec::new();
    table.push(eos_scenario(&broker, "EndTxn response dropped", &[], |p| {
        p.drop_next(api::END_TXN, 1)
    }));
    table.push(eos_scenario(
        &broker,
        "TxnOffsetCommit response dropped",
        &[],
        |p| p.drop_next(api::TXN_OFFSET_COMMIT, 1),
    ));
    table.push(eos_scenario(
        &broker,
        "EndTxn delayed past the transaction timeout",
        std::slice::from_ref(&tx_timeout),
        |p| p.delay_next(api::END_TXN, 1, Duration::from_secs(15)),
    ));
    table.push(eos_scenario(
        &broker,
        "Produce delayed past delivery.timeout.ms",
        &[
            tx_timeout.clone(),
            ("kafka.producer.delivery.timeout.ms", "5000".to_string()),
        ],
        |p| p.delay_next(api::PRODUCE, 1, Duration::from_secs(8)),
    ));
    table.push(eos_scenario(
        &broker,
        "all connections cut for 10 s",
        &[],
        |p| p.cut_for(Duration::from_secs(10)),
    ));
    let table: Vec<Outcome> = table.into_iter().flatten().collect();
    for o in &table {
        eprintln!(
            "fault: {:<45} runs {} duplicates {} losses {} restarts {}",
            o.fault, o.runs, o.duplicates, o.losses, o.restarts
        );
    }
    for o in &table {
        if (o.duplicates, o.losses) != (0, 0) {
            eprintln!("--- log of {}:\n{}", o.fault, o.log);
        }
    }
    for o in &table {
        assert_eq!((o.duplicates, o.losses), (0, 0), "{}", o.fault);
    }
}
