//! Logs: `tracing` events on stderr, as text or JSON lines (`log.format`), filtered by
//! `ONCEFLOW_LOG` (an `EnvFilter`, default `info`).
//!
//! Text has ANSI colours only when stderr is a terminal; JSON lines carry the fields of
//! the current spans (each partition task's span names its topology, partition and stores).

use crate::config::LogFormat;
use std::io::IsTerminal;

/// Install the global subscriber. A second call (or another subscriber already set) is a
/// no-op.
pub(crate) fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ONCEFLOW_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
}
