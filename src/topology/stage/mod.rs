//! Stage kinds: everything about one kind of stage in one module, behind one trait.
//!
//! A kind is a spec type (what a topology holds for a stage of that kind) that implements
//! [`StageKindSpec`]: its `describe` line and graph links, the topics and stores it
//! declares, its checks at build time, and the processor it runs (its name, as files and
//! messages write it, is in its registration line). Its module also holds its
//! [`TopologyBuilder`](crate::TopologyBuilder) method and its topology-file schema (one or
//! more [`FileKind`]s, read with the located field readers of `crate::schema`).
//!
//! The kinds are registered once, in [`stage_kinds!`] below; the topology, the builder,
//! `describe` and the topology-file parser only ever go through the trait. Adding a kind is
//! one new module here (its `mod` line) plus one registration line.
//!
//! | module | kind | file keys |
//! |---|---|---|
//! | `dedup` | drop repeated records by key within a TTL | `dedup` |
//! | `sink` | write records to topics | `sink` |
//! | `filter` | keep records a predicate accepts | `filter` |
//! | `map` | set, rename, drop fields | `map` |
//! | `route` | records to topics by predicate | `route` |
//! | `enrich` | join with a lookup table | `enrich` |
//! | `external` | effects outside Kafka with keyed idempotency | `http`, `postgres`, `redis`, `file` |

// One module per kind (declared here rather than by `stage_kinds!` so that rustfmt sees
// them); each is registered below.
mod dedup;
mod enrich;
mod external;
mod filter;
mod map;
mod route;
mod sink;

use crate::codec::Format;
use crate::processor::enrich::{EnrichSpec, TableSpec};
use crate::processor::key::KeySource;
use crate::processor::route::RouteSpec;
use crate::processor::stages::{DedupSpec, SinkSpec};
use crate::processor::transform::{FilterSpec, MapSpec};
use crate::processor::Processor;
use crate::schema::node::Node;
use crate::schema::{Fields, Reader};
use crate::sink::ExternalSinkSpec;
use crate::topology::{Source, Topology};

pub(crate) use crate::error::FieldError;

/// What a stage's checks may look at besides its own spec.
pub(crate) struct CheckCx<'a> {
    /// The topology's source, if one was set.
    pub(crate) source: Option<&'a Source>,
    /// The key of the nearest dedup stage upstream, if any (not set for
    /// [`StageKindSpec::check_tables`]).
    pub(crate) upstream_dedup: Option<&'a KeySource>,
    /// The declared lookup tables.
    pub(crate) tables: &'a [TableSpec],
}

impl CheckCx<'_> {
    /// The source's format name, `?` when there is no source.
    pub(crate) fn format_name(&self) -> &'static str {
        self.source.map_or("?", |s| s.format.name())
    }
}

/// What building a stage's processor may look at: the topology and the stage's place in it.
pub(crate) struct BuildCx<'a> {
    /// The whole topology.
    pub(crate) topology: &'a Topology,
    /// The stage's index.
    pub(crate) index: usize,
    /// The stage's name (also its store's name).
    pub(crate) name: &'a str,
}

impl BuildCx<'_> {
    /// The topology's name.
    pub(crate) fn topology_name(&self) -> &str {
        self.topology.name()
    }

    /// Whether the source's values are JSON.
    pub(crate) fn json(&self) -> bool {
        self.topology.source().format == Format::Json
    }

    /// Whether a stage follows this one (so records go on after it).
    pub(crate) fn forwards(&self) -> bool {
        self.index + 1 < self.topology.stages().len()
    }

    /// The stages after this one.
    pub(crate) fn downstream(&self) -> &[crate::topology::Stage] {
        &self.topology.stages()[self.index + 1..]
    }
}

/// Where a stage sends something, for the `describe` graphs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Link {
    /// An edge from the stage to a topic, maybe labelled.
    ToTopic(String, Option<String>),
    /// An edge from a lookup table to the stage, labelled.
    FromTable(String, &'static str),
}

