//! Runtime configuration: set in code through [`crate::RuntimeBuilder`] or from `FERRY_*`
//! environment variables. [`VARIABLES`] is the list the runtime accepts; `docs/configuration.md`
//! gives each one's meaning, accepted values and default (one table, so the two cannot drift).
//!
//! Sizes take an optional binary suffix: `K`, `M`, `G` (powers of 1024). Booleans are
//! `1/0/true/false/on/off/yes/no`. An unknown `FERRY_*` variable is an error, so a misspelt knob
//! never goes unnoticed.

use ferry_base::error::{FerryError, Result};
use std::path::PathBuf;

/// Most CPU workers per rank: far above any node's cores, low enough that a mistyped value is an
/// error rather than an attempt to start billions of threads.
pub const MAX_WORKERS: usize = 4096;
/// Most exec streams per device.
pub const MAX_EXEC_STREAMS: usize = 256;
/// Most GPU tasks admitted per exec stream ahead of the priority queue.
pub const MAX_QUEUE_DEPTH: usize = 1024;
/// Largest device pool `FERRY_DEVICE_MEM` may ask for, bytes (1 PiB): sizes near `u64::MAX`
/// would overflow the pool's layout arithmetic.
pub const MAX_DEVICE_MEM: u64 = 1 << 50;
/// Longest injected delay (`FERRY_EMU_DELAY_US`, `FERRY_FAULTS`), µs.
pub const MAX_INJECTED_DELAY_US: u64 = 60_000_000;

mod variables;
pub use variables::{Variable, VARIABLES};

/// The memory tiers a run may use (`FERRY_LAYERS`), after DevitoPRO's `layers` option: for
/// tests and debugging, a tier can be taken out of the hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layers {
    /// Devices (GPU tasks run their GPU bodies).
    pub device: bool,
    /// Host memory keeps copies nobody uses (without it they go to disk at once).
    pub host: bool,
    /// The disk tier.
    pub disk: bool,
}

impl std::str::FromStr for Layers {
    type Err = FerryError;

    /// Parses a comma list of `device`, `host`, `disk` (at least one).
    fn from_str(v: &str) -> Result<Layers> {
        let mut l = Layers {
            device: false,
            host: false,
            disk: false,
        };
        for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.to_ascii_lowercase().as_str() {
                "device" => l.device = true,
                "host" => l.host = true,
                "disk" => l.disk = true,
                other => {
                    return Err(FerryError::Config(format!(
                        "FERRY_LAYERS={v:?}: unknown tier {other:?} (expected device, host, disk)"
                    )))
                }
            }
        }
        l.check()
            .map_err(|msg| FerryError::Config(format!("FERRY_LAYERS={v:?}: {msg}")))?;
        Ok(l)
    }
}

impl Layers {
    /// Whether the tiers combine: at least one, and host memory or the disk (tiles are created
    /// and read in host memory; without the host tier they go to disk at once).
    fn check(&self) -> std::result::Result<(), &'static str> {
        if !(self.device || self.host || self.disk) {
            return Err("name at least one tier");
        }
        if !self.host && !self.disk {
            return Err("tiles are created and read in host memory; without the host tier they need the disk tier");
        }
        Ok(())
    }
}

