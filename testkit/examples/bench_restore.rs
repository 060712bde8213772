//! Restore-rate benchmark (issue 3): how fast onceflow rebuilds a dedup store from its
//! changelog, against how fast a plain consumer reads that changelog, in one run.
//!
//! What it measures:
//! 1. Data: a changelog topic exactly as onceflow writes it for application.id `A` and a
//!    dedup stage `dedup`: topic `A-dedup-changelog`, 4 partitions,
//!    `cleanup.policy=compact,delete`, `retention.ms=-1`; N entries (default 1,000,000),
//!    key = the raw dedup key (`evt-000000042`), value = a prost-encoded `DedupEntry`,
//!    partition = the partition of that id in the input (xxh3 of the id, as the other
//!    benchmarks). An empty 4-partition input topic.
//! 2. Alternating for R rounds (default 3: a, a', b, a, a', b, ...):
//!    - (a) raw consume: a plain rdkafka `BaseConsumer`, read_committed, assigned to all
//!      changelog partitions from the beginning, one `poll` per record, counting records
//!      until its position has reached the end offsets captured at start; records/s from
//!      before the capture to the end;
//!    - (a') the same with batch reads (`onceflow::__testkit::read_batch`, 10,000 a
//!      call), the reader onceflow's restore uses. The baseline (A) of every ratio is the
//!      faster of (a) and (a') in that round;
//!    - (b) onceflow restore: `App::run` in-process with application.id `A`, a fresh empty
//!      state dir, the dedup topology on the empty input, stop at end.
//!      `RunSummary::restored` must be N. Three rates: N / the restore phase (first
//!      "restore starting" to last "restore complete" log event, captured in-process: the
//!      restore rate, as Kafka Streams' restore listener spans it from onRestoreStart to
//!      onRestoreEnd), which is the one the target is judged by; N / the time from the
//!      start of `App::run` to the last "restore complete" (also start-up: topic checks,
//!      group join, planning; every partition ready to process, what a user waits for);
//!      and N / the wall time of the whole `App::run` call (also stopping: end of input,
//!      close, flush). Stores are written behind: "ready" does not wait for sled, and
//!      closing skips what sled has not got (the checks below account for it).
//!
//!    - (c) sled alone, no Kafka: the restores' apply over the same records, pre-built,
//!      20,000 per step shared among the partitions as the run loop takes them, written
//!      synchronously into a fresh sled store: what persisting costs (done behind, later;
//!      `onceflow::__testkit::time_restore`).
//!    - (c') the restore path alone, no Kafka: the runtime's tasks restoring record by
//!      record over the same steps, into write-behind stores with the state writer held
//!      (as during a restore): what a restore adds to reading
//!      (`onceflow::__testkit::time_restore` with the topology).
//!
//!    The medians, the ratios restore/A and the target (b'/A >= 0.8) are reported, and the
//!    whole run split into start-up (to the first "restore starting"), restore phase and
//!    tail (last "restore complete" to the end of the run).
//! 3. Checks on the state the last round left: each partition's changelog checkpoint in
//!    sled is at most its end offset and a sample of 10,000 keys below the checkpoints
//!    decodes to the entries written; then a run over 1,000 known and 1,000 new ids on the
//!    same state dir restores exactly the entries above the checkpoints
//!    and drops exactly the known ones; its wall time is reported as (d), what the first
//!    records after a restore cost.
//!
//! Ends with a table and one machine-readable last line starting `bench-restore:`.
//!
//! ```text
//! scripts/bench-restore                                 # build, start the broker, run
//! ONCEFLOW_BENCH_RECORDS=100000 scripts/bench-restore   # quick smoke run
//! ```
//! Environment: ONCEFLOW_BOOTSTRAP_SERVERS (127.0.0.1:9092), ONCEFLOW_BENCH_RECORDS
//! (1000000), ONCEFLOW_BENCH_ROUNDS (3), ONCEFLOW_LOG (warn), ONCEFLOW_BENCH_SKIP_APPLY_ALONE
//! (set: skip (c), e.g. when profiling).

#[path = "bench_support/mod.rs"]
mod support;

use onceflow::__testkit::time_restore;
use onceflow::__testkit::{changelog_topic, read_batch, read_state};
use onceflow::{App, RunOptions, RunSummary};
use onceflow::{ChangelogRecord, DedupEntry};
use onceflow_testkit::kafka::Admin;
use onceflow_testkit::kafka::TestProducer;
use prost::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{
    cleanup, dedup_topology, event_id, event_json, list, median, now_ms, onceflow_config,
    partition_of, rate_list, Created, Res, Settings, PARTITIONS,
};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

