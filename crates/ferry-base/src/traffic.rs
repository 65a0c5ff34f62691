//! Traffic counters: bytes, messages and busy time per [`TrafficPath`] a payload travels, written by
//! the thread that moves the bytes (the MPI thread, the GPU manager, the transfer layer's
//! callbacks) and read at any time as relaxed atomics. Every layer that moves payload counts
//! here, so the vocabulary of paths lives at the bottom.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// A way a payload travels. Each transfer is counted under exactly one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TrafficPath {
    /// Host memory to host memory over MPI, at most `FERRY_EAGER_BYTES`: posted at once.
    HostEager,
    /// Host memory to host memory over MPI, larger: posted within the send window.
    HostRendezvous,
    /// Host to a local device (stage-in).
    HostToDevice,
    /// A local device to the host (stage-out for a host consumer, write-back on eviction).
    DeviceToHost,
    /// One local device to another (peer copy, e.g. over NVLink).
    DevicePeer,
    /// Between ranks in chunks of `FERRY_BOUNCE_CHUNK` bytes: device data goes through the bounce
    /// pool (device→host of chunk k+1 overlapping the send of chunk k); host data is sent from
    /// where it lies. Counted once per tile, bytes summed over the chunks.
    Staged,
    /// Between ranks with device memory handed straight to a CUDA-aware MPI (GPU-direct).
    GpuDirect,
    /// Between ranks of one node: the consumer copies from the producer's device pool, mapped
    /// once through CUDA IPC (emulated devices: shared memory), on NVLink where there is one.
    Ipc,
    /// Small control messages of the transfer protocols (IPC descriptors and acknowledgements);
    /// not payload, so not counted as traffic of the graph.
    Control,
    /// Messages that carry several small tiles for one peer at once (`FERRY_PACK_BYTES`); their
    /// tiles are counted on the host paths, these are the carriers (header included).
    Packed,
    /// The same control messages as [`TrafficPath::Control`], between ranks of one node through the
    /// shared-memory control ring instead of MPI (`FERRY_CONTROL_RING`).
    ControlRing,
    /// Host memory between ranks of one node in a single copy: the origin reads or writes the
    /// target's registered memory with `process_vm_readv` / `process_vm_writev` (Linux's Cross
    /// Memory Attach), no MPI message and no intermediate buffer.
    Cma,
    /// Small host tiles (one ring slot, at most `FERRY_EAGER_BYTES`) between ranks of one node
    /// through the transfer layer's shared-memory ring (`FERRY_CONTROL_RING`) instead of MPI: the
    /// sender writes the slot itself, the receiver's progress pass copies it out.
    HostRing,
}

impl TrafficPath {
    /// Every path, in table order.
    pub const ALL: [TrafficPath; 13] = [
        TrafficPath::HostEager,
        TrafficPath::HostRendezvous,
        TrafficPath::HostToDevice,
        TrafficPath::DeviceToHost,
        TrafficPath::DevicePeer,
        TrafficPath::Staged,
        TrafficPath::GpuDirect,
        TrafficPath::Ipc,
        TrafficPath::Control,
        TrafficPath::Packed,
        TrafficPath::ControlRing,
        TrafficPath::Cma,
        TrafficPath::HostRing,
    ];

    /// The paths that carry tile payloads between ranks (what a graph's transfers add up to).
    pub const NETWORK: [TrafficPath; 7] = [
        TrafficPath::HostEager,
        TrafficPath::HostRendezvous,
        TrafficPath::Staged,
        TrafficPath::GpuDirect,
        TrafficPath::Ipc,
        TrafficPath::Cma,
        TrafficPath::HostRing,
    ];

    /// Short name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            TrafficPath::HostEager => "host-eager",
            TrafficPath::HostRendezvous => "host-rendezvous",
            TrafficPath::HostToDevice => "h2d",
            TrafficPath::DeviceToHost => "d2h",
            TrafficPath::DevicePeer => "peer",
            TrafficPath::Staged => "staged",
            TrafficPath::GpuDirect => "gpu-direct",
            TrafficPath::Ipc => "ipc",
            TrafficPath::Control => "control",
            TrafficPath::Packed => "packed",
            TrafficPath::ControlRing => "control-ring",
            TrafficPath::Cma => "cma",
            TrafficPath::HostRing => "host-ring",
        }
    }

    /// Position in [`TrafficPath::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The live counters of one [`TrafficPath`].
#[derive(Default)]
pub struct PathCounters {
    /// Bytes sent (or copied out) on the path.
    pub bytes_sent: AtomicU64,
    /// Bytes received (or copied in) on the path.
    pub bytes_recv: AtomicU64,
    /// Transfers sent.
    pub sends: AtomicU64,
    /// Transfers received.
    pub recvs: AtomicU64,
    /// Nanoseconds during which at least one transfer of the path was in flight.
    pub active_ns: AtomicU64,
}

/// Traffic per [`TrafficPath`]: the live counters of each, written by whichever thread moves the
/// bytes.
#[derive(Default)]
pub struct Traffic {
    paths: [PathCounters; TrafficPath::ALL.len()],
}

impl Traffic {
    /// The counters of path `p`.
    pub fn path(&self, p: TrafficPath) -> &PathCounters {
        &self.paths[p.index()]
    }
}

/// Tracks the time during which at least one transfer of a path is in flight (on the thread that owns the clock).
pub struct ActiveClock {
    in_flight: [usize; TrafficPath::ALL.len()],
    since: [Option<Instant>; TrafficPath::ALL.len()],
}

impl Default for ActiveClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ActiveClock {
    /// A clock with nothing in flight.
    pub fn new() -> Self {
        ActiveClock {
            in_flight: [0; TrafficPath::ALL.len()],
            since: [None; TrafficPath::ALL.len()],
        }
    }

    /// A transfer of path `p` started.
    pub fn start(&mut self, p: TrafficPath) {
        let k = p.index();
        if self.in_flight[k] == 0 {
            self.since[k] = Some(Instant::now());
        }
        self.in_flight[k] += 1;
    }

    /// A transfer of path `p` ended: when it was the last in flight, adds the span since the
    /// first started to `p`'s `active_ns` in `c`.
    pub fn stop(&mut self, p: TrafficPath, c: &Traffic) {
        let k = p.index();
        self.in_flight[k] = self.in_flight[k].saturating_sub(1);
        if self.in_flight[k] == 0 {
            if let Some(t) = self.since[k].take() {
                c.path(p).active_ns.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
            }
        }
    }
}
