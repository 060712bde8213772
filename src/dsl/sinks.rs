//! External sink stages in topology files: `http`, `postgres`, `redis`, `file`.
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
//! - postgres: { url: {env: ONCEFLOW_POSTGRES_URL}, sql: "INSERT INTO t (id, body) VALUES ($1, $2::jsonb)", params: ["{value./id}", "{value}"] }
//! - redis: { url: {env: ONCEFLOW_REDIS_URL}, command: [SET, "order:{value./id}", "{value}"] }
//! - file: { path: out.jsonl, line: "{value}" }
//! ```
//!
//! Secrets given as `{ env: VAR }` are read when the sink starts; they never appear in
//! `describe`, logs or errors.

use crate::sink::{
    EffectSpec, ExternalSinkSpec, FileSpec, HttpSpec, InFlight, OnStoreError, PostgresSpec,
    RedisSpec, Secret, StoreSpec,
};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A value given inline or read from the environment.
#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub(crate) enum SecretDef {
    /// The value.
    Plain(String),
    /// `{ env: NAME }`.
    Env {
        /// Variable name.
        env: String,
    },
}

impl SecretDef {
    fn compile(&self) -> Secret {
        match self {
            SecretDef::Plain(s) => Secret::Inline(s.clone()),
            SecretDef::Env { env } => Secret::Env(env.clone()),
        }
    }
}

/// `idempotency:` of an external sink.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct IdempotencyDef {
    /// Key template.
    pub(crate) key: Option<String>,
    /// `sled`, `redis`, `postgres` or `none`.
    pub(crate) store: Option<String>,
    /// Redis store URL.
    pub(crate) url: Option<SecretDef>,
    /// Redis key prefix.
    pub(crate) prefix: Option<String>,
    /// Sled store directory (default `<state.dir>/idempotency/<application.id>`; a relative
    /// path is taken under `state.dir`).
    pub(crate) path: Option<PathBuf>,
    /// Postgres inbox table (default `onceflow_inbox`).
    pub(crate) table: Option<String>,
    /// Reservation lease.
    pub(crate) lease: Option<String>,
    /// How long completed keys are kept.
    pub(crate) ttl: Option<String>,
    /// `wait` or `raise`.
    pub(crate) in_flight: Option<String>,
    /// Bound of `wait`.
    pub(crate) wait_timeout: Option<String>,
    /// Pause before a raised record is retried.
    pub(crate) raise_backoff: Option<String>,
    /// How long a record is retried while its key is in flight elsewhere.
    pub(crate) in_flight_give_up: Option<String>,
    /// `fail_closed` or `fail_open`.
    pub(crate) on_store_error: Option<String>,
    /// How long store operations are retried.
    pub(crate) store_retry_for: Option<String>,
    /// Longest key in bytes.
    pub(crate) max_key_bytes: Option<usize>,
}

/// `http:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HttpDef {
    /// Stage name (default `http`).
    pub(crate) name: Option<String>,
    /// URL.
    pub(crate) url: SecretDef,
    /// POST or PUT.
    pub(crate) method: Option<String>,
    /// Headers.
    #[serde(default)]
    pub(crate) headers: BTreeMap<String, SecretDef>,
    /// Body template.
    pub(crate) body: Option<String>,
    /// Call timeout.
    pub(crate) timeout: Option<String>,
    /// Retries.
    pub(crate) retries: Option<u32>,
    /// First backoff.
    pub(crate) backoff: Option<String>,
    /// Effects in flight per partition.
    pub(crate) concurrency: Option<usize>,
    /// Idempotency settings.
    #[serde(default)]
    pub(crate) idempotency: IdempotencyDef,
}

/// `postgres:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PostgresDef {
    /// Stage name (default `postgres`).
    pub(crate) name: Option<String>,
    /// Connection URL.
    pub(crate) url: SecretDef,
    /// Statement with `$n` placeholders.
    pub(crate) sql: String,
    /// Parameter templates.
    #[serde(default)]
    pub(crate) params: Vec<String>,
    /// Effects in flight per partition.
    pub(crate) concurrency: Option<usize>,
    /// Idempotency settings.
    #[serde(default)]
    pub(crate) idempotency: IdempotencyDef,
}

/// `redis:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedisDef {
    /// Stage name (default `redis`).
    pub(crate) name: Option<String>,
    /// Connection URL.
    pub(crate) url: SecretDef,
    /// Command and argument templates.
    pub(crate) command: Vec<String>,
    /// Effects in flight per partition.
    pub(crate) concurrency: Option<usize>,
    /// Idempotency settings.
    #[serde(default)]
    pub(crate) idempotency: IdempotencyDef,
}

