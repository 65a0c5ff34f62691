//! The GPU manager: one always-on thread per rank that owns every stream, event and pool of the
//! rank's devices and walks each GPU task through its lifecycle:
//!
//! 1. **alloc** — reserve pool blocks for all of the task's tiles at once, all or nothing (a
//!    partial reservation can live-lock two tasks that each hold half of what they need). On
//!    failure: evict least-recently-used copies that are pinned by nobody (a clean copy, valid
//!    elsewhere, is dropped; a dirty one is written back on the output stream first), retry; a
//!    task that still cannot fit waits, holding nothing, and is retried when blocks come back.
//!    A task larger than an empty device fails with a clear error instead of waiting forever.
//! 2. **stage-in** — each tile the task reads that is not valid on its device comes from a peer
//!    device when one holds it (peer copy), else from the host (H2D), on the input stream. A tile
//!    already arriving for another task is waited for, not copied twice.
//! 3. **exec** — the body is launched on the next exec stream after the stage-in event.
//! 4. **stage-out** — nothing leaves the device eagerly. A host consumer (a CPU task, a send, a
//!    read of the result) asks for the copy with [`GpuCmd::ToHost`]; eviction writes dirty copies
//!    back. A tile produced on a device and consumed there is never staged out.
//! 5. **finalize** — when the exec event completes: the written tiles are valid on that device
//!    only, the read ones are valid there too, pins are released, the copies go to the back of
//!    the LRU, and the task's completion callback releases its successors.
//!
//! The thread never blocks while work is in flight: it polls events, napping between polls with
//! a timeout that a new command cuts short. It never calls MPI.
//!
//! Each stage's work on this thread is a `tracing` span (`gpu.alloc`, `gpu.stage_in`, `gpu.exec`
//! — the launch, not the kernel's device time —, `gpu.finalize`, `gpu.stage_out`), and each is
//! counted in the statistics (bytes per path, evictions, write-backs, allocation waits).
//!
//! This module holds the loop, the commands and admission; the lifecycle's stages have a module
//! each: `placement` chooses the device, `memory` allocates and evicts (alloc), `stage_in`
//! brings the tiles read, `exec` launches (and releases successors at launch), `finalize` polls
//! events and completes tasks, `stage_out` serves host consumers. `transfer` serves the
//! transfer layer (comm-in reservations, pins, IPC pulls), `parts` the groups of part writers,
//! `timeline` times each operation on its stream for the trace, `phases` the thread's time.

mod exec;
mod finalize;
mod held;
mod memory;
mod parts;
mod phases;
mod placement;
mod stage_in;
mod stage_out;
mod state;
mod timeline;
mod transfer;

pub use phases::PHASES;
use phases::{Phase, Stopwatch};
use state::{Admission, DeviceMemory, InFlight, Transfers, Tuning};
pub use transfer::{Ahead, CopyOp, DeviceAck, Fill, OnPlaced, Placed, Signal, COMM_IN_KEYS, SIGNAL_FREE_STREAM};

use crate::counters::MemoryCounters;
use crate::data::buffer::TileBuf;
use crate::data::copy::TileCopy;
use crate::data::tile_arg::TileArgs;
use crossbeam::channel::{self, Receiver, Sender};
use ferry_base::error::Rank;
use ferry_base::traffic::{ActiveClock, TrafficPath};
use ferry_device::pool::{Block, Pool};
use ferry_device::{Backend, DeviceError, Mem, Stream};
use ferry_device::{Kernel, LaunchArgs};
use smallvec::SmallVec;
// Keys here are addresses and sequence numbers of this process: no hashing attack to resist,
// and the manager looks them up on every pass (SipHash was a fifth of a pass on emulated devices).
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Pool block alignment: 256 bytes, what cuBLAS and coalesced loads like.
const ALIGN: u64 = 256;
/// Tasks of at least this priority run on the device's high-priority exec stream.
const CRITICAL_PRIORITY: i32 = 2;
/// Initial estimate of a task's service time, seconds, before any task has completed.
const INITIAL_SERVICE_S: f64 = 50e-6;

/// Called on the manager thread when a request ends.
pub type Then = Box<dyn FnOnce(Result<(), DeviceError>) + Send>;

