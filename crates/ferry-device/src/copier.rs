//! Copies between host memory and device memory that someone else allocated: a framework's own
//! `cudaMalloc` regions, registered with the communication engine. The engine stages their bytes
//! through pinned host buffers when MPI cannot take device pointers, and this is the part of that
//! which touches the device: where a pointer lives, asynchronous copies on a stream of their own
//! per device with completion polled (never waited for), pinned host buffers, and device
//! allocations (for tests, benchmarks and receive-side placement).
//!
//! [`CudaCopier`] does it with the CUDA driver; [`EmulatedCopier`] with host memory standing in
//! for device memory, so that CI, which has no GPU, runs the same protocol.

use crate::cuda;
use crate::mapping_cache::MappingCache;
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use ferry_base::error::DeviceError;
use std::sync::{Arc, Mutex};

/// Idle mappings of other processes' allocations a copier keeps open unless told otherwise
/// ([`Copier::keep_idle_mappings`]).
pub const KEEP_IDLE_MAPPINGS: usize = 256;

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDir {
    /// Device memory to host memory.
    DeviceToHost,
    /// Host memory to device memory.
    HostToDevice,
}

/// A copy in flight; [`Copier::done`] says when it has completed.
pub struct Ticket(TicketKind);

enum TicketKind {
    /// Completed when it was issued (emulated copies).
    Done,
    /// Completed when the event (from the copier's pool for its device) has.
    Event(crate::cuda::PooledEvent),
}

/// Frees what [`Copier::alloc_pinned`] or [`Copier::alloc_device`] allocated.
pub type Free = Box<dyn FnOnce() + Send>;

/// Device-side work of staged transfers; see the module documentation. Used by one thread at a
/// time (the engine keeps it behind a lock).
pub trait Copier: Send {
    /// `"cuda"` or `"emulated"`.
    fn kind(&self) -> &'static str;

    /// Devices this process sees.
    fn devices(&self) -> usize;

    /// Where `len` bytes at `ptr` live: `Some(device)` when they are device memory of one
    /// device (within one allocation), `None` when they are host memory.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] when the range starts in device memory but runs past its
    /// allocation, or the driver cannot say.
    fn locate(&self, ptr: u64, len: usize) -> Result<Option<usize>, DeviceError>;

    /// Starts copying `len` bytes between device address `dev` on `device` and host memory at
    /// `host`, in the order of earlier copies on that device.
    ///
    /// # Safety
    /// Both ranges must be valid for `len` bytes and untouched by anyone else until
    /// [`Copier::done`] has said so for the ticket.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] when the copy cannot be issued.
    unsafe fn copy(
        &mut self,
        device: usize,
        dir: CopyDir,
        dev: u64,
        host: *mut u8,
        len: usize,
    ) -> Result<Ticket, DeviceError>;

    /// Whether the copy of `t` has completed.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] when it failed.
    fn done(&mut self, t: &Ticket) -> Result<bool, DeviceError>;

