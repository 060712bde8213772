//! Payload fingerprints over chosen JSON fields.
//!
//! A dedup stage with a fingerprint stores a hash of the payload with each key, so that the
//! same key with another payload is a *conflict*, not a duplicate. `fingerprint: true`
//! hashes the value bytes as read. [`FingerprintFields`] instead hashes what the value
//! *says* in the fields that matter: the values at the `cover` pointers (all of the value
//! when none is given), leaving out those at the `ignore` pointers. A `*` token matches every
//! element of an array (`/payload/commits/*/author/email`).
//!
//! The hash is over the JSON meaning, not its text: object members in any order, any
//! whitespace and string escapes give the same fingerprint; numbers compare by value
//! (`1`, `1.0` and `1e0` are equal; numbers beyond 64-bit integers compare as `f64`). So a
//! re-serialized copy, or one where only an ignored field changed (an e-mail address
//! obfuscated after the fact), is a duplicate. One pass over the bytes, no tree is built.

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The fields a fingerprint is taken over: JSON pointers (RFC 6901) into the value, where a
/// `*` token stands for every element of an array.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FingerprintFields {
    /// Pointers whose values are covered, in this order; empty: the whole value.
    pub cover: Vec<String>,
    /// Pointers whose values are left out (wherever they lie in what is covered).
    pub ignore: Vec<String>,
}

impl FingerprintFields {
    /// Cover only the values at `pointers`.
    pub fn cover<S: Into<String>>(pointers: impl IntoIterator<Item = S>) -> Self {
        FingerprintFields {
            cover: pointers.into_iter().map(Into::into).collect(),
            ignore: Vec::new(),
        }
    }

    /// Cover the whole value but the values at `pointers`.
    pub fn ignore<S: Into<String>>(pointers: impl IntoIterator<Item = S>) -> Self {
        FingerprintFields {
            cover: Vec::new(),
            ignore: pointers.into_iter().map(Into::into).collect(),
        }
    }

    /// Check the pointers.
    ///
    /// # Errors
    /// A sentence naming the list and the pointer: one that is neither empty nor starts
    /// with `/`, or no pointer at all.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.cover.is_empty() && self.ignore.is_empty() {
            return Err("give at least one JSON pointer to cover or to ignore".into());
        }
        for (list, ptrs) in [("cover", &self.cover), ("ignore", &self.ignore)] {
            for p in ptrs {
                if !p.is_empty() && !p.starts_with('/') {
                    return Err(format!(
                        "{list}: {p:?} is not a JSON pointer (it must be empty or start with '/')"
                    ));
                }
            }
        }
        Ok(())
    }

    /// For `describe`: `cover /a, /b; ignore /c`.
    pub(crate) fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.cover.is_empty() {
            parts.push(format!("cover {}", self.cover.join(", ")));
        }
        if !self.ignore.is_empty() {
            parts.push(format!("ignore {}", self.ignore.join(", ")));
        }
        parts.join("; ")
    }

    /// The pointers tokenized, ready to hash records.
    pub(crate) fn compile(&self) -> Fingerprinter {
        let toks = |v: &[String]| v.iter().map(|p| super::json_scan::tokens(p)).collect();
        Fingerprinter {
            cover: toks(&self.cover),
            ignore: toks(&self.ignore),
        }
    }
}

/// A compiled [`FingerprintFields`].
#[derive(Debug, Clone)]
pub(crate) struct Fingerprinter {
    cover: Vec<Vec<String>>,
    ignore: Vec<Vec<String>>,
}

