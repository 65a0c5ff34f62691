//! The communication engine from C (`ferry_engine_*`): a framework that keeps its own task
//! graph registers memory, sends active messages, and moves registered regions with put, get
//! and tagged send/receive, each with a completion callback (see `ferry-engine` and
//! `docs/engine.md` for the semantics, the threading contract and the PaRSEC/StarPU mapping).
//!
//! Callbacks are C function pointers with a `void *user` argument. They run on the engine's
//! progress thread, or inside `ferry_engine_progress` on the calling thread; a completion that
//! reports an error sets that thread's `ferry_last_error` before it is called.

use crate::registry::{self, Object};
use crate::status::*;
use crate::util::{out, slice};
use eng::{
    AmMessage, Completions, Engine, EngineConfig, EngineError, EngineHandle, MemHandle, MemKind, Notify, Progress,
};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// An engine handle (0: none).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_engine {
    /// Opaque id.
    pub id: u64,
}

/// Bytes of a memory handle.
pub const FERRY_MEM_HANDLE_BYTES: usize = 40;
const _: () = assert!(FERRY_MEM_HANDLE_BYTES == eng::MEM_HANDLE_BYTES);

/// A registered memory region as every rank names it: plain bytes that may be copied into
/// messages and shipped to peers (PaRSEC's `mem_register` handle).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_mem_handle {
    /// The encoded handle.
    pub bytes: [u8; FERRY_MEM_HANDLE_BYTES],
}

/// Progress by the engine's own thread (the default).
pub const FERRY_PROGRESS_THREAD: i32 = 0;
/// Progress only inside `ferry_engine_progress` and the collectives, called by the framework.
pub const FERRY_PROGRESS_CALLER: i32 = 1;
/// Both: threads inside `ferry_engine_progress` (or a collective) run passes themselves; the
/// engine's thread is a backstop that drives when nobody else has for `backstop_us` (a rank per
/// core).
pub const FERRY_PROGRESS_SHARED: i32 = 2;
/// Callbacks run where events are seen (the progress thread, or inside `ferry_engine_progress`).
pub const FERRY_COMPLETIONS_INLINE: i32 = 0;
/// Callbacks are queued and run by `ferry_engine_progress` on the thread that calls it.
pub const FERRY_COMPLETIONS_CALLER: i32 = 1;

/// Options of `ferry_engine_init` (pass NULL for the defaults).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_engine_options {
    /// `FERRY_PROGRESS_THREAD`, `FERRY_PROGRESS_CALLER` or `FERRY_PROGRESS_SHARED`.
    pub progress: i32,
    /// `FERRY_COMPLETIONS_INLINE` or `FERRY_COMPLETIONS_CALLER`.
    pub completions: i32,
    /// Longest nap of the progress thread when idle, µs (negative: the default, 50).
    pub progress_sleep_us: i64,
    /// Devices whose memory may be registered: `FERRY_ENGINE_DEVICES_AUTO` (CUDA when there is
    /// a GPU), `FERRY_ENGINE_DEVICES_NONE`, `FERRY_ENGINE_DEVICES_CUDA` (required), or K > 0
    /// emulated devices.
    pub devices: i32,
    /// `FERRY_GPU_DIRECT_AUTO`, `_ON`, `_FORCE` or `_OFF` (see `docs/engine.md`).
    pub gpu_direct: i32,
    /// 1: device memory of ranks of one node moves by peer copies through CUDA IPC; 0: never.
    pub ipc: i32,
    /// With `FERRY_PROGRESS_SHARED`: how often, µs, the engine's thread drives when nobody else
    /// has (≤ 0: the default, 200; at most 1,000,000).
    pub backstop_us: i64,
    /// 1: every active message goes over MPI, none through the node's shared-memory rings;
    /// 0: the default (rings between ranks of a node, for messages up to `am_ring_max_bytes`).
    pub no_am_rings: i32,
    /// 1: host memory between ranks of a node moves over MPI, never by single copies through
    /// Cross Memory Attach (and this process does not let its peers read its memory); 0: the
    /// default (single copies where the start-up probe passed).
    pub no_cma: i32,
    /// Smallest get or put, bytes, that takes a single copy (≤ 0: the default, 4096).
    pub cma_min_bytes: i64,
    /// Longest active message, bytes, through the node's rings; longer ones go over MPI (≤ 0:
    /// the default, every active message; at most 1,080 keeps no byte rings, see
    /// `docs/engine.md`).
    pub am_ring_max_bytes: i64,
    /// With `FERRY_PROGRESS_THREAD`: 1 lets `ferry_engine_share_progress` hand the loop's
    /// driving to the framework's threads later (ferry then asks MPI, when it initialises it,
    /// for `MPI_THREAD_SERIALIZED`); 0: the loop stays the engine thread's.
    pub share_later: i32,
}

