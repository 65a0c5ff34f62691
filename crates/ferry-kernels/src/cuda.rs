//! GPU (CUDA) versions of the crate's tile kernels, over cudarc 0.19
//! (driver API, NVRTC, cuBLAS, cuSOLVER; all loaded dynamically at run time).
//!
//! Semantics match the CPU kernels of [`crate::tile`], [`crate::stencil`] and
//! [`crate::spd`]:
//! * Cholesky tiles ([`CudaTileKernels::potrf`], [`CudaTileKernels::trsm`],
//!   [`CudaTileKernels::syrk`], [`CudaTileKernels::gemm_nt`]) are `f64`,
//!   **column-major**, leading dimension = number of rows, lower convention,
//!   exactly like [`crate::tile`]. They agree with the CPU kernels to rounding
//!   (cuBLAS/cuSOLVER order their sums differently from faer), not bitwise;
//! * [`CudaTileKernels::spd_tile`] is **bit-identical** to
//!   [`crate::spd::spd_tile`] (integer hashing plus exact floating-point steps);
//! * [`CudaTileKernels::jacobi_step`] is **bit-identical** to
//!   [`crate::stencil::jacobi_step`] (same association order, no FMA
//!   contraction), on **row-major** tiles like [`crate::stencil`].
//!
//! # Device pointers and ordering
//! Every kernel method takes raw device pointers (`u64`, cudarc's
//! `CUdeviceptr`) and only **enqueues** work on the stream the
//! [`CudaTileKernels`] was built for: it returns before the GPU has run
//! anything, and errors detected by the GPU itself (bad pointers, a
//! non-positive pivot) surface later ([`CudaTileKernels::check_info`], or any
//! later synchronising call). Raw pointers bypass cudarc's per-buffer event
//! tracking, so ordering against other streams is the caller's job (events).
//!
//! # No panics
//! cudarc panics when a CUDA library cannot be loaded; every entry point here
//! first checks that the libraries it needs are present and returns an error
//! otherwise. Dimensions are converted to the `i32` that cuBLAS/cuSOLVER take
//! with checks ([`CudaKernelError::Shape`] on overflow).

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::cublas::{self, CudaBlas};
use cudarc::cusolver::{self, DnHandle};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileError, CompileOptions};

/// Every failure a CUDA kernel wrapper can report.
#[derive(Debug, thiserror::Error)]
pub enum CudaKernelError {
    /// The CUDA driver (or the driver library itself) failed: context, stream,
    /// allocation, module loading, kernel launch, copy, synchronisation.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// cuBLAS failed (handle creation, or a call returned a non-success status).
    #[error("cuBLAS error: {0}")]
    Blas(String),
    /// cuSOLVER failed (handle creation, buffer-size query, factorization
    /// status, or a negative `devInfo`, i.e. an invalid argument).
    #[error("cuSOLVER error: {0}")]
    Solver(String),
    /// NVRTC could not compile the kernel source (the message holds the log).
    #[error("NVRTC error: {0}")]
    Nvrtc(String),
    /// A Cholesky factorization met a non-positive (or NaN) pivot.
    #[error("matrix is not positive definite: non-positive pivot in column {column}")]
    NotPositiveDefinite {
        /// Zero-based column (within the tile or matrix) of the first bad pivot.
        column: usize,
    },
    /// Bad dimensions or pointers: a dimension that does not fit the `i32`
    /// cuBLAS/cuSOLVER take, a size that overflows, a tile outside its matrix,
    /// a null pointer where one is required, overlapping in/out buffers.
    #[error("shape error: {0}")]
    Shape(String),
}

use crate::links::drv;

fn blas(e: cublas::result::CublasError) -> CudaKernelError {
    CudaKernelError::Blas(format!("{e:?}"))
}

fn solver(e: cusolver::result::CusolverError) -> CudaKernelError {
    CudaKernelError::Solver(format!("{e:?}"))
}

pub(crate) fn nvrtc(e: CompileError) -> CudaKernelError {
    match e {
        CompileError::CompileError { nvrtc, options, log } => CudaKernelError::Nvrtc(format!(
            "{nvrtc:?} with options {options:?}; log:\n{}",
            log.to_string_lossy()
        )),
        other => CudaKernelError::Nvrtc(format!("{other:?}")),
    }
}

