//! MPI progress shared with the rank's idle threads.
//!
//! When a rank's threads outnumber its cores (a rank per core, `mpirun -np <cores>`), a
//! progress thread of its own is a thread too many: every message a worker waits for needs the
//! progress thread scheduled on the worker's core, and each hop of a fine-grained graph costs
//! context switches. The cure MPI programs use is that the thread that waits is the thread
//! that polls. Once [`crate::CommHandle::share_progress`] has handed the
//! loop over, any thread may drive it ([`ProgressShare::try_pass`], one at a time, behind a
//! mutex: MPI at `MPI_THREAD_SERIALIZED`), idle workers and threads blocked in a collective do,
//! and the progress thread is only a backstop: it wakes every tick ([`TICK`] unless the caller
//! chose another; less often while others drive, [`BACKSTOP_BACKOFF`]) and passes when nobody
//! else did since its last wake-up (a worker inside a long task must not stall the rank's
//! messages), and it still finalizes MPI at the end, on the thread that initialised it.

use super::progress::{Comms, Loop, Pass};
use super::{Cmd, Passed, ShareReply};
use crossbeam::channel::Receiver;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

/// How often, by default, the progress thread looks whether anybody drove the loop since its
/// last look, and drives it itself if not ([`crate::CommHandle::share_progress`] takes another).
/// Long enough that its wake-ups cost a busy core little, short enough that a message is not
/// held up for long while every worker of the rank runs a long task.
pub const TICK: Duration = Duration::from_micros(200);

/// While other threads drive the loop, the backstop rests between its one-tick looks, the rest
/// doubling after each look that finds the loop driven, so that a look and its rest last up to
/// this many ticks; a look that finds it undriven drives it and stops resting. Each wake-up of
/// the backstop takes the core from the thread it interrupts for a context switch and the
/// timer's (tens of µs on a VM), every tick on a core whose worker drives the loop steadily; a
/// worker that starts a long task leaves the loop undriven for at most this many ticks before
/// the backstop notices.
const BACKSTOP_BACKOFF: u32 = 8;

/// [`Shared::stop`]: still running.
const RUNNING: u8 = 0;
/// [`Shared::stop`]: an orderly shutdown was asked for.
const STOP: u8 = 1;
/// [`Shared::stop`]: a shutdown with `MPI_Abort` was asked for (or every sender went away).
const ABORT: u8 = 2;

/// The loop (MPI handles inside) and its command channel, which goes with it when the
/// progress thread takes it back to finish it: commands posted after that fail
/// ([`crate::CommHandle::post`] reports the thread gone), as they do once an unshared loop's
/// thread has ended.
struct SendLoop(Loop, Receiver<Cmd>);

// SAFETY: a shared loop exists only when MPI runs at MPI_THREAD_SERIALIZED or above
// (`Cmd::ShareProgress` is refused otherwise), which lets any thread make MPI calls one at a
// time; the mutex around it serialises them.
unsafe impl Send for SendLoop {}

/// What the progress thread and the threads that drive its loop share.
struct Shared {
    /// The loop; `None` once the progress thread has taken it back to finish it.
    lp: Mutex<Option<SendLoop>>,
    /// Commands may be queued: set by every post ([`ProgressShare::posted`]), cleared by each
    /// pass before it drains the channel (so a command posted during a pass sets it again).
    queued: AtomicBool,
    /// Passes made by any thread: the progress thread drives only when this has not moved in
    /// a `tick`.
    passes: AtomicU64,
    /// The backstop's period.
    tick: Duration,
    /// [`RUNNING`], [`STOP`] or [`ABORT`]: set by whichever pass took the shutdown command.
    stop: AtomicU8,
    /// The loop's `waiting()` after the last pass (read without the lock by idle threads that
    /// decide whether to keep polling).
    waiting: AtomicBool,
    /// The progress thread, woken when the loop has stopped or a shutdown was posted.
    owner: std::thread::Thread,
    /// Wakes a thread that drives the loop when it may have gone to sleep (idle workers park
    /// once the loop has had nothing in flight for a while): called after every command posted
    /// ([`ProgressShare::set_waker`]).
    waker: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

/// A handle on a progress loop that any thread may drive ([`ProgressShare::try_pass`]), made
/// by [`crate::CommHandle::share_progress`]. Cheap to clone.
#[derive(Clone)]
pub struct ProgressShare(Arc<Shared>);

impl ProgressShare {
    /// Passes of the loop made so far, by any thread: a thread that sees the count move between
    /// two of its own looks knows that another thread drives the loop.
    pub fn passes(&self) -> u64 {
        self.0.passes.load(Relaxed)
    }

    /// The period of the progress thread's backstop.
    pub fn tick(&self) -> Duration {
        self.0.tick
    }

