//! The main job's real input and its check: two GH Archive hours into Kafka, with the
//! duplicates of real delivery faults, and a read_committed count of the deduplicated output.
//!
//! Delivery guarantee shown: the topology (`topologies/gharchive-dedup.yaml`) runs
//! at_least_once; the check proves each event id appears once in `gharchive.unique`.
//!
//! ```text
//! cargo run --release -p onceflow-testkit --example gharchive -- load   # create topics, publish with duplicates
//! cargo run --release -p onceflow-testkit --example gharchive -- check  # count gharchive.unique, exit 1 if wrong
//! cargo run --release -p onceflow-testkit --example gharchive -- reset  # delete the demo topics and consumer group
//! ```
//! The broker address comes from ONCEFLOW_BOOTSTRAP_SERVERS (default 127.0.0.1:9092).

use onceflow::Config;
use onceflow_testkit::kafka::Admin;
use onceflow_testkit::{gharchive, kafka};
use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Duration;

const EVENTS: &str = "gharchive.events";
const UNIQUE: &str = "gharchive.unique";
const PARTITIONS: usize = 4;

fn admin(bootstrap: &str) -> onceflow::Result<Admin> {
    let cfg = Config::load(&[], &[("bootstrap.servers".into(), bootstrap.into())])?;
    Admin::new(&cfg)
}

fn load(bootstrap: &str, dlq: &str) -> onceflow::Result<()> {
    let a = admin(bootstrap)?;
    // Timestamps are from 2015: never delete by time or size, whatever the broker default.
    let keep = [("retention.ms", "-1"), ("retention.bytes", "-1")];
    for t in [EVENTS, UNIQUE, dlq] {
        a.ensure_topic(t, PARTITIONS, &keep)?;
    }
    let p = kafka::TestProducer::new(bootstrap)?;
    let started = std::time::Instant::now();
    let r = gharchive::publish(&p, EVENTS, 2000, 42)?;
    println!(
        "loaded: events_in={} distinct={} relay_repeats={} retry_repeats={} topic={EVENTS} seconds={:.2}",
        r.published,
        r.distinct,
        r.relay_repeats,
        r.retry_repeats,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Delete the demo topics and the consumer group, so the next load starts from nothing.
fn reset(bootstrap: &str, dlq: &str, group: &str) -> onceflow::Result<()> {
    let a = admin(bootstrap)?;
    let changelog = onceflow::__testkit::changelog_topic(group, "dedup");
    let mut topics = Vec::new();
    for t in [EVENTS, UNIQUE, dlq, changelog.as_str()] {
        if a.partition_count(t)?.is_some() {
            topics.push(t);
        }
    }
    if !topics.is_empty() {
        a.delete_topics(&topics)?;
    }
    kafka::delete_group(bootstrap, group)?;
    // Topic deletion is asynchronous: wait until the broker no longer lists them.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for t in &topics {
        while a.partition_count(t)?.is_some() {
            if std::time::Instant::now() > deadline {
                return Err(onceflow::Error::Broker(format!(
                    "topic {t} still exists after delete"
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    if topics.is_empty() {
        println!("reset: no demo topics to delete; group {group} deleted if it existed");
    } else {
        println!(
            "reset: deleted {}; group {group} deleted if it existed",
            topics.join(", ")
        );
    }
    Ok(())
}

fn check(bootstrap: &str) -> onceflow::Result<bool> {
    let mut distinct = std::collections::HashSet::new();
    for f in gharchive::hour_files() {
        for e in gharchive::read_hour(&f)? {
            distinct.insert(e.id);
        }
    }
    let out = kafka::read_topic(bootstrap, UNIQUE, true, Duration::from_secs(120))?;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for r in &out {
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap_or_default())
            .unwrap_or(serde_json::Value::Null);
        let id = v["id"].as_str().unwrap_or("<no id>").to_string();
        *seen.entry(id).or_default() += 1;
    }
    let twice = seen.values().filter(|n| **n > 1).count();
    let missing = distinct.iter().filter(|id| !seen.contains_key(*id)).count();
    println!(
        "checked: unique_out={} distinct_ids_out={} expected={} missing={} repeated={}",
        out.len(),
        seen.len(),
        distinct.len(),
        missing,
        twice
    );
    Ok(out.len() == distinct.len() && missing == 0 && twice == 0)
}

fn main() -> ExitCode {
    // Retries of transient broker errors (a just-started broker) show on stderr, filtered
    // by ONCEFLOW_LOG (default info) as onceflow's own logs.
    let filter = tracing_subscriber::EnvFilter::try_from_env("ONCEFLOW_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let bootstrap = kafka::bootstrap_servers();
    let dlq = std::env::var("GHARCHIVE_DLQ").unwrap_or_else(|_| "gharchive-dedup.dlq".into());
    let res = match std::env::args().nth(1).as_deref() {
        Some("load") => load(&bootstrap, &dlq).map(|_| true),
        Some("check") => check(&bootstrap),
        Some("reset") => reset(&bootstrap, &dlq, "gharchive-dedup").map(|_| true),
        _ => {
            eprintln!("usage: gharchive load|check|reset");
            return ExitCode::from(2);
        }
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gharchive: {e}");
            ExitCode::from(1)
        }
    }
}
