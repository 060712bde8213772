//! Topic preparation before a run: the source must exist; sink, dead-letter and changelog
//! topics are created or checked.

use super::App;
use crate::error::{Error, Result};
use crate::kafka::admin::Admin;
use crate::state::restore::changelog_topic;
use crate::topology::StageKind;
use std::collections::BTreeMap;

/// Topic configuration of a repartition topic: deleted by DeleteRecords once consumed
/// (`runtime::hop`), never by time or size, so no record is dropped before it is processed.
/// Segments of 50 MiB or 10 minutes (Kafka Streams' values): the broker frees disk only by
/// whole segments below the log start, and the default 1 GiB segment would keep a
/// consumed gigabyte on disk.
pub(super) const REPARTITION_CONFIGS: &[(&str, &str)] = &[
    ("cleanup.policy", "delete"),
    ("retention.ms", "-1"),
    ("retention.bytes", "-1"),
    ("segment.bytes", "52428800"),
    ("segment.ms", "600000"),
];

impl App {
    /// The repartition topic of the topology's hop: the first dedup stage with
    /// `partitioning: repartition` in effect, when only filter and map stages come before
    /// it (see [`prepare_topics`](Self::prepare_topics) for the topologies refused).
    pub(crate) fn repartition_topic(&self) -> Option<String> {
        let (_, name, _) = self.topology.hop().ok().flatten()?;
        Some(crate::processor::stages::repartition_topic(
            &self.config.application_id,
            name,
        ))
    }

    /// The run's repartition hop (`partitions`: the source's count, which the repartition
    /// topic has), when a dedup stage repartitions (after no stage, or after filter and
    /// map stages only, which the router tasks run).
    ///
    /// # Errors
    /// The purge's admin client cannot be created.
    pub(super) fn hop(&self, partitions: usize) -> Result<Option<super::routing::Hop>> {
        let Some(topic) = self.repartition_topic() else {
            return Ok(None);
        };
        let Some((_, _, spec)) = self.topology.hop().ok().flatten() else {
            return Ok(None);
        };
        let router = crate::processor::repartition::Router::new(
            spec.key.clone(),
            self.topology.source().format.clone(),
            &topic,
            i32::try_from(partitions).unwrap_or(i32::MAX),
        );
        tracing::info!(topic = %topic, partitions, "repartitioning by the dedup key through the repartition topic");
        Ok(Some(super::routing::Hop {
            router,
            name: topic.as_str().into(),
            purger: crate::runtime::hop::Purger::spawn(&self.config, &topic)?,
            last_purge: std::time::Instant::now(),
            pending: Vec::new(),
        }))
    }

    /// The sink topics whose own `max.message.bytes` admits less than the producer's
    /// `message.max.bytes`, each with the largest record it takes: its limit less 128 bytes
    /// for the record batch's framing (61 bytes of batch header, a record's varints and
    /// header lengths). A topic the broker will not describe keeps the producer's limit.
    ///
    /// Read with `prepare_topics`' admin client, after it created the missing topics.
    fn topic_record_limits(&self, admin: &Admin) -> std::collections::HashMap<String, usize> {
        const FRAMING: usize = 128;
        let producer_limit = self.config.max_record_bytes();
        let mut limits = std::collections::HashMap::new();
        for t in self.topology.sink_topics() {
            let Ok(configs) = admin.topic_configs(&t) else {
                continue;
            };
            let Some(topic_max) = configs
                .get("max.message.bytes")
                .and_then(|(v, _)| v.trim().parse::<usize>().ok())
            else {
                continue;
            };
            let limit = topic_max.saturating_sub(FRAMING);
            if limit < producer_limit {
                limits.insert(t, limit);
            }
        }
        limits
    }

