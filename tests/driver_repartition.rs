//! Dedup across partitions (issue 13): `partitioning: repartition` routes the stage's input
//! by the dedup key so that copies with different Kafka keys on different source partitions
//! meet on one partition; `partitioning: source` is the user's promise and, broken, lets
//! each copy pass (shown here so the promise is documented by a test).

use onceflow::__testkit::partition_for;
use onceflow::dsl;
use onceflow::headers;
use onceflow::headers::dlq_headers;
use onceflow::Guarantee;
use onceflow::KeySource;
use onceflow::{DedupSpec, Partitioning};
use onceflow::{Format, Topology, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};

const GUARANTEES: [Guarantee; 2] = [Guarantee::AtLeastOnce, Guarantee::ExactlyOnceV2];

fn by_id(partitioning: Option<Partitioning>) -> Topology {
    let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
    spec.partitioning = partitioning;
    with_dedup(spec)
}

/// Source `in`, dedup stage `dedup` with `spec`, sink to `out`.
fn with_dedup(spec: DedupSpec) -> Topology {
    TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup("dedup", spec)
        .sink("out", "out")
        .build()
        .unwrap()
}

/// The value of the last header `name` of `r` (a dead letter's `onceflow.dlq.*` headers
/// come after the original ones).
fn last_header(r: &onceflow::OutRecord, name: &str) -> Option<bytes::Bytes> {
    let (_, v) = r.headers.iter().rev().find(|(k, _)| k == name)?;
    v.clone()
}

/// `r` carries none of the hop's `onceflow.source*` headers (the task after the hop takes
/// them off).
fn assert_no_hop_headers(r: &onceflow::OutRecord) {
    assert!(
        r.headers
            .iter()
            .all(|(k, _)| !k.starts_with("onceflow.source")),
        "{:?}",
        r.headers
    );
}

