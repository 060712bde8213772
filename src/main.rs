//! The `onceflow` command: run, validate and describe topologies.

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
        args: onceflow::deploy::RunArgs,
    },
    /// Check a topology file (YAML, or TOML when named *.toml) without connecting to
    /// anything; prints every error (file:line:column, stage, field) and exits 1 if there is any.
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
        format: onceflow::topology::DescribeFormat,
        /// The application.id that prefixes changelog topic names.
        #[arg(long, default_value = "onceflow")]
        application_id: String,
    },
    /// Inspect or seed a dedup store: `state get`, `state dump`, `state seed`.
    State(onceflow::tools::cli::StateArgs),
    /// Delete an application's internal topics, group offsets and local state
    /// (--dry-run lists them); refused while instances run.
    Reset(onceflow::tools::cli::ResetArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run { .. }) {
        onceflow::logging::init(onceflow::config::LogFormat::Text);
    }
    match cli.command {
        Command::State(args) => onceflow::tools::cli::state_main(args),
        Command::Reset(args) => onceflow::tools::cli::reset_main(args),
        Command::Validate { topology } => match onceflow::dsl::load(&topology) {
            Ok(t) => {
                println!("{}: ok", topology.display());
                // Which partitioning each dedup stage runs under, and why.
                for s in t.stages() {
                    if let onceflow::topology::StageKind::Dedup(d) = &s.kind {
                        let (p, why) = d.effective_partitioning();
                        println!("  dedup {}: partitioning={} ({why})", s.name, p.name());
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
        } => match onceflow::dsl::load(&topology) {
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
            let topo = match onceflow::dsl::load(&topology) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            onceflow::deploy::run(topo, &args)
        }
    }
}
