//! The `route` kind: each record to the topic of the first branch whose predicate accepts
//! it, else to the default. Spec [`RouteSpec`] and processor `Route` in
//! `processor/route.rs`.
//!
//! ```yaml
//! - route:
//!     routes: [ { when: 'value.public', to: gh.public } ]
//!     default: gh.private
//! ```

use super::{BuildCx, CheckCx, FieldError, FileKind, Link, ReadStage, StageKind, StageKindSpec};
use crate::names::check_topic_name;
use crate::processor::expr::Predicate;
use crate::processor::route::{Route, RouteBranch, RouteSpec};
use crate::processor::Processor;
use crate::schema::node::Val;
use crate::schema::{Fields, Reader};
use crate::topology::TopologyBuilder;

impl StageKindSpec for RouteSpec {
    fn settings(&self) -> String {
        let mut parts: Vec<String> = self
            .branches
            .iter()
            .map(|b| format!("`{}`->{}", b.when.describe(), b.topic))
            .collect();
        parts.push(format!(
            "default->{}",
            self.default.as_deref().unwrap_or("(dropped)")
        ));
        parts.join(" ")
    }

    fn output_topics(&self) -> Vec<String> {
        self.topics()
    }

    fn links(&self) -> Vec<Link> {
        let branches = self
            .branches
            .iter()
            .map(|b| Link::ToTopic(b.topic.clone(), Some(b.when.describe())));
        let default = self
            .default
            .iter()
            .map(|d| Link::ToTopic(d.clone(), Some("default".into())));
        branches.chain(default).collect()
    }

    fn delivers(&self) -> bool {
        true
    }

    fn check(&mut self, _cx: &CheckCx<'_>, errors: &mut Vec<FieldError>) {
        if self.branches.is_empty() {
            errors.push(FieldError::at(
                "routes",
                "a route needs at least one branch",
            ));
        }
        for b in &self.branches {
            if let Err(why) = check_topic_name(&b.topic) {
                errors.push(FieldError::at("routes", why));
            }
        }
        if let Some(t) = &self.default {
            if let Err(why) = check_topic_name(t) {
                errors.push(FieldError::at("default", why));
            }
        }
    }

    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor> {
        let t = cx.topology;
        Box::new(
            Route::new(
                cx.topology_name(),
                cx.name,
                self.clone(),
                cx.json(),
                cx.forwards(),
            )
            .with_codecs(
                t.source().format.clone(),
                self.topics()
                    .into_iter()
                    .map(|x| {
                        let f = t.topic_format(&x);
                        (x, f)
                    })
                    .collect(),
            ),
        )
    }
}

/// `- route: {...}` in topology files.
pub(super) const FILE_KINDS: &[FileKind] = &[FileKind {
    key: "route",
    fields: &["name", "routes", "default"],
    default_name: |_, i| super::numbered("route", i),
    read,
}];

fn read(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let mut spec = RouteSpec::new();
    let mut ok = true;
    if let Some(n) = c.required(f, "routes", place) {
        match &n.val {
            Val::Seq(items) => {
                for it in items {
                    let Some(bf) = c.fields(it, place, Some("routes"), &["when", "to"]) else {
                        ok = false;
                        continue;
                    };
                    let when: Option<Predicate> = match bf.get("when") {
                        Some(w) => c.func(w, place, "when"),
                        None => {
                            c.err(bf.pos, place, Some("when"), "missing field (in a route)");
                            None
                        }
                    };
                    let to = match bf.get("to") {
                        Some(t) => c.string(t, place, "to"),
                        None => {
                            c.err(bf.pos, place, Some("to"), "missing field (in a route)");
                            None
                        }
                    };
                    match (when, to) {
                        (Some(when), Some(topic)) => {
                            spec.branches.push(RouteBranch { when, topic })
                        }
                        _ => ok = false,
                    }
                }
            }
            other => {
                ok = false;
                c.err(
                    n.pos,
                    place,
                    Some("routes"),
                    format!(
                        "expected a list of {{when, to}} maps, found {}",
                        other.type_name()
                    ),
                );
            }
        }
    } else {
        ok = false;
    }
    ok &= c.opt(
        f,
        "default",
        |c, n| c.string(n, place, "default"),
        |t| spec.default = Some(t),
    );
    ok.then_some((StageKind::Route(spec), None))
}

impl TopologyBuilder {
    /// Add a route stage: each record to the topic of the first branch whose predicate
    /// accepts it, else to the default topic (without one, it is dropped, counted as
    /// `filtered`); a predicate's `Err` dead-letters the record. Records go on to a later
    /// stage too.
    ///
    /// ```
    /// use onceflow::prelude::*;
    /// let by_kind = RouteSpec::new()
    ///     .when(|r| Ok(r.header("kind") == Some(Some(&b"push"[..]))), "pushes")
    ///     .default_topic("other");
    /// let t = TopologyBuilder::new("routing")
    ///     .source("events", Format::Json)
    ///     .route("by-kind", by_kind)
    ///     .build()
    ///     .unwrap();
    /// assert!(t.describe().contains("Route: by-kind"));
    /// ```
    pub fn route(self, name: impl Into<String>, spec: RouteSpec) -> Self {
        self.stage(name, StageKind::Route(spec))
    }
}