/// CUDA devices when the driver and a GPU are there, else none.
pub const FERRY_ENGINE_DEVICES_AUTO: i32 = -1;
/// No devices: registering device memory fails.
pub const FERRY_ENGINE_DEVICES_NONE: i32 = 0;
/// The CUDA devices; `ferry_engine_init` fails without them.
pub const FERRY_ENGINE_DEVICES_CUDA: i32 = -2;
/// Device memory goes to MPI when the library reports CUDA support, else staged.
pub const FERRY_GPU_DIRECT_AUTO: i32 = 0;
/// Device memory goes to MPI; `ferry_engine_init` fails unless the library reports CUDA support.
pub const FERRY_GPU_DIRECT_ON: i32 = 1;
/// Device memory goes to MPI, trusting the caller that the library takes it.
pub const FERRY_GPU_DIRECT_FORCE: i32 = 2;
/// Device memory is always staged through pinned host buffers.
pub const FERRY_GPU_DIRECT_OFF: i32 = 3;

/// What the engine can do (`ferry_engine_capabilities`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_engine_caps {
    /// `MPIX_Query_cuda_support()`: 1 yes, 0 no, -1 the library cannot say.
    pub cuda_aware_mpi: i32,
    /// Largest active-message payload, bytes.
    pub am_max_payload: usize,
    /// One past the largest user tag of active messages.
    pub am_user_tags: u32,
    /// One past the largest tag of two-sided sends and receives.
    pub two_sided_tags: u32,
}

/// What this rank knows about a peer (`ferry_engine_peer`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_peer_caps {
    /// 1 when the peer runs on this rank's node.
    pub same_node: i32,
    /// Routes to it, a bit each: bit 0 host memory through MPI, bit 1 device memory by peer
    /// copies through CUDA IPC, bit 2 device memory through a CUDA-aware MPI (GPU-direct), bit
    /// 3 device memory staged through the bounce buffers, bit 4 host memory in a single copy
    /// (Cross Memory Attach).
    pub routes: u32,
}

/// Counters of a rank's engine (filled by `ferry_engine_stats`); see `ferry_engine::EngineStats`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ferry_engine_counters {
    /// User active messages sent.
    pub am_sent: u64,
    /// User active messages received.
    pub am_received: u64,
    /// Put notifications delivered here.
    pub notifications: u64,
    /// Puts started here that completed.
    pub puts: u64,
    /// Gets started here that completed.
    pub gets: u64,
    /// Puts into this rank's memory that landed.
    pub puts_served: u64,
    /// Gets from this rank's memory that were sent.
    pub gets_served: u64,
    /// Peers' requests refused here.
    pub refused: u64,
    /// Bytes of completed puts started here.
    pub bytes_put: u64,
    /// Bytes of completed gets started here.
    pub bytes_got: u64,
    /// Two-sided sends completed.
    pub sends: u64,
    /// Two-sided receives completed.
    pub recvs: u64,
    /// Peer copies started here under a lease on the target's registration.
    pub leased_copies: u64,
    /// Gets and puts of host memory started here as single copies into or out of a node
    /// peer's memory (Cross Memory Attach).
    pub single_copies: u64,
    /// Registrations alive.
    pub registrations: u64,
}

/// An active-message handler: `(tag, source rank, payload, payload bytes, user)`. The payload is
/// valid only during the call.
#[allow(non_camel_case_types)]
pub type ferry_am_handler = Option<unsafe extern "C" fn(u16, i32, *const c_void, usize, *mut c_void)>;

/// A completion: `(status, user)`; on an error, `ferry_last_error()` on this thread says why.
#[allow(non_camel_case_types)]
pub type ferry_completion = Option<unsafe extern "C" fn(ferry_status, *mut c_void)>;

/// The engine behind a handle: its operations, and the engine itself for finalize.
pub(crate) struct EngineObject {
    pub(crate) handle: EngineHandle,
    engine: Mutex<Option<Engine>>,
    /// Device memory allocated through `ferry_engine_alloc_device`, by address; freed by
    /// `ferry_engine_free_device` or after the engine has finalized.
    pub(crate) buffers: Mutex<std::collections::HashMap<u64, eng::DeviceBuffer>>,
}

/// A C pointer carried into a callback.
struct User(*mut c_void);
// SAFETY: the caller passes `user` for its callback, on whichever thread the documented
// contract says the callback runs.
unsafe impl Send for User {}
unsafe impl Sync for User {}

/// The status of an engine error (and this thread's message).
pub(crate) fn engine_error(e: &EngineError) -> ferry_status {
    use EngineError as E;
    let status = match e {
        E::BadHandle(_) | E::ForeignHandle { .. } | E::NotRegistered { .. } | E::WrongOwner { .. } | E::Finalized => {
            FERRY_ERR_INVALID_HANDLE
        }
        E::OutOfBounds { .. }
        | E::TagOutOfRange { .. }
        | E::TagTaken(_)
        | E::UnknownTag(_)
        | E::PayloadTooLarge { .. }
        | E::NoSuchPeer { .. }
        | E::InvalidArgument(_) => FERRY_ERR_INVALID_ARGUMENT,
        E::Busy { .. } => FERRY_ERR_BUSY,
        E::Remote { .. } => FERRY_ERR_REMOTE,
        E::CallbackPanicked(_) => FERRY_ERR_POISONED,
        E::NoDevices(_) | E::Device(_) | E::DeviceFull { .. } => FERRY_ERR_DEVICE,
        E::SingleCopy { .. } => FERRY_ERR_IO,
        E::Comm(inner) => return from_error(inner),
    };
    fail(status, e.to_string())
}

