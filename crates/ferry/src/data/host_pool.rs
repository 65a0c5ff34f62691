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
        }
    }

    /// A zeroed block of at least `bytes` bytes and its address, or `None` when the pool is full.
    pub(crate) fn alloc(&self, bytes: usize) -> Option<(Block, *mut u8)> {
        let block = self.pool.lock().unwrap_or_else(|p| p.into_inner()).alloc(bytes as u64);
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
        // SAFETY: as above; zeroed like every tile buffer.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Some((block, ptr))
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

/// `bytes` of zeroed, 8-byte aligned heap memory, or `None` when the allocator cannot provide
/// it (a size from the environment must give an error, not abort the process). Zeroed by the
/// allocator (`calloc`-like): fresh pages are not touched until used, as with `vec![0; n]`.
pub(crate) fn try_zeroed_words(bytes: u64) -> Option<Box<[u64]>> {
    let words = usize::try_from(bytes.div_ceil(8)).ok()?;
    if words == 0 {
        return Some(Box::new([]));
    }
    let layout = std::alloc::Layout::array::<u64>(words).ok()?;
    // SAFETY: `layout` has a non-zero size. A non-null result is `words` zeroed, aligned u64s
    // (zero is a valid u64) that the box owns and frees with this same layout.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut u64;
        (!p.is_null()).then(|| Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, words)))
    }
}

/// A pool over ordinary heap memory, for emulated devices (the same allocator path, unpinned).
///
/// # Errors
/// [`FerryError::Config`] when `bytes` cannot be allocated.
pub(crate) fn heap_pool(bytes: u64) -> Result<HostPool, FerryError> {
    let words = try_zeroed_words(bytes).ok_or_else(|| {
        FerryError::Config(format!(
            "cannot allocate a host pool of {bytes} bytes for emulated devices (FERRY_HOST_PINNED_BYTES)"
        ))
    })?;
    let len = words.len();
    let base = Box::into_raw(words) as *mut u64 as *mut u8;
    // SAFETY: `base` owns `len` words until the release closure rebuilds and drops the box.
    Ok(unsafe {
        HostPool::new(
            base,
            bytes,
            Box::new(move |p| drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p as *mut u64, len)))),
        )
    })
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
