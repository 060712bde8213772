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
//!    The medians of (a) and (b) and the ratio b/a (target >= 0.8) are reported. Each side
//!    runs in a child process of its own (this program, `ONCEFLOW_BENCH_CHILD` set), so its
//!    peak RSS (its own `VmHWM`) and CPU time (user + system, from `wait4`) are its own: reported per side,
//!    with the RSS ratio b/a (target <= 1.5) and CPU µs per record, in all and by kind of
//!    thread (`ThreadCpu`: the main thread, librdkafka's, the delivery reports', the state
//!    writer's), and how long the main thread waited for a core while runnable (the
//!    kernel's `schedstat`: on a machine whose cores are all busy, a loop is slowed by
//!    the other threads as much as by its own work). With `ONCEFLOW_BENCH_BROKER_PID` (a
//!    local broker's process; `scripts/bench` sets it) also the broker's CPU µs per record over each side's run:
//!    both share the machine.
//! 3. Without a broker, over the same N pre-built records, with the sled backend (written
//!    behind, as `App::run` does) and with the memory backend, committing state every
//!    10,000 records (plus an fsync for sled), decisions/s:
//!    - the dedup stage alone (`onceflow::__testkit::drive_dedup`): one stage and its store
//!      per partition, keyed by the Kafka key, no source decoding or sink (targets: sled
//!      >= 1 M, memory >= 2 M);
//!    - the tasks (one per partition, `onceflow::__testkit::drive_tasks`): the whole task
//!      path of the topology, the source's JSON check and the sink included.
//!
//! Ends with a table and one machine-readable line starting `bench:`.
//!
//! With `ONCEFLOW_BENCH_MODE=repartition` (`scripts/bench --repartition`) it measures the
//! repartition hop (issue 13) instead: the same events published twice, keyed by the id
//! (copies share a partition) and with random Kafka keys (copies spread over the
//! partitions); per round the co-partitioned dedup (`partitioning: source` on the keyed
//! topic) and the repartitioned dedup (`partitioning: repartition` on the randomly keyed
//! one), for each guarantee in `ONCEFLOW_BENCH_GUARANTEES` (`at_least_once`; a comma list,
//! e.g. `at_least_once,exactly_once_v2`). Reports both rates, the ratio repartitioned /
//! co-partitioned (target >= 0.6) and the repartition topic after each run (log start and
//! end offsets, records left, bytes on the broker's disk). Ends with `bench-repartition:`
//! lines.
//!
//! Siblings: `bench_restore.rs` (restore rate, `scripts/bench-restore`) and `bench_eos.rs`
//! (exactly_once_v2 vs at_least_once, `scripts/bench-eos`); shared code in `bench_support/`.
//!
//! ```text
//! scripts/bench                                  # build, start the broker, run
//! ONCEFLOW_BENCH_RECORDS=50000 scripts/bench     # quick smoke run
//! ```
//! Environment: ONCEFLOW_BOOTSTRAP_SERVERS (127.0.0.1:9092), ONCEFLOW_BENCH_RECORDS
//! (1000000), ONCEFLOW_BENCH_ROUNDS (3), ONCEFLOW_LOG (warn), ONCEFLOW_BENCH_MODE
//! (unset, `repartition`, or `tasks`: part 3 alone, no broker), ONCEFLOW_BENCH_GUARANTEES (`at_least_once`).

#[path = "bench_support/mod.rs"]
mod support;

use onceflow::__testkit::{changelog_topic, drive_dedup, drive_tasks, repartition_topic};
use onceflow::Partitioning;
use onceflow::Topology;
use onceflow::{App, RunOptions, RunSummary};
use onceflow::{Counts, TestRecord};
use onceflow_testkit::kafka::Admin;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientConfig, ClientContext};
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{
    cleanup, dedup_topology, dedup_topology_partitioned, generate, load, load_random_keys, median,
    onceflow_config, rate_list, topic_records, verify_unique, Created, Dataset, Res, Settings,
    PARTITIONS, VALUE_LEN,
};

const TARGET_RATIO: f64 = 0.8;
/// Target of onceflow's peak RSS against the passthrough's (issue 12).
const RSS_TARGET: f64 = 1.5;
const MIB: f64 = 1024.0 * 1024.0;
/// Commit interval of the broker-free dedup runs, in records.
const STATE_COMMIT_EVERY: usize = 10_000;

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

/// The config of the dedup topology's run (fresh application.id and state dir).
fn onceflow_run_config(bootstrap: &str, app_id: &str, state_dir: &str) -> Res<onceflow::Config> {
    onceflow_config(
        bootstrap,
        &[
            ("application.id", app_id),
            ("state.dir", state_dir),
            ("processing.guarantee", "at_least_once"),
        ],
    )
}

