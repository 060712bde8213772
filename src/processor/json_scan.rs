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
    // Most values take the byte-level pass alone; whatever it is unsure of (and every
    // error) is decided by the serde walk below.
    if let Some(found) = super::json_fast::scan(bytes, pointers) {
        return Ok(found);
    }
    serde_scan(bytes, pointers)
}

/// [`scan`] by the serde walk alone.
fn serde_scan(bytes: &[u8], pointers: &[Vec<String>]) -> Result<Vec<Scalar>, serde_json::Error> {
    let mut found = vec![Scalar::Missing; pointers.len()];
    let paths: Vec<(usize, &[String])> = pointers
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.as_slice()))
        .collect();
    if let Err(e) = walk(bytes, &paths, &mut found, false) {
        // serde parses a number where a pointer ends as f64 and refuses one beyond its
        // range (1e400, 400 digits), where the JSON grammar has no limit: read the values
        // at the pointers as their text instead (the raw walk reads every number so).
        if !e.to_string().contains("number out of range") {
            return Err(e);
        }
        found.fill(Scalar::Missing);
        walk(bytes, &paths, &mut found, true)?;
        return Ok(found);
    }
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
/// With `raw`, a value where a pointer ends is read as its JSON text when it is a number (its
/// exact text, whatever its size), else as without `raw`.
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
            } else {
                // Not a number: read as the plain walk reads it.
                let ending: Vec<(usize, &[String])> = self
                    .paths
                    .iter()
                    .filter(|(_, rest)| rest.is_empty())
                    .copied()
                    .collect();
                let mut de = serde_json::Deserializer::from_str(text);
                Walk {
                    paths: &ending,
                    found: self.found,
                    raw: false,
                }
                .deserialize(&mut de)
                .map_err(D::Error::custom)?;
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
                    if super::json_fast::index_matches(first, index) {
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
            // Beyond f64's range: serde refuses to parse them, the JSON grammar has no limit.
            "1e400",
            "-1.5E+400",
            &"9".repeat(400),
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

    /// A JSON value whose keys come from a few names the pointers below use.
    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "[a-z\"\\/é\n\t\u{1}\u{7f}\u{1F600}]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 5, |inner| {
            let key = prop_oneof![
                Just("id".to_string()),
                Just("a".to_string()),
                Just("0".to_string()),
                Just("a/b".to_string()),
                Just("q\"\n".to_string()),
                Just("é".to_string()),
            ];
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
                proptest::collection::vec((key, inner), 0..4)
                    .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    #[derive(Debug, Clone)]
    enum Edit {
        Insert(&'static str),
        Remove,
        Replace(u8),
    }

    const POINTERS: [&str; 10] = [
        "", "/id", "/a", "/a/id", "/0", "/a/0", "/a~1b", "/q\"\n", "/é", "/a/1/id",
    ];

    /// The fast path and the serde walk over `bytes`: if the fast path answers, the serde
    /// walk accepts the bytes and picks the same values. Returns whether it answered.
    fn agrees(bytes: &[u8]) -> Result<bool, TestCaseError> {
        let toks: Vec<Vec<String>> = POINTERS.iter().map(|p| tokens(p)).collect();
        match super::super::json_fast::scan(bytes, &toks) {
            None => Ok(false),
            Some(fast) => {
                let slow = serde_scan(bytes, &toks);
                prop_assert!(
                    slow.is_ok(),
                    "fast path accepted {:?}, serde refused: {:?}",
                    String::from_utf8_lossy(bytes),
                    slow
                );
                prop_assert_eq!(Some(fast), slow.ok());
                Ok(true)
            }
        }
    }

    #[test]
    fn fast_path_answers_for_plain_documents() {
        // `/id` twice: a value that ends two pointers goes to both.
        let toks: Vec<Vec<String>> = ["/id", "/actor/login", "/n/0", "/id"]
            .iter()
            .map(|p| tokens(p))
            .collect();
        for doc in [
            r#"{"id":"2489368070","actor":{"login":"plain é","x":[1,2.5e3,true,null,{}]},"n":[-7]}"#,
            " { \"id\" : 12 , \"n\" : [ 0 ] , \"s\":\"tab\\t\\\"q\\\"\" } ",
            r#"{"id":"a\"b\\c\/d\n","actor":{"login":null},"n":[[],"x"]}"#,
        ] {
            let fast = super::super::json_fast::scan(doc.as_bytes(), &toks);
            assert!(fast.is_some(), "{doc}");
            assert_eq!(fast, serde_scan(doc.as_bytes(), &toks).ok(), "{doc}");
        }
    }

    /// Not a timed test: prints ns per ~200-byte event for each path (run with
    /// `cargo test --release --lib scan_speed -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn scan_speed() {
        let doc = br#"{"id":"e-000123456","user":"user-01234","type":"PushEvent","ts":1796228746123,"payload":"Kq3ZpLmW9xT2vBnR8sYfGhJcDe4aU7iO1lMzQwEr5tXyNb6VkPjHgFdSaZxCvBnMqWeRtYuIoPlKjHgFdSa0123456789abcdefghijklmn"}"#;
        let toks = vec![tokens("/id")];
        let n = 100_000;
        let time = |f: &dyn Fn() -> Vec<Scalar>| {
            let t = std::time::Instant::now();
            let mut last = Vec::new();
            for _ in 0..n {
                last = std::hint::black_box(f());
            }
            (t.elapsed().as_nanos() as f64 / n as f64, last)
        };
        // Alternating rounds, medians: the machine is shared.
        let (mut fasts, mut slows) = (Vec::new(), Vec::new());
        for _ in 0..15 {
            let (f, a) = time(&|| scan(doc, &toks).unwrap());
            let (s, b) = time(&|| serde_scan(doc, &toks).unwrap());
            assert_eq!(a, b);
            assert_eq!(a, vec![Scalar::Str("e-000123456".into())]);
            fasts.push(f);
            slows.push(s);
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (fast, slow) = (median(&mut fasts), median(&mut slows));
        println!(
            "scan_speed: fast path {fast:.0} ns, serde walk {slow:.0} ns, ratio {:.2}",
            slow / fast
        );
    }

    proptest! {
        // Grammar edges (a leading zero after an edit) show up in about 1 case of 1,000.
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn fast_path_agrees_with_the_serde_path(v in json_value(), pretty in any::<bool>()) {
            let text = if pretty { serde_json::to_string_pretty(&v) } else { serde_json::to_string(&v) };
            agrees(text.unwrap().as_bytes())?;
        }

        /// Valid documents with one to three small edits (a token inserted, a byte
        /// removed or replaced): mostly invalid, and near the grammar's edges.
        #[test]
        fn fast_path_never_accepts_what_serde_refuses(
            v in json_value(),
            edits in proptest::collection::vec((any::<prop::sample::Index>(), prop_oneof![
                Just(Edit::Remove),
                any::<u8>().prop_map(Edit::Replace),
                prop::sample::select(vec![
                    "{", "}", "[", "]", ":", ",", "\"", "\\", "\\u0041", "\\x", "0", "1", "-",
                    ".", "e", "+", " ", "\u{1}", "true", "nul", "é", "\u{FFFD}",
                ]).prop_map(Edit::Insert),
            ]), 1..4),
        ) {
            let mut bytes = serde_json::to_vec(&v).unwrap();
            for (at, edit) in edits {
                let i = at.index(bytes.len() + 1);
                match edit {
                    Edit::Insert(t) => {
                        bytes.splice(i..i, t.bytes());
                    }
                    Edit::Remove if i < bytes.len() => {
                        bytes.remove(i);
                    }
                    Edit::Replace(b) if i < bytes.len() => bytes[i] = b,
                    _ => {}
                }
            }
            agrees(&bytes)?;
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
