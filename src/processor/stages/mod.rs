//! Built-in stages: dedup (with an optional duplicate topic) and topic sink (one or more
//! topics, key and headers settable).
//!
//! One file per stage kind: `dedup_stage` ([`DedupSpec`], [`Dedup`]) and `topic_sink`
//! ([`SinkSpec`], [`TopicSink`]).

pub(crate) mod dedup_stage;
pub(crate) mod topic_sink;

pub(crate) use dedup_stage::*;
pub(crate) use topic_sink::*;

use super::dedup::{decide, Decision, DedupEntry, Observation, Policy};
use super::expr::{plan, Bindings, BytesFn};
use super::fingerprint::{FingerprintFields, Fingerprinter};
use super::key::KeySource;
use super::{Context, OutRecord, Processor, Record, StageError};
use crate::error::RecordError;
use prost::Message;
