//! Fused replays on a CPU rank: the tasks that a replayed trace runs on a rank without devices
//! become one node of the graph, whose parts then run as a static task graph on the workers —
//! the CPU counterpart of a CUDA graph (`ferry_device::fused`).
//!
//! Plain insertion pays, per task, for a node: its allocation, its edges (a lock per
//! predecessor), the reference counts of its tile copies and class (cache lines that the
//! inserting thread and the workers write in turn), and its free on another thread. A fused
//! replay pays for one node per trace. Its parts' dependencies are worked out once, when the
//! recording is made ([`ferry_base::access::sequence_dependencies`]), and a launch only resets a
//! counter per part: a part that finishes decrements its successors' counters, runs the first
//! one it makes ready itself and queues the others for idle workers, and the last part to
//! finish completes the node. This is the scheme of a parallel executor of a static DAG, as in
//! Taskflow's executor (Huang et al., "Taskflow", IEEE TPDS 2022) or a CUDA graph's launch.
//!
//! Only ranks whose copies keep one host buffer for life fuse this way (no devices, no host
//! tier, no coherence check: `Dispatch::host_only`): a part then reads its tiles where they
//! are, with no residency bookkeeping, and the node holds every copy for the whole launch.
//!
//! A part may also be one of the recording's transfers on this rank: a send of one of the
//! node's tiles, or a receive into one ([`PartWork`]). They are ordered with the tasks by the
//! tiles like any part (a send reads its tile, a receive writes it), posted to the transfer
//! layer as soon as the parts they follow have finished, and finish when the transfer layer
//! says so (a send whose data has left, a receive whose data has landed). So the tile a step
//! computes leaves as soon as its task ends, and the task that waits for a peer's tile starts
//! when it lands, as with one node per transfer — without the nodes: a replay on a rank per
//! core otherwise spends more time inserting and dispatching a step's send, receive and task
//! than the peer's data takes to come. Their tags are drawn when the replay is inserted, in the
//! recording's order (the peer's plain or fused replay draws the same ones), and passed after
//! the tasks' arguments.

use super::dispatch::{CpuJob, Dispatch};
use super::node::Node;
use super::task::{run_body, TaskArgs, TaskClass, TaskContext, TileArgs};
use crossbeam::utils::CachePadded;
use ferry_base::error::{FerryError, Rank, TaskError};
use ferry_base::AccessMode;
use ferry_device::TileView;
use smallvec::SmallVec;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One task of a fused CPU replay.
pub(crate) struct CpuPart {
    /// Its class: the body that runs, and the statistics that count it.
    pub(crate) class: TaskClass,
    /// Its tiles, in its argument order: the index of each among the fused node's tiles, and
    /// how the task uses it.
    pub(crate) tiles: SmallVec<[(u32, AccessMode); 6]>,
    /// Its sequence number less the fused node's.
    pub(crate) seq_offset: u64,
}

/// Per task of a fused replay, its arguments' range among the fused node's.
type ArgRanges = SmallVec<[Range<usize>; 16]>;

/// What one part of a fused CPU replay does.
pub(crate) enum PartWork {
    /// Runs a task.
    Task(CpuPart),
    /// Sends the fused node's tile `tile` (an index among its tiles) to `peer`.
    Send { tile: u32, peer: Rank },
    /// Receives the newest version of the fused node's tile `tile` from `peer`, into its copy.
    Recv { tile: u32, peer: Rank },
}

impl PartWork {
    /// The tiles it uses and how: a send reads its tile, a receive writes it.
    fn tiles(&self) -> SmallVec<[(u32, AccessMode); 6]> {
        match self {
            PartWork::Task(p) => p.tiles.clone(),
            PartWork::Send { tile, .. } => smallvec::smallvec![(*tile, AccessMode::Read)],
            PartWork::Recv { tile, .. } => smallvec::smallvec![(*tile, AccessMode::Write)],
        }
    }
}

/// The tasks and transfers of a recording on this CPU rank, with their dependencies (made once
/// per recording, launched once per replay).
pub(crate) struct CpuGraph {
    name: String,
    parts: Vec<PartWork>,
    /// Per part, its index among the parts of its kind: a task's among the tasks (its
    /// arguments), a transfer's among the transfers (its tag).
    ord: Vec<u32>,
    /// Tasks among the parts.
    tasks: usize,
    /// Per part, the parts that follow it.
    succs: Vec<SmallVec<[u32; 4]>>,
    /// Per part, how many parts it follows.
    preds: Vec<u32>,
    /// The parts that follow none, in order (never empty: the first part follows none).
    roots: Vec<u32>,
}

