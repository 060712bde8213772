//! The plain topology: a source, a chain of named stages, and the stores they use.
//!
//! [`TopologyBuilder`] is the Rust API; topology files (`dsl`) compile to builder calls.
//! [`TopologyBuilder::build`] validates and returns a [`Topology`] or every error found,
//! each naming the stage and the field. [`Topology::describe`] prints it.

pub(crate) mod builder;
pub(crate) mod describe;
pub(crate) mod stage;

use crate::names::check_topic_name;
pub(crate) use builder::TopologyBuilder;
pub(crate) use describe::DescribeFormat;

use crate::error::Error;
use crate::processor::stages::DedupSpec;
use crate::processor::Processor;
use crate::topology::stage::BuildCx;
pub(crate) use crate::topology::stage::StageKind;

pub(crate) use crate::codec::Format;
pub(crate) use crate::processor::enrich::TableSpec;

/// The source of a topology: one topic and its value format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Source {
    /// Topic name.
    pub(crate) topic: String,
    /// Value format.
    pub(crate) format: Format,
}

/// A named stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stage {
    /// Unique name; also the name of the stage's state store, if it has one.
    pub(crate) name: String,
    /// What it does.
    pub(crate) kind: StageKind,
}

/// A validated topology, ready to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    name: String,
    source: Source,
    stages: Vec<Stage>,
    tables: Vec<TableSpec>,
    topic_formats: std::collections::BTreeMap<String, Format>,
}

/// A repartition hop: the dedup stage's index among the stages, its name and its spec.
pub(crate) type Hop<'a> = (usize, &'a str, &'a DedupSpec);

impl Topology {
    /// This topology with its external sinks' local stores bound to an instance's state
    /// dir (see [`crate::sink::ExternalSinkSpec::bind_state_dir`]); `App::run` calls it with
    /// `state.dir` and `application.id`.
    pub(crate) fn with_state_dir(
        mut self,
        state_dir: &std::path::Path,
        application_id: &str,
    ) -> Topology {
        for st in &mut self.stages {
            if let StageKind::External(spec) = &mut st.kind {
                spec.bind_state_dir(state_dir, application_id);
            }
        }
        self
    }

    /// Start-up check of the external sinks (`sink::preflight`): every secret
    /// given as `{ env: VAR }` is set, and an HTTP sink's URL and header values are usable.
    /// `App::run` calls it before processing starts.
    ///
    /// # Errors
    /// [`Error::Config`](crate::error::Error::Config) naming the stage, the field and the
    /// variable (never a value).
    pub fn preflight(&self) -> crate::error::Result<()> {
        crate::sink::preflight(self.stages.iter().filter_map(|st| match &st.kind {
            StageKind::External(spec) => Some((st.name.as_str(), &**spec)),
            _ => None,
        }))
    }

    /// The topology's name (a metric label).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Its source.
    pub(crate) fn source(&self) -> &Source {
        &self.source
    }

    /// Its stages in order.
    pub(crate) fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Names of the state stores the stages declare (one per dedup stage), in stage
    /// order.
    pub(crate) fn stores(&self) -> Vec<String> {
        self.stages
            .iter()
            .flat_map(|s| s.kind.spec().stores(&s.name))
            .collect()
    }

