//! The registered host pool: one region of page-locked ("pinned") host memory, reserved at
//! start-up when devices are in use, from which tile copies take their host buffers.
//!
//! Copies between a device and pinned memory run at the link's rate (H200: 55 GB/s
//! pinned against 6.8–9.4 GB/s pageable) and are truly asynchronous. Pinning is expensive per
//! call, so the region is pinned once and sub-allocated with the device pool's best-fit
//! allocator; when it is full, buffers fall back to pageable memory (counted, never an error).
//!
//! Pinning itself is slow: 0.3–0.55 s per GiB on the H200 machines, over a second per rank for the default 4 GiB before the first task. So a backend
//! may pin only the first part of the region at start-up (`FERRY_HOST_PIN_AT_START`) and the
//! rest in the background ([`HostPool::pinned_in_parts`]): what is not pinned yet is held back
//! as allocated blocks, which the pinning thread frees part by part as it pins them. A buffer
//! asked for meanwhile gets pinned memory if the pinned part has room, else pageable memory, as
//! when the pool is full.

use ferry_base::error::FerryError;
use ferry_device::pool::{Block, Pool};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Sub-allocation alignment: 256 bytes (what DMA engines and vector loads like).
const ALIGN: u64 = 256;

pub use ferry_device::{Pin, Release};

/// The first part the tests lay out: what `FERRY_HOST_PIN_AT_START=256M` asks for (≈ 0.1 s of
/// pinning on the H200 machines).
#[cfg(test)]
const PIN_FIRST: u64 = 256 << 20;

/// The largest part pinned in the background in one call: the largest buffer such a part can
/// hold, how long a pool dropped while pinning waits at most, and how long the process's other
/// CUDA calls may wait meanwhile — the driver serialises them with a registration in progress
/// (a 1 GiB part held up the runtime's own start-up calls 0.41 s on the H200 machines, where a
/// registration pins 0.3–0.45 s per GiB).
const PIN_LARGEST: u64 = 1 << 30;

/// Bytes between two parts pinned separately (a page, so that every part starts on one).
const PIN_GAP: u64 = 4096;

/// How a region of `capacity` bytes is pinned in parts, as `(offset, length)` blocks in offset
/// order: the first part (`first` bytes, whole pages, at most the region), then a gap of at most
/// [`PIN_GAP`] bytes, the next part, a gap, and so on. Later parts start at the first's size but
/// at most [`PIN_LARGEST`] and double up to it; the last one takes what is left, at most that
/// too (a region may end in a gap). The first part is the one pinned at start-up; parts grow so
/// that large tiles find a part that holds them soon and the number of driver calls stays small
/// (4 GiB from 256 MiB: 256 MiB, 256 MiB, 512 MiB, 1 GiB, 1 GiB, 1 GiB less the gaps). A region no
/// larger than `first` is one part; an empty one has none.
fn parts(capacity: u64, first: u64) -> Vec<(u64, u64)> {
    let first = first.min(capacity).max(PIN_GAP) & !(PIN_GAP - 1);
    let mut out = Vec::new();
    let (mut at, mut len) = (0u64, first);
    while at < capacity {
        let rest = capacity - at;
        if rest <= len {
            out.push((at, rest));
            break;
        }
        out.push((at, len));
        at += len;
        let gap = PIN_GAP.min(capacity - at);
        out.push((at, gap));
        at += gap;
        // The second part is as large as the first (at most the largest); then they double.
        len = if out.len() == 2 {
            first.min(PIN_LARGEST)
        } else {
            len.saturating_mul(2).min(PIN_LARGEST)
        };
    }
    out
}

