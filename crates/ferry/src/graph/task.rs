//! Task classes, the context a task body sees, and the task builder.

use super::cpu_graph::CpuGraph;
use crossbeam::utils::CachePadded;
use ferry_base::error::{Rank, TaskError};
use ferry_device::{CudaTaskContext, Kernel, TileView};
pub(crate) use ferry_memory::data::tile_arg::{TileArg, TileArgs};
use ferry_memory::data::Access;
use std::any::TypeId;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The CPU body of a task class.
pub type CpuBody = dyn Fn(&TaskContext<'_>) -> Result<(), TaskError> + Send + Sync;

/// The CUDA body of a task class: enqueues its kernels on [`CudaTaskContext::stream`] and
/// returns without synchronising (the GPU manager records an event after it).
pub use ferry_device::CudaBody;

pub(crate) struct ClassInner {
    pub(crate) name: String,
    /// The name again, shareable without allocating (worker status).
    pub(crate) name_arc: Arc<str>,
    pub(crate) name_hash: u64,
    pub(crate) cpu: Arc<CpuBody>,
    pub(crate) cuda: Option<Arc<CudaBody>>,
    /// Written by the workers at every task's end. On its own cache line, which also aligns the
    /// whole class so that the `Arc`'s counts (bumped per task by the inserting thread and the
    /// workers) sit on a line of their own: the fields above are read per inserted task, and
    /// sharing a line with counters that other cores write made each read a miss (`perf`
    /// located 7% of the inserting thread there).
    pub(crate) stats: CachePadded<ClassStats>,
    /// For the class of a fused replay (`graph/inserter/fuse.rs`): the classes of its tasks, in
    /// order, whose statistics its completions count (each task, an equal share of the time).
    pub(crate) parts: Vec<TaskClass>,
    /// For the class of a fused replay on a CPU rank: the graph its node launches on the
    /// workers (`graph/cpu_graph.rs`).
    pub(crate) cpu_graph: Option<Arc<CpuGraph>>,
}

/// A task class is what the device layer launches: it sees the class as a [`Kernel`], never
/// as a task.
impl Kernel for ClassInner {
    fn name(&self) -> &str {
        &self.name
    }

    fn run_cuda(&self, ctx: &CudaTaskContext<'_>) -> Option<Result<(), TaskError>> {
        self.cuda.as_ref().map(|body| body(ctx))
    }

    fn run_emulated(&self, tiles: &[TileView], args: &[i64], seq: u64, rank: Rank) -> Result<(), String> {
        run_cpu(&*self.cpu, tiles, args, seq, rank, usize::MAX)
    }
}

/// Per-class counters (the statistics' per-class table).
#[derive(Default)]
pub(crate) struct ClassStats {
    pub(crate) tasks: AtomicU64,
    pub(crate) busy_ns: AtomicU64,
}

/// A kind of task: a name and a CPU body. Cheap to clone.
///
/// Every rank must create its classes with the same names and insert the same tasks in the same
/// order (sequential task flow); the name enters the graph hash that `wait` compares across
/// ranks.
#[derive(Clone)]
pub struct TaskClass {
    pub(crate) inner: Arc<ClassInner>,
}

impl std::fmt::Debug for TaskClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TaskClass({})", self.inner.name)
    }
}

