//! The Kafka run loop and the at_least_once commit protocol.
//!
//! # Commit protocol (at_least_once), in this order, per commit interval
//! 1. process records: each task's stages stage their state writes (lookups see the
//!    staged writes of the same batch) and their outputs are queued on the producer;
//! 2. flush the producer: wait until every output and dead letter is acknowledged;
//! 3. apply each task's staged writes to its sled tree in one batch, and fsync;
//! 4. commit the consumer offsets of the processed records.
//!
//! A crash anywhere before 4 replays the batch from the last committed offsets: its outputs
//! may appear twice, never get lost. Because 3 follows 2, a dedup mark is never written for
//! an output that is not durable, so a replayed record whose mark exists truly was emitted.
//! Because 4 follows 3, no committed offset stands for state that could be lost.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kafka::admin::Admin;
use crate::kafka::consumer::{self, RebalanceListener, SourceConsumer};
use crate::kafka::producer::OutputProducer;
use crate::processor::{Counts, OutRecord, Record, SourceMeta};
use crate::runtime::{failpoint, Task};
use crate::state::{SledBackend, StateBackend};
use crate::topology::Topology;
use bytes::Bytes;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Options of one run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Stop (committing everything) once every assigned partition has been read to its end.
    pub stop_at_end: bool,
    /// Set to true to stop gracefully (SIGTERM/SIGINT): finish the record in hand, commit,
    /// close the stores.
    pub shutdown: Arc<AtomicBool>,
}

/// What a run did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RunSummary {
    /// Totals by outcome.
    pub counts: Counts,
    /// Wall-clock seconds from the first record to the end of the run.
    pub seconds: f64,
    /// Commits made.
    pub commits: u64,
}

impl RunSummary {
    /// Source records per second.
    pub fn records_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.counts.records_in as f64 / self.seconds
        } else {
            0.0
        }
    }

    /// One line, `key=value` pairs, printed by `onceflow run` at exit.
    pub fn line(&self) -> String {
        let c = &self.counts;
        format!(
            "summary: records_in={} passed={} duplicates={} conflicts={} dead_lettered={} records_out={} commits={} seconds={:.3} records_per_second={:.0}",
            c.records_in, c.passed, c.duplicates, c.conflicts, c.dead_lettered, c.records_out,
            self.commits, self.seconds, self.records_per_second()
        )
    }
}

/// A topology bound to a config, ready to run against Kafka.
pub struct App {
    config: Config,
    topology: Topology,
}

struct Engine {
    topology: Topology,
    config: Config,
    backend: SledBackend,
    producer: OutputProducer,
    tasks: BTreeMap<i32, Task>,
    at_end: BTreeSet<i32>,
    closed_counts: Counts,
    last_commit: Instant,
    uncommitted: usize,
    commits: u64,
    failed: Option<Error>,
    out: Vec<OutRecord>,
    first_record: Option<Instant>,
}

impl Engine {
    fn process(&mut self, m: &BorrowedMessage<'_>) -> Result<()> {
        let p = m.partition();
        self.first_record.get_or_insert_with(Instant::now);
        self.at_end.remove(&p);
        let task = match self.tasks.get_mut(&p) {
            Some(t) => t,
            None => {
                // Assignment callback not seen yet (cannot happen with librdkafka's ordering,
                // but never process a record without its task and stores).
                let t = Task::new(&self.topology, p, &self.backend, &self.config.dlq_topic)?;
                self.tasks.entry(p).or_insert(t)
            }
        };
        let record = to_record(m, &self.topology.source().topic);
        let wall = wall_clock_ms();
        task.process(record, wall, &mut self.out)?;
        for o in self.out.drain(..) {
            self.producer.send(&o)?;
        }
        self.uncommitted += 1;
        Ok(())
    }

    fn commit_due(&self) -> bool {
        self.uncommitted > 0
            && (self.last_commit.elapsed() >= Duration::from_millis(self.config.commit_interval_ms)
                || self.uncommitted >= 200_000)
    }

