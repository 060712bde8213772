//! Topic administration: partition counts, creation of missing topics, deletion of
//! topics and consumer groups. Every request is retried on transient broker errors
//! ([`crate::kafka::retry`]): a just-started broker, a coordinator still loading, a topic
//! whose partitions have no leader yet.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kafka::retry::{is_retriable_code, retry};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use std::time::Duration;

/// Timeout of one group request ([`Admin::delete_group`]); transient failures are retried.
const GROUP_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A topic to create: name, partition count, topic configs (`cleanup.policy`, ...).
pub type TopicSpec<'a> = (String, usize, Vec<(&'a str, String)>);

/// A blocking admin client.
pub struct Admin {
    client: AdminClient<DefaultClientContext>,
    timeout: Duration,
}

impl Admin {
    /// Connect an admin client with the config's bootstrap servers and `kafka.*` properties.
    ///
    /// # Errors
    /// [`Error::Config`] when librdkafka refuses a property.
    pub fn new(cfg: &Config) -> Result<Admin> {
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
    pub fn partition_count(&self, topic: &str) -> Result<Option<usize>> {
        retry(&format!("metadata of topic {topic}"), || {
            self.partition_count_once(topic)
        })
    }

    fn partition_count_once(&self, topic: &str) -> Result<Option<usize>> {
        let md = self
            .client
            .inner()
            .fetch_metadata(Some(topic), self.timeout)
            .map_err(Error::kafka("fetch metadata"))?;
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

    /// Create `topic` with `partitions` partitions and topic `configs` unless it exists.
    /// Returns whether it was created.
    ///
    /// # Errors
    /// [`Error::Broker`] when the broker refuses the creation for any reason other than
    /// the topic already existing.
    pub fn ensure_topic(
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
    pub fn ensure_topics(&self, topics: &[TopicSpec<'_>]) -> Result<Vec<String>> {
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
            retry(&format!("metadata of new topic {t}"), || {
                match self.partition_count_once(t)? {
                    Some(_) => Ok(()),
                    None => Err(Error::BrokerCode {
                        what: format!("metadata of new topic {t}"),
                        code: RDKafkaErrorCode::LeaderNotAvailable,
                    }),
                }
            })?;
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

    /// Delete `topics` (missing ones are fine). For tests and demos.
    ///
    /// # Errors
    /// [`Error::Broker`] when the broker refuses.
    pub fn delete_topics(&self, topics: &[&str]) -> Result<()> {
        retry("delete topics", || {
            let opts = AdminOptions::new().operation_timeout(Some(self.timeout));
            let res = futures::executor::block_on(self.client.delete_topics(topics, &opts))
                .map_err(Error::kafka("delete topics"))?;
            for r in res {
                match r {
                    Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
                    Err((t, code)) => {
                        return Err(Error::BrokerCode {
                            what: format!("cannot delete topic {t}"),
                            code,
                        })
                    }
                }
            }
            Ok(())
        })
    }

    /// Delete consumer group `group` with its committed offsets (a missing group is fine).
    ///
    /// # Errors
    /// [`Error::BrokerCode`] when the broker refuses (`NonEmptyGroup` while members are
    /// active), after the retries of transient errors (`NotCoordinator` on a broker that
    /// was just started).
    pub fn delete_group(&self, group: &str) -> Result<()> {
        retry(&format!("delete group {group}"), || {
            // A short request timeout: on a just-started broker librdkafka may wait for
            // a group coordinator that is being elected for the whole timeout; a new
            // attempt looks the coordinator up again.
            let opts = AdminOptions::new()
                .request_timeout(Some(GROUP_REQUEST_TIMEOUT))
                .operation_timeout(Some(GROUP_REQUEST_TIMEOUT));
            let res = futures::executor::block_on(self.client.delete_groups(&[group], &opts))
                .map_err(Error::kafka("delete group"))?;
            for r in res {
                match r {
                    Ok(_) | Err((_, RDKafkaErrorCode::GroupIdNotFound)) => {}
                    Err((g, code)) => {
                        return Err(Error::BrokerCode {
                            what: format!("cannot delete group {g}"),
                            code,
                        })
                    }
                }
            }
            Ok(())
        })
    }
}
