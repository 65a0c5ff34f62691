//! Replay of recorded task sequences: memoized dependence analysis, after Legion's tracing
//! (Lee, Slaughter, Aiken, Bauer, "Dynamic Tracing: Memoization of Task Graphs for Dynamic
//! Task-Based Runtimes", SC 2018).
//!
//! The first time a sequence is inserted inside a trace, each rank records what the analysis
//! of each task decided *for this rank*: the sends and receives it posted (with their peers and
//! whether the receive lands on a device), whether it runs the task, which stale copies it
//! dropped. It also records what the sequence found in the directory and what it left there.
//! A later insertion of the same sequence replays those decisions: per task, it checks that the
//! task is the recorded one (class, placement, tiles, modes), folds its hash into the sequence's
//! as plain insertion would, and performs this rank's recorded actions — a task of another rank
//! that moves nothing here costs a comparison. The global per-access work (validation, the
//! directory's versions and holders, packing decisions) is skipped, and the directory is set to
//! the recorded exit state when the trace ends.
//!
//! What stays live is what depends on execution rather than on the sequence: the local
//! dependency edges (each replayed node is hooked to the current last writer and readers of its
//! tiles, so a replay orders correctly after whatever ran before it), renaming of tiles a send
//! still reads, device acknowledgements, and tags (numbered on from each peer's counter).
//!
//! A recording is valid for a replay when the tiles the sequence reads before writing have the
//! same newest writer and holders as when it was recorded (every rank decides alike: the
//! directory is the same everywhere). When they differ, the sequence is recorded again. A task
//! that differs from the recording, or a sequence that ends early or runs long, fails the run
//! with [`FerryError::TraceMismatch`] naming the first differing task: the directory is not
//! consistent until the trace's end, so the sequence cannot go on.

use super::inserter::fuse::{FusePlan, Held};
use super::task::{Task, TaskClass};
use ferry_base::error::{FerryError, Rank};
use ferry_memory::data::directory::TileKey;
use ferry_memory::data::rankset::RankSet;
use ferry_memory::data::{Access, AccessMode};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::ops::Range;
use std::sync::Arc;

/// A trace's identifier, chosen by the caller (the same on every rank).
pub type TraceId = u64;

/// One of this rank's actions for a task of a recorded sequence, in the order plain insertion
/// performed them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    /// Send this rank's copy of `key` to `peer`.
    Send { key: TileKey, peer: Rank },
    /// Receive the newest version of `key` from `peer`, into device memory when `to_device`.
    Recv { key: TileKey, peer: Rank, to_device: bool },
    /// Send the copies of `keys` (a range of [`Recording::packed`]) to `peer` as one message.
    SendPacked { keys: (u32, u32), peer: Rank },
    /// Receive `keys` from `peer` as one message.
    RecvPacked { keys: (u32, u32), peer: Rank },
    /// Run the task here.
    Run,
    /// Another rank wrote `key`: drop this rank's copy, stale now.
    Forget { key: TileKey },
}

/// What a recording knows of one task of the sequence.
pub(super) struct RecordedTask {
    /// The class's name hash and whether it has a GPU body: what the analysis depends on (a
    /// class rebuilt with the same name and bodies is the same class to a replay).
    pub(super) class: (u64, bool),
    pub(super) on: Option<Rank>,
    pub(super) accesses: SmallVec<[Access; 4]>,
    pub(super) keys: SmallVec<[TileKey; 4]>,
    pub(super) exec: Rank,
    /// The task's hash before its arguments (class, executing rank, tiles and modes), which a
    /// replay extends with the arguments of the task it is given.
    pub(super) shape_hash: u64,
    /// Its actions on this rank: a range of [`Recording::ops`].
    pub(super) ops: Range<u32>,
    /// Its class, when it runs here and this rank fuses replays: a part of a fused replay
    /// (`graph/inserter/fuse.rs`).
    pub(super) local_class: Option<TaskClass>,
}

impl RecordedTask {
    /// Whether `task` is this recorded task (its arguments may differ).
    #[inline]
    pub(super) fn matches(&self, task: &Task<'_>) -> bool {
        self.class == (task.class.inner.name_hash, task.class.has_gpu())
            && self.on == task.on
            && *self.accesses == *task.accesses
    }
}

/// The tile's state in the directory: newest writer and holders.
type TileState = (TileKey, Rank, RankSet);

