//! Operating onceflow against the real broker: the HTTP listener (`/health`, `/ready`
//! during and after a restore, `/metrics` with every metric DESIGN.md names), JSON logs,
//! and the example binaries run as processes with their own `ONCEFLOW_EXAMPLE_*` variables.

mod common;

use common::*;
use onceflow_testkit::kafka;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(120);

/// A real HTTP client (reqwest) GET: status and body.
fn get(url: &str) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reqwest::Client::new()
            .get(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .unwrap();
        let code = r.status().as_u16();
        (code, r.text().await.unwrap())
    })
}

/// The address of the listener from the `http listening` log line (tests use port 0).
fn http_address(run: &mut Running) -> String {
    run.wait_for_log("http listening", T);
    let log = run.stderr.lock().unwrap().clone();
    let line = log.lines().find(|l| l.contains("http listening")).unwrap();
    // Text: `address=127.0.0.1:N`; JSON: `"address":"127.0.0.1:N"`.
    let at = match line.find("address=") {
        Some(i) => i + "address=".len(),
        None => line.find("\"address\":\"").expect("address field") + "\"address\":\"".len(),
    };
    line[at..]
        .split(|c: char| c.is_whitespace() || c == '"' || c == ',')
        .find(|s| !s.is_empty())
        .unwrap()
        .to_string()
}

