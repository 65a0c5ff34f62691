//! Checkpoint and restore of collections.

use crate::collection::{ferry_collection, AnyCollection};
use crate::registry;
use crate::runtime::ferry_runtime;
use crate::status::*;
use crate::util::{cstr, out, slice};
use rt::CollectionRef;
use std::ffi::c_char;

/// The collections behind `colls`, as the runtime's type-erased references, checked to belong
/// to `runtime`.
unsafe fn refs(
    runtime: ferry_runtime,
    colls: *const ferry_collection,
    n: usize,
) -> Result<Vec<CollectionRef>, ferry_status> {
    let handles = slice(colls, n, "colls")?;
    let mut v = Vec::with_capacity(n);
    for h in handles {
        let (owner, c) = registry::collection(h.id)?;
        if owner != runtime.id {
            return Err(fail(
                FERRY_ERR_INVALID_HANDLE,
                "a collection belongs to another runtime",
            ));
        }
        v.push(match &*c {
            AnyCollection::F64(x) => x.into(),
            AnyCollection::F32(x) => x.into(),
            AnyCollection::I64(x) => x.into(),
            AnyCollection::I32(x) => x.into(),
            AnyCollection::U8(x) => x.into(),
        });
    }
    Ok(v)
}

/// Writes the `n` collections `colls` to the checkpoint directory `dir` (created if needed, on a
/// file system every rank sees), tagged with `step`. Collective: every rank calls it at the same
/// point of the sequence; it first waits for every task inserted so far. Device-resident tiles
/// stream through the bounce pool (`FERRY_BOUNCE_BYTES`), never mirrored on the host.
/// `FERRY_ERR_CHECKPOINT` when a file cannot be written (the directory is then not restorable).
///
/// # Safety
/// `dir` must be a NUL-terminated string; `colls` valid for `n` reads.
#[no_mangle]
pub unsafe extern "C" fn ferry_checkpoint(
    runtime: ferry_runtime,
    dir: *const c_char,
    step: u64,
    colls: *const ferry_collection,
    n: usize,
) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        let (dir, colls) = match (cstr(dir, "dir"), refs(runtime, colls, n)) {
            (Ok(d), Ok(c)) => (d, c),
            (Err(s), _) | (_, Err(s)) => return s,
        };
        match rt.checkpoint(std::path::Path::new(dir), step, &colls) {
            Ok(_) => FERRY_OK,
            Err(e) => from_error(&e),
        }
    })
}

/// Restores the `n` collections `colls` from the checkpoint in `dir` and writes its step to
/// `step`. Collective. Everything is read and checked (shapes against the collections given,
/// every tile against its checksum) before anything changes; the checkpoint may come from
/// another rank count. `FERRY_ERR_CHECKPOINT` names the file and the problem.
///
/// # Safety
/// `dir` must be a NUL-terminated string; `colls` valid for `n` reads; `step` for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_restore(
    runtime: ferry_runtime,
    dir: *const c_char,
    colls: *const ferry_collection,
    n: usize,
    step: *mut u64,
) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        if step.is_null() {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "step is null");
        }
        let (dir, colls) = match (cstr(dir, "dir"), refs(runtime, colls, n)) {
            (Ok(d), Ok(c)) => (d, c),
            (Err(s), _) | (_, Err(s)) => return s,
        };
        match rt.restore(std::path::Path::new(dir), &colls) {
            Ok(k) => match out(step, k) {
                Ok(()) => FERRY_OK,
                Err(s) => s,
            },
            Err(e) => from_error(&e),
        }
    })
}
