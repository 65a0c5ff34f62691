//! Memory tiers beyond the devices: a host-memory budget with least-recently-used eviction, and
//! a disk tier that host copies spill to when the budget is exceeded.
//!
//! The device tier is the GPU manager's (`manager/memory.rs`): it evicts to host memory.
//! This module takes over from there:
//!
//! - Every host buffer of a tile copy is charged to the [`HostTier`] budget
//!   (`FERRY_HOST_MEM_LIMIT`, or `FERRY_HOST_MEM_FRACTION` of the node's memory per rank) and
//!   filed in a host LRU each time it is used. When the budget is exceeded the I/O thread evicts
//!   in LRU order down to a low-water mark (7/8 of the budget): a copy whose data is also valid
//!   elsewhere (a device, or its disk slot) is dropped; a dirty one is written to its disk slot
//!   first, then dropped. A copy in use is never evicted: host pins (tasks and sends between
//!   dispatch and completion), CPU writers, write-backs landing, and any other holder of the
//!   buffer (transfers and copies hold it while they run) all keep it.
//! - Data valid only on disk is brought back by [`Residency::to_host`] on demand (counted as a
//!   wait), or ahead of time by the prefetcher, which looks along the inserted task sequence
//!   (`FERRY_PREFETCH_TASKS` tasks past the oldest not yet dispatched) and loads what those
//!   tasks read while the budget has room (eviction stops at the low-water mark: the band up to
//!   the budget is the prefetcher's).
//! - Loads read into a fresh buffer and install it only if no newer version appeared meanwhile,
//!   and spills mark the disk slot valid only if the version did not change while they wrote: a
//!   transfer between tiers never races a writer.
//!
//! Without a host budget (the default when no disk tier is configured) none of this runs: host
//! buffers are neither counted nor filed, and the hot paths pay nothing.

mod disk;
mod io;
mod prefetch;

pub use disk::DiskStore;
pub use io::IoCmd;

use crate::counters::MemoryCounters;
use crate::data::budget::HostBudget;
use crate::data::copy::TileCopy;
use crate::manager::{GpuCmd, GpuHandle};
use crossbeam::channel::Sender;
use ferry_base::error::FerryError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

/// Called when a move between tiers ends.
pub type Then = Box<dyn FnOnce(Result<(), FerryError>) + Send>;

/// The host budget, its LRU, the disk store and the I/O thread's mailbox.
pub struct HostTier {
    /// Bytes of host tile buffers allowed at once (0: every unused buffer goes to disk).
    pub limit: u64,
    /// Eviction stops at this many bytes in use (the band above it, up to the limit, is room
    /// for prefetching).
    pub low_water: u64,
    used: AtomicU64,
    /// Least recently used first; entries whose stamp is not the copy's current one are stale.
    lru: Mutex<VecDeque<(Weak<TileCopy>, u64)>>,
    stamp: AtomicU64,
    /// A `Relieve` is queued for the I/O thread.
    pressure: AtomicBool,
    io: Sender<IoCmd>,
    /// The disk tier, when one is configured.
    pub disk: Option<Arc<DiskStore>>,
    /// What the prefetcher should load next.
    pub prefetch: prefetch::Prefetch,
    /// This layer's statistics.
    pub counters: Arc<MemoryCounters>,
}

/// The host tier is the budget that copies' host buffers count against.
impl HostBudget for HostTier {
    fn charge(&self, bytes: usize) {
        HostTier::charge(self, bytes);
    }
    fn uncharge(&self, bytes: usize) {
        HostTier::uncharge(self, bytes);
    }
    fn touch(&self, me: &Weak<TileCopy>, stamp: &mut u64) {
        HostTier::touch(self, me, stamp);
    }
    fn release_disk(&self, slot: ferry_device::pool::Block) {
        if let Some(d) = &self.disk {
            d.release(slot);
        }
    }
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostTier({} of {} bytes)", self.used(), self.limit)
    }
}

