//! Internals that the workspace's own tests, benchmarks and crash harness (`tests/`,
//! `testkit/`) drive directly. Not part of the API: no stability, no documentation.
//!
//! Each entry point does one whole thing a test or benchmark needs (create a topic, time
//! a restore, read a store back), so that the types behind it stay crate-private.

use crate::error::{Error, Result};
use crate::processor::{Counts, Record};
use crate::runtime::Task;
use crate::sink::effects::Effector;
use crate::sink::protocol::EffectOutcome;
use crate::sink::store::{IdempotencyStore, RedisIdempotencyStore, SledIdempotencyStore};
use crate::sink::{idempotency_scope, redis_prefix, ExternalSinkSpec, StoreSpec};
use crate::state::table::{MemoryTable, TableEngine, TableRecord, Tables};
use crate::state::{MemoryBackend, SledBackend, StateBackend};
use crate::{ChangelogRecord, Config, Format, OutRecord, Topology};
use bytes::Bytes;
use rdkafka::consumer::BaseConsumer;
use rdkafka::error::KafkaError;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The headers of a fetched record, a name that is not UTF-8 decoded with replacement
/// characters (what the run loop reads).
pub use crate::kafka::consumer::header_pairs;

/// Entries the expiry sweep of a dedup stage tombstones at most per commit.
pub const SWEEP_BATCH: usize = crate::processor::stages::SWEEP_BATCH;

/// at_least_once commits in flight at most (pipelined commits).
pub const MAX_IN_FLIGHT: usize = crate::runtime::commit::MAX_IN_FLIGHT;

// ------------------------------------------------------------------------ names

/// As `App::run` does at start: transparent huge pages off for this process and the
/// children it starts (see `crate::limit_huge_pages`).
pub fn limit_huge_pages() -> bool {
    crate::limit_huge_pages()
}

/// As `App::run` does at start: the allocator's purge delay for this process (see
/// `crate::limit_retained_memory`; not inherited by children, which call it themselves).
pub fn limit_retained_memory() -> Option<i64> {
    crate::limit_retained_memory()
}

/// Name of the changelog topic of `store` in application `app`.
pub fn changelog_topic(app: &str, store: &str) -> String {
    crate::state::restore::changelog_topic(app, store)
}

/// Name of the repartition topic of dedup stage `stage` in application `app`.
pub fn repartition_topic(app: &str, stage: &str) -> String {
    crate::processor::stages::repartition_topic(app, stage)
}

/// The partition of `key` among `partitions` (the repartition hop's partitioner).
pub fn partition_for(key: &[u8], partitions: i32) -> i32 {
    crate::processor::repartition::partition_for(key, partitions)
}

// ------------------------------------------------------------------------ process

/// Run `f` until it succeeds or fails with an error that is not transient, as onceflow
/// retries its own Kafka requests.
///
/// # Errors
/// The first error that is not transient, or the last transient one once the retry budget
/// is spent.
pub fn retry<T>(what: &str, f: impl FnMut() -> Result<T>) -> Result<T> {
    crate::kafka::retry::retry(what, f)
}

// ------------------------------------------------------------------------ admin

/// Create `topic` with `partitions` partitions and topic `configs` unless it exists, with
/// the bootstrap servers and `kafka.*` properties of `cfg`. Returns whether it was created.
///
/// # Errors
/// A client the config does not allow; a creation the broker refuses.
pub fn create_topic(
    cfg: &Config,
    topic: &str,
    partitions: usize,
    configs: &[(&str, &str)],
) -> Result<bool> {
    crate::kafka::admin::Admin::new(cfg)?.ensure_topic(topic, partitions, configs)
}

/// Delete what a run left: `topics`, then consumer `groups` with their committed offsets
/// (missing ones are fine).
///
/// # Errors
/// As [`create_topic`]; `NonEmptyGroup` while a group's members are active.
pub fn delete(cfg: &Config, topics: &[&str], groups: &[&str]) -> Result<()> {
    let admin = crate::kafka::admin::Admin::new(cfg)?;
    if !topics.is_empty() {
        admin.delete_topics(topics)?;
    }
    for group in groups {
        admin.delete_group(group)?;
    }
    Ok(())
}

/// The number of partitions of `topic`, `None` if it does not exist.
///
/// # Errors
/// As [`create_topic`]; metadata that cannot be fetched.
pub fn partition_count(cfg: &Config, topic: &str) -> Result<Option<usize>> {
    crate::kafka::admin::Admin::new(cfg)?.partition_count(topic)
}

