//! Sequential task flow: turns the inserted sequence into this rank's local graph of tasks,
//! sends and receives.
//!
//! Every rank sees the same sequence and keeps the same copy directory, so each rank knows,
//! without asking, which tiles it must send to whom and which it will receive:
//!
//! * A task runs on the owner of the first tile it writes (owner-computes) unless placed
//!   explicitly.
//! * For each tile the task reads whose newest version is not on the executing rank `e`, the
//!   rank that wrote that version sends it to `e` and `e` receives it into a fresh buffer. Both
//!   sides number the transfers between an ordered pair of ranks in insertion order; that number
//!   (modulo `MPI_TAG_UB + 1`) is the tag. No request/grant handshake, one message per payload.
//! * Locally, a reader depends on the last writer of its copy (RAW); a writer depends on the last
//!   writer and on every reader since, sends included (WAW, WAR: a copy a send is still reading is
//!   never overwritten). A receive lands in a new buffer (renaming), so it never waits for local
//!   readers of the old copy.
//! * A run of consecutive part writes of one tile ([`AccessMode::ReadWritePart`]) is a group:
//!   its members depend on what came before the group, not on each other, and what comes after
//!   depends on all of them. A member that runs on the host also depends on the members before
//!   it (two bodies would otherwise hold the tile's `&mut` at once).
//! * A rank that neither runs the task nor holds a tile it reads only updates the directory:
//!   O(1) per access.

use super::dispatch::Dispatch;
use super::epoch::EpochHashes;
use super::node::{Edges, Node, Work};
use super::recent::{Recent, RecentRing};
use super::replay::{self, Op, RecordedTask, Recorder, Recording, Replayer, TraceId, TraceMode, Tracing};
use super::task::{Task, TaskArgs, TileArg, TileArgs};
use super::window::SubmitWindow;
use ferry_base::error::{FerryError, Rank, Result};
use ferry_base::hash;
use ferry_memory::data::collection::CollectionDesc;
use ferry_memory::data::copy::{CopyEnv, TileCopy};
use ferry_memory::data::directory::{Directory, TileKey};
use ferry_memory::data::AccessMode;
use fuse::{FuseEnv, Held};
use smallvec::SmallVec;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// This rank's state of one tile it holds a copy of.
pub(crate) struct LocalTile {
    pub(crate) copy: Arc<TileCopy>,
    last_writer: Option<Arc<Node>>,
    /// When the current version was written in parts: the group's members other than
    /// `last_writer` (its first). Empty otherwise.
    parts: Vec<Arc<Node>>,
    readers: Vec<Arc<Node>>,
    /// The sends among `readers` (unfinished ones decide renaming, see `Inserter::add_task`),
    /// and whether each could carry a device acknowledgement (its route is IPC and
    /// acknowledgements are on).
    sends: Vec<(Arc<Node>, bool)>,
    /// The group of part writers still open (the last access was a part write).
    group: Option<Box<OpenGroup>>,
}

/// A group of part writers that the next part write of the tile joins.
struct OpenGroup {
    /// What the group waits for: the writers and readers of the version before it.
    before: Vec<Arc<Node>>,
    /// The latest member that runs on the host: every member after it waits for it (it waited
    /// for all members before it).
    last_host: Option<Arc<Node>>,
    /// The device members since `last_host` (all of them when there is none): the next host
    /// member waits for them.
    since_host: Vec<Arc<Node>>,
    /// The device acknowledgements its members could wait for: the unfinished sends that could
    /// carry one among `before` when the group opened ([`LocalTile::ack_waits`]).
    ack_waits: u8,
}

/// Memory the inserted sequence needs on this rank, counted at insertion: bytes of the tile
/// copies held as the sequence goes (owned tiles, received versions, fresh outputs; a copy
/// superseded by a newer version leaves the count), their peak, and the largest task.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Footprint {
    pub(crate) live: u64,
    pub(crate) peak: u64,
    pub(crate) largest_task: u64,
    pub(crate) largest_gpu_task: u64,
}

impl Footprint {
    fn add(&mut self, bytes: u64) {
        self.live += bytes;
        self.peak = self.peak.max(self.live);
    }

    fn task(&mut self, bytes: u64, gpu: bool) {
        self.largest_task = self.largest_task.max(bytes);
        if gpu {
            self.largest_gpu_task = self.largest_gpu_task.max(bytes);
        }
    }
}

impl LocalTile {
    /// A copy that the receive `node` fills: its first writer.
    fn arriving(copy: Arc<TileCopy>, node: &Arc<Node>) -> Self {
        LocalTile {
            last_writer: Some(node.clone()),
            ..LocalTile::new(copy)
        }
    }

    pub(crate) fn new(copy: Arc<TileCopy>) -> Self {
        LocalTile {
            copy,
            last_writer: None,
            parts: Vec::new(),
            readers: Vec::new(),
            sends: Vec::new(),
            group: None,
        }
    }

    /// The writers of the current version: its writer, or every member of the group that wrote
    /// it in parts.
    fn writers(&self) -> impl Iterator<Item = &Arc<Node>> {
        self.last_writer.iter().chain(&self.parts)
    }

    /// `node` reads the current version (a task, or a send): it waits for the version's
    /// writers, and the next writer waits for it. Ends an open group of part writers.
    fn add_reader(&mut self, edges: &mut Edges<'_>) {
        for w in self.writers() {
            edges.after(w);
        }
        self.readers.push(edges.node().clone());
        self.group = None;
    }

