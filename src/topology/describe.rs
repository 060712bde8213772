//! `describe()`: a topology as text, as a Mermaid flowchart, or as a Graphviz dot graph,
//! showing the source, each stage with its settings, the topics written, and the stores
//! with their changelog topics.

use super::Topology;
use crate::state::restore::changelog_topic;
use crate::topology::stage::Link;
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

/// A kind's title in the text form: its name with each word capitalized and the spaces
/// left out (`dedup` -> `Dedup`, `external sink` -> `ExternalSink`).
fn title(kind_name: &str) -> String {
    kind_name
        .split(' ')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
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
            let kind = st.kind.spec();
            for line in kind.describe_before(app, &st.name) {
                let _ = writeln!(s, "  {line}");
            }
            let _ = writeln!(
                s,
                "  {}: {} {}",
                title(st.kind.kind_name()),
                st.name,
                kind.settings()
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
            for store in st.kind.spec().stores(&st.name) {
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
        let hop = self.hop().ok().flatten().map(|(k, name, d)| {
            (
                k,
                crate::processor::stages::repartition_topic(app, name),
                d.key.describe(),
            )
        });
        for (i, st) in self.stages.iter().enumerate() {
            let id = format!("s{i}");
            let kind = st.kind.spec();
            if let Some((_, topic, key)) = hop.as_ref().filter(|(k, ..)| *k == i) {
                // The repartition hop: what the stages before it pass is routed by the
                // dedup key through the repartition topic.
                let t = topic_node(topic, &mut nodes);
                edges.push((
                    prev.clone(),
                    t.clone(),
                    Some(format!("repartition by {key}")),
                ));
                prev = t;
            }
            let label = format!("{} {}\n{}", st.kind.kind_name(), st.name, kind.settings());
            nodes.push(if dot {
                format!(
                    "  {id} [shape=box, label=\"{}\"];",
                    esc(&label).replace('\n', "\\n")
                )
            } else {
                format!("  {id}[\"{}\"]", esc(&label).replace('\n', "<br/>"))
            });
            edges.push((prev.clone(), id.clone(), None));
            for link in kind.links() {
                match link {
                    Link::ToTopic(t, label) => {
                        let t = topic_node(&t, &mut nodes);
                        edges.push((id.clone(), t, label));
                    }
                    Link::FromTable(table, label) => {
                        if let Some((_, tid)) = table_ids.iter().find(|(n, _)| *n == table) {
                            edges.push((tid.clone(), id.clone(), Some(label.into())));
                        }
                    }
                }
            }
            for (j, store) in kind.stores(&st.name).into_iter().enumerate() {
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
