//! Link ceilings measured with the bare driver, for benchmarks to quote ratios against in the
//! same run: a peer copy between two GPUs (`cuMemcpyPeerAsync`), and pinned host↔device copies.
//!
//! Each function creates its own contexts, streams and buffers and frees them on return; call them
//! before or after a runtime's work, not during (they would share the links).

use crate::cuda::CudaKernelError;
use cudarc::driver::{result, sys, CudaContext};
use std::time::Instant;

fn drv(e: cudarc::driver::DriverError) -> CudaKernelError {
    CudaKernelError::Driver(format!("{e:?}"))
}

fn check(r: sys::CUresult, what: &str) -> Result<(), CudaKernelError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaKernelError::Driver(format!("{what}: {r:?}")))
    }
}

fn require_driver() -> Result<(), CudaKernelError> {
    // SAFETY: a plain check whether the shared library can be loaded.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaKernelError::Driver("no CUDA driver library".into()))
    }
}

/// GB/s (10⁹ bytes/s) of `reps` rounds of `inflight` peer copies of `bytes` each from GPU `src`
/// to GPU `dst`, spread round-robin over `streams` streams of `dst` (the ceiling ferry's IPC path
/// is measured against: ANCHORS.md, H200 NV18, 395 GB/s at 1 GiB). One untimed round first.
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
        cd.bind_to_thread().map_err(drv)?;
        let r = sys::cuCtxEnablePeerAccess(cs.cu_ctx(), 0);
        if r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            check(r, "cuCtxEnablePeerAccess")?;
        }
        cs.bind_to_thread().map_err(drv)?;
        let sbuf: Vec<u64> = (0..inflight)
            .map(|_| result::malloc_sync(bytes))
            .collect::<Result<_, _>>()
            .map_err(drv)?;
        cd.bind_to_thread().map_err(drv)?;
        let dbuf: Vec<u64> = (0..inflight)
            .map(|_| result::malloc_sync(bytes))
            .collect::<Result<_, _>>()
            .map_err(drv)?;
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
        for p in dbuf {
            let _ = result::free_sync(p);
        }
        cs.bind_to_thread().map_err(drv)?;
        for p in sbuf {
            let _ = result::free_sync(p);
        }
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
    // The batch row timed calls of eight copies each: per copy.
    for r in rows.iter_mut().filter(|r| r.0.starts_with("cuMemcpyBatchAsync")) {
        r.1 /= 8.0;
    }
    Ok(rows)
}