/// CUDA C source of the NVRTC kernels (compiled once per
/// [`CudaTileKernels::new`] / [`cusolver_dpotrf_baseline`] call).
///
/// All kernels are 1D grid-stride loops over `unsigned long long` indices, so
/// any grid size covers any tile; the host caps the grid (see `grid_1d`).
const KERNELS: &str = r#"
typedef unsigned long long u64;

// Line-by-line port of `crate::spd::splitmix64` (wrapping u64 arithmetic is
// the native behaviour of unsigned long long in C).
__device__ __forceinline__ u64 ferry_splitmix64(u64 x) {
    u64 z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Port of `crate::spd::uniform`: top 53 bits times 2^-53 (both exact).
__device__ __forceinline__ double ferry_uniform(u64 seed, u64 lo, u64 hi) {
    u64 h = ferry_splitmix64(ferry_splitmix64(ferry_splitmix64(seed) ^ lo) ^ hi);
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

// Port of `crate::spd::spd_entry`.
__device__ __forceinline__ double ferry_spd_entry(u64 seed, u64 n, u64 i, u64 j) {
    u64 lo = (i <= j) ? i : j;
    u64 hi = (i <= j) ? j : i;
    double u = ferry_uniform(seed, lo, hi);
    return (i == j) ? ((double)n + u) : (u - 0.5);
}

// Column-major rows x cols tile of the generated SPD matrix whose top-left
// entry is global (i0, j0): out[r + c * rows] = spd_entry(seed, n, i0 + r, j0 + c).
extern "C" __global__ void ferry_spd_tile(u64 seed, u64 n, u64 i0, u64 j0,
                                          u64 rows, u64 cols, double* out) {
    u64 total = rows * cols;
    u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 idx = (u64)blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < total; idx += stride) {
        u64 r = idx % rows;
        u64 c = idx / rows;
        out[idx] = ferry_spd_entry(seed, n, i0 + r, j0 + c);
    }
}

// After cusolverDnDpotrf on a column-major n x n tile: zero the strict upper
// triangle (the CPU potrf does; the tiled algorithm relies on it) and fold
// the devInfo of this factorization (info[0]) into the sticky first failure
// (info[1]) that check_info reads.
extern "C" __global__ void ferry_potrf_epilogue(u64 n, double* a, int* info) {
    u64 gid = (u64)blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (gid == 0) {
        int v = info[0];
        if (info[1] == 0 && v != 0) {
            info[1] = v;
        }
    }
    u64 total = n * n;
    u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 idx = gid; idx < total; idx += stride) {
        u64 i = idx % n;
        u64 j = idx / n;
        if (i < j) {
            a[idx] = 0.0;
        }
    }
}

// One explicit 5-point Jacobi step on a row-major rows x cols tile, out of
// place. Null halo pointers mean zeros (Dirichlet boundary). The update is
// written exactly as in crate::stencil::cell; compiled with --fmad=false.
// The new edges go to the non-null *_out arrays as in ferry_copy_edges (one
// launch instead of two: the step's edges are on the halo exchange's
// critical path).
extern "C" __global__ void ferry_jacobi_step(u64 rows, u64 cols, double alpha,
                                             const double* u,
                                             const double* north, const double* south,
                                             const double* west, const double* east,
                                             double* out,
                                             double* north_out, double* south_out,
                                             double* west_out, double* east_out) {
    // 2-D launch (grid_2d): y strides over rows, x over columns, so no cell pays a 64-bit
    // division for its coordinates.
    u64 cstride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        for (u64 c = (u64)blockIdx.x * (u64)blockDim.x + threadIdx.x; c < cols; c += cstride) {
            u64 idx = r * cols + c;
            double uc = u[idx];
            double n = (r == 0) ? (north ? north[c] : 0.0) : u[idx - cols];
            double s = (r + 1 == rows) ? (south ? south[c] : 0.0) : u[idx + cols];
            double w = (c == 0) ? (west ? west[r] : 0.0) : u[idx - 1];
            double e = (c + 1 == cols) ? (east ? east[r] : 0.0) : u[idx + 1];
            double v = uc + alpha * (((n + s) + (w + e)) - 4.0 * uc);
            out[idx] = v;
            if (r == 0 && north_out) north_out[c] = v;
            if (r + 1 == rows && south_out) south_out[c] = v;
            if (c == 0 && west_out) west_out[r] = v;
            if (c + 1 == cols && east_out) east_out[r] = v;
        }
    }
}

