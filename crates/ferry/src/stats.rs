//! End-of-run statistics: tasks and busy time per thread, bytes and GB/s per payload path.
//!
//! Counters are relaxed atomics written by the thread that does the work; a [`StatsSnapshot`]
//! reads them at any time. [`StatsSnapshot::table`] prints the table the examples show, for one
//! rank or summed over ranks (after [`crate::Runtime::gather_stats`]).

pub use ferry_base::traffic::TrafficPath;
use ferry_engine::ProgressCounters;
use ferry_memory::counters::MemoryCounters;
use serde::{Deserialize, Serialize};
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// Per-thread counters of a CPU worker, on cache lines of their own (two of them): a worker
/// writes its own several times per task, and two workers' counters on one line made every
/// task of each a miss for the other.
#[repr(align(128))]
pub(crate) struct WorkerCounters {
    pub(crate) tasks: AtomicU64,
    pub(crate) busy_ns: AtomicU64,
    /// Times the worker parked for want of work (shared with the pool, which counts them).
    pub(crate) naps: Arc<AtomicU64>,
    /// The body running now, for the watchdog's report: its class (name hash, resolved through
    /// [`Counters::class_names`]), sequence number (`u64::MAX`: none) and start (ns since
    /// `Counters::start`). Atomics, not a lock with a cloned name: a lock and a shared `Arc`'s
    /// count per task cost more than the smallest tasks.
    pub(crate) current_class: AtomicU64,
    pub(crate) current_seq: AtomicU64,
    pub(crate) current_start_ns: AtomicU64,
}

impl WorkerCounters {
    fn new() -> WorkerCounters {
        WorkerCounters {
            tasks: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            naps: Arc::new(AtomicU64::new(0)),
            current_class: AtomicU64::new(0),
            current_seq: AtomicU64::new(u64::MAX),
            current_start_ns: AtomicU64::new(0),
        }
    }
}

/// The live counters of one rank.
pub(crate) struct Counters {
    pub(crate) start: Instant,
    pub(crate) workers: Vec<WorkerCounters>,
    /// The inserting thread's, for the tasks it runs at its scheduling points
    /// (`FERRY_INSERTER_HELPS`): worker index `workers.len()` ([`Counters::slot`]).
    pub(crate) inserting: WorkerCounters,
    /// The communication layer's: what the MPI thread moved, its busy time and naps (the MPI
    /// thread writes these).
    pub(crate) comm: Arc<ProgressCounters>,
    /// The data and memory layer's (devices, tiers, the GPU manager) and the traffic it and the
    /// transfer layer move (shared with the GPU manager, the I/O thread and the transfer layer).
    pub(crate) memory: Arc<MemoryCounters>,
    /// Write-only accesses given a fresh copy because a send still read the old one.
    pub(crate) renamed: AtomicU64,
    /// Jobs (tasks, parts of fused replays) the inserting thread ran between insertions
    /// (`FERRY_INSERTER_HELPS`).
    pub(crate) inserter_jobs: AtomicU64,
    /// Times insertion blocked in a full submission window, and for how long in all.
    pub(crate) window_stalls: AtomicU64,
    pub(crate) window_stall_ns: AtomicU64,
    /// Times insertion went on past a full window because nothing finished (`graph/window.rs`).
    pub(crate) window_overruns: AtomicU64,
    /// Traces recorded, and tasks inserted by replaying a recording (`graph/replay.rs`).
    pub(crate) trace_records: AtomicU64,
    pub(crate) replayed_tasks: AtomicU64,
    /// Replays fused into one GPU launch, and the tasks they held (`graph/fuse.rs`); the
    /// launches' own counters (graph captures and updates).
    pub(crate) fused_replays: AtomicU64,
    pub(crate) fused_tasks: AtomicU64,
    pub(crate) fused: Arc<ferry_device::fused::FusedCounters>,
    /// Names of the task classes inserted so far, by name hash.
    pub(crate) class_names: std::sync::Mutex<std::collections::HashMap<u64, std::sync::Arc<str>>>,
}

impl Counters {
    /// The worker index the inserting thread runs tasks as: one past the last worker.
    pub(crate) fn inserting_worker(&self) -> usize {
        self.workers.len()
    }

    /// The counters of worker `worker`, the inserting thread's for
    /// [`Counters::inserting_worker`], `None` past that.
    pub(crate) fn slot(&self, worker: usize) -> Option<&WorkerCounters> {
        self.workers
            .get(worker)
            .or_else(|| (worker == self.inserting_worker()).then_some(&self.inserting))
    }