impl CpuGraph {
    /// The graph of `parts`, in the order they were inserted; `name` names it in errors.
    ///
    /// # Panics
    /// When `parts` is empty.
    pub(crate) fn new(name: String, parts: Vec<PartWork>) -> CpuGraph {
        assert!(!parts.is_empty(), "a fused CPU replay has parts");
        let tiles: Vec<_> = parts.iter().map(PartWork::tiles).collect();
        let deps = ferry_base::access::sequence_dependencies(tiles.iter().map(|t| &t[..]));
        let (mut tasks, mut transfers) = (0u32, 0u32);
        let ord = parts
            .iter()
            .map(|p| {
                let n = if matches!(p, PartWork::Task(_)) {
                    &mut tasks
                } else {
                    &mut transfers
                };
                *n += 1;
                *n - 1
            })
            .collect();
        let mut succs: Vec<SmallVec<[u32; 4]>> = vec![SmallVec::new(); parts.len()];
        for (k, d) in deps.iter().enumerate() {
            for &p in d {
                succs[p as usize].push(k as u32);
            }
        }
        let preds: Vec<u32> = deps.iter().map(|d| d.len() as u32).collect();
        let roots = (0..parts.len() as u32).filter(|&k| preds[k as usize] == 0).collect();
        CpuGraph {
            name,
            parts,
            ord,
            tasks: tasks as usize,
            succs,
            preds,
            roots,
        }
    }

    /// Transfers among the parts.
    pub(crate) fn transfers(&self) -> usize {
        self.parts.len() - self.tasks
    }

    /// Each task's range of the fused node's arguments (`Fused::pack_args` format, the
    /// transfers' tags after them), and the tags; or an error naming the graph.
    fn split<'a>(&self, args: &'a [i64]) -> Result<(ArgRanges, &'a [i64]), String> {
        let bad = || {
            format!(
                "fused `{}`: {} arguments are not those of its {} tasks and {} transfers",
                self.name,
                args.len(),
                self.tasks,
                self.transfers()
            )
        };
        let at = args.len().checked_sub(self.transfers()).ok_or_else(bad)?;
        let ranges = ferry_device::fused::packed_ranges(&args[..at], self.tasks).ok_or_else(bad)?;
        Ok((ranges, &args[at..]))
    }

    /// Runs the parts one after another on the calling thread: the fused class's CPU body,
    /// for a runner that does not launch the graph on the workers.
    pub(crate) fn run_in_order(&self, ctx: &TaskContext<'_>) -> Result<(), TaskError> {
        if self.transfers() > 0 {
            return Err(format!(
                "fused `{}` has transfers: it runs only as a graph on the workers of a host-only rank",
                self.name
            )
            .into());
        }
        let (ranges, _) = self.split(ctx.args)?;
        let mut views = SmallVec::new();
        let tasks = self.parts.iter().filter_map(|p| match p {
            PartWork::Task(t) => Some(t),
            _ => None,
        });
        for (k, p) in tasks.enumerate() {
            part_views(p, ctx.tiles, &mut views);
            run_body(
                &p.class,
                &views,
                &ctx.args[ranges[k].clone()],
                ctx.seq + p.seq_offset,
                ctx.rank,
                ctx.worker,
            )
            .map_err(|e| format!("`{}` (part {k} of fused `{}`): {e}", p.class.name(), self.name))?;
        }
        Ok(())
    }
}

/// Fills `out` with part `p`'s tiles out of the fused node's `views`, each with the part's own
/// mode. In place: a returned `SmallVec` of eight views is a 500-byte move per part. The
/// indices were made from the node's accesses, so they are in range.
fn part_views(p: &CpuPart, views: &[TileView], out: &mut SmallVec<[TileView; 8]>) {
    out.clear();
    out.extend(p.tiles.iter().map(|&(u, mode)| TileView {
        mode,
        ..views[u as usize].clone()
    }));
}

