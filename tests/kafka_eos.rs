//! exactly_once_v2 on the real broker: the real data once, upstream aborted transactions
//! ignored, two applications side by side, offsets never ahead of the visible output, and
//! a zombie fenced.

mod common;

use common::*;
use onceflow_testkit::{gharchive, kafka};
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::ClientConfig;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(180);

fn eos(instance: &str) -> Vec<(&'static str, String)> {
    vec![
        ("processing.guarantee", "exactly_once_v2".into()),
        ("instance.id", instance.into()),
        ("kafka.session.timeout.ms", "6000".into()),
    ]
}

fn ids_in(topic: &str, committed: bool) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in kafka::read_topic(&bootstrap(), topic, committed, T).unwrap() {
        *m.entry(json_id(r.value.as_deref())).or_default() += 1;
    }
    m
}

fn assert_exactly_once(topic: &str) {
    let got = ids_in(topic, true);
    let want = gharchive_distinct_ids();
    let dups: Vec<_> = got.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(dups.is_empty(), "duplicates read_committed: {dups:?}");
    assert_eq!(
        got.keys().cloned().collect::<HashSet<_>>(),
        want,
        "every id once"
    );
}

#[test]
fn real_data_exactly_once() {
    let names = gharchive_names(4);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    let rep = gharchive::publish(&p, &names.input, 2000, 21).unwrap();
    let (st, out) = start(&names, &eos("a"), &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{out}");
    assert_eq!(
        summary_field(&out, "records_in"),
        Some(rep.published as f64)
    );
    assert_exactly_once(&names.output);
}

fn transactional_producer(
    txn_id: &str,
    compression: &str,
) -> ThreadedProducer<rdkafka::producer::DefaultProducerContext> {
    let p: ThreadedProducer<_> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("transactional.id", txn_id)
        .set("compression.type", compression)
        .set("linger.ms", "50")
        .create()
        .unwrap();
    p.init_transactions(Duration::from_secs(30)).unwrap();
    p
}

#[test]
fn upstream_aborted_transactions_never_reach_the_state() {
    let yaml = "name: t\nsource: {topic: '{input}', format: json}\nstages:\n  - dedup: {name: dedup, key: {json_pointer: /id}, ttl: 1h, partitioning: source}\n  - sink: {topic: '{output}'}\n";
    let names = names_for(yaml, 1);
    for (codec, tag) in [("lz4", "l"), ("zstd", "z")] {
        let p = transactional_producer(&unique(&format!("upstream-{codec}")), codec);
        let send = |id: &str| {
            let v = format!(r#"{{"id":"{tag}-{id}","pad":"{}"}}"#, "x".repeat(200));
            p.send(
                BaseRecord::<str, str>::to(&names.input)
                    .key("k")
                    .payload(&v),
            )
            .map_err(|(e, _)| e)
            .unwrap();
        };
        p.begin_transaction().unwrap();
        for id in ["x1", "x2", "x3", "x4", "x5"] {
            send(id);
        }
        p.flush(Duration::from_secs(30)).unwrap();
        p.abort_transaction(Duration::from_secs(30)).unwrap();
        p.begin_transaction().unwrap();
        for id in ["x1", "x2", "x3", "y1"] {
            send(id);
        }
        p.commit_transaction(Duration::from_secs(30)).unwrap();
    }
    // The raw topic does hold the aborted records.
    let uncommitted = kafka::read_topic(&bootstrap(), &names.input, false, T)
        .unwrap()
        .len();
    assert_eq!(uncommitted, 18, "5 aborted + 4 committed, twice");
    let (st, out) = start(&names, &eos("a"), &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{out}");
    assert_eq!(summary_field(&out, "records_in"), Some(8.0), "{out}");
    let mut got: Vec<String> = ids_in(&names.output, true).into_keys().collect();
    got.sort();
    assert_eq!(
        got,
        vec!["l-x1", "l-x2", "l-x3", "l-y1", "z-x1", "z-x2", "z-x3", "z-y1"]
    );
    // The dedup state (its changelog) holds no key of an aborted-only record.
    let changelog = format!("{}-dedup-changelog", names.app);
    let keys: HashSet<String> = kafka::read_topic(&bootstrap(), &changelog, true, T)
        .unwrap()
        .iter()
        .map(|r| String::from_utf8(r.key.as_deref().unwrap().to_vec()).unwrap())
        .collect();
    for k in ["l-x4", "l-x5", "z-x4", "z-x5"] {
        assert!(!keys.contains(k), "{k} came from an aborted transaction");
    }
    assert_eq!(keys.len(), 8);
}

/// `--stop-at-end` reads a source partition to its last stable offset (read_committed): a
/// transaction an upstream producer left open past the committed records is not waited for.
#[test]
fn stop_at_end_does_not_wait_for_an_open_upstream_transaction() {
    let yaml = "name: t\nsource: {topic: '{input}', format: json}\nstages:\n  - dedup: {name: dedup, key: {json_pointer: /id}, ttl: 1h, partitioning: source}\n  - sink: {topic: '{output}'}\n";
    let names = names_for(yaml, 2);
    let p: ThreadedProducer<_> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("transactional.id", unique("upstream-open"))
        // Far longer than the instance may take: the broker must not abort it meanwhile.
        .set("transaction.timeout.ms", "600000")
        .create()
        .unwrap();
    p.init_transactions(Duration::from_secs(30)).unwrap();
    let send = |p: &ThreadedProducer<_>, id: &str, partition: i32| {
        let v = format!(r#"{{"id":"{id}"}}"#);
        p.send(
            BaseRecord::<str, str>::to(&names.input)
                .key(id)
                .payload(&v)
                .partition(partition),
        )
        .map_err(|(e, _)| e)
        .unwrap();
    };
    p.begin_transaction().unwrap();
    for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
        send(&p, id, i as i32 % 2);
    }
    p.commit_transaction(Duration::from_secs(30)).unwrap();
    // Left open, its records in the log (past the last stable offset) on one partition.
    p.begin_transaction().unwrap();
    send(&p, "open-1", 0);
    send(&p, "open-2", 0);
    p.flush(Duration::from_secs(30)).unwrap();
    let t0 = Instant::now();
    let (st, out) = start(&names, &eos("a"), &[], &["--stop-at-end"]).wait(Duration::from_secs(60));
    assert!(st.success(), "{out}");
    assert_eq!(summary_field(&out, "records_in"), Some(4.0), "{out}");
    let mut got: Vec<String> = ids_in(&names.output, true).into_keys().collect();
    got.sort();
    assert_eq!(got, vec!["a", "b", "c", "d"]);
    eprintln!("stopped {:.1}s after the start", t0.elapsed().as_secs_f64());
    p.abort_transaction(Duration::from_secs(30)).unwrap();
}

#[test]
fn two_applications_on_one_broker_do_not_fence_each_other() {
    let a = gharchive_names(2);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    gharchive::publish(&p, &a.input, 2000, 22).unwrap();
    // A second application on the same input, same instance id, other application.id.
    let b = Names {
        input: a.input.clone(),
        output: unique("out-b"),
        dlq: unique("dlq-b"),
        app: unique("app-b"),
        state: tempfile::tempdir().unwrap(),
        topology: a.topology.clone(),
    };
    let b_topology = b.state.path().join("t.yaml");
    std::fs::write(
        &b_topology,
        std::fs::read_to_string(&a.topology)
            .unwrap()
            .replace(&a.output, &b.output),
    )
    .unwrap();
    let b = Names {
        topology: b_topology,
        ..b
    };
    create_topics(&[&b.output, &b.dlq], 2);
    let ra = start(&a, &eos("same"), &[], &["--stop-at-end"]);
    let rb = start(&b, &eos("same"), &[], &["--stop-at-end"]);
    let (sa, oa) = ra.wait(T);
    let (sb, ob) = rb.wait(T);
    assert!(sa.success() && sb.success(), "{oa}\n{ob}");
    assert_exactly_once(&a.output);
    assert_exactly_once(&b.output);
}

#[test]
fn committed_offsets_are_never_ahead_of_the_visible_output() {
    let names = gharchive_names(4);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    gharchive::publish(&p, &names.input, 2000, 23).unwrap();
    // First input offset of each id, per partition.
    let input = kafka::read_topic(&bootstrap(), &names.input, true, T).unwrap();
    let mut mut_sets = eos("a");
    mut_sets.push(("kafka.consumer.max.partition.fetch.bytes", "20000".into()));
    let mut run = start(&names, &mut_sets, &[], &["--stop-at-end"]);
    run.wait_for_log("transactions initialised", T);
    let mut checks = 0;
    let started = Instant::now();
    loop {
        let committed =
            kafka::committed_offsets(&bootstrap(), &names.app, &names.input, 4).unwrap();
        let visible: HashSet<String> = ids_in(&names.output, true).into_keys().collect();
        for r in &input {
            if let Some(c) = committed[r.partition as usize] {
                if r.offset < c {
                    let id = json_id(r.value.as_deref());
                    assert!(
                        visible.contains(&id),
                        "offset {} of p{} committed, but {id} not visible",
                        r.offset,
                        r.partition
                    );
                }
            }
        }
        checks += 1;
        if run.child.try_wait().unwrap().is_some() || started.elapsed() > T {
            break;
        }
    }
    let (st, _) = run.wait(T);
    assert!(st.success());
    assert!(
        checks >= 2,
        "checked during the run, not only after it ({checks})"
    );
    assert_exactly_once(&names.output);
}

#[test]
fn a_zombie_is_fenced_and_its_late_writes_never_appear() {
    let names = gharchive_names(2);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    gharchive::publish(&p, &names.input, 2000, 24).unwrap();
    // A long transaction, so the zombie is stopped with one open.
    let mut sets = eos("z");
    sets.push(("commit.interval.ms", "3000".into()));
    sets.push(("kafka.consumer.max.partition.fetch.bytes", "20000".into()));
    let mut zombie = start(&names, &sets, &[], &[]);
    zombie.wait_for_log("transactions initialised", T);
    // Wait until it has written into an open transaction.
    let deadline = Instant::now() + T;
    while kafka::read_topic(&bootstrap(), &names.output, false, T)
        .unwrap()
        .is_empty()
    {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(50));
    }
    zombie.signal(libc::SIGSTOP);
    // The replacement: same instance id (same transactional.id), its own state dir.
    let mut rsets = eos("z");
    rsets.push((
        "state.dir",
        names.state.path().join("replacement").display().to_string(),
    ));
    let replacement = start(&names, &rsets, &[], &["--stop-at-end"]);
    let (st, out) = replacement.wait(T);
    assert!(st.success(), "{out}");
    zombie.signal(libc::SIGCONT);
    let log = zombie.stderr.clone();
    let (st, _) = zombie.wait(T);
    assert!(!st.success(), "the zombie must exit non-zero");
    let log = log.lock().unwrap().clone();
    assert!(
        log.contains("fenced"),
        "the zombie says it was fenced:\n{log}"
    );
    assert_exactly_once(&names.output);
    let all = kafka::read_topic(&bootstrap(), &names.output, false, T)
        .unwrap()
        .len();
    let committed: usize = ids_in(&names.output, true).values().sum();
    eprintln!(
        "zombie: {} records of aborted transactions in the output log",
        all - committed
    );
    assert!(
        all > committed,
        "the zombie's open transaction was aborted, its records stay invisible"
    );
}
