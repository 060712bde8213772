//! Throughput of the enrichment pipeline (JSON in, JSON out, one table lookup) next to a
//! passthrough pipeline (JSON in, JSON out, no stage), in the same run on the same data.
//!
//! What it measures:
//! 1. Data: N orders (default 500,000, ~170 bytes of JSON, keyed by order id) over 4
//!    partitions, each naming one of C customers (default 10,000); a compacted 4-partition
//!    customer topic with one JSON row per customer.
//! 2. Against the broker, alternating for R rounds (default 3): (a) `App::run` of the
//!    passthrough topology (source → sink) and (b) `App::run` of the enrichment topology
//!    of examples/enrich_orders.rs (source → enrich on `/customer_id` into `/customer` →
//!    sink), both at_least_once, stop at end, fresh application.id and state dir.
//!    records/s from `RunSummary` (first record to the last commit; the table load comes
//!    before the first record and is reported on its own). The outputs are counted (N each)
//!    and one enriched record is checked. Medians and the ratio b/a are reported.
//! 3. Without a broker: one task per partition over the same N pre-built records
//!    (`onceflow::__testkit::drive_tasks`), passthrough vs enrich with the table in sled and
//!    in memory (loaded before each measure starts); records/s and ratios. This isolates the
//!    stage cost (view parse, lookup, row parse, merge, JSON write) from the broker.
//!
//! Ends with one machine-readable line starting `bench-enrich:`.
//!
//! ```text
//! scripts/bench-enrich                                   # build, start the broker, run
//! ONCEFLOW_BENCH_RECORDS=50000 scripts/bench-enrich      # quick smoke run
//! ```
//! Environment: ONCEFLOW_BOOTSTRAP_SERVERS (127.0.0.1:9092), ONCEFLOW_BENCH_RECORDS
//! (500000), ONCEFLOW_BENCH_CUSTOMERS (10000), ONCEFLOW_BENCH_ROUNDS (3), ONCEFLOW_LOG (warn),
//! ONCEFLOW_BENCH_TASKS_ONLY (set: part 3 only, no broker; for profiling).

#[path = "bench_support/mod.rs"]
mod support;

use bytes::Bytes;
use onceflow::__testkit::drive_tasks;
use onceflow::KeySource;
use onceflow::TestRecord;
use onceflow::{App, RunOptions, RunSummary};
use onceflow::{EnrichSpec, Format, MissingPolicy, TableSpec, Topology, TopologyBuilder};
use onceflow_testkit::kafka;
use onceflow_testkit::kafka::Admin;
use std::process::ExitCode;
use std::time::Instant;
use support::{
    cleanup, env_usize, init_logging, median, onceflow_config, rate_list, topic_records, Created,
    Res, Settings, PARTITIONS,
};

/// A row of a lookup table: partition, offset, key, value.
type TableRow = (i32, i64, Option<Vec<u8>>, Option<Vec<u8>>);

struct Order {
    key: Bytes,
    partition: i32,
    value: Bytes,
}

fn orders(n: usize, customers: usize) -> Vec<Order> {
    (0..n)
        .map(|i| {
            let id = format!("o{i:09}");
            let value = format!(
                r#"{{"order_id":"{id}","customer_id":"c{}","amount_cents":{},"items":["sku-{}","sku-{}"],"channel":"web","note":"bench order payload"}}"#,
                i % customers,
                (i * 7919) % 100_000,
                i % 97,
                i % 13
            );
            Order {
                partition: (xxhash_rust::xxh3::xxh3_64(id.as_bytes()) % PARTITIONS as u64) as i32,
                key: Bytes::from(id),
                value: Bytes::from(value),
            }
        })
        .collect()
}

fn customer_row(i: usize) -> String {
    format!(
        r#"{{"name":"Customer {i}","tier":"{}","country":"UK"}}"#,
        ["basic", "gold"][i % 2]
    )
}

fn passthrough_topology(input: &str, output: &str) -> Res<Topology> {
    TopologyBuilder::new("passthrough")
        .source(input, Format::Json)
        .sink("out", output)
        .build()
        .map_err(|e| format!("{e:?}").into())
}

/// The topology of examples/enrich_orders.rs.
fn enrich_topology(input: &str, customers: &str, output: &str) -> Res<Topology> {
    TopologyBuilder::new("enrich-orders")
        .source(input, Format::Json)
        .table(TableSpec::new("customers", customers))
        .enrich(
            "join-customer",
            EnrichSpec::new(
                "customers",
                KeySource::JsonPointer("/customer_id".into()),
                "/customer",
            )
            .on_missing(MissingPolicy::DeadLetter),
        )
        .sink("enriched", output)
        .build()
        .map_err(|e| format!("{e:?}").into())
}