// The interior of ferry_jacobi_step: cells 1..rows-1 x 1..cols-1, which read
// no halo. The ring is left to ferry_jacobi_ring.
extern "C" __global__ void ferry_jacobi_interior(u64 rows, u64 cols, double alpha,
                                                 const double* u, double* out) {
    if (rows < 3 || cols < 3) return;
    // 2-D launch over the interior (grid_2d of rows-2 x cols-2), as in ferry_jacobi_step.
    u64 cstride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 r = 1 + blockIdx.y; r + 1 < rows; r += gridDim.y) {
        for (u64 c = 1 + (u64)blockIdx.x * (u64)blockDim.x + threadIdx.x; c + 1 < cols; c += cstride) {
            u64 idx = r * cols + c;
            double uc = u[idx];
            double n = u[idx - cols];
            double s = u[idx + cols];
            double w = u[idx - 1];
            double e = u[idx + 1];
            out[idx] = uc + alpha * (((n + s) + (w + e)) - 4.0 * uc);
        }
    }
}

// The ring of ferry_jacobi_step (first and last rows and columns; every cell
// when rows or cols < 3), with the halos, and the new edges written to the
// *_out arrays as in ferry_copy_edges (null outputs skipped).
extern "C" __global__ void ferry_jacobi_ring(u64 rows, u64 cols, double alpha,
                                             const double* u,
                                             const double* north, const double* south,
                                             const double* west, const double* east,
                                             double* out,
                                             double* north_out, double* south_out,
                                             double* west_out, double* east_out) {
    bool all = rows < 3 || cols < 3;
    u64 total = all ? rows * cols : 2 * cols + 2 * (rows - 2);
    u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 k = (u64)blockIdx.x * (u64)blockDim.x + threadIdx.x; k < total; k += stride) {
        u64 r, c;
        if (all) { r = k / cols; c = k % cols; }
        else if (k < cols) { r = 0; c = k; }
        else if (k < 2 * cols) { r = rows - 1; c = k - cols; }
        else { u64 m = k - 2 * cols; r = 1 + m / 2; c = (m % 2 == 0) ? 0 : cols - 1; }
        u64 idx = r * cols + c;
        double uc = u[idx];
        double n = (r == 0) ? (north ? north[c] : 0.0) : u[idx - cols];
        double s = (r + 1 == rows) ? (south ? south[c] : 0.0) : u[idx + cols];
        double w = (c == 0) ? (west ? west[r] : 0.0) : u[idx - 1];
        double e = (c + 1 == cols) ? (east ? east[r] : 0.0) : u[idx + 1];
        double v = uc + alpha * (((n + s) + (w + e)) - 4.0 * uc);
        out[idx] = v;
        if (r == 0 && north_out) north_out[c] = v;
        if (r + 1 == rows && south_out) south_out[c] = v;
        if (c == 0 && west_out) west_out[r] = v;
        if (c + 1 == cols && east_out) east_out[r] = v;
    }
}

// Edges of a row-major rows x cols tile (rows, cols >= 1): first row ->
// north_out (cols), last row -> south_out (cols), first column -> west_out
// (rows), last column -> east_out (rows). A null output is skipped.
extern "C" __global__ void ferry_copy_edges(u64 rows, u64 cols, const double* u,
                                            double* north_out, double* south_out,
                                            double* west_out, double* east_out) {
    u64 total = (rows > cols) ? rows : cols;
    u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 idx = (u64)blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < total; idx += stride) {
        if (idx < cols) {
            if (north_out) north_out[idx] = u[idx];
            if (south_out) south_out[idx] = u[(rows - 1) * cols + idx];
        }
        if (idx < rows) {
            if (west_out) west_out[idx] = u[idx * cols];
            if (east_out) east_out[idx] = u[idx * cols + (cols - 1)];
        }
    }
}

// Port of `crate::rng::philox4x32_10`.
__device__ __forceinline__ void ferry_philox(unsigned int c[4], unsigned int k0, unsigned int k1) {
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        u64 p0 = (u64)0xD2511F53u * (u64)c[0];
        u64 p1 = (u64)0xCD9E8D57u * (u64)c[2];
        unsigned int n0 = (unsigned int)(p1 >> 32) ^ c[1] ^ k0;
        unsigned int n1 = (unsigned int)p1;
        unsigned int n2 = (unsigned int)(p0 >> 32) ^ c[3] ^ k1;
        unsigned int n3 = (unsigned int)p0;
        c[0] = n0; c[1] = n1; c[2] = n2; c[3] = n3;
    }
}

