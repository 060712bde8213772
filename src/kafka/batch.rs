//! Batch reads from a consumer: many fetched records per call instead of one.
//!
//! `BaseConsumer::poll` hands out one record per call, each call taking the queue's lock,
//! reading the clock and handling one event. A restore reads hundreds of thousands of
//! small changelog records as fast as it can, so that per-call cost is a large share of
//! its time. [`consume_batch`] takes up to `max` records in one call to librdkafka's
//! `rd_kafka_consume_batch_queue` on the consumer's queue; the records stay valid while
//! the [`Batch`] lives, so they are applied without copying them first. librdkafka moves the consumer's
//! position past each record handed out, and past transaction control records, exactly as
//! `poll` does, so `position()` stays right.
//!
//! The run loop reads its source the same way: [`SourceQueue`] is a queue of its own that
//! the assigned partitions' fetched records are forwarded to, so the consumer's own queue
//! (read by `poll`) carries only rebalances and errors.

use rdkafka::bindings as rd;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use std::time::Duration;

/// How much of a record's value [`Batch::prefetch_data`] fetches ahead, in bytes.
const PREFETCH_VALUE_BYTES: usize = 256;

/// One record of a batch, borrowed until the batch ends.
pub(crate) struct BatchRecord<'a> {
    msg: &'a rd::rd_kafka_message_t,
}

impl<'a> BatchRecord<'a> {
    /// The partition.
    pub(crate) fn partition(&self) -> i32 {
        self.msg.partition
    }

    /// The offset.
    pub(crate) fn offset(&self) -> i64 {
        self.msg.offset
    }

    /// The key, `None` when the record has none.
    pub(crate) fn key(&self) -> Option<&'a [u8]> {
        // SAFETY: librdkafka guarantees `key_len` bytes at `key` while the message lives;
        // the message outlives 'a (it is destroyed when the batch ends).
        unsafe { bytes_at(self.msg.key, self.msg.key_len) }
    }

    /// The value, `None` for a tombstone.
    pub(crate) fn payload(&self) -> Option<&'a [u8]> {
        // SAFETY: as for `key`.
        unsafe { bytes_at(self.msg.payload, self.msg.len) }
    }

    /// The topic name, `None` when not UTF-8 (never for topics onceflow names).
    pub(crate) fn topic(&self) -> Option<&'a str> {
        if self.msg.rkt.is_null() {
            return None;
        }
        // SAFETY: a message's topic handle stays valid while the message lives, and its name
        // is a NUL-terminated string owned by it.
        unsafe {
            let name = rd::rd_kafka_topic_name(self.msg.rkt);
            if name.is_null() {
                return None;
            }
            std::ffi::CStr::from_ptr(name).to_str().ok()
        }
    }
}

impl<'a> BatchRecord<'a> {
    /// The record of a message `poll` handed out (a record of a partition whose records
    /// are not forwarded to a [`SourceQueue`]), read the same way as a batch's.
    pub(crate) fn of(m: &'a rdkafka::message::BorrowedMessage<'_>) -> BatchRecord<'a> {
        // SAFETY: the message lives while `m` does, which outlives 'a.
        BatchRecord {
            msg: unsafe { &*m.ptr() },
        }
    }

    /// The address of the record's librdkafka topic handle: the same for every record of a
    /// topic while the consumer lives, so it names the topic without reading its name.
    pub(crate) fn topic_handle(&self) -> usize {
        self.msg.rkt as usize
    }

    /// The timestamp in milliseconds, `None` when the record has none.
    pub(crate) fn timestamp(&self) -> Option<i64> {
        let mut kind = rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        // SAFETY: a live message; librdkafka only reads it.
        let ts = unsafe { rd::rd_kafka_message_timestamp(self.msg, &mut kind) };
        (ts != -1 && kind != rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE)
            .then_some(ts)
    }

    /// The headers in record order: name and value (`None`: a null value). A name that is
    /// not UTF-8 comes with its invalid bytes replaced (U+FFFD); Kafka clients write UTF-8
    /// names, so this is a broken producer, and the record is still processed.
    pub(crate) fn headers(
        &self,
    ) -> impl Iterator<Item = (std::borrow::Cow<'a, str>, Option<&'a [u8]>)> {
        let mut hdrs: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
        // SAFETY: a live message; the headers it returns belong to it (not to be freed)
        // and live as long as it does.
        let err = unsafe {
            rd::rd_kafka_message_headers(
                self.msg as *const rd::rd_kafka_message_t as *mut rd::rd_kafka_message_t,
                &mut hdrs,
            )
        };
        let list = if err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            hdrs as *const rd::rd_kafka_headers_t
        } else {
            std::ptr::null()
        };
        // SAFETY: the message's own headers (or none), living for 'a.
        unsafe { crate::kafka::consumer::list_pairs(list) }
    }
}

