//! The engine: start-up, registration, active messages, and the handle every operation goes
//! through. The one-sided protocol is in `one_sided.rs`, two-sided operations in `two_sided.rs`.

use crate::am::{AmMessage, Handlers};
use crate::am_rings::AmRings;
use crate::caps::{EngineCaps, PeerCaps, Route};
use crate::config::{Devices, EngineConfig, Progress};
use crate::delivery::Delivery;
use crate::error::{EngineError, Result};
use crate::handle::{MemHandle, MemKind};
use crate::lease::PeerLeases;
use crate::one_sided::Pending;
use crate::registry::{Publish, Registry};
use crate::staged::{EnginePoller, Staging};
use crate::stats::{Counters, EngineStats};
use crate::{wire, AM_MAX_PAYLOAD, AM_USER_TAGS};

/// The largest message on the active-message channel: a payload of [`AM_MAX_PAYLOAD`] bytes and
/// the engine's header around it (every rank receives into buffers of this size).
pub(crate) const AM_WIRE_MAX: usize = AM_MAX_PAYLOAD + 4096;

/// Free buffers of [`AM_WIRE_MAX`] bytes the active-message pool keeps (4.5 MB): enough for a
/// window of large messages in flight each way, past the receives posted ahead.
const AM_POOL_KEEP: usize = 64;
use crossbeam::channel::Receiver;
use ferry_base::error::{FerryError, Rank};
use ferry_base::node_rings::RingCaps;
use ferry_base::region::MemRegion;
use ferry_base::shm::ShmHandle;
use ferry_base::traffic::TrafficPath;
use ferry_comm::{
    AmBuf, AmPool, Channel, Cmd, CommConfig, CommCounters, CommHandle, Driver, GpuDirect, InitInfo, Passed,
    ProgressShare, Transfer,
};
use ferry_device::copier::{Copier, CudaCopier, EmulatedCopier};
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

/// Called once when an operation is over on this side, with its outcome.
pub type Completion = Box<dyn FnOnce(Result<()>) + Send>;

/// Payloads up to this size count as eager host traffic, larger ones as rendezvous.
const EAGER_BYTES: usize = 8 << 10;

/// How long finalize waits for device copies in flight (this rank's, and peers' under a lease).
const FINALIZE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Idle polls of a blocking engine call (a collective driven by the caller) before it starts
/// yielding its core between polls.
const SPINS_BEFORE_YIELD: u32 = 20_000;

/// Where the fields of a rank's start-up record lie: the job key (8), `bounce_chunk` (8),
/// GPU-direct (1), IPC (1), active messages (1), the lease table's handle, the active-message
/// rings' caps (zeros: none), then the host name.
const AM_AT: usize = 18;
const LEASES_AT: usize = AM_AT + 1;
const RINGS_AT: usize = LEASES_AT + ShmHandle::BYTES;
/// The single-copy route's pid (4; 0: off) and the address of its probe word (8).
const CMA_AT: usize = RINGS_AT + RingCaps::BYTES;
const HOST_AT: usize = CMA_AT + 12;

/// A notification that a one-sided operation delivers to the target's handler for `tag` once
/// the data has landed (PaRSEC's `r_tag` and `r_cb_data`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notify {
    /// The handler's tag on the target (below [`AM_USER_TAGS`]).
    pub tag: u16,
    /// Bytes handed to it (at most [`AM_MAX_PAYLOAD`]).
    pub bytes: Vec<u8>,
}

/// Operations in flight that the poller must keep the loop polling for.
#[derive(Default)]
pub(crate) struct InFlight {
    /// One-sided operations waiting for their peer (`Shared::pending`).
    pub(crate) pending: AtomicUsize,
    /// Ranges granted to peers' copies (`Shared::granted`).
    pub(crate) granted: AtomicUsize,
}

impl InFlight {
    pub(crate) fn any(&self) -> bool {
        self.pending.load(Ordering::Relaxed) > 0 || self.granted.load(Ordering::Relaxed) > 0
    }
}

/// The state every thread of the engine shares.
pub(crate) struct Shared {
    pub(crate) rank: Rank,
    pub(crate) size: usize,
    pub(crate) job: u64,
    pub(crate) comm: CommHandle,
    pub(crate) registry: Arc<Registry>,
    pub(crate) handlers: Handlers,
    pub(crate) delivery: Arc<Delivery>,
    /// One-sided operations waiting for their peer, by (peer, payload tag).
    pub(crate) pending: Mutex<FxHashMap<(Rank, u32), Pending>>,
    /// `pending.len()` and `granted.len()`, for the poller's every pass without taking the
    /// locks (or the engine's state).
    pub(crate) in_flight: Arc<InFlight>,
    next_tag: AtomicU32,
    /// Payload tags of one-sided operations are taken modulo this.
    data_tags: u32,
    pub(crate) two_sided_tags: u32,
    pub(crate) counters: Counters,
    pub(crate) comm_counters: Arc<CommCounters>,
    closed: AtomicBool,
    peers: Vec<PeerCaps>,
    pub(crate) info: InitInfo,
    /// The MPI progress loop, when the caller drives it ([`Progress::Caller`]).
    pub(crate) driver: Option<Mutex<Driver>>,
    /// The progress thread's loop, once any thread may drive it ([`Progress::Shared`], or
    /// [`EngineHandle::share_progress`]).
    pub(crate) share: OnceLock<ProgressShare>,
    /// Held while [`EngineHandle::share_progress`] asks the loop to share itself.
    pub(crate) share_lock: Mutex<()>,
    /// The device side of staged transfers, when this rank has devices.
    pub(crate) staging: Option<Mutex<Staging>>,
    /// Bytes per chunk of staged payloads (the same on every rank).
    pub(crate) bounce_chunk: usize,
    /// This rank hands device memory to MPI.
    gpu_direct: bool,
    /// Device memory is exported for peer copies (`EngineConfig::ipc`, with devices).
    pub(crate) ipc_enabled: bool,
    /// Buffers of active messages longer than [`ferry_comm::AM_COPY_OUT`], sent and received.
    am_pool: Arc<AmPool>,
    /// Active messages are received ([`EngineConfig::active_messages`]).
    active_messages: bool,
    /// Rings in shared memory that carry active messages to and from the node's peers
    /// (`am_rings.rs`), where the pairs use them.
    pub(crate) am_rings: Option<Arc<AmRings>>,
    /// Bytes of device memory the engine allocated, per device.
    pub(crate) device_used: Arc<Vec<std::sync::atomic::AtomicUsize>>,
    /// At most this many bytes of engine allocations per device (`EngineConfig::device_budget`).
    pub(crate) device_budget: Option<usize>,
    /// The devices' placement arenas (`arena.rs`).
    pub(crate) arenas: crate::arena::Arenas,
    /// The framework's placer, when it installed one (`placer.rs`).
    pub(crate) placer: crate::placer::PlacerSlot,
    /// The node's peers' lease tables, by rank (`lease.rs`; `None` without the IPC or the
    /// single-copy route).
    pub(crate) peer_leases: Vec<Option<Arc<PeerLeases>>>,
    /// Peer copies lease (`EngineConfig::ipc_leases`); else they always ask for a grant.
    pub(crate) ipc_leases: bool,
    /// The process of each peer that single copies reach (`cma.rs`), by rank.
    cma_pids: Vec<Option<i32>>,
    /// The smallest payload of a single copy (`EngineConfig::cma_min_bytes`).
    pub(crate) cma_min_bytes: usize,
    /// Ranges of this rank granted to peers' copies, until their release (`ipc.rs`).
    pub(crate) granted: Mutex<FxHashMap<(Rank, u32), crate::ipc::Granted>>,
}

