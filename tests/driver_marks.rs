//! Failed effects leave no mark (issue 11, item 4), through the broker-free test driver:
//! a record that passed a dedup stage and then ends in the dead-letter topic (an HTTP
//! effect that failed for good, a map or route error) has its dedup mark withdrawn in the
//! same commit, so a later delivery of the same id runs the effect.

mod sink_support;

use onceflow::DedupSpec;
use onceflow::KeySource;
use onceflow::MapSpec;
use onceflow::RouteSpec;
use onceflow::{EffectSpec, ExternalSinkSpec, HttpSpec, Secret, StoreSpec};
use onceflow::{Format, Topology, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use sink_support::*;
use std::sync::Arc;
use std::time::Duration;

/// An HTTP sink with `retries: 0` behind a dedup stage on `/id`; the idempotency key is
/// the dedup key.
fn dedup_then_http(url: &str, dir: &tempfile::TempDir) -> Topology {
    dedup_then_http_with(
        DedupSpec::new(KeySource::JsonPointer("/id".into())),
        url,
        dir,
    )
}

/// As [`dedup_then_http`], with the dedup stage `dedup`.
fn dedup_then_http_with(dedup: DedupSpec, url: &str, dir: &tempfile::TempDir) -> Topology {
    let mut h = HttpSpec::new(Secret::Inline(url.to_string()));
    h.retries = 0;
    h.timeout = Duration::from_secs(5);
    let spec = ExternalSinkSpec::new(
        EffectSpec::Http(h),
        StoreSpec::Sled {
            path: Some(dir.path().join("idem")),
        },
    );
    TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup("dedup", dedup)
        .external_sink("hook", spec)
        .sink("out", "out")
        .build()
        .unwrap()
}

/// A receiver that answers 503 to the first call for `id-03`, 200 to everything else.
fn fails_id03_once() -> Receiver {
    Receiver::start(Arc::new(|k, n| {
        if k == Some(&b"id-03"[..]) && n == 0 {
            (503, Duration::ZERO)
        } else {
            (200, Duration::ZERO)
        }
    }))
}

fn id(id: &str, ts: i64) -> TestRecord {
    TestRecord::json(format!(r#"{{"id":"{id}"}}"#)).timestamp(ts)
}

fn oks(rx: &Receiver, key: &str) -> usize {
    rx.per_key()
        .get(key.as_bytes())
        .map_or(0, |s| s.iter().filter(|s| (200..300).contains(*s)).count())
}

fn changelog_keys(d: &TestDriver) -> Vec<(String, bool)> {
    d.changelog("dedup", 0)
        .iter()
        .map(|r| {
            (
                String::from_utf8_lossy(&r.key).into_owned(),
                r.value.is_some(),
            )
        })
        .collect()
}

#[test]
fn a_dead_lettered_effect_leaves_no_mark_and_its_redelivery_runs_it() {
    let rx = fails_id03_once();
    let dir = tempfile::tempdir().unwrap();
    let mut d = TestDriver::new(dedup_then_http(&rx.url, &dir));
    for (i, k) in ["id-01", "id-02", "id-03", "id-04", "id-05"]
        .iter()
        .enumerate()
    {
        d.pipe(id(k, 1000 + i as i64)).unwrap();
    }
    assert_eq!(d.dead_letters().len(), 1, "id-03 is dead-lettered");
    assert_eq!(oks(&rx, "id-03"), 0);
    // No mark, staged or committed, and no changelog record for id-03.
    assert_eq!(d.dedup_entry("dedup", 0, b"id-03").unwrap(), None);
    assert!(
        !changelog_keys(&d).iter().any(|(k, _)| k == "id-03"),
        "{:?}",
        changelog_keys(&d)
    );
    // A marked id stays a duplicate: it never reaches the effect again.
    d.pipe(id("id-02", 2000)).unwrap();
    // The redelivery of id-03 runs the effect: exactly one 2xx.
    d.pipe(id("id-03", 2001)).unwrap();
    assert_eq!(oks(&rx, "id-03"), 1, "{:?}", rx.per_key());
    assert_eq!(oks(&rx, "id-02"), 1);
    assert!(d.dedup_entry("dedup", 0, b"id-03").unwrap().is_some());
    // A third delivery is a duplicate again.
    d.pipe(id("id-03", 2002)).unwrap();
    assert_eq!(oks(&rx, "id-03"), 1);
    assert_eq!(rx.calls().len(), 6, "{:?}", rx.per_key());
    let c = d.counts();
    assert_eq!((c.passed, c.duplicates, c.dead_lettered), (6, 2, 1));
    assert_eq!(d.output("out").len(), 5);
}

#[test]
fn a_twin_in_the_same_commit_passes_once_the_first_is_dead_lettered() {
    let rx = fails_id03_once();
    let dir = tempfile::tempdir().unwrap();
    let mut d = TestDriver::new(dedup_then_http(&rx.url, &dir)).auto_commit(false);
    d.pipe(id("id-01", 1000)).unwrap();
    d.pipe(id("id-03", 1001)).unwrap(); // 503: dead-lettered at the commit
    d.pipe(id("id-03", 1002)).unwrap(); // its twin: must run the effect
    d.pipe(id("id-03", 1003)).unwrap(); // a duplicate of the twin
    d.pipe(id("id-02", 1004)).unwrap();
    d.commit().unwrap();
    assert_eq!(oks(&rx, "id-03"), 1, "{:?}", rx.per_key());
    assert_eq!(rx.per_key()[&b"id-03".to_vec()], vec![503, 200]);
    assert_eq!(d.dead_letters().len(), 1);
    // The mark that stands is the twin's (offset 2), in the changelog once.
    let e = d.dedup_entry("dedup", 0, b"id-03").unwrap().unwrap();
    assert_eq!(e.source_offset, 2);
    let marks: Vec<_> = changelog_keys(&d)
        .into_iter()
        .filter(|(k, _)| k == "id-03")
        .collect();
    assert_eq!(marks, vec![("id-03".to_string(), true)]);
    assert_eq!(d.committed_offset(0), Some(5));
    // Later deliveries are duplicates.
    d.pipe(id("id-03", 1005)).unwrap();
    d.commit().unwrap();
    assert_eq!(oks(&rx, "id-03"), 1);
    assert_eq!(d.output("out").len(), 3);
}

#[test]
fn a_record_dead_lettered_by_a_map_or_route_leaves_no_mark() {
    // A map that fails on records without /amount, then a route that fails on amount 13.
    let map = MapSpec::new().set("/cents", |r| {
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap_or_default())
            .map_err(|e| e.to_string())?;
        let a = v
            .get("amount")
            .and_then(|a| a.as_i64())
            .ok_or("no /amount")?;
        Ok(serde_json::json!(a * 100))
    });
    let route = RouteSpec::new().when(
        |r| {
            let v: serde_json::Value =
                serde_json::from_slice(r.value.as_deref().unwrap_or_default())
                    .map_err(|e| e.to_string())?;
            if v["cents"] == 1300 {
                return Err("unlucky amount".into());
            }
            Ok(true)
        },
        "out",
    );
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup(
            "dedup",
            DedupSpec::new(KeySource::JsonPointer("/id".into())),
        )
        .map("cents", map)
        .route("route", route)
        .build()
        .unwrap();
    for batch in [true, false] {
        let mut d = TestDriver::new(t.clone()).auto_commit(batch);
        let rec = |id: &str, body: &str| {
            TestRecord::json(format!(r#"{{"id":"{id}"{body}}}"#)).timestamp(1000)
        };
        d.pipe(rec("a", r#","amount":1"#)).unwrap();
        d.pipe(rec("b", "")).unwrap(); // map error
        d.pipe(rec("c", r#","amount":13"#)).unwrap(); // route error
        d.pipe(rec("b", r#","amount":2"#)).unwrap(); // fixed redelivery: passes
        d.pipe(rec("c", r#","amount":3"#)).unwrap(); // fixed redelivery: passes
        d.pipe(rec("a", r#","amount":1"#)).unwrap(); // duplicate
        d.commit().unwrap();
        assert_eq!(d.dead_letters().len(), 2, "batch {batch}");
        let out = d.output_values("out");
        assert_eq!(out.len(), 3, "batch {batch}: {out:?}");
        assert!(out[1].contains(r#""id":"b""#) && out[2].contains(r#""id":"c""#));
        for k in ["a", "b", "c"] {
            let e = d.dedup_entry("dedup", 0, k.as_bytes()).unwrap().unwrap();
            let want = match k {
                "a" => 0,
                "b" => 3,
                _ => 4,
            };
            assert_eq!(e.source_offset, want, "batch {batch}, key {k}");
        }
        let c = d.counts();
        assert_eq!((c.passed, c.duplicates, c.dead_lettered), (5, 1, 2));
    }
}

#[test]
fn a_withdrawn_mark_does_not_count_against_max_keys() {
    // max_keys 2: a, then b (dead-lettered by the map: its mark withdrawn), then c. Two
    // keys are kept, so a (the oldest) is not evicted and stays a duplicate.
    let map = MapSpec::new().set("/ok", |r| {
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap_or_default())
            .map_err(|e| e.to_string())?;
        if v["id"] == "b" {
            return Err("refused".into());
        }
        Ok(serde_json::json!(true))
    });
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup(
            "dedup",
            DedupSpec::new(KeySource::JsonPointer("/id".into())).with_max_keys(2),
        )
        .map("check", map)
        .sink("out", "out")
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(id("a", 1000)).unwrap();
    d.pipe(id("b", 1001)).unwrap();
    d.pipe(id("c", 1002)).unwrap();
    d.pipe(id("a", 1003)).unwrap();
    assert_eq!(d.output("out").len(), 2, "{:?}", d.output_values("out"));
    assert_eq!(d.counts().duplicates, 1);
    assert!(d.dedup_entry("dedup", 0, b"a").unwrap().is_some());
    assert_eq!(d.dedup_entry("dedup", 0, b"b").unwrap(), None);
}

#[test]
fn max_keys_does_not_evict_a_late_first_occurrence_it_just_wrote() {
    // max_keys 2: a (t=100 s), b (t=200 s), then `late` (t=50 s, older than both). Its entry
    // counts as written when it arrived, so a is evicted, and the copy of `late` right
    // after is a duplicate.
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup(
            "dedup",
            DedupSpec::new(KeySource::JsonPointer("/id".into())).with_max_keys(2),
        )
        .sink("out", "out")
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    for (key, t) in [
        ("a", 100_000),
        ("b", 200_000),
        ("late", 50_000),
        ("late", 50_000),
    ] {
        d.pipe(id(key, t)).unwrap();
    }
    let c = d.counts();
    assert_eq!(
        (c.passed, c.duplicates),
        (3, 1),
        "{:?}",
        d.output_values("out")
    );
    assert!(d.dedup_entry("dedup", 0, b"late").unwrap().is_some());
    assert_eq!(d.dedup_entry("dedup", 0, b"a").unwrap(), None);
}

/// A record larger than the producer accepts (`message.max.bytes`, librdkafka's default
/// 1,000,000 bytes in the driver) is refused by the sink stage: it goes to the dead-letter
/// topic with a reason naming the limit, its dedup mark is withdrawn, and processing goes
/// on. Before, the send failed after the mark was staged and the instance stopped (on
/// every restart: a poison pill).
#[test]
fn a_record_too_large_for_the_producer_is_dead_lettered_and_leaves_no_mark() {
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup(
            "dedup",
            DedupSpec::new(KeySource::JsonPointer("/id".into())),
        )
        .sink("out", "out")
        .build()
        .unwrap();
    for batch in [true, false] {
        let mut d = TestDriver::new(t.clone()).auto_commit(batch);
        let pad = "x".repeat(1_000_001);
        d.pipe(TestRecord::json(format!(r#"{{"id":"big","pad":"{pad}"}}"#)).timestamp(1000))
            .unwrap();
        d.pipe(id("a", 1001)).unwrap();
        d.pipe(id("big", 1002)).unwrap(); // small again: passes
        d.pipe(id("big", 1003)).unwrap(); // duplicate
        d.commit().unwrap();
        let dead = d.dead_letters();
        assert_eq!(dead.len(), 1, "batch {batch}");
        let reason = dead[0]
            .headers
            .iter()
            .find(|(k, _)| k == "onceflow.dlq.reason")
            .and_then(|(_, v)| v.clone())
            .unwrap();
        let reason = String::from_utf8_lossy(&reason).into_owned();
        assert!(reason.contains("message.max.bytes"), "{reason}");
        let out = d.output_values("out");
        assert_eq!(out.len(), 2, "batch {batch}: a, then the small big");
        assert!(out[1].contains(r#""id":"big""#));
        let e = d.dedup_entry("dedup", 0, b"big").unwrap().unwrap();
        assert_eq!(
            e.source_offset, 2,
            "batch {batch}: the mark is the small copy's"
        );
        let c = d.counts();
        assert_eq!(
            (c.passed, c.duplicates, c.dead_lettered),
            (3, 1, 1),
            "batch {batch}"
        );
    }
}

/// Held twins behind a repartition hop (issue 13): the first copy of an id and its twins
/// come from different source partitions with different Kafka keys, meet on the key's
/// repartition partition, and the first one's effect fails for good. Its mark is withdrawn
/// at the commit, the first twin held against it passes and runs the effect, the other is
/// a duplicate; the dead letter, the mark and the changelog name the original records.
#[test]
fn behind_a_hop_a_twin_from_another_partition_passes_once_the_first_is_dead_lettered() {
    use onceflow::__testkit::partition_for;
    use onceflow::headers::dlq_headers;
    use onceflow::{Guarantee, Partitioning};
    for g in [Guarantee::AtLeastOnce, Guarantee::ExactlyOnceV2] {
        let rx = fails_id03_once();
        let dir = tempfile::tempdir().unwrap();
        let dedup = DedupSpec::new(KeySource::JsonPointer("/id".into()))
            .with_partitioning(Partitioning::Repartition);
        let t = dedup_then_http_with(dedup, &rx.url, &dir);
        let mut d = TestDriver::new(t)
            .guarantee(g)
            .source_partitions(4)
            .auto_commit(false);
        let rec = |id: &str, key: &str, p: i32| id_rec(id).key(key).partition(p);
        d.pipe(rec("id-01", "user-a", 0)).unwrap();
        d.pipe(rec("id-03", "user-a", 0)).unwrap(); // 503: dead-lettered at the commit
        d.pipe(rec("id-03", "session-9", 2)).unwrap(); // its twin: must run the effect
        d.pipe(rec("id-03", "relay", 1)).unwrap(); // a duplicate of the twin
        d.pipe(rec("id-02", "user-b", 3)).unwrap();
        d.commit().unwrap();
        assert_eq!(
            rx.per_key()[&b"id-03".to_vec()],
            vec![503, 200],
            "{g:?}: one failed call, then the twin's"
        );
        // The dead letter names the first copy's original record (p0, offset 1).
        let dl = d.dead_letters();
        assert_eq!(dl.len(), 1, "{g:?}");
        let hdr = |n: &str| {
            dl[0]
                .headers
                .iter()
                .rev()
                .find(|(k, _)| k == n)
                .and_then(|(_, v)| v.clone())
        };
        assert_eq!(
            hdr(dlq_headers::TOPIC).as_deref(),
            Some(&b"in"[..]),
            "{g:?}"
        );
        assert_eq!(
            hdr(dlq_headers::PARTITION).as_deref(),
            Some(&b"0"[..]),
            "{g:?}"
        );
        assert_eq!(
            hdr(dlq_headers::OFFSET).as_deref(),
            Some(&b"1"[..]),
            "{g:?}"
        );
        // The mark that stands is the twin's, named by its source record (p2, offset 0),
        // in the store and changelog of the key's repartition partition, once.
        let p = partition_for(b"id-03", 4);
        let e = d.dedup_entry("dedup", p, b"id-03").unwrap().unwrap();
        assert_eq!((e.source_partition, e.source_offset), (2, 0), "{g:?}");
        let marks: Vec<bool> = d
            .changelog("dedup", p)
            .iter()
            .filter(|r| r.key == b"id-03")
            .map(|r| r.value.is_some())
            .collect();
        assert_eq!(marks, vec![true], "{g:?}");
        let c = d.counts();
        assert_eq!((c.duplicates, c.dead_lettered), (1, 1), "{g:?}");
        // Later deliveries, from any partition, are duplicates: no call.
        d.pipe(rec("id-03", "late", 3)).unwrap();
        d.commit().unwrap();
        assert_eq!(oks(&rx, "id-03"), 1, "{g:?}");
        assert_eq!(d.output("out").len(), 3, "{g:?}");
    }
}

fn id_rec(id: &str) -> TestRecord {
    TestRecord::json(format!(r#"{{"id":"{id}"}}"#)).timestamp(1000)
}
