//! Collections: tiled matrices of one element type, distributed over the ranks.

use crate::registry::{self, Object};
use crate::runtime::ferry_runtime;
use crate::status::*;
use crate::util::{cstr, out};
use rt::{Collection, Distribution, ProcessGrid};
use std::ffi::c_char;

/// A collection handle (0: none).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_collection {
    /// Opaque id.
    pub id: u64,
}

/// Element type of a collection: one of the `FERRY_F64` … `FERRY_U8` constants (an integer, so
/// that a bad value from C is an error code rather than undefined behaviour).
#[allow(non_camel_case_types)]
pub type ferry_elem = i32;
/// `double`.
pub const FERRY_F64: ferry_elem = 0;
/// `float`.
pub const FERRY_F32: ferry_elem = 1;
/// `int64_t`.
pub const FERRY_I64: ferry_elem = 2;
/// `int32_t`.
pub const FERRY_I32: ferry_elem = 3;
/// `uint8_t`.
pub const FERRY_U8: ferry_elem = 4;

/// How tiles are spread over ranks: one of the `FERRY_DIST_*` constants.
#[allow(non_camel_case_types)]
pub type ferry_dist_kind = i32;
/// 2D block-cyclic over a `p × q` process grid (ScaLAPACK's layout).
pub const FERRY_DIST_BLOCK_CYCLIC_2D: ferry_dist_kind = 0;
/// 2D block: the tile grid cut into `p × q` contiguous blocks.
pub const FERRY_DIST_BLOCK_2D: ferry_dist_kind = 1;
/// Every tile on one rank.
pub const FERRY_DIST_ON_RANK: ferry_dist_kind = 2;

/// A distribution: `kind` with a `p × q` grid (`p * q` = number of ranks), or `rank` for
/// `FERRY_DIST_ON_RANK`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_distribution {
    /// The layout.
    pub kind: ferry_dist_kind,
    /// Process-grid rows.
    pub p: usize,
    /// Process-grid columns.
    pub q: usize,
    /// The rank of `FERRY_DIST_ON_RANK`.
    pub rank: i32,
}

/// A collection of any supported element type.
pub(crate) enum AnyCollection {
    F64(Collection<f64>),
    F32(Collection<f32>),
    I64(Collection<i64>),
    I32(Collection<i32>),
    U8(Collection<u8>),
}

macro_rules! each {
    ($c:expr, $x:ident => $e:expr) => {
        match $c {
            AnyCollection::F64($x) => $e,
            AnyCollection::F32($x) => $e,
            AnyCollection::I64($x) => $e,
            AnyCollection::I32($x) => $e,
            AnyCollection::U8($x) => $e,
        }
    };
}

impl AnyCollection {
    /// The access of `mode` (already validated: one of the `FERRY_READ/WRITE/RW/RW_PART`
    /// values).
    pub(crate) fn access(&self, i: usize, j: usize, mode: crate::task::ferry_mode) -> rt::Access {
        use crate::task::{FERRY_READ, FERRY_RW_PART, FERRY_WRITE};
        each!(self, c => match mode {
            FERRY_READ => c.read(i, j),
            FERRY_WRITE => c.write(i, j),
            FERRY_RW_PART => c.rw_part(i, j),
            _ => c.rw(i, j),
        })
    }
    fn tiles(&self) -> (usize, usize) {
        each!(self, c => (c.tile_rows(), c.tile_cols()))
    }
    fn elem_size(&self) -> usize {
        match self {
            AnyCollection::F64(_) | AnyCollection::I64(_) => 8,
            AnyCollection::F32(_) | AnyCollection::I32(_) => 4,
            AnyCollection::U8(_) => 1,
        }
    }
}

fn distribution(d: &ferry_distribution) -> Result<Distribution, ferry_status> {
    let grid = || ProcessGrid::new(d.p, d.q).map_err(|e| fail(FERRY_ERR_INVALID_ARGUMENT, e.to_string()));
    Ok(match d.kind {
        FERRY_DIST_BLOCK_CYCLIC_2D => Distribution::BlockCyclic2d(grid()?),
        FERRY_DIST_BLOCK_2D => Distribution::Block2d(grid()?),
        FERRY_DIST_ON_RANK => Distribution::OnRank(d.rank),
        k => return Err(fail(FERRY_ERR_INVALID_ARGUMENT, format!("distribution kind {k}"))),
    })
}

/// The squarest `p × q` grid of `ranks` ranks (`p ≤ q`, as close as the factors allow): what
/// the Rust examples use, so C programs can lay data out the same way.
///
/// # Safety
/// `p` and `q` must be valid for writes (null gives `FERRY_ERR_INVALID_ARGUMENT`).
#[no_mangle]
pub unsafe extern "C" fn ferry_grid_squarest(ranks: usize, p: *mut usize, q: *mut usize) -> ferry_status {
    guard(|| {
        if ranks == 0 {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "ranks must be at least 1");
        }
        let g = ProcessGrid::squarest(ranks);
        let (a, b) = (g.p, g.q);
        match (out(p, a), out(q, b)) {
            (Ok(()), Ok(())) => FERRY_OK,
            (Err(s), _) | (_, Err(s)) => s,
        }
    })
}

