//! `Task::flush_effects`: finish the external effects in flight before a commit.
//!
//! External sink stages ([`crate::sink`]) run their effects asynchronously. Before the
//! runtime commits source offsets it calls [`Task::flush_effects`]: every stage's
//! [`crate::processor::Processor::flush`] waits for its effects; records whose effect failed
//! become dead letters (appended to `out`, sent before the offsets), and records that go on
//! run through the rest of the stages. So an offset is committed only once its record's
//! effect is done or dead-lettered.

use super::{dead_letter, Task};
use crate::error::Result;
use crate::processor::{Context, OutRecord, StageError};

impl Task {
    /// Wait for the external effects in flight; dead letters and downstream outputs are
    /// appended to `out`. Call before committing offsets (and before flushing the producer).
    ///
    /// # Errors
    /// A system failure of a stage (a store failure downstream).
    pub fn flush_effects(&mut self, wall_ms: i64, out: &mut Vec<OutRecord>) -> Result<()> {
        for i in 0..self.nodes.len() {
            let mut forwarded = Vec::new();
            let failed = {
                let mut ctx = Context {
                    stores: &mut self.stores,
                    forwarded: &mut forwarded,
                    emitted: out,
                    counts: &mut self.counts,
                    tables: &self.tables,
                    wall_clock_ms: wall_ms,
                    stream_time_ms: self.stream_time,
                };
                self.nodes[i].1.flush(&mut ctx)?
            };
            for (rec, err) in failed {
                self.count_dead_letter(i + 1);
                self.counts.dead_lettered += 1;
                let src = (
                    rec.source.topic.to_string(),
                    rec.source.partition,
                    rec.source.offset,
                );
                out.push(dead_letter(
                    &self.dlq_topic,
                    &src,
                    rec.key,
                    rec.value,
                    rec.headers,
                    rec.timestamp,
                    &err,
                ));
            }
            // Records released by stage i go through stages i+1.. now.
            let mut cur = forwarded;
            for j in i + 1..self.nodes.len() {
                if cur.is_empty() {
                    break;
                }
                let mut next = Vec::new();
                for rec in cur.drain(..) {
                    let keep = rec.clone();
                    let mut ctx = Context {
                        stores: &mut self.stores,
                        forwarded: &mut next,
                        emitted: out,
                        counts: &mut self.counts,
                        tables: &self.tables,
                        wall_clock_ms: wall_ms,
                        stream_time_ms: self.stream_time,
                    };
                    match self.nodes[j].1.process(rec, &mut ctx) {
                        Ok(()) => {}
                        Err(StageError::Record(e)) => {
                            self.count_dead_letter(j + 1);
                            self.counts.dead_lettered += 1;
                            let src = (
                                keep.source.topic.to_string(),
                                keep.source.partition,
                                keep.source.offset,
                            );
                            out.push(dead_letter(
                                &self.dlq_topic,
                                &src,
                                keep.key,
                                keep.value,
                                keep.headers,
                                keep.timestamp,
                                &e,
                            ));
                        }
                        Err(StageError::Fatal(e)) => return Err(e),
                    }
                }
                cur = next;
            }
        }
        Ok(())
    }
}
