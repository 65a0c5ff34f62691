//! 2D 5-point heat equation (explicit Jacobi update) on ferry, on an N×N grid of tiles with
//! Dirichlet-zero boundaries and a 2D block distribution.
//!
//! Each tile publishes its four edges as small tiles of their own (double-buffered by step
//! parity, so a step reads the edges of the previous one); a step task per tile reads the
//! neighbours' edges, updates its tile in place and writes its new edges. Only edges cross ranks.
//!
//! Check: the initial field is the lowest discrete sine mode, an eigenvector of the update, so
//! after T steps it must equal `g^T` times the initial field (`g = 1 − 8α sin²(πh/2)`). The
//! checksum is a hash of every cell's bits: equal checksums mean bit-identical fields, whatever
//! the rank count or tiling.

use anyhow::bail;
use clap::Parser;
use ferry::{Collection, Distribution, ProcessGrid, Runtime, Task, TaskClass, TaskContext, TaskError};
use ferry_examples::{gpu_kernels, main_with_config, path_records, process_grid, write_json};
use ferry_kernels::stencil;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "2D heat-equation stencil on ferry (run under mpirun)")]
struct Args {
    /// Interior grid points per side (the grid is n×n).
    #[arg(long, default_value_t = 1024)]
    n: usize,
    /// Tile size: nb×nb tiles, or mb×nb with --mb (nb is then the tile width); the last
    /// row/column of tiles may be smaller.
    #[arg(long, default_value_t = 256)]
    nb: usize,
    /// Tile rows, when tiles are not square (mb×nb tiles): `--mb 2048 --nb 4096` cuts a 4096²
    /// grid into two row slabs, one per GPU, each with one neighbour (the decomposition of
    /// NVIDIA's multi-GPU Jacobi sample). Default: nb.
    #[arg(long)]
    mb: Option<usize>,
    /// Time steps.
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Diffusion number α = κΔt/h² (stable for α ≤ 1/4).
    #[arg(long, default_value_t = 0.2)]
    alpha: f64,
    /// Process grid PxQ (default: as square as the rank count allows).
    #[arg(long)]
    grid: Option<ProcessGrid>,
    /// Steps run before the timer starts (first-use costs: kernel compilation, library handles).
    /// They count towards --iters.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Seed of the --noise generators (the initial field is deterministic).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where GPU-capable tasks run: none (CPU workers), cuda, emu:K (K emulated GPUs per rank), or
    /// auto (cuda when a GPU is present). Default: FERRY_DEVICES, else auto.
    #[arg(long)]
    devices: Option<ferry::DeviceSpec>,
    /// Log the runtime's start-up (devices, pools, transfer routes) at info level.
    #[arg(short = 'v', long)]
    verbose: bool,
    /// No progress bar and no statistics table.
    #[arg(short = 'q', long)]
    quiet: bool,
    /// Write a JSON record of parameters and results here (rank 0).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep every step's field as a snapshot, then run a backward pass over them in reverse
    /// order (as an adjoint would): the newest snapshots stay on the device, older ones spill
    /// to host and disk (`FERRY_DEVICE_MEM`, `FERRY_HOST_MEM_LIMIT`, `FERRY_SPILL_DIR`), and the
    /// backward pass is prefetched ahead.
    #[arg(long)]
    save_snapshots: bool,
    /// Stochastic forcing: after each step, add amplitude·(u − ½) with u uniform from a
    /// Philox4x32-10 generator per tile whose state lives in a tile (on the device with
    /// devices). 0 = off; with noise there is no analytic solution, only the checksum.
    #[arg(long, default_value_t = 0.0)]
    noise: f64,
    /// Write a checkpoint every K steps (of the field, its edges and the generator states) under
    /// --checkpoint-dir, as `step-{t}`.
    #[arg(long, default_value_t = 0)]
    checkpoint_every: usize,
    /// Where --checkpoint-every writes.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Restart from this checkpoint directory (a `step-{t}` written by --checkpoint-every) and
    /// run the remaining steps up to --iters; any rank count.
    #[arg(long)]
    restart: Option<PathBuf>,
    /// Split each tile's step into an interior task (no halos) and a ring task (halos in, new
    /// edges out, at high priority), so that the halo exchange of one step overlaps the
    /// interior update of the next. `concurrent` (the default of a bare `--overlap`): both
    /// write parts of the new field (`rw_part`), so a step's ring runs alongside its interior;
    /// `ordered`: the ring reads-writes the new field after the interior. Same bits every way.
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "concurrent")]
    overlap: Option<Overlap>,
    /// With CUDA: first time the same steps with no runtime, the anchor for the runtime's
    /// per-step overhead, printed as `anchor` and recorded as `anchor_seconds`. On one rank
    /// without --overlap: this run's tiles on GPU 0, each step's ferry kernels enqueued on one
    /// stream and on four (`ferry_kernels::stencil_tiles`; `anchor_seconds` is the faster).
    /// Otherwise, on rank 0 with at least two visible GPUs: the grid as two slabs of n/2 rows on
    /// GPUs 0 and 1 (`ferry_kernels::stencil_pair`: ferry's kernels ordered by CUDA events,
    /// plain or --overlap as chosen; with --overlap also the interior and ring of a step running
    /// concurrently, `anchor_concurrent_seconds`), which compares like with like against
    /// `--mb n/2 --nb n` on two ranks.
    #[arg(long)]
    anchor: bool,
    /// Insert each step as a trace (`Runtime::trace`, one id per buffer parity): the first two
    /// steps are recorded, the later ones replay the recording instead of redoing the
    /// dependence analysis. Same bits either way.
    #[arg(long, conflicts_with = "save_snapshots")]
    replay: bool,
}

