//! The exactly_once_v2 crash harness: run after run, publish input with duplicates, run one
//! to three `onceflow run` instances of a dedup topology under `exactly_once_v2`, SIGKILL
//! one of them at a failpoint of the transactional commit (or at a random moment), restart
//! it, let the group commit to the end of the input, stop everything with SIGTERM, and
//! check the output read_committed: every distinct input id exactly once.
//!
//! Each run:
//! 1. creates fresh topics (input with [`PARTITIONS`] partitions, output, dlq; names unique
//!    to the run) and publishes 3,000–20,000 JSON events `{"id":"<run>-<n>",...}` with ~25%
//!    repeats (half of them recent, half drawn from every id so far: far apart), keyed by
//!    a function of the id so that repeats land in the same partition: 10–70% before the
//!    instances start, the rest in paced chunks over 3–8 s while they run, then more in
//!    small chunks until the kill has happened (a failpoint of the commit needs input to
//!    fire); with a small probability, the two real GH Archive hours first (see
//!    [`gharchive::publish`]);
//! 2. starts 1–3 instances with `processing.guarantee=exactly_once_v2`; instance slot `i`
//!    always has `instance.id=i` (a restart fences its predecessor and aborts its open
//!    transaction) and its own state dir; `commit.interval.ms` random in 50–200;
//!    `kafka.session.timeout.ms=6000`;
//! 3. kills one instance with SIGKILL: either at a failpoint (`ONCEFLOW_FAILPOINTS=
//!    <name>=kill@<n>`, `n` in 1..=4; for `restore.during` the instance is first killed at a
//!    random moment and its state dir wiped, so that it restores) or at a random moment
//!    (0.2–3 s after the start); then restarts it without failpoints, sometimes with its
//!    state dir wiped;
//!    Opt-in kind `sigstop` ([`HarnessOptions::kill_kinds`]): not a kill but SIGSTOP for
//!    7–12 s (longer than the session timeout) and SIGCONT, so the group evicts the
//!    instance and it comes back a zombie in the middle of a transaction. Opt-in kind
//!    `zombie`: the same stop, but the instance stops itself at `eos.after_changelog` or
//!    `eos.before_commit` (`=stop@<n>`), the exact window where its offsets are in an open
//!    transaction;
//! 4. waits until the group's committed offsets reach the input's high watermarks, then
//!    stops every instance with SIGTERM (each must exit 0);
//! 5. reads the output read_committed (every distinct id once: duplicates and losses are
//!    counted) and read_uncommitted (the difference is the aborted records: proof that the
//!    kills hit open transactions).
//!
//! A run that passes deletes its topics (input, output, dlq, changelog), its consumer group
//! and its directory; a run that fails keeps them all and names them in its report.

use crate::kafka::Admin;
use crate::{gharchive, kafka};
use onceflow::__testkit::changelog_topic;
use onceflow::failpoints;
use onceflow::Config;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Partitions of the input topic (and so of the output, dlq and changelog).
pub const PARTITIONS: usize = 4;

/// The failpoints a run may kill an instance at.
pub const FAILPOINTS: &[&str] = &[
    failpoints::EOS_AFTER_PRODUCE,
    failpoints::EOS_AFTER_CHANGELOG,
    failpoints::EOS_BEFORE_COMMIT,
    failpoints::EOS_AFTER_COMMIT,
    failpoints::RESTORE_DURING,
];

/// Name of the dedup stage (and store) of the harness topology.
const STORE: &str = "dedup";

/// How long a failpoint may take to fire before the victim is killed anyway.
const FAILPOINT_WAIT: Duration = Duration::from_secs(45);
/// How long the group may take to commit to the end of the input.
const COMMIT_WAIT: Duration = Duration::from_secs(180);
/// How long an instance may take to exit after SIGTERM.
const STOP_WAIT: Duration = Duration::from_secs(60);
/// Timeout of each read of a whole topic.
const READ_WAIT: Duration = Duration::from_secs(120);

/// Options of a harness session.
#[derive(Debug, Clone)]
pub struct HarnessOptions {
    /// The `onceflow` binary.
    pub bin: PathBuf,
    /// Broker address.
    pub bootstrap: String,
    /// Seed of every random choice (run parameters; the timing is the machine's).
    pub seed: u64,
    /// Number of runs.
    pub runs: usize,
    /// Synthetic events per run: at least.
    pub min_events: usize,
    /// Synthetic events per run: at most.
    pub max_events: usize,
    /// Probability that a run also publishes the two real GH Archive hours first.
    pub gharchive_probability: f64,
    /// Where runs keep their state dirs and instance logs (`<work_dir>/run-<n>`).
    pub work_dir: PathBuf,
    /// Keep the directory (logs) of passing runs too.
    pub keep_logs: bool,
    /// Copy the binary into `work_dir` first, so a rebuild during a long session does not
    /// change the binary under test.
    pub copy_binary: bool,
    /// Kill kinds to choose from, each equally likely: `moment`, the [`FAILPOINTS`], and
    /// the opt-in `sigstop`; empty means `moment` and every failpoint.
    pub kill_kinds: Vec<String>,
    /// Extra config keys for every instance (`--set k=v`), e.g. `kafka.debug=cgrp,eos`.
    pub extra_sets: Vec<(String, String)>,
    /// Run the dedup with `partitioning: repartition` and publish every event with a random
    /// Kafka key, so the copies of an id land on different partitions and only the
    /// repartition hop brings them together (default false: keyed by the id, `source`).
    pub repartition: bool,
    /// With `repartition`: put a map stage before the dedup (it copies `/id` to `/uid`,
    /// which the dedup keys on), so the router tasks run a stage before they route (the
    /// hop after stateless stages). Default false.
    pub prefix: bool,
}

