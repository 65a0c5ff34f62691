//! Completion and finalize: the manager's poll of every event in flight (stage-ins, transfer
//! copies, kernels, stage-outs, write-backs) and the finalize stage of a task whose kernel has
//! completed — validity, pins, the LRU, the service-time estimate, and the callback that
//! releases its successors.

use super::phases::Phase;
use super::{key, timeline, Manager, Running, INITIAL_SERVICE_S};
use crate::data::copy::Location;
use ferry_device::{Backend, DeviceError, Stream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

impl<B: Backend> Manager<B> {
    /// Checks every event in flight; returns whether anything finished.
    pub(super) fn poll(&mut self) -> bool {
        let mut any = false;
        // Finished stage-ins (for the per-path active time).
        for d in 0..self.fly.stages.len() {
            while let Some(st) = self.fly.stages[d].front() {
                if !self.b.done(&st.event).unwrap_or(true) {
                    break;
                }
                let st = self.fly.stages[d].pop_front().expect("front exists");
                for p in st.paths {
                    self.clock.stop(p, &self.counters.traffic);
                }
                if let Some((start, seq, bytes)) = st.timed {
                    let info = timeline::OpInfo {
                        op: "stage-in",
                        seq,
                        bytes,
                    };
                    self.end_op(d, Stream::In, Some(start), &st.event, info);
                }
            }
        }
        // Transfer copies before tasks: a landed pull releases its consumers, which are on the
        // critical path; finalizing tasks (µs each) can wait that long.
        if !self.xfer.copies.is_empty() {
            let implied = self.consumers_done();
            any |= self.poll_copies(&implied);
        }
        // Finished tasks: only each stream's oldest task can be next.
        for q in 0..self.fly.running.len() {
            // A query that finds its event complete is the expensive one (1.4 µs on H200,
            // against 0.25 µs for a record): when a stream holds several tasks, ask the newest
            // first — if it is done, so is every task before it on the stream, and none of them
            // needs a query of its own. (When the manager falls behind, several tasks of a
            // stream finish between two passes: the saving comes when it is needed.)
            // Only the tasks there now: finalizing one may launch more onto this stream.
            let queued = self.fly.running[q].len();
            let mut settled = if queued > 1
                && self.fly.running[q]
                    .back()
                    .is_some_and(|newest| matches!(self.b.done(&newest.exec), Ok(true)))
            {
                queued
            } else {
                0
            };
            while let Some(front) = self.fly.running[q].front() {
                // A task released early is finalized after the tasks it follows (they finished
                // first on the device, but this pass may look at this queue before theirs):
                // finalizing in the other order would leave an older version current.
                if front.task.after.iter().any(|q| self.fly.launched.contains_key(q)) {
                    break;
                }
                let done = if front.done {
                    settled = settled.saturating_sub(1);
                    Ok(true)
                } else if settled > 0 {
                    settled -= 1;
                    Ok(true)
                } else {
                    self.b.done(&front.exec)
                };
                let result = match done {
                    Ok(false) => break,
                    Ok(true) => {
                        let (d, seq) = (front.dev, front.task.seq);
                        self.b
                            .take_launch_error(d, seq)
                            .map_or(Ok(()), |m| Err(DeviceError::Body(m)))
                    }
                    Err(e) => Err(e),
                };
                let r = self.fly.running[q].pop_front().expect("front exists");
                self.fly.in_flight -= 1;
                self.timed(Phase::Finalize, |m| m.finalize(r, result));
                any = true;
            }
        }
        any |= self.poll_stage_outs();
        let (done, freed) = self.poll_writebacks();
        any |= done;
        if freed || (any && !self.adm.waiting.is_empty()) {
            self.retry_waiting();
        }
        any
    }

    fn finalize(&mut self, r: Running<B::Event>, result: Result<(), DeviceError>) {
        let d = r.dev;
        let _span = tracing::info_span!(
            "gpu.finalize",
            class = r.task.kernel.name(),
            seq = r.task.seq,
            device = d
        )
        .entered();
        let Running {
            task,
            queue,
            launched,
            staged,
            sources,
            exec,
            timed,
            ..
        } = r;
        if timed.is_some() {
            let streams = self.b.exec_streams().max(1);
            let info = timeline::OpInfo {
                op: task.kernel.name(),
                seq: task.seq,
                bytes: 0,
            };
            self.end_op(d, Stream::Exec(queue % streams), timed, &exec, info);
        }
        // Service time: from when the task could start on its stream (launched, or the previous
        // task of the stream finished) to now; an exponential moving average per device.
        let now = Instant::now();
        let start = self.adm.last_done[queue].map_or(launched, |t| t.max(launched));
        self.adm.last_done[queue] = Some(now);
        // A sample is capped at 4× the estimate: a one-off stall (a library's first call, an
        // NVRTC compile of hundreds of ms on a stream's first task) would otherwise inflate the
        // estimate for many tasks, and placement would move whole tiles to the other device —
        // which then stay there (the 2-GPU stencil ended up split 22k/3k tasks). A real change
        // of task size still gets through within a few tasks.
        let sample = (now - start)
            .as_secs_f64()
            .min(4.0 * self.adm.service_s[d].max(INITIAL_SERVICE_S));
        self.adm.service_s[d] = 0.9 * self.adm.service_s[d] + 0.1 * sample;
        for (c, e) in &sources {
            c.lock().dev[*e].pins -= 1;
        }
        if self.fly.launched.remove(&task.seq).is_some() {
            // Its outputs are valid (below) rather than arriving.
            for x in task.tiles.iter().filter(|x| x.mode.writes()) {
                let k = key(&x.copy, d);
                if self.fly.arriving.get(&k).is_some_and(|e| Arc::ptr_eq(e, &exec)) {
                    self.fly.arriving.remove(&k);
                }
            }
        }
        let debug = ferry_base::debug::check_coherence();
        for x in &task.tiles {
            // Launch-ahead: a task launched after this one may already be writing the block
            // (the next writer of a tile this task read): its bytes are not what this task saw,
            // so the coherence check leaves the block alone until that writer is finalized.
            let overwritten =
                debug
                    && self.fly.arriving.get(&key(&x.copy, d)).is_some_and(|e| {
                        !Arc::ptr_eq(e, &exec) && staged.as_ref().is_none_or(|st| !Arc::ptr_eq(e, st))
                    });
            let mut s = x.copy.lock();
            if result.is_ok() {
                let h = s.dev[d]
                    .block
                    .filter(|_| debug && !overwritten)
                    .and_then(|b| self.b.debug_hash(d, b.offset, x.copy.bytes()));
                if x.mode.writes() {
                    s.produced_at(Location::Device(d));
                    if debug && !overwritten {
                        s.debug_hash = h;
                    }
                } else {
                    if debug && !overwritten && s.debug_hash.is_some() && h != s.debug_hash {
                        tracing::error!("coherence: task seq {} read tile {:?} on device {d}: device data differs from the current version (valid before: {})", task.seq, x.coords, s.dev[d].valid);
                    }
                    s.dev[d].valid = true;
                }
            }
            s.dev[d].pins -= 1;
            s.used(task.seq);
            drop(s);
            if let Some(ev) = &staged {
                let k = key(&x.copy, d);
                if self.fly.arriving.get(&k).is_some_and(|e| Arc::ptr_eq(e, ev)) {
                    self.fly.arriving.remove(&k);
                }
            }
            self.mem.next_stamp += 1;
            x.copy.lock().dev[d].lru_stamp = self.mem.next_stamp;
            self.mem.lru[d].push_back((Arc::downgrade(&x.copy), self.mem.next_stamp));
        }
        // Drop stale entries once they outnumber the live blocks: amortised O(1) per touch.
        if self.mem.lru[d].len() > 2 * (self.mem.pools[d].allocations() + 64) {
            self.mem.lru[d].retain(|(w, stamp)| {
                w.upgrade().is_some_and(|c| {
                    let s = c.lock();
                    s.dev[d].lru_stamp == *stamp && s.dev[d].block.is_some()
                })
            });
        }
        self.adm.load[d] -= 1;
        self.adm.admitted[d] -= 1;
        self.unbind_parts(&task);
        self.counters.device(d).tasks.fetch_add(1, Relaxed);
        self.timed(Phase::Callbacks, |_| (task.done)(result));
        self.timed(Phase::Launch, |m| m.pump(d));
        self.clean_ahead(d);
    }
}