#[global_allocator]
static ALLOC: ferry_examples::alloc::Counting = ferry_examples::alloc::Counting;

/// How --overlap orders a step's interior and ring tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Overlap {
    /// Both write disjoint parts of the new field (`Collection::rw_part`): they may run at the
    /// same time.
    Concurrent,
    /// The ring reads-writes the new field, after the interior.
    Ordered,
}

impl Overlap {
    /// The name on the command line and in the JSON record.
    fn name(self) -> &'static str {
        match self {
            Overlap::Concurrent => "concurrent",
            Overlap::Ordered => "ordered",
        }
    }
}

/// Priority of the ring tasks of --overlap: their edges are what the neighbours wait for, so
/// they run on each device's high-priority stream (`Task::priority`: ≥ 2).
const RING_PRIORITY: i32 = 2;

/// The backward pass: `adj ← ½·adj + snapshot(s)` for s from the last step down to the first,
/// per tile. Since the field is the sine mode times `g^(s+1)` after step s, the result must be
/// the sine mode times Σ_s ½^s g^(s+1).
fn backward_pass(
    rt: &Runtime,
    snaps: &[Collection<f64>],
    n: usize,
    (mb, nb): (usize, usize),
    alpha: f64,
    dist: Distribution,
) -> anyhow::Result<Backward> {
    let adj = rt.tile_grid::<f64>("adjoint", n, n, mb, nb, dist)?;
    let step = TaskClass::new("adjoint", |ctx| {
        let snap = ctx.tile::<f64>(0)?.to_vec();
        for (a, s) in ctx.tile_mut::<f64>(1)?.iter_mut().zip(snap) {
            *a = 0.5 * *a + s;
        }
        Ok(())
    })
    .with_cuda(|ctx| {
        let (rows, cols) = ctx.shape(0)?;
        let mut kern = gpu_kernels(ctx)?;
        // SAFETY: both tiles have the same shape, on the stream's device.
        unsafe { kern.scale_add(rows * cols, 0.5, ctx.ptr(1)?, ctx.ptr(0)?)? };
        Ok(())
    });
    let before = rt.gather_stats()?;
    let t0 = Instant::now();
    for s in snaps.iter().rev() {
        for i in 0..adj.tile_rows() {
            for j in 0..adj.tile_cols() {
                rt.insert(&step, &[s.read(i, j), adj.rw(i, j)])?;
            }
        }
    }
    rt.wait()?;
    let seconds = t0.elapsed().as_secs_f64();
    let after = rt.gather_stats()?;
    let (b, a) = (
        ferry_examples::tier_record(&before),
        ferry_examples::tier_record(&after),
    );
    let g = stencil::sine_mode_decay(n, alpha);
    let weight: f64 = (0..snaps.len())
        .map(|s| 0.5f64.powi(s as i32) * g.powi(s as i32 + 1))
        .sum();
    let (max_err, checksum) = verify(rt, &adj, n, (mb, nb), weight)?;
    Ok(Backward {
        steps: snaps.len(),
        seconds,
        max_rel_error: max_err,
        checksum: format!("{checksum:016x}"),
        waited: a.demand_loads - b.demand_loads,
        prefetched: a.prefetches - b.prefetches,
    })
}

/// Compares the tiles (`mb × nb`) of `u` this rank owns with `weight` × the sine mode; returns
/// the largest relative deviation and the bitwise checksum, over all ranks.
fn verify(
    rt: &Runtime,
    u: &Collection<f64>,
    n: usize,
    (mb, nb): (usize, usize),
    weight: f64,
) -> anyhow::Result<(f64, u64)> {
    let mut max_err: f64 = 0.0;
    let mut checksum: u64 = 0;
    for i in 0..u.tile_rows() {
        for j in 0..u.tile_cols() {
            if u.owner(i, j)? != rt.rank() {
                continue;
            }
            let (rows, cols) = u.tile_shape(i, j)?;
            let data = rt.tile(u, i, j)?;
            for r in 0..rows {
                for c in 0..cols {
                    let (gi, gj) = (i * mb + r, j * nb + c);
                    let v = data[r * cols + c];
                    let want = weight * stencil::sine_mode(n, gi, gj);
                    max_err = max_err.max((v - want).abs() / weight.abs().max(f64::MIN_POSITIVE));
                    let cell = ferry_kernels::spd::splitmix64(((gi * n + gj) as u64) ^ v.to_bits().rotate_left(17));
                    checksum = checksum.wrapping_add(cell);
                }
            }
        }
    }
    let max_err = rt.allgather_f64(max_err)?.into_iter().fold(0.0, f64::max);
    let checksum = rt.allgather_u64(checksum)?.into_iter().fold(0u64, u64::wrapping_add);
    Ok((max_err, checksum))
}