fn handle(e: ferry_engine) -> Result<EngineHandle, ferry_status> {
    object(e).map(|o| o.handle.clone())
}

/// The live engine behind `e` (`FERRY_ERR_INVALID_HANDLE` otherwise).
pub(crate) fn object(e: ferry_engine) -> Result<Arc<EngineObject>, ferry_status> {
    match registry::get(e.id) {
        Some(Object::Engine(o)) => Ok(o),
        _ => Err(fail(
            FERRY_ERR_INVALID_HANDLE,
            format!("{} is not a live ferry_engine", e.id),
        )),
    }
}

/// Runs `f` with the engine behind `e`, mapping its error.
pub(crate) fn with(e: ferry_engine, f: impl FnOnce(&EngineHandle) -> Result<(), EngineError>) -> ferry_status {
    guard(|| match handle(e) {
        Ok(h) => match f(&h) {
            Ok(()) => FERRY_OK,
            Err(err) => engine_error(&err),
        },
        Err(s) => s,
    })
}

/// A Rust completion that calls the C one.
pub(crate) fn completion(cb: ferry_completion, user: *mut c_void) -> impl FnOnce(eng::Result<()>) + Send + 'static {
    let user = User(user);
    move |r| {
        let user = user;
        let status = match &r {
            Ok(()) => FERRY_OK,
            Err(e) => engine_error(e),
        };
        if let Some(cb) = cb {
            // SAFETY: the caller's callback with the caller's user pointer.
            unsafe { cb(status, user.0) };
        }
    }
}

/// Decodes a handle the caller passed by pointer.
pub(crate) unsafe fn mem(h: &EngineHandle, p: *const ferry_mem_handle, what: &str) -> Result<MemHandle, EngineError> {
    if p.is_null() {
        return Err(EngineError::InvalidArgument(format!("{what} is null")));
    }
    h.mem_handle(&(*p).bytes)
}

/// A notification from C arguments (`tag` < 0: none).
unsafe fn notify(tag: i32, data: *const c_void, len: usize) -> Result<Option<Notify>, EngineError> {
    if tag < 0 {
        return Ok(None);
    }
    let tag = u16::try_from(tag).map_err(|_| EngineError::InvalidArgument(format!("notification tag {tag}")))?;
    let bytes = slice(data as *const u8, len, "notify_data")
        .map_err(|_| EngineError::InvalidArgument("notify_data is null".into()))?
        .to_vec();
    Ok(Some(Notify { tag, bytes }))
}

/// Starts the engine on every rank (collective). `comm` points to an `MPI_Comm` to run on (a
/// duplicate is used; MPI must then be initialised by the caller with `MPI_THREAD_MULTIPLE`),
/// or is NULL for `MPI_COMM_WORLD` (ferry initialises MPI if the caller has not). `options`
/// may be NULL.
///
/// # Safety
/// `comm` is NULL or points to a valid `MPI_Comm`; `options` is NULL or valid; `out` is valid
/// for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_init(
    comm: *const c_void,
    options: *const ferry_engine_options,
    out_engine: *mut ferry_engine,
) -> ferry_status {
    guard(|| {
        if out_engine.is_null() {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "out_engine is null");
        }
        let mut cfg = EngineConfig::default();
        if !comm.is_null() {
            cfg.communicator = Some(eng::CallerComm(*(comm as *const eng::RawComm)));
        }
        if let Some(o) = options.as_ref() {
            cfg.progress = match o.progress {
                FERRY_PROGRESS_THREAD => Progress::Thread,
                FERRY_PROGRESS_CALLER => Progress::Caller,
                FERRY_PROGRESS_SHARED => Progress::Shared,
                p => {
                    return fail(
                        FERRY_ERR_INVALID_ARGUMENT,
                        format!("progress {p} (FERRY_PROGRESS_THREAD, FERRY_PROGRESS_CALLER or FERRY_PROGRESS_SHARED)"),
                    )
                }
            };
            cfg.completions = match o.completions {
                FERRY_COMPLETIONS_INLINE => Completions::ProgressThread,
                FERRY_COMPLETIONS_CALLER => Completions::Caller,
                c => {
                    return fail(
                        FERRY_ERR_INVALID_ARGUMENT,
                        format!("completions {c} (FERRY_COMPLETIONS_INLINE or FERRY_COMPLETIONS_CALLER)"),
                    )
                }
            };
            cfg.progress_sleep_us = u64::try_from(o.progress_sleep_us).ok();
            cfg.backstop_us = u64::try_from(o.backstop_us).ok().filter(|&us| us > 0);
            cfg.devices = match o.devices {
                FERRY_ENGINE_DEVICES_AUTO => eng::Devices::Auto,
                FERRY_ENGINE_DEVICES_NONE => eng::Devices::None,
                FERRY_ENGINE_DEVICES_CUDA => eng::Devices::Cuda,
                k if k > 0 => eng::Devices::Emulated(k as usize),
                d => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("devices {d}")),
            };
            cfg.gpu_direct = match o.gpu_direct {
                FERRY_GPU_DIRECT_AUTO => eng::GpuDirect::Auto,
                FERRY_GPU_DIRECT_ON => eng::GpuDirect::On,
                FERRY_GPU_DIRECT_FORCE => eng::GpuDirect::Force,
                FERRY_GPU_DIRECT_OFF => eng::GpuDirect::Off,
                g => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("gpu_direct {g}")),
            };
            cfg.ipc = match o.ipc {
                0 => false,
                1 => true,
                i => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("ipc {i} (0 or 1)")),
            };
            cfg.am_rings = match o.no_am_rings {
                0 => true,
                1 => false,
                i => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("no_am_rings {i} (0 or 1)")),
            };
            cfg.cma = match o.no_cma {
                0 => true,
                1 => false,
                i => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("no_cma {i} (0 or 1)")),
            };
            if let Ok(n) = usize::try_from(o.cma_min_bytes) {
                cfg.cma_min_bytes = if n == 0 { eng::CMA_MIN_BYTES } else { n };
            }
            if let Ok(n) = usize::try_from(o.am_ring_max_bytes) {
                cfg.am_ring_max_bytes = if n == 0 { eng::AM_RING_MAX_BYTES } else { n };
            }
            cfg.share_later = match o.share_later {
                0 => false,
                1 => true,
                i => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("share_later {i} (0 or 1)")),
            };
        }
        match Engine::start(cfg) {
            Ok(e) => {
                let obj = EngineObject {
                    handle: e.handle(),
                    engine: Mutex::new(Some(e)),
                    buffers: Mutex::new(Default::default()),
                };
                let id = registry::insert(Object::Engine(Arc::new(obj)));
                match out(out_engine, ferry_engine { id }) {
                    Ok(()) => FERRY_OK,
                    Err(s) => s,
                }
            }
            Err(e) => engine_error(&e),
        }
    })
}

