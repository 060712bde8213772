//! Delivery guarantee: exactly_once_v2 recommended (`--set
//! processing.guarantee=exactly_once_v2`): outputs, dedup marks (changelog) and offsets
//! commit in one transaction, so each distinct event reaches the output once. Under the
//! default at_least_once an event may be written twice after a crash, but a dedup mark
//! never stands for an output that was lost.
//!
//! Scenario: analytics events (JSON, topic `analytics.events`) arrive with duplicates from
//! client retries and relays; repeats of an `event_id` within 24 hours (event time) are
//! dropped, first occurrences go to `analytics.unique`.
//!
//! Not here yet: the duplicate side topic (dedup `duplicates_to`) lives on the branch that
//! adds the topology language stages; once merged, this example sends duplicates there.
//!
//! ```text
//! cargo run --release --example analytics_dedup -- --set dlq.topic=analytics.dlq
//! ```

#[path = "deploy_support/mod.rs"]
mod deploy;

use onceflow::processor::key::KeySource;
use onceflow::processor::stages::DedupSpec;
use onceflow::topology::{Format, Topology, TopologyBuilder};

/// Events of `input` deduplicated by `/event_id` over 24 h, written to `output`.
pub fn topology(input: &str, output: &str) -> Topology {
    TopologyBuilder::new("analytics-dedup")
        .source(input, Format::Json)
        .dedup(
            "dedup-events",
            DedupSpec::new(KeySource::JsonPointer("/event_id".into())),
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
    deploy::main(topology(
        &var("ONCEFLOW_EXAMPLE_INPUT", "analytics.events"),
        &var("ONCEFLOW_EXAMPLE_OUTPUT", "analytics.unique"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceflow::testing::{TestDriver, TestRecord};

    #[test]
    fn repeats_within_a_day_are_dropped() {
        let mut d = TestDriver::new(topology("analytics.events", "analytics.unique"));
        let hour = 3_600_000;
        let ev = |id: &str, t: i64| {
            TestRecord::json(format!(r#"{{"event_id":"{id}","t":{t}}}"#)).timestamp(t)
        };
        d.pipe(ev("a", 0)).unwrap();
        d.pipe(ev("b", hour)).unwrap();
        d.pipe(ev("a", 2 * hour)).unwrap(); // retry: dropped
        d.pipe(ev("a", 25 * hour)).unwrap(); // a day later: a new occurrence
        d.pipe(TestRecord::json(r#"{"t":1}"#)).unwrap(); // no key: dead letter
        assert_eq!(
            d.output_values("analytics.unique"),
            vec![
                r#"{"event_id":"a","t":0}"#,
                r#"{"event_id":"b","t":3600000}"#,
                r#"{"event_id":"a","t":90000000}"#,
            ]
        );
        assert_eq!(d.counts().duplicates, 1);
        assert_eq!(d.dead_letters().len(), 1);
    }
}