    /// The commit protocol: flush outputs, apply state, fsync, commit offsets.
    fn commit(
        &mut self,
        consumer: &SourceConsumer,
        mode: CommitMode,
        only: Option<&[i32]>,
    ) -> Result<()> {
        self.last_commit = Instant::now();
        if self.uncommitted == 0 {
            return Ok(());
        }
        // 1-2. Outputs and dead letters durable.
        failpoint::hit("commit.before_flush");
        self.producer.flush(Duration::from_secs(600))?;
        failpoint::hit("commit.after_flush");
        // 3. State: one batch per store, then one fsync.
        let mut tpl = TopicPartitionList::new();
        let topic = self.topology.source().topic.clone();
        for (p, t) in self.tasks.iter_mut() {
            if only.is_some_and(|o| !o.contains(p)) {
                continue;
            }
            t.commit_state()?;
            if let Some(pos) = t.position() {
                tpl.add_partition_offset(&topic, *p, Offset::Offset(pos))
                    .map_err(Error::kafka("build offsets"))?;
            }
        }
        self.backend.flush()?;
        failpoint::hit("commit.after_state");
        // 4. Offsets.
        if tpl.count() > 0 {
            consumer
                .commit(&tpl, mode)
                .map_err(Error::kafka("commit offsets"))?;
        }
        if only.is_none() {
            self.uncommitted = 0;
        }
        self.commits += 1;
        metrics::counter!(crate::metrics::COMMITS, "topology" => self.topology.name().to_string())
            .increment(1);
        Ok(())
    }

    fn all_at_end(&self) -> bool {
        !self.tasks.is_empty() && self.tasks.keys().all(|p| self.at_end.contains(p))
    }
}

struct Listener {
    engine: Arc<Mutex<Engine>>,
}

impl RebalanceListener for Listener {
    fn on_revoke(&self, consumer: &SourceConsumer, partitions: &[i32]) {
        let mut e = self.engine.lock().expect("engine lock");
        tracing::info!(?partitions, "partitions revoked: committing their work");
        // The producer flush covers every partition's outputs, so commit all of them: the
        // partitions we keep lose nothing by an early commit.
        if let Err(err) = e.commit(consumer, CommitMode::Sync, None) {
            tracing::error!(error = %err, "commit on revocation failed");
            e.failed.get_or_insert(err);
            return;
        }
        for p in partitions {
            if let Some(t) = e.tasks.remove(p) {
                let c = *t.counts();
                e.closed_counts.add(&c);
            }
            e.at_end.remove(p);
        }
    }

    fn on_assign(&self, _consumer: &SourceConsumer, partitions: &[i32]) {
        let mut e = self.engine.lock().expect("engine lock");
        tracing::info!(?partitions, "partitions assigned");
        for p in partitions {
            if e.tasks.contains_key(p) {
                continue;
            }
            match Task::new(&e.topology, *p, &e.backend, &e.config.dlq_topic) {
                Ok(t) => {
                    e.tasks.insert(*p, t);
                }
                Err(err) => {
                    e.failed.get_or_insert(err);
                }
            }
        }
    }
}

fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn to_record(m: &BorrowedMessage<'_>, topic: &str) -> Record {
    let headers = match m.headers() {
        None => Vec::new(),
        Some(h) => h
            .iter()
            .map(|h| (h.key.to_string(), h.value.map(Bytes::copy_from_slice)))
            .collect(),
    };
    Record {
        key: m.key().map(Bytes::copy_from_slice),
        value: m.payload().map(Bytes::copy_from_slice),
        headers,
        timestamp: m.timestamp().to_millis(),
        json: None,
        source: SourceMeta {
            topic: topic.into(),
            partition: m.partition(),
            offset: m.offset(),
        },
    }
}

impl App {
    /// Bind `topology` to `config`.
    pub fn new(config: Config, topology: Topology) -> App {
        App { config, topology }
    }

