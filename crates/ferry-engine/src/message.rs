//! Tagged messages of unregistered memory: the layer a framework builds its own transfer
//! protocols on (ferry's task runtime sends tiles, descriptors and acknowledgements this way),
//! below the registered two-sided [`EngineHandle::send`] / [`EngineHandle::recv`].
//!
//! A message names its memory by a [`MemRegion`] (pointer and length, kept alive by the message
//! until its callback has run), its peer, an MPI tag and a [`Lane`]. Matching is MPI's: by
//! (peer, lane, tag), in posting order on each side; a receive takes a message of exactly its
//! length: a shorter one fails it with [`ferry_base::error::FerryError::SizeMismatch`], a longer
//! one with the MPI library's truncation error ([`ferry_base::error::FerryError::Mpi`]). Lanes
//! are communicators of their own, so a tag on one never matches the other. The data lane is
//! the one [`EngineHandle::send`] / [`EngineHandle::recv`] use: a process that uses both picks
//! tags that do not collide.

use crate::engine::EngineHandle;
use crate::error::{EngineError, Result};
use ferry_base::error::Rank;
pub use ferry_base::join::Done;
pub use ferry_base::region::{Bytes, MemRegion};
use ferry_base::traffic::TrafficPath;
use ferry_comm::{Channel, Cmd, Transfer};
use std::sync::Arc;

/// Which of the engine's two message lanes a [`Message`] travels on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Payloads and the descriptors that announce them.
    Data,
    /// Short protocol messages (acknowledgements) that must not match a payload's receive of
    /// the same tag.
    Control,
}

impl Lane {
    fn channel(self) -> Channel {
        match self {
            Lane::Data => Channel::Data,
            Lane::Control => Channel::Ack,
        }
    }
}

/// One send or receive of [`EngineHandle::send_message`] / [`EngineHandle::recv_message`].
pub struct Message {
    /// The memory sent from or received into; the engine holds it until `done` has run.
    pub region: Arc<dyn MemRegion>,
    /// The other rank.
    pub peer: Rank,
    /// The MPI tag, `0..=MPI_TAG_UB` ([`crate::MpiInfo::tag_ub`]); both sides compute it.
    pub tag: i32,
    /// The lane.
    pub lane: Lane,
    /// Where the message's bytes are counted in [`EngineHandle::traffic`].
    pub path: TrafficPath,
    /// Whether it also counts as one message of `path` (a payload sent in chunks counts its
    /// bytes per chunk, and itself once, which its sender does).
    pub counts: bool,
    /// Posted at once, outside the send window ([`crate::EngineConfig::max_sends`]): for short
    /// payloads and protocol messages. All messages of one (peer, lane, tag) must agree, so that
    /// none overtakes another queued in the window.
    pub eager: bool,
    /// Runs once the message has completed (the send buffer may be reused; the received bytes
    /// have landed) or failed. It runs inside the pass of the progress loop that completed it
    /// (the engine's thread, or a thread driving the loop), whatever
    /// [`crate::EngineConfig::completions`] says: it must be short and must not block.
    pub done: Done,
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Message")
            .field("len", &self.region.len())
            .field("peer", &self.peer)
            .field("tag", &self.tag)
            .field("lane", &self.lane)
            .field("path", &self.path)
            .field("eager", &self.eager)
            .finish()
    }
}

impl EngineHandle {
    /// Sends `m` to `m.peer`. It goes out at once: with a shared loop this thread runs a pass
    /// that posts it, if no other thread is in one (a worker that finished a tile would
    /// otherwise post it only after the next task it runs).
    ///
    /// # Errors
    /// [`EngineError::NoSuchPeer`], [`EngineError::InvalidArgument`] (a tag outside
    /// `0..=MPI_TAG_UB`), [`EngineError::Finalized`], [`EngineError::Comm`] when the progress
    /// thread has gone. `m.done` is then dropped without running. MPI failures later reach
    /// `m.done`.
    pub fn send_message(&self, m: Message) -> Result<()> {
        self.post_message(false, m)
    }

    /// Posts a receive of `m` from `m.peer` (posted by the loop at once, outside any window).
    ///
    /// # Errors
    /// As [`EngineHandle::send_message`].
    pub fn recv_message(&self, m: Message) -> Result<()> {
        self.post_message(true, m)
    }

    fn post_message(&self, recv: bool, m: Message) -> Result<()> {
        let s = self.shared();
        s.check_open()?;
        s.check_peer(m.peer)?;
        if m.tag < 0 || m.tag as u32 >= s.two_sided_tags {
            return Err(EngineError::InvalidArgument(format!(
                "message tag {} is outside 0..={}",
                m.tag,
                s.two_sided_tags - 1
            )));
        }
        let t = Transfer {
            region: m.region,
            peer: m.peer,
            tag: m.tag,
            channel: m.lane.channel(),
            path: m.path,
            counts: m.counts,
            eager: m.eager,
            done: m.done,
        };
        let cmd = if recv { Cmd::Recv(t) } else { Cmd::Send(t) };
        if recv {
            s.post_recv_cmd(cmd)
        } else {
            s.post_cmd(cmd)
        }
    }
}
