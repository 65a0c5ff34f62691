//! Device memory for a task: all-or-nothing reservation, and eviction when the pool is full.

use super::{GpuTask, Manager, WriteBack, ALIGN};
use crate::data::copy::TileCopy;
use ferry_base::traffic::TrafficPath;
use ferry_device::pool::Block;
use ferry_device::{Backend, DeviceError, Stream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::sync::Weak;

impl<B: Backend> Manager<B> {
    /// Reserves blocks for every tile of `t` on `d`, all or nothing, evicting when needed.
    /// `Ok(false)`: must wait for memory. Pins the copies on success.
    pub(super) fn try_alloc(&mut self, d: usize, t: &GpuTask) -> Result<bool, DeviceError> {
        let need: u64 = t
            .tiles
            .iter()
            .map(|x| (x.copy.bytes() as u64).div_ceil(ALIGN) * ALIGN)
            .sum();
        if need > self.mem.pools[d].capacity() {
            return Err(DeviceError::TooLarge {
                class: t.kernel.name().to_string(),
                need,
                device: d,
                capacity: self.mem.pools[d].capacity(),
            });
        }
        for attempt in 0..2 {
            let mut got: Vec<(usize, Block)> = Vec::new();
            let mut ok = true;
            for (k, x) in t.tiles.iter().enumerate() {
                if x.copy.lock().dev[d].block.is_some() {
                    continue;
                }
                let injected = self.b.fail_alloc(d);
                match (!injected)
                    .then(|| self.mem.pools[d].alloc(x.copy.bytes() as u64))
                    .flatten()
                {
                    Some(b) => got.push((k, b)),
                    None => {
                        self.counters.device(d).alloc_failures.fetch_add(1, Relaxed);
                        ok = false;
                        break;
                    }
                }
            }
            if ok {
                for (k, b) in got {
                    t.tiles[k].copy.lock().dev[d].block = Some(b);
                }
                for x in &t.tiles {
                    x.copy.lock().dev[d].pins += 1;
                }
                return Ok(true);
            }
            for (_, b) in got {
                self.mem.pools[d].free(b);
            }
            if attempt == 0 && !self.evict(d, need) {
                break;
            }
        }
        // Nothing to evict now: wait, holding nothing, for blocks to come back (running tasks,
        // stage-outs and write-backs all unpin theirs when they end; `run` also retries
        // periodically, which covers injected allocation faults).
        Ok(false)
    }

    /// The live entries of device `d`'s LRU in eviction order: the copy whose next use (the
    /// earliest unfinished task of this rank that accesses it, in insertion order) lies furthest
    /// in the future first, copies no inserted task uses before all; least recently used first
    /// among equals. Insertion runs ahead of execution, so the runtime knows the future accesses:
    /// this approximates Belady's optimal replacement (L. A. Belady, "A study of replacement
    /// algorithms for a virtual-storage computer", IBM Systems Journal 5(2), 1966), where plain
    /// LRU thrashes on the cyclic sweeps of tiled factorizations (each trailing update sweeps a
    /// matrix larger than the device: LRU evicts exactly the tile needed next).
    fn eviction_order(&mut self, d: usize) -> Vec<(Weak<TileCopy>, u64)> {
        let mut live: Vec<(u64, usize, (Weak<TileCopy>, u64))> = Vec::with_capacity(self.mem.lru[d].len());
        for (k, (w, stamp)) in std::mem::take(&mut self.mem.lru[d]).into_iter().enumerate() {
            let Some(copy) = w.upgrade() else { continue };
            let s = copy.lock();
            if s.dev[d].lru_stamp != stamp || s.dev[d].block.is_none() {
                continue;
            }
            live.push((s.next_use(), k, (w, stamp)));
        }
        // Furthest next use first; stable, so LRU order among equals.
        live.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        live.into_iter().map(|(_, _, e)| e).collect()
    }

    /// Frees at least `need` bytes on `d` if possible: drops clean unpinned copies in eviction
    /// order ([`Manager::eviction_order`]) and starts write-backs of dirty ones. Returns whether
    /// anything was freed or started.
    pub(super) fn evict(&mut self, d: usize, need: u64) -> bool {
        let mut freed = 0u64;
        let mut started = false;
        let mut keep = Vec::new();
        for w in self.eviction_order(d) {
            if freed >= need {
                keep.push(w);
                continue;
            }
            let Some(copy) = w.0.upgrade() else { continue };
            let mut s = copy.lock();
            if s.dev[d].lru_stamp != w.1 {
                continue;
            }
            let Some(block) = s.dev[d].block else { continue };
            if s.dev[d].pins > 0 {
                drop(s);
                keep.push(w);
                continue;
            }
            if !s.dev[d].valid || s.valid_elsewhere(d) {
                s.dev[d].block = None;
                s.dev[d].valid = false;
                drop(s);
                self.mem.pools[d].free(block);
                freed += block.len;
                self.counters.device(d).evictions.fetch_add(1, Relaxed);
                continue;
            }
            // Dirty, but a CPU task is writing the host buffer (its output supersedes this copy;
            // writing back now would clobber it), or another write-back of this copy, from an
            // older version on another device, is still landing in the same buffer (it could land
            // after this one and leave stale data marked current).
            if s.host_writers > 0 || s.writebacks_in_flight > 0 {
                drop(s);
                keep.push(w);
                continue;
            }
            // Dirty: write back to the host first, then free (in `poll`).
            drop(s);
            if self.write_back(d, &copy, block, true) {
                freed += block.len;
                started = true;
            }
            // Stays on the LRU: if the copy is written again during the write-back, the block is
            // kept and must remain evictable later.
            keep.push(w);
        }
        // Back in LRU order (by stamp: stamps grow with every touch).
        keep.sort_by_key(|(_, stamp)| *stamp);
        self.mem.lru[d] = keep.into();
        freed > 0 || started
    }

    /// Starts writing the dirty, unpinned copy `copy` back from `block` on `d` to the host, on
    /// the output stream; `free`: release the block once it has landed (eviction), else keep it,
    /// clean (cleaning ahead of need). Returns whether it started.
    fn write_back(&mut self, d: usize, copy: &Arc<TileCopy>, block: Block, free: bool) -> bool {
        let mut s = copy.lock();
        let host = s.host_buf(copy.bytes());
        if ferry_base::debug::check_coherence() {
            let h = self.b.debug_hash(d, block.offset, copy.bytes());
            if s.debug_hash.is_some() && h != s.debug_hash {
                tracing::error!(
                    "coherence: write-back start: device {d} block already stale (gen {}, pins {})",
                    s.generation,
                    s.dev[d].pins
                );
            }
        }
        s.dev[d].pins += 1;
        s.writebacks_in_flight += 1;
        let generation = s.generation;
        drop(s);
        let timed = self.begin_op(d, Stream::Out);
        // SAFETY: the host buffer (held below) and the block (pinned) stay alive until the event
        // recorded below completes.
        let r = unsafe { self.b.d2h(d, Stream::Out, host.as_ptr(), block.offset, copy.bytes()) }
            .and_then(|_| self.b.record(d, Stream::Out));
        match r {
            Ok(event) => {
                self.clock.start(TrafficPath::DeviceToHost);
                self.counters
                    .path(TrafficPath::DeviceToHost)
                    .bytes_sent
                    .fetch_add(copy.bytes() as u64, Relaxed);
                self.counters
                    .path(TrafficPath::DeviceToHost)
                    .sends
                    .fetch_add(1, Relaxed);
                let dc = self.counters.device(d);
                if free { &dc.writebacks } else { &dc.cleanings }.fetch_add(1, Relaxed);
                self.mem.writebacks.push(WriteBack {
                    copy: copy.clone(),
                    dev: d,
                    event,
                    generation,
                    free,
                    _host: host,
                    timed,
                });
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "write-back failed");
                let mut s = copy.lock();
                s.dev[d].pins -= 1;
                s.writebacks_in_flight -= 1;
                false
            }
        }
    }

    /// Keeps the first `low_water` bytes of device `d`'s eviction order clean: when free memory
    /// is below the mark, dirty unpinned copies there are written back (and kept), so that the
    /// next allocation that must evict only drops copies instead of waiting for write-backs.
    /// Only copies that no inserted task uses again are cleaned: a copy that a later task
    /// writes would be written back twice (measured on a tiled Cholesky 1.5× the device:
    /// cleaning every dirty copy in eviction order took 2.4× the device→host traffic and saved
    /// no host→device copy). Bounded by the entries that cover the mark.
    pub(super) fn clean_ahead(&mut self, d: usize) {
        let mark = (self.mem.pools[d].capacity() as f64 * self.tune.low_water) as u64;
        let free = self.mem.pools[d].capacity() - self.mem.pools[d].used();
        if mark == 0 || free >= mark {
            return;
        }
        let mut ready = free;
        let mut dirty = Vec::new();
        let order = self.eviction_order(d);
        for (w, stamp) in order.iter() {
            if ready >= mark {
                break;
            }
            let Some(copy) = w.upgrade() else { continue };
            let s = copy.lock();
            if s.dev[d].lru_stamp != *stamp || s.dev[d].pins > 0 {
                continue;
            }
            let Some(block) = s.dev[d].block else { continue };
            ready += block.len;
            let clean = !s.dev[d].valid || s.valid_elsewhere(d);
            if !clean && s.next_use() == u64::MAX && s.host_writers == 0 && s.writebacks_in_flight == 0 {
                drop(s);
                dirty.push((copy, block));
            }
        }
        let mut order = order;
        order.sort_by_key(|(_, stamp)| *stamp);
        self.mem.lru[d] = order.into();
        for (copy, block) in dirty {
            self.write_back(d, &copy, block, false);
        }
    }

    /// Checks the write-backs in flight; returns (whether any finished, whether a block was freed).
    pub(super) fn poll_writebacks(&mut self) -> (bool, bool) {
        let mut any = false;
        let mut freed = false;
        let mut k = 0;
        while k < self.mem.writebacks.len() {
            if self.b.done(&self.mem.writebacks[k].event).unwrap_or(true) {
                let WriteBack {
                    copy,
                    dev,
                    generation,
                    free,
                    event,
                    timed,
                    ..
                } = self.mem.writebacks.swap_remove(k);
                self.clock.stop(TrafficPath::DeviceToHost, &self.counters.traffic);
                let info = super::timeline::OpInfo {
                    op: if free { "write-back" } else { "clean-ahead" },
                    seq: 0,
                    bytes: copy.bytes() as u64,
                };
                self.end_op(dev, Stream::Out, timed, &event, info);
                let mut s = copy.lock();
                s.dev[dev].pins -= 1;
                s.writebacks_in_flight -= 1;
                // A GPU task may have written the copy while it was being written back (eviction
                // is not ordered by the task graph): then the host data is stale and the device
                // block holds the only current data.
                // Mark the host current only when nobody else holds the block: a task pinning it may
                // be writing it right now (it was launched on the pinned block after the write-back
                // started), and its write lands in the generation only when it finishes.
                let current = s.generation == generation && s.dev[dev].pins == 0;
                if current {
                    if ferry_base::debug::check_coherence() {
                        // SAFETY: debugging only.
                        let h = s.host.as_ref().map(|b| ferry_base::hash::bytes(unsafe { b.bytes() }));
                        if s.debug_hash.is_some() && h != s.debug_hash {
                            tracing::error!("coherence: write-back from device {} landed stale data (gen {}, valid {:?}, host_valid {})", dev, s.generation, s.dev.iter().map(|c| c.valid).collect::<Vec<_>>(), s.host_valid);
                        }
                    }
                    s.host_valid = true;
                }
                if current && free {
                    if let Some(b) = s.dev[dev].block.take() {
                        s.dev[dev].valid = false;
                        drop(s);
                        self.mem.pools[dev].free(b);
                        self.counters.device(dev).evictions.fetch_add(1, Relaxed);
                        freed = true;
                    }
                }
                any = true;
            } else {
                k += 1;
            }
        }
        (any, freed)
    }
}
