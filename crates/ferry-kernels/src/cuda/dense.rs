//! The dense tile kernels of the Cholesky on cuBLAS and cuSOLVER: `potrf`, `trsm`, `syrk`,
//! `gemm_nt`, and the check of `potrf`'s `devInfo`.

use super::*;
impl CudaTileKernels {
    /// In-place lower Cholesky factorization of one `n × n` column-major tile
    /// (`cusolverDnDpotrf`, `CUBLAS_FILL_MODE_LOWER`, `lda = n`), then the
    /// strict upper triangle is set to zero (as [`crate::tile::potrf`] does).
    ///
    /// * `a`: device pointer to `n × n` `f64`; only the lower triangle is read;
    ///   on success it holds exactly `L`.
    ///
    /// Enqueued, not waited for. The factorization's `devInfo` stays on the
    /// device: a non-positive pivot is **not** reported here but by the next
    /// [`CudaTileKernels::check_info`] (which costs a stream synchronisation;
    /// call it when the result matters, e.g. once after a whole
    /// factorization). `n == 0` is a no-op.
    ///
    /// The first call for a given `n` queries the workspace size (host call)
    /// and may grow the device workspace (a stream-ordered allocation).
    ///
    /// # Errors
    /// `Shape` if `n` does not fit `i32` or `a` is null; `Solver` if
    /// cuSOLVER rejects the call; `Driver` if the workspace allocation or the
    /// epilogue kernel launch fails.
    ///
    /// # Safety
    /// `a` must point to at least `n * n` `f64` of device memory of this
    /// stream's context, not accessed concurrently by other streams.
    pub unsafe fn potrf(&mut self, n: usize, a: u64) -> Result<(), CudaKernelError> {
        let ni = blas_int("n", n)?;
        let total = tile_elems(n, n)?;
        if n == 0 {
            return Ok(());
        }
        non_null("a", a)?;
        self.bind()?;
        let uplo = cusolver::sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;
        let lwork = match self.lwork_cache {
            Some((cn, lw)) if cn == n => lw,
            _ => {
                let mut lw: c_int = 0;
                // SAFETY: host-side query; `a` is a valid n x n device tile.
                unsafe {
                    cusolver::sys::cusolverDnDpotrf_bufferSize(self.dn.cu(), uplo, ni, a as *mut f64, ni, &mut lw)
                }
                .result()
                .map_err(solver)?;
                self.lwork_cache = Some((n, lw));
                lw
            }
        };
        let need = usize::try_from(lwork.max(1))
            .map_err(|_| CudaKernelError::Solver(format!("negative workspace size {lwork}")))?;
        let grow = self.workspace.as_ref().is_none_or(|w| w.len() < need);
        if grow {
            // Dropping the old workspace frees it in stream order (or after a
            // stream synchronisation without memory pools), so a potrf still
            // queued on it is safe.
            self.workspace = None;
            // SAFETY: the workspace is scratch; cuSOLVER never reads it
            // before writing.
            self.workspace = Some(unsafe { self.stream.alloc::<f64>(need) }.map_err(drv)?);
        }
        let Some(ws) = self.workspace.as_mut() else {
            return Err(CudaKernelError::Driver("potrf workspace missing".into()));
        };
        let (ws_ptr, _ws_guard) = ws.device_ptr_mut(&self.stream);
        let (info_ptr, _info_guard) = self.info.device_ptr_mut(&self.stream);
        // SAFETY: `a` is n x n (caller), `ws` holds >= lwork f64, `info` >= 1 int.
        unsafe {
            cusolver::sys::cusolverDnDpotrf(
                self.dn.cu(),
                uplo,
                ni,
                a as *mut f64,
                ni,
                ws_ptr as *mut f64,
                lwork,
                info_ptr as *mut c_int,
            )
        }
        .result()
        .map_err(solver)?;
        let n64 = dev_u64("n", n)?;
        if let Some(cfg) = grid_1d(total) {
            let mut b = self.stream.launch_builder(&self.kernels.potrf_epilogue);
            b.arg(&n64).arg(&a).arg(&info_ptr);
            // SAFETY: matches `ferry_potrf_epilogue(u64, double*, int*)`;
            // `a` has n * n elements, `info` 2 ints.
            unsafe { b.launch(cfg) }.map_err(drv)?;
        }
        Ok(())
    }

    /// Synchronises the stream, then reports the first non-zero `devInfo` of
    /// the [`CudaTileKernels::potrf`] calls enqueued since the previous
    /// `check_info` (and resets it).
    ///
    /// This is the only way `potrf` failures are seen, and it costs a full
    /// stream synchronisation: call it when you need the answer (e.g. once at
    /// the end of a factorization, or before using a factor).
    ///
    /// # Errors
    /// `NotPositiveDefinite { column }` (zero-based column within the tile
    /// that failed) if some potrf met a non-positive pivot; `Solver` for a
    /// negative `devInfo`; `Driver` if the synchronisation or copy fails (this
    /// also reports asynchronous errors of earlier work on the stream).
    pub fn check_info(&mut self) -> Result<(), CudaKernelError> {
        self.bind()?;
        let mut host: [c_int; 2] = [0; 2];
        self.stream.memcpy_dtoh(&self.info, &mut host[..]).map_err(drv)?;
        self.stream.synchronize().map_err(drv)?;
        if host[1] != 0 {
            self.stream.memset_zeros(&mut self.info).map_err(drv)?;
        }
        info_to_result(host[1])
    }

