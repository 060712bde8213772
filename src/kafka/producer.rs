//! The output producer: idempotent, with every delivery tracked so the commit protocol can
//! wait until what it produced is durable before it applies state and commits offsets.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::processor::OutRecord;
use crate::state::restore::ChangelogWrite;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Output slots of the tracker's `unacked` counts: epoch `e` counts in slot `e % EPOCH_SLOTS`
/// (far more than the commits in flight at once); slot `EPOCH_SLOTS` counts changelog
/// records.
const EPOCH_SLOTS: usize = 64;
/// Changelog records handed to librdkafka per call (bounds the message array built for it).
const CHANGELOG_CHUNK: usize = 1024;

/// Records delivery failures, and what is not yet acknowledged per commit epoch; checked
/// at each commit.
pub(crate) struct DeliveryTracker {
    failures: AtomicU64,
    /// Records sent and not yet acknowledged (delivered or failed), per slot.
    unacked: [AtomicI64; EPOCH_SLOTS + 1],
    first_failure: Mutex<Option<String>>,
    /// Highest delivered offset per changelog topic and partition.
    changelog_offsets:
        Mutex<std::collections::HashMap<String, std::collections::HashMap<i32, i64>>>,
    /// This producer's place in the stall check of [`super::link`].
    link: super::link::Registration,
}

impl ClientContext for DeliveryTracker {
    fn error(&self, error: KafkaError, reason: &str) {
        super::link::note_error(&self.link, &error);
        tracing::error!(%error, reason, "librdkafka error (producer)");
    }

    /// Statistics (every `statistics.interval.ms`, served by the producer's own polling
    /// thread) feed the stall check of [`super::link`].
    fn stats_raw(&self, statistics: &[u8]) {
        super::link::note_stats(&self.link, statistics);
    }
}

impl ProducerContext for DeliveryTracker {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, slot: usize) {
        if let (Ok(msg), true) = (result, slot == EPOCH_SLOTS) {
            // A changelog record (only they count in that slot): the topic is read for them
            // alone, not for every output delivered.
            use rdkafka::Message;
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

/// librdkafka topic handles of the producer, one per topic name, made on first use. A
/// produce by handle skips what a produce by name costs per record: a copy of the name
/// (rdkafka), a write lock of the client's topic list and a search of it (librdkafka).
#[derive(Default)]
struct TopicHandles(std::sync::RwLock<Vec<(Box<str>, TopicHandle)>>);

/// One librdkafka topic handle (`rd_kafka_topic_t`), owned by [`TopicHandles`].
#[derive(Clone, Copy)]
struct TopicHandle(*mut rdkafka::bindings::rd_kafka_topic_t);

// SAFETY: librdkafka topic handles may be used from any thread (produce and destroy are
// thread-safe); the handle is only destroyed once, by `TopicHandles::destroy`.
unsafe impl Send for TopicHandle {}
// SAFETY: as for Send.
unsafe impl Sync for TopicHandle {}

impl TopicHandles {
    /// The handle of `topic` on client `rk`, made on first use.
    fn get(&self, rk: *mut rdkafka::bindings::rd_kafka_t, topic: &str) -> Result<TopicHandle> {
        let find = |v: &[(Box<str>, TopicHandle)]| {
            v.iter().find(|(name, _)| &**name == topic).map(|(_, h)| *h)
        };
        if let Some(h) = find(&self.0.read().unwrap_or_else(|p| p.into_inner())) {
            return Ok(h);
        }
        let mut all = self.0.write().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = find(&all) {
            return Ok(h);
        }
        let name = std::ffi::CString::new(topic)
            .map_err(|_| Error::Config(format!("topic name {topic:?} contains a NUL byte")))?;
        // SAFETY: `rk` is a live client; a NULL conf takes the client's default topic
        // configuration (as a produce by name does).
        let rkt = unsafe {
            rdkafka::bindings::rd_kafka_topic_new(rk, name.as_ptr(), std::ptr::null_mut())
        };
        if rkt.is_null() {
            // SAFETY: reads librdkafka's thread-local last error.
            let code = unsafe { rdkafka::bindings::rd_kafka_last_error() };
            return Err(produce_error(code.into()));
        }
        all.push((topic.into(), TopicHandle(rkt)));
        Ok(TopicHandle(rkt))
    }

    /// Release every handle (before the client goes).
    fn destroy(&mut self) {
        let all = self.0.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, h) in all.drain(..) {
            // SAFETY: made by rd_kafka_topic_new and released exactly once, here, while the
            // client lives (OutputProducer's Drop runs before its fields drop).
            unsafe { rdkafka::bindings::rd_kafka_topic_destroy(h.0) };
        }
    }
}

/// The `message.timeout.ms` in force in `producer` (after librdkafka's own adjustments,
/// e.g. to `transaction.timeout.ms`), `None` when it cannot be read.
fn message_timeout_ms(producer: &ThreadedProducer<DeliveryTracker>) -> Option<u64> {
    let mut buf = [0u8; 32];
    let mut size = buf.len();
    // SAFETY: the client is alive; `rd_kafka_conf` returns its configuration, owned by the
    // client and read only here; `rd_kafka_conf_get` writes at most `size` bytes (a
    // NUL-terminated string) into `buf` and sets `size` to the length it needed.
    let res = unsafe {
        let conf = rdkafka::bindings::rd_kafka_conf(producer.client().native_ptr());
        rdkafka::bindings::rd_kafka_conf_get(
            conf,
            c"message.timeout.ms".as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut size,
        )
    };
    if res != rdkafka::bindings::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
        return None;
    }
    std::ffi::CStr::from_bytes_until_nul(&buf)
        .ok()?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The error of a record librdkafka refused to queue.
fn produce_error(code: RDKafkaErrorCode) -> Error {
    Error::Kafka {
        op: "produce",
        source: KafkaError::MessageProduction(code),
    }
}

/// One record to queue, borrowing its parts.
struct Outgoing<'a> {
    topic: &'a str,
    /// `None`: the partitioner picks.
    partition: Option<i32>,
    key: Option<&'a [u8]>,
    /// `None`: a tombstone.
    value: Option<&'a [u8]>,
    headers: Option<RawHeaders>,
    /// Milliseconds since the epoch; `None`: now.
    timestamp: Option<i64>,
}

