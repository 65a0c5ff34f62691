//! Transfer benchmark: tiles produced on rank 0's device move to rank 1's device, over each
//! payload path in turn, within one run.
//!
//! Per (path, tile size, tiles in flight): rank 0 stamps each of `k` tiles (a device-side fill
//! with a value unique to the round), rank 1 reads them (the transfer) in a `sink` that writes a
//! small tile of its own; rounds follow each other (the next stamp of a tile waits for the send
//! of the previous one), so `k` transfers are in flight. GB/s = bytes moved / wall time of the
//! rounds between two `wait`s. With emulated devices the sink checks the stamp, so the run also
//! proves the bytes arrived; on every backend rank 0 reads its tiles back after the timed rounds
//! and checks their last stamp (every word on CUDA, where the stamp is a device fill).
//!
//! `--tasks` says how the tiles of a round are produced and consumed: `per-tile` (a stamp and a
//! sink task per tile: the rate of a graph of small tasks, which the GPU managers' per-task cost
//! bounds as much as the transfer) or `per-round` (one stamp task writes the round's `k` tiles
//! and one sink reads them all: the transfer path itself, as the anchors measure it, with one
//! task per side and round). On CUDA a per-round stamp writes its tiles with one fill kernel
//! (`ferry_kernels::fill`), a per-tile stamp with one `cuMemsetD32Async`.
//!
//! Anchors measured in the same run on rank 0 when CUDA is present: the bare peer copy
//! (`cuMemcpyPeerAsync` on four streams; needs a second visible GPU), the same copies pulled by
//! one launch of a copy kernel (which the copy engines' per-call cost does not bound: at 1 MiB it
//! is the better ceiling), pinned H2D/D2H (the legs of the staged path), the host cost of the
//! driver calls the GPU manager makes, and the round-trip latency of a signal between the GPUs.
//! The MPI leg is the `mpi-host` row: the same graph with host-resident tiles over plain MPI.

use anyhow::{bail, Context};
use clap::Parser;
use ferry::{Distribution, Runtime, Task, TaskClass, TransferPath};
use ferry_examples::{main_with_runtime, write_json};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

// mimalloc underneath: ferry's threads free what other threads allocated (see `alloc`).
#[global_allocator]
static ALLOC: ferry_examples::alloc::Counting = ferry_examples::alloc::Counting;

#[derive(Parser, Debug)]
#[command(about = "Rank 0's device → rank 1's device, over every payload path (mpirun -np 2)")]
struct Args {
    /// Tile sizes in bytes (K/M/G suffixes), comma-separated.
    #[arg(long, default_value = "64K,1M,4M,16M,64M,256M", value_delimiter = ',')]
    sizes: Vec<String>,
    /// Tiles in flight, comma-separated.
    #[arg(long, default_value = "1,8,16", value_delimiter = ',')]
    inflight: Vec<usize>,
    /// Paths: host, staged, gpu-direct, ipc, mpi-host (host-resident tiles over plain MPI);
    /// `all` tries each and skips those this job cannot use.
    #[arg(long, default_value = "all", value_delimiter = ',')]
    paths: Vec<String>,
    /// How the tiles of a round are produced and consumed, comma-separated: `per-tile` (a stamp
    /// and a sink task per tile) or `per-round` (one stamp task writes the round's tiles, one
    /// sink task reads them; at most 64 in flight).
    #[arg(long, default_value = "per-tile", value_delimiter = ',')]
    tasks: Vec<Tasks>,
    /// Bytes to move per measurement (rounds are added until this much moved; at least 5).
    #[arg(long, default_value = "2G")]
    volume: String,
    /// At most this many rounds per measurement (at least 5: every measurement runs 5).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(5..))]
    max_rounds: u64,
    /// CUDA sinks check the stamp of every tile they read (first, middle and last word, one
    /// small kernel per sink; rank 1 fails the row if any tile held another round's stamp).
    /// Off by default: the check costs the consumer a launch per sink, which the rates of
    /// earlier records do not include. CPU and emulated sinks always check.
    #[arg(long)]
    check_sinks: bool,
    /// Where tasks run: cuda, emu:K or auto. Default: FERRY_DEVICES, else auto.
    #[arg(long)]
    devices: Option<ferry::DeviceSpec>,
    /// Also measure how fast a GPU's wait wakes after a signal from the other GPU, by how
    /// long the wait was pending and how it waits (`ferry_kernels::links::signal_wake_us`).
    #[arg(long)]
    wake_probe: bool,
    /// Write a JSON record here (rank 0).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// How a round's tiles are produced and consumed (`--tasks`).
#[derive(clap::ValueEnum, Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Tasks {
    /// A stamp task and a sink task per tile.
    PerTile,
    /// One stamp task writes the round's tiles, one sink task reads them.
    PerRound,
}

