//! The NVRTC kernels over tiles: the generated SPD tile, the stencil's Jacobi steps and halo
//! edges, vector updates, Philox noise and tile copies.

use super::*;
impl CudaTileKernels {
    /// Fills a column-major `rows × cols` tile of the generated SPD matrix
    /// whose top-left entry is global `(i0, j0)`:
    /// `out[r + c * rows] = spd_entry(seed, n_global, i0 + r, j0 + c)`,
    /// **bit-identical** to [`crate::spd::spd_tile`] (the NVRTC code is a
    /// line-by-line port of SplitMix64 and the 53-bit uniform mapping; a CPU
    /// mirror of it is unit-tested against [`crate::spd::spd_entry`]).
    ///
    /// Enqueued. An empty tile is a no-op.
    ///
    /// # Errors
    /// `Shape` if the tile is not inside the `n_global × n_global` matrix,
    /// `rows * cols` overflows, or `out` is null; `Driver` on launch failure.
    ///
    /// # Safety
    /// `out` must point to at least `rows * cols` `f64` of device memory of
    /// this context.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn spd_tile(
        &mut self,
        seed: u64,
        n_global: usize,
        i0: usize,
        j0: usize,
        rows: usize,
        cols: usize,
        out: u64,
    ) -> Result<(), CudaKernelError> {
        self.bind()?;
        // SAFETY: forwarded from the caller.
        unsafe {
            launch_spd(
                &self.stream,
                &self.kernels.spd_tile,
                seed,
                n_global,
                i0,
                j0,
                rows,
                cols,
                out,
            )
        }
    }

    /// One explicit 5-point Jacobi step on a **row-major** `rows × cols` tile,
    /// out of place, **bit-identical** to [`crate::stencil::jacobi_step`]:
    /// `out = u + alpha * (((n + s) + (w + e)) - 4.0 * u)` in that order, no
    /// FMA (the module is compiled with `--fmad=false`).
    ///
    /// * `u`, `out`: `rows × cols` row-major; must not overlap;
    /// * `north`, `south`: `cols` values (row above / below the tile);
    ///   `west`, `east`: `rows` values (column left / right). A **null**
    ///   (`0`) halo means zeros (Dirichlet boundary);
    /// * `alpha`: `κ Δt / h²` (stable for `≤ 1/4`; not checked).
    ///
    /// Enqueued. An empty tile is a no-op.
    ///
    /// # Errors
    /// `Shape` if `rows * cols` overflows, `u`/`out` is null, or `u` and
    /// `out` overlap; `Driver` on launch failure.
    ///
    /// # Safety
    /// Non-null pointers must reference device memory of this context of the
    /// stated lengths; halos must not overlap `out`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn jacobi_step(
        &mut self,
        rows: usize,
        cols: usize,
        alpha: f64,
        u: u64,
        north: u64,
        south: u64,
        west: u64,
        east: u64,
        out: u64,
    ) -> Result<(), CudaKernelError> {
        // SAFETY: the caller's contract; no edge outputs.
        unsafe { self.jacobi_step_edges(rows, cols, alpha, u, [north, south, west, east], out, [0; 4]) }
    }

    /// [`CudaTileKernels::jacobi_step`] fused with
    /// [`CudaTileKernels::copy_edges`] of the new values: `halos` are
    /// `[north, south, west, east]` as in `jacobi_step`, and the new first
    /// row, last row, first column and last column of `out` also go to the
    /// non-null `edges_out` arrays `[north_out, south_out, west_out,
    /// east_out]` (`cols`, `cols`, `rows`, `rows` values). One launch: a
    /// halo exchange's producer is one kernel shorter on the critical path,
    /// and the GPU manager makes one driver call fewer (≈ 3.4 µs on H200).
    ///
    /// Enqueued. An empty tile is a no-op.
    ///
    /// # Errors
    /// As [`CudaTileKernels::jacobi_step`].
    ///
    /// # Safety
    /// As [`CudaTileKernels::jacobi_step`] and [`CudaTileKernels::copy_edges`]; moreover no
    /// edge output may overlap `u` or a halo (one launch writes the edges while other threads
    /// still read those).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn jacobi_step_edges(
        &mut self,
        rows: usize,
        cols: usize,
        alpha: f64,
        u: u64,
        halos: [u64; 4],
        out: u64,
        edges_out: [u64; 4],
    ) -> Result<(), CudaKernelError> {
        tile_elems(rows, cols)?;
        let Some(cfg) = grid_2d(rows as u64, cols as u64) else {
            return Ok(());
        };
        non_null("u", u)?;
        non_null("out", out)?;
        disjoint("jacobi_step", u, out, tile_bytes(rows, cols)?)?;
        self.bind()?;
        let (r64, c64) = (dev_u64("rows", rows)?, dev_u64("cols", cols)?);
        let [north, south, west, east] = halos;
        let [no, so, wo, eo] = edges_out;
        let mut b = self.stream.launch_builder(&self.kernels.jacobi_step);
        b.arg(&r64)
            .arg(&c64)
            .arg(&alpha)
            .arg(&u)
            .arg(&north)
            .arg(&south)
            .arg(&west)
            .arg(&east)
            .arg(&out)
            .arg(&no)
            .arg(&so)
            .arg(&wo)
            .arg(&eo);
        // SAFETY: matches `ferry_jacobi_step`'s parameter list; lengths from
        // the caller.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// The interior part of [`CudaTileKernels::jacobi_step`]: the cells
    /// `1..rows-1 × 1..cols-1`, which read no halo (nothing when `rows` or
    /// `cols` < 3). With [`CudaTileKernels::jacobi_ring`] on the same `out` it
    /// gives exactly `jacobi_step`'s bits; split so that a tile's interior
    /// can run while its halos are still in transit.
    ///
    /// Enqueued.
    ///
    /// # Errors
    /// As [`CudaTileKernels::jacobi_step`].
    ///
    /// # Safety
    /// As [`CudaTileKernels::jacobi_step`].
    pub unsafe fn jacobi_interior(
        &mut self,
        rows: usize,
        cols: usize,
        alpha: f64,
        u: u64,
        out: u64,
    ) -> Result<(), CudaKernelError> {
        tile_elems(rows, cols)?;
        let Some(cfg) = grid_2d(rows.saturating_sub(2) as u64, cols.saturating_sub(2) as u64) else {
            return Ok(());
        };
        non_null("u", u)?;
        non_null("out", out)?;
        disjoint("jacobi_interior", u, out, tile_bytes(rows, cols)?)?;
        self.bind()?;
        let (r64, c64) = (dev_u64("rows", rows)?, dev_u64("cols", cols)?);
        let mut b = self.stream.launch_builder(&self.kernels.jacobi_interior);
        b.arg(&r64).arg(&c64).arg(&alpha).arg(&u).arg(&out);
        // SAFETY: matches `ferry_jacobi_interior`'s parameter list.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// The ring part of [`CudaTileKernels::jacobi_step`] (first and last rows
    /// and columns; every cell when `rows` or `cols` < 3), reading the halos,
    /// fused with [`CudaTileKernels::copy_edges`] of the new values into the
    /// non-null `*_out` arrays. One launch.
    ///
    /// Enqueued. An empty tile is a no-op.
    ///
    /// # Errors
    /// As [`CudaTileKernels::jacobi_step`].
    ///
    /// # Safety
    /// As [`CudaTileKernels::jacobi_step`] and [`CudaTileKernels::copy_edges`]; moreover no
    /// edge output may overlap `u` or a halo (as for [`CudaTileKernels::jacobi_step_edges`]).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn jacobi_ring(
        &mut self,
        rows: usize,
        cols: usize,
        alpha: f64,
        u: u64,
        halos: [u64; 4],
        out: u64,
        edges_out: [u64; 4],
    ) -> Result<(), CudaKernelError> {
        let all = tile_elems(rows, cols)?;
        let ring = if rows < 3 || cols < 3 {
            all
        } else {
            2 * cols as u64 + 2 * (rows as u64 - 2)
        };
        let Some(cfg) = grid_1d(ring) else {
            return Ok(());
        };
        non_null("u", u)?;
        non_null("out", out)?;
        disjoint("jacobi_ring", u, out, tile_bytes(rows, cols)?)?;
        self.bind()?;
        let (r64, c64) = (dev_u64("rows", rows)?, dev_u64("cols", cols)?);
        let [n, s, w, e] = halos;
        let [no, so, wo, eo] = edges_out;
        let mut b = self.stream.launch_builder(&self.kernels.jacobi_ring);
        b.arg(&r64)
            .arg(&c64)
            .arg(&alpha)
            .arg(&u)
            .arg(&n)
            .arg(&s)
            .arg(&w)
            .arg(&e)
            .arg(&out)
            .arg(&no)
            .arg(&so)
            .arg(&wo)
            .arg(&eo);
        // SAFETY: matches `ferry_jacobi_ring`'s parameter list.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// Copies the four edges of a **row-major** `rows × cols` tile in one
    /// kernel: first row → `north_out` (`cols` values), last row →
    /// `south_out` (`cols`), first column → `west_out` (`rows`), last column →
    /// `east_out` (`rows`). These are the halos the neighbours need (the
    /// tile's first row is the `south` halo of the tile above, and so on; see
    /// [`crate::stencil::copy_first_row`] and friends). A null output is
    /// skipped.
    ///
    /// Enqueued.
    ///
    /// # Errors
    /// `Shape` if `rows == 0` or `cols == 0` (there is no edge), the size
    /// overflows, or `u` is null; `Driver` on launch failure.
    ///
    /// # Safety
    /// `u` must reference `rows * cols` `f64` and each non-null output its
    /// stated length, all device memory of this context; outputs must not
    /// overlap `u` or each other.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_edges(
        &mut self,
        rows: usize,
        cols: usize,
        u: u64,
        north_out: u64,
        south_out: u64,
        west_out: u64,
        east_out: u64,
    ) -> Result<(), CudaKernelError> {
        tile_elems(rows, cols)?;
        if rows == 0 || cols == 0 {
            return Err(CudaKernelError::Shape(format!("a {rows} x {cols} tile has no edges")));
        }
        non_null("u", u)?;
        let Some(cfg) = grid_1d(dev_u64("max(rows, cols)", rows.max(cols))?) else {
            return Ok(());
        };
        self.bind()?;
        let (r64, c64) = (dev_u64("rows", rows)?, dev_u64("cols", cols)?);
        let mut b = self.stream.launch_builder(&self.kernels.copy_edges);
        b.arg(&r64)
            .arg(&c64)
            .arg(&u)
            .arg(&north_out)
            .arg(&south_out)
            .arg(&west_out)
            .arg(&east_out);
        // SAFETY: matches `ferry_copy_edges`'s parameter list.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// `y ← beta·y + x` over `n` `f64` (`cublasDscal_v2` then `cublasDaxpy_v2`, host pointer
    /// mode): element by element the same rounding as the CPU's `beta * y + x` when `beta` is a
    /// power of two (the scaling is exact, the addition rounds once).
    ///
    /// Enqueued. `n == 0` is a no-op.
    ///
    /// # Errors
    /// `Shape` if `n` does not fit `i32` or a pointer is null; `Blas` if cuBLAS rejects a call.
    ///
    /// # Safety
    /// `x` and `y` must reference `n` `f64` of device memory of this context and not overlap.
    pub unsafe fn scale_add(&mut self, n: usize, beta: f64, y: u64, x: u64) -> Result<(), CudaKernelError> {
        let ni = blas_int("n", n)?;
        if n == 0 {
            return Ok(());
        }
        non_null("x", x)?;
        non_null("y", y)?;
        disjoint("scale_add", x, y, dev_u64("bytes", n * 8)?)?;
        self.bind()?;
        let one = 1.0f64;
        // SAFETY: lengths as documented; host pointer mode (cudarc's default).
        unsafe {
            cublas::sys::cublasDscal_v2(*self.blas.handle(), ni, &beta, y as *mut f64, 1)
                .result()
                .map_err(blas)?;
            cublas::sys::cublasDaxpy_v2(*self.blas.handle(), ni, &one, x as *const f64, 1, y as *mut f64, 1)
                .result()
                .map_err(blas)
        }
    }

    /// Adds Philox4x32-10 noise to `count` `f64` at `out` and advances the generator state at
    /// `state` past them: the GPU twin of [`crate::rng::PhiloxState::add_noise`], bit for bit.
    /// Two launches on the stream (the noise, then a one-thread advance), so the state stays on
    /// the device.
    ///
    /// Enqueued. `count == 0` is a no-op.
    ///
    /// # Errors
    /// `Shape` if a pointer is null; `Driver` on launch failure.
    ///
    /// # Safety
    /// `state` must reference one [`crate::rng::PhiloxState`] (32 bytes) and `out` `count` `f64`,
    /// device memory of this context, not overlapping.
    pub unsafe fn philox_noise(
        &mut self,
        count: usize,
        amplitude: f64,
        state: u64,
        out: u64,
    ) -> Result<(), CudaKernelError> {
        let Some(cfg) = grid_1d(dev_u64("count", count)?) else {
            return Ok(());
        };
        non_null("state", state)?;
        non_null("out", out)?;
        self.bind()?;
        let n = dev_u64("count", count)?;
        let mut b = self.stream.launch_builder(&self.kernels.philox_noise);
        b.arg(&n).arg(&amplitude).arg(&state).arg(&out);
        // SAFETY: matches `ferry_philox_noise`'s parameter list; lengths from the caller.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        let one = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.kernels.philox_advance);
        b.arg(&n).arg(&state);
        // SAFETY: matches `ferry_philox_advance`'s parameter list.
        unsafe { b.launch(one) }.map_err(drv)?;
        Ok(())
    }

    /// Device-to-device copy of `bytes` bytes from `src` to `dst`
    /// (`cuMemcpyDtoDAsync` on the stream). Enqueued; `bytes == 0` is a no-op.
    ///
    /// # Errors
    /// `Shape` if a pointer is null or the ranges overlap; `Driver` if the
    /// copy cannot be enqueued.
    ///
    /// # Safety
    /// Both pointers must reference at least `bytes` bytes of device memory
    /// (of this context, or peer-accessible).
    pub unsafe fn copy_tile(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaKernelError> {
        if bytes == 0 {
            return Ok(());
        }
        non_null("dst", dst)?;
        non_null("src", src)?;
        disjoint("copy_tile", src, dst, dev_u64("bytes", bytes)?)?;
        self.bind()?;
        // SAFETY: forwarded from the caller.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(drv)
    }
}
