//! Shared by the deployable examples (`enrich_orders`, `analytics_dedup`, `route_events`):
//! turn a topology built in Rust into a program that runs it like `onceflow run` does.
//!
//! Usage of every such binary:
//!
//! ```text
//! <binary> [--config FILE]... [--set KEY=VALUE]... [--stop-at-end] [--describe]
//! ```
//!
//! Config comes in layers as for `onceflow run` (built-in defaults, the files, then
//! `ONCEFLOW__*` environment variables, then `--set`); SIGTERM or SIGINT stops gracefully
//! (the work done is committed), a second signal exits at once. Exit codes: 0 done,
//! 1 run failed, 2 bad arguments or config.
//!
//! Included with `#[path = "deploy_support/mod.rs"] mod deploy;`.
#![allow(dead_code)]

use onceflow::config::{parse_set, Config};
use onceflow::runtime::{App, RunOptions};
use onceflow::topology::Topology;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Run `topology` with the config named on the command line until stopped.
pub fn main(topology: Topology) -> ExitCode {
    let mut files = Vec::new();
    let mut sets = Vec::new();
    let mut stop_at_end = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--config" | "--set" => {
                let Some(v) = args.next() else {
                    eprintln!("{a} needs a value");
                    return ExitCode::from(2);
                };
                if a == "--config" {
                    files.push(std::path::PathBuf::from(v));
                } else {
                    match parse_set(&v) {
                        Ok(kv) => sets.push(kv),
                        Err(e) => {
                            eprintln!("{e}");
                            return ExitCode::from(2);
                        }
                    }
                }
            }
            "--stop-at-end" => stop_at_end = true,
            "--describe" => {
                print!("{}", topology.describe());
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!(
                    "unknown argument {other:?}; usage: [--config FILE]... [--set KEY=VALUE]... [--stop-at-end] [--describe]"
                );
                return ExitCode::from(2);
            }
        }
    }
    let config = match Config::load(&files, &sets) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    onceflow::logging::init(config.log_format);
    let status = match onceflow::http::start(&config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let shutdown = Arc::new(AtomicBool::new(false));
    on_signals(shutdown.clone());
    match App::new(config, topology).run(RunOptions {
        stop_at_end,
        shutdown,
        status: Some(status),
    }) {
        Ok(summary) => {
            println!("{}", summary.line());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}

/// Set `flag` on the first SIGTERM/SIGINT; exit on the second.
fn on_signals(flag: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            eprintln!("cannot start the signal handler");
            return;
        };
        rt.block_on(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                eprintln!("cannot install signal handlers");
                return;
            };
            loop {
                tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
                if flag.swap(true, Ordering::SeqCst) {
                    eprintln!("second signal: exiting without committing");
                    std::process::exit(130);
                }
            }
        });
    });
}
