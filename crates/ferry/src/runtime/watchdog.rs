//! The watchdog: when no task, transfer or stage of this rank has finished for
//! `FERRY_WATCHDOG_S` seconds while work is outstanding, the rank reports what it is waiting for
//! and fails the run, which ends the MPI job (`FERRY_ABORT_ON_ERROR`) instead of burning the
//! allocation in a hang.
//!
//! Progress is the count of finished graph nodes (tasks, sends, receives). A single task body
//! that runs longer than the limit also trips it: set the limit above the longest task. When
//! that body runs on the inserting thread (`FERRY_INSERTER_HELPS`), which would otherwise end
//! the job on the error, the watchdog ends it (`MPI_Abort`) under `FERRY_ABORT_ON_ERROR`.

use crate::graph::tracker::Tracker;
use crate::stats::Counters;
use crossbeam::channel::{self, Sender};
use ferry_base::error::{FerryError, Rank};
use ferry_engine::EngineHandle;
use ferry_memory::manager::{GpuCmd, GpuHandle};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the watchdog watches for and does.
pub(super) struct Watch {
    /// This rank, for the error.
    pub(super) rank: Rank,
    /// Time without progress that counts as a hang (`FERRY_WATCHDOG_S`); zero: no watchdog.
    pub(super) limit: Duration,
    /// Whether an error ends the job (`FERRY_ABORT_ON_ERROR`).
    pub(super) abort_on_error: bool,
}

/// A running watchdog; dropping it stops the thread.
pub(super) struct Watchdog {
    stop: Option<Sender<()>>,
    join: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching `tracker` as `watch` says; a limit of zero disables the watchdog.
    pub(super) fn start(
        watch: Watch,
        tracker: Arc<Tracker>,
        counters: Arc<Counters>,
        engine: EngineHandle,
        gpu: Option<GpuHandle>,
        mailbox: Option<Arc<ferry_transfer::mailbox::Mailbox>>,
    ) -> std::io::Result<Watchdog> {
        let Watch {
            rank,
            limit,
            abort_on_error,
        } = watch;
        if limit.is_zero() {
            return Ok(Watchdog { stop: None, join: None });
        }
        let (stop, stopped) = channel::bounded::<()>(1);
        let period = (limit / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let join = std::thread::Builder::new()
            .name("ferry-watchdog".into())
            .spawn(move || {
                let mut last = (tracker.completed(), Instant::now());
                loop {
                    match stopped.recv_timeout(period) {
                        Err(channel::RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    let now = (tracker.completed(), Instant::now());
                    if now.0 != last.0 || tracker.outstanding() == 0 || tracker.is_poisoned() {
                        last = now;
                        continue;
                    }
                    if now.1 - last.1 < limit {
                        continue;
                    }
                    let mut report = format!("  {} local tasks and transfers unfinished\n", tracker.outstanding());
                    let mut inserting_stuck = false;
                    let threads = counters.workers.iter().chain([&counters.inserting]);
                    for (i, w) in threads.enumerate() {
                        let seq = w.current_seq.load(std::sync::atomic::Ordering::Acquire);
                        if seq == u64::MAX {
                            continue;
                        }
                        let who = if i < counters.inserting_worker() {
                            format!("worker-{i}")
                        } else {
                            inserting_stuck = true;
                            "the inserting thread".to_string()
                        };
                        let hash = w.current_class.load(std::sync::atomic::Ordering::Relaxed);
                        let start = w.current_start_ns.load(std::sync::atomic::Ordering::Relaxed);
                        let class = counters
                            .class_names
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get(&hash)
                            .cloned()
                            .unwrap_or_else(|| "?".into());
                        let running = counters.start.elapsed().as_secs_f64() - start as f64 * 1e-9;
                        report += &format!("  {who} has run task `{class}` #{seq} for {running:.1} s\n");
                    }
                    report += &engine.report();
                    if let Some(g) = &gpu {
                        let (tx, rx) = channel::bounded(1);
                        if g.post(GpuCmd::Report(tx)).is_ok() {
                            report += &rx
                                .recv_timeout(Duration::from_secs(1))
                                .unwrap_or_else(|_| "  GPU manager: no answer\n".into());
                        }
                    }
                    if let Some(m) = &mailbox {
                        report += &m.report();
                    }
                    tracker.fail(FerryError::Watchdog {
                        rank,
                        seconds: limit.as_secs(),
                        report,
                    });
                    // The thread that would end the job on the error (at its `wait`, or at
                    // shutdown) is in the body that does not return: end it from here.
                    if inserting_stuck && abort_on_error {
                        if let Err(e) = engine.abort_job_now() {
                            tracing::error!(error = %e, "ferry: the watchdog could not end the job");
                        }
                    }
                    return;
                }
            })?;
        Ok(Watchdog {
            stop: Some(stop),
            join: Some(join),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}