/// One pinned region and its allocator.
pub struct HostPool {
    base: *mut u8,
    /// Shared with the pinning thread, which frees the blocks it holds back as it pins them.
    pool: Arc<Mutex<Pool>>,
    release: Mutex<Option<Release>>,
    /// Buffers that did not fit and went to pageable memory.
    pub fallbacks: AtomicU64,
    /// Most bytes in use at once (blocks as allocated, alignment included; held-back blocks not).
    pub peak: AtomicU64,
    /// Bytes held back until pinned (0 once pinning is over, or without background pinning).
    unpinned: Arc<AtomicU64>,
    /// Bytes held for good between the parts pinned separately (see [`parts`]).
    gaps: AtomicU64,
    /// Asks the pinning thread to stop after its current chunk.
    stop_pinning: Arc<AtomicBool>,
    pinner: Mutex<Option<JoinHandle<()>>>,
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
    pub unsafe fn new(base: *mut u8, bytes: u64, release: Release) -> HostPool {
        HostPool {
            base,
            pool: Arc::new(Mutex::new(Pool::new(bytes, ALIGN))),
            release: Mutex::new(Some(release)),
            fallbacks: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            unpinned: Arc::new(AtomicU64::new(0)),
            gaps: AtomicU64::new(0),
            stop_pinning: Arc::new(AtomicBool::new(false)),
            pinner: Mutex::new(None),
        }
    }

    /// A pool over `bytes` bytes at `base` that `pin` pins in parts: the first part (`first`
    /// bytes) now, the others on a thread of its own (`ferry-pin`), in offset order, each given
    /// to the pool once pinned; until then it is held back (no buffer is taken there). See
    /// `parts` for the layout: no buffer ever spans two parts, because a driver copy may not
    /// span two registrations (on CUDA, `cuMemcpyHtoDAsync` from such a buffer fails with
    /// `CUDA_ERROR_INVALID_VALUE`). Dropping the pool stops the thread after the part in hand. A
    /// failed `pin` in the background is logged and ends the pinning (the rest stays held back:
    /// buffers that do not fit the pinned parts go to pageable memory, as when the pool is full).
    ///
    /// # Errors
    /// The first part could not be pinned, or the thread not started (the region is released).
    ///
    /// # Safety
    /// As for [`HostPool::new`], and `base` page-aligned.
    pub unsafe fn pinned_in_parts(
        base: *mut u8,
        bytes: u64,
        release: Release,
        first: u64,
        mut pin: Pin,
    ) -> Result<HostPool, String> {
        // SAFETY: the caller's contract.
        let p = unsafe { HostPool::new(base, bytes, release) };
        let layout = parts(p.capacity(), first);
        // On an empty pool, blocks are taken in offset order.
        let blocks: Option<Vec<Block>> = {
            let mut pool = p.pool.lock().unwrap_or_else(|e| e.into_inner());
            layout.iter().map(|&(_, len)| pool.alloc(len)).collect()
        };
        let blocks = match blocks {
            Some(b) if b.iter().zip(&layout).all(|(b, &(off, _))| b.offset == off) => b,
            _ => {
                return Err(format!(
                    "the host pool's layout does not fit its {} bytes",
                    p.capacity()
                ))
            }
        };
        let mut blocks = blocks.into_iter();
        let Some(head) = blocks.next() else {
            // An empty pool (fewer bytes than its alignment): nothing to pin.
            return Ok(p);
        };
        // Every other block is a gap, held for good.
        let (held, gaps): (Vec<_>, Vec<_>) = blocks.enumerate().partition(|(k, _)| k % 2 == 1);
        let held: Vec<Block> = held.into_iter().map(|x| x.1).collect();
        let gaps: Vec<Block> = gaps.into_iter().map(|x| x.1).collect();
        pin(base as usize, head.len as usize)?;
        p.pool.lock().unwrap_or_else(|e| e.into_inner()).free(head);
        p.gaps.store(gaps.iter().map(|b| b.len).sum(), Relaxed);
        if held.is_empty() {
            return Ok(p);
        }
        let total: u64 = held.iter().map(|b| b.len).sum();
        p.unpinned.store(total, Relaxed);
        let (pool, unpinned, stop) = (p.pool.clone(), p.unpinned.clone(), p.stop_pinning.clone());
        let base = base as usize;
        let spawned = std::thread::Builder::new().name("ferry-pin".into()).spawn(move || {
            let started = std::time::Instant::now();
            for b in held {
                if stop.load(Relaxed) {
                    return;
                }
                if let Err(e) = pin(base + b.offset as usize, b.len as usize) {
                    tracing::warn!(
                        "pinning the host pool stopped at byte {} ({e}): the rest stays unused",
                        b.offset
                    );
                    return;
                }
                {
                    // Both under the lock, as `alloc_unzeroed` reads them for the peak.
                    let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
                    pool.free(b);
                    unpinned.fetch_sub(b.len, Relaxed);
                }
                tracing::trace!(
                    offset = b.offset,
                    bytes = b.len,
                    seconds = started.elapsed().as_secs_f64(),
                    "host pool part pinned"
                );
            }
            tracing::debug!(
                bytes = total,
                seconds = started.elapsed().as_secs_f64(),
                "host pool pinned"
            );
        });
        match spawned {
            Ok(h) => {
                *p.pinner.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
                Ok(p)
            }
            Err(e) => Err(format!("cannot start the thread that pins the host pool: {e}")),
        }
    }