/// Device acknowledgements a node released early waits for: as a rule one per IPC send of the
/// tiles it overwrites.
pub type AckWaits = SmallVec<[DeviceAck; 2]>;

/// Sequence numbers of the launched tasks a node was released early after: one or two as a rule,
/// inline (one per launch-ahead release, on the GPU manager thread).
pub type AfterSeqs = SmallVec<[u64; 4]>;

/// A ready GPU task.
pub struct GpuTask {
    /// What runs (a task class, as the device layer sees it).
    pub kernel: Arc<dyn Kernel>,
    /// The tiles it touches (copy, shape, access mode), in argument order.
    pub tiles: TileArgs,
    /// Its scalar arguments.
    pub args: LaunchArgs,
    /// Its sequence number (the inserted task's).
    pub seq: u64,
    /// This rank.
    pub rank: Rank,
    /// ≥ 2: the high-priority exec stream (critical path).
    pub priority: i32,
    /// Launch-ahead: the device the task must run on, because it was released early by tasks
    /// launched there (or by a comm-in copy enqueued there, see [`Ahead`]) ...
    pub device: Option<usize>,
    /// ... and their sequence numbers (or the copy's key): the task's stream waits for those
    /// still running, and it is finalized only after them.
    pub after: AfterSeqs,
    /// Device acknowledgements of IPC sends of tiles it overwrites (all of `device`): its
    /// stream waits for each word to reach its value before the kernel (`FERRY_DEVICE_ACK`).
    pub acks: AckWaits,
    /// Called once the task is launched (releases its GPU successors early, offers its sends).
    pub launched: Option<OnLaunch>,
    /// Called once it has completed on the device (or failed).
    pub done: Then,
}

/// Called on the manager thread once a task is launched, with where it was launched; says
/// whether it released any GPU successor early (only then must the manager keep track of the
/// task's event).
pub type OnLaunch = Box<dyn FnOnce(&mut LaunchSite<'_>) -> bool + Send>;

/// Where a task was just launched, as its [`OnLaunch`] sees it.
pub struct LaunchSite<'a> {
    device: usize,
    /// Makes the signal (see [`LaunchSite::signal`]); called at most once.
    make: &'a mut dyn FnMut() -> Option<Signal>,
    made: Option<Option<Signal>>,
}

impl LaunchSite<'_> {
    /// The device the task runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// A signal that passes once the task has completed, for a peer process to order work
    /// after it (an offer at launch, `ferry-transfer/src/send.rs`): the manager writes the next value of
    /// the task's exec stream's signal word after it. The same signal for every call; `None`
    /// when the backend cannot signal (the task's sends then wait for its completion).
    pub fn signal(&mut self) -> Option<Signal> {
        *self.made.get_or_insert_with(|| (self.make)())
    }
}

/// Requests to the manager.
pub enum GpuCmd {
    /// Run a GPU task through its lifecycle.
    Task(GpuTask),
    /// Make every copy valid in host memory, then call `then`.
    ToHost {
        /// The copies.
        copies: Vec<Arc<TileCopy>>,
        /// Called when done.
        then: Then,
    },
    /// comm-in: reserve and pin a block on some device for data arriving from another rank
    /// (`None`: no device can take it now; it lands in host memory), then start the copy that
    /// `then` returns, if any.
    Reserve {
        /// The copy the data arrives for.
        copy: Arc<TileCopy>,
        /// Called with where the block was placed; returns the copy to start.
        then: OnPlaced,
    },
    /// Release a pin of `Reserve`, or one the transfer layer took on a device copy it reads.
    Unpin {
        /// The copy.
        copy: Arc<TileCopy>,
        /// The device.
        dev: usize,
    },
    /// Data landed in the block `Reserve` pinned on `dev` (the transfer layer has already marked
    /// it valid, at `generation`): release the pin, file the copy in the LRU.
    Landed {
        /// The copy.
        copy: Arc<TileCopy>,
        /// The device.
        dev: usize,
        /// The version the data is.
        generation: u64,
    },
    /// An asynchronous copy for a transfer; `then` runs when it has completed.
    Copy {
        /// The copy.
        op: CopyOp,
        /// Called when it has completed.
        then: Then,
    },
    /// Describe what is in flight (for the watchdog).
    Report(Sender<String>),
    /// Finish what is in flight and end the thread.
    Shutdown,
}