/// Record, for the cleanup, the topics and group that the run of `app_id` creates (dead
/// letters, changelogs).
fn record_onceflow_topics(bootstrap: &str, app_id: &str, created: &mut Created) -> Res<()> {
    let cfg = onceflow_run_config(bootstrap, app_id, "unused")?;
    created.topics.push(cfg.dlq_topic.clone());
    created.groups.push(app_id.to_string());
    created.topics.push(changelog_topic(app_id, "dedup"));
    Ok(())
}

/// Run the dedup topology in this process to the end of `input` (a fresh state dir).
fn run_onceflow(bootstrap: &str, input: &str, output: &str, app_id: &str) -> Res<RunSummary> {
    let state = tempfile::tempdir()?;
    let cfg = onceflow_run_config(bootstrap, app_id, &state.path().display().to_string())?;
    let app = App::new(cfg, dedup_topology(input, output)?);
    let summary = app.run(RunOptions {
        stop_at_end: true,
        ..Default::default()
    })?;
    Ok(summary)
}

// ------------------------------------------------------------------------ child processes

/// The environment variable that makes this program run one side of a round and exit.
const CHILD_ENV: &str = "ONCEFLOW_BENCH_CHILD";

/// What one side of a round did, with the child process's resource use (`wait4`).
#[derive(Clone, Default)]
struct ChildRun {
    records: usize,
    seconds: f64,
    /// onceflow's `summary:` line (empty for the passthrough).
    summary: String,
    /// Peak resident set size, bytes.
    peak_rss: u64,
    /// User + system CPU time, seconds.
    cpu_seconds: f64,
    /// The broker's user + system CPU time over the child's run, seconds, when
    /// `ONCEFLOW_BENCH_BROKER_PID` names a local broker process.
    broker_cpu_seconds: Option<f64>,
    /// The child's CPU time by kind of thread (see [`ThreadCpu`]): `kind:seconds,...`.
    threads: String,
    /// Seconds the main thread spent runnable but waiting for a core (see
    /// [`ThreadCpu::finish`]), when the kernel says.
    main_waited: Option<f64>,
}

impl ChildRun {
    fn usage(&self) -> String {
        let broker = self
            .broker_cpu_seconds
            .map(|b| {
                format!(
                    " broker_cpu_seconds={b:.2} broker_cpu_us_per_record={:.2}",
                    b * 1e6 / self.records.max(1) as f64
                )
            })
            .unwrap_or_default();
        let per_record = |secs: f64| secs * 1e6 / self.records.max(1) as f64;
        let threads: Vec<String> = self
            .threads
            .split(',')
            .filter_map(|kv| kv.split_once(':'))
            .filter_map(|(k, v)| Some(format!("{k}:{:.2}", per_record(v.parse().ok()?))))
            .collect();
        let threads = if threads.is_empty() {
            String::new()
        } else {
            format!(" threads_cpu_us_per_record={}", threads.join(","))
        };
        let main = self
            .main_waited
            .map(|w| format!(" main_waited_for_a_core_us_per_record={:.2}", per_record(w)))
            .unwrap_or_default();
        format!(
            "peak_rss_mib={:.0} cpu_seconds={:.2} cpu_us_per_record={:.2}{broker}{threads}{main}",
            self.peak_rss as f64 / (1024.0 * 1024.0),
            self.cpu_seconds,
            per_record(self.cpu_seconds)
        )
    }
}

/// The CPU time of this process's threads by kind, sampled from `/proc/self/task` every
/// 100 ms by a thread of its own, so that threads which end before the run does (clients
/// closed at the stop) still count, less at most their last 100 ms. Kinds: `main` (the
/// process's first thread: the run loop, or the passthrough's loop), `librdkafka` (`rdk:*`),
/// `delivery` (rdkafka's producer polling thread, which serves the delivery reports),
/// `state_writer`, `read_ahead` (the store reads done ahead of the run loop), `sled` (sled's
/// I/O threads and its log flusher), `other`.
struct ThreadCpu {
    seen: Arc<Mutex<BTreeMap<u32, (String, u64)>>>,
    stop: Arc<AtomicBool>,
    sampler: Option<std::thread::JoinHandle<()>>,
    /// The main thread's wait for a core ([`run_queue_ns`]) when sampling started.
    started: Option<u64>,
}

/// How long a thread of this process has waited on a run queue for a core, in nanoseconds
/// (the second field of `/proc/self/task/<tid>/schedstat`), when the kernel keeps it.
fn run_queue_ns(tid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    s.split_whitespace().nth(1)?.parse().ok()
}