    /// Bytes not pinned yet (held back until the background pinning reaches them).
    pub fn unpinned(&self) -> u64 {
        self.unpinned.load(Relaxed)
    }

    /// A zeroed block of at least `bytes` bytes and its address, or `None` when the pool is full.
    pub fn alloc(&self, bytes: usize) -> Option<(Block, *mut u8)> {
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
    pub fn alloc_unzeroed(&self, bytes: usize) -> Option<(Block, *mut u8)> {
        let block = {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            let block = pool.alloc(bytes as u64);
            let held = self.unpinned.load(Relaxed) + self.gaps.load(Relaxed);
            self.peak.fetch_max(pool.used().saturating_sub(held), Relaxed);
            block
        };
        let Some(block) = block else {
            if self.fallbacks.fetch_add(1, Relaxed) == 0 {
                let unpinned = self.unpinned.load(Relaxed);
                if unpinned > 0 {
                    tracing::warn!(
                        bytes,
                        unpinned,
                        "pinned host pool full while the rest of it is still being pinned: this tile buffer and those that find no room are pageable"
                    );
                } else {
                    tracing::warn!(
                        bytes,
                        "pinned host pool full: further tile buffers are pageable (FERRY_HOST_PINNED_BYTES)"
                    );
                }
            }
            return None;
        };
        // SAFETY: the block lies inside the region (the allocator's invariant) and is ours now.
        let ptr = unsafe { self.base.add(block.offset as usize) };
        Some((block, ptr))
    }

    /// Whether a block of `bytes` bytes would fit now (alignment aside).
    pub fn has_room(&self, bytes: usize) -> bool {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).largest_free() >= bytes as u64
    }

    /// Returns a block.
    pub fn free(&self, block: Block) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).free(block);
    }

    /// Bytes of the region.
    pub fn capacity(&self) -> u64 {
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
        // The pinning thread must be done with the region before it goes back.
        self.stop_pinning.store(true, Relaxed);
        if let Some(h) = self.pinner.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            let t = std::time::Instant::now();
            let _ = h.join();
            tracing::debug!(waited_s = t.elapsed().as_secs_f64(), "host pool: pinning thread joined");
        }
        if let Some(r) = self.release.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            let t = std::time::Instant::now();
            r(self.base);
            tracing::debug!(seconds = t.elapsed().as_secs_f64(), "host pool released");
        }
    }
}

