//! Opening the devices a rank will drive, from [`crate::DeviceSpec`].

use crate::config::Config;
use crate::stats::Counters;
use ferry_base::error::{FerryError, Result};
use ferry_device::cuda::{self, CudaBackend};
use ferry_device::emu::{EmuBackend, EmuConfig};
use ferry_device::{Backend, DeviceSpec};
use ferry_engine::MpiInfo;
use ferry_memory::data::host_pool::{heap_pool, HostPool};
use ferry_memory::manager::{self, GpuHandle};
use ferry_transfer::bounce::BouncePool;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Capacity of an emulated device when `FERRY_DEVICE_MEM` is not set.
const EMU_DEFAULT_BYTES: u64 = 256 << 20;

/// Pinned host pool size for CUDA devices when `FERRY_HOST_PINNED_BYTES` is not set.
const CUDA_DEFAULT_PINNED: u64 = 4 << 30;
/// Host pool size for emulated devices when `FERRY_HOST_PINNED_BYTES` is not set.
const EMU_DEFAULT_PINNED: u64 = 64 << 20;

/// Opened backends, not yet handed to a GPU manager thread.
pub(super) enum Backends {
    Cuda(CudaBackend),
    Emu(EmuBackend),
}

/// The devices of a rank and the host pool that goes with them.
pub(super) struct Opened {
    backends: Backends,
    count: usize,
    pub(super) host_pool: Option<Arc<HostPool>>,
}

impl Opened {
    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// The PCI addresses of the devices whose backend knows one (CUDA), in device order.
    pub(super) fn pci_addresses(&self) -> Vec<(u32, u8, u8)> {
        (0..self.count)
            .filter_map(|d| match &self.backends {
                Backends::Cuda(x) => x.pci_address(d),
                Backends::Emu(x) => x.pci_address(d),
            })
            .collect()
    }

    /// Whether every device's context is shared through MPS; `None` for backends without MPS
    /// (emulated devices) or a driver that cannot say.
    pub(super) fn mps_enabled(&self) -> Option<bool> {
        match &self.backends {
            Backends::Cuda(x) => (0..self.count)
                .map(|d| x.mps_enabled(d))
                .try_fold(true, |all, m| Some(all && m?)),
            Backends::Emu(_) => None,
        }
    }

    /// Per (a, b): the rank of the peer link from device `a` to `b` (lower is faster), if any.
    pub(super) fn links(&self) -> Vec<Vec<Option<u32>>> {
        (0..self.count)
            .map(|a| {
                (0..self.count)
                    .map(|b| match &self.backends {
                        Backends::Cuda(x) => x.link_rank(a, b),
                        Backends::Emu(x) => x.link_rank(a, b),
                    })
                    .collect()
            })
            .collect()
    }

    /// Device `d` as the communication engine numbers it (the CUDA ordinal; emulated devices
    /// alike in both).
    pub(super) fn engine_device(&self, d: usize) -> usize {
        match &self.backends {
            Backends::Cuda(b) => b.ordinal(d),
            Backends::Emu(_) => d,
        }
    }

    /// Per device, its pool's allocation (pool and signal area): address and bytes, for the
    /// engine to register.
    pub(super) fn pool_allocations(&self) -> Vec<(u64, u64)> {
        self.bases()
            .into_iter()
            .zip(self.pool_bytes())
            .map(|(base, n)| (base, ferry_device::pool_allocation(n)))
            .collect()
    }

    /// Device `d`'s handle of the host mirror of its signal words, made now (`None`: none).
    pub(super) fn signal_mirror_export(&self, d: usize) -> Option<Vec<u8>> {
        match &self.backends {
            Backends::Cuda(b) => b.signal_mirror_export(d),
            Backends::Emu(b) => b.signal_mirror_export(d),
        }
    }

    /// Whether every device publishes a host mirror of its signal words (made by
    /// [`Opened::signal_mirror_export`]).
    pub(super) fn signal_mirrors(&self) -> bool {
        (0..self.count).all(|d| match &self.backends {
            Backends::Cuda(b) => b.publishes_signal_mirror(d),
            Backends::Emu(b) => b.publishes_signal_mirror(d),
        })
    }

    /// Per device, the device address of its pool's offset 0.
    pub(super) fn bases(&self) -> Vec<u64> {
        (0..self.count)
            .map(|d| match &self.backends {
                Backends::Cuda(b) => b.addr(d, 0),
                Backends::Emu(b) => b.addr(d, 0),
            })
            .collect()
    }

    /// Per device, its pool's bytes.
    pub(super) fn pool_bytes(&self) -> Vec<u64> {
        (0..self.count)
            .map(|d| match &self.backends {
                Backends::Cuda(b) => b.pool_bytes(d),
                Backends::Emu(b) => b.pool_bytes(d),
            })
            .collect()
    }

