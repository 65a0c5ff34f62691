//! Status codes, the per-thread error message, and the guard that keeps Rust panics and errors
//! from crossing the ABI.

use std::cell::RefCell;
use std::ffi::{c_char, CString};

/// The outcome of a call.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ferry_status {
    /// Success.
    FERRY_OK = 0,
    /// A null pointer, an empty or non-UTF-8 name, a size or index out of range.
    FERRY_ERR_INVALID_ARGUMENT = 1,
    /// A handle that is not (or no longer) a live object of the expected kind.
    FERRY_ERR_INVALID_HANDLE = 2,
    /// An invalid configuration (`FERRY_*` variables) or a transfer path a pair cannot use.
    FERRY_ERR_CONFIG = 3,
    /// MPI could not be initialised or used (including a caller's MPI below MPI_THREAD_MULTIPLE).
    FERRY_ERR_MPI = 4,
    /// A device (CUDA or emulated) failed or is absent.
    FERRY_ERR_DEVICE = 5,
    /// A task body returned non-zero (the message names the class and the task).
    FERRY_ERR_TASK_FAILED = 6,
    /// The ranks inserted different task sequences.
    FERRY_ERR_GRAPH_MISMATCH = 7,
    /// An earlier error ended the run; only finalize remains useful.
    FERRY_ERR_POISONED = 8,
    /// A bug in ferry (a panic caught at the ABI border).
    FERRY_ERR_INTERNAL = 9,
    /// The output buffer is too small (the needed size was written).
    FERRY_ERR_BUFFER_TOO_SMALL = 10,
    /// A checkpoint could not be written, or the one to restore is missing, truncated, corrupt,
    /// of another format version, or does not match the collections given.
    FERRY_ERR_CHECKPOINT = 11,
    /// The disk tier failed (its spill space is full, or a spill file could not be written).
    FERRY_ERR_SPILL = 12,
    /// A file ferry writes for the caller (a trace in `FERRY_TRACE_DIR`) could not be created
    /// or written; the message names it and the cause.
    FERRY_ERR_IO = 13,
    /// A memory registration still in use by operations in flight (nothing changed).
    FERRY_ERR_BUSY = 14,
    /// The peer refused a one-sided operation (a stale or unregistered handle there); the
    /// message gives its reason.
    FERRY_ERR_REMOTE = 15,
}

pub use ferry_status::*;

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last error and returns `status`.
pub(crate) fn fail(status: ferry_status, msg: impl Into<String>) -> ferry_status {
    let s = msg.into().replace('\0', " ");
    LAST.with(|l| *l.borrow_mut() = CString::new(s).unwrap_or_default());
    status
}

/// The status of a runtime error.
pub(crate) fn from_error(e: &rt::FerryError) -> ferry_status {
    use rt::FerryError as E;
    let status = match e {
        E::Config(_) => FERRY_ERR_CONFIG,
        E::MpiInit(_) | E::Mpi { .. } | E::SizeMismatch { .. } | E::Protocol { .. } | E::ThreadLost(_) => FERRY_ERR_MPI,
        E::GraphMismatch(_) | E::TraceMismatch { .. } => FERRY_ERR_GRAPH_MISMATCH,
        E::InvalidArgument(_) | E::TileOutOfBounds { .. } => FERRY_ERR_INVALID_ARGUMENT,
        E::TaskFailed { .. } => FERRY_ERR_TASK_FAILED,
        E::Poisoned(_) | E::Watchdog { .. } => FERRY_ERR_POISONED,
        E::Device(_) => FERRY_ERR_DEVICE,
        E::Checkpoint { .. } => FERRY_ERR_CHECKPOINT,
        E::Spill { .. } => FERRY_ERR_SPILL,
        E::Io { .. } => FERRY_ERR_IO,
        _ => FERRY_ERR_INTERNAL,
    };
    fail(status, e.to_string())
}

