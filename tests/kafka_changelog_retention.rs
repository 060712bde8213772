//! Issue 11, item 1, on the real broker: a live entry is always restorable. The changelog
//! keeps every entry the store treats as live whatever the downtime (the broker's
//! time-based deletion never reaches it), and an existing changelog whose settings could
//! delete live entries (created by an older onceflow, or for another TTL) is corrected at
//! start-up.

mod common;

use common::*;
use onceflow_testkit::kafka;
use rdkafka::consumer::{BaseConsumer, Consumer};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(120);
const T0: i64 = 1_420_070_400_000;

fn run_to_end(names: &Names) -> (String, String) {
    let run = start(names, &[], &[], &["--stop-at-end"]);
    let log = run.stderr.clone();
    let (st, out) = run.wait(T);
    let log = log.lock().unwrap().clone();
    assert!(st.success(), "exit {st:?}\n{out}\n{log}");
    (out, log)
}

fn send_ids(names: &Names, ids: &[String], ts: i64) {
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    for id in ids {
        p.send(
            &names.input,
            Some(0),
            None,
            Some(format!(r#"{{"id":"{id}"}}"#).as_bytes()),
            &[],
            Some(ts),
        )
        .unwrap();
    }
    p.flush().unwrap();
}

fn outputs(names: &Names) -> Vec<String> {
    kafka::read_topic(&bootstrap(), &names.output, true, T)
        .unwrap()
        .iter()
        .map(|r| json_id(r.value.as_deref()))
        .collect()
}

fn log_start(client: &BaseConsumer, topic: &str) -> i64 {
    client
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .unwrap()
        .0
}

/// One setting of `topic` as the broker describes it (read with rdkafka directly, not
/// through the code under test).
fn topic_config(topic: &str, name: &str) -> Option<String> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    let client: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    let res = futures::executor::block_on(
        client.describe_configs(&[ResourceSpecifier::Topic(topic)], &AdminOptions::new()),
    )
    .unwrap();
    let resource = res.into_iter().next().unwrap().unwrap();
    resource.get(name).and_then(|e| e.value.clone())
}

/// The issue's scenario: TTL 5 s, grace 0 s, five ids processed; an outage long past
/// TTL + grace in wall-clock time; the state dir lost; the five ids again with their
/// original timestamps. Before the fix the changelog had `cleanup.policy=compact,delete`
/// with `retention.ms` = TTL + grace: the broker emptied it during the outage, the restore
/// found nothing and the five ids passed again (10 outputs).
///
/// The outage lasts until the broker has shown that it deletes by time: a sentinel topic
/// with those old settings, written after the changelog, loses its record (the log
/// cleaner deletes expired segments of `compact,delete` logs in each of its rounds).
#[test]
fn a_live_entry_survives_an_outage_longer_than_ttl_plus_grace() {
    let names = names_for(
        "name: t\nsource: {topic: '{input}', format: json}\nstages:\n  - dedup: {name: dedup, key: {json_pointer: /id}, ttl: 5s, grace: 0s, partitioning: source}\n  - sink: {topic: '{output}'}\n",
        1,
    );
    let ids: Vec<String> = (1..=5).map(|i| format!("id-{i}")).collect();
    send_ids(&names, &ids, T0);
    run_to_end(&names);
    let changelog = format!("{}-dedup-changelog", names.app);

    let sentinel = unique("sentinel");
    admin()
        .ensure_topic(
            &sentinel,
            1,
            &[
                ("cleanup.policy", "compact,delete"),
                ("retention.ms", "5000"),
            ],
        )
        .unwrap();
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    p.send(&sentinel, Some(0), Some(b"k"), Some(b"v"), &[], None)
        .unwrap();
    p.flush().unwrap();
    let client: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    let started = Instant::now();
    while log_start(&client, &sentinel) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the broker deleted nothing by time within 90 s: this broker cannot show the outage"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    std::thread::sleep(Duration::from_secs(2)); // the rest of that cleaner round
    let outage = started.elapsed();
    let start_after_outage = log_start(&client, &changelog);

    std::fs::remove_dir_all(names.state_dir()).unwrap(); // the state dir is lost
    send_ids(&names, &ids, T0);
    let (out, _) = run_to_end(&names);
    let got = outputs(&names);
    assert_eq!(
        got.len(),
        5,
        "5 outputs, not 10; changelog log start after the {outage:?} outage: {start_after_outage}\n{got:?}\n{out}"
    );
    assert_eq!(got, ids);
    assert_eq!(summary_field(&out, "restored"), Some(5.0), "{out}");
    assert_eq!(start_after_outage, 0, "no changelog record deleted");
    admin().delete_topics(&[&sentinel]).unwrap();
}

/// A changelog created with settings that can delete live entries (what an older onceflow
/// created for another TTL: `compact,delete`, `retention.ms` = old TTL + grace) is
/// corrected when the application starts with a new TTL, with a warning naming the
/// setting, the value found and the one expected; the topic's other overrides stay, and
/// its entries still restore.
#[test]
fn a_changelog_made_for_another_ttl_is_corrected_at_start_up() {
    let names = names_for(
        "name: t\nsource: {topic: '{input}', format: json}\nstages:\n  - dedup: {name: dedup, key: {json_pointer: /id}, ttl: 2h, grace: 0s, partitioning: source}\n  - sink: {topic: '{output}'}\n",
        1,
    );
    let changelog = format!("{}-dedup-changelog", names.app);
    let old_retention = (10 * 60 * 1000 + 3600 * 1000).to_string(); // TTL 10m + grace 1h
    admin()
        .ensure_topic(
            &changelog,
            1,
            &[
                ("cleanup.policy", "compact,delete"),
                ("retention.ms", &old_retention),
                ("max.message.bytes", "2000000"),
            ],
        )
        .unwrap();
    let ids: Vec<String> = (1..=3).map(|i| format!("id-{i}")).collect();
    send_ids(&names, &ids, T0);
    let (_, log) = run_to_end(&names);
    assert!(
        log.contains("changelog topic could delete live entries: corrected its configuration")
            && log.contains("cleanup.policy")
            && log.contains("compact,delete (retention.ms=4200000, retention.bytes=-1)"),
        "{log}"
    );
    let get = |k: &str| topic_config(&changelog, k);
    assert_eq!(get("cleanup.policy").as_deref(), Some("compact"));
    assert_eq!(
        get("max.message.bytes").as_deref(),
        Some("2000000"),
        "other overrides kept"
    );

    // A second start finds nothing to correct, and the entries come back after a wipe.
    std::fs::remove_dir_all(names.state_dir()).unwrap();
    send_ids(&names, &ids, T0 + 60_000);
    let (out, log) = run_to_end(&names);
    assert!(!log.contains("corrected its configuration"), "{log}");
    assert_eq!(summary_field(&out, "restored"), Some(3.0), "{out}");
    assert_eq!(outputs(&names), ids);
}

/// Records deleted under a store (here with DeleteRecords, as retention would) cannot be
/// restored: the restore says so with a warning naming the offsets lost, instead of
/// restoring less in silence.
#[test]
fn a_restore_warns_when_changelog_records_were_deleted_under_it() {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::TopicPartitionList;
    let names = names_for(
        "name: t\nsource: {topic: '{input}', format: json}\nstages:\n  - dedup: {name: dedup, key: {json_pointer: /id}, ttl: 1h, partitioning: source}\n  - sink: {topic: '{output}'}\n",
        1,
    );
    // DeleteRecords needs `delete` in the policy: a changelog that never deletes by time or
    // size is accepted with it (and left as it is).
    let changelog = format!("{}-dedup-changelog", names.app);
    admin()
        .ensure_topic(
            &changelog,
            1,
            &[
                ("cleanup.policy", "compact,delete"),
                ("retention.ms", "-1"),
                ("retention.bytes", "-1"),
            ],
        )
        .unwrap();
    let ids: Vec<String> = (1..=3).map(|i| format!("id-{i}")).collect();
    send_ids(&names, &ids, T0);
    let (_, log) = run_to_end(&names);
    assert!(!log.contains("corrected its configuration"), "{log}");
    let client: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&changelog, 0, rdkafka::Offset::Offset(2))
        .unwrap();
    let res =
        futures::executor::block_on(client.delete_records(&tpl, &AdminOptions::new())).unwrap();
    for e in res.elements() {
        e.error().unwrap();
    }
    let watermarks: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    assert_eq!(
        log_start(&watermarks, &changelog),
        2,
        "records 0 and 1 deleted"
    );
    std::fs::remove_dir_all(names.state_dir()).unwrap();
    send_ids(&names, &ids, T0);
    let (out, log) = run_to_end(&names);
    assert!(
        log.contains("changelog records were deleted before this store read them")
            && log.contains("entries written at offsets 0..2 cannot be restored"),
        "{log}"
    );
    assert_eq!(summary_field(&out, "restored"), Some(1.0), "{out}");
    assert_eq!(
        outputs(&names),
        vec!["id-1", "id-2", "id-3", "id-1", "id-2"],
        "the two deleted entries let their duplicates through"
    );
}