    /// Counters for `workers` workers and `devices` devices, with the MPI thread's `comm`
    /// (made before the MPI thread starts, when the worker count is not known yet).
    pub(crate) fn new(workers: usize, devices: usize, comm: Arc<ProgressCounters>) -> Counters {
        Counters {
            start: Instant::now(),
            workers: (0..workers).map(|_| WorkerCounters::new()).collect(),
            inserting: WorkerCounters::new(),
            comm,
            memory: Arc::new(MemoryCounters::new(devices)),
            renamed: AtomicU64::new(0),
            inserter_jobs: AtomicU64::new(0),
            window_stalls: AtomicU64::new(0),
            window_stall_ns: AtomicU64::new(0),
            window_overruns: AtomicU64::new(0),
            trace_records: AtomicU64::new(0),
            replayed_tasks: AtomicU64::new(0),
            fused_replays: AtomicU64::new(0),
            fused_tasks: AtomicU64::new(0),
            fused: Default::default(),
            class_names: Default::default(),
        }
    }

    /// Test helper: the counters of path `p` that the GPU manager and the transfer layer write.
    #[cfg(test)]
    pub(crate) fn path(&self, p: TrafficPath) -> &ferry_base::traffic::PathCounters {
        self.memory.path(p)
    }
}

/// Busy time of one thread.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThreadStats {
    /// Thread name (`worker-3`, `mpi`).
    pub name: String,
    /// Tasks run (0 for the MPI thread).
    pub tasks: u64,
    /// Seconds spent running task bodies (workers) or doing MPI work (the MPI thread).
    pub busy_s: f64,
    /// Times the thread went to sleep for want of work: a worker parking after its spin, the
    /// MPI thread or the GPU manager blocking on its channel (a nap it may be woken from). Each
    /// costs the thread that wakes it a system call and the sleeper a wake-up; per transfer or
    /// per task, it shows whether a progress thread keeps up without sleeping.
    #[serde(default)]
    pub naps: u64,
}

/// Where the GPU manager thread's wall time went, seconds per activity (exclusive: a launch
/// made while finalizing counts as launch). All zero without devices, and unless
/// `FERRY_GPU_PHASES` is on. Cumulative since the runtime started: a one-off cost such as the
/// NVRTC compilation of a kernel on its first launch (≈ 0.3 s for the stencil's) is in
/// `launch_s`; take differences of two snapshots to see a steady state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ManagerPhases {
    /// Napping or blocked, waiting for a command or an event.
    pub idle_s: f64,
    /// Serving commands: reservations, pins, stage-out requests, queueing tasks.
    pub commands_s: f64,
    /// Enqueuing transfer copies (IPC pulls, bounce-buffer chunks).
    pub copies_s: f64,
    /// Admitting tasks: allocation, eviction, stage-in and the kernel launch.
    pub launch_s: f64,
    /// Querying events (copies, stage-ins, tasks, write-backs), productive or not.
    pub poll_s: f64,
    /// Its own bookkeeping when a task ends (validity, pins, LRU).
    pub finalize_s: f64,
    /// Completion callbacks run for the graph (releasing successors, posting their sends) and
    /// the transfer layer (acknowledging copies).
    pub callbacks_s: f64,
}

impl ManagerPhases {
    fn capture(ns: &[AtomicU64; ferry_memory::counters::PHASES]) -> ManagerPhases {
        let s = |i: usize| ns[i].load(Relaxed) as f64 * 1e-9;
        ManagerPhases {
            idle_s: s(0),
            commands_s: s(1),
            copies_s: s(2),
            launch_s: s(3),
            poll_s: s(4),
            finalize_s: s(5),
            callbacks_s: s(6),
        }
    }

    /// The busy phases as `(name, seconds)`, in the order of the table.
    pub fn busy(&self) -> [(&'static str, f64); 6] {
        [
            ("launch", self.launch_s),
            ("callbacks", self.callbacks_s),
            ("finalize", self.finalize_s),
            ("poll", self.poll_s),
            ("copies", self.copies_s),
            ("commands", self.commands_s),
        ]
    }
}

/// Traffic on one path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathStats {
    /// [`TrafficPath::name`].
    pub path: String,
    /// Bytes this rank sent on the path.
    pub bytes_sent: u64,
    /// Bytes this rank received on the path.
    pub bytes_recv: u64,
    /// Messages sent.
    pub sends: u64,
    /// Messages received.
    pub recvs: u64,
    /// Seconds during which at least one transfer of the path was in flight on this rank.
    pub active_s: f64,
}

impl PathStats {
    /// `(bytes_sent + bytes_recv) / active_s` in GB/s (10⁹ bytes per second); 0 when idle.
    pub fn gbps(&self) -> f64 {
        if self.active_s > 0.0 {
            (self.bytes_sent + self.bytes_recv) as f64 / self.active_s / 1e9
        } else {
            0.0
        }
    }
}

