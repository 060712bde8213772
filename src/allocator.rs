//! onceflow's global allocator (feature `mimalloc`): mimalloc, plus one thing it does for
//! sled.
//!
//! sled 0.34 keeps process-wide metric histograms: 41 of them, each 65,536 counters of 8
//! bytes, allocated and zero-filled on the first database opened in the process, even
//! with its metrics compiled out (its default `no_metrics` feature, which onceflow keeps:
//! no counter is ever written after that). That is 20.5 MiB of resident zeros, about a
//! tenth of the onceflow side's peak in `scripts/bench` (`heaptrack`, README). While the
//! first sled database is opened ([`first_sled_open`]), this allocator notes the
//! allocations (zeroed or not: the compiler may turn sled's allocate-then-fill-with-zeros
//! into a zeroed allocation, which mimalloc fills when it reuses memory) of a histogram's
//! exact size and alignment made on that thread; once sled
//! returns, if there are exactly 41 and every byte is still zero, their pages are handed
//! back to the kernel (`madvise(MADV_DONTNEED)`: they read as zeros again, as they
//! were). Anything else (another count, a non-zero byte, another thread that opened sled
//! first) leaves memory as it is.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Bytes of one sled histogram: 65,536 counters of 8 bytes (`sled::histogram`).
const HISTOGRAM_BYTES: usize = 65_536 * 8;
/// Alignment of a histogram's counters (`Vec<AtomicUsize>`).
const HISTOGRAM_ALIGN: usize = std::mem::align_of::<AtomicUsize>();
/// Histograms in sled 0.34's `Metrics`.
const HISTOGRAMS: usize = 41;

thread_local! {
    /// Whether this thread is opening the process's first sled database.
    static NOTING: Cell<bool> = const { Cell::new(false) };
}

/// Addresses of the histogram-sized allocations noted (the first [`HISTOGRAMS`] + 1).
static NOTED: [AtomicUsize; HISTOGRAMS + 1] = [const { AtomicUsize::new(0) }; HISTOGRAMS + 1];
/// How many histogram-sized allocations were noted (may exceed [`NOTED`]'s length).
static NOTED_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Whether the first sled open has been claimed (only it notes allocations).
static CLAIMED: AtomicBool = AtomicBool::new(false);
/// Bytes handed back to the kernel by [`first_sled_open`].
static RELEASED: AtomicUsize = AtomicUsize::new(0);

/// mimalloc, noting histogram-sized allocations while [`NOTING`] is set (see the module
/// doc). Every call is mimalloc's; the check costs a size comparison.
pub(crate) struct Allocator;

// SAFETY: every method forwards to mimalloc with the caller's arguments; noting an address
// neither allocates nor touches the memory.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { mimalloc::MiMalloc.alloc(layout) };
        if layout.size() == HISTOGRAM_BYTES && layout.align() == HISTOGRAM_ALIGN {
            note(p);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) };
        if layout.size() == HISTOGRAM_BYTES && layout.align() == HISTOGRAM_ALIGN {
            note(p);
        }
        p
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as received.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
}

fn note(p: *mut u8) {
    // `try_with`: a thread being torn down has no flag, and notes nothing.
    if p.is_null() || !NOTING.try_with(Cell::get).unwrap_or(false) {
        return;
    }
    let i = NOTED_COUNT.fetch_add(1, Ordering::Relaxed);
    if let Some(slot) = NOTED.get(i) {
        slot.store(p as usize, Ordering::Relaxed);
    }
}

/// Run `open` (the opening of a sled database); the first call in the process hands
/// sled's metric histograms back to the kernel afterwards (see the module doc). Later
/// calls, and calls racing the first on other threads, just run `open`.
pub(crate) fn first_sled_open<T>(open: impl FnOnce() -> T) -> T {
    if CLAIMED.swap(true, Ordering::AcqRel) {
        return open();
    }
    NOTING.with(|n| n.set(true));
    let out = open();
    NOTING.with(|n| n.set(false));
    let released = release_noted();
    RELEASED.store(released, Ordering::Relaxed);
    if released > 0 {
        tracing::debug!(
            bytes = released,
            "sled's unused metric histograms handed back"
        );
    }
    out
}

/// Bytes of sled's metric histograms handed back to the kernel in this process (0 before
/// the first sled open, or when the check in the module doc left them alone).
pub(crate) fn sled_histogram_bytes_released() -> usize {
    RELEASED.load(Ordering::Relaxed)
}

/// Hand back the pages of the noted allocations when they are exactly sled's histograms,
/// all zeros; returns the bytes handed back.
fn release_noted() -> usize {
    if NOTED_COUNT.load(Ordering::Relaxed) != HISTOGRAMS {
        return 0;
    }
    let blocks: Vec<usize> = NOTED[..HISTOGRAMS]
        .iter()
        .map(|a| a.load(Ordering::Relaxed))
        .collect();
    // SAFETY: each address is a live allocation of HISTOGRAM_BYTES (sled's histograms are
    // in a process-wide static, never freed), aligned for AtomicUsize; read atomically.
    let all_zero = blocks.iter().all(|&p| {
        let counters =
            unsafe { std::slice::from_raw_parts(p as *const AtomicUsize, HISTOGRAM_BYTES / 8) };
        counters.iter().all(|c| c.load(Ordering::Relaxed) == 0)
    });
    if !all_zero {
        return 0;
    }
    // SAFETY: sysconf takes no pointers.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => return 0,
    };
    let mut released = 0;
    for p in blocks {
        // Only whole pages inside the block: its neighbours keep theirs.
        let start = p.next_multiple_of(page);
        let end = (p + HISTOGRAM_BYTES) / page * page;
        if end <= start {
            continue;
        }
        // SAFETY: [start, end) lies inside one live, all-zero allocation that nothing
        // writes (sled's counters, metrics compiled out); MADV_DONTNEED on private
        // anonymous memory leaves it reading as zeros.
        let r =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        if r == 0 {
            released += end - start;
        }
    }
    released
}
