//! The fast path of [`super::json_scan::scan`]: a byte-level pass over a JSON value that
//! picks the values at a few pointers, for the values it is sure about.
//!
//! It answers only when it is certain that `serde_json` accepts the bytes and that the
//! serde walk would pick the same values; anything it is not sure of gives `None` and the
//! caller takes the `serde_json` path, which also words every error. So it never accepts
//! what the serde path refuses, and never decides an error on its own:
//! - `\u` escapes, control characters in strings, invalid UTF-8, nesting deeper than
//!   [`MAX_DEPTH`], and any syntax error give `None`;
//! - a number where a pointer leads (serde parses those, and may refuse an out-of-range
//!   float) gives `None` unless it is an integer of at most [`MAX_INT_DIGITS`] digits;
//!   elsewhere a number is checked against the JSON grammar only, as serde does when it
//!   skips a value.
//!
//! `json_scan::tests::fast_path_agrees_with_the_serde_path` checks both directions on
//! generated documents and byte strings.

use super::json_scan::Scalar;

/// Deeper nesting is left to `serde_json` (its recursion limit is 128).
const MAX_DEPTH: usize = 100;
/// Longer integers are left to `serde_json` (it reads them as `f64`, which overflows past
/// ~309 digits).
const MAX_INT_DIGITS: usize = 300;

/// The values at `pointers` (tokenized), or `None` when the serde path must decide.
pub(super) fn scan(bytes: &[u8], pointers: &[Vec<String>]) -> Option<Vec<Scalar>> {
    let mut found = vec![Scalar::Missing; pointers.len()];
    let paths: Paths<'_> = pointers
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.as_slice()))
        .collect();
    let mut p = Parser { b: bytes, i: 0 };
    p.ws();
    p.value(&paths, &mut found, 0)?;
    p.ws();
    (p.i == bytes.len()).then_some(found)
}

/// Whether array element `index` is the one an RFC 6901 token names (as the serde walk
/// reads it: decimal, no leading zero).
pub(super) fn index_matches(token: &str, index: usize) -> bool {
    token.parse::<usize>().ok() == Some(index) && (token == "0" || !token.starts_with('0'))
}

/// The pointers that lead into a value: (index, tokens left). Held inline for up to four
/// (no allocation per object or array for the usual few pointers).
type Paths<'p> = smallvec::SmallVec<[(usize, &'p [String]); 4]>;

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

