//! Topic administration: partition counts, creation of missing topics, the topic
//! configuration of changelogs (checked and corrected at start-up), deletion of topics and
//! consumer groups. Every request is retried on transient broker errors
//! ([`crate::kafka::retry`]): a just-started broker, a coordinator still loading, a topic
//! whose partitions have no leader yet.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kafka::retry::{is_retriable_code, retry};
use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, ConfigSource, NewTopic, ResourceSpecifier,
    TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use std::time::Duration;

/// Timeout of one group request ([`Admin::delete_group`]); transient failures are retried.
const GROUP_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A topic to create: name, partition count, topic configs (`cleanup.policy`, ...).
pub(crate) type TopicSpec<'a> = (String, usize, Vec<(&'a str, String)>);

/// Topic configs a changelog topic is created with.
///
/// **A live entry is always restorable**, whatever the downtime. An entry's liveness is
/// judged by stream time, which stands still while nothing is processed, so no wall-clock
/// age of a changelog record says it is dead: any time-based deletion (`cleanup.policy`
/// with `delete` and a finite `retention.ms`, the old `TTL + grace` setting) can empty the
/// changelog during an outage, and a restore into a lost state dir then finds nothing.
/// So the policy is `compact` alone: the latest record of every key stays until the sweep
/// writes its tombstone (expired entries leave the log only that way, and with
/// `max_keys` eviction); the log size is bounded by the live keys. Tombstones themselves
/// are removed after `delete.retention.ms` (broker default 24 h): a restore that resumes
/// from a local checkpoint older than that may miss one and keep a swept entry, which the
/// decision judges by record time like any entry and the next sweep deletes again: nothing
/// live is ever lost.
pub(crate) const CHANGELOG_CONFIGS: &[(&str, &str)] = &[("cleanup.policy", "compact")];

/// One setting of an existing changelog topic that contradicts [`CHANGELOG_CONFIGS`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConfigMismatch {
    /// The setting, e.g. `cleanup.policy`.
    pub(crate) setting: String,
    /// The value found on the topic (with the settings that make it wrong, e.g.
    /// `compact,delete (retention.ms=3600000)`).
    pub(crate) found: String,
    /// The value onceflow needs.
    pub(crate) expected: String,
}

impl std::fmt::Display for ConfigMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is {}, expected {}",
            self.setting, self.found, self.expected
        )
    }
}

/// The settings among `configs` (an existing changelog topic's configuration, name to
/// value) that let the broker delete records the store may still treat as live.
///
/// `cleanup.policy` must be `compact`; `compact,delete` is accepted only when neither time
/// nor size can delete anything (`retention.ms=-1` and `retention.bytes=-1`). A missing
/// `cleanup.policy` counts as the broker default, `delete`.
pub(crate) fn changelog_mismatches(
    configs: &std::collections::BTreeMap<String, String>,
) -> Vec<ConfigMismatch> {
    let get = |k: &str| configs.get(k).map(String::as_str);
    let policy = get("cleanup.policy").unwrap_or("delete");
    let parts: Vec<&str> = policy.split(',').map(str::trim).collect();
    let compact = parts.contains(&"compact");
    let delete = parts.contains(&"delete");
    let (ms, bytes) = (get("retention.ms"), get("retention.bytes"));
    let never_deletes = ms == Some("-1") && bytes.unwrap_or("-1") == "-1";
    if compact && (!delete || never_deletes) {
        return Vec::new();
    }
    let mut found = policy.to_string();
    if delete {
        found.push_str(&format!(
            " (retention.ms={}, retention.bytes={})",
            ms.unwrap_or("broker default"),
            bytes.unwrap_or("broker default")
        ));
    }
    vec![ConfigMismatch {
        setting: "cleanup.policy".into(),
        found,
        expected: "compact".into(),
    }]
}

/// A blocking admin client.
pub(crate) struct Admin {
    client: AdminClient<DefaultClientContext>,
    timeout: Duration,
}