/// The other threads' side of the manager.
#[derive(Clone)]
pub struct GpuHandle {
    tx: Sender<GpuCmd>,
    /// Where dropped copies give their blocks back.
    pub release: Sender<(usize, Block)>,
}

impl GpuHandle {
    /// Queues `cmd` for the manager.
    ///
    /// # Errors
    /// The manager thread has ended.
    pub fn post(&self, cmd: GpuCmd) -> Result<(), DeviceError> {
        self.tx
            .send(cmd)
            .map_err(|_| DeviceError::Body("the GPU manager thread has ended".into()))
    }
}

/// The GPU manager's tuning, from the runtime's configuration.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Tasks admitted per exec stream of a device (past the priority queue: allocated, staged,
    /// launched) — enough to keep a stream busy across the manager's reaction time, few enough
    /// that a critical-path task that becomes ready is not stuck behind a deep queue of launched
    /// kernels (`FERRY_DEVICE_QUEUE_DEPTH`).
    pub depth: usize,
    /// The longest nap between event polls while work is in flight, µs: the latency with which
    /// a finished kernel or copy is noticed once the thread has been idle a while
    /// (`FERRY_GPU_POLL_US`).
    pub poll_us: u64,
    /// Fraction of each pool kept clean by early write-backs (`FERRY_DEVICE_LOW_WATER`).
    pub low_water: f64,
    /// How long, µs, a pull offered at its producer's launch is held on the host until the
    /// producer's signal shows in its host mirror, before it waits on the device instead
    /// (`FERRY_OFFER_POLL_US`; 0: pulls whose signal has not shown wait on the device at once).
    pub offer_poll_us: u64,
    /// Stage tiles in from other devices over peer links (`FERRY_PEER_COPY`; off only to
    /// measure what they save).
    pub peer_copies: bool,
    /// Time the thread by phase (`FERRY_GPU_PHASES`, see `phases`).
    pub phases: bool,
    /// A task launched ahead follows its predecessor onto its exec stream
    /// (`FERRY_STREAM_AFFINITY`, see `Manager::follows`).
    pub stream_affinity: bool,
    /// Fault injection: tasks skip their waits for device acknowledgements
    /// (`FERRY_FAULTS=skip-ack-wait:1`).
    pub skip_ack_wait: bool,
    /// Nap at once while waiting on the devices, without spinning first: the rank's threads
    /// outnumber its cores (`ferry_base::idle`, `FERRY_YIELD_WHEN_IDLE`).
    pub yield_when_idle: bool,
}

/// Starts the manager thread over `backend`; returns its handle, its thread, and a description
/// of each device.
/// `opts`: the thread's tuning ([`Options`]); `died`: called with the message should the
/// thread panic (a bug), so that the run fails at once instead of waiting for tasks that the
/// dead thread will never finish.
pub fn start<B: Backend>(
    backend: B,
    counters: Arc<MemoryCounters>,
    opts: Options,
    died: Box<dyn FnOnce(String) + Send>,
) -> std::io::Result<(GpuHandle, JoinHandle<()>, Vec<String>)> {
    let (tx, rx) = channel::unbounded();
    let (rel_tx, rel_rx) = channel::unbounded();
    let names = (0..backend.devices()).map(|d| backend.describe(d)).collect();
    let labels: Vec<String> = (0..backend.devices()).map(|d| backend.label(d)).collect();
    let join = std::thread::Builder::new().name("ferry-gpu".into()).spawn(move || {
        ferry_base::affinity::note_thread(ferry_base::affinity::Role::Gpu);
        ferry_base::naps::precise();
        let mut m = Manager::new(backend, rx, rel_rx, counters);
        m.timeline = timeline::Timeline::start(&mut m.b, &labels);
        m.tune = Tuning::new(&opts);
        m.watch = Stopwatch::new(opts.phases);
        // Unwinding drops the requests in flight unanswered; `died` fails the run.
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.run())) {
            died(ferry_base::error::panic_message(&*p).to_string());
        }
    })?;
    Ok((GpuHandle { tx, release: rel_tx }, join, names))
}