/// Count and busy time of one task class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassStats {
    /// Class name.
    pub name: String,
    /// Tasks of the class run on this rank.
    pub tasks: u64,
    /// Seconds in their bodies.
    pub busy_s: f64,
}

/// What one local device did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceStats {
    /// Device description (`cuda0 NVIDIA H200 (120.3 GiB pool)`, `emu1 (256 MiB)`).
    pub name: String,
    /// GPU tasks run on it.
    pub tasks: u64,
    /// Copies dropped or written back to make room.
    pub evictions: u64,
    /// Dirty copies written back to the host before eviction.
    pub writebacks: u64,
    /// Pool allocations that failed (including injected faults).
    pub alloc_failures: u64,
    /// Times a task had to wait for device memory.
    pub alloc_waits: u64,
    /// Seconds tasks spent waiting for device memory, summed over tasks.
    #[serde(default)]
    pub alloc_wait_s: f64,
    /// Dirty copies written back ahead of need because free memory fell under the low-water
    /// mark (they stay on the device, clean: a later eviction only drops them).
    #[serde(default)]
    pub cleanings: u64,
    /// Host→device copies of tiles that a peer-linked device of this rank held or was staging
    /// in: what peer copies would have saved (0 with `FERRY_PEER_COPY=on` except on races
    /// with eviction).
    #[serde(default)]
    pub host_duplicates: u64,
    /// Bytes this device received over peer links, per source device (index = source).
    #[serde(default)]
    pub peer_bytes_from: Vec<u64>,
    /// Tasks that were released when the tasks they follow were launched, not finished, and
    /// ordered after them on this device (`FERRY_LAUNCH_AHEAD`).
    #[serde(default)]
    pub launched_ahead: u64,
    /// Of those, tasks launched onto the exec stream of the predecessor they follow, ordered by
    /// the stream rather than by a wait for its event (`FERRY_STREAM_AFFINITY`).
    #[serde(default)]
    pub followed: u64,
    /// GPU tasks writing a part of a tile (`AccessMode::ReadWritePart`) placed on this device
    /// while another part writer of that tile was in flight here: a member of their group,
    /// which may run alongside them, or, with launch-ahead, a member of an earlier group still
    /// unfinalized (ordered before them by the graph).
    #[serde(default)]
    pub parts_together: u64,
    /// comm-in copies (IPC pulls, staged host→device copies) into this device whose GPU
    /// consumers were launched behind them, ordered by the copy's event, instead of after the
    /// copy had been seen complete (`FERRY_COMM_IN_AHEAD`).
    #[serde(default)]
    pub comm_in_ahead: u64,
    /// IPC sends of tiles that GPU tasks produced on this device which left when the task was
    /// launched, the consumer's pull ordered after the task by a signal, rather than once the
    /// task had been seen complete (`FERRY_OFFER_AT_LAUNCH`).
    #[serde(default)]
    pub offered_at_launch: u64,
    /// GPU tasks that overwrite a tile an IPC send of this device still read, launched before
    /// the consumer had acknowledged over the host: their stream waited on the device for the
    /// acknowledgement word that the consumer's comm stream writes after its pull
    /// (`FERRY_DEVICE_ACK`, `ferry-transfer/src/ack.rs`).
    #[serde(default)]
    pub acked_on_device: u64,
    /// Device acknowledgements that this device's comm streams wrote right behind their IPC
    /// pulls.
    #[serde(default)]
    pub acks_written: u64,
    /// IPC pulls offered at launch that this device enqueued with no stream wait: the GPU
    /// manager had seen their producer's signal in its host mirror (`FERRY_OFFER_POLL_US`).
    #[serde(default)]
    pub offers_seen: u64,
    /// IPC pulls offered at launch whose stream waited on this device for their producer's
    /// signal (no host mirror, or the signal not seen within `FERRY_OFFER_POLL_US`).
    #[serde(default)]
    pub offers_waited: u64,
    /// Batches of those pulls that were held for the host mirror for all of
    /// `FERRY_OFFER_POLL_US`, then waited on the device (a long producer kernel).
    #[serde(default)]
    pub offers_held_out: u64,
    /// Batches in which several IPC pulls that reached the GPU manager together were enqueued
    /// behind one event (with one `cuMemcpyBatchAsync` where the driver has it; one by one on
    /// emulated devices and older drivers).
    #[serde(default)]
    pub copy_batches: u64,
    /// The copies in those batches (a lone copy is not counted).
    #[serde(default)]
    pub batched_copies: u64,
}