fn run_to_end(names: &Names, sets: &[(&str, String)]) -> String {
    let (st, out) = start(names, sets, &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{out}");
    out
}

fn wait_committed(names: &Names, partitions: usize) {
    let total: i64 = kafka::read_topic(&bootstrap(), &names.input, true, T)
        .unwrap()
        .len() as i64;
    let deadline = Instant::now() + T;
    loop {
        let c =
            kafka::committed_offsets(&bootstrap(), &names.app, &names.input, partitions).unwrap();
        // Committed offsets count every record (and transaction markers under EOS).
        if c.iter().map(|o| o.unwrap_or(0)).sum::<i64>() >= total {
            return;
        }
        assert!(Instant::now() < deadline, "not all committed");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `/ready` is 503 with each restoring store partition's done / total / ETA while a
/// changelog of 15,129 entries is restored (slowed by the `restore.during=delay`
/// failpoint, 250 ms per restore step), then 200; `/health` is 200 throughout.
#[test]
fn ready_reports_restore_progress_then_turns_200() {
    let names = gharchive_names(4);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    onceflow_testkit::gharchive::publish(&p, &names.input, 0, 21).unwrap();
    let out = run_to_end(&names, &[]);
    assert_eq!(summary_field(&out, "passed"), Some(15_129.0), "{out}");
    std::fs::remove_dir_all(names.state_dir()).unwrap();

    let mut run = start(
        &names,
        &[],
        &[("ONCEFLOW_FAILPOINTS", "restore.during=delay")],
        &[],
    );
    let addr = http_address(&mut run);
    let mut progress_bodies = Vec::new();
    let mut ready_at = None;
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        let (code, body) = get(&format!("http://{addr}/ready"));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if code == 200 {
            assert_eq!(v["ready"], true, "{body}");
            assert!(v["restoring"].as_array().unwrap().is_empty(), "{body}");
            assert_eq!(v["assigned"].as_array().unwrap().len(), 4, "{body}");
            ready_at = Some(body);
            break;
        }
        assert_eq!(code, 503, "{body}");
        assert_eq!(v["ready"], false, "{body}");
        if !v["restoring"].as_array().unwrap().is_empty() {
            progress_bodies.push(v);
        }
        let (h, hb) = get(&format!("http://{addr}/health"));
        assert_eq!(h, 200, "healthy while restoring: {hb}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        ready_at.is_some(),
        "never ready:\n{}",
        run.stderr.lock().unwrap()
    );
    assert!(
        !progress_bodies.is_empty(),
        "no 503 with a restoring partition seen before ready"
    );
    let mut totals = std::collections::BTreeMap::new();
    for v in &progress_bodies {
        for r in v["restoring"].as_array().unwrap() {
            assert_eq!(r["store"], "dedup", "{v}");
            let (done, total) = (r["done"].as_u64().unwrap(), r["total"].as_u64().unwrap());
            assert!(total > 0 && done <= total, "{v}");
            assert!(r["eta_seconds"].as_f64().unwrap() >= 0.0, "{v}");
            totals.insert(r["partition"].as_i64().unwrap(), total);
        }
    }
    // Every partition's changelog holds a share of the 15,129 entries (plus markers).
    let seen: u64 = totals.values().sum();
    assert!(seen >= 15_129 / 4, "totals {totals:?}");
    eprintln!(
        "503 bodies with progress: {}; first: {}",
        progress_bodies.len(),
        progress_bodies[0]
    );
    let log = run.stderr.lock().unwrap().clone();
    assert!(
        !log.contains('\u{1b}'),
        "no colour codes when stderr is not a terminal"
    );
    run.signal(libc::SIGTERM);
    let (st, out) = run.wait(T);
    assert!(st.success());
    assert_eq!(summary_field(&out, "restored"), Some(15_129.0), "{out}");
}

/// Every metric DESIGN.md names, scraped from `/metrics` after a run under
/// exactly_once_v2 that restored, deduplicated, dead-lettered and ran external effects:
/// each name with its label set and a plausible value. Logs are JSON lines with the
/// task span's fields.
#[test]
fn metrics_endpoint_serves_every_named_metric_with_its_labels() {
    let effects = tempfile::tempdir().unwrap();
    let lines = effects.path().join("effects.jsonl");
    let yaml = format!(
        r#"name: ops-metrics
source: {{ topic: "{{input}}", format: json }}
stages:
  - dedup: {{ name: dedup, key: {{ json_pointer: /id }}, ttl: 1h, partitioning: source }}
  - file: {{ name: effects, path: "{}", line: "{{value}}", idempotency: {{ key: "{{value./id}}" }} }}
  - sink: {{ topic: "{{output}}" }}
"#,
        lines.display()
    );
    let names = names_for(&yaml, 2);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    let send = |v: &[u8]| {
        p.send(
            &names.input,
            None,
            Some(b"k".as_slice()),
            Some(v),
            &[],
            None,
        )
        .unwrap()
    };
    for i in 0..20 {
        send(format!("{{\"id\":\"e{i}\"}}").as_bytes());
    }
    p.flush().unwrap();
    let eos = [("processing.guarantee", "exactly_once_v2".to_string())];
    run_to_end(&names, &eos);
    std::fs::remove_dir_all(names.state_dir()).unwrap();
    // Second run: restore, then 5 repeats, 5 new ids and 2 records that are not JSON.
    for i in 15..25 {
        send(format!("{{\"id\":\"e{i}\"}}").as_bytes());
    }
    send(b"not json");
    send(b"{\"no_id\": 1}");
    p.flush().unwrap();
    let mut run = start(&names, &eos, &[("ONCEFLOW__LOG__FORMAT", "json")], &[]);
    let addr = http_address(&mut run);
    wait_committed(&names, 2);
    // The state-memory gauges are set at the run loop's first turns after a commit (sled's
    // part at one where no batch is being written): scrape until the 3 parts of both
    // partitions are there (the other metrics are set before the commit).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let (code, text) = loop {
        let (code, text) = get(&format!("http://{addr}/metrics"));
        let series = text
            .lines()
            .filter(|l| l.starts_with("onceflow_state_memory_bytes{"))
            .count();
        if series == 6 || std::time::Instant::now() > deadline {
            break (code, text);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(code, 200);
    let stderr = run.stderr.clone();
    run.signal(libc::SIGTERM);
    let (st, out) = run.wait(T);
    assert!(st.success(), "{out}");

    // (name, labels that must be present with these values, value check)
    let samples: Vec<Sample> = text
        .lines()
        .filter(|l| l.starts_with("onceflow_"))
        .map(parse_sample)
        .collect();
    let find = |name: &str, labels: &[(&str, &str)]| -> Vec<f64> {
        samples
            .iter()
            .filter(|(n, ls, _)| {
                n == name
                    && labels.iter().all(|(k, v)| {
                        ls.iter()
                            .any(|(lk, lv)| lk == k && (v.is_empty() || lv == v))
                    })
            })
            .map(|(_, _, v)| *v)
            .collect()
    };
    let keys_of = |name: &str| -> std::collections::BTreeSet<String> {
        samples
            .iter()
            .filter(|(n, _, _)| n == name)
            .flat_map(|(_, ls, _)| ls.iter().map(|(k, _)| k.clone()))
            .collect()
    };
    let sum = |v: Vec<f64>| v.iter().sum::<f64>();
    let t = [("topology", "ops-metrics")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v: Vec<(&str, &str)> = t.to_vec();
        v.extend_from_slice(extra);
        v
    };
    // onceflow_records_processed_total{topology,stage,result}
    assert_eq!(
        keys_of("onceflow_records_processed_total"),
        ["result", "stage", "topology"].map(String::from).into(),
        "{text}"
    );
    assert_eq!(
        sum(find(
            "onceflow_records_processed_total",
            &with(&[("stage", "dedup"), ("result", "passed")])
        )),
        5.0,
        "{text}"
    );
    assert_eq!(
        sum(find(
            "onceflow_records_processed_total",
            &with(&[("stage", "dedup"), ("result", "duplicate")])
        )),
        5.0,
        "{text}"
    );
    // onceflow_dedup_check_duration_seconds{topology,stage}: a histogram with buckets.
    let count = sum(find(
        "onceflow_dedup_check_duration_seconds_count",
        &with(&[("stage", "dedup")]),
    ));
    assert!(
        count >= 1.0,
        "one decision in 64 is timed, the first included:\n{text}"
    );
    assert!(
        !find(
            "onceflow_dedup_check_duration_seconds_bucket",
            &with(&[("stage", "dedup"), ("le", "")])
        )
        .is_empty(),
        "{text}"
    );
    // onceflow_dedup_keys{topology,store,partition}
    assert_eq!(
        keys_of("onceflow_dedup_keys"),
        ["partition", "store", "topology"].map(String::from).into(),
        "{text}"
    );
    assert_eq!(
        sum(find("onceflow_dedup_keys", &with(&[("store", "dedup")]))),
        25.0,
        "{text}"
    );
    // onceflow_state_memory_bytes{store,partition,part}: every record has key "k", so one
    // partition holds every entry and the other none. The 20 restored ones are in sled's
    // index (12 bytes a key at least); a committed batch is resident; no store was opened
    // over an empty engine with keys leaving memory, so no key filter.
    assert_eq!(
        keys_of("onceflow_state_memory_bytes"),
        ["part", "partition", "store"].map(String::from).into(),
        "{text}"
    );
    let part = |partition: &'static str, p: &'static str| {
        sum(find(
            "onceflow_state_memory_bytes",
            &[("store", "dedup"), ("partition", partition), ("part", p)],
        ))
    };
    let (full, empty) = if part("0", "engine") > 0.0 {
        ("0", "1")
    } else {
        ("1", "0")
    };
    assert!(part(full, "engine") >= 20.0 * 12.0, "{text}");
    assert!(part(full, "resident") > 0.0, "{text}");
    for p in ["0", "1"] {
        assert_eq!(part(p, "key_filter"), 0.0, "{text}");
    }
    assert_eq!(
        part(empty, "engine") + part(empty, "resident"),
        0.0,
        "{text}"
    );
    assert_eq!(
        find("onceflow_state_memory_bytes", &[("store", "dedup")]).len(),
        2 * 3,
        "3 parts of 2 partitions: {text}"
    );
    // onceflow_restore_records_total / onceflow_restore_remaining_records{store,partition}
    for n in [
        "onceflow_restore_records_total",
        "onceflow_restore_remaining_records",
    ] {
        assert_eq!(
            keys_of(n),
            ["partition", "store"].map(String::from).into(),
            "{n}\n{text}"
        );
    }
    assert_eq!(
        sum(find(
            "onceflow_restore_records_total",
            &[("store", "dedup")]
        )),
        20.0,
        "{text}"
    );
    assert_eq!(
        sum(find(
            "onceflow_restore_remaining_records",
            &[("store", "dedup")]
        )),
        0.0
    );
    // onceflow_transactions_total{result}
    assert!(
        sum(find(
            "onceflow_transactions_total",
            &[("result", "committed")]
        )) >= 1.0,
        "{text}"
    );
    // onceflow_sink_effects_total{sink,result} (and topology)
    assert_eq!(
        sum(find(
            "onceflow_sink_effects_total",
            &with(&[("sink", "effects"), ("result", "done")])
        )),
        5.0,
        "{text}"
    );
    // onceflow_dead_letters_total{topology,topic,stage}
    assert_eq!(
        keys_of("onceflow_dead_letters_total"),
        ["stage", "topic", "topology"].map(String::from).into(),
        "{text}"
    );
    assert_eq!(
        sum(find(
            "onceflow_dead_letters_total",
            &with(&[("stage", "source")])
        )),
        1.0,
        "the value that is not JSON\n{text}"
    );
    assert_eq!(
        sum(find(
            "onceflow_dead_letters_total",
            &with(&[("stage", "dedup")])
        )),
        1.0,
        "the record without /id\n{text}"
    );
    assert!(sum(find("onceflow_commits_total", &t)) >= 1.0, "{text}");

    // JSON logs: one object per line, task spans name topology, partition and stores.
    let log = stderr.lock().unwrap().clone();
    let json_lines: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(!json_lines.is_empty(), "{log}");
    assert!(!log.contains('\u{1b}'), "no colour codes off a terminal");
    let restore_line = json_lines
        .iter()
        .find(|v| v["fields"]["message"] == "restore complete")
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(restore_line["span"]["name"], "task", "{restore_line}");
    assert_eq!(
        restore_line["span"]["topology"], "ops-metrics",
        "{restore_line}"
    );
    assert_eq!(restore_line["span"]["stores"], "dedup", "{restore_line}");
    assert!(
        restore_line["span"]["partition"].is_number(),
        "{restore_line}"
    );
}

/// One Prometheus sample: name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

/// `name{k="v",...} value` → (name, labels, value).
fn parse_sample(line: &str) -> Sample {
    let (head, value) = line.rsplit_once(' ').unwrap();
    let value: f64 = value.parse().unwrap_or(f64::NAN);
    match head.split_once('{') {
        None => (head.to_string(), Vec::new(), value),
        Some((name, rest)) => {
            let body = rest.trim_end_matches('}');
            let labels = body
                .split("\",")
                .filter(|s| !s.is_empty())
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_string(), v.trim_matches('"').to_string()))
                })
                .collect();
            (name.to_string(), labels, value)
        }
    }
}

