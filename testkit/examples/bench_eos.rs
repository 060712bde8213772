//! exactly_once_v2 against at_least_once (issue 4): throughput and end-to-end latency of
//! onceflow's dedup topology under both guarantees, on one broker, in one run.
//!
//! What it measures:
//! 1. Throughput. Data: N synthetic JSON events (default 1,000,000, ~200 bytes each, a
//!    quarter of them repeats; the generator of `examples/bench.rs`) in a fresh
//!    4-partition topic. Alternating for R rounds (default 3: alo, eos, alo, eos, ...),
//!    each run with a fresh application.id, state dir and output topic, in-process,
//!    stop at end:
//!    - alo: `processing.guarantee=at_least_once`, the default `commit.interval.ms` (1000);
//!    - eos: `processing.guarantee=exactly_once_v2`, `commit.interval.ms=100`,
//!      `instance.id=bench-<round>`.
//!
//!    records/s from `RunSummary` (first record to end of run); each output is read back
//!    read_committed and must hold each distinct id once. Medians, the ratio eos/alo and
//!    the target (>= 0.8, issue 12) are reported.
//! 2. End-to-end latency, alternating for R rounds per guarantee: onceflow runs on a
//!    thread on fresh topics (same settings as above, no stop at end); once warm-up records
//!    on every input partition have come through, the warm-up producer (linger.ms=1, so
//!    already connected and holding its producer id) publishes
//!    events at a steady rate (default 10,000/s for 10 s, a quarter of them repeats) with
//!    the record timestamp = the wall clock at send (ms); a read_committed consumer on the
//!    output takes (receive time - record timestamp) for every output record (onceflow's
//!    sink keeps the input timestamp). Every distinct id must arrive once. p50 and p99 in
//!    ms per round, and their medians over the rounds.
//!
//!    With ONCEFLOW_BENCH_BROKER_GC_LOG (the broker's GC log, `scripts/kafka gclog`; set by
//!    `scripts/bench-eos`), each round also reports the broker's GC pauses during its steady
//!    phase: the JVM stops the broker for them, so a long one shows in the tail.
//!
//! Ends with a table and one machine-readable last line starting `bench-eos:`.
//!
//! ```text
//! scripts/bench-eos                                  # build, start the broker, run
//! ONCEFLOW_BENCH_RECORDS=100000 ONCEFLOW_BENCH_LATENCY_SECONDS=3 scripts/bench-eos
//! ```
//! Environment: ONCEFLOW_BOOTSTRAP_SERVERS (127.0.0.1:9092), ONCEFLOW_BENCH_RECORDS
//! (1000000), ONCEFLOW_BENCH_ROUNDS (3), ONCEFLOW_BENCH_LATENCY_RATE (10000 events/s),
//! ONCEFLOW_BENCH_LATENCY_SECONDS (10), ONCEFLOW_LOG (warn), ONCEFLOW_BENCH_LATENCY_TRACE (a
//! path prefix: each latency round writes `<prefix>.<alo|eos>.<round>`, a line per output
//! record: ms since the first one arrived, its latency in ms; to see when a tail happened).

#[path = "bench_support/mod.rs"]
mod support;

use onceflow::__testkit::changelog_topic;
use onceflow::{App, RunOptions, RunSummary};
use onceflow_testkit::kafka::Admin;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{
    cleanup, dedup_topology, env_usize, event_json, generate, init_logging, list, load, median,
    now_ms, now_us, onceflow_config, quantile, rate_list, thread_cpu_seconds, verify_unique,
    Created, Dataset, Res, Settings, PARTITIONS, VALUE_LEN,
};

/// Target of the eos/alo throughput ratio (issue 12).
const TARGET_RATIO: f64 = 0.8;
/// Target of the exactly_once_v2 p99 end-to-end latency at 10k events/s, ms (issue 12).
const TARGET_EOS_P99_MS: f64 = 150.0;
/// commit.interval.ms of the exactly_once_v2 runs.
const EOS_COMMIT_INTERVAL_MS: &str = "100";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Guarantee {
    AtLeastOnce,
    ExactlyOnceV2,
}

