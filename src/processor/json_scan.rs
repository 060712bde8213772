//! One pass over a JSON value that validates all of it and picks out the values at a few
//! JSON pointers, without building a tree: the source's decode step for topologies whose
//! stages only read fields by pointer (a dedup key), at a fraction of the cost of
//! `serde_json::Value` (no allocation but the picked strings).

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// The value found at a pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scalar {
    /// No such field.
    Missing,
    /// JSON null.
    Null,
    /// A string.
    Str(String),
    /// A number, as `serde_json::Number` prints it.
    Num(String),
    /// A boolean, array or object (named for error messages).
    Other(&'static str),
}

/// Split an RFC 6901 pointer into unescaped tokens (`""` is the whole document).
pub fn tokens(pointer: &str) -> Vec<String> {
    if pointer.is_empty() {
        return Vec::new();
    }
    pointer
        .split('/')
        .skip(1)
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect()
}

/// Validate `bytes` as one JSON value and return the value at each of `pointers`
/// (tokenized with [`tokens`]), in order.
///
/// # Errors
/// The `serde_json` syntax error, with its line and column, when `bytes` is not JSON.
pub fn scan(bytes: &[u8], pointers: &[Vec<String>]) -> Result<Vec<Scalar>, serde_json::Error> {
    let mut found = vec![Scalar::Missing; pointers.len()];
    let paths: Vec<(usize, &[String])> = pointers
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.as_slice()))
        .collect();
    let mut de = serde_json::Deserializer::from_slice(bytes);
    Walk {
        paths: &paths,
        found: &mut found,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok(found)
}

/// Walks one value; `paths` are the pointers (rest of their tokens) that lead into it.
struct Walk<'a, 'p> {
    paths: &'a [(usize, &'p [String])],
    found: &'a mut [Scalar],
}

impl<'de> DeserializeSeed<'de> for Walk<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.paths.is_empty() {
            d.deserialize_ignored_any(IgnoredAny)?;
            return Ok(());
        }
        d.deserialize_any(self)
    }
}

impl Walk<'_, '_> {
    fn set(&mut self, v: Scalar) {
        for (i, rest) in self.paths {
            if rest.is_empty() {
                self.found[*i] = v.clone();
            }
        }
    }
}

/// An object key, borrowed from the input unless it holds escapes (serde's own
/// `Cow<str>` always allocates).
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = std::borrow::Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(KeySeed)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = std::borrow::Cow<'de, str>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v))
    }
}

impl<'de> Visitor<'de> for Walk<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(mut self, _: bool) -> Result<(), E> {
        self.set(Scalar::Other("a boolean"));
        Ok(())
    }
    fn visit_i64<E>(mut self, v: i64) -> Result<(), E> {
        self.set(Scalar::Num(v.to_string()));
        Ok(())
    }
    fn visit_u64<E>(mut self, v: u64) -> Result<(), E> {
        self.set(Scalar::Num(v.to_string()));
        Ok(())
    }
    fn visit_f64<E>(mut self, v: f64) -> Result<(), E> {
        let text = serde_json::Number::from_f64(v)
            .map(|n| n.to_string())
            .unwrap_or_default();
        self.set(Scalar::Num(text));
        Ok(())
    }
    fn visit_str<E>(mut self, v: &str) -> Result<(), E> {
        self.set(Scalar::Str(v.to_string()));
        Ok(())
    }
    fn visit_unit<E>(mut self) -> Result<(), E> {
        self.set(Scalar::Null);
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.set(Scalar::Other("an object"));
        let mut sub: Vec<(usize, &[String])> = Vec::new();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            sub.clear();
            for (i, rest) in self.paths {
                if let Some((first, tail)) = rest.split_first() {
                    if *first == key {
                        sub.push((*i, tail));
                        // A repeated key: the last occurrence wins, as in serde_json::Value.
                        self.found[*i] = Scalar::Missing;
                    }
                }
            }
            map.next_value_seed(Walk {
                paths: &sub,
                found: self.found,
            })?;
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.set(Scalar::Other("an array"));
        let mut sub: Vec<(usize, &[String])> = Vec::new();
        let mut index = 0usize;
        loop {
            sub.clear();
            for (i, rest) in self.paths {
                if let Some((first, tail)) = rest.split_first() {
                    if first.parse::<usize>().ok() == Some(index)
                        && (first == "0" || !first.starts_with('0'))
                    {
                        sub.push((*i, tail));
                    }
                }
            }
            if seq
                .next_element_seed(Walk {
                    paths: &sub,
                    found: self.found,
                })?
                .is_none()
            {
                break;
            }
            index += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn via_value(bytes: &[u8], pointer: &str) -> Option<Scalar> {
        let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
        Some(match v.pointer(pointer) {
            None => Scalar::Missing,
            Some(serde_json::Value::Null) => Scalar::Null,
            Some(serde_json::Value::String(s)) => Scalar::Str(s.clone()),
            Some(serde_json::Value::Number(n)) => Scalar::Num(n.to_string()),
            Some(serde_json::Value::Bool(_)) => Scalar::Other("a boolean"),
            Some(serde_json::Value::Array(_)) => Scalar::Other("an array"),
            Some(serde_json::Value::Object(_)) => Scalar::Other("an object"),
        })
    }

    #[test]
    fn agrees_with_serde_json_value_pointer() {
        let docs = [
            r#"{"id":"2489368070","actor":{"id":9152315},"a/b":1,"m~n":2,"arr":[10,{"x":"y"}]}"#,
            r#"{"id":12.5}"#,
            r#"{"id":-3,"id":"last"}"#,
            r#"{"id":null}"#,
            r#"[1,2,3]"#,
            r#""just a string""#,
            r#"{"id":{"deep":[true]}}"#,
            r#"{"i\u0064":"escaped key","actor":{"\u0069d":7}}"#,
        ];
        let pointers = [
            "/id",
            "/actor/id",
            "/a~1b",
            "/m~0n",
            "/arr/1/x",
            "/arr/01",
            "/arr/0",
            "",
            "/nope",
            "/1",
        ];
        for d in docs {
            let toks: Vec<Vec<String>> = pointers.iter().map(|p| tokens(p)).collect();
            let got = scan(d.as_bytes(), &toks).unwrap();
            for (p, g) in pointers.iter().zip(got) {
                assert_eq!(Some(g), via_value(d.as_bytes(), p), "doc {d} pointer {p:?}");
            }
        }
    }

    #[test]
    fn rejects_what_serde_json_rejects_with_the_same_message() {
        for bad in [
            "not json",
            "{\"id\":1",
            "{\"id\":1} trailing",
            "",
            "\u{0}\u{ff}",
        ] {
            let ours = scan(bad.as_bytes(), &[tokens("/id")])
                .unwrap_err()
                .to_string();
            let theirs = serde_json::from_slice::<serde_json::Value>(bad.as_bytes())
                .unwrap_err()
                .to_string();
            assert_eq!(ours, theirs, "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn never_panics_and_agrees_on_validity(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let ours = scan(&bytes, &[tokens("/id")]).is_ok();
            let theirs = serde_json::from_slice::<serde_json::Value>(&bytes).is_ok();
            prop_assert_eq!(ours, theirs);
        }
    }
}