/// Runs `f`, turning a panic into `FERRY_ERR_INTERNAL` (a panic must never unwind into C).
pub(crate) fn guard(f: impl FnOnce() -> ferry_status) -> ferry_status {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(s) => s,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into());
            fail(FERRY_ERR_INTERNAL, format!("internal error (please report): {msg}"))
        }
    }
}

/// The calling thread's message for its last failed call (empty if none); valid until the
/// thread's next failing call.
#[no_mangle]
pub extern "C" fn ferry_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// A static name for a status value (`"FERRY_ERR_INVALID_HANDLE"`; `"unknown ferry_status"` for
/// any other integer).
#[no_mangle]
pub extern "C" fn ferry_status_name(status: i32) -> *const c_char {
    let all = [
        FERRY_OK,
        FERRY_ERR_INVALID_ARGUMENT,
        FERRY_ERR_INVALID_HANDLE,
        FERRY_ERR_CONFIG,
        FERRY_ERR_MPI,
        FERRY_ERR_DEVICE,
        FERRY_ERR_TASK_FAILED,
        FERRY_ERR_GRAPH_MISMATCH,
        FERRY_ERR_POISONED,
        FERRY_ERR_INTERNAL,
        FERRY_ERR_BUFFER_TOO_SMALL,
        FERRY_ERR_CHECKPOINT,
        FERRY_ERR_SPILL,
        FERRY_ERR_IO,
        FERRY_ERR_BUSY,
        FERRY_ERR_REMOTE,
    ];
    let Some(&status) = all.iter().find(|&&s| s as i32 == status) else {
        return c"unknown ferry_status".as_ptr();
    };
    let s: &'static std::ffi::CStr = match status {
        FERRY_OK => c"FERRY_OK",
        FERRY_ERR_INVALID_ARGUMENT => c"FERRY_ERR_INVALID_ARGUMENT",
        FERRY_ERR_INVALID_HANDLE => c"FERRY_ERR_INVALID_HANDLE",
        FERRY_ERR_CONFIG => c"FERRY_ERR_CONFIG",
        FERRY_ERR_MPI => c"FERRY_ERR_MPI",
        FERRY_ERR_DEVICE => c"FERRY_ERR_DEVICE",
        FERRY_ERR_TASK_FAILED => c"FERRY_ERR_TASK_FAILED",
        FERRY_ERR_GRAPH_MISMATCH => c"FERRY_ERR_GRAPH_MISMATCH",
        FERRY_ERR_POISONED => c"FERRY_ERR_POISONED",
        FERRY_ERR_INTERNAL => c"FERRY_ERR_INTERNAL",
        FERRY_ERR_BUFFER_TOO_SMALL => c"FERRY_ERR_BUFFER_TOO_SMALL",
        FERRY_ERR_CHECKPOINT => c"FERRY_ERR_CHECKPOINT",
        FERRY_ERR_SPILL => c"FERRY_ERR_SPILL",
        FERRY_ERR_IO => c"FERRY_ERR_IO",
        FERRY_ERR_BUSY => c"FERRY_ERR_BUSY",
        FERRY_ERR_REMOTE => c"FERRY_ERR_REMOTE",
    };
    s.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file ferry could not write is an I/O status with the path and the cause in the
    /// message, not an internal error; every status has its name.
    #[test]
    fn io_errors_have_their_own_status() {
        let e = rt::FerryError::Io {
            path: "/no/such/dir/trace-rank0.json".into(),
            error: std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied"),
        };
        assert_eq!(from_error(&e), FERRY_ERR_IO);
        let msg = unsafe { std::ffi::CStr::from_ptr(ferry_last_error()) }
            .to_string_lossy()
            .into_owned();
        assert!(
            msg.contains("/no/such/dir/trace-rank0.json") && msg.contains("denied"),
            "{msg}"
        );
        for s in 0..=FERRY_ERR_REMOTE as i32 {
            let name = unsafe { std::ffi::CStr::from_ptr(ferry_status_name(s)) };
            assert!(name.to_bytes().starts_with(b"FERRY_"), "{s}: {name:?}");
        }
    }
}
