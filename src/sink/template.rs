//! Templates over a record: idempotency keys, HTTP bodies, SQL parameters, Redis arguments.
//!
//! A template is text with placeholders in braces; `{{` and `}}` stand for literal braces.
//!
//! | placeholder | renders |
//! |---|---|
//! | `{key}` | the Kafka key, byte for byte |
//! | `{value}` | the whole value: byte for byte as read, or the record view as JSON when there is one (a stage changed it, or the source is protobuf) |
//! | `{value./order_id}` | the JSON field at that pointer (RFC 6901): a string as its UTF-8 bytes, a number as its decimal text |
//! | `{header.msg-id}` | the first header of that name, byte for byte |
//! | `{topic}`, `{partition}`, `{offset}` | where the record was read from its source (behind a repartition hop: the source record it was routed from) |
//! | `{timestamp}` | the record timestamp in ms |
//!
//! Rendering is strict: a missing or null field, header or key, or a field that is an object,
//! array or boolean, is an error naming it; nothing is ever replaced by an empty string.
//! Output is raw bytes: nothing is decoded or escaped, so any byte (`:`, `/`, non-UTF-8) is
//! kept as given; except that an idempotency key ([`Template::render_key_into`]) escapes
//! `%` and the template's literal bytes inside each placeholder's text, so that it is
//! never lossy.

use crate::codec::Format;
use crate::processor::json_scan::Scalar;
use crate::processor::key::KeySource;
use crate::processor::Record;
use std::io::Write as _;

/// One part of a parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Part {
    /// Literal bytes.
    Lit(Vec<u8>),
    /// `{key}`.
    Key,
    /// `{value}`.
    Value,
    /// `{value./ptr}`.
    Field(String),
    /// `{header.NAME}`.
    Header(String),
    /// `{topic}`.
    Topic,
    /// `{partition}`.
    Partition,
    /// `{offset}`.
    Offset,
    /// `{timestamp}`.
    Timestamp,
}

/// A parsed template; see the module docs for the syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Template {
    text: String,
    parts: Vec<Part>,
}