/// The runtime's knobs. Construct with [`Config::default`] and adjust, or read from the
/// environment with [`Config::from_env`].
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// CPU worker threads; `None` picks cores ÷ node-local ranks (at least 1).
    pub workers: Option<usize>,
    /// Whether idle threads yield their cores instead of spinning: `Some(true)` always,
    /// `Some(false)` never, `None` (the default) when the rank's workers outnumber its cores,
    /// or its cores cannot give one worker and each helper thread on the graph's critical path
    /// (the inserting thread, the progress thread when there are peers, the GPU manager when
    /// there are devices) a core of its own, as under a rank per core
    /// (`ferry_base::idle::oversubscribed`). Open MPI's `mpi_yield_when_idle` is the same switch
    /// for its own waits.
    pub yield_when_idle: Option<bool>,
    /// Whether `submit` is a task scheduling point (`FERRY_INSERTER_HELPS`): the inserting
    /// thread makes a progress pass and runs a few ready tasks after every second insertion.
    /// `Some(true)` always, `Some(false)` never, `None` (the default) where idle workers give
    /// way to the inserting thread (a rank per core without devices, see
    /// [`Config::yield_when_idle`]), so that the graph runs while it is inserted instead of
    /// after.
    pub inserter_helps: Option<bool>,
    /// Who drives MPI progress (`FERRY_MPI_PROGRESS`): `Some(false)` the progress thread alone,
    /// `Some(true)` idle workers and threads waiting in a collective, the progress thread only
    /// as a backstop (`ferry_comm::ProgressShare`; needs `MPI_THREAD_SERIALIZED`), `None` (the
    /// default) shared when idle threads yield their cores ([`Config::yield_when_idle`]) and the
    /// rank has peers, the progress thread alone otherwise.
    pub shared_progress: Option<bool>,
    /// With shared progress: the period, µs, at which the progress thread drives the loop when
    /// nobody else has since its last look (`FERRY_PROGRESS_BACKSTOP_US`, 1 to 1,000,000).
    pub progress_backstop_us: u64,
    /// Payloads of at most this many bytes are posted immediately, outside the send window.
    pub eager_bytes: usize,
    /// Rendezvous sends in flight per rank (≥ 1).
    pub max_sends: usize,
    /// Rendezvous sends in flight per destination rank (≥ 1).
    pub max_sends_per_peer: usize,
    /// Longest nap of the MPI progress thread while requests are in flight, in microseconds;
    /// `None`: 1 µs when the rank drives CUDA devices (each nap adds to the latency of every
    /// transfer: on 2× H200, IPC at 4 MiB × 8 in flight went from 98 to 260 GB/s with 1 µs
    /// instead of 50/100), else 50 µs (cores are scarce on CPU-only ranks).
    pub progress_sleep_us: Option<u64>,
    /// Longest nap of the GPU manager between event polls while work is in flight, µs; `None`:
    /// 1 µs with CUDA devices, else 100 µs.
    pub gpu_poll_us: Option<u64>,
    /// Directory for per-rank Chrome traces; `None` disables tracing to file.
    pub trace_dir: Option<PathBuf>,
    /// `tracing` env-filter directive for stderr logs.
    pub log_filter: String,
    /// `tracing` env-filter directive for the trace files (`FERRY_TRACE_FILTER`, default
    /// `info`: every span and event ferry writes). `ferry::gpu=info,ferry::clock=info` keeps
    /// only the device streams, which costs the manager least.
    pub trace_filter: String,
    /// Call `MPI_Abort` at shutdown after an error.
    pub abort_on_error: bool,
    /// Fault injection (`FERRY_FAULTS`): a test-only knob, set through [`Config::apply_vars`] or
    /// the environment, so not part of the public configuration.
    pub(crate) faults: ferry_base::faults::Faults,
    /// The submission window: most unfinished local graph nodes (tasks, sends, receives) before
    /// insertion blocks until half of them have finished; 0 = unbounded (`graph/window.rs`).
    pub submit_window: usize,
    /// Seconds without any finished task or transfer (while work is outstanding) before the
    /// watchdog reports what the rank waits for and fails the run; 0 disables it.
    pub watchdog_s: u64,
    /// Which devices to use.
    pub devices: crate::DeviceSpec,
    /// Fraction of each GPU's free memory its pool reserves at start-up, in (0, 1].
    pub device_mem_fraction: f64,
    /// Exact pool bytes per device (overrides the fraction; the capacity of emulated devices,
    /// 256 MiB when unset).
    pub device_mem: Option<u64>,
    /// Exec streams per device (≥ 1); `None` picks 8 for CUDA (measured on H200: tiled Cholesky
    /// at N = 32768 reaches cuSOLVER with 8, 0.96× with 4) and 4 for emulated devices.
    pub exec_streams: Option<usize>,
    /// GPU tasks admitted per exec stream past the per-device priority queue (≥ 1).
    pub device_queue_depth: usize,
    /// Bytes of the registered (pinned) host pool tile buffers come from when devices are in use;
    /// `None` picks 4 GiB for CUDA and 64 MiB for emulated devices; `Some(0)` turns it off.
    pub host_pinned_bytes: Option<u64>,
    /// Bytes of the CUDA host pool pinned before the runtime starts; `None` (the default) pins
    /// it whole then. With less, the rest is pinned on a thread of its own meanwhile, in parts of
    /// up to 1 GiB, during each of which the process's other CUDA calls wait, and no buffer
    /// larger than a part is pinned (see `docs/tuning.md`).
    pub host_pin_at_start: Option<u64>,
    /// Fault injection of the emulated devices (`FERRY_EMU_*`): test-only knobs, set from the
    /// environment only, so not part of the public configuration.
    pub(crate) emu_faults: EmuFaults,
    /// Whether device memory is handed to MPI.
    pub gpu_direct: ferry_transfer::GpuDirect,
    /// Payload path between ranks (`Auto` chooses per pair).
    pub transfer_path: ferry_transfer::TransferPath,
    /// Bytes of the pinned bounce pool (staged transfers of device data).
    pub bounce_bytes: usize,
    /// Chunk size of staged transfers, bytes (≥ 4 KiB, ≤ `bounce_bytes`).
    pub bounce_chunk: usize,
    /// CUDA: device-to-device copies of at most this many bytes are made by a copy kernel
    /// (`ferry-device/src/sm_copy.rs`) instead of a copy engine; 0 turns the kernel off.
    pub sm_copy_bytes: usize,
    /// Thread blocks of 256 threads per copy of the copy kernel, at most (≥ 1).
    pub sm_copy_blocks: usize,
    /// Tiles of at most this many bytes that one task reads from one rank are packed into one
    /// message (host and staged routes); 0 turns packing off.
    pub pack_bytes: usize,
    /// Host tier budget per rank in bytes (overrides the fraction).
    pub host_mem_limit: Option<u64>,
    /// Host tier budget as a fraction of the node's memory divided by its ranks, in (0, 1];
    /// `None`: 0.5 when the disk tier is on, else no budget.
    pub host_mem_fraction: Option<f64>,
    /// Directory of the disk tier; `Some` turns the tier on.
    pub spill_dir: Option<PathBuf>,
    /// Disk tier budget per rank in bytes; `None`: `spill_fraction` of the free space at
    /// start-up divided by the node's ranks.
    pub spill_bytes: Option<u64>,
    /// Fraction of the spill file system's free space the disk tier may take, in (0, 1].
    pub spill_fraction: f64,
    /// Tiers in use; `None`: devices and host, plus disk when `spill_dir` is set.
    pub layers: Option<Layers>,
    /// Tasks of the inserted sequence, past the oldest not yet dispatched, whose spilled inputs
    /// the I/O thread loads ahead (0: no prefetching).
    pub prefetch_tasks: usize,
    /// Fraction of a device pool kept clean by early write-backs, in [0, 0.5].
    pub device_low_water: f64,
    /// Stage tiles in from other devices of the rank over peer links.
    pub peer_copy: bool,
    /// Launch-ahead: a GPU task's GPU successors are released when it is launched and ordered
    /// after it on the device (`FERRY_LAUNCH_AHEAD`; `off` to measure what it saves).
    pub launch_ahead: bool,
    /// Fused replays: on a rank with one device, the GPU tasks of a replayed trace that moves
    /// nothing between ranks run as one launch, a CUDA graph captured once
    /// (`FERRY_TRACE_GRAPHS`; `off` to replay task by task).
    pub trace_graphs: bool,
    /// Stream affinity: a GPU task launched ahead goes onto the exec stream of a predecessor it
    /// follows when that predecessor is the newest task there and the stream is of the task's
    /// priority class, so stream order replaces a wait between streams
    /// (`FERRY_STREAM_AFFINITY`; `off` to measure what it saves).
    pub stream_affinity: bool,
    /// comm-in ahead: the GPU consumers of a tile received into device memory by a copy the GPU
    /// manager enqueues (an IPC pull, the host→device leg of the staged path) are launched
    /// behind that copy, their stream ordered after its event, instead of after its completion
    /// has been seen on the host (`FERRY_COMM_IN_AHEAD`; `off` to measure what it saves).
    pub comm_in_ahead: bool,
    /// Offers at launch: the IPC sends of a GPU task's outputs leave when the task is launched;
    /// the consumer's pull waits on its device for a signal the producer's stream writes after
    /// the task, instead of the send waiting for the task's completion to be seen on the host
    /// (`FERRY_OFFER_AT_LAUNCH`; `off` to measure what it saves).
    pub offer_at_launch: bool,
    /// How long, µs, the consumer's GPU manager holds a pull offered at launch until the
    /// producer's signal shows in the host mirror that the producer's stream writes next to
    /// the device word (`ferry-device/src/signal_mirror.rs`): seen there, the pull is enqueued with no
    /// stream wait; still held after this, it waits on the device as it would with 0
    /// (`FERRY_OFFER_POLL_US`, at most 1 000 000). Pulls that ask for a device acknowledgement
    /// are held until their signal shows, however long.
    pub offer_poll_us: u64,
    /// Device acknowledgements: an IPC send asks its consumer to write a word of the producer's
    /// signal area after its pull, and the tasks that overwrite the sent tile are launched at
    /// once, their stream waiting for that word, instead of after the consumer's host
    /// acknowledgement (`FERRY_DEVICE_ACK`: `auto`, the default, for tasks that could wait for
    /// two acknowledgements or more; `on` for every overwriting GPU task; `off`). Sends offered at launch ask where
    /// their rank publishes signal mirrors (the consumer then holds those pulls on the host
    /// until the signal shows). See [`crate::DeviceAcks`] for what was measured.
    pub device_ack: crate::DeviceAcks,
    /// The control ring: between ranks of one node with devices, transfer descriptors and
    /// acknowledgements go through rings in shared memory, written by whichever thread sends
    /// and read by the MPI thread, instead of through MPI (`FERRY_CONTROL_RING`).
    pub control_ring: bool,
    /// Renaming past sends: a write-only access to a tile that a send still reads writes a fresh
    /// copy instead of waiting for the send — on the IPC route, for the peer's
    /// acknowledgement (`FERRY_RENAME_SENT`; `off` to measure what it saves).
    pub rename_sent: bool,
    /// Time the GPU manager thread by phase — commands, copies, launches, polls, finalization,
    /// callbacks, idle — into the statistics (`FERRY_GPU_PHASES`; off by default: about six
    /// clock reads per task, 6–7% of the empty-GPU-task rate on H200).
    pub gpu_phases: bool,
    /// Bind the runtime's threads near their devices (`true`: `FERRY_BIND=auto`).
    pub bind: bool,
}

