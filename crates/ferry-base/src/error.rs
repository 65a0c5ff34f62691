//! The error type of every fallible public operation.

use std::fmt;

/// A rank number in the runtime's communicator (`0..size`).
pub type Rank = i32;

/// Everything that can go wrong in ferry, as one typed error.
///
/// Errors are values: no public function panics on bad input. After an error that leaves transfers
/// in flight (a failed task, a failed MPI operation), the runtime is *poisoned*: later calls return
/// [`FerryError::Poisoned`] and shutdown aborts the MPI job instead of hanging (see
/// `docs/configuration.md`, `FERRY_ABORT_ON_ERROR`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FerryError {
    /// A configuration value (builder call or `FERRY_*` variable) is invalid or unknown.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// MPI could not be initialised, was finalized already, or lacks the threading level needed
    /// (`MPI_THREAD_MULTIPLE` when the caller initialised it, funneled when ferry does).
    #[error("MPI initialisation failed: {0}")]
    MpiInit(String),
    /// An MPI call returned an error code.
    #[error("MPI error in {op} (peer {peer}, tag {tag}): {msg}")]
    Mpi {
        /// The MPI function that failed.
        op: &'static str,
        /// The peer rank involved, or -1.
        peer: Rank,
        /// The tag involved, or -1.
        tag: i32,
        /// The MPI library's error string.
        msg: String,
    },
    /// A received message had a different size from the tile it was meant for: the ranks disagree
    /// about the task graph or the collections.
    #[error("message from rank {peer} (tag {tag}) has {got} bytes, expected {expected}: the ranks disagree about the task graph")]
    SizeMismatch {
        /// Sender.
        peer: Rank,
        /// Tag of the message.
        tag: i32,
        /// Bytes received.
        got: usize,
        /// Bytes expected.
        expected: usize,
    },
    /// A control message of a transfer protocol was malformed or announced something the graph
    /// does not allow (a corrupt or foreign message, or ranks that disagree).
    #[error("bad transfer descriptor from rank {peer} (tag {tag}): {msg}")]
    Protocol {
        /// Sender.
        peer: Rank,
        /// Tag of the transfer.
        tag: i32,
        /// What was wrong.
        msg: String,
    },
    /// The ranks inserted different task sequences (or created different collections).
    #[error("task graph mismatch between ranks: {0}")]
    GraphMismatch(GraphMismatch),
    /// A replayed trace met a task other than the one it recorded (or ended early, or ran
    /// past its recording): the run stops, since the replay cannot go on consistently.
    #[error("trace {trace} does not replay its recording: {detail}")]
    TraceMismatch {
        /// The trace's id.
        trace: u64,
        /// The first differing task, as inserted and as recorded.
        detail: String,
    },
    /// Bad arguments to a collection constructor or a tile access.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A tile index is outside its collection.
    #[error("tile ({i}, {j}) is outside collection `{collection}` of {mt}×{nt} tiles")]
    TileOutOfBounds {
        /// Collection name.
        collection: String,
        /// Row index of the tile.
        i: usize,
        /// Column index of the tile.
        j: usize,
        /// Tiles per column.
        mt: usize,
        /// Tiles per row.
        nt: usize,
    },
    /// A task body returned an error or panicked.
    #[error("task `{class}` (#{seq} in insertion order) failed on rank {rank}: {msg}")]
    TaskFailed {
        /// Task class name.
        class: String,
        /// Position of the task in the inserted sequence.
        seq: u64,
        /// Rank that ran it.
        rank: Rank,
        /// The body's error or panic message.
        msg: String,
    },
    /// A previous error stopped the runtime; the original error was returned once before.
    #[error("the runtime stopped after an earlier error: {0}")]
    Poisoned(String),
    /// A device could not be opened or failed (no driver, no GPU, a CUDA error, a task that does
    /// not fit on a device).
    #[error("device error: {0}")]
    Device(DeviceError),
    /// Nothing progressed for `seconds` while work was outstanding: a hang, reported instead of
    /// waited out (`FERRY_WATCHDOG_S`).
    #[error("watchdog: no progress for {seconds} s on rank {rank}; waiting for:\n{report}")]
    Watchdog {
        /// The rank that noticed.
        rank: Rank,
        /// Seconds without progress.
        seconds: u64,
        /// What the rank was waiting for (tasks, transfers, devices).
        report: String,
    },
    /// The disk tier failed: the spill space is full (its budget, `FERRY_SPILL_BYTES`, or the
    /// file system), or a spill file could not be created, written or read.
    #[error("disk tier in {dir}: {msg}")]
    Spill {
        /// The spill directory.
        dir: String,
        /// What went wrong.
        msg: String,
    },
    /// A checkpoint could not be written, or a checkpoint to restore is missing, truncated,
    /// corrupt, of another format version, or does not match the program's collections.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The file or directory involved (or the rank that failed).
        path: String,
        /// What went wrong.
        msg: String,
    },
    /// An internal thread ended unexpectedly.
    #[error("runtime thread `{0}` ended unexpectedly")]
    ThreadLost(&'static str),
    /// A step panicked inside ferry (a bug: please report it with the message); the runtime
    /// stopped what it had started before returning this.
    #[error("internal error (a bug in ferry): {0}")]
    Internal(String),
    /// Writing a trace or statistics record failed.
    #[error("I/O error on {path}: {error}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error, said in the message (not also the `source`: reports that
        /// print the chain, `{:#}`, said it twice).
        error: std::io::Error,
    },
}