impl Template {
    /// Parse `text`.
    ///
    /// # Errors
    /// A sentence naming the unknown placeholder, an unclosed `{`, a stray `}`, or a JSON
    /// pointer that does not start with `/`.
    pub(crate) fn parse(text: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut lit = Vec::new();
        let b = text.as_bytes();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'{' if b.get(i + 1) == Some(&b'{') => {
                    lit.push(b'{');
                    i += 2;
                }
                b'}' if b.get(i + 1) == Some(&b'}') => {
                    lit.push(b'}');
                    i += 2;
                }
                b'}' => {
                    return Err(format!(
                    "template {text:?}: stray '}}' at byte {i} (write '}}}}' for a literal brace)"
                ))
                }
                b'{' => {
                    let end = text[i + 1..].find('}').ok_or_else(|| {
                        format!("template {text:?}: '{{' at byte {i} is never closed")
                    })? + i
                        + 1;
                    let name = &text[i + 1..end];
                    if !lit.is_empty() {
                        parts.push(Part::Lit(std::mem::take(&mut lit)));
                    }
                    parts.push(
                        parse_placeholder(name).map_err(|r| format!("template {text:?}: {r}"))?,
                    );
                    i = end + 1;
                }
                c => {
                    lit.push(c);
                    i += 1;
                }
            }
        }
        if !lit.is_empty() {
            parts.push(Part::Lit(lit));
        }
        Ok(Template {
            text: text.to_string(),
            parts,
        })
    }

    /// The template as written.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// Its parts.
    pub(crate) fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The JSON pointers it reads (appended to `out`, without repeats).
    pub(crate) fn json_pointers(&self, out: &mut Vec<String>) {
        for p in &self.parts {
            if let Part::Field(f) = p {
                if !out.contains(f) {
                    out.push(f.clone());
                }
            }
        }
    }

    /// Check the template against the source format: a field placeholder needs a source
    /// whose values have fields (`json`, or `protobuf` whose message type has the field).
    ///
    /// # Errors
    /// A sentence naming the field and the format (and, for protobuf, the missing field).
    pub(crate) fn check_format(&self, format: &Format) -> Result<(), String> {
        for p in &self.parts {
            let Part::Field(f) = p else { continue };
            match format {
                Format::Json => {}
                Format::Protobuf(pf) => {
                    let mut desc = pf.descriptor().clone();
                    for tok in crate::processor::json_scan::tokens(f) {
                        let Some(field) = desc.get_field_by_name(&tok) else {
                            return Err(format!(
                                "template {:?} reads field {f}, but protobuf message {} has no field {tok:?}",
                                self.text,
                                desc.full_name()
                            ));
                        };
                        match field.kind() {
                            prost_reflect::Kind::Message(m) if !field.is_list() && !field.is_map() => {
                                desc = m
                            }
                            _ => break, // a scalar, list or map: deeper tokens are not checked
                        }
                    }
                }
                Format::Bytes | Format::String => {
                    return Err(format!(
                        "template {:?} reads field {f}, but the source format is {}: its values have no fields",
                        self.text,
                        format.name()
                    ))
                }
            }
        }
        Ok(())
    }

    /// Render against `record`, appending to `out`.
    ///
    /// # Errors
    /// A sentence naming the missing or unusable part.
    pub(crate) fn render_into(&self, record: &Record, out: &mut Vec<u8>) -> Result<(), String> {
        for p in &self.parts {
            render_part(p, record, out)?;
        }
        Ok(())
    }

    /// Check that this template, used as an idempotency key, tells records apart: it needs
    /// a placeholder (else every record gets one key), and literal text between any two
    /// placeholders (else `{value./a}{value./b}` renders ("ab", "c") and ("a", "bc") alike).
    ///
    /// # Errors
    /// A sentence saying which rule the template breaks.
    pub(crate) fn check_key(&self) -> Result<(), String> {
        if self.parts.iter().all(|p| matches!(p, Part::Lit(_))) {
            return Err(format!(
                "{:?} has no placeholder, so every record would get the same key and every effect after the first would be skipped; use one such as {{value./id}}",
                self.text
            ));
        }
        if self
            .parts
            .iter()
            .any(|p| matches!(p, Part::Lit(l) if l.contains(&b'%')))
        {
            return Err(format!(
                "{:?} has `%` in its literal text, which reads like the `%XX` a placeholder's text is escaped with, so two different records could render one key; use another separator",
                self.text
            ));
        }
        for pair in self.parts.windows(2) {
            if !matches!(pair[0], Part::Lit(_)) && !matches!(pair[1], Part::Lit(_)) {
                return Err(format!(
                    "{:?} has two placeholders with nothing between them, so two different records could render one key; put a separator such as `:` between them",
                    self.text
                ));
            }
        }
        Ok(())
    }

    /// Render as an idempotency key, appending to `out`: as [`Template::render_into`], but
    /// inside each placeholder's text `%` and every byte that occurs in the template's
    /// literal text are written as `%XX` (hex), so that a separator never appears inside a
    /// value and two different records never render one key (with
    /// [`Template::check_key`]'s rules). `order-{value./id}` renders id `A-1` as
    /// `order-A%2D1`.
    ///
    /// # Errors
    /// As [`Template::render_into`].
    pub(crate) fn render_key_into(&self, record: &Record, out: &mut Vec<u8>) -> Result<(), String> {
        let mut escape = [false; 256];
        escape[usize::from(b'%')] = true;
        for p in &self.parts {
            if let Part::Lit(l) = p {
                for b in l {
                    escape[usize::from(*b)] = true;
                }
            }
        }
        let mut part = Vec::new();
        for p in &self.parts {
            if let Part::Lit(l) = p {
                out.extend_from_slice(l);
                continue;
            }
            part.clear();
            render_part(p, record, &mut part)?;
            for b in &part {
                if escape[usize::from(*b)] {
                    let _ = write!(out, "%{b:02X}");
                } else {
                    out.push(*b);
                }
            }
        }
        Ok(())
    }

    /// Render against `record` into a new buffer.
    ///
    /// # Errors
    /// As [`Template::render_into`].
    pub(crate) fn render(&self, record: &Record) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        self.render_into(record, &mut out)?;
        Ok(out)
    }
}

