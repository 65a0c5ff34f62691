//! A counter-based random number generator: Philox4x32-10 (J. K. Salmon, M. A. Moraes,
//! R. O. Dror, D. E. Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
//! generator of cuRAND's `curandStatePhilox4_32_10_t`, here with its whole state in 32 bytes that
//! a task keeps in a tile — on the device when the task runs there — and that a checkpoint saves
//! like any other tile.
//!
//! The CPU version below and the NVRTC kernel `ferry_philox_noise` ([`crate::cuda`]) produce the
//! same bits: integer arithmetic, and one exact scaling to a double.

/// Multipliers and key increments of Philox4x32 (the paper's constants).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: the 128-bit block for counter `ctr` under key `key`.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// The generator state of one tile: a key and a 64-bit position (how many values it has
/// produced). 32 bytes, `repr(C)`: stored in a tile of four `u64`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PhiloxState {
    /// The key (two 32-bit words in the low 64 bits; the high half is unused, zero).
    pub key: u64,
    /// Values produced so far: value `k` comes from counter `(position + k, stream)`.
    pub position: u64,
    /// Distinguishes independent streams under one key (e.g. a tile index).
    pub stream: u64,
    /// Reserved (zero), for alignment to 32 bytes.
    pub reserved: u64,
}

impl PhiloxState {
    /// A fresh state for `(seed, stream)`.
    pub fn new(seed: u64, stream: u64) -> PhiloxState {
        PhiloxState {
            key: seed,
            position: 0,
            stream,
            reserved: 0,
        }
    }

    /// The `k`-th uniform double in [0, 1) after the current position, without advancing:
    /// block for counter `(position + k, stream)`, its first two words as 53 bits × 2⁻⁵³.
    pub fn uniform_at(&self, k: u64) -> f64 {
        let n = self.position.wrapping_add(k);
        let ctr = [
            n as u32,
            (n >> 32) as u32,
            self.stream as u32,
            (self.stream >> 32) as u32,
        ];
        let key = [self.key as u32, (self.key >> 32) as u32];
        let x = philox4x32_10(ctr, key);
        let bits = (u64::from(x[0]) << 21) ^ (u64::from(x[1]) >> 11);
        (bits & ((1u64 << 53) - 1)) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// Adds `amplitude · (u − ½)` to each value of `out` (u uniform in [0, 1)), one value per
    /// element in order, and advances the position past them.
    pub fn add_noise(&mut self, amplitude: f64, out: &mut [f64]) {
        for (k, x) in out.iter_mut().enumerate() {
            *x += amplitude * (self.uniform_at(k as u64) - 0.5);
        }
        self.position = self.position.wrapping_add(out.len() as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123 `tests/kat_vectors`, the three `philox4x32 10` lines (counter, key, result).
    #[test]
    fn known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn noise_advances_and_is_reproducible() {
        let mut a = PhiloxState::new(7, 3);
        let mut x = vec![0.0; 100];
        a.add_noise(2.0, &mut x);
        assert_eq!(a.position, 100);
        assert!(x.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = x.iter().sum::<f64>() / 100.0;
        assert!(mean.abs() < 0.3, "{mean}");
        // Two halves from a saved state give the same bits as one pass.
        let mut b = PhiloxState::new(7, 3);
        let mut y = vec![0.0; 100];
        b.add_noise(2.0, &mut y[..40]);
        let saved = b;
        let mut c = saved;
        c.add_noise(2.0, &mut y[40..]);
        assert_eq!(x, y);
        assert_ne!(
            PhiloxState::new(7, 4).uniform_at(0),
            PhiloxState::new(7, 3).uniform_at(0)
        );
    }
}
