//! Delivery guarantee: exactly_once_v2 recommended (`--set
//! processing.guarantee=exactly_once_v2`): outputs, duplicates, dedup marks (changelog)
//! and offsets commit in one transaction, so each event reaches exactly one of the two
//! output topics, once. Under the default at_least_once an event may be written twice
//! after a crash, but a dedup mark never stands for an output that was lost.
//!
//! Scenario: analytics events (JSON, topic `analytics.events`) arrive with duplicates from
//! client retries and relays. First occurrences of an `event_id` within 24 hours (event
//! time) go to `analytics.unique`; every repeat goes to the side topic
//! `analytics.duplicates` as it was read (key, value, headers, timestamp) plus the headers
//! `onceflow.duplicate.kind: duplicate` and `onceflow.duplicate.of.partition` /
//! `onceflow.duplicate.of.offset` naming the first occurrence, so duplicate rates can be
//! measured per client. An event without an
//! `event_id` goes to the dead-letter topic with the reason.
//!
//! ```text
//! cargo run --release --example analytics_dedup -- --set dlq.topic=analytics.dlq
//! ```
//!
//! Topic names can be changed with ONCEFLOW_EXAMPLE_INPUT, ONCEFLOW_EXAMPLE_OUTPUT and
//! ONCEFLOW_EXAMPLE_DUPLICATES. The same idea as a file (which also sets the output key
//! and a header): topologies/analytics-dedup.yaml.

use onceflow::KeySource;
use onceflow::{DedupSpec, Partitioning};
use onceflow::{Format, Topology, TopologyBuilder};

/// Events of `input` deduplicated by `/event_id` over 24 h of event time: first
/// occurrences written to `output`, repeats to `duplicates`.
pub fn topology(input: &str, output: &str, duplicates: &str) -> Topology {
    TopologyBuilder::new("analytics-dedup")
        .source(input, Format::Json)
        .dedup(
            "dedup-events",
            DedupSpec::new(KeySource::JsonPointer("/event_id".into()))
                .with_duplicates_to(duplicates)
                // Repartition: clients key events by user or session (or not at all), so
                // copies of one event_id may arrive on different partitions.
                .with_partitioning(Partitioning::Repartition),
        )
        .sink("unique", output)
        .build()
        .unwrap_or_else(|errors| {
            for e in errors {
                eprintln!("{e}");
            }
            std::process::exit(2)
        })
}

fn main() -> std::process::ExitCode {
    let var = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    onceflow::deploy::main(topology(
        &var("ONCEFLOW_EXAMPLE_INPUT", "analytics.events"),
        &var("ONCEFLOW_EXAMPLE_OUTPUT", "analytics.unique"),
        &var("ONCEFLOW_EXAMPLE_DUPLICATES", "analytics.duplicates"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceflow::headers::dlq_headers;
    use onceflow::headers::{DUPLICATE_KIND, DUPLICATE_OF_OFFSET, DUPLICATE_OF_PARTITION};
    use onceflow::{TestDriver, TestRecord};

    /// A header's value as text (`None` when absent or null).
    fn header<'a>(h: &'a [(String, Option<bytes::Bytes>)], name: &str) -> Option<&'a str> {
        h.iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.as_deref())
            .map(|b| std::str::from_utf8(b).unwrap())
    }

    #[test]
    fn repeats_within_a_day_go_to_the_duplicate_topic() {
        let mut d = TestDriver::new(topology(
            "analytics.events",
            "analytics.unique",
            "analytics.duplicates",
        ));
        let hour = 3_600_000;
        let ev = |id: &str, t: i64| {
            TestRecord::json(format!(r#"{{"event_id":"{id}","t":{t}}}"#)).timestamp(t)
        };
        d.pipe(ev("a", 0)).unwrap(); // offset 0
        d.pipe(ev("b", hour)).unwrap(); // offset 1
        d.pipe(ev("a", 2 * hour).key("client-7").header("relay", "r2"))
            .unwrap(); // offset 2: a retry of offset 0
        d.pipe(ev("a", 25 * hour)).unwrap(); // offset 3: a day later, a new occurrence
        d.pipe(ev("b", 3 * hour)).unwrap(); // offset 4: a repeat of offset 1
        d.pipe(ev("a", 26 * hour)).unwrap(); // offset 5: a repeat of offset 3
        d.pipe(TestRecord::json(r#"{"t":1}"#)).unwrap(); // offset 6: no key, dead letter
        assert_eq!(
            d.output_values("analytics.unique"),
            vec![
                r#"{"event_id":"a","t":0}"#,
                r#"{"event_id":"b","t":3600000}"#,
                r#"{"event_id":"a","t":90000000}"#,
            ]
        );
        // Each duplicate exactly as read, plus the position of its first occurrence.
        type Side = (Option<String>, String, Option<i64>, Vec<(String, String)>);
        let side: Vec<Side> = d
            .output("analytics.duplicates")
            .iter()
            .map(|r| {
                (
                    r.key
                        .as_deref()
                        .map(|k| String::from_utf8(k.to_vec()).unwrap()),
                    String::from_utf8(r.value.as_deref().unwrap().to_vec()).unwrap(),
                    r.timestamp,
                    r.headers
                        .iter()
                        .map(|(k, v)| {
                            let v = std::str::from_utf8(v.as_deref().unwrap()).unwrap();
                            (k.clone(), v.to_string())
                        })
                        .collect(),
                )
            })
            .collect();
        // Read back from the repartition topic: keyed by the event id, with the headers as
        // the source had them (the hop's source header is taken off again) plus the
        // position of the first occurrence.
        let of = |first: &str| {
            vec![
                (DUPLICATE_KIND.to_string(), "duplicate".to_string()),
                (DUPLICATE_OF_PARTITION.to_string(), "0".to_string()),
                (DUPLICATE_OF_OFFSET.to_string(), first.to_string()),
            ]
        };
        let mut first = vec![("relay".to_string(), "r2".to_string())];
        first.extend(of("0"));
        assert_eq!(
            side,
            vec![
                (
                    Some("a".to_string()),
                    r#"{"event_id":"a","t":7200000}"#.to_string(),
                    Some(2 * hour),
                    first,
                ),
                (
                    Some("b".to_string()),
                    r#"{"event_id":"b","t":10800000}"#.to_string(),
                    Some(3 * hour),
                    of("1"),
                ),
                (
                    Some("a".to_string()),
                    r#"{"event_id":"a","t":93600000}"#.to_string(),
                    Some(26 * hour),
                    of("3"),
                ),
            ]
        );
        assert_eq!(d.counts().duplicates, 3);
        let dl = d.dead_letters();
        assert_eq!(dl.len(), 1);
        assert_eq!(dl[0].value.as_deref(), Some(&br#"{"t":1}"#[..]));
        assert_eq!(
            header(&dl[0].headers, dlq_headers::REASON),
            Some("key field /event_id is missing")
        );
        assert_eq!(
            header(&dl[0].headers, dlq_headers::STAGE),
            Some("dedup-events")
        );
    }
}
