//! Expressions over a record: CEL (the Common Expression Language, via the `cel` crate) in
//! topology files, Rust closures in the builder API; both are a [`Func`].
//!
//! An expression sees these variables:
//!
//! | name | CEL type | what |
//! |---|---|---|
//! | `value` | map, list, string, number, bool or null | the decoded JSON value; `bytes` when the source format is `bytes`; `null` for a null value |
//! | `key` | string, or bytes | the Kafka key: a string when it is valid UTF-8, bytes otherwise (never decoded lossily); `null` when absent |
//! | `headers` | map of string to string/bytes/null | headers by name, the first of each name; a header value follows the rule of `key` |
//! | `topic`, `partition`, `offset` | string, int, int | where the record was read |
//! | `timestamp` | int or null | record timestamp in ms since the epoch |
//!
//! An expression that does not parse is a build error. One that fails on a record (a
//! missing field such as `value.nope`, a type mismatch such as `value.n + "x"`, a predicate
//! that is not a bool) makes that record a dead letter with the reason; it never panics.
//! `has(value.field)` tests a field without failing.

use super::record::Record;
use bytes::Bytes;
use cel::objects::{Key, Map};
use cel::{Context, Env, Program, Value};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

/// The names an expression may use, in the order the docs list them.
pub const VARIABLES: [&str; 7] = [
    "value",
    "key",
    "headers",
    "topic",
    "partition",
    "offset",
    "timestamp",
];

/// Longest expression accepted, in bytes.
pub const MAX_EXPR_LEN: usize = 4096;
/// Deepest bracket nesting accepted in an expression.
pub const MAX_EXPR_NESTING: usize = 32;
/// Most operator characters accepted in an expression (each may add a parser level).
pub const MAX_EXPR_OPERATORS: usize = 256;

fn env() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| Arc::new(Env::stdlib())).clone()
}

/// A parsed CEL expression and its source text.
#[derive(Clone)]
pub struct Expr {
    source: String,
    program: Arc<Program>,
    /// The top-level fields of `value` it reads (`value.a`, `value["a"]`), or `None` when
    /// it uses `value` as a whole: only those fields are converted for it.
    value_fields: Option<Vec<String>>,
}

/// Collect the top-level fields of `value` that `e` reads; `whole` is set when `value` is
/// used in any other way (passed to a function, iterated, compared).
fn value_fields(e: &cel::common::ast::IdedExpr, out: &mut Vec<String>, whole: &mut bool) {
    use cel::common::ast::{EntryExpr, Expr as E, LiteralValue};
    let is_value = |x: &cel::common::ast::IdedExpr| matches!(&x.expr, E::Ident(n) if n == "value");
    let add = |f: &str, out: &mut Vec<String>| {
        if !out.iter().any(|o| o == f) {
            out.push(f.to_string());
        }
    };
    match &e.expr {
        E::Ident(n) => {
            if n == "value" {
                *whole = true;
            }
        }
        E::Select(sel) if is_value(&sel.operand) => add(&sel.field, out),
        E::Select(sel) => value_fields(&sel.operand, out, whole),
        E::Call(c) => {
            let indexed = c.func_name == "_[_]"
                && c.args.len() == 2
                && is_value(&c.args[0])
                && matches!(&c.args[1].expr, E::Literal(LiteralValue::String(_)));
            if indexed {
                if let E::Literal(LiteralValue::String(f)) = &c.args[1].expr {
                    add(f.inner(), out);
                }
            } else {
                if let Some(t) = &c.target {
                    value_fields(t, out, whole);
                }
                for a in &c.args {
                    value_fields(a, out, whole);
                }
            }
        }
        E::Comprehension(c) => {
            if [c.iter_var.as_str(), c.accu_var.as_str()].contains(&"value")
                || c.iter_var2.as_deref() == Some("value")
            {
                *whole = true;
            }
            for x in [
                &c.iter_range,
                &c.accu_init,
                &c.loop_cond,
                &c.loop_step,
                &c.result,
            ] {
                value_fields(x, out, whole);
            }
        }
        E::List(l) => l.elements.iter().for_each(|x| value_fields(x, out, whole)),
        E::Map(m) => {
            for en in &m.entries {
                if let EntryExpr::MapEntry(me) = &en.expr {
                    value_fields(&me.key, out, whole);
                    value_fields(&me.value, out, whole);
                }
            }
        }
        E::Struct(st) => {
            for en in &st.entries {
                match &en.expr {
                    EntryExpr::StructField(f) => value_fields(&f.value, out, whole),
                    EntryExpr::MapEntry(me) => {
                        value_fields(&me.key, out, whole);
                        value_fields(&me.value, out, whole);
                    }
                }
            }
        }
        E::Literal(_) | E::Unspecified => {}
    }
}

