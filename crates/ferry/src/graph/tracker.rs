//! Completion tracking for `wait`: how many local nodes are unfinished, and the first error.

use crate::error::FerryError;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

pub(crate) struct Tracker {
    outstanding: AtomicU64,
    /// Nodes finished so far (the watchdog's progress measure).
    completed: AtomicU64,
    poisoned: AtomicBool,
    error: Mutex<Option<FerryError>>,
    cv: Condvar,
}

impl Tracker {
    pub(crate) fn new() -> Self {
        Tracker {
            outstanding: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            error: Mutex::new(None),
            cv: Condvar::new(),
        }
    }

    /// One more local node to wait for.
    pub(crate) fn add_one(&self) {
        self.outstanding.fetch_add(1, Ordering::AcqRel);
    }

    /// One local node finished.
    /// Nodes finished so far.
    pub(crate) fn completed(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    pub(crate) fn done_one(&self) {
        self.completed.fetch_add(1, Ordering::AcqRel);
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _g = self.error.lock().unwrap_or_else(|p| p.into_inner());
            self.cv.notify_all();
        }
    }

    pub(crate) fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Acquire)
    }

    /// Records an error; the first one wins.
    pub(crate) fn fail(&self, e: FerryError) {
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            tracing::error!(error = %e, "ferry: run failed");
            *g = Some(e);
        }
        self.poisoned.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// The first error, as a fresh value (the original stays for later callers).
    pub(crate) fn error(&self) -> Option<FerryError> {
        self.error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(FerryError::duplicate)
    }

    /// Takes the original first error, leaving a copy behind.
    pub(crate) fn take_error(&self) -> Option<FerryError> {
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        let e = g.take();
        *g = e.as_ref().map(FerryError::duplicate);
        e
    }

    /// Blocks until no local node is unfinished or an error was recorded.
    pub(crate) fn wait_idle(&self) {
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        while g.is_none() && self.outstanding() > 0 {
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
