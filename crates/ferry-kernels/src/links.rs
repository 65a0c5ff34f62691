//! Link ceilings measured with the bare driver, for benchmarks to quote ratios against in the
//! same run: a peer copy between two GPUs (`cuMemcpyPeerAsync`), and pinned host↔device copies.
//!
//! Each function creates its own contexts, streams and buffers and frees them on return; call them
//! before or after a runtime's work, not during (they would share the links).

use crate::cuda::CudaKernelError;
use cudarc::driver::{result, sys, CudaContext, PushKernelArg};
use std::time::Instant;

pub(crate) fn drv(e: cudarc::driver::DriverError) -> CudaKernelError {
    CudaKernelError::Driver(format!("{e:?}"))
}

pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<(), CudaKernelError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaKernelError::Driver(format!("{what}: {r:?}")))
    }
}

pub(crate) fn require_driver() -> Result<(), CudaKernelError> {
    // SAFETY: a plain check whether the shared library can be loaded.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaKernelError::Driver("no CUDA driver library".into()))
    }
}

/// Enables access from `ctx` (bound to this thread first) to `peer`'s memory; access enabled
/// already is fine.
///
/// # Safety
/// Plain driver calls on live contexts.
pub(crate) unsafe fn enable_peer_access(ctx: &CudaContext, peer: &CudaContext) -> Result<(), CudaKernelError> {
    ctx.bind_to_thread().map_err(drv)?;
    // SAFETY: live contexts, the first one bound.
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
    if r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        check(r, "cuCtxEnablePeerAccess")?;
    }
    Ok(())
}

/// `n` device buffers of `bytes` each in `ctx` (bound to this thread first); free them with
/// [`free_each`].
///
/// # Safety
/// Plain allocations on a live context.
pub(crate) unsafe fn alloc_each(ctx: &CudaContext, n: usize, bytes: usize) -> Result<Vec<u64>, CudaKernelError> {
    ctx.bind_to_thread().map_err(drv)?;
    // SAFETY: plain allocations in the bound context.
    (0..n)
        .map(|_| unsafe { result::malloc_sync(bytes) }.map_err(drv))
        .collect()
}

/// Frees buffers of [`alloc_each`] in `ctx`.
///
/// # Safety
/// Nothing may use the buffers any more.
pub(crate) unsafe fn free_each(ctx: &CudaContext, bufs: Vec<u64>) {
    if ctx.bind_to_thread().is_ok() {
        for p in bufs {
            // SAFETY: allocated in this context; unused (the caller's contract).
            let _ = unsafe { result::free_sync(p) };
        }
    }
}

/// GB/s (10⁹ bytes/s) of `reps` rounds of `inflight` peer copies of `bytes` each from GPU `src`
/// to GPU `dst`, spread round-robin over `streams` streams of `dst` (the ceiling ferry's IPC path
/// is measured against: 395 GB/s at 1 GiB between two H200 joined by NV18). One untimed round first.
///
/// # Errors
/// `Driver` without a driver, with an ordinal out of range, when peer access cannot be enabled,
/// or when an allocation or copy fails; `Shape` for zero sizes or counts.
pub fn peer_copy_gbps(
    src: usize,
    dst: usize,
    bytes: usize,
    inflight: usize,
    streams: usize,
    reps: usize,
) -> Result<f64, CudaKernelError> {
    if bytes == 0 || inflight == 0 || streams == 0 || reps == 0 {
        return Err(CudaKernelError::Shape(
            "peer copy: sizes and counts must be positive".into(),
        ));
    }
    require_driver()?;
    let (cs, cd) = (CudaContext::new(src).map_err(drv)?, CudaContext::new(dst).map_err(drv)?);
    // SAFETY: plain driver calls on valid contexts; buffers freed below.
    unsafe {
        enable_peer_access(&cd, &cs)?;
        let sbuf = alloc_each(&cs, inflight, bytes)?;
        let dbuf = alloc_each(&cd, inflight, bytes)?;
        let ss: Vec<_> = (0..streams)
            .map(|_| cd.new_stream())
            .collect::<Result<_, _>>()
            .map_err(drv)?;
        let round = || -> Result<(), CudaKernelError> {
            for k in 0..inflight {
                let s = &ss[k % streams];
                result::memcpy_peer_async(cd.cu_ctx(), dbuf[k], cs.cu_ctx(), sbuf[k], bytes, s.cu_stream())
                    .map_err(drv)?;
            }
            for s in &ss {
                s.synchronize().map_err(drv)?;
            }
            Ok(())
        };
        round()?;
        let t0 = Instant::now();
        for _ in 0..reps {
            round()?;
        }
        let secs = t0.elapsed().as_secs_f64();
        free_each(&cd, dbuf);
        free_each(&cs, sbuf);
        Ok((reps * inflight * bytes) as f64 / secs / 1e9)
    }
}

