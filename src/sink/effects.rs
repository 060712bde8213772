//! The effects themselves: an HTTP call, a PostgreSQL statement (optionally with its inbox
//! row in the same transaction), a Redis command, a line appended to a file.
//!
//! Each effect is split in two: [`Effector::prepare`] renders the record's templates on the
//! task thread (so template errors dead-letter the record before anything runs) and
//! [`Effector::run`] performs the effect on the sink runtime. Errors never carry URLs,
//! connection strings or header values: they can hold secrets.

use super::protocol::Outcome;
use super::template::Template;
use super::{EffectSpec, Secret};
use crate::processor::Record;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A record's effect, rendered and ready to run.
#[derive(Debug, Clone)]
pub enum Prepared {
    /// HTTP body.
    Http(Vec<u8>),
    /// SQL parameters (text).
    Sql(Vec<String>),
    /// Redis command and arguments.
    Redis(Vec<Vec<u8>>),
    /// A file line (without its newline).
    Line(Vec<u8>),
}

enum Kind {
    Http {
        client: reqwest::Client,
        url: String,
        method: reqwest::Method,
        headers: reqwest::header::HeaderMap,
        body: Template,
        retries: u32,
        backoff: Duration,
    },
    Postgres {
        url: String,
        sql: String,
        params: Vec<Template>,
        pool: tokio::sync::Mutex<Vec<tokio_postgres::Client>>,
        ready: tokio::sync::OnceCell<()>,
    },
    Redis {
        url: String,
        command: Vec<Template>,
        conn: tokio::sync::OnceCell<redis::aio::ConnectionManager>,
    },
    File {
        line: Template,
        file: Mutex<std::fs::File>,
    },
}

/// One sink's effect with its connections (opened on first use).
pub struct Effector {
    kind: Kind,
    sink: String,
    /// How long failing connections are retried before the record fails.
    retry_for: Duration,
}

fn secret(s: &Secret, what: &str) -> Result<String, String> {
    s.resolve().map_err(|e| format!("{what}: {e}"))
}

