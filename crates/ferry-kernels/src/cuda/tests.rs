use super::*;
use crate::spd::{spd_entry, splitmix64};

// CPU mirror of the CUDA C in `KERNELS`, line by line (C `unsigned long
// long` arithmetic wraps, hence `wrapping_*`; `(double)x` of a u64 rounds
// to nearest like Rust's `as f64`).

/// Mirror of `ferry_splitmix64`.
fn c_splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15); // u64 z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9); // z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB); // z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^ (z >> 31) // return z ^ (z >> 31);
}

/// Mirror of `ferry_uniform`.
fn c_uniform(seed: u64, lo: u64, hi: u64) -> f64 {
    let h = c_splitmix64(c_splitmix64(c_splitmix64(seed) ^ lo) ^ hi);
    (h >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0) // (double)(h >> 11) * (1.0 / 9007199254740992.0)
}

/// Mirror of `ferry_spd_entry`.
fn c_spd_entry(seed: u64, n: u64, i: u64, j: u64) -> f64 {
    let lo = if i <= j { i } else { j };
    let hi = if i <= j { j } else { i };
    let u = c_uniform(seed, lo, hi);
    if i == j {
        n as f64 + u
    } else {
        u - 0.5
    }
}

#[test]
fn c_mirror_matches_spd_entry_bitwise() {
    let mut s = 0x1234_5678u64;
    let mut next = || {
        s = splitmix64(s);
        s
    };
    for k in 0..5000 {
        let seed = next();
        let n = (next() % 1_000_000) as usize + 1;
        let i = (next() % n as u64) as usize;
        // Every 4th sample on the diagonal.
        let j = if k % 4 == 0 { i } else { (next() % n as u64) as usize };
        let got = c_spd_entry(seed, n as u64, i as u64, j as u64);
        let want = spd_entry(seed, n, i, j);
        assert_eq!(got.to_bits(), want.to_bits(), "seed {seed} n {n} i {i} j {j}");
        assert_eq!(c_splitmix64(seed), splitmix64(seed));
    }
    // Huge indices too (spd_entry is defined for any indices).
    for &(i, j) in &[(usize::MAX, 0), (0, usize::MAX), (usize::MAX, usize::MAX)] {
        let got = c_spd_entry(7, u64::MAX, i as u64, j as u64);
        assert_eq!(got.to_bits(), spd_entry(7, usize::MAX, i, j).to_bits());
    }
    assert_eq!(
        (1.0f64 / 9_007_199_254_740_992.0).to_bits(),
        (1.0 / (1u64 << 53) as f64).to_bits()
    );
}

#[test]
fn kernel_source_has_every_function_and_constant() {
    for name in KERNEL_NAMES {
        assert!(
            KERNELS.contains(&format!("extern \"C\" __global__ void {name}(")),
            "{name} missing from KERNELS"
        );
    }
    // The constants the CPU mirror uses appear verbatim in the C source.
    for lit in [
        "x + 0x9E3779B97F4A7C15ULL",
        "(z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL",
        "(z ^ (z >> 27)) * 0x94D049BB133111EBULL",
        "return z ^ (z >> 31);",
        "ferry_splitmix64(ferry_splitmix64(ferry_splitmix64(seed) ^ lo) ^ hi)",
        "(double)(h >> 11) * (1.0 / 9007199254740992.0)",
        "(i == j) ? ((double)n + u) : (u - 0.5)",
        "out[idx] = uc + alpha * (((n + s) + (w + e)) - 4.0 * uc);",
        "double v = uc + alpha * (((n + s) + (w + e)) - 4.0 * uc);",
    ] {
        assert!(KERNELS.contains(lit), "`{lit}` missing from KERNELS");
    }
    let opts = compile_options(9, 0);
    assert_eq!(opts.fmad, Some(false));
    assert_eq!(opts.options, vec!["--gpu-architecture=compute_90".to_string()]);
}

#[test]
fn dimension_overflow_is_shape() {
    assert_eq!(blas_int("n", 0).unwrap(), 0);
    assert_eq!(blas_int("n", i32::MAX as usize).unwrap(), i32::MAX);
    assert!(matches!(
        blas_int("n", i32::MAX as usize + 1),
        Err(CudaKernelError::Shape(_))
    ));
    assert!(matches!(blas_int("n", usize::MAX), Err(CudaKernelError::Shape(_))));
    assert!(matches!(tile_elems(usize::MAX, 2), Err(CudaKernelError::Shape(_))));
    assert!(matches!(tile_elems(1 << 31, 1 << 30), Err(CudaKernelError::Shape(_))));
    assert_eq!(tile_elems(3, 4).unwrap(), 12);
    assert_eq!(tile_bytes(3, 4).unwrap(), 96);
    assert!(matches!(check_spd_tile(10, 9, 0, 2, 3), Err(CudaKernelError::Shape(_))));
    assert!(matches!(
        check_spd_tile(10, 0, usize::MAX, 2, 3),
        Err(CudaKernelError::Shape(_))
    ));
    check_spd_tile(10, 8, 7, 2, 3).unwrap();
    assert!(matches!(non_null("a", 0), Err(CudaKernelError::Shape(_))));
    assert!(matches!(disjoint("x", 100, 104, 8), Err(CudaKernelError::Shape(_))));
    disjoint("x", 100, 108, 8).unwrap();
    disjoint("x", 100, 100, 0).unwrap();
}

#[test]
fn launch_grid_and_info_mapping() {
    assert!(grid_1d(0).is_none());
    let c = grid_1d(1).unwrap();
    assert_eq!((c.grid_dim, c.block_dim), ((1, 1, 1), (BLOCK, 1, 1)));
    assert_eq!(grid_1d(257).unwrap().grid_dim.0, 2);
    assert_eq!(grid_1d(u64::MAX).unwrap().grid_dim.0, 1 << 16);
    assert!(grid_2d(0, 5).is_none() && grid_2d(5, 0).is_none());
    assert_eq!(grid_2d(2046, 4094).unwrap().grid_dim, (16, 2046, 1));
    assert_eq!(grid_2d(1, 1 << 30).unwrap().grid_dim, (1 << 16, 1, 1));
    assert_eq!(grid_2d(1 << 20, 1 << 20).unwrap().grid_dim, (1, 65_535, 1));
    assert_eq!(grid_2d(4096, 4096).unwrap().grid_dim, (16, 4096, 1));
    info_to_result(0).unwrap();
    assert!(matches!(
        info_to_result(1),
        Err(CudaKernelError::NotPositiveDefinite { column: 0 })
    ));
    assert!(matches!(
        info_to_result(17),
        Err(CudaKernelError::NotPositiveDefinite { column: 16 })
    ));
    assert!(matches!(info_to_result(-3), Err(CudaKernelError::Solver(_))));
    assert!(matches!(info_to_result(i32::MIN), Err(CudaKernelError::Solver(_))));
}