impl HostTier {
    /// Starts the host tier and its I/O thread. `fail` reports an error of the disk tier that
    /// no caller waits for (a spill that could not be written) to the run.
    pub fn start(
        limit: u64,
        disk: Option<DiskStore>,
        prefetch_tasks: usize,
        counters: Arc<MemoryCounters>,
        fail: Box<dyn Fn(FerryError) + Send>,
    ) -> std::io::Result<(Arc<HostTier>, JoinHandle<()>)> {
        let (tx, rx) = crossbeam::channel::unbounded();
        let tier = Arc::new(HostTier {
            limit,
            low_water: limit - limit / 8,
            used: AtomicU64::new(0),
            lru: Mutex::new(VecDeque::new()),
            stamp: AtomicU64::new(0),
            pressure: AtomicBool::new(false),
            io: tx,
            disk: disk.map(Arc::new),
            prefetch: prefetch::Prefetch::new(prefetch_tasks),
            counters,
        });
        let t = tier.clone();
        let join = std::thread::Builder::new()
            .name("ferry-io".into())
            .spawn(move || io::run(&t, rx, fail))?;
        Ok((tier, join))
    }

    /// Bytes of host tile buffers alive now.
    pub fn used(&self) -> u64 {
        self.used.load(Relaxed)
    }

    /// A new host buffer of `bytes` bytes exists: count it, and ask for eviction past the budget.
    pub fn charge(&self, bytes: usize) {
        let now = self.used.fetch_add(bytes as u64, Relaxed) + bytes as u64;
        self.counters.tier.host_peak.fetch_max(now, Relaxed);
        if now > self.limit {
            self.relieve_soon();
        }
    }

    /// A host buffer of `bytes` bytes is gone.
    pub fn uncharge(&self, bytes: usize) {
        self.used.fetch_sub(bytes as u64, Relaxed);
    }

    /// Files the copy behind `me` as the most recently used; `stamp` is its state's stamp.
    /// Called with that copy's state locked (`stamp` lives there).
    pub fn touch(&self, me: &Weak<TileCopy>, stamp: &mut u64) {
        let s = self.stamp.fetch_add(1, Relaxed) + 1;
        *stamp = s;
        let mut lru = self.lru.lock().unwrap_or_else(|p| p.into_inner());
        lru.push_back((me.clone(), s));
        // Drop stale entries once they dominate: amortised O(1) per touch. A copy whose state is
        // locked now keeps its entries: the caller holds its own copy's lock, and another thread
        // may hold a copy's lock while it waits for this list — locking either here would
        // deadlock (the caller's own lock always did, once the list reached 8192 entries).
        if lru.len() > 4096 && lru.len() % 4096 == 0 {
            lru.retain(|(w, st)| {
                w.upgrade()
                    .is_some_and(|c| c.try_lock().is_none_or(|state| state.host_stamp == *st))
            });
        }
    }

    fn relieve_soon(&self) {
        if !self.pressure.swap(true, Relaxed) {
            let _ = self.io.send(IoCmd::Relieve);
        }
    }

    /// Loads the copies valid only on disk back into host memory, then calls `then`.
    pub fn load(&self, copies: Vec<Arc<TileCopy>>, then: Then) {
        let cmd = IoCmd::Load {
            copies,
            then,
            since: Instant::now(),
        };
        if let Err(e) = self.io.send(cmd) {
            if let IoCmd::Load { then, .. } = e.0 {
                then(Err(FerryError::ThreadLost("io")));
            }
        }
    }

    /// Tells the prefetcher about a task inserted on this rank and the copies it reads.
    pub fn note_insert(&self, seq: u64, reads: Vec<Weak<TileCopy>>) {
        if self.disk.is_some() && self.prefetch.insert(seq, reads) {
            let _ = self.io.send(IoCmd::Prefetch);
        }
    }

    /// Tells the prefetcher that a task was dispatched (it no longer needs prefetching).
    pub fn note_dispatch(&self, seq: u64) {
        if self.disk.is_some() && self.prefetch.remove(seq) {
            let _ = self.io.send(IoCmd::Prefetch);
        }
    }

    /// Stops the I/O thread (pending loads are answered first).
    pub fn shutdown(&self) {
        let _ = self.io.send(IoCmd::Shutdown);
    }

    fn pop_lru(&self) -> Option<(Weak<TileCopy>, u64)> {
        self.lru.lock().unwrap_or_else(|p| p.into_inner()).pop_front()
    }

    fn push_front_lru(&self, kept: Vec<(Weak<TileCopy>, u64)>) {
        let mut lru = self.lru.lock().unwrap_or_else(|p| p.into_inner());
        for e in kept.into_iter().rev() {
            lru.push_front(e);
        }
    }
}

/// Whether the copy's current data is only in its disk slot.
pub fn disk_only(s: &crate::data::copy::CopyState) -> bool {
    s.disk_valid && !s.host_valid && !s.dev.iter().any(|c| c.valid)
}

