//! A reproducible, generated symmetric positive definite matrix whose tiles
//! can be computed independently (no communication needed to build it).

use crate::error::{check_len, check_range, elems, KernelError};

/// The SplitMix64 mixing function: one step of Steele, Lea & Flood's
/// SplitMix generator ("Fast splittable pseudorandom number generators",
/// OOPSLA 2014), as popularised by Vigna's `splitmix64.c`: adds the golden
/// gamma `0x9E3779B97F4A7C15` and applies the finaliser. A bijection on `u64`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in `[0, 1)` from the top 53 bits of a hash of `(seed, lo, hi)`.
fn uniform(seed: u64, lo: usize, hi: usize) -> f64 {
    // usize -> u64 is lossless on every platform Rust supports (≤ 64 bits).
    let h = splitmix64(splitmix64(splitmix64(seed) ^ lo as u64) ^ hi as u64);
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Entry `(i, j)` (zero-based) of the generated `n × n` SPD matrix for `seed`.
///
/// * off-diagonal (`i != j`): uniform in `[−0.5, 0.5)`, from SplitMix64 of
///   `(seed, min(i, j), max(i, j))`, hence symmetric;
/// * diagonal: `n + u` with `u` uniform in `[0, 1)`.
///
/// Positive definiteness (Gershgorin circle theorem): every row has
/// off-diagonal absolute sum `≤ (n − 1) / 2 < n ≤ a_ii`, so the symmetric
/// matrix is strictly diagonally dominant with a positive diagonal and all its
/// eigenvalues lie in `[n − (n−1)/2, n + 1 + (n−1)/2)`, i.e. are positive; the
/// condition number is below 3.
///
/// Defined for any indices (no panic); the guarantee concerns `i, j < n`.
pub fn spd_entry(seed: u64, n: usize, i: usize, j: usize) -> f64 {
    let (lo, hi) = if i <= j { (i, j) } else { (j, i) };
    let u = uniform(seed, lo, hi);
    if i == j {
        n as f64 + u
    } else {
        u - 0.5
    }
}

/// Fills a column-major `rows × cols` tile of the generated matrix whose
/// top-left entry is the global entry `(i0, j0)`:
/// `out[r + c * rows] = spd_entry(seed, n, i0 + r, j0 + c)`.
///
/// # Errors
/// * [`KernelError::Shape`] if `out.len() != rows * cols`;
/// * [`KernelError::InvalidArgument`] if the tile does not fit inside the
///   `n × n` matrix (`i0 + rows > n` or `j0 + cols > n`).
pub fn spd_tile(
    seed: u64,
    n: usize,
    i0: usize,
    j0: usize,
    rows: usize,
    cols: usize,
    out: &mut [f64],
) -> Result<(), KernelError> {
    check_len("out", elems(rows, cols)?, out.len())?;
    check_range("row", i0, rows, n)?;
    check_range("column", j0, cols, n)?;
    if rows == 0 {
        return Ok(());
    }
    for (c, col) in out.chunks_exact_mut(rows).enumerate() {
        for (r, v) in col.iter_mut().enumerate() {
            *v = spd_entry(seed, n, i0 + r, j0 + c);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tile::dense_cholesky;

    #[test]
    fn symmetric_bounded_and_spd() {
        let n = 40;
        let mut a = vec![0.0; n * n];
        spd_tile(42, n, 0, 0, n, n, &mut a).unwrap();
        for i in 0..n {
            for j in 0..n {
                assert_eq!(a[i + j * n].to_bits(), a[j + i * n].to_bits());
                if i == j {
                    assert!(a[i + j * n] >= n as f64 && a[i + j * n] < n as f64 + 1.0);
                } else {
                    assert!((-0.5..0.5).contains(&a[i + j * n]));
                }
            }
        }
        dense_cholesky(n, &mut a, 1).unwrap();
        // Different seeds differ.
        assert_ne!(spd_entry(1, n, 3, 5), spd_entry(2, n, 3, 5));
    }

    #[test]
    fn tiles_agree_with_whole() {
        let n = 10;
        let mut whole = vec![0.0; n * n];
        spd_tile(7, n, 0, 0, n, n, &mut whole).unwrap();
        let (i0, j0, rows, cols) = (3, 6, 5, 4);
        let mut t = vec![0.0; rows * cols];
        spd_tile(7, n, i0, j0, rows, cols, &mut t).unwrap();
        for c in 0..cols {
            for r in 0..rows {
                assert_eq!(t[r + c * rows], whole[(i0 + r) + (j0 + c) * n]);
            }
        }
    }

    #[test]
    fn errors() {
        let mut t = vec![0.0; 6];
        assert!(matches!(
            spd_tile(0, 10, 0, 0, 2, 3, &mut t[..5]),
            Err(KernelError::Shape { .. })
        ));
        assert!(matches!(
            spd_tile(0, 10, 9, 0, 2, 3, &mut t),
            Err(KernelError::InvalidArgument(_))
        ));
        assert!(matches!(
            spd_tile(0, 10, 0, usize::MAX, 2, 3, &mut t),
            Err(KernelError::InvalidArgument(_))
        ));
    }
}
