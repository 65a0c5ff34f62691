//! Task classes with C bodies, insertion with access modes, and what a body sees.

use crate::collection::ferry_collection;
use crate::registry::{self, Object};
use crate::runtime::ferry_runtime;
use crate::status::*;
use crate::util::{cstr, out, slice};
use std::ffi::{c_char, c_int, c_void};

/// A task-class handle (0: none).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_class {
    /// Opaque id.
    pub id: u64,
}

/// How a task uses a tile: `FERRY_READ`, `FERRY_WRITE`, `FERRY_RW` or `FERRY_RW_PART`.
#[allow(non_camel_case_types)]
pub type ferry_mode = i32;
/// Reads it.
pub const FERRY_READ: ferry_mode = 1;
/// Overwrites it without reading.
pub const FERRY_WRITE: ferry_mode = 2;
/// Reads and writes it.
pub const FERRY_RW: ferry_mode = 3;
/// Reads and writes a part of it that the other tasks of its group (a run of consecutive
/// `FERRY_RW_PART` accesses to the tile) do not touch; the group's members may run at the
/// same time (Rust: `AccessMode::ReadWritePart`).
pub const FERRY_RW_PART: ferry_mode = 4;

/// One tile a task accesses.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_access {
    /// The collection.
    pub coll: ferry_collection,
    /// Tile row.
    pub i: usize,
    /// Tile column.
    pub j: usize,
    /// How.
    pub mode: ferry_mode,
}

/// What a body sees while it runs (valid only during the call).
#[allow(non_camel_case_types)]
pub struct ferry_task_ctx {
    _opaque: [u8; 0],
}

/// A task body: returns 0 on success, anything else fails the run (the value is reported).
/// CPU bodies get host pointers; CUDA bodies get device pointers and a stream
/// (`ferry_task_stream`) on which they must only enqueue work.
#[allow(non_camel_case_types)]
pub type ferry_body = Option<unsafe extern "C" fn(ctx: *const ferry_task_ctx, user: *mut c_void) -> c_int>;

/// Where a body runs, behind the opaque pointer C gets.
pub(crate) enum Ctx<'a, 'b> {
    Cpu(&'a rt::TaskContext<'b>),
    Cuda(&'a rt::CudaTaskContext<'b>),
}

/// The caller's pointer, handed back to its bodies; C owns what it points to.
#[derive(Clone, Copy)]
struct User(*mut c_void);
// SAFETY: ferry never dereferences it; the caller decides what its bodies may do with it
// (documented: bodies may run on any thread, concurrently).
unsafe impl Send for User {}
// SAFETY: as above.
unsafe impl Sync for User {}

type Body = unsafe extern "C" fn(*const ferry_task_ctx, *mut c_void) -> c_int;

fn call(body: Body, ctx: &Ctx<'_, '_>, user: User, name: &str) -> Result<(), rt::TaskError> {
    // SAFETY: the C body gets a pointer that is valid for the call, and its own `user`.
    let rc = unsafe { body(ctx as *const Ctx as *const ferry_task_ctx, user.0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("C body of `{name}` returned {rc}").into())
    }
}

