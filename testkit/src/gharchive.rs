//! The real input of the main job: two hours of GH Archive events
//! (`examples/data/gharchive/`, see its README for provenance), published with the
//! duplicates that real delivery faults make.

use crate::kafka::TestProducer;
use onceflow::{Error, Result};
use rand::{Rng, SeedableRng};
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// One GH Archive event as published: key `/actor/id`, timestamp from `created_at`.
#[derive(Debug, Clone)]
pub struct Event {
    /// `/id`, the dedup key.
    pub id: String,
    /// `/actor/id` as decimal text, the Kafka key.
    pub actor: String,
    /// `created_at` in ms since the epoch.
    pub timestamp_ms: i64,
    /// The JSON line as read.
    pub line: Vec<u8>,
}

/// The data directory shipped in the repo.
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/gharchive")
}

/// The hourly files, in hour order.
pub fn hour_files() -> Vec<PathBuf> {
    vec![
        data_dir().join("2015-01-01-0.json.gz"),
        data_dir().join("2015-01-01-1.json.gz"),
    ]
}

/// Read one gzipped JSON-lines hour.
///
/// # Errors
/// [`Error::Io`] for an unreadable file; [`Error::Broker`]-free: a line that is not an
/// event (no `id`, `actor.id` or `created_at`) is an error naming the file and line.
pub fn read_hour(path: &Path) -> Result<Vec<Event>> {
    let io = |e: std::io::Error| Error::Io {
        path: path.display().to_string(),
        source: e,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let r = std::io::BufReader::new(flate2::read::GzDecoder::new(f));
    let mut out = Vec::new();
    for (i, line) in r.lines().enumerate() {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| Error::Io {
            path: format!("{}:{}", path.display(), i + 1),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string()),
        };
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| bad(&e.to_string()))?;
        let id = v["id"]
            .as_str()
            .ok_or_else(|| bad("no string /id"))?
            .to_string();
        let actor = match &v["actor"]["id"] {
            serde_json::Value::Number(n) => n.to_string(),
            serde_json::Value::String(s) => s.clone(),
            _ => return Err(bad("no /actor/id")),
        };
        let created = v["created_at"]
            .as_str()
            .ok_or_else(|| bad("no /created_at"))?;
        let t = humantime::parse_rfc3339(created).map_err(|e| bad(&e.to_string()))?;
        let timestamp_ms = t
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|e| bad(&e.to_string()))?
            .as_millis() as i64;
        out.push(Event {
            id,
            actor,
            timestamp_ms,
            line: line.into_bytes(),
        });
    }
    Ok(out)
}

/// What a load published.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Distinct events in the data.
    pub distinct: usize,
    /// Records published in all.
    pub published: usize,
    /// Of those, re-published tails (relay crash before marking sent).
    pub relay_repeats: usize,
    /// Of those, immediate repeats (producer retry without idempotence).
    pub retry_repeats: usize,
}

/// Publish every hour to `topic` keyed by `/actor/id` with `created_at` as timestamp, with
/// delivery faults: a seeded 5% of events are sent twice in a row, and after each hour its
/// last `tail` events are published again.
///
/// # Errors
/// Reading the data or producing failed.
pub fn publish(producer: &TestProducer, topic: &str, tail: usize, seed: u64) -> Result<LoadReport> {
    publish_with(producer, topic, tail, seed, false)
}

/// As [`publish`], but every record (each copy too) gets a random Kafka key (seeded), so
/// the copies of an event land on different partitions, as when producers key by session
/// or not at all: a dedup by `/id` needs `partitioning: repartition`.
///
/// # Errors
/// As [`publish`].
pub fn publish_random_keys(
    producer: &TestProducer,
    topic: &str,
    tail: usize,
    seed: u64,
) -> Result<LoadReport> {
    publish_with(producer, topic, tail, seed, true)
}

fn publish_with(
    producer: &TestProducer,
    topic: &str,
    tail: usize,
    seed: u64,
    random_keys: bool,
) -> Result<LoadReport> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut keys = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut rep = LoadReport::default();
    for f in hour_files() {
        let events = read_hour(&f)?;
        rep.distinct += events.len();
        let mut send = |e: &Event| {
            let random = format!("k{}", keys.random::<u64>());
            let key = if random_keys {
                random.as_bytes()
            } else {
                e.actor.as_bytes()
            };
            producer.send(
                topic,
                None,
                Some(key),
                Some(&e.line),
                &[],
                Some(e.timestamp_ms),
            )
        };
        for e in &events {
            send(e)?;
            rep.published += 1;
            if rng.random_bool(0.05) {
                send(e)?;
                rep.published += 1;
                rep.retry_repeats += 1;
            }
        }
        for e in &events[events.len().saturating_sub(tail)..] {
            send(e)?;
            rep.published += 1;
            rep.relay_repeats += 1;
        }
    }
    producer.flush()?;
    Ok(rep)
}
