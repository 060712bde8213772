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
            // The first copy's coordinates travel as headers; the timestamp is kept.
            let h = |r: &onceflow::OutRecord, n: &str| {
                r.headers
                    .iter()
                    .find(|(k, _)| k == n)
                    .and_then(|(_, v)| v.clone())
            };
            assert_eq!(
                h(out[0], headers::SOURCE_TOPIC).as_deref(),
                Some(&b"in"[..])
            );
            assert_eq!(
                h(out[0], headers::SOURCE_PARTITION).as_deref(),
                Some(&b"0"[..])
            );
            assert_eq!(
                h(out[0], headers::SOURCE_OFFSET).as_deref(),
                Some(&b"0"[..])
            );
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
    let h = |r: &onceflow::OutRecord, n: &str| {
        r.headers
            .iter()
            .rev()
            .find(|(k, _)| k == n)
            .and_then(|(_, v)| v.clone())
    };
    assert_eq!(h(dl[0], dlq_headers::TOPIC).as_deref(), Some(&b"in"[..]));
    assert_eq!(h(dl[0], dlq_headers::PARTITION).as_deref(), Some(&b"2"[..]));
    assert_eq!(h(dl[0], dlq_headers::OFFSET).as_deref(), Some(&b"0"[..]));
    assert_eq!(
        dl[0].key.as_deref(),
        Some(&b"k"[..]),
        "the Kafka key is kept"
    );
    assert_eq!(h(dl[1], dlq_headers::PARTITION).as_deref(), Some(&b"1"[..]));
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