    /// `bytes` of pinned host memory (page-locked, usable by every device's copies).
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] when the allocation fails.
    fn alloc_pinned(&mut self, bytes: usize) -> Result<(*mut u8, Free), DeviceError>;

    /// `bytes` of device memory on `device`.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] for an absent device or an allocation that fails.
    fn alloc_device(&mut self, device: usize, bytes: usize) -> Result<(u64, Free), DeviceError>;

    /// What another process of this node needs to map the device memory at `ptr`
    /// ([`Copier::open`]): the allocation's IPC handle and where `ptr` lies in it.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] when the memory cannot be exported (not device memory, or
    /// memory the driver will not share).
    fn export(&mut self, ptr: u64) -> Result<Vec<u8>, DeviceError>;

    /// Maps memory another process exported ([`Copier::export`]) for copies on `device` and
    /// returns the address of the exported pointer. An allocation is mapped once while it is in
    /// use, and stays mapped once idle while the copier keeps at most
    /// [`Copier::keep_idle_mappings`] idle ones (the least recently used closes first). Each
    /// `open` must be matched by one [`Copier::close`] once the copies that use the address
    /// have completed.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] for a handle that cannot be opened (nothing is then held).
    fn open(&mut self, device: usize, exported: &[u8]) -> Result<u64, DeviceError>;

    /// Ends one [`Copier::open`] of `exported` on `device`: its copies have completed. The
    /// mapping then closes if it is idle past the bound. Closing what is not open does nothing.
    fn close(&mut self, device: usize, exported: &[u8]);

    /// At most `n` idle mappings stay open ([`KEEP_IDLE_MAPPINGS`] unless told otherwise);
    /// mappings idle past it close now.
    fn keep_idle_mappings(&mut self, n: usize);

    /// Mappings of other processes' allocations open now (idle or in use).
    fn mappings(&self) -> usize;

    /// Starts copying `len` bytes from device address `src` to device address `dst` (either
    /// may be a mapping from [`Copier::open`]) on `device`'s stream.
    ///
    /// # Safety
    /// Both ranges must be valid device memory for `len` bytes, untouched by anyone else until
    /// [`Copier::done`] has said so.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] when the copy cannot be issued.
    unsafe fn copy_device(&mut self, device: usize, dst: u64, src: u64, len: usize) -> Result<Ticket, DeviceError>;

    /// Makes the caller's `stream` (a `CUstream` of `device`'s context, as an integer; 0 is
    /// the legacy default stream) wait for the copy of `t` (`cuStreamWaitEvent`): work enqueued
    /// there afterwards sees its bytes, with no host round trip. Emulated devices have no
    /// streams (their copies complete when issued): nothing to do.
    ///
    /// # Safety
    /// `stream` is a live stream of `device`'s context (or 0).
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] for a stream the driver refuses.
    unsafe fn stream_wait(&mut self, device: usize, stream: u64, t: &Ticket) -> Result<(), DeviceError>;

    /// Makes `stream` wait until the 32-bit word at `word` (pinned host memory from
    /// [`Copier::alloc_pinned`]) is at least 1 (`cuStreamWaitValue32`), and returns a ticket
    /// that completes once the stream has passed the wait: the word may be reused then, not
    /// before. Emulated devices: a completed ticket.
    ///
    /// # Safety
    /// `stream` as for [`Copier::stream_wait`]; `word` stays allocated until the ticket has
    /// completed.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] for a stream the driver refuses, or a device without stream memory
    /// operations.
    unsafe fn stream_wait_word(&mut self, device: usize, stream: u64, word: *mut u32) -> Result<Ticket, DeviceError>;
}

/// Bytes of an exported allocation: the handle (64 for CUDA, a shared-memory handle for
/// emulated devices, zero-padded), the allocation's size, and the offset of the exported
/// pointer in it.
const EXPORT_HANDLE: usize = 64;
/// Bytes of an export ([`Copier::export`]): the handle, the allocation's size and the offset.
pub const EXPORT_BYTES: usize = EXPORT_HANDLE + 16;
const _: () = assert!(EXPORT_HANDLE == crate::mapping_cache::HANDLE);

fn export_bytes(handle: &[u8], size: u64, offset: u64) -> Vec<u8> {
    let mut v = vec![0u8; EXPORT_HANDLE];
    v[..handle.len()].copy_from_slice(handle);
    v.extend_from_slice(&size.to_le_bytes());
    v.extend_from_slice(&offset.to_le_bytes());
    v
}

/// The export of the memory `by` bytes past an exported pointer (the same allocation).
///
/// # Errors
/// [`DeviceError::Cuda`] for bytes that are not an export, or an offset past the allocation.
pub fn shift_export(exported: &[u8], by: u64) -> Result<Vec<u8>, DeviceError> {
    let (handle, size, offset) = parse_export(exported)?;
    if offset + by > size {
        return Err(DeviceError::Cuda {
            op: "export",
            msg: format!("offset {} past an allocation of {size} bytes", offset + by),
        });
    }
    Ok(export_bytes(handle, size, offset + by))
}

