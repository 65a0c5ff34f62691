//! The CUDA backend on cudarc (dynamic loading: the driver is looked up at run time).
//!
//! cudarc panics when `libcuda` is missing, so [`probe`] checks `is_culib_present()` before any
//! other call. Per device: one context (the primary one), one pool reserved at start-up with a
//! single `cuMemAlloc` of a fraction of free memory, an input, an output and several exec
//! streams, and events for every hand-off. Peer access is enabled between every pair of devices
//! the driver reports capable.
//!
//! Host memory that copies read or write is pinned where it can be: the registered host pool
//! and the bounce pool are mapped by [`CudaBackend::pinnable_region`] and registered with
//! `cuMemHostRegister` (on H200, pinned copies run at 55 GB/s against 6.8–9.4 GB/s from pageable
//! memory); a buffer past the pinned pools stays pageable and is copied at the pageable rate.

mod backend;
mod context;
pub(crate) mod graph;
mod host;

pub use context::CudaTaskContext;
use context::Resources;

use crate::signal_mirror::{PeerMirror, SignalMirror};
use crate::{Backend, BatchCopy, DeviceError, Launch, Mem, Stream, TileView};
use cudarc::driver::sys;
use cudarc::driver::{result, CudaContext, CudaStream};
use ferry_base::shm::ShmHandle;
use smallvec::SmallVec;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, OnceLock};

/// Free events of one device, recorded again and again instead of created and destroyed per
/// hand-off (the manager records one or two per task).
pub(crate) type EventPool = Arc<Mutex<Vec<sys::CUevent>>>;

/// An event taken from its device's pool; goes back there when dropped.
pub struct PooledEvent {
    ev: sys::CUevent,
    pool: EventPool,
}

// SAFETY: a CUevent is a driver handle usable from any thread; the manager thread is its only user.
unsafe impl Send for PooledEvent {}

impl PooledEvent {
    /// Records an event of `pool` (a new one, with `flags`, when the pool is empty) on `stream`.
    ///
    /// # Safety
    /// `stream` is a live stream of the context current on this thread, the one the pool's
    /// events were created in.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] from `cuEventCreate` or `cuEventRecord`.
    pub(crate) unsafe fn record(
        pool: &EventPool,
        flags: sys::CUevent_flags,
        stream: sys::CUstream,
    ) -> Result<PooledEvent, DeviceError> {
        let free = pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let ev = match free {
            Some(ev) => ev,
            None => result::event::create(flags).map_err(cuda_err("cuEventCreate"))?,
        };
        let e = PooledEvent { ev, pool: pool.clone() };
        // Re-recording an event that another stream still waits on is fine:
        // cuStreamWaitEvent captured it.
        result::event::record(e.ev, stream).map_err(cuda_err("cuEventRecord"))?;
        Ok(e)
    }

    /// The driver's handle.
    pub(crate) fn raw(&self) -> sys::CUevent {
        self.ev
    }

    /// Whether the work recorded before it has completed.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] from `cuEventQuery` (a failed copy or kernel).
    pub(crate) fn is_complete(&self) -> Result<bool, DeviceError> {
        // SAFETY: a live event.
        match unsafe { result::event::query(self.ev) } {
            Ok(()) => Ok(true),
            Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(err) => Err(cuda_err("cuEventQuery")(err)),
        }
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).push(self.ev);
    }
}
use std::sync::Arc;

fn cuda_err(op: &'static str) -> impl Fn(result::DriverError) -> DeviceError {
    move |e| DeviceError::Cuda {
        op,
        msg: format!("{e:?}"),
    }
}

/// Maps the allocation whose IPC handle (`cuIpcGetMemHandle`'s 64 bytes, at the start of
/// `handle`) another process of this node exported, into the current context, with peer access
/// enabled lazily; returns its base address here.
///
/// # Safety
/// The context of the device to map it on is current. The mapping is closed once, with
/// `cuIpcCloseMemHandle`, when nothing uses it any more.
///
/// # Errors
/// [`DeviceError::Cuda`] when the driver refuses the handle.
pub(crate) unsafe fn ipc_open(handle: &[u8]) -> Result<sys::CUdeviceptr, DeviceError> {
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    for (x, &b) in h.reserved.iter_mut().zip(handle) {
        *x = b as std::ffi::c_char;
    }
    let mut base: sys::CUdeviceptr = 0;
    sys::cuIpcOpenMemHandle_v2(
        &mut base,
        h,
        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
    )
    .result()
    .map_err(cuda_err("cuIpcOpenMemHandle"))?;
    Ok(base)
}

