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
const KERNELS: &str = include_str!("kernels.cu");

/// Names of the `extern "C"` kernels in [`KERNELS`], in the order they are
/// loaded by `load_kernels`.
const KERNEL_NAMES: [&str; 9] = [
    "ferry_spd_tile",
    "ferry_potrf_epilogue",
    "ferry_jacobi_step",
    "ferry_copy_edges",
    "ferry_philox_noise",
    "ferry_philox_advance",
    "ferry_jacobi_interior",
    "ferry_jacobi_ring",
    "ferry_empty",
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
    empty: CudaFunction,
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
        empty: f(8)?,
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
    /// Launches a kernel that does nothing (one block of one thread): the cost of a GPU task
    /// with a launch and no work.
    ///
    /// # Errors
    /// `Driver` when the launch fails.
    pub fn empty(&mut self) -> Result<(), CudaKernelError> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.kernels.empty);
        // SAFETY: `ferry_empty()` takes no arguments and touches no memory.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

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

mod baseline;
mod dense;
mod grid;
mod mg_baseline;

pub use baseline::{cusolver_dpotrf_baseline, BaselineResult};
pub use mg_baseline::{cusolvermg_dpotrf_baseline, visible_devices, MgBaselineResult};

#[cfg(test)]
mod tests;
