//! The external sink kind: an effect outside Kafka (HTTP call, PostgreSQL statement,
//! Redis command, file line) made once per idempotency key. Spec [`ExternalSinkSpec`] and
//! its checks in `sink/mod.rs`, processor `ExternalSink` in `sink/stage.rs`.
//!
//! Four file keys, one per effect, sharing `concurrency` and `idempotency`:
//!
//! ```yaml
//! - http:
//!     name: notify
//!     url: { env: HOOK_URL }            # a plain string, or { env: VAR } for a secret
//!     method: POST                      # POST (default) | PUT
//!     headers: { Authorization: { env: HOOK_TOKEN }, Content-Type: application/json }
//!     body: "{value}"                   # template (default: the value as read)
//!     timeout: 10s
//!     retries: 5
//!     backoff: 200ms
//!     concurrency: 16                   # effects in flight per partition
//!     idempotency:
//!       key: "{value./order_id}.invoice"  # default: the upstream dedup key, else {topic}-{partition}-{offset}
//!       store: redis                    # sled (default; postgres sinks: postgres) | redis | postgres | none
//!       url: { env: ONCEFLOW_REDIS_URL }  # redis store
//!       lease: 5m                       # must outlast the call with its retries (checked)
//!       ttl: 7d                         # how long completed keys are kept
//!       in_flight: wait                 # wait | raise
//!       wait_timeout: 30s
//!       on_store_error: fail_closed     # fail_closed | fail_open
//!       store_retry_for: 30s
//!       max_key_bytes: 1024
//! - postgres: { url: {env: ONCEFLOW_POSTGRES_URL}, sql: "INSERT INTO t (id, body) VALUES ($1, $2::jsonb)", params: ["{value./id}", "{value}"], timeout: 30s }
//! - redis: { url: {env: ONCEFLOW_REDIS_URL}, command: [SET, "order:{value./id}", "{value}"] }
//! - file: { path: out.jsonl, line: "{value}" }
//! ```
//!
//! Secrets given as `{ env: VAR }` are read when the sink starts; they never appear in
//! `describe`, logs or errors. Every field is read with its position, nested ones too
//! (`idempotency.lease`), so a problem found at build time points at the field.

use super::{BuildCx, CheckCx, FieldError, FileKind, ReadStage, StageKind, StageKindSpec};
use crate::processor::Processor;
use crate::schema::node::{Node, Val};
use crate::schema::{Fields, Reader};
use crate::sink::{
    EffectSpec, ExternalSinkSpec, FileSpec, HttpSpec, InFlight, OnStoreError, PostgresSpec,
    RedisSpec, Secret, StoreSpec,
};
use crate::topology::TopologyBuilder;

impl StageKindSpec for ExternalSinkSpec {
    fn settings(&self) -> String {
        // Its own description, less the `ExternalSink: <name>` head.
        let full = self.describe("\u{1}");
        full.split_once("\u{1} ")
            .map_or(full.clone(), |(_, rest)| rest.to_string())
    }

    fn delivers(&self) -> bool {
        true
    }

    fn external_effect(&self) -> bool {
        true
    }

    fn json_pointers(&self, out: &mut Vec<String>) {
        ExternalSinkSpec::json_pointers(self, out);
    }

    fn check(&mut self, cx: &CheckCx<'_>, errors: &mut Vec<FieldError>) {
        let format = cx.source.map(|s| &s.format);
        errors.extend(self.validate(cx.upstream_dedup.cloned(), format));
    }

    fn processor(&self, cx: &BuildCx<'_>) -> Box<dyn Processor> {
        Box::new(crate::sink::stage::ExternalSink::new(
            cx.topology_name(),
            cx.name,
            self,
            cx.forwards(),
        ))
    }
}

/// The fields of `idempotency:`.
const IDEMPOTENCY: &[&str] = &[
    "key",
    "store",
    "url",
    "prefix",
    "path",
    "table",
    "lease",
    "ttl",
    "in_flight",
    "wait_timeout",
    "raise_backoff",
    "in_flight_give_up",
    "on_store_error",
    "store_retry_for",
    "max_key_bytes",
];

