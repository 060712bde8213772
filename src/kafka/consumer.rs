//! The source consumer: a `BaseConsumer` whose rebalances come to the run loop as events
//! over a channel.
//!
//! librdkafka serves a rebalance from inside `poll`, on the polling thread, and `poll`
//! returns right after it. The context does not touch the run loop's state: it sends a
//! [`RebalanceEvent`] and leaves the assignment change to the run loop, which, as soon as
//! `poll` returns, commits the revoked partitions' work and then unassigns them (what Kafka
//! Streams does in `onPartitionsRevoked`), or assigns new partitions and pauses them until
//! their restore is done. librdkafka waits for that assign / unassign call. While
//! deferral is off ([`SourceContext::defer_rebalances`]; on close, for example) the
//! context changes the assignment itself.

use crate::config::Config;
use crate::error::Result;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, TopicPartitionList};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

/// A rebalance, for the run loop to carry out.
pub(crate) enum RebalanceEvent {
    /// Partitions were assigned; the run loop must assign them
    /// ([`apply_assign`]), pause them and set up their tasks.
    Assigned(TopicPartitionList),
    /// Partitions are being taken away; the run loop must finish and commit their work
    /// (or, when `lost`, abort it: the group moved on without this instance), then
    /// unassign them ([`apply_revoke`]).
    Revoked {
        /// The partitions.
        partitions: TopicPartitionList,
        /// The assignment was lost (session timeout), not handed over.
        lost: bool,
    },
}

impl RebalanceEvent {}

/// Consumer context sending rebalances to the run loop.
pub(crate) struct SourceContext {
    events: mpsc::Sender<RebalanceEvent>,
    deferred: AtomicBool,
    /// This consumer's place in the stall check of [`super::link`].
    link: super::link::Registration,
}

/// The consumer type of the runtime.
pub(crate) type SourceConsumer = BaseConsumer<SourceContext>;

impl SourceContext {
    /// Whether rebalances go to the run loop (true) or are carried out by the context at
    /// once (false: before the run loop starts and after it ends, so closing the consumer
    /// never waits for a loop that is gone).
    pub(crate) fn defer_rebalances(&self, on: bool) {
        self.deferred.store(on, Ordering::SeqCst);
    }
}

impl ClientContext for SourceContext {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        // End-of-partition arrives through `poll` as well; it is not an error.
        use rdkafka::error::{KafkaError, RDKafkaErrorCode};
        if matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        ) {
            return;
        }
        super::link::note_error(&self.link, &error);
        tracing::error!(%error, reason, "librdkafka error");
    }

    /// Statistics (every `statistics.interval.ms`) feed the stall check of
    /// [`super::link`]; they are not parsed further.
    fn stats_raw(&self, statistics: &[u8]) {
        super::link::note_stats(&self.link, statistics);
    }
}

/// Carry out an assignment: incremental under the cooperative protocol, whole otherwise.
///
/// # Errors
/// [`crate::Error::Kafka`] when librdkafka refuses it.
pub(crate) fn apply_assign(consumer: &SourceConsumer, tpl: &TopicPartitionList) -> Result<()> {
    match consumer.rebalance_protocol() {
        RebalanceProtocol::Cooperative => consumer.incremental_assign(tpl),
        _ => consumer.assign(tpl),
    }
    .map_err(crate::Error::kafka("assign"))
}

/// Carry out a revocation: incremental under the cooperative protocol, everything
/// otherwise.
///
/// # Errors
/// [`crate::Error::Kafka`] when librdkafka refuses it.
pub(crate) fn apply_revoke(consumer: &SourceConsumer, tpl: &TopicPartitionList) -> Result<()> {
    match consumer.rebalance_protocol() {
        RebalanceProtocol::Cooperative => consumer.incremental_unassign(tpl),
        _ => consumer.unassign(),
    }
    .map_err(crate::Error::kafka("unassign"))
}