/// What the host and disk tiers did (all zero without a host budget).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TierStats {
    /// The host budget in bytes (`None`: no budget in force; `Some(0)`: every unused host copy
    /// goes to disk).
    pub host_limit: Option<u64>,
    /// Most bytes of host tile buffers alive at once.
    pub host_peak: u64,
    /// Host copies dropped because their data was valid elsewhere (a device, the disk).
    pub host_drops: u64,
    /// Host copies written to the spill file.
    pub spills: u64,
    /// Bytes written to the spill file.
    pub spill_bytes: u64,
    /// Seconds spent writing them.
    pub spill_s: f64,
    /// Copies read back from the spill file (on demand and prefetched).
    pub loads: u64,
    /// Bytes read back.
    pub load_bytes: u64,
    /// Seconds spent reading them.
    pub load_s: f64,
    /// Loads started by the prefetcher, ahead of the task that reads the copy.
    pub prefetches: u64,
    /// Copies a task or a send had to wait for (not prefetched in time).
    pub demand_loads: u64,
    /// Seconds those waits took, from request to data in host memory, summed.
    pub demand_wait_s: f64,
    /// Most bytes of spill-file slots reserved at once.
    pub disk_peak: u64,
}

impl TierStats {
    /// Spill write rate in GB/s (10⁹ B/s; 0 when nothing was written).
    pub fn spill_gbps(&self) -> f64 {
        if self.spill_s > 0.0 {
            self.spill_bytes as f64 / self.spill_s / 1e9
        } else {
            0.0
        }
    }

    /// Load rate in GB/s (10⁹ B/s; 0 when nothing was read).
    pub fn load_gbps(&self) -> f64 {
        if self.load_s > 0.0 {
            self.load_bytes as f64 / self.load_s / 1e9
        } else {
            0.0
        }
    }
}

/// A copy of one rank's counters at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// The rank.
    pub rank: i32,
    /// Seconds since the runtime started.
    pub wall_s: f64,
    /// Workers, then the MPI thread.
    pub threads: Vec<ThreadStats>,
    /// One entry per [`TrafficPath`], in [`TrafficPath::ALL`] order.
    pub paths: Vec<PathStats>,
    /// Task classes that ran on this rank, by name.
    pub classes: Vec<ClassStats>,
    /// Local devices, in order.
    pub devices: Vec<DeviceStats>,
    /// Host tile buffers that found the pinned host pool full and went to pageable memory.
    #[serde(default)]
    pub pinned_fallbacks: u64,
    /// Bytes of the pinned host pool (0 without one).
    #[serde(default)]
    pub pinned_bytes: u64,
    /// Most bytes of the pinned host pool in use at once (0 without one).
    #[serde(default)]
    pub pinned_peak_bytes: u64,
    /// Bytes of the pinned host pool not pinned yet when the snapshot was taken (0 by default:
    /// the pool is pinned whole at start-up). With `FERRY_HOST_PIN_AT_START` below the pool's
    /// size the rest is pinned on a thread of its own, and these bytes serve no buffer until
    /// then; if a registration fails, the pinning stops (a warning says where) and what it did
    /// not reach stays counted here for the rest of the run.
    #[serde(default)]
    pub pinned_pending_bytes: u64,
    /// Bytes of the bounce pool (0 without devices).
    #[serde(default)]
    pub bounce_bytes: u64,
    /// Most bounce-pool bytes in use at once: the extra host memory staged transfers took.
    #[serde(default)]
    pub bounce_peak_bytes: u64,
    /// Where the GPU manager thread's time went.
    #[serde(default)]
    pub gpu_manager: ManagerPhases,
    /// The host and disk tiers.
    #[serde(default)]
    pub tier: TierStats,
    /// Write-only accesses that wrote a fresh copy of their tile because a send still read the
    /// current one, instead of waiting for that send to finish (`FERRY_RENAME_SENT`).
    #[serde(default)]
    pub renamed: u64,
    /// Jobs the inserting thread ran at its scheduling points between insertions
    /// (`FERRY_INSERTER_HELPS`): ready tasks, and the tasks of fused replays it took over.
    #[serde(default)]
    pub inserter_jobs: u64,
    /// Times insertion blocked because the submission window (`FERRY_SUBMIT_WINDOW`) was full.
    #[serde(default)]
    pub window_stalls: u64,
    /// Seconds insertion spent blocked in those stalls.
    #[serde(default)]
    pub window_stall_s: f64,
    /// Times insertion went on past a full window because none of the rank's tasks or
    /// transfers finished for 50 ms (the window is a soft bound: `graph/window.rs`).
    #[serde(default)]
    pub window_overruns: u64,
    /// Traces recorded ([`crate::Runtime::trace`]): first uses, and sequences recorded again
    /// because the tiles they read had changed holders.
    #[serde(default)]
    pub trace_records: u64,
    /// Tasks inserted by replaying a trace's recording instead of by the full analysis.
    #[serde(default)]
    pub replayed_tasks: u64,
    /// Replays whose GPU tasks ran as one fused launch (a CUDA graph on CUDA devices).
    #[serde(default)]
    pub fused_replays: u64,
    /// Tasks those fused launches held.
    #[serde(default)]
    pub fused_tasks: u64,
    /// CUDA graphs captured for fused replays: the first launch of each recording, and again
    /// where its tiles moved (or arguments a body reads changed).
    #[serde(default)]
    pub graph_captures: u64,
    /// Of those captures, the ones that updated the instantiated graph in place.
    #[serde(default)]
    pub graph_updates: u64,
    /// Fused launches whose kernels ran one by one (emulated devices; bodies that cannot be
    /// captured).
    #[serde(default)]
    pub fused_direct: u64,
}

