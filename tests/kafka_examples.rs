//! The deployable example binaries run as processes against the real broker, their topics
//! named through their own `ONCEFLOW_EXAMPLE_*` variables (which onceflow's config loader
//! must not take for config keys), each until its input is exhausted.

mod common;

use common::*;
use onceflow_testkit::kafka;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

/// Build the three example binaries once (cargo's lock is free while tests run) and
/// return the directory holding them.
fn examples_dir() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let st = Command::new(env!("CARGO"))
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .args(["build", "--release", "--example", "analytics_dedup"])
                .args(["--example", "enrich_orders", "--example", "route_events"])
                .status()
                .unwrap();
            assert!(st.success(), "building the examples failed");
            let target = std::env::var("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
            target.join("release/examples")
        })
        .clone()
}

/// Run example `name` to the end of its input with `env` (its ONCEFLOW_EXAMPLE_* names);
/// returns stdout (the summary line).
fn run_example(name: &str, env: &[(&str, &str)]) -> String {
    let (out, so, se) = run_example_raw(name, env);
    assert!(
        out.status.success(),
        "{name} exited {}:\n{so}\n{se}",
        out.status
    );
    assert!(se.contains("http listening"), "{se}");
    so
}

/// Run example `name` as [`run_example`] does; returns its output, stdout and stderr.
fn run_example_raw(name: &str, env: &[(&str, &str)]) -> (std::process::Output, String, String) {
    let state = tempfile::tempdir().unwrap();
    let out = Command::new(examples_dir().join(name))
        .args(["--set", &format!("application.id={}", unique(name))])
        .args(["--set", &format!("state.dir={}", state.path().display())])
        .args(["--set", &format!("dlq.topic={}", unique("dlq"))])
        .args(["--set", "http.address=127.0.0.1:0", "--stop-at-end"])
        .env("ONCEFLOW_BOOTSTRAP_SERVERS", bootstrap())
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    (out, so, se)
}

fn values(topic: &str) -> Vec<serde_json::Value> {
    kafka::read_topic(&bootstrap(), topic, true, T)
        .unwrap()
        .iter()
        .map(|r| serde_json::from_slice(r.value.as_deref().unwrap()).unwrap())
        .collect()
}

/// The analytics example dedups by `/event_id` with `partitioning: repartition` (its events
/// are keyed by user or session): copies of an event published on different partitions,
/// with different keys (or none), still come out once, the repeats on the side topic.
#[test]
fn analytics_dedup_repartitions_copies_from_different_partitions() {
    let (input, output, dups) = (unique("events"), unique("unique"), unique("dups"));
    create_topics(&[&input, &output, &dups], 2);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    let send = |part: i32, key: Option<&[u8]>, id: &str| {
        let v = format!(r#"{{"event_id":"{id}","user":"u"}}"#);
        p.send(&input, Some(part), key, Some(v.as_bytes()), &[], None)
            .unwrap();
    };
    send(0, Some(b"user-1"), "e1");
    send(1, Some(b"user-2"), "e1");
    send(1, Some(b"session-9"), "e2");
    send(0, None, "e2");
    send(0, Some(b"user-1"), "e3");
    send(1, None, "e1");
    p.flush().unwrap();
    let so = run_example(
        "analytics_dedup",
        &[
            ("ONCEFLOW_EXAMPLE_INPUT", &input),
            ("ONCEFLOW_EXAMPLE_OUTPUT", &output),
            ("ONCEFLOW_EXAMPLE_DUPLICATES", &dups),
        ],
    );
    let mut ids: Vec<String> = values(&output)
        .iter()
        .map(|v| v["event_id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    assert_eq!(ids, ["e1", "e2", "e3"], "{so}");
    let mut repeats: Vec<String> = values(&dups)
        .iter()
        .map(|v| v["event_id"].as_str().unwrap().to_string())
        .collect();
    repeats.sort();
    assert_eq!(repeats, ["e1", "e1", "e2"], "{so}");
}

#[test]
fn enrich_orders_runs_as_a_process() {
    let (orders, customers, output) = (unique("orders"), unique("customers"), unique("enriched"));
    create_topics(&[&orders, &output], 2);
    admin()
        .ensure_topic(&customers, 2, &[("cleanup.policy", "compact")])
        .unwrap();
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    p.send(
        &customers,
        None,
        Some(b"c1".as_slice()),
        Some(br#"{"name":"Ada"}"#.as_slice()),
        &[],
        None,
    )
    .unwrap();
    p.send(
        &orders,
        None,
        Some(b"o1".as_slice()),
        Some(br#"{"order_id":1,"customer_id":"c1"}"#.as_slice()),
        &[],
        None,
    )
    .unwrap();
    p.flush().unwrap();
    let so = run_example(
        "enrich_orders",
        &[
            ("ONCEFLOW_EXAMPLE_ORDERS", &orders),
            ("ONCEFLOW_EXAMPLE_CUSTOMERS", &customers),
            ("ONCEFLOW_EXAMPLE_OUTPUT", &output),
        ],
    );
    let out = values(&output);
    assert_eq!(out.len(), 1, "{so}");
    assert_eq!(out[0]["customer"]["name"], "Ada", "{so}");
}

#[test]
fn route_events_runs_as_a_process() {
    let input = unique("gh");
    let prefix = format!("{}.", unique("rt"));
    let routed: Vec<String> = ["pushes", "issues", "pull-requests", "other"]
        .iter()
        .map(|t| format!("{prefix}{t}"))
        .collect();
    let mut all: Vec<&str> = routed.iter().map(String::as_str).collect();
    all.push(&input);
    create_topics(&all, 1);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    for ty in ["PushEvent", "IssuesEvent", "WatchEvent"] {
        let v = format!(
            r#"{{"id":"1","type":"{ty}","repo":{{"name":"r/x"}},"actor":{{"login":"ada"}},"payload":{{}}}}"#
        );
        p.send(&input, None, None, Some(v.as_bytes()), &[], None)
            .unwrap();
    }
    p.flush().unwrap();
    let so = run_example(
        "route_events",
        &[
            ("ONCEFLOW_EXAMPLE_INPUT", &input),
            ("ONCEFLOW_EXAMPLE_PREFIX", &prefix),
        ],
    );
    let pushes = values(&routed[0]);
    assert_eq!(pushes.len(), 1, "{so}");
    assert_eq!(pushes[0]["repo_name"], "r/x");
    assert!(pushes[0].get("payload").is_none());
    assert_eq!(values(&routed[1]).len(), 1);
    assert_eq!(values(&routed[3]).len(), 1);
}
