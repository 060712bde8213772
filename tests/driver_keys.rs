//! Issue 11, items 3, 6 and 7, through the broker-free test driver: numeric JSON keys keep
//! their exact text (both when the value is only scanned and when an earlier stage made a
//! view of it); `store: none` reports its effects `unprotected`; fingerprints over chosen
//! JSON fields, with conflicts sent to the duplicate topic.

mod sink_support;

use onceflow::dsl;
use onceflow::headers::OUTCOME_HEADER;
use onceflow::{TestDriver, TestRecord};
use sink_support::Receiver;

fn driver(yaml: &str) -> TestDriver {
    TestDriver::new(dsl::parse("t.yaml", yaml).unwrap_or_else(|e| panic!("{e}")))
}

fn header(r: &onceflow::OutRecord, name: &str) -> Option<String> {
    r.headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.as_deref())
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The ids of item 3: around 2^53, 2^63, 2^64 (and below -2^63), decimals, and the string
/// "1" next to the numbers 1 and 1.0. Each is written as its JSON text.
const IDS: &[&str] = &[
    "9007199254740992",     // 2^53
    "9007199254740993",     // 2^53 + 1: no longer exact as an f64
    "9223372036854775807",  // 2^63 - 1
    "9223372036854775808",  // 2^63
    "18446744073709551615", // 2^64 - 1
    "18446744073709551616", // 2^64
    "18446744073709551617", // 2^64 + 1: the same f64 as 2^64
    "-9223372036854775809", // below i64
    "-9223372036854775810", // the same f64 as the one above
    "0.1",
    "0.10000000000000001", // the same f64 as 0.1
    "1",
    "1.0",
    "1.00",
    "1e0",
    "\"1\"", // the string "1": the same key as the number 1
];

/// Pipe every id twice (all firsts, then all again) and return, per id, the dedup key the
/// store holds (its exact text) and the ids that passed.
fn exact_keys(yaml: &str) -> (Vec<String>, Vec<usize>) {
    let mut d = driver(yaml);
    for round in 0..2 {
        for (n, id) in IDS.iter().enumerate() {
            d.pipe(TestRecord::json(format!(
                r#"{{"id":{id},"n":{n},"r":{round}}}"#
            )))
            .unwrap();
        }
    }
    let passed: Vec<usize> = d
        .output_values("out")
        .iter()
        .map(|v| {
            let v: serde_json::Value = serde_json::from_str(v).unwrap();
            v["n"].as_u64().unwrap() as usize
        })
        .collect();
    let mut stored = Vec::new();
    for id in IDS {
        let text = id.trim_matches('"');
        if d.dedup_entry("dedup", 0, text.as_bytes())
            .unwrap()
            .is_some()
        {
            stored.push(text.to_string());
        }
    }
    (stored, passed)
}

fn expected_keys() -> (Vec<String>, Vec<usize>) {
    let stored = IDS
        .iter()
        .map(|s| s.trim_matches('"').to_string())
        .collect();
    // Every id but the string "1" (the last) is its own key: all pass once.
    let passed = (0..IDS.len() - 1).collect();
    (stored, passed)
}

#[test]
fn numeric_keys_keep_their_exact_text_when_scanned() {
    let got = exact_keys(
        r#"
name: t
source: { topic: in, format: json }
stages:
  - dedup: { name: dedup, key: { json_pointer: /id } }
  - sink: { topic: out }
"#,
    );
    assert_eq!(got, expected_keys());
}

/// A dedup on `key` (YAML) of a `format` source, co-partitioned, then a sink.
fn dedup_on(format: &str, key: &str) -> TestDriver {
    driver(&format!(
        "name: t\nsource: {{ topic: in, format: {format} }}\nstages:\n  - dedup: {{ key: {key}, partitioning: source }}\n  - sink: {{ topic: out }}\n"
    ))
}