impl ConsumerContext for SourceContext {
    fn rebalance(
        &self,
        consumer: &SourceConsumer,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let event = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                Some(RebalanceEvent::Assigned(tpl.clone()))
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => Some(RebalanceEvent::Revoked {
                partitions: tpl.clone(),
                lost: consumer.assignment_lost(),
            }),
            other => {
                tracing::warn!(error = ?other, "rebalance error");
                None
            }
        };
        let assign = matches!(event, Some(RebalanceEvent::Assigned(_)));
        if let Some(ev) = event {
            if self.deferred.load(Ordering::SeqCst) && self.events.send(ev).is_ok() {
                return;
            }
        }
        let done = if assign {
            apply_assign(consumer, tpl)
        } else {
            apply_revoke(consumer, tpl)
        };
        if let Err(e) = done {
            tracing::warn!(error = %e, "rebalance");
        }
    }
}

/// Create the source consumer: group `application.id`, manual commits, `read_committed`,
/// `auto.offset.reset=earliest`, cooperative incremental rebalancing
/// (`partition.assignment.strategy=cooperative-sticky`: a rebalance takes away only the
/// partitions that move, the others keep processing) and static membership
/// (`group.instance.id`, see [`Config::group_instance_id`]), `statistics.interval.ms=1000`
/// for the stall check of `/ready` (see [`super::link`]); then the user's `kafka.*` and
/// `kafka.consumer.*`, which win (an empty `group.instance.id` turns static membership
/// off).
///
/// `enable.partition.eof` is always off, whatever the user sets: librdkafka's batch read
/// (`rd_kafka_consume_batch_queue`, 2.12.1) moves a partition's position one past a
/// partition-end event's offset, which would skip the next record written there.
/// `--stop-at-end` compares positions with high watermarks instead. Rebalances are sent to
/// `events` while [`SourceContext::defer_rebalances`] is on.
///
/// # Errors
/// [`crate::Error::Config`] when librdkafka refuses a property.
pub(crate) fn create(cfg: &Config, events: mpsc::Sender<RebalanceEvent>) -> Result<SourceConsumer> {
    let ctx = SourceContext {
        events,
        deferred: AtomicBool::new(false),
        link: super::link::register(super::link::Client::Source),
    };
    source_config(cfg)
        .create_with_context(ctx)
        .map_err(crate::kafka::config_error)
}

/// How much the source consumer fetches ahead of processing, in KiB
/// (`queued.max.messages.kbytes`; librdkafka's default is 65536). The run loop is slower
/// than the fetcher, so a prefetch queue fills up to its bound: with 64 MiB the onceflow side
/// of `scripts/bench` peaked at 269–278 MiB, with 4 MiB at 219–234 MiB, at the same speed
/// (4 MiB is about 50 ms of its input). Kafka Streams buffers 1,000 records a partition
/// (`buffered.records.per.partition`). `kafka.consumer.queued.max.messages.kbytes` wins.
const SOURCE_PREFETCH_KIB: &str = "4096";

fn source_config(cfg: &Config) -> rdkafka::ClientConfig {
    let mut defaults = vec![
        ("group.id", cfg.application_id.as_str()),
        ("enable.auto.commit", "false"),
        ("enable.auto.offset.store", "false"),
        ("auto.offset.reset", "earliest"),
        ("isolation.level", "read_committed"),
        ("partition.assignment.strategy", "cooperative-sticky"),
        ("queued.max.messages.kbytes", SOURCE_PREFETCH_KIB),
        // For `/ready`: a cluster whose brokers stop answering (see kafka::link).
        ("statistics.interval.ms", super::link::STATS_INTERVAL_MS),
    ];
    if let Some(id) = &cfg.group_instance_id {
        defaults.push(("group.instance.id", id.as_str()));
    }
    let mut c = crate::kafka::client_config(cfg, &defaults, &cfg.kafka_consumer);
    if c.get("group.instance.id").is_some_and(str::is_empty) {
        c.remove("group.instance.id");
    }
    // Partition-end events in a batch move the position past the end (see `create`).
    c.set("enable.partition.eof", "false");
    c
}

/// Whether the source consumer of `cfg` is a static member of its group (KIP-345): it then
/// does not leave the group when it stops, so a restart within `session.timeout.ms` gets
/// its partitions back without a rebalance.
pub(crate) fn is_static_member(cfg: &Config) -> bool {
    source_config(cfg).get("group.instance.id").is_some()
}

