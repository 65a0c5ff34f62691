//! Messages of unregistered memory and the outcome agreement, from C (`ferry_engine_send_bytes`,
//! `ferry_engine_recv_bytes`, `ferry_engine_agree`): what a framework that builds its own
//! transfer protocol on the engine needs beside registered put, get, send and receive (see
//! `EngineHandle::send_message` and `EngineHandle::agree` in `ferry-engine`).

use crate::engine::{completion, ferry_completion, ferry_engine, with};
use crate::status::*;
use crate::util::slice;
use eng::{EngineError, Lane, MemRegion, Message, TrafficPath};
use std::ffi::c_void;
use std::sync::Arc;

/// The data lane of `ferry_engine_send_bytes`: payloads (shared with `ferry_engine_send`).
pub const FERRY_LANE_DATA: i32 = 0;
/// The control lane: short protocol messages that must not match a payload's receive of the
/// same tag.
pub const FERRY_LANE_CONTROL: i32 = 1;

/// Messages up to this size count as eager host traffic in the counters, larger as rendezvous.
const EAGER_BYTES: usize = 8 << 10;

/// The caller's memory of a message: valid until its callback has run (the caller's promise).
struct CallerBytes {
    ptr: usize,
    len: usize,
}

// SAFETY: the caller's promise at `ferry_engine_send_bytes` / `ferry_engine_recv_bytes` (unsafe
// functions): valid for `len` bytes and untouched until the message's callback has run.
unsafe impl MemRegion for CallerBytes {
    fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn message(
    engine: ferry_engine,
    recv: bool,
    data: *mut c_void,
    len: usize,
    peer: i32,
    tag: i32,
    lane: i32,
    done: ferry_completion,
    user: *mut c_void,
) -> ferry_status {
    guard(|| {
        if len > 0 && data.is_null() {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "data is null");
        }
        let lane = match lane {
            FERRY_LANE_DATA => Lane::Data,
            FERRY_LANE_CONTROL => Lane::Control,
            other => {
                return fail(
                    FERRY_ERR_INVALID_ARGUMENT,
                    format!("lane {other} (FERRY_LANE_DATA or FERRY_LANE_CONTROL)"),
                )
            }
        };
        // A message fails with the communication layer's error: the engine's status of it.
        let done = completion(done, user);
        let done = Box::new(move |r: rt::Result<()>| done(r.map_err(EngineError::Comm)));
        with(engine, |h| {
            let m = Message {
                region: Arc::new(CallerBytes {
                    ptr: data as usize,
                    len,
                }),
                peer,
                tag,
                lane,
                path: if len <= EAGER_BYTES {
                    TrafficPath::HostEager
                } else {
                    TrafficPath::HostRendezvous
                },
                counts: true,
                // Through the send window: messages of one tag may differ in length, and an
                // eager one would overtake a queued one of the same tag.
                eager: false,
                done,
            };
            if recv {
                h.recv_message(m)
            } else {
                h.send_message(m)
            }
        })
    })
}

/// Sends `len` bytes at `data` to `peer` with `tag` (`0..=` the MPI library's `MPI_TAG_UB`) on
/// `lane` (`FERRY_LANE_DATA` or `FERRY_LANE_CONTROL`), with no registration; `done(status,
/// user)` runs once `data` may be reused. Messages of one (peer, lane, tag) are received in the
/// order they were sent, by receives in the order they were posted; the data lane is the one
/// `ferry_engine_send` uses (pick tags apart). `done` runs on the thread that runs the pass of
/// the progress loop that completed the message, whatever `options.completions` says: it must be
/// short and must not block. A message still in flight when the engine is finalized fails its
/// `done`, but MPI may still write a receive's `data` until MPI itself is finalized: keep it
/// until then.
///
/// Returns `FERRY_ERR_INVALID_ARGUMENT` for a null `data` with `len` > 0, an unknown lane, a
/// peer outside the job or a tag out of range (`done` then never runs),
/// `FERRY_ERR_INVALID_HANDLE` for an engine that is not live.
///
/// # Safety
/// `data` is valid for `len` bytes and untouched until `done` has run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_engine_send_bytes(
    engine: ferry_engine,
    data: *const c_void,
    len: usize,
    peer: i32,
    tag: i32,
    lane: i32,
    done: ferry_completion,
    user: *mut c_void,
) -> ferry_status {
    message(engine, false, data as *mut c_void, len, peer, tag, lane, done, user)
}

