//! Time semantics of the dedup stage through the broker-free driver: stream time, records
//! without a timestamp, far-future timestamps (DESIGN.md "The dedup stage: contract").

use onceflow::{DedupSpec, Guarantee, KeySource, TimeSource};
use onceflow::{Format, Topology, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use std::time::Duration;

const GUARANTEES: [Guarantee; 2] = [Guarantee::AtLeastOnce, Guarantee::ExactlyOnceV2];
const MIN: i64 = 60_000;
/// 2015-01-01T00:00:00Z
const T: i64 = 1_420_070_400_000;

fn topology(ttl_ms: i64, grace_ms: i64) -> Topology {
    let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
    spec.ttl_ms = ttl_ms;
    spec.grace_ms = grace_ms;
    spec.time = TimeSource::Event;
    spec.partitioning = Some(onceflow::Partitioning::Source);
    TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup("dedup", spec)
        .sink("out", "out")
        .build()
        .unwrap()
}

fn driver(g: Guarantee, ttl_ms: i64, grace_ms: i64) -> TestDriver {
    TestDriver::new(topology(ttl_ms, grace_ms)).guarantee(g)
}

fn ev(id: &str, t: i64) -> TestRecord {
    TestRecord::json(format!(r#"{{"id":"{id}","t":{t}}}"#)).timestamp(t)
}

/// A record without a timestamp (Kafka CreateTime -1, which rdkafka reads as "none").
fn untimed(id: &str) -> TestRecord {
    TestRecord::json(format!(r#"{{"id":"{id}"}}"#))
}

/// DESIGN.md: "Neither downtime nor one far-future timestamp wipes live state." README:
/// "Stream time is the second-highest record time seen, so neither downtime nor one
/// far-future timestamp expires live state". One message with a bad far-future
/// timestamp, delivered twice (the very redelivery dedup exists for), is still one
/// far-future timestamp: its duplicate must not confirm it as stream time and sweep every
/// live entry.
#[test]
fn one_far_future_message_delivered_twice_does_not_sweep_live_state() {
    for g in GUARANTEES {
        let mut d = driver(g, 10 * MIN, 60 * MIN);
        d.pipe(ev("a", T)).unwrap();
        d.pipe(ev("b", T + 1)).unwrap();
        let far = T + 365 * 24 * 60 * MIN; // a producer's clock a year ahead
        d.pipe(ev("x", far)).unwrap();
        d.pipe(ev("x", far)).unwrap(); // its redelivery: a duplicate
        d.pipe(ev("c", T + 2)).unwrap(); // a commit (and its sweep)
        assert!(
            d.dedup_entry("dedup", 0, b"a").unwrap().is_some(),
            "{g:?}: a's entry (first seen {T}, live until {}) was swept",
            T + 10 * MIN
        );
        d.pipe(ev("a", T + 3)).unwrap(); // a copy of a, 3 ms after it: a duplicate
        let c = d.counts();
        assert_eq!(
            (c.passed, c.duplicates),
            (4, 2),
            "{g:?}: a, b, x, c pass; x's and a's copies are duplicates; outputs {:?}",
            d.output_values("out")
        );
    }
}

/// DESIGN.md: "Time is the record timestamp (event time) by default" and "Neither downtime
/// nor one far-future timestamp wipes live state". Two records without a timestamp
/// (Kafka CreateTime -1) are judged at the wall clock, and that wall-clock time becomes
/// the stream time of an event-time stream: replaying last year's events, two such records
/// sweep every live entry and the next copy passes.
#[test]
fn records_without_a_timestamp_do_not_sweep_event_time_state() {
    for g in GUARANTEES {
        let mut d = driver(g, 10 * MIN, 60 * MIN);
        // The wall clock is a year past the events' time (a backfill, a replay).
        d.advance_wall_clock(Duration::from_millis((T + 365 * 24 * 60 * MIN) as u64));
        d.pipe(ev("a", T)).unwrap();
        d.pipe(ev("b", T + 1)).unwrap();
        d.pipe(untimed("n1")).unwrap();
        d.pipe(untimed("n2")).unwrap();
        d.pipe(ev("c", T + 2)).unwrap(); // a commit and its sweep
        d.pipe(ev("a", T + 3)).unwrap(); // a copy of a within its TTL
        let c = d.counts();
        assert_eq!(
            (c.passed, c.duplicates),
            (5, 1),
            "{g:?}: the copy of a (3 ms after it, TTL 10 min) passed: outputs {:?}",
            d.output_values("out")
        );
    }
}

/// DESIGN.md: "judged per key, not by stream time: ... downtime never expires state by
/// itself." A message without a timestamp, produced twice (a producer retry: both copies
/// carry CreateTime -1), whose second copy is read after the instance was down for longer
/// than the TTL, passes twice: its first-seen time was the wall clock, so downtime alone
/// expired it.
#[test]
fn downtime_does_not_expire_the_entry_of_a_record_without_a_timestamp() {
    for g in GUARANTEES {
        let mut d = driver(g, 24 * 60 * MIN, 60 * MIN);
        d.advance_wall_clock(Duration::from_millis(T as u64));
        d.pipe(untimed("m")).unwrap();
        d.crash(); // the instance goes down (nothing in flight)
        d.advance_wall_clock(Duration::from_secs(25 * 3600)); // 25 h of downtime
        d.pipe(untimed("m")).unwrap(); // the producer's retry, read after the restart
        let c = d.counts();
        assert_eq!(
            (c.passed, c.duplicates),
            (1, 1),
            "{g:?}: the second copy of one message passed after downtime: outputs {:?}",
            d.output_values("out")
        );
    }
}