/// Take up to `max` records from `consumer` in one call, as a restore reads its changelog
/// (`timeout` `Duration::ZERO`: only what is queued now), and hand `f` each one's
/// partition, offset and key plus value length, or the error librdkafka reported in its
/// place. Returns how many were taken.
///
/// # Errors
/// librdkafka refuses the call (no consumer queue).
pub fn read_batch(
    consumer: &BaseConsumer,
    timeout: Duration,
    max: usize,
    mut f: impl FnMut(std::result::Result<(i32, i64, usize), KafkaError>),
) -> std::result::Result<usize, KafkaError> {
    let batch = crate::kafka::batch::consume_batch(consumer, timeout, max)?;
    for r in batch.records() {
        f(r.map(|m| {
            let len = m.key().map_or(0, <[u8]>::len) + m.payload().map_or(0, <[u8]>::len);
            (m.partition(), m.offset(), len)
        }));
    }
    Ok(batch.len())
}

// ------------------------------------------------------------------------ state

/// A lookup table's records for [`drive_tasks`]: `(partition, offset, key, value)`.
pub type TableRows = Vec<(i32, i64, Option<Vec<u8>>, Option<Vec<u8>>)>;

/// What [`read_state`] returns: the stored next offsets by partition, and the values of the
/// keys asked for.
pub type StateRead = (BTreeMap<i32, i64>, Vec<Option<Vec<u8>>>);

/// Process `records` through one task per source partition of `topology` (as many as the
/// highest partition among them, at least one: with no record, it only builds a task's
/// processors and stores, as on assignment, and commits), each record at the next offset of its partition, timed
/// (the records are made source records before the clock starts). Stores and `tables`
/// (name, rows in log order as (partition, offset, key, value), loaded before the clock
/// starts, with the format the topology gives the table) live in sled under `sled_dir`, or
/// in memory. State is committed (and the backend flushed) every
/// `commit_every` records (0: never) and at the end. Each record is processed at wall
/// clock `wall_clock_ms`, or the clock's time when `None`.
///
/// Returns the totals over the tasks, the seconds taken, and the records written to topics
/// other than the dead-letter topic.
///
/// # Errors
/// A store failure.
pub fn drive_tasks(
    topology: &Topology,
    sled_dir: Option<&Path>,
    tables: &[(&str, TableRows)],
    records: Vec<crate::TestRecord>,
    commit_every: usize,
    wall_clock_ms: Option<i64>,
) -> Result<(Counts, f64, usize)> {
    const DLQ: &str = "dlq";
    let sled = sled_dir.map(SledBackend::open).transpose()?;
    let memory = MemoryBackend::default();
    let backend: &dyn StateBackend = match &sled {
        Some(s) => s,
        None => &memory,
    };
    let mut loaded = Tables::new();
    for (name, rows) in tables {
        let engine: Arc<dyn TableEngine> = match &sled {
            Some(s) => s.open_table(name)?,
            None => Arc::new(MemoryTable::new(name)),
        };
        let format = topology
            .tables()
            .iter()
            .find(|t| t.name == *name)
            .map_or(Format::Json, |t| t.format.clone());
        let rows: Vec<TableRecord> = rows
            .iter()
            .map(|(partition, offset, key, value)| TableRecord {
                partition: *partition,
                offset: *offset,
                key: key.clone(),
                value: value.clone(),
            })
            .collect();
        crate::state::table::apply_records(engine.as_ref(), &format, &rows)?;
        loaded.insert(name.to_string(), engine);
    }
    let (records, partitions) = source_records(records, topology.source().topic.as_str());
    let mut tasks: Vec<Task> = (0..partitions)
        .map(|p| Ok(Task::new(topology, p, backend, DLQ)?.with_tables(loaded.clone())))
        .collect::<Result<_>>()?;
    let commit = |tasks: &mut [Task]| -> Result<()> {
        for t in tasks.iter_mut() {
            t.commit_state(|_| None)?;
        }
        backend.flush()
    };
    let mut out: Vec<OutRecord> = Vec::with_capacity(4);
    let mut written = 0;
    let started = Instant::now();
    for (i, r) in records.into_iter().enumerate() {
        let p = r.source.partition as usize;
        let wall = wall_clock_ms.unwrap_or_else(crate::tools::now_ms);
        tasks[p].process(r, wall, &mut out)?;
        written += out.iter().filter(|o| o.topic != DLQ).count();
        out.clear();
        if commit_every > 0 && (i + 1) % commit_every == 0 {
            commit(&mut tasks)?;
        }
    }
    commit(&mut tasks)?;
    let seconds = started.elapsed().as_secs_f64();
    let mut counts = Counts::default();
    for t in &tasks {
        counts.add(t.counts());
    }
    Ok((counts, seconds, written))
}