/// Fault injection of the emulated devices, for the tests of the device lifecycle.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct EmuFaults {
    /// 1-based pool allocation attempts that fail (`FERRY_EMU_FAIL_ALLOC`).
    pub(crate) fail_alloc: Vec<u64>,
    /// 1-based single copies (host↔device and device↔device, counted on this rank as they are
    /// enqueued; batched IPC pulls aside) whose enqueueing fails (`FERRY_EMU_FAIL_COPY`).
    pub(crate) fail_copy: Vec<u64>,
    /// Upper bound of each stream operation's extra delay, µs (`FERRY_EMU_DELAY_US`).
    pub(crate) delay_us: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workers: None,
            yield_when_idle: None,
            inserter_helps: None,
            shared_progress: None,
            progress_backstop_us: ferry_engine::DEFAULT_BACKSTOP.as_micros() as u64,
            eager_bytes: 64 << 10,
            max_sends: 64,
            max_sends_per_peer: 16,
            progress_sleep_us: None,
            gpu_poll_us: None,
            trace_dir: None,
            log_filter: "warn".into(),
            trace_filter: "info".into(),
            abort_on_error: true,
            faults: ferry_base::faults::Faults::default(),
            // PaRSEC's DTD window is 8 000 tasks. 16 384 nodes kept a 10⁶-task Task Bench run
            // at 45 MB (250 MB unbounded) and ran it 5–20% faster, and stay far ahead of any device's or worker pool's queues.
            submit_window: 1 << 14,
            watchdog_s: 300,
            devices: crate::DeviceSpec::None,
            device_mem_fraction: 0.9,
            device_mem: None,
            exec_streams: None,
            device_queue_depth: 2,
            host_pinned_bytes: None,
            host_pin_at_start: None,
            emu_faults: EmuFaults::default(),
            gpu_direct: ferry_transfer::GpuDirect::Auto,
            transfer_path: ferry_transfer::TransferPath::Auto,
            bounce_bytes: 64 << 20,
            // 1 MiB: D2H, send and upload of one tile overlap chunk by chunk. On 2× H200, 8 in
            // flight, staged 4M/64M/256M went 7.0–7.4/4.9–5.1/4.9 GB/s with 4 MiB chunks against
            // 8.3/5.7–6.2/5.3–5.9 with 1 MiB.
            bounce_chunk: 1 << 20,
            // Batches of pulls up to 4 MiB by the copy kernel (lone copies stay on the copy
            // engines, and the kernel is compiled at start-up): on 2× H200, IPC 4M × 8 with a
            // task per round 307–312 GB/s against 273–277, the slab stencil 0.0495–0.0505 s
            // against 0.0523–0.0530, nothing slower, once lone pulls stayed on the copy engines and
            // the kernel was compiled at start-up (before, each lone pull paid a launch and the
            // lazy NVRTC compile fell inside timed runs).
            sm_copy_bytes: 4 << 20,
            sm_copy_blocks: 64,
            // Off: packing measured 1.6–1.9× slower on the GPU machine (`ferry-transfer/src/packed.rs`).
            pack_bytes: 0,
            host_mem_limit: None,
            host_mem_fraction: None,
            spill_dir: None,
            spill_bytes: None,
            spill_fraction: 0.9,
            layers: None,
            prefetch_tasks: 16,
            device_low_water: 0.05,
            peer_copy: true,
            launch_ahead: false,
            trace_graphs: true,
            stream_affinity: true,
            comm_in_ahead: true,
            offer_at_launch: true,
            offer_poll_us: 50,
            device_ack: crate::DeviceAcks::Auto,
            control_ring: true,
            rename_sent: true,
            gpu_phases: false,
            bind: true,
        }
    }
}