/// One launch of a [`CpuGraph`]: what its parts share while they run.
pub(crate) struct GraphRun {
    graph: Arc<CpuGraph>,
    /// The fused node's tiles, at their fixed host buffers.
    views: Vec<TileView>,
    args: TaskArgs,
    /// Per task, its arguments' range in `args`.
    arg_ranges: ArgRanges,
    seq: u64,
    /// Per part, the parts it follows that have not finished.
    waiting: Box<[AtomicU32]>,
    /// Parts not finished.
    left: AtomicUsize,
    /// A part failed: the others skip their bodies.
    failed: AtomicBool,
    /// Body time per worker, ns: counted where it is spent, summed once at the end (a shared
    /// counter per part would be a cache line passed between the workers at every part).
    busy: Box<[CachePadded<AtomicU64>]>,
    node: Arc<Node>,
    class: TaskClass,
    /// The node's copies, held until the last part finishes.
    tiles: Mutex<Option<TileArgs>>,
}

// SAFETY: `views` point into the fixed host buffers of the copies in `tiles`, which the run
// holds until its last part has finished. Parts that share a tile where one of them writes it
// (a task, or a receive) are ordered by `waiting` (each part starts only after a
// release-acquire handover from every part it follows), so a tile is written by one part at a
// time, with no reader alongside.
unsafe impl Send for GraphRun {}
// SAFETY: as above.
unsafe impl Sync for GraphRun {}

/// A part of a [`GraphRun`] queued for a worker.
pub(crate) struct PartJob {
    run: Arc<GraphRun>,
    part: u32,
}

impl PartJob {
    pub(crate) fn run(self, worker: usize, dispatch: &Arc<Dispatch>) {
        self.run.step(self.part as usize, worker, dispatch);
    }
}

