//! Start-up of one rank's runtime: MPI and its progress thread, tracing, the memory tiers, the
//! devices and the transfer routes between ranks, then the GPU manager, the I/O thread, the
//! workers (once the dispatcher they run with exists) and the watchdog.

use super::started::StartedThreads;
use super::{devices, trace, watchdog, Runtime, Threads};
use crate::config::Config;
use crate::graph::dispatch::Dispatch;
use crate::graph::inserter::Inserter;
use crate::graph::tracker::Tracker;
use crate::sched::{IdleWait, Pool};
use crate::stats::Counters;
use ferry_base::affinity;
use ferry_base::error::{panic_message, FerryError, Rank, Result};
use ferry_engine::{Engine, EngineHandle, MemKind, MpiInfo, PeerMapping, ProgressCounters, MEM_HANDLE_BYTES};
use ferry_transfer::bounce::BouncePool;
use ferry_transfer::mailbox::{self, Inbound, Mailbox};
use ferry_transfer::route::{Caps, Routes};
use ferry_transfer::DeviceAcks;
use ferry_transfer::{GpuDirect, IpcMap, TransferPath, Transport};
use std::sync::{Arc, Mutex};

impl Runtime {
    /// Starts one rank's runtime: MPI and its progress thread first (only MPI knows the
    /// node-local rank count that sizes the workers), then tracing, the memory tiers, the
    /// devices, the transfer routes, the GPU manager, the I/O thread, the workers and the
    /// watchdog, in that order.
    ///
    /// # Errors
    /// Whatever a step refuses (configuration, MPI, devices, threads); the MPI thread is
    /// stopped before the error returns, so that the process can exit.
    pub(super) fn start(mut config: Config) -> Result<Runtime> {
        config.validate()?;
        // Polling latencies: a rank that drives CUDA devices polls almost without napping (every
        // nap adds to each transfer's and each kernel's hand-off latency); others nap longer.
        let cuda = match config.devices {
            crate::DeviceSpec::Cuda | crate::DeviceSpec::CudaOrdinals(_) => true,
            crate::DeviceSpec::Auto => ferry_device::cuda::probe().is_ok(),
            _ => false,
        };
        config.progress_sleep_us.get_or_insert(if cuda { 1 } else { 50 });
        config.gpu_poll_us.get_or_insert(if cuda { 1 } else { 100 });
        // The engine's progress counters exist from its start; the rest of the rank's counters,
        // sized by the worker count that only MPI can tell (ranks per node), after.
        let engine = Engine::start(config.engine(cuda))?;
        let handle = engine.handle();
        let progress_counters = handle.progress_counters();
        let info = handle.mpi_info().clone();
        let (rank, size) = (info.rank, info.size);
        // A panic past this point must not leave the MPI thread running (a C caller, whose
        // `ferry_init` turns the panic into an error, would then hang at exit): catch it and
        // stop the thread like any other failure.
        let mut past_agreement = false;
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Self::start_after_mpi(config, handle.clone(), info, progress_counters, &mut past_agreement)
        }))
        .unwrap_or_else(|p| {
            Err(FerryError::Internal(format!(
                "start-up panicked: {}",
                panic_message(&*p)
            )))
        });
        match started {
            Ok(rt) => {
                if let Some(t) = rt.threads.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                    t.engine = Some(engine);
                }
                Ok(rt)
            }
            Err(e) => {
                // Every failure after this point leaves the MPI thread running: end it. A panic
                // may have struck this rank alone while the others wait for it in a start-up
                // collective, where finalizing would hang them (and this rank in Open MPI's
                // finalize fence): the job is aborted instead, with the error said first, since
                // the abort ends this process before the caller sees it. So is a failure past
                // the last start-up agreement (a thread that cannot start): the others are in
                // the clock synchronisation by then.
                let abort = (matches!(e, FerryError::Internal(_)) || past_agreement) && size > 1;
                if abort {
                    eprintln!("ferry: rank {rank}: {e}; aborting the job");
                }
                let _ = if abort { engine.abort_job() } else { engine.finalize() };
                Err(e)
            }
        }
    }

    /// [`Runtime::start`] once MPI is up.
    fn start_after_mpi(
        mut config: Config,
        engine: EngineHandle,
        info: MpiInfo,
        progress_counters: Arc<ProgressCounters>,
        past_agreement: &mut bool,
    ) -> Result<Runtime> {
        // `available_parallelism` honours the CPU set mpirun bound this rank to. The MPI thread
        // sleeps on its channel when idle and naps while waiting, so it gets no core of its own.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = config
            .workers
            .unwrap_or_else(|| (cores / info.local_size.max(1)).max(1));
        // What each rank sets up on its own (a trace file, the spill directory, the devices),
        // agreed on before the first collective: a rank that failed here alone would otherwise
        // leave the others waiting for it there.
        let local = (|| {
            let trace = trace::init(&config, info.rank)?;
            // Memory tiers: which are in use and their budgets (taking out the device tier
            // turns the devices off before they are opened).
            let plan = config.tier_plan(info.local_size, node_memory())?;
            if !plan.devices {
                config.devices = crate::DeviceSpec::None;
            }
            let disk = match &plan.disk {
                Some((dir, budget)) => Some(ferry_memory::tier::DiskStore::open(
                    dir,
                    *budget,
                    info.rank,
                    config.faults.disk_fail,
                )?),
                None => None,
            };
            let devices = devices::open(&config, &info)?;
            Ok((trace, plan, disk, devices))
        })();
        let (trace, plan, disk, mut devices) = agree(&engine, local)?;
        let ndev = devices.as_ref().map_or(0, |d| d.count());
        // Whether idle threads yield their cores (`ferry_base::idle`): the helpers on the
        // graph's critical path besides the workers are the inserting thread (sequential task
        // flow inserts while the tasks run), the progress thread when there are peers to hear
        // from, and the GPU manager when there are devices.
        let helpers = 1 + usize::from(info.size > 1) + usize::from(ndev > 0);
        let online = ferry_base::idle::online_cpus();
        let yield_when_idle = config
            .yield_when_idle
            .unwrap_or_else(|| ferry_base::idle::oversubscribed(workers, helpers, cores, online, info.local_size));
        if yield_when_idle {
            engine
                .set_yield_when_idle(true)
                .map_err(|e| FerryError::Config(format!("cannot reach the MPI thread: {e}")))?;
            if config.yield_when_idle.is_none() && info.rank == 0 {
                let per_rank = ferry_base::idle::cores_per_rank(cores, online, info.local_size);
                let helpers = match (info.size > 1, ndev > 0) {
                    (true, true) => ", the inserting thread, the MPI progress thread and the GPU manager",
                    (true, false) => ", the inserting thread and the MPI progress thread",
                    (false, true) => ", the inserting thread and the GPU manager",
                    (false, false) => " and the inserting thread",
                };
                let msg = format!(
                    "ferry: {} rank(s) on this node, {per_rank:.2} core(s) each, for {workers} worker(s){helpers}: \
                     idle threads yield their cores instead of spinning (FERRY_YIELD_WHEN_IDLE=off keeps them spinning)",
                    info.local_size
                );
                // A rank per core (or less) is the case worth a warning: fewer ranks per node
                // with more workers each would use the cores better. A rank whose default
                // workers fill its cores, beside a helper thread, is an ordinary set-up.
                if per_rank <= 1.0 {
                    tracing::warn!("{msg}; fewer ranks per node, with more workers each, use the cores better");
                } else {
                    tracing::info!("{msg}");
                }
            }
        }
        // Who drives MPI progress: where idle threads yield their cores, a progress thread
        // that needs a core to receive what a worker waits for costs each hop of the graph
        // context switches; idle workers drive it instead (`ferry_engine::ProgressShare`).
        let shared_progress = match config.shared_progress {
            Some(on) => on,
            None => yield_when_idle && info.size > 1,
        };
        let progress_share = if shared_progress {
            match engine.share_progress(std::time::Duration::from_micros(config.progress_backstop_us)) {
                Ok(share) => Some(share),
                // Every rank runs the same MPI library at the same threading level, so every
                // rank takes the same branch here.
                Err(e) if config.shared_progress.is_none() => {
                    if info.rank == 0 {
                        tracing::info!("MPI progress stays on its own thread: {e}");
                    }
                    None
                }
                Err(e) => {
                    return Err(FerryError::Config(format!(
                        "FERRY_MPI_PROGRESS=shared: {}",
                        FerryError::from(e)
                    )))
                }
            }
        } else {
            None
        };
        let host_pool = devices.as_ref().and_then(|d| d.host_pool.clone());
        // Transfer paths: what this rank can do, published to all; then the routes, the peer
        // pools mapped once, and the bounce pool.
        let bases = devices.as_ref().map(|d| d.bases()).unwrap_or_default();
        let device_capacity = devices.as_ref().map(|d| d.pool_bytes()).unwrap_or_default();
        let device_links = devices.as_ref().map(|d| d.links()).unwrap_or_default();
        let pci = devices.as_ref().map(|d| d.pci_addresses()).unwrap_or_default();
        let gpu_pci = pci.first().copied();
        let counters = Arc::new(Counters::new(workers, ndev, progress_counters));
        let TransferSetup {
            routes,
            ipc,
            peer_pools,
            bounce,
            mailbox,
            mirrors_seen,
        } = transfer_setup(&config, &info, &engine, pci, devices.as_mut(), &counters)?;
        // Whether this rank's devices publish signal mirrors (made as their pools were
        // exported, above) that every peer could map: only then may its offered sends ask for
        // device acknowledgements.
        let mirrored = mirrors_seen && devices.as_ref().is_some_and(|d| d.signal_mirrors());
        // Device acknowledgements only where some peer could take the IPC route (the route of
        // a pair may change at run time, `Routes::set`, but not whether it could): elsewhere
        // nothing would ask, and the graph's checks for them would cost every task.
        let ipc_peers = (0..info.size as Rank).any(|p| p != info.rank && routes.ipc_capable(p));
        // Every step that could fail on some ranks only has been agreed on; what fails now
        // (starting a thread) fails on one rank, and ends the job (see `start`).
        *past_agreement = true;
        let pinned = host_pool.clone();
        // From here on each thread started is held, and the runtime keeps them so: a failure or
        // a panic stops them all on the way out.
        let mut started = StartedThreads::default();
        started.peer_pools(peer_pools);
        let tracker = Arc::new(Tracker::new());
        let gpu_died = {
            let t = tracker.clone();
            Box::new(move |msg: String| t.fail(FerryError::Internal(format!("the GPU manager thread panicked: {msg}"))))
        };
        let (gpu, device_names) = match devices
            .map(|d| {
                d.start(
                    counters.clone(),
                    ferry_memory::manager::Options {
                        depth: config.device_queue_depth,
                        poll_us: config.gpu_poll_us.unwrap_or(100),
                        low_water: config.device_low_water,
                        offer_poll_us: config.offer_poll_us,
                        peer_copies: config.peer_copy,
                        phases: config.gpu_phases,
                        stream_affinity: config.stream_affinity,
                        skip_ack_wait: config.faults.skip_ack_wait,
                        yield_when_idle,
                    },
                    gpu_died,
                )
            })
            .transpose()
        {
            Ok(Some((h, j, names))) => {
                started.gpu(h.clone(), j);
                (Some(h), names)
            }
            Ok(None) => (None, Vec::new()),
            Err(e) => return Err(FerryError::Config(format!("cannot start the GPU manager: {e}"))),
        };
        // The control ring is read by the MPI thread, like every other message.
        if let Some(m) = &mailbox {
            m.set_waker(Box::new(engine.waker()));
            engine
                .add_poller(Box::new(ferry_transfer::mailbox::Reader(m.clone())))
                .map_err(|e| FerryError::Config(format!("cannot start the control ring: {e}")))?;
        }
        // Started once the dispatcher they run with exists (it is made with a spawner).
        // Declared after `started`: on a failure it is dropped, and its workers stopped, first.
        // A rank per core without devices (the workers have their cores, the helpers none):
        // the only thread that needs the workers' core for long is the inserting thread (the
        // progress thread's backstop wakes on a timer, and preempts a spinning worker). Idle
        // workers then spin while it sleeps on the graph and give way while it inserts.
        let idle_wait = if !yield_when_idle {
            IdleWait::Spin
        } else if config.yield_when_idle.is_none()
            && ndev == 0
            && workers as f64 <= ferry_base::idle::cores_per_rank(cores, online, info.local_size)
        {
            IdleWait::YieldToInserter(tracker.inserter_awake())
        } else {
            IdleWait::Yield
        };
        let mut pool = Pool::new(
            workers,
            counters.workers.iter().map(|w| w.naps.clone()).collect(),
            idle_wait,
            progress_share
                .clone()
                .map(|s| Arc::new(DriveProgress(s)) as Arc<dyn crate::sched::IdleWork>),
        );
        // A command posted while every worker is parked wakes one to drive the loop, instead of
        // waiting for the progress thread's next tick.
        if let Some(share) = &progress_share {
            share.set_waker(Box::new(pool.spawner().idle_waker()));
        }
        let host_tier = match plan.host_limit {
            Some(limit) => {
                let t = tracker.clone();
                match ferry_memory::tier::HostTier::start(
                    limit,
                    disk,
                    config.prefetch_tasks,
                    counters.memory.clone(),
                    Box::new(move |e| t.fail(e)),
                ) {
                    Ok((tier, join)) => {
                        tracing::info!(
                            rank = info.rank,
                            host_limit = limit,
                            spill = ?tier.disk.as_ref().map(|d| d.dir().to_path_buf()),
                            "host tier"
                        );
                        started.io(tier.clone(), join);
                        Some(tier)
                    }
                    Err(e) => return Err(FerryError::Config(format!("cannot start the I/O thread: {e}"))),
                }
            }
            None => None,
        };
        let transport = Arc::new(Transport::new(
            engine.clone(),
            gpu.clone(),
            routes,
            bounce,
            config.bounce_chunk,
            config.eager_bytes,
            ipc,
            bases,
            counters.memory.clone(),
            host_tier.clone(),
            {
                let tracker = tracker.clone();
                Arc::new(move |e| tracker.fail(e))
            },
            mailbox.clone(),
            config
                .device_ack
                .min_waits()
                .filter(|_| gpu.is_some() && ipc_peers)
                .map(|min| ferry_transfer::ack::AckWords::new(ndev, mirrored, min)),
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
            host_only: ndev == 0 && host_tier.is_none() && !ferry_base::debug::check_coherence(),
            devices: ndev,
            next_comm_in: std::sync::atomic::AtomicU64::new(ferry_memory::manager::COMM_IN_KEYS),
        });
        if let Err(e) = pool.start(dispatch.clone()) {
            return Err(FerryError::Config(format!("cannot start {workers} workers: {e}")));
        }
        // Every thread has started and recorded itself (`Pool::start` waits for the workers):
        // place them.
        let binding = if config.bind {
            affinity::bind(workers, gpu_pci, ndev > 0, (info.local_rank, info.local_size))
        } else {
            vec!["threads not bound (FERRY_BIND=none)".to_string()]
        };
        for line in &binding {
            tracing::info!(rank = info.rank, "placement: {line}");
        }
        let watchdog = match watchdog::Watchdog::start(
            watchdog::Watch {
                rank: info.rank,
                limit: std::time::Duration::from_secs(config.watchdog_s),
                abort_on_error: config.abort_on_error,
            },
            dispatch.tracker.clone(),
            counters.clone(),
            engine.clone(),
            gpu.clone(),
            mailbox,
        ) {
            Ok(w) => w,
            Err(e) => return Err(FerryError::Config(format!("cannot start the watchdog: {e}"))),
        };
        let release = gpu.as_ref().map(|g| g.release.clone());
        // GPU-direct: check once that device memory handed to MPI arrives intact.
        if ndev > 0 && dispatch.transport.routes.caps(info.rank).gpu_direct {
            let check = dispatch
                .transport
                .gpu_direct_self_check(info.rank, ndev, release.clone(), info.tag_ub);
            // Other ranks may already wait for this one: `start` ends the job rather than hang
            // it (a failure past the last agreement).
            check?;
        }
        if config.faults.start_fail {
            return Err(FerryError::Config(
                "start-up failed after every thread started (FERRY_FAULTS=start-fail:1)".into(),
            ));
        }
        let env = ferry_memory::data::copy::CopyEnv {
            devices: ndev,
            release,
            pool: host_pool,
            tier: host_tier.map(|t| t as Arc<dyn ferry_memory::data::budget::HostBudget>),
        };
        // Where idle workers give way to the inserting thread, the graph would otherwise run
        // only once insertion is over (`sched/help.rs`).
        let inserter_helps = config
            .inserter_helps
            .unwrap_or_else(|| dispatch.spawner.yields_to_inserter());
        let inserter = Inserter::new(
            info.rank,
            info.size,
            info.tag_ub,
            dispatch.clone(),
            env,
            config.submit_window,
            fuse_env(
                config.trace_graphs,
                ndev,
                dispatch.host_only,
                &device_capacity,
                &counters,
            ),
        )
        .with_help(inserter_helps);
        trace::sync_clocks(&engine)?;
        tracing::info!(rank = info.rank, size = info.size, workers, library = %info.library, "ferry runtime started");
        Ok(Runtime {
            info,
            config,
            workers,
            engine,
            dispatch,
            inserter: Mutex::new(inserter),
            classes: Mutex::new(Vec::new()),
            counters,
            threads: Mutex::new(Some(Threads {
                pool,
                engine: None,
                started,
            })),
            device_names,
            device_capacity,
            device_links,
            binding,
            yield_when_idle,
            shared_progress: progress_share.is_some(),
            inserter_helps,
            disk_budget: plan.disk.as_ref().map(|d| d.1),
            host_pool: pinned,
            watchdog: Mutex::new(Some(watchdog)),
            _trace: trace,
        })
    }
}