impl Fingerprinter {
    /// The fingerprint of JSON `bytes`.
    ///
    /// # Errors
    /// The bytes are not JSON (the `serde_json` message, with line and column).
    pub(crate) fn of_bytes(&self, bytes: &[u8]) -> Result<u64, String> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let h = self.run(&mut de).map_err(|e| e.to_string())?;
        de.end().map_err(|e| e.to_string())?;
        Ok(h)
    }

    /// The fingerprint of a decoded value (a record view); equal to [`Self::of_bytes`] of
    /// its text.
    pub(crate) fn of_value(&self, v: &serde_json::Value) -> u64 {
        // A Value always deserializes: no error can come out of it.
        self.run(v).unwrap_or_default()
    }

    fn run<'de, D: Deserializer<'de>>(&self, d: D) -> Result<u64, D::Error> {
        let cover: Vec<Path<'_>> = self
            .cover
            .iter()
            .enumerate()
            .map(|(i, p)| Path {
                index: i,
                rest: p.as_slice(),
                at: 0,
            })
            .collect();
        let ignore: Vec<&[String]> = self.ignore.iter().map(Vec::as_slice).collect();
        let mut matches = vec![Vec::new(); cover.len()];
        let whole = Node {
            cover: &cover,
            ignore: &ignore,
            need: cover.is_empty(),
            matches: &mut matches,
        }
        .deserialize(d)?;
        if cover.is_empty() {
            return Ok(whole.unwrap_or_else(|| mix(b'i', 0)));
        }
        // Each covered pointer: its matches in document order (none when it is missing).
        let mut out = Vec::with_capacity(matches.len() * 16);
        for m in &matches {
            out.extend_from_slice(&(m.len() as u64).to_le_bytes());
            for h in m {
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        Ok(xxh3_64(&out))
    }
}

/// A cover pointer on its way down: its index, the tokens left, and the array indices a
/// `*` matched on the way (hashed), so two matches at different places differ.
#[derive(Clone, Copy)]
struct Path<'p> {
    index: usize,
    rest: &'p [String],
    at: u64,
}

fn mix(tag: u8, v: u64) -> u64 {
    xxh3_64_with_seed(&v.to_le_bytes(), tag as u64)
}

fn hash_bytes(tag: u8, b: &[u8]) -> u64 {
    xxh3_64_with_seed(b, tag as u64)
}

fn hash_int(text: &str) -> u64 {
    hash_bytes(b'n', text.as_bytes())
}

/// Whether token `t` selects array element `i` (`*`, or the index without leading zeros).
fn selects(t: &str, i: usize) -> bool {
    t == "*" || (t.parse::<usize>().ok() == Some(i) && (t == "0" || !t.starts_with('0')))
}

/// Hashes one value (when `need`, or when a cover pointer ends at it) and records the
/// hashes of cover matches inside it. Returns `None` for a value not needed or ignored.
struct Node<'a, 'p> {
    cover: &'a [Path<'p>],
    ignore: &'a [&'p [String]],
    need: bool,
    matches: &'a mut [Vec<u64>],
}

impl<'de> DeserializeSeed<'de> for Node<'_, '_> {
    type Value = Option<u64>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
        if self.ignore.iter().any(|r| r.is_empty()) {
            d.deserialize_ignored_any(IgnoredAny)?;
            return Ok(None);
        }
        let ends: Vec<Path<'_>> = self
            .cover
            .iter()
            .filter(|p| p.rest.is_empty())
            .copied()
            .collect();
        let hash_here = self.need || !ends.is_empty();
        let deeper = self.cover.iter().any(|p| !p.rest.is_empty());
        if !hash_here && !deeper {
            d.deserialize_ignored_any(IgnoredAny)?;
            return Ok(None);
        }
        let need = self.need;
        let matches = self.matches;
        let h = d.deserialize_any(Value {
            cover: self.cover,
            ignore: self.ignore,
            hash: hash_here,
            matches: &mut *matches,
        })?;
        if let Some(h) = h {
            for p in ends {
                matches[p.index].push(mix(b'@', p.at ^ h));
            }
        }
        Ok(if need { h } else { None })
    }
}

struct Value<'a, 'p> {
    cover: &'a [Path<'p>],
    ignore: &'a [&'p [String]],
    hash: bool,
    matches: &'a mut [Vec<u64>],
}

impl Value<'_, '_> {
    fn scalar(&self, h: impl FnOnce() -> u64) -> Option<u64> {
        self.hash.then(h)
    }
}

