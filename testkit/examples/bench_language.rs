//! Broker-free benchmark of the language stages: GH Archive events through the in-memory
//! test driver, a plain sink (passthrough) next to filter, map, route and a sink with a
//! computed key and header, each in CEL and (filter) as a Rust closure. Measures the CPU
//! cost of the stages only: no broker, no state store writes. Prints records/s and the
//! ratio to the passthrough measured in the same run.
//!
//!   cargo run --release -p onceflow-testkit --example bench_language            # 3 rounds over the shipped data
//!   ONCEFLOW_BENCH_ROUNDS=1 cargo run --release -p onceflow-testkit --example bench_language

use onceflow::dsl;
use onceflow::{Format, Topology, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use onceflow_testkit::gharchive;
use std::time::Instant;

fn file(stages: &str) -> Topology {
    let text = format!("name: bench\nsource: {{ topic: in }}\nstages:\n{stages}");
    dsl::parse("bench.yaml", &text).unwrap_or_else(|e| panic!("{e}"))
}

fn run(t: &Topology, events: &[Vec<u8>]) -> f64 {
    let mut d = TestDriver::new(t.clone()).auto_commit(false);
    let start = Instant::now();
    for (i, e) in events.iter().enumerate() {
        d.pipe(TestRecord::json(e.clone()).timestamp(i as i64))
            .unwrap();
        if i % 1000 == 999 {
            d.commit().unwrap();
        }
    }
    d.commit().unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(d.dead_letters().len(), 0, "a benchmark record was refused");
    events.len() as f64 / secs
}

fn main() {
    let rounds: usize = std::env::var("ONCEFLOW_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let mut events = Vec::new();
    for f in gharchive::hour_files() {
        events.extend(
            gharchive::read_hour(&f)
                .unwrap()
                .into_iter()
                .map(|e| e.line),
        );
    }
    let cases: Vec<(&str, Topology)> = vec![
        ("passthrough sink", file("  - sink: { topic: out }\n")),
        (
            "filter (CEL)",
            file("  - filter: { when: 'value.type == \"PushEvent\"' }\n  - sink: { topic: out }\n"),
        ),
        (
            "filter (closure)",
            TopologyBuilder::new("bench")
                .source("in", Format::Json)
                .filter("f", |r| {
                    Ok(r.json.as_ref().and_then(|j| j.get("type")).and_then(|t| t.as_str())
                        == Some("PushEvent"))
                })
                .sink("out", "out")
                .build()
                .unwrap(),
        ),
        (
            "map (CEL, 2 set + drop)",
            file("  - map: { set: { repo_name: value.repo.name, actor_login: value.actor.login }, drop: [payload] }\n  - sink: { topic: out }\n"),
        ),
        (
            "route (CEL, 3 branches)",
            file("  - route:\n      routes:\n        - { when: 'value.type == \"PushEvent\"', to: a }\n        - { when: 'value.type in [\"IssuesEvent\", \"IssueCommentEvent\"]', to: b }\n        - { when: 'value.type.startsWith(\"PullRequest\")', to: c }\n      default: d\n"),
        ),
        (
            "sink key + header (CEL)",
            file("  - sink: { topic: out, key: value.repo.name, headers: { type: value.type } }\n"),
        ),
    ];
    println!(
        "events: {} (GH Archive, {} rounds, best round)",
        events.len(),
        rounds
    );
    let mut base = 0.0;
    let mut line = Vec::new();
    for (name, t) in &cases {
        let best = (0..rounds).map(|_| run(t, &events)).fold(0.0, f64::max);
        if base == 0.0 {
            base = best;
        }
        println!(
            "{name:<26} {best:>12.0} records/s  {:>5.2}x passthrough",
            best / base
        );
        line.push(format!("{}={:.0}", name.split(' ').next().unwrap(), best));
    }
    println!("bench_language: {}", line.join(" "));
}
