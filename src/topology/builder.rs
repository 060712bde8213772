//! [`TopologyBuilder`]: a [`Topology`] built stage by stage and validated, every error
//! reported with its stage and field ([`BuildError`]).

use super::*;
use crate::topology::stage::{CheckCx, FieldError};

/// Builds a [`Topology`] stage by stage.
///
/// ```
/// use onceflow::prelude::*;
/// let t = TopologyBuilder::new("dedup-demo")
///     .source("events", Format::Json)
///     .dedup("dedup", DedupSpec::new(KeySource::JsonPointer("/id".into())))
///     .sink("out", "events.unique")
///     .build()
///     .unwrap();
/// let text = t.describe();
/// assert!(text.contains("dedup") && text.contains("events.unique"), "{text}");
/// ```
#[derive(Debug, Default)]
pub struct TopologyBuilder {
    name: String,
    source: Option<Source>,
    stages: Vec<Stage>,
    tables: Vec<TableSpec>,
    topic_formats: std::collections::BTreeMap<String, Format>,
}

impl TopologyBuilder {
    /// Start a topology called `name`.
    pub fn new(name: impl Into<String>) -> Self {
        TopologyBuilder {
            name: name.into(),
            ..Default::default()
        }
    }

    /// Set the source topic and its format.
    pub fn source(mut self, topic: impl Into<String>, format: Format) -> Self {
        self.source = Some(Source {
            topic: topic.into(),
            format,
        });
        self
    }

    /// Add a stage of any kind (what topology files compile to).
    pub(crate) fn stage(mut self, name: impl Into<String>, kind: StageKind) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            kind,
        });
        self
    }

    /// Validate and build.
    ///
    /// # Errors
    /// Every problem found, each an [`Error::Topology`] naming the stage (its kind when
    /// unnamed; `topology`, `source`, `stages`, `table <name>` or `topic <name>` for the
    /// rest) and, in its reason, the field: ``field `ttl`: must be positive``. A dedup stage
    /// that repartitions with a stage other than a filter or map before it is refused at
    /// its field `partitioning` (see [`Partitioning`](crate::Partitioning)).
    pub fn build(self) -> Result<Topology, Vec<Error>> {
        self.build_detailed()
            .map_err(|es| es.into_iter().map(BuildError::into_error).collect())
    }

    /// Validate and build, with errors that keep the stage index and the field apart (for
    /// topology files, which map them to a line and column).
    ///
    /// # Errors
    /// Every problem found: no source, an empty or invalid topology name (`[A-Za-z0-9._-]`), an invalid topic name, an invalid or
    /// duplicate stage name, a TTL that is not positive, a JSON-pointer key or a map stage
    /// on a non-JSON source, a bad field pointer, a sink without topics, a route without
    /// branches, no sink or route at all.
    pub(crate) fn build_detailed(mut self) -> Result<Topology, Vec<BuildError>> {
        let mut errors = Vec::new();
        let top = |field: Option<&'static str>, reason: String| BuildError {
            stage: None,
            node: if field == Some("name") {
                "topology"
            } else {
                "source"
            }
            .into(),
            field: field.map(str::to_string),
            reason,
        };
        if self.name.trim().is_empty() {
            errors.push(top(Some("name"), "must not be empty".into()));
        } else if !self
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        {
            // A `/` or `:` in the name could forge another sink's idempotency scope
            // (`<topology>/<sink>`, Redis prefix `onceflow:<topology>/<sink>:`).
            errors.push(top(
                Some("name"),
                format!(
                    "{:?}: use only ASCII letters, digits, '-', '_' and '.' (it scopes the idempotency keys of its sinks, `<topology>/<sink>`)",
                    self.name
                ),
            ));
        }
        let source = match self.source.clone() {
            Some(s) => {
                if let Err(r) = check_topic_name(&s.topic) {
                    errors.push(top(Some("topic"), r));
                }
                Some(s)
            }
            None => {
                errors.push(top(None, "missing: a topology needs a source topic".into()));
                None
            }
        };
        let mut seen = std::collections::HashSet::new();
        // The key of the nearest dedup stage upstream: an external sink's default key.
        let mut upstream_dedup = None;
        // That dedup stage's index, and the dedup stages whose key a sink takes.
        let (mut upstream_at, mut keep_key) = (None, Vec::new());
        for (i, st) in self.stages.iter_mut().enumerate() {
            let node = if st.name.is_empty() {
                st.kind.kind_name().to_string()
            } else {
                st.name.clone()
            };
            // Problems of the stage as a whole, not of one field.
            let mut whole: Vec<String> = Vec::new();
            let mut err_owned = |field: String, reason: String| {
                errors.push(BuildError {
                    stage: Some(i),
                    node: node.clone(),
                    field: Some(field),
                    reason,
                })
            };
            let mut err = |field: &str, reason: String| err_owned(field.to_string(), reason);
            if st.name.is_empty() {
                err("name", "must not be empty".into());
            } else if !st
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
            {
                err(
                    "name",
                    "use only ASCII letters, digits, '-', '_' and '.' (it names a store and its changelog topic)"
                        .into(),
                );
            }
            if !seen.insert(st.name.clone()) {
                err("name", "duplicate stage name".into());
            }
            // Lookup tables keep their state in sled trees `table-<name>`: a store named so
            // would share a table's tree and miss the store checks.
            if matches!(st.kind, StageKind::Dedup(_)) && st.name.starts_with("table-") {
                err(
                    "name",
                    "must not start with `table-` (the prefix of lookup tables' state); rename the stage".into(),
                );
            }
            let cx = CheckCx {
                source: source.as_ref(),
                upstream_dedup: upstream_dedup.as_ref(),
                tables: &self.tables,
            };
            let mut found = Vec::new();
            st.kind.spec_mut().check(&cx, &mut found);
            for FieldError { field, reason } in found {
                match field {
                    Some(f) => err_owned(f, reason),
                    None => whole.push(reason),
                }
            }
            if let StageKind::Dedup(d) = &st.kind {
                upstream_dedup = Some(d.key.clone());
                upstream_at = Some(i);
            }
            if let StageKind::External(x) = &st.kind {
                if matches!(x.resolved_key, Some(crate::sink::KeyRule::Dedup(_))) {
                    keep_key.extend(upstream_at);
                }
            }
            for reason in whole {
                errors.push(BuildError {
                    stage: Some(i),
                    node: node.clone(),
                    field: None,
                    reason,
                });
            }
        }
        for i in keep_key {
            if let StageKind::Dedup(d) = &mut self.stages[i].kind {
                d.keep_key = true;
            }
        }
        // Tables, the stages' checks against them, and topic codecs.
        self.validate_tables(source.as_ref(), &mut errors);
        if !self.stages.iter().any(|s| s.kind.spec().delivers()) {
            errors.push(BuildError {
                stage: None,
                node: "stages".into(),
                field: None,
                reason: "a topology needs at least one sink, route or external sink".into(),
            });
        }
        let topology = match (errors.is_empty(), source) {
            (true, Some(source)) => Topology {
                name: self.name,
                source,
                stages: self.stages,
                tables: self.tables,
                topic_formats: self.topic_formats,
            },
            _ => return Err(errors),
        };
        // A repartition hop with a stage that has state or effects before it.
        if let Err((i, reason)) = topology.hop_at() {
            return Err(vec![BuildError {
                stage: Some(i),
                node: topology.stages[i].name.clone(),
                field: Some("partitioning".into()),
                reason,
            }]);
        }
        Ok(topology)
    }
}

