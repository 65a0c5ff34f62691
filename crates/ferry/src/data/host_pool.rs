//! The registered host pool: one region of page-locked ("pinned") host memory, reserved at
//! start-up when devices are in use, from which tile copies take their host buffers.
//!
//! Copies between a device and pinned memory run at the link's rate (ANCHORS.md, H200: 55 GB/s
//! pinned against 6.8–9.4 GB/s pageable) and are truly asynchronous. Pinning is expensive per
//! call, so the region is pinned once and sub-allocated with the device pool's best-fit
//! allocator; when it is full, buffers fall back to pageable memory (counted, never an error).

use crate::device::pool::{Block, Pool};
use crate::error::FerryError;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Sub-allocation alignment: 256 bytes (what DMA engines and vector loads like).
const ALIGN: u64 = 256;

/// How a region goes back (unpin and free, on the backend's terms).
pub(crate) type Release = Box<dyn FnOnce(*mut u8) + Send + Sync>;

/// One pinned region and its allocator.
pub(crate) struct HostPool {
    base: *mut u8,
    pool: Mutex<Pool>,
    release: Mutex<Option<Release>>,
    /// Buffers that did not fit and went to pageable memory.
    pub(crate) fallbacks: AtomicU64,
    /// Most bytes in use at once (blocks as allocated, alignment included).
    pub(crate) peak: AtomicU64,
}

// SAFETY: `base` is a plain host allocation owned by the pool; the allocator is behind a mutex
// and every block handed out is used by one TileBuf at a time (the graph serialises its users).
unsafe impl Send for HostPool {}
// SAFETY: as above.
unsafe impl Sync for HostPool {}

impl HostPool {
    /// A pool over `bytes` bytes at `base`, given back with `release` when the pool is dropped.
    ///
    /// # Safety
    /// `base..base + bytes` must be valid, writable, 8-byte aligned host memory owned by the pool
    /// until `release` runs.
    pub(crate) unsafe fn new(base: *mut u8, bytes: u64, release: Release) -> HostPool {
        HostPool {
            base,
            pool: Mutex::new(Pool::new(bytes, ALIGN)),
            release: Mutex::new(Some(release)),
            fallbacks: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// A zeroed block of at least `bytes` bytes and its address, or `None` when the pool is full.
    pub(crate) fn alloc(&self, bytes: usize) -> Option<(Block, *mut u8)> {
        let (block, ptr) = self.alloc_unzeroed(bytes)?;
        // SAFETY: the block lies inside the region and is ours now; zeroed like every tile buffer.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Some((block, ptr))
    }

    /// A block of at least `bytes` bytes holding whatever its last user left there (bytes of
    /// this process: initialised memory, never read by the caller before it writes them), or
    /// `None` when the pool is full. For buffers written whole before they are read — a
    /// receive's landing area —, which zeroing would cost a pass over memory (≈ 0.5 ms per 4 MiB
    /// chunk buffer of a windowed staged receive, on the MPI thread that takes it).
    pub(crate) fn alloc_unzeroed(&self, bytes: usize) -> Option<(Block, *mut u8)> {
        let block = {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            let block = pool.alloc(bytes as u64);
            self.peak.fetch_max(pool.used(), Relaxed);
            block
        };
        let Some(block) = block else {
            if self.fallbacks.fetch_add(1, Relaxed) == 0 {
                tracing::warn!(
                    bytes,
                    "pinned host pool full: further tile buffers are pageable (FERRY_HOST_PINNED_BYTES)"
                );
            }
            return None;
        };
        // SAFETY: the block lies inside the region (the allocator's invariant) and is ours now.
        let ptr = unsafe { self.base.add(block.offset as usize) };
        Some((block, ptr))
    }

    /// Whether a block of `bytes` bytes would fit now (alignment aside).
    pub(crate) fn has_room(&self, bytes: usize) -> bool {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).largest_free() >= bytes as u64
    }

    /// Returns a block.
    pub(crate) fn free(&self, block: Block) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).free(block);
    }

    /// Bytes of the region.
    pub(crate) fn capacity(&self) -> u64 {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).capacity()
    }
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostPool({} bytes)", self.capacity())
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        if let Some(r) = self.release.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            r(self.base);
        }
    }
}

/// `bytes` of zeroed, 8-byte aligned heap memory and the [`Release`] that frees it, or `None`
/// when the allocator cannot provide it (a size from the environment must give an error, not
/// abort the process). Zeroed by the allocator (`calloc`-like): fresh pages are not touched
/// until used, as with `vec![0; n]`. What the pools of emulated devices stand on: the host pool
/// here, the bounce pool (`transfer/bounce.rs`).
pub(crate) fn zeroed_heap(bytes: u64) -> Option<(*mut u8, Release)> {
    let words = usize::try_from(bytes.div_ceil(8)).ok()?.max(1);
    let layout = std::alloc::Layout::array::<u64>(words).ok()?;
    // SAFETY: `layout` has a non-zero size; a non-null result is freed only by the release
    // below, with this same layout.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `q` is the allocation made above (the pool hands back its base), freed once.
    let release: Release = Box::new(move |q| unsafe { std::alloc::dealloc(q, layout) });
    Some((p, release))
}

/// A pool over ordinary heap memory, for emulated devices (the same allocator path, unpinned).
///
/// # Errors
/// [`FerryError::Config`] when `bytes` cannot be allocated.
pub(crate) fn heap_pool(bytes: u64) -> Result<HostPool, FerryError> {
    let (base, release) = zeroed_heap(bytes).ok_or_else(|| {
        FerryError::Config(format!(
            "cannot allocate a host pool of {bytes} bytes for emulated devices (FERRY_HOST_PINNED_BYTES)"
        ))
    })?;
    // SAFETY: `base` holds `bytes` bytes until `release` runs.
    Ok(unsafe { HostPool::new(base, bytes, release) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_zeroed_blocks_and_falls_back_when_full() {
        let p = heap_pool(4096).unwrap();
        let (a, pa) = p.alloc(1000).unwrap();
        // SAFETY: the block is ours.
        unsafe {
            assert!(std::slice::from_raw_parts(pa, 1000).iter().all(|&b| b == 0));
            std::ptr::write_bytes(pa, 7, 1000);
        }
        p.free(a);
        let (_, pb) = p.alloc(1000).unwrap();
        // SAFETY: as above: a reused block is zeroed again.
        assert!(unsafe { std::slice::from_raw_parts(pb, 1000) }.iter().all(|&b| b == 0));
        assert!(p.alloc(4000).is_none());
        assert_eq!(p.fallbacks.load(Relaxed), 1);
    }
}
