//! onceflow: a stream processor for Kafka, in the style of Kafka Streams, whose promise is
//! that every effect happens once however often the message behind it is delivered.
//!
//! A [`Topology`] (from a YAML or TOML file via [`dsl`], or built with [`TopologyBuilder`])
//! wires a source topic through stages (filter, map, dedup, route, sinks; CEL expressions in
//! files, closures in Rust) to output topics. [`App`] runs it against Kafka with the
//! at_least_once commit protocol; [`TestDriver`] runs it without a broker.
//!
//! Start with [`prelude`]: `use onceflow::prelude::*;` brings the builder, the stage specs,
//! the config, [`App`], [`TestDriver`] and the error types. A program that builds its
//! topology in Rust and is deployed as a binary ends in [`deploy::main`].

#![warn(unreachable_pub, missing_docs)]

// The parts of the library; their items are crate-private unless re-exported below.
pub(crate) mod codec;
pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod http;
pub(crate) mod kafka;
pub(crate) mod logging;
pub(crate) mod names;
pub(crate) mod prefetch;
pub(crate) mod processor;
pub(crate) mod runtime;
pub(crate) mod schema;
pub(crate) mod sink;
pub(crate) mod state;
pub(crate) mod testing;
pub(crate) mod tools;
pub(crate) mod topology;

pub mod cli;
pub mod deploy;
pub mod dsl;
pub mod metrics;

// The public types, by the part of the library that defines them.
pub use codec::{Format, ProtoFormat};
pub use config::{Config, Guarantee, LogFormat};
pub use error::{Error, RecordError, Result};
pub use processor::{
    dedup::DedupEntry,
    enrich::{EnrichSpec, MissingPolicy, TableSpec},
    fingerprint::FingerprintFields,
    key::KeySource,
    record::{OutRecord, Record, SourceMeta},
    route::{RouteBranch, RouteSpec},
    stages::dedup_stage::{ConflictPolicy, DedupSpec, Partitioning, TimeSource},
    stages::topic_sink::SinkSpec,
    transform::MapSpec,
    Counts,
};
pub use runtime::app::{App, RunOptions, RunSummary};
pub use sink::{
    protocol::{InFlight, OnStoreError, ReservationPolicy},
    EffectSpec, ExternalSinkSpec, FileSpec, HttpSpec, PostgresSpec, RedisSpec, Secret, StoreSpec,
};
pub use state::restore::ChangelogRecord;
pub use state::StateMemory;
pub use testing::{TestDriver, TestRecord};
pub use topology::{builder::TopologyBuilder, describe::DescribeFormat, Topology};

/// What a program using onceflow needs, for `use onceflow::prelude::*;`: the topology
/// builder and its stage specs, the config, the run entry points, the test driver, records
/// and the error types.
pub mod prelude {
    pub use crate::{
        App, Config, ConflictPolicy, Counts, DedupSpec, DescribeFormat, EffectSpec, EnrichSpec,
        Error, ExternalSinkSpec, FileSpec, FingerprintFields, Format, Guarantee, HttpSpec,
        InFlight, KeySource, LogFormat, MapSpec, MissingPolicy, OnStoreError, OutRecord,
        Partitioning, PostgresSpec, ProtoFormat, Record, RecordError, RedisSpec, ReservationPolicy,
        Result, RouteBranch, RouteSpec, RunOptions, RunSummary, Secret, SinkSpec, SourceMeta,
        StoreSpec, TableSpec, TestDriver, TestRecord, TimeSource, Topology, TopologyBuilder,
    };
}

/// The names of the headers onceflow writes on the records it emits.
pub mod headers {
    pub use crate::{
        processor::repartition::SOURCE,
        processor::stages::dedup_stage::{
            DUPLICATE_KIND, DUPLICATE_OF_OFFSET, DUPLICATE_OF_PARTITION,
        },
        runtime::task::dlq_headers,
        sink::stage::{OUTCOME_HEADER, RESULT_HEADER},
    };
}

/// The failpoints of the commit protocol: the points at which [`TestDriver::crash_at`]
/// (and the crash harness, through `ONCEFLOW_FAILPOINT`) stops a run.
pub mod failpoints {
    pub use crate::runtime::commit::{
        commit_failpoints, AFTER_CHANGELOG, AFTER_FLUSH, AFTER_STATE, BEFORE_FLUSH,
        EOS_AFTER_CHANGELOG, EOS_AFTER_COMMIT, EOS_AFTER_PRODUCE, EOS_BEFORE_COMMIT,
        RESTORE_DURING, STATE_WRITE,
    };
}

/// Internals that the workspace's own tests, benchmarks and crash harness (`tests/`,
/// `testkit/`) drive directly. Not part of the API: no stability, no documentation.
#[doc(hidden)]
#[path = "testkit.rs"]
pub mod __testkit;

