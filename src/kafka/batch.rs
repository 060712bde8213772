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

use rdkafka::bindings as rd;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use std::time::Duration;

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

    /// The records in queue order (per partition, log order): `Ok` for a record, `Err` for
    /// an error librdkafka reports in the stream (a fetch error, a partition end when
    /// `enable.partition.eof` is on).
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
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let mut batch = Batch(Vec::with_capacity(max));
    // SAFETY: the buffer has room for `max` pointers; librdkafka writes `n` of them.
    let n = unsafe {
        let n = rd::rd_kafka_consume_batch_queue(queue, timeout_ms, batch.0.as_mut_ptr(), max);
        rd::rd_kafka_queue_destroy(queue);
        n
    };
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