/// How this rank fuses replayed traces, if it does (`graph/inserter/fuse.rs`): as one CUDA
/// graph on a rank with one device; as a static graph on the workers on a rank whose copies keep
/// one host buffer for life (`host_only`); not with several devices, nor with `graphs` off.
fn fuse_env(
    graphs: bool,
    devices: usize,
    host_only: bool,
    capacity: &[u64],
    counters: &crate::stats::Counters,
) -> Option<crate::graph::inserter::fuse::FuseEnv> {
    use crate::graph::inserter::fuse::FuseEnv;
    match (graphs, devices) {
        (true, 1) => Some(FuseEnv::Gpu {
            max_bytes: capacity.iter().min().copied().unwrap_or(0) / 2,
            counters: counters.fused.clone(),
        }),
        (true, 0) if host_only => Some(FuseEnv::Cpu),
        _ => None,
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

/// Decides whether this rank hands device memory to MPI (`FERRY_GPU_DIRECT`).
///
/// # Errors
/// `on` with a library that does not report CUDA support.
fn gpu_direct(config: &Config, info: &MpiInfo, devices: usize) -> Result<bool> {
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
        // `GpuDirect` may gain settings in the transfer layer before this runtime knows them.
        other => return Err(FerryError::Config(format!("FERRY_GPU_DIRECT={other:?}: not supported by this runtime"))),
    })
}

