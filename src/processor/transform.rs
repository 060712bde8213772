//! Stateless transforms: `filter` (keep records a predicate accepts) and `map` (set,
//! rename and drop fields of a JSON value, with computed fields).
//!
//! Both refuse a record (it goes to the dead-letter topic with the reason) when an
//! expression fails on it; neither ever panics on input.

use super::expr::{ensure_json, plan, projection, Bindings, Computed, Predicate};
use super::{Context, Processor, Record, StageError};
use crate::codec::json_type;
use crate::error::RecordError;
use serde_json::Value;
use std::sync::Arc;

/// Metric counters of a stateless stage, `onceflow_records_processed_total{result}`.
pub(crate) struct StatelessMetrics {
    pub(crate) passed: metrics::Counter,
    pub(crate) dropped: metrics::Counter,
    pub(crate) error: metrics::Counter,
}

impl StatelessMetrics {
    pub(crate) fn new(topology: &str, stage: &str) -> Self {
        let c = |result| crate::metrics::records_processed(topology, stage, result);
        StatelessMetrics {
            passed: c("passed"),
            dropped: c("filtered"),
            error: c("error"),
        }
    }
}

/// Decode the JSON tree when the source is JSON, refusing the record if it is not JSON.
pub(crate) fn prepare(stage: &str, record: &mut Record, json: bool) -> Result<(), StageError> {
    if json {
        ensure_json(record).map_err(|e| RecordError::new(stage, e))?;
    }
    Ok(())
}

/// Settings of a filter stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FilterSpec {
    /// Records for which it is true go on; false ones are dropped (counted as `filtered`).
    pub(crate) predicate: Predicate,
}

/// Keeps the records its predicate accepts.
pub(crate) struct Filter {
    name: String,
    spec: FilterSpec,
    proj: Option<Arc<[String]>>,
    /// Decode the whole JSON tree before evaluating (see `expr::plan`).
    json: bool,
    metrics: StatelessMetrics,
}

impl Filter {
    /// A filter stage; `json` says the source value is JSON (decoded for the predicate).
    pub(crate) fn new(topology: &str, name: &str, spec: FilterSpec, json: bool) -> Self {
        let (proj, tree) = plan(json, [&spec.predicate]);
        Filter {
            name: name.to_string(),
            proj,
            spec,
            json: tree,
            metrics: StatelessMetrics::new(topology, name),
        }
    }
}

impl Processor for Filter {
    fn process(&mut self, mut record: Record, ctx: &mut Context<'_>) -> Result<(), StageError> {
        prepare(&self.name, &mut record, self.json)?;
        let keep = self
            .spec
            .predicate
            .eval(&Bindings::projected(&record, self.proj.clone()))
            .map_err(|e| {
                self.metrics.error.increment(1);
                RecordError::new(&self.name, e)
            })?;
        if keep {
            self.metrics.passed.increment(1);
            ctx.forward(record);
        } else {
            self.metrics.dropped.increment(1);
        }
        Ok(())
    }
}

/// Settings of a map stage, applied in this order: every `set` expression is evaluated on
/// the record as it came in; then `rename` moves fields (a missing source field is left
/// alone); then the `set` results are written (creating missing parent objects); then
/// `drop` removes fields (a missing one is no error). Fields are JSON pointers (`/a/b`).
/// The value must be a JSON object; the new value replaces the record's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MapSpec {
    /// Computed fields: pointer and function.
    pub(crate) set: Vec<(String, Computed)>,
    /// Renames: from pointer, to pointer.
    pub rename: Vec<(String, String)>,
    /// Pointers of fields to remove.
    pub drop: Vec<String>,
}

impl MapSpec {
    /// An empty map, to give fields with [`MapSpec::set`], [`MapSpec::rename`] and
    /// [`MapSpec::drop_field`]; `build` refuses a map left empty, as topology files do.
    pub fn new() -> Self {
        MapSpec::default()
    }

    /// Set the field at `pointer` to what `f` computes from the record.
    pub fn set(
        mut self,
        pointer: impl Into<String>,
        f: impl Fn(&Record) -> Result<Value, String> + Send + Sync + 'static,
    ) -> Self {
        self.set.push((pointer.into(), Computed::native(f)));
        self
    }

    /// Move the field at `from` to `to`.
    pub fn rename(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.rename.push((from.into(), to.into()));
        self
    }

    /// Remove the field at `pointer`.
    pub fn drop_field(mut self, pointer: impl Into<String>) -> Self {
        self.drop.push(pointer.into());
        self
    }