impl ThreadCpu {
    fn start() -> ThreadCpu {
        let seen = Arc::new(Mutex::new(BTreeMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        let sampler = std::thread::Builder::new()
            .name("bench-threads".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    Self::sample(&s);
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
            .ok();
        ThreadCpu {
            seen,
            stop,
            sampler,
            started: run_queue_ns(std::process::id()),
        }
    }

    /// Note the name and user + system clock ticks of every live thread.
    fn sample(seen: &Mutex<BTreeMap<u32, (String, u64)>>) {
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return;
        };
        for entry in dir.flatten() {
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|t| t.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let Some((comm, ticks)) = stat_cpu(&stat) else {
                continue;
            };
            seen.lock().unwrap().insert(tid, (comm.to_string(), ticks));
        }
    }

    /// Stop sampling; ` threads=kind:seconds,...` for the child's result line, and
    /// ` main_waited=seconds` when the kernel says: how long the main thread waited on a
    /// run queue for a core since [`ThreadCpu::start`] (runnable, not sleeping). A loop
    /// that waits for a core while the cores run other threads (librdkafka's, the
    /// broker's) is slowed by them, not by what it waits for.
    fn finish(mut self) -> String {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.sampler.take() {
            let _ = t.join();
        }
        Self::sample(&self.seen);
        let hz = clock_ticks_per_second().unwrap_or(100.0);
        let pid = std::process::id();
        let mut by_kind: BTreeMap<&str, u64> = BTreeMap::new();
        for (tid, (comm, ticks)) in self.seen.lock().unwrap().iter() {
            let kind = match comm.as_str() {
                _ if *tid == pid => "main",
                c if c.starts_with("rdk:") => "librdkafka",
                c if c.starts_with("producer poll") => "delivery",
                c if c.starts_with("onceflow-state") => "state_writer",
                c if c.starts_with("onceflow-warm") => "read_ahead",
                c if c.starts_with("sled") || c == "log flusher" => "sled",
                _ => "other",
            };
            *by_kind.entry(kind).or_default() += ticks;
        }
        let kinds: Vec<String> = by_kind
            .iter()
            .map(|(k, t)| format!("{k}:{:.2}", *t as f64 / hz))
            .collect();
        let main = self
            .started
            .zip(run_queue_ns(pid))
            .map(|(w0, w1)| format!(" main_waited={:.3}", w1.saturating_sub(w0) as f64 / 1e9))
            .unwrap_or_default();
        format!(" threads={}{main}", kinds.join(","))
    }
}

/// The CPU time (user + system, seconds) the local broker process has used so far, when
/// `ONCEFLOW_BENCH_BROKER_PID` names it (`scripts/bench` sets it): on a machine shared with
/// the broker, its cost per record is part of each side's.
fn broker_cpu_seconds() -> Option<f64> {
    let pid = std::env::var("ONCEFLOW_BENCH_BROKER_PID").ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).ok()?;
    let (_, ticks) = stat_cpu(&stat)?;
    Some(ticks as f64 / clock_ticks_per_second()?)
}

/// The name and the user + system CPU time (clock ticks) of a process's or thread's
/// `/proc/.../stat` line: `pid (comm) state ...`, utime and stime the 14th and 15th
/// fields, counted after the name (which may hold spaces, closed by the last ')').
fn stat_cpu(stat: &str) -> Option<(&str, u64)> {
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let f: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((&stat[open + 1..close], ticks))
}

/// Clock ticks per second of `/proc`'s CPU times.
fn clock_ticks_per_second() -> Option<f64> {
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then_some(hz as f64)
}

/// Run one side of a round in a child process (this program with [`CHILD_ENV`] set), so
/// that its peak RSS and CPU time are its own. `args`: `passthrough INPUT OUTPUT GROUP N` or
/// `onceflow INPUT OUTPUT APP_ID`.
fn run_child(args: &[&str]) -> Res<ChildRun> {
    use std::io::Read;
    let broker_before = broker_cpu_seconds();
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .env(CHILD_ENV, args.join(" "))
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut out = String::new();
    child
        .stdout
        .take()
        .ok_or("child: no stdout")?
        .read_to_string(&mut out)?;
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    // SAFETY: `pid` is our child, not yet reaped (std reaps only on wait, never called).
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if r != pid {
        return Err(format!(
            "child {args:?}: wait4 failed: {}",
            std::io::Error::last_os_error()
        )
        .into());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Err(format!("child {args:?} failed (status {status}); its output: {out}").into());
    }
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("child-result: "))
        .ok_or_else(|| format!("child {args:?} printed no result; its output: {out}"))?;
    let field = |name: &str| -> Res<&str> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .ok_or_else(|| format!("child result without {name}: {line}").into())
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(ChildRun {
        records: field("records")?.parse()?,
        seconds: field("seconds")?.parse()?,
        summary: out
            .lines()
            .find(|l| l.starts_with("summary: "))
            .unwrap_or("")
            .to_string(),
        // The child's own VmHWM (its address space's peak since exec). Not `ru_maxrss`:
        // Linux folds the forked copy of this (large) parent into the child's maxrss at
        // exec, so ru_maxrss never reads below the parent's size when the child forked.
        peak_rss: match field("vmhwm_kib") {
            Ok(kib) => kib.parse::<u64>()? * 1024,
            // Linux reports ru_maxrss in KiB.
            Err(_) => usage.ru_maxrss as u64 * 1024,
        },
        cpu_seconds: tv(usage.ru_utime) + tv(usage.ru_stime),
        broker_cpu_seconds: broker_before.zip(broker_cpu_seconds()).map(|(a, b)| b - a),
        threads: field("threads").unwrap_or("").to_string(),
        main_waited: field("main_waited").ok().and_then(|v| v.parse().ok()),
    })
}