/// A communication engine of one rank: it owns the progress thread and, through
/// [`std::ops::Deref`], offers every operation of [`EngineHandle`]. Dropping it finalizes it.
pub struct Engine {
    handle: EngineHandle,
    /// The progress thread ([`Progress::Thread`]).
    thread: Option<JoinHandle<()>>,
    /// Not finalized yet.
    running: bool,
}

/// The operations of an engine, from any thread, concurrently (see the crate documentation
/// for the threading contract). Cheap to clone; a handler that must answer (start a put, send
/// an active message) keeps one ([`Engine::handle`]). After the engine is finalized every
/// operation fails with [`EngineError::Finalized`].
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

impl std::ops::Deref for Engine {
    type Target = EngineHandle;
    fn deref(&self) -> &EngineHandle {
        &self.handle
    }
}

impl Engine {
    /// Starts the engine on every rank of the job (collective): its progress thread, which
    /// initialises MPI unless the caller has, the job's key for memory handles, and what every
    /// rank knows about its peers.
    ///
    /// # Errors
    /// [`EngineError::Comm`] with [`FerryError::MpiInit`] when MPI cannot be used (finalized
    /// already, initialised by the caller below `MPI_THREAD_MULTIPLE`, a communicator supplied
    /// without the caller initialising MPI), or a start-up exchange failed.
    pub fn start(cfg: EngineConfig) -> Result<Engine> {
        let comm_cfg = CommConfig {
            max_sends: cfg.max_sends.max(1),
            max_sends_per_peer: cfg.max_sends_per_peer.max(1),
            progress_sleep_us: cfg.progress_sleep_us,
            faults: cfg.faults,
            communicator: cfg.communicator,
            shareable: cfg.progress == Progress::Shared || cfg.share_later,
        };
        let comm_counters = Arc::new(CommCounters::default());
        let (comm, mut thread, mut driver, info) = match cfg.progress {
            Progress::Thread | Progress::Shared => {
                let (c, j, i) = ferry_comm::start(&comm_cfg, comm_counters.clone())?;
                (c, Some(j), None, i)
            }
            Progress::Caller => {
                let (c, d, i) = ferry_comm::start_driven(&comm_cfg, comm_counters.clone())?;
                (c, None, Some(d), i)
            }
        };
        // On a failure: the thread stopped here; a driver stops when dropped.
        let stop = |e: EngineError, thread: &mut Option<JoinHandle<()>>| {
            let _ = comm.post(Cmd::Shutdown { abort: false });
            if let Some(j) = thread.take() {
                let _ = j.join();
            }
            e
        };
        // What every rank must know of the others: the job's key (rank 0's, so handles of
        // another job or an earlier engine are refused), the chunk of staged payloads (which
        // both sides of a transfer count), whether it hands device memory to MPI, and its node.
        if cfg.bounce_chunk < 4096 {
            return Err(stop(
                EngineError::InvalidArgument(format!("bounce_chunk of {} bytes (at least 4096)", cfg.bounce_chunk)),
                &mut thread,
            ));
        }
        let gpu_direct = match cfg.gpu_direct {
            GpuDirect::On if info.cuda_support != Some(true) => {
                return Err(stop(
                    EngineError::NoDevices(format!(
                        "gpu_direct is On, but the MPI library does not report CUDA support (MPIX_Query_cuda_support: {:?}); use Force to trust it anyway, or Auto to stage",
                        info.cuda_support
                    )),
                    &mut thread,
                ))
            }
            GpuDirect::On | GpuDirect::Force => true,
            GpuDirect::Auto => info.cuda_support == Some(true),
            _ => false,
        };
        let copier: Option<Box<dyn Copier>> = match cfg.devices {
            Devices::None => None,
            Devices::Emulated(k) if k > 0 => Some(Box::new(EmulatedCopier::new(k).failing_pins(cfg.faults.pin_fail))),
            Devices::Emulated(_) => None,
            Devices::Auto => CudaCopier::new().ok().map(|c| Box::new(c) as Box<dyn Copier>),
            Devices::Cuda => match CudaCopier::new() {
                Ok(c) => Some(Box::new(c)),
                Err(e) => return Err(stop(EngineError::Device(e), &mut thread)),
            },
        };
        let copier = copier.map(|mut c| {
            c.keep_idle_mappings(cfg.ipc_keep_mappings);
            c
        });
        let staging = match copier.map(|c| Staging::new(c, cfg.bounce_chunk, cfg.bounce_slots)) {
            Some(Ok(st)) => Some(st),
            Some(Err(e)) => return Err(stop(e, &mut thread)),
            None => None,
        };
        // The single-copy route needs active messages (its reports, and the MPI route it
        // falls back to); peers may read this process's memory from now on (`cma.rs`).
        let cma = cfg.cma && cfg.active_messages && cfg!(target_os = "linux");
        if cma {
            ferry_base::cross_memory::allow_peers();
        }
        let publish = Publish {
            device: cfg.ipc && cfg.ipc_leases && staging.is_some(),
            host: cma,
        };
        // Exported device registrations and host registrations are published for the node's
        // peers (`lease.rs`); a table that cannot be made leaves peer copies to the grant
        // protocol and host memory to MPI.
        let leases = (publish.device || publish.host)
            .then(|| {
                crate::lease::LeaseTable::create()
                    .map_err(|e| {
                        tracing::info!("no lease table (peer copies take the grant protocol, host memory MPI): {e}")
                    })
                    .ok()
            })
            .flatten();
        let lease_handle = leases.as_ref().and_then(|t| t.handle());
        let mut mine = job_candidate(info.rank).to_le_bytes().to_vec();
        mine.extend_from_slice(&(cfg.bounce_chunk as u64).to_le_bytes());
        mine.push(u8::from(gpu_direct));
        mine.push(u8::from(cfg.ipc && staging.is_some()));
        mine.push(u8::from(cfg.active_messages));
        mine.extend_from_slice(&lease_handle.map_or([0u8; ShmHandle::BYTES], |h| h.to_bytes()));
        // Active-message rings with the node's peers (only with active messages, and several
        // ranks on this node), made before anyone can learn where they are.
        let ring_max = cfg.am_ring_max_bytes.min(AM_WIRE_MAX);
        let am_pool = AmPool::new(AM_WIRE_MAX, AM_POOL_KEEP);
        let inbound = (cfg.active_messages && cfg.am_rings)
            .then(|| AmRings::inbound(info.local_rank, info.local_size, ring_max))
            .flatten();
        let ring_caps = inbound.as_ref().and_then(|i| i.caps());
        mine.extend_from_slice(&ring_caps.map_or([0u8; RingCaps::BYTES], |c| c.to_bytes()));
        // The word the node's peers read to learn whether single copies reach this process: the
        // record's first 8 bytes, alive until the second allgather (below), after every probe.
        let probe: Box<[u8; 8]> = Box::new(mine[..8].try_into().expect("8 bytes"));
        let pid = if cma && leases.is_some() { std::process::id() } else { 0 };
        mine.extend_from_slice(&pid.to_le_bytes());
        mine.extend_from_slice(&(probe.as_ptr() as u64).to_le_bytes());
        mine.extend_from_slice(info.host.as_bytes());
        let all = match start_allgather(&comm, driver.as_mut(), mine) {
            Ok(a) => a,
            Err(e) => return Err(stop(e, &mut thread)),
        };
        if let Some((r, b)) = all
            .iter()
            .enumerate()
            .find(|(_, b)| b[8..16] != (cfg.bounce_chunk as u64).to_le_bytes())
        {
            let theirs = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
            return Err(stop(
                EngineError::InvalidArgument(format!(
                    "bounce_chunk differs between ranks: {} here, {theirs} on rank {r}",
                    cfg.bounce_chunk
                )),
                &mut thread,
            ));
        }
        // A rank without active messages would never receive its peers' (nor the requests of
        // their puts and gets): they hang instead of failing.
        if let Some(r) = all.iter().position(|b| b[AM_AT] != u8::from(cfg.active_messages)) {
            return Err(stop(
                EngineError::InvalidArgument(format!(
                    "active_messages differs between ranks: {} here, {} on rank {r}",
                    cfg.active_messages, !cfg.active_messages
                )),
                &mut thread,
            ));
        }
        let job = u64::from_le_bytes(all[0][..8].try_into().expect("8 bytes"));
        let (peers, cma_pids) = all
            .iter()
            .enumerate()
            .map(|(r, b)| {
                let direct = gpu_direct && b[16] == 1;
                let same_node = b[HOST_AT..] == *info.host.as_bytes();
                // Not with itself: CUDA cannot open an IPC handle in the process that exported it.
                let ipc = r != info.rank as usize && same_node && cfg.ipc && staging.is_some() && b[17] == 1;
                let their_pid = u32::from_le_bytes(b[CMA_AT..CMA_AT + 4].try_into().expect("4 bytes")) as i32;
                let probe_at = u64::from_le_bytes(b[CMA_AT + 4..HOST_AT].try_into().expect("8 bytes"));
                let cma = r != info.rank as usize
                    && same_node
                    && pid != 0
                    && their_pid != 0
                    && crate::cma::probe(their_pid, probe_at, &b[..8]);
                let mut routes = vec![Route::HostMpi];
                if cma {
                    routes.push(Route::Cma);
                }
                if ipc {
                    routes.push(Route::Ipc);
                }
                if staging.is_some() {
                    routes.push(if direct { Route::GpuDirect } else { Route::Staged });
                }
                let caps = PeerCaps {
                    rank: r as Rank,
                    same_node,
                    routes,
                    gpu_direct: direct,
                    ipc,
                    cma,
                };
                (caps, cma.then_some(their_pid))
            })
            .unzip::<_, _, Vec<PeerCaps>, Vec<Option<i32>>>();
        // The lease tables of the peers this rank copies to and from.
        let peer_leases = all
            .iter()
            .zip(&peers)
            .map(|(b, p): (&Vec<u8>, &PeerCaps)| {
                let h = ShmHandle::from_bytes(&b[LEASES_AT..RINGS_AT]).filter(|h| h.len > 0);
                match h {
                    Some(h) if (p.ipc && cfg.ipc_leases) || p.cma => PeerLeases::open(h)
                        .map_err(|e| tracing::info!(peer = p.rank, "lease table not mapped (grant protocol): {e}"))
                        .ok()
                        .map(Arc::new),
                    _ => None,
                }
            })
            .collect();
        // The pairs that use rings: each rank maps its node peers' rings, then all say which
        // they mapped (collective whenever active messages are on, rings or not, so that no
        // rank skips it), and a pair uses them when both mapped the other's.
        let am_rings = if cfg.active_messages {
            let candidates: Vec<(Rank, RingCaps)> = match &inbound {
                Some(_) => all
                    .iter()
                    .zip(&peers)
                    .filter(|(_, p): &(&Vec<u8>, &PeerCaps)| p.same_node && p.rank != info.rank)
                    .filter_map(|(b, p)| RingCaps::from_bytes(&b[RINGS_AT..CMA_AT]).map(|c| (p.rank, c)))
                    .filter(|(_, c)| c.handle.len > 0)
                    .collect(),
                None => Vec::new(),
            };
            let opened = inbound
                .as_ref()
                .map(|i| AmRings::open(i, &candidates))
                .unwrap_or_default();
            let list: Vec<u8> = opened.iter().flat_map(|(r, _, _)| r.to_le_bytes()).collect();
            let lists = match start_allgather(&comm, driver.as_mut(), list) {
                Ok(l) => l,
                Err(e) => return Err(stop(e, &mut thread)),
            };
            let mapped_me = |peer: Rank| {
                lists
                    .get(peer as usize)
                    .is_some_and(|b| b.chunks_exact(4).any(|c| c == info.rank.to_le_bytes()))
            };
            let pairs: Vec<_> = opened.into_iter().filter(|(r, _, _)| mapped_me(*r)).collect();
            inbound
                .and_then(|i| AmRings::new(i, pairs, info.size, ring_max, comm.clone(), am_pool.clone()))
                .map(Arc::new)
        } else {
            None
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let online = ferry_base::idle::online_cpus();
        let yield_when_idle = cfg
            .yield_when_idle
            .unwrap_or_else(|| ferry_base::idle::oversubscribed(1, 1, cores, online, info.local_size));
        if yield_when_idle {
            let _ = comm.post(Cmd::YieldWhenIdle(true));
        }
        // Shared progress: the loop goes behind a lock that any thread may take for a pass.
        let share = match cfg.progress {
            Progress::Shared => match comm.share_progress(
                cfg.backstop_us
                    .map_or(ferry_comm::SHARED_PROGRESS_TICK, std::time::Duration::from_micros),
            ) {
                Ok(s) => Some(s),
                Err(e) => return Err(stop(EngineError::from(e), &mut thread)),
            },
            _ => None,
        };
        let tag_ub = info.tag_ub.max(32767) as u32;
        let devices = staging.as_ref().map_or(0, |st| st.copier().devices());
        let shared = Arc::new(Shared {
            rank: info.rank,
            size: info.size,
            job,
            comm: comm.clone(),
            registry: Arc::new(Registry::new(info.rank, job, leases, publish)),
            peer_leases,
            ipc_leases: cfg.ipc_leases,
            cma_pids,
            cma_min_bytes: cfg.cma_min_bytes,
            handlers: Handlers::default(),
            delivery: Arc::new(Delivery::new(cfg.completions)),
            pending: Mutex::new(FxHashMap::default()),
            in_flight: Arc::default(),
            next_tag: AtomicU32::new(0),
            data_tags: tag_ub.min(1 << 24),
            two_sided_tags: tag_ub.saturating_add(1),
            counters: Counters::default(),
            comm_counters,
            closed: AtomicBool::new(false),
            peers,
            info,
            driver: driver.take().map(Mutex::new),
            share: share.map(OnceLock::from).unwrap_or_default(),
            share_lock: Mutex::new(()),
            staging: staging.map(Mutex::new),
            bounce_chunk: cfg.bounce_chunk,
            gpu_direct,
            granted: Mutex::new(FxHashMap::default()),
            device_used: Arc::new((0..devices).map(|_| std::sync::atomic::AtomicUsize::new(0)).collect()),
            device_budget: cfg.device_budget,
            arenas: crate::arena::Arenas::new(cfg.placement_arena, devices),
            placer: Default::default(),
            ipc_enabled: cfg.ipc && devices > 0,
            am_pool,
            active_messages: cfg.active_messages,
            am_rings,
        });
        let poller = EnginePoller {
            shared: Arc::downgrade(&shared),
            delivery: shared.delivery.clone(),
            in_flight: shared.in_flight.clone(),
            rings: shared.am_rings.clone(),
            ready: Vec::new(),
            staging_used: shared
                .staging
                .as_ref()
                .map(|st| st.lock().unwrap_or_else(|e| e.into_inner()).used()),
        };
        if let Err(e) = comm.post(Cmd::Poller(Box::new(poller))) {
            return Err(stop(e.into(), &mut thread));
        }
        let s = shared.clone();
        let listen = || {
            comm.post(Cmd::Listen {
                listener: Box::new(move |source, tag, bytes| s.on_active_message(source, tag, bytes)),
                pool: shared.am_pool.clone(),
            })
        };
        if let Err(e) = cfg.active_messages.then(listen).transpose() {
            return Err(stop(e.into(), &mut thread));
        }
        Ok(Engine {
            handle: EngineHandle { shared },
            thread,
            running: true,
        })
    }

    /// A handle on this engine's operations, for handlers and other threads.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stops the engine (not collective: call it after the operations every peer needs from
    /// this rank have completed, e.g. after a [`EngineHandle::barrier`]). Operations still in
    /// flight complete with an error; registrations and handlers end.
    ///
    /// # Errors
    /// [`EngineError::Comm`] when the progress thread had died.
    pub fn finalize(mut self) -> Result<()> {
        self.stop(false)
    }

    /// Ends the whole job with `MPI_Abort` instead of finalizing: for a rank that failed while
    /// its peers may be waiting for it in a collective, where finalizing would hang them (and
    /// this rank in the library's finalize). Operations in flight fail as in
    /// [`Engine::finalize`]. The MPI library ends the process; this returns only where it
    /// does not (a job of one rank, under some libraries).
    ///
    /// # Errors
    /// As [`Engine::finalize`].
    pub fn abort_job(mut self) -> Result<()> {
        self.stop(true)
    }

    fn stop(&mut self, abort: bool) -> Result<()> {
        if !std::mem::replace(&mut self.running, false) {
            return Ok(());
        }
        let shared = &self.handle.shared;
        shared.closed.store(true, Ordering::Release);
        let posted = shared.comm.post(Cmd::Shutdown { abort });
        let joined = match self.thread.take() {
            Some(join) => join.join().map_err(|_| ()),
            None => {
                if let Some(d) = &shared.driver {
                    d.lock().unwrap_or_else(|e| e.into_inner()).stop();
                }
                Ok(())
            }
        };
        // Operations whose peer never answered.
        let left: Vec<Pending> = {
            let mut p = shared.pending.lock().unwrap_or_else(|e| e.into_inner());
            shared.in_flight.pending.store(0, Ordering::Relaxed);
            p.drain().map(|(_, v)| v).collect()
        };
        for p in left {
            p.fail(EngineError::Finalized, &shared.delivery);
        }
        // Ranges granted to peers whose release never came.
        shared.granted.lock().unwrap_or_else(|e| e.into_inner()).clear();
        shared.in_flight.granted.store(0, Ordering::Relaxed);
        // No peer leases this rank's memory any more; copies of peers still running get a moment.
        let held = shared.registry.close_leases(FINALIZE_WAIT);
        if held > 0 {
            tracing::error!(
                pins = held,
                "peers were still copying from or into this rank's memory when its engine finalized"
            );
        }
        // This rank's own peer copies (leased ones are in no table): their completions end them
        // (and drop their pins on the peers' memory). One still running after the wait keeps
        // its memory: its completion is leaked, not run.
        if let Some(st) = &shared.staging {
            let running = Staging::finish_copies(st, FINALIZE_WAIT);
            if !running.is_empty() {
                tracing::error!(copies = running.len(), "device copies still running at finalize");
                std::mem::forget(running);
            }
        }
        shared.delivery.drain_all();
        // Handlers may hold handles on the engine: dropping them ends the cycle.
        shared.handlers.clear();
        posted?;
        joined.map_err(|_| EngineError::Comm(FerryError::ThreadLost("engine progress")))
    }
}

impl EngineHandle {
    /// Ends the whole job with `MPI_Abort`, from any thread and without waiting: for a thread
    /// that knows the rank cannot go on while the thread that owns the [`Engine`] never comes
    /// back to end it (stuck in a task body, say). The progress thread makes the call (with
    /// shared progress, whichever thread drives the loop next, its backstop at the latest);
    /// operations after this one fail as after [`Engine::abort_job`]. The MPI library ends the
    /// process; under some libraries a job of one rank goes on, and the owner's later
    /// [`Engine::finalize`] returns at once.
    ///
    /// # Errors
    /// As [`Engine::abort_job`], when the progress thread is gone.
    pub fn abort_job_now(&self) -> Result<()> {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.comm.post(Cmd::Shutdown { abort: true })?;
        Ok(())
    }

