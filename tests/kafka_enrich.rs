//! Enrichment on the real broker: the table topic (3 partitions) is loaded before any order
//! is joined; a table update changes later joins; a tombstone removes a row; with the state
//! dir kept the table resumes from its stored offsets, and after the state dir is wiped it
//! is restored from the table topic.

mod common;

use common::*;
use onceflow::Config;
use onceflow::KeySource;
use onceflow::{App, RunOptions, RunSummary};
use onceflow::{EnrichSpec, Format, MissingPolicy, TableSpec, Topology, TopologyBuilder};
use onceflow_testkit::kafka::{self, ReadRecord};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Run {
    shutdown: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<onceflow::Result<RunSummary>>,
}

fn start(config: &Config, topology: &Topology) -> Run {
    let shutdown = Arc::new(AtomicBool::new(false));
    let app = App::new(config.clone(), topology.clone());
    let opts = RunOptions {
        stop_at_end: false,
        shutdown: shutdown.clone(),
    };
    Run {
        shutdown,
        thread: std::thread::spawn(move || app.run(opts)),
    }
}

impl Run {
    fn stop(self) -> RunSummary {
        self.shutdown.store(true, Ordering::SeqCst);
        self.thread.join().unwrap().unwrap()
    }
}

/// Read `topic` until it holds `n` records (or fail after 60 s).
fn wait_for(topic: &str, n: usize) -> Vec<ReadRecord> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let recs = kafka::read_topic(&bootstrap(), topic, true, Duration::from_secs(30)).unwrap();
        if recs.len() >= n || Instant::now() > deadline {
            assert_eq!(recs.len(), n, "records in {topic}");
            return recs;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Table topic records applied since the last call (`onceflow_table_records_total`).
fn table_records(snap: &metrics_util::debugging::Snapshotter) -> u64 {
    snap.snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, _, _, _)| k.key().name() == onceflow::metrics::TABLE_RECORDS)
        .map(|(_, _, _, v)| match v {
            metrics_util::debugging::DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}

fn text(r: &ReadRecord) -> String {
    String::from_utf8(r.value.as_deref().unwrap().to_vec()).unwrap()
}

#[test]
fn table_is_loaded_followed_and_restored() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    recorder.install().unwrap();
    let orders = unique("orders");
    let customers = unique("customers");
    let out = unique("enriched");
    let dlq = unique("dlq");
    let app = unique("app");
    let state = tempfile::tempdir().unwrap();
    create_topics(&[&orders, &out, &dlq], 2);
    admin()
        .ensure_topic(&customers, 3, &[("cleanup.policy", "compact")])
        .unwrap();
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    for i in 0..9 {
        let row = format!(r#"{{"name":"cust{i}","tier":"basic"}}"#);
        p.send(
            &customers,
            None,
            Some(format!("c{i}").as_bytes()),
            Some(row.as_bytes()),
            &[],
            None,
        )
        .unwrap();
    }
    // Orders are in the topic before the instance starts: they must all see the table.
    for i in 0..9 {
        let o = format!(r#"{{"order_id":"o{i}","customer_id":"c{i}"}}"#);
        p.send(&orders, Some(i % 2), None, Some(o.as_bytes()), &[], None)
            .unwrap();
    }
    p.flush().unwrap();

    let config = Config::load_with_env(
        &[],
        &[
            ("bootstrap.servers".into(), bootstrap()),
            ("application.id".into(), app.clone()),
            ("state.dir".into(), state.path().display().to_string()),
            ("dlq.topic".into(), dlq.clone()),
            ("commit.interval.ms".into(), "100".into()),
        ],
        std::iter::empty(),
    )
    .unwrap();
    let topology = TopologyBuilder::new("enrich-orders")
        .source(&orders, Format::Json)
        .table(TableSpec::new("customers", &customers))
        .enrich(
            "join",
            EnrichSpec::new(
                "customers",
                KeySource::JsonPointer("/customer_id".into()),
                "/customer",
            )
            .on_missing(MissingPolicy::DeadLetter),
        )
        .sink("out", &out)
        .build()
        .unwrap();

    // 1. Load, then join: every order found its customer.
    let run = start(&config, &topology);
    let got = wait_for(&out, 9);
    let mut joined: Vec<String> = got.iter().map(text).collect();
    joined.sort();
    let want: Vec<String> = (0..9)
        .map(|i| {
            format!(
                r#"{{"order_id":"o{i}","customer_id":"c{i}","customer":{{"name":"cust{i}","tier":"basic"}}}}"#
            )
        })
        .collect();
    assert_eq!(joined, want);

    // 2. An update changes later joins; a tombstone removes the row (the order then goes
    // to the dead-letter topic, the policy here). Orders for c1 are sent until one sees the
    // update; from then on every order sees it.
    p.send(
        &customers,
        None,
        Some(b"c1"),
        Some(br#"{"name":"cust1","tier":"gold"}"#),
        &[],
        None,
    )
    .unwrap();
    p.send(&customers, None, Some(b"c8"), None, &[], None)
        .unwrap();
    p.flush().unwrap();
    let gold = r#"{"order_id":"u","customer_id":"c1","customer":{"name":"cust1","tier":"gold"}}"#;
    let basic = r#"{"order_id":"u","customer_id":"c1","customer":{"name":"cust1","tier":"basic"}}"#;
    let count = |recs: &[ReadRecord], want: &str| recs.iter().filter(|r| text(r) == want).count();
    let mut sent = 9;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        p.send(
            &orders,
            Some(0),
            None,
            Some(br#"{"order_id":"u","customer_id":"c1"}"#),
            &[],
            None,
        )
        .unwrap();
        p.flush().unwrap();
        sent += 1;
        let all = wait_for(&out, sent);
        if count(&all, gold) > 0 {
            assert_eq!(count(&all, gold), 1);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the table update was never applied"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let basics = count(&wait_for(&out, sent), basic);
    for _ in 0..3 {
        p.send(
            &orders,
            Some(1),
            None,
            Some(br#"{"order_id":"u","customer_id":"c1"}"#),
            &[],
            None,
        )
        .unwrap();
    }
    p.send(
        &orders,
        Some(1),
        None,
        Some(br#"{"order_id":"x","customer_id":"c8"}"#),
        &[],
        None,
    )
    .unwrap();
    p.flush().unwrap();
    sent += 3;
    let all = wait_for(&out, sent);
    assert_eq!(count(&all, gold), 4, "every later join sees the update");
    assert_eq!(count(&all, basic), basics);
    let dead = wait_for(&dlq, 1);
    assert_eq!(
        dead[0].header_str("onceflow.dlq.reason").as_deref(),
        Some("no row in table customers for key \"c8\"")
    );
    run.stop();
    // 9 rows loaded, then the update and the tombstone followed.
    assert_eq!(table_records(&snap), 11);

    // 3. State kept: the table's stored offsets are the topic's ends (the next restart
    // resumes there instead of reading the topic again).
    {
        let (offsets, rows) = onceflow::__testkit::read_state(
            &state.path().join(&app),
            "customers",
            None,
            &[b"c8", b"c1"],
        )
        .unwrap();
        let c = kafka::read_topic(&bootstrap(), &customers, true, Duration::from_secs(30)).unwrap();
        let mut ends = std::collections::BTreeMap::new();
        for r in &c {
            ends.insert(r.partition, r.offset + 1);
        }
        assert_eq!(offsets, ends);
        assert!(rows[0].is_none());
        assert_eq!(
            rows[1].as_deref(),
            Some(&br#"{"name":"cust1","tier":"gold"}"#[..])
        );
    }

    // A restart with the state kept resumes from those offsets: no table record is read
    // again, and joins work at once.
    let run = start(&config, &topology);
    p.send(
        &orders,
        Some(0),
        None,
        Some(br#"{"order_id":"k","customer_id":"c2"}"#),
        &[],
        None,
    )
    .unwrap();
    p.flush().unwrap();
    sent += 1;
    let all = wait_for(&out, sent);
    assert_eq!(
        count(
            &all,
            r#"{"order_id":"k","customer_id":"c2","customer":{"name":"cust2","tier":"basic"}}"#
        ),
        1
    );
    run.stop();
    assert_eq!(table_records(&snap), 0);

    // 4. State dir wiped: the table comes back from its topic before the next join.
    std::fs::remove_dir_all(state.path().join(&app)).unwrap();
    let run = start(&config, &topology);
    p.send(
        &orders,
        Some(0),
        None,
        Some(br#"{"order_id":"w","customer_id":"c1"}"#),
        &[],
        None,
    )
    .unwrap();
    p.send(
        &orders,
        Some(1),
        None,
        Some(br#"{"order_id":"w","customer_id":"c5"}"#),
        &[],
        None,
    )
    .unwrap();
    p.flush().unwrap();
    let all = wait_for(&out, sent + 2);
    let mut tail: Vec<String> = all
        .iter()
        .map(text)
        .filter(|t| t.starts_with(r#"{"order_id":"w""#))
        .collect();
    tail.sort();
    assert_eq!(
        tail,
        vec![
            r#"{"order_id":"w","customer_id":"c1","customer":{"name":"cust1","tier":"gold"}}"#,
            r#"{"order_id":"w","customer_id":"c5","customer":{"name":"cust5","tier":"basic"}}"#,
        ]
    );
    run.stop();
    // The whole table topic was read again.
    assert_eq!(table_records(&snap), 11);
}
