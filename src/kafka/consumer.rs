//! The source consumer: a `BaseConsumer` whose rebalance callbacks go to a listener.
//!
//! librdkafka calls the rebalance callback from inside `poll`, on the polling thread, so
//! the listener runs between two records, never in the middle of one. On revocation the
//! listener commits the revoked partitions' work synchronously before they are given up
//! (what Kafka Streams does in `onPartitionsRevoked`); on assignment it only creates tasks.

use crate::config::Config;
use crate::error::Result;
use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance};
use rdkafka::ClientContext;
use std::sync::{Arc, OnceLock};

/// Receives the partitions assigned to and revoked from this instance.
pub trait RebalanceListener: Send + Sync {
    /// Partitions are about to be taken away: finish their work and commit it now.
    fn on_revoke(&self, consumer: &SourceConsumer, partitions: &[i32]);
    /// Partitions were assigned: set up their tasks.
    fn on_assign(&self, consumer: &SourceConsumer, partitions: &[i32]);
}

/// Consumer context forwarding rebalances to the [`RebalanceListener`].
#[derive(Default)]
pub struct SourceContext {
    listener: OnceLock<Arc<dyn RebalanceListener>>,
}

/// The consumer type of the runtime.
pub type SourceConsumer = BaseConsumer<SourceContext>;

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
        tracing::error!(%error, reason, "librdkafka error");
    }
}

fn partitions(r: &Rebalance<'_>) -> Vec<i32> {
    match r {
        Rebalance::Assign(tpl) | Rebalance::Revoke(tpl) => {
            tpl.elements().iter().map(|e| e.partition()).collect()
        }
        Rebalance::Error(_) => Vec::new(),
    }
}

impl ConsumerContext for SourceContext {
    fn pre_rebalance(&self, consumer: &SourceConsumer, r: &Rebalance<'_>) {
        match r {
            Rebalance::Revoke(_) => {
                if let Some(l) = self.listener.get() {
                    l.on_revoke(consumer, &partitions(r));
                }
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Assign(_) => {}
        }
    }

    fn post_rebalance(&self, consumer: &SourceConsumer, r: &Rebalance<'_>) {
        if let Rebalance::Assign(_) = r {
            if let Some(l) = self.listener.get() {
                l.on_assign(consumer, &partitions(r));
            }
        }
    }
}

/// Create the source consumer: group `application.id`, manual commits, `read_committed`,
/// `auto.offset.reset=earliest`; then the user's `kafka.*` and `kafka.consumer.*`.
///
/// `partition_eof` turns on librdkafka's end-of-partition events (used by `--stop-at-end`).
///
/// # Errors
/// [`crate::Error::Config`] when librdkafka refuses a property.
pub fn create(
    cfg: &Config,
    partition_eof: bool,
    listener: Arc<dyn RebalanceListener>,
) -> Result<SourceConsumer> {
    let ctx = SourceContext::default();
    let _ = ctx.listener.set(listener);
    crate::kafka::client_config(
        cfg,
        &[
            ("group.id", cfg.application_id.as_str()),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("auto.offset.reset", "earliest"),
            ("isolation.level", "read_committed"),
            (
                "enable.partition.eof",
                if partition_eof { "true" } else { "false" },
            ),
        ],
        &cfg.kafka_consumer,
    )
    .create_with_context(ctx)
    .map_err(crate::kafka::config_error)
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
pub fn create_restore_consumer(cfg: &Config) -> Result<BaseConsumer> {
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
pub fn create_watermark_client(cfg: &Config) -> Result<BaseConsumer> {
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

#[cfg(test)]
mod restore_consumer_tests {
    use super::*;

    #[test]
    fn the_restore_consumer_stays_read_committed_whatever_the_user_sets() {
        let sets: Vec<(String, String)> = [
            ("kafka.consumer.isolation.level", "read_uncommitted"),
            ("kafka.consumer.enable.auto.commit", "true"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let cfg = Config::load_with_env(&[], &sets, std::iter::empty()).unwrap();
        assert_eq!(
            cfg.kafka_consumer
                .get("isolation.level")
                .map(String::as_str),
            Some("read_uncommitted"),
            "the user's setting reached the config"
        );
        let c = restore_consumer_config(&cfg);
        assert_eq!(c.get("isolation.level"), Some("read_committed"));
        assert_eq!(c.get("enable.auto.commit"), Some("false"));
        assert_eq!(c.get("fetch.wait.max.ms"), Some("10"));
    }
}
