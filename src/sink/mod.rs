//! External sinks (HTTP, PostgreSQL, Redis, file) and the idempotency-key machinery that
//! makes their effects happen once.
//!
//! An effect outside Kafka cannot join a Kafka transaction. Each external sink therefore gives
//! every effect an **idempotency key**, rendered from a [`template::Template`] over the record
//! (default: the key of the nearest dedup stage upstream, else `{topic}-{partition}-{offset}`),
//! and records it:
//!
//! - `store: postgres` (PostgreSQL sinks only): an inbox row `(<topology>/<sink>, key)` is inserted in the
//!   same database transaction as the sink's own SQL; a second insert of the key finds the
//!   row and the transaction is rolled back. Exactly once for the database.
//! - `store: sled` / `store: redis`: the reservation protocol of [`protocol`]: reserve (in
//!   flight, with a lease), run the effect, mark it completed with its result.
//! - `store: none`: no protection (at-least-once), for measurements and idempotent targets;
//!   its effects are reported `unprotected`.
//!
//! Each sink's keys live in their own namespace, [`idempotency_scope`]`(topology, sink)`,
//! which no other pair of names can produce.
//!
//! A `redis` sink whose store is `redis` with the same URL runs its command and the
//! completed record in one MULTI/EXEC, so a lost reply can be settled by reading the record
//! ([`effects::Effector::run_redis_in_transaction`]). Without that, a command that is not
//! idempotent ([`effects::redis_command_is_idempotent`]) is never sent again after a lost
//! reply: the record is dead-lettered with its outcome unknown ([`protocol::EffectError`]).
//!
//! A key that renders empty, names a missing field, or is longer than `max_key_bytes` fails
//! the record (dead letter, with the reason); the effect never runs without its key.
//!
//! The runtime commits a record's source offset only after its effect is done or
//! dead-lettered: the sink stage runs effects on a shared tokio runtime, up to `concurrency`
//! at once per partition, keeping the order of records with the same key, and the task waits
//! for all of them before each commit ([`crate::processor::Processor::flush`]).

pub(crate) mod effects;
pub(crate) mod protocol;
pub(crate) mod stage;
pub(crate) mod store;
pub(crate) mod template;

use crate::codec::Format;
use crate::processor::key::KeySource;
pub(crate) use protocol::{InFlight, OnStoreError, ReservationPolicy};
use std::path::{Path, PathBuf};
use std::time::Duration;
pub(crate) use template::Template;

/// A setting that may be a secret: given inline, or read from an environment variable when
/// the sink connects. `describe` and errors print only `env:NAME` or `<inline>`, never the
/// value.
#[derive(Clone, PartialEq, Eq)]
pub enum Secret {
    /// The value itself.
    Inline(String),
    /// The name of an environment variable holding it.
    Env(String),
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Secret {
    /// The value.
    ///
    /// # Errors
    /// A sentence naming the variable when it is unset, empty or not UTF-8.
    pub(crate) fn resolve(&self) -> Result<String, String> {
        match self {
            Secret::Inline(v) => Ok(v.clone()),
            Secret::Env(n) => match std::env::var(n) {
                Ok(v) if !v.is_empty() => Ok(v),
                Ok(_) => Err(format!("environment variable {n} is empty")),
                Err(_) => Err(format!("environment variable {n} is not set")),
            },
        }
    }

    /// A printable form that never shows the value.
    pub(crate) fn describe(&self) -> String {
        match self {
            Secret::Inline(_) => "<inline>".into(),
            Secret::Env(n) => format!("env:{n}"),
        }
    }
}

/// `http` sink settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpSpec {
    /// Target URL (may be a secret: it can carry a token).
    pub url: Secret,
    /// `POST` (default) or `PUT`.
    pub method: String,
    /// Headers; values may be secrets (`Authorization`).
    pub headers: Vec<(String, Secret)>,
    /// Body template (default `{value}`: the record value as read).
    pub body: String,
    /// Timeout of one call (default 10 s).
    pub timeout: Duration,
    /// Retries after the first call for 408, 409, 425, 429, 5xx and transport errors (default 5).
    pub retries: u32,
    /// First backoff, doubled per retry up to 10 s (default 200 ms).
    pub backoff: Duration,
}