// Port of `crate::rng::PhiloxState::add_noise` without the advance: out[k] +=
// amplitude * (u_k - 0.5), u_k from counter (position + k, stream) under the
// state's key. state = [key, position, stream, reserved].
extern "C" __global__ void ferry_philox_noise(u64 count, double amplitude, const u64* state, double* out) {
    u64 key = state[0], pos = state[1], stream = state[2];
    u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 idx = (u64)blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < count; idx += stride) {
        u64 n = pos + idx;
        unsigned int c[4] = {(unsigned int)n, (unsigned int)(n >> 32),
                             (unsigned int)stream, (unsigned int)(stream >> 32)};
        ferry_philox(c, (unsigned int)key, (unsigned int)(key >> 32));
        u64 bits = (((u64)c[0]) << 21) ^ (((u64)c[1]) >> 11);
        double u = (double)(bits & 0x1FFFFFFFFFFFFFULL) * (1.0 / 9007199254740992.0);
        out[idx] += amplitude * (u - 0.5);
    }
}

// The advance that follows ferry_philox_noise on the same stream.
extern "C" __global__ void ferry_philox_advance(u64 count, u64* state) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        state[1] += count;
    }
}
"#;

/// Names of the `extern "C"` kernels in [`KERNELS`], in the order they are
/// loaded by `load_kernels`.
const KERNEL_NAMES: [&str; 8] = [
    "ferry_spd_tile",
    "ferry_potrf_epilogue",
    "ferry_jacobi_step",
    "ferry_copy_edges",
    "ferry_philox_noise",
    "ferry_philox_advance",
    "ferry_jacobi_interior",
    "ferry_jacobi_ring",
];

/// Threads per block of every NVRTC kernel.
const BLOCK: u32 = 256;
/// Cap on the number of blocks; the kernels' grid-stride loops cover the rest.
const MAX_BLOCKS: u64 = 1 << 16;

/// The loaded NVRTC functions (each keeps its module alive).
#[derive(Debug, Clone)]
struct Kernels {
    spd_tile: CudaFunction,
    potrf_epilogue: CudaFunction,
    jacobi_step: CudaFunction,
    copy_edges: CudaFunction,
    philox_noise: CudaFunction,
    philox_advance: CudaFunction,
    jacobi_interior: CudaFunction,
    jacobi_ring: CudaFunction,
}

/// Returns an error (instead of cudarc's panic) if a CUDA library this module
/// loads lazily is missing. `driver` also checks `libcuda`.
fn require_libs(driver: bool) -> Result<(), CudaKernelError> {
    // SAFETY: each `is_culib_present` only tries `dlopen` on the candidate
    // names and closes what it opened; no CUDA function is called.
    unsafe {
        if driver && !cudarc::driver::sys::is_culib_present() {
            return Err(CudaKernelError::Driver(
                "the CUDA driver library (libcuda) was not found".into(),
            ));
        }
    }
    require_nvrtc()?;
    // SAFETY: as above.
    unsafe {
        if !cudarc::cublas::sys::is_culib_present() {
            return Err(CudaKernelError::Blas(
                "the cuBLAS library (libcublas) was not found".into(),
            ));
        }
        if !cudarc::cusolver::sys::is_culib_present() {
            return Err(CudaKernelError::Solver(
                "the cuSOLVER library (libcusolver) was not found".into(),
            ));
        }
    }
    Ok(())
}

/// An error (instead of cudarc's panic) if NVRTC cannot be loaded.
pub(crate) fn require_nvrtc() -> Result<(), CudaKernelError> {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and closes what it
    // opened; no NVRTC function is called.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaKernelError::Nvrtc(
            "the NVRTC library (libnvrtc) was not found".into(),
        ))
    }
}

/// NVRTC options: a virtual architecture matching the device, and
/// `--fmad=false`.
///
/// `--fmad=false` forbids contracting `a * b + c` into a fused multiply-add.
/// With contraction, `alpha * (...)` and `u + ...` of the Jacobi update could
/// become one FMA (one rounding instead of two), and `4.0 * uc` could fuse
/// into the subtraction, so the GPU bits would differ from the CPU kernel's
/// (Rust never contracts) and from run to run of different tilings.
pub(crate) fn compile_options(major: i32, minor: i32) -> CompileOptions {
    CompileOptions {
        fmad: Some(false),
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some("ferry_kernels.cu".into()),
        ..Default::default()
    }
}

