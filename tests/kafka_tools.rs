//! The state tools against the real broker, run as a user would: `onceflow state get`,
//! `state dump`, `state seed` and `onceflow reset` as processes of the built binary.

mod common;

use common::*;
use onceflow_testkit::kafka;
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Dedup by the Kafka key, so that tests can use keys that are not UTF-8.
const TOPOLOGY: &str = r#"
name: tools-test
source: { topic: "{input}", format: bytes }
stages:
  - dedup: { name: seen, key: kafka_key, ttl: 1h }
  - sink: { topic: "{output}" }
"#;

/// The same behind a repartition hop.
const HOP: &str = r#"
name: tools-hop
source: { topic: "{input}", format: bytes }
stages:
  - dedup: { name: seen, key: kafka_key, ttl: 1h, partitioning: repartition }
  - sink: { topic: "{output}" }
"#;

const T0: i64 = 1_764_547_200_000; // 2025-12-01T00:00:00Z
const HOUR: i64 = 3_600_000;

/// Run `onceflow <args> <topology> --set ... <rest>`; returns (exit code, stdout, stderr).
fn tool(names: &Names, state_dir: &Path, args: &[&str], rest: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_onceflow"));
    cmd.args(args).arg(&names.topology);
    for (k, v) in [
        ("application.id", names.app.clone()),
        ("state.dir", path_of(state_dir)),
        ("dlq.topic", names.dlq.clone()),
    ] {
        cmd.arg("--set").arg(format!("{k}={v}"));
    }
    cmd.args(rest)
        .env("ONCEFLOW_BOOTSTRAP_SERVERS", bootstrap())
        .env("ONCEFLOW_LOG", "warn");
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_lines(s: &str) -> Vec<Value> {
    s.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Produce (partition, key, timestamp) records with value = key.
fn produce(topic: &str, records: &[(i32, &[u8], i64)]) {
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    for (part, key, ts) in records {
        p.send(topic, Some(*part), Some(key), Some(key), &[], Some(*ts))
            .unwrap();
    }
    p.flush().unwrap();
}

fn run_to_end(names: &Names) -> String {
    let (st, out) = start(names, &[], &[], &["--stop-at-end"]).wait(Duration::from_secs(120));
    assert!(st.success(), "{out}");
    out
}

/// Wait until the group of a stopped instance lists no member (it left on shutdown).
fn wait_group_empty(names: &Names) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (code, stdout, stderr) = tool(names, &names.state_dir(), &["reset"], &["--dry-run"]);
        assert_eq!(code, 0, "{stdout}{stderr}");
        if !stdout.contains("active members") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "members stay: {stdout}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// (partition, key, key_encoding, first_seen_ms, source_partition, source_offset) of an entry.
fn ident(v: &Value) -> (i64, String, String, i64, i64, i64) {
    (
        v["partition"].as_i64().unwrap(),
        v["key"].as_str().unwrap().to_string(),
        v["key_encoding"].as_str().unwrap().to_string(),
        v["first_seen_ms"].as_i64().unwrap(),
        v["source_partition"].as_i64().unwrap(),
        v["source_offset"].as_i64().unwrap(),
    )
}

#[test]
fn state_get_and_dump_answer_from_the_local_store_and_from_the_changelog() {
    let names = names_for(TOPOLOGY, 3);
    let binary: &[u8] = b"\xff\x00a";
    produce(
        &names.input,
        &[
            (0, b"order-1", T0),
            (0, b"order-1", T0 + 5),
            (1, b"order-2", T0 + 1),
            (2, binary, T0 + 2),
            (2, b"order-3", T0 + 3),
        ],
    );
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(4.0), "{out}");
    assert_eq!(summary_field(&out, "duplicates"), Some(1.0), "{out}");
    let state = names.state_dir();
    let empty = tempfile::tempdir().unwrap();

    // Seen: first occurrence (offset 0 of partition 0, time T0), not the duplicate.
    let want = (0, "order-1".to_string(), "utf8".to_string(), T0, 0, 0);
    for (dir, from, read_from_changelog) in [
        (state.as_path(), "local", false),
        (state.as_path(), "changelog", true),
        (state.as_path(), "auto", false),
        (empty.path(), "auto", true), // no local state: the changelog answers
    ] {
        let (code, stdout, stderr) = tool(
            &names,
            dir,
            &["state", "get"],
            &["order-1", "--json", "--from", from],
        );
        assert_eq!(code, 0, "from {from}: {stdout}{stderr}");
        let lines = json_lines(&stdout);
        assert_eq!(lines.len(), 1, "{stdout}");
        let v = &lines[0];
        assert_eq!(ident(v), want, "from {from} in {}: {v}", dir.display());
        assert_eq!(v["seen"], true);
        assert_eq!(v["source_topic"], names.input.as_str());
        assert_eq!(v["store"], "seen");
        assert_eq!(v["seeded"], false);
        assert_eq!(v["expires_at_ms"].as_i64(), Some(T0 + HOUR));
        assert_eq!(v["first_seen"], "2025-12-01T00:00:00.000Z");
        if read_from_changelog {
            assert!(v["changelog_offset"].is_i64(), "from {from}: {v}");
        } else if from == "local" {
            assert!(v["changelog_offset"].is_null(), "{v}");
        }
    }
    // The text form says the same for an operator.
    let (code, stdout, _) = tool(&names, &state, &["state", "get"], &["order-1"]);
    assert_eq!(code, 0);
    assert!(stdout.contains("seen on partition 0"), "{stdout}");
    assert!(
        stdout.contains(&format!("{} partition 0 offset 0", names.input)),
        "{stdout}"
    );
    assert!(
        stdout.contains("2025-12-01T01:00:00.000Z"),
        "expiry: {stdout}"
    );

    // Not seen: exit 1, every partition searched.
    for dir in [state.as_path(), empty.path()] {
        let (code, stdout, stderr) = tool(&names, dir, &["state", "get"], &["order-9", "--json"]);
        assert_eq!(code, 1, "{stdout}{stderr}");
        let v = &json_lines(&stdout)[0];
        assert_eq!(v["seen"], false);
        assert_eq!(v["partitions_searched"], serde_json::json!([0, 1, 2]));
    }

    // A key that is not UTF-8, given in base64, found on partition 2.
    let (code, stdout, stderr) = tool(
        &names,
        empty.path(),
        &["state", "get"],
        &["--key-base64", "/wBh", "--json"],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    let v = &json_lines(&stdout)[0];
    assert_eq!(ident(v), (2, "/wBh".into(), "base64".into(), T0 + 2, 2, 0));
    // A bad base64 key is an error naming it, exit 2.
    let (code, _, stderr) = tool(&names, &state, &["state", "get"], &["--key-base64", "%%%"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("not valid base64"), "{stderr}");

    // Dump: every live entry once, keys as UTF-8 or base64; local and changelog agree.
    let mut dumps = Vec::new();
    for (dir, from) in [
        (state.as_path(), "local"),
        (empty.path(), "changelog"),
        (state.as_path(), "auto"),
    ] {
        let (code, stdout, stderr) = tool(&names, dir, &["state", "dump"], &["--from", from]);
        assert_eq!(code, 0, "{stderr}");
        let mut rows: Vec<_> = json_lines(&stdout).iter().map(ident).collect();
        rows.sort();
        dumps.push(rows);
    }
    assert_eq!(
        dumps[0],
        vec![
            (0, "order-1".into(), "utf8".into(), T0, 0, 0),
            (1, "order-2".into(), "utf8".into(), T0 + 1, 1, 0),
            (2, "/wBh".into(), "base64".into(), T0 + 2, 2, 0),
            (2, "order-3".into(), "utf8".into(), T0 + 3, 2, 1),
        ]
    );
    assert_eq!(dumps[1], dumps[0], "changelog and local store agree");
    assert_eq!(dumps[2], dumps[0]);

    // A stage that does not exist is named in the error.
    let (code, _, stderr) = tool(&names, &state, &["state", "dump"], &["--stage", "nope"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("no dedup stage of that name (dedup stages: seen)"),
        "{stderr}"
    );
}

#[test]
fn state_seed_is_refused_while_instances_run_and_every_later_run_sees_the_seeds() {
    let names = names_for(TOPOLOGY, 2);
    produce(&names.input, &[(0, b"a", T0)]);
    let seeds = names.state.path().join("seeds.txt");
    // One key that is not UTF-8, given as base64 in a second file.
    std::fs::write(&seeds, "seed-1\r\nseed-2\n\na\n").unwrap();
    let seeds64 = names.state.path().join("seeds64.txt");
    std::fs::write(&seeds64, "/w==\n").unwrap();

    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(1.0), "{out}");

    let mut running = start(&names, &[], &[], &[]);
    running.wait_for_log("partitions assigned", Duration::from_secs(60));
    let (code, stdout, stderr) = tool(
        &names,
        &names.state.path().join("other"),
        &["state", "seed"],
        &[seeds.to_str().unwrap()],
    );
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stderr.contains("refusing to seed"), "{stderr}");
    assert!(stderr.contains("active member"), "{stderr}");
    running.signal(libc::SIGTERM);
    let (st, out) = running.wait(Duration::from_secs(60));
    assert!(st.success(), "{out}");
    wait_group_empty(&names);

    // 3 distinct keys x 2 partitions, less "a" on partition 0 where it exists: 5 written.
    let other = names.state.path().join("other");
    let (code, stdout, stderr) = tool(
        &names,
        &other,
        &["state", "seed"],
        &[
            seeds.to_str().unwrap(),
            "--first-seen",
            "2025-12-01T00:30:00Z",
        ],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("keys=3 written=5 kept_existing=1 partitions=0,1"),
        "{stdout}"
    );
    // Again, the same time: every key has its live entry now, nothing is written.
    let (code, stdout, stderr) = tool(
        &names,
        &other,
        &["state", "seed"],
        &[
            seeds.to_str().unwrap(),
            "--first-seen",
            "2025-12-01T00:30:00Z",
        ],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("written=0 kept_existing=6"), "{stdout}");
    let (code, stdout, stderr) = tool(
        &names,
        &other,
        &["state", "seed"],
        &[seeds64.to_str().unwrap(), "--base64", "--partition", "1"],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("written=1 kept_existing=0 partitions=1"),
        "{stdout}"
    );

    let (code, stdout, _) = tool(&names, &other, &["state", "get"], &["seed-1", "--json"]);
    assert_eq!(code, 0);
    let lines = json_lines(&stdout);
    assert_eq!(
        lines
            .iter()
            .map(|v| v["partition"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        vec![0, 1],
        "seeded on every partition: {stdout}"
    );
    for v in &lines {
        assert_eq!(v["seeded"], true);
        assert_eq!(v["source_topic"], Value::Null);
        assert_eq!(v["first_seen_ms"].as_i64(), Some(T0 + HOUR / 2));
    }
    // The instance's own state dir predates the seeds: on disk alone it has not seen them,
    // brought up to date from the changelog (the default) it has.
    let own = names.state_dir();
    let (code, stdout, _) = tool(
        &names,
        &own,
        &["state", "get"],
        &["seed-1", "--from", "local"],
    );
    assert_eq!(code, 1, "{stdout}");
    let (code, stdout, _) = tool(&names, &own, &["state", "get"], &["seed-1", "--json"]);
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(json_lines(&stdout).len(), 2, "{stdout}");
    let (code, stdout, stderr) = tool(&names, &own, &["state", "dump"], &[]);
    assert_eq!(code, 0, "{stderr}");
    let mut rows: Vec<_> = json_lines(&stdout).iter().map(ident).collect();
    rows.sort();
    let s = |p: i64, k: &str, enc: &str| (p, k.to_string(), enc.to_string(), T0 + HOUR / 2, p, -1);
    let mut seeded_rows = vec![
        (0, "a".to_string(), "utf8".to_string(), T0, 0, 0),
        s(0, "seed-1", "utf8"),
        s(0, "seed-2", "utf8"),
        s(1, "a", "utf8"),
        s(1, "seed-1", "utf8"),
        s(1, "seed-2", "utf8"),
    ];
    // The base64 seed was written now, with the default first-seen time.
    let b64: Vec<_> = rows.iter().filter(|r| r.2 == "base64").cloned().collect();
    assert_eq!(b64.len(), 1, "{stdout}");
    assert_eq!((b64[0].0, b64[0].1.as_str(), b64[0].5), (1, "/w==", -1));
    rows.retain(|r| r.2 != "base64");
    seeded_rows.sort();
    assert_eq!(rows, seeded_rows);

    // "a" kept its own entry (source offset 0), not overwritten by the seed.
    let (_, stdout, _) = tool(
        &names,
        &other,
        &["state", "get"],
        &["a", "--json", "--from", "changelog"],
    );
    let a: Vec<_> = json_lines(&stdout).iter().map(ident).collect();
    assert_eq!(a[0], (0, "a".into(), "utf8".into(), T0, 0, 0), "{stdout}");

    // The next run (same state dir, whose checkpoint predates the seeds) restores them:
    // seeded keys are duplicates, on whichever partition they arrive.
    produce(
        &names.input,
        &[
            (1, b"seed-1", T0 + HOUR / 2 + 10),
            (0, b"seed-2", T0 + HOUR / 2 + 20),
            (1, b"\xff", T0 + HOUR / 2 + 30),
            (0, b"\xff", T0 + HOUR / 2 + 40),
            (0, b"b", T0 + HOUR / 2 + 50),
        ],
    );
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "duplicates"), Some(3.0), "{out}");
    assert_eq!(
        summary_field(&out, "passed"),
        Some(2.0),
        "\\xff on partition 0 was not seeded there: {out}"
    );
    let got = output_values(&names);
    assert_eq!(got, vec![b"a".to_vec(), b"b".to_vec(), b"\xff".to_vec()]);
}

#[test]
fn reset_lists_in_a_dry_run_refuses_while_running_and_deletes_topics_offsets_and_local_state() {
    let names = names_for(TOPOLOGY, 2);
    produce(
        &names.input,
        &[(0, b"x", T0), (1, b"y", T0), (1, b"y", T0 + 1)],
    );
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(2.0), "{out}");
    let state = names.state_dir();
    let local = state.join(&names.app);
    let changelog = format!("{}-seen-changelog", names.app);
    assert!(local.is_dir());
    assert_eq!(admin().partition_count(&changelog).unwrap(), Some(2));

    let (code, stdout, stderr) = tool(&names, &state, &["reset"], &["--dry-run"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("dry run"), "{stdout}");
    assert!(stdout.contains(&format!("topic {changelog}")), "{stdout}");
    assert!(
        stdout.contains(&format!("committed offsets on {}: 0=1 1=2", names.input)),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("local state dir {}", local.display())),
        "{stdout}"
    );
    assert_eq!(
        admin().partition_count(&changelog).unwrap(),
        Some(2),
        "a dry run deletes nothing"
    );
    assert!(local.is_dir(), "a dry run deletes nothing");

    // Refused while an instance runs (here from another state dir, as on another machine).
    let mut running = start_in(
        None,
        &names,
        &[("state.dir", path_of(&names.state.path().join("b")))],
        &[],
        &[],
    );
    running.wait_for_log("partitions assigned", Duration::from_secs(60));
    // The running instance holds its state dir: `state get` answers from the changelog,
    // `--from local` says why it cannot.
    let b = names.state.path().join("b");
    let (code, stdout, stderr) = tool(&names, &b, &["state", "get"], &["y", "--json"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let v = &json_lines(&stdout)[0];
    assert_eq!(ident(v), (1, "y".into(), "utf8".into(), T0, 1, 0));
    assert!(v["changelog_offset"].is_i64(), "{v}");
    let (code, _, stderr) = tool(&names, &b, &["state", "get"], &["y", "--from", "local"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("locked by another onceflow process"),
        "{stderr}"
    );

    let (code, stdout, stderr) = tool(&names, &state, &["reset"], &[]);
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stderr.contains("refusing to reset"), "{stderr}");
    assert!(stdout.contains("active members: 1"), "{stdout}");
    assert_eq!(
        admin().partition_count(&changelog).unwrap(),
        Some(2),
        "nothing deleted"
    );
    running.signal(libc::SIGTERM);
    assert!(running.wait(Duration::from_secs(60)).0.success());
    wait_group_empty(&names);

    let (code, stdout, stderr) = tool(&names, &state, &["reset"], &[]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(
        admin().partition_count(&changelog).unwrap(),
        None,
        "changelog deleted"
    );
    assert!(!local.exists(), "local state removed");
    let (_, stdout, _) = tool(&names, &state, &["reset"], &["--dry-run"]);
    assert!(
        stdout.contains(&format!("committed offsets on {}: none", names.input)),
        "{stdout}"
    );

    // Reprocessing from the start: every record again, nothing remembered.
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "records_in"), Some(3.0), "{out}");
    assert_eq!(summary_field(&out, "passed"), Some(2.0), "{out}");
}

/// The values of the output topic read_committed, sorted.
fn output_values(names: &Names) -> Vec<Vec<u8>> {
    let got =
        kafka::read_topic(&bootstrap(), &names.output, true, Duration::from_secs(60)).unwrap();
    let mut got: Vec<Vec<u8>> = got
        .into_iter()
        .map(|r| r.value.map(|b| b.to_vec()).unwrap_or_default())
        .collect();
    got.sort();
    got
}

/// `state seed` of the keys `s1` and `s2` (default first-seen: now) into the default
/// state dir; it must succeed.
fn seed_s1_s2(names: &Names) {
    let seeds = names.state.path().join("seeds.txt");
    std::fs::write(&seeds, "s1\ns2\n").unwrap();
    let (code, stdout, stderr) = tool(
        names,
        &names.state_dir(),
        &["state", "seed"],
        &[seeds.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Seeded entries do not set stream time: seeding (while the instances are stopped, their
/// input lagging the wall clock) must not make the next start's sweep delete the live
/// entries of other keys (their first-seen times made stream time at the wall clock, and a
/// copy within its TTL passed).
#[test]
fn seeding_keys_does_not_sweep_the_live_entries_of_other_keys() {
    let names = names_for(TOPOLOGY, 1);
    // The instance processed events up to 3 h ago, then was stopped.
    let t = now_ms() - 3 * HOUR;
    produce(&names.input, &[(0, b"a", t), (0, b"b", t + 1)]);
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(2.0), "{out}");
    wait_group_empty(&names);

    // While it is down, the operator seeds two known ids (default first-seen: now).
    seed_s1_s2(&names);

    // Restarted, it reads its backlog: the events right after the ones it had done.
    produce(&names.input, &[(0, b"c", t + 2)]);
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(1.0), "{out}");
    wait_group_empty(&names);

    // a is still live for its copies (first seen t, expires t + 1 h): state get says so...
    let (code, stdout, stderr) = tool(
        &names,
        &names.state_dir(),
        &["state", "get"],
        &["a", "--json"],
    );
    let a_seen = code == 0;
    // ... and run drops the copy of a, 3 ms after it.
    produce(&names.input, &[(0, b"a", t + 3)]);
    let out = run_to_end(&names);
    assert!(
        a_seen,
        "state get: key a was forgotten after the seed of s1, s2: {stdout}{stderr}"
    );
    assert_eq!(
        (
            summary_field(&out, "passed"),
            summary_field(&out, "duplicates")
        ),
        (Some(0.0), Some(1.0)),
        "the copy of a passed: {out}"
    );
    let got = output_values(&names);
    assert_eq!(got, vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
}

/// `state seed` replaces an entry that has expired at the seed's first-seen time (first
/// seen 5 h ago, TTL 1 h, not swept yet because stream time has not moved): kept, the key
/// would not be seen and a copy arriving now would pass.
#[test]
fn a_seeded_key_is_seen_even_when_its_old_entry_had_expired() {
    let names = names_for(TOPOLOGY, 1);
    let t0 = now_ms() - 5 * HOUR;
    produce(&names.input, &[(0, b"k", t0)]);
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(1.0), "{out}");
    wait_group_empty(&names);

    let seeds = names.state.path().join("seeds.txt");
    std::fs::write(&seeds, "k\n").unwrap();
    let before = now_ms();
    let (code, stdout, stderr) = tool(
        &names,
        &names.state_dir(),
        &["state", "seed"],
        &[seeds.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    // What the tools say now: k must be seen from the seed on, for an hour.
    let (code, got, stderr) = tool(
        &names,
        &names.state_dir(),
        &["state", "get"],
        &["k", "--json"],
    );
    assert_eq!(code, 0, "{got}{stderr}");
    let v = &json_lines(&got)[0];
    let expires = v["expires_at_ms"].as_i64().unwrap();

    // A copy of k, stamped now (within the hour after the seed).
    produce(&names.input, &[(0, b"k", before + 1000)]);
    let out = run_to_end(&names);
    assert!(
        expires >= before + HOUR,
        "after `state seed` ({stdout}) state get says k expires at {expires}, before the seed at {before}: {got}"
    );
    assert_eq!(
        summary_field(&out, "duplicates"),
        Some(1.0),
        "the copy of the seeded key passed: {out}"
    );
}

/// Records without a timestamp (CreateTime -1) among older events do not set stream time,
/// in the run or after a restart: with the wall clock as their time, the sweep deleted the
/// live entries of the events and the next copy passed (tests/driver_time.rs has the same
/// through the driver).
#[test]
fn records_without_a_timestamp_do_not_sweep_the_live_entries_of_older_events() {
    untimed_records_among_older_events(TOPOLOGY);
}

/// The same behind a repartition hop: the repartition record's stamp (the time it was
/// routed) is not taken for the source record's time.
#[test]
fn records_without_a_timestamp_keep_none_through_a_repartition_hop() {
    untimed_records_among_older_events(HOP);
}

fn untimed_records_among_older_events(topology: &str) {
    let names = names_for(topology, 1);
    let t = now_ms() - 48 * HOUR; // two days old events (a replay, a backlog)
    produce(
        &names.input,
        &[
            (0, b"a", t),
            (0, b"b", t + 1),
            (0, b"n1", -1),
            (0, b"n2", -1),
            (0, b"c", t + 2),
        ],
    );
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(5.0), "{out}");
    wait_group_empty(&names);
    // The next run reads one more event of that time (a commit, and its sweep).
    produce(&names.input, &[(0, b"d", t + 3)]);
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(1.0), "{out}");
    wait_group_empty(&names);
    let (code, got, stderr) = tool(
        &names,
        &names.state_dir(),
        &["state", "get"],
        &["a", "--json"],
    );
    produce(&names.input, &[(0, b"a", t + 4)]); // a copy of a, 4 ms after it
    let out = run_to_end(&names);
    assert_eq!(code, 0, "a's entry (first seen {t}) is gone: {got}{stderr}");
    assert_eq!(
        summary_field(&out, "duplicates"),
        Some(1.0),
        "the copy of a passed: {out}"
    );
}

/// `reset --dry-run` lists the group's committed offsets on every topic it reads, the
/// repartition topic of a dedup with `partitioning: repartition` too (they are deleted
/// with the group).
#[test]
fn a_reset_plan_lists_the_offsets_committed_on_the_repartition_topic() {
    let names = names_for(HOP, 2);
    produce(&names.input, &[(0, b"x", T0), (1, b"x", T0), (1, b"y", T0)]);
    let out = run_to_end(&names);
    assert_eq!(summary_field(&out, "passed"), Some(2.0), "{out}");
    wait_group_empty(&names);
    let (code, stdout, stderr) = tool(&names, &names.state_dir(), &["reset"], &["--dry-run"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let hop = format!("{}-seen-repartition", names.app);
    assert!(stdout.contains(&format!("topic {hop}")), "{stdout}");
    assert!(
        stdout.contains(&format!("committed offsets on {}: 0=1 1=2", names.input)),
        "{stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.contains(&format!("committed offsets on {hop}: ")))
        .unwrap_or_else(|| panic!("no offsets line for {hop}: {stdout}"));
    let total: i64 = line
        .rsplit(": ")
        .next()
        .unwrap()
        .split(' ')
        .map(|po| po.split('=').nth(1).unwrap().parse::<i64>().unwrap())
        .sum();
    assert_eq!(total, 3, "three records routed and committed: {line}");
}

/// `state seed` writes dedup state only: a table the topology reads whose topic does not
/// exist yet does not stop it (a run still stops on it, `kafka_ops`).
#[test]
fn state_seed_does_not_need_the_table_topics() {
    const WITH_TABLE: &str = r#"
name: tools-table
source: { topic: "{input}", format: json }
tables:
  - { name: customers, topic: "{output}-customers", format: json }
stages:
  - dedup: { name: seen, key: kafka_key, ttl: 1h }
  - enrich: { name: join, table: customers, key: { json_pointer: /customer_id }, into: /customer, on_missing: pass }
  - sink: { topic: "{output}" }
"#;
    let names = names_for(WITH_TABLE, 1);
    seed_s1_s2(&names);
    let (code, stdout, stderr) = tool(
        &names,
        &names.state.path().join("fresh"),
        &["state", "get"],
        &["s1", "--json"],
    );
    assert_eq!(
        code, 0,
        "the seeded key is in the changelog: {stdout}{stderr}"
    );
}
