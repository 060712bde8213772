//! Reading a topology file: a located document tree ([`node`]: YAML and TOML, every value
//! and key with its line and column) and the typed field readers ([`Reader`]: strings,
//! durations, choices, expressions, key sources, codecs, maps read entry by entry) that
//! report each problem at the position of the value at fault.
//!
//! `dsl` drives the reading of a whole file; each stage kind (`topology::stage`) reads its
//! own fields with a [`Reader`], so its file schema stays next to the rest of the kind.

pub(crate) mod node;

use crate::codec::{Format, ProtoFormat};
use crate::processor::key::KeySource;
use node::{Node, Pos, Val};
use std::collections::HashMap;
use std::path::PathBuf;

/// One problem found in a file.
#[derive(Debug, Clone)]
pub(crate) struct Located {
    /// Where.
    pub(crate) pos: Pos,
    /// The stage or section, as messages name it (``stage `d` (dedup)``, `source`, ...).
    pub(crate) place: String,
    /// The field at fault, if one is.
    pub(crate) field: Option<String>,
    /// What is wrong.
    pub(crate) message: String,
}

impl Located {
    /// ``file:line:column: place, field `f`: message``.
    pub(crate) fn render(&self, file: &str) -> String {
        match &self.field {
            Some(f) => format!(
                "{file}:{}: {}, field `{f}`: {}",
                self.pos, self.place, self.message
            ),
            None => format!("{file}:{}: {}: {}", self.pos, self.place, self.message),
        }
    }
}

/// A map's fields, after the unknown ones were reported.
pub(crate) struct Fields<'a> {
    /// Where the map starts.
    pub(crate) pos: Pos,
    /// Each field: name, the name's position, value.
    pub(crate) entries: Vec<(&'a str, Pos, &'a Node)>,
}

impl<'a> Fields<'a> {
    /// The value of field `name`, if given.
    pub(crate) fn get(&self, name: &str) -> Option<&'a Node> {
        self.entries
            .iter()
            .find(|(k, _, _)| *k == name)
            .map(|(_, _, n)| *n)
    }
}

/// Typed, located field reading. Each reader reports a problem (at the value's position,
/// naming the place and the field) and gives `None`; every problem of a file is collected,
/// not only the first.
pub(crate) struct Reader {
    /// The file's directory: descriptor set paths are relative to it.
    pub(crate) base: PathBuf,
    /// The problems found so far.
    pub(crate) errors: Vec<Located>,
    /// Positions of the fields of the stage being read, by name (nested ones as
    /// `idempotency.lease`), for placing the problems the builder finds later.
    pub(crate) field_pos: HashMap<String, Pos>,
}

impl Reader {
    /// A reader for a file in directory `base`.
    pub(crate) fn new(base: PathBuf) -> Self {
        Reader {
            base,
            errors: Vec::new(),
            field_pos: HashMap::new(),
        }
    }
}

/// `a, b, c`.
pub(crate) fn list(names: &[&str]) -> String {
    names.join(", ")
}

/// The message for field or kind `name` that is not among `allowed`: `unknown field, did you
/// mean `ttl`? expected one of ...` (the hint only when a known name is near, see
/// [`crate::names::nearest`]). `what` is `field` or `stage kind `x``.
pub(crate) fn unknown(what: &str, name: &str, allowed: &[&str]) -> String {
    let hint = crate::names::nearest(name, allowed.iter().copied())
        .map_or_else(|| ",".to_string(), |k| format!(", did you mean `{k}`?"));
    format!("unknown {what}{hint} expected one of {}", list(allowed))
}

impl Reader {
    pub(crate) fn err(
        &mut self,
        pos: Pos,
        place: &str,
        field: Option<&str>,
        message: impl Into<String>,
    ) {
        self.errors.push(Located {
            pos,
            place: place.to_string(),
            field: field.map(str::to_string),
            message: message.into(),
        });
    }

    /// Report a value of the wrong type: "expected `what`, found <its type>".
    pub(crate) fn wrong_type(
        &mut self,
        pos: Pos,
        place: &str,
        field: Option<&str>,
        what: &str,
        found: &Val,
    ) {
        self.err(
            pos,
            place,
            field,
            format!("expected {what}, found {}", found.type_name()),
        );
    }

