//! The runtime: the user-facing API and shutdown; `start` brings a rank up, `builder` configures it.

mod builder;
mod collective;
mod devices;
mod estimate;
mod replay;
mod start;
mod started;
mod topology;
pub(crate) mod trace;
mod watchdog;

pub use builder::RuntimeBuilder;
pub use estimate::MemoryEstimate;
pub use topology::Topology;

use crate::config::Config;
use crate::graph::dispatch::{CpuJob, Dispatch};
use crate::graph::inserter::Inserter;
use crate::graph::{Task, TaskClass};
use crate::sched::Pool;
use crate::stats::Counters;
use crate::Access;
use ferry_base::error::{FerryError, Rank, Result};
use ferry_engine::{Engine, EngineHandle, MpiInfo};
use ferry_memory::data::buffer::TileBuf;
use ferry_memory::data::collection::CollectionDesc;
use ferry_memory::data::{Collection, Distribution};
use ferry_transfer::TransferPath;
use std::sync::{Arc, Mutex, MutexGuard};

struct Threads {
    pool: Pool<CpuJob>,
    /// The communication engine (its MPI progress thread), stopped last.
    engine: Option<Engine>,
    /// The GPU manager and the I/O thread.
    started: started::StartedThreads,
}

/// One rank's runtime: the MPI progress thread, the CPU workers, and the task graph.
///
/// Every rank creates the same collections and inserts the same tasks in the same order;
/// [`Runtime::wait`] returns when all of them have run on every rank. Dropping the runtime waits
/// for outstanding work, stops the threads and finalizes MPI.
pub struct Runtime {
    info: MpiInfo,
    config: Config,
    workers: usize,
    pub(crate) engine: EngineHandle,
    pub(crate) dispatch: Arc<Dispatch>,
    inserter: Mutex<Inserter>,
    classes: Mutex<Vec<TaskClass>>,
    counters: Arc<Counters>,
    device_names: Vec<String>,
    /// Pool bytes of each local device.
    device_capacity: Vec<u64>,
    /// Peer link ranks between local devices.
    device_links: Vec<Vec<Option<u32>>>,
    /// Where the threads were placed (`FERRY_BIND`), one line each.
    binding: Vec<String>,
    /// Whether idle threads yield their cores (`ferry_base::idle`).
    yield_when_idle: bool,
    /// Whether idle workers drive MPI progress (`FERRY_MPI_PROGRESS`).
    shared_progress: bool,
    /// Whether the inserting thread runs ready tasks between insertions (`FERRY_INSERTER_HELPS`).
    inserter_helps: bool,
    /// Disk tier budget, when the tier is on.
    disk_budget: Option<u64>,
    /// The registered host pool, when devices are in use.
    host_pool: Option<Arc<ferry_memory::data::host_pool::HostPool>>,
    watchdog: Mutex<Option<watchdog::Watchdog>>,
    threads: Mutex<Option<Threads>>,
    _trace: trace::TraceGuard,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Runtime(rank {} of {}, {} workers)",
            self.info.rank, self.info.size, self.workers
        )
    }
}

impl Runtime {
    /// A builder with the default configuration.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// Switches the payload path of every pair of ranks (as `FERRY_TRANSFER_PATH` does at
    /// start-up), for benchmarks and tests that compare paths within one run. Collective in
    /// effect: every rank must call it with the same value at the same point of the sequence,
    /// right after [`Runtime::wait`], when no transfer is in flight.
    ///
    /// # Errors
    /// [`FerryError::Config`] when some pair cannot use the path (the routes stay as they were);
    /// [`FerryError::InvalidArgument`] when work is still outstanding.
    pub fn set_transfer_path(&self, path: TransferPath) -> Result<()> {
        self.refuse_in_trace("set_transfer_path")?;
        if self.dispatch.tracker.outstanding() > 0 {
            return Err(FerryError::InvalidArgument(
                "set_transfer_path with work outstanding: call it right after wait()".into(),
            ));
        }
        self.dispatch.transport.routes.set(path)?;
        // Recordings hold the packing and comm-in decisions of the old routes.
        self.inserter_unchecked().forget_traces();
        Ok(())
    }