#[derive(Serialize)]
struct Record {
    example: &'static str,
    n: usize,
    mb: usize,
    nb: usize,
    iters: usize,
    alpha: f64,
    grid: String,
    ranks: usize,
    workers: usize,
    seconds: f64,
    cell_updates_per_s: f64,
    max_rel_error: f64,
    checksum: String,
    tasks: u64,
    /// Tasks inserted by replaying a trace (`--replay`), all ranks (each rank counts every task).
    replayed_tasks: u64,
    /// Replays fused into one GPU launch (a CUDA graph on CUDA devices), and the tasks they
    /// held, all ranks.
    fused_replays: u64,
    fused_tasks: u64,
    /// --overlap: `concurrent` or `ordered`; absent without.
    overlap: Option<&'static str>,
    /// GPU tasks released when the tasks they follow were launched (launch-ahead), all ranks.
    launched_ahead: u64,
    /// Of those, tasks launched onto the stream of the task they follow (stream affinity).
    followed: u64,
    /// Part writers (--overlap concurrent) placed while another part writer of their tile was
    /// in flight on their device, all ranks (`DeviceStats::parts_together`).
    parts_together: u64,
    /// comm-in copies whose GPU consumers were launched behind them, all ranks.
    comm_in_ahead: u64,
    /// IPC sends offered at their producer's launch (`FERRY_OFFER_AT_LAUNCH`), all ranks.
    offered_at_launch: u64,
    /// Of the pulls offered at launch, those enqueued with no stream wait (the producer's
    /// signal seen in its host mirror) and those that waited on the device, all ranks
    /// (`FERRY_OFFER_POLL_US`).
    offers_seen: u64,
    offers_waited: u64,
    /// GPU tasks that waited on the device for a consumer's acknowledgement of an IPC send of
    /// the tile they overwrite (`FERRY_DEVICE_ACK`), summed over ranks.
    acked_on_device: u64,
    /// Write-only accesses renamed past a pending send (`FERRY_RENAME_SENT`), all ranks.
    renamed: u64,
    /// Jobs the inserting threads ran between insertions (`FERRY_INSERTER_HELPS`), all ranks.
    inserter_jobs: u64,
    paths: Vec<ferry_examples::PathRecord>,
    tier: ferry::TierStats,
    /// With --save-snapshots: the backward pass.
    backward: Option<Backward>,
    /// With --checkpoint-every: each checkpoint (rank 0's view).
    checkpoints: Vec<CheckpointRecord>,
    /// With --anchor: seconds for the timed steps of the same grid as two row slabs on two GPUs
    /// with no runtime (`ferry_kernels::stencil_pair`), in this run's structure (plain,
    /// ordered --overlap, or concurrent --overlap).
    anchor_seconds: Option<f64>,
    /// With --anchor --overlap: the same with the interior and the ring of a step concurrent.
    anchor_concurrent_seconds: Option<f64>,
    /// With --restart: the step it resumed from.
    restarted_from: Option<u64>,
}

/// One checkpoint as rank 0 saw it.
#[derive(Serialize)]
struct CheckpointRecord {
    step: usize,
    seconds: f64,
    bytes: u64,
    from_device: u64,
    gbps: f64,
    /// Peak heap bytes the checkpoint added on rank 0 (the counting allocator).
    host_added: u64,
    bounce_bytes: u64,
}

/// What the backward pass over the snapshots did.
#[derive(Serialize)]
struct Backward {
    steps: usize,
    seconds: f64,
    max_rel_error: f64,
    checksum: String,
    /// Snapshot reads that had to wait for a load from disk (not prefetched in time).
    waited: u64,
    /// Snapshot tiles loaded back ahead of their task.
    prefetched: u64,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    ferry_examples::set_verbosity(args.verbose, args.quiet);
    let mb = args.mb.unwrap_or(args.nb);
    if args.n < 1 || args.nb < 1 || args.nb > args.n || mb < 1 || mb > args.n {
        eprintln!(
            "stencil: error: need n ≥ 1, 1 ≤ nb ≤ n and 1 ≤ mb ≤ n (got n = {}, nb = {}, mb = {mb})",
            args.n, args.nb
        );
        return std::process::ExitCode::FAILURE;
    }
    if !(args.alpha > 0.0 && args.alpha <= 0.25) {
        eprintln!(
            "stencil: error: --alpha {} outside (0, 0.25], where the explicit scheme is stable",
            args.alpha
        );
        return std::process::ExitCode::FAILURE;
    }
    if args.checkpoint_every > 0 && args.checkpoint_dir.is_none() {
        eprintln!("stencil: error: --checkpoint-every needs --checkpoint-dir");
        return std::process::ExitCode::FAILURE;
    }
    if args.checkpoint_every == 0 && args.checkpoint_dir.is_some() {
        eprintln!("stencil: error: --checkpoint-dir needs --checkpoint-every K (K ≥ 1 steps between checkpoints)");
        return std::process::ExitCode::FAILURE;
    }
    if args.save_snapshots && (args.restart.is_some() || args.checkpoint_every > 0) {
        eprintln!("stencil: error: --save-snapshots does not combine with checkpoints");
        return std::process::ExitCode::FAILURE;
    }
    if !args.noise.is_finite() || args.noise < 0.0 {
        eprintln!("stencil: error: --noise {} must be a finite amplitude ≥ 0", args.noise);
        return std::process::ExitCode::FAILURE;
    }
    // A memory-bound kernel: 4 exec streams per GPU (2× H200, 20480², nb 4096: 94% parallel
    // efficiency with 4, 73% with the default 8).
    //
    // With --overlap each step is a chain of kernels on the same tiles plus a small halo: launch
    // each step behind the previous one on its GPU (launch-ahead), and send halos after their
    // kernel ends rather than offering them at launch, which delays the next interior (2× H200,
    // 4096² row slabs: 85.4% parallel efficiency against 55–66% with the runtime's defaults;
    // docs/tuning.md). Halo descriptors go over MPI rather than the control ring, which puts
    // their writing on the GPU manager, the critical thread of this loop (2× H200, 4096² slabs:
    // median 0.0501 s with the ring off against 0.0510 on, 4 of 5 pairs).
    // `FERRY_LAUNCH_AHEAD`, `FERRY_OFFER_AT_LAUNCH` and `FERRY_CONTROL_RING` still override.
    let mut defaults = ferry::config::Config::default();
    if args.overlap.is_some() {
        defaults.launch_ahead = true;
        defaults.offer_at_launch = false;
        defaults.control_ring = false;
    }
    main_with_config("stencil", defaults, args.devices, Some(4), |rt| run(rt, &args))
}

