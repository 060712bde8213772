//! Test and benchmark tooling of onceflow, kept out of the library: nothing here ships to
//! users of `onceflow` (its broker-free `TestDriver` stays in `onceflow::testing`).
//!
//! - [`kafka`]: helpers for tests, demos and benchmarks that talk to a real broker (read a
//!   topic read_committed or read_uncommitted, produce input, reset a consumer group);
//! - [`gharchive`]: the GH Archive loader (two real hours in `examples/data/gharchive/`,
//!   published with delivery-fault duplicates);
//! - [`harness`]: the exactly_once_v2 crash harness (spawns `onceflow run` processes,
//!   SIGKILL/SIGSTOP at failpoints, checks the output read_committed).
//!
//! The programs that use them are this crate's examples: the benchmarks (`bench*`), the
//! harness runner (`crash_harness`) and the demo's loader (`gharchive`), e.g.
//! `cargo build --release -p onceflow-testkit --example bench`.

pub mod gharchive;
pub mod harness;
pub mod kafka;
