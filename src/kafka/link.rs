//! Whether this process reaches the Kafka cluster, for `/ready`.
//!
//! librdkafka reports through a client's error callback when every broker connection is
//! down (`AllBrokersDown`); both the source consumer and the output producer pass such
//! reports to [`note_error`]. Nothing reports the way back, so the run loop, while the
//! link is down, asks the cluster for metadata about once a second and calls [`note_up`]
//! when an answer comes. The state is per process (every client of it talks to the same
//! cluster).

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::sync::atomic::{AtomicBool, Ordering};

static DOWN: AtomicBool = AtomicBool::new(false);

/// Take note of a client error: `AllBrokersDown` marks the cluster unreachable.
pub fn note_error(error: &KafkaError) {
    if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown)
        && !DOWN.swap(true, Ordering::SeqCst)
    {
        tracing::warn!("every broker is unreachable: not ready until one answers");
    }
}

/// A broker answered: the cluster is reachable again.
pub fn note_up() {
    if DOWN.swap(false, Ordering::SeqCst) {
        tracing::info!("a broker answers again: ready once the partitions are");
    }
}

/// Whether a broker was reachable at last notice (true until a client reports every
/// broker down).
pub fn reachable() -> bool {
    !DOWN.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_brokers_down_makes_the_cluster_unreachable_until_one_answers() {
        note_up();
        assert!(reachable());
        note_error(&KafkaError::Global(
            RDKafkaErrorCode::BrokerTransportFailure,
        ));
        assert!(reachable(), "one connection lost is not the cluster gone");
        note_error(&KafkaError::Global(RDKafkaErrorCode::AllBrokersDown));
        assert!(!reachable());
        note_up();
        assert!(reachable());
    }
}
