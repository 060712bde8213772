//! One error type for onceflow, tagged with who is at fault.
//!
//! Errors before the run (config, topology) stop start-up; errors on a single record
//! ([`RecordError`]) never stop the run: the record goes to the dead-letter topic.

use std::fmt;

/// Who caused an error, so an operator knows where to look (the Arroyo habit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The user's config, topology file or input data.
    User,
    /// A system outside onceflow: the broker, the disk, a sink.
    External,
    /// A bug in onceflow ([`Error::Internal`]).
    Internal,
}

impl Fault {
    /// What an operator does about an error of this kind, for the last line `onceflow run`
    /// prints before it exits.
    pub(crate) fn hint(self) -> &'static str {
        match self {
            Fault::User => "fix the config or topology named above and start again",
            Fault::External => {
                "a system outside onceflow failed; a restart resumes from the last commit"
            }
            Fault::Internal => "this is a bug in onceflow; please report it with the log",
        }
    }

    /// The exit code of `onceflow run` for an error of this kind: 2 for the user's config or
    /// topology (as for errors found before the run starts), 1 otherwise.
    pub(crate) fn exit_code(self) -> u8 {
        match self {
            Fault::User => 2,
            Fault::External | Fault::Internal => 1,
        }
    }
}

/// Every error onceflow returns from its public API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration key or value is wrong; names the key and where it came from.
    #[error("config error: {0}")]
    Config(String),
    /// The topology failed validation; `node` names the stage (or file location).
    #[error("topology error in {node}: {reason}")]
    Topology {
        /// The stage (or `file:line:column`) at fault.
        node: String,
        /// What is wrong, a sentence.
        reason: String,
    },
    /// A state store failed (open, read, write, flush).
    #[error("state store error ({store}): {reason}")]
    State {
        /// The store.
        store: String,
        /// What failed.
        reason: String,
    },
    /// A Kafka operation failed; `op` says which one.
    #[error("kafka {op} failed: {source}")]
    Kafka {
        /// The operation (`subscribe`, `commit`, ...).
        op: &'static str,
        /// The client's error.
        #[source]
        source: rdkafka::error::KafkaError,
    },
    /// Another instance with the same transactional.id (or a newer group generation) took
    /// over: this instance is a zombie and must stop, not retry.
    #[error("fenced: {0}")]
    Fenced(String),
    /// Kafka-side condition that is not a client error (a configuration the broker refused,
    /// a topic count onceflow cannot run with).
    #[error("{0}")]
    Broker(String),
    /// A topic the topology reads does not exist (the source topic, a table's topic):
    /// onceflow creates only the topics it writes, so this is the user's to create or to
    /// name right; the message names the topic and the cluster. Exit 2, as a config fault:
    /// a restart alone would find it missing again.
    #[error("{0}")]
    MissingTopic(String),
    /// A transaction's commit or abort ended without a known outcome (its answer was lost or
    /// came too late): it may have committed or not. Never retried blindly (librdkafka does
    /// not implement KIP-890); the producer is re-created instead.
    #[error("transaction outcome unknown: {0}")]
    TransactionOutcomeUnknown(String),
    /// The broker answered a request with an error code; `what` names the request and its
    /// object (`delete group g`). Transient codes are retried first (`kafka::retry`).
    #[error("{what}: {code}")]
    BrokerCode {
        /// The request and its object.
        what: String,
        /// The broker's error code.
        code: rdkafka::types::RDKafkaErrorCode,
    },
    /// I/O on a local file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// onceflow broke one of its own invariants (a bug, not the input's or a system's
    /// fault); the message says which. The run stops; a restart resumes from the last commit.
    #[error("internal error (a bug in onceflow, please report it): {0}")]
    Internal(String),
}

impl Error {
    /// Who is at fault for this error.
    pub(crate) fn fault(&self) -> Fault {
        match self {
            Error::Config(_) | Error::Topology { .. } | Error::MissingTopic(_) => Fault::User,
            Error::State { .. }
            | Error::Kafka { .. }
            | Error::Broker(_)
            | Error::BrokerCode { .. }
            | Error::Io { .. }
            | Error::TransactionOutcomeUnknown(_)
            | Error::Fenced(_) => Fault::External,
            Error::Internal(_) => Fault::Internal,
        }
    }

