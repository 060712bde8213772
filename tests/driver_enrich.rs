//! The enrich stage through the broker-free test driver: joins, table updates and
//! tombstones, missing-match policies, bad lookup keys, and the table restored from its
//! topic after the state is wiped; each with its exact output.

use onceflow::headers::dlq_headers;
use onceflow::KeySource;
use onceflow::{EnrichSpec, Format, MissingPolicy, TableSpec, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};

fn driver(policy: MissingPolicy, into: &str) -> TestDriver {
    let t = TopologyBuilder::new("orders")
        .source("orders", Format::Json)
        .table(TableSpec::new("customers", "customers"))
        .enrich(
            "join",
            EnrichSpec::new(
                "customers",
                KeySource::JsonPointer("/customer_id".into()),
                into,
            )
            .on_missing(policy),
        )
        .sink("out", "orders.enriched")
        .build()
        .unwrap();
    TestDriver::new(t)
}

fn customer(d: &mut TestDriver, id: &str, row: Option<&str>) {
    let r = match row {
        Some(v) => TestRecord::json(v),
        None => TestRecord::null_value(),
    };
    d.pipe_table("customers", r.key(id)).unwrap();
}

fn reasons(d: &TestDriver) -> Vec<(String, String)> {
    d.dead_letters()
        .iter()
        .map(|r| {
            let h = |n: &str| {
                let v = r.headers.iter().find(|(k, _)| k == n).unwrap();
                String::from_utf8(v.1.as_ref().unwrap().to_vec()).unwrap()
            };
            (h(dlq_headers::STAGE), h(dlq_headers::REASON))
        })
        .collect()
}