    /// `node` as a map with only `allowed` fields (unknown ones are reported).
    pub(crate) fn fields<'a>(
        &mut self,
        node: &'a Node,
        place: &str,
        field: Option<&str>,
        allowed: &[&str],
    ) -> Option<Fields<'a>> {
        let Val::Map(entries) = &node.val else {
            self.wrong_type(node.pos, place, field, "a map", &node.val);
            return None;
        };
        let mut out = Fields {
            pos: node.pos,
            entries: Vec::new(),
        };
        for (k, kpos, v) in entries {
            if allowed.contains(&k.as_str()) {
                out.entries.push((k.as_str(), *kpos, v));
            } else {
                self.err(*kpos, place, Some(k), unknown("field", k, allowed));
            }
        }
        Some(out)
    }

    pub(crate) fn required<'a>(
        &mut self,
        f: &Fields<'a>,
        name: &str,
        place: &str,
    ) -> Option<&'a Node> {
        let n = f.get(name);
        if n.is_none() {
            self.err(f.pos, place, Some(name), "missing field");
        }
        n
    }

    pub(crate) fn string(&mut self, n: &Node, place: &str, field: &str) -> Option<String> {
        match &n.val {
            Val::Str(s) => Some(s.clone()),
            other => {
                self.wrong_type(n.pos, place, Some(field), "a string", other);
                None
            }
        }
    }

    /// Optional field `name` of `f`: when given, read with `read` (which reports a
    /// problem) and handed to `set`. Whether it is absent or was read.
    pub(crate) fn opt<T>(
        &mut self,
        f: &Fields<'_>,
        name: &str,
        read: impl FnOnce(&mut Self, &Node) -> Option<T>,
        set: impl FnOnce(T),
    ) -> bool {
        match f.get(name) {
            None => true,
            Some(n) => read(self, n).map(set).is_some(),
        }
    }

    /// A duration such as `24h` or `90s` (written back by [`duration_text`]), at most
    /// [`MAX_DURATION`].
    pub(crate) fn duration(
        &mut self,
        n: &Node,
        place: &str,
        field: &str,
    ) -> Option<std::time::Duration> {
        let Val::Str(s) = &n.val else {
            self.wrong_type(
                n.pos,
                place,
                Some(field),
                "a duration such as 24h or 90s",
                &n.val,
            );
            return None;
        };
        match humantime::parse_duration(s) {
            Ok(d) if d > MAX_DURATION => {
                self.err(n.pos, place, Some(field), too_long(&format!("{s:?}")));
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                self.err(
                    n.pos,
                    place,
                    Some(field),
                    format!("{s:?} is not a duration such as 24h or 90s: {e}"),
                );
                None
            }
        }
    }

    /// A duration in milliseconds (see [`Self::duration`]).
    pub(crate) fn duration_ms(&mut self, n: &Node, place: &str, field: &str) -> Option<i64> {
        self.duration(n, place, field)
            .map(|d| d.as_millis().min(i64::MAX as u128) as i64)
    }

    /// Note where field `field` of the stage being read is (a nested one such as
    /// `idempotency.lease`, or an alias), so that a problem the builder finds with it later
    /// is placed there.
    pub(crate) fn note_field_pos(&mut self, field: &str, pos: Pos) {
        self.field_pos.insert(field.to_string(), pos);
    }

    pub(crate) fn choice(
        &mut self,
        n: &Node,
        place: &str,
        field: &str,
        allowed: &[&str],
    ) -> Option<String> {
        let s = self.string(n, place, field)?;
        if allowed.contains(&s.as_str()) {
            Some(s)
        } else {
            self.err(
                n.pos,
                place,
                Some(field),
                unknown(&format!("value {s:?}"), &s, allowed),
            );
            None
        }
    }

    /// An expression: a string (or a bool or number, taken as its text).
    pub(crate) fn expr_text(&mut self, n: &Node, place: &str, field: &str) -> Option<String> {
        match &n.val {
            Val::Str(s) => Some(s.clone()),
            Val::Bool(b) => Some(b.to_string()),
            Val::Int(i) => Some(i.to_string()),
            Val::Float(f) => Some(f.to_string()),
            other => {
                self.wrong_type(n.pos, place, Some(field), "an expression (a string)", other);
                None
            }
        }
    }

    pub(crate) fn func<T: crate::processor::expr::FromCel>(
        &mut self,
        n: &Node,
        place: &str,
        field: &str,
    ) -> Option<crate::processor::expr::Func<T>> {
        let text = self.expr_text(n, place, field)?;
        match crate::processor::expr::Func::<T>::expr(&text) {
            Ok(f) => Some(f),
            Err(e) => {
                self.err(n.pos, place, Some(field), e);
                None
            }
        }
    }

    /// A field path: a JSON pointer (`/a/b`) or a top-level field name.
    pub(crate) fn field_path(
        &mut self,
        text: &str,
        pos: Pos,
        place: &str,
        field: &str,
    ) -> Option<String> {
        if text.is_empty() {
            self.err(pos, place, Some(field), "a field name must not be empty");
            return None;
        }
        if text.starts_with('/') {
            return Some(text.to_string());
        }
        Some(format!("/{}", text.replace('~', "~0").replace('/', "~1")))
    }

    /// A key source: `kafka_key`, `value_hash`, or a map with one of `json_pointer`,
    /// `header`, `composite` (a list of key sources).
    pub(crate) fn key(&mut self, n: &Node, place: &str) -> Option<KeySource> {
        const KINDS: [&str; 5] = [
            "json_pointer",
            "header",
            "kafka_key",
            "value_hash",
            "composite",
        ];
        let bad = |c: &mut Reader, what: &str| {
            c.err(
                n.pos,
                place,
                Some("key"),
                format!(
                    "expected kafka_key, value_hash, or a map with one of {}; found {what}",
                    list(&KINDS)
                ),
            );
            None
        };
        match &n.val {
            Val::Str(s) if s == "kafka_key" => Some(KeySource::KafkaKey),
            Val::Str(s) if s == "value_hash" => Some(KeySource::ValueHash),
            Val::Str(s) => bad(self, &format!("{s:?}")),
            Val::Map(es) if es.len() == 1 => {
                let (k, kpos, v) = &es[0];
                match k.as_str() {
                    "json_pointer" => self.string(v, place, "key").map(KeySource::JsonPointer),
                    "header" => self.string(v, place, "key").map(KeySource::Header),
                    "kafka_key" => Some(KeySource::KafkaKey),
                    "value_hash" => Some(KeySource::ValueHash),
                    "composite" => match &v.val {
                        Val::Seq(parts) if !parts.is_empty() => {
                            let parts: Vec<Option<KeySource>> =
                                parts.iter().map(|p| self.key(p, place)).collect();
                            parts
                                .into_iter()
                                .collect::<Option<Vec<_>>>()
                                .map(KeySource::Composite)
                        }
                        other => {
                            self.err(
                                v.pos,
                                place,
                                Some("key"),
                                format!(
                                    "composite expects a non-empty list of keys, found {}",
                                    other.type_name()
                                ),
                            );
                            None
                        }
                    },
                    other => {
                        self.err(
                            *kpos,
                            place,
                            Some("key"),
                            unknown(&format!("key source `{other}`"), other, &KINDS),
                        );
                        None
                    }
                }
            }
            other => bad(self, other.type_name()),
        }
    }

    /// As [`Reader::entries`], for a map keyed by field names: each key is read as a field
    /// path ([`Reader::field_path`]) and handed to `read` (`None` when it was bad, the
    /// problem kept), so that `read` can still check the entry's value.
    pub(crate) fn path_entries(
        &mut self,
        f: &Fields<'_>,
        field: &str,
        place: &str,
        what: &str,
        mut read: impl FnMut(&mut Self, Option<String>, &Node) -> Option<()>,
    ) -> bool {
        self.entries(f, field, place, what, |c, k, kpos, v| {
            let path = c.field_path(k, kpos, place, field);
            read(c, path, v)
        })
    }

    /// Read each entry of map field `field` of `f`, if given, with `read` (see
    /// [`Self::each_entry`]). Whether it is absent or every entry was read.
    pub(crate) fn entries(
        &mut self,
        f: &Fields<'_>,
        field: &str,
        place: &str,
        what: &str,
        read: impl FnMut(&mut Self, &str, Pos, &Node) -> Option<()>,
    ) -> bool {
        match f.get(field) {
            None => true,
            Some(n) => self.each_entry(n, place, field, what, read),
        }
    }

    /// Read each entry of the map `n` (field `field`) with `read`, which gives `None` when
    /// the entry is wrong (having reported it); a node that is not a map is reported as
    /// `what`. Whether every entry was read.
    pub(crate) fn each_entry(
        &mut self,
        n: &Node,
        place: &str,
        field: &str,
        what: &str,
        mut read: impl FnMut(&mut Self, &str, Pos, &Node) -> Option<()>,
    ) -> bool {
        match &n.val {
            Val::Map(es) => {
                let mut ok = true;
                for (k, kpos, v) in es {
                    // Every entry is read, so that every error is reported.
                    ok &= read(self, k, *kpos, v).is_some();
                }
                ok
            }
            other => {
                self.wrong_type(n.pos, place, Some(field), what, other);
                false
            }
        }
    }

    /// A codec: `json`, `bytes`, `string` or `{ protobuf: { descriptor_set, message } }`.
    pub(crate) fn codec(&mut self, n: &Node, place: &str, field: &str) -> Option<Format> {
        const NAMES: [&str; 4] = [
            "json",
            "bytes",
            "string",
            "{ protobuf: { descriptor_set, message } }",
        ];
        match &n.val {
            Val::Str(s) if s == "json" => Some(Format::Json),
            Val::Str(s) if s == "bytes" => Some(Format::Bytes),
            Val::Str(s) if s == "string" => Some(Format::String),
            Val::Map(es) if es.len() == 1 && es[0].0 == "protobuf" => {
                let inner = &es[0].2;
                let f = self.fields(inner, place, Some(field), &["descriptor_set", "message"])?;
                let ds = self
                    .required(&f, "descriptor_set", place)
                    .and_then(|n| self.string(n, place, "descriptor_set"));
                let msg = self
                    .required(&f, "message", place)
                    .and_then(|n| self.string(n, place, "message"));
                let (ds, msg) = (ds?, msg?);
                match ProtoFormat::from_file(self.base.join(&ds), &msg) {
                    Ok(p) => Some(Format::Protobuf(p)),
                    Err(e) => {
                        self.err(inner.pos, place, Some(field), e.to_string());
                        None
                    }
                }
            }
            Val::Str(s) => {
                self.err(
                    n.pos,
                    place,
                    Some(field),
                    unknown(&format!("format {s:?}"), s, &NAMES),
                );
                None
            }
            other => {
                self.err(
                    n.pos,
                    place,
                    Some(field),
                    format!(
                        "expected one of {}, found {}",
                        list(&NAMES),
                        other.type_name()
                    ),
                );
                None
            }
        }
    }
}

