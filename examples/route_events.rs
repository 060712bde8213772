//! Delivery guarantee: at_least_once by default (an event may be written twice after a
//! crash, never lost); run with `--set processing.guarantee=exactly_once_v2` for exactly
//! once into Kafka: each event then lands on exactly one topic (or the dead-letter topic),
//! once.
//!
//! Scenario: GitHub Archive events (JSON, topic `gharchive.events`) routed to one topic per
//! event type. Each event is slimmed first (repository and actor names lifted to the top
//! level as `repo_name` and `actor_login`, the bulky `payload` and `org` dropped), then
//! written to the topic of its type: `PushEvent` to `gharchive.pushes`, `IssuesEvent` and
//! `IssueCommentEvent` to `gharchive.issues`, `PullRequest*` to `gharchive.pull-requests`,
//! any other type to `gharchive.other`. An event that is not a JSON object, lacks a repo or
//! actor name, or has no string `type` goes to the dead-letter topic with the reason.
//!
//! ```text
//! cargo run --release --example route_events -- --set dlq.topic=gharchive.dlq
//! ```
//!
//! The input topic can be changed with ONCEFLOW_EXAMPLE_INPUT and the output topics'
//! common prefix (default `gharchive.`) with ONCEFLOW_EXAMPLE_PREFIX. The same topology as
//! a file, with CEL expressions where this uses closures:
//! topologies/routing-by-event-type.yaml.

use onceflow::MapSpec;
use onceflow::Record;
use onceflow::RouteSpec;
use onceflow::{Format, Topology, TopologyBuilder};
use serde_json::Value;

/// The string at JSON pointer `ptr` of the record's value.
///
/// # Errors
/// The field is missing or not a string (the record is then dead-lettered).
fn text<'r>(r: &'r Record, ptr: &str) -> Result<&'r str, String> {
    match r.json.as_ref().and_then(|v| v.pointer(ptr)) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(format!("{ptr} is not a string: {other}")),
        None => Err(format!("{ptr} is missing")),
    }
}

/// Events of `input` slimmed and routed by type to `<prefix>pushes`, `<prefix>issues`,
/// `<prefix>pull-requests`, or by default `<prefix>other`.
pub fn topology(input: &str, prefix: &str) -> Topology {
    TopologyBuilder::new("route-events")
        .source(input, Format::Json)
        .map(
            "slim",
            MapSpec::new()
                .set("/repo_name", |r| text(r, "/repo/name").map(Value::from))
                .set("/actor_login", |r| text(r, "/actor/login").map(Value::from))
                .drop_field("/payload")
                .drop_field("/org"),
        )
        .route(
            "by-type",
            RouteSpec::new()
                .when(
                    |r| text(r, "/type").map(|t| t == "PushEvent"),
                    format!("{prefix}pushes"),
                )
                .when(
                    |r| text(r, "/type").map(|t| t == "IssuesEvent" || t == "IssueCommentEvent"),
                    format!("{prefix}issues"),
                )
                .when(
                    |r| text(r, "/type").map(|t| t.starts_with("PullRequest")),
                    format!("{prefix}pull-requests"),
                )
                .default_topic(format!("{prefix}other")),
        )
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
        &var("ONCEFLOW_EXAMPLE_INPUT", "gharchive.events"),
        &var("ONCEFLOW_EXAMPLE_PREFIX", "gharchive."),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceflow::headers::dlq_headers;
    use onceflow::{TestDriver, TestRecord};

    /// A header's value as text (`None` when absent or null).
    fn header<'a>(h: &'a [(String, Option<bytes::Bytes>)], name: &str) -> Option<&'a str> {
        h.iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.as_deref())
            .map(|b| std::str::from_utf8(b).unwrap())
    }

    fn event(ty: &str, n: u32) -> String {
        format!(
            r#"{{"id":"{n}","type":"{ty}","actor":{{"login":"ann"}},"repo":{{"name":"r/x"}},"payload":{{"size":3}},"org":{{"id":1}}}}"#
        )
    }

    fn slim(ty: &str, n: u32) -> String {
        format!(
            r#"{{"id":"{n}","type":"{ty}","actor":{{"login":"ann"}},"repo":{{"name":"r/x"}},"repo_name":"r/x","actor_login":"ann"}}"#
        )
    }

    #[test]
    fn events_go_to_the_topic_of_their_type() {
        let mut d = TestDriver::new(topology("gharchive.events", "gharchive."));
        let types = [
            "PushEvent",
            "IssuesEvent",
            "PullRequestReviewCommentEvent",
            "WatchEvent",
            "IssueCommentEvent",
            "PullRequestEvent",
            "ForkEvent",
        ];
        for (n, ty) in types.iter().enumerate() {
            d.pipe(TestRecord::json(event(ty, n as u32)).key(format!("k{n}")))
                .unwrap();
        }
        // Records that fail: no repo (map), a type that is not a string (route), not JSON
        // (source).
        let no_repo = r#"{"id":"7","type":"PushEvent","actor":{"login":"x"}}"#;
        let numeric_type = r#"{"id":"8","type":42,"actor":{"login":"x"},"repo":{"name":"r/y"}}"#;
        d.pipe(TestRecord::json(no_repo)).unwrap();
        d.pipe(TestRecord::json(numeric_type)).unwrap();
        d.pipe(TestRecord::json("not json")).unwrap();

        assert_eq!(d.output_values("gharchive.pushes"), [slim("PushEvent", 0)]);
        assert_eq!(
            d.output_values("gharchive.issues"),
            [slim("IssuesEvent", 1), slim("IssueCommentEvent", 4)]
        );
        assert_eq!(
            d.output_values("gharchive.pull-requests"),
            [
                slim("PullRequestReviewCommentEvent", 2),
                slim("PullRequestEvent", 5)
            ]
        );
        // The default route.
        assert_eq!(
            d.output_values("gharchive.other"),
            [slim("WatchEvent", 3), slim("ForkEvent", 6)]
        );
        // Keys pass through unchanged.
        let keys: Vec<&[u8]> = d
            .output("gharchive.other")
            .iter()
            .map(|r| r.key.as_deref().unwrap())
            .collect();
        assert_eq!(keys, [&b"k3"[..], &b"k6"[..]]);

        // Each failing record goes to the dead-letter topic as it was read, with the stage
        // and the reason, and to no other topic.
        let dead: Vec<(String, String, String)> = d
            .dead_letters()
            .iter()
            .map(|r| {
                (
                    header(&r.headers, dlq_headers::STAGE).unwrap().to_string(),
                    header(&r.headers, dlq_headers::REASON).unwrap().to_string(),
                    String::from_utf8(r.value.as_deref().unwrap().to_vec()).unwrap(),
                )
            })
            .collect();
        let reason = |s: &str| s.to_string();
        assert_eq!(dead.len(), 3);
        assert_eq!(
            dead[0],
            (
                reason("slim"),
                reason("set /repo_name: /repo/name is missing"),
                reason(no_repo)
            )
        );
        assert_eq!(
            dead[1],
            (
                reason("by-type"),
                reason("/type is not a string: 42"),
                reason(numeric_type)
            )
        );
        // Not JSON: refused where the source value is decoded, before any stage.
        assert_eq!(
            dead[2],
            (
                reason("source"),
                reason("value is not valid JSON: expected ident at line 1 column 2"),
                reason("not json")
            )
        );
        let written: usize = ["pushes", "issues", "pull-requests", "other"]
            .iter()
            .map(|t| d.output(&format!("gharchive.{t}")).len())
            .sum();
        assert_eq!(written, types.len());
    }
}
