//! Restore through the broker-free test driver: the changelog is captured, the local state
//! dropped, and the changelog replayed; including a rebalance in the middle of a restore
//! and the expiry sweep's tombstones. Each case has its exact output.

use onceflow::KeySource;
use onceflow::{__testkit::SWEEP_BATCH, DedupSpec};
use onceflow::{Format, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use std::time::Duration;

use onceflow::Guarantee;

/// Every test body runs once per guarantee: the driver commits with the runtime's protocol
/// under each.
const GUARANTEES: [Guarantee; 2] = [Guarantee::AtLeastOnce, Guarantee::ExactlyOnceV2];

fn driver_for(g: Guarantee, t: onceflow::Topology) -> TestDriver {
    TestDriver::new(t).guarantee(g)
}

const MIN: i64 = 60_000;
const T: i64 = 1_420_070_400_000;

fn driver(g: Guarantee, key: KeySource, format: Format, ttl_ms: i64, grace_ms: i64) -> TestDriver {
    let mut spec = DedupSpec::new(key);
    spec.ttl_ms = ttl_ms;
    spec.grace_ms = grace_ms;
    let t = TopologyBuilder::new("t")
        .source("in", format)
        .dedup("dedup", spec)
        .sink("out", "out")
        .build()
        .unwrap();
    driver_for(g, t)
}

fn by_id(g: Guarantee, ttl_ms: i64, grace_ms: i64) -> TestDriver {
    driver(
        g,
        KeySource::JsonPointer("/id".into()),
        Format::Json,
        ttl_ms,
        grace_ms,
    )
}

fn ev(id: &str, t: i64) -> TestRecord {
    TestRecord::json(format!(r#"{{"id":"{id}","t":{t}}}"#)).timestamp(t)
}

fn ids(d: &TestDriver) -> Vec<String> {
    d.output("out")
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
            format!(
                "{}@{}",
                v["id"].as_str().unwrap(),
                (v["t"].as_i64().unwrap() - T) / MIN
            )
        })
        .collect()
}

#[test]
fn a_restore_completes_before_the_first_record_is_processed() {
    for g in GUARANTEES {
        let mut d = by_id(g, 24 * 60 * MIN, 60 * MIN);
        for i in 1..=5 {
            d.pipe(ev(&format!("a{i}"), T)).unwrap();
        }
        d.wipe_state();
        for i in 1..=5 {
            d.pipe(ev(&format!("a{i}"), T + MIN)).unwrap();
        }
        assert_eq!(ids(&d), vec!["a1@0", "a2@0", "a3@0", "a4@0", "a5@0"]);
        assert_eq!(d.restored_records(), 5);
    }
}

#[test]
fn b_renewals_restore_in_log_order() {
    for g in GUARANTEES {
        let mut d = by_id(g, 10 * MIN, 60 * MIN);
        d.pipe(ev("k", T)).unwrap();
        d.pipe(ev("k", T + 11 * MIN)).unwrap();
        d.pipe(ev("k", T + 12 * MIN)).unwrap();
        d.wipe_state();
        d.pipe(ev("k", T + 13 * MIN)).unwrap();
        d.pipe(ev("m", T + 13 * MIN)).unwrap();
        assert_eq!(ids(&d), vec!["k@0", "k@11", "m@13"]);
    }
}

#[test]
fn put_tombstone_put_of_one_key_restore_in_log_order() {
    for g in GUARANTEES {
        // Grace 0: the sweep deletes k once stream time passes T + 10m.
        let mut d = by_id(g, 10 * MIN, 0);
        d.pipe(ev("k", T)).unwrap();
        d.pipe(ev("x", T + 20 * MIN)).unwrap();
        d.pipe(ev("y", T + 21 * MIN)).unwrap(); // second-highest time T+20m > T+10m: sweep k
        d.pipe(ev("k", T + 22 * MIN)).unwrap(); // no entry: first again
        let k_log: Vec<Option<i64>> = d
            .changelog("dedup", 0)
            .iter()
            .filter(|r| r.key == b"k")
            .map(|r| {
                r.value.as_ref().map(|v| {
                    use prost::Message;
                    onceflow::DedupEntry::decode(v.as_slice())
                        .unwrap()
                        .first_seen_ms
                })
            })
            .collect();
        assert_eq!(
            k_log,
            vec![Some(T), None, Some(T + 22 * MIN)],
            "put, tombstone, put"
        );
        d.wipe_state();
        d.pipe(ev("k", T + 23 * MIN)).unwrap(); // restored put wins over the tombstone
        assert_eq!(ids(&d), vec!["k@0", "x@20", "y@21", "k@22"]);
        let e = d.dedup_entry("dedup", 0, b"k").unwrap().unwrap();
        assert_eq!(e.first_seen_ms, T + 22 * MIN);
    }
}

#[test]
fn c_keys_sharing_prefixes_survive_a_restore_distinct() {
    for g in GUARANTEES {
        let mut d = driver(
            g,
            KeySource::Header("msg-id".into()),
            Format::Bytes,
            60 * MIN,
            60 * MIN,
        );
        let keys = ["a", "aa", "a:", "a:b", "ab", "ord:4", "ord:42", "ord:42:x"];
        for k in keys {
            d.pipe(TestRecord::json(k).header("msg-id", k).timestamp(T))
                .unwrap();
        }
        d.wipe_state();
        d.pipe(
            TestRecord::json("again")
                .header("msg-id", "ord:4")
                .timestamp(T),
        )
        .unwrap();
        let out: Vec<String> = d.output_values("out");
        assert_eq!(out, keys.iter().map(|k| k.to_string()).collect::<Vec<_>>());
        assert_eq!(d.restored_records(), 8);
    }
}

#[test]
fn d_non_utf8_keys_survive_a_restore_and_stay_distinct() {
    for g in GUARANTEES {
        let mut d = driver(
            g,
            KeySource::Header("msg-id".into()),
            Format::Bytes,
            60 * MIN,
            60 * MIN,
        );
        let raw: [&[u8]; 5] = [&[0x00], &[0xFF], &[0xC3, 0x28], &[0xC3, 0xA9], &[0x85]];
        for (i, k) in raw.iter().enumerate() {
            d.pipe(
                TestRecord::json(format!("r{i}"))
                    .header("msg-id", k.to_vec())
                    .timestamp(T),
            )
            .unwrap();
        }
        d.wipe_state();
        for (i, k) in raw.iter().enumerate() {
            d.pipe(
                TestRecord::json(format!("again{i}"))
                    .header("msg-id", k.to_vec())
                    .timestamp(T),
            )
            .unwrap();
        }
        d.pipe(
            TestRecord::json("fffd")
                .header("msg-id", vec![0xEF, 0xBF, 0xBD])
                .timestamp(T),
        )
        .unwrap();
        d.pipe(
            TestRecord::json("qmark")
                .header("msg-id", b"?".to_vec())
                .timestamp(T),
        )
        .unwrap();
        assert_eq!(
            d.output_values("out"),
            vec!["r0", "r1", "r2", "r3", "r4", "fffd", "qmark"]
        );
    }
}

#[test]
fn a_rebalance_in_the_middle_of_a_restore_resumes_where_it_stopped() {
    for g in GUARANTEES {
        let mut d = by_id(g, 24 * 60 * MIN, 60 * MIN);
        for i in 0..50 {
            d.pipe(ev(&format!("e{i}"), T)).unwrap();
        }
        d.wipe_state();
        d.restore_partially(0, 20).unwrap(); // assigned, 20 of 50 restored, revoked
        assert_eq!(d.restored_records(), 20);
        for i in 0..50 {
            d.pipe(ev(&format!("e{i}"), T + MIN)).unwrap(); // assigned again: the rest restores
        }
        assert_eq!(
            d.restored_records(),
            50,
            "the second restore starts at the checkpoint, not at 0"
        );
        assert_eq!(d.output("out").len(), 50, "no record passed twice");
    }
}

#[test]
fn the_sweep_is_bounded_per_commit() {
    for g in GUARANTEES {
        let mut d = by_id(g, MIN, 0).auto_commit(false);
        let n = SWEEP_BATCH * 2 + 500;
        for i in 0..n {
            d.pipe(ev(&format!("s{i:05}"), T)).unwrap();
        }
        d.commit().unwrap();
        d.pipe(ev("late1", T + 10 * MIN)).unwrap();
        d.pipe(ev("late2", T + 10 * MIN)).unwrap();
        let tombstones = |d: &TestDriver| {
            d.changelog("dedup", 0)
                .iter()
                .filter(|r| r.value.is_none())
                .count()
        };
        d.commit().unwrap();
        assert_eq!(
            tombstones(&d),
            SWEEP_BATCH,
            "one commit sweeps at most SWEEP_BATCH entries"
        );
        d.commit().unwrap();
        assert_eq!(tombstones(&d), SWEEP_BATCH, "no record, no commit work");
        for round in 0..3 {
            d.pipe(ev(&format!("tick{round}"), T + 10 * MIN)).unwrap();
            d.commit().unwrap();
        }
        assert_eq!(
            tombstones(&d),
            n,
            "every expired entry is swept in the end, live ones stay"
        );
        assert!(d.dedup_entry("dedup", 0, b"late1").unwrap().is_some());
    }
}

/// The sweep reads no entry while none can have expired (stream time within TTL plus grace
/// of the oldest entry's base), also after a restore, and reads them once one can.
#[test]
fn the_sweep_reads_nothing_while_no_entry_can_have_expired() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    for g in GUARANTEES {
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let read = || -> u64 {
            snap.snapshot()
                .into_vec()
                .into_iter()
                .filter(|(k, ..)| k.key().name() == "onceflow_dedup_sweep_read_total")
                .map(|(.., v)| match v {
                    DebugValue::Counter(n) => n,
                    _ => 0,
                })
                .sum()
        };
        metrics::with_local_recorder(&recorder, || {
            let mut d = by_id(g, 10 * MIN, 0).auto_commit(false);
            for i in 0..100 {
                d.pipe(ev(&format!("k{i:03}"), T + i)).unwrap();
            }
            d.commit().unwrap();
            // Stream time (the second-highest time) moves to T + 9 min: 9 min < 10.
            d.pipe(ev("n0", T + 9 * MIN)).unwrap();
            d.pipe(ev("n1", T + 9 * MIN)).unwrap();
            d.commit().unwrap();
            d.commit().unwrap();
            assert_eq!(read(), 0, "{g:?}: nothing can have expired, nothing read");
            d.wipe_state();
            d.pipe(ev("n2", T + 9 * MIN + 1)).unwrap(); // restored, then processed
            d.commit().unwrap();
            assert_eq!(d.restored_records(), 102, "{g:?}");
            assert_eq!(read(), 0, "{g:?}: after the restore too");
            // Stream time T + 11 min: the k entries (T + 0..99 ms) have expired.
            d.pipe(ev("t0", T + 11 * MIN)).unwrap();
            d.pipe(ev("t1", T + 11 * MIN)).unwrap();
            d.commit().unwrap();
            assert!(read() >= 100, "{g:?}: {} entries read", read());
            let tombstones = d
                .changelog("dedup", 0)
                .iter()
                .filter(|r| r.value.is_none())
                .count();
            assert_eq!(tombstones, 100, "{g:?}: every k entry swept, no other");
        });
    }
}