/// Receives a message of exactly `len` bytes from `peer` with `tag` on `lane` into `data`;
/// `done(status, user)` runs once its bytes have landed, with `FERRY_ERR_MPI` for a message of
/// another length. Errors and threading as `ferry_engine_send_bytes`.
///
/// # Safety
/// `data` is valid for `len` writes, and neither read nor written until `done` has run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_engine_recv_bytes(
    engine: ferry_engine,
    data: *mut c_void,
    len: usize,
    peer: i32,
    tag: i32,
    lane: i32,
    done: ferry_completion,
    user: *mut c_void,
) -> ferry_status {
    message(engine, true, data, len, peer, tag, lane, done, user)
}

/// Agrees on a step that each rank took on its own (collective; blocks, never from a
/// callback). Each rank passes `ok` (1 when its step succeeded, 0 when it failed) and `len`
/// bytes at `data`: its payload, or its error's text. When every rank succeeded, every rank's
/// payload lands in `out_data` (`len` × ranks bytes, in rank order; every rank must pass the
/// same `len`), `*out_failed_rank` is -1 and the call returns `FERRY_OK`. Otherwise it returns
/// `FERRY_ERR_REMOTE` on every rank, `*out_failed_rank` is the first rank that failed and
/// `ferry_last_error()` gives its text; `out_data` is untouched.
///
/// Also `FERRY_ERR_INVALID_ARGUMENT` (a null pointer, `ok` not 0 or 1, payloads of different
/// lengths), `FERRY_ERR_MPI` when the exchange fails.
///
/// # Safety
/// `data` is valid for `len` reads, `out_data` for `len` × ranks writes, `out_failed_rank` for
/// a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_agree(
    engine: ferry_engine,
    ok: i32,
    data: *const c_void,
    len: usize,
    out_data: *mut c_void,
    out_failed_rank: *mut i32,
) -> ferry_status {
    guard(|| {
        let bytes = match slice(data as *const u8, len, "data") {
            Ok(b) => b,
            Err(s) => return s,
        };
        if out_failed_rank.is_null() || (out_data.is_null() && len > 0) {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "out_data or out_failed_rank is null");
        }
        let mine = match ok {
            1 => Ok(bytes.to_vec()),
            0 => Err(String::from_utf8_lossy(bytes).into_owned()),
            other => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("ok = {other} (1 or 0)")),
        };
        with(engine, |h| match h.agree(&mine)? {
            Ok(all) => {
                if let Some((r, b)) = all.iter().enumerate().find(|(_, b)| b.len() != len) {
                    return Err(EngineError::InvalidArgument(format!(
                        "rank {r} gave {} bytes, this rank {len}",
                        b.len()
                    )));
                }
                // (`out_data` may be null when `len` is 0: nothing to copy then.)
                for (r, b) in all.iter().enumerate().filter(|_| len > 0) {
                    // SAFETY: the caller vouches for `len` × ranks bytes at `out_data`.
                    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), (out_data as *mut u8).add(r * len), len) };
                }
                // SAFETY: checked non-null above; the caller vouches for it.
                unsafe { *out_failed_rank = -1 };
                Ok(())
            }
            Err((r, reason)) => {
                // SAFETY: as above.
                unsafe { *out_failed_rank = r as i32 };
                Err(EngineError::Remote { peer: r as i32, reason })
            }
        })
    })
}
