//! # ferry-engine
//!
//! The communication engine that task-based frameworks keeping their own task graph link
//! (PaRSEC's `parsec_comm_engine_t`, StarPU-MPI's point-to-point calls, Realm's active
//! messages): registered memory, active messages, one-sided put and get with local completions
//! and remote notifications, and tagged two-sided send and receive. It knows ranks, tags and
//! memory regions, never tasks or graphs.
//!
//! ```text
//! framework threads ──► Engine (any thread) ──► command channel ──► progress thread ──► MPI
//!        ▲                                                                │
//!        └──── completions and handlers (progress thread, or Engine::progress) ◄┘
//! ```
//!
//! ## Threading contract
//! - **Calls.** [`Engine`] and its [`EngineHandle`]s are `Send + Sync`: any thread may call any
//!   operation concurrently.
//!   Operations only queue work for the progress thread and return; none blocks, except the
//!   collectives [`EngineHandle::allgather`] and [`EngineHandle::barrier`] (which must not be called from a
//!   callback) and [`Engine::finalize`].
//! - **MPI.** Only the engine's progress thread calls MPI on the engine's communicators
//!   (duplicates of `MPI_COMM_WORLD` or of the caller's communicator, so the caller's traffic
//!   never matches the engine's). If ferry initialises MPI, it does so on that thread with
//!   `MPI_THREAD_FUNNELED` and finalizes it when the engine stops; a caller that uses MPI itself
//!   must initialise it first, with `MPI_THREAD_MULTIPLE`.
//! - **Callbacks and handlers** run on the progress thread ([`Completions::ProgressThread`],
//!   the default) or, queued, inside [`EngineHandle::progress`] on the caller's thread
//!   ([`Completions::Caller`]). With [`Progress::Caller`] the progress thread is the caller's
//!   thread inside `progress`; with [`Progress::Shared`], whichever thread runs the pass (the
//!   engine's thread, a caller inside `progress` or a collective, or one that posted an
//!   operation). They must not block waiting for another engine event (on the
//!   progress thread it would never come), must not call MPI and must not call the
//!   collectives; they may start new operations. A panic in one is caught, and the engine then
//!   refuses new operations with [`EngineError::CallbackPanicked`].
//!
//! ## Ordering and limits
//! - Active messages from one source with one tag are delivered in send order (between ranks of
//!   a node, short ones travel through shared-memory rings and the rest over MPI, in order). A message whose
//!   tag has no handler yet is held, and delivered in order once one is registered.
//! - Payloads of active messages and notifications: at most [`AM_MAX_PAYLOAD`] bytes. User tags:
//!   `0..`[`AM_USER_TAGS`].
//! - A put's or get's completion runs once, with `Ok` or the reason; a notification reaches the
//!   target's handler only after the data has landed (put: at the target; get: at the origin).

#![warn(missing_docs)]

mod am;
mod am_rings;
mod arena;
mod caps;
mod cma;
mod collective;
mod config;
mod delivery;
mod driving;
mod engine;
mod error;
mod handle;
mod ipc;
mod lease;
mod message;
mod one_sided;
mod peer_map;
mod placement;
mod placer;
mod registry;
mod staged;
mod stats;
mod stream;
mod two_sided;
mod wire;

pub use am::{AmBytes, AmMessage, Handler};
pub use caps::{EngineCaps, PeerCaps, Route};
pub use collective::{Agreed, ClockPair, Outcome};
pub use config::{Devices, EngineConfig, Progress, AM_RING_MAX_BYTES, CMA_MIN_BYTES};
pub use delivery::Completions;
pub use driving::{MpiInfo, Passed, ProgressCounters, ProgressShare, DEFAULT_BACKSTOP};
pub use engine::{Completion, DeviceBuffer, Engine, EngineHandle, Notify};
pub use error::{EngineError, Result};
pub use ferry_base::error::Rank;
pub use ferry_base::faults::Faults;
pub use ferry_base::poller::{Polled, Poller};
pub use ferry_base::traffic::{Traffic, TrafficPath};
pub use ferry_comm::GpuDirect;
pub use ferry_comm::{CallerComm, RawComm};
pub use handle::{MemHandle, MemKind, MEM_HANDLE_BYTES};
pub use message::{Bytes, Done, Lane, MemRegion, Message};
pub use peer_map::PeerMapping;
pub use placement::{Placed, PlacedRequest};
pub use placer::Placer;
pub use stats::EngineStats;

/// Peers' device allocations an engine keeps mapped once idle unless told otherwise
/// ([`EngineConfig::ipc_keep_mappings`]).
pub const IPC_KEEP_MAPPINGS: usize = ferry_device::copier::KEEP_IDLE_MAPPINGS;

/// Largest payload of an active message or a notification, bytes. Active messages are received
/// whole on the progress thread as they arrive; larger data belongs in a put or get.
pub const AM_MAX_PAYLOAD: usize = 64 << 10;

/// One past the largest tag users may register handlers for (the engine's own protocol uses
/// the tags above).
pub const AM_USER_TAGS: u32 = 1 << 14;
