//! Fused replays: the tasks that a replayed trace runs on this rank become one task. On a rank
//! with one device, its body is a fused launch of their GPU bodies ([`ferry_device::fused`]: a
//! CUDA graph captured once, launched with one call): the GPU manager then walks the lifecycle —
//! alloc, stage-in, exec, finalize — once per replay instead of once per task, and the device
//! runs the tasks' kernels as the graph's branches, ordered by their tiles. On a rank without
//! devices, its node launches the tasks on the workers as a static graph
//! (`graph/cpu_graph.rs`): one node, one set of edges and one set of tile references per replay
//! instead of per task.
//!
//! A recording fuses on this rank when every action it recorded here is a task that runs here
//! (with a GPU body, on a device rank), a stale copy dropped, or — on a CPU rank — a transfer
//! of one tile to or from a peer (not packed): the transfers become parts of the static graph
//! (`graph/cpu_graph.rs`), so nothing outside the trace waits for one of its tasks alone — a
//! peer waiting for a tile gets it when the part that wrote it ends. It also needs at least two
//! such tasks, no part writes (their groups order host and device members in ways a graph does
//! not), and, on a device, tiles that fit in half its pool (one task takes all its tiles at
//! once). The fused task takes the union of the parts' tiles, each with the mode of the whole
//! sequence: read when only read (a send reads), write when written before read (a receive
//! writes), read-write otherwise. A stale copy dropped before the parts touch its tile is
//! dropped during the replay, as plain replay does; one dropped after they touched it is
//! dropped after the fused task is inserted, when that is the tile's last action in the
//! sequence (the fused task holds its copy meanwhile; a receive later in the sequence refills
//! it). Transfer tags are drawn when the fused task is inserted, in the recording's order. The
//! directory, the hashes and the mismatch checks are those of a plain replay: only the local
//! graph differs.
//!
//! The tasks of a fused replay are held until the trace ends; if one of them was inserted with
//! another class object than the recording's (a class rebuilt under the same name), they are
//! inserted one by one there instead, as a plain replay would have.

use super::{Inserter, Op, Recording, TraceId};
use crate::graph::cpu_graph::{CpuGraph, CpuPart, PartWork};
use crate::graph::task::{Task, TaskArgs, TaskClass};
use ferry_base::error::Rank;
use ferry_device::fused::{Fused, FusedCounters, FusedPart};
use ferry_memory::data::directory::TileKey;
use ferry_memory::data::{Access, AccessMode};
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// How this rank runs its fused replays: set only with `FERRY_TRACE_GRAPHS` on, on a rank with
/// exactly one device or on one whose tasks run on host buffers fixed for life (no devices, no
/// host tier).
pub(crate) enum FuseEnv {
    /// As one launch on its device (a CUDA graph).
    Gpu {
        /// Most tile bytes a fused task may take (half the device pool).
        max_bytes: u64,
        /// The runtime's counters of fused GPU launches.
        counters: Arc<FusedCounters>,
    },
    /// As a static graph on the CPU workers.
    Cpu,
}

/// How a recording's tasks on this rank run as one.
pub(crate) struct FusePlan {
    /// The fused task's tiles: the union of the tasks', in first-use order, with the
    /// sequence's mode of each.
    accesses: Vec<Access>,
    keys: Vec<TileKey>,
    /// Its class: bodies that launch the [`Fused`] sequence, or the [`CpuGraph`].
    class: TaskClass,
    /// The tasks' classes (addresses), in order: a replay fuses only with these.
    parts: Vec<usize>,
    /// The transfers among the parts, in the recording's order: peer, and whether a send.
    transfers: Vec<(Rank, bool)>,
    /// The stale copies the replay drops as it goes, by their action's index in
    /// [`Recording::ops`]: those of tiles the parts have not touched yet.
    pub(super) forget_now: FxHashSet<u32>,
    /// The tiles whose copy is dropped after the fused task is inserted: a stale copy dropped
    /// after the parts touched the tile, as its last action in the sequence.
    forget_after: Vec<TileKey>,
}

impl FusePlan {
    /// Whether the parts include transfers: the replay then posts none of its own.
    pub(super) fn has_transfers(&self) -> bool {
        !self.transfers.is_empty()
    }
}

/// The tasks of a fused replay, held until the trace ends: their arguments already packed for
/// the fused task ([`Fused::pack_args`]'s format), so that a replay copies each task's
/// arguments once and clones no class.
#[derive(Default)]
pub(crate) struct Held {
    args: TaskArgs,
    tasks: Vec<HeldTask>,
}

/// One held task.
struct HeldTask {
    seq: u64,
    priority: i32,
    /// Its class, only when it is not the recording's class object (a class rebuilt under the
    /// same name): the replay then inserts the tasks one by one.
    other: Option<TaskClass>,
}