impl StatsSnapshot {
    pub(crate) fn capture(rank: i32, c: &Counters, classes: Vec<ClassStats>, device_names: &[String]) -> StatsSnapshot {
        let mut threads: Vec<ThreadStats> = c
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| ThreadStats {
                name: format!("worker-{i}"),
                tasks: w.tasks.load(Relaxed),
                busy_s: w.busy_ns.load(Relaxed) as f64 * 1e-9,
                naps: w.naps.load(Relaxed),
            })
            .collect();
        threads.push(ThreadStats {
            name: "mpi".into(),
            tasks: 0,
            busy_s: c.comm.busy_ns.load(Relaxed) as f64 * 1e-9,
            naps: c.comm.naps.load(Relaxed),
        });
        if !c.memory.devices.is_empty() {
            threads.push(ThreadStats {
                name: "gpu-manager".into(),
                tasks: c.memory.devices.iter().map(|d| d.tasks.load(Relaxed)).sum(),
                busy_s: c.memory.gpu_manager_busy_ns.load(Relaxed) as f64 * 1e-9,
                naps: c.memory.gpu_manager_naps.load(Relaxed),
            });
        }
        let devices = c
            .memory
            .devices
            .iter()
            .enumerate()
            .map(|(d, x)| DeviceStats {
                name: device_names.get(d).cloned().unwrap_or_else(|| format!("device{d}")),
                tasks: x.tasks.load(Relaxed),
                evictions: x.evictions.load(Relaxed),
                writebacks: x.writebacks.load(Relaxed),
                alloc_failures: x.alloc_failures.load(Relaxed),
                alloc_waits: x.alloc_waits.load(Relaxed),
                alloc_wait_s: x.alloc_wait_ns.load(Relaxed) as f64 * 1e-9,
                cleanings: x.cleanings.load(Relaxed),
                host_duplicates: x.host_duplicates.load(Relaxed),
                launched_ahead: x.launched_ahead.load(Relaxed),
                followed: x.followed.load(Relaxed),
                parts_together: x.parts_together.load(Relaxed),
                comm_in_ahead: x.comm_in_ahead.load(Relaxed),
                offered_at_launch: x.offered_at_launch.load(Relaxed),
                acked_on_device: x.acked_on_device.load(Relaxed),
                acks_written: x.acks_written.load(Relaxed),
                offers_seen: x.offers_seen.load(Relaxed),
                offers_waited: x.offers_waited.load(Relaxed),
                offers_held_out: x.offers_held_out.load(Relaxed),
                copy_batches: x.copy_batches.load(Relaxed),
                batched_copies: x.batched_copies.load(Relaxed),
                peer_bytes_from: x.peer_from.iter().map(|b| b.load(Relaxed)).collect(),
            })
            .collect();
        let paths = TrafficPath::ALL
            .iter()
            .map(|&p| {
                // A path's bytes are counted by the MPI thread (messages it completed) and by the
                // layers above it (copies, and the staged and IPC transfers the transfer layer
                // counts itself): the path's figure is the sum.
                let (a, b) = (c.comm.traffic.path(p), c.memory.path(p));
                let sum =
                    |f: fn(&ferry_base::traffic::PathCounters) -> &AtomicU64| f(a).load(Relaxed) + f(b).load(Relaxed);
                PathStats {
                    path: p.name().into(),
                    bytes_sent: sum(|x| &x.bytes_sent),
                    bytes_recv: sum(|x| &x.bytes_recv),
                    sends: sum(|x| &x.sends),
                    recvs: sum(|x| &x.recvs),
                    active_s: sum(|x| &x.active_ns) as f64 * 1e-9,
                }
            })
            .collect();
        StatsSnapshot {
            rank,
            wall_s: c.start.elapsed().as_secs_f64(),
            threads,
            paths,
            classes,
            devices,
            pinned_fallbacks: 0,
            pinned_bytes: 0,
            pinned_peak_bytes: 0,
            pinned_pending_bytes: 0,
            bounce_bytes: 0,
            bounce_peak_bytes: 0,
            gpu_manager: ManagerPhases::capture(&c.memory.gpu_phase_ns),
            renamed: c.renamed.load(Relaxed),
            inserter_jobs: c.inserter_jobs.load(Relaxed),
            window_stalls: c.window_stalls.load(Relaxed),
            window_stall_s: c.window_stall_ns.load(Relaxed) as f64 * 1e-9,
            window_overruns: c.window_overruns.load(Relaxed),
            trace_records: c.trace_records.load(Relaxed),
            replayed_tasks: c.replayed_tasks.load(Relaxed),
            fused_replays: c.fused_replays.load(Relaxed),
            fused_tasks: c.fused_tasks.load(Relaxed),
            graph_captures: c.fused.captures.load(Relaxed),
            graph_updates: c.fused.updates.load(Relaxed),
            fused_direct: c.fused.direct.load(Relaxed),
            tier: TierStats {
                host_peak: c.memory.tier.host_peak.load(Relaxed),
                host_drops: c.memory.tier.host_drops.load(Relaxed),
                spills: c.memory.tier.spills.load(Relaxed),
                spill_bytes: c.memory.tier.spill_bytes.load(Relaxed),
                spill_s: c.memory.tier.spill_ns.load(Relaxed) as f64 * 1e-9,
                loads: c.memory.tier.loads.load(Relaxed),
                load_bytes: c.memory.tier.load_bytes.load(Relaxed),
                load_s: c.memory.tier.load_ns.load(Relaxed) as f64 * 1e-9,
                prefetches: c.memory.tier.prefetches.load(Relaxed),
                demand_loads: c.memory.tier.demand_loads.load(Relaxed),
                demand_wait_s: c.memory.tier.demand_wait_ns.load(Relaxed) as f64 * 1e-9,
                ..TierStats::default()
            },
        }
    }

    /// Tasks run on this rank.
    pub fn tasks(&self) -> u64 {
        self.classes.iter().map(|c| c.tasks).sum()
    }

    /// The entry of `path`: found by its name (a record written by another version of ferry
    /// may list other paths, or these in another order); all zero when the snapshot has none.
    pub fn path(&self, path: TrafficPath) -> &PathStats {
        static NONE: PathStats = PathStats {
            path: String::new(),
            bytes_sent: 0,
            bytes_recv: 0,
            sends: 0,
            recvs: 0,
            active_s: 0.0,
        };
        let name = path.name();
        self.paths
            .get(path.index())
            .filter(|p| p.path == name)
            .or_else(|| self.paths.iter().find(|p| p.path == name))
            .unwrap_or(&NONE)
    }

    /// Bytes sent on every path.
    pub fn bytes_sent(&self) -> u64 {
        self.paths.iter().map(|p| p.bytes_sent).sum()
    }

    /// A printable table of `ranks` (one snapshot per rank): per rank tasks and busy time, then
    /// per class and per path, summed over ranks. TrafficPath GB/s is the rank-summed bytes over the
    /// longest per-rank active time.
    pub fn table(ranks: &[StatsSnapshot]) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<6} {:>10} {:>10} {:>12} {:>10} {:>22}",
            "rank", "tasks", "wall s", "worker busy", "mpi busy", "naps workers/mpi/gpu"
        );
        for r in ranks {
            let workers: Vec<&ThreadStats> = r.threads.iter().filter(|t| t.name.starts_with("worker-")).collect();
            let busy: f64 = workers.iter().map(|t| t.busy_s).sum();
            let util = if r.wall_s > 0.0 && !workers.is_empty() {
                busy / (r.wall_s * workers.len() as f64)
            } else {
                0.0
            };
            let thread = |name: &str| r.threads.iter().find(|t| t.name == name);
            let mpi = thread("mpi").map_or(0.0, |t| t.busy_s);
            let naps = format!(
                "{}/{}/{}",
                workers.iter().map(|t| t.naps).sum::<u64>(),
                thread("mpi").map_or(0, |t| t.naps),
                thread("gpu-manager").map_or(0, |t| t.naps)
            );
            let _ = writeln!(
                s,
                "{:<6} {:>10} {:>10.3} {:>11.1}% {:>9.3}s {:>22}",
                r.rank,
                r.tasks(),
                r.wall_s,
                util * 100.0,
                mpi,
                naps
            );
        }
        let mut classes: Vec<ClassStats> = Vec::new();
        for c in ranks.iter().flat_map(|r| &r.classes) {
            match classes.iter_mut().find(|x| x.name == c.name) {
                Some(x) => {
                    x.tasks += c.tasks;
                    x.busy_s += c.busy_s;
                }
                None => classes.push(c.clone()),
            }
        }
        let _ = writeln!(s, "{:<16} {:>10} {:>12} {:>12}", "class", "tasks", "busy s", "mean µs");
        for c in &classes {
            let mean = if c.tasks > 0 {
                c.busy_s / c.tasks as f64 * 1e6
            } else {
                0.0
            };
            let _ = writeln!(s, "{:<16} {:>10} {:>12.3} {:>12.1}", c.name, c.tasks, c.busy_s, mean);
        }
        let _ = writeln!(
            s,
            "{:<16} {:>12} {:>10} {:>10} {:>10}",
            "path", "bytes sent", "messages", "active s", "GB/s"
        );
        for p in TrafficPath::ALL {
            let bytes: u64 = ranks.iter().map(|r| r.path(p).bytes_sent).sum();
            let msgs: u64 = ranks.iter().map(|r| r.path(p).sends).sum();
            let active = ranks.iter().map(|r| r.path(p).active_s).fold(0.0, f64::max);
            let gbps = if active > 0.0 { bytes as f64 / active / 1e9 } else { 0.0 };
            let _ = writeln!(
                s,
                "{:<16} {:>12} {:>10} {:>10.4} {:>10.3}",
                p.name(),
                bytes,
                msgs,
                active,
                gbps
            );
        }
        if ranks.iter().any(|r| !r.devices.is_empty()) {
            let _ = writeln!(
                s,
                "{:<6} {:<34} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9}",
                "rank",
                "device",
                "tasks",
                "ahead",
                "followed",
                "parts",
                "comm-in",
                "offered",
                "acked",
                "acks",
                "evictions",
                "writebacks",
                "cleanings",
                "oom",
                "waits"
            );
            for r in ranks {
                for d in &r.devices {
                    let _ = writeln!(
                        s,
                        "{:<6} {:<34} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9}",
                        r.rank,
                        d.name,
                        d.tasks,
                        d.launched_ahead,
                        d.followed,
                        d.parts_together,
                        d.comm_in_ahead,
                        d.offered_at_launch,
                        d.acked_on_device,
                        d.acks_written,
                        d.evictions,
                        d.writebacks,
                        d.cleanings,
                        d.alloc_failures,
                        d.alloc_waits
                    );
                }
            }
        }
        // Where each rank's GPU manager spent its time, per task it ran (`FERRY_GPU_PHASES`).
        if ranks.iter().any(|r| r.gpu_manager.busy().iter().any(|(_, x)| *x > 0.0)) {
            let _ = write!(s, "{:<6} {:>10} {:>7}", "rank", "gpu-mgr s", "idle");
            for (name, _) in ManagerPhases::default().busy() {
                let _ = write!(s, " {:>10}", format!("{name} µs"));
            }
            let _ = writeln!(s, "   (per task)");
            for r in ranks {
                let g = &r.gpu_manager;
                let busy: f64 = g.busy().iter().map(|(_, x)| x).sum();
                let total = busy + g.idle_s;
                let tasks = r.devices.iter().map(|d| d.tasks).sum::<u64>().max(1) as f64;
                let idle = if total > 0.0 { 100.0 * g.idle_s / total } else { 0.0 };
                let _ = write!(s, "{:<6} {:>10.4} {:>6.1}%", r.rank, busy, idle);
                for (_, x) in g.busy() {
                    let _ = write!(s, " {:>10.2}", x / tasks * 1e6);
                }
                let _ = writeln!(s);
            }
        }
        if ranks.iter().any(|r| r.tier.host_limit.is_some()) {
            let _ = writeln!(
                s,
                "{:<6} {:>12} {:>12} {:>8} {:>8} {:>9} {:>8} {:>9} {:>10} {:>8}",
                "rank",
                "host limit",
                "host peak",
                "drops",
                "spills",
                "spill GB/s",
                "loads",
                "load GB/s",
                "prefetched",
                "waited"
            );
            for r in ranks {
                let t = &r.tier;
                let _ = writeln!(
                    s,
                    "{:<6} {:>12} {:>12} {:>8} {:>8} {:>9.2} {:>8} {:>9.2} {:>10} {:>8}",
                    r.rank,
                    t.host_limit.unwrap_or(0),
                    t.host_peak,
                    t.host_drops,
                    t.spills,
                    t.spill_gbps(),
                    t.loads,
                    t.load_gbps(),
                    t.prefetches,
                    t.demand_loads
                );
            }
        }
        if ranks.iter().any(|r| r.window_stalls > 0) {
            let stalls: u64 = ranks.iter().map(|r| r.window_stalls).sum();
            let secs: f64 = ranks.iter().map(|r| r.window_stall_s).sum();
            let overruns: u64 = ranks.iter().map(|r| r.window_overruns).sum();
            let _ = writeln!(
                s,
                "submission window full: insertion blocked {stalls} times, {secs:.3} s, went on past it {overruns} times (all ranks)"
            );
        }
        if ranks.iter().any(|r| r.inserter_jobs > 0) {
            let jobs: u64 = ranks.iter().map(|r| r.inserter_jobs).sum();
            let _ = writeln!(
                s,
                "inserting threads ran {jobs} ready jobs between insertions (all ranks)"
            );
        }
        if ranks.iter().any(|r| r.trace_records > 0) {
            let records: u64 = ranks.iter().map(|r| r.trace_records).sum();
            let replayed: u64 = ranks.iter().map(|r| r.replayed_tasks).sum();
            let _ = writeln!(
                s,
                "traces: {records} recordings, {replayed} tasks inserted by replay (all ranks)"
            );
        }
        if ranks.iter().any(|r| r.fused_replays > 0) {
            let sum = |f: fn(&StatsSnapshot) -> u64| ranks.iter().map(f).sum::<u64>();
            let _ = writeln!(
                s,
                "fused replays: {} launches held {} GPU tasks; {} CUDA graph captures ({} updated in place), {} launches kernel by kernel (all ranks)",
                sum(|r| r.fused_replays),
                sum(|r| r.fused_tasks),
                sum(|r| r.graph_captures),
                sum(|r| r.graph_updates),
                sum(|r| r.fused_direct),
            );
        }
        s
    }
}

