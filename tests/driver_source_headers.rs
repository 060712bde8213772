//! Source records that carry headers named like onceflow's own source coordinates
//! (`onceflow.source`, e.g. read from a topic another onceflow or a relay wrote): never
//! trusted. The router writes the coordinates of the record read, and dead letters and
//! dedup entries name that record.

use onceflow::__testkit::partition_for;
use onceflow::headers::dlq_headers;
use onceflow::{
    DedupSpec, Format, KeySource, Partitioning, TestDriver, TestRecord, Topology, TopologyBuilder,
};

fn by_id() -> Topology {
    let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
    spec.partitioning = Some(Partitioning::Repartition);
    TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup("dedup", spec)
        .sink("out", "out")
        .build()
        .unwrap()
}

fn last_header(r: &onceflow::OutRecord, name: &str) -> Option<Vec<u8>> {
    r.headers
        .iter()
        .rev()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.as_ref().map(|b| b.to_vec()))
}

/// A record without the dedup key must be dead-lettered (DESIGN: "A record with no key ...
/// goes to the dead-letter topic ... never silently merged"). When the source record happens
/// to carry a well-formed `onceflow.source` header (e.g. read from a topic another onceflow
/// app or a relay wrote), the router keeps that header and does NOT add
/// `onceflow.source.unkeyed`, so after the hop the record counts as keyed and its *Kafka key*
/// becomes the dedup key: the record passes, and a second such record is dropped as a
/// "duplicate" of an unrelated one.
#[test]
fn unkeyed_record_with_a_source_header_is_dead_lettered_not_keyed_by_its_kafka_key() {
    let mut d = TestDriver::new(by_id()).source_partitions(4);
    d.pipe(
        TestRecord::json(r#"{"x":1}"#)
            .key("k9")
            .header("onceflow.source", "elsewhere/0/7")
            .partition(1),
    )
    .unwrap();
    d.pipe(
        TestRecord::json(r#"{"x":2}"#)
            .key("k9")
            .header("onceflow.source", "elsewhere/0/8")
            .partition(2),
    )
    .unwrap();
    assert_eq!(
        d.output_values("out"),
        Vec::<String>::new(),
        "records without /id passed dedup (keyed by their Kafka key); counts: {:?}",
        d.counts()
    );
    assert_eq!(d.dead_letters().len(), 2);
}

/// The dedup entry names the record read (in/1/0), not a header it carried; that header
/// name is onceflow's, so the source's own copy does not reach the output.
#[test]
fn a_source_header_on_the_input_names_nothing() {
    let mut d = TestDriver::new(by_id()).source_partitions(4);
    d.pipe(
        TestRecord::json(r#"{"id":"e-1"}"#)
            .header("onceflow.source", "spoofed/3/999")
            .partition(1),
    )
    .unwrap();
    d.commit().unwrap();
    let p = partition_for(b"e-1", 4);
    let e = d.dedup_entry("dedup", p, b"e-1").unwrap().unwrap();
    let out = d.output("out");
    assert_eq!(out.len(), 1);
    assert_eq!((e.source_partition, e.source_offset), (1, 0));
    assert_eq!(last_header(out[0], "onceflow.source"), None);
}

/// Same collision, dead-letter side: a record failing after the hop is dead-lettered
/// naming the spoofed coordinates instead of in/1/0.
#[test]
fn dead_letter_names_the_record_read_not_a_header_it_carried() {
    let mut d = TestDriver::new(by_id()).source_partitions(4);
    d.pipe(
        TestRecord::json(r#"{"id":null}"#)
            .header("onceflow.source", "spoofed/3/999")
            .partition(1),
    )
    .unwrap();
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    let t = last_header(dl[0], dlq_headers::TOPIC);
    let p = last_header(dl[0], dlq_headers::PARTITION);
    let o = last_header(dl[0], dlq_headers::OFFSET);
    assert_eq!(
        (t.as_deref(), p.as_deref(), o.as_deref()),
        (Some(&b"in"[..]), Some(&b"1"[..]), Some(&b"0"[..]))
    );
}

/// Even without any hop: a record that happens to carry an `onceflow.source` header is
/// dead-lettered naming that header's coordinates instead of where it was read
/// (`runtime/task.rs` `dead_letter`: "headers that still name a source ... win").
/// README: dead letters carry `onceflow.dlq.source.topic/.partition/.offset` of the record.
#[test]
fn without_a_hop_dead_letter_names_where_the_record_was_read() {
    let t = onceflow::dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in }\nstages:\n  - filter: { name: f, when: 'value.n > 1' }\n  - sink: { topic: out }\n",
    )
    .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(TestRecord::json(r#"{"x":1}"#).header("onceflow.source", "other/5/42"))
        .unwrap();
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    let t = last_header(dl[0], dlq_headers::TOPIC);
    let p = last_header(dl[0], dlq_headers::PARTITION);
    let o = last_header(dl[0], dlq_headers::OFFSET);
    assert_eq!(
        (t.as_deref(), p.as_deref(), o.as_deref()),
        (Some(&b"in"[..]), Some(&b"0"[..]), Some(&b"0"[..]))
    );
}
