//! Typed configuration, layered: built-in defaults (`config/onceflow.toml`), then config
//! files, then `ONCEFLOW__*` environment variables, then `--set key=value`.
//!
//! Keys are dotted (`commit.interval.ms`). Every key is settable from the environment as
//! `ONCEFLOW__` + the key uppercased with each dot as a double underscore
//! (`ONCEFLOW__COMMIT__INTERVAL__MS`, `ONCEFLOW__KAFKA__LINGER__MS`). Variables with a
//! single underscore after `ONCEFLOW` (`ONCEFLOW_LOG`, `ONCEFLOW_DEMO_STATE`, a script's own
//! `ONCEFLOW_EXAMPLE_INPUT`) are never config keys, so they cannot collide with one; the one
//! exception is `ONCEFLOW_BOOTSTRAP_SERVERS`, read as `bootstrap.servers` below
//! `ONCEFLOW__BOOTSTRAP__SERVERS` (every script and test of the project sets it). Unknown
//! keys are an error that names the key, where it was set and the nearest known key.
//! `kafka.<property>` passes a librdkafka property to both clients;
//! `kafka.consumer.<property>` / `kafka.producer.<property>` to one.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The built-in defaults, also shipped as `config/onceflow.toml`.
pub(crate) const DEFAULTS: &str = include_str!("../../config/onceflow.toml");

/// Prefix of environment variables that are config keys: `ONCEFLOW__A__B` is `a.b`.
pub(crate) const ENV_PREFIX: &str = "ONCEFLOW__";

/// The broker address variable every script and test sets; read as `bootstrap.servers`
/// (below `ONCEFLOW__BOOTSTRAP__SERVERS`).
pub(crate) const BOOTSTRAP_ENV: &str = "ONCEFLOW_BOOTSTRAP_SERVERS";

/// librdkafka's default `message.max.bytes`: the largest record a producer accepts.
pub(crate) const DEFAULT_MAX_RECORD_BYTES: usize = 1_000_000;

/// sled's page cache when `state.cache.bytes` is unset and the topology has no lookup
/// table: 16 MiB. Also the cache of a sink's sled idempotency store, whatever is set.
pub(crate) const STATE_CACHE_BYTES: u64 = 16 << 20;

/// sled's page cache when `state.cache.bytes` is unset and the topology has a lookup
/// table: 256 MiB.
pub(crate) const TABLES_CACHE_BYTES: u64 = 256 << 20;

/// The smallest `state.cache.bytes` (sled panics below 256 bytes; 1 MiB keeps a page).
const MIN_CACHE_BYTES: u64 = 1 << 20;

/// Keys that were renamed: (old, new).
const RENAMED: &[(&str, &str)] = &[("metrics.address", "http.address")];

/// Keys onceflow knows, besides `kafka.*`.
pub(crate) const KEYS: &[&str] = &[
    "bootstrap.servers",
    "application.id",
    "state.dir",
    "commit.interval.ms",
    "processing.guarantee",
    "dlq.topic",
    "http.address",
    "log.format",
    "instance.id",
    "state.stop.persist.ms",
    "state.cache.bytes",
];

/// `log.format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines (default); ANSI colours only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line, with the fields of its spans.
    Json,
}

/// `processing.guarantee`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guarantee {
    /// Outputs may repeat after a crash (the batch in flight), never get lost.
    AtLeastOnce,
    /// Outputs, changelog records and consumed offsets commit in one Kafka transaction
    /// (KIP-98, KIP-447): read_committed consumers see each output once.
    ExactlyOnceV2,
}

