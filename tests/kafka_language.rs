//! The topology language on a real broker: a file with map, dedup (with a duplicate topic),
//! route and a multi-topic sink with computed key and headers runs end to end; topics the
//! stages write are created before the run; expression failures are dead-lettered.
//! Under both at_least_once and exactly_once_v2.

mod common;

use common::*;
use onceflow::headers::dlq_headers;
use onceflow_testkit::kafka;
use std::time::Duration;

const TOPOLOGY: &str = r#"
name: language-e2e
source: { topic: "{input}" }
stages:
  - map:
      name: shape
      set: { kind: value.type }
      drop: [payload]
  - dedup: { name: seen, key: { json_pointer: /id }, duplicates_to: "{dups}", partitioning: source }
  - route:
      name: split
      routes:
        - { when: 'value.kind == "push"', to: "{pushes}" }
      default: "{others}"
  - sink:
      name: all
      topics: ["{output}", "{copy}"]
      key: value.user
      headers: { kind: value.kind }
"#;

fn run(guarantee: &str) {
    let t = [
        ("{dups}", unique("dups")),
        ("{pushes}", unique("pushes")),
        ("{others}", unique("others")),
        ("{copy}", unique("copy")),
    ];
    let mut yaml = TOPOLOGY.to_string();
    for (hole, name) in &t {
        yaml = yaml.replace(hole, name);
    }
    let names = names_for(&yaml, 2);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    let inputs: [&[u8]; 6] = [
        br#"{"id":1,"type":"push","user":"ann","payload":{"x":1}}"#,
        br#"{"id":2,"type":"watch","user":"bob"}"#,
        br#"{"id":1,"type":"push","user":"ann","payload":{"x":1}}"#,
        br#"{"id":3,"user":"cy"}"#,
        br#"{"id":4,"type":"push","user":{"o":1}}"#,
        br#"{"id":5,"type":"fork","user":"dee"}"#,
    ];
    for v in inputs {
        p.send(&names.input, Some(0), Some(b"k"), Some(v), &[], None)
            .unwrap();
    }
    p.flush().unwrap();
    let (st, out) = start(
        &names,
        &[("processing.guarantee", guarantee.to_string())],
        &[],
        &["--stop-at-end"],
    )
    .wait(Duration::from_secs(120));
    assert!(st.success(), "{out}");
    let read = |topic: &str| {
        kafka::read_topic(&bootstrap(), topic, true, Duration::from_secs(60)).unwrap()
    };
    let values = |topic: &str| -> Vec<String> {
        read(topic)
            .iter()
            .map(|r| String::from_utf8(r.value.as_deref().unwrap().to_vec()).unwrap())
            .collect()
    };
    let (dups, pushes, others, copy) = (&t[0].1, &t[1].1, &t[2].1, &t[3].1);
    assert_eq!(
        values(pushes),
        [r#"{"id":1,"type":"push","user":"ann","kind":"push"}"#]
    );
    assert_eq!(
        values(others),
        [
            r#"{"id":2,"type":"watch","user":"bob","kind":"watch"}"#,
            r#"{"id":5,"type":"fork","user":"dee","kind":"fork"}"#
        ]
    );
    assert_eq!(
        values(dups),
        [r#"{"id":1,"type":"push","user":"ann","kind":"push"}"#]
    );
    for topic in [&names.output, copy] {
        let recs = read(topic);
        // Keyed by user now: spread over the partitions, so compared sorted.
        let mut got: Vec<(String, String)> = recs
            .iter()
            .map(|r| {
                (
                    String::from_utf8(r.key.as_deref().unwrap().to_vec()).unwrap(),
                    r.header_str("kind").unwrap(),
                )
            })
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                ("ann".to_string(), "push".to_string()),
                ("bob".into(), "watch".into()),
                ("dee".into(), "fork".into())
            ],
            "{topic}"
        );
    }
    let dl: Vec<(String, String)> = read(&names.dlq)
        .iter()
        .map(|r| {
            (
                r.header_str(dlq_headers::STAGE).unwrap(),
                r.header_str(dlq_headers::REASON).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        dl,
        [
            (
                "shape".to_string(),
                "set /kind: expression `value.type` failed: No such key: type".to_string()
            ),
            (
                "all".into(),
                "key: expression `value.user`: gave map, expected a string, bytes, a number or null"
                    .into()
            ),
        ]
    );
}

#[test]
fn language_topology_at_least_once() {
    run("at_least_once");
}

#[test]
fn language_topology_exactly_once_v2() {
    run("exactly_once_v2");
}