    /// Local work done so far and still to do: graph nodes (tasks, sends and receives) of this
    /// rank that have finished, and that are inserted but not finished. For progress displays;
    /// the total grows while tasks are being inserted.
    pub fn progress(&self) -> (u64, u64) {
        (self.dispatch.tracker.completed(), self.dispatch.tracker.outstanding())
    }

    /// This rank (`0..size`).
    pub fn rank(&self) -> Rank {
        self.info.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.info.size
    }

    /// This rank's index among the ranks of its node, and the number of such ranks.
    pub fn local_rank(&self) -> (usize, usize) {
        (self.info.local_rank, self.info.local_size)
    }

    /// Number of CPU workers of this rank.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The MPI library's version line.
    pub fn mpi_library(&self) -> &str {
        &self.info.library
    }

    /// The inserter, whatever the run's state: for checks that every rank must make alike
    /// (before a collective step) whether or not its own run has failed since the last `wait`.
    pub(crate) fn inserter_unchecked(&self) -> MutexGuard<'_, Inserter> {
        self.inserter.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn inserter(&self) -> Result<MutexGuard<'_, Inserter>> {
        // The flag first: the error's lock is not worth taking on every insertion.
        if self.dispatch.tracker.is_poisoned() {
            if let Some(e) = self.dispatch.tracker.error() {
                return Err(e);
            }
        }
        Ok(self.inserter.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn add_collection<T: 'static>(
        &self,
        name: &str,
        m: usize,
        n: usize,
        mb: usize,
        nb: usize,
        dist: Distribution,
    ) -> Result<Collection<T>> {
        self.refuse_in_trace("creating a collection")?;
        let mut ins = self.inserter()?;
        let id = ins.dir.len() as u32;
        let desc =
            Arc::new(CollectionDesc::new::<T>(id, name, m, n, mb, nb, dist, self.size())?.in_runtime(ins.instance()));
        if let Err(e) = ins.add_collection(desc.clone()) {
            // Only this rank ran out: the others go on. Recorded as the run's error too, so
            // that every rank's next `wait` fails (as for a failed task) rather than this rank
            // leaving the others in a collective.
            drop(ins);
            let recorded = match &e {
                FerryError::InvalidArgument(m) => FerryError::InvalidArgument(m.clone()),
                other => FerryError::Internal(other.to_string()),
            };
            self.dispatch.tracker.fail(recorded);
            return Err(e);
        }
        Ok(Collection::from_desc(desc))
    }

    /// An `m`×`n` matrix of `T` in square `nb`×`nb` tiles (ragged at the bottom and right edges),
    /// distributed by `dist`. Tiles this rank owns are allocated and zeroed now. Collective in
    /// the STF sense: every rank creates the same collections in the same order.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] for an empty shape, `nb` larger than the matrix, a tile
    /// over [`crate::MAX_TILE_BYTES`], more than [`crate::MAX_TILES`] tiles, a distribution that
    /// does not fit the job, or no memory for the tiles' directory entries (then also the run's
    /// error, on every rank's next `wait`).
    pub fn tiled_matrix<T: bytemuck::Pod>(
        &self,
        name: &str,
        m: usize,
        n: usize,
        nb: usize,
        dist: Distribution,
    ) -> Result<Collection<T>> {
        self.add_collection::<T>(name, m, n, nb, nb, dist)
    }

    /// An `m`×`n` grid of `T` in `mb`×`nb` tiles; like [`Runtime::tiled_matrix`] with
    /// rectangular tiles (a vector is an `n`×1 grid of `nb`×1 tiles).
    ///
    /// # Errors
    /// As [`Runtime::tiled_matrix`].
    pub fn tile_grid<T: bytemuck::Pod>(
        &self,
        name: &str,
        m: usize,
        n: usize,
        mb: usize,
        nb: usize,
        dist: Distribution,
    ) -> Result<Collection<T>> {
        self.add_collection::<T>(name, m, n, mb, nb, dist)
    }

    /// Inserts a task of `class` on `accesses`, placed by owner-computes. Shorthand for
    /// `submit(Task::new(class, accesses))`.
    ///
    /// # Errors
    /// As [`Runtime::submit`].
    pub fn insert(&self, class: &TaskClass, accesses: &[Access]) -> Result<()> {
        self.submit(Task::new(class, accesses))
    }

