//! The effects themselves: an HTTP call, a PostgreSQL statement (optionally with its inbox
//! row in the same transaction), a Redis command, a line appended to a file.
//!
//! Each effect is split in two: [`Effector::prepare`] renders the record's templates on the
//! task thread (so template errors dead-letter the record before anything runs) and
//! [`Effector::run`] performs the effect on the sink runtime. Errors never carry URLs,
//! connection strings or header values: they can hold secrets.

use super::protocol::{EffectError, EffectOutcome};
use super::store::{TransactionMark, RELEASE_LUA};
use super::template::Template;
use super::{EffectSpec, Secret};
use crate::processor::Record;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A record's effect, rendered and ready to run.
#[derive(Debug, Clone)]
pub(crate) enum Prepared {
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
        /// The inbox table is there; `true` when it has the `attempt` column.
        ready: tokio::sync::OnceCell<bool>,
        /// The limit of one try's connect, and of its statement (see `PostgresSpec::timeout`).
        timeout: Duration,
    },
    Redis {
        link: RedisLink,
        command: Vec<Template>,
    },
    File {
        line: Template,
        file: Mutex<std::fs::File>,
    },
}

/// One sink's effect with its connections (opened on first use).
pub(crate) struct Effector {
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
    pub(crate) fn new(
        sink: &str,
        spec: &EffectSpec,
        retry_for: Duration,
    ) -> Result<Effector, String> {
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
                        // A redirect would resend a POST as a body-less GET (301-303) and
                        // its 2xx count as done: a 3xx is an answer of its own, dead-lettered.
                        .redirect(reqwest::redirect::Policy::none())
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
                timeout: p.timeout,
            },
            EffectSpec::Redis(r) => Kind::Redis {
                link: RedisLink::new(secret(&r.url, "url")?),
                command: r.command.iter().map(|s| t(s)).collect::<Result<_, _>>()?,
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
    pub(crate) fn prepare(&self, record: &Record) -> Result<Prepared, String> {
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
                let l = line.render_line(record).map_err(|e| format!("line: {e}"))?;
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

    /// Run the effect once (with its own retries), sending `key` where the target takes one
    /// (HTTP `Idempotency-Key`). Returns the result to store.
    ///
    /// A `redis` command is sent again after a failure only when that is safe: the
    /// connection failed before it was sent, or the command is idempotent
    /// ([`redis_command_is_idempotent`]).
    ///
    /// # Errors
    /// A sentence for the dead-letter topic: the HTTP status and a body excerpt, the
    /// database error, retries exhausted; [`EffectError::unknown`] for a `redis` command
    /// that is not idempotent whose reply was lost.
    pub(crate) async fn run(
        &self,
        key: Option<&[u8]>,
        prep: &Prepared,
    ) -> Result<Vec<u8>, EffectError> {
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
                    // HTTP drops a header value's outer whitespace: " a" would reach the
                    // receiver as "a", one key for two records.
                    if matches!(k.first().zip(k.last()), Some((a, b)) if a.is_ascii_whitespace() || b.is_ascii_whitespace())
                    {
                        return Err("the idempotency key starts or ends with whitespace, which HTTP drops from a header value (two keys would reach the receiver as one); trim the id or put a literal around it in the key template".to_string().into());
                    }
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
                            let moved = r
                                .headers()
                                .get(reqwest::header::LOCATION)
                                .map(|l| format!(" (redirected to {:?}, not followed: set the sink's url to it)", String::from_utf8_lossy(l.as_bytes())))
                                .filter(|_| (300..400).contains(&status))
                                .unwrap_or_default();
                            let text = r.bytes().await.unwrap_or_default();
                            let excerpt =
                                String::from_utf8_lossy(&text[..text.len().min(200)]).into_owned();
                            if (200..300).contains(&status) {
                                return Ok(format!("{status} {excerpt}").into_bytes());
                            }
                            let retriable =
                                matches!(status, 408 | 409 | 425 | 429) || status >= 500;
                            if !retriable {
                                return Err(format!(
                                    "HTTP {status} (not retried){moved}: {excerpt}"
                                )
                                .into());
                            }
                            format!("HTTP {status}: {excerpt}")
                        }
                        Err(e) => format!("HTTP call failed: {}", e.without_url()),
                    };
                    if attempt > *retries {
                        return Err(format!("{retry_reason} (after {attempt} tries)").into());
                    }
                    tracing::debug!(sink = %self.sink, attempt, reason = %retry_reason, "retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
            }
            (Kind::Postgres { .. }, Prepared::Sql(params)) => {
                Ok(self.pg(None, params).await.map(|o| o.result().to_vec())?)
            }
            (Kind::Redis { link, .. }, Prepared::Redis(args)) => self.redis(link, args, None).await,
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

    /// Run a `redis` effect and its completed record `mark` in one MULTI/EXEC (the sink's
    /// idempotency store is the same Redis). A command that fails inside the transaction
    /// takes the mark out again, so a failure is never recorded as completed.
    ///
    /// After a lost reply (the connection failed once the transaction was sent) the sink
    /// first closes the old connection on the server (`CLIENT KILL ID`), so a transaction
    /// still in flight on it can no longer run, then reads the record: holding `mark` means
    /// the transaction ran (the effect is done; its reply is lost, so its result says so),
    /// anything else means it did not, and it is sent again. MULTI/EXEC runs all or
    /// nothing, so the command never runs without its mark, nor twice.
    ///
    /// # Errors
    /// As [`Effector::run`]; [`EffectError::unknown`] when the record cannot be read back
    /// within the retry window after a lost reply.
    pub(crate) async fn run_redis_in_transaction(
        &self,
        prep: &Prepared,
        mark: &TransactionMark,
    ) -> Result<Vec<u8>, EffectError> {
        match (&self.kind, prep) {
            (Kind::Redis { link, .. }, Prepared::Redis(args)) => {
                self.redis(link, args, Some(mark)).await
            }
            _ => Err("internal error: a Redis transaction for another effect".into()),
        }
    }

    async fn redis(
        &self,
        link: &RedisLink,
        args: &[Vec<u8>],
        mark: Option<&TransactionMark>,
    ) -> Result<Vec<u8>, EffectError> {
        let name = String::from_utf8_lossy(&args[0]).to_ascii_uppercase();
        let idempotent = redis_command_is_idempotent(args);
        let deadline = Instant::now() + self.retry_for;
        let mut pause = Duration::from_millis(100);
        let mut cmd = redis::cmd(&name);
        for a in &args[1..] {
            cmd.arg(a);
        }
        loop {
            // Not connected: nothing was sent, so any command may be tried again.
            let Linked {
                conn: mut c,
                id,
                generation,
            } = match link.get().await {
                Ok(l) => l,
                Err(e) if Instant::now() + pause < deadline => {
                    tracing::warn!(sink = %self.sink, error = %e, "redis sink: cannot connect; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                    continue;
                }
                Err(e) => return Err(format!("redis: {e}").into()),
            };
            let r = match mark {
                None => cmd.query_async::<redis::Value>(&mut c).await,
                Some(m) => redis::pipe()
                    .atomic()
                    .add_command(cmd.clone())
                    .cmd("SET")
                    .arg(&m.key)
                    .arg(&m.value)
                    .arg("PX")
                    .arg(m.ttl_ms)
                    .ignore()
                    .query_async::<Vec<redis::Value>>(&mut c)
                    .await
                    .map(|mut v| v.pop().unwrap_or(redis::Value::Nil)),
            };
            let e = match r {
                Ok(v) => return Ok(redis_result(&v)),
                Err(e) => e,
            };
            let transport = e.is_io_error()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
                || e.is_timeout();
            if !transport {
                // Redis answered with an error. Inside MULTI/EXEC the other commands ran:
                // take the mark out again.
                if let Some(m) = mark {
                    if let Err(e2) = link.release_mark(m).await {
                        tracing::warn!(sink = %self.sink, error = %e2, "redis sink: could not take out the completed mark of a failed command; it expires with the completed TTL");
                    }
                }
                return Err(format!("redis: {e}").into());
            }
            link.forget(generation).await;
            // Refused: the command was not sent. Otherwise it may have run.
            let sent = !e.is_connection_refusal();
            if sent {
                match mark {
                    Some(m) => match link.settle(id, m, deadline).await {
                        Ok(true) => {
                            tracing::warn!(sink = %self.sink, command = %name, error = %e, "redis sink: reply lost, but the transaction ran (its completed mark is there): done");
                            return Ok(format!(
                                "{name}: done (the reply was lost; its transaction ran)"
                            )
                            .into_bytes());
                        }
                        Ok(false) => {
                            tracing::warn!(sink = %self.sink, command = %name, error = %e, "redis sink: reply lost and the transaction did not run; sending it again");
                        }
                        Err(why) => {
                            return Err(EffectError::unknown(format!(
                                "redis: the outcome of {name} is unknown: the connection failed after its transaction was sent ({e}), and whether it ran could not be read back ({why})"
                            )));
                        }
                    },
                    None if !idempotent => {
                        tracing::error!(sink = %self.sink, command = %name, error = %e, "redis sink: outcome unknown; not retried (not idempotent): dead-lettering the record");
                        return Err(EffectError::unknown(format!(
                            "redis: the outcome of {name} is unknown: the connection failed after it was sent ({e}); {name} is not idempotent, so it is not retried (it may have run once). An idempotency store on the sink's own Redis would make this case safe"
                        )));
                    }
                    None => {}
                }
            }
            if Instant::now() + pause >= deadline {
                return Err(format!("redis: {e}").into());
            }
            tracing::warn!(sink = %self.sink, error = %e, "redis sink: retrying");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
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
    pub(crate) async fn run_with_inbox(
        &self,
        table: &str,
        scope: &str,
        key: &[u8],
        prep: &Prepared,
    ) -> Result<EffectOutcome, EffectError> {
        match prep {
            Prepared::Sql(params) => self.pg(Some((table, scope, key)), params).await,
            _ => Err("internal error: inbox for a non-SQL effect".into()),
        }
    }

    /// Run the sink's statement (with `inbox`: and its inbox row, in one transaction),
    /// retrying a failed connection and serialization failures within `retry_for`.
    ///
    /// # Errors
    /// The statement failed; or, without an inbox, the connection failed after the
    /// statement was sent: its outcome is unknown ([`EffectError::unknown`], not retried, as
    /// it may have committed); with an inbox a retry is safe (the row tells).
    async fn pg(
        &self,
        inbox: Option<(&str, &str, &[u8])>,
        params: &[String],
    ) -> Result<EffectOutcome, EffectError> {
        let Kind::Postgres {
            url,
            sql,
            pool,
            ready,
            timeout,
            ..
        } = &self.kind
        else {
            return Err("internal error: not a postgres effect".into());
        };
        let deadline = Instant::now() + self.retry_for;
        // One token for every try of this effect: an inbox row holding it was written by
        // an earlier try whose COMMIT reply was lost (done), not by another record.
        let attempt: i64 = rand::random();
        let mut pause = Duration::from_millis(100);
        // Whether an earlier try may have committed (no later try has told).
        let mut unresolved = false;
        loop {
            let client = {
                let mut p = pool.lock().await;
                p.pop()
            };
            let client = match client {
                Some(c) if !c.is_closed() => Ok(c),
                _ => match tokio::time::timeout(*timeout, connect(url)).await {
                    Ok(r) => r.map_err(PgTry::Failed),
                    Err(_) => Err(PgTry::TimedOut(format!(
                        "connecting took longer than the sink's timeout ({timeout:?})"
                    ))),
                },
            };
            // Whether this try sent the statement (its outcome is then unknown when the
            // connection fails or the try times out).
            let mut sent = false;
            let r = match client {
                Ok(c) => {
                    let mut token = None;
                    if let Some((table, _, _)) = inbox {
                        let init = tokio::time::timeout(
                            *timeout,
                            ready.get_or_try_init(|| create_inbox(&c, table)),
                        );
                        match init.await {
                            // Nothing of the effect was sent: another try may create it
                            // (a lock held elsewhere, a slow server). The connection goes.
                            Err(_) => Err(PgTry::TimedOut(format!(
                                    "postgres inbox table {table}: creating it took longer than the sink's timeout ({timeout:?})"
                                ))),
                            Ok(Err(e)) => {
                                return Err(format!("postgres inbox table {table}: {e}").into())
                            }
                            Ok(Ok(true)) => {
                                token = Some(attempt);
                                Ok(())
                            }
                            Ok(Ok(false)) => Ok(()),
                        }
                    } else {
                        Ok(())
                    }
                    .map(|()| (c, token))
                }
                Err(e) => Err(e),
            };
            let r = match r {
                Ok((mut c, token)) => {
                    sent = true;
                    let cancel = c.cancel_token();
                    let (r, reusable) = {
                        let once = pg_once(&mut c, inbox.map(|i| (i, token)), sql, params);
                        tokio::pin!(once);
                        match tokio::time::timeout(*timeout, &mut once).await {
                            Ok(r) => (r.map_err(PgTry::Failed), true),
                            Err(_) => {
                                // One transaction with the inbox; alone, a statement is one
                                // unless it is a CALL or DO, which may commit inside.
                                let atomic = inbox.is_some() || !may_commit_inside(sql);
                                let settled = settle_cancelled(cancel, once, *timeout, atomic);
                                (settled.await, false)
                            }
                        }
                    };
                    // After a cancel the connection goes: a cancel that arrives late would
                    // end whatever statement it ran next.
                    if reusable && !c.is_closed() {
                        pool.lock().await.push(c);
                    }
                    r
                }
                Err(e) => Err(e),
            };
            match r {
                Ok(o) => return Ok(o),
                Err(e) => {
                    // `lost`: no reply to go by (retriable); `maybe_ran`: it may have
                    // committed (sent, and then the connection failed, or the try timed
                    // out with no reply to its cancel that tells).
                    let (lost, maybe_ran, text, code) = match &e {
                        PgTry::Failed(e) => {
                            let lost = !sent || connection_lost(e);
                            (lost, lost && sent, pg_error(e), e.code())
                        }
                        PgTry::TimedOut(what) => (true, sent, what.clone(), None),
                        PgTry::Cancelled(what) => (true, false, what.clone(), None),
                    };
                    // A try that may have committed stays unknown until a later one
                    // reads its inbox row (an `Ok` return).
                    unresolved |= maybe_ran;
                    let unknown = unresolved;
                    if unknown && inbox.is_none() {
                        tracing::error!(sink = %self.sink, error = %text, "postgres sink: outcome unknown; not retried: dead-lettering the record");
                        return Err(EffectError::unknown(format!(
                            "postgres: the outcome of the statement is unknown: the connection failed or timed out after it was sent ({text}); it is not sent again (it may have committed). The postgres idempotency store (an inbox row in the statement's transaction) makes this case safe"
                        )));
                    }
                    let retriable = match code {
                        None => lost,
                        Some(c) => {
                            *c == tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE
                                || *c == tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED
                        }
                    };
                    if !retriable || Instant::now() + pause >= deadline {
                        if unknown {
                            // A try may have committed (its inbox row would tell a
                            // redelivery): not "failed", which says it did not take place.
                            tracing::error!(sink = %self.sink, error = %text, "postgres sink: outcome unknown after the retries; dead-lettering the record");
                            return Err(EffectError::unknown(format!(
                                "postgres: the outcome of the statement is unknown: a try timed out or lost its connection after it was sent, and store_retry_for ran out before a later try could read its inbox row (last try: {text}); a redelivery finds the row if it committed"
                            )));
                        }
                        return Err(format!("postgres: {text}").into());
                    }
                    tracing::warn!(sink = %self.sink, error = %text, "postgres sink: retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

/// Why one try of a `postgres` effect failed.
enum PgTry {
    /// The client's error.
    Failed(tokio_postgres::Error),
    /// It passed the sink's timeout (connecting, the inbox table, or the statement with
    /// no reply to its cancel either).
    TimedOut(String),
    /// It passed the sink's timeout and the server answered the cancel with
    /// `query_canceled` (57014): the statement (and its transaction) did not take place.
    Cancelled(String),
}

/// Whether `sql` may commit part of its work before it ends: a top-level `CALL` of a
/// procedure, or a `DO` block, may run `COMMIT` inside (PostgreSQL 11+). Any other single
/// statement commits whole or not at all. Read from the first keyword, after whitespace
/// and comments.
fn may_commit_inside(sql: &str) -> bool {
    let mut rest = sql;
    loop {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix("--") {
            rest = r.split_once('\n').map_or("", |(_, after)| after);
        } else if let Some(r) = rest.strip_prefix("/*") {
            // Unclosed: the server refuses the statement; assume the worst meanwhile.
            let Some((_, after)) = r.split_once("*/") else {
                return true;
            };
            rest = after;
        } else {
            break;
        }
    }
    let word: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphabetic())
        .collect();
    word.eq_ignore_ascii_case("call") || word.eq_ignore_ascii_case("do")
}

/// A statement past the sink's `timeout`: ask the server to end it (its transaction rolls
/// back unless its COMMIT already ran), then read its reply, both within `timeout` again.
/// The reply tells what happened: done (it finished before the cancel took effect),
/// [`PgTry::Cancelled`] (it did not take place: only for an `atomic` statement, one that
/// commits whole or not at all), another error; no reply, or `query_canceled` for a
/// statement that may have committed part of its work, leaves the outcome unknown
/// ([`PgTry::TimedOut`]).
async fn settle_cancelled(
    cancel: tokio_postgres::CancelToken,
    once: std::pin::Pin<
        &mut impl std::future::Future<Output = Result<EffectOutcome, tokio_postgres::Error>>,
    >,
    timeout: Duration,
    atomic: bool,
) -> Result<EffectOutcome, PgTry> {
    let reply = async {
        let _ = cancel.cancel_query(tokio_postgres::NoTls).await;
        once.await
    };
    match tokio::time::timeout(timeout, reply).await {
        Ok(Ok(o)) => Ok(o),
        Ok(Err(e)) if e.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED) => {
            if atomic {
                Err(PgTry::Cancelled(format!(
                    "the statement took longer than the sink's timeout ({timeout:?}): it was cancelled and did not take place"
                )))
            } else {
                Err(PgTry::TimedOut(format!(
                    "the statement took longer than the sink's timeout ({timeout:?}) and was cancelled, but a CALL or DO may have committed part of its work before"
                )))
            }
        }
        Ok(Err(e)) => Err(PgTry::Failed(e)),
        Err(_) => Err(PgTry::TimedOut(format!(
            "the statement took longer than the sink's timeout ({timeout:?}) and its cancel got no reply"
        ))),
    }
}

/// The longest a `postgres` sink's statement can take under a redis or sled store (no
/// inbox table), retrying for `retry_for`: the last try may start just before it ends and
/// take `timeout` for each of its steps: connecting, running, and cancelling the statement
/// (the cancel and its reply).
pub(crate) fn postgres_worst_case(retry_for: Duration, timeout: Duration) -> Duration {
    retry_for.saturating_add(timeout.saturating_mul(3))
}

/// Whether `e` is the connection failing (closed, an I/O error, a timeout), as against
/// the server or the client refusing the statement.
fn connection_lost(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        if s.is::<std::io::Error>() {
            return true;
        }
        src = s.source();
    }
    false
}

/// The longest a `redis` sink's command can take, retrying for `retry_for`: the last
/// attempt may start just before it ends and take a connection (two tries) and a reply.
pub(crate) fn redis_worst_case(retry_for: Duration) -> Duration {
    retry_for
        .saturating_add(REDIS_CONNECT_TIMEOUT * 2)
        .saturating_add(REDIS_RESPONSE_TIMEOUT)
}

/// How long one connection attempt of a `redis` sink may take.
const REDIS_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a `redis` sink waits for one reply; past it the outcome is treated as after a
/// dropped connection.
const REDIS_RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether running Redis command `args` twice leaves the same state as running it once, so
/// that it may be sent again after a lost reply. An allow-list: a command not on it
/// (INCR, INCRBY, INCRBYFLOAT, DECR, DECRBY, HINCRBY, HINCRBYFLOAT, ZINCRBY, XADD, LPUSH,
/// RPUSH, LPUSHX, RPUSHX, APPEND, PUBLISH, LPOP, RPOP, SPOP, LMOVE, EVAL, ...) counts as not
/// idempotent, and so does `ZADD ... INCR`. EXPIRE and PEXPIRE are on the list although a
/// repeat restarts the relative expiry.
pub(crate) fn redis_command_is_idempotent(args: &[Vec<u8>]) -> bool {
    let Some(name) = args.first() else {
        return false;
    };
    let name = String::from_utf8_lossy(name).to_ascii_uppercase();
    match name.as_str() {
        "SET" | "SETNX" | "SETEX" | "PSETEX" | "MSET" | "MSETNX" | "HSET" | "HMSET" | "HSETNX"
        | "HDEL" | "DEL" | "UNLINK" | "EXPIRE" | "PEXPIRE" | "EXPIREAT" | "PEXPIREAT"
        | "PERSIST" | "SADD" | "SREM" | "ZREM" | "PFADD" | "SETBIT" | "SETRANGE" | "LSET"
        | "GEOADD" => true,
        "ZADD" => !args[1..].iter().any(|a| a.eq_ignore_ascii_case(b"INCR")),
        _ => false,
    }
}

/// The connection of a `redis` sink: one multiplexed connection, opened on first use and
/// again after a failure, with its server-side client id (`CLIENT ID`), so that after a
/// lost reply the server can be told to close it ([`RedisLink::settle`]).
struct RedisLink {
    url: String,
    cur: tokio::sync::Mutex<Option<Linked>>,
    /// Connections opened so far.
    opened: std::sync::atomic::AtomicU64,
}

/// One connection of a [`RedisLink`].
#[derive(Clone)]
struct Linked {
    conn: redis::aio::MultiplexedConnection,
    /// Its client id on the server, when the server gave it.
    id: Option<i64>,
    /// Which connection of the link it is (1, 2, ...).
    generation: u64,
}

impl RedisLink {
    fn new(url: String) -> Self {
        RedisLink {
            url,
            cur: tokio::sync::Mutex::new(None),
            opened: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The connection, opened if needed.
    async fn get(&self) -> Result<Linked, redis::RedisError> {
        let mut cur = self.cur.lock().await;
        if let Some(l) = &*cur {
            return Ok(l.clone());
        }
        let client = redis::Client::open(self.url.as_str())
            .map_err(|e| redis::RedisError::from((e.kind(), "invalid redis URL")))?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(REDIS_CONNECT_TIMEOUT)
            .set_response_timeout(REDIS_RESPONSE_TIMEOUT);
        let mut c = match tokio::time::timeout(
            REDIS_CONNECT_TIMEOUT * 2,
            client.get_multiplexed_async_connection_with_config(&cfg),
        )
        .await
        {
            Ok(r) => r?,
            Err(_) => {
                return Err(redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connect timed out",
                )))
            }
        };
        // Without it (an ACL may forbid CLIENT) a lost reply inside a transaction cannot
        // be settled and ends as unknown.
        let id = redis::cmd("CLIENT")
            .arg("ID")
            .query_async::<i64>(&mut c)
            .await
            .ok();
        let l = Linked {
            conn: c,
            id,
            generation: self
                .opened
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1,
        };
        *cur = Some(l.clone());
        Ok(l)
    }

    /// Drop the connection of `generation` (it failed); the next [`RedisLink::get`] opens
    /// a new one.
    async fn forget(&self, generation: u64) {
        let mut cur = self.cur.lock().await;
        if cur.as_ref().map(|l| l.generation) == Some(generation) {
            *cur = None;
        }
    }

    /// After a lost reply on the connection with client id `old`: close that connection on
    /// the server, so that nothing it sent can still run, then read whether the
    /// transaction of `mark` ran. Retried until `deadline`.
    ///
    /// # Errors
    /// Why it cannot be told: no client id to close, or Redis unreachable until `deadline`.
    async fn settle(
        &self,
        old: Option<i64>,
        mark: &TransactionMark,
        deadline: Instant,
    ) -> Result<bool, String> {
        let Some(old) = old else {
            return Err("the server gave no CLIENT ID for the connection, so it cannot be closed before reading".into());
        };
        let mut pause = Duration::from_millis(50);
        loop {
            let r = async {
                let Linked {
                    conn: mut c,
                    generation,
                    ..
                } = self.get().await?;
                let r = async {
                    // The number closed (0: it is gone already); either way nothing more
                    // can run from it.
                    redis::cmd("CLIENT")
                        .arg("KILL")
                        .arg("ID")
                        .arg(old)
                        .query_async::<i64>(&mut c)
                        .await?;
                    redis::cmd("GET")
                        .arg(&mark.key)
                        .query_async::<Option<Vec<u8>>>(&mut c)
                        .await
                }
                .await;
                if r.is_err() {
                    self.forget(generation).await;
                }
                r
            }
            .await;
            match r {
                Ok(v) => return Ok(v.as_deref() == Some(mark.value.as_slice())),
                Err(e) if Instant::now() + pause < deadline => {
                    tracing::warn!(error = %e, "redis sink: cannot read back a transaction's mark yet; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(format!("redis: {e}")),
            }
        }
    }

    /// Take `mark` out again when its command failed inside the transaction (only while
    /// it is still there).
    async fn release_mark(&self, mark: &TransactionMark) -> Result<(), redis::RedisError> {
        let mut c = self.get().await?.conn;
        redis::cmd("EVAL")
            .arg(RELEASE_LUA)
            .arg(1)
            .arg(&mark.key)
            .arg(&mark.value)
            .query_async::<i64>(&mut c)
            .await
            .map(|_| ())
    }
}

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

/// Create the inbox table if missing. Returns whether it has the `attempt` column (the
/// token of the try that wrote a row); a table made by an earlier onceflow gets it added
/// when this user may alter it, else it works on without (a try whose COMMIT reply was lost
/// is then counted a duplicate of itself: the effect still ran once).
async fn create_inbox(c: &tokio_postgres::Client, table: &str) -> Result<bool, String> {
    use tokio_postgres::error::SqlState;
    let table = super::inbox_table_sql(table);
    let ddl = format!(
        "CREATE TABLE IF NOT EXISTS {table} (sink text NOT NULL, key bytea NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now(), attempt bigint, PRIMARY KEY (sink, key))"
    );
    for _ in 0..3 {
        match c.batch_execute(&ddl).await {
            Ok(()) => break,
            // Two sessions creating it at once: one loses on the catalog's unique index.
            Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => continue,
            Err(e) => return Err(pg_error(&e)),
        }
    }
    let probe = format!("SELECT attempt FROM {table} LIMIT 0");
    match c.batch_execute(&probe).await {
        Ok(()) => return Ok(true),
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_COLUMN) => {}
        Err(e) => return Err(pg_error(&e)),
    }
    let alter = format!("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS attempt bigint");
    match c.batch_execute(&alter).await {
        Ok(()) => Ok(true),
        Err(e) => {
            tracing::warn!(table = %table, error = %pg_error(&e), "postgres inbox table has no `attempt` column and it could not be added: a try whose COMMIT reply is lost will be counted skipped_duplicate (its effect still ran once)");
            Ok(false)
        }
    }
}

/// An inbox row to write with an effect: `((table, scope, key), attempt)`.
type InboxRow<'a> = ((&'a str, &'a str, &'a [u8]), Option<i64>);

/// Run the statement once; with an inbox `((table, scope, key), attempt)`, in one
/// transaction with its inbox row (stamped with `attempt` when the table has the column).
async fn pg_once(
    c: &mut tokio_postgres::Client,
    inbox: Option<InboxRow<'_>>,
    sql: &str,
    params: &[String],
) -> Result<EffectOutcome, tokio_postgres::Error> {
    use tokio_postgres::types::{ToSql, Type};
    let types = vec![Type::TEXT; params.len()];
    let args: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
    match inbox {
        None => {
            let stmt = c.prepare_typed(sql, &types).await?;
            let n = c.execute(&stmt, &args).await?;
            Ok(EffectOutcome::Done(format!("{n} rows").into_bytes()))
        }
        Some(((table, sink, key), attempt)) => {
            let tx = c.transaction().await?;
            let table = super::inbox_table_sql(table);
            let k: &[u8] = key;
            let fresh = match attempt {
                Some(a) => {
                    let ins = format!(
                        "INSERT INTO {table} (sink, key, attempt) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING"
                    );
                    tx.execute(&ins, &[&sink, &k, &a]).await?
                }
                None => {
                    let ins = format!(
                        "INSERT INTO {table} (sink, key) VALUES ($1, $2) ON CONFLICT DO NOTHING"
                    );
                    tx.execute(&ins, &[&sink, &k]).await?
                }
            };
            if fresh == 0 {
                // Written by an earlier try of this very effect (its COMMIT's reply was
                // lost): done, once. Else another record's effect came first.
                let mine = match attempt {
                    Some(a) => {
                        let q = format!("SELECT attempt FROM {table} WHERE sink = $1 AND key = $2");
                        let row = tx.query_opt(&q, &[&sink, &k]).await?;
                        row.and_then(|r| r.get::<_, Option<i64>>(0)) == Some(a)
                    }
                    None => false,
                };
                tx.rollback().await?;
                if mine {
                    return Ok(EffectOutcome::Done(
                        b"committed by an earlier try whose reply was lost".to_vec(),
                    ));
                }
                return Ok(EffectOutcome::SkippedDuplicate(b"inbox".to_vec()));
            }
            let stmt = tx.prepare_typed(sql, &types).await?;
            let n = tx.execute(&stmt, &args).await?;
            tx.commit().await?;
            Ok(EffectOutcome::Done(format!("{n} rows").into_bytes()))
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_call_and_do_may_commit_inside() {
        use super::may_commit_inside;
        for sql in [
            "CALL p($1)",
            "  call p($1)",
            "-- note\nCALL p($1)",
            "/* a */ /* b */ Do $$ BEGIN COMMIT; END $$",
            "/* unclosed CALL",
        ] {
            assert!(may_commit_inside(sql), "{sql:?}");
        }
        for sql in [
            "INSERT INTO t VALUES ($1)",
            "WITH x AS (DELETE FROM t RETURNING *) SELECT 1",
            "-- CALL in a comment\nUPDATE t SET a = 1",
            "SELECT do_it($1)",
            "CALLS",
            "",
        ] {
            assert!(!may_commit_inside(sql), "{sql:?}");
        }
    }

    use super::redis_command_is_idempotent as idem;

    fn args(a: &[&str]) -> Vec<Vec<u8>> {
        a.iter().map(|s| s.as_bytes().to_vec()).collect()
    }

    #[test]
    fn redis_commands_are_idempotent_only_when_listed() {
        for ok in [
            &["SET", "k", "v"][..],
            &["hset", "h", "f", "v"],
            &["DEL", "k"],
            &["EXPIRE", "k", "60"],
            &["SADD", "s", "m"],
            &["ZADD", "z", "1", "m"],
        ] {
            assert!(idem(&args(ok)), "{ok:?}");
        }
        for not in [
            &["INCRBY", "k", "5"][..],
            &["INCR", "k"],
            &["HINCRBY", "h", "f", "1"],
            &["XADD", "s", "*", "f", "v"],
            &["LPUSH", "l", "v"],
            &["RPUSH", "l", "v"],
            &["ZADD", "z", "incr", "1", "m"],
            &["EVAL", "return 1", "0"],
            &["SOMETHING.NEW", "k"],
            &[],
        ] {
            assert!(!idem(&args(not)), "{not:?}");
        }
    }
}