impl Held {
    /// Holds `task`, the next task of `plan`'s replay that runs here, numbered `seq`.
    pub(crate) fn push(&mut self, plan: &FusePlan, task: &Task<'_>, seq: u64) {
        let same = plan.parts.get(self.tasks.len()) == Some(&class_id(task.class));
        Fused::pack_part(&mut self.args, task.args);
        self.tasks.push(HeldTask {
            seq,
            priority: task.priority,
            other: (!same).then(|| task.class.clone()),
        });
    }
}

fn class_id(class: &TaskClass) -> usize {
    Arc::as_ptr(&class.inner) as *const () as usize
}

impl Inserter {
    /// The plan by which `rec`'s tasks on this rank run as one launch, when they can (see the
    /// module documentation).
    pub(super) fn fuse_plan(&self, id: TraceId, rec: &Recording) -> Option<FusePlan> {
        let env = self.fuse.as_ref()?;
        let gpu = matches!(env, FuseEnv::Gpu { .. });
        let runs = rec.ops.iter().filter(|op| matches!(op, Op::Run)).count();
        if runs < 2 {
            return None;
        }
        let mut index: FxHashMap<TileKey, u32> = FxHashMap::default();
        let (mut accesses, mut keys): (Vec<Access>, Vec<TileKey>) = (Vec::new(), Vec::new());
        let mut bytes = 0u64;
        // The slot of `key` among the fused task's tiles, its mode widened by a use of `mode`.
        let mut slot = |key: TileKey, mode: AccessMode| -> Option<u32> {
            if let Some(&u) = index.get(&key) {
                let m: &mut AccessMode = &mut accesses[u as usize].mode;
                if *m == AccessMode::Read && mode.writes() {
                    *m = AccessMode::ReadWrite;
                }
                return Some(u);
            }
            let desc = self.dir.desc(key.0)?;
            let (i, j) = desc.coords(key.1 as usize);
            let u = accesses.len() as u32;
            index.insert(key, u);
            accesses.push(Access {
                coll: key.0,
                runtime: desc.runtime,
                i,
                j,
                mode,
            });
            keys.push(key);
            bytes += desc.tile_bytes(i, j) as u64;
            Some(u)
        };
        let mut parts = Vec::with_capacity(runs);
        let mut ids = Vec::with_capacity(runs);
        let mut classes = Vec::with_capacity(runs);
        let mut transfers = Vec::new();
        let mut forget_now = FxHashSet::default();
        // Per tile the parts touched: whether its latest action is a drop of its copy.
        let mut dropped: FxHashMap<TileKey, bool> = FxHashMap::default();
        let first_run = rec
            .tasks
            .iter()
            .position(|t| rec.ops[t.ops.start as usize..t.ops.end as usize].contains(&Op::Run))?;
        for (pos, t) in rec.tasks.iter().enumerate() {
            for i in t.ops.start..t.ops.end {
                match rec.ops[i as usize] {
                    Op::Run => {
                        let class = t.local_class.as_ref().filter(|c| !gpu || c.has_gpu())?;
                        let mut tiles = smallvec::SmallVec::new();
                        for (a, &key) in t.accesses.iter().zip(&t.keys) {
                            if a.mode.is_part() {
                                return None;
                            }
                            tiles.push((slot(key, a.mode)?, a.mode));
                            dropped.insert(key, false);
                        }
                        parts.push(PartWork::Task(CpuPart {
                            class: class.clone(),
                            tiles,
                            seq_offset: (pos - first_run) as u64,
                        }));
                        ids.push(class_id(class));
                        classes.push(class.clone());
                    }
                    Op::Send { key, peer } if !gpu => {
                        let tile = slot(key, AccessMode::Read)?;
                        dropped.insert(key, false);
                        parts.push(PartWork::Send { tile, peer });
                        transfers.push((peer, true));
                    }
                    Op::Recv {
                        key,
                        peer,
                        to_device: false,
                    } if !gpu => {
                        let tile = slot(key, AccessMode::Write)?;
                        dropped.insert(key, false);
                        parts.push(PartWork::Recv { tile, peer });
                        transfers.push((peer, false));
                    }
                    Op::Forget { key } => match dropped.get_mut(&key) {
                        Some(d) => *d = true,
                        None => {
                            forget_now.insert(i);
                        }
                    },
                    _ => return None,
                }
            }
        }
        // In the order the tiles were first touched: the same on every replay.
        let forget_after: Vec<TileKey> = keys.iter().copied().filter(|k| dropped[k]).collect();
        let name = format!("trace {id}");
        let class = match env {
            FuseEnv::Gpu { max_bytes, .. } if bytes > *max_bytes => {
                tracing::debug!(
                    trace = id,
                    bytes,
                    "trace not fused: its tiles take more than half a device pool"
                );
                return None;
            }
            FuseEnv::Gpu { counters, .. } => {
                let parts = parts
                    .into_iter()
                    .filter_map(|p| match p {
                        PartWork::Task(p) => Some(FusedPart {
                            kernel: p.class.inner.clone(),
                            tiles: p.tiles,
                            seq_offset: p.seq_offset,
                        }),
                        // A device rank records no transfer part (checked above).
                        PartWork::Send { .. } | PartWork::Recv { .. } => None,
                    })
                    .collect();
                let fused = Arc::new(Fused::new(name.clone(), parts, counters.clone()));
                let f = fused.clone();
                TaskClass::new(&name, move |ctx| {
                    f.run_emulated(ctx.tiles, ctx.args, ctx.seq, ctx.rank)
                        .map_err(Into::into)
                })
                .with_cuda(move |ctx| fused.run_cuda(ctx))
                .with_parts(classes)
            }
            FuseEnv::Cpu => TaskClass::fused_cpu(&name, Arc::new(CpuGraph::new(name.clone(), parts)), classes),
        };
        Some(FusePlan {
            accesses,
            keys,
            class,
            parts: ids,
            transfers,
            forget_now,
            forget_after,
        })
    }

