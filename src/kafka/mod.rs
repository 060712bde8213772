//! Kafka clients: the source consumer (rebalance events through a listener), the output
//! producer (delivery tracked for the commit protocol), and admin (topics, partition counts).
//!
//! Every client takes `bootstrap.servers` from [`Config`] and the librdkafka properties
//! passed through as `kafka.*` (both clients), `kafka.consumer.*` or `kafka.producer.*`.

pub(crate) mod admin;
pub(crate) mod batch;
pub(crate) mod consumer;
pub(crate) mod link;
pub(crate) mod producer;
pub(crate) mod retry;

use crate::config::Config;
use rdkafka::ClientConfig;
use std::collections::BTreeMap;

/// A librdkafka config with `bootstrap.servers`, then `defaults`, then the user's
/// `kafka.*` properties, then `specific` (consumer- or producer-only) ones.
pub(crate) fn client_config(
    cfg: &Config,
    defaults: &[(&str, &str)],
    specific: &BTreeMap<String, String>,
) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.bootstrap_servers);
    for (k, v) in defaults {
        c.set(*k, *v);
    }
    for (k, v) in cfg.kafka.iter().chain(specific.iter()) {
        c.set(k, v);
    }
    c
}

/// Turn librdkafka refusing a property (unknown, or a value it cannot take) into a config
/// error naming the `kafka.*` key and its value.
pub(crate) fn config_error(e: rdkafka::error::KafkaError) -> crate::Error {
    match e {
        rdkafka::error::KafkaError::ClientCreation(msg) => crate::Error::Config(format!(
            "a kafka.* property was refused by librdkafka: {msg}"
        )),
        rdkafka::error::KafkaError::ClientConfig(_, desc, key, value) => {
            crate::Error::Config(format!(
                "kafka.{key} (or kafka.consumer.{key} / kafka.producer.{key}) = {value:?} was refused by librdkafka: {desc}"
            ))
        }
        other => crate::Error::Kafka {
            op: "client creation",
            source: other,
        },
    }
}
