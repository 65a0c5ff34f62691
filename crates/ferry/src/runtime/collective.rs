//! The collective operations of a runtime: `wait` (with graph-mismatch detection), gathers and
//! statistics across ranks.

use super::Runtime;
use crate::graph::epoch::{Difference, EpochHashes};
use crate::graph::{Task, TaskClass};
use crate::stats::{ClassStats, StatsSnapshot};
use ferry_base::error::{FerryError, GraphMismatch, Rank, Result};
use ferry_memory::data::Collection;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

impl Runtime {
    /// Waits until every task inserted so far has run on every rank and every transfer has
    /// completed; tiles written away from their owner are brought home first. Collective: every
    /// rank calls it at the same point of the sequence.
    ///
    /// Before waiting, the ranks compare the hash of their inserted sequences, so ranks that
    /// inserted different graphs get [`FerryError::GraphMismatch`] instead of a hang.
    ///
    /// # Errors
    /// [`FerryError::GraphMismatch`], a task's or transfer's error, or [`FerryError::Poisoned`]
    /// after an earlier error.
    pub fn wait(&self) -> Result<()> {
        self.refuse_in_trace("wait")?;
        // When the run failed, the first caller to wait gets the original error (the task that
        // failed, the MPI call…), later calls a `Poisoned` copy, whichever step noticed it.
        match self.wait_inner() {
            Err(e @ FerryError::Poisoned(_)) if self.dispatch.tracker.is_poisoned() => {
                Err(self.dispatch.tracker.take_error().unwrap_or(e))
            }
            r => r,
        }
    }

    fn wait_inner(&self) -> Result<()> {
        // Every rank takes part in both allgathers whatever happened to it, telling the others
        // its error if it has one: a rank that returned early would leave them blocked in one.
        {
            let mut ins = self.inserter_unchecked();
            ins.wait_entered = ins.seq;
        }
        let mine = self.inserter().map(|ins| {
            let mut m = Vec::with_capacity(16);
            m.extend_from_slice(&ins.seq.to_le_bytes());
            m.extend_from_slice(&ins.hash.to_le_bytes());
            m
        });
        let all = self.settle(mine)?;
        let per_rank: Vec<(u64, u64)> = all
            .iter()
            .map(|b| {
                let w =
                    |k: usize| u64::from_le_bytes(b.get(k..k + 8).and_then(|s| s.try_into().ok()).unwrap_or([0; 8]));
                (w(0), w(8))
            })
            .collect();
        if per_rank.iter().any(|p| *p != per_rank[0]) {
            let (first, descriptions) = self.locate_mismatch();
            let e = FerryError::GraphMismatch(GraphMismatch {
                per_rank,
                first_task: first.and_then(|d| match d {
                    Difference::Task(t) => Some(t),
                    Difference::Within(..) => None,
                }),
                within: first.and_then(|d| match d {
                    Difference::Within(lo, hi) => Some((lo, hi)),
                    Difference::Task(_) => None,
                }),
                descriptions,
            });
            self.dispatch.tracker.fail(e);
            return Err(self.dispatch.tracker.take_error().expect("just recorded"));
        }
        // Every rank inserts the transfers home, even one that has failed since the first
        // allgather: the owners of its tiles insert the matching receives (after an error the
        // graph drains without running bodies, but its transfers still go).
        self.inserter.lock().unwrap_or_else(|p| p.into_inner()).bring_home();
        self.dispatch.tracker.wait_idle();
        let mine = self.dispatch.tracker.take_error().map_or(Ok(Vec::new()), Err);
        self.settle(mine)?;
        self.inserter()?.new_epoch();
        Ok(())
    }