impl HarnessOptions {
    /// Defaults: 3,000–20,000 events, GH Archive data in 10% of runs, logs under
    /// `$TMPDIR/onceflow-harness-<pid>` kept only for failed runs, the binary copied.
    pub fn new(bin: &Path, bootstrap: &str, seed: u64, runs: usize) -> HarnessOptions {
        HarnessOptions {
            bin: bin.to_path_buf(),
            bootstrap: bootstrap.to_string(),
            seed,
            runs,
            min_events: 3_000,
            max_events: 20_000,
            gharchive_probability: 0.1,
            // One dir per harness, also when several run in one process (parallel tests).
            work_dir: std::env::temp_dir().join(format!(
                "onceflow-harness-{}-{}",
                std::process::id(),
                HARNESSES.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            )),
            keep_logs: false,
            copy_binary: true,
            kill_kinds: Vec::new(),
            extra_sets: Vec::new(),
            repartition: false,
            prefix: false,
        }
    }
}

/// What one run did and found.
#[derive(Debug, Clone, Default)]
pub struct RunReport {
    /// Run number, from 1.
    pub run: usize,
    /// Instances started (slots).
    pub instances: usize,
    /// The killed slot.
    pub victim: usize,
    /// How it was killed: `moment@1.23s`, `<failpoint>=kill@<n>` (plus `+wipe` for
    /// `restore.during`, which is preceded by a kill at a moment and a wiped state dir),
    /// `sigstop@<s>+<s>`, or a zombie's `<failpoint>=stop@<n>+<s>`.
    pub kill: String,
    /// Whether the failpoint fired (a `moment` kill always counts as fired); a failpoint
    /// that did not fire within its wait is replaced by a SIGKILL at that moment.
    pub fired: bool,
    /// Whether the victim's state dir was wiped before its final restart.
    pub wiped: bool,
    /// Milliseconds between the kill and the restart.
    pub restart_after_ms: u64,
    /// Whether the two real GH Archive hours were published too.
    pub gharchive: bool,
    /// Records published to the input.
    pub records_in: usize,
    /// Distinct ids among them.
    pub distinct: usize,
    /// Output records, read_committed.
    pub output_committed: usize,
    /// Output records, read_uncommitted.
    pub output_uncommitted: usize,
    /// read_uncommitted minus read_committed: records of aborted transactions.
    pub aborted: usize,
    /// Output records beyond the first of their id.
    pub duplicates: usize,
    /// Distinct input ids missing from the output.
    pub losses: usize,
    /// Output records whose id is not an input id (or unreadable).
    pub unexpected: usize,
    /// Dead letters (read_committed): none expected.
    pub dead_letters: usize,
    /// Wall-clock seconds of the run.
    pub seconds: f64,
    /// Everything else that went wrong (an instance that exited by itself, did not exit 0
    /// on SIGTERM, offsets never committed to the end, ...).
    pub problems: Vec<String>,
    /// Up to 10 duplicated ids with where they appeared.
    pub duplicate_samples: Vec<String>,
    /// Up to 10 lost ids with where they were in the input.
    pub loss_samples: Vec<String>,
    /// The run's topics, application id and directory (kept when the run failed).
    pub names: String,
}

impl RunReport {
    /// The kind of kill, as `--kill` names it: `moment`, `sigstop`, `zombie` (a stop at a
    /// failpoint, `<failpoint>=stop@<n>`) or the failpoint killed at.
    pub fn kind(&self) -> &str {
        match self.kill.split_once('=') {
            Some((_, how)) if how.starts_with("stop@") => "zombie",
            _ => self.kill.split(['=', '@']).next().unwrap_or(""),
        }
    }

    /// Whether the run found nothing wrong.
    pub fn ok(&self) -> bool {
        self.duplicates == 0
            && self.losses == 0
            && self.unexpected == 0
            && self.dead_letters == 0
            && self.problems.is_empty()
    }