#[test]
fn neither_downtime_nor_one_far_future_timestamp_expires_live_state() {
    for g in GUARANTEES {
        let mut d = by_id(g, 10 * MIN, 0);
        d.pipe(ev("k", T)).unwrap();
        d.advance_wall_clock(Duration::from_secs(30 * 24 * 3600)); // a month of downtime
        d.pipe(ev("far", T + 365 * 24 * 60 * MIN)).unwrap(); // one bogus timestamp
        d.pipe(ev("k", T + 5 * MIN)).unwrap();
        assert_eq!(ids(&d), vec!["k@0", "far@525600"]);
        assert!(d.dedup_entry("dedup", 0, b"k").unwrap().is_some());
    }
}

#[test]
fn max_keys_evicts_the_oldest_with_a_tombstone_and_a_metric() {
    for g in GUARANTEES {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let (out, log) = metrics::with_local_recorder(&recorder, || {
            let spec = DedupSpec::new(KeySource::JsonPointer("/id".into())).with_max_keys(3);
            let t = TopologyBuilder::new("t")
                .source("in", Format::Json)
                .dedup("dedup", spec)
                .sink("out", "out")
                .build()
                .unwrap();
            let mut d = driver_for(g, t);
            d.pipe(ev("c", T + 2 * MIN)).unwrap();
            d.pipe(ev("a", T)).unwrap();
            d.pipe(ev("b", T + MIN)).unwrap();
            d.pipe(ev("d", T + 3 * MIN)).unwrap(); // 4 keys: a (oldest first-seen) goes
            d.pipe(ev("b", T + 4 * MIN)).unwrap(); // still kept: duplicate
            d.pipe(ev("a", T + 5 * MIN)).unwrap(); // evicted: passes again, evicting b
                                                   // The eviction survives a restore: it is in the changelog as a tombstone.
            d.wipe_state();
            d.pipe(ev("b", T + 6 * MIN)).unwrap();
            let log: Vec<(String, bool)> = d
                .changelog("dedup", 0)
                .iter()
                .map(|r| (String::from_utf8(r.key.clone()).unwrap(), r.value.is_some()))
                .collect();
            (ids(&d), log)
        });
        assert_eq!(out, vec!["c@2", "a@0", "b@1", "d@3", "a@5", "b@6"]);
        let s = |k: &str, put: bool| (k.to_string(), put);
        assert_eq!(
            log,
            vec![
                s("c", true),
                s("a", true),
                s("b", true),
                s("d", true),
                s("a", false),
                s("a", true),
                s("b", false),
                s("b", true),
                s("c", false)
            ]
        );
        let mut evicted = 0;
        let mut keys = None;
        for (key, _, _, value) in snap.snapshot().into_vec() {
            match (key.key().name(), value) {
                ("onceflow_dedup_evicted_total", DebugValue::Counter(n)) => evicted += n,
                ("onceflow_dedup_keys", DebugValue::Gauge(g)) => keys = Some(g.into_inner()),
                _ => {}
            }
        }
        assert_eq!(evicted, 3);
        assert_eq!(keys, Some(3.0));
    }
}

