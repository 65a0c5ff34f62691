//! The threads a rank's start-up has started so far, stopped again if the start-up fails.

use crate::device::manager::{GpuCmd, GpuHandle};
use crate::tier::HostTier;
use std::sync::Arc;
use std::thread::JoinHandle;

/// The GPU manager and the I/O thread, as start-up starts them.
///
/// Until [`StartedThreads::keep`] hands them to the runtime, dropping this stops each and
/// joins it, in the order of [`Runtime::shutdown`](super::Runtime::shutdown) (GPU manager,
/// then I/O thread) — on an error return and on a panic's unwinding alike. So a start-up that
/// fails after them (workers or a watchdog thread that cannot be spawned, a failed GPU-direct
/// self-check, the clock synchronisation) leaves no thread of it behind, and the process can
/// start another runtime or exit. (The worker pool stops itself when dropped: start-up
/// declares it after this guard, so that it is dropped, and its workers stopped, first. The
/// MPI thread is `Runtime::start`'s own to stop: it started first and ends last.)
#[derive(Default)]
pub(super) struct StartedThreads {
    gpu: Option<(GpuHandle, JoinHandle<()>)>,
    io: Option<(Arc<HostTier>, JoinHandle<()>)>,
}

impl StartedThreads {
    /// Holds the GPU manager: `handle` commands it, `join` ends with its thread.
    pub(super) fn gpu(&mut self, handle: GpuHandle, join: JoinHandle<()>) {
        self.gpu = Some((handle, join));
    }

    /// Holds the I/O thread of the host tier `tier`.
    pub(super) fn io(&mut self, tier: Arc<HostTier>, join: JoinHandle<()>) {
        self.io = Some((tier, join));
    }

    /// Start-up succeeded: the join handles of the GPU manager and of the I/O thread (those
    /// that started) go to the runtime, which stops the threads at shutdown.
    pub(super) fn keep(mut self) -> (Option<JoinHandle<()>>, Option<JoinHandle<()>>) {
        (self.gpu.take().map(|(_, j)| j), self.io.take().map(|(_, j)| j))
    }
}

impl Drop for StartedThreads {
    fn drop(&mut self) {
        if let Some((gpu, join)) = self.gpu.take() {
            // A manager that already ended (it panicked) has closed its channel: nothing to
            // tell it, and its join returns at once.
            let _ = gpu.post(GpuCmd::Shutdown);
            let _ = join.join();
        }
        if let Some((tier, join)) = self.io.take() {
            tier.shutdown();
            let _ = join.join();
        }
    }
}
