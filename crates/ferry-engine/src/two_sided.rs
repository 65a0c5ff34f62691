//! Tagged two-sided send and receive of registered regions with completion callbacks
//! (StarPU-MPI's `isend_detached` / `irecv_detached`).
//!
//! A receive names its source and tag (no wildcards) and its exact length: a shorter message
//! fails the receive with [`ferry_base::error::FerryError::SizeMismatch`], a longer one with the
//! MPI library's truncation error ([`ferry_base::error::FerryError::Mpi`]). Messages of
//! one (source, tag) are received in the order they were sent, by receives in the order they
//! were posted. Sends beyond the engine's window ([`crate::EngineConfig::max_sends`]) wait, in
//! order, for earlier ones to complete.

use crate::engine::EngineHandle;
use crate::error::{EngineError, Result};
use crate::handle::MemHandle;
use crate::stats::Counters;
use ferry_base::error::Rank;
use ferry_comm::Channel;
use std::sync::Arc;

impl EngineHandle {
    fn check_two_sided(&self, peer: Rank, tag: u32) -> Result<()> {
        let s = self.shared();
        s.check_open()?;
        s.check_peer(peer)?;
        if tag >= s.two_sided_tags {
            return Err(EngineError::InvalidArgument(format!(
                "tag {tag} is over the MPI library's limit ({})",
                s.two_sided_tags - 1
            )));
        }
        Ok(())
    }

    /// Sends `len` bytes at `offset` of `local` to `peer` with `tag`; `done` runs once the
    /// send buffer may be reused.
    ///
    /// # Errors
    /// At once: [`EngineError::NoSuchPeer`], [`EngineError::InvalidArgument`] (a tag over the
    /// limit, 0 bytes), [`EngineError::OutOfBounds`], [`EngineError::NotRegistered`],
    /// [`EngineError::WrongOwner`], [`EngineError::Finalized`]. Through `done`: MPI failures.
    pub fn send(
        &self,
        local: &MemHandle,
        offset: usize,
        len: usize,
        peer: Rank,
        tag: u32,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) -> Result<()> {
        self.post_two_sided(false, local, offset, len, peer, tag, done)
    }

    /// Receives exactly `len` bytes from `peer` with `tag` into `local` at `offset`; `done` runs
    /// once they have landed.
    ///
    /// # Errors
    /// As [`EngineHandle::send`]; through `done` also a message of another length.
    pub fn recv(
        &self,
        local: &MemHandle,
        offset: usize,
        len: usize,
        peer: Rank,
        tag: u32,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) -> Result<()> {
        self.post_two_sided(true, local, offset, len, peer, tag, done)
    }

    #[allow(clippy::too_many_arguments)]
    fn post_two_sided(
        &self,
        recv: bool,
        local: &MemHandle,
        offset: usize,
        len: usize,
        peer: Rank,
        tag: u32,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) -> Result<()> {
        self.check_two_sided(peer, tag)?;
        let s = self.shared();
        let region = s.registry.pin(local, offset, len)?;
        let path = match region.device {
            // Both sides decide how a message moves on their own, so device memory goes only
            // where MPI takes it.
            Some(_) if !s.gpu_direct_to(peer) => {
                return Err(EngineError::NoDevices(format!(
                    "a two-sided transfer of device memory needs GPU-direct to rank {peer}; put and get stage device memory"
                )))
            }
            Some(_) => ferry_base::traffic::TrafficPath::GpuDirect,
            None => crate::engine::payload_path(len),
        };
        let s2 = s.clone();
        let ended = Box::new(move |r: ferry_base::error::Result<()>| {
            if r.is_ok() {
                let c = &s2.counters;
                let (n, b) = if recv {
                    (&c.recvs, &c.bytes_received)
                } else {
                    (&c.sends, &c.bytes_sent)
                };
                Counters::add(n, 1);
                Counters::add(b, len as u64);
            }
            s2.delivery.deliver(Box::new(move || done(r.map_err(Into::into))));
        });
        s.post_on(recv, Channel::Data, path, Arc::new(region), peer, tag, ended)
    }
}
