//! The single-copy route for host memory between ranks of one node: Linux's Cross Memory Attach.
//!
//! A get or put whose two regions are host memory, between ranks of one node, moves with one
//! system call on the origin's thread: `process_vm_readv` reads the target's registration into
//! the local one (get), `process_vm_writev` writes the local region into the target's (put).
//! The kernel copies between the two address spaces directly, so the bytes cross memory once;
//! MPI's shared-memory transports use the same call for their large messages, but only after a
//! rendezvous through the target's progress loop, which this route does not need.
//!
//! - **Liveness.** The origin leases the target's registration from the table the target
//!   publishes in shared memory (`lease.rs`; for host memory its export is the base address):
//!   while the pin is held the target cannot unregister it, so the origin never reads or writes
//!   memory whose registration has ended. Without a lease (a slot past the table, a stale
//!   handle) the operation takes the MPI route, where the target words the refusal.
//! - **Permission.** `process_vm_*` needs the right to ptrace the target (same user; under Yama
//!   `ptrace_scope` 1, a target that declared the caller its tracer). Every rank with the route
//!   on declares any process its tracer at start-up (`ferry_base::cross_memory::allow_peers`, as Open MPI's `vader`
//!   transport does), then probes each node peer's memory ([`probe`]): a pair whose probe fails
//!   (a seccomp filter, Yama at 2 or 3, a kernel without CMA) stays on MPI.
//! - **Afterwards** the target learns of the copy as of a leased peer copy (`LeaseDone`, marked
//!   as a single copy), for its counters and a put's notification.
//!
//! References: `process_vm_readv(2)`; Open MPI's `opal/mca/btl/vader` (single-copy mechanisms,
//! CMA); Vienne, "Benefits of Cross Memory Attach for MPI libraries on HPC clusters" (XSEDE '14).

use crate::engine::{Completion, Notify, Shared};
use crate::error::{EngineError, Result};
use crate::lease::Lease;
use crate::registry::Pinned;
use ferry_base::cross_memory;
use ferry_base::error::Rank;
use ferry_base::region::MemRegion;
use ferry_base::traffic::TrafficPath;
use std::sync::Arc;

/// Bytes of a host registration's export in the lease table: its base address.
pub(crate) const EXPORT_BYTES: usize = 8;

/// Whether this process can read `expect.len()` bytes at `addr` of process `pid` and finds
/// `expect` there.
pub(crate) fn probe(pid: i32, addr: u64, expect: &[u8]) -> bool {
    let mut got = vec![0u8; expect.len()];
    // SAFETY: `got` is ours and `expect.len()` bytes long; the remote range is only read.
    match unsafe { cross_memory::copy(pid, addr, got.as_mut_ptr(), got.len(), false) } {
        Ok(()) => got == expect,
        Err(e) => {
            tracing::info!(pid, "no single copy with this peer (host memory takes MPI): {e}");
            false
        }
    }
}

impl Shared {
    /// The peer's process when a payload of `len` bytes between a local region (on `device`,
    /// or host memory) and `remote` takes the single-copy route: host memory on both sides, the
    /// peer reachable by it, and at least `EngineConfig::cma_min_bytes`.
    pub(crate) fn cma_route(
        &self,
        device: Option<usize>,
        remote: &crate::handle::MemHandle,
        peer: Rank,
        len: usize,
    ) -> Option<i32> {
        let host = len >= self.cma_min_bytes && device.is_none() && remote.kind.device().is_none();
        host.then(|| self.cma_pid(peer)).flatten()
    }

    /// A get (`put` false) or put between `local` and the leased host registration at
    /// `remote_offset` of `peer`'s process `pid`, as one copy on this thread: `done` runs once it is over, after the
    /// target has been told (`LeaseDone`) and, for a get, notified.
    ///
    /// # Errors
    /// A range past the leased registration, or an export that is not an address: nothing has
    /// been copied, and the lease is given back. A failed copy reports through `done`
    /// ([`EngineError::SingleCopy`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn single_copy(
        self: &Arc<Self>,
        local: Pinned,
        lease: Lease,
        peer: Rank,
        pid: i32,
        remote_offset: usize,
        put: bool,
        notify: Option<Notify>,
        done: Completion,
    ) -> Result<()> {
        let len = local.len();
        lease.check_range(remote_offset, len)?;
        let base = <[u8; EXPORT_BYTES]>::try_from(lease.export.as_slice())
            .map(u64::from_le_bytes)
            .map_err(|_| EngineError::InvalidArgument(format!("a host lease of {} bytes", lease.export.len())))?;
        // SAFETY: the local range is pinned by the operation (the caller's contract keeps
        // others off it while in flight), the remote one held by the lease until after the copy.
        let r = unsafe { cross_memory::copy(pid, base + remote_offset as u64, local.ptr(), len, put) };
        drop(lease);
        drop(local);
        let r = r.map_err(|source| EngineError::SingleCopy { peer, source });
        self.on_leased_copy(peer, put, len, TrafficPath::Cma, r, notify, done);
        Ok(())
    }
}
