//! The external sink stage: renders a record's key and effect on the task thread, runs the
//! effect on the sink runtime, and hands results back before each commit.
//!
//! Ordering and commit guarantee: at most `concurrency` effects are in flight per task
//! (partition); a record whose key is already in flight waits for it first, so records with
//! the same key take effect in order. [`Processor::flush`] waits for every effect in flight;
//! the runtime calls it before it commits offsets, so an offset is committed only once its
//! record's effect is done (or skipped as a duplicate) or its record is dead-lettered.
//!
//! Records whose effect is done or skipped go on to the next stage, if any, with the headers
//! `onceflow.effect.outcome` (`done`, `skipped_duplicate`, `unprotected`) and
//! `onceflow.effect.result` (the stored result). `unprotected` means the effect ran with no
//! idempotency record: `store: none`, or an unreachable store under `fail_open`.

use super::effects::{Effector, Prepared};
use super::protocol::{run_once, EffectError, EffectOutcome};
use super::store::{IdempotencyStore, RedisIdempotencyStore, SledIdempotencyStore};
use super::{EffectSpec, ExternalSinkSpec, KeyRule, StoreSpec};
use crate::error::{Error, RecordError};
use crate::processor::{Context, Processor, Record, StageError};
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::OnceCell;

/// Header naming how the effect ended.
pub const OUTCOME_HEADER: &str = "onceflow.effect.outcome";
/// Header carrying the effect's (stored) result.
pub const RESULT_HEADER: &str = "onceflow.effect.result";

struct Shared {
    name: String,
    /// `<topology>/<sink>` ([`super::idempotency_scope`]): the namespace of this sink's keys
    /// in its store (sled tree, Redis prefix, inbox rows), so sinks of the same name in other
    /// topologies sharing the store never see each other's keys.
    scope: String,
    spec: ExternalSinkSpec,
    effector: Result<Effector, String>,
    store: OnceCell<Option<Arc<dyn IdempotencyStore>>>,
    /// A `redis` sink whose idempotency store is the same Redis (same URL): its command
    /// and completed record run in one MULTI/EXEC ([`Effector::run_redis_in_transaction`]).
    redis_transaction: bool,
    /// done, skipped_duplicate, unprotected, failed, unknown.
    counters: [metrics::Counter; 5],
}

impl Shared {
    async fn store(&self) -> Result<Option<Arc<dyn IdempotencyStore>>, String> {
        self.store
            .get_or_try_init(|| async {
                Ok::<_, String>(match &self.spec.store {
                    StoreSpec::None | StoreSpec::Postgres { .. } => None,
                    StoreSpec::Sled { .. } => {
                        let path = self.sled_path()?;
                        Some(Arc::new(
                            SledIdempotencyStore::open(path, &self.scope).map_err(|e| e.0)?,
                        ) as Arc<dyn IdempotencyStore>)
                    }
                    StoreSpec::Redis { url, .. } => {
                        let url = url.resolve().map_err(|e| format!("idempotency.url: {e}"))?;
                        Some(Arc::new(
                            RedisIdempotencyStore::connect(
                                &url,
                                self.redis_prefix().as_bytes(),
                                std::time::Duration::from_secs(2),
                            )
                            .await
                            .map_err(|e| e.0)?,
                        ) as Arc<dyn IdempotencyStore>)
                    }
                })
            })
            .await
            .cloned()
    }

    /// The directory of a sled store: an absolute path, as [`super::bind_state_dir`] makes it.
    ///
    /// # Errors
    /// The store was not bound to a state dir (default or relative path).
    fn sled_path(&self) -> Result<&std::path::Path, String> {
        match &self.spec.store {
            StoreSpec::Sled { path: Some(p) } if p.is_absolute() => Ok(p),
            StoreSpec::Sled { path } => Err(format!(
                "the sled idempotency store has no state dir to live in ({}): the topology was not bound to one (App::run binds it to state.dir; in tests use TestDriver::state_dir)",
                match path {
                    Some(p) => format!("relative path {}", p.display()),
                    None => "default path".into(),
                }
            )),
            _ => Err("internal error: not a sled store".into()),
        }
    }

    /// The key prefix of a Redis store (default `onceflow:<topology>/<sink>:`).
    fn redis_prefix(&self) -> String {
        match &self.spec.store {
            StoreSpec::Redis {
                prefix: Some(p), ..
            } => p.clone(),
            _ => super::redis_prefix(&self.scope),
        }
    }

