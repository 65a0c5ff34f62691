//! Two calls a framework makes once its engine is up, from C: measuring its clock against rank
//! 0's (`ferry_engine_sync_clocks`, for merged traces: ferry's own and the framework's events
//! on one time line), and handing the progress loop's driving to its own threads after
//! start-up (`ferry_engine_share_progress`: a runtime that learns only then that its ranks share
//! cores). `EngineHandle::sync_clocks` and `EngineHandle::share_progress` in `ferry-engine`.

use crate::engine::{ferry_engine, with};
use crate::status::*;
use crate::util::out;
use eng::EngineError;
use std::sync::Mutex;
use std::time::Duration;

/// This rank's clock against rank 0's at one instant, µs (`ferry_engine_sync_clocks`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ferry_clock_pair {
    /// This rank's clock, µs.
    pub local_us: f64,
    /// Rank 0's clock at the same instant, µs: add `rank0_us - local_us` to this rank's times
    /// to put them on rank 0's clock.
    pub rank0_us: f64,
    /// Round trip of the sample kept, µs: the pair is uncertain by half of it (0 on rank 0).
    pub rtt_us: f64,
}

/// A clock: µs from any fixed origin of the caller's choice, monotonic.
#[allow(non_camel_case_types)]
pub type ferry_clock_fn = Option<unsafe extern "C" fn() -> f64>;

/// The C clock of the `ferry_engine_sync_clocks` call in progress (`None`: the default clock).
/// The engine takes a plain function, which cannot carry the C pointer: the call parks it
/// here, under [`ONE_AT_A_TIME`], for the duration.
static CLOCK: Mutex<ferry_clock_fn> = Mutex::new(None);
/// One `ferry_engine_sync_clocks` of the process at a time (its clock sits in [`CLOCK`]).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The clock the engine reads during a call: the caller's, or the monotonic clock in µs.
fn read_clock() -> f64 {
    if let Some(f) = *CLOCK.lock().unwrap_or_else(|e| e.into_inner()) {
        // SAFETY: the caller's clock, as documented.
        return unsafe { f() };
    }
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3
}

/// Measures this rank's clock against rank 0's by a ping-pong with it that keeps the sample of
/// the shortest round trip (Cristian's algorithm: F. Cristian, "Probabilistic clock
/// synchronization", Distributed Computing 3, 1989), and writes the pair to `out_pair`.
/// `now_us`: the clock to measure, µs (NULL: the monotonic clock, `CLOCK_MONOTONIC`); it runs on
/// whichever thread drives the engine's loop during the call. Collective: every rank calls it,
/// with nothing else in flight (it holds the progress loop while it runs). Not from a callback.
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` (null `out_pair`, checked before anything is sent: pass
/// it on every rank alike), `FERRY_ERR_INVALID_HANDLE`, `FERRY_ERR_MPI`.
///
/// # Safety
/// `out_pair` is valid for a write; `now_us`, when given, may be called from another thread.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_sync_clocks(
    engine: ferry_engine,
    now_us: ferry_clock_fn,
    out_pair: *mut ferry_clock_pair,
) -> ferry_status {
    if out_pair.is_null() {
        return fail(FERRY_ERR_INVALID_ARGUMENT, "out_pair is null");
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    *CLOCK.lock().unwrap_or_else(|e| e.into_inner()) = now_us;
    let mut pair = ferry_clock_pair::default();
    let status = with(engine, |h| {
        let p = h.sync_clocks(read_clock)?;
        pair = ferry_clock_pair {
            local_us: p.local_us,
            rank0_us: p.rank0_us,
            rtt_us: p.rtt_us,
        };
        Ok(())
    });
    *CLOCK.lock().unwrap_or_else(|e| e.into_inner()) = None;
    if status != FERRY_OK {
        return status;
    }
    match out(out_pair, pair) {
        Ok(()) => FERRY_OK,
        Err(s) => s,
    }
}

/// Longest backstop tick of `ferry_engine_share_progress`, µs.
const BACKSTOP_MAX_US: i64 = 1_000_000;

/// Hands the driving of the engine's progress loop to the threads that call
/// `ferry_engine_progress` (and the collectives), keeping the engine's thread as a backstop that
/// drives when nobody has for `backstop_us` (≤ 0: 200; at most 1,000,000): what
/// `FERRY_PROGRESS_SHARED` does from the start, for an engine started with
/// `FERRY_PROGRESS_THREAD` and `share_later` = 1. For ranks whose threads outnumber their
/// cores: the thread that waits for a message polls for it. A second call is a no-op (the loop
/// stays shared with the first backstop).
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` (a backstop over 1 s; an engine whose caller drives its
/// loop, `FERRY_PROGRESS_CALLER`), `FERRY_ERR_CONFIG` (started without `share_later`, or MPI
/// below `MPI_THREAD_SERIALIZED`), `FERRY_ERR_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn ferry_engine_share_progress(engine: ferry_engine, backstop_us: i64) -> ferry_status {
    if backstop_us > BACKSTOP_MAX_US {
        return fail(
            FERRY_ERR_INVALID_ARGUMENT,
            format!("backstop {backstop_us} µs (at most {BACKSTOP_MAX_US})"),
        );
    }
    let us = if backstop_us <= 0 { 200 } else { backstop_us as u64 };
    with(engine, |h| {
        h.share_progress(Duration::from_micros(us)).map(drop)?;
        Ok::<(), EngineError>(())
    })
}
