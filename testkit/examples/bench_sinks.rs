//! External sink benchmark. Delivery guarantee measured: once per idempotency key (sled,
//! redis, postgres inbox) against at-least-once (no store, plain insert).
//!
//! Broker-free: records are piped through the test driver (4 partitions, a commit every
//! 1,000 records, which waits for the effects in flight), so the figures are the sink
//! stage's own cost, not Kafka's. In one run, alternating rounds:
//! - effects/s of the `http` sink against a local receiver (in this process, one thread per
//!   connection) with the `sled` store, the `redis` store, and no idempotency;
//! - rows/s of the `postgres` sink with the inbox (one transaction per row with its inbox
//!   row) against a plain insert.
//!
//! Environment: ONCEFLOW_BENCH_RECORDS (20000 per mode and round), ONCEFLOW_BENCH_ROUNDS (3),
//! ONCEFLOW_BENCH_CONCURRENCY (16), ONCEFLOW_REDIS_URL, ONCEFLOW_POSTGRES_URL (modes whose
//! service is unset are skipped, and say so).

#[path = "../../tests/sink_support/mod.rs"]
mod sink_support;

use onceflow::{EffectSpec, ExternalSinkSpec, HttpSpec, PostgresSpec, Secret, StoreSpec};
use onceflow::{Format, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

fn run(spec: ExternalSinkSpec, n: usize, run_id: &str, round: usize) -> (f64, usize) {
    let t = TopologyBuilder::new("bench")
        .source("in", Format::Json)
        .external_sink("bench", spec)
        .build()
        .expect("bench topology");
    let mut d = TestDriver::new(t).auto_commit(false);
    let start = Instant::now();
    for i in 0..n {
        let v = format!(
            r#"{{"id":"{run_id}-{round}-{i}","type":"PushEvent","actor":{{"id":{i}}},"payload":"{}"}}"#,
            "x".repeat(120)
        );
        d.pipe(TestRecord::json(v).partition((i % 4) as i32))
            .expect("pipe");
        if i % 1000 == 999 {
            d.commit().expect("commit");
        }
    }
    d.commit().expect("commit");
    let secs = start.elapsed().as_secs_f64();
    (n as f64 / secs, d.dead_letters().len())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let n = env_usize("ONCEFLOW_BENCH_RECORDS", 20_000);
    let rounds = env_usize("ONCEFLOW_BENCH_ROUNDS", 3);
    let conc = env_usize("ONCEFLOW_BENCH_CONCURRENCY", 16);
    let run_id = format!("b{}", std::process::id());
    let rx = sink_support::Receiver::ok();
    let redis = std::env::var("ONCEFLOW_REDIS_URL").ok();
    let pg = std::env::var("ONCEFLOW_POSTGRES_URL").ok();
    let dir = tempfile::tempdir().expect("tempdir");
    if redis.is_none() {
        eprintln!("bench-sinks: ONCEFLOW_REDIS_URL unset: the redis mode is SKIPPED");
    }
    if pg.is_none() {
        eprintln!("bench-sinks: ONCEFLOW_POSTGRES_URL unset: the postgres modes are SKIPPED");
    }
    let table = format!("bench_{run_id}");
    let pg_client = pg.as_ref().map(|url| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let c = rt.block_on(async {
            let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
                .await
                .expect("postgres");
            tokio::spawn(conn);
            c.batch_execute(&format!(
                "CREATE TABLE {table} (id text, type text, actor bigint)"
            ))
            .await
            .unwrap();
            c
        });
        (rt, c)
    });

    let http = |store: StoreSpec| {
        let mut s = ExternalSinkSpec::new(
            EffectSpec::Http(HttpSpec::new(Secret::Inline(rx.url.clone()))),
            store,
        )
        .with_key("{value./id}");
        s.concurrency = conc;
        s
    };
    let pgs = |store: StoreSpec| {
        let mut s = ExternalSinkSpec::new(
            EffectSpec::Postgres(PostgresSpec::new(
                Secret::Env("ONCEFLOW_POSTGRES_URL".into()),
                format!("INSERT INTO {table} (id, type, actor) VALUES ($1, $2, $3::bigint)"),
                vec![
                    "{value./id}".into(),
                    "{value./type}".into(),
                    "{value./actor/id}".into(),
                ],
            )),
            store,
        )
        .with_key("{value./id}");
        s.concurrency = conc;
        s
    };
    type Mode<'a> = (&'a str, Box<dyn Fn(usize) -> ExternalSinkSpec + 'a>);
    let mut modes: Vec<Mode> = vec![
        ("http, no idempotency", Box::new(|_| http(StoreSpec::None))),
        (
            "http, sled store",
            Box::new(|r| {
                http(StoreSpec::Sled {
                    path: Some(dir.path().join(format!("sled-{r}"))),
                })
            }),
        ),
    ];
    if let Some(u) = &redis {
        let u = u.clone();
        let run_id = run_id.clone();
        modes.push((
            "http, redis store",
            Box::new(move |r| {
                http(StoreSpec::Redis {
                    url: Secret::Inline(u.clone()),
                    prefix: Some(format!("bench:{run_id}:{r}:")),
                })
            }),
        ));
    }
    if pg.is_some() {
        let inbox = format!("{table}_inbox");
        modes.push(("postgres, plain insert", Box::new(|_| pgs(StoreSpec::None))));
        modes.push((
            "postgres, with inbox",
            Box::new(move |_| {
                pgs(StoreSpec::Postgres {
                    table: inbox.clone(),
                })
            }),
        ));
    }
    let mut rates: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        for (name, mk) in &modes {
            let (rate, dead) = run(
                mk(round),
                n,
                &format!("{run_id}-{name}").replace([' ', ','], ""),
                round,
            );
            assert_eq!(dead, 0, "{name}: dead letters in a benchmark run");
            eprintln!("round {round}: {name:<24} {rate:>9.0} /s");
            rates.entry(name).or_default().push(rate);
        }
    }
    println!("{:<24} {:>12}   (median of {rounds} rounds of {n} records, concurrency {conc} x 4 partitions)", "mode", "per second");
    let mut med = BTreeMap::new();
    for (name, _) in &modes {
        let m = median(rates.get_mut(name).unwrap());
        med.insert(*name, m);
        println!("{name:<24} {m:>12.0}");
    }
    let base = med["http, no idempotency"];
    let mut line = format!(
        "bench-sinks: http none={base:.0}/s sled={:.0}/s ({:.2}x)",
        med["http, sled store"],
        med["http, sled store"] / base
    );
    if let Some(r) = med.get("http, redis store") {
        line += &format!(" redis={r:.0}/s ({:.2}x)", r / base);
    }
    if let (Some(p), Some(i)) = (
        med.get("postgres, plain insert"),
        med.get("postgres, with inbox"),
    ) {
        line += &format!(
            "; postgres plain={p:.0} rows/s inbox={i:.0} rows/s ({:.2}x)",
            i / p
        );
    }
    println!("{line}");
    if let Some((rt, c)) = pg_client {
        rt.block_on(c.batch_execute(&format!(
            "DROP TABLE {table}; DROP TABLE IF EXISTS {table}_inbox"
        )))
        .ok();
    }
    std::thread::sleep(Duration::from_millis(10));
}