/// Creates a task class `name` with a CPU body and, optionally, a CUDA body (`cuda` may be
/// null); `user` is passed to both. Bodies run on ferry's threads, several at once: they must be
/// thread-safe, and must not call back into ferry except through the `ferry_task_*` accessors.
///
/// # Safety
/// `name` must be a NUL-terminated string; `out_class` valid for writes; the bodies valid
/// functions for the runtime's lifetime.
#[no_mangle]
pub unsafe extern "C" fn ferry_class_new(
    runtime: ferry_runtime,
    name: *const c_char,
    cpu: ferry_body,
    cuda: ferry_body,
    user: *mut c_void,
    out_class: *mut ferry_class,
) -> ferry_status {
    guard(|| {
        if let Err(s) = registry::runtime(runtime.id) {
            return s;
        }
        let name = match cstr(name, "name") {
            Ok(n) if !n.is_empty() => n.to_string(),
            Ok(_) => return fail(FERRY_ERR_INVALID_ARGUMENT, "the class name is empty"),
            Err(s) => return s,
        };
        let Some(cpu) = cpu else {
            return fail(
                FERRY_ERR_INVALID_ARGUMENT,
                format!("class `{name}`: the CPU body is null"),
            );
        };
        let user = User(user);
        let n1 = name.clone();
        let mut class = rt::TaskClass::new(&name, move |ctx| call(cpu, &Ctx::Cpu(ctx), user, &n1));
        if let Some(gpu) = cuda {
            let n2 = name.clone();
            class = class.with_cuda(move |ctx| call(gpu, &Ctx::Cuda(ctx), user, &n2));
        }
        let id = registry::insert(Object::Class {
            owner: runtime.id,
            class,
        });
        match out(out_class, ferry_class { id }) {
            Ok(()) => FERRY_OK,
            Err(s) => s,
        }
    })
}

/// Inserts a task of `class` on `n_acc` tiles with `n_args` integer arguments, at `priority`
/// (higher runs first; ≥ 2 marks the critical path), on `on_rank` (−1: the owner of the first
/// tile it writes). Every rank inserts the same sequence. Dependencies and transfers follow.
///
/// # Safety
/// `acc` must point to `n_acc` accesses and `args` to `n_args` values (either may be null when
/// its count is 0).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_insert(
    runtime: ferry_runtime,
    class: ferry_class,
    acc: *const ferry_access,
    n_acc: usize,
    args: *const i64,
    n_args: usize,
    priority: i32,
    on_rank: i32,
) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        let (owner, class) = match registry::class(class.id) {
            Ok(c) => c,
            Err(s) => return s,
        };
        if owner != runtime.id {
            return fail(FERRY_ERR_INVALID_HANDLE, "the class belongs to another runtime");
        }
        let (acc, args) = match (slice(acc, n_acc, "acc"), slice(args, n_args, "args")) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(s), _) | (_, Err(s)) => return s,
        };
        let mut accesses = Vec::with_capacity(acc.len());
        for a in acc {
            let (o, c) = match registry::collection(a.coll.id) {
                Ok(c) => c,
                Err(s) => return s,
            };
            if o != runtime.id {
                return fail(FERRY_ERR_INVALID_HANDLE, "a collection belongs to another runtime");
            }
            let mode = a.mode;
            if !(FERRY_READ..=FERRY_RW_PART).contains(&mode) {
                return fail(FERRY_ERR_INVALID_ARGUMENT, format!("access mode {mode}"));
            }
            accesses.push(c.access(a.i, a.j, a.mode));
        }
        let mut task = rt::Task::new(&class, &accesses).args(args).priority(priority);
        if on_rank >= 0 {
            task = task.on(on_rank);
        } else if on_rank != -1 {
            return fail(FERRY_ERR_INVALID_ARGUMENT, format!("on_rank {on_rank}: a rank or -1"));
        }
        match rt.submit(task) {
            Ok(()) => FERRY_OK,
            Err(e) => from_error(&e),
        }
    })
}

/// The context behind `ctx`.
///
/// # Safety
/// `ctx` is null or the pointer a body received, during that body.
pub(crate) unsafe fn ctx_of<'a>(ctx: *const ferry_task_ctx) -> Result<&'a Ctx<'a, 'a>, ferry_status> {
    if ctx.is_null() {
        return Err(fail(FERRY_ERR_INVALID_ARGUMENT, "ctx is null"));
    }
    Ok(&*(ctx as *const Ctx))
}

