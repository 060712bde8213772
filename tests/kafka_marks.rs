//! Failed effects leave no mark (issue 11, item 4), against the real broker, under
//! at_least_once and exactly_once_v2: an HTTP sink with `retries: 0` behind a dedup stage;
//! the receiver answers 503 once for id-03, which is dead-lettered; id-03 delivered again
//! (after the state dir was lost, so the dedup state comes back from the changelog) gets
//! exactly one 2xx, while id-02 delivered again stays a duplicate.

mod common;
mod sink_support;

use common::*;
use onceflow_testkit::kafka;
use sink_support::*;
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(180);

fn scenario(guarantee: &str) {
    let rx = Receiver::start(Arc::new(|k, n| {
        if k == Some(&b"id-03"[..]) && n == 0 {
            (503, Duration::ZERO)
        } else {
            (200, Duration::ZERO)
        }
    }));
    let yaml = format!(
        r#"name: marks
source: {{ topic: "{{input}}", format: json }}
stages:
  - dedup: {{ name: seen, key: {{ json_pointer: /id }}, ttl: 24h, partitioning: source }}
  - http:
      name: hook
      url: "{url}"
      retries: 0
      timeout: 5s
"#,
        url = rx.url
    );
    let names = names_for(&yaml, 1);
    let p = kafka::TestProducer::new(&bootstrap()).unwrap();
    let send = |id: &str, ts: i64| {
        p.send(
            &names.input,
            Some(0),
            Some(id.as_bytes()),
            Some(format!(r#"{{"id":"{id}"}}"#).as_bytes()),
            &[],
            Some(ts),
        )
        .unwrap();
        p.flush().unwrap();
    };
    let t0 = 1_700_000_000_000;
    for (i, id) in ["id-01", "id-02", "id-03", "id-04", "id-05"]
        .iter()
        .enumerate()
    {
        send(id, t0 + i as i64);
    }
    let sets = [("processing.guarantee", guarantee.to_string())];
    let (st, out) = start(&names, &sets, &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{out}");
    assert_eq!(summary_field(&out, "dead_lettered"), Some(1.0), "{out}");
    assert_eq!(summary_field(&out, "effects_done"), Some(4.0), "{out}");

    // The state dir is lost: the next run restores the dedup store from its changelog.
    std::fs::remove_dir_all(names.state_dir()).unwrap();
    send("id-02", t0 + 10);
    send("id-03", t0 + 11);
    let (st, out) = start(&names, &sets, &[], &["--stop-at-end"]).wait(T);
    assert!(st.success(), "{out}");
    assert_eq!(summary_field(&out, "duplicates"), Some(1.0), "{out}");
    assert_eq!(summary_field(&out, "effects_done"), Some(1.0), "{out}");

    let per = rx.per_key();
    let oks = |id: &str| {
        per.get(id.as_bytes())
            .map_or(0, |s| s.iter().filter(|s| (200..300).contains(*s)).count())
    };
    for id in ["id-01", "id-02", "id-03", "id-04", "id-05"] {
        assert_eq!(oks(id), 1, "{guarantee}: one 2xx for {id}: {per:?}");
    }
    assert_eq!(per[&b"id-03".to_vec()], vec![503, 200], "{guarantee}");
    let dl = kafka::read_topic(&bootstrap(), &names.dlq, true, T).unwrap();
    assert_eq!(dl.len(), 1, "{guarantee}");
    assert_eq!(json_id(dl[0].value.as_deref()), "id-03");
    // The changelog holds one mark per id: none for the failed delivery.
    let changelog = format!("{}-seen-changelog", names.app);
    let marks = kafka::read_topic(&bootstrap(), &changelog, true, T).unwrap();
    let mut keys: Vec<String> = marks
        .iter()
        .filter(|r| r.value.is_some())
        .map(|r| String::from_utf8_lossy(r.key.as_deref().unwrap_or_default()).into_owned())
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        vec!["id-01", "id-02", "id-03", "id-04", "id-05"],
        "{guarantee}"
    );
    eprintln!(
        "{guarantee}: calls per id {:?}; changelog {} records",
        {
            let mut v: Vec<(String, Vec<u16>)> = per
                .iter()
                .map(|(k, s)| (String::from_utf8_lossy(k).into_owned(), s.clone()))
                .collect();
            v.sort();
            v
        },
        marks.len()
    );
}

#[test]
fn a_dead_lettered_effect_runs_on_redelivery_at_least_once() {
    scenario("at_least_once");
}

#[test]
fn a_dead_lettered_effect_runs_on_redelivery_exactly_once_v2() {
    scenario("exactly_once_v2");
}

/// A record that grows past the producer's `message.max.bytes` in a stage (here a map
/// that copies a field twice, with the limit lowered to 1,500 bytes) is dead-lettered
/// with its source coordinates and the reason; the instance keeps running, its mark is
/// withdrawn, and the records around it come out. Before, the send failed and the
/// instance exited non-zero, again at every restart.
#[test]
fn a_record_too_large_for_the_producer_is_dead_lettered_not_a_stop() {
    for guarantee in ["at_least_once", "exactly_once_v2"] {
        let yaml = r#"name: big
source: { topic: "{input}", format: json }
stages:
  - dedup: { name: seen, key: { json_pointer: /id }, ttl: 24h, partitioning: source }
  - map: { name: grow, set: { copy1: value.pad, copy2: value.pad } }
  - sink: { topic: "{output}" }
"#;
        let names = names_for(yaml, 1);
        let p = kafka::TestProducer::new(&bootstrap()).unwrap();
        let send = |id: &str, pad: usize| {
            let v = format!(r#"{{"id":"{id}","pad":"{}"}}"#, "x".repeat(pad));
            p.send(&names.input, Some(0), None, Some(v.as_bytes()), &[], None)
                .unwrap();
        };
        send("a", 10);
        send("big", 600); // ~1,850 bytes after the map
        send("b", 10);
        send("big", 10); // the redelivery, small: passes (the mark was withdrawn)
        p.flush().unwrap();
        let sets = [
            ("processing.guarantee", guarantee.to_string()),
            ("kafka.producer.message.max.bytes", "1500".to_string()),
        ];
        let run = start(&names, &sets, &[], &["--stop-at-end"]);
        let log = run.stderr.clone();
        let (st, out) = run.wait(T);
        let log = log.lock().unwrap().clone();
        assert!(st.success(), "{guarantee}: exit {st:?}\n{out}\n{log}");
        let ids: Vec<String> = kafka::read_topic(&bootstrap(), &names.output, true, T)
            .unwrap()
            .iter()
            .map(|r| json_id(r.value.as_deref()))
            .collect();
        assert_eq!(ids, ["a", "b", "big"], "{guarantee}");
        let dead = kafka::read_topic(&bootstrap(), &names.dlq, true, T).unwrap();
        assert_eq!(dead.len(), 1, "{guarantee}");
        let header = |k: &str| {
            dead[0]
                .headers
                .iter()
                .find(|(n, _)| n == k)
                .and_then(|(_, v)| v.clone())
                .map(|v| String::from_utf8_lossy(&v).into_owned())
        };
        assert_eq!(header("onceflow.dlq.source.offset").as_deref(), Some("1"));
        assert!(
            header("onceflow.dlq.reason").is_some_and(|r| r.contains("message.max.bytes")),
            "{guarantee}: {:?}",
            header("onceflow.dlq.reason")
        );
    }
}