/// Create the restore consumer: no group, manual assignment of changelog partitions,
/// `fetch.wait.max.ms=10` (librdkafka's default 500 ms delays the last step of every
/// restore), then the user's `kafka.*` and `kafka.consumer.*` properties (except
/// `group.id`-related ones, which it does not use), then, whatever those say,
/// `isolation.level=read_committed` (a restore must never apply an aborted or still-open
/// transaction's records, KIP-98) and no offset commits.
///
/// # Errors
/// [`crate::Error::Config`] when librdkafka refuses a property.
pub(crate) fn create_restore_consumer(cfg: &Config) -> Result<BaseConsumer> {
    restore_consumer_config(cfg)
        .create()
        .map_err(crate::kafka::config_error)
}

fn restore_consumer_config(cfg: &Config) -> rdkafka::ClientConfig {
    let mut c = crate::kafka::client_config(
        cfg,
        &[
            ("group.id", &format!("{}-restore", cfg.application_id)),
            ("enable.auto.offset.store", "false"),
            ("auto.offset.reset", "earliest"),
            ("enable.partition.eof", "false"),
            // A restore reads to a captured end: once caught up, a fetch that waits the
            // default 500 ms for more data only delays the position reaching that end.
            ("fetch.wait.max.ms", "10"),
        ],
        &cfg.kafka_consumer,
    );
    c.set("isolation.level", "read_committed");
    c.set("enable.auto.commit", "false");
    c
}

/// Create the client that reads changelog high watermarks: `isolation.level=read_uncommitted`
/// (forced, whatever `kafka.consumer.*` says), never subscribed or assigned.
///
/// The restore consumer is `read_committed`, so its watermark query answers the last stable
/// offset (LSO, KIP-98). Comparing the two tells whether a changelog partition still holds
/// an open transaction: a previous owner of the partition (a zombie, or an instance that is
/// still committing its revocation) whose marks would be missed by a restore that stopped
/// at the LSO.
///
/// # Errors
/// [`crate::Error::Config`] when librdkafka refuses a property.
pub(crate) fn create_watermark_client(cfg: &Config) -> Result<BaseConsumer> {
    let mut c = crate::kafka::client_config(
        cfg,
        &[
            ("group.id", &format!("{}-restore", cfg.application_id)),
            ("enable.auto.commit", "false"),
            ("enable.partition.eof", "false"),
        ],
        &cfg.kafka_consumer,
    );
    c.set("isolation.level", "read_uncommitted");
    c.create().map_err(crate::kafka::config_error)
}

/// The headers of a fetched record, in order: name and value (`None`: a null value).
///
/// Kafka's protocol makes a header name a string, but the broker takes any bytes. A name
/// that is not UTF-8 is decoded with U+FFFD replacement characters, as Kafka's Java client
/// decodes it; rdkafka's own header iterator panics on one. Values are never decoded.
pub fn header_pairs(
    headers: Option<&rdkafka::message::BorrowedHeaders>,
) -> impl Iterator<Item = (std::borrow::Cow<'_, str>, Option<&[u8]>)> {
    use rdkafka::bindings as rd;
    // rdkafka's `BorrowedHeaders` is the librdkafka headers list itself.
    let list = headers.map_or(std::ptr::null(), |h| {
        h as *const rdkafka::message::BorrowedHeaders as *const rd::rd_kafka_headers_t
    });
    // SAFETY: the list of a live message (or none), borrowed for as long as `headers`.
    unsafe { list_pairs(list) }
}

/// The pairs of a librdkafka headers list, as [`header_pairs`] gives them.
///
/// # Safety
/// `list` must be null or the headers list of a message that lives for `'a`.
pub(crate) unsafe fn list_pairs<'a>(
    list: *const rdkafka::bindings::rd_kafka_headers_t,
) -> impl Iterator<Item = (std::borrow::Cow<'a, str>, Option<&'a [u8]>)> {
    use rdkafka::bindings as rd;
    let count = if list.is_null() {
        0
    } else {
        // SAFETY: a live list (the caller's promise).
        unsafe { rd::rd_kafka_header_cnt(list) }
    };
    (0..count).filter_map(move |i| {
        let mut name = std::ptr::null();
        let mut value = std::ptr::null();
        let mut size = 0;
        // SAFETY: `i` < the list's count; what it points to lives as long as `headers`.
        let err = unsafe { rd::rd_kafka_header_get_all(list, i, &mut name, &mut value, &mut size) };
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated name and `size` value bytes owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
        let value = (!value.is_null())
            .then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) });
        Some((name, value))
    })
}