impl HttpSpec {
    /// POST the record value to `url`, with the defaults above.
    pub fn new(url: Secret) -> Self {
        HttpSpec {
            url,
            method: "POST".into(),
            headers: Vec::new(),
            body: "{value}".into(),
            timeout: Duration::from_secs(10),
            retries: 5,
            backoff: Duration::from_millis(200),
        }
    }
}

/// `postgres` sink settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresSpec {
    /// Connection URL (`postgres://user:pass@host:port/db`), usually from the environment.
    pub url: Secret,
    /// The statement, with `$1`.. placeholders; every parameter is sent as text, so cast in
    /// SQL where a column is not text (`$2::bigint`).
    pub sql: String,
    /// One template per placeholder.
    pub params: Vec<String>,
    /// How long one try may wait to connect, and again to run the statement (with its
    /// inbox row) and commit (default 30 s; the same bound again for creating the inbox
    /// table on first use, and for the cancel and its reply). Past it the statement is
    /// cancelled and the connection dropped. A reply `query_canceled` (57014) means it did
    /// not take place: retried within `idempotency.store_retry_for`, then dead-lettered as
    /// failed (not for a `CALL` or `DO` without the `postgres` store: it may commit inside,
    /// so that reply counts as none). With no reply it is as after a lost connection: with the `postgres` store
    /// the try is retried within `store_retry_for` (its inbox row tells whether it
    /// committed; when the time runs out first, the record is dead-lettered as `unknown`);
    /// without, its outcome is unknown and the record is dead-lettered. A try that timed
    /// out before sending the statement (connecting, the inbox table) is retried.
    pub timeout: Duration,
}

impl PostgresSpec {
    /// Run `sql` with `params` on the database at `url`, with the default timeout (30 s).
    pub fn new(url: Secret, sql: impl Into<String>, params: Vec<String>) -> Self {
        PostgresSpec {
            url,
            sql: sql.into(),
            params,
            timeout: Duration::from_secs(30),
        }
    }
}

/// `redis` sink settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSpec {
    /// Connection URL.
    pub url: Secret,
    /// The command and its arguments, each a template, e.g. `[SET, "order:{value./id}", "{value}"]`.
    pub command: Vec<String>,
}

/// `file` sink settings: one line per record appended to `path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    /// File to append to (created if missing).
    pub path: PathBuf,
    /// Line template (default `{value}`; a JSON value makes a JSON line).
    pub line: String,
}

/// Which effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EffectSpec {
    /// HTTP call.
    Http(HttpSpec),
    /// PostgreSQL statement.
    Postgres(PostgresSpec),
    /// Redis command.
    Redis(RedisSpec),
    /// Append a line to a file.
    File(FileSpec),
}

impl EffectSpec {
    fn kind(&self) -> &'static str {
        match self {
            EffectSpec::Http(_) => "http",
            EffectSpec::Postgres(_) => "postgres",
            EffectSpec::Redis(_) => "redis",
            EffectSpec::File(_) => "file",
        }
    }
}

/// Where idempotency keys are recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// No protection: effects are at-least-once, and reported `unprotected` (outcome
    /// header and `onceflow_sink_effects_total`), never `done`.
    None,
    /// Local sled database (one tree per topology and sink), in the instance's state dir:
    /// one instance only. Bound to a state dir before it runs (`App::run` and
    /// `TestDriver::state_dir` do it: a default path becomes
    /// `<state.dir>/idempotency/<application.id>`, a relative one is taken under `state.dir`), so that it is covered by the state dir's lock and
    /// two instances with different state dirs never share it.
    Sled {
        /// Database directory: `None` (the default) is `sled_home``(state.dir,
        /// application.id)`; a relative path is taken under `state.dir`; an absolute path is
        /// used as it is (outside the state dir, the lock does not cover it).
        path: Option<PathBuf>,
    },
    /// Redis, shared by instances.
    Redis {
        /// Connection URL.
        url: Secret,
        /// Prefix of the Redis keys (default `onceflow:<topology>/<sink>:`).
        prefix: Option<String>,
    },
    /// PostgreSQL inbox table in the sink's own database and transaction (postgres sinks
    /// only); its rows are `(<topology>/<sink>, key)`.
    Postgres {
        /// Inbox table name (default `onceflow_inbox`), created if missing.
        table: String,
    },
}