/// A number beyond f64's range at the key's pointer is a key by its text, as any other
/// number (serde refuses to parse it; the JSON grammar has no limit).
#[test]
fn numbers_beyond_f64_are_keys_by_their_text() {
    let mut d = dedup_on("json", "{ json_pointer: /id }");
    let big = "9".repeat(400);
    for id in ["1e400", "1E400", big.as_str(), "1e400"] {
        d.pipe(TestRecord::json(format!(r#"{{"id":{id},"s":"x"}}"#)))
            .unwrap();
    }
    let c = d.counts();
    assert_eq!((c.passed, c.duplicates, c.dead_lettered), (3, 1, 0));
}

/// `value_hash`: a null value (a tombstone) has no key and is dead-lettered; tombstones of
/// two Kafka keys are not one key. An empty value is a value.
#[test]
fn value_hash_dead_letters_a_null_value_and_keys_an_empty_one() {
    let mut d = dedup_on("bytes", "value_hash");
    d.pipe(TestRecord::null_value().key("customer-1")).unwrap();
    d.pipe(TestRecord::null_value().key("customer-2")).unwrap();
    d.pipe(TestRecord::json("").key("customer-3")).unwrap();
    d.pipe(TestRecord::json("").key("customer-4")).unwrap();
    let c = d.counts();
    assert_eq!((c.passed, c.duplicates, c.dead_lettered), (1, 1, 2));
    let reasons: Vec<String> = d
        .dead_letters()
        .iter()
        .filter_map(|r| header(r, onceflow::headers::dlq_headers::REASON))
        .collect();
    assert!(
        reasons.iter().all(|r| r.contains("the value is null")),
        "{reasons:?}"
    );
}

/// A `map` stage rewrites the value through `serde_json::Value`, where a number that is not
/// a 64-bit integer is an `f64`: the digits of 2^64 + 1 are gone before the dedup stage sees
/// it. Such a key is refused (dead letter with the reason), never merged with 2^64; numbers
/// within 64-bit integers stay exact; a fraction is keyed as the map wrote it.
#[test]
fn after_a_map_integers_beyond_64_bits_are_refused_not_merged() {
    let ids = [
        "9007199254740993",
        "18446744073709551615",
        "-9223372036854775808",
        "1",
        "\"1\"",
        "0.5",
        "18446744073709551616",
        "18446744073709551617",
        "-9223372036854775809",
    ];
    let mut d = driver(
        r#"
name: t
source: { topic: in, format: json }
stages:
  - map: { set: { seen: 'true' } }
  - dedup: { name: dedup, key: { json_pointer: /id }, partitioning: source }
  - sink: { topic: out }
"#,
    );
    for _ in 0..2 {
        for (n, id) in ids.iter().enumerate() {
            d.pipe(TestRecord::json(format!(r#"{{"id":{id},"n":{n}}}"#)))
                .unwrap();
        }
    }
    let passed: Vec<u64> = d
        .output_values("out")
        .iter()
        .map(|v| {
            serde_json::from_str::<serde_json::Value>(v).unwrap()["n"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(passed, vec![0, 1, 2, 3, 5]);
    for k in [
        "9007199254740993",
        "18446744073709551615",
        "-9223372036854775808",
        "1",
        "0.5",
    ] {
        assert!(
            d.dedup_entry("dedup", 0, k.as_bytes()).unwrap().is_some(),
            "{k}"
        );
    }
    let reasons: Vec<String> = d
        .dead_letters()
        .iter()
        .map(|r| header(r, onceflow::headers::dlq_headers::REASON).unwrap())
        .collect();
    assert_eq!(reasons.len(), 6, "{reasons:?}");
    assert!(
        reasons.iter().all(|r| r == "key field /id is an integer beyond 64 bits, whose exact digits an earlier stage lost when it rewrote the value; dedup before that stage, or send the id as a string"),
        "{reasons:?}"
    );
}

/// Item 6: an external sink with `store: none` runs its effects without protection and
/// reports them so: outcome header `unprotected`, counted as unprotected, never `done`.
#[test]
fn store_none_reports_effects_unprotected() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let rx = Receiver::ok();
    let yaml = format!(
        r#"
name: t
source: {{ topic: in, format: json }}
stages:
  - http: {{ name: hook, url: "{}", idempotency: {{ key: "{{value./id}}", store: none }} }}
  - sink: {{ topic: out }}
"#,
        rx.url
    );
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let d = metrics::with_local_recorder(&recorder, || {
        let mut d = driver(&yaml);
        d.pipe(TestRecord::json(r#"{"id":"a"}"#)).unwrap();
        d.pipe(TestRecord::json(r#"{"id":"a"}"#)).unwrap(); // no store: runs again
        d.commit().unwrap();
        d
    });
    assert_eq!(rx.calls().len(), 2);
    let outcomes: Vec<Option<String>> = d
        .output("out")
        .iter()
        .map(|r| header(r, OUTCOME_HEADER))
        .collect();
    assert_eq!(
        outcomes,
        vec![Some("unprotected".into()), Some("unprotected".into())]
    );
    let c = d.counts();
    assert_eq!((c.effects_done, c.effects_unprotected), (0, 2), "{c:?}");
    let mut counted = std::collections::BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if let (DebugValue::Counter(n @ 1..), "onceflow_sink_effects_total") =
            (value, key.key().name())
        {
            let result = key.key().labels().find(|l| l.key() == "result").unwrap();
            *counted.entry(result.value().to_string()).or_insert(0) += n;
        }
    }
    assert_eq!(
        counted,
        [("unprotected".to_string(), 2u64)].into_iter().collect(),
        "onceflow_sink_effects_total by result"
    );
}

/// A GH Archive push event: `email` is the author's address (obfuscated in later
/// re-downloads), `message` the commit message.
fn push(id: &str, email: &str, message: &str) -> String {
    format!(
        r#"{{"id":"{id}","type":"PushEvent","payload":{{"size":2,"commits":[{{"sha":"a1","author":{{"email":"{email}","name":"Ann"}},"message":"{message}"}},{{"sha":"b2","author":{{"email":"{email}","name":"Ann"}},"message":"fix"}}]}}}}"#
    )
}

/// The same event re-serialized: other member order and whitespace.
fn push_reserialized(id: &str, email: &str, message: &str) -> String {
    format!(
        r#"{{ "type": "PushEvent", "payload": {{ "commits": [ {{ "message": "{message}", "author": {{ "name": "Ann", "email": "{email}" }}, "sha": "a1" }}, {{ "author": {{ "name": "Ann", "email": "{email}" }}, "sha": "b2", "message": "fix" }} ], "size": 2 }}, "id": "{id}" }}"#
    )
}

fn fingerprint_driver(fingerprint: &str) -> TestDriver {
    driver(&format!(
        r#"
name: t
source: {{ topic: in, format: json }}
stages:
  - dedup:
      name: dedup
      key: {{ json_pointer: /id }}
      fingerprint: {fingerprint}
      on_conflict: duplicates_to
      duplicates_to: dups
  - sink: {{ topic: out }}
"#
    ))
}

/// Pipe the first event and then `repeats`; return the `onceflow.duplicate.kind` header of
/// each record on the duplicate topic, and (duplicates, conflicts).
fn judge(d: &mut TestDriver, repeats: &[String]) -> (Vec<String>, (u64, u64)) {
    d.pipe(TestRecord::json(push("e1", "ann@example.com", "add")))
        .unwrap();
    for r in repeats {
        d.pipe(TestRecord::json(r.clone())).unwrap();
    }
    assert_eq!(d.output("out").len(), 1, "only the first occurrence passes");
    let kinds = d
        .output("dups")
        .iter()
        .map(|r| header(r, "onceflow.duplicate.kind").unwrap_or_default())
        .collect();
    let c = d.counts();
    (kinds, (c.duplicates, c.conflicts))
}

#[test]
fn fingerprint_ignoring_a_field_counts_a_redacted_copy_as_a_duplicate() {
    let mut d = fingerprint_driver("{ ignore: [/payload/commits/*/author/email] }");
    let got = judge(
        &mut d,
        &[
            push("e1", "ann@example.com", "add"),        // identical
            push("e1", "0f1e2d@users.noreply", "add"),   // only the ignored field differs
            push_reserialized("e1", "x@y", "add"),       // re-serialized and redacted
            push("e1", "ann@example.com", "add tests"),  // a covered field differs
            push_reserialized("e1", "x@y", "add tests"), // both
        ],
    );
    assert_eq!(
        got,
        (
            vec![
                "duplicate".to_string(),
                "duplicate".into(),
                "duplicate".into(),
                "conflict".into(),
                "conflict".into()
            ],
            (3, 2)
        )
    );
}

#[test]
fn fingerprint_covering_fields_ignores_the_rest() {
    let mut d = fingerprint_driver("{ cover: [/type, /payload/commits/*/message] }");
    let got = judge(
        &mut d,
        &[
            push("e1", "0f1e2d@users.noreply", "add"), // not covered: duplicate
            push_reserialized("e1", "x@y", "add"),     // re-serialized: duplicate
            push("e1", "ann@example.com", "add tests"), // covered field differs: conflict
        ],
    );
    assert_eq!(
        got,
        (
            vec![
                "duplicate".to_string(),
                "duplicate".into(),
                "conflict".into()
            ],
            (2, 1)
        )
    );
}

/// Without a fingerprint on fields, `fingerprint: true` still hashes the value bytes: a
/// re-serialized copy is a conflict (the documented difference).
#[test]
fn fingerprint_true_hashes_the_bytes_as_read() {
    let mut d = fingerprint_driver("true");
    let got = judge(&mut d, &[push_reserialized("e1", "ann@example.com", "add")]);
    assert_eq!(got, (vec!["conflict".to_string()], (0, 1)));
}

#[test]
fn fingerprint_fields_are_validated_with_their_place() {
    let bad = |fingerprint: &str, on_conflict: &str, dups: &str| {
        let yaml = format!(
            "name: t\nsource: {{ topic: in, format: json }}\nstages:\n  - dedup:\n      key: {{ json_pointer: /id }}\n      fingerprint: {fingerprint}\n      on_conflict: {on_conflict}\n{dups}  - sink: {{ topic: out }}\n"
        );
        match dsl::parse("t.yaml", &yaml) {
            Ok(_) => panic!("{fingerprint} / {on_conflict} should be refused"),
            Err(e) => e.to_string(),
        }
    };
    assert_eq!(
        bad("{ ignore: [payload/email] }", "drop", ""),
        "t.yaml:6:20: stage `dedup` (dedup), field `fingerprint`: ignore: \"payload/email\" is not a JSON pointer (it must be empty or start with '/')"
    );
    assert_eq!(
        bad("{ cover: [] }", "drop", ""),
        "t.yaml:6:20: stage `dedup` (dedup), field `fingerprint`: give at least one JSON pointer to cover or to ignore"
    );
    assert_eq!(
        bad("{ covers: [/a] }", "drop", ""),
        "t.yaml:6:20: stage `dedup` (dedup), field `fingerprint`: unknown field `covers`, expected cover or ignore"
    );
    assert_eq!(
        bad("true", "duplicates_to", ""),
        "t.yaml:7:20: stage `dedup` (dedup), field `on_conflict`: duplicates_to needs a duplicates_to topic"
    );
    // Accepted, and shown by describe.
    let t = dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in, format: json }\nstages:\n  - dedup:\n      key: { json_pointer: /id }\n      fingerprint: { ignore: [/payload/commits/*/author/email] }\n      on_conflict: duplicates_to\n      duplicates_to: dups\n  - sink: { topic: out }\n",
    )
    .unwrap();
    let text = t.describe();
    assert!(
        text.contains(
            "fingerprint(ignore /payload/commits/*/author/email) on_conflict=duplicates_to"
        ),
        "{text}"
    );
}

/// The same through the Rust builder: `DedupSpec::with_fingerprint_fields`, checked by
/// `build()` (a bytes source has no fields; `duplicates_to` needs its topic).
#[test]
fn fingerprint_fields_from_the_builder() {
    use onceflow::FingerprintFields;
    use onceflow::KeySource;
    use onceflow::{ConflictPolicy, DedupSpec};
    use onceflow::{Format, TopologyBuilder};
    let spec = |format: Format, side: Option<&str>| {
        let mut s = DedupSpec::new(KeySource::JsonPointer("/id".into())).with_fingerprint_fields(
            FingerprintFields::ignore(["/payload/commits/*/author/email"]),
        );
        s.on_conflict = ConflictPolicy::DuplicatesTo;
        s.duplicates_to = side.map(str::to_string);
        TopologyBuilder::new("t")
            .source("in", format)
            .dedup("dedup", s)
            .sink("out", "out")
            .build()
    };
    let errs: Vec<String> = spec(Format::Bytes, None)
        .unwrap_err()
        .iter()
        .map(|e| e.to_string())
        .collect();
    assert!(
        errs.contains(&"topology error in dedup: field `fingerprint`: fingerprint fields need a source with fields (json, protobuf), but the source format is bytes".to_string()),
        "{errs:?}"
    );
    assert!(
        errs.contains(&"topology error in dedup: field `on_conflict`: duplicates_to needs a duplicates_to topic".to_string()),
        "{errs:?}"
    );
    let mut d = TestDriver::new(spec(Format::Json, Some("dups")).unwrap());
    let got = judge(
        &mut d,
        &[
            push("e1", "0f1e2d@users.noreply", "add"),
            push("e1", "ann@example.com", "add tests"),
        ],
    );
    assert_eq!(
        got,
        (vec!["duplicate".to_string(), "conflict".into()], (1, 1))
    );
}