    /// This rank in the engine's communicator.
    pub fn rank(&self) -> Rank {
        self.shared.rank
    }

    /// Ranks in the engine's communicator.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// What the engine can do.
    pub fn capabilities(&self) -> EngineCaps {
        let i = &self.shared.info;
        EngineCaps {
            one_sided: true,
            two_sided: true,
            multithreaded: true,
            noncontiguous: false,
            cuda_aware_mpi: i.cuda_support,
            gpu_direct: self.shared.gpu_direct,
            devices: self
                .shared
                .staging
                .as_ref()
                .map_or(0, |st| st.lock().unwrap_or_else(|e| e.into_inner()).copier().devices()),
            device_kind: self.shared.staging.as_ref().map_or("none", |st| {
                st.lock().unwrap_or_else(|e| e.into_inner()).copier().kind()
            }),
            mpi_library: i.library.clone(),
            am_max_payload: AM_MAX_PAYLOAD,
            am_user_tags: AM_USER_TAGS,
            two_sided_tags: self.shared.two_sided_tags,
        }
    }

    /// What this rank knows about `peer`.
    ///
    /// # Errors
    /// [`EngineError::NoSuchPeer`] for a rank outside the job.
    pub fn peer(&self, peer: Rank) -> Result<PeerCaps> {
        self.shared.check_peer(peer)?;
        Ok(self.shared.peers[peer as usize].clone())
    }