impl Template {
    /// Render as one line of a file sink: as [`Template::render`], but a `{value}` that is
    /// JSON spread over several lines (pretty-printed) is written without its line breaks.
    /// They are whitespace between tokens (JSON strings hold no raw line break), so the
    /// line is the same JSON, with its numbers and strings as read.
    ///
    /// # Errors
    /// As [`Template::render_into`].
    pub(crate) fn render_line(&self, record: &Record) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        for p in &self.parts {
            match (p, &record.json, &record.value) {
                (Part::Value, None, Some(v))
                    if v.iter().any(|b| matches!(b, b'\n' | b'\r'))
                        && serde_json::from_slice::<serde::de::IgnoredAny>(v).is_ok() =>
                {
                    out.extend(v.iter().filter(|b| !matches!(b, b'\n' | b'\r')));
                }
                _ => render_part(p, record, &mut out)?,
            }
        }
        Ok(out)
    }
}

/// Render one part of a template against `record`, appending to `out`.
fn render_part(p: &Part, record: &Record, out: &mut Vec<u8>) -> Result<(), String> {
    match p {
        Part::Lit(l) => out.extend_from_slice(l),
        Part::Key => match &record.key {
            Some(k) => out.extend_from_slice(k),
            None => return Err("{key}: the record has a null Kafka key".into()),
        },
        // The view when a stage changed it, or when the value bytes are not JSON text (a
        // string or protobuf source decodes one), as JSON; else the value bytes as read
        // (a JSON source's view made only to be read says the same, less exactly: numbers
        // as i64/f64). Scanned `fields` mark a value read as JSON text.
        Part::Value => match (&record.json, &record.value) {
            (Some(_), Some(v)) if !record.view_edited && record.fields.is_some() => {
                out.extend_from_slice(v)
            }
            (Some(view), _) => {
                serde_json::to_writer(&mut *out, view).map_err(|e| format!("{{value}}: {e}"))?
            }
            (None, Some(v)) => out.extend_from_slice(v),
            (None, None) => return Err("{value}: the record has a null value".into()),
        },
        Part::Header(h) => match record.header(h) {
            Some(Some(v)) => out.extend_from_slice(v),
            Some(None) => return Err(format!("{{header.{h}}}: the header is null")),
            None => return Err(format!("{{header.{h}}}: no such header")),
        },
        Part::Field(f) => field(record, f, out)?,
        Part::Topic => out.extend_from_slice(record.origin().topic.as_bytes()),
        Part::Partition => {
            let _ = write!(out, "{}", record.origin().partition);
        }
        Part::Offset => {
            let _ = write!(out, "{}", record.origin().offset);
        }
        Part::Timestamp => match record.timestamp {
            Some(t) => {
                let _ = write!(out, "{t}");
            }
            None => return Err("{timestamp}: the record has no timestamp".into()),
        },
    }
    Ok(())
}

fn parse_placeholder(name: &str) -> Result<Part, String> {
    Ok(match name {
        "key" => Part::Key,
        "value" => Part::Value,
        "topic" => Part::Topic,
        "partition" => Part::Partition,
        "offset" => Part::Offset,
        "timestamp" => Part::Timestamp,
        _ => {
            if let Some(ptr) = name.strip_prefix("value.") {
                if !ptr.starts_with('/') {
                    return Err(format!(
                        "{{{name}}}: a field is a JSON pointer starting with '/', e.g. {{value./id}}"
                    ));
                }
                Part::Field(ptr.to_string())
            } else if let Some(h) = name.strip_prefix("header.") {
                if h.is_empty() {
                    return Err("{header.}: the header name is empty".into());
                }
                Part::Header(h.to_string())
            } else {
                return Err(format!(
                    "unknown placeholder {{{name}}}; use key, value, value./pointer, header.NAME, topic, partition, offset or timestamp"
                ));
            }
        }
    })
}

