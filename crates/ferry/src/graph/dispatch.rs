//! Where ready nodes go: CPU tasks to the workers, GPU tasks to the GPU manager, sends and
//! receives to the MPI thread; and how their completion flows back into the graph.
//!
//! A CPU task that reads a tile whose current data is only on a device first asks the GPU
//! manager to stage it out; only then is it dispatched. Sends and receives go to the transfer
//! layer, which picks the path.

use super::cpu_graph::{GraphRun, PartJob};
use super::node::{AckWaits, AfterSeqs, Early, EarlyDep, Node, Work};
use super::task::{run_body, TaskArgs, TaskClass, TileArg, TileArgs};
use super::tracker::Tracker;
use crate::sched::{Job, Spawner};
use crate::stats::Counters;
use ferry_base::error::{FerryError, Rank, Result};
use ferry_device::TileView;
use ferry_memory::data::buffer::TileBuf;
use ferry_memory::data::copy::{Location, TileCopy};
use ferry_memory::manager::{Ahead, DeviceAck, GpuCmd, GpuHandle, GpuTask, LaunchSite, OnLaunch, COMM_IN_KEYS};
use ferry_transfer::Transport;
use smallvec::SmallVec;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::Arc;
use std::time::Instant;

/// Shared by every thread that finishes nodes.
pub(crate) struct Dispatch {
    pub(crate) rank: Rank,
    /// Fault injection: the most a CPU task body is delayed, µs (0: off).
    pub(crate) sched_jitter_us: u64,
    pub(crate) spawner: Spawner<CpuJob>,
    pub(crate) transport: Arc<Transport>,
    pub(crate) gpu: Option<GpuHandle>,
    pub(crate) tracker: Arc<Tracker>,
    pub(crate) counters: Arc<Counters>,
    /// Release GPU successors of a GPU task when it is launched (`FERRY_LAUNCH_AHEAD`; see
    /// `graph::node`).
    pub(crate) launch_ahead: bool,
    /// Launch the GPU consumers of a tile received into device memory behind its comm-in copy
    /// (`FERRY_COMM_IN_AHEAD`; see [`Ahead`]).
    pub(crate) comm_in_ahead: bool,
    /// The next key of a comm-in copy (from [`COMM_IN_KEYS`] up).
    pub(crate) next_comm_in: AtomicU64,
    /// Send a GPU task's outputs over IPC when it is launched, ordered after it on the
    /// consumer's device by a signal (`FERRY_OFFER_AT_LAUNCH`; see
    /// [`Transport::send_offered`]).
    pub(crate) offer_at_launch: bool,
    /// Give a write-only access a fresh copy when a send still reads the current one
    /// (`FERRY_RENAME_SENT`; see `Inserter::add_task`).
    pub(crate) rename_sent: bool,
    /// No device, no host tier, no coherence check: a host copy is then never evicted,
    /// replaced or made stale, so CPU tasks skip the residency bookkeeping (pins, writers,
    /// validity) and lock a tile's copy once, at dispatch, instead of twice. On fine-grained
    /// graphs each of those locks is a cache-line transfer between the workers that share
    /// the tile, on the critical path.
    pub(crate) host_only: bool,
    /// Devices of this rank (launch-ahead binds a successor to its predecessor's device).
    pub(crate) devices: usize,
}

impl Dispatch {
    /// Drops the insertion reference of a freshly built node, dispatching it if it is ready.
    pub(crate) fn release(self: &Arc<Self>, node: Arc<Node>) {
        if node.release() {
            self.dispatch(node);
        }
    }

