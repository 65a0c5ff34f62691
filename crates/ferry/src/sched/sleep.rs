//! Parking of idle workers without lost wake-ups.
//!
//! A worker that found no job registers as sleeping *under the mutex*, re-checks for work, then
//! waits. A spawner pushes first and then notifies when anyone sleeps. Both sides order their
//! steps with `SeqCst`, so either the spawner sees the sleeper or the sleeper sees the job. The
//! timed wait is only a backstop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

pub(super) struct Sleep {
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Sleep {
    pub(super) fn new() -> Self {
        Sleep {
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    /// Parks the calling worker unless `has_work` says there is something to do; whether it
    /// parked.
    pub(super) fn sleep(&self, has_work: impl Fn() -> bool) -> bool {
        let guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let parked = !has_work();
        if parked {
            let _ = self.cv.wait_timeout(guard, Duration::from_millis(20));
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        parked
    }

    /// Wakes one parked worker, if any (after a push).
    pub(super) fn wake_one(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.cv.notify_one();
        }
    }

    /// Wakes every parked worker (shutdown).
    pub(super) fn wake_all(&self) {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.cv.notify_all();
    }
}
