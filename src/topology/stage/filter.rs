//! The `filter` kind: keep the records a predicate accepts. Spec `FilterSpec` and
//! processor `Filter` in `processor/transform.rs`.
//!
//! ```yaml
//! - filter: { name: pushes, when: 'value.type == "PushEvent"' }
//! ```

use super::{BuildCx, CheckCx, FieldError, FileKind, ReadStage, StageKind, StageKindSpec};
use crate::processor::expr::Predicate;
use crate::processor::transform::{Filter, FilterSpec};
use crate::processor::{Processor, Record};
use crate::schema::{Fields, Reader};
use crate::topology::TopologyBuilder;

impl StageKindSpec for FilterSpec {
    fn settings(&self) -> String {
        format!("when `{}`", self.predicate.describe())
    }

    fn check(&mut self, _cx: &CheckCx<'_>, _errors: &mut Vec<FieldError>) {}

    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor> {
        Box::new(Filter::new(
            cx.topology_name(),
            cx.name,
            self.clone(),
            cx.json(),
        ))
    }
}

/// `- filter: {...}` in topology files.
pub(super) const FILE_KINDS: &[FileKind] = &[FileKind {
    key: "filter",
    fields: &["name", "when"],
    default_name: |_, i| super::numbered("filter", i),
    read,
}];

fn read(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let n = c.required(f, "when", place)?;
    let predicate: Predicate = c.func(n, place, "when")?;
    Some((StageKind::Filter(FilterSpec { predicate }), None))
}

impl TopologyBuilder {
    /// Add a filter stage: records for which `predicate` returns true go on (the others
    /// are dropped, counted as `filtered`); an `Err` sends the record to the dead-letter
    /// topic with that reason.
    ///
    /// ```
    /// use onceflow::prelude::*;
    /// // Only records with the header `kind: order` go on.
    /// let t = TopologyBuilder::new("orders")
    ///     .source("events", Format::Json)
    ///     .filter("orders-only", |r| Ok(r.header("kind") == Some(Some(&b"order"[..]))))
    ///     .sink("out", "orders")
    ///     .build()
    ///     .unwrap();
    /// assert!(t.describe().contains("Filter: orders-only"));
    /// ```
    pub fn filter(
        self,
        name: impl Into<String>,
        predicate: impl Fn(&Record) -> Result<bool, String> + Send + Sync + 'static,
    ) -> Self {
        self.stage(
            name,
            StageKind::Filter(FilterSpec {
                predicate: Predicate::native(predicate),
            }),
        )
    }
}