/// Stops the engine (not collective: call it once the operations peers need from this rank
/// are done, e.g. after `ferry_engine_barrier`); operations still in flight complete with an
/// error. The handle becomes invalid. MPI is finalized if ferry initialised it.
#[no_mangle]
pub extern "C" fn ferry_engine_finalize(engine: ferry_engine) -> ferry_status {
    guard(|| {
        let Some(Object::Engine(o)) = registry::remove(engine.id, |o| matches!(o, Object::Engine(_))) else {
            return fail(
                FERRY_ERR_INVALID_HANDLE,
                format!("{} is not a live ferry_engine", engine.id),
            );
        };
        // Its peer mappings first: they lease the peers' registrations, which the peers'
        // finalize waits for.
        drop(registry::remove_all(
            |x| matches!(x, Object::PeerMapping { engine: id, .. } if *id == engine.id),
        ));
        let e = o.engine.lock().unwrap_or_else(|p| p.into_inner()).take();
        let finalized = e.map(Engine::finalize);
        // Freed once no registration of them can be in use any more.
        o.buffers.lock().unwrap_or_else(|p| p.into_inner()).clear();
        match finalized {
            Some(Err(err)) => engine_error(&err),
            _ => FERRY_OK,
        }
    })
}

/// This rank and the number of ranks of the engine's communicator.
///
/// # Safety
/// `rank` and `size` are valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_rank(engine: ferry_engine, rank: *mut i32, size: *mut i32) -> ferry_status {
    guard(|| match handle(engine) {
        Ok(h) => match (out(rank, h.rank()), out(size, h.size() as i32)) {
            (Ok(()), Ok(())) => FERRY_OK,
            (Err(s), _) | (_, Err(s)) => s,
        },
        Err(s) => s,
    })
}

/// What the engine can do.
///
/// # Safety
/// `out_caps` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_capabilities(
    engine: ferry_engine,
    out_caps: *mut ferry_engine_caps,
) -> ferry_status {
    guard(|| match handle(engine) {
        Ok(h) => {
            let c = h.capabilities();
            let caps = ferry_engine_caps {
                cuda_aware_mpi: c.cuda_aware_mpi.map_or(-1, i32::from),
                am_max_payload: c.am_max_payload,
                am_user_tags: c.am_user_tags,
                two_sided_tags: c.two_sided_tags,
            };
            out(out_caps, caps).map_or_else(|s| s, |_| FERRY_OK)
        }
        Err(s) => s,
    })
}

/// What this rank knows about `peer`.
///
/// # Safety
/// `out_caps` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_peer(
    engine: ferry_engine,
    peer: i32,
    out_caps: *mut ferry_peer_caps,
) -> ferry_status {
    with(engine, |h| {
        let p = h.peer(peer)?;
        let caps = ferry_peer_caps {
            same_node: i32::from(p.same_node),
            routes: p.routes.iter().fold(0, |m, r| m | (1 << (*r as u32))),
        };
        out(out_caps, caps).map_err(|_| EngineError::InvalidArgument("out_caps is null".into()))
    })
}