impl Tasks {
    fn name(self) -> &'static str {
        match self {
            Tasks::PerTile => "per-tile",
            Tasks::PerRound => "per-round",
        }
    }
}

/// Most tiles one task of `--tasks per-round` stamps or reads.
const MAX_ROUND_TILES: usize = 64;

#[derive(Serialize, Clone)]
struct Row {
    path: String,
    /// How the round's tiles were produced and consumed (`--tasks`).
    tasks: Tasks,
    bytes: usize,
    inflight: usize,
    /// Rounds timed (with `per-round` tasks each moves half the tiles in flight).
    rounds: usize,
    /// Tiles moved while timed.
    transfers: usize,
    seconds: f64,
    gbps: f64,
    /// gbps over the bare peer copy at the same size and depth (when measured).
    of_peer_copy: Option<f64>,
    /// Bytes rank 0 sent on each network path during the measurement.
    sent: Vec<(String, u64)>,
    /// Per rank (0, 1): µs of GPU-manager work and of MPI-thread work per transfer during the
    /// measurement (busy time of loop passes that did something, over `rounds × k`): which
    /// thread bounds a small-tile rate.
    manager_us: [f64; 2],
    mpi_us: [f64; 2],
    /// Per rank (0, 1): naps per transfer of the GPU manager and of the MPI thread (times it
    /// blocked on its channel for want of work, each ended by a wake-up or a timeout).
    manager_naps: [f64; 2],
    mpi_naps: [f64; 2],
    /// Rank 1 (the consumer): the share of its IPC pulls that were enqueued in batches, and the
    /// mean copies per batch (0 when none was).
    batched: (f64, f64),
    /// Rank 1 (the consumer): µs of GPU-manager time per transfer by phase (launch,
    /// callbacks, finalize, poll, copies, commands: `ferry::ManagerPhases`; zero unless
    /// `FERRY_GPU_PHASES=on`).
    consumer_phases_us: Vec<(String, f64)>,
    /// The same for rank 0 (the producer, whose tasks stamp the tiles before they move).
    producer_phases_us: Vec<(String, f64)>,
    /// Device acknowledgements (`FERRY_DEVICE_ACK`): rank 0's stamps that waited for one on the
    /// device, and rank 1's acknowledgements written behind their pulls.
    device_acks: [u64; 2],
    /// Rank 1's IPC pulls offered at launch: enqueued with no stream wait (the producer's
    /// signal seen in its host mirror), waited for on the device, and batches held for the
    /// mirror past `FERRY_OFFER_POLL_US`.
    offers: [u64; 3],
}

/// One side's phases of a row.
type PhasesOf = fn(&Row) -> &[(String, f64)];

