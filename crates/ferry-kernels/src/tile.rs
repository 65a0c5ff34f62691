//! Cholesky tile kernels (POTRF, TRSM, SYRK, GEMM) and the small vector
//! kernels a tiled Cholesky solve needs.
//!
//! Conventions, for every function here:
//! * tiles are `f64`, **column-major**, with leading dimension equal to the
//!   number of rows (element `(i, j)` of an `m × n` tile is `a[i + j * m]`);
//! * the lower-triangular convention is used: `A = L Lᵀ` with `L` lower;
//! * every slice length is checked against the dimensions passed with it,
//!   and a mismatch returns [`KernelError::Shape`] before anything is written;
//! * all faer calls run with `Par::Seq` (these kernels run inside task bodies
//!   whose parallelism is provided by the runtime).
//!
//! The matrix kernels are thin wrappers over faer 0.24
//! (`faer::linalg::cholesky::llt`, `faer::linalg::triangular_solve`,
//! `faer::linalg::matmul`). A tiled right-looking Cholesky of a matrix split
//! into `T × T` tiles is, for `k = 0..T`:
//! `potrf(A_kk)`; `trsm(A_ik, L_kk)` for `i > k`; `syrk(A_ii, A_ik)` and
//! `gemm_nt(A_ij, A_ik, A_jk)` for `j < i`, `i, j > k`
//! (Buttari, Langou, Kurzak & Dongarra 2009, "A class of parallel tiled linear
//! algebra algorithms for multicore architectures", Parallel Computing 35).

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch, LltError, LltRegularization};
use faer::linalg::matmul::triangular::BlockStructure;
use faer::reborrow::*;
use faer::{Accum, MatMut, MatRef, Par};

use crate::error::{check_len, elems, KernelError};

/// In-place Cholesky factorization of one `n × n` tile (LAPACK `DPOTRF`,
/// lower).
///
/// * `a`: `n × n` column-major, length `n * n`. Only the lower triangle
///   (diagonal included) is read. On success it holds exactly `L`: the lower
///   triangle is `L` with `A = L Lᵀ` and the strict upper triangle is set to
///   zero.
///
/// # Errors
/// * [`KernelError::Shape`] if `a.len() != n * n` (nothing is written);
/// * [`KernelError::NotPositiveDefinite`] with the zero-based column of the
///   first non-positive (or NaN) pivot. `a` is then partially overwritten
///   (columns before `column` may already hold `L`) and must be discarded.
///
/// Uses faer's blocked left-looking `cholesky_in_place` with no dynamic
/// regularization; allocates `O(n)` scratch.
pub fn potrf(n: usize, a: &mut [f64]) -> Result<(), KernelError> {
    llt_in_place(n, a, Par::Seq)
}

/// Dense Cholesky of a whole `n × n` matrix with faer: the baseline a tiled
/// factorization is benchmarked against.
///
/// * `a`: `n × n` column-major, length `n * n`; only the lower triangle is
///   read; on success it holds `L` (lower) with the strict upper triangle
///   zeroed, exactly like [`potrf`].
/// * `threads`: threads faer may use (`Par::rayon(threads)`; 1 or 0 means
///   `Par::Seq`). Benchmarks pass the same thread count the tiled run had.
///
/// # Errors
/// Same as [`potrf`]: `Shape` on a wrong length, `NotPositiveDefinite` on a
/// non-positive pivot.
pub fn dense_cholesky(n: usize, a: &mut [f64], threads: usize) -> Result<(), KernelError> {
    let par = if threads > 1 { Par::rayon(threads) } else { Par::Seq };
    llt_in_place(n, a, par)
}