const TARGET_RATIO: f64 = 0.8;
/// The dedup stage, hence the store, hence the changelog's middle name.
const STORE: &str = "dedup";
/// Keys checked one by one against the entry written for them.
const SAMPLE: usize = 10_000;
/// Changelog records the run loop takes per restore step (`RESTORE_BATCH` in
/// src/runtime/app.rs), for the engine-only measure.
const RESTORE_BATCH: usize = 20_000;
/// Known and new ids in the final duplicate check.
const CHECK_IDS: usize = 1_000;

// ------------------------------------------------------------------------ restore log

/// The restore log events of the run in progress, captured in-process with their time.
#[derive(Clone, Default)]
struct RestoreLog(Arc<Mutex<Vec<LogEvent>>>);

#[derive(Debug, Clone)]
struct LogEvent {
    at: Instant,
    /// "restore starting" or "restore complete".
    message: String,
    partition: i64,
    /// `done` of "restore complete".
    done: u64,
    /// `rate` of "restore complete", e.g. "412345/s".
    rate: String,
}

#[derive(Default)]
struct Fields {
    message: String,
    partition: i64,
    done: u64,
    rate: String,
}

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            "rate" => self.rate = format!("{value:?}").trim_matches('"').to_string(),
            _ => {}
        }
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "message" => self.message = value.to_string(),
            "rate" => self.rate = value.to_string(),
            _ => {}
        }
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        match field.name() {
            "partition" => self.partition = value,
            "done" => self.done = value.max(0) as u64,
            _ => {}
        }
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        match field.name() {
            "partition" => self.partition = value as i64,
            "done" => self.done = value,
            _ => {}
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for RestoreLog {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let at = Instant::now();
        let mut f = Fields::default();
        event.record(&mut f);
        if f.message == "restore starting" || f.message == "restore complete" {
            self.0.lock().expect("restore log").push(LogEvent {
                at,
                message: f.message,
                partition: f.partition,
                done: f.done,
                rate: f.rate,
            });
        }
    }
}

impl RestoreLog {
    fn take(&self) -> Vec<LogEvent> {
        std::mem::take(&mut *self.0.lock().expect("restore log"))
    }
}

/// stderr logging filtered by ONCEFLOW_LOG (default warn), plus the restore log capture
/// (onceflow's info events, whatever ONCEFLOW_LOG says).
fn init_logging() -> RestoreLog {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ONCEFLOW_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let log = RestoreLog::default();
    let capture =
        tracing_subscriber::filter::Targets::new().with_target("onceflow", tracing::Level::INFO);
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(filter),
        )
        .with(log.clone().with_filter(capture))
        .init();
    log
}

// ------------------------------------------------------------------------ data

/// The entry onceflow would have written for the `n`-th distinct id, the `offset`-th
/// first occurrence in its partition.
fn entry(first_seen_ms: i64, partition: i32, offset: i64) -> DedupEntry {
    DedupEntry {
        first_seen_ms,
        source_partition: partition,
        source_offset: offset,
        fingerprint: None,
        written_stream_ms: None,
        untimed: false,
    }
}

/// What was written: per id index, its partition and source offset; per partition, the
/// number of entries.
struct Changelog {
    topic: String,
    first_seen_ms: i64,
    partition: Vec<i32>,
    offset: Vec<i64>,
    per_partition: [i64; PARTITIONS],
}

/// Write `n` dedup entries to `topic`, stamped now, as onceflow's commit does.
fn build_changelog(s: &Settings, topic: &str, n: usize) -> Res<(Changelog, f64)> {
    let p = TestProducer::new(&s.bootstrap)?;
    let first_seen_ms = now_ms();
    let mut cl = Changelog {
        topic: topic.to_string(),
        first_seen_ms,
        partition: Vec::with_capacity(n),
        offset: Vec::with_capacity(n),
        per_partition: [0; PARTITIONS],
    };
    let started = Instant::now();
    for i in 0..n {
        let id = event_id(i);
        let part = partition_of(id.as_bytes());
        let off = cl.per_partition[part as usize];
        cl.per_partition[part as usize] += 1;
        let value = entry(first_seen_ms, part, off).encode_to_vec();
        p.send(
            topic,
            Some(part),
            Some(id.as_bytes()),
            Some(&value),
            &[],
            Some(now_ms()),
        )?;
        cl.partition.push(part);
        cl.offset.push(off);
    }
    p.flush()?;
    Ok((cl, started.elapsed().as_secs_f64()))
}

