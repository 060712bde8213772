//! Scaling out and in: two, then three instances of one topology, one stopped with SIGTERM
//! or started every few seconds, while the real data and 200,000 synthetic events with
//! duplicates flow. The partitions and their state move; every distinct id comes out
//! exactly once.

mod common;

use common::*;
use onceflow_testkit::{gharchive, kafka};
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(240);

#[test]
fn instances_come_and_go_and_every_id_comes_out_exactly_once() {
    let names = gharchive_names(6);
    let bs = bootstrap();
    // Producer thread: real data first, then synthetic events with 25% repeats, paced so
    // that they flow during the churn.
    let input = names.input.clone();
    let producer = std::thread::spawn(move || {
        let p = kafka::TestProducer::new(&bs).unwrap();
        gharchive::publish(&p, &input, 2000, 3).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        // In the GH Archive hours' era (see SYNTHETIC_EVENT_MS), not the wall clock.
        let now = SYNTHETIC_EVENT_MS;
        let mut distinct = 0u64;
        let mut sent = 0u64;
        let started = Instant::now();
        while sent < 200_000 {
            let id = if distinct > 0 && rng.random_bool(0.25) {
                rng.random_range(0..distinct)
            } else {
                distinct += 1;
                distinct - 1
            };
            let v = format!(r#"{{"id":"syn-{id}","type":"Synthetic","n":{sent}}}"#);
            let key = format!("u{}", id % 1000);
            p.send(
                &input,
                None,
                Some(key.as_bytes()),
                Some(v.as_bytes()),
                &[],
                Some(now),
            )
            .unwrap();
            sent += 1;
            if sent % 10_000 == 0 {
                p.flush().unwrap();
                // ~200k over ~12 s.
                let target = Duration::from_millis(sent * 60 / 1000);
                if let Some(d) = target.checked_sub(started.elapsed()) {
                    std::thread::sleep(d);
                }
            }
        }
        p.flush().unwrap();
        distinct
    });

    let sets = |i: usize| -> Vec<(&'static str, String)> {
        vec![
            (
                "state.dir",
                names
                    .state
                    .path()
                    .join(format!("state-{i}"))
                    .display()
                    .to_string(),
            ),
            ("commit.interval.ms", "200".into()),
            ("kafka.session.timeout.ms", "6000".into()),
        ]
    };
    let mut running: HashMap<usize, Running> = HashMap::new();
    running.insert(0, start(&names, &sets(0), &[], &[]));
    running.insert(1, start(&names, &sets(1), &[], &[]));
    // Two instances, then three, then one stopped or started every 3 s.
    let schedule: [(bool, usize); 7] = [
        (true, 2),
        (false, 0),
        (true, 0),
        (false, 1),
        (false, 2),
        (true, 1),
        (true, 2),
    ];
    let mut events = Vec::new();
    for (start_it, i) in schedule {
        std::thread::sleep(Duration::from_secs(3));
        if start_it {
            running.insert(i, start(&names, &sets(i), &[], &[]));
            events.push(format!("started {i} ({} running)", running.len()));
        } else {
            let r = running.remove(&i).unwrap();
            r.signal(libc::SIGTERM);
            let log = r.stderr.clone();
            let (st, out) = r.wait(T);
            assert!(
                st.success(),
                "instance {i} must stop cleanly on SIGTERM: {st:?}\n{out}\n{}",
                log.lock().unwrap()
            );
            events.push(format!("stopped {i} ({} running)", running.len()));
        }
    }
    eprintln!("churn: {}", events.join("; "));
    let synthetic = producer.join().unwrap();
    if running.is_empty() {
        running.insert(0, start(&names, &sets(0), &[], &[]));
    }
    // Let the survivors finish: everything read_committed in the input is committed.
    let total_in = kafka::read_topic(&bootstrap(), &names.input, true, T)
        .unwrap()
        .len() as i64;
    let deadline = Instant::now() + T;
    loop {
        let c = kafka::committed_offsets(&bootstrap(), &names.app, &names.input, 6).unwrap();
        if c.iter().map(|o| o.unwrap_or(0)).sum::<i64>() >= total_in {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "input not fully committed: {c:?} of {total_in}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    for (_, r) in running.drain() {
        r.signal(libc::SIGTERM);
        assert!(r.wait(T).0.success());
    }

    let mut want: HashSet<String> = gharchive::hour_files()
        .iter()
        .flat_map(|f| gharchive::read_hour(f).unwrap())
        .map(|e| e.id)
        .collect();
    want.extend((0..synthetic).map(|i| format!("syn-{i}")));
    let mut counts: HashMap<String, usize> = HashMap::new();
    for r in kafka::read_topic(&bootstrap(), &names.output, true, T).unwrap() {
        *counts.entry(json_id(r.value.as_deref())).or_default() += 1;
    }
    let repeated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).take(5).collect();
    let missing: Vec<_> = want
        .iter()
        .filter(|id| !counts.contains_key(*id))
        .take(5)
        .collect();
    assert!(
        repeated.is_empty(),
        "ids output more than once, e.g. {repeated:?}"
    );
    assert!(missing.is_empty(), "ids lost, e.g. {missing:?}");
    assert_eq!(counts.len(), want.len());
}