    /// Registers `len` bytes of host memory at `ptr` that the caller allocated; the handle
    /// names it on every rank ([`MemHandle::to_bytes`]).
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay allocated until [`EngineHandle::unregister`] succeeds for it (or the
    /// engine is finalized), and must not be written by anyone else while an operation that
    /// reads or writes it is in flight (between its start and its completion).
    ///
    /// # Errors
    /// [`EngineError::InvalidArgument`] for a null pointer or 0 bytes;
    /// [`EngineError::Finalized`], [`EngineError::CallbackPanicked`].
    pub unsafe fn register(&self, ptr: *mut u8, len: usize, kind: MemKind) -> Result<MemHandle> {
        self.shared.check_open()?;
        self.shared.check_kind(ptr as u64, len, kind)?;
        // Device memory that peers of this node may copy is exported now, once: a grant then
        // costs no driver call (register early, not at transfer time).
        let export = match kind.device() {
            Some(_) if self.shared.ipc_enabled => self
                .shared
                .staging_or_error()?
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .copier_mut()
                .export(ptr as u64)
                .map_err(|e| tracing::info!("device memory at {ptr:p} cannot be exported for peer copies: {e}"))
                .ok(),
            _ => None,
        };
        self.shared.registry.add(ptr, len, kind, export)
    }

    /// Whether `h`, this rank's registration, was exported for peer copies: device memory, IPC
    /// on, the driver could export its allocation, and it is in this rank's lease table. Only
    /// then do the node's peers map it ([`EngineHandle::map_peer`]); otherwise their device
    /// payloads with it take the other routes (a peer copy may still be granted).
    ///
    /// # Errors
    /// [`EngineError::WrongOwner`] for another rank's handle; [`EngineError::NotRegistered`],
    /// [`EngineError::ForeignHandle`].
    pub fn exported(&self, h: &MemHandle) -> Result<bool> {
        Ok(self.shared.registry.pin(h, 0, h.len)?.export.is_some() && self.shared.registry.leased(h)?)
    }

    /// Registers memory the engine itself placed, whose kind is known and whose IPC export (if
    /// any) was derived from its allocation's: no driver call (placements in an arena).
    ///
    /// # Safety
    /// As [`EngineHandle::register`]; `kind` is the memory's, `export` its export.
    pub(crate) unsafe fn register_placed(
        &self,
        ptr: *mut u8,
        len: usize,
        kind: MemKind,
        export: Option<Vec<u8>>,
    ) -> Result<MemHandle> {
        self.shared.check_open()?;
        self.shared.registry.add(ptr, len, kind, export)
    }

    /// `len` bytes of device memory on `device`, from the engine (freed when the buffer drops);
    /// register it like any device memory. For tests, benchmarks and frameworks without an
    /// allocator of their own.
    ///
    /// # Errors
    /// [`EngineError::NoDevices`] without devices; [`EngineError::DeviceFull`] past
    /// `EngineConfig::device_budget`; [`EngineError::Device`] for an absent device or a failed
    /// allocation.
    pub fn alloc_device(&self, device: usize, len: usize) -> Result<DeviceBuffer> {
        self.shared.check_open()?;
        self.shared.alloc_device(device, len)
    }

    /// Bytes of placed memory in `device`'s placement arena now, and the arena's capacity
    /// (`(0, 0)` before its first placed get, without one, or for an absent device).
    pub fn placement_arena(&self, device: usize) -> (u64, u64) {
        self.shared.arenas.usage(device)
    }

    /// Copies `bytes` into device memory at `ptr` on `device`, and waits for the copy (a
    /// blocking helper for tests and benchmarks; not for a callback).
    ///
    /// # Safety
    /// `ptr..ptr + bytes.len()` is device memory of `device` that nothing else uses meanwhile.
    ///
    /// # Errors
    /// [`EngineError::NoDevices`], [`EngineError::Device`].
    pub unsafe fn device_write(&self, device: usize, ptr: u64, bytes: &[u8]) -> Result<()> {
        self.shared.device_copy(
            device,
            ferry_device::copier::CopyDir::HostToDevice,
            ptr,
            bytes.as_ptr() as *mut u8,
            bytes.len(),
        )
    }

    /// Copies device memory at `ptr` on `device` into `out`, and waits (see
    /// [`EngineHandle::device_write`]).
    ///
    /// # Safety
    /// As [`EngineHandle::device_write`].
    ///
    /// # Errors
    /// As [`EngineHandle::device_write`].
    pub unsafe fn device_read(&self, device: usize, ptr: u64, out: &mut [u8]) -> Result<()> {
        self.shared.device_copy(
            device,
            ferry_device::copier::CopyDir::DeviceToHost,
            ptr,
            out.as_mut_ptr(),
            out.len(),
        )
    }

    /// Ends the registration of `h`; its handle is refused from now on, on every rank.
    ///
    /// # Errors
    /// [`EngineError::Busy`] while operations on it are in flight (nothing changes);
    /// [`EngineError::NotRegistered`] for a handle already unregistered;
    /// [`EngineError::WrongOwner`] for another rank's handle.
    pub fn unregister(&self, h: &MemHandle) -> Result<()> {
        self.shared.registry.remove(h)
    }

    /// Decodes a handle that a peer shipped as bytes.
    ///
    /// # Errors
    /// [`EngineError::BadHandle`] for bytes that are not a handle, [`EngineError::ForeignHandle`]
    /// for one of another job.
    pub fn mem_handle(&self, bytes: &[u8]) -> Result<MemHandle> {
        MemHandle::decode(bytes, self.shared.job)
    }

    /// Registers the handler of active messages with `tag`. Messages that arrived for it before
    /// are delivered now, in their order.
    ///
    /// # Errors
    /// [`EngineError::TagOutOfRange`] for `tag ≥` [`AM_USER_TAGS`], [`EngineError::TagTaken`].
    pub fn register_handler(&self, tag: u16, handler: impl Fn(AmMessage) + Send + Sync + 'static) -> Result<()> {
        self.shared.check_open()?;
        self.shared.check_am()?;
        check_user_tag(tag)?;
        if self.shared.handlers.register(tag, Arc::new(handler))? {
            let s = self.shared.clone();
            self.shared
                .comm
                .post(Cmd::Run(Box::new(move || s.handlers.flush(tag, &s.delivery))))?;
        }
        Ok(())
    }

    /// Removes the handler of `tag`; its messages are held from now on until another is
    /// registered.
    ///
    /// # Errors
    /// [`EngineError::UnknownTag`] when none is registered.
    pub fn unregister_handler(&self, tag: u16) -> Result<()> {
        self.shared.handlers.unregister(tag)
    }

    /// Sends an active message to `peer`'s handler for `tag` (eager: the bytes are copied, and
    /// the call returns at once).
    ///
    /// # Errors
    /// [`EngineError::TagOutOfRange`], [`EngineError::PayloadTooLarge`],
    /// [`EngineError::NoSuchPeer`], [`EngineError::Finalized`].
    pub fn send_am(&self, tag: u16, peer: Rank, bytes: &[u8]) -> Result<()> {
        self.shared.check_open()?;
        check_user_tag(tag)?;
        check_payload(bytes.len())?;
        self.shared.check_peer(peer)?;
        self.shared.post_am_bytes(peer, i32::from(tag), bytes)?;
        Counters::add(&self.shared.counters.am_sent, 1);
        Ok(())
    }

    /// Gathers `bytes` from every rank, in rank order, on every rank (collective; blocks the
    /// calling thread). Frameworks use it to exchange memory handles at start-up.
    ///
    /// # Errors
    /// [`EngineError::Comm`] when the exchange fails.
    pub fn allgather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.shared.check_open()?;
        if self.loop_waits() {
            return Ok(self.shared.comm.allgather(bytes.to_vec())?);
        }
        let rx = self.shared.comm.allgather_start(bytes.to_vec())?;
        self.wait_reply(&rx)
    }