impl Guarantee {
    fn tag(self) -> &'static str {
        match self {
            Guarantee::AtLeastOnce => "alo",
            Guarantee::ExactlyOnceV2 => "eos",
        }
    }

    /// The config of one run under this guarantee.
    fn sets(self, app_id: &str, state_dir: &str, instance: &str) -> Vec<(String, String)> {
        let mut v = vec![
            ("application.id".to_string(), app_id.to_string()),
            ("state.dir".to_string(), state_dir.to_string()),
        ];
        match self {
            Guarantee::AtLeastOnce => {
                v.push(("processing.guarantee".into(), "at_least_once".into()));
            }
            Guarantee::ExactlyOnceV2 => {
                v.push(("processing.guarantee".into(), "exactly_once_v2".into()));
                v.push(("commit.interval.ms".into(), EOS_COMMIT_INTERVAL_MS.into()));
                v.push(("instance.id".into(), instance.to_string()));
            }
        }
        v
    }
}

const BOTH: [Guarantee; 2] = [Guarantee::AtLeastOnce, Guarantee::ExactlyOnceV2];

struct LatencySettings {
    rate: usize,
    seconds: usize,
}

/// An `App` of the dedup topology from `input` to `output` under `g`, with a fresh state
/// dir (returned: it lives as long as the run). The topics and group it creates go to
/// `created`.
fn app(
    s: &Settings,
    g: Guarantee,
    app_id: &str,
    instance: &str,
    input: &str,
    output: &str,
    created: &mut Created,
) -> Res<(App, tempfile::TempDir)> {
    let state = tempfile::tempdir()?;
    let sets = g.sets(app_id, &state.path().display().to_string(), instance);
    let sets: Vec<(&str, &str)> = sets.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let cfg = onceflow_config(&s.bootstrap, &sets)?;
    created.topics.push(cfg.dlq_topic.clone());
    created.groups.push(app_id.to_string());
    let app = App::new(cfg, dedup_topology(input, output)?);
    created.topics.push(changelog_topic(app_id, "dedup"));
    Ok((app, state))
}

// ------------------------------------------------------------------------ 1. throughput

/// One throughput run: its summary and the share of its wall time the processing thread
/// was on a CPU.
fn throughput_round(
    s: &Settings,
    ds: &Dataset,
    g: Guarantee,
    round: usize,
    admin: &Admin,
    input: &str,
    created: &mut Created,
) -> Res<(RunSummary, f64)> {
    let tag = g.tag();
    let output = s.name(&format!("{tag}-out{round}"));
    admin.ensure_topic(&output, PARTITIONS, &[("retention.ms", "-1")])?;
    created.topics.push(output.clone());
    let app_id = format!("bench-{tag}-{}-{round}", s.run_id);
    let (app, _state) = app(
        s,
        g,
        &app_id,
        &format!("bench-{round}"),
        input,
        &output,
        created,
    )?;
    let (cpu0, wall0) = (thread_cpu_seconds(), Instant::now());
    let summary = app.run(RunOptions {
        stop_at_end: true,
        ..Default::default()
    })?;
    let (cpu, wall) = (thread_cpu_seconds() - cpu0, wall0.elapsed().as_secs_f64());
    println!("round {round} {tag}: {}", summary.line());
    println!(
        "round {round} {tag}: run_wall_seconds={wall:.3} processing_thread_cpu_seconds={cpu:.3} busy={:.0}% ms_per_commit_cycle={:.0}",
        100.0 * cpu / wall,
        1000.0 * summary.seconds / summary.commits.max(1) as f64
    );
    if summary.counts.records_in as usize != ds.events.len() {
        return Err(format!(
            "{tag}: onceflow read {} records, expected {}",
            summary.counts.records_in,
            ds.events.len()
        )
        .into());
    }
    verify_unique(&s.bootstrap, &output, ds.distinct)?;
    println!(
        "round {round} {tag} verified: {} unique records in {output} (read_committed)",
        ds.distinct
    );
    Ok((summary, cpu / wall))
}

// ------------------------------------------------------------------------ 2. latency

struct LatencyRound {
    /// Latencies in ms, sorted.
    ms: Vec<f64>,
    sent: usize,
    send_seconds: f64,
    summary: RunSummary,
    /// The steady phase, wall clock ms: from the first send to the last arrival.
    window: (i64, i64),
}

/// The broker's GC pauses in a window of a latency round.
struct Pauses {
    count: usize,
    over_100: usize,
    max_ms: f64,
    total_ms: f64,
}