/// `records` as source records of `topic`, each partition's numbered from offset 0, and
/// the partition count they need (the highest partition + 1; 1 when there is none).
fn source_records(records: Vec<crate::TestRecord>, topic: &str) -> (Vec<Record>, i32) {
    let topic: Arc<str> = topic.into();
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    let records: Vec<Record> = records
        .into_iter()
        .map(|r| {
            let offset = next.entry(r.source_partition()).or_default();
            *offset += 1;
            r.into_record(topic.clone(), *offset - 1)
        })
        .collect();
    let partitions = next.keys().max().map_or(1, |p| p + 1);
    (records, partitions)
}

/// The dedup stage alone: one stage named `dedup` (built from `spec`) and its store per
/// partition, with the store in sled under `sled_dir` (written behind, as `App::run` does)
/// or in memory when `None`, over `records`, committing every store every `commit_every`
/// records (and once at the end) as the runtime commits state; each mark settles after
/// its record, as in a task where no later stage can fail it. No source decoding, no
/// task bookkeeping and no sink: what a record costs the stage's lookup, decision and
/// staging, plus the store commits. Records are built before the clock starts. Returns
/// the stage's counts and the seconds taken.
///
/// # Errors
/// A store that fails to open or commit, or a record the stage refuses.
pub fn drive_dedup(
    spec: crate::DedupSpec,
    sled_dir: Option<&Path>,
    records: Vec<crate::TestRecord>,
    commit_every: usize,
) -> Result<(Counts, f64)> {
    use crate::processor::stages::dedup_stage::Dedup;
    use crate::processor::{Context, Processor, Stores};
    use crate::state::StagedStore;
    let sled = sled_dir.map(SledBackend::open).transpose()?;
    let memory = MemoryBackend::default();
    let backend: &dyn StateBackend = match &sled {
        Some(s) => s,
        None => &memory,
    };
    let (records, partitions) = source_records(records, "dedup.in");
    let records_in = records.len() as u64;
    let mut tasks: Vec<(Dedup, Stores)> = (0..partitions)
        .map(|p| {
            let mut stores = Stores::new();
            let engine = backend.open("dedup", p)?;
            stores.insert(
                "dedup".to_string(),
                StagedStore::new(engine, backend.writer()),
            );
            Ok((Dedup::new("bench", "dedup", "dedup", spec.clone()), stores))
        })
        .collect::<Result<_>>()?;
    let tables = Tables::new();
    let (mut forwarded, mut emitted) = (Vec::with_capacity(4), Vec::new());
    let mut counts = Counts::default();
    let commit = |tasks: &mut [(Dedup, Stores)]| -> Result<()> {
        for (stage, stores) in tasks.iter_mut() {
            for s in stores.values_mut() {
                s.commit(None)?;
            }
            stage.on_commit();
        }
        backend.flush()
    };
    let no_limits = std::collections::HashMap::new();
    let started = Instant::now();
    for (i, r) in records.into_iter().enumerate() {
        let (stage, stores) = &mut tasks[r.source.partition as usize];
        let mut ctx = Context {
            stores,
            forwarded: &mut forwarded,
            emitted: &mut emitted,
            counts: &mut counts,
            tables: &tables,
            wall_clock_ms: 0,
            max_record_bytes: crate::processor::DEFAULT_MAX_RECORD_BYTES,
            topic_limits: &no_limits,
        };
        stage
            .process(r, &mut ctx)
            .map_err(|e| Error::Internal(format!("the dedup stage refused a record: {e:?}")))?;
        forwarded.clear();
        // As the task does when no later stage can fail the record: its mark stands.
        for s in stores.values_mut() {
            s.settle();
        }
        if commit_every > 0 && (i + 1) % commit_every == 0 {
            commit(&mut tasks)?;
        }
    }
    commit(&mut tasks)?;
    let seconds = started.elapsed().as_secs_f64();
    counts.records_in = records_in;
    Ok((counts, seconds))
}

