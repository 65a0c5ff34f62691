//! CUDA kernels for C bodies, compiled through ferry with NVRTC: C programs need no CUDA
//! toolchain of their own. A kernel is created once from its source (anywhere: compilation waits
//! until a CUDA body first launches it) and compiled per exec stream on first use, with
//! `--fmad=false` so that its floating point matches a C or Rust CPU body bit for bit.

use crate::registry::{self, Object};
use crate::runtime::ferry_runtime;
use crate::status::*;
use crate::task::{ctx_of, ferry_task_ctx, Ctx};
use crate::util::{cstr, out};
use rt::cudarc;
use std::collections::HashMap;
use std::ffi::{c_char, c_void};

/// A kernel handle (0: none).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_kernel {
    /// Opaque id.
    pub id: u64,
}

/// A kernel's CUDA C source and the name of its `extern "C" __global__` function.
pub(crate) struct KernelSource {
    pub(crate) source: String,
    pub(crate) name: String,
}

/// Compiled kernels of one exec stream, by handle id.
#[derive(Default)]
struct Compiled(HashMap<u64, cudarc::driver::CudaFunction>);

/// Registers a CUDA kernel: `source` (CUDA C, the function declared `extern "C" __global__`) and
/// the function's `name`. Nothing is compiled here, so CPU-only ranks may create it too; the
/// first launch on each exec stream compiles it (NVRTC, `--fmad=false`, for that device's
/// architecture), and a compile error fails that task with NVRTC's log.
///
/// # Safety
/// `source` and `name` must be NUL-terminated strings; `out_kernel` valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_cuda_kernel_new(
    runtime: ferry_runtime,
    source: *const c_char,
    name: *const c_char,
    out_kernel: *mut ferry_kernel,
) -> ferry_status {
    guard(|| {
        if let Err(s) = registry::runtime(runtime.id) {
            return s;
        }
        let (source, name) = match (cstr(source, "source"), cstr(name, "name")) {
            (Ok(a), Ok(b)) if !a.is_empty() && !b.is_empty() => (a.to_string(), b.to_string()),
            (Ok(_), Ok(_)) => return fail(FERRY_ERR_INVALID_ARGUMENT, "empty kernel source or name"),
            (Err(s), _) | (_, Err(s)) => return s,
        };
        let id = registry::insert(Object::Kernel {
            owner: runtime.id,
            kernel: std::sync::Arc::new(KernelSource { source, name }),
        });
        match out(out_kernel, ferry_kernel { id }) {
            Ok(()) => FERRY_OK,
            Err(s) => s,
        }
    })
}

/// Launches `kernel` from a CUDA body on the task's stream: `grid` and `block` are 3 dimensions
/// each, `shared_bytes` dynamic shared memory, `params` one pointer per kernel parameter (as
/// `cuLaunchKernel`'s `kernelParams`). `FERRY_ERR_INVALID_ARGUMENT` from a CPU body.
///
/// # Safety
/// `ctx` as given to the body; `grid`, `block` point to 3 values; `params` matches the kernel's
/// parameter list (the driver cannot check it).
#[no_mangle]
pub unsafe extern "C" fn ferry_task_launch(
    ctx_ptr: *const ferry_task_ctx,
    kernel: ferry_kernel,
    grid: *const u32,
    block: *const u32,
    shared_bytes: u32,
    params: *mut *mut c_void,
) -> ferry_status {
    guard(|| {
        let c = match ctx_of(ctx_ptr) {
            Ok(c) => c,
            Err(s) => return s,
        };
        let Ctx::Cuda(t) = c else {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "ferry_task_launch from a CPU body");
        };
        if grid.is_null() || block.is_null() {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "grid or block is null");
        }
        // SAFETY: the caller promises 3 values each.
        let (g, b) = unsafe {
            (
                std::slice::from_raw_parts(grid, 3),
                std::slice::from_raw_parts(block, 3),
            )
        };
        let cache = t.resource::<Compiled>(|_| Ok(Compiled::default()));
        let mut cache = match cache {
            Ok(c) => c,
            Err(e) => return fail(FERRY_ERR_DEVICE, e.to_string()),
        };
        let f = match cache.0.entry(kernel.id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let src = match registry::get(kernel.id) {
                    Some(Object::Kernel { kernel: k, .. }) => k,
                    _ => {
                        return fail(
                            FERRY_ERR_INVALID_HANDLE,
                            format!("{} is not a live ferry_kernel", kernel.id),
                        )
                    }
                };
                match compile(t.stream(), &src) {
                    Ok(f) => v.insert(f),
                    Err(msg) => return fail(FERRY_ERR_DEVICE, msg),
                }
            }
        };
        // SAFETY: the function belongs to this stream's context; parameters are the caller's.
        let r = unsafe {
            cudarc::driver::sys::cuLaunchKernel(
                f.cu_function(),
                g[0],
                g[1],
                g[2],
                b[0],
                b[1],
                b[2],
                shared_bytes,
                t.stream().cu_stream(),
                params,
                std::ptr::null_mut(),
            )
        };
        if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            FERRY_OK
        } else {
            fail(FERRY_ERR_DEVICE, format!("cuLaunchKernel: {r:?}"))
        }
    })
}

fn compile(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    k: &KernelSource,
) -> Result<cudarc::driver::CudaFunction, String> {
    let ctx = stream.context();
    let (major, minor) = ctx.compute_capability().map_err(|e| format!("{e:?}"))?;
    // SAFETY: a plain check whether the library can be loaded (cudarc panics without it).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("NVRTC (libnvrtc) is not installed: CUDA kernels cannot be compiled".into());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        fmad: Some(false),
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some(format!("{}.cu", k.name)),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&k.source, opts).map_err(|e| format!("NVRTC: {e:?}"))?;
    let module = ctx.load_module(ptx).map_err(|e| format!("cuModuleLoad: {e:?}"))?;
    module
        .load_function(&k.name)
        .map_err(|e| format!("kernel `{}` not found in its source: {e:?}", k.name))
}
