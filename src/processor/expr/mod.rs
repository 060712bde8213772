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
pub(crate) const VARIABLES: [&str; 7] = [
    "value",
    "key",
    "headers",
    "topic",
    "partition",
    "offset",
    "timestamp",
];

/// Longest expression accepted, in bytes.
pub(crate) const MAX_EXPR_LEN: usize = 4096;
/// Deepest bracket nesting accepted in an expression.
pub(crate) const MAX_EXPR_NESTING: usize = 32;
/// Most operator characters accepted in an expression (each may add a parser level).
pub(crate) const MAX_EXPR_OPERATORS: usize = 256;

fn env() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| Arc::new(Env::stdlib())).clone()
}

/// A parsed CEL expression and its source text.
#[derive(Clone)]
pub(crate) struct Expr {
    source: String,
    program: Arc<Program>,
    /// The top-level fields of `value` it reads (`value.a`, `value["a"]`), or `None` when
    /// it uses `value` as a whole: only those fields are converted for it.
    value_fields: Option<Vec<String>>,
}

/// The expressions inside a list, map or struct literal, in order (a map entry's key
/// before its value); none for any other expression.
fn literal_parts(e: &cel::common::ast::Expr) -> Vec<&cel::common::ast::IdedExpr> {
    use cel::common::ast::{EntryExpr, Expr as E};
    fn entry(en: &EntryExpr) -> Vec<&cel::common::ast::IdedExpr> {
        match en {
            EntryExpr::StructField(f) => vec![&f.value],
            EntryExpr::MapEntry(me) => vec![&me.key, &me.value],
        }
    }
    match e {
        E::List(l) => l.elements.iter().collect(),
        // A map literal holds only map entries.
        E::Map(m) => m
            .entries
            .iter()
            .flat_map(|en| match &en.expr {
                EntryExpr::MapEntry(_) => entry(&en.expr),
                EntryExpr::StructField(_) => Vec::new(),
            })
            .collect(),
        E::Struct(st) => st.entries.iter().flat_map(|en| entry(&en.expr)).collect(),
        _ => Vec::new(),
    }
}

/// Collect the top-level fields of `value` that `e` reads; `whole` is set when `value` is
/// used in any other way (passed to a function, iterated, compared).
fn value_fields(e: &cel::common::ast::IdedExpr, out: &mut Vec<String>, whole: &mut bool) {
    use cel::common::ast::{Expr as E, LiteralValue};
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
        E::List(_) | E::Map(_) | E::Struct(_) => literal_parts(&e.expr)
            .into_iter()
            .for_each(|x| value_fields(x, out, whole)),
        E::Literal(_) | E::Unspecified => {}
    }
}

/// How a stage with these functions binds `value`: the projection its expressions allow
/// (`None` for a non-JSON source or when one needs the whole value), and whether the stage
/// must decode the whole JSON tree first (closures read [`Record::json`]; a whole-value
/// expression needs it).
pub(crate) fn plan<'a, T: FromCel + 'a>(
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
pub(crate) fn projection<'a>(exprs: impl IntoIterator<Item = &'a Expr>) -> Option<Arc<[String]>> {
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
    pub(crate) fn parse(source: &str) -> Result<Expr, String> {
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
    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    /// Evaluate against a record's bindings.
    ///
    /// # Errors
    /// The CEL runtime error as a sentence naming the expression.
    pub(crate) fn eval(&self, b: &Bindings<'_>) -> Result<Value, String> {
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
    use cel::common::ast::Expr as E;
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
        E::List(_) | E::Map(_) | E::Struct(_) => literal_parts(&e.expr)
            .into_iter()
            .for_each(|x| free_vars(x, bound, out)),
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

mod bindings;
mod func;
pub(crate) use bindings::*;
pub(crate) use func::*;

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(value: &str) -> Record {
        let headers: [(&str, &[u8]); 3] = [("h", b"v"), ("bin", &[0xff, 0x00]), ("h", b"second")];
        Record {
            json: Some(serde_json::from_str(value).unwrap()),
            ..Record::for_test(b"k1", value, &headers, ("in", 2, 7), 1000)
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
        assert_eq!(k.eval(&b).unwrap(), Some(Bytes::from_static(b"3.0")));
        let k = BytesFn::expr("value.m").unwrap();
        assert_eq!(
            k.eval(&b).unwrap_err(),
            "expression `value.m`: gave map, expected a string, bytes, a number or null"
        );
    }
}