/// Brings copies into host memory from wherever their current data lives: a device (a
/// stage-out by the GPU manager) or the disk (a load by the I/O thread). Used by every host
/// consumer: CPU tasks, sends from host memory, reads of results.
pub struct Residency {
    /// The GPU manager, for stage-outs (none without devices).
    pub gpu: Option<GpuHandle>,
    /// The host tier, for loads from disk (none without a budget).
    pub host: Option<Arc<HostTier>>,
}

impl Residency {
    /// Calls `then` once every copy in `copies` is valid in host memory (at once when all are).
    /// Callers pin the copies' host memory first (`host_pins`) when a host budget is in force,
    /// so that nothing brought in is evicted again before they use it.
    pub fn to_host(&self, copies: Vec<Arc<TileCopy>>, then: Then) {
        let (mut from_device, mut from_disk) = (Vec::new(), Vec::new());
        for c in copies {
            let s = c.lock();
            if s.host_valid && s.writebacks_in_flight == 0 {
                continue;
            }
            let on_disk = disk_only(&s) && s.writebacks_in_flight == 0;
            drop(s);
            if on_disk && self.host.is_some() {
                from_disk.push(c);
            } else {
                from_device.push(c);
            }
        }
        let jobs = usize::from(!from_device.is_empty()) + usize::from(!from_disk.is_empty());
        if jobs == 0 {
            return then(Ok(()));
        }
        let join = ferry_base::join::Join::new(jobs, then);
        if !from_device.is_empty() {
            match &self.gpu {
                Some(gpu) => {
                    let j = join.clone();
                    let cmd = GpuCmd::ToHost {
                        copies: from_device,
                        then: Box::new(move |r| j.arrive(r.map_err(FerryError::Device))),
                    };
                    if let Err(e) = gpu.post(cmd) {
                        join.arrive(Err(FerryError::Device(e)));
                    }
                }
                // No devices: a copy not valid on the host is a zero-initialised one.
                None => join.arrive(Ok(())),
            }
        }
        if !from_disk.is_empty() {
            let host = self.host.as_ref().expect("checked above");
            let j = join.clone();
            host.load(from_disk, Box::new(move |r| j.arrive(r)));
        }
    }

    /// The host tier, when a budget is in force.
    pub fn tier(&self) -> Option<&Arc<HostTier>> {
        self.host.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::copy::CopyEnv;
    use std::time::Duration;

    /// Touches past the 8192-entry mark sweep the list while the touched copy's lock is held:
    /// the sweep once locked it again (a self-deadlock). It must finish, keep the locked copy's
    /// entries, and drop the stale entries of copies nobody holds.
    #[test]
    fn touching_past_the_sweep_mark_does_not_deadlock() {
        let counters = Arc::new(MemoryCounters::new(0));
        let (tier, _io) = HostTier::start(1 << 40, None, 0, counters, Box::new(|_| {})).unwrap();
        let env = CopyEnv {
            tier: Some(tier.clone() as Arc<dyn HostBudget>),
            ..CopyEnv::default()
        };
        let (tx, rx) = crossbeam::channel::bounded(1);
        let t = tier.clone();
        std::thread::spawn(move || {
            let idle = TileCopy::host(8, &env);
            let _first = idle.lock().host_buf(8);
            // Stale at once: the entry above is superseded by this one.
            let _second = idle.lock().host_buf(8);
            let busy = TileCopy::host(8, &env);
            let len = || t.lru.lock().unwrap().len();
            while len() < 8191 {
                drop(busy.lock().host_buf(8));
            }
            // The 8192nd entry sweeps, under `busy`'s lock.
            drop(busy.lock().host_buf(8));
            let _ = tx.send((len(), idle, busy));
        });
        let (len, idle, busy) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the sweep deadlocked on the touched copy's own lock");
        // `busy` was locked during the sweep: all of its 8190 entries stay; `idle` keeps only
        // its current one.
        assert_eq!(len, 8191, "entries after the sweep");
        let lru = tier.lru.lock().unwrap();
        let idle_entries = lru.iter().filter(|(w, _)| w.ptr_eq(&Arc::downgrade(&idle))).count();
        assert_eq!(idle_entries, 1);
        let stamp = busy.lock().host_stamp;
        assert!(lru
            .iter()
            .any(|(w, st)| w.ptr_eq(&Arc::downgrade(&busy)) && *st == stamp));
    }
}
