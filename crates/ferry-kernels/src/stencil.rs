//! 2D 5-point explicit heat-equation (Jacobi) update on row-major tiles.
//!
//! A tile is a row-major `rows × cols` block of `f64` (element `(r, c)` at
//! `u[r * cols + c]`). Its four halos are passed explicitly: `north` is the
//! row just above the tile (length `cols`), `south` the row just below
//! (length `cols`), `west` the column just left (length `rows`), `east` the
//! column just right (length `rows`). Dirichlet zero boundaries are passed by
//! the caller as zero slices.
//!
//! Every cell is updated with exactly
//! `out = u + alpha * (((n + s) + (w + e)) - 4.0 * u)`,
//! always in that association order and without fused multiply-add, so the
//! result is bit-identical whatever the tiling of the global grid.
//! This is the forward-Euler discretisation of `∂u/∂t = κ ∇²u` with
//! `alpha = κ Δt / h²`; it is stable for `alpha ≤ 1/4`.

use crate::error::{check_len, elems, KernelError};

/// The single-cell update. Written literally; Rust never contracts floating
/// point expressions into FMAs, so this is bit-reproducible.
#[inline(always)]
fn cell(alpha: f64, u: f64, n: f64, s: f64, w: f64, e: f64) -> f64 {
    u + alpha * (((n + s) + (w + e)) - 4.0 * u)
}

/// Updates one row: `cur` holds the old values of the row, `north`/`south`
/// the old rows above and below, `w`/`e` the west/east halo values.
#[inline]
fn step_row(alpha: f64, cur: &[f64], north: &[f64], south: &[f64], w: f64, e: f64, out: &mut [f64]) {
    let cols = cur.len();
    match cols {
        0 => {}
        1 => out[0] = cell(alpha, cur[0], north[0], south[0], w, e),
        _ => {
            out[0] = cell(alpha, cur[0], north[0], south[0], w, cur[1]);
            for c in 1..cols - 1 {
                out[c] = cell(alpha, cur[c], north[c], south[c], cur[c - 1], cur[c + 1]);
            }
            let l = cols - 1;
            out[l] = cell(alpha, cur[l], north[l], south[l], cur[l - 1], e);
        }
    }
}

struct Halos<'a> {
    north: &'a [f64],
    south: &'a [f64],
    west: &'a [f64],
    east: &'a [f64],
}

fn check_step(rows: usize, cols: usize, u_len: usize, h: &Halos<'_>) -> Result<(), KernelError> {
    check_len("u", elems(rows, cols)?, u_len)?;
    check_len("north", cols, h.north.len())?;
    check_len("south", cols, h.south.len())?;
    check_len("west", rows, h.west.len())?;
    check_len("east", rows, h.east.len())
}

/// One explicit 5-point Jacobi step on a tile, out of place.
///
/// * `u`, `out`: row-major `rows × cols`, length `rows * cols`;
/// * `north`, `south`: length `cols`; `west`, `east`: length `rows` (see the
///   module docs for their meaning);
/// * `alpha`: dimensionless diffusion number `κ Δt / h²` (stable for
///   `alpha ≤ 1/4`; not checked).
///
/// `out[r, c] = u + alpha * (((n + s) + (w + e)) - 4.0 * u)` with `n, s, w, e`
/// the four neighbours of `(r, c)`, taken from the halos at the tile edges.
/// Empty tiles (`rows == 0` or `cols == 0`) are valid no-ops.
///
/// # Errors
/// [`KernelError::Shape`] if any slice length is wrong (nothing is written);
/// `InvalidArgument` if `rows * cols` overflows.
#[allow(clippy::too_many_arguments)]
pub fn jacobi_step(
    rows: usize,
    cols: usize,
    alpha: f64,
    u: &[f64],
    north: &[f64],
    south: &[f64],
    west: &[f64],
    east: &[f64],
    out: &mut [f64],
) -> Result<(), KernelError> {
    let h = Halos {
        north,
        south,
        west,
        east,
    };
    check_step(rows, cols, u.len(), &h)?;
    check_len("out", u.len(), out.len())?;
    if cols == 0 {
        return Ok(());
    }
    for r in 0..rows {
        let cur = &u[r * cols..(r + 1) * cols];
        let n = if r == 0 { north } else { &u[(r - 1) * cols..r * cols] };
        let s = if r + 1 == rows {
            south
        } else {
            &u[(r + 1) * cols..(r + 2) * cols]
        };
        step_row(alpha, cur, n, s, west[r], east[r], &mut out[r * cols..(r + 1) * cols]);
    }
    Ok(())
}