impl TaskClass {
    /// A class named `name` whose tasks run `body` on a CPU worker.
    ///
    /// The body receives a [`TaskContext`] with the task's tiles in access order. It returns an
    /// error to fail the task (and the run); a panic in the body is caught and reported the same
    /// way.
    pub fn new<F>(name: &str, body: F) -> TaskClass
    where
        F: Fn(&TaskContext<'_>) -> Result<(), TaskError> + Send + Sync + 'static,
    {
        TaskClass {
            inner: Arc::new(ClassInner {
                name: name.to_string(),
                name_arc: Arc::from(name),
                name_hash: ferry_base::hash::bytes(name.as_bytes()),
                cpu: Arc::new(body),
                cuda: None,
                stats: CachePadded::default(),
                parts: Vec::new(),
                cpu_graph: None,
            }),
        }
    }

    /// The same class with a GPU body: with devices, its tasks run on a GPU (the CUDA body on
    /// CUDA devices; on emulated devices the CPU body runs on the device copy, standing in for
    /// the kernel). Counters start afresh.
    pub fn with_cuda<F>(self, body: F) -> TaskClass
    where
        F: Fn(&CudaTaskContext<'_>) -> Result<(), TaskError> + Send + Sync + 'static,
    {
        self.derived(Some(Arc::new(body)), Vec::new())
    }

    /// A class of the same name and CPU body, with `cuda` and `parts`; counters start afresh.
    fn derived(&self, cuda: Option<Arc<CudaBody>>, parts: Vec<TaskClass>) -> TaskClass {
        let i = &self.inner;
        TaskClass {
            inner: Arc::new(ClassInner {
                name: i.name.clone(),
                name_arc: i.name_arc.clone(),
                name_hash: i.name_hash,
                cpu: i.cpu.clone(),
                cuda,
                stats: CachePadded::default(),
                parts,
                cpu_graph: i.cpu_graph.clone(),
            }),
        }
    }

    /// Whether the class has a GPU body.
    pub fn has_gpu(&self) -> bool {
        self.inner.cuda.is_some()
    }

    /// The class name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub(crate) fn record(&self, ns: u64) {
        if self.inner.parts.is_empty() {
            self.inner.stats.tasks.fetch_add(1, Relaxed);
            self.inner.stats.busy_ns.fetch_add(ns, Relaxed);
            return;
        }
        let share = ns / self.inner.parts.len() as u64;
        for p in &self.inner.parts {
            p.record(share);
        }
    }

    /// The class of a fused replay: its tasks' `parts`' statistics count its completions.
    pub(crate) fn with_parts(self, parts: Vec<TaskClass>) -> TaskClass {
        self.derived(self.inner.cuda.clone(), parts)
    }

    /// The class of a fused replay on a CPU rank, named `name`: its node launches `graph` on
    /// the workers (its CPU body runs the parts in order), and its completions count under the
    /// parts' classes, `parts`.
    pub(crate) fn fused_cpu(name: &str, graph: Arc<CpuGraph>, parts: Vec<TaskClass>) -> TaskClass {
        let g = graph.clone();
        let mut class = TaskClass::new(name, move |ctx| g.run_in_order(ctx)).with_parts(parts);
        Arc::get_mut(&mut class.inner).expect("a new class").cpu_graph = Some(graph);
        class
    }
}

/// A task to insert: class, accesses, and optional scalar arguments, placement and priority.
///
/// ```ignore
/// rt.submit(Task::new(&gemm, &[a.read(m, k), a.read(n, k), a.rw(m, n)]).args(&[k as i64]))?;
/// ```
#[derive(Debug, Clone)]
pub struct Task<'a> {
    pub(crate) class: &'a TaskClass,
    pub(crate) accesses: &'a [Access],
    pub(crate) args: &'a [i64],
    pub(crate) on: Option<Rank>,
    pub(crate) priority: i32,
}

impl<'a> Task<'a> {
    /// A task of `class` on `accesses` (tiles must be distinct), placed by owner-computes: on the
    /// owner of the first tile it writes, or of its first tile when it writes none.
    pub fn new(class: &'a TaskClass, accesses: &'a [Access]) -> Task<'a> {
        Task {
            class,
            accesses,
            args: &[],
            on: None,
            priority: 0,
        }
    }

    /// Scalar arguments the body reads with [`TaskContext::args`].
    pub fn args(mut self, args: &'a [i64]) -> Task<'a> {
        self.args = args;
        self
    }

    /// Critical-path hint. Ready tasks are admitted to a device highest priority first; a task
    /// with priority ≥ 2 also runs on the device's high-priority exec stream, ahead of queued
    /// lower-priority kernels (e.g. the panel of a factorization while the trailing update of
    /// the previous step is still running). Default 0.
    pub fn priority(mut self, priority: i32) -> Task<'a> {
        self.priority = priority;
        self
    }

    /// Runs the task on `rank` instead of the owner-computes choice.
    pub fn on(mut self, rank: Rank) -> Task<'a> {
        self.on = Some(rank);
        self
    }
}