    /// Whether a blocking call waits the communication layer's way: the loop has a thread of
    /// its own (shared or not) and no callback waits for the caller's `progress`. That wait
    /// drives a shared loop while it has work and sleeps a tick at a time while others drive
    /// it, instead of spinning on a core the tasks it waits for may need.
    pub(crate) fn loop_waits(&self) -> bool {
        self.shared.driver.is_none() && self.shared.delivery.mode() == crate::Completions::ProgressThread
    }

    /// Waits for the progress loop's reply on `rx`, driving the loop meanwhile when callers
    /// drive it ([`Progress::Caller`], or a shared loop).
    pub(crate) fn wait_reply<T>(&self, rx: &Receiver<ferry_base::error::Result<T>>) -> Result<T> {
        if self.shared.driver.is_none() && self.shared.share.get().is_none() {
            return wait_reply(rx, None);
        }
        wait_reply(rx, Some(&mut || self.progress() > 0))
    }

    /// Blocks until every rank has called it (collective).
    ///
    /// # Errors
    /// As [`EngineHandle::allgather`].
    pub fn barrier(&self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }

    /// Progresses the engine on this thread: with [`Progress::Caller`] or [`Progress::Shared`],
    /// one pass of the MPI progress loop (none when another thread is in one), whose callbacks
    /// run here; then the callbacks queued for the caller ([`crate::Completions::Caller`]).
    /// Returns 1 if the pass found work, plus the queued callbacks run (0 when nothing
    /// happened). One pass, not a drain: a caller waiting for a reply checks for it after the
    /// pass that brought it instead of after one more pass that finds nothing (about a sixth
    /// of a short active message's round trip in `engine-bench`). Must not be called from a
    /// callback that itself runs inside a pass.
    pub fn progress(&self) -> usize {
        let mut n = 0;
        if let Some(d) = &self.shared.driver {
            if let Ok(mut d) = d.try_lock() {
                if d.pass() == Passed::Worked {
                    n += 1;
                }
            }
        } else if let Some(s) = self.shared.share.get() {
            if s.try_pass() == Some(Passed::Worked) {
                n += 1;
            }
        }
        n + self.shared.delivery.drain()
    }

