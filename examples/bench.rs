//! Throughput benchmark of onceflow's dedup topology against the cost of a bare Kafka
//! consume→produce loop, on one broker and one data set, in one run.
//!
//! What it measures:
//! 1. Data: N synthetic JSON events (default 1,000,000, ~200 bytes each), a quarter of them
//!    repeats of an earlier id (half near repeats, within the last 64 distinct ids; half far
//!    repeats, any earlier id), produced to a fresh 4-partition topic. Each id always goes
//!    to the same partition (xxh3 of the id), so per-partition dedup sees every repeat.
//! 2. Against the broker, alternating for R rounds (default 3: a, b, a, b, a, b):
//!    - (a) passthrough: a plain rdkafka BaseConsumer → ThreadedProducer loop, no state,
//!      every record copied to an output topic, async offset commit every ~1 s, a flush at
//!      the end; records/s from the first record to "all N consumed and flushed";
//!    - (b) onceflow: `App::run` with the dedup-on-/id (TTL 24 h) topology, at_least_once,
//!      stop at end, fresh application.id and state dir; records/s from `RunSummary`. The
//!      output is read back read_committed and must hold each distinct id once.
//!
//!    The medians of (a) and (b) and the ratio b/a (target >= 0.8) are reported.
//! 3. Without a broker: `Task`s (one per partition) over the same N pre-built records,
//!    with the sled backend and with the memory backend, committing state every 10,000
//!    records (plus an fsync for sled); decisions/s and the ratio sled/memory.
//!
//! Ends with a table and one machine-readable line starting `bench:`.
//!
//! ```text
//! scripts/bench                                  # build, start the broker, run
//! ONCEFLOW_BENCH_RECORDS=50000 scripts/bench     # quick smoke run
//! ```
//! Environment: ONCEFLOW_BOOTSTRAP_SERVERS (127.0.0.1:9092), ONCEFLOW_BENCH_RECORDS
//! (1000000), ONCEFLOW_BENCH_ROUNDS (3), ONCEFLOW_LOG (warn).

use bytes::Bytes;
use onceflow::config::Config;
use onceflow::kafka::admin::Admin;
use onceflow::processor::key::KeySource;
use onceflow::processor::stages::{DedupSpec, TimeSource};
use onceflow::processor::{Counts, Record, SourceMeta};
use onceflow::runtime::{App, RunOptions, RunSummary, Task};
use onceflow::state::{MemoryBackend, SledBackend, StateBackend};
use onceflow::testing::kafka;
use onceflow::topology::{Format, Topology, TopologyBuilder};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientConfig, ClientContext};
use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error>;
type Res<T> = std::result::Result<T, BoxError>;

const PARTITIONS: usize = 4;
const VALUE_LEN: usize = 200;
const TTL_MS: i64 = 24 * 3600 * 1000;
const TARGET_RATIO: f64 = 0.8;
/// Commit interval of the broker-free dedup runs, in records.
const STATE_COMMIT_EVERY: usize = 10_000;
const EVENT_TYPES: [&str; 5] = [
    "PushEvent",
    "WatchEvent",
    "IssuesEvent",
    "ForkEvent",
    "CreateEvent",
];

// ------------------------------------------------------------------------ settings

struct Settings {
    bootstrap: String,
    records: usize,
    rounds: usize,
    run_id: String,
}

fn env_usize(name: &str, default: usize) -> Res<usize> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{name}={v:?}: expected a positive integer").into()),
        },
    }
}

impl Settings {
    fn from_env() -> Res<Settings> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        Ok(Settings {
            bootstrap: kafka::bootstrap_servers(),
            records: env_usize("ONCEFLOW_BENCH_RECORDS", 1_000_000)?,
            rounds: env_usize("ONCEFLOW_BENCH_ROUNDS", 3)?,
            run_id: format!("{stamp}-{}", std::process::id()),
        })
    }

    fn name(&self, what: &str) -> String {
        format!("bench.{what}.{}", self.run_id)
    }
}