/// A task's scalar arguments, inline up to 6: most tasks then cost no allocation for them, and
/// no free on the worker that finishes them (a cross-thread free for mimalloc).
pub(crate) type TaskArgs = ferry_device::LaunchArgs;

/// Runs `class`'s CPU body on `tiles`; returns the body's error or panic as text.
pub(crate) fn run_body(
    class: &TaskClass,
    tiles: &[TileView],
    args: &[i64],
    seq: u64,
    rank: Rank,
    worker: usize,
) -> Result<(), String> {
    run_cpu(&*class.inner.cpu, tiles, args, seq, rank, worker)
}

/// Runs a CPU body on `tiles` (host memory: a worker's, or an emulated device's copies).
fn run_cpu(
    body: &CpuBody,
    tiles: &[TileView],
    args: &[i64],
    seq: u64,
    rank: Rank,
    worker: usize,
) -> Result<(), String> {
    let ctx = TaskContext {
        tiles,
        args,
        seq,
        rank,
        worker,
        borrows: RefCell::new(smallvec::smallvec![0; tiles.len()]),
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&ctx))) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(p) => Err(format!("panicked: {}", ferry_base::error::panic_message(&*p))),
    }
}

/// One tile as raw memory ([`TaskContext::raw_tile`]).
#[derive(Debug, Clone, Copy)]
pub struct RawTile {
    /// Address of the first element (host memory for CPU bodies).
    pub ptr: *mut u8,
    /// Bytes of the tile's memory.
    pub bytes: usize,
    /// Rows of the tile (row-major, `cols` elements per row).
    pub rows: usize,
    /// Columns of the tile.
    pub cols: usize,
    /// Whether the access writes the tile.
    pub writable: bool,
}

/// What a task body gets: its tiles (in the order of its accesses), its arguments, and where it
/// runs.
///
/// Tiles are borrowed through [`TaskContext::tile`] and [`TaskContext::tile_mut`], which check the
/// element type, the access mode and aliasing at run time and return an error (never panic) on
/// misuse: a tile may be borrowed mutably once per body, and not both shared and mutably.
pub struct TaskContext<'a> {
    pub(crate) tiles: &'a [TileView],
    pub(crate) args: &'a [i64],
    pub(crate) seq: u64,
    pub(crate) rank: Rank,
    pub(crate) worker: usize,
    /// Per tile: 0 not borrowed, >0 shared borrows, -1 borrowed mutably.
    pub(crate) borrows: RefCell<smallvec::SmallVec<[i32; 8]>>,
}

impl<'a> TaskContext<'a> {
    /// Number of tiles (= accesses) of the task.
    pub fn num_tiles(&self) -> usize {
        self.tiles.len()
    }

    /// Scalar arguments given with [`Task::args`].
    pub fn args(&self) -> &[i64] {
        self.args
    }

    /// Position of this task in the inserted sequence (the same on every rank).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The rank running the task.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Index of the CPU worker running the task, `0..workers`; `workers` itself (one past the
    /// last, [`crate::Runtime::workers`]) when the inserting thread runs it at a scheduling
    /// point of `submit` (`FERRY_INSERTER_HELPS`). Per-worker scratch is indexed with
    /// `workers + 1` slots.
    pub fn worker(&self) -> usize {
        self.worker
    }

