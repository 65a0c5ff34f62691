//! The runtime: builder, start-up and shutdown of the threads, and the user-facing API.

pub(crate) mod affinity;
mod builder;
mod collective;
mod devices;
mod estimate;
pub(crate) mod naps;
mod topology;
pub(crate) mod trace;
mod watchdog;

pub use builder::RuntimeBuilder;
pub use estimate::MemoryEstimate;
pub use topology::Topology;

use crate::comm::{self, Cmd, CommHandle, InitInfo};
use crate::config::Config;
use crate::data::buffer::TileBuf;
use crate::data::collection::CollectionDesc;
use crate::data::{Collection, Distribution};
use crate::error::{FerryError, Rank, Result};
use crate::graph::dispatch::{Dispatch, ReadyTask};
use crate::graph::inserter::Inserter;
use crate::graph::tracker::Tracker;
use crate::graph::{Task, TaskClass};
use crate::sched::Pool;
use crate::stats::Counters;
use crate::transfer::bounce::BouncePool;
use crate::transfer::route::{Caps, Routes};
use crate::transfer::{GpuDirect, IpcMap, TransferPath, Transport};
use crate::Access;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

struct Threads {
    pool: Pool<ReadyTask>,
    mpi: Option<JoinHandle<()>>,
    gpu: Option<JoinHandle<()>>,
    io: Option<JoinHandle<()>>,
}

/// One rank's runtime: the MPI progress thread, the CPU workers, and the task graph.
///
/// Every rank creates the same collections and inserts the same tasks in the same order;
/// [`Runtime::wait`] returns when all of them have run on every rank. Dropping the runtime waits
/// for outstanding work, stops the threads and finalizes MPI.
pub struct Runtime {
    info: InitInfo,
    config: Config,
    workers: usize,
    pub(crate) comm: CommHandle,
    pub(crate) dispatch: Arc<Dispatch>,
    inserter: Mutex<Inserter>,
    classes: Mutex<Vec<TaskClass>>,
    counters: Arc<Counters>,
    /// The MPI thread's counters (created before the worker count is known).
    mpi_counters: Arc<Counters>,
    device_names: Vec<String>,
    /// Pool bytes of each local device.
    device_capacity: Vec<u64>,
    /// Peer link ranks between local devices.
    device_links: Vec<Vec<Option<u32>>>,
    /// Where the threads were placed (`FERRY_BIND`), one line each.
    binding: Vec<String>,
    /// Disk tier budget, when the tier is on.
    disk_budget: Option<u64>,
    /// The registered host pool, when devices are in use.
    host_pool: Option<Arc<crate::data::host_pool::HostPool>>,
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