    /// What this rank's engine has done so far.
    pub fn stats(&self) -> EngineStats {
        let mappings = self
            .shared
            .staging
            .as_ref()
            .map_or(0, |st| st.lock().unwrap_or_else(|e| e.into_inner()).copier().mappings());
        self.shared
            .counters
            .snapshot(self.shared.registry.count(), self.shared.handlers.held(), mappings)
    }

    /// What is in flight, for hang reports: the one-sided operations waiting for their peer,
    /// and what the progress thread has posted (`None` from it when it does not answer within
    /// a second).
    pub fn report(&self) -> String {
        let mut s = String::new();
        {
            let p = self.shared.pending.lock().unwrap_or_else(|e| e.into_inner());
            s += &format!("  engine: {} one-sided operations waiting for their peer\n", p.len());
            let mut keys: Vec<_> = p.keys().collect();
            keys.sort();
            for (peer, tag) in keys.into_iter().take(16) {
                s += &format!("    rank {peer} payload tag {tag}\n");
            }
        }
        s += &self
            .shared
            .comm
            .report(std::time::Duration::from_secs(1))
            .unwrap_or_else(|| "  MPI: the progress thread does not answer\n".into());
        s
    }

    /// Bytes and messages per path that the progress thread moved.
    pub fn traffic(&self) -> &ferry_base::traffic::Traffic {
        &self.shared.comm_counters.traffic
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.stop(false);
    }
}

/// Device memory the engine allocated ([`EngineHandle::alloc_device`]); freed on drop (after
/// its registration has ended).
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    device: usize,
    free: Option<ferry_device::copier::Free>,
}

impl DeviceBuffer {
    /// Its device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Its bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Its device.
    pub fn device(&self) -> usize {
        self.device
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(f) = self.free.take() {
            f();
        }
    }
}

