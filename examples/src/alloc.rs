//! A counting global allocator for the drivers: bytes of heap memory alive now and at peak, so
//! that a driver can report the host memory an operation added (e.g. a checkpoint) from the
//! allocator's own statistics.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting. Install with `#[global_allocator] static A: Counting = Counting;`.
pub struct Counting;

// SAFETY: forwards to the system allocator; the counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let now = CURRENT.fetch_add(l.size() as u64, Relaxed) + l.size() as u64;
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        CURRENT.fetch_sub(l.size() as u64, Relaxed);
        System.dealloc(p, l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(l);
        if !p.is_null() {
            let now = CURRENT.fetch_add(l.size() as u64, Relaxed) + l.size() as u64;
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            let now = if new >= l.size() {
                CURRENT.fetch_add((new - l.size()) as u64, Relaxed) + (new - l.size()) as u64
            } else {
                CURRENT.fetch_sub((l.size() - new) as u64, Relaxed) - (l.size() - new) as u64
            };
            PEAK.fetch_max(now, Relaxed);
        }
        q
    }
}

/// Starts a measurement: the peak restarts from the bytes alive now, which are returned.
pub fn start() -> u64 {
    let now = CURRENT.load(Relaxed);
    PEAK.store(now, Relaxed);
    now
}

/// Most bytes alive since [`start`] returned `base`, above `base`.
pub fn added_since(base: u64) -> u64 {
    PEAK.load(Relaxed).saturating_sub(base)
}