/// The same id on two source partitions with two different Kafka keys.
fn pipe_copies(d: &mut TestDriver) {
    d.pipe(
        TestRecord::json(r#"{"id":"e-1","n":1}"#)
            .key("user-a")
            .partition(0)
            .timestamp(1_000),
    )
    .unwrap();
    d.pipe(
        TestRecord::json(r#"{"id":"e-1","n":1}"#)
            .key("session-9")
            .partition(3)
            .timestamp(2_000),
    )
    .unwrap();
    d.pipe(
        TestRecord::json(r#"{"id":"e-2","n":2}"#)
            .key("user-a")
            .partition(0)
            .timestamp(3_000),
    )
    .unwrap();
}

#[test]
fn repartition_passes_an_id_once_across_partitions() {
    for g in GUARANTEES {
        // The default for a JSON-pointer key is repartition; stating it is the same.
        for p in [None, Some(Partitioning::Repartition)] {
            let mut d = TestDriver::new(by_id(p)).guarantee(g).source_partitions(4);
            assert_eq!(d.repartition_topic(), Some("test-dedup-repartition"));
            pipe_copies(&mut d);
            let out = d.output("out");
            assert_eq!(out.len(), 2, "{g:?} {p:?}: {:?}", d.output_values("out"));
            // Keyed by the dedup key bytes, on the partition Kafka's partitioner gives them.
            assert_eq!(out[0].key.as_deref(), Some(&b"e-1"[..]));
            assert_eq!(out[1].key.as_deref(), Some(&b"e-2"[..]));
            // The source coordinates travel on the repartition topic only: the task after
            // the hop takes its header off, so outputs carry the source's headers alone
            // (the dedup entry names the first copy, see below); the timestamp is kept.
            out.iter().for_each(|o| assert_no_hop_headers(o));
            assert_eq!(out[0].timestamp, Some(1_000));
            let c = d.counts();
            assert_eq!(c.duplicates, 1, "{g:?}: the second copy is a duplicate");
            // The store partition holding the mark is the key's repartition partition.
            let p1 = partition_for(b"e-1", 4);
            assert!(d.dedup_entry("dedup", p1, b"e-1").unwrap().is_some());
        }
    }
}

#[test]
fn source_partitioning_lets_copies_on_two_partitions_pass() {
    for g in GUARANTEES {
        let mut d = TestDriver::new(by_id(Some(Partitioning::Source)))
            .guarantee(g)
            .source_partitions(4);
        assert_eq!(d.repartition_topic(), None);
        pipe_copies(&mut d);
        // The promise was broken (copies on partitions 0 and 3): each copy passes.
        assert_eq!(
            d.output_values("out"),
            vec![
                r#"{"id":"e-1","n":1}"#,
                r#"{"id":"e-1","n":1}"#,
                r#"{"id":"e-2","n":2}"#
            ],
            "{g:?}"
        );
    }
}

#[test]
fn kafka_key_defaults_to_source_partitioning() {
    // The partitioning in effect shows as the driver's repartition topic (none: source).
    let repartition_topic = |spec: DedupSpec| {
        TestDriver::new(with_dedup(spec))
            .repartition_topic()
            .map(str::to_string)
    };
    assert_eq!(repartition_topic(DedupSpec::new(KeySource::KafkaKey)), None);
    assert_eq!(
        repartition_topic(DedupSpec::new(KeySource::Header("msg-id".into()))).as_deref(),
        Some("test-dedup-repartition")
    );
    let spec = DedupSpec::new(KeySource::ValueHash).with_partitioning(Partitioning::Source);
    assert_eq!(repartition_topic(spec), None);
}

#[test]
fn a_record_without_key_is_dead_lettered_naming_its_source() {
    let mut d = TestDriver::new(by_id(None)).source_partitions(4);
    d.pipe(TestRecord::json(r#"{"x":1}"#).key("k").partition(2))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"x":2}"#).partition(1)).unwrap();
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 2);
    let h = last_header;
    assert_eq!(h(dl[0], dlq_headers::TOPIC).as_deref(), Some(&b"in"[..]));
    assert_eq!(h(dl[0], dlq_headers::PARTITION).as_deref(), Some(&b"2"[..]));
    assert_eq!(h(dl[0], dlq_headers::OFFSET).as_deref(), Some(&b"0"[..]));
    assert_eq!(
        dl[0].key.as_deref(),
        Some(&b"k"[..]),
        "the Kafka key is kept"
    );
    assert_eq!(h(dl[1], dlq_headers::PARTITION).as_deref(), Some(&b"1"[..]));
    // Not JSON, with a Kafka key: the router cannot read the key, so the record travels
    // marked unkeyed, and the task after the hop reads (and refuses) its value instead of
    // taking the Kafka key as the dedup key.
    d.pipe(TestRecord::json("{not json").key("k").partition(3))
        .unwrap();
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 3);
    assert_eq!(
        h(dl[2], dlq_headers::STAGE).as_deref(),
        Some(&b"source"[..])
    );
    assert_eq!(h(dl[2], dlq_headers::PARTITION).as_deref(), Some(&b"3"[..]));
    dl.iter().for_each(|r| assert_no_hop_headers(r));
    assert!(d.output("out").is_empty(), "{:?}", d.output_values("out"));
    let reasons: Vec<_> = dl
        .iter()
        .map(|r| String::from_utf8(h(r, dlq_headers::REASON).unwrap().to_vec()).unwrap())
        .collect();
    assert_eq!(reasons[0], "key field /id is missing", "{reasons:?}");
    assert!(
        reasons[2].starts_with("value is not valid JSON"),
        "{reasons:?}"
    );
}

#[test]
fn crash_and_restart_after_repartition_emit_once() {
    for point in onceflow::failpoints::commit_failpoints(Guarantee::ExactlyOnceV2) {
        let mut d = TestDriver::new(by_id(None))
            .guarantee(Guarantee::ExactlyOnceV2)
            .source_partitions(2);
        d.crash_at(point).unwrap();
        pipe_copies(&mut d);
        d.restart().unwrap();
        pipe_copies(&mut d);
        assert_eq!(
            d.output_values("out"),
            vec![r#"{"id":"e-1","n":1}"#, r#"{"id":"e-2","n":2}"#],
            "crash at {point}"
        );
    }
}

#[test]
fn topology_files_state_partitioning_and_describe_shows_it() {
    let t = dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in, format: json }\nstages:\n  - dedup: { key: { json_pointer: /id }, partitioning: source }\n  - sink: { topic: out }\n",
    )
    .unwrap();
    let text = t.describe();
    assert!(text.contains("partitioning=source (stated"), "{text}");
    assert!(!text.contains("Repartition:"), "{text}");
    let t = dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in, format: json }\nstages:\n  - dedup: { key: { json_pointer: /id } }\n  - sink: { topic: out }\n",
    )
    .unwrap();
    let text = t.describe_as(onceflow::DescribeFormat::Text, "app");
    assert!(text.contains("partitioning=repartition (default"), "{text}");
    assert!(
        text.contains("Repartition: topic app-dedup-repartition keyed by json pointer /id"),
        "{text}"
    );
    let err = dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in, format: json }\nstages:\n  - dedup: { key: { json_pointer: /id }, partitioning: sideways }\n  - sink: { topic: out }\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("partitioning"), "{err}");
}

