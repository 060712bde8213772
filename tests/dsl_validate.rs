//! Topology files: golden validation errors (every file under topologies/invalid/ with its
//! exact messages), the `validate` and `describe` commands, and a property test that no
//! input makes the parser panic.

use onceflow::dsl;
use onceflow::DescribeFormat;
use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn invalid_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("topologies/invalid"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("yaml" | "toml")
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn golden_invalid_topologies_fail_with_their_exact_messages() {
    let files = invalid_files();
    assert!(files.len() >= 10, "golden files missing: {files:?}");
    for f in files {
        let rel = f.strip_prefix(root()).unwrap().display().to_string();
        let text = std::fs::read_to_string(&f).unwrap();
        let expected = std::fs::read_to_string(f.with_extension("expected"))
            .unwrap_or_else(|e| panic!("{rel}: no .expected file: {e}"));
        let got = match dsl::parse(&rel, &text) {
            Ok(_) => panic!("{rel} should fail validation"),
            Err(e) => e.to_string(),
        };
        assert_eq!(got, expected.trim_end(), "{rel}");
    }
}

#[test]
fn every_error_of_a_file_is_reported_together() {
    let f = root().join("topologies/invalid/wrong-types.yaml");
    let e = dsl::load(&f).unwrap_err();
    assert_eq!(e.errors.len(), 9);
    // Each names file:line:column, the place and the field.
    for line in &e.errors {
        let (loc, rest) = line.split_once(": ").unwrap();
        let parts: Vec<&str> = loc.rsplitn(3, ':').collect();
        assert!(
            parts[0].parse::<u32>().is_ok() && parts[1].parse::<u32>().is_ok(),
            "{line}"
        );
        assert!(rest.contains("field `"), "{line}");
    }
}

#[test]
fn shipped_topologies_validate() {
    for name in [
        "gharchive-dedup.yaml",
        "analytics-dedup.yaml",
        "routing-by-event-type.yaml",
        "routing-by-event-type.toml",
    ] {
        let p = root().join("topologies").join(name);
        if let Err(e) = dsl::load(&p) {
            panic!("{name}: {e}");
        }
    }
}

fn onceflow(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_onceflow"))
        .args(args)
        .current_dir(root())
        .env("ONCEFLOW_LOG", "off")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn validate_command_exits_1_with_every_error() {
    let (code, out, err) = onceflow(&["validate", "topologies/invalid/unknown-fields.yaml"]);
    assert_eq!(code, 1);
    assert_eq!(out, "");
    let want =
        std::fs::read_to_string(root().join("topologies/invalid/unknown-fields.expected")).unwrap();
    assert_eq!(err.trim_end(), want.trim_end());
    let (code, out, _) = onceflow(&["validate", "topologies/analytics-dedup.yaml"]);
    assert_eq!(
        (code, out.as_str()),
        (
            0,
            "topologies/analytics-dedup.yaml: ok\n  dedup seen-events: partitioning=repartition (stated)\n  hop: before dedup seen-events (the first stage)\n"
        )
    );
    let (code, _, err) = onceflow(&["validate", "topologies/does-not-exist.yaml"]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with("topologies/does-not-exist.yaml: cannot read: "),
        "{err}"
    );
}

#[test]
fn describe_text_names_stages_topics_stores_and_changelogs() {
    let (code, out, _) = onceflow(&[
        "describe",
        "topologies/analytics-dedup.yaml",
        "--application-id",
        "shop",
    ]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "Topology: analytics-dedup
  Source: topic analytics.events (format json)
  Repartition: topic shop-seen-events-repartition keyed by json pointer /event_id
  Dedup: seen-events key=json pointer /event_id ttl=24h time=event grace=1h duplicates_to=analytics.duplicates partitioning=repartition (stated)
  Sink: unique topics=analytics.unique key=`value.user_id` header[event-name]=`value.event`
  Topics written: analytics.duplicates (json), analytics.unique (json)
  Store: seen-events (stage seen-events) changelog shop-seen-events-changelog
"
    );
}

#[test]
fn describe_mermaid_and_dot() {
    let t = dsl::load(&root().join("topologies/analytics-dedup.yaml")).unwrap();
    assert_eq!(
        t.describe_as(DescribeFormat::Mermaid, "onceflow"),
        r#"flowchart LR
  t0(["topic analytics.events"])
  t1(["topic onceflow-seen-events-repartition"])
  s0["dedup seen-events<br/>key=json pointer /event_id ttl=24h time=event grace=1h duplicates_to=analytics.duplicates partitioning=repartition (stated)"]
  t2(["topic analytics.duplicates"])
  st0_0[("store seen-events<br/>changelog onceflow-seen-events-changelog")]
  s1["sink unique<br/>topics=analytics.unique key=`value.user_id` header[event-name]=`value.event`"]
  t3(["topic analytics.unique"])
  t0 -->|"repartition by json pointer /event_id"| t1
  t1 --> s0
  s0 -->|"duplicates"| t2
  s0 -->|"state"| st0_0
  s0 --> s1
  s1 --> t3
"#
    );
    let t = dsl::load(&root().join("topologies/routing-by-event-type.yaml")).unwrap();
    let dot = t.describe_as(DescribeFormat::Dot, "onceflow");
    assert_eq!(
        dot,
        r#"digraph "routing-by-event-type" {
  rankdir=LR;
  t0 [shape=ellipse, label="topic gharchive.events"];
  s0 [shape=box, label="map slim\nset /repo_name=`value.repo.name` set /actor_login=`value.actor.login` drop /payload drop /org"];
  s1 [shape=box, label="route by-type\n`value.type == \"PushEvent\"`->gharchive.pushes `value.type in [\"IssuesEvent\", \"IssueCommentEvent\"]`->gharchive.issues `value.type.startsWith(\"PullRequest\")`->gharchive.pull-requests default->gharchive.other"];
  t1 [shape=ellipse, label="topic gharchive.pushes"];
  t2 [shape=ellipse, label="topic gharchive.issues"];
  t3 [shape=ellipse, label="topic gharchive.pull-requests"];
  t4 [shape=ellipse, label="topic gharchive.other"];
  t0 -> s0;
  s0 -> s1;
  s1 -> t1 [label="value.type == \"PushEvent\""];
  s1 -> t2 [label="value.type in [\"IssuesEvent\", \"IssueCommentEvent\"]"];
  s1 -> t3 [label="value.type.startsWith(\"PullRequest\")"];
  s1 -> t4 [label="default"];
}
"#
    );
    let (code, out, _) = onceflow(&[
        "describe",
        "--format",
        "dot",
        "topologies/routing-by-event-type.yaml",
    ]);
    assert_eq!((code, out), (0, dot));
    let (code, _, err) = onceflow(&[
        "describe",
        "--format",
        "svg",
        "topologies/routing-by-event-type.yaml",
    ]);
    assert_eq!(code, 2, "{err}");
}

/// Texts to mutate: every shipped and golden topology file.
fn corpus() -> Vec<(String, String)> {
    let mut v = Vec::new();
    for dir in ["topologies", "topologies/invalid"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap() {
            let p = e.unwrap().path();
            if matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("yaml" | "toml")
            ) {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                v.push((name, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    v.sort();
    v
}

#[derive(Debug, Clone)]
enum Mutation {
    Delete(usize, usize),
    Insert(usize, String),
    DuplicateLine(usize),
    SwapLines(usize, usize),
    Replace(usize, char),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let piece = prop_oneof![
        Just(": ".to_string()),
        Just("- ".to_string()),
        Just("{".to_string()),
        Just("}".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just("\n  ".to_string()),
        Just("&a ".to_string()),
        Just("*a".to_string()),
        Just("\"".to_string()),
        Just("'".to_string()),
        Just(" = ".to_string()),
        Just("[[stages]]\n".to_string()),
        Just("value.".to_string()),
        Just("((".to_string()),
        Just("~".to_string()),
        Just("\t".to_string()),
        "[ -~]{0,8}",
        any::<String>(),
    ];
    prop_oneof![
        (any::<usize>(), 0usize..40).prop_map(|(a, n)| Mutation::Delete(a, n)),
        (any::<usize>(), piece).prop_map(|(a, s)| Mutation::Insert(a, s)),
        any::<usize>().prop_map(Mutation::DuplicateLine),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
        (any::<usize>(), any::<char>()).prop_map(|(a, c)| Mutation::Replace(a, c)),
    ]
}

fn floor_char(s: &str, i: usize) -> usize {
    let mut i = i % (s.len() + 1);
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn apply(text: &str, m: &Mutation) -> String {
    let mut s = text.to_string();
    match m {
        Mutation::Delete(a, n) => {
            let a = floor_char(&s, *a);
            let b = floor_char(&s, (a + n).min(s.len()));
            s.replace_range(a..b.max(a), "");
        }
        Mutation::Insert(a, piece) => {
            let a = floor_char(&s, *a);
            s.insert_str(a, piece);
        }
        Mutation::Replace(a, c) => {
            let a = floor_char(&s, *a);
            if let Some(old) = s[a..].chars().next() {
                s.replace_range(a..a + old.len_utf8(), &c.to_string());
            }
        }
        Mutation::DuplicateLine(i) | Mutation::SwapLines(i, _) => {
            let mut lines: Vec<&str> = text.lines().collect();
            if lines.is_empty() {
                return s;
            }
            let i = i % lines.len();
            if let Mutation::SwapLines(_, j) = m {
                let j = j % lines.len();
                lines.swap(i, j);
            } else {
                lines.insert(i, lines[i]);
            }
            s = lines.join("\n");
        }
    }
    s
}

/// Parse as YAML and as TOML; whatever compiles must also describe itself and build the
/// processors of a task (what a task does on assignment).
fn must_not_panic(text: &str) {
    for name in ["fuzz.yaml", "fuzz.toml"] {
        if let Ok(t) = dsl::parse(name, text) {
            for f in [
                DescribeFormat::Text,
                DescribeFormat::Mermaid,
                DescribeFormat::Dot,
            ] {
                let _ = t.describe_as(f, "app");
            }
            let _ = onceflow::__testkit::drive_tasks(&t, None, &[], vec![], 0, Some(0));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn parser_never_panics_on_mutated_files(
        file in any::<prop::sample::Index>(),
        muts in prop::collection::vec(mutation(), 1..6),
    ) {
        let c = corpus();
        let (_, text) = &c[file.index(c.len())];
        let mut t = text.clone();
        for m in &muts {
            t = apply(&t, m);
        }
        must_not_panic(&t);
    }

    #[test]
    fn parser_never_panics_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        must_not_panic(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn parser_never_panics_on_random_text(text in "[ -~\n\t]{0,300}") {
        must_not_panic(&text);
    }
}

#[test]
fn pathological_inputs_are_errors_not_crashes() {
    let deep_yaml = format!("name: x\nsource: {}\n", "[".repeat(100_000));
    assert!(dsl::parse("d.yaml", &deep_yaml).is_err());
    let deep_toml = format!("name = {}\n", "[".repeat(100_000));
    assert!(dsl::parse("d.toml", &deep_toml).is_err());
    let deep_inline = format!("a = {}1{}\n", "{b = ".repeat(5_000), "}".repeat(5_000));
    assert!(dsl::parse("d.toml", &deep_inline).is_err());
    let expr = format!(
        "name: x\nsource: {{topic: a}}\nstages:\n  - filter: {{when: '{}'}}\n  - sink: {{topic: b}}\n",
        "-".repeat(4000)
    );
    assert!(dsl::parse("e.yaml", &expr).is_err());
    let _ = Path::new("");
}

fn cel_expr() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("value.n".to_string()),
        Just("value.s".to_string()),
        Just("value.l".to_string()),
        Just("value.m".to_string()),
        Just("value.missing".to_string()),
        Just("key".to_string()),
        Just("headers".to_string()),
        Just("timestamp".to_string()),
        Just("9223372036854775807".to_string()),
        Just("-9223372036854775808".to_string()),
        Just("18446744073709551615u".to_string()),
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1.5e308".to_string()),
        Just("'é'".to_string()),
        Just("b'\\xff'".to_string()),
        Just("null".to_string()),
        Just("[]".to_string()),
        Just("{}".to_string()),
    ];
    leaf.prop_recursive(4, 24, 3, |inner| {
        prop_oneof![
            (
                inner.clone(),
                prop::sample::select(vec!["+", "-", "*", "/", "%", "==", "<", "&&", "||", " in "]),
                inner.clone()
            )
                .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
            inner.clone().prop_map(|a| format!("-({a})")),
            inner.clone().prop_map(|a| format!("size({a})")),
            inner.clone().prop_map(|a| format!("string({a})")),
            inner.clone().prop_map(|a| format!("int({a})")),
            inner.clone().prop_map(|a| format!("({a})[0]")),
            inner
                .clone()
                .prop_map(|a| format!("({a}).exists(x, x == 1)")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}).matches({b})")),
            (inner.clone(), inner).prop_map(|(a, b)| format!("[{a}, {b}]")),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Expressions over odd values (overflow, division by zero, wrong types, bad regexes)
    /// give a value or an error for the record, never a crash.
    #[test]
    fn expressions_never_panic_at_run_time(expr in cel_expr()) {
        use onceflow::{TestDriver, TestRecord};
        let yaml = format!(
            "name: t\nsource: {{topic: in}}\nstages:\n  - map: {{set: {{r: {}}}}}\n  - sink: {{topic: out, key: {}}}\n",
            serde_json::to_string(&expr).unwrap(),
            serde_json::to_string(&expr).unwrap(),
        );
        if let Ok(t) = dsl::parse("e.yaml", &yaml) {
            let mut d = TestDriver::new(t);
            d.pipe(
                TestRecord::json(r#"{"n":-9223372036854775808,"s":"(","l":[1,"a",null],"m":{"a":1}}"#)
                    .key(vec![0xff])
                    .header("h", "v"),
            )
            .unwrap();
            prop_assert_eq!(d.output("out").len() + d.dead_letters().len(), 1);
        }
    }
}

/// `validate` shows where the repartition hop is (after a stateless prefix) and fails,
/// naming both stages, for a hop `onceflow run` refuses (a sink before the dedup).
#[test]
fn validate_shows_the_hop_after_stateless_stages_and_refuses_a_sink_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let validate = |stages: &str| {
        let f = dir.path().join("t.yaml");
        let head = "name: t\nsource: { topic: in, format: json }\nstages:\n";
        std::fs::write(&f, format!("{head}{stages}  - sink: {{ topic: out }}\n")).unwrap();
        onceflow(&["validate", f.to_str().unwrap()])
    };
    let (code, out, err) = validate(
        "  - filter: { name: keep, when: 'value.n > 0' }\n  - map: { name: rename, rename: { id: uid } }\n  - dedup: { name: dedup, key: { json_pointer: /uid } }\n",
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.ends_with(
            "  dedup dedup: partitioning=repartition (default for a key other than kafka_key)\n  hop: before dedup dedup, after keep, rename (run on the source partitions, before routing)\n"
        ),
        "{out}"
    );
    let (code, out, err) = validate(
        "  - sink: { name: copy, topic: copy }\n  - dedup: { name: dedup, key: { json_pointer: /id } }\n",
    );
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    // At the dedup's line and column, as any other error of the file.
    assert!(
        err.contains("t.yaml:5:5: stage `dedup` (dedup), field `partitioning`: "),
        "{err}"
    );
    assert!(err.contains("dedup stage \"dedup\""), "{err}");
    assert!(err.contains("stage \"copy\" (sink)"), "{err}");
    assert!(err.contains("only filter and map stages"), "{err}");
    // describe refuses it alike: its picture would show a topology that never runs.
    let f = dir.path().join("t.yaml");
    for format in ["text", "mermaid", "dot"] {
        let (code, out, err) = onceflow(&["describe", "--format", format, f.to_str().unwrap()]);
        assert_eq!((code, out.as_str()), (1, ""), "{format}: {err}");
        assert!(
            err.contains("only filter and map stages"),
            "{format}: {err}"
        );
    }
}

#[test]
fn describe_graphs_draw_the_repartition_hop() {
    let t = onceflow::dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in, format: json }\nstages:\n  - filter: { name: keep, when: 'value.n > 0' }\n  - dedup: { name: d, key: { json_pointer: /id } }\n  - sink: { topic: out }\n",
    )
    .unwrap();
    let mermaid = t.describe_as(DescribeFormat::Mermaid, "app");
    // source -> keep -> repartition topic -> d
    assert!(
        mermaid.contains("  t1([\"topic app-d-repartition\"])"),
        "{mermaid}"
    );
    assert!(
        mermaid.contains("  s0 -->|\"repartition by json pointer /id\"| t1\n  t1 --> s1\n"),
        "{mermaid}"
    );
    let dot = t.describe_as(DescribeFormat::Dot, "app");
    assert!(dot.contains("label=\"topic app-d-repartition\""), "{dot}");
    assert!(
        dot.contains("  s0 -> t1 [label=\"repartition by json pointer /id\"];"),
        "{dot}"
    );
    // Stated `partitioning: source`: no hop drawn.
    let t = onceflow::dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in, format: json }\nstages:\n  - dedup: { name: d, key: { json_pointer: /id }, partitioning: source }\n  - sink: { topic: out }\n",
    )
    .unwrap();
    assert!(!t
        .describe_as(DescribeFormat::Mermaid, "app")
        .contains("repartition"));
}

/// `describe --application-id` refuses an id that `run` refuses (it printed topic names
/// that cannot exist; found by a review helper).
#[test]
fn describe_refuses_an_application_id_that_run_refuses() {
    let file = root().join("topologies/gharchive-dedup.yaml");
    let (code, _, err) = onceflow(&[
        "describe",
        file.to_str().unwrap(),
        "--application-id",
        "my app/x",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("it prefixes internal topic names"), "{err}");
}
