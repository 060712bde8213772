//! Every stage of the topology language through the broker-free test driver, each with its
//! exact output: filter, map, route, multi-topic sinks with computed key and headers, and
//! dedup with a duplicate topic; in topology files (CEL) and in the builder (closures).
//! Missing fields, nulls, wrong types and expressions failing at run time send the record
//! to the dead-letter topic with the reason; nothing crashes and nothing else is written.

use onceflow::dsl;
use onceflow::headers::dlq_headers;
use onceflow::KeySource;
use onceflow::MapSpec;
use onceflow::RouteSpec;
use onceflow::{DedupSpec, SinkSpec};
use onceflow::{Format, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use std::path::Path;

fn file(yaml: &str) -> TestDriver {
    let t = dsl::parse("t.yaml", yaml).unwrap_or_else(|e| panic!("{e}"));
    TestDriver::new(t)
}

fn header<'a>(h: &'a [(String, Option<bytes::Bytes>)], name: &str) -> Option<&'a str> {
    h.iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.as_deref())
        .map(|b| std::str::from_utf8(b).unwrap())
}

/// (stage, reason, original value) of each dead letter.
fn dead(d: &TestDriver) -> Vec<(String, String, String)> {
    d.dead_letters()
        .iter()
        .map(|r| {
            (
                header(&r.headers, dlq_headers::STAGE).unwrap().to_string(),
                header(&r.headers, dlq_headers::REASON).unwrap().to_string(),
                String::from_utf8_lossy(r.value.as_deref().unwrap_or_default()).into_owned(),
            )
        })
        .collect()
}

fn dl(stage: &str, reason: &str, value: &str) -> (String, String, String) {
    (stage.into(), reason.into(), value.into())
}

const FILTER: &str = r#"
name: t
source: { topic: in }
stages:
  - filter: { name: big, when: 'value.n > 10' }
  - sink: { topic: out }
"#;