/// `- http: / postgres: / redis: / file: {...}` in topology files; each is named after
/// its key unless it says otherwise. Besides its effect's fields, each has `name`,
/// `concurrency` and `idempotency`.
pub(super) const FILE_KINDS: &[FileKind] = &[
    FileKind {
        key: "http",
        fields: &[
            "name",
            "concurrency",
            "idempotency",
            "url",
            "method",
            "headers",
            "body",
            "timeout",
            "retries",
            "backoff",
        ],
        default_name: |_, _| "http".into(),
        read: http,
    },
    FileKind {
        key: "postgres",
        fields: &[
            "name",
            "concurrency",
            "idempotency",
            "url",
            "sql",
            "params",
            "timeout",
        ],
        default_name: |_, _| "postgres".into(),
        read: postgres,
    },
    FileKind {
        key: "redis",
        fields: &["name", "concurrency", "idempotency", "url", "command"],
        default_name: |_, _| "redis".into(),
        read: redis,
    },
    FileKind {
        key: "file",
        fields: &["name", "concurrency", "idempotency", "path", "line"],
        default_name: |_, _| "file".into(),
        read: file,
    },
];

fn http(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let mut ok = true;
    let url = url(c, f, place);
    let mut h = HttpSpec::new(url.clone().unwrap_or(Secret::Inline(String::new())));
    ok &= url.is_some();
    ok &= c.opt(
        f,
        "method",
        |c, n| c.string(n, place, "method"),
        |m| h.method = m.to_ascii_uppercase(),
    );
    let mut headers = Vec::new();
    ok &= c.entries(
        f,
        "headers",
        place,
        "a map of header name to value (or { env: VAR })",
        |c, k, _, v| {
            headers.push((k.to_string(), secret(c, v, place, "headers")?));
            Some(())
        },
    );
    // In name order, as `describe` shows them.
    headers.sort_by(|a, b| a.0.cmp(&b.0));
    h.headers = headers;
    ok &= c.opt(f, "body", |c, n| c.string(n, place, "body"), |b| h.body = b);
    ok &= c.opt(
        f,
        "timeout",
        |c, n| c.duration(n, place, "timeout"),
        |t| h.timeout = t,
    );
    ok &= c.opt(f, "retries", |c, n| retries(c, n, place), |r| h.retries = r);
    ok &= c.opt(
        f,
        "backoff",
        |c, n| c.duration(n, place, "backoff"),
        |b| h.backoff = b,
    );
    finish(c, f, place, EffectSpec::Http(h), ok)
}

fn postgres(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let url = url(c, f, place);
    let sql = c
        .required(f, "sql", place)
        .and_then(|n| c.string(n, place, "sql"));
    let params = match f.get("params") {
        None => Some(Vec::new()),
        Some(n) => strings(c, n, place, "params"),
    };
    let mut ok = url.is_some() && sql.is_some() && params.is_some();
    let mut p = PostgresSpec::new(
        url.unwrap_or(Secret::Inline(String::new())),
        sql.unwrap_or_default(),
        params.unwrap_or_default(),
    );
    ok &= c.opt(
        f,
        "timeout",
        |c, n| c.duration(n, place, "timeout"),
        |t| p.timeout = t,
    );
    finish(c, f, place, EffectSpec::Postgres(p), ok)
}

fn redis(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let url = url(c, f, place);
    let command = c
        .required(f, "command", place)
        .and_then(|n| strings(c, n, place, "command"));
    let ok = url.is_some() && command.is_some();
    let effect = EffectSpec::Redis(RedisSpec {
        url: url.unwrap_or(Secret::Inline(String::new())),
        command: command.unwrap_or_default(),
    });
    finish(c, f, place, effect, ok)
}

