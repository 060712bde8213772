//! Faults of the state dir under exactly_once_v2, on the real broker and the GH Archive data:
//! a state dir that fills up (a small tmpfs), and a sled database truncated or garbled on
//! disk (set aside at start-up, restored from the changelog). The
//! changelog is the truth: whatever happens to the local store, read_committed output keeps
//! every id exactly once.

mod common;

use common::*;
use onceflow_testkit::{gharchive, kafka};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(240);

fn eos() -> Vec<(&'static str, String)> {
    vec![
        ("processing.guarantee", "exactly_once_v2".into()),
        ("commit.interval.ms", "100".into()),
    ]
}

fn output_counts(topic: &str) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in kafka::read_topic(&bootstrap(), topic, true, T).unwrap() {
        *m.entry(json_id(r.value.as_deref())).or_default() += 1;
    }
    m
}

/// Every distinct id exactly once in `topic`, read_committed; prints the fault table row.
fn assert_each_id_once(fault: &str, topic: &str, restarts: usize) {
    let counts = output_counts(topic);
    let ids = gharchive_distinct_ids();
    let duplicates: usize = counts.values().map(|n| n - 1).sum();
    let losses = ids.iter().filter(|id| !counts.contains_key(*id)).count();
    eprintln!(
        "fault: {fault:<48} {:<16} {:>4} {duplicates:>10} {losses:>6} {restarts:>8}",
        "exactly_once_v2", 1
    );
    assert_eq!((duplicates, losses), (0, 0), "{fault}: duplicates, losses");
}

/// A tmpfs mounted for the test's lifetime; `None` where mounting is not allowed.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs { dir })
    }

    fn resize(&self, size: &str) {
        let st = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(self.dir.path())
            .status()
            .unwrap();
        assert!(st.success(), "remount the tmpfs with {size}");
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

#[test]
fn a_full_state_dir_stops_the_instance_clearly_and_a_restart_with_space_loses_and_repeats_nothing()
{
    let Some(fs) = Tmpfs::mount("1m") else {
        eprintln!("*** SKIPPED *** cannot mount a tmpfs here (needs root)");
        return;
    };
    let names = gharchive_names(4);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    gharchive::publish(&p, &names.input, 2000, 5).unwrap();
    p.flush().unwrap();
    let mut sets = eos();
    sets.push(("state.dir", fs.path().join("state").display().to_string()));

    let run = start(&names, &sets, &[], &["--stop-at-end"]);
    let log = run.stderr.clone();
    let (st, _) = run.wait(T);
    let log = log.lock().unwrap().clone();
    assert!(
        !st.success(),
        "the job must stop when its state dir is full:\n{log}"
    );
    assert!(
        log.contains("No space left on device") || log.to_lowercase().contains("no space"),
        "the error names the cause:\n{log}"
    );
    // What was committed so far has no repeats.
    let counts = output_counts(&names.output);
    assert!(
        counts.values().all(|n| *n == 1),
        "repeats before the restart"
    );

    fs.resize("256m");
    let (st, _) = start(&names, &sets, &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "the restart with space completes");
    assert_each_id_once("state dir full (tmpfs)", &names.output, 1);
}

/// The largest file under `dir`.
fn largest_file(dir: &Path) -> PathBuf {
    let mut best: Option<(u64, PathBuf)> = None;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().map(Result::unwrap) {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else if best.as_ref().is_none_or(|(n, _)| m.len() > *n) {
                best = Some((m.len(), e.path()));
            }
        }
    }
    best.expect("a file in the state dir").1
}

/// Damage the sled database after a graceful run with `damage` (given its largest file),
/// deliver every event again and restart: the damage is detected at open, the database
/// moved aside (kept) with a WARN line naming it, the stores restored from the changelog,
/// so every repeated event is dropped as a duplicate.
fn a_damaged_database_is_set_aside_and_restored(fault: &str, seed: u64, damage: fn(&Path)) {
    let names = gharchive_names(4);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    gharchive::publish(&p, &names.input, 2000, seed).unwrap();
    p.flush().unwrap();
    let (st, _) = start(&names, &eos(), &[], &["--stop-at-end"]).wait(T);
    assert!(st.success());

    let f = largest_file(&names.state_dir());
    let len = std::fs::metadata(&f).unwrap().len();
    assert!(len > 4096, "{} is {len} bytes", f.display());
    damage(&f);
    gharchive::publish(&p, &names.input, 0, seed + 1).unwrap();
    p.flush().unwrap();

    let run = start(&names, &eos(), &[], &["--stop-at-end"]);
    let log = run.stderr.clone();
    let (st, out) = run.wait(T);
    let log = log.lock().unwrap().clone();
    assert!(st.success(), "the job runs on a damaged state dir:\n{log}");
    let db = names.state_dir().join(&names.app);
    let line = log
        .lines()
        .find(|l| l.contains("sled database corrupted"))
        .unwrap_or_else(|| panic!("no WARN line about the damage:\n{log}"));
    assert!(
        line.contains("WARN") && line.contains(&db.display().to_string()),
        "the line names the path: {line}"
    );
    assert!(line.contains("error="), "the line names the error: {line}");
    let aside: Vec<_> = std::fs::read_dir(names.state_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains(".corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "moved aside, not deleted: {aside:?}");
    assert!(aside[0].join(f.file_name().unwrap()).exists());
    assert!(
        summary_field(&out, "restored").unwrap_or(0.0) > 0.0,
        "restored from the changelog: {out}"
    );
    assert_eq!(summary_field(&out, "passed"), Some(0.0), "{out}\n{log}");
    assert_each_id_once(fault, &names.output, 0);
}

#[test]
fn a_truncated_sled_database_is_set_aside_and_restored_with_no_loss_and_no_repeat() {
    a_damaged_database_is_set_aside_and_restored("sled database truncated", 6, |f| {
        let len = std::fs::metadata(f).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(f)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
    });
}

#[test]
fn a_garbled_sled_database_is_set_aside_and_restored_with_no_loss_and_no_repeat() {
    a_damaged_database_is_set_aside_and_restored("sled database garbled", 16, |f| {
        use std::io::{Seek, SeekFrom, Write};
        let len = std::fs::metadata(f).unwrap().len();
        // 256 bytes of every 4 KiB past the first eighth, so live data is hit (a single
        // stretch may fall on obsolete page versions only).
        let mut file = std::fs::OpenOptions::new().write(true).open(f).unwrap();
        for at in (len / 8..len).step_by(4096) {
            file.seek(SeekFrom::Start(at)).unwrap();
            file.write_all(&[0xab; 256]).unwrap();
        }
    });
}
