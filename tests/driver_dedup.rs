//! The dedup topology through the broker-free test driver: windows, time sources, key
//! sources, the staging guarantee and dead letters, each with its exact output.

use onceflow::headers::dlq_headers;
use onceflow::KeySource;
use onceflow::{ConflictPolicy, DedupSpec, TimeSource};
use onceflow::{Format, Topology, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use std::time::Duration;

use onceflow::failpoints;
use onceflow::Guarantee;

/// Every test body runs once per guarantee: the driver commits with the runtime's protocol
/// under each.
const GUARANTEES: [Guarantee; 2] = [Guarantee::AtLeastOnce, Guarantee::ExactlyOnceV2];

fn driver_for(g: Guarantee, t: onceflow::Topology) -> TestDriver {
    TestDriver::new(t).guarantee(g)
}

const MIN: i64 = 60_000;

fn topology(key: KeySource, ttl_ms: i64, time: TimeSource, format: Format) -> Topology {
    let mut spec = DedupSpec::new(key);
    spec.ttl_ms = ttl_ms;
    spec.time = time;
    // These tests pipe every copy of a key to one partition (the promise of `source`);
    // tests/driver_repartition.rs covers copies on several partitions.
    spec.partitioning = Some(onceflow::Partitioning::Source);
    TopologyBuilder::new("t")
        .source("in", format)
        .dedup("dedup", spec)
        .sink("out", "out")
        .build()
        .unwrap()
}

fn by_id(g: Guarantee, ttl_ms: i64) -> TestDriver {
    driver_for(
        g,
        topology(
            KeySource::JsonPointer("/id".into()),
            ttl_ms,
            TimeSource::Event,
            Format::Json,
        ),
    )
}

fn ev(id: &str, t: i64) -> TestRecord {
    TestRecord::json(format!(r#"{{"id":"{id}","t":{t}}}"#)).timestamp(t)
}

/// Stream time survives a restart: it starts again from the committed entries, so a late
/// first occurrence among the first records after it is known as late and keeps its entry
/// a full window after it arrived (before, it was swept at the next commit and its copy
/// passed).
#[test]
fn a_late_first_occurrence_right_after_a_restart_keeps_its_window() {
    for g in GUARANTEES {
        let mut d = by_id(g, 10 * MIN);
        let t = 1_420_070_400_000;
        let h5 = 300 * MIN;
        d.pipe(ev("a", t + h5)).unwrap();
        d.pipe(ev("b", t + h5)).unwrap(); // stream time t + 5 h, committed
        d.crash();
        d.pipe(ev("c", t + h5)).unwrap();
        d.pipe(ev("late", t)).unwrap(); // 5 h late: a first occurrence
        d.pipe(ev("e", t + h5)).unwrap(); // a commit and its sweep
        d.pipe(ev("late", t)).unwrap(); // its copy
        let c = d.counts();
        assert_eq!((c.passed, c.duplicates), (5, 1), "{g:?}");
        assert!(
            d.dedup_entry("dedup", 0, b"late").unwrap().is_some(),
            "{g:?}"
        );
    }
}

#[test]
fn event_time_window_is_judged_per_key() {
    for g in GUARANTEES {
        let mut d = by_id(g, 10 * MIN);
        let t = 1_420_070_400_000; // 2015-01-01T00:00:00Z
        d.pipe(ev("k", t)).unwrap();
        d.pipe(ev("k", t + 11 * MIN)).unwrap(); // past the TTL: new again
        d.pipe(ev("k", t + 12 * MIN)).unwrap(); // within the renewed window: duplicate
        d.pipe(ev("m", t + 60 * 24 * MIN)).unwrap(); // far-future record of another key
        d.pipe(ev("k", t + 13 * MIN)).unwrap(); // still a duplicate: stream time does not expire k
        d.pipe(ev("late", t - 60 * MIN)).unwrap(); // a late first occurrence is a first occurrence
        assert_eq!(
            d.output_values("out"),
            vec![
                format!(r#"{{"id":"k","t":{t}}}"#),
                format!(r#"{{"id":"k","t":{}}}"#, t + 11 * MIN),
                format!(r#"{{"id":"m","t":{}}}"#, t + 60 * 24 * MIN),
                format!(r#"{{"id":"late","t":{}}}"#, t - 60 * MIN),
            ]
        );
        let c = d.counts();
        assert_eq!((c.records_in, c.passed, c.duplicates), (6, 4, 2));
    }
}

#[test]
fn processing_time_uses_the_wall_clock() {
    for g in GUARANTEES {
        let mut d = driver_for(
            g,
            topology(
                KeySource::JsonPointer("/id".into()),
                10 * MIN,
                TimeSource::Processing,
                Format::Json,
            ),
        );
        // Record timestamps say the repeats are far apart; the wall clock says they are not.
        d.pipe(ev("a", 0)).unwrap();
        d.pipe(ev("a", 100 * MIN)).unwrap();
        d.advance_wall_clock(Duration::from_secs(11 * 60));
        d.pipe(ev("a", 200 * MIN)).unwrap();
        assert_eq!(d.output("out").len(), 2);
        let e = d.dedup_entry("dedup", 0, b"a").unwrap().unwrap();
        assert_eq!(
            e.first_seen_ms,
            11 * MIN,
            "first-seen is the wall clock of the renewal"
        );
    }
}

#[test]
fn entry_records_first_seen_time_and_source_position() {
    for g in GUARANTEES {
        let mut d = by_id(g, 10 * MIN);
        d.pipe(ev("x", 5).partition(2)).unwrap();
        d.pipe(ev("y", 6).partition(2)).unwrap();
        d.pipe(ev("y", 7).partition(2)).unwrap();
        let e = d.dedup_entry("dedup", 2, b"y").unwrap().unwrap();
        assert_eq!(
            (e.first_seen_ms, e.source_partition, e.source_offset),
            (6, 2, 1)
        );
        assert!(
            d.dedup_entry("dedup", 0, b"y").unwrap().is_none(),
            "state is per partition"
        );
    }
}

#[test]
fn a_mark_never_hides_a_lost_output() {
    for g in GUARANTEES {
        let mut d = by_id(g, 10 * MIN).auto_commit(false);
        d.pipe(ev("a", 1)).unwrap();
        d.pipe(ev("a", 2)).unwrap(); // lookups see the batch's own pending entry
        assert_eq!(
            d.dedup_entry("dedup", 0, b"a")
                .unwrap()
                .map(|e| e.first_seen_ms),
            Some(1)
        );
        // Crash before the outputs were durable: the staged entry must go with them.
        d.crash();
        assert!(d.output("out").is_empty());
        assert!(
            d.dedup_entry("dedup", 0, b"a").unwrap().is_none(),
            "no mark without its output"
        );
        // Redelivery after the crash: the record passes again, so nothing is lost.
        d.pipe(ev("a", 1)).unwrap();
        d.pipe(ev("a", 2)).unwrap();
        d.commit().unwrap();
        assert_eq!(
            d.output_values("out"),
            vec![r#"{"id":"a","t":1}"#.to_string()]
        );
        // After the commit the mark is durable: a crash no longer forgets it.
        d.crash();
        d.pipe(ev("a", 3)).unwrap();
        d.commit().unwrap();
        assert_eq!(d.output("out").len(), 1);
    }
}

#[test]
fn keys_sharing_prefixes_or_separators_stay_distinct() {
    for g in GUARANTEES {
        let mut d = driver_for(
            g,
            topology(
                KeySource::Header("msg-id".into()),
                10 * MIN,
                TimeSource::Event,
                Format::Bytes,
            ),
        );
        let keys = [
            "a", "aa", "a:", "a:b", "ab", "ord:4", "ord:42", "ord:42:x", "ord:4",
        ];
        for (i, k) in keys.iter().enumerate() {
            d.pipe(
                TestRecord::json(format!("v{i}"))
                    .header("msg-id", *k)
                    .timestamp(i as i64),
            )
            .unwrap();
        }
        assert_eq!(
            d.output("out").len(),
            8,
            "the repeat of ord:4 is the only duplicate"
        );
        assert_eq!(d.counts().duplicates, 1);
    }
}

#[test]
fn non_utf8_keys_are_raw_bytes() {
    for g in GUARANTEES {
        let mut d = driver_for(
            g,
            topology(
                KeySource::Header("msg-id".into()),
                10 * MIN,
                TimeSource::Event,
                Format::Bytes,
            ),
        );
        let keys: [&[u8]; 8] = [
            &[0x00],
            &[0xFF],
            &[0xC3, 0x28],
            &[0xC3, 0xA9],
            &[0x85],
            &[0xEF, 0xBF, 0xBD],
            b"?",
            &[0xFF],
        ];
        for (i, k) in keys.iter().enumerate() {
            d.pipe(
                TestRecord::json(format!("v{i}"))
                    .header("msg-id", k.to_vec())
                    .timestamp(i as i64),
            )
            .unwrap();
        }
        assert_eq!(
            d.output("out").len(),
            7,
            "no two invalid byte strings merge into U+FFFD or '?'"
        );
        assert!(d.dedup_entry("dedup", 0, &[0xFF]).unwrap().is_some());
    }
}

#[test]
fn kafka_key_and_composite_keys() {
    for g in GUARANTEES {
        let mut d = driver_for(
            g,
            topology(
                KeySource::KafkaKey,
                10 * MIN,
                TimeSource::Event,
                Format::Bytes,
            ),
        );
        d.pipe(TestRecord::json("1").key("k1")).unwrap();
        d.pipe(TestRecord::json("2").key("k1")).unwrap();
        d.pipe(TestRecord::json("3").key("k2")).unwrap();
        assert_eq!(d.output_values("out"), vec!["1", "3"]);

        let ce = KeySource::Composite(vec![
            KeySource::Header("ce_id".into()),
            KeySource::Header("ce_source".into()),
        ]);
        let mut d = driver_for(g, topology(ce, 10 * MIN, TimeSource::Event, Format::Bytes));
        d.pipe(
            TestRecord::json("1")
                .header("ce_id", "1")
                .header("ce_source", "/a"),
        )
        .unwrap();
        d.pipe(
            TestRecord::json("2")
                .header("ce_id", "1")
                .header("ce_source", "/b"),
        )
        .unwrap();
        d.pipe(
            TestRecord::json("3")
                .header("ce_id", "1")
                .header("ce_source", "/a"),
        )
        .unwrap();
        assert_eq!(d.output_values("out"), vec!["1", "2"]);
    }
}

#[test]
fn fingerprint_conflicts_follow_the_policy() {
    for g in GUARANTEES {
        for (policy, want_out, want_dlq) in [
            (ConflictPolicy::Drop, vec![r#"{"id":1,"v":"a"}"#], 0),
            (
                ConflictPolicy::Pass,
                vec![r#"{"id":1,"v":"a"}"#, r#"{"id":1,"v":"b"}"#],
                0,
            ),
            (ConflictPolicy::DeadLetter, vec![r#"{"id":1,"v":"a"}"#], 1),
        ] {
            let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
            spec.fingerprint = true;
            spec.on_conflict = policy;
            let t = TopologyBuilder::new("t")
                .source("in", Format::Json)
                .dedup("dedup", spec)
                .sink("out", "out")
                .build()
                .unwrap();
            let mut d = driver_for(g, t);
            d.pipe(TestRecord::json(r#"{"id":1,"v":"a"}"#)).unwrap();
            d.pipe(TestRecord::json(r#"{"id":1,"v":"a"}"#)).unwrap(); // same payload: duplicate
            d.pipe(TestRecord::json(r#"{"id":1,"v":"b"}"#)).unwrap(); // other payload: conflict
            assert_eq!(d.output_values("out"), want_out, "{policy:?}");
            assert_eq!(d.dead_letters().len(), want_dlq, "{policy:?}");
            let c = d.counts();
            assert_eq!((c.duplicates, c.conflicts), (1, 1), "{policy:?}");
        }
    }
}

fn header(r: &onceflow::OutRecord, name: &str) -> String {
    let v = r
        .headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.clone())
        .unwrap_or_default();
    String::from_utf8(v.to_vec()).unwrap()
}

#[test]
fn bad_records_go_to_the_dead_letter_topic_and_processing_goes_on() {
    for g in GUARANTEES {
        let mut d = by_id(g, 10 * MIN);
        d.pipe(TestRecord::json("not json").key("k0").header("trace", "t0"))
            .unwrap();
        d.pipe(TestRecord::json(r#"{"no_id":1}"#)).unwrap();
        d.pipe(TestRecord::json(r#"{"no_id":2}"#)).unwrap();
        d.pipe(TestRecord::json(r#"{"id":{"nested":true}}"#))
            .unwrap();
        d.pipe(TestRecord::json(r#"{"id":null}"#)).unwrap();
        d.pipe(TestRecord::null_value()).unwrap();
        d.pipe(TestRecord::json(r#"{"id":"ok"}"#)).unwrap();
        assert_eq!(d.output_values("out"), vec![r#"{"id":"ok"}"#]);
        let dl = d.dead_letters();
        let reasons: Vec<(String, String, String)> = dl
            .iter()
            .map(|r| {
                (
                    header(r, dlq_headers::OFFSET),
                    header(r, dlq_headers::STAGE),
                    header(r, dlq_headers::REASON),
                )
            })
            .collect();
        let s = |a: &str, b: &str, c: &str| (a.to_string(), b.to_string(), c.to_string());
        assert_eq!(
            reasons,
            vec![
                s(
                    "0",
                    "source",
                    "value is not valid JSON: expected ident at line 1 column 2"
                ),
                s("1", "dedup", "key field /id is missing"),
                s("2", "dedup", "key field /id is missing"),
                s(
                    "3",
                    "dedup",
                    "key field /id is an object, expected a string or a number"
                ),
                s("4", "dedup", "key field /id is null"),
                s("5", "source", "value is null, expected JSON"),
            ],
            "two records without a key are two dead letters, never one null key"
        );
        // The dead letter is the source record as read, plus where it came from.
        let first = dl[0];
        assert_eq!(first.value.as_deref(), Some(&b"not json"[..]));
        assert_eq!(first.key.as_deref(), Some(&b"k0"[..]));
        assert_eq!(header(first, "trace"), "t0");
        assert_eq!(header(first, dlq_headers::TOPIC), "in");
        assert_eq!(header(first, dlq_headers::PARTITION), "0");
        assert_eq!(d.counts().dead_lettered, 6);
        assert_eq!(
            d.committed_offset(0),
            Some(7),
            "dead letters are committed past, not retried"
        );
    }
}

#[test]
fn dead_letters_are_counted_in_a_metric() {
    for g in GUARANTEES {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let mut d = by_id(g, 10 * MIN);
            d.pipe(TestRecord::json("{")).unwrap();
            d.pipe(TestRecord::json(r#"{"x":1}"#)).unwrap();
            d.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap();
            d.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap();
        });
        let mut got = std::collections::BTreeMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            if let DebugValue::Counter(n) = value {
                let labels: Vec<String> = key
                    .key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                got.insert(format!("{}{{{}}}", key.key().name(), labels.join(",")), n);
            }
        }
        // By the stage that refused the record: `source` for a value that is not JSON, the
        // dedup stage for a record without its key.
        assert_eq!(
            got.get("onceflow_dead_letters_total{topology=t,topic=in,stage=source}"),
            Some(&1),
            "{got:?}"
        );
        assert_eq!(
            got.get("onceflow_dead_letters_total{topology=t,topic=in,stage=dedup}"),
            Some(&1),
            "{got:?}"
        );
        assert_eq!(
            got.get("onceflow_records_processed_total{topology=t,stage=dedup,result=passed}"),
            Some(&1)
        );
        assert_eq!(
            got.get("onceflow_records_processed_total{topology=t,stage=dedup,result=duplicate}"),
            Some(&1)
        );
        assert_eq!(
            got.get("onceflow_records_processed_total{topology=t,stage=dedup,result=error}"),
            Some(&1)
        );
    }
}

/// The ids in `out`, in order.
fn out_ids(d: &TestDriver) -> Vec<String> {
    d.output("out")
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
            v["id"].as_str().unwrap().to_string()
        })
        .collect()
}

/// The commit protocol under crashes: the driver dies at each failpoint of each
/// guarantee's commit (in the second of three commits), restarts (restore from the
/// changelog, replay from the committed offsets), and must have lost nothing: every
/// distinct id comes out; under exactly_once_v2 exactly once, under at_least_once at most
/// twice (the batch in flight); and every id's mark survives, so later repeats are dropped.
#[test]
fn a_crash_at_every_failpoint_loses_nothing() {
    for g in GUARANTEES {
        for point in failpoints::commit_failpoints(g) {
            for wipe in [false, true] {
                let ctx = format!(
                    "{g:?} at {point}{}",
                    if wipe { " + wiped state" } else { "" }
                );
                let mut d = by_id(g, 10 * MIN).auto_commit(false);
                let batches: [&[&str]; 3] = [
                    &["a", "b", "a", "c"],
                    &["b", "d", "e", "d", "a"],
                    &["f", "e", "c", "g"],
                ];
                for (i, batch) in batches.iter().enumerate() {
                    if i == 1 {
                        d.crash_at(point).unwrap();
                    }
                    for id in batch.iter() {
                        d.pipe(ev(id, 1)).unwrap();
                    }
                    d.commit().unwrap();
                    if i == 1 {
                        assert_eq!(d.crashed_at(), Some(*point), "{ctx}: the failpoint fired");
                        if wipe {
                            d.wipe_state();
                        }
                        d.restart().unwrap();
                        d.commit().unwrap();
                    }
                }
                let ids = out_ids(&d);
                for id in ["a", "b", "c", "d", "e", "f", "g"] {
                    let n = ids.iter().filter(|x| *x == id).count();
                    assert!(n >= 1, "{ctx}: {id} lost: {ids:?}");
                    match g {
                        Guarantee::ExactlyOnceV2 => {
                            assert_eq!(n, 1, "{ctx}: {id} repeated: {ids:?}")
                        }
                        Guarantee::AtLeastOnce => {
                            assert!(n <= 2, "{ctx}: {id} repeated more than once: {ids:?}")
                        }
                    }
                    assert!(
                        d.dedup_entry("dedup", 0, id.as_bytes()).unwrap().is_some(),
                        "{ctx}: the mark of {id} survives"
                    );
                }
                assert_eq!(d.committed_offset(0), Some(13), "{ctx}");
                // Repeats after recovery are duplicates.
                let before = ids.len();
                for id in ["a", "d", "g"] {
                    d.pipe(ev(id, 2)).unwrap();
                }
                d.commit().unwrap();
                assert_eq!(
                    out_ids(&d).len(),
                    before,
                    "{ctx}: repeats after recovery pass"
                );
            }
        }
    }
}

#[test]
fn crash_at_refuses_a_point_of_the_other_guarantee() {
    let mut d = by_id(Guarantee::AtLeastOnce, MIN);
    assert!(d.crash_at(failpoints::EOS_BEFORE_COMMIT).is_err());
    assert!(d.crash_at(failpoints::AFTER_FLUSH).is_ok());
    let mut d = by_id(Guarantee::ExactlyOnceV2, MIN);
    assert!(d.crash_at(failpoints::AFTER_FLUSH).is_err());
    assert!(d.crash_at(failpoints::EOS_AFTER_COMMIT).is_ok());
}

/// exactly_once_v2: a transaction that fails to commit (abortable) is aborted, its staged
/// marks dropped, and its records read again from the committed offsets; the next commit
/// gives each id once.
#[test]
fn an_aborted_transaction_rewinds_and_repeats_nothing() {
    let mut d = by_id(Guarantee::ExactlyOnceV2, 10 * MIN).auto_commit(false);
    for id in ["a", "b", "a"] {
        d.pipe(ev(id, 1)).unwrap();
    }
    d.commit().unwrap();
    for id in ["c", "b", "d", "c"] {
        d.pipe(ev(id, 1)).unwrap();
    }
    d.fail_next_transaction();
    d.commit().unwrap();
    assert_eq!(
        out_ids(&d),
        ["a", "b"],
        "nothing of the aborted transaction"
    );
    assert_eq!(d.committed_offset(0), Some(3));
    // The rewound records were processed again: had the aborted marks stayed, c and d
    // would be dropped as duplicates now, and lost.
    d.commit().unwrap();
    assert_eq!(out_ids(&d), ["a", "b", "c", "d"]);
    assert_eq!(d.committed_offset(0), Some(7));
    // The counts (the `summary:` line) are what was committed, not what was rolled back.
    let c = d.counts();
    assert_eq!(
        (c.records_in, c.passed, c.duplicates, c.records_out),
        (7, 4, 3, 4),
        "{c:?}"
    );
}

/// After an unknown outcome the producer must be re-created; when that fails (the brokers
/// stay away, or three send-offsets calls are stuck in old producers, librdkafka #5456),
/// the commit returns the error, which stops the instance, and nothing of the transaction
/// shows.
#[test]
fn a_producer_that_cannot_be_re_created_stops_the_instance() {
    let mut d = by_id(Guarantee::ExactlyOnceV2, 10 * MIN).auto_commit(false);
    d.pipe(ev("a", 1)).unwrap();
    d.commit().unwrap();
    d.pipe(ev("b", 1)).unwrap();
    d.lose_next_commit_answer(false);
    d.fail_next_producer_recreation("3 calls stuck");
    let e = d.commit().expect_err("the commit must fail, not go on");
    assert!(e.to_string().contains("3 calls stuck"), "{e}");
    assert_eq!(out_ids(&d), ["a"]);
    assert_eq!(d.committed_offset(0), Some(1));
}

/// exactly_once_v2: a transaction whose commit answer is lost, after it committed or
/// before, is never retried blindly: the producer is re-created, the staged marks dropped,
/// the stores restored from the changelog (which holds the marks if it committed) and the
/// records read again from the committed offsets. Later repeats of every id are dropped
/// and nothing is output twice or lost. (Treated as an abort, the committed case would
/// lose the marks of c and d, and their repeats would pass again.)
#[test]
fn a_transaction_of_unknown_outcome_repeats_nothing_and_loses_nothing() {
    for committed in [true, false] {
        let mut d = by_id(Guarantee::ExactlyOnceV2, 10 * MIN).auto_commit(false);
        for id in ["a", "b", "a"] {
            d.pipe(ev(id, 1)).unwrap();
        }
        d.commit().unwrap();
        for id in ["c", "b", "d", "c"] {
            d.pipe(ev(id, 1)).unwrap();
        }
        d.lose_next_commit_answer(committed);
        d.commit().unwrap();
        d.commit().unwrap();
        for id in ["a", "b", "c", "d"] {
            d.pipe(ev(id, 2)).unwrap();
        }
        d.commit().unwrap();
        assert_eq!(
            out_ids(&d),
            ["a", "b", "c", "d"],
            "commit answer lost after it {}",
            if committed { "committed" } else { "failed" }
        );
        assert_eq!(d.committed_offset(0), Some(11));
    }
}