/// The typed configuration of one onceflow instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// `application.id`: the consumer group id and prefix of internal topics.
    pub application_id: String,
    /// `state.dir`: where the sled database lives.
    pub state_dir: PathBuf,
    /// `commit.interval.ms` (default 1000; 100 under exactly_once_v2).
    pub commit_interval_ms: u64,
    /// `instance.id` (default the host name): unique per instance of an application.
    pub instance_id: String,
    /// The consumer's `group.instance.id` (static membership, KIP-345):
    /// `<application.id>-<instance.id>` when `instance.id` is set explicitly; `None` (a
    /// dynamic member) when it defaulted to the host name, so that two processes on one
    /// host never fence each other. `kafka.consumer.group.instance.id` overrides it (empty:
    /// off).
    pub group_instance_id: Option<String>,
    /// `processing.guarantee` (default at_least_once).
    pub processing_guarantee: Guarantee,
    /// `dlq.topic` (default `<application.id>.dlq`).
    pub dlq_topic: String,
    /// `http.address` (default `127.0.0.1:9464`): the loopback listener of `/health`,
    /// `/ready` and `/metrics`; `None` when set to `off`. Port 0 picks a free port.
    pub http_address: Option<SocketAddr>,
    /// `log.format` (default text).
    pub log_format: LogFormat,
    /// `state.stop.persist.ms` (default 3000): how long a graceful stop waits for the
    /// state writer to persist the committed marks still in memory. What is not persisted
    /// by then is restored from the changelog at the next start (the stored changelog
    /// offset never runs ahead of the data), so a stop after a long backlog stays short;
    /// 0 waits for nothing.
    pub stop_persist_ms: u64,
    /// `state.cache.bytes`: sled's page cache, in bytes. `None` (unset, the default): 16 MiB,
    /// or 256 MiB when the topology has a lookup table.
    pub state_cache_bytes: Option<u64>,
    /// librdkafka properties for both clients (`kafka.*`, prefix removed).
    pub kafka: BTreeMap<String, String>,
    /// librdkafka properties for the consumer only (`kafka.consumer.*`).
    pub kafka_consumer: BTreeMap<String, String>,
    /// librdkafka properties for the producer only (`kafka.producer.*`).
    pub kafka_producer: BTreeMap<String, String>,
}

impl Config {
    /// Load the layers: defaults, `files` in order, the process environment, `sets`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key and its source for unknown keys, bad values, a
    /// missing or malformed file.
    pub fn load(files: &[PathBuf], sets: &[(String, String)]) -> Result<Config> {
        Self::load_with_env(files, sets, utf8_env(std::env::vars_os())?)
    }