/// `v` is the value at every pointer of `paths` that ends here (moved into the last one,
/// copied for the others).
fn set(paths: &[(usize, &[String])], found: &mut [Scalar], v: Scalar) {
    let mut ends = paths
        .iter()
        .filter(|(_, rest)| rest.is_empty())
        .map(|(i, _)| *i);
    let Some(mut last) = ends.next() else {
        return;
    };
    for i in ends {
        found[last] = v.clone();
        last = i;
    }
    found[last] = v;
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    fn value(
        &mut self,
        paths: &[(usize, &[String])],
        found: &mut [Scalar],
        depth: usize,
    ) -> Option<()> {
        match self.peek()? {
            b'{' => {
                set(paths, found, Scalar::Other("an object"));
                self.object(paths, found, depth + 1)
            }
            b'[' => {
                set(paths, found, Scalar::Other("an array"));
                self.array(paths, found, depth + 1)
            }
            b'"' => {
                let (s, escaped) = self.string()?;
                if paths.iter().any(|(_, rest)| rest.is_empty()) {
                    let text = if escaped {
                        unescape(s)?
                    } else {
                        // Checked by `string`.
                        std::str::from_utf8(s).ok()?.to_string()
                    };
                    set(paths, found, Scalar::Str(text));
                }
                Some(())
            }
            b't' => self.literal(b"true", paths, found, Scalar::Other("a boolean")),
            b'f' => self.literal(b"false", paths, found, Scalar::Other("a boolean")),
            b'n' => self.literal(b"null", paths, found, Scalar::Null),
            b'-' | b'0'..=b'9' => {
                let start = self.i;
                let integer = self.number()?;
                if !paths.is_empty() {
                    let text = &self.b[start..self.i];
                    if !integer || text.len() > MAX_INT_DIGITS {
                        return None;
                    }
                    let text = std::str::from_utf8(text).ok()?;
                    set(paths, found, Scalar::Num(text.to_string()));
                }
                Some(())
            }
            _ => None,
        }
    }

    fn literal(
        &mut self,
        word: &[u8],
        paths: &[(usize, &[String])],
        found: &mut [Scalar],
        v: Scalar,
    ) -> Option<()> {
        if !self.b[self.i..].starts_with(word) {
            return None;
        }
        self.i += word.len();
        set(paths, found, v);
        Some(())
    }

    fn object(
        &mut self,
        paths: &[(usize, &[String])],
        found: &mut [Scalar],
        depth: usize,
    ) -> Option<()> {
        if !self.open(b'}', depth)? {
            return Some(());
        }
        let mut sub: Paths<'_> = Paths::new();
        loop {
            if self.peek()? != b'"' {
                return None;
            }
            let (key, escaped) = self.string()?;
            sub.clear();
            if !paths.is_empty() {
                let owned;
                let key: &[u8] = if escaped {
                    owned = unescape(key)?;
                    owned.as_bytes()
                } else {
                    key
                };
                for (i, rest) in paths {
                    if let Some((first, tail)) = rest.split_first() {
                        if first.as_bytes() == key {
                            sub.push((*i, tail));
                            // A repeated key: the last occurrence wins, as on the serde path.
                            found[*i] = Scalar::Missing;
                        }
                    }
                }
            }
            self.ws();
            self.eat(b':')?;
            self.ws();
            self.value(&sub, found, depth)?;
            if !self.more(b'}')? {
                return Some(());
            }
        }
    }

    fn array(
        &mut self,
        paths: &[(usize, &[String])],
        found: &mut [Scalar],
        depth: usize,
    ) -> Option<()> {
        if !self.open(b']', depth)? {
            return Some(());
        }
        let mut sub: Paths<'_> = Paths::new();
        let mut index = 0usize;
        loop {
            sub.clear();
            for (i, rest) in paths {
                if let Some((first, tail)) = rest.split_first() {
                    if index_matches(first, index) {
                        sub.push((*i, tail));
                    }
                }
            }
            self.value(&sub, found, depth)?;
            if !self.more(b']')? {
                return Some(());
            }
            index += 1;
        }
    }

    /// Step into an object or array (at its opening bracket) closed by `close`: whether it
    /// holds any member. `None` past [`MAX_DEPTH`].
    fn open(&mut self, close: u8, depth: usize) -> Option<bool> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.i += 1;
        self.ws();
        Some(self.eat(close).is_none())
    }

    /// After a member: whether another follows (a comma), or the container ends (`close`).
    fn more(&mut self, close: u8) -> Option<bool> {
        self.ws();
        let c = self.peek()?;
        self.i += 1;
        if c == b',' {
            self.ws();
            Some(true)
        } else {
            (c == close).then_some(false)
        }
    }

    /// A string at `self.i` (its opening quote): its raw bytes between the quotes and
    /// whether it holds escapes. `None` for a `\u` escape, a control character, invalid
    /// UTF-8 or no closing quote.
    fn string(&mut self) -> Option<(&'a [u8], bool)> {
        let start = self.i + 1;
        let mut j = start;
        let mut escaped = false;
        let mut ascii = true;
        loop {
            j = skip_plain(self.b, j);
            match *self.b.get(j)? {
                b'"' => break,
                b'\\' => {
                    match self.b.get(j + 1)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                        _ => return None,
                    }
                    escaped = true;
                    j += 2;
                }
                0..=0x1f => return None,
                0x80.. => {
                    ascii = false;
                    j += 1;
                }
                _ => j += 1,
            }
        }
        let s = &self.b[start..j];
        if !ascii {
            std::str::from_utf8(s).ok()?;
        }
        self.i = j + 1;
        Some((s, escaped))
    }

    /// A number at `self.i` by the JSON grammar; whether it is an integer (no fraction,
    /// no exponent).
    fn number(&mut self) -> Option<bool> {
        let _ = self.eat(b'-');
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        let mut integer = true;
        if self.eat(b'.').is_some() {
            integer = false;
            if !self.peek()?.is_ascii_digit() {
                return None;
            }
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            integer = false;
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if !self.peek()?.is_ascii_digit() {
                return None;
            }
            self.digits();
        }
        Some(integer)
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
    }
}

