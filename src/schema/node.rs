//! A located document tree: YAML (via `yaml-rust2` events with markers) and TOML (via
//! `toml`'s spanned document) both load into [`Node`]s that carry the line and column of
//! every value and key, so validation can name where each problem is.
//!
//! Loading is bounded: nesting deeper than [`MAX_DEPTH`] or more than [`MAX_NODES`] nodes
//! (aliases included, so an alias bomb cannot blow up) is an error, not a crash.

use std::fmt;

/// Deepest nesting of lists and maps accepted.
pub(crate) const MAX_DEPTH: usize = 64;
/// Most nodes accepted in one document (aliases count their copies).
pub(crate) const MAX_NODES: usize = 100_000;

/// A place in the file: 1-based line and column (columns count characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub(crate) struct Pos {
    /// Line, from 1.
    pub(crate) line: usize,
    /// Column, from 1.
    pub(crate) col: usize,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

/// A value with its position.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Node {
    /// Where the value starts.
    pub(crate) pos: Pos,
    /// The value.
    pub(crate) val: Val,
}

impl Node {
    /// The string value of field `key` when this node is a map that has it as a string
    /// (e.g. a stage's `name`, read first so later messages can use it).
    pub(crate) fn str_field(&self, key: &str) -> Option<String> {
        match &self.val {
            Val::Map(es) => {
                es.iter()
                    .find(|(k, _, _)| k == key)
                    .and_then(|(_, _, n)| match &n.val {
                        Val::Str(s) => Some(s.clone()),
                        _ => None,
                    })
            }
            _ => None,
        }
    }
}

/// The value of a [`Node`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Val {
    /// `null`, `~` or an empty YAML value.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string (a quoted scalar, or a plain one that is no other type).
    Str(String),
    /// A list.
    Seq(Vec<Node>),
    /// A map in file order: key (text, position) and value.
    Map(Vec<(String, Pos, Node)>),
}

impl Val {
    /// The type's name for messages: `a string`, `a map`, ...
    pub(crate) fn type_name(&self) -> &'static str {
        match self {
            Val::Null => "null",
            Val::Bool(_) => "a bool",
            Val::Int(_) => "an integer",
            Val::Float(_) => "a float",
            Val::Str(_) => "a string",
            Val::Seq(_) => "a list",
            Val::Map(_) => "a map",
        }
    }
}

/// A load failure: where and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LoadError {
    /// Where.
    pub(crate) pos: Pos,
    /// What.
    pub(crate) message: String,
}

// ---------------------------------------------------------------- YAML

mod yaml {
    use super::*;
    use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
    use yaml_rust2::scanner::{Marker, TScalarStyle};

    enum Frame {
        Seq(Pos, usize, Vec<Node>),
        Map(Pos, usize, Vec<(String, Pos, Node)>, Option<(String, Pos)>),
    }

    pub(super) struct Builder {
        stack: Vec<Frame>,
        anchors: std::collections::HashMap<usize, Node>,
        root: Option<Node>,
        error: Option<LoadError>,
        nodes: usize,
        docs: usize,
    }

    fn pos(m: &Marker) -> Pos {
        Pos {
            line: m.line(),
            col: m.col() + 1,
        }
    }

    fn count(n: &Node) -> usize {
        match &n.val {
            Val::Seq(v) => 1 + v.iter().map(count).sum::<usize>(),
            Val::Map(v) => 1 + v.iter().map(|(_, _, n)| count(n)).sum::<usize>(),
            _ => 1,
        }
    }

