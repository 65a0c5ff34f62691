//! Tile kernels for ferry's examples.
//!
//! * [`tile`]: Cholesky tile kernels (POTRF, TRSM, SYRK, GEMM) over faer, plus
//!   the vector kernels of a tiled triangular solve and a dense baseline;
//! * [`stencil`]: the bit-reproducible 5-point explicit heat (Jacobi) update
//!   on row-major tiles with explicit halos, and an analytic eigenmode check;
//! * [`spd`]: a reproducible generated SPD matrix computable tile by tile;
//! * [`geo`]: Gaussian-process covariance tiles over GeoNames places and the
//!   Gaussian log-likelihood;
//! * [`rng`]: Philox4x32-10, a counter-based generator whose 32-byte state lives in a tile;
//! * [`fill`]: a batched fill of 32-bit words on the GPU (one launch for many buffers);
//! * [`links`]: link ceilings (peer copy, pinned host↔device) measured with the bare driver;
//! * [`error`]: [`KernelError`], returned by every fallible kernel;
//! * [`cuda`]: GPU versions of the tile, stencil and SPD kernels (cuBLAS,
//!   cuSOLVER and NVRTC through cudarc, loaded at run time), with their own
//!   error type [`cuda::CudaKernelError`].
//!
//! No public function panics on bad input: wrong slice lengths give
//! [`KernelError::Shape`], other bad arguments [`KernelError::InvalidArgument`].
//! All dense linear algebra runs single-threaded (`faer::Par::Seq`): the
//! parallelism comes from the task runtime executing many kernels at once.

#![warn(missing_docs)]

pub mod cuda;
pub mod error;
pub mod fill;
pub mod geo;
pub mod links;
pub mod rng;
pub mod spd;
pub mod stencil;
pub mod stencil_pair;
pub mod stencil_tiles;
pub mod tile;

pub use error::KernelError;
