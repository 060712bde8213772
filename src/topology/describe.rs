//! `describe()`: a topology as text, as a Mermaid flowchart, or as a Graphviz dot graph,
//! showing the source, each stage with its settings, the topics written, and the stores
//! with their changelog topics.

use super::{StageKind, Topology};
use crate::processor::stages::{repartition_topic, Partitioning};
use crate::state::restore::changelog_topic;
use std::fmt::Write as _;

/// Output format of [`Topology::describe_as`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DescribeFormat {
    /// Indented text, one line per node.
    #[default]
    Text,
    /// A Mermaid `flowchart LR`.
    Mermaid,
    /// A Graphviz `digraph`.
    Dot,
}

impl std::str::FromStr for DescribeFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(DescribeFormat::Text),
            "mermaid" => Ok(DescribeFormat::Mermaid),
            "dot" => Ok(DescribeFormat::Dot),
            other => Err(format!(
                "unknown format {other:?}; use text, mermaid or dot"
            )),
        }
    }
}

/// One line of settings for a stage.
fn settings(kind: &StageKind) -> String {
    match kind {
        StageKind::Dedup(d) => {
            let mut s = format!(
                "key={} ttl={} time={:?}",
                d.key.describe(),
                humantime::format_duration(
                    std::time::Duration::from_millis(d.ttl_ms.max(0) as u64)
                ),
                d.time
            );
            if d.fingerprint {
                match &d.fingerprint_fields {
                    Some(f) => {
                        let _ = write!(s, " fingerprint({})", f.describe());
                    }
                    None => s.push_str(" fingerprint"),
                }
                let _ = write!(s, " on_conflict={}", d.on_conflict.name());
            }
            if let Some(m) = d.max_keys {
                let _ = write!(s, " max_keys={m}");
            }
            if let Some(t) = &d.duplicates_to {
                let _ = write!(s, " duplicates_to={t}");
            }
            let (p, why) = d.effective_partitioning();
            let _ = write!(s, " partitioning={} ({why})", p.name());
            s
        }
        StageKind::Sink(k) => {
            let mut s = format!("topics={}", k.topics.join(","));
            if let Some(f) = &k.key {
                let _ = write!(s, " key=`{}`", f.describe());
            }
            for (h, f) in &k.headers {
                let _ = write!(s, " header[{h}]=`{}`", f.describe());
            }
            s
        }
        StageKind::Filter(f) => format!("when `{}`", f.predicate.describe()),
        StageKind::Map(m) => {
            let mut parts = Vec::new();
            for (from, to) in &m.rename {
                parts.push(format!("rename {from}->{to}"));
            }
            for (p, f) in &m.set {
                parts.push(format!("set {p}=`{}`", f.describe()));
            }
            for p in &m.drop {
                parts.push(format!("drop {p}"));
            }
            parts.join(" ")
        }
        StageKind::Route(r) => {
            let mut parts: Vec<String> = r
                .branches
                .iter()
                .map(|b| format!("`{}`->{}", b.when.describe(), b.topic))
                .collect();
            parts.push(format!(
                "default->{}",
                r.default.as_deref().unwrap_or("(dropped)")
            ));
            parts.join(" ")
        }
        // Its own description, less the `ExternalSink: <name>` head.
        StageKind::External(e) => {
            let full = e.describe("\u{1}");
            full.split_once("\u{1} ")
                .map_or(full.clone(), |(_, rest)| rest.to_string())
        }
        StageKind::Enrich(e) => format!(
            "table={} key={} into={:?} on_missing={}",
            e.table,
            e.key.describe(),
            e.into,
            e.on_missing.name()
        ),
    }
}

fn kind_title(kind: &StageKind) -> &'static str {
    match kind {
        StageKind::Dedup(_) => "Dedup",
        StageKind::Sink(_) => "Sink",
        StageKind::Filter(_) => "Filter",
        StageKind::Map(_) => "Map",
        StageKind::Route(_) => "Route",
        StageKind::Enrich(_) => "Enrich",
        StageKind::External(_) => "ExternalSink",
    }
}

fn stores_of(kind: &StageKind, name: &str) -> Vec<String> {
    match kind {
        StageKind::Dedup(_) => vec![name.to_string()],
        _ => Vec::new(),
    }
}

/// Escape text for a Mermaid label in double quotes.
fn mermaid_text(s: &str) -> String {
    s.replace('"', "#quot;")
}

