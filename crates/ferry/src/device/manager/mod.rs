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
//! This module holds the loop and the task lifecycle; `placement` chooses the device,
//! `memory` reserves and evicts, `stage_out` serves host consumers, `timeline` times each
//! operation on its stream for the trace.

mod memory;
mod parts;
mod phases;
mod placement;
mod stage_out;
mod timeline;
mod transfer;

pub(crate) use phases::PHASES;
use phases::{Phase, Stopwatch};
pub(crate) use transfer::{Ahead, CopyOp, OnPlaced, Placed, Signal, COMM_IN_KEYS};

use super::pool::{Block, Pool};
use super::{Backend, DeviceError, Launch, Stream};
use crate::data::buffer::TileBuf;
use crate::data::copy::{Location, TileCopy};
use crate::error::Rank;
use crate::graph::TaskClass;
use crate::stats::{ActiveClock, Counters, Path};
use crossbeam::channel::{self, Receiver, Sender};
// Keys here are addresses and sequence numbers of this process: no hashing attack to resist,
// and the manager looks them up on every pass (SipHash was a fifth of a pass on emulated devices).
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Pool block alignment: 256 bytes, what cuBLAS and coalesced loads like.
const ALIGN: u64 = 256;
/// Tasks of at least this priority run on the device's high-priority exec stream.
const CRITICAL_PRIORITY: i32 = 2;
/// Initial estimate of a task's service time, seconds, before any task has completed.
const INITIAL_SERVICE_S: f64 = 50e-6;

/// Called on the manager thread when a request ends.
pub(crate) type Then = Box<dyn FnOnce(Result<(), DeviceError>) + Send>;

/// A ready GPU task.
pub(crate) struct GpuTask {
    pub(crate) class: TaskClass,
    /// The graph's own tile arguments (copy, shape, access mode).
    pub(crate) tiles: crate::graph::task::TileArgs,
    pub(crate) args: crate::graph::task::TaskArgs,
    pub(crate) seq: u64,
    pub(crate) rank: Rank,
    /// ≥ 2: the high-priority exec stream (critical path).
    pub(crate) priority: i32,
    /// Launch-ahead: the device the task must run on, because it was released early by tasks
    /// launched there (or by a comm-in copy enqueued there, see [`Ahead`]) ...
    pub(crate) device: Option<usize>,
    /// ... and their sequence numbers (or the copy's key): the task's stream waits for those
    /// still running, and it is finalized only after them.
    pub(crate) after: Vec<u64>,
    /// Called once the task is launched (releases its GPU successors early, offers its sends).
    pub(crate) launched: Option<OnLaunch>,
    pub(crate) done: Then,
}

/// Called on the manager thread once a task is launched, with where it was launched; says
/// whether it released any GPU successor early (only then must the manager keep track of the
/// task's event).
pub(crate) type OnLaunch = Box<dyn FnOnce(&mut LaunchSite<'_>) -> bool + Send>;

/// Where a task was just launched, as its [`OnLaunch`] sees it.
pub(crate) struct LaunchSite<'a> {
    device: usize,
    /// Makes the signal (see [`LaunchSite::signal`]); called at most once.
    make: &'a mut dyn FnMut() -> Option<Signal>,
    made: Option<Option<Signal>>,
}

impl LaunchSite<'_> {
    /// The device the task runs on.
    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// A signal that passes once the task has completed, for a peer process to order work
    /// after it (an offer at launch, `transfer/send.rs`): the manager writes the next value of
    /// the task's exec stream's signal word after it. The same signal for every call; `None`
    /// when the backend cannot signal (the task's sends then wait for its completion).
    pub(crate) fn signal(&mut self) -> Option<Signal> {
        *self.made.get_or_insert_with(|| (self.make)())
    }
}

/// Requests to the manager.
pub(crate) enum GpuCmd {
    Task(GpuTask),
    /// Make every copy valid in host memory, then call `then`.
    ToHost {
        copies: Vec<Arc<TileCopy>>,
        then: Then,
    },
    /// comm-in: reserve and pin a block on some device for data arriving from another rank
    /// (`None`: no device can take it now; it lands in host memory).
    Reserve {
        copy: Arc<TileCopy>,
        then: OnPlaced,
    },
    /// Release a pin of `Reserve`, or one the transfer layer took on a device copy it reads.
    Unpin {
        copy: Arc<TileCopy>,
        dev: usize,
    },
    /// Data landed in the block `Reserve` pinned on `dev` (the transfer layer has already marked
    /// it valid, at `generation`): release the pin, file the copy in the LRU.
    Landed {
        copy: Arc<TileCopy>,
        dev: usize,
        generation: u64,
    },
    /// An asynchronous copy for a transfer; `then` runs when it has completed.
    Copy {
        op: CopyOp,
        then: Then,
    },
    /// Describe what is in flight (for the watchdog).
    Report(Sender<String>),
    Shutdown,
}

/// The other threads' side of the manager.
#[derive(Clone)]
pub(crate) struct GpuHandle {
    tx: Sender<GpuCmd>,
    pub(crate) release: Sender<(usize, Block)>,
}