    /// Check the topics before the run: the source must exist; missing sink topics and the
    /// dead-letter topic are created with the source's partition count.
    ///
    /// # Errors
    /// [`Error::Broker`] when the source topic is missing or topics cannot be created.
    pub fn prepare_topics(&self) -> Result<usize> {
        let admin = Admin::new(&self.config)?;
        let src = &self.topology.source().topic;
        let n = admin.partition_count(src)?.ok_or_else(|| {
            Error::Broker(format!(
                "source topic {src} does not exist on {}; create it first",
                self.config.bootstrap_servers
            ))
        })?;
        let mut topics = self.topology.sink_topics();
        topics.push(self.config.dlq_topic.clone());
        for t in topics {
            if admin.ensure_topic(&t, n, &[])? {
                tracing::info!(topic = %t, partitions = n, "created topic");
            }
        }
        Ok(n)
    }

    /// Run until shutdown is requested (or, with `stop_at_end`, the input is exhausted).
    ///
    /// # Errors
    /// Start-up errors (state dir locked, source topic missing, bad `kafka.*` property) and
    /// fatal run errors (a delivery that failed for good, a store failure). Nothing of the
    /// failed batch is committed: a restart processes it again.
    pub fn run(&self, opts: RunOptions) -> Result<RunSummary> {
        self.prepare_topics()?;
        let dir = self.config.state_dir.join(&self.config.application_id);
        let backend = SledBackend::open(&dir)?;
        let producer = OutputProducer::new(&self.config)?;
        let engine = Arc::new(Mutex::new(Engine {
            topology: self.topology.clone(),
            config: self.config.clone(),
            backend,
            producer,
            tasks: BTreeMap::new(),
            at_end: BTreeSet::new(),
            closed_counts: Counts::default(),
            last_commit: Instant::now(),
            uncommitted: 0,
            commits: 0,
            failed: None,
            out: Vec::with_capacity(16),
            first_record: None,
        }));
        let consumer = consumer::create(
            &self.config,
            opts.stop_at_end,
            Arc::new(Listener {
                engine: engine.clone(),
            }),
        )?;
        consumer
            .subscribe(&[self.topology.source().topic.as_str()])
            .map_err(Error::kafka("subscribe"))?;
        tracing::info!(topology = self.topology.name(), source = %self.topology.source().topic,
            state = %dir.display(), "running");
        let result = self.run_loop(&consumer, &engine, &opts);
        let mut e = engine.lock().expect("engine lock");
        let result = result.and_then(|_| {
            // Graceful stop: commit what was processed, then leave the group.
            e.commit(&consumer, CommitMode::Sync, None)
        });
        drop(e);
        consumer.unsubscribe();
        let mut e = engine.lock().expect("engine lock");
        let mut counts = e.closed_counts;
        for t in e.tasks.values() {
            counts.add(t.counts());
        }
        e.tasks.clear();
        e.backend.flush()?;
        let seconds = e
            .first_record
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        let summary = RunSummary {
            counts,
            seconds,
            commits: e.commits,
        };
        result.map(|_| summary)
    }

    fn run_loop(
        &self,
        consumer: &SourceConsumer,
        engine: &Arc<Mutex<Engine>>,
        opts: &RunOptions,
    ) -> Result<()> {
        loop {
            if opts.shutdown.load(Ordering::SeqCst) {
                tracing::info!("shutdown requested: committing and closing");
                return Ok(());
            }
            let polled = consumer.poll(Duration::from_millis(100));
            let mut e = engine.lock().expect("engine lock");
            if let Some(err) = e.failed.take() {
                return Err(err);
            }
            match polled {
                None => {
                    if opts.stop_at_end && e.all_at_end() {
                        tracing::info!("every assigned partition is at its end: stopping");
                        return Ok(());
                    }
                }
                Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                    e.at_end.insert(p);
                }
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "consumer error");
                }
                Some(Ok(m)) => e.process(&m)?,
            }
            if e.commit_due() {
                e.commit(consumer, CommitMode::Async, None)?;
            }
        }
    }
}