/// onceflow's config for this run: the process environment (except the bench's own
/// ONCEFLOW_BENCH_* variables, which are not config keys) plus `sets`.
fn onceflow_config(bootstrap: &str, sets: &[(&str, &str)]) -> Res<Config> {
    let env = std::env::vars().filter(|(k, _)| !k.starts_with("ONCEFLOW_BENCH_"));
    let mut all = vec![("bootstrap.servers".to_string(), bootstrap.to_string())];
    all.extend(sets.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Ok(Config::load_with_env(&[], &all, env)?)
}

// ------------------------------------------------------------------------ data

/// One event as produced: the id is the Kafka key and the dedup key.
struct Event {
    id: Bytes,
    partition: i32,
    value: Bytes,
    timestamp: i64,
}

struct Dataset {
    events: Vec<Event>,
    distinct: usize,
    near_repeats: usize,
    far_repeats: usize,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn partition_of(id: &[u8]) -> i32 {
    (xxhash_rust::xxh3::xxh3_64(id) % PARTITIONS as u64) as i32
}

/// A JSON object of exactly `VALUE_LEN` bytes; the payload field pads it with text from
/// `noise` starting at `at`.
fn event_json(id: &str, user: u32, kind: &str, ts: i64, noise: &[u8], at: usize) -> Bytes {
    let mut v =
        format!(r#"{{"id":"{id}","user":"user-{user:05}","type":"{kind}","ts":{ts},"payload":""#)
            .into_bytes();
    let pad = VALUE_LEN.saturating_sub(v.len() + 2);
    v.extend_from_slice(&noise[at..at + pad]);
    v.extend_from_slice(br#""}"#);
    Bytes::from(v)
}

/// `n` events, `n / 4` of them repeats (byte-identical copies) of an earlier event.
fn generate(n: usize, seed: u64) -> Dataset {
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
            let id = format!("evt-{:09}", firsts.len());
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

fn load(s: &Settings, ds: &Dataset, topic: &str) -> Res<f64> {
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

/// Records in `topic`: the sum of its partitions' high watermarks (no transactions, no
/// deletions, so offsets are records).
fn topic_records(bootstrap: &str, topic: &str) -> Res<i64> {
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

// ------------------------------------------------------------------------ (a) passthrough

/// Counts failed deliveries, as onceflow's producer does.
#[derive(Default)]
struct Failures(AtomicU64);

impl ClientContext for Failures {}

impl ProducerContext for Failures {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if result.is_err() {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The baseline: consume `input` from the beginning and produce every record unchanged to
/// `output`. Returns (records, seconds from first record to all consumed and flushed).
fn passthrough(
    bootstrap: &str,
    input: &str,
    output: &str,
    group: &str,
    expected: usize,
) -> Res<(usize, f64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .set("fetch.queue.backoff.ms", "20")
        .create()?;
    let producer: ThreadedProducer<Failures> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create_with_context(Failures::default())?;
    consumer.subscribe(&[input])?;
    let mut first: Option<Instant> = None;
    let mut last_commit = Instant::now();
    let mut last_progress = Instant::now();
    let mut n = 0usize;
    while n < expected {
        match consumer.poll(Duration::from_millis(100)) {
            None => {
                if last_progress.elapsed() > Duration::from_secs(120) {
                    return Err(format!("passthrough: stuck at {n} of {expected} records").into());
                }
            }
            Some(Err(e)) => eprintln!("passthrough: consumer error: {e}"),
            Some(Ok(m)) => {
                first.get_or_insert_with(Instant::now);
                last_progress = Instant::now();
                let mut r: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(output);
                if let Some(k) = m.key() {
                    r = r.key(k);
                }
                if let Some(v) = m.payload() {
                    r = r.payload(v);
                }
                if let Some(ts) = m.timestamp().to_millis() {
                    r = r.timestamp(ts);
                }
                if let Some(h) = m.headers() {
                    r = r.headers(h.detach());
                }
                loop {
                    match producer.send(r) {
                        Ok(()) => break,
                        Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                            r = back;
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        Err((e, _)) => return Err(e.into()),
                    }
                }
                n += 1;
            }
        }
        if last_commit.elapsed() >= Duration::from_secs(1) && first.is_some() {
            last_commit = Instant::now();
            consumer.commit_consumer_state(CommitMode::Async)?;
        }
    }
    producer.flush(Duration::from_secs(300))?;
    let seconds = first.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
    consumer.commit_consumer_state(CommitMode::Sync)?;
    let failed = producer.context().0.load(Ordering::Relaxed);
    if failed > 0 {
        return Err(format!("passthrough: {failed} deliveries failed").into());
    }
    Ok((n, seconds))
}

// ------------------------------------------------------------------------ (b) onceflow

fn dedup_topology(input: &str, output: &str) -> Res<Topology> {
    let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
    spec.ttl_ms = TTL_MS;
    spec.time = TimeSource::Event;
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

/// Run the dedup topology in-process to the end of `input`. The topics it creates (dead
/// letters, changelogs) are recorded in `created` before the run, for the cleanup.
fn run_onceflow(
    bootstrap: &str,
    input: &str,
    output: &str,
    app_id: &str,
    created: &mut Created,
) -> Res<RunSummary> {
    let state = tempfile::tempdir()?;
    let dir = state.path().display().to_string();
    let cfg = onceflow_config(
        bootstrap,
        &[
            ("application.id", app_id),
            ("state.dir", &dir),
            ("processing.guarantee", "at_least_once"),
        ],
    )?;
    created.topics.push(cfg.dlq_topic.clone());
    created.groups.push(app_id.to_string());
    let app = App::new(cfg, dedup_topology(input, output)?);
    created
        .topics
        .extend(app.changelog_topics().into_values().map(|(topic, _)| topic));
    let summary = app.run(RunOptions {
        stop_at_end: true,
        ..Default::default()
    })?;
    Ok(summary)
}

/// Read `topic` back read_committed; every distinct id must appear exactly once.
fn verify_unique(bootstrap: &str, topic: &str, distinct: usize) -> Res<()> {
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

// ------------------------------------------------------------------------ (3) dedup alone

fn prebuilt_records(ds: &Dataset, topic: &str) -> Vec<Record> {
    let topic: Arc<str> = topic.into();
    let mut next = [0i64; PARTITIONS];
    ds.events
        .iter()
        .map(|e| {
            let offset = next[e.partition as usize];
            next[e.partition as usize] += 1;
            Record {
                key: Some(e.id.clone()),
                value: Some(e.value.clone()),
                headers: Vec::new(),
                timestamp: Some(e.timestamp),
                json: None,
                fields: None,
                source: SourceMeta {
                    topic: topic.clone(),
                    partition: e.partition,
                    offset,
                },
            }
        })
        .collect()
}

/// Drive one `Task` per partition over the pre-built records, committing state every
/// `STATE_COMMIT_EVERY` records. Returns the counts and the seconds taken.
fn dedup_alone(ds: &Dataset, backend: &dyn StateBackend) -> Res<(Counts, f64)> {
    let topology = dedup_topology("bench.in", "bench.out")?;
    let mut tasks: Vec<Task> = (0..PARTITIONS as i32)
        .map(|p| Task::new(&topology, p, backend, "bench.dlq"))
        .collect::<Result<_, _>>()?;
    let records = prebuilt_records(ds, "bench.in");
    let mut out = Vec::with_capacity(4);
    let started = Instant::now();
    for (i, r) in records.into_iter().enumerate() {
        let p = r.source.partition as usize;
        tasks[p].process(r, now_ms(), &mut out)?;
        out.clear();
        if (i + 1) % STATE_COMMIT_EVERY == 0 {
            for t in tasks.iter_mut() {
                t.commit_state(|_| None)?;
            }
            backend.flush()?;
        }
    }
    for t in tasks.iter_mut() {
        t.commit_state(|_| None)?;
    }
    backend.flush()?;
    let seconds = started.elapsed().as_secs_f64();
    let mut counts = Counts::default();
    for t in &tasks {
        counts.add(t.counts());
    }
    if counts.passed as usize != ds.distinct || counts.dead_lettered != 0 {
        return Err(format!(
            "dedup alone: passed={} dead_lettered={}, expected passed={}",
            counts.passed, counts.dead_lettered, ds.distinct
        )
        .into());
    }
    Ok((counts, seconds))
}

// ------------------------------------------------------------------------ report

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn rate_list(xs: &[f64]) -> String {
    xs.iter()
        .map(|x| format!("{x:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Default)]
struct Results {
    passthrough: Vec<f64>,
    onceflow: Vec<f64>,
    sled: Vec<f64>,
    memory: Vec<f64>,
}

fn report(s: &Settings, ds: &Dataset, r: &Results) {
    let (pa, pb) = (median(&r.passthrough), median(&r.onceflow));
    let (ps, pm) = (median(&r.sled), median(&r.memory));
    let ratio = if pa > 0.0 { pb / pa } else { 0.0 };
    let sled_ratio = if pm > 0.0 { ps / pm } else { 0.0 };
    let met = ratio >= TARGET_RATIO;
    println!();
    println!(
        "== onceflow bench: {} records ({} distinct, {} near + {} far repeats), {} partitions, {} round(s), medians ==",
        ds.events.len(),
        ds.distinct,
        ds.near_repeats,
        ds.far_repeats,
        PARTITIONS,
        s.rounds
    );
    println!("{:<44} {:>14}  per round", "measure", "median");
    println!(
        "{:<44} {:>14}  [{}]",
        "(a) passthrough consume->produce, rec/s",
        format!("{pa:.0}"),
        rate_list(&r.passthrough)
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "(b) onceflow dedup at_least_once, rec/s",
        format!("{pb:.0}"),
        rate_list(&r.onceflow)
    );
    let per_round: Vec<String> = r
        .passthrough
        .iter()
        .zip(&r.onceflow)
        .map(|(a, b)| format!("{:.3}", b / a))
        .collect();
    println!(
        "{:<44} {:>14}  [{}]",
        "ratio b/a",
        format!("{ratio:.3}"),
        per_round.join(", ")
    );
    println!(
        "{:<44} {:>14}",
        format!("target b/a >= {TARGET_RATIO}"),
        if met { "MET" } else { "NOT MET" }
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "dedup alone, sled, decisions/s",
        format!("{ps:.0}"),
        rate_list(&r.sled)
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "dedup alone, memory, decisions/s",
        format!("{pm:.0}"),
        rate_list(&r.memory)
    );
    println!(
        "{:<44} {:>14}",
        "ratio sled/memory",
        format!("{sled_ratio:.3}")
    );
    println!(
        "bench: records={} rounds={} passthrough_rps={pa:.0} onceflow_rps={pb:.0} ratio={ratio:.3} target_met={met} sled_dps={ps:.0} memory_dps={pm:.0} sled_memory_ratio={sled_ratio:.3}",
        ds.events.len(),
        s.rounds
    );
}

// ------------------------------------------------------------------------ main

/// Topics and groups this run created, removed at the end whatever happened.
#[derive(Default)]
struct Created {
    topics: Vec<String>,
    groups: Vec<String>,
}

fn run(s: &Settings, created: &mut Created) -> Res<()> {
    let admin = Admin::new(&onceflow_config(&s.bootstrap, &[])?)?;
    let keep = [("retention.ms", "-1"), ("retention.bytes", "-1")];
    let input = s.name("in");

    let t = Instant::now();
    let ds = generate(s.records, 42);
    println!(
        "generated: records={} distinct={} near_repeats={} far_repeats={} value_bytes={} seconds={:.2}",
        ds.events.len(),
        ds.distinct,
        ds.near_repeats,
        ds.far_repeats,
        VALUE_LEN,
        t.elapsed().as_secs_f64()
    );
    admin.ensure_topic(&input, PARTITIONS, &keep)?;
    created.topics.push(input.clone());
    let secs = load(s, &ds, &input)?;
    println!(
        "loaded: topic={input} partitions={PARTITIONS} seconds={secs:.2} records_per_second={:.0}",
        ds.events.len() as f64 / secs
    );

    let mut res = Results::default();
    for round in 1..=s.rounds {
        // (a) passthrough
        let out = s.name(&format!("pass{round}"));
        let group = s.name(&format!("pass{round}-group"));
        admin.ensure_topic(&out, PARTITIONS, &keep)?;
        created.topics.push(out.clone());
        created.groups.push(group.clone());
        let (n, secs) = passthrough(&s.bootstrap, &input, &out, &group, ds.events.len())?;
        let written = topic_records(&s.bootstrap, &out)?;
        if written != n as i64 {
            return Err(format!("passthrough wrote {written} records, expected {n}").into());
        }
        let rps = n as f64 / secs;
        println!("round {round} (a) passthrough: records={n} seconds={secs:.3} records_per_second={rps:.0}");
        res.passthrough.push(rps);

        // (b) onceflow
        let out = s.name(&format!("unique{round}"));
        let app = format!("bench-dedup-{}-{round}", s.run_id);
        admin.ensure_topic(&out, PARTITIONS, &keep)?;
        created.topics.push(out.clone());
        let summary = run_onceflow(&s.bootstrap, &input, &out, &app, created)?;
        println!("round {round} (b) onceflow: {}", summary.line());
        if summary.counts.records_in as usize != ds.events.len() {
            return Err(format!(
                "onceflow read {} records, expected {}",
                summary.counts.records_in,
                ds.events.len()
            )
            .into());
        }
        verify_unique(&s.bootstrap, &out, ds.distinct)?;
        println!(
            "round {round} (b) verified: {} unique records in {out} (read_committed)",
            ds.distinct
        );
        res.onceflow.push(summary.records_per_second());
    }

    for round in 1..=s.rounds {
        let dir = tempfile::tempdir()?;
        let sled = SledBackend::open(dir.path())?;
        let (c, secs) = dedup_alone(&ds, &sled)?;
        drop(sled);
        let dps = c.records_in as f64 / secs;
        println!(
            "round {round} dedup alone, sled: records={} passed={} duplicates={} seconds={secs:.3} decisions_per_second={dps:.0}",
            c.records_in, c.passed, c.duplicates
        );
        res.sled.push(dps);

        let (c, secs) = dedup_alone(&ds, &MemoryBackend::default())?;
        let dps = c.records_in as f64 / secs;
        println!(
            "round {round} dedup alone, memory: records={} passed={} duplicates={} seconds={secs:.3} decisions_per_second={dps:.0}",
            c.records_in, c.passed, c.duplicates
        );
        res.memory.push(dps);
    }
    report(s, &ds, &res);
    Ok(())
}

fn cleanup(s: &Settings, created: &Created) {
    for g in &created.groups {
        if let Err(e) = kafka::delete_group(&s.bootstrap, g) {
            eprintln!("bench: cleanup: group {g}: {e}");
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
            "cleanup: deleted {} topics and {} groups",
            topics.len(),
            created.groups.len()
        ),
        Err(e) => eprintln!("bench: cleanup: deleting topics {topics:?}: {e}"),
    }
}

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ONCEFLOW_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let s = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "bench: broker={} records={} rounds={} run_id={}",
        s.bootstrap, s.records, s.rounds, s.run_id
    );
    let mut created = Created::default();
    let res = run(&s, &mut created);
    cleanup(&s, &created);
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: failed: {e}");
            ExitCode::from(1)
        }
    }
}