/// One kind of stage. Its spec type implements it; the topology, the builder, `describe`
/// and the runtime see stages only through it (and [`StageKind::spec`]).
pub(crate) trait StageKindSpec: std::fmt::Debug + Send + Sync {
    /// One line of settings for `describe`.
    fn settings(&self) -> String;

    /// Lines `describe` prints before the stage's own line (e.g. a repartition topic), for
    /// application id `app` and stage `name`. Default: none.
    fn describe_before(&self, _app: &str, _name: &str) -> Vec<String> {
        Vec::new()
    }

    /// Topics this stage writes, in order. Default: none.
    fn output_topics(&self) -> Vec<String> {
        Vec::new()
    }

    /// The edges of this stage in the `describe` graphs. Default: one unlabelled edge to
    /// each output topic.
    fn links(&self) -> Vec<Link> {
        self.output_topics()
            .into_iter()
            .map(|t| Link::ToTopic(t, None))
            .collect()
    }

    /// Whether the stage delivers the records that reach it (a sink, a route, an external
    /// sink; a topology needs at least one). Default: false (a side output such as a
    /// dedup's duplicate topic does not count).
    fn delivers(&self) -> bool {
        false
    }

    /// Whether the stage makes effects outside Kafka (a dedup stage upstream then holds
    /// back twins until the effect is done). Default: false.
    fn external_effect(&self) -> bool {
        false
    }

    /// The state stores of stage `name`. Default: none.
    fn stores(&self, _name: &str) -> Vec<String> {
        Vec::new()
    }

    /// Append the JSON pointers the stage reads (for decoding without a tree). Default:
    /// none.
    fn json_pointers(&self, _out: &mut Vec<String>) {}