/// The four edges of every tile, for one step parity.
struct Edges {
    north: Collection<f64>,
    south: Collection<f64>,
    west: Collection<f64>,
    east: Collection<f64>,
}

impl Edges {
    /// The edges of `mt × nt` tiles of `mb × nb` over an `n × n` grid.
    #[allow(clippy::too_many_arguments)]
    fn new(
        rt: &Runtime,
        n: usize,
        (mb, nb): (usize, usize),
        mt: usize,
        nt: usize,
        dist: Distribution,
        p: usize,
    ) -> ferry::Result<Edges> {
        Ok(Edges {
            north: rt.tile_grid(&format!("north{p}"), mt, n, 1, nb, dist)?,
            south: rt.tile_grid(&format!("south{p}"), mt, n, 1, nb, dist)?,
            west: rt.tile_grid(&format!("west{p}"), n, nt, mb, 1, dist)?,
            east: rt.tile_grid(&format!("east{p}"), n, nt, mb, 1, dist)?,
        })
    }
}

/// The four halos (N, S, W, E) of a step or ring task for a CPU body: the neighbours' edges
/// that exist (`args[0..4]` say which; they follow the task's six own accesses, in that order),
/// zeros for the ones at the Dirichlet boundary.
fn host_halos(ctx: &TaskContext<'_>, args: &[i64], rows: usize, cols: usize) -> Result<[Vec<f64>; 4], TaskError> {
    let mut k = 6;
    let mut halo = |present: i64, len: usize| -> Result<Vec<f64>, TaskError> {
        if present == 0 {
            return Ok(vec![0.0; len]);
        }
        k += 1;
        Ok(ctx.tile::<f64>(k - 1)?.to_vec())
    };
    Ok([
        halo(args[0], cols)?,
        halo(args[1], cols)?,
        halo(args[2], rows)?,
        halo(args[3], rows)?,
    ])
}

/// The same halos for a CUDA body: device addresses, null (zeros) at the boundary.
fn device_halos(ctx: &ferry::CudaTaskContext<'_>, args: &[i64]) -> Result<[u64; 4], TaskError> {
    let mut k = 6;
    let mut halo = |present: i64| -> Result<u64, TaskError> {
        if present == 0 {
            return Ok(0);
        }
        k += 1;
        ctx.ptr(k - 1)
    };
    Ok([halo(args[0])?, halo(args[1])?, halo(args[2])?, halo(args[3])?])
}

/// Writes the four edges of `u` (`rows × cols`, row-major) into tiles `first..first + 4`
/// (N, S, W, E).
fn publish_edges(ctx: &TaskContext<'_>, u: &[f64], rows: usize, cols: usize, first: usize) -> Result<(), TaskError> {
    stencil::copy_first_row(rows, cols, u, ctx.tile_mut(first)?)?;
    stencil::copy_last_row(rows, cols, u, ctx.tile_mut(first + 1)?)?;
    stencil::copy_first_col(rows, cols, u, ctx.tile_mut(first + 2)?)?;
    stencil::copy_last_col(rows, cols, u, ctx.tile_mut(first + 3)?)?;
    Ok(())
}