fn run_app(
    s: &Settings,
    topology: Topology,
    app_id: &str,
    created: &mut Created,
) -> Res<(RunSummary, f64)> {
    let state = tempfile::tempdir()?;
    let dir = state.path().display().to_string();
    let cfg = onceflow_config(
        &s.bootstrap,
        &[
            ("application.id", app_id),
            ("state.dir", &dir),
            ("processing.guarantee", "at_least_once"),
        ],
    )?;
    created.topics.push(cfg.dlq_topic.clone());
    created.groups.push(app_id.to_string());
    let started = Instant::now();
    let summary = App::new(cfg, topology).run(RunOptions {
        stop_at_end: true,
        ..Default::default()
    })?;
    // Whole run minus the processing span: start-up, including the table load.
    let startup = started.elapsed().as_secs_f64() - summary.seconds;
    Ok((summary, startup))
}

fn records_for_tasks(data: &[Order]) -> Vec<TestRecord> {
    data.iter()
        .map(|o| {
            TestRecord::json(o.value.to_vec())
                .key(o.key.to_vec())
                .timestamp(0)
                .partition(o.partition)
        })
        .collect()
}

/// Records/s of `topology` over `records` through one task per partition
/// (`onceflow::__testkit::drive_tasks`), with `tables` (name, rows) loaded first, in sled
/// under `sled_dir` or in memory; and the records written to topics other than the
/// dead-letter topic.
fn tasks_rate(
    topology: &Topology,
    sled_dir: Option<&std::path::Path>,
    tables: &[(&str, Vec<TableRow>)],
    records: &[TestRecord],
) -> Res<(f64, usize)> {
    let (_, seconds, written) =
        drive_tasks(topology, sled_dir, tables, records.to_vec(), 0, Some(0))?;
    Ok((records.len() as f64 / seconds, written))
}

/// The rows of table `customers`: `customers` rows spread over the partitions.
fn customer_rows(customers: usize) -> Vec<TableRow> {
    (0..customers)
        .map(|i| {
            (
                (i % PARTITIONS) as i32,
                (i / PARTITIONS) as i64,
                Some(format!("c{i}").into_bytes()),
                Some(customer_row(i).into_bytes()),
            )
        })
        .collect()
}

