//! Completion tracking for `wait`: how many local nodes are unfinished, and the first error.

use crossbeam::utils::CachePadded;
use ferry_base::error::FerryError;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

pub(crate) struct Tracker {
    /// Nodes inserted so far: written by the inserting thread only.
    added: CachePadded<AtomicU64>,
    /// Nodes finished so far (also the watchdog's progress measure): written by the threads
    /// that finish them. Two counters on two cache lines rather than one shared count of
    /// unfinished nodes, which the inserting thread and the workers both wrote for every task
    /// (the line moved between their cores twice per task).
    completed: CachePadded<AtomicU64>,
    /// Threads in `wait_idle` or `wait_completed`. Only then does a finishing thread compare
    /// `completed` with `added` and `target`: reading `added` at every finish pulled its line
    /// away from the inserting thread before each of its increments (a tenth of the insertion
    /// time of an empty task).
    waiters: CachePadded<AtomicU64>,
    /// The `completed` count the inserting thread waits for in `wait_completed` (the submission
    /// window, `graph/window.rs`); `u64::MAX` when it does not wait.
    target: AtomicU64,
    poisoned: AtomicBool,
    error: Mutex<Option<FerryError>>,
    cv: Condvar,
    /// Down while the inserting thread sleeps in `wait_idle` or `wait_completed`, up otherwise:
    /// workers that share its core spin only while it sleeps (`sched::IdleWait`).
    inserter_awake: Arc<AtomicBool>,
}

impl Tracker {
    pub(crate) fn new() -> Self {
        Tracker {
            added: CachePadded::new(AtomicU64::new(0)),
            completed: CachePadded::new(AtomicU64::new(0)),
            waiters: CachePadded::new(AtomicU64::new(0)),
            target: AtomicU64::new(u64::MAX),
            poisoned: AtomicBool::new(false),
            error: Mutex::new(None),
            cv: Condvar::new(),
            inserter_awake: Arc::new(AtomicBool::new(true)),
        }
    }

    /// The flag that is down while the inserting thread sleeps on this tracker.
    pub(crate) fn inserter_awake(&self) -> Arc<AtomicBool> {
        self.inserter_awake.clone()
    }

    /// One more local node to wait for.
    pub(crate) fn add_one(&self) {
        self.added.fetch_add(1, Ordering::SeqCst);
    }

    /// Nodes inserted so far (exact on the inserting thread, which alone adds them).
    #[inline]
    pub(crate) fn added(&self) -> u64 {
        self.added.load(Ordering::Relaxed)
    }

    /// Nodes finished so far.
    pub(crate) fn completed(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    /// One local node finished; when it was the last one and a thread waits (in `wait_idle` or
    /// `wait_completed`), wakes it and says so (`true`: nothing local is left to run). Also
    /// wakes the inserting thread in `wait_completed` when this is the count it waits for.
    pub(crate) fn done_one(&self) -> bool {
        let done = self.completed.fetch_add(1, Ordering::SeqCst) + 1;
        // A waiter registers (after storing its target) before it reads `completed` (all
        // `SeqCst`): if it read the count before this increment, this load sees it registered.
        // A node added after the load of `added` keeps the count above zero: no wake-up is
        // due. The waiter checks under the mutex that the notification takes, so none is lost.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let last = done == self.added.load(Ordering::SeqCst);
            if last || done == self.target.load(Ordering::SeqCst) {
                let _g = self.error.lock().unwrap_or_else(|p| p.into_inner());
                self.cv.notify_all();
            }
            return last;
        }
        false
    }

