//! The submission window: a bound on how far insertion may run ahead of execution.
//!
//! Every rank inserts the whole sequential task flow, and without a bound its inserting thread
//! runs ahead of the workers for as long as the program inserts: each unfinished node holds its
//! task's description, its edges and its tile arguments (about 260 bytes per task of Task
//! Bench's `stencil_1d`), so a long run's memory grows with its length. Like PaRSEC's DTD window
//! (`dtd_window_size` / `dtd_threshold_size`) and StarPU's
//! `STARPU_LIMIT_MAX_SUBMITTED_TASKS` / `STARPU_LIMIT_MIN_SUBMITTED_TASKS`, insertion blocks
//! once this rank's unfinished nodes (tasks, sends, receives) reach the window, and resumes
//! when they have fallen to half of it (the hysteresis keeps the inserting thread from waking
//! for every finished task).
//!
//! **A soft bound.** In the graph alone, blocking could not deadlock: ranks block on their own
//! counts, every rank inserts the same sequence, and the earliest unfinished node of that
//! sequence (a send or receive counted at the position of the task it serves) has its local
//! predecessors finished and its peer's half of any transfer inserted. But the flow control
//! of transfers assumes that a receive is posted once its sender can send: the send window
//! (`ferry-comm/src/window.rs`) and the bounce pool (`ferry-transfer/src/bounce.rs`) let later rendezvous sends hold
//! their slots until their receives come, and an earlier send can queue behind them. A rank
//! blocked in its window before those receives would never post them. So a wait in which no
//! node of this rank finishes for [`STALL`] gives up: insertion goes on for another quarter
//! window (counted as an overrun) and blocks again later. That also lets a graph that differs
//! between ranks reach `wait`, where it is reported, and a task body that inserts tasks itself
//! go on. The bound holds whenever the rank's own nodes keep finishing.
//!
//! **Cost.** The inserting thread is the only writer of the tracker's `added` count and keeps
//! the last `completed` count it read. It reads `completed` — a line the finishing threads
//! write for every node — only when that cached view says the window is full, and then either
//! finds at least a quarter of the window free or blocks until half of it is: one shared read
//! per quarter window of insertions, never one per insertion.

use super::tracker::Tracker;
use crate::stats::Counters;
use ferry_base::error::{FerryError, Result};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// How long a full window waits without any of this rank's nodes finishing before insertion
/// goes on anyway (see the module documentation).
pub(crate) const STALL: Duration = Duration::from_millis(50);

/// The inserting side of the window (lives in the `Inserter`, behind its lock).
pub(crate) struct SubmitWindow {
    /// Most unfinished local nodes before insertion blocks; 0: unbounded.
    limit: u64,
    /// The `completed` count last read: `added − seen` is at least the true number of
    /// unfinished nodes (`completed` only grows).
    seen: u64,
    /// Nodes admitted past the limit after stalls (see [`STALL`]); back to 0 once a wait ends
    /// with the window half empty.
    overrun: u64,
}

impl SubmitWindow {
    /// A window of `limit` nodes (0: unbounded).
    pub(crate) fn new(limit: usize) -> SubmitWindow {
        SubmitWindow {
            limit: limit as u64,
            seen: 0,
            overrun: 0,
        }
    }

    /// Returns once fewer than `limit` local nodes are unfinished (plus what stalls let through),
    /// blocking the calling (inserting) thread while the window is full; stalls and overruns are
    /// counted in `counters`.
    ///
    /// # Errors
    /// The error that stopped the run, when one was recorded while blocked.
    #[inline]
    pub(crate) fn admit(&mut self, tracker: &Tracker, counters: &Counters) -> Result<()> {
        // Inline, and only a compare with the inserter's own counters: this runs for every
        // insertion, and the window is rarely full.
        if self.has_room(tracker.added()) {
            return Ok(());
        }
        self.admit_within(tracker, counters, STALL)
    }