impl Admin {
    /// Connect an admin client with the config's bootstrap servers and `kafka.*` properties.
    ///
    /// # Errors
    /// [`Error::Config`] when librdkafka refuses a property.
    pub(crate) fn new(cfg: &Config) -> Result<Admin> {
        // A metadata request must never create the topic it asks about (brokers with
        // auto.create.topics.enable would create it with default settings).
        let client = crate::kafka::client_config(
            cfg,
            &[("allow.auto.create.topics", "false")],
            &Default::default(),
        )
        .create()
        .map_err(crate::kafka::config_error)?;
        Ok(Admin {
            client,
            timeout: Duration::from_secs(30),
        })
    }

    /// The number of partitions of `topic`, `None` if it does not exist.
    ///
    /// # Errors
    /// [`Error::Kafka`] when metadata cannot be fetched (broker unreachable), after the
    /// retries of transient errors.
    pub(crate) fn partition_count(&self, topic: &str) -> Result<Option<usize>> {
        partition_count_of(self.client.inner(), topic, self.timeout)
    }

    /// Whether any of the `partitions` partitions of `topic` holds a record (its high
    /// watermark above its low one). Transient errors (a partition without a leader yet,
    /// a topic this client does not know yet) are retried.
    ///
    /// # Errors
    /// [`Error::Kafka`] when a partition's watermarks cannot be read.
    pub(crate) fn has_records(&self, topic: &str, partitions: usize) -> Result<bool> {
        for p in 0..i32::try_from(partitions).unwrap_or(i32::MAX) {
            let (low, high) = crate::kafka::retry::retry_known_topic("fetch watermarks", || {
                self.client
                    .inner()
                    .fetch_watermarks(topic, p, self.timeout)
                    .map_err(Error::kafka("fetch changelog watermarks"))
            })?;
            if high > low {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// The number of partitions of `topic` as `client` gets it from a metadata request, `None`
/// if it does not exist; each request waits at most `timeout` (and 10 s).
///
/// # Errors
/// As [`Admin::partition_count`].
pub(crate) fn partition_count_of<C: rdkafka::client::ClientContext>(
    client: &rdkafka::client::Client<C>,
    topic: &str,
    timeout: Duration,
) -> Result<Option<usize>> {
    retry(&format!("metadata of topic {topic}"), || {
        partition_count_once(client, topic, timeout)
    })
}

fn partition_count_once<C: rdkafka::client::ClientContext>(
    client: &rdkafka::client::Client<C>,
    topic: &str,
    timeout: Duration,
) -> Result<Option<usize>> {
    let md = client
        .fetch_metadata(Some(topic), timeout.min(METADATA_ATTEMPT))
        .map_err(|e| {
            if matches!(
                e.rdkafka_error_code(),
                Some(RDKafkaErrorCode::BrokerTransportFailure | RDKafkaErrorCode::AllBrokersDown)
            ) {
                crate::kafka::link::note_down();
            }
            Error::kafka("fetch metadata")(e)
        })?;
    crate::kafka::link::note_up();
    let Some(t) = md.topics().iter().find(|t| t.name() == topic) else {
        return Ok(None);
    };
    match t.error() {
        None if !t.partitions().is_empty() => Ok(Some(t.partitions().len())),
        None => Ok(None),
        Some(e) => {
            let code: RDKafkaErrorCode = e.into();
            if code == RDKafkaErrorCode::UnknownTopicOrPartition
                || code == RDKafkaErrorCode::UnknownTopic
            {
                Ok(None)
            } else {
                Err(Error::BrokerCode {
                    what: format!("metadata of topic {topic}"),
                    code,
                })
            }
        }
    }
}

impl Admin {
    /// Create `topic` with `partitions` partitions and topic `configs` unless it exists.
    /// Returns whether it was created.
    ///
    /// # Errors
    /// [`Error::Broker`] when the broker refuses the creation for any reason other than
    /// the topic already existing.
    pub(crate) fn ensure_topic(
        &self,
        topic: &str,
        partitions: usize,
        configs: &[(&str, &str)],
    ) -> Result<bool> {
        let configs = configs.iter().map(|(k, v)| (*k, v.to_string())).collect();
        let created = self.ensure_topics(&[(topic.to_string(), partitions, configs)])?;
        Ok(!created.is_empty())
    }

    /// Create every topic of `topics` (name, partitions, topic configs) that does not exist,
    /// in one CreateTopics request. Returns the names created.
    ///
    /// # Errors
    /// [`Error::Broker`] when the broker refuses a creation for any reason other than the
    /// topic already existing.
    /// Topics created here are waited for until the broker's metadata lists their
    /// partitions (a topic just created may answer `UnknownTopicOrPartition` for a moment).
    pub(crate) fn ensure_topics(&self, topics: &[TopicSpec<'_>]) -> Result<Vec<String>> {
        let mut created = Vec::new();
        retry("create topics", || {
            let left: Vec<TopicSpec<'_>> = topics
                .iter()
                .filter(|(t, _, _)| !created.contains(t))
                .cloned()
                .collect();
            created.extend(self.create_topics_once(&left)?);
            Ok(())
        })?;
        for t in &created {
            retry(
                &format!("metadata of new topic {t}"),
                || match partition_count_once(self.client.inner(), t, self.timeout)? {
                    Some(_) => Ok(()),
                    None => Err(Error::BrokerCode {
                        what: format!("metadata of new topic {t}"),
                        code: RDKafkaErrorCode::LeaderNotAvailable,
                    }),
                },
            )?;
        }
        Ok(created)
    }

    fn create_topics_once(&self, topics: &[TopicSpec<'_>]) -> Result<Vec<String>> {
        if topics.is_empty() {
            return Ok(Vec::new());
        }
        let new: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|(t, n, configs)| {
                configs.iter().fold(
                    NewTopic::new(t, *n as i32, TopicReplication::Fixed(-1)),
                    |nt, (k, v)| nt.set(k, v),
                )
            })
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(self.timeout));
        let res = futures::executor::block_on(self.client.create_topics(&new, &opts))
            .map_err(Error::kafka("create topics"))?;
        let mut created = Vec::new();
        let mut failed = None;
        for r in res {
            match r {
                Ok(t) => created.push(t),
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                // A transient failure of one topic: the others are kept, it is retried.
                Err((t, code)) if is_retriable_code(code) && failed.is_none() => {
                    failed = Some(Error::BrokerCode {
                        what: format!("cannot create topic {t}"),
                        code,
                    })
                }
                Err((t, code)) => {
                    return Err(Error::BrokerCode {
                        what: format!("cannot create topic {t}"),
                        code,
                    })
                }
            }
        }
        match failed {
            // Report progress through `created` only when nothing is left to retry.
            Some(e) if created.is_empty() => Err(e),
            _ => Ok(created),
        }
    }

    /// The configuration of `topic` as the broker reports it: every setting with a value,
    /// each with whether it is a topic-level override (`true`) or inherited from the broker.
    ///
    /// # Errors
    /// [`Error::Broker`] when the broker refuses DescribeConfigs (e.g. no such topic, not
    /// authorized); [`Error::Kafka`] when it cannot be reached.
    pub(crate) fn topic_configs(
        &self,
        topic: &str,
    ) -> Result<std::collections::BTreeMap<String, (String, bool)>> {
        let opts = AdminOptions::new().request_timeout(Some(self.timeout));
        let spec = [ResourceSpecifier::Topic(topic)];
        let res = retry("describe configs", || {
            futures::executor::block_on(self.client.describe_configs(&spec, &opts))
                .map_err(Error::kafka("describe configs"))
        })?;
        let resource = res
            .into_iter()
            .next()
            .ok_or_else(|| Error::Broker(format!("no configuration returned for topic {topic}")))?
            .map_err(|code| {
                Error::Broker(format!(
                    "cannot describe the configuration of topic {topic}: {code}"
                ))
            })?;
        Ok(resource
            .entries
            .into_iter()
            .filter_map(|e| {
                let own = e.source == ConfigSource::DynamicTopic;
                e.value.map(|v| (e.name, (v, own)))
            })
            .collect())
    }

    /// Check the configuration of the existing changelog `topic` of `store` against
    /// [`CHANGELOG_CONFIGS`] and correct what contradicts it (AlterConfigs, keeping the
    /// topic's other overrides). Returns the mismatches that were corrected (empty when
    /// the topic was right); each is logged as a warning.
    ///
    /// # Errors
    /// [`Error::Broker`] naming the topic, the setting, the value found and the one
    /// expected when the configuration cannot be read or the broker refuses the correction
    /// (e.g. not authorized): onceflow does not run on a changelog that may lose live
    /// entries.
    pub(crate) fn ensure_changelog_config(
        &self,
        store: &str,
        topic: &str,
    ) -> Result<Vec<ConfigMismatch>> {
        let current = self.topic_configs(topic)?;
        let values = current
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect();
        let wrong = changelog_mismatches(&values);
        if wrong.is_empty() {
            return Ok(wrong);
        }
        let refuse = |why: String| {
            let list: Vec<String> = wrong.iter().map(ToString::to_string).collect();
            Error::Broker(format!(
                "changelog topic {topic} of store {store}: {}; the broker could delete live dedup entries \
                 (a restore would then let duplicates through), and correcting it failed: {why}; \
                 set it on the topic (kafka-configs --alter --entity-type topics --entity-name {topic} \
                 --add-config cleanup.policy=compact) and start again",
                list.join("; ")
            ))
        };
        // AlterConfigs replaces the topic's whole set of overrides: send the ones it has,
        // with the corrections applied.
        let mut set: std::collections::BTreeMap<&str, &str> = current
            .iter()
            .filter(|(_, (_, own))| *own)
            .map(|(k, (v, _))| (k.as_str(), v.as_str()))
            .collect();
        for m in &wrong {
            set.insert(&m.setting, &m.expected);
        }
        let alter = set.iter().fold(
            AlterConfig::new(ResourceSpecifier::Topic(topic)),
            |a, (k, v)| a.set(k, v),
        );
        let opts = AdminOptions::new().request_timeout(Some(self.timeout));
        let res = futures::executor::block_on(self.client.alter_configs([&alter], &opts))
            .map_err(|e| refuse(e.to_string()))?;
        for r in res {
            if let Err((_, code)) = r {
                return Err(refuse(code.to_string()));
            }
        }
        for m in &wrong {
            tracing::warn!(
                store,
                topic,
                setting = %m.setting,
                found = %m.found,
                expected = %m.expected,
                "changelog topic could delete live entries: corrected its configuration"
            );
        }
        Ok(wrong)
    }

    /// Delete `topics` (missing ones are fine). For tests and demos.
    ///
    /// # Errors
    /// [`Error::Broker`] when the broker refuses.
    pub(crate) fn delete_topics(&self, topics: &[&str]) -> Result<()> {
        retry("delete topics", || {
            let opts = AdminOptions::new().operation_timeout(Some(self.timeout));
            let res = futures::executor::block_on(self.client.delete_topics(topics, &opts))
                .map_err(Error::kafka("delete topics"))?;
            all_deleted(res, RDKafkaErrorCode::UnknownTopicOrPartition, "topic")
        })
    }

    /// Delete the records of `topic` before the given offsets, per partition
    /// (`(partition, offset)`; DeleteRecords, which moves each partition's log start
    /// offset up to its offset). Used to purge consumed repartition records.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the request fails, [`Error::Broker`] naming the partition the
    /// broker refused (e.g. an offset beyond its high watermark). Not retried: the next
    /// purge asks again.
    pub(crate) fn delete_records(&self, topic: &str, offsets: &[(i32, i64)]) -> Result<()> {
        let mut tpl = rdkafka::TopicPartitionList::new();
        for (p, o) in offsets {
            tpl.add_partition_offset(topic, *p, rdkafka::Offset::Offset(*o))
                .map_err(Error::kafka("delete records"))?;
        }
        let opts = AdminOptions::new().operation_timeout(Some(self.timeout));
        let res = futures::executor::block_on(self.client.delete_records(&tpl, &opts))
            .map_err(Error::kafka("delete records"))?;
        for e in res.elements() {
            if let Err(err) = e.error() {
                return Err(Error::Broker(format!(
                    "DeleteRecords of {}/{} up to {:?} refused: {err}",
                    e.topic(),
                    e.partition(),
                    e.offset()
                )));
            }
        }
        Ok(())
    }

    /// Delete consumer group `group` with its committed offsets (a missing group is fine).
    ///
    /// # Errors
    /// [`Error::BrokerCode`] when the broker refuses (`NonEmptyGroup` while members are
    /// active), after the retries of transient errors (`NotCoordinator` on a broker that
    /// was just started).
    pub(crate) fn delete_group(&self, group: &str) -> Result<()> {
        retry(&format!("delete group {group}"), || {
            // A short request timeout: on a just-started broker librdkafka may wait for
            // a group coordinator that is being elected for the whole timeout; a new
            // attempt looks the coordinator up again.
            let opts = AdminOptions::new()
                .request_timeout(Some(GROUP_REQUEST_TIMEOUT))
                .operation_timeout(Some(GROUP_REQUEST_TIMEOUT));
            let res = futures::executor::block_on(self.client.delete_groups(&[group], &opts))
                .map_err(Error::kafka("delete group"))?;
            all_deleted(res, RDKafkaErrorCode::GroupIdNotFound, "group")
        })
    }
}

/// The answer to a delete request (topics or groups, `what`): every name deleted or
/// already gone (`absent`, e.g. an unknown topic), else the first refusal.
///
/// # Errors
/// [`Error::BrokerCode`] naming the first `what` the broker refused to delete.
fn all_deleted(
    res: Vec<Result<String, (String, RDKafkaErrorCode)>>,
    absent: RDKafkaErrorCode,
    what: &str,
) -> Result<()> {
    for r in res {
        match r {
            Ok(_) => {}
            Err((_, code)) if code == absent => {}
            Err((name, code)) => {
                return Err(Error::BrokerCode {
                    what: format!("cannot delete {what} {name}"),
                    code,
                })
            }
        }
    }
    Ok(())
}

/// The longest one metadata request may wait: [`Admin::partition_count`] retries for up to
/// two minutes, in attempts this long, so that a stop asked for meanwhile
/// ([`crate::kafka::retry::cancellable`]) is seen within seconds.
const METADATA_ATTEMPT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn cfg(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn only_configs_that_never_delete_a_live_entry_pass() {
        let ok = [
            cfg(&[("cleanup.policy", "compact"), ("retention.ms", "5000")]),
            cfg(&[
                ("cleanup.policy", "compact,delete"),
                ("retention.ms", "-1"),
                ("retention.bytes", "-1"),
            ]),
            cfg(&[
                ("cleanup.policy", "delete, compact"),
                ("retention.ms", "-1"),
            ]),
        ];
        for c in &ok {
            assert_eq!(changelog_mismatches(c), vec![], "{c:?}");
        }
        let bad = [
            (
                cfg(&[
                    ("cleanup.policy", "compact,delete"),
                    ("retention.ms", "5000"),
                ]),
                "compact,delete (retention.ms=5000, retention.bytes=broker default)",
            ),
            (
                cfg(&[
                    ("cleanup.policy", "compact,delete"),
                    ("retention.ms", "-1"),
                    ("retention.bytes", "1048576"),
                ]),
                "compact,delete (retention.ms=-1, retention.bytes=1048576)",
            ),
            (
                cfg(&[("cleanup.policy", "delete"), ("retention.ms", "-1")]),
                "delete (retention.ms=-1, retention.bytes=broker default)",
            ),
            (
                cfg(&[]),
                "delete (retention.ms=broker default, retention.bytes=broker default)",
            ),
        ];
        for (c, found) in &bad {
            assert_eq!(
                changelog_mismatches(c),
                vec![ConfigMismatch {
                    setting: "cleanup.policy".into(),
                    found: found.to_string(),
                    expected: "compact".into(),
                }],
                "{c:?}"
            );
        }
    }

    #[test]
    fn new_changelogs_are_created_right() {
        let c = CHANGELOG_CONFIGS
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(changelog_mismatches(&c), vec![]);
    }
}