/// Errors of the device layer (backends, pools, launches), turned into [`FerryError::Device`] at
/// the border. Defined here, below the device crate, so that every layer can carry one.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// No CUDA driver library could be loaded.
    #[error("no CUDA driver: libcuda could not be loaded (use --devices none or emu:K)")]
    NoDriver,
    /// The driver loaded but reports no GPU.
    #[error("the CUDA driver reports no GPU")]
    NoDevices,
    /// A CUDA call failed.
    #[error("CUDA error in {op}: {msg}")]
    Cuda {
        /// The operation.
        op: &'static str,
        /// The driver's message.
        msg: String,
    },
    /// A task cannot fit on a device even when it is empty.
    #[error("task `{class}` needs {need} bytes of device memory, but device {device} holds only {capacity}")]
    TooLarge {
        /// Task class.
        class: String,
        /// Bytes of all its tiles.
        need: u64,
        /// The device.
        device: usize,
        /// Pool capacity.
        capacity: u64,
    },
    /// A GPU body reported an error.
    #[error("GPU body failed: {0}")]
    Body(String),
}

// By hand rather than `#[from]`, which would also make the device error the `source`: the
// message already says it, and reports that print the chain (`{:#}`) said it twice.
impl From<DeviceError> for FerryError {
    fn from(e: DeviceError) -> Self {
        FerryError::Device(e)
    }
}

/// The first point where the ranks' inserted sequences disagree, as far as ferry can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphMismatch {
    /// Per rank: (number of tasks inserted, hash of the sequence).
    pub per_rank: Vec<(u64, u64)>,
    /// Position in the sequence of the first task the ranks disagree on, when found.
    pub first_task: Option<u64>,
    /// When the first difference lies past the tasks whose hashes are kept one by one (the
    /// first 1 048 576 of an epoch): the positions `[lo, hi)` of the block of tasks that holds
    /// it (`first_task` is then `None`).
    pub within: Option<(u64, u64)>,
    /// Per rank: its description of that task (when it still had it), e.g.
    /// ``"`gemm` on rank 1: R c0(3,1) R c0(2,1) RW c0(3,2)"``.
    pub descriptions: Vec<String>,
}

impl fmt::Display for GraphMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (r, (n, h)) in self.per_rank.iter().enumerate() {
            if r > 0 {
                write!(f, "; ")?;
            }
            write!(f, "rank {r}: {n} tasks, hash {h:016x}")?;
        }
        if let Some(t) = self.first_task {
            write!(f, "; first differing task: #{t}")?;
            for (r, d) in self.descriptions.iter().enumerate() {
                write!(f, "\n  rank {r} inserted {d}")?;
            }
        } else if let Some((lo, hi)) = self.within {
            write!(f, "; the first difference lies within tasks [#{lo}, #{hi})")?;
        }
        Ok(())
    }
}

/// Shorthand for results whose error is [`FerryError`].
pub type Result<T, E = FerryError> = std::result::Result<T, E>;

/// The error a task body returns: any error type, boxed.
pub type TaskError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl FerryError {
    /// A copy of this error for a second reader (the runtime reports its first error to every
    /// caller that waits after it). I/O sources are flattened to their message.
    pub fn duplicate(&self) -> FerryError {
        FerryError::Poisoned(self.to_string())
    }
}

/// The text of a panic's payload (`panic!` with a literal or with a format), for errors that
/// report a caught panic.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole chain of an error as a report prints it (`{:#}`: each source after a colon).
    fn chain(e: &dyn std::error::Error) -> String {
        let mut s = e.to_string();
        let mut cur = e.source();
        while let Some(c) = cur {
            s.push_str(&format!(": {c}"));
            cur = c.source();
        }
        s
    }

    /// An I/O error names its file and says its cause once, however it is printed.
    #[test]
    fn io_errors_say_their_cause_once() {
        let e = FerryError::Io {
            path: "/no/such/dir/trace-rank0.json".into(),
            error: std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory"),
        };
        let s = chain(&e);
        assert!(s.contains("/no/such/dir/trace-rank0.json"), "{s}");
        assert_eq!(s.matches("no such directory").count(), 1, "{s}");
    }
}
