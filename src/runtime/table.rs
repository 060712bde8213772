//! Lookup tables at run time, as Kafka Streams runs a GlobalKTable: before the instance
//! processes a record, every table is loaded from *all* partitions of its topic up to the
//! end offsets captured at start; then a background thread keeps following the topics, so
//! a table update changes the joins of later records.
//!
//! The table topic is the table's changelog. Each table's sled tree stores, in the same
//! atomic batch as its rows, the next offset to read of every partition: with the state dir
//! kept, loading resumes from there; with it wiped, the table is read again from the start
//! of its topic. A stored offset past a partition's end (the topic was deleted and created
//! again) clears the table and reloads it. Reads are `read_committed`; offsets are never
//! committed to the group coordinator (the tree holds them). The load ends when each
//! partition's consumer position reaches the high watermark captured at start, so an open
//! transaction on a table topic holds the start-up until it commits or aborts.
//!
//! Updates the follower applies are visible to lookups at once; a lookup never waits for
//! the follower, so joins see the table as of the moment they run.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kafka::admin::Admin;
use crate::state::table::{apply_records, TableEngine, TableRecord, Tables};
use crate::state::SledBackend;
use crate::topology::{Format, Topology};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Records taken per batch (one atomic table write per table and batch).
const BATCH: usize = 10_000;

struct Loaded {
    name: String,
    topic: String,
    format: Format,
    engine: Arc<dyn TableEngine>,
}

/// The error of a table whose topic does not exist (checked before start-up creates any
/// topic, and again when the table is loaded).
pub(crate) fn missing_table_topic(spec: &crate::topology::TableSpec, config: &Config) -> Error {
    Error::MissingTopic(format!(
        "table topic {} of table {} does not exist on {}; create it (cleanup.policy=compact) and write the table to it",
        spec.topic, spec.name, config.bootstrap_servers
    ))
}

/// The loaded tables of an instance and the thread that keeps them following their topics.
/// Dropping it stops the thread.
pub(crate) struct TableSet {
    handles: Tables,
    stop: Arc<AtomicBool>,
    follower: Option<std::thread::JoinHandle<()>>,
}

impl TableSet {
    /// Open every table of `topology` in `backend`, load it to the end of its topic, and
    /// start following. Returns at once when the topology has no tables.
    ///
    /// # Errors
    /// [`Error::MissingTopic`] when a table topic does not exist; [`Error::Kafka`] when the
    /// consumer cannot be created or assigned, or watermarks cannot be read;
    /// [`Error::State`] when a table write fails. Returns `Ok` early, partly loaded, when
    /// `shutdown` is set during the load.
    pub(crate) fn start(
        config: &Config,
        topology: &Topology,
        backend: &SledBackend,
        shutdown: &Arc<AtomicBool>,
    ) -> Result<TableSet> {
        let stop = Arc::new(AtomicBool::new(false));
        if topology.tables().is_empty() {
            return Ok(TableSet {
                handles: Tables::new(),
                stop,
                follower: None,
            });
        }
        let admin = Admin::new(config)?;
        let consumer: BaseConsumer = crate::kafka::client_config(
            config,
            &[
                ("group.id", &format!("{}-tables", config.application_id)),
                ("enable.auto.commit", "false"),
                ("enable.auto.offset.store", "false"),
                ("auto.offset.reset", "earliest"),
                ("isolation.level", "read_committed"),
                ("enable.partition.eof", "false"),
            ],
            &config.kafka_consumer,
        )
        .create()
        .map_err(crate::kafka::config_error)?;
        let mut tables: Vec<Loaded> = Vec::new();
        let mut handles = Tables::new();
        let mut tpl = TopicPartitionList::new();
        let mut ends: BTreeMap<(String, i32), (i64, i64)> = BTreeMap::new();
        for spec in topology.tables() {
            let n = admin
                .partition_count(&spec.topic)?
                .ok_or_else(|| missing_table_topic(spec, config))?;
            warn_unless_compacted(&admin, &spec.name, &spec.topic);
            let engine: Arc<dyn TableEngine> = backend.open_table(&spec.name)?;
            let mut marks = Vec::with_capacity(n);
            for p in 0..n as i32 {
                let (low, high) =
                    crate::kafka::retry::retry_known_topic("fetch table watermarks", || {
                        consumer
                            .fetch_watermarks(&spec.topic, p, Duration::from_secs(30))
                            .map_err(Error::kafka("fetch table watermarks"))
                    })?;
                marks.push((p, low, high));
            }
            let mut stored = engine.offsets()?;
            if marks
                .iter()
                .any(|(p, _, high)| stored.get(p).is_some_and(|o| o > high))
                || stored.keys().any(|p| *p >= n as i32)
            {
                tracing::warn!(table = %spec.name, topic = %spec.topic,
                    "stored table offsets lie past the topic's end (was it recreated?): reloading the table");
                engine.clear()?;
                stored.clear();
            }
            let mut total = 0;
            for (p, low, high) in marks {
                let start = stored.get(&p).copied().unwrap_or(low).max(low);
                total += (high - start).max(0);
                ends.insert((spec.topic.clone(), p), (start, high));
                tpl.add_partition_offset(&spec.topic, p, Offset::Offset(start))
                    .map_err(Error::kafka("table partition list"))?;
            }
            tracing::info!(table = %spec.name, topic = %spec.topic, partitions = n,
                records = total, resumed = !stored.is_empty(), "loading table");
            handles.insert(spec.name.clone(), engine.clone());
            tables.push(Loaded {
                name: spec.name.clone(),
                topic: spec.topic.clone(),
                format: spec.format.clone(),
                engine,
            });
        }
        consumer
            .assign(&tpl)
            .map_err(Error::kafka("assign table partitions"))?;
        load(&consumer, &tables, &ends, shutdown)?;
        let follower = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("onceflow-tables".into())
                .spawn(move || follow(consumer, tables, stop))
                .map_err(|e| Error::Io {
                    path: "table follower thread".into(),
                    source: e,
                })?
        };
        Ok(TableSet {
            handles,
            stop,
            follower: Some(follower),
        })
    }

    /// The tables by name, for [`crate::runtime::Task::with_tables`].
    pub(crate) fn handles(&self) -> Tables {
        self.handles.clone()
    }
}

