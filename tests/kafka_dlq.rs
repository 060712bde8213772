//! Bad input on a real broker: each bad record goes to the dead-letter topic with headers
//! naming source topic, partition, offset and reason; processing goes on.

mod common;

use common::*;
use onceflow::headers::dlq_headers;
use onceflow_testkit::kafka;
use std::time::Duration;

#[test]
fn bad_records_are_dead_lettered_with_their_source_and_reason() {
    let names = gharchive_names(1);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    let inputs: [&[u8]; 6] = [
        br#"{"id":"1"}"#,
        b"\x00\xffnot json",
        br#"{"type":"PushEvent"}"#,
        br#"{"type":"PushEvent"}"#,
        br#"{"id":[1,2]}"#,
        br#"{"id":2}"#,
    ];
    for v in inputs {
        p.send(
            &names.input,
            Some(0),
            Some(b"k"),
            Some(v),
            &[("h", b"x")],
            None,
        )
        .unwrap();
    }
    p.flush().unwrap();
    let (st, out) = start(&names, &[], &[], &["--stop-at-end"]).wait(Duration::from_secs(120));
    assert!(st.success());
    assert_eq!(summary_field(&out, "dead_lettered"), Some(4.0), "{out}");

    let good =
        kafka::read_topic(&bootstrap(), &names.output, true, Duration::from_secs(60)).unwrap();
    let good: Vec<String> = good.iter().map(|r| json_id(r.value.as_deref())).collect();
    assert_eq!(
        good,
        vec!["1", "2"],
        "processing went on past the bad records"
    );

    let dl = kafka::read_topic(&bootstrap(), &names.dlq, true, Duration::from_secs(60)).unwrap();
    let got: Vec<(String, String, String, String)> = dl
        .iter()
        .map(|r| {
            (
                r.header_str(dlq_headers::TOPIC).unwrap(),
                r.header_str(dlq_headers::PARTITION).unwrap(),
                r.header_str(dlq_headers::OFFSET).unwrap(),
                r.header_str(dlq_headers::REASON).unwrap(),
            )
        })
        .collect();
    let row = |off: &str, reason: &str| {
        (
            names.input.clone(),
            "0".to_string(),
            off.to_string(),
            reason.to_string(),
        )
    };
    assert_eq!(
        got,
        vec![
            row(
                "1",
                "value is not valid JSON: expected value at line 1 column 1"
            ),
            row("2", "key field /id is missing"),
            row("3", "key field /id is missing"),
            row(
                "4",
                "key field /id is an array, expected a string or a number"
            ),
        ]
    );
    assert_eq!(
        dl[0].value.as_deref(),
        Some(&b"\x00\xffnot json"[..]),
        "the raw value, byte for byte"
    );
    assert_eq!(dl[0].key.as_deref(), Some(&b"k"[..]));
    assert_eq!(
        dl[0].header_str("h").as_deref(),
        Some("x"),
        "source headers kept"
    );
}