/// Waits for the reply on `rx`. Without `drive`, blocks on the channel (a progress thread
/// answers); with it (the caller drives progress), calls it between looks, yielding the core
/// when it found nothing to do.
fn wait_reply<T>(rx: &Receiver<ferry_base::error::Result<T>>, drive: Option<&mut dyn FnMut() -> bool>) -> Result<T> {
    let lost = || EngineError::Comm(FerryError::ThreadLost("engine progress"));
    let Some(drive) = drive else {
        return rx.recv().map_err(|_| lost())?.map_err(Into::into);
    };
    // Polls while messages keep coming; gives the core up only after a quiet spell (a peer
    // late to the collective), as an MPI library's blocking wait does.
    let mut idle = 0u32;
    loop {
        match rx.try_recv() {
            Ok(r) => return r.map_err(Into::into),
            Err(crossbeam::channel::TryRecvError::Disconnected) => return Err(lost()),
            Err(crossbeam::channel::TryRecvError::Empty) => {}
        }
        if drive() {
            idle = 0;
        } else if idle < SPINS_BEFORE_YIELD {
            idle += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// An allgather of start-up, before the engine exists: waits for it, running passes of the
/// loop itself when the caller drives progress (nobody else would).
fn start_allgather(comm: &CommHandle, driver: Option<&mut Driver>, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
    let rx = comm.allgather_start(bytes)?;
    match driver {
        Some(d) => wait_reply(&rx, Some(&mut || d.pass() == Passed::Worked)),
        None => wait_reply(&rx, None),
    }
}

/// A random-enough job key: time, process and rank mixed (only rank 0's is used).
fn job_candidate(rank: Rank) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    ferry_base::hash::mix(t ^ (u64::from(std::process::id()) << 32) ^ rank as u64) | 1
}

pub(crate) fn check_user_tag(tag: u16) -> Result<()> {
    if u32::from(tag) >= AM_USER_TAGS {
        return Err(EngineError::TagOutOfRange {
            tag: u32::from(tag),
            limit: AM_USER_TAGS,
        });
    }
    Ok(())
}

pub(crate) fn check_payload(len: usize) -> Result<()> {
    if len > AM_MAX_PAYLOAD {
        return Err(EngineError::PayloadTooLarge {
            len,
            limit: AM_MAX_PAYLOAD,
        });
    }
    Ok(())
}

/// The traffic path of a payload of `len` bytes.
pub(crate) fn payload_path(len: usize) -> TrafficPath {
    if len <= EAGER_BYTES {
        TrafficPath::HostEager
    } else {
        TrafficPath::HostRendezvous
    }
}

impl Shared {
    /// Device memory from the copier, within the budget of engine allocations per device.
    pub(crate) fn alloc_device(&self, device: usize, len: usize) -> Result<DeviceBuffer> {
        let st = self.staging_or_error()?;
        let used = self.device_used.get(device).ok_or_else(|| {
            EngineError::NoDevices(format!("device {device} (this rank has {})", self.device_used.len()))
        })?;
        let before = used.fetch_add(len, Ordering::AcqRel);
        if let Some(budget) = self.device_budget {
            if before + len > budget {
                used.fetch_sub(len, Ordering::AcqRel);
                return Err(EngineError::DeviceFull {
                    device,
                    need: len,
                    used: before,
                    budget,
                });
            }
        }
        let allocated = st
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .copier_mut()
            .alloc_device(device, len);
        let (ptr, free) = match allocated {
            Ok(x) => x,
            Err(e) => {
                used.fetch_sub(len, Ordering::AcqRel);
                return Err(e.into());
            }
        };
        let counters = self.device_used.clone();
        Ok(DeviceBuffer {
            ptr,
            len,
            device,
            free: Some(Box::new(move || {
                free();
                counters[device].fetch_sub(len, Ordering::AcqRel);
            })),
        })
    }

    pub(crate) fn staging_or_error(&self) -> Result<&Mutex<Staging>> {
        self.staging.as_ref().ok_or_else(|| {
            EngineError::NoDevices(
                "this engine has no devices (no CUDA driver or GPU, or EngineConfig::devices is None)".into(),
            )
        })
    }

    /// Checks that `len` bytes at `ptr` are the kind of memory the caller says.
    fn check_kind(&self, ptr: u64, len: usize, kind: MemKind) -> Result<()> {
        let Some(want) = kind.device() else {
            // Host memory declared as host: device memory passed as host would reach MPI as a
            // host pointer; refuse it when the devices can tell.
            if let Some(st) = &self.staging {
                if let Ok(Some(d)) = st
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .copier()
                    .locate(ptr, len.max(1))
                {
                    return Err(EngineError::InvalidArgument(format!(
                        "{len} bytes at {ptr:#x} are memory of device {d}, registered as host memory"
                    )));
                }
            }
            return Ok(());
        };
        let st = self.staging_or_error()?;
        let g = st.lock().unwrap_or_else(|e| e.into_inner());
        let n = g.copier().devices();
        if want >= n {
            return Err(EngineError::NoDevices(format!("device {want} (this rank has {n})")));
        }
        match g.copier().locate(ptr, len)? {
            Some(d) if d == want => Ok(()),
            Some(d) => Err(EngineError::InvalidArgument(format!(
                "{len} bytes at {ptr:#x} are memory of device {d}, registered as device {want}"
            ))),
            None => Err(EngineError::InvalidArgument(format!(
                "{len} bytes at {ptr:#x} are host memory, registered as device {want}"
            ))),
        }
    }

    /// A device copy, waited for.
    fn device_copy(
        &self,
        device: usize,
        dir: ferry_device::copier::CopyDir,
        dev: u64,
        host: *mut u8,
        len: usize,
    ) -> Result<()> {
        let st = self.staging_or_error()?;
        let mut g = st.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the caller's promise (device_write / device_read).
        let t = unsafe { g.copier_mut().copy(device, dir, dev, host, len)? };
        while !g.copier_mut().done(&t)? {
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Whether device memory moves to and from `peer` by peer copies through IPC.
    pub(crate) fn ipc_to(&self, peer: Rank) -> bool {
        self.peers.get(peer as usize).is_some_and(|p| p.ipc)
    }

    /// The process of `peer`, when single copies of host memory reach it (`cma.rs`).
    pub(crate) fn cma_pid(&self, peer: Rank) -> Option<i32> {
        *self.cma_pids.get(peer as usize)?
    }

    /// The progress loop's counters (the IPC route adds its copies to them).
    pub(crate) fn comm_counters(&self) -> &CommCounters {
        &self.comm_counters
    }

    /// Whether device memory moves to and from `peer` by GPU-direct.
    pub(crate) fn gpu_direct_to(&self, peer: Rank) -> bool {
        self.peers.get(peer as usize).is_some_and(|p| p.gpu_direct)
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(EngineError::Finalized);
        }
        if let Some(p) = self.delivery.poisoned() {
            return Err(EngineError::CallbackPanicked(p.to_string()));
        }
        Ok(())
    }

    pub(crate) fn check_peer(&self, peer: Rank) -> Result<()> {
        if peer < 0 || peer as usize >= self.size {
            return Err(EngineError::NoSuchPeer { peer, size: self.size });
        }
        Ok(())
    }

    /// A handle of this job naming an existing rank.
    pub(crate) fn check_remote(&self, h: &MemHandle) -> Result<()> {
        if h.job != self.job {
            return Err(EngineError::ForeignHandle {
                found: h.job,
                expected: self.job,
            });
        }
        self.check_peer(h.rank)
    }

    /// The next payload tag of a one-sided operation: even for a get's payload (target to
    /// origin), odd for a put's (origin to target). Each rank numbers its own operations, so
    /// between two ranks the payloads of one direction are either puts of the one or gets of
    /// the other; the parity keeps their tags apart, and the round-robin count keeps two
    /// operations of one origin apart.
    pub(crate) fn data_tag(&self, put: bool) -> u32 {
        let n = self.next_tag.fetch_add(1, Ordering::Relaxed) % (self.data_tags / 2);
        2 * n + u32::from(put)
    }

    /// Refuses what needs active messages when they are off ([`EngineConfig::active_messages`]).
    pub(crate) fn check_am(&self) -> Result<()> {
        if self.active_messages {
            Ok(())
        } else {
            Err(EngineError::InvalidArgument(
                "active messages are off (EngineConfig::active_messages): no handlers, active messages, puts or gets"
                    .into(),
            ))
        }
    }

    /// Posts an active message (eager; a failure is logged: no caller waits for it).
    pub(crate) fn post_am(&self, peer: Rank, tag: i32, bytes: impl Into<AmBuf>) -> Result<()> {
        self.check_am()?;
        let bytes: AmBuf = bytes.into();
        if bytes.len() > AM_WIRE_MAX {
            // Every rank receives into buffers of this size: a longer message would be lost.
            return Err(EngineError::PayloadTooLarge {
                len: bytes.len(),
                limit: AM_WIRE_MAX,
            });
        }
        if let Some(r) = self.am_rings.as_ref().filter(|r| r.serves(peer)) {
            if r.send(peer, tag, &bytes) {
                Counters::add(&self.counters.am_ring_sent, 1);
                return Ok(());
            }
            // Over MPI, counted for the peer's order. Under the ring's lock the send is only
            // handed to the loop (a caller-driven loop that is free posts it at once, running
            // no callback); a shared loop then takes it in a pass on this thread, outside it.
            r.send_large(peer, self.am_cmd(peer, tag, bytes), |cmd| match self.submit(cmd) {
                Some(cmd) => self.comm.post(cmd).map_err(EngineError::from),
                None => Ok(()),
            })?;
            if let Some(share) = self.share.get() {
                let _ = share.try_pass();
            }
            return Ok(());
        }
        self.post_cmd(self.am_cmd(peer, tag, bytes))
    }

    /// [`Shared::post_am`] of bytes not yet in a buffer: straight into a node peer's rings when
    /// they fit them (no copy into a buffer first).
    pub(crate) fn post_am_bytes(&self, peer: Rank, tag: i32, bytes: &[u8]) -> Result<()> {
        if let Some(r) = self.am_rings.as_ref().filter(|r| r.serves(peer)) {
            self.check_am()?;
            if r.send(peer, tag, bytes) {
                Counters::add(&self.counters.am_ring_sent, 1);
                return Ok(());
            }
        }
        self.post_am(peer, tag, self.am_pool.copy_of(bytes))
    }

    /// The command that sends an active message over MPI.
    fn am_cmd(&self, peer: Rank, tag: i32, bytes: AmBuf) -> Cmd {
        Cmd::Send(Transfer {
            region: Arc::new(bytes),
            peer,
            tag,
            channel: Channel::Am,
            path: TrafficPath::Control,
            counts: true,
            eager: true,
            done: Box::new(move |r| {
                if let Err(e) = r {
                    tracing::error!(peer, tag, "active message not sent: {e}");
                }
            }),
        })
    }

    /// Hands `cmd` to the progress loop: with caller-driven progress and the loop free, it is
    /// handled at once on this thread (the message starts now, not at the next pass); with
    /// shared progress and the loop free, a pass on this thread takes it (and a sleeping driver
    /// is woken only when this thread cannot take it: `CommHandle::post_now`).
    pub(crate) fn post_cmd(&self, cmd: Cmd) -> Result<()> {
        match self.submit(cmd) {
            Some(cmd) => Ok(self.comm.post_now(cmd)?),
            None => Ok(()),
        }
    }

    /// [`Shared::post_cmd`] for a receive: posted by the loop's next pass, without a pass on
    /// this thread now (a receive waits for its peer anyway).
    pub(crate) fn post_recv_cmd(&self, cmd: Cmd) -> Result<()> {
        match self.submit(cmd) {
            Some(cmd) => Ok(self.comm.post(cmd)?),
            None => Ok(()),
        }
    }

    /// With caller-driven progress and the loop free, handles `cmd` on this thread; else gives
    /// it back.
    fn submit(&self, cmd: Cmd) -> Option<Cmd> {
        match self.driver.as_ref().map(|d| d.try_lock()) {
            Some(Ok(mut d)) => d.submit(cmd).err(),
            _ => Some(cmd),
        }
    }

    /// Posts a payload send or receive of a one-sided operation, counted on `path`.
    pub(crate) fn post_payload_on(
        &self,
        recv: bool,
        path: TrafficPath,
        region: Arc<dyn MemRegion>,
        peer: Rank,
        tag: u32,
        done: ferry_base::join::Done,
    ) -> Result<()> {
        self.post_on(recv, Channel::OneSided, path, region, peer, tag, done)
    }

    /// Posts a payload send or receive on `channel`, counted on `path`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn post_on(
        &self,
        recv: bool,
        channel: Channel,
        path: TrafficPath,
        region: Arc<dyn MemRegion>,
        peer: Rank,
        tag: u32,
        done: ferry_base::join::Done,
    ) -> Result<()> {
        let t = Transfer {
            path,
            region,
            peer,
            tag: tag as i32,
            channel,
            counts: true,
            // One-sided payloads are posted at once: they are bounded by the operations in
            // flight (and the bounce pools), and must not queue behind two-sided sends whose
            // receives may wait for them.
            eager: channel == Channel::OneSided,
            done,
        };
        self.comm.post(if recv { Cmd::Recv(t) } else { Cmd::Send(t) })?;
        Ok(())
    }

    /// Every active message (on the progress thread).
    fn on_active_message(self: &Arc<Self>, source: Rank, tag: i32, bytes: AmBuf) {
        // From a peer whose ring is used, an MPI message comes after the slots sent before it.
        if let Some(r) = &self.am_rings {
            let mut ready = Vec::new();
            if let Some(bytes) = r.arrived_over_mpi(source, tag, bytes, &mut ready) {
                return self.dispatch_am(source, tag, bytes);
            }
            for (source, tag, bytes) in ready {
                self.dispatch_am(source, tag, bytes);
            }
            return;
        }
        self.dispatch_am(source, tag, bytes)
    }

    /// Hands an active message that is due (in order) to its handler, or to the engine's own
    /// protocol.
    pub(crate) fn dispatch_am(self: &Arc<Self>, source: Rank, tag: i32, bytes: AmBuf) {
        if (0..AM_USER_TAGS as i32).contains(&tag) {
            Counters::add(&self.counters.am_received, 1);
            let m = AmMessage {
                source,
                tag: tag as u16,
                bytes,
            };
            return self.handlers.received(m, &self.delivery);
        }
        let r = match tag {
            wire::GET_REQUEST => self.on_get_request(source, &bytes),
            wire::GET_REFUSED => self.on_get_refused(source, &bytes),
            wire::PUT_REQUEST => self.on_put_request(source, &bytes),
            wire::PUT_DONE => self.on_put_done(source, &bytes),
            wire::IPC_GRANT => self.on_ipc_grant(source, &bytes),
            wire::IPC_RELEASE => self.on_ipc_release(source, &bytes),
            wire::LEASE_DONE => self.on_lease_done(source, &bytes),
            _ => Err(EngineError::InvalidArgument(format!(
                "active message with engine tag {tag}"
            ))),
        };
        if let Err(e) = r {
            tracing::error!(source, tag, "engine message: {e}");
        }
    }
}
