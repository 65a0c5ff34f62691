//! Thin wrappers over the raw MPI calls the progress thread makes.
//!
//! rsmpi's safe requests tie buffers to Rust lifetimes; the progress loop instead owns its
//! buffers through [`super::MemRegion`] handles and keeps raw `MPI_Request`s in one array for
//! `MPI_Testsome`. Every function here must run on the MPI progress thread.

use ferry_base::error::{FerryError, Rank};
use mpi::ffi;
use std::os::raw::{c_char, c_int, c_void};

pub(super) type RawComm = ffi::MPI_Comm;
pub(super) type RawRequest = ffi::MPI_Request;
pub(super) type RawStatus = ffi::MPI_Status;

const SUCCESS: c_int = ffi::MPI_SUCCESS as c_int;
const ERR_IN_STATUS: c_int = ffi::MPI_ERR_IN_STATUS as c_int;

pub(super) fn null_request() -> RawRequest {
    // SAFETY: reading an initialised constant exported by the rsmpi shim.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn bytes_type() -> ffi::MPI_Datatype {
    // SAFETY: reading an initialised constant exported by the rsmpi shim.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// The MPI library's text for an error code.
pub(super) fn error_string(code: c_int) -> String {
    let mut buf = vec![0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: buf holds MPI_MAX_ERROR_STRING characters as the standard requires.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != SUCCESS {
        return format!("MPI error code {code}");
    }
    let bytes: Vec<u8> = buf[..len.max(0) as usize].iter().map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

pub(super) fn check(rc: c_int, op: &'static str, peer: Rank, tag: i32) -> Result<(), FerryError> {
    if rc == SUCCESS {
        Ok(())
    } else {
        Err(FerryError::Mpi {
            op,
            peer,
            tag,
            msg: error_string(rc),
        })
    }
}

/// What the library says about device pointers: `MPIX_Query_cuda_support()` when it exports
/// that function (Open MPI, MVAPICH), looked up with `dlsym` so that libraries without it (MPICH)
/// still link; `None` when absent. Open MPI built without CUDA says 0 even when a CUDA-enabled
/// UCX would take device pointers at run time (hence `FERRY_GPU_DIRECT=force`).
pub(super) fn query_cuda_support() -> Option<bool> {
    // SAFETY: dlsym on the global namespace; the symbol, when present, has this signature.
    unsafe {
        let f = libc::dlsym(libc::RTLD_DEFAULT, c"MPIX_Query_cuda_support".as_ptr());
        if f.is_null() {
            return None;
        }
        let f: extern "C" fn() -> c_int = std::mem::transmute(f);
        Some(f() == 1)
    }
}

/// Makes MPI errors on `comm` return codes instead of aborting, so ferry can report them.
pub(super) fn errors_return(comm: RawComm) -> Result<(), FerryError> {
    // SAFETY: comm is a valid communicator owned by the progress thread.
    let rc = unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) };
    check(rc, "MPI_Comm_set_errhandler", -1, -1)
}

/// `MPI_Comm_dup` of a communicator the caller supplied.
pub(super) fn dup(comm: RawComm) -> Result<RawComm, FerryError> {
    // SAFETY: the caller promised a valid communicator; the out-parameter is valid.
    unsafe {
        let mut out: RawComm = std::mem::zeroed();
        let rc = ffi::MPI_Comm_dup(comm, &mut out);
        check(rc, "MPI_Comm_dup", -1, -1).map(|_| out)
    }
}

/// `len` as an MPI count, or an error naming the call: MPI counts are `int`, and a longer
/// message must be refused rather than wrap to a wrong (or negative) count.
fn count(len: usize, op: &'static str, peer: Rank, tag: i32) -> Result<c_int, FerryError> {
    c_int::try_from(len).map_err(|_| FerryError::Mpi {
        op,
        peer,
        tag,
        msg: format!(
            "{len} bytes exceed an MPI count (at most {} bytes per message)",
            c_int::MAX
        ),
    })
}

/// `MPI_Isend` of `len` bytes at `ptr`.
///
/// # Safety
/// `ptr..ptr+len` must stay valid and unmodified until the request completes.
pub(super) unsafe fn isend(
    ptr: *const u8,
    len: usize,
    peer: Rank,
    tag: i32,
    comm: RawComm,
) -> Result<RawRequest, FerryError> {
    let n = count(len, "MPI_Isend", peer, tag)?;
    let mut req = null_request();
    let rc = ffi::MPI_Isend(ptr as *const c_void, n, bytes_type(), peer, tag, comm, &mut req);
    check(rc, "MPI_Isend", peer, tag).map(|_| req)
}

/// A message taken out of MPI's matching by [`improbe`]: its envelope and size. It must be
/// received with [`imrecv`] (or [`discard`]).
pub(super) struct Arrived {
    pub(super) msg: ffi::MPI_Message,
    pub(super) source: Rank,
    pub(super) tag: i32,
    pub(super) len: usize,
}

// SAFETY: a message handle is a plain value; only the progress thread uses it.
unsafe impl Send for Arrived {}

/// The next message from any source with any tag that has arrived on `comm`, if one has
/// (`MPI_Improbe`: matched and removed from the queue, so a later probe does not see it again).
pub(super) fn improbe(comm: RawComm) -> Result<Option<Arrived>, FerryError> {
    let mut flag: c_int = 0;
    // SAFETY: reading initialised constants of the rsmpi shim; out-parameters are valid.
    unsafe {
        let mut msg = ffi::RSMPI_MESSAGE_NULL;
        let mut status: RawStatus = std::mem::zeroed();
        let rc = ffi::MPI_Improbe(
            ffi::RSMPI_ANY_SOURCE,
            ffi::RSMPI_ANY_TAG,
            comm,
            &mut flag,
            &mut msg,
            &mut status,
        );
        check(rc, "MPI_Improbe", -1, -1)?;
        if flag == 0 {
            return Ok(None);
        }
        // The message is matched now and must be received whatever happens: a size the library
        // cannot tell is left at 0, and the receive into the wanted buffer reports the mismatch.
        let mut count: c_int = 0;
        if ffi::MPI_Get_count(&status, bytes_type(), &mut count) != SUCCESS {
            count = 0;
        }
        Ok(Some(Arrived {
            msg,
            source: status.MPI_SOURCE,
            tag: status.MPI_TAG,
            len: count.max(0) as usize,
        }))
    }
}

/// Receives the probed message `m` into `len` bytes at `ptr` (`MPI_Imrecv`).
///
/// # Safety
/// `ptr..ptr + len` must stay valid and untouched until the request completes.
pub(super) unsafe fn imrecv(ptr: *mut u8, len: usize, m: &mut Arrived) -> Result<RawRequest, FerryError> {
    let n = count(len, "MPI_Imrecv", m.source, m.tag)?;
    let mut req = null_request();
    let rc = ffi::MPI_Imrecv(ptr as *mut c_void, n, bytes_type(), &mut m.msg, &mut req);
    check(rc, "MPI_Imrecv", m.source, m.tag).map(|_| req)
}

/// Receives the probed message `m` into a scratch buffer and drops it (shutdown: every matched
/// message must be received), waiting for it at most until `until`; a receive still running
/// then keeps its buffer (leaked: the library may still write it).
pub(super) fn discard(mut m: Arrived, until: std::time::Instant) {
    let mut buf = vec![0u8; m.len.max(1)];
    // SAFETY: the buffer holds the message and outlives the request (leaked if unfinished).
    let posted = unsafe { imrecv(buf.as_mut_ptr(), m.len, &mut m) };
    let Ok(mut req) = posted else { return };
    while std::time::Instant::now() < until {
        if test(&mut req).unwrap_or(true) {
            return;
        }
        std::thread::yield_now();
    }
    std::mem::forget(buf);
}

/// One finished request of a [`testsome`] call.
pub(super) struct Finished {
    pub(super) index: usize,
    /// Bytes received (receives) or 0.
    pub(super) count: usize,
    /// `MPI_ERROR` of the status when the call reported errors per status.
    pub(super) error: Option<c_int>,
}

/// `MPI_Testsome` over `reqs`; completed entries become `MPI_REQUEST_NULL`. Results come in
/// increasing index order.
pub(super) fn testsome(
    reqs: &mut [RawRequest],
    indices: &mut Vec<c_int>,
    statuses: &mut Vec<RawStatus>,
    out: &mut Vec<Finished>,
) -> Result<(), FerryError> {
    out.clear();
    if reqs.is_empty() {
        return Ok(());
    }
    indices.resize(reqs.len(), 0);
    // SAFETY: MPI_Status is plain data; zeroed is a valid bit pattern.
    statuses.resize(reqs.len(), unsafe { std::mem::zeroed() });
    let mut outcount: c_int = 0;
    // SAFETY: the arrays hold reqs.len() entries each.
    let rc = unsafe {
        ffi::MPI_Testsome(
            reqs.len() as c_int,
            reqs.as_mut_ptr(),
            &mut outcount,
            indices.as_mut_ptr(),
            statuses.as_mut_ptr(),
        )
    };
    if rc != SUCCESS && rc != ERR_IN_STATUS {
        return check(rc, "MPI_Testsome", -1, -1);
    }
    for k in 0..outcount.max(0) as usize {
        let st = &statuses[k];
        let error = (rc == ERR_IN_STATUS && st.MPI_ERROR != SUCCESS).then_some(st.MPI_ERROR);
        let mut count: c_int = 0;
        // SAFETY: st is a status filled in by MPI_Testsome.
        unsafe { ffi::MPI_Get_count(st, bytes_type(), &mut count) };
        out.push(Finished {
            index: indices[k] as usize,
            count: count.max(0) as usize,
            error,
        });
    }
    out.sort_unstable_by_key(|f| f.index);
    Ok(())
}

/// `MPI_Test` on one request.
pub(super) fn test(req: &mut RawRequest) -> Result<bool, FerryError> {
    let mut flag: c_int = 0;
    // SAFETY: req is a live request (or MPI_REQUEST_NULL, which tests as complete).
    let rc = unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    check(rc, "MPI_Test", -1, -1).map(|_| flag != 0)
}

/// `MPI_Test` on a receive: `(source, tag, bytes)` once it has completed.
pub(super) fn test_received(req: &mut RawRequest) -> Result<Option<(Rank, i32, usize)>, FerryError> {
    let mut flag: c_int = 0;
    // SAFETY: req is a live request; the status is an out-parameter of the documented type.
    unsafe {
        let mut status: RawStatus = std::mem::zeroed();
        let rc = ffi::MPI_Test(req, &mut flag, &mut status);
        check(rc, "MPI_Test", -1, -1)?;
        if flag == 0 {
            return Ok(None);
        }
        let mut count: c_int = 0;
        let rc = ffi::MPI_Get_count(&status, bytes_type(), &mut count);
        check(rc, "MPI_Get_count", status.MPI_SOURCE, status.MPI_TAG)?;
        Ok(Some((status.MPI_SOURCE, status.MPI_TAG, count.max(0) as usize)))
    }
}

/// `MPI_Irecv` from any source with any tag into `len` bytes at `ptr`.
///
/// # Safety
/// `ptr..ptr + len` must stay valid and untouched until the request completes.
pub(super) unsafe fn irecv_any(ptr: *mut u8, len: usize, comm: RawComm) -> Result<RawRequest, FerryError> {
    irecv(ptr, len, ffi::RSMPI_ANY_SOURCE, ffi::RSMPI_ANY_TAG, comm)
}

/// `MPI_Cancel` then `MPI_Request_free`: used only at shutdown after an error.
pub(super) fn cancel(req: &mut RawRequest) {
    // SAFETY: req is a live request; errors are ignored on this best-effort path.
    unsafe {
        ffi::MPI_Cancel(req);
        ffi::MPI_Request_free(req);
    }
}

/// `MPI_Cancel` of a posted receive, which then completes (cancelled, or with its message if one
/// matched meanwhile) and must still be tested to the end.
pub(super) fn cancel_receive(req: &mut RawRequest) {
    // SAFETY: req is a live request; errors are ignored on this best-effort path.
    unsafe {
        ffi::MPI_Cancel(req);
    }
}

/// `MPI_Iallgather` of one `u64` per rank.
///
/// # Safety
/// `send` and `recv` (`size` entries) must stay valid until the request completes.
pub(super) unsafe fn iallgather_u64(send: *const u64, recv: *mut u64, comm: RawComm) -> Result<RawRequest, FerryError> {
    let mut req = null_request();
    let rc = ffi::MPI_Iallgather(
        send as *const c_void,
        8,
        bytes_type(),
        recv as *mut c_void,
        8,
        bytes_type(),
        comm,
        &mut req,
    );
    check(rc, "MPI_Iallgather", -1, -1).map(|_| req)
}

/// `MPI_Iallgatherv` of bytes.
///
/// # Safety
/// All buffers must stay valid until the request completes; `counts`/`displs` have `size` entries.
pub(super) unsafe fn iallgatherv(
    send: &[u8],
    send_len: usize,
    recv: *mut u8,
    counts: *const c_int,
    displs: *const c_int,
    comm: RawComm,
) -> Result<RawRequest, FerryError> {
    let n = count(send_len, "MPI_Iallgatherv", -1, -1)?;
    let mut req = null_request();
    let rc = ffi::MPI_Iallgatherv(
        send.as_ptr() as *const c_void,
        n,
        bytes_type(),
        recv as *mut c_void,
        counts,
        displs,
        bytes_type(),
        comm,
        &mut req,
    );
    check(rc, "MPI_Iallgatherv", -1, -1).map(|_| req)
}

/// `MPI_Abort` on `comm`: ends every rank of the job.
pub(super) fn abort(comm: RawComm, code: c_int) -> ! {
    // SAFETY: MPI is initialised on this thread.
    unsafe { ffi::MPI_Abort(comm, code) };
    std::process::exit(code)
}

/// `MPI_Irecv` of up to `len` bytes into `ptr`.
///
/// # Safety
/// `ptr..ptr+len` must stay valid and untouched by others until the request completes.
pub(super) unsafe fn irecv(
    ptr: *mut u8,
    len: usize,
    peer: Rank,
    tag: i32,
    comm: RawComm,
) -> Result<RawRequest, FerryError> {
    let n = count(len, "MPI_Irecv", peer, tag)?;
    let mut req = null_request();
    let rc = ffi::MPI_Irecv(ptr as *mut c_void, n, bytes_type(), peer, tag, comm, &mut req);
    check(rc, "MPI_Irecv", peer, tag).map(|_| req)
}

/// Tests `req` until it completes or `deadline` passes (then cancels it): for start-up
/// exchanges, so that the MPI thread never blocks in MPI for good.
///
/// # Errors
/// A failed test, or `deadline` passed.
pub(super) fn wait_until(
    req: &mut RawRequest,
    op: &'static str,
    peer: Rank,
    tag: i32,
    deadline: std::time::Instant,
) -> Result<(), FerryError> {
    loop {
        if test(req)? {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            cancel(req);
            return Err(FerryError::Mpi {
                op,
                peer,
                tag,
                msg: "no progress before the deadline (a rank did not take part)".into(),
            });
        }
        std::hint::spin_loop();
    }
}
