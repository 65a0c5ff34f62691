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
//! (with a GPU body, on a device rank), or a stale copy dropped (of a tile those tasks do not
//! touch): no send, no receive, so nothing outside the trace waits for one of its tasks alone.
//! It also needs at least two such tasks, no part writes (their groups order host and device
//! members in ways a graph does not), and, on a device, tiles that fit in half its pool (one
//! task takes all its tiles at once). The fused task takes the union of the tasks' tiles, each
//! with the mode of the whole sequence: read when only read, write when written before read,
//! read-write otherwise. The directory, the hashes and the mismatch checks are those of a plain
//! replay: only the local graph differs.
//!
//! The tasks of a fused replay are held until the trace ends; if one of them was inserted with
//! another class object than the recording's (a class rebuilt under the same name), they are
//! inserted one by one there instead, as a plain replay would have.

use super::{Inserter, Op, Recording, TraceId};
use crate::graph::cpu_graph::{CpuGraph, CpuPart};
use crate::graph::task::{Task, TaskArgs, TaskClass};
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
    /// Its position in the recording.
    pos: usize,
    priority: i32,
    /// Its class, only when it is not the recording's class object (a class rebuilt under the
    /// same name): the replay then inserts the tasks one by one.
    other: Option<TaskClass>,
}

impl Held {
    /// Holds `task`, the next task of `plan`'s replay, numbered `seq`, at `pos` in the recording.
    pub(crate) fn push(&mut self, plan: &FusePlan, task: &Task<'_>, seq: u64, pos: usize) {
        let same = plan.parts.get(self.tasks.len()) == Some(&class_id(task.class));
        Fused::pack_part(&mut self.args, task.args);
        self.tasks.push(HeldTask {
            seq,
            pos,
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
        let mut runs = Vec::new();
        let mut forgotten = FxHashSet::default();
        for (pos, t) in rec.tasks.iter().enumerate() {
            for op in &rec.ops[t.ops.start as usize..t.ops.end as usize] {
                match *op {
                    Op::Run => runs.push(pos),
                    Op::Forget { key } => {
                        forgotten.insert(key);
                    }
                    _ => return None,
                }
            }
        }
        if runs.len() < 2 {
            return None;
        }
        let mut index: FxHashMap<TileKey, u32> = FxHashMap::default();
        let (mut accesses, mut keys): (Vec<Access>, Vec<TileKey>) = (Vec::new(), Vec::new());
        let mut bytes = 0u64;
        let gpu = matches!(env, FuseEnv::Gpu { .. });
        let mut parts = Vec::with_capacity(runs.len());
        let mut ids = Vec::with_capacity(runs.len());
        let mut classes = Vec::with_capacity(runs.len());
        for &pos in &runs {
            let t = &rec.tasks[pos];
            let class = t.local_class.as_ref().filter(|c| !gpu || c.has_gpu())?;
            let mut tiles = smallvec::SmallVec::new();
            for (a, &key) in t.accesses.iter().zip(&t.keys) {
                if a.mode.is_part() || forgotten.contains(&key) {
                    return None;
                }
                let u = match index.get(&key) {
                    Some(&u) => {
                        let m: &mut AccessMode = &mut accesses[u as usize].mode;
                        if *m == AccessMode::Read && a.mode.writes() {
                            *m = AccessMode::ReadWrite;
                        }
                        u
                    }
                    None => {
                        let u = accesses.len() as u32;
                        index.insert(key, u);
                        accesses.push(*a);
                        keys.push(key);
                        bytes += self.dir.desc(key.0)?.tile_bytes(a.i, a.j) as u64;
                        u
                    }
                };
                tiles.push((u, a.mode));
            }
            parts.push((class.clone(), tiles, (pos - runs[0]) as u64));
            ids.push(class_id(class));
            classes.push(class.clone());
        }
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
                    .map(|(class, tiles, seq_offset)| FusedPart {
                        kernel: class.inner.clone(),
                        tiles,
                        seq_offset,
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
            FuseEnv::Cpu => {
                let parts = parts
                    .into_iter()
                    .map(|(class, tiles, seq_offset)| CpuPart {
                        class,
                        tiles,
                        seq_offset,
                    })
                    .collect();
                TaskClass::fused_cpu(&name, Arc::new(CpuGraph::new(name.clone(), parts)), classes)
            }
        };
        Some(FusePlan {
            accesses,
            keys,
            class,
            parts: ids,
        })
    }

    /// Ends a replay of a recording with a [`FusePlan`]: inserts its held tasks as one.
    pub(super) fn end_fused_replay(&mut self, id: TraceId, rec: &Recording, held: Held) {
        let plan = rec.fuse.as_ref().expect("called for a recording with a plan");
        let Some(first) = held.tasks.first() else { return };
        let same = held.tasks.len() == plan.parts.len() && held.tasks.iter().all(|t| t.other.is_none());
        if !same {
            tracing::debug!(trace = id, "replay not fused: a task's class is not the recording's");
            let per_task = ferry_device::fused::split_args(&held.args, held.tasks.len())
                .expect("held arguments are packed per task");
            for (k, (t, args)) in held.tasks.iter().zip(per_task).enumerate() {
                let rt = &rec.tasks[t.pos];
                // `other` is `None` only where the class was the plan's part `k` (`Held::push`).
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
            return;
        }
        let task = Task {
            class: &plan.class,
            accesses: &plan.accesses,
            args: &held.args,
            on: None,
            priority: held.tasks.iter().map(|t| t.priority).max().unwrap_or(0),
        };
        self.add_task(&task, &plan.keys, first.seq);
        self.dispatch.counters.fused_replays.fetch_add(1, Relaxed);
        self.dispatch
            .counters
            .fused_tasks
            .fetch_add(held.tasks.len() as u64, Relaxed);
    }
}