/// Kafka's protocol makes a header name a string, but the broker takes any bytes. A record
/// whose header name is not UTF-8 must neither stop the run (rdkafka's header iterator
/// panics on one) nor be lost: it is processed, its name decoded with replacement
/// characters, and a bad record carrying one still reaches the dead-letter topic.
#[test]
fn a_header_name_that_is_not_utf8_neither_stops_the_run_nor_loses_the_record() {
    let names = gharchive_names(1);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    let bad_name: &[u8] = b"n\xffame";
    p.send_raw_names(
        &names.input,
        Some(0),
        Some(b"k"),
        Some(br#"{"id":"1"}"#),
        &[(bad_name, b"v1"), (b"plain", b"v2")],
        None,
    )
    .unwrap();
    p.send_raw_names(
        &names.input,
        Some(0),
        Some(b"k"),
        Some(b"not json"),
        &[(bad_name, b"v3")],
        None,
    )
    .unwrap();
    p.send(
        &names.input,
        Some(0),
        None,
        Some(br#"{"id":"2"}"#),
        &[],
        None,
    )
    .unwrap();
    p.flush().unwrap();
    let (st, out) = start(&names, &[], &[], &["--stop-at-end"]).wait(Duration::from_secs(120));
    assert!(st.success(), "{out}");
    assert_eq!(summary_field(&out, "dead_lettered"), Some(1.0), "{out}");

    let good =
        kafka::read_topic(&bootstrap(), &names.output, true, Duration::from_secs(60)).unwrap();
    let ids: Vec<String> = good.iter().map(|r| json_id(r.value.as_deref())).collect();
    assert_eq!(ids, vec!["1", "2"], "no record lost");
    let headers: Vec<(&str, Option<&[u8]>)> = good[0]
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_deref()))
        .collect();
    assert_eq!(
        headers,
        vec![
            ("n\u{fffd}ame", Some(&b"v1"[..])),
            ("plain", Some(&b"v2"[..]))
        ],
        "headers kept in order, the bad name with a replacement character"
    );

    let dl = kafka::read_topic(&bootstrap(), &names.dlq, true, Duration::from_secs(60)).unwrap();
    assert_eq!(dl.len(), 1, "{dl:?}");
    assert_eq!(dl[0].value.as_deref(), Some(&b"not json"[..]));
    assert_eq!(dl[0].header_str("n\u{fffd}ame").as_deref(), Some("v3"));
}

/// An output topic whose own `max.message.bytes` is below what the producer accepts (a
/// topic-level limit, as operators set them): a record over it is refused by the broker,
/// the run stops with exit 1 ("a restart resumes from the last commit") and every restart
/// stops at the same record, so the partition never moves again (found by review 10). As
/// for the producer's own limit (README: "refused by that stage ... instead of a send
/// failure that would stop the instance at every restart"), the record over the topic's
/// limit is dead-lettered and processing goes on.
#[test]
fn a_record_over_the_output_topics_own_size_limit_is_dead_lettered_not_a_stop_at_every_restart() {
    let names = names_without_topics(
        r#"
name: topic-limit
source: { topic: "{input}", format: json }
stages:
  - dedup: { name: seen, key: kafka_key }
  - sink: { topic: "{output}" }
"#,
    );
    create_topics(&[&names.input, &names.dlq], 1);
    admin()
        .ensure_topic(
            &names.output,
            1,
            &[
                ("retention.ms", "-1"),
                ("retention.bytes", "-1"),
                ("max.message.bytes", "1000"),
            ],
        )
        .unwrap();
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    let big = format!(r#"{{"id":1,"pad":"{}"}}"#, "x".repeat(3000));
    for (k, v) in [("a", big.as_str()), ("b", r#"{"id":2}"#)] {
        p.send(
            &names.input,
            Some(0),
            Some(k.as_bytes()),
            Some(v.as_bytes()),
            &[],
            None,
        )
        .unwrap();
    }
    p.flush().unwrap();
    for attempt in 0..2 {
        let run = start(&names, &[], &[], &["--stop-at-end"]);
        let stderr = run.stderr.clone();
        let (st, out) = run.wait(Duration::from_secs(120));
        let err = stderr.lock().unwrap().clone();
        assert!(
            st.success(),
            "run {attempt} stopped at the record over the topic's limit: {out}\n{err}"
        );
    }
    let good =
        kafka::read_topic(&bootstrap(), &names.output, true, Duration::from_secs(60)).unwrap();
    let good: Vec<String> = good.iter().map(|r| json_id(r.value.as_deref())).collect();
    assert_eq!(good, vec!["2"], "processing went on past the big record");
    let dl = kafka::read_topic(&bootstrap(), &names.dlq, true, Duration::from_secs(60)).unwrap();
    assert_eq!(dl.len(), 1, "the big record is dead-lettered");
    assert_eq!(dl[0].key.as_deref(), Some(&b"a"[..]));
}
