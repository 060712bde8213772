//! Idempotency stores: where a sink reserves an effect key before running the effect and
//! records it completed, with the effect's result, after.
//!
//! An entry is either *in flight* (reserved by one holder, identified by a random token, until
//! its lease expires) or *completed* (with the stored result, until its TTL expires). A key
//! with no entry, or with an expired lease, is free. Keys are raw bytes, stored as given.
//!
//! - `MemoryIdempotencyStore` (under `cfg(test)`): one process, for tests (it can be told to fail, to test the policies);
//! - [`SledIdempotencyStore`]: one instance, local disk (a sled tree per sink);
//! - [`RedisIdempotencyStore`]: shared by instances (`SET key NX PX lease`, then the completed record).
//!
//! The memory and sled stores share one implementation of the steps over a [`LocalMap`]
//! (get, compare-and-swap, put, persist); only the map differs.
//!
//! The PostgreSQL inbox is not a store of this kind: its row commits in the sink's own
//! transaction (see `sink::effects`).

use futures::future::BoxFuture;

/// What every store operation gives: a boxed future of its result.
pub(crate) type StoreFuture<'a, T> = BoxFuture<'a, StoreResult<T>>;

/// A store operation's result.
pub(crate) type StoreResult<T> = Result<T, StoreError>;
use std::collections::HashMap;
#[cfg(test)]
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What a reservation attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reservation {
    /// The key was free: the caller holds it until its lease expires.
    Acquired,
    /// Another holder's lease is live.
    InFlight,
    /// The effect was done; its stored result.
    Completed(Vec<u8>),
}

/// A store operation failed (unreachable, timed out): the policy `on_store_error` decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoreError(pub String);

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who reserves a key, and for how long: the reservation's token (unique per attempt) and
/// its lease (after it the key is free again, should its holder die).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    /// The attempt's token; only its holder completes or releases the key.
    pub(crate) token: u64,
    /// How long the reservation holds.
    pub(crate) lease: Duration,
}

/// A completed effect's mark: its `result` (kept for a duplicate to return), kept for `ttl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Completion<'a> {
    /// The effect's result, stored as given.
    pub(crate) result: &'a [u8],
    /// How long the mark is kept.
    pub(crate) ttl: Duration,
}

/// An idempotency store. Every method is one atomic step of the reservation protocol.
pub(crate) trait IdempotencyStore: Send + Sync {
    /// Reserve `key` for `claim.token` with a lease of `claim.lease`, unless it is in flight
    /// or completed.
    ///
    /// # Errors
    /// `StoreError` when the store cannot be reached.
    fn reserve<'a>(&'a self, key: &'a [u8], claim: Claim) -> StoreFuture<'a, Reservation>;

