//! External sinks against the real broker, PostgreSQL and Redis (addresses from
//! ONCEFLOW_BOOTSTRAP_SERVERS, ONCEFLOW_POSTGRES_URL, ONCEFLOW_REDIS_URL; scripts/test starts
//! all three), with a local HTTP receiver that logs every call and its Idempotency-Key.
//!
//! - the GH Archive data with its duplicates into a postgres sink whose table has no unique
//!   constraint: 15,129 rows; again with a SIGKILL mid-run and a restart: still 15,129;
//! - the same into an http sink with the redis store, killed mid-run: every id reaches the
//!   receiver with a 2xx, a key is sent twice only for effects in flight at the kill, and
//!   then with the same Idempotency-Key;
//! - twins on two instances with a slow receiver, `wait` and `raise`: one effect.

mod common;
mod sink_support;

use common::*;
use onceflow_testkit::{gharchive, kafka};
use sink_support::*;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(240);

fn pg(url: &str) -> (tokio::runtime::Runtime, tokio_postgres::Client) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c
    });
    (rt, client)
}

fn pg_counts(rt: &tokio::runtime::Runtime, c: &tokio_postgres::Client, table: &str) -> (i64, i64) {
    rt.block_on(async {
        let r = c
            .query_one(
                &format!("SELECT count(*), count(DISTINCT id) FROM {table}"),
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    })
}

fn pg_topology(table: &str, inbox: &str) -> String {
    format!(
        r#"name: pg-sink
source: {{ topic: "{{input}}", format: json }}
stages:
  - postgres:
      name: rows
      url: {{ env: ONCEFLOW_POSTGRES_URL }}
      sql: "INSERT INTO {table} (id, type, actor) VALUES ($1, $2, $3::bigint)"
      params: ["{{value./id}}", "{{value./type}}", "{{value./actor/id}}"]
      idempotency: {{ key: "{{value./id}}", store: postgres, table: {inbox} }}
"#
    )
}

fn pg_setup() -> Option<(
    tokio::runtime::Runtime,
    tokio_postgres::Client,
    String,
    Names,
)> {
    let url = postgres_url()?;
    let (rt, c) = pg(&url);
    let table = unique("rows").replace('-', "_");
    let inbox = format!("{table}_inbox");
    rt.block_on(c.batch_execute(&format!(
        "CREATE TABLE {table} (id text, type text, actor bigint)" // no unique constraint
    )))
    .unwrap();
    let names = names_for(&pg_topology(&table, &inbox), 4);
    let rep = gharchive::publish(
        &kafka::TestProducer::new(&bootstrap()).unwrap(),
        &names.input,
        2000,
        7,
    )
    .unwrap();
    assert_eq!(rep.distinct, 15_129);
    assert!(rep.published > rep.distinct);
    Some((rt, c, table, names))
}

#[test]
fn gh_data_into_postgres_gives_one_row_per_id() {
    let Some((rt, c, table, names)) = pg_setup() else {
        return;
    };
    let t0 = Instant::now();
    let (st, out) = start(&names, &[], &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{out}");
    assert_eq!(summary_field(&out, "dead_lettered"), Some(0.0), "{out}");
    assert_eq!(pg_counts(&rt, &c, &table), (15_129, 15_129));
    // The summary counts the effects: one done per id, every repeat skipped, none written
    // to a topic.
    assert_eq!(summary_field(&out, "effects_done"), Some(15_129.0), "{out}");
    assert_eq!(
        summary_field(&out, "effects_skipped"),
        summary_field(&out, "records_in").map(|n| n - 15_129.0),
        "{out}"
    );
    assert_eq!(summary_field(&out, "records_out"), Some(0.0), "{out}");
    eprintln!(
        "postgres sink: 15,129 rows in {:.1}s; {}",
        t0.elapsed().as_secs_f64(),
        out.trim()
    );
}

#[test]
fn gh_data_into_postgres_killed_mid_run_still_one_row_per_id() {
    let Some((rt, c, table, names)) = pg_setup() else {
        return;
    };
    let run = start(
        &names,
        &[
            ("commit.interval.ms", "50".into()),
            ("kafka.session.timeout.ms", "6000".into()),
        ],
        &[],
        &["--stop-at-end"],
    );
    let deadline = Instant::now() + T;
    loop {
        let (n, _) = pg_counts(&rt, &c, &table);
        if n >= 3000 {
            break;
        }
        assert!(Instant::now() < deadline, "no progress: {n} rows");
        std::thread::sleep(Duration::from_millis(20));
    }
    run.signal(libc::SIGKILL);
    let (st, _) = run.wait(T);
    assert!(!st.success(), "killed");
    let at_kill = pg_counts(&rt, &c, &table);
    assert!(
        at_kill.0 < 15_129,
        "the kill must land mid-run: {at_kill:?}"
    );
    let (st, out) = start(&names, &[], &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{out}");
    assert_eq!(pg_counts(&rt, &c, &table), (15_129, 15_129));
    eprintln!(
        "postgres sink killed at {} rows, restarted: 15,129 rows, 15,129 ids; restart {}",
        at_kill.0,
        out.trim()
    );
}

#[test]
fn gh_data_into_http_with_redis_store_each_id_once_unless_killed_in_flight() {
    let Some(_) = redis_url() else { return };
    let rx = Receiver::ok();
    let prefix = unique("gh");
    let yaml = format!(
        r#"name: http-sink
source: {{ topic: "{{input}}", format: json }}
stages:
  - http:
      name: hook
      url: "{url}"
      concurrency: 8
      timeout: 1s
      retries: 1
      idempotency: {{ key: "{{value./id}}", store: redis, url: {{ env: ONCEFLOW_REDIS_URL }}, prefix: "{prefix}:", lease: 5s }}
"#,
        url = rx.url
    );
    let names = names_for(&yaml, 4);
    let rep = gharchive::publish(
        &kafka::TestProducer::new(&bootstrap()).unwrap(),
        &names.input,
        2000,
        7,
    )
    .unwrap();
    let run = start(
        &names,
        &[
            ("commit.interval.ms", "50".into()),
            ("kafka.session.timeout.ms", "6000".into()),
        ],
        &[],
        &["--stop-at-end"],
    );
    let deadline = Instant::now() + T;
    while rx.calls().len() < 4000 {
        assert!(Instant::now() < deadline, "no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    run.signal(libc::SIGKILL);
    let _ = run.wait(T);
    let at_kill = rx.calls().len();
    let (st, out) = start(&names, &[], &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{out}");
    assert_eq!(summary_field(&out, "dead_lettered"), Some(0.0), "{out}");

    let calls = rx.calls();
    // The key sent is the record's id, on every call.
    for c in &calls {
        assert_eq!(
            c.key.as_deref().map(|k| k.to_vec()),
            Some(json_id(Some(&c.body)).into_bytes())
        );
        assert_eq!(c.method, "POST");
        assert_eq!(c.status, 200);
    }
    let mut per: HashMap<Vec<u8>, usize> = HashMap::new();
    for c in &calls {
        *per.entry(c.key.clone().unwrap()).or_default() += 1;
    }
    let ids: HashSet<String> = per
        .keys()
        .map(|k| String::from_utf8(k.clone()).unwrap())
        .collect();
    assert_eq!(
        ids,
        gharchive_distinct_ids(),
        "every distinct id reached the receiver"
    );
    let twice = per.values().filter(|n| **n > 1).count();
    assert!(per.values().all(|n| *n <= 2));
    // Only effects in flight at the kill can repeat: at most concurrency x partitions.
    assert!(twice <= 8 * 4, "{twice} keys sent twice");
    eprintln!(
        "http sink + redis store: {} published, {} distinct ids, {} calls ({} before the kill), {twice} keys sent twice (in flight at the SIGKILL, same Idempotency-Key)",
        rep.published,
        per.len(),
        calls.len(),
        at_kill
    );
}

/// Two instances (two application ids reading two topics), one sink name and one Redis key
/// prefix: the same effect key arrives at both while the receiver takes 3 s a call.
fn twins(in_flight: &str) {
    let Some(_) = redis_url() else { return };
    let rx = Receiver::start(Arc::new(|_, _| (200, Duration::from_secs(3))));
    let prefix = unique("twins");
    let yaml = format!(
        r#"name: twins
source: {{ topic: "{{input}}", format: json }}
stages:
  - http:
      name: hook
      url: "{url}"
      timeout: 10s
      idempotency: {{ key: "{{value./order}}", store: redis, url: {{ env: ONCEFLOW_REDIS_URL }}, prefix: "{prefix}:", in_flight: {in_flight}, wait_timeout: 20s, raise_backoff: 300ms }}
  - sink: {{ topic: "{{output}}" }}
"#,
        url = rx.url
    );
    let a = names_for(&yaml, 1);
    let b = names_for(&yaml, 1);
    let mut ra = start(&a, &[], &[], &[]);
    let mut rb = start(&b, &[], &[], &[]);
    ra.wait_for_log("partitions assigned", T);
    rb.wait_for_log("partitions assigned", T);
    std::thread::sleep(Duration::from_millis(500));
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    p.send(
        &a.input,
        Some(0),
        None,
        Some(br#"{"order":"o-1","from":"a"}"#),
        &[],
        None,
    )
    .unwrap();
    p.flush().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    p.send(
        &b.input,
        Some(0),
        None,
        Some(br#"{"order":"o-1","from":"b"}"#),
        &[],
        None,
    )
    .unwrap();
    p.flush().unwrap();
    let deadline = Instant::now() + T;
    let (oa, ob) = loop {
        let oa = kafka::read_topic(&bootstrap(), &a.output, true, T).unwrap();
        let ob = kafka::read_topic(&bootstrap(), &b.output, true, T).unwrap();
        if !oa.is_empty() && !ob.is_empty() {
            break (oa, ob);
        }
        assert!(
            Instant::now() < deadline,
            "twins did not finish\n--- instance a:\n{}\n--- instance b:\n{}",
            ra.stderr.lock().unwrap(),
            rb.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    if in_flight == "raise" {
        assert!(
            rb.stderr
                .lock()
                .unwrap()
                .contains("effect key in progress elsewhere"),
            "the twin must have raised and been retried"
        );
    }
    ra.signal(libc::SIGTERM);
    rb.signal(libc::SIGTERM);
    let _ = ra.wait(T);
    let _ = rb.wait(T);
    assert_eq!(rx.calls().len(), 1, "one effect for the twins");
    let outcome = |r: &kafka::ReadRecord| r.header_str("onceflow.effect.outcome").unwrap();
    let result = |r: &kafka::ReadRecord| r.header_str("onceflow.effect.result").unwrap();
    assert_eq!(outcome(&oa[0]), "done");
    assert_eq!(outcome(&ob[0]), "skipped_duplicate");
    assert_eq!(
        result(&oa[0]),
        result(&ob[0]),
        "both finish with the same stored result"
    );
    assert_eq!(result(&oa[0]), "200 answer 200 #0");
}

#[test]
fn twins_on_two_instances_wait_for_one_effect() {
    twins("wait");
}

#[test]
fn twins_on_two_instances_raise_then_skip_as_completed() {
    twins("raise");
}

/// The sled idempotency store by default lives in the instance's state dir
/// (`<state.dir>/idempotency/<application.id>`), wherever the process was started: not in
/// its working directory. So it is covered by the state dir's lock, and two instances with
/// different state dirs never share it (a store shared by accident would skip the second
/// instance's effects as duplicates of effects it never made).
#[test]
fn the_default_sled_store_lives_in_the_state_dir_not_the_working_dir() {
    let out = tempfile::tempdir().unwrap();
    let lines = out.path().join("lines.jsonl");
    let yaml = format!(
        r#"name: sled-home
source: {{ topic: "{{input}}", format: json }}
stages:
  - file: {{ name: lines, path: "{}", idempotency: {{ key: "{{value./id}}" }} }}
"#,
        lines.display()
    );
    let names = names_for(&yaml, 1);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    for v in [r#"{"id":"a"}"#, r#"{"id":"b"}"#, r#"{"id":"a"}"#] {
        p.send(&names.input, Some(0), None, Some(v.as_bytes()), &[], None)
            .unwrap();
    }
    p.flush().unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let (st, so) = start_in(Some(cwd.path()), &names, &[], &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{so}");
    assert_eq!(std::fs::read_to_string(&lines).unwrap().lines().count(), 2);
    let home = names.state_dir().join("idempotency").join(&names.app);
    assert!(
        home.join("conf").exists(),
        "no sled database at {}",
        home.display()
    );
    let left: Vec<_> = std::fs::read_dir(cwd.path()).unwrap().collect();
    assert!(
        left.is_empty(),
        "the run wrote into its working dir: {left:?}"
    );
    // A second instance, with its own state dir (and group), from the same working dir:
    // its store is its own, so its effects run.
    let other = tempfile::tempdir().unwrap();
    let (st, so) = start_in(
        Some(cwd.path()),
        &names,
        &[
            ("state.dir", other.path().display().to_string()),
            ("application.id", format!("{}-2", names.app)),
        ],
        &[],
        &["--stop-at-end"],
    )
    .wait(T);
    assert!(st.success(), "{so}");
    assert_eq!(summary_field(&so, "effects_done"), Some(2.0), "{so}");
    assert_eq!(std::fs::read_to_string(&lines).unwrap().lines().count(), 4);
}