/// Registers `len` bytes of host memory at `ptr`; writes its handle.
///
/// # Safety
/// The memory stays allocated until `ferry_engine_unregister` succeeds for it (or the engine is
/// finalized) and is not written by anyone else while an operation on it is in flight;
/// `out_handle` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_register(
    engine: ferry_engine,
    ptr: *mut c_void,
    len: usize,
    out_handle: *mut ferry_mem_handle,
) -> ferry_status {
    with(engine, |h| {
        let m = h.register(ptr as *mut u8, len, MemKind::Host)?;
        out(out_handle, ferry_mem_handle { bytes: m.to_bytes() })
            .map_err(|_| EngineError::InvalidArgument("out_handle is null".into()))
    })
}

/// Registers `len` bytes of device memory at `ptr` on `device` (the caller's `cudaMalloc` or
/// pool); the engine checks with the driver that it is that device's memory
/// (`FERRY_ERR_INVALID_ARGUMENT` otherwise, `FERRY_ERR_DEVICE` without devices).
///
/// # Safety
/// As `ferry_engine_register`.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_register_device(
    engine: ferry_engine,
    ptr: *mut c_void,
    len: usize,
    device: u32,
    out_handle: *mut ferry_mem_handle,
) -> ferry_status {
    with(engine, |h| {
        let m = h.register(ptr as *mut u8, len, MemKind::Device(device))?;
        out(out_handle, ferry_mem_handle { bytes: m.to_bytes() })
            .map_err(|_| EngineError::InvalidArgument("out_handle is null".into()))
    })
}

/// Ends a registration (`FERRY_ERR_BUSY` while operations on it are in flight).
///
/// # Safety
/// `handle` is valid for a read.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_unregister(
    engine: ferry_engine,
    handle: *const ferry_mem_handle,
) -> ferry_status {
    with(engine, |h| h.unregister(&mem(h, handle, "handle")?))
}

/// Registers the handler of active messages with `tag` (below `am_user_tags`); messages that
/// arrived for it before are delivered now, in order.
///
/// # Safety
/// `handler` stays callable, with `user`, until it is unregistered or the engine finalized.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_register_handler(
    engine: ferry_engine,
    tag: u16,
    handler: ferry_am_handler,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        let Some(f) = handler else {
            return Err(EngineError::InvalidArgument("handler is null".into()));
        };
        let user = User(user);
        h.register_handler(tag, move |m: AmMessage| {
            let u = &user;
            // SAFETY: the caller's handler with its user pointer; the payload lives for the call.
            unsafe { f(m.tag, m.source, m.bytes.as_ptr() as *const c_void, m.bytes.len(), u.0) }
        })
    })
}

/// Removes the handler of `tag`; its messages are held until another is registered.
#[no_mangle]
pub extern "C" fn ferry_engine_unregister_handler(engine: ferry_engine, tag: u16) -> ferry_status {
    with(engine, |h| h.unregister_handler(tag))
}

/// Sends `len` bytes (at most `am_max_payload`) to `peer`'s handler for `tag`; the bytes are
/// copied before the call returns.
///
/// # Safety
/// `data` is valid for `len` reads (or NULL with `len` 0).
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_send_am(
    engine: ferry_engine,
    tag: u16,
    peer: i32,
    data: *const c_void,
    len: usize,
) -> ferry_status {
    guard(|| match slice(data as *const u8, len, "data") {
        Ok(bytes) => with(engine, |h| h.send_am(tag, peer, bytes)),
        Err(s) => s,
    })
}

/// Reads `len` bytes at `remote_offset` of `remote` into `local` at `local_offset`; `done`
/// runs once they have landed; then, if `notify_tag` ≥ 0, the owner's handler for it receives
/// `notify_len` bytes at `notify_data` (copied now).
///
/// # Safety
/// The handles are valid for reads; `notify_data` for `notify_len` reads; `done` is NULL or
/// callable with `user` until it has run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_engine_get(
    engine: ferry_engine,
    local: *const ferry_mem_handle,
    local_offset: usize,
    remote: *const ferry_mem_handle,
    remote_offset: usize,
    len: usize,
    notify_tag: i32,
    notify_data: *const c_void,
    notify_len: usize,
    done: ferry_completion,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        let (l, r) = (mem(h, local, "local")?, mem(h, remote, "remote")?);
        let n = notify(notify_tag, notify_data, notify_len)?;
        h.get(&l, local_offset, &r, remote_offset, len, n, completion(done, user))
    })
}

/// As `ferry_engine_get`, into device memory (`local` registered as device memory), and
/// stream-ordered: work enqueued on `stream` (a `CUstream` of the destination's device; NULL is
/// the legacy default stream) after this call returns runs once the bytes have landed, with no
/// host round trip; `done` still runs on the host. A get that fails releases the stream too.
/// Emulated devices ignore `stream`. See `ferry_engine::EngineHandle::get_on_stream`.
///
/// # Safety
/// As `ferry_engine_get`; `stream` is a live stream of the destination's device, or NULL.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_engine_get_on_stream(
    engine: ferry_engine,
    local: *const ferry_mem_handle,
    local_offset: usize,
    remote: *const ferry_mem_handle,
    remote_offset: usize,
    len: usize,
    notify_tag: i32,
    notify_data: *const c_void,
    notify_len: usize,
    stream: *mut c_void,
    done: ferry_completion,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        let (l, r) = (mem(h, local, "local")?, mem(h, remote, "remote")?);
        let n = notify(notify_tag, notify_data, notify_len)?;
        h.get_on_stream(
            &l,
            local_offset,
            &r,
            remote_offset,
            len,
            n,
            stream as u64,
            completion(done, user),
        )
    })
}

