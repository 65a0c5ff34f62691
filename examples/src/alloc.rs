//! A counting global allocator for the drivers: the heap bytes an operation adds (e.g. a
//! checkpoint), so that a driver can report them from the allocator's own figures.
//!
//! The count runs only inside [`measure`]: outside, an allocation costs one relaxed load more than
//! the underlying allocator alone. (Counting always updated two counters
//! shared by every thread on every allocation: their cache line moved between cores all the time.)
//!
//! Underneath is mimalloc, not the system allocator. ferry's threads hand objects to each other by
//! design: a received tile's copy, its graph node and its completion callbacks are made on the
//! inserting or the MPI thread and freed on the GPU manager. glibc's allocator serves such a free
//! under the allocating thread's arena lock, which that thread holds for its own allocations: a
//! profile of the IPC consumer's GPU manager on 2× H200 had 14% of its samples in `free`, a third
//! of them waiting on that lock, and mimalloc (a per-thread heap, remote frees pushed without a
//! lock) moved IPC 1 MiB × 8 per round from 94–102 to 113–125 GB/s, four pairs of four. On one H100 shared by two ranks under
//! MPS, where the frees were mostly the driver's own, it had measured slower.

use mimalloc::MiMalloc;
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::Relaxed};
use std::sync::Mutex;

/// Whether a measurement is running.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Bytes allocated minus bytes freed since the measurement started (frees of older blocks make
/// it negative).
static DELTA: AtomicI64 = AtomicI64::new(0);
/// The largest `DELTA` since the measurement started.
static PEAK: AtomicI64 = AtomicI64::new(0);
/// One measurement at a time.
static MEASURING: Mutex<()> = Mutex::new(());

/// mimalloc, counting inside [`measure`]. Install with
/// `#[global_allocator] static A: ferry_examples::alloc::Counting = ferry_examples::alloc::Counting;`.
pub struct Counting;

impl Counting {
    fn added(bytes: usize) {
        if ACTIVE.load(Relaxed) {
            let now = DELTA.fetch_add(bytes as i64, Relaxed) + bytes as i64;
            PEAK.fetch_max(now, Relaxed);
        }
    }

    fn removed(bytes: usize) {
        if ACTIVE.load(Relaxed) {
            DELTA.fetch_sub(bytes as i64, Relaxed);
        }
    }
}

// SAFETY: forwards every call to mimalloc with the same arguments; the counters are plain atomics
// and never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { MiMalloc.alloc(l) };
        if !p.is_null() {
            Self::added(l.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        Self::removed(l.size());
        // SAFETY: the caller's contract, forwarded.
        unsafe { MiMalloc.dealloc(p, l) }
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { MiMalloc.alloc_zeroed(l) };
        if !p.is_null() {
            Self::added(l.size());
        }
        p
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let q = unsafe { MiMalloc.realloc(p, l, new) };
        if !q.is_null() {
            if new >= l.size() {
                Self::added(new - l.size());
            } else {
                Self::removed(l.size() - new);
            }
        }
        q
    }
}

/// Runs `f` and returns its result with the most heap bytes alive at any moment during it above
/// those alive when it started, over every thread of the process (blocks allocated before and
/// freed during `f` count against it). Measurements run one at a time (a second call waits);
/// only meaningful where [`Counting`] is the global allocator (0 otherwise).
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, u64) {
    /// Ends the count however `f` ends (a panic must not leave every allocation counting).
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            ACTIVE.store(false, Relaxed);
        }
    }
    let _one = MEASURING.lock().unwrap_or_else(|p| p.into_inner());
    DELTA.store(0, Relaxed);
    PEAK.store(0, Relaxed);
    ACTIVE.store(true, Relaxed);
    let r = {
        let _stop = Stop;
        f()
    };
    (r, PEAK.load(Relaxed).max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    // This test binary's allocator, so that `measure` sees its allocations.
    #[global_allocator]
    static ALLOC: Counting = Counting;

    /// The peak above the start, not the net: a block freed inside still counts at its peak; a
    /// block allocated before and freed inside does not make the figure negative; nothing is
    /// counted outside a measurement.
    #[test]
    fn measure_reports_the_peak_added_inside_only() {
        let (v, added) = measure(|| vec![1u8; 1 << 20]);
        assert!(added >= 1 << 20, "a 1 MiB vector added {added} bytes");
        let (_, added) = measure(|| {
            let a = vec![2u8; 3 << 20];
            drop(a);
            let b = vec![3u8; 1 << 20];
            b.len()
        });
        assert!(added >= 3 << 20, "the 3 MiB peak was lost: {added}");
        assert!(added < 4 << 20, "freed blocks still counted: {added}");
        let (_, added) = measure(|| drop(v));
        assert_eq!(added, 0, "a free alone adds nothing");
        let before = PEAK.load(Relaxed);
        let _outside = vec![4u8; 2 << 20];
        assert_eq!(PEAK.load(Relaxed), before, "counted outside a measurement");
    }
}
