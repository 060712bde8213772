//! One pass over a JSON value that validates all of it and picks out the values at a few
//! JSON pointers, without building a tree: the source's decode step for topologies whose
//! stages only read fields by pointer (a dedup key), at a fraction of the cost of
//! `serde_json::Value` (no allocation but the picked strings).
//!
//! Numbers are picked as their exact text: an integer that fits 64 bits is read as one
//! (its text is the only way to write it), any other number (beyond 64 bits, a fraction,
//! an exponent, `-0`) is read again from the bytes as written, so two numbers that round
//! to the same `f64` (2^64 and 2^64 + 1) never give the same text.

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// The value found at a pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scalar {
    /// No such field.
    Missing,
    /// JSON null.
    Null,
    /// A string.
    Str(String),
    /// A number, its exact text as written (`1.0` stays `1.0`, `18446744073709551617`
    /// stays itself).
    Num(String),
    /// A boolean, array or object (named for error messages).
    Other(&'static str),
}

/// Split an RFC 6901 pointer into unescaped tokens (`""` is the whole document).
pub(crate) fn tokens(pointer: &str) -> Vec<String> {
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
pub(crate) fn scan(
    bytes: &[u8],
    pointers: &[Vec<String>],
) -> Result<Vec<Scalar>, serde_json::Error> {
    let mut found = vec![Scalar::Missing; pointers.len()];
    let paths: Vec<(usize, &[String])> = pointers
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.as_slice()))
        .collect();
    walk(bytes, &paths, &mut found, false)?;
    // Numbers that did not come as 64-bit integers were marked with an empty text: read
    // their exact text in a second pass over the (now known valid) bytes, for those
    // pointers only.
    if found
        .iter()
        .any(|f| matches!(f, Scalar::Num(t) if t.is_empty()))
    {
        let lossy: Vec<(usize, &[String])> = paths
            .iter()
            .filter(|(i, _)| matches!(&found[*i], Scalar::Num(t) if t.is_empty()))
            .copied()
            .collect();
        let mut exact = vec![Scalar::Missing; pointers.len()];
        walk(bytes, &lossy, &mut exact, true)?;
        for (i, _) in lossy {
            found[i] = std::mem::replace(&mut exact[i], Scalar::Missing);
        }
    }
    Ok(found)
}

/// One pass of [`Walk`] over `bytes`, which must hold one JSON value and nothing after it.
fn walk(
    bytes: &[u8],
    paths: &[(usize, &[String])],
    found: &mut [Scalar],
    raw: bool,
) -> Result<(), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    Walk { paths, found, raw }.deserialize(&mut de)?;
    de.end()
}

/// Walks one value; `paths` are the pointers (rest of their tokens) that lead into it.
/// With `raw`, a value where a pointer ends is read as its JSON text (numbers keep it).
struct Walk<'a, 'p> {
    paths: &'a [(usize, &'p [String])],
    found: &'a mut [Scalar],
    raw: bool,
}

impl<'de> DeserializeSeed<'de> for Walk<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(mut self, d: D) -> Result<(), D::Error> {
        if self.paths.is_empty() {
            d.deserialize_ignored_any(IgnoredAny)?;
            return Ok(());
        }
        if self.raw && self.paths.iter().any(|(_, rest)| rest.is_empty()) {
            use serde::de::Error as _;
            let raw = <&serde_json::value::RawValue as serde::Deserialize>::deserialize(d)?;
            let text = raw.get();
            if text.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
                self.set(Scalar::Num(text.to_string()));
            }
            // Pointers that go on into this value (an object or array): walk its text.
            let deeper: Vec<(usize, &[String])> = self
                .paths
                .iter()
                .filter(|(_, rest)| !rest.is_empty())
                .copied()
                .collect();
            if !deeper.is_empty() {
                let mut de = serde_json::Deserializer::from_str(text);
                Walk {
                    paths: &deeper,
                    found: self.found,
                    raw: true,
                }
                .deserialize(&mut de)
                .map_err(D::Error::custom)?;
            }
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
    fn visit_f64<E>(mut self, _: f64) -> Result<(), E> {
        // Not a 64-bit integer: its exact text is read by the raw pass (see `scan`).
        self.set(Scalar::Num(String::new()));
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
                raw: self.raw,
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
                    raw: self.raw,
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

    #[test]
    fn numbers_keep_their_exact_text() {
        for text in [
            "0",
            "-0",
            "9007199254740993",
            "9223372036854775808",
            "18446744073709551615",
            "18446744073709551616",
            "18446744073709551617",
            "-9223372036854775809",
            "123456789012345678901234567890",
            "1.0",
            "1.00",
            "1e0",
            "1E+2",
            "0.10000000000000001",
            "-2.5e-300",
        ] {
            let doc = format!(r#"{{"id":{text},"a":[{text},{{"b":{text}}}],"s":"x"}}"#);
            let ptrs = ["/id", "/a/0", "/a/1/b", "/s"].map(tokens);
            let got = scan(doc.as_bytes(), &ptrs).unwrap();
            let num = Scalar::Num(text.to_string());
            assert_eq!(
                got,
                vec![num.clone(), num.clone(), num, Scalar::Str("x".into())],
                "{doc}"
            );
        }
        // A pointer into an object next to one at the object itself, both past a big number.
        let doc = r#"{"o":{"n":18446744073709551617,"m":1.50},"o2":2}"#;
        let got = scan(
            doc.as_bytes(),
            &[tokens("/o"), tokens("/o/n"), tokens("/o/m")],
        )
        .unwrap();
        assert_eq!(
            got,
            vec![
                Scalar::Other("an object"),
                Scalar::Num("18446744073709551617".into()),
                Scalar::Num("1.50".into())
            ]
        );
        // Repeated keys: the last occurrence wins, whatever the number.
        let got = scan(br#"{"id":2,"id":1.50}"#, &[tokens("/id")]).unwrap();
        assert_eq!(got, vec![Scalar::Num("1.50".into())]);
        let got = scan(br#"{"id":1.50,"id":2}"#, &[tokens("/id")]).unwrap();
        assert_eq!(got, vec![Scalar::Num("2".into())]);
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