/// Writes `len` bytes at `local_offset` of `local` into `remote` at `remote_offset`; `done`
/// runs once they are in place at the owner, whose handler for `notify_tag` (if ≥ 0) has then
/// received the notification.
///
/// # Safety
/// As `ferry_engine_get`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_engine_put(
    engine: ferry_engine,
    local: *const ferry_mem_handle,
    local_offset: usize,
    remote: *const ferry_mem_handle,
    remote_offset: usize,
    len: usize,
    notify_tag: i32,
    notify_data: *const c_void,
    notify_len: usize,
    done: ferry_completion,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        let (l, r) = (mem(h, local, "local")?, mem(h, remote, "remote")?);
        let n = notify(notify_tag, notify_data, notify_len)?;
        h.put(&l, local_offset, &r, remote_offset, len, n, completion(done, user))
    })
}

/// Sends `len` bytes at `offset` of `local` to `peer` with `tag`; `done` runs when the buffer
/// may be reused.
///
/// # Safety
/// As `ferry_engine_get`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_engine_send(
    engine: ferry_engine,
    local: *const ferry_mem_handle,
    offset: usize,
    len: usize,
    peer: i32,
    tag: u32,
    done: ferry_completion,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        let l = mem(h, local, "local")?;
        h.send(&l, offset, len, peer, tag, completion(done, user))
    })
}

/// Receives exactly `len` bytes from `peer` with `tag` into `local` at `offset`; `done` runs
/// once they have landed (with an error for a message of another length).
///
/// # Safety
/// As `ferry_engine_get`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_engine_recv(
    engine: ferry_engine,
    local: *const ferry_mem_handle,
    offset: usize,
    len: usize,
    peer: i32,
    tag: u32,
    done: ferry_completion,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        let l = mem(h, local, "local")?;
        h.recv(&l, offset, len, peer, tag, completion(done, user))
    })
}

/// Memory a placed get filled (0: none); released with `ferry_engine_placed_release`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_placed {
    /// Opaque id.
    pub id: u64,
}

/// A placed get's completion: `(status, placed, user)`; `placed` is 0 on an error.
#[allow(non_camel_case_types)]
pub type ferry_placed_completion = Option<unsafe extern "C" fn(ferry_status, ferry_placed, *mut c_void)>;

/// Reads `len` bytes at `remote_offset` of `remote` into new memory the engine allocates on
/// `device` (within the engine's device budget), or in pinned host memory when the device has
/// no room; `done` receives it (`ferry_engine_placed_info` says where it landed). Receive-side
/// placement: PaRSEC's RGET, TTG's receive into device memory.
///
/// A NULL `done` gives the placement back as soon as it has landed.
///
/// # Safety
/// `remote` is valid for a read, `notify_data` for `notify_len` reads; `done` is NULL or callable
/// with `user` until it has run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_engine_get_placed(
    engine: ferry_engine,
    device: u32,
    remote: *const ferry_mem_handle,
    remote_offset: usize,
    len: usize,
    notify_tag: i32,
    notify_data: *const c_void,
    notify_len: usize,
    done: ferry_placed_completion,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        let r = mem(h, remote, "remote")?;
        let n = notify(notify_tag, notify_data, notify_len)?;
        let user = User(user);
        h.get_placed(device as usize, &r, remote_offset, len, n, move |res| {
            let user = user;
            // Nobody to hand it to: the placement is given back at once.
            let Some(cb) = done else { return };
            let (status, placed) = match res {
                Ok(p) => {
                    let id = registry::insert(Object::Placed(Arc::new(Mutex::new(Some(p)))));
                    (FERRY_OK, ferry_placed { id })
                }
                Err(e) => (engine_error(&e), ferry_placed { id: 0 }),
            };
            // SAFETY: the caller's callback with its user pointer.
            unsafe { cb(status, placed, user.0) };
        })
    })
}

/// One get of `ferry_engine_get_placed_all`: `len` bytes at `offset` of `remote`, and the
/// notification (`notify_tag` ≥ 0) its owner receives once they have landed.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_placed_request {
    /// The remote registration read.
    pub remote: ferry_mem_handle,
    /// Bytes from its start.
    pub offset: usize,
    /// Bytes read (at least 1).
    pub len: usize,
    /// The owner's handler tag, or -1 for no notification.
    pub notify_tag: i32,
    /// Bytes of the notification (copied by the call).
    pub notify_data: *const c_void,
    /// Their length.
    pub notify_len: usize,
}