/// The headers list of one record to produce, built from borrowed names and values (which
/// librdkafka copies); destroyed when dropped, unless a successful produce took it over
/// (then forgotten).
struct RawHeaders(*mut rdkafka::bindings::rd_kafka_headers_t);

impl RawHeaders {
    /// The list of `all`, `None` when empty (a record without headers).
    fn new<'a>(all: impl ExactSizeIterator<Item = (&'a str, Option<&'a [u8]>)>) -> Option<Self> {
        if all.len() == 0 {
            return None;
        }
        // SAFETY: a new list, owned by the returned value.
        let list = RawHeaders(unsafe { rdkafka::bindings::rd_kafka_headers_new(all.len()) });
        for (name, value) in all {
            let (ptr, len) = value.map_or((std::ptr::null(), 0), |v| (v.as_ptr(), v.len()));
            // SAFETY: name and value are valid for the lengths given (no NUL needed) and
            // copied into the list. The only error is a read-only list, which a new one is
            // not.
            unsafe {
                rdkafka::bindings::rd_kafka_header_add(
                    list.0,
                    name.as_ptr().cast(),
                    name.len() as isize,
                    ptr.cast(),
                    len as isize,
                )
            };
        }
        Some(list)
    }
}

impl Drop for RawHeaders {
    fn drop(&mut self) {
        // SAFETY: a list made by `new` and still ours (a produce that took it forgets it).
        unsafe { rdkafka::bindings::rd_kafka_headers_destroy(self.0) };
    }
}

impl Drop for OutputProducer {
    fn drop(&mut self) {
        self.topics.destroy();
    }
}

/// Idempotent producer for sink, dead-letter (and later changelog) records.
///
/// librdkafka retries each record until `delivery.timeout.ms` (default 300 s); a record
/// that still fails is a fatal error for the batch: [`OutputProducer::flush`] reports it
/// and the runtime stops without applying state or committing offsets, so the batch is
/// processed again on restart (at_least_once: never lost).
pub(crate) struct OutputProducer {
    /// Destroyed before the producer (see Drop).
    topics: TopicHandles,
    producer: ThreadedProducer<DeliveryTracker>,
    /// The commit epoch outputs sent now count towards ([`OutputProducer::open_epoch`]).
    epoch: AtomicU64,
    /// [`crate::kafka::link::outages`] when the open transaction began.
    txn_outages: AtomicU64,
    /// How long a wait for delivery reports may take (see [`OutputProducer::ack_timeout`]).
    ack_timeout: Duration,
}

