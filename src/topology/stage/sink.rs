//! The `sink` kind: write each record to one or more topics, key and headers possibly
//! computed. Spec [`SinkSpec`] and processor `TopicSink` in
//! `processor/stages/topic_sink.rs`.
//!
//! ```yaml
//! - sink: { topics: [a, b], key: 'value.repo', headers: { kind: 'value.type' }, format: json }
//! ```

use super::{BuildCx, CheckCx, FieldError, FileKind, ReadStage, StageKind, StageKindSpec};
use crate::names::check_topic_name;
use crate::processor::expr::BytesFn;
use crate::processor::stages::{SinkSpec, TopicSink};
use crate::processor::Processor;
use crate::schema::node::{Node, Val};
use crate::schema::{Fields, Reader};
use crate::topology::TopologyBuilder;
use std::fmt::Write as _;

impl StageKindSpec for SinkSpec {
    fn settings(&self) -> String {
        let mut s = format!("topics={}", self.topics.join(","));
        if let Some(f) = &self.key {
            let _ = write!(s, " key=`{}`", f.describe());
        }
        for (h, f) in &self.headers {
            let _ = write!(s, " header[{h}]=`{}`", f.describe());
        }
        s
    }

    fn output_topics(&self) -> Vec<String> {
        self.topics.clone()
    }

    fn delivers(&self) -> bool {
        true
    }

    fn check(&mut self, _cx: &CheckCx<'_>, errors: &mut Vec<FieldError>) {
        if self.topics.is_empty() {
            errors.push(FieldError::at("topic", "a sink needs at least one topic"));
        }
        for t in &self.topics {
            if let Err(r) = check_topic_name(t) {
                errors.push(FieldError::at("topic", r));
            }
        }
        for (h, _) in &self.headers {
            if h.is_empty() {
                errors.push(FieldError::at("headers", "a header name must not be empty"));
            }
        }
    }

    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor> {
        let t = cx.topology;
        Box::new(
            TopicSink::new(cx.name, self, cx.json(), cx.forwards()).with_codecs(
                t.source().format.clone(),
                self.topics.iter().map(|x| t.topic_format(x)).collect(),
            ),
        )
    }
}

/// `- sink: {...}` in topology files.
pub(super) const FILE_KINDS: &[FileKind] = &[FileKind {
    key: "sink",
    fields: &["name", "topic", "topics", "key", "headers", "format"],
    default_name,
    read,
}];

/// `sink-<topic>`, the characters a stage name may not hold made `_` (a bad topic is
/// reported once, under `topic`); `sink-<n>` without a topic.
fn default_name(body: &Node, index: usize) -> String {
    match body.str_field("topic") {
        Some(s) => format!(
            "sink-{}",
            s.replace(
                |c: char| !(c.is_ascii_alphanumeric() || "-_.".contains(c)),
                "_"
            )
        ),
        None => super::numbered("sink", index),
    }
}

fn read(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let mut format = None;
    if let Some(n) = f.get("format") {
        format = Some(c.codec(n, place, "format")?);
    }
    let mut ok = true;
    let mut topics = Vec::new();
    match (f.get("topic"), f.get("topics")) {
        (Some(_), Some(n)) => {
            ok = false;
            c.err(
                n.pos,
                place,
                Some("topics"),
                "give either topic or topics, not both",
            );
        }
        (None, None) => {
            ok = false;
            c.err(f.pos, place, Some("topic"), "missing field (or topics)");
        }
        (Some(n), None) => match c.string(n, place, "topic") {
            Some(t) => topics.push(t),
            None => ok = false,
        },
        (None, Some(n)) => match &n.val {
            Val::Seq(items) => {
                for it in items {
                    match c.string(it, place, "topics") {
                        Some(t) => topics.push(t),
                        None => ok = false,
                    }
                }
            }
            other => {
                ok = false;
                c.wrong_type(n.pos, place, Some("topics"), "a list of topics", other);
            }
        },
    }
    let mut spec = SinkSpec {
        topics,
        key: None,
        headers: Vec::new(),
    };
    if let Some(n) = f.get("key") {
        let k: Option<BytesFn> = c.func(n, place, "key");
        match k {
            Some(k) => spec.key = Some(k),
            None => ok = false,
        }
    }
    ok &= c.entries(
        f,
        "headers",
        place,
        "a map of header name to expression",
        |c, h, _, v| {
            let func: BytesFn = c.func(v, place, "headers")?;
            spec.headers.push((h.to_string(), func));
            Some(())
        },
    );
    ok.then_some((StageKind::Sink(spec), format))
}

impl TopologyBuilder {
    /// Add a sink stage writing records as they are to `topic`.
    pub fn sink(self, name: impl Into<String>, topic: impl Into<String>) -> Self {
        self.sink_with(name, SinkSpec::to(topic))
    }

    /// Add a sink stage: one or more topics, key and headers possibly computed. Records
    /// go on to a later stage too.
    ///
    /// ```
    /// use onceflow::prelude::*;
    /// let t = TopologyBuilder::new("fan-out")
    ///     .source("events", Format::Json)
    ///     .sink_with("out", SinkSpec::to("a").also("b"))
    ///     .build()
    ///     .unwrap();
    /// assert!(t.describe().contains("Sink: out topics=a,b"));
    /// ```
    pub fn sink_with(self, name: impl Into<String>, spec: SinkSpec) -> Self {
        self.stage(name, StageKind::Sink(spec))
    }
}