/// `file:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileDef {
    /// Stage name (default `file`).
    pub(crate) name: Option<String>,
    /// File to append to.
    pub(crate) path: PathBuf,
    /// Line template.
    pub(crate) line: Option<String>,
    /// Effects in flight per partition.
    pub(crate) concurrency: Option<usize>,
    /// Idempotency settings.
    #[serde(default)]
    pub(crate) idempotency: IdempotencyDef,
}

fn dur(v: &Option<String>, field: &str, errs: &mut Vec<String>) -> Option<std::time::Duration> {
    let s = v.as_ref()?;
    match humantime::parse_duration(s) {
        Ok(d) => Some(d),
        Err(e) => {
            errs.push(format!(
                "field `{field}`: {s:?} is not a duration like 30s: {e}"
            ));
            None
        }
    }
}

fn finish(
    effect: EffectSpec,
    concurrency: Option<usize>,
    id: &IdempotencyDef,
    errs: &mut Vec<String>,
) -> ExternalSinkSpec {
    let is_pg = matches!(effect, EffectSpec::Postgres(_));
    let store = match id.store.as_deref() {
        None if is_pg => "postgres",
        None => "sled",
        Some(s) => s,
    };
    let store = match store {
        "none" => StoreSpec::None,
        "sled" => StoreSpec::Sled {
            path: id.path.clone(),
        },
        "redis" => match &id.url {
            Some(u) => StoreSpec::Redis {
                url: u.compile(),
                prefix: id.prefix.clone(),
            },
            None => {
                errs.push("field `idempotency.url`: the redis store needs a URL (e.g. { env: ONCEFLOW_REDIS_URL })".into());
                StoreSpec::None
            }
        },
        "postgres" => StoreSpec::Postgres {
            table: id.table.clone().unwrap_or_else(|| "onceflow_inbox".into()),
        },
        other => {
            errs.push(format!(
                "field `idempotency.store`: {other:?}; use sled, redis, postgres or none"
            ));
            StoreSpec::None
        }
    };
    let mut spec = ExternalSinkSpec::new(effect, store);
    spec.key = id.key.clone();
    if let Some(c) = concurrency {
        spec.concurrency = c;
    }
    if let Some(m) = id.max_key_bytes {
        spec.max_key_bytes = m;
    }
    let p = &mut spec.policy;
    if let Some(d) = dur(&id.lease, "idempotency.lease", errs) {
        p.lease = d;
        p.in_flight_give_up = d * 2;
    }
    if let Some(d) = dur(&id.ttl, "idempotency.ttl", errs) {
        p.completed_ttl = d;
    }
    if let Some(d) = dur(&id.raise_backoff, "idempotency.raise_backoff", errs) {
        p.raise_backoff = d;
    }
    if let Some(d) = dur(&id.in_flight_give_up, "idempotency.in_flight_give_up", errs) {
        p.in_flight_give_up = d;
    }
    if let Some(d) = dur(&id.store_retry_for, "idempotency.store_retry_for", errs) {
        p.store_retry_for = d;
    }
    let wait = dur(&id.wait_timeout, "idempotency.wait_timeout", errs);
    match id.in_flight.as_deref() {
        None | Some("wait") => {
            if let Some(w) = wait {
                p.in_flight = InFlight::Wait(w);
            }
        }
        Some("raise") => p.in_flight = InFlight::Raise,
        Some(o) => errs.push(format!(
            "field `idempotency.in_flight`: {o:?}; use wait or raise"
        )),
    }
    match id.on_store_error.as_deref() {
        None | Some("fail_closed") => p.on_store_error = OnStoreError::FailClosed,
        Some("fail_open") => p.on_store_error = OnStoreError::FailOpen,
        Some(o) => errs.push(format!(
            "field `idempotency.on_store_error`: {o:?}; use fail_closed or fail_open"
        )),
    }
    spec
}

