//! onceflow: a stream processor for Kafka, in the style of Kafka Streams, whose promise is
//! that every effect happens once however often the message behind it is delivered.
//!
//! A [`topology::Topology`] (from a YAML or TOML file via [`dsl`], or built with
//! [`topology::TopologyBuilder`]) wires a source topic through stages (filter, map, dedup,
//! route, sinks; CEL expressions in files, closures in Rust) to output topics. [`runtime::App`] runs it against Kafka with the at_least_once commit
//! protocol; [`testing::TestDriver`] runs it without a broker.

pub mod codec;
pub mod config;
pub mod deploy;
pub mod dsl;
pub mod error;
pub mod http;
pub mod kafka;
pub mod logging;
pub mod metrics;
pub mod processor;
pub mod runtime;
pub mod sink;
pub mod state;
pub mod testing;
pub mod tools;
pub mod topology;

pub use error::{Error, RecordError, Result};