impl StoreSpec {
    fn describe(&self) -> String {
        match self {
            StoreSpec::None => "none".into(),
            StoreSpec::Sled { path: Some(p) } => format!("sled({})", p.display()),
            StoreSpec::Sled { path: None } => {
                "sled(<state.dir>/idempotency/<application.id>)".into()
            }
            StoreSpec::Redis { url, .. } => format!("redis({})", url.describe()),
            StoreSpec::Postgres { table } => format!("postgres-inbox({table})"),
        }
    }
}

/// How the idempotency key is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyRule {
    /// A template over the record.
    Template(Template),
    /// The key of the dedup stage upstream (the default when there is one).
    Dedup(KeySource),
}

/// An external sink stage: its effect, its key and its store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalSinkSpec {
    /// The effect.
    pub effect: EffectSpec,
    /// Key template; `None` = the default (dedup key upstream, else topic-partition-offset).
    pub key: Option<String>,
    /// Filled by `build()`: the key rule in force.
    pub(crate) resolved_key: Option<KeyRule>,
    /// Longest key accepted, in bytes (default 1024).
    pub max_key_bytes: usize,
    /// The idempotency store.
    pub store: StoreSpec,
    /// The reservation protocol's settings.
    pub policy: ReservationPolicy,
    /// Effects in flight at once per partition (default 16); records with the same key run
    /// in order.
    pub concurrency: usize,
}

impl ExternalSinkSpec {
    /// A sink for `effect` with store `store` and every default.
    pub fn new(effect: EffectSpec, store: StoreSpec) -> Self {
        ExternalSinkSpec {
            effect,
            key: None,
            resolved_key: None,
            max_key_bytes: 1024,
            store,
            policy: ReservationPolicy::default(),
            concurrency: 16,
        }
    }

    /// Set the key template.
    pub fn with_key(mut self, template: impl Into<String>) -> Self {
        self.key = Some(template.into());
        self
    }

    /// The JSON pointers its templates read.
    pub(crate) fn json_pointers(&self, out: &mut Vec<String>) {
        let mut push = |t: &str| {
            if let Ok(t) = Template::parse(t) {
                t.json_pointers(out);
            }
        };
        if let Some(k) = &self.key {
            push(k);
        }
        match &self.effect {
            EffectSpec::Http(h) => push(&h.body),
            EffectSpec::Postgres(p) => p.params.iter().for_each(|t| push(t)),
            EffectSpec::Redis(r) => r.command.iter().for_each(|t| push(t)),
            EffectSpec::File(f) => push(&f.line),
        }
        if let Some(KeyRule::Dedup(k)) = &self.resolved_key {
            k.json_pointers(out);
        }
    }

    /// One line for `describe`; secrets are shown by their source only.
    pub(crate) fn describe(&self, name: &str) -> String {
        let what = match &self.effect {
            EffectSpec::Http(h) => format!(
                "{} {} headers=[{}] timeout={:?} retries={}",
                h.method,
                h.url.describe(),
                h.headers
                    .iter()
                    .map(|(k, v)| format!("{k}={}", v.describe()))
                    .collect::<Vec<_>>()
                    .join(", "),
                h.timeout,
                h.retries
            ),
            EffectSpec::Postgres(p) => format!(
                "{} sql={:?} params={:?} timeout={:?}",
                p.url.describe(),
                p.sql,
                p.params,
                p.timeout
            ),
            EffectSpec::Redis(r) => format!("{} command={:?}", r.url.describe(), r.command),
            EffectSpec::File(f) => format!("{} line={:?}", f.path.display(), f.line),
        };
        let key = match &self.resolved_key {
            Some(KeyRule::Template(t)) => t.text().to_string(),
            Some(KeyRule::Dedup(k)) => format!("dedup key {}", k.describe()),
            None => self.key.clone().unwrap_or_default(),
        };
        let in_flight = match self.policy.in_flight {
            InFlight::Wait(d) => format!("wait({d:?})"),
            InFlight::Raise => "raise".into(),
        };
        format!(
            "  ExternalSink: {name} {} {what} key={key:?} store={} in_flight={in_flight} on_store_error={:?} concurrency={}",
            self.effect.kind(),
            self.store.describe(),
            self.policy.on_store_error,
            self.concurrency
        )
    }
}

