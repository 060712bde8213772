//! The runtime: tasks, the commit protocol (`commit`), the Kafka run loop, shutdown.

pub(crate) mod app;
pub(crate) mod commit;
pub(crate) mod failpoint;
pub(crate) mod hop;
pub(crate) mod log;
pub(crate) mod status;
pub(crate) mod table;
pub(crate) mod task;

pub(crate) use app::{App, RunOptions};
pub(crate) use status::Status;
pub(crate) use task::Task;