/// The pauses that `log` (a JVM GC log written with `-Xlog:gc:...:time,timemillis`, as
/// `scripts/kafka` starts the broker) records as overlapping `window` (wall clock ms). A
/// pause line is written when the pause ends: `[...][<end>ms] GC(n) Pause ... <d>ms`. `None`
/// when the log cannot be read.
fn broker_pauses(log: &str, window: (i64, i64)) -> Option<Pauses> {
    let text = std::fs::read_to_string(log).ok()?;
    let mut p = Pauses {
        count: 0,
        over_100: 0,
        max_ms: 0.0,
        total_ms: 0.0,
    };
    for line in text.lines().filter(|l| l.contains(" Pause ")) {
        let end = line
            .split(']')
            .filter_map(|d| d.strip_prefix('[')?.strip_suffix("ms")?.parse::<i64>().ok())
            .next();
        let took = line
            .rsplit(' ')
            .next()
            .and_then(|d| d.strip_suffix("ms")?.parse::<f64>().ok());
        let (Some(end), Some(took)) = (end, took) else {
            continue;
        };
        if end < window.0 || end - (took as i64) > window.1 {
            continue;
        }
        p.count += 1;
        p.over_100 += usize::from(took > 100.0);
        p.max_ms = p.max_ms.max(took);
        p.total_ms += took;
    }
    Some(p)
}

fn load_producer(
    bootstrap: &str,
) -> Res<ThreadedProducer<rdkafka::producer::DefaultProducerContext>> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "1")
        .create()?)
}

fn send(
    p: &ThreadedProducer<rdkafka::producer::DefaultProducerContext>,
    topic: &str,
    partition: i32,
    key: &[u8],
    value: &[u8],
    timestamp: i64,
) -> Res<()> {
    let mut r: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic)
        .partition(partition)
        .key(key)
        .payload(value)
        .timestamp(timestamp);
    loop {
        match p.send(r) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                r = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err((e, _)) => return Err(e.into()),
        }
    }
}

