//! Whether this process reaches the Kafka cluster, for `/ready`.
//!
//! librdkafka reports through a client's error callback when every broker connection is
//! down (`AllBrokersDown`); both the source consumer and the output producer pass such
//! reports to [`note_error`]. Nothing reports the way back, so the run loop, while the
//! link is down, asks the cluster for metadata about once a second and calls [`note_up`]
//! when an answer comes. The state is per process (every client of it talks to the same
//! cluster).

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The reachability state (one per process: [`LINK`]).
pub(crate) struct Link {
    down: AtomicBool,
    /// How many times every broker went unreachable since the process started.
    outages: AtomicU64,
}

/// This process's link to the cluster.
pub(crate) static LINK: Link = Link::new();

impl Link {
    /// Reachable until a client reports every broker down.
    pub(crate) const fn new() -> Link {
        Link {
            down: AtomicBool::new(false),
            outages: AtomicU64::new(0),
        }
    }

    /// As [`note_error`].
    pub(crate) fn note_error(&self, error: &KafkaError) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown)
            && !self.down.swap(true, Ordering::SeqCst)
        {
            self.outages.fetch_add(1, Ordering::SeqCst);
            tracing::warn!("every broker is unreachable: not ready until one answers");
        }
    }

    /// As [`note_up`].
    pub(crate) fn note_up(&self) {
        if self.down.swap(false, Ordering::SeqCst) {
            tracing::info!("a broker answers again: ready once the partitions are");
        }
    }

    /// As [`reachable`].
    pub(crate) fn reachable(&self) -> bool {
        !self.down.load(Ordering::SeqCst)
    }

    /// As [`outages`].
    pub(crate) fn outages(&self) -> u64 {
        self.outages.load(Ordering::SeqCst)
    }
}

impl Default for Link {
    fn default() -> Self {
        Link::new()
    }
}

/// Take note of a client error: `AllBrokersDown` marks the cluster unreachable.
pub(crate) fn note_error(error: &KafkaError) {
    LINK.note_error(error);
}

/// A request that needs a broker found none to answer it within its time (a start-up
/// metadata request failing with a transport error): the cluster is unreachable, as when a
/// client reports every broker down. Start-up's admin client needs this: librdkafka's
/// error reports reach only clients whose main queue is polled, and the admin client's is
/// not.
pub(crate) fn note_down() {
    LINK.note_error(&KafkaError::Global(RDKafkaErrorCode::AllBrokersDown));
}

/// A broker answered: the cluster is reachable again.
pub(crate) fn note_up() {
    LINK.note_up();
}

/// Whether a broker was reachable at last notice (true until a client reports every
/// broker down).
pub(crate) fn reachable() -> bool {
    LINK.reachable()
}

/// How many times every broker went unreachable since the process started: a change
/// between two readings means an outage began in between (the producer compares the
/// readings at a transaction's begin and at its fencing).
pub(crate) fn outages() -> u64 {
    LINK.outages()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_brokers_down_makes_the_cluster_unreachable_until_one_answers() {
        let link = Link::new();
        assert!(link.reachable());
        link.note_error(&KafkaError::Global(
            RDKafkaErrorCode::BrokerTransportFailure,
        ));
        assert!(
            link.reachable(),
            "one connection lost is not the cluster gone"
        );
        link.note_error(&KafkaError::Global(RDKafkaErrorCode::AllBrokersDown));
        assert!(!link.reachable());
        link.note_up();
        assert!(link.reachable());
    }
}