fn llt_in_place(n: usize, a: &mut [f64], par: Par) -> Result<(), KernelError> {
    check_len("a", elems(n, n)?, a.len())?;
    let mut mat = MatMut::from_column_major_slice_mut(a, n, n);
    let mut buf = MemBuffer::new(cholesky_in_place_scratch::<f64>(n, par, Default::default()));
    let stack = MemStack::new(&mut buf);
    cholesky_in_place(
        mat.rb_mut(),
        LltRegularization::default(),
        par,
        stack,
        Default::default(),
    )
    .map_err(|e| match e {
        LltError::NonPositivePivot { index } => KernelError::NotPositiveDefinite { column: index },
    })?;
    for j in 1..n {
        for i in 0..j {
            mat[(i, j)] = 0.0;
        }
    }
    Ok(())
}

/// Triangular solve from the right with a transposed lower factor (BLAS
/// `DTRSM`, side = R, uplo = L, trans = T, diag = N): `B ← B · L⁻ᵀ`.
///
/// * `l`: `n × n` lower-triangular factor (only the lower triangle, diagonal
///   included, is read), length `n * n`;
/// * `b`: `m × n`, length `m * n`, overwritten with the solution `X` of
///   `X Lᵀ = B`.
///
/// A zero diagonal in `l` yields infinities/NaNs in `b`, not a panic.
///
/// # Errors
/// [`KernelError::Shape`] if a length is wrong (nothing is written).
pub fn trsm(m: usize, n: usize, l: &[f64], b: &mut [f64]) -> Result<(), KernelError> {
    check_len("l", elems(n, n)?, l.len())?;
    check_len("b", elems(m, n)?, b.len())?;
    let l = MatRef::from_column_major_slice(l, n, n);
    let mut b = MatMut::from_column_major_slice_mut(b, m, n);
    // X Lᵀ = B  <=>  L Xᵀ = Bᵀ.
    faer::linalg::triangular_solve::solve_lower_triangular_in_place(l, b.rb_mut().transpose_mut(), Par::Seq);
    Ok(())
}

/// Symmetric rank-k update of a lower triangle (BLAS `DSYRK`, uplo = L,
/// trans = N, alpha = −1, beta = 1): `C ← C − A·Aᵀ` on the lower triangle.
///
/// * `a`: `n × k`, length `n * k`;
/// * `c`: `n × n`, length `n * n`; its lower triangle (diagonal included) is
///   updated, its strict upper triangle is neither read nor written.
///
/// # Errors
/// [`KernelError::Shape`] if a length is wrong (nothing is written).
pub fn syrk(n: usize, k: usize, a: &[f64], c: &mut [f64]) -> Result<(), KernelError> {
    check_len("a", elems(n, k)?, a.len())?;
    check_len("c", elems(n, n)?, c.len())?;
    let a = MatRef::from_column_major_slice(a, n, k);
    let c = MatMut::from_column_major_slice_mut(c, n, n);
    faer::linalg::matmul::triangular::matmul(
        c,
        BlockStructure::TriangularLower,
        Accum::Add,
        a,
        BlockStructure::Rectangular,
        a.transpose(),
        BlockStructure::Rectangular,
        -1.0,
        Par::Seq,
    );
    Ok(())
}

/// General update with the second operand transposed (BLAS `DGEMM`,
/// transa = N, transb = T, alpha = −1, beta = 1): `C ← C − A·Bᵀ`.
///
/// * `a`: `m × k`, length `m * k`;
/// * `b`: `n × k`, length `n * k`;
/// * `c`: `m × n`, length `m * n`.
///
/// # Errors
/// [`KernelError::Shape`] if a length is wrong (nothing is written).
pub fn gemm_nt(m: usize, n: usize, k: usize, a: &[f64], b: &[f64], c: &mut [f64]) -> Result<(), KernelError> {
    check_len("a", elems(m, k)?, a.len())?;
    check_len("b", elems(n, k)?, b.len())?;
    check_len("c", elems(m, n)?, c.len())?;
    let a = MatRef::from_column_major_slice(a, m, k);
    let b = MatRef::from_column_major_slice(b, n, k);
    let c = MatMut::from_column_major_slice_mut(c, m, n);
    faer::linalg::matmul::matmul(c, Accum::Add, a, b.transpose(), -1.0, Par::Seq);
    Ok(())
}