/// How a stage with these functions binds `value`: the projection its expressions allow
/// (`None` for a non-JSON source or when one needs the whole value), and whether the stage
/// must decode the whole JSON tree first (closures read [`Record::json`]; a whole-value
/// expression needs it).
pub fn plan<'a, T: FromCel + 'a>(
    json: bool,
    funcs: impl IntoIterator<Item = &'a Func<T>>,
) -> (Option<Arc<[String]>>, bool) {
    if !json {
        return (None, false);
    }
    let funcs: Vec<&Func<T>> = funcs.into_iter().collect();
    let native = funcs.iter().any(|f| matches!(f, Func::Native(_)));
    let proj = projection(funcs.iter().filter_map(|f| f.as_expr()));
    let tree = native || proj.is_none();
    (proj, tree)
}

/// What of `value` a set of expressions reads: the union of their top-level fields, or
/// `None` when any needs the whole value.
pub fn projection<'a>(exprs: impl IntoIterator<Item = &'a Expr>) -> Option<Arc<[String]>> {
    let mut out: Vec<String> = Vec::new();
    for e in exprs {
        for f in e.value_fields.as_ref()? {
            if !out.contains(f) {
                out.push(f.clone());
            }
        }
    }
    Some(out.into())
}

impl Expr {
    /// Parse `source` as CEL.
    ///
    /// # Errors
    /// The parser's message (with the position inside the expression) when `source` is not
    /// a CEL expression, or names a variable other than those of [`VARIABLES`] (and the
    /// names bound by macros such as `exists(x, ...)`).
    pub fn parse(source: &str) -> Result<Expr, String> {
        if source.trim().is_empty() {
            return Err("expression is empty".into());
        }
        if source.len() > MAX_EXPR_LEN {
            return Err(format!(
                "expression is {} bytes long, at most {MAX_EXPR_LEN}",
                source.len()
            ));
        }
        // The parser recurses per nesting level: bound it, so no input overflows the stack.
        let mut depth = 0usize;
        for c in source.chars() {
            match c {
                '(' | '[' | '{' => {
                    depth += 1;
                    if depth > MAX_EXPR_NESTING {
                        return Err(format!(
                            "expression nests brackets deeper than {MAX_EXPR_NESTING} levels"
                        ));
                    }
                }
                ')' | ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        let ops = source
            .matches(|c: char| {
                matches!(
                    c,
                    '!' | '-'
                        | '+'
                        | '*'
                        | '/'
                        | '%'
                        | '.'
                        | '&'
                        | '|'
                        | '<'
                        | '>'
                        | '='
                        | '?'
                        | ':'
                )
            })
            .count();
        if ops > MAX_EXPR_OPERATORS {
            return Err(format!(
                "expression has {ops} operators, at most {MAX_EXPR_OPERATORS}"
            ));
        }
        // The parser is generated code; whatever it does on odd input, a topology file
        // must not crash the process.
        let parsed = std::panic::catch_unwind(|| Program::compile(source));
        let program = match parsed {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                // The first line holds the message; the next ones draw a caret under it.
                let text = e.to_string();
                let first = text.lines().next().unwrap_or_default();
                let msg = first
                    .strip_prefix("ERROR: <input>:")
                    .map_or_else(|| first.to_string(), |rest| format!("at {rest}"));
                return Err(format!("expression does not parse: {msg}"));
            }
            Err(_) => return Err("expression does not parse (the CEL parser failed)".into()),
        };
        let mut vars = std::collections::BTreeSet::new();
        free_vars(program.expression(), &mut Vec::new(), &mut vars);
        let unknown: Vec<String> = vars
            .into_iter()
            .filter(|v| !VARIABLES.contains(&v.as_str()))
            .collect();
        if !unknown.is_empty() {
            return Err(format!(
                "unknown variable {}; expressions see {}",
                unknown
                    .iter()
                    .map(|u| format!("`{u}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
                VARIABLES.join(", ")
            ));
        }
        let mut fields = Vec::new();
        let mut whole = false;
        value_fields(program.expression(), &mut fields, &mut whole);
        Ok(Expr {
            source: source.to_string(),
            program: Arc::new(program),
            value_fields: (!whole).then_some(fields),
        })
    }

    /// The source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluate against a record's bindings.
    ///
    /// # Errors
    /// The CEL runtime error as a sentence naming the expression.
    pub fn eval(&self, b: &Bindings<'_>) -> Result<Value, String> {
        let ctx = b.context()?;
        // Defence in depth: an interpreter panic on some odd value refuses the record
        // instead of taking the process down.
        let run = std::panic::AssertUnwindSafe(|| self.program.execute(ctx));
        match std::panic::catch_unwind(run) {
            Ok(r) => r.map_err(|e| format!("expression `{}` failed: {e}", self.source)),
            Err(_) => Err(format!(
                "expression `{}` failed: the CEL interpreter panicked",
                self.source
            )),
        }
    }
}

/// Collect the variables `e` uses that no enclosing comprehension (`exists(x, ...)`,
/// `map(x, ...)`, ...) binds.
fn free_vars(
    e: &cel::common::ast::IdedExpr,
    bound: &mut Vec<String>,
    out: &mut std::collections::BTreeSet<String>,
) {
    use cel::common::ast::{EntryExpr, Expr as E};
    match &e.expr {
        E::Ident(n) => {
            if !bound.iter().any(|b| b == n) {
                out.insert(n.clone());
            }
        }
        E::Select(sel) => free_vars(&sel.operand, bound, out),
        E::Call(c) => {
            if let Some(t) = &c.target {
                free_vars(t, bound, out);
            }
            for a in &c.args {
                free_vars(a, bound, out);
            }
        }
        E::Comprehension(c) => {
            free_vars(&c.iter_range, bound, out);
            free_vars(&c.accu_init, bound, out);
            let n = bound.len();
            bound.push(c.iter_var.clone());
            bound.extend(c.iter_var2.iter().cloned());
            bound.push(c.accu_var.clone());
            for x in [&c.loop_cond, &c.loop_step, &c.result] {
                free_vars(x, bound, out);
            }
            bound.truncate(n);
        }
        E::List(l) => l.elements.iter().for_each(|x| free_vars(x, bound, out)),
        E::Map(m) => {
            for en in &m.entries {
                if let EntryExpr::MapEntry(me) = &en.expr {
                    free_vars(&me.key, bound, out);
                    free_vars(&me.value, bound, out);
                }
            }
        }
        E::Struct(st) => {
            for en in &st.entries {
                match &en.expr {
                    EntryExpr::StructField(f) => free_vars(&f.value, bound, out),
                    EntryExpr::MapEntry(me) => {
                        free_vars(&me.key, bound, out);
                        free_vars(&me.value, bound, out);
                    }
                }
            }
        }
        E::Literal(_) | E::Unspecified => {}
    }
}

impl fmt::Debug for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Expr({:?})", self.source)
    }
}

impl PartialEq for Expr {
    fn eq(&self, o: &Self) -> bool {
        self.source == o.source
    }
}
impl Eq for Expr {}

/// A record's variables for expressions, converted once per record however many
/// expressions a stage evaluates.
pub struct Bindings<'r> {
    record: &'r Record,
    fields: Option<Arc<[String]>>,
    ctx: OnceLock<Result<Context<'static, 'static>, String>>,
}

