//! The output producer: idempotent, with every delivery tracked so the commit protocol can
//! wait until what it produced is durable before it applies state and commits offsets.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::processor::OutRecord;
use crate::state::restore::ChangelogWrite;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Output slots of the tracker's `unacked` counts: epoch `e` counts in slot `e % EPOCH_SLOTS`
/// (far more than the commits in flight at once); slot `EPOCH_SLOTS` counts changelog
/// records.
const EPOCH_SLOTS: usize = 64;

/// Records delivery failures, and what is not yet acknowledged per commit epoch; checked
/// at each commit.
pub(crate) struct DeliveryTracker {
    failures: AtomicU64,
    /// Records sent and not yet acknowledged (delivered or failed), per slot.
    unacked: [AtomicI64; EPOCH_SLOTS + 1],
    first_failure: Mutex<Option<String>>,
    changelog_topics: std::collections::HashSet<String>,
    /// Highest delivered offset per changelog topic and partition.
    changelog_offsets:
        Mutex<std::collections::HashMap<String, std::collections::HashMap<i32, i64>>>,
}

impl ClientContext for DeliveryTracker {
    fn error(&self, error: KafkaError, reason: &str) {
        super::link::note_error(&error);
        tracing::error!(%error, reason, "librdkafka error (producer)");
    }
}

impl ProducerContext for DeliveryTracker {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, slot: usize) {
        if let Ok(msg) = result {
            use rdkafka::Message;
            if self.changelog_topics.contains(msg.topic()) {
                let mut m = self
                    .changelog_offsets
                    .lock()
                    .expect("delivery tracker lock");
                // No allocation per delivery: the topic's map exists after its first.
                let per_topic = match m.get_mut(msg.topic()) {
                    Some(t) => t,
                    None => m.entry(msg.topic().to_string()).or_default(),
                };
                let e = per_topic.entry(msg.partition()).or_insert(-1);
                *e = (*e).max(msg.offset());
            }
        }
        if let Err((e, msg)) = result {
            use rdkafka::Message;
            self.failures.fetch_add(1, Ordering::SeqCst);
            let mut f = self.first_failure.lock().expect("delivery tracker lock");
            if f.is_none() {
                *f = Some(format!(
                    "delivery to {}/{} failed: {e}",
                    msg.topic(),
                    msg.partition()
                ));
            }
        }
        // Counted down last: once a slot reads zero its records' reports are all in.
        if let Some(n) = self.unacked.get(slot) {
            n.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Idempotent producer for sink, dead-letter (and later changelog) records.
///
/// librdkafka retries each record until `delivery.timeout.ms` (default 300 s); a record
/// that still fails is a fatal error for the batch: [`OutputProducer::flush`] reports it
/// and the runtime stops without applying state or committing offsets, so the batch is
/// processed again on restart (at_least_once: never lost).
pub(crate) struct OutputProducer {
    producer: ThreadedProducer<DeliveryTracker>,
    /// The commit epoch outputs sent now count towards ([`OutputProducer::open_epoch`]).
    epoch: AtomicU64,
    /// [`crate::kafka::link::outages`] when the open transaction began.
    txn_outages: AtomicU64,
}

impl OutputProducer {
    /// Create the producer (`enable.idempotence=true`, `linger.ms=5`, and under
    /// exactly_once_v2 `transactional.id=<application.id>-<instance.id>`; then `kafka.*` and
    /// `kafka.producer.*`). `changelog_topics` are the topics whose delivered offsets are
    /// tracked for store checkpoints.
    ///
    /// # Errors
    /// [`Error::Config`] when librdkafka refuses a property.
    pub(crate) fn new(
        cfg: &Config,
        changelog_topics: std::collections::HashSet<String>,
    ) -> Result<OutputProducer> {
        let txn_id = cfg.transactional_id();
        let mut defaults = vec![("enable.idempotence", "true"), ("linger.ms", "5")];
        if cfg.exactly_once() {
            defaults.push(("transactional.id", txn_id.as_str()));
        }
        let producer = crate::kafka::client_config(cfg, &defaults, &cfg.kafka_producer)
            .create_with_context(DeliveryTracker {
                failures: AtomicU64::new(0),
                unacked: std::array::from_fn(|_| AtomicI64::new(0)),
                first_failure: Mutex::new(None),
                changelog_topics,
                changelog_offsets: Mutex::default(),
            })
            .map_err(crate::kafka::config_error)?;
        Ok(OutputProducer {
            producer,
            epoch: AtomicU64::new(0),
            txn_outages: AtomicU64::new(0),
        })
    }

    /// Queue `rec` for delivery, waiting while librdkafka's queue is full.
    ///
    /// # Errors
    /// [`Error::Kafka`] when librdkafka refuses the record for a reason other than a full
    /// queue (unknown topic, record too large).
    pub(crate) fn send(&self, rec: &OutRecord) -> Result<()> {
        let headers = (!rec.headers.is_empty()).then(|| {
            rec.headers.iter().fold(
                OwnedHeaders::new_with_capacity(rec.headers.len()),
                |h, (k, v)| {
                    h.insert(Header {
                        key: k.as_str(),
                        value: v.as_deref(),
                    })
                },
            )
        });
        self.send_output(
            &rec.topic,
            rec.partition,
            rec.key.as_deref(),
            rec.value.as_deref(),
            headers,
            rec.timestamp,
        )
    }

    /// Queue one record to `topic`/`partition` from borrowed parts (the repartition router's
    /// records); as [`OutputProducer::send`].
    ///
    /// # Errors
    /// As [`OutputProducer::send`].
    pub(crate) fn send_parts(
        &self,
        topic: &str,
        partition: i32,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        headers: &[(&str, Option<&[u8]>)],
        timestamp: Option<i64>,
    ) -> Result<()> {
        let headers = (!headers.is_empty()).then(|| {
            headers.iter().fold(
                OwnedHeaders::new_with_capacity(headers.len()),
                |h, (k, v)| h.insert(Header { key: k, value: *v }),
            )
        });
        self.send_output(topic, Some(partition), key, value, headers, timestamp)
    }

    /// Queue an output (counted towards the current epoch) from its parts.
    fn send_output(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
        timestamp: Option<i64>,
    ) -> Result<()> {
        let slot = (self.epoch.load(Ordering::Relaxed) % EPOCH_SLOTS as u64) as usize;
        let mut record: BaseRecord<'_, [u8], [u8], usize> = BaseRecord::with_opaque_to(topic, slot);
        if let Some(k) = key {
            record = record.key(k);
        }
        if let Some(v) = value {
            record = record.payload(v);
        }
        if let Some(p) = partition {
            record = record.partition(p);
        }
        if let Some(ts) = timestamp {
            record = record.timestamp(ts);
        }
        if let Some(h) = headers {
            record = record.headers(h);
        }
        self.send_record(record)
    }

    /// Queue one changelog record `write` (its `value` `None`: a tombstone) to `topic`,
    /// from borrowed bytes; as [`OutputProducer::send`].
    ///
    /// # Errors
    /// As [`OutputProducer::send`].
    pub(crate) fn send_changelog(&self, topic: &str, write: &ChangelogWrite<'_>) -> Result<()> {
        let mut record: BaseRecord<'_, [u8], [u8], usize> =
            BaseRecord::with_opaque_to(topic, EPOCH_SLOTS)
                .key(write.key)
                .partition(write.partition)
                .timestamp(write.timestamp_ms);
        if let Some(v) = write.value {
            record = record.payload(v);
        }
        self.send_record(record)
    }

    fn send_record(&self, mut record: BaseRecord<'_, [u8], [u8], usize>) -> Result<()> {
        let slot = &self.producer.context().unacked[record.delivery_opaque];
        // Counted before the send: its delivery report may come before `send` returns.
        slot.fetch_add(1, Ordering::SeqCst);
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err((e, _)) => {
                    slot.fetch_sub(1, Ordering::SeqCst);
                    return Err(Error::Kafka {
                        op: "produce",
                        source: e,
                    });
                }
            }
        }
    }