/// Compiles [`KERNELS`] with NVRTC for the device of `ctx` and loads the
/// functions. The context must be bound to the calling thread.
fn load_kernels(ctx: &Arc<CudaContext>) -> Result<Kernels, CudaKernelError> {
    let (major, minor) = ctx.compute_capability().map_err(drv)?;
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, compile_options(major, minor)).map_err(nvrtc)?;
    let module = ctx.load_module(ptx).map_err(drv)?;
    let f = |i: usize| module.load_function(KERNEL_NAMES[i]).map_err(drv);
    Ok(Kernels {
        spd_tile: f(0)?,
        potrf_epilogue: f(1)?,
        jacobi_step: f(2)?,
        copy_edges: f(3)?,
        philox_noise: f(4)?,
        philox_advance: f(5)?,
        jacobi_interior: f(6)?,
        jacobi_ring: f(7)?,
    })
}

/// A dimension as the `i32` cuBLAS/cuSOLVER take, or `Shape` if it does not fit.
fn blas_int(what: &str, v: usize) -> Result<c_int, CudaKernelError> {
    c_int::try_from(v)
        .map_err(|_| CudaKernelError::Shape(format!("{what} = {v} does not fit in a 32-bit BLAS integer")))
}

/// `usize` to the `unsigned long long` the NVRTC kernels take.
fn dev_u64(what: &str, v: usize) -> Result<u64, CudaKernelError> {
    u64::try_from(v).map_err(|_| CudaKernelError::Shape(format!("{what} = {v} does not fit in 64 bits")))
}

/// Number of `f64` elements of a `rows × cols` tile, checked so that the byte
/// size (`8 ×` that) fits in `u64` (device address arithmetic).
fn tile_elems(rows: usize, cols: usize) -> Result<u64, CudaKernelError> {
    let e = dev_u64("rows", rows)?
        .checked_mul(dev_u64("cols", cols)?)
        .filter(|e| e.checked_mul(8).is_some())
        .ok_or_else(|| CudaKernelError::Shape(format!("a {rows} x {cols} tile of f64 overflows 64-bit sizes")))?;
    Ok(e)
}

/// Byte size of a `rows × cols` `f64` tile as `u64`.
fn tile_bytes(rows: usize, cols: usize) -> Result<u64, CudaKernelError> {
    // `tile_elems` guarantees the product by 8 does not overflow.
    Ok(tile_elems(rows, cols)? * 8)
}

/// `Shape` error if `ptr` is null.
fn non_null(what: &str, ptr: u64) -> Result<(), CudaKernelError> {
    if ptr == 0 {
        Err(CudaKernelError::Shape(format!("`{what}` is a null device pointer")))
    } else {
        Ok(())
    }
}

/// `Shape` error if the byte ranges `[a, a + len)` and `[b, b + len)` overlap.
fn disjoint(what: &str, a: u64, b: u64, len: u64) -> Result<(), CudaKernelError> {
    let overlap = len > 0 && a < b.saturating_add(len) && b < a.saturating_add(len);
    if overlap {
        Err(CudaKernelError::Shape(format!(
            "{what}: input and output buffers overlap"
        )))
    } else {
        Ok(())
    }
}

/// Checks that the tile `[i0, i0 + rows) × [j0, j0 + cols)` lies inside the
/// `n × n` matrix (the check of [`crate::spd::spd_tile`]).
fn check_spd_tile(n: usize, i0: usize, j0: usize, rows: usize, cols: usize) -> Result<(), CudaKernelError> {
    for (what, start, len) in [("row", i0, rows), ("column", j0, cols)] {
        match start.checked_add(len) {
            Some(end) if end <= n => {}
            _ => {
                return Err(CudaKernelError::Shape(format!(
                    "{what} range {start}..{start}+{len} exceeds the dimension {n}"
                )))
            }
        }
    }
    Ok(())
}

