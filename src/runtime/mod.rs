//! The runtime: tasks, the commit protocol (`commit`), the Kafka run loop, shutdown.

pub mod app;
pub mod commit;
pub mod failpoint;
pub mod hop;
pub mod log;
pub mod status;
pub mod table;
pub mod task;

pub use app::{App, RunOptions, RunSummary};
pub use status::Status;
pub use task::Task;