impl<'r> Bindings<'r> {
    /// Bindings of `record`; its decoded JSON ([`Record::json`]) is `value` when present,
    /// else the raw value bytes.
    pub fn new(record: &'r Record) -> Self {
        Bindings {
            record,
            fields: None,
            ctx: OnceLock::new(),
        }
    }

    /// Bindings that convert only these top-level fields of a JSON object value (see
    /// [`projection`]): every expression evaluated with them must read no other. With
    /// `fields`, a record whose tree is not decoded yet has its value bytes read as JSON,
    /// decoding only those fields (pass `None` for a non-JSON source).
    pub fn projected(record: &'r Record, fields: Option<Arc<[String]>>) -> Self {
        Bindings {
            record,
            fields,
            ctx: OnceLock::new(),
        }
    }

    /// The record.
    pub fn record(&self) -> &Record {
        self.record
    }

    fn context(&self) -> Result<&Context<'static, 'static>, String> {
        self.ctx
            .get_or_init(|| self.build_context())
            .as_ref()
            .map_err(Clone::clone)
    }

    fn build_context(&self) -> Result<Context<'static, 'static>, String> {
        {
            let r = self.record;
            let mut ctx = Context::with_env(env());
            let value = match (&r.json, &r.value) {
                (None, Some(bytes)) if self.fields.is_some() => {
                    let fields = self.fields.as_deref().unwrap_or_default();
                    pick_fields(bytes, fields)?
                }
                (Some(serde_json::Value::Object(o)), _) if self.fields.is_some() => {
                    let fields = self.fields.as_deref().unwrap_or_default();
                    Value::Map(Map {
                        map: Arc::new(
                            fields
                                .iter()
                                .filter_map(|f| {
                                    o.get(f)
                                        .map(|v| (Key::String(Arc::new(f.clone())), json_to_cel(v)))
                                })
                                .collect(),
                        ),
                    })
                }
                (Some(j), _) => json_to_cel(j),
                (None, Some(v)) => Value::Bytes(Arc::new(v.to_vec())),
                (None, None) => Value::Null,
            };
            ctx.add_variable_from_value("value", value);
            ctx.add_variable_from_value("key", raw_to_cel(r.key.as_deref()));
            let mut hs: HashMap<Key, Value> = HashMap::new();
            for (k, v) in &r.headers {
                hs.entry(Key::String(Arc::new(k.clone())))
                    .or_insert_with(|| raw_to_cel(v.as_deref()));
            }
            ctx.add_variable_from_value("headers", Value::Map(Map { map: Arc::new(hs) }));
            ctx.add_variable_from_value(
                "topic",
                Value::String(Arc::new(r.source.topic.to_string())),
            );
            ctx.add_variable_from_value("partition", Value::Int(r.source.partition as i64));
            ctx.add_variable_from_value("offset", Value::Int(r.source.offset));
            ctx.add_variable_from_value("timestamp", r.timestamp.map_or(Value::Null, Value::Int));
            Ok(ctx)
        }
    }
}