// ------------------------------------------------------------------------ (a) raw consume

/// Read `topic` from the beginning to the end offsets captured at start, read_committed,
/// counting records. Returns (records, seconds).
fn raw_consume(bootstrap: &str, topic: &str, batch: bool) -> Res<(u64, f64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "bench-restore-raw") // never joined, never committed
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        // As onceflow's consumers (config/onceflow.toml): librdkafka's 1000 ms default
        // stalls a consumer whose queue fills.
        .set("fetch.queue.backoff.ms", "20")
        .create()?;
    let started = Instant::now();
    let mut tpl = TopicPartitionList::new();
    let mut ends = [0i64; PARTITIONS];
    let mut next = [0i64; PARTITIONS];
    for p in 0..PARTITIONS {
        let (lo, hi) = consumer.fetch_watermarks(topic, p as i32, Duration::from_secs(10))?;
        ends[p] = hi;
        next[p] = lo;
        tpl.add_partition_offset(topic, p as i32, Offset::Offset(lo))?;
    }
    consumer.assign(&tpl)?;
    let mut n = 0u64;
    let mut bytes = 0usize;
    let mut last_progress = Instant::now();
    let mut error = None;
    while (0..PARTITIONS).any(|p| next[p] < ends[p]) {
        let mut got = 0usize;
        let mut take = |r: Result<(i32, i64, usize), rdkafka::error::KafkaError>| match r {
            Err(e) => error = Some(e),
            Ok((p, offset, len)) => {
                let p = p as usize;
                next[p] = next[p].max(offset + 1);
                bytes += len;
                n += 1;
                got += 1;
            }
        };
        if batch {
            // What is queued; when nothing is, wait for one record (as the restore does).
            if read_batch(&consumer, Duration::ZERO, 10_000, &mut take)? == 0 {
                read_batch(&consumer, Duration::from_millis(100), 1, &mut take)?;
            }
        } else if let Some(r) = consumer.poll(Duration::from_millis(100)) {
            take(r.map(|m| {
                let len = m.key().map_or(0, <[u8]>::len) + m.payload().map_or(0, <[u8]>::len);
                (m.partition(), m.offset(), len)
            }));
        }
        if let Some(e) = error.take() {
            return Err(format!("raw consume of {topic}: {e}").into());
        }
        if got > 0 {
            last_progress = Instant::now();
            continue;
        }
        // Transaction markers take offsets and are never delivered.
        let pos = consumer.position()?;
        for (p, nx) in next.iter_mut().enumerate() {
            if let Some(Offset::Offset(o)) = pos.find_partition(topic, p as i32).map(|e| e.offset())
            {
                *nx = (*nx).max(o);
            }
        }
        if last_progress.elapsed() > Duration::from_secs(60) {
            return Err(format!("raw consume of {topic}: stuck at {n} records").into());
        }
    }
    let secs = started.elapsed().as_secs_f64();
    std::hint::black_box(bytes);
    Ok((n, secs))
}

// ------------------------------------------------------------------------ (b) restore

struct RestoreRound {
    summary: RunSummary,
    /// Wall time of the whole `App::run` call.
    run_seconds: f64,
    /// First "restore starting" to last "restore complete".
    phase_seconds: f64,
    /// Start of `App::run` to the last "restore complete": every partition ready to
    /// process (what a user waits for).
    ready_seconds: f64,
    /// Start of `App::run` to the first "restore starting" (topics, group join, plan).
    startup_seconds: f64,
    /// Last "restore complete" to the end of `App::run` (resume, end of input, close).
    tail_seconds: f64,
    /// The per-partition rates of the "restore complete" events, as logged.
    partition_rates: Vec<String>,
}

/// The application.id and the topics of the onceflow runs.
struct Names {
    app_id: String,
    input: String,
    output: String,
}