/// The first position from `j` on where a byte may need a look in a string (a quote, a
/// backslash, a control character or a byte that is not ASCII), looked for 16 bytes at a
/// time; when the bytes left are fewer than 16 and hold none, the start of those bytes.
#[cfg(target_arch = "x86_64")]
fn skip_plain(b: &[u8], mut j: usize) -> usize {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_cmplt_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };
    // SAFETY: SSE2 is part of every x86_64 CPU; each load reads 16 bytes inside `b`
    // (`j + 16 <= b.len()`), unaligned loads allowed.
    unsafe {
        let quote = _mm_set1_epi8(b'"' as i8);
        let backslash = _mm_set1_epi8(b'\\' as i8);
        let space = _mm_set1_epi8(0x20);
        while j + 16 <= b.len() {
            let x = _mm_loadu_si128(b.as_ptr().add(j).cast::<__m128i>());
            // Signed: bytes of 0x80 and above are negative, so below a space too.
            let hit = _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(x, quote), _mm_cmpeq_epi8(x, backslash)),
                _mm_cmplt_epi8(x, space),
            );
            let mask = _mm_movemask_epi8(hit);
            if mask != 0 {
                return j + mask.trailing_zeros() as usize;
            }
            j += 16;
        }
    }
    j
}

/// [`skip_plain`] elsewhere: no skipping, the byte loop looks at every byte.
#[cfg(not(target_arch = "x86_64"))]
fn skip_plain(_: &[u8], j: usize) -> usize {
    j
}

/// The text of a string's raw bytes holding only the escapes [`Parser::string`] accepts
/// (valid UTF-8, checked there).
fn unescape(s: &[u8]) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut it = s.iter();
    while let Some(&c) = it.next() {
        if c != b'\\' {
            out.push(c);
            continue;
        }
        out.push(match it.next() {
            Some(b'b') => 0x08,
            Some(b'f') => 0x0c,
            Some(b'n') => b'\n',
            Some(b'r') => b'\r',
            Some(b't') => b'\t',
            Some(&other) => other,
            None => break,
        });
    }
    String::from_utf8(out).ok()
}

/// How far into a value [`peek_member`] looks, in bytes: a hint must cost less than the
/// cache miss it saves.
const PEEK_BYTES: usize = 128;

/// The raw text of top-level member `name` of a JSON object, when it is a string without
/// escapes (the bytes between its quotes) or a number (its text), found within the value's
/// first [`PEEK_BYTES`] bytes: a guess for a prefetch hint, read without validating the
/// document (of a name given twice, the first; the scan takes the last). A malformed
/// document gives `None` or some bytes, never a panic.
pub(crate) fn peek_member<'a>(value: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let b = &value[..value.len().min(PEEK_BYTES)];
    let ws = |mut i: usize| {
        while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            i += 1;
        }
        i
    };
    let mut i = ws(0);
    if *b.get(i)? != b'{' {
        return None;
    }
    i += 1;
    loop {
        i = ws(i);
        if *b.get(i)? != b'"' {
            return None;
        }
        let (end, escaped) = peek_string(b, i)?;
        let key = &b[i + 1..end];
        i = ws(end + 1);
        if *b.get(i)? != b':' {
            return None;
        }
        i = ws(i + 1);
        if !escaped && key == name {
            return match *b.get(i)? {
                b'"' => match peek_string(b, i)? {
                    (end, false) => Some(&b[i + 1..end]),
                    (_, true) => None,
                },
                b'-' | b'0'..=b'9' => {
                    let n = b[i..].iter().position(|c| {
                        !matches!(c, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                    })?;
                    Some(&b[i..i + n])
                }
                _ => None,
            };
        }
        i = ws(peek_skip(b, i)?);
        if *b.get(i)? != b',' {
            return None;
        }
        i += 1;
    }
}

/// The closing quote of the string opening at `i`, and whether it holds an escape.
fn peek_string(b: &[u8], i: usize) -> Option<(usize, bool)> {
    let (mut j, mut escaped) = (i + 1, false);
    loop {
        match *b.get(j)? {
            b'"' => return Some((j, escaped)),
            b'\\' => {
                escaped = true;
                j += 2;
            }
            _ => j += 1,
        }
    }
}