    fn dispatch(self: &Arc<Self>, node: Arc<Node>) {
        let Some(work) = node.take_work() else { return };
        match work {
            Work::Task {
                class,
                tiles,
                args,
                seq,
                priority,
                ack_waits: _,
                small,
            } => {
                if let Some(tier) = self.transport.residency.tier() {
                    tier.note_dispatch(seq);
                }
                if class.has_gpu() && self.gpu.is_some() && !self.tracker.is_poisoned() {
                    // Only launch-ahead, comm-in ahead and device acknowledgements release nodes
                    // early (and take a lock to say so).
                    let early = if self.launch_ahead || self.comm_in_ahead || self.transport.device_acks() {
                        node.take_early()
                    } else {
                        None
                    };
                    self.to_gpu(node, class, tiles, args, seq, priority, early);
                } else {
                    // Inputs must be in host memory; outputs must not be the target of a
                    // device→host copy still in flight (an eviction's write-back). The host
                    // buffers stay pinned until the body has run (the host tier must not evict
                    // what was brought in for it).
                    //
                    // When every tile is current on the host, the buffers are taken under this
                    // same lock, so the worker that runs the body takes none: the releasing
                    // thread locked these copies last, and on fine tasks each lock another
                    // core takes is a cache-line transfer on the critical path. A host-only
                    // rank takes nothing here: the body reads each copy's fixed host buffer.
                    let mut stale: Vec<Arc<TileCopy>> = Vec::new();
                    let mut bufs = HostBufs::new();
                    for t in tiles.iter().filter(|_| !self.host_only) {
                        let mut c = t.copy.lock();
                        c.host_pins += 1;
                        if t.mode.writes() {
                            c.host_writers += 1;
                        }
                        if (t.mode.reads() && !c.host_valid) || (t.mode.writes() && c.writebacks_in_flight > 0) {
                            stale.push(t.copy.clone());
                        } else {
                            bufs.push(c.host_buf(t.copy.bytes()));
                        }
                    }
                    if !stale.is_empty() {
                        bufs.clear();
                    }
                    let job = ReadyTask {
                        node,
                        small,
                        class,
                        tiles,
                        args,
                        seq,
                        bufs,
                    };
                    if stale.is_empty() {
                        // The usual case, without the closure's clone of `self` (a count both
                        // workers write) and its moves of the job.
                        self.spawner.spawn(CpuJob::Task(job));
                    } else {
                        let d = self.clone();
                        self.after_host(stale, move || d.spawner.spawn(CpuJob::Task(job)));
                    }
                }
            }
            Work::Send { copy, peer, tag } => {
                let d = self.clone();
                let sent = Arc::as_ptr(&copy) as usize;
                // The node again for an early release: only when acknowledgements are asked
                // for (a clone per send is a shared count's round trip between threads).
                let want_ack = self.transport.device_acks() && self.acked_successors(&node, sent);
                let n = want_ack.then(|| node.clone());
                let ack = self
                    .transport
                    .send(copy, peer, tag, want_ack, Box::new(move |r| d.finish(&node, r)));
                if let (Some(a), Some(n)) = (ack, n) {
                    self.release_on_ack(&n, sent, a);
                }
            }
            Work::Recv {
                copy,
                peer,
                tag,
                to_device,
            } => {
                let ahead =
                    (to_device && self.comm_in_ahead && self.gpu.is_some()).then(|| self.consumers_of(&node, &copy));
                let d = self.clone();
                self.transport
                    .recv(copy, peer, tag, to_device, ahead, Box::new(move |r| d.finish(&node, r)));
            }
            Work::SendPacked { copies, peer, tag } => {
                let d = self.clone();
                self.transport
                    .send_packed(copies, peer, tag, Box::new(move |r| d.finish(&node, r)));
            }
            Work::RecvPacked { copies, peer, tag } => {
                let d = self.clone();
                self.transport
                    .recv_packed(copies, peer, tag, Box::new(move |r| d.finish(&node, r)));
            }
        }
    }