/// ` vmhwm_kib=N`: this process's peak resident set size (`VmHWM` in /proc/self/status),
/// or nothing where the kernel does not say.
fn vmhwm() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kib| format!(" vmhwm_kib={kib}"))
        .unwrap_or_default()
}

/// The child side of [`run_child`].
fn child_main(spec: &str, bootstrap: &str) -> Res<()> {
    let a: Vec<&str> = spec.split(' ').collect();
    match a.as_slice() {
        ["passthrough", input, output, group, n] => {
            let cpu = ThreadCpu::start();
            let (n, secs) = passthrough(bootstrap, input, output, group, n.parse()?)?;
            let threads = cpu.finish();
            println!(
                "child-result: records={n} seconds={secs}{}{threads}",
                vmhwm()
            );
        }
        ["onceflow", input, output, app] => {
            let cpu = ThreadCpu::start();
            let summary = run_onceflow(bootstrap, input, output, app)?;
            let threads = cpu.finish();
            println!("{}", summary.line());
            println!(
                "child-result: records={} seconds={}{}{threads}",
                summary.counts.records_in,
                summary.seconds,
                vmhwm()
            );
        }
        _ => return Err(format!("{CHILD_ENV}={spec:?}: unknown child").into()),
    }
    Ok(())
}

// ------------------------------------------------------------------------ (3) dedup alone

fn prebuilt_records(ds: &Dataset) -> Vec<TestRecord> {
    ds.events
        .iter()
        .map(|e| {
            TestRecord::json(e.value.to_vec())
                .key(e.id.to_vec())
                .timestamp(e.timestamp)
                .partition(e.partition)
        })
        .collect()
}

/// Drive one task per partition over the pre-built records (`onceflow::__testkit::drive_tasks`)
/// with their stores in sled under `sled_dir` (in memory when `None`), committing state
/// every `STATE_COMMIT_EVERY` records. Returns the counts and the seconds taken.
fn dedup_alone(ds: &Dataset, sled_dir: Option<&std::path::Path>) -> Res<(Counts, f64)> {
    let topology = dedup_topology("bench.in", "bench.out")?;
    let records = prebuilt_records(ds);
    let (counts, seconds, _) =
        drive_tasks(&topology, sled_dir, &[], records, STATE_COMMIT_EVERY, None)?;
    if counts.passed as usize != ds.distinct || counts.dead_lettered != 0 {
        return Err(format!(
            "dedup alone: passed={} dead_lettered={}, expected passed={}",
            counts.passed, counts.dead_lettered, ds.distinct
        )
        .into());
    }
    Ok((counts, seconds))
}

/// The dedup stage alone (`onceflow::__testkit::drive_dedup`) over the pre-built
/// records, its store in sled under `sled_dir` (in memory when `None`), keyed by the
/// Kafka key (the id: a JSON-pointer key reads the value as the task decoded it, which
/// is the task's work). Returns the counts and the seconds taken.
fn stage_alone(ds: &Dataset, sled_dir: Option<&std::path::Path>) -> Res<(Counts, f64)> {
    let mut spec = support::dedup_spec()?;
    spec.key = onceflow::KeySource::KafkaKey;
    let (counts, seconds) = drive_dedup(spec, sled_dir, prebuilt_records(ds), STATE_COMMIT_EVERY)?;
    if counts.passed as usize != ds.distinct || counts.records_in as usize != ds.events.len() {
        return Err(format!(
            "dedup stage alone: records={} passed={}, expected {} and {}",
            counts.records_in,
            counts.passed,
            ds.events.len(),
            ds.distinct
        )
        .into());
    }
    Ok((counts, seconds))
}

// ------------------------------------------------------------------------ report

#[derive(Default)]
struct Results {
    passthrough: Vec<f64>,
    onceflow: Vec<f64>,
    passthrough_usage: Vec<ChildRun>,
    onceflow_usage: Vec<ChildRun>,
    sled: Vec<f64>,
    memory: Vec<f64>,
    stage_sled: Vec<f64>,
    stage_memory: Vec<f64>,
}

