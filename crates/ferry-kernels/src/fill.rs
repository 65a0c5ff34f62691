//! A batched fill of 32-bit words on the GPU: one kernel launch writes up to [`MAX_FILLS`]
//! buffers, each with its own value — what a producer that writes several tiles at once costs
//! in one launch, where `cuMemsetD32Async` costs a driver call (and the driver's locks) per
//! buffer. The `transfer` benchmark's per-round stamp uses it, and its sink checks what arrived
//! with [`count_mismatches_u32`] (the same table, compared instead of written).
//!
//! The kernels are compiled with NVRTC once per CUDA context (on first use there) and cached
//! for the process; they need NVRTC only, not cuBLAS or cuSOLVER.

use crate::cuda::{compile_options, nvrtc, require_nvrtc, CudaKernelError};
use crate::links::drv;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::{Arc, Mutex};

/// Buffers one [`fill_u32`] launch fills at most (the table travels in the kernel's parameters:
/// 16 × 24 bytes).
pub const MAX_FILLS: usize = 16;

/// Threads per block.
const THREADS: u32 = 256;

/// Most blocks per buffer (each thread then loops over the rest).
const MAX_BLOCKS: u64 = 1024;

/// CUDA C of the fill kernel: buffer `blockIdx.y` of the table gets its value in each of its
/// words (a grid-stride loop over x).
const KERNEL: &str = r#"
typedef unsigned long long u64;
struct ferry_fill { u64 ptr; u64 words; u64 value; };
struct ferry_fills { struct ferry_fill f[16]; };
extern "C" __global__ void ferry_fill_u32(struct ferry_fills t, u64 n) {
    u64 k = blockIdx.y;
    if (k >= n) return;
    unsigned int* p = (unsigned int*)t.f[k].ptr;
    unsigned int v = (unsigned int)t.f[k].value;
    u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 i = (u64)blockIdx.x * (u64)blockDim.x + threadIdx.x; i < t.f[k].words; i += stride) {
        p[i] = v;
    }
}
extern "C" __global__ void ferry_count_mismatches_u32(struct ferry_fills t, u64 n, unsigned int* count) {
    u64 k = blockIdx.x;
    if (k >= n || threadIdx.x != 0 || t.f[k].words == 0) return;
    const volatile unsigned int* p = (const unsigned int*)t.f[k].ptr;
    unsigned int v = (unsigned int)t.f[k].value;
    u64 w = t.f[k].words;
    if (p[0] != v || p[w / 2] != v || p[w - 1] != v) atomicAdd(count, 1u);
}
"#;

/// The kernel's table, laid out as `struct ferry_fills`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Table {
    f: [[u64; 3]; MAX_FILLS],
}

// SAFETY: plain old data with the layout of `struct ferry_fills` (16 × (ptr, words, value)).
unsafe impl DeviceRepr for Table {}

/// The loaded kernels (fill, count) of each context that has used them (keyed by the
/// context's driver handle).
type Kernels = (CudaFunction, CudaFunction);
static LOADED: Mutex<Vec<(usize, Kernels)>> = Mutex::new(Vec::new());

/// The kernels of `ctx`, compiled and loaded on first use.
fn kernels(ctx: &Arc<CudaContext>) -> Result<Kernels, CudaKernelError> {
    let key = ctx.cu_ctx() as usize;
    let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, f)) = loaded.iter().find(|(k, _)| *k == key) {
        return Ok(f.clone());
    }
    require_nvrtc()?;
    let (major, minor) = ctx.compute_capability().map_err(drv)?;
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNEL, compile_options(major, minor)).map_err(nvrtc)?;
    let m = ctx.load_module(ptx).map_err(drv)?;
    let f = (
        m.load_function("ferry_fill_u32").map_err(drv)?,
        m.load_function("ferry_count_mismatches_u32").map_err(drv)?,
    );
    loaded.push((key, f.clone()));
    Ok(f)
}

