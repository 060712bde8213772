//! The plain topology: a source, a chain of named stages, and the stores they use.
//!
//! [`TopologyBuilder`] is the Rust API; topology files (`dsl`) compile to builder calls.
//! [`TopologyBuilder::build`] validates and returns a [`Topology`] or every error found,
//! each naming the stage and the field. [`Topology::describe`] prints it.

mod builder;
mod describe;

use crate::kafka::check_topic_name;
pub use builder::{BuildError, TopologyBuilder};
pub use describe::DescribeFormat;

use crate::error::Error;
use crate::processor::route::{Route, RouteSpec};
use crate::processor::stages::{Dedup, DedupSpec, SinkSpec, TopicSink};
use crate::processor::transform::{Filter, FilterSpec, MapFields, MapSpec};
use crate::processor::Processor;
use crate::processor::Record;

pub(crate) use crate::codec::{Format, ProtoFormat};
pub use crate::processor::enrich::{EnrichSpec, MissingPolicy, TableSpec};

/// The source of a topology: one topic and its value format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Source {
    /// Topic name.
    pub(crate) topic: String,
    /// Value format.
    pub(crate) format: Format,
}

/// What a stage does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StageKind {
    /// Drop repeated records by key within a TTL.
    Dedup(DedupSpec),
    /// Write records to one or more topics.
    Sink(SinkSpec),
    /// Keep records a predicate accepts.
    Filter(FilterSpec),
    /// Set, rename and drop fields.
    Map(MapSpec),
    /// Send records to topics by predicate.
    Route(RouteSpec),
    /// Join records with a lookup table.
    Enrich(EnrichSpec),
    /// An effect outside Kafka (HTTP, PostgreSQL, Redis, file) with keyed idempotency.
    External(Box<crate::sink::ExternalSinkSpec>),
}

impl StageKind {
    /// The kind as written in topology files (`dedup`, `sink`, ...).
    pub(crate) fn kind_name(&self) -> &'static str {
        match self {
            StageKind::Dedup(_) => "dedup",
            StageKind::Sink(_) => "sink",
            StageKind::Filter(_) => "filter",
            StageKind::Map(_) => "map",
            StageKind::Route(_) => "route",
            StageKind::Enrich(_) => "enrich",
            StageKind::External(_) => "external sink",
        }
    }

    /// Topics this stage writes (sinks, routes, a dedup's duplicate topic), in order.
    pub(crate) fn output_topics(&self) -> Vec<String> {
        match self {
            StageKind::Sink(k) => k.topics.clone(),
            StageKind::Route(r) => r.topics(),
            StageKind::Dedup(d) => d.duplicates_to.iter().cloned().collect(),
            StageKind::Filter(_)
            | StageKind::Map(_)
            | StageKind::Enrich(_)
            | StageKind::External(_) => Vec::new(),
        }
    }
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
    pub fn name(&self) -> &str {
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

    /// Names of the state stores, one per dedup stage.
    pub fn stores(&self) -> Vec<String> {
        self.stages
            .iter()
            .filter(|s| matches!(s.kind, StageKind::Dedup(_)))
            .map(|s| s.name.clone())
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

    /// The JSON pointers the stages read, for decoding without a tree.
    pub(crate) fn json_pointers(&self) -> Vec<String> {
        let mut out = Vec::new();
        for s in &self.stages {
            match &s.kind {
                StageKind::Dedup(d) => d.key.json_pointers(&mut out),
                StageKind::Enrich(e) => {
                    e.key.json_pointers(&mut out);
                    // The enrich fast path needs to know the target field is absent.
                    if crate::processor::enrich::splice_field(&e.into).is_some()
                        && !out.contains(&e.into)
                    {
                        out.push(e.into.clone());
                    }
                }
                StageKind::External(e) => e.json_pointers(&mut out),
                _ => {}
            }
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

    /// New processor instances for one task (one source partition), in stage order.
    pub(crate) fn instantiate(&self) -> Vec<(String, Box<dyn Processor>)> {
        let last = self.stages.len().saturating_sub(1);
        let json = self.source.format == Format::Json;
        let t = self.name.as_str();
        self.stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.name.as_str();
                let p: Box<dyn Processor> = match &s.kind {
                    StageKind::Dedup(spec) => Box::new(
                        Dedup::new(t, n, n, spec.clone()).holding_twins(
                            self.stages[i + 1..]
                                .iter()
                                .any(|s| matches!(s.kind, StageKind::External(_))),
                        ),
                    ),
                    StageKind::Sink(spec) => {
                        Box::new(TopicSink::new(n, spec, json, i != last).with_codecs(
                            self.source.format.clone(),
                            spec.topics.iter().map(|t| self.topic_format(t)).collect(),
                        ))
                    }
                    StageKind::Enrich(spec) => {
                        Box::new(crate::processor::enrich::Enrich::new(t, n, spec.clone()))
                    }
                    StageKind::External(spec) => {
                        Box::new(crate::sink::stage::ExternalSink::new(t, n, spec, i != last))
                    }
                    StageKind::Filter(spec) => Box::new(Filter::new(t, n, spec.clone(), json)),
                    StageKind::Map(spec) => Box::new(MapFields::new(t, n, spec.clone())),
                    StageKind::Route(spec) => Box::new(
                        Route::new(t, n, spec.clone(), json, i != last).with_codecs(
                            self.source.format.clone(),
                            spec.topics()
                                .into_iter()
                                .map(|x| {
                                    let f = self.topic_format(&x);
                                    (x, f)
                                })
                                .collect(),
                        ),
                    ),
                };
                (s.name.clone(), p)
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
                "a map stage needs a source with a record view (json, string or protobuf), but the source format is bytes".into(),
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