/// # Safety
/// `ptr` must be null or point to `len` readable bytes living for 'a.
unsafe fn bytes_at<'a>(ptr: *mut std::ffi::c_void, len: usize) -> Option<&'a [u8]> {
    if ptr.is_null() {
        None
    } else {
        Some(std::slice::from_raw_parts(ptr.cast::<u8>(), len))
    }
}

/// Records taken from a consumer in one call, destroyed (returned to librdkafka) when the
/// batch is dropped. The records borrow from the batch, so they cannot outlive it.
pub(crate) struct Batch(Vec<*mut rd::rd_kafka_message_t>);

// SAFETY: a batch owns its messages exclusively (librdkafka hands each out once); they are
// plain memory that any thread may read, and destroying them is thread-safe.
unsafe impl Send for Batch {}

impl Drop for Batch {
    fn drop(&mut self) {
        for m in self.0.drain(..) {
            // SAFETY: each pointer came from rd_kafka_consume_batch_queue and is destroyed
            // exactly once, here.
            unsafe { rd::rd_kafka_message_destroy(m) };
        }
    }
}

impl Batch {
    /// Records and errors taken.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether nothing was taken.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Record `i` (`None` past the end or for an error in the stream).
    pub(crate) fn get(&self, i: usize) -> Option<BatchRecord<'_>> {
        let &m = self.0.get(i)?;
        // SAFETY: a message returned by librdkafka, alive until the batch drops.
        let msg = unsafe { &*m };
        (msg.err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR)
            .then_some(BatchRecord { msg })
    }

    /// Hint that record `i` is read soon: fetch its message's header (where its key and
    /// value are) into the cache.
    pub(crate) fn prefetch(&self, i: usize) {
        if let Some(&m) = self.0.get(i) {
            crate::prefetch::prefetch(m);
        }
    }

    /// Hint that record `i` is read soon, once its header is in the cache
    /// ([`Batch::prefetch`]): fetch its key and the start of its value.
    pub(crate) fn prefetch_data(&self, i: usize) {
        if let Some(m) = self.get(i) {
            let (key, value) = (m.msg.key as *const u8, m.msg.payload as *const u8);
            crate::prefetch::prefetch(key);
            for line in 0..m.msg.len.min(PREFETCH_VALUE_BYTES).div_ceil(64) {
                crate::prefetch::prefetch(value.wrapping_add(line * 64));
            }
        }
    }

    /// The records in queue order (per partition, log order): `Ok` for a record, `Err` for
    /// an error librdkafka reports in the stream (a fetch error; a partition end only with
    /// `enable.partition.eof`, which onceflow's consumers keep off).
    pub(crate) fn records(&self) -> impl Iterator<Item = Result<BatchRecord<'_>, KafkaError>> {
        self.0.iter().map(|&m| {
            // SAFETY: a message returned by librdkafka, alive until the batch drops.
            let msg = unsafe { &*m };
            if msg.err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                Ok(BatchRecord { msg })
            } else if msg.err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PARTITION_EOF {
                Err(KafkaError::PartitionEOF(msg.partition))
            } else {
                Err(KafkaError::MessageConsumption(RDKafkaErrorCode::from(
                    msg.err,
                )))
            }
        })
    }
}

/// Take up to `max` records from `consumer` in one call. librdkafka returns when it has
/// `max`, or when `timeout` has passed (`Duration::ZERO`: only what is queued now).
///
/// # Errors
/// [`KafkaError`] when librdkafka refuses the call (no consumer queue).
pub(crate) fn consume_batch(
    consumer: &BaseConsumer,
    timeout: Duration,
    max: usize,
) -> Result<Batch, KafkaError> {
    if max == 0 {
        return Ok(Batch(Vec::new()));
    }
    let rk = consumer.client().native_ptr();
    // SAFETY: `rk` is the live client of `consumer`; each queue handle taken here is
    // released below, before returning.
    let queue = unsafe {
        let q = rd::rd_kafka_queue_get_consumer(rk);
        if q.is_null() {
            // No group.id: records arrive on the main queue (as rdkafka's poll reads it).
            rd::rd_kafka_queue_get_main(rk)
        } else {
            q
        }
    };
    if queue.is_null() {
        return Err(KafkaError::ClientCreation(
            "the consumer has no queue to read from".into(),
        ));
    }
    // SAFETY: a live queue handle, released right after.
    let batch = unsafe { take(queue, timeout, max) };
    // SAFETY: taken above, not used after.
    unsafe { rd::rd_kafka_queue_destroy(queue) };
    batch
}

/// Up to `max` records of `queue` (see [`consume_batch`]).
///
/// # Safety
/// `queue` must be a live queue handle of a consumer.
unsafe fn take(
    queue: *mut rd::rd_kafka_queue_t,
    timeout: Duration,
    max: usize,
) -> Result<Batch, KafkaError> {
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let mut batch = Batch(Vec::with_capacity(max));
    // SAFETY: the buffer has room for `max` pointers; librdkafka writes `n` of them.
    let n =
        unsafe { rd::rd_kafka_consume_batch_queue(queue, timeout_ms, batch.0.as_mut_ptr(), max) };
    if n < 0 {
        // SAFETY: reads librdkafka's thread-local last error.
        let code = unsafe { rd::rd_kafka_last_error() };
        return Err(KafkaError::MessageConsumption(RDKafkaErrorCode::from(code)));
    }
    let n = usize::try_from(n).unwrap_or(0).min(max);
    // SAFETY: librdkafka initialised the first `n` entries.
    unsafe { batch.0.set_len(n) };
    Ok(batch)
}