use crate::error::FieldError;

impl ExternalSinkSpec {
    /// Validate this sink and resolve its key rule, given what the topology knows: the key of
    /// the nearest dedup stage upstream (the default idempotency key) and the source's format
    /// (which the templates must fit); called by `TopologyBuilder::build`. Returns the problems
    /// found, each naming the field.
    pub(crate) fn validate(
        &mut self,
        upstream_dedup: Option<KeySource>,
        format: Option<&Format>,
    ) -> Vec<FieldError> {
        let spec = self;
        let mut errs = Vec::new();
        let check = |field: &str, t: &str, errs: &mut Vec<FieldError>| match Template::parse(t) {
            Ok(t) => {
                if let Some(f) = format {
                    if let Err(e) = t.check_format(f) {
                        errs.push(FieldError::at(field, e.to_string()));
                    }
                }
                Some(t)
            }
            Err(e) => {
                errs.push(FieldError::at(field, e.to_string()));
                None
            }
        };
        spec.resolved_key = match (&spec.key, upstream_dedup) {
            (Some(k), _) => {
                let t = check("key", k, &mut errs);
                if let Some(t) = &t {
                    if t.parts().is_empty() {
                        errs.push(FieldError::at("key", "the template is empty"));
                    } else if let Err(e) = t.check_key() {
                        errs.push(FieldError::at("key", e));
                    }
                }
                t.map(KeyRule::Template)
            }
            (None, Some(d)) => Some(KeyRule::Dedup(d)),
            (None, None) => Template::parse("{topic}-{partition}-{offset}")
                .ok()
                .map(KeyRule::Template),
        };
        if spec.max_key_bytes == 0 {
            errs.push(FieldError::at("max_key_bytes", "must be positive"));
        }
        if spec.concurrency == 0 {
            errs.push(FieldError::at("concurrency", "must be positive"));
        }
        if matches!(&spec.effect, EffectSpec::Postgres(p) if p.timeout.is_zero()) {
            errs.push(FieldError::at("timeout", "must be positive"));
        }
        if spec.policy.lease.is_zero() {
            errs.push(FieldError::at("idempotency.lease", "must be positive"));
        }
        // As topology files refuse them where they are read: no deadline overflows later.
        let max = crate::schema::MAX_DURATION;
        let mut durations = vec![
            ("idempotency.lease", spec.policy.lease),
            ("idempotency.ttl", spec.policy.completed_ttl),
            ("idempotency.raise_backoff", spec.policy.raise_backoff),
            ("idempotency.store_retry_for", spec.policy.store_retry_for),
        ];
        if let Some(d) = spec.policy.in_flight_give_up {
            durations.push(("idempotency.in_flight_give_up", d));
        }
        if let crate::sink::InFlight::Wait(d) = spec.policy.in_flight {
            durations.push(("idempotency.in_flight", d));
        }
        match &spec.effect {
            EffectSpec::Http(h) => {
                durations.push(("timeout", h.timeout));
                durations.push(("backoff", h.backoff));
            }
            EffectSpec::Postgres(p) => durations.push(("timeout", p.timeout)),
            _ => {}
        }
        for (field, d) in durations {
            if d > max {
                errs.push(FieldError::at(
                    field,
                    crate::schema::too_long(&format!("{d:?}")),
                ));
            }
        }
        if spec.policy.completed_ttl.is_zero() && !matches!(spec.store, StoreSpec::None) {
            errs.push(FieldError::at(
                "idempotency.ttl",
                "must be positive (completed keys kept for no time protect nothing)",
            ));
        }
        // A lease that ends while its holder may still be running the effect lets a twin
        // run it too (a sink without a store has no lease).
        let worst = match (&spec.effect, &spec.store) {
            (_, StoreSpec::None | StoreSpec::Postgres { .. }) => None,
            (EffectSpec::Http(h), _) => Some((
                http_worst_case(h),
                "the call can take with its retries",
                "timeout x (retries + 1) + backoffs",
                "timeout/retries",
            )),
            (EffectSpec::Redis(_), _) => Some((
                effects::redis_worst_case(spec.policy.store_retry_for),
                "the command can take with its retries",
                "store_retry_for + connecting + the 10 s reply timeout",
                "store_retry_for",
            )),
            (EffectSpec::Postgres(p), _) => Some((
                effects::postgres_worst_case(spec.policy.store_retry_for, p.timeout),
                "the statement can take with its retries",
                "store_retry_for + 3 x timeout (connecting, the statement, its cancel)",
                "store_retry_for/timeout",
            )),
            _ => None,
        };
        if let Some((worst, what, how, lower)) = worst {
            if spec.policy.lease <= worst {
                errs.push(FieldError::at("idempotency.lease", format!(
                    "{:?} is not longer than the longest {what} ({worst:?} = {how}); raise the lease or lower {lower}",
                    spec.policy.lease
                )));
            }
        }
        match &spec.effect {
            EffectSpec::Http(h) => {
                check("body", &h.body, &mut errs);
                if !matches!(h.method.as_str(), "POST" | "PUT") {
                    errs.push(FieldError::at(
                        "method",
                        format!("{:?}; use POST or PUT", h.method),
                    ));
                }
                if let Secret::Inline(u) = &h.url {
                    if !(u.starts_with("http://") || u.starts_with("https://")) {
                        errs.push(FieldError::at("url", "must start with http:// or https://"));
                    }
                }
                for (k, _) in &h.headers {
                    if reqwest::header::HeaderName::from_bytes(k.as_bytes()).is_err() {
                        errs.push(FieldError::at(
                            format!("headers.{k}"),
                            format!("{k:?} is not a valid header name (letters, digits and !#$%&'*+-.^_`|~ only)"),
                        ));
                    }
                }
            }
            EffectSpec::Postgres(p) => {
                for (i, t) in p.params.iter().enumerate() {
                    check(&format!("params[{i}]"), t, &mut errs);
                }
                if p.sql.trim().is_empty() {
                    errs.push(FieldError::at("sql", "must not be empty"));
                }
            }
            EffectSpec::Redis(r) => {
                if r.command.is_empty() {
                    errs.push(FieldError::at(
                        "command",
                        "must name a command, e.g. [SET, \"k:{value./id}\", \"{value}\"]",
                    ));
                }
                for (i, t) in r.command.iter().enumerate() {
                    check(&format!("command[{i}]"), t, &mut errs);
                }
                // The command itself is the topology's, never a record's: a record could
                // turn SET into DEL, and whether a lost reply may be sent again is decided
                // by the command's name.
                if let Some(name) = r.command.first() {
                    if Template::parse(name).is_ok_and(|t| {
                        t.parts()
                            .iter()
                            .any(|p| !matches!(p, crate::sink::template::Part::Lit(_)))
                    }) {
                        errs.push(FieldError::at(
                            "command[0]",
                            format!("{name:?}: the command name must be literal text (SET, HSET, XADD, ...), not taken from the record"),
                        ));
                    }
                }
            }
            EffectSpec::File(f) => {
                check("line", &f.line, &mut errs);
            }
        }
        if let StoreSpec::Postgres { table } = &spec.store {
            if !matches!(spec.effect, EffectSpec::Postgres(_)) {
                errs.push(FieldError::at("idempotency.store", "postgres (the inbox table) works only with a postgres sink, whose SQL commits in the same transaction; use redis or sled"));
            }
            if !inbox_table_ok(table) {
                errs.push(FieldError::at(
                    "idempotency.table",
                    format!("{table:?}; use a table name or schema.table, each made of lowercase ASCII letters, digits and '_', not starting with a digit"),
                ));
            }
        }
        errs
    }
}

