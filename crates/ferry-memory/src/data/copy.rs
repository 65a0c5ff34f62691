//! One rank's copy of one version of a tile, across its locations: host memory and the local
//! devices.
//!
//! Coherence within a rank is single-writer, many-readers, ordered by the task graph: the node
//! that writes a copy runs alone, so validity flags change only when a writer finishes (the new
//! data is valid exactly where it was produced) or when staging finishes (one more location holds
//! it). The mutex guards those short updates; nobody holds it across a wait.

use super::buffer::TileBuf;
use super::host_pool::HostPool;
use crate::data::budget::{BudgetLink, HostBudget};
use crossbeam::channel::Sender;
use crossbeam::utils::CachePadded;
use ferry_device::pool::Block;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// How a host buffer is made: [`TileBuf::zeroed_in`] or [`TileBuf::landing_in`].
type MakeBuf = fn(Option<&Arc<HostPool>>, usize, Option<&Arc<dyn HostBudget>>) -> TileBuf;

/// Where one copy of a tile lives on a device.
#[derive(Debug, Default)]
pub struct DevCopy {
    /// Allocation in the device pool, if any.
    pub block: Option<Block>,
    /// Whether the allocation holds the copy's current data.
    pub valid: bool,
    /// In-flight users (GPU tasks, staging, write-back): a pinned copy is never evicted.
    pub pins: u32,
    /// Stamp of the copy's latest entry in its device's LRU queue; older entries are stale.
    pub lru_stamp: u64,
}

/// The state of a copy; see the module documentation.
#[derive(Debug)]
pub struct CopyState {
    /// Host memory of the copy, allocated on first need (zeroed: a copy valid on the host with no
    /// buffer yet holds zeros).
    pub host: Option<Arc<TileBuf>>,
    /// Whether the host buffer holds the current version.
    pub host_valid: bool,
    /// One entry per local device (empty without devices).
    pub dev: Vec<DevCopy>,
    /// Number of writes so far: a write-back started before a write must not mark the host copy
    /// valid when it lands after it.
    pub generation: u64,
    /// CPU tasks writing the host buffer now: eviction must not write back into it meanwhile.
    pub host_writers: u32,
    /// Where host buffers come from (the pinned pool), if devices are in use.
    pub host_pool: Option<Arc<HostPool>>,
    /// Eviction write-backs into the host buffer in flight: a CPU writer waits for them to land
    /// before it writes (stage-outs for readers are ordered by the graph; write-backs are not).
    pub writebacks_in_flight: u32,
    /// With `FERRY_CHECK_COHERENCE`: hash of the current data, when known.
    pub debug_hash: Option<u64>,
    /// Consumers committed to the host buffer (a CPU task from dispatch to its end, a send, a
    /// read of the result): the host tier never evicts a pinned buffer.
    pub host_pins: u32,
    /// The host tier, when a budget is in force.
    pub tier: Option<BudgetLink>,
    /// Stamp of the copy's latest entry in the host LRU.
    pub host_stamp: u64,
    /// Slot in the rank's spill file, once the copy has spilled (kept for later versions).
    pub disk: Option<Block>,
    /// Whether the slot holds the current data.
    pub disk_valid: bool,
    /// Sequence numbers of the inserted, unfinished tasks of this rank that access the copy, in
    /// insertion order (kept only with devices): the device evicts the copy needed furthest in
    /// the future first.
    pub uses: std::collections::VecDeque<u64>,
    /// GPU tasks that write parts of the copy ([`crate::data::AccessMode::ReadWritePart`]),
    /// placed on a device and not finalized yet: that device, and how many. They all write
    /// their parts into that device's block, so the GPU manager places the group's other
    /// members there too.
    pub part_writers: Option<(usize, u32)>,
}

impl CopyState {
    /// Whether some location other than device `d` holds the data. The disk does not count: a
    /// device copy whose data is also on disk is written back to the host rather than dropped,
    /// so that a stage-out already asked of the GPU manager always finds the data on a device or
    /// the host (the disk is the I/O thread's, not the manager's).
    pub fn valid_elsewhere(&self, d: usize) -> bool {
        self.host_valid || self.dev.iter().enumerate().any(|(e, c)| e != d && c.valid)
    }

    /// The next task that uses the copy (its sequence number; `u64::MAX`: none inserted).
    pub fn next_use(&self) -> u64 {
        self.uses.front().copied().unwrap_or(u64::MAX)
    }

    /// Task `seq` is over: it no longer counts as a use.
    pub fn used(&mut self, seq: u64) {
        if let Some(k) = self.uses.iter().position(|&x| x == seq) {
            self.uses.remove(k);
        }
    }

    /// The host buffer, allocated (pinned when the pool has room) if missing; with a host
    /// budget, the copy becomes the most recently used of the host tier.
    pub fn host_buf(&mut self, bytes: usize) -> Arc<TileBuf> {
        self.host_buf_from(bytes, TileBuf::zeroed_in)
    }

