//! [`TopologyBuilder`]: a [`Topology`] built stage by stage and validated, every error
//! reported with its stage and field ([`BuildError`]).

use super::*;

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
/// assert_eq!(t.stores(), vec!["dedup".to_string()]);
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

    /// Add a dedup stage.
    pub fn dedup(mut self, name: impl Into<String>, spec: DedupSpec) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            kind: StageKind::Dedup(spec),
        });
        self
    }

    /// Add a sink stage writing records as they are to `topic`.
    pub fn sink(self, name: impl Into<String>, topic: impl Into<String>) -> Self {
        self.sink_with(name, SinkSpec::to(topic))
    }

    /// Add a sink stage: one or more topics, key and headers possibly computed.
    pub fn sink_with(self, name: impl Into<String>, spec: SinkSpec) -> Self {
        self.stage(name, StageKind::Sink(spec))
    }

    /// Add a filter stage: records for which `predicate` returns true go on; an `Err`
    /// sends the record to the dead-letter topic with that reason.
    pub fn filter(
        self,
        name: impl Into<String>,
        predicate: impl Fn(&Record) -> Result<bool, String> + Send + Sync + 'static,
    ) -> Self {
        self.stage(
            name,
            StageKind::Filter(FilterSpec {
                predicate: crate::processor::expr::Predicate::native(predicate),
            }),
        )
    }

    /// Add a map stage (set, rename, drop fields of a JSON object value).
    pub fn map(self, name: impl Into<String>, spec: MapSpec) -> Self {
        self.stage(name, StageKind::Map(spec))
    }

    /// Add a route stage (records to topics by predicate, with a default).
    pub fn route(self, name: impl Into<String>, spec: RouteSpec) -> Self {
        self.stage(name, StageKind::Route(spec))
    }

    // ---- External sinks (issue 6: effects outside Kafka with keyed idempotency) ----

    /// Add an external sink stage: an HTTP call, a PostgreSQL statement, a Redis command or
    /// a file line per record, made once per idempotency key (see [`ExternalSinkSpec`](crate::ExternalSinkSpec)). Its key
    /// template and settings are checked by [`TopologyBuilder::build`].
    pub fn external_sink(
        mut self,
        name: impl Into<String>,
        spec: crate::sink::ExternalSinkSpec,
    ) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            kind: StageKind::External(Box::new(spec)),
        });
        self
    }

    // ---- end of external sinks ----

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
    /// Every problem found, each an [`Error::Topology`] naming the stage and field (see
    /// [`Self::build_detailed`]).
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
    pub fn build_detailed(mut self) -> Result<Topology, Vec<BuildError>> {
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
        // External sinks resolve and check their templates (and the key an upstream dedup
        // gives them).
        let fmt = self.source.as_ref().map(|s| s.format.clone());
        for i in 0..self.stages.len() {
            let upstream_dedup = self.stages[..i].iter().rev().find_map(|s| match &s.kind {
                StageKind::Dedup(d) => Some(d.key.clone()),
                _ => None,
            });
            let StageKind::External(spec) = &mut self.stages[i].kind else {
                continue;
            };
            for r in spec.validate(upstream_dedup, fmt.as_ref()) {
                let (field, reason) = split_field(&r);
                errors.push(BuildError {
                    stage: Some(i),
                    node: self.stages[i].name.clone(),
                    field,
                    reason,
                });
            }
        }
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
        let has_view = source.as_ref().map(|s| s.format.has_view());
        let mut seen = std::collections::HashSet::new();
        for (i, st) in self.stages.iter().enumerate() {
            let node = if st.name.is_empty() {
                st.kind.kind_name().to_string()
            } else {
                st.name.clone()
            };
            // Problems of the stage as a whole, not of one field.
            let mut whole: Vec<String> = Vec::new();
            let mut err = |field: &'static str, reason: String| {
                errors.push(BuildError {
                    stage: Some(i),
                    node: node.clone(),
                    field: Some(field.to_string()),
                    reason,
                })
            };
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
            match &st.kind {
                StageKind::Dedup(d) => {
                    if d.ttl_ms <= 0 {
                        err("ttl", "must be positive".into());
                    }
                    if d.key.needs_json()
                        && source
                            .as_ref()
                            .is_some_and(|s| matches!(s.format, Format::Bytes | Format::String))
                    {
                        let format = source.as_ref().map_or("?", |s| s.format.name());
                        err(
                            "key",
                            format!(
                                "{} needs a json source, but the source format is {format}",
                                d.key.describe()
                            ),
                        );
                    }
                    if let crate::processor::key::KeySource::JsonPointer(p) = &d.key {
                        if !p.is_empty() && !p.starts_with('/') {
                            err("key", format!("JSON pointer {p:?} must start with '/'"));
                        }
                    }
                    if let Some(t) = &d.duplicates_to {
                        if let Err(r) = check_topic_name(t) {
                            err("duplicates_to", r);
                        }
                    }
                    if let Some(f) = &d.fingerprint_fields {
                        if let Err(r) = f.validate() {
                            err("fingerprint", r);
                        } else if !d.fingerprint {
                            err(
                                "fingerprint",
                                "fingerprint fields are given but the fingerprint is off".into(),
                            );
                        }
                        if let Some(s) = source.as_ref().filter(|s| !s.format.has_view()) {
                            err(
                                "fingerprint",
                                format!(
                                    "fingerprint fields need a source with fields (json, string, protobuf), but the source format is {}",
                                    s.format.name()
                                ),
                            );
                        }
                    }
                    if d.on_conflict == crate::processor::stages::ConflictPolicy::DuplicatesTo
                        && d.duplicates_to.is_none()
                    {
                        err(
                            "on_conflict",
                            "duplicates_to needs a duplicates_to topic".into(),
                        );
                    }
                }
                StageKind::Sink(k) => {
                    if k.topics.is_empty() {
                        err("topic", "a sink needs at least one topic".into());
                    }
                    for t in &k.topics {
                        if let Err(r) = check_topic_name(t) {
                            err("topic", r);
                        }
                    }
                    for (h, _) in &k.headers {
                        if h.is_empty() {
                            err("headers", "a header name must not be empty".into());
                        }
                    }
                }
                StageKind::Filter(_) | StageKind::Enrich(_) | StageKind::External(_) => {}
                StageKind::Map(m) => {
                    if has_view == Some(false) {
                        let format = source.as_ref().map_or("?", |s| s.format.name());
                        whole.push(format!(
                            "a map stage needs a source with a record view (json, string or protobuf), but the source format is {format}"
                        ));
                    }
                    for (field, p) in m.pointers() {
                        if let Err(r) = crate::processor::transform::check_field_pointer(p) {
                            err(field, r);
                        }
                    }
                }
                StageKind::Route(r) => {
                    if r.branches.is_empty() {
                        err("routes", "a route needs at least one branch".into());
                    }
                    for b in &r.branches {
                        if let Err(why) = check_topic_name(&b.topic) {
                            err("routes", why);
                        }
                    }
                    if let Some(t) = &r.default {
                        if let Err(why) = check_topic_name(t) {
                            err("default", why);
                        }
                    }
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
        // Tables, enrich stages and topic codecs; their errors name a stage (by name), a
        // table or a topic, and the field in the reason.
        let mut table_errors = Vec::new();
        self.validate_tables(source.as_ref(), &mut table_errors);
        for e in table_errors {
            if let Error::Topology { node, reason } = e {
                let (field, reason) = split_field(&reason);
                errors.push(BuildError {
                    stage: self.stages.iter().position(|s| s.name == node),
                    node,
                    field,
                    reason,
                });
            }
        }
        if !self.stages.iter().any(|s| {
            matches!(
                s.kind,
                StageKind::Sink(_) | StageKind::Route(_) | StageKind::External(_)
            )
        }) {
            errors.push(BuildError {
                stage: None,
                node: "stages".into(),
                field: None,
                reason: "a topology needs at least one sink, route or external sink".into(),
            });
        }
        match (errors.is_empty(), source) {
            (true, Some(source)) => Ok(Topology {
                name: self.name,
                source,
                stages: self.stages,
                tables: self.tables,
                topic_formats: self.topic_formats,
            }),
            _ => Err(errors),
        }
    }
}

/// Split `field `x`: reason` into the field and the reason.
fn split_field(reason: &str) -> (Option<String>, String) {
    if let Some(rest) = reason.strip_prefix("field `") {
        if let Some((f, r)) = rest.split_once("`: ") {
            return (Some(f.to_string()), r.to_string());
        }
    }
    (None, reason.to_string())
}

/// One validation error of [`TopologyBuilder::build_detailed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildError {
    /// Index of the stage, `None` for the topology itself (name, source, sinks).
    pub stage: Option<usize>,
    /// Stage name (its kind when unnamed), or `topology`, `source`, `stages`.
    pub node: String,
    /// The field at fault, if one is.
    pub field: Option<String>,
    /// What is wrong.
    pub reason: String,
}

