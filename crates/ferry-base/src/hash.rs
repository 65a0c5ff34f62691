//! The 64-bit hash of the inserted sequence that ranks compare to detect diverging graphs.
//!
//! Mixing is splitmix64's finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom number
//! generators", OOPSLA 2014): cheap, and every input bit affects every output bit.

/// splitmix64's finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Folds `v` into the running hash `h`.
pub fn fold(h: u64, v: u64) -> u64 {
    mix(h.rotate_left(5) ^ v.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// Hash of a byte string.
pub fn bytes(b: &[u8]) -> u64 {
    b.chunks(8).fold(b.len() as u64, |h, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        fold(h, u64::from_le_bytes(w))
    })
}
