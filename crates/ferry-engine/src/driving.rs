//! What a framework that owns its threads needs from the progress loop beyond operations: hand
//! the loop's driving to its idle threads after start-up, make the loop's thread yield its core,
//! have the loop poll a source of messages of the framework's own (a shared-memory ring), wake
//! the loop, and read the loop's counters and what MPI said at start-up.

use crate::engine::EngineHandle;
use crate::error::Result;
use ferry_base::poller::Poller;
use ferry_comm::Cmd;
pub use ferry_comm::{CommCounters as ProgressCounters, InitInfo as MpiInfo, Passed, ProgressShare};
use std::sync::Arc;

impl EngineHandle {
    /// Hands the driving of the progress loop to whichever threads call
    /// [`ProgressShare::try_pass`] (a framework's idle workers), keeping the engine's thread as a
    /// backstop that drives it when nobody has for `backstop` (1 µs to 1 s; ferry's default is
    /// 200 µs). From then on [`EngineHandle::progress`] and the collectives drive the loop
    /// themselves. For a rank whose threads outnumber its cores: the thread that waits for a
    /// message polls for it, with no switch to the progress thread and back per message. A
    /// second call returns the first share. The engine must have been started with
    /// [`crate::Progress::Shared`] or [`crate::EngineConfig::share_later`].
    ///
    /// # Errors
    /// [`crate::EngineError::InvalidArgument`] when the caller drives the loop
    /// ([`crate::Progress::Caller`]); [`crate::EngineError::Comm`] when MPI runs below
    /// `MPI_THREAD_SERIALIZED` or `backstop` is out of range; [`crate::EngineError::Finalized`].
    pub fn share_progress(&self, backstop: std::time::Duration) -> Result<ProgressShare> {
        let s = self.shared();
        s.check_open()?;
        if s.driver.is_some() {
            // The loop's owner is the caller: asking the loop to share itself would wait for a
            // pass of the thread that asks.
            return Err(crate::EngineError::InvalidArgument(
                "the caller drives this engine's progress (Progress::Caller): it has no loop to share".into(),
            ));
        }
        // One asker at a time: a second concurrent call gets the first's share, not the loop's
        // refusal to be shared twice.
        let _one = s.share_lock.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(share) = s.share.get() {
            return Ok(share.clone());
        }
        let share = s.comm.share_progress(backstop)?;
        Ok(s.share.get_or_init(|| share).clone())
    }

    /// Makes the engine's progress thread yield its core when it has nothing to do, instead of
    /// spinning before it naps (for ranks whose threads outnumber their cores; see
    /// [`crate::EngineConfig::yield_when_idle`], which decides it at start-up).
    ///
    /// # Errors
    /// [`crate::EngineError::Comm`] when the progress thread has gone,
    /// [`crate::EngineError::Finalized`].
    pub fn set_yield_when_idle(&self, on: bool) -> Result<()> {
        let s = self.shared();
        s.check_open()?;
        s.comm.post(Cmd::YieldWhenIdle(on))?;
        Ok(())
    }

    /// Adds `poller` to the progress loop: it runs in every pass, on the thread that runs the
    /// pass, for as long as the engine runs, and is closed when the loop ends. For messages that
    /// arrive without MPI (a shared-memory ring another process writes); a poller that expects
    /// nothing and then has work calls the waker of [`EngineHandle::waker`].
    ///
    /// # Errors
    /// [`crate::EngineError::Comm`] when the progress thread has gone,
    /// [`crate::EngineError::Finalized`].
    pub fn add_poller(&self, poller: Box<dyn Poller>) -> Result<()> {
        let s = self.shared();
        s.check_open()?;
        s.comm.post(Cmd::Poller(poller))?;
        Ok(())
    }

    /// A function that wakes the progress loop for a pass (from any thread; does nothing once
    /// the engine has stopped).
    pub fn waker(&self) -> impl Fn() + Send + Sync + 'static {
        let comm = self.shared().comm.clone();
        move || {
            let _ = comm.post(Cmd::Wake);
        }
    }

    /// What MPI said at start-up: this rank, the ranks of the job and of this node, the
    /// library's version, `MPI_TAG_UB`, CUDA support, the node's name.
    pub fn mpi_info(&self) -> &MpiInfo {
        &self.shared().info
    }

    /// The progress loop's live counters: bytes and messages per path, its busy time and naps.
    pub fn progress_counters(&self) -> Arc<ProgressCounters> {
        self.shared().comm_counters.clone()
    }
}

/// How long the engine's thread lets a shared loop go undriven before it drives it itself,
/// unless told otherwise ([`crate::EngineConfig::backstop_us`], [`EngineHandle::share_progress`]).
pub const DEFAULT_BACKSTOP: std::time::Duration = ferry_comm::SHARED_PROGRESS_TICK;
