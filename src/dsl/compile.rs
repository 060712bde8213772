//! The compiler's core: reporting errors with positions, reading typed fields, and the
//! document's top level (name, source, tables, the stage list).

use super::*;

impl Compiler {
    pub(super) fn err(
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
    pub(super) fn wrong_type(
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
    pub(super) fn fields<'a>(
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
                self.err(
                    *kpos,
                    place,
                    Some(k),
                    format!("unknown field, expected one of {}", list(allowed)),
                );
            }
        }
        Some(out)
    }

    pub(super) fn required<'a>(
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

    pub(super) fn string(&mut self, n: &Node, place: &str, field: &str) -> Option<String> {
        match &n.val {
            Val::Str(s) => Some(s.clone()),
            other => {
                self.wrong_type(n.pos, place, Some(field), "a string", other);
                None
            }
        }
    }

    pub(super) fn duration_ms(&mut self, n: &Node, place: &str, field: &str) -> Option<i64> {
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
            Ok(d) => Some(d.as_millis().min(i64::MAX as u128) as i64),
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

    pub(super) fn choice(
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
                format!("unknown value {s:?}, expected one of {}", list(allowed)),
            );
            None
        }
    }

    /// An expression: a string (or a bool or number, taken as its text).
    pub(super) fn expr_text(&mut self, n: &Node, place: &str, field: &str) -> Option<String> {
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

    pub(super) fn func<T: crate::processor::expr::FromCel>(
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
    pub(super) fn field_path(
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
}

impl Compiler {
    pub(super) fn topology(&mut self, root: &Node) -> Option<TopologyBuilder> {
        let f = self.fields(
            root,
            "top level",
            None,
            &["name", "source", "tables", "stages"],
        )?;
        for (k, p, _) in &f.entries {
            self.top_pos.insert(format!("topology.{k}"), *p);
            self.top_pos.insert(k.to_string(), *p);
        }
        let name = self
            .required(&f, "name", "top level")
            .and_then(|n| self.string(n, "top level", "name"));
        self.name_failed = name.is_none();
        let source = self
            .required(&f, "source", "top level")
            .and_then(|n| self.source(n));
        self.source_failed = source.is_none();
        let mut stages = Vec::new();
        self.incomplete = true;
        if let Some(sn) = self.required(&f, "stages", "top level") {
            match &sn.val {
                Val::Seq(items) => {
                    self.incomplete = false;
                    for (i, item) in items.iter().enumerate() {
                        stages.push(self.stage(i, item));
                    }
                }
                other => self.err(
                    sn.pos,
                    "top level",
                    Some("stages"),
                    format!("expected a list of stages, found {}", other.type_name()),
                ),
            }
        }
        let mut b = TopologyBuilder::new(name.unwrap_or_default());
        if let Some((topic, format)) = source {
            b = b.source(topic, format);
        }
        if let Some(tn) = f.get("tables") {
            match &tn.val {
                Val::Seq(items) => {
                    for (i, item) in items.iter().enumerate() {
                        if let Some(t) = self.table(i, item) {
                            b = b.table(t);
                        }
                    }
                }
                other => self.err(
                    tn.pos,
                    "top level",
                    Some("tables"),
                    format!("expected a list of tables, found {}", other.type_name()),
                ),
            }
        }
        // The stages that compiled go to the builder, so its checks (duplicate names, topic
        // names, ...) are reported with the file's own errors.
        for (i, st) in stages.into_iter().enumerate() {
            match st {
                Some((name, kind, format)) => {
                    self.builder_index.push(i);
                    if let (Some(f), StageKind::Sink(k)) = (format, &kind) {
                        for t in &k.topics {
                            b = b.topic_format(t.clone(), f.clone());
                        }
                    }
                    b = b.stage(name, kind);
                }
                None => self.incomplete = true,
            }
        }
        Some(b)
    }

    /// A codec: `json`, `bytes`, `string` or `{ protobuf: { descriptor_set, message } }`.
    pub(super) fn codec(&mut self, n: &Node, place: &str, field: &str) -> Option<Format> {
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
                    format!("unknown format {s:?}, expected one of {}", list(&NAMES)),
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

    pub(super) fn source(&mut self, n: &Node) -> Option<(String, Format)> {
        let place = "source";
        self.top_pos.insert("source".into(), n.pos);
        let f = self.fields(n, place, None, &["topic", "format"])?;
        for (k, _, v) in &f.entries {
            self.top_pos.insert(format!("source.{k}"), v.pos);
        }
        let topic = self
            .required(&f, "topic", place)
            .and_then(|n| self.string(n, place, "topic"));
        let format = match f.get("format") {
            None => Some(Format::Json),
            Some(n) => self.codec(n, place, "format"),
        };
        Some((topic?, format?))
    }

    /// One item of `stages:`. Always records the stage's position (so builder errors can be
    /// placed), and returns the stage if it compiled.
    pub(super) fn stage(
        &mut self,
        i: usize,
        item: &Node,
    ) -> Option<(String, StageKind, Option<Format>)> {
        let anon = format!("stage #{}", i + 1);
        self.stage_pos
            .push((item.pos, anon.clone(), HashMap::new()));
        let Val::Map(entries) = &item.val else {
            self.err(
                item.pos,
                &anon,
                None,
                format!(
                    "expected a map with one key naming the stage kind ({}), found {}",
                    list(&STAGE_KINDS),
                    item.val.type_name()
                ),
            );
            return None;
        };
        if entries.len() != 1 {
            self.err(
                item.pos,
                &anon,
                None,
                format!(
                    "expected one key naming the stage kind ({}), found {}",
                    list(&STAGE_KINDS),
                    if entries.is_empty() {
                        "none".to_string()
                    } else {
                        entries
                            .iter()
                            .map(|(k, _, _)| format!("`{k}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ),
            );
            return None;
        }
        let (kind, kpos, body) = &entries[0];
        if !STAGE_KINDS.contains(&kind.as_str()) {
            self.err(
                *kpos,
                &anon,
                None,
                format!(
                    "unknown stage kind `{kind}`, expected one of {}",
                    list(&STAGE_KINDS)
                ),
            );
            return None;
        }
        let allowed: &[&str] = match kind.as_str() {
            "dedup" => &[
                "name",
                "key",
                "ttl",
                "time",
                "grace",
                "max_keys",
                "fingerprint",
                "on_conflict",
                "duplicates_to",
                "partitioning",
            ],
            "filter" => &["name", "when"],
            "map" => &["name", "set", "rename", "drop"],
            "route" => &["name", "routes", "default"],
            "enrich" => &["name", "table", "key", "into", "on_missing"],
            _ => &["name", "topic", "topics", "key", "headers", "format"],
        };
        // The stage's name first, so every later message can use it.
        let name = body.str_field("name");
        let default_name = match kind.as_str() {
            "dedup" => "dedup".to_string(),
            "enrich" => match &body.val {
                Val::Map(es) => es
                    .iter()
                    .find(|(k, _, _)| k == "table")
                    .and_then(|(_, _, n)| match &n.val {
                        Val::Str(s) => Some(format!("enrich-{s}")),
                        _ => None,
                    })
                    .unwrap_or_else(|| format!("enrich-{}", i + 1)),
                _ => format!("enrich-{}", i + 1),
            },
            "sink" => match &body.val {
                Val::Map(es) => es
                    .iter()
                    .find(|(k, _, _)| k == "topic")
                    .and_then(|(_, _, n)| match &n.val {
                        // Characters a stage name may not hold become `_`: a bad topic is
                        // reported once, under `topic`.
                        Val::Str(s) => Some(format!(
                            "sink-{}",
                            s.replace(
                                |c: char| !(c.is_ascii_alphanumeric() || "-_.".contains(c)),
                                "_"
                            )
                        )),
                        _ => None,
                    })
                    .unwrap_or_else(|| format!("sink-{}", i + 1)),
                _ => format!("sink-{}", i + 1),
            },
            k if EXTERNAL_KINDS.contains(&k) => k.to_string(),
            k => format!("{k}-{}", i + 1),
        };
        let name = name.unwrap_or(default_name);
        let place = format!("stage `{name}` ({kind})");
        if EXTERNAL_KINDS.contains(&kind.as_str()) {
            self.stage_pos.last_mut().expect("pushed above").1 = place.clone();
            return self.external(kind, body, &place).map(|(n, k)| (n, k, None));
        }
        let f = self.fields(body, &place, None, allowed)?;
        {
            let entry = self.stage_pos.last_mut().expect("pushed above");
            entry.1 = place.clone();
            for (k, _, v) in &f.entries {
                if let Some(a) = allowed.iter().find(|a| **a == *k) {
                    entry.2.insert(*a, v.pos);
                }
            }
        }
        if let Some(n) = f.get("name") {
            self.string(n, &place, "name");
        }
        let mut format = None;
        let kind = match kind.as_str() {
            "dedup" => StageKind::Dedup(self.dedup(&f, &place)?),
            "filter" => StageKind::Filter(self.filter(&f, &place)?),
            "map" => StageKind::Map(self.map(&f, &place)?),
            "route" => StageKind::Route(self.route(&f, &place)?),
            "enrich" => StageKind::Enrich(self.enrich(&f, &place)?),
            _ => {
                if let Some(n) = f.get("format") {
                    format = Some(self.codec(n, &place, "format")?);
                }
                StageKind::Sink(self.sink(&f, &place)?)
            }
        };
        Some((name, kind, format))
    }

    /// One item of `tables:`.
    pub(super) fn table(&mut self, i: usize, item: &Node) -> Option<TableSpec> {
        let anon = format!("table #{}", i + 1);
        let name = item.str_field("name");
        let place = name.as_ref().map_or(anon, |n| format!("table `{n}`"));
        let f = self.fields(item, &place, None, &["name", "topic", "format"])?;
        if let Some(n) = &name {
            // The builder names a table's errors `table <name>`.
            self.top_pos.insert(format!("table {n}"), f.pos);
            for (k, _, v) in &f.entries {
                self.top_pos.insert(format!("table {n}.{k}"), v.pos);
            }
            self.top_place.insert(format!("table {n}"), place.clone());
        }
        let name = self
            .required(&f, "name", &place)
            .and_then(|n| self.string(n, &place, "name"));
        let topic = self
            .required(&f, "topic", &place)
            .and_then(|n| self.string(n, &place, "topic"));
        let format = match f.get("format") {
            None => Some(Format::Json),
            Some(n) => self.codec(n, &place, "format"),
        };
        Some(TableSpec::new(name?, topic?).format(format?))
    }
}