/// GB/s of `reps` pinned host↔device copies of `bytes` on GPU `ordinal`: `(h2d, d2h)`.
///
/// # Errors
/// As [`peer_copy_gbps`].
pub fn pinned_copy_gbps(ordinal: usize, bytes: usize, reps: usize) -> Result<(f64, f64), CudaKernelError> {
    if bytes == 0 || reps == 0 {
        return Err(CudaKernelError::Shape(
            "pinned copy: sizes and counts must be positive".into(),
        ));
    }
    require_driver()?;
    let ctx = CudaContext::new(ordinal).map_err(drv)?;
    ctx.bind_to_thread().map_err(drv)?;
    let stream = ctx.new_stream().map_err(drv)?;
    // SAFETY: plain allocations, freed below; copies synchronised before timing ends.
    unsafe {
        let host = result::malloc_host(bytes, 0).map_err(drv)? as *mut u8;
        let dev = result::malloc_sync(bytes).map_err(drv)?;
        let time = |h2d: bool| -> Result<f64, CudaKernelError> {
            let t0 = Instant::now();
            for _ in 0..reps {
                if h2d {
                    result::memcpy_htod_async(dev, std::slice::from_raw_parts(host, bytes), stream.cu_stream())
                        .map_err(drv)?;
                } else {
                    result::memcpy_dtoh_async(std::slice::from_raw_parts_mut(host, bytes), dev, stream.cu_stream())
                        .map_err(drv)?;
                }
            }
            stream.synchronize().map_err(drv)?;
            Ok((reps * bytes) as f64 / t0.elapsed().as_secs_f64() / 1e9)
        };
        time(true)?;
        let h2d = time(true)?;
        let d2h = time(false)?;
        let _ = result::free_sync(dev);
        let _ = result::free_host(host as *mut std::ffi::c_void);
        Ok((h2d, d2h))
    }
}