#[test]
fn joins_follow_table_updates_and_tombstones() {
    let mut d = driver(MissingPolicy::Pass, "/customer");
    customer(&mut d, "c1", Some(r#"{"name":"Ada","tier":"gold"}"#));
    customer(&mut d, "42", Some(r#"{"name":"Num"}"#));
    d.pipe(TestRecord::json(
        r#"{"order_id":"o1","customer_id":"c1","amount":5}"#,
    ))
    .unwrap();
    // A numeric key field matches the table key "42" (its decimal text).
    d.pipe(TestRecord::json(r#"{"order_id":"o2","customer_id":42}"#))
        .unwrap();
    // A table update changes later joins, not earlier ones.
    customer(&mut d, "c1", Some(r#"{"name":"Ada","tier":"platinum"}"#));
    d.pipe(TestRecord::json(r#"{"order_id":"o3","customer_id":"c1"}"#))
        .unwrap();
    // A tombstone deletes the row: the next order has no match and passes unchanged.
    customer(&mut d, "c1", None);
    d.pipe(TestRecord::json(
        r#"{"order_id":"o4",  "customer_id":"c1"}"#,
    ))
    .unwrap();
    assert_eq!(
        d.output_values("orders.enriched"),
        vec![
            r#"{"order_id":"o1","customer_id":"c1","amount":5,"customer":{"name":"Ada","tier":"gold"}}"#,
            r#"{"order_id":"o2","customer_id":42,"customer":{"name":"Num"}}"#,
            r#"{"order_id":"o3","customer_id":"c1","customer":{"name":"Ada","tier":"platinum"}}"#,
            // Unchanged records keep their bytes as read.
            r#"{"order_id":"o4",  "customer_id":"c1"}"#,
        ]
    );
    assert!(d.dead_letters().is_empty());
}

#[test]
fn missing_policies_drop_pass_dead_letter() {
    let order = r#"{"order_id":"o1","customer_id":"nobody"}"#;
    let mut d = driver(MissingPolicy::Drop, "/customer");
    d.pipe(TestRecord::json(order)).unwrap();
    assert!(d.output_values("orders.enriched").is_empty());
    assert!(d.dead_letters().is_empty());

    let mut d = driver(MissingPolicy::Pass, "/customer");
    d.pipe(TestRecord::json(order)).unwrap();
    assert_eq!(d.output_values("orders.enriched"), vec![order]);

    let mut d = driver(MissingPolicy::DeadLetter, "/customer");
    d.pipe(TestRecord::json(order)).unwrap();
    d.pipe(TestRecord::json(r#"{"customer_id":"bin\u0001"}"#))
        .unwrap();
    assert!(d.output_values("orders.enriched").is_empty());
    assert_eq!(
        reasons(&d),
        vec![
            (
                "join".to_string(),
                "no row in table customers for key \"nobody\"".to_string()
            ),
            (
                "join".to_string(),
                "no row in table customers for key \"bin\\x01\"".to_string()
            ),
        ]
    );
    assert_eq!(d.dead_letters()[0].value.as_deref(), Some(order.as_bytes()));
}

#[test]
fn bad_lookup_keys_and_records_are_dead_lettered() {
    let mut d = driver(MissingPolicy::Pass, "/customer/profile");
    customer(&mut d, "c1", Some(r#"{"name":"Ada"}"#));
    d.pipe(TestRecord::json(r#"{"order_id":"o1"}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"customer_id":null}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"customer_id":{"id":"c1"}}"#))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"customer_id":"c1","customer":"vip"}"#))
        .unwrap();
    d.pipe(TestRecord::json(
        r#"{"customer_id":"c1","customer":{"since":2020}}"#,
    ))
    .unwrap();
    d.pipe(TestRecord::json("not json")).unwrap();
    assert_eq!(
        reasons(&d),
        vec![
            (
                "join".into(),
                "lookup key: key field /customer_id is missing".into()
            ),
            (
                "join".into(),
                "lookup key: key field /customer_id is null".into()
            ),
            (
                "join".into(),
                "lookup key: key field /customer_id is an object, expected a string or a number"
                    .into()
            ),
            (
                "join".into(),
                "cannot set /customer/profile: /customer is a string, not an object".into()
            ),
            (
                "source".to_string(),
                "value is not valid JSON: expected ident at line 1 column 2".to_string()
            ),
        ]
    );
    assert_eq!(
        d.output_values("orders.enriched"),
        vec![r#"{"customer_id":"c1","customer":{"since":2020,"profile":{"name":"Ada"}}}"#]
    );
}

/// Into a top-level field, a row joins the same whether the record had that field or not:
/// the record's and the row's numbers keep their digits (an integer beyond 64 bits too).
/// Found by a review helper: with the field present, the row went through `f64`.
#[test]
fn a_row_joins_the_same_whether_or_not_the_field_exists() {
    let mut d = driver(MissingPolicy::DeadLetter, "/customer");
    customer(&mut d, "c1", Some(r#"{"acct":18446744073709551617}"#));
    for order in [
        r#"{"customer_id":"c1","n":18446744073709551616}"#,
        r#"{"customer_id":"c1","n":18446744073709551616,"customer":null}"#,
        r#"{"customer_id":"c1","customer":{"old":1},"n":18446744073709551616}"#,
    ] {
        d.pipe(TestRecord::json(order)).unwrap();
    }
    let out = d.output_values("orders.enriched");
    assert_eq!(out.len(), 3, "{out:?}");
    for v in &out {
        assert!(
            v.contains(r#""customer":{"acct":18446744073709551617}"#),
            "{v}"
        );
        assert!(v.contains(r#""n":18446744073709551616"#), "{v}");
    }
}

#[test]
fn empty_into_merges_the_row_fields() {
    let mut d = driver(MissingPolicy::Pass, "");
    customer(&mut d, "c1", Some(r#"{"name":"Ada","customer_id":"C-1"}"#));
    d.pipe(TestRecord::json(r#"{"customer_id":"c1","n":1}"#))
        .unwrap();
    assert_eq!(
        d.output_values("orders.enriched"),
        vec![r#"{"customer_id":"C-1","n":1,"name":"Ada"}"#]
    );
}

#[test]
fn unusable_table_rows_are_removed_not_served_stale() {
    let mut d = driver(MissingPolicy::DeadLetter, "/c");
    customer(&mut d, "c1", Some(r#"{"name":"Ada"}"#));
    customer(&mut d, "c1", Some("{broken"));
    d.pipe_table("customers", TestRecord::json(r#"{"no":"key"}"#))
        .unwrap();
    assert_eq!(d.table_row("customers", b"c1").unwrap(), None);
    d.pipe(TestRecord::json(r#"{"customer_id":"c1"}"#)).unwrap();
    assert_eq!(
        reasons(&d),
        vec![(
            "join".to_string(),
            "no row in table customers for key \"c1\"".to_string()
        )]
    );
}

#[test]
fn table_comes_back_from_its_topic_after_a_wipe() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    // Table topic records applied so far: the sum of `onceflow_table_records_total` (a
    // snapshot takes the counts since the last one).
    fn loaded(snapshotter: &Snapshotter, total: &mut u64) -> u64 {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            if let DebugValue::Counter(n) = value {
                if key.key().name() == onceflow::metrics::TABLE_RECORDS {
                    *total += n;
                }
            }
        }
        *total
    }
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut total = 0;
    metrics::with_local_recorder(&recorder, || {
        let mut d = driver(MissingPolicy::Pass, "/customer");
        for i in 0..5 {
            customer(&mut d, &format!("c{i}"), Some(&format!(r#"{{"n":{i}}}"#)));
        }
        d.pipe(TestRecord::json(r#"{"customer_id":"c3"}"#)).unwrap();
        assert_eq!(loaded(&snapshotter, &mut total), 5);
        // Kept state: the table resumes from its stored offsets (nothing is read twice).
        d.crash();
        customer(&mut d, "c3", Some(r#"{"n":33}"#));
        d.pipe(TestRecord::json(r#"{"customer_id":"c3"}"#)).unwrap();
        assert_eq!(loaded(&snapshotter, &mut total), 6);
        // Wiped state: the table is loaded again from the start of its topic.
        d.wipe_state();
        assert_eq!(
            d.table_row("customers", b"c3").unwrap().as_deref(),
            Some(r#"{"n":33}"#)
        );
        assert_eq!(loaded(&snapshotter, &mut total), 12);
        d.pipe(TestRecord::json(r#"{"customer_id":"c4"}"#)).unwrap();
        assert_eq!(
            d.output_values("orders.enriched"),
            vec![
                r#"{"customer_id":"c3","customer":{"n":3}}"#,
                r#"{"customer_id":"c3","customer":{"n":33}}"#,
                r#"{"customer_id":"c4","customer":{"n":4}}"#,
            ]
        );
    });
}

#[test]
fn build_checks_tables_and_enrich_stages() {
    let errs = TopologyBuilder::new("t")
        .source("raw", Format::Bytes)
        .table(TableSpec::new("customers", "raw").format(Format::Bytes))
        .table(TableSpec::new("customers", "c"))
        .enrich(
            "join",
            EnrichSpec::new("custs", KeySource::JsonPointer("id".into()), "x"),
        )
        .sink("out", "out")
        .topic_format("other", Format::Json)
        .build()
        .unwrap_err();
    let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
    assert_eq!(
        text,
        vec![
            "topology error in table customers: field `format`: a table needs rows with a view (json, string or protobuf), not bytes",
            "topology error in table customers: field `topic`: raw is the source topic; a table needs its own topic",
            "topology error in table customers: field `name`: duplicate table name",
            "topology error in join: field `table`: no table named \"custs\" (declared: customers, customers)",
            "topology error in join: enrich needs a source with a record view (json, string or protobuf), but the source format is bytes",
            "topology error in join: field `key`: JSON pointer \"id\" must start with '/'",
            "topology error in join: field `into`: JSON pointer \"x\" must start with '/'",
            "topology error in topic other: a format (json) is set for a topic no sink or route writes",
            "topology error in topic other: the source format is bytes, which cannot be written as json",
        ]
    );
}

#[test]
fn describe_shows_tables_enrich_and_formats() {
    let t = TopologyBuilder::new("orders")
        .source("orders", Format::Json)
        .table(TableSpec::new("customers", "customers"))
        .enrich(
            "join",
            EnrichSpec::new(
                "customers",
                KeySource::JsonPointer("/customer_id".into()),
                "/customer",
            )
            .on_missing(MissingPolicy::DeadLetter),
        )
        .sink("out", "orders.enriched")
        .build()
        .unwrap();
    assert_eq!(
        t.describe(),
        "Topology: orders\n  Source: topic orders (format json)\n  Table: customers topic=customers (format json) store=table-customers\n  Enrich: join table=customers key=json pointer /customer_id into=\"/customer\" on_missing=dead_letter\n  Sink: out topics=orders.enriched\n  Topics written: orders.enriched (json)\n"
    );
}

#[test]
fn shipped_enrich_orders_file_runs_and_matches_the_builder() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/topologies/enrich-orders.yaml");
    let t = onceflow::dsl::load(std::path::Path::new(path)).unwrap();
    let built = TopologyBuilder::new("enrich-orders")
        .source("orders", Format::Json)
        .table(TableSpec::new("customers", "customers"))
        .enrich(
            "join-customer",
            EnrichSpec::new(
                "customers",
                KeySource::JsonPointer("/customer_id".into()),
                "/customer",
            )
            .on_missing(MissingPolicy::DeadLetter),
        )
        .sink("enriched", "orders.enriched")
        .topic_format("orders.enriched", Format::Json)
        .build()
        .unwrap();
    assert_eq!(t, built);
    let mut d = TestDriver::new(t);
    d.pipe_table("customers", TestRecord::json(r#"{"name":"Ada"}"#).key("c1"))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"order_id":"o1","customer_id":"c1"}"#))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"order_id":"o2","customer_id":"c2"}"#))
        .unwrap();
    assert_eq!(
        d.output_values("orders.enriched"),
        vec![r#"{"order_id":"o1","customer_id":"c1","customer":{"name":"Ada"}}"#]
    );
    assert_eq!(
        reasons(&d),
        vec![(
            "join-customer".to_string(),
            "no row in table customers for key \"c2\"".to_string()
        )]
    );
}

#[test]
fn topology_files_with_codecs_and_tables_compile_or_name_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let desc = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/shop.desc");
    std::fs::copy(desc, dir.path().join("shop.desc")).unwrap();
    let file = dir.path().join("t.yaml");
    let text = r#"name: t
source: { topic: orders, format: { protobuf: { descriptor_set: shop.desc, message: shop.Order } } }
tables:
  - { name: customers, topic: customers, format: { protobuf: { descriptor_set: shop.desc, message: shop.Customer } } }
stages:
  - enrich: { table: customers, key: { json_pointer: /customer_id } }
  - sink: { topic: out, format: { protobuf: { descriptor_set: shop.desc, message: shop.EnrichedOrder } } }
"#;
    std::fs::write(&file, text).unwrap();
    let t = onceflow::dsl::load(&file).unwrap();
    assert_eq!(
        t.describe(),
        "Topology: t\n  Source: topic orders (format protobuf shop.Order)\n  Table: customers topic=customers (format protobuf shop.Customer) store=table-customers\n  Enrich: enrich-customers table=customers key=json pointer /customer_id into=\"/customers\" on_missing=pass\n  Sink: sink-out topics=out\n  Topics written: out (protobuf shop.EnrichedOrder)\n"
    );
    std::fs::write(
        &file,
        text.replace("shop.Customer", "shop.Nope")
            .replace("customers, key", "custs, key"),
    )
    .unwrap();
    let err = onceflow::dsl::load(&file).unwrap_err().to_string();
    let f = file.display().to_string();
    let d = dir.path().join("shop.desc").display().to_string();
    assert_eq!(
        err,
        format!("{f}:4:62: table `customers`, field `format`: config error: {d}: no message type \"shop.Nope\" in the descriptor set (it has: shop.Customer, shop.EnrichedOrder, shop.Order)\n\
{f}:6:22: stage `enrich-custs` (enrich), field `table`: no table named \"custs\" (declared: none)")
    );
}