/// `(handle, allocation size, offset)` of exported bytes; the offset lies inside the
/// allocation.
fn parse_export(b: &[u8]) -> Result<(&[u8], u64, u64), DeviceError> {
    if b.len() != EXPORT_BYTES {
        return Err(DeviceError::Cuda {
            op: "open",
            msg: format!("exported memory of {} bytes (expected {EXPORT_BYTES})", b.len()),
        });
    }
    let size = u64::from_le_bytes(b[EXPORT_HANDLE..EXPORT_HANDLE + 8].try_into().expect("8 bytes"));
    let offset = u64::from_le_bytes(b[EXPORT_HANDLE + 8..].try_into().expect("8 bytes"));
    if offset > size {
        return Err(DeviceError::Cuda {
            op: "open",
            msg: format!("exported offset {offset} past an allocation of {size} bytes"),
        });
    }
    Ok((&b[..EXPORT_HANDLE], size, offset))
}

/// Bytes available from the exported pointer to the end of its allocation.
///
/// # Errors
/// [`DeviceError::Cuda`] for bytes that are not an export.
pub fn exported_len(exported: &[u8]) -> Result<u64, DeviceError> {
    let (_, size, offset) = parse_export(exported)?;
    Ok(size - offset)
}

fn cuda_err(op: &'static str) -> impl Fn(result::DriverError) -> DeviceError {
    move |e| DeviceError::Cuda {
        op,
        msg: format!("{e:?}"),
    }
}

/// The CUDA driver's copier: one context (the primary one) and one non-blocking stream per
/// device, each opened the first time the device is used. A rank of a node with eight GPUs
/// that drives one of them then holds one context, not eight (each costs hundreds of MiB of
/// the device's memory).
pub struct CudaCopier {
    devices: Vec<std::sync::OnceLock<(Arc<CudaContext>, Arc<CudaStream>)>>,
    /// Per device, events recorded again and again (creating and destroying one per copy costs
    /// more than a small copy).
    events: Vec<crate::cuda::EventPool>,
    /// Allocations of other processes mapped here, by (device, handle): their bases.
    mapped: MappingCache<u64>,
}

// SAFETY: CUevent handles (the event pools) may be used from any thread; the pools are behind
// mutexes, and the rest of the copier is Send already.
unsafe impl Send for CudaCopier {}

impl Drop for CudaCopier {
    fn drop(&mut self) {
        let all = self.mapped.drain();
        self.close_mappings(all);
        // The pooled events (those of tickets still alive return to a pool nobody drains).
        for (opened, pool) in self.devices.iter().zip(&self.events) {
            let Some((ctx, _)) = opened.get() else { continue };
            let _ = ctx.bind_to_thread();
            for ev in pool.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
                // SAFETY: created by `PooledEvent::record` in this context, idle in the pool.
                let _ = unsafe { result::event::destroy(ev) };
            }
        }
    }
}

impl CudaCopier {
    /// Closes mappings the cache let go of, each in its device's context.
    fn close_mappings(&self, closing: Vec<(usize, u64)>) {
        for (d, base) in closing {
            if let Some((ctx, _)) = self.devices.get(d).and_then(|o| o.get()) {
                let _ = ctx.bind_to_thread();
            }
            // SAFETY: opened by `open`; the cache hands each mapping out once, with no copy
            // using it.
            let _ = unsafe { sys::cuIpcCloseMemHandle(base) };
        }
    }

    /// A copier over every device of this process (their contexts opened when first used).
    ///
    /// # Errors
    /// [`DeviceError::NoDriver`], [`DeviceError::NoDevices`].
    pub fn new() -> Result<CudaCopier, DeviceError> {
        let n = cuda::probe()?;
        let devices = (0..n).map(|_| std::sync::OnceLock::new()).collect();
        Ok(CudaCopier {
            events: (0..n).map(|_| crate::cuda::EventPool::default()).collect(),
            devices,
            mapped: MappingCache::new(KEEP_IDLE_MAPPINGS),
        })
    }

