//! The multi-GPU anchor of the distributed GPU Cholesky: NVIDIA's cuSOLVERMg `cusolverMgPotrf`
//! of the whole matrix over one or more GPUs of this process.
//!
//! cuSOLVERMg distributes the matrix in a 1D block-cyclic layout over columns: block column `jb`
//! (columns `jb·nb .. jb·nb + nb`) lives on device `jb mod d`, as local block `jb / d` of that
//! device's column-major array with leading dimension `n` (cuSOLVER documentation, "cuSolverMG:
//! multi-GPU LAPACK", the `cusolverMgCreateMatrixDesc` layout; NVIDIA's `cuSolverMg` samples use
//! the same allocation). The factorization runs inside one call, which returns when every device
//! is done.

use std::ffi::c_void;
use std::time::Instant;

use cudarc::cusolvermg::sys as mg;

use super::*;

/// Result of [`cusolvermg_dpotrf_baseline`].
#[derive(Debug, Clone, PartialEq)]
pub struct MgBaselineResult {
    /// Matrix order.
    pub n: usize,
    /// Column block size of the 1D block-cyclic layout.
    pub nb: usize,
    /// CUDA ordinals the matrix was spread over, in layout order.
    pub devices: Vec<usize>,
    /// Wall time of one `cusolverMgPotrf` call, in seconds (host clock around the call, which
    /// returns after every device has finished).
    pub seconds: f64,
    /// `n³ / 3 / seconds / 1e9`, in GFLOP/s.
    pub gflops: f64,
    /// `log det A = 2 Σ log L_jj` of the factor, read back from the devices: the check that
    /// the factorization computed the same matrix as ferry's tiled Cholesky.
    pub log_det: f64,
}

/// A cuSOLVERMg status as this crate's error.
fn mg_status(what: &str, s: mg::cusolverStatus_t) -> Result<(), CudaKernelError> {
    if s == mg::cusolverStatus_t::CUSOLVER_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(CudaKernelError::Solver(format!("{what}: {s:?}")))
    }
}

/// Destroys the cuSOLVERMg objects on every exit path.
struct MgObjects {
    handle: mg::cusolverMgHandle_t,
    grid: mg::cudaLibMgGrid_t,
    desc: mg::cudaLibMgMatrixDesc_t,
}

impl Drop for MgObjects {
    fn drop(&mut self) {
        // SAFETY: each object was created by the matching cusolverMgCreate* call (or is null)
        // and is destroyed once; the return codes carry nothing to act on during cleanup.
        unsafe {
            if !self.desc.is_null() {
                mg::cusolverMgDestroyMatrixDesc(self.desc);
            }
            if !self.grid.is_null() {
                mg::cusolverMgDestroyGrid(self.grid);
            }
            if !self.handle.is_null() {
                mg::cusolverMgDestroy(self.handle);
            }
        }
    }
}

/// One device's share of the matrix and of the workspace.
struct DeviceShare {
    ordinal: usize,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    a: CudaSlice<f64>,
    work: Option<CudaSlice<f64>>,
}

