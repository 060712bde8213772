//! `onceflow state seed`: write dedup entries for ids known to be done, through the
//! changelog, so a new deployment does not repeat them.

use super::*;

impl StateTools {
    /// Write `keys` as dedup entries (first seen at `first_seen_ms`, no source record) to
    /// the changelog of `store`, on every partition (or only `partitions`), so that every
    /// instance restores them before it processes its partitions. A key that has an entry on
    /// a partition already, live at `first_seen_ms` (not older than the TTL), is left alone
    /// there (its first-seen time and source stay); an expired one is replaced. The
    /// changelog topic is created, as `run` would, when missing.
    ///
    /// Every partition by default, because the partition a later copy of a key arrives on is
    /// set by the producer's partitioner, which onceflow does not know.
    ///
    /// # Errors
    /// The group has active members (refused: a running instance would not see the
    /// entries), a partition out of range, the broker unreachable, a delivery that failed.
    pub(crate) fn seed(
        &self,
        store: &StoreInfo,
        keys: &[Vec<u8>],
        first_seen_ms: i64,
        partitions: Option<&[i32]>,
    ) -> Result<SeedReport> {
        self.refuse_if_active("seed the state")?;
        let n = crate::runtime::App::new(self.config.clone(), self.topology.clone())
            .prepare_topics_for_state()?
            .partitions as i32;
        let parts: Vec<i32> = match partitions {
            Some(ps) => {
                if let Some(bad) = ps.iter().find(|p| **p < 0 || **p >= n) {
                    return Err(Error::Config(format!(
                        "--partition {bad}: changelog {} has partitions 0..{}",
                        store.changelog,
                        n - 1
                    )));
                }
                let mut ps = ps.to_vec();
                ps.sort_unstable();
                ps.dedup();
                ps
            }
            None => (0..n).collect(),
        };
        let wanted: std::collections::HashSet<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let consumer = crate::kafka::consumer::create_restore_consumer(&self.config)?;
        let producer: rdkafka::producer::ThreadedProducer<SeedDeliveries> =
            crate::kafka::client_config(
                &self.config,
                &[("enable.idempotence", "true"), ("linger.ms", "5")],
                &self.config.kafka_producer,
            )
            .create_with_context(SeedDeliveries::default())
            .map_err(crate::kafka::config_error)?;
        let value = DedupEntry {
            first_seen_ms,
            source_partition: 0,
            source_offset: SEEDED_OFFSET,
            fingerprint: None,
            written_stream_ms: None,
            untimed: false,
        };
        let mut report = SeedReport {
            topic: store.changelog.clone(),
            partitions: parts.clone(),
            written: 0,
            kept: 0,
        };
        for &p in &parts {
            // Keys to seed that have an entry on this partition: left alone.
            let mut live: HashMap<Vec<u8>, bool> = HashMap::new();
            let (_, end) = with_retries("changelog end offset", || {
                consumer
                    .fetch_watermarks(&store.changelog, p, Duration::from_secs(30))
                    .map_err(Error::kafka("changelog offsets"))
            })?;
            read_changelog(
                &consumer,
                &store.changelog,
                p,
                Offset::Beginning,
                end,
                |k, v, _| {
                    if wanted.contains(k) {
                        // Kept only while live at the seed's time: an expired entry would
                        // let the next copy pass, against what the seed says.
                        let kept = match v {
                            None => false,
                            Some(v) => DedupEntry::decode(v).map_or(true, |e| {
                                first_seen_ms.saturating_sub(e.first_seen_ms) <= store.ttl_ms
                            }),
                        };
                        live.insert(k.to_vec(), kept);
                    }
                    Ok(())
                },
            )?;
            let bytes = DedupEntry {
                source_partition: p,
                ..value.clone()
            }
            .encode_to_vec();
            let now = now_ms();
            let mut seen_here = std::collections::HashSet::new();
            for k in keys {
                if !seen_here.insert(k.as_slice()) {
                    continue;
                }
                if live.get(k.as_slice()) == Some(&true) {
                    report.kept += 1;
                    continue;
                }
                let mut rec =
                    rdkafka::producer::BaseRecord::<'_, [u8], [u8], ()>::to(&store.changelog)
                        .partition(p)
                        .key(k.as_slice())
                        .payload(bytes.as_slice())
                        .timestamp(now);
                loop {
                    match producer.send(rec) {
                        Ok(()) => break,
                        Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                            rec = r;
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err((e, _)) => return Err(Error::kafka("produce seed entry")(e)),
                    }
                }
            }
        }
        use rdkafka::producer::Producer as _;
        producer
            .flush(TOOL_TIMEOUT)
            .map_err(Error::kafka("flush seed entries"))?;
        let ctx = producer.context();
        if let Some(first) = ctx.first_failure.lock().ok().and_then(|f| f.clone()) {
            return Err(Error::Broker(format!(
                "{} seed entr(ies) could not be written; first: {first}",
                ctx.failed.load(std::sync::atomic::Ordering::SeqCst)
            )));
        }
        report.written = ctx.delivered.load(std::sync::atomic::Ordering::SeqCst);
        Ok(report)
    }
}

/// Counts the deliveries of `state seed`.
#[derive(Default)]
struct SeedDeliveries {
    delivered: std::sync::atomic::AtomicU64,
    failed: std::sync::atomic::AtomicU64,
    first_failure: std::sync::Mutex<Option<String>>,
}

impl rdkafka::ClientContext for SeedDeliveries {}

impl rdkafka::producer::ProducerContext for SeedDeliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &rdkafka::producer::DeliveryResult<'_>, _: ()) {
        use std::sync::atomic::Ordering;
        match result {
            Ok(_) => {
                self.delivered.fetch_add(1, Ordering::SeqCst);
            }
            Err((e, _)) => {
                self.failed.fetch_add(1, Ordering::SeqCst);
                if let Ok(mut f) = self.first_failure.lock() {
                    f.get_or_insert_with(|| e.to_string());
                }
            }
        }
    }
}