/// Number of CUDA devices, or why there are none. Never panics: the driver library is probed
/// before cudarc touches it.
pub fn probe() -> Result<usize, DeviceError> {
    // SAFETY: a plain check whether the shared library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::NoDriver);
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err(DeviceError::NoDevices),
        Err(e) => Err(DeviceError::Cuda {
            op: "cuDeviceGetCount",
            msg: format!("{e:?}"),
        }),
    }
}

struct CudaDevice {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    base: u64,
    capacity: u64,
    /// In, Out, Comm(0..), Exec(0..) (see [`Stream::index`]).
    streams: Vec<Arc<CudaStream>>,
    events: EventPool,
    /// Events that can be timed ([`Backend::enable_timing`]); a pool of their own, so an event
    /// created without timing never comes back as a timed one.
    timed_events: EventPool,
    resources: Vec<Resources>,
    /// The copy kernel for small device-to-device copies (`FERRY_SM_COPY_BYTES`).
    copy_kernel: crate::sm_copy::CopyKernel,
    /// The host mirror of the signal words, made when the pool is first exported (only ranks
    /// of one node read it); `Some(None)` where it could not be made.
    mirror: OnceLock<Option<SignalMirror>>,
    /// The acknowledging copy kernels' counters (`sm_copy::launch_acked`), one per stream:
    /// `None` until first needed, then the address, or `None` where it could not be made.
    ack_counter: Option<Option<u64>>,
}

/// Another process's pool, mapped through CUDA IPC by someone else (the communication engine).
struct RemotePool {
    /// The local device it is mapped for.
    dev: usize,
    base: u64,
    /// The host mirror of its signal words, where its owner published one.
    mirror: Option<PeerMirror>,
    /// Its owner published a mirror that could not be mapped.
    mirror_missing: bool,
}

/// The CUDA GPUs of one rank.
pub struct CudaBackend {
    devs: Vec<CudaDevice>,
    exec: usize,
    /// Per (a, b): the driver's performance rank of the peer link (lower is faster), if any.
    peer: Vec<Vec<Option<u32>>>,
    /// Other processes' pools mapped through CUDA IPC.
    remote: Vec<RemotePool>,
    /// Whether events are recorded with timing ([`Backend::enable_timing`]).
    timing: bool,
    /// Whether `cuMemcpyBatchAsync` (CUDA 13 driver API) takes batches of copies: `None` until
    /// first needed, then whether the driver exports it; `false` too after the driver refused a
    /// batch (copies then go one by one).
    batch: Option<bool>,
    /// Whether the driver exports the stream memory operations (`cuStreamWriteValue64_v2`,
    /// `cuStreamWaitValue64_v2`): probed on first use, like `batch`.
    mem_ops: Option<bool>,
    /// Batches of device-to-device copies of at most this many bytes each go through the copy
    /// kernel (0: none; `FERRY_SM_COPY_BYTES`), each copy over at most `sm_copy_blocks` thread
    /// blocks; lone copies always go to a copy engine.
    sm_copy_bytes: u64,
    sm_copy_blocks: u32,
    /// Fault injection: the copy kernel fails to build (`FERRY_FAULTS=no-copy-kernel:1`).
    sm_copy_fault: bool,
}

// SAFETY: the backend lives on, and is used only by, the GPU manager thread after it is moved
// there once; the `Resources` caches (RefCell, non-Send handles) never leave that thread.
unsafe impl Send for CudaBackend {}

