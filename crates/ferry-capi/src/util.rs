//! Checked conversions of C arguments.

use crate::status::*;
use std::ffi::{c_char, CStr};

/// A borrowed UTF-8 string from a C pointer.
///
/// # Safety
/// `p` is null or a NUL-terminated string that outlives the call.
pub(crate) unsafe fn cstr<'a>(p: *const c_char, what: &str) -> Result<&'a str, ferry_status> {
    if p.is_null() {
        return Err(fail(FERRY_ERR_INVALID_ARGUMENT, format!("{what} is null")));
    }
    CStr::from_ptr(p)
        .to_str()
        .map_err(|_| fail(FERRY_ERR_INVALID_ARGUMENT, format!("{what} is not UTF-8")))
}

/// Writes `v` through an out-pointer.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
pub(crate) unsafe fn out<T>(p: *mut T, v: T) -> Result<(), ferry_status> {
    if p.is_null() {
        return Err(fail(FERRY_ERR_INVALID_ARGUMENT, "an output pointer is null"));
    }
    p.write(v);
    Ok(())
}

/// A slice from a C pointer and length (null allowed when `n` is 0).
///
/// # Safety
/// `p` is valid for `n` reads of `T` when `n > 0`.
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], ferry_status> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(fail(
            FERRY_ERR_INVALID_ARGUMENT,
            format!("{what} is null with length {n}"),
        ));
    }
    Ok(std::slice::from_raw_parts(p, n))
}
