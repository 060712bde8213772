//! Helpers for tests, demos and benchmarks that talk to a real broker: read a whole topic,
//! produce records, reset a consumer group.
//!
//! The broker address comes from `ONCEFLOW_BOOTSTRAP_SERVERS` (see [`bootstrap_servers`]),
//! so any Kafka-compatible broker can stand in for the one `scripts/kafka` starts.

use bytes::Bytes;
use onceflow::{Error, Result};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::time::{Duration, Instant};

/// An [`Error::Kafka`] naming the operation, from the client's error.
fn kafka_error(op: &'static str) -> impl FnOnce(rdkafka::error::KafkaError) -> Error {
    move |source| Error::Kafka { op, source }
}

/// The broker under test: `ONCEFLOW_BOOTSTRAP_SERVERS`, default `127.0.0.1:9092`.
pub fn bootstrap_servers() -> String {
    std::env::var("ONCEFLOW_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A record read back from a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRecord {
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key bytes.
    pub key: Option<Bytes>,
    /// Value bytes.
    pub value: Option<Bytes>,
    /// Headers.
    pub headers: Vec<(String, Option<Bytes>)>,
    /// Timestamp (ms).
    pub timestamp: Option<i64>,
}

impl ReadRecord {
    /// The value of header `name`, as UTF-8 text.
    pub fn header_str(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.as_ref())
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

/// Read every record of `topic` from the beginning to its current end, with
/// `isolation.level` read_committed (`committed = true`) or read_uncommitted.
///
/// The end is each partition's high watermark (for read_committed, the last stable offset)
/// when reading starts; reading stops when the consumer position has reached it, so
/// transaction markers, which take offsets but are never delivered, do not make it wait.
///
/// # Errors
/// [`Error::Kafka`] on client errors, [`Error::Broker`] if the topic is missing or the end
/// is not reached within `timeout`.
pub fn read_topic(
    bootstrap: &str,
    topic: &str,
    committed: bool,
    timeout: Duration,
) -> Result<Vec<ReadRecord>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "onceflow-reader")
        .set("enable.auto.commit", "false")
        .set(
            "isolation.level",
            if committed {
                "read_committed"
            } else {
                "read_uncommitted"
            },
        )
        .create()
        .map_err(kafka_error("create reader"))?;
    let md = onceflow::__testkit::retry("metadata", || {
        consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .map_err(kafka_error("metadata"))
    })?;
    let parts: Vec<i32> = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    if parts.is_empty() {
        return Err(Error::Broker(format!("topic {topic} does not exist")));
    }
    let mut tpl = TopicPartitionList::new();
    let mut ends = std::collections::BTreeMap::new();
    for p in &parts {
        let (lo, hi) = onceflow::__testkit::retry("watermarks", || {
            consumer
                .fetch_watermarks(topic, *p, Duration::from_secs(10))
                .map_err(kafka_error("watermarks"))
        })?;
        ends.insert(*p, hi);
        tpl.add_partition_offset(topic, *p, Offset::Offset(lo))
            .map_err(kafka_error("assign"))?;
    }
    consumer.assign(&tpl).map_err(kafka_error("assign"))?;
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    // Next offset to read per partition, from the records seen; the consumer position is
    // asked only when idle, since it is a round trip to librdkafka's main thread.
    let mut next: std::collections::BTreeMap<i32, i64> = std::collections::BTreeMap::new();
    let mut last_error: Option<KafkaError> = None;
    let reached = |next: &std::collections::BTreeMap<i32, i64>| {
        ends.iter()
            .all(|(p, end)| *end == 0 || next.get(p).is_some_and(|o| *o >= *end))
    };
    loop {
        if reached(&next) {
            break;
        }
        if Instant::now() > deadline {
            return Err(Error::Broker(format!(
                "reading {topic}: end not reached in {timeout:?} (read {} records; last client error: {last_error:?})",
                out.len()
            )));
        }
        match consumer.poll(Duration::from_millis(200)) {
            None => {
                // Transaction markers take offsets and are never delivered: ask the position.
                let pos = consumer.position().map_err(kafka_error("position"))?;
                for (p, _) in ends.iter() {
                    if let Some(Offset::Offset(o)) =
                        pos.find_partition(topic, *p).map(|e| e.offset())
                    {
                        let e = next.entry(*p).or_insert(o);
                        *e = (*e).max(o);
                    }
                }
            }
            Some(Err(e)) => {
                // A connection lost (all brokers down, a transport failure) is reported
                // here too; librdkafka reconnects by itself, so only a fatal error ends the
                // read (else the deadline does, naming the last error).
                if consumer.client().fatal_error().is_some() || !is_transient(&e) {
                    return Err(Error::Kafka {
                        op: "read",
                        source: e,
                    });
                }
                last_error = Some(e);
            }
            Some(Ok(m)) => {
                let e = next.entry(m.partition()).or_insert(0);
                *e = (*e).max(m.offset() + 1);
                out.push(ReadRecord {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(Bytes::copy_from_slice),
                    value: m.payload().map(Bytes::copy_from_slice),
                    headers: onceflow::__testkit::header_pairs(m.headers())
                        .map(|(k, v)| (k.into_owned(), v.map(Bytes::copy_from_slice)))
                        .collect(),
                    timestamp: m.timestamp().to_millis(),
                });
            }
        }
    }
    Ok(out)
}