impl GraphRun {
    /// Launches `graph` for its fused node `node` (whose class is `class`, tiles `tiles`,
    /// arguments `args` and sequence number `seq`) on worker `worker`: posts the transfers that
    /// follow no part, queues the tasks that follow none but one, which this worker runs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch(
        graph: Arc<CpuGraph>,
        node: Arc<Node>,
        class: TaskClass,
        tiles: TileArgs,
        args: TaskArgs,
        seq: u64,
        worker: usize,
        dispatch: &Arc<Dispatch>,
    ) {
        let arg_ranges = match graph.split(&args) {
            Ok((ranges, _tags)) => ranges,
            Err(msg) => {
                drop(tiles);
                let e = FerryError::TaskFailed {
                    class: class.name().to_string(),
                    seq,
                    rank: dispatch.rank,
                    msg,
                };
                dispatch.finish(&node, Err(e));
                return;
            }
        };
        let views = tiles.iter().map(|t| t.view(t.copy.fixed_host().as_ptr())).collect();
        let run = Arc::new(GraphRun {
            views,
            args,
            arg_ranges,
            seq,
            waiting: graph.preds.iter().map(|&n| AtomicU32::new(n)).collect(),
            left: AtomicUsize::new(graph.parts.len()),
            failed: AtomicBool::new(false),
            busy: (0..dispatch.counters.workers.len().max(1))
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            node,
            class,
            tiles: Mutex::new(Some(tiles)),
            graph,
        });
        let mut first = None;
        for &r in &run.graph.roots {
            if !matches!(run.graph.parts[r as usize], PartWork::Task(_)) {
                run.post(r as usize, dispatch);
            } else if first.is_none() {
                first = Some(r as usize);
            } else {
                dispatch.spawner.spawn(CpuJob::Part(PartJob {
                    run: run.clone(),
                    part: r,
                }));
            }
        }
        if let Some(k) = first {
            run.step(k, worker, dispatch);
        }
    }

    /// Runs task `k` on `worker`, then each first task it makes ready, until a task readies
    /// none; the other tasks it readies are queued and the transfers posted
    /// ([`GraphRun::finished`]).
    fn step(self: &Arc<Self>, mut k: usize, worker: usize, dispatch: &Arc<Dispatch>) {
        // One clock reading per part: a part's end is the next one's start.
        let mut t = Instant::now();
        loop {
            t = self.run_part(k, worker, dispatch, t);
            match self.finished(k, dispatch, true) {
                Some(s) => k = s,
                None => return,
            }
        }
    }

    /// Part `k` has finished: the parts it made ready start — transfers posted at once, tasks
    /// queued, but the first one returned instead when `inline` (for the caller to run) — and
    /// the last part to finish completes the node.
    fn finished(self: &Arc<Self>, k: usize, dispatch: &Arc<Dispatch>, inline: bool) -> Option<usize> {
        let mut next = None;
        for &s in &self.graph.succs[k] {
            // Acquire-release: the successor sees every write of the parts it follows.
            if self.waiting[s as usize].fetch_sub(1, Ordering::AcqRel) != 1 {
                continue;
            }
            if !matches!(self.graph.parts[s as usize], PartWork::Task(_)) {
                self.post(s as usize, dispatch);
            } else if inline && next.is_none() {
                next = Some(s as usize);
            } else {
                dispatch.spawner.spawn(CpuJob::Part(PartJob {
                    run: self.clone(),
                    part: s,
                }));
            }
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.complete(dispatch);
            return None;
        }
        next
    }

    /// Posts transfer part `k` to the transfer layer; it finishes in the callback (on the
    /// thread that completes it: a progress pass, or this one for a send that went straight
    /// into a ring), which starts what follows it. A transfer that failed fails the run; the
    /// parts after it skip their bodies. (Posted even after a failure: the peer's half
    /// of it may be waiting.)
    fn post(self: &Arc<Self>, k: usize, dispatch: &Arc<Dispatch>) {
        let (send, tile, peer) = match self.graph.parts[k] {
            PartWork::Send { tile, peer } => (true, tile, peer),
            PartWork::Recv { tile, peer } => (false, tile, peer),
            PartWork::Task(_) => unreachable!("tasks run, transfers are posted"),
        };
        // The tags follow the tasks' arguments (checked by `split` at the launch).
        let tag = self.args[self.args.len() - self.graph.transfers() + self.graph.ord[k] as usize] as i32;
        // The node's copies are there until its last part, which this one is not yet.
        let copy = match self.tiles.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(tiles) => tiles[tile as usize].copy.clone(),
            None => unreachable!("a transfer is posted before the run completes"),
        };
        let (run, d) = (self.clone(), dispatch.clone());
        let done: ferry_transfer::Done = Box::new(move |r| {
            if let Err(e) = r {
                run.failed.store(true, Ordering::Relaxed);
                d.tracker.fail(e);
            }
            run.finished(k, &d, false);
        });
        if send {
            dispatch.transport.send(copy, peer, tag, false, done);
        } else {
            dispatch.transport.recv(copy, peer, tag, false, None, done);
        }
    }

    /// Runs task part `k`'s body on `worker`, unless the run (or this launch) already failed,
    /// and returns when it ended (`t0`: when it started, as far as its time counts); a failure
    /// fails the run at once, naming the part.
    fn run_part(&self, k: usize, worker: usize, dispatch: &Dispatch, mut t0: Instant) -> Instant {
        if self.failed.load(Ordering::Relaxed) || dispatch.tracker.is_poisoned() {
            return t0;
        }
        let PartWork::Task(p) = &self.graph.parts[k] else {
            unreachable!("only tasks run on a worker")
        };
        let mut views = SmallVec::new();
        part_views(p, &self.views, &mut views);
        let seq = self.seq + p.seq_offset;
        if dispatch.sched_jitter_us > 0 {
            let mut j = ferry_base::faults::Jitter::new(seq ^ (worker as u64) << 40, dispatch.sched_jitter_us);
            std::thread::sleep(j.next_delay());
            t0 = Instant::now();
        }
        let slot = dispatch.counters.slot(worker);
        if let Some(w) = slot {
            let since = t0.saturating_duration_since(dispatch.counters.start).as_nanos() as u64;
            w.current_class.store(p.class.inner.name_hash, Ordering::Relaxed);
            w.current_start_ns.store(since, Ordering::Relaxed);
            w.current_seq.store(seq, Ordering::Release);
        }
        let out = run_body(
            &p.class,
            &views,
            &self.args[self.arg_ranges[self.graph.ord[k] as usize].clone()],
            seq,
            dispatch.rank,
            worker,
        );
        let end = Instant::now();
        let ns = end.saturating_duration_since(t0).as_nanos() as u64;
        if let Some(w) = slot {
            w.current_seq.store(u64::MAX, Ordering::Release);
            w.tasks.fetch_add(1, Ordering::Relaxed);
            w.busy_ns.fetch_add(ns, Ordering::Relaxed);
        }
        if let Some(b) = self.busy.get(worker) {
            b.fetch_add(ns, Ordering::Relaxed);
        }
        if let Err(msg) = out {
            self.failed.store(true, Ordering::Relaxed);
            dispatch.tracker.fail(FerryError::TaskFailed {
                class: p.class.name().to_string(),
                seq,
                rank: dispatch.rank,
                msg,
            });
        }
        end
    }

    /// After the last part: counts the parts' time under their classes, gives the copies back
    /// and finishes the node (a failure was reported by its part already).
    fn complete(&self, dispatch: &Arc<Dispatch>) {
        let busy: u64 = self.busy.iter().map(|b| b.load(Ordering::Relaxed)).sum();
        self.class.record(busy);
        drop(self.tiles.lock().unwrap_or_else(|p| p.into_inner()).take());
        dispatch.finish(&self.node, Ok(()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::any::TypeId;
    use std::cell::RefCell;

    fn part(class: &TaskClass, tiles: &[(u32, AccessMode)], seq_offset: u64) -> PartWork {
        PartWork::Task(CpuPart {
            class: class.clone(),
            tiles: tiles.iter().copied().collect(),
            seq_offset,
        })
    }

    /// Successors, predecessor counts and roots follow the tiles: read after write, write after
    /// read and write after write order parts; independent parts are roots.
    #[test]
    fn the_graph_follows_the_tiles() {
        use AccessMode::{Read as R, ReadWrite as RW, Write as W};
        let c = TaskClass::new("c", |_| Ok(()));
        let g = CpuGraph::new(
            "t".into(),
            vec![
                part(&c, &[(0, W)], 0),         // 0
                part(&c, &[(1, W)], 1),         // 1
                part(&c, &[(0, R), (2, W)], 2), // 2: after 0
                part(&c, &[(0, RW)], 3),        // 3: after 0 (writer) and 2 (reader)
                part(&c, &[(1, R), (2, R)], 4), // 4: after 1 and 2
                part(&c, &[(3, R)], 5),         // 5: a root
            ],
        );
        let succs: Vec<Vec<u32>> = g.succs.iter().map(|s| s.to_vec()).collect();
        assert_eq!(succs, vec![vec![2, 3], vec![4], vec![3, 4], vec![], vec![], vec![]]);
        assert_eq!(g.preds, vec![0, 0, 1, 2, 2, 0]);
        assert_eq!(g.roots, vec![0, 1, 5]);
    }

    /// Run in order (the fused class's own CPU body), each part sees its own tiles with its own
    /// modes, arguments and sequence number; malformed arguments are an error naming the graph.
    #[test]
    fn in_order_each_part_sees_its_own_tiles_and_arguments() {
        use AccessMode::{Read as R, Write as W};
        let add = TaskClass::new("add", |ctx| {
            let sum: u64 = (1..ctx.num_tiles())
                .map(|k| ctx.tile::<u64>(k).map(|t| t[0]))
                .sum::<Result<_, _>>()?;
            ctx.tile_mut::<u64>(0)?[0] = sum + ctx.args()[0] as u64 + ctx.seq();
            Ok(())
        });
        let g = CpuGraph::new(
            "t".into(),
            vec![part(&add, &[(0, W)], 0), part(&add, &[(1, W), (0, R)], 2)],
        );
        let (mut a, mut b) = ([0u64; 2], [0u64; 2]);
        let view = |buf: &mut [u64; 2]| TileView {
            ptr: buf.as_mut_ptr() as *mut u8,
            bytes: 16,
            rows: 1,
            cols: 2,
            mode: AccessMode::ReadWrite,
            elem: TypeId::of::<u64>(),
            elem_name: "u64",
            coords: (0, 0),
        };
        let tiles = [view(&mut a), view(&mut b)];
        let ctx = |args: &'static [i64]| TaskContext {
            tiles: &tiles,
            args,
            seq: 100,
            rank: 0,
            worker: 0,
            borrows: RefCell::new(smallvec::smallvec![0; 2]),
        };
        g.run_in_order(&ctx(&[1, 5, 1, 7])).unwrap();
        // a = 5 + 100; b = a + 7 + 102.
        assert_eq!((a[0], b[0]), (105, 214));
        let e = g.run_in_order(&ctx(&[1, 5, 2, 7])).unwrap_err().to_string();
        assert!(
            e.contains("fused `t`: 4 arguments are not those of its 2 tasks and 0 transfers"),
            "{e}"
        );
    }
}