    /// Whether, by the cached finished count, `added` nodes leave room (always when unbounded).
    #[inline]
    fn has_room(&self, added: u64) -> bool {
        self.limit == 0 || added - self.seen < self.limit + self.overrun
    }

    /// [`SubmitWindow::admit`] with the stall limit given (tests call it directly).
    #[cold]
    fn admit_within(&mut self, tracker: &Tracker, counters: &Counters, stall: Duration) -> Result<()> {
        let added = tracker.added();
        if self.has_room(added) {
            return Ok(());
        }
        let limit = self.limit + self.overrun;
        self.seen = tracker.completed();
        if added - self.seen < self.limit {
            // Back within the window proper: what stalls let through is spent.
            self.overrun = 0;
            return Ok(());
        }
        // A refresh that finds less than a quarter of the window free blocks until half of it
        // is: otherwise the thread would refresh every few insertions near the limit.
        if added - self.seen <= limit - self.limit.div_ceil(4) {
            return Ok(());
        }
        let resume = added - limit / 2;
        let t0 = Instant::now();
        // On the inserting thread's track of a trace: where insertion waited for execution.
        let span = tracing::info_span!("submit.window_full", unfinished = added - self.seen, resume_at = resume);
        self.seen = span.in_scope(|| tracker.wait_completed(resume, stall));
        counters.window_stalls.fetch_add(1, Relaxed);
        counters
            .window_stall_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
        if self.seen >= resume {
            self.overrun = 0;
            return Ok(());
        }
        if tracker.is_poisoned() {
            return Err(tracker
                .error()
                .unwrap_or_else(|| FerryError::Poisoned("the run failed while insertion waited".into())));
        }
        // Nothing of this rank finished for `stall`: go on for another quarter window.
        self.overrun += self.limit.div_ceil(4);
        counters.window_overruns.fetch_add(1, Relaxed);
        tracing::debug!(
            unfinished = added - self.seen,
            "submission window: no progress, insertion goes on"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    /// Finishers complete nodes as they appear while one thread inserts them in groups of up to
    /// three through a window of 16: after every admission the true number of unfinished nodes
    /// is below the window, the window stalled, and every node finished.
    #[test]
    fn insertion_never_runs_more_than_a_window_ahead() {
        const LIMIT: u64 = 16;
        let tracker = Arc::new(Tracker::new());
        let counters = Counters::new(1, 0, Default::default());
        let stop = Arc::new(AtomicBool::new(false));
        // Nodes the finishers may finish (those inserted), and those they have taken.
        let released = Arc::new(AtomicU64::new(0));
        let claimed = Arc::new(AtomicU64::new(0));
        let finishers: Vec<_> = (0..2)
            .map(|_| {
                let (t, stop) = (tracker.clone(), stop.clone());
                let (released, claimed) = (released.clone(), claimed.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        let c = claimed.load(Ordering::Acquire);
                        let free = c < released.load(Ordering::Acquire);
                        if free
                            && claimed
                                .compare_exchange(c, c + 1, Ordering::AcqRel, Ordering::Acquire)
                                .is_ok()
                        {
                            // Slow enough for the window to fill.
                            std::thread::sleep(std::time::Duration::from_micros(20));
                            t.done_one();
                        } else if !free {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut w = SubmitWindow::new(LIMIT as usize);
        // A stall limit far above the finishers' pace: the window must hold on a loaded machine.
        let patient = Duration::from_secs(30);
        for k in 0..2000u64 {
            w.admit_within(&tracker, &counters, patient)
                .expect("no error was recorded");
            assert!(
                tracker.outstanding() < LIMIT,
                "admitted with {} unfinished",
                tracker.outstanding()
            );
            for _ in 0..=(k % 3) {
                tracker.add_one();
            }
            released.store(tracker.added(), Ordering::Release);
        }
        tracker.wait_idle();
        stop.store(true, Ordering::Release);
        for f in finishers {
            f.join().expect("finisher");
        }
        assert_eq!(tracker.outstanding(), 0);
        assert!(counters.window_stalls.load(Relaxed) > 0, "the window never filled");
    }

    /// Nothing finishes while the window is full: after the stall limit insertion goes on for
    /// a quarter window (an overrun), blocks again at the enlarged limit, and, once nodes finish
    /// again, the window is back to its size.
    #[test]
    fn a_stalled_window_lets_insertion_go_on() {
        let tracker = Tracker::new();
        let counters = Counters::new(1, 0, Default::default());
        let mut w = SubmitWindow::new(8);
        let stall = Duration::from_millis(20);
        for _ in 0..8 {
            w.admit_within(&tracker, &counters, stall).unwrap();
            tracker.add_one();
        }
        let t0 = Instant::now();
        w.admit_within(&tracker, &counters, stall).unwrap();
        assert!(t0.elapsed() >= stall, "it waited for the stall limit first");
        assert_eq!(counters.window_overruns.load(Relaxed), 1);
        // Two more nodes fit (a quarter of 8), then it stalls again.
        for _ in 0..2 {
            tracker.add_one();
            w.admit_within(&tracker, &counters, stall).unwrap();
        }
        assert_eq!(
            counters.window_overruns.load(Relaxed),
            2,
            "{} unfinished",
            tracker.outstanding()
        );
        tracker.add_one();
        // Everything finishes: the next refresh finds the window empty, and insertion runs a
        // window's worth again without blocking.
        for _ in 0..tracker.outstanding() {
            tracker.done_one();
        }
        let stalls = counters.window_stalls.load(Relaxed);
        for _ in 0..7 {
            w.admit_within(&tracker, &counters, stall).unwrap();
            tracker.add_one();
        }
        assert_eq!(w.overrun, 0, "the overrun is spent once the window has room again");
        assert_eq!(counters.window_stalls.load(Relaxed), stalls);
        assert_eq!(counters.window_overruns.load(Relaxed), 2);
    }

    /// The finish that reaches the awaited count wakes the inserting thread at once: 200 waits
    /// that each lost their wake-up would take 20 s (the 100 ms backstop).
    #[test]
    fn the_awaited_finish_wakes_the_inserter() {
        let tracker = Arc::new(Tracker::new());
        let start = Instant::now();
        for round in 0..200u64 {
            for _ in 0..4 {
                tracker.add_one();
            }
            let finisher = {
                let t = tracker.clone();
                std::thread::spawn(move || {
                    for _ in 0..4 {
                        t.done_one();
                    }
                })
            };
            let done = tracker.wait_completed((round + 1) * 4 - 2, Duration::from_secs(30));
            assert!(done >= (round + 1) * 4 - 2);
            finisher.join().expect("finisher");
        }
        assert!(start.elapsed() < Duration::from_secs(10), "wake-ups were lost");
    }

    /// An unbounded window never blocks and never stalls.
    #[test]
    fn an_unbounded_window_admits_everything() {
        let tracker = Tracker::new();
        let counters = Counters::new(1, 0, Default::default());
        let mut w = SubmitWindow::new(0);
        for _ in 0..10_000 {
            w.admit(&tracker, &counters).unwrap();
            tracker.add_one();
        }
        assert_eq!(tracker.outstanding(), 10_000);
        assert_eq!(counters.window_stalls.load(Relaxed), 0);
    }

    /// An error recorded while insertion waits ends the wait with that error.
    #[test]
    fn an_error_ends_the_wait() {
        let tracker = Arc::new(Tracker::new());
        let counters = Counters::new(1, 0, Default::default());
        let mut w = SubmitWindow::new(4);
        for _ in 0..4 {
            w.admit(&tracker, &counters).unwrap();
            tracker.add_one();
        }
        let failer = {
            let t = tracker.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                t.fail(FerryError::InvalidArgument("boom".into()));
            })
        };
        let e = w
            .admit(&tracker, &counters)
            .expect_err("the window is full and the run failed");
        assert!(e.to_string().contains("boom"), "{e}");
        failer.join().unwrap();
    }
}
