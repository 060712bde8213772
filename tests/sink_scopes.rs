//! Issue 11, item 5: idempotency-key scopes cannot collide. A sink's keys live under
//! `<topology>/<sink>`; with plain concatenation, topology `T` / sink `hook` / key
//! `k/s:order-5` and topology `T/hook:k` / sink `s` / key `order-5` made the same Redis key,
//! and topology `a/b` / sink `c` and topology `a` / sink `b/c` the same sled tree and inbox
//! scope: the second effect was skipped as done. Here: such topology names are refused by
//! `build()`, and the scope itself keeps them apart in sled, Redis and the PostgreSQL inbox.
//! (That the scopes of names `build()` allows are unchanged is a unit test in `src/sink`.)

mod sink_support;

use onceflow::__testkit::key_seen_across_scopes;
use onceflow::{EffectSpec, ExternalSinkSpec, FileSpec, PostgresSpec, Secret, StoreSpec};
use onceflow::{Format, TopologyBuilder};
use sink_support::{postgres_url, redis_url};

/// Two (topology, sink, key) triples that plain concatenation confused.
fn pairs(tag: &str) -> Vec<[(String, String, Vec<u8>); 2]> {
    // Every topology name starts with the run's tag, so runs against the same Redis and
    // PostgreSQL never see each other's keys.
    let t = |s: &str| format!("r{tag}{s}");
    vec![
        [
            (t("T"), "hook".into(), b"k/s:order-5".to_vec()),
            (t("T/hook:k"), "s".into(), b"order-5".to_vec()),
        ],
        [
            (t("a/b"), "c".into(), b"order-5".to_vec()),
            (t("a"), "b/c".into(), b"order-5".to_vec()),
        ],
    ]
}

fn tag() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

#[test]
fn a_topology_name_that_could_forge_a_scope_is_refused() {
    let errs = TopologyBuilder::new("T/hook:k")
        .source("in", Format::Json)
        .sink("out", "out")
        .build()
        .unwrap_err();
    assert_eq!(
        errs.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
        vec!["topology error in topology: field `name`: \"T/hook:k\": use only ASCII letters, digits, '-', '_' and '.' (it scopes the idempotency keys of its sinks, `<topology>/<sink>`)"]
    );
    let e = onceflow::dsl::parse(
        "t.yaml",
        "name: \"T/hook:k\"\nsource: { topic: in }\nstages:\n  - sink: { topic: out }\n",
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        e,
        "t.yaml:1:1: topology, field `name`: \"T/hook:k\": use only ASCII letters, digits, '-', '_' and '.' (it scopes the idempotency keys of its sinks, `<topology>/<sink>`)"
    );
}

/// In `sink`'s idempotency store, the second key of each pair is not seen once the first
/// is completed, each under its own (topology, sink) scope.
fn assert_apart(sink: &ExternalSinkSpec, pairs: Vec<[(String, String, Vec<u8>); 2]>) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    for [(t1, s1, k1), (t2, s2, k2)] in pairs {
        let seen = rt
            .block_on(key_seen_across_scopes(
                sink,
                (&t1, &s1, &k1),
                (&t2, &s2, &k2),
            ))
            .unwrap();
        assert!(!seen, "{t2}/{s2} sees the key completed by {t1}/{s1}");
    }
}

/// A sink keeping its keys in `store`; its effect (a file line) never runs here.
fn with_store(store: StoreSpec) -> ExternalSinkSpec {
    let effect = EffectSpec::File(FileSpec {
        path: "unused".into(),
        line: "{value}".into(),
    });
    ExternalSinkSpec::new(effect, store)
}

#[test]
fn colliding_pairs_stay_apart_in_sled() {
    let dir = tempfile::tempdir().unwrap();
    let sink = with_store(StoreSpec::Sled {
        path: Some(dir.path().to_path_buf()),
    });
    assert_apart(&sink, pairs(""));
}

#[test]
fn colliding_pairs_stay_apart_in_redis() {
    let Some(url) = redis_url() else { return };
    // Each scope's default prefix, `onceflow:<topology>/<sink>:`.
    let sink = with_store(StoreSpec::Redis {
        url: Secret::Inline(url),
        prefix: None,
    });
    assert_apart(&sink, pairs(&tag()));
}

#[test]
fn colliding_pairs_stay_apart_in_the_postgres_inbox() {
    let Some(url) = postgres_url() else { return };
    let table = "onceflow_inbox_scopes".to_string();
    let spec = EffectSpec::Postgres(PostgresSpec::new(Secret::Inline(url), "SELECT 1", vec![]));
    // Each first effect runs (an error otherwise); a second one skipped as a duplicate of
    // it would be a key seen across scopes.
    assert_apart(
        &ExternalSinkSpec::new(spec, StoreSpec::Postgres { table }),
        pairs(&tag()),
    );
}