/// One validation error of [`TopologyBuilder::build_detailed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BuildError {
    /// Index of the stage, `None` for the topology itself (name, source, sinks).
    pub(crate) stage: Option<usize>,
    /// Stage name (its kind when unnamed), or `topology`, `source`, `stages`.
    pub(crate) node: String,
    /// The field at fault, if one is.
    pub(crate) field: Option<String>,
    /// What is wrong.
    pub(crate) reason: String,
}

impl BuildError {
    /// As an [`Error::Topology`]: `node`, and `field `x`: reason`.
    pub(crate) fn into_error(self) -> Error {
        Error::Topology {
            node: self.node,
            reason: match &self.field {
                Some(f) => format!("field `{f}`: {}", self.reason),
                None => self.reason,
            },
        }
    }
}

impl TopologyBuilder {
    /// Declare a lookup table materialized from a compacted topic (see
    /// `state::table`); enrich stages refer to it by name.
    pub fn table(mut self, spec: TableSpec) -> Self {
        self.tables.push(spec);
        self
    }

    /// Set the codec of a sink topic's values (default: the source's format).
    pub fn topic_format(mut self, topic: impl Into<String>, format: Format) -> Self {
        self.topic_formats.insert(topic.into(), format);
        self
    }

    /// Checks of tables, of the stages against them (enrich) and of topic codecs,
    /// appended to `errors`.
    fn validate_tables(&self, source: Option<&Source>, errors: &mut Vec<BuildError>) {
        let err = |node: &str, field: Option<&str>, reason: String| BuildError {
            stage: None,
            node: node.to_string(),
            field: field.map(str::to_string),
            reason,
        };
        let mut names = std::collections::HashSet::new();
        for t in &self.tables {
            let node = format!("table {}", t.name);
            if t.name.is_empty()
                || !t
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
            {
                errors.push(err(
                    &node,
                    Some("name"),
                    "use only ASCII letters, digits, '-', '_' and '.' (it names the table's store), at least one".into(),
                ));
            }
            if !names.insert(t.name.as_str()) {
                errors.push(err(&node, Some("name"), "duplicate table name".into()));
            }
            if let Err(r) = check_topic_name(&t.topic) {
                errors.push(err(&node, Some("topic"), r));
            }
            if !t.format.has_view() {
                errors.push(err(
                    &node,
                    Some("format"),
                    "a table needs rows with a view (json, string or protobuf), not bytes".into(),
                ));
            }
            if source.is_some_and(|s| s.topic == t.topic) {
                errors.push(err(
                    &node,
                    Some("topic"),
                    format!(
                        "{} is the source topic; a table needs its own topic",
                        t.topic
                    ),
                ));
            }
        }
        for (i, st) in self.stages.iter().enumerate() {
            let cx = CheckCx {
                source,
                upstream_dedup: None,
                tables: &self.tables,
            };
            let mut found = Vec::new();
            st.kind.spec().check_tables(&cx, &mut found);
            errors.extend(found.into_iter().map(|e| BuildError {
                stage: Some(i),
                node: st.name.clone(),
                field: e.field,
                reason: e.reason,
            }));
        }
        for (topic, f) in &self.topic_formats {
            let written = self
                .stages
                .iter()
                .any(|s| s.kind.output_topics().contains(topic));
            if !written {
                errors.push(err(
                    &format!("topic {topic}"),
                    None,
                    format!(
                        "a format ({}) is set for a topic no sink or route writes",
                        f.describe()
                    ),
                ));
            }
            if let Some(src) = source {
                if !src.format.has_view() && !matches!(f, Format::Bytes) {
                    errors.push(err(
                        &format!("topic {topic}"),
                        None,
                        format!(
                            "the source format is bytes, which cannot be written as {}",
                            f.describe()
                        ),
                    ));
                }
            }
        }
    }
}