    /// Every pointer this map names, with the field it comes from, for validation.
    pub(crate) fn pointers(&self) -> Vec<(&'static str, &str)> {
        let mut out: Vec<(&'static str, &str)> = Vec::new();
        out.extend(self.set.iter().map(|(p, _)| ("set", p.as_str())));
        for (a, b) in &self.rename {
            out.push(("rename", a.as_str()));
            out.push(("rename", b.as_str()));
        }
        out.extend(self.drop.iter().map(|p| ("drop", p.as_str())));
        out
    }
}

/// Check a JSON pointer for a map field: starts with `/`, names at least one field.
///
/// # Errors
/// A sentence saying what is wrong.
pub(crate) fn check_field_pointer(p: &str) -> Result<(), String> {
    if !p.starts_with('/') || p.len() < 2 {
        return Err(format!(
            "field path {p:?} must be a JSON pointer such as /name or /a/b"
        ));
    }
    Ok(())
}

fn tokens(p: &str) -> Vec<String> {
    p.split('/')
        .skip(1)
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect()
}

/// Remove and return the value at `p`; `None` when any step is missing.
fn take(root: &mut Value, p: &str) -> Option<Value> {
    let toks = tokens(p);
    let (last, parents) = toks.split_last()?;
    let mut cur = root;
    for t in parents {
        cur = cur.as_object_mut()?.get_mut(t)?;
    }
    cur.as_object_mut()?.shift_remove(last)
}

/// Write `v` at `p`, creating missing parent objects.
fn put(root: &mut Value, p: &str, v: Value) -> Result<(), String> {
    let toks = tokens(p);
    let Some((last, parents)) = toks.split_last() else {
        return Err(format!("cannot set {p:?}: not a field"));
    };
    let mut cur = root;
    let mut at = String::new();
    for t in parents {
        let k = json_type(cur);
        let here = if at.is_empty() { "the value" } else { &at };
        let Some(obj) = cur.as_object_mut() else {
            return Err(format!("cannot set {p}: {here} is {k}, not an object"));
        };
        cur = obj
            .entry(t.clone())
            .or_insert_with(|| Value::Object(Default::default()));
        at.push('/');
        at.push_str(t);
    }
    let k = json_type(cur);
    cur.as_object_mut()
        .ok_or_else(|| {
            let parent = if at.is_empty() { "the value" } else { &at };
            format!("cannot set {p}: {parent} is {k}, not an object")
        })?
        .insert(last.clone(), v);
    Ok(())
}

/// Sets, renames and drops fields of a JSON object value.
pub(crate) struct MapFields {
    name: String,
    spec: MapSpec,
    proj: Option<Arc<[String]>>,
    metrics: StatelessMetrics,
}

impl MapFields {
    /// A map stage (its source must be JSON; `build()` checks).
    pub(crate) fn new(topology: &str, name: &str, spec: MapSpec) -> Self {
        MapFields {
            name: name.to_string(),
            proj: projection(spec.set.iter().filter_map(|(_, f)| f.as_expr())),
            spec,
            metrics: StatelessMetrics::new(topology, name),
        }
    }

    fn apply(&self, record: &mut Record) -> Result<(), String> {
        ensure_json(record)?;
        match &record.json {
            None => return Err("value is null; map needs a JSON object".into()),
            Some(Value::Object(_)) => {}
            Some(other) => {
                return Err(format!(
                    "value is {}; map needs a JSON object",
                    json_type(other)
                ))
            }
        }
        let computed = {
            let b = Bindings::projected(record, self.proj.clone());
            let mut out = Vec::with_capacity(self.spec.set.len());
            for (p, f) in &self.spec.set {
                out.push((p, f.eval(&b).map_err(|e| format!("set {p}: {e}"))?));
            }
            out
        };
        let json = record.json.as_mut().expect("checked above");
        for (from, to) in &self.spec.rename {
            if let Some(v) = take(json, from) {
                put(json, to, v)?;
            }
        }
        for (p, v) in computed {
            put(json, p, v)?;
        }
        for p in &self.spec.drop {
            take(json, p);
        }
        let bytes =
            serde_json::to_vec(json).map_err(|e| format!("cannot encode the value: {e}"))?;
        record.value = Some(bytes.into());
        record.view_edited = true;
        // The scanned fields described the old bytes.
        record.fields = None;
        Ok(())
    }
}

impl Processor for MapFields {
    fn process(&mut self, mut record: Record, ctx: &mut Context<'_>) -> Result<(), StageError> {
        if let Err(e) = self.apply(&mut record) {
            self.metrics.error.increment(1);
            return Err(RecordError::new(&self.name, e).into());
        }
        self.metrics.passed.increment(1);
        ctx.forward(record);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_and_take() {
        let mut v: Value = serde_json::from_str(r#"{"a":{"b":1},"s":"x","a~b":2}"#).unwrap();
        assert_eq!(take(&mut v, "/a/b"), Some(Value::from(1)));
        assert_eq!(take(&mut v, "/a/zz"), None);
        assert_eq!(take(&mut v, "/s/zz"), None);
        assert_eq!(take(&mut v, "/a~0b"), Some(Value::from(2)));
        put(&mut v, "/n/m", Value::from(3)).unwrap();
        assert_eq!(
            put(&mut v, "/s/t", Value::from(3)).unwrap_err(),
            "cannot set /s/t: /s is a string, not an object"
        );
        assert_eq!(v.to_string(), r#"{"a":{},"s":"x","n":{"m":3}}"#);
    }
}