    fn plain(s: &str) -> Val {
        match s {
            "" | "~" | "null" | "Null" | "NULL" => return Val::Null,
            "true" | "True" | "TRUE" => return Val::Bool(true),
            "false" | "False" | "FALSE" => return Val::Bool(false),
            _ => {}
        }
        let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(i) = s.parse::<i64>() {
                return Val::Int(i);
            }
        }
        let looks_float = digits
            .bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'-' | b'+'))
            && digits.bytes().any(|b| b.is_ascii_digit())
            && digits.contains(['.', 'e', 'E']);
        if looks_float {
            if let Ok(f) = s.parse::<f64>() {
                return Val::Float(f);
            }
        }
        Val::Str(s.to_string())
    }

    impl Builder {
        pub(super) fn new() -> Self {
            Builder {
                stack: Vec::new(),
                anchors: Default::default(),
                root: None,
                error: None,
                nodes: 0,
                docs: 0,
            }
        }

        fn fail(&mut self, pos: Pos, message: impl Into<String>) {
            if self.error.is_none() {
                self.error = Some(LoadError {
                    pos,
                    message: message.into(),
                });
            }
        }

        /// Count `n` more values; false (and an error) past [`MAX_NODES`].
        fn bump(&mut self, n: usize, pos: Pos) -> bool {
            self.nodes = self.nodes.saturating_add(n);
            if self.nodes > MAX_NODES {
                self.fail(
                    pos,
                    format!("the document has more than {MAX_NODES} values"),
                );
                return false;
            }
            true
        }

        fn push_node(&mut self, node: Node, anchor: usize) {
            if anchor > 0 {
                self.anchors.insert(anchor, node.clone());
            }
            let mut problem: Option<(Pos, String)> = None;
            match self.stack.last_mut() {
                None => {
                    if self.root.is_none() {
                        self.root = Some(node);
                    }
                }
                Some(Frame::Seq(_, _, items)) => items.push(node),
                Some(Frame::Map(_, _, entries, key)) => match key.take() {
                    None => match node.val {
                        Val::Str(s) => *key = Some((s, node.pos)),
                        Val::Null | Val::Bool(_) | Val::Int(_) | Val::Float(_) => {
                            let text = match node.val {
                                Val::Bool(b) => b.to_string(),
                                Val::Int(i) => i.to_string(),
                                Val::Float(f) => f.to_string(),
                                _ => "null".to_string(),
                            };
                            *key = Some((text, node.pos));
                        }
                        _ => {
                            problem = Some((
                                node.pos,
                                "a map key must be a plain value, not a list or a map".into(),
                            ));
                        }
                    },
                    Some((k, kpos)) => {
                        if entries.iter().any(|(e, _, _)| *e == k) {
                            problem = Some((kpos, format!("duplicate key `{k}`")));
                        }
                        entries.push((k, kpos, node));
                    }
                },
            }
            if let Some((p, m)) = problem {
                self.fail(p, m);
            }
        }
    }

    impl MarkedEventReceiver for Builder {
        fn on_event(&mut self, ev: Event, mark: Marker) {
            if self.error.is_some() {
                return;
            }
            let p = pos(&mark);
            match ev {
                Event::DocumentStart => {
                    self.docs += 1;
                    if self.docs > 1 {
                        self.fail(p, "a topology file holds one YAML document, found another");
                    }
                }
                Event::Scalar(text, style, anchor, _tag) => {
                    if !self.bump(1, p) {
                        return;
                    }
                    let val = if style == TScalarStyle::Plain {
                        plain(&text)
                    } else {
                        Val::Str(text)
                    };
                    self.push_node(Node { pos: p, val }, anchor);
                }
                Event::SequenceStart(anchor, _) => {
                    if !self.bump(1, p) {
                        return;
                    }
                    if self.stack.len() >= MAX_DEPTH {
                        return self.fail(p, format!("nesting deeper than {MAX_DEPTH} levels"));
                    }
                    self.stack.push(Frame::Seq(p, anchor, Vec::new()));
                }
                Event::MappingStart(anchor, _) => {
                    if !self.bump(1, p) {
                        return;
                    }
                    if self.stack.len() >= MAX_DEPTH {
                        return self.fail(p, format!("nesting deeper than {MAX_DEPTH} levels"));
                    }
                    self.stack.push(Frame::Map(p, anchor, Vec::new(), None));
                }
                Event::SequenceEnd | Event::MappingEnd => match self.stack.pop() {
                    Some(Frame::Seq(sp, anchor, items)) => self.push_node(
                        Node {
                            pos: sp,
                            val: Val::Seq(items),
                        },
                        anchor,
                    ),
                    Some(Frame::Map(sp, anchor, entries, _)) => self.push_node(
                        Node {
                            // A block mapping's start is marked at its first `:`; place
                            // the map at its first key instead.
                            pos: entries.first().map_or(sp, |(_, kp, _)| sp.min(*kp)),
                            val: Val::Map(entries),
                        },
                        anchor,
                    ),
                    None => self.fail(p, "unbalanced YAML structure"),
                },
                Event::Alias(id) => match self.anchors.get(&id).cloned() {
                    Some(n) => {
                        if self.bump(count(&n), p) {
                            let val = n.val;
                            self.push_node(Node { pos: p, val }, 0)
                        }
                    }
                    None => self.fail(p, "alias to an unknown anchor"),
                },
                _ => {}
            }
        }
    }

    pub(super) fn load(text: &str) -> Result<Node, LoadError> {
        let mut b = Builder::new();
        let mut parser = Parser::new_from_str(text);
        if let Err(e) = parser.load(&mut b, true) {
            let m = e.marker();
            return Err(LoadError {
                pos: pos(m),
                message: format!("YAML syntax: {}", e.info()),
            });
        }
        if let Some(e) = b.error {
            return Err(e);
        }
        Ok(b.root.unwrap_or(Node {
            pos: Pos { line: 1, col: 1 },
            val: Val::Null,
        }))
    }
}

