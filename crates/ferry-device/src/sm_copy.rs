//! Copy kernels: small device-to-device copies made by the GPU's multiprocessors instead of its
//! copy engines (`FERRY_SM_COPY_BYTES`).
//!
//! On the H200 machines a `cuMemcpyAsync` costs the host 3.6–4.7 µs per call, more than a kernel
//! launch (3.4 µs), and a run of copies through `cuMemcpyBatchAsync` saves nothing per copy
//! (`docs/tuning.md`, "Communication"). One launch of [`KERNEL`] makes up to
//! [`MAX_COPIES`] copies, each spread over up to `blocks` thread blocks that load the source —
//! a peer's pool mapped through CUDA IPC, or this device's pool — 16 bytes per thread with four
//! loads in flight. What an IPC pull of a consumer needs is exactly that: a load from the
//! producer's memory over NVLink.
//!
//! Only batches go through it (two or more independent copies enqueued together, each within
//! `FERRY_SM_COPY_BYTES`): a lone copy costs the GPU manager less as one `cuMemcpyAsync`. IPC
//! pulls that owe their producers device acknowledgements (`FERRY_DEVICE_ACK`), even a lone one,
//! go through its acknowledging twin, whose last block writes the words ([`launch_acked`]): one
//! launch instead of a launch and a `cuStreamWriteValue64` per word.
//!
//! The module is compiled with NVRTC once per device, at start-up (compiled on first use, it
//! stalled the manager for tens of milliseconds in the middle of a run). Where NVRTC is missing
//! or the compile fails, copies go to the copy engines as before (logged once).

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Copies one launch makes at most (the table travels in the kernel's parameters: 16 × 24
/// bytes, within the 4 KiB every driver takes).
pub const MAX_COPIES: usize = 16;

/// Threads per block.
const THREADS: u32 = 256;

/// Bytes one block moves per pass of its loop: 256 threads × 16 bytes × 4 loads in flight.
const BYTES_PER_BLOCK_PASS: u64 = THREADS as u64 * 16 * 4;

/// CUDA C of the copy kernel (`copy_kernel.cu`, shared with the `transfer` benchmark's
/// copy-kernel anchor so that it measures this very kernel).
const KERNEL: &str = include_str!("copy_kernel.cu");

/// The kernel's copy table, laid out as `struct ferry_copies`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Table {
    c: [[u64; 3]; MAX_COPIES],
}

// SAFETY: plain old data with the layout of `struct ferry_copies` (16 × (src, dst, len) u64).
unsafe impl DeviceRepr for Table {}

/// The kernel's acknowledgement table, laid out as `struct ferry_acks`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Acks {
    w: [[u64; 2]; MAX_COPIES],
}

// SAFETY: plain old data with the layout of `struct ferry_acks` (16 × (address, value) u64).
unsafe impl DeviceRepr for Acks {}

/// The loaded copy kernels of one device: plain, and writing acknowledgement words at the end
/// ([`launch_acked`]).
pub struct Functions {
    pub batch: CudaFunction,
    pub acked: CudaFunction,
}

/// The copy kernel of one device: not tried yet, loaded, or unavailable.
#[derive(Default)]
pub enum CopyKernel {
    #[default]
    Untried,
    Loaded(Functions),
    Unavailable,
}

impl CopyKernel {
    /// The loaded function, compiling and loading it in `ctx` (bound to this thread) on first
    /// use; `None` when that failed (once logged, copies then use the copy engines). `fault`:
    /// fail as if NVRTC were missing (`FERRY_FAULTS=no-copy-kernel:1`).
    pub fn get(&mut self, ctx: &Arc<CudaContext>, ordinal: usize, fault: bool) -> Option<&Functions> {
        if let CopyKernel::Untried = self {
            let loaded = if fault {
                Err("injected by FERRY_FAULTS=no-copy-kernel:1".to_string())
            } else {
                load(ctx)
            };
            *self = match loaded {
                Ok(f) => CopyKernel::Loaded(f),
                // A node with the driver but no CUDA toolkit is common and loses nothing but
                // speed: said once, without alarm. A failed compile or load is a fault.
                Err(e) if e == NO_NVRTC => {
                    tracing::info!(ordinal, error = %e, "no copy kernel: batches of copies use the copy engines");
                    CopyKernel::Unavailable
                }
                Err(e) => {
                    tracing::warn!(ordinal, error = %e, "no copy kernel: batches of copies use the copy engines");
                    CopyKernel::Unavailable
                }
            };
        }
        match self {
            CopyKernel::Loaded(f) => Some(f),
            _ => None,
        }
    }
}

/// Why the kernel is unavailable where the NVRTC library is missing.
const NO_NVRTC: &str = "the NVRTC library (libnvrtc) was not found";

fn load(ctx: &Arc<CudaContext>) -> Result<Functions, String> {
    // SAFETY: a check whether the shared library can be loaded (cudarc panics without it).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(NO_NVRTC.into());
    }
    let arch = ctx.compute_capability().map_err(|e| format!("{e:?}"))?;
    let module = ctx.load_module(ptx_for(arch)?).map_err(|e| format!("{e:?}"))?;
    let function = |name: &str| module.load_function(name).map_err(|e| format!("{e:?}"));
    Ok(Functions {
        batch: function("ferry_copy_batch")?,
        acked: function("ferry_copy_batch_acked")?,
    })
}