/// The table of `(ptr, words, value)` entries for one launch, the number of non-empty ones and
/// the longest.
fn table(entries: &[(u64, usize, u32)]) -> Result<(Table, u64, u64), CudaKernelError> {
    if entries.len() > MAX_FILLS {
        return Err(CudaKernelError::Shape(format!(
            "{} buffers in one launch (at most {MAX_FILLS})",
            entries.len()
        )));
    }
    let mut t = Table { f: [[0; 3]; MAX_FILLS] };
    let (mut n, mut longest) = (0usize, 0u64);
    for &(ptr, words, value) in entries.iter().filter(|f| f.1 > 0) {
        if ptr == 0 {
            return Err(CudaKernelError::Shape("a null device pointer".into()));
        }
        let words = words as u64;
        t.f[n] = [ptr, words, u64::from(value)];
        longest = longest.max(words);
        n += 1;
    }
    Ok((t, n as u64, longest))
}

/// Adds to the 32-bit counter at device address `count` the number of buffers of `checks` —
/// `(ptr, words, value)` as for [`fill_u32`] — whose first, middle or last word is not `value`,
/// in one kernel launch on `stream` (what a consumer checks of tiles a [`fill_u32`] stamped:
/// a transfer that raced the next stamp, or moved the wrong bytes, shows there). Enqueued, not
/// waited for.
///
/// # Errors
/// As [`fill_u32`]; also `Shape` for a null `count`.
///
/// # Safety
/// Each `ptr` must reference at least `4 × words` bytes of device memory of `stream`'s context
/// and `count` 4 bytes; the context must be bound to the calling thread.
pub unsafe fn count_mismatches_u32(
    stream: &Arc<CudaStream>,
    checks: &[(u64, usize, u32)],
    count: u64,
) -> Result<(), CudaKernelError> {
    if count == 0 {
        return Err(CudaKernelError::Shape("a null counter".into()));
    }
    let (t, n, _) = table(checks)?;
    if n == 0 {
        return Ok(());
    }
    let (_, f) = kernels(stream.context())?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&t).arg(&n).arg(&count);
    // SAFETY: the arguments match `ferry_count_mismatches_u32(struct ferry_fills, u64,
    // unsigned int*)`; the ranges are the caller's.
    unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
}

/// Fills each buffer of `fills` — `(ptr, words, value)`: `words` 32-bit words at device address
/// `ptr` — with its `value`, in one kernel launch on `stream`. Enqueued, not waited for; empty
/// buffers and an empty list are no-ops. The first fill in a context compiles the kernel
/// (NVRTC, tens of milliseconds).
///
/// # Errors
/// `Shape` for more than [`MAX_FILLS`] buffers or a null pointer; `Nvrtc` without NVRTC or when
/// the compile fails; `Driver` when loading or the launch fails.
///
/// # Safety
/// Each `ptr` must reference at least `4 × words` bytes of device memory of `stream`'s context,
/// not accessed concurrently by other streams; the context must be bound to the calling thread.
pub unsafe fn fill_u32(stream: &Arc<CudaStream>, fills: &[(u64, usize, u32)]) -> Result<(), CudaKernelError> {
    let (t, n, longest) = table(fills)?;
    if n == 0 {
        return Ok(());
    }
    let (f, _) = kernels(stream.context())?;
    let cfg = LaunchConfig {
        grid_dim: (longest.div_ceil(u64::from(THREADS)).min(MAX_BLOCKS) as u32, n as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&t).arg(&n);
    // SAFETY: the arguments match `ferry_fill_u32(struct ferry_fills, u64)`; the ranges are the
    // caller's.
    unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<Table>(), MAX_FILLS * 3 * 8);
        assert!(KERNEL.contains("struct ferry_fills { struct ferry_fill f[16]; };"));
        assert!(KERNEL.contains("struct ferry_fill { u64 ptr; u64 words; u64 value; };"));
        assert_eq!(MAX_FILLS, 16);
    }
}
