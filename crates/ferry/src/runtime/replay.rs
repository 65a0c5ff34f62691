//! Traces: recording a repeated sequence of insertions once and replaying it afterwards
//! (`graph/replay.rs` has the mechanism).

use super::Runtime;
use crate::graph::{TraceId, TraceMode};
use ferry_base::error::{FerryError, Result};

impl Runtime {
    /// Inserts the tasks `body` inserts as trace `id`: the first time, they are analysed as
    /// usual and what the analysis decided on this rank is recorded; later, the same sequence
    /// replays that recording instead of redoing the analysis (memoized dependence analysis, as
    /// in Legion's tracing: Lee et al., SC 2018). Results are the same bit for bit; what a
    /// replay saves is insertion time — most of all on ranks that run few of the tasks, for
    /// which a task of another rank costs a comparison.
    ///
    /// Collective in the STF sense: every rank traces the same sequences with the same ids.
    /// `body` must insert the same tasks each time — same classes (by name and whether they
    /// have a GPU body), tiles, modes and placements, in the same order; arguments and
    /// priorities may differ. A trace whose tiles read before written have changed holders since
    /// its recording (the sequence would move other data) is recorded again, alike on every
    /// rank; [`crate::StatsSnapshot::trace_records`] counts recordings.
    ///
    /// ```ignore
    /// for step in 0..steps {
    ///     rt.trace(step % 2, |rt| insert_step(rt, step))?;
    /// }
    /// ```
    ///
    /// # Errors
    /// `body`'s error; those of [`Runtime::begin_trace`] and [`Runtime::end_trace`]. A recording
    /// whose body failed (or in which an insertion failed) is dropped. A replayed task that
    /// differs from the recording fails the run with [`FerryError::TraceMismatch`] naming it,
    /// and so does a replay whose body fails or panics before the end: every rank's next
    /// [`Runtime::wait`] fails.
    pub fn trace<R, E, F>(&self, id: TraceId, body: F) -> std::result::Result<R, E>
    where
        F: FnOnce(&Runtime) -> std::result::Result<R, E>,
        E: From<FerryError>,
    {
        self.begin_trace(id)?;
        // Closes the trace however `body` ends: an error or a panic abandons it.
        struct Open<'a>(&'a Runtime);
        impl Drop for Open<'_> {
            fn drop(&mut self) {
                self.0.inserter_unchecked().abandon_trace("its body panicked");
            }
        }
        let open = Open(self);
        let r = body(self);
        std::mem::forget(open);
        match r {
            Ok(v) => {
                self.end_trace()?;
                Ok(v)
            }
            Err(e) => {
                self.inserter_unchecked().abandon_trace("its body returned an error");
                Err(e)
            }
        }
    }

    /// Opens trace `id` (see [`Runtime::trace`]); the insertions up to [`Runtime::end_trace`]
    /// belong to it. Returns whether it records or replays.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when a trace is open already (traces do not nest); the
    /// error that stopped the runtime.
    pub fn begin_trace(&self, id: TraceId) -> Result<TraceMode> {
        self.inserter()?.begin_trace(id)
    }

    /// Closes the open trace: keeps its recording, or ends its replay. Returns the number of
    /// tasks it inserted.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when no trace is open; [`FerryError::TraceMismatch`] when
    /// a replay inserted fewer tasks than its recording (also the run's error);
    /// [`FerryError::Poisoned`] after a replay that failed.
    pub fn end_trace(&self) -> Result<usize> {
        let (id, mode, n) = self.inserter_unchecked().end_trace()?;
        tracing::debug!(trace = id, ?mode, tasks = n, "trace.end");
        Ok(n)
    }

    /// Refuses `what` while a trace is open: operations that are not insertions (a `wait`, a
    /// new collection, a checkpoint, a route change) cannot be part of a recorded sequence.
    pub(crate) fn refuse_in_trace(&self, what: &str) -> Result<()> {
        match self.inserter_unchecked().open_trace() {
            Some(id) => Err(FerryError::InvalidArgument(format!(
                "{what} inside trace {id}: end the trace first"
            ))),
            None => Ok(()),
        }
    }
}
