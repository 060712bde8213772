//! Shared by the benchmarks (`examples/bench.rs`, `bench_restore.rs`, `bench_eos.rs`):
//! settings from the environment, the synthetic event generator, loading a topic, the
//! dedup topology, read-back checks, medians, and the cleanup of what a run created.
//!
//! Included with `#[path = "bench_support/mod.rs"] mod support;` (a directory without a
//! `main.rs`, so cargo does not take it for an example of its own). Each benchmark uses a
//! part of it.
#![allow(dead_code)]

use bytes::Bytes;
use onceflow::Config;
use onceflow::KeySource;
use onceflow::{DedupSpec, Partitioning, TimeSource};
use onceflow::{Format, Topology, TopologyBuilder};
use onceflow_testkit::kafka;
use onceflow_testkit::kafka::Admin;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use std::collections::HashSet;
use std::time::{Duration, Instant};

pub type BoxError = Box<dyn std::error::Error>;
pub type Res<T> = std::result::Result<T, BoxError>;

pub const PARTITIONS: usize = 4;
pub const VALUE_LEN: usize = 200;
pub const TTL_MS: i64 = 24 * 3600 * 1000;
const EVENT_TYPES: [&str; 5] = [
    "PushEvent",
    "WatchEvent",
    "IssuesEvent",
    "ForkEvent",
    "CreateEvent",
];

// ------------------------------------------------------------------------ settings

pub struct Settings {
    pub bootstrap: String,
    pub records: usize,
    pub rounds: usize,
    pub run_id: String,
}

pub fn env_usize(name: &str, default: usize) -> Res<usize> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{name}={v:?}: expected a positive integer").into()),
        },
    }
}

impl Settings {
    /// ONCEFLOW_BOOTSTRAP_SERVERS, ONCEFLOW_BENCH_RECORDS (`default_records`),
    /// ONCEFLOW_BENCH_ROUNDS (3), and a run id unique to this process.
    pub fn from_env(default_records: usize) -> Res<Settings> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        Ok(Settings {
            bootstrap: kafka::bootstrap_servers(),
            records: env_usize("ONCEFLOW_BENCH_RECORDS", default_records)?,
            rounds: env_usize("ONCEFLOW_BENCH_ROUNDS", 3)?,
            run_id: format!("{stamp}-{}", std::process::id()),
        })
    }

    pub fn name(&self, what: &str) -> String {
        format!("bench.{what}.{}", self.run_id)
    }
}