    /// Triangular solve from the right with a transposed lower factor
    /// (`cublasDtrsm_v2`, side R, lower, trans T, non-unit, `alpha = 1`):
    /// `B ← B · L⁻ᵀ`, as [`crate::tile::trsm`].
    ///
    /// * `l`: `n × n` column-major lower factor (`lda = n`; only the lower
    ///   triangle is read);
    /// * `b`: `m × n` column-major (`ldb = m`), overwritten.
    ///
    /// Enqueued. `m == 0` or `n == 0` is a no-op.
    ///
    /// # Errors
    /// `Shape` if a dimension does not fit `i32` or a pointer is null;
    /// `Blas` if cuBLAS rejects the call.
    ///
    /// # Safety
    /// `l` and `b` must point to device memory of this context holding at
    /// least `n * n` and `m * n` `f64`; `b` must not overlap `l`.
    pub unsafe fn trsm(&mut self, m: usize, n: usize, l: u64, b: u64) -> Result<(), CudaKernelError> {
        let (mi, ni) = (blas_int("m", m)?, blas_int("n", n)?);
        if m == 0 || n == 0 {
            return Ok(());
        }
        non_null("l", l)?;
        non_null("b", b)?;
        self.bind()?;
        let one = 1.0f64;
        // SAFETY: shapes as documented; host pointer mode (cudarc's default).
        unsafe {
            cublas::sys::cublasDtrsm_v2(
                *self.blas.handle(),
                cublas::sys::cublasSideMode_t::CUBLAS_SIDE_RIGHT,
                cublas::sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cublas::sys::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                mi,
                ni,
                &one,
                l as *const f64,
                ni,
                b as *mut f64,
                mi,
            )
        }
        .result()
        .map_err(blas)
    }

    /// Symmetric rank-k update of a lower triangle (`cublasDsyrk_v2`, lower,
    /// trans N, `alpha = −1`, `beta = 1`): `C ← C − A·Aᵀ`, as
    /// [`crate::tile::syrk`]; the strict upper triangle of `C` is untouched.
    ///
    /// * `a`: `n × k` column-major (`lda = n`);
    /// * `c`: `n × n` column-major (`ldc = n`).
    ///
    /// Enqueued. `n == 0` or `k == 0` is a no-op.
    ///
    /// # Errors
    /// `Shape` if a dimension does not fit `i32` or a pointer is null;
    /// `Blas` if cuBLAS rejects the call.
    ///
    /// # Safety
    /// `a` and `c` must point to device memory of this context holding at
    /// least `n * k` and `n * n` `f64`; they must not overlap.
    pub unsafe fn syrk(&mut self, n: usize, k: usize, a: u64, c: u64) -> Result<(), CudaKernelError> {
        let (ni, ki) = (blas_int("n", n)?, blas_int("k", k)?);
        if n == 0 || k == 0 {
            return Ok(());
        }
        non_null("a", a)?;
        non_null("c", c)?;
        self.bind()?;
        let (alpha, beta) = (-1.0f64, 1.0f64);
        // SAFETY: shapes as documented; host pointer mode.
        unsafe {
            cublas::sys::cublasDsyrk_v2(
                *self.blas.handle(),
                cublas::sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                ki,
                &alpha,
                a as *const f64,
                ni,
                &beta,
                c as *mut f64,
                ni,
            )
        }
        .result()
        .map_err(blas)
    }

    /// General update with the second operand transposed (`cublasDgemm_v2`,
    /// N, T, `alpha = −1`, `beta = 1`): `C ← C − A·Bᵀ`, as
    /// [`crate::tile::gemm_nt`].
    ///
    /// * `a`: `m × k` column-major (`lda = m`);
    /// * `b`: `n × k` column-major (`ldb = n`);
    /// * `c`: `m × n` column-major (`ldc = m`).
    ///
    /// Enqueued. Any zero dimension is a no-op.
    ///
    /// # Errors
    /// `Shape` if a dimension does not fit `i32` or a pointer is null;
    /// `Blas` if cuBLAS rejects the call.
    ///
    /// # Safety
    /// The pointers must reference device memory of this context holding at
    /// least `m * k`, `n * k` and `m * n` `f64`; `c` must not overlap `a`/`b`.
    pub unsafe fn gemm_nt(
        &mut self,
        m: usize,
        n: usize,
        k: usize,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<(), CudaKernelError> {
        let (mi, ni, ki) = (blas_int("m", m)?, blas_int("n", n)?, blas_int("k", k)?);
        if m == 0 || n == 0 || k == 0 {
            return Ok(());
        }
        non_null("a", a)?;
        non_null("b", b)?;
        non_null("c", c)?;
        self.bind()?;
        let (alpha, beta) = (-1.0f64, 1.0f64);
        // SAFETY: shapes as documented; host pointer mode.
        unsafe {
            cublas::sys::cublasDgemm_v2(
                *self.blas.handle(),
                cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                mi,
                ni,
                ki,
                &alpha,
                a as *const f64,
                mi,
                b as *const f64,
                ni,
                &beta,
                c as *mut f64,
                mi,
            )
        }
        .result()
        .map_err(blas)
    }
}
