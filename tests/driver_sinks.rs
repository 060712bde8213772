//! External sinks through the broker-free test driver, against a local HTTP receiver (and a
//! private Redis for the outage tests): key templates, raw-byte keys, the 2 KiB key, one
//! retry after a 503, Redis stopped mid-run under fail_closed and fail_open.

mod sink_support;

use onceflow::headers::dlq_headers;
use onceflow::headers::{OUTCOME_HEADER, RESULT_HEADER};
use onceflow::{EffectSpec, ExternalSinkSpec, HttpSpec, OnStoreError, Secret, StoreSpec};
use onceflow::{Format, Topology, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use sink_support::*;
use std::sync::Arc;
use std::time::Duration;

fn http(url: &str) -> HttpSpec {
    let mut h = HttpSpec::new(Secret::Inline(url.to_string()));
    h.backoff = Duration::from_millis(20);
    h.timeout = Duration::from_secs(5);
    h
}

fn topology(spec: ExternalSinkSpec, format: Format) -> Topology {
    TopologyBuilder::new("t")
        .source("in", format)
        .external_sink("hook", spec)
        .sink("out", "out")
        .build()
        .unwrap()
}

#[test]
fn key_templates_keep_raw_bytes_and_refuse_long_keys() {
    let rx = Receiver::ok();
    let dir = tempfile::tempdir().unwrap();
    let spec =
        ExternalSinkSpec::new(EffectSpec::Http(http(&rx.url)), sled(&dir)).with_key("{header.k}");
    let mut d = TestDriver::new(topology(spec, Format::Json));
    d.pipe(TestRecord::json(r#"{"n":1}"#).header("k", "order-9:invoice"))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"n":2}"#).header("k", b"\xff\xfe-9\x80".to_vec()))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"n":3}"#).header("k", vec![b'x'; 2048]))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"n":4}"#)).unwrap(); // no header: no key
                                                     // The same keys again: duplicates, no second call.
    d.pipe(TestRecord::json(r#"{"n":5}"#).header("k", "order-9:invoice"))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"n":6}"#).header("k", b"\xff\xfe-9\x80".to_vec()))
        .unwrap();

    let keys: Vec<Vec<u8>> = rx.calls().into_iter().map(|c| c.key.unwrap()).collect();
    assert_eq!(
        keys,
        vec![b"order-9:invoice".to_vec(), b"\xff\xfe-9\x80".to_vec()]
    );
    let outcomes: Vec<&[u8]> = d
        .output("out")
        .iter()
        .map(|r| header(r, OUTCOME_HEADER).unwrap())
        .collect();
    assert_eq!(
        outcomes,
        vec![
            &b"done"[..],
            b"done",
            b"skipped_duplicate",
            b"skipped_duplicate"
        ]
    );
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 2);
    let reason = |i: usize| {
        String::from_utf8_lossy(header(dl[i], dlq_headers::REASON).unwrap()).into_owned()
    };
    assert_eq!(
        reason(0),
        "idempotency key is 2048 bytes, longer than max_key_bytes (1024)"
    );
    assert_eq!(reason(1), "{header.k}: no such header");
    assert_eq!(header(dl[0], dlq_headers::STAGE), Some(&b"hook"[..]));
    assert_eq!(d.committed_offset(0), Some(6));
}

#[test]
fn a_template_naming_a_field_the_codec_cannot_have_fails_validation() {
    let spec = ExternalSinkSpec::new(
        EffectSpec::Http(http("http://127.0.0.1:1/")),
        StoreSpec::None,
    )
    .with_key("{value./order_id}.invoice");
    let errs = TopologyBuilder::new("t")
        .source("in", Format::Bytes)
        .external_sink("hook", spec)
        .build()
        .unwrap_err();
    assert_eq!(errs.len(), 1);
    assert_eq!(
        errs[0].to_string(),
        "topology error in hook: field `key`: template \"{value./order_id}.invoice\" reads field /order_id, but the source format is bytes: its values have no fields"
    );
}

/// Two different records never share an idempotency key: a separator inside a value is
/// escaped, and a template that cannot tell records apart is refused at build.
#[test]
fn a_key_template_never_makes_one_key_of_two_records() {
    let dir = tempfile::tempdir().unwrap();
    let file = |dir: &tempfile::TempDir| {
        EffectSpec::File(onceflow::FileSpec {
            path: dir.path().join("out.jsonl"),
            line: "{value}".into(),
        })
    };
    let spec = ExternalSinkSpec::new(file(&dir), sled(&dir)).with_key("{value./a}-{value./b}");
    let mut d = TestDriver::new(topology(spec, Format::Json));
    for v in [
        r#"{"a":"x-","b":"y"}"#,
        r#"{"a":"x","b":"-y"}"#,
        r#"{"a":"x","b":"-y"}"#, // a true repeat: skipped
    ] {
        d.pipe(TestRecord::json(v)).unwrap();
    }
    let lines = std::fs::read_to_string(dir.path().join("out.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 2, "{lines}");
    for (key, why) in [
        ("invoice", "no placeholder"),
        ("{value./a}{value./b}", "nothing between them"),
    ] {
        let spec = ExternalSinkSpec::new(file(&dir), sled(&dir)).with_key(key);
        let errs = TopologyBuilder::new("t")
            .source("in", Format::Json)
            .external_sink("hook", spec)
            .sink("out", "out")
            .build()
            .unwrap_err();
        assert!(errs[0].to_string().contains(why), "{key}: {}", errs[0]);
    }
}

/// The default idempotency key is the key the dedup decided by, even behind a `map` that
/// rewrites the value: `1.0` and `1e0` are two ids to the dedup (their exact text), so two
/// effects, not one (read again from the mapped view both were `1.0`).
#[test]
fn the_default_key_is_the_dedup_key_even_behind_a_map() {
    let dir = tempfile::tempdir().unwrap();
    let effect = EffectSpec::File(onceflow::FileSpec {
        path: dir.path().join("out.jsonl"),
        line: "{value}".into(),
    });
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .dedup(
            "dedup",
            onceflow::DedupSpec::new(onceflow::KeySource::JsonPointer("/id".into()))
                .with_partitioning(onceflow::Partitioning::Source),
        )
        .map(
            "m",
            onceflow::MapSpec::new().set("/seen", |_| Ok(serde_json::Value::Bool(true))),
        )
        .external_sink("hook", ExternalSinkSpec::new(effect, sled(&dir)))
        .sink("out", "out")
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    for v in [r#"{"id":1.0}"#, r#"{"id":1e0}"#, r#"{"id":1e0}"#] {
        d.pipe(TestRecord::json(v).timestamp(1000)).unwrap();
    }
    assert_eq!((d.counts().passed, d.counts().duplicates), (2, 1));
    let lines = std::fs::read_to_string(dir.path().join("out.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 2, "{lines}");
    let done: Vec<_> = d
        .output("out")
        .iter()
        .filter_map(|r| header(r, OUTCOME_HEADER))
        .collect();
    assert_eq!(done, [&b"done"[..], &b"done"[..]]);
}

#[test]
fn a_503_is_retried_once_then_done_without_duplicate() {
    let rx = Receiver::start(Arc::new(|k, n| {
        if k == Some(&b"order-7"[..]) && n == 0 {
            (503, Duration::ZERO)
        } else {
            (200, Duration::ZERO)
        }
    }));
    let dir = tempfile::tempdir().unwrap();
    let spec = ExternalSinkSpec::new(EffectSpec::Http(http(&rx.url)), sled(&dir))
        .with_key("order-{value./id}");
    let mut d = TestDriver::new(topology(spec, Format::Json));
    for id in [6, 7, 8, 7] {
        d.pipe(TestRecord::json(format!(r#"{{"id":{id}}}"#)))
            .unwrap();
    }
    let per = rx.per_key();
    assert_eq!(
        per[&b"order-7".to_vec()],
        vec![503, 200],
        "one retry, one 2xx"
    );
    assert_eq!(per[&b"order-6".to_vec()], vec![200]);
    assert_eq!(per[&b"order-8".to_vec()], vec![200]);
    assert_eq!(rx.calls().len(), 4);
    let out = d.output("out");
    assert_eq!(
        header(out[3], OUTCOME_HEADER),
        Some(&b"skipped_duplicate"[..])
    );
    // The twin gets the stored result of the call that succeeded.
    assert_eq!(header(out[3], RESULT_HEADER), header(out[1], RESULT_HEADER));
    assert!(d.dead_letters().is_empty());
}

#[test]
fn a_4xx_is_dead_lettered_with_status_and_body() {
    let rx = Receiver::start(Arc::new(|_, _| (422, Duration::ZERO)));
    let dir = tempfile::tempdir().unwrap();
    let spec =
        ExternalSinkSpec::new(EffectSpec::Http(http(&rx.url)), sled(&dir)).with_key("{value./id}");
    let mut d = TestDriver::new(topology(spec, Format::Json));
    d.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap();
    assert_eq!(rx.calls().len(), 1, "not retried");
    let dl = d.dead_letters();
    assert_eq!(
        header(dl[0], dlq_headers::REASON),
        Some(&b"HTTP 422 (not retried): answer 422 #0"[..])
    );
    // A failure never marks the key done: the next delivery calls again.
    d.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap();
    assert_eq!(rx.calls().len(), 2);
}

/// A record an external sink fails late (at the commit), behind a `map` and a first sink
/// whose outcome headers it carries, is dead-lettered as read: value, key and headers as the
/// source had them, with one set of `onceflow.dlq.*` headers. Found by a review helper: this
/// path wrote the mapped value and the earlier sink's headers, while a record refused while
/// processed was written as read.
#[test]
fn a_late_failure_dead_letters_the_record_as_read() {
    let ok = Receiver::ok();
    let bad = Receiver::start(Arc::new(|_, _| (422, Duration::ZERO)));
    let dir = tempfile::tempdir().unwrap();
    let first = ExternalSinkSpec::new(EffectSpec::Http(http(&ok.url)), sled(&dir))
        .with_key("a-{value./id}");
    let second = ExternalSinkSpec::new(EffectSpec::Http(http(&bad.url)), sled(&dir))
        .with_key("b-{value./id}");
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .map(
            "add",
            onceflow::MapSpec::new().set("/added", |_| Ok(serde_json::Value::Bool(true))),
        )
        .external_sink("first", first)
        .external_sink("second", second)
        .sink("out", "out")
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    let input = r#"{"id": 1}"#;
    d.pipe(
        TestRecord::json(input)
            .key("k1")
            .header("h", "v")
            .header(dlq_headers::REASON, "an earlier failure, replayed"),
    )
    .unwrap();
    assert_eq!(bad.calls().len(), 1);
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    assert_eq!(
        dl[0].value.as_deref(),
        Some(input.as_bytes()),
        "the value as read"
    );
    assert_eq!(dl[0].key.as_deref(), Some(&b"k1"[..]));
    let names: Vec<&str> = dl[0].headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "h",
            dlq_headers::TOPIC,
            dlq_headers::PARTITION,
            dlq_headers::OFFSET,
            dlq_headers::STAGE,
            dlq_headers::REASON
        ],
        "the headers as read, the old dead-letter headers replaced"
    );
    assert_eq!(header(dl[0], dlq_headers::STAGE), Some(&b"second"[..]));
}

fn outage(policy: OnStoreError) -> (Receiver, TestDriver, usize) {
    let mut redis = OwnRedis::start();
    let rx = Receiver::ok();
    let mut spec = ExternalSinkSpec::new(
        EffectSpec::Http(http(&rx.url)),
        StoreSpec::Redis {
            url: Secret::Inline(redis.url()),
            prefix: None,
        },
    )
    .with_key("{value./id}");
    spec.policy.on_store_error = policy;
    // fail_closed rides out the 3 s outage; fail_open gives up on the store quickly.
    spec.policy.store_retry_for = match policy {
        OnStoreError::FailClosed => Duration::from_secs(20),
        OnStoreError::FailOpen => Duration::from_millis(300),
    };
    spec.concurrency = 4;
    let mut d = TestDriver::new(topology(spec, Format::Json)).auto_commit(false);
    let ev = |i: usize| TestRecord::json(format!(r#"{{"id":"e{i}"}}"#)).partition((i % 2) as i32);
    for i in 0..20 {
        d.pipe(ev(i)).unwrap();
    }
    d.commit().unwrap();
    redis.stop();
    let restart = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        redis.resume();
        redis
    });
    // During the outage (and for fail_closed, past it): 20 new ids and 20 repeats.
    for i in 10..50 {
        d.pipe(ev(i)).unwrap();
    }
    d.commit().unwrap();
    let redis = restart.join().unwrap();
    // After it, the repeats again: all completed.
    for i in 0..40 {
        d.pipe(ev(i)).unwrap();
    }
    d.commit().unwrap();
    drop(redis);
    let unprotected = d
        .output("out")
        .iter()
        .filter(|r| header(r, OUTCOME_HEADER) == Some(&b"unprotected"[..]))
        .count();
    (rx, d, unprotected)
}

#[test]
fn redis_outage_fail_closed_loses_nothing_and_repeats_nothing() {
    let (rx, d, unprotected) = outage(OnStoreError::FailClosed);
    let per = rx.per_key();
    assert_eq!(per.len(), 50, "every id reached the receiver");
    let repeated: Vec<_> = per.iter().filter(|(_, v)| v.len() > 1).collect();
    assert!(repeated.is_empty(), "repeated effects: {repeated:?}");
    assert_eq!(unprotected, 0);
    assert!(d.dead_letters().is_empty());
    assert_eq!(d.output("out").len(), 100);
}

#[test]
fn redis_outage_fail_open_runs_effects_unprotected_and_counts_them() {
    use metrics_util::debugging::DebuggingRecorder;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (rx, d, unprotected) =
        metrics::with_local_recorder(&recorder, || outage(OnStoreError::FailOpen));
    let per = rx.per_key();
    assert_eq!(per.len(), 50, "every id reached the receiver");
    assert!(unprotected > 0, "the outage must run effects unprotected");
    let counted = effects_counted(&snapshotter);
    assert_eq!(
        counted.get("unprotected"),
        Some(&(unprotected as u64)),
        "{counted:?}"
    );
    assert_eq!(counted.values().sum::<u64>(), 100, "{counted:?}");
    // The run summary counts the same outcomes.
    let c = d.counts();
    assert_eq!(c.effects_unprotected, unprotected as u64);
    assert_eq!(
        c.effects_done + c.effects_skipped + c.effects_unprotected + c.dead_lettered,
        100,
        "{c:?}"
    );
    eprintln!(
        "fail_open: {unprotected} effects unprotected, {} calls for 50 ids",
        rx.calls().len()
    );
    assert!(d.dead_letters().is_empty());
}

#[test]
fn same_key_effects_keep_their_order_while_others_overlap() {
    // The first call for key a is slow; b and c overtake it, the second a waits for it.
    let rx = Receiver::start(Arc::new(|k, n| {
        if k == Some(&b"a"[..]) && n == 0 {
            (200, Duration::from_millis(400))
        } else {
            (200, Duration::ZERO)
        }
    }));
    let mut spec = ExternalSinkSpec::new(EffectSpec::Http(http(&rx.url)), StoreSpec::None)
        .with_key("{value./k}");
    spec.concurrency = 8;
    let mut d = TestDriver::new(topology(spec, Format::Json)).auto_commit(false);
    for (k, v) in [("a", 1), ("b", 2), ("c", 3), ("a", 4)] {
        d.pipe(TestRecord::json(format!(r#"{{"k":"{k}","v":{v}}}"#)))
            .unwrap();
    }
    d.commit().unwrap();
    let bodies: Vec<String> = rx
        .calls()
        .iter()
        .map(|c| String::from_utf8(c.body.clone()).unwrap())
        .collect();
    assert_eq!(bodies.len(), 4);
    let pos = |s: &str| bodies.iter().position(|b| b.contains(s)).unwrap();
    assert!(
        pos(r#""v":1"#) < pos(r#""v":4"#),
        "same key in order: {bodies:?}"
    );
    assert!(
        pos(r#""v":2"#) < pos(r#""v":1"#),
        "other keys overlap the slow call: {bodies:?}"
    );
    // Everything finished before the commit; the offset covers all four.
    assert_eq!(d.committed_offset(0), Some(4));
}

#[test]
fn redis_sink_runs_its_command_once_per_key() {
    let redis = OwnRedis::start();
    let spec = ExternalSinkSpec::new(
        EffectSpec::Redis(onceflow::RedisSpec {
            url: Secret::Inline(redis.url()),
            command: vec![
                "INCRBY".into(),
                "orders:{value./customer}".into(),
                "{value./amount}".into(),
            ],
        }),
        StoreSpec::Redis {
            url: Secret::Inline(redis.url()),
            prefix: Some("idem:".into()),
        },
    )
    .with_key("order-{value./id}");
    let mut d = TestDriver::new(topology(spec, Format::Json));
    for (id, amount) in [(1, 5), (2, 7), (1, 5), (3, 1), (2, 7)] {
        d.pipe(TestRecord::json(format!(
            r#"{{"id":{id},"customer":"c:9","amount":{amount}}}"#
        )))
        .unwrap();
    }
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "GET", "orders:c:9"])
        .output()
        .unwrap();
    // INCRBY is not idempotent: 13 only if each order ran once (5 + 7 + 1), not 25.
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "13");
    let outcomes: Vec<&[u8]> = d
        .output("out")
        .iter()
        .map(|r| header(r, OUTCOME_HEADER).unwrap())
        .collect();
    assert_eq!(
        outcomes,
        vec![
            &b"done"[..],
            b"done",
            b"skipped_duplicate",
            b"done",
            b"skipped_duplicate"
        ]
    );
    let completed = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "GET", "idem:order-1"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&completed.stdout).trim(), "C5");
}

#[test]
fn file_sink_appends_one_json_line_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.jsonl");
    let spec = file_by_id(path.clone(), "{value}", &dir);
    let mut d = TestDriver::new(topology(spec, Format::Json));
    for id in [1, 2, 1, 3, 3] {
        d.pipe(TestRecord::json(format!(r#"{{"id":{id}}}"#)))
            .unwrap();
    }
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "{\"id\":1}\n{\"id\":2}\n{\"id\":3}\n"
    );
}

/// One record, one line: a field rendered with a line break is dead-lettered, not split.
#[test]
fn a_file_sink_line_with_a_line_break_is_dead_lettered() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.txt");
    let spec = file_by_id(path.clone(), "{value./a}", &dir);
    let mut d = TestDriver::new(topology(spec, Format::Json));
    d.pipe(TestRecord::json(r#"{"id":1,"a":"x\ny"}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"id":2,"a":"ok"}"#)).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "ok\n");
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    assert_eq!(
        header(dl[0], dlq_headers::REASON),
        Some(&b"line: the rendered line contains a line break; a file sink writes one line per record ({value} renders JSON on one line)"[..])
    );
}

#[test]
fn a_lease_shorter_than_the_call_with_its_retries_fails_validation() {
    let mut h = http("http://127.0.0.1:1/");
    h.timeout = Duration::from_secs(2);
    h.retries = 2;
    h.backoff = Duration::from_millis(100);
    let mut spec = ExternalSinkSpec::new(EffectSpec::Http(h), StoreSpec::Sled { path: None });
    spec.policy.lease = Duration::from_secs(6);
    let errs = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .external_sink("hook", spec.clone())
        .build()
        .unwrap_err();
    assert_eq!(
        errs[0].to_string(),
        "topology error in hook: field `idempotency.lease`: 6s is not longer than the longest the call can take with its retries (6.3s = timeout x (retries + 1) + backoffs); raise the lease or lower timeout/retries"
    );
    spec.policy.lease = Duration::from_secs(7);
    assert!(TopologyBuilder::new("t")
        .source("in", Format::Json)
        .external_sink("hook", spec)
        .build()
        .is_ok());
}

#[test]
fn a_template_naming_a_field_the_protobuf_message_lacks_fails_validation() {
    use onceflow::ProtoFormat;
    let desc = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/shop.desc");
    let build = |key: &str| {
        let spec = ExternalSinkSpec::new(
            EffectSpec::Http(http("http://127.0.0.1:1/")),
            StoreSpec::None,
        )
        .with_key(key);
        TopologyBuilder::new("t")
            .source(
                "in",
                Format::Protobuf(ProtoFormat::from_file(desc, "shop.EnrichedOrder").unwrap()),
            )
            .external_sink("hook", spec)
            .build()
    };
    assert!(build("{value./order_id}.invoice").is_ok());
    assert!(build("{value./customer/tier}-{value./order_id}").is_ok());
    let errs = build("{value./customer/rank}").unwrap_err();
    assert_eq!(
        errs[0].to_string(),
        "topology error in hook: field `key`: template \"{value./customer/rank}\" reads field /customer/rank, but protobuf message shop.Customer has no field \"rank\""
    );
    assert!(build("{value./orderId}").is_err());
}

/// A file sink writing `line` to `path`, keyed by `/id`, with a sled store in `dir`.
fn file_by_id(path: std::path::PathBuf, line: &str, dir: &tempfile::TempDir) -> ExternalSinkSpec {
    ExternalSinkSpec::new(
        EffectSpec::File(onceflow::FileSpec {
            path,
            line: line.into(),
        }),
        sled(dir),
    )
    .with_key("{value./id}")
}

fn file_sink_topology(topology: &str, dir: &tempfile::TempDir, out: &str) -> Topology {
    let spec = file_by_id(dir.path().join(out), "{value}", dir);
    TopologyBuilder::new(topology)
        .source("in", Format::Json)
        .external_sink("file", spec)
        .build()
        .unwrap()
}

/// Two topologies whose sinks share a name and a store (the default sled directory, or one
/// Redis) must not see each other's keys: the second one's effects would be skipped as
/// "duplicates" of effects it never made.
#[test]
fn idempotency_keys_are_scoped_by_topology_not_only_by_sink_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = TestDriver::new(file_sink_topology("orders-a", &dir, "a.jsonl"));
    a.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap();
    let mut b = TestDriver::new(file_sink_topology("invoices-b", &dir, "b.jsonl"));
    b.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("a.jsonl")).unwrap(),
        "{\"id\":1}\n"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("b.jsonl")).unwrap_or_default(),
        "{\"id\":1}\n",
        "topology invoices-b's effect was skipped as a duplicate of orders-a's"
    );
}

/// A secret that is set but unusable (an HTTP URL that does not parse, a header value with a
/// newline) is a configuration error at start-up, not a dead letter for every record; and
/// the error never shows the value.
#[test]
fn preflight_rejects_unusable_http_secrets_without_showing_them() {
    std::env::set_var("REVIEW_BAD_URL", "not a url s3cr3t");
    std::env::set_var("REVIEW_BAD_TOKEN", "Bearer s3cr3t\nX-Evil: 1");
    let mut h = HttpSpec::new(Secret::Env("REVIEW_BAD_URL".into()));
    h.headers.push((
        "Authorization".into(),
        Secret::Env("REVIEW_BAD_TOKEN".into()),
    ));
    let t = topology(
        ExternalSinkSpec::new(EffectSpec::Http(h), StoreSpec::None),
        Format::Json,
    );
    let e = t.preflight().unwrap_err().to_string();
    assert!(e.contains("stage `hook`: field `url`"), "{e}");
    assert!(e.contains("REVIEW_BAD_URL"), "{e}");
    assert!(
        e.contains("stage `hook`: field `headers.Authorization`"),
        "{e}"
    );
    assert!(!e.contains("s3cr3t"), "secret in the error: {e}");
}

/// A `redis` sink whose Redis cannot be reached gives up on the record after its retry
/// window (`store_retry_for`) and dead-letters it, with a reason that does not show the URL's
/// password. (redis-rs's default reconnect backoff kept one record, and so its partition,
/// waiting about eight minutes.)
#[test]
fn an_unreachable_redis_sink_dead_letters_within_its_retry_window() {
    let url = "redis://:s3cr3t@127.0.0.1:1/";
    let mut spec = ExternalSinkSpec::new(
        EffectSpec::Redis(onceflow::RedisSpec {
            url: Secret::Inline(url.into()),
            command: vec!["SET".into(), "k:{value./id}".into(), "{value}".into()],
        }),
        StoreSpec::None,
    )
    .with_key("{value./id}");
    spec.policy.store_retry_for = Duration::from_millis(500);
    let mut d = TestDriver::new(topology(spec, Format::Json));
    let t0 = std::time::Instant::now();
    d.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap();
    d.commit().unwrap();
    let took = t0.elapsed();
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    let reason = String::from_utf8_lossy(header(dl[0], dlq_headers::REASON).unwrap()).into_owned();
    assert!(reason.starts_with("redis: "), "{reason}");
    assert!(!reason.contains("s3cr3t"), "{reason}");
    assert!(
        took < Duration::from_secs(20),
        "one record held its partition for {took:?} with a 500 ms retry window"
    );
}

/// Three orders for the `redis` sink with key `order-{value./id}`.
const ORDERS: [(u32, &str, u32); 3] = [(1, "c:9", 5), (2, "c:7", 7), (3, "c:9", 1)];

fn order(id: u32, customer: &str, amount: u32) -> TestRecord {
    TestRecord::json(format!(
        r#"{{"id":{id},"customer":"{customer}","amount":{amount}}}"#
    ))
}

/// A `redis` sink running `command`, idempotent per order id in a Redis store on `redis`.
fn redis_command_sink(redis: &OwnRedis, command: &[&str]) -> Topology {
    redis_sink_with_store(&redis.url(), command, redis_store(&redis.url()))
}

/// A Redis idempotency store at `url` with key prefix `idem:`.
fn redis_store(url: &str) -> StoreSpec {
    StoreSpec::Redis {
        url: Secret::Inline(url.to_string()),
        prefix: Some("idem:".into()),
    }
}

/// The command of the lost-reply tests: not idempotent.
const INCRBY: [&str; 3] = ["INCRBY", "orders:{value./customer}", "{value./amount}"];

/// Order 1 (INCRBY orders:c:9 by 5) through a proxy that injects `fault` into the INCRBY
/// request, with the idempotency store on the same Redis through the same proxy (same URL).
/// Checks the fault was injected and nothing was dead-lettered.
fn incrby_with_a_same_url_store(fault: Fault) -> (OwnRedis, LossyProxy, TestDriver) {
    let redis = OwnRedis::start();
    let proxy = LossyProxy::start_with(redis.port, b"INCRBY", fault);
    let url = proxy.redis_url();
    let mut d = TestDriver::new(redis_sink_with_store(&url, &INCRBY, redis_store(&url)));
    d.pipe(order(1, "c:9", 5)).unwrap();
    assert_eq!(proxy.cuts(), 1, "the proxy must have injected {fault:?}");
    assert!(d.dead_letters().is_empty(), "{:?}", d.dead_letters());
    (redis, proxy, d)
}

/// Deliver the orders as a crash and a restart would: the first two committed, the third
/// processed and then lost by a crash before its commit, all three redelivered (the broker
/// hands back everything after the committed offset, and a consumer that lost its offsets
/// starts over), then all three again to a fresh instance (a new process on the same input).
/// Returns the outcome headers of every forwarded record, in order, and the result headers;
/// checks the effects counted for the run summary.
fn deliver_twice_with_a_crash(top: impl Fn() -> Topology) -> (Vec<String>, Vec<Vec<u8>>) {
    let mut outcomes = Vec::new();
    let mut results = Vec::new();
    let mut collect = |d: &TestDriver| {
        for r in d.output("out") {
            outcomes.push(String::from_utf8(header(r, OUTCOME_HEADER).unwrap().to_vec()).unwrap());
            results.push(header(r, RESULT_HEADER).unwrap().to_vec());
        }
    };
    let mut d = TestDriver::new(top()).auto_commit(false);
    for (id, c, a) in &ORDERS[..2] {
        d.pipe(order(*id, c, *a)).unwrap();
    }
    d.commit().unwrap();
    let (id, c, a) = ORDERS[2];
    d.pipe(order(id, c, a)).unwrap();
    // Its effect has started; the crash loses the output and the offset, not the effect.
    d.crash();
    for (id, c, a) in ORDERS {
        d.pipe(order(id, c, a)).unwrap();
    }
    d.commit().unwrap();
    collect(&d);
    // Counted when an effect's record is forwarded: 3's effect ran before the crash, its
    // record was lost with it, so the first instance counts 2 done and 3 skipped.
    let c = d.counts();
    assert_eq!(
        (c.effects_done, c.effects_skipped, c.effects_unprotected),
        (2, 3, 0)
    );
    drop(d);
    let mut again = TestDriver::new(top());
    for (id, c, a) in ORDERS {
        again.pipe(order(id, c, a)).unwrap();
    }
    collect(&again);
    let c = again.counts();
    assert_eq!(
        (c.effects_done, c.effects_skipped, c.effects_unprotected),
        (0, 3, 0)
    );
    (outcomes, results)
}

fn redis_conn(redis: &OwnRedis) -> redis::Connection {
    redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap()
}

#[test]
fn redis_hset_runs_once_per_key_across_a_crash_and_a_replay() {
    let redis = OwnRedis::start();
    // `seen_at` records the offset of the delivery that ran the effect: a replayed record
    // that ran HSET again would overwrite it with its later offset.
    let command = [
        "HSET",
        "order:{value./id}",
        "customer",
        "{value./customer}",
        "amount",
        "{value./amount}",
        "seen_at",
        "{offset}",
    ];
    let (outcomes, results) = deliver_twice_with_a_crash(|| redis_command_sink(&redis, &command));
    // Forwarded: 1, 2 done; after the crash (which lost the output of 3, not its effect)
    // 1, 2, 3 redelivered, then 1, 2, 3 on the fresh instance: all skipped.
    assert_eq!(
        outcomes,
        ["done", "done"]
            .into_iter()
            .chain(["skipped_duplicate"; 6])
            .collect::<Vec<_>>()
    );
    // HSET's reply (fields added, 3) is stored and given back to every duplicate.
    assert!(results.iter().all(|r| r == b"3"), "{results:?}");
    let mut c = redis_conn(&redis);
    for (id, customer, amount, seen_at) in [(1, "c:9", 5, 0), (2, "c:7", 7, 1), (3, "c:9", 1, 2)] {
        let h: std::collections::BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(format!("order:{id}"))
            .query(&mut c)
            .unwrap();
        let want: std::collections::BTreeMap<String, String> = [
            ("customer", customer.to_string()),
            ("amount", amount.to_string()),
            ("seen_at", seen_at.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(h, want, "order:{id}");
    }
    let keys: Vec<String> = redis::cmd("KEYS").arg("order:*").query(&mut c).unwrap();
    assert_eq!(keys.len(), 3, "{keys:?}");
}

#[test]
fn redis_xadd_runs_once_per_key_across_a_crash_and_a_replay() {
    let redis = OwnRedis::start();
    let command = [
        "XADD",
        "orders",
        "*",
        "id",
        "{value./id}",
        "amount",
        "{value./amount}",
        "offset",
        "{offset}",
    ];
    let (outcomes, results) = deliver_twice_with_a_crash(|| redis_command_sink(&redis, &command));
    assert_eq!(
        outcomes,
        ["done", "done"]
            .into_iter()
            .chain(["skipped_duplicate"; 6])
            .collect::<Vec<_>>()
    );
    let mut c = redis_conn(&redis);
    // XADD is not idempotent: every extra run would add an entry.
    let len: usize = redis::cmd("XLEN").arg("orders").query(&mut c).unwrap();
    assert_eq!(len, 3);
    type Entry = (String, Vec<(String, String)>);
    let entries: Vec<Entry> = redis::cmd("XRANGE")
        .arg("orders")
        .arg("-")
        .arg("+")
        .query(&mut c)
        .unwrap();
    // Effects of different keys overlap (only same-key effects keep their order), so the
    // entries are compared by order id.
    let mut by_id: std::collections::BTreeMap<String, Entry> = std::collections::BTreeMap::new();
    for e in &entries {
        let id = e.1.iter().find(|(k, _)| k == "id").unwrap().1.clone();
        assert!(
            by_id.insert(id.clone(), e.clone()).is_none(),
            "order {id} added twice"
        );
    }
    let fields: Vec<Vec<(String, String)>> = by_id.values().map(|(_, f)| f.clone()).collect();
    let want: Vec<Vec<(String, String)>> = [(1, 5, 0), (2, 7, 1), (3, 1, 2)]
        .iter()
        .map(|(id, amount, offset)| {
            vec![
                ("id".to_string(), id.to_string()),
                ("amount".to_string(), amount.to_string()),
                ("offset".to_string(), offset.to_string()),
            ]
        })
        .collect();
    assert_eq!(fields, want);
    // The stored result of each effect is its entry ID, given back to its duplicates.
    // Forwarded: 1, 2; after the crash 1, 2, 3; on the fresh instance 1, 2, 3.
    let want_results: Vec<Vec<u8>> = ["1", "2", "1", "2", "3", "1", "2", "3"]
        .iter()
        .map(|id| by_id[*id].0.clone().into_bytes())
        .collect();
    assert_eq!(results, want_results);
}

/// A `redis` sink running `command` through `url`, idempotent per order id in `store`.
fn redis_sink_with_store(url: &str, command: &[&str], store: StoreSpec) -> Topology {
    let spec = ExternalSinkSpec::new(
        EffectSpec::Redis(onceflow::RedisSpec {
            url: Secret::Inline(url.to_string()),
            command: command.iter().map(|s| s.to_string()).collect(),
        }),
        store,
    )
    .with_key("order-{value./id}");
    topology(spec, Format::Json)
}

fn redis_get(redis: &OwnRedis, key: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(key)
        .query(&mut redis_conn(redis))
        .unwrap()
}

/// INCRBY whose reply is lost after Redis ran it, with the idempotency store on the same
/// Redis (same URL): the command and the completed record run in one MULTI/EXEC, so after
/// the lost reply the sink reads the record, finds its own mark and counts the effect done
/// instead of running INCRBY again.
#[test]
fn redis_incrby_with_a_lost_reply_runs_once_in_one_transaction_with_its_store() {
    let (redis, _proxy, mut d) = incrby_with_a_same_url_store(Fault::LoseReply);
    assert_eq!(redis_get(&redis, "orders:c:9").as_deref(), Some("5"));
    // The redelivery is a duplicate; another order runs.
    d.pipe(order(1, "c:9", 5)).unwrap();
    d.pipe(order(2, "c:9", 7)).unwrap();
    assert_eq!(redis_get(&redis, "orders:c:9").as_deref(), Some("12"));
    let outcomes: Vec<&[u8]> = d
        .output("out")
        .iter()
        .map(|r| header(r, OUTCOME_HEADER).unwrap())
        .collect();
    assert_eq!(outcomes, vec![&b"done"[..], b"skipped_duplicate", b"done"]);
    let result = header(d.output("out")[0], RESULT_HEADER).unwrap();
    assert!(
        String::from_utf8_lossy(result).contains("reply was lost"),
        "{result:?}"
    );
    // The completed record holds the result for later duplicates.
    assert!(redis_get(&redis, "idem:order-1").unwrap().starts_with('C'));
}

/// The transaction lost on its way (it never reached Redis): the sink cannot tell this from
/// a lost reply, reads the record, finds no mark of its own and sends the transaction again.
#[test]
fn redis_incrby_transaction_lost_before_redis_is_sent_again() {
    let (redis, _proxy, d) = incrby_with_a_same_url_store(Fault::DropRequest);
    assert_eq!(redis_get(&redis, "orders:c:9").as_deref(), Some("5"));
    assert_eq!(header(d.output("out")[0], RESULT_HEADER), Some(&b"5"[..]));
}

/// INCRBY whose reply is lost, with the idempotency store elsewhere (sled): the sink cannot
/// tell whether it ran and INCRBY is not idempotent, so it is not retried: the record is
/// dead-lettered with a reason naming the command and the unknown outcome, counted as
/// `unknown`, and INCRBY ran at most once.
#[test]
fn redis_incrby_with_a_lost_reply_and_a_store_elsewhere_is_dead_lettered_as_unknown() {
    let redis = OwnRedis::start();
    let proxy = LossyProxy::start(redis.port, b"INCRBY");
    let dir = tempfile::tempdir().unwrap();
    let top = redis_sink_with_store(&proxy.redis_url(), &INCRBY, sled(&dir));
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let d = metrics::with_local_recorder(&recorder, || {
        let mut d = TestDriver::new(top);
        d.pipe(order(1, "c:9", 5)).unwrap();
        d
    });
    assert_eq!(proxy.cuts(), 1);
    assert_eq!(redis_get(&redis, "orders:c:9").as_deref(), Some("5"));
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    let reason = String::from_utf8_lossy(header(dl[0], dlq_headers::REASON).unwrap()).into_owned();
    assert!(
        reason.contains("unknown") && reason.contains("INCRBY"),
        "{reason}"
    );
    let counted = effects_counted(&snapshotter);
    assert_eq!(counted.get("unknown"), Some(&1), "{counted:?}");
    assert_eq!(counted.values().sum::<u64>(), 1, "{counted:?}");
}

/// An idempotent command (HSET) whose reply is lost is retried: running it twice leaves
/// the same hash.
#[test]
fn redis_hset_with_a_lost_reply_is_retried() {
    let redis = OwnRedis::start();
    let proxy = LossyProxy::start(redis.port, b"HSET");
    let dir = tempfile::tempdir().unwrap();
    let top = redis_sink_with_store(
        &proxy.redis_url(),
        &["HSET", "order:{value./id}", "amount", "{value./amount}"],
        sled(&dir),
    );
    let mut d = TestDriver::new(top);
    d.pipe(order(1, "c:9", 5)).unwrap();
    assert_eq!(proxy.cuts(), 1);
    assert!(d.dead_letters().is_empty());
    let amount: Option<String> = redis::cmd("HGET")
        .arg("order:1")
        .arg("amount")
        .query(&mut redis_conn(&redis))
        .unwrap();
    assert_eq!(amount.as_deref(), Some("5"));
    assert_eq!(
        header(d.output("out")[0], OUTCOME_HEADER),
        Some(&b"done"[..])
    );
}

/// A file sink with the default sled store (no path given).
fn file_sink_default_store(out: &std::path::Path) -> Topology {
    let spec = ExternalSinkSpec::new(
        EffectSpec::File(onceflow::FileSpec {
            path: out.to_path_buf(),
            line: "{value}".into(),
        }),
        StoreSpec::Sled { path: None },
    )
    .with_key("{value./id}");
    TopologyBuilder::new("t")
        .source("in", Format::Json)
        .external_sink("file", spec)
        .build()
        .unwrap()
}

/// The default sled store lives in the state dir it is bound to
/// (`<state dir>/idempotency/<application id>`): instances with the same state dir share
/// it, instances with different ones do not; unbound, it refuses to guess a directory and
/// dead-letters the record with the reason.
#[test]
fn the_default_sled_store_lives_in_the_bound_state_dir() {
    let out = tempfile::tempdir().unwrap();
    let lines = out.path().join("lines.jsonl");
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let run = |state: &std::path::Path| {
        let mut d = TestDriver::new(file_sink_default_store(&lines)).state_dir(state);
        d.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap();
        assert!(d.dead_letters().is_empty());
    };
    run(one.path());
    assert!(one.path().join("idempotency/test/conf").exists());
    run(one.path()); // same state dir: a duplicate, skipped
    run(two.path()); // its own store: runs
    assert!(two.path().join("idempotency/test/conf").exists());
    let n = std::fs::read_to_string(&lines).unwrap().lines().count();
    assert_eq!(n, 2, "one line per state dir");
    let mut d = TestDriver::new(file_sink_default_store(&lines));
    d.pipe(TestRecord::json(r#"{"id":2}"#)).unwrap();
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    let reason = String::from_utf8_lossy(header(dl[0], dlq_headers::REASON).unwrap()).into_owned();
    assert!(reason.contains("no state dir"), "{reason}");
}

/// A command that fails inside the transaction (INCRBY on a value that is not a number):
/// MULTI/EXEC does not roll back the completed mark written with it, so the sink takes the
/// mark out again; the record is dead-lettered and its key is free for a later delivery.
#[test]
fn a_redis_command_failing_inside_its_transaction_leaves_no_completed_mark() {
    let redis = OwnRedis::start();
    let _: () = redis::cmd("SET")
        .arg("orders:c:9")
        .arg("not a number")
        .query(&mut redis_conn(&redis))
        .unwrap();
    let top = redis_sink_with_store(&redis.url(), &INCRBY, redis_store(&redis.url()));
    let mut d = TestDriver::new(top);
    d.pipe(order(1, "c:9", 5)).unwrap();
    let dl = d.dead_letters();
    assert_eq!(dl.len(), 1);
    let reason = String::from_utf8_lossy(header(dl[0], dlq_headers::REASON).unwrap()).into_owned();
    assert!(reason.contains("not an integer"), "{reason}");
    assert_eq!(redis_get(&redis, "idem:order-1"), None);
    assert_eq!(
        redis_get(&redis, "orders:c:9").as_deref(),
        Some("not a number")
    );
}

/// The transaction delayed on its way past the sink's reply timeout (10 s): the sink closes
/// the old connection on the server (CLIENT KILL ID) before it reads the record, so the
/// delayed transaction can no longer run when it arrives; it finds no mark, sends the
/// transaction again, and INCRBY runs once. (Reading without closing would find no mark,
/// send again, and the delayed copy would run too.)
#[test]
fn redis_incrby_transaction_delayed_past_the_timeout_runs_once() {
    let (redis, _proxy, d) = incrby_with_a_same_url_store(Fault::Delay(Duration::from_secs(12)));
    assert_eq!(header(d.output("out")[0], RESULT_HEADER), Some(&b"5"[..]));
    // Past the delayed copy's release.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(redis_get(&redis, "orders:c:9").as_deref(), Some("5"));
}

/// A pretty-printed JSON value is one JSON line in a file sink (`{value}` renders JSON on one
/// line): its line breaks, whitespace between tokens, are left out; numbers keep their text.
/// It was dead-lettered for holding a line break (found by a review helper). A string's
/// `\n` escape (two characters) is untouched; a placeholder whose text holds a raw line
/// break is still refused (`a_file_sink_line_with_a_line_break_is_dead_lettered`).
#[test]
fn a_pretty_printed_json_value_is_one_line_in_a_file_sink() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.jsonl");
    let spec = file_by_id(path.clone(), "{value}", &dir);
    let mut d = TestDriver::new(topology(spec, Format::Json));
    d.pipe(TestRecord::json(
        "{\n  \"id\": 1,\r\n  \"n\": 1.50,\n  \"s\": \"a\\nb\"\n}\n",
    ))
    .unwrap();
    assert!(d.dead_letters().is_empty(), "{:?}", d.dead_letters());
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "{  \"id\": 1,  \"n\": 1.50,  \"s\": \"a\\nb\"}\n"
    );
}

/// `{value}` renders a JSON value as read when no stage rewrote it, even after a stage that
/// parsed the tree to read it (a filter on the whole value): numbers keep their digits.
/// After a `map`, it renders the map's result.
#[test]
fn value_placeholder_renders_an_unchanged_json_value_as_read() {
    let dir = tempfile::tempdir().unwrap();
    let line = |name: &str| file_by_id(dir.path().join(name), "{value}", &dir);
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .filter("whole", |r| {
            Ok(r.json.as_ref().is_some_and(|v| v.is_object()))
        })
        .external_sink("read", line("read.jsonl"))
        .map(
            "m",
            onceflow::MapSpec::new().set("/m", |_| Ok(serde_json::Value::Bool(true))),
        )
        .external_sink("mapped", line("mapped.jsonl"))
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    let input = r#"{"id": "a", "n": 18446744073709551617, "x": 1.50}"#;
    d.pipe(TestRecord::json(input)).unwrap();
    assert!(d.dead_letters().is_empty(), "{:?}", d.dead_letters());
    let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
    assert_eq!(read("read.jsonl"), format!("{input}\n"));
    assert_eq!(
        read("mapped.jsonl"),
        "{\"id\":\"a\",\"n\":1.8446744073709552e+19,\"x\":1.5,\"m\":true}\n"
    );
}

/// The driver checks the external sinks as `onceflow run` does at start-up
/// (`Topology::preflight`): a file sink in a missing directory is a config error at the
/// first record, not a dead letter per record.
#[test]
fn the_driver_runs_the_start_up_check_of_external_sinks() {
    let dir = tempfile::tempdir().unwrap();
    let spec = file_by_id(dir.path().join("missing/out.jsonl"), "{value}", &dir);
    let mut d = TestDriver::new(topology(spec, Format::Json));
    let err = d.pipe(TestRecord::json(r#"{"id":1}"#)).unwrap_err();
    assert!(matches!(err, onceflow::Error::Config(_)), "{err}");
    assert!(err.to_string().contains("cannot open"), "{err}");
    assert!(d.dead_letters().is_empty());
    assert!(d.output("out").is_empty());
}