fn onceflow_run(
    s: &Settings,
    names: &Names,
    state_dir: &std::path::Path,
    created: &mut Created,
) -> Res<(RunSummary, f64)> {
    let dir = state_dir.display().to_string();
    let cfg = onceflow_config(
        &s.bootstrap,
        &[
            ("application.id", names.app_id.as_str()),
            ("state.dir", &dir),
            ("processing.guarantee", "at_least_once"),
        ],
    )?;
    if !created.topics.contains(&cfg.dlq_topic) {
        created.topics.push(cfg.dlq_topic.clone());
    }
    let app = App::new(cfg, dedup_topology(&names.input, &names.output)?);
    let started = Instant::now();
    let summary = app.run(RunOptions {
        stop_at_end: true,
        ..Default::default()
    })?;
    Ok((summary, started.elapsed().as_secs_f64()))
}

fn restore_round(
    s: &Settings,
    names: &Names,
    state_dir: &std::path::Path,
    expected: u64,
    log: &RestoreLog,
    created: &mut Created,
) -> Res<RestoreRound> {
    log.take();
    let started = Instant::now();
    let (summary, run_seconds) = onceflow_run(s, names, state_dir, created)?;
    let ended = Instant::now();
    let events = log.take();
    if summary.restored != expected || summary.counts.records_in != 0 {
        return Err(format!(
            "onceflow restored {} records and read {} (expected {expected} and 0)",
            summary.restored, summary.counts.records_in
        )
        .into());
    }
    let starts: Vec<&LogEvent> = events
        .iter()
        .filter(|e| e.message == "restore starting")
        .collect();
    let completes: Vec<&LogEvent> = events
        .iter()
        .filter(|e| e.message == "restore complete")
        .collect();
    let done: u64 = completes.iter().map(|e| e.done).sum();
    if starts.len() != PARTITIONS || completes.len() != PARTITIONS || done != expected {
        return Err(format!(
            "restore log: {} \"restore starting\", {} \"restore complete\" events, done={done} \
             (expected {PARTITIONS}, {PARTITIONS}, {expected})",
            starts.len(),
            completes.len()
        )
        .into());
    }
    let first = starts.iter().map(|e| e.at).min().expect("4 starts");
    let last = completes.iter().map(|e| e.at).max().expect("4 completes");
    let mut partition_rates: Vec<(i64, String)> = completes
        .iter()
        .map(|e| (e.partition, e.rate.clone()))
        .collect();
    partition_rates.sort();
    Ok(RestoreRound {
        summary,
        run_seconds,
        phase_seconds: last.duration_since(first).as_secs_f64(),
        ready_seconds: last.duration_since(started).as_secs_f64(),
        startup_seconds: first.duration_since(started).as_secs_f64(),
        tail_seconds: ended.duration_since(last).as_secs_f64(),
        partition_rates: partition_rates
            .into_iter()
            .map(|(p, r)| format!("p{p}={r}"))
            .collect(),
    })
}

// ------------------------------------------------------------------------ (c) engine alone

/// The changelog records as the restore consumer hands them over, per partition.
fn changelog_records(cl: &Changelog) -> [Vec<ChangelogRecord>; PARTITIONS] {
    let mut out: [Vec<ChangelogRecord>; PARTITIONS] = Default::default();
    for (i, (&p, &off)) in cl.partition.iter().zip(&cl.offset).enumerate() {
        out[p as usize].push(ChangelogRecord {
            key: event_id(i).into_bytes(),
            value: Some(entry(cl.first_seen_ms, p, off).encode_to_vec()),
            offset: off,
        });
    }
    out
}

// ------------------------------------------------------------------------ checks