/// Escape text for a dot label in double quotes.
fn dot_text(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

impl Topology {
    /// Describe in `format`; changelog topic names use `application_id`.
    pub fn describe_as(&self, format: DescribeFormat, application_id: &str) -> String {
        match format {
            DescribeFormat::Text => self.describe_text(application_id),
            DescribeFormat::Mermaid => self.describe_graph(application_id, false),
            DescribeFormat::Dot => self.describe_graph(application_id, true),
        }
    }

    fn describe_text(&self, app: &str) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "Topology: {}", self.name);
        let _ = writeln!(
            s,
            "  Source: topic {} (format {})",
            self.source.topic,
            self.source.format.describe()
        );
        for t in &self.tables {
            let _ = writeln!(
                s,
                "  Table: {} topic={} (format {}) store=table-{}",
                t.name,
                t.topic,
                t.format.describe(),
                t.name
            );
        }
        for st in &self.stages {
            if let StageKind::Dedup(d) = &st.kind {
                if d.effective_partitioning().0 == Partitioning::Repartition {
                    let _ = writeln!(
                        s,
                        "  Repartition: topic {} keyed by {}",
                        repartition_topic(app, &st.name),
                        d.key.describe()
                    );
                }
            }
            let _ = writeln!(
                s,
                "  {}: {} {}",
                kind_title(&st.kind),
                st.name,
                settings(&st.kind)
            );
        }
        let topics: Vec<String> = self
            .sink_topics()
            .iter()
            .map(|t| format!("{t} ({})", self.topic_format(t).describe()))
            .collect();
        if !topics.is_empty() {
            let _ = writeln!(s, "  Topics written: {}", topics.join(", "));
        }
        for st in &self.stages {
            for store in stores_of(&st.kind, &st.name) {
                let _ = writeln!(
                    s,
                    "  Store: {store} (stage {}) changelog {}",
                    st.name,
                    changelog_topic(app, &store)
                );
            }
        }
        s
    }

    /// Mermaid or dot: topics are ellipses/stadiums, stages boxes, stores cylinders.
    fn describe_graph(&self, app: &str, dot: bool) -> String {
        let mut s = String::new();
        let esc = |t: &str| if dot { dot_text(t) } else { mermaid_text(t) };
        let mut nodes: Vec<String> = Vec::new();
        let mut edges: Vec<(String, String, Option<String>)> = Vec::new();
        let mut topic_ids: Vec<String> = Vec::new();
        let mut topic_node = |t: &str, nodes: &mut Vec<String>| -> String {
            let id = match topic_ids.iter().position(|x| x == t) {
                Some(i) => format!("t{i}"),
                None => {
                    topic_ids.push(t.to_string());
                    let id = format!("t{}", topic_ids.len() - 1);
                    nodes.push(if dot {
                        format!("  {id} [shape=ellipse, label=\"topic {}\"];", esc(t))
                    } else {
                        format!("  {id}([\"topic {}\"])", esc(t))
                    });
                    id
                }
            };
            id
        };
        let src = topic_node(&self.source.topic, &mut nodes);
        let mut table_ids = Vec::new();
        for (k, t) in self.tables.iter().enumerate() {
            let tid = format!("tb{k}");
            let topic = topic_node(&t.topic, &mut nodes);
            nodes.push(if dot {
                format!(
                    "  {tid} [shape=cylinder, label=\"table {}\\nstore table-{}\"];",
                    esc(&t.name),
                    esc(&t.name)
                )
            } else {
                format!(
                    "  {tid}[(\"table {}<br/>store table-{}\")]",
                    esc(&t.name),
                    esc(&t.name)
                )
            });
            edges.push((topic, tid.clone(), Some("load".into())));
            table_ids.push((t.name.clone(), tid));
        }
        let mut prev = src;
        for (i, st) in self.stages.iter().enumerate() {
            let id = format!("s{i}");
            let label = format!(
                "{} {}\n{}",
                st.kind.kind_name(),
                st.name,
                settings(&st.kind)
            );
            nodes.push(if dot {
                format!(
                    "  {id} [shape=box, label=\"{}\"];",
                    esc(&label).replace('\n', "\\n")
                )
            } else {
                format!("  {id}[\"{}\"]", esc(&label).replace('\n', "<br/>"))
            });
            edges.push((prev.clone(), id.clone(), None));
            match &st.kind {
                StageKind::Route(r) => {
                    for b in &r.branches {
                        let t = topic_node(&b.topic, &mut nodes);
                        edges.push((id.clone(), t, Some(b.when.describe())));
                    }
                    if let Some(d) = &r.default {
                        let t = topic_node(d, &mut nodes);
                        edges.push((id.clone(), t, Some("default".into())));
                    }
                }
                StageKind::Enrich(e) => {
                    if let Some((_, tid)) = table_ids.iter().find(|(n, _)| *n == e.table) {
                        edges.push((tid.clone(), id.clone(), Some("lookup".into())));
                    }
                }
                StageKind::Dedup(d) => {
                    if let Some(side) = &d.duplicates_to {
                        let t = topic_node(side, &mut nodes);
                        edges.push((id.clone(), t, Some("duplicates".into())));
                    }
                }
                other => {
                    for t in other.output_topics() {
                        let t = topic_node(&t, &mut nodes);
                        edges.push((id.clone(), t, None));
                    }
                }
            }
            for (j, store) in stores_of(&st.kind, &st.name).into_iter().enumerate() {
                let sid = format!("st{i}_{j}");
                let cl = changelog_topic(app, &store);
                nodes.push(if dot {
                    format!(
                        "  {sid} [shape=cylinder, label=\"store {}\\nchangelog {}\"];",
                        esc(&store),
                        esc(&cl)
                    )
                } else {
                    format!(
                        "  {sid}[(\"store {}<br/>changelog {}\")]",
                        esc(&store),
                        esc(&cl)
                    )
                });
                edges.push((id.clone(), sid, Some("state".into())));
            }
            prev = id;
        }
        if dot {
            let _ = writeln!(s, "digraph \"{}\" {{", esc(&self.name));
            let _ = writeln!(s, "  rankdir=LR;");
        } else {
            let _ = writeln!(s, "flowchart LR");
        }
        for n in nodes {
            let _ = writeln!(s, "{n}");
        }
        for (a, b, label) in edges {
            let _ = match (dot, label) {
                (true, Some(l)) => writeln!(s, "  {a} -> {b} [label=\"{}\"];", esc(&l)),
                (true, None) => writeln!(s, "  {a} -> {b};"),
                (false, Some(l)) => writeln!(s, "  {a} -->|\"{}\"| {b}", esc(&l)),
                (false, None) => writeln!(s, "  {a} --> {b}"),
            };
        }
        if dot {
            let _ = writeln!(s, "}}");
        }
        s
    }
}
