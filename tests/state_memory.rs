//! Memory that sled takes and never uses is handed back. A test binary of its own: what it
//! checks happens on the first sled database opened in the process.

/// The process's resident set, in KiB (`VmRSS` of /proc/self/status).
fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line")
}

/// sled 0.34 zero-fills 41 metric histograms of 512 KiB on its first open, even with its
/// metrics compiled out; onceflow's allocator hands their pages back (src/allocator.rs).
#[cfg(all(feature = "mimalloc", target_os = "linux"))]
#[test]
fn the_first_sled_open_hands_back_sleds_unused_metric_histograms() {
    const HISTOGRAM: u64 = 512 * 1024;
    let dir = tempfile::tempdir().expect("a temporary state dir");
    assert_eq!(onceflow::__testkit::sled_histogram_bytes_released(), 0);
    let before = vm_rss_kib();
    onceflow::__testkit::read_state(dir.path(), "dedup", Some(0), &[]).expect("sled opens");
    let grown_kib = vm_rss_kib().saturating_sub(before);
    let released = onceflow::__testkit::sled_histogram_bytes_released() as u64;
    eprintln!("resident set grew by {grown_kib} KiB; {released} bytes handed back");
    // Every histogram, bar at most a page at each end where it shares a page.
    assert!(
        released >= 41 * (HISTOGRAM - 8 * 1024),
        "only {released} bytes of sled's 41 histograms were handed back"
    );
    // Opening sled grew it by ~34 MiB with the histograms (20.5 MiB) resident, ~13 without.
    assert!(
        grown_kib < 20 * 1024,
        "the resident set grew by {grown_kib} KiB on opening sled"
    );
}