    /// Count the outputs sent from now on towards commit epoch `epoch` (see
    /// [`OutputProducer::epoch_acked`]).
    pub(crate) fn open_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// Whether every output sent under `epoch` has its delivery report, when every earlier
    /// epoch's has too (the commit protocol asks in epoch order); with `wait`, wait for it
    /// (at most `timeout`).
    ///
    /// # Errors
    /// [`Error::Broker`] naming the first failed delivery since the producer started;
    /// [`Error::Broker`] when `wait` timed out.
    pub(crate) fn epoch_acked(&self, epoch: u64, wait: bool, timeout: Duration) -> Result<bool> {
        let slot = (epoch % EPOCH_SLOTS as u64) as usize;
        self.slot_acked(slot, wait, timeout)
    }

    /// As [`OutputProducer::epoch_acked`] for every changelog record sent.
    ///
    /// # Errors
    /// As [`OutputProducer::epoch_acked`].
    pub(crate) fn changelog_acked(&self, wait: bool, timeout: Duration) -> Result<bool> {
        self.slot_acked(EPOCH_SLOTS, wait, timeout)
    }

    fn slot_acked(&self, slot: usize, wait: bool, timeout: Duration) -> Result<bool> {
        let n = &self.producer.context().unacked[slot];
        let done = || n.load(Ordering::SeqCst) <= 0;
        if wait && !done() {
            let deadline = std::time::Instant::now() + timeout;
            let mut pause = Duration::from_micros(50);
            while !done() {
                if std::time::Instant::now() >= deadline {
                    return Err(Error::Broker(format!(
                        "records not acknowledged within {} s",
                        timeout.as_secs()
                    )));
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
        self.check_failures()?;
        Ok(done())
    }

    fn check_failures(&self) -> Result<()> {
        let ctx = self.producer.context();
        if ctx.failures.load(Ordering::SeqCst) > 0 {
            let first = ctx
                .first_failure
                .lock()
                .expect("delivery tracker lock")
                .clone();
            return Err(Error::Broker(format!(
                "{} output record(s) could not be delivered; first: {}",
                ctx.failures.load(Ordering::SeqCst),
                first.unwrap_or_default()
            )));
        }
        Ok(())
    }

    /// The offset after the highest delivered record of changelog `topic`'s `partition`
    /// (what a store checkpoints after a commit), `None` before the first delivery.
    pub(crate) fn changelog_next_offset(&self, topic: &str, partition: i32) -> Option<i64> {
        self.producer
            .context()
            .changelog_offsets
            .lock()
            .expect("delivery tracker lock")
            .get(topic)
            .and_then(|t| t.get(&partition))
            .map(|o| o + 1)
    }

    /// Forget delivery failures (after an aborted transaction: its records are gone anyway).
    pub(crate) fn reset_failures(&self) {
        let ctx = self.producer.context();
        ctx.failures.store(0, Ordering::SeqCst);
        *ctx.first_failure.lock().expect("delivery tracker lock") = None;
        ctx.changelog_offsets
            .lock()
            .expect("delivery tracker lock")
            .clear();
    }

    /// Register the transactional.id with the coordinator, fencing any earlier producer
    /// with the same id and aborting its open transaction (KIP-98).
    ///
    /// # Errors
    /// [`Error::Kafka`] when the coordinator cannot be reached in time.
    pub(crate) fn init_transactions(&self) -> Result<()> {
        self.producer
            .init_transactions(Duration::from_secs(60))
            .map_err(Error::kafka("init transactions"))
    }

    /// Begin a transaction.
    ///
    /// # Errors
    /// [`Error::Kafka`] (fatal when fenced).
    pub(crate) fn begin_transaction(&self) -> Result<()> {
        self.txn_outages
            .store(crate::kafka::link::outages(), Ordering::SeqCst);
        self.producer
            .begin_transaction()
            .map_err(Error::kafka("begin transaction"))
    }

    /// Whether every broker went unreachable while the open transaction ran (a broker
    /// outage): a fencing after one is most likely the coordinator's abort of the timed-out
    /// transaction, which bumps the producer epoch, not another instance.
    pub(crate) fn outage_in_transaction(&self) -> bool {
        crate::kafka::link::outages() != self.txn_outages.load(Ordering::SeqCst)
    }

    /// Add the consumed offsets to the transaction with the consumer's group metadata, so
    /// the group coordinator fences a zombie of an older generation (KIP-447).
    ///
    /// # Errors
    /// [`Error::Kafka`]; abortable or fatal per the error.
    pub(crate) fn send_offsets_to_transaction(
        &self,
        offsets: &rdkafka::TopicPartitionList,
        cgm: &rdkafka::consumer::ConsumerGroupMetadata,
    ) -> Result<()> {
        self.producer
            .send_offsets_to_transaction(offsets, cgm, Duration::from_secs(60))
            .map_err(Error::kafka("send offsets to transaction"))
    }

    /// Commit the transaction (flushes first).
    ///
    /// # Errors
    /// [`Error::Kafka`]; abortable or fatal per the error.
    pub(crate) fn commit_transaction(&self) -> Result<()> {
        self.wait_in_flight(std::time::Instant::now() + Duration::from_secs(120));
        self.producer
            .commit_transaction(Duration::from_secs(120))
            .map_err(Error::kafka("commit transaction"))
    }

    /// Abort the transaction: its records are never visible read_committed.
    ///
    /// # Errors
    /// [`Error::Kafka`] (fatal when fenced).
    pub(crate) fn abort_transaction(&self) -> Result<()> {
        self.producer
            .abort_transaction(Duration::from_secs(120))
            .map_err(Error::kafka("abort transaction"))
    }

    /// Wait until no record is in flight (or `deadline`). rdkafka's flush on a
    /// ThreadedProducer, also called by `commit_transaction`, sleeps in 100 ms polls while
    /// the background thread serves the delivery reports; waiting on the in-flight count
    /// first makes that flush return at once.
    fn wait_in_flight(&self, deadline: std::time::Instant) {
        let mut pause = Duration::from_micros(50);
        while self.producer.in_flight_count() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }
}