/// Load YAML text (one document).
///
/// # Errors
/// A syntax error, a duplicate key, a non-scalar key, too deep or too large a document.
pub(crate) fn load_yaml(text: &str) -> Result<Node, LoadError> {
    yaml::load(text)
}

// ---------------------------------------------------------------- TOML

/// Line starts of a text, to turn byte offsets into positions.
struct Lines<'a> {
    text: &'a str,
    starts: Vec<usize>,
}

impl<'a> Lines<'a> {
    fn new(text: &'a str) -> Self {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Lines { text, starts }
    }

    fn pos(&self, offset: usize) -> Pos {
        let offset = offset.min(self.text.len());
        let line = self.starts.partition_point(|&s| s <= offset).max(1);
        let start = self.starts[line - 1];
        let col = self
            .text
            .get(start..offset)
            .map_or(offset - start, |s| s.chars().count())
            + 1;
        Pos { line, col }
    }
}

/// Deepest bracket nesting in TOML text (outside strings, roughly): checked before parsing,
/// so a pathological input cannot recurse deeply in the parser.
fn toml_nesting(text: &str) -> usize {
    let (mut depth, mut max, mut in_str, mut quote) = (0usize, 0usize, false, '"');
    let mut prev = ' ';
    for c in text.chars() {
        if in_str {
            if c == quote && prev != '\\' {
                in_str = false;
            }
        } else {
            match c {
                '"' | '\'' => {
                    in_str = true;
                    quote = c;
                }
                '[' | '{' => {
                    depth += 1;
                    max = max.max(depth);
                }
                ']' | '}' => depth = depth.saturating_sub(1),
                '\n' => {}
                _ => {}
            }
        }
        prev = c;
    }
    max
}