/// The entries are in the sled store under `dir` (`<state.dir>/<application.id>`) as far
/// as its writer got before the run closed the stores: each partition's changelog
/// checkpoint is at most its end offset, and a sample of `SAMPLE` keys below the
/// checkpoint decodes to the entries written. Returns the entries above the checkpoints:
/// what the next run must restore again. (`RunSummary::restored` and the restore log
/// already count every entry; a full scan of sled costs more than the restore.)
fn check_store(dir: &std::path::Path, cl: &Changelog) -> Res<u64> {
    let mut checkpoints = [0i64; PARTITIONS];
    for (p, c) in checkpoints.iter_mut().enumerate() {
        let (offsets, _) = read_state(dir, STORE, Some(p as i32), &[])?;
        let checkpoint = offsets.get(&(p as i32)).copied().unwrap_or(0);
        if checkpoint > cl.per_partition[p] {
            return Err(format!(
                "store {STORE}/{p}: changelog checkpoint {checkpoint}, beyond the end {}",
                cl.per_partition[p]
            )
            .into());
        }
        *c = checkpoint;
    }
    let n = cl.partition.len();
    let step = (n / SAMPLE).max(1);
    // The sample below the checkpoints, per partition: (id index, id).
    let mut sample: [Vec<(usize, String)>; PARTITIONS] = Default::default();
    for i in (0..n).step_by(step) {
        if cl.offset[i] < checkpoints[cl.partition[i] as usize] {
            sample[cl.partition[i] as usize].push((i, event_id(i)));
        }
    }
    let mut sampled = 0;
    for (p, ids) in sample.iter().enumerate() {
        let keys: Vec<&[u8]> = ids.iter().map(|(_, id)| id.as_bytes()).collect();
        let (_, values) = read_state(dir, STORE, Some(p as i32), &keys)?;
        for ((i, id), raw) in ids.iter().zip(values) {
            let raw = raw.ok_or_else(|| format!("{id}: missing from store {STORE}/{p}"))?;
            let got = DedupEntry::decode(raw.as_slice())?;
            let want = entry(cl.first_seen_ms, cl.partition[*i], cl.offset[*i]);
            if got != want {
                return Err(format!("{id}: stored {got:?}, expected {want:?}").into());
            }
            sampled += 1;
        }
    }
    let remaining: i64 = (0..PARTITIONS)
        .map(|p| cl.per_partition[p] - checkpoints[p])
        .sum();
    println!(
        "check: {sampled} sampled entries below the checkpoints in sled as written; checkpoints [{}] of ends [{}]: {remaining} entries not yet written behind when the run closed its stores",
        list(&checkpoints.map(|x| x as f64), 0),
        list(&cl.per_partition.map(|x| x as f64), 0),
    );
    Ok(remaining as u64)
}

/// On the restored state: a run over `CHECK_IDS` known ids and as many new ones drops
/// exactly the known ones, and restores exactly the `remaining` entries above the sled
/// checkpoints (none when the writer had caught up).
/// Returns the wall time of that run: what the first records after a restore cost.
fn check_duplicates(
    s: &Settings,
    names: &Names,
    state_dir: &std::path::Path,
    n: usize,
    remaining: u64,
    created: &mut Created,
) -> Res<f64> {
    let p = TestProducer::new(&s.bootstrap)?;
    let noise = vec![b'x'; 8192];
    let known = (0..CHECK_IDS).map(|k| k * (n / CHECK_IDS).max(1) % n);
    let new = (0..CHECK_IDS).map(|k| n + k);
    for i in known.chain(new) {
        let id = event_id(i);
        let value = event_json(&id, 1, "PushEvent", now_ms(), &noise, 0);
        p.send(
            &names.input,
            Some(partition_of(id.as_bytes())),
            Some(id.as_bytes()),
            Some(&value),
            &[],
            Some(now_ms()),
        )?;
    }
    p.flush()?;
    let (summary, run_seconds) = onceflow_run(s, names, state_dir, created)?;
    let c = &summary.counts;
    let distinct_known = n.min(CHECK_IDS) as u64;
    if summary.restored != remaining
        || c.records_in != 2 * CHECK_IDS as u64
        || c.duplicates != CHECK_IDS as u64
        || c.passed != CHECK_IDS as u64
    {
        return Err(format!(
            "duplicate check on the restored state: {} (expected restored={remaining} records_in={} duplicates={} passed={})",
            summary.line(),
            2 * CHECK_IDS,
            CHECK_IDS,
            CHECK_IDS
        )
        .into());
    }
    println!(
        "check: {CHECK_IDS} known ids ({distinct_known} distinct) dropped as duplicates, {CHECK_IDS} new ids passed, {remaining} entries restored again as expected: run_seconds={run_seconds:.3} {}",
        summary.line()
    );
    Ok(run_seconds)
}

// ------------------------------------------------------------------------ report

#[derive(Default)]
struct Results {
    /// Per round, the faster of the two raw consumers: the baseline of every ratio.
    raw: Vec<f64>,
    raw_poll: Vec<f64>,
    raw_batch: Vec<f64>,
    run: Vec<f64>,
    ready: Vec<f64>,
    phase: Vec<f64>,
    startup: Vec<f64>,
    tail: Vec<f64>,
    sled: Vec<f64>,
    /// (c') the restore path alone.
    memory: Vec<f64>,
    /// Wall time of the check run (2,000 records) on the restored state.
    first_records_seconds: f64,
}

