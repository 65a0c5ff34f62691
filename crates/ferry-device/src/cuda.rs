//! The CUDA backend on cudarc (dynamic loading: the driver is looked up at run time).
//!
//! cudarc panics when `libcuda` is missing, so [`probe`] checks `is_culib_present()` before any
//! other call. Per device: one context (the primary one), one pool reserved at start-up with a
//! single `cuMemAlloc` of a fraction of free memory, an input, an output and several exec
//! streams, and events for every hand-off. Peer access is enabled between every pair of devices
//! the driver reports capable.
//!
//! Host buffers are ordinary (pageable) memory for now: copies from them run at the pageable
//! rate (`ANCHORS.md`: 6.8–9.4 GB/s against 55 GB/s pinned); tiles produced and consumed on the
//! device never cross. Pinned staging is the next step (the bounce pool).

use super::signal_mirror::{PeerMirror, SignalMirror};
use super::{Backend, BatchCopy, DeviceError, Launch, Mem, Stream, TileView};
use cudarc::driver::sys;
use cudarc::driver::{result, CudaContext, CudaStream};
use ferry_base::error::TaskError;
use ferry_base::shm::ShmHandle;
use smallvec::SmallVec;
use std::ffi::c_void;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, OnceLock};

/// Free events of one device, recorded again and again instead of created and destroyed per
/// hand-off (the manager records one or two per task).
type EventPool = Arc<Mutex<Vec<sys::CUevent>>>;

/// An event taken from its device's pool; goes back there when dropped.
pub struct PooledEvent {
    ev: sys::CUevent,
    pool: EventPool,
}

// SAFETY: a CUevent is a driver handle usable from any thread; the manager thread is its only user.
unsafe impl Send for PooledEvent {}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).push(self.ev);
    }
}
use rustc_hash::FxHashMap as HashMap;
use std::any::{Any, TypeId};
use std::cell::{RefCell, RefMut};
use std::sync::Arc;

fn cuda_err(op: &'static str) -> impl Fn(result::DriverError) -> DeviceError {
    move |e| DeviceError::Cuda {
        op,
        msg: format!("{e:?}"),
    }
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

/// Per exec stream cache of library handles (cuBLAS, cuSOLVER, modules…), keyed by type.
#[derive(Default)]
struct Resources {
    map: RefCell<HashMap<TypeId, Box<dyn Any>>>,
}

/// What a CUDA task body sees: its stream, the device addresses and shapes of its tiles, its
/// arguments, and a per-stream cache for library handles.
///
/// The body runs on the GPU manager thread and must only *enqueue* work on
/// [`CudaTaskContext::stream`]; the manager records an event after it and releases the task's
/// successors when the event completes.
pub struct CudaTaskContext<'a> {
    stream: &'a Arc<CudaStream>,
    tiles: &'a [TileView],
    args: &'a [i64],
    seq: u64,
    device: usize,
    resources: &'a Resources,
}

