//! GeoNames places and their covariance tiles (`ferry_kernels::geo`), for C and C++ frameworks:
//! the matrix the STF `cholesky --points` factors, built tile by tile, so that a framework with
//! a task graph of its own factors exactly the same one.

use crate::registry::{self, Object};
use crate::status::{
    fail, ferry_status, guard, FERRY_ERR_INVALID_ARGUMENT, FERRY_ERR_INVALID_HANDLE, FERRY_ERR_IO, FERRY_OK,
};
use crate::util::cstr;
use ferry_kernels::geo::{self, CovKernel, CovParams, Ordering, Place};
use ferry_kernels::KernelError;
use std::ffi::c_char;
use std::sync::Arc;

/// Loaded places (0: none); freed with `ferry_places_free`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_places {
    /// Opaque id.
    pub id: u64,
}

/// Places in the file's order.
pub const FERRY_ORDER_FILE: i32 = 0;
/// Places sorted along a Z-order (Morton) curve: the first M form a compact region.
pub const FERRY_ORDER_MORTON: i32 = 1;

/// `σ² e^{−r}`, `r = d / ℓ`.
pub const FERRY_COV_EXPONENTIAL: i32 = 0;
/// `σ² (1 + √3 r) e^{−√3 r}`.
pub const FERRY_COV_MATERN32: i32 = 1;
/// `σ² (1 + √5 r + 5r²/3) e^{−√5 r}`.
pub const FERRY_COV_MATERN52: i32 = 2;
/// `σ² e^{−r²/2}`.
pub const FERRY_COV_SQEXP: i32 = 3;

/// A covariance function of great-circle distance: the kernel (`FERRY_COV_*`), the length
/// scale ℓ in km (> 0), the marginal variance σ² (> 0) and the nugget added on the diagonal
/// (≥ 0). The STF `cholesky --points` defaults: exponential, 500 km, 1, 0.01.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_cov_params {
    /// `FERRY_COV_*`.
    pub kernel: i32,
    /// Length scale, km.
    pub length_km: f64,
    /// Marginal variance.
    pub variance: f64,
    /// Added on the diagonal.
    pub nugget: f64,
}

fn kernel_error(e: &KernelError) -> ferry_status {
    let status = match e {
        KernelError::Io(_) => FERRY_ERR_IO,
        _ => FERRY_ERR_INVALID_ARGUMENT,
    };
    fail(status, e.to_string())
}

fn places(p: ferry_places) -> Result<Arc<Vec<Place>>, ferry_status> {
    match registry::get(p.id) {
        Some(Object::Places(v)) => Ok(v),
        _ => Err(fail(
            FERRY_ERR_INVALID_HANDLE,
            format!("{} is not a live ferry_places", p.id),
        )),
    }
}

/// Loads the places of a GeoNames file (tab-separated, as `data/cities1000.csv`): the first
/// `count` in `order` (`FERRY_ORDER_*`; `count` 0: all of them).
///
/// Errors: `FERRY_ERR_IO` for a file that cannot be read, `FERRY_ERR_INVALID_ARGUMENT` for a
/// malformed line (the message gives its number), an unknown order, fewer places than `count`.
///
/// # Safety
/// `path` is a NUL-terminated string; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_places_load(
    path: *const c_char,
    count: usize,
    order: i32,
    out: *mut ferry_places,
) -> ferry_status {
    guard(|| {
        if out.is_null() {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "out is null");
        }
        let path = match cstr(path, "path") {
            Ok(p) => p,
            Err(s) => return s,
        };
        let order = match order {
            FERRY_ORDER_FILE => Ordering::File,
            FERRY_ORDER_MORTON => Ordering::Morton,
            o => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("order {o}: expected FERRY_ORDER_*")),
        };
        match geo::load_places(std::path::Path::new(path), (count > 0).then_some(count), order) {
            Ok(v) => {
                let id = registry::insert(Object::Places(Arc::new(v)));
                out.write(ferry_places { id });
                FERRY_OK
            }
            Err(e) => {
                let status = kernel_error(&e);
                fail(status, format!("{path}: {e}"))
            }
        }
    })
}

/// The number of places.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_places_count(p: ferry_places, out: *mut usize) -> ferry_status {
    guard(|| match places(p) {
        Ok(_) if out.is_null() => fail(FERRY_ERR_INVALID_ARGUMENT, "out is null"),
        Ok(v) => {
            out.write(v.len());
            FERRY_OK
        }
        Err(s) => s,
    })
}

/// Writes the `rows × cols` tile at `(i0, j0)` of the places' covariance matrix into `out`,
/// column-major (`out[r + c·rows]`), bit for bit what the STF `cholesky --points` factors
/// (`ferry_kernels::geo::covariance_tile`).
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` for parameters out of range or a tile past the matrix;
/// `FERRY_ERR_INVALID_HANDLE` for places freed or never loaded.
///
/// # Safety
/// `params` is valid for a read; `out` for `rows × cols` writes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_places_covariance_tile(
    p: ferry_places,
    params: *const ferry_cov_params,
    i0: usize,
    j0: usize,
    rows: usize,
    cols: usize,
    out: *mut f64,
) -> ferry_status {
    guard(|| {
        let v = match places(p) {
            Ok(v) => v,
            Err(s) => return s,
        };
        if params.is_null() || (out.is_null() && rows * cols > 0) {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "params or out is null");
        }
        let c = params.read();
        let kernel = match c.kernel {
            FERRY_COV_EXPONENTIAL => CovKernel::Exponential,
            FERRY_COV_MATERN32 => CovKernel::Matern32,
            FERRY_COV_MATERN52 => CovKernel::Matern52,
            FERRY_COV_SQEXP => CovKernel::SquaredExponential,
            k => return fail(FERRY_ERR_INVALID_ARGUMENT, format!("kernel {k}: expected FERRY_COV_*")),
        };
        let Some(n) = rows.checked_mul(cols) else {
            return fail(FERRY_ERR_INVALID_ARGUMENT, "rows × cols overflows");
        };
        let params = CovParams {
            kernel,
            variance: c.variance,
            length_scale_km: c.length_km,
            nugget: c.nugget,
        };
        let tile: &mut [f64] = if n == 0 {
            &mut []
        } else {
            std::slice::from_raw_parts_mut(out, n)
        };
        match geo::covariance_tile(&v, &params, i0, j0, rows, cols, tile) {
            Ok(()) => FERRY_OK,
            Err(e) => kernel_error(&e),
        }
    })
}

/// Frees loaded places (`FERRY_ERR_INVALID_HANDLE` when freed already).
#[no_mangle]
pub extern "C" fn ferry_places_free(p: ferry_places) -> ferry_status {
    guard(|| match registry::remove(p.id, |o| matches!(o, Object::Places(_))) {
        Some(_) => FERRY_OK,
        None => fail(FERRY_ERR_INVALID_HANDLE, format!("{} is not a live ferry_places", p.id)),
    })
}
