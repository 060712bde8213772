//! The `onceflow state` and `onceflow reset` commands: argument parsing (clap) and output.
//! `src/main.rs` only mounts them.
//!
//! Exit codes: 0 done (`state get`: the key is seen), 1 `state get`: the key is not seen,
//! 2 an error or a refusal (bad arguments, active group members, broker unreachable).

use super::{format_ms, show_key, FoundEntry, ReadFrom, StateTools, StoreInfo, SEEDED_OFFSET};
use crate::config::{parse_set, Config};
use crate::error::{Error, Result};
use base64::Engine as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The topology and config arguments every tool takes, as `onceflow run` does.
#[derive(Debug, clap::Args)]
pub(crate) struct Target {
    /// The topology file (YAML, or TOML when named *.toml).
    pub(crate) topology: PathBuf,
    /// A config file (TOML); may be given several times, later files win.
    #[arg(long = "config", value_name = "FILE")]
    pub(crate) configs: Vec<PathBuf>,
    /// Set one config key, e.g. --set application.id=orders; wins over files and environment.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(crate) sets: Vec<String>,
}

/// `onceflow state ...`.
#[derive(Debug, clap::Args)]
pub(crate) struct StateArgs {
    /// What to do.
    #[command(subcommand)]
    pub(crate) command: StateCommand,
}

/// The `state` subcommands.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum StateCommand {
    /// Is this key seen? First-seen time, the source record that created it, when it
    /// expires, and which partition holds it. Exit 0 when seen, 1 when not.
    Get {
        #[command(flatten)]
        target: Target,
        /// The dedup key, as text (its UTF-8 bytes), or base64 with --key-base64.
        key: String,
        /// The key is base64 (for keys that are not UTF-8, e.g. composite keys).
        #[arg(long)]
        key_base64: bool,
        /// The dedup stage (store); needed when the topology has several.
        #[arg(long, value_name = "NAME")]
        stage: Option<String>,
        /// Where to read: auto (local store brought up to date from the changelog, else the
        /// changelog), local (no broker), changelog.
        #[arg(long, value_enum, default_value_t = ReadFrom::Auto)]
        from: ReadFrom,
        /// Print JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print every entry the store holds (expired ones until the sweep deletes them) as a JSON line (keys as UTF-8 when valid, else base64, with
    /// `key_encoding` saying which).
    Dump {
        #[command(flatten)]
        target: Target,
        /// The dedup stage (store); needed when the topology has several.
        #[arg(long, value_name = "NAME")]
        stage: Option<String>,
        /// Where to read: auto, local or changelog (as for `state get`).
        #[arg(long, value_enum, default_value_t = ReadFrom::Auto)]
        from: ReadFrom,
    },
    /// Bulk-load known keys (one per line) as seen, through the changelog, so that every
    /// instance restores them. Refused while the application's group has active members.
    Seed {
        #[command(flatten)]
        target: Target,
        /// File of keys, one per line (`-` for stdin); empty lines are skipped.
        file: PathBuf,
        /// Each line is base64 (for keys that are not UTF-8).
        #[arg(long)]
        base64: bool,
        /// The dedup stage (store); needed when the topology has several.
        #[arg(long, value_name = "NAME")]
        stage: Option<String>,
        /// First-seen time of the entries: RFC 3339 (2026-12-01T00:00:00Z) or ms since the
        /// epoch; default now.
        #[arg(long, value_name = "TIME")]
        first_seen: Option<String>,
        /// Write to this partition only (repeatable); default every partition, since the
        /// partition a later copy arrives on depends on the producer's partitioner.
        #[arg(long = "partition", value_name = "P")]
        partitions: Vec<i32>,
    },
}

/// `onceflow reset ...`.
#[derive(Debug, clap::Args)]
pub(crate) struct ResetArgs {
    #[command(flatten)]
    target: Target,
    /// List what would be deleted, delete nothing.
    #[arg(long)]
    dry_run: bool,
}

fn load(target: &Target) -> Result<StateTools> {
    let topo = crate::dsl::load(&target.topology).map_err(|e| Error::Topology {
        node: target.topology.display().to_string(),
        reason: e.to_string(),
    })?;
    let sets = target
        .sets
        .iter()
        .map(|s| parse_set(s))
        .collect::<Result<Vec<_>>>()?;
    let config = Config::load(&target.configs, &sets)?;
    Ok(StateTools::new(config, topo))
}