    /// The dedup stages with `partitioning: repartition` in effect (stated or by default),
    /// with their index in the stage list: each reads its input back from
    /// `<application.id>-<stage>-repartition`.
    pub(crate) fn repartitioned(&self) -> Vec<(usize, &str, &DedupSpec)> {
        self.stages
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &s.kind {
                StageKind::Dedup(d)
                    if d.effective_partitioning().0
                        == crate::processor::stages::Partitioning::Repartition =>
                {
                    Some((i, s.name.as_str(), d))
                }
                _ => None,
            })
            .collect()
    }

    /// The repartition hop: the first dedup stage with `partitioning: repartition` in
    /// effect (index `k`, name, spec), or `None` when no stage repartitions. The stages
    /// before it (`stages[..k]`) run on the source partitions, in the router tasks, before
    /// each record is routed; the dedup and every stage after it run on the repartition
    /// topic's partitions. Only stateless stages (filter, map) may come before it.
    ///
    /// # Errors
    /// The reason, naming the repartitioning dedup and the stage before it, when a stage
    /// other than a filter or a map comes before a repartitioning dedup (another dedup,
    /// including a second repartitioning one: one hop per topology; an enrich, route,
    /// sink or external sink): its state or effects would run on the source partitions,
    /// before the copies of a key meet.
    pub(crate) fn hop(&self) -> Result<Option<Hop<'_>>, String> {
        self.hop_at().map_err(|(_, why)| why)
    }

    /// As [`Topology::hop`]; the error also gives the index of the dedup stage refused.
    pub(crate) fn hop_at(&self) -> Result<Option<Hop<'_>>, (usize, String)> {
        let repartitioned = self.repartitioned();
        for (i, name, d) in &repartitioned {
            let Some(before) = self.stages[..*i]
                .iter()
                .find(|s| !matches!(s.kind, StageKind::Filter(_) | StageKind::Map(_)))
            else {
                continue;
            };
            let why = match &before.kind {
                StageKind::Dedup(b) if b.effective_partitioning().0
                    == crate::processor::stages::Partitioning::Repartition =>
                {
                    "onceflow runs one repartition hop per topology"
                }
                StageKind::Dedup(_) => {
                    "its store would hold marks per source partition, and it would drop records before the copies of a key meet"
                }
                StageKind::Enrich(_) => {
                    "its lookups would run on the source partitions, before the hop"
                }
                _ => "its outputs or effects would be made on the source partitions for every copy, before the dedup drops the repeats",
            };
            return Err((*i, format!(
                "dedup stage {name:?} (key {}) needs `partitioning: repartition` (the default for a key other than kafka_key), which routes its input by the dedup key; stage {:?} ({}) comes before it, and only filter and map stages may run before the hop: {why}; move the dedup before it, or, if every copy of a key is published on one partition (e.g. the Kafka key is the dedup key or determines it), state `partitioning: source` on the stage",
                d.key.describe(),
                before.name,
                before.kind.kind_name(),
            )));
        }
        Ok(repartitioned.into_iter().next())
    }

    /// The index of the dedup stage of the repartition hop, if the topology has one that
    /// runs.
    pub(crate) fn hop_stage_index(&self) -> Option<usize> {
        self.hop().ok().flatten().map(|(k, ..)| k)
    }

    /// The index of the first stage a task on the repartition topic runs (the dedup of
    /// [`Topology::hop`]), 0 without a hop (or with one that is refused: the runtime and
    /// the test driver refuse such a topology before a task is made).
    pub(crate) fn hop_stage(&self) -> usize {
        self.hop().ok().flatten().map_or(0, |(k, ..)| k)
    }

    /// The JSON pointers the stages read, for decoding without a tree.
    pub(crate) fn json_pointers(&self) -> Vec<String> {
        let mut out = Vec::new();
        for s in &self.stages {
            s.kind.spec().json_pointers(&mut out);
        }
        out
    }

    /// Topics the stages write (sinks, routes, duplicate topics), in order, without
    /// repeats; the runtime creates the missing ones before the run.
    pub(crate) fn sink_topics(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in &self.stages {
            for t in s.kind.output_topics() {
                if !out.contains(&t) {
                    out.push(t);
                }
            }
        }
        out
    }

    /// New processor instances of `stages` (a range of stage indices) for one task, in
    /// stage order: the stages before a repartition hop for a router task, the rest for a
    /// task on the repartition topic ([`Topology::hop`]), all of them without a hop.
    pub(crate) fn instantiate(
        &self,
        stages: std::ops::Range<usize>,
    ) -> Vec<(String, Box<dyn Processor>)> {
        self.stages[stages.clone()]
            .iter()
            .zip(stages)
            .map(|(s, index)| {
                let cx = BuildCx {
                    topology: self,
                    index,
                    name: &s.name,
                };
                (s.name.clone(), s.kind.spec().processor(&cx))
            })
            .collect()
    }

    /// A text description: source, stages with their settings, topics written, stores and
    /// their changelog topics (for the default `application.id`, `onceflow`).
    pub fn describe(&self) -> String {
        self.describe_as(DescribeFormat::Text, "onceflow")
    }
}

impl Topology {
    /// The lookup tables, in declaration order.
    pub(crate) fn tables(&self) -> &[TableSpec] {
        &self.tables
    }