    /// As [`Config::load`], with the environment given (for tests).
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn load_with_env(
        files: &[PathBuf],
        sets: &[(String, String)],
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config> {
        // Each layer is flattened to dotted keys, so `[kafka] "linger.ms" = 5`,
        // `kafka.linger.ms = 5` and ONCEFLOW_KAFKA_LINGER_MS all name one key.
        let mut flat: BTreeMap<String, (String, String)> = BTreeMap::new();
        let mut layer = |text: &str, origin: String| -> Result<()> {
            let table: toml::Table = text
                .parse()
                .map_err(|e| Error::Config(format!("{origin}: {e}")))?;
            let mut out = BTreeMap::new();
            flatten("", &toml::Value::Table(table), &mut out)
                .map_err(|e| Error::Config(format!("{origin}: {e}")))?;
            for (k, v) in out {
                flat.insert(k, (v, origin.clone()));
            }
            Ok(())
        };
        layer(DEFAULTS, "built-in defaults (config/onceflow.toml)".into())?;
        for f in files {
            let text = std::fs::read_to_string(f)
                .map_err(|e| Error::Config(format!("config file {}: {e}", f.display())))?;
            layer(&text, format!("config file {}", f.display()))?;
        }
        // Environment: ONCEFLOW__COMMIT__INTERVAL__MS -> commit.interval.ms. The broker
        // address alias first, so that the double-underscore form wins over it.
        let mut env: Vec<(String, String)> = env.into_iter().collect();
        env.sort_by_key(|(k, _)| k != BOOTSTRAP_ENV);
        for (k, v) in env {
            let key = if k == BOOTSTRAP_ENV {
                "bootstrap.servers".to_string()
            } else if let Some(rest) = k.strip_prefix(ENV_PREFIX) {
                rest.to_ascii_lowercase().replace("__", ".")
            } else {
                continue;
            };
            flat.insert(key, (v, format!("environment variable {k}")));
        }
        for (k, v) in sets {
            flat.insert(k.clone(), (v.clone(), format!("--set {k}={v}")));
        }
        let origins: BTreeMap<String, String> = flat
            .iter()
            .map(|(k, (_, o))| (k.clone(), o.clone()))
            .collect();
        let values: BTreeMap<String, String> = flat.into_iter().map(|(k, (v, _))| (k, v)).collect();
        let origin = |key: &str| {
            origins
                .get(key)
                .cloned()
                .unwrap_or_else(|| "nowhere".into())
        };
        Self::from_flat(&values, &origin)
    }

    fn from_flat(
        flat: &BTreeMap<String, String>,
        origin: &dyn Fn(&str) -> String,
    ) -> Result<Config> {
        let bad =
            |k: &str, why: String| Error::Config(format!("`{k}` (from {}): {why}", origin(k)));
        let mut kafka = BTreeMap::new();
        let mut kafka_consumer = BTreeMap::new();
        let mut kafka_producer = BTreeMap::new();
        for (k, v) in flat {
            let property = k
                .strip_prefix("kafka.consumer.")
                .map(|p| (p, &mut kafka_consumer))
                .or_else(|| {
                    k.strip_prefix("kafka.producer.")
                        .map(|p| (p, &mut kafka_producer))
                })
                .or_else(|| k.strip_prefix("kafka.").map(|p| (p, &mut kafka)));
            if let Some((p, into)) = property {
                check_kafka_property(p, v).map_err(|why| bad(k, why))?;
                if let Some(why) = managed_property(p, v) {
                    return Err(bad(k, why));
                }
                into.insert(p.to_string(), v.clone());
            } else if !KEYS.contains(&k.as_str()) {
                return Err(Error::Config(format!(
                    "unknown config key `{k}` (from {}){}; known keys: {}, kafka.<librdkafka property>",
                    origin(k),
                    did_you_mean(k),
                    KEYS.join(", ")
                )));
            }
        }
        let get = |k: &str| flat.get(k).cloned().unwrap_or_default();
        let application_id = get("application.id");
        if application_id.is_empty() {
            return Err(bad("application.id", "must not be empty".into()));
        }
        if let Err(r) = crate::names::check_topic_name(&application_id) {
            return Err(bad(
                "application.id",
                format!("it prefixes internal topic names: {r}"),
            ));
        }
        let processing_guarantee = match get("processing.guarantee").as_str() {
            "at_least_once" => Guarantee::AtLeastOnce,
            "exactly_once_v2" => Guarantee::ExactlyOnceV2,
            other => {
                return Err(bad(
                    "processing.guarantee",
                    format!("{other:?} is not one of at_least_once, exactly_once_v2"),
                ))
            }
        };
        let default_interval = match processing_guarantee {
            Guarantee::AtLeastOnce => "1000",
            Guarantee::ExactlyOnceV2 => "100",
        };
        // A number of milliseconds (`positive`: above 0) under key `k`, `default` when unset.
        let millis = |k: &str, default: &str, positive: bool| -> Result<u64> {
            let v = flat.get(k).map_or(default, String::as_str);
            v.parse()
                .ok()
                .filter(|n| !positive || *n > 0)
                .ok_or_else(|| {
                    let what = if positive { "a positive" } else { "a" };
                    bad(k, format!("{v:?} is not {what} number of milliseconds"))
                })
        };
        let commit_interval_ms = millis("commit.interval.ms", default_interval, true)?;
        let bootstrap_servers = get("bootstrap.servers");
        if bootstrap_servers.is_empty() {
            return Err(bad("bootstrap.servers", "must not be empty".into()));
        }
        let dlq_topic = match get("dlq.topic") {
            t if t.is_empty() => format!("{application_id}.dlq"),
            t => {
                crate::names::check_topic_name(&t).map_err(|r| bad("dlq.topic", r))?;
                t
            }
        };
        let http_address = match get("http.address") {
            a if a.is_empty() || a == "off" => None,
            // An IP address and port, or a host name resolved now (`localhost:9464`).
            a => Some(match a.parse::<SocketAddr>() {
                Ok(addr) => addr,
                Err(e) => std::net::ToSocketAddrs::to_socket_addrs(a.as_str())
                    .ok()
                    .and_then(|mut it| it.next())
                    .ok_or_else(|| {
                        bad(
                            "http.address",
                            format!("{a:?} is not host:port (or off): {e}"),
                        )
                    })?,
            }),
        };
        let log_format = match get("log.format").as_str() {
            "" | "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                return Err(bad(
                    "log.format",
                    format!("{other:?} is not one of text, json"),
                ))
            }
        };
        let stop_persist_ms = millis("state.stop.persist.ms", "", false)?;
        let state_cache_bytes = match get("state.cache.bytes") {
            v if v.is_empty() => None,
            v => Some(
                v.parse::<u64>()
                    .ok()
                    .filter(|n| *n >= MIN_CACHE_BYTES)
                    .ok_or_else(|| {
                        bad(
                            "state.cache.bytes",
                            format!("{v:?} is not a number of bytes of at least {MIN_CACHE_BYTES} (1 MiB)"),
                        )
                    })?,
            ),
        };
        let state_dir = get("state.dir");
        if state_dir.is_empty() {
            return Err(bad("state.dir", "must not be empty".into()));
        }
        let (instance_id, explicit) = match get("instance.id") {
            id if id.is_empty() => (host_name(), false),
            id => (id, true),
        };
        if let Err(r) = crate::names::check_topic_name(&format!("{application_id}-{instance_id}")) {
            return Err(bad(
                "instance.id",
                format!("it is part of the transactional.id: {r}"),
            ));
        }
        let group_instance_id = explicit.then(|| format!("{application_id}-{instance_id}"));
        Ok(Config {
            instance_id,
            group_instance_id,
            bootstrap_servers,
            application_id,
            state_dir: Path::new(&state_dir).to_path_buf(),
            commit_interval_ms,
            processing_guarantee,
            dlq_topic,
            http_address,
            log_format,
            stop_persist_ms,
            state_cache_bytes,
            kafka,
            kafka_consumer,
            kafka_producer,
        })
    }
}