/// Host-side cost, in µs per call, of the driver calls a GPU manager makes per operation, on GPU
/// `ordinal` (each call enqueued `calls` times in batches of 256, the stream drained between
/// batches and not timed): what bounds the operations per second of one manager thread.
///
/// Rows: `cuEventRecord` (without and with timing), `cuEventQuery` on a completed event,
/// `cuStreamWaitEvent`, `cuLaunchKernel` of an empty kernel, a 64 KiB device-to-device
/// `cuMemcpyAsync`, the same copies eight at a time through `cuMemcpyBatchAsync` (µs per copy;
/// left out when the driver lacks the CUDA 13 entry point), and `cuStreamWriteValue64` to pinned
/// host memory (left out when the device cannot use 64-bit stream memory operations).
///
/// # Errors
/// As [`peer_copy_gbps`], and `Nvrtc` when the empty kernel does not compile.
pub fn call_costs_us(ordinal: usize, calls: usize) -> Result<Vec<(&'static str, f64)>, CudaKernelError> {
    if calls == 0 {
        return Err(CudaKernelError::Shape("call costs: at least one call".into()));
    }
    require_driver()?;
    let ctx = CudaContext::new(ordinal).map_err(drv)?;
    ctx.bind_to_thread().map_err(drv)?;
    let stream = ctx.new_stream().map_err(drv)?;
    let s = stream.cu_stream();
    let ptx = cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void ferry_nop() {}")
        .map_err(|e| CudaKernelError::Nvrtc(format!("{e:?}")))?;
    let module = ctx.load_module(ptx).map_err(drv)?;
    let nop = module.load_function("ferry_nop").map_err(drv)?;
    let mut rows = Vec::new();
    // Rows timed outside `time` (which holds `rows`), appended at the end.
    let mut extra = Vec::new();
    // Times `f` over `calls` calls in batches, draining the stream between batches.
    let mut time = |name: &'static str, f: &mut dyn FnMut() -> Result<(), CudaKernelError>| {
        let mut spent = 0.0;
        let mut left = calls;
        while left > 0 {
            let n = left.min(256);
            let t0 = Instant::now();
            for _ in 0..n {
                f()?;
            }
            spent += t0.elapsed().as_secs_f64();
            stream.synchronize().map_err(drv)?;
            left -= n;
        }
        rows.push((name, spent * 1e6 / calls as f64));
        Ok::<(), CudaKernelError>(())
    };
    // SAFETY: plain driver calls on this context's live stream, events and buffers, all freed
    // below after the stream is drained.
    unsafe {
        let plain = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(drv)?;
        let timed = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(drv)?;
        time("cuEventRecord", &mut || result::event::record(plain, s).map_err(drv))?;
        time("cuEventRecord (timing)", &mut || {
            result::event::record(timed, s).map_err(drv)
        })?;
        stream.synchronize().map_err(drv)?;
        time("cuEventQuery (completed)", &mut || {
            result::event::query(plain).map_err(drv)
        })?;
        // Each of many events queried once after it completed (the GPU manager's case), rather
        // than one event queried again and again.
        {
            let fresh: Vec<sys::CUevent> = (0..256)
                .map(|_| result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(drv))
                .collect::<Result<_, _>>()?;
            for &e in &fresh {
                result::event::record(e, s).map_err(drv)?;
            }
            stream.synchronize().map_err(drv)?;
            let t0 = Instant::now();
            for &e in &fresh {
                result::event::query(e).map_err(drv)?;
            }
            extra.push((
                "cuEventQuery (completed, first query)",
                t0.elapsed().as_secs_f64() * 1e6 / fresh.len() as f64,
            ));
            for e in fresh {
                let _ = result::event::destroy(e);
            }
        }
        time("cuStreamQuery (idle stream)", &mut || {
            check(sys::cuStreamQuery(s), "cuStreamQuery")
        })?;
        time("cuStreamWaitEvent", &mut || {
            result::stream::wait_event(s, plain, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).map_err(drv)
        })?;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        time("cuLaunchKernel (empty)", &mut || {
            let mut b = stream.launch_builder(&nop);
            b.launch(cfg).map(|_| ()).map_err(drv)
        })?;
        let (a, b) = (
            result::malloc_sync(1 << 16).map_err(drv)?,
            result::malloc_sync(1 << 16).map_err(drv)?,
        );
        time("cuMemcpyAsync (64 KiB D2D)", &mut || {
            result::memcpy_dtod_async(b, a, 1 << 16, s).map_err(drv)
        })?;
        if sys::culib().get::<*const ()>(b"cuMemcpyBatchAsync_v2\0").is_ok() {
            const K: usize = 8;
            let dst = result::malloc_sync(K << 16).map_err(drv)?;
            let here = sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal as i32,
            };
            let mut attrs = [sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: here,
                dstLocHint: here,
                flags: 0,
            }];
            let mut idx = [0usize];
            let mut dsts: Vec<sys::CUdeviceptr> = (0..K as u64).map(|k| dst + (k << 16)).collect();
            let mut srcs = vec![a; K];
            let mut sizes = vec![1usize << 16; K];
            time("cuMemcpyBatchAsync (8 × 64 KiB, per copy)", &mut || {
                check(
                    sys::cuMemcpyBatchAsync_v2(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        K,
                        attrs.as_mut_ptr(),
                        idx.as_mut_ptr(),
                        1,
                        s,
                    ),
                    "cuMemcpyBatchAsync",
                )
            })?;
            stream.synchronize().map_err(drv)?;
            let _ = result::free_sync(dst);
        }
        let mut can = 0;
        check(
            sys::cuDeviceGetAttribute(
                &mut can,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                ordinal as i32,
            ),
            "cuDeviceGetAttribute",
        )?;
        if can != 0 {
            let host = result::malloc_host(8, sys::CU_MEMHOSTALLOC_DEVICEMAP).map_err(drv)? as *mut u64;
            let mut dev: sys::CUdeviceptr = 0;
            check(
                sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut std::ffi::c_void, 0),
                "cuMemHostGetDevicePointer",
            )?;
            let mut v = 0u64;
            time("cuStreamWriteValue64 (host flag)", &mut || {
                v += 1;
                check(sys::cuStreamWriteValue64_v2(s, dev, v, 0), "cuStreamWriteValue64")
            })?;
            stream.synchronize().map_err(drv)?;
            let _ = result::free_host(host as *mut std::ffi::c_void);
        }
        stream.synchronize().map_err(drv)?;
        let _ = result::free_sync(a);
        let _ = result::free_sync(b);
        let _ = result::event::destroy(plain);
        let _ = result::event::destroy(timed);
    }
    rows.extend(extra);
    // The batch row timed calls of eight copies each: per copy.
    for r in rows.iter_mut().filter(|r| r.0.starts_with("cuMemcpyBatchAsync")) {
        r.1 /= 8.0;
    }
    Ok(rows)
}