/// Load TOML text.
///
/// # Errors
/// A syntax error (the parser's message), or too deep a document.
pub(crate) fn load_toml(text: &str) -> Result<Node, LoadError> {
    use toml::de::{DeTable, DeValue};
    use toml::Spanned;
    let lines = Lines::new(text);
    if toml_nesting(text) > MAX_DEPTH {
        return Err(LoadError {
            pos: Pos { line: 1, col: 1 },
            message: format!("nesting deeper than {MAX_DEPTH} levels"),
        });
    }
    let doc = DeTable::parse(text).map_err(|e| LoadError {
        pos: lines.pos(e.span().map_or(0, |s| s.start)),
        message: format!("TOML syntax: {}", e.message().trim()),
    })?;
    fn conv(v: &Spanned<DeValue<'_>>, lines: &Lines<'_>) -> Node {
        let pos = lines.pos(v.span().start);
        let val = match v.get_ref() {
            DeValue::String(s) => Val::Str(s.to_string()),
            DeValue::Integer(i) => {
                let digits = i.as_str().replace('_', "");
                match i64::from_str_radix(&digits, i.radix()) {
                    Ok(n) => Val::Int(n),
                    Err(_) => Val::Str(i.as_str().to_string()),
                }
            }
            DeValue::Float(f) => {
                Val::Float(f.as_str().replace('_', "").parse().unwrap_or(f64::NAN))
            }
            DeValue::Boolean(b) => Val::Bool(*b),
            DeValue::Datetime(d) => Val::Str(d.to_string()),
            DeValue::Array(a) => Val::Seq(a.iter().map(|x| conv(x, lines)).collect()),
            DeValue::Table(t) => Val::Map(table(t, lines)),
        };
        Node { pos, val }
    }
    fn table(t: &DeTable<'_>, lines: &Lines<'_>) -> Vec<(String, Pos, Node)> {
        let mut entries: Vec<(usize, String, Pos, Node)> = t
            .iter()
            .map(|(k, v)| {
                (
                    k.span().start,
                    k.get_ref().to_string(),
                    lines.pos(k.span().start),
                    conv(v, lines),
                )
            })
            .collect();
        entries.sort_by_key(|e| e.0);
        entries.into_iter().map(|(_, k, p, n)| (k, p, n)).collect()
    }
    Ok(Node {
        pos: Pos { line: 1, col: 1 },
        val: Val::Map(table(doc.get_ref(), &lines)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_positions_and_types() {
        let n = load_yaml("a: 1\nb:\n  - x\n  - 'true'\n  - true\nc: {d: 2.5, e: ~}\n").unwrap();
        let Val::Map(m) = &n.val else { panic!() };
        assert_eq!(m[0].0, "a");
        assert_eq!(m[0].1, Pos { line: 1, col: 1 });
        assert_eq!(m[0].2.pos, Pos { line: 1, col: 4 });
        assert_eq!(m[0].2.val, Val::Int(1));
        let Val::Seq(s) = &m[1].2.val else { panic!() };
        assert_eq!(s[0].pos, Pos { line: 3, col: 5 });
        assert_eq!(s[1].val, Val::Str("true".into()));
        assert_eq!(s[2].val, Val::Bool(true));
        let Val::Map(c) = &m[2].2.val else { panic!() };
        assert_eq!(c[0].2.val, Val::Float(2.5));
        assert_eq!(c[1].2.val, Val::Null);
        assert_eq!(c[1].1, Pos { line: 6, col: 13 });
    }

    #[test]
    fn yaml_errors() {
        assert_eq!(
            load_yaml("a: 1\na: 2\n").unwrap_err(),
            LoadError {
                pos: Pos { line: 2, col: 1 },
                message: "duplicate key `a`".into()
            }
        );
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(load_yaml(&deep)
            .unwrap_err()
            .message
            .contains("nesting deeper"));
        let bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n";
        assert!(load_yaml(bomb).unwrap_err().message.contains("more than"));
    }

    #[test]
    fn toml_positions_in_file_order() {
        let n = load_toml("z = 1\na = \"s\"\n[t]\nk = [1, 2]\n").unwrap();
        let Val::Map(m) = &n.val else { panic!() };
        let keys: Vec<&str> = m.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(keys, ["z", "a", "t"]);
        assert_eq!(m[1].2.pos, Pos { line: 2, col: 5 });
        let Val::Map(t) = &m[2].2.val else { panic!() };
        assert_eq!(t[0].1, Pos { line: 4, col: 1 });
        let e = load_toml("a = \n").unwrap_err();
        assert_eq!(e.pos.line, 1);
    }
}