/// The position after the value starting at `i` (brackets matched by depth alone).
fn peek_skip(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => peek_string(b, i).map(|(end, _)| end + 1),
        b'{' | b'[' => {
            let (mut j, mut depth) = (i, 0usize);
            loop {
                match *b.get(j)? {
                    b'"' => {
                        j = peek_string(b, j)?.0;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => b[i..]
            .iter()
            .position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
            .map(|n| i + n),
    }
}

#[cfg(test)]
mod tests {
    use super::{peek_member, skip_plain};
    use proptest::prelude::*;

    #[test]
    fn a_peek_finds_a_top_level_string_or_number() {
        let peek = |doc: &str| peek_member(doc.as_bytes(), b"id").map(|s| s.to_vec());
        assert_eq!(peek(r#"{"id":"abc","x":1}"#), Some(b"abc".to_vec()));
        assert_eq!(
            peek(r#" { "a" : {"id":7,"b":[1,"}]",{"c":null}]}, "i\u0064":1, "id" : -4.5e3 }"#),
            Some(b"-4.5e3".to_vec())
        );
        // A nested "id" is not the member; an escaped value is not its raw text.
        assert_eq!(peek(r#"{"a":{"id":"x"}}"#), None);
        assert_eq!(peek(r#"{"id":"a\"b"}"#), None);
        assert_eq!(peek(r#"{"id":true}"#), None);
        assert_eq!(peek(r#"["id","x"]"#), None);
        // Past the bytes it looks at.
        let far = format!(r#"{{"pad":"{}","id":"x"}}"#, "p".repeat(200));
        assert_eq!(peek(&far), None);
    }

    /// A JSON string or number of a generated document, as JSON text.
    fn scalar() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z\\\"é ]{0,6}".prop_map(|s| serde_json::to_string(&s).unwrap()),
            any::<i64>().prop_map(|n| n.to_string()),
            Just("1.5e-3".to_string()),
            Just("null".to_string()),
            Just(r#"{"id":"in","l":[1,{"x":"]"}]}"#.to_string()),
        ]
    }

    proptest! {
        /// Whatever the bytes, a peek returns without a panic.
        #[test]
        fn a_peek_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
            let _ = peek_member(&bytes, b"id");
        }

        /// On a JSON object, what a peek finds is the key a JSON-pointer key reads from the
        /// member (the string's text, the number's text).
        #[test]
        fn a_peek_agrees_with_the_scan(members in proptest::collection::vec(("(id|a|b|i)", scalar()), 0..6)) {
            // Each name once: with a name twice, the peek reads the first, the scan the last.
            let mut seen = std::collections::HashSet::new();
            let members: Vec<_> = members.into_iter().filter(|(k, _)| seen.insert(k.clone())).collect();
            let doc = format!(
                "{{{}}}",
                members.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect::<Vec<_>>().join(", ")
            );
            let pointers = vec![vec!["id".to_string()]];
            let want = crate::processor::json_scan::scan(doc.as_bytes(), &pointers).unwrap();
            if let Some(found) = peek_member(doc.as_bytes(), b"id") {
                use crate::processor::json_scan::Scalar;
                match &want[0] {
                    Scalar::Str(s) | Scalar::Num(s) => prop_assert_eq!(found, s.as_bytes(), "{}", doc),
                    other => prop_assert!(false, "found {:?} where the scan read {:?} in {}", found, other, doc),
                }
            }
        }
    }

    fn needs_look(c: u8) -> bool {
        c == b'"' || c == b'\\' || !(0x20..0x80).contains(&c)
    }

    proptest! {
        /// `skip_plain` never skips a byte that needs a look, and stops only at one or
        /// where fewer than 16 bytes are left.
        #[test]
        fn skip_plain_stops_at_the_first_byte_that_needs_a_look(
            b in proptest::collection::vec(prop_oneof![
                8 => 0x20u8..0x7f,
                1 => Just(b'"'),
                1 => Just(b'\\'),
                1 => 0u8..0x20,
                1 => 0x80u8..=0xff,
            ], 0..80),
            from in 0usize..80,
        ) {
            let j = from.min(b.len());
            let p = skip_plain(&b, j);
            prop_assert!(p >= j && p <= b.len());
            prop_assert!(b[j..p].iter().all(|c| !needs_look(*c)), "skipped a byte that needs a look");
            prop_assert!(p == b.len() || needs_look(b[p]) || p + 16 > b.len(), "stopped early at {p}");
        }
    }
}