    /// Inserts a task. Returns at once: the task runs when its inputs are ready, on its rank.
    ///
    /// # Errors
    /// [`FerryError::TileOutOfBounds`], [`FerryError::InvalidArgument`] (a tile accessed twice,
    /// a collection of another runtime — a handle kept past its runtime's shutdown —, a
    /// placement outside the job), or the error that stopped the runtime.
    pub fn submit(&self, task: Task<'_>) -> Result<()> {
        let mut ins = self.inserter()?;
        if !ins.is_last_class(task.class) {
            self.register_class(task.class);
        }
        ins.insert(&task)
    }

    fn register_class(&self, class: &TaskClass) {
        let mut cs = self.classes.lock().unwrap_or_else(|p| p.into_inner());
        if !cs.iter().any(|c| Arc::ptr_eq(&c.inner, &class.inner)) {
            cs.push(class.clone());
            self.counters
                .class_names
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(class.inner.name_hash, class.inner.name_arc.clone());
        }
    }

    /// A copy of tile `(i, j)` of `coll`, read on its owner after [`Runtime::wait`].
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when this rank does not own the tile, work is still
    /// outstanding, a trace is open, or `coll` belongs to another runtime;
    /// [`FerryError::TileOutOfBounds`].
    pub fn tile<T: bytemuck::Pod>(&self, coll: &Collection<T>, i: usize, j: usize) -> Result<Vec<T>> {
        self.refuse_in_trace("a read of a tile")?;
        let ins = self.inserter()?;
        ins.check_own(&coll.desc)?;
        let idx = coll.desc.index(i, j)?;
        if coll.desc.owner(i, j) != self.rank() {
            return Err(FerryError::InvalidArgument(format!(
                "tile ({i}, {j}) of `{}` is owned by rank {}, not {}",
                coll.desc.name,
                coll.desc.owner(i, j),
                self.rank()
            )));
        }
        if self.dispatch.tracker.outstanding() > 0 {
            return Err(FerryError::InvalidArgument(
                "tasks are still running: call wait() before reading tiles".into(),
            ));
        }
        let copy = ins.local_copy((coll.desc.id, idx as u32)).ok_or_else(|| {
            FerryError::InvalidArgument(format!(
                "tile ({i}, {j}) of `{}` is not home: call wait() first",
                coll.desc.name
            ))
        })?;
        drop(ins);
        // Pinned so that the host tier does not evict what was just brought in.
        copy.lock().host_pins += 1;
        let staged = self.stage_to_host(&copy);
        let buf = copy.lock().host_buf(copy.bytes());
        copy.lock().host_pins -= 1;
        staged?;
        Ok(read_buf(&buf, coll.desc.tile_shape(i, j)))
    }

