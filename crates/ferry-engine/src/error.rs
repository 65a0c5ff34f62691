//! The engine's errors: every bad input and every failed operation, with what went wrong.

use ferry_base::error::{FerryError, Rank};

/// What an engine call or a completion reports. Every variant says what was wrong with the
/// input, or what failed; none leaves the engine in a worse state than before the call.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A memory handle's bytes are not one (wrong length, magic or version).
    #[error("not a memory handle: {0}")]
    BadHandle(String),
    /// A memory handle of another engine instance (another job, or an earlier start).
    #[error("memory handle of another job (its job key {found:#x}, this job's {expected:#x})")]
    ForeignHandle {
        /// The key in the handle.
        found: u64,
        /// This job's key.
        expected: u64,
    },
    /// A handle whose registration is gone (unregistered, or its slot reused since).
    #[error("memory registration {id} (generation {generation}) on rank {rank} is not registered (unregistered, or never registered there)")]
    NotRegistered {
        /// The rank that owns the registration.
        rank: Rank,
        /// Its slot.
        id: u32,
        /// Its generation.
        generation: u32,
    },
    /// A local operation named a handle of another rank, or a remote one named this rank's.
    #[error("memory handle belongs to rank {owner}, but the operation needs one of rank {wanted}")]
    WrongOwner {
        /// Rank that registered the memory.
        owner: Rank,
        /// Rank the operation needs.
        wanted: Rank,
    },
    /// `offset + len` beyond the registered region.
    #[error("bytes {offset}..{end} are outside the registered region of {region} bytes", end = offset.saturating_add(*len))]
    OutOfBounds {
        /// First byte asked for.
        offset: usize,
        /// Bytes asked for.
        len: usize,
        /// Bytes registered.
        region: usize,
    },
    /// A registration that is still the source or target of operations in flight.
    #[error("memory registration {id} has {ops} operations in flight; unregister it after their completions")]
    Busy {
        /// Its slot.
        id: u32,
        /// Operations in flight on it.
        ops: usize,
    },
    /// A tag outside the range users may register.
    #[error("active-message tag {tag} is out of range (user tags are 0..{limit})")]
    TagOutOfRange {
        /// The tag.
        tag: u32,
        /// One past the largest user tag.
        limit: u32,
    },
    /// A handler for this tag exists already.
    #[error("a handler for active-message tag {0} is registered already")]
    TagTaken(u16),
    /// No handler for this tag (unregistering one that is not there).
    #[error("no handler is registered for active-message tag {0}")]
    UnknownTag(u16),
    /// An active message or notification over the payload limit.
    #[error("payload of {len} bytes is over the active-message limit of {limit} bytes")]
    PayloadTooLarge {
        /// Bytes given.
        len: usize,
        /// The limit ([`crate::AM_MAX_PAYLOAD`]).
        limit: usize,
    },
    /// A peer rank outside the job.
    #[error("rank {peer} is not in the job (size {size})")]
    NoSuchPeer {
        /// The rank asked for.
        peer: Rank,
        /// Ranks in the job.
        size: usize,
    },
    /// An argument the call cannot take (a null pointer, a zero length, a tag over the MPI limit).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// What the peer reported about an operation it refused (its own validation failed).
    #[error("rank {peer} refused the operation: {reason}")]
    Remote {
        /// The peer.
        peer: Rank,
        /// Its error, as text.
        reason: String,
    },
    /// Device memory where this engine has no devices (no CUDA driver or GPU, or
    /// `EngineConfig::devices` is `None`), or a route that cannot move it.
    #[error("no devices: {0}")]
    NoDevices(String),
    /// An engine allocation of device memory past `EngineConfig::device_budget`.
    #[error("device {device} is full: {need} more bytes on {used} of a budget of {budget}")]
    DeviceFull {
        /// The device.
        device: usize,
        /// Bytes asked for.
        need: usize,
        /// Bytes the engine holds there.
        used: usize,
        /// The budget.
        budget: usize,
    },
    /// A device copy of a staged transfer, or a device query, failed.
    #[error(transparent)]
    Device(#[from] ferry_base::error::DeviceError),
    /// A handler or completion callback panicked; the engine stops taking operations.
    #[error("a callback panicked ({0}); the engine takes no more operations")]
    CallbackPanicked(String),
    /// The engine has been finalized (or is finalizing).
    #[error("the engine has been finalized")]
    Finalized,
    /// A single copy of host memory to or from a node peer (`process_vm_readv` /
    /// `process_vm_writev`, [`crate::Route::Cma`]) failed after its start-up probe had passed:
    /// the peer's process is gone, or its memory unmapped under a live registration.
    #[error("single copy with rank {peer} failed: {source}")]
    SingleCopy {
        /// The peer.
        peer: Rank,
        /// The system call's error.
        source: std::io::Error,
    },
    /// The communication layer below failed (MPI errors, size mismatches, a lost thread).
    #[error(transparent)]
    Comm(#[from] FerryError),
}

/// Results of the engine.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// For callers whose errors are ferry's (the task runtime): the communication layer's own
/// failures pass through, bad arguments stay bad arguments, the rest keep their text.
impl From<EngineError> for FerryError {
    fn from(e: EngineError) -> FerryError {
        match e {
            EngineError::Comm(e) => e,
            EngineError::Device(e) => FerryError::Device(e),
            EngineError::Finalized => FerryError::ThreadLost("engine progress"),
            e @ (EngineError::NoSuchPeer { .. }
            | EngineError::InvalidArgument(_)
            | EngineError::OutOfBounds { .. }
            | EngineError::TagOutOfRange { .. }
            | EngineError::PayloadTooLarge { .. }
            | EngineError::BadHandle(_)) => FerryError::InvalidArgument(e.to_string()),
            e => FerryError::Internal(e.to_string()),
        }
    }
}