    /// Mark `key` completed with `done.result`, kept for `done.ttl`. Called only after the effect
    /// succeeded; it overwrites whatever is there (a completed effect is completed).
    ///
    /// # Errors
    /// `StoreError` when the store cannot be reached.
    fn complete<'a>(&'a self, key: &'a [u8], done: Completion<'a>) -> StoreFuture<'a, ()>;

    /// Drop the reservation of `key` if `token` still holds it (the effect failed).
    ///
    /// # Errors
    /// `StoreError` when the store cannot be reached.
    fn release<'a>(&'a self, key: &'a [u8], token: u64) -> StoreFuture<'a, ()>;

    /// The state of `key` now: `None` when free, else `InFlight` or `Completed`.
    ///
    /// # Errors
    /// `StoreError` when the store cannot be reached.
    fn lookup<'a>(&'a self, key: &'a [u8]) -> StoreFuture<'a, Option<Reservation>>;
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `now` (ms) plus `d`, saturating: a duration too long for the clock means "never".
fn deadline(now: u64, d: std::time::Duration) -> u64 {
    now.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Entry encoding shared by the memory and sled stores: `I` + token (8) + expiry ms (8), or
/// `C` + expiry ms (8) + result.
fn encode_in_flight(token: u64, expires: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(17);
    v.push(b'I');
    v.extend_from_slice(&token.to_be_bytes());
    v.extend_from_slice(&expires.to_be_bytes());
    v
}

fn encode_completed(result: &[u8], expires: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(9 + result.len());
    v.push(b'C');
    v.extend_from_slice(&expires.to_be_bytes());
    v.extend_from_slice(result);
    v
}

/// What a reserve with `token` finds in a stored entry: `None` when the key is free
/// (absent or expired), `Acquired` when the reservation is this token's own (a retried call
/// whose first reply was lost), else the entry's state.
fn held(v: &[u8], now: u64, token: u64) -> Option<Reservation> {
    match decode(v, now)? {
        (Reservation::InFlight, Some(t)) if t == token => Some(Reservation::Acquired),
        (r, _) => Some(r),
    }
}

/// Decode a stored entry as seen at time `now`: `None` when free (absent or expired), else
/// its state with the holder's token when in flight.
fn decode(v: &[u8], now: u64) -> Option<(Reservation, Option<u64>)> {
    let u = |b: &[u8]| u64::from_be_bytes(b.try_into().unwrap_or([0; 8]));
    match v.first() {
        Some(b'I') if v.len() == 17 => {
            (u(&v[9..17]) > now).then(|| (Reservation::InFlight, Some(u(&v[1..9]))))
        }
        Some(b'C') if v.len() >= 9 => {
            (u(&v[1..9]) > now).then(|| (Reservation::Completed(v[9..].to_vec()), None))
        }
        _ => None,
    }
}

/// The map under a local store (memory, sled): the few operations the reservation steps
/// are made of. The steps themselves are written once, in the [`IdempotencyStore`]
/// implementation for every `LocalMap`, over the entry encoding above.
pub(crate) trait LocalMap: Send + Sync {
    /// Called once at the start of every store operation (the memory store counts
    /// operations and fails injected ones here).
    ///
    /// # Errors
    /// [`StoreError`] to fail the operation.
    fn begin(&self) -> StoreResult<()> {
        Ok(())
    }

    /// The entry of `key`.
    ///
    /// # Errors
    /// [`StoreError`] when the map cannot be read.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;

    /// Atomically set `key` to `new` (`None`: remove it) if it still holds `old` (`None`:
    /// absent). `Ok(false)` when it held something else.
    ///
    /// # Errors
    /// [`StoreError`] when the map cannot be written.
    fn swap(&self, key: &[u8], old: Option<&[u8]>, new: Option<Vec<u8>>) -> StoreResult<bool>;

    /// Set `key` to `value`, whatever it held.
    ///
    /// # Errors
    /// [`StoreError`] when the map cannot be written.
    fn put(&self, key: &[u8], value: Vec<u8>) -> StoreResult<()>;

    /// Make the writes so far durable (nothing by default).
    ///
    /// # Errors
    /// [`StoreError`] when they cannot be made durable.
    fn persist(&self) -> StoreFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
}

impl<M: LocalMap> IdempotencyStore for M {
    fn reserve<'a>(&'a self, key: &'a [u8], claim: Claim) -> StoreFuture<'a, Reservation> {
        let Claim { token, lease } = claim;
        Box::pin(async move {
            self.begin()?;
            loop {
                let now = now_ms();
                let cur = self.get(key)?;
                if let Some(r) = cur.as_deref().and_then(|v| held(v, now, token)) {
                    return Ok(r);
                }
                let new = encode_in_flight(token, deadline(now, lease));
                if self.swap(key, cur.as_deref(), Some(new))? {
                    return Ok(Reservation::Acquired);
                }
                // Raced: look again.
            }
        })
    }

    fn complete<'a>(&'a self, key: &'a [u8], done: Completion<'a>) -> StoreFuture<'a, ()> {
        let Completion { result, ttl } = done;
        Box::pin(async move {
            self.begin()?;
            self.put(key, encode_completed(result, deadline(now_ms(), ttl)))?;
            self.persist().await
        })
    }

    fn release<'a>(&'a self, key: &'a [u8], token: u64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.begin()?;
            let cur = self.get(key)?;
            if let Some((Reservation::InFlight, Some(t))) =
                cur.as_deref().and_then(|v| decode(v, now_ms()))
            {
                if t == token {
                    // Lost a race: the entry changed, so it is not ours to drop any more.
                    let _ = self.swap(key, cur.as_deref(), None)?;
                }
            }
            Ok(())
        })
    }

    fn lookup<'a>(&'a self, key: &'a [u8]) -> StoreFuture<'a, Option<Reservation>> {
        Box::pin(async move {
            self.begin()?;
            Ok(self
                .get(key)?
                .as_deref()
                .and_then(|v| decode(v, now_ms()))
                .map(|r| r.0))
        })
    }
}