impl GpuHandle {
    pub(crate) fn post(&self, cmd: GpuCmd) -> Result<(), DeviceError> {
        self.tx
            .send(cmd)
            .map_err(|_| DeviceError::Body("the GPU manager thread has ended".into()))
    }
}

/// The GPU manager's tuning, from the runtime's configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Options {
    /// Tasks admitted per exec stream of a device (past the priority queue: allocated, staged,
    /// launched) — enough to keep a stream busy across the manager's reaction time, few enough
    /// that a critical-path task that becomes ready is not stuck behind a deep queue of launched
    /// kernels (`FERRY_DEVICE_QUEUE_DEPTH`).
    pub(crate) depth: usize,
    /// The longest nap between event polls while work is in flight, µs: the latency with which
    /// a finished kernel or copy is noticed once the thread has been idle a while
    /// (`FERRY_GPU_POLL_US`).
    pub(crate) poll_us: u64,
    /// Fraction of each pool kept clean by early write-backs (`FERRY_DEVICE_LOW_WATER`).
    pub(crate) low_water: f64,
    /// Stage tiles in from other devices over peer links (`FERRY_PEER_COPY`; off only to
    /// measure what they save).
    pub(crate) peer_copies: bool,
    /// Time the thread by phase (`FERRY_GPU_PHASES`, see `phases`).
    pub(crate) phases: bool,
    /// A task launched ahead follows its predecessor onto its exec stream
    /// (`FERRY_STREAM_AFFINITY`, see `Manager::follows`).
    pub(crate) stream_affinity: bool,
}