/// Checks every peer link the driver reported and access was enabled for: 4 KiB of a pattern
/// copied from device a's pool to device b's (still unused at start-up) must arrive intact. A
/// link that fails is dropped (those tiles go through the host) with a warning: a driver that
/// reports peer access which does not work would otherwise corrupt data silently.
fn verify_peer_links(devs: &[CudaDevice], peer: &mut [Vec<Option<u32>>]) {
    const N: usize = 4096;
    for a in 0..devs.len() {
        for b in 0..devs.len() {
            if peer[a][b].is_none() {
                continue;
            }
            let pattern: Vec<u8> = (0..N).map(|k| (k * 31 + a * 7 + b * 13) as u8).collect();
            let mut back = vec![0u8; N];
            // SAFETY: the first 2 × 4 KiB of each pool are unused until the manager starts.
            let r = unsafe {
                devs[a]
                    .ctx
                    .bind_to_thread()
                    .and_then(|_| result::memcpy_htod_sync(devs[a].base, &pattern))
                    .and_then(|_| {
                        devs[b].ctx.bind_to_thread()?;
                        result::memcpy_dtod_sync(devs[b].base + N as u64, devs[a].base, N)?;
                        result::memcpy_dtoh_sync(&mut back, devs[b].base + N as u64)
                    })
            };
            match r {
                Ok(()) if back == pattern => {
                    tracing::info!(from = devs[a].ordinal, to = devs[b].ordinal, rank = ?peer[a][b], "peer link checked")
                }
                Ok(()) => {
                    tracing::warn!(
                        from = devs[a].ordinal,
                        to = devs[b].ordinal,
                        "peer copy delivered other bytes: link not used"
                    );
                    peer[a][b] = None;
                }
                Err(e) => {
                    tracing::warn!(from = devs[a].ordinal, to = devs[b].ordinal, error = %e, "peer copy failed: link not used");
                    peer[a][b] = None;
                }
            }
        }
    }
}

