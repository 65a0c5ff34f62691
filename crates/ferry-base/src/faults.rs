//! Run-time fault injection (`FERRY_FAULTS`), for testing that the runtime absorbs the faults it
//! is meant to absorb (results stay exact) and reports the others.
//!
//! `FERRY_FAULTS` is a comma-separated list:
//!
//! | fault | effect |
//! |---|---|
//! | `mpi-delay:US` | every finished MPI request is reported up to `US` µs late (and so out of order) |
//! | `sched-jitter:US` | every CPU task body starts up to `US` µs late (perturbs worker interleavings) |
//! | `slow-link:MBPS` | every send is posted only after `bytes / MBPS` µs (a slow link) |
//! | `disk-fail:N` | the `N`-th write to the disk tier's spill file (1-based, per rank) fails (not absorbable: the run ends with `FerryError::Spill`) |
//! | `no-copy-kernel:1` | the copy kernel (`FERRY_SM_COPY_BYTES`) fails to build at start-up, as where NVRTC is missing: copies fall back to the copy engines (CUDA only) |
//! | `skip-ack-wait:1` | tasks released on a device acknowledgement (`FERRY_DEVICE_ACK`) do not wait for it: they may overwrite a tile its consumer has not read yet (shows that a check catches that race) |
//! | `start-fail:1` | start-up fails once every thread of the rank has started (as where the watchdog thread cannot be spawned or the GPU-direct self-check fails): `build` returns [`FerryError::Config`] and every thread it started is stopped (on more than one rank the job is aborted, as for any failure past the last start-up agreement) |
//!
//! Delays are pseudo-random but deterministic per rank, thread and event count (splitmix64), so a
//! failing run can be repeated. Emulated devices have their own faults (`FERRY_EMU_FAIL_ALLOC`,
//! `FERRY_EMU_DELAY_US`).

use crate::error::{FerryError, Result};
use std::time::Duration;

/// The faults in force (all off by default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Upper bound of the delay before a finished MPI request is reported, µs.
    pub mpi_delay_us: u64,
    /// Upper bound of the delay before a CPU task body starts, µs.
    pub sched_jitter_us: u64,
    /// Simulated link speed for sends, MB/s (0: off).
    pub slow_link_mbps: u64,
    /// The 1-based spill-file write that fails (0: off).
    pub disk_fail: u64,
    /// The copy kernel fails to build on first use (CUDA; the copies then use the copy engines).
    pub no_copy_kernel: bool,
    /// Tasks released on a device acknowledgement skip the wait for it.
    pub skip_ack_wait: bool,
    /// Start-up fails once every thread has started.
    pub start_fail: bool,
    /// Pinned host allocations of emulated devices fail (the engine's bounce buffers, which it
    /// pins when it first stages), as `cudaHostAlloc` does when pinned memory runs out.
    pub pin_fail: bool,
}

impl std::str::FromStr for Faults {
    type Err = FerryError;

    /// Parses `mpi-delay:US,sched-jitter:US,slow-link:MBPS,disk-fail:N,no-copy-kernel:1,skip-ack-wait:1,start-fail:1,pin-fail:1` (any
    /// subset, any order; empty: none).
    fn from_str(s: &str) -> Result<Faults> {
        let mut f = Faults::default();
        for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let bad = || {
                FerryError::Config(format!(
                    "FERRY_FAULTS item {item:?}: expected mpi-delay:US, sched-jitter:US, slow-link:MBPS, disk-fail:N, no-copy-kernel:1, skip-ack-wait:1, start-fail:1 or pin-fail:1"
                ))
            };
            let (name, value) = item.split_once(':').ok_or_else(bad)?;
            let v: u64 = value.trim().parse().map_err(|_| bad())?;
            match name.trim() {
                "mpi-delay" => f.mpi_delay_us = v,
                "sched-jitter" => f.sched_jitter_us = v,
                "slow-link" => f.slow_link_mbps = v,
                "disk-fail" => f.disk_fail = v,
                "no-copy-kernel" => f.no_copy_kernel = v != 0,
                "skip-ack-wait" => f.skip_ack_wait = v != 0,
                "start-fail" => f.start_fail = v != 0,
                "pin-fail" => f.pin_fail = v != 0,
                _ => return Err(bad()),
            }
        }
        Ok(f)
    }
}

/// A deterministic stream of delays up to a bound.
pub struct Jitter {
    state: u64,
    bound_us: u64,
}

impl Jitter {
    /// Delays of at most `bound_us` µs, the same sequence for the same `seed`.
    pub fn new(seed: u64, bound_us: u64) -> Jitter {
        Jitter {
            state: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed,
            bound_us,
        }
    }

    /// The next delay (zero when the bound is zero).
    pub fn next_delay(&mut self) -> Duration {
        if self.bound_us == 0 {
            return Duration::ZERO;
        }
        self.state = crate::hash::mix(self.state.wrapping_add(1));
        Duration::from_micros(self.state % self.bound_us.saturating_add(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let f: Faults = "mpi-delay:100, sched-jitter:20,slow-link:500".parse().unwrap();
        assert_eq!(
            f,
            Faults {
                mpi_delay_us: 100,
                sched_jitter_us: 20,
                slow_link_mbps: 500,
                disk_fail: 0,
                no_copy_kernel: false,
                skip_ack_wait: false,
                start_fail: false,
                pin_fail: false,
            }
        );
        let f: Faults = "no-copy-kernel:1,disk-fail:3,start-fail:1,pin-fail:1".parse().unwrap();
        assert!(f.no_copy_kernel && f.disk_fail == 3 && f.start_fail && f.pin_fail);
        assert!(!"no-copy-kernel:0".parse::<Faults>().unwrap().no_copy_kernel);
        assert_eq!("".parse::<Faults>().unwrap(), Faults::default());
        assert!("mpi-delay".parse::<Faults>().is_err());
        assert!("disk-full:1".parse::<Faults>().is_err());
        let mut j = Jitter::new(1, 10);
        assert!((0..100).all(|_| j.next_delay() <= Duration::from_micros(10)));
    }
}