/// The copy kernel of [`sm_pull_gbps`]: ferry's own (`ferry::device::sm_copy`), copy
/// `blockIdx.y` of a table, 16 bytes per thread and four loads in flight per thread, its bytes
/// spread over `gridDim.x` blocks.
const SM_COPY: &str = include_str!("../../ferry-device/src/copy_kernel.cu");

#[repr(C)]
#[derive(Clone, Copy)]
struct SmCopies {
    c: [[u64; 3]; 16],
}

// SAFETY: plain old data with the layout of `struct ferry_copies` (16 × 3 u64).
unsafe impl cudarc::driver::DeviceRepr for SmCopies {}

/// GB/s of `reps` rounds of `inflight` (≤ 16) copies of `bytes` (a multiple of 16) each from
/// GPU `src` to GPU `dst`, made by one kernel launch per round on `dst` that **loads** the
/// peer's memory over the link (what a consumer's pull does), with `blocks` thread blocks of
/// 256 threads per copy; and the host µs per launch. The counterpart of [`peer_copy_gbps`]
/// (copy engines, one driver call per copy) in the same run: which is cheaper to issue and
/// faster at a given size.
///
/// # Errors
/// As [`peer_copy_gbps`]; `Nvrtc` when the kernel does not compile; `Shape` when `inflight`
/// exceeds 16 or `bytes` is not a multiple of 16.
pub fn sm_pull_gbps(
    src: usize,
    dst: usize,
    bytes: usize,
    inflight: usize,
    blocks: u32,
    reps: usize,
) -> Result<(f64, f64), CudaKernelError> {
    if bytes == 0 || inflight == 0 || reps == 0 || blocks == 0 || inflight > 16 || bytes % 16 != 0 {
        return Err(CudaKernelError::Shape(
            "sm pull: positive sizes, at most 16 copies of a multiple of 16 bytes".into(),
        ));
    }
    require_driver()?;
    let (cs, cd) = (CudaContext::new(src).map_err(drv)?, CudaContext::new(dst).map_err(drv)?);
    cd.bind_to_thread().map_err(drv)?;
    let ptx = cudarc::nvrtc::compile_ptx(SM_COPY).map_err(|e| CudaKernelError::Nvrtc(format!("{e:?}")))?;
    let module = cd.load_module(ptx).map_err(drv)?;
    let f = module.load_function("ferry_copy_batch").map_err(drv)?;
    let stream = cd.new_stream().map_err(drv)?;
    // SAFETY: plain driver calls on valid contexts; buffers freed below after the stream drains.
    unsafe {
        enable_peer_access(&cd, &cs)?;
        let sbuf = alloc_each(&cs, inflight, bytes)?;
        let dbuf = alloc_each(&cd, inflight, bytes)?;
        let mut t = SmCopies { c: [[0; 3]; 16] };
        for k in 0..inflight {
            t.c[k] = [sbuf[k], dbuf[k], bytes as u64];
        }
        let n = inflight as u64;
        let per_copy = ((bytes / 16) as u64).div_ceil(256 * 4).clamp(1, blocks as u64) as u32;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (per_copy, inflight as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch_s = 0.0;
        let round = |timed: &mut f64| -> Result<(), CudaKernelError> {
            let t0 = Instant::now();
            let mut b = stream.launch_builder(&f);
            b.arg(&t).arg(&n);
            b.launch(cfg).map_err(drv)?;
            *timed += t0.elapsed().as_secs_f64();
            stream.synchronize().map_err(drv)
        };
        round(&mut 0.0)?;
        let t0 = Instant::now();
        for _ in 0..reps {
            round(&mut launch_s)?;
        }
        let secs = t0.elapsed().as_secs_f64();
        free_each(&cd, dbuf);
        free_each(&cs, sbuf);
        Ok((
            (reps * inflight * bytes) as f64 / secs / 1e9,
            launch_s * 1e6 / reps as f64,
        ))
    }
}

/// A signal value past every wait of a probe, written to release them after a failure:
/// `cuStreamWaitValue64`'s "≥" is a signed comparison of the difference, so it must be far
/// above the waited values without being negative as an `i64`.
const RELEASE: u64 = 1 << 62;

/// How [`signal_round_trip_us`] signals between the two GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalMode {
    /// `cuStreamWriteValue64` (with its memory barrier) into one's own memory; the other GPU's
    /// stream waits (`cuStreamWaitValue64`, ≥) on it across the link: what offers at launch do.
    Pull,
    /// The same operations, each GPU writing into the other's memory and waiting on its own.
    Push,
    /// Events: `cuEventRecord` on one GPU's stream, `cuStreamWaitEvent` on the other's (the
    /// ordering an IPC event handle would give between processes).
    Event,
}