fn file(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<ReadStage> {
    let path = c
        .required(f, "path", place)
        .and_then(|n| c.string(n, place, "path"));
    let line = match f.get("line") {
        None => Some("{value}".to_string()),
        Some(n) => c.string(n, place, "line"),
    };
    let ok = path.is_some() && line.is_some();
    let effect = EffectSpec::File(FileSpec {
        path: path.unwrap_or_default().into(),
        line: line.unwrap_or_default(),
    });
    finish(c, f, place, effect, ok)
}

/// The fields all external sinks share (`concurrency`, `idempotency`), and the stage;
/// `ok` says whether the effect's own fields were read. A problem with a shared field is
/// reported but still gives the stage (with that setting's default), so that the
/// builder's checks of the effect are reported too.
fn finish(
    c: &mut Reader,
    f: &Fields<'_>,
    place: &str,
    effect: EffectSpec,
    ok: bool,
) -> Option<ReadStage> {
    let is_pg = matches!(effect, EffectSpec::Postgres(_));
    let mut spec = ExternalSinkSpec::new(effect, StoreSpec::None);
    if let Some(k) = f
        .get("concurrency")
        .and_then(|n| count(c, n, place, "concurrency"))
    {
        spec.concurrency = k as usize;
    }
    let id = f
        .get("idempotency")
        .and_then(|n| nested(c, n, place, "idempotency", IDEMPOTENCY));
    let get = |name: &str| id.as_ref().and_then(|f| f.get(name));
    // A key template or key length in error messages is this sink's `idempotency.key` /
    // `idempotency.max_key_bytes`: place them there.
    for (alias, field) in [("key", "key"), ("max_key_bytes", "max_key_bytes")] {
        if let Some(n) = get(field) {
            c.note_field_pos(alias, n.pos);
        }
    }
    let text = |c: &mut Reader, name: &str| -> Result<Option<String>, ()> {
        match get(name) {
            None => Ok(None),
            Some(n) => c
                .string(n, place, &format!("idempotency.{name}"))
                .map(Some)
                .ok_or(()),
        }
    };
    let store = text(c, "store").ok().flatten();
    let store_pos = get("store").map_or(f.pos, |n| n.pos);
    spec.store = match store
        .as_deref()
        .unwrap_or(if is_pg { "postgres" } else { "sled" })
    {
        "none" => StoreSpec::None,
        "sled" => StoreSpec::Sled {
            path: text(c, "path").ok().flatten().map(Into::into),
        },
        "redis" => {
            let url = get("url").and_then(|n| secret(c, n, place, "idempotency.url"));
            let prefix = text(c, "prefix");
            match (url, prefix) {
                (Some(url), Ok(prefix)) => StoreSpec::Redis { url, prefix },
                (None, _) if get("url").is_none() => {
                    c.err(
                        store_pos,
                        place,
                        Some("idempotency.url"),
                        "the redis store needs a URL (e.g. { env: ONCEFLOW_REDIS_URL })",
                    );
                    StoreSpec::None
                }
                _ => StoreSpec::None,
            }
        }
        "postgres" => match text(c, "table") {
            Ok(t) => StoreSpec::Postgres {
                table: t.unwrap_or_else(|| "onceflow_inbox".into()),
            },
            Err(()) => StoreSpec::None,
        },
        other => {
            c.err(
                store_pos,
                place,
                Some("idempotency.store"),
                format!("{other:?}; use sled, redis, postgres or none"),
            );
            StoreSpec::None
        }
    };
    // A field of another store than the one in use would be ignored: refuse it (e.g. a
    // Redis `url` while the store is sled, one instance's).
    let chosen = store
        .as_deref()
        .unwrap_or(if is_pg { "postgres" } else { "sled" });
    for (field, owner) in [
        ("path", "sled"),
        ("url", "redis"),
        ("prefix", "redis"),
        ("table", "postgres"),
    ] {
        let known = ["none", "sled", "redis", "postgres"].contains(&chosen);
        if let Some(n) = get(field).filter(|_| known && owner != chosen) {
            c.err(
                n.pos,
                place,
                Some(&format!("idempotency.{field}")),
                format!("belongs to store {owner}, but the store is {chosen}; set `store: {owner}` or remove it"),
            );
        }
    }
    spec.key = text(c, "key").ok().flatten();
    if let Some(m) =
        get("max_key_bytes").and_then(|n| count(c, n, place, "idempotency.max_key_bytes"))
    {
        spec.max_key_bytes = m as usize;
    }
    let dur = |c: &mut Reader, name: &str| {
        get(name).and_then(|n| c.duration(n, place, &format!("idempotency.{name}")))
    };
    let p = &mut spec.policy;
    if let Some(d) = dur(c, "lease") {
        p.lease = d;
    }
    if let Some(d) = dur(c, "ttl") {
        p.completed_ttl = d;
    }
    if let Some(d) = dur(c, "raise_backoff") {
        p.raise_backoff = d;
    }
    if let Some(d) = dur(c, "in_flight_give_up") {
        p.in_flight_give_up = Some(d);
    }
    if let Some(d) = dur(c, "store_retry_for") {
        p.store_retry_for = d;
    }
    let wait = dur(c, "wait_timeout");
    let pick = |c: &mut Reader, name: &str, allowed: [&str; 2]| match get(name) {
        None => None,
        Some(n) => {
            let field = format!("idempotency.{name}");
            let v = c.string(n, place, &field);
            if let Some(o) = v.as_deref().filter(|v| !allowed.contains(v)) {
                c.err(
                    n.pos,
                    place,
                    Some(&field),
                    format!("{o:?}; use {} or {}", allowed[0], allowed[1]),
                );
                return None;
            }
            v
        }
    };
    match pick(c, "in_flight", ["wait", "raise"]).as_deref() {
        Some("raise") => p.in_flight = InFlight::Raise,
        _ => {
            if let Some(w) = wait {
                p.in_flight = InFlight::Wait(w);
            }
        }
    }
    p.on_store_error = match pick(c, "on_store_error", ["fail_closed", "fail_open"]).as_deref() {
        Some("fail_open") => OnStoreError::FailOpen,
        _ => OnStoreError::FailClosed,
    };
    ok.then(|| (StageKind::External(Box::new(spec)), None))
}

/// The map `n` (field `field`) with only `allowed` fields; an unknown one is reported as
/// `field.name` at its position, and every field's position is noted under that name.
fn nested<'a>(
    c: &mut Reader,
    n: &'a Node,
    place: &str,
    field: &str,
    allowed: &[&str],
) -> Option<Fields<'a>> {
    let Val::Map(entries) = &n.val else {
        c.wrong_type(n.pos, place, Some(field), "a map", &n.val);
        return None;
    };
    let mut out = Fields {
        pos: n.pos,
        entries: Vec::new(),
    };
    for (k, kpos, v) in entries {
        let name = format!("{field}.{k}");
        if allowed.contains(&k.as_str()) {
            c.note_field_pos(&name, v.pos);
            out.entries.push((k.as_str(), *kpos, v));
        } else {
            c.err(
                *kpos,
                place,
                Some(&name),
                crate::schema::unknown("field", k, allowed),
            );
        }
    }
    Some(out)
}