    async fn effect(&self, key: Vec<u8>, prep: Prepared) -> Result<EffectOutcome, EffectError> {
        let eff = self.effector.as_ref().map_err(|e| e.clone())?;
        let policy = &self.spec.policy;
        if let StoreSpec::Postgres { table } = &self.spec.store {
            return eff.run_with_inbox(table, &self.scope, &key, &prep).await;
        }
        if matches!(self.spec.store, StoreSpec::None) {
            // No store, no protection: reported as such, never as `done`.
            return eff
                .run(Some(&key), &prep)
                .await
                .map(EffectOutcome::Unprotected);
        }
        if matches!(self.spec.store, StoreSpec::Sled { .. }) {
            // A setting, not an outage: no retry.
            self.sled_path()?;
        }
        // Connecting is retried like any store operation (Redis may be down at start-up).
        let deadline = std::time::Instant::now() + policy.store_retry_for;
        let mut pause = std::time::Duration::from_millis(100);
        let store = loop {
            match self.store().await {
                Err(e) if std::time::Instant::now() + pause < deadline => {
                    tracing::warn!(sink = %self.name, error = %e, "idempotency store: cannot connect; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(2));
                }
                r => break r,
            }
        };
        let store = match store {
            Ok(s) => s,
            Err(e) => {
                // Could not even connect: the same policy as an unreachable store.
                return match policy.on_store_error {
                    super::OnStoreError::FailClosed => Err(format!(
                        "idempotency store unavailable (fail_closed; effect not run): {e}"
                    )
                    .into()),
                    super::OnStoreError::FailOpen => {
                        tracing::warn!(sink = %self.name, error = %e, "idempotency store unavailable: running unprotected (fail_open)");
                        eff.run(Some(&key), &prep)
                            .await
                            .map(EffectOutcome::Unprotected)
                    }
                };
            }
        };
        let Some(store) = store else {
            // Only `none` has no store here (postgres returned above): unprotected.
            return eff
                .run(Some(&key), &prep)
                .await
                .map(EffectOutcome::Unprotected);
        };
        if self.redis_transaction {
            let prefix = self.redis_prefix();
            let prep = &prep;
            return run_once(store.as_ref(), &key, policy, || {
                // A fresh mark per run of the effect: a lost reply is settled by its own mark.
                let mark = RedisIdempotencyStore::transaction_mark(
                    prefix.as_bytes(),
                    &key,
                    policy.completed_ttl,
                );
                async move { eff.run_redis_in_transaction(prep, &mark).await }
            })
            .await;
        }
        run_once(store.as_ref(), &key, policy, || eff.run(Some(&key), &prep)).await
    }
}

struct Pending {
    key: Vec<u8>,
    record: Record,
    handle: tokio::task::JoinHandle<Result<EffectOutcome, EffectError>>,
}

/// The external sink processor of one task.
pub(crate) struct ExternalSink {
    shared: Arc<Shared>,
    in_flight: VecDeque<Pending>,
    failed: Vec<(Record, RecordError)>,
    forward: bool,
    keybuf: Vec<u8>,
}

impl ExternalSink {
    /// A processor for sink `name`; `forward` passes finished records to a next stage.
    /// Connections open on first use; a setting that cannot be resolved (an unset
    /// environment variable) fails every record with its reason.
    pub(crate) fn new(topology: &str, name: &str, spec: &ExternalSinkSpec, forward: bool) -> Self {
        let c = |r: &'static str| metrics::counter!(crate::metrics::SINK_EFFECTS, "topology" => topology.to_string(), "sink" => name.to_string(), "result" => r);
        let effector = Effector::new(name, &spec.effect, spec.policy.store_retry_for);
        if let Err(e) = &effector {
            tracing::error!(sink = name, error = %e, "sink cannot be set up; its records are dead-lettered");
        }
        let redis_transaction = match (&spec.effect, &spec.store) {
            (EffectSpec::Redis(r), StoreSpec::Redis { url, .. }) => {
                matches!((r.url.resolve(), url.resolve()), (Ok(a), Ok(b)) if a == b)
            }
            _ => false,
        };
        ExternalSink {
            shared: Arc::new(Shared {
                name: name.to_string(),
                scope: super::idempotency_scope(topology, name),
                spec: spec.clone(),
                effector,
                store: OnceCell::new(),
                redis_transaction,
                counters: [
                    c("done"),
                    c("skipped_duplicate"),
                    c("unprotected"),
                    c("failed"),
                    c("unknown"),
                ],
            }),
            in_flight: VecDeque::new(),
            failed: Vec::new(),
            forward,
            keybuf: Vec::new(),
        }
    }