/// Read JSON `bytes` converting only the top-level `fields` of an object (the rest is
/// skipped without building it); any other JSON value is converted whole.
fn pick_fields(bytes: &[u8], fields: &[String]) -> Result<Value, String> {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    struct Pick<'a>(&'a [String]);
    // `None`: the value is not an object.
    type Picked = Option<HashMap<Key, Value>>;
    impl<'de> Visitor<'de> for Pick<'_> {
        type Value = Picked;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Picked, A::Error> {
            let mut out = HashMap::with_capacity(self.0.len());
            while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if self.0.iter().any(|f| *f == *k) {
                    let v: serde_json::Value = map.next_value()?;
                    out.insert(Key::String(Arc::new(k.into_owned())), json_to_cel(&v));
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(Some(out))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Picked, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(None)
        }
        fn visit_bool<E>(self, _: bool) -> Result<Picked, E> {
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Picked, E> {
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Picked, E> {
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Picked, E> {
            Ok(None)
        }
        fn visit_str<E>(self, _: &str) -> Result<Picked, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Picked, E> {
            Ok(None)
        }
    }
    impl<'de> DeserializeSeed<'de> for Pick<'_> {
        type Value = Picked;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Picked, D::Error> {
            d.deserialize_any(self)
        }
    }
    let bad = |e: serde_json::Error| format!("value is not valid JSON: {e}");
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let picked = Pick(fields).deserialize(&mut de).map_err(bad)?;
    de.end().map_err(bad)?;
    match picked {
        Some(map) => Ok(Value::Map(Map { map: Arc::new(map) })),
        None => {
            let v: serde_json::Value = serde_json::from_slice(bytes).map_err(bad)?;
            Ok(json_to_cel(&v))
        }
    }
}

fn raw_to_cel(b: Option<&[u8]>) -> Value {
    match b {
        None => Value::Null,
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) => Value::String(Arc::new(s.to_string())),
            Err(_) => Value::Bytes(Arc::new(b.to_vec())),
        },
    }
}