    /// Check the spec against the rest of the topology, appending every problem to
    /// `errors`; it may settle settings that depend on the topology (an external sink's key
    /// rule). Called by [`TopologyBuilder::build`](crate::TopologyBuilder::build).
    fn check(&mut self, cx: &CheckCx<'_>, errors: &mut Vec<FieldError>);

    /// Checks against the declared lookup tables, appending every problem to `errors`;
    /// run after the tables themselves are checked (so a table's own errors come first).
    /// Default: none.
    fn check_tables(&self, _cx: &CheckCx<'_>, _errors: &mut Vec<FieldError>) {}

    /// A new processor for one task (one source partition).
    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor>;
}

/// A boxed spec is its spec (external sinks are boxed to keep [`StageKind`] small).
impl<T: StageKindSpec + ?Sized> StageKindSpec for Box<T> {
    fn settings(&self) -> String {
        (**self).settings()
    }
    fn describe_before(&self, app: &str, name: &str) -> Vec<String> {
        (**self).describe_before(app, name)
    }
    fn output_topics(&self) -> Vec<String> {
        (**self).output_topics()
    }
    fn links(&self) -> Vec<Link> {
        (**self).links()
    }
    fn delivers(&self) -> bool {
        (**self).delivers()
    }
    fn external_effect(&self) -> bool {
        (**self).external_effect()
    }
    fn stores(&self, name: &str) -> Vec<String> {
        (**self).stores(name)
    }
    fn json_pointers(&self, out: &mut Vec<String>) {
        (**self).json_pointers(out)
    }
    fn check(&mut self, cx: &CheckCx<'_>, errors: &mut Vec<FieldError>) {
        (**self).check(cx, errors)
    }
    fn check_tables(&self, cx: &CheckCx<'_>, errors: &mut Vec<FieldError>) {
        (**self).check_tables(cx, errors)
    }
    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor> {
        (**self).processor(cx)
    }
}

/// A stage read from a topology file: its kind, and the value format of the topics it
/// writes when the file sets one (a sink's `format`).
pub(crate) type ReadStage = (StageKind, Option<Format>);

/// One key a topology file may use in `stages:` (`dedup`, `http`, ...): the fields it
/// accepts and how it is read.
pub(crate) struct FileKind {
    /// The key (`- dedup: {...}`).
    pub(crate) key: &'static str,
    /// The fields it accepts; any other is reported as unknown, at its position.
    pub(crate) fields: &'static [&'static str],
    /// The stage's name when the file gives none: from the body and the stage's index
    /// (from 0).
    pub(crate) default_name: fn(body: &Node, index: usize) -> String,
    /// Read the fields into a stage; every problem is reported to the compiler with its
    /// position, and `None` returned when any was found.
    pub(crate) read: fn(&mut Reader, &Fields<'_>, place: &str) -> Option<ReadStage>,
}

/// The default name `<key>-<n>` (`n` from 1).
pub(crate) fn numbered(key: &str, index: usize) -> String {
    format!("{key}-{}", index + 1)
}

/// Registers the stage kinds: one line per kind, `Variant(SpecType) = "name" => module`
/// (the name as topology files and messages write the kind). Makes the
/// [`StageKind`] enum, its view as a [`StageKindSpec`], and the list of file keys.
macro_rules! stage_kinds {
    ($( $(#[$doc:meta])* $variant:ident($ty:ty) = $name:literal => $module:ident, )*) => {
        /// What a stage does: one variant per registered kind.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub(crate) enum StageKind {
            $( $(#[$doc])* $variant($ty), )*
        }

        impl StageKind {
            /// The kind as written in topology files and messages (`dedup`, `sink`, ...).
            pub(crate) fn kind_name(&self) -> &'static str {
                match self {
                    $( StageKind::$variant(_) => $name, )*
                }
            }

            /// This stage's kind, through its trait.
            pub(crate) fn spec(&self) -> &dyn StageKindSpec {
                match self {
                    $( StageKind::$variant(s) => s, )*
                }
            }

            /// As [`Self::spec`], mutable (for [`StageKindSpec::check`]).
            pub(crate) fn spec_mut(&mut self) -> &mut dyn StageKindSpec {
                match self {
                    $( StageKind::$variant(s) => s, )*
                }
            }
        }

        /// Every key a topology file may use in `stages:`.
        pub(crate) fn file_kinds() -> impl Iterator<Item = &'static FileKind> {
            [$( $module::FILE_KINDS, )*].into_iter().flatten()
        }
    };
}

stage_kinds! {
    /// Drop repeated records by key within a TTL.
    Dedup(DedupSpec) = "dedup" => dedup,
    /// Write records to one or more topics.
    Sink(SinkSpec) = "sink" => sink,
    /// Keep records a predicate accepts.
    Filter(FilterSpec) = "filter" => filter,
    /// Set, rename and drop fields.
    Map(MapSpec) = "map" => map,
    /// Send records to topics by predicate.
    Route(RouteSpec) = "route" => route,
    /// Join records with a lookup table.
    Enrich(EnrichSpec) = "enrich" => enrich,
    /// An effect outside Kafka (HTTP, PostgreSQL, Redis, file) with keyed idempotency.
    External(Box<ExternalSinkSpec>) = "external sink" => external,
}

impl StageKind {
    /// Topics this stage writes, in order.
    pub(crate) fn output_topics(&self) -> Vec<String> {
        self.spec().output_topics()
    }
}

/// The file key `key`, if registered.
pub(crate) fn file_kind(key: &str) -> Option<&'static FileKind> {
    file_kinds().find(|k| k.key == key)
}

/// The registered file keys, sorted (for messages).
pub(crate) fn file_keys() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = file_kinds().map(|k| k.key).collect();
    v.sort_unstable();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_keys_are_unique_and_sorted() {
        let keys = file_keys();
        assert_eq!(
            keys,
            [
                "dedup", "enrich", "file", "filter", "http", "map", "postgres", "redis", "route",
                "sink"
            ]
        );
        for k in &keys {
            assert_eq!(file_kind(k).map(|f| f.key), Some(*k));
        }
    }
}
