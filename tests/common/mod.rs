//! Shared helpers of the integration tests: unique names, topics, the onceflow binary.
#![allow(dead_code)]

use onceflow::Config;
use onceflow_testkit::kafka::Admin;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The broker under test; fails clearly when the suite is run without one.
pub fn bootstrap() -> String {
    std::env::var("ONCEFLOW_BOOTSTRAP_SERVERS").expect(
        "ONCEFLOW_BOOTSTRAP_SERVERS is not set: run the suite with scripts/test, which starts a broker",
    )
}

/// A name unique to this test run, e.g. `it-<pid>-<n>-<what>`.
pub fn unique(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "it-{}-{}-{}-{what}",
        std::process::id(),
        nanos % 100_000,
        N.fetch_add(1, Ordering::SeqCst)
    )
}

pub fn admin() -> Admin {
    let cfg = Config::load(&[], &[("bootstrap.servers".into(), bootstrap())]).unwrap();
    Admin::new(&cfg).unwrap()
}

/// Create topics with `partitions` partitions and no time or size retention.
pub fn create_topics(topics: &[&str], partitions: usize) {
    let a = admin();
    for t in topics {
        a.ensure_topic(
            t,
            partitions,
            &[("retention.ms", "-1"), ("retention.bytes", "-1")],
        )
        .unwrap();
    }
}

/// Names of one isolated run of a topology: input, output, dlq topics, app id, state dir.
pub struct Names {
    pub input: String,
    pub output: String,
    pub dlq: String,
    pub app: String,
    pub state: tempfile::TempDir,
    pub topology: PathBuf,
}

/// An isolated run of a topology given as YAML text with `{input}` and `{output}` holes.
pub fn names_for(yaml: &str, partitions: usize) -> Names {
    let names = names_without_topics(yaml);
    create_topics(&[&names.input, &names.output, &names.dlq], partitions);
    names
}

/// As [`names_for`], creating no topic (for a broker other than [`bootstrap`]).
pub fn names_without_topics(yaml: &str) -> Names {
    let input = unique("in");
    let output = unique("out");
    let dlq = unique("dlq");
    let app = unique("app");
    let state = tempfile::tempdir().unwrap();
    let topology = state.path().join("topology.yaml");
    std::fs::write(
        &topology,
        yaml.replace("{input}", &input).replace("{output}", &output),
    )
    .unwrap();
    Names {
        input,
        output,
        dlq,
        app,
        state,
        topology,
    }
}

impl Names {
    /// The default state dir of `start` (instance 0).
    pub fn state_dir(&self) -> PathBuf {
        self.state.path().join("state")
    }
}

/// Copy the shipped gharchive topology with its topic names replaced by unique ones.
pub fn gharchive_names(partitions: usize) -> Names {
    names_for(&gharchive_yaml(), partitions)
}

/// As [`gharchive_names`], creating no topic.
pub fn gharchive_names_no_topics() -> Names {
    names_without_topics(&gharchive_yaml())
}

/// The shipped gharchive topology with `{input}` / `{output}` holes for its topics.
fn gharchive_yaml() -> String {
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/topologies/gharchive-dedup.yaml"
    ))
    .unwrap();
    assert!(shipped.contains("gharchive.events") && shipped.contains("gharchive.unique"));
    shipped
        .replace("gharchive.events", "{input}")
        .replace("gharchive.unique", "{output}")
}

/// The distinct event ids of the shipped GH Archive data.
pub fn gharchive_distinct_ids() -> std::collections::HashSet<String> {
    onceflow_testkit::gharchive::hour_files()
        .iter()
        .flat_map(|f| onceflow_testkit::gharchive::read_hour(f).unwrap())
        .map(|e| e.id)
        .collect()
}

/// A running `onceflow run`, with its stderr collected.
pub struct Running {
    pub child: Child,
    pub stderr: Arc<Mutex<String>>,
    stdout: Option<std::process::ChildStdout>,
}