    /// The codec of `topic`'s values: as set with [`TopologyBuilder::topic_format`], else the
    /// source's format (so a pipeline writes what it reads unless told otherwise).
    pub(crate) fn topic_format(&self, topic: &str) -> Format {
        self.topic_formats
            .get(topic)
            .cloned()
            .unwrap_or_else(|| self.source.format.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::key::KeySource;
    use crate::processor::route::RouteSpec;
    use crate::processor::stages::SinkSpec;
    use crate::processor::transform::MapSpec;

    #[test]
    fn build_reports_every_error() {
        let mut bad = DedupSpec::new(KeySource::JsonPointer("id".into()));
        bad.ttl_ms = 0;
        let errs = TopologyBuilder::new("t")
            .source("in put", Format::Bytes)
            .dedup("d", bad)
            .dedup("d", DedupSpec::new(KeySource::KafkaKey))
            .build()
            .unwrap_err();
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        let want = [
            "topology error in source: field `topic`: topic name \"in put\" holds ' '; use only ASCII letters, digits, '.', '_' and '-'",
            "topology error in d: field `ttl`: must be positive",
            "topology error in d: field `key`: json pointer id needs a json source, but the source format is bytes",
            "topology error in d: field `key`: JSON pointer \"id\" must start with '/'",
            "topology error in d: field `name`: duplicate stage name",
            "topology error in stages: a topology needs at least one sink, route or external sink",
        ];
        assert_eq!(text, want);
    }

    #[test]
    fn build_checks_a_composite_keys_pointers_and_the_grace() {
        let mut bad = DedupSpec::new(KeySource::Composite(vec![
            KeySource::JsonPointer("id".into()),
            KeySource::KafkaKey,
        ]));
        bad.grace_ms = -1;
        let errs = TopologyBuilder::new("t")
            .source("in", Format::Json)
            .dedup("d", bad)
            .sink("out", "out")
            .build()
            .unwrap_err();
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        let want = [
            "topology error in d: field `grace`: must not be negative",
            "topology error in d: field `key`: JSON pointer \"id\" must start with '/'",
        ];
        assert_eq!(text, want);
    }

    #[test]
    fn a_dedup_stage_may_not_take_the_tables_prefix() {
        let errs = TopologyBuilder::new("t")
            .source("in", Format::Json)
            .dedup("table-x", DedupSpec::new(KeySource::KafkaKey))
            .sink("out", "out")
            .build()
            .unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(
            errs[0].to_string().starts_with(
                "topology error in table-x: field `name`: must not start with `table-`"
            ),
            "{}",
            errs[0]
        );
    }

    #[test]
    fn build_checks_the_language_stages() {
        let errs = TopologyBuilder::new("t")
            .source("in", Format::Bytes)
            .map("m", MapSpec::new().rename("a", "/b").drop_field("/"))
            .route("r", RouteSpec::new())
            .route(
                "r2",
                RouteSpec::new().when(|_| Ok(true), "x y").default_topic(""),
            )
            .sink_with(
                "s",
                SinkSpec {
                    topics: vec![],
                    key: None,
                    headers: vec![],
                },
            )
            .dedup(
                "d",
                DedupSpec::new(KeySource::KafkaKey).with_duplicates_to("a/b"),
            )
            .build_detailed()
            .unwrap_err();
        let got: Vec<(Option<usize>, Option<&str>, String)> = errs
            .iter()
            .map(|e| (e.stage, e.field.as_deref(), e.reason.clone()))
            .collect();
        let want = vec![
            (
                Some(0),
                Some("rename"),
                "field path \"a\" must be a JSON pointer such as /name or /a/b".to_string(),
            ),
            (
                Some(0),
                Some("drop"),
                "field path \"/\" must be a JSON pointer such as /name or /a/b".into(),
            ),
            (
                Some(0),
                None,
                "a map stage needs JSON objects (a json or protobuf source), but the source format is bytes".into(),
            ),
            (
                Some(1),
                Some("routes"),
                "a route needs at least one branch".into(),
            ),
            (
                Some(2),
                Some("routes"),
                "topic name \"x y\" holds ' '; use only ASCII letters, digits, '.', '_' and '-'"
                    .into(),
            ),
            (
                Some(2),
                Some("default"),
                "topic name must not be empty".into(),
            ),
            (
                Some(3),
                Some("topic"),
                "a sink needs at least one topic".into(),
            ),
            (
                Some(4),
                Some("duplicates_to"),
                "topic name \"a/b\" holds '/'; use only ASCII letters, digits, '.', '_' and '-'"
                    .into(),
            ),
        ];
        assert_eq!(got, want);
    }
}