    /// Never let seen ids pass again after a dedup stage's `partitioning` changed: its marks
    /// sit where the old partitioning put each key (a source partition, or the partition
    /// the key routes to), and the new one looks for them elsewhere. A stage whose changelog
    /// holds records tells its past partitioning by its repartition topic: there is one
    /// exactly when the stage repartitioned (`onceflow reset` deletes both).
    ///
    /// # Errors
    /// [`Error::Config`] naming the stage, both partitionings and the two ways on;
    /// [`Error::Kafka`] when metadata or watermarks cannot be read.
    /// `changelogs` holds the changelogs found with `partitions` partitions.
    fn check_partitioning_unchanged(
        &self,
        admin: &Admin,
        partitions: usize,
        changelogs: &std::collections::HashSet<String>,
    ) -> Result<()> {
        let hop = self.topology.hop().ok().flatten().map(|(_, name, _)| name);
        for s in self.topology.stages() {
            let StageKind::Dedup(_) = &s.kind else {
                continue;
            };
            let changelog = changelog_topic(&self.config.application_id, &s.name);
            let repartition =
                crate::processor::stages::repartition_topic(&self.config.application_id, &s.name);
            let now_repartitions = hop == Some(s.name.as_str());
            // The changelog was read first: an instance starting next to this one creates
            // both topics in one request, so once the changelog shows, so does the other.
            if !changelogs.contains(&changelog) {
                continue;
            }
            let repartitioned = admin.partition_count(&repartition)?.is_some();
            if now_repartitions == repartitioned || !admin.has_records(&changelog, partitions)? {
                continue;
            }
            let (was, is) = if now_repartitions {
                ("source", "repartition")
            } else {
                ("repartition", "source")
            };
            return Err(Error::Config(format!(
                "dedup stage {:?} now has `partitioning: {is}`, but its changelog {changelog} holds marks written under `partitioning: {was}` (the repartition topic {repartition} {}): they sit on the partitions the old partitioning chose, the new one looks for each key elsewhere, and ids seen before would pass again; go back to `partitioning: {was}`, or reset the application (`onceflow reset FILE`: every mark is dropped, so ids seen before pass once more)",
                s.name,
                if now_repartitions { "does not exist" } else { "exists" },
            )));
        }
        Ok(())
    }

    /// Never let copies on different partitions pass silently: a repartitioning dedup
    /// whose hop cannot run is refused before anything is created.
    ///
    /// # Errors
    /// [`Error::Config`] when a dedup stage that needs `partitioning: repartition` has a
    /// stage other than a filter or a map before it, naming both (see `Topology::hop`).
    pub(crate) fn check_hop(&self) -> Result<()> {
        self.topology.hop().map(|_| ()).map_err(Error::Config)
    }

