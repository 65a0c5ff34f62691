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
