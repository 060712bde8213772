//! `onceflow run` start-up faults, without a broker (bootstrap 127.0.0.1:1, nothing
//! listening): exit 2 for a config fault (fix it and start again), 1 for a failure outside
//! onceflow (a restart resumes); SIGTERM stops the run, also while the broker is still out
//! of reach.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_onceflow");

fn topology() -> String {
    format!(
        "{}/topologies/gharchive-dedup.yaml",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn base(state: &std::path::Path) -> Command {
    let mut c = Command::new(BIN);
    c.arg("run")
        .arg(topology())
        .args([
            "--set",
            "bootstrap.servers=127.0.0.1:1",
            "--set",
            "http.address=off",
        ])
        .arg("--set")
        .arg(format!("state.dir={}", state.display()))
        .env_remove("ONCEFLOW_BOOTSTRAP_SERVERS");
    c
}

/// A property that librdkafka refuses is a config fault: exit 2, naming the key.
#[test]
fn a_bad_kafka_property_is_a_config_fault_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (how, env) in [("set", false), ("env", true)] {
        let mut c = base(dir.path());
        if env {
            c.env("ONCEFLOW__KAFKA__LINGER__MS", "abc");
        } else {
            c.args(["--set", "kafka.linger.ms=abc"]);
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{how}: {err}");
        assert!(
            err.contains("kafka.linger.ms"),
            "{how}: names the key: {err}"
        );
        assert!(err.contains("\"abc\""), "{how}: names the value: {err}");
    }
}

/// Run a second instance with `args` on `state` while a first one holds it.
fn while_another_runs(state: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut first = base(state)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let out = base(state).args(args).output().unwrap();
    let _ = first.kill();
    let _ = first.wait();
    out
}

/// A second instance on a state.dir in use is told to fix it (as a port in use): exit 2.
#[test]
fn a_locked_state_dir_is_a_config_fault() {
    let dir = tempfile::tempdir().unwrap();
    let out = while_another_runs(dir.path(), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("locked"), "{err}");
    assert_eq!(out.status.code(), Some(2), "{err}");
}

/// Under `log.format = json` the reason a run stops is a JSON line too (a log shipper
/// reading JSON lines would drop a plain one, the very line that explains the exit).
#[test]
fn the_reason_a_run_stops_is_a_json_line_under_log_format_json() {
    let dir = tempfile::tempdir().unwrap();
    let out = while_another_runs(dir.path(), &["--set", "log.format=json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let last = lines.last().expect("a reason");
    assert_eq!(last["level"], "ERROR", "{last}");
    assert!(
        last["fields"]["message"]
            .as_str()
            .unwrap()
            .contains("locked"),
        "{last}"
    );
    assert!(last["fields"]["hint"].is_string(), "{last}");
}

/// The exit code of `child` once it exits; killed and a panic with `why` if it still runs
/// 15 s from now.
fn exit_within_15_s(child: &mut std::process::Child, why: &str) -> Option<i32> {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        if t0.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{why}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One SIGTERM while start-up waits for the broker (metadata retried for up to 2 min)
/// stops the run: exit 0, without a second signal (130).
#[test]
fn sigterm_during_start_up_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = base(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let code = exit_within_15_s(&mut child, "still running 15 s after SIGTERM");
    assert_eq!(
        code,
        Some(0),
        "a second signal was needed, or the stop failed"
    );
}

fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let code = text[9..12].parse().unwrap();
    let body = text.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    (code, body.to_string())
}

/// While start-up cannot reach any broker, `/ready` answers 503 with
/// `"broker_reachable":false` (it said true: only the run loop's clients reported "all
/// brokers down", the start-up admin client did not; found by a review helper).
#[test]
fn ready_says_the_broker_is_unreachable_during_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = base(dir.path())
        .args(["--set", "http.address=127.0.0.1:0"])
        .env("ONCEFLOW_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut addr = None;
    let mut down = false;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) && !(addr.is_some() && down) {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            if let Some(a) = line.split("address=").nth(1) {
                addr = Some(a.split_whitespace().next().unwrap().to_string());
            }
            down |= line.contains("every broker is unreachable");
        }
    }
    let got = addr.as_ref().map(|a| http_get(a, "/ready"));
    let _ = child.kill();
    let _ = child.wait();
    let (code, body) = got.expect("no `http listening` line");
    assert!(down, "start-up never noted every broker down");
    assert_eq!(code, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["broker_reachable"], serde_json::json!(false), "{body}");
}

/// `kafka.bootstrap.servers` passes librdkafka's own `bootstrap.servers` to the consumer and
/// producer while start-up's admin client and the tools use onceflow's `bootstrap.servers`:
/// a user who writes it under `[kafka]` in a config file gets clients on one cluster and
/// topic checks on another (here: start-up waits for an unreachable broker, `--stop-at-end`
/// never ends). Like `group.id` and `transactional.id`, it is onceflow's to set: a config
/// fault naming the key and pointing at `bootstrap.servers` (found by review 10).
#[test]
fn kafka_bootstrap_servers_is_a_config_fault_pointing_at_bootstrap_servers() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = base(dir.path())
        .args([
            "--set",
            "kafka.bootstrap.servers=127.0.0.1:2",
            "--stop-at-end",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let code = exit_within_15_s(
        &mut child,
        "kafka.bootstrap.servers was taken: still starting after 15 s",
    );
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("kafka.bootstrap.servers"),
        "names the key: {err}"
    );
}