/// What a wait for delivery reports allows beyond the producer's `message.timeout.ms`
/// (see [`OutputProducer::ack_timeout`]).
const ACK_MARGIN: Duration = Duration::from_secs(30);

/// The wait for delivery reports when `message.timeout.ms` is 0 (no limit) or unreadable.
const ACK_TIMEOUT_UNLIMITED: Duration = Duration::from_secs(600);

/// The wait for delivery reports allowed by a producer whose `message.timeout.ms` is
/// `message_timeout_ms` (see [`OutputProducer::ack_timeout`]).
fn ack_timeout_for(message_timeout_ms: Option<u64>) -> Duration {
    match message_timeout_ms {
        Some(ms) if ms > 0 => Duration::from_millis(ms) + ACK_MARGIN,
        _ => ACK_TIMEOUT_UNLIMITED,
    }
}

impl OutputProducer {
    /// Create the producer (`enable.idempotence=true`, `linger.ms=5`,
    /// `partitioner=murmur2_random`: a keyed record goes where the Java client and Kafka
    /// Streams put its key, a record without a key to a random partition;
    /// `statistics.interval.ms=1000` for the stall check of `/ready`; and under
    /// exactly_once_v2 `transactional.id=<application.id>-<instance.id>`; then `kafka.*` and
    /// `kafka.producer.*`). The delivered offsets of records sent by
    /// [`OutputProducer::send_changelog`] are tracked for store checkpoints.
    ///
    /// # Errors
    /// [`Error::Config`] when librdkafka refuses a property.
    pub(crate) fn new(cfg: &Config) -> Result<OutputProducer> {
        let txn_id = cfg.transactional_id();
        let mut defaults = vec![
            ("enable.idempotence", "true"),
            ("linger.ms", "5"),
            ("partitioner", "murmur2_random"),
            // For `/ready`: a cluster whose brokers stop answering (see kafka::link).
            ("statistics.interval.ms", super::link::STATS_INTERVAL_MS),
        ];
        if cfg.exactly_once() {
            defaults.push(("transactional.id", txn_id.as_str()));
        }
        let producer = crate::kafka::client_config(cfg, &defaults, &cfg.kafka_producer)
            .create_with_context(DeliveryTracker {
                failures: AtomicU64::new(0),
                unacked: std::array::from_fn(|_| AtomicI64::new(0)),
                first_failure: Mutex::new(None),
                changelog_offsets: Mutex::default(),
                link: super::link::register(super::link::Client::Output),
            })
            .map_err(crate::kafka::config_error)?;
        let ack_timeout = ack_timeout_for(message_timeout_ms(&producer));
        Ok(OutputProducer {
            topics: TopicHandles::default(),
            producer,
            epoch: AtomicU64::new(0),
            txn_outages: AtomicU64::new(0),
            ack_timeout,
        })
    }

    /// How long an at_least_once commit may wait for its records' delivery reports before
    /// it fails: the producer's `message.timeout.ms` in force (librdkafka's default 300 s)
    /// plus 30 s, or 600 s when it is 0 (no limit). librdkafka reports every record within
    /// its message timeout, delivered or failed; a report still missing past that is a
    /// client stuck, and failing the commit then lets a restart resume from the last
    /// commit instead of waiting on. (An exactly_once_v2 commit waits in librdkafka's
    /// `commit_transaction`, bounded by its own timeout.)
    pub(crate) fn ack_timeout(&self) -> Duration {
        self.ack_timeout
    }

    /// Queue `rec` for delivery, waiting while librdkafka's queue is full.
    ///
    /// # Errors
    /// [`Error::Kafka`] when librdkafka refuses the record for a reason other than a full
    /// queue (unknown topic, record too large).
    pub(crate) fn send(&self, rec: &OutRecord) -> Result<()> {
        self.send_output(Outgoing {
            topic: &rec.topic,
            partition: rec.partition,
            key: rec.key.as_deref(),
            value: rec.value.as_deref(),
            headers: RawHeaders::new(rec.headers.iter().map(|(k, v)| (k.as_str(), v.as_deref()))),
            timestamp: rec.timestamp,
        })
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
        self.send_output(Outgoing {
            topic,
            partition: Some(partition),
            key,
            value,
            headers: RawHeaders::new(headers.iter().copied()),
            timestamp,
        })
    }

