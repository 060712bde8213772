//! The topic sink: one or more topics, key and headers settable.

use super::*;

/// Settings of a topic sink: one or more topics, and optionally a computed key and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkSpec {
    /// Destination topics (at least one); each gets the same record.
    pub topics: Vec<String>,
    /// The output key; default: the record's key unchanged. A `null` result writes a null
    /// key.
    pub(crate) key: Option<BytesFn>,
    /// Headers to set, in order: each replaces the record's headers of that name; a `null`
    /// result removes them.
    pub(crate) headers: Vec<(String, BytesFn)>,
}

impl SinkSpec {
    /// A sink to `topic` writing records as they are.
    pub fn to(topic: impl Into<String>) -> Self {
        SinkSpec {
            topics: vec![topic.into()],
            key: None,
            headers: Vec::new(),
        }
    }

    /// Also write to `topic`.
    pub fn also(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// Compute the output key from the record (`None`: a null key).
    pub fn key(
        mut self,
        f: impl Fn(&Record) -> Result<Option<bytes::Bytes>, String> + Send + Sync + 'static,
    ) -> Self {
        self.key = Some(BytesFn::native(f));
        self
    }

    /// Set header `name` to what `f` computes (`None` removes it).
    pub fn header(
        mut self,
        name: impl Into<String>,
        f: impl Fn(&Record) -> Result<Option<bytes::Bytes>, String> + Send + Sync + 'static,
    ) -> Self {
        self.headers.push((name.into(), BytesFn::native(f)));
        self
    }
}

type Headers = Vec<(String, Option<bytes::Bytes>)>;

/// Writes each record to its topics with its key, value, headers and timestamp (key and
/// headers possibly computed), and forwards it when a later stage exists. A key or header
/// that cannot be computed sends the record to the dead-letter topic, and nothing is
/// written for it.
pub(crate) struct TopicSink {
    name: String,
    spec: SinkSpec,
    proj: Option<std::sync::Arc<[String]>>,
    /// Decode the whole JSON tree before evaluating (see `expr::plan`).
    json: bool,
    forward: bool,
    /// Source format and each topic's format (see [`crate::processor::codec::encode_for_sink`]).
    codecs: Option<(crate::codec::Format, Vec<crate::codec::Format>)>,
}

impl TopicSink {
    /// A sink stage; `json`: the source is JSON (decoded for key and header expressions);
    /// `forward` is false for the last stage, which then moves the record out instead of
    /// copying it.
    pub(crate) fn new(name: &str, spec: &SinkSpec, json: bool, forward: bool) -> Self {
        let (proj, tree) = plan(
            json,
            spec.key.iter().chain(spec.headers.iter().map(|(_, f)| f)),
        );
        TopicSink {
            name: name.to_string(),
            proj,
            spec: spec.clone(),
            json: tree,
            forward,
            codecs: None,
        }
    }

    /// Write values in each topic's format (`sinks`, one per topic of the spec), the source
    /// being in `source` format (see [`crate::processor::codec::encode_for_sink`]); without this the
    /// value bytes pass as they are. A record whose view does not encode goes to the
    /// dead-letter topic, and nothing is written for it.
    pub(crate) fn with_codecs(
        mut self,
        source: crate::codec::Format,
        sinks: Vec<crate::codec::Format>,
    ) -> Self {
        self.codecs = Some((source, sinks));
        self
    }

    /// The value bytes for each topic.
    fn values(&self, record: &Record) -> Result<Vec<Option<bytes::Bytes>>, RecordError> {
        match &self.codecs {
            None => Ok(vec![record.value.clone(); self.spec.topics.len()]),
            Some((source, sinks)) => sinks
                .iter()
                .map(|sink| {
                    crate::processor::codec::encode_for_sink(record, source, sink)
                        .map_err(|e| RecordError::new(&self.name, e))
                })
                .collect(),
        }
    }

    fn computed(&self, record: &Record) -> Result<(Option<bytes::Bytes>, Headers), String> {
        let b = Bindings::projected(record, self.proj.clone());
        let key = match &self.spec.key {
            Some(f) => f.eval(&b).map_err(|e| format!("key: {e}"))?,
            None => record.key.clone(),
        };
        let mut headers = record.headers.clone();
        for (name, f) in &self.spec.headers {
            let v = f.eval(&b).map_err(|e| format!("header {name}: {e}"))?;
            headers.retain(|(k, _)| k != name);
            if v.is_some() {
                headers.push((name.clone(), v));
            }
        }
        Ok((key, headers))
    }
}

impl Processor for TopicSink {
    fn process(&mut self, mut record: Record, ctx: &mut Context<'_>) -> Result<(), StageError> {
        let timestamp = record.timestamp;
        let n = self.spec.topics.len();
        let plain = self.spec.key.is_none() && self.spec.headers.is_empty();
        if plain && n == 1 && !self.forward {
            // The common last stage: move the record out, no copies.
            let value = match &self.codecs {
                None => record.value,
                // Bytes written as read (what `encode_for_sink` returns, moved, not cloned
                // into a vector of one).
                Some((source, sinks))
                    if record.json.is_none()
                        && crate::processor::codec::written_as_read(source, &sinks[0]) =>
                {
                    record.value
                }
                Some((source, sinks)) => {
                    crate::processor::codec::encode_for_sink(&record, source, &sinks[0])
                        .map_err(|e| RecordError::new(&self.name, e))?
                }
            };
            ctx.emit(OutRecord {
                topic: self.spec.topics[0].clone(),
                partition: None,
                key: record.key,
                value,
                headers: record.headers,
                timestamp,
            })
            .map_err(|e| RecordError::new(&self.name, e))?;
            return Ok(());
        }
        let (key, headers) = if plain {
            (None, None)
        } else {
            crate::processor::transform::prepare(&self.name, &mut record, self.json)?;
            let (k, h) = self
                .computed(&record)
                .map_err(|e| RecordError::new(&self.name, e))?;
            (Some(k), Some(h))
        };
        let key = key.unwrap_or_else(|| record.key.clone());
        let headers = headers.unwrap_or_else(|| record.headers.clone());
        let values = self.values(&record)?;
        for (topic, value) in self.spec.topics.iter().zip(values) {
            ctx.emit(OutRecord {
                topic: topic.clone(),
                partition: None,
                key: key.clone(),
                value,
                headers: headers.clone(),
                timestamp,
            })
            .map_err(|e| RecordError::new(&self.name, e))?;
        }
        if self.forward {
            ctx.forward(record);
        }
        Ok(())
    }
}