/// Forward substitution with a lower-triangular tile (BLAS `DTRSV`, uplo = L,
/// trans = N, diag = N): `x ← L⁻¹ x`.
///
/// * `l`: `n × n` lower-triangular (only the lower triangle is read), length
///   `n * n`;
/// * `x`: length `n`, overwritten with the solution of `L y = x`.
///
/// A zero diagonal in `l` yields infinities/NaNs, not a panic.
///
/// # Errors
/// [`KernelError::Shape`] if a length is wrong (nothing is written).
pub fn trsv_lower(n: usize, l: &[f64], x: &mut [f64]) -> Result<(), KernelError> {
    check_len("l", elems(n, n)?, l.len())?;
    check_len("x", n, x.len())?;
    let l = MatRef::from_column_major_slice(l, n, n);
    let x = MatMut::from_column_major_slice_mut(x, n, 1);
    faer::linalg::triangular_solve::solve_lower_triangular_in_place(l, x, Par::Seq);
    Ok(())
}

/// Matrix-vector update (BLAS `DGEMV`, trans = N, alpha = −1, beta = 1):
/// `y ← y − A·x`.
///
/// * `a`: `m × n` column-major, length `m * n`;
/// * `x`: length `n`;
/// * `y`: length `m`.
///
/// # Errors
/// [`KernelError::Shape`] if a length is wrong (nothing is written).
pub fn gemv_sub(m: usize, n: usize, a: &[f64], x: &[f64], y: &mut [f64]) -> Result<(), KernelError> {
    check_len("a", elems(m, n)?, a.len())?;
    check_len("x", n, x.len())?;
    check_len("y", m, y.len())?;
    let a = MatRef::from_column_major_slice(a, m, n);
    let x = MatRef::from_column_major_slice(x, n, 1);
    let y = MatMut::from_column_major_slice_mut(y, m, 1);
    faer::linalg::matmul::matmul(y, Accum::Add, a, x, -1.0, Par::Seq);
    Ok(())
}

/// `Σᵢ ln L_ii` over the diagonal of an `n × n` Cholesky factor tile.
///
/// The log-determinant of the matrix factored is `log det A = 2 Σ ln L_ii`
/// summed over all diagonal tiles, so a diagonal tile contributes **twice**
/// the value returned here.
///
/// * `l`: `n × n` column-major, length `n * n`; only the diagonal is read.
///
/// # Errors
/// * [`KernelError::Shape`] if `l.len() != n * n`;
/// * [`KernelError::NotPositiveDefinite`] with the column of the first
///   diagonal entry that is not strictly positive (or is NaN): such a tile is
///   not a Cholesky factor.
pub fn lower_logdet(n: usize, l: &[f64]) -> Result<f64, KernelError> {
    check_len("l", elems(n, n)?, l.len())?;
    let mut sum = 0.0;
    for i in 0..n {
        let d = l[i + i * n];
        if d.is_nan() || d <= 0.0 {
            return Err(KernelError::NotPositiveDefinite { column: i });
        }
        sum += d.ln();
    }
    Ok(sum)
}

