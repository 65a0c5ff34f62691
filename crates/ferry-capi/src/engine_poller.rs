//! The framework's own pollers in the engine's progress loop, from C (`ferry_engine_add_poller`,
//! `ferry_engine_wake`): a function the loop calls in every pass, on the thread that runs the
//! pass, for work the framework must notice without a thread of its own (CUDA events of its
//! streams, a queue another library fills). StarPU's progression hooks and Realm's background
//! work items are the models; see `EngineHandle::add_poller` in `ferry-engine`.

use crate::engine::{ferry_engine, with};
use crate::status::ferry_status;
use eng::{EngineError, Polled, Poller};
use std::ffi::c_void;

/// Bit of a poll function's answer: it did work (ran callbacks, moved messages). The loop then
/// runs another pass at once instead of idling.
pub const FERRY_POLL_WORKED: u32 = 1;
/// Bit of a poll function's answer: it waits for something that will arrive without a message
/// the engine sees (a CUDA event, memory another process writes): the loop keeps polling
/// (it may yield or nap, but never blocks until the next operation). A poller that answers
/// without this bit and later has work wakes the loop with `ferry_engine_wake`.
pub const FERRY_POLL_EXPECTING: u32 = 2;

/// A poll function: `(user)` → `FERRY_POLL_WORKED` | `FERRY_POLL_EXPECTING` (0: nothing done,
/// nothing awaited). Other bits are ignored.
#[allow(non_camel_case_types)]
pub type ferry_poll_fn = Option<unsafe extern "C" fn(*mut c_void) -> u32>;

/// Called once when the loop ends (`ferry_engine_finalize`), after the last poll: `(user)`.
#[allow(non_camel_case_types)]
pub type ferry_poll_close_fn = Option<unsafe extern "C" fn(*mut c_void)>;

/// A C poller: its functions and their user pointer. Its close runs exactly once: when the loop
/// ends, or when it is dropped without having been closed (an add that failed).
struct CPoller {
    poll: ferry_poll_fn,
    close: ferry_poll_close_fn,
    user: *mut c_void,
    closed: bool,
}

// SAFETY: the caller of `ferry_engine_add_poller` hands `user` to functions that the documented
// contract runs on whichever thread runs the engine's passes, one pass at a time.
unsafe impl Send for CPoller {}

impl Poller for CPoller {
    fn poll(&mut self) -> Polled {
        let Some(poll) = self.poll else {
            return Polled {
                worked: false,
                expecting: false,
            };
        };
        // SAFETY: the caller's function with the caller's user pointer.
        let bits = unsafe { poll(self.user) };
        Polled {
            worked: bits & FERRY_POLL_WORKED != 0,
            expecting: bits & FERRY_POLL_EXPECTING != 0,
        }
    }

    fn sending(&self) -> bool {
        false
    }

    fn close(&mut self) {
        if std::mem::replace(&mut self.closed, true) {
            return;
        }
        if let Some(close) = self.close {
            // SAFETY: as for `poll`; called once.
            unsafe { close(self.user) };
        }
    }
}

impl Drop for CPoller {
    fn drop(&mut self) {
        self.close();
    }
}

/// Adds a poller to the engine's progress loop: `poll(user)` runs in every pass from the next
/// one on, on the thread that runs the pass (the progress thread, or a thread inside
/// `ferry_engine_progress` or a collective, as for handlers), until the engine finalizes.
/// Pollers run in the order they were added.
///
/// `close(user)` (`close` may be NULL) runs exactly once whatever happens, so the framework
/// frees `user` in one place: after the last poll when the engine finalizes, or before this
/// call returns when it fails.
///
/// A poll function must return quickly: it must not block, call MPI or call the engine's
/// collectives; it may start operations (send active messages, puts, gets). It answers
/// `FERRY_POLL_WORKED` when it did something and `FERRY_POLL_EXPECTING` while it waits for
/// something the engine cannot see; without that bit an idle progress thread may nap up to
/// `progress_sleep_us` between passes (or block until the next operation, with
/// `active_messages` off), so a poller that later finds work calls `ferry_engine_wake`.
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` (`poll` is NULL), `FERRY_ERR_INVALID_HANDLE` (a
/// finalized or made-up engine), `FERRY_ERR_MPI` (the progress loop has stopped).
///
/// # Safety
/// `poll` and `close` are safe to call with `user` from the thread that runs a pass, until
/// `close` has run.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_add_poller(
    engine: ferry_engine,
    poll: ferry_poll_fn,
    close: ferry_poll_close_fn,
    user: *mut c_void,
) -> ferry_status {
    let p = CPoller {
        poll,
        close,
        user,
        closed: false,
    };
    // A poller that does not reach the loop (the closure not run, an error) is dropped here,
    // which closes it.
    with(engine, move |h| {
        if poll.is_none() {
            return Err(EngineError::InvalidArgument("poll is null".into()));
        }
        h.add_poller(Box::new(p))
    })
}

/// Wakes the engine's progress loop for a pass now (from any thread, including a poll
/// function or a thread of the framework's own). Does nothing harmful after the engine has
/// stopped.
///
/// Errors: `FERRY_ERR_INVALID_HANDLE` (a finalized or made-up engine).
#[no_mangle]
pub extern "C" fn ferry_engine_wake(engine: ferry_engine) -> ferry_status {
    with(engine, |h| {
        (h.waker())();
        Ok(())
    })
}