/// The effect's `url` (required): a secret.
fn url(c: &mut Reader, f: &Fields<'_>, place: &str) -> Option<Secret> {
    c.required(f, "url", place)
        .and_then(|n| secret(c, n, place, "url"))
}

/// A secret: a plain string, or `{ env: VAR }` read when the sink starts.
fn secret(c: &mut Reader, n: &Node, place: &str, field: &str) -> Option<Secret> {
    match &n.val {
        Val::Str(s) => Some(Secret::Inline(s.clone())),
        Val::Map(es) if es.len() == 1 && es[0].0 == "env" => {
            c.string(&es[0].2, place, field).map(Secret::Env)
        }
        other => {
            c.wrong_type(n.pos, place, Some(field), "a string or { env: VAR }", other);
            None
        }
    }
}

/// A list of strings (templates).
fn strings(c: &mut Reader, n: &Node, place: &str, field: &str) -> Option<Vec<String>> {
    let Val::Seq(items) = &n.val else {
        c.wrong_type(n.pos, place, Some(field), "a list of strings", &n.val);
        return None;
    };
    let read: Vec<Option<String>> = items.iter().map(|i| c.string(i, place, field)).collect();
    read.into_iter().collect()
}

/// An HTTP sink's `retries`: a count that fits 32 bits.
fn retries(c: &mut Reader, n: &Node, place: &str) -> Option<u32> {
    let r = count(c, n, place, "retries")?;
    let fits = u32::try_from(r).ok();
    if fits.is_none() {
        c.err(
            n.pos,
            place,
            Some("retries"),
            format!("{r} retries is too many"),
        );
    }
    fits
}

/// A count: an integer, zero or more.
fn count(c: &mut Reader, n: &Node, place: &str, field: &str) -> Option<u64> {
    match &n.val {
        Val::Int(i) if *i >= 0 => Some(*i as u64),
        Val::Int(i) => {
            c.err(
                n.pos,
                place,
                Some(field),
                format!("expected an integer, zero or more, found {i}"),
            );
            None
        }
        other => {
            c.wrong_type(n.pos, place, Some(field), "an integer", other);
            None
        }
    }
}

impl TopologyBuilder {
    /// Add an external sink stage: an HTTP call, a PostgreSQL statement, a Redis command or
    /// a file line per record, made once per idempotency key (see
    /// [`ExternalSinkSpec`](crate::ExternalSinkSpec)). Its key template and settings are
    /// checked by [`TopologyBuilder::build`].
    ///
    /// ```
    /// use onceflow::prelude::*;
    /// // One line per order in a file, at most once per order id.
    /// let ledger = ExternalSinkSpec::new(
    ///     EffectSpec::File(FileSpec { path: "orders.jsonl".into(), line: "{value}".into() }),
    ///     StoreSpec::Sled { path: None },
    /// )
    /// .with_key("{value./id}");
    /// let t = TopologyBuilder::new("orders")
    ///     .source("orders", Format::Json)
    ///     .external_sink("ledger", ledger)
    ///     .build()
    ///     .unwrap();
    /// assert!(t.describe().contains("ExternalSink: ledger file"));
    /// ```
    pub fn external_sink(self, name: impl Into<String>, spec: ExternalSinkSpec) -> Self {
        self.stage(name, StageKind::External(Box::new(spec)))
    }
}