    fn start(mut config: Config) -> Result<Runtime> {
        config.validate()?;
        // Polling latencies: a rank that drives CUDA devices polls almost without napping (every
        // nap adds to each transfer's and each kernel's hand-off latency); others nap longer.
        let cuda = match config.devices {
            crate::DeviceSpec::Cuda | crate::DeviceSpec::CudaOrdinals(_) => true,
            crate::DeviceSpec::Auto => crate::device::cuda::probe().is_ok(),
            _ => false,
        };
        config.progress_sleep_us.get_or_insert(if cuda { 1 } else { 50 });
        config.gpu_poll_us.get_or_insert(if cuda { 1 } else { 100 });
        // The worker count depends on the node-local rank count, which only MPI knows; the MPI
        // thread therefore gets counters of its own before the workers' are sized.
        let mpi_counters = Arc::new(Counters::new(0, 0));
        let (comm, mpi_join, info) = comm::start(&config, mpi_counters.clone())?;
        // `available_parallelism` honours the CPU set mpirun bound this rank to. The MPI thread
        // sleeps on its channel when idle and naps while waiting, so it gets no core of its own.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = config
            .workers
            .unwrap_or_else(|| (cores / info.local_size.max(1)).max(1));
        let mut mpi_join = Some(mpi_join);
        let mut stop_mpi = |e: FerryError| {
            let _ = comm.post(Cmd::Shutdown { abort: false });
            if let Some(j) = mpi_join.take() {
                let _ = j.join();
            }
            e
        };
        let trace = match trace::init(&config, info.rank) {
            Ok(t) => t,
            Err(e) => return Err(stop_mpi(e)),
        };
        // Memory tiers: which are in use and their budgets (taking out the device tier turns
        // the devices off before they are opened).
        let plan = match config.tier_plan(info.local_size, node_memory()) {
            Ok(p) => p,
            Err(e) => return Err(stop_mpi(e)),
        };
        if !plan.devices {
            config.devices = crate::DeviceSpec::None;
        }
        let disk = match &plan.disk {
            Some((dir, budget)) => match crate::tier::DiskStore::open(dir, *budget, info.rank, config.faults.disk_fail)
            {
                Ok(d) => Some(d),
                Err(e) => return Err(stop_mpi(e)),
            },
            None => None,
        };
        let devices = match devices::open(&config, &info) {
            Ok(d) => d,
            Err(e) => return Err(stop_mpi(e)),
        };
        let mut devices = devices;
        let ndev = devices.as_ref().map_or(0, |d| d.count());
        let host_pool = devices.as_ref().and_then(|d| d.host_pool.clone());
        // Transfer paths: what this rank can do, published to all; then the routes, the peer
        // pools mapped once, and the bounce pool.
        let bases = devices.as_ref().map(|d| d.bases()).unwrap_or_default();
        let device_capacity = devices.as_ref().map(|d| d.pool_bytes()).unwrap_or_default();
        let device_links = devices.as_ref().map(|d| d.links()).unwrap_or_default();
        let pci = devices.as_ref().map(|d| d.pci_addresses()).unwrap_or_default();
        let gpu_pci = pci.first().copied();
        let (routes, ipc, bounce) = match transfer_setup(&config, &info, &comm, pci, devices.as_mut()) {
            Ok(x) => x,
            Err(e) => return Err(stop_mpi(e)),
        };
        let pinned = host_pool.clone();
        let counters = Arc::new(Counters::new(workers, ndev));
        let (gpu, gpu_join, device_names) = match devices
            .map(|d| {
                d.start(
                    counters.clone(),
                    crate::device::manager::Options {
                        depth: config.device_queue_depth,
                        poll_us: config.gpu_poll_us.unwrap_or(100),
                        low_water: config.device_low_water,
                        peer_copies: config.peer_copy,
                        phases: config.gpu_phases,
                        stream_affinity: config.stream_affinity,
                    },
                )
            })
            .transpose()
        {
            Ok(Some((h, j, names))) => (Some(h), Some(j), names),
            Ok(None) => (None, None, Vec::new()),
            Err(e) => {
                return Err(stop_mpi(FerryError::Config(format!(
                    "cannot start the GPU manager: {e}"
                ))))
            }
        };
        let pool = match Pool::start(workers) {
            Ok(p) => p,
            Err(e) => {
                return Err(stop_mpi(FerryError::Config(format!(
                    "cannot start {workers} workers: {e}"
                ))))
            }
        };
        // Every thread has started and recorded itself: place them.
        let binding = if config.bind {
            affinity::bind(workers, gpu_pci, ndev > 0, (info.local_rank, info.local_size))
        } else {
            vec!["threads not bound (FERRY_BIND=none)".to_string()]
        };
        for line in &binding {
            tracing::info!(rank = info.rank, "placement: {line}");
        }
        let tracker = Arc::new(Tracker::new());
        let (host_tier, io_join) = match plan.host_limit {
            Some(limit) => {
                let t = tracker.clone();
                match crate::tier::HostTier::start(
                    limit,
                    disk,
                    config.prefetch_tasks,
                    counters.clone(),
                    Box::new(move |e| t.fail(e)),
                ) {
                    Ok((tier, join)) => {
                        tracing::info!(
                            rank = info.rank,
                            host_limit = limit,
                            spill = ?tier.disk.as_ref().map(|d| d.dir().to_path_buf()),
                            "host tier"
                        );
                        (Some(tier), Some(join))
                    }
                    Err(e) => {
                        return Err(stop_mpi(FerryError::Config(format!(
                            "cannot start the I/O thread: {e}"
                        ))))
                    }
                }
            }
            None => (None, None),
        };
        let transport = Arc::new(Transport::new(
            comm.clone(),
            gpu.clone(),
            routes,
            bounce,
            config.bounce_chunk,
            config.eager_bytes,
            ipc,
            bases,
            counters.clone(),
            host_tier.clone(),
            {
                let tracker = tracker.clone();
                Arc::new(move |e| tracker.fail(e))
            },
        ));
        let dispatch = Arc::new(Dispatch {
            rank: info.rank,
            sched_jitter_us: config.faults.sched_jitter_us,
            spawner: pool.spawner(),
            transport,
            gpu: gpu.clone(),
            tracker,
            counters: counters.clone(),
            launch_ahead: config.launch_ahead,
            comm_in_ahead: config.comm_in_ahead,
            offer_at_launch: config.offer_at_launch,
            rename_sent: config.rename_sent,
            host_only: ndev == 0 && host_tier.is_none() && !crate::config::check_coherence(),
            devices: ndev,
            next_comm_in: std::sync::atomic::AtomicU64::new(crate::device::manager::COMM_IN_KEYS),
        });
        let watchdog = match watchdog::Watchdog::start(
            info.rank,
            std::time::Duration::from_secs(config.watchdog_s),
            dispatch.tracker.clone(),
            counters.clone(),
            comm.clone(),
            gpu.clone(),
        ) {
            Ok(w) => w,
            Err(e) => return Err(stop_mpi(FerryError::Config(format!("cannot start the watchdog: {e}")))),
        };
        let release = gpu.as_ref().map(|g| g.release.clone());
        // GPU-direct: check once that device memory handed to MPI arrives intact.
        if ndev > 0 && dispatch.transport.routes.caps(info.rank).gpu_direct {
            let check = dispatch
                .transport
                .gpu_direct_self_check(info.rank, ndev, release.clone(), info.tag_ub);
            if let Err(e) = check {
                // Other ranks may already wait for this one: end the job rather than hang it.
                let _ = comm.post(Cmd::Shutdown { abort: true });
                let _ = gpu.as_ref().map(|g| g.post(crate::device::manager::GpuCmd::Shutdown));
                return Err(stop_mpi(e));
            }
        }
        let env = crate::data::copy::CopyEnv {
            devices: ndev,
            release,
            pool: host_pool,
            tier: host_tier,
        };
        let inserter = Inserter::new(info.rank, info.size, info.tag_ub, dispatch.clone(), env);
        if let Err(e) = trace::sync_clocks(&comm) {
            return Err(stop_mpi(e));
        }
        tracing::info!(rank = info.rank, size = info.size, workers, library = %info.library, "ferry runtime started");
        Ok(Runtime {
            info,
            config,
            workers,
            comm,
            dispatch,
            inserter: Mutex::new(inserter),
            classes: Mutex::new(Vec::new()),
            counters,
            mpi_counters,
            threads: Mutex::new(Some(Threads {
                pool,
                mpi: mpi_join,
                gpu: gpu_join,
                io: io_join,
            })),
            device_names,
            device_capacity,
            device_links,
            binding,
            disk_budget: plan.disk.as_ref().map(|d| d.1),
            host_pool: pinned,
            watchdog: Mutex::new(Some(watchdog)),
            _trace: trace,
        })
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
        if self.dispatch.tracker.outstanding() > 0 {
            return Err(FerryError::InvalidArgument(
                "set_transfer_path with work outstanding: call it right after wait()".into(),
            ));
        }
        self.dispatch.transport.routes.set(path)
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
        let mut ins = self.inserter()?;
        let id = ins.dir.len() as u32;
        let desc = Arc::new(CollectionDesc::new::<T>(id, name, m, n, mb, nb, dist, self.size())?);
        ins.add_collection(desc.clone());
        Ok(Collection::from_desc(desc))
    }

