//! The `map` kind: set, rename and drop fields of the record view. Spec [`MapSpec`] and
//! processor `MapFields` in `processor/transform.rs`.
//!
//! ```yaml
//! - map:
//!     name: shape
//!     rename: { actor: user }            # a field name, or a JSON pointer (/a/b)
//!     set: { repo: 'value.repo.name' }   # computed fields: CEL expressions
//!     drop: [payload]
//! ```

use super::{BuildCx, CheckCx, FieldError, FileKind, ReadStage, StageKind, StageKindSpec};
use crate::processor::expr::Computed;
use crate::processor::transform::{check_field_pointer, MapFields, MapSpec};
use crate::processor::Processor;
use crate::schema::node::Val;
use crate::schema::{Fields, Reader};
use crate::topology::TopologyBuilder;

impl StageKindSpec for MapSpec {
    fn settings(&self) -> String {
        let mut parts = Vec::new();
        for (from, to) in &self.rename {
            parts.push(format!("rename {from}->{to}"));
        }
        for (p, f) in &self.set {
            parts.push(format!("set {p}=`{}`", f.describe()));
        }
        for p in &self.drop {
            parts.push(format!("drop {p}"));
        }
        parts.join(" ")
    }

    fn check(&mut self, cx: &CheckCx<'_>, errors: &mut Vec<FieldError>) {
        for (field, p) in self.pointers() {
            if let Err(r) = check_field_pointer(p) {
                errors.push(FieldError::at(field, r));
            }
        }
        if self.set.is_empty() && self.rename.is_empty() && self.drop.is_empty() {
            errors.push(FieldError::whole(
                "a map stage needs at least one of set, rename, drop",
            ));
        }
        if cx
            .source
            .is_some_and(|s| matches!(s.format, crate::Format::Bytes | crate::Format::String))
        {
            errors.push(FieldError::whole(format!(
                "a map stage needs JSON objects (a json or protobuf source), but the source format is {}",
                cx.format_name()
            )));
        }
    }

    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor> {
        Box::new(MapFields::new(cx.topology_name(), cx.name, self.clone()))
    }
}

/// `- map: {...}` in topology files.
pub(super) const FILE_KINDS: &[FileKind] = &[FileKind {
    key: "map",
    fields: &["name", "set", "rename", "drop"],
    default_name: |_, i| super::numbered("map", i),
    read,
}];

fn read(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let mut spec = MapSpec::new();
    let mut ok = true;
    if f.get("set").is_none() && f.get("rename").is_none() && f.get("drop").is_none() {
        c.err(
            f.pos,
            place,
            None,
            "a map stage needs at least one of set, rename, drop",
        );
        return None;
    }
    ok &= c.path_entries(
        f,
        "set",
        place,
        "a map of field to expression",
        |c, path, v| {
            let func: Option<Computed> = c.func(v, place, "set");
            spec.set.push((path?, func?));
            Some(())
        },
    );
    ok &= c.path_entries(
        f,
        "rename",
        place,
        "a map of old name to new name",
        |c, from, v| {
            let to = c
                .string(v, place, "rename")
                .and_then(|t| c.field_path(&t, v.pos, place, "rename"));
            spec.rename.push((from?, to?));
            Some(())
        },
    );
    if let Some(n) = f.get("drop") {
        match &n.val {
            Val::Seq(items) => {
                for it in items {
                    match c
                        .string(it, place, "drop")
                        .and_then(|t| c.field_path(&t, it.pos, place, "drop"))
                    {
                        Some(p) => spec.drop.push(p),
                        None => ok = false,
                    }
                }
            }
            other => {
                ok = false;
                c.wrong_type(n.pos, place, Some("drop"), "a list of field names", other);
            }
        }
    }
    ok.then_some((StageKind::Map(spec), None))
}

impl TopologyBuilder {
    /// Add a map stage: set, rename and drop fields of the record view, a JSON object
    /// (json or protobuf sources; a bytes or string source, or a map with nothing to do, is
    /// a build error).
    ///
    /// ```
    /// use onceflow::prelude::*;
    /// let t = TopologyBuilder::new("slim")
    ///     .source("events", Format::Json)
    ///     .map("shape", MapSpec::new().rename("/actor", "/user").drop_field("/payload"))
    ///     .sink("out", "events.slim")
    ///     .build()
    ///     .unwrap();
    /// assert!(t.describe().contains("Map: shape rename /actor->/user drop /payload"));
    /// ```
    pub fn map(self, name: impl Into<String>, spec: MapSpec) -> Self {
        self.stage(name, StageKind::Map(spec))
    }
}