    /// One line: run, instances, kill, records in, distinct, output, aborted, duplicates,
    /// losses, seconds (and the problems, if any).
    pub fn line(&self) -> String {
        let mut s = format!(
            "run {}: instances={} victim={} kill={} fired={} restart_after_ms={} wiped={} gharchive={} records_in={} distinct={} output_committed={} aborted={} duplicates={} losses={} seconds={:.1}",
            self.run,
            self.instances,
            self.victim,
            self.kill,
            yes_no(self.fired),
            self.restart_after_ms,
            yes_no(self.wiped),
            yes_no(self.gharchive),
            self.records_in,
            self.distinct,
            self.output_committed,
            self.aborted,
            self.duplicates,
            self.losses,
            self.seconds
        );
        if self.unexpected > 0 {
            let _ = write!(s, " unexpected={}", self.unexpected);
        }
        if self.dead_letters > 0 {
            let _ = write!(s, " dead_letters={}", self.dead_letters);
        }
        if !self.ok() {
            let _ = write!(s, " FAILED");
            for p in &self.problems {
                let _ = write!(s, "\n    problem: {p}");
            }
            for d in &self.duplicate_samples {
                let _ = write!(s, "\n    duplicate: {d}");
            }
            for l in &self.loss_samples {
                let _ = write!(s, "\n    lost: {l}");
            }
            let _ = write!(s, "\n    kept: {}", self.names);
        }
        s
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// What a harness session found.
#[derive(Debug, Clone, Default)]
pub struct HarnessReport {
    /// The seed.
    pub seed: u64,
    /// Every run, in order.
    pub runs: Vec<RunReport>,
    /// Wall-clock seconds of the session.
    pub seconds: f64,
}

impl HarnessReport {
    /// Duplicated output records over all runs.
    pub fn duplicates(&self) -> usize {
        self.runs.iter().map(|r| r.duplicates).sum()
    }

    /// Lost ids over all runs.
    pub fn losses(&self) -> usize {
        self.runs.iter().map(|r| r.losses).sum()
    }

    /// Aborted output records seen over all runs.
    pub fn aborted(&self) -> usize {
        self.runs.iter().map(|r| r.aborted).sum()
    }

    /// Runs that found anything wrong.
    pub fn failed_runs(&self) -> usize {
        self.runs.iter().filter(|r| !r.ok()).count()
    }

    /// Runs whose failpoint (or moment kill) fired.
    pub fn fired(&self) -> usize {
        self.runs.iter().filter(|r| r.fired).count()
    }

    /// No duplicate, no loss, no failed run.
    pub fn ok(&self) -> bool {
        self.duplicates() == 0 && self.losses() == 0 && self.failed_runs() == 0
    }

    /// `harness: runs=N duplicates=0 losses=0 aborted_records=... failed_runs=0 ...`
    pub fn summary_line(&self) -> String {
        let mut kinds: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for r in &self.runs {
            let k = r.kind().to_string();
            let e = kinds.entry(k).or_default();
            e.0 += 1;
            e.1 += usize::from(r.fired);
        }
        let kinds: Vec<String> = kinds
            .iter()
            .map(|(k, (n, f))| format!("{k}:{f}/{n}"))
            .collect();
        format!(
            "harness: runs={} duplicates={} losses={} aborted_records={} failed_runs={} fired={}/{} records_in={} seconds={:.0} seed={} kills_fired_by_kind=[{}]",
            self.runs.len(),
            self.duplicates(),
            self.losses(),
            self.aborted(),
            self.failed_runs(),
            self.fired(),
            self.runs.len(),
            self.runs.iter().map(|r| r.records_in).sum::<usize>(),
            self.seconds,
            self.seed,
            kinds.join(" ")
        )
    }
}

/// Run `runs` crash runs of the `onceflow` binary `bin` against `bootstrap`, printing one
/// line per run to stdout; see the module docs.
pub fn run(bin: &Path, bootstrap: &str, seed: u64, runs: usize) -> HarnessReport {
    run_with(&HarnessOptions::new(bin, bootstrap, seed, runs), |r| {
        println!("{}", r.line())
    })
}

/// As [`run`], with options, calling `each` with every run's report as it finishes.
pub fn run_with(opts: &HarnessOptions, mut each: impl FnMut(&RunReport)) -> HarnessReport {
    let started = Instant::now();
    let mut report = HarnessReport {
        seed: opts.seed,
        ..Default::default()
    };
    let _ = std::fs::create_dir_all(&opts.work_dir);
    let mut bin = opts.bin.clone();
    if opts.copy_binary {
        let copy = opts.work_dir.join("onceflow");
        match std::fs::copy(&opts.bin, &copy) {
            Ok(_) => bin = copy,
            Err(e) => eprintln!(
                "harness: cannot copy {} to {} ({e}); using it in place",
                opts.bin.display(),
                copy.display()
            ),
        }
    }
    for n in 1..=opts.runs {
        let seed = opts
            .seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(n as u64);
        let r = Run::new(opts, &bin, n, seed).execute();
        each(&r);
        report.runs.push(r);
    }
    report.seconds = started.elapsed().as_secs_f64();
    if !opts.keep_logs && report.ok() && opts.copy_binary {
        let _ = std::fs::remove_file(opts.work_dir.join("onceflow"));
        let _ = std::fs::remove_dir(&opts.work_dir);
    }
    report
}

/// How the victim is killed.
#[derive(Debug, Clone)]
enum KillPlan {
    /// SIGKILL after this long.
    Moment(Duration),
    /// `ONCEFLOW_FAILPOINTS=<name>=kill@<n>` from the start.
    Failpoint(&'static str, u32),
    /// SIGKILL after this long, wipe the state dir, restart with `restore.during=kill@<n>`.
    RestoreDuring(Duration, u32),
    /// Not a kill: SIGSTOP after the first duration, SIGCONT after the second (longer than
    /// the session timeout), so the group evicts the instance and it comes back a zombie
    /// with an open transaction of an old generation (opt-in kind `sigstop`).
    Stop(Duration, Duration),
    /// `ONCEFLOW_FAILPOINTS=<name>=stop@<n>`: the instance stops itself (SIGSTOP) at a
    /// transactional failpoint, with its transaction open (`eos.before_commit`: offsets
    /// already added); SIGCONT after the duration, longer than the session timeout, so it
    /// comes back a zombie in the exact window (opt-in kind `zombie`).
    Zombie(&'static str, u32, Duration),
}

/// Harnesses created in this process, for their work dirs.
static HARNESSES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Failpoints of the opt-in kind `zombie`.
const ZOMBIE_POINTS: &[&str] = &[
    failpoints::EOS_AFTER_CHANGELOG,
    failpoints::EOS_BEFORE_COMMIT,
];

/// Sets its flag when dropped.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// One synthetic input event.
struct Event {
    key: String,
    value: String,
}

/// The synthetic events of a run: ids `<run>-<n>`, ~25% repeats (half of them one of the
/// last 30 ids, a retry; half any id so far, possibly far apart, a relay replaying old
/// records), keyed by a function of the id, so that a repeat goes to the partition of its
/// first occurrence (dedup is partition-local).
struct Gen {
    run: usize,
    rng: StdRng,
    distinct: usize,
    seq: usize,
    /// A random Kafka key per event (else a function of the id).
    random_keys: bool,
}

impl Gen {
    fn next(&mut self) -> Event {
        let n = if self.distinct > 0 && self.rng.random_bool(0.25) {
            if self.rng.random_bool(0.5) {
                self.distinct - 1 - self.rng.random_range(0..self.distinct.min(30))
            } else {
                self.rng.random_range(0..self.distinct)
            }
        } else {
            self.distinct += 1;
            self.distinct - 1
        };
        let (run, seq) = (self.run, self.seq);
        self.seq += 1;
        let pad = "x".repeat(self.rng.random_range(0..120));
        let key = if self.random_keys {
            format!("r{}", self.rng.random::<u32>())
        } else {
            format!("k{}", n % 101)
        };
        Event {
            key,
            value: format!(r#"{{"id":"{run}-{n}","seq":{seq},"run":{run},"pad":"{pad}"}}"#),
        }
    }

    /// Every id generated so far.
    fn ids(&self) -> impl Iterator<Item = String> + '_ {
        (0..self.distinct).map(|n| format!("{}-{n}", self.run))
    }
}

/// Publish `n` events of `gen` to `topic` and wait for their delivery.
fn publish(
    p: &kafka::TestProducer,
    topic: &str,
    gen: &mut Gen,
    n: usize,
    timestamp: Option<i64>,
) -> Result<(), String> {
    for _ in 0..n {
        let e = gen.next();
        p.send(
            topic,
            None,
            Some(e.key.as_bytes()),
            Some(e.value.as_bytes()),
            &[],
            timestamp,
        )
        .map_err(|e| format!("publish to {topic}: {e}"))?;
    }
    p.flush().map_err(|e| format!("publish to {topic}: {e}"))
}

/// A running (or exited) instance.
struct Proc {
    slot: usize,
    gen: usize,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn label(&self) -> String {
        format!(
            "slot {} (start {}, log {})",
            self.slot,
            self.gen,
            self.log.display()
        )
    }

    fn wait_timeout(&mut self, t: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + t;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    fn kill9(&mut self) -> Option<ExitStatus> {
        self.signal(libc::SIGKILL);
        self.wait_timeout(Duration::from_secs(10))
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn status_text(st: &ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => format!("{st}"),
    }
}

/// One run and its state.
struct Run<'a> {
    opts: &'a HarnessOptions,
    bin: &'a Path,
    rng: StdRng,
    seed: u64,
    report: RunReport,
    input: String,
    output: String,
    dlq: String,
    app: String,
    changelog: String,
    /// The repartition topic (used with [`HarnessOptions::repartition`]).
    repartition: String,
    dir: PathBuf,
    topology: PathBuf,
    procs: Vec<Option<Proc>>,
    gens: Vec<usize>,
    intervals: Vec<u64>,
}

impl<'a> Run<'a> {
    fn new(opts: &'a HarnessOptions, bin: &'a Path, n: usize, seed: u64) -> Run<'a> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tag = format!("crash-{}-{:05}-r{n}", std::process::id(), nanos % 100_000);
        let app = format!("{tag}-app");
        let dir = opts.work_dir.join(format!("run-{n}"));
        Run {
            opts,
            bin,
            rng: StdRng::seed_from_u64(seed),
            seed,
            report: RunReport {
                run: n,
                ..Default::default()
            },
            input: format!("{tag}-in"),
            output: format!("{tag}-out"),
            dlq: format!("{tag}-dlq"),
            changelog: changelog_topic(&app, STORE),
            repartition: onceflow::__testkit::repartition_topic(&app, STORE),
            app,
            topology: dir.join("topology.yaml"),
            dir,
            procs: Vec::new(),
            gens: Vec::new(),
            intervals: Vec::new(),
        }
    }

    fn admin(&self) -> Result<Admin, String> {
        let cfg = Config::load_with_env(
            &[],
            &[("bootstrap.servers".into(), self.opts.bootstrap.clone())],
            std::iter::empty(),
        )
        .map_err(|e| e.to_string())?;
        Admin::new(&cfg).map_err(|e| e.to_string())
    }

    fn execute(mut self) -> RunReport {
        let started = Instant::now();
        self.report.names = format!(
            "input={} output={} dlq={} changelog={} application.id={} dir={}",
            self.input,
            self.output,
            self.dlq,
            self.changelog,
            self.app,
            self.dir.display()
        );
        if let Err(e) = self.body() {
            self.report.problems.push(e);
        }
        // Whatever happened, no instance outlives its run.
        for p in self.procs.iter_mut().flatten() {
            if let Ok(None) = p.child.try_wait() {
                p.kill9();
            }
        }
        self.procs.clear();
        self.report.seconds = started.elapsed().as_secs_f64();
        if self.report.ok() {
            self.cleanup();
        }
        self.report
    }

    fn cleanup(&mut self) {
        if let Ok(admin) = self.admin() {
            let topics = [
                &self.input,
                &self.output,
                &self.dlq,
                &self.changelog,
                &self.repartition,
            ];
            let topics: Vec<&str> = topics.iter().map(|s| s.as_str()).collect();
            if let Err(e) = admin.delete_topics(&topics) {
                eprintln!(
                    "harness: run {}: cannot delete topics: {e}",
                    self.report.run
                );
            }
        }
        let _ = kafka::delete_group(&self.opts.bootstrap, &self.app);
        if !self.opts.keep_logs {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn slot_dir(&self, slot: usize) -> PathBuf {
        self.dir.join(format!("slot-{slot}"))
    }

    fn body(&mut self) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        // 1. Topics, topology, input.
        let admin = self.admin()?;
        let keep = [("retention.ms", "-1"), ("retention.bytes", "-1")];
        for t in [&self.input, &self.output, &self.dlq] {
            admin
                .ensure_topic(t, PARTITIONS, &keep)
                .map_err(|e| format!("create topic {t}: {e}"))?;
        }
        let (prefix, key) = if self.opts.repartition && self.opts.prefix {
            (
                "  - map:\n      name: shape\n      set: { uid: 'value.id' }\n",
                "/uid",
            )
        } else {
            ("", "/id")
        };
        let yaml = format!(
            "name: crash-harness\nsource: {{ topic: {}, format: json }}\nstages:\n{prefix}  - dedup:\n      name: {STORE}\n      key: {{ json_pointer: {key} }}\n      ttl: 24h\n      time: event\n      partitioning: {}\n  - sink:\n      name: out\n      topic: {}\n",
            self.input,
            if self.opts.repartition {
                "repartition"
            } else {
                "source"
            },
            self.output
        );
        std::fs::write(&self.topology, yaml).map_err(|e| format!("topology: {e}"))?;

        let use_gh = self
            .rng
            .random_bool(self.opts.gharchive_probability.clamp(0.0, 1.0));
        self.report.gharchive = use_gh;
        let mut expected: HashSet<String> = HashSet::new();
        let producer =
            kafka::TestProducer::new(&self.opts.bootstrap).map_err(|e| format!("producer: {e}"))?;
        // With the real data (timestamps of 2015-01-01), the synthetic events carry the last
        // real timestamp, so that event time stays within the 24 h TTL for every id.
        let mut timestamp = None;
        if use_gh {
            let publish = if self.opts.repartition {
                gharchive::publish_random_keys
            } else {
                gharchive::publish
            };
            let rep = publish(&producer, &self.input, 2000, self.seed)
                .map_err(|e| format!("publish gharchive: {e}"))?;
            self.report.records_in += rep.published;
            let mut last = 0;
            for f in gharchive::hour_files() {
                for e in gharchive::read_hour(&f).map_err(|e| e.to_string())? {
                    last = last.max(e.timestamp_ms);
                    expected.insert(e.id);
                }
            }
            timestamp = Some(last);
        }
        // Part of the events before the instances start, the rest in paced chunks over
        // 3-8 s while they run; then, until the kill has happened (a failpoint needs
        // commits, and so input, to fire), more in smaller chunks.
        let total = self
            .rng
            .random_range(self.opts.min_events..=self.opts.max_events.max(self.opts.min_events));
        let mut gen = Gen {
            run: self.report.run,
            rng: StdRng::seed_from_u64(self.rng.random()),
            distinct: 0,
            seq: 0,
            random_keys: self.opts.repartition,
        };
        let first = (total as f64 * self.rng.random_range(0.1..0.7)) as usize;
        publish(&producer, &self.input, &mut gen, first, timestamp)?;
        drop(producer);
        let killed = Arc::new(AtomicBool::new(false));
        // However this function ends, the publisher stops extending the input.
        let _stop = SetOnDrop(killed.clone());
        let publisher = {
            let bs = self.opts.bootstrap.clone();
            let topic = self.input.clone();
            let killed = killed.clone();
            let mut rng = StdRng::seed_from_u64(self.rng.random());
            let rest = total - first;
            std::thread::spawn(move || -> Result<(usize, Gen), String> {
                let p = kafka::TestProducer::new(&bs).map_err(|e| e.to_string())?;
                let chunks = rng.random_range(10..=40usize);
                let pause = rng.random_range(3_000..=8_000) / chunks as u64;
                let mut sent = 0;
                for c in 0..chunks {
                    let n = rest * (c + 1) / chunks - rest * c / chunks;
                    publish(&p, &topic, &mut gen, n, timestamp)?;
                    sent += n;
                    std::thread::sleep(Duration::from_millis(pause));
                }
                let deadline = Instant::now() + FAILPOINT_WAIT;
                while !killed.load(Ordering::SeqCst) && Instant::now() < deadline {
                    let n = rng.random_range(20..=200);
                    publish(&p, &topic, &mut gen, n, timestamp)?;
                    sent += n;
                    std::thread::sleep(Duration::from_millis(rng.random_range(100..=300)));
                }
                Ok((first + sent, gen))
            })
        };

        // 2. Instances, the victim, the kill plan.
        let k = self.rng.random_range(1..=3usize);
        self.report.instances = k;
        self.procs = (0..k).map(|_| None).collect();
        self.gens = vec![0; k];
        self.intervals = (0..k).map(|_| self.rng.random_range(50..=200)).collect();
        let victim = self.rng.random_range(0..k);
        self.report.victim = victim;
        let kinds: Vec<&str> = std::iter::once("moment")
            .chain(FAILPOINTS.iter().copied())
            .filter(|k| {
                self.opts.kill_kinds.is_empty() || self.opts.kill_kinds.iter().any(|o| o == k)
            })
            .chain(
                self.opts
                    .kill_kinds
                    .iter()
                    .any(|o| o == "sigstop")
                    .then_some("sigstop"),
            )
            .chain(
                self.opts
                    .kill_kinds
                    .iter()
                    .any(|o| o == "zombie")
                    .then_some("zombie"),
            )
            .collect();
        if kinds.is_empty() {
            return Err(format!("no kill kind among {:?}", self.opts.kill_kinds));
        }
        let plan = match kinds[self.rng.random_range(0..kinds.len())] {
            "moment" => KillPlan::Moment(self.moment()),
            "sigstop" => KillPlan::Stop(
                self.moment(),
                Duration::from_millis(self.rng.random_range(7_000..=12_000)),
            ),
            "zombie" => KillPlan::Zombie(
                ZOMBIE_POINTS[self.rng.random_range(0..ZOMBIE_POINTS.len())],
                self.rng.random_range(1..=4u32),
                Duration::from_millis(self.rng.random_range(7_000..=12_000)),
            ),
            kind => {
                let name = FAILPOINTS
                    .iter()
                    .copied()
                    .find(|f| *f == kind)
                    .expect("a failpoint");
                let n = self.rng.random_range(1..=4u32);
                if name == failpoints::RESTORE_DURING {
                    KillPlan::RestoreDuring(self.moment(), n)
                } else {
                    KillPlan::Failpoint(name, n)
                }
            }
        };
        for slot in 0..k {
            let fp = match &plan {
                KillPlan::Failpoint(name, n) if slot == victim => Some(format!("{name}=kill@{n}")),
                KillPlan::Zombie(name, n, _) if slot == victim => Some(format!("{name}=stop@{n}")),
                _ => None,
            };
            self.start(slot, fp.as_deref(), &[])?;
        }

        // 3. The kill.
        let stop = matches!(plan, KillPlan::Stop(..) | KillPlan::Zombie(..));
        match plan {
            KillPlan::Stop(after, pause) => {
                self.report.kill = format!(
                    "sigstop@{:.2}s+{:.1}s",
                    after.as_secs_f64(),
                    pause.as_secs_f64()
                );
                std::thread::sleep(after);
                let p = self.procs[victim]
                    .as_ref()
                    .ok_or_else(|| format!("slot {victim} is not running"))?;
                p.signal(libc::SIGSTOP);
                std::thread::sleep(pause);
                p.signal(libc::SIGCONT);
                self.report.fired = true;
            }
            KillPlan::Zombie(name, n, pause) => {
                self.report.kill = format!("{name}=stop@{n}+{:.1}s", pause.as_secs_f64());
                let p = self.procs[victim]
                    .as_ref()
                    .ok_or_else(|| format!("slot {victim} is not running"))?;
                let needle = format!("failpoint {name}: stopped");
                let deadline = Instant::now() + FAILPOINT_WAIT;
                while !p.log_text().contains(&needle) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                if p.log_text().contains(&needle) {
                    std::thread::sleep(pause);
                    self.report.fired = true;
                }
                p.signal(libc::SIGCONT);
            }
            KillPlan::Moment(after) => {
                self.report.kill = format!("moment@{:.2}s", after.as_secs_f64());
                std::thread::sleep(after);
                self.kill_now(victim, "moment")?;
                self.report.fired = true;
            }
            KillPlan::Failpoint(name, n) => {
                self.report.kill = format!("{name}=kill@{n}");
                self.report.fired = self.await_failpoint(victim, name)?;
            }
            KillPlan::RestoreDuring(after, n) => {
                self.report.kill = format!(
                    "{}=kill@{n}+wipe(after moment@{:.2}s)",
                    failpoints::RESTORE_DURING,
                    after.as_secs_f64()
                );
                // Something to restore: every changelog partition has records.
                let deadline = Instant::now() + FAILPOINT_WAIT;
                while Instant::now() < deadline
                    && !high_watermarks(&self.opts.bootstrap, &self.changelog)
                        .is_ok_and(|h| h.iter().all(|h| *h > 0))
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                std::thread::sleep(after);
                self.kill_now(victim, "moment before the restore")?;
                self.wipe(victim)?;
                // Small fetches and a small prefetch queue, so that the restore takes
                // several steps and the n-th restore batch exists (by default one step
                // takes a whole changelog partition).
                self.start(
                    victim,
                    Some(&format!("{}=kill@{n}", failpoints::RESTORE_DURING)),
                    &[
                        ("kafka.consumer.max.partition.fetch.bytes", "4096".into()),
                        ("kafka.consumer.queued.max.messages.kbytes", "1".into()),
                    ],
                )?;
                self.report.fired = self.await_failpoint(victim, failpoints::RESTORE_DURING)?;
            }
        }
        killed.store(true, Ordering::SeqCst);
        if stop {
            // The zombie goes on; if it stops by itself (fenced), it is restarted.
            std::thread::sleep(Duration::from_secs(3));
            let p = self.procs[victim]
                .as_mut()
                .ok_or_else(|| format!("slot {victim} is not running"))?;
            if let Ok(Some(st)) = p.child.try_wait() {
                let _ = write!(self.report.kill, "+exited({})", status_text(&st));
                self.start(victim, None, &[])?;
            }
            return self.finish(publisher, expected);
        }
        // Restart the victim: mostly after a short pause; with other instances, sometimes
        // only after its session has expired, so that the survivors take its partitions
        // over (and wait for its open transaction, which only the restart aborts). Sometimes
        // with its state wiped.
        let pause = if k > 1 && self.rng.random_bool(0.25) {
            self.rng.random_range(7_000..=10_000)
        } else {
            self.rng.random_range(0..=1500)
        };
        self.report.restart_after_ms = pause;
        std::thread::sleep(Duration::from_millis(pause));
        if self.rng.random_bool(1.0 / 3.0) {
            self.wipe(victim)?;
            self.report.wiped = true;
        }
        self.start(victim, None, &[])?;
        self.finish(publisher, expected)
    }

    /// Steps 4 and 5: everything published, everything committed, SIGTERM; the output.
    fn finish(
        &mut self,
        publisher: std::thread::JoinHandle<Result<(usize, Gen), String>>,
        mut expected: HashSet<String>,
    ) -> Result<(), String> {
        match publisher.join() {
            Ok(Ok((n, gen))) => {
                self.report.records_in += n;
                expected.extend(gen.ids());
                self.report.distinct = expected.len();
            }
            Ok(Err(e)) => return Err(format!("publisher: {e}")),
            Err(_) => return Err("publisher panicked".into()),
        }
        let ends = high_watermarks(&self.opts.bootstrap, &self.input)?;
        let total: i64 = ends.iter().sum();
        if total as usize != self.report.records_in {
            self.report.problems.push(format!(
                "input holds {total} records, {} were published",
                self.report.records_in
            ));
        }
        self.await_committed(&ends);
        self.stop_all();

        // 5. The output.
        self.check_output(&expected)
    }

    /// A random kill moment: 0.2–3 s.
    fn moment(&mut self) -> Duration {
        Duration::from_millis(self.rng.random_range(200..=3000))
    }

    /// Start instance `slot` (its `gen`-th start), with `failpoints` if given and `extra`
    /// config keys.
    fn start(
        &mut self,
        slot: usize,
        failpoints: Option<&str>,
        extra: &[(&str, String)],
    ) -> Result<(), String> {
        self.gens[slot] += 1;
        let gen = self.gens[slot];
        let log = self.dir.join(format!("slot-{slot}-start-{gen}.log"));
        let f = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let f2 = f.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(self.bin);
        cmd.arg("run").arg(&self.topology);
        let mut sets = vec![
            ("bootstrap.servers", self.opts.bootstrap.clone()),
            ("application.id", self.app.clone()),
            ("state.dir", self.slot_dir(slot).display().to_string()),
            ("dlq.topic", self.dlq.clone()),
            ("processing.guarantee", "exactly_once_v2".into()),
            ("instance.id", slot.to_string()),
            ("commit.interval.ms", self.intervals[slot].to_string()),
            ("kafka.session.timeout.ms", "6000".into()),
            // Several instances run at once: any free port for /health, /ready, /metrics.
            ("http.address", "127.0.0.1:0".into()),
        ];
        sets.extend(extra.iter().cloned());
        sets.extend(
            self.opts
                .extra_sets
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone())),
        );
        for (k, v) in sets {
            cmd.arg("--set").arg(format!("{k}={v}"));
        }
        // The instance's config is the --set flags above: none of the harness's own
        // ONCEFLOW_* variables (ONCEFLOW_BIN, a config layer ONCEFLOW__*) may reach it.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if k.starts_with("ONCEFLOW_") && k != "ONCEFLOW_LOG" {
                cmd.env_remove(&*k);
            }
        }
        cmd.env("ONCEFLOW_BOOTSTRAP_SERVERS", &self.opts.bootstrap);
        if std::env::var_os("ONCEFLOW_LOG").is_none() {
            cmd.env("ONCEFLOW_LOG", "info");
        }
        if let Some(fp) = failpoints {
            cmd.env("ONCEFLOW_FAILPOINTS", fp);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(f))
            .stderr(Stdio::from(f2));
        let child = cmd
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", self.bin.display()))?;
        self.procs[slot] = Some(Proc {
            slot,
            gen,
            child,
            log,
        });
        Ok(())
    }

    fn wipe(&mut self, slot: usize) -> Result<(), String> {
        let d = self.slot_dir(slot);
        match std::fs::remove_dir_all(&d) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("wipe {}: {e}", d.display())),
        }
    }

    /// SIGKILL `slot` now; a slot that already exited is a problem.
    fn kill_now(&mut self, slot: usize, why: &str) -> Result<(), String> {
        let p = self.procs[slot]
            .as_mut()
            .ok_or_else(|| format!("slot {slot} is not running"))?;
        if let Ok(Some(st)) = p.child.try_wait() {
            let msg = format!(
                "{} exited by itself ({}) before the {why} kill",
                p.label(),
                status_text(&st)
            );
            self.report.problems.push(msg);
            return Ok(());
        }
        if p.kill9().is_none() {
            return Err(format!("{} did not die on SIGKILL", p.label()));
        }
        Ok(())
    }

    /// Wait for the victim to kill itself at `name`; if it does not within the wait, kill it
    /// now. Returns whether the failpoint fired.
    fn await_failpoint(&mut self, slot: usize, name: &str) -> Result<bool, String> {
        let p = self.procs[slot]
            .as_mut()
            .ok_or_else(|| format!("slot {slot} is not running"))?;
        match p.wait_timeout(FAILPOINT_WAIT) {
            Some(st) => {
                let fired = p
                    .log_text()
                    .contains(&format!("failpoint {name}: killing the process"));
                if !fired || st.signal() != Some(libc::SIGKILL) {
                    let msg = format!(
                        "{} exited ({}) without its failpoint {name} firing",
                        p.label(),
                        status_text(&st)
                    );
                    self.report.problems.push(msg);
                }
                Ok(fired)
            }
            None => {
                if p.kill9().is_none() {
                    return Err(format!("{} did not die on SIGKILL", p.label()));
                }
                Ok(false)
            }
        }
    }

    /// Wait until the group's committed offsets reach `ends`; an instance that exits by
    /// itself meanwhile is a problem (and is restarted, at most 3 times).
    fn await_committed(&mut self, ends: &[i64]) {
        let deadline = Instant::now() + COMMIT_WAIT;
        let mut restarts = 0;
        let mut last = Vec::new();
        loop {
            for slot in 0..self.procs.len() {
                let exited =
                    match self.procs[slot].as_mut() {
                        Some(p) => p.child.try_wait().ok().flatten().map(|st| {
                            format!("{} exited by itself ({})", p.label(), status_text(&st))
                        }),
                        None => None,
                    };
                if let Some(msg) = exited {
                    self.report.problems.push(msg);
                    // Keep its log; restart it (at most 3 times in all) or leave the slot empty.
                    self.procs[slot] = None;
                    if restarts < 3 {
                        restarts += 1;
                        if let Err(e) = self.start(slot, None, &[]) {
                            self.report.problems.push(e);
                        }
                    }
                }
            }
            if self.procs.iter().all(Option::is_none) {
                self.report.problems.push(format!(
                    "no instance left running (restarted {restarts} times); committed offsets {last:?}, input end {ends:?}"
                ));
                return;
            }
            match kafka::committed_offsets(&self.opts.bootstrap, &self.app, &self.input, PARTITIONS)
            {
                Ok(c) => {
                    let done = ends
                        .iter()
                        .zip(&c)
                        .all(|(end, c)| *end == 0 || c.is_some_and(|c| c >= *end));
                    if done && (!self.opts.repartition || self.repartition_consumed()) {
                        return;
                    }
                    last = c;
                }
                Err(e) => {
                    if Instant::now() >= deadline {
                        self.report.problems.push(format!("committed offsets: {e}"));
                        return;
                    }
                }
            }
            if Instant::now() >= deadline {
                self.report.problems.push(format!(
                    "committed offsets {last:?} did not reach the input end {ends:?} within {COMMIT_WAIT:?}"
                ));
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// With the hop, once the source is committed to its end (no router writes any more):
    /// whether every repartition record is consumed and committed, i.e. each partition's
    /// committed offset is past its last record visible read_committed. (Not the high
    /// watermark: under exactly_once_v2 a partition may end with transaction markers and
    /// aborted records, which a committed offset never passes.) While a transaction is
    /// open on the topic (a killed instance's, until it is fenced or times out), the
    /// answer is no: a read_committed read ends where that transaction began, before the
    /// records other instances committed after it, which the stages have yet to read.
    fn repartition_consumed(&self) -> bool {
        let bs = &self.opts.bootstrap;
        if kafka::transaction_open(bs, &self.repartition, PARTITIONS).unwrap_or(true) {
            return false;
        }
        let Ok(records) = kafka::read_topic(bs, &self.repartition, true, Duration::from_secs(5))
        else {
            return false;
        };
        let Ok(c) = kafka::committed_offsets(bs, &self.app, &self.repartition, PARTITIONS) else {
            return false;
        };
        let mut last = [None::<i64>; PARTITIONS];
        for r in &records {
            if let Some(l) = last.get_mut(r.partition as usize) {
                *l = Some(l.map_or(r.offset, |o: i64| o.max(r.offset)));
            }
        }
        last.iter()
            .zip(&c)
            .all(|(last, c)| last.is_none_or(|l| c.is_some_and(|c| c > l)))
    }

    /// SIGTERM every instance at once; each must exit 0.
    fn stop_all(&mut self) {
        for p in self.procs.iter().flatten() {
            p.signal(libc::SIGTERM);
        }
        for slot in 0..self.procs.len() {
            let Some(mut p) = self.procs[slot].take() else {
                continue;
            };
            match p.wait_timeout(STOP_WAIT) {
                Some(st) if st.success() => {}
                Some(st) => self.report.problems.push(format!(
                    "{} exited {} on SIGTERM, not 0",
                    p.label(),
                    status_text(&st)
                )),
                None => {
                    self.report.problems.push(format!(
                        "{} did not exit within {STOP_WAIT:?} of SIGTERM",
                        p.label()
                    ));
                    p.kill9();
                }
            }
        }
    }

    fn check_output(&mut self, expected: &HashSet<String>) -> Result<(), String> {
        let bs = &self.opts.bootstrap;
        let committed = kafka::read_topic(bs, &self.output, true, READ_WAIT)
            .map_err(|e| format!("read {} read_committed: {e}", self.output))?;
        let uncommitted = kafka::read_topic(bs, &self.output, false, READ_WAIT)
            .map_err(|e| format!("read {} read_uncommitted: {e}", self.output))?;
        let dlq = kafka::read_topic(bs, &self.dlq, true, READ_WAIT)
            .map_err(|e| format!("read {}: {e}", self.dlq))?;
        self.report.output_committed = committed.len();
        self.report.output_uncommitted = uncommitted.len();
        self.report.aborted = uncommitted.len().saturating_sub(committed.len());
        self.report.dead_letters = dlq.len();

        let mut seen: HashMap<String, Vec<(i32, i64)>> = HashMap::new();
        for r in &committed {
            match json_id(r.value.as_deref()) {
                Some(id) if expected.contains(&id) => {
                    seen.entry(id).or_default().push((r.partition, r.offset))
                }
                _ => self.report.unexpected += 1,
            }
        }
        self.report.duplicates = seen.values().map(|v| v.len() - 1).sum();
        let lost: Vec<&String> = expected
            .iter()
            .filter(|id| !seen.contains_key(*id))
            .collect();
        self.report.losses = lost.len();
        if self.report.duplicates == 0 && lost.is_empty() {
            return Ok(());
        }
        // Where the bad ids were in the input, for the diagnosis.
        let mut input_pos: HashMap<String, Vec<(i32, i64)>> = HashMap::new();
        if let Ok(recs) = kafka::read_topic(bs, &self.input, true, READ_WAIT) {
            for r in recs {
                if let Some(id) = json_id(r.value.as_deref()) {
                    input_pos
                        .entry(id)
                        .or_default()
                        .push((r.partition, r.offset));
                }
            }
        }
        let fmt = |v: Option<&Vec<(i32, i64)>>| -> String {
            v.map(|v| {
                v.iter()
                    .map(|(p, o)| format!("p{p}@{o}"))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default()
        };
        let mut dups: Vec<(&String, &Vec<(i32, i64)>)> =
            seen.iter().filter(|(_, v)| v.len() > 1).collect();
        dups.sort();
        for (id, at) in dups.into_iter().take(10) {
            self.report.duplicate_samples.push(format!(
                "{id}: output {} input {}",
                fmt(Some(at)),
                fmt(input_pos.get(id))
            ));
        }
        let mut lost = lost;
        lost.sort();
        for id in lost.into_iter().take(10) {
            self.report
                .loss_samples
                .push(format!("{id}: input {}", fmt(input_pos.get(id))));
        }
        Ok(())
    }
}

/// The `/id` of a JSON value, as text (numbers as their decimal text).
fn json_id(v: Option<&[u8]>) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(v?).ok()?;
    match &v["id"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The high watermark of each partition of `topic`.
fn high_watermarks(bootstrap: &str, topic: &str) -> Result<Vec<i64>, String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "onceflow-harness-watermarks")
        .set("enable.auto.commit", "false")
        .create()
        .map_err(|e| format!("watermark consumer: {e}"))?;
    (0..PARTITIONS as i32)
        .map(|p| {
            consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .map(|(_, hi)| hi)
                .map_err(|e| format!("watermarks of {topic}/{p}: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary counts a zombie stop as `zombie`, not as the failpoint it stopped at
    /// (it did: seeds 1205 and 1206 were reported as drawing no zombie).
    #[test]
    fn the_summary_counts_each_kind_of_kill_apart() {
        let run = |kill: &str, fired: bool| RunReport {
            kill: kill.into(),
            fired,
            ..Default::default()
        };
        let report = HarnessReport {
            seed: 7,
            runs: vec![
                run("eos.after_changelog=stop@3+10.0s", true),
                run("eos.after_changelog=kill@2", true),
                run("eos.before_commit=stop@1+8.5s", false),
                run("sigstop@1.13s+9.2s", true),
                run("moment@0.54s", true),
                run("restore.during=kill@4+wipe(after moment@0.71s)", false),
            ],
            seconds: 1.0,
        };
        let kinds: Vec<&str> = report.runs.iter().map(RunReport::kind).collect();
        assert_eq!(
            kinds,
            [
                "zombie",
                "eos.after_changelog",
                "zombie",
                "sigstop",
                "moment",
                "restore.during"
            ]
        );
        let line = report.summary_line();
        assert!(
            line.ends_with(
                "kills_fired_by_kind=[eos.after_changelog:1/1 moment:1/1 restore.during:0/1 sigstop:1/1 zombie:1/2]"
            ),
            "{line}"
        );
    }
}
