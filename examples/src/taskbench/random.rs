//! Task Bench's deterministic pseudo-random numbers: MurmurHash3 (x64, 128-bit; Austin Appleby,
//! public domain) of a key of 64-bit integers, seed 1234567, first word scaled to [0, 1]. Used by
//! `random_nearest` and the `load_imbalance` kernel, so that every rank (and every
//! implementation) draws the same graph.

const SEED: u64 = 1234567;

fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51afd7ed558ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ceb9fe1a85ec53);
    k ^ (k >> 33)
}

/// MurmurHash3_x64_128 of `data` with `seed`: `(h1, h2)`.
pub fn murmur3_x64_128(data: &[u8], seed: u64) -> (u64, u64) {
    const C1: u64 = 0x87c37b91114253d5;
    const C2: u64 = 0x4cf5ad432745937f;
    let (mut h1, mut h2) = (seed, seed);
    let blocks = data.len() / 16;
    for b in 0..blocks {
        let w = |k: usize| u64::from_le_bytes(data[b * 16 + k..b * 16 + k + 8].try_into().expect("8 bytes"));
        let (mut k1, mut k2) = (w(0), w(8));
        k1 = k1.wrapping_mul(C1).rotate_left(31).wrapping_mul(C2);
        h1 ^= k1;
        h1 = h1
            .rotate_left(27)
            .wrapping_add(h2)
            .wrapping_mul(5)
            .wrapping_add(0x52dce729);
        k2 = k2.wrapping_mul(C2).rotate_left(33).wrapping_mul(C1);
        h2 ^= k2;
        h2 = h2
            .rotate_left(31)
            .wrapping_add(h1)
            .wrapping_mul(5)
            .wrapping_add(0x38495ab5);
    }
    let tail = &data[blocks * 16..];
    let (mut k1, mut k2) = (0u64, 0u64);
    for (i, &b) in tail.iter().enumerate() {
        if i < 8 {
            k1 |= (b as u64) << (8 * i);
        } else {
            k2 |= (b as u64) << (8 * (i - 8));
        }
    }
    if tail.len() > 8 {
        k2 = k2.wrapping_mul(C2).rotate_left(33).wrapping_mul(C1);
        h2 ^= k2;
    }
    if !tail.is_empty() {
        k1 = k1.wrapping_mul(C1).rotate_left(31).wrapping_mul(C2);
        h1 ^= k1;
    }
    h1 ^= data.len() as u64;
    h2 ^= data.len() as u64;
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    h1 = fmix64(h1);
    h2 = fmix64(h2);
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    (h1, h2)
}

/// A uniform number in [0, 1] determined by `key` (Task Bench's `random_uniform`).
pub fn uniform(key: &[i64]) -> f64 {
    let bytes: Vec<u8> = key.iter().flat_map(|k| k.to_le_bytes()).collect();
    let (h1, _) = murmur3_x64_128(&bytes, SEED);
    h1 as f64 * (0.5f64).powi(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur3_known_values() {
        // Reference values of MurmurHash3_x64_128 (seed 0) from the reference implementation.
        assert_eq!(murmur3_x64_128(b"", 0), (0, 0));
        assert_eq!(murmur3_x64_128(b"hello", 0), (0xcbd8a7b341bd9b02, 0x5b1e906a48ae1d19));
    }

    #[test]
    fn uniform_is_in_range_and_deterministic() {
        let a = uniform(&[0, 3, 1, 2, 5]);
        assert!((0.0..=1.0).contains(&a));
        assert_eq!(a, uniform(&[0, 3, 1, 2, 5]));
        assert_ne!(a, uniform(&[0, 3, 1, 5, 2]));
    }
}