#[test]
fn filter_keeps_what_the_predicate_accepts() {
    let mut d = file(FILTER);
    for v in [
        r#"{"n":11}"#,
        r#"{"n":10}"#,
        r#"{"n":10.5}"#,
        r#"{"n":-3,"x":1}"#,
        r#"{"n":100}"#,
    ] {
        d.pipe(TestRecord::json(v)).unwrap();
    }
    assert_eq!(
        d.output_values("out"),
        [r#"{"n":11}"#, r#"{"n":10.5}"#, r#"{"n":100}"#]
    );
    assert!(d.dead_letters().is_empty());
}

#[test]
fn filter_missing_null_and_wrong_typed_fields_are_dead_letters() {
    let mut d = file(FILTER);
    for v in [
        r#"{"m":1}"#,
        r#"{"n":null}"#,
        r#"{"n":"eleven"}"#,
        r#"[1,2]"#,
        r#"not json"#,
        r#"{"n":12}"#,
    ] {
        d.pipe(TestRecord::json(v)).unwrap();
    }
    d.pipe(TestRecord::null_value()).unwrap();
    assert_eq!(d.output_values("out"), [r#"{"n":12}"#]);
    assert_eq!(
        dead(&d),
        [
            dl(
                "big",
                "expression `value.n > 10` failed: No such key: n",
                r#"{"m":1}"#
            ),
            dl(
                "big",
                "expression `value.n > 10` failed: found no matching overload for '_>_' applied to '(null_type, int)'",
                r#"{"n":null}"#
            ),
            dl(
                "big",
                "expression `value.n > 10` failed: found no matching overload for '_>_' applied to '(string, int)'",
                r#"{"n":"eleven"}"#
            ),
            dl(
                "big",
                "expression `value.n > 10` failed: found no matching overload for '_._' applied to '(list, string)'",
                r#"[1,2]"#
            ),
            dl(
                "source",
                "value is not valid JSON: expected ident at line 1 column 2",
                "not json"
            ),
            dl("source", "value is null, expected JSON", ""),
        ]
    );
}

#[test]
fn filter_predicate_that_is_not_a_bool_is_a_dead_letter() {
    let mut d = file(
        "name: t\nsource: { topic: in }\nstages:\n  - filter: { name: f, when: value.n }\n  - sink: { topic: out }\n",
    );
    d.pipe(TestRecord::json(r#"{"n":1}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"n":true}"#)).unwrap();
    assert_eq!(d.output_values("out"), [r#"{"n":true}"#]);
    assert_eq!(
        dead(&d),
        [dl(
            "f",
            "expression `value.n`: gave int, expected a bool",
            r#"{"n":1}"#
        )]
    );
}

#[test]
fn filter_sees_key_headers_and_metadata() {
    let mut d = file(
        r#"
name: t
source: { topic: in, format: bytes }
stages:
  - filter:
      when: key == "k1" && headers["trace"] == "yes" && partition == 1 && offset == 1 && timestamp > 5 && value == b"raw"
  - sink: { topic: out }
"#,
    );
    let r = |k: &str, t: &str| {
        TestRecord::json("raw")
            .key(k)
            .header("trace", t)
            .timestamp(10)
            .partition(1)
    };
    d.pipe(r("k1", "yes")).unwrap(); // offset 0
    d.pipe(r("k1", "yes")).unwrap(); // offset 1: passes
    d.pipe(r("k2", "yes")).unwrap();
    d.pipe(r("k1", "no")).unwrap();
    assert_eq!(d.output("out").len(), 1);
    assert_eq!(d.output("out")[0].key.as_deref(), Some(&b"k1"[..]));
    assert!(d.dead_letters().is_empty());
}

const MAP: &str = r#"
name: t
source: { topic: in }
stages:
  - map:
      name: shape
      rename: { actor: user, /meta/src: /source }
      set:
        total: value.price * value.qty
        /stats/first_tag: value.tags[0]
        who: value.actor.login
      drop: [secret, /meta]
  - sink: { topic: out }
"#;

#[test]
fn map_sets_renames_and_drops_fields() {
    let mut d = file(MAP);
    d.pipe(TestRecord::json(
        r#"{"actor":{"login":"ann"},"price":3,"qty":4,"tags":["a","b"],"secret":"x","meta":{"src":"web","v":1}}"#,
    ))
    .unwrap();
    assert_eq!(
        d.output_values("out"),
        [
            r#"{"price":3,"qty":4,"tags":["a","b"],"user":{"login":"ann"},"source":"web","total":12,"stats":{"first_tag":"a"},"who":"ann"}"#
        ]
    );
    assert!(d.dead_letters().is_empty());
}

#[test]
fn map_refuses_missing_fields_wrong_types_and_non_objects() {
    let mut d = file(MAP);
    let inputs = [
        // no actor: `who` fails
        r#"{"price":3,"qty":4,"tags":["a"]}"#,
        // price is a string
        r#"{"actor":{"login":"a"},"price":"3","qty":4,"tags":["a"]}"#,
        // empty tags: index out of range
        r#"{"actor":{"login":"a"},"price":3,"qty":4,"tags":[]}"#,
        // not an object
        r#""just a string""#,
        r#"null"#,
        // ok, and `meta` absent: rename and drop of missing fields are no-ops
        r#"{"actor":{"login":"b"},"price":1.5,"qty":2.0,"tags":["z"]}"#,
        // CEL does no mixed arithmetic: double * int has no overload
        r#"{"actor":{"login":"c"},"price":1.5,"qty":2,"tags":["z"]}"#,
    ];
    for v in inputs {
        d.pipe(TestRecord::json(v)).unwrap();
    }
    assert_eq!(
        d.output_values("out"),
        [
            r#"{"price":1.5,"qty":2.0,"tags":["z"],"user":{"login":"b"},"total":3.0,"stats":{"first_tag":"z"},"who":"b"}"#
        ]
    );
    let reasons: Vec<String> = dead(&d).into_iter().map(|(_, r, _)| r).collect();
    assert_eq!(
        reasons,
        [
            "set /who: expression `value.actor.login` failed: No such key: actor",
            "set /total: expression `value.price * value.qty` failed: Unsupported binary operator 'mul': String(\"3\"), Int(4)",
            "set /stats/first_tag: expression `value.tags[0]` failed: Index out of bounds: Int(0)",
            "value is a string; map needs a JSON object",
            "value is null; map needs a JSON object",
            "set /total: expression `value.price * value.qty` failed: Unsupported binary operator 'mul': Float(1.5), Int(2)",
        ]
    );
}

#[test]
fn map_output_feeds_a_later_dedup() {
    // The dedup reads the renamed field: the map re-encodes the value, and later stages
    // see the new one.
    let mut d = file(
        r#"
name: t
source: { topic: in }
stages:
  - map: { rename: { ident: id } }
  - dedup: { key: { json_pointer: /id }, partitioning: source }
  - sink: { topic: out }
"#,
    );
    for v in [
        r#"{"ident":1}"#,
        r#"{"ident":1}"#,
        r#"{"ident":2}"#,
        r#"{"x":2}"#,
    ] {
        d.pipe(TestRecord::json(v)).unwrap();
    }
    assert_eq!(d.output_values("out"), [r#"{"id":1}"#, r#"{"id":2}"#]);
    assert_eq!(
        dead(&d),
        [dl("dedup", "key field /id is missing", r#"{"x":2}"#)]
    );
}

const ROUTE: &str = r#"
name: t
source: { topic: in }
stages:
  - route:
      name: by-type
      routes:
        - { when: 'value.type == "push"', to: pushes }
        - { when: 'value.type.startsWith("issue")', to: issues }
        - { when: 'value.size > 100', to: big }
      default: other
"#;

#[test]
fn route_sends_to_the_first_matching_branch_or_the_default() {
    let mut d = file(ROUTE);
    for v in [
        r#"{"type":"push","size":1000}"#,
        r#"{"type":"issue_comment"}"#,
        r#"{"type":"fork","size":101}"#,
        r#"{"type":"fork","size":5}"#,
        r#"{"type":"issues"}"#,
    ] {
        d.pipe(TestRecord::json(v)).unwrap();
    }
    assert_eq!(
        d.output_values("pushes"),
        [r#"{"type":"push","size":1000}"#]
    );
    assert_eq!(
        d.output_values("issues"),
        [r#"{"type":"issue_comment"}"#, r#"{"type":"issues"}"#]
    );
    assert_eq!(d.output_values("big"), [r#"{"type":"fork","size":101}"#]);
    assert_eq!(d.output_values("other"), [r#"{"type":"fork","size":5}"#]);
    assert!(d.dead_letters().is_empty());
}

#[test]
fn route_failures_go_to_the_dead_letter_topic_only() {
    let mut d = file(ROUTE);
    for v in [r#"{"kind":"push"}"#, r#"{"type":7}"#, r#"{"type":"x"}"#] {
        d.pipe(TestRecord::json(v)).unwrap();
    }
    // `{"type":"x"}` has no size: the third branch fails before the default is reached.
    assert_eq!(
        dead(&d),
        [
            dl(
                "by-type",
                "expression `value.type == \"push\"` failed: No such key: type",
                r#"{"kind":"push"}"#
            ),
            dl(
                "by-type",
                "expression `value.type.startsWith(\"issue\")` failed: found no matching overload for 'startsWith' applied to 'int.(string)'",
                r#"{"type":7}"#
            ),
            dl(
                "by-type",
                "expression `value.size > 100` failed: No such key: size",
                r#"{"type":"x"}"#
            ),
        ]
    );
    for t in ["pushes", "issues", "big", "other"] {
        assert!(d.output(t).is_empty(), "{t}");
    }
}

#[test]
fn route_without_default_drops_unmatched_records() {
    let mut d = file(
        "name: t\nsource: {topic: in}\nstages:\n  - route: {routes: [{when: 'value.a == 1', to: one}]}\n",
    );
    d.pipe(TestRecord::json(r#"{"a":1}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"a":2}"#)).unwrap();
    assert_eq!(d.output_values("one"), [r#"{"a":1}"#]);
    assert_eq!(d.counts().records_out, 1);
    assert!(d.dead_letters().is_empty());
}

const SINK: &str = r#"
name: t
source: { topic: in }
stages:
  - sink:
      name: out
      topics: [a, b]
      key: value.user
      headers:
        kind: value.kind
        drop-me: 'null'
"#;

#[test]
fn sink_writes_to_every_topic_with_computed_key_and_headers() {
    let mut d = file(SINK);
    d.pipe(
        TestRecord::json(r#"{"user":42,"kind":"click"}"#)
            .key("old")
            .header("kind", "stale")
            .header("keep", "1")
            .header("drop-me", "x")
            .timestamp(77),
    )
    .unwrap();
    d.pipe(TestRecord::json(r#"{"user":"u7","kind":"view"}"#))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"user":null,"kind":"view"}"#))
        .unwrap();
    for topic in ["a", "b"] {
        let out = d.output(topic);
        assert_eq!(out.len(), 3, "{topic}");
        assert_eq!(out[0].key.as_deref(), Some(&b"42"[..]));
        let names: Vec<&str> = out[0].headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["keep", "kind"]);
        assert_eq!(header(&out[0].headers, "kind"), Some("click"));
        assert_eq!(out[0].timestamp, Some(77));
        assert_eq!(out[1].key.as_deref(), Some(&b"u7"[..]));
        assert_eq!(out[2].key, None, "a null result writes a null key");
        assert_eq!(
            out[0].value.as_deref(),
            Some(&br#"{"user":42,"kind":"click"}"#[..])
        );
    }
    assert!(d.dead_letters().is_empty());
}

#[test]
fn sink_key_failures_write_nothing() {
    let mut d = file(SINK);
    d.pipe(TestRecord::json(r#"{"kind":"click"}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"user":{"id":1},"kind":"click"}"#))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"user":1,"kind":["x"]}"#))
        .unwrap();
    assert!(d.output("a").is_empty() && d.output("b").is_empty());
    let reasons: Vec<String> = dead(&d).into_iter().map(|(_, r, _)| r).collect();
    assert_eq!(
        reasons,
        [
            "key: expression `value.user` failed: No such key: user",
            "key: expression `value.user`: gave map, expected a string, bytes, a number or null",
            "header kind: expression `value.kind`: gave list, expected a string, bytes, a number or null",
        ]
    );
}

const ANALYTICS_DUPS: &str = r#"
name: t
source: { topic: in }
stages:
  - dedup: { name: d, key: { json_pointer: /id }, ttl: 1h, duplicates_to: dups }
  - sink: { topic: out }
"#;

#[test]
fn dedup_sends_duplicates_to_the_side_topic_with_the_first_occurrence() {
    let mut d = file(ANALYTICS_DUPS);
    d.pipe(TestRecord::json(r#"{"id":"a","n":1}"#).timestamp(0))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"id":"b"}"#).timestamp(1))
        .unwrap();
    d.pipe(
        TestRecord::json(r#"{"id":"a","n":2}"#)
            .timestamp(2)
            .header("h", "v"),
    )
    .unwrap();
    // Past the 1 h window: a first occurrence again.
    d.pipe(TestRecord::json(r#"{"id":"a","n":3}"#).timestamp(3_600_001))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"n":4}"#).timestamp(5)).unwrap();
    assert_eq!(
        d.output_values("out"),
        [
            r#"{"id":"a","n":1}"#,
            r#"{"id":"b"}"#,
            r#"{"id":"a","n":3}"#
        ]
    );
    let dups = d.output("dups");
    assert_eq!(dups.len(), 1);
    assert_eq!(dups[0].value.as_deref(), Some(&br#"{"id":"a","n":2}"#[..]));
    assert_eq!(dups[0].timestamp, Some(2));
    assert_eq!(header(&dups[0].headers, "h"), Some("v"));
    assert_eq!(
        header(&dups[0].headers, "onceflow.duplicate.of.partition"),
        Some("0")
    );
    assert_eq!(
        header(&dups[0].headers, "onceflow.duplicate.of.offset"),
        Some("0")
    );
    assert_eq!(
        dead(&d),
        [dl("d", "key field /id is missing", r#"{"n":4}"#)]
    );
    let c = d.counts();
    assert_eq!((c.passed, c.duplicates, c.dead_lettered), (3, 1, 1));
}

#[test]
fn builder_closures_do_what_expressions_do() {
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .filter("has-id", |r| {
            Ok(r.json.as_ref().and_then(|j| j.get("id")).is_some())
        })
        .map(
            "tag",
            MapSpec::new()
                .set("/len", |r| {
                    let s = r.json.as_ref().unwrap()["id"]
                        .as_str()
                        .ok_or("id is not a string")?;
                    Ok(serde_json::Value::from(s.len()))
                })
                .drop_field("/junk"),
        )
        .dedup(
            "dedup",
            DedupSpec::new(KeySource::JsonPointer("/id".into()))
                .with_duplicates_to("dups")
                .with_partitioning(onceflow::Partitioning::Source),
        )
        .route(
            "split",
            RouteSpec::new()
                .when(|r| Ok(r.json.as_ref().unwrap()["len"] == 1), "short")
                .default_topic("long"),
        )
        .sink_with(
            "all",
            SinkSpec::to("all").also("all2").key(|r| {
                Ok(r.json.as_ref().unwrap()["id"]
                    .as_str()
                    .map(|s| bytes::Bytes::from(s.to_uppercase())))
            }),
        )
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    for v in [
        r#"{"id":"a","junk":1}"#,
        r#"{"nope":1}"#,
        r#"{"id":"bcd"}"#,
        r#"{"id":"a"}"#,
        r#"{"id":5}"#,
    ] {
        d.pipe(TestRecord::json(v)).unwrap();
    }
    assert_eq!(d.output_values("short"), [r#"{"id":"a","len":1}"#]);
    assert_eq!(d.output_values("long"), [r#"{"id":"bcd","len":3}"#]);
    assert_eq!(d.output_values("dups"), [r#"{"id":"a","len":1}"#]);
    let keys: Vec<_> = d.output("all2").iter().map(|r| r.key.clone()).collect();
    assert_eq!(
        keys,
        [
            Some(bytes::Bytes::from_static(b"A")),
            Some(bytes::Bytes::from_static(b"BCD"))
        ]
    );
    assert_eq!(d.output("all").len(), 2);
    assert_eq!(
        dead(&d),
        [dl("tag", "set /len: id is not a string", r#"{"id":5}"#)]
    );
}

fn shipped(name: &str) -> TestDriver {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("topologies")
        .join(name);
    TestDriver::new(dsl::load(&p).unwrap_or_else(|e| panic!("{e}")))
}

#[test]
fn shipped_analytics_dedup_topology() {
    let mut d = shipped("analytics-dedup.yaml");
    let ev = |id: &str, user: i64, t: i64| {
        TestRecord::json(format!(
            r#"{{"event_id":"{id}","user_id":{user},"event":"page_view"}}"#
        ))
        .timestamp(t)
    };
    d.pipe(ev("e1", 7, 0)).unwrap();
    d.pipe(ev("e2", 8, 10)).unwrap();
    d.pipe(ev("e1", 7, 20)).unwrap();
    d.pipe(ev("e1", 7, 30)).unwrap();
    d.pipe(TestRecord::json(r#"{"user_id":1}"#).timestamp(40))
        .unwrap();
    let unique = d.output("analytics.unique");
    let got: Vec<(Option<&[u8]>, Option<&str>)> = unique
        .iter()
        .map(|r| (r.key.as_deref(), header(&r.headers, "event-name")))
        .collect();
    assert_eq!(
        got,
        [
            (Some(&b"7"[..]), Some("page_view")),
            (Some(&b"8"[..]), Some("page_view"))
        ]
    );
    let dups = d.output("analytics.duplicates");
    assert_eq!(dups.len(), 2);
    for r in dups {
        assert_eq!(
            header(&r.headers, "onceflow.duplicate.of.offset"),
            Some("0")
        );
    }
    assert_eq!(
        dead(&d),
        [dl(
            "seen-events",
            "key field /event_id is missing",
            r#"{"user_id":1}"#
        )]
    );
}

#[test]
fn shipped_routing_topology() {
    let mut d = shipped("routing-by-event-type.yaml");
    let ev = |ty: &str| {
        format!(
            r#"{{"type":"{ty}","actor":{{"login":"ann"}},"repo":{{"name":"r/x"}},"payload":{{"big":1}},"org":{{}}}}"#
        )
    };
    for ty in [
        "PushEvent",
        "IssuesEvent",
        "PullRequestReviewCommentEvent",
        "WatchEvent",
        "IssueCommentEvent",
    ] {
        d.pipe(TestRecord::json(ev(ty))).unwrap();
    }
    d.pipe(TestRecord::json(
        r#"{"type":"PushEvent","actor":{"login":"x"}}"#,
    ))
    .unwrap();
    let slim = |ty: &str| {
        format!(
            r#"{{"type":"{ty}","actor":{{"login":"ann"}},"repo":{{"name":"r/x"}},"repo_name":"r/x","actor_login":"ann"}}"#
        )
    };
    assert_eq!(d.output_values("gharchive.pushes"), [slim("PushEvent")]);
    assert_eq!(
        d.output_values("gharchive.issues"),
        [slim("IssuesEvent"), slim("IssueCommentEvent")]
    );
    assert_eq!(
        d.output_values("gharchive.pull-requests"),
        [slim("PullRequestReviewCommentEvent")]
    );
    assert_eq!(d.output_values("gharchive.other"), [slim("WatchEvent")]);
    assert_eq!(
        dead(&d),
        [dl(
            "slim",
            "set /repo_name: expression `value.repo.name` failed: No such key: repo",
            r#"{"type":"PushEvent","actor":{"login":"x"}}"#
        )]
    );
}

#[test]
fn shipped_routing_topology_in_toml_is_the_same() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("topologies");
    let y = dsl::load(&dir.join("routing-by-event-type.yaml")).unwrap();
    let t = dsl::load(&dir.join("routing-by-event-type.toml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(y, t);
}

#[test]
fn shipped_routing_topology_on_real_gharchive_events() {
    // One hour of real events: every event lands on exactly one topic (or the DLQ), and
    // each topic holds exactly the types routed to it.
    let files = onceflow_testkit::gharchive::hour_files();
    let events = onceflow_testkit::gharchive::read_hour(&files[0]).unwrap();
    let mut d = shipped("routing-by-event-type.yaml");
    let n = events.len().min(3000);
    for e in &events[..n] {
        d.pipe(TestRecord::json(e.line.clone())).unwrap();
    }
    let mut total = d.dead_letters().len();
    for (topic, ok) in [
        (
            "gharchive.pushes",
            &(|t: &str| t == "PushEvent") as &dyn Fn(&str) -> bool,
        ),
        ("gharchive.issues", &|t: &str| {
            t == "IssuesEvent" || t == "IssueCommentEvent"
        }),
        ("gharchive.pull-requests", &|t: &str| {
            t.starts_with("PullRequest")
        }),
        ("gharchive.other", &|t: &str| {
            !(t == "PushEvent"
                || t == "IssuesEvent"
                || t == "IssueCommentEvent"
                || t.starts_with("PullRequest"))
        }),
    ] {
        let vals = d.output_values(topic);
        assert!(!vals.is_empty(), "{topic} got nothing");
        for v in &vals {
            let j: serde_json::Value = serde_json::from_str(v).unwrap();
            assert!(ok(j["type"].as_str().unwrap()), "{topic}: {v}");
            assert!(j.get("payload").is_none() && j["repo_name"].is_string());
        }
        total += vals.len();
    }
    assert_eq!(total, n);
}

#[test]
fn a_record_refused_by_a_later_stage_has_only_its_dead_letter() {
    // The route writes before the sink computes its key; when the key fails, the route's
    // output for that record is withdrawn: one source record, one outcome.
    let mut d = file(
        r#"
name: t
source: { topic: in }
stages:
  - route: { routes: [ { when: 'true', to: routed } ] }
  - sink: { topic: out, key: value.k }
"#,
    );
    d.pipe(TestRecord::json(r#"{"k":"a"}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"nok":1}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"k":"b"}"#)).unwrap();
    assert_eq!(d.output_values("routed"), [r#"{"k":"a"}"#, r#"{"k":"b"}"#]);
    assert_eq!(d.output_values("out"), [r#"{"k":"a"}"#, r#"{"k":"b"}"#]);
    assert_eq!(
        dead(&d),
        [dl(
            "sink-out",
            "key: expression `value.k` failed: No such key: k",
            r#"{"nok":1}"#
        )]
    );
    assert_eq!(d.counts().records_out, 4);
}

#[test]
fn keys_and_headers_that_are_not_utf8_are_bytes_never_decoded_lossily() {
    let mut d = file(
        r#"
name: t
source: { topic: in }
stages:
  - filter: { when: 'key == b"\xff\x00" && headers.h == b"\xfe"' }
  - sink: { topic: out, key: key, headers: { copy: headers.h } }
"#,
    );
    d.pipe(
        TestRecord::json(r#"{"a":1}"#)
            .key(vec![0xff, 0x00])
            .header("h", vec![0xfe]),
    )
    .unwrap();
    d.pipe(
        TestRecord::json(r#"{"a":2}"#)
            .key("\u{fffd}\u{0}")
            .header("h", vec![0xfe]),
    )
    .unwrap();
    let out = d.output("out");
    assert_eq!(out.len(), 1, "the replacement-character key is another key");
    assert_eq!(out[0].key.as_deref(), Some(&[0xff, 0x00][..]));
    assert_eq!(
        out[0]
            .headers
            .iter()
            .find(|(k, _)| k == "copy")
            .unwrap()
            .1
            .as_deref(),
        Some(&[0xfe][..])
    );
}

/// A CEL map with keys `1` and `"1"` is two entries in CEL but one name in JSON: the record
/// is dead-lettered naming the stage, not written with one entry lost.
#[test]
fn a_map_result_whose_keys_collide_in_json_is_a_dead_letter() {
    let mut d = file(
        r#"
name: t
source: { topic: in }
stages:
  - map: { name: m, set: { o: '{1: "int", "1": "string"}' } }
  - sink: { topic: out }
"#,
    );
    d.pipe(TestRecord::json(r#"{}"#)).unwrap();
    assert_eq!(d.output_values("out"), Vec::<String>::new());
    let dead = dead(&d);
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "m", "{dead:?}");
    assert!(dead[0].1.contains("two keys written \"1\""), "{dead:?}");
}

/// A dead letter carries the record as read, even when a `map` before the failing stage
/// rewrote it, and one set of `onceflow.dlq.*` headers: a replayed dead letter that fails
/// again names only its new failure (it kept the old headers and got a second set; found
/// by a review helper).
#[test]
fn a_dead_letter_is_the_record_as_read_with_one_set_of_dlq_headers() {
    let mut d = file(
        r#"
name: t
source: { topic: in }
stages:
  - map: { name: m, set: { n: "value.a + 1" } }
  - route:
      name: r
      routes:
        - { when: 'value.n.missing == 1', to: out }
"#,
    );
    d.pipe(
        TestRecord::json(r#"{"a":1}"#)
            .header(dlq_headers::STAGE, "old-stage")
            .header(dlq_headers::REASON, "an old failure")
            .header(dlq_headers::OFFSET, "12345")
            .header("mine", "kept"),
    )
    .unwrap();
    let got = dead(&d);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].0.as_str(), got[0].2.as_str()), ("r", r#"{"a":1}"#));
    assert!(!got[0].1.contains("old failure"), "{got:?}");
    let h = &d.dead_letters()[0].headers;
    for name in [dlq_headers::STAGE, dlq_headers::REASON, dlq_headers::OFFSET] {
        assert_eq!(
            h.iter().filter(|(k, _)| k == name).count(),
            1,
            "{name}: {h:?}"
        );
    }
    assert_eq!(header(h, dlq_headers::OFFSET), Some("0"));
    assert_eq!(header(h, "mine"), Some("kept"));
}