struct Running<E> {
    task: GpuTask,
    dev: usize,
    exec: Arc<E>,
    queue: usize,
    launched: Instant,
    /// Events this task's stage-in recorded (shared with later readers of the same tiles).
    staged: Option<Arc<E>>,
    /// Host buffers being read by H2D copies: alive until the task ends.
    _keep: Vec<Arc<TileBuf>>,
    /// Source copies of peer copies, pinned on their device until the task ends (else eviction
    /// could reuse the block before the copy has read it).
    sources: Vec<(Arc<TileCopy>, usize)>,
    /// The kernel's start event, when the GPU timeline is on.
    timed: Option<E>,
    /// Its exec event was found complete earlier in this pass (`Manager::consumers_done`).
    done: bool,
}

/// A task chosen for a device, waiting for a slot; the heap pops the highest priority, then the
/// earliest inserted.
struct Queued(GpuTask);

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        self.0.priority == o.0.priority && self.0.seq == o.0.seq
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.priority.cmp(&o.0.priority).then(o.0.seq.cmp(&self.0.seq))
    }
}

/// A stage-in in flight on a device's input stream.
struct Stage<E> {
    event: Arc<E>,
    /// The paths whose active clock it holds.
    paths: smallvec::SmallVec<[TrafficPath; 4]>,
    /// Its start event, task and bytes, when the GPU timeline is on.
    timed: Option<(E, u64, u64)>,
}

struct ToHostOp<E> {
    /// Stage-outs issued, with their source device.
    copies: Vec<(Arc<TileCopy>, usize)>,
    /// Their host buffers, alive until the copies have landed.
    buffers: Vec<Arc<TileBuf>>,
    events: Vec<E>,
    /// Start events of the copies (GPU timeline), parallel to `events`.
    timed: Vec<Option<E>>,
    /// Copies not yet issued: an eviction write-back into their host buffer is still in flight
    /// (for a CPU writer, this is the whole point: its buffer must be quiet before it writes).
    pending: Vec<Arc<TileCopy>>,
    then: Option<Then>,
}

struct WriteBack<E> {
    copy: Arc<TileCopy>,
    dev: usize,
    event: E,
    /// The copy's generation when the write-back started.
    generation: u64,
    /// Free the block once landed (eviction), or keep it clean (cleaning ahead).
    free: bool,
    /// The host buffer being written (the host tier may drop the copy's reference meanwhile).
    _host: Arc<TileBuf>,
    /// Its start event (GPU timeline).
    timed: Option<E>,
}

struct Manager<B: Backend> {
    b: B,
    rx: Receiver<GpuCmd>,
    released: Receiver<(usize, Block)>,
    counters: Arc<MemoryCounters>,
    clock: ActiveClock,
    mem: DeviceMemory<B::Event>,
    adm: Admission,
    fly: InFlight<B::Event>,
    xfer: Transfers<B::Event>,
    tune: Tuning,
    /// Times every operation on its stream, while a trace is written.
    timeline: Option<timeline::Timeline<B::Event>>,
    /// Charges the thread's time to what it is doing (`ManagerPhases` in the statistics).
    watch: Stopwatch,
    stop: bool,
}

fn key(copy: &Arc<TileCopy>, d: usize) -> (usize, usize) {
    (Arc::as_ptr(copy) as usize, d)
}