/// The environment variables that can be config keys, as text. A variable that is not
/// UTF-8 is skipped unless its name makes it a config key (`ONCEFLOW__*`,
/// `ONCEFLOW_BOOTSTRAP_SERVERS`), which is an error: other programs' variables may hold any
/// bytes.
///
/// # Errors
/// [`Error::Config`] naming a config variable whose name or value is not UTF-8.
fn utf8_env(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (k, v) in vars {
        let name = k.to_string_lossy();
        let ours = name.starts_with(ENV_PREFIX) || name == BOOTSTRAP_ENV;
        match (k.to_str(), v.to_str()) {
            (Some(k), Some(v)) => out.push((k.to_string(), v.to_string())),
            _ if ours => {
                return Err(Error::Config(format!(
                    "environment variable {}: its {} is not UTF-8",
                    name.escape_debug(),
                    if k.to_str().is_none() {
                        "name"
                    } else {
                        "value"
                    }
                )))
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Whether librdkafka takes `value` for `property` on its own (its name, type and range):
/// checked when the config is read, so that a refusal names where the key was set. A
/// property meant for the other client kind, or one that conflicts with another, is still
/// refused when the client is created.
///
/// # Errors
/// librdkafka's reason, with the value.
fn check_kafka_property(property: &str, value: &str) -> std::result::Result<(), String> {
    let mut c = rdkafka::ClientConfig::new();
    c.set(property, value);
    match c.create_native_config() {
        Ok(_) => Ok(()),
        Err(rdkafka::error::KafkaError::ClientConfig(_, desc, _, _)) => {
            Err(format!("{value:?} was refused by librdkafka: {desc}"))
        }
        Err(e) => Err(format!("{value:?} was refused by librdkafka: {e}")),
    }
}

/// Why a librdkafka property onceflow's guarantees rest on cannot take `value`, or `None`
/// when it may (any other property, or the value onceflow needs). These are set by
/// onceflow itself; a `kafka.*` value would otherwise win over them.
fn managed_property(property: &str, value: &str) -> Option<String> {
    let v = value.trim().to_ascii_lowercase();
    let why = match property {
        "isolation.level" if v != "read_committed" => {
            "onceflow reads read_committed: records of aborted or still open transactions must never be processed (KIP-98)"
        }
        "enable.auto.commit" if v != "false" => {
            "onceflow commits offsets itself, only after the outputs and state they stand for (the commit protocol)"
        }
        "enable.partition.eof" => "set by onceflow (off: a partition-end event in a batch read moves the position past the end)",
        "group.id" => "the consumer group is `application.id`: set that",
        "bootstrap.servers" | "metadata.broker.list" => {
            "the brokers are `bootstrap.servers` (start-up's topic checks and the state tools use it too, so every client talks to one cluster): set that"
        }
        "transactional.id" => {
            "set by onceflow under exactly_once_v2 from `application.id` and `instance.id`: set those"
        }
        "enable.idempotence" if v != "true" => {
            "the producer must be idempotent: a retried send must not write an output twice"
        }
        "acks" | "request.required.acks" if v != "all" && v != "-1" => {
            "an output counts as delivered only once every in-sync replica has it (acks=all)"
        }
        _ => return None,
    };
    Some(format!("{value:?}: not allowed: {why}"))
}

/// `; did you mean `x`?` for the known key nearest to `key` (a renamed key's new name, or
/// one within a third of its length in edits), or nothing.
fn did_you_mean(key: &str) -> String {
    if let Some((_, new)) = RENAMED.iter().find(|(old, _)| *old == key) {
        return format!("; it was renamed: did you mean `{new}`?");
    }
    match crate::names::nearest(key, KEYS.iter().copied()) {
        Some(k) => format!("; did you mean `{k}`?"),
        None => String::new(),
    }
}

/// Flatten a TOML table to dotted keys. A list is joined with commas, and is allowed only
/// where the value is a comma-separated list: `bootstrap.servers` and `kafka.*` properties
/// (librdkafka's lists, e.g. `partition.assignment.strategy`), of scalars only.
///
/// # Errors
/// A list under another key, or a list holding a list or a table, naming the key.
fn flatten(
    prefix: &str,
    v: &toml::Value,
    out: &mut BTreeMap<String, String>,
) -> std::result::Result<(), String> {
    let scalar = |x: &toml::Value| match x {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let text = match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out)?;
            }
            return Ok(());
        }
        toml::Value::Array(a) => {
            if prefix != "bootstrap.servers" && !prefix.starts_with("kafka.") {
                return Err(format!(
                    "`{prefix}` takes one value, not a list (lists are for bootstrap.servers and kafka.* properties)"
                ));
            }
            if let Some(x) = a.iter().find(|x| x.is_array() || x.is_table()) {
                return Err(format!(
                    "`{prefix}`: a list of plain values was expected, it holds {}",
                    x.type_str()
                ));
            }
            a.iter().map(scalar).collect::<Vec<_>>().join(",")
        }
        other => scalar(other),
    };
    out.insert(prefix.to_string(), text);
    Ok(())
}

/// The host name, or `onceflow` if it cannot be read.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    match (rc, std::str::from_utf8(&buf[..end])) {
        (0, Ok(h)) if !h.is_empty() => h
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect(),
        _ => "onceflow".into(),
    }
}