    /// A ticket for the work issued so far on `device`'s stream (its context bound).
    fn record(&self, device: usize) -> Result<Ticket, DeviceError> {
        let (_, stream) = self.device(device)?;
        // SAFETY: the copier's stream of `device`, whose context the caller bound; the pool
        // holds events of that context.
        let ev = unsafe {
            crate::cuda::PooledEvent::record(
                &self.events[device],
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
                stream.cu_stream(),
            )
        }?;
        Ok(Ticket(TicketKind::Event(ev)))
    }

    /// Device `d`'s context and stream, opened now if this is its first use.
    fn device(&self, d: usize) -> Result<&(Arc<CudaContext>, Arc<CudaStream>), DeviceError> {
        let cell = self.devices.get(d).ok_or_else(|| DeviceError::Cuda {
            op: "copier",
            msg: format!("device {d} is not one of the {} devices", self.devices.len()),
        })?;
        if let Some(v) = cell.get() {
            return Ok(v);
        }
        let ctx = CudaContext::new(d).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        // A racing first use may have set it meanwhile: its pair is kept, this one dropped.
        let _ = cell.set((ctx, stream));
        Ok(cell.get().expect("set above"))
    }

    /// The context of the lowest device opened so far, or device 0's (opened now) when none is.
    fn any_context(&self) -> Result<&Arc<CudaContext>, DeviceError> {
        match self.devices.iter().find_map(|o| o.get()) {
            Some((ctx, _)) => Ok(ctx),
            None => self.device(0).map(|(ctx, _)| ctx),
        }
    }
}

impl Copier for CudaCopier {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn devices(&self) -> usize {
        self.devices.len()
    }