impl<'a> CudaTaskContext<'a> {
    /// The exec stream to enqueue on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
    /// Device address (`CUdeviceptr`) of tile `k`, in access order.
    ///
    /// # Errors
    /// `k` out of range.
    pub fn ptr(&self, k: usize) -> Result<u64, TaskError> {
        self.tile(k).map(|t| t.ptr as u64)
    }
    /// `(rows, cols)` of tile `k`.
    ///
    /// # Errors
    /// `k` out of range.
    pub fn shape(&self, k: usize) -> Result<(usize, usize), TaskError> {
        self.tile(k).map(|t| (t.rows, t.cols))
    }
    /// Tile coordinates `(i, j)` of access `k`.
    ///
    /// # Errors
    /// `k` out of range.
    pub fn coords(&self, k: usize) -> Result<(usize, usize), TaskError> {
        self.tile(k).map(|t| t.coords)
    }
    fn tile(&self, k: usize) -> Result<&TileView, TaskError> {
        self.tiles
            .get(k)
            .ok_or_else(|| format!("tile index {k} out of range: the task has {} tiles", self.tiles.len()).into())
    }
    /// Number of tiles.
    pub fn num_tiles(&self) -> usize {
        self.tiles.len()
    }
    /// Scalar arguments.
    pub fn args(&self) -> &[i64] {
        self.args
    }
    /// Position of the task in the inserted sequence.
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// Index of the device among this rank's devices.
    pub fn device(&self) -> usize {
        self.device
    }
    /// A per-stream value of type `T` (e.g. a cuBLAS handle bound to this stream), created by
    /// `init` on first use and kept for the life of the runtime.
    ///
    /// # Errors
    /// `init`'s error, or a nested call for the same `T` while the first borrow is alive.
    pub fn resource<T: 'static>(
        &self,
        init: impl FnOnce(&Arc<CudaStream>) -> Result<T, TaskError>,
    ) -> Result<RefMut<'_, T>, TaskError> {
        let mut map = self
            .resources
            .map
            .try_borrow_mut()
            .map_err(|_| "resource already borrowed")?;
        if let std::collections::hash_map::Entry::Vacant(e) = map.entry(TypeId::of::<T>()) {
            e.insert(Box::new(init(self.stream)?));
        }
        RefMut::filter_map(map, |m| {
            m.get_mut(&TypeId::of::<T>()).and_then(|b| b.downcast_mut::<T>())
        })
        .map_err(|_| "resource has an unexpected type".into())
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
    copy_kernel: super::sm_copy::CopyKernel,
    /// The host mirror of the signal words, made when the pool is first exported (only ranks
    /// of one node read it); `Some(None)` where it could not be made.
    mirror: OnceLock<Option<SignalMirror>>,
    /// The acknowledging copy kernels' counters (`sm_copy::launch_acked`), one per stream:
    /// `None` until first needed, then the address, or `None` where it could not be made.
    ack_counter: Option<Option<u64>>,
}