/// Round-trip latency, in µs, of a signal between GPUs `a` and `b`: `rounds` ping-pongs made
/// as `mode` says, enqueued in batches of 64 rounds behind a gate and released together. Half
/// of it is the latency of one hop of the IPC path's ordering of a pull after its producer.
///
/// # Errors
/// As [`peer_copy_gbps`], and `Driver` when the devices cannot use 64-bit stream memory
/// operations.
pub fn signal_round_trip_us(a: usize, b: usize, mode: SignalMode, rounds: usize) -> Result<f64, CudaKernelError> {
    if rounds == 0 {
        return Err(CudaKernelError::Shape("signal round trip: at least one round".into()));
    }
    require_driver()?;
    let ca = CudaContext::new(a).map_err(drv)?;
    let cb = CudaContext::new(b).map_err(drv)?;
    // SAFETY: plain driver calls on valid contexts; every buffer is freed after both streams
    // drained.
    unsafe {
        for (ctx, other) in [(&ca, &cb), (&cb, &ca)] {
            ctx.bind_to_thread().map_err(drv)?;
            let mut can = 0;
            check(
                sys::cuDeviceGetAttribute(
                    &mut can,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                    ctx.ordinal() as i32,
                ),
                "cuDeviceGetAttribute",
            )?;
            if can == 0 {
                return Err(CudaKernelError::Driver("no 64-bit stream memory operations".into()));
            }
            enable_peer_access(ctx, other)?;
        }
        // The words: one in each GPU's memory, zeroed; a pinned host word gates the start.
        ca.bind_to_thread().map_err(drv)?;
        let wa = result::malloc_sync(8).map_err(drv)?;
        result::memset_d8_sync(wa, 0, 8).map_err(drv)?;
        let sa = ca.new_stream().map_err(drv)?;
        cb.bind_to_thread().map_err(drv)?;
        let wb = result::malloc_sync(8).map_err(drv)?;
        result::memset_d8_sync(wb, 0, 8).map_err(drv)?;
        let sb = cb.new_stream().map_err(drv)?;
        let gate = result::malloc_host(8, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE)
            .map_err(drv)? as *mut u64;
        gate.write_volatile(0);
        // The gate is waited for on GPU a's stream: its device address in a's context.
        ca.bind_to_thread().map_err(drv)?;
        let mut gate_dev: sys::CUdeviceptr = 0;
        check(
            sys::cuMemHostGetDevicePointer_v2(&mut gate_dev, gate as *mut std::ffi::c_void, 0),
            "cuMemHostGetDevicePointer",
        )?;
        let write = |s: sys::CUstream, at: u64, v: u64| {
            check(
                sys::cuStreamWriteValue64_v2(
                    s,
                    at,
                    v,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as std::ffi::c_uint,
                ),
                "cuStreamWriteValue64",
            )
        };
        let wait = |s: sys::CUstream, at: u64, v: u64| {
            check(
                sys::cuStreamWaitValue64_v2(
                    s,
                    at,
                    v,
                    sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as std::ffi::c_uint,
                ),
                "cuStreamWaitValue64",
            )
        };
        // Pull: A writes wa, B waits on wa (remote for B); B writes wb, A waits on wb (remote).
        // Push: A writes wb (remote), B waits on wb (local); B writes wa (remote), A waits on wa.
        let push = mode == SignalMode::Push;
        let (a_writes, b_waits, b_writes, a_waits) = if push { (wb, wb, wa, wa) } else { (wa, wa, wb, wb) };
        // Batches of at most 64 rounds enqueued behind the gate: a stream's queue of pending
        // operations is bounded, and enqueuing more than it holds behind a closed gate blocks the
        // host before it can open the gate.
        const BATCH: usize = 64;
        let mut events: Vec<sys::CUevent> = Vec::new();
        let mut measure = || -> Result<f64, CudaKernelError> {
            let mut secs = 0.0;
            let (mut done, mut batch) = (0u64, 0u64);
            while (done as usize) < rounds {
                let n = (rounds - done as usize).min(BATCH) as u64;
                batch += 1;
                ca.bind_to_thread().map_err(drv)?;
                wait(sa.cu_stream(), gate_dev, batch)?;
                if mode == SignalMode::Event {
                    // A fresh pair per round: a wait captures the event's latest record.
                    let plain = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
                    let any = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
                    for _ in 0..n {
                        ca.bind_to_thread().map_err(drv)?;
                        let ea = result::event::create(plain).map_err(drv)?;
                        events.push(ea);
                        result::event::record(ea, sa.cu_stream()).map_err(drv)?;
                        cb.bind_to_thread().map_err(drv)?;
                        let eb = result::event::create(plain).map_err(drv)?;
                        events.push(eb);
                        result::stream::wait_event(sb.cu_stream(), ea, any).map_err(drv)?;
                        result::event::record(eb, sb.cu_stream()).map_err(drv)?;
                        ca.bind_to_thread().map_err(drv)?;
                        result::stream::wait_event(sa.cu_stream(), eb, any).map_err(drv)?;
                    }
                } else {
                    for i in done + 1..=done + n {
                        write(sa.cu_stream(), a_writes, i)?;
                        wait(sa.cu_stream(), a_waits, i)?;
                    }
                    cb.bind_to_thread().map_err(drv)?;
                    for i in done + 1..=done + n {
                        wait(sb.cu_stream(), b_waits, i)?;
                        write(sb.cu_stream(), b_writes, i)?;
                    }
                }
                let t0 = Instant::now();
                gate.write_volatile(batch);
                sa.synchronize().map_err(drv)?;
                secs += t0.elapsed().as_secs_f64();
                sb.synchronize().map_err(drv)?;
                for e in events.drain(..) {
                    let _ = result::event::destroy(e);
                }
                done += n;
            }
            Ok(secs * 1e6 / rounds as f64)
        };
        let measured = measure();
        if measured.is_err() {
            // Part of a batch may be enqueued behind the gate: open it and satisfy every wait
            // (synchronous writes go on the legacy stream, which these non-blocking streams do
            // not wait for), so that nothing is left blocked in the shared primary contexts.
            gate.write_volatile(u64::MAX);
            // Not all ones: `cuStreamWaitValue64`'s ≥ compares cyclically (as a signed
            // difference), so u64::MAX is "below" every small value; 2⁶² is above them all.
            let _ = ca.bind_to_thread().map(|_| result::memcpy_htod_sync(wa, &[RELEASE]));
            let _ = cb.bind_to_thread().map(|_| result::memcpy_htod_sync(wb, &[RELEASE]));
            let _ = sa.synchronize();
            let _ = sb.synchronize();
            for e in events.drain(..) {
                let _ = result::event::destroy(e);
            }
        }
        let _ = cb.bind_to_thread().map(|_| result::free_sync(wb));
        let _ = ca.bind_to_thread().map(|_| result::free_sync(wa));
        let _ = result::free_host(gate as *mut std::ffi::c_void);
        measured
    }
}