    fn locate(&self, ptr: u64, len: usize) -> Result<Option<usize>, DeviceError> {
        // Any context will do for the query: the thread's own if it has one (a framework that
        // registers its memory has bound its device), else one of the copier's.
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: an out-pointer of the documented type.
        let bound = unsafe { sys::cuCtxGetCurrent(&mut current) } == sys::CUresult::CUDA_SUCCESS && !current.is_null();
        if !bound {
            self.any_context()?
                .bind_to_thread()
                .map_err(cuda_err("cuCtxSetCurrent"))?;
        }
        let mut mem_type: u32 = 0;
        // SAFETY: the out-pointer holds the attribute's type (an unsigned int).
        let r = unsafe {
            sys::cuPointerGetAttribute(
                &mut mem_type as *mut u32 as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS || mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            // Memory the driver does not know (plain host memory), or host memory it knows.
            return Ok(None);
        }
        let mut ordinal: i32 = -1;
        // SAFETY: as above, an int.
        unsafe {
            sys::cuPointerGetAttribute(
                &mut ordinal as *mut i32 as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            )
        }
        .result()
        .map_err(cuda_err("cuPointerGetAttribute"))?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: out-pointers of the documented types.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(cuda_err("cuMemGetAddressRange"))?;
        if ptr + len as u64 > base + size as u64 {
            return Err(DeviceError::Cuda {
                op: "cuMemGetAddressRange",
                msg: format!("{len} bytes at {ptr:#x} run past their allocation ({size} bytes at {base:#x})"),
            });
        }
        Ok(usize::try_from(ordinal).ok())
    }

    unsafe fn copy(
        &mut self,
        device: usize,
        dir: CopyDir,
        dev: u64,
        host: *mut u8,
        len: usize,
    ) -> Result<Ticket, DeviceError> {
        let (ctx, stream) = self.device(device)?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        match dir {
            CopyDir::DeviceToHost => {
                let dst = std::slice::from_raw_parts_mut(host, len);
                result::memcpy_dtoh_async(dst, dev, stream.cu_stream()).map_err(cuda_err("cuMemcpyDtoHAsync"))?;
            }
            CopyDir::HostToDevice => {
                let src = std::slice::from_raw_parts(host as *const u8, len);
                result::memcpy_htod_async(dev, src, stream.cu_stream()).map_err(cuda_err("cuMemcpyHtoDAsync"))?;
            }
        }
        self.record(device)
    }

    fn done(&mut self, t: &Ticket) -> Result<bool, DeviceError> {
        match &t.0 {
            TicketKind::Done => Ok(true),
            TicketKind::Event(e) => e.is_complete(),
        }
    }

    fn alloc_pinned(&mut self, bytes: usize) -> Result<(*mut u8, Free), DeviceError> {
        // Portable: any context serves every device.
        let ctx = self.any_context()?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: a fresh allocation, portable to every context; freed once by the returned Free.
        let p = unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(cuda_err("cuMemHostAlloc"))?;
        let addr = p as usize;
        let ctx = ctx.clone();
        let free: Free = Box::new(move || {
            let _ = ctx.bind_to_thread();
            // SAFETY: allocated above, freed once.
            let _ = unsafe { result::free_host(addr as *mut std::ffi::c_void) };
        });
        Ok((p as *mut u8, free))
    }

    fn alloc_device(&mut self, device: usize, bytes: usize) -> Result<(u64, Free), DeviceError> {
        let (ctx, _) = self.device(device)?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: a fresh allocation in the current (primary) context, freed once below.
        let p = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(cuda_err("cuMemAlloc"))?;
        let ctx = ctx.clone();
        let free: Free = Box::new(move || {
            let _ = ctx.bind_to_thread();
            // SAFETY: allocated above, freed once.
            let _ = unsafe { result::free_sync(p) };
        });
        Ok((p, free))
    }

    fn export(&mut self, ptr: u64) -> Result<Vec<u8>, DeviceError> {
        let d = self.locate(ptr, 1)?.ok_or_else(|| DeviceError::Cuda {
            op: "cuIpcGetMemHandle",
            msg: format!("{ptr:#x} is not device memory"),
        })?;
        let (ctx, _) = self.device(d)?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: out-pointers of the documented types.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(cuda_err("cuMemGetAddressRange"))?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `base` is the start of a device allocation of this process.
        unsafe { sys::cuIpcGetMemHandle(&mut h, base) }
            .result()
            .map_err(cuda_err("cuIpcGetMemHandle"))?;
        let bytes: Vec<u8> = h.reserved.iter().map(|&c| c as u8).collect();
        Ok(export_bytes(&bytes, size as u64, ptr - base))
    }

    fn open(&mut self, device: usize, exported: &[u8]) -> Result<u64, DeviceError> {
        let (handle, _, offset) = parse_export(exported)?;
        let ctx = self.device(device)?.0.clone();
        let base = self.mapped.acquire(device, handle, || {
            ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
            // SAFETY: the device's context is bound above; the mapping is closed when the cache
            // lets it go (`close_mappings`).
            let base = unsafe { cuda::ipc_open(handle)? };
            Ok((base, base))
        })?;
        Ok(base + offset)
    }

    fn close(&mut self, device: usize, exported: &[u8]) {
        if let Ok((handle, _, _)) = parse_export(exported) {
            let closing = self.mapped.release(device, handle);
            self.close_mappings(closing);
        }
    }

    fn keep_idle_mappings(&mut self, n: usize) {
        let closing = self.mapped.set_keep_idle(n);
        self.close_mappings(closing);
    }

    fn mappings(&self) -> usize {
        self.mapped.len()
    }

    unsafe fn copy_device(&mut self, device: usize, dst: u64, src: u64, len: usize) -> Result<Ticket, DeviceError> {
        let (ctx, stream) = self.device(device)?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream.cu_stream())
            .result()
            .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
        self.record(device)
    }