    /// `node` writes the next version, whole (`part` false) or a part of it (`part`; `serial`:
    /// `node` runs on the host). See [`AccessMode::ReadWritePart`].
    fn add_writer(&mut self, edges: &mut Edges<'_>, part: bool, serial: bool) {
        let node = edges.node();
        if let (true, Some(g)) = (part, self.group.as_mut()) {
            // Joins the open group: waits for what the group waits for, and for the latest
            // member that runs on the host. A member that runs on the host itself also waits
            // for the device members since that one: host members run one at a time, and
            // never beside a device member (each would write its own copy of the tile). O(1)
            // edges per member beyond the group's own predecessors, however long the group.
            for b in g.before.iter().chain(&g.last_host) {
                edges.after(b);
            }
            if serial {
                for w in &g.since_host {
                    edges.after(w);
                }
                g.last_host = Some(node.clone());
                g.since_host.clear();
            } else {
                g.since_host.push(node.clone());
            }
            self.parts.push(node.clone());
            return;
        }
        for p in self.writers().chain(&self.readers) {
            edges.after(p);
        }
        let ack_waits = if part { self.ack_waits(false) } else { 0 };
        self.group = part.then(|| {
            let before = self.writers().chain(&self.readers).cloned().collect();
            let (last_host, since_host) = if serial {
                (Some(node.clone()), Vec::new())
            } else {
                (None, vec![node.clone()])
            };
            Box::new(OpenGroup {
                before,
                last_host,
                since_host,
                ack_waits,
            })
        });
        self.last_writer = Some(node.clone());
        self.parts.clear();
        self.readers.clear();
        self.sends.clear();
    }

    /// Whether a send of this copy has not finished (it may be waiting for the peer's
    /// acknowledgement).
    fn sending(&mut self) -> bool {
        self.sends.retain(|(s, _)| !s.is_done());
        !self.sends.is_empty()
    }

    /// The device acknowledgements that a write of this tile could wait for: the unfinished
    /// sends of the current version that could carry one — or, for a part write that joins
    /// the open group (`part`), those the group's first member could (the members wait for
    /// what it waits for). Saturates at 255.
    fn ack_waits(&mut self, part: bool) -> u8 {
        if let (true, Some(g)) = (part, self.group.as_ref()) {
            return g.ack_waits;
        }
        self.sends.retain(|(s, _)| !s.is_done());
        u8::try_from(self.sends.iter().filter(|(_, acked)| *acked).count()).unwrap_or(u8::MAX)
    }

    /// Forgets finished nodes so long runs do not accumulate them.
    fn prune(&mut self) {
        if self.last_writer.as_ref().is_some_and(|w| w.is_done()) {
            self.last_writer = None;
        }
        if self.parts.len() >= 16 {
            self.parts.retain(|w| !w.is_done());
        }
        if self.readers.len() >= 16 {
            self.readers.retain(|r| !r.is_done());
        }
        if self.sends.len() >= 16 {
            self.sends.retain(|(r, _)| !r.is_done());
        }
    }
}

pub(crate) struct Inserter {
    rank: Rank,
    size: usize,
    tag_modulus: u64,
    pub(crate) dir: Directory<LocalTile>,
    /// Transfers numbered so far from this rank to each peer, and from each peer to this rank.
    sent: Vec<u64>,
    received: Vec<u64>,
    /// Tasks inserted and the running hash of the sequence.
    pub(crate) seq: u64,
    pub(crate) hash: u64,
    /// Per-task hashes since the last `wait`, and where that epoch started in the sequence.
    pub(crate) epoch_hashes: EpochHashes,
    pub(crate) epoch_start: u64,
    /// `seq` when this rank last entered `wait`'s agreements (whatever came of them): the
    /// tasks past it owe the other ranks a `wait`, which shutdown makes for a program that
    /// gave up before it.
    pub(crate) wait_entered: u64,
    /// The last `RECENT_TASKS` tasks, for mismatch reports, and their classes' names by hash.
    recent: RecentRing,
    names: rustc_hash::FxHashMap<u64, Arc<str>>,
    /// The class of the last task inserted (its address, and its name's hash): a graph inserts
    /// runs of one class, and those skip the name lookup and the runtime's class registry.
    last_class: (usize, u64),
    dispatch: Arc<Dispatch>,
    /// Where new copies live: local devices (copies track a location per device), where their
    /// blocks go back, the pinned host pool, the host tier.
    env: CopyEnv,
    /// What the inserted sequence needs in memory on this rank.
    pub(crate) footprint: Footprint,
    /// Largest tile packed with others (`Routes::pack_bytes`; 0: never).
    pack_bytes: u64,
    /// How far insertion may run ahead of execution.
    window: SubmitWindow,
    /// This runtime's number among the runtimes of the process (from 1): the collections it
    /// registers carry it, and accesses through another runtime's handles are refused.
    instance: u64,
    /// The open trace, if any, and the recordings made so far (`graph/replay.rs`).
    tracing: Tracing,
    traces: rustc_hash::FxHashMap<TraceId, Arc<Recording>>,
    /// Fused replays, where this rank can run them (`inserter/fuse.rs`).
    fuse: Option<FuseEnv>,
    /// Whether and how often this thread runs ready work between insertions.
    help: InsertionHelp,
}

/// The inserting thread's share of the graph's work (`sched/help.rs`): when on, after every
/// [`HELP_EVERY`] insertions, a progress pass and up to [`HELP_JOBS`] ready jobs.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct InsertionHelp {
    on: bool,
    since: u32,
}

impl InsertionHelp {
    /// Help (`on`) or only insert.
    pub(crate) fn new(on: bool) -> Self {
        InsertionHelp { on, since: 0 }
    }
}