impl CudaBackend {
    /// Opens the GPUs with the given ordinals, reserves `fraction` of each one's free memory (or
    /// exactly `bytes` when given), creates the streams and enables peer access.
    pub fn new(ordinals: &[usize], fraction: f64, bytes: Option<u64>, exec: usize) -> Result<CudaBackend, DeviceError> {
        let mut devs = Vec::new();
        for &ord in ordinals {
            let ctx = CudaContext::new(ord).map_err(cuda_err("cuCtxCreate"))?;
            ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
            // The manager orders work with its own events.
            // SAFETY: ferry tracks every dependency itself and never uses cudarc's slices.
            unsafe { ctx.disable_event_tracking() };
            let (free, total) = result::mem_get_info().map_err(cuda_err("cuMemGetInfo"))?;
            let capacity = bytes.unwrap_or(((free as f64) * fraction) as u64) & !0xFFFF;
            // The pool, then its signal words (zeroed: offers count up from 1), in one allocation
            // so that a peer's IPC mapping of the pool covers them.
            let alloc = crate::pool_allocation(capacity);
            // SAFETY: plain allocation; freed in Drop with the context bound. The memset covers
            // the signal area, inside the allocation.
            let base = unsafe {
                let base = result::malloc_sync(alloc as usize).map_err(cuda_err("cuMemAlloc (device pool)"))?;
                let signals = base + crate::signal_offset(capacity, 0);
                result::memset_d8_sync(signals, 0, crate::SIGNAL_BYTES as usize)
                    .map_err(cuda_err("cuMemsetD8 (signal words)"))?;
                base
            };
            // In, Out, Comm(..), then Exec(0) at the highest priority (critical-path tasks), the
            // others at the default one.
            let (_, greatest) =
                result::stream::get_priority_range().map_err(cuda_err("cuCtxGetStreamPriorityRange"))?;
            let mut streams = Vec::new();
            for k in 0..Stream::count(exec) {
                let s = if k == Stream::Exec(0).index() {
                    ctx.new_stream_with_priority(greatest)
                } else {
                    ctx.new_stream()
                };
                streams.push(s.map_err(cuda_err("cuStreamCreate"))?);
            }
            let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
            tracing::info!(ordinal = ord, %name, pool_gib = capacity as f64 / (1u64 << 30) as f64, free, total, "CUDA device pool reserved");
            devs.push(CudaDevice {
                ordinal: ord,
                name,
                ctx,
                base,
                capacity,
                streams,
                events: EventPool::default(),
                timed_events: EventPool::default(),
                resources: (0..exec).map(|_| Resources::default()).collect(),
                copy_kernel: Default::default(),
                mirror: OnceLock::new(),
                ack_counter: None,
            });
        }
        let n = devs.len();
        let mut peer = vec![vec![None; n]; n];
        for a in 0..n {
            for b in 0..n {
                if a == b {
                    continue;
                }
                let mut can = 0;
                // SAFETY: plain driver queries and settings on valid contexts.
                unsafe {
                    let da = result::device::get(devs[a].ordinal as i32).map_err(cuda_err("cuDeviceGet"))?;
                    let db = result::device::get(devs[b].ordinal as i32).map_err(cuda_err("cuDeviceGet"))?;
                    sys::cuDeviceCanAccessPeer(&mut can, da, db)
                        .result()
                        .map_err(cuda_err("cuDeviceCanAccessPeer"))?;
                    if can != 0 {
                        devs[a].ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
                        let r = sys::cuCtxEnablePeerAccess(devs[b].ctx.cu_ctx(), 0);
                        if r != sys::CUresult::CUDA_SUCCESS
                            && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                        {
                            return Err(DeviceError::Cuda {
                                op: "cuCtxEnablePeerAccess",
                                msg: format!("{r:?}"),
                            });
                        }
                    }
                }
                if can != 0 {
                    // The driver's relative rank of the link (lower is faster: NVLink before
                    // PCIe): what a stage-in picks its source by.
                    let mut rank = 0;
                    // SAFETY: a plain driver query on valid devices.
                    let r = unsafe {
                        let da = result::device::get(devs[a].ordinal as i32).map_err(cuda_err("cuDeviceGet"))?;
                        let db = result::device::get(devs[b].ordinal as i32).map_err(cuda_err("cuDeviceGet"))?;
                        sys::cuDeviceGetP2PAttribute(
                            &mut rank,
                            sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK,
                            da,
                            db,
                        )
                    };
                    peer[a][b] = Some(if r == sys::CUresult::CUDA_SUCCESS {
                        rank.max(0) as u32
                    } else {
                        0
                    });
                }
            }
        }
        verify_peer_links(&devs, &mut peer);
        Ok(CudaBackend {
            devs,
            exec,
            peer,
            remote: Vec::new(),
            timing: false,
            batch: None,
            mem_ops: None,
            sm_copy_bytes: 0,
            sm_copy_blocks: 1,
            sm_copy_fault: false,
        })
    }

    /// Batches of device-to-device copies (this device's pool, peers' pools mapped through IPC)
    /// of at most `bytes` each go through the copy kernel ([`crate::sm_copy`]), each copy over at
    /// most `blocks` thread blocks of 256 threads; `bytes == 0` leaves every copy to the copy
    /// engines. The kernel is compiled now, for every device. `fault`: it fails to build, as
    /// without NVRTC (fault injection).
    pub fn set_sm_copies(&mut self, bytes: u64, blocks: u32, fault: bool) {
        self.sm_copy_bytes = bytes;
        self.sm_copy_blocks = blocks.max(1);
        self.sm_copy_fault = fault;
        if bytes > 0 {
            // Compiled now, at start-up: on first use the NVRTC compile stalled the GPU
            // manager in the middle of a run (a 2-rank Cholesky 8192 on H200 took 21–26 ms
            // longer).
            for d in 0..self.devs.len() {
                if self.bind(d).is_ok() {
                    let dev = &mut self.devs[d];
                    let _ = dev.copy_kernel.get(&dev.ctx, dev.ordinal, fault);
                }
            }
        }
    }