/// The process environment's `FERRY_*` variables as `(name, value)` pairs, in environment order
/// (what [`Config::from_env`] applies; tools print them). Other variables are skipped unread:
/// one that is not UTF-8 (which `std::env::vars` would panic on) concerns some other program.
///
/// # Errors
/// [`FerryError::Config`] for a `FERRY_*` variable whose value is not UTF-8.
pub fn ferry_vars() -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (k, v) in std::env::vars_os() {
        let name = k.to_string_lossy();
        if !name.starts_with("FERRY_") {
            continue;
        }
        match (k.to_str(), v.into_string()) {
            (Some(k), Ok(v)) => out.push((k.to_string(), v)),
            _ => {
                return Err(FerryError::Config(format!(
                    "environment variable {name}: not valid UTF-8"
                )))
            }
        }
    }
    Ok(out)
}

impl Config {
    /// Reads every `FERRY_*` variable of the process environment over the defaults.
    ///
    /// # Errors
    /// [`FerryError::Config`] for an unparsable value or an unknown `FERRY_*` variable.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        c.apply_vars(ferry_vars()?)?;
        Ok(c)
    }

    /// Applies `(name, value)` pairs over this configuration; names not starting with `FERRY_`
    /// are ignored. Used by [`Config::from_env`]; public so that tools can apply a saved
    /// environment.
    ///
    /// # Errors
    /// [`FerryError::Config`] for an unparsable value or an unknown `FERRY_*` variable.
    pub fn apply_vars<I, K, V>(&mut self, vars: I) -> Result<()>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        for (k, v) in vars {
            let (k, v) = (k.as_ref(), v.as_ref().trim());
            if !k.starts_with("FERRY_") {
                continue;
            }
            match VARIABLES.iter().find(|x| x.name == k) {
                Some(x) => (x.set)(self, k, v)?,
                None => {
                    let known: Vec<&str> = VARIABLES.iter().map(|x| x.name).collect();
                    return Err(FerryError::Config(format!(
                        "unknown variable {k}; known: {}",
                        known.join(", ")
                    )));
                }
            }
        }
        self.validate()
    }

    /// Checks the invariants between fields.
    ///
    /// # Errors
    /// [`FerryError::Config`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if let Some(w) = self.workers.filter(|w| !(1..=MAX_WORKERS).contains(w)) {
            return Err(FerryError::Config(format!(
                "{w} workers: must be between 1 and {MAX_WORKERS} (FERRY_WORKERS)"
            )));
        }
        if self.max_sends == 0 || self.max_sends_per_peer == 0 {
            return Err(FerryError::Config("send windows must be at least 1".into()));
        }
        // Checked here too: a `Layers` built in code does not go through `FromStr`.
        if let Some(l) = &self.layers {
            l.check()
                .map_err(|msg| FerryError::Config(format!("layers {l:?}: {msg} (FERRY_LAYERS)")))?;
        }
        if !(self.device_mem_fraction > 0.0 && self.device_mem_fraction <= 1.0) {
            return Err(FerryError::Config(format!(
                "device memory fraction {} must be in (0, 1]",
                self.device_mem_fraction
            )));
        }
        if let Some(n) = self.exec_streams.filter(|n| !(1..=MAX_EXEC_STREAMS).contains(n)) {
            return Err(FerryError::Config(format!(
                "{n} exec streams: must be between 1 and {MAX_EXEC_STREAMS} (FERRY_EXEC_STREAMS)"
            )));
        }
        if self.device_queue_depth > MAX_QUEUE_DEPTH {
            return Err(FerryError::Config(format!(
                "{} GPU tasks per exec stream: at most {MAX_QUEUE_DEPTH} (FERRY_DEVICE_QUEUE_DEPTH)",
                self.device_queue_depth
            )));
        }
        if let Some(b) = self.device_mem.filter(|&b| b > MAX_DEVICE_MEM) {
            return Err(FerryError::Config(format!(
                "a device pool of {b} bytes: at most {MAX_DEVICE_MEM} (FERRY_DEVICE_MEM)"
            )));
        }
        for (name, us) in [
            ("FERRY_EMU_DELAY_US", self.emu_faults.delay_us),
            ("FERRY_FAULTS mpi-delay", self.faults.mpi_delay_us),
            ("FERRY_FAULTS sched-jitter", self.faults.sched_jitter_us),
        ] {
            if us > MAX_INJECTED_DELAY_US {
                return Err(FerryError::Config(format!(
                    "{name}: {us} µs, at most {MAX_INJECTED_DELAY_US} (one minute)"
                )));
            }
        }
        if self.bounce_chunk < 4096 || self.bounce_chunk > i32::MAX as usize {
            return Err(FerryError::Config(format!(
                "bounce chunk of {} bytes: must be between 4K and 2 GiB (one MPI message)",
                self.bounce_chunk
            )));
        }
        if let Some(f) = self.host_mem_fraction {
            if !(f > 0.0 && f <= 1.0) {
                return Err(FerryError::Config(format!(
                    "host memory fraction {f} must be in (0, 1] (FERRY_HOST_MEM_FRACTION)"
                )));
            }
        }
        if !(self.spill_fraction > 0.0 && self.spill_fraction <= 1.0) {
            return Err(FerryError::Config(format!(
                "spill fraction {} must be in (0, 1] (FERRY_SPILL_FRACTION)",
                self.spill_fraction
            )));
        }
        if !(0.0..=0.5).contains(&self.device_low_water) {
            return Err(FerryError::Config(format!(
                "device low-water mark {} must be in [0, 0.5] (FERRY_DEVICE_LOW_WATER)",
                self.device_low_water
            )));
        }
        if self.spill_bytes == Some(0) {
            return Err(FerryError::Config(
                "a disk tier of 0 bytes cannot hold anything (FERRY_SPILL_BYTES)".into(),
            ));
        }
        if self.sm_copy_blocks == 0 || self.sm_copy_blocks > 65_535 {
            return Err(FerryError::Config(format!(
                "{} thread blocks per copy: must be between 1 and 65535 (FERRY_SM_COPY_BLOCKS)",
                self.sm_copy_blocks
            )));
        }
        if self.bounce_bytes < self.bounce_chunk {
            return Err(FerryError::Config(format!(
                "bounce pool of {} bytes cannot hold one chunk of {} bytes (FERRY_BOUNCE_BYTES, FERRY_BOUNCE_CHUNK)",
                self.bounce_bytes, self.bounce_chunk
            )));
        }
        Ok(())
    }
}

