//! Topology-file entries for codecs, lookup tables and the enrich stage.
//!
//! ```yaml
//! source: { topic: orders, format: { protobuf: { descriptor_set: shop.desc, message: shop.Order } } }
//! tables:
//!   - { name: customers, topic: customers, format: json }
//! stages:
//!   - enrich: { name: join, table: customers, key: { json_pointer: /customer_id }, into: /customer, on_missing: dead_letter }
//!   - sink: { topic: orders.enriched, format: json }
//! ```
//!
//! A `descriptor_set` path is relative to the topology file's directory.

use super::KeyDef;
use crate::processor::codec::{Format, ProtoFormat};
use crate::processor::enrich::{EnrichSpec, MissingPolicy, TableSpec};
use crate::topology::TopologyBuilder;
use serde::Deserialize;
use std::path::Path;

/// `format:` of a source, sink or table topic.
#[derive(Debug, Deserialize, Default, Clone)]
#[serde(rename_all = "snake_case")]
pub enum CodecDef {
    /// JSON values (default).
    #[default]
    Json,
    /// Raw bytes.
    Bytes,
    /// UTF-8 text.
    String,
    /// `{ protobuf: { descriptor_set: file.desc, message: pkg.Type } }`
    Protobuf(ProtoDef),
}

/// `protobuf:` settings.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct ProtoDef {
    /// A FileDescriptorSet file (`protoc --include_imports --descriptor_set_out`).
    pub descriptor_set: String,
    /// Full name of the message type, e.g. `shop.Order`.
    pub message: String,
}

impl CodecDef {
    /// The codec; `base` is the topology file's directory.
    ///
    /// # Errors
    /// A sentence: the descriptor set cannot be read or lacks the message type.
    pub fn compile(&self, base: &Path) -> Result<Format, String> {
        Ok(match self {
            CodecDef::Json => Format::Json,
            CodecDef::Bytes => Format::Bytes,
            CodecDef::String => Format::String,
            CodecDef::Protobuf(p) => Format::Protobuf(
                ProtoFormat::from_file(base.join(&p.descriptor_set), &p.message)
                    .map_err(|e| e.to_string())?,
            ),
        })
    }
}

/// One item of `tables:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableDef {
    /// Table name (enrich stages refer to it).
    pub name: String,
    /// Its compacted topic.
    pub topic: String,
    /// Codec of the topic's values (default json).
    #[serde(default)]
    pub format: CodecDef,
}

/// `enrich:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrichDef {
    /// Stage name (default `enrich-<table>`).
    pub name: Option<String>,
    /// Table to look up.
    pub table: String,
    /// Where the lookup key comes from (as a dedup key).
    pub key: KeyDef,
    /// JSON pointer where the row goes (default `/<table>`; `""` merges into the top level).
    pub into: Option<String>,
    /// `drop`, `pass` (default) or `dead_letter`.
    pub on_missing: Option<MissingDef>,
}

/// `on_missing:` values.
#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum MissingDef {
    /// Drop the record.
    Drop,
    /// Pass it on unchanged.
    Pass,
    /// Dead-letter it.
    DeadLetter,
}

/// Add the `tables:` of a file to `b`.
pub(super) fn add_tables(
    mut b: TopologyBuilder,
    defs: &[TableDef],
    base: &Path,
    errors: &mut Vec<String>,
) -> TopologyBuilder {
    for (i, t) in defs.iter().enumerate() {
        match t.format.compile(base) {
            Ok(f) => b = b.table(TableSpec::new(&t.name, &t.topic).format(f)),
            Err(e) => errors.push(format!("tables[{i}] (`{}`): field `format`: {e}", t.name)),
        }
    }
    b
}

/// Add an `enrich:` stage to `b`.
pub(super) fn add_enrich(b: TopologyBuilder, d: &EnrichDef) -> TopologyBuilder {
    let name = d
        .name
        .clone()
        .unwrap_or_else(|| format!("enrich-{}", d.table));
    let into = d.into.clone().unwrap_or_else(|| format!("/{}", d.table));
    let policy = match d.on_missing {
        None | Some(MissingDef::Pass) => MissingPolicy::Pass,
        Some(MissingDef::Drop) => MissingPolicy::Drop,
        Some(MissingDef::DeadLetter) => MissingPolicy::DeadLetter,
    };
    b.enrich(
        name,
        EnrichSpec::new(&d.table, d.key.compile(), into).on_missing(policy),
    )
}
