//! The `route` stage: each record goes to the topic of the first branch whose predicate
//! holds, or to the default topic, or (with no default) nowhere.

use super::expr::{plan, Bindings, Predicate};
use super::transform::{prepare, StatelessMetrics};
use super::{Context, OutRecord, Processor, Record, StageError};
use crate::error::RecordError;
use std::sync::Arc;

/// One branch of a route: records for which `when` holds go to `topic`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteBranch {
    /// The predicate.
    pub(crate) when: Predicate,
    /// The destination topic.
    pub topic: String,
}

/// Settings of a route stage. Branches are tried in order and the first that holds wins;
/// a record no branch takes goes to `default`, or is dropped (counted as `filtered`) when
/// there is none. A predicate failing on a record sends the record to the dead-letter
/// topic (nothing is written for it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RouteSpec {
    /// Branches, in order.
    pub branches: Vec<RouteBranch>,
    /// Topic for records no branch takes.
    pub default: Option<String>,
}

impl RouteSpec {
    /// A route with no branch and no default.
    pub fn new() -> Self {
        RouteSpec::default()
    }

    /// Add a branch: records for which `when` returns true go to `topic`.
    pub fn when(
        mut self,
        when: impl Fn(&Record) -> Result<bool, String> + Send + Sync + 'static,
        topic: impl Into<String>,
    ) -> Self {
        self.branches.push(RouteBranch {
            when: Predicate::native(when),
            topic: topic.into(),
        });
        self
    }

    /// Set the default topic.
    pub fn default_topic(mut self, topic: impl Into<String>) -> Self {
        self.default = Some(topic.into());
        self
    }

    /// Every topic the route may write, in order, without repeats.
    pub(crate) fn topics(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for t in self
            .branches
            .iter()
            .map(|b| &b.topic)
            .chain(self.default.iter())
        {
            if !out.contains(t) {
                out.push(t.clone());
            }
        }
        out
    }
}

/// Writes each record to the topic its branch picks, and forwards it when a later stage
/// exists (like a topic sink).
pub(crate) struct Route {
    name: String,
    spec: RouteSpec,
    proj: Option<Arc<[String]>>,
    /// Decode the whole JSON tree before evaluating (see `expr::plan`).
    json: bool,
    forward: bool,
    metrics: StatelessMetrics,
    /// Source format and each topic's format (see [`super::codec::encode_for_sink`]).
    codecs: Option<(crate::codec::Format, Vec<(String, crate::codec::Format)>)>,
}

impl Route {
    /// A route stage; `json`: the source is JSON; `forward`: not the last stage.
    pub(crate) fn new(
        topology: &str,
        name: &str,
        spec: RouteSpec,
        json: bool,
        forward: bool,
    ) -> Self {
        let (proj, tree) = plan(json, spec.branches.iter().map(|b| &b.when));
        Route {
            name: name.to_string(),
            proj,
            spec,
            json: tree,
            forward,
            metrics: StatelessMetrics::new(topology, name),
            codecs: None,
        }
    }

    /// Write values in each topic's format, the source being in `source` format (see
    /// [`super::codec::encode_for_sink`]); a record whose view does not encode goes to the
    /// dead-letter topic.
    pub(crate) fn with_codecs(
        mut self,
        source: crate::codec::Format,
        topics: Vec<(String, crate::codec::Format)>,
    ) -> Self {
        self.codecs = Some((source, topics));
        self
    }

    fn pick(&self, record: &Record) -> Result<Option<&str>, String> {
        let b = Bindings::projected(record, self.proj.clone());
        for br in &self.spec.branches {
            if br.when.eval(&b)? {
                return Ok(Some(&br.topic));
            }
        }
        Ok(self.spec.default.as_deref())
    }
}

impl Processor for Route {
    fn process(&mut self, mut record: Record, ctx: &mut Context<'_>) -> Result<(), StageError> {
        prepare(&self.name, &mut record, self.json)?;
        let topic = match self.pick(&record) {
            Ok(t) => t.map(str::to_string),
            Err(e) => {
                self.metrics.error.increment(1);
                return Err(RecordError::new(&self.name, e).into());
            }
        };
        let Some(topic) = topic else {
            self.metrics.dropped.increment(1);
            return Ok(());
        };
        let value = match &self.codecs {
            None => record.value.clone(),
            Some((source, formats)) => {
                let sink = formats
                    .iter()
                    .find(|(t, _)| *t == topic)
                    .map_or(source, |(_, f)| f);
                super::codec::encode_for_sink(&record, source, sink)
                    .map_err(|e| RecordError::new(&self.name, e))?
            }
        };
        self.metrics.passed.increment(1);
        let out = OutRecord {
            topic,
            partition: None,
            key: record.key.clone(),
            value,
            headers: record.headers.clone(),
            timestamp: record.timestamp,
        };
        ctx.emit(out).map_err(|e| RecordError::new(&self.name, e))?;
        if self.forward {
            ctx.forward(record);
        }
        Ok(())
    }
}
