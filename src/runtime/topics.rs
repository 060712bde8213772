//! Topic preparation before a run: the source must exist; sink, dead-letter and changelog
//! topics are created or checked.

use super::App;
use crate::error::{Error, Result};
use crate::kafka::admin::Admin;
use crate::state::restore::changelog_topic;
use crate::topology::StageKind;
use std::collections::BTreeMap;

impl App {
    /// The changelog topic of each store.
    pub fn changelog_topics(&self) -> BTreeMap<String, String> {
        self.topology
            .stages()
            .iter()
            .filter_map(|s| match &s.kind {
                StageKind::Dedup(_) => Some((
                    s.name.clone(),
                    changelog_topic(&self.config.application_id, &s.name),
                )),
                _ => None,
            })
            .collect()
    }

    /// Check the topics before the run: the source must exist; missing sink topics and the
    /// dead-letter topic are created with the source's partition count; changelog topics
    /// are created with [`CHANGELOG_CONFIGS`](crate::kafka::admin::CHANGELOG_CONFIGS)
    /// (`cleanup.policy=compact`: a live entry is always restorable), or checked to have
    /// the source's partition count and a configuration that never deletes a live entry
    /// (corrected when it could).
    ///
    /// # Errors
    /// [`Error::Config`] when a dedup stage has `partitioning: repartition` in effect (not
    /// run by the runtime yet); [`Error::Broker`] when the source topic is missing, a
    /// changelog has another partition count than the source or a configuration that cannot
    /// be corrected, or topics cannot be created.
    pub fn prepare_topics(&self) -> Result<usize> {
        // Never let copies on different partitions pass silently: until the runtime runs
        // the repartition hop, a stage that needs it is refused before anything is created.
        if let Some((_, name, d)) = self.topology.repartitioned().first() {
            return Err(Error::Config(format!(
                "dedup stage {name:?} (key {}) needs `partitioning: repartition` (the default for a key other than kafka_key), which `onceflow run` does not run yet (the test driver does); if every copy of a key is published on one partition (e.g. the Kafka key is the dedup key or determines it), state `partitioning: source` on the stage",
                d.key.describe()
            )));
        }
        let admin = Admin::new(&self.config)?;
        let src = &self.topology.source().topic;
        let n = admin.partition_count(src)?.ok_or_else(|| {
            Error::Broker(format!(
                "source topic {src} does not exist on {}; create it first",
                self.config.bootstrap_servers
            ))
        })?;
        // Metadata per topic (cheap), then one CreateTopics request for the missing ones.
        let mut missing: Vec<crate::kafka::admin::TopicSpec<'_>> = Vec::new();
        let mut topics = self.topology.sink_topics();
        topics.push(self.config.dlq_topic.clone());
        for t in topics {
            if admin.partition_count(&t)?.is_none() && !missing.iter().any(|m| m.0 == t) {
                missing.push((t, n, Vec::new()));
            }
        }
        for (store, topic) in self.changelog_topics() {
            match admin.partition_count(&topic)? {
                Some(m) if m != n => {
                    return Err(Error::Broker(format!(
                        "changelog topic {topic} of store {store} has {m} partitions, but source topic {src} has {n}; \
                         they must match (delete the changelog to rebuild it, or use a new application.id)"
                    )))
                }
                Some(_) => {
                    admin.ensure_changelog_config(&store, &topic)?;
                }
                None => missing.push((
                    topic,
                    n,
                    crate::kafka::admin::CHANGELOG_CONFIGS
                        .iter()
                        .map(|(k, v)| (*k, v.to_string()))
                        .collect(),
                )),
            }
        }
        for t in admin.ensure_topics(&missing)? {
            match missing.iter().find(|m| m.0 == t) {
                Some((_, _, c)) if !c.is_empty() => {
                    tracing::info!(topic = %t, partitions = n, cleanup_policy = %c[0].1, "created changelog topic")
                }
                _ => tracing::info!(topic = %t, partitions = n, "created topic"),
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::processor::key::KeySource;
    use crate::processor::stages::{DedupSpec, Partitioning};
    use crate::runtime::App;
    use crate::topology::{Format, TopologyBuilder};

    /// A stage that needs the repartition hop is refused before any topic is touched (the
    /// broker address is unreachable on purpose: the refusal comes first).
    #[test]
    fn a_stage_needing_repartition_is_refused_at_start() {
        let cfg = Config::load_with_env(
            &[],
            &[("bootstrap.servers".into(), "127.0.0.1:1".into())],
            Vec::new(),
        )
        .unwrap();
        let t = |p: Option<Partitioning>| {
            let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
            spec.partitioning = p;
            TopologyBuilder::new("t")
                .source("in", Format::Json)
                .dedup("by-id", spec)
                .sink("out", "out")
                .build()
                .unwrap()
        };
        for p in [None, Some(Partitioning::Repartition)] {
            let err = App::new(cfg.clone(), t(p))
                .prepare_topics()
                .unwrap_err()
                .to_string();
            assert!(err.contains("\"by-id\""), "{err}");
            assert!(err.contains("partitioning: source"), "{err}");
        }
        // Stated `source`: nothing to refuse.
        assert!(t(Some(Partitioning::Source)).repartitioned().is_empty());
    }
}