/// The restore steps of `records` (per partition, in log order): `per_step` records a
/// step shared among the partitions, as the run loop takes them; each step is (partition,
/// its records, the position after them).
fn restore_steps(
    records: &[Vec<ChangelogRecord>],
    per_step: usize,
) -> Vec<(usize, &[ChangelogRecord], i64)> {
    let per_step = (per_step / records.len().max(1)).max(1);
    let longest = records.iter().map(Vec::len).max().unwrap_or(0);
    let mut steps = Vec::new();
    for at in (0..longest).step_by(per_step) {
        for (p, recs) in records.iter().enumerate() {
            let chunk = &recs[at.min(recs.len())..(at + per_step).min(recs.len())];
            if let Some(last) = chunk.last() {
                steps.push((p, chunk, last.offset + 1));
            }
        }
    }
    steps
}

/// A restore of `store` without Kafka, timed: the changelog `records` of each partition
/// (index = partition), `per_step` records a step shared among the partitions as the run
/// loop takes them, into a fresh sled database under `dir`. Without `topology`, the apply
/// side alone: each partition's restore writes its steps synchronously (the steps are
/// built, owned, before the clock starts). With it, the runtime's restore path: one task of
/// `topology` per partition restoring record by record into write-behind stores, with the
/// state writer held (as during a restore). Returns the seconds taken.
///
/// # Errors
/// A store failure; a partition whose restore did not finish.
pub fn time_restore(
    topology: Option<&Topology>,
    dir: &Path,
    store: &str,
    records: &[Vec<ChangelogRecord>],
    per_step: usize,
) -> Result<f64> {
    use crate::state::restore::Restorer;
    let backend = SledBackend::open(dir)?;
    let steps = restore_steps(records, per_step);
    let not_done = |p: usize| Error::state(store, format!("partition {p} not done"));
    let Some(topology) = topology else {
        let mut engines = Vec::with_capacity(records.len());
        let mut restorers = Vec::with_capacity(records.len());
        for (p, recs) in records.iter().enumerate() {
            let e = backend.open(store, p as i32)?;
            let end = recs.len() as i64;
            restorers.push(Restorer::plan(store, p as i32, e.as_ref(), 0, end)?);
            engines.push(e);
        }
        // Owned, as the run loop gets its records from the consumer.
        let steps: Vec<(usize, Vec<ChangelogRecord>, i64)> = steps
            .into_iter()
            .map(|(p, recs, position)| (p, recs.to_vec(), position))
            .collect();
        let started = Instant::now();
        for (p, recs, position) in steps {
            restorers[p].apply(engines[p].as_ref(), recs, position)?;
        }
        if let Some(r) = restorers.iter().find(|r| !r.is_done()) {
            return Err(not_done(r.partition() as usize));
        }
        backend.flush()?;
        return Ok(started.elapsed().as_secs_f64());
    };
    let mut tasks = Vec::with_capacity(records.len());
    for (p, recs) in records.iter().enumerate() {
        let mut t = Task::new(topology, p as i32, &backend, "dlq")?;
        t.plan_restore(store, 0, recs.len() as i64)?;
        tasks.push(t);
    }
    let hold = backend.writer().map(|w| w.hold());
    let started = Instant::now();
    for (p, chunk, position) in steps {
        for r in chunk {
            tasks[p].restore_record(store, &r.key, r.value.as_deref(), r.offset);
        }
        tasks[p].finish_restore_step(store, position)?;
    }
    let secs = started.elapsed().as_secs_f64();
    if let Some(p) = tasks.iter().position(Task::is_restoring) {
        return Err(not_done(p));
    }
    drop(hold);
    Ok(secs)
}

/// Read back the state kept in the sled database `dir` (`<state.dir>/<application.id>`):
/// with `partition`, dedup store `name`'s partition (its changelog checkpoint as the one
/// offset); without, lookup table `name` (its stored next offset per partition). Returns
/// those offsets and the values of `keys`.
///
/// # Errors
/// A store failure (e.g. the database is open elsewhere).
pub fn read_state(
    dir: &Path,
    name: &str,
    partition: Option<i32>,
    keys: &[&[u8]],
) -> Result<StateRead> {
    let backend = SledBackend::open(dir)?;
    match partition {
        Some(p) => {
            let store = backend.open(name, p)?;
            let offsets = store.changelog_offset()?.map(|o| (p, o)).into_iter();
            let values = keys.iter().map(|k| store.get(k)).collect::<Result<_>>()?;
            Ok((offsets.collect(), values))
        }
        None => {
            let table = backend.open_table(name)?;
            let values = keys.iter().map(|k| table.get(k)).collect::<Result<_>>()?;
            Ok((table.offsets()?, values))
        }
    }
}

