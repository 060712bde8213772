//! The `onceflow` command: run, validate and describe topologies (see `onceflow::cli`).

fn main() -> std::process::ExitCode {
    onceflow::cli::main()
}
