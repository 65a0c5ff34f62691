//! Where completion callbacks and active-message handlers run.
//!
//! [`Completions::ProgressThread`] (the default) runs them on the engine's progress thread (or
//! inside the caller's pass, with caller-driven progress), in the same or the next pass after
//! their event: the lowest latency, and what PaRSEC's communication thread expects. They never
//! run inside the communication layer's own completion: by the time one runs, the operation has
//! let go of its memory (a callback may unregister it, or drop a placed buffer). [`Completions::Caller`] queues them, and the framework runs them by calling
//! [`crate::EngineHandle::progress`] from a thread of its choice (StarPU-MPI's and Legion's style:
//! callbacks on the framework's own threads, where they may take the framework's locks).
//!
//! A callback that panics is caught: the panic is recorded, the engine refuses further
//! operations with [`crate::EngineError::CallbackPanicked`], and the thread that ran it lives on.

use crossbeam::channel::{Receiver, Sender};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// Where callbacks and handlers run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Completions {
    /// On the engine's progress thread, as events are seen.
    #[default]
    ProgressThread,
    /// Queued; run by [`crate::EngineHandle::progress`] on the calling thread.
    Caller,
}

pub(crate) type Callback = Box<dyn FnOnce() + Send>;

pub(crate) struct Delivery {
    mode: Completions,
    tx: Sender<Callback>,
    rx: Receiver<Callback>,
    /// The first panic of a callback: what it said.
    poisoned: OnceLock<String>,
}

impl Delivery {
    pub(crate) fn new(mode: Completions) -> Delivery {
        let (tx, rx) = crossbeam::channel::unbounded();
        Delivery {
            mode,
            tx,
            rx,
            poisoned: OnceLock::new(),
        }
    }

    /// Queues `f`: for the progress loop's next look ([`Delivery::drain_on_progress`]), or for
    /// the caller's `progress` ([`Delivery::drain`]).
    pub(crate) fn deliver(&self, f: Callback) {
        // The receiver lives as long as `self`: sending cannot fail.
        let _ = self.tx.send(f);
    }

    /// Runs `f` now when callbacks run on the progress loop and none is queued before it (so
    /// the order of events holds), else queues it. Only for callers outside the communication
    /// layer's completions (the active-message listener): `f` may then unregister memory.
    pub(crate) fn run_or_deliver(&self, f: Callback) {
        if self.mode == Completions::ProgressThread && self.rx.is_empty() {
            self.run(f);
        } else {
            self.deliver(f);
        }
    }

    /// Where callbacks run.
    pub(crate) fn mode(&self) -> Completions {
        self.mode
    }

    /// Whether no callback is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// Runs the queued callbacks when they belong to the progress loop (its poller calls this
    /// in every pass); how many ran.
    pub(crate) fn drain_on_progress(&self) -> usize {
        match self.mode {
            Completions::ProgressThread => self.drain_all(),
            Completions::Caller => 0,
        }
    }

    fn run(&self, f: Callback) {
        if let Err(p) = catch_unwind(AssertUnwindSafe(f)) {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic payload".into());
            tracing::error!("engine callback panicked: {msg}");
            let _ = self.poisoned.set(msg);
        }
    }

    /// Runs the queued callbacks for the caller (caller mode) on this thread; how many ran.
    pub(crate) fn drain(&self) -> usize {
        match self.mode {
            Completions::ProgressThread => 0,
            Completions::Caller => self.drain_all(),
        }
    }

    /// Runs every queued callback on this thread (and at finalize); how many ran.
    pub(crate) fn drain_all(&self) -> usize {
        let mut n = 0;
        while let Ok(f) = self.rx.try_recv() {
            self.run(f);
            n += 1;
        }
        n
    }

    /// The first callback panic, if there was one.
    pub(crate) fn poisoned(&self) -> Option<&str> {
        self.poisoned.get().map(|s| s.as_str())
    }
}