fn run(s: &Settings, customers: usize, created: &mut Created) -> Res<()> {
    let data = orders(s.records, customers);
    println!(
        "data: {} orders, {} customers, {:.0} bytes/order on average",
        data.len(),
        customers,
        data.iter().map(|o| o.value.len()).sum::<usize>() as f64 / data.len() as f64
    );

    // (3) first: no broker, the stage cost alone.
    let records = records_for_tasks(&data);
    let pass = passthrough_topology("orders", "out")?;
    let enrich = enrich_topology("orders", "customers", "out")?;
    let tables = [("customers", customer_rows(customers))];
    let (mut t_pass, mut t_mem, mut t_sled) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..s.rounds {
        let (r, w) = tasks_rate(&pass, None, &[], &records)?;
        assert_eq!(w, records.len());
        t_pass.push(r);
        let (r, w) = tasks_rate(&enrich, None, &tables, &records)?;
        assert_eq!(w, records.len(), "every order joined");
        t_mem.push(r);
        let dir = tempfile::tempdir()?;
        let (r, w) = tasks_rate(&enrich, Some(dir.path()), &tables, &records)?;
        assert_eq!(w, records.len(), "every order joined");
        t_sled.push(r);
        eprintln!(
            "tasks round {}: passthrough {:.0}/s, enrich(memory) {:.0}/s, enrich(sled) {:.0}/s",
            round + 1,
            t_pass[round],
            t_mem[round],
            t_sled[round]
        );
    }

    if std::env::var_os("ONCEFLOW_BENCH_TASKS_ONLY").is_some() {
        println!(
            "tasks only: passthrough {:.0}/s, enrich(sled) {:.0}/s, enrich(memory) {:.0}/s (medians)",
            median(&t_pass),
            median(&t_sled),
            median(&t_mem)
        );
        return Ok(());
    }

    // (2) against the broker.
    let admin = Admin::new(&onceflow_config(&s.bootstrap, &[])?)?;
    let input = s.name("enrich.orders");
    let table_topic = s.name("enrich.customers");
    admin.ensure_topic(&input, PARTITIONS, &[])?;
    created.topics.push(input.clone());
    admin.ensure_topic(&table_topic, PARTITIONS, &[("cleanup.policy", "compact")])?;
    created.topics.push(table_topic.clone());
    let p = kafka::TestProducer::new(&s.bootstrap)?;
    for i in 0..customers {
        p.send(
            &table_topic,
            None,
            Some(format!("c{i}").as_bytes()),
            Some(customer_row(i).as_bytes()),
            &[],
            None,
        )?;
    }
    for o in &data {
        p.send(
            &input,
            Some(o.partition),
            Some(&o.key),
            Some(&o.value),
            &[],
            Some(0),
        )?;
    }
    p.flush()?;
    let (mut b_pass, mut b_enrich, mut loads) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..s.rounds {
        let out = s.name(&format!("enrich.pass-out.{round}"));
        created.topics.push(out.clone());
        let (sum, _) = run_app(
            s,
            passthrough_topology(&input, &out)?,
            &s.name(&format!("pass-app-{round}")),
            created,
        )?;
        let n = topic_records(&s.bootstrap, &out)?;
        if n != s.records as i64 {
            return Err(format!("passthrough wrote {n} records, expected {}", s.records).into());
        }
        b_pass.push(sum.records_per_second());
        let out = s.name(&format!("enrich.out.{round}"));
        created.topics.push(out.clone());
        let (sum, startup) = run_app(
            s,
            enrich_topology(&input, &table_topic, &out)?,
            &s.name(&format!("enrich-app-{round}")),
            created,
        )?;
        let n = topic_records(&s.bootstrap, &out)?;
        if n != s.records as i64 || sum.counts.dead_lettered != 0 {
            return Err(format!(
                "enrich wrote {n} records and {} dead letters, expected {} and 0",
                sum.counts.dead_lettered, s.records
            )
            .into());
        }
        b_enrich.push(sum.records_per_second());
        loads.push(startup);
        if round == 0 {
            let first = kafka::read_topic(
                &s.bootstrap,
                &out,
                false,
                std::time::Duration::from_secs(60),
            )?;
            let v =
                String::from_utf8_lossy(first[0].value.as_deref().unwrap_or_default()).into_owned();
            if !v.contains(r#""customer":{"name":"Customer "#) {
                return Err(format!("an output record is not enriched: {v}").into());
            }
        }
        eprintln!("broker round {}: passthrough {:.0}/s, enrich {:.0}/s (start-up incl. table load {:.2} s)",
            round + 1, b_pass[round], b_enrich[round], startup);
    }

    let (mp, mm, ms) = (median(&t_pass), median(&t_mem), median(&t_sled));
    let (bp, be) = (median(&b_pass), median(&b_enrich));
    println!();
    println!(
        "Enrichment vs passthrough, {} orders, {} customers, {} rounds (medians)",
        s.records, customers, s.rounds
    );
    println!(
        "  broker: passthrough      {:>10.0} records/s   [{}]",
        bp,
        rate_list(&b_pass)
    );
    println!(
        "  broker: enrich           {:>10.0} records/s   [{}]",
        be,
        rate_list(&b_enrich)
    );
    println!("  broker: enrich/passthrough ratio {:.3}", be / bp);
    println!(
        "  broker: enrich start-up incl. loading {} table rows: {:.2} s (median)",
        customers,
        median(&loads)
    );
    println!(
        "  tasks:  passthrough      {:>10.0} records/s   [{}]",
        mp,
        rate_list(&t_pass)
    );
    println!(
        "  tasks:  enrich (sled)    {:>10.0} records/s   [{}]",
        ms,
        rate_list(&t_sled)
    );
    println!(
        "  tasks:  enrich (memory)  {:>10.0} records/s   [{}]",
        mm,
        rate_list(&t_mem)
    );
    println!(
        "  tasks:  enrich(sled)/passthrough ratio {:.3}, enrich(memory)/passthrough {:.3}",
        ms / mp,
        mm / mp
    );
    println!(
        "bench-enrich: records={} customers={} broker_passthrough_rps={:.0} broker_enrich_rps={:.0} broker_ratio={:.3} tasks_passthrough_rps={:.0} tasks_enrich_sled_rps={:.0} tasks_enrich_memory_rps={:.0} tasks_ratio_sled={:.3}",
        s.records, customers, bp, be, be / bp, mp, ms, mm, ms / mp
    );
    Ok(())
}

fn main() -> ExitCode {
    init_logging();
    let (s, customers) = match Settings::from_env(500_000)
        .and_then(|s| Ok((s, env_usize("ONCEFLOW_BENCH_CUSTOMERS", 10_000)?)))
    {
        Ok(x) => x,
        Err(e) => {
            eprintln!("bench-enrich: {e}");
            return ExitCode::from(2);
        }
    };
    let mut created = Created::default();
    let res = run(&s, customers, &mut created);
    cleanup(&s, &created);
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-enrich: {e}");
            ExitCode::from(1)
        }
    }
}