    /// The host buffer for a receive that writes all of it before anyone reads it: as
    /// [`CopyState::host_buf`], except that a buffer made here is not zeroed
    /// ([`TileBuf::landing_in`]).
    pub fn landing_host_buf(&mut self, bytes: usize) -> Arc<TileBuf> {
        self.host_buf_from(bytes, TileBuf::landing_in)
    }

    /// The host buffer, made by `make` (from the pinned pool and charged to the host budget) if
    /// missing; the copy becomes the host tier's most recently used.
    fn host_buf_from(&mut self, bytes: usize, make: MakeBuf) -> Arc<TileBuf> {
        if self.host.is_none() {
            let tier = self.tier.as_ref().map(|t| &t.budget);
            self.host = Some(Arc::new(make(self.host_pool.as_ref(), bytes, tier)));
        }
        self.touch_host();
        self.host.clone().expect("set above")
    }

    /// Removes the host buffer if it is `buf` (a receive's landing buffer that the receive did
    /// not fill: see `ferry-transfer/src/region.rs`, `TileLanding::discard`).
    pub fn forget_host(&mut self, buf: &Arc<TileBuf>) {
        if self.host.as_ref().is_some_and(|h| Arc::ptr_eq(h, buf)) {
            self.host = None;
        }
    }

    /// Whether someone uses the host buffer: a consumer pinned it (a CPU task, a send, a read
    /// of the result), a CPU task or a write-back is writing it, or a reference to it is alive
    /// besides the copy's own and the `held` ones of the caller. `false` without a buffer.
    pub fn host_in_use(&self, held: usize) -> bool {
        self.host.as_ref().is_some_and(|h| {
            self.host_pins > 0
                || self.host_writers > 0
                || self.writebacks_in_flight > 0
                || Arc::strong_count(h) > 1 + held
        })
    }

    /// Gives the host buffer back (to the pinned pool, or the heap, and out of the host budget)
    /// when it holds no current data and nobody uses it ([`CopyState::host_in_use`]). Says
    /// whether it did.
    pub fn release_stale_host(&mut self) -> bool {
        let idle = self.host.is_some() && !self.host_valid && !self.host_in_use(0);
        if idle {
            self.host = None;
        }
        idle
    }

    /// A new zeroed host buffer for this copy (not installed), charged to the host budget.
    pub fn fresh_host_buf(&self, bytes: usize) -> TileBuf {
        TileBuf::zeroed_in(self.host_pool.as_ref(), bytes, self.tier.as_ref().map(|t| &t.budget))
    }

    /// Files the copy as the host tier's most recently used (nothing without a budget).
    pub fn touch_host(&mut self) {
        if let Some(t) = &self.tier {
            t.budget.touch(&t.me, &mut self.host_stamp);
        }
    }

    /// Marks the data as produced at `at` (a write finished there): valid there only.
    pub fn produced_at(&mut self, at: Location) {
        self.generation += 1;
        self.disk_valid = false;
        self.host_valid = at == Location::Host;
        for (d, c) in self.dev.iter_mut().enumerate() {
            c.valid = at == Location::Device(d);
        }
    }
}

/// A memory location of a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host memory.
    Host,
    /// Local device `d`.
    Device(usize),
}

/// Where a rank's copies live: its local devices and where their blocks go back, the pinned
/// host pool, and the host tier when a budget is in force.
#[derive(Debug, Clone, Default)]
pub struct CopyEnv {
    /// Local devices.
    pub devices: usize,
    /// Where a dropped copy's device blocks go back (the GPU manager's channel).
    pub release: Option<Sender<(usize, Block)>>,
    /// The pinned host pool host buffers come from.
    pub pool: Option<Arc<HostPool>>,
    /// The host tier, when a budget is in force.
    pub tier: Option<Arc<dyn HostBudget>>,
}

/// One version-chain of a tile on this rank: bytes, and its state across locations.
pub struct TileCopy {
    bytes: usize,
    /// On a cache line of its own, away from the `Arc`'s counts: the inserting thread clones
    /// the `Arc` for every task that uses the tile while workers lock the state, and sharing
    /// one line made both pay for the other's writes.
    state: CachePadded<Mutex<CopyState>>,
    /// Where device blocks go back when the copy is dropped (the GPU manager owns the pools).
    release: Option<Sender<(usize, Block)>>,
    /// The host buffer, published once for [`TileCopy::fixed_host`] (outside `state`'s padded
    /// lines, beside fields nothing writes: read without a miss once it is set).
    fixed: OnceLock<Arc<TileBuf>>,
}