impl<'de> Visitor<'de> for Value<'_, '_> {
    type Value = Option<u64>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Option<u64>, E> {
        Ok(self.scalar(|| mix(b'b', v as u64)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Option<u64>, E> {
        Ok(self.scalar(|| hash_int(&v.to_string())))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Option<u64>, E> {
        Ok(self.scalar(|| hash_int(&v.to_string())))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Option<u64>, E> {
        Ok(self.scalar(|| {
            // Compare by value: an integral f64 that fits 64 bits hashes as that integer.
            if v.fract() == 0.0
                && (-9.223_372_036_854_776e18..1.844_674_407_370_955_2e19).contains(&v)
            {
                if v < 0.0 {
                    hash_int(&(v as i64).to_string())
                } else {
                    hash_int(&(v as u64).to_string())
                }
            } else {
                mix(b'f', v.to_bits())
            }
        }))
    }
    fn visit_str<E>(self, v: &str) -> Result<Option<u64>, E> {
        Ok(self.scalar(|| hash_bytes(b's', v.as_bytes())))
    }
    fn visit_unit<E>(self) -> Result<Option<u64>, E> {
        Ok(self.scalar(|| mix(b'z', 0)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<u64>, A::Error> {
        // Members in any order: the object's hash is the sum of its members' hashes. A name
        // that repeats counts once, with its last value (as serde and the key scan read it).
        let mut sum = 0u64;
        let mut terms: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
        let mut cover: Vec<Path<'_>> = Vec::new();
        let mut ignore: Vec<&[String]> = Vec::new();
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            cover.clear();
            ignore.clear();
            for p in self.cover {
                if let Some((first, tail)) = p.rest.split_first() {
                    if *first == key {
                        cover.push(Path { rest: tail, ..*p });
                    }
                }
            }
            for r in self.ignore {
                if let Some((first, tail)) = r.split_first() {
                    if *first == key {
                        ignore.push(tail);
                    }
                }
            }
            let child = map.next_value_seed(Node {
                cover: &cover,
                ignore: &ignore,
                need: self.hash,
                matches: &mut *self.matches,
            })?;
            let name = hash_bytes(b'k', key.as_bytes());
            let term = child.map_or(0, |h| mix(b'm', name ^ h));
            if let Some(before) = terms.insert(name, term) {
                sum = sum.wrapping_sub(before);
            }
            sum = sum.wrapping_add(term);
        }
        Ok(self.scalar(|| mix(b'o', sum)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<u64>, A::Error> {
        let mut acc = Vec::new();
        let mut cover: Vec<Path<'_>> = Vec::new();
        let mut ignore: Vec<&[String]> = Vec::new();
        let mut i = 0usize;
        loop {
            cover.clear();
            ignore.clear();
            for p in self.cover {
                if let Some((first, tail)) = p.rest.split_first() {
                    if selects(first, i) {
                        let at = if first == "*" {
                            mix(b'*', p.at ^ i as u64)
                        } else {
                            p.at
                        };
                        cover.push(Path {
                            rest: tail,
                            at,
                            ..*p
                        });
                    }
                }
            }
            for r in self.ignore {
                if let Some((first, tail)) = r.split_first() {
                    if selects(first, i) {
                        ignore.push(tail);
                    }
                }
            }
            let Some(child) = seq.next_element_seed(Node {
                cover: &cover,
                ignore: &ignore,
                need: self.hash,
                matches: &mut *self.matches,
            })?
            else {
                break;
            };
            if self.hash {
                // An ignored element leaves a gap: the others keep their places.
                acc.extend_from_slice(&(i as u64).to_le_bytes());
                acc.extend_from_slice(&child.unwrap_or(0).to_le_bytes());
                acc.push(child.is_some() as u8);
            }
            i += 1;
        }
        Ok(self.scalar(|| hash_bytes(b'a', &acc)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(fields: &FingerprintFields, json: &str) -> u64 {
        let f = fields.compile();
        let a = f.of_bytes(json.as_bytes()).unwrap();
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(a, f.of_value(&v), "bytes and view agree on {json}");
        a
    }

    #[test]
    fn meaning_not_text() {
        let all = FingerprintFields::ignore(["/nothing"]);
        let a = fp(&all, r#"{"a":1,"b":[true,null,"x\u0041"],"c":{"d":2.5}}"#);
        let b = fp(
            &all,
            r#" { "c" : { "d" : 25e-1 } , "b" : [ true , null , "xA" ] , "a" : 1.0 } "#,
        );
        assert_eq!(a, b);
        for other in [
            r#"{"a":2,"b":[true,null,"xA"],"c":{"d":2.5}}"#,
            r#"{"a":1,"b":[null,true,"xA"],"c":{"d":2.5}}"#,
            r#"{"a":1,"b":[true,null,"xA"],"c":{"d":2.5},"e":null}"#,
            r#"{"a":"1","b":[true,null,"xA"],"c":{"d":2.5}}"#,
            r#"{"a":1,"b":[true,null,"xA"],"c":{"e":2.5}}"#,
        ] {
            assert_ne!(a, fp(&all, other), "{other}");
        }
    }

    #[test]
    fn a_repeated_member_counts_once_with_its_last_value() {
        let all = FingerprintFields::ignore(["/nothing"]);
        let once = fp(&all, r#"{"id":"a","n":2}"#);
        assert_eq!(fp(&all, r#"{"id":"a","n":1,"n":2}"#), once);
        assert_eq!(fp(&all, r#"{"id":"a","n":2,"n":2}"#), once);
        assert_ne!(fp(&all, r#"{"id":"a","n":2,"n":1}"#), once);
        // Ignored, then given again: the last one counts.
        let ign = FingerprintFields::ignore(["/n/x"]);
        assert_eq!(
            fp(&ign, r#"{"n":{"x":1},"n":{"x":2,"y":3}}"#),
            fp(&ign, r#"{"n":{"y":3}}"#)
        );
    }

    #[test]
    fn ignore_and_cover_with_wildcards() {
        let ign = FingerprintFields::ignore(["/c/*/e"]);
        let base = r#"{"id":1,"c":[{"e":"a@x","m":"hi"},{"e":"b@x","m":"yo"}]}"#;
        let redacted = r#"{"id":1,"c":[{"e":"0f","m":"hi"},{"m":"yo"}]}"#;
        let changed = r#"{"id":1,"c":[{"e":"a@x","m":"ho"},{"e":"b@x","m":"yo"}]}"#;
        assert_eq!(fp(&ign, base), fp(&ign, redacted));
        assert_ne!(fp(&ign, base), fp(&ign, changed));

        let cov = FingerprintFields::cover(["/c/*/m", "/id"]);
        assert_eq!(fp(&cov, base), fp(&cov, redacted));
        assert_ne!(fp(&cov, base), fp(&cov, changed));
        assert_ne!(
            fp(&cov, base),
            fp(&cov, r#"{"id":2,"c":[{"m":"hi"},{"m":"yo"}]}"#)
        );
        // A value moved to another element is another payload; so is a missing field.
        assert_ne!(
            fp(&cov, r#"{"id":1,"c":[{"m":"hi"},{}]}"#),
            fp(&cov, r#"{"id":1,"c":[{},{"m":"hi"}]}"#)
        );
        // A wildcard that selects nothing: the same whether the array is empty or missing.
        assert_eq!(fp(&cov, r#"{"id":1}"#), fp(&cov, r#"{"id":1,"c":[]}"#));
        assert_ne!(fp(&cov, r#"{"c":[]}"#), fp(&cov, r#"{"id":null,"c":[]}"#));
        // Cover and ignore together: covered, but for the ignored part.
        let both = FingerprintFields {
            cover: vec!["/c".into()],
            ignore: vec!["/c/*/e".into()],
        };
        assert_eq!(fp(&both, base), fp(&both, redacted));
        assert_eq!(
            fp(&both, base),
            fp(&both, r#"{"id":9,"c":[{"m":"hi"},{"m":"yo"}]}"#)
        );
        assert_ne!(fp(&both, base), fp(&both, changed));
    }

    #[test]
    fn bad_json_and_bad_pointers_are_errors() {
        let f = FingerprintFields::ignore(["/a"]).compile();
        assert!(f.of_bytes(b"{\"a\":").is_err());
        assert!(f.of_bytes(b"{} x").is_err());
        assert_eq!(
            FingerprintFields::cover(["a"]).validate().unwrap_err(),
            "cover: \"a\" is not a JSON pointer (it must be empty or start with '/')"
        );
        assert!(FingerprintFields::default().validate().is_err());
        assert!(FingerprintFields::cover([""]).validate().is_ok());
    }

    proptest::proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let f = FingerprintFields { cover: vec!["/a/*".into(), "".into()], ignore: vec!["/a/0".into()] };
            let ok = f.compile().of_bytes(&bytes).is_ok();
            proptest::prop_assert_eq!(ok, serde_json::from_slice::<serde_json::Value>(&bytes).is_ok());
        }
    }
}