/// The allocator of every program that links onceflow (feature `mimalloc`, on by
/// default; turn default features off to keep your own `#[global_allocator]`). onceflow
/// allocates on several threads at once (processing, the state writer, librdkafka's
/// callbacks); with glibc's allocator the state writer spent about half its time growing
/// and consolidating its arena (measured with `perf` on `scripts/bench`).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turn transparent huge pages off for this process, as [`App::run`] does at start when
/// onceflow's allocator is mimalloc (feature `mimalloc`, Linux). mimalloc asks the kernel
/// for huge pages on its large regions (`madvise(MADV_HUGEPAGE)`), so the resident set then
/// grows in 2 MiB steps, most of them part-used: the onceflow side of `scripts/bench` peaked
/// at 350 MiB with them and 264 MiB without, at the same speed (see docs/benchmarks.md).
///
/// Memory already faulted in keeps its pages; the setting holds for the rest of the
/// process's life (`prctl(PR_SET_THP_DISABLE)`). Nothing is changed when the environment
/// sets `MIMALLOC_ALLOW_THP` (mimalloc's own switch, read when the process starts: `1`
/// keeps huge pages, `0` turns them off itself), or without the feature, or off Linux.
/// Returns whether huge pages are now off for the process.
pub(crate) fn limit_huge_pages() -> bool {
    #[cfg(all(feature = "mimalloc", target_os = "linux"))]
    {
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
            // SAFETY: PR_SET_THP_DISABLE takes an integer flag and no pointers.
            unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        }
        // SAFETY: PR_GET_THP_DISABLE takes no argument and returns the flag.
        unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1 }
    }
    #[cfg(not(all(feature = "mimalloc", target_os = "linux")))]
    {
        false
    }
}

/// How long onceflow's allocator keeps memory freed by the process before handing it back
/// to the kernel, in milliseconds: mimalloc's `purge_delay`, whose default in mimalloc v3
/// is 1,000. A run loop frees much of what it allocates within a commit or two (a
/// commit's staged marks, the source's batches, librdkafka's produced messages), so with
/// a second's delay the resident set holds about a second's worth of freed pages: at
/// 100 ms the onceflow side of `scripts/bench` peaked at a median 176 MiB against 210
/// with 1,000 ms, at the same throughput (8 pairs, see docs/benchmarks.md).
pub(crate) const PURGE_DELAY_MS: i64 = 100;

/// mimalloc v3's `mi_option_purge_delay`: its place in `mi_option_e` (the Rust bindings do
/// not name it); `purge_delay_tests` checks it against the option's default.
#[cfg(feature = "mimalloc")]
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

#[cfg(feature = "mimalloc")]
extern "C" {
    fn mi_option_get(option: std::ffi::c_int) -> std::ffi::c_long;
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// Set the allocator's purge delay to [`PURGE_DELAY_MS`], as [`App::run`] does at start
/// with the `mimalloc` feature. Nothing is changed when the environment sets
/// `MIMALLOC_PURGE_DELAY` (mimalloc's own switch, read when the process starts; any case,
/// or its old name `MIMALLOC_RESET_DELAY`), or without the feature. Returns the delay in
/// force, in milliseconds (`None` without the feature).
// `c_long` is `i64` here but not on every platform.
#[allow(clippy::useless_conversion)]
pub(crate) fn limit_retained_memory() -> Option<i64> {
    #[cfg(feature = "mimalloc")]
    {
        // mimalloc reads its options' names without regard to case, and the delay also
        // under its old name.
        let chosen = std::env::vars_os().any(|(k, _)| {
            k.to_str().is_some_and(|k| {
                k.eq_ignore_ascii_case("MIMALLOC_PURGE_DELAY")
                    || k.eq_ignore_ascii_case("MIMALLOC_RESET_DELAY")
            })
        });
        if !chosen {
            // SAFETY: mimalloc's option setter takes an option number and a value, no
            // pointers; options may be set at any time.
            unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS as _) };
        }
        // SAFETY: as above, a getter.
        Some(i64::from(unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) }))
    }
    #[cfg(not(feature = "mimalloc"))]
    {
        None
    }
}

#[cfg(all(test, feature = "mimalloc"))]
mod purge_delay_tests {
    #[test]
    fn the_purge_delay_option_is_mimallocs_and_is_set() {
        // SAFETY: as in `limit_retained_memory`.
        let before = unsafe { super::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        let chosen = std::env::vars_os().any(|(k, _)| {
            k.to_str()
                .is_some_and(|k| k.to_ascii_uppercase().starts_with("MIMALLOC_"))
        });
        if chosen {
            // The environment's choice stands (and may name other options).
            return;
        }
        // Option 15 must be the purge delay: mimalloc v3's default for it is 1,000 ms, and
        // no other option has that default (nothing else in this test binary sets it).
        assert_eq!(
            before,
            1000,
            "option {} is not mimalloc's purge delay",
            super::MI_OPTION_PURGE_DELAY
        );
        assert_eq!(super::limit_retained_memory(), Some(super::PURGE_DELAY_MS));
    }
}

#[cfg(all(test, feature = "mimalloc", target_os = "linux"))]
mod allocator_tests {
    #[test]
    fn huge_pages_are_off_once_limited() {
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
            // The user's choice stands; nothing to check.
            return;
        }
        assert!(super::limit_huge_pages());
        // SAFETY: as in `limit_huge_pages`.
        let flag = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        assert_eq!(flag, 1, "PR_GET_THP_DISABLE after limit_huge_pages");
    }
}