/// The memory store's entries: idempotency key → encoded entry.
#[cfg(test)]
type Entries = HashMap<Vec<u8>, Vec<u8>>;

/// In-process store for tests: a map behind a mutex, with real time for leases. It can be
/// set to fail the next `n` operations, to exercise `on_store_error`.
#[cfg(test)]
#[derive(Default, Clone)]
pub(crate) struct MemoryIdempotencyStore {
    map: Arc<Mutex<Entries>>,
    fail_next: Arc<AtomicUsize>,
    /// Operations served (reserve, complete, release, lookup), failed or not.
    pub(crate) ops: Arc<AtomicUsize>,
}

#[cfg(test)]
impl MemoryIdempotencyStore {
    /// An empty store.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Fail the next `n` operations with a [`StoreError`].
    pub(crate) fn fail_next(&self, n: usize) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    fn check(&self) -> StoreResult<()> {
        self.ops.fetch_add(1, Ordering::SeqCst);
        let r = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        match r {
            Ok(_) => Err(StoreError("memory store: injected failure".into())),
            Err(_) => Ok(()),
        }
    }

    fn map(&self) -> Result<std::sync::MutexGuard<'_, Entries>, StoreError> {
        self.map
            .lock()
            .map_err(|_| StoreError("memory store poisoned".into()))
    }
}

#[cfg(test)]
impl LocalMap for MemoryIdempotencyStore {
    fn begin(&self) -> StoreResult<()> {
        self.check()
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.map()?.get(key).cloned())
    }

    fn swap(&self, key: &[u8], old: Option<&[u8]>, new: Option<Vec<u8>>) -> StoreResult<bool> {
        let mut m = self.map()?;
        if m.get(key).map(Vec::as_slice) != old {
            return Ok(false);
        }
        match new {
            Some(v) => m.insert(key.to_vec(), v),
            None => m.remove(key),
        };
        Ok(true)
    }

    fn put(&self, key: &[u8], value: Vec<u8>) -> StoreResult<()> {
        self.map()?.insert(key.to_vec(), value);
        Ok(())
    }
}

/// Local store: one sled tree per sink in a database shared by the process. It protects
/// against redelivery to this instance (crash, restart, retry, a twin from another local
/// partition) but not against a twin on another instance: use Redis for that.
#[derive(Clone)]
pub(crate) struct SledIdempotencyStore {
    tree: sled::Tree,
    /// The sweep of expired entries: where the last chunk ended, and operations since.
    sweep: Arc<Mutex<Sweep>>,
}

/// An incremental sweep over a sled store's tree: every [`SWEEP_EVERY`] writes, the next
/// [`SWEEP_CHUNK`] entries are read and the expired ones (a completed key past its TTL, a
/// reservation past its lease) deleted, so the tree holds about the keys of one TTL
/// rather than every key ever done.
#[derive(Default)]
struct Sweep {
    after: Option<Vec<u8>>,
    writes: u64,
}

/// Writes between two sweep steps.
const SWEEP_EVERY: u64 = 64;
/// Entries read by one sweep step: four times [`SWEEP_EVERY`], so the sweep outpaces the
/// writes that add keys.
const SWEEP_CHUNK: usize = 256;

static SLED_DBS: std::sync::OnceLock<Mutex<HashMap<std::path::PathBuf, sled::Db>>> =
    std::sync::OnceLock::new();