/// `bytes` of zeroed, 8-byte aligned heap memory and the [`Release`] that frees it, or `None`
/// when the allocator cannot provide it (a size from the environment must give an error, not
/// abort the process). Zeroed by the allocator (`calloc`-like): fresh pages are not touched
/// until used, as with `vec![0; n]`. What the pools of emulated devices stand on: the host pool
/// here, the bounce pool (`ferry-transfer/src/bounce.rs`).
pub fn zeroed_heap(bytes: u64) -> Option<(*mut u8, Release)> {
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
pub fn heap_pool(bytes: u64) -> Result<HostPool, FerryError> {
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

    /// A heap pool of `bytes` bytes pinned in parts by `pin`, the first of one page.
    fn in_parts(bytes: u64, pin: Pin) -> Result<HostPool, String> {
        let (base, release) = zeroed_heap(bytes).unwrap();
        // SAFETY: `base` holds `bytes` bytes until `release` runs (not page-aligned: `pin`
        // pins nothing here).
        unsafe { HostPool::pinned_in_parts(base, bytes, release, PIN_GAP, pin) }
    }

    fn wait_until(what: impl Fn() -> bool) {
        let t = std::time::Instant::now();
        while !what() && t.elapsed().as_secs() < 20 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(what(), "timed out");
    }

    /// Parts double up to the largest, each starts on a page, gaps of a page lie between them,
    /// and together they cover the region.
    #[test]
    fn a_region_is_pinned_in_doubling_parts_with_gaps() {
        let l = parts(4 << 30, PIN_FIRST);
        let lens: Vec<u64> = l.iter().step_by(2).map(|&(_, n)| n).collect();
        let m = 1 << 20;
        assert_eq!(lens[..5], [256 * m, 256 * m, 512 * m, 1024 * m, 1024 * m]);
        assert_eq!(lens[5], (1 << 30) - 5 * PIN_GAP, "the last part takes the rest");
        assert!(l.iter().skip(1).step_by(2).all(|&(_, n)| n == PIN_GAP));
        assert!(l.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
        assert!(l.iter().all(|&(off, _)| off % PIN_GAP == 0));
        assert_eq!(l.last().map(|&(off, n)| off + n), Some(4 << 30));
        assert_eq!(parts(PIN_FIRST, PIN_FIRST), vec![(0, PIN_FIRST)]);
        let big = parts(100 << 30, PIN_FIRST);
        assert!(big.iter().step_by(2).all(|p| p.1 <= PIN_LARGEST));
        assert_eq!(big.iter().map(|p| p.1).sum::<u64>(), 100 << 30);
        // A large first part: later parts still at most the largest.
        let l = parts(8 << 30, 3 << 30);
        assert_eq!(l[0], (0, 3 << 30));
        assert!(l.iter().skip(2).step_by(2).all(|p| p.1 <= PIN_LARGEST));
        assert_eq!(l.iter().map(|p| p.1).sum::<u64>(), 8 << 30);
        // Degenerate sizes: nothing, less than a page, a first part past the region.
        assert!(parts(0, PIN_FIRST).is_empty());
        assert_eq!(parts(256, PIN_FIRST), vec![(0, 256)]);
        assert_eq!(parts(4 << 30, u64::MAX), vec![(0, 4 << 30)]);
        assert_eq!(parts(4 << 30, 0)[0], (0, PIN_GAP), "at least a page first");
        // A region that ends right after a part ends in a (short) gap, never an empty block.
        let l = parts(2 * PIN_GAP + 256, PIN_GAP);
        assert_eq!(l, vec![(0, PIN_GAP), (PIN_GAP, PIN_GAP), (2 * PIN_GAP, 256)]);
        assert!(parts(3 * PIN_GAP - 256, PIN_GAP).iter().all(|p| p.1 > 0));
    }

    /// The first part is pinned before the pool exists; until a later part is pinned no buffer
    /// lies there, and no buffer ever spans two parts. Parts are pinned in offset order, each
    /// once, and held-back bytes and gaps do not count in the peak.
    #[test]
    fn background_pinning_hands_out_only_pinned_parts() {
        let (go, gate) = std::sync::mpsc::channel::<()>();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let seen = calls.clone();
        let mut k = 0;
        // Layout of 8 pages: parts at pages 0, 2, 4–5 and 7.
        let p = in_parts(
            8 * PIN_GAP,
            Box::new(move |addr, len| {
                if k > 0 {
                    gate.recv().map_err(|e| e.to_string())?;
                }
                k += 1;
                seen.lock().unwrap().push((addr, len));
                Ok(())
            }),
        )
        .unwrap();
        let base = p.base as usize;
        let page = PIN_GAP as usize;
        assert_eq!(
            *calls.lock().unwrap(),
            vec![(base, page)],
            "the first part, before the pool is made"
        );
        assert_eq!(p.unpinned(), 4 * PIN_GAP);
        assert!(p.alloc(2 * page).is_none(), "only the first part is pinned");
        let (a, pa) = p.alloc(page).expect("the pinned part serves");
        assert_eq!(pa, p.base);
        assert_eq!(p.peak.load(Relaxed), PIN_GAP);
        for _ in 0..3 {
            go.send(()).unwrap();
        }
        wait_until(|| p.unpinned() == 0);
        assert_eq!(
            *calls.lock().unwrap(),
            vec![
                (base, page),
                (base + 2 * page, page),
                (base + 4 * page, 2 * page),
                (base + 7 * page, page)
            ]
        );
        p.free(a);
        assert!(p.alloc(3 * page).is_none(), "no buffer spans two parts");
        let (_, pb) = p.alloc(2 * page).expect("the largest part");
        assert_eq!(pb as usize, base + 4 * page);
        assert_eq!(p.peak.load(Relaxed), 2 * PIN_GAP);
    }

    /// A pool dropped while it is being pinned stops the pinning after the part in hand and
    /// releases its region only then; a failed pin leaves the rest held back; a failed first
    /// part is an error.
    #[test]
    fn pinning_stops_at_drop_and_at_an_error() {
        let calls = Arc::new(AtomicU64::new(0));
        let n = calls.clone();
        let p = in_parts(
            1 << 30,
            Box::new(move |_, _| {
                n.fetch_add(1, Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(5));
                Ok(())
            }),
        )
        .unwrap();
        let total = parts(p.capacity(), PIN_GAP).len().div_ceil(2) as u64;
        wait_until(|| calls.load(Relaxed) >= 3);
        drop(p);
        let at_drop = calls.load(Relaxed);
        assert!(
            at_drop < total,
            "pinned {at_drop} of {total} parts before the drop ended it"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(calls.load(Relaxed), at_drop, "no pin after the drop");

        let mut k = 0;
        let p = in_parts(
            8 * PIN_GAP,
            Box::new(move |_, _| {
                k += 1;
                if k == 3 {
                    Err("refused".into())
                } else {
                    Ok(())
                }
            }),
        )
        .unwrap();
        wait_until(|| p.pinner.lock().unwrap().as_ref().is_some_and(|h| h.is_finished()));
        // Pages 0 and 2 pinned; the part of pages 4–5 refused, page 7 never tried.
        assert_eq!(p.unpinned(), 3 * PIN_GAP);
        assert!(p.alloc(PIN_GAP as usize).is_some() && p.alloc(PIN_GAP as usize).is_some());
        assert!(p.alloc(PIN_GAP as usize).is_none());

        let refused = in_parts(8 * PIN_GAP, Box::new(|_, _| Err("no".into())));
        assert_eq!(refused.err().as_deref(), Some("no"));

        // Fewer bytes than the alignment: an empty pool, nothing pinned, no panic.
        let (base, release) = zeroed_heap(100).unwrap();
        // SAFETY: `base` holds 100 bytes until `release` runs.
        let empty = unsafe { HostPool::pinned_in_parts(base, 100, release, 0, Box::new(|_, _| Err("no".into()))) };
        assert!(empty.unwrap().alloc(1).is_none());
    }
}
