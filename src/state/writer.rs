//! The write-behind writer: one thread per process that writes committed batches of every
//! store to its engine, in order, with back-pressure when a store falls too far behind.

use super::*;
use std::sync::OnceLock;

/// Called before the writer writes each chunk, when set: the runtime installs its
/// `state.write` failpoint here (`runtime::failpoint`), so that this module knows nothing
/// of failpoints. Unset, a chunk costs one atomic load.
static BEFORE_CHUNK: OnceLock<fn()> = OnceLock::new();

/// Set the hook the writer calls before each chunk (once per process; later calls are
/// ignored).
pub(crate) fn set_before_chunk(hook: fn()) {
    let _ = BEFORE_CHUNK.set(hook);
}

/// How far the writer got with one store's batches.
#[derive(Debug, Default)]
pub(super) struct Progress {
    /// Sequence number of the last batch fully written to the engine.
    pub(super) persisted: u64,
    /// The writer is writing a chunk of this store now.
    pub(super) busy: bool,
    /// The store was closed: the writer skips its remaining batches.
    pub(super) stopped: bool,
    /// The first write failure; the writer writes nothing more of this store after it.
    pub(super) error: Option<String>,
}

/// Progress shared between a store and the writer.
#[derive(Debug, Default)]
pub(super) struct Shared {
    pub(super) state: Mutex<Progress>,
    pub(super) changed: Condvar,
}

impl Shared {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        // A panic while holding this lock leaves plain numbers behind: keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One committed batch for the writer.
pub(super) struct Job {
    pub(super) engine: Arc<dyn KeyValueStore>,
    pub(super) shared: Arc<Shared>,
    pub(super) seq: u64,
    pub(super) ops: Ops,
    pub(super) changelog_offset: Option<i64>,
    /// The store's key count before the batch and each op's change to it, when known.
    pub(super) count: Option<(u64, Vec<i8>)>,
}

/// The background thread of a backend that writes committed batches to their engines, in
/// commit order per store, so neither processing nor restore waits on the engine's write
/// cost (sled: several microseconds a key here).
///
/// Durability: a batch is written as one engine batch (chunks of `WRITE_CHUNK` ops, only
/// the last chunk storing the batch's changelog offset), so the stored offset never runs
/// ahead of the data it stands for. A crash (or a closed store, whose remaining batches are
/// skipped) leaves the engine with a prefix of the batches and an older offset; the
/// restore replays the changelog from that offset in log order.
/// The thread runs at a lower CPU priority (nice 10) than processing and restore.
///
/// While a [`WriterHold`] is alive (the runtime takes one while any restore is in
/// progress) the writer starts no new batch unless some store waits for it (a store over
/// [`UNPERSISTED_OPS`], or a sync): on a small machine the restore then has the CPU, and
/// the backlog is written once the restore is done. Holding never changes what is
/// written or in which order, only when.
pub(crate) struct Writer {
    pub(super) tx: Mutex<std::sync::mpsc::Sender<Job>>,
    pub(super) gate: Arc<Gate>,
}

/// Holds and demands on the writer (see [`Writer`]).
#[derive(Debug, Default)]
pub(super) struct Gate {
    pub(super) state: Mutex<GateState>,
    pub(super) changed: Condvar,
}

#[derive(Debug, Default)]
pub(super) struct GateState {
    /// Live [`WriterHold`]s.
    pub(super) holds: usize,
    /// Stores waiting for the writer now.
    pub(super) demand: usize,
}

impl Gate {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Block while held and nobody waits for the writer.
    pub(super) fn pass(&self) {
        let mut st = self.lock();
        while st.holds > 0 && st.demand == 0 {
            st = self
                .changed
                .wait_timeout(st, std::time::Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    pub(super) fn add(&self, holds: isize, demand: isize) {
        let mut st = self.lock();
        st.holds = st.holds.saturating_add_signed(holds);
        st.demand = st.demand.saturating_add_signed(demand);
        drop(st);
        self.changed.notify_all();
    }
}

/// Keeps the [`Writer`] from starting batches nobody waits for, until dropped.
pub(crate) struct WriterHold {
    pub(super) gate: Arc<Gate>,
}

impl Drop for WriterHold {
    fn drop(&mut self) {
        self.gate.add(-1, 0);
    }
}

/// A store waiting for the writer: overrides holds until dropped.
pub(super) struct Demand<'a>(&'a Gate);

impl Drop for Demand<'_> {
    fn drop(&mut self) {
        self.0.add(0, -1);
    }
}

impl Writer {
    /// Start the writer thread; it ends when the last handle is dropped.
    ///
    /// # Panics
    /// When the OS refuses to start a thread.
    pub(crate) fn spawn() -> Arc<Writer> {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let gate = Arc::new(Gate::default());
        let g = gate.clone();
        std::thread::Builder::new()
            .name("onceflow-state-writer".into())
            .spawn(move || {
                lower_thread_priority();
                for job in rx {
                    g.pass();
                    write_job(job);
                }
            })
            .expect("spawn the state writer thread");
        Arc::new(Writer {
            tx: Mutex::new(tx),
            gate,
        })
    }

    /// Hold the writer back until the returned guard is dropped (see [`Writer`]).
    pub(crate) fn hold(&self) -> WriterHold {
        self.gate.add(1, 0);
        WriterHold {
            gate: self.gate.clone(),
        }
    }

    #[cfg(test)]
    /// Whether any [`WriterHold`] is alive.
    pub(crate) fn is_held(&self) -> bool {
        self.gate.lock().holds > 0
    }

    pub(super) fn demand(&self) -> Demand<'_> {
        self.gate.add(0, 1);
        Demand(&self.gate)
    }

    pub(super) fn submit(&self, job: Job) -> std::result::Result<(), ()> {
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| ())
    }
}

#[cfg(target_os = "linux")]
pub(super) fn lower_thread_priority() {
    // SAFETY: plain syscalls on this thread's own id; a failure only keeps the priority.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn lower_thread_priority() {}

pub(super) fn write_job(job: Job) {
    let n = job.ops.len();
    let mut at: usize = 0;
    loop {
        let end = at.saturating_add(WRITE_CHUNK).min(n);
        let last = end == n;
        {
            let mut st = job.shared.lock();
            if st.stopped || st.error.is_some() {
                return;
            }
            st.busy = true;
        }
        if let Some(hook) = BEFORE_CHUNK.get() {
            hook();
        }
        let offset = if last { job.changelog_offset } else { None };
        // The count after this chunk, stored with it: always consistent with the data.
        let count = job.count.as_ref().map(|(base, deltas)| {
            let d: i64 = deltas[..end].iter().map(|d| i64::from(*d)).sum();
            Counted {
                after: base.saturating_add_signed(d),
                deltas: &deltas[at..end],
            }
        });
        let result = job
            .engine
            .write_ops(&job.ops.slices(at..end), offset, count);
        let mut st = job.shared.lock();
        st.busy = false;
        if let Err(e) = result {
            st.error = Some(e.to_string());
        } else if last {
            st.persisted = job.seq;
        }
        drop(st);
        job.shared.changed.notify_all();
        if last {
            return;
        }
        at = end;
    }
}