/// A bug that panics the run loop must end the process with a failure, not leave it
/// running: a supervisor restarts a process that exited, but one that hangs keeps its
/// group membership (heartbeats go on) and processes nothing. Unwinding closes the source
/// consumer, and that close used to wait for a rebalance only the gone run loop would
/// have carried out.
#[test]
fn a_panic_in_the_run_loop_ends_the_process_with_a_failure() {
    let names = gharchive_names(1);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    p.send(
        &names.input,
        Some(0),
        None,
        Some(br#"{"id":"1"}"#),
        &[],
        None,
    )
    .unwrap();
    p.flush().unwrap();
    // No --stop-at-end: only the panic ends this run.
    let run = start(
        &names,
        &[],
        &[("ONCEFLOW_FAILPOINTS", "commit.before_flush=panic")],
        &[],
    );
    let log = run.stderr.clone();
    let (st, _) = run.wait(Duration::from_secs(60));
    assert!(!st.success(), "a panic is a failure");
    let log = log.lock().unwrap();
    assert!(
        log.contains("failpoint commit.before_flush: panic"),
        "the panic is the one planted: {log}"
    );
}

/// A source topic that does not exist stops start-up at once with exit 2 (the user's to
/// create or to name right), a message naming the topic, and the hint to fix it, not "a
/// restart resumes from the last commit": a restart alone finds it missing again (exit 1
/// and that hint before; review 10).
#[test]
fn a_missing_source_topic_is_exit_2_naming_the_topic() {
    let names = names_without_topics(
        "name: missing-source\nsource: { topic: \"{input}\", format: json }\nstages:\n  - dedup: { key: { json_pointer: /id } }\n  - sink: { topic: \"{output}\" }\n",
    );
    let (code, log) = run_to_a_refused_start(&names);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!("source topic {} does not exist", names.input)),
        "{log}"
    );
    assert!(log.contains("create it first"), "{log}");
    assert!(!log.contains("a restart resumes"), "{log}");
}