impl SledIdempotencyStore {
    /// Open (or reuse, within this process) the database at `path` and its tree `tree`.
    /// The database's page cache takes at most 16 MiB
    /// ([`crate::config::STATE_CACHE_BYTES`]).
    ///
    /// # Errors
    /// [`StoreError`] when sled cannot open the path.
    pub(crate) fn open(path: &std::path::Path, tree: &str) -> StoreResult<SledIdempotencyStore> {
        let dbs = SLED_DBS.get_or_init(Default::default);
        let mut dbs = dbs
            .lock()
            .map_err(|_| StoreError("sled registry poisoned".into()))?;
        let db = match dbs.get(path) {
            Some(db) => db.clone(),
            None => {
                // sled's page cache bounded as the state stores' is (16 MiB), not sled's
                // default (up to 1 GiB): a read that misses it costs far less than the
                // external effect each read guards.
                let db = sled::Config::new()
                    .path(path)
                    .cache_capacity(crate::config::STATE_CACHE_BYTES)
                    .open()
                    .map_err(|e| {
                        StoreError(format!(
                            "cannot open the sled idempotency store at {}: {e}",
                            path.display()
                        ))
                    })?;
                dbs.insert(path.to_path_buf(), db.clone());
                db
            }
        };
        let tree = db
            .open_tree(format!("idempotency:{tree}"))
            .map_err(|e| StoreError(format!("sled tree {tree}: {e}")))?;
        Ok(SledIdempotencyStore {
            tree,
            sweep: Arc::default(),
        })
    }

    /// Count a write; every [`SWEEP_EVERY`] writes, delete the expired entries among the
    /// next [`SWEEP_CHUNK`] (each only if unchanged since read, so a concurrent reservation
    /// is never lost), wrapping around at the end of the tree.
    fn sweep_step(&self) -> StoreResult<()> {
        let Ok(mut sweep) = self.sweep.lock() else {
            return Ok(()); // a panicked sweep: the store still works, unswept
        };
        sweep.writes += 1;
        if sweep.writes % SWEEP_EVERY != 0 {
            return Ok(());
        }
        let now = now_ms();
        let mut left = SWEEP_CHUNK;
        // From the cursor to the end, then (if the chunk is not used up) from the start.
        for from in [sweep.after.take(), None] {
            let range = match &from {
                Some(a) => self.tree.range((
                    std::ops::Bound::Excluded(a.clone()),
                    std::ops::Bound::Unbounded,
                )),
                None => self.tree.iter(),
            };
            for kv in range.take(left) {
                let (k, v) = kv.map_err(Self::err)?;
                left -= 1;
                if decode(&v, now).is_none() {
                    // Err: changed meanwhile (reserved again): kept.
                    let _ = self
                        .tree
                        .compare_and_swap(&k, Some(&v), None as Option<&[u8]>)
                        .map_err(Self::err)?;
                }
                sweep.after = Some(k.to_vec());
            }
            if left == 0 || from.is_none() {
                break;
            }
        }
        Ok(())
    }

    /// [`Self::sweep_step`], best effort: the operation that triggered it has succeeded,
    /// so a failing sweep is logged, not reported (the next step tries again).
    fn sweep(&self) {
        if let Err(e) = self.sweep_step() {
            tracing::warn!(error = %e, "sweeping expired idempotency keys failed; retried later");
        }
    }

    fn err(e: sled::Error) -> StoreError {
        StoreError(format!("sled idempotency store: {e}"))
    }
}

impl LocalMap for SledIdempotencyStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.tree.get(key).map_err(Self::err)?.map(|v| v.to_vec()))
    }

    fn swap(&self, key: &[u8], old: Option<&[u8]>, new: Option<Vec<u8>>) -> StoreResult<bool> {
        let swapped = self
            .tree
            .compare_and_swap(key, old, new)
            .map_err(Self::err)?
            .is_ok();
        self.sweep();
        Ok(swapped)
    }

    fn put(&self, key: &[u8], value: Vec<u8>) -> StoreResult<()> {
        self.tree.insert(key, value).map_err(Self::err)?;
        self.sweep();
        Ok(())
    }

    fn persist(&self) -> StoreFuture<'_, ()> {
        // Durable before the record's offset can be committed. sled's flush_async stalled
        // under many concurrent callers here; a blocking flush on the blocking pool does not.
        let tree = self.tree.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || tree.flush())
                .await
                .map_err(|e| StoreError(format!("sled flush task: {e}")))?
                .map_err(Self::err)?;
            Ok(())
        })
    }
}