/// The interior of [`jacobi_step`]: the cells `1..rows-1 × 1..cols-1` of
/// `out`, which need no halo (nothing when `rows` or `cols` < 3). With
/// [`jacobi_ring`] on the same `out` the result is bit-identical to
/// [`jacobi_step`]: the two split one step so that a tile's interior can be
/// updated while its halos are still in transit (overlapping communication
/// with computation, as in NVIDIA's multi-GPU Jacobi sample).
///
/// # Errors
/// [`KernelError::Shape`] if a length is wrong (nothing is written).
pub fn jacobi_interior(rows: usize, cols: usize, alpha: f64, u: &[f64], out: &mut [f64]) -> Result<(), KernelError> {
    check_len("u", elems(rows, cols)?, u.len())?;
    check_len("out", u.len(), out.len())?;
    if rows < 3 || cols < 3 {
        return Ok(());
    }
    for r in 1..rows - 1 {
        let (n, cur, s) = (&u[(r - 1) * cols..], &u[r * cols..], &u[(r + 1) * cols..]);
        let o = &mut out[r * cols..(r + 1) * cols];
        for c in 1..cols - 1 {
            o[c] = cell(alpha, cur[c], n[c], s[c], cur[c - 1], cur[c + 1]);
        }
    }
    Ok(())
}

/// The ring of [`jacobi_step`]: the first and last rows and columns of `out`
/// (every cell when `rows` or `cols` < 3), with the halos as in
/// [`jacobi_step`]. See [`jacobi_interior`].
///
/// # Errors
/// [`KernelError::Shape`] if a length is wrong (nothing is written).
#[allow(clippy::too_many_arguments)]
pub fn jacobi_ring(
    rows: usize,
    cols: usize,
    alpha: f64,
    u: &[f64],
    north: &[f64],
    south: &[f64],
    west: &[f64],
    east: &[f64],
    out: &mut [f64],
) -> Result<(), KernelError> {
    let h = Halos {
        north,
        south,
        west,
        east,
    };
    check_step(rows, cols, u.len(), &h)?;
    check_len("out", u.len(), out.len())?;
    if cols == 0 {
        return Ok(());
    }
    let at = |r: usize, c: usize| {
        let n = if r == 0 { north[c] } else { u[(r - 1) * cols + c] };
        let s = if r + 1 == rows { south[c] } else { u[(r + 1) * cols + c] };
        let w = if c == 0 { west[r] } else { u[r * cols + c - 1] };
        let e = if c + 1 == cols { east[r] } else { u[r * cols + c + 1] };
        cell(alpha, u[r * cols + c], n, s, w, e)
    };
    for r in 0..rows {
        if r == 0 || r + 1 == rows || cols < 3 {
            for c in 0..cols {
                out[r * cols + c] = at(r, c);
            }
        } else {
            out[r * cols] = at(r, 0);
            out[r * cols + cols - 1] = at(r, cols - 1);
        }
    }
    Ok(())
}