/// Another process's pool mapped through CUDA IPC.
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
            let alloc = super::pool_allocation(capacity);
            // SAFETY: plain allocation; freed in Drop with the context bound. The memset covers
            // the signal area, inside the allocation.
            let base = unsafe {
                let base = result::malloc_sync(alloc as usize).map_err(cuda_err("cuMemAlloc (device pool)"))?;
                let signals = base + super::signal_offset(capacity, 0);
                result::memset_d8_sync(signals, 0, super::SIGNAL_BYTES as usize)
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
    /// of at most `bytes` each go through the copy kernel ([`super::sm_copy`]), each copy over at
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
            // longer; docs/benchmarks.md, session 22).
            for d in 0..self.devs.len() {
                if self.bind(d).is_ok() {
                    let dev = &mut self.devs[d];
                    let _ = dev.copy_kernel.get(&dev.ctx, dev.ordinal, fault);
                }
            }
        }
    }

    /// Enqueues `copies` (`(dst, src, len)` ends on device `d`) through the copy kernel, in
    /// launches of at most [`super::sm_copy::MAX_COPIES`]. `Ok(false)` (nothing enqueued) when
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
            || acks.len() > super::sm_copy::MAX_COPIES
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
        let chunks = ends.chunks(super::sm_copy::MAX_COPIES).count();
        for (k, chunk) in ends.chunks(super::sm_copy::MAX_COPIES).enumerate() {
            // The acknowledgements go with the last chunk: the ones before it on the stream
            // have run by then.
            // SAFETY: the caller's contract (live, mapped, non-overlapping ranges; mapped
            // acknowledgement words); the counter is this device's, and acknowledged batches
            // are enqueued on one stream (`ACK_STREAM`).
            let r = unsafe {
                if k + 1 == chunks && !words.is_empty() {
                    super::sm_copy::launch_acked(stream, &f.acked, chunk, self.sm_copy_blocks, &words, counter)
                } else {
                    super::sm_copy::launch(stream, &f.batch, chunk, self.sm_copy_blocks)
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

impl CudaBackend {
    /// A region of `bytes` of anonymous memory mapped here (page-aligned, not touched), the
    /// release that unregisters what was pinned and unmaps it, and the [`Pin`] that pins a part
    /// of it (`cuMemHostRegister`, portable: usable with every context), from any thread. For
    /// the registered host pool (which pins its first part at once and the rest in the
    /// background) and the bounce pool (pinned whole at once).
    ///
    /// Pinning a fresh mapping this way costs about 0.3 s per GiB on the H200 machines, where
    /// `cuMemHostAlloc` took 0.55 (docs/benchmarks.md, sessions 24 and 26).
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] when the memory cannot be mapped.
    ///
    /// [`Pin`]: crate::Pin
    pub fn pinnable_region(&self, bytes: u64) -> Result<(*mut u8, crate::Release, crate::Pin), DeviceError> {
        const PAGE: u64 = 4096;
        let map_len = usize::try_from(bytes.max(1).div_ceil(PAGE) * PAGE).map_err(|_| DeviceError::Cuda {
            op: "mmap (pinned host memory)",
            msg: format!("{bytes} bytes do not fit in this address space"),
        })?;
        // SAFETY: an anonymous private mapping, owned by the release function below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(DeviceError::Cuda {
                op: "mmap (pinned host memory)",
                msg: std::io::Error::last_os_error().to_string(),
            });
        }
        let ctx = self.devs[0].ctx.clone();
        // Start addresses of the registered parts; read by the release, which runs once no part
        // is being registered any more (`HostPool`'s drop joins its pinning thread first).
        let registered = Arc::new(Mutex::new(Vec::<usize>::new()));
        let release: crate::Release = {
            let (ctx, registered) = (ctx.clone(), registered.clone());
            Box::new(move |p| {
                let mut registered = registered.lock().unwrap_or_else(|e| e.into_inner());
                if !registered.is_empty() {
                    if let Err(e) = ctx.bind_to_thread() {
                        // Unmapping memory the driver still has registered would leave it
                        // pinned pages that no longer belong to the mapping: keep both.
                        tracing::warn!("pinned host memory kept at shutdown (cuCtxSetCurrent: {e:?})");
                        return;
                    }
                    for addr in registered.drain(..) {
                        // SAFETY: registered by `pin` below; no copy uses the memory any more.
                        let _ = unsafe { sys::cuMemHostUnregister(addr as *mut c_void) };
                    }
                }
                // SAFETY: the mapping made above, unmapped once.
                unsafe { libc::munmap(p as *mut c_void, map_len) };
            })
        };
        let (start, end) = (base as usize, base as usize + map_len);
        let pin: crate::Pin = Box::new(move |addr, len| {
            if addr < start || addr.saturating_add(len) > end {
                return Err(format!("{len} bytes at {addr:#x} lie outside the region"));
            }
            ctx.bind_to_thread().map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
            // SAFETY: `addr..addr + len` lies inside the mapping (checked above), which outlives
            // the registration (the release unregisters before it unmaps).
            unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
                .result()
                .map_err(|e| format!("cuMemHostRegister: {e:?}"))?;
            registered.lock().unwrap_or_else(|e| e.into_inner()).push(addr);
            Ok(())
        });
        Ok((base as *mut u8, release, pin))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        for r in &self.remote {
            if self.devs[r.dev].ctx.bind_to_thread().is_ok() {
                // SAFETY: mapped by cuIpcOpenMemHandle in this context; no copy uses it any more.
                let _ = unsafe { sys::cuIpcCloseMemHandle(r.base) };
            }
        }
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

impl Backend for CudaBackend {
    type Event = PooledEvent;

    fn devices(&self) -> usize {
        self.devs.len()
    }
    fn label(&self, d: usize) -> String {
        format!("cuda:{}", self.devs[d].ordinal)
    }
    fn describe(&self, d: usize) -> String {
        let v = &self.devs[d];
        format!(
            "cuda{} {} ({:.1} GiB pool)",
            v.ordinal,
            v.name,
            v.capacity as f64 / (1u64 << 30) as f64
        )
    }
    fn pool_bytes(&self, d: usize) -> u64 {
        self.devs[d].capacity
    }
    fn exec_streams(&self) -> usize {
        self.exec
    }
    fn peer_link(&self, a: usize, b: usize) -> bool {
        self.peer[a][b].is_some()
    }
    fn pci_address(&self, d: usize) -> Option<(u32, u8, u8)> {
        use sys::CUdevice_attribute as A;
        // SAFETY: plain driver queries on a valid device ordinal.
        unsafe {
            let dev = result::device::get(self.devs[d].ordinal as i32).ok()?;
            let q = |a| result::device::get_attribute(dev, a).ok();
            let dom = q(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
            let bus = q(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
            let slot = q(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
            Some((dom as u32, bus as u8, slot as u8))
        }
    }
    fn link_rank(&self, a: usize, b: usize) -> Option<u32> {
        self.peer[a][b]
    }
    unsafe fn h2d(&mut self, d: usize, s: Stream, dst: u64, src: *const u8, len: usize) -> Result<(), DeviceError> {
        self.bind(d)?;
        let src = std::slice::from_raw_parts(src, len);
        result::memcpy_htod_async(self.devs[d].base + dst, src, self.stream(d, s).cu_stream())
            .map_err(cuda_err("cuMemcpyHtoDAsync"))
    }
    unsafe fn d2h(&mut self, d: usize, s: Stream, dst: *mut u8, src: u64, len: usize) -> Result<(), DeviceError> {
        self.bind(d)?;
        let dst = std::slice::from_raw_parts_mut(dst, len);
        result::memcpy_dtoh_async(dst, self.devs[d].base + src, self.stream(d, s).cu_stream())
            .map_err(cuda_err("cuMemcpyDtoHAsync"))
    }
    unsafe fn peer(
        &mut self,
        d: usize,
        s: Stream,
        dst: u64,
        src_dev: usize,
        src: u64,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.bind(d)?;
        let (dd, sd) = (&self.devs[d], &self.devs[src_dev]);
        result::memcpy_peer_async(
            dd.ctx.cu_ctx(),
            dd.base + dst,
            sd.ctx.cu_ctx(),
            sd.base + src,
            len,
            self.stream(d, s).cu_stream(),
        )
        .map_err(cuda_err("cuMemcpyPeerAsync"))
    }
    fn addr(&self, d: usize, off: u64) -> u64 {
        self.devs[d].base + off
    }
    unsafe fn copy(&mut self, d: usize, s: Stream, dst: Mem, src: Mem, len: usize) -> Result<(), DeviceError> {
        // A lone copy goes to a copy engine even when the copy kernel is on: one launch costs
        // the manager more than one `cuMemcpyAsync`, and lone pulls were slower by kernel on 2×
        // H200 (sessions 20 and 22); the kernel pays off for batches (`copy_batch`) — and for a
        // lone pull that owes an acknowledgement, whose word it writes too (`copy_batch_acked`:
        // one launch against a copy and a stream write; its per-tile rate is not measured yet).
        self.bind(d)?;
        let (dst, src) = (self.at(d, dst)?, self.at(d, src)?);
        sys::cuMemcpyAsync(dst, src, len, self.stream(d, s).cu_stream())
            .result()
            .map_err(cuda_err("cuMemcpyAsync"))
    }
    /// The copy kernel runs a batch's copies side by side (a grid row each), so batches may
    /// hold copies up to its limit; the copy engines run them one after another.
    fn batch_copy_max(&self) -> usize {
        let kernel = self.sm_copy_bytes > 0
            && !self
                .devs
                .iter()
                .any(|d| matches!(d.copy_kernel, super::sm_copy::CopyKernel::Unavailable));
        let engines = 1 << 20;
        if kernel {
            engines.max(self.sm_copy_bytes as usize)
        } else {
            engines
        }
    }

    unsafe fn copy_batch_acked(
        &mut self,
        d: usize,
        s: Stream,
        ops: &[BatchCopy],
        acks: &[(Mem, u64)],
    ) -> Result<bool, DeviceError> {
        let copies: SmallVec<[(Mem, Mem, usize); 8]> = ops.iter().map(|op| (op.dst, op.src, op.len)).collect();
        // SAFETY: the caller's contract.
        unsafe { self.sm_copies(d, s, &copies, acks) }
    }
    unsafe fn copy_batch(&mut self, d: usize, s: Stream, ops: &[BatchCopy]) -> Result<(), DeviceError> {
        if self.sm_copy_bytes > 0 {
            let copies: Vec<(Mem, Mem, usize)> = ops.iter().map(|op| (op.dst, op.src, op.len)).collect();
            // SAFETY: the caller's contract.
            if unsafe { self.sm_copies(d, s, &copies, &[])? } {
                return Ok(());
            }
        }
        // cudarc loads each symbol on first call and panics on a missing one: probe it once.
        // SAFETY: looking a symbol up in the loaded driver library calls nothing.
        let batch = *self
            .batch
            .get_or_insert_with(|| unsafe { sys::culib().get::<*const ()>(b"cuMemcpyBatchAsync_v2\0") }.is_ok());
        if !batch || ops.len() < 2 {
            return super::copy_each(self, d, s, ops);
        }
        self.bind(d)?;
        let mut dsts = Vec::with_capacity(ops.len());
        let mut srcs = Vec::with_capacity(ops.len());
        let mut sizes = Vec::with_capacity(ops.len());
        for op in ops {
            dsts.push(self.at(d, op.dst)?);
            srcs.push(self.at(d, op.src)?);
            sizes.push(op.len);
        }
        // One attribute for all copies: sources are read in stream order (after the work
        // already on the stream). Location hints apply only to managed and pageable memory,
        // which a pool never is.
        let here = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.devs[d].ordinal as std::ffi::c_int,
        };
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: here,
            dstLocHint: here,
            flags: 0,
        }];
        let mut attr_idx = [0usize];
        let stream = self.stream(d, s).cu_stream();
        // SAFETY: the caller keeps every range alive and in bounds (the trait contract); the
        // arrays outlive the call, which copies them.
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                ops.len(),
                attrs.as_mut_ptr(),
                attr_idx.as_mut_ptr(),
                1,
                stream,
            )
        };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            // Refused as a whole (nothing enqueued): this driver cannot batch these copies; one
            // by one from now on.
            sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                tracing::info!(device = d, error = ?r, "cuMemcpyBatchAsync refused a batch: copies go one by one");
                self.batch = Some(false);
                super::copy_each(self, d, s, ops)
            }
            e => Err(cuda_err("cuMemcpyBatchAsync")(result::DriverError(e))),
        }
    }
    fn write_signal(&mut self, d: usize, s: Stream, at: Mem, value: u64) -> Result<(), DeviceError> {
        self.check_mem_ops()?;
        self.bind(d)?;
        let addr = self.at(d, at)?;
        if addr % 8 != 0 {
            return Err(DeviceError::Body("misaligned signal word".into()));
        }
        // A signal word of this device's own area is mirrored into host memory for the node's
        // other ranks, right behind it (`signal_mirror.rs`).
        let mirror = match at {
            Mem::Pool(off) => off
                .checked_sub(super::signal_offset(self.devs[d].capacity, 0))
                .map(|i| i / 8)
                .filter(|&slot| slot < super::SIGNAL_SLOTS as u64)
                .and_then(|slot| Some(self.devs[d].mirror.get()?.as_ref()?.device_word(slot as usize))),
            _ => None,
        };
        let stream = self.stream(d, s).cu_stream();
        for addr in std::iter::once(addr).chain(mirror) {
            // SAFETY: a word of this device's signal area or of a mapped peer pool (the
            // transfer layer checked the word against the peer's published pool), or its host
            // mirror, registered and mapped for this device; on a live stream. The default flag
            // puts a memory barrier before the write: the work before it on the stream is
            // visible to whoever sees the value.
            unsafe {
                sys::cuStreamWriteValue64_v2(
                    stream,
                    addr,
                    value,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as std::ffi::c_uint,
                )
            }
            .result()
            .map_err(cuda_err("cuStreamWriteValue64"))?;
        }
        Ok(())
    }
    fn wait_signal(&mut self, d: usize, s: Stream, at: Mem, value: u64) -> Result<(), DeviceError> {
        self.check_mem_ops()?;
        self.bind(d)?;
        let addr = self.at(d, at)?;
        // SAFETY: a mapped address on a live stream (the transfer layer checked the offset
        // against the peer's published pool).
        unsafe {
            sys::cuStreamWaitValue64_v2(
                self.stream(d, s).cu_stream(),
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as std::ffi::c_uint,
            )
        }
        .result()
        .map_err(cuda_err("cuStreamWaitValue64"))
    }
    fn ipc_export(&self, d: usize) -> Option<Vec<u8>> {
        self.bind(d).ok()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: the pool base came from cuMemAlloc in this context (exportable).
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, self.devs[d].base) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::info!(device = d, error = ?r, "the device pool cannot be exported through CUDA IPC");
            return None;
        }
        let mut out: Vec<u8> = h.reserved.iter().map(|&c| c as u8).collect();
        out.extend_from_slice(&self.devs[d].capacity.to_le_bytes());
        // The signal words' host mirror goes with the pool: only the ranks of this node, which
        // map the pool, read it (`signal_mirror.rs`). Without one, their pulls wait on the device.
        let mirror = self.devs[d].mirror.get_or_init(|| {
            SignalMirror::new(&self.devs[d].ctx)
                .map_err(|e| tracing::info!(device = d, error = %e, "no host mirror of the signal words: offered pulls wait on the device"))
                .ok()
        });
        if let Some(m) = mirror.as_ref().and_then(SignalMirror::handle) {
            out.extend_from_slice(&m.to_bytes());
        }
        Some(out)
    }
    fn ipc_open(&mut self, d: usize, handle: &[u8]) -> Result<usize, DeviceError> {
        const POOL: usize = 72;
        if handle.len() != POOL && handle.len() != POOL + ShmHandle::BYTES {
            return Err(DeviceError::Body(format!(
                "CUDA IPC handle of {} bytes (expected {POOL}, or {} with a signal mirror)",
                handle.len(),
                POOL + ShmHandle::BYTES
            )));
        }
        self.bind(d)?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (x, &b) in h.reserved.iter_mut().zip(&handle[..64]) {
            *x = b as std::ffi::c_char;
        }
        let capacity = u64::from_le_bytes(handle[64..72].try_into().expect("8 bytes"));
        // A mirror that cannot be mapped costs speed only: its pulls wait on the device.
        let published = ShmHandle::from_bytes(&handle[POOL..]);
        let mirror = published.and_then(|m| {
            PeerMirror::open(m, super::signal_offset(capacity, 0))
                .map_err(|e| tracing::info!(device = d, error = %e, "a peer's signal mirror cannot be mapped: its pulls wait on the device"))
                .ok()
        });
        let mirror_missing = published.is_some() && mirror.is_none();
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: a handle exported by another process of this node; closed in Drop.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
            .result()
            .map_err(cuda_err("cuIpcOpenMemHandle"))?;
        }
        self.remote.push(RemotePool {
            dev: d,
            base,
            mirror,
            mirror_missing,
        });
        Ok(self.remote.len() - 1)
    }
    fn ipc_mirror_missing(&self, remote: usize) -> bool {
        self.remote.get(remote).is_some_and(|r| r.mirror_missing)
    }
    fn publishes_signal_mirror(&self, d: usize) -> bool {
        self.devs[d].mirror.get().is_some_and(Option::is_some)
    }
    fn signal_mirror(&self, d: usize, at: Mem) -> Option<*const AtomicU64> {
        match at {
            Mem::Remote { pool, off } => self.remote.get(pool).filter(|r| r.dev == d)?.mirror.as_ref()?.word(off),
            _ => None,
        }
    }
    fn record(&mut self, d: usize, s: Stream) -> Result<PooledEvent, DeviceError> {
        self.bind(d)?;
        let (pool, flags) = if self.timing {
            (self.devs[d].timed_events.clone(), sys::CUevent_flags::CU_EVENT_DEFAULT)
        } else {
            (self.devs[d].events.clone(), sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        };
        let free = pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let ev = match free {
            Some(ev) => ev,
            None => result::event::create(flags).map_err(cuda_err("cuEventCreate"))?,
        };
        let e = PooledEvent { ev, pool };
        // SAFETY: a live event and stream of this device's context (bound above). Re-recording
        // an event that another stream still waits on is fine: cuStreamWaitEvent captured it.
        unsafe { result::event::record(e.ev, self.stream(d, s).cu_stream()) }.map_err(cuda_err("cuEventRecord"))?;
        Ok(e)
    }
    fn done(&mut self, e: &PooledEvent) -> Result<bool, DeviceError> {
        // SAFETY: a live event.
        match unsafe { result::event::query(e.ev) } {
            Ok(()) => Ok(true),
            Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(err) => Err(cuda_err("cuEventQuery")(err)),
        }
    }
    fn enable_timing(&mut self) {
        self.timing = true;
    }
    fn elapsed_us(&mut self, a: &PooledEvent, b: &PooledEvent) -> Result<Option<f64>, DeviceError> {
        // SAFETY: live events; the driver checks that both were timed and have completed.
        let ms = unsafe { result::event::elapsed(a.ev, b.ev) }.map_err(cuda_err("cuEventElapsedTime"))?;
        Ok(Some(f64::from(ms) * 1e3))
    }
    fn synchronize(&mut self, e: &PooledEvent) -> Result<(), DeviceError> {
        // SAFETY: a live event.
        unsafe { result::event::synchronize(e.ev) }.map_err(cuda_err("cuEventSynchronize"))
    }
    fn sync_stream(&mut self, d: usize, s: Stream) -> Result<(), DeviceError> {
        self.bind(d)?;
        // Not through an event: recording one may be what just failed.
        self.stream(d, s).synchronize().map_err(cuda_err("cuStreamSynchronize"))
    }
    fn wait(&mut self, d: usize, s: Stream, e: &PooledEvent) -> Result<(), DeviceError> {
        self.bind(d)?;
        // SAFETY: a live stream and event.
        unsafe {
            result::stream::wait_event(
                self.stream(d, s).cu_stream(),
                e.ev,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_err("cuStreamWaitEvent"))
    }
    fn launch(&mut self, s: Stream, l: Launch) -> Result<(), DeviceError> {
        let d = l.device;
        self.bind(d)?;
        let Stream::Exec(k) = s else {
            return Err(DeviceError::Body("kernels run on exec streams only".into()));
        };
        let ctx = CudaTaskContext {
            stream: &self.devs[d].streams[s.index()],
            tiles: &l.tiles,
            args: &l.args,
            seq: l.seq,
            device: d,
            resources: &self.devs[d].resources[k],
        };
        // A panicking body is the task's failure, not the GPU manager's: unwinding into the
        // manager's loop would end the thread that owns every stream of the rank (CPU bodies
        // are caught the same way, in `run_body`).
        let name = l.kernel.name();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.kernel.run_cuda(&ctx))) {
            Ok(None) => Err(DeviceError::Body(format!("class `{name}` has no CUDA body"))),
            Ok(Some(r)) => r.map_err(|e| DeviceError::Body(format!("`{name}`: {e}"))),
            Err(p) => Err(DeviceError::Body(format!(
                "`{name}`: panicked: {}",
                ferry_base::error::panic_message(&*p)
            ))),
        }
    }
    fn take_launch_error(&mut self, _d: usize, _seq: u64) -> Option<String> {
        None
    }
}
