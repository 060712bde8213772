//! Named failpoints in the commit protocol, for crash tests.
//!
//! Chosen by the environment variable `ONCEFLOW_FAILPOINTS`, a comma-separated list of
//! `name=action[@n]`: `action` is `kill` (the process sends itself SIGKILL: no cleanup, no
//! commit) or `pause` (log `failpoint <name>: paused` and stop here forever, so a test can
//! SIGKILL the process at that exact moment) or `stop` (log `failpoint <name>: stopped` and
//! send itself SIGSTOP; after a SIGCONT it goes on from there: a zombie in the making) or
//! `delay` (sleep 250 ms at the n-th hit and every later one: a slow restore for the
//! tests of `/ready`, a slow state writer for those of a stop) or `panic` (panic there: a
//! stand-in for a bug, for the test that a panic ends the process); `@n` fires on the n-th
//! hit (default 1).
//! Off, a failpoint costs one relaxed atomic load.
//!
//! The names, and where in the commit each point is, are in [`super::commit`]
//! ([`super::commit::FAILPOINTS`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

/// Failpoint names, to validate `ONCEFLOW_FAILPOINTS`.
pub(crate) const NAMES: &[&str] = super::commit::FAILPOINTS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Kill,
    Pause,
    Stop,
    Delay,
    Panic,
}

struct Point {
    action: Action,
    at: u64,
    hits: AtomicU64,
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static POINTS: OnceLock<HashMap<String, Point>> = OnceLock::new();

/// Read `ONCEFLOW_FAILPOINTS`; call once at start-up.
///
/// # Errors
/// A config error naming the bad entry (unknown name or action).
pub(crate) fn init_from_env() -> crate::Result<()> {
    let Ok(spec) = std::env::var("ONCEFLOW_FAILPOINTS") else {
        return Ok(());
    };
    let mut points = HashMap::new();
    for entry in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad =
            |why: &str| crate::Error::Config(format!("ONCEFLOW_FAILPOINTS entry {entry:?}: {why}"));
        let (name, rest) = entry
            .split_once('=')
            .ok_or_else(|| bad("expected name=action[@n]"))?;
        if !NAMES.contains(&name) {
            return Err(bad(&format!(
                "unknown failpoint; known: {}",
                NAMES.join(", ")
            )));
        }
        let (action, at) = match rest.split_once('@') {
            Some((a, n)) => (a, n.parse::<u64>().map_err(|_| bad("@n must be a number"))?),
            None => (rest, 1),
        };
        let action = match action {
            "kill" => Action::Kill,
            "pause" => Action::Pause,
            "stop" => Action::Stop,
            "delay" => Action::Delay,
            "panic" => Action::Panic,
            _ => return Err(bad("action must be kill, pause, stop, delay or panic")),
        };
        points.insert(
            name.to_string(),
            Point {
                action,
                at,
                hits: AtomicU64::new(0),
            },
        );
    }
    let _ = POINTS.set(points);
    ENABLED.store(true, Ordering::Relaxed);
    crate::state::set_before_chunk(|| hit(super::commit::STATE_WRITE));
    Ok(())
}

/// Pass failpoint `name`: does nothing unless it is armed and this is its n-th hit.
#[inline]
pub(crate) fn hit(name: &str) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    fire(name);
}

#[cold]
fn fire(name: &str) {
    let Some(p) = POINTS.get().and_then(|m| m.get(name)) else {
        return;
    };
    let n = p.hits.fetch_add(1, Ordering::SeqCst) + 1;
    if n != p.at && !(p.action == Action::Delay && n > p.at) {
        return;
    }
    match p.action {
        Action::Kill => {
            eprintln!("failpoint {name}: killing the process");
            // SAFETY: kill(2) on our own pid with a valid signal has no memory effects.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        Action::Stop => {
            eprintln!("failpoint {name}: stopped");
            // SAFETY: kill(2) on our own pid with a valid signal has no memory effects.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGSTOP);
            }
            eprintln!("failpoint {name}: continued");
        }
        Action::Delay => std::thread::sleep(std::time::Duration::from_millis(250)),
        Action::Panic => panic!("failpoint {name}: panic (a stand-in for a bug)"),
        Action::Pause => {
            eprintln!("failpoint {name}: paused");
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
    }
}