impl Config {
    /// The largest record the producer accepts, in bytes: `kafka.producer.message.max.bytes`,
    /// else `kafka.message.max.bytes`, else librdkafka's default 1,000,000. A stage that would
    /// write a larger record dead-letters its source record instead.
    pub(crate) fn max_record_bytes(&self) -> usize {
        self.kafka_producer
            .get("message.max.bytes")
            .or_else(|| self.kafka.get("message.max.bytes"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_MAX_RECORD_BYTES)
    }

    /// sled's page cache in bytes: `state.cache.bytes` when set; else 16 MiB, or 256 MiB
    /// when the topology has a lookup table. A state store answers the keys of its last
    /// 262,144 entries per partition from memory, so sled's cache mostly holds pages it
    /// has written; a lookup table reads sled on every lookup its own row cache misses.
    pub(crate) fn sled_cache_bytes(&self, has_tables: bool) -> u64 {
        self.state_cache_bytes.unwrap_or(if has_tables {
            TABLES_CACHE_BYTES
        } else {
            STATE_CACHE_BYTES
        })
    }

    /// Whether `processing.guarantee` is exactly_once_v2.
    pub(crate) fn exactly_once(&self) -> bool {
        self.processing_guarantee == Guarantee::ExactlyOnceV2
    }

    /// The producer's `transactional.id`: `<application.id>-<instance.id>`.
    pub(crate) fn transactional_id(&self) -> String {
        format!("{}-{}", self.application_id, self.instance_id)
    }
}

/// Parse `key=value` (the `--set` argument).
///
/// # Errors
/// [`Error::Config`] when there is no `=`.
pub(crate) fn parse_set(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(Error::Config(format!("--set {s:?}: expected key=value"))),
    }
}