fn report(s: &Settings, r: &Results) {
    let (raw, run, phase) = (median(&r.raw), median(&r.run), median(&r.phase));
    let ratio = |x: f64| if raw > 0.0 { x / raw } else { 0.0 };
    let (ratio_run, ratio_phase) = (ratio(run), ratio(phase));
    let met = ratio_phase >= TARGET_RATIO;
    let per_round = |xs: &[f64]| -> String {
        let v: Vec<f64> = xs.iter().zip(&r.raw).map(|(x, a)| x / a).collect();
        list(&v, 3)
    };
    println!();
    println!(
        "== onceflow restore bench: {} changelog entries, {} partitions, {} round(s), medians ==",
        s.records, PARTITIONS, s.rounds
    );
    println!("{:<52} {:>12}  per round", "measure", "median");
    let row = |name: &str, v: String, rounds: String| println!("{name:<52} {v:>12}  [{rounds}]");
    row(
        "(a) raw consume, one poll per record, rec/s",
        format!("{:.0}", median(&r.raw_poll)),
        rate_list(&r.raw_poll),
    );
    row(
        "(a') raw consume, batch reads, rec/s",
        format!("{:.0}", median(&r.raw_batch)),
        rate_list(&r.raw_batch),
    );
    row(
        "(A) raw baseline: the faster of a, a' per round",
        format!("{raw:.0}"),
        rate_list(&r.raw),
    );
    row(
        "(b) onceflow restore, whole run, rec/s",
        format!("{run:.0}"),
        rate_list(&r.run),
    );
    row(
        "(b'') onceflow restore, start to all ready, rec/s",
        format!("{:.0}", median(&r.ready)),
        rate_list(&r.ready),
    );
    row(
        "(b') onceflow restore, restore phase only, rec/s",
        format!("{phase:.0}"),
        rate_list(&r.phase),
    );
    row(
        "    of which start-up to first restore, s",
        format!("{:.2}", median(&r.startup)),
        list(&r.startup, 2),
    );
    row(
        "    of which last restore to end of run, s",
        format!("{:.2}", median(&r.tail)),
        list(&r.tail, 2),
    );
    row(
        "(c) restore apply alone (no Kafka), sled, rec/s",
        format!("{:.0}", median(&r.sled)),
        rate_list(&r.sled),
    );
    row(
        "(c') restore path alone (no Kafka), write-behind, rec/s",
        format!("{:.0}", median(&r.memory)),
        rate_list(&r.memory),
    );
    println!(
        "{:<52} {:>12}",
        format!(
            "(d) run of {} records on the restored state, s",
            2 * CHECK_IDS
        ),
        format!("{:.2}", r.first_records_seconds)
    );
    row("ratio b/A", format!("{ratio_run:.3}"), per_round(&r.run));
    row(
        "ratio b''/A",
        format!("{:.3}", ratio(median(&r.ready))),
        per_round(&r.ready),
    );
    row(
        "ratio b'/A",
        format!("{ratio_phase:.3}"),
        per_round(&r.phase),
    );
    println!(
        "{:<52} {:>12}",
        format!("target b'/A >= {TARGET_RATIO}"),
        if met { "MET" } else { "NOT MET" }
    );
    println!(
        "bench-restore: records={} rounds={} raw_rps={raw:.0} restore_rps={run:.0} restore_phase_rps={phase:.0} ready_rps={:.0} ratio={ratio_run:.3} ready_ratio={:.3} phase_ratio={ratio_phase:.3} target_met={met} sled_apply_rps={:.0} path_alone_rps={:.0} first_records_run_seconds={:.2}",
        s.records, s.rounds, median(&r.ready), ratio(median(&r.ready)), median(&r.sled), median(&r.memory), r.first_records_seconds
    );
}

// ------------------------------------------------------------------------ main