fn fail(e: Error) -> ExitCode {
    eprintln!("onceflow: {e}");
    ExitCode::from(2)
}

/// Run `onceflow state ...`; returns the exit code (see the module docs).
pub(crate) fn state_main(args: StateArgs) -> ExitCode {
    match state_cmd(args) {
        Ok(code) => code,
        Err(e) => fail(e),
    }
}

/// Run `onceflow reset ...`; returns the exit code (see the module docs).
pub(crate) fn reset_main(args: ResetArgs) -> ExitCode {
    match reset_cmd(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn out_err(e: std::io::Error) -> Error {
    Error::Io {
        path: "stdout".into(),
        source: e,
    }
}

fn partitions_text(ps: &[i32]) -> String {
    if ps.is_empty() {
        return "none".into();
    }
    ps.iter().map(i32::to_string).collect::<Vec<_>>().join(",")
}

fn state_cmd(args: StateArgs) -> Result<ExitCode> {
    match args.command {
        StateCommand::Get {
            target,
            key,
            key_base64,
            stage,
            from,
            json,
        } => {
            let key = if key_base64 {
                base64::engine::general_purpose::STANDARD
                    .decode(key.trim())
                    .map_err(|e| Error::Config(format!("the key is not valid base64: {e}")))?
            } else {
                key.into_bytes()
            };
            let tools = load(&target)?;
            let store = tools.store(stage.as_deref())?;
            let (found, searched) = tools.get(&store, &key, from)?;
            let mut out = std::io::stdout().lock();
            let (shown, enc) = show_key(&key);
            if found.is_empty() {
                if json {
                    let v = serde_json::json!({"store": store.name, "key": shown,
                        "key_encoding": enc, "seen": false, "partitions_searched": searched});
                    writeln!(out, "{v}").map_err(out_err)?;
                } else {
                    writeln!(
                        out,
                        "key {shown:?} ({enc}) in store {}: not seen (partitions searched: {})",
                        store.name,
                        partitions_text(&searched)
                    )
                    .map_err(out_err)?;
                }
                return Ok(ExitCode::from(1));
            }
            for f in &found {
                if json {
                    let mut v = f.to_json(&store, tools.source_topic());
                    v["seen"] = true.into();
                    writeln!(out, "{v}").map_err(out_err)?;
                } else {
                    write_text(&mut out, f, &store, tools.source_topic()).map_err(out_err)?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        StateCommand::Dump {
            target,
            stage,
            from,
        } => {
            let tools = load(&target)?;
            let store = tools.store(stage.as_deref())?;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            let mut n = 0u64;
            let searched = tools.visit(&store, None, from, &mut |f| {
                n += 1;
                writeln!(out, "{}", f.to_json(&store, tools.source_topic())).map_err(out_err)
            })?;
            out.flush().map_err(out_err)?;
            eprintln!(
                "dumped {n} entries of store {} (partitions {})",
                store.name,
                partitions_text(&searched)
            );
            Ok(ExitCode::SUCCESS)
        }
        StateCommand::Seed {
            target,
            file,
            base64,
            stage,
            first_seen,
            partitions,
        } => {
            let keys = read_keys(&file, base64)?;
            let first_seen_ms = match first_seen {
                None => super::now_ms(),
                Some(t) => parse_time(&t)?,
            };
            let tools = load(&target)?;
            let store = tools.store(stage.as_deref())?;
            let parts = (!partitions.is_empty()).then_some(partitions.as_slice());
            let r = tools.seed(&store, &keys, first_seen_ms, parts)?;
            println!(
                "seeded: keys={} written={} kept_existing={} partitions={} topic={} first_seen={}",
                keys.len(),
                r.written,
                r.kept,
                partitions_text(&r.partitions),
                r.topic,
                format_ms(first_seen_ms)
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn write_text(
    out: &mut impl Write,
    f: &FoundEntry,
    store: &StoreInfo,
    source_topic: &str,
) -> std::io::Result<()> {
    let (shown, enc) = show_key(&f.key);
    let e = &f.entry;
    let expires = e.first_seen_ms.saturating_add(store.ttl_ms);
    writeln!(
        out,
        "key {shown:?} ({enc}) in store {}: seen on partition {}",
        store.name, f.partition
    )?;
    writeln!(
        out,
        "  first seen:  {} ({} ms)",
        format_ms(e.first_seen_ms),
        e.first_seen_ms
    )?;
    if e.source_offset == SEEDED_OFFSET {
        writeln!(out, "  created by:  onceflow state seed (no source record)")?;
    } else {
        writeln!(
            out,
            "  created by:  {source_topic} partition {} offset {}",
            e.source_partition, e.source_offset
        )?;
    }
    writeln!(
        out,
        "  expires:     {} (first seen + ttl: a record with a later time passes again)",
        format_ms(expires)
    )?;
    writeln!(
        out,
        "  swept after: stream time {} (its time, or the stream time when written if later, + ttl + grace)",
        format_ms(super::swept_after_ms(e, store))
    )?;
    match f.changelog_offset {
        Some(o) => writeln!(out, "  read from:   {} offset {o}", store.changelog),
        None => writeln!(out, "  read from:   local store"),
    }
}

/// Parse `--first-seen`: ms since the epoch, or RFC 3339.
fn parse_time(t: &str) -> Result<i64> {
    if let Ok(ms) = t.parse::<i64>() {
        return Ok(ms);
    }
    let bad = |e: &dyn std::fmt::Display| {
        Error::Config(format!(
            "--first-seen {t:?}: {e} (expected RFC 3339, e.g. 2026-12-01T00:00:00Z or 2026-12-01T01:00:00+01:00, or ms since the epoch)"
        ))
    };
    // humantime takes UTC (`Z`) only: a numeric offset `+HH:MM` / `-HH:MM` is applied here.
    let (utc, offset_ms) = match split_offset(t) {
        Some((local, off)) => (format!("{local}Z"), off),
        None => (t.to_string(), 0),
    };
    let st = humantime::parse_rfc3339_weak(&utc).map_err(|e| bad(&e))?;
    let ms = match st.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    };
    Ok(ms - offset_ms)
}

/// A time ending in a numeric UTC offset (`...T01:00:00+01:00`): the local part and the
/// offset in ms. `None` for `Z` or no offset.
fn split_offset(t: &str) -> Option<(&str, i64)> {
    let cut = t.len().checked_sub(6)?;
    let (local, off) = t.split_at_checked(cut)?;
    let b = off.as_bytes();
    let sign = match b[0] {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    if !local.contains('T') && !local.contains(' ') || b[3] != b':' {
        return None;
    }
    let h: i64 = off[1..3].parse().ok()?;
    let m: i64 = off[4..6].parse().ok()?;
    if h > 23 || m > 59 {
        return None;
    }
    Some((local, sign * (h * 60 + m) * 60_000))
}

/// The keys of a seed file, one per line (`\n` or `\r\n`), raw bytes (or base64); empty
/// lines skipped.
fn read_keys(file: &Path, base64: bool) -> Result<Vec<Vec<u8>>> {
    let io = |e| Error::Io {
        path: file.display().to_string(),
        source: e,
    };
    let data = if file == Path::new("-") {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut v).map_err(io)?;
        v
    } else {
        std::fs::read(file).map_err(io)?
    };
    let mut keys = Vec::new();
    for (i, line) in data.split(|b| *b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            continue;
        }
        if base64 {
            let k = base64::engine::general_purpose::STANDARD
                .decode(line.trim_ascii())
                .map_err(|e| {
                    Error::Config(format!(
                        "{}:{}: not valid base64: {e}",
                        file.display(),
                        i + 1
                    ))
                })?;
            keys.push(k);
        } else {
            keys.push(line.to_vec());
        }
    }
    Ok(keys)
}

fn reset_cmd(args: ResetArgs) -> Result<()> {
    let tools = load(&args.target)?;
    let plan = tools.reset_plan()?;
    let members = tools.active_members()?;
    let mut out = std::io::stdout().lock();
    let w = |out: &mut std::io::StdoutLock<'_>, s: String| writeln!(out, "{s}").map_err(out_err);
    w(
        &mut out,
        format!(
            "reset of application {} ({}):",
            plan.group,
            if args.dry_run {
                "dry run, nothing is deleted"
            } else {
                "deleting"
            }
        ),
    )?;
    for (topic, committed) in &plan.committed {
        let offsets = if committed.is_empty() {
            "none".to_string()
        } else {
            committed
                .iter()
                .map(|(p, o)| format!("{p}={o}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        w(
            &mut out,
            format!(
                "  consumer group {}: committed offsets on {topic}: {offsets}",
                plan.group
            ),
        )?;
    }
    for t in &plan.topics {
        w(&mut out, format!("  topic {t}"))?;
    }
    match &plan.local_state {
        Some(d) => w(&mut out, format!("  local state dir {}", d.display()))?,
        None => w(
            &mut out,
            format!(
                "  local state dir {}: not on this machine",
                tools.local_dir().display()
            ),
        )?,
    }
    w(
        &mut out,
        "  kept: source, sink and dead-letter topics; idempotency stores of external sinks (done effects stay done)".into(),
    )?;
    if !members.is_empty() {
        w(
            &mut out,
            format!(
                "  active members: {} (a reset is refused until every instance is stopped)",
                members.len()
            ),
        )?;
    }
    if args.dry_run {
        return Ok(());
    }
    drop(out);
    tools.reset(&plan)?;
    println!(
        "reset done; remove {} on every other machine that ran this application (or run onceflow reset there)",
        tools.local_dir().display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_files_are_read_as_raw_lines_or_base64_with_line_numbers_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("keys");
        std::fs::write(&f, b"a\r\n\nb \n\xff\xfe\nlast").unwrap();
        assert_eq!(
            read_keys(&f, false).unwrap(),
            vec![
                b"a".to_vec(),
                b"b ".to_vec(),
                b"\xff\xfe".to_vec(),
                b"last".to_vec()
            ],
            "CRLF and blank lines handled, bytes kept as they are"
        );
        std::fs::write(&f, "/w==\nnot base64!\n").unwrap();
        let e = read_keys(&f, true).unwrap_err().to_string();
        assert!(e.contains("keys:2: not valid base64"), "{e}");
        std::fs::write(&f, "/w==\r\n").unwrap();
        assert_eq!(read_keys(&f, true).unwrap(), vec![vec![0xff]]);
    }

    #[test]
    fn first_seen_takes_rfc3339_or_millis() {
        assert_eq!(parse_time("1764547200000").unwrap(), 1_764_547_200_000);
        assert_eq!(
            parse_time("2025-12-01T00:00:00Z").unwrap(),
            1_764_547_200_000
        );
        let e = parse_time("yesterday").unwrap_err().to_string();
        assert!(e.contains("--first-seen"), "{e}");
        // A numeric offset: the same instant.
        for t in ["2025-12-01T01:00:00+01:00", "2025-11-30T19:30:00-04:30"] {
            assert_eq!(parse_time(t).unwrap(), 1_764_547_200_000, "{t}");
        }
        assert_eq!(
            parse_time("2025-12-01T00:00:00.250+00:00").unwrap(),
            1_764_547_200_250
        );
        for bad in [
            "2025-12-01T00:00:00+25:00",
            "2025-12-01+01:00",
            "é+01:00",
            "+01:00",
        ] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn text_and_json_agree_on_when_a_late_entry_is_swept() {
        let store = StoreInfo {
            name: "dedup".into(),
            changelog: "app-dedup-changelog".into(),
            ttl_ms: 600_000,
            grace_ms: 3_600_000,
        };
        let f = FoundEntry {
            partition: 0,
            key: b"late".to_vec(),
            entry: crate::processor::dedup::DedupEntry {
                first_seen_ms: 0,
                source_partition: 0,
                source_offset: 3,
                fingerprint: None,
                written_stream_ms: Some(86_400_000), // a day late
                untimed: false,
            },
            changelog_offset: None,
        };
        let json = f.to_json(&store, "in")["swept_after"]
            .as_str()
            .unwrap()
            .to_string();
        // From when it was written: a day + 10 min + 1 h.
        assert_eq!(json, "1970-01-02T01:10:00.000Z");
        let mut text = Vec::new();
        write_text(&mut text, &f, &store, "in").unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains(&format!("swept after: stream time {json}")),
            "{text}"
        );
    }
}