    /// Agrees on a step of `wait` that each rank took on its own (`CommHandle::agree`):
    /// every rank's payload, else this rank's own error, else an error naming the first rank
    /// that failed — whose failure fails this rank's run too (the job's graph cannot
    /// complete, and later calls must say so). Collective.
    fn settle(&self, mine: Result<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        // A rank tells the others its first error itself, not the copy that calls refused since
        // then carry ("the runtime stopped after an earlier error: …"): they report it as
        // "rank r failed: <error>".
        let told = mine.as_ref().cloned().map_err(|e| match e {
            FerryError::Poisoned(first) => first.clone(),
            e => e.to_string(),
        });
        let all = self.engine.agree(&told)?;
        mine?;
        all.map_err(|(r, msg)| {
            // Recorded for later calls; `wait` hands out the recorded original.
            let e = || FerryError::Poisoned(format!("rank {r} failed: {msg}"));
            self.dispatch.tracker.fail(e());
            e()
        })
    }

    /// After the ranks' sequence hashes differ (every rank is here): exchange the per-task hashes
    /// of the current epoch (`graph/epoch.rs`), find the first task they disagree on — or the
    /// block of tasks, past those hashed one by one — and gather each rank's description of
    /// that task; positions are in the whole sequence. Collective; best effort (an MPI error
    /// yields no location).
    fn locate_mismatch(&self) -> (Option<Difference>, Vec<String>) {
        let (start, mine) = {
            let ins = self.inserter.lock().unwrap_or_else(|p| p.into_inner());
            (ins.epoch_start, ins.epoch_hashes.encode())
        };
        let Ok(all) = self.engine.allgather(&mine) else {
            return (None, Vec::new());
        };
        let k = match EpochHashes::first_difference(&all) {
            None => return (None, Vec::new()),
            Some(Difference::Within(lo, hi)) => return (Some(Difference::Within(start + lo, start + hi)), Vec::new()),
            Some(Difference::Task(k)) => k,
        };
        let seq = start + k;
        let (description, recorded) = {
            let ins = self.inserter.lock().unwrap_or_else(|p| p.into_inner());
            (ins.describe_task(seq), ins.epoch_hashes.len())
        };
        let mine = description.unwrap_or_else(|| {
            if k < recorded {
                "a task no longer kept".into()
            } else {
                "no task (its sequence is shorter)".into()
            }
        });
        let descriptions = match self.engine.allgather(mine.as_bytes()) {
            Ok(d) => d
                .into_iter()
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .collect(),
            Err(_) => Vec::new(),
        };
        (Some(Difference::Task(seq)), descriptions)
    }

    /// Gathers every tile of `coll` on `root`: `Some(tiles)` there (tile `(i, j)` at index
    /// `i · tile_cols + j`), `None` elsewhere. Runs as tasks on `root` (the transfers are the
    /// runtime's own), then waits. Collective.
    ///
    /// # Errors
    /// As [`Runtime::wait`]; [`FerryError::InvalidArgument`] when `root` is not a rank or `coll`
    /// belongs to another runtime.
    pub fn gather<T: bytemuck::Pod + Send + Sync>(
        &self,
        coll: &Collection<T>,
        root: Rank,
    ) -> Result<Option<Vec<Vec<T>>>> {
        self.refuse_in_trace("gather")?;
        if root < 0 || root as usize >= self.size() {
            return Err(FerryError::InvalidArgument(format!("gather root {root} is not a rank")));
        }
        // Unchecked: a rank whose run failed must still reach the `wait` below with the others.
        self.inserter_unchecked().check_own(&coll.desc)?;
        let (mt, nt) = (coll.tile_rows(), coll.tile_cols());
        let slots: Arc<Mutex<Vec<Vec<T>>>> = Arc::new(Mutex::new(vec![Vec::new(); mt * nt]));
        let sink = slots.clone();
        let class = TaskClass::new("ferry.gather", move |ctx| {
            let (i, j) = ctx.coords(0)?;
            let nt = ctx.args()[0] as usize;
            let data = ctx.tile::<T>(0)?.to_vec();
            sink.lock().unwrap_or_else(|p| p.into_inner())[i * nt + j] = data;
            Ok(())
        });
        let args = [nt as i64];
        for i in 0..mt {
            for j in 0..nt {
                self.submit(Task::new(&class, &[coll.read(i, j)]).args(&args).on(root))?;
            }
        }
        self.wait()?;
        if self.rank() != root {
            return Ok(None);
        }
        let tiles = std::mem::take(&mut *slots.lock().unwrap_or_else(|p| p.into_inner()));
        Ok(Some(tiles))
    }