/// How [`signal_wake_us`]'s waiting GPU waits for the signal word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiter {
    /// `cuStreamWaitValue64` (≥) on the peer's word, as an IPC pull offered at launch waits.
    Stream,
    /// One thread of a kernel spinning on the word over the link (volatile loads).
    Kernel,
}

/// CUDA C of [`Waiter::Kernel`]: one thread polls the word (in the peer's memory, over the
/// link), then stores the value into a host-mapped flag.
const SPIN_WAIT: &str = r#"
typedef unsigned long long u64;
extern "C" __global__ void ferry_spin_wait(const volatile u64* word, u64 value, volatile u64* flag) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    while (*word < value) { }
    __threadfence_system();
    *flag = value;
}
"#;

/// Wake-up latency, in µs (median of `reps`), of a GPU `b` waiting for a signal word that GPU
/// `a` writes into its own memory: `b`'s wait (and, behind it, a write of a host-mapped flag)
/// is enqueued, left pending for `pending_us`, then the host has `a`'s stream write the word
/// (`cuStreamWriteValue64`) and spins until the flag appears. The figure includes the write
/// call, `a`'s write, the wake-up of `b`'s wait and the flag's trip to the host; compared across
/// `pending_us` and [`Waiter`] kinds it shows whether a wait enqueued long before its signal
/// wakes later, which is what an IPC pull offered at launch does in a pipeline.
///
/// # Errors
/// As [`signal_round_trip_us`]; [`CudaKernelError::Nvrtc`] when the spin kernel cannot be
/// compiled; `Shape` for `reps == 0`.
pub fn signal_wake_us(
    a: usize,
    b: usize,
    waiter: Waiter,
    pending_us: u64,
    reps: usize,
) -> Result<f64, CudaKernelError> {
    if reps == 0 {
        return Err(CudaKernelError::Shape("signal wake-up: at least one repetition".into()));
    }
    require_driver()?;
    let ca = CudaContext::new(a).map_err(drv)?;
    let cb = CudaContext::new(b).map_err(drv)?;
    let spin = if waiter == Waiter::Kernel {
        cb.bind_to_thread().map_err(drv)?;
        let ptx = cudarc::nvrtc::compile_ptx(SPIN_WAIT).map_err(|e| CudaKernelError::Nvrtc(format!("{e:?}")))?;
        let module = cb.load_module(ptx).map_err(drv)?;
        Some(module.load_function("ferry_spin_wait").map_err(drv)?)
    } else {
        None
    };
    // SAFETY: plain driver calls on valid contexts; the word is released (set to its maximum)
    // before anything is freed, so no wait is left blocked.
    unsafe {
        enable_peer_access(&ca, &cb)?;
        enable_peer_access(&cb, &ca)?;
        ca.bind_to_thread().map_err(drv)?;
        let word = result::malloc_sync(8).map_err(drv)?;
        result::memset_d8_sync(word, 0, 8).map_err(drv)?;
        let sa = ca.new_stream().map_err(drv)?;
        cb.bind_to_thread().map_err(drv)?;
        let sb = cb.new_stream().map_err(drv)?;
        let flag = result::malloc_host(8, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE)
            .map_err(drv)? as *mut u64;
        flag.write_volatile(0);
        let mut flag_dev: sys::CUdeviceptr = 0;
        check(
            sys::cuMemHostGetDevicePointer_v2(&mut flag_dev, flag as *mut std::ffi::c_void, 0),
            "cuMemHostGetDevicePointer",
        )?;
        let run = || -> Result<f64, CudaKernelError> {
            let mut us = Vec::with_capacity(reps);
            // One untimed round first (first-use costs).
            for v in 1..=reps as u64 + 1 {
                cb.bind_to_thread().map_err(drv)?;
                match &spin {
                    Some(f) => {
                        let cfg = cudarc::driver::LaunchConfig {
                            grid_dim: (1, 1, 1),
                            block_dim: (32, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let mut l = sb.launch_builder(f);
                        l.arg(&word).arg(&v).arg(&flag_dev);
                        l.launch(cfg).map_err(drv)?;
                    }
                    None => {
                        check(
                            sys::cuStreamWaitValue64_v2(
                                sb.cu_stream(),
                                word,
                                v,
                                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as std::ffi::c_uint,
                            ),
                            "cuStreamWaitValue64",
                        )?;
                        check(
                            sys::cuStreamWriteValue64_v2(
                                sb.cu_stream(),
                                flag_dev,
                                v,
                                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as std::ffi::c_uint,
                            ),
                            "cuStreamWriteValue64",
                        )?;
                    }
                }
                let pending = Instant::now();
                while pending.elapsed().as_micros() < u128::from(pending_us) {
                    std::hint::spin_loop();
                }
                ca.bind_to_thread().map_err(drv)?;
                let t0 = Instant::now();
                check(
                    sys::cuStreamWriteValue64_v2(
                        sa.cu_stream(),
                        word,
                        v,
                        sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as std::ffi::c_uint,
                    ),
                    "cuStreamWriteValue64",
                )?;
                while flag.read_volatile() < v {
                    if t0.elapsed().as_secs() > 5 {
                        return Err(CudaKernelError::Driver("signal wake-up: no flag within 5 s".into()));
                    }
                    std::hint::spin_loop();
                }
                if v > 1 {
                    us.push(t0.elapsed().as_secs_f64() * 1e6);
                }
            }
            us.sort_by(f64::total_cmp);
            Ok(us[us.len() / 2])
        };
        let measured = run();
        // Whatever happened, no wait stays blocked: 2⁶² releases them all (see `RELEASE`).
        let _ = ca.bind_to_thread().map(|_| result::memcpy_htod_sync(word, &[RELEASE]));
        let _ = sa.synchronize();
        let _ = sb.synchronize();
        let _ = ca.bind_to_thread().map(|_| result::free_sync(word));
        let _ = result::free_host(flag as *mut std::ffi::c_void);
        measured
    }
}