/// A group's completion: `(status, placed, count, user)`; `placed` holds `count` placements in
/// request order, valid during the call (each released with `ferry_engine_placed_release`);
/// NULL and 0 on an error (the placements already made are freed).
#[allow(non_camel_case_types)]
pub type ferry_placed_all_completion =
    Option<unsafe extern "C" fn(ferry_status, *const ferry_placed, usize, *mut c_void)>;

/// Places the inputs of one task together: reads each request's bytes into new memory, all of
/// it on `device` (the engine's placement arena, else allocations of their own) or, when the
/// device has no room for all of it at once, all of it in pinned host memory, so a task never
/// holds part of the device while it waits for the rest. `done` runs once every get has landed.
///
/// Errors at once (nothing started): as `ferry_engine_get_placed` for any request;
/// `FERRY_ERR_INVALID_ARGUMENT` for `count` 0 or `requests` NULL.
///
/// # Safety
/// `requests` is valid for `count` reads, each request's `notify_data` for its `notify_len`;
/// `done` is NULL (the placements are given back as soon as they have landed) or callable with
/// `user` until it has run.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_get_placed_all(
    engine: ferry_engine,
    device: u32,
    requests: *const ferry_placed_request,
    count: usize,
    done: ferry_placed_all_completion,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        if count == 0 || requests.is_null() {
            return Err(EngineError::InvalidArgument(
                "no requests (count 0 or requests NULL)".into(),
            ));
        }
        // SAFETY: the caller's promise above.
        let reqs = unsafe { std::slice::from_raw_parts(requests, count) };
        let mut rust = Vec::with_capacity(count);
        for r in reqs {
            rust.push(eng::PlacedRequest {
                remote: h.mem_handle(&r.remote.bytes)?,
                offset: r.offset,
                len: r.len,
                // SAFETY: as above.
                notify: unsafe { notify(r.notify_tag, r.notify_data, r.notify_len)? },
            });
        }
        let user = User(user);
        h.get_placed_all(device as usize, &rust, move |res| {
            let user = user;
            // Nobody to hand them to: the placements are given back at once.
            let Some(cb) = done else { return };
            let (status, placed) = match res {
                Ok(v) => (
                    FERRY_OK,
                    v.into_iter()
                        .map(|p| ferry_placed {
                            id: registry::insert(Object::Placed(Arc::new(Mutex::new(Some(p))))),
                        })
                        .collect::<Vec<_>>(),
                ),
                Err(e) => (engine_error(&e), Vec::new()),
            };
            let ptr = if placed.is_empty() {
                std::ptr::null()
            } else {
                placed.as_ptr()
            };
            // SAFETY: the caller's callback with its user pointer; the array lives until it
            // returns.
            unsafe { cb(status, ptr, placed.len(), user.0) };
        })
    })
}

/// A framework's placement of a group (`ferry_engine_set_placer`): device addresses on
/// `device` for `count` lengths (`lens`), written to `out_addrs`; returns 1 when it placed all of
/// them, 0 for none (no room, even after evicting what it may evict).
#[allow(non_camel_case_types)]
pub type ferry_place_fn = Option<unsafe extern "C" fn(u32, usize, *const usize, *mut u64, *mut c_void) -> i32>;

/// The end of a placement (`ferry_engine_set_placer`): `(device, addr, len, user)`; the memory
/// is the framework's again.
#[allow(non_camel_case_types)]
pub type ferry_release_fn = Option<unsafe extern "C" fn(u32, u64, usize, *mut c_void)>;

/// A placer made of C callbacks.
struct CPlacer {
    place: unsafe extern "C" fn(u32, usize, *const usize, *mut u64, *mut c_void) -> i32,
    release: unsafe extern "C" fn(u32, u64, usize, *mut c_void),
    user: User,
}

impl eng::Placer for CPlacer {
    fn place(&self, device: usize, lens: &[usize]) -> Option<Vec<u64>> {
        let mut addrs = vec![0u64; lens.len()];
        // SAFETY: the framework's callback with its user pointer, `lens` and room for an address
        // per length.
        let placed = unsafe {
            (self.place)(
                device as u32,
                lens.len(),
                lens.as_ptr(),
                addrs.as_mut_ptr(),
                self.user.0,
            )
        };
        (placed == 1).then_some(addrs)
    }

    fn release(&self, device: usize, addr: u64, len: usize) {
        // SAFETY: the framework's callback with its user pointer.
        unsafe { (self.release)(device as u32, addr, len, self.user.0) }
    }
}