    /// Every rank's `value`, in rank order, on every rank (summing the result in order gives the
    /// same bits on every rank). Collective.
    ///
    /// # Errors
    /// An MPI error, or the error that stopped the runtime.
    pub fn allgather_f64(&self, value: f64) -> Result<Vec<f64>> {
        if let Some(e) = self.dispatch.tracker.error() {
            return Err(e);
        }
        let all = self.engine.allgather(&value.to_le_bytes())?;
        Ok(all
            .iter()
            .map(|b| f64::from_le_bytes(b.as_slice().try_into().unwrap_or([0; 8])))
            .collect())
    }

    /// Every rank's `value`, in rank order, on every rank. Collective.
    ///
    /// # Errors
    /// An MPI error, or the error that stopped the runtime.
    pub fn allgather_u64(&self, value: u64) -> Result<Vec<u64>> {
        Ok(self
            .allgather_f64(f64::from_bits(value))?
            .into_iter()
            .map(f64::to_bits)
            .collect())
    }

    /// This rank's statistics now.
    pub fn stats(&self) -> StatsSnapshot {
        let classes = self
            .classes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|c| ClassStats {
                name: c.name().to_string(),
                tasks: c.inner.stats.tasks.load(Relaxed),
                busy_s: c.inner.stats.busy_ns.load(Relaxed) as f64 * 1e-9,
            })
            .collect();
        let mut s = StatsSnapshot::capture(self.rank(), &self.counters, classes, &self.device_names);
        s.pinned_fallbacks = self.host_pool.as_ref().map_or(0, |p| p.fallbacks.load(Relaxed));
        s.pinned_bytes = self.host_pool.as_ref().map_or(0, |p| p.capacity());
        s.pinned_peak_bytes = self.host_pool.as_ref().map_or(0, |p| p.peak.load(Relaxed));
        s.pinned_pending_bytes = self.host_pool.as_ref().map_or(0, |p| p.unpinned());
        if let Some(t) = self.dispatch.transport.residency.tier() {
            s.tier.host_limit = Some(t.limit);
            s.tier.disk_peak = t.disk.as_ref().map_or(0, |d| d.peak.load(Relaxed));
        }
        if let Some(b) = self.dispatch.transport.bounce() {
            s.bounce_bytes = (b.slots() * b.chunk()) as u64;
            s.bounce_peak_bytes = (b.peak() * b.chunk()) as u64;
        }
        s
    }

    /// Every rank's statistics, in rank order, on every rank. Collective: a rank that cannot
    /// encode its record still takes part (the ranks agree on the outcome), so none is left
    /// waiting for it.
    ///
    /// # Errors
    /// An MPI error; a record that does not encode (on that rank; the others get an
    /// `InvalidArgument` naming it) or does not decode.
    pub fn gather_stats(&self) -> Result<Vec<StatsSnapshot>> {
        let mine = postcard::to_allocvec(&self.stats()).map_err(|e| format!("statistics encoding: {e}"));
        let all = self.engine.agree(&mine)?;
        mine.map_err(FerryError::InvalidArgument)?;
        all.map_err(|(r, msg)| FerryError::InvalidArgument(format!("rank {r}: {msg}")))?
            .iter()
            .map(|b| {
                postcard::from_bytes(b).map_err(|e| FerryError::InvalidArgument(format!("statistics decoding: {e}")))
            })
            .collect()
    }
}