impl Config {
    /// The options of the communication engine the runtime runs on (`cuda`: this rank drives
    /// CUDA devices). The runtime's GPU manager allocates the device pools and its transfer
    /// layer builds its routes on the engine's messages; the engine takes the same kind of
    /// devices so that it registers those pools and maps the node's other ranks' pools for
    /// their peer copies (it opens a CUDA context only for a device it touches, and pins bounce
    /// buffers only if it stages, which this runtime never asks). It receives no active
    /// messages (its idle progress thread then blocks until the next operation); whether idle
    /// threads yield, and whether they drive progress, is decided once the devices are open,
    /// so the loop is started able to be shared later unless `FERRY_MPI_PROGRESS=thread` says
    /// it never will be.
    pub(crate) fn engine(&self, cuda: bool) -> ferry_engine::EngineConfig {
        let devices = match self.devices {
            crate::DeviceSpec::Emu(k) => ferry_engine::Devices::Emulated(k),
            _ if cuda => ferry_engine::Devices::Cuda,
            _ => ferry_engine::Devices::None,
        };
        ferry_engine::EngineConfig {
            progress: ferry_engine::Progress::Thread,
            progress_sleep_us: self.progress_sleep_us,
            yield_when_idle: Some(false),
            devices,
            // Peer mappings only: no placed gets, and one bounce buffer per direction should
            // anything ever stage.
            placement_arena: 0,
            bounce_slots: 1,
            // The transfer layer decides GPU-direct per peer itself (`FERRY_GPU_DIRECT`).
            gpu_direct: ferry_engine::GpuDirect::Off,
            max_sends: self.max_sends,
            max_sends_per_peer: self.max_sends_per_peer,
            share_later: self.shared_progress != Some(false),
            active_messages: false,
            faults: self.faults,
            ..Default::default()
        }
    }
}