    /// Attaches another process's pool, mapped by the engine at `base`, for copies on local
    /// device `d`.
    pub(super) fn ipc_attach(
        &mut self,
        d: usize,
        base: u64,
        pool_bytes: u64,
        mirror: Option<&[u8]>,
    ) -> std::result::Result<usize, crate::DeviceError> {
        match &mut self.backends {
            Backends::Cuda(b) => b.ipc_attach(d, base, pool_bytes, mirror),
            Backends::Emu(b) => b.ipc_attach(d, base, pool_bytes, mirror),
        }
    }

    /// Whether the pool mapped as `remote` came with a signal mirror that could not be mapped
    /// ([`ferry_device::Backend::ipc_mirror_missing`]).
    pub(super) fn ipc_mirror_missing(&self, remote: usize) -> bool {
        match &self.backends {
            Backends::Cuda(b) => b.ipc_mirror_missing(remote),
            Backends::Emu(b) => b.ipc_mirror_missing(remote),
        }
    }

    /// The bounce pool for staged transfers: pinned for CUDA, plain memory for emulated devices.
    ///
    /// # Errors
    /// Pinning the memory failed.
    pub(super) fn bounce_pool(&self, bytes: usize, chunk: usize) -> Result<BouncePool> {
        match &self.backends {
            Backends::Cuda(b) => {
                // Pinned whole now: every bounce buffer is in use from the first staged transfer.
                let (ptr, release, mut pin) = b.pinnable_region(bytes as u64)?;
                if let Err(e) = pin(ptr as usize, bytes) {
                    release(ptr);
                    return Err(FerryError::Config(format!("bounce pool (FERRY_BOUNCE_BYTES): {e}")));
                }
                // SAFETY: `bytes` of pinned memory owned by the pool until `release`.
                Ok(unsafe { BouncePool::new(ptr, bytes, chunk, release) })
            }
            Backends::Emu(_) => BouncePool::heap(bytes, chunk).ok_or_else(|| {
                FerryError::Config(format!(
                    "cannot allocate a bounce pool of {bytes} bytes for emulated devices (FERRY_BOUNCE_BYTES)"
                ))
            }),
        }
    }

    /// Moves the backend into a new GPU manager thread.
    pub(super) fn start(
        self,
        counters: Arc<Counters>,
        opts: manager::Options,
        died: Box<dyn FnOnce(String) + Send>,
    ) -> std::io::Result<(GpuHandle, JoinHandle<()>, Vec<String>)> {
        match self.backends {
            Backends::Cuda(b) => manager::start(b, counters.memory.clone(), opts, died),
            Backends::Emu(b) => manager::start(b, counters.memory.clone(), opts, died),
        }
    }
}

/// The GPUs local rank `r` of `l` drives among `g` visible ones: `{k : k mod l = r}`, or GPU
/// `r mod g` when there are fewer GPUs than ranks.
fn ordinals(g: usize, r: usize, l: usize) -> Vec<usize> {
    if g >= l {
        (0..g).filter(|k| k % l == r).collect()
    } else {
        vec![r % g]
    }
}

/// How many of `l` local ranks drive the GPU that local rank `r` drives among `g` visible
/// ones (see [`ordinals`]): 1 unless there are fewer GPUs than ranks.
fn sharers(g: usize, r: usize, l: usize) -> usize {
    if g >= l {
        1
    } else {
        (0..l).filter(|k| k % g == r % g).count()
    }
}

