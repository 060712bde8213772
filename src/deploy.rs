//! Topologies as binaries: the runner behind `onceflow run` and behind a program that builds
//! its topology in Rust.
//!
//! A deployable program is its topology plus one call:
//!
//! ```no_run
//! use onceflow::prelude::*;
//!
//! fn main() -> std::process::ExitCode {
//!     let topology = TopologyBuilder::new("copy-orders")
//!         .source("orders", Format::Json)
//!         .sink("copied", "orders.copy")
//!         .build()
//!         .expect("a valid topology");
//!     onceflow::deploy::main(topology)
//! }
//! ```
//!
//! Such a binary takes `[--config FILE]... [--set KEY=VALUE]... [--stop-at-end] [--describe]`.
//! Config comes in layers as for `onceflow run`: built-in defaults, the files in order, then
//! `ONCEFLOW__*` environment variables, then `--set`. SIGTERM or SIGINT stops gracefully (the
//! work done is committed); a second signal exits at once with code 130.
//!
//! Exit codes: 0 done; 1 the run failed for a reason outside onceflow (broker, disk, sink:
//! a restart resumes from the last commit); 2 bad arguments, config or topology, or a topic
//! the topology reads (source, table) missing.

use crate::config::{parse_set, Config, LogFormat};
use crate::runtime::{App, RunOptions};
use crate::topology::Topology;
use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// How to run a topology: the arguments `onceflow run` and a deployable binary share.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct RunArgs {
    /// A config file (TOML); may be given several times, later files win.
    #[arg(long = "config", value_name = "FILE")]
    pub(crate) configs: Vec<PathBuf>,
    /// Set one config key, e.g. --set commit.interval.ms=500; wins over files and environment.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(crate) sets: Vec<String>,
    /// Stop once every assigned partition has been read to its end, committing everything.
    #[arg(long)]
    pub(crate) stop_at_end: bool,
}

/// The command line of a deployable topology binary.
#[derive(Parser, Debug)]
#[command(about = "Run this program's onceflow topology against Kafka")]
struct Args {
    #[command(flatten)]
    run: RunArgs,
    /// Print the topology (source, stages, topics, stores and changelogs) and exit.
    #[arg(long)]
    describe: bool,
}

/// Run `topology` with the config named on this process's command line until stopped, and
/// return the process's exit code (see the module doc for the arguments and codes).
pub fn main(topology: Topology) -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS // --help, --version
            };
        }
    };
    if args.describe {
        // Internal topic names carry the application.id the run would use.
        return match describe(&topology, &args.run) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(2)
            }
        };
    }
    run(topology, &args.run)
}

/// `--describe`: the topology as `onceflow describe` prints it, its internal topics named
/// with the application.id of the config `args` name.
fn describe(topology: &Topology, args: &RunArgs) -> crate::error::Result<String> {
    let c = load_config(args)?;
    Ok(topology.describe_as(crate::topology::DescribeFormat::Text, &c.application_id))
}

/// The config named by `args`: files in order, the environment, then `--set`.
fn load_config(args: &RunArgs) -> crate::error::Result<Config> {
    let sets: Vec<_> = args
        .sets
        .iter()
        .map(|s| parse_set(s))
        .collect::<Result<_, _>>()?;
    Config::load(&args.configs, &sets)
}

/// Run `topology` with config from `args.configs` (in order) and `args.sets` (`KEY=VALUE`,
/// winning over files and environment) until SIGTERM/SIGINT, or until every assigned
/// partition has been read to its end with `args.stop_at_end`; print the `summary:` line and
/// return the exit code.
///
/// Errors are printed to stderr, with a last line saying what to do about them.
pub(crate) fn run(topology: Topology, args: &RunArgs) -> ExitCode {
    let config = match load_config(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    crate::logging::init(config.log_format);
    let format = config.log_format;
    let status = match crate::http::start(&config) {
        Ok(s) => s,
        Err(e) => {
            report(format, &e.to_string(), None);
            return ExitCode::from(2);
        }
    };
    if let Err(e) = crate::runtime::failpoint::init_from_env() {
        report(format, &e.to_string(), None);
        return ExitCode::from(2);
    }
    let shutdown = Arc::new(AtomicBool::new(false));
    watch_signals(shutdown.clone(), format);
    let opts = RunOptions {
        stop_at_end: args.stop_at_end,
        shutdown,
    };
    match App::new(config, topology).run_with_status(opts, Some(status)) {
        Ok(summary) => {
            println!("{}", summary.line());
            ExitCode::SUCCESS
        }
        Err(e) => {
            let fault = e.fault();
            report(format, &e.to_string(), Some(fault.hint()));
            ExitCode::from(fault.exit_code())
        }
    }
}

/// Print why the run stopped (and what to do) on stderr: `onceflow: ...` lines, or under
/// `log.format = json` one JSON object shaped as the log lines are (level `ERROR`, the
/// message and hint under `fields`), so a log shipper reading JSON lines keeps it. Printed
/// whatever `ONCEFLOW_LOG` filters: it is the exit's reason.
fn report(format: LogFormat, message: &str, hint: Option<&str>) {
    match format {
        LogFormat::Text => match hint {
            Some(h) => eprintln!("onceflow: {message}\nonceflow: {h}"),
            None => eprintln!("{message}"),
        },
        LogFormat::Json => {
            let mut fields = serde_json::json!({ "message": message });
            if let Some(h) = hint {
                fields["hint"] = h.into();
            }
            let line = serde_json::json!({
                "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
                "level": "ERROR",
                "fields": fields,
                "target": "onceflow",
            });
            eprintln!("{line}");
        }
    }
}

/// Set `flag` on SIGTERM or SIGINT; a second signal exits at once (code 130).
fn watch_signals(flag: Arc<AtomicBool>, format: LogFormat) {
    std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the signal handler");
                return;
            }
        };
        rt.block_on(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                tracing::error!("cannot install signal handlers");
                return;
            };
            loop {
                tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
                if flag.swap(true, Ordering::SeqCst) {
                    report(format, "second signal: exiting without committing", None);
                    std::process::exit(130);
                }
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::key::KeySource;
    use crate::processor::stages::DedupSpec;
    use crate::topology::{Format, TopologyBuilder};

    /// `--describe` names the internal topics with the application.id the config gives (it
    /// always said `onceflow`; found by a review helper), and a bad config is an error.
    #[test]
    fn describe_names_topics_with_the_configured_application_id() {
        let t = TopologyBuilder::new("t")
            .source("in", Format::Json)
            .dedup(
                "by-id",
                DedupSpec::new(KeySource::JsonPointer("/id".into())),
            )
            .sink("out", "out")
            .build()
            .unwrap();
        let args =
            Args::try_parse_from(["bin", "--describe", "--set", "application.id=shop"]).unwrap();
        assert!(args.describe);
        let text = describe(&t, &args.run).unwrap();
        assert!(text.contains("shop-by-id-changelog"), "{text}");
        let bad =
            Args::try_parse_from(["bin", "--describe", "--set", "application.id=a b"]).unwrap();
        assert!(describe(&t, &bad.run).is_err());
    }
}