#[derive(Serialize)]
struct Record {
    example: &'static str,
    devices: Vec<String>,
    mpi: String,
    rows: Vec<Row>,
    /// (bytes, in flight, GB/s) of the bare peer copy.
    peer_copy: Vec<(usize, usize, f64)>,
    /// Pinned (H2D, D2H) GB/s at 256 MiB, rank 0's GPU.
    pinned: Option<(f64, f64)>,
    /// Host µs per driver call on rank 0's GPU (`ferry_kernels::links::call_costs_us`): the
    /// floor under the GPU manager's cost per operation.
    driver_calls_us: Vec<(&'static str, f64)>,
    /// (bytes, in flight, most blocks per copy, GB/s, host µs per launch) of the copy kernel
    /// pulling from the peer GPU (`ferry_kernels::links::sm_pull_gbps`).
    sm_pull: Vec<(usize, usize, u32, f64, f64)>,
    /// µs per round trip of a signal between the two GPUs, per way of signalling
    /// (`ferry_kernels::links::signal_round_trip_us`).
    signal_round_trip_us: Vec<(String, f64)>,
    /// With `--wake-probe`: (waiter, µs the wait was pending, µs to wake), per
    /// `ferry_kernels::links::signal_wake_us`.
    signal_wake_us: Vec<(String, u64, f64)>,
    /// Peak bounce-pool bytes in use on rank 0, and the pool's size.
    bounce_peak: (u64, u64),
    /// Per rank: most bytes of the pinned host pool in use at once, and the host buffers that
    /// found it full (pageable instead).
    host_pool: Vec<(u64, u64)>,
}

/// Largest tile or volume `--sizes`/`--volume` accept (1 TiB): keeps `bytes × in flight` far from
/// overflow.
const MAX_BYTES: usize = 1 << 40;
/// Most tiles in flight per measurement.
const MAX_INFLIGHT: usize = 4096;

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1usize << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num
        .parse()
        .with_context(|| format!("size {s:?}: expected e.g. 65536, 64K, 4M"))?;
    let Some(bytes) = n.checked_mul(mul).filter(|&b| b <= MAX_BYTES) else {
        bail!("size {s:?}: at most {}G", MAX_BYTES >> 30);
    };
    if bytes == 0 || bytes % 8 != 0 {
        bail!("size {s:?}: must be a positive multiple of 8 bytes");
    }
    Ok(bytes)
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    main_with_runtime("transfer", args.devices, None, |rt| run(rt, &args))
}

/// The value stamped into tile `i` in round `r` (never 0, the initial content).
fn stamp_value(r: usize, i: usize) -> u32 {
    ((r as u32).wrapping_mul(2654435761) ^ (i as u32).wrapping_mul(40503)) | 1
}

/// The benchmark's task classes: `stamp` fills each of its tiles with its argument of the same
/// index; `sink` reads all its tiles but the last (on CPUs and emulated devices checking each
/// stamp when `verify`; on CUDA counting the tiles with another stamp when `check_cuda`) and
/// writes the last, a small tile of its own.
fn classes(verify: bool, check_cuda: bool) -> (TaskClass, TaskClass, TaskClass, TaskClass) {
    let stamp_cpu = |ctx: &ferry::TaskContext<'_>| -> Result<(), ferry::TaskError> {
        for k in 0..ctx.num_tiles() {
            let v = stamp_arg(ctx.args(), k)?;
            let t = ctx.tile_mut::<u32>(k)?;
            // Emulated devices run this as the kernel; only the ends and the middle are stamped
            // (the bytes between still move; checking them catches a misplaced or missing
            // chunk).
            let n = t.len();
            t[0] = v;
            t[n - 1] = v;
            t[n / 2] = v;
        }
        Ok(())
    };
    let sink_cpu = move |ctx: &ferry::TaskContext<'_>| -> Result<(), ferry::TaskError> {
        let inputs = ctx.num_tiles().saturating_sub(1);
        for k in 0..inputs {
            let v = stamp_arg(ctx.args(), k)?;
            let t = ctx.tile::<u32>(k)?;
            let n = t.len();
            if verify && (t[0] != v || t[n - 1] != v || t[n / 2] != v) {
                return Err(format!(
                    "tile {:?}: expected stamp {v:#x}, found {:#x}/{:#x}/{:#x}",
                    ctx.coords(k)?,
                    t[0],
                    t[n / 2],
                    t[n - 1]
                )
                .into());
            }
        }
        ctx.tile_mut::<u32>(inputs)?[0] = stamp_arg(ctx.args(), 0)?;
        Ok(())
    };
    let stamp = TaskClass::new("stamp", stamp_cpu).with_cuda(|ctx| {
        // Several tiles (one task per round): one fill kernel writes them all, as an
        // application's producer kernel would, where a `cuMemsetD32Async` per tile cost the
        // producer's GPU manager a driver call (and its locks) each.
        if ctx.num_tiles() > 1 && ctx.num_tiles() <= ferry_kernels::fill::MAX_FILLS {
            let mut fills = Vec::with_capacity(ctx.num_tiles());
            for k in 0..ctx.num_tiles() {
                let (rows, cols) = ctx.shape(k)?;
                fills.push((ctx.ptr(k)?, rows * cols, stamp_arg(ctx.args(), k)?));
            }
            // SAFETY: each tile's device block holds `rows × cols` 32-bit words; enqueued on
            // the task's stream, whose context the GPU manager has bound to this thread.
            return unsafe { ferry_kernels::fill::fill_u32(ctx.stream(), &fills) }.map_err(|e| e.into());
        }
        for k in 0..ctx.num_tiles() {
            let v = stamp_arg(ctx.args(), k)?;
            let (rows, cols) = ctx.shape(k)?;
            let words = rows * cols;
            // SAFETY: the tile's device block holds `words` 32-bit words; enqueued on the task's
            // stream.
            let r = unsafe {
                ferry::cudarc::driver::sys::cuMemsetD32Async(ctx.ptr(k)?, v, words, ctx.stream().cu_stream())
            };
            if r != ferry::cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuMemsetD32Async: {r:?}").into());
            }
        }
        Ok(())
    });
    // On CUDA, with `--check-sinks`, the sink counts the tiles whose stamp is not the one
    // expected (first, middle and last word, in one small kernel) into its own tile, which rank
    // 1 checks after the run: a pull that raced the next stamp of its tile, or moved the wrong
    // bytes, shows there. Without it, the sink only receives.
    let sink = TaskClass::new("sink", sink_cpu).with_cuda(move |ctx| {
        if !check_cuda {
            return Ok(());
        }
        let inputs = ctx.num_tiles().saturating_sub(1);
        for first in (0..inputs).step_by(ferry_kernels::fill::MAX_FILLS) {
            let mut checks = Vec::new();
            for k in first..inputs.min(first + ferry_kernels::fill::MAX_FILLS) {
                let (rows, cols) = ctx.shape(k)?;
                checks.push((ctx.ptr(k)?, rows * cols, stamp_arg(ctx.args(), k)?));
            }
            // SAFETY: each input's device block holds `rows × cols` 32-bit words and the last
            // tile (this task's own, written) at least one; enqueued on the task's stream.
            unsafe { ferry_kernels::fill::count_mismatches_u32(ctx.stream(), &checks, ctx.ptr(inputs)?) }?;
        }
        Ok(())
    });
    let stamp_host = TaskClass::new("stamp.host", stamp_cpu);
    let sink_host = TaskClass::new("sink.host", sink_cpu);
    (stamp, sink, stamp_host, sink_host)
}