    /// Queue an output, counted towards the current epoch.
    fn send_output(&self, rec: Outgoing<'_>) -> Result<()> {
        let slot = (self.epoch.load(Ordering::Relaxed) % EPOCH_SLOTS as u64) as usize;
        self.produce(rec, slot)
    }

    /// Queue one changelog record `write` (its `value` `None`: a tombstone) to `topic`,
    /// from borrowed bytes; as [`OutputProducer::send`].
    ///
    /// # Errors
    /// As [`OutputProducer::send`].
    pub(crate) fn send_changelog(&self, topic: &str, write: &ChangelogWrite<'_>) -> Result<()> {
        let rec = Outgoing {
            topic,
            partition: Some(write.partition),
            key: Some(write.key),
            value: write.value,
            headers: None,
            timestamp: Some(write.timestamp_ms),
        };
        self.produce(rec, EPOCH_SLOTS)
    }

    /// Queue a run of changelog records to `partition` of `topic`, in order (a `None` value:
    /// a tombstone), [`CHANGELOG_CHUNK`] records a call to librdkafka
    /// (`rd_kafka_produce_batch`: the topic and partition are looked up once a call, the
    /// clock read once); stamped with the time they are queued. Counted as [`OutputProducer::send_changelog`] counts one; waits while
    /// librdkafka's queue is full.
    ///
    /// # Errors
    /// As [`OutputProducer::send`]; the records before the refused one are queued.
    pub(crate) fn send_changelog_run(
        &self,
        topic: &str,
        partition: i32,
        writes: &[(&[u8], Option<&[u8]>)],
    ) -> Result<()> {
        let rk = self.producer.client().native_ptr();
        let rkt = self.topics.get(rk, topic)?;
        for chunk in writes.chunks(CHANGELOG_CHUNK) {
            self.produce_chunk(rkt.0, partition, chunk)?;
        }
        Ok(())
    }

