//! Traces: a repeated sequence of insertions recorded once and replayed afterwards
//! (`ferry::Runtime::begin_trace` / `end_trace`).

use crate::registry;
use crate::runtime::ferry_runtime;
use crate::status::*;
use rt::TraceMode;

/// Opens trace `id`: the tasks inserted until `ferry_trace_end` are recorded the first time
/// (analysed as usual) and replay that recording afterwards, skipping the dependence analysis.
/// Every rank traces the same sequences with the same ids, and each use of an id must insert
/// the same tasks (classes by name, tiles, modes, placements; arguments and priorities may
/// differ). `*replaying` (when not null) is set to 1 when the sequence replays, 0 when it is
/// recorded (first use, or the tiles it reads changed holders since the recording).
///
/// `FERRY_ERR_INVALID_ARGUMENT` when a trace is open already (traces do not nest).
///
/// # Safety
/// `replaying` must be null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_trace_begin(runtime: ferry_runtime, id: u64, replaying: *mut i32) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        match rt.begin_trace(id) {
            Ok(mode) => {
                if !replaying.is_null() {
                    replaying.write(i32::from(mode == TraceMode::Replay));
                }
                FERRY_OK
            }
            Err(e) => from_error(&e),
        }
    })
}

/// Closes the open trace; `*tasks` (when not null) receives the number of tasks it inserted.
///
/// `FERRY_ERR_INVALID_ARGUMENT` when no trace is open; `FERRY_ERR_GRAPH_MISMATCH` when a
/// replay inserted fewer tasks than its recording (the run has failed then: every rank's next
/// `ferry_wait` reports it); `FERRY_ERR_POISONED` after a replay that failed earlier (the
/// insertion of a task other than the recorded one returned `FERRY_ERR_GRAPH_MISMATCH`). A
/// trace still open at `ferry_finalize` is closed there: a recording is dropped, a replay cut
/// short fails the run.
///
/// # Safety
/// `tasks` must be null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_trace_end(runtime: ferry_runtime, tasks: *mut usize) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        match rt.end_trace() {
            Ok(n) => {
                if !tasks.is_null() {
                    tasks.write(n);
                }
                FERRY_OK
            }
            Err(e) => from_error(&e),
        }
    })
}