/// Reads back the producer's tiles after a run and checks the last stamp of each, `last(i)`:
/// every word when the stamp filled the tile on a device (`whole`), else the three words a CPU
/// or emulated stamp writes. On CUDA the sink does not look at its tiles, so this is what shows
/// that the producer's fills (one kernel for a round's tiles) wrote what the transfers moved.
fn check_stamps(
    rt: &Runtime,
    a: &ferry::Collection<u32>,
    k: usize,
    whole: bool,
    last: impl Fn(usize) -> Option<u32>,
) -> anyhow::Result<()> {
    for i in 0..k {
        let Some(want) = last(i) else { continue };
        let t = rt.tile(a, i, 0)?;
        let n = t.len();
        let bad = if whole {
            t.iter().position(|&x| x != want)
        } else {
            [0, n / 2, n - 1].into_iter().find(|&j| t[j] != want)
        };
        if let Some(j) = bad {
            bail!("tile {i}: word {j} holds {:#x}, the last stamp was {want:#x}", t[j]);
        }
    }
    Ok(())
}

/// The stamp of a task's tile `k`: its argument `k`.
fn stamp_arg(args: &[i64], k: usize) -> Result<u32, ferry::TaskError> {
    args.get(k)
        .map(|&v| v as u32)
        .ok_or_else(|| format!("no stamp argument for tile {k}").into())
}