    /// One `rd_kafka_produce_batch` call (again while the queue is full) for
    /// [`OutputProducer::send_changelog_run`].
    fn produce_chunk(
        &self,
        rkt: *mut rdkafka::bindings::rd_kafka_topic_t,
        partition: i32,
        writes: &[(&[u8], Option<&[u8]>)],
    ) -> Result<()> {
        let counter = &self.producer.context().unacked[EPOCH_SLOTS];
        let mut msgs: Vec<rdkafka::bindings::rd_kafka_message_t> = writes
            .iter()
            .map(|(key, value)| {
                // SAFETY: every field of the C struct is an integer or a pointer, for which
                // all zeroes are valid (no error, null pointers).
                let mut m: rdkafka::bindings::rd_kafka_message_t = unsafe { std::mem::zeroed() };
                m.partition = partition;
                m.key = key.as_ptr() as *mut std::ffi::c_void;
                m.key_len = key.len();
                if let Some(v) = value {
                    m.payload = v.as_ptr() as *mut std::ffi::c_void;
                    m.len = v.len();
                }
                // The delivery callback reads the slot back from the opaque.
                m._private = EPOCH_SLOTS as *mut std::ffi::c_void;
                m
            })
            .collect();
        let mut from = 0;
        while from < msgs.len() {
            let rest = &mut msgs[from..];
            let n = rest.len();
            // Counted before the send: a delivery report may come before the call returns.
            counter.fetch_add(n as i64, Ordering::SeqCst);
            // SAFETY: the client and topic handle are alive (see `produce`); each message's
            // key and value are valid for their lengths during the call and copied (F_COPY);
            // `rest` is `n` initialized messages, which librdkafka only reads and marks
            // with a per-message error.
            let queued = unsafe {
                rdkafka::bindings::rd_kafka_produce_batch(
                    rkt,
                    partition,
                    rdkafka::bindings::RD_KAFKA_MSG_F_COPY,
                    rest.as_mut_ptr(),
                    n as i32,
                )
            };
            counter.fetch_sub(n as i64 - i64::from(queued.max(0)), Ordering::SeqCst);
            // A full queue refuses that message and every later one: those are sent again.
            // Any other refusal stops the run.
            match rest.iter().find(|m| {
                m.err != rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
            }) {
                None => return Ok(()),
                Some(m) => match RDKafkaErrorCode::from(m.err) {
                    RDKafkaErrorCode::QueueFull => {
                        from += queued.max(0) as usize;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    code => return Err(produce_error(code)),
                },
            }
        }
        Ok(())
    }

    /// Queue `rec`, counted in `slot` until its delivery report, waiting while librdkafka's
    /// queue is full. Produced by topic handle (see [`TopicHandles`]); key and value are
    /// copied by librdkafka (`RD_KAFKA_MSG_F_COPY`), the headers list is handed over.
    fn produce(&self, rec: Outgoing<'_>, slot: usize) -> Result<()> {
        let Outgoing {
            topic,
            partition,
            key,
            value,
            headers,
            timestamp,
        } = rec;
        use rdkafka::bindings::rd_kafka_vtype_t::*;
        let rk = self.producer.client().native_ptr();
        let rkt = self.topics.get(rk, topic)?;
        let bytes = |b: Option<&[u8]>| {
            b.map_or((std::ptr::null_mut(), 0), |b| {
                (b.as_ptr() as *mut std::ffi::c_void, b.len())
            })
        };
        let ((value_ptr, value_len), (key_ptr, key_len)) = (bytes(value), bytes(key));
        let hdrs = headers.as_ref().map_or(std::ptr::null_mut(), |h| h.0);
        let counter = &self.producer.context().unacked[slot];
        // Counted before the send: its delivery report may come before `producev` returns.
        counter.fetch_add(1, Ordering::SeqCst);
        loop {
            // SAFETY: the client and topic handle are alive (the handle is destroyed before
            // the producer, see Drop); key and value are valid for their lengths during the
            // call and copied (F_COPY); on success librdkafka owns the headers list, which is
            // then forgotten here; on failure it stays ours. The opaque is the slot number,
            // which the delivery callback reads back as a `usize` (rdkafka's `IntoOpaque`).
            let err = unsafe {
                rdkafka::bindings::rd_kafka_producev(
                    rk,
                    RD_KAFKA_VTYPE_RKT,
                    rkt.0,
                    RD_KAFKA_VTYPE_PARTITION,
                    partition.unwrap_or(-1),
                    RD_KAFKA_VTYPE_MSGFLAGS,
                    rdkafka::bindings::RD_KAFKA_MSG_F_COPY,
                    RD_KAFKA_VTYPE_VALUE,
                    value_ptr,
                    value_len,
                    RD_KAFKA_VTYPE_KEY,
                    key_ptr,
                    key_len,
                    RD_KAFKA_VTYPE_OPAQUE,
                    slot as *mut std::ffi::c_void,
                    RD_KAFKA_VTYPE_TIMESTAMP,
                    timestamp.unwrap_or(0),
                    RD_KAFKA_VTYPE_HEADERS,
                    hdrs,
                    RD_KAFKA_VTYPE_END,
                )
            };
            match RDKafkaErrorCode::from(err) {
                RDKafkaErrorCode::NoError => {
                    std::mem::forget(headers);
                    return Ok(());
                }
                RDKafkaErrorCode::QueueFull => std::thread::sleep(Duration::from_millis(1)),
                code => {
                    counter.fetch_sub(1, Ordering::SeqCst);
                    return Err(produce_error(code));
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

#[cfg(test)]
mod ack_timeout_tests {
    use super::*;

    /// The producer `sets` give (no broker is contacted), and its wait for delivery reports.
    fn ack_timeout_with(sets: &[(&str, &str)]) -> Duration {
        let mut sets = sets.to_vec();
        sets.push(("bootstrap.servers", "127.0.0.1:1"));
        OutputProducer::new(&Config::from_sets(&sets))
            .unwrap()
            .ack_timeout()
    }

    #[test]
    fn a_commit_waits_for_delivery_reports_the_message_timeout_in_force_and_a_margin() {
        // librdkafka's default message timeout, 300 s.
        assert_eq!(ack_timeout_with(&[]), Duration::from_secs(330));
        assert_eq!(
            ack_timeout_with(&[("kafka.producer.message.timeout.ms", "40000")]),
            Duration::from_secs(70)
        );
        // The alias librdkafka also takes.
        assert_eq!(
            ack_timeout_with(&[("kafka.producer.delivery.timeout.ms", "5000")]),
            Duration::from_secs(35)
        );
        // 0: no limit in librdkafka; the wait keeps its own bound.
        assert_eq!(
            ack_timeout_with(&[("kafka.producer.message.timeout.ms", "0")]),
            ACK_TIMEOUT_UNLIMITED
        );
    }
}
