//! A cache prefetch hint: loops over many records or keys fetch what a later step reads
//! (a hash table slot, a consumed message) while they work on the current one.

/// Hint that the cache line at `p` is read soon. Never faults and changes nothing the
/// program sees, whatever `p` is; a no-op off x86-64.
#[inline]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults, whatever the
    // address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