/// The error for a duration (as written, `text`) over [`MAX_DURATION`].
pub(crate) fn too_long(text: &str) -> String {
    format!("{text} is longer than 100 years, the longest duration onceflow takes")
}

/// The longest duration a topology file may give (100 years): longer ones are refused
/// where they are read, so that no deadline or sum of them overflows later.
pub(crate) const MAX_DURATION: std::time::Duration =
    std::time::Duration::from_secs(100 * 365 * 24 * 3600);

/// `ms` in the notation topology files use, in the largest of `h`, `m`, `s`, `ms` that
/// divides it evenly (`86400000` is `24h`, `90000` is `90s`, `1500` is `1500ms`), so that
/// `describe` shows a duration as a user would write it and the text reads back as the
/// same value. A negative `ms` is shown as `0ms`.
pub(crate) fn duration_text(ms: i64) -> String {
    let ms = ms.max(0);
    for (unit, size) in [("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if ms != 0 && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::duration_text;

    #[test]
    fn a_described_duration_reads_back_as_the_same_value() {
        let cases = [
            (86_400_000, "24h"),
            (604_800_000, "168h"),
            (5_400_000, "90m"),
            (90_000, "90s"),
            (1_500, "1500ms"),
            (0, "0ms"),
            (-5, "0ms"),
        ];
        for (ms, text) in cases {
            assert_eq!(duration_text(ms), text, "{ms} ms");
            let back = humantime::parse_duration(text).expect(text);
            assert_eq!(back.as_millis() as i64, ms.max(0), "{text}");
        }
    }
}