fn field(record: &Record, ptr: &str, out: &mut Vec<u8>) -> Result<(), String> {
    if let Some((ptrs, vals)) = &record.fields {
        if let Some(i) = ptrs.iter().position(|p| p == ptr) {
            return match &vals[i] {
                Scalar::Missing => Err(format!("{{value.{ptr}}}: the field is missing")),
                Scalar::Null => Err(format!("{{value.{ptr}}}: the field is null")),
                Scalar::Str(s) | Scalar::Num(s) => {
                    out.extend_from_slice(s.as_bytes());
                    Ok(())
                }
                Scalar::Other(t) => Err(format!(
                    "{{value.{ptr}}}: the field is {t}, expected a string or a number"
                )),
            };
        }
    }
    // No scanned fields: read through the dedup key code, which also parses the value.
    let mut buf = Vec::new();
    let json_source = KeySource::JsonPointer(ptr.to_string());
    if record.json.is_some() {
        return json_source
            .extract_into(record, &mut buf)
            .map(|()| out.extend_from_slice(&buf))
            .map_err(|e| format!("{{value.{ptr}}}: {e}"));
    }
    let Some(v) = record.value.as_deref() else {
        return Err(format!("{{value.{ptr}}}: the record has a null value"));
    };
    let toks = vec![crate::processor::json_scan::tokens(ptr)];
    match crate::processor::json_scan::scan(v, &toks) {
        Ok(mut vals) => {
            let r = Record {
                fields: Some((vec![ptr.to_string()].into(), vec![vals.remove(0)])),
                ..record.clone()
            };
            field(&r, ptr, out)
        }
        Err(e) => Err(format!("{{value.{ptr}}}: the value is not JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(value: &str) -> Record {
        Record::for_test(
            b"k\xff1",
            value,
            &[("msg-id", b"m-1")],
            ("orders", 3, 42),
            7,
        )
    }

    #[test]
    fn renders_every_placeholder_as_raw_bytes() {
        let t = Template::parse(
            "{value./order_id}.invoice|{header.msg-id}|{key}|{topic}-{partition}-{offset}|{{x}}",
        )
        .unwrap();
        let out = t.render(&rec(r#"{"order_id": 9}"#)).unwrap();
        assert_eq!(out, b"9.invoice|m-1|k\xff1|orders-3-42|{x}".to_vec());
        let t = Template::parse("order-{value./o/id}:invoice").unwrap();
        assert_eq!(
            t.render(&rec(r#"{"o":{"id":"9"}}"#)).unwrap(),
            b"order-9:invoice"
        );
    }

    #[test]
    fn a_key_tells_records_apart() {
        let t = Template::parse("{value./a}-{value./b}").unwrap();
        t.check_key().unwrap();
        let mut seen = std::collections::HashMap::new();
        let texts = ["", "a", "-", "a-", "-a", "%", "%2D", "a-b", "b"];
        for a in texts {
            for b in texts {
                let v = serde_json::json!({ "a": a, "b": b }).to_string();
                let mut key = Vec::new();
                t.render_key_into(&rec(&v), &mut key).unwrap();
                if let Some(before) = seen.insert(key.clone(), (a, b)) {
                    panic!("{before:?} and {:?} both render {key:?}", (a, b));
                }
            }
        }
        let mut key = Vec::new();
        Template::parse("order-{value./id}")
            .unwrap()
            .render_key_into(&rec(r#"{"id":"A-1%"}"#), &mut key)
            .unwrap();
        assert_eq!(key, b"order-A%2D1%25");
        for (text, why) in [
            ("invoice", "no placeholder"),
            ("{value./a}{value./b}", "nothing between them"),
            ("x{key}{topic}y", "nothing between them"),
            // (a="x%", b="y") and (a="x", b="%y") both rendered `x%25%25y` (review helper).
            ("{value./a}%25{value./b}", "has `%` in its literal text"),
            ("k%{value./a}", "has `%` in its literal text"),
        ] {
            let e = Template::parse(text).unwrap().check_key().unwrap_err();
            assert!(e.contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn missing_parts_are_errors() {
        let t = Template::parse("{value./order_id}").unwrap();
        assert!(t.render(&rec("{}")).unwrap_err().contains("missing"));
        assert!(t
            .render(&rec(r#"{"order_id":null}"#))
            .unwrap_err()
            .contains("null"));
        assert!(t
            .render(&rec(r#"{"order_id":[1]}"#))
            .unwrap_err()
            .contains("array"));
        let t = Template::parse("{header.nope}").unwrap();
        assert!(t.render(&rec("{}")).unwrap_err().contains("no such header"));
    }

    #[test]
    fn parse_errors_name_the_problem() {
        assert!(Template::parse("{valu}")
            .unwrap_err()
            .contains("unknown placeholder {valu}"));
        assert!(Template::parse("{value.id}").unwrap_err().contains("'/'"));
        assert!(Template::parse("a{key")
            .unwrap_err()
            .contains("never closed"));
        assert!(Template::parse("a}b").unwrap_err().contains("stray"));
        let t = Template::parse("{value./id}").unwrap();
        assert!(t
            .check_format(&Format::Bytes)
            .unwrap_err()
            .contains("bytes"));
        assert!(t
            .check_format(&Format::String)
            .unwrap_err()
            .contains("string"));
        assert!(t.check_format(&Format::Json).is_ok());
    }
}