/// Insertions between two of the inserting thread's scheduling points. A fine-grained graph's
/// chain of hops advances by about one hop per point on each rank (a pass receives the peer's
/// tile, the task it readies runs, its output goes out), so a point per step of a two-task-wide
/// stencil keeps execution level with insertion. A point after every insertion, or every
/// fourth, measured no better on Task Bench's `stencil_1d` (CI VM, within its spread).
const HELP_EVERY: u32 = 2;

/// The most ready jobs the inserting thread runs at one scheduling point: enough to carry the
/// chain along, few enough that insertion, which readies the jobs after them, goes on.
const HELP_JOBS: usize = 4;

/// What the analysis of one task found: its tiles' keys, its executing rank, and its hash
/// before its arguments.
struct Analysed {
    keys: SmallVec<[TileKey; 8]>,
    exec: Rank,
    shape_hash: u64,
}

impl Inserter {
    /// The inserter of rank `rank` of `size`; `window`: the submission window in graph nodes
    /// (0: unbounded).
    pub(crate) fn new(
        rank: Rank,
        size: usize,
        tag_ub: i32,
        dispatch: Arc<Dispatch>,
        env: CopyEnv,
        window: usize,
        fuse: Option<FuseEnv>,
    ) -> Self {
        Inserter {
            rank,
            size,
            tag_modulus: tag_ub.max(1) as u64 + 1,
            dir: Directory::new(rank, size),
            sent: vec![0; size],
            received: vec![0; size],
            seq: 0,
            hash: 0,
            epoch_hashes: EpochHashes::default(),
            epoch_start: 0,
            wait_entered: 0,
            recent: RecentRing::new(),
            names: rustc_hash::FxHashMap::default(),
            last_class: (0, 0),
            pack_bytes: dispatch.transport.routes.pack_bytes(),
            dispatch,
            env,
            footprint: Footprint::default(),
            window: SubmitWindow::new(window),
            instance: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            tracing: Tracing::Off,
            traces: rustc_hash::FxHashMap::default(),
            fuse,
            help: InsertionHelp::default(),
        }
    }

    /// Makes `submit` a scheduling point of the inserting thread (`on`) or not
    /// ([`InsertionHelp`]).
    pub(crate) fn with_help(mut self, on: bool) -> Self {
        self.help = InsertionHelp::new(on);
        self
    }

    /// A new copy, valid in a zeroed host buffer.
    fn new_copy(&self, bytes: usize) -> Arc<TileCopy> {
        TileCopy::host(bytes, &self.env)
    }

    /// This runtime's number, for [`CollectionDesc::in_runtime`].
    pub(crate) fn instance(&self) -> u64 {
        self.instance
    }

    /// Registers a collection (same order on every rank); allocates the tiles this rank owns.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when its directory entries cannot be allocated; the
    /// sequence is then unchanged.
    pub(crate) fn add_collection(&mut self, desc: Arc<CollectionDesc>) -> Result<()> {
        let d = desc.clone();
        let env = self.env.clone();
        let mut owned = 0u64;
        self.dir.add(desc, |i, j| {
            owned += d.tile_bytes(i, j) as u64;
            LocalTile::new(TileCopy::host(d.tile_bytes(i, j), &env))
        })?;
        self.hash = hash::fold(self.hash, hash::bytes(d.name.as_bytes()));
        for v in [d.m, d.n, d.mb, d.nb, d.elem_size] {
            self.hash = hash::fold(self.hash, v as u64);
        }
        self.footprint.add(owned);
        Ok(())
    }

    fn tag(&self, n: u64) -> i32 {
        (n % self.tag_modulus) as i32
    }

    /// The tag of the next transfer from this rank to `peer` (both sides number the transfers
    /// of an ordered pair in insertion order).
    fn next_send_tag(&mut self, peer: Rank) -> i32 {
        let n = self.sent[peer as usize];
        self.sent[peer as usize] += 1;
        self.tag(n)
    }

    /// The tag of the next transfer from `peer` to this rank.
    fn next_recv_tag(&mut self, peer: Rank) -> i32 {
        let n = self.received[peer as usize];
        self.received[peer as usize] += 1;
        self.tag(n)
    }

    /// Validates a task and returns the keys of its tiles (inline up to 8: no allocation per
    /// task) and its executing rank.
    fn validate(&self, task: &Task<'_>) -> Result<(SmallVec<[TileKey; 8]>, Rank)> {
        let mut keys = SmallVec::with_capacity(task.accesses.len());
        for a in task.accesses {
            let desc = self
                .dir
                .desc(a.coll)
                .filter(|d| d.runtime == a.runtime)
                .ok_or_else(|| {
                    FerryError::InvalidArgument(format!(
                        "task `{}`: its access to tile ({}, {}) names a collection of another runtime (one that was shut down?)",
                        task.class.name(),
                        a.i,
                        a.j
                    ))
                })?;
            let key = (a.coll, desc.index(a.i, a.j)? as u32);
            if keys.contains(&key) {
                return Err(FerryError::InvalidArgument(format!(
                    "task `{}` accesses tile ({}, {}) of `{}` twice",
                    task.class.name(),
                    a.i,
                    a.j,
                    desc.name
                )));
            }
            keys.push(key);
        }
        let exec = match task.on {
            Some(r) if r < 0 || r as usize >= self.size => {
                return Err(FerryError::InvalidArgument(format!(
                    "task `{}` placed on rank {r} of a {}-rank job",
                    task.class.name(),
                    self.size
                )))
            }
            Some(r) => r,
            None => {
                let first = task.accesses.iter().position(|a| a.mode.writes()).unwrap_or(0);
                match task.accesses.get(first) {
                    Some(a) => {
                        let desc = self.dir.desc(a.coll).expect("validated above");
                        desc.owner(a.i, a.j)
                    }
                    None => 0,
                }
            }
        };
        Ok((keys, exec))
    }