impl fmt::Display for StatsSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&StatsSnapshot::table(std::slice::from_ref(self)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_sums_ranks() {
        let c = Counters::new(2, 0, Default::default());
        c.workers[1].naps.store(5, Relaxed);
        c.comm.naps.store(7, Relaxed);
        c.path(TrafficPath::HostEager).bytes_sent.store(1000, Relaxed);
        c.path(TrafficPath::HostEager).sends.store(2, Relaxed);
        let cls = vec![ClassStats {
            name: "gemm".into(),
            tasks: 3,
            busy_s: 0.003,
        }];
        let a = StatsSnapshot::capture(0, &c, cls.clone(), &[]);
        let b = StatsSnapshot::capture(1, &c, cls, &[]);
        assert_eq!(a.tasks(), 3);
        let t = StatsSnapshot::table(&[a, b]);
        assert!(t.contains("gemm") && t.contains(" 6 "), "{t}");
        assert!(t.contains("2000"), "{t}");
        assert!(t.contains(" 5/7/0"), "naps of workers, MPI thread, GPU manager: {t}");
    }

    /// A snapshot whose path list is short or in another order (a record of another version)
    /// still answers by path name, and prints, without indexing past its end.
    #[test]
    fn paths_are_found_by_name() {
        let c = Counters::new(1, 0, Default::default());
        c.path(TrafficPath::HostEager).bytes_sent.store(1000, Relaxed);
        c.path(TrafficPath::Ipc).bytes_sent.store(7, Relaxed);
        let mut snap = StatsSnapshot::capture(0, &c, Vec::new(), &[]);
        assert_eq!(snap.path(TrafficPath::Ipc).bytes_sent, 7);
        // Another order, one entry fewer.
        snap.paths.reverse();
        let gone = TrafficPath::ALL
            .into_iter()
            .find(|&p| p != TrafficPath::Ipc && p != TrafficPath::HostEager);
        snap.paths
            .retain(|p| Some(p.path.as_str()) != gone.map(TrafficPath::name));
        assert_eq!(snap.path(TrafficPath::Ipc).bytes_sent, 7);
        assert_eq!(snap.path(TrafficPath::HostEager).bytes_sent, 1000);
        snap.paths.retain(|p| p.path != TrafficPath::HostEager.name());
        assert_eq!(snap.path(TrafficPath::HostEager).bytes_sent, 0);
        snap.paths.clear();
        assert_eq!(snap.path(TrafficPath::Ipc).sends, 0);
        let t = StatsSnapshot::table(&[snap]);
        assert!(t.contains(TrafficPath::Ipc.name()), "{t}");
    }
}