fn report(s: &Settings, ds: &Dataset, r: &Results) {
    let (pa, pb) = (median(&r.passthrough), median(&r.onceflow));
    let (ps, pm) = (median(&r.sled), median(&r.memory));
    let (ss, sm) = (median(&r.stage_sled), median(&r.stage_memory));
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
    let rss = |u: &[ChildRun]| {
        median(
            &u.iter()
                .map(|c| c.peak_rss as f64 / MIB)
                .collect::<Vec<_>>(),
        )
    };
    let cpu = |u: &[ChildRun]| {
        median(
            &u.iter()
                .map(|c| c.cpu_seconds * 1e6 / c.records.max(1) as f64)
                .collect::<Vec<_>>(),
        )
    };
    let (ra, rb) = (rss(&r.passthrough_usage), rss(&r.onceflow_usage));
    let (ca, cb) = (cpu(&r.passthrough_usage), cpu(&r.onceflow_usage));
    let rss_ratio = if ra > 0.0 { rb / ra } else { 0.0 };
    let list = |u: &[ChildRun], f: &dyn Fn(&ChildRun) -> f64| {
        u.iter()
            .map(|c| format!("{:.1}", f(c)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mib = |c: &ChildRun| c.peak_rss as f64 / MIB;
    let us = |c: &ChildRun| c.cpu_seconds * 1e6 / c.records.max(1) as f64;
    println!(
        "{:<44} {:>14}  [{}]",
        "(a) peak RSS, MiB",
        format!("{ra:.0}"),
        list(&r.passthrough_usage, &mib)
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "(b) peak RSS, MiB",
        format!("{rb:.0}"),
        list(&r.onceflow_usage, &mib)
    );
    println!(
        "{:<44} {:>14}",
        format!("RSS b/a (target <= {RSS_TARGET})"),
        format!(
            "{rss_ratio:.2} {}",
            if rss_ratio <= RSS_TARGET {
                "MET"
            } else {
                "NOT MET"
            }
        )
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "(a) CPU us/record (user+sys)",
        format!("{ca:.2}"),
        list(&r.passthrough_usage, &us)
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "(b) CPU us/record (user+sys)",
        format!("{cb:.2}"),
        list(&r.onceflow_usage, &us)
    );
    // A row per side of seconds per record, when every run of both sides has them.
    let per_record_row = |what: &str, secs: &dyn Fn(&ChildRun) -> Option<f64>| {
        let us = |u: &[ChildRun]| {
            u.iter()
                .map(|c| secs(c).map(|s| s * 1e6 / c.records.max(1) as f64))
                .collect::<Option<Vec<f64>>>()
        };
        if let (Some(a), Some(b)) = (us(&r.passthrough_usage), us(&r.onceflow_usage)) {
            for (side, v) in [("(a)", a), ("(b)", b)] {
                let each: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
                println!(
                    "{:<44} {:>14}  [{}]",
                    format!("{side} {what}"),
                    format!("{:.2}", median(&v)),
                    each.join(", ")
                );
            }
        }
    };
    per_record_row("main thread waited for a core us/rec", &|c| c.main_waited);
    per_record_row("broker CPU us/record", &|c| c.broker_cpu_seconds);
    println!(
        "{:<44} {:>14}  [{}]",
        "dedup stage alone, sled, decisions/s",
        format!("{ss:.0}"),
        rate_list(&r.stage_sled)
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "dedup stage alone, memory, decisions/s",
        format!("{sm:.0}"),
        rate_list(&r.stage_memory)
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "tasks alone, sled, decisions/s",
        format!("{ps:.0}"),
        rate_list(&r.sled)
    );
    println!(
        "{:<44} {:>14}  [{}]",
        "tasks alone, memory, decisions/s",
        format!("{pm:.0}"),
        rate_list(&r.memory)
    );
    println!(
        "{:<44} {:>14}",
        "ratio sled/memory",
        format!("{sled_ratio:.3}")
    );
    println!(
        "bench: records={} rounds={} passthrough_rps={pa:.0} onceflow_rps={pb:.0} ratio={ratio:.3} target_met={met} passthrough_rss_mib={ra:.0} onceflow_rss_mib={rb:.0} rss_ratio={rss_ratio:.2} passthrough_cpu_us={ca:.2} onceflow_cpu_us={cb:.2} stage_sled_dps={ss:.0} stage_memory_dps={sm:.0} sled_dps={ps:.0} memory_dps={pm:.0} sled_memory_ratio={sled_ratio:.3}",
        ds.events.len(),
        s.rounds
    );
}

// ------------------------------------------------------------------------ main

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
        let child = run_child(&[
            "passthrough",
            &input,
            &out,
            &group,
            &ds.events.len().to_string(),
        ])?;
        let (n, secs) = (child.records, child.seconds);
        let written = topic_records(&s.bootstrap, &out)?;
        if written != n as i64 {
            return Err(format!("passthrough wrote {written} records, expected {n}").into());
        }
        let rps = n as f64 / secs;
        println!(
            "round {round} (a) passthrough: records={n} seconds={secs:.3} records_per_second={rps:.0} {}",
            child.usage()
        );
        res.passthrough.push(rps);
        res.passthrough_usage.push(child.clone());

        // (b) onceflow
        let out = s.name(&format!("unique{round}"));
        let app = format!("bench-dedup-{}-{round}", s.run_id);
        admin.ensure_topic(&out, PARTITIONS, &keep)?;
        created.topics.push(out.clone());
        record_onceflow_topics(&s.bootstrap, &app, created)?;
        let child = run_child(&["onceflow", &input, &out, &app])?;
        println!(
            "round {round} (b) onceflow: {} {}",
            child.summary,
            child.usage()
        );
        if child.records != ds.events.len() {
            return Err(format!(
                "onceflow read {} records, expected {}",
                child.records,
                ds.events.len()
            )
            .into());
        }
        verify_unique(&s.bootstrap, &out, ds.distinct)?;
        println!(
            "round {round} (b) verified: {} unique records in {out} (read_committed)",
            ds.distinct
        );
        res.onceflow.push(child.records as f64 / child.seconds);
        res.onceflow_usage.push(child);
    }

    dedup_alone_rounds(s, &ds, &mut res)?;
    report(s, &ds, &res);
    Ok(())
}

/// `ONCEFLOW_BENCH_MODE=tasks`: only the broker-free part (3), for profiling the task path.
fn run_tasks(s: &Settings) -> Res<()> {
    let ds = generate(s.records, 42);
    let mut res = Results::default();
    dedup_alone_rounds(s, &ds, &mut res)?;
    println!(
        "bench-tasks: records={} rounds={} stage_sled_dps={:.0} stage_memory_dps={:.0} (dedup stage alone; targets: sled >= 1000000, memory >= 2000000) sled_dps={:.0} memory_dps={:.0} (tasks)",
        s.records,
        s.rounds,
        median(&res.stage_sled),
        median(&res.stage_memory),
        median(&res.sled),
        median(&res.memory)
    );
    Ok(())
}

/// Part (3), `s.rounds` times: the dedup stage alone and the dedup tasks over the
/// pre-built records, with sled and in memory.
///
/// `ONCEFLOW_BENCH_ONLY=stage_memory` (or `stage_sled`) runs that part alone, for a
/// profiler.
fn dedup_alone_rounds(s: &Settings, ds: &Dataset, res: &mut Results) -> Res<()> {
    let only = std::env::var("ONCEFLOW_BENCH_ONLY").ok();
    for round in 1..=s.rounds {
        for (name, sled) in [("sled", true), ("memory", false)] {
            if only.as_ref().is_some_and(|o| *o != format!("stage_{name}")) {
                continue;
            }
            let dir = tempfile::tempdir()?;
            let (c, secs) = stage_alone(ds, sled.then(|| dir.path()))?;
            let dps = c.records_in as f64 / secs;
            println!(
                "round {round} dedup stage alone, {name}: records={} passed={} duplicates={} seconds={secs:.3} decisions_per_second={dps:.0}",
                c.records_in, c.passed, c.duplicates
            );
            if sled {
                res.stage_sled.push(dps);
            } else {
                res.stage_memory.push(dps);
            }
        }
        if only.is_some() {
            continue;
        }
        let dir = tempfile::tempdir()?;
        let (c, secs) = dedup_alone(ds, Some(dir.path()))?;
        let dps = c.records_in as f64 / secs;
        println!(
            "round {round} tasks alone, sled: records={} passed={} duplicates={} seconds={secs:.3} decisions_per_second={dps:.0}",
            c.records_in, c.passed, c.duplicates
        );
        res.sled.push(dps);

        let (c, secs) = dedup_alone(ds, None)?;
        let dps = c.records_in as f64 / secs;
        println!(
            "round {round} tasks alone, memory: records={} passed={} duplicates={} seconds={secs:.3} decisions_per_second={dps:.0}",
            c.records_in, c.passed, c.duplicates
        );
        res.memory.push(dps);
    }
    Ok(())
}

// ------------------------------------------------------------------------ repartition mode

/// Target of the repartitioned / co-partitioned throughput ratio (issue 13).
const REPARTITION_TARGET: f64 = 0.6;

/// Run `topology` in-process to the end of its input under `guarantee`; the topics it
/// creates (dead letters, changelogs, the repartition topic) are recorded in `created`.
fn run_guarantee(
    bootstrap: &str,
    topology: Topology,
    app_id: &str,
    guarantee: &str,
    created: &mut Created,
) -> Res<RunSummary> {
    let state = tempfile::tempdir()?;
    let dir = state.path().display().to_string();
    let mut sets = vec![
        ("application.id", app_id),
        ("state.dir", dir.as_str()),
        ("processing.guarantee", guarantee),
    ];
    if guarantee == "exactly_once_v2" {
        sets.push(("commit.interval.ms", "100"));
    }
    let cfg = onceflow_config(bootstrap, &sets)?;
    created.topics.push(cfg.dlq_topic.clone());
    created.topics.push(repartition_topic(app_id, "dedup"));
    created.groups.push(app_id.to_string());
    let app = App::new(cfg, topology);
    created.topics.push(changelog_topic(app_id, "dedup"));
    Ok(app.run(RunOptions {
        stop_at_end: true,
        ..Default::default()
    })?)
}

/// A repartition topic after a run: the sums over its partitions of the log start and end
/// offsets, and its size on the broker's disk (None when the log-dirs tool fails).
struct TopicSize {
    start: i64,
    end: i64,
    bytes: Option<u64>,
}

fn topic_size(bootstrap: &str, topic: &str) -> Res<TopicSize> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let (mut start, mut end) = (0, 0);
    for p in 0..PARTITIONS as i32 {
        let (lo, hi) = c.fetch_watermarks(topic, p, Duration::from_secs(10))?;
        start += lo;
        end += hi;
    }
    Ok(TopicSize {
        start,
        end,
        bytes: log_dir_bytes(bootstrap, topic),
    })
}