/// The namespace of sink `sink`'s idempotency keys in topology `topology`:
/// `<topology>/<sink>`, the sled tree (`idempotency:<scope>`), the inbox row's scope column
/// and, in Redis, the default key prefix [`redis_prefix`].
///
/// Scopes never collide: `build()` allows only `[A-Za-z0-9._-]` in topology and stage
/// names, so neither can hold the `/` between them or the `:` that ends a Redis prefix;
/// and for any other name (a sink made outside `build()`) `%`, `/` and `:` are written
/// `%25`, `%2F`, `%3A`, so that topology `T` / sink `hook` and topology `T/hook:k` /
/// sink `s` get different scopes whatever their keys (names allowed by `build()` are left
/// as they are, so existing keys stay found).
pub(crate) fn idempotency_scope(topology: &str, sink: &str) -> String {
    fn escaped(name: &str, out: &mut String) {
        for c in name.chars() {
            match c {
                '%' => out.push_str("%25"),
                '/' => out.push_str("%2F"),
                ':' => out.push_str("%3A"),
                c => out.push(c),
            }
        }
    }
    let mut s = String::with_capacity(topology.len() + sink.len() + 1);
    escaped(topology, &mut s);
    s.push('/');
    escaped(sink, &mut s);
    s
}

/// The default prefix of a sink's Redis idempotency keys: `onceflow:<scope>:` (see
/// [`idempotency_scope`]); a key is the prefix followed by its bytes.
pub(crate) fn redis_prefix(scope: &str) -> String {
    format!("onceflow:{scope}:")
}