/// onceflow's config for this run: the process environment (except the bench's own
/// ONCEFLOW_BENCH_* variables, which are not config keys) plus `sets`.
pub fn onceflow_config(bootstrap: &str, sets: &[(&str, &str)]) -> Res<Config> {
    let env = std::env::vars().filter(|(k, _)| !k.starts_with("ONCEFLOW_BENCH_"));
    let mut all = vec![("bootstrap.servers".to_string(), bootstrap.to_string())];
    all.extend(sets.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Ok(Config::load_with_env(&[], &all, env)?)
}

/// Log to stderr filtered by ONCEFLOW_LOG (default warn).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ONCEFLOW_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

// ------------------------------------------------------------------------ data

/// One event as produced: the id is the Kafka key and the dedup key.
pub struct Event {
    pub id: Bytes,
    pub partition: i32,
    pub value: Bytes,
    pub timestamp: i64,
}

pub struct Dataset {
    pub events: Vec<Event>,
    pub distinct: usize,
    pub near_repeats: usize,
    pub far_repeats: usize,
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// CPU seconds the calling thread has used (user + system).
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

pub fn partition_of(id: &[u8]) -> i32 {
    (xxhash_rust::xxh3::xxh3_64(id) % PARTITIONS as u64) as i32
}

/// The id of the `n`-th distinct event.
pub fn event_id(n: usize) -> String {
    format!("evt-{n:09}")
}

/// A JSON object of exactly `VALUE_LEN` bytes; the payload field pads it with text from
/// `noise` starting at `at`.
pub fn event_json(id: &str, user: u32, kind: &str, ts: i64, noise: &[u8], at: usize) -> Bytes {
    let mut v =
        format!(r#"{{"id":"{id}","user":"user-{user:05}","type":"{kind}","ts":{ts},"payload":""#)
            .into_bytes();
    let pad = VALUE_LEN.saturating_sub(v.len() + 2);
    v.extend_from_slice(&noise[at..at + pad]);
    v.extend_from_slice(br#""}"#);
    Bytes::from(v)
}

/// `n` events, `n / 4` of them repeats (byte-identical copies) of an earlier event.
pub fn generate(n: usize, seed: u64) -> Dataset {
    let mut rng = StdRng::seed_from_u64(seed);
    let repeats = n / 4;
    let mut is_repeat: Vec<bool> = (0..n).map(|i| i < repeats).collect();
    is_repeat.shuffle(&mut rng);
    // The first event cannot repeat anything.
    if let Some(first_new) = is_repeat.iter().position(|r| !r) {
        is_repeat.swap(0, first_new);
    }
    let alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let noise: Vec<u8> = (0..8192)
        .map(|_| alphabet[rng.random_range(0..alphabet.len())])
        .collect();
    let ts = now_ms();
    let mut events: Vec<Event> = Vec::with_capacity(n);
    // Index into `events` of each distinct id's first occurrence.
    let mut firsts: Vec<usize> = Vec::with_capacity(n - repeats);
    let (mut near, mut far) = (0, 0);
    for repeat in is_repeat {
        if repeat {
            let back = if rng.random_bool(0.5) {
                near += 1;
                rng.random_range(1..=firsts.len().min(64))
            } else {
                far += 1;
                rng.random_range(1..=firsts.len())
            };
            let orig = &events[firsts[firsts.len() - back]];
            events.push(Event {
                id: orig.id.clone(),
                partition: orig.partition,
                value: orig.value.clone(),
                timestamp: orig.timestamp,
            });
        } else {
            let id = event_id(firsts.len());
            let kind = EVENT_TYPES[rng.random_range(0..EVENT_TYPES.len())];
            let value = event_json(
                &id,
                rng.random_range(0..50_000),
                kind,
                ts,
                &noise,
                rng.random_range(0..4096),
            );
            firsts.push(events.len());
            events.push(Event {
                partition: partition_of(id.as_bytes()),
                id: Bytes::from(id.into_bytes()),
                value,
                timestamp: ts,
            });
        }
    }
    Dataset {
        distinct: firsts.len(),
        events,
        near_repeats: near,
        far_repeats: far,
    }
}

pub fn load(s: &Settings, ds: &Dataset, topic: &str) -> Res<f64> {
    let p = kafka::TestProducer::new(&s.bootstrap)?;
    let started = Instant::now();
    for e in &ds.events {
        p.send(
            topic,
            Some(e.partition),
            Some(&e.id),
            Some(&e.value),
            &[],
            Some(e.timestamp),
        )?;
    }
    p.flush()?;
    Ok(started.elapsed().as_secs_f64())
}

/// Publish the same events with random 16-byte Kafka keys (seeded by `seed`) on the
/// partitions librdkafka's default partitioner gives them, so copies of an id land on
/// different partitions (3 in 4 of them for 4 partitions).
pub fn load_random_keys(s: &Settings, ds: &Dataset, topic: &str, seed: u64) -> Res<f64> {
    let p = kafka::TestProducer::new(&s.bootstrap)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let mut key = [0u8; 16];
    for e in &ds.events {
        rng.fill(&mut key[..]);
        p.send(
            topic,
            None,
            Some(&key),
            Some(&e.value),
            &[],
            Some(e.timestamp),
        )?;
    }
    p.flush()?;
    Ok(started.elapsed().as_secs_f64())
}

/// Records in `topic`: the sum of its partitions' high watermarks (no transactions, no
/// deletions, so offsets are records).
pub fn topic_records(bootstrap: &str, topic: &str) -> Res<i64> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let mut total = 0;
    for p in 0..PARTITIONS as i32 {
        let (lo, hi) = c.fetch_watermarks(topic, p, Duration::from_secs(10))?;
        total += hi - lo;
    }
    Ok(total)
}

// ------------------------------------------------------------------------ onceflow

/// The dedup topology of the benchmarks: dedup on `/id` (the JSON pointer key), or on the
/// Kafka key (which the benchmarks set to the id) with `ONCEFLOW_BENCH_KEY=kafka_key`.
pub fn dedup_topology(input: &str, output: &str) -> Res<Topology> {
    // Source: the benchmark publishes every copy of an id with the same Kafka key.
    dedup_topology_partitioned(input, output, Partitioning::Source)
}

/// [`dedup_topology`] with the dedup stage's `partitioning` chosen: `Source` when every
/// copy of an id shares a partition ([`load`]), `Repartition` when they do not
/// ([`load_random_keys`]).
pub fn dedup_topology_partitioned(
    input: &str,
    output: &str,
    partitioning: Partitioning,
) -> Res<Topology> {
    let mut spec = dedup_spec()?;
    spec.partitioning = Some(partitioning);
    TopologyBuilder::new("bench-dedup")
        .source(input, Format::Json)
        .dedup("dedup", spec)
        .sink("unique", output)
        .build()
        .map_err(|errs| {
            let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
            text.join("; ").into()
        })
}

/// The dedup stage of the benchmarks: keyed by `ONCEFLOW_BENCH_KEY` (`json_pointer`, the
/// default: `/id` in the value; or `kafka_key`), TTL 24 h, event time.
pub fn dedup_spec() -> Res<DedupSpec> {
    let key = match std::env::var("ONCEFLOW_BENCH_KEY").as_deref() {
        Ok("kafka_key") => KeySource::KafkaKey,
        Ok("json_pointer") | Err(_) => KeySource::JsonPointer("/id".into()),
        Ok(other) => {
            return Err(
                format!("ONCEFLOW_BENCH_KEY={other}: expected kafka_key or json_pointer").into(),
            )
        }
    };
    let mut spec = DedupSpec::new(key);
    spec.ttl_ms = TTL_MS;
    spec.time = TimeSource::Event;
    Ok(spec)
}

/// Read `topic` back read_committed; every distinct id must appear exactly once.
pub fn verify_unique(bootstrap: &str, topic: &str, distinct: usize) -> Res<()> {
    let out = kafka::read_topic(bootstrap, topic, true, Duration::from_secs(600))?;
    let mut ids = HashSet::with_capacity(out.len());
    for r in &out {
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap_or_default())?;
        ids.insert(v["id"].as_str().unwrap_or_default().to_string());
    }
    if out.len() != distinct || ids.len() != distinct {
        return Err(format!(
            "onceflow output {topic}: {} records, {} distinct ids, expected {distinct} of each",
            out.len(),
            ids.len()
        )
        .into());
    }
    Ok(())
}

// ------------------------------------------------------------------------ report

pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The `q`-quantile (0..=1) of sorted `v`, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn rate_list(xs: &[f64]) -> String {
    xs.iter()
        .map(|x| format!("{x:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn list(xs: &[f64], decimals: usize) -> String {
    xs.iter()
        .map(|x| format!("{x:.decimals$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

// ------------------------------------------------------------------------ cleanup

/// Topics and groups this run created, removed at the end whatever happened.
#[derive(Default)]
pub struct Created {
    pub topics: Vec<String>,
    pub groups: Vec<String>,
}

pub fn cleanup(s: &Settings, created: &Created) {
    let mut groups = 0;
    for g in &created.groups {
        match kafka::delete_group(&s.bootstrap, g) {
            // A group of static members (`instance.id` set, as the exactly_once_v2 runs of
            // `bench_eos` do) keeps them after a graceful stop until their session times
            // out: the broker refuses to delete it meanwhile, and drops it with its offsets
            // after `offsets.retention.minutes`.
            Err(e) if e.to_string().contains("NonEmptyGroup") => {
                println!(
                    "cleanup: group {g} kept (static members stay until their session times out)"
                );
            }
            Err(e) => eprintln!("bench: cleanup: group {g}: {e}"),
            Ok(()) => groups += 1,
        }
    }
    if created.topics.is_empty() {
        return;
    }
    let topics: Vec<&str> = created.topics.iter().map(|t| t.as_str()).collect();
    let res = onceflow_config(&s.bootstrap, &[])
        .and_then(|c| Ok(Admin::new(&c)?))
        .and_then(|a| Ok(a.delete_topics(&topics)?));
    match res {
        Ok(()) => println!(
            "cleanup: deleted {} topics and {groups} groups",
            topics.len()
        ),
        Err(e) => eprintln!("bench: cleanup: deleting topics {topics:?}: {e}"),
    }
}
