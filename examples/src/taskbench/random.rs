//! Task Bench's deterministic pseudo-random numbers (`core/core_random.c`): SipHash-2-4 with
//! the 16-byte key 1, 2, …, 15, 0 over a key of 64-bit integers (their little-endian bytes),
//! the 64-bit hash scaled by 2^-64 to [0, 1). Used by `random_nearest` and the
//! `load_imbalance` kernel, so that every rank, and Task Bench's own implementations, draw the
//! same graph and the same iteration counts.
//!
//! SipHash: Jean-Philippe Aumasson and Daniel J. Bernstein, "SipHash: a fast short-input PRF"
//! (INDOCRYPT 2012); the implementation is the `siphasher` crate's.

use siphasher::sip::SipHasher24;
use std::hash::Hasher;

/// The key bytes 1, 2, …, 15, 0 as SipHash's two little-endian words.
const K0: u64 = 0x0807_0605_0403_0201;
const K1: u64 = 0x000f_0e0d_0c0b_0a09;

/// A uniform number in [0, 1) determined by `key` (Task Bench's `random_uniform`).
pub fn uniform(key: &[i64]) -> f64 {
    let mut h = SipHasher24::new_with_keys(K0, K1);
    for k in key {
        h.write(&k.to_le_bytes());
    }
    h.finish() as f64 * (0.5f64).powi(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values printed by Task Bench's own `random_uniform` (its `core_random.c` and
    /// `siphash.c`, built with gcc) for the same keys.
    #[test]
    fn matches_task_bench() {
        assert_eq!(uniform(&[0, 3, 1, 2, 5]), 0.852_967_503_015_015_2);
        assert_eq!(uniform(&[0, 10, 1]), 0.078_198_395_148_027_8);
        assert_eq!(uniform(&[2, 5, 0, 7, 9]), 0.288_404_379_712_265_3);
    }

    #[test]
    fn uniform_is_in_range_and_deterministic() {
        let a = uniform(&[0, 3, 1, 2, 5]);
        assert!((0.0..1.0).contains(&a));
        assert_eq!(a, uniform(&[0, 3, 1, 2, 5]));
        assert_ne!(a, uniform(&[0, 3, 1, 5, 2]));
    }
}