/// One explicit 5-point Jacobi step on a tile, in place; bit-identical to
/// [`jacobi_step`] with the same arguments.
///
/// * `u`: row-major `rows × cols`, length `rows * cols`; overwritten with the
///   new values;
/// * halos and `alpha` as in [`jacobi_step`].
///
/// Scratch: one heap allocation of `2 * cols` `f64` per call (two row
/// buffers holding the old values of the previous and the current row, since
/// those are overwritten before their last use).
///
/// # Errors
/// [`KernelError::Shape`] if any slice length is wrong (nothing is written);
/// `InvalidArgument` if `rows * cols` overflows.
#[allow(clippy::too_many_arguments)]
pub fn jacobi_step_in_place(
    rows: usize,
    cols: usize,
    alpha: f64,
    u: &mut [f64],
    north: &[f64],
    south: &[f64],
    west: &[f64],
    east: &[f64],
) -> Result<(), KernelError> {
    let h = Halos {
        north,
        south,
        west,
        east,
    };
    check_step(rows, cols, u.len(), &h)?;
    if cols == 0 {
        return Ok(());
    }
    let mut scratch = vec![0.0; 2 * cols];
    let (mut prev, mut cur) = scratch.split_at_mut(cols);
    for r in 0..rows {
        cur.copy_from_slice(&u[r * cols..(r + 1) * cols]);
        let (done, rest) = u.split_at_mut((r + 1) * cols);
        let out = &mut done[r * cols..];
        let n: &[f64] = if r == 0 { north } else { prev };
        let s: &[f64] = if r + 1 == rows { south } else { &rest[..cols] };
        step_row(alpha, cur, n, s, west[r], east[r], out);
        std::mem::swap(&mut prev, &mut cur);
    }
    Ok(())
}

/// Copies the first row (row 0) of a row-major `rows × cols` tile into `dst`
/// (length `cols`): the `south` halo of the tile above.
///
/// # Errors
/// `Shape` if `u.len() != rows * cols` or `dst.len() != cols`;
/// `InvalidArgument` if `rows == 0`.
pub fn copy_first_row(rows: usize, cols: usize, u: &[f64], dst: &mut [f64]) -> Result<(), KernelError> {
    check_row_copy(rows, cols, u, dst)?;
    dst.copy_from_slice(&u[..cols]);
    Ok(())
}

/// Copies the last row (row `rows − 1`) of a row-major `rows × cols` tile into
/// `dst` (length `cols`): the `north` halo of the tile below.
///
/// # Errors
/// `Shape` if `u.len() != rows * cols` or `dst.len() != cols`;
/// `InvalidArgument` if `rows == 0`.
pub fn copy_last_row(rows: usize, cols: usize, u: &[f64], dst: &mut [f64]) -> Result<(), KernelError> {
    check_row_copy(rows, cols, u, dst)?;
    dst.copy_from_slice(&u[(rows - 1) * cols..]);
    Ok(())
}

/// Copies the first column (column 0) of a row-major `rows × cols` tile into
/// `dst` (length `rows`): the `east` halo of the tile to the left.
///
/// # Errors
/// `Shape` if `u.len() != rows * cols` or `dst.len() != rows`;
/// `InvalidArgument` if `cols == 0`.
pub fn copy_first_col(rows: usize, cols: usize, u: &[f64], dst: &mut [f64]) -> Result<(), KernelError> {
    check_col_copy(rows, cols, u, dst)?;
    for (d, row) in dst.iter_mut().zip(u.chunks_exact(cols)) {
        *d = row[0];
    }
    Ok(())
}

/// Copies the last column (column `cols − 1`) of a row-major `rows × cols`
/// tile into `dst` (length `rows`): the `west` halo of the tile to the right.
///
/// # Errors
/// `Shape` if `u.len() != rows * cols` or `dst.len() != rows`;
/// `InvalidArgument` if `cols == 0`.
pub fn copy_last_col(rows: usize, cols: usize, u: &[f64], dst: &mut [f64]) -> Result<(), KernelError> {
    check_col_copy(rows, cols, u, dst)?;
    for (d, row) in dst.iter_mut().zip(u.chunks_exact(cols)) {
        *d = row[cols - 1];
    }
    Ok(())
}

