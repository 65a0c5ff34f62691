//! Peer mappings: a peer's registered device memory mapped into this process, for device work
//! the caller issues itself on its own streams (the counterpart of NVSHMEM's `nvshmem_ptr` and
//! OpenSHMEM's `shmem_ptr`: a direct address where the route allows one).
//!
//! A framework that keeps its own streams and orders its copies on the device (waits on
//! signal words, acknowledgement words written after a copy, consumers launched behind it)
//! cannot hand each copy to the engine's stream without losing that order. It asks the engine
//! for the mapping instead, once per peer allocation, and copies from or into the address with
//! its own device calls. The engine still decides the route (only IPC peers map), owns the
//! mapping (opened through its copier's cache, closed past the idle bound after the last
//! [`PeerMapping`] of it drops) and keeps the target's registration alive while mapped: the
//! mapping holds a lease on it (`lease.rs`), so the owner's `unregister` answers
//! [`EngineError::Busy`] until every peer has dropped its mappings, and its engine's finalize
//! waits for them.

use crate::engine::{EngineHandle, Shared};
use crate::error::{EngineError, Result};
use crate::handle::MemHandle;
use crate::lease::Lease;
use ferry_base::error::Rank;
use std::sync::Arc;

/// A peer's registered device memory, mapped on one local device ([`EngineHandle::map_peer`]).
/// The mapping stays open while this lives; dropping it lets the engine close it.
pub struct PeerMapping {
    addr: u64,
    len: usize,
    device: usize,
    peer: Rank,
    exported: Vec<u8>,
    shared: Arc<Shared>,
    /// Held until after the mapping is let go of (fields drop after `Drop::drop`).
    _lease: Lease,
}

impl std::fmt::Debug for PeerMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerMapping")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("device", &self.device)
            .field("peer", &self.peer)
            .finish()
    }
}

impl PeerMapping {
    /// The device address, valid in this process on [`PeerMapping::device`] (a CUDA device
    /// pointer in its context; with emulated devices, a host address), of the registration's
    /// first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes mapped: the registration's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the registration has no bytes (never: registrations are not empty).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The local device the address is valid on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The rank that owns the memory.
    pub fn peer(&self) -> Rank {
        self.peer
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        if let Some(st) = &self.shared.staging {
            st.lock()
                .unwrap_or_else(|e| e.into_inner())
                .copier_mut()
                .close(self.device, &self.exported);
        }
    }
}

impl EngineHandle {
    /// Maps `remote`, a peer's registration of device memory, on local device `device`, for
    /// copies this process issues itself (see the module): the address of its first byte, valid
    /// until the [`PeerMapping`] drops. Only peers on the IPC route map (same node, both
    /// engines with IPC on). Opening an allocation costs milliseconds on CUDA the first time;
    /// later mappings of the same allocation, from this registration or another, reuse it.
    ///
    /// The caller's device work on the address is its own business: the engine does not order
    /// it with the owner's work, and the owner must not reuse what the caller reads or writes
    /// until the caller's own protocol says so. The registration itself cannot end meanwhile.
    ///
    /// # Errors
    /// - [`EngineError::ForeignHandle`], [`EngineError::NoSuchPeer`]: not a handle of this job's
    ///   peers;
    /// - [`EngineError::InvalidArgument`]: this rank's own memory (use its address), or host
    ///   memory;
    /// - [`EngineError::NoDevices`]: this engine has no devices, `device` is not one of them, or
    ///   the peer is not on the IPC route (another node, IPC off on either side);
    /// - [`EngineError::NotRegistered`]: the registration has ended, or its owner did not
    ///   publish it for leases (no lease table, a slot past the table's size,
    ///   `EngineConfig::ipc_leases` off);
    /// - [`EngineError::Device`]: the driver refused the mapping;
    /// - [`EngineError::Finalized`].
    pub fn map_peer(&self, remote: &MemHandle, device: usize) -> Result<PeerMapping> {
        let s = self.shared();
        s.check_open()?;
        s.check_remote(remote)?;
        if remote.rank == s.rank {
            return Err(EngineError::InvalidArgument(
                "map_peer of this rank's own registration: use its address".into(),
            ));
        }
        if remote.kind.device().is_none() {
            return Err(EngineError::InvalidArgument(format!(
                "map_peer of rank {}'s host memory (only device memory maps)",
                remote.rank
            )));
        }
        let staging = s.staging_or_error()?;
        if !s.ipc_to(remote.rank) {
            return Err(EngineError::NoDevices(format!(
                "rank {} is not on the IPC route from rank {} (another node, or IPC off on either side)",
                remote.rank, s.rank
            )));
        }
        let mut g = staging.lock().unwrap_or_else(|e| e.into_inner());
        let devices = g.copier().devices();
        if device >= devices {
            return Err(EngineError::NoDevices(format!(
                "device {device} is not one of this engine's {devices}"
            )));
        }
        let lease = s.lease(remote).ok_or(EngineError::NotRegistered {
            rank: remote.rank,
            id: remote.id,
            generation: remote.generation,
        })?;
        let exported = lease.export.clone();
        let addr = g.copier_mut().open(device, &exported)?;
        drop(g);
        Ok(PeerMapping {
            addr,
            len: lease.len as usize,
            device,
            peer: remote.rank,
            exported,
            shared: s.clone(),
            _lease: lease,
        })
    }
}