/// A simple idempotent producer for test input.
pub struct TestProducer {
    producer: ThreadedProducer<DefaultProducerContext>,
}

impl TestProducer {
    /// Connect to `bootstrap` with `linger.ms=5`, `enable.idempotence=true`.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the client cannot be created.
    pub fn new(bootstrap: &str) -> Result<TestProducer> {
        let producer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("linger.ms", "5")
            .set("enable.idempotence", "true")
            .set("queue.buffering.max.messages", "1000000")
            .create()
            .map_err(kafka_error("create producer"))?;
        Ok(TestProducer { producer })
    }

    /// Queue one record (waits while the local queue is full).
    ///
    /// # Errors
    /// [`Error::Kafka`] when librdkafka refuses the record.
    pub fn send(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        headers: &[(&str, &[u8])],
        timestamp: Option<i64>,
    ) -> Result<()> {
        let raw: Vec<(&[u8], &[u8])> = headers.iter().map(|(k, v)| (k.as_bytes(), *v)).collect();
        self.send_raw_names(topic, partition, key, value, &raw, timestamp)
    }

    /// As [`TestProducer::send`], with header names as bytes, which need not be UTF-8 (the
    /// broker does not check them): for tests of what a consumer makes of such a name.
    ///
    /// # Errors
    /// [`Error::Kafka`] when librdkafka refuses the record or a header.
    pub fn send_raw_names(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        headers: &[(&[u8], &[u8])],
        timestamp: Option<i64>,
    ) -> Result<()> {
        let mut r: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic);
        if let Some(k) = key {
            r = r.key(k);
        }
        if let Some(v) = value {
            r = r.payload(v);
        }
        if let Some(p) = partition {
            r = r.partition(p);
        }
        if let Some(t) = timestamp {
            r = r.timestamp(t);
        }
        if !headers.is_empty() {
            let h = rdkafka::message::OwnedHeaders::new_with_capacity(headers.len());
            // rdkafka's `BorrowedHeaders` is the librdkafka headers list itself.
            let list = h.as_borrowed() as *const rdkafka::message::BorrowedHeaders
                as *mut rdkafka::bindings::rd_kafka_headers_t;
            for (k, v) in headers {
                // SAFETY: a live list owned by `h`; librdkafka copies name and value.
                let err = unsafe {
                    rdkafka::bindings::rd_kafka_header_add(
                        list,
                        k.as_ptr().cast(),
                        k.len() as isize,
                        v.as_ptr().cast(),
                        v.len() as isize,
                    )
                };
                if err != rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                    return Err(Error::Kafka {
                        op: "add header",
                        source: rdkafka::error::KafkaError::MessageProduction(err.into()),
                    });
                }
            }
            r = r.headers(h);
        }
        loop {
            match self.producer.send(r) {
                Ok(()) => return Ok(()),
                Err((
                    rdkafka::error::KafkaError::MessageProduction(
                        rdkafka::types::RDKafkaErrorCode::QueueFull,
                    ),
                    back,
                )) => {
                    r = back;
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err((e, _)) => {
                    return Err(Error::Kafka {
                        op: "produce",
                        source: e,
                    })
                }
            }
        }
    }

    /// Wait for every queued record to be delivered.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the flush times out.
    pub fn flush(&self) -> Result<()> {
        self.producer
            .flush(Duration::from_secs(120))
            .map_err(kafka_error("flush"))
    }
}