    /// Enqueues `copies` (`(dst, src, len)` ends on device `d`) through the copy kernel, in
    /// launches of at most [`crate::sm_copy::MAX_COPIES`]. `Ok(false)` (nothing enqueued) when
    /// a copy does not qualify — an end in host memory, or longer than `FERRY_SM_COPY_BYTES` —
    /// or the kernel is unavailable: the caller uses the copy engines.
    ///
    /// # Safety
    /// As [`Backend::copy`] for each copy.
    unsafe fn sm_copies(
        &mut self,
        d: usize,
        s: Stream,
        copies: &[(Mem, Mem, usize)],
        acks: &[(Mem, u64)],
    ) -> Result<bool, DeviceError> {
        let device = |m: &Mem| matches!(m, Mem::Pool(_) | Mem::Remote { .. });
        if self.sm_copy_bytes == 0
            || acks.len() > crate::sm_copy::MAX_COPIES
            || !copies
                .iter()
                .all(|(dst, src, len)| device(dst) && device(src) && *len as u64 <= self.sm_copy_bytes)
        {
            return Ok(false);
        }
        let mut ends = Vec::with_capacity(copies.len());
        for &(dst, src, len) in copies.iter().filter(|c| c.2 > 0) {
            ends.push((self.at(d, dst)?, self.at(d, src)?, len));
        }
        let mut words: SmallVec<[(u64, u64); 8]> = SmallVec::new();
        for &(at, value) in acks {
            let addr = self.at(d, at)?;
            if addr % 8 != 0 {
                return Err(DeviceError::Body("misaligned acknowledgement word".into()));
            }
            words.push((addr, value));
        }
        if ends.is_empty() {
            return Ok(false);
        }
        self.bind(d)?;
        let fault = self.sm_copy_fault;
        let loaded = |dev: &mut CudaDevice| dev.copy_kernel.get(&dev.ctx, dev.ordinal, fault).is_some();
        if !loaded(&mut self.devs[d]) {
            return Ok(false);
        }
        // Each stream its own counter: launches that share one must be ordered.
        let counter = if words.is_empty() {
            0
        } else {
            match self.ack_counter(d) {
                Some(c) => c + 4 * s.index() as u64,
                None => return Ok(false),
            }
        };
        let dev = &mut self.devs[d];
        let Some(f) = dev.copy_kernel.get(&dev.ctx, dev.ordinal, fault) else {
            return Ok(false);
        };
        let stream = &dev.streams[s.index()];
        let chunks = ends.chunks(crate::sm_copy::MAX_COPIES).count();
        for (k, chunk) in ends.chunks(crate::sm_copy::MAX_COPIES).enumerate() {
            // The acknowledgements go with the last chunk: the ones before it on the stream
            // have run by then.
            // SAFETY: the caller's contract (live, mapped, non-overlapping ranges; mapped
            // acknowledgement words); the counter is this device's, and acknowledged batches
            // are enqueued on one stream (`ACK_STREAM`).
            let r = unsafe {
                if k + 1 == chunks && !words.is_empty() {
                    crate::sm_copy::launch_acked(stream, &f.acked, chunk, self.sm_copy_blocks, &words, counter)
                } else {
                    crate::sm_copy::launch(stream, &f.batch, chunk, self.sm_copy_blocks)
                }
            };
            if let Err(msg) = r {
                // The caller fails every copy of the batch and may release their blocks: the
                // chunks already enqueued must not still be writing into them.
                if k > 0 {
                    let _ = stream.synchronize();
                }
                return Err(DeviceError::Cuda {
                    op: "cuLaunchKernel (copy kernel)",
                    msg,
                });
            }
        }
        Ok(true)
    }

    /// The acknowledging copy kernels' counters on device `d` (one zeroed 4-byte word per
    /// stream, [`Stream::index`]), made on first use (with the device bound); `None` where that
    /// failed (said once; acknowledgement words are then written by the streams).
    fn ack_counter(&mut self, d: usize) -> Option<u64> {
        if let Some(c) = self.devs[d].ack_counter {
            return c;
        }
        let bytes = 4 * Stream::count(self.exec);
        // SAFETY: a fresh allocation in the bound context, freed in Drop. The memset runs on
        // the legacy stream, which the runtime's (non-blocking) streams do not wait for: the
        // context is synchronised before any kernel may count there.
        let made = unsafe {
            result::malloc_sync(bytes).and_then(|c| {
                result::memset_d8_sync(c, 0, bytes)
                    .and_then(|_| self.devs[d].ctx.synchronize())
                    .map(|_| c)
                    .inspect_err(|_| {
                        let _ = result::free_sync(c);
                    })
            })
        };
        let c = made
            .map_err(|e| tracing::warn!(device = d, error = ?e, "no counter for the acknowledging copy kernel: acknowledgements are written by the streams"))
            .ok();
        self.devs[d].ack_counter = Some(c);
        c
    }