/// Installs the framework's placer: from now on, placed gets take device memory from `place`
/// (all of a group's or none; it may evict the framework's own data to make room) and fall back
/// to pinned host memory when it has none, instead of the engine's arena; `release` gets each
/// placement back once its `ferry_placed` is released. Both NULL: removes the placer.
///
/// The callbacks run on the threads that start placed gets and release placements; they must not
/// wait for engine events.
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` for one callback without the other.
///
/// # Safety
/// The callbacks stay callable with `user` until the placer is removed or replaced and its
/// placements released, or the engine is finalized.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_set_placer(
    engine: ferry_engine,
    place: ferry_place_fn,
    release: ferry_release_fn,
    user: *mut c_void,
) -> ferry_status {
    with(engine, |h| {
        match (place, release) {
            (Some(place), Some(release)) => h.set_placer(Some(Arc::new(CPlacer {
                place,
                release,
                user: User(user),
            }))),
            (None, None) => h.set_placer(None),
            _ => {
                return Err(EngineError::InvalidArgument(
                    "a placer needs both callbacks (or neither, to remove it)".into(),
                ))
            }
        }
        Ok(())
    })
}

/// Where placed memory landed: its handle (registered with the engine, shippable to peers), its
/// address (device or host), and its device (-1: pinned host memory).
///
/// # Safety
/// The out-pointers are valid for writes (each may be NULL).
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_placed_info(
    placed: ferry_placed,
    out_handle: *mut ferry_mem_handle,
    out_addr: *mut u64,
    out_device: *mut i32,
) -> ferry_status {
    guard(|| {
        let Some(Object::Placed(p)) = registry::get(placed.id) else {
            return fail(
                FERRY_ERR_INVALID_HANDLE,
                format!("{} is not a live ferry_placed", placed.id),
            );
        };
        let g = p.lock().unwrap_or_else(|e| e.into_inner());
        let Some(p) = g.as_ref() else {
            return fail(FERRY_ERR_INVALID_HANDLE, "placed memory already released");
        };
        if !out_handle.is_null() {
            out_handle.write(ferry_mem_handle {
                bytes: p.handle().to_bytes(),
            });
        }
        if !out_addr.is_null() {
            out_addr.write(p.addr());
        }
        if !out_device.is_null() {
            out_device.write(p.device().map_or(-1, |d| d as i32));
        }
        FERRY_OK
    })
}

/// Ends the registration of placed memory and frees it (`FERRY_ERR_INVALID_HANDLE` for one
/// released already).
#[no_mangle]
pub extern "C" fn ferry_engine_placed_release(placed: ferry_placed) -> ferry_status {
    guard(
        || match registry::remove(placed.id, |o| matches!(o, Object::Placed(_))) {
            Some(Object::Placed(p)) => {
                drop(p.lock().unwrap_or_else(|e| e.into_inner()).take());
                FERRY_OK
            }
            _ => fail(
                FERRY_ERR_INVALID_HANDLE,
                format!("{} is not a live ferry_placed", placed.id),
            ),
        },
    )
}

/// Progresses the engine on this thread (see `EngineHandle::progress`); writes the number of
/// events progressed to `events` unless it is NULL.
///
/// # Safety
/// `events` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_progress(engine: ferry_engine, events: *mut usize) -> ferry_status {
    guard(|| match handle(engine) {
        Ok(h) => {
            let n = h.progress();
            if !events.is_null() {
                events.write(n);
            }
            FERRY_OK
        }
        Err(s) => s,
    })
}

/// Blocks until every rank has called it (collective; not from a callback).
#[no_mangle]
pub extern "C" fn ferry_engine_barrier(engine: ferry_engine) -> ferry_status {
    with(engine, |h| h.barrier())
}

/// Gathers `len` bytes from every rank into `out` (`len` × ranks bytes, in rank order);
/// collective, every rank with the same `len` (for shipping memory handles).
///
/// # Safety
/// `data` is valid for `len` reads, `out` for `len` × ranks writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_allgather(
    engine: ferry_engine,
    data: *const c_void,
    len: usize,
    out_data: *mut c_void,
) -> ferry_status {
    guard(|| {
        let bytes = match slice(data as *const u8, len, "data") {
            Ok(b) => b,
            Err(s) => return s,
        };
        if out_data.is_null() && len > 0 {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "out_data is null");
        }
        with(engine, |h| {
            let all = h.allgather(bytes)?;
            if let Some((r, b)) = all.iter().enumerate().find(|(_, b)| b.len() != len) {
                return Err(EngineError::InvalidArgument(format!(
                    "rank {r} gave {} bytes, this rank {len}",
                    b.len()
                )));
            }
            // (`out_data` may be null when `len` is 0: nothing to copy then.)
            for (r, b) in all.iter().enumerate().filter(|_| len > 0) {
                std::ptr::copy_nonoverlapping(b.as_ptr(), (out_data as *mut u8).add(r * len), len);
            }
            Ok(())
        })
    })
}

/// This rank's engine counters.
///
/// # Safety
/// `out_stats` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_stats(
    engine: ferry_engine,
    out_stats: *mut ferry_engine_counters,
) -> ferry_status {
    with(engine, |h| {
        let s = h.stats();
        let c = ferry_engine_counters {
            am_sent: s.am_sent,
            am_received: s.am_received,
            notifications: s.notifications,
            puts: s.puts,
            gets: s.gets,
            puts_served: s.puts_served,
            gets_served: s.gets_served,
            refused: s.refused,
            bytes_put: s.bytes_put,
            bytes_got: s.bytes_got,
            sends: s.sends,
            recvs: s.recvs,
            leased_copies: s.leased_copies,
            single_copies: s.single_copies,
            registrations: s.registrations,
        };
        out(out_stats, c).map_err(|_| EngineError::InvalidArgument("out_stats is null".into()))
    })
}
