//! The `onceflow` command line: run, validate and describe topologies; inspect state; reset.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "onceflow",
    version,
    about = "Kafka stream processing where every effect happens once"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a topology against Kafka until SIGTERM/SIGINT (or the end of input with --stop-at-end).
    Run {
        /// The topology file (YAML, or TOML when named *.toml).
        topology: PathBuf,
        #[command(flatten)]
        args: crate::deploy::RunArgs,
    },
    /// Check a topology file (YAML, or TOML when named *.toml) without connecting to
    /// anything; prints every error (file:line:column, stage, field) and exits 1 if there is any
    /// (or if `run` would refuse its repartition hop); prints each dedup's partitioning and
    /// where the hop is.
    Validate {
        /// The topology file.
        topology: PathBuf,
    },
    /// Print a topology: source, stages, topics written, stores and their changelog topics.
    Describe {
        /// The topology file (YAML, or TOML when named *.toml).
        topology: PathBuf,
        /// Output format: text, mermaid or dot.
        #[arg(long, default_value = "text")]
        format: crate::topology::DescribeFormat,
        /// The application.id that prefixes changelog topic names (checked as `run` checks
        /// it).
        #[arg(long, default_value = "onceflow", value_parser = application_id)]
        application_id: String,
    },
    /// Inspect or seed a dedup store: `state get`, `state dump`, `state seed`.
    State(crate::tools::cli::StateArgs),
    /// Delete an application's internal topics, group offsets and local state
    /// (--dry-run lists them); refused while instances run.
    Reset(crate::tools::cli::ResetArgs),
}

/// The `onceflow` command (what the `onceflow` binary runs): `run`, `validate` and
/// `describe` a topology file, `state get/dump/seed` and `reset`. Parses this process's
/// arguments and returns its exit code: 0 done; for `run`, 1 for a failure outside onceflow
/// and 2 for a bad config or topology (see [`crate::deploy`]); for `validate` and
/// `describe`, 1 when the file has errors.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run { .. }) {
        crate::logging::init(crate::config::LogFormat::Text);
    }
    match cli.command {
        Command::State(args) => crate::tools::cli::state_main(args),
        Command::Reset(args) => crate::tools::cli::reset_main(args),
        Command::Validate { topology } => match crate::dsl::load(&topology) {
            Ok(t) => {
                // A hop `onceflow run` refuses (a stage with state or effects before a
                // repartitioning dedup) was refused by `load`, at the dedup's line.
                let hop = t.hop().ok().flatten();
                println!("{}: ok", topology.display());
                // Which partitioning each dedup stage runs under, and why.
                for s in t.stages() {
                    if let crate::topology::StageKind::Dedup(d) = &s.kind {
                        let (p, why) = d.effective_partitioning();
                        println!("  dedup {}: partitioning={} ({why})", s.name, p.name());
                    }
                }
                // Where the hop is: the stages before it run on the source partitions.
                if let Some((k, name, _)) = hop {
                    let before: Vec<&str> =
                        t.stages()[..k].iter().map(|s| s.name.as_str()).collect();
                    match before.as_slice() {
                        [] => println!("  hop: before dedup {name} (the first stage)"),
                        b => println!(
                            "  hop: before dedup {name}, after {} (run on the source partitions, before routing)",
                            b.join(", ")
                        ),
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(1)
            }
        },
        Command::Describe {
            topology,
            format,
            application_id,
        } => match crate::dsl::load(&topology) {
            // A hop `onceflow run` refuses is refused by `load` (at the dedup's line), so
            // no picture of a topology that never runs is drawn.
            Ok(t) => {
                print!("{}", t.describe_as(format, &application_id));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(1)
            }
        },
        Command::Run { topology, args } => {
            let topo = match crate::dsl::load(&topology) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            crate::deploy::run(topo, &args)
        }
    }
}

/// An `--application-id` value: it prefixes internal topic names, so it must make valid
/// ones (the check `run` makes on `application.id`).
fn application_id(v: &str) -> Result<String, String> {
    crate::names::check_topic_name(v)
        .map(|()| v.to_string())
        .map_err(|r| format!("it prefixes internal topic names: {r}"))
}
