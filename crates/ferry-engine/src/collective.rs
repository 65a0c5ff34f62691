//! Collectives beyond [`EngineHandle::allgather`]: agreeing on the outcome of a step that each
//! rank takes on its own, and measuring each rank's clock against rank 0's. Both block the
//! calling thread (never call them from a callback) and drive the loop while they wait when
//! callers drive it.

use crate::engine::EngineHandle;
use crate::error::Result;
use crossbeam::channel;
use ferry_comm::outcome::{decode, encode};
pub use ferry_comm::outcome::{Agreed, Outcome};
pub use ferry_comm::ClockPair;
use ferry_comm::Cmd;

impl EngineHandle {
    /// Allgathers this rank's outcome of a step it took on its own (opening a file, mapping a
    /// peer's memory): every rank's payload, in rank order, when the step succeeded on all of
    /// them; else the first rank that failed (this one included) and its error's text. Every
    /// rank takes part whatever happened to it, so a rank that failed never leaves the others
    /// blocked in the next collective. Collective.
    ///
    /// # Errors
    /// The exchange's own failure (the outer `Result`): [`crate::EngineError::Comm`],
    /// [`crate::EngineError::Finalized`].
    pub fn agree(&self, mine: &Outcome) -> Result<Agreed> {
        Ok(decode(self.allgather(&encode(mine))?))
    }

    /// Measures this rank's clock `now` (µs) against rank 0's by a ping-pong with it that keeps
    /// the sample of the shortest round trip (Cristian's algorithm: F. Cristian, "Probabilistic
    /// clock synchronization", Distributed Computing 3, 1989). Collective; holds the progress
    /// loop while it runs (call it at start-up, with nothing else in flight).
    ///
    /// # Errors
    /// [`crate::EngineError::Comm`] when MPI fails, [`crate::EngineError::Finalized`].
    pub fn sync_clocks(&self, now: fn() -> f64) -> Result<ClockPair> {
        let s = self.shared();
        s.check_open()?;
        if self.loop_waits() {
            return Ok(s.comm.sync_clocks(now)?);
        }
        let (reply, rx) = channel::bounded(1);
        s.comm.post(Cmd::SyncClocks { now, reply })?;
        self.wait_reply(&rx)
    }
}