    unsafe fn stream_wait(&mut self, device: usize, stream: u64, t: &Ticket) -> Result<(), DeviceError> {
        let (ctx, _) = self.device(device)?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        match &t.0 {
            TicketKind::Done => Ok(()),
            TicketKind::Event(e) => sys::cuStreamWaitEvent(stream as sys::CUstream, e.raw(), 0)
                .result()
                .map_err(cuda_err("cuStreamWaitEvent")),
        }
    }

    unsafe fn stream_wait_word(&mut self, device: usize, stream: u64, word: *mut u32) -> Result<Ticket, DeviceError> {
        let (ctx, _) = self.device(device)?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        // Pinned host memory is mapped at the same address on the device (unified addressing).
        sys::cuStreamWaitValue32_v2(
            stream as sys::CUstream,
            word as sys::CUdeviceptr,
            1,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
        .result()
        .map_err(cuda_err("cuStreamWaitValue32"))?;
        let ev = crate::cuda::PooledEvent::record(
            &self.events[device],
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            stream as sys::CUstream,
        )?;
        Ok(Ticket(TicketKind::Event(ev)))
    }
}

/// An emulated device allocation: its device, its shared mapping, and a number no other
/// allocation of this process has (a later allocation may get the same file descriptor, and a
/// peer's mapping of the old one must not be taken for it).
type EmulatedAllocation = (usize, Arc<ferry_base::shm::SharedMem>, u64);

static ALLOCATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Every live emulated device allocation of this process, whoever made it (an
/// [`EmulatedCopier`], or the emulated backend's pools through [`EmulatedMemory::adopt`]): the
/// emulated driver's table, process-wide as CUDA's is, so that memory one layer allocated is
/// located and exported by another.
static EMULATED: Mutex<Vec<EmulatedAllocation>> = Mutex::new(Vec::new());

fn emulated() -> std::sync::MutexGuard<'static, Vec<EmulatedAllocation>> {
    EMULATED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Shared memory counted as emulated device memory of one device while this lives: what
/// [`EmulatedCopier::locate`] and [`EmulatedCopier::export`] see, like memory from
/// [`EmulatedCopier::alloc_device`].
pub struct EmulatedMemory {
    serial: u64,
}

impl EmulatedMemory {
    /// Counts `mem` as device memory of emulated device `device` until the result drops.
    pub fn adopt(device: usize, mem: Arc<ferry_base::shm::SharedMem>) -> EmulatedMemory {
        let serial = ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        emulated().push((device, mem, serial));
        EmulatedMemory { serial }
    }
}

impl Drop for EmulatedMemory {
    fn drop(&mut self) {
        emulated().retain(|(_, _, serial)| *serial != self.serial);
    }
}

/// Emulated devices: "device memory" is shared host memory (`memfd`, the emulated counterpart
/// of CUDA IPC) that [`EmulatedCopier::alloc_device`] hands out, or that the emulated backend
/// adopted ([`EmulatedMemory`]); the process-wide table of both tells it from other host memory
/// in [`Copier::locate`]. Copies are `memcpy`s, complete when issued.
pub struct EmulatedCopier {
    devices: usize,
    /// Other processes' allocations mapped here (unmapped when dropped).
    mapped: MappingCache<ferry_base::shm::SharedMem>,
    /// Pinned host allocations fail (fault injection: `Faults::pin_fail`).
    pin_fail: bool,
}

impl EmulatedCopier {
    /// `devices` emulated devices.
    pub fn new(devices: usize) -> EmulatedCopier {
        EmulatedCopier {
            devices,
            mapped: MappingCache::new(KEEP_IDLE_MAPPINGS),
            pin_fail: false,
        }
    }

    /// Makes every pinned host allocation fail, as a CUDA device's does when pinned memory runs
    /// out (`ferry_base::faults::Faults::pin_fail`).
    pub fn failing_pins(mut self, on: bool) -> EmulatedCopier {
        self.pin_fail = on;
        self
    }
}

impl Copier for EmulatedCopier {
    fn kind(&self) -> &'static str {
        "emulated"
    }

    fn devices(&self) -> usize {
        self.devices
    }

    fn locate(&self, ptr: u64, len: usize) -> Result<Option<usize>, DeviceError> {
        let a = emulated();
        let found = a
            .iter()
            .map(|(d, m, _)| (*d, m.base() as u64, m.len()))
            .find(|(_, start, n)| (*start..*start + *n as u64).contains(&ptr));
        match found {
            None => Ok(None),
            Some((d, start, n)) if ptr + len as u64 <= start + n as u64 => Ok(Some(d)),
            Some((_, start, n)) => Err(DeviceError::Cuda {
                op: "emulated locate",
                msg: format!("{len} bytes at {ptr:#x} run past their allocation ({n} bytes at {start:#x})"),
            }),
        }
    }

    unsafe fn copy(
        &mut self,
        device: usize,
        dir: CopyDir,
        dev: u64,
        host: *mut u8,
        len: usize,
    ) -> Result<Ticket, DeviceError> {
        if device >= self.devices {
            return Err(DeviceError::Cuda {
                op: "emulated copy",
                msg: format!("device {device} is not one of the {} devices", self.devices),
            });
        }
        match dir {
            CopyDir::DeviceToHost => std::ptr::copy_nonoverlapping(dev as *const u8, host, len),
            CopyDir::HostToDevice => std::ptr::copy_nonoverlapping(host as *const u8, dev as *mut u8, len),
        }
        Ok(Ticket(TicketKind::Done))
    }

    fn done(&mut self, _t: &Ticket) -> Result<bool, DeviceError> {
        Ok(true)
    }

    fn alloc_pinned(&mut self, bytes: usize) -> Result<(*mut u8, Free), DeviceError> {
        if self.pin_fail {
            return Err(DeviceError::Cuda {
                op: "emulated pinned alloc",
                msg: format!("{bytes} bytes of pinned memory refused (fault injection: pin-fail)"),
            });
        }
        let n = bytes.max(1);
        let p = Box::into_raw(vec![0u8; n].into_boxed_slice());
        let addr = p as *mut u8 as usize;
        let free: Free = Box::new(move || {
            let p = std::ptr::slice_from_raw_parts_mut(addr as *mut u8, n);
            // SAFETY: made by Box::into_raw above (same address and length), freed once.
            drop(unsafe { Box::from_raw(p) });
        });
        Ok((addr as *mut u8, free))
    }

    fn alloc_device(&mut self, device: usize, bytes: usize) -> Result<(u64, Free), DeviceError> {
        if device >= self.devices {
            return Err(DeviceError::Cuda {
                op: "emulated alloc",
                msg: format!("device {device} is not one of the {} devices", self.devices),
            });
        }
        let m = ferry_base::shm::SharedMem::create(c"ferry-emulated-device", bytes.max(1)).map_err(|e| {
            DeviceError::Cuda {
                op: "emulated alloc",
                msg: e.to_string(),
            }
        })?;
        let addr = m.base() as u64;
        let held = EmulatedMemory::adopt(device, Arc::new(m));
        let free: Free = Box::new(move || drop(held));
        Ok((addr, free))
    }

    fn export(&mut self, ptr: u64) -> Result<Vec<u8>, DeviceError> {
        let a = emulated();
        let (m, serial) = a
            .iter()
            .map(|(_, m, serial)| (m, *serial))
            .find(|(m, _)| (m.base() as u64..m.base() as u64 + m.len() as u64).contains(&ptr))
            .ok_or_else(|| DeviceError::Cuda {
                op: "emulated export",
                msg: format!("{ptr:#x} is not emulated device memory"),
            })?;
        let h = m.handle().ok_or_else(|| DeviceError::Cuda {
            op: "emulated export",
            msg: "a mapping of another process".into(),
        })?;
        let mut handle = h.to_bytes().to_vec();
        handle.extend_from_slice(&serial.to_le_bytes());
        Ok(export_bytes(&handle, m.len() as u64, ptr - m.base() as u64))
    }

    fn open(&mut self, _device: usize, exported: &[u8]) -> Result<u64, DeviceError> {
        let (handle, _, offset) = parse_export(exported)?;
        // One mapping per allocation for all emulated devices (they share the host's memory).
        let base = self.mapped.acquire(0, handle, || {
            let h = ferry_base::shm::ShmHandle::from_bytes(&handle[..ferry_base::shm::ShmHandle::BYTES]).ok_or_else(
                || DeviceError::Cuda {
                    op: "emulated open",
                    msg: "not a shared-memory handle".into(),
                },
            )?;
            let m = ferry_base::shm::SharedMem::open(h).map_err(|e| DeviceError::Cuda {
                op: "emulated open",
                msg: e.to_string(),
            })?;
            let base = m.base() as u64;
            Ok((m, base))
        })?;
        Ok(base + offset)
    }

    fn close(&mut self, _device: usize, exported: &[u8]) {
        if let Ok((handle, _, _)) = parse_export(exported) {
            // Dropping a mapping unmaps it.
            drop(self.mapped.release(0, handle));
        }
    }

    fn keep_idle_mappings(&mut self, n: usize) {
        drop(self.mapped.set_keep_idle(n));
    }

    fn mappings(&self) -> usize {
        self.mapped.len()
    }

    unsafe fn copy_device(&mut self, device: usize, dst: u64, src: u64, len: usize) -> Result<Ticket, DeviceError> {
        if device >= self.devices {
            return Err(DeviceError::Cuda {
                op: "emulated copy",
                msg: format!("device {device} is not one of the {} devices", self.devices),
            });
        }
        std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len);
        Ok(Ticket(TicketKind::Done))
    }

