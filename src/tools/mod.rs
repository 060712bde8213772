//! Operator tools over an application's dedup state and internal topics: what the CLI's
//! `onceflow state get | dump | seed` and `onceflow reset` run (see [`cli`]).
//!
//! # Where state is read from
//! A dedup store is partition-local: one sled tree per (store, partition) under
//! `<state.dir>/<application.id>`, each change also written to the compacted changelog
//! `<application.id>-<store>-changelog` (same partition as the source record). The tools read
//! each partition the way a restore does: the local tree when this machine has one (with
//! the changelog offset it reached), then the changelog from that offset to its end, read
//! `read_committed`; without a local tree, the whole changelog. So an answer is as fresh as
//! the changelog, even when the local store lags (after a crash, or a partition that moved to
//! another instance). [`ReadFrom::Local`] reads the local trees alone (no broker),
//! [`ReadFrom::Changelog`] the changelog alone.
//!
//! # Safety of writes
//! `state seed` and `reset` refuse while the application's consumer group has members: a
//! running instance owns its changelog partitions (it does not read what others write there,
//! and its local checkpoint would skip them), and a reset under a running instance would be
//! undone by its next commit.

pub(crate) mod cli;
mod reset;
mod seed;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kafka::admin::Admin;
use crate::processor::dedup::DedupEntry;
use crate::state::restore::changelog_topic;
use crate::state::{KeyValueStore, SledBackend, StateBackend, StateDirLock};
use crate::topology::{StageKind, Topology};
use base64::Engine as _;
use prost::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Where `state get` and `state dump` read a store partition from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub(crate) enum ReadFrom {
    /// The local tree when present, brought up to date from the changelog; else the
    /// changelog alone (the default).
    #[default]
    Auto,
    /// The local trees only, as they are on disk; no broker is asked.
    Local,
    /// The changelog only, read `read_committed` from its start to its end.
    Changelog,
}

/// A dedup store of the topology: its name and its settings that the tools report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoreInfo {
    /// Store name (the dedup stage's name).
    pub(crate) name: String,
    /// Its changelog topic.
    pub(crate) changelog: String,
    /// TTL in ms.
    pub(crate) ttl_ms: i64,
    /// Grace after the TTL before the sweep deletes an entry, in ms.
    pub(crate) grace_ms: i64,
}

/// One live dedup entry, as the tools found it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FoundEntry {
    /// Store partition (= source partition) holding it.
    pub(crate) partition: i32,
    /// The raw key.
    pub(crate) key: Vec<u8>,
    /// The decoded entry.
    pub(crate) entry: DedupEntry,
    /// Offset of the changelog record it was read from, `None` when read from the local tree.
    pub(crate) changelog_offset: Option<i64>,
}

/// Source offset of entries written by `state seed`: no source record created them.
pub(crate) const SEEDED_OFFSET: i64 = -1;

/// A key as text: `(text, "utf8")` when it is valid UTF-8, else `(base64, "base64")`.
/// Never lossy: the two encodings are told apart by the second field.
pub(crate) fn show_key(key: &[u8]) -> (String, &'static str) {
    match std::str::from_utf8(key) {
        Ok(s) => (s.to_string(), "utf8"),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(key),
            "base64",
        ),
    }
}

