//! Memory regions a transfer hands to the MPI thread: slices of host buffers, landing buffers
//! taken on arrival, device blocks (GPU-direct), small owned control buffers.

use ferry_engine::MemRegion;
use ferry_memory::data::budget::HostBudget;
use ferry_memory::data::buffer::TileBuf;
use ferry_memory::data::copy::TileCopy;
use ferry_memory::data::host_pool::HostPool;
use smallvec::SmallVec;
use std::cell::UnsafeCell;
use std::sync::{Arc, OnceLock};

/// `len` bytes at `off` of a tile's host buffer (one chunk of a staged transfer).
pub struct Slice {
    pub buf: Arc<TileBuf>,
    pub off: usize,
    pub len: usize,
}

// SAFETY: a range of the tile's host buffer, which the `Arc` keeps; the transfer layer hands a
// tile's buffer to one transfer at a time, or to sends only (readers).
unsafe impl MemRegion for Slice {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: `off + len <= buf.len()` by construction (the chunking of `super::chunks`).
        unsafe { self.buf.as_ptr().add(self.off) }
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Whether a receive of `bytes` bytes into a buffer from `pool` should take it when its message
/// is matched rather than now. Only while the pinned pool has room for it: the buffer is then
/// pinned memory, taken on the MPI thread in a few hundred nanoseconds. Pageable memory —
/// without a pool (no devices), or with the pool full — is taken now, zeroed on the posting
/// thread: a fresh pageable buffer on the MPI thread faulted its pages in there, on the path of
/// every message (2× H200, 256 MiB host-resident tiles × 8 with the pool full: 5.0–5.5 GB/s
/// against 6.0–6.4 GB/s taken at posting).
fn lazy(pool: Option<&Arc<HostPool>>, bytes: usize) -> bool {
    pool.is_some_and(|p| p.has_room(bytes))
}

/// A host buffer of `bytes` bytes taken when a receive into it is first matched (on the MPI
/// thread, `ferry-comm/src/matching.rs`), not when the receive is posted: receives are posted at
/// insertion, long before their messages come, and a buffer taken then would sit idle all that
/// time — with the submission window, for thousands of receives. From the pinned host pool,
/// unzeroed: every byte read is one a receive wrote ([`TileBuf::landing_in`]). Taken at once
/// when the pool has no room now (see `lazy`).
pub struct Landing {
    bytes: usize,
    pool: Option<Arc<HostPool>>,
    budget: Option<Arc<dyn HostBudget>>,
    buf: OnceLock<TileBuf>,
}

impl Landing {
    /// A landing buffer of `bytes` bytes, from where the host buffers of `copy` come.
    pub fn new(copy: &TileCopy, bytes: usize) -> Arc<Landing> {
        let (pool, budget) = {
            let s = copy.lock();
            (s.host_pool.clone(), s.tier.as_ref().map(|t| t.budget.clone()))
        };
        let landing = Landing {
            bytes,
            pool,
            budget,
            buf: OnceLock::new(),
        };
        if !lazy(landing.pool.as_ref(), bytes) {
            let _ = landing.buf.set(TileBuf::zeroed_in(
                landing.pool.as_ref(),
                bytes,
                landing.budget.as_ref(),
            ));
        }
        Arc::new(landing)
    }