    fn key(&mut self, record: &Record) -> Result<Vec<u8>, String> {
        self.keybuf.clear();
        match &self.shared.spec.resolved_key {
            Some(KeyRule::Template(t)) => t.render_key_into(record, &mut self.keybuf)?,
            // The key the dedup decided by; read again only if it is not carried.
            Some(KeyRule::Dedup(k)) => match &record.dedup_key {
                Some(key) => self.keybuf.extend_from_slice(key),
                None => k
                    .extract_into(record, &mut self.keybuf)
                    .map_err(|e| format!("dedup key: {e}"))?,
            },
            None => return Err("internal error: the sink's key was not resolved by build()".into()),
        }
        if self.keybuf.is_empty() {
            return Err("idempotency key is empty".into());
        }
        let max = self.shared.spec.max_key_bytes;
        if self.keybuf.len() > max {
            return Err(format!(
                "idempotency key is {} bytes, longer than max_key_bytes ({max})",
                self.keybuf.len()
            ));
        }
        Ok(self.keybuf.clone())
    }

    /// Wait for the effect at `i` and file its result.
    fn finish(&mut self, i: usize, ctx: &mut Context<'_>) {
        let Some(p) = self.in_flight.remove(i) else {
            return;
        };
        let r = futures::executor::block_on(p.handle)
            .unwrap_or_else(|e| Err(format!("internal error: effect task failed: {e}").into()));
        let s = &self.shared;
        match r {
            Ok(o) => {
                let idx = match o {
                    EffectOutcome::Done(_) => 0,
                    EffectOutcome::SkippedDuplicate(_) => 1,
                    EffectOutcome::Unprotected(_) => {
                        if !matches!(s.spec.store, StoreSpec::None) {
                            tracing::warn!(sink = %s.name, "effect ran unprotected (idempotency store unreachable, fail_open)");
                        }
                        2
                    }
                };
                s.counters[idx].increment(1);
                let c = ctx.counts();
                match o {
                    EffectOutcome::Done(_) => c.effects_done += 1,
                    EffectOutcome::SkippedDuplicate(_) => c.effects_skipped += 1,
                    EffectOutcome::Unprotected(_) => c.effects_unprotected += 1,
                }
                if self.forward {
                    let mut rec = p.record;
                    rec.headers.push((
                        OUTCOME_HEADER.into(),
                        Some(Bytes::from_static(o.label().as_bytes())),
                    ));
                    rec.headers
                        .push((RESULT_HEADER.into(), Some(Bytes::from(o.result().to_vec()))));
                    ctx.forward(rec);
                }
            }
            Err(e) if e.unknown => {
                s.counters[4].increment(1);
                tracing::error!(sink = %s.name, partition = p.record.source.partition, offset = p.record.source.offset, reason = %e, "effect outcome unknown: dead-lettering the record");
                self.failed
                    .push((p.record, RecordError::new(&s.name, e.reason)));
            }
            Err(e) => {
                s.counters[3].increment(1);
                tracing::warn!(sink = %s.name, partition = p.record.source.partition, offset = p.record.source.offset, reason = %e, "effect failed: dead-lettering the record");
                self.failed
                    .push((p.record, RecordError::new(&s.name, e.reason)));
            }
        }
    }
}

impl Processor for ExternalSink {
    fn process(&mut self, record: Record, ctx: &mut Context<'_>) -> Result<(), StageError> {
        let key = match self.key(&record) {
            Ok(k) => k,
            Err(r) => return Err(StageError::Record(RecordError::new(&self.shared.name, r))),
        };
        let prep = match &self.shared.effector {
            Ok(e) => e.prepare(&record),
            Err(e) => Err(format!("sink not set up: {e}")),
        }
        .map_err(|r| StageError::Record(RecordError::new(&self.shared.name, r)))?;
        // Same key in flight: it goes first (per-key order).
        while let Some(i) = self.in_flight.iter().position(|p| p.key == key) {
            self.finish(i, ctx);
        }
        while self.in_flight.len() >= self.shared.spec.concurrency {
            self.finish(0, ctx);
        }
        let shared = self.shared.clone();
        let k = key.clone();
        let handle = super::runtime().spawn(async move { shared.effect(k, prep).await });
        self.in_flight.push_back(Pending {
            key,
            record,
            handle,
        });
        Ok(())
    }

    fn flush(&mut self, ctx: &mut Context<'_>) -> Result<Vec<(Record, RecordError)>, Error> {
        while !self.in_flight.is_empty() {
            self.finish(0, ctx);
        }
        Ok(std::mem::take(&mut self.failed))
    }

    fn on_abort(&mut self) {
        // The records will be processed again; effects already started still run to the
        // end (so their keys are marked and the replay skips them).
        for p in self.in_flight.drain(..) {
            let _ = futures::executor::block_on(p.handle);
        }
        self.failed.clear();
    }
}