/// Convert a JSON value to CEL: objects to maps with string keys, integers to `int` (or
/// `uint` past `i64`), other numbers to `double`.
pub fn json_to_cel(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::Null,
        J::Bool(b) => Value::Bool(*b),
        J::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::Int(i)
            } else if let Some(u) = n.as_u64() {
                Value::UInt(u)
            } else {
                Value::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        J::String(s) => Value::String(Arc::new(s.clone())),
        J::Array(a) => Value::List(Arc::new(a.iter().map(json_to_cel).collect())),
        J::Object(o) => Value::Map(Map {
            map: Arc::new(
                o.iter()
                    .map(|(k, v)| (Key::String(Arc::new(k.clone())), json_to_cel(v)))
                    .collect(),
            ),
        }),
    }
}

fn type_name(v: &Value) -> String {
    v.type_of().to_string()
}

/// Convert a CEL result to JSON.
///
/// # Errors
/// For values JSON cannot hold: bytes, durations, timestamps, functions, a float that is
/// NaN or infinite.
pub fn cel_to_json(v: &Value) -> Result<serde_json::Value, String> {
    use serde_json::Value as J;
    Ok(match v {
        Value::Null => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::UInt(u) => J::from(*u),
        Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(J::Number)
            .ok_or_else(|| format!("the result {f} is not a finite number"))?,
        Value::String(s) => J::String(s.to_string()),
        Value::List(l) => J::Array(l.iter().map(cel_to_json).collect::<Result<_, _>>()?),
        Value::Map(m) => {
            let mut o = serde_json::Map::new();
            // Sorted, so one input always gives the same bytes.
            let mut entries: Vec<_> = m.map.iter().collect();
            entries.sort_by_key(|(k, _)| key_text(k));
            for (k, v) in entries {
                o.insert(key_text(k), cel_to_json(v)?);
            }
            J::Object(o)
        }
        other => {
            return Err(format!(
                "the result is of type {}, which JSON cannot hold",
                type_name(other)
            ))
        }
    })
}

fn key_text(k: &Key) -> String {
    match k {
        Key::Int(i) => i.to_string(),
        Key::Uint(u) => u.to_string(),
        Key::Bool(b) => b.to_string(),
        Key::String(s) => s.to_string(),
    }
}