impl Drop for TableSet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.follower.take() {
            let _ = t.join();
        }
    }
}

/// Poll up to [`BATCH`] records (waiting at most `wait` for the first) and apply them, one
/// batch per table. Returns the number of records applied.
fn step(consumer: &BaseConsumer, tables: &[Loaded], wait: Duration) -> Result<usize> {
    let mut by_topic: BTreeMap<String, Vec<TableRecord>> = BTreeMap::new();
    let mut n = 0;
    let mut wait = wait;
    while n < BATCH {
        match consumer.poll(wait) {
            None => break,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "table consumer error");
                break;
            }
            Some(Ok(m)) => {
                by_topic
                    .entry(m.topic().to_string())
                    .or_default()
                    .push(TableRecord {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        value: m.payload().map(<[u8]>::to_vec),
                    });
                n += 1;
            }
        }
        wait = Duration::ZERO;
    }
    for t in tables {
        // Tables may share a topic; each applies the whole batch of its topic.
        if let Some(recs) = by_topic.get(&t.topic) {
            apply_records(t.engine.as_ref(), &t.format, recs)?;
        }
    }
    Ok(n)
}

/// Read until every table partition's position reaches its end captured at start.
fn load(
    consumer: &BaseConsumer,
    tables: &[Loaded],
    ends: &BTreeMap<(String, i32), (i64, i64)>,
    shutdown: &Arc<AtomicBool>,
) -> Result<()> {
    let started = Instant::now();
    let mut last_log = Instant::now();
    let mut applied = 0u64;
    loop {
        let positions = consumer
            .position()
            .map_err(Error::kafka("table positions"))?;
        // A partition is loaded when its position reached the end captured at start (or
        // there was nothing to read); transaction markers take offsets, so the position,
        // not the last record's offset, is what counts.
        let behind: i64 = ends
            .iter()
            .map(|((topic, p), (start, end))| {
                if end <= start {
                    return 0;
                }
                match positions.find_partition(topic, *p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => (*end - o).max(0),
                    _ => *end - *start,
                }
            })
            .sum();
        if behind == 0 {
            break;
        }
        if shutdown.load(Ordering::SeqCst) {
            tracing::info!("shutdown requested while loading tables");
            return Ok(());
        }
        applied += step(consumer, tables, Duration::from_millis(100))? as u64;
        if last_log.elapsed() >= Duration::from_secs(2) {
            tracing::info!(applied, behind, "loading tables");
            last_log = Instant::now();
        }
    }
    for t in tables {
        tracing::info!(table = %t.name, "table loaded");
    }
    tracing::info!(
        records = applied,
        seconds = format!("{:.3}", started.elapsed().as_secs_f64()),
        "tables loaded"
    );
    Ok(())
}