impl TileCopy {
    /// A copy whose data starts valid on the host as zeros. The buffer itself is allocated on
    /// first use (pinned when the environment's pool has room), so tiles that are only ever
    /// produced and consumed on a device, or never touched, cost no host memory.
    pub fn host(bytes: usize, env: &CopyEnv) -> Arc<TileCopy> {
        Arc::new_cyclic(|me| TileCopy {
            bytes,
            state: CachePadded::new(Mutex::new(CopyState {
                host: None,
                host_pool: env.pool.clone(),
                host_valid: true,
                dev: (0..env.devices).map(|_| DevCopy::default()).collect(),
                generation: 0,
                host_writers: 0,
                writebacks_in_flight: 0,
                debug_hash: None,
                host_pins: 0,
                tier: env.tier.as_ref().map(|t| BudgetLink {
                    budget: t.clone(),
                    me: me.clone(),
                }),
                host_stamp: 0,
                disk: None,
                disk_valid: false,
                uses: std::collections::VecDeque::new(),
                part_writers: None,
            })),
            release: env.release.clone(),
            fixed: OnceLock::new(),
        })
    }

    #[inline]
    /// Bytes of the tile.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The copy's state, locked (held briefly: never across a wait).
    pub fn lock(&self) -> MutexGuard<'_, CopyState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state, if no one holds its lock now (this thread included).
    pub fn try_lock(&self) -> Option<MutexGuard<'_, CopyState>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The host buffer of a copy whose host buffer, once made, stays until the copy is
    /// dropped: on a rank with no device and no host tier (the task layer's host-only dispatch), nothing
    /// evicts, replaces or invalidates host buffers. The first call makes it under the lock
    /// (as [`CopyState::host_buf`]); later calls read it with one load, taking neither the
    /// lock nor a reference. On fine-grained graphs both were cache-line transfers between
    /// the workers on the path from one task to the next: a lock and an `Arc` clone per tile
    /// where a task is dispatched, the `Arc`'s drop where it ends.
    ///
    /// Must not be used where the host buffer can be replaced (a host tier, devices).
    #[inline]
    pub fn fixed_host(&self) -> &TileBuf {
        self.fixed.get_or_init(|| self.lock().host_buf(self.bytes))
    }
}

impl Drop for TileCopy {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if let (Some(slot), Some(t)) = (state.disk.take(), state.tier.as_ref()) {
            t.budget.release_disk(slot);
        }
        if let Some(tx) = &self.release {
            for (d, c) in state.dev.iter_mut().enumerate() {
                if let Some(b) = c.block.take() {
                    let _ = tx.send((d, b));
                }
            }
        }
    }
}

impl std::fmt::Debug for TileCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TileCopy({} bytes)", self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A staging buffer goes back only when it holds no current data and nobody uses it.
    #[test]
    fn a_stale_idle_host_buffer_is_released() {
        let c = TileCopy::host(64, &CopyEnv::default());
        let held = c.lock().host_buf(64);
        assert!(!c.lock().release_stale_host(), "valid on the host: kept");
        c.lock().host_valid = false;
        assert!(!c.lock().release_stale_host(), "another reference is alive: kept");
        drop(held);
        c.lock().host_pins = 1;
        assert!(!c.lock().release_stale_host(), "pinned by a consumer: kept");
        c.lock().host_pins = 0;
        assert!(c.lock().release_stale_host(), "stale and idle: released");
        assert!(c.lock().host.is_none());
        assert!(!c.lock().release_stale_host(), "nothing left to release");
    }

    /// A failed receive's landing buffer is taken back only if it is still the copy's buffer:
    /// the copy returns to "valid as zeros, no buffer", and another buffer is left alone.
    #[test]
    fn a_failed_landing_buffer_is_forgotten() {
        let c = TileCopy::host(64, &CopyEnv::default());
        let landed = c.lock().landing_host_buf(64);
        let other = Arc::new(TileBuf::zeroed(64));
        c.lock().forget_host(&other);
        assert!(
            c.lock().host.as_ref().is_some_and(|h| Arc::ptr_eq(h, &landed)),
            "not ours: kept"
        );
        c.lock().forget_host(&landed);
        assert!(c.lock().host.is_none());
        assert!(c.lock().host_valid, "valid as zeros again");
        // SAFETY: a fresh zeroed buffer, no writer.
        assert!(unsafe { c.lock().host_buf(64).bytes() }.iter().all(|&x| x == 0));
    }

    /// The fixed host buffer is the copy's host buffer, made once: whichever of the two is
    /// asked first, both name the same memory afterwards, and data written through one is
    /// read through the other.
    #[test]
    fn the_fixed_host_buffer_is_the_host_buffer() {
        let a = TileCopy::host(64, &CopyEnv::default());
        let first = a.fixed_host().as_ptr();
        assert_eq!(a.fixed_host().as_ptr(), first, "made once");
        assert_eq!(a.lock().host_buf(64).as_ptr(), first, "the same as the locked path's");

        let b = TileCopy::host(64, &CopyEnv::default());
        let locked = b.lock().host_buf(64);
        // SAFETY: nothing else uses the buffer.
        unsafe { locked.as_ptr().write_bytes(7, 64) };
        assert_eq!(
            b.fixed_host().as_ptr(),
            locked.as_ptr(),
            "the buffer made under the lock"
        );
        // SAFETY: 64 initialized bytes, no writer.
        assert!(unsafe { b.fixed_host().bytes() }.iter().all(|&x| x == 7));
    }
}