/// Publish `ds` to `topic` at `rate` events/s, each stamped with the wall clock at send.
/// Returns (events sent, seconds).
/// Publish `ds` at `rate` with producer `p`, already connected (the warm-up's): a new
/// producer's first records would wait for its metadata and producer id (~0.5 s here),
/// and that wait would count as onceflow's latency.
fn publish_steady(
    p: ThreadedProducer<rdkafka::producer::DefaultProducerContext>,
    topic: &str,
    ds: &Dataset,
    rate: usize,
) -> Res<(usize, f64)> {
    let started = Instant::now();
    let mut sent = 0;
    while sent < ds.events.len() {
        let due = ((started.elapsed().as_secs_f64() * rate as f64) as usize).min(ds.events.len());
        while sent < due {
            let e = &ds.events[sent];
            send(&p, topic, e.partition, &e.id, &e.value, now_ms())?;
            sent += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let secs = started.elapsed().as_secs_f64();
    p.flush(Duration::from_secs(60))?;
    Ok((sent, secs))
}

fn output_reader(bootstrap: &str, topic: &str) -> Res<BaseConsumer> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "bench-eos-latency-reader") // never joined, never committed
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS as i32 {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    c.assign(&tpl)?;
    Ok(c)
}

fn latency_round(
    s: &Settings,
    ls: &LatencySettings,
    ds: &Arc<Dataset>,
    g: Guarantee,
    round: usize,
    admin: &Admin,
    created: &mut Created,
) -> Res<LatencyRound> {
    let tag = g.tag();
    let input = s.name(&format!("lat-{tag}-in{round}"));
    let output = s.name(&format!("lat-{tag}-out{round}"));
    for t in [&input, &output] {
        admin.ensure_topic(t, PARTITIONS, &[("retention.ms", "-1")])?;
        created.topics.push(t.clone());
    }
    let app_id = format!("bench-lat-{tag}-{}-{round}", s.run_id);
    let (app, state) = app(
        s,
        g,
        &app_id,
        &format!("bench-lat-{round}"),
        &input,
        &output,
        created,
    )?;
    let shutdown = Arc::new(AtomicBool::new(false));
    let opts = RunOptions {
        stop_at_end: false,
        shutdown: shutdown.clone(),
    };
    let runner = std::thread::spawn(move || {
        let r = app.run(opts);
        drop(state);
        r
    });
    let stop = |runner: std::thread::JoinHandle<onceflow::Result<RunSummary>>| -> Res<RunSummary> {
        shutdown.store(true, Ordering::SeqCst);
        match runner.join() {
            Ok(r) => Ok(r?),
            Err(_) => Err("the onceflow thread panicked".into()),
        }
    };
    let reader = output_reader(&s.bootstrap, &output)?;

    // Warm-up: a record on every input partition every 100 ms until one from each has
    // come through (onceflow has joined, been assigned everything, and is producing).
    let warm = load_producer(&s.bootstrap)?;
    let noise = vec![b'w'; 8192];
    let mut seen = [false; PARTITIONS];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last_send: Option<Instant> = None;
    let mut k = 0;
    while !seen.iter().all(|x| *x) {
        if Instant::now() > deadline || runner.is_finished() {
            let r = stop(runner);
            return Err(format!("{tag} latency round {round}: warm-up records never came through ({seen:?}; run: {:?})", r.map(|s| s.line())).into());
        }
        if last_send.is_none_or(|t| t.elapsed() >= Duration::from_millis(100)) {
            for p in 0..PARTITIONS as i32 {
                let id = format!("warm-{p}-{k}");
                let v = event_json(&id, 0, "PushEvent", now_ms(), &noise, 0);
                send(&warm, &input, p, id.as_bytes(), &v, now_ms())?;
            }
            k += 1;
            last_send = Some(Instant::now());
        }
        if let Some(m) = reader.poll(Duration::from_millis(10)) {
            let m = m?;
            let key = m.key().unwrap_or_default();
            if let Some(rest) = key.strip_prefix(b"warm-") {
                if let Some(p) = rest.first().map(|c| (c - b'0') as usize) {
                    seen[p.min(PARTITIONS - 1)] = true;
                }
            }
        }
    }
    warm.flush(Duration::from_secs(10))?;

    // The steady phase.
    let steady_from = now_ms();
    let topic = input.clone();
    let (rate, data) = (ls.rate, ds.clone());
    let publisher = std::thread::spawn(move || -> Result<(usize, f64), String> {
        publish_steady(warm, &topic, &data, rate).map_err(|e| e.to_string())
    });
    let mut ms = Vec::with_capacity(ds.distinct);
    let mut ids: HashSet<Vec<u8>> = HashSet::with_capacity(ds.distinct);
    let mut arrivals_us: Vec<i64> = Vec::with_capacity(ds.distinct);
    let deadline = Instant::now() + Duration::from_secs(ls.seconds as u64 + 60);
    while ms.len() < ds.distinct && Instant::now() < deadline && !runner.is_finished() {
        let Some(m) = reader.poll(Duration::from_millis(100)) else {
            continue;
        };
        let m = m?;
        let received_us = now_us();
        let key = m.key().unwrap_or_default();
        if key.starts_with(b"warm-") {
            continue;
        }
        let Some(ts) = m.timestamp().to_millis() else {
            return Err(format!("{tag}: an output record without a timestamp").into());
        };
        if !ids.insert(key.to_vec()) {
            return Err(format!(
                "{tag}: {} arrived twice (read_committed)",
                String::from_utf8_lossy(key)
            )
            .into());
        }
        ms.push((received_us - ts * 1000) as f64 / 1000.0);
        arrivals_us.push(received_us);
    }
    if let Ok(path) = std::env::var("ONCEFLOW_BENCH_LATENCY_TRACE") {
        let t0 = arrivals_us.first().copied().unwrap_or(0);
        let mut out = String::new();
        for (at, l) in arrivals_us.iter().zip(&ms) {
            out.push_str(&format!("{} {:.1}\n", (at - t0) / 1000, l));
        }
        std::fs::write(format!("{path}.{tag}.{round}"), out)?;
    }
    let window = (steady_from, now_ms());
    let published = publisher.join();
    let summary = stop(runner)?;
    let (sent, send_seconds) = match published {
        Ok(r) => r?,
        Err(_) => return Err("the publisher thread panicked".into()),
    };
    if ms.len() != ds.distinct {
        return Err(format!(
            "{tag} latency round {round}: {} of {} distinct ids came through; {}",
            ms.len(),
            ds.distinct,
            summary.line()
        )
        .into());
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok(LatencyRound {
        ms,
        sent,
        send_seconds,
        summary,
        window,
    })
}

// ------------------------------------------------------------------------ report

#[derive(Default)]
struct Results {
    /// records/s, per round, [alo, eos].
    rps: [Vec<f64>; 2],
    /// Share of the run the processing thread was on a CPU, per round, [alo, eos].
    busy: [Vec<f64>; 2],
    /// Milliseconds per commit (interval + commit), per round, [alo, eos].
    cycle_ms: [Vec<f64>; 2],
    p50: [Vec<f64>; 2],
    p99: [Vec<f64>; 2],
    max: [Vec<f64>; 2],
    /// The longest broker GC pause during each latency round, ms (none without a GC log).
    gc_max: [Vec<f64>; 2],
}

fn report(s: &Settings, ls: &LatencySettings, ds: &Dataset, r: &Results) {
    let [alo, eos] = [median(&r.rps[0]), median(&r.rps[1])];
    let ratio = if alo > 0.0 { eos / alo } else { 0.0 };
    let met = ratio >= TARGET_RATIO;
    let per_round: Vec<f64> = r.rps[0].iter().zip(&r.rps[1]).map(|(a, e)| e / a).collect();
    println!();
    println!(
        "== onceflow eos bench: {} records ({} distinct), {} partitions, {} round(s); latency at {}/s for {} s; medians ==",
        ds.events.len(),
        ds.distinct,
        PARTITIONS,
        s.rounds,
        ls.rate,
        ls.seconds
    );
    println!("{:<50} {:>10}  per round", "measure", "median");
    let row = |name: &str, v: String, rounds: String| println!("{name:<50} {v:>10}  [{rounds}]");
    row(
        "at_least_once throughput, rec/s",
        format!("{alo:.0}"),
        rate_list(&r.rps[0]),
    );
    row(
        &format!("exactly_once_v2 ({EOS_COMMIT_INTERVAL_MS} ms) throughput, rec/s"),
        format!("{eos:.0}"),
        rate_list(&r.rps[1]),
    );
    row("ratio eos/alo", format!("{ratio:.3}"), list(&per_round, 3));
    println!(
        "{:<50} {:>10}",
        format!("target eos/alo >= {TARGET_RATIO}"),
        if met { "MET" } else { "NOT MET" }
    );
    for (i, g) in BOTH.iter().enumerate() {
        row(
            &format!("  {} processing thread on CPU, %", g.tag()),
            format!("{:.0}", median(&r.busy[i])),
            list(&r.busy[i], 0),
        );
        row(
            &format!("  {} ms per commit cycle", g.tag()),
            format!("{:.0}", median(&r.cycle_ms[i])),
            list(&r.cycle_ms[i], 0),
        );
    }
    for (i, g) in BOTH.iter().enumerate() {
        let name = match g {
            Guarantee::AtLeastOnce => "at_least_once",
            Guarantee::ExactlyOnceV2 => "exactly_once_v2",
        };
        row(
            &format!("{name} latency p50, ms"),
            format!("{:.1}", median(&r.p50[i])),
            list(&r.p50[i], 1),
        );
        row(
            &format!("{name} latency p99, ms"),
            format!("{:.1}", median(&r.p99[i])),
            list(&r.p99[i], 1),
        );
        row(
            &format!("{name} latency max, ms"),
            format!("{:.1}", median(&r.max[i])),
            list(&r.max[i], 1),
        );
        if !r.gc_max[i].is_empty() {
            row(
                "  longest broker GC pause in the round, ms",
                format!("{:.1}", median(&r.gc_max[i])),
                list(&r.gc_max[i], 1),
            );
        }
    }
    let eos_p99 = median(&r.p99[1]);
    let p99_met = !r.p99[1].is_empty() && eos_p99 <= TARGET_EOS_P99_MS;
    println!(
        "{:<50} {:>10}",
        format!("target exactly_once_v2 p99 <= {TARGET_EOS_P99_MS} ms"),
        if p99_met { "MET" } else { "NOT MET" }
    );
    println!(
        "bench-eos: records={} rounds={} alo_rps={alo:.0} eos_rps={eos:.0} ratio={ratio:.3} target_met={met} eos_p99_target_met={p99_met} latency_rate={} latency_seconds={} alo_p50_ms={:.1} alo_p99_ms={:.1} eos_p50_ms={:.1} eos_p99_ms={:.1}",
        ds.events.len(),
        s.rounds,
        ls.rate,
        ls.seconds,
        median(&r.p50[0]),
        median(&r.p99[0]),
        median(&r.p50[1]),
        median(&r.p99[1]),
    );
}

// ------------------------------------------------------------------------ main

fn run(s: &Settings, ls: &LatencySettings, created: &mut Created) -> Res<(Dataset, Results)> {
    let admin = Admin::new(&onceflow_config(&s.bootstrap, &[])?)?;
    let input = s.name("eos-in");

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
    admin.ensure_topic(&input, PARTITIONS, &[("retention.ms", "-1")])?;
    created.topics.push(input.clone());
    let secs = load(s, &ds, &input)?;
    println!(
        "loaded: topic={input} partitions={PARTITIONS} seconds={secs:.2} records_per_second={:.0}",
        ds.events.len() as f64 / secs
    );

    let mut res = Results::default();
    for round in 1..=s.rounds {
        for (i, g) in BOTH.iter().enumerate() {
            let (summary, busy) = throughput_round(s, &ds, *g, round, &admin, &input, created)?;
            res.rps[i].push(summary.records_per_second());
            res.busy[i].push(100.0 * busy);
            res.cycle_ms[i].push(1000.0 * summary.seconds / summary.commits.max(1) as f64);
        }
    }

    let lat = Arc::new(generate(ls.rate * ls.seconds, 7));
    println!(
        "latency data: events={} distinct={} rate={}/s seconds={}",
        lat.events.len(),
        lat.distinct,
        ls.rate,
        ls.seconds
    );
    for round in 1..=s.rounds {
        for (i, g) in BOTH.iter().enumerate() {
            let r = latency_round(s, ls, &lat, *g, round, &admin, created)?;
            let (p50, p99, max) = (
                quantile(&r.ms, 0.5),
                quantile(&r.ms, 0.99),
                r.ms.last().copied().unwrap_or(0.0),
            );
            println!(
                "round {round} {} latency: sent={} send_rate={:.0}/s received={} p50_ms={p50:.1} p99_ms={p99:.1} max_ms={max:.1} commits={}",
                g.tag(),
                r.sent,
                r.sent as f64 / r.send_seconds,
                r.ms.len(),
                r.summary.commits
            );
            res.p50[i].push(p50);
            res.p99[i].push(p99);
            res.max[i].push(max);
            if let Ok(log) = std::env::var("ONCEFLOW_BENCH_BROKER_GC_LOG") {
                match broker_pauses(&log, r.window) {
                    Some(p) => {
                        println!(
                            "round {round} {} broker GC: pauses={} over_100ms={} max_ms={:.1} total_ms={:.1}",
                            g.tag(),
                            p.count,
                            p.over_100,
                            p.max_ms,
                            p.total_ms
                        );
                        res.gc_max[i].push(p.max_ms);
                    }
                    None => println!("round {round} {} broker GC: no log at {log}", g.tag()),
                }
            }
        }
    }
    Ok((ds, res))
}

fn main() -> ExitCode {
    init_logging();
    let settings = Settings::from_env(1_000_000).and_then(|s| {
        let ls = LatencySettings {
            rate: env_usize("ONCEFLOW_BENCH_LATENCY_RATE", 10_000)?,
            seconds: env_usize("ONCEFLOW_BENCH_LATENCY_SECONDS", 10)?,
        };
        Ok((s, ls))
    });
    let (s, ls) = match settings {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench-eos: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "bench-eos: broker={} records={} rounds={} latency_rate={} latency_seconds={} run_id={}",
        s.bootstrap, s.records, s.rounds, ls.rate, ls.seconds, s.run_id
    );
    let mut created = Created::default();
    let res = run(&s, &ls, &mut created);
    cleanup(&s, &created);
    match res {
        Ok((ds, r)) => {
            report(&s, &ls, &ds, &r);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench-eos: failed: {e}");
            ExitCode::from(1)
        }
    }
}
