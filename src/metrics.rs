//! Metric names (DESIGN.md, "Operations"). Recorded through the `metrics` facade; served in
//! Prometheus format at `/metrics` of the HTTP listener (`http.address`, see
//! `http.rs`).

/// Counter `{topology,stage,result}`, result = passed|duplicate|conflict|error, and
/// `filtered` for records a filter drops or no route takes.
pub(crate) const RECORDS_PROCESSED: &str = "onceflow_records_processed_total";

/// Stage `stage`'s counter of [`RECORDS_PROCESSED`] with result `result` (`passed`,
/// `filtered`, `error`, ...).
pub(crate) fn records_processed(
    topology: &str,
    stage: &str,
    result: &'static str,
) -> metrics::Counter {
    metrics::counter!(RECORDS_PROCESSED,
        "topology" => topology.to_string(), "stage" => stage.to_string(), "result" => result)
}

/// Histogram `{topology,stage}`: time of one dedup decision (lookup + decide + stage),
/// sampled one decision in 64.
pub const DEDUP_CHECK_SECONDS: &str = "onceflow_dedup_check_duration_seconds";
/// Gauge `{topology,store,partition}`: keys held.
pub(crate) const DEDUP_KEYS: &str = "onceflow_dedup_keys";
/// Gauge `{store,partition,part}`: bytes a store partition holds in memory, by `part`:
/// `resident` (committed entries readable in memory, with their index), `key_filter`
/// (see [`crate::StateMemory::key_filter`]), `engine` (the engine's own: sled's index of key
/// hashes, or all of a memory store); sled's page cache (`state.cache.bytes`) is not
/// counted. Set after the first commit, then at most every [`STATE_MEMORY_EVERY`];
/// `engine` is not waited for while the engine writes a batch (it keeps its last value and
/// is set at a later turn). A revoked partition's gauges keep their last values.
pub(crate) const STATE_MEMORY: &str = "onceflow_state_memory_bytes";
/// How often [`STATE_MEMORY`] is set at most (each time walks the stores' tables).
pub(crate) const STATE_MEMORY_EVERY: std::time::Duration = std::time::Duration::from_secs(10);
/// Counter `{store,partition}`: changelog records applied by restore.
pub(crate) const RESTORE_RECORDS: &str = "onceflow_restore_records_total";
/// Gauge `{store,partition}`: changelog records left to restore.
pub(crate) const RESTORE_REMAINING: &str = "onceflow_restore_remaining_records";
/// Counter `{result}`, result = committed|aborted|unknown (the commit's reply was lost).
pub(crate) const TRANSACTIONS: &str = "onceflow_transactions_total";
/// Counter `{topology,sink,result}`, result = done|skipped_duplicate|unprotected|failed|unknown
/// (external sinks; `unprotected`: run without idempotency under `on_store_error: fail_open`;
/// `unknown`: a Redis command that is not idempotent lost its reply, so whether it ran is
/// unknown; the record is dead-lettered, not retried).
pub(crate) const SINK_EFFECTS: &str = "onceflow_sink_effects_total";
/// Counter `{topology,topic,stage}`: records sent to the dead-letter topic.
pub(crate) const DEAD_LETTERS: &str = "onceflow_dead_letters_total";
/// Counter `{topology,store,partition}`: entries evicted by `max_keys`, oldest first.
pub(crate) const EVICTED: &str = "onceflow_dedup_evicted_total";
/// Counter `{topology,store}`: entries removed by the expiry sweep.
pub(crate) const EXPIRED: &str = "onceflow_dedup_expired_total";
/// Counter `{topology,store}`: entries the expiry sweep read (it reads none while no entry
/// can have expired).
pub(crate) const SWEEP_READ: &str = "onceflow_dedup_sweep_read_total";
/// Counter `{topology}`: commits made, under either guarantee.
pub(crate) const COMMITS: &str = "onceflow_commits_total";

/// Counter `{table}`: table topic records applied to a lookup table (load and follow).
pub const TABLE_RECORDS: &str = "onceflow_table_records_total";
/// Counter `{topology,stage,result}` of enrich stages, result = matched|missing|error.
pub(crate) const ENRICH_LOOKUPS: &str = "onceflow_enrich_lookups_total";

/// Buckets of [`DEDUP_CHECK_SECONDS`], in seconds: 1 µs to 100 ms.
pub(crate) const DEDUP_CHECK_BUCKETS: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2, 1e-1,
];

/// Install the Prometheus recorder as this process's metrics recorder and return its
/// handle (rendered by `/metrics`). Histograms are exported with buckets
/// ([`DEDUP_CHECK_BUCKETS`]). Once per process: a second call returns the first handle.
///
/// # Errors
/// [`crate::Error::Config`] when another recorder is installed already.
pub(crate) fn install_prometheus() -> crate::Result<metrics_exporter_prometheus::PrometheusHandle> {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let h = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(DEDUP_CHECK_SECONDS.into()),
            DEDUP_CHECK_BUCKETS,
        )
        .and_then(|b| b.install_recorder())
        .map_err(|e| crate::Error::Config(format!("metrics recorder: {e}")))?;
    Ok(HANDLE.get_or_init(|| h).clone())
}