impl Running {
    /// Wait until stderr contains `needle`.
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.stderr.lock().unwrap().contains(needle) {
            if let Some(st) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "onceflow exited ({st}) before logging {needle:?}:\n{}",
                    self.stderr.lock().unwrap()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the log within {timeout:?}:\n{}",
                self.stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait for exit; returns (exit status, stdout).
    pub fn wait(mut self, timeout: Duration) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                let mut out = String::new();
                if let Some(mut s) = self.stdout.take() {
                    use std::io::Read;
                    s.read_to_string(&mut out).unwrap();
                }
                return (st, out);
            }
            if Instant::now() > deadline {
                let stacks = thread_stacks(self.child.id());
                let _ = self.child.kill();
                panic!(
                    "onceflow did not exit within {timeout:?}; log:\n{}\n{stacks}",
                    self.stderr.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Send a signal.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }
}

/// Every thread's stack of process `pid`, from gdb (when installed), for the message of a
/// test that found the process hung; a line saying why when there are none.
pub fn thread_stacks(pid: u32) -> String {
    let out = Command::new("timeout")
        .args(["60", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "set pagination off", "-ex", "thread apply all bt 40"])
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => format!(
            "thread stacks of pid {pid} (gdb):\n{}",
            String::from_utf8_lossy(&o.stdout)
        ),
        Ok(o) => format!(
            "no thread stacks of pid {pid}: gdb exited {:?}: {}",
            o.status.code(),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => format!("no thread stacks of pid {pid}: cannot run gdb: {e}"),
    }
}

/// A test that fails (panics) with instances still running does not leave them behind:
/// they would run on, holding CPU and group members, while the rest of the suite runs.
impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Event time for synthetic events published next to the GH Archive hours: 2015-01-01T02:00Z,
/// right after the two hours. Stamped with the wall clock instead, they move a partition's
/// stream time on by years, and the expiry sweep then deletes the GH events' marks (TTL 24 h
/// plus grace, counted in stream time) while copies of those events may still be on their
/// way: copies that arrive later pass again, as the dedup contract allows after expiry.
/// (Seen under churn with a repartition hop, where routers deliver each source partition's
/// records at their own pace.)
pub const SYNTHETIC_EVENT_MS: i64 = 1_420_077_600_000;

/// Start `onceflow run <topology> --set k=v ... [extra args]` with `env` added.
pub fn start(
    names: &Names,
    sets: &[(&str, String)],
    env: &[(&str, &str)],
    extra: &[&str],
) -> Running {
    start_in(None, names, sets, env, extra)
}

/// As [`start`], with the working directory `cwd` (default: the test's).
pub fn start_in(
    cwd: Option<&std::path::Path>,
    names: &Names,
    sets: &[(&str, String)],
    env: &[(&str, &str)],
    extra: &[&str],
) -> Running {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_onceflow"));
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    cmd.arg("run").arg(&names.topology);
    let mut all: Vec<(String, String)> = vec![
        ("application.id".into(), names.app.clone()),
        (
            "state.dir".into(),
            names.state.path().join("state").display().to_string(),
        ),
        ("dlq.topic".into(), names.dlq.clone()),
        // Tests run instances in parallel: any free port (a test may set its own).
        ("http.address".into(), "127.0.0.1:0".into()),
    ];
    all.extend(sets.iter().map(|(k, v)| (k.to_string(), v.clone())));
    for (k, v) in all {
        cmd.arg("--set").arg(format!("{k}={v}"));
    }
    cmd.args(extra);
    cmd.env("ONCEFLOW_BOOTSTRAP_SERVERS", bootstrap());
    // `ONCEFLOW_TEST_CHILD_LOG` overrides the instance's log filter (e.g.
    // `info,librdkafka=debug` with `ONCEFLOW__KAFKA__PRODUCER__DEBUG=broker,topic`).
    let log = std::env::var("ONCEFLOW_TEST_CHILD_LOG").unwrap_or_else(|_| "info".into());
    cmd.env("ONCEFLOW_LOG", log);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let stderr = Arc::new(Mutex::new(String::new()));
    let err = child.stderr.take().unwrap();
    let sink = stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let mut s = sink.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    let stdout = child.stdout.take();
    Running {
        child,
        stderr,
        stdout,
    }
}

/// Parse `key=value` from the `summary:` line of stdout.
pub fn summary_field(stdout: &str, key: &str) -> Option<f64> {
    let line = stdout.lines().find(|l| l.starts_with("summary:"))?;
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
}

/// The `/id` of a JSON value.
pub fn json_id(v: Option<&[u8]>) -> String {
    let v: serde_json::Value = serde_json::from_slice(v.unwrap_or_default()).unwrap();
    match &v["id"] {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub fn path_of(p: &Path) -> String {
    p.display().to_string()
}