    /// `(rows, cols)` of tile `k`.
    ///
    /// # Errors
    /// When `k` is not an access index of the task.
    pub fn shape(&self, k: usize) -> Result<(usize, usize), TaskError> {
        let t = self.arg(k)?;
        Ok((t.rows, t.cols))
    }

    /// Tile coordinates `(i, j)` of access `k` in its collection.
    ///
    /// # Errors
    /// When `k` is not an access index of the task.
    pub fn coords(&self, k: usize) -> Result<(usize, usize), TaskError> {
        Ok(self.arg(k)?.coords)
    }

    fn arg(&self, k: usize) -> Result<&TileView, TaskError> {
        self.tiles
            .get(k)
            .ok_or_else(|| format!("tile index {k} out of range: the task has {} tiles", self.tiles.len()).into())
    }

    fn check_type<T: 'static>(&self, k: usize) -> Result<&TileView, TaskError> {
        let t = self.arg(k)?;
        if t.elem != TypeId::of::<T>() {
            return Err(format!(
                "tile {k} holds {} but was read as {}",
                t.elem_name,
                std::any::type_name::<T>()
            )
            .into());
        }
        Ok(t)
    }

    /// Tile `k` as raw memory, for bodies written in other languages (the C ABI): its address,
    /// bytes, shape and whether the task may write it. The memory stays valid, and is this task's
    /// alone for a writable tile, until the body returns; the element type and aliasing are not
    /// checked (Rust bodies use [`TaskContext::tile`] and [`TaskContext::tile_mut`]).
    ///
    /// # Errors
    /// When `k` is not an access index of the task.
    pub fn raw_tile(&self, k: usize) -> Result<RawTile, TaskError> {
        let t = self.arg(k)?;
        Ok(RawTile {
            ptr: t.ptr,
            bytes: t.bytes,
            rows: t.rows,
            cols: t.cols,
            writable: t.mode.writes(),
        })
    }

    /// Tile `k`, read-only: `rows × cols` elements. For a write-only access the contents are
    /// unspecified until the body writes them.
    ///
    /// # Errors
    /// Wrong element type, index out of range, or the tile is already borrowed mutably.
    pub fn tile<T: bytemuck::Pod>(&self, k: usize) -> Result<&[T], TaskError> {
        let t = self.check_type::<T>(k)?;
        let mut b = self.borrows.borrow_mut();
        if b[k] < 0 {
            return Err(format!("tile {k} is already borrowed mutably").into());
        }
        b[k] += 1;
        let len = (t.rows * t.cols * std::mem::size_of::<T>()).min(t.bytes);
        // SAFETY: the graph gives this task the copy for its duration (readers exclude writers);
        // `borrows` rules out a mutable alias within the body; the memory is 8-byte aligned.
        let bytes = unsafe { std::slice::from_raw_parts(t.ptr, len) };
        Ok(bytemuck::cast_slice(bytes))
    }

    /// Tile `k`, writable. Requires a `write` or `rw` access.
    ///
    /// # Errors
    /// Wrong element type, index out of range, a read-only access, or the tile is already
    /// borrowed.
    #[allow(clippy::mut_from_ref)]
    pub fn tile_mut<T: bytemuck::Pod>(&self, k: usize) -> Result<&mut [T], TaskError> {
        let t = self.check_type::<T>(k)?;
        if !t.mode.writes() {
            return Err(format!("tile {k} was declared read-only").into());
        }
        let mut b = self.borrows.borrow_mut();
        if b[k] != 0 {
            return Err(format!("tile {k} is already borrowed").into());
        }
        b[k] = -1;
        let len = (t.rows * t.cols * std::mem::size_of::<T>()).min(t.bytes);
        // SAFETY: the graph makes this task the only user of the copy while it runs (a writer
        // waits for all earlier readers and writers); `borrows` rules out a second alias.
        let bytes = unsafe { std::slice::from_raw_parts_mut(t.ptr, len) };
        Ok(bytemuck::cast_slice_mut(bytes))
    }
}