    /// Shorthand for a [`Error::Kafka`] naming the operation.
    pub(crate) fn kafka(op: &'static str) -> impl FnOnce(rdkafka::error::KafkaError) -> Error {
        move |source| Error::Kafka { op, source }
    }

    /// For a failed transactional operation: whether it is fatal (fenced, or the producer
    /// is unusable) rather than abortable or retriable.
    pub(crate) fn is_fatal_transaction_error(&self) -> bool {
        match self {
            Error::Fenced(_) => true,
            Error::Kafka { source, .. } => {
                match source {
                    rdkafka::error::KafkaError::Transaction(e) => e.is_fatal(),
                    other => matches!(
                    other.rdkafka_error_code(),
                    Some(rdkafka::types::RDKafkaErrorCode::Fenced)
                        | Some(rdkafka::types::RDKafkaErrorCode::ProducerFenced)
                        | Some(rdkafka::types::RDKafkaErrorCode::InvalidProducerEpoch)
                        | Some(rdkafka::types::RDKafkaErrorCode::TransactionalIdAuthorizationFailed)
                ),
                }
            }
            _ => false,
        }
    }

    /// Whether a local store or file failed (full disk, corrupt file): not the
    /// transaction's fault, so retrying the transaction cannot help.
    pub(crate) fn is_store_failure(&self) -> bool {
        matches!(self, Error::State { .. } | Error::Io { .. })
    }

    /// Shorthand for a [`Error::State`].
    pub(crate) fn state(store: impl Into<String>, reason: impl fmt::Display) -> Error {
        Error::State {
            store: store.into(),
            reason: reason.to_string(),
        }
    }
}

/// Result alias with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a single record could not be processed; the record goes to the dead-letter topic.
///
/// `stage` is the topology node that refused it (`source` for decoding errors) and
/// `reason` a sentence a user can act on. It travels in the dead-letter record's headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordError {
    /// Node name that refused the record.
    pub stage: String,
    /// Human-readable reason, e.g. "value is not valid JSON: expected value at line 1 column 1".
    pub reason: String,
}

impl RecordError {
    /// A record error raised by `stage`.
    pub(crate) fn new(stage: impl Into<String>, reason: impl Into<String>) -> Self {
        RecordError {
            stage: stage.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stage {}: {}", self.stage, self.reason)
    }
}

impl std::error::Error for RecordError {}

/// A problem with one stage found at build time: the field at fault (as a topology file
/// names it, e.g. `ttl` or `idempotency.lease`), or `None` for the stage as a whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FieldError {
    /// The field, if one is at fault.
    pub(crate) field: Option<String>,
    /// What is wrong.
    pub(crate) reason: String,
}

impl FieldError {
    /// A problem with field `field`.
    pub(crate) fn at(field: impl Into<String>, reason: impl Into<String>) -> Self {
        FieldError {
            field: Some(field.into()),
            reason: reason.into(),
        }
    }

    /// A problem with the stage as a whole.
    pub(crate) fn whole(reason: impl Into<String>) -> Self {
        FieldError {
            field: None,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config or topology error is the user's (exit 2, like errors found before the run);
    /// a broker or disk failure is outside onceflow (exit 1, a restart resumes); a broken
    /// invariant is onceflow's own bug (exit 1, asks for a report).
    #[test]
    fn who_is_at_fault_sets_the_exit_code() {
        let user = Error::Config("commit.interval.ms: not a number".into());
        assert_eq!(user.fault(), Fault::User);
        assert_eq!(user.fault().exit_code(), 2);
        let disk = Error::state("dedup/0", "No space left on device");
        assert_eq!(disk.fault(), Fault::External);
        assert_eq!(disk.fault().exit_code(), 1);
        assert!(disk.fault().hint().contains("restart"));
        assert_ne!(Fault::User.hint(), Fault::External.hint());
        let bug = Error::Internal("store dedup: no changelog topic".into());
        assert_eq!(bug.fault(), Fault::Internal);
        assert_eq!(bug.fault().exit_code(), 1);
        assert!(bug.fault().hint().contains("bug"));
        assert!(bug.to_string().contains("no changelog topic"), "{bug}");
    }
}
