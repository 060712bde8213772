//! The compiler's core: reporting errors with positions, reading typed fields, and the
//! document's top level (name, source, tables, the stage list).

use super::*;

impl Compiler {
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

    /// A duration such as `24h` or `90s`.
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
        if let Some(entry) = self.stage_pos.last_mut() {
            entry.2.insert(field.to_string(), pos);
        }
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
                format!("unknown value {s:?}, expected one of {}", list(allowed)),
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
        let bad = |c: &mut Compiler, what: &str| {
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
                            format!(
                                "unknown key source `{other}`, expected one of {}",
                                list(&KINDS)
                            ),
                        );
                        None
                    }
                }
            }
            other => bad(self, other.type_name()),
        }
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
}

impl Compiler {
    pub(crate) fn topology(&mut self, root: &Node) -> Option<TopologyBuilder> {
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
                    if let Some(f) = format {
                        for t in kind.output_topics() {
                            b = b.topic_format(t, f.clone());
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

    pub(crate) fn source(&mut self, n: &Node) -> Option<(String, Format)> {
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
    /// placed), and returns the stage if it compiled. The item's one key names its kind
    /// (see `crate::stage`), whose [`FileKind`](crate::stage::FileKind) reads it.
    pub(crate) fn stage(
        &mut self,
        i: usize,
        item: &Node,
    ) -> Option<(String, StageKind, Option<Format>)> {
        let anon = format!("stage #{}", i + 1);
        self.stage_pos
            .push((item.pos, anon.clone(), HashMap::new()));
        let keys = crate::stage::file_keys();
        let Val::Map(entries) = &item.val else {
            self.err(
                item.pos,
                &anon,
                None,
                format!(
                    "expected a map with one key naming the stage kind ({}), found {}",
                    list(&keys),
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
                    list(&keys),
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
        let Some(file_kind) = crate::stage::file_kind(kind) else {
            self.err(
                *kpos,
                &anon,
                None,
                format!(
                    "unknown stage kind `{kind}`, expected one of {}",
                    list(&keys)
                ),
            );
            return None;
        };
        // The stage's name first, so every later message can use it.
        let name = body
            .str_field("name")
            .unwrap_or_else(|| (file_kind.default_name)(body, i));
        let place = format!("stage `{name}` ({kind})");
        self.stage_pos.last_mut().expect("pushed above").1 = place.clone();
        let f = self.fields(body, &place, None, file_kind.fields)?;
        for (k, _, v) in &f.entries {
            self.note_field_pos(k, v.pos);
        }
        if let Some(n) = f.get("name") {
            self.string(n, &place, "name");
        }
        let (kind, format) = (file_kind.read)(self, &f, &place)?;
        Some((name, kind, format))
    }

    /// One item of `tables:`.
    pub(crate) fn table(&mut self, i: usize, item: &Node) -> Option<TableSpec> {
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