/// Tile `k` (in access order): its memory (host for CPU bodies, device for CUDA bodies) and
/// shape (row-major, `cols` elements per row). Writing a tile accessed read-only is an error of
/// the caller that ferry cannot see.
///
/// # Safety
/// `ctx` as given to the body; the out-pointers valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_task_tile(
    ctx_ptr: *const ferry_task_ctx,
    k: usize,
    ptr: *mut *mut c_void,
    rows: *mut usize,
    cols: *mut usize,
) -> ferry_status {
    guard(|| {
        let c = match ctx_of(ctx_ptr) {
            Ok(c) => c,
            Err(s) => return s,
        };
        let got: Result<(*mut c_void, usize, usize), rt::TaskError> = match c {
            Ctx::Cpu(t) => t.raw_tile(k).map(|r| (r.ptr as *mut c_void, r.rows, r.cols)),
            Ctx::Cuda(t) => t.ptr(k).and_then(|p| t.shape(k).map(|(r, c)| (p as *mut c_void, r, c))),
        };
        match got {
            Ok((p, r, cc)) => match (out(ptr, p), out(rows, r), out(cols, cc)) {
                (Ok(()), Ok(()), Ok(())) => FERRY_OK,
                (Err(s), _, _) | (_, Err(s), _) | (_, _, Err(s)) => s,
            },
            Err(e) => fail(FERRY_ERR_INVALID_ARGUMENT, e.to_string()),
        }
    })
}

/// Coordinates `(i, j)` of tile `k` in its collection.
///
/// # Safety
/// As [`ferry_task_tile`].
#[no_mangle]
pub unsafe extern "C" fn ferry_task_coords(
    ctx_ptr: *const ferry_task_ctx,
    k: usize,
    i: *mut usize,
    j: *mut usize,
) -> ferry_status {
    guard(|| {
        let c = match ctx_of(ctx_ptr) {
            Ok(c) => c,
            Err(s) => return s,
        };
        let got = match c {
            Ctx::Cpu(t) => t.coords(k),
            Ctx::Cuda(t) => t.coords(k),
        };
        match got {
            Ok((a, b)) => match (out(i, a), out(j, b)) {
                (Ok(()), Ok(())) => FERRY_OK,
                (Err(s), _) | (_, Err(s)) => s,
            },
            Err(e) => fail(FERRY_ERR_INVALID_ARGUMENT, e.to_string()),
        }
    })
}

/// The task's integer arguments (valid during the body) and their count.
///
/// # Safety
/// As [`ferry_task_tile`].
#[no_mangle]
pub unsafe extern "C" fn ferry_task_args(
    ctx_ptr: *const ferry_task_ctx,
    args: *mut *const i64,
    n: *mut usize,
) -> ferry_status {
    guard(|| {
        let c = match ctx_of(ctx_ptr) {
            Ok(c) => c,
            Err(s) => return s,
        };
        let a = match c {
            Ctx::Cpu(t) => t.args(),
            Ctx::Cuda(t) => t.args(),
        };
        match (out(args, a.as_ptr()), out(n, a.len())) {
            (Ok(()), Ok(())) => FERRY_OK,
            (Err(s), _) | (_, Err(s)) => s,
        }
    })
}

/// The CUDA stream (`CUstream`) a CUDA body must enqueue on; null for a CPU body or a null
/// `ctx`.
///
/// # Safety
/// As [`ferry_task_tile`].
#[no_mangle]
pub unsafe extern "C" fn ferry_task_stream(ctx_ptr: *const ferry_task_ctx) -> *mut c_void {
    match ctx_of(ctx_ptr) {
        Ok(Ctx::Cuda(t)) => t.stream().cu_stream() as *mut c_void,
        _ => std::ptr::null_mut(),
    }
}

/// The local device a CUDA body runs on (its index among this rank's devices); −1 for a CPU body
/// or a null `ctx`.
///
/// # Safety
/// As [`ferry_task_tile`].
#[no_mangle]
pub unsafe extern "C" fn ferry_task_device(ctx_ptr: *const ferry_task_ctx) -> i32 {
    match ctx_of(ctx_ptr) {
        Ok(Ctx::Cuda(t)) => t.device() as i32,
        _ => -1,
    }
}
