//! Where the GPU manager's time goes: a stopwatch that charges the thread's wall time to what it
//! is doing (exclusive time: a launch made while finalizing is charged to launches, not to
//! finalization), published as `ferry::stats::ManagerPhases`.
//!
//! One `Instant::now()` per switch (≈ 20 ns on Linux, a vDSO call), about six per task: on
//! 2× H200 that cost the empty-GPU-task rate 6–7% (317–349k tasks/s against 354–374k), so the
//! stopwatch runs only when asked for (`FERRY_GPU_PHASES`); off, a switch is one branch.

use crate::counters::MemoryCounters;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// What the manager thread is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Napping or blocked, waiting for a command or an event.
    Idle = 0,
    /// Taking commands off its channel and serving them (reservations, pins, stage-out
    /// requests, tasks queued by priority).
    Commands,
    /// Enqueuing transfer copies (IPC pulls, bounce-buffer chunks).
    Copies,
    /// Admitting tasks: allocation, eviction, stage-in and the kernel launch.
    Launch,
    /// Querying events of copies, stage-ins, tasks, write-backs.
    Poll,
    /// The manager's own bookkeeping when a task ends (validity, pins, LRU).
    Finalize,
    /// Completion callbacks it runs for others: the graph releasing a task's successors, the
    /// transfer layer acknowledging a copy.
    Callbacks,
}

/// How many phases there are.
pub const PHASES: usize = 7;

/// Charges elapsed time to the current phase.
pub(super) struct Stopwatch {
    on: bool,
    phase: Phase,
    since: Instant,
    ns: [u64; PHASES],
}

impl Stopwatch {
    /// A stopwatch that times only when `on`.
    pub(super) fn new(on: bool) -> Self {
        Stopwatch {
            on,
            phase: Phase::Commands,
            since: Instant::now(),
            ns: [0; PHASES],
        }
    }

    /// Charges the time since the last switch to the current phase and enters `p`; returns
    /// the phase left (to switch back to).
    pub(super) fn switch(&mut self, p: Phase) -> Phase {
        if !self.on {
            return p;
        }
        let now = Instant::now();
        self.ns[self.phase as usize] += now.saturating_duration_since(self.since).as_nanos() as u64;
        self.since = now;
        std::mem::replace(&mut self.phase, p)
    }

    /// Adds what was charged since the last publication to the rank's counters.
    pub(super) fn publish(&mut self, counters: &MemoryCounters) {
        if !self.on {
            return;
        }
        for (c, ns) in counters.gpu_phase_ns.iter().zip(&mut self.ns) {
            if *ns > 0 {
                c.fetch_add(std::mem::take(ns), Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Time goes to the phase that was current, nested phases are exclusive, and publishing
    /// moves it to the counters once.
    #[test]
    fn charges_exclusive_time_to_the_current_phase() {
        let counters = MemoryCounters::new(1);
        let mut w = Stopwatch::new(true);
        w.switch(Phase::Finalize);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let prev = w.switch(Phase::Launch);
        assert_eq!(prev, Phase::Finalize);
        std::thread::sleep(std::time::Duration::from_millis(40));
        w.switch(prev);
        w.switch(Phase::Idle);
        w.publish(&counters);
        w.publish(&counters);
        let ns = |p: Phase| counters.gpu_phase_ns[p as usize].load(Relaxed);
        assert!(ns(Phase::Finalize) >= 20_000_000, "{}", ns(Phase::Finalize));
        // Had the nested launch been charged to finalize too, it would hold ≥ 60 ms.
        assert!(ns(Phase::Finalize) < 40_000_000, "{}", ns(Phase::Finalize));
        assert!(ns(Phase::Launch) >= 40_000_000, "{}", ns(Phase::Launch));
        assert_eq!(ns(Phase::Poll), 0);
        // Off, nothing is charged.
        let mut off = Stopwatch::new(false);
        off.switch(Phase::Poll);
        std::thread::sleep(std::time::Duration::from_millis(5));
        off.switch(Phase::Idle);
        off.publish(&counters);
        assert_eq!(ns(Phase::Poll), 0);
    }
}
