//! The Rust builder refuses what the topology-file form of the same stage refuses, and what
//! could only misbehave at run time; its defaults are the files' defaults. Each case was
//! found by a review helper (builder accepted it; files refused it or it failed per record).

use onceflow::prelude::*;
use std::time::Duration;

/// The reasons `build` gives, joined, or `None` when it builds.
fn refused(b: TopologyBuilder) -> Option<String> {
    b.build().err().map(|e| format!("{e:?}"))
}

fn json_source() -> TopologyBuilder {
    TopologyBuilder::new("t").source("in", Format::Json)
}

#[test]
fn dedup_keys_and_limits_that_cannot_work_are_refused() {
    // An empty composite: every record had the one empty key, all but the first dropped.
    let r = refused(
        json_source()
            .dedup("d", DedupSpec::new(KeySource::Composite(vec![])))
            .sink("out", "out"),
    )
    .expect("empty composite refused");
    assert!(r.contains("a composite key needs at least one part"), "{r}");
    // Nested too.
    let nested = KeySource::Composite(vec![KeySource::KafkaKey, KeySource::Composite(vec![])]);
    assert!(refused(
        json_source()
            .dedup("d", DedupSpec::new(nested))
            .sink("out", "out")
    )
    .is_some());
    // max_keys 0 evicted every mark as it was written: no dedup at all.
    let r = refused(
        json_source()
            .dedup("d", DedupSpec::new(KeySource::KafkaKey).with_max_keys(0))
            .sink("out", "out"),
    )
    .expect("max_keys 0 refused");
    assert!(
        r.contains("max_keys") && r.contains("must be positive"),
        "{r}"
    );
    assert!(refused(
        json_source()
            .dedup("d", DedupSpec::new(KeySource::KafkaKey).with_max_keys(1))
            .sink("out", "out")
    )
    .is_none());
}

#[test]
fn stages_that_need_objects_refuse_a_string_source() {
    let string = || TopologyBuilder::new("t").source("in", Format::String);
    let r = refused(
        string()
            .map("m", MapSpec::new().rename("/a", "/b"))
            .sink("out", "out"),
    )
    .expect("map on a string source refused");
    assert!(r.contains("a map stage needs JSON objects"), "{r}");
    let mut d = DedupSpec::new(KeySource::KafkaKey);
    d.fingerprint = true;
    d.fingerprint_fields = Some(FingerprintFields::cover(["/a"]));
    let r = refused(string().dedup("d", d).sink("out", "out")).expect("fingerprint fields refused");
    assert!(
        r.contains("fingerprint fields need a source with fields"),
        "{r}"
    );
    // A map with nothing to do is refused, as in files.
    let r = refused(json_source().map("m", MapSpec::new()).sink("out", "out"))
        .expect("empty map refused");
    assert!(r.contains("needs at least one of set, rename, drop"), "{r}");
}

#[test]
fn enrich_checks_a_composite_keys_pointers() {
    let key = KeySource::Composite(vec![KeySource::JsonPointer("cid".into())]);
    let r = refused(
        json_source()
            .table(TableSpec::new("c", "customers"))
            .enrich("join", EnrichSpec::new("c", key, "/customer"))
            .sink("out", "out"),
    )
    .expect("pointer without / refused");
    assert!(
        r.contains("cid") && r.contains("must start with '/'"),
        "{r}"
    );
}

#[test]
fn a_route_topic_may_have_its_own_codec() {
    let t = json_source()
        .route(
            "r",
            RouteSpec::new().when(|_| Ok(true), "a").default_topic("b"),
        )
        .topic_format("a", Format::String)
        .build();
    assert!(t.is_ok(), "{:?}", t.err());
}

fn ledger(policy: impl FnOnce(&mut ReservationPolicy)) -> ExternalSinkSpec {
    let mut spec = ExternalSinkSpec::new(
        EffectSpec::File(FileSpec {
            path: "/tmp/onceflow-builder-checks-ledger.jsonl".into(),
            line: "{value}".into(),
        }),
        StoreSpec::None,
    )
    .with_key("{value./id}");
    policy(&mut spec.policy);
    spec
}

#[test]
fn sink_durations_past_100_years_are_refused_and_give_up_follows_the_lease() {
    // Duration::MAX ("keep forever") overflowed the store's deadline: a panic in debug, an
    // expired mark in release.
    let r =
        refused(json_source().external_sink("ledger", ledger(|p| p.completed_ttl = Duration::MAX)))
            .expect("ttl past 100 years refused");
    assert!(
        r.contains("idempotency.ttl") && r.contains("longer than 100 years"),
        "{r}"
    );
    let r = refused(json_source().external_sink("ledger", ledger(|p| p.lease = Duration::MAX)))
        .expect("lease past 100 years refused");
    assert!(r.contains("idempotency.lease"), "{r}");
    // The give-up default is lease x 2 in the builder as in files.
    let yaml = r#"
name: t
source: { topic: in, format: json }
stages:
  - file:
      name: ledger
      path: /tmp/onceflow-builder-checks-ledger.jsonl
      idempotency: { key: "{value./id}", store: none, lease: 1h }
"#;
    let from_file = onceflow::dsl::parse("t.yaml", yaml).unwrap();
    let from_builder = json_source()
        .external_sink("ledger", ledger(|p| p.lease = Duration::from_secs(3600)))
        .build()
        .unwrap();
    assert_eq!(from_file, from_builder);
    let mut p = ReservationPolicy {
        lease: Duration::from_secs(3600),
        ..ReservationPolicy::default()
    };
    assert_eq!(p.give_up(), Duration::from_secs(7200));
    p.in_flight_give_up = Some(Duration::from_secs(5));
    assert_eq!(p.give_up(), Duration::from_secs(5));
}