impl<B: Backend> Manager<B> {
    fn new(b: B, rx: Receiver<GpuCmd>, released: Receiver<(usize, Block)>, counters: Arc<MemoryCounters>) -> Self {
        let n = b.devices();
        let pools = (0..n).map(|d| Pool::new(b.pool_bytes(d), ALIGN)).collect();
        let b_exec = b.exec_streams().max(1);
        let queues = n * b_exec;
        Manager {
            b,
            rx,
            released,
            counters,
            clock: ActiveClock::new(),
            timeline: None,
            watch: Stopwatch::new(false),
            stop: false,
            mem: DeviceMemory {
                pools,
                lru: (0..n).map(|_| VecDeque::new()).collect(),
                next_stamp: 0,
                writebacks: Vec::new(),
            },
            adm: Admission {
                load: vec![0; n],
                ready: (0..n).map(|_| std::collections::BinaryHeap::new()).collect(),
                admitted: vec![0; n],
                service_s: vec![INITIAL_SERVICE_S; n],
                last_done: vec![None; queues],
                next_exec: vec![0; n],
                rotate: 0,
                waiting: VecDeque::new(),
                part_deferred: Vec::new(),
            },
            fly: InFlight {
                running: (0..queues).map(|_| VecDeque::new()).collect(),
                in_flight: 0,
                stages: (0..n).map(|_| VecDeque::new()).collect(),
                to_host: Vec::new(),
                arriving: FxHashMap::default(),
                launched: FxHashMap::default(),
            },
            xfer: Transfers {
                copies: VecDeque::new(),
                pending_copies: Vec::new(),
                held: Default::default(),
                signals: vec![vec![0; b_exec]; n],
                no_signals: false,
                acks_released: false,
            },
            // What the unit tests, which build a manager directly, run with; `start` puts the
            // caller's settings in place.
            tune: Tuning {
                depth: 2,
                low_water: 0.0,
                stream_affinity: true,
                peer_copies: true,
                skip_ack_wait: false,
                hold_for: Duration::ZERO,
                max_nap: Duration::from_micros(100),
                yield_when_idle: false,
            },
        }
    }

    fn busy(&self) -> bool {
        self.fly.in_flight > 0
            || !self.fly.to_host.is_empty()
            || !self.mem.writebacks.is_empty()
            || !self.xfer.copies.is_empty()
            || !self.xfer.pending_copies.is_empty()
            || !self.xfer.held.is_empty()
            || !self.adm.waiting.is_empty()
            || !self.adm.part_deferred.is_empty()
            || self.adm.ready.iter().any(|r| !r.is_empty())
    }

    fn run(&mut self) {
        let mut nap = Duration::from_micros(1);
        let mut idle_polls = 0u32;
        loop {
            let t0 = Instant::now();
            let mut worked = false;
            self.watch.switch(Phase::Commands);
            loop {
                while let Ok(cmd) = self.rx.try_recv() {
                    worked = true;
                    self.handle(cmd);
                }
                // Held pulls whose producer has signalled go first: they are the oldest.
                worked |= self.release_held();
                if self.xfer.pending_copies.is_empty() {
                    break;
                }
                // Enqueue the run of copies that ended the pass. comm-in ahead posts their
                // consumers to this thread: the next round takes them, so they are launched in
                // this pass rather than after a round of polls and finalizations.
                self.flush_copies();
            }
            // Tasks that came are admitted and launched only now, after every other command of
            // the pass: a transfer's reservation and pull (on a halo exchange's critical path)
            // must not wait behind launches (5–10 µs each on CUDA) — nor the pulls of a run
            // that ended the pass.
            self.timed(Phase::Launch, Self::pump_ready);
            worked |= self.drain_released();
            worked |= self.timed(Phase::Poll, Self::poll);
            self.tick_timeline();
            if self.stop && self.fly.in_flight > 0 && !self.xfer.acks_released {
                self.release_acks();
            }
            // At shutdown, tasks still waiting for memory or deferred behind part writers are
            // abandoned (the run failed).
            if self.stop && self.fly.in_flight == 0 && self.fly.to_host.is_empty() && self.mem.writebacks.is_empty() {
                self.abandon_copies();
                self.watch.switch(Phase::Idle);
                self.watch.publish(&self.counters);
                return;
            }
            if worked {
                self.counters
                    .gpu_manager_busy_ns
                    .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
                self.watch.publish(&self.counters);
                nap = Duration::from_micros(1);
                idle_polls = 0;
                continue;
            }
            self.watch.switch(Phase::Idle);
            if !self.busy() {
                self.watch.publish(&self.counters);
                // Nothing in flight: sleep until a command or a released block arrives.
                self.counters.gpu_manager_naps.fetch_add(1, Relaxed);
                crossbeam::select! {
                    recv(self.rx) -> m => match m {
                        Ok(cmd) => self.timed(Phase::Commands, |m| m.handle(cmd)),
                        Err(_) => self.stop = true,
                    },
                    recv(self.released) -> r => if let Ok((d, b)) = r { self.mem.pools[d].free(b) },
                }
                continue;
            }
            if idle_polls < 64 && !self.tune.yield_when_idle {
                idle_polls += 1;
                std::hint::spin_loop();
                continue;
            }
            self.counters.gpu_manager_naps.fetch_add(1, Relaxed);
            match self.rx.recv_timeout(nap) {
                Ok(cmd) => self.timed(Phase::Commands, |m| m.handle(cmd)),
                Err(channel::RecvTimeoutError::Timeout) => {
                    nap = (nap * 2).min(self.tune.max_nap);
                    if !self.adm.waiting.is_empty() && self.fly.in_flight == 0 {
                        self.retry_waiting();
                    }
                }
                Err(channel::RecvTimeoutError::Disconnected) => self.stop = true,
            }
        }
    }