impl BuildError {
    /// As an [`Error::Topology`]: `node`, and `field `x`: reason`.
    pub fn into_error(self) -> Error {
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

    /// Add an enrich stage: a lookup join against a declared table.
    pub fn enrich(mut self, name: impl Into<String>, spec: EnrichSpec) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            kind: StageKind::Enrich(spec),
        });
        self
    }

    /// Set the codec of a sink topic's values (default: the source's format).
    pub fn topic_format(mut self, topic: impl Into<String>, format: Format) -> Self {
        self.topic_formats.insert(topic.into(), format);
        self
    }

    /// Checks of tables, enrich stages and codecs, appended to `errors`.
    fn validate_tables(&self, source: Option<&Source>, errors: &mut Vec<Error>) {
        let err = |node: &str, reason: String| Error::Topology {
            node: node.to_string(),
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
                    "field `name`: use only ASCII letters, digits, '-', '_' and '.' (it names the table's store), at least one".into(),
                ));
            }
            if !names.insert(t.name.as_str()) {
                errors.push(err(&node, "field `name`: duplicate table name".into()));
            }
            if let Err(r) = check_topic_name(&t.topic) {
                errors.push(err(&node, format!("field `topic`: {r}")));
            }
            if !t.format.has_view() {
                errors.push(err(
                    &node,
                    "field `format`: a table needs rows with a view (json, string or protobuf), not bytes".into(),
                ));
            }
            if source.is_some_and(|s| s.topic == t.topic) {
                errors.push(err(
                    &node,
                    format!(
                        "field `topic`: {} is the source topic; a table needs its own topic",
                        t.topic
                    ),
                ));
            }
        }
        for st in &self.stages {
            let StageKind::Enrich(e) = &st.kind else {
                continue;
            };
            if !self.tables.iter().any(|t| t.name == e.table) {
                let have: Vec<&str> = self.tables.iter().map(|t| t.name.as_str()).collect();
                errors.push(err(
                    &st.name,
                    format!(
                        "field `table`: no table named {:?} (declared: {})",
                        e.table,
                        if have.is_empty() {
                            "none".to_string()
                        } else {
                            have.join(", ")
                        }
                    ),
                ));
            }
            if let Some(src) = source {
                if !src.format.has_view() {
                    errors.push(err(
                        &st.name,
                        "enrich needs a source with a record view (json, string or protobuf), but the source format is bytes".into(),
                    ));
                }
            }
            for (field, p) in [
                ("key", key_pointer(&e.key)),
                ("into", Some(e.into.as_str())),
            ] {
                if let Some(p) = p {
                    if !p.is_empty() && !p.starts_with('/') {
                        errors.push(err(
                            &st.name,
                            format!("field `{field}`: JSON pointer {p:?} must start with '/'"),
                        ));
                    }
                }
            }
        }
        for (topic, f) in &self.topic_formats {
            let written = self
                .stages
                .iter()
                .any(|s| matches!(&s.kind, StageKind::Sink(k) if k.topics.contains(topic)));
            if !written {
                errors.push(err(
                    &format!("topic {topic}"),
                    format!(
                        "a format ({}) is set for a topic no sink writes",
                        f.describe()
                    ),
                ));
            }
            if let Some(src) = source {
                if !src.format.has_view() && !matches!(f, Format::Bytes) {
                    errors.push(err(
                        &format!("topic {topic}"),
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

fn key_pointer(k: &crate::processor::key::KeySource) -> Option<&str> {
    match k {
        crate::processor::key::KeySource::JsonPointer(p) => Some(p),
        _ => None,
    }
}