    /// comm-in ahead: how the GPU tasks that read `copy`, which the receive `node` fills, are
    /// released bound to the device of its comm-in copy once that copy is enqueued (the GPU
    /// manager orders them after the copy's event). Its other successors wait for the receive
    /// to finish, as do all of them when the data lands anywhere but in a device block.
    fn consumers_of(self: &Arc<Self>, node: &Arc<Node>, copy: &Arc<TileCopy>) -> Ahead {
        let key = self.next_comm_in.fetch_add(1, Relaxed);
        debug_assert!(key >= COMM_IN_KEYS);
        let d = self.clone();
        let n = node.clone();
        let target = Arc::as_ptr(copy) as usize;
        let reads = move |class: &TaskClass, tiles: &[TileArg]| {
            class.has_gpu()
                && tiles
                    .iter()
                    .any(|t| t.mode.reads() && !t.mode.writes() && Arc::as_ptr(&t.copy) as usize == target)
        };
        Ahead {
            key,
            copy: copy.clone(),
            release: Box::new(move |dev: usize| {
                let eligible = |x: &Node| !d.tracker.is_poisoned() && x.is_task_where(reads);
                let (ready, any) = n.launched(dev, key, eligible);
                for next in ready {
                    d.dispatch(next);
                }
                any
            }),
        }
    }

    /// Offers at launch: the sends of `written` (tiles the GPU task `node`, just launched on
    /// `dev`, writes) to peers on the IPC route start now, ordered after the task by its
    /// signal, instead of after its completion. Only sends that wait for nothing else, and only
    /// if the device can signal (else they wait as usual).
    fn offer_sends(self: &Arc<Self>, node: &Node, dev: usize, written: &[usize], site: &mut LaunchSite<'_>) {
        let t = &self.transport;
        let eligible = |x: &Node| {
            !self.tracker.is_poisoned()
                && x.is_send_where(|copy, peer| written.contains(&(Arc::as_ptr(copy) as usize)) && t.offerable(peer))
        };
        let mut signal = None;
        let sends = node.offered(eligible, || {
            signal = site.signal();
            signal.is_some()
        });
        let Some(signal) = signal.filter(|_| !sends.is_empty()) else {
            return;
        };
        self.counters
            .memory
            .device(dev)
            .offered_at_launch
            .fetch_add(sends.len() as u64, Relaxed);
        for s in sends {
            let Some(Work::Send { copy, peer, tag }) = s.take_work() else {
                unreachable!("only sends are offered")
            };
            let d = self.clone();
            let sent = Arc::as_ptr(&copy) as usize;
            let want_ack = self.transport.device_acks() && self.acked_successors(&s, sent);
            let n = want_ack.then(|| s.clone());
            let ack =
                self.transport
                    .send_offered(copy, peer, tag, signal, want_ack, Box::new(move |r| d.finish(&s, r)));
            if let (Some(a), Some(n)) = (ack, n) {
                self.release_on_ack(&n, sent, a);
            }
        }
    }

    /// Device acknowledgements: the send `node` of the copy `sent` (its address) asked its
    /// consumer to write `ack` after the pull, so the GPU tasks that overwrite that copy — the
    /// send's successors, as a rule — are released now, bound to the device of the sent block
    /// and waiting there for the word, rather than after the consumer's host acknowledgement.
    /// Only where that device is where they would run anyway (the copy is among their largest
    /// tiles, as for launch-ahead); other successors wait for the send to finish.
    fn release_on_ack(self: &Arc<Self>, node: &Node, sent: usize, ack: DeviceAck) {
        let eligible = |x: &Node| !self.tracker.is_poisoned() && self.overwrites_on_device(x, sent);
        let (ready, _) = node.release_early(ack.dev, EarlyDep::Acked(ack), eligible);
        for next in ready {
            self.dispatch(next);
        }
    }

    /// Whether the send `node` of copy `sent` has a successor that [`Dispatch::release_on_ack`]
    /// would release: only then is a device acknowledgement worth asking for (it costs the
    /// consumer a write, and sometimes a completion later: `Manager::enqueue_copies`). One
    /// inserted after the send left waits for its end.
    fn acked_successors(&self, node: &Node, sent: usize) -> bool {
        node.has_successor_where(|x| self.overwrites_on_device(x, sent))
    }