    /// Start of the buffer, taken now if it was not yet.
    pub fn ptr(&self) -> *mut u8 {
        self.buf
            .get_or_init(|| TileBuf::landing_in(self.pool.as_ref(), self.bytes, self.budget.as_ref()))
            .as_ptr()
    }
}

/// The first `len` bytes of a [`Landing`] buffer (one chunk of a staged receive).
pub struct LandingSlice {
    pub landing: Arc<Landing>,
    pub len: usize,
}

// SAFETY: the landing buffer the `Arc` keeps, written only by the receive of its chunk.
unsafe impl MemRegion for LandingSlice {
    fn ptr(&self) -> *mut u8 {
        self.landing.ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// The host buffer of a fresh copy that a receive fills whole, made when the receive (or the
/// first of its chunks) is matched on the MPI thread rather than when it is posted, for the
/// reason [`Landing`] gives; unzeroed ([`CopyState::landing_host_buf`]). Made at once, zeroed,
/// when the pinned pool has no room for it now (see `lazy`). Once made, it is the copy's host
/// buffer like any other.
///
/// [`CopyState::landing_host_buf`]: ferry_memory::data::copy::CopyState::landing_host_buf
pub struct TileLanding {
    copy: Arc<TileCopy>,
    buf: OnceLock<Arc<TileBuf>>,
}

impl TileLanding {
    pub fn new(copy: Arc<TileCopy>) -> Arc<TileLanding> {
        let landing = TileLanding {
            copy,
            buf: OnceLock::new(),
        };
        let bytes = landing.copy.bytes();
        let mut s = landing.copy.lock();
        if !lazy(s.host_pool.as_ref(), bytes) {
            let _ = landing.buf.set(s.host_buf(bytes));
        }
        drop(s);
        Arc::new(landing)
    }

    /// The copy's host buffer, made now if it was not yet.
    pub fn buf(&self) -> &Arc<TileBuf> {
        self.buf
            .get_or_init(|| self.copy.lock().landing_host_buf(self.copy.bytes()))
    }

    /// After a failed receive: takes the buffer back from the copy, which returns to "valid as
    /// zeros, no buffer yet". An unzeroed buffer that the receive did not write whole must not
    /// stay as the copy's data: what reads it after the failure (a spill to disk, a packed
    /// send) would read uninitialised memory.
    pub fn discard(&self) {
        if let Some(b) = self.buf.get() {
            self.copy.lock().forget_host(b);
        }
    }
}

/// `len` bytes at `off` of a [`TileLanding`] (a whole tile, or one chunk of a staged receive).
pub struct TileLandingSlice {
    pub landing: Arc<TileLanding>,
    pub off: usize,
    pub len: usize,
}

// SAFETY: a range of the landing tile the `Arc` keeps, written only by the receive of its range.
unsafe impl MemRegion for TileLandingSlice {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: `off + len` lies inside the tile (whole, or cut by `super::chunks`).
        unsafe { self.landing.buf().as_ptr().add(self.off) }
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A pinned device block, by address: only ever handed to an MPI that takes device memory.
pub struct DeviceRegion {
    pub addr: u64,
    pub len: usize,
}

// SAFETY: a device block the GPU manager pinned for this transfer (released after its callback);
// handed only to an MPI that takes device memory.
unsafe impl MemRegion for DeviceRegion {
    fn ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Bytes a [`Small`] holds inline: a descriptor (48 bytes) or an acknowledgement (8) fits.
const SMALL_INLINE: usize = 64;

/// A small owned buffer (descriptors, acknowledgements, packed messages).
///
/// Up to [`SMALL_INLINE`] bytes live inside the `Arc`'s own allocation: the IPC route exchanges
/// a descriptor and an acknowledgement per tile, and a boxed slice plus the temporary of
/// [`Small::zeroed`] had made them three allocations each, on the GPU manager and MPI threads
/// that bound that route's small-tile rate.
pub struct Small {
    bytes: UnsafeCell<SmallVec<[u8; SMALL_INLINE]>>,
}

// SAFETY: written only by the MPI receive into it, read only after that completed (the
// completion callback runs on the MPI thread after the request finished).
unsafe impl Sync for Small {}
// SAFETY: plain memory.
unsafe impl Send for Small {}

impl Small {
    pub fn new(bytes: &[u8]) -> Arc<Small> {
        Arc::new(Small {
            bytes: UnsafeCell::new(SmallVec::from_slice(bytes)),
        })
    }
    pub fn zeroed(len: usize) -> Arc<Small> {
        Arc::new(Small {
            bytes: UnsafeCell::new(SmallVec::from_elem(0, len)),
        })
    }
    /// The contents.
    ///
    /// # Safety
    /// No receive into the buffer may be in flight.
    pub unsafe fn get(&self) -> &[u8] {
        &*self.bytes.get()
    }
}

// SAFETY: the inline buffer this region owns, written only by the receive that holds it.
unsafe impl MemRegion for Small {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: only the pointer is taken.
        unsafe { (*self.bytes.get()).as_mut_ptr() }
    }
    fn len(&self) -> usize {
        // SAFETY: the length never changes.
        unsafe { (&*self.bytes.get()).len() }
    }
}