    /// Ends a replay of a recording with a [`FusePlan`]: inserts its held tasks, and its
    /// transfers, as one task (with the transfers' tags, drawn now); then drops the copies the
    /// plan drops after it.
    pub(super) fn end_fused_replay(&mut self, id: TraceId, rec: &Recording, held: Held) {
        let plan = rec.fuse.as_ref().expect("called for a recording with a plan");
        let Some(first) = held.tasks.first() else { return };
        let same = held.tasks.len() == plan.parts.len() && held.tasks.iter().all(|t| t.other.is_none());
        if !same {
            tracing::debug!(trace = id, "replay not fused: a task's class is not the recording's");
            return self.end_unfused(rec, plan, &held);
        }
        let first_seq = first.seq;
        let priority = held.tasks.iter().map(|t| t.priority).max().unwrap_or(0);
        let tasks = held.tasks.len() as u64;
        let mut args = held.args;
        for &(peer, send) in &plan.transfers {
            let tag = if send {
                self.next_send_tag(peer)
            } else {
                self.next_recv_tag(peer)
            };
            args.push(i64::from(tag));
        }
        let task = Task {
            class: &plan.class,
            accesses: &plan.accesses,
            args: &args,
            on: None,
            priority,
        };
        self.add_task(&task, &plan.keys, first_seq);
        for &key in &plan.forget_after {
            self.set_local(key, None);
        }
        self.dispatch.counters.fused_replays.fetch_add(1, Relaxed);
        self.dispatch.counters.fused_tasks.fetch_add(tasks, Relaxed);
    }

    /// A fused replay whose tasks cannot run as one (a class rebuilt under the same name):
    /// performs the recording's actions one by one, in order, as a plain replay would have
    /// (the stale copies dropped during the replay already excepted).
    fn end_unfused(&mut self, rec: &Recording, plan: &FusePlan, held: &Held) {
        let per_task =
            ferry_device::fused::split_args(&held.args, held.tasks.len()).expect("held arguments are packed per task");
        let mut runs = held.tasks.iter().zip(per_task).enumerate();
        for rt in &rec.tasks {
            for i in rt.ops.start..rt.ops.end {
                match rec.ops[i as usize] {
                    Op::Send { key, peer } => self.post_send(key, peer),
                    Op::Recv { key, peer, to_device } => self.post_recv(key, peer, to_device),
                    Op::Forget { key } if !plan.forget_now.contains(&i) => self.set_local(key, None),
                    Op::Forget { .. } => {}
                    Op::Run => {
                        let Some((k, (t, args))) = runs.next() else {
                            debug_assert!(false, "a held task per recorded run");
                            return;
                        };
                        // `other` is `None` only where the class was the plan's part `k`
                        // (`Held::push`).
                        let class = t
                            .other
                            .as_ref()
                            .or_else(|| plan.class.inner.parts.get(k))
                            .expect("a held task of the recording's class has its part");
                        let task = Task {
                            class,
                            accesses: &rt.accesses,
                            args,
                            on: rt.on,
                            priority: t.priority,
                        };
                        self.add_task(&task, &rt.keys, t.seq);
                    }
                    // A plan has no packed transfer (`fuse_plan`).
                    Op::SendPacked { .. } | Op::RecvPacked { .. } => {
                        debug_assert!(false, "a fused recording with a packed transfer")
                    }
                }
            }
        }
    }
}