/// A list of 1-based indices such as `3,7,8` (fault injection).
fn parse_indices(k: &str, v: &str) -> Result<Vec<u64>> {
    v.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| x.trim().parse::<u64>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| FerryError::Config(format!("{k}={v:?}: expected a list like 3,7,8")))
}

fn parse_count(name: &str, v: &str, min: usize) -> Result<usize> {
    let n: usize = v
        .parse()
        .map_err(|_| FerryError::Config(format!("{name}={v:?}: expected a whole number")))?;
    if n < min {
        return Err(FerryError::Config(format!("{name}={n}: must be at least {min}")));
    }
    Ok(n)
}

/// Parses `123`, `64K`, `8M`, `1G` (binary multiples).
pub(crate) fn parse_size(name: &str, v: &str) -> Result<usize> {
    let bad = || FerryError::Config(format!("{name}={v:?}: expected bytes like 65536, 64K, 8M, 1G"));
    let (digits, shift) = match v.as_bytes().last().map(|b| b.to_ascii_uppercase()) {
        Some(b'K') => (&v[..v.len() - 1], 10),
        Some(b'M') => (&v[..v.len() - 1], 20),
        Some(b'G') => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    let n: usize = digits.trim().parse().map_err(|_| bad())?;
    n.checked_mul(1usize << shift).ok_or_else(bad)
}

fn parse_fraction(name: &str, v: &str) -> Result<f64> {
    v.parse::<f64>()
        .ok()
        .filter(|f| f.is_finite())
        .ok_or_else(|| FerryError::Config(format!("{name}={v:?}: expected a number like 0.5")))
}

/// The tiers in force and their budgets, resolved from the configuration and the node.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TierPlan {
    pub(crate) devices: bool,
    /// Host budget per rank in bytes; `None`: no budget (no host tier bookkeeping at all).
    pub(crate) host_limit: Option<u64>,
    /// Spill directory and budget, when the disk tier is on.
    pub(crate) disk: Option<(PathBuf, u64)>,
}