/// Creates an `m × n` collection of `elem` in `mb × nb` tiles (ragged at the bottom and right),
/// distributed by `dist`. Every rank must create the same collections in the same order (a
/// collective in the sequential-task-flow sense). Tiles this rank owns are allocated and zeroed.
///
/// # Safety
/// `name` must be a NUL-terminated string and `out_coll` valid for writes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_collection_new(
    runtime: ferry_runtime,
    name: *const c_char,
    elem: ferry_elem,
    m: usize,
    n: usize,
    mb: usize,
    nb: usize,
    dist: ferry_distribution,
    out_coll: *mut ferry_collection,
) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        let name = match cstr(name, "name") {
            Ok(n) => n,
            Err(s) => return s,
        };
        let dist = match distribution(&dist) {
            Ok(d) => d,
            Err(s) => return s,
        };
        let made = match elem {
            FERRY_F64 => rt.tile_grid::<f64>(name, m, n, mb, nb, dist).map(AnyCollection::F64),
            FERRY_F32 => rt.tile_grid::<f32>(name, m, n, mb, nb, dist).map(AnyCollection::F32),
            FERRY_I64 => rt.tile_grid::<i64>(name, m, n, mb, nb, dist).map(AnyCollection::I64),
            FERRY_I32 => rt.tile_grid::<i32>(name, m, n, mb, nb, dist).map(AnyCollection::I32),
            FERRY_U8 => rt.tile_grid::<u8>(name, m, n, mb, nb, dist).map(AnyCollection::U8),
            e => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("element type {e}")),
        };
        let coll = match made {
            Ok(c) => c,
            Err(e) => return from_error(&e),
        };
        let id = registry::insert(Object::Collection {
            owner: runtime.id,
            coll: std::sync::Arc::new(coll),
        });
        match out(out_coll, ferry_collection { id }) {
            Ok(()) => FERRY_OK,
            Err(s) => s,
        }
    })
}

/// The collection's tile grid: `mt` tile rows, `nt` tile columns.
///
/// # Safety
/// `mt` and `nt` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_collection_tiles(
    coll: ferry_collection,
    mt: *mut usize,
    nt: *mut usize,
) -> ferry_status {
    guard(|| {
        let (_, c) = match registry::collection(coll.id) {
            Ok(c) => c,
            Err(s) => return s,
        };
        let (a, b) = c.tiles();
        match (out(mt, a), out(nt, b)) {
            (Ok(()), Ok(())) => FERRY_OK,
            (Err(s), _) | (_, Err(s)) => s,
        }
    })
}

/// The owner rank and shape (`rows × cols` elements) of tile `(i, j)`.
///
/// # Safety
/// `owner`, `rows` and `cols` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_collection_tile(
    coll: ferry_collection,
    i: usize,
    j: usize,
    owner: *mut i32,
    rows: *mut usize,
    cols: *mut usize,
) -> ferry_status {
    guard(|| {
        let (_, c) = match registry::collection(coll.id) {
            Ok(c) => c,
            Err(s) => return s,
        };
        let r = each!(&*c, x => x.owner(i, j).and_then(|o| x.tile_shape(i, j).map(|s| (o, s))));
        match r {
            Ok((o, (r, k))) => match (out(owner, o), out(rows, r), out(cols, k)) {
                (Ok(()), Ok(()), Ok(())) => FERRY_OK,
                (Err(s), _, _) | (_, Err(s), _) | (_, _, Err(s)) => s,
            },
            Err(e) => from_error(&e),
        }
    })
}

/// Copies this rank's current data of tile `(i, j)` (after `ferry_wait`, on the tile's owner)
/// into `buf` of `bytes` bytes, which must be exactly the tile's size.
///
/// # Safety
/// `buf` must be valid for `bytes` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn ferry_tile_read(
    runtime: ferry_runtime,
    coll: ferry_collection,
    i: usize,
    j: usize,
    buf: *mut std::ffi::c_void,
    bytes: usize,
) -> ferry_status {
    guard(|| {
        let rt = match registry::runtime(runtime.id) {
            Ok(r) => r,
            Err(s) => return s,
        };
        let (owner, c) = match registry::collection(coll.id) {
            Ok(c) => c,
            Err(s) => return s,
        };
        if owner != runtime.id {
            return fail(FERRY_ERR_INVALID_HANDLE, "the collection belongs to another runtime");
        }
        if buf.is_null() {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "buf is null");
        }
        let esize = c.elem_size();
        let data: Result<Vec<u8>, rt::FerryError> = each!(&*c, x => rt.tile(x, i, j).map(|v| {
            // SAFETY: plain-old-data elements viewed as bytes.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * esize) }.to_vec()
        }));
        match data {
            Ok(d) if d.len() == bytes => {
                // SAFETY: the caller promises `bytes` writable bytes at `buf`.
                unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), buf as *mut u8, bytes) };
                FERRY_OK
            }
            Ok(d) => fail(
                FERRY_ERR_INVALID_ARGUMENT,
                format!("tile ({i}, {j}) holds {} bytes, the buffer {bytes}", d.len()),
            ),
            Err(e) => from_error(&e),
        }
    })
}
