//! Which of a rank's devices a ready GPU task goes to.

use super::{GpuTask, Manager};
use ferry_device::Backend;

/// Bandwidth assumed for a peer copy when choosing a device, bytes/s (NVLink peer copies measure
/// 200–390 GB/s on H200 NV18; PCIe peers are slower; a conservative middle).
const PEER_BW: f64 = 100e9;
/// Bandwidth assumed for a host→device copy when choosing a device, bytes/s (pinned: ~50 GB/s;
/// pageable: 6.8–9.4 GB/s measured; the lower one, so data stays where it is).
const H2D_BW: f64 = 8e9;

impl<B: Backend> Manager<B> {
    /// The device where the task is expected to finish first: the time to drain the device's
    /// queue (tasks in flight × moving-average service time ÷ exec streams) plus the time to bring
    /// the task's inputs that are not there (peer copy when another device holds them, else from
    /// the host), in the spirit of StarPU's `dmda` and HEFT (Topcuoglu et al., IEEE TPDS 2002).
    /// Ties go round-robin, so work with no resident data spreads out.
    pub(super) fn choose(&mut self, t: &GpuTask) -> usize {
        let n = self.mem.pools.len();
        if n == 1 {
            return 0;
        }
        self.adm.rotate = (self.adm.rotate + 1) % n;
        let streams = self.b.exec_streams().max(1) as f64;
        // Per tile: bytes, whether the task reads it, and a bitmask of the devices holding it.
        let states: Vec<(f64, bool, u64)> = t
            .tiles
            .iter()
            .map(|x| {
                let s = x.copy.lock();
                let valid = s
                    .dev
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.valid)
                    .fold(0u64, |m, (e, _)| m | 1 << e);
                (x.copy.bytes() as f64, x.mode.reads(), valid)
            })
            .collect();
        let mut best: Option<(usize, f64)> = None;
        for k in 0..n {
            let d = (self.adm.rotate + k) % n;
            let wait = self.adm.load[d] as f64 * self.adm.service_s[d] / streams;
            let here = 1u64 << d;
            let transfer: f64 = states
                .iter()
                .filter(|(_, reads, valid)| *reads && valid & here == 0)
                .map(|(bytes, _, valid)| if *valid != 0 { bytes / PEER_BW } else { bytes / H2D_BW })
                .sum();
            // A written tile that lives elsewhere also drags its later users along.
            let scatter: f64 = states
                .iter()
                .filter(|(_, reads, valid)| !*reads && valid & !here != 0)
                .map(|(b, _, _)| b / PEER_BW)
                .sum();
            let cost = wait + transfer + scatter;
            if best.is_none_or(|(_, c)| cost < c) {
                best = Some((d, cost));
            }
        }
        best.map_or(0, |(d, _)| d)
    }
}