/// Squared Frobenius norm `Σ a_ij²` of an `m × n` tile (any layout: every
/// element is summed once).
///
/// Summation is compensated (Neumaier's improved Kahan–Babuška algorithm,
/// Neumaier 1974, ZAMM 54), so the error is `O(ε)` relative to the sum of
/// squares, independent of `m·n`. Used for residual norms.
///
/// # Errors
/// [`KernelError::Shape`] if `a.len() != m * n`.
pub fn sum_squares(m: usize, n: usize, a: &[f64]) -> Result<f64, KernelError> {
    check_len("a", elems(m, n)?, a.len())?;
    let mut sum = 0.0f64;
    let mut comp = 0.0f64;
    for &v in a {
        let x = v * v;
        let t = sum + x;
        if sum.abs() >= x {
            comp += (sum - t) + x;
        } else {
            comp += (x - t) + sum;
        }
        sum = t;
    }
    Ok(sum + comp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spd::splitmix64;

    fn rand_vec(seed: u64, len: usize) -> Vec<f64> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = splitmix64(s);
                (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
            })
            .collect()
    }

    /// A = M Mᵀ + n I with random M: SPD but not diagonally dominant.
    fn random_spd(seed: u64, n: usize) -> Vec<f64> {
        let m = rand_vec(seed, n * n);
        let mut a = vec![0.0; n * n];
        for j in 0..n {
            for i in 0..n {
                let mut s = 0.0;
                for k in 0..n {
                    s += m[i + k * n] * m[j + k * n];
                }
                a[i + j * n] = s + if i == j { n as f64 * 0.1 } else { 0.0 };
            }
        }
        a
    }

    fn get_tile(a: &[f64], n: usize, r0: usize, c0: usize, rows: usize, cols: usize) -> Vec<f64> {
        let mut t = vec![0.0; rows * cols];
        for j in 0..cols {
            for i in 0..rows {
                t[i + j * rows] = a[(r0 + i) + (c0 + j) * n];
            }
        }
        t
    }

    /// Tiled right-looking Cholesky with the given (uneven) tile sizes,
    /// returning the assembled lower factor.
    fn tiled_cholesky(a: &[f64], n: usize, sizes: &[usize]) -> Vec<f64> {
        let offs: Vec<usize> = sizes
            .iter()
            .scan(0, |acc, &s| {
                let o = *acc;
                *acc += s;
                Some(o)
            })
            .collect();
        let t = sizes.len();
        let mut tiles: Vec<Vec<Vec<f64>>> = (0..t)
            .map(|i| {
                (0..t)
                    .map(|j| get_tile(a, n, offs[i], offs[j], sizes[i], sizes[j]))
                    .collect()
            })
            .collect();
        for k in 0..t {
            potrf(sizes[k], &mut tiles[k][k]).unwrap();
            for i in k + 1..t {
                let lkk = tiles[k][k].clone();
                trsm(sizes[i], sizes[k], &lkk, &mut tiles[i][k]).unwrap();
            }
            for i in k + 1..t {
                let aik = tiles[i][k].clone();
                syrk(sizes[i], sizes[k], &aik, &mut tiles[i][i]).unwrap();
                for j in k + 1..i {
                    let ajk = tiles[j][k].clone();
                    gemm_nt(sizes[i], sizes[j], sizes[k], &aik, &ajk, &mut tiles[i][j]).unwrap();
                }
            }
        }
        let mut l = vec![0.0; n * n];
        for i in 0..t {
            for j in 0..=i {
                for c in 0..sizes[j] {
                    for r in 0..sizes[i] {
                        l[(offs[i] + r) + (offs[j] + c) * n] = tiles[i][j][r + c * sizes[i]];
                    }
                }
            }
        }
        l
    }

    fn max_rel_diff(x: &[f64], y: &[f64]) -> f64 {
        let scale = y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        x.iter().zip(y).fold(0.0f64, |m, (a, b)| m.max((a - b).abs())) / scale
    }

    #[test]
    fn tiled_matches_dense() {
        for (seed, sizes) in [
            (1u64, vec![6, 6]),
            (2, vec![5, 3]),
            (3, vec![4, 3, 5]),
            (4, vec![7, 1, 2, 6]),
        ] {
            let n: usize = sizes.iter().sum();
            let a = random_spd(seed, n);
            let mut dense = a.clone();
            dense_cholesky(n, &mut dense, 1).unwrap();
            let tiled = tiled_cholesky(&a, n, &sizes);
            let d = max_rel_diff(&tiled, &dense);
            assert!(d < 1e-12, "sizes {sizes:?}: rel diff {d}");
            // dense holds exactly L: strict upper is zero, and L Lᵀ = A.
            for j in 0..n {
                for i in 0..n {
                    if i < j {
                        assert_eq!(dense[i + j * n], 0.0);
                    }
                    let s: f64 = (0..n).map(|k| dense[i + k * n] * dense[j + k * n]).sum();
                    assert!((s - a[i + j * n]).abs() < 1e-12 * n as f64);
                }
            }
        }
    }

    #[test]
    fn potrf_reads_lower_only_and_zeroes_upper() {
        let n = 5;
        let a = random_spd(9, n);
        let mut reference = a.clone();
        potrf(n, &mut reference).unwrap();
        let mut garbage = a.clone();
        for j in 1..n {
            for i in 0..j {
                garbage[i + j * n] = f64::NAN;
            }
        }
        potrf(n, &mut garbage).unwrap();
        assert_eq!(garbage, reference);
    }

    #[test]
    fn syrk_leaves_strict_upper() {
        let (n, k) = (4, 3);
        let a = rand_vec(5, n * k);
        let mut c = rand_vec(6, n * n);
        let c0 = c.clone();
        syrk(n, k, &a, &mut c).unwrap();
        for j in 0..n {
            for i in 0..n {
                if i < j {
                    assert_eq!(c[i + j * n], c0[i + j * n]);
                } else {
                    let s: f64 = (0..k).map(|p| a[i + p * n] * a[j + p * n]).sum();
                    assert!((c[i + j * n] - (c0[i + j * n] - s)).abs() < 1e-14);
                }
            }
        }
    }

    #[test]
    fn not_positive_definite() {
        let mut a = random_spd(11, 4);
        a[2 + 2 * 4] = -1.0;
        match potrf(4, &mut a) {
            Err(KernelError::NotPositiveDefinite { column }) => assert_eq!(column, 2),
            other => panic!("expected NotPositiveDefinite, got {other:?}"),
        }
        let mut b = vec![-1.0];
        assert!(matches!(
            dense_cholesky(1, &mut b, 1),
            Err(KernelError::NotPositiveDefinite { column: 0 })
        ));
        let mut c = vec![4.0, 0.0, 0.0, -2.0];
        assert!(matches!(
            potrf(2, &mut c),
            Err(KernelError::NotPositiveDefinite { column: 1 })
        ));
        // Column index is global even inside faer's blocked/recursive code.
        for (n, bad) in [(100, 70), (300, 257), (64, 0), (64, 63)] {
            let mut big = vec![0.0; n * n];
            crate::spd::spd_tile(3, n, 0, 0, n, n, &mut big).unwrap();
            big[bad + bad * n] = -1e6;
            match dense_cholesky(n, &mut big, 1) {
                Err(KernelError::NotPositiveDefinite { column }) => assert_eq!(column, bad),
                other => panic!("expected NotPositiveDefinite, got {other:?}"),
            }
        }
        let mut nan = vec![f64::NAN; 9];
        assert!(potrf(3, &mut nan).is_err());
        assert!(matches!(
            lower_logdet(2, &[1.0, 0.0, 0.0, 0.0]),
            Err(KernelError::NotPositiveDefinite { column: 1 })
        ));
    }

    #[test]
    fn shape_errors() {
        fn is_shape(r: Result<(), KernelError>, name: &str) {
            match r {
                Err(KernelError::Shape { what, .. }) => assert_eq!(what, name),
                other => panic!("expected Shape({name}), got {other:?}"),
            }
        }
        let mut v = vec![0.0; 8];
        is_shape(potrf(3, &mut v), "a");
        is_shape(dense_cholesky(3, &mut v, 1), "a");
        is_shape(trsm(2, 3, &[0.0; 8], &mut [0.0; 6]), "l");
        is_shape(trsm(2, 3, &[0.0; 9], &mut [0.0; 5]), "b");
        is_shape(syrk(3, 2, &[0.0; 5], &mut [0.0; 9]), "a");
        is_shape(syrk(3, 2, &[0.0; 6], &mut [0.0; 8]), "c");
        is_shape(gemm_nt(2, 3, 4, &[0.0; 7], &[0.0; 12], &mut [0.0; 6]), "a");
        is_shape(gemm_nt(2, 3, 4, &[0.0; 8], &[0.0; 11], &mut [0.0; 6]), "b");
        is_shape(gemm_nt(2, 3, 4, &[0.0; 8], &[0.0; 12], &mut [0.0; 7]), "c");
        is_shape(trsv_lower(3, &[0.0; 8], &mut [0.0; 3]), "l");
        is_shape(trsv_lower(3, &[0.0; 9], &mut [0.0; 2]), "x");
        is_shape(gemv_sub(2, 3, &[0.0; 5], &[0.0; 3], &mut [0.0; 2]), "a");
        is_shape(gemv_sub(2, 3, &[0.0; 6], &[0.0; 2], &mut [0.0; 2]), "x");
        is_shape(gemv_sub(2, 3, &[0.0; 6], &[0.0; 3], &mut [0.0; 3]), "y");
        is_shape(lower_logdet(2, &[1.0; 3]).map(|_| ()), "l");
        is_shape(sum_squares(2, 2, &[1.0; 3]).map(|_| ()), "a");
        assert!(matches!(
            potrf(usize::MAX, &mut v),
            Err(KernelError::InvalidArgument(_))
        ));
        // Empty tiles are valid no-ops.
        potrf(0, &mut []).unwrap();
        gemm_nt(0, 0, 0, &[], &[], &mut []).unwrap();
    }

    #[test]
    fn trsv_and_gemv_match_naive() {
        let n = 6;
        let mut l = random_spd(21, n);
        potrf(n, &mut l).unwrap();
        let b = rand_vec(22, n);
        let mut x = b.clone();
        trsv_lower(n, &l, &mut x).unwrap();
        let mut naive = b.clone();
        for i in 0..n {
            let mut s = naive[i];
            for k in 0..i {
                s -= l[i + k * n] * naive[k];
            }
            naive[i] = s / l[i + i * n];
        }
        assert!(max_rel_diff(&x, &naive) < 1e-13);

        let (m, k) = (5, 4);
        let a = rand_vec(23, m * k);
        let xv = rand_vec(24, k);
        let mut y = rand_vec(25, m);
        let mut y_naive = y.clone();
        gemv_sub(m, k, &a, &xv, &mut y).unwrap();
        for (i, yi) in y_naive.iter_mut().enumerate() {
            for (p, xp) in xv.iter().enumerate() {
                *yi -= a[i + p * m] * xp;
            }
        }
        assert!(max_rel_diff(&y, &y_naive) < 1e-14);
    }

    #[test]
    fn trsm_solves() {
        let (m, n) = (3, 4);
        let mut l = random_spd(31, n);
        potrf(n, &mut l).unwrap();
        let b = rand_vec(32, m * n);
        let mut x = b.clone();
        trsm(m, n, &l, &mut x).unwrap();
        // X Lᵀ should reproduce B.
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..n).map(|p| x[i + p * m] * l[j + p * n]).sum();
                assert!((s - b[i + j * m]).abs() < 1e-14);
            }
        }
    }

    #[test]
    fn logdet_and_sum_squares() {
        let l = [2.0, 1.0, 0.0, 3.0];
        let v = lower_logdet(2, &l).unwrap();
        assert!((v - 6.0f64.ln()).abs() < 1e-15);
        assert_eq!(sum_squares(2, 2, &l).unwrap(), 14.0);
        // Compensation: 1 + many tiny squares that plain summation would drop.
        let mut a = vec![1e-9; 1001];
        a[0] = 1.0;
        let s = sum_squares(1, 1001, &a).unwrap();
        let plain: f64 = a.iter().map(|v| v * v).sum();
        assert_eq!(plain, 1.0);
        assert!((s - (1.0 + 1e-15)).abs() < 3e-16, "{s}");
    }
}