/// Compile an `http:` stage into its name and spec; problems are appended to `errs`.
pub(crate) fn http(d: &HttpDef, errs: &mut Vec<String>) -> (String, ExternalSinkSpec) {
    let mut h = HttpSpec::new(d.url.compile());
    if let Some(m) = &d.method {
        h.method = m.to_ascii_uppercase();
    }
    h.headers = d
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.compile()))
        .collect();
    if let Some(b) = &d.body {
        h.body = b.clone();
    }
    if let Some(t) = dur(&d.timeout, "timeout", errs) {
        h.timeout = t;
    }
    if let Some(r) = d.retries {
        h.retries = r;
    }
    if let Some(b) = dur(&d.backoff, "backoff", errs) {
        h.backoff = b;
    }
    let name = d.name.clone().unwrap_or_else(|| "http".into());
    (
        name,
        finish(EffectSpec::Http(h), d.concurrency, &d.idempotency, errs),
    )
}

/// Compile a `postgres:` stage.
pub(crate) fn postgres(d: &PostgresDef, errs: &mut Vec<String>) -> (String, ExternalSinkSpec) {
    let e = EffectSpec::Postgres(PostgresSpec {
        url: d.url.compile(),
        sql: d.sql.clone(),
        params: d.params.clone(),
    });
    let name = d.name.clone().unwrap_or_else(|| "postgres".into());
    (name, finish(e, d.concurrency, &d.idempotency, errs))
}

/// Compile a `redis:` stage.
pub(crate) fn redis(d: &RedisDef, errs: &mut Vec<String>) -> (String, ExternalSinkSpec) {
    let e = EffectSpec::Redis(RedisSpec {
        url: d.url.compile(),
        command: d.command.clone(),
    });
    let name = d.name.clone().unwrap_or_else(|| "redis".into());
    (name, finish(e, d.concurrency, &d.idempotency, errs))
}

/// Compile a `file:` stage.
pub(crate) fn file(d: &FileDef, errs: &mut Vec<String>) -> (String, ExternalSinkSpec) {
    let e = EffectSpec::File(FileSpec {
        path: d.path.clone(),
        line: d.line.clone().unwrap_or_else(|| "{value}".into()),
    });
    let name = d.name.clone().unwrap_or_else(|| "file".into());
    (name, finish(e, d.concurrency, &d.idempotency, errs))
}

#[cfg(test)]
mod tests {
    use crate::sink::{EffectSpec, KeyRule, StoreSpec};
    use crate::topology::StageKind;

    #[test]
    fn sink_stages_compile_and_describe_without_secrets() {
        let text = r#"
name: t
source: { topic: orders }
stages:
  - dedup: { key: { json_pointer: /id } }
  - http:
      name: notify
      url: { env: HOOK_URL }
      headers: { Authorization: { env: HOOK_TOKEN }, X-Plain: "visible" }
      idempotency: { store: redis, url: { env: ONCEFLOW_REDIS_URL }, in_flight: raise }
  - postgres: { url: "postgres://u:hunter2@h/db", sql: "INSERT INTO t VALUES ($1)", params: ["{value./id}"] }
  - file: { path: /tmp/x.jsonl, idempotency: { key: "{topic}-{offset}", store: none } }
"#;
        let t = crate::dsl::parse("t.yaml", text).unwrap();
        let d = t.describe();
        assert!(!d.contains("hunter2"), "{d}");
        assert!(
            d.contains("env:HOOK_URL") && d.contains("Authorization=env:HOOK_TOKEN"),
            "{d}"
        );
        let StageKind::External(h) = &t.stages()[1].kind else {
            panic!()
        };
        assert!(matches!(h.resolved_key, Some(KeyRule::Dedup(_))));
        assert!(matches!(h.store, StoreSpec::Redis { .. }));
        let StageKind::External(p) = &t.stages()[2].kind else {
            panic!()
        };
        assert!(matches!(p.effect, EffectSpec::Postgres(_)));
        assert_eq!(
            p.store,
            StoreSpec::Postgres {
                table: "onceflow_inbox".into()
            }
        );
        assert_eq!(t.json_pointers(), vec!["/id".to_string()]);
    }

    #[test]
    fn bad_templates_fail_validation() {
        let text = r#"
name: t
source: { topic: orders, format: bytes }
stages:
  - http: { url: "http://x", idempotency: { key: "{value./order_id}" } }
  - redis: { url: "redis://x", command: [SET, "{nope}"], idempotency: { store: redisx } }
"#;
        let e = crate::dsl::parse("t.yaml", text).unwrap_err().to_string();
        assert!(e.contains("t.yaml:5:5: stage `http` (http), field `key`: template \"{value./order_id}\" reads field /order_id, but the source format is bytes"), "{e}");
        assert!(e.contains("unknown placeholder {nope}"), "{e}");
        assert!(
            e.contains("\"redisx\"; use sled, redis, postgres or none"),
            "{e}"
        );
    }
}
