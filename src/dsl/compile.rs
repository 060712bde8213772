//! The document's top level: name, source, tables and the stage list (each stage read by
//! its kind, see `topology::stage`).

use super::*;

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
        // A topic has one format: two stages writing one topic in different formats would
        // leave one of them writing the other's.
        let mut formats: HashMap<String, (Format, String)> = HashMap::new();
        for (i, st) in stages.into_iter().enumerate() {
            match st {
                Some((name, kind, format)) => {
                    self.builder_index.push(i);
                    if let Some(f) = format {
                        for t in kind.output_topics() {
                            match formats.get(&t) {
                                Some((g, by)) if *g != f => {
                                    let (pos, place, fields) = &self.stage_pos[i];
                                    let (pos, place) = (
                                        fields.get("format").copied().unwrap_or(*pos),
                                        place.clone(),
                                    );
                                    let msg = format!(
                                        "topic {t} is written as {} by stage `{by}`; a topic has one format",
                                        g.describe()
                                    );
                                    self.err(pos, &place, Some("format"), msg);
                                }
                                Some(_) => {}
                                None => {
                                    formats.insert(t.clone(), (f.clone(), name.clone()));
                                }
                            }
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
    /// (see `topology::stage`), whose [`FileKind`](crate::topology::stage::FileKind) reads it.
    pub(crate) fn stage(
        &mut self,
        i: usize,
        item: &Node,
    ) -> Option<(String, StageKind, Option<Format>)> {
        let anon = format!("stage #{}", i + 1);
        self.stage_pos
            .push((item.pos, anon.clone(), HashMap::new()));
        let keys = crate::topology::stage::file_keys();
        let Val::Map(entries) = &item.val else {
            self.err(
                item.pos,
                &anon,
                None,
                format!(
                    "expected a map with one key naming the stage kind ({}), found {}",
                    crate::schema::list(&keys),
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
                    crate::schema::list(&keys),
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
        let Some(file_kind) = crate::topology::stage::file_kind(kind) else {
            self.err(
                *kpos,
                &anon,
                None,
                crate::schema::unknown(&format!("stage kind `{kind}`"), kind, &keys),
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
        let read = (file_kind.read)(&mut self.r, &f, &place);
        self.stage_pos.last_mut().expect("pushed above").2 = std::mem::take(&mut self.r.field_pos);
        let (kind, format) = read?;
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
