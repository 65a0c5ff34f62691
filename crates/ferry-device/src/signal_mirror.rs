//! Host mirrors of a CUDA device's signal words, for the ranks of its node.
//!
//! A consumer's pull of a tile offered at its producer's launch must not read the tile before
//! the producer's kernel has finished: the producer's stream writes a signal word behind the
//! kernel, and the pull waits for it. Waiting on the device (`cuStreamWaitValue64` on the
//! peer's word) costs the consumer's GPU manager a driver call per batch (≈ 1.5 µs on H200),
//! and a stream wait wakes 12–14 µs after the word is written, where a thread polling it wakes
//! in about 7 (`transfer --wake-probe` measures both).
//!
//! So the producer's stream also writes each signal value into a page of shared host memory
//! (a `memfd` mapping registered with the driver and mapped for the device), right after the
//! device word and with the same memory barrier; the other ranks of the node map the page
//! read-only and their GPU managers hold an offered pull back until its value shows there,
//! then enqueue it with no wait at all ([`super::Backend::signal_mirror`]). The producer pays
//! one more stream write per signalled launch (≈ 0.9 µs of host time).

use cudarc::driver::{sys, CudaContext};
use ferry_base::shm::{SharedMem, ShmHandle};
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Bytes of one mirror: a page, of which the first [`super::SIGNAL_SLOTS`] words are used.
const BYTES: usize = 4096;

const _: () = assert!(super::SIGNAL_SLOTS * 8 <= BYTES);

/// This process's mirror of one device's signal words: a shared page registered with the
/// driver, and its device address (what the device's streams write).
pub struct SignalMirror {
    /// Dropped only once unregistered (see the drop).
    mem: ManuallyDrop<SharedMem>,
    ctx: Arc<CudaContext>,
    device_addr: u64,
}

impl SignalMirror {
    /// Creates the page and registers it in `ctx` (made current on this thread).
    ///
    /// # Errors
    /// The failing system or driver call, as text.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<SignalMirror, String> {
        let mem = SharedMem::create(c"ferry-signal-mirror", BYTES).map_err(|e| e.to_string())?;
        ctx.bind_to_thread().map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the page is this mapping's, alive until the drop below unregisters it.
        unsafe { sys::cuMemHostRegister_v2(mem.base() as *mut c_void, BYTES, flags) }
            .result()
            .map_err(|e| format!("cuMemHostRegister: {e:?}"))?;
        let mut device_addr: sys::CUdeviceptr = 0;
        // SAFETY: registered just above with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_addr, mem.base() as *mut c_void, 0) }.result();
        if let Err(e) = r {
            // SAFETY: registered just above; nothing uses it.
            let _ = unsafe { sys::cuMemHostUnregister(mem.base() as *mut c_void) };
            return Err(format!("cuMemHostGetDevicePointer: {e:?}"));
        }
        Ok(SignalMirror {
            mem: ManuallyDrop::new(mem),
            ctx: ctx.clone(),
            device_addr,
        })
    }

    /// The device address of the mirror of signal word `slot` (below
    /// [`super::SIGNAL_SLOTS`]).
    pub fn device_word(&self, slot: usize) -> u64 {
        debug_assert!(slot < super::SIGNAL_SLOTS);
        self.device_addr + 8 * slot as u64
    }

    /// What the other ranks of the node open it with.
    pub fn handle(&self) -> Option<ShmHandle> {
        self.mem.handle()
    }
}

impl Drop for SignalMirror {
    fn drop(&mut self) {
        // Unmapping a page the driver still has registered would leave it pinned memory that
        // no longer belongs to the mapping: without the context, the page is kept.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered in `new`; the backend drops its mirrors after synchronising
            // its devices, so no stream writes the page any more.
            let _ = unsafe { sys::cuMemHostUnregister(self.mem.base() as *mut c_void) };
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.mem) };
        }
    }
}

/// Another rank's mirror of one of its devices' signal words, mapped here.
pub struct PeerMirror {
    mem: SharedMem,
    /// Offset of the peer's signal word 0 from the base of its pool (what [`super::Mem::Remote`]
    /// words name).
    first_word: u64,
}

impl PeerMirror {
    /// Maps the mirror a peer published with its pool, whose signal words start at pool offset
    /// `first_word`.
    ///
    /// # Errors
    /// A handle of another size than a mirror's, or the failing system call, as text.
    pub fn open(h: ShmHandle, first_word: u64) -> Result<PeerMirror, String> {
        if h.len != BYTES as u64 {
            return Err(format!("a signal mirror of {} bytes (expected {BYTES})", h.len));
        }
        let mem = SharedMem::open(h).map_err(|e| e.to_string())?;
        Ok(PeerMirror { mem, first_word })
    }

    /// The mirror of the peer's signal word at pool offset `off`, or `None` when `off` is not
    /// one of its signal words.
    pub fn word(&self, off: u64) -> Option<*const std::sync::atomic::AtomicU64> {
        let i = off.checked_sub(self.first_word)?;
        (i % 8 == 0 && i < 8 * super::SIGNAL_SLOTS as u64)
            // SAFETY: within the page (checked just above), 8-byte aligned (page-aligned base).
            .then(|| unsafe { self.mem.base().add(i as usize) } as *const std::sync::atomic::AtomicU64)
    }
}