    /// The address of one end of a copy enqueued on device `d` (unified addressing: one
    /// `cuMemcpyAsync` covers device, pinned host and mapped remote memory alike).
    fn at(&self, d: usize, m: Mem) -> Result<u64, DeviceError> {
        match m {
            Mem::Pool(off) => Ok(self.devs[d].base + off),
            Mem::Host(p) => Ok(p as u64),
            Mem::Remote { pool, off } => match self.remote.get(pool) {
                Some(r) if r.dev == d => Ok(r.base + off),
                _ => Err(DeviceError::Body(format!(
                    "remote pool {pool} is not mapped for device {d}"
                ))),
            },
        }
    }
    fn stream(&self, d: usize, s: Stream) -> &Arc<CudaStream> {
        &self.devs[d].streams[s.index()]
    }

    /// Fails when the driver lacks the stream memory operations (probed once: cudarc panics
    /// on a missing symbol).
    fn check_mem_ops(&mut self) -> Result<(), DeviceError> {
        // SAFETY: looking symbols up in the loaded driver library calls nothing.
        let ok = *self.mem_ops.get_or_insert_with(|| unsafe {
            sys::culib().get::<*const ()>(b"cuStreamWriteValue64_v2\0").is_ok()
                && sys::culib().get::<*const ()>(b"cuStreamWaitValue64_v2\0").is_ok()
        });
        if ok {
            Ok(())
        } else {
            Err(DeviceError::Body(
                "the CUDA driver has no stream memory operations (cuStreamWaitValue64)".into(),
            ))
        }
    }

    /// Device `d`'s CUDA ordinal (among the visible devices): how the driver, and a
    /// communication engine over every device of the process, number it.
    pub fn ordinal(&self, d: usize) -> usize {
        self.devs[d].ordinal
    }

    /// Makes device `d`'s context current on the calling thread.
    ///
    /// # Errors
    /// The driver refused (`cuCtxSetCurrent`).
    pub fn bind(&self, d: usize) -> Result<(), DeviceError> {
        self.devs[d].ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))
    }

    /// Whether device `d`'s context is shared through MPS (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`);
    /// `None` where the driver cannot say.
    pub fn mps_enabled(&self, d: usize) -> Option<bool> {
        // SAFETY: plain driver queries on a valid device ordinal.
        unsafe {
            let dev = result::device::get(self.devs[d].ordinal as i32).ok()?;
            let v =
                result::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED).ok()?;
            Some(v != 0)
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Peers' pools are attached, not owned (`Backend::ipc_attach`): their mappings close
        // with whoever opened them, after this drop has synchronised the copies that used them.
        for d in &self.devs {
            if d.ctx.bind_to_thread().is_ok() {
                let _ = d.ctx.synchronize();
                let mut idle: Vec<sys::CUevent> =
                    d.events.lock().unwrap_or_else(|p| p.into_inner()).drain(..).collect();
                idle.extend(d.timed_events.lock().unwrap_or_else(|p| p.into_inner()).drain(..));
                for ev in idle {
                    // SAFETY: pooled events are idle (the device is synchronised) and unused.
                    let _ = unsafe { result::event::destroy(ev) };
                }
                d.resources.iter().for_each(|r| r.map.borrow_mut().clear());
                // SAFETY: the pool was allocated by malloc_sync in this context; nothing uses it now.
                let _ = unsafe { result::free_sync(d.base) };
                if let Some(Some(c)) = d.ack_counter {
                    // SAFETY: allocated by `ack_counter` in this context; the device is idle.
                    let _ = unsafe { result::free_sync(c) };
                }
            }
        }
    }
}