    /// Whether `x` is a GPU task that overwrites the copy at `sent`, where that copy is among
    /// its largest tiles (so the device of the sent block is where it would run anyway, as for
    /// launch-ahead) or the rank has one device, and that could wait for at least as many
    /// acknowledgements as `FERRY_DEVICE_ACK` asks for (`auto`: two, counted at its insertion —
    /// a task that waits for one does better waiting for the host acknowledgement, see
    /// [`crate::DeviceAcks`]).
    fn overwrites_on_device(&self, x: &Node, sent: usize) -> bool {
        x.is_task_awaiting(self.transport.ack_min_waits(), |class, tiles| {
            let largest = tiles.iter().map(|t| t.copy.bytes()).max().unwrap_or(0);
            class.has_gpu()
                && tiles.iter().any(|t| {
                    t.mode.writes()
                        && Arc::as_ptr(&t.copy) as usize == sent
                        && (self.devices <= 1 || t.copy.bytes() == largest)
                })
        })
    }

    /// Runs `then` once every copy in `stale` is valid in host memory (at once when none is).
    fn after_host(self: &Arc<Self>, stale: Vec<Arc<TileCopy>>, then: impl FnOnce() + Send + 'static) {
        if stale.is_empty() {
            return then();
        }
        let d = self.clone();
        self.transport.residency.to_host(
            stale,
            Box::new(move |r| match r {
                Ok(()) => then(),
                Err(e) => d.tracker.fail(e),
            }),
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn to_gpu(
        self: &Arc<Self>,
        node: Arc<Node>,
        class: TaskClass,
        tiles: TileArgs,
        args: TaskArgs,
        seq: u64,
        priority: i32,
        early: Option<Early>,
    ) {
        // With a host budget: the host copies of the inputs stay pinned until the task ends, and
        // inputs that only the disk holds come back first. The pins keep every input reachable
        // by the stage-in: a device copy is dropped only when the host (pinned, so kept) or
        // another device holds the data, and is otherwise written back to the host.
        let mut pinned: Vec<Arc<TileCopy>> = Vec::new();
        let mut from_disk: Vec<Arc<TileCopy>> = Vec::new();
        if self.transport.residency.tier().is_some() {
            for t in tiles.iter().filter(|t| t.mode.reads()) {
                let mut c = t.copy.lock();
                c.host_pins += 1;
                if ferry_memory::tier::disk_only(&c) {
                    from_disk.push(t.copy.clone());
                }
                drop(c);
                pinned.push(t.copy.clone());
            }
        }
        let d = self.clone();
        let n = node.clone();
        let rank = self.rank;
        let counted = class.clone();
        let t0 = Instant::now();
        // Launch-ahead: once this task is launched, the GPU tasks that continue the chain of
        // one of its tiles — they write a tile this task uses, so they run where that tile
        // lives anyway — may follow it on the device without waiting for it to finish. Other
        // successors (a fan-out of readers, which placement spreads over the devices; CPU
        // tasks; sends) wait for its end — except the IPC sends of its outputs, which are
        // offered at launch.
        let offers = self.offer_at_launch && self.transport.offers_possible() && tiles.iter().any(|t| t.mode.writes());
        let launched: Option<OnLaunch> = (self.launch_ahead || offers).then(|| {
            let d = self.clone();
            let n = node.clone();
            let ahead = self.launch_ahead;
            // Only what each use needs, inline for the usual few tiles.
            let mine: CopyIds = if ahead {
                tiles.iter().map(|t| Arc::as_ptr(&t.copy) as usize).collect()
            } else {
                CopyIds::new()
            };
            let written: CopyIds = if offers {
                tiles
                    .iter()
                    .filter(|t| t.mode.writes())
                    .map(|t| Arc::as_ptr(&t.copy) as usize)
                    .collect()
            } else {
                CopyIds::new()
            };
            Box::new(move |site: &mut LaunchSite<'_>| {
                let dev = site.device();
                if offers {
                    d.offer_sends(&n, dev, &written, site);
                }
                if !ahead {
                    return false;
                }
                let shared = |t: &TileArg| mine.contains(&(Arc::as_ptr(&t.copy) as usize));
                // With several devices, an early release binds the successor to this device:
                // only when its largest data is here too. A step's ring writes the small edge
                // tile that the neighbouring slab's ring (on the other device) read; bound to
                // that device, it pulled its whole slab across each step (1 rank × 2 H200:
                // 4× slower than without launch-ahead).
                let follows_its_data = |tiles: &[TileArg]| {
                    let largest = tiles.iter().map(|t| t.copy.bytes()).max().unwrap_or(0);
                    tiles.iter().any(|t| t.copy.bytes() == largest && shared(t))
                };
                let continues = |class: &TaskClass, tiles: &[TileArg]| {
                    class.has_gpu()
                        && tiles.iter().any(|t| t.mode.writes() && shared(t))
                        && (d.devices <= 1 || follows_its_data(tiles))
                };
                let eligible = |x: &Node| !d.tracker.is_poisoned() && x.is_task_where(continues);
                let (ready, any) = n.launched(dev, seq, eligible);
                for next in ready {
                    d.dispatch(next);
                }
                any
            }) as OnLaunch
        });
        let (device, after, acks) = early.map_or((None, AfterSeqs::new(), AckWaits::new()), |e| {
            (Some(e.device), e.after, e.acks)
        });
        let task = GpuTask {
            tiles,
            kernel: class.inner.clone(),
            args,
            seq,
            rank,
            priority,
            device,
            after,
            acks,
            launched,
            done: Box::new(move |r| {
                for c in &pinned {
                    c.lock().host_pins -= 1;
                }
                // GPU tasks count their time from dispatch to completion (queueing included).
                counted.record(t0.elapsed().as_nanos() as u64);
                let r = r.map_err(|e| FerryError::TaskFailed {
                    class: counted.name().to_string(),
                    seq,
                    rank,
                    msg: e.to_string(),
                });
                d.finish(&n, r)
            }),
        };
        let d = self.clone();
        let post = move || {
            let gpu = d.gpu.as_ref().expect("checked by the caller");
            if let Err(e) = gpu.post(GpuCmd::Task(task)) {
                d.finish(&node, Err(FerryError::Device(e)));
            }
        };
        if from_disk.is_empty() {
            return post();
        }
        let d = self.clone();
        self.transport.residency.to_host(
            from_disk,
            Box::new(move |r| match r {
                Ok(()) => post(),
                Err(e) => d.tracker.fail(e),
            }),
        );
    }

    /// Records the end of a node (successfully or not) and dispatches the successors it freed.
    pub(crate) fn finish(self: &Arc<Self>, node: &Node, result: Result<()>) {
        if let Err(e) = result {
            self.tracker.fail(e);
        }
        self.release_successors(node);
        self.retire();
    }

    /// The first half of [`Dispatch::finish`] for a node that succeeded: marks it finished
    /// and dispatches the successors it freed. [`Dispatch::retire`] must follow.
    fn release_successors(self: &Arc<Self>, node: &Node) {
        for next in node.complete() {
            self.dispatch(next);
        }
    }

    /// The second half of [`Dispatch::finish`]: counts the node as finished (waking `wait`
    /// when it was the last).
    fn retire(&self) {
        if self.tracker.done_one() {
            self.spawner.quiesce();
        }
    }
}

/// A CPU task whose inputs are all in host memory, queued for a worker.
///
/// The dispatcher is not in it: the worker holds that ([`Job::Context`]).
pub(crate) struct ReadyTask {
    node: Arc<Node>,
    /// Its tiles are at most [`SPENT_MAX_BYTES`].
    small: bool,
    class: TaskClass,
    tiles: TileArgs,
    args: TaskArgs,
    seq: u64,
    /// The tiles' host buffers, in `tiles` order, when taken at dispatch; empty when some
    /// input had to be staged to the host first (the body's worker takes them then).
    bufs: HostBufs,
}

/// Host buffers of a CPU task's tiles, kept alive for its body. Inline for up to 8 tiles: two
/// heap allocations per task, freed by another thread than the one that made them, were a
/// measurable part of an empty task's cost.
type HostBufs = SmallVec<[Arc<TileBuf>; 8]>;

/// Identities (addresses) of a task's tile copies, as a launch-ahead closure keeps them: inline
/// for the usual few tiles (the closure is made for every GPU task).
type CopyIds = SmallVec<[usize; 4]>;

/// What a finished CPU task of a host-only rank leaves to its worker to drop later
/// ([`Job::Spent`]): its references to the node, the class and the tile copies, whose counts
/// the inserting thread writes for every task.
///
/// Only for small tasks of host-only ranks. A superseded copy (a received or renamed version)
/// lives until its last reader's references go, so a worker that holds a batch holds up to
/// [`SPENT_BATCH`](crate::sched::SPENT_BATCH) tasks' tiles: at most [`SPENT_MAX_BYTES`] each,
/// so that a worker never keeps more than a couple of MiB alive this way — the batching pays
/// only for fine-grained tasks, whose tiles are small. A rank with devices drops a task's tiles
/// before the task counts as finished: a copy's drop gives its device blocks back to the GPU
/// manager.
pub(crate) struct SpentTask {
    _node: Arc<Node>,
    _class: TaskClass,
    _tiles: TileArgs,
}

/// Most tile bytes a task may have for its worker to drop its references later ([`SpentTask`]).
pub(crate) const SPENT_MAX_BYTES: u64 = 64 << 10;

/// What the CPU workers run: a ready task, or a part of a fused CPU replay
/// (`graph/cpu_graph.rs`).
pub(crate) enum CpuJob {
    Task(ReadyTask),
    Part(PartJob),
}

impl Job for CpuJob {
    type Context = Dispatch;
    type Spent = SpentTask;

