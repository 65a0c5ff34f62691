//! How the engine starts.

use crate::delivery::Completions;
use ferry_base::faults::Faults;
use ferry_comm::{CallerComm, GpuDirect};

/// Which devices the engine moves memory of.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Devices {
    /// The CUDA devices when the driver and a GPU are there, else none.
    #[default]
    Auto,
    /// The CUDA devices; start-up fails without them.
    Cuda,
    /// This many emulated devices: device memory is host memory from
    /// [`crate::EngineHandle::alloc_device`], copies are `memcpy`s (tests on machines without
    /// GPUs).
    Emulated(usize),
    /// None: registering device memory is an error.
    None,
}

/// Who drives the engine's MPI progress.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Progress {
    /// A progress thread of the engine's own polls MPI all the time (PaRSEC's communication
    /// thread): operations progress while the caller computes.
    #[default]
    Thread,
    /// No thread: MPI progresses only inside [`crate::EngineHandle::progress`] (and the
    /// blocking collectives), called by the framework's own threads, one at a time (concurrent
    /// callers return at once). The lowest latency when the framework has a polling thread to
    /// spare or fewer cores than threads; nothing moves while nobody calls it.
    Caller,
    /// Both: any thread that calls [`crate::EngineHandle::progress`] (or waits in a blocking
    /// collective) runs passes of the loop itself, one thread at a time, as with `Caller`; the
    /// engine's thread is a backstop that drives only when nobody else has for
    /// [`EngineConfig::backstop_us`] (200 µs by default), so
    /// operations still progress while the framework computes. For a rank per core: the thread
    /// that waits for a message polls for it, without a switch to the progress thread and back
    /// per message. Callbacks and handlers run inline on whichever thread runs the pass (or, with
    /// [`Completions::Caller`], inside `progress`). Needs MPI at `MPI_THREAD_SERIALIZED` or above.
    Shared,
}

