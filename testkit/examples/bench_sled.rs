//! sled's apply rate alone, for the shapes onceflow could give its dedup marks (issue 12:
//! "if sled's write rate is the bound, change how onceflow uses sled").
//!
//! Writes `N` marks (default 750,000: the keys of the 1,000,000-event `scripts/bench` run)
//! into 4 trees (one per partition) in batches of `N / 20` per tree (one commit's worth),
//! one `apply_batch` per batch, and reports marks written per second for:
//! - `store`: onceflow's sled store itself (`SledBackend`, entries packed into segments of
//!   64 with an index in memory), through `KeyValueStore::write_ops` as the state writer
//!   calls it (`onceflow::__testkit::time_store_writes`);
//! - `per-key`: one sled key per mark (`b'd' ++ id` → a ~24-byte entry, random ids), what
//!   onceflow wrote before segments, in sled's `LowSpace` mode with a 256 MiB cache;
//! - `high-throughput`: the same in sled's `HighThroughput` mode;
//! - `run-prefixed`: keys prefixed by their batch's sequence number, so each batch lands
//!   in one key range (sled leaves hold at most 16 entries; random keys touch a new leaf
//!   almost every insert);
//! - `packed-64`: 64 sorted marks per sled value (one insert per 64 marks), sled alone.
//!
//! Ratios are against `per-key`.
//!
//! ```text
//! cargo run --release -p onceflow-testkit --example bench_sled
//! ONCEFLOW_BENCH_KEYS=200000 cargo run --release -p onceflow-testkit --example bench_sled
//! ```

use std::time::Instant;

const TREES: usize = 4;

#[derive(Clone, Copy)]
enum Shape {
    Onceflow,
    RunPrefixed,
    Packed(usize),
}

fn id(i: u64) -> Vec<u8> {
    // Ids as the bench's events carry them: a hash-spread decimal string.
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes())).into_bytes()
}

/// `keys` marks through onceflow's own sled store (see the module doc), in the same
/// batches as [`run`].
fn run_store(keys: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let per_tree = keys / TREES;
    let batch = (per_tree / 20).max(1);
    let value = bytes::Bytes::from_static(&[7u8; 24]);
    let mut next = 0u64;
    // Batches of every tree in turn, their ops made as they are written.
    let batches = (0..per_tree).step_by(batch).flat_map(|written| {
        let n = batch.min(per_tree - written);
        (0..TREES as i32).map(move |t| (t, n))
    });
    let batches = batches.map(|(t, n)| {
        let ops: Vec<(bytes::Bytes, Option<bytes::Bytes>)> = (0..n)
            .map(|_| {
                next += 1;
                (bytes::Bytes::from(id(next)), Some(value.clone()))
            })
            .collect();
        (t, ops)
    });
    let secs =
        onceflow::__testkit::time_store_writes(dir.path(), "dedup", TREES as i32, batches).unwrap();
    report("store", per_tree * TREES, secs)
}

/// Print and return the rate of `marks` written in `secs` seconds.
fn report(name: &str, marks: usize, secs: f64) -> f64 {
    let rate = marks as f64 / secs;
    println!("{name:<16} marks={marks} seconds={secs:.3} marks_per_second={rate:.0}");
    rate
}

fn run(name: &str, keys: usize, mode: sled::Mode, shape: Shape) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let db = sled::Config::new()
        .path(dir.path())
        .cache_capacity(256 * 1024 * 1024)
        .mode(mode)
        .flush_every_ms(Some(1000))
        .open()
        .unwrap();
    let trees: Vec<sled::Tree> = (0..TREES)
        .map(|t| db.open_tree(format!("dedup/{t}")).unwrap())
        .collect();
    let per_tree = keys / TREES;
    let batch = (per_tree / 20).max(1);
    let value = [7u8; 24];
    let started = Instant::now();
    let mut next = 0u64;
    let mut seq = 0u64;
    let mut written = 0usize;
    while written < per_tree {
        let n = batch.min(per_tree - written);
        for tree in &trees {
            let mut b = sled::Batch::default();
            let mut ids: Vec<Vec<u8>> = (0..n)
                .map(|_| {
                    next += 1;
                    id(next)
                })
                .collect();
            match shape {
                Shape::Onceflow => {
                    for k in ids {
                        let mut key = Vec::with_capacity(k.len() + 1);
                        key.push(b'd');
                        key.extend_from_slice(&k);
                        b.insert(key, &value[..]);
                    }
                }
                Shape::RunPrefixed => {
                    for k in ids {
                        let mut key = Vec::with_capacity(k.len() + 9);
                        key.push(b'd');
                        key.extend_from_slice(&seq.to_be_bytes());
                        key.extend_from_slice(&k);
                        b.insert(key, &value[..]);
                    }
                }
                Shape::Packed(per) => {
                    ids.sort();
                    for (c, chunk) in ids.chunks(per).enumerate() {
                        let mut key = Vec::with_capacity(17);
                        key.push(b'p');
                        key.extend_from_slice(&seq.to_be_bytes());
                        key.extend_from_slice(&(c as u64).to_be_bytes());
                        let mut v = Vec::with_capacity(chunk.len() * 42);
                        for k in chunk {
                            v.push(k.len() as u8);
                            v.extend_from_slice(k);
                            v.extend_from_slice(&value);
                        }
                        b.insert(key, v);
                    }
                }
            }
            b.insert(&b"m:changelog"[..], &seq.to_be_bytes()[..]);
            tree.apply_batch(b).unwrap();
            seq += 1;
        }
        written += n;
    }
    db.flush().unwrap();
    report(name, per_tree * TREES, started.elapsed().as_secs_f64())
}

fn main() {
    let keys: usize = std::env::var("ONCEFLOW_BENCH_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(750_000);
    let store = run_store(keys);
    let base = run("per-key", keys, sled::Mode::LowSpace, Shape::Onceflow);
    let ht = run(
        "high-throughput",
        keys,
        sled::Mode::HighThroughput,
        Shape::Onceflow,
    );
    let rp = run(
        "run-prefixed",
        keys,
        sled::Mode::LowSpace,
        Shape::RunPrefixed,
    );
    let pk = run("packed-64", keys, sled::Mode::LowSpace, Shape::Packed(64));
    println!(
        "bench-sled: keys={keys} store={store:.0} ({:.2}x) per_key={base:.0} high_throughput={ht:.0} ({:.2}x) run_prefixed={rp:.0} ({:.2}x) packed_64={pk:.0} ({:.2}x)",
        store / base,
        ht / base,
        rp / base,
        pk / base
    );
}