/// Delete the consumer group `group` (its committed offsets), ignoring a missing group.
///
/// # Errors
/// [`Error::BrokerCode`] when the broker refuses (e.g. the group still has members), after
/// the retries of transient errors.
pub fn delete_group(bootstrap: &str, group: &str) -> Result<()> {
    let cfg = onceflow::Config::load_with_env(
        &[],
        &[("bootstrap.servers".into(), bootstrap.into())],
        std::iter::empty(),
    )?;
    onceflow::__testkit::delete(&cfg, &[], &[group])
}

/// Admin requests (topics, partition counts) through onceflow's own admin client, with the
/// bootstrap servers and `kafka.*` properties of a config; each request connects anew.
pub struct Admin(onceflow::Config);

impl Admin {
    /// Admin requests with `cfg`'s bootstrap servers and `kafka.*` properties.
    ///
    /// # Errors
    /// None yet: the client is made (and a refused property reported) per request.
    pub fn new(cfg: &onceflow::Config) -> Result<Admin> {
        Ok(Admin(cfg.clone()))
    }

    /// Create `topic` with `partitions` partitions and topic `configs` unless it exists.
    /// Returns whether it was created.
    ///
    /// # Errors
    /// A refused property or creation.
    pub fn ensure_topic(
        &self,
        topic: &str,
        partitions: usize,
        configs: &[(&str, &str)],
    ) -> Result<bool> {
        onceflow::__testkit::create_topic(&self.0, topic, partitions, configs)
    }

    /// Delete `topics` (missing ones are fine).
    ///
    /// # Errors
    /// A refused property or deletion.
    pub fn delete_topics(&self, topics: &[&str]) -> Result<()> {
        onceflow::__testkit::delete(&self.0, topics, &[])
    }

    /// The number of partitions of `topic`, `None` if it does not exist.
    ///
    /// # Errors
    /// A refused property; metadata that cannot be fetched.
    pub fn partition_count(&self, topic: &str) -> Result<Option<usize>> {
        onceflow::__testkit::partition_count(&self.0, topic)
    }
}

/// Whether a transaction is open on any of `topic`'s partitions: its last stable offset
/// (the end a read_committed reader sees) is below its high watermark. A read_committed
/// read of such a partition ends at the open transaction, before records committed after
/// it began.
///
/// # Errors
/// [`Error::Kafka`] on client errors.
pub fn transaction_open(bootstrap: &str, topic: &str, partitions: usize) -> Result<bool> {
    let client = |isolation: &str| -> Result<BaseConsumer> {
        ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", "onceflow-reader")
            .set("isolation.level", isolation)
            .create()
            .map_err(kafka_error("create watermark client"))
    };
    let (committed, uncommitted) = (client("read_committed")?, client("read_uncommitted")?);
    for p in 0..partitions as i32 {
        let end = |c: &BaseConsumer| {
            onceflow::__testkit::retry("watermarks", || {
                c.fetch_watermarks(topic, p, Duration::from_secs(10))
                    .map_err(kafka_error("watermarks"))
            })
            .map(|(_, hi)| hi)
        };
        if end(&committed)? < end(&uncommitted)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The committed offsets of `group` on `topic`'s partitions (`None` where nothing is
/// committed).
///
/// # Errors
/// [`Error::Kafka`] on client errors.
pub fn committed_offsets(
    bootstrap: &str,
    group: &str,
    topic: &str,
    partitions: usize,
) -> Result<Vec<Option<i64>>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .map_err(kafka_error("create consumer"))?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p as i32);
    }
    let c = onceflow::__testkit::retry("committed offsets", || {
        consumer
            .committed_offsets(tpl.clone(), Duration::from_secs(10))
            .map_err(kafka_error("committed offsets"))
    })?;
    Ok((0..partitions)
        .map(
            |p| match c.find_partition(topic, p as i32).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            },
        )
        .collect())
}

/// Whether `e` is a client-side connection error that librdkafka recovers from by itself
/// (it reconnects): all brokers down, a transport failure, a timed-out request.
fn is_transient(e: &KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(
            C::AllBrokersDown
                | C::BrokerTransportFailure
                | C::RequestTimedOut
                | C::OperationTimedOut
        )
    )
}
