//! The bounce pool: a fixed number of pinned host buffers of one chunk each, allocated (and
//! registered with the driver) once at start-up. Staged transfers of device data copy each chunk
//! device→host into a bounce buffer and send it from there; the buffer comes back when the send
//! completes. The extra host memory of staged transfers is therefore exactly the pool, however
//! large or many the tiles.
//!
//! Only sends take bounce buffers. A send holding one waits for nothing but its receiver, whose
//! receive is always posted (receives never wait for memory), so buffers always come back and
//! a waiting chunk always gets one: no cycle of ranks waiting on each other's buffers.

use ferry_engine::MemRegion;
use ferry_memory::data::host_pool::Release;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Called with a buffer once one is free.
pub type Waiter = Box<dyn FnOnce(Slot) + Send>;

struct State {
    free: Vec<usize>,
    waiters: VecDeque<Waiter>,
    peak: usize,
}

/// A fixed set of equal pinned buffers; see the module documentation.
pub struct BouncePool {
    base: *mut u8,
    chunk: usize,
    slots: usize,
    state: Mutex<State>,
    release: Mutex<Option<Release>>,
}

// SAFETY: `base` is memory owned by the pool; each buffer is used by one holder at a time (the
// `Slot` that owns its index).
unsafe impl Send for BouncePool {}
// SAFETY: as above; the free list is behind a mutex.
unsafe impl Sync for BouncePool {}

impl BouncePool {
    /// A pool of `bytes / chunk` buffers of `chunk` bytes at `base`, given back with `release`.
    ///
    /// # Safety
    /// `base..base + bytes` must be valid, writable host memory owned by the pool until `release`
    /// runs.
    pub unsafe fn new(base: *mut u8, bytes: usize, chunk: usize, release: Release) -> BouncePool {
        let slots = (bytes / chunk).max(1);
        BouncePool {
            base,
            chunk,
            slots,
            state: Mutex::new(State {
                free: (0..slots).rev().collect(),
                waiters: VecDeque::new(),
                peak: 0,
            }),
            release: Mutex::new(Some(release)),
        }
    }

    /// A pool in ordinary heap memory (emulated devices); `None` when it cannot be allocated.
    pub fn heap(bytes: usize, chunk: usize) -> Option<BouncePool> {
        let (base, release) = ferry_memory::data::host_pool::zeroed_heap(bytes as u64)?;
        // SAFETY: the memory is owned by the pool until `release`.
        Some(unsafe { BouncePool::new(base, bytes, chunk, release) })
    }

    /// Bytes of one buffer (the chunk size of staged transfers).
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Number of buffers.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Most buffers ever in use at once.
    pub fn peak(&self) -> usize {
        self.lock().peak
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls `f` with a free buffer: now when one is free, else when one comes back (on the thread
    /// that gives it back). Waiters are served in arrival order.
    pub fn acquire(self: &Arc<Self>, f: Waiter) {
        let mut st = self.lock();
        if st.waiters.is_empty() {
            if let Some(idx) = st.free.pop() {
                st.peak = st.peak.max(self.slots - st.free.len());
                drop(st);
                return f(self.slot(idx));
            }
        }
        st.waiters.push_back(f);
    }

    fn slot(self: &Arc<Self>, idx: usize) -> Slot {
        Slot {
            pool: self.clone(),
            idx,
            len: self.chunk,
        }
    }

    fn give_back(self: &Arc<Self>, idx: usize) {
        let mut st = self.lock();
        match st.waiters.pop_front() {
            Some(f) => {
                drop(st);
                f(self.slot(idx));
            }
            None => st.free.push(idx),
        }
    }
}

impl Drop for BouncePool {
    fn drop(&mut self) {
        if let Some(r) = self.release.lock().unwrap_or_else(|p| p.into_inner()).take() {
            r(self.base);
        }
    }
}

/// One bounce buffer, returned to its pool when dropped.
pub struct Slot {
    pool: Arc<BouncePool>,
    idx: usize,
    len: usize,
}

impl Slot {
    /// Uses only the first `len` bytes (the last chunk of a tile is shorter).
    pub fn truncate(&mut self, len: usize) {
        self.len = len.min(self.pool.chunk);
    }
}

// SAFETY: this slot's chunk of the pinned bounce pool, which the `Arc` keeps; a slot is held by
// one chunk at a time until it is dropped.
unsafe impl MemRegion for Slot {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: idx < slots, so the buffer lies inside the pool's memory.
        unsafe { self.pool.base.add(self.idx * self.pool.chunk) }
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.give_back(self.idx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn waiters_get_buffers_in_order_and_memory_is_bounded() {
        let pool = Arc::new(BouncePool::heap(3 * 4096, 4096).unwrap());
        assert_eq!(pool.slots(), 3);
        let held = Arc::new(Mutex::new(Vec::new()));
        let order = Arc::new(Mutex::new(Vec::new()));
        for k in 0..5 {
            let (held, order) = (held.clone(), order.clone());
            pool.acquire(Box::new(move |s| {
                order.lock().unwrap().push(k);
                held.lock().unwrap().push(s);
            }));
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        // Giving one back serves the oldest waiter.
        let first = held.lock().unwrap().remove(0);
        let p0 = first.ptr();
        drop(first);
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(held.lock().unwrap().last().unwrap().ptr(), p0);
        assert_eq!(pool.peak(), 3);
        let n = Arc::new(AtomicUsize::new(0));
        // Dropping outside the lock: a waiter served by the drop pushes into `held`.
        let taken = std::mem::take(&mut *held.lock().unwrap());
        drop(taken); // serves waiter 4
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        let taken = std::mem::take(&mut *held.lock().unwrap());
        drop(taken);
        let c = n.clone();
        pool.acquire(Box::new(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }
}