impl Effector {
    /// Set up the effect of sink `sink` (resolve secrets, build the HTTP client, open the
    /// file); connections to databases are opened on first use.
    ///
    /// # Errors
    /// A sentence naming the setting: an unset environment variable, a bad header, a file
    /// that cannot be opened.
    pub fn new(sink: &str, spec: &EffectSpec, retry_for: Duration) -> Result<Effector, String> {
        let t = |s: &str| Template::parse(s);
        let kind = match spec {
            EffectSpec::Http(h) => {
                let mut headers = reqwest::header::HeaderMap::new();
                for (k, v) in &h.headers {
                    let name = reqwest::header::HeaderName::from_bytes(k.as_bytes())
                        .map_err(|_| format!("header name {k:?} is not valid"))?;
                    let val =
                        reqwest::header::HeaderValue::from_str(&secret(v, &format!("header {k}"))?)
                            .map_err(|_| {
                                format!("header {k}: the value is not a valid header value")
                            })?;
                    headers.insert(name, val);
                }
                Kind::Http {
                    client: reqwest::Client::builder()
                        .timeout(h.timeout)
                        .pool_max_idle_per_host(64)
                        .build()
                        .map_err(|e| format!("http client: {e}"))?,
                    url: secret(&h.url, "url")?,
                    method: reqwest::Method::from_bytes(h.method.as_bytes())
                        .map_err(|_| format!("method {:?}", h.method))?,
                    headers,
                    body: t(&h.body)?,
                    retries: h.retries,
                    backoff: h.backoff,
                }
            }
            EffectSpec::Postgres(p) => Kind::Postgres {
                url: secret(&p.url, "url")?,
                sql: p.sql.clone(),
                params: p.params.iter().map(|s| t(s)).collect::<Result<_, _>>()?,
                pool: tokio::sync::Mutex::new(Vec::new()),
                ready: tokio::sync::OnceCell::new(),
            },
            EffectSpec::Redis(r) => Kind::Redis {
                url: secret(&r.url, "url")?,
                command: r.command.iter().map(|s| t(s)).collect::<Result<_, _>>()?,
                conn: tokio::sync::OnceCell::new(),
            },
            EffectSpec::File(f) => Kind::File {
                line: t(&f.line)?,
                file: Mutex::new(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&f.path)
                        .map_err(|e| format!("cannot open {}: {e}", f.path.display()))?,
                ),
            },
        };
        Ok(Effector {
            kind,
            sink: sink.to_string(),
            retry_for,
        })
    }

    /// Render the record's templates.
    ///
    /// # Errors
    /// The template error (a missing field, header, key).
    pub fn prepare(&self, record: &Record) -> Result<Prepared, String> {
        Ok(match &self.kind {
            Kind::Http { body, .. } => {
                Prepared::Http(body.render(record).map_err(|e| format!("body: {e}"))?)
            }
            Kind::Postgres { params, .. } => Prepared::Sql(
                params
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let b = p.render(record).map_err(|e| format!("params[{i}]: {e}"))?;
                        String::from_utf8(b).map_err(|_| {
                            format!("params[{i}]: not UTF-8 text, cannot be a SQL text parameter")
                        })
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Kind::Redis { command, .. } => Prepared::Redis(
                command
                    .iter()
                    .enumerate()
                    .map(|(i, p)| p.render(record).map_err(|e| format!("command[{i}]: {e}")))
                    .collect::<Result<_, _>>()?,
            ),
            Kind::File { line, .. } => {
                let l = line.render(record).map_err(|e| format!("line: {e}"))?;
                // One record, one line: a rendered line break would split it.
                if l.iter().any(|b| matches!(b, b'\n' | b'\r')) {
                    return Err(
                        "line: the rendered line contains a line break; a file sink \
                                writes one line per record ({value} renders JSON on one line)"
                            .to_string(),
                    );
                }
                Prepared::Line(l)
            }
        })
    }

    /// Whether this is a PostgreSQL effect (which can carry its inbox row).
    pub fn is_postgres(&self) -> bool {
        matches!(self.kind, Kind::Postgres { .. })
    }

    /// Run the effect once (with its own retries), sending `key` where the target takes one
    /// (HTTP `Idempotency-Key`). Returns the result to store.
    ///
    /// # Errors
    /// A sentence for the dead-letter topic: the HTTP status and a body excerpt, the
    /// database error, retries exhausted.
    pub async fn run(&self, key: Option<&[u8]>, prep: &Prepared) -> Result<Vec<u8>, String> {
        match (&self.kind, prep) {
            (
                Kind::Http {
                    client,
                    url,
                    method,
                    headers,
                    retries,
                    backoff,
                    ..
                },
                Prepared::Http(body),
            ) => {
                let mut headers = headers.clone();
                if let Some(k) = key {
                    let v = reqwest::header::HeaderValue::from_bytes(k).map_err(|_| {
                        "the idempotency key holds bytes an HTTP header cannot carry (control characters)".to_string()
                    })?;
                    headers.insert("idempotency-key", v);
                }
                let mut pause = *backoff;
                let mut attempt = 0u32;
                loop {
                    attempt += 1;
                    let resp = client
                        .request(method.clone(), url)
                        .headers(headers.clone())
                        .body(body.clone())
                        .send()
                        .await;
                    let retry_reason = match resp {
                        Ok(r) => {
                            let status = r.status().as_u16();
                            let text = r.bytes().await.unwrap_or_default();
                            let excerpt =
                                String::from_utf8_lossy(&text[..text.len().min(200)]).into_owned();
                            if (200..300).contains(&status) {
                                return Ok(format!("{status} {excerpt}").into_bytes());
                            }
                            let retriable =
                                matches!(status, 408 | 409 | 425 | 429) || status >= 500;
                            if !retriable {
                                return Err(format!("HTTP {status} (not retried): {excerpt}"));
                            }
                            format!("HTTP {status}: {excerpt}")
                        }
                        Err(e) => format!("HTTP call failed: {}", e.without_url()),
                    };
                    if attempt > *retries {
                        return Err(format!("{retry_reason} (after {attempt} tries)"));
                    }
                    tracing::debug!(sink = %self.sink, attempt, reason = %retry_reason, "retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
            }
            (Kind::Postgres { .. }, Prepared::Sql(params)) => {
                self.pg(None, params).await.map(|o| o.result().to_vec())
            }
            (Kind::Redis { url, conn, .. }, Prepared::Redis(args)) => {
                let deadline = Instant::now() + self.retry_for;
                let mut pause = Duration::from_millis(100);
                loop {
                    let r = async {
                        let c = conn
                            .get_or_try_init(|| async {
                                let client = redis::Client::open(url.as_str()).map_err(|e| {
                                    redis::RedisError::from((e.kind(), "invalid redis URL"))
                                })?;
                                // redis-rs's default reconnect backoff (6 tries from 1 s,
                                // factor 100, up to a minute each) held one record for
                                // minutes; the retry window is ours (`retry_for`).
                                let cfg = redis::aio::ConnectionManagerConfig::new()
                                    .set_connection_timeout(REDIS_CONNECT_TIMEOUT)
                                    .set_number_of_retries(1)
                                    .set_max_delay(500);
                                match tokio::time::timeout(
                                    REDIS_CONNECT_TIMEOUT * 2,
                                    redis::aio::ConnectionManager::new_with_config(client, cfg),
                                )
                                .await
                                {
                                    Ok(r) => r,
                                    Err(_) => Err(redis::RedisError::from(std::io::Error::new(
                                        std::io::ErrorKind::TimedOut,
                                        "connect timed out",
                                    ))),
                                }
                            })
                            .await?;
                        let mut c = c.clone();
                        let mut cmd = redis::cmd(&String::from_utf8_lossy(&args[0]));
                        for a in &args[1..] {
                            cmd.arg(a);
                        }
                        cmd.query_async::<redis::Value>(&mut c).await
                    }
                    .await;
                    match r {
                        Ok(v) => return Ok(redis_result(&v)),
                        Err(e)
                            if (e.is_io_error()
                                || e.is_connection_dropped()
                                || e.is_connection_refusal()
                                || e.is_timeout())
                                && Instant::now() + pause < deadline =>
                        {
                            tracing::warn!(sink = %self.sink, error = %e, "redis sink: retrying");
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(Duration::from_secs(2));
                        }
                        Err(e) => return Err(format!("redis: {e}")),
                    }
                }
            }
            (Kind::File { file, .. }, Prepared::Line(line)) => {
                use std::io::Write;
                let mut f = file.lock().map_err(|_| "file lock poisoned".to_string())?;
                let mut buf = line.clone();
                buf.push(b'\n');
                f.write_all(&buf).map_err(|e| format!("file write: {e}"))?;
                f.sync_data().map_err(|e| format!("file sync: {e}"))?;
                Ok(Vec::new())
            }
            _ => Err("internal error: prepared effect of another kind".into()),
        }
    }

    /// Run the PostgreSQL statement with its inbox row `(scope, key)` in `table`, in one
    /// transaction: if the row exists the transaction is rolled back and the effect is a
    /// duplicate. Exactly once for the database. `scope` (the stage passes
    /// `<topology>/<sink>`) keeps the keys of different sinks and topologies sharing one
    /// inbox table apart.
    ///
    /// # Errors
    /// As [`Effector::run`].
    pub async fn run_with_inbox(
        &self,
        table: &str,
        scope: &str,
        key: &[u8],
        prep: &Prepared,
    ) -> Result<Outcome, String> {
        match prep {
            Prepared::Sql(params) => self.pg(Some((table, scope, key)), params).await,
            _ => Err("internal error: inbox for a non-SQL effect".into()),
        }
    }

    async fn pg(
        &self,
        inbox: Option<(&str, &str, &[u8])>,
        params: &[String],
    ) -> Result<Outcome, String> {
        let Kind::Postgres {
            url,
            sql,
            pool,
            ready,
            ..
        } = &self.kind
        else {
            return Err("internal error: not a postgres effect".into());
        };
        let deadline = Instant::now() + self.retry_for;
        let mut pause = Duration::from_millis(100);
        loop {
            let client = {
                let mut p = pool.lock().await;
                p.pop()
            };
            let client = match client {
                Some(c) if !c.is_closed() => Ok(c),
                _ => connect(url).await,
            };
            let r = match client {
                Ok(mut c) => {
                    if let Some((table, _, _)) = inbox {
                        if let Err(e) = ready.get_or_try_init(|| create_inbox(&c, table)).await {
                            return Err(format!("postgres inbox table {table}: {e}"));
                        }
                    }
                    let r = pg_once(&mut c, inbox, sql, params).await;
                    if !c.is_closed() {
                        pool.lock().await.push(c);
                    }
                    r
                }
                Err(e) => Err(e),
            };
            match r {
                Ok(o) => return Ok(o),
                Err(e) => {
                    let retriable = match e.code() {
                        None => true, // connection, I/O
                        Some(c) => {
                            *c == tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE
                                || *c == tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED
                        }
                    };
                    let text = pg_error(&e);
                    if !retriable || Instant::now() + pause >= deadline {
                        return Err(format!("postgres: {text}"));
                    }
                    tracing::warn!(sink = %self.sink, error = %text, "postgres sink: retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

/// How long one connection attempt of a `redis` sink may take.
const REDIS_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The stored result of a Redis command: a status or string reply as its bytes, an integer as
/// decimal text, anything else in its debug form.
fn redis_result(v: &redis::Value) -> Vec<u8> {
    match v {
        redis::Value::Okay => b"OK".to_vec(),
        redis::Value::Int(i) => i.to_string().into_bytes(),
        redis::Value::BulkString(b) => b.clone(),
        redis::Value::SimpleString(s) => s.clone().into_bytes(),
        redis::Value::Nil => b"nil".to_vec(),
        other => format!("{other:?}").into_bytes(),
    }
}

fn pg_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{} ({})", d.message(), d.code().code()),
        // The cause (e.g. "connection refused") is in the source; it holds no secret.
        None => match std::error::Error::source(e) {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        },
    }
}

async fn connect(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "postgres connection closed");
        }
    });
    Ok(client)
}

async fn create_inbox(c: &tokio_postgres::Client, table: &str) -> Result<(), String> {
    let ddl = format!(
        "CREATE TABLE IF NOT EXISTS {table} (sink text NOT NULL, key bytea NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (sink, key))"
    );
    for _ in 0..3 {
        match c.batch_execute(&ddl).await {
            Ok(()) => return Ok(()),
            // Two sessions creating it at once: one loses on the catalog's unique index.
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
                continue
            }
            Err(e) => return Err(pg_error(&e)),
        }
    }
    Ok(())
}

async fn pg_once(
    c: &mut tokio_postgres::Client,
    inbox: Option<(&str, &str, &[u8])>,
    sql: &str,
    params: &[String],
) -> Result<Outcome, tokio_postgres::Error> {
    use tokio_postgres::types::{ToSql, Type};
    let types = vec![Type::TEXT; params.len()];
    let args: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
    match inbox {
        None => {
            let stmt = c.prepare_typed(sql, &types).await?;
            let n = c.execute(&stmt, &args).await?;
            Ok(Outcome::Done(format!("{n} rows").into_bytes()))
        }
        Some((table, sink, key)) => {
            let tx = c.transaction().await?;
            let ins =
                format!("INSERT INTO {table} (sink, key) VALUES ($1, $2) ON CONFLICT DO NOTHING");
            let k: &[u8] = key;
            let fresh = tx.execute(&ins, &[&sink, &k]).await?;
            if fresh == 0 {
                tx.rollback().await?;
                return Ok(Outcome::SkippedDuplicate(b"inbox".to_vec()));
            }
            let stmt = tx.prepare_typed(sql, &types).await?;
            let n = tx.execute(&stmt, &args).await?;
            tx.commit().await?;
            Ok(Outcome::Done(format!("{n} rows").into_bytes()))
        }
    }
}