/// The default directory of the sled idempotency store of application `application_id`
/// with state dir `state_dir`: `<state.dir>/idempotency/<application.id>`, next to the
/// dedup stores' database `<state.dir>/<application.id>`. One sled database for all the
/// application's sinks, one tree per topology and sink.
pub(crate) fn sled_home(state_dir: &Path, application_id: &str) -> PathBuf {
    state_dir.join("idempotency").join(application_id)
}

impl ExternalSinkSpec {
    /// Bind this sink's sled idempotency store to a state dir: a default path becomes
    /// `sled_home`, a relative one is joined to `state_dir`, and both are made absolute
    /// (a relative `state_dir` is taken from the working directory now, as the dedup stores'
    /// database is). A bound path is absolute, so binding twice changes nothing; the sink
    /// refuses an unbound (default or relative) path rather than guess a directory. Other
    /// stores are left as they are.
    pub(crate) fn bind_state_dir(&mut self, state_dir: &Path, application_id: &str) {
        if let StoreSpec::Sled { path } = &mut self.store {
            let state_dir =
                std::path::absolute(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
            *path = Some(match path.take() {
                None => sled_home(&state_dir, application_id),
                Some(p) if p.is_relative() => state_dir.join(p),
                Some(p) => p,
            });
        }
    }
}

/// Whether `table` names an inbox table onceflow can write: `name` or `schema.name`, each
/// part `[a-z_][a-z0-9_]*` (lowercase: it is quoted in SQL, see [`inbox_table_sql`], so a
/// reserved word such as `order` works, and means what it would unquoted).
pub(crate) fn inbox_table_ok(table: &str) -> bool {
    let parts: Vec<&str> = table.split('.').collect();
    parts.len() <= 2
        && parts.iter().all(|p| {
            p.chars()
                .next()
                .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
}

/// `table` (checked by [`inbox_table_ok`]) as SQL: each part double-quoted.
pub(crate) fn inbox_table_sql(table: &str) -> String {
    table
        .split('.')
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join(".")
}

/// The longest an HTTP effect can take: every try timing out, plus the backoffs between.
pub(crate) fn http_worst_case(h: &HttpSpec) -> Duration {
    let mut total = h.timeout.saturating_mul(h.retries.saturating_add(1));
    let mut pause = h.backoff;
    for _ in 0..h.retries.min(64) {
        total = total.saturating_add(pause);
        pause = pause.saturating_mul(2).min(Duration::from_secs(10));
    }
    // After 64 doublings the pause is the cap (or zero without a backoff) for every
    // further retry.
    let rest = h.retries.saturating_sub(64);
    total.saturating_add(pause.saturating_mul(rest))
}

/// Start-up check of external sinks, each given with its stage name: every secret given as
/// `{ env: VAR }` is set, an HTTP sink's URL and header values are usable, a file sink's
/// path opens for appending (created if missing), and a sled store's path is not a file. Called
/// before processing starts (through `Topology::preflight`), so a missing variable stops
/// start-up instead of dead-lettering every record.
///
/// # Errors
/// [`crate::error::Error::Config`] naming the stage, the field and the variable (never a
/// value).
pub(crate) fn preflight<'a>(
    sinks: impl IntoIterator<Item = (&'a str, &'a ExternalSinkSpec)>,
) -> Result<(), crate::error::Error> {
    let mut errs = Vec::new();
    for (name, spec) in sinks {
        // Found while `check` borrows `errs`; appended after.
        let mut later: Vec<String> = Vec::new();
        // Set is not enough: a value the client cannot use would dead-letter every record
        // (or, under fail_open, run every effect unprotected). The messages name the source
        // of the value, never the value.
        let usable =
            |field: &str, s: &Secret, ok: &dyn Fn(&str) -> bool, what: &str| match s.resolve() {
                Err(e) => Some(format!("stage `{}`: field `{field}`: {e}", name)),
                Ok(v) if !ok(&v) => Some(format!(
                    "stage `{}`: field `{field}`: the value of {} is not {what}",
                    name,
                    s.describe()
                )),
                Ok(_) => None,
            };
        let redis_url = |v: &str| redis::IntoConnectionInfo::into_connection_info(v).is_ok();
        let postgres_url = |v: &str| v.parse::<tokio_postgres::Config>().is_ok();
        match &spec.effect {
            EffectSpec::Http(h) => {
                let mut found = Vec::new();
                found.extend(usable(
                    "url",
                    &h.url,
                    &|v| {
                        reqwest::Url::parse(v)
                            .map(|u| matches!(u.scheme(), "http" | "https"))
                            .unwrap_or(false)
                    },
                    "an http:// or https:// URL",
                ));
                for (k, v) in &h.headers {
                    found.extend(usable(
                        &format!("headers.{k}"),
                        v,
                        &|v| reqwest::header::HeaderValue::from_str(v).is_ok(),
                        "a valid header value (no control characters)",
                    ));
                }
                later.extend(found);
            }
            EffectSpec::Postgres(p) => {
                later.extend(usable("url", &p.url, &postgres_url, "a PostgreSQL URL"))
            }
            EffectSpec::Redis(r) => later.extend(usable("url", &r.url, &redis_url, "a Redis URL")),
            // Opened (created if need be) for appending as the sink will, so that a path in
            // a missing or read-only directory stops start-up.
            EffectSpec::File(f) => {
                let opened = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&f.path);
                if let Err(e) = opened {
                    later.push(format!(
                        "stage `{name}`: field `path`: cannot open {} for appending: {e}",
                        f.path.display()
                    ));
                }
            }
        }
        if let StoreSpec::Sled { path: Some(p) } = &spec.store {
            if p.exists() && !p.is_dir() {
                later.push(format!(
                    "stage `{name}`: field `idempotency.path`: {} is not a directory (a sled store is one)",
                    p.display()
                ));
            }
        }
        if let StoreSpec::Redis { url, .. } = &spec.store {
            later.extend(usable("idempotency.url", url, &redis_url, "a Redis URL"));
        }
        errs.extend(later);
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(crate::error::Error::Config(errs.join("; ")))
    }
}

/// The shared runtime on which every external effect runs (two worker threads, started on
/// first use).
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("onceflow-sink")
            .enable_all()
            .build()
            .expect("cannot start the sink runtime")
    })
}