    /// One pass of the progress loop on the calling thread (the commands queued, arrivals,
    /// requests, collectives; completion callbacks and pollers run here), unless another
    /// thread is in one: then `None` at once. `Some(Passed::Stopped)` once the loop has
    /// stopped.
    ///
    /// Must not be called from inside a completion callback (the pass would find its own
    /// thread holding the loop, and return `None` forever to a caller that retries).
    pub fn try_pass(&self) -> Option<Passed> {
        let s = &*self.0;
        if s.stop.load(Acquire) != RUNNING {
            return Some(Passed::Stopped);
        }
        let mut guard = match s.lp.try_lock() {
            Ok(g) => g,
            Err(TryLockError::WouldBlock) => return None,
            // Only a panic outside a pass's callbacks (which are caught below) poisons it.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
        };
        // Looked at again under the lock: the pass that took the shutdown may have released
        // it just before the progress thread takes the loop back.
        if s.stop.load(Acquire) != RUNNING {
            return Some(Passed::Stopped);
        }
        let Some(SendLoop(lp, rx)) = guard.as_mut() else {
            return Some(Passed::Stopped);
        };
        s.passes.fetch_add(1, Relaxed);
        s.queued.store(false, SeqCst);
        // A callback that panics has taken the rest of its batch of finished requests with it
        // (MPI has released them): the rank cannot go on, and must not hang either. The panic
        // ends the loop with an abort, on this thread's return, as one on the progress thread
        // would have ended it.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lp.pass(rx)));
        let stop = match ran {
            Ok(Pass::Ran(worked)) => {
                s.waiting.store(lp.waiting(), Relaxed);
                return Some(if worked { Passed::Worked } else { Passed::Idle });
            }
            Ok(Pass::Stop(abort)) => abort,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|m| m.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!("a completion callback panicked in a shared MPI progress pass: {what}");
                true
            }
        };
        s.stop.store(if stop { ABORT } else { STOP }, Release);
        drop(guard);
        s.owner.unpark();
        Some(Passed::Stopped)
    }

    /// Whether the loop has work queued or in flight (commands not yet handled, requests,
    /// receives waiting for their message, a collective, a poller expecting a message): a
    /// thread with nothing else to do should keep driving it rather than sleep.
    pub fn pending(&self) -> bool {
        let s = &*self.0;
        s.stop.load(Relaxed) == RUNNING && (s.waiting.load(Relaxed) || s.queued.load(SeqCst))
    }

    /// Whether commands may wait in the loop's channel for a pass (posted since the last pass
    /// began).
    pub fn queued(&self) -> bool {
        self.0.stop.load(Relaxed) == RUNNING && self.0.queued.load(SeqCst)
    }

    /// Sets what wakes a sleeping driver of the loop when a command is posted (the first call
    /// holds): without it, a command posted while every thread that drives the loop sleeps waits
    /// for the progress thread's next tick. Called on the posting thread; must be cheap
    /// when nobody sleeps.
    pub fn set_waker(&self, waker: Box<dyn Fn() + Send + Sync>) {
        let _ = self.0.waker.set(waker);
    }

    /// Wakes the progress thread (a shutdown was posted: it need not wait for its tick).
    pub(crate) fn wake_owner(&self) {
        self.0.owner.unpark();
    }

    /// A command was posted: marks it queued, without waking anybody.
    pub(crate) fn mark_queued(&self) {
        self.0.queued.store(true, SeqCst);
    }

    /// A command was posted: marks it queued and wakes a sleeping driver
    /// ([`ProgressShare::set_waker`]).
    pub(crate) fn posted(&self) {
        self.0.queued.store(true, SeqCst);
        if let Some(w) = self.0.waker.get() {
            w();
        }
    }
}

/// The rest of the progress thread's life once it shares its loop: answers `reply` with the
/// share, then wakes every `tick` to drive the loop when nobody else has, until a pass takes
/// the shutdown; then flushes the sends (unless aborting) and finishes the loop, finalizing MPI
/// when ferry initialised it.
///
/// The loop stays timed: `CommCounters::busy_ns` goes on counting the passes that did work,
/// whichever thread ran them.
pub(super) fn serve(mut lp: Loop, comms: Comms, rx: Receiver<Cmd>, reply: ShareReply, tick: Duration) {
    lp.mark_shared();
    let waiting = lp.waiting();
    let shared = Arc::new(Shared {
        lp: Mutex::new(Some(SendLoop(lp, rx))),
        // Commands posted before the hand-over may be waiting.
        queued: AtomicBool::new(true),
        passes: AtomicU64::new(0),
        tick,
        stop: AtomicU8::new(RUNNING),
        waiting: AtomicBool::new(waiting),
        owner: std::thread::current(),
        waker: std::sync::OnceLock::new(),
    });
    let share = ProgressShare(shared.clone());
    // An asker gone changes nothing: the loop stops as ever, at a shutdown command or once
    // every sender has gone.
    let _ = reply.send(Ok(share.clone()));
    // Each look is one tick long, so that a thread that passed once just before it starts (a
    // worker posting a send, then running a long task) does not count as driving; while
    // others drive, the looks are spaced by a rest that doubles up to the back-off.
    let mut rest = Duration::ZERO;
    while shared.stop.load(Acquire) == RUNNING {
        if !rest.is_zero() {
            std::thread::park_timeout(rest);
        }
        let before = shared.passes.load(Relaxed);
        std::thread::park_timeout(tick);
        if shared.stop.load(Acquire) != RUNNING {
            continue;
        }
        if shared.passes.load(Relaxed) != before {
            rest = if rest.is_zero() {
                tick
            } else {
                (rest * 2).min(tick * (BACKSTOP_BACKOFF - 1))
            };
            continue;
        }
        rest = Duration::ZERO;
        // Nobody drove the loop for a whole tick: drive it until it has nothing to do, or until
        // another thread drives it again (under a steady stream of messages every pass finds
        // work, and the backstop would go on competing for the lock and the core).
        loop {
            let mine = shared.passes.load(Relaxed) + 1;
            match share.try_pass() {
                Some(Passed::Worked) if shared.passes.load(Relaxed) == mine => {}
                _ => break,
            }
        }
    }
    let abort = shared.stop.load(Acquire) == ABORT;
    let taken = shared.lp.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(SendLoop(mut lp, rx)) = taken {
        if !abort {
            lp.flush(&rx);
        }
        lp.finish(abort, comms);
        // Commands still queued are dropped with the channel (their replies with them).
        drop(rx);
    }
}
