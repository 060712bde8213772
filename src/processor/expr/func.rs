//! What a stage computes from a record: a CEL expression or a closure, and the result
//! types a [`Func`] can give.

use super::*;

/// A record function of the builder API: a closure over the record (its decoded JSON is in
/// [`Record::json`] for a JSON source) giving a `T` or a reason the record is refused.
pub(crate) type RecordFn<T> = Arc<dyn Fn(&Record) -> Result<T, String> + Send + Sync>;

/// What a stage computes from a record: a CEL expression (topology files) or a closure
/// (builder API).
pub(crate) enum Func<T> {
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
    pub(crate) fn native(f: impl Fn(&Record) -> Result<T, String> + Send + Sync + 'static) -> Self {
        Func::Native(Arc::new(f))
    }

    /// Parse a CEL expression as a function.
    ///
    /// # Errors
    /// As [`Expr::parse`].
    pub(crate) fn expr(source: &str) -> Result<Self, String> {
        Expr::parse(source).map(Func::Expr)
    }

    /// The expression, if this is one.
    pub(crate) fn as_expr(&self) -> Option<&Expr> {
        match self {
            Func::Expr(e) => Some(e),
            Func::Native(_) => None,
        }
    }

    /// For descriptions: the expression text, or `<closure>`.
    pub(crate) fn describe(&self) -> String {
        match self {
            Func::Expr(e) => e.source().to_string(),
            Func::Native(_) => "<closure>".into(),
        }
    }

    /// Evaluate on a record.
    ///
    /// # Errors
    /// The expression failed, the result has the wrong type, or the closure refused.
    pub(crate) fn eval(&self, b: &Bindings<'_>) -> Result<T, String> {
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
pub(crate) trait FromCel: Sized {
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
            Value::Float(f) => double_text(*f)?.into_bytes(),
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

/// The text of a double for a key or header, as a dedup key writes a number a stage held
/// as `f64` (`1.0` stays `1.0`, so it is not the int `1`).
///
/// # Errors
/// NaN or an infinity (no number text), or an integral double past 2^53: an integer beyond
/// 64 bits read from JSON, whose digits are gone, so two ids would give one key.
fn double_text(f: f64) -> Result<String, String> {
    if crate::processor::key::digits_lost(f) {
        return Err(format!(
            "gave the double {f:e}, an integer past 2^53 (an integer beyond 64 bits read from JSON is one): its digits are lost; send the id as a string"
        ));
    }
    serde_json::Number::from_f64(f)
        .map(|n| n.to_string())
        .ok_or_else(|| format!("gave the double {f}, which has no number text"))
}

/// A predicate: keeps or routes a record.
pub(crate) type Predicate = Func<bool>;
/// A computed JSON field.
pub(crate) type Computed = Func<serde_json::Value>;
/// A computed key or header value.
pub(crate) type BytesFn = Func<Option<Bytes>>;

/// Make sure `record.json` holds the decoded value when the source is JSON (a stage after
/// the source that needs the whole tree decodes it once).
///
/// # Errors
/// The value is not valid JSON.
pub(crate) fn ensure_json(record: &mut Record) -> Result<(), String> {
    if record.json.is_none() {
        if let Some(v) = &record.value {
            record.json = Some(
                serde_json::from_slice(v).map_err(|e| format!("value is not valid JSON: {e}"))?,
            );
        }
    }
    Ok(())
}