/// For unit tests: the configuration of `--set` pairs alone (no files, no environment).
#[cfg(test)]
impl Config {
    pub(crate) fn from_sets(sets: &[(&str, &str)]) -> Config {
        let sets: Vec<(String, String)> = sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::load_with_env(&[], &sets, std::iter::empty()).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn defaults_load() {
        let c = Config::load_with_env(&[], &[], env(&[])).unwrap();
        assert_eq!(c.bootstrap_servers, "127.0.0.1:9092");
        assert_eq!(c.application_id, "onceflow");
        assert_eq!(c.dlq_topic, "onceflow.dlq");
        assert_eq!(c.commit_interval_ms, 1000);
        let eos = Config::load_with_env(
            &[],
            &[("processing.guarantee".into(), "exactly_once_v2".into())],
            env(&[]),
        )
        .unwrap();
        assert_eq!(
            eos.commit_interval_ms, 100,
            "exactly_once_v2 commits every 100 ms by default"
        );
        let eos = Config::load_with_env(
            &[],
            &[
                ("processing.guarantee".into(), "exactly_once_v2".into()),
                ("commit.interval.ms".into(), "250".into()),
                ("instance.id".into(), "a1".into()),
            ],
            env(&[]),
        )
        .unwrap();
        assert_eq!(eos.commit_interval_ms, 250);
        assert_eq!(eos.transactional_id(), "onceflow-a1");
        assert_eq!(
            c.kafka_consumer
                .get("fetch.queue.backoff.ms")
                .map(String::as_str),
            Some("20")
        );
    }

    #[test]
    fn state_cache_bytes() {
        const MIB: u64 = 1024 * 1024;
        let c = Config::load_with_env(&[], &[], env(&[])).unwrap();
        assert_eq!(c.state_cache_bytes, None);
        assert_eq!(c.sled_cache_bytes(false), 16 * MIB);
        assert_eq!(
            c.sled_cache_bytes(true),
            256 * MIB,
            "lookup tables read sled"
        );
        let set = |v: &str| {
            Config::load_with_env(&[], &[("state.cache.bytes".into(), v.into())], env(&[]))
        };
        let c = set("1048576").unwrap();
        assert_eq!(c.sled_cache_bytes(false), MIB);
        assert_eq!(c.sled_cache_bytes(true), MIB, "a set value wins");
        for bad in ["0", "1", "1048575", "-1", "16MiB"] {
            let err = set(bad).unwrap_err().to_string();
            assert!(
                err.contains("state.cache.bytes") && err.contains(bad),
                "{bad}: {err}"
            );
        }
    }

    /// A variable that is not UTF-8 is skipped, unless it is a config variable: then it is
    /// an error naming it (it panicked in `std::env::vars`; found by a review helper).
    #[test]
    fn variables_that_are_not_utf8() {
        use std::os::unix::ffi::OsStringExt;
        let os = |s: &[u8]| std::ffi::OsString::from_vec(s.to_vec());
        let got = utf8_env([
            (os(b"OTHER"), os(b"caf\xe9")),
            (os(b"ONCEFLOW__DLQ__TOPIC"), os(b"dead")),
        ])
        .unwrap();
        assert_eq!(
            got,
            [("ONCEFLOW__DLQ__TOPIC".to_string(), "dead".to_string())]
        );
        let e = utf8_env([(os(b"ONCEFLOW__DLQ__TOPIC"), os(b"caf\xe9"))])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("environment variable ONCEFLOW__DLQ__TOPIC: its value is not UTF-8"),
            "{e}"
        );
        let e = utf8_env([(os(b"ONCEFLOW__A\xff"), os(b"x"))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("its name is not UTF-8"), "{e}");
    }

    /// A `kafka.*` value that would undo what the guarantees rest on (read_committed, no
    /// auto commit, onceflow's group and transactional.id, an idempotent producer with
    /// acks=all, the end-of-partition events `--stop-at-end` needs) stops start-up; the value
    /// onceflow sets itself passes.
    #[test]
    fn a_kafka_value_that_undoes_a_guarantee_is_refused() {
        for (k, v) in [
            ("kafka.consumer.isolation.level", "read_uncommitted"),
            ("kafka.isolation.level", "READ_UNCOMMITTED"),
            ("kafka.consumer.enable.auto.commit", "true"),
            ("kafka.consumer.enable.partition.eof", "false"),
            ("kafka.consumer.group.id", "other"),
            ("kafka.bootstrap.servers", "127.0.0.1:1"),
            ("kafka.producer.metadata.broker.list", "127.0.0.1:1"),
            ("kafka.producer.transactional.id", "mine"),
            ("kafka.producer.enable.idempotence", "false"),
            ("kafka.producer.acks", "1"),
            ("kafka.request.required.acks", "0"),
        ] {
            let e = Config::load_with_env(&[], &[(k.into(), v.into())], env(&[]))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("`{k}`")) && e.contains("not allowed"),
                "{k}: {e}"
            );
        }
        for (k, v) in [
            ("kafka.consumer.isolation.level", "read_committed"),
            ("kafka.enable.auto.commit", "false"),
            ("kafka.producer.acks", "all"),
            ("kafka.producer.enable.idempotence", "true"),
        ] {
            Config::load_with_env(&[], &[(k.into(), v.into())], env(&[]))
                .unwrap_or_else(|e| panic!("{k}={v}: {e}"));
        }
    }

    /// A refused `kafka.*` value is a config error naming the key, the value and where it
    /// was set (file, environment or --set), before any client is made; a property for the
    /// other client kind passes here (librdkafka takes it on its own).
    #[test]
    fn a_refused_kafka_value_names_where_it_was_set() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.toml");
        std::fs::write(&f, "[kafka]\n\"linger.ms\" = \"soon\"\n").unwrap();
        let e = Config::load_with_env(std::slice::from_ref(&f), &[], env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`kafka.linger.ms`"), "{e}");
        assert!(e.contains(&format!("config file {}", f.display())), "{e}");
        assert!(e.contains("\"soon\" was refused by librdkafka"), "{e}");
        let e = Config::load_with_env(
            &[],
            &[],
            env(&[("ONCEFLOW__KAFKA__CONSUMER__FETCH__MAX__BYTES", "-5")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`kafka.consumer.fetch.max.bytes`"), "{e}");
        assert!(
            e.contains("environment variable ONCEFLOW__KAFKA__CONSUMER__FETCH__MAX__BYTES"),
            "{e}"
        );
        let e = Config::load_with_env(
            &[],
            &[("kafka.producer.no.such.property".into(), "1".into())],
            env(&[]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--set kafka.producer.no.such.property=1"), "{e}");
        let c = Config::load_with_env(
            &[],
            &[("kafka.consumer.linger.ms".into(), "5".into())],
            env(&[]),
        )
        .unwrap();
        assert_eq!(
            c.kafka_consumer.get("linger.ms").map(String::as_str),
            Some("5")
        );
    }

    /// A TOML list is a comma-separated value only where one is meant (bootstrap.servers,
    /// kafka.*); elsewhere it is an error naming the key and the file.
    #[test]
    fn lists_only_where_a_list_is_meant() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.toml");
        let load = |text: &str| {
            std::fs::write(&f, text).unwrap();
            Config::load_with_env(std::slice::from_ref(&f), &[], env(&[]))
        };
        let e = load("commit.interval.ms = [1000]\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`commit.interval.ms` takes one value, not a list"),
            "{e}"
        );
        assert!(e.contains(&format!("config file {}", f.display())), "{e}");
        let e = load("[kafka]\n\"client.rack\" = [[\"a\"]]\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`kafka.client.rack`: a list of plain values"),
            "{e}"
        );
        let c = load(
            "bootstrap.servers = [\"h1:9092\", \"h2:9092\"]\n[kafka]\n\"partition.assignment.strategy\" = [\"range\", \"roundrobin\"]\n",
        )
        .unwrap();
        assert_eq!(c.bootstrap_servers, "h1:9092,h2:9092");
        assert_eq!(
            c.kafka
                .get("partition.assignment.strategy")
                .map(String::as_str),
            Some("range,roundrobin")
        );
    }

    #[test]
    fn layers_file_then_env_then_set() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.toml");
        std::fs::write(
            &f,
            "application.id = \"from-file\"\ncommit.interval.ms = 50\n[kafka]\n\"linger.ms\" = 7\n",
        )
        .unwrap();
        let c = Config::load_with_env(std::slice::from_ref(&f), &[], env(&[])).unwrap();
        assert_eq!(c.application_id, "from-file");
        assert_eq!(c.commit_interval_ms, 50);
        assert_eq!(c.kafka.get("linger.ms").map(String::as_str), Some("7"));
        let c = Config::load_with_env(
            std::slice::from_ref(&f),
            &[],
            env(&[
                ("ONCEFLOW__APPLICATION__ID", "from-env"),
                ("ONCEFLOW_BROKER_PORT", "1"),
            ]),
        )
        .unwrap();
        assert_eq!(c.application_id, "from-env");
        let c = Config::load_with_env(
            &[f],
            &[("application.id".into(), "from-set".into())],
            env(&[
                ("ONCEFLOW__APPLICATION__ID", "from-env"),
                ("ONCEFLOW__KAFKA__LINGER__MS", "9"),
            ]),
        )
        .unwrap();
        assert_eq!(c.application_id, "from-set");
        assert_eq!(c.kafka.get("linger.ms").map(String::as_str), Some("9"));
    }

    /// The collisions: a script's own `ONCEFLOW_*` variables (the demo's
    /// `ONCEFLOW_DEMO_STATE`, the examples' `ONCEFLOW_EXAMPLE_*`) are not config keys.
    #[test]
    fn single_underscore_variables_are_not_config_keys() {
        let c = Config::load_with_env(
            &[],
            &[],
            env(&[
                ("ONCEFLOW_DEMO_STATE", "target/x"),
                ("ONCEFLOW_EXAMPLE_INPUT", "in"),
                ("ONCEFLOW_LOG", "debug"),
                ("ONCEFLOW_BOOTSTRAP_SERVERS", "alias:1"),
                ("ONCEFLOW__HTTP__ADDRESS", "off"),
                ("ONCEFLOW__LOG__FORMAT", "json"),
            ]),
        )
        .unwrap();
        assert_eq!(c.bootstrap_servers, "alias:1");
        assert_eq!(c.http_address, None);
        assert_eq!(c.log_format, LogFormat::Json);
        let c = Config::load_with_env(
            &[],
            &[],
            env(&[
                ("ONCEFLOW__BOOTSTRAP__SERVERS", "nested:1"),
                ("ONCEFLOW_BOOTSTRAP_SERVERS", "alias:1"),
            ]),
        )
        .unwrap();
        assert_eq!(c.bootstrap_servers, "nested:1", "the nested form wins");
        let d = Config::load_with_env(&[], &[], env(&[])).unwrap();
        assert_eq!(d.http_address, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(d.log_format, LogFormat::Text);
        // A host name is a host (review 10: `localhost:9464` was refused).
        let h = Config::load_with_env(
            &[],
            &[("http.address".into(), "localhost:9464".into())],
            env(&[]),
        )
        .unwrap();
        assert!(h
            .http_address
            .is_some_and(|a| a.ip().is_loopback() && a.port() == 9464));
    }

    #[test]
    fn unknown_keys_are_errors_naming_their_source() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.toml");
        std::fs::write(&f, "bootstrap.server = \"x\"\n").unwrap();
        let e = Config::load_with_env(std::slice::from_ref(&f), &[], env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown config key `bootstrap.server`"), "{e}");
        assert!(e.contains("bad.toml"), "{e}");
        assert!(e.contains("did you mean `bootstrap.servers`?"), "{e}");
        let e = Config::load_with_env(&[], &[], env(&[("ONCEFLOW__STATEDIR", "x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ONCEFLOW__STATEDIR"), "{e}");
        let e = Config::load_with_env(&[], &[], env(&[("ONCEFLOW__STATE__DIRR", "x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `state.dir`?"), "{e}");
        let e = Config::load_with_env(&[], &[("metrics.address".into(), "x".into())], env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("renamed: did you mean `http.address`?"), "{e}");
        let e = Config::load_with_env(&[], &[("nope".into(), "1".into())], env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown config key `nope`"), "{e}");
    }

    #[test]
    fn bad_values_are_errors() {
        let set = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        for (k, v, want) in [
            ("commit.interval.ms", "0", "positive"),
            ("commit.interval.ms", "soon", "positive"),
            ("processing.guarantee", "maybe", "not one of"),
            ("application.id", "a b", "internal topic"),
            ("http.address", "nowhere", "host:port"),
            ("log.format", "xml", "not one of"),
        ] {
            let e = Config::load_with_env(&[], &set(k, v), env(&[]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(k) && e.contains(want), "{k}={v}: {e}");
        }
        assert!(Config::load_with_env(&[PathBuf::from("/no/such.toml")], &[], env(&[])).is_err());
    }
}