/// 1D launch configuration for a grid-stride kernel over `total` items, or
/// `None` when there is nothing to do.
fn grid_1d(total: u64) -> Option<LaunchConfig> {
    if total == 0 {
        return None;
    }
    let blocks = total.div_ceil(u64::from(BLOCK)).min(MAX_BLOCKS);
    // `blocks <= MAX_BLOCKS = 2^16`, so it fits in u32.
    let blocks = u32::try_from(blocks).unwrap_or(1 << 16);
    Some(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A 2-D launch over `rows × cols` cells for the kernels that loop `y` over rows and `x` over
/// columns (`ferry_jacobi_step`, `ferry_jacobi_interior`): one row per block row up to 65 535
/// (the grid's `y` limit; the loops stride past it), [`BLOCK`] threads across columns, at most
/// [`MAX_BLOCKS`] blocks in all (a tile narrower than [`BLOCK`] leaves threads idle). Their cells then need no 64-bit division for their
/// coordinates, which a 1-D grid-stride loop pays per cell. `None` when there is no cell.
fn grid_2d(rows: u64, cols: u64) -> Option<LaunchConfig> {
    if rows == 0 || cols == 0 {
        return None;
    }
    let y = rows.min(65_535);
    let x = cols.div_ceil(u64::from(BLOCK)).min((MAX_BLOCKS / y).max(1));
    Some(LaunchConfig {
        // Both fit in u32: y ≤ 65 535, x ≤ MAX_BLOCKS.
        grid_dim: (u32::try_from(x).unwrap_or(1), u32::try_from(y).unwrap_or(1), 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Maps a cuSOLVER `devInfo` to a result: `0` success, `i > 0` the leading
/// minor of order `i` is not positive definite (zero-based column `i − 1`),
/// `i < 0` the `−i`-th argument was invalid.
fn info_to_result(info: c_int) -> Result<(), CudaKernelError> {
    match info {
        0 => Ok(()),
        i if i > 0 => Err(CudaKernelError::NotPositiveDefinite {
            // i > 0, so i - 1 >= 0 and the conversion cannot fail.
            column: usize::try_from(i - 1).unwrap_or(0),
        }),
        i => Err(CudaKernelError::Solver(format!(
            "cusolverDnDpotrf reported invalid argument {} (devInfo = {i})",
            -i64::from(i)
        ))),
    }
}

/// Per-stream GPU tile kernels: the CUDA counterpart of [`crate::tile`],
/// [`crate::stencil`] and [`crate::spd`].
///
/// Holds, for one CUDA stream: a cuBLAS handle and a cuSOLVER dense handle
/// bound to that stream, the `potrf` device workspace (grown on demand), a
/// device `devInfo` pair, and the NVRTC-compiled helper kernels.
///
/// [`CudaTileKernels::new`] compiles the NVRTC module (tens of milliseconds)
/// and creates the library handles: create **one per execution stream, once,
/// and cache it**; never one per task. Methods take `&mut self`, so one value
/// is used by one thread at a time (it is `Send`); the CUDA context is bound
/// to the calling thread on every call.
///
/// All kernel methods are `unsafe`: they take raw device pointers (`u64`) that
/// the caller guarantees point to live device allocations of the stream's
/// context, large enough for the stated shapes, and not concurrently written
/// by other streams without ordering. They enqueue and return (no
/// synchronisation), except [`CudaTileKernels::check_info`].
#[derive(Debug)]
pub struct CudaTileKernels {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    dn: DnHandle,
    /// `potrf` workspace (`f64` elements), grown on demand.
    workspace: Option<CudaSlice<f64>>,
    /// `(n, lwork)` of the last buffer-size query.
    lwork_cache: Option<(usize, c_int)>,
    /// `[devInfo of the last potrf, first non-zero devInfo since check_info]`.
    info: CudaSlice<c_int>,
    kernels: Kernels,
}

impl CudaTileKernels {
    /// Builds the kernels for `stream`: checks that NVRTC, cuBLAS and
    /// cuSOLVER can be loaded, compiles and loads the NVRTC module for the
    /// stream's device (`--fmad=false`, `compute_XY` of the device), creates
    /// the cuBLAS and cuSOLVER handles bound to `stream`, and allocates the
    /// 2-int device `devInfo` (zeroed). Synchronous with respect to nothing on
    /// the GPU except that allocation.
    ///
    /// Cost: an NVRTC compilation per call, so create one per exec stream and
    /// cache it.
    ///
    /// # Errors
    /// `Nvrtc`, `Blas`, `Solver` if a library is missing or its setup fails
    /// (`Nvrtc` carries the compiler log); `Driver` for context/module/
    /// allocation failures.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, CudaKernelError> {
        require_libs(false)?;
        let ctx = stream.context().clone();
        ctx.bind_to_thread().map_err(drv)?;
        let kernels = load_kernels(&ctx)?;
        let blas = CudaBlas::new(stream.clone()).map_err(blas)?;
        let dn = DnHandle::new(stream.clone()).map_err(solver)?;
        let info = stream.alloc_zeros::<c_int>(2).map_err(drv)?;
        Ok(Self {
            stream,
            blas,
            dn,
            workspace: None,
            lwork_cache: None,
            info,
            kernels,
        })
    }

    /// The stream every method enqueues on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn bind(&self) -> Result<(), CudaKernelError> {
        self.stream.context().bind_to_thread().map_err(drv)
    }

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

/// Launches `ferry_spd_tile` (shared by [`CudaTileKernels::spd_tile`] and the
/// baseline). The context must be bound to the calling thread.
///
/// # Safety
/// `out` must reference `rows * cols` `f64` of device memory of `stream`'s
/// context.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_spd(
    stream: &CudaStream,
    f: &CudaFunction,
    seed: u64,
    n: usize,
    i0: usize,
    j0: usize,
    rows: usize,
    cols: usize,
    out: u64,
) -> Result<(), CudaKernelError> {
    check_spd_tile(n, i0, j0, rows, cols)?;
    let Some(cfg) = grid_1d(tile_elems(rows, cols)?) else {
        return Ok(());
    };
    non_null("out", out)?;
    let args = [
        dev_u64("n", n)?,
        dev_u64("i0", i0)?,
        dev_u64("j0", j0)?,
        dev_u64("rows", rows)?,
        dev_u64("cols", cols)?,
    ];
    let mut b = stream.launch_builder(f);
    b.arg(&seed)
        .arg(&args[0])
        .arg(&args[1])
        .arg(&args[2])
        .arg(&args[3])
        .arg(&args[4])
        .arg(&out);
    // SAFETY: matches `ferry_spd_tile(u64 x6, double*)`; length from the caller.
    unsafe { b.launch(cfg) }.map_err(drv)?;
    Ok(())
}

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
/// events (ms → s) and check its `devInfo`. Everything is freed on return.
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

    let seconds = f64::from(ms) / 1e3;
    let nf = n as f64;
    Ok(BaselineResult {
        n,
        seconds,
        gflops: nf * nf * nf / 3.0 / seconds / 1e9,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spd::{spd_entry, splitmix64};

    // CPU mirror of the CUDA C in `KERNELS`, line by line (C `unsigned long
    // long` arithmetic wraps, hence `wrapping_*`; `(double)x` of a u64 rounds
    // to nearest like Rust's `as f64`).

    /// Mirror of `ferry_splitmix64`.
    fn c_splitmix64(x: u64) -> u64 {
        let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15); // u64 z = x + 0x9E3779B97F4A7C15ULL;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9); // z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB); // z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        z ^ (z >> 31) // return z ^ (z >> 31);
    }

    /// Mirror of `ferry_uniform`.
    fn c_uniform(seed: u64, lo: u64, hi: u64) -> f64 {
        let h = c_splitmix64(c_splitmix64(c_splitmix64(seed) ^ lo) ^ hi);
        (h >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0) // (double)(h >> 11) * (1.0 / 9007199254740992.0)
    }

    /// Mirror of `ferry_spd_entry`.
    fn c_spd_entry(seed: u64, n: u64, i: u64, j: u64) -> f64 {
        let lo = if i <= j { i } else { j };
        let hi = if i <= j { j } else { i };
        let u = c_uniform(seed, lo, hi);
        if i == j {
            n as f64 + u
        } else {
            u - 0.5
        }
    }

    #[test]
    fn c_mirror_matches_spd_entry_bitwise() {
        let mut s = 0x1234_5678u64;
        let mut next = || {
            s = splitmix64(s);
            s
        };
        for k in 0..5000 {
            let seed = next();
            let n = (next() % 1_000_000) as usize + 1;
            let i = (next() % n as u64) as usize;
            // Every 4th sample on the diagonal.
            let j = if k % 4 == 0 { i } else { (next() % n as u64) as usize };
            let got = c_spd_entry(seed, n as u64, i as u64, j as u64);
            let want = spd_entry(seed, n, i, j);
            assert_eq!(got.to_bits(), want.to_bits(), "seed {seed} n {n} i {i} j {j}");
            assert_eq!(c_splitmix64(seed), splitmix64(seed));
        }
        // Huge indices too (spd_entry is defined for any indices).
        for &(i, j) in &[(usize::MAX, 0), (0, usize::MAX), (usize::MAX, usize::MAX)] {
            let got = c_spd_entry(7, u64::MAX, i as u64, j as u64);
            assert_eq!(got.to_bits(), spd_entry(7, usize::MAX, i, j).to_bits());
        }
        assert_eq!(
            (1.0f64 / 9_007_199_254_740_992.0).to_bits(),
            (1.0 / (1u64 << 53) as f64).to_bits()
        );
    }

    #[test]
    fn kernel_source_has_every_function_and_constant() {
        for name in KERNEL_NAMES {
            assert!(
                KERNELS.contains(&format!("extern \"C\" __global__ void {name}(")),
                "{name} missing from KERNELS"
            );
        }
        // The constants the CPU mirror uses appear verbatim in the C source.
        for lit in [
            "x + 0x9E3779B97F4A7C15ULL",
            "(z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL",
            "(z ^ (z >> 27)) * 0x94D049BB133111EBULL",
            "return z ^ (z >> 31);",
            "ferry_splitmix64(ferry_splitmix64(ferry_splitmix64(seed) ^ lo) ^ hi)",
            "(double)(h >> 11) * (1.0 / 9007199254740992.0)",
            "(i == j) ? ((double)n + u) : (u - 0.5)",
            "out[idx] = uc + alpha * (((n + s) + (w + e)) - 4.0 * uc);",
            "double v = uc + alpha * (((n + s) + (w + e)) - 4.0 * uc);",
        ] {
            assert!(KERNELS.contains(lit), "`{lit}` missing from KERNELS");
        }
        let opts = compile_options(9, 0);
        assert_eq!(opts.fmad, Some(false));
        assert_eq!(opts.options, vec!["--gpu-architecture=compute_90".to_string()]);
    }

    #[test]
    fn dimension_overflow_is_shape() {
        assert_eq!(blas_int("n", 0).unwrap(), 0);
        assert_eq!(blas_int("n", i32::MAX as usize).unwrap(), i32::MAX);
        assert!(matches!(
            blas_int("n", i32::MAX as usize + 1),
            Err(CudaKernelError::Shape(_))
        ));
        assert!(matches!(blas_int("n", usize::MAX), Err(CudaKernelError::Shape(_))));
        assert!(matches!(tile_elems(usize::MAX, 2), Err(CudaKernelError::Shape(_))));
        assert!(matches!(tile_elems(1 << 31, 1 << 30), Err(CudaKernelError::Shape(_))));
        assert_eq!(tile_elems(3, 4).unwrap(), 12);
        assert_eq!(tile_bytes(3, 4).unwrap(), 96);
        assert!(matches!(check_spd_tile(10, 9, 0, 2, 3), Err(CudaKernelError::Shape(_))));
        assert!(matches!(
            check_spd_tile(10, 0, usize::MAX, 2, 3),
            Err(CudaKernelError::Shape(_))
        ));
        check_spd_tile(10, 8, 7, 2, 3).unwrap();
        assert!(matches!(non_null("a", 0), Err(CudaKernelError::Shape(_))));
        assert!(matches!(disjoint("x", 100, 104, 8), Err(CudaKernelError::Shape(_))));
        disjoint("x", 100, 108, 8).unwrap();
        disjoint("x", 100, 100, 0).unwrap();
    }

    #[test]
    fn launch_grid_and_info_mapping() {
        assert!(grid_1d(0).is_none());
        let c = grid_1d(1).unwrap();
        assert_eq!((c.grid_dim, c.block_dim), ((1, 1, 1), (BLOCK, 1, 1)));
        assert_eq!(grid_1d(257).unwrap().grid_dim.0, 2);
        assert_eq!(grid_1d(u64::MAX).unwrap().grid_dim.0, 1 << 16);
        assert!(grid_2d(0, 5).is_none() && grid_2d(5, 0).is_none());
        assert_eq!(grid_2d(2046, 4094).unwrap().grid_dim, (16, 2046, 1));
        assert_eq!(grid_2d(1, 1 << 30).unwrap().grid_dim, (1 << 16, 1, 1));
        assert_eq!(grid_2d(1 << 20, 1 << 20).unwrap().grid_dim, (1, 65_535, 1));
        assert_eq!(grid_2d(4096, 4096).unwrap().grid_dim, (16, 4096, 1));
        info_to_result(0).unwrap();
        assert!(matches!(
            info_to_result(1),
            Err(CudaKernelError::NotPositiveDefinite { column: 0 })
        ));
        assert!(matches!(
            info_to_result(17),
            Err(CudaKernelError::NotPositiveDefinite { column: 16 })
        ));
        assert!(matches!(info_to_result(-3), Err(CudaKernelError::Solver(_))));
        assert!(matches!(info_to_result(i32::MIN), Err(CudaKernelError::Solver(_))));
    }
}