/// One rank's recording of a sequence.
#[derive(Default)]
pub(crate) struct Recording {
    pub(super) tasks: Vec<RecordedTask>,
    pub(super) ops: Vec<Op>,
    pub(super) packed: Vec<TileKey>,
    /// The tiles the sequence reads before writing, as the recording found them: the condition
    /// for a replay.
    pub(super) entry: Vec<TileState>,
    /// Every tile the sequence touches, as it left them, with the versions it wrote.
    pub(super) exit: Vec<(TileState, u32)>,
    /// How this rank's tasks of the sequence run as one task, when they can.
    pub(super) fuse: Option<FusePlan>,
}

impl Recording {
    /// Tasks in the sequence.
    pub(crate) fn len(&self) -> usize {
        self.tasks.len()
    }
}

/// A recording in progress.
pub(super) struct Recorder {
    pub(super) id: TraceId,
    pub(super) rec: Recording,
    /// The tiles touched so far, with their version when first touched.
    pub(super) touched: FxHashMap<TileKey, u32>,
    pub(super) order: Vec<TileKey>,
    /// An insertion inside the trace failed: the recording is dropped at its end.
    pub(super) failed: bool,
}

impl Recorder {
    pub(super) fn new(id: TraceId) -> Recorder {
        Recorder {
            id,
            rec: Recording::default(),
            touched: FxHashMap::default(),
            order: Vec::new(),
            failed: false,
        }
    }

    /// Notes an action of the task being inserted.
    #[inline]
    pub(super) fn op(&mut self, op: Op) {
        self.rec.ops.push(op);
    }

    /// Notes a packed transfer's tiles; returns their range in [`Recording::packed`].
    pub(super) fn packed(&mut self, keys: &[TileKey]) -> (u32, u32) {
        let start = self.rec.packed.len() as u32;
        self.rec.packed.extend_from_slice(keys);
        (start, self.rec.packed.len() as u32)
    }
}

/// A replay in progress.
pub(super) struct Replayer {
    pub(super) id: TraceId,
    pub(super) rec: Arc<Recording>,
    /// The next task of the recording.
    pub(super) pos: usize,
    /// With a [`FusePlan`]: the tasks to run here, held until the trace's end.
    pub(super) held: Held,
}

/// Whether a trace is open, and how.
#[derive(Default)]
pub(super) enum Tracing {
    #[default]
    Off,
    Recording(Box<Recorder>),
    Replaying(Replayer),
    /// A replay failed (the run's error says why); the trace still has to be ended.
    Failed(TraceId),
}

impl Tracing {
    /// The open trace's id.
    pub(super) fn id(&self) -> Option<TraceId> {
        match self {
            Tracing::Off => None,
            Tracing::Recording(r) => Some(r.id),
            Tracing::Replaying(r) => Some(r.id),
            Tracing::Failed(id) => Some(*id),
        }
    }
}

/// How [`crate::Runtime::begin_trace`] took a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceMode {
    /// The sequence is being recorded (first use of the id, or the tiles it reads changed since
    /// its recording): it is inserted as usual.
    Record,
    /// The sequence replays its recording.
    Replay,
}

/// `` `name` on rank r: R c0(3,1) W c1(0,2) ``, for mismatch reports.
pub(super) fn describe(name: &str, exec: Option<Rank>, accesses: &[Access]) -> String {
    let mut s = match exec {
        Some(r) => format!("`{name}` on rank {r}:"),
        None => format!("`{name}`:"),
    };
    for a in accesses {
        let m = match a.mode {
            AccessMode::Read => "R",
            AccessMode::Write => "W",
            AccessMode::ReadWrite => "RW",
            AccessMode::ReadWritePart => "RWP",
        };
        s += &format!(" {m} c{}({},{})", a.coll, a.i, a.j);
    }
    if accesses.is_empty() {
        s += " no tiles";
    }
    s
}

/// The error of a replay that met a task other than the recorded one (`recorded`: the recorded
/// task's description, or `None` past the recording's end; `got`: the inserted one's, or `None`
/// when the sequence ended early).
pub(super) fn mismatch(
    id: TraceId,
    pos: usize,
    len: usize,
    recorded: Option<String>,
    got: Option<String>,
) -> FerryError {
    let detail = match (recorded, got) {
        (Some(r), Some(g)) => format!("task {pos} of the sequence is {g}; the recording has {r}"),
        (None, Some(g)) => format!("the recording has {len} tasks; task {pos} of the sequence, {g}, is one too many"),
        (Some(r), None) => format!("the sequence ended after {pos} tasks; the recording has {len}, the next being {r}"),
        (None, None) => format!("the sequence ended after {pos} tasks; the recording has {len}"),
    };
    FerryError::TraceMismatch { trace: id, detail }
}