    /// An `m`×`n` matrix of `T` in square `nb`×`nb` tiles (ragged at the bottom and right edges),
    /// distributed by `dist`. Tiles this rank owns are allocated and zeroed now. Collective in
    /// the STF sense: every rank creates the same collections in the same order.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] for an empty shape, `nb` larger than the matrix, a tile
    /// over [`crate::MAX_TILE_BYTES`], or a distribution that does not fit the job.
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
    /// an unknown collection, a placement outside the job), or the error that stopped the runtime.
    pub fn submit(&self, task: Task<'_>) -> Result<()> {
        let mut ins = self.inserter()?;
        self.register_class(task.class);
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
    /// [`FerryError::InvalidArgument`] when this rank does not own the tile or work is still
    /// outstanding; [`FerryError::TileOutOfBounds`].
    pub fn tile<T: bytemuck::Pod>(&self, coll: &Collection<T>, i: usize, j: usize) -> Result<Vec<T>> {
        let ins = self.inserter()?;
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
    fn stage_to_host(&self, copy: &Arc<crate::data::copy::TileCopy>) -> Result<()> {
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
    /// Called by `Drop`; call it yourself to see the error. After an error that may have left
    /// other ranks waiting, this ends the job with `MPI_Abort` (unless `FERRY_ABORT_ON_ERROR=0`).
    ///
    /// # Errors
    /// The error of the final wait, if any.
    pub fn shutdown(&self) -> Result<()> {
        let Some(mut threads) = self.threads.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Ok(());
        };
        let result = if self.dispatch.tracker.is_poisoned() {
            Ok(())
        } else if self.dispatch.tracker.outstanding() > 0 {
            self.wait()
        } else {
            Ok(())
        };
        let poisoned = self.dispatch.tracker.is_poisoned();
        self.watchdog.lock().unwrap_or_else(|p| p.into_inner()).take();
        if poisoned && self.config.abort_on_error {
            // A worker may be stuck in a body that will never return (that may be why the run
            // failed): end the job first, join nothing.
            let _ = self.comm.post(Cmd::Shutdown { abort: true });
            if let Some(j) = threads.mpi.take() {
                let _ = j.join();
            }
        }
        threads.pool.stop();
        if let (Some(g), Some(j)) = (&self.dispatch.gpu, threads.gpu.take()) {
            let _ = g.post(crate::device::manager::GpuCmd::Shutdown);
            let _ = j.join();
        }
        if let (Some(t), Some(j)) = (self.dispatch.transport.residency.tier(), threads.io.take()) {
            t.shutdown();
            let _ = j.join();
        }
        let _ = self.comm.post(Cmd::Shutdown {
            abort: poisoned && self.config.abort_on_error,
        });
        if let Some(j) = threads.mpi.take() {
            let _ = j.join();
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

/// Physical memory of the node in bytes (0 when the system does not say).
fn node_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages > 0 && size > 0 {
        pages as u64 * size as u64
    } else {
        0
    }
}

fn read_buf<T: bytemuck::Pod>(buf: &TileBuf, (rows, cols): (usize, usize)) -> Vec<T> {
    // SAFETY: called only when no task or transfer is outstanding, so nobody writes the copy.
    let bytes = unsafe { buf.bytes() };
    bytemuck::cast_slice::<u8, T>(&bytes[..rows * cols * std::mem::size_of::<T>()]).to_vec()
}

/// Decides whether this rank hands device memory to MPI (`FERRY_GPU_DIRECT`).
///
/// # Errors
/// `on` with a library that does not report CUDA support.
fn gpu_direct(config: &Config, info: &InitInfo, devices: usize) -> Result<bool> {
    let said = match info.cuda_support {
        Some(true) => "reports CUDA support",
        Some(false) => "reports no CUDA support (MPIX_Query_cuda_support() = 0)",
        None => "has no MPIX_Query_cuda_support",
    };
    Ok(match config.gpu_direct {
        GpuDirect::Off => false,
        GpuDirect::Auto => devices > 0 && info.cuda_support == Some(true),
        GpuDirect::Force => devices > 0,
        GpuDirect::On if info.cuda_support == Some(true) => devices > 0,
        GpuDirect::On => {
            return Err(FerryError::Config(format!(
                "FERRY_GPU_DIRECT=on, but the MPI library ({}) {said}: ferry never hands device pointers to an MPI that cannot take them. Use FERRY_GPU_DIRECT=force if this MPI is CUDA-aware at run time (e.g. Open MPI over a CUDA-enabled UCX), or off",
                info.library
            )))
        }
    })
}

/// Publishes this rank's transfer capabilities, plans the route to every peer, maps the device
/// pools of the node's other ranks (once: opening a CUDA IPC handle costs ≈10 ms) and allocates
/// the bounce pool.
fn transfer_setup(
    config: &Config,
    info: &InitInfo,
    comm: &CommHandle,
    pci: Vec<(u32, u8, u8)>,
    mut devices: Option<&mut devices::Opened>,
) -> Result<(Routes, IpcMap, Option<Arc<BouncePool>>)> {
    let ndev = devices.as_ref().map_or(0, |d| d.count());
    let mine = Caps {
        host: info.host.clone(),
        devices: ndev as u32,
        gpu_direct: gpu_direct(config, info, ndev)?,
        ipc: devices.as_ref().map(|d| d.ipc_handles()).unwrap_or_default(),
        pool_bytes: devices.as_ref().map(|d| d.pool_bytes()).unwrap_or_default(),
        chunk: config.bounce_chunk as u64,
        want: config.transfer_path,
        pack_bytes: config.pack_bytes as u64,
        pci,
    };
    let bytes = postcard::to_allocvec(&mine).map_err(|e| FerryError::Config(format!("capabilities: {e}")))?;
    let all = comm.allgather(bytes)?;
    let caps: Vec<Caps> = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            postcard::from_bytes(b)
                .map_err(|e| FerryError::Config(format!("rank {r} published unreadable transfer capabilities: {e}")))
        })
        .collect::<Result<_>>()?;
    let routes = Routes::plan(info.rank, caps, config.transfer_path)?;
    let mut ipc = IpcMap::new();
    if let Some(d) = devices.as_mut() {
        for peer in 0..info.size as Rank {
            if peer == info.rank || !routes.ipc_capable(peer) {
                continue;
            }
            for (pd, handle) in routes.caps(peer).ipc.clone().iter().enumerate() {
                let mut ids = Vec::with_capacity(ndev);
                for local in 0..ndev {
                    ids.push(d.ipc_open(local, handle)?);
                }
                ipc.insert((peer, pd), ids);
            }
        }
    }
    let bounce = match devices.as_ref() {
        Some(d) => Some(Arc::new(d.bounce_pool(config.bounce_bytes, config.bounce_chunk)?)),
        None => None,
    };
    // Ranks that share a GPU without MPS run their kernels in turns (time slices): two ranks on
    // one H100 took 4x the time of one rank for the slab stencil, and the same as one under MPS
    // (docs/tuning.md, "Ranks sharing a GPU"). Said once per GPU, by its lowest rank.
    let sharers: Vec<Rank> = (0..info.size as Rank)
        .filter(|&p| p != info.rank && routes.shares_gpu(p))
        .collect();
    if sharers.first().is_some_and(|&p| p > info.rank) && devices.as_ref().and_then(|d| d.mps_enabled()) == Some(false)
    {
        tracing::warn!(
            rank = info.rank,
            with = ?sharers,
            "ranks share a GPU without MPS: their kernels run in turns, not together; start `nvidia-cuda-mps-control -d` before mpirun, or run as many ranks as GPUs"
        );
    }
    if config.transfer_path != TransferPath::Auto || ndev > 0 {
        let summary: Vec<String> = (0..info.size as Rank)
            .filter(|&p| p != info.rank)
            .map(|p| {
                let shared = if routes.shares_gpu(p) { "(shared GPU)" } else { "" };
                format!("{p}:{:?}{shared}", routes.get(p))
            })
            .collect();
        tracing::info!(rank = info.rank, routes = %summary.join(" "), "transfer routes");
    }
    Ok((routes, ipc, bounce))
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