fn check_row_copy(rows: usize, cols: usize, u: &[f64], dst: &[f64]) -> Result<(), KernelError> {
    check_len("u", elems(rows, cols)?, u.len())?;
    check_len("dst", cols, dst.len())?;
    if rows == 0 {
        return Err(KernelError::InvalidArgument("tile has no rows".into()));
    }
    Ok(())
}

fn check_col_copy(rows: usize, cols: usize, u: &[f64], dst: &[f64]) -> Result<(), KernelError> {
    check_len("u", elems(rows, cols)?, u.len())?;
    check_len("dst", rows, dst.len())?;
    if cols == 0 {
        return Err(KernelError::InvalidArgument("tile has no columns".into()));
    }
    Ok(())
}

/// The lowest discrete sine eigenmode on an `N × N` interior grid
/// (`N = n_global`): `sin(π x_i) · sin(π x_j)` with `x_i = (i + 1) / (N + 1)`,
/// `i = gi`, `j = gj` (global zero-based indices).
///
/// The mode vanishes at the Dirichlet boundary `i = −1` and `i = N`, so it is
/// an eigenvector of the update with zero halos at the grid edges; see
/// [`sine_mode_decay`]. Defined (and panic-free) for any indices; meaningful
/// for `gi, gj < N`.
pub fn sine_mode(n_global: usize, gi: usize, gj: usize) -> f64 {
    let h = 1.0 / (n_global as f64 + 1.0);
    let xi = (gi as f64 + 1.0) * h;
    let xj = (gj as f64 + 1.0) * h;
    (std::f64::consts::PI * xi).sin() * (std::f64::consts::PI * xj).sin()
}