/// A time in ms since the epoch as RFC 3339 UTC with milliseconds; a time outside
/// 1970..=9999 (which RFC 3339 formatting cannot show) as `<ms> ms since the epoch`.
pub(crate) fn format_ms(ms: i64) -> String {
    const MAX: i64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    if !(0..=MAX).contains(&ms) {
        return format!("{ms} ms since the epoch");
    }
    let t = std::time::UNIX_EPOCH + Duration::from_millis(ms as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// The stream time past which the sweep may delete entry `e` of `store`: from its sweep
/// base (its time, or the later stream time when it was written: a late first occurrence)
/// + TTL + grace. One rule for `state get`'s text and JSON and the sweep itself.
pub(crate) fn swept_after_ms(e: &DedupEntry, store: &StoreInfo) -> i64 {
    e.sweep_base_ms()
        .saturating_add(store.ttl_ms)
        .saturating_add(store.grace_ms)
}

impl FoundEntry {
    /// The entry as one JSON object (the line format of `state dump` and `state get --json`).
    ///
    /// Fields: `store`, `partition`, `key`, `key_encoding` (`utf8` | `base64`),
    /// `first_seen_ms` / `first_seen`, `source_topic`, `source_partition`, `source_offset`
    /// (`seeded: true` and no source topic for entries written by `state seed`),
    /// `expires_at_ms` / `expires_at` (first seen + TTL: a record with a later time passes
    /// again), `swept_after` (stream time past which the sweep deletes it: + grace),
    /// `fingerprint` (hex or null), `changelog_offset` (null when read from the local tree).
    pub(crate) fn to_json(&self, store: &StoreInfo, source_topic: &str) -> serde_json::Value {
        let (key, enc) = show_key(&self.key);
        let e = &self.entry;
        let seeded = e.source_offset == SEEDED_OFFSET;
        let expires = e.first_seen_ms.saturating_add(store.ttl_ms);
        serde_json::json!({
            "store": store.name,
            "partition": self.partition,
            "key": key,
            "key_encoding": enc,
            "first_seen_ms": e.first_seen_ms,
            "first_seen": format_ms(e.first_seen_ms),
            "seeded": seeded,
            "source_topic": if seeded { None } else { Some(source_topic) },
            "source_partition": e.source_partition,
            "source_offset": e.source_offset,
            "expires_at_ms": expires,
            "expires_at": format_ms(expires),
            "swept_after": format_ms(swept_after_ms(e, store)),
            "fingerprint": e.fingerprint.map(|f| format!("{f:016x}")),
            "changelog_offset": self.changelog_offset,
        })
    }
}

/// A member of the application's consumer group, as DescribeGroups reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    /// Member id given by the coordinator.
    pub(crate) id: String,
    /// `client.id` of the member.
    pub(crate) client_id: String,
    /// Host it connects from.
    pub(crate) host: String,
}

/// What `onceflow reset` deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResetPlan {
    /// The consumer group (`application.id`).
    pub(crate) group: String,
    /// Its committed offsets per topic it reads: the source topic first, then each
    /// repartition topic that exists; (partition, offset) pairs, empty when none.
    pub(crate) committed: Vec<(String, Vec<(i32, i64)>)>,
    /// Internal topics that exist: changelogs, repartition topics.
    pub(crate) topics: Vec<String>,
    /// The local state directory, when it exists on this machine.
    pub(crate) local_state: Option<PathBuf>,
}

/// What `state seed` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SeedReport {
    /// The changelog written.
    pub(crate) topic: String,
    /// Partitions written to.
    pub(crate) partitions: Vec<i32>,
    /// Entries written (keys × partitions, minus those kept).
    pub(crate) written: u64,
    /// (key, partition) pairs left alone because an entry existed already.
    pub(crate) kept: u64,
}

/// How long a tool waits for a changelog read to reach its end, or for a broker that
/// answers a retriable error (a coordinator not ready yet).
const TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// Run `f` with the retries of every admin call ([`crate::kafka::retry`]), for at most
/// [`TOOL_TIMEOUT`].
fn with_retries<T>(what: &str, f: impl FnMut() -> Result<T>) -> Result<T> {
    crate::kafka::retry::retry_for(what, TOOL_TIMEOUT, f)
}

/// The state tools of one topology under one config.
pub(crate) struct StateTools {
    config: Config,
    topology: Topology,
}

/// The local state of this machine, opened for reading under the state dir's lock.
struct Local {
    _lock: StateDirLock,
    backend: SledBackend,
}

impl StateTools {
    /// Bind the tools to `topology` and `config` (the same files and `--set`s as `run`).
    pub(crate) fn new(config: Config, topology: Topology) -> StateTools {
        StateTools { config, topology }
    }