/// What [`transfer_setup`] sets up.
struct TransferSetup {
    routes: Routes,
    /// The peers' pools attached for IPC.
    ipc: IpcMap,
    /// The engine's mappings of those pools: held until the GPU manager, which copies through
    /// them, has stopped.
    peer_pools: Vec<PeerMapping>,
    bounce: Option<Arc<BouncePool>>,
    /// The control rings.
    mailbox: Option<Arc<Mailbox>>,
    /// Every rank mapped the signal mirror of every peer pool that came with one (agreed on by
    /// all ranks): only then may offered sends ask for device acknowledgements under
    /// `FERRY_DEVICE_ACK=auto`.
    mirrors_seen: bool,
}

/// Per device, what this rank publishes for the node's peers to map its pool: the engine's
/// handle of the pool's registration (pool and signal area), then the handle of its signal
/// words' host mirror, if it has one; empty where the pool cannot be mapped by peers (not
/// registered, or not exported: its peers then take another route).
fn pool_handles(engine: &EngineHandle, d: &devices::Opened) -> Vec<Vec<u8>> {
    d.pool_allocations()
        .into_iter()
        .enumerate()
        .map(|(k, (base, len))| {
            let kind = MemKind::Device(d.engine_device(k) as u32);
            // SAFETY: the pool's whole allocation. The engine itself never reads or writes it (its
            // peers map it and copy through their GPU managers, as this rank's transfer protocol
            // tells them). The GPU manager frees it at shutdown, once every transfer is over,
            // and the registration ends with the engine just after.
            let registered = unsafe { engine.register(base as *mut u8, len as usize, kind) };
            let handle = match registered.and_then(|h| engine.exported(&h).map(|x| x.then_some(h))) {
                Ok(Some(h)) => h,
                Ok(None) => {
                    tracing::info!(device = k, "the device pool cannot be exported: no IPC with this rank");
                    return Vec::new();
                }
                Err(e) => {
                    tracing::info!(device = k, error = %e, "the device pool cannot be registered: no IPC with this rank");
                    return Vec::new();
                }
            };
            let mut out = handle.to_bytes().to_vec();
            out.extend(d.signal_mirror_export(k).unwrap_or_default());
            out
        })
        .collect()
}

