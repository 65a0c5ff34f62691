//! Device memory through the engine (`ferry_engine_alloc_device`, `_free_device`,
//! `_device_write`, `_device_read`): for C frameworks without an allocator of their own, and the
//! only way to get memory of the engine's emulated devices (shared host memory that peers of the
//! node map, the stand-in for CUDA IPC), so that a framework's device path runs where CI has no
//! GPU. On CUDA devices the memory is an ordinary `cuMemAlloc` allocation of that device.

use crate::engine::{engine_error, ferry_engine, object};
use crate::status::*;
use crate::util::out;
use std::ffi::c_void;

/// Allocates `len` bytes (> 0) of device memory on `device` and writes its address; register it
/// with `ferry_engine_register_device` like any device memory. It is freed by
/// `ferry_engine_free_device`, or after `ferry_engine_finalize`.
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` (0 bytes, `out_ptr` NULL), `FERRY_ERR_DEVICE` (no such
/// device, over the engine's device budget, a failed allocation), `FERRY_ERR_INVALID_HANDLE`.
///
/// # Safety
/// `out_ptr` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_alloc_device(
    engine: ferry_engine,
    device: u32,
    len: usize,
    out_ptr: *mut *mut c_void,
) -> ferry_status {
    guard(|| {
        let o = match object(engine) {
            Ok(o) => o,
            Err(s) => return s,
        };
        if len == 0 || out_ptr.is_null() {
            return fail(
                FERRY_ERR_INVALID_ARGUMENT,
                if len == 0 {
                    "0 bytes of device memory"
                } else {
                    "out_ptr is null"
                },
            );
        }
        match o.handle.alloc_device(device as usize, len) {
            Ok(b) => {
                let ptr = b.ptr();
                o.buffers.lock().unwrap_or_else(|p| p.into_inner()).insert(ptr, b);
                match out(out_ptr, ptr as *mut c_void) {
                    Ok(()) => FERRY_OK,
                    Err(s) => s,
                }
            }
            Err(e) => engine_error(&e),
        }
    })
}

/// Frees memory that `ferry_engine_alloc_device` returned. End its registrations first: the
/// engine does not check that none is left.
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` for an address that is not such an allocation (NULL, or
/// already freed); `FERRY_ERR_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn ferry_engine_free_device(engine: ferry_engine, ptr: *mut c_void) -> ferry_status {
    guard(|| {
        let o = match object(engine) {
            Ok(o) => o,
            Err(s) => return s,
        };
        let freed = o
            .buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(ptr as u64));
        match freed {
            Some(b) => {
                drop(b);
                FERRY_OK
            }
            None => fail(
                FERRY_ERR_INVALID_ARGUMENT,
                format!("{ptr:p} is not device memory from ferry_engine_alloc_device (or was freed)"),
            ),
        }
    })
}

/// Copies `len` bytes of host memory at `src` to device memory at `dst` on `device` and waits
/// for the copy (a blocking helper: not for a callback or handler).
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` (NULL pointers), `FERRY_ERR_DEVICE` (no such device, a
/// failed copy), `FERRY_ERR_INVALID_HANDLE`.
///
/// # Safety
/// `src` is valid for `len` reads; `dst..dst + len` is device memory of `device` that nothing
/// else uses meanwhile.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_device_write(
    engine: ferry_engine,
    device: u32,
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
) -> ferry_status {
    // SAFETY: the caller's promise above.
    unsafe { blocking_copy(engine, device, Dir::ToDevice, dst, src, len) }
}

/// Copies `len` bytes of device memory at `src` on `device` to host memory at `dst` and waits
/// (see `ferry_engine_device_write`).
///
/// # Safety
/// `dst` is valid for `len` writes; `src..src + len` is device memory of `device`.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_device_read(
    engine: ferry_engine,
    device: u32,
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
) -> ferry_status {
    // SAFETY: the caller's promise above.
    unsafe { blocking_copy(engine, device, Dir::ToHost, dst, src, len) }
}

enum Dir {
    ToDevice,
    ToHost,
}

/// The body of `ferry_engine_device_write` and `_read`.
///
/// # Safety
/// As theirs, for the direction `dir`.
unsafe fn blocking_copy(
    engine: ferry_engine,
    device: u32,
    dir: Dir,
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
) -> ferry_status {
    guard(|| {
        let o = match object(engine) {
            Ok(o) => o,
            Err(s) => return s,
        };
        if len == 0 {
            return FERRY_OK;
        }
        if src.is_null() || dst.is_null() {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "a null pointer");
        }
        let d = device as usize;
        // SAFETY: the caller's promise (host side valid for `len` bytes, device side device
        // memory of `device` nobody else uses meanwhile).
        let copied = unsafe {
            match dir {
                Dir::ToDevice => {
                    o.handle
                        .device_write(d, dst as u64, std::slice::from_raw_parts(src as *const u8, len))
                }
                Dir::ToHost => o
                    .handle
                    .device_read(d, src as u64, std::slice::from_raw_parts_mut(dst as *mut u8, len)),
            }
        };
        match copied {
            Ok(()) => FERRY_OK,
            Err(e) => engine_error(&e),
        }
    })
}
