//! The exactly_once_v2 crash harness (see `onceflow_testkit::harness`): run after run,
//! fresh topics and input with duplicates, 1–3 `onceflow run` instances under
//! exactly_once_v2, one SIGKILLed at a transactional failpoint or a random moment and
//! restarted, then every distinct input id must appear exactly once read_committed.
//!
//! ```text
//! cargo build --release -p onceflow --bin onceflow -p onceflow-testkit --example crash_harness
//! target/release/examples/crash_harness --runs 200 [--seed S] [--bin PATH]
//!     [--min-events N] [--max-events N] [--gharchive P] [--work-dir DIR] [--keep-logs]
//!     [--kill KIND,...]   # moment, eos.after_produce, eos.after_changelog,
//!                         # eos.before_commit, eos.after_commit, restore.during;
//!                         # opt-in: sigstop (SIGSTOP 7-12 s at a random moment, then
//!                         # SIGCONT: a zombie), zombie (the same, stopped by the
//!                         # instance itself at eos.after_changelog or eos.before_commit)
//!     [--set KEY=VALUE]...  # extra config for every instance, e.g. kafka.debug=cgrp,eos
//!     [--repartition]     # dedup with partitioning: repartition, events with random
//!                         # Kafka keys (copies of an id on different partitions)
//!     [--prefix]          # with --repartition: a map stage before the dedup, which the
//!                         # router tasks run before they route
//! ```
//! The binary is `--bin`, else `ONCEFLOW_BIN`, else `target/release/onceflow`; the broker
//! is `ONCEFLOW_BOOTSTRAP_SERVERS` (default 127.0.0.1:9092). Prints one line per run and a
//! final `harness: runs=N duplicates=0 losses=0 aborted_records=... failed_runs=0` line;
//! exits 1 if any run had a duplicate, a loss or another failure.

use onceflow_testkit::{harness, kafka};
use std::path::PathBuf;
use std::process::ExitCode;

fn usage() -> ExitCode {
    eprintln!(
        "usage: crash_harness [--runs N] [--seed S] [--bin PATH] [--min-events N] [--max-events N] \
         [--gharchive PROBABILITY] [--work-dir DIR] [--keep-logs] [--kill moment,eos.after_commit,...] [--set KEY=VALUE]... [--repartition [--prefix]]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let bin = std::env::var_os("ONCEFLOW_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/release/onceflow"));
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(1);
    let mut opts = harness::HarnessOptions::new(&bin, &kafka::bootstrap_servers(), seed, 10);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Option<String> {
            let v = args.next();
            if v.is_none() {
                eprintln!("{name} needs a value");
            }
            v
        };
        let ok = match a.as_str() {
            "--runs" => value("--runs")
                .and_then(|v| v.parse().ok())
                .map(|v| opts.runs = v),
            "--seed" => value("--seed")
                .and_then(|v| v.parse().ok())
                .map(|v| opts.seed = v),
            "--bin" => value("--bin").map(|v| opts.bin = PathBuf::from(v)),
            "--min-events" => value("--min-events")
                .and_then(|v| v.parse().ok())
                .map(|v| opts.min_events = v),
            "--max-events" => value("--max-events")
                .and_then(|v| v.parse().ok())
                .map(|v| opts.max_events = v),
            "--gharchive" => value("--gharchive")
                .and_then(|v| v.parse().ok())
                .map(|v| opts.gharchive_probability = v),
            "--work-dir" => value("--work-dir").map(|v| opts.work_dir = PathBuf::from(v)),
            "--kill" => value("--kill").map(|v| {
                opts.kill_kinds = v.split(',').map(str::to_string).collect();
            }),
            "--set" => value("--set").and_then(|v| {
                let (k, v) = v.split_once('=')?;
                opts.extra_sets.push((k.to_string(), v.to_string()));
                Some(())
            }),
            "--keep-logs" => {
                opts.keep_logs = true;
                Some(())
            }
            "--repartition" => {
                opts.repartition = true;
                Some(())
            }
            "--prefix" => {
                opts.prefix = true;
                Some(())
            }
            "-h" | "--help" => return usage(),
            _ => None,
        };
        if ok.is_none() {
            eprintln!("bad argument {a:?}");
            return usage();
        }
    }
    if !opts.bin.exists() {
        eprintln!(
            "onceflow binary {} not found: build it (cargo build --release --bin onceflow) or set ONCEFLOW_BIN",
            opts.bin.display()
        );
        return ExitCode::from(2);
    }
    println!(
        "harness: bin={} bootstrap={} seed={} runs={} events={}..={} work_dir={}",
        opts.bin.display(),
        opts.bootstrap,
        opts.seed,
        opts.runs,
        opts.min_events,
        opts.max_events,
        opts.work_dir.display()
    );
    let report = harness::run_with(&opts, |r| println!("{}", r.line()));
    println!("{}", report.summary_line());
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