    fn run(self, worker: usize, dispatch: &Arc<Dispatch>) -> Option<SpentTask> {
        match self {
            CpuJob::Task(t) => t.run(worker, dispatch),
            CpuJob::Part(p) => {
                p.run(worker, dispatch);
                None
            }
        }
    }
}

impl ReadyTask {
    fn run(self, worker: usize, dispatch: &Arc<Dispatch>) -> Option<SpentTask> {
        if let Some(graph) = self.class.inner.cpu_graph.clone() {
            if dispatch.host_only && !dispatch.tracker.is_poisoned() {
                let ReadyTask {
                    node,
                    class,
                    tiles,
                    args,
                    seq,
                    ..
                } = self;
                GraphRun::launch(graph, node, class, tiles, args, seq, worker, dispatch);
                return None;
            }
        }
        let ReadyTask {
            node,
            small,
            class,
            tiles,
            args,
            seq,
            bufs,
        } = self;
        let mut released = false;
        // After an error the run is over: drain the graph without running bodies.
        let (result, bufs) = if dispatch.tracker.is_poisoned() {
            for t in tiles.iter().filter(|_| !dispatch.host_only) {
                let mut c = t.copy.lock();
                c.host_pins -= 1;
                c.used(seq);
                if t.mode.writes() {
                    c.host_writers -= 1;
                }
            }
            (Ok(()), bufs)
        } else {
            let name = class.name();
            let span = tracing::info_span!("task", class = name, seq);
            let _g = span.enter();
            // A host-only rank's copies keep their host buffer (`TileCopy::fixed_host`); others
            // hold theirs for the body (taken at dispatch, or now after a stage to the host).
            let bufs = if dispatch.host_only || bufs.len() == tiles.len() {
                bufs
            } else {
                tiles.iter().map(|t| t.copy.lock().host_buf(t.copy.bytes())).collect()
            };
            // Filled in place: a collected `SmallVec` of eight views is a 700-byte move.
            let mut views: SmallVec<[TileView; 8]> = SmallVec::new();
            if dispatch.host_only {
                views.extend(tiles.iter().map(|t| t.view(t.copy.fixed_host().as_ptr())));
            } else {
                views.extend(tiles.iter().zip(&bufs).map(|(t, b)| t.view(b.as_ptr())));
            }
            if dispatch.sched_jitter_us > 0 {
                let mut j = ferry_base::faults::Jitter::new(seq ^ (worker as u64) << 40, dispatch.sched_jitter_us);
                std::thread::sleep(j.next_delay());
            }
            let t0 = Instant::now();
            let slot = dispatch.counters.slot(worker);
            if let Some(w) = slot {
                let since = t0.saturating_duration_since(dispatch.counters.start).as_nanos() as u64;
                w.current_class.store(class.inner.name_hash, Relaxed);
                w.current_start_ns.store(since, Relaxed);
                w.current_seq.store(seq, Release);
            }
            let out = run_body(&class, &views, &args, seq, dispatch.rank, worker);
            if let Some(w) = slot {
                w.current_seq.store(u64::MAX, Release);
            }
            // A host-only rank has nothing to update in the copies after a body: a task that
            // succeeded releases its successors at once, before the statistics (shared
            // counters) and the drop of its tiles (counts other workers' tasks hold too). On a
            // fine-grained graph that release is the critical path: the next step's tasks wait
            // for it. The clock is read before it: the successors' dispatch may run an MPI pass
            // on this thread (`CommHandle::post_now`), which is not the body's time.
            let ns = t0.elapsed().as_nanos() as u64;
            if dispatch.host_only && out.is_ok() {
                dispatch.release_successors(&node);
                released = true;
            }
            class.record(ns);
            if let Some(w) = dispatch.counters.slot(worker) {
                w.tasks.fetch_add(1, Relaxed);
                w.busy_ns.fetch_add(ns, Relaxed);
            }
            let debug = ferry_base::debug::check_coherence();
            for (t, b) in tiles.iter().zip(&bufs).filter(|_| !dispatch.host_only) {
                let mut c = t.copy.lock();
                if debug {
                    // SAFETY: debugging only; the body has finished.
                    let h = ferry_base::hash::bytes(unsafe { b.bytes() });
                    if t.mode.writes() {
                        c.debug_hash = Some(h);
                    } else if c.debug_hash.is_some_and(|x| x != h) {
                        tracing::error!(
                            "coherence: CPU task seq {seq} read tile {:?}: host data differs from the current version",
                            t.coords
                        );
                    }
                }
                if t.mode.writes() {
                    c.produced_at(Location::Host);
                    c.host_writers -= 1;
                }
                c.host_pins -= 1;
                c.used(seq);
            }
            let result = out.map_err(|msg| FerryError::TaskFailed {
                class: name.to_string(),
                seq,
                rank: dispatch.rank,
                msg,
            });
            (result, bufs)
        };
        // The buffers (none on a host-only rank, whose bodies read each copy's fixed host
        // buffer) and, but for a small task of a host-only rank (`SpentTask`), the tiles go
        // before the node counts as finished: a `wait` that returns finds the task's references
        // to its copies gone.
        drop(bufs);
        let kept = if dispatch.host_only && small {
            Some(tiles)
        } else {
            drop(tiles);
            None
        };
        if released {
            dispatch.retire();
        } else {
            dispatch.finish(&node, result);
        }
        kept.map(|tiles| SpentTask {
            _node: node,
            _class: class,
            _tiles: tiles,
        })
    }
}
