//! Paths of the commit protocol that the driver's public API does not reach: the abort of
//! a partial loss of partitions (`runtime::rebalance`, partitions lost while others are
//! kept), which calls [`Protocol::abort`](crate::runtime::commit::Protocol::abort) and
//! carries its outcome out for the partitions kept; and a sweep between an abort and the
//! rewound records being read again (the driver reads them again at once).

use super::*;
use crate::{DedupSpec, Format, KeySource, Partitioning, TopologyBuilder};

/// An exactly_once_v2 driver of dedup on `/id` (TTL `ttl_ms`, grace `grace_ms`) into
/// topic `out`, committing only when told.
fn eos_driver(ttl_ms: i64, grace_ms: i64) -> TestDriver {
    driver(Guarantee::ExactlyOnceV2, ttl_ms, grace_ms)
}

/// As [`eos_driver`], under `guarantee`.
fn driver(guarantee: Guarantee, ttl_ms: i64, grace_ms: i64) -> TestDriver {
    let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
    spec.ttl_ms = ttl_ms;
    spec.grace_ms = grace_ms;
    spec.partitioning = Some(Partitioning::Source);
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup("dedup", spec)
        .sink("out", "out")
        .build()
        .unwrap();
    TestDriver::new(t).guarantee(guarantee).auto_commit(false)
}

fn ev(id: &str, t: i64) -> TestRecord {
    TestRecord::json(format!(r#"{{"id":"{id}","t":{t}}}"#)).timestamp(t)
}

/// A loss of partitions aborts while a transaction commits in the background; that
/// commit then fails (refused: the partitions must be rewound, its first transaction
/// included) or ends unknown after committing (every partition kept must be opened again,
/// restoring its marks). Either way a, b and c each come out once.
#[test]
fn an_abort_for_lost_partitions_carries_out_how_the_background_commit_ended() {
    for unknown in [false, true] {
        let mut d = eos_driver(600_000, 3_600_000).pipelined(true);
        for id in ["a", "b"] {
            d.pipe(ev(id, 1)).unwrap();
        }
        d.commit().unwrap();
        assert_eq!(d.in_flight_commits(), 1);
        if unknown {
            d.lose_next_commit_answer(true);
        } else {
            d.fail_next_transaction();
        }
        d.pipe(ev("c", 2)).unwrap();
        // As runtime::rebalance does for the partitions kept.
        let outcome = d.protocol.abort(&mut d.log, &mut d.tasks).unwrap();
        d.settle(outcome).unwrap();
        d.commit_and_wait().unwrap();
        // A later copy of a: a duplicate.
        d.pipe(ev("a", 3)).unwrap();
        d.commit_and_wait().unwrap();
        let ids: Vec<String> = d
            .output_values("out")
            .iter()
            .map(|v| serde_json::from_str::<serde_json::Value>(v).unwrap()["id"].to_string())
            .collect();
        for id in ["a", "b", "c"] {
            let n = ids.iter().filter(|x| x.trim_matches('"') == id).count();
            assert_eq!(n, 1, "unknown={unknown}: {id} came out {n} times: {ids:?}");
        }
    }
}

/// An abort drops records and rewinds; stream time must not keep what they moved it to.
/// In the runtime, a commit (with its expiry sweep) may come before the records read
/// again have caught up: a sweep by the dropped records' time would delete an entry that
/// is live for the records in between, and a repeat among them would pass.
#[test]
fn an_abort_forgets_the_stream_time_of_the_records_it_drops() {
    let mut d = eos_driver(10_000, 0);
    d.pipe(ev("x", 0)).unwrap();
    d.commit().unwrap();
    // A repeat of x within its TTL, then two records far ahead (the sweep goes by the
    // second-highest time).
    d.pipe(ev("x", 5)).unwrap();
    d.pipe(ev("y1", 100_000)).unwrap();
    d.pipe(ev("y2", 100_000)).unwrap();
    let outcome = d.protocol.abort(&mut d.log, &mut d.tasks).unwrap();
    assert!(matches!(outcome, Outcome::Aborted(_)), "{outcome:?}");
    // The sweep of a commit that comes before the records are read again.
    let clock = d.clock_ms;
    for t in d.tasks.values_mut() {
        t.punctuate(clock).unwrap();
    }
    d.settle(outcome).unwrap();
    d.commit().unwrap();
    let xs = d
        .output_values("out")
        .iter()
        .filter(|v| v.contains(r#""id":"x""#))
        .count();
    assert_eq!(xs, 1, "x came out {xs} times: {:?}", d.output_values("out"));
}

/// at_least_once: a commit in flight past the log's `ack_timeout` is waited for at its
/// next step (where the runtime's wait is bounded and fails), not checked and left in
/// flight for good while fewer than `MAX_IN_FLIGHT` are.
#[test]
fn an_overdue_commit_in_flight_is_waited_for() {
    let mut d = driver(Guarantee::AtLeastOnce, 600_000, 3_600_000).pipelined(true);
    for id in ["a", "b"] {
        d.pipe(ev(id, 1)).unwrap();
    }
    d.commit().unwrap();
    assert_eq!(d.in_flight_commits(), 1);
    // Not overdue: a step only checks, and the acknowledgements are held.
    let outcome = d.protocol.advance(&mut d.log, &mut d.tasks).unwrap();
    d.settle(outcome).unwrap();
    assert_eq!(d.in_flight_commits(), 1);
    assert!(d.output("out").is_empty());
    // Overdue: the step waits, and the commit completes.
    d.log.ack_timeout = Some(std::time::Duration::ZERO);
    let outcome = d.protocol.advance(&mut d.log, &mut d.tasks).unwrap();
    d.settle(outcome).unwrap();
    assert_eq!(d.in_flight_commits(), 0);
    assert_eq!(d.output("out").len(), 2);
}
