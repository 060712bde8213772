//! Each stage kind's fields, read into its spec: key, dedup (with fingerprint), filter, map,
//! route, sink, enrich, and the external sinks.

use super::*;

impl Compiler {
    pub(super) fn key(&mut self, n: &Node, place: &str) -> Option<KeySource> {
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

    pub(super) fn dedup(&mut self, f: &Fields<'_>, place: &str) -> Option<DedupSpec> {
        let key = self
            .required(f, "key", place)
            .and_then(|n| self.key(n, place));
        let mut ok = key.is_some();
        let mut spec = DedupSpec::new(key.unwrap_or(KeySource::KafkaKey));
        if let Some(n) = f.get("ttl") {
            match self.duration_ms(n, place, "ttl") {
                Some(ms) => spec.ttl_ms = ms,
                None => ok = false,
            }
        }
        if let Some(n) = f.get("grace") {
            match self.duration_ms(n, place, "grace") {
                Some(ms) => spec.grace_ms = ms,
                None => ok = false,
            }
        }
        if let Some(n) = f.get("time") {
            match self
                .choice(n, place, "time", &["event", "processing"])
                .as_deref()
            {
                Some("processing") => spec.time = TimeSource::Processing,
                Some(_) => spec.time = TimeSource::Event,
                None => ok = false,
            }
        }
        if let Some(n) = f.get("max_keys") {
            match &n.val {
                Val::Int(i) if *i > 0 => spec.max_keys = Some(*i as u64),
                other => {
                    ok = false;
                    self.err(
                        n.pos,
                        place,
                        Some("max_keys"),
                        format!(
                            "expected a positive integer, found {}",
                            match other {
                                Val::Int(i) => i.to_string(),
                                o => o.type_name().to_string(),
                            }
                        ),
                    );
                }
            }
        }
        if let Some(n) = f.get("fingerprint") {
            match self.fingerprint(n, place) {
                Some((on, fields)) => {
                    spec.fingerprint = on;
                    spec.fingerprint_fields = fields;
                }
                None => ok = false,
            }
        }
        if let Some(n) = f.get("on_conflict") {
            match self
                .choice(
                    n,
                    place,
                    "on_conflict",
                    &["drop", "pass", "dead_letter", "duplicates_to"],
                )
                .as_deref()
            {
                Some("pass") => spec.on_conflict = ConflictPolicy::Pass,
                Some("dead_letter") => spec.on_conflict = ConflictPolicy::DeadLetter,
                Some("duplicates_to") => spec.on_conflict = ConflictPolicy::DuplicatesTo,
                Some(_) => spec.on_conflict = ConflictPolicy::Drop,
                None => ok = false,
            }
        }
        if let Some(n) = f.get("duplicates_to") {
            match self.string(n, place, "duplicates_to") {
                Some(t) => spec.duplicates_to = Some(t),
                None => ok = false,
            }
        }
        if let Some(n) = f.get("partitioning") {
            match self
                .choice(n, place, "partitioning", &["source", "repartition"])
                .as_deref()
            {
                Some("source") => spec.partitioning = Some(Partitioning::Source),
                Some(_) => spec.partitioning = Some(Partitioning::Repartition),
                None => ok = false,
            }
        }
        ok.then_some(spec)
    }

    /// `fingerprint: true | false | { cover: [pointers], ignore: [pointers] }`: whether it is
    /// on, and the fields it is taken over (`None`: the value bytes).
    pub(super) fn fingerprint(
        &mut self,
        n: &Node,
        place: &str,
    ) -> Option<(
        bool,
        Option<crate::processor::fingerprint::FingerprintFields>,
    )> {
        const FIELD: &str = "fingerprint";
        let entries = match &n.val {
            Val::Bool(b) => return Some((*b, None)),
            Val::Map(es) => es,
            other => {
                self.wrong_type(
                    n.pos,
                    place,
                    Some(FIELD),
                    "true, false or { cover: [json pointers], ignore: [json pointers] }",
                    other,
                );
                return None;
            }
        };
        let mut fields = crate::processor::fingerprint::FingerprintFields::default();
        for (k, _, v) in entries {
            let list = match k.as_str() {
                "cover" => &mut fields.cover,
                "ignore" => &mut fields.ignore,
                other => {
                    self.err(
                        n.pos,
                        place,
                        Some(FIELD),
                        format!("unknown field `{other}`, expected cover or ignore"),
                    );
                    return None;
                }
            };
            let Val::Seq(items) = &v.val else {
                self.err(
                    n.pos,
                    place,
                    Some(FIELD),
                    format!(
                        "{k}: expected a list of JSON pointers, found {}",
                        v.val.type_name()
                    ),
                );
                return None;
            };
            for item in items {
                match &item.val {
                    Val::Str(p) => list.push(p.clone()),
                    other => {
                        self.err(
                            n.pos,
                            place,
                            Some(FIELD),
                            format!("{k}: expected a JSON pointer, found {}", other.type_name()),
                        );
                        return None;
                    }
                }
            }
        }
        if let Err(r) = fields.validate() {
            self.err(n.pos, place, Some(FIELD), r);
            return None;
        }
        Some((true, Some(fields)))
    }

    pub(super) fn filter(&mut self, f: &Fields<'_>, place: &str) -> Option<FilterSpec> {
        let n = self.required(f, "when", place)?;
        let predicate: Predicate = self.func(n, place, "when")?;
        Some(FilterSpec { predicate })
    }

    pub(super) fn map(&mut self, f: &Fields<'_>, place: &str) -> Option<MapSpec> {
        let mut spec = MapSpec::new();
        let mut ok = true;
        if f.get("set").is_none() && f.get("rename").is_none() && f.get("drop").is_none() {
            self.err(
                f.pos,
                place,
                None,
                "a map stage needs at least one of set, rename, drop",
            );
            return None;
        }
        if let Some(n) = f.get("set") {
            ok &= self.each_entry(
                n,
                place,
                "set",
                "a map of field to expression",
                |c, k, kpos, v| {
                    let path = c.field_path(k, kpos, place, "set");
                    let func: Option<Computed> = c.func(v, place, "set");
                    spec.set.push((path?, func?));
                    Some(())
                },
            );
        }
        if let Some(n) = f.get("rename") {
            ok &= self.each_entry(
                n,
                place,
                "rename",
                "a map of old name to new name",
                |c, k, kpos, v| {
                    let from = c.field_path(k, kpos, place, "rename");
                    let to = c
                        .string(v, place, "rename")
                        .and_then(|t| c.field_path(&t, v.pos, place, "rename"));
                    spec.rename.push((from?, to?));
                    Some(())
                },
            );
        }
        if let Some(n) = f.get("drop") {
            match &n.val {
                Val::Seq(items) => {
                    for it in items {
                        match self
                            .string(it, place, "drop")
                            .and_then(|t| self.field_path(&t, it.pos, place, "drop"))
                        {
                            Some(p) => spec.drop.push(p),
                            None => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.wrong_type(n.pos, place, Some("drop"), "a list of field names", other);
                }
            }
        }
        ok.then_some(spec)
    }

    pub(super) fn route(&mut self, f: &Fields<'_>, place: &str) -> Option<RouteSpec> {
        let mut spec = RouteSpec::new();
        let mut ok = true;
        if let Some(n) = self.required(f, "routes", place) {
            match &n.val {
                Val::Seq(items) => {
                    for it in items {
                        let Some(bf) = self.fields(it, place, Some("routes"), &["when", "to"])
                        else {
                            ok = false;
                            continue;
                        };
                        let when: Option<Predicate> = match bf.get("when") {
                            Some(w) => self.func(w, place, "when"),
                            None => {
                                self.err(bf.pos, place, Some("when"), "missing field (in a route)");
                                None
                            }
                        };
                        let to = match bf.get("to") {
                            Some(t) => self.string(t, place, "to"),
                            None => {
                                self.err(bf.pos, place, Some("to"), "missing field (in a route)");
                                None
                            }
                        };
                        match (when, to) {
                            (Some(when), Some(topic)) => {
                                spec.branches.push(RouteBranch { when, topic })
                            }
                            _ => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.err(
                        n.pos,
                        place,
                        Some("routes"),
                        format!(
                            "expected a list of {{when, to}} maps, found {}",
                            other.type_name()
                        ),
                    );
                }
            }
        } else {
            ok = false;
        }
        if let Some(n) = f.get("default") {
            match self.string(n, place, "default") {
                Some(t) => spec.default = Some(t),
                None => ok = false,
            }
        }
        ok.then_some(spec)
    }

    pub(super) fn sink(&mut self, f: &Fields<'_>, place: &str) -> Option<SinkSpec> {
        let mut ok = true;
        let mut topics = Vec::new();
        match (f.get("topic"), f.get("topics")) {
            (Some(_), Some(n)) => {
                ok = false;
                self.err(
                    n.pos,
                    place,
                    Some("topics"),
                    "give either topic or topics, not both",
                );
            }
            (None, None) => {
                ok = false;
                self.err(f.pos, place, Some("topic"), "missing field (or topics)");
            }
            (Some(n), None) => match self.string(n, place, "topic") {
                Some(t) => topics.push(t),
                None => ok = false,
            },
            (None, Some(n)) => match &n.val {
                Val::Seq(items) => {
                    for it in items {
                        match self.string(it, place, "topics") {
                            Some(t) => topics.push(t),
                            None => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.wrong_type(n.pos, place, Some("topics"), "a list of topics", other);
                }
            },
        }
        let mut spec = SinkSpec {
            topics,
            key: None,
            headers: Vec::new(),
        };
        if let Some(n) = f.get("key") {
            let k: Option<BytesFn> = self.func(n, place, "key");
            match k {
                Some(k) => spec.key = Some(k),
                None => ok = false,
            }
        }
        if let Some(n) = f.get("headers") {
            match &n.val {
                Val::Map(es) => {
                    for (h, _, v) in es {
                        let func: Option<BytesFn> = self.func(v, place, "headers");
                        match func {
                            Some(fun) => spec.headers.push((h.clone(), fun)),
                            None => ok = false,
                        }
                    }
                }
                other => {
                    ok = false;
                    self.wrong_type(
                        n.pos,
                        place,
                        Some("headers"),
                        "a map of header name to expression",
                        other,
                    );
                }
            }
        }
        ok.then_some(spec)
    }

    pub(super) fn enrich(&mut self, f: &Fields<'_>, place: &str) -> Option<EnrichSpec> {
        let table = self
            .required(f, "table", place)
            .and_then(|n| self.string(n, place, "table"));
        let key = self
            .required(f, "key", place)
            .and_then(|n| self.key(n, place));
        let into = match f.get("into") {
            None => table.as_ref().map(|t| format!("/{t}")),
            Some(n) => self.string(n, place, "into"),
        };
        let policy = match f.get("on_missing") {
            None => Some(MissingPolicy::Pass),
            Some(n) => self
                .choice(n, place, "on_missing", &["drop", "pass", "dead_letter"])
                .map(|s| match s.as_str() {
                    "drop" => MissingPolicy::Drop,
                    "dead_letter" => MissingPolicy::DeadLetter,
                    _ => MissingPolicy::Pass,
                }),
        };
        Some(EnrichSpec::new(table?, key?, into?).on_missing(policy?))
    }

    /// An external sink stage, read with its serde definition (see [`sinks`]); its errors
    /// are placed at the stage.
    pub(super) fn external(
        &mut self,
        kind: &str,
        body: &Node,
        place: &str,
    ) -> Option<(String, StageKind)> {
        fn read<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, String> {
            serde_json::from_value(v).map_err(|e| e.to_string())
        }
        let v = to_json(body);
        let mut errs = Vec::new();
        let built = match kind {
            "http" => read::<sinks::HttpDef>(v).map(|d| sinks::http(&d, &mut errs)),
            "postgres" => read::<sinks::PostgresDef>(v).map(|d| sinks::postgres(&d, &mut errs)),
            "redis" => read::<sinks::RedisDef>(v).map(|d| sinks::redis(&d, &mut errs)),
            _ => read::<sinks::FileDef>(v).map(|d| sinks::file(&d, &mut errs)),
        };
        let (name, spec) = match built {
            Ok(x) => x,
            Err(e) => {
                self.err(body.pos, place, None, e);
                return None;
            }
        };
        for e in errs {
            let (field, msg) = match e.strip_prefix("field `").and_then(|r| r.split_once("`: ")) {
                Some((f, m)) => (Some(f.to_string()), m.to_string()),
                None => (None, e),
            };
            self.errors.push(Located {
                pos: body.pos,
                place: place.to_string(),
                field,
                message: msg,
            });
        }
        Some((name, StageKind::External(Box::new(spec))))
    }

    /// Read each entry of the map `n` (field `field`) with `read`, which gives `None` when
    /// the entry is wrong (having reported it); a node that is not a map is reported as
    /// `what`. Whether every entry was read.
    fn each_entry(
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