/// Shared store on Redis. The Redis key is `prefix` + the idempotency key bytes. In flight:
/// `SET k I<token> NX PX <lease>`; completed: `SET k C<result> PX <ttl>`; release deletes the
/// key only while it still holds our token (a Lua script, so it is atomic).
#[derive(Clone)]
pub(crate) struct RedisIdempotencyStore {
    conn: redis::aio::ConnectionManager,
    prefix: Vec<u8>,
    op_timeout: Duration,
}

/// Delete `KEYS[1]` only while it holds `ARGV[1]` (atomic: a script).
pub(crate) const RELEASE_LUA: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

/// The completed record a `redis` sink writes in the same MULTI/EXEC as its command, when
/// its idempotency store is the same Redis (see `sink::effects`): the command and the
/// record take effect together or not at all. Its result names one attempt (a random
/// nonce), so after a lost reply the sink can read whether *this* attempt ran. Once the
/// reply is in, the reservation protocol overwrites it with the command's real result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TransactionMark {
    /// The Redis key of the idempotency record: the store's prefix + the idempotency key.
    pub(crate) key: Vec<u8>,
    /// The record: `C` (completed) + `transaction <nonce>`.
    pub(crate) value: Vec<u8>,
    /// Its time to live, in milliseconds (the completed TTL).
    pub(crate) ttl_ms: u64,
}

impl RedisIdempotencyStore {
    /// Connect to `url` (`redis://host:port/db`). Each operation times out after `op_timeout`.
    ///
    /// # Errors
    /// [`StoreError`] when the URL is invalid or Redis cannot be reached; the message never
    /// holds the URL (it may carry a password).
    pub(crate) async fn connect(
        url: &str,
        prefix: &[u8],
        op_timeout: Duration,
    ) -> StoreResult<RedisIdempotencyStore> {
        let client = redis::Client::open(url).map_err(|e| {
            StoreError(format!(
                "redis idempotency store: invalid URL ({:?})",
                e.kind()
            ))
        })?;
        let cfg = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(op_timeout)
            .set_response_timeout(op_timeout)
            .set_number_of_retries(1);
        let conn = tokio::time::timeout(
            op_timeout * 2,
            redis::aio::ConnectionManager::new_with_config(client, cfg),
        )
        .await
        .map_err(|_| StoreError("redis idempotency store: connect timed out".into()))?
        .map_err(|e| StoreError(format!("redis idempotency store: connect failed: {e}")))?;
        Ok(RedisIdempotencyStore {
            conn,
            prefix: prefix.to_vec(),
            op_timeout,
        })
    }

    fn k(&self, key: &[u8]) -> Vec<u8> {
        let mut k = self.prefix.clone();
        k.extend_from_slice(key);
        k
    }

    /// A fresh [`TransactionMark`] for `key` in a store with key prefix `prefix`, kept for
    /// `ttl` (the completed TTL).
    pub(crate) fn transaction_mark(prefix: &[u8], key: &[u8], ttl: Duration) -> TransactionMark {
        let mut k = prefix.to_vec();
        k.extend_from_slice(key);
        TransactionMark {
            key: k,
            value: format!("Ctransaction {:016x}", rand::random::<u64>()).into_bytes(),
            ttl_ms: ttl.as_millis().max(1) as u64,
        }
    }

    async fn q<T: redis::FromRedisValue>(&self, c: redis::Cmd) -> StoreResult<T> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.op_timeout, c.query_async(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(StoreError(format!("redis idempotency store: {e}"))),
            Err(_) => Err(StoreError(
                "redis idempotency store: operation timed out".into(),
            )),
        }
    }

    fn parse(v: Option<Vec<u8>>) -> Option<Reservation> {
        match v {
            Some(v) if v.first() == Some(&b'C') => Some(Reservation::Completed(v[1..].to_vec())),
            Some(_) => Some(Reservation::InFlight),
            None => None,
        }
    }
}

