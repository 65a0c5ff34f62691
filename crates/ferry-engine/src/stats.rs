//! The engine's counters: operations and bytes, per kind and side.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Live counters (one per field of [`EngineStats`]).
#[derive(Default)]
pub(crate) struct Counters {
    pub am_sent: AtomicU64,
    pub am_received: AtomicU64,
    pub notifications: AtomicU64,
    pub puts: AtomicU64,
    pub gets: AtomicU64,
    pub puts_served: AtomicU64,
    pub gets_served: AtomicU64,
    pub refused: AtomicU64,
    pub bytes_put: AtomicU64,
    pub bytes_got: AtomicU64,
    pub sends: AtomicU64,
    pub recvs: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub leased_copies: AtomicU64,
    pub single_copies: AtomicU64,
    pub am_ring_sent: AtomicU64,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }
}

/// What this rank's engine has done so far (completed operations only).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// User active messages sent (notifications of gets included; the engine's own not).
    pub am_sent: u64,
    /// User active messages delivered to, or held for, a handler.
    pub am_received: u64,
    /// Notifications of puts delivered here (their data had landed here).
    pub notifications: u64,
    /// Puts this rank started that completed successfully.
    pub puts: u64,
    /// Gets this rank started that completed successfully.
    pub gets: u64,
    /// Puts into this rank's memory that landed.
    pub puts_served: u64,
    /// Gets from this rank's memory that were sent.
    pub gets_served: u64,
    /// Requests of peers refused here (bad or stale handle, out of bounds).
    pub refused: u64,
    /// Bytes of the completed puts this rank started.
    pub bytes_put: u64,
    /// Bytes of the completed gets this rank started.
    pub bytes_got: u64,
    /// Two-sided sends completed.
    pub sends: u64,
    /// Two-sided receives completed.
    pub recvs: u64,
    /// Bytes of those sends.
    pub bytes_sent: u64,
    /// Bytes of those receives.
    pub bytes_received: u64,
    /// Peer copies this rank started under a lease on the target's registration (the IPC
    /// route with no message before the copy; `lease.rs`).
    pub leased_copies: u64,
    /// Gets and puts of host memory this rank made as single copies into or out of a node
    /// peer's memory (Cross Memory Attach, [`crate::Route::Cma`]; `cma.rs`).
    pub single_copies: u64,
    /// Active messages (the engine's own included) this rank wrote into a node peer's ring
    /// (`am_rings.rs`) instead of sending them over MPI.
    pub am_ring_sent: u64,
    /// Registrations alive.
    pub registrations: u64,
    /// Active messages held for want of a handler.
    pub held_messages: u64,
    /// Peers' device allocations mapped here for peer copies now (in use, or idle and kept:
    /// [`crate::EngineConfig::ipc_keep_mappings`]).
    pub ipc_mappings: u64,
}

impl Counters {
    pub(crate) fn snapshot(&self, registrations: usize, held: usize, ipc_mappings: usize) -> EngineStats {
        let g = |c: &AtomicU64| c.load(Relaxed);
        EngineStats {
            am_sent: g(&self.am_sent),
            am_received: g(&self.am_received),
            notifications: g(&self.notifications),
            puts: g(&self.puts),
            gets: g(&self.gets),
            puts_served: g(&self.puts_served),
            gets_served: g(&self.gets_served),
            refused: g(&self.refused),
            bytes_put: g(&self.bytes_put),
            bytes_got: g(&self.bytes_got),
            sends: g(&self.sends),
            recvs: g(&self.recvs),
            bytes_sent: g(&self.bytes_sent),
            bytes_received: g(&self.bytes_received),
            leased_copies: g(&self.leased_copies),
            single_copies: g(&self.single_copies),
            am_ring_sent: g(&self.am_ring_sent),
            registrations: registrations as u64,
            held_messages: held as u64,
            ipc_mappings: ipc_mappings as u64,
        }
    }
}
