//! Paths of the commit protocol that the driver's public API does not reach: here, the
//! abort of a partial loss of partitions (`runtime::rebalance`, partitions lost while
//! others are kept), which calls [`Protocol::abort`](crate::runtime::commit::Protocol::abort)
//! and carries its outcome out for the partitions kept.

use super::*;
use crate::{DedupSpec, Format, KeySource, Partitioning, TopologyBuilder};

fn eos_pipelined() -> TestDriver {
    let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
    spec.ttl_ms = 600_000;
    spec.partitioning = Some(Partitioning::Source);
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup("dedup", spec)
        .sink("out", "out")
        .build()
        .unwrap();
    TestDriver::new(t)
        .guarantee(Guarantee::ExactlyOnceV2)
        .auto_commit(false)
        .pipelined(true)
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
        let mut d = eos_pipelined();
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
