//! The data and memory layer's live counters: per device (written by the GPU manager), the
//! host and disk tiers (written by the I/O thread), and the traffic this layer and the transfer
//! layer move. Relaxed atomics, read at any time; the runtime assembles them with the other
//! layers' into its statistics.

use ferry_base::traffic::{PathCounters, Traffic, TrafficPath};
use std::sync::atomic::AtomicU64;

/// The GPU manager's phases (`manager::phases`): idle, commands, copies, launch, poll,
/// finalize, callbacks.
pub const PHASES: usize = crate::manager::PHASES;

/// Per-device counters, written by the GPU manager.
#[derive(Default)]
pub struct DeviceCounters {
    /// GPU tasks finalized on the device.
    pub tasks: AtomicU64,
    /// Copies evicted from the pool.
    pub evictions: AtomicU64,
    /// Dirty copies written back to the host before eviction.
    pub writebacks: AtomicU64,
    /// Allocations the pool could not serve at once.
    pub alloc_failures: AtomicU64,
    /// Tasks that waited for memory, and for how long in all, ns.
    pub alloc_waits: AtomicU64,
    /// Nanoseconds tasks waited for memory.
    pub alloc_wait_ns: AtomicU64,
    /// Write-backs made ahead of need to keep the low-water mark clean.
    pub cleanings: AtomicU64,
    /// Host→device copies of data a peer-linked device held or was staging in.
    pub host_duplicates: AtomicU64,
    /// Bytes this device received over peer links, per source device.
    pub peer_from: Vec<AtomicU64>,
    /// Tasks released early by launched tasks (launch-ahead).
    pub launched_ahead: AtomicU64,
    /// Tasks launched ahead onto the stream of the predecessor they follow (stream affinity).
    pub followed: AtomicU64,
    /// Part writers placed here while another member of their group was in flight here.
    pub parts_together: AtomicU64,
    /// comm-in copies whose consumers were launched behind them (comm-in ahead).
    pub comm_in_ahead: AtomicU64,
    /// Sends of tiles produced here that left at their producer's launch (offers at launch).
    pub offered_at_launch: AtomicU64,
    /// Tasks whose stream waited here for consumers' device acknowledgements of IPC sends.
    pub acked_on_device: AtomicU64,
    /// Acknowledgements this device's comm streams wrote behind IPC pulls.
    pub acks_written: AtomicU64,
    /// IPC pulls offered at launch enqueued with no stream wait (their producer's signal seen
    /// in its host mirror), those that waited on the device, and batches held for the mirror
    /// past `FERRY_OFFER_POLL_US`.
    pub offers_seen: AtomicU64,
    /// Offered pulls whose stream waited on the device for the producer's signal.
    pub offers_waited: AtomicU64,
    /// Batches held for the host mirror past `FERRY_OFFER_POLL_US`.
    pub offers_held_out: AtomicU64,
    /// Batches of independent transfer copies enqueued with one driver call, and the copies in
    /// them.
    pub copy_batches: AtomicU64,
    /// Copies in those batches.
    pub batched_copies: AtomicU64,
}

/// Counters of the host and disk tiers, written by the I/O thread (and by whoever allocates a
/// host buffer, for the peak).
#[derive(Default)]
pub struct TierCounters {
    /// Most bytes of host tile buffers in use at once.
    pub host_peak: AtomicU64,
    /// Host copies dropped because their data was valid elsewhere.
    pub host_drops: AtomicU64,
    /// Copies written to the disk tier.
    pub spills: AtomicU64,
    /// Bytes written to the disk tier.
    pub spill_bytes: AtomicU64,
    /// Nanoseconds spent writing to the disk tier.
    pub spill_ns: AtomicU64,
    /// Copies read back from the disk tier.
    pub loads: AtomicU64,
    /// Bytes read back from the disk tier.
    pub load_bytes: AtomicU64,
    /// Nanoseconds spent reading from the disk tier.
    pub load_ns: AtomicU64,
    /// Loads made ahead of need by the prefetcher.
    pub prefetches: AtomicU64,
    /// Loads a consumer waited for.
    pub demand_loads: AtomicU64,
    /// Nanoseconds consumers waited for loads.
    pub demand_wait_ns: AtomicU64,
}

/// The data and memory layer's counters (shared with the transfer layer, which counts its
/// traffic here too).
pub struct MemoryCounters {
    /// Bytes and transfers per path moved by the GPU manager, the tiers and the transfer layer.
    pub traffic: Traffic,
    /// Per device, by index.
    pub devices: Vec<DeviceCounters>,
    /// The host and disk tiers.
    pub tier: TierCounters,
    /// Nanoseconds the GPU manager spent working (not napping).
    pub gpu_manager_busy_ns: AtomicU64,
    /// Times the GPU manager blocked on its channel for want of work.
    pub gpu_manager_naps: AtomicU64,
    /// The GPU manager's wall time by phase, ns, indexed as [`PHASES`] says.
    pub gpu_phase_ns: [AtomicU64; PHASES],
}

impl MemoryCounters {
    /// Counters for `devices` devices, all zero.
    pub fn new(devices: usize) -> MemoryCounters {
        MemoryCounters {
            traffic: Traffic::default(),
            devices: (0..devices)
                .map(|_| DeviceCounters {
                    peer_from: (0..devices).map(|_| AtomicU64::new(0)).collect(),
                    ..DeviceCounters::default()
                })
                .collect(),
            tier: TierCounters::default(),
            gpu_manager_busy_ns: AtomicU64::new(0),
            gpu_manager_naps: AtomicU64::new(0),
            gpu_phase_ns: Default::default(),
        }
    }

    /// The counters of device `d`.
    ///
    /// # Panics
    /// `d` is not a device of these counters.
    pub fn device(&self, d: usize) -> &DeviceCounters {
        &self.devices[d]
    }

    /// The counters of path `p`.
    pub fn path(&self, p: TrafficPath) -> &PathCounters {
        self.traffic.path(p)
    }
}