    /// A shutdown with tasks still in flight follows an error (a healthy run waits for every
    /// task first), and an error fails every rank of the job: a task waiting for a device
    /// acknowledgement that its consumer will never write would hold the shutdown forever. Its
    /// word is set past any value here, on the output stream (which waits for nothing); tasks
    /// launched after this skip their waits (`exec`). Their consumers may still be reading:
    /// the results of a failed run are garbage anyway.
    fn release_acks(&mut self) {
        const RELEASE: u64 = 1 << 62;
        self.xfer.acks_released = true;
        let waits: Vec<DeviceAck> = self
            .fly
            .running
            .iter()
            .flatten()
            .flat_map(|r| r.task.acks.iter().copied())
            .collect();
        for a in waits {
            let at = Mem::Pool(ferry_device::ack_offset(self.b.pool_bytes(a.dev), a.word as usize));
            if let Err(e) = self.b.write_signal(a.dev, Stream::Out, at, RELEASE) {
                tracing::warn!(device = a.dev, error = %e, "an acknowledgement word could not be released at shutdown");
            }
        }
    }

    /// Runs `f` with its time charged to phase `p` (then back to the phase it interrupted).
    fn timed<R>(&mut self, p: Phase, f: impl FnOnce(&mut Self) -> R) -> R {
        let prev = self.watch.switch(p);
        let r = f(self);
        self.watch.switch(prev);
        r
    }

    fn handle(&mut self, cmd: GpuCmd) {
        // Only copies that come together are batched: a copy must not wait behind the launches
        // and other work of the commands after it (on the stencil's critical path, an edge's
        // pull waited for the next step's launches). The bookkeeping commands of transfers —
        // a reservation, a landing, an unpin — take well under a µs, so they do not end a batch,
        // unless a task waits for memory (a freed block then launches it); a reservation's own
        // copy joins the batch when it may, and ends it (going after it) when it may not.
        let cheap = matches!(
            &cmd,
            GpuCmd::Reserve { .. } | GpuCmd::Landed { .. } | GpuCmd::Unpin { .. }
        ) && self.adm.waiting.is_empty();
        if !cheap && !matches!(&cmd, GpuCmd::Copy { op, .. } if self.batchable(op)) {
            self.flush_copies();
        }
        match cmd {
            GpuCmd::Task(t) => self.place(t),
            GpuCmd::ToHost { copies, then } => self.start_to_host(copies, then),
            GpuCmd::Reserve { copy, then } => {
                let placed = self.reserve(&copy);
                if let Some((op, then)) = then(placed) {
                    if !self.batchable(&op) {
                        self.flush_copies();
                    }
                    self.start_copy(op, then);
                }
            }
            GpuCmd::Unpin { copy, dev } => self.unpin(&copy, dev),
            GpuCmd::Landed { copy, dev, generation } => self.landed(&copy, dev, generation),
            GpuCmd::Copy { op, then } => self.start_copy(op, then),
            GpuCmd::Report(reply) => {
                let _ = reply.send(self.report());
            }
            GpuCmd::Shutdown => self.stop = true,
        }
    }

    /// Chooses the device of a ready task and queues it there.
    fn place(&mut self, t: GpuTask) {
        // A task released early runs where the tasks (or the comm-in copy) it follows run.
        let forced = t.device.filter(|&d| d < self.mem.pools.len());
        let d = match (Self::part_binding(&t), forced) {
            (parts::Binding::Conflict, _) => return self.adm.part_deferred.push(t),
            (parts::Binding::Bound(e), Some(d)) if d != e => return self.adm.part_deferred.push(t),
            (parts::Binding::Bound(e), _) => {
                self.counters.device(e).parts_together.fetch_add(1, Relaxed);
                e
            }
            (parts::Binding::Free, Some(d)) => d,
            (parts::Binding::Free, None) => self.choose(&t),
        };
        if forced.is_some() && t.after.iter().any(|&q| q < COMM_IN_KEYS) {
            self.counters.device(d).launched_ahead.fetch_add(1, Relaxed);
        }
        Self::bind_parts(&t, d);
        self.adm.load[d] += 1;
        self.adm.ready[d].push(Queued(t));
    }