    /// Local nodes not finished yet.
    pub(crate) fn outstanding(&self) -> u64 {
        // `completed` first: `added` only grows and every finished node was added before, so
        // the later load of `added` is at least the earlier `completed`.
        let done = self.completed.load(Ordering::SeqCst);
        self.added.load(Ordering::SeqCst) - done
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

    /// Blocks until `target` nodes have finished, an error was recorded, or no node has finished
    /// for `stall`; returns the finished count last read (below `target` after an error or a
    /// stall). One thread at a time: the inserting thread, whose submission window is full.
    pub(crate) fn wait_completed(&self, target: u64, stall: Duration) -> u64 {
        let _asleep = Asleep::new(&self.inserter_awake);
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        self.target.store(target, Ordering::SeqCst);
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let mut done = self.completed.load(Ordering::SeqCst);
        let mut moved = std::time::Instant::now();
        while g.is_none() && done < target && moved.elapsed() < stall {
            // The finish that reaches `target` notifies; the timeout only bounds the stall check.
            let left = stall.saturating_sub(moved.elapsed());
            g = self
                .cv
                .wait_timeout(g, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            let now = self.completed.load(Ordering::SeqCst);
            if now != done {
                (done, moved) = (now, std::time::Instant::now());
            }
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        self.target.store(u64::MAX, Ordering::SeqCst);
        done
    }

    /// Blocks until no local node is unfinished or an error was recorded.
    pub(crate) fn wait_idle(&self) {
        let _asleep = Asleep::new(&self.inserter_awake);
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        self.waiters.fetch_add(1, Ordering::SeqCst);
        while g.is_none() && self.outstanding() > 0 {
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Holds the inserting thread's flag down while it sleeps on the tracker, up again when it
/// returns (a drop guard: also on unwinding).
struct Asleep<'a>(&'a AtomicBool);

impl<'a> Asleep<'a> {
    fn new(awake: &'a AtomicBool) -> Asleep<'a> {
        awake.store(false, Ordering::Relaxed);
        Asleep(awake)
    }
}

impl Drop for Asleep<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// The inserting thread's flag is down exactly while it sleeps in `wait_idle` or
    /// `wait_completed`.
    #[test]
    fn the_inserter_flag_is_down_while_it_sleeps() {
        let t = Arc::new(Tracker::new());
        let awake = t.inserter_awake();
        assert!(awake.load(Ordering::Relaxed));
        t.add_one();
        for completed in [false, true] {
            let waiter = {
                let t = t.clone();
                std::thread::spawn(move || {
                    if completed {
                        t.wait_completed(2, Duration::from_secs(30));
                    } else {
                        t.wait_idle();
                    }
                })
            };
            while t.waiters.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            assert!(!awake.load(Ordering::Relaxed), "asleep (wait_completed: {completed})");
            t.done_one();
            waiter.join().expect("the waiter returns");
            assert!(
                awake.load(Ordering::Relaxed),
                "awake again (wait_completed: {completed})"
            );
            t.add_one();
        }
    }

    #[test]
    fn the_last_finish_wakes_a_waiter_and_says_so() {
        let t = Arc::new(Tracker::new());
        // Nobody waits: finishing the last node wakes no one.
        t.add_one();
        assert!(!t.done_one());
        assert_eq!(t.outstanding(), 0);

        for _ in 0..3 {
            t.add_one();
        }
        let waiter = {
            let t = t.clone();
            std::thread::spawn(move || t.wait_idle())
        };
        while t.waiters.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        assert!(!t.done_one());
        assert!(!t.done_one());
        assert!(t.done_one(), "the last finish while a thread waits reports the drain");
        waiter.join().expect("the waiter returns");
        assert_eq!(t.waiters.load(Ordering::SeqCst), 0);
        assert_eq!((t.outstanding(), t.completed()), (0, 4));
    }

    #[test]
    fn many_finishers_never_lose_the_wake_up() {
        // Each round: nodes finish on several threads while one thread waits; wait_idle must
        // return through a notification, long before its 100 ms backstop would add up.
        let t = Arc::new(Tracker::new());
        let start = std::time::Instant::now();
        for _ in 0..200 {
            for _ in 0..8 {
                t.add_one();
            }
            let finishers: Vec<_> = (0..4)
                .map(|_| {
                    let t = t.clone();
                    std::thread::spawn(move || {
                        t.done_one();
                        t.done_one();
                    })
                })
                .collect();
            t.wait_idle();
            assert_eq!(t.outstanding(), 0);
            for f in finishers {
                f.join().expect("finisher");
            }
        }
        // 200 lost wake-ups would take 20 s; a few stragglers are tolerated on a loaded machine.
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
    }
}