/// Exact per-step amplification factor `g = 1 − 8 · alpha · sin²(π h / 2)`,
/// `h = 1 / (N + 1)`, of [`sine_mode`] under the Jacobi update.
///
/// Derivation: for `v_i = sin(π x_i)`,
/// `v_{i+1} + v_{i−1} − 2 v_i = 2 v_i (cos(π h) − 1) = −4 sin²(π h / 2) v_i`.
/// The 2D stencil `(n + s) + (w + e) − 4u` is the sum of that second
/// difference in each direction, i.e. `−8 sin²(π h / 2) u`, so one step maps
/// `u ↦ (1 − 8 alpha sin²(π h / 2)) u` and `T` steps multiply by `g^T`
/// (up to rounding).
pub fn sine_mode_decay(n_global: usize, alpha: f64) -> f64 {
    let h = 1.0 / (n_global as f64 + 1.0);
    let s = (std::f64::consts::PI * h / 2.0).sin();
    1.0 - 8.0 * alpha * s * s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Interior then ring gives exactly the bits of one whole step, for thin and square tiles.
    #[test]
    fn interior_and_ring_make_one_step() {
        for (rows, cols) in [(1, 1), (1, 7), (6, 1), (2, 5), (3, 3), (4, 9), (17, 13)] {
            let val = |k: usize| ((k * 7919) % 1013) as f64 / 97.0 - 3.0;
            let u: Vec<f64> = (0..rows * cols).map(val).collect();
            let north: Vec<f64> = (0..cols).map(|k| val(k + 5000)).collect();
            let south: Vec<f64> = (0..cols).map(|k| val(k + 6000)).collect();
            let west: Vec<f64> = (0..rows).map(|k| val(k + 7000)).collect();
            let east: Vec<f64> = (0..rows).map(|k| val(k + 8000)).collect();
            let mut whole = vec![0.0; rows * cols];
            jacobi_step(rows, cols, 0.2, &u, &north, &south, &west, &east, &mut whole).unwrap();
            let mut split = vec![f64::NAN; rows * cols];
            jacobi_interior(rows, cols, 0.2, &u, &mut split).unwrap();
            jacobi_ring(rows, cols, 0.2, &u, &north, &south, &west, &east, &mut split).unwrap();
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&split), bits(&whole), "{rows} x {cols}");
        }
        let mut out = vec![0.0; 4];
        assert!(jacobi_interior(2, 3, 0.2, &[0.0; 6], &mut out).is_err());
    }

    /// Runs `steps` steps on an `n × n` grid split into `tr × tc` tiles
    /// (uneven sizes), copying halos between tiles, and returns the global
    /// row-major field.
    fn run_tiled(n: usize, tr: usize, tc: usize, alpha: f64, steps: usize, init: &[f64]) -> Vec<f64> {
        let split = |parts: usize| -> Vec<(usize, usize)> {
            (0..parts)
                .map(|p| (p * n / parts, (p + 1) * n / parts - p * n / parts))
                .collect()
        };
        let rs = split(tr);
        let cs = split(tc);
        let mut tiles: Vec<Vec<Vec<f64>>> = rs
            .iter()
            .map(|&(r0, nr)| {
                cs.iter()
                    .map(|&(c0, nc)| {
                        let mut t = vec![0.0; nr * nc];
                        for r in 0..nr {
                            for c in 0..nc {
                                t[r * nc + c] = init[(r0 + r) * n + c0 + c];
                            }
                        }
                        t
                    })
                    .collect()
            })
            .collect();
        for _ in 0..steps {
            let old = tiles.clone();
            for (a, &(_, nr)) in rs.iter().enumerate() {
                for (b, &(_, nc)) in cs.iter().enumerate() {
                    let mut north = vec![0.0; nc];
                    let mut south = vec![0.0; nc];
                    let mut west = vec![0.0; nr];
                    let mut east = vec![0.0; nr];
                    if a > 0 {
                        copy_last_row(rs[a - 1].1, nc, &old[a - 1][b], &mut north).unwrap();
                    }
                    if a + 1 < tr {
                        copy_first_row(rs[a + 1].1, nc, &old[a + 1][b], &mut south).unwrap();
                    }
                    if b > 0 {
                        copy_last_col(nr, cs[b - 1].1, &old[a][b - 1], &mut west).unwrap();
                    }
                    if b + 1 < tc {
                        copy_first_col(nr, cs[b + 1].1, &old[a][b + 1], &mut east).unwrap();
                    }
                    jacobi_step(
                        nr,
                        nc,
                        alpha,
                        &old[a][b],
                        &north,
                        &south,
                        &west,
                        &east,
                        &mut tiles[a][b],
                    )
                    .unwrap();
                }
            }
        }
        let mut out = vec![0.0; n * n];
        for (a, &(r0, nr)) in rs.iter().enumerate() {
            for (b, &(c0, nc)) in cs.iter().enumerate() {
                for r in 0..nr {
                    for c in 0..nc {
                        out[(r0 + r) * n + c0 + c] = tiles[a][b][r * nc + c];
                    }
                }
            }
        }
        out
    }

    fn noise(n: usize) -> Vec<f64> {
        let mut s = 7u64;
        (0..n * n)
            .map(|_| {
                s = crate::spd::splitmix64(s);
                (s >> 11) as f64 / (1u64 << 53) as f64
            })
            .collect()
    }

    #[test]
    fn tiling_is_bit_identical() {
        let n = 17;
        let init = noise(n);
        let whole = run_tiled(n, 1, 1, 0.2, 10, &init);
        let tiled = run_tiled(n, 2, 3, 0.2, 10, &init);
        assert!(whole.iter().zip(&tiled).all(|(a, b)| a.to_bits() == b.to_bits()));
        let fine = run_tiled(n, 17, 5, 0.2, 10, &init);
        assert!(whole.iter().zip(&fine).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn sine_mode_decays_exactly() {
        let n = 24;
        let alpha = 0.23;
        let steps = 50;
        let init: Vec<f64> = (0..n * n).map(|k| sine_mode(n, k / n, k % n)).collect();
        let out = run_tiled(n, 2, 3, alpha, steps, &init);
        let g = sine_mode_decay(n, alpha).powi(steps as i32);
        let scale = out.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = out.iter().zip(&init).fold(0.0f64, |m, (o, i)| m.max((o - g * i).abs()));
        assert!(err / scale < 1e-12, "relative error {}", err / scale);
        assert!(g < 0.9, "the test should actually decay (g^T = {g})");
    }

    #[test]
    fn in_place_matches_out_of_place() {
        for (rows, cols) in [(5, 7), (1, 4), (4, 1), (1, 1), (3, 2)] {
            let u = noise(rows.max(cols))[..rows * cols].to_vec();
            let halo = |len: usize, k: f64| -> Vec<f64> { (0..len).map(|i| k + i as f64 * 0.1).collect() };
            let (n, s, w, e) = (halo(cols, 1.0), halo(cols, 2.0), halo(rows, 3.0), halo(rows, 4.0));
            let mut out = vec![0.0; rows * cols];
            jacobi_step(rows, cols, 0.21, &u, &n, &s, &w, &e, &mut out).unwrap();
            let mut v = u.clone();
            jacobi_step_in_place(rows, cols, 0.21, &mut v, &n, &s, &w, &e).unwrap();
            assert!(out.iter().zip(&v).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn shape_errors() {
        let u = vec![0.0; 6];
        let mut out = vec![0.0; 6];
        let z2 = [0.0; 2];
        let z3 = [0.0; 3];
        let shape = |r: Result<(), KernelError>, name: &str| match r {
            Err(KernelError::Shape { what, .. }) => assert_eq!(what, name),
            other => panic!("expected Shape({name}), got {other:?}"),
        };
        // rows = 2, cols = 3.
        shape(jacobi_step(2, 3, 0.1, &u[..5], &z3, &z3, &z2, &z2, &mut out), "u");
        shape(jacobi_step(2, 3, 0.1, &u, &z2, &z3, &z2, &z2, &mut out), "north");
        shape(jacobi_step(2, 3, 0.1, &u, &z3, &z2, &z2, &z2, &mut out), "south");
        shape(jacobi_step(2, 3, 0.1, &u, &z3, &z3, &z3, &z2, &mut out), "west");
        shape(jacobi_step(2, 3, 0.1, &u, &z3, &z3, &z2, &z3, &mut out), "east");
        shape(jacobi_step(2, 3, 0.1, &u, &z3, &z3, &z2, &z2, &mut out[..5]), "out");
        let mut v = u.clone();
        shape(jacobi_step_in_place(2, 3, 0.1, &mut v, &z3, &z3, &z2, &z3), "east");
        let mut d = [0.0; 3];
        shape(copy_first_row(2, 3, &u, &mut d[..2]), "dst");
        shape(copy_last_row(2, 3, &u[..4], &mut d), "u");
        shape(copy_first_col(2, 3, &u, &mut d), "dst");
        shape(copy_last_col(3, 2, &u, &mut d[..2]), "dst");
        assert!(matches!(
            copy_first_row(0, 3, &[], &mut d),
            Err(KernelError::InvalidArgument(_))
        ));
        assert!(matches!(
            copy_last_col(3, 0, &[], &mut d),
            Err(KernelError::InvalidArgument(_))
        ));
        // Empty tiles are fine.
        jacobi_step(0, 3, 0.1, &[], &z3, &z3, &[], &[], &mut []).unwrap();
        jacobi_step_in_place(2, 0, 0.1, &mut [], &[], &[], &z2, &z2).unwrap();
    }

    #[test]
    fn edge_copies() {
        let u: Vec<f64> = (0..6).map(f64::from).collect(); // 2 × 3
        let mut r = [0.0; 3];
        let mut c = [0.0; 2];
        copy_first_row(2, 3, &u, &mut r).unwrap();
        assert_eq!(r, [0.0, 1.0, 2.0]);
        copy_last_row(2, 3, &u, &mut r).unwrap();
        assert_eq!(r, [3.0, 4.0, 5.0]);
        copy_first_col(2, 3, &u, &mut c).unwrap();
        assert_eq!(c, [0.0, 3.0]);
        copy_last_col(2, 3, &u, &mut c).unwrap();
        assert_eq!(c, [2.0, 5.0]);
    }
}