impl IdempotencyStore for RedisIdempotencyStore {
    fn reserve<'a>(&'a self, key: &'a [u8], claim: Claim) -> StoreFuture<'a, Reservation> {
        let Claim { token, lease } = claim;
        Box::pin(async move {
            let k = self.k(key);
            let mut val = vec![b'I'];
            val.extend_from_slice(token.to_string().as_bytes());
            loop {
                let mut c = redis::cmd("SET");
                c.arg(&k)
                    .arg(&val)
                    .arg("NX")
                    .arg("PX")
                    .arg(lease.as_millis().max(1) as u64);
                let ok: Option<String> = self.q(c).await?;
                if ok.is_some() {
                    return Ok(Reservation::Acquired);
                }
                let mut g = redis::cmd("GET");
                g.arg(&k);
                let held: Option<Vec<u8>> = self.q(g).await?;
                if held.as_deref() == Some(val.as_slice()) {
                    // Our own reservation: an earlier try of this call set it, and its
                    // reply was lost (a timeout), so the retry finds it.
                    return Ok(Reservation::Acquired);
                }
                if let Some(r) = Self::parse(held) {
                    return Ok(r);
                }
                // Expired or released between SET and GET: try again.
            }
        })
    }

    fn complete<'a>(&'a self, key: &'a [u8], done: Completion<'a>) -> StoreFuture<'a, ()> {
        let Completion { result, ttl } = done;
        Box::pin(async move {
            let mut val = vec![b'C'];
            val.extend_from_slice(result);
            let mut c = redis::cmd("SET");
            c.arg(self.k(key))
                .arg(val)
                .arg("PX")
                .arg(ttl.as_millis().max(1) as u64);
            let _: Option<String> = self.q(c).await?;
            Ok(())
        })
    }

    fn release<'a>(&'a self, key: &'a [u8], token: u64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut val = vec![b'I'];
            val.extend_from_slice(token.to_string().as_bytes());
            let mut c = redis::cmd("EVAL");
            c.arg(RELEASE_LUA).arg(1).arg(self.k(key)).arg(val);
            let _: i64 = self.q(c).await?;
            Ok(())
        })
    }

    fn lookup<'a>(&'a self, key: &'a [u8]) -> StoreFuture<'a, Option<Reservation>> {
        Box::pin(async move {
            let mut g = redis::cmd("GET");
            g.arg(self.k(key));
            Ok(Self::parse(self.q(g).await?))
        })
    }
}

#[cfg(test)]
mod sweep_tests {
    use super::*;

    #[test]
    fn the_sled_store_forgets_expired_keys_as_it_is_used() {
        let dir = tempfile::tempdir().unwrap();
        let s = SledIdempotencyStore::open(&dir.path().join("db"), "t/hook").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let claim = Claim {
            token: 1,
            lease: Duration::from_secs(60),
        };
        let done = |ttl| Completion {
            result: b"200 ok",
            ttl,
        };
        rt.block_on(async {
            // 1,000 keys done with a 1 ms TTL, 10 with an hour's.
            for i in 0..1_010u32 {
                let k = i.to_be_bytes();
                assert_eq!(s.reserve(&k, claim).await.unwrap(), Reservation::Acquired);
                let ttl = if i < 1_000 { 1 } else { 3_600_000 };
                s.complete(&k, done(Duration::from_millis(ttl)))
                    .await
                    .unwrap();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            // Using the store (200 more keys, done for an hour) sweeps the expired ones.
            for i in 2_000..2_200u32 {
                let k = i.to_be_bytes();
                s.reserve(&k, claim).await.unwrap();
                s.complete(&k, done(Duration::from_secs(3600)))
                    .await
                    .unwrap();
            }
            // Every live key is kept, with its result.
            for i in (1_000..1_010u32).chain(2_000..2_200) {
                let got = s.lookup(&i.to_be_bytes()).await.unwrap();
                assert_eq!(got, Some(Reservation::Completed(b"200 ok".to_vec())), "{i}");
            }
        });
        assert_eq!(s.tree.len(), 210, "expired keys kept");
    }
}