#[cfg(test)]
mod scope_tests {
    use super::{idempotency_scope, inbox_table_ok, inbox_table_sql, redis_prefix};

    /// An inbox table name is a lowercase identifier or schema.identifier, quoted in SQL:
    /// `order` works (it failed on every record as a reserved word), `1inbox`, `a..b` and
    /// `Inbox` are refused at build (they passed, then failed per record). Review helper.
    #[test]
    fn inbox_table_names_are_checked_and_quoted() {
        for ok in ["onceflow_inbox", "order", "user", "ops.inbox_2", "_x"] {
            assert!(inbox_table_ok(ok), "{ok}");
        }
        for bad in ["", "1inbox", "a..b", "Inbox", "a.b.c", "a-b", "a.", "x y"] {
            assert!(!inbox_table_ok(bad), "{bad}");
        }
        assert_eq!(inbox_table_sql("ops.order"), "\"ops\".\"order\"");
    }

    #[test]
    fn scopes_of_names_build_allows_are_unchanged() {
        // Existing keys must stay found after an upgrade.
        assert_eq!(idempotency_scope("orders-a", "hook"), "orders-a/hook");
        assert_eq!(
            redis_prefix(&idempotency_scope("t", "hook")),
            "onceflow:t/hook:"
        );
    }
}