/// The queue the run loop reads its source records from, in batches: a queue of the
/// consumer's own that each assigned partition's fetched records are forwarded to
/// ([`SourceQueue::forward`], before the partition is assigned). The consumer's queue,
/// which `poll` reads, then carries rebalances and errors only; `poll` must still be called
/// to serve them. librdkafka keeps each partition's records in log order in the queue,
/// drops those a seek or pause made stale, and moves the consumer's position past each
/// record handed out, as `poll` does. Drop it before closing the consumer.
pub(crate) struct SourceQueue {
    rk: *mut rd::rd_kafka_t,
    queue: *mut rd::rd_kafka_queue_t,
}

// SAFETY: librdkafka's queue handles may be used from any thread; the client outlives the
// queue (it is dropped before the consumer is closed).
unsafe impl Send for SourceQueue {}

impl SourceQueue {
    /// A new, empty queue of `consumer`.
    ///
    /// # Errors
    /// [`KafkaError::ClientCreation`] when librdkafka cannot create it.
    pub(crate) fn new<C: rdkafka::consumer::ConsumerContext>(
        consumer: &BaseConsumer<C>,
    ) -> Result<SourceQueue, KafkaError> {
        let rk = consumer.client().native_ptr();
        // SAFETY: the live client of `consumer`.
        let queue = unsafe { rd::rd_kafka_queue_new(rk) };
        if queue.is_null() {
            return Err(KafkaError::ClientCreation(
                "librdkafka could not create the source queue".into(),
            ));
        }
        Ok(SourceQueue { rk, queue })
    }

    /// Forward the fetched records of `partitions` to this queue. Call before assigning
    /// them: records fetched before this call would go to the consumer's queue (and come
    /// out of `poll`, ahead of the rest). librdkafka keeps the forwarding across pauses and
    /// seeks; an unassignment ends it (the next assignment forwards again).
    pub(crate) fn forward(&self, partitions: &rdkafka::TopicPartitionList) {
        for e in partitions.elements() {
            let Ok(topic) = std::ffi::CString::new(e.topic()) else {
                continue;
            };
            // SAFETY: a live client; the partition queue handle is released right after
            // forwarding (the forwarding keeps its own reference).
            unsafe {
                let pq = rd::rd_kafka_queue_get_partition(self.rk, topic.as_ptr(), e.partition());
                if !pq.is_null() {
                    rd::rd_kafka_queue_forward(pq, self.queue);
                    rd::rd_kafka_queue_destroy(pq);
                }
            }
        }
    }

    /// Take up to `max` records (or errors in the stream, a fetch error),
    /// waiting at most `timeout` for `max` of them: `Duration::ZERO` takes what is queued,
    /// and with `max` 1 the call returns as soon as a record arrives.
    ///
    /// # Errors
    /// [`KafkaError`] when librdkafka refuses the call.
    pub(crate) fn take(&self, timeout: Duration, max: usize) -> Result<Batch, KafkaError> {
        if max == 0 {
            return Ok(Batch(Vec::new()));
        }
        // SAFETY: the queue handle lives until `self` drops.
        unsafe { take(self.queue, timeout, max) }
    }
}

impl Drop for SourceQueue {
    fn drop(&mut self) {
        // SAFETY: the handle from `rd_kafka_queue_new`, released once. Records forwarded
        // later are dropped by librdkafka (the queue is disabled).
        unsafe { rd::rd_kafka_queue_destroy(self.queue) };
    }
}

/// Destroys batches on a background thread: returning a record to librdkafka costs about as
/// much as reading it, and the reader need not wait for it. Dropping the `Freer` waits for
/// every batch handed to it to be destroyed, so drop it before the consumer it read from.
pub(crate) struct Freer {
    tx: Option<std::sync::mpsc::Sender<Vec<Batch>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Freer {
    /// Start the thread (`onceflow-batch-free`).
    ///
    /// # Panics
    /// When the OS refuses to start a thread.
    pub(crate) fn spawn() -> Freer {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<Batch>>();
        let thread = std::thread::Builder::new()
            .name("onceflow-batch-free".into())
            .spawn(move || {
                for batches in rx {
                    drop(batches);
                }
            })
            .expect("spawn the batch freeing thread");
        Freer {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    /// Destroy `batches` in the background (here, when the thread is gone).
    pub(crate) fn free(&self, batches: Vec<Batch>) {
        if let Some(tx) = &self.tx {
            if let Err(back) = tx.send(batches) {
                drop(back.0);
            }
        }
    }
}

impl Drop for Freer {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