    /// The dedup store of stage `stage`, or the topology's only one when `None`.
    ///
    /// # Errors
    /// [`Error::Topology`] when no such dedup stage exists, or when `stage` is `None` and
    /// the topology has none or several.
    pub(crate) fn store(&self, stage: Option<&str>) -> Result<StoreInfo> {
        let dedups: Vec<_> = self
            .topology
            .stages()
            .iter()
            .filter_map(|s| match &s.kind {
                StageKind::Dedup(d) => Some((s.name.as_str(), d)),
                _ => None,
            })
            .collect();
        let names = || {
            dedups
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let found = match stage {
            Some(want) => {
                dedups
                    .iter()
                    .find(|(n, _)| *n == want)
                    .ok_or_else(|| Error::Topology {
                        node: want.to_string(),
                        reason: format!("no dedup stage of that name (dedup stages: {})", names()),
                    })?
            }
            None => match dedups.as_slice() {
                [one] => one,
                [] => {
                    return Err(Error::Topology {
                        node: self.topology.name().to_string(),
                        reason: "the topology has no dedup stage, so no state to inspect".into(),
                    })
                }
                _ => {
                    return Err(Error::Topology {
                        node: self.topology.name().to_string(),
                        reason: format!(
                            "several dedup stages ({}): choose one with --stage",
                            names()
                        ),
                    })
                }
            },
        };
        Ok(StoreInfo {
            name: found.0.to_string(),
            changelog: changelog_topic(&self.config.application_id, found.0),
            ttl_ms: found.1.ttl_ms,
            grace_ms: found.1.grace_ms,
        })
    }

    /// The topology's source topic (the topic the entries' source coordinates refer to).
    pub(crate) fn source_topic(&self) -> &str {
        &self.topology.source().topic
    }

    /// `<state.dir>/<application.id>`: the local sled database.
    pub(crate) fn local_dir(&self) -> PathBuf {
        self.config.state_dir.join(&self.config.application_id)
    }

    fn open_local(&self, from: ReadFrom) -> Result<Option<Local>> {
        if from == ReadFrom::Changelog {
            return Ok(None);
        }
        let dir = self.local_dir();
        if !dir.is_dir() {
            return match from {
                ReadFrom::Local => Err(Error::state(
                    dir.display().to_string(),
                    "no local state here (check state.dir and application.id); --from changelog reads the changelog",
                )),
                _ => Ok(None),
            };
        }
        let lock = match StateDirLock::acquire(&self.config.state_dir) {
            Ok(l) => l,
            Err(e) if from == ReadFrom::Auto => {
                tracing::warn!(error = %e, "local state is in use: reading the changelog only");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let backend = SledBackend::open(&dir)?;
        Ok(Some(Local {
            _lock: lock,
            backend,
        }))
    }

    fn changelog_partitions(&self, store: &StoreInfo) -> Result<usize> {
        let admin = Admin::new(&self.config)?;
        admin.partition_count(&store.changelog)?.ok_or_else(|| {
            Error::Broker(format!(
                "changelog topic {} of store {} does not exist on {} (has the application run, with this application.id?)",
                store.changelog, store.name, self.config.bootstrap_servers
            ))
        })
    }

    /// Visit every live entry of `store` (only those of `key`, when given), partition by
    /// partition, as [`ReadFrom`] says. Returns the partitions searched.
    ///
    /// # Errors
    /// The broker unreachable, the changelog missing or not reaching its end within 60 s
    /// (an open transaction that never ends), a local store that cannot be opened (locked
    /// by a running instance, under [`ReadFrom::Local`]), or a stored value that is not a
    /// dedup entry (named by store, partition and key).
    pub(crate) fn visit(
        &self,
        store: &StoreInfo,
        key: Option<&[u8]>,
        from: ReadFrom,
        f: &mut dyn FnMut(FoundEntry) -> Result<()>,
    ) -> Result<Vec<i32>> {
        let local = self.open_local(from)?;
        let local_parts = local
            .as_ref()
            .map(|l| l.backend.stored_partitions(&store.name))
            .unwrap_or_default();
        let partitions: Vec<i32> = if from == ReadFrom::Local {
            local_parts.clone()
        } else {
            (0..self.changelog_partitions(store)? as i32).collect()
        };
        let consumer = if from == ReadFrom::Local {
            None
        } else {
            Some(crate::kafka::consumer::create_restore_consumer(
                &self.config,
            )?)
        };
        for &p in &partitions {
            let tree = match &local {
                Some(l) if local_parts.contains(&p) => Some(l.backend.open(&store.name, p)?),
                _ => None,
            };
            // Changelog records after what the local tree holds (all of them without one).
            let mut tail: HashMap<Vec<u8>, (Option<Vec<u8>>, i64)> = HashMap::new();
            let mut base = tree;
            if let Some(c) = &consumer {
                let (_, end) = with_retries("changelog end offset", || {
                    c.fetch_watermarks(&store.changelog, p, Duration::from_secs(30))
                        .map_err(Error::kafka("changelog offsets"))
                })?;
                let checkpoint = match &base {
                    Some(t) => t.changelog_offset()?,
                    None => None,
                };
                let start = match checkpoint {
                    Some(cp) if cp <= end => Offset::Offset(cp),
                    // No checkpoint, or one beyond the end (the changelog was recreated):
                    // the local tree cannot be trusted; the changelog alone answers.
                    _ => {
                        base = None;
                        Offset::Beginning
                    }
                };
                read_changelog(c, &store.changelog, p, start, end, |k, v, off| {
                    if key.is_none_or(|want| want == k) {
                        tail.insert(k.to_vec(), (v.map(<[u8]>::to_vec), off));
                    }
                    Ok(())
                })?;
            }
            let decode = |k: &[u8], v: &[u8]| {
                DedupEntry::decode(v).map_err(|e| {
                    let (shown, enc) = show_key(k);
                    Error::state(
                        format!("{}/{p}", store.name),
                        format!("the value of key {shown:?} ({enc}) is not a dedup entry: {e}"),
                    )
                })
            };
            if let Some(t) = &base {
                match key {
                    Some(k) if !tail.contains_key(k) => {
                        if let Some(v) = t.get(k)? {
                            f(FoundEntry {
                                partition: p,
                                key: k.to_vec(),
                                entry: decode(k, &v)?,
                                changelog_offset: None,
                            })?;
                        }
                    }
                    Some(_) => {}
                    None => scan_tree(t.as_ref(), |k, v| {
                        if tail.contains_key(k) {
                            return Ok(());
                        }
                        f(FoundEntry {
                            partition: p,
                            key: k.to_vec(),
                            entry: decode(k, v)?,
                            changelog_offset: None,
                        })
                    })?,
                }
            }
            let mut tail: Vec<_> = tail.into_iter().collect();
            tail.sort_by_key(|(_, (_, off))| *off);
            for (k, (v, off)) in tail {
                if let Some(v) = v {
                    let entry = decode(&k, &v)?;
                    f(FoundEntry {
                        partition: p,
                        key: k,
                        entry,
                        changelog_offset: Some(off),
                    })?;
                }
            }
        }
        Ok(partitions)
    }

    /// The live entries of `key` in `store`, one per partition holding it (a key is on one
    /// partition when the source is partitioned by it, possibly on several otherwise).
    ///
    /// # Errors
    /// As [`StateTools::visit`].
    pub(crate) fn get(
        &self,
        store: &StoreInfo,
        key: &[u8],
        from: ReadFrom,
    ) -> Result<(Vec<FoundEntry>, Vec<i32>)> {
        let mut found = Vec::new();
        let searched = self.visit(store, Some(key), from, &mut |e| {
            found.push(e);
            Ok(())
        })?;
        Ok((found, searched))
    }
}

/// The wall clock in ms since the epoch.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Visit the committed data entries of a local tree in the engine's order, a page at a time.
fn scan_tree(
    tree: &dyn KeyValueStore,
    mut f: impl FnMut(&[u8], &[u8]) -> Result<()>,
) -> Result<()> {
    let mut after: Option<Vec<u8>> = None;
    loop {
        let page = tree.scan(after.as_deref(), 10_000)?;
        for (k, v) in &page {
            f(k, v)?;
        }
        if page.len() < 10_000 {
            return Ok(());
        }
        after = page.last().map(|(k, _)| k.clone());
    }
}

/// Read partition `p` of changelog `topic` from `start` up to `end` (exclusive), in log
/// order, with `consumer` (read_committed); `f` gets key, value (`None`: tombstone), offset.
/// Done when the consumer's position reaches `end` (transaction markers take offsets).
fn read_changelog(
    consumer: &BaseConsumer,
    topic: &str,
    p: i32,
    start: Offset,
    end: i64,
    mut f: impl FnMut(&[u8], Option<&[u8]>, i64) -> Result<()>,
) -> Result<()> {
    if let Offset::Offset(s) = start {
        if s >= end {
            return Ok(());
        }
    }
    if end <= 0 {
        return Ok(());
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, p, start)
        .map_err(Error::kafka("changelog partition list"))?;
    consumer
        .assign(&tpl)
        .map_err(Error::kafka("assign changelog"))?;
    let result = (|| {
        let mut deadline = Instant::now() + TOOL_TIMEOUT;
        let mut since_check = 0u32;
        loop {
            let check;
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    deadline = Instant::now() + TOOL_TIMEOUT;
                    let off = m.offset();
                    if off < end {
                        let Some(k) = m.key() else {
                            return Err(Error::Broker(format!(
                                "changelog {topic} partition {p} offset {off}: a record without a key (not written by onceflow?)"
                            )));
                        };
                        f(k, m.payload(), off)?;
                    }
                    if off + 1 >= end {
                        return Ok(());
                    }
                    since_check += 1;
                    check = since_check >= 10_000;
                }
                Some(Err(e)) => return Err(Error::kafka("read changelog")(e)),
                None => check = true,
            }
            if check {
                since_check = 0;
                let pos = consumer
                    .position()
                    .map_err(Error::kafka("changelog position"))?;
                if let Some(Offset::Offset(o)) = pos.find_partition(topic, p).map(|e| e.offset()) {
                    if o >= end {
                        return Ok(());
                    }
                }
                if Instant::now() > deadline {
                    return Err(Error::Broker(format!(
                        "changelog {topic} partition {p} did not reach offset {end} within {} s (an open transaction?)",
                        TOOL_TIMEOUT.as_secs()
                    )));
                }
            }
        }
    })();
    let _ = consumer.unassign();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_show_as_utf8_when_valid_else_base64_never_lossy() {
        assert_eq!(show_key(b"order-1"), ("order-1".to_string(), "utf8"));
        assert_eq!(show_key(b""), (String::new(), "utf8"));
        assert_eq!(show_key(b"\xff\x00a"), ("/wBh".to_string(), "base64"));
        // Invalid UTF-8 that a lossy decode would turn into U+FFFD stays distinct.
        assert_ne!(show_key(b"\xff"), show_key("\u{fffd}".as_bytes()));
    }

    #[test]
    fn times_format_as_rfc3339_utc_with_millis() {
        assert_eq!(format_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_ms(1_764_547_200_123), "2025-12-01T00:00:00.123Z");
        // Out of RFC 3339's range: shown as a number, never a panic.
        assert_eq!(format_ms(-1_000), "-1000 ms since the epoch");
        assert_eq!(
            format_ms(i64::MAX),
            format!("{} ms since the epoch", i64::MAX)
        );
        assert_eq!(format_ms(253_402_300_799_999), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn an_entry_as_json_names_its_source_and_expiry() {
        let store = StoreInfo {
            name: "dedup".into(),
            changelog: "app-dedup-changelog".into(),
            ttl_ms: 3_600_000,
            grace_ms: 60_000,
        };
        let found = FoundEntry {
            partition: 2,
            key: b"k".to_vec(),
            entry: DedupEntry {
                first_seen_ms: 0,
                source_partition: 2,
                source_offset: 7,
                fingerprint: Some(255),
                written_stream_ms: None,
                untimed: false,
            },
            changelog_offset: Some(3),
        };
        let v = found.to_json(&store, "events");
        assert_eq!(v["source_topic"], "events");
        assert_eq!(v["source_offset"], 7);
        assert_eq!(v["seeded"], false);
        assert_eq!(v["expires_at_ms"], 3_600_000);
        assert_eq!(v["swept_after"], "1970-01-01T01:01:00.000Z");
        assert_eq!(v["fingerprint"], "00000000000000ff");
        assert_eq!(v["changelog_offset"], 3);
        let seeded = FoundEntry {
            entry: DedupEntry {
                source_offset: SEEDED_OFFSET,
                ..found.entry.clone()
            },
            ..found
        };
        let v = seeded.to_json(&store, "events");
        assert_eq!(v["seeded"], true);
        assert!(v["source_topic"].is_null());
    }

    #[test]
    fn stored_partitions_lists_a_stores_trees_only() {
        let dir = tempfile::tempdir().unwrap();
        let b = SledBackend::open(dir.path()).unwrap();
        for (store, p) in [("dedup", 0), ("dedup", 2), ("dedup-x", 1), ("other", 5)] {
            b.open(store, p).unwrap();
        }
        assert_eq!(b.stored_partitions("dedup"), vec![0, 2]);
        assert_eq!(b.stored_partitions("dedup-x"), vec![1]);
        assert_eq!(b.stored_partitions("none"), Vec::<i32>::new());
    }
}