fn run(rt: &Runtime, args: &Args) -> anyhow::Result<()> {
    if rt.size() != 2 {
        bail!("the transfer benchmark runs on exactly 2 ranks (got {})", rt.size());
    }
    let sizes: Vec<usize> = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<anyhow::Result<_>>()?;
    let volume = parse_size(&args.volume)?;
    if args.inflight.iter().any(|&k| k == 0 || k > MAX_INFLIGHT) {
        bail!("--inflight values must be between 1 and {MAX_INFLIGHT}");
    }
    if args.tasks.contains(&Tasks::PerRound) && args.inflight.iter().any(|&k| k > MAX_ROUND_TILES) {
        bail!("--tasks per-round takes at most {MAX_ROUND_TILES} tiles in flight (one task holds them all)");
    }
    let all = ["ipc", "gpu-direct", "staged", "host", "mpi-host"];
    let paths: Vec<String> = if args.paths.iter().any(|p| p == "all") {
        all.iter().map(|s| s.to_string()).collect()
    } else {
        for p in &args.paths {
            if !all.contains(&p.as_str()) {
                bail!("unknown path {p:?}; expected one of {all:?} or all");
            }
        }
        args.paths.clone()
    };
    let cuda = ferry_examples::on_cuda(rt);
    // Emulated devices and CPU workers run the checking bodies; CUDA moves the bytes unchecked.
    let (stamp, sink, stamp_host, sink_host) = classes(!cuda, args.check_sinks);

    // Anchors first, on rank 0, while the runtime is idle.
    let mut peer_copy = Vec::new();
    let mut pinned = None;
    let mut driver_calls_us = Vec::new();
    let mut sm_pull = Vec::new();
    let mut signal_round_trip_us = Vec::new();
    let mut signal_wake_us = Vec::new();
    if cuda && rt.rank() == 0 && args.wake_probe {
        use ferry_kernels::links::Waiter;
        for pending in [0u64, 20, 100, 500] {
            for waiter in [Waiter::Stream, Waiter::Kernel] {
                match ferry_kernels::links::signal_wake_us(0, 1, waiter, pending, 200) {
                    Ok(us) => signal_wake_us.push((format!("{waiter:?}"), pending, us)),
                    Err(e) => eprintln!("transfer: no signal wake-up {waiter:?} ({e})"),
                }
            }
        }
    }
    if cuda && rt.rank() == 0 {
        pinned = ferry_kernels::links::pinned_copy_gbps(0, 256 << 20, 8).ok();
        {
            use ferry_kernels::links::SignalMode;
            for mode in [SignalMode::Pull, SignalMode::Push, SignalMode::Event] {
                match ferry_kernels::links::signal_round_trip_us(0, 1, mode, 2000) {
                    Ok(us) => signal_round_trip_us.push((format!("{mode:?}"), us)),
                    Err(e) => eprintln!("transfer: no signal round trip {mode:?} ({e})"),
                }
            }
        }
        match ferry_kernels::links::call_costs_us(0, 20_000) {
            Ok(rows) => driver_calls_us = rows,
            Err(e) => eprintln!("transfer: no driver-call costs ({e})"),
        }
        for &bytes in &sizes {
            for &k in &args.inflight {
                let reps = (volume / (bytes * k)).clamp(3, 200);
                if k <= 16 && bytes % 16 == 0 {
                    for blocks in [16u32, 64, 256] {
                        match ferry_kernels::links::sm_pull_gbps(1, 0, bytes, k, blocks, reps) {
                            Ok((g, us)) => sm_pull.push((bytes, k, blocks, g, us)),
                            Err(e) => eprintln!("transfer: no sm pull ({e})"),
                        }
                    }
                }
                match ferry_kernels::links::peer_copy_gbps(0, 1, bytes, k, 4.min(k), reps) {
                    Ok(g) => peer_copy.push((bytes, k, g)),
                    Err(e) => {
                        eprintln!("transfer: no peer-copy anchor ({e})");
                        break;
                    }
                }
            }
        }
    }
    rt.wait()?;

    let mut rows = Vec::new();
    let mut serial = 0usize;
    for path in &paths {
        let (route, host_resident) = match path.as_str() {
            "ipc" => (TransferPath::Ipc, false),
            "gpu-direct" => (TransferPath::GpuDirect, false),
            "staged" => (TransferPath::Staged, false),
            "host" => (TransferPath::Host, false),
            _ => (TransferPath::Host, true),
        };
        if let Err(e) = rt.set_transfer_path(route) {
            if rt.rank() == 0 {
                println!("{path:<11} skipped: {e}");
            }
            continue;
        }
        let (stamp, sink) = if host_resident {
            (&stamp_host, &sink_host)
        } else {
            (&stamp, &sink)
        };
        let runs = args.tasks.iter().flat_map(|&t| sizes.iter().map(move |&b| (t, b)));
        for (tasks, bytes) in runs {
            for &k in &args.inflight {
                serial += 1;
                // One u32 column per tile: k tiles of `bytes` on rank 0, k small tiles on rank 1.
                let rows_per_tile = bytes / 4;
                let a = rt.tile_grid::<u32>(
                    &format!("a{serial}"),
                    rows_per_tile * k,
                    1,
                    rows_per_tile,
                    1,
                    Distribution::OnRank(0),
                )?;
                let b = rt.tile_grid::<u32>(&format!("b{serial}"), k, 1, 1, 1, Distribution::OnRank(1))?;
                // Each tile moves `moves` times. Per round: every tile (a task each), or, with
                // one task per side and round, every other tile — alternate rounds stamp the two
                // halves, so the next round's stamp need not wait for the acknowledgements of
                // this round's pulls and `k` tiles stay in flight as with a task per tile.
                let moves = (volume / (bytes * k)).clamp(5, args.max_rounds as usize);
                let groups = match tasks {
                    Tasks::PerTile => 1,
                    Tasks::PerRound => k.min(2),
                };
                let rounds = moves * groups;
                let transfers = moves * k;
                let insert_round = |r: usize| -> ferry::Result<()> {
                    match tasks {
                        Tasks::PerTile => {
                            for i in 0..k {
                                let v = [stamp_value(r, i) as i64];
                                rt.submit(Task::new(stamp, &[a.rw(i, 0)]).args(&v))?;
                                rt.submit(Task::new(sink, &[a.read(i, 0), b.rw(i, 0)]).args(&v))?;
                            }
                        }
                        Tasks::PerRound => {
                            let group = r % groups;
                            let tiles: Vec<usize> = (0..k).filter(|i| i % groups == group).collect();
                            let v: Vec<i64> = tiles.iter().map(|&i| stamp_value(r, i) as i64).collect();
                            let written: Vec<_> = tiles.iter().map(|&i| a.rw(i, 0)).collect();
                            rt.submit(Task::new(stamp, &written).args(&v))?;
                            let mut read: Vec<_> = tiles.iter().map(|&i| a.read(i, 0)).collect();
                            read.push(b.rw(group, 0));
                            rt.submit(Task::new(sink, &read).args(&v))?;
                        }
                    }
                    Ok(())
                };
                // Untimed rounds first (first-use costs, every tile once), then the timed ones.
                for r in 0..groups {
                    insert_round(r)?;
                }
                rt.wait()?;
                let before_all = rt.gather_stats()?;
                let before = rt.stats();
                let t0 = Instant::now();
                for r in groups..groups + rounds {
                    insert_round(r)?;
                }
                rt.wait()?;
                let seconds = t0.elapsed().as_secs_f64();
                let after = rt.stats();
                let after_all = rt.gather_stats()?;
                if rt.rank() == 1 && cuda && !host_resident && args.check_sinks {
                    // The CUDA sinks' counts of tiles that arrived with another stamp.
                    for i in 0..k {
                        let bad = rt.tile(&b, i, 0)?[0];
                        if bad != 0 {
                            bail!("{bad} tiles read by sink {i} held another stamp than their round's");
                        }
                    }
                }
                if rt.rank() == 0 {
                    check_stamps(rt, &a, k, cuda && !host_resident, |i| {
                        (groups..groups + rounds)
                            .rev()
                            .find(|r| r % groups == i % groups)
                            .map(|r| stamp_value(r, i))
                    })?;
                }
                let per_transfer = |thread: &str| -> [f64; 2] {
                    let busy = |s: &[ferry::StatsSnapshot], r: usize| {
                        s.get(r)
                            .and_then(|x| x.threads.iter().find(|t| t.name == thread))
                            .map_or(0.0, |t| t.busy_s)
                    };
                    [0, 1].map(|r| (busy(&after_all, r) - busy(&before_all, r)) * 1e6 / transfers as f64)
                };
                let batches = |s: &[ferry::StatsSnapshot]| -> (u64, u64) {
                    s.get(1).map_or((0, 0), |x| {
                        x.devices
                            .iter()
                            .fold((0, 0), |(b, c), d| (b + d.copy_batches, c + d.batched_copies))
                    })
                };
                let ((b0, c0), (b1, c1)) = (batches(&before_all), batches(&after_all));
                let batched = (
                    (c1 - c0) as f64 / transfers as f64,
                    if b1 > b0 {
                        (c1 - c0) as f64 / (b1 - b0) as f64
                    } else {
                        0.0
                    },
                );
                let phases_us = |r: usize| match (before_all.get(r), after_all.get(r)) {
                    (Some(b), Some(a)) => a
                        .gpu_manager
                        .busy()
                        .iter()
                        .zip(b.gpu_manager.busy())
                        .map(|(&(name, x), (_, y))| (name.to_string(), (x - y) * 1e6 / transfers as f64))
                        .collect(),
                    _ => Vec::new(),
                };
                let naps = |thread: &str| -> [f64; 2] {
                    let naps = |s: &[ferry::StatsSnapshot], r: usize| {
                        s.get(r)
                            .and_then(|x| x.threads.iter().find(|t| t.name == thread))
                            .map_or(0, |t| t.naps)
                    };
                    [0, 1].map(|r| (naps(&after_all, r) - naps(&before_all, r)) as f64 / transfers as f64)
                };
                let acks = |s: &[ferry::StatsSnapshot]| -> [u64; 2] {
                    let dev = |r: usize, f: fn(&ferry::DeviceStats) -> u64| {
                        s.get(r).map_or(0, |x| x.devices.iter().map(f).sum::<u64>())
                    };
                    [dev(0, |d| d.acked_on_device), dev(1, |d| d.acks_written)]
                };
                let (a0, a1) = (acks(&before_all), acks(&after_all));
                let device_acks = [0, 1].map(|k| a1[k] - a0[k]);
                let offers = {
                    let of = |s: &[ferry::StatsSnapshot]| -> [u64; 3] {
                        let dev = |f: fn(&ferry::DeviceStats) -> u64| {
                            s.get(1).map_or(0, |x| x.devices.iter().map(f).sum::<u64>())
                        };
                        [
                            dev(|d| d.offers_seen),
                            dev(|d| d.offers_waited),
                            dev(|d| d.offers_held_out),
                        ]
                    };
                    let (b, a) = (of(&before_all), of(&after_all));
                    [0, 1, 2].map(|k| a[k] - b[k])
                };
                let gbps = (transfers * bytes) as f64 / seconds / 1e9;
                let of_peer_copy = peer_copy
                    .iter()
                    .find(|&&(b2, k2, _)| b2 == bytes && k2 == k)
                    .map(|&(_, _, g)| gbps / g);
                let sent = ferry::TrafficPath::NETWORK
                    .iter()
                    .map(|&p| {
                        (
                            p.name().to_string(),
                            after.path(p).bytes_sent - before.path(p).bytes_sent,
                        )
                    })
                    .filter(|(_, b)| *b > 0)
                    .collect();
                rows.push(Row {
                    path: path.clone(),
                    tasks,
                    bytes,
                    inflight: k,
                    rounds,
                    transfers,
                    seconds,
                    gbps,
                    of_peer_copy,
                    sent,
                    manager_us: per_transfer("gpu-manager"),
                    mpi_us: per_transfer("mpi"),
                    manager_naps: naps("gpu-manager"),
                    mpi_naps: naps("mpi"),
                    batched,
                    consumer_phases_us: phases_us(1),
                    producer_phases_us: phases_us(0),
                    device_acks,
                    offers,
                });
            }
        }
    }
    rt.set_transfer_path(rt.config().transfer_path)?;
    let stats = rt.stats();
    let host_pool: Vec<(u64, u64)> = rt
        .gather_stats()?
        .iter()
        .map(|s| (s.pinned_peak_bytes, s.pinned_fallbacks))
        .collect();
    if rt.rank() == 0 {
        println!(
            "{:<11} {:>10} {:>4} {:>7} {:>10} {:>10} {:>15} {:>15} {:>13} {:>17} {:>9} {:>13}  bytes sent per path (rank 0)",
            "path",
            "tile",
            "k",
            "rounds",
            "GB/s",
            "of peer",
            "mgr µs/xfer 0/1",
            "mpi µs/xfer 0/1",
            "batched/size",
            "naps/xfer mgr;mpi",
            "tasks",
            "acked/acks"
        );
        for r in &rows {
            let sent: Vec<String> = r.sent.iter().map(|(p, b)| format!("{p}={b}")).collect();
            println!(
                "{:<11} {:>10} {:>4} {:>7} {:>10.2} {:>10} {:>15} {:>15} {:>13} {:>17} {:>9} {:>13}  {}",
                r.path,
                human(r.bytes),
                r.inflight,
                r.rounds,
                r.gbps,
                r.of_peer_copy.map_or("-".into(), |x| format!("{:.2}", x)),
                format!("{:.1}/{:.1}", r.manager_us[0], r.manager_us[1]),
                format!("{:.1}/{:.1}", r.mpi_us[0], r.mpi_us[1]),
                format!("{:.2}/{:.1}", r.batched.0, r.batched.1),
                format!(
                    "{:.2}/{:.2};{:.2}/{:.2}",
                    r.manager_naps[0], r.manager_naps[1], r.mpi_naps[0], r.mpi_naps[1]
                ),
                r.tasks.name(),
                format!("{}/{}", r.device_acks[0], r.device_acks[1]),
                sent.join(" ")
            );
        }
        for (b, k, g) in &peer_copy {
            println!("peer-copy   {:>10} {:>4} {:>7} {:>10.2}", human(*b), k, "-", g);
        }
        // Where each GPU manager spends a transfer (theirs bound small tiles).
        // (`FERRY_GPU_PHASES=on`; all zero otherwise.)
        let producer: PhasesOf = |r| &r.producer_phases_us;
        let consumer: PhasesOf = |r| &r.consumer_phases_us;
        for (side, phases) in [("producer", producer), ("consumer", consumer)] {
            let timed = |r: &&Row| phases(r).iter().any(|(_, us)| *us > 0.0);
            if let Some(first) = rows.iter().find(timed) {
                print!("{:<11} {:>10} {:>4} {:>9}", side, "tile", "k", "tasks");
                for (name, _) in phases(first) {
                    print!(" {:>10}", format!("{name} µs"));
                }
                println!();
                for r in rows.iter().filter(timed) {
                    print!(
                        "{:<11} {:>10} {:>4} {:>9}",
                        r.path,
                        human(r.bytes),
                        r.inflight,
                        r.tasks.name()
                    );
                    for (_, us) in phases(r) {
                        print!(" {:>10.2}", us);
                    }
                    println!();
                }
            }
        }
        if let Some((h2d, d2h)) = pinned {
            println!("pinned 256M: H2D {h2d:.1} GB/s, D2H {d2h:.1} GB/s");
        }
        for (call, us) in &driver_calls_us {
            println!("driver call {call:<34} {us:>7.3} µs");
        }
        for (bytes, k, blocks, g, us) in &sm_pull {
            println!(
                "copy kernel {:>5} x {k:<2} (<= {blocks:<3} blocks/copy) {g:7.1} GB/s, launch {us:.2} µs",
                human(*bytes)
            );
        }
        for (mode, us) in &signal_round_trip_us {
            println!("signal round trip {mode:<6} {us:>7.2} µs");
        }
        for (waiter, pending, us) in &signal_wake_us {
            println!("signal wake-up {waiter:<6} pending {pending:>4} µs: {us:>7.2} µs");
        }
        println!(
            "bounce pool: peak {} of {} bytes",
            stats.bounce_peak_bytes, stats.bounce_bytes
        );
        for (r, (peak, fallbacks)) in host_pool.iter().enumerate() {
            println!("pinned host pool, rank {r}: peak {peak} bytes, {fallbacks} buffers pageable");
        }
        if let Some(path) = &args.json {
            write_json(
                path,
                &Record {
                    example: "transfer",
                    devices: rt.devices().to_vec(),
                    mpi: rt.mpi_library().to_string(),
                    rows,
                    peer_copy,
                    pinned,
                    driver_calls_us,
                    sm_pull,
                    signal_round_trip_us,
                    signal_wake_us,
                    bounce_peak: (stats.bounce_peak_bytes, stats.bounce_bytes),
                    host_pool,
                },
            )?;
        }
    }
    Ok(())
}

fn human(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 {
        format!("{}K", b >> 10)
    } else {
        format!("{b}")
    }
}