/// Registers this rank's device pools with the engine, publishes its transfer capabilities,
/// plans the route to every peer, has the engine map the device pools of the node's other ranks
/// (once: opening a CUDA IPC handle costs ≈10 ms), allocates the bounce pool and connects the
/// control rings with the node's other ranks.
fn transfer_setup(
    config: &Config,
    info: &MpiInfo,
    engine: &EngineHandle,
    pci: Vec<(u32, u8, u8)>,
    mut devices: Option<&mut devices::Opened>,
    counters: &Arc<Counters>,
) -> Result<TransferSetup> {
    let ndev = devices.as_ref().map_or(0, |d| d.count());
    // This rank's inbound control rings exist before anyone learns where they are. Without
    // them this rank publishes none, and its peers stay on MPI with it.
    let inbound = if config.control_ring && info.local_size > 1 {
        mailbox::inbound(info.local_rank as u32, info.local_size as u32)
            .map_err(
                |e| tracing::warn!(rank = info.rank, error = %e, "control ring: none (control messages go over MPI)"),
            )
            .ok()
    } else {
        None
    };
    let mine = Caps {
        host: info.host.clone(),
        devices: ndev as u32,
        gpu_direct: gpu_direct(config, info, ndev)?,
        ipc: devices.as_ref().map(|d| pool_handles(engine, d)).unwrap_or_default(),
        pool_bytes: devices.as_ref().map(|d| d.pool_bytes()).unwrap_or_default(),
        chunk: config.bounce_chunk as u64,
        want: config.transfer_path,
        pack_bytes: config.pack_bytes as u64,
        pci,
        mailbox: inbound.as_ref().and_then(Inbound::caps),
        eager_bytes: config.eager_bytes as u64,
    };
    let bytes = postcard::to_allocvec(&mine).map_err(|e| FerryError::Config(format!("capabilities: {e}")))?;
    let all = engine.allgather(&bytes)?;
    let caps: Vec<Caps> = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            postcard::from_bytes(b)
                .map_err(|e| FerryError::Config(format!("rank {r} published unreadable transfer capabilities: {e}")))
        })
        .collect::<Result<_>>()?;
    let routes = Routes::plan(info.rank, caps, config.transfer_path)?;
    // Peers' pools mapped and the bounce pool registered: steps that can fail on one rank
    // alone (a mapping the driver refuses, pinned memory exhausted), agreed on before the
    // control rings' collective.
    let local = (|| {
        let mut ipc = IpcMap::default();
        let mut mappings = Vec::new();
        let mut mirrors_seen = true;
        if let Some(d) = devices.as_mut() {
            for peer in 0..info.size as Rank {
                if peer == info.rank || !routes.ipc_capable(peer) {
                    continue;
                }
                let pools = routes.caps(peer).pool_bytes.clone();
                for (pd, published) in routes.caps(peer).ipc.clone().iter().enumerate() {
                    let (handle, mirror) = published.split_at(published.len().min(MEM_HANDLE_BYTES));
                    let handle = engine.mem_handle(handle)?;
                    let pool_bytes = pools.get(pd).copied().unwrap_or(0);
                    let mirror = (!mirror.is_empty()).then_some(mirror);
                    let mut ids = Vec::with_capacity(ndev);
                    for local in 0..ndev {
                        // The engine maps it (and keeps the peer's registration alive while
                        // mapped); the GPU manager copies through the address on its own streams.
                        let mapping = engine.map_peer(&handle, d.engine_device(local))?;
                        if (mapping.len() as u64) < ferry_device::pool_allocation(pool_bytes) {
                            return Err(FerryError::Config(format!(
                                "rank {peer} published device {pd}'s pool of {pool_bytes} bytes, but registered only {}",
                                mapping.len()
                            )));
                        }
                        let id = d.ipc_attach(local, mapping.addr(), pool_bytes, mirror)?;
                        mappings.push(mapping);
                        // With device acknowledgements, the peer's offered sends ask for them,
                        // and this rank can take those only by seeing the peer's signals on the
                        // host: refused here, on every rank, rather than failing transfers.
                        if d.ipc_mirror_missing(id) {
                            if config.device_ack == DeviceAcks::On {
                                return Err(FerryError::Config(format!(
                                    "FERRY_DEVICE_ACK=on: the signal mirror of rank {peer}'s device {pd} cannot be mapped here (see the log; or set FERRY_DEVICE_ACK=auto or off)"
                                )));
                            }
                            mirrors_seen = false;
                        }
                        ids.push(id);
                    }
                    ipc.insert((peer, pd), ids);
                }
            }
        }
        let bounce = match devices.as_ref() {
            Some(d) => Some(Arc::new(d.bounce_pool(config.bounce_bytes, config.bounce_chunk)?)),
            None => None,
        };
        Ok((ipc, mappings, bounce, mirrors_seen))
    })();
    // Offered sends ask for device acknowledgements only where every consumer can hold their
    // pulls on the host: one rank that could not map a mirror turns that off on all (each
    // rank's flag travels in the agreement).
    let ((ipc, peer_pools, bounce, _), seen) = agree_sharing(engine, local, |(_, _, _, seen)| vec![u8::from(*seen)])?;
    let mirrors_seen = seen.iter().all(|b| b.first() == Some(&1));
    if !mirrors_seen && info.rank == 0 && config.device_ack.min_waits().is_some() {
        tracing::warn!(
            "device acknowledgements: a signal mirror could not be mapped on some rank (see its log); sends offered at launch go without"
        );
    }
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
    let mailbox = ferry_transfer::mailbox::connect(inbound, &routes, info.rank, info.size, engine, &counters.memory)?;
    if let Some(m) = &mailbox {
        tracing::info!(rank = info.rank, peers = ?m.peers(), "control ring");
    }
    Ok(TransferSetup {
        routes,
        ipc,
        peer_pools,
        bounce,
        mailbox: mailbox.map(Arc::new),
        mirrors_seen,
    })
}