    /// Inserts one task. Errors leave the graph unchanged, except inside a replayed trace (see
    /// `graph/replay.rs`), where a task other than the recorded one fails the run.
    #[inline]
    pub(crate) fn insert(&mut self, task: &Task<'_>) -> Result<()> {
        let r = match self.tracing {
            Tracing::Off => self.analyse(task).map(drop),
            Tracing::Recording(_) => self.record(task),
            Tracing::Replaying(_) => self.replay(task),
            Tracing::Failed(id) => Err(FerryError::Poisoned(format!(
                "trace {id} failed to replay its recording"
            ))),
        };
        // Not while replaying: a replayed insertion is only a comparison with the recording,
        // so insertion is short and the graph hardly falls behind it (replays measured no
        // faster with the points).
        if self.help.on && !matches!(self.tracing, Tracing::Replaying(_)) {
            self.help.since += 1;
            if self.help.since >= HELP_EVERY {
                self.help.since = 0;
                self.run_ready();
            }
        }
        r
    }

    /// A scheduling point of the inserting thread: a progress pass and up to [`HELP_JOBS`] ready
    /// jobs, run as the worker one past the last (`TaskContext::worker`).
    fn run_ready(&self) {
        let d = &self.dispatch;
        let ran = d.spawner.help(d, d.counters.inserting_worker(), HELP_JOBS);
        if ran > 0 {
            d.counters
                .inserter_jobs
                .fetch_add(ran as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Inserts one task by the full analysis.
    fn analyse(&mut self, task: &Task<'_>) -> Result<Analysed> {
        let (keys, exec) = self.validate(task)?;
        self.analyse_validated(task, keys, exec)
    }

    /// [`Inserter::analyse`] of a task whose tiles' keys and executing rank [`Inserter::validate`]
    /// gave.
    fn analyse_validated(&mut self, task: &Task<'_>, keys: SmallVec<[TileKey; 8]>, exec: Rank) -> Result<Analysed> {
        // Blocks while the window is full: before the task counts, so an error ends the
        // sequence without it.
        self.window.admit(&self.dispatch.tracker, &self.dispatch.counters)?;
        let seq = self.seq;
        self.seq += 1;
        // This task's own hash (kept per task until the next `wait`, to name the first task the
        // ranks disagree on) folded into the running hash of the sequence.
        let mut h = hash::fold(0, task.class.inner.name_hash);
        h = hash::fold(h, exec as u64);
        for (a, k) in task.accesses.iter().zip(&keys) {
            h = hash::fold(h, (k.0 as u64) << 34 | (k.1 as u64) << 2 | a.mode as u64);
        }
        let shape_hash = h;
        self.note_task(task, seq, shape_hash, &keys, exec);

        // Inputs: bring the newest version of every read tile to the executing rank (into device
        // memory when the task will run on a device).
        let on_device = self.env.devices > 0 && task.class.has_gpu();
        // Small tiles the task reads from one other rank travel together (see `packable`).
        // A pack is one MPI message: a tile that would take it past an MPI count travels alone
        // (every rank decides alike, from the same sizes).
        let mut packs: Vec<(Rank, Vec<TileKey>, usize)> = Vec::new();
        for (a, &key) in task.accesses.iter().zip(&keys) {
            if !a.mode.reads() {
                continue;
            }
            match self.packable(key, exec) {
                Some((from, bytes)) => match packs.iter_mut().find(|(r, _, _)| *r == from) {
                    Some((_, v, total))
                        if ferry_transfer::packed::header_bytes(v.len() + 1) + *total + bytes
                            <= ferry_memory::data::MAX_TILE_BYTES =>
                    {
                        *total += bytes;
                        v.push(key);
                    }
                    Some(_) => self.bring(key, exec, on_device),
                    None => packs.push((from, vec![key], bytes)),
                },
                None => self.bring(key, exec, on_device),
            }
        }
        for (from, group, _) in packs {
            if group.len() == 1 {
                self.bring(group[0], exec, on_device);
            } else {
                self.bring_packed(&group, from, exec);
            }
        }
        if exec == self.rank {
            self.add_task(task, &keys, seq);
            self.record_op(Op::Run);
        }
        // Outputs: a new version, valid only on the executing rank.
        for (a, &key) in task.accesses.iter().zip(&keys) {
            if a.mode.writes() {
                self.dir.record_write(key, exec);
                if exec != self.rank {
                    // Our copy, if any, is stale now; its pending users keep their buffer.
                    self.set_local(key, None);
                    self.record_op(Op::Forget { key });
                }
            }
        }
        Ok(Analysed { keys, exec, shape_hash })
    }

    /// What insertion and replay alike do for a task: count it, fold its hash (its shape's,
    /// then its arguments) into the sequence's, keep its description for mismatch reports.
    #[inline]
    fn note_task(&mut self, task: &Task<'_>, seq: u64, shape_hash: u64, keys: &[TileKey], exec: Rank) {
        let mut h = shape_hash;
        for &x in task.args {
            h = hash::fold(h, x as u64);
        }
        self.hash = hash::fold(self.hash, h);
        self.epoch_hashes.push(h);
        // A new class, or another class of the same address (a test's, dropped): its name may be
        // new. (No class lives at address 0, so the first task always looks.)
        let class = (Arc::as_ptr(&task.class.inner) as usize, task.class.inner.name_hash);
        if class != self.last_class {
            self.names
                .entry(class.1)
                .or_insert_with(|| task.class.inner.name_arc.clone());
        }
        self.last_class = class;
        self.recent.push(Recent::new(seq, task, keys, exec));
    }

    /// Notes an action of the task being analysed, when a trace is recording.
    #[inline]
    fn record_op(&mut self, op: Op) {
        if let Tracing::Recording(r) = &mut self.tracing {
            r.op(op);
        }
    }

    /// Opens trace `id`: replays its recording when there is one and the tiles it reads before
    /// writing are as they were when it was recorded; else records it.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when a trace is open already (traces do not nest).
    pub(crate) fn begin_trace(&mut self, id: TraceId) -> Result<TraceMode> {
        if let Some(open) = self.tracing.id() {
            return Err(FerryError::InvalidArgument(format!(
                "trace {id} begun inside trace {open}: traces do not nest (end the open one first)"
            )));
        }
        if let Some(rec) = self.traces.get(&id) {
            let same = rec.entry.iter().all(|(key, writer, holders)| {
                let m = self.dir.meta(*key);
                m.writer == *writer && m.valid_on == *holders
            });
            if same {
                self.tracing = Tracing::Replaying(Replayer {
                    id,
                    rec: rec.clone(),
                    pos: 0,
                    held: Held::default(),
                });
                return Ok(TraceMode::Replay);
            }
        }
        self.tracing = Tracing::Recording(Box::new(Recorder::new(id)));
        Ok(TraceMode::Record)
    }

    /// Closes the open trace: keeps a recording (unless an insertion inside it failed), or ends
    /// a replay by setting the directory to the recorded exit state. Returns the trace's id and
    /// how it was taken, with the number of tasks it inserted.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when no trace is open; [`FerryError::TraceMismatch`] (also
    /// the run's error) when a replay inserted fewer tasks than its recording; a
    /// [`FerryError::Poisoned`] after a replay that failed.
    pub(crate) fn end_trace(&mut self) -> Result<(TraceId, TraceMode, usize)> {
        match std::mem::take(&mut self.tracing) {
            Tracing::Off => Err(FerryError::InvalidArgument("end_trace without an open trace".into())),
            Tracing::Recording(r) => {
                let Recorder {
                    id,
                    mut rec,
                    touched,
                    order,
                    failed,
                } = *r;
                let n = rec.len();
                if !failed {
                    rec.exit = order
                        .iter()
                        .map(|&key| {
                            let m = self.dir.meta(key);
                            (
                                (key, m.writer, m.valid_on.clone()),
                                m.version.wrapping_sub(touched[&key]),
                            )
                        })
                        .collect();
                    rec.fuse = self.fuse_plan(id, &rec);
                    self.traces.insert(id, Arc::new(rec));
                    self.dispatch.counters.trace_records.fetch_add(1, Relaxed);
                }
                Ok((id, TraceMode::Record, n))
            }
            Tracing::Replaying(mut rp) => {
                if rp.pos != rp.rec.len() {
                    let next = &rp.rec.tasks[rp.pos];
                    let e =
                        |s: &Self| replay::mismatch(rp.id, rp.pos, rp.rec.len(), Some(s.describe_recorded(next)), None);
                    self.dispatch.tracker.fail(e(self));
                    return Err(e(self));
                }
                if rp.rec.fuse.is_some() {
                    self.end_fused_replay(rp.id, &rp.rec, std::mem::take(&mut rp.held));
                }
                for ((key, writer, holders), writes) in &rp.rec.exit {
                    self.dir.restore(*key, *writes, *writer, holders);
                }
                self.dispatch.counters.replayed_tasks.fetch_add(rp.pos as u64, Relaxed);
                Ok((rp.id, TraceMode::Replay, rp.pos))
            }
            Tracing::Failed(id) => Err(FerryError::Poisoned(format!(
                "trace {id} failed to replay its recording"
            ))),
        }
    }

    /// Abandons the open trace, if any, because of `why` (its body failed, or the runtime shuts
    /// down with it open): a recording is dropped (the directory is consistent); a replay cut
    /// short fails the run (the directory is not, until the trace's end).
    pub(crate) fn abandon_trace(&mut self, why: &str) {
        match std::mem::take(&mut self.tracing) {
            Tracing::Off | Tracing::Failed(_) | Tracing::Recording(_) => {}
            Tracing::Replaying(rp) => {
                self.dispatch.tracker.fail(FerryError::TraceMismatch {
                    trace: rp.id,
                    detail: format!(
                        "{why} after {} of its {} tasks: the replay cannot be completed",
                        rp.pos,
                        rp.rec.len()
                    ),
                });
            }
        }
    }

    /// The open trace's id, if any.
    pub(crate) fn open_trace(&self) -> Option<TraceId> {
        self.tracing.id()
    }

    /// Drops every recording (the routes they were made under changed).
    pub(crate) fn forget_traces(&mut self) {
        self.traces.clear();
    }

    /// Inserts a task by the full analysis and records what it did on this rank.
    fn record(&mut self, task: &Task<'_>) -> Result<()> {
        // The directory's state of the tiles first touched here, before the analysis changes it.
        let (keys, exec) = match self.validate(task) {
            Ok(v) => v,
            Err(e) => return Err(self.recording_failed(e)),
        };
        let Tracing::Recording(r) = &mut self.tracing else {
            unreachable!("record() runs while recording")
        };
        for (a, &key) in task.accesses.iter().zip(&keys) {
            if r.touched.contains_key(&key) {
                continue;
            }
            let m = self.dir.meta(key);
            r.touched.insert(key, m.version);
            r.order.push(key);
            if a.mode.reads() {
                r.rec.entry.push((key, m.writer, m.valid_on.clone()));
            }
        }
        let first_op = r.rec.ops.len() as u32;
        match self.analyse_validated(task, keys, exec) {
            Ok(an) => {
                let Tracing::Recording(r) = &mut self.tracing else {
                    unreachable!("still recording")
                };
                let ops = first_op..r.rec.ops.len() as u32;
                r.rec.tasks.push(RecordedTask {
                    class: (task.class.inner.name_hash, task.class.has_gpu()),
                    on: task.on,
                    accesses: task.accesses.iter().copied().collect(),
                    keys: an.keys.iter().copied().collect(),
                    exec: an.exec,
                    shape_hash: an.shape_hash,
                    ops,
                    local_class: (an.exec == self.rank && self.fuse.is_some()).then(|| task.class.clone()),
                });
                Ok(())
            }
            Err(e) => Err(self.recording_failed(e)),
        }
    }

    /// An insertion inside a recording failed: the recording is not kept.
    fn recording_failed(&mut self, e: FerryError) -> FerryError {
        if let Tracing::Recording(r) = &mut self.tracing {
            r.failed = true;
        }
        e
    }

    /// Inserts a task by replaying the open trace's recording.
    fn replay(&mut self, task: &Task<'_>) -> Result<()> {
        // `Failed` while the ops run: should one of them panic, the trace is not left looking
        // closed over a directory that was never restored.
        let id = self.tracing.id().expect("replay() runs while replaying");
        let Tracing::Replaying(mut rp) = std::mem::replace(&mut self.tracing, Tracing::Failed(id)) else {
            unreachable!("replay() runs while replaying")
        };
        match self.replay_task(&mut rp, task) {
            Ok(()) => {
                self.tracing = Tracing::Replaying(rp);
                Ok(())
            }
            Err(e) => {
                self.tracing = Tracing::Failed(rp.id);
                Err(e)
            }
        }
    }

    fn replay_task(&mut self, rp: &mut Replayer, task: &Task<'_>) -> Result<()> {
        let rec = &*rp.rec;
        let Some(rt) = rec.tasks.get(rp.pos).filter(|rt| rt.matches(task)) else {
            let e = |s: &Self| {
                let recorded = rec.tasks.get(rp.pos).map(|rt| s.describe_recorded(rt));
                let got = replay::describe(task.class.name(), task.on, task.accesses);
                replay::mismatch(rp.id, rp.pos, rec.len(), recorded, Some(got))
            };
            self.dispatch.tracker.fail(e(self));
            return Err(e(self));
        };
        self.window.admit(&self.dispatch.tracker, &self.dispatch.counters)?;
        let seq = self.seq;
        self.seq += 1;
        self.note_task(task, seq, rt.shape_hash, &rt.keys, rt.exec);
        for i in rt.ops.start..rt.ops.end {
            match rec.ops[i as usize] {
                // A fused replay's transfers are parts of its task (`inserter/fuse.rs`).
                Op::Send { .. } | Op::Recv { .. } if rec.fuse.as_ref().is_some_and(|p| p.has_transfers()) => {}
                Op::Send { key, peer } => self.post_send(key, peer),
                Op::Recv { key, peer, to_device } => self.post_recv(key, peer, to_device),
                Op::SendPacked { keys, peer } => {
                    self.post_send_packed(&rec.packed[keys.0 as usize..keys.1 as usize], peer)
                }
                Op::RecvPacked { keys, peer } => {
                    self.post_recv_packed(&rec.packed[keys.0 as usize..keys.1 as usize], peer)
                }
                Op::Run => match &rec.fuse {
                    Some(plan) => rp.held.push(plan, task, seq),
                    None => self.add_task(task, &rt.keys, seq),
                },
                // A fused replay drops at once only the copies of tiles its parts have not
                // touched yet; the others after its task.
                Op::Forget { key } => {
                    if rec.fuse.as_ref().is_none_or(|p| p.forget_now.contains(&i)) {
                        self.set_local(key, None)
                    }
                }
            }
        }
        rp.pos += 1;
        Ok(())
    }

    /// A recorded task, described for a mismatch report.
    fn describe_recorded(&self, rt: &RecordedTask) -> String {
        let name = self.names.get(&rt.class.0).map_or("?", |n| &**n);
        replay::describe(name, rt.on, &rt.accesses)
    }

    /// Makes the newest version of `key` valid on `to`, posting a send here if this rank holds it
    /// and a receive here if this rank is `to`.
    fn bring(&mut self, key: TileKey, to: Rank, to_device: bool) {
        let meta = self.dir.meta(key);
        if meta.valid_on.contains(to) {
            return;
        }
        let from = meta.writer;
        if from == self.rank {
            self.post_send(key, to);
            self.record_op(Op::Send { key, peer: to });
        } else if to == self.rank {
            self.post_recv(key, from, to_device);
            self.record_op(Op::Recv {
                key,
                peer: from,
                to_device,
            });
        }
        self.dir.mark_valid(key, to);
    }

    /// Sends this rank's copy of `key` to `peer`, with the pair's next tag.
    fn post_send(&mut self, key: TileKey, peer: Rank) {
        let tag = self.next_send_tag(peer);
        self.add_send(key, peer, tag);
    }

    /// Receives the newest version of `key` from `peer`, with the pair's next tag.
    fn post_recv(&mut self, key: TileKey, peer: Rank, to_device: bool) {
        let tag = self.next_recv_tag(peer);
        self.add_recv(key, peer, tag, to_device);
    }

    /// The rank `key` would come from and the tile's bytes, when its transfer to `to` may be
    /// packed with others: the newest version is on another rank, the tile is at most the pack
    /// size, and the pair's route moves host memory (host or staged). Every rank decides alike:
    /// sizes, the directory, the routes and the pack size (the smallest over the ranks) are the
    /// same everywhere.
    fn packable(&self, key: TileKey, to: Rank) -> Option<(Rank, usize)> {
        let meta = self.dir.meta(key);
        let from = meta.writer;
        if meta.valid_on.contains(to) || self.pack_bytes == 0 || from == to {
            return None;
        }
        let desc = self.dir.desc(key.0)?;
        let (i, j) = desc.coords(key.1 as usize);
        let bytes = desc.tile_bytes(i, j);
        if bytes as u64 > self.pack_bytes {
            return None;
        }
        let peer = if from == self.rank {
            to
        } else if to == self.rank {
            from
        } else {
            // A third rank only updates the directory: the route does not matter.
            return Some((from, bytes));
        };
        matches!(
            self.dispatch.transport.routes.get(peer),
            ferry_transfer::route::Route::Host | ferry_transfer::route::Route::Staged
        )
        .then_some((from, bytes))
    }

    /// [`Inserter::bring`] for several tiles from `from` to `to` as one packed message (one tag).
    fn bring_packed(&mut self, keys: &[TileKey], from: Rank, to: Rank) {
        if from == self.rank {
            self.post_send_packed(keys, to);
            if let Tracing::Recording(r) = &mut self.tracing {
                let keys = r.packed(keys);
                r.op(Op::SendPacked { keys, peer: to });
            }
        } else if to == self.rank {
            self.post_recv_packed(keys, from);
            if let Tracing::Recording(r) = &mut self.tracing {
                let keys = r.packed(keys);
                r.op(Op::RecvPacked { keys, peer: from });
            }
        }
        for &key in keys {
            self.dir.mark_valid(key, to);
        }
    }

    /// Sends this rank's copies of `keys` to `to` as one message, with the pair's next tag.
    fn post_send_packed(&mut self, keys: &[TileKey], to: Rank) {
        let tag = self.next_send_tag(to);
        let mut copies = Vec::with_capacity(keys.len());
        for &key in keys {
            let lt = self
                .dir
                .local_mut(key)
                .as_mut()
                .expect("the writer of the newest version holds a copy");
            lt.prune();
            copies.push(lt.copy.clone());
        }
        let node = Node::new(Work::SendPacked { copies, peer: to, tag });
        let mut edges = Edges::new(&node);
        for &key in keys {
            let lt = self.dir.local_mut(key).as_mut().expect("checked above");
            lt.add_reader(&mut edges);
        }
        self.dispatch.tracker.add_one();
        self.dispatch.release(node);
    }

    /// Receives the newest versions of `keys` from `from` as one message, into fresh copies,
    /// with the pair's next tag.
    fn post_recv_packed(&mut self, keys: &[TileKey], from: Rank) {
        let tag = self.next_recv_tag(from);
        let copies: Vec<Arc<TileCopy>> = keys
            .iter()
            .map(|&key| {
                let desc = self.dir.desc(key.0).expect("valid key");
                let (i, j) = desc.coords(key.1 as usize);
                self.new_copy(desc.tile_bytes(i, j))
            })
            .collect();
        let node = Node::new(Work::RecvPacked {
            copies: copies.clone(),
            peer: from,
            tag,
        });
        for (&key, copy) in keys.iter().zip(copies) {
            self.set_local(key, Some(LocalTile::arriving(copy, &node)));
        }
        self.dispatch.tracker.add_one();
        self.dispatch.release(node);
    }

    /// Brings every tile whose newest version is away from its owner back home (at `wait`).
    pub(crate) fn bring_home(&mut self) {
        for key in self.dir.away() {
            let desc = self.dir.desc(key.0).expect("key from the directory");
            let (i, j) = desc.coords(key.1 as usize);
            let owner = desc.owner(i, j);
            self.bring(key, owner, false);
        }
    }

    fn add_send(&mut self, key: TileKey, peer: Rank, tag: i32) {
        let lt = self
            .dir
            .local_mut(key)
            .as_mut()
            .expect("the writer of the newest version holds a copy");
        lt.prune();
        let node = Node::new(Work::Send {
            copy: lt.copy.clone(),
            peer,
            tag,
        });
        lt.add_reader(&mut Edges::new(&node));
        lt.sends.push((node.clone(), self.dispatch.transport.ackable(peer)));
        self.dispatch.tracker.add_one();
        self.dispatch.release(node);
    }

    fn add_recv(&mut self, key: TileKey, peer: Rank, tag: i32, to_device: bool) {
        let desc = self.dir.desc(key.0).expect("valid key");
        let (i, j) = desc.coords(key.1 as usize);
        let copy = self.new_copy(desc.tile_bytes(i, j));
        let node = Node::new(Work::Recv {
            copy: copy.clone(),
            peer,
            tag,
            to_device,
        });
        self.set_local(key, Some(LocalTile::arriving(copy, &node)));
        self.dispatch.tracker.add_one();
        self.dispatch.release(node);
    }

    /// Replaces this rank's copy of `key`, keeping the footprint's count of live bytes.
    fn set_local(&mut self, key: TileKey, tile: Option<LocalTile>) {
        let added = tile.as_ref().map_or(0, |t| t.copy.bytes() as u64);
        let old = std::mem::replace(self.dir.local_mut(key), tile);
        let removed = old.map_or(0, |t| t.copy.bytes() as u64);
        self.footprint.add(added);
        self.footprint.live -= removed;
    }

    fn add_task(&mut self, task: &Task<'_>, keys: &[TileKey], seq: u64) {
        let mut tiles = TileArgs::with_capacity(keys.len());
        let mut task_bytes = 0u64;
        // Device acknowledgements: how many it could wait for (the unfinished sends that could
        // carry one, of the tiles it overwrites).
        let count_acks = self.dispatch.transport.device_acks();
        let mut ack_waits = 0u8;
        for (a, &key) in task.accesses.iter().zip(keys) {
            // What the task needs of the description, read out rather than cloning its `Arc`.
            let desc = self.dir.desc(key.0).expect("valid key");
            let (i, j) = (a.i, a.j);
            let bytes = desc.tile_bytes(i, j);
            let (rows, cols) = desc.tile_shape(i, j);
            let (elem, elem_name) = (desc.elem_type, desc.elem_name);
            task_bytes += bytes as u64;
            // Renaming: a write-only access to a tile that a send still reads writes a fresh
            // copy (the send keeps the old one), instead of waiting for the send to finish —
            // which, on the IPC route, means for the peer's acknowledgement: a round trip
            // between ranks on the path of every double-buffered halo. (`validate` refuses a
            // task that names a tile twice, so no other access of this task sees the old copy.)
            let rename = self.dispatch.rename_sent
                && a.mode == AccessMode::Write
                && self.dir.local_mut(key).as_mut().is_some_and(|lt| lt.sending());
            if rename {
                let c = self.new_copy(bytes);
                self.set_local(key, Some(LocalTile::new(c)));
                self.dispatch
                    .counters
                    .renamed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let fresh = self.dir.local(key).is_none().then(|| self.new_copy(bytes));
            if let Some(c) = &fresh {
                self.footprint.add(c.bytes() as u64);
            }
            let slot = self.dir.local_mut(key);
            // A write-only access to a tile this rank holds no copy of gets a fresh copy.
            let lt = slot.get_or_insert_with(|| LocalTile::new(fresh.expect("made when missing")));
            lt.prune();
            if count_acks && a.mode.writes() {
                ack_waits = ack_waits.saturating_add(lt.ack_waits(a.mode.is_part()));
            }
            if self.env.devices > 0 {
                lt.copy.lock().uses.push_back(seq);
            }
            tiles.push(TileArg {
                copy: lt.copy.clone(),
                rows,
                cols,
                mode: a.mode,
                elem,
                elem_name,
                coords: (i, j),
            });
        }
        let gpu = self.env.devices > 0 && task.class.has_gpu();
        self.footprint.task(task_bytes, gpu);
        // The host tier's prefetcher looks along the inserted sequence.
        if let Some(tier) = self.dispatch.transport.residency.tier() {
            let reads = tiles
                .iter()
                .filter(|t| t.mode.reads())
                .map(|t| Arc::downgrade(&t.copy))
                .collect();
            tier.note_insert(seq, reads);
        }
        let node = Node::new(Work::Task {
            class: task.class.clone(),
            tiles,
            args: TaskArgs::from_slice(task.args),
            seq,
            priority: task.priority,
            ack_waits,
            small: task_bytes <= super::dispatch::SPENT_MAX_BYTES,
        });
        // Edges straight from the directory's entries: collecting the predecessors first would
        // clone and drop each one's `Arc`, whose counts the workers finishing them also write.
        let mut edges = Edges::new(&node);
        for (a, &key) in task.accesses.iter().zip(keys) {
            let lt = self.dir.local_mut(key).as_mut().expect("created above");
            if a.mode.writes() {
                lt.add_writer(&mut edges, a.mode.is_part(), !gpu);
            } else {
                lt.add_reader(&mut edges);
            }
        }
        self.dispatch.tracker.add_one();
        self.dispatch.release(node);
    }

    /// Whether `class` is the class of the last task inserted (then the runtime, which keeps
    /// every class it has seen alive, has registered it: no other class can have its address).
    pub(crate) fn is_last_class(&self, class: &super::task::TaskClass) -> bool {
        self.last_class.0 == Arc::as_ptr(&class.inner) as usize
    }

    /// Starts a new epoch (after a successful `wait`): per-task hashes are kept per epoch.
    pub(crate) fn new_epoch(&mut self) {
        self.epoch_hashes.clear();
        self.epoch_start = self.seq;
    }

    /// This rank's description of task `seq`, if it is among the recent ones.
    pub(crate) fn describe_task(&self, seq: u64) -> Option<String> {
        self.recent.find(seq).map(|r| r.describe(&self.names, &self.dir))
    }

    /// Checks that `desc` is a collection of this runtime (a handle kept from a runtime that
    /// was shut down names a collection id this one may not have, or has with other tiles).
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] naming the collection.
    pub(crate) fn check_own(&self, desc: &Arc<CollectionDesc>) -> Result<()> {
        match self.dir.desc(desc.id) {
            Some(d) if Arc::ptr_eq(d, desc) => Ok(()),
            _ => Err(FerryError::InvalidArgument(format!(
                "collection `{}` belongs to another runtime (one that was shut down?)",
                desc.name
            ))),
        }
    }

    /// This rank's current copy of tile `key`, if it holds one.
    pub(crate) fn local_copy(&self, key: TileKey) -> Option<Arc<TileCopy>> {
        self.dir.local(key).map(|lt| lt.copy.clone())
    }
}

pub(crate) mod fuse;
#[cfg(test)]
mod tests;
