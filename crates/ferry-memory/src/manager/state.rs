//! The GPU manager's state, one type per concern, each worked on by the files of its stage:
//! the thread's loop (`mod.rs`) holds one of each.

use super::held::HeldPulls;
use super::transfer::{CopyInFlight, CopyOp};
use super::{GpuTask, Options, Queued, Running, Stage, Then, ToHostOp, WriteBack};
use crate::data::copy::TileCopy;
use ferry_device::pool::Pool;
use rustc_hash::FxHashMap;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Device memory: each device's pool, its least-recently-used resident copies, and the
/// write-backs in flight (alloc and eviction, `memory.rs`).
pub(super) struct DeviceMemory<E> {
    pub(super) pools: Vec<Pool>,
    /// Least recently used first. A copy is pushed again at every use with a new stamp; entries
    /// whose stamp is not the copy's current one are stale and skipped (touch in O(1)).
    pub(super) lru: Vec<VecDeque<(Weak<TileCopy>, u64)>>,
    /// The next LRU stamp.
    pub(super) next_stamp: u64,
    /// Write-backs of evicted or cleaned copies in flight.
    pub(super) writebacks: Vec<WriteBack<E>>,
}

/// Admission: per device, the tasks placed there, queued by priority, admitted, or waiting for
/// memory, and the service-time estimates that placement uses (`placement.rs`, `exec.rs`,
/// `finalize.rs`, `parts.rs`).
pub(super) struct Admission {
    /// Per device: tasks placed there and not yet finalized (placement's measure of load).
    pub(super) load: Vec<usize>,
    /// Per device: tasks chosen for it, not yet admitted, by priority.
    pub(super) ready: Vec<BinaryHeap<Queued>>,
    /// Per device: tasks admitted (waiting for memory, staging or running).
    pub(super) admitted: Vec<usize>,
    /// Moving average of a task's service time on each device, seconds.
    pub(super) service_s: Vec<f64>,
    /// When the last task of each (device, exec stream) queue finished.
    pub(super) last_done: Vec<Option<Instant>>,
    /// Per device: the exec stream the next task goes to (round robin).
    pub(super) next_exec: Vec<usize>,
    /// Where the next scan over devices starts, so that none is always served last.
    pub(super) rotate: usize,
    /// Tasks waiting for memory, with their device and since when.
    pub(super) waiting: VecDeque<(usize, GpuTask, Instant)>,
    /// Part writers that could not go where their group's members in flight are (see
    /// `parts`), until those are finalized.
    pub(super) part_deferred: Vec<GpuTask>,
}

/// Work in flight on the devices' streams: tasks, stage-ins, stage-outs, and the events later
/// work waits for (`exec.rs`, `stage_in.rs`, `stage_out.rs`, `finalize.rs`).
pub(super) struct InFlight<E> {
    /// Tasks in flight, one FIFO per (device, exec stream): events on a stream complete in
    /// order, so only each queue's front is polled.
    pub(super) running: Vec<VecDeque<Running<E>>>,
    /// Tasks launched and not yet finalized, over all devices.
    pub(super) in_flight: usize,
    /// Stage-in events per device (its input stream, so also in order), with the paths whose
    /// active clock they hold.
    pub(super) stages: Vec<VecDeque<Stage<E>>>,
    /// Stage-outs in flight for host consumers.
    pub(super) to_host: Vec<ToHostOp<E>>,
    /// Tiles being staged into a device, and the event that ends it; with launch-ahead, also
    /// the tiles a launched task is writing there, and its exec event.
    pub(super) arriving: FxHashMap<(usize, usize), Arc<E>>,
    /// Launch-ahead: the exec events of launched tasks not yet finalized, by sequence number
    /// (the tasks released early after them wait for these); comm-in ahead: the events of
    /// comm-in copies not yet completed, by their key.
    pub(super) launched: FxHashMap<u64, Arc<E>>,
}

/// The transfer layer's device work: copies in flight and pending, pulls held for their
/// producer's signal, and the signal words this rank writes (`transfer.rs`, `held.rs`, `exec.rs`).
pub(super) struct Transfers<E> {
    /// Copies for transfers between ranks, in issue order.
    pub(super) copies: VecDeque<CopyInFlight<E>>,
    /// Independent copies not yet enqueued, batched at the end of the pass (`flush_copies`).
    pub(super) pending_copies: Vec<(CopyOp, Then)>,
    /// Offered pulls held until their producer's signal shows in its host mirror (`held`).
    pub(super) held: HeldPulls,
    /// Per device and exec stream, the last value written to its signal word (see
    /// [`LaunchSite::signal`]): values rise in stream order, so a peer waiting for "at least v"
    /// waits for exactly the tasks up to the one that signalled v.
    pub(super) signals: Vec<Vec<u64>>,
    /// The backend refused a signal once: no more are tried.
    pub(super) no_signals: bool,
    /// Whether the acknowledgement words that tasks in flight wait for were released at a
    /// shutdown after an error (see `Manager::release_acks`).
    pub(super) acks_released: bool,
}

/// The manager's settings, fixed at start-up from [`Options`].
pub(super) struct Tuning {
    /// Admitted tasks allowed per exec stream.
    pub(super) depth: usize,
    /// Fraction of each pool kept clean ahead of need (`FERRY_DEVICE_LOW_WATER`).
    pub(super) low_water: f64,
    /// A task launched ahead follows its predecessor onto its stream (`FERRY_STREAM_AFFINITY`).
    pub(super) stream_affinity: bool,
    /// Stage tiles in from another device over a peer link (`FERRY_PEER_COPY`).
    pub(super) peer_copies: bool,
    /// Fault injection: no waits for device acknowledgements (see [`Options::skip_ack_wait`]).
    pub(super) skip_ack_wait: bool,
    /// How long a pull is held at most before it waits on the device instead
    /// (`FERRY_OFFER_POLL_US`; zero: held only if it asks for a device acknowledgement, which
    /// is held until its signal shows).
    pub(super) hold_for: Duration,
    /// Longest nap between polls while work is in flight.
    pub(super) max_nap: Duration,
    /// Nap without spinning first (see [`Options::yield_when_idle`]).
    pub(super) yield_when_idle: bool,
}

impl Tuning {
    /// The settings that `opts` asks for.
    pub(super) fn new(opts: &Options) -> Tuning {
        Tuning {
            depth: opts.depth.max(1),
            low_water: opts.low_water,
            stream_affinity: opts.stream_affinity,
            peer_copies: opts.peer_copies,
            skip_ack_wait: opts.skip_ack_wait,
            hold_for: Duration::from_micros(opts.offer_poll_us),
            max_nap: Duration::from_micros(opts.poll_us.max(1)),
            yield_when_idle: opts.yield_when_idle,
        }
    }
}
