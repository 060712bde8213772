//! A record's variables as CEL values, and CEL values back to JSON.

use super::*;

/// A record's variables for expressions, converted once per record however many
/// expressions a stage evaluates.
pub(crate) struct Bindings<'r> {
    record: &'r Record,
    fields: Option<Arc<[String]>>,
    ctx: OnceLock<Result<Context<'static, 'static>, String>>,
}

impl<'r> Bindings<'r> {
    #[cfg(test)]
    /// Bindings of `record`; its decoded JSON ([`Record::json`]) is `value` when present,
    /// else the raw value bytes.
    pub(crate) fn new(record: &'r Record) -> Self {
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
    pub(crate) fn projected(record: &'r Record, fields: Option<Arc<[String]>>) -> Self {
        Bindings {
            record,
            fields,
            ctx: OnceLock::new(),
        }
    }

    /// The record.
    pub(crate) fn record(&self) -> &Record {
        self.record
    }

    pub(super) fn context(&self) -> Result<&Context<'static, 'static>, String> {
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
                Value::String(Arc::new(r.origin().topic.to_string())),
            );
            ctx.add_variable_from_value("partition", Value::Int(r.origin().partition as i64));
            ctx.add_variable_from_value("offset", Value::Int(r.origin().offset));
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
pub(crate) fn json_to_cel(v: &serde_json::Value) -> Value {
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

pub(super) fn type_name(v: &Value) -> String {
    v.type_of().to_string()
}

/// Convert a CEL result to JSON.
///
/// # Errors
/// For values JSON cannot hold: bytes, durations, timestamps, functions, a float that is
/// NaN or infinite.
pub(crate) fn cel_to_json(v: &Value) -> Result<serde_json::Value, String> {
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
                let text = key_text(k);
                // `1` and `"1"` are two CEL keys but one JSON name: refused, not merged.
                if o.insert(text.clone(), cel_to_json(v)?).is_some() {
                    return Err(format!(
                        "the result map has two keys written {text:?} in JSON (e.g. 1 and \"1\"); JSON holds one"
                    ));
                }
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