/// Keep applying table topic records until `stop`. A table write failure stops following
/// (the table stays as it was, logged at error level): joins go on against it.
fn follow(consumer: BaseConsumer, tables: Vec<Loaded>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        if let Err(e) = step(&consumer, &tables, Duration::from_millis(100)) {
            tracing::error!(error = %e, "a table update failed: tables stop following their topics");
            return;
        }
    }
}

/// Warn when table `table`'s topic may delete rows the table still holds: a topic whose
/// `cleanup.policy` is not `compact` (or `compact,delete` with a time or size bound) loses
/// its old rows to retention, and a table loaded again from it (a new instance, a wiped
/// state dir) silently lacks them. Not an error: the topic is the user's, and one that is
/// never trimmed (`retention.ms=-1`) is fine. A configuration that cannot be read is
/// logged at debug level and the check skipped.
fn warn_unless_compacted(admin: &Admin, table: &str, topic: &str) {
    match admin.topic_configs(topic) {
        Ok(configs) => {
            if let Some(w) = compaction_warning(table, topic, &configs) {
                tracing::warn!(table = %table, topic = %topic, "{w}");
            }
        }
        Err(e) => tracing::debug!(table = %table, topic = %topic,
            "cannot read the table topic's configuration, not checking its cleanup policy: {e}"),
    }
}

/// The warning for table `table` read from `topic` with configuration `configs` (as
/// [`Admin::topic_configs`] returns it), or `None` when the topic keeps every key's latest
/// row (compacted without a time or size bound, or never trimmed at all).
fn compaction_warning(
    table: &str,
    topic: &str,
    configs: &BTreeMap<String, (String, bool)>,
) -> Option<String> {
    let plain: BTreeMap<String, String> = configs
        .iter()
        .map(|(k, (v, _))| (k.clone(), v.clone()))
        .collect();
    let get = |k: &str| plain.get(k).map(String::as_str);
    if get("retention.ms") == Some("-1") && get("retention.bytes").unwrap_or("-1") == "-1" {
        return None;
    }
    let m = crate::kafka::admin::changelog_mismatches(&plain);
    let m = m.first()?;
    Some(format!(
        "table topic {topic} of table {table} may delete rows: its {m}; \
         rows older than its retention are missing whenever the table is loaded again \
         (a new instance, a wiped state dir). Set cleanup.policy=compact on it"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> BTreeMap<String, (String, bool)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), (v.to_string(), true)))
            .collect()
    }

    /// A table topic that retention can trim gets a warning naming the table, the topic
    /// and what was found; a compacted or never-trimmed one gets none.
    #[test]
    fn a_table_topic_that_may_delete_rows_is_named() {
        let w = compaction_warning(
            "customers",
            "cust",
            &cfg(&[("cleanup.policy", "delete"), ("retention.ms", "604800000")]),
        )
        .expect("delete policy warns");
        assert!(w.contains("table topic cust of table customers"), "{w}");
        assert!(
            w.contains("cleanup.policy is delete (retention.ms=604800000"),
            "{w}"
        );
        assert!(
            compaction_warning("c", "t", &cfg(&[])).is_some(),
            "broker default is delete"
        );
        assert!(compaction_warning(
            "c",
            "t",
            &cfg(&[
                ("cleanup.policy", "compact,delete"),
                ("retention.ms", "1000")
            ])
        )
        .is_some());
        assert_eq!(
            compaction_warning("c", "t", &cfg(&[("cleanup.policy", "compact")])),
            None
        );
        assert_eq!(
            compaction_warning(
                "c",
                "t",
                &cfg(&[("cleanup.policy", "delete"), ("retention.ms", "-1")])
            ),
            None,
            "a topic never trimmed keeps every row"
        );
        assert_eq!(
            compaction_warning(
                "c",
                "t",
                &cfg(&[
                    ("cleanup.policy", "compact,delete"),
                    ("retention.ms", "-1"),
                    ("retention.bytes", "-1")
                ])
            ),
            None
        );
    }
}