/// Write `batches` (partition, ops in order; a later op on a key wins) into dedup store
/// `store` of a fresh sled database under `dir`, each batch with the next changelog
/// offset, then flush; the stores of `partitions` partitions are opened first. Returns the
/// seconds from the first batch to the end of the flush.
///
/// # Errors
/// A store failure.
pub fn time_store_writes(
    dir: &Path,
    store: &str,
    partitions: i32,
    batches: impl IntoIterator<Item = (i32, Vec<(Bytes, Option<Bytes>)>)>,
) -> Result<f64> {
    let backend = SledBackend::open(dir)?;
    let stores = (0..partitions)
        .map(|p| backend.open(store, p))
        .collect::<Result<Vec<_>>>()?;
    let started = Instant::now();
    for (seq, (p, ops)) in batches.into_iter().enumerate() {
        stores[p as usize].write_ops(&crate::state::slices(&ops), Some(seq as i64), None)?;
    }
    backend.flush()?;
    Ok(started.elapsed().as_secs_f64())
}

// ------------------------------------------------------------------------ sinks

/// Whether a key completed in one idempotency scope is seen in another: complete key
/// `a.2` under the scope of topology `a.0` / sink `a.1` (`<topology>/<sink>`), then look
/// key `b.2` up under the scope of `b.0` / `b.1`, in the idempotency store of `sink` (sled
/// with an absolute path; Redis with each scope's default prefix unless one is given; a
/// PostgreSQL inbox, where both keys run `sink`'s postgres effect for a record with value
/// `{"id":5}`, and the second is seen when it is skipped as a duplicate).
///
/// # Errors
/// Another kind of store; a store or effect failure; a first inbox effect that did not run.
pub async fn key_seen_across_scopes(
    sink: &ExternalSinkSpec,
    a: (&str, &str, &[u8]),
    b: (&str, &str, &[u8]),
) -> std::result::Result<bool, String> {
    let scope = |(topology, name, _): (&str, &str, &[u8])| idempotency_scope(topology, name);
    if let StoreSpec::Postgres { table } = &sink.store {
        let eff = Effector::new("pg", &sink.effect, Duration::from_secs(5))?;
        let record = crate::TestRecord::json(r#"{"id":5}"#)
            .timestamp(0)
            .into_record("in".into(), 0);
        let prep = eff.prepare(&record)?;
        let first = eff
            .run_with_inbox(table, &scope(a), a.2, &prep)
            .await
            .map_err(|e| e.reason)?;
        if first.label() != "done" {
            return Err(format!("the first effect was {}", first.label()));
        }
        let second = eff.run_with_inbox(table, &scope(b), b.2, &prep).await;
        return match second.map_err(|e| e.reason)? {
            EffectOutcome::Done(_) => Ok(false),
            EffectOutcome::SkippedDuplicate(_) => Ok(true),
            other => Err(format!("the second effect was {}", other.label())),
        };
    }
    let open = |scope: String| async move {
        Ok::<Box<dyn IdempotencyStore>, String>(match &sink.store {
            StoreSpec::Sled { path: Some(path) } => {
                Box::new(SledIdempotencyStore::open(path, &scope).map_err(|e| e.0)?)
            }
            StoreSpec::Redis { url, prefix } => {
                let prefix = prefix.clone().unwrap_or_else(|| redis_prefix(&scope));
                Box::new(
                    RedisIdempotencyStore::connect(
                        &url.resolve()?,
                        prefix.as_bytes(),
                        Duration::from_secs(2),
                    )
                    .await
                    .map_err(|e| e.0)?,
                )
            }
            other => return Err(format!("no idempotency store to open: {other:?}")),
        })
    };
    let first = open(scope(a)).await?;
    let second = open(scope(b)).await?;
    first
        .complete(
            a.2,
            crate::sink::store::Completion {
                result: b"done by the first",
                ttl: Duration::from_secs(60),
            },
        )
        .await
        .map_err(|e| e.0)?;
    Ok(second.lookup(b.2).await.map_err(|e| e.0)?.is_some())
}