fn run(rt: &Runtime, args: &Args) -> anyhow::Result<()> {
    let (n, nb) = (args.n, args.nb);
    let mb = args.mb.unwrap_or(nb);
    let mut grid = process_grid(rt, args.grid)?;
    // Without --grid, the longer side of the process grid goes along the longer side of the
    // tile grid: row slabs (--mb 2048 --nb 4096 on 2 ranks) are split 2×1, one per rank.
    if args.grid.is_none() && n.div_ceil(mb) > n.div_ceil(nb) && grid.p < grid.q {
        grid = ferry::ProcessGrid { p: grid.q, q: grid.p };
    }
    let dist = Distribution::Block2d(grid);
    // Two fields, read and written in turn (Jacobi's double buffer): step t reads fields[t % 2].
    let fields: [Collection<f64>; 2] = [
        rt.tile_grid("u0", n, n, mb, nb, dist)?,
        rt.tile_grid("u1", n, n, mb, nb, dist)?,
    ];
    // The anchor first, on rank 0, while the runtime is idle (it shares the GPUs).
    let timed_steps = args.iters - args.warmup.min(args.iters);
    let cuda = ferry_examples::on_cuda(rt);
    if args.anchor && !cuda && rt.rank() == 0 {
        eprintln!("stencil: --anchor needs CUDA devices; no anchor");
    }
    // Seconds per step, `(structure, seconds)`: the example's own structure, and with --overlap
    // also the concurrent one.
    let mut anchors: Vec<(&str, f64)> = Vec::new();
    if args.anchor && cuda && rt.size() == 1 && args.overlap.is_none() && timed_steps > 0 {
        // One rank, one GPU: the same tiles' kernels with no runtime, on one stream and on four.
        for (name, streams) in [("1 stream", 1), ("4 streams", 4)] {
            match ferry_kernels::stencil_tiles::seconds_per_step(0, n, (mb, nb), timed_steps, streams) {
                Ok(s) => anchors.push((name, s)),
                Err(e) => eprintln!("stencil: no one-GPU anchor on {name} ({e})"),
            }
        }
    } else if args.anchor && cuda && rt.rank() == 0 && timed_steps > 0 {
        use ferry_kernels::stencil_pair::{seconds_per_step, Structure};
        let structures: &[(&str, Structure)] = if args.overlap.is_some() {
            &[("overlap", Structure::Overlap), ("concurrent", Structure::Concurrent)]
        } else {
            &[("plain", Structure::Plain)]
        };
        for &(name, st) in structures {
            match seconds_per_step(0, 1, n, timed_steps, st) {
                Ok(s) => anchors.push((name, s)),
                Err(e) => eprintln!("stencil: no {name} anchor ({e})"),
            }
        }
    }
    let anchor = |name: &str| anchors.iter().find(|a| a.0 == name).map(|a| a.1);
    rt.wait()?;
    let u = &fields[0];
    let (mt, nt) = (u.tile_rows(), u.tile_cols());
    let edges = [
        Edges::new(rt, n, (mb, nb), mt, nt, dist, 0)?,
        Edges::new(rt, n, (mb, nb), mt, nt, dist, 1)?,
    ];

    let init = TaskClass::new("init", move |ctx| {
        let (i, j) = ctx.coords(0)?;
        let (rows, cols) = ctx.shape(0)?;
        let u = ctx.tile_mut::<f64>(0)?;
        for r in 0..rows {
            for c in 0..cols {
                u[r * cols + c] = stencil::sine_mode(n, i * mb + r, j * nb + c);
            }
        }
        publish_edges(ctx, u, rows, cols, 1)
    });
    // Generator states: one 1×4 tile of u64 (a PhiloxState) per field tile, same owners.
    let rng: Collection<u64> = rt.tile_grid("rng", mt, 4 * nt, 1, 4, dist)?;
    let state_of = |t: usize| -> Vec<ferry::CollectionRef> {
        let (u, e) = (&fields[t % 2], &edges[t % 2]);
        vec![
            u.into(),
            (&e.north).into(),
            (&e.south).into(),
            (&e.west).into(),
            (&e.east).into(),
            (&rng).into(),
        ]
    };
    let start = match &args.restart {
        Some(dir) => {
            let step = Runtime::checkpoint_step(dir)? as usize;
            if step > args.iters {
                bail!(
                    "--restart {}: the checkpoint is at step {step}, beyond --iters {}",
                    dir.display(),
                    args.iters
                );
            }
            rt.restore(dir, &state_of(step))?;
            step
        }
        None => 0,
    };
    let restarted_from = args.restart.as_ref().map(|_| start as u64);
    let seed = args.seed;
    let rng_init = TaskClass::new("rng.init", move |ctx| {
        let (i, j) = ctx.coords(0)?;
        let s = ferry_kernels::rng::PhiloxState::new(seed, (i * nt + j) as u64);
        ctx.tile_mut::<u64>(0)?
            .copy_from_slice(bytemuck::cast_slice(std::slice::from_ref(&s)));
        Ok(())
    });
    for i in 0..mt {
        for j in 0..nt {
            if start > 0 {
                break;
            }
            rt.insert(&rng_init, &[rng.write(i, j)])?;
            let e = &edges[0];
            rt.insert(
                &init,
                &[
                    u.write(i, j),
                    e.north.write(i, j),
                    e.south.write(i, j),
                    e.west.write(i, j),
                    e.east.write(i, j),
                ],
            )?;
        }
    }
    rt.wait()?;

    // args: [has north, has south, has west, has east, alpha bits]; accesses: the tile's old
    // field (read), its new field (write), its four new edges, then the neighbours' old edges
    // that exist, in N, S, W, E order.
    let step = TaskClass::new("step", |ctx| {
        let a = ctx.args();
        let alpha = f64::from_bits(a[4] as u64);
        let (rows, cols) = ctx.shape(0)?;
        let [north, south, west, east] = host_halos(ctx, a, rows, cols)?;
        let out = ctx.tile_mut::<f64>(1)?;
        stencil::jacobi_step(rows, cols, alpha, ctx.tile(0)?, &north, &south, &west, &east, out)?;
        publish_edges(ctx, out, rows, cols, 2)
    })
    .with_cuda(|ctx| {
        let a = ctx.args();
        let alpha = f64::from_bits(a[4] as u64);
        let (rows, cols) = ctx.shape(0)?;
        let [n, s, w, e] = device_halos(ctx, a)?;
        let (old, new) = (ctx.ptr(0)?, ctx.ptr(1)?);
        let mut kern = gpu_kernels(ctx)?;
        // SAFETY: the pointers are this task's tiles, of the shapes given, on the stream's device.
        unsafe {
            let edges = [ctx.ptr(2)?, ctx.ptr(3)?, ctx.ptr(4)?, ctx.ptr(5)?];
            kern.jacobi_step_edges(rows, cols, alpha, old, [n, s, w, e], new, edges)?;
        }
        Ok(())
    });

    // --overlap: the step split in two. Interior: accesses [old field (read), new field],
    // args [alpha bits]; it writes only the cells that need no halo. Ring: the step's accesses;
    // it writes the first and last rows and columns and publishes the new edges. The two write
    // disjoint parts of the new field: `concurrent` says so (`rw_part` for both), `ordered`
    // writes the interior first (`write`) and the ring into it (`rw`).
    let interior = TaskClass::new("step.interior", |ctx| {
        let alpha = f64::from_bits(ctx.args()[0] as u64);
        let (rows, cols) = ctx.shape(0)?;
        stencil::jacobi_interior(rows, cols, alpha, ctx.tile(0)?, ctx.tile_mut::<f64>(1)?)?;
        Ok(())
    })
    .with_cuda(|ctx| {
        let alpha = f64::from_bits(ctx.args()[0] as u64);
        let (rows, cols) = ctx.shape(0)?;
        let (old, new) = (ctx.ptr(0)?, ctx.ptr(1)?);
        let mut kern = gpu_kernels(ctx)?;
        // SAFETY: the pointers are this task's tiles, of the shapes given, on the stream's device.
        unsafe { kern.jacobi_interior(rows, cols, alpha, old, new)? };
        Ok(())
    });
    let ring = TaskClass::new("step.ring", |ctx| {
        let a = ctx.args();
        let alpha = f64::from_bits(a[4] as u64);
        let (rows, cols) = ctx.shape(0)?;
        let [north, south, west, east] = host_halos(ctx, a, rows, cols)?;
        let out = ctx.tile_mut::<f64>(1)?;
        stencil::jacobi_ring(rows, cols, alpha, ctx.tile(0)?, &north, &south, &west, &east, out)?;
        publish_edges(ctx, out, rows, cols, 2)
    })
    .with_cuda(|ctx| {
        let a = ctx.args();
        let alpha = f64::from_bits(a[4] as u64);
        let (rows, cols) = ctx.shape(0)?;
        let halos = device_halos(ctx, a)?;
        let edges = [ctx.ptr(2)?, ctx.ptr(3)?, ctx.ptr(4)?, ctx.ptr(5)?];
        let (old, new) = (ctx.ptr(0)?, ctx.ptr(1)?);
        let mut kern = gpu_kernels(ctx)?;
        // SAFETY: as for the whole step.
        unsafe { kern.jacobi_ring(rows, cols, alpha, old, halos, new, edges)? };
        Ok(())
    });

    // Snapshots: one collection per step, distributed like the field.
    let snaps = if args.save_snapshots {
        Some(
            (0..args.iters)
                .map(|t| rt.tile_grid::<f64>(&format!("snap{t}"), n, n, mb, nb, dist))
                .collect::<Result<Vec<_>, _>>()?,
        )
    } else {
        None
    };
    let save = TaskClass::new("save", |ctx| {
        let src = ctx.tile::<f64>(0)?.to_vec();
        ctx.tile_mut::<f64>(1)?.copy_from_slice(&src);
        Ok(())
    })
    .with_cuda(|ctx| {
        let (rows, cols) = ctx.shape(0)?;
        let mut kern = gpu_kernels(ctx)?;
        // SAFETY: both tiles have the same shape, on the stream's device.
        unsafe { kern.copy_tile(ctx.ptr(1)?, ctx.ptr(0)?, rows * cols * 8)? };
        Ok(())
    });

    let noise = TaskClass::new("noise", |ctx| {
        let amplitude = f64::from_bits(ctx.args()[0] as u64);
        let (rows, cols) = ctx.shape(0)?;
        let state: &mut [u64] = ctx.tile_mut(1)?;
        let st: &mut ferry_kernels::rng::PhiloxState = bytemuck::from_bytes_mut(bytemuck::cast_slice_mut(state));
        let u = ctx.tile_mut::<f64>(0)?;
        st.add_noise(amplitude, u);
        publish_edges(ctx, u, rows, cols, 2)
    })
    .with_cuda(|ctx| {
        let amplitude = f64::from_bits(ctx.args()[0] as u64);
        let (rows, cols) = ctx.shape(0)?;
        let u = ctx.ptr(0)?;
        let mut kern = gpu_kernels(ctx)?;
        // SAFETY: the task's tiles: the field (rows×cols f64), its generator state (32 bytes)
        // and its four edges, on the stream's device.
        unsafe {
            kern.philox_noise(rows * cols, amplitude, ctx.ptr(1)?, u)?;
            kern.copy_edges(rows, cols, u, ctx.ptr(2)?, ctx.ptr(3)?, ctx.ptr(4)?, ctx.ptr(5)?)?;
        }
        Ok(())
    });
    let noise_args = [args.noise.to_bits() as i64];
    let mut checkpoints = Vec::new();

    let warmup = args.warmup.min(args.iters);
    let mut t0 = Instant::now();
    let mut paused = 0.0;
    for t in start..args.iters {
        if t == warmup && warmup > start {
            rt.wait()?;
            t0 = Instant::now();
        }
        let (old, new) = (&edges[t % 2], &edges[(t + 1) % 2]);
        let (src, dst) = (&fields[t % 2], &fields[(t + 1) % 2]);
        let insert_step = |rt: &Runtime| -> ferry::Result<()> {
            for i in 0..mt {
                for j in 0..nt {
                    let mut acc = vec![
                        src.read(i, j),
                        dst.write(i, j),
                        new.north.write(i, j),
                        new.south.write(i, j),
                        new.west.write(i, j),
                        new.east.write(i, j),
                    ];
                    let has = [i > 0, i + 1 < mt, j > 0, j + 1 < nt];
                    if has[0] {
                        acc.push(old.south.read(i - 1, j));
                    }
                    if has[1] {
                        acc.push(old.north.read(i + 1, j));
                    }
                    if has[2] {
                        acc.push(old.east.read(i, j - 1));
                    }
                    if has[3] {
                        acc.push(old.west.read(i, j + 1));
                    }
                    let targs = [
                        has[0] as i64,
                        has[1] as i64,
                        has[2] as i64,
                        has[3] as i64,
                        args.alpha.to_bits() as i64,
                    ];
                    if let Some(overlap) = args.overlap {
                        let alpha = [args.alpha.to_bits() as i64];
                        let (inner, outer) = match overlap {
                            Overlap::Concurrent => (dst.rw_part(i, j), dst.rw_part(i, j)),
                            Overlap::Ordered => (dst.write(i, j), dst.rw(i, j)),
                        };
                        rt.submit(Task::new(&interior, &[src.read(i, j), inner]).args(&alpha))?;
                        acc[1] = outer;
                        rt.submit(Task::new(&ring, &acc).args(&targs).priority(RING_PRIORITY))?;
                    } else {
                        rt.submit(Task::new(&step, &acc).args(&targs))?;
                    }
                    if args.noise > 0.0 {
                        let acc = [
                            dst.rw(i, j),
                            rng.rw(i, j),
                            new.north.write(i, j),
                            new.south.write(i, j),
                            new.west.write(i, j),
                            new.east.write(i, j),
                        ];
                        rt.submit(Task::new(&noise, &acc).args(&noise_args))?;
                    }
                    if let Some(snaps) = &snaps {
                        rt.insert(&save, &[dst.read(i, j), snaps[t].write(i, j)])?;
                    }
                }
            }
            Ok(())
        };
        if args.replay {
            rt.trace((t % 2) as u64, insert_step)?;
        } else {
            insert_step(rt)?;
        }
        let done = t + 1;
        if args.checkpoint_every > 0 && done % args.checkpoint_every == 0 && done < args.iters {
            let dir = args
                .checkpoint_dir
                .as_ref()
                .expect("checked in main")
                .join(format!("step-{done}"));
            rt.wait()?;
            let c0 = Instant::now();
            let (rep, host_added) =
                ferry_examples::alloc::measure(|| rt.checkpoint(&dir, done as u64, &state_of(done)));
            let rep = rep?;
            paused += c0.elapsed().as_secs_f64();
            checkpoints.push(CheckpointRecord {
                step: done,
                seconds: rep.seconds,
                bytes: rep.from_host + rep.from_device + rep.from_disk,
                from_device: rep.from_device,
                gbps: rep.gbps(),
                host_added,
                bounce_bytes: rep.bounce_bytes,
            });
        }
    }
    rt.wait()?;
    let seconds = t0.elapsed().as_secs_f64() - paused;
    let mut backward = match &snaps {
        Some(snaps) => Some(backward_pass(rt, snaps, n, (mb, nb), args.alpha, dist)?),
        None => None,
    };

    // Verification on the owners: analytic decay and a bitwise checksum.
    let u = &fields[args.iters % 2];
    let g = stencil::sine_mode_decay(n, args.alpha).powi(args.iters as i32);
    let (max_err, checksum) = verify(rt, u, n, (mb, nb), g)?;
    if let Some(b) = &backward {
        if b.max_rel_error.is_nan() || b.max_rel_error >= 1e-9 {
            bail!(
                "the backward pass deviates from the analytic sum by {:.3e} (relative)",
                b.max_rel_error
            );
        }
    }
    let stats = rt.gather_stats()?;
    if rt.rank() == 0 {
        let updates = (n * n * (args.iters - warmup.max(start))) as f64 / seconds;
        println!(
            "stencil: {n}×{n} grid, {mb}×{nb} tiles ({mt}×{nt}), {} steps, α = {}",
            args.iters, args.alpha
        );
        println!(
            "{:<16} {} ({} ranks × {} workers)",
            "grid",
            grid,
            rt.size(),
            rt.workers()
        );
        println!("{:<16} {:.4}", "seconds", seconds);
        let steps = (args.iters - warmup.max(start)) as f64;
        for &(name, per_step) in &anchors {
            let what = if name.contains("stream") {
                format!("1 GPU, the same tiles' kernels on {name}")
            } else {
                format!("2 GPUs, row slabs, {name}")
            };
            println!(
                "{:<16} {:.4}  ({what}, no runtime; this run {:+.1} µs per step, {:.2}×)",
                "anchor",
                per_step * steps,
                (seconds / steps - per_step) * 1e6,
                seconds / steps / per_step
            );
        }
        println!("{:<16} {:.3e}", "cell updates/s", updates);
        if args.noise > 0.0 {
            println!(
                "{:<16} n/a (with --noise there is no analytic solution)",
                "max rel. error"
            );
        } else {
            println!(
                "{:<16} {:.3e}  (against g^T × initial sine mode)",
                "max rel. error", max_err
            );
        }
        println!("{:<16} {:016x}", "checksum", checksum);
        for c in &checkpoints {
            println!(
                "{:<16} step {}: {} bytes ({} from devices) in {:.4} s, {:.2} GB/s on rank 0, host memory added {} bytes (bounce pool {})",
                "checkpoint", c.step, c.bytes, c.from_device, c.seconds, c.gbps, c.host_added, c.bounce_bytes
            );
        }
        if let Some(s) = restarted_from {
            println!("{:<16} from step {s}", "restarted");
        }
        if let Some(b) = &backward {
            println!(
                "{:<16} {} steps in {:.4} s, max rel. error {:.3e}, checksum {}, {} snapshot reads waited for disk, {} prefetched",
                "backward", b.steps, b.seconds, b.max_rel_error, b.checksum, b.waited, b.prefetched
            );
        }
        if !ferry_examples::quiet() {
            print!("{}", ferry::StatsSnapshot::table(&stats));
        }
        if let Some(path) = &args.json {
            let rec = Record {
                example: "stencil",
                n,
                mb,
                nb,
                iters: args.iters,
                alpha: args.alpha,
                grid: grid.to_string(),
                ranks: rt.size(),
                workers: rt.workers(),
                seconds,
                cell_updates_per_s: updates,
                max_rel_error: max_err,
                checksum: format!("{checksum:016x}"),
                tasks: stats.iter().map(|s| s.tasks()).sum(),
                replayed_tasks: stats.iter().map(|s| s.replayed_tasks).sum(),
                fused_replays: stats.iter().map(|s| s.fused_replays).sum(),
                fused_tasks: stats.iter().map(|s| s.fused_tasks).sum(),
                overlap: args.overlap.map(Overlap::name),
                launched_ahead: stats.iter().flat_map(|s| &s.devices).map(|d| d.launched_ahead).sum(),
                followed: stats.iter().flat_map(|s| &s.devices).map(|d| d.followed).sum(),
                parts_together: stats.iter().flat_map(|s| &s.devices).map(|d| d.parts_together).sum(),
                comm_in_ahead: stats.iter().flat_map(|s| &s.devices).map(|d| d.comm_in_ahead).sum(),
                offered_at_launch: stats.iter().flat_map(|s| &s.devices).map(|d| d.offered_at_launch).sum(),
                offers_seen: stats.iter().flat_map(|s| &s.devices).map(|d| d.offers_seen).sum(),
                offers_waited: stats.iter().flat_map(|s| &s.devices).map(|d| d.offers_waited).sum(),
                acked_on_device: stats.iter().flat_map(|s| &s.devices).map(|d| d.acked_on_device).sum(),
                renamed: stats.iter().map(|s| s.renamed).sum(),
                inserter_jobs: stats.iter().map(|s| s.inserter_jobs).sum(),
                paths: path_records(&stats),
                tier: ferry_examples::tier_record(&stats),
                backward: backward.take(),
                checkpoints: std::mem::take(&mut checkpoints),
                restarted_from,
                // One GPU: the faster of the one-stream and four-stream anchors.
                anchor_seconds: anchor(match args.overlap {
                    Some(Overlap::Concurrent) => "concurrent",
                    Some(Overlap::Ordered) => "overlap",
                    None => "plain",
                })
                .or_else(|| {
                    anchors
                        .iter()
                        .filter(|a| a.0.contains("stream"))
                        .map(|a| a.1)
                        .min_by(f64::total_cmp)
                })
                .map(|x| x * steps),
                anchor_concurrent_seconds: anchor("concurrent").map(|x| x * steps),
            };
            write_json(path, &rec)?;
        }
    }
    if args.noise == 0.0 && (max_err.is_nan() || max_err >= 1e-9) {
        bail!("the field deviates from the analytic solution by {max_err:.3e} (relative)");
    }

    Ok(())
}
