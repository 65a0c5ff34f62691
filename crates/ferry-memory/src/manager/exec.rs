//! Launch and exec: a task whose blocks are allocated is staged in and its body launched on an
//! exec stream; launch-ahead releases its GPU successors as soon as it is launched, and a
//! signal word after it tells peer processes when its output is complete.

use super::{key, GpuTask, LaunchSite, Manager, Running, Signal, Stage, CRITICAL_PRIORITY};
use ferry_device::{Backend, DeviceError, Launch, Mem, Stream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// What [`Manager::exec`] enqueued (what the stage-in enqueued is in its `StagedIn`).
struct Launched<E> {
    /// The exec stream's event after the body.
    exec: Arc<E>,
    /// Index of the (device, exec stream) queue.
    queue: usize,
    /// The kernel's start event (GPU timeline).
    timed: Option<E>,
}

impl<B: Backend> Manager<B> {
    /// Stage-in, then exec.
    pub(super) fn launch(&mut self, d: usize, mut t: GpuTask) {
        let launched = self.stage_in(d, &t).and_then(|mut st| {
            let waits = std::mem::take(&mut st.waits);
            self.exec(d, &t, waits).map(|l| (st, l))
        });
        match launched {
            Ok((st, l)) => {
                // Launch-ahead: what the successors it releases early must find (below).
                let ahead = t.launched.take().map(|f| {
                    let writes: smallvec::SmallVec<[(usize, usize); 4]> = t
                        .tiles
                        .iter()
                        .filter(|x| x.mode.writes())
                        .map(|x| key(&x.copy, d))
                        .collect();
                    (f, writes, t.seq, l.exec.clone())
                });
                let stream = l.queue % self.b.exec_streams().max(1);
                if let (Some(ev), false) = (&st.staged, st.staging.is_empty()) {
                    for &p in &st.staging {
                        self.clock.start(p);
                    }
                    self.fly.stages[d].push_back(Stage {
                        event: ev.clone(),
                        paths: st.staging,
                        timed: st.stage_timed.map(|(e, bytes)| (e, t.seq, bytes)),
                    });
                }
                self.fly.in_flight += 1;
                self.fly.running[l.queue].push_back(Running {
                    task: t,
                    dev: d,
                    exec: l.exec,
                    queue: l.queue,
                    launched: Instant::now(),
                    staged: st.staged,
                    _keep: st.keep,
                    sources: st.sources,
                    timed: l.timed,
                    done: false,
                });
                // Launch-ahead: the successors released early (posted to this thread, so they
                // are handled after what follows) find this task's outputs arriving — their
                // stage-in waits for it instead of copying the old data — and its event, which
                // their stream waits for. (The coherence checker also needs to know which
                // blocks a launched task is writing, early successors or not: see `finalize`.)
                if let Some((f, writes, seq, exec)) = ahead {
                    let released = {
                        let mut make = || self.signal_after(d, stream);
                        let mut site = LaunchSite {
                            device: d,
                            make: &mut make,
                            made: None,
                        };
                        f(&mut site)
                    };
                    if released || ferry_base::debug::check_coherence() {
                        for k in writes {
                            self.fly.arriving.insert(k, exec.clone());
                        }
                        self.fly.launched.insert(seq, exec);
                    }
                }
            }
            Err(e) => {
                for x in &t.tiles {
                    x.copy.lock().dev[d].pins -= 1;
                }
                self.finish_early(d, t, e);
            }
        }
    }

    /// Writes the next value of the signal word of exec stream `k` of `d` after the work on
    /// that stream (the task just launched there).
    fn signal_after(&mut self, d: usize, k: usize) -> Option<Signal> {
        if self.xfer.no_signals || k >= ferry_device::SIGNAL_SLOTS {
            return None;
        }
        let value = self.xfer.signals[d][k] + 1;
        match self.b.signal(d, Stream::Exec(k), k, value) {
            Ok(()) => {
                self.xfer.signals[d][k] = value;
                Some(Signal { dev: d, slot: k, value })
            }
            Err(e) => {
                tracing::warn!(device = d, error = %e, "no signals after launches: sends wait for their producer's completion");
                self.xfer.no_signals = true;
                None
            }
        }
    }

    /// Exec: launches `t`'s body on an exec stream of `d` after `waits` (what its stage-in found
    /// it must wait for).
    /// Exec stream 0 is the device's high-priority stream, kept for critical-path tasks; a task
    /// launched ahead follows its predecessor onto its stream ([`Manager::follows`]); a task
    /// waiting for device acknowledgements goes to its first written tile's stream
    /// ([`Manager::ack_stream`]); the others take the remaining streams round-robin.
    ///
    /// # Errors
    /// A failed driver call (a wait, the launch, the record).
    fn exec(
        &mut self,
        d: usize,
        t: &GpuTask,
        mut waits: super::stage_in::Waits<B::Event>,
    ) -> Result<Launched<B::Event>, DeviceError> {
        let _exec_span = tracing::info_span!("gpu.exec", class = t.kernel.name(), seq = t.seq, device = d).entered();
        let e = self.b.exec_streams().max(1);
        // Exec stream 0 is the device's high-priority stream, kept for critical-path tasks
        // (priority ≥ CRITICAL_PRIORITY); the others take the rest (round-robin unless they
        // follow a predecessor or wait for acknowledgements).
        let critical = t.priority >= CRITICAL_PRIORITY;
        let follows = self.follows(d, t, critical);
        let k = if e == 1 || critical {
            0
        } else if let Some((k, _)) = follows {
            k
        } else if let Some(k) = Self::ack_stream(t, e) {
            k
        } else {
            self.adm.next_exec[d] += 1;
            1 + self.adm.next_exec[d] % (e - 1)
        };
        let s = Stream::Exec(k);
        // The event of the task it follows needs no wait (it also comes through `waits` when
        // this task reads a tile that one is writing: `arriving`).
        let followed = follows.and_then(|(_, seq)| self.fly.launched.get(&seq).cloned());
        // Launch-ahead: also after the tasks that released this one early, those still running
        // (the one it follows on its stream is before it in stream order). One wait per event:
        // a comm-in consumer finds its copy's event both arriving and among those it follows.
        for q in &t.after {
            if follows.is_some_and(|(_, seq)| seq == *q) {
                continue;
            }
            if let Some(ev) = self.fly.launched.get(q) {
                waits.push(ev.clone());
            }
        }
        for (k, ev) in waits.iter().enumerate() {
            let seen = waits[..k].iter().any(|w| Arc::ptr_eq(w, ev));
            if seen || followed.as_ref().is_some_and(|f| Arc::ptr_eq(f, ev)) {
                continue;
            }
            self.b.wait(d, s, ev)?;
        }
        // Device acknowledgements: the consumers of the tiles this task overwrites have read
        // them once their words reach these values.
        for a in &t.acks {
            if a.dev != d {
                return Err(DeviceError::Body(format!(
                    "a task bound to device {} by an acknowledgement was placed on device {d}",
                    a.dev
                )));
            }
            let at = Mem::Pool(ferry_device::ack_offset(self.b.pool_bytes(d), a.word as usize));
            // After a failed run's shutdown released the words (`Manager::release_acks`),
            // nobody may write them any more.
            if !self.tune.skip_ack_wait && !self.xfer.acks_released {
                self.b.wait_signal(d, s, at, a.value)?;
            }
        }
        if !t.acks.is_empty() {
            self.counters.device(d).acked_on_device.fetch_add(1, Relaxed);
        }
        let tiles = t
            .tiles
            .iter()
            .map(|x| {
                let off = x.copy.lock().dev[d].block.expect("allocated").offset;
                x.view(self.b.addr(d, off) as *mut u8)
            })
            .collect();
        let launch = Launch {
            kernel: t.kernel.clone(),
            tiles,
            args: t.args.clone(),
            seq: t.seq,
            rank: t.rank,
            device: d,
        };
        let timed = self.begin_op(d, s);
        self.b.launch(s, launch)?;
        let exec = Arc::new(self.b.record(d, s)?);
        if follows.is_some() {
            self.counters.device(d).followed.fetch_add(1, Relaxed);
        }
        Ok(Launched {
            exec,
            queue: d * e + k,
            timed,
        })
    }

    /// The exec stream of a task that waits for device acknowledgements (`FERRY_DEVICE_ACK`):
    /// chosen by the first tile it writes, so that the writers of one tile keep to one stream.
    /// Such a task is launched before the consumer has read the tile, and its stream stalls at
    /// the wait until the word lands; round-robin would queue the next writers of other tiles
    /// behind that wait (each waiting on its own consumer), coupling tiles that are
    /// independent. `None` for a task without acknowledgements, or with no tile it writes, or
    /// with a single non-priority stream (`e ≤ 2`).
    fn ack_stream(t: &GpuTask, e: usize) -> Option<usize> {
        if t.acks.is_empty() || e <= 2 {
            return None;
        }
        let tile = t.tiles.iter().find(|x| x.mode.writes())?;
        Some(stream_of_tile(Arc::as_ptr(&tile.copy) as usize, e))
    }

    /// Stream affinity under launch-ahead: the exec stream of `d` (and the sequence number of
    /// the task there) whose newest task is one that `t` follows (a predecessor that released
    /// it early and is still running), if that stream is of `t`'s class (the high-priority
    /// stream 0 for a critical task, another for the rest) and the affinity is on
    /// (`FERRY_STREAM_AFFINITY`). On that stream, stream order replaces the wait for the
    /// predecessor's event — a dependency between streams costs the GPU a few µs between the
    /// two kernels (the 2-rank stencil's timeline on H200: 3.7–4.1 µs from a kernel's end to its
    /// successor's start on another stream) — and `t` queues behind nothing it does not wait for
    /// anyway.
    fn follows(&self, d: usize, t: &GpuTask, critical: bool) -> Option<(usize, u64)> {
        let e = self.b.exec_streams().max(1);
        if e == 1 || t.after.is_empty() || !self.tune.stream_affinity {
            return None;
        }
        let class = if critical { 0..1 } else { 1..e };
        class.into_iter().find_map(|k| {
            let seq = self.fly.running[d * e + k].back()?.task.seq;
            t.after.contains(&seq).then_some((k, seq))
        })
    }
}

/// The non-priority exec stream (1 … `e` − 1, `e` ≥ 2) that the tile copy at address `addr`
/// keeps to: Fibonacci hashing (Knuth, TAOCP vol. 3, §6.4), because allocation addresses share
/// their low bits and the product's high bits do not.
fn stream_of_tile(addr: usize, e: usize) -> usize {
    let h = (addr as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    1 + (h as usize) % (e - 1)
}

#[cfg(test)]
mod tests {
    use super::stream_of_tile;

    /// Tiles allocated one after another (addresses a few cache lines apart) spread over every
    /// non-priority stream, never onto the critical path's stream 0, and one tile always gets
    /// the same stream.
    #[test]
    fn tiles_spread_over_the_non_priority_streams() {
        for e in [3, 8, 17] {
            for stride in [64, 256, 4096] {
                let mut hit = vec![0; e];
                for k in 0..64 * e {
                    let addr = 0x7f00_0000_0000 + k * stride;
                    let s = stream_of_tile(addr, e);
                    assert!((1..e).contains(&s), "e {e}: stream {s}");
                    assert_eq!(s, stream_of_tile(addr, e));
                    hit[s] += 1;
                }
                assert!(hit[1..].iter().all(|&n| n > 0), "e {e}, stride {stride}: {hit:?}");
            }
        }
    }
}