/// Issue 11, item 2: a first occurrence whose own time is already a window behind stream
/// time keeps its entry for a full window after it arrived (the sweep counts from the
/// stream time when it was written), so its own duplicates are caught; then it expires.
#[test]
fn a_late_first_occurrence_keeps_its_window_through_the_sweeps() {
    for g in GUARANTEES {
        let mut d = by_id(g, 10 * MIN, 0); // TTL 10m, grace 0; every pipe commits (and sweeps)
        let h3 = 180 * MIN;
        d.pipe(ev("x", T + h3)).unwrap();
        d.pipe(ev("y", T + h3)).unwrap(); // stream time (second-highest) now T0+3h
        d.pipe(ev("id", T + MIN)).unwrap(); // late first occurrence: passes
        for i in 0..4 {
            d.pipe(ev(&format!("tick{i}"), T + h3)).unwrap(); // commits, each with a sweep
        }
        d.pipe(ev("id", T + 2 * MIN)).unwrap(); // its duplicate: dropped
        assert_eq!(
            ids(&d),
            vec![
                "x@180",
                "y@180",
                "id@1",
                "tick0@180",
                "tick1@180",
                "tick2@180",
                "tick3@180"
            ]
        );
        assert!(
            d.dedup_entry("dedup", 0, b"id").unwrap().is_some(),
            "the late entry survived the sweeps"
        );
        // A full window after it arrived (stream time past T0+3h+10m), the sweep removes it.
        d.pipe(ev("z", T + h3 + 11 * MIN)).unwrap();
        d.pipe(ev("w", T + h3 + 11 * MIN)).unwrap();
        d.pipe(ev("tick4", T + h3 + 11 * MIN)).unwrap();
        assert!(
            d.dedup_entry("dedup", 0, b"id").unwrap().is_none(),
            "expired a window after arrival"
        );
    }
}