fn run(s: &Settings, log: &RestoreLog, created: &mut Created) -> Res<Results> {
    let admin = Admin::new(&onceflow_config(&s.bootstrap, &[])?)?;
    let names = Names {
        app_id: format!("bench-restore-{}", s.run_id),
        input: s.name("restore-in"),
        output: s.name("restore-out"),
    };
    let changelog = changelog_topic(&names.app_id, STORE);
    created.groups.push(names.app_id.clone());
    for t in [&names.input, &names.output] {
        admin.ensure_topic(t, PARTITIONS, &[("retention.ms", "-1")])?;
        created.topics.push(t.clone());
    }
    admin.ensure_topic(
        &changelog,
        PARTITIONS,
        &[("cleanup.policy", "compact,delete"), ("retention.ms", "-1")],
    )?;
    created.topics.push(changelog.clone());
    let (cl, secs) = build_changelog(s, &changelog, s.records)?;
    println!(
        "changelog: topic={} partitions={PARTITIONS} entries={} per_partition=[{}] seconds={secs:.2} records_per_second={:.0}",
        cl.topic,
        s.records,
        list(&cl.per_partition.map(|x| x as f64), 0),
        s.records as f64 / secs
    );

    let records = changelog_records(&cl);
    let mut res = Results::default();
    let mut last_state = None;
    for round in 1..=s.rounds {
        let mut best = 0f64;
        for (label, batch) in [
            ("(a) raw consume, poll", false),
            ("(a') raw consume, batch", true),
        ] {
            let (n, secs) = raw_consume(&s.bootstrap, &changelog, batch)?;
            if n != s.records as u64 {
                return Err(format!("raw consume read {n} records, expected {}", s.records).into());
            }
            let rps = n as f64 / secs;
            println!(
                "round {round} {label}: records={n} seconds={secs:.3} records_per_second={rps:.0}"
            );
            if batch {
                res.raw_batch.push(rps);
            } else {
                res.raw_poll.push(rps);
            }
            best = best.max(rps);
        }
        res.raw.push(best);

        let state = tempfile::tempdir()?;
        let r = restore_round(s, &names, state.path(), s.records as u64, log, created)?;
        let (run_rps, phase_rps) = (
            r.summary.restored as f64 / r.run_seconds,
            r.summary.restored as f64 / r.phase_seconds,
        );
        println!(
            "round {round} (b) onceflow restore: restored={} run_seconds={:.3} records_per_second={run_rps:.0} ready_seconds={:.3} phase_seconds={:.3} phase_records_per_second={phase_rps:.0} startup_seconds={:.3} tail_seconds={:.3} partitions=[{}]",
            r.summary.restored,
            r.run_seconds,
            r.ready_seconds,
            r.phase_seconds,
            r.startup_seconds,
            r.tail_seconds,
            r.partition_rates.join(" ")
        );
        res.run.push(run_rps);
        res.ready.push(r.summary.restored as f64 / r.ready_seconds);
        res.phase.push(phase_rps);
        res.startup.push(r.startup_seconds);
        res.tail.push(r.tail_seconds);
        last_state = Some(state);

        if std::env::var_os("ONCEFLOW_BENCH_SKIP_APPLY_ALONE").is_some() {
            continue;
        }
        let dir = tempfile::tempdir()?;
        let secs = time_restore(None, dir.path(), STORE, &records, RESTORE_BATCH)?;
        let rps = s.records as f64 / secs;
        println!("round {round} (c) restore apply alone, sled: records={} seconds={secs:.3} records_per_second={rps:.0}", s.records);
        res.sled.push(rps);
        let dir = tempfile::tempdir()?;
        let topology = dedup_topology(&names.input, &names.output)?;
        let secs = time_restore(Some(&topology), dir.path(), STORE, &records, RESTORE_BATCH)?;
        let rps = s.records as f64 / secs;
        println!("round {round} (c') restore path alone, write-behind stores: records={} seconds={secs:.3} records_per_second={rps:.0}", s.records);
        res.memory.push(rps);
    }

    let state = last_state.expect("at least one round");
    let remaining = check_store(&state.path().join(&names.app_id), &cl)?;
    res.first_records_seconds =
        check_duplicates(s, &names, state.path(), s.records, remaining, created)?;
    Ok(res)
}

fn main() -> ExitCode {
    let log = init_logging();
    let s = match Settings::from_env(1_000_000) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench-restore: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "bench-restore: broker={} records={} rounds={} run_id={}",
        s.bootstrap, s.records, s.rounds, s.run_id
    );
    let mut created = Created::default();
    let res = run(&s, &log, &mut created);
    cleanup(&s, &created);
    match res {
        Ok(r) => {
            report(&s, &r);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench-restore: failed: {e}");
            ExitCode::from(1)
        }
    }
}