/// Bytes of `topic` in the broker's log dirs, from Kafka's log-dirs tool (run through
/// `scripts/kafka run`, from the repository root as `scripts/bench` runs us).
fn log_dir_bytes(bootstrap: &str, topic: &str) -> Option<u64> {
    let out = std::process::Command::new("scripts/kafka")
        .args([
            "run",
            "org.apache.kafka.tools.LogDirsCommand",
            "--bootstrap-server",
            bootstrap,
            "--describe",
            "--topic-list",
            topic,
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with('{'))?;
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let mut total = 0;
    for b in v["brokers"].as_array()? {
        for d in b["logDirs"].as_array()? {
            for p in d["partitions"].as_array()? {
                total += p["size"].as_u64()?;
            }
        }
    }
    Some(total)
}

/// Seconds until the repartition `topic`'s log end offsets sum to at least `n` (every
/// source record routed), polled every 50 ms; `None` when stopped first.
fn routed_after(
    bootstrap: &str,
    topic: &str,
    n: i64,
    stop: &std::sync::atomic::AtomicBool,
) -> Option<f64> {
    let started = Instant::now();
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .ok()?;
    while !stop.load(Ordering::Relaxed) {
        let end: i64 = (0..PARTITIONS as i32)
            .map(|p| {
                c.fetch_watermarks(topic, p, Duration::from_secs(2))
                    .map_or(0, |(_, hi)| hi)
            })
            .sum();
        if end >= n {
            return Some(started.elapsed().as_secs_f64());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn run_repartition(s: &Settings, created: &mut Created) -> Res<()> {
    let admin = Admin::new(&onceflow_config(&s.bootstrap, &[])?)?;
    let keep = [("retention.ms", "-1"), ("retention.bytes", "-1")];
    let guarantees: Vec<String> = std::env::var("ONCEFLOW_BENCH_GUARANTEES")
        .unwrap_or_else(|_| "at_least_once".into())
        .split(',')
        .map(|g| g.trim().to_string())
        .filter(|g| !g.is_empty())
        .collect();
    for g in &guarantees {
        if g != "at_least_once" && g != "exactly_once_v2" {
            return Err(format!("ONCEFLOW_BENCH_GUARANTEES: unknown guarantee {g:?}").into());
        }
    }
    let ds = generate(s.records, 42);
    let keyed = s.name("in-keyed");
    let random = s.name("in-random");
    for t in [&keyed, &random] {
        admin.ensure_topic(t, PARTITIONS, &keep)?;
        created.topics.push(t.clone());
    }
    let secs = load(s, &ds, &keyed)?;
    println!("loaded: topic={keyed} (keyed by id) seconds={secs:.2}");
    let secs = load_random_keys(s, &ds, &random, 7)?;
    println!("loaded: topic={random} (random keys) seconds={secs:.2}");
    let n = ds.events.len();

    let mut lines = Vec::new();
    for g in &guarantees {
        let (mut co, mut re) = (Vec::new(), Vec::new());
        let mut sizes = Vec::new();
        for round in 1..=s.rounds {
            for (input, partitioning, what) in [
                (&keyed, Partitioning::Source, "source"),
                (&random, Partitioning::Repartition, "repartition"),
            ] {
                let out = s.name(&format!("{what}-{g}-{round}"));
                let app = format!("bench-{what}-{g}-{}-{round}", s.run_id);
                admin.ensure_topic(&out, PARTITIONS, &keep)?;
                created.topics.push(out.clone());
                let topology = dedup_topology_partitioned(input, &out, partitioning)?;
                // With the hop, a watcher notes when the routers have written every record
                // to the repartition topic (the routing step's share of the run).
                let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let watcher = (partitioning == Partitioning::Repartition).then(|| {
                    let (b, t, stop) = (
                        s.bootstrap.clone(),
                        repartition_topic(&app, "dedup"),
                        stop.clone(),
                    );
                    std::thread::spawn(move || routed_after(&b, &t, n as i64, &stop))
                });
                let started = Instant::now();
                let summary = run_guarantee(&s.bootstrap, topology, &app, g, created)?;
                let total = started.elapsed().as_secs_f64();
                stop.store(true, Ordering::Relaxed);
                if let Some(Ok(Some(routed))) = watcher.map(|w| w.join()) {
                    println!(
                        "round {round} {g} steps: routed all {n} records after {routed:.2} s of {total:.2} s (run start to return)"
                    );
                }
                println!("round {round} {g} {what}: {}", summary.line());
                if summary.counts.records_in as usize != n {
                    return Err(format!(
                        "{what} {g}: read {} records, expected {n}",
                        summary.counts.records_in
                    )
                    .into());
                }
                verify_unique(&s.bootstrap, &out, ds.distinct)?;
                let rps = summary.records_per_second();
                if partitioning == Partitioning::Source {
                    co.push(rps);
                } else {
                    re.push(rps);
                    let size = topic_size(&s.bootstrap, &repartition_topic(&app, "dedup"))?;
                    println!(
                        "round {round} {g} repartition topic: log_start={} log_end={} records_left={} bytes={}",
                        size.start,
                        size.end,
                        size.end - size.start,
                        size.bytes.map_or("?".into(), |b| b.to_string())
                    );
                    sizes.push(size);
                }
            }
        }
        let (mc, mr) = (median(&co), median(&re));
        let ratio = if mc > 0.0 { mr / mc } else { 0.0 };
        let per_round: Vec<String> = co
            .iter()
            .zip(&re)
            .map(|(c, r)| format!("{:.3}", r / c))
            .collect();
        let last = sizes.last();
        lines.push(format!(
            "bench-repartition: guarantee={g} records={n} rounds={} source_rps={mc:.0} repartition_rps={mr:.0} ratio={ratio:.3} per_round=[{}] target_met={} repartition_log_start={} repartition_log_end={} repartition_bytes={}",
            s.rounds,
            per_round.join(","),
            ratio >= REPARTITION_TARGET,
            last.map_or(0, |z| z.start),
            last.map_or(0, |z| z.end),
            last.and_then(|z| z.bytes).map_or("?".into(), |b| b.to_string()),
        ));
        println!();
        println!("== repartition bench, {g}: {n} records ({} distinct), {PARTITIONS} partitions, {} round(s), medians ==", ds.distinct, s.rounds);
        println!(
            "{:<48} {:>12}  [{}]",
            "co-partitioned dedup (source), rec/s",
            format!("{mc:.0}"),
            rate_list(&co)
        );
        println!(
            "{:<48} {:>12}  [{}]",
            "repartitioned dedup (random keys), rec/s",
            format!("{mr:.0}"),
            rate_list(&re)
        );
        println!(
            "{:<48} {:>12}  [{}]  target >= {REPARTITION_TARGET}: {}",
            "ratio repartitioned/co-partitioned",
            format!("{ratio:.3}"),
            per_round.join(", "),
            if ratio >= REPARTITION_TARGET {
                "MET"
            } else {
                "NOT MET"
            }
        );
    }
    println!();
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

fn main() -> ExitCode {
    support::init_logging();
    // Both sides and the dedup tasks run as onceflow's `App::run` does: transparent huge
    // pages off (inherited by the children) and the allocator's purge delay (each child
    // is this program again and sets it here).
    onceflow::__testkit::limit_huge_pages();
    onceflow::__testkit::limit_retained_memory();
    let s = match Settings::from_env(1_000_000) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        // One side of a round (see `run_child`): run it, print its result, exit.
        return match child_main(&spec, &s.bootstrap) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench child: failed: {e}");
                ExitCode::from(1)
            }
        };
    }
    println!(
        "bench: broker={} records={} rounds={} run_id={}",
        s.bootstrap, s.records, s.rounds, s.run_id
    );
    let mut created = Created::default();
    let res = match std::env::var("ONCEFLOW_BENCH_MODE").as_deref() {
        Ok("repartition") => run_repartition(&s, &mut created),
        Ok("tasks") => run_tasks(&s),
        Ok(other) if !other.is_empty() => {
            Err(format!("ONCEFLOW_BENCH_MODE: unknown mode {other:?} (repartition, tasks)").into())
        }
        _ => run(&s, &mut created),
    };
    cleanup(&s, &created);
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: failed: {e}");
            ExitCode::from(1)
        }
    }
}