    /// Blocks until `copy` is valid in host memory (a stage-out by the GPU manager or a load
    /// from disk if needed).
    fn stage_to_host(&self, copy: &Arc<ferry_memory::data::copy::TileCopy>) -> Result<()> {
        if copy.lock().host_valid {
            return Ok(());
        }
        let (tx, rx) = crossbeam::channel::bounded(1);
        self.dispatch.transport.residency.to_host(
            vec![copy.clone()],
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv().map_err(|_| FerryError::ThreadLost("io"))??;
        Ok(())
    }

    /// What the tasks inserted so far need in memory on this rank, per tier (device, host,
    /// disk), against the capacities and budgets in force; see [`MemoryEstimate`]. Call it after
    /// inserting a graph (before or after [`Runtime::wait`]) to check that it can run here, e.g.
    /// `if !est.problems().is_empty() { ... }`.
    pub fn estimate_memory(&self) -> MemoryEstimate {
        let fp = self.inserter.lock().unwrap_or_else(|p| p.into_inner()).footprint;
        MemoryEstimate::new(
            fp,
            self.device_capacity.clone(),
            self.dispatch.transport.residency.tier().map(|t| t.limit),
            self.disk_budget,
        )
    }

    /// What this rank found at start-up: node, CPUs, devices and their peer links, the MPI
    /// library and whether it takes device pointers, the route to every other rank.
    pub fn topology(&self) -> Topology {
        let routes = &self.dispatch.transport.routes;
        Topology {
            rank: self.info.rank,
            size: self.info.size,
            local: (self.info.local_rank, self.info.local_size),
            host: self.info.host.clone(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            numa_nodes: topology::numa_nodes(),
            workers: self.workers,
            yield_when_idle: self.yield_when_idle,
            shared_progress: self.shared_progress,
            inserter_helps: self.inserter_helps,
            mpi_library: self.info.library.clone(),
            mpi_cuda_support: self.info.cuda_support,
            gpu_direct: routes.caps(self.info.rank).gpu_direct,
            devices: self.device_names.clone(),
            links: self.device_links.clone(),
            binding: self.binding.clone(),
            routes: (0..self.info.size as Rank)
                .filter(|&p| p != self.info.rank)
                .map(|p| {
                    (
                        p,
                        routes.caps(p).host.clone(),
                        format!("{:?}", routes.get(p)).to_lowercase(),
                    )
                })
                .collect(),
        }
    }

    /// Local devices, described (empty without devices).
    pub fn devices(&self) -> &[String] {
        &self.device_names
    }

    /// Waits for outstanding work, stops the workers and the MPI thread, and finalizes MPI.
    /// Tasks inserted since this rank last called [`Runtime::wait`] get that `wait` here (a
    /// collective, as every rank makes it), also after a failure when `FERRY_ABORT_ON_ERROR=0`,
    /// so that a program that gave up on one rank does not leave the others blocked in theirs.
    /// Called by `Drop`; call it yourself to see the error. After an error that may have left
    /// other ranks waiting, this ends the job with `MPI_Abort` (unless `FERRY_ABORT_ON_ERROR=0`).
    ///
    /// # Errors
    /// The error of the final wait, if any.
    pub fn shutdown(&self) -> Result<()> {
        let Some(mut threads) = self.threads.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Ok(());
        };
        // A trace left open (a body that panicked, a C program that never ended it): a recording
        // is dropped; a replay cut short fails the run, which takes the abort path below.
        self.inserter_unchecked().abandon_trace("the runtime shut down");
        // Tasks inserted since this rank last entered `wait` owe the other ranks that `wait`:
        // they make it for this epoch (SPMD), and a program that gave up early — at an
        // insertion refused after a failure, say — would leave them blocked in its agreements.
        // After a failure its outcome is this rank's error, already reported; and it is made
        // only without the abort below, which ends the others' waits itself (a rank stuck in a
        // body would never answer the agreement, and the abort would never come).
        let owed = {
            let ins = self.inserter_unchecked();
            ins.seq != ins.wait_entered
        };
        let result = if self.dispatch.tracker.is_poisoned() {
            if owed && !self.config.abort_on_error {
                let _ = self.wait();
            }
            Ok(())
        } else if owed || self.dispatch.tracker.outstanding() > 0 {
            self.wait()
        } else {
            Ok(())
        };
        let poisoned = self.dispatch.tracker.is_poisoned();
        self.watchdog.lock().unwrap_or_else(|p| p.into_inner()).take();
        if poisoned && self.config.abort_on_error {
            // A worker may be stuck in a body that will never return (that may be why the run
            // failed): end the job first, join nothing.
            if let Some(e) = threads.engine.take() {
                let _ = e.abort_job();
            }
        }
        threads.pool.stop();
        threads.started.stop();
        if let Some(e) = threads.engine.take() {
            if let Err(e) = e.finalize() {
                tracing::error!(error = %e, "ferry: the communication engine did not stop cleanly");
            }
        }
        result
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(error = %e, "ferry: error at shutdown");
        }
    }
}

fn read_buf<T: bytemuck::Pod>(buf: &TileBuf, (rows, cols): (usize, usize)) -> Vec<T> {
    // SAFETY: called only when no task or transfer is outstanding, so nobody writes the copy.
    let bytes = unsafe { buf.bytes() };
    bytemuck::cast_slice::<u8, T>(&bytes[..rows * cols * std::mem::size_of::<T>()]).to_vec()
}

#[cfg(test)]
mod tests {
    /// Frameworks share one runtime between their threads (and the C ABI keeps it in a global
    /// table): it must stay `Send + Sync`.
    #[test]
    fn runtime_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::Runtime>();
    }
}