/// Behind a hop, a dedup entry and the duplicate topic's headers name the first
/// occurrence by its original source partition and offset (its `onceflow.source.*`
/// headers), not by its coordinates on the repartition topic.
#[test]
fn dedup_entries_name_the_original_source_record() {
    use onceflow::headers::{DUPLICATE_OF_OFFSET, DUPLICATE_OF_PARTITION};
    for g in GUARANTEES {
        let mut spec =
            DedupSpec::new(KeySource::JsonPointer("/id".into())).with_duplicates_to("dups");
        spec.partitioning = Some(Partitioning::Repartition);
        let mut d = TestDriver::new(with_dedup(spec))
            .guarantee(g)
            .source_partitions(4);
        let p1 = partition_for(b"e-1", 4);
        // The first copy sits at offset 2 of a source partition other than p1, behind two
        // records routed elsewhere: on the repartition topic it is at offset 0 of p1.
        let source_p = (p1 + 1) % 4;
        let fillers: Vec<String> = (0..)
            .map(|i| format!("f-{i}"))
            .filter(|id| partition_for(id.as_bytes(), 4) != p1)
            .take(2)
            .collect();
        for id in &fillers {
            d.pipe(TestRecord::json(format!(r#"{{"id":"{id}"}}"#)).partition(source_p))
                .unwrap();
        }
        d.pipe(
            TestRecord::json(r#"{"id":"e-1"}"#)
                .key("user-a")
                .partition(source_p),
        )
        .unwrap();
        d.pipe(
            TestRecord::json(r#"{"id":"e-1"}"#)
                .key("session-9")
                .partition((p1 + 2) % 4),
        )
        .unwrap();
        d.commit().unwrap();
        let e = d.dedup_entry("dedup", p1, b"e-1").unwrap().unwrap();
        assert_eq!(
            (e.source_partition, e.source_offset),
            (source_p, 2),
            "{g:?}: the entry names the original record"
        );
        let dups = d.output("dups");
        assert_eq!(dups.len(), 1, "{g:?}");
        let h = |n: &str| {
            dups[0]
                .headers
                .iter()
                .find(|(k, _)| k == n)
                .and_then(|(_, v)| v.clone())
        };
        assert_eq!(
            h(DUPLICATE_OF_PARTITION).as_deref(),
            Some(source_p.to_string().as_bytes()),
            "{g:?}"
        );
        assert_eq!(h(DUPLICATE_OF_OFFSET).as_deref(), Some(&b"2"[..]), "{g:?}");
    }
}

/// `filter → map → dedup(repartition) → sink`: the filter and the map run on the source
/// partitions before the hop (issue 13), the dedup on the repartition topic's partitions.
const PREFIXED: &str = r#"
name: t
source: { topic: in, format: json }
stages:
  - filter: { name: keep, when: 'value.kind != "skip"' }
  - map: { name: rename, rename: { id: uid }, set: { twice: 'value.n * 2' } }
  - dedup: { name: dedup, key: { json_pointer: /uid } }
  - sink: { topic: out }
"#;

fn prefixed(g: Guarantee) -> TestDriver {
    let t = dsl::parse("t.yaml", PREFIXED).unwrap_or_else(|e| panic!("{e}"));
    TestDriver::new(t).guarantee(g).source_partitions(4)
}

/// An id on two source partitions with two Kafka keys passes once behind a stateless
/// prefix; the dedup key is read from the map's result (`/uid`, the renamed `/id`); a
/// record the filter drops is neither routed (no mark on its key's partition) nor emitted.
#[test]
fn a_stateless_prefix_runs_before_the_hop() {
    for g in GUARANTEES {
        let mut d = prefixed(g);
        assert_eq!(d.repartition_topic(), Some("test-dedup-repartition"));
        for (v, key, p) in [
            (r#"{"id":"e-1","kind":"push","n":1}"#, "user-a", 0),
            (r#"{"id":"e-1","kind":"push","n":1}"#, "session-9", 3),
            (r#"{"id":"e-2","kind":"skip","n":2}"#, "user-a", 1),
            (r#"{"id":"e-3","kind":"push","n":3}"#, "user-b", 2),
        ] {
            d.pipe(TestRecord::json(v).key(key).partition(p).timestamp(1_000))
                .unwrap();
        }
        assert_eq!(
            d.output_values("out"),
            [
                r#"{"kind":"push","n":1,"uid":"e-1","twice":2}"#,
                r#"{"kind":"push","n":3,"uid":"e-3","twice":6}"#
            ],
            "{g:?}"
        );
        let out = d.output("out");
        assert_eq!(out[0].key.as_deref(), Some(&b"e-1"[..]), "keyed by /uid");
        assert!(d.dead_letters().is_empty(), "{g:?}: /uid is there");
        let c = d.counts();
        assert_eq!((c.passed, c.duplicates), (2, 1), "{g:?}");
        assert_eq!(c.records_in, 4, "{g:?}: every source record counted once");
        // The filtered record never reached the dedup stage.
        let p2 = partition_for(b"e-2", 4);
        assert!(d.dedup_entry("dedup", p2, b"e-2").unwrap().is_none());
        let p1 = partition_for(b"e-1", 4);
        assert!(d.dedup_entry("dedup", p1, b"e-1").unwrap().is_some());
    }
}

/// A record the map (before the hop) refuses goes to the dead-letter topic from the
/// router: named by its source topic, partition and offset and the map stage, with its
/// key, value and headers as read; nothing is routed for it.
#[test]
fn a_record_a_stage_before_the_hop_refuses_is_dead_lettered_at_its_source() {
    for g in GUARANTEES {
        let mut d = prefixed(g);
        d.pipe(TestRecord::json(r#"{"id":"e-1","kind":"push","n":1}"#).partition(2))
            .unwrap();
        d.pipe(
            TestRecord::json(r#"{"id":"e-9","kind":"push","n":"x"}"#)
                .key("k-9")
                .header("trace", "t-1")
                .partition(2)
                .timestamp(7),
        )
        .unwrap();
        assert_eq!(d.output("out").len(), 1, "{g:?}");
        let dl = d.dead_letters();
        assert_eq!(dl.len(), 1, "{g:?}");
        let h = |n: &str| last_header(dl[0], n);
        assert_eq!(h(dlq_headers::TOPIC).as_deref(), Some(&b"in"[..]));
        assert_eq!(h(dlq_headers::PARTITION).as_deref(), Some(&b"2"[..]));
        assert_eq!(h(dlq_headers::OFFSET).as_deref(), Some(&b"1"[..]));
        assert_eq!(h(dlq_headers::STAGE).as_deref(), Some(&b"rename"[..]));
        assert_eq!(
            h("trace").as_deref(),
            Some(&b"t-1"[..]),
            "source headers kept"
        );
        assert_eq!(
            h(headers::SOURCE),
            None,
            "a dead letter from the router was never routed"
        );
        assert_eq!(dl[0].key.as_deref(), Some(&b"k-9"[..]));
        assert_eq!(
            dl[0].value.as_deref(),
            Some(&br#"{"id":"e-9","kind":"push","n":"x"}"#[..]),
            "the value as read"
        );
        assert_eq!(dl[0].timestamp, Some(7));
        assert_eq!(d.counts().dead_lettered, 1, "{g:?}");
        let p9 = partition_for(b"e-9", 4);
        assert!(d.dedup_entry("dedup", p9, b"e-9").unwrap().is_none());
    }
}

/// Only filter and map may come before a repartitioning dedup: a stage with state or
/// effects there is refused by the driver, naming both stages and why.
#[test]
fn a_stateful_stage_before_the_hop_is_refused() {
    // In a file: refused when the file is read, at the refused dedup's line and column.
    let err = dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in, format: json }\nstages:\n  - dedup: { name: first, key: kafka_key }\n  - dedup: { name: by-id, key: { json_pointer: /id } }\n  - sink: { topic: out }\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.starts_with("t.yaml:5:"), "{err}");
    assert!(err.contains("\"by-id\""), "{err}");
    assert!(err.contains("\"first\" (dedup)"), "{err}");
    assert!(err.contains("only filter and map"), "{err}");
    // With the builder: refused by `build`, naming the stage and the field.
    let errs = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup("first", DedupSpec::new(KeySource::KafkaKey))
        .dedup(
            "by-id",
            DedupSpec::new(KeySource::JsonPointer("/id".into())),
        )
        .sink("out", "out")
        .build()
        .unwrap_err();
    let text = errs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(errs.len(), 1, "{text}");
    assert!(
        text.contains("by-id") && text.contains("partitioning"),
        "{text}"
    );
}

/// `describe` prints the hop between the stateless prefix and the dedup.
#[test]
fn describe_shows_the_hop_after_the_prefix() {
    let t = dsl::parse("t.yaml", PREFIXED).unwrap();
    let text = t.describe_as(onceflow::DescribeFormat::Text, "app");
    let lines: Vec<&str> = text.lines().collect();
    let at = |p: &str| lines.iter().position(|l| l.trim_start().starts_with(p));
    let (map, hop, dedup) = (
        at("Map: rename").unwrap(),
        at("Repartition: topic app-dedup-repartition").unwrap(),
        at("Dedup: dedup").unwrap(),
    );
    assert!(map < hop && hop < dedup, "{text}");
}

/// A map before the hop re-encodes the value, and numbers beyond 64 bits come out of it as
/// floats (`1e+20`), their digits lost. Such an id is refused with a dead letter naming the
/// dedup stage, as without the hop: routed by the float's text, two different ids
/// (2^64 and 2^64 + 1) became one key and the second was dropped. An id the map keeps
/// exactly (a fraction, a 64-bit integer) meets its copies on one partition and passes once.
#[test]
fn behind_a_map_number_ids_are_refused_or_meet_as_without_the_hop() {
    const MAPPED: &str = r#"
name: t
source: { topic: in, format: json }
stages:
  - map:
      name: tag
      set: { seen: 'true' }
  - dedup:
      name: dedup
      key: { json_pointer: /id }
      ttl: 1h
      partitioning: PART
  - sink:
      name: out
      topic: out
"#;
    let refused = [
        "18446744073709551616",
        "18446744073709551617",
        "1e20",
        "100000000000000000000.0",
        "-9223372036854775809",
        "1.5e300",
    ];
    let kept = ["0.5", "9223372036854775807"];
    for part in ["source", "repartition"] {
        for g in GUARANTEES {
            let t = dsl::parse("t.yaml", &MAPPED.replace("PART", part))
                .unwrap_or_else(|e| panic!("{e}"));
            let mut d = TestDriver::new(t).guarantee(g).source_partitions(4);
            // Copies with different Kafka keys on different partitions ("source" sees
            // each copy on its own partition, so it is given one partition).
            let copies = if part == "source" { 1 } else { 3 };
            for (i, id) in refused.iter().chain(&kept).enumerate() {
                for copy in 0..copies {
                    d.pipe(
                        TestRecord::json(format!(r#"{{"id":{id}}}"#))
                            .key(format!("random-{i}-{copy}"))
                            .partition(copy as i32)
                            .timestamp(1_000),
                    )
                    .unwrap();
                }
            }
            let c = d.counts();
            let what = format!("{part} {g:?}: {c:?}");
            assert_eq!(c.passed, kept.len() as u64, "{what}");
            assert_eq!(c.duplicates, (kept.len() * (copies - 1)) as u64, "{what}");
            assert_eq!(c.dead_lettered, (refused.len() * copies) as u64, "{what}");
            for r in d.dead_letters() {
                let stage = r
                    .headers
                    .iter()
                    .find(|(k, _)| k == onceflow::headers::dlq_headers::STAGE)
                    .and_then(|(_, v)| v.clone());
                assert_eq!(stage.as_deref(), Some(&b"dedup"[..]), "{what}");
            }
        }
    }
}

/// Behind the hop the stages see the source record's coordinates, not the repartition
/// topic's: CEL's `topic`, `partition` and `offset` (here in a filter and in sink headers)
/// name the record as the router read it, and the hop's own header is gone.
#[test]
fn stages_after_the_hop_see_the_source_coordinates() {
    let t = dsl::parse(
        "t.yaml",
        r#"name: t
source: { topic: in, format: json }
stages:
  - dedup: { key: { json_pointer: /id } }
  - filter: { name: second, when: 'offset == 1 && partition == 2 && topic == "in"' }
  - sink: { topic: out, headers: { at: 'topic + "/" + string(partition) + "/" + string(offset)' } }
"#,
    )
    .unwrap();
    for g in GUARANTEES {
        let mut d = TestDriver::new(t.clone()).guarantee(g).source_partitions(4);
        for (p, id) in [(2, "a"), (2, "b"), (1, "c")] {
            d.pipe(TestRecord::json(format!(r#"{{"id":"{id}"}}"#)).partition(p))
                .unwrap();
        }
        let out = d.output("out");
        assert_eq!(out.len(), 1, "{g:?}: only in/2/1 passes the filter");
        assert_eq!(out[0].value.as_deref(), Some(&br#"{"id":"b"}"#[..]));
        assert_eq!(last_header(out[0], "at").as_deref(), Some(&b"in/2/1"[..]));
        assert_eq!(last_header(out[0], headers::SOURCE), None, "{g:?}");
    }
}

// Source records that carry headers named like onceflow's own source coordinates
// (`onceflow.source`, e.g. read from a topic another onceflow or a relay wrote): never
// trusted. The router writes the coordinates of the record read, and dead letters and
// dedup entries name that record.

/// The topic, partition and offset dead letter `r` names.
fn dlq_source(r: &onceflow::OutRecord) -> (String, String, String) {
    let h = |n| String::from_utf8_lossy(&last_header(r, n).unwrap_or_default()).into_owned();
    (
        h(dlq_headers::TOPIC),
        h(dlq_headers::PARTITION),
        h(dlq_headers::OFFSET),
    )
}

/// A record without the dedup key is dead-lettered, never keyed by its Kafka key, also when
/// it carries a well-formed `onceflow.source` header (which made the router leave out
/// `onceflow.source.unkeyed`: such records passed, the second as a "duplicate").
#[test]
fn an_unkeyed_record_carrying_a_source_header_is_dead_lettered() {
    let mut d = TestDriver::new(by_id(Some(Partitioning::Repartition))).source_partitions(4);
    for (n, p) in [(7, 1), (8, 2)] {
        d.pipe(
            TestRecord::json(format!(r#"{{"x":{n}}}"#))
                .key("k9")
                .header("onceflow.source", format!("elsewhere/0/{n}"))
                .partition(p),
        )
        .unwrap();
    }
    assert_eq!(
        d.output_values("out"),
        Vec::<String>::new(),
        "{:?}",
        d.counts()
    );
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 2);
    assert_eq!(dlq_source(dl[0]), ("in".into(), "1".into(), "0".into()));
}

/// The dedup entry and a dead letter after the hop name the record read (in/1/0), not a
/// header it carried; that header name is onceflow's, so it does not reach the output.
#[test]
fn a_source_header_on_the_input_names_nothing() {
    let mut d = TestDriver::new(by_id(Some(Partitioning::Repartition))).source_partitions(4);
    let spoofed = |v: &str| {
        TestRecord::json(v)
            .header("onceflow.source", "spoofed/3/999")
            .partition(1)
    };
    d.pipe(spoofed(r#"{"id":"e-1"}"#)).unwrap();
    d.pipe(spoofed(r#"{"id":null}"#)).unwrap();
    d.commit().unwrap();
    let e = d
        .dedup_entry("dedup", partition_for(b"e-1", 4), b"e-1")
        .unwrap()
        .unwrap();
    assert_eq!((e.source_partition, e.source_offset), (1, 0));
    let out = d.output("out");
    assert_eq!(out.len(), 1);
    assert_eq!(last_header(out[0], "onceflow.source"), None);
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    assert_eq!(dlq_source(dl[0]), ("in".into(), "1".into(), "1".into()));
}

/// Without a hop too: a dead letter names where the record was read, not an
/// `onceflow.source` header it carried.
#[test]
fn without_a_hop_a_dead_letter_names_where_the_record_was_read() {
    let t = dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in }\nstages:\n  - filter: { name: f, when: 'value.n > 1' }\n  - sink: { topic: out }\n",
    )
    .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(TestRecord::json(r#"{"x":1}"#).header("onceflow.source", "other/5/42"))
        .unwrap();
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    assert_eq!(dlq_source(dl[0]), ("in".into(), "0".into(), "0".into()));
}