/// Run `names`' topology to the end of a start that is refused: its exit code and its
/// stderr, read to the last line (the hint to start again).
fn run_to_a_refused_start(names: &Names) -> (Option<i32>, String) {
    let run = start(names, &[], &[], &["--stop-at-end"]);
    let log = run.stderr.clone();
    let (st, _) = run.wait(Duration::from_secs(60));
    // The reader of stderr may lag the exit by a moment: wait for the last line (the hint).
    let t0 = Instant::now();
    while !log.lock().unwrap().contains("start again") && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = log.lock().unwrap().clone();
    (st.code(), log)
}

/// A table topic that does not exist stops start-up with exit 2, like a missing source
/// topic, and before anything is created: no sink, dead-letter or changelog topic is left
/// behind by a start that could not run.
#[test]
fn a_missing_table_topic_is_exit_2_before_any_topic_is_created() {
    let names = names_without_topics(
        "name: missing-table\nsource: { topic: \"{input}\", format: json }\ntables:\n  - { name: customers, topic: \"{input}-customers\", format: json }\nstages:\n  - dedup: { key: { json_pointer: /id } }\n  - enrich: { table: customers, key: { json_pointer: /customer } }\n  - sink: { topic: \"{output}\" }\n",
    );
    create_topics(&[&names.input], 2);
    let (code, log) = run_to_a_refused_start(&names);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!(
            "table topic {}-customers of table customers does not exist",
            names.input
        )),
        "{log}"
    );
    let admin = admin();
    let changelog = onceflow::__testkit::changelog_topic(&names.app, "dedup");
    for t in [&names.output, &names.dlq, &changelog] {
        assert_eq!(
            admin.partition_count(t).unwrap(),
            None,
            "{t} was created by a start that stopped on a missing table topic"
        );
    }
    admin.delete_topics(&[&names.input]).unwrap();
}