/// Agrees on a start-up step that ranks take on their own: `Ok` only when it succeeded on
/// every rank. A rank that failed returns its own error; the others return
/// [`FerryError::Config`] naming the first rank that failed and its error. Collective.
///
/// # Errors
/// As above, or the allgather's MPI error.
fn agree<T>(engine: &EngineHandle, local: Result<T>) -> Result<T> {
    agree_sharing(engine, local, |_| Vec::new()).map(|(v, _)| v)
}

/// [`agree`], each rank also publishing `share` of its result: with every rank's share, in
/// rank order, in the same allgather.
///
/// # Errors
/// As [`agree`].
fn agree_sharing<T>(
    engine: &EngineHandle,
    local: Result<T>,
    share: impl Fn(&T) -> Vec<u8>,
) -> Result<(T, Vec<Vec<u8>>)> {
    let all = engine.agree(&local.as_ref().map(share).map_err(ToString::to_string))?;
    let v = local?;
    all.map(|shares| (v, shares))
        .map_err(|(r, msg)| FerryError::Config(format!("rank {r} could not start: {msg}")))
}

/// Idle workers drive the rank's MPI progress (a shared loop, `ferry_engine::ProgressShare`).
struct DriveProgress(ferry_engine::ProgressShare);

impl crate::sched::IdleWork for DriveProgress {
    fn run(&self) -> bool {
        matches!(self.0.try_pass(), Some(ferry_engine::Passed::Worked))
    }

    fn pending(&self) -> bool {
        self.0.pending()
    }

    fn queued(&self) -> bool {
        self.0.queued()
    }
}
