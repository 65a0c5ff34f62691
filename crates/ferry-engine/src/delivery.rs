//! Where completion callbacks and active-message handlers run.
//!
//! [`Completions::ProgressThread`] (the default) runs them on the engine's progress thread as
//! soon as their event is seen: the lowest latency, and what PaRSEC's communication thread
//! expects. [`Completions::Caller`] queues them, and the framework runs them by calling
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

    /// Runs `f` now (progress-thread mode) or queues it for [`Delivery::drain`].
    pub(crate) fn deliver(&self, f: Callback) {
        match self.mode {
            Completions::ProgressThread => self.run(f),
            Completions::Caller => {
                // The receiver lives as long as `self`: sending cannot fail.
                let _ = self.tx.send(f);
            }
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

    /// Runs the queued callbacks (caller mode) on this thread; how many ran.
    pub(crate) fn drain(&self) -> usize {
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