/// The kernel's PTX for compute capability `arch`, compiled by NVRTC once per process and
/// architecture: every device of a node usually shares one, and each compile takes tens of
/// milliseconds of start-up.
fn ptx_for(arch: (i32, i32)) -> Result<cudarc::nvrtc::Ptx, String> {
    static COMPILED: std::sync::Mutex<Vec<((i32, i32), cudarc::nvrtc::Ptx)>> = std::sync::Mutex::new(Vec::new());
    let mut compiled = COMPILED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, ptx)) = compiled.iter().find(|(a, _)| *a == arch) {
        return Ok(ptx.clone());
    }
    let (major, minor) = arch;
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some("ferry_copy.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNEL, opts).map_err(|e| format!("{e:?}"))?;
    compiled.push((arch, ptx.clone()));
    Ok(ptx)
}

/// Enqueues `copies` (`(dst, src, len)` device addresses, at most [`MAX_COPIES`], none empty)
/// on `stream` as one launch of `f`, each copy over at most `blocks` thread blocks.
///
/// # Errors
/// The driver's launch error, as text.
///
/// # Safety
/// Every range must be device memory mapped in the stream's context, alive until the copy has
/// run; a destination must not overlap another copy's source or destination.
pub unsafe fn launch(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    copies: &[(u64, u64, usize)],
    blocks: u32,
) -> Result<(), String> {
    // SAFETY: the caller's contract.
    unsafe { launch_with(stream, f, copies, blocks, None) }
}

/// As [`launch`] with `f` the acknowledging kernel (`ferry_copy_batch_acked`): once every
/// block has read its sources, the last to finish writes each `(address, value)` of `acks` (at
/// most [`MAX_COPIES`], 8-byte aligned words — the producers' acknowledgement words, mapped
/// here), as a `cuStreamWriteValue64` behind the copies would, without its driver call per
/// word. `done` is a 4-byte counter of the stream's device, zero before the launch (the kernel
/// leaves it zero); launches sharing it must be ordered (one counter per stream).
///
/// # Errors
/// The driver's launch error, or more than [`MAX_COPIES`] words, as text.
///
/// # Safety
/// As [`launch`]; every ack address is mapped in the stream's context and alive until the
/// kernel has run; `done` is device memory no other launch uses concurrently.
pub unsafe fn launch_acked(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    copies: &[(u64, u64, usize)],
    blocks: u32,
    acks: &[(u64, u64)],
    done: u64,
) -> Result<(), String> {
    if acks.len() > MAX_COPIES {
        return Err(format!(
            "{} acknowledgement words for one launch (at most {MAX_COPIES})",
            acks.len()
        ));
    }
    // SAFETY: the caller's contract.
    unsafe { launch_with(stream, f, copies, blocks, Some((acks, done))) }
}

unsafe fn launch_with(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    copies: &[(u64, u64, usize)],
    blocks: u32,
    acks: Option<(&[(u64, u64)], u64)>,
) -> Result<(), String> {
    debug_assert!(!copies.is_empty() && copies.len() <= MAX_COPIES);
    let mut t = Table {
        c: [[0; 3]; MAX_COPIES],
    };
    let mut longest = 0u64;
    for (slot, &(dst, src, len)) in t.c.iter_mut().zip(copies) {
        *slot = [src, dst, len as u64];
        longest = longest.max(len as u64);
    }
    let n = copies.len() as u64;
    let per_copy = longest
        .div_ceil(BYTES_PER_BLOCK_PASS)
        .clamp(1, u64::from(blocks.max(1))) as u32;
    let cfg = LaunchConfig {
        grid_dim: (per_copy, copies.len() as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut a = Acks {
        w: [[0; 2]; MAX_COPIES],
    };
    let (na, counter) = match acks {
        Some((acks, done)) => {
            for (slot, &(at, value)) in a.w.iter_mut().zip(acks) {
                *slot = [at, value];
            }
            (acks.len().min(MAX_COPIES) as u64, done)
        }
        None => (0u64, 0u64),
    };
    let mut b = stream.launch_builder(f);
    b.arg(&t).arg(&n);
    if acks.is_some() {
        b.arg(&a).arg(&na).arg(&counter);
    }
    // SAFETY: the arguments match `ferry_copy_batch`'s (or `ferry_copy_batch_acked`'s)
    // parameters; the ranges and words are the caller's.
    unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| format!("{e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<Table>(), 16 * 3 * 8);
        assert_eq!(std::mem::size_of::<Acks>(), 16 * 2 * 8);
        assert!(KERNEL.contains("struct ferry_acks { u64 w[16][2]; };"));
        assert!(KERNEL.contains("ferry_copy_batch_acked(struct ferry_copies t, u64 n, struct ferry_acks a, u64 na,"));
        assert!(KERNEL.contains("struct ferry_copy c[16];"));
        assert_eq!(MAX_COPIES, 16);
        assert_eq!(BYTES_PER_BLOCK_PASS, 16384);
    }
}
