//! The runtime: start-up (from the `FERRY_*` environment), ranks, wait, statistics, finalize.

use crate::registry::{self, Object};
use crate::status::*;
use crate::util::out;
use std::ffi::c_char;
use std::sync::Arc;

/// A runtime handle (0: none).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_runtime {
    /// Opaque id.
    pub id: u64,
}

/// Starts ferry on this rank, configured by the `FERRY_*` environment variables (see
/// `docs/configuration.md`): the MPI progress thread, the CPU workers and the devices.
///
/// If the caller has initialised MPI, ferry uses it — it must provide `MPI_THREAD_MULTIPLE`
/// (`FERRY_ERR_MPI` otherwise) — and leaves it initialised when finalized; otherwise ferry
/// initialises MPI and finalizes it in `ferry_finalize` (MPI can then not be started again in
/// this process). Collective: every rank calls it.
///
/// # Safety
/// `out_rt` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_init(out_rt: *mut ferry_runtime) -> ferry_status {
    guard(|| {
        if out_rt.is_null() {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "out_rt is null");
        }
        match rt::Runtime::builder().from_env().build() {
            Ok(r) => {
                let id = registry::insert(Object::Runtime(Arc::new(r)));
                match out(out_rt, ferry_runtime { id }) {
                    Ok(()) => FERRY_OK,
                    Err(s) => s,
                }
            }
            Err(e) => from_error(&e),
        }
    })
}

/// Waits for outstanding work, stops ferry's threads and releases the runtime and every
/// collection and class created with it (their handles become invalid). Collective.
#[no_mangle]
pub extern "C" fn ferry_finalize(runtime: ferry_runtime) -> ferry_status {
    guard(|| {
        let Some(rt) = registry::remove_runtime(runtime.id) else {
            return fail(
                FERRY_ERR_INVALID_HANDLE,
                format!("{} is not a live ferry_runtime", runtime.id),
            );
        };
        let r = rt.shutdown();
        // Task classes hold closures only; the runtime itself goes when the last clone does.
        drop(rt);
        match r {
            Ok(()) => FERRY_OK,
            Err(e) => from_error(&e),
        }
    })
}

/// This rank and the number of ranks.
///
/// # Safety
/// `rank` and `size` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_rank(runtime: ferry_runtime, rank: *mut i32, size: *mut i32) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        match (out(rank, rt.rank()), out(size, rt.size() as i32)) {
            (Ok(()), Ok(())) => FERRY_OK,
            (Err(s), _) | (_, Err(s)) => s,
        }
    })
}

/// Returns when every task inserted so far has run on every rank; reports the first error of
/// the run. Collective.
#[no_mangle]
pub extern "C" fn ferry_wait(runtime: ferry_runtime) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        match rt.wait() {
            Ok(()) => FERRY_OK,
            Err(e) => from_error(&e),
        }
    })
}

/// This rank's statistics as JSON (tasks per class, bytes and messages per path, devices):
/// writes at most `len` bytes including the NUL into `buf`, and the size needed (with the NUL)
/// into `needed`; `FERRY_ERR_BUFFER_TOO_SMALL` when it did not fit (call again with `needed`).
///
/// # Safety
/// `buf` must be valid for `len` bytes of writes (or null with `len` 0); `needed` for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_stats_json(
    runtime: ferry_runtime,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        let json = match serde_json::to_string(&rt.stats()) {
            Ok(j) => j,
            Err(e) => return fail(FERRY_ERR_INTERNAL, e.to_string()),
        };
        let n = json.len() + 1;
        if let Err(s) = out(needed, n) {
            return s;
        }
        if buf.is_null() || len < n {
            return fail(FERRY_ERR_BUFFER_TOO_SMALL, format!("the statistics need {n} bytes"));
        }
        // SAFETY: the caller promises `len >= n` writable bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf as *mut u8, json.len());
            *buf.add(json.len()) = 0;
        }
        FERRY_OK
    })
}