/// A record function of the builder API: a closure over the record (its decoded JSON is in
/// [`Record::json`] for a JSON source) giving a `T` or a reason the record is refused.
pub type RecordFn<T> = Arc<dyn Fn(&Record) -> Result<T, String> + Send + Sync>;

/// What a stage computes from a record: a CEL expression (topology files) or a closure
/// (builder API).
pub enum Func<T> {
    /// A parsed CEL expression.
    Expr(Expr),
    /// A Rust closure.
    Native(RecordFn<T>),
}

impl<T> Clone for Func<T> {
    fn clone(&self) -> Self {
        match self {
            Func::Expr(e) => Func::Expr(e.clone()),
            Func::Native(f) => Func::Native(f.clone()),
        }
    }
}

impl<T> fmt::Debug for Func<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Func::Expr(e) => write!(f, "{e:?}"),
            Func::Native(_) => f.write_str("<closure>"),
        }
    }
}

impl<T> PartialEq for Func<T> {
    fn eq(&self, o: &Self) -> bool {
        match (self, o) {
            (Func::Expr(a), Func::Expr(b)) => a == b,
            (Func::Native(a), Func::Native(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}
impl<T> Eq for Func<T> {}

impl<T: FromCel> Func<T> {
    /// A closure as a function.
    pub fn native(f: impl Fn(&Record) -> Result<T, String> + Send + Sync + 'static) -> Self {
        Func::Native(Arc::new(f))
    }

    /// Parse a CEL expression as a function.
    ///
    /// # Errors
    /// As [`Expr::parse`].
    pub fn expr(source: &str) -> Result<Self, String> {
        Expr::parse(source).map(Func::Expr)
    }

    /// The expression, if this is one.
    pub fn as_expr(&self) -> Option<&Expr> {
        match self {
            Func::Expr(e) => Some(e),
            Func::Native(_) => None,
        }
    }

    /// For descriptions: the expression text, or `<closure>`.
    pub fn describe(&self) -> String {
        match self {
            Func::Expr(e) => e.source().to_string(),
            Func::Native(_) => "<closure>".into(),
        }
    }

    /// Evaluate on a record.
    ///
    /// # Errors
    /// The expression failed, the result has the wrong type, or the closure refused.
    pub fn eval(&self, b: &Bindings<'_>) -> Result<T, String> {
        match self {
            Func::Expr(e) => {
                let v = e.eval(b)?;
                T::from_cel(&v).map_err(|why| format!("expression `{}`: {why}", e.source()))
            }
            Func::Native(f) => f(b.record()),
        }
    }
}

/// Conversion of a CEL result to what a stage needs.
pub trait FromCel: Sized {
    /// Convert, or say why not.
    ///
    /// # Errors
    /// A sentence naming the type found.
    fn from_cel(v: &Value) -> Result<Self, String>;
}

impl FromCel for bool {
    fn from_cel(v: &Value) -> Result<bool, String> {
        match v {
            Value::Bool(b) => Ok(*b),
            other => Err(format!("gave {}, expected a bool", type_name(other))),
        }
    }
}

impl FromCel for serde_json::Value {
    fn from_cel(v: &Value) -> Result<Self, String> {
        cel_to_json(v)
    }
}

/// Bytes for a key or header: a string as its UTF-8 bytes, bytes as they are, a number as
/// its decimal text, a bool as `true`/`false`; `null` gives no bytes (a null key).
impl FromCel for Option<Bytes> {
    fn from_cel(v: &Value) -> Result<Self, String> {
        Ok(Some(Bytes::from(match v {
            Value::Null => return Ok(None),
            Value::String(s) => s.as_bytes().to_vec(),
            Value::Bytes(b) => b.to_vec(),
            Value::Int(i) => i.to_string().into_bytes(),
            Value::UInt(u) => u.to_string().into_bytes(),
            Value::Float(f) => f.to_string().into_bytes(),
            Value::Bool(b) => b.to_string().into_bytes(),
            other => {
                return Err(format!(
                    "gave {}, expected a string, bytes, a number or null",
                    type_name(other)
                ))
            }
        })))
    }
}

/// A predicate: keeps or routes a record.
pub type Predicate = Func<bool>;
/// A computed JSON field.
pub type Computed = Func<serde_json::Value>;
/// A computed key or header value.
pub type BytesFn = Func<Option<Bytes>>;

/// Make sure `record.json` holds the decoded value when the source is JSON (a stage after
/// the source that needs the whole tree decodes it once).
///
/// # Errors
/// The value is not valid JSON.
pub fn ensure_json(record: &mut Record) -> Result<(), String> {
    if record.json.is_none() {
        if let Some(v) = &record.value {
            record.json = Some(
                serde_json::from_slice(v).map_err(|e| format!("value is not valid JSON: {e}"))?,
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::SourceMeta;

    fn rec(value: &str) -> Record {
        Record {
            key: Some(Bytes::from_static(b"k1")),
            value: Some(Bytes::from(value.to_string())),
            headers: vec![
                ("h".into(), Some(Bytes::from_static(b"v"))),
                ("bin".into(), Some(Bytes::from_static(&[0xff, 0x00]))),
                ("h".into(), Some(Bytes::from_static(b"second"))),
            ],
            timestamp: Some(1000),
            json: Some(serde_json::from_str(value).unwrap()),
            fields: None,
            source: SourceMeta {
                topic: "in".into(),
                partition: 2,
                offset: 7,
            },
        }
    }

    #[test]
    fn sees_every_variable() {
        let r = rec(r#"{"a":{"b":[1,2,3]},"s":"x"}"#);
        let b = Bindings::new(&r);
        let cases = [
            ("value.a.b[1] == 2", true),
            ("key == 'k1'", true),
            ("headers.h == 'v'", true),
            ("headers['bin'] == b'\\xff\\x00'", true),
            ("topic == 'in' && partition == 2 && offset == 7", true),
            ("timestamp == 1000", true),
            ("has(value.zz)", false),
            ("value.a.b.exists(x, x > 2)", true),
            ("value.a.b.map(y, y * 2).filter(z, z > 2).size() == 2", true),
            ("value.a.b.all(x, value.a.b.exists(w, w >= x))", true),
        ];
        for (src, want) in cases {
            let p = Predicate::expr(src).unwrap();
            assert_eq!(p.eval(&b), Ok(want), "{src}");
        }
    }

    #[test]
    fn runtime_failures_are_errors() {
        let r = rec(r#"{"n":1,"s":"x"}"#);
        let b = Bindings::new(&r);
        let e = Predicate::expr("value.missing == 1")
            .unwrap()
            .eval(&b)
            .unwrap_err();
        assert_eq!(
            e,
            "expression `value.missing == 1` failed: No such key: missing"
        );
        let e = Predicate::expr("value.n").unwrap().eval(&b).unwrap_err();
        assert_eq!(e, "expression `value.n`: gave int, expected a bool");
        assert!(Predicate::expr("value.n + value.s == 2")
            .unwrap()
            .eval(&b)
            .is_err());
    }

    #[test]
    fn parse_errors_and_unknown_variables() {
        assert!(Expr::parse("value.a ==")
            .unwrap_err()
            .starts_with("expression does not parse"));
        assert_eq!(
            Expr::parse("vale.a == 1").unwrap_err(),
            "unknown variable `vale`; expressions see value, key, headers, topic, partition, offset, timestamp"
        );
        assert_eq!(Expr::parse("  ").unwrap_err(), "expression is empty");
        // A comprehension binds its variable only inside it.
        assert_eq!(
            Expr::parse("value.l.exists(x, x > 1) && x == 2").unwrap_err(),
            "unknown variable `x`; expressions see value, key, headers, topic, partition, offset, timestamp"
        );
        assert_eq!(
            Expr::parse(&"(".repeat(5000)).unwrap_err(),
            "expression is 5000 bytes long, at most 4096"
        );
        assert_eq!(
            Expr::parse(&format!("{}1{}", "(".repeat(40), ")".repeat(40))).unwrap_err(),
            "expression nests brackets deeper than 32 levels"
        );
        // Long chains of unary and binary operators stay within the parser's stack.
        let _ = Expr::parse(&format!("{}true", "!".repeat(250)));
        assert!(Expr::parse(&format!("{}value", "-".repeat(250))).is_ok());
        assert!(Expr::parse(&vec!["value.a"; 120].join(" + ")).is_ok());
    }

    #[test]
    fn projection_converts_only_the_fields_read() {
        let f = |src: &str| Expr::parse(src).unwrap().value_fields;
        assert_eq!(
            f("value.a.b == 1 && has(value.c)"),
            Some(vec!["a".into(), "c".into()])
        );
        assert_eq!(
            f("value['x y'] == 1 && key == 'k'"),
            Some(vec!["x y".into()])
        );
        assert_eq!(
            f("value.l.exists(v, v > value.m)"),
            Some(vec!["l".into(), "m".into()])
        );
        assert_eq!(f("size(value) > 1"), None);
        assert_eq!(f("value == {}"), None);
        let r = rec(r#"{"a":{"b":1},"c":2,"big":[1,2,3]}"#);
        let exprs = [
            Expr::parse("value.a.b == 1").unwrap(),
            Expr::parse("has(value.c)").unwrap(),
        ];
        let p = projection(exprs.iter());
        assert_eq!(p.as_deref(), Some(&["a".to_string(), "c".to_string()][..]));
        let b = Bindings::projected(&r, p);
        for e in &exprs {
            assert_eq!(e.eval(&b).unwrap(), Value::Bool(true));
        }
        // From the bytes, without a decoded tree: the same answers.
        let mut raw = r.clone();
        raw.json = None;
        let b = Bindings::projected(&raw, projection(exprs.iter()));
        for e in &exprs {
            assert_eq!(e.eval(&b).unwrap(), Value::Bool(true));
        }
        let e = Expr::parse("value.big[2] == 3 && !has(value.zz)").unwrap();
        assert_eq!(
            e.eval(&Bindings::projected(&raw, projection([&e])))
                .unwrap(),
            Value::Bool(true)
        );
        raw.value = Some(Bytes::from_static(b"[1,2]"));
        assert_eq!(
            e.eval(&Bindings::projected(&raw, projection([&e]))).unwrap_err(),
            "expression `value.big[2] == 3 && !has(value.zz)` failed: found no matching overload for '_._' applied to '(list, string)'"
        );
        raw.value = Some(Bytes::from_static(b"{\"big\": [1,2,3]} x"));
        assert!(e
            .eval(&Bindings::projected(&raw, projection([&e])))
            .unwrap_err()
            .starts_with("value is not valid JSON: trailing characters"));
        let e = Expr::parse("has(value.big)").unwrap();
        assert_eq!(
            e.eval(&Bindings::projected(&r, projection([&e]))).unwrap(),
            Value::Bool(true)
        );
    }

    #[test]
    fn conversions() {
        let r = rec(r#"{"n":1.5,"m":{"b":1,"a":[true,null]}}"#);
        let b = Bindings::new(&r);
        let c = Computed::expr("value.m").unwrap();
        assert_eq!(
            c.eval(&b).unwrap().to_string(),
            r#"{"a":[true,null],"b":1}"#
        );
        let k = BytesFn::expr("value.n * 2.0").unwrap();
        assert_eq!(k.eval(&b).unwrap(), Some(Bytes::from_static(b"3")));
        let k = BytesFn::expr("value.m").unwrap();
        assert_eq!(
            k.eval(&b).unwrap_err(),
            "expression `value.m`: gave map, expected a string, bytes, a number or null"
        );
    }
}