impl Config {
    /// Resolves layers, budgets and directories for a rank that shares its node with
    /// `local_ranks` ranks and `node_memory` bytes.
    ///
    /// # Errors
    /// [`FerryError::Config`] when the layers ask for something the other settings contradict.
    pub(crate) fn tier_plan(&self, local_ranks: usize, node_memory: u64) -> Result<TierPlan> {
        let layers = self.layers.unwrap_or(Layers {
            device: true,
            host: true,
            disk: self.spill_dir.is_some(),
        });
        if self.spill_dir.is_some() && !layers.disk {
            return Err(FerryError::Config(
                "FERRY_SPILL_DIR is set but FERRY_LAYERS leaves out the disk tier".into(),
            ));
        }
        let share = node_memory / local_ranks.max(1) as u64;
        let disk = layers.disk.then(|| {
            let dir = self
                .spill_dir
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("ferry-spill"));
            let budget = self.spill_bytes.unwrap_or_else(|| {
                let free = ferry_memory::tier::DiskStore::free_space(&dir).unwrap_or(0);
                (free as f64 * self.spill_fraction) as u64 / local_ranks.max(1) as u64
            });
            (dir, budget)
        });
        let host_limit = if !layers.host {
            Some(0)
        } else if let Some(b) = self.host_mem_limit {
            Some(b)
        } else if let Some(f) = self.host_mem_fraction {
            Some((share as f64 * f) as u64)
        } else if disk.is_some() {
            Some(share / 2)
        } else {
            None
        };
        Ok(TierPlan {
            devices: layers.device,
            host_limit,
            disk,
        })
    }
}

/// `auto` as `None`, else a switch as [`parse_bool`] takes it.
fn parse_auto_bool(name: &str, v: &str) -> Result<Option<bool>> {
    if v.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    parse_bool(name, v)
        .map(Some)
        .map_err(|_| FerryError::Config(format!("{name}={v:?}: expected auto, on or off")))
}

fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(FerryError::Config(format!(
            "{name}={v:?}: expected 1/0/true/false/on/off"
        ))),
    }
}

#[cfg(test)]
mod tests;