    fn report(&self) -> String {
        let mut s = String::new();
        for d in 0..self.mem.pools.len() {
            s += &format!(
                "  device {d}: {} ready, {} admitted ({} waiting for memory), pool {}/{} bytes used\n",
                self.adm.ready[d].len(),
                self.adm.admitted[d],
                self.adm.waiting.iter().filter(|(x, ..)| *x == d).count(),
                self.mem.pools[d].used(),
                self.mem.pools[d].capacity()
            );
        }
        s += &format!(
            "  {} stage-outs, {} write-backs and {} transfer copies in flight; {} part writers deferred\n",
            self.fly.to_host.len(),
            self.mem.writebacks.len(),
            self.xfer.copies.len(),
            self.adm.part_deferred.len()
        );
        s
    }

    fn drain_released(&mut self) -> bool {
        let mut any = false;
        while let Ok((d, b)) = self.released.try_recv() {
            self.mem.pools[d].free(b);
            any = true;
        }
        if any {
            self.retry_waiting();
        }
        any
    }

    fn admit(&mut self, d: usize, t: GpuTask) {
        let span = tracing::info_span!("gpu.alloc", class = t.kernel.name(), seq = t.seq, device = d);
        let allocated = span.in_scope(|| self.try_alloc(d, &t));
        match allocated {
            Ok(true) => self.launch(d, t),
            Ok(false) => {
                self.counters.device(d).alloc_waits.fetch_add(1, Relaxed);
                self.adm.waiting.push_back((d, t, Instant::now()));
            }
            Err(e) => self.finish_early(d, t, e),
        }
    }

    fn finish_early(&mut self, d: usize, t: GpuTask, e: DeviceError) {
        self.adm.load[d] -= 1;
        self.adm.admitted[d] -= 1;
        self.unbind_parts(&t);
        (t.done)(Err(e));
        self.pump(d);
    }

    /// Admits the ready tasks of every device that has free slots, one per device in turn (all
    /// of device 0's launches before device 1's would leave device 1 idle for their duration:
    /// the 1-rank × 2-GPU stencil lost 12% that way).
    fn pump_ready(&mut self) {
        loop {
            let mut admitted = false;
            for d in 0..self.adm.ready.len() {
                admitted |= self.admit_next(d);
            }
            if !admitted {
                return;
            }
        }
    }

    /// Admits the highest-priority ready tasks of `d` while it has free slots.
    fn pump(&mut self, d: usize) {
        while self.admit_next(d) {}
    }

    /// Admits the highest-priority ready task of `d` if it has a free slot; whether it did.
    fn admit_next(&mut self, d: usize) -> bool {
        if self.adm.admitted[d] >= self.tune.depth.saturating_mul(self.b.exec_streams().max(1)) {
            return false;
        }
        let Some(Queued(t)) = self.adm.ready[d].pop() else {
            return false;
        };
        self.adm.admitted[d] += 1;
        self.admit(d, t);
        true
    }

    fn retry_waiting(&mut self) {
        if self.adm.waiting.is_empty() {
            return;
        }
        let prev = self.watch.switch(Phase::Launch);
        let waiting = std::mem::take(&mut self.adm.waiting);
        for (d, t, since) in waiting {
            match self.try_alloc(d, &t) {
                Ok(true) => {
                    self.counters
                        .device(d)
                        .alloc_wait_ns
                        .fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
                    self.launch(d, t)
                }
                Ok(false) => self.adm.waiting.push_back((d, t, since)),
                Err(e) => self.finish_early(d, t, e),
            }
        }
        self.watch.switch(prev);
    }

    fn count(&mut self, p: TrafficPath, bytes: usize) {
        let c = self.counters.path(p);
        c.bytes_sent.fetch_add(bytes as u64, Relaxed);
        c.sends.fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests;