    /// Check that each topic has one role: the dead-letter topic is none of the topics the
    /// run reads (source, tables, changelogs, repartition topic), and no sink writes a
    /// changelog or the repartition topic. A dead-letter topic that is the source re-reads
    /// every dead letter and dead-letters it again, without end. A stage writing the source
    /// topic is only warned about (a dedup in front drops what comes back).
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting or the stage and the topic's other role.
    pub(crate) fn check_topic_roles(&self) -> Result<()> {
        let mut read: Vec<(String, String)> = vec![(
            self.topology.source().topic.clone(),
            "the source topic".to_string(),
        )];
        for t in self.topology.tables() {
            read.push((t.topic.clone(), format!("the topic of table {}", t.name)));
        }
        let mut internal: Vec<(String, String)> = self
            .changelog_topics()
            .into_iter()
            .map(|(store, topic)| (topic, format!("the changelog of store {store}")))
            .collect();
        if let Some(t) = self.repartition_topic() {
            internal.push((t, "the repartition topic".to_string()));
        }
        let dlq = &self.config.dlq_topic;
        if let Some((_, role)) = read.iter().chain(&internal).find(|(t, _)| t == dlq) {
            return Err(Error::Config(format!(
                "dlq.topic {dlq} is {role}; dead letters need a topic of their own (it would read them back)"
            )));
        }
        let source = &self.topology.source().topic;
        for st in self.topology.stages() {
            for t in st.kind.output_topics() {
                if t == *source {
                    tracing::warn!(stage = %st.name, topic = %t,
                        "this stage writes the source topic: every record it writes is read and processed again");
                }
                if let Some((_, role)) = internal.iter().find(|(i, _)| *i == t) {
                    return Err(Error::Config(format!(
                        "stage `{}` writes topic {t}, which is {role}; onceflow writes that topic itself",
                        st.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// The changelog topic of each store.
    pub(crate) fn changelog_topics(&self) -> BTreeMap<String, String> {
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
    /// (corrected when it could). With a repartition hop (a dedup with `partitioning:
    /// repartition`, after filter and map stages only), the repartition topic
    /// `<application.id>-<stage>-repartition` is created with the source's partition count
    /// and `REPARTITION_CONFIGS` (no time or size retention: consumed records are purged
    /// instead, see `runtime::hop`), or checked to have that count. Returns the source's
    /// partition count.
    ///
    /// # Errors
    /// [`Error::Config`] when a dedup stage that needs `partitioning: repartition` has a
    /// stage other than a filter or a map before it (its state or effects would run on
    /// the source partitions, before the hop), naming both, and when a changelog or the
    /// repartition topic has another partition count than the source (a setup a restart
    /// cannot fix: exit 2); [`Error::MissingTopic`] when the source topic or a table topic is missing;
    /// [`Error::Broker`] when a changelog has a configuration that cannot be corrected, or
    /// topics cannot be created.
    pub(crate) fn prepare_topics(&self) -> Result<PreparedTopics> {
        self.prepare_topics_with(true)
    }

    /// As [`App::prepare_topics`] for a tool that writes state only (`state seed`): a
    /// missing table topic is not its concern (a run still stops on it).
    ///
    /// # Errors
    /// As [`App::prepare_topics`], less the missing table topic.
    pub(crate) fn prepare_topics_for_state(&self) -> Result<PreparedTopics> {
        self.prepare_topics_with(false)
    }

    fn prepare_topics_with(&self, check_tables: bool) -> Result<PreparedTopics> {
        self.check_hop()?;
        self.check_topic_roles()?;
        let admin = Admin::new(&self.config)?;
        let src = &self.topology.source().topic;
        let n = admin.partition_count(src)?.ok_or_else(|| {
            Error::MissingTopic(format!(
                "source topic {src} does not exist on {}; create it first",
                self.config.bootstrap_servers
            ))
        })?;
        // Tables are read, never created: a missing one stops start-up before anything is
        // (unless one of the app's own sinks writes it: it is created below).
        let sink_topics = self.topology.sink_topics();
        for spec in self.topology.tables().iter().filter(|_| check_tables) {
            if !sink_topics.contains(&spec.topic) && admin.partition_count(&spec.topic)?.is_none() {
                return Err(crate::runtime::table::missing_table_topic(
                    spec,
                    &self.config,
                ));
            }
        }
        // Metadata per topic (cheap), then one CreateTopics request for the missing ones.
        let mut missing: Vec<crate::kafka::admin::TopicSpec<'_>> = Vec::new();
        let mut topics = sink_topics;
        topics.push(self.config.dlq_topic.clone());
        for t in topics {
            if admin.partition_count(&t)?.is_none() && !missing.iter().any(|m| m.0 == t) {
                missing.push((t, n, Vec::new()));
            }
        }
        let mut changelogs = std::collections::HashSet::new();
        for (store, topic) in self.changelog_topics() {
            match admin.partition_count(&topic)? {
                Some(m) if m != n => {
                    return Err(Error::Config(changelog_count_advice(
                        &store, &topic, m, src, n,
                    )))
                }
                Some(_) => {
                    admin.ensure_changelog_config(&store, &topic)?;
                    changelogs.insert(topic);
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
        self.check_partitioning_unchanged(&admin, n, &changelogs)?;
        if let Some(topic) = self.repartition_topic() {
            match admin.partition_count(&topic)? {
                Some(m) if m != n => {
                    return Err(Error::Config(format!(
                        "repartition topic {topic} has {m} partitions, but source topic {src} has {n}; \
                         they must match (delete the repartition topic once it is consumed, or use a new application.id)"
                    )))
                }
                Some(_) => {}
                None => missing.push((
                    topic,
                    n,
                    REPARTITION_CONFIGS
                        .iter()
                        .map(|(k, v)| (*k, v.to_string()))
                        .collect(),
                )),
            }
        }
        if i32::try_from(n).map_or(true, |n| n >= crate::runtime::hop::ROUTER_BASE) {
            return Err(Error::Broker(format!(
                "source topic {src} has {n} partitions; onceflow supports fewer than {}",
                crate::runtime::hop::ROUTER_BASE
            )));
        }
        for t in admin.ensure_topics(&missing)? {
            match missing.iter().find(|m| m.0 == t) {
                _ if Some(&t) == self.repartition_topic().as_ref() => {
                    tracing::info!(topic = %t, partitions = n, "created repartition topic")
                }
                Some((_, _, c)) if !c.is_empty() => {
                    tracing::info!(topic = %t, partitions = n, cleanup_policy = %c[0].1, "created changelog topic")
                }
                _ => tracing::info!(topic = %t, partitions = n, "created topic"),
            }
        }
        Ok(PreparedTopics {
            partitions: n,
            record_limits: self.topic_record_limits(&admin),
        })
    }
}

/// What [`App::prepare_topics`] found.
#[derive(Debug)]
pub(crate) struct PreparedTopics {
    /// The source topic's partition count (every internal topic has as many).
    pub(crate) partitions: usize,
    /// The sink topics whose own `max.message.bytes` admits less than the producer's, with
    /// the largest record each takes (see `App::topic_record_limits`).
    pub(crate) record_limits: std::collections::HashMap<String, usize>,
}

/// The error for changelog `topic` of `store` with `m` partitions against source `src`
/// with `n`: what to do (grow the changelog: its partitions keep their marks; deleting it
/// would lose them, and a local store ahead of its changelog is cleared).
pub(crate) fn changelog_count_advice(
    store: &str,
    topic: &str,
    m: usize,
    src: &str,
    n: usize,
) -> String {
    let what = format!(
        "changelog topic {topic} of store {store} has {m} partitions, but source topic {src} has {n}; they must match"
    );
    if m < n {
        format!(
            "{what}: grow the changelog too (kafka-topics.sh --alter --topic {topic} --partitions {n}), \
             which keeps its marks (do not delete it: the marks would be lost and their duplicates pass). \
             A copy of an id may now arrive on another partition than its first occurrence: \
             use `partitioning: repartition` unless the producer keeps each id on one partition"
        )
    } else {
        format!("{what}: a topic's partitions cannot be reduced; use a new application.id")
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::processor::key::KeySource;
    use crate::processor::stages::{DedupSpec, Partitioning};
    use crate::processor::transform::MapSpec;
    use crate::runtime::App;
    use crate::topology::{Format, TopologyBuilder};

    /// A dead-letter topic that the run reads or writes itself, or a sink writing an
    /// internal topic, is a config error before any topic is touched (the broker address is
    /// unreachable on purpose). dlq.topic = the source topic dead-lettered its own dead
    /// letters without end; found by a review helper.
    #[test]
    fn each_topic_has_one_role() {
        let cfg = |dlq: &str| {
            let mut sets = vec![
                ("bootstrap.servers".to_string(), "127.0.0.1:1".to_string()),
                ("application.id".to_string(), "app".to_string()),
            ];
            if !dlq.is_empty() {
                sets.push(("dlq.topic".into(), dlq.into()));
            }
            Config::load_with_env(&[], &sets, Vec::new()).unwrap()
        };
        let topology = |sink: &str| {
            TopologyBuilder::new("t")
                .source("in", Format::Json)
                .table(crate::processor::enrich::TableSpec::new(
                    "cust",
                    "customers",
                ))
                .dedup(
                    "by-id",
                    DedupSpec::new(KeySource::JsonPointer("/id".into())),
                )
                .sink("out", sink)
                .build()
                .unwrap()
        };
        let refused =
            |dlq: &str, sink: &str| match App::new(cfg(dlq), topology(sink)).prepare_topics() {
                Err(crate::Error::Config(m)) => m,
                other => panic!("dlq {dlq}, sink {sink}: {other:?}"),
            };
        assert_eq!(
            refused("in", "out"),
            "dlq.topic in is the source topic; dead letters need a topic of their own (it would read them back)"
        );
        assert!(refused("customers", "out").contains("is the topic of table cust"));
        assert!(refused("app-by-id-changelog", "out").contains("is the changelog of store by-id"));
        assert!(refused("app-by-id-repartition", "out").contains("is the repartition topic"));
        assert_eq!(
            refused("", "app-by-id-changelog"),
            "stage `out` writes topic app-by-id-changelog, which is the changelog of store by-id; onceflow writes that topic itself"
        );
        // The default dead-letter topic and a plain sink pass these checks.
        assert!(App::new(cfg(""), topology("out"))
            .check_topic_roles()
            .is_ok());
    }

    /// A dedup that repartitions gets its repartition topic when it is the first stage or
    /// follows stateless stages only (filter, map: the routers run them); a stage with
    /// state or effects before it is refused by `prepare_topics` before any topic is
    /// touched (the broker address is unreachable on purpose: the refusal comes first).
    #[test]
    fn a_repartitioning_dedup_may_follow_stateless_stages_only() {
        let cfg = Config::load_with_env(
            &[],
            &[
                ("bootstrap.servers".into(), "127.0.0.1:1".into()),
                ("application.id".into(), "app".into()),
            ],
            Vec::new(),
        )
        .unwrap();
        let by_id = |p: Option<Partitioning>| {
            let mut spec = DedupSpec::new(KeySource::JsonPointer("/id".into()));
            spec.partitioning = p;
            spec
        };
        let first = |p: Option<Partitioning>| {
            TopologyBuilder::new("t")
                .source("in", Format::Json)
                .dedup("by-id", by_id(p))
                .sink("out", "out")
                .build()
                .unwrap()
        };
        for p in [None, Some(Partitioning::Repartition)] {
            assert_eq!(
                App::new(cfg.clone(), first(p))
                    .repartition_topic()
                    .as_deref(),
                Some("app-by-id-repartition")
            );
        }
        assert_eq!(
            App::new(cfg.clone(), first(Some(Partitioning::Source))).repartition_topic(),
            None
        );
        let prefixed = TopologyBuilder::new("t")
            .source("in", Format::Json)
            .filter("keep", |_| Ok(true))
            .map("rename", MapSpec::new().rename("/key", "/id"))
            .dedup("by-id", by_id(None))
            .sink("out", "out")
            .build()
            .unwrap();
        assert_eq!(prefixed.hop().unwrap().map(|h| h.0), Some(2));
        let app = App::new(cfg.clone(), prefixed);
        assert_eq!(
            app.repartition_topic().as_deref(),
            Some("app-by-id-repartition")
        );
        app.check_hop().unwrap();
        for (before, kind) in [("by-key", "dedup"), ("copy", "sink"), ("first", "dedup")] {
            let b = TopologyBuilder::new("t")
                .source("in", Format::Json)
                .filter("keep", |_| Ok(true));
            let b = match before {
                "by-key" => b.dedup("by-key", DedupSpec::new(KeySource::KafkaKey)),
                "copy" => b.sink("copy", "copy"),
                _ => b.dedup("first", by_id(None)),
            };
            // Refused when built, a second repartitioning dedup included (one hop per
            // topology).
            let errs = b
                .dedup("by-id", by_id(None))
                .sink("out", "out")
                .build()
                .unwrap_err();
            assert_eq!(errs.len(), 1);
            let err = errs[0].to_string();
            assert!(err.contains("field `partitioning`"), "{err}");
            assert!(err.contains("\"by-id\""), "{err}");
            assert!(err.contains(&format!("{before:?} ({kind})")), "{err}");
            assert!(err.contains("only filter and map stages"), "{err}");
            assert!(err.contains("partitioning: source"), "{err}");
        }
    }
}