/// The multi-GPU anchor: one `cusolverMgPotrf` (lower) of the `n × n` generated SPD matrix
/// ([`crate::spd::spd_entry`] with `seed`, the matrix ferry's `cholesky` factors) spread over
/// `devices` in column blocks of `nb`.
///
/// Steps: a context, stream and NVRTC module per device; per device, `⌈⌈n/nb⌉ / d⌉ · nb`
/// columns of `n` f64 (`8 n` bytes a column) filled block column by block column with the
/// `ferry_spd_tile` kernel; peer access enabled between every pair of devices (cuSOLVERMg
/// requires it and fails otherwise); the workspace queried and allocated on every device; one
/// **untimed warm-up** factorization and a refill; then one timed factorization and the log
/// determinant read back from the diagonal (`n` copies of 8 bytes).
///
/// # Errors
/// `Shape` if `devices` is empty or repeats an ordinal, `n` or `nb` is 0 or does not fit `i32`;
/// `Driver` if a device is absent, peer access cannot be enabled, or an allocation fails
/// (out of memory); `Solver` if cuSOLVER or cuSOLVERMg (`libcusolverMg`) is missing or a call
/// fails; `NotPositiveDefinite` if `info` reports a bad pivot (it cannot for this matrix, which
/// is strictly diagonally dominant).
pub fn cusolvermg_dpotrf_baseline(
    devices: &[usize],
    n: usize,
    nb: usize,
    seed: u64,
) -> Result<MgBaselineResult, CudaKernelError> {
    if devices.is_empty() {
        return Err(CudaKernelError::Shape("cuSOLVERMg needs at least one device".into()));
    }
    for (k, d) in devices.iter().enumerate() {
        if devices[..k].contains(d) {
            return Err(CudaKernelError::Shape(format!("device {d} is listed twice")));
        }
    }
    if n == 0 || nb == 0 {
        return Err(CudaKernelError::Shape(format!("n = {n}, nb = {nb}: both must be >= 1")));
    }
    let ni = blas_int("n", n)?;
    blas_int("nb", nb)?;
    let dev_ids: Vec<i32> = devices
        .iter()
        .map(|&d| i32::try_from(d).map_err(|_| CudaKernelError::Shape(format!("device ordinal {d}"))))
        .collect::<Result<_, _>>()?;
    require_libs(true)?;
    // SAFETY: only tries dlopen on the candidate names; no cuSOLVERMg function is called.
    if !unsafe { mg::is_culib_present() } {
        return Err(CudaKernelError::Solver(
            "the cuSOLVERMg library (libcusolverMg) was not found".into(),
        ));
    }
    let nd = devices.len();
    let blocks = n.div_ceil(nb);
    let local_cols = blocks.div_ceil(nd) * nb;
    let local_elems = local_cols
        .checked_mul(n)
        .ok_or_else(|| CudaKernelError::Shape(format!("n = {n}: a device's share overflows usize")))?;

    let mut shares = Vec::with_capacity(nd);
    for &ordinal in devices {
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        let stream = ctx.new_stream().map_err(drv)?;
        let kernels = load_kernels(&ctx)?;
        // SAFETY: every owned block column is written by the spd kernel before any read; the
        // padding columns past the last block are never read.
        let a = unsafe { stream.alloc::<f64>(local_elems) }.map_err(drv)?;
        shares.push(DeviceShare {
            ordinal,
            stream,
            kernels,
            a,
            work: None,
        });
    }
    enable_peer_access(&shares)?;

    let fill = |shares: &mut [DeviceShare]| -> Result<(), CudaKernelError> {
        for jb in 0..blocks {
            let s = &mut shares[jb % nd];
            let (j0, w) = (jb * nb, nb.min(n - jb * nb));
            let (ptr, _g) = s.a.device_ptr_mut(&s.stream);
            let out = ptr + ((jb / nd) * nb * n * 8) as u64;
            // SAFETY: the local block `jb / nd` holds `nb · n` f64 from `out`.
            unsafe { launch_spd(&s.stream, &s.kernels.spd_tile, seed, n, 0, j0, n, w, out)? };
        }
        for s in shares.iter() {
            s.stream.synchronize().map_err(drv)?;
        }
        Ok(())
    };
    fill(&mut shares)?;

    let mut objs = MgObjects {
        handle: std::ptr::null_mut(),
        grid: std::ptr::null_mut(),
        desc: std::ptr::null_mut(),
    };
    let mut ids = dev_ids.clone();
    // SAFETY: out-pointers to live locals; `ids` outlives the calls that read it.
    unsafe {
        mg_status("cusolverMgCreate", mg::cusolverMgCreate(&mut objs.handle))?;
        mg_status(
            "cusolverMgDeviceSelect",
            mg::cusolverMgDeviceSelect(objs.handle, nd as i32, ids.as_mut_ptr()),
        )?;
        mg_status(
            "cusolverMgCreateDeviceGrid",
            mg::cusolverMgCreateDeviceGrid(
                &mut objs.grid,
                1,
                nd as i32,
                dev_ids.as_ptr(),
                mg::cusolverMgGridMapping_t::CUDALIBMG_GRID_MAPPING_COL_MAJOR,
            ),
        )?;
        mg_status(
            "cusolverMgCreateMatrixDesc",
            mg::cusolverMgCreateMatrixDesc(
                &mut objs.desc,
                n as i64,
                n as i64,
                n as i64,
                nb as i64,
                mg::cudaDataType::CUDA_R_64F,
                objs.grid,
            ),
        )?;
    }
    let mut a_ptrs: Vec<*mut c_void> = shares
        .iter_mut()
        .map(|s| {
            let (p, _g) = s.a.device_ptr_mut(&s.stream);
            p as *mut c_void
        })
        .collect();
    let uplo = mg::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;
    let mut lwork: i64 = 0;
    // SAFETY: `a_ptrs` holds one live device allocation per selected device, laid out as the
    // descriptor says.
    unsafe {
        mg_status(
            "cusolverMgPotrf_bufferSize",
            mg::cusolverMgPotrf_bufferSize(
                objs.handle,
                uplo,
                ni,
                a_ptrs.as_mut_ptr(),
                1,
                1,
                objs.desc,
                mg::cudaDataType::CUDA_R_64F,
                &mut lwork,
            ),
        )?;
    }
    let lwork_len = usize::try_from(lwork.max(1))
        .map_err(|_| CudaKernelError::Solver(format!("negative workspace size {lwork}")))?;
    for s in shares.iter_mut() {
        // SAFETY: scratch, written by cuSOLVERMg before being read.
        s.work = Some(unsafe { s.stream.alloc::<f64>(lwork_len) }.map_err(drv)?);
    }
    let mut work_ptrs: Vec<*mut c_void> = shares
        .iter_mut()
        .map(|s| {
            let w = s.work.as_mut().expect("allocated above");
            let (p, _g) = w.device_ptr_mut(&s.stream);
            p as *mut c_void
        })
        .collect();

    let mut factor = || -> Result<(), CudaKernelError> {
        let mut info: i32 = 0;
        // SAFETY: matrix and workspace pointers are live allocations of the sizes declared.
        unsafe {
            mg_status(
                "cusolverMgPotrf",
                mg::cusolverMgPotrf(
                    objs.handle,
                    uplo,
                    ni,
                    a_ptrs.as_mut_ptr(),
                    1,
                    1,
                    objs.desc,
                    mg::cudaDataType::CUDA_R_64F,
                    work_ptrs.as_mut_ptr(),
                    lwork,
                    &mut info,
                ),
            )?;
        }
        info_to_result(info)
    };
    // Untimed warm-up (cuSOLVERMg loads its kernels and sets up its streams on first use).
    factor()?;
    fill(&mut shares)?;
    let t0 = Instant::now();
    factor()?;
    for s in shares.iter() {
        s.stream.synchronize().map_err(drv)?;
    }
    let seconds = t0.elapsed().as_secs_f64();

    let mut log_det = 0.0;
    for j in 0..n {
        let jb = j / nb;
        let s = &mut shares[jb % nd];
        s.stream.context().bind_to_thread().map_err(drv)?;
        let (ptr, _g) = s.a.device_ptr_mut(&s.stream);
        let at = ptr + ((((jb / nd) * nb + (j - jb * nb)) * n + j) * 8) as u64;
        let mut host = [0f64];
        // SAFETY: `at` is inside the device's share (column < local_cols, row < n).
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host[..], at, s.stream.cu_stream()) }.map_err(drv)?;
        s.stream.synchronize().map_err(drv)?;
        log_det += 2.0 * host[0].ln();
    }
    drop(objs);
    let nf = n as f64;
    Ok(MgBaselineResult {
        n,
        nb,
        devices: shares.iter().map(|s| s.ordinal).collect(),
        seconds,
        gflops: nf * nf * nf / 3.0 / seconds / 1e9,
        log_det,
    })
}

/// Enables peer access from every device's context to every other's (a no-op for one device).
fn enable_peer_access(shares: &[DeviceShare]) -> Result<(), CudaKernelError> {
    use cudarc::driver::sys;
    for a in shares {
        a.stream.context().bind_to_thread().map_err(drv)?;
        for b in shares {
            if a.ordinal == b.ordinal {
                continue;
            }
            // SAFETY: both contexts are live primary contexts; the current one is `a`'s.
            let r = unsafe { sys::cuCtxEnablePeerAccess(b.stream.context().cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                return Err(CudaKernelError::Driver(format!(
                    "peer access from GPU {} to GPU {}: {r:?}",
                    a.ordinal, b.ordinal
                )));
            }
        }
    }
    Ok(())
}

/// Number of CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`).
///
/// # Errors
/// `Driver` if libcuda is missing or `cuDeviceGetCount` fails.
pub fn visible_devices() -> Result<usize, CudaKernelError> {
    require_libs(true)?;
    let n = CudaContext::device_count().map_err(drv)?;
    usize::try_from(n).map_err(|_| CudaKernelError::Driver(format!("cuDeviceGetCount returned {n}")))
}
