//! The trace clock: µs since ferry's per-rank trace file began, the `ts` of its events. The
//! runtime starts it when it opens the trace file; the layers that place their own events on
//! the trace (the GPU manager's stream timeline) read it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// When ferry's trace layer began (its timestamps count from here).
static ORIGIN: OnceLock<Instant> = OnceLock::new();
/// Whether ferry's own trace layer is installed and writing (not the application's subscriber).
static RUNNING: AtomicBool = AtomicBool::new(false);

/// The trace clock, µs; `None` when ferry writes no trace file.
pub fn now_us() -> Option<f64> {
    if !RUNNING.load(Ordering::Acquire) {
        return None;
    }
    ORIGIN.get().map(|o| o.elapsed().as_secs_f64() * 1e6)
}

/// Sets the clock's origin to now, as the trace layer is built (once per process: the global
/// subscriber is installed once).
pub fn set_origin() {
    let _ = ORIGIN.set(Instant::now());
}

/// Marks the trace file as written (`true`) or closed (`false`): [`now_us`] reads the clock
/// only while it is written, so that work is not timed for a trace that no one writes.
pub fn set_running(on: bool) {
    RUNNING.store(on, Ordering::Release);
}

/// Starts the clock without a trace file, for unit tests of code that places events on it (each
/// test runs in its own process under cargo-nextest).
#[doc(hidden)]
pub fn start_for_tests() {
    ORIGIN.get_or_init(Instant::now);
    set_running(true);
}