/// Starts the manager thread over `backend`; returns its handle, its thread, and a description
/// of each device.
/// `opts`: the thread's tuning ([`Options`]).
pub(crate) fn start<B: Backend>(
    backend: B,
    counters: Arc<Counters>,
    opts: Options,
) -> std::io::Result<(GpuHandle, JoinHandle<()>, Vec<String>)> {
    let (tx, rx) = channel::unbounded();
    let (rel_tx, rel_rx) = channel::unbounded();
    let names = (0..backend.devices()).map(|d| backend.describe(d)).collect();
    let labels: Vec<String> = (0..backend.devices()).map(|d| backend.label(d)).collect();
    let join = std::thread::Builder::new().name("ferry-gpu".into()).spawn(move || {
        crate::runtime::affinity::note_thread(crate::runtime::affinity::Role::Gpu);
        crate::runtime::naps::precise();
        let mut m = Manager::new(backend, rx, rel_rx, counters);
        m.timeline = timeline::Timeline::start(&mut m.b, &labels);
        m.depth = opts.depth.max(1);
        m.max_nap = Duration::from_micros(opts.poll_us.max(1));
        m.low_water = opts.low_water;
        m.peer_copies = opts.peer_copies;
        m.stream_affinity = opts.stream_affinity;
        m.watch = Stopwatch::new(opts.phases);
        m.run();
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
    paths: Vec<Path>,
    /// Its start event, task and bytes, when the GPU timeline is on.
    timed: Option<(E, u64, u64)>,
}

/// What `stage_and_exec` enqueued.
struct Launched<E> {
    exec: Arc<E>,
    staged: Option<Arc<E>>,
    keep: Vec<Arc<TileBuf>>,
    staging: Vec<Path>,
    sources: Vec<(Arc<TileCopy>, usize)>,
    /// Index of the (device, exec stream) queue.
    queue: usize,
    /// Start events of the stage-in (with its bytes) and of the kernel (GPU timeline).
    stage_timed: Option<(E, u64)>,
    timed: Option<E>,
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
    counters: Arc<Counters>,
    clock: ActiveClock,
    pools: Vec<Pool>,
    /// Least recently used first. A copy is pushed again at every use with a new stamp; entries
    /// whose stamp is not the copy's current one are stale and skipped (touch in O(1)).
    lru: Vec<VecDeque<(Weak<TileCopy>, u64)>>,
    next_stamp: u64,
    load: Vec<usize>,
    /// Per device: tasks chosen for it, not yet admitted, by priority.
    ready: Vec<std::collections::BinaryHeap<Queued>>,
    /// Per device: tasks admitted (waiting for memory, staging or running).
    admitted: Vec<usize>,
    /// Admitted tasks allowed per exec stream.
    depth: usize,
    /// Moving average of a task's service time on each device, seconds.
    service_s: Vec<f64>,
    /// When the last task of each (device, exec stream) queue finished.
    last_done: Vec<Option<Instant>>,
    next_exec: Vec<usize>,
    rotate: usize,
    /// Tasks waiting for memory, with their device and since when.
    waiting: VecDeque<(usize, GpuTask, Instant)>,
    /// Fraction of each pool kept clean ahead of need (`FERRY_DEVICE_LOW_WATER`).
    low_water: f64,
    /// A task launched ahead follows its predecessor onto its stream (`FERRY_STREAM_AFFINITY`).
    stream_affinity: bool,
    /// Stage tiles in from another device over a peer link (`FERRY_PEER_COPY`).
    peer_copies: bool,
    /// Tasks in flight, one FIFO per (device, exec stream): events on a stream complete in
    /// order, so only each queue's front is polled.
    running: Vec<VecDeque<Running<B::Event>>>,
    in_flight: usize,
    /// Stage-in events per device (its input stream, so also in order), with the paths whose
    /// active clock they hold.
    stages: Vec<VecDeque<Stage<B::Event>>>,
    to_host: Vec<ToHostOp<B::Event>>,
    writebacks: Vec<WriteBack<B::Event>>,
    /// Tiles being staged into a device, and the event that ends it; with launch-ahead, also
    /// the tiles a launched task is writing there, and its exec event.
    arriving: FxHashMap<(usize, usize), Arc<B::Event>>,
    /// Launch-ahead: the exec events of launched tasks not yet finalized, by sequence number
    /// (the tasks released early after them wait for these); comm-in ahead: the events of
    /// comm-in copies not yet completed, by their key.
    launched: FxHashMap<u64, Arc<B::Event>>,
    /// Copies for transfers between ranks, in issue order.
    copies: VecDeque<transfer::CopyInFlight<B::Event>>,
    /// Independent copies not yet enqueued, batched at the end of the pass (`flush_copies`).
    pending_copies: Vec<(CopyOp, Then)>,
    /// Longest nap between polls while work is in flight.
    max_nap: Duration,
    /// Times every operation on its stream, while a trace is written.
    timeline: Option<timeline::Timeline<B::Event>>,
    /// Charges the thread's time to what it is doing (`ManagerPhases` in the statistics).
    watch: Stopwatch,
    /// Per device and exec stream, the last value written to its signal word (see
    /// [`LaunchSite::signal`]): values rise in stream order, so a peer waiting for "at least v"
    /// waits for exactly the tasks up to the one that signalled v.
    signals: Vec<Vec<u64>>,
    /// The backend refused a signal once: no more are tried.
    no_signals: bool,
    /// Part writers that could not go where their group's members in flight are (see
    /// `parts`), until those are finalized.
    part_deferred: Vec<GpuTask>,
    stop: bool,
}

fn key(copy: &Arc<TileCopy>, d: usize) -> (usize, usize) {
    (Arc::as_ptr(copy) as usize, d)
}

impl<B: Backend> Manager<B> {
    fn new(b: B, rx: Receiver<GpuCmd>, released: Receiver<(usize, Block)>, counters: Arc<Counters>) -> Self {
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
            pools,
            lru: (0..n).map(|_| VecDeque::new()).collect(),
            next_stamp: 0,
            load: vec![0; n],
            ready: (0..n).map(|_| std::collections::BinaryHeap::new()).collect(),
            admitted: vec![0; n],
            depth: 2,
            service_s: vec![INITIAL_SERVICE_S; n],
            last_done: vec![None; queues],
            next_exec: vec![0; n],
            rotate: 0,
            waiting: VecDeque::new(),
            low_water: 0.0,
            peer_copies: true,
            stream_affinity: true,
            running: (0..queues).map(|_| VecDeque::new()).collect(),
            in_flight: 0,
            stages: (0..n).map(|_| VecDeque::new()).collect(),
            to_host: Vec::new(),
            writebacks: Vec::new(),
            arriving: FxHashMap::default(),
            launched: FxHashMap::default(),
            copies: VecDeque::new(),
            pending_copies: Vec::new(),
            max_nap: Duration::from_micros(100),
            timeline: None,
            watch: Stopwatch::new(false),
            signals: vec![vec![0; b_exec]; n],
            no_signals: false,
            part_deferred: Vec::new(),
            stop: false,
        }
    }

    fn busy(&self) -> bool {
        self.in_flight > 0
            || !self.to_host.is_empty()
            || !self.writebacks.is_empty()
            || !self.copies.is_empty()
            || !self.pending_copies.is_empty()
            || !self.waiting.is_empty()
            || !self.part_deferred.is_empty()
            || self.ready.iter().any(|r| !r.is_empty())
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
                if self.pending_copies.is_empty() {
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
            // At shutdown, tasks still waiting for memory or deferred behind part writers are
            // abandoned (the run failed).
            if self.stop && self.in_flight == 0 && self.to_host.is_empty() && self.writebacks.is_empty() {
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
                crossbeam::select! {
                    recv(self.rx) -> m => match m {
                        Ok(cmd) => self.timed(Phase::Commands, |m| m.handle(cmd)),
                        Err(_) => self.stop = true,
                    },
                    recv(self.released) -> r => if let Ok((d, b)) = r { self.pools[d].free(b) },
                }
                continue;
            }
            if idle_polls < 64 {
                idle_polls += 1;
                std::hint::spin_loop();
                continue;
            }
            match self.rx.recv_timeout(nap) {
                Ok(cmd) => self.timed(Phase::Commands, |m| m.handle(cmd)),
                Err(channel::RecvTimeoutError::Timeout) => {
                    nap = (nap * 2).min(self.max_nap);
                    if !self.waiting.is_empty() && self.in_flight == 0 {
                        self.retry_waiting();
                    }
                }
                Err(channel::RecvTimeoutError::Disconnected) => self.stop = true,
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
        // a reservation (whose pull comes next), a landing, an unpin — enqueue nothing and take
        // well under a µs, so they do not end a batch, unless a task waits for memory (a freed
        // block then launches it).
        let cheap = matches!(
            &cmd,
            GpuCmd::Reserve { .. } | GpuCmd::Landed { .. } | GpuCmd::Unpin { .. }
        ) && self.waiting.is_empty();
        if !cheap && !matches!(&cmd, GpuCmd::Copy { op, .. } if Self::batchable(op)) {
            self.flush_copies();
        }
        match cmd {
            GpuCmd::Task(t) => self.place(t),
            GpuCmd::ToHost { copies, then } => self.start_to_host(copies, then),
            GpuCmd::Reserve { copy, then } => {
                let placed = self.reserve(&copy);
                then(placed)
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
        let forced = t.device.filter(|&d| d < self.pools.len());
        let d = match (Self::part_binding(&t), forced) {
            (parts::Binding::Conflict, _) => return self.part_deferred.push(t),
            (parts::Binding::Bound(e), Some(d)) if d != e => return self.part_deferred.push(t),
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
        self.load[d] += 1;
        self.ready[d].push(Queued(t));
    }

    fn report(&self) -> String {
        let mut s = String::new();
        for d in 0..self.pools.len() {
            s += &format!(
                "  device {d}: {} ready, {} admitted ({} waiting for memory), pool {}/{} bytes used\n",
                self.ready[d].len(),
                self.admitted[d],
                self.waiting.iter().filter(|(x, ..)| *x == d).count(),
                self.pools[d].used(),
                self.pools[d].capacity()
            );
        }
        s += &format!(
            "  {} stage-outs, {} write-backs and {} transfer copies in flight; {} part writers deferred\n",
            self.to_host.len(),
            self.writebacks.len(),
            self.copies.len(),
            self.part_deferred.len()
        );
        s
    }

    fn drain_released(&mut self) -> bool {
        let mut any = false;
        while let Ok((d, b)) = self.released.try_recv() {
            self.pools[d].free(b);
            any = true;
        }
        if any {
            self.retry_waiting();
        }
        any
    }

    fn admit(&mut self, d: usize, t: GpuTask) {
        let span = tracing::info_span!("gpu.alloc", class = t.class.name(), seq = t.seq, device = d);
        let allocated = span.in_scope(|| self.try_alloc(d, &t));
        match allocated {
            Ok(true) => self.launch(d, t),
            Ok(false) => {
                self.counters.device(d).alloc_waits.fetch_add(1, Relaxed);
                self.waiting.push_back((d, t, Instant::now()));
            }
            Err(e) => self.finish_early(d, t, e),
        }
    }

    fn finish_early(&mut self, d: usize, t: GpuTask, e: DeviceError) {
        self.load[d] -= 1;
        self.admitted[d] -= 1;
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
            for d in 0..self.ready.len() {
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
        if self.admitted[d] >= self.depth * self.b.exec_streams().max(1) {
            return false;
        }
        let Some(Queued(t)) = self.ready[d].pop() else {
            return false;
        };
        self.admitted[d] += 1;
        self.admit(d, t);
        true
    }

    fn retry_waiting(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        let prev = self.watch.switch(Phase::Launch);
        let waiting = std::mem::take(&mut self.waiting);
        for (d, t, since) in waiting {
            match self.try_alloc(d, &t) {
                Ok(true) => {
                    self.counters
                        .device(d)
                        .alloc_wait_ns
                        .fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
                    self.launch(d, t)
                }
                Ok(false) => self.waiting.push_back((d, t, since)),
                Err(e) => self.finish_early(d, t, e),
            }
        }
        self.watch.switch(prev);
    }

    /// Stage-in, then exec.
    fn launch(&mut self, d: usize, mut t: GpuTask) {
        match self.stage_and_exec(d, &t) {
            Ok(l) => {
                // Launch-ahead: what the successors it releases early must find (below).
                let ahead = t.launched.take().map(|f| {
                    let writes: Vec<(usize, usize)> = t
                        .tiles
                        .iter()
                        .filter(|x| x.mode.writes())
                        .map(|x| key(&x.copy, d))
                        .collect();
                    (f, writes, t.seq, l.exec.clone())
                });
                let stream = l.queue % self.b.exec_streams().max(1);
                if let (Some(ev), false) = (&l.staged, l.staging.is_empty()) {
                    for &p in &l.staging {
                        self.clock.start(p);
                    }
                    self.stages[d].push_back(Stage {
                        event: ev.clone(),
                        paths: l.staging,
                        timed: l.stage_timed.map(|(e, bytes)| (e, t.seq, bytes)),
                    });
                }
                self.in_flight += 1;
                self.running[l.queue].push_back(Running {
                    task: t,
                    dev: d,
                    exec: l.exec,
                    queue: l.queue,
                    launched: Instant::now(),
                    staged: l.staged,
                    _keep: l.keep,
                    sources: l.sources,
                    timed: l.timed,
                });
                // Launch-ahead: the successors released early (posted to this thread, so they
                // are handled after what follows) find this task's outputs arriving — their
                // stage-in waits for it instead of copying the old data — and its event, which
                // their stream waits for. (The coherence checker also needs to know which
                // blocks a launched task is writing, early successors or not: see `finalize`.)
                if let Some((f, writes, seq, exec)) = ahead {
                    let released = {
                        let mut make = || self.signal_after(d, stream);
                        let mut site = LaunchSite {
                            device: d,
                            make: &mut make,
                            made: None,
                        };
                        f(&mut site)
                    };
                    if released || crate::config::check_coherence() {
                        for k in writes {
                            self.arriving.insert(k, exec.clone());
                        }
                        self.launched.insert(seq, exec);
                    }
                }
            }
            Err(e) => {
                for x in &t.tiles {
                    x.copy.lock().dev[d].pins -= 1;
                }
                self.finish_early(d, t, e);
            }
        }
    }

    /// Writes the next value of the signal word of exec stream `k` of `d` after the work on
    /// that stream (the task just launched there).
    fn signal_after(&mut self, d: usize, k: usize) -> Option<Signal> {
        if self.no_signals || k >= super::SIGNAL_SLOTS {
            return None;
        }
        let value = self.signals[d][k] + 1;
        match self.b.signal(d, Stream::Exec(k), k, value) {
            Ok(()) => {
                self.signals[d][k] = value;
                Some(Signal { dev: d, slot: k, value })
            }
            Err(e) => {
                tracing::warn!(device = d, error = %e, "no signals after launches: sends wait for their producer's completion");
                self.no_signals = true;
                None
            }
        }
    }

    fn stage_and_exec(&mut self, d: usize, t: &GpuTask) -> Result<Launched<B::Event>, DeviceError> {
        let stage_span = tracing::info_span!("gpu.stage_in", class = t.class.name(), seq = t.seq, device = d).entered();
        let mut staging = Vec::new();
        let mut sources = Vec::new();
        let mut waits: Vec<Arc<B::Event>> = Vec::new();
        let mut keep = Vec::new();
        let mut copied: Vec<usize> = Vec::new();
        // GPU timeline: the stage-in's start (before its first copy) and its bytes.
        let mut stage_timed: Option<(B::Event, u64)> = None;
        for (k, x) in t.tiles.iter().enumerate() {
            if !x.mode.reads() {
                continue;
            }
            let s = x.copy.lock();
            if s.dev[d].valid {
                continue;
            }
            if let Some(ev) = self.arriving.get(&key(&x.copy, d)) {
                waits.push(ev.clone());
                continue;
            }
            let dst = s.dev[d].block.expect("allocated").offset;
            let bytes = x.copy.bytes();
            let peer = if self.peer_copies { self.best_peer(&s, d) } else { None };
            let pending = if peer.is_none() && self.peer_copies {
                self.arriving_elsewhere(&x.copy, d)
            } else {
                None
            };
            if let Some((e, ev)) = pending {
                // Another device is staging this very data in: wait for it there and copy it
                // over the peer link, rather than a second host→device copy.
                let mut s = s;
                let src = s.dev[e].block.expect("a tile being staged in has a block").offset;
                s.dev[e].pins += 1;
                drop(s);
                sources.push((x.copy.clone(), e));
                self.b.wait(d, Stream::In, &ev)?;
                self.begin_stage(d, &mut stage_timed, bytes);
                // SAFETY: as for a peer copy below; the stream waits for the source's stage-in.
                unsafe { self.b.peer_pending(d, Stream::In, dst, e, src, bytes)? };
                self.count_peer(e, d, bytes);
                staging.push(Path::DevicePeer);
            } else if let Some(e) = peer {
                let src = s.dev[e].block.expect("valid copies have a block").offset;
                let mut s = s;
                s.dev[e].pins += 1;
                drop(s);
                sources.push((x.copy.clone(), e));
                self.begin_stage(d, &mut stage_timed, bytes);
                // SAFETY: both blocks are allocated and the source is valid (not written while a
                // reader runs); the copies stay alive while the task runs.
                unsafe { self.b.peer(d, Stream::In, dst, e, src, bytes)? };
                self.count_peer(e, d, bytes);
                staging.push(Path::DevicePeer);
            } else if s.host_valid {
                self.count_duplicate(&x.copy, &s, d);
                let mut s = s;
                let host = s.host_buf(bytes);
                drop(s);
                self.begin_stage(d, &mut stage_timed, bytes);
                // SAFETY: `keep` holds the host buffer until the task ends.
                unsafe { self.b.h2d(d, Stream::In, dst, host.as_ptr(), bytes)? };
                keep.push(host);
                self.count(Path::HostToDevice, bytes);
                staging.push(Path::HostToDevice);
            } else {
                // Valid only on a device without a peer link to `d` (or peer copies are off):
                // through the host.
                self.count_duplicate(&x.copy, &s, d);
                let e = (0..s.dev.len())
                    .find(|&e| s.dev[e].valid)
                    .ok_or_else(|| DeviceError::Body("tile has no valid copy".into()))?;
                let src = s.dev[e].block.expect("valid copies have a block").offset;
                let mut s = s;
                s.dev[e].pins += 1;
                drop(s);
                sources.push((x.copy.clone(), e));
                let host = x.copy.lock().host_buf(bytes);
                // SAFETY: as above; the In stream of `d` waits for the D2H event.
                unsafe { self.b.d2h(e, Stream::Out, host.as_ptr(), src, bytes)? };
                let ev = self.b.record(e, Stream::Out)?;
                self.b.wait(d, Stream::In, &ev)?;
                self.begin_stage(d, &mut stage_timed, bytes);
                // SAFETY: as above.
                unsafe { self.b.h2d(d, Stream::In, dst, host.as_ptr(), bytes)? };
                keep.push(host);
                self.count(Path::DeviceToHost, bytes);
                self.count(Path::HostToDevice, bytes);
                // Both legs are in flight until the stage-in event: both paths' clocks run.
                staging.push(Path::DeviceToHost);
                staging.push(Path::HostToDevice);
            }
            copied.push(k);
        }
        let staged = if copied.is_empty() {
            None
        } else {
            let ev = Arc::new(self.b.record(d, Stream::In)?);
            for &k in &copied {
                self.arriving.insert(key(&t.tiles[k].copy, d), ev.clone());
            }
            waits.push(ev.clone());
            Some(ev)
        };
        drop(stage_span);
        let _exec_span = tracing::info_span!("gpu.exec", class = t.class.name(), seq = t.seq, device = d).entered();
        let e = self.b.exec_streams().max(1);
        // Exec stream 0 is the device's high-priority stream, kept for critical-path tasks
        // (priority ≥ CRITICAL_PRIORITY); the others take the rest round-robin.
        let critical = t.priority >= CRITICAL_PRIORITY;
        let follows = self.follows(d, t, critical);
        let k = if e == 1 || critical {
            0
        } else if let Some((k, _)) = follows {
            k
        } else {
            self.next_exec[d] += 1;
            1 + self.next_exec[d] % (e - 1)
        };
        let s = Stream::Exec(k);
        // The event of the task it follows needs no wait (it also comes through `waits` when
        // this task reads a tile that one is writing: `arriving`).
        let followed = follows.and_then(|(_, seq)| self.launched.get(&seq).cloned());
        // Launch-ahead: also after the tasks that released this one early, those still running
        // (the one it follows on its stream is before it in stream order). One wait per event:
        // a comm-in consumer finds its copy's event both arriving and among those it follows.
        for q in &t.after {
            if follows.is_some_and(|(_, seq)| seq == *q) {
                continue;
            }
            if let Some(ev) = self.launched.get(q) {
                waits.push(ev.clone());
            }
        }
        for (k, ev) in waits.iter().enumerate() {
            let seen = waits[..k].iter().any(|w| Arc::ptr_eq(w, ev));
            if seen || followed.as_ref().is_some_and(|f| Arc::ptr_eq(f, ev)) {
                continue;
            }
            self.b.wait(d, s, ev)?;
        }
        let tiles = t
            .tiles
            .iter()
            .map(|x| {
                let off = x.copy.lock().dev[d].block.expect("allocated").offset;
                x.view(self.b.addr(d, off) as *mut u8)
            })
            .collect();
        let launch = Launch {
            class: t.class.clone(),
            tiles,
            args: t.args.to_vec(),
            seq: t.seq,
            rank: t.rank,
            device: d,
        };
        let timed = self.begin_op(d, s);
        self.b.launch(s, launch)?;
        let exec = Arc::new(self.b.record(d, s)?);
        if follows.is_some() {
            self.counters.device(d).followed.fetch_add(1, Relaxed);
        }
        Ok(Launched {
            exec,
            staged,
            keep,
            staging,
            sources,
            queue: d * e + k,
            stage_timed,
            timed,
        })
    }

    /// Stream affinity under launch-ahead: the exec stream of `d` (and the sequence number of
    /// the task there) whose newest task is one that `t` follows (a predecessor that released
    /// it early and is still running), if that stream is of `t`'s class (the high-priority
    /// stream 0 for a critical task, another for the rest) and the affinity is on
    /// (`FERRY_STREAM_AFFINITY`). On that stream, stream order replaces the wait for the
    /// predecessor's event — a dependency between streams costs the GPU a few µs between the
    /// two kernels (the 2-rank stencil's timeline on H200: 3.7–4.1 µs from a kernel's end to its
    /// successor's start on another stream) — and `t` queues behind nothing it does not wait for
    /// anyway.
    fn follows(&self, d: usize, t: &GpuTask, critical: bool) -> Option<(usize, u64)> {
        let e = self.b.exec_streams().max(1);
        if e == 1 || t.after.is_empty() || !self.stream_affinity {
            return None;
        }
        let class = if critical { 0..1 } else { 1..e };
        class.into_iter().find_map(|k| {
            let seq = self.running[d * e + k].back()?.task.seq;
            t.after.contains(&seq).then_some((k, seq))
        })
    }

    /// GPU timeline: the start event of an operation about to be enqueued on stream `s` of `d`
    /// (`None` when the timeline is off).
    fn begin_op(&mut self, d: usize, s: Stream) -> Option<B::Event> {
        self.timeline.as_mut()?.begin(&mut self.b, d, s)
    }

    /// GPU timeline: the stage-in of a task starts before its first copy; counts its bytes.
    fn begin_stage(&mut self, d: usize, timed: &mut Option<(B::Event, u64)>, bytes: usize) {
        match timed {
            Some((_, total)) => *total += bytes as u64,
            None => *timed = self.begin_op(d, Stream::In).map(|e| (e, bytes as u64)),
        }
    }

    /// GPU timeline: reports an operation that `begin_op` started and whose completion event
    /// `end` has completed.
    fn end_op(&mut self, d: usize, s: Stream, start: Option<B::Event>, end: &B::Event, info: timeline::OpInfo<'_>) {
        if let (Some(tl), Some(start)) = (self.timeline.as_mut(), start) {
            tl.end(&mut self.b, d, s, start, end, info);
        }
    }

    /// The device to copy a tile valid on several devices from, into `d`: the best link
    /// (the backend's rank: NVLink before PCIe), then the least loaded source — never plain
    /// index order, which sends every copy through device 0.
    fn best_peer(&self, s: &crate::data::copy::CopyState, d: usize) -> Option<usize> {
        (0..s.dev.len())
            .filter(|&e| e != d && s.dev[e].valid && s.dev[e].block.is_some())
            .filter_map(|e| self.b.link_rank(e, d).map(|r| (r, self.load[e], e)))
            .min()
            .map(|(_, _, e)| e)
    }

    /// A device with a peer link to `d` that is staging `copy` in now, and the event that ends it.
    fn arriving_elsewhere(&self, copy: &Arc<TileCopy>, d: usize) -> Option<(usize, Arc<B::Event>)> {
        (0..self.pools.len())
            .filter(|&e| e != d)
            .filter_map(|e| Some((self.b.link_rank(e, d)?, e)))
            .filter_map(|(r, e)| self.arriving.get(&key(copy, e)).map(|ev| (r, e, ev.clone())))
            .min_by_key(|(r, e, _)| (*r, *e))
            .map(|(_, e, ev)| (e, ev))
    }

    /// Counts a host→device stage-in of data that a linked device holds or is staging in: what
    /// a peer copy would have saved (peer copies off, or a race with eviction).
    fn count_duplicate(&self, copy: &Arc<TileCopy>, s: &crate::data::copy::CopyState, d: usize) {
        let linked = (0..s.dev.len())
            .any(|e| e != d && self.b.peer_link(e, d) && (s.dev[e].valid || self.arriving.contains_key(&key(copy, e))));
        if linked {
            self.counters.device(d).host_duplicates.fetch_add(1, Relaxed);
        }
    }

    fn count_peer(&mut self, from: usize, to: usize, bytes: usize) {
        self.count(Path::DevicePeer, bytes);
        if let Some(c) = self.counters.device(to).peer_from.get(from) {
            c.fetch_add(bytes as u64, Relaxed);
        }
    }

    fn count(&mut self, p: Path, bytes: usize) {
        let c = self.counters.path(p);
        c.bytes_sent.fetch_add(bytes as u64, Relaxed);
        c.sends.fetch_add(1, Relaxed);
    }

    /// Checks every event in flight; returns whether anything finished.
    fn poll(&mut self) -> bool {
        let mut any = false;
        // Finished stage-ins (for the per-path active time).
        for d in 0..self.stages.len() {
            while let Some(st) = self.stages[d].front() {
                if !self.b.done(&st.event).unwrap_or(true) {
                    break;
                }
                let st = self.stages[d].pop_front().expect("front exists");
                for p in st.paths {
                    self.clock.stop(p, &self.counters);
                }
                if let Some((start, seq, bytes)) = st.timed {
                    let info = timeline::OpInfo {
                        op: "stage-in",
                        seq,
                        bytes,
                    };
                    self.end_op(d, Stream::In, Some(start), &st.event, info);
                }
            }
        }
        // Transfer copies before tasks: a landed pull releases its consumers, which are on the
        // critical path; finalizing tasks (µs each) can wait that long.
        if !self.copies.is_empty() {
            any |= self.poll_copies();
        }
        // Finished tasks: only each stream's oldest task can be next.
        for q in 0..self.running.len() {
            // A query that finds its event complete is the expensive one (1.4 µs on H200,
            // against 0.25 µs for a record): when a stream holds several tasks, ask the newest
            // first — if it is done, so is every task before it on the stream, and none of them
            // needs a query of its own. (When the manager falls behind, several tasks of a
            // stream finish between two passes: the saving comes when it is needed.)
            // Only the tasks there now: finalizing one may launch more onto this stream.
            let queued = self.running[q].len();
            let mut settled = if queued > 1
                && self.running[q]
                    .back()
                    .is_some_and(|newest| matches!(self.b.done(&newest.exec), Ok(true)))
            {
                queued
            } else {
                0
            };
            while let Some(front) = self.running[q].front() {
                // A task released early is finalized after the tasks it follows (they finished
                // first on the device, but this pass may look at this queue before theirs):
                // finalizing in the other order would leave an older version current.
                if front.task.after.iter().any(|q| self.launched.contains_key(q)) {
                    break;
                }
                let done = if settled > 0 {
                    settled -= 1;
                    Ok(true)
                } else {
                    self.b.done(&front.exec)
                };
                let result = match done {
                    Ok(false) => break,
                    Ok(true) => {
                        let (d, seq) = (front.dev, front.task.seq);
                        self.b
                            .take_launch_error(d, seq)
                            .map_or(Ok(()), |m| Err(DeviceError::Body(m)))
                    }
                    Err(e) => Err(e),
                };
                let r = self.running[q].pop_front().expect("front exists");
                self.in_flight -= 1;
                self.timed(Phase::Finalize, |m| m.finalize(r, result));
                any = true;
            }
        }
        any |= self.poll_stage_outs();
        let (done, freed) = self.poll_writebacks();
        any |= done;
        if freed || (any && !self.waiting.is_empty()) {
            self.retry_waiting();
        }
        any
    }

    fn finalize(&mut self, r: Running<B::Event>, result: Result<(), DeviceError>) {
        let d = r.dev;
        let _span = tracing::info_span!(
            "gpu.finalize",
            class = r.task.class.name(),
            seq = r.task.seq,
            device = d
        )
        .entered();
        let Running {
            task,
            queue,
            launched,
            staged,
            sources,
            exec,
            timed,
            ..
        } = r;
        if timed.is_some() {
            let streams = self.b.exec_streams().max(1);
            let info = timeline::OpInfo {
                op: task.class.name(),
                seq: task.seq,
                bytes: 0,
            };
            self.end_op(d, Stream::Exec(queue % streams), timed, &exec, info);
        }
        // Service time: from when the task could start on its stream (launched, or the previous
        // task of the stream finished) to now; an exponential moving average per device.
        let now = Instant::now();
        let start = self.last_done[queue].map_or(launched, |t| t.max(launched));
        self.last_done[queue] = Some(now);
        // A sample is capped at 4× the estimate: a one-off stall (a library's first call, an
        // NVRTC compile of hundreds of ms on a stream's first task) would otherwise inflate the
        // estimate for many tasks, and placement would move whole tiles to the other device —
        // which then stay there (the 2-GPU stencil ended up split 22k/3k tasks). A real change
        // of task size still gets through within a few tasks.
        let sample = (now - start)
            .as_secs_f64()
            .min(4.0 * self.service_s[d].max(INITIAL_SERVICE_S));
        self.service_s[d] = 0.9 * self.service_s[d] + 0.1 * sample;
        for (c, e) in &sources {
            c.lock().dev[*e].pins -= 1;
        }
        if self.launched.remove(&task.seq).is_some() {
            // Its outputs are valid (below) rather than arriving.
            for x in task.tiles.iter().filter(|x| x.mode.writes()) {
                let k = key(&x.copy, d);
                if self.arriving.get(&k).is_some_and(|e| Arc::ptr_eq(e, &exec)) {
                    self.arriving.remove(&k);
                }
            }
        }
        let debug = crate::config::check_coherence();
        for x in &task.tiles {
            // Launch-ahead: a task launched after this one may already be writing the block
            // (the next writer of a tile this task read): its bytes are not what this task saw,
            // so the coherence check leaves the block alone until that writer is finalized.
            let overwritten = debug
                && self
                    .arriving
                    .get(&key(&x.copy, d))
                    .is_some_and(|e| !Arc::ptr_eq(e, &exec) && staged.as_ref().is_none_or(|st| !Arc::ptr_eq(e, st)));
            let mut s = x.copy.lock();
            if result.is_ok() {
                let h = s.dev[d]
                    .block
                    .filter(|_| debug && !overwritten)
                    .and_then(|b| self.b.debug_hash(d, b.offset, x.copy.bytes()));
                if x.mode.writes() {
                    s.produced_at(Location::Device(d));
                    if debug && !overwritten {
                        s.debug_hash = h;
                    }
                } else {
                    if debug && !overwritten && s.debug_hash.is_some() && h != s.debug_hash {
                        tracing::error!("coherence: task seq {} read tile {:?} on device {d}: device data differs from the current version (valid before: {})", task.seq, x.coords, s.dev[d].valid);
                    }
                    s.dev[d].valid = true;
                }
            }
            s.dev[d].pins -= 1;
            s.used(task.seq);
            drop(s);
            if let Some(ev) = &staged {
                let k = key(&x.copy, d);
                if self.arriving.get(&k).is_some_and(|e| Arc::ptr_eq(e, ev)) {
                    self.arriving.remove(&k);
                }
            }
            self.next_stamp += 1;
            x.copy.lock().dev[d].lru_stamp = self.next_stamp;
            self.lru[d].push_back((Arc::downgrade(&x.copy), self.next_stamp));
        }
        // Drop stale entries once they outnumber the live blocks: amortised O(1) per touch.
        if self.lru[d].len() > 2 * (self.pools[d].allocations() + 64) {
            self.lru[d].retain(|(w, stamp)| {
                w.upgrade().is_some_and(|c| {
                    let s = c.lock();
                    s.dev[d].lru_stamp == *stamp && s.dev[d].block.is_some()
                })
            });
        }
        self.load[d] -= 1;
        self.admitted[d] -= 1;
        self.unbind_parts(&task);
        self.counters.device(d).tasks.fetch_add(1, Relaxed);
        self.timed(Phase::Callbacks, |_| (task.done)(result));
        self.timed(Phase::Launch, |m| m.pump(d));
        self.clean_ahead(d);
    }
}
