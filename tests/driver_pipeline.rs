//! Pipelined at_least_once commits through the broker-free test driver (issue 12 item 4):
//! commits stay in flight, sealed, while records go on being processed; each completes its
//! steps in order (outputs acknowledged, then changelog, then store, then offsets); a crash
//! repeats at most what was in flight and loses nothing. And exactly_once_v2 with the
//! transaction's commit in the background (issue 12 item 5): records processed meanwhile
//! send their outputs in the next transaction; a failure or crash repeats nothing.

use onceflow::Guarantee;
use onceflow::KeySource;
use onceflow::{__testkit::MAX_IN_FLIGHT, failpoints};
use onceflow::{DedupSpec, Partitioning};
use onceflow::{Format, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};

fn pipelined() -> TestDriver {
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
        .guarantee(Guarantee::AtLeastOnce)
        .auto_commit(false)
        .pipelined(true)
}

fn ev(id: &str, t: i64) -> TestRecord {
    TestRecord::json(format!(r#"{{"id":"{id}","t":{t}}}"#)).timestamp(t)
}

fn out_ids(d: &TestDriver) -> Vec<String> {
    d.output_values("out")
        .iter()
        .map(|v| {
            let j: serde_json::Value = serde_json::from_str(v).unwrap();
            j["id"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn commits_in_flight_complete_in_order_and_their_marks_still_count() {
    let mut d = pipelined();
    for id in ["a", "b"] {
        d.pipe(ev(id, 1)).unwrap();
    }
    d.commit().unwrap();
    assert_eq!(d.in_flight_commits(), 1);
    // Nothing acknowledged: no output, and so no mark in the changelog, no offset.
    assert!(d.output("out").is_empty());
    assert!(
        d.changelog("dedup", 0).is_empty(),
        "a mark reached the changelog before its output was acknowledged"
    );
    assert_eq!(d.committed_offset(0), None);
    // Processing goes on while the commit is in flight; its sealed marks still count.
    for id in ["a", "c"] {
        d.pipe(ev(id, 2)).unwrap();
    }
    d.commit().unwrap();
    assert_eq!(d.in_flight_commits(), 2);
    assert!(d.changelog("dedup", 0).is_empty());
    d.acknowledge().unwrap();
    assert_eq!(d.in_flight_commits(), 0);
    assert_eq!(out_ids(&d), ["a", "b", "c"]);
    let keys: Vec<&[u8]> = d.changelog("dedup", 0).iter().map(|r| &r.key[..]).collect();
    assert_eq!(keys.len(), 3, "one changelog record per mark: {keys:?}");
    assert_eq!(d.committed_offset(0), Some(4));
}

#[test]
fn commits_in_flight_are_bounded() {
    let mut d = pipelined();
    for i in 0..(MAX_IN_FLIGHT as i64 + 3) {
        d.pipe(ev(&format!("k{i}"), i)).unwrap();
        d.commit().unwrap();
        assert!(
            d.in_flight_commits() <= MAX_IN_FLIGHT,
            "{}",
            d.in_flight_commits()
        );
    }
    // The commits that had to wait completed, in order, with their offsets.
    assert!(d.committed_offset(0).is_some_and(|o| o >= 3));
    d.acknowledge().unwrap();
    assert_eq!(d.committed_offset(0), Some(MAX_IN_FLIGHT as i64 + 3));
    assert_eq!(out_ids(&d).len(), MAX_IN_FLIGHT + 3);
}

#[test]
fn a_crash_with_commits_in_flight_repeats_at_most_them_and_loses_nothing() {
    let batches: [&[&str]; 4] = [
        &["a", "b", "a"],
        &["c", "b", "d"],
        &["e", "a", "f", "c"],
        &["g", "e", "h"],
    ];
    let total: i64 = batches.iter().map(|b| b.len() as i64).sum();
    for point in failpoints::commit_failpoints(Guarantee::AtLeastOnce) {
        for wipe in [false, true] {
            let ctx = format!("at {point}{}", if wipe { " + wiped state" } else { "" });
            let mut d = pipelined();
            // Batch 0 completes; batches 1 and 2 are in flight when the crash comes.
            for (i, batch) in batches.iter().enumerate() {
                if i == 2 {
                    d.crash_at(point).unwrap();
                }
                for id in batch.iter() {
                    d.pipe(ev(id, 1)).unwrap();
                }
                d.commit().unwrap();
                if i == 0 {
                    d.acknowledge().unwrap();
                    assert_eq!(d.committed_offset(0), Some(3), "{ctx}");
                }
                if i == 2 {
                    if d.crashed_at().is_none() {
                        // The failpoints after the seal fire as the pipeline goes on.
                        d.acknowledge().unwrap();
                    }
                    assert_eq!(d.crashed_at(), Some(*point), "{ctx}: the failpoint fired");
                    assert!(
                        d.committed_offset(0).unwrap() < 9,
                        "{ctx}: batch 2 never committed"
                    );
                    if wipe {
                        d.wipe_state();
                    }
                    d.restart().unwrap();
                    d.commit().unwrap();
                    d.acknowledge().unwrap();
                }
            }
            d.acknowledge().unwrap();
            let ids = out_ids(&d);
            for id in ["a", "b", "c", "d", "e", "f", "g", "h"] {
                let n = ids.iter().filter(|x| *x == id).count();
                assert!(n >= 1, "{ctx}: {id} lost: {ids:?}");
                assert!(n <= 2, "{ctx}: {id} repeated more than once: {ids:?}");
                // Only the records of the commits in flight (batches 1 and 2) may repeat.
                if ["a", "b", "g", "h"].contains(&id) {
                    assert_eq!(n, 1, "{ctx}: {id} was not in flight yet repeated: {ids:?}");
                }
                assert!(
                    d.dedup_entry("dedup", 0, id.as_bytes()).unwrap().is_some(),
                    "{ctx}: the mark of {id} survives"
                );
            }
            assert_eq!(d.committed_offset(0), Some(total), "{ctx}");
            // Repeats after recovery are duplicates.
            let before = ids.len();
            for id in ["a", "d", "h"] {
                d.pipe(ev(id, 2)).unwrap();
            }
            d.commit().unwrap();
            d.acknowledge().unwrap();
            assert_eq!(
                out_ids(&d).len(),
                before,
                "{ctx}: repeats after recovery pass"
            );
        }
    }
}

/// The repartition purge deletes consumed records up to the last *completed* commit's
/// offsets: a commit still in flight may yet fail, and its records are read again then.
#[test]
fn the_purge_offsets_never_run_ahead_of_a_completed_commit() {
    let mut d = pipelined();
    d.pipe(ev("a", 1)).unwrap();
    d.pipe(ev("b", 1)).unwrap();
    d.commit().unwrap();
    assert_eq!(d.in_flight_commits(), 1);
    assert!(
        d.last_committed_offsets().is_empty(),
        "a commit in flight counted as completed"
    );
    d.acknowledge().unwrap();
    assert_eq!(d.last_committed_offsets(), vec![(0, 2)]);
    d.pipe(ev("c", 2)).unwrap();
    d.commit().unwrap();
    assert_eq!(d.in_flight_commits(), 1);
    assert_eq!(
        d.last_committed_offsets(),
        vec![(0, 2)],
        "the purge offsets ran ahead of the commit in flight"
    );
    d.acknowledge().unwrap();
    assert_eq!(d.last_committed_offsets(), vec![(0, 3)]);
}

/// exactly_once_v2 with the transaction's commit in the background (issue 12 item 5).
fn eos_pipelined() -> TestDriver {
    let d = pipelined();
    d.guarantee(Guarantee::ExactlyOnceV2)
}

#[test]
fn records_processed_while_a_transaction_commits_go_out_in_the_next_one() {
    let mut d = eos_pipelined();
    for id in ["a", "b"] {
        d.pipe(ev(id, 1)).unwrap();
    }
    d.commit().unwrap();
    assert_eq!(d.in_flight_commits(), 1, "the transaction is committing");
    assert!(
        d.output("out").is_empty(),
        "nothing visible before the commit ends"
    );
    assert_eq!(d.committed_offset(0), None);
    // Processing goes on meanwhile: the committing transaction's marks still count, and
    // the new outputs wait for the next transaction.
    for id in ["a", "c", "c"] {
        d.pipe(ev(id, 2)).unwrap();
    }
    assert!(d.output("out").is_empty());
    d.acknowledge().unwrap();
    assert_eq!(d.in_flight_commits(), 0);
    assert_eq!(
        out_ids(&d),
        ["a", "b"],
        "only the first transaction is visible"
    );
    assert_eq!(d.committed_offset(0), Some(2));
    assert!(d.dedup_entry("dedup", 0, b"b").unwrap().is_some());
    d.commit().unwrap();
    d.acknowledge().unwrap();
    assert_eq!(out_ids(&d), ["a", "b", "c"]);
    assert_eq!(d.committed_offset(0), Some(5));
    let keys: Vec<&[u8]> = d.changelog("dedup", 0).iter().map(|r| &r.key[..]).collect();
    assert_eq!(keys.len(), 3, "one changelog record per mark: {keys:?}");
    assert_eq!(d.counts().duplicates, 2);
}

/// A transaction that fails, or whose answer is lost, while records are processed behind
/// it: they are read again from the committed offsets and every id comes out once.
#[test]
fn a_failed_transaction_behind_which_records_were_processed_repeats_and_loses_nothing() {
    for case in ["refused", "lost after commit", "lost before commit"] {
        let mut d = eos_pipelined();
        for id in ["a", "b"] {
            d.pipe(ev(id, 1)).unwrap();
        }
        d.commit().unwrap();
        d.acknowledge().unwrap();
        match case {
            "refused" => d.fail_next_transaction(),
            "lost after commit" => d.lose_next_commit_answer(true),
            _ => d.lose_next_commit_answer(false),
        }
        for id in ["c", "a", "d"] {
            d.pipe(ev(id, 2)).unwrap();
        }
        d.commit().unwrap();
        assert_eq!(d.in_flight_commits(), 1, "{case}");
        for id in ["e", "c", "f"] {
            d.pipe(ev(id, 3)).unwrap();
        }
        d.acknowledge().unwrap();
        d.commit().unwrap();
        d.acknowledge().unwrap();
        let mut ids = out_ids(&d);
        ids.sort();
        assert_eq!(ids, ["a", "b", "c", "d", "e", "f"], "{case}");
        assert_eq!(d.committed_offset(0), Some(8), "{case}");
        for id in ["a", "d", "f"] {
            d.pipe(ev(id, 4)).unwrap();
        }
        d.commit().unwrap();
        d.acknowledge().unwrap();
        assert_eq!(out_ids(&d).len(), 6, "{case}: repeats after recovery pass");
    }
}

#[test]
fn a_crash_while_a_transaction_commits_repeats_nothing_and_loses_nothing() {
    for point in failpoints::commit_failpoints(Guarantee::ExactlyOnceV2) {
        for wipe in [false, true] {
            let ctx = format!("at {point}{}", if wipe { " + wiped state" } else { "" });
            let mut d = eos_pipelined();
            for id in ["a", "b", "a"] {
                d.pipe(ev(id, 1)).unwrap();
            }
            d.commit().unwrap();
            d.acknowledge().unwrap();
            d.crash_at(point).unwrap();
            for id in ["c", "b", "d"] {
                d.pipe(ev(id, 2)).unwrap();
            }
            d.commit().unwrap();
            if d.crashed_at().is_none() {
                // Records processed while the transaction commits.
                for id in ["e", "c", "f"] {
                    d.pipe(ev(id, 3)).unwrap();
                }
                d.acknowledge().unwrap();
            }
            assert_eq!(d.crashed_at(), Some(*point), "{ctx}: the failpoint fired");
            if wipe {
                d.wipe_state();
            }
            d.restart().unwrap();
            d.commit().unwrap();
            d.acknowledge().unwrap();
            for id in ["e", "c", "f", "g"] {
                d.pipe(ev(id, 4)).unwrap();
            }
            d.commit().unwrap();
            d.acknowledge().unwrap();
            let ids = out_ids(&d);
            for id in ["a", "b", "c", "d", "e", "f", "g"] {
                let n = ids.iter().filter(|x| *x == id).count();
                assert_eq!(n, 1, "{ctx}: {id} came out {n} times: {ids:?}");
            }
        }
    }
}

/// The commit before a revocation or a stop waits for the transaction committing in the
/// background; when that fails only then (refused, or its answer lost either way), the
/// abort's rewind or the restart after an unknown outcome must still be carried out: the
/// records behind it are read again (none lost), and the marks of a transaction that did
/// commit are restored (no repeat).
#[test]
fn a_transaction_failing_under_the_commit_before_a_revocation_repeats_and_loses_nothing() {
    for case in ["refused", "lost after commit", "lost before commit"] {
        let mut d = eos_pipelined();
        for id in ["a", "b"] {
            d.pipe(ev(id, 1)).unwrap();
        }
        d.commit().unwrap();
        assert_eq!(d.in_flight_commits(), 1, "{case}");
        match case {
            "refused" => d.fail_next_transaction(),
            "lost after commit" => d.lose_next_commit_answer(true),
            _ => d.lose_next_commit_answer(false),
        }
        for id in ["c", "d"] {
            d.pipe(ev(id, 2)).unwrap();
        }
        d.commit_and_wait().unwrap();
        // Processing goes on; later copies of a and c are duplicates.
        d.pipe(ev("e", 3)).unwrap();
        d.commit_and_wait().unwrap();
        for id in ["a", "c"] {
            d.pipe(ev(id, 4)).unwrap();
        }
        d.commit_and_wait().unwrap();
        let ids = out_ids(&d);
        for id in ["a", "b", "c", "d", "e"] {
            let n = ids.iter().filter(|x| *x == id).count();
            assert_eq!(n, 1, "{case}: {id} came out {n} times: {ids:?}");
        }
    }
}
