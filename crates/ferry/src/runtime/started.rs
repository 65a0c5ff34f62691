//! The GPU manager and the I/O thread of a rank, held from their start to their stop.

use ferry_memory::manager::{GpuCmd, GpuHandle};
use ferry_memory::tier::HostTier;
use std::sync::Arc;
use std::thread::JoinHandle;

/// The GPU manager and the I/O thread, as start-up starts them; the runtime keeps them here.
///
/// [`StartedThreads::stop`] — called by [`Runtime::shutdown`](super::Runtime::shutdown), and by
/// the drop — stops each and joins it, GPU manager first. So a start-up that fails after them
/// (workers or a watchdog thread that cannot be spawned, a failed GPU-direct self-check, the
/// clock synchronisation), by an error return or a panic's unwinding, leaves no thread of it
/// behind, and the process can start another runtime or exit. (The worker pool stops itself
/// when dropped: start-up declares it after this guard, so that it is dropped, and its workers
/// stopped, first. The MPI thread is `Runtime::start`'s own to stop: it started first and ends
/// last.)
#[derive(Default)]
pub(super) struct StartedThreads {
    gpu: Option<(GpuHandle, JoinHandle<()>)>,
    io: Option<(Arc<HostTier>, JoinHandle<()>)>,
    /// The engine's mappings of the node's other ranks' device pools, which the GPU manager
    /// copies through: let go of once it has stopped.
    peer_pools: Vec<ferry_engine::PeerMapping>,
}

impl StartedThreads {
    /// Holds the GPU manager: `handle` commands it, `join` ends with its thread.
    pub(super) fn gpu(&mut self, handle: GpuHandle, join: JoinHandle<()>) {
        self.gpu = Some((handle, join));
    }

    /// Holds the engine's mappings of peers' pools until the GPU manager has stopped.
    pub(super) fn peer_pools(&mut self, mappings: Vec<ferry_engine::PeerMapping>) {
        self.peer_pools = mappings;
    }

    /// Holds the I/O thread of the host tier `tier`.
    pub(super) fn io(&mut self, tier: Arc<HostTier>, join: JoinHandle<()>) {
        self.io = Some((tier, join));
    }

    /// Stops the GPU manager, then the I/O thread, and joins each (those that started).
    /// Idempotent.
    pub(super) fn stop(&mut self) {
        if let Some((gpu, join)) = self.gpu.take() {
            // A manager that already ended (it panicked) has closed its channel: nothing to
            // tell it, and its join returns at once.
            let _ = gpu.post(GpuCmd::Shutdown);
            let _ = join.join();
        }
        // Its copies have all completed (its backend synchronised its devices as it dropped).
        self.peer_pools.clear();
        if let Some((tier, join)) = self.io.take() {
            tier.shutdown();
            let _ = join.join();
        }
    }
}

impl Drop for StartedThreads {
    fn drop(&mut self) {
        self.stop();
    }
}