    unsafe fn stream_wait(&mut self, device: usize, _stream: u64, _t: &Ticket) -> Result<(), DeviceError> {
        self.check(device, "emulated stream wait")
    }

    unsafe fn stream_wait_word(&mut self, device: usize, _stream: u64, _word: *mut u32) -> Result<Ticket, DeviceError> {
        self.check(device, "emulated stream wait")?;
        Ok(Ticket(TicketKind::Done))
    }
}

impl EmulatedCopier {
    fn check(&self, device: usize, op: &'static str) -> Result<(), DeviceError> {
        if device >= self.devices {
            return Err(DeviceError::Cuda {
                op,
                msg: format!("device {device} is not one of the {} devices", self.devices),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_device_memory_is_told_from_host_memory_and_copies() {
        let mut c = EmulatedCopier::new(2);
        let (d, free) = c.alloc_device(1, 64).unwrap();
        let host = vec![7u8; 64];
        assert_eq!(c.locate(d, 64).unwrap(), Some(1));
        assert_eq!(c.locate(d + 8, 8).unwrap(), Some(1));
        assert!(c.locate(d + 8, 64).is_err());
        assert_eq!(c.locate(host.as_ptr() as u64, 64).unwrap(), None);
        let mut back = vec![0u8; 64];
        unsafe {
            let t = c
                .copy(1, CopyDir::HostToDevice, d, host.as_ptr() as *mut u8, 64)
                .unwrap();
            assert!(c.done(&t).unwrap());
            c.copy(1, CopyDir::DeviceToHost, d, back.as_mut_ptr(), 64).unwrap();
        }
        assert_eq!(back, host);
        assert!(c.alloc_device(2, 8).is_err());
        // Exported and mapped again (as another process would): the same bytes.
        let e = c.export(d + 8).unwrap();
        let mut other = EmulatedCopier::new(1);
        let m = other.open(0, &e).unwrap();
        assert_eq!(other.open(0, &e).unwrap(), m, "mapped once");
        let mut seen = vec![0u8; 56];
        unsafe { std::ptr::copy_nonoverlapping(m as *const u8, seen.as_mut_ptr(), 56) };
        assert_eq!(seen, host[8..]);
        free();
        assert_eq!(c.locate(d, 8).unwrap(), None);
    }
}
