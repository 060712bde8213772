//! The runtime: tasks, the Kafka run loop and its commit protocol, shutdown.

pub mod app;
pub mod failpoint;
pub mod status;
pub mod table;
pub mod task;

pub use app::{App, RunOptions, RunSummary};
pub use status::Status;
pub use task::Task;