/// Options of [`crate::Engine::start`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Run on (a duplicate of) this communicator instead of `MPI_COMM_WORLD`. MPI must then be
    /// initialised by the caller with `MPI_THREAD_MULTIPLE`. Ranks are ranks of this
    /// communicator.
    pub communicator: Option<CallerComm>,
    /// Who drives MPI progress: the engine's own thread, or the caller's calls to
    /// [`crate::EngineHandle::progress`].
    pub progress: Progress,
    /// Where callbacks and handlers run (with [`Progress::Caller`], always on the thread that
    /// calls `progress`: inside the pass, or queued for its end with [`Completions::Caller`]).
    pub completions: Completions,
    /// Longest nap of the progress thread when nothing happens, µs (`None`: 50). Lower costs a
    /// core; higher adds up to that much latency to the first message after a quiet spell.
    pub progress_sleep_us: Option<u64>,
    /// With [`Progress::Shared`]: how often, µs, the engine's thread drives the loop when nobody
    /// else has since its last look (`None`: 200; 1 to 1,000,000). Shorter bounds the delay of a
    /// message while the framework computes, longer takes less of a busy core.
    pub backstop_us: Option<u64>,
    /// Whether the progress thread yields its core when idle instead of spinning (`None`: when
    /// this rank has fewer than two cores, one for the caller's thread and one for it).
    pub yield_when_idle: Option<bool>,
    /// Which devices' memory may be registered.
    pub devices: Devices,
    /// Whether device memory is handed to MPI (GPU-direct) instead of staged through pinned
    /// host buffers: `Auto` when the library reports CUDA support, `Force` to trust the caller
    /// (an MPI over a CUDA-enabled UCX that does not say so). Both ranks of a pair must allow it.
    pub gpu_direct: GpuDirect,
    /// Whether device memory of two ranks of one node moves by peer copies through CUDA IPC
    /// (mapped once per allocation) before GPU-direct or staging is considered. Both ranks
    /// must allow it.
    pub ipc: bool,
    /// Peers' device allocations kept mapped here once no copy uses them (the least recently
    /// used closes first past this many): mapping one costs milliseconds on CUDA, and a mapping
    /// kept open keeps a freed allocation's memory from going back to its owner's device.
    pub ipc_keep_mappings: usize,
    /// Whether peer copies lease the target's registration from the table it publishes in
    /// shared memory, with no message before the copy (`true`), or always ask the target for
    /// a grant first (`false`: an override for benchmarks and tests of that protocol).
    pub ipc_leases: bool,
    /// At most this many bytes of device memory per device that the engine allocates
    /// ([`crate::EngineHandle::alloc_device`], placed gets); `None`: until the device is full.
    pub device_budget: Option<usize>,
    /// Bytes of device memory per device reserved, at the first placed get on that device, for
    /// the memory of placed gets (one allocation carved by a best-fit pool: no allocation and
    /// no device-wide synchronization of a free per get; one IPC export for all of them).
    /// Capped by what `device_budget` leaves then; 0: every placed get allocates its own.
    pub placement_arena: usize,
    /// Bytes per chunk of staged payloads (every rank the same; at least 4 KiB).
    pub bounce_chunk: usize,
    /// Pinned bounce buffers per direction (at least 1): the host memory of staged transfers
    /// is `2 × bounce_slots × bounce_chunk`.
    pub bounce_slots: usize,
    /// Payload sends in flight per rank, and per peer (at least 1 each); more wait in order.
    pub max_sends: usize,
    /// See `max_sends`.
    pub max_sends_per_peer: usize,
    /// With [`Progress::Thread`]: whether [`crate::EngineHandle::share_progress`] may later hand
    /// the loop's driving to the caller's threads. When ferry initialises MPI it then asks for
    /// `MPI_THREAD_SERIALIZED` instead of `MPI_THREAD_FUNNELED` (some libraries do more work per
    /// call at the higher level). Implied by [`Progress::Shared`].
    pub share_later: bool,
    /// Whether the engine receives active messages (`true`): handlers, active messages, puts
    /// and gets need them. `false` leaves only tagged sends and receives and the collectives,
    /// and lets an idle progress thread block until the next operation instead of polling for
    /// messages that may come (for a runtime that builds its own protocols on
    /// [`crate::EngineHandle::send_message`]). Every rank must say the same.
    pub active_messages: bool,
    /// Faults injected into the progress loop (`mpi-delay`, `slow-link`), for tests of what a
    /// slow network does to the caller, and into emulated devices (`pin-fail`: their pinned
    /// allocations, the bounce buffers, fail); none by default.
    pub faults: Faults,
    /// Whether active messages between ranks of one node go through rings in shared memory,
    /// written by the sending thread and read by the peer's loop, instead of MPI (`true`):
    /// up to 108 bytes in a slot of a message ring, longer ones (up to
    /// [`EngineConfig::am_ring_max_bytes`]) copied through a byte ring. A pair uses its rings
    /// only when both ranks say so and could map each other's. `false`: an override for
    /// benchmarks.
    pub am_rings: bool,
    /// The longest active message, bytes, that goes through the rings (`am_rings`); longer ones
    /// go over MPI, in order with the rest. Default [`AM_RING_MAX_BYTES`]: every active
    /// message. Each rank keeps a byte ring per node peer of at least twice this (capped at
    /// the default's), 1 MiB each with up to 17 ranks per node and 16 MiB per rank in all
    /// above that. 1,080 or less keeps no byte rings at all: messages of 109 bytes up to the
    /// limit then go in several slots, longer ones over MPI.
    pub am_ring_max_bytes: usize,
    /// Whether gets and puts between host registrations of ranks of one node copy straight
    /// from or into the peer's memory with `process_vm_readv` / `process_vm_writev` (Linux's
    /// Cross Memory Attach, [`crate::Route::Cma`]; `true`) instead of going through MPI. At
    /// start-up each rank lets the node's other processes of its user read its memory
    /// (`prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`, as Open MPI's shared-memory transport does
    /// under Yama) and probes each peer's; a pair whose probe fails (a kernel without CMA, a
    /// seccomp filter, Yama's `ptrace_scope` 2 or 3) stays on MPI. `false`: an override for
    /// benchmarks, or for a job whose processes must not read each other's memory.
    pub cma: bool,
    /// Smallest get or put, bytes, that takes the single-copy route (`cma`); smaller ones go
    /// over MPI, whose eager messages cost less than the system call's setup (it pins the
    /// peer's pages) below a few KiB. Default 4096, the eager limit of Open MPI's
    /// shared-memory transport, above which it uses the same call.
    pub cma_min_bytes: usize,
}

/// [`EngineConfig::am_ring_max_bytes`] by default: the longest active message on the wire, a
/// payload of [`crate::AM_MAX_PAYLOAD`] bytes and the engine's header room (68 KiB).
pub const AM_RING_MAX_BYTES: usize = crate::engine::AM_WIRE_MAX;

/// [`EngineConfig::cma_min_bytes`] by default.
pub const CMA_MIN_BYTES: usize = 4096;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            communicator: None,
            progress: Progress::Thread,
            completions: Completions::ProgressThread,
            progress_sleep_us: None,
            backstop_us: None,
            yield_when_idle: None,
            devices: Devices::Auto,
            gpu_direct: GpuDirect::Auto,
            ipc: true,
            ipc_leases: true,
            ipc_keep_mappings: crate::IPC_KEEP_MAPPINGS,
            device_budget: None,
            placement_arena: 256 << 20,
            bounce_chunk: 4 << 20,
            bounce_slots: 8,
            max_sends: 64,
            max_sends_per_peer: 16,
            share_later: false,
            active_messages: true,
            faults: Faults::default(),
            am_rings: true,
            am_ring_max_bytes: AM_RING_MAX_BYTES,
            cma: true,
            cma_min_bytes: CMA_MIN_BYTES,
        }
    }
}
