//! The table of `FERRY_*` variables: each declared once, with its description and its parser.

use super::*;

/// One `FERRY_*` variable: its name, a one-line description (error messages list them), and how
/// its value sets the configuration. [`VARIABLES`] declares each variable once; a unit test
/// checks that `docs/configuration.md` documents exactly these.
pub struct Variable {
    /// The variable's name (`FERRY_…`).
    pub name: &'static str,
    /// What it sets, in one line.
    pub about: &'static str,
    /// Parses `value` of variable `name` into the configuration.
    pub(super) set: fn(&mut Config, &str, &str) -> Result<()>,
}

impl std::fmt::Debug for Variable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name)
    }
}

/// Every variable this module understands.
pub static VARIABLES: &[Variable] = &[
    Variable {
        name: "FERRY_WORKERS",
        about: "CPU worker threads per rank",
        set: |c, k, v| {
            c.workers = Some(parse_count(k, v, 1)?);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_YIELD_WHEN_IDLE",
        about: "idle threads yield their cores instead of spinning: auto (when the rank's threads outnumber its cores), on, off",
        set: |c, k, v| {
            c.yield_when_idle = parse_auto_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_INSERTER_HELPS",
        about: "the inserting thread runs ready tasks and progress passes between insertions: auto (on a rank per core without devices), on, off",
        set: |c, k, v| {
            c.inserter_helps = parse_auto_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_MPI_PROGRESS",
        about: "who drives MPI progress: auto (idle workers when idle threads yield their cores, else the progress thread), thread, shared",
        set: |c, k, v| {
            c.shared_progress = match v.to_ascii_lowercase().as_str() {
                "auto" => None,
                "thread" => Some(false),
                "shared" => Some(true),
                _ => {
                    return Err(FerryError::Config(format!(
                        "{k}={v:?}: expected auto, thread or shared"
                    )))
                }
            };
            Ok(())
        },
    },
    Variable {
        name: "FERRY_EAGER_BYTES",
        about: "eager payload threshold in bytes (K/M/G suffixes)",
        set: |c, k, v| {
            c.eager_bytes = parse_size(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_MAX_SENDS",
        about: "rendezvous sends in flight per rank",
        set: |c, k, v| {
            c.max_sends = parse_count(k, v, 1)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_MAX_SENDS_PER_PEER",
        about: "rendezvous sends in flight per destination",
        set: |c, k, v| {
            c.max_sends_per_peer = parse_count(k, v, 1)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_PROGRESS_BACKSTOP_US",
        about: "with shared MPI progress: how often the progress thread drives when nobody else did, microseconds",
        set: |c, k, v| {
            let us = parse_count(k, v, 1)?;
            if us > 1_000_000 {
                return Err(FerryError::Config(format!("{k}={v:?}: at most 1000000 (1 s)")));
            }
            c.progress_backstop_us = us as u64;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_PROGRESS_SLEEP_US",
        about: "longest idle nap of the MPI thread, microseconds",
        set: |c, k, v| {
            c.progress_sleep_us = Some(parse_count(k, v, 0)? as u64);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_GPU_POLL_US",
        about: "longest nap of the GPU manager between event polls, microseconds",
        set: |c, k, v| {
            c.gpu_poll_us = Some(parse_count(k, v, 1)? as u64);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_TRACE",
        about: "directory for per-rank Chrome traces",
        set: |c, _, v| {
            c.trace_dir = (!v.is_empty()).then(|| PathBuf::from(v));
            Ok(())
        },
    },
    Variable {
        name: "FERRY_TRACE_FILTER",
        about: "tracing filter for the trace files",
        set: |c, _, v| {
            c.trace_filter = v.to_string();
            Ok(())
        },
    },
    Variable {
        name: "FERRY_LOG",
        about: "tracing filter for stderr logs",
        set: |c, _, v| {
            c.log_filter = v.to_string();
            Ok(())
        },
    },
    Variable {
        name: "FERRY_ABORT_ON_ERROR",
        about: "MPI_Abort after an error with transfers in flight",
        set: |c, k, v| {
            c.abort_on_error = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_FAULTS",
        about: "fault injection (mpi-delay:US, sched-jitter:US, slow-link:MBPS, disk-fail:N)",
        set: |c, _, v| {
            c.faults = v.parse()?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_WATCHDOG_S",
        about: "seconds without progress before the watchdog fails the run",
        set: |c, k, v| {
            c.watchdog_s = parse_count(k, v, 0)? as u64;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_DEVICES",
        about: "none, cuda, auto or emu:K",
        set: |c, _, v| {
            c.devices = v.parse()?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_DEVICE_MEM_FRACTION",
        about: "fraction of free GPU memory for the pool",
        set: |c, k, v| {
            c.device_mem_fraction = parse_fraction(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_DEVICE_MEM",
        about: "exact device pool bytes",
        set: |c, k, v| {
            c.device_mem = Some(parse_size(k, v)? as u64);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_EXEC_STREAMS",
        about: "exec streams per device",
        set: |c, k, v| {
            c.exec_streams = Some(parse_count(k, v, 1)?);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_DEVICE_QUEUE_DEPTH",
        about: "GPU tasks admitted per exec stream",
        set: |c, k, v| {
            c.device_queue_depth = parse_count(k, v, 1)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_HOST_PINNED_BYTES",
        about: "registered host pool bytes",
        set: |c, k, v| {
            c.host_pinned_bytes = Some(parse_size(k, v)? as u64);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_HOST_PIN_AT_START",
        about: "host pool bytes pinned before the runtime starts (the rest in the background)",
        set: |c, k, v| {
            c.host_pin_at_start = Some(parse_size(k, v)? as u64);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_EMU_FAIL_ALLOC",
        about: "emulated allocation attempts that fail",
        set: |c, k, v| {
            c.emu_faults.fail_alloc = parse_indices(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_EMU_FAIL_COPY",
        about: "emulated copies that fail",
        set: |c, k, v| {
            c.emu_faults.fail_copy = parse_indices(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_CHECK_COHERENCE",
        about: "debugging: hash copies at every hand-off",
        set: |_, k, v| {
            parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_EMU_DELAY_US",
        about: "emulated stream operation delay bound, microseconds",
        set: |c, k, v| {
            c.emu_faults.delay_us = parse_count(k, v, 0)? as u64;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_GPU_DIRECT",
        about: "auto, on, force or off: hand device memory to MPI",
        set: |c, _, v| {
            c.gpu_direct = v.parse()?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_TRANSFER_PATH",
        about: "auto, host, staged, gpu-direct or ipc",
        set: |c, _, v| {
            c.transfer_path = v.parse()?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_BOUNCE_BYTES",
        about: "pinned bounce pool bytes",
        set: |c, k, v| {
            c.bounce_bytes = parse_size(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_BOUNCE_CHUNK",
        about: "staged transfer chunk bytes",
        set: |c, k, v| {
            c.bounce_chunk = parse_size(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_SM_COPY_BYTES",
        about: "device-to-device copies up to this size by a copy kernel (0: off)",
        set: |c, k, v| {
            c.sm_copy_bytes = parse_size(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_SM_COPY_BLOCKS",
        about: "thread blocks per copy of the copy kernel",
        set: |c, k, v| {
            c.sm_copy_blocks = parse_count(k, v, 1)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_PACK_BYTES",
        about: "tiles up to this size read by one task from one rank travel as one message",
        set: |c, k, v| {
            c.pack_bytes = parse_size(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_HOST_MEM_LIMIT",
        about: "host tier budget per rank, bytes",
        set: |c, k, v| {
            c.host_mem_limit = Some(parse_size(k, v)? as u64);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_HOST_MEM_FRACTION",
        about: "host tier budget as a fraction of node memory per rank",
        set: |c, k, v| {
            c.host_mem_fraction = Some(parse_fraction(k, v)?);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_SPILL_DIR",
        about: "directory of the disk tier",
        set: |c, _, v| {
            c.spill_dir = (!v.is_empty()).then(|| PathBuf::from(v));
            Ok(())
        },
    },
    Variable {
        name: "FERRY_SPILL_BYTES",
        about: "disk tier budget per rank, bytes",
        set: |c, k, v| {
            c.spill_bytes = Some(parse_size(k, v)? as u64);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_SPILL_FRACTION",
        about: "disk tier budget as a fraction of free space per rank",
        set: |c, k, v| {
            c.spill_fraction = parse_fraction(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_LAYERS",
        about: "memory tiers in use: device, host, disk",
        set: |c, _, v| {
            c.layers = Some(v.parse()?);
            Ok(())
        },
    },
    Variable {
        name: "FERRY_PEER_COPY",
        about: "stage tiles in from other devices over peer links",
        set: |c, k, v| {
            c.peer_copy = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_LAUNCH_AHEAD",
        about: "release GPU successors of a GPU task when it is launched",
        set: |c, k, v| {
            c.launch_ahead = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_TRACE_GRAPHS",
        about: "run the GPU tasks of a replayed trace as one CUDA graph (one device per rank)",
        set: |c, k, v| {
            c.trace_graphs = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_STREAM_AFFINITY",
        about: "a GPU task launched ahead follows its predecessor onto its stream",
        set: |c, k, v| {
            c.stream_affinity = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_GPU_PHASES",
        about: "time the GPU manager thread by phase (statistics)",
        set: |c, k, v| {
            c.gpu_phases = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_COMM_IN_AHEAD",
        about: "launch the GPU consumers of received data behind its comm-in copy",
        set: |c, k, v| {
            c.comm_in_ahead = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_RENAME_SENT",
        about: "a write-only access to a tile a send still reads gets a fresh copy",
        set: |c, k, v| {
            c.rename_sent = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_OFFER_AT_LAUNCH",
        about: "send a GPU task's outputs over IPC at its launch, the pull ordered after it",
        set: |c, k, v| {
            c.offer_at_launch = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_OFFER_POLL_US",
        about: "µs an offered pull is held until its producer's signal shows on the host (0: none)",
        set: |c, k, v| {
            c.offer_poll_us = parse_count(k, v, 0)? as u64;
            if c.offer_poll_us > 1_000_000 {
                return Err(FerryError::Config(format!("{k}={v}: at most 1000000 (1 s)")));
            }
            Ok(())
        },
    },
    Variable {
        name: "FERRY_DEVICE_ACK",
        about: "auto, on or off: IPC consumers acknowledge on the device; the sent tile's next writers wait there",
        set: |c, _, v| {
            c.device_ack = v.parse()?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_CONTROL_RING",
        about: "IPC descriptors and acknowledgements through shared memory instead of MPI",
        set: |c, k, v| {
            c.control_ring = parse_bool(k, v)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_BIND",
        about: "thread placement: auto or none",
        set: |c, k, v| {
            c.bind = match v {
                "auto" => true,
                "none" => false,
                _ => return Err(FerryError::Config(format!("{k}={v:?}: expected auto or none"))),
            };
            Ok(())
        },
    },
    Variable {
        name: "FERRY_SUBMIT_WINDOW",
        about: "unfinished local tasks and transfers before insertion blocks (0: unbounded)",
        set: |c, k, v| {
            c.submit_window = parse_count(k, v, 0)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_PREFETCH_TASKS",
        about: "tasks ahead whose spilled inputs are loaded early",
        set: |c, k, v| {
            c.prefetch_tasks = parse_count(k, v, 0)?;
            Ok(())
        },
    },
    Variable {
        name: "FERRY_DEVICE_LOW_WATER",
        about: "fraction of a device pool kept clean by early write-backs",
        set: |c, k, v| {
            c.device_low_water = parse_fraction(k, v)?;
            Ok(())
        },
    },
];
