//! The single-GPU anchor of the tiled GPU Cholesky: one cuSOLVER `dpotrf` of the whole matrix.

use super::*;
/// Result of [`cusolver_dpotrf_baseline`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BaselineResult {
    /// Matrix order.
    pub n: usize,
    /// Wall time of one `cusolverDnDpotrf` on the whole matrix, in seconds
    /// (CUDA events around the call on the stream).
    pub seconds: f64,
    /// `n³ / 3 / seconds / 1e9`: the usual Cholesky flop count over the time,
    /// in GFLOP/s (infinite if the event timer read 0).
    pub gflops: f64,
    /// `log det A = 2 Σ log L_jj` of the factor (read back from the diagonal): what ferry's
    /// `cholesky` prints for the same matrix, and the check that the anchor factored it.
    pub log_det: f64,
}

/// The single-GPU anchor a tiled GPU Cholesky is compared against: one
/// `cusolverDnDpotrf` (lower) of the whole `n × n` generated SPD matrix
/// ([`crate::spd::spd_entry`] with `seed`) on device `ordinal`.
///
/// Steps: create a context and a stream on `ordinal`; compile the NVRTC
/// module; allocate the `n × n` matrix (`8 n²` bytes) and fill it with one
/// `ferry_spd_tile` launch (the whole matrix as one tile); query the
/// workspace size and allocate it; run one **untimed warm-up** factorization
/// (it loads cuSOLVER's kernels lazily, which would otherwise be timed) and
/// refill the matrix; synchronise; then time one factorization with CUDA
/// events (ms → s), check its `devInfo` and read the log determinant back from the diagonal
/// (`n` copies of 8 bytes, after the timing). Everything is freed on return.
///
/// # Errors
/// `Shape` if `n == 0` or `n` does not fit `i32` / `n²` overflows;
/// `Driver`, `Nvrtc`, `Solver` if a library is missing or a call fails (an
/// out-of-memory allocation is a `Driver` error); `NotPositiveDefinite` if
/// the factorization fails (it cannot for this matrix, which is strictly
/// diagonally dominant).
pub fn cusolver_dpotrf_baseline(ordinal: usize, n: usize, seed: u64) -> Result<BaselineResult, CudaKernelError> {
    if n == 0 {
        return Err(CudaKernelError::Shape("the baseline needs n >= 1".into()));
    }
    let ni = blas_int("n", n)?;
    let elems = tile_elems(n, n)?;
    let elems =
        usize::try_from(elems).map_err(|_| CudaKernelError::Shape(format!("n = {n}: n² does not fit usize")))?;
    require_libs(true)?;
    let ctx = CudaContext::new(ordinal).map_err(drv)?;
    let stream = ctx.new_stream().map_err(drv)?;
    let kernels = load_kernels(&ctx)?;
    let dn = DnHandle::new(stream.clone()).map_err(solver)?;
    // SAFETY: fully written by the spd kernel before any read.
    let mut a = unsafe { stream.alloc::<f64>(elems) }.map_err(drv)?;
    let mut info = stream.alloc_zeros::<c_int>(1).map_err(drv)?;
    let uplo = cusolver::sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;

    let (a_ptr, _a_guard) = a.device_ptr_mut(&stream);
    let (info_ptr, _info_guard) = info.device_ptr_mut(&stream);
    let mut lwork: c_int = 0;
    ctx.bind_to_thread().map_err(drv)?;
    // SAFETY: host-side query on a valid n x n device matrix.
    unsafe { cusolver::sys::cusolverDnDpotrf_bufferSize(dn.cu(), uplo, ni, a_ptr as *mut f64, ni, &mut lwork) }
        .result()
        .map_err(solver)?;
    let lwork_len = usize::try_from(lwork.max(1))
        .map_err(|_| CudaKernelError::Solver(format!("negative workspace size {lwork}")))?;
    // SAFETY: scratch, written by cuSOLVER before being read.
    let mut ws = unsafe { stream.alloc::<f64>(lwork_len) }.map_err(drv)?;
    let (ws_ptr, _ws_guard) = ws.device_ptr_mut(&stream);

    let fill = || -> Result<(), CudaKernelError> {
        // SAFETY: `a` holds n * n f64.
        unsafe { launch_spd(&stream, &kernels.spd_tile, seed, n, 0, 0, n, n, a_ptr) }
    };
    let factor = || -> Result<(), CudaKernelError> {
        // SAFETY: a is n x n, ws holds lwork f64, info one int.
        unsafe {
            cusolver::sys::cusolverDnDpotrf(
                dn.cu(),
                uplo,
                ni,
                a_ptr as *mut f64,
                ni,
                ws_ptr as *mut f64,
                lwork,
                info_ptr as *mut c_int,
            )
        }
        .result()
        .map_err(solver)
    };
    let read_info = || -> Result<(), CudaKernelError> {
        let mut host: [c_int; 1] = [0];
        // SAFETY: copies one int from the live `info` allocation, then waits.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host[..], info_ptr, stream.cu_stream()) }
            .map_err(drv)?;
        stream.synchronize().map_err(drv)?;
        info_to_result(host[0])
    };

    // Untimed warm-up (lazy kernel loading, first-call setup), then refill.
    fill()?;
    factor()?;
    read_info()?;
    fill()?;
    stream.synchronize().map_err(drv)?;

    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags).map_err(drv)?;
    factor()?;
    let end = stream.record_event(flags).map_err(drv)?;
    let ms = start.elapsed_ms(&end).map_err(drv)?;
    read_info()?;
    let mut log_det = 0.0;
    for j in 0..n {
        let mut host = [0f64];
        let at = a_ptr + ((j * n + j) * 8) as u64;
        // SAFETY: element (j, j) of the live n x n allocation.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host[..], at, stream.cu_stream()) }.map_err(drv)?;
        stream.synchronize().map_err(drv)?;
        log_det += 2.0 * host[0].ln();
    }

    let seconds = f64::from(ms) / 1e3;
    let nf = n as f64;
    Ok(BaselineResult {
        n,
        seconds,
        gflops: nf * nf * nf / 3.0 / seconds / 1e9,
        log_det,
    })
}