/// Opens the devices of `cfg.devices`; `None` for CPU-only runs.
///
/// # Errors
/// `cuda` without a driver or GPU, or a CUDA failure while reserving pools.
pub(super) fn open(cfg: &Config, info: &MpiInfo) -> Result<Option<Opened>> {
    let spec = match cfg.devices {
        DeviceSpec::Auto => match cuda::probe() {
            Ok(_) => DeviceSpec::Cuda,
            Err(e) => {
                tracing::info!(reason = %e, "no CUDA device: running on CPU workers");
                DeviceSpec::None
            }
        },
        s => s,
    };
    Ok(match spec {
        DeviceSpec::None | DeviceSpec::Auto => None,
        DeviceSpec::Emu(k) if !(1..=64).contains(&k) => {
            return Err(crate::FerryError::Config(format!(
                "emu:{k}: between 1 and 64 devices per rank"
            )));
        }
        // The parser never makes an empty mask; a spec built in code can.
        DeviceSpec::CudaOrdinals(0) => {
            return Err(crate::FerryError::Config(
                "cuda: with no ordinal: name at least one GPU (cuda:0)".into(),
            ));
        }
        DeviceSpec::Emu(k) => {
            let b = EmuBackend::new(&EmuConfig {
                devices: k,
                capacity: cfg.device_mem.unwrap_or(EMU_DEFAULT_BYTES),
                exec_streams: cfg.exec_streams.unwrap_or(4),
                fail_alloc: cfg.emu_faults.fail_alloc.clone(),
                fail_copy: cfg.emu_faults.fail_copy.clone(),
                delay_us: cfg.emu_faults.delay_us,
                seed: info.rank as u64 + 1,
            })?;
            let bytes = cfg.host_pinned_bytes.unwrap_or(EMU_DEFAULT_PINNED);
            let host_pool = if bytes > 0 {
                Some(Arc::new(heap_pool(bytes)?))
            } else {
                None
            };
            Some(Opened {
                backends: Backends::Emu(b),
                count: k,
                host_pool,
            })
        }
        DeviceSpec::Cuda | DeviceSpec::CudaOrdinals(_) => {
            let g = cuda::probe()?;
            if g > 64 {
                return Err(crate::FerryError::Config(format!(
                    "{g} GPUs visible; ferry drives at most 64 per rank"
                )));
            }
            // Ranks that share a GPU share its pool fraction: each taking 0.9 of what was free
            // left the last one's context and library handles no room (cuSOLVER failed inside
            // the first kernel of two ranks on one H200).
            let mut fraction = cfg.device_mem_fraction;
            let ords = match cfg.devices {
                DeviceSpec::CudaOrdinals(mask) => {
                    let ords: Vec<usize> = (0..64).filter(|k| mask >> k & 1 == 1).collect();
                    if let Some(&bad) = ords.iter().find(|&&k| k >= g) {
                        return Err(crate::FerryError::Config(format!(
                            "devices cuda:{bad} asked for, but only {g} GPU(s) are visible"
                        )));
                    }
                    ords
                }
                _ => {
                    let (r, l) = (info.local_rank, info.local_size.max(1));
                    fraction /= sharers(g, r, l) as f64;
                    ordinals(g, r, l)
                }
            };
            let mut b = CudaBackend::new(&ords, fraction, cfg.device_mem, cfg.exec_streams.unwrap_or(8))?;
            b.set_sm_copies(
                cfg.sm_copy_bytes as u64,
                cfg.sm_copy_blocks as u32,
                cfg.faults.no_copy_kernel,
            );
            let n = ords.len();
            let bytes = cfg.host_pinned_bytes.unwrap_or(CUDA_DEFAULT_PINNED);
            let host_pool = if bytes > 0 {
                let (ptr, release, pin) = b.pinnable_region(bytes)?;
                // Whole now, or the first part now and the rest on the pool's pinning thread
                // (`FERRY_HOST_PIN_AT_START`, see `host_pool`).
                // SAFETY: `ptr` is `bytes` of page-aligned host memory owned by the pool.
                let first = cfg.host_pin_at_start.unwrap_or(bytes);
                let pool = unsafe { HostPool::pinned_in_parts(ptr, bytes, release, first, pin) }
                    .map_err(|e| FerryError::Config(format!("pinned host pool (FERRY_HOST_PINNED_BYTES): {e}")))?;
                Some(Arc::new(pool))
            } else {
                None
            };
            Some(Opened {
                backends: Backends::Cuda(b),
                count: n,
                host_pool,
            })
        }
        // `DeviceSpec` may gain kinds in the device layer before this runtime opens them.
        other => {
            return Err(crate::FerryError::Config(format!(
                "devices {other:?}: not supported by this runtime"
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{ordinals, sharers};

    /// Specs that only code can build (the parser refuses them) are refused with an error, not
    /// a manager without devices (which divided by zero placing a task).
    #[test]
    fn empty_device_specs_are_refused() {
        let info = ferry_engine::MpiInfo {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            library: String::new(),
            tag_ub: 1 << 20,
            cuda_support: None,
            host: "h".into(),
        };
        for (spec, want) in [
            (crate::DeviceSpec::Emu(0), "emu:0"),
            (crate::DeviceSpec::Emu(65), "emu:65"),
            (crate::DeviceSpec::CudaOrdinals(0), "no ordinal"),
        ] {
            let cfg = crate::config::Config {
                devices: spec,
                ..Default::default()
            };
            match super::open(&cfg, &info) {
                Err(crate::FerryError::Config(m)) => assert!(m.contains(want), "{m}"),
                Err(e) => panic!("{spec:?}: {e}"),
                Ok(_) => panic!("{spec:?} was accepted"),
            }
        }
    }

    #[test]
    fn gpus_are_shared_out_among_local_ranks() {
        assert_eq!(ordinals(2, 0, 1), vec![0, 1]);
        assert_eq!(ordinals(2, 1, 2), vec![1]);
        assert_eq!(ordinals(4, 1, 2), vec![1, 3]);
        assert_eq!(ordinals(1, 3, 4), vec![0]);
    }

    #[test]
    fn ranks_sharing_a_gpu_are_counted() {
        assert_eq!(sharers(2, 0, 1), 1);
        assert_eq!(sharers(2, 1, 2), 1);
        assert_eq!(sharers(1, 0, 2), 2);
        assert_eq!(sharers(1, 3, 4), 4);
        // Three ranks on two GPUs: ranks 0 and 2 share GPU 0, rank 1 has GPU 1.
        assert_eq!(sharers(2, 0, 3), 2);
        assert_eq!(sharers(2, 1, 3), 1);
        assert_eq!(sharers(2, 2, 3), 2);
    }
}