#[cfg(test)]
mod restore_consumer_tests {
    use super::*;

    fn load(sets: &[(&str, &str)]) -> Config {
        Config::from_sets(sets)
    }

    #[test]
    fn the_source_consumer_is_cooperative_and_static_when_instance_id_is_set() {
        let cfg = load(&[("application.id", "app"), ("instance.id", "a1")]);
        let c = source_config(&cfg);
        assert_eq!(
            c.get("partition.assignment.strategy"),
            Some("cooperative-sticky")
        );
        assert_eq!(c.get("group.instance.id"), Some("app-a1"));
        assert!(is_static_member(&cfg));

        // instance.id left to the host name: a dynamic member (two processes on one host
        // must not fence each other), still cooperative.
        let cfg = load(&[("application.id", "app")]);
        let c = source_config(&cfg);
        assert_eq!(c.get("group.instance.id"), None);
        assert_eq!(
            c.get("partition.assignment.strategy"),
            Some("cooperative-sticky")
        );
        assert!(!is_static_member(&cfg));
    }

    #[test]
    fn the_users_group_instance_id_and_strategy_win() {
        let cfg = load(&[
            ("instance.id", "a1"),
            ("kafka.consumer.group.instance.id", "mine"),
            ("kafka.consumer.partition.assignment.strategy", "range"),
        ]);
        let c = source_config(&cfg);
        assert_eq!(c.get("group.instance.id"), Some("mine"));
        assert_eq!(c.get("partition.assignment.strategy"), Some("range"));
        let cfg = load(&[
            ("instance.id", "a1"),
            ("kafka.consumer.group.instance.id", ""),
        ]);
        assert_eq!(source_config(&cfg).get("group.instance.id"), None);
        assert!(!is_static_member(&cfg));
    }

    #[test]
    fn the_source_consumer_never_has_partition_end_events() {
        // Config files refuse the property (`config::managed_property`); the source
        // consumer forces it off all the same.
        let mut cfg = load(&[("application.id", "app")]);
        assert_eq!(
            source_config(&cfg).get("enable.partition.eof"),
            Some("false")
        );
        cfg.kafka_consumer
            .insert("enable.partition.eof".into(), "true".into());
        cfg.kafka
            .insert("enable.partition.eof".into(), "true".into());
        assert_eq!(
            source_config(&cfg).get("enable.partition.eof"),
            Some("false")
        );
    }

    #[test]
    fn the_source_prefetch_is_bounded_unless_the_user_sets_it() {
        let cfg = load(&[("application.id", "app")]);
        let c = source_config(&cfg);
        assert_eq!(
            c.get("queued.max.messages.kbytes"),
            Some(SOURCE_PREFETCH_KIB)
        );
        // librdkafka takes it (a refused property fails here, without a broker).
        c.create::<BaseConsumer>()
            .expect("librdkafka accepts the source config");
        let cfg = load(&[("kafka.consumer.queued.max.messages.kbytes", "65536")]);
        let c = source_config(&cfg);
        assert_eq!(c.get("queued.max.messages.kbytes"), Some("65536"));
    }

    #[test]
    fn the_restore_consumer_stays_read_committed_whatever_the_user_sets() {
        // Config files refuse these values (`config::managed_property`); the restore
        // consumer forces its own all the same.
        let mut cfg = Config::load_with_env(&[], &[], std::iter::empty()).unwrap();
        for (k, v) in [
            ("isolation.level", "read_uncommitted"),
            ("enable.auto.commit", "true"),
        ] {
            cfg.kafka_consumer.insert(k.into(), v.into());
        }
        let c = restore_consumer_config(&cfg);
        assert_eq!(c.get("isolation.level"), Some("read_committed"));
        assert_eq!(c.get("enable.auto.commit"), Some("false"));
        assert_eq!(c.get("fetch.wait.max.ms"), Some("10"));
    }
}