/// Expected: a table fed by the app itself (the table's topic is also the topic one of its
/// own sinks writes; `check_topic_roles` allows it: only the source, the dead-letter topic
/// and internal topics are refused or warned about) starts on a fresh cluster as it did
/// before the table check: `prepare_topics` creates the missing sink topic, and the table
/// loads it (empty) right after. The table check should skip a table topic that start-up
/// is about to create, or run after the sink topics are created.
///
/// Actual: the new check in `prepare_topics` runs before any topic is created, finds the
/// table's topic (the app's own output) missing and stops start-up with exit 2 ("table
/// topic ... does not exist"): the topology can never start until someone creates its
/// output topic by hand.
#[test]
fn a_table_fed_by_the_apps_own_sink_starts_on_a_fresh_cluster() {
    let names = names_without_topics(
        "name: self-fed-table\nsource: { topic: \"{input}\", format: json }\ntables:\n  - { name: latest, topic: \"{output}\", format: json }\nstages:\n  - enrich: { table: latest, key: { json_pointer: /id }, into: /previous }\n  - sink: { topic: \"{output}\" }\n",
    );
    create_topics(&[&names.input], 2);
    let run = start(&names, &[], &[], &["--stop-at-end"]);
    let log = run.stderr.clone();
    let (st, _) = run.wait(Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    let log = log.lock().unwrap();
    assert!(
        !log.contains("does not exist"),
        "start-up refused the app's own sink topic as a missing table topic: {log}"
    );
    assert!(st.success(), "exit {:?}: {log}", st.code());
    let admin = admin();
    let _ = admin.delete_topics(&[&names.input, &names.output, &names.dlq]);
}
