//! Tiled Cholesky factorization `A = L·Lᵀ` on ferry: POTRF, TRSM, SYRK and GEMM tasks on the
//! lower tiles of a 2D block-cyclic matrix, with faer kernels on the CPU.
//!
//! Inputs: a generated SPD matrix (`--n`, `--seed`), or the Gaussian-process covariance over the
//! GeoNames places (`--points data/cities1000.csv --count M`). With places, the Gaussian
//! log-likelihood of the standardized-latitude field under the GP is reported as well:
//! `ℓ = −½ zᵀΣ⁻¹z − ½ log det Σ − (n/2) ln 2π`, with `log det Σ = 2 Σ ln L_ii` and
//! `zᵀΣ⁻¹z = ‖L⁻¹z‖²` (a tiled forward substitution on the factor).
//!
//! Check: `‖A − L·Lᵀ‖_F / (‖A‖_F · n · ε)`, computed with tiled tasks as well (`--check`).

use anyhow::{bail, Context};
use clap::Parser;
use ferry::{Collection, Distribution, ProcessGrid, Runtime, Task, TaskClass};
use ferry_examples::{gpu_kernels, main_with_runtime, path_records, process_grid, write_json};
use ferry_kernels::geo::{self, CovKernel, CovParams, Ordering, Place};
use ferry_kernels::{spd, tile};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

// mimalloc underneath: ferry's threads free what other threads allocated (see `alloc`).
#[global_allocator]
static ALLOC: ferry_examples::alloc::Counting = ferry_examples::alloc::Counting;

#[derive(Parser, Debug, Clone)]
#[command(about = "Tiled Cholesky factorization on ferry (run under mpirun)")]
struct Args {
    /// Matrix order for the generated SPD matrix (not with --points: the places set it).
    #[arg(long, default_value_t = 2048, conflicts_with = "points")]
    n: usize,
    /// Tile size (nb×nb tiles; the last row/column of tiles may be smaller).
    #[arg(long, default_value_t = 256)]
    nb: usize,
    /// Process grid PxQ (default: as square as the rank count allows).
    #[arg(long)]
    grid: Option<ProcessGrid>,
    /// Seed of the generated matrix (not with --points).
    #[arg(long, default_value_t = 42, conflicts_with = "points")]
    seed: u64,
    /// CSV of places (lat,lon,cc): factorize their GP covariance instead.
    #[arg(long)]
    points: Option<PathBuf>,
    /// Number of places to use (first M in the chosen order; with --points).
    #[arg(long, requires = "points")]
    count: Option<usize>,
    /// Order of the places: file or morton (a space-filling curve: the first M form a compact region).
    #[arg(long, default_value = "file", requires = "points")]
    order: Ordering,
    /// Covariance kernel: exponential, matern32, matern52 or sqexp.
    #[arg(long, default_value = "exponential", requires = "points")]
    kernel: CovKernel,
    /// Kernel length scale in km.
    #[arg(long, default_value_t = 500.0, requires = "points")]
    length_scale: f64,
    /// Kernel variance σ².
    #[arg(long, default_value_t = 1.0, requires = "points")]
    variance: f64,
    /// Nugget τ² added to the diagonal.
    #[arg(long, default_value_t = 1e-2, requires = "points")]
    nugget: f64,
    /// Residual check: exact (tiled L·Lᵀ), none, or auto (exact up to n = 16384).
    #[arg(long, default_value = "auto")]
    check: String,
    /// Also time faer's dense Cholesky of the same matrix on rank 0 (same run, same threads).
    #[arg(long)]
    compare_dense: bool,
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
    /// Untimed warm-up factorizations of a small (2·nb) matrix first: the first use of a GPU
    /// library loads its kernels (hundreds of ms), which is not what the timing should measure.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed factorizations of the same matrix (regenerated before each, untimed); `seconds`
    /// is their median.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    reps: u64,
    /// Insert each factorization as a trace (`Runtime::trace`): the first is recorded, the
    /// later ones (--reps) replay the recording instead of redoing the dependence analysis.
    /// Same bits either way.
    #[arg(long)]
    replay: bool,
}

/// Where the matrix entries come from; every tile is generated on its owner.
#[derive(Clone)]
enum Source {
    Spd { seed: u64, n: usize },
    Gp { places: Arc<Vec<Place>>, params: CovParams },
}

impl Source {
    fn n(&self) -> usize {
        match self {
            Source::Spd { n, .. } => *n,
            Source::Gp { places, .. } => places.len(),
        }
    }
    fn fill(
        &self,
        i0: usize,
        j0: usize,
        rows: usize,
        cols: usize,
        out: &mut [f64],
    ) -> Result<(), ferry_kernels::KernelError> {
        match self {
            Source::Spd { seed, n } => spd::spd_tile(*seed, *n, i0, j0, rows, cols, out),
            Source::Gp { places, params } => geo::covariance_tile(places, params, i0, j0, rows, cols, out),
        }
    }
}

#[derive(Serialize)]
struct Record {
    example: &'static str,
    n: usize,
    nb: usize,
    grid: String,
    ranks: usize,
    workers: usize,
    input: String,
    seconds: f64,
    /// Every timed factorization's seconds (`seconds` is their median), and whether the later
    /// ones replayed a trace.
    rep_seconds: Vec<f64>,
    replay: bool,
    gflops: f64,
    residual: Option<f64>,
    logdet: f64,
    loglik: Option<f64>,
    dense_seconds: Option<f64>,
    dense_gflops: Option<f64>,
    tasks: u64,
    /// Tasks inserted by replaying a trace (`--replay`), all ranks (each rank counts every task).
    replayed_tasks: u64,
    /// Replays fused into one GPU launch (a CUDA graph on CUDA devices), and the tasks they
    /// held, all ranks.
    fused_replays: u64,
    fused_tasks: u64,
    paths: Vec<ferry_examples::PathRecord>,
    tier: ferry::TierStats,
    /// Every rank's devices, in rank order.
    devices: Vec<ferry::DeviceStats>,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    ferry_examples::set_verbosity(args.verbose, args.quiet);
    // Bad input ends here, before MPI starts or any work is done.
    let source = match prepare(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cholesky: error: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    main_with_runtime("cholesky", args.devices, None, |rt| run(rt, &args, source))
}

fn prepare(args: &Args) -> anyhow::Result<Source> {
    if !matches!(args.check.as_str(), "auto" | "exact" | "none") {
        bail!("--check {}: expected auto, exact or none", args.check);
    }
    let source = match &args.points {
        Some(path) => {
            if !path.exists() {
                bail!("--points {}: no such file", path.display());
            }
            let places = geo::load_places(path, args.count, args.order)
                .with_context(|| format!("reading {}", path.display()))?;
            let params = CovParams {
                kernel: args.kernel,
                variance: args.variance,
                length_scale_km: args.length_scale,
                nugget: args.nugget,
            };
            params.validate()?;
            Source::Gp {
                places: Arc::new(places),
                params,
            }
        }
        None => Source::Spd {
            seed: args.seed,
            n: args.n,
        },
    };
    let n = source.n();
    if n < 1 {
        bail!("--n must be at least 1");
    }
    if args.nb < 1 || args.nb > n {
        bail!("--nb {} must be between 1 and n = {n}", args.nb);
    }
    Ok(source)
}

/// Sum over ranks, in rank order (the same bits on every rank).
fn global_sum(rt: &Runtime, x: f64) -> anyhow::Result<f64> {
    Ok(rt.allgather_f64(x)?.iter().sum())
}

fn run(rt: &Runtime, args: &Args, source: Source) -> anyhow::Result<()> {
    let grid = process_grid(rt, args.grid)?;
    let n = source.n();
    let nb = args.nb;
    let a: Collection<f64> = rt.tiled_matrix("A", n, n, nb, Distribution::BlockCyclic2d(grid))?;
    let nt = a.tile_rows();

    // Generate the lower tiles on their owners.
    let gen = generate_class("generate", &source);
    let kernels = kernels();
    let nb_arg = [nb as i64];
    let generate = || -> ferry::Result<()> {
        for j in 0..nt {
            for i in j..nt {
                rt.submit(Task::new(&gen, &[a.write(i, j)]).args(&nb_arg))?;
            }
        }
        rt.wait()
    };
    generate()?;

    // Warm-up on a small generated matrix (same classes, same streams), then the timed run.
    let m = (2 * nb).min(n);
    for w in 0..args.warmup {
        let wm: Collection<f64> =
            rt.tiled_matrix(&format!("warmup{w}"), m, m, nb, Distribution::BlockCyclic2d(grid))?;
        let wgen = generate_class("warmup.generate", &Source::Spd { seed: args.seed, n: m });
        for j in 0..wm.tile_rows() {
            for i in j..wm.tile_rows() {
                rt.submit(Task::new(&wgen, &[wm.write(i, j)]).args(&nb_arg))?;
            }
        }
        factorize(rt, &wm, &kernels)?;
        rt.wait()?;
    }

    // The factorizations: one trace id for all of them, so the later ones replay the first.
    let mut rep_seconds = Vec::with_capacity(args.reps as usize);
    for r in 0..args.reps {
        if r > 0 {
            generate()?;
        }
        let t0 = Instant::now();
        if args.replay {
            rt.trace(0, |rt| factorize(rt, &a, &kernels))?;
        } else {
            factorize(rt, &a, &kernels)?;
        }
        rt.wait()?;
        rep_seconds.push(t0.elapsed().as_secs_f64());
    }
    let seconds = {
        let mut s = rep_seconds.clone();
        s.sort_by(f64::total_cmp);
        let k = s.len() / 2;
        if s.len() % 2 == 1 {
            s[k]
        } else {
            (s[k - 1] + s[k]) / 2.0
        }
    };
    let gflops = (n as f64).powi(3) / 3.0 / seconds / 1e9;

    // log det Σ = 2 Σ ln L_ii over the diagonal tiles this rank owns.
    let mut logdet_local = 0.0;
    for k in 0..nt {
        if a.owner(k, k)? == rt.rank() {
            let (r, _) = a.tile_shape(k, k)?;
            logdet_local += 2.0 * tile::lower_logdet(r, &rt.tile(&a, k, k)?)?;
        }
    }
    let logdet = global_sum(rt, logdet_local)?;

    let loglik = match &source {
        Source::Gp { places, .. } => Some(loglik(rt, &a, grid, places)?),
        Source::Spd { .. } => None,
    };
    let exact = match args.check.as_str() {
        "exact" => true,
        "none" => false,
        _ => n <= 16384,
    };
    let residual = if exact {
        Some(residual(rt, &a, &source, grid)?)
    } else {
        None
    };

    let stats = rt.gather_stats()?;
    let on_gpu = !rt.devices().is_empty();
    let (dense_seconds, dense_gflops) = if args.compare_dense && rt.rank() == 0 {
        let s = if on_gpu {
            gpu_baseline(&source)?
        } else {
            dense_baseline(&source, rt.workers())?
        };
        (Some(s), Some((n as f64).powi(3) / 3.0 / s / 1e9))
    } else {
        (None, None)
    };
    if rt.rank() != 0 {
        return Ok(());
    }
    let input = match (&source, &args.points) {
        (Source::Gp { params, .. }, Some(p)) => format!(
            "{} places of {} ({:?} order), {} kernel, length {} km, variance {}, nugget {}",
            n,
            p.display(),
            args.order,
            params.kernel.name(),
            params.length_scale_km,
            params.variance,
            params.nugget
        ),
        _ => format!("generated SPD, seed {}", args.seed),
    };
    println!("cholesky: {input}");
    println!("{:<14} {}", "n", n);
    println!("{:<14} {} ({}×{} tiles)", "nb", nb, nt, nt);
    println!(
        "{:<14} {} ({} ranks × {} workers)",
        "grid",
        grid,
        rt.size(),
        rt.workers()
    );
    println!("{:<14} {:.4}", "seconds", seconds);
    if rep_seconds.len() > 1 {
        let all: Vec<String> = rep_seconds.iter().map(|s| format!("{s:.4}")).collect();
        println!(
            "{:<14} {} (median above){}",
            "reps",
            all.join(" "),
            if args.replay {
                ", the first recorded, the others replayed"
            } else {
                ""
            }
        );
    }
    println!("{:<14} {:.2}", "GFLOP/s", gflops);
    if let Some(r) = residual {
        println!("{:<14} {:.3e}  (‖A−LLᵀ‖_F / (‖A‖_F·n·ε))", "residual", r);
    }
    println!("{:<14} {:.6}", "log det", logdet);
    if let Some(l) = loglik {
        println!("{:<14} {:.6}", "log-likelihood", l);
    }
    for d in rt.devices() {
        println!("{:<14} {d}", "device");
    }
    if let (Some(s), Some(g)) = (dense_seconds, dense_gflops) {
        let anchor = if on_gpu { "cuSOLVER" } else { "faer dense" };
        println!(
            "{:<14} {:.4} s, {:.2} GFLOP/s, ferry/{anchor} = {:.3}",
            anchor,
            s,
            g,
            gflops / g
        );
    }
    if !ferry_examples::quiet() {
        print!("{}", ferry::StatsSnapshot::table(&stats));
    }
    if let Some(path) = &args.json {
        let rec = Record {
            example: "cholesky",
            n,
            nb,
            grid: grid.to_string(),
            ranks: rt.size(),
            workers: rt.workers(),
            input,
            seconds,
            rep_seconds,
            replay: args.replay,
            gflops,
            residual,
            logdet,
            loglik,
            dense_seconds,
            dense_gflops,
            tasks: stats.iter().map(|s| s.tasks()).sum(),
            replayed_tasks: stats.iter().map(|s| s.replayed_tasks).sum(),
            fused_replays: stats.iter().map(|s| s.fused_replays).sum(),
            fused_tasks: stats.iter().map(|s| s.fused_tasks).sum(),
            paths: path_records(&stats),
            tier: ferry_examples::tier_record(&stats),
            devices: stats.iter().flat_map(|s| s.devices.clone()).collect(),
        };
        write_json(path, &rec)?;
    }
    if let Some(r) = residual {
        if r.is_nan() || r >= 1.0 {
            bail!("residual {r:.3e} is not below 1: the factorization is wrong");
        }
    }
    Ok(())
}

/// A class writing tile `(i, j)` of the matrix (argument: nb) on its owner. The generated SPD
/// matrix is produced on the GPU where the tile will be used; the GP covariance is computed on
/// the CPU (and staged in when a GPU needs it).
fn generate_class(name: &str, source: &Source) -> TaskClass {
    let src = source.clone();
    let class = TaskClass::new(name, move |ctx| {
        let (i, j) = ctx.coords(0)?;
        let (rows, cols) = ctx.shape(0)?;
        let nb = ctx.args()[0] as usize;
        src.fill(i * nb, j * nb, rows, cols, ctx.tile_mut::<f64>(0)?)?;
        Ok(())
    });
    match *source {
        Source::Spd { seed, n } => class.with_cuda(move |ctx| {
            let (i, j) = ctx.coords(0)?;
            let (rows, cols) = ctx.shape(0)?;
            let nb = ctx.args()[0] as usize;
            let out = ctx.ptr(0)?;
            // SAFETY: `out` is the task's rows×cols tile on this stream's device.
            unsafe { gpu_kernels(ctx)?.spd_tile(seed, n, i * nb, j * nb, rows, cols, out)? };
            Ok(())
        }),
        Source::Gp { .. } => class,
    }
}

/// Inserts the right-looking tiled Cholesky (LAPACK `dpotrf` blocked, lower): for each panel k,
/// POTRF on the diagonal tile, TRSM down the panel, SYRK/GEMM on the trailing matrix.
/// The Cholesky's task classes, made once: a replayed trace fuses its GPU tasks into one CUDA
/// graph, reused as long as the replays insert the recording's class objects.
struct Kernels {
    potrf: TaskClass,
    trsm: TaskClass,
    syrk: TaskClass,
    gemm: TaskClass,
}

fn kernels() -> Kernels {
    // Each class has a CPU body (faer) and a CUDA body (cuSOLVER/cuBLAS on the task's stream).
    // SAFETY (every CUDA body): the pointers are the task's tiles, of the shapes given, on the
    // device of the stream the kernels enqueue on.
    let potrf = TaskClass::new("potrf", |ctx| {
        let (n, _) = ctx.shape(0)?;
        tile::potrf(n, ctx.tile_mut(0)?)?;
        Ok(())
    })
    .with_cuda(|ctx| {
        let (n, _) = ctx.shape(0)?;
        unsafe { gpu_kernels(ctx)?.potrf(n, ctx.ptr(0)?)? };
        Ok(())
    });
    let trsm = TaskClass::new("trsm", |ctx| {
        let (m, n) = ctx.shape(1)?;
        tile::trsm(m, n, ctx.tile(0)?, ctx.tile_mut(1)?)?;
        Ok(())
    })
    .with_cuda(|ctx| {
        let (m, n) = ctx.shape(1)?;
        unsafe { gpu_kernels(ctx)?.trsm(m, n, ctx.ptr(0)?, ctx.ptr(1)?)? };
        Ok(())
    });
    let syrk = TaskClass::new("syrk", |ctx| {
        let (n, k) = ctx.shape(0)?;
        tile::syrk(n, k, ctx.tile(0)?, ctx.tile_mut(1)?)?;
        Ok(())
    })
    .with_cuda(|ctx| {
        let (n, k) = ctx.shape(0)?;
        unsafe { gpu_kernels(ctx)?.syrk(n, k, ctx.ptr(0)?, ctx.ptr(1)?)? };
        Ok(())
    });
    let gemm = TaskClass::new("gemm", |ctx| {
        let (m, k) = ctx.shape(0)?;
        let (n, _) = ctx.shape(1)?;
        tile::gemm_nt(m, n, k, ctx.tile(0)?, ctx.tile(1)?, ctx.tile_mut(2)?)?;
        Ok(())
    })
    .with_cuda(|ctx| {
        let (m, k) = ctx.shape(0)?;
        let (n, _) = ctx.shape(1)?;
        unsafe { gpu_kernels(ctx)?.gemm_nt(m, n, k, ctx.ptr(0)?, ctx.ptr(1)?, ctx.ptr(2)?)? };
        Ok(())
    });
    Kernels {
        potrf,
        trsm,
        syrk,
        gemm,
    }
}

fn factorize(rt: &Runtime, a: &Collection<f64>, kernels: &Kernels) -> anyhow::Result<()> {
    let nt = a.tile_rows();
    let Kernels {
        potrf,
        trsm,
        syrk,
        gemm,
    } = kernels;
    // Priorities follow the critical path POTRF(k) → TRSM(k+1, k) → SYRK(k+1, k) → POTRF(k+1)
    // (≥ 2: the device's high-priority stream), then the rest of the panel and the updates of the
    // next panel's column (1: look-ahead), then the trailing update (0).
    for k in 0..nt {
        rt.submit(Task::new(potrf, &[a.rw(k, k)]).priority(3))?;
        for m in k + 1..nt {
            let p = if m == k + 1 { 2 } else { 1 };
            rt.submit(Task::new(trsm, &[a.read(k, k), a.rw(m, k)]).priority(p))?;
        }
        for m in k + 1..nt {
            let p = if m == k + 1 { 2 } else { 0 };
            rt.submit(Task::new(syrk, &[a.read(m, k), a.rw(m, m)]).priority(p))?;
            for n in k + 1..m {
                let p = i32::from(n == k + 1);
                rt.submit(Task::new(gemm, &[a.read(m, k), a.read(n, k), a.rw(m, n)]).priority(p))?;
            }
        }
    }
    Ok(())
}

/// `ℓ = −½‖L⁻¹z‖² − ½ log det Σ − (n/2) ln 2π` for z = standardized latitudes, with the
/// forward substitution as TRSV/GEMV tasks on a tiled vector.
fn loglik(rt: &Runtime, l: &Collection<f64>, grid: ProcessGrid, places: &Arc<Vec<Place>>) -> anyhow::Result<f64> {
    let n = places.len();
    let (nb, _) = l.tile_size();
    let nt = l.tile_rows();
    // Vector tile k lives with the process row of L's tile row k.
    let z: Collection<f64> = rt.tile_grid("z", n, 1, nb, 1, Distribution::BlockCyclic2d(grid))?;
    let data = Arc::new(geo::standardized_latitude(places));
    let zgen = TaskClass::new("z.generate", move |ctx| {
        let (k, _) = ctx.coords(0)?;
        let nb = ctx.args()[0] as usize;
        let t = ctx.tile_mut::<f64>(0)?;
        let len = t.len();
        t.copy_from_slice(&data[k * nb..k * nb + len]);
        Ok(())
    });
    let trsv = TaskClass::new("trsv", |ctx| {
        let (n, _) = ctx.shape(0)?;
        tile::trsv_lower(n, ctx.tile(0)?, ctx.tile_mut(1)?)?;
        Ok(())
    });
    let gemv = TaskClass::new("gemv", |ctx| {
        let (m, n) = ctx.shape(0)?;
        tile::gemv_sub(m, n, ctx.tile(0)?, ctx.tile(1)?, ctx.tile_mut(2)?)?;
        Ok(())
    });
    for k in 0..nt {
        rt.submit(Task::new(&zgen, &[z.write(k, 0)]).args(&[nb as i64]))?;
    }
    for k in 0..nt {
        rt.insert(&trsv, &[l.read(k, k), z.rw(k, 0)])?;
        for m in k + 1..nt {
            rt.insert(&gemv, &[l.read(m, k), z.read(k, 0), z.rw(m, 0)])?;
        }
    }
    rt.wait()?;
    let mut quad = 0.0;
    let mut logdet = 0.0;
    for k in 0..nt {
        if z.owner(k, 0)? == rt.rank() {
            quad += tile::sum_squares(z.tile_shape(k, 0)?.0, 1, &rt.tile(&z, k, 0)?)?;
        }
        if l.owner(k, k)? == rt.rank() {
            logdet += 2.0 * tile::lower_logdet(l.tile_shape(k, k)?.0, &rt.tile(l, k, k)?)?;
        }
    }
    let quad = global_sum(rt, quad)?;
    let logdet = global_sum(rt, logdet)?;
    Ok(geo::gaussian_loglik(n, logdet, quad))
}

/// `‖A − L·Lᵀ‖_F / (‖A‖_F · n · ε)`: R = A − Σ_k L_ik·L_jkᵀ as tasks on a second matrix, then
/// per-rank sums of squares (off-diagonal tiles count twice: A and R are symmetric).
fn residual(rt: &Runtime, l: &Collection<f64>, source: &Source, grid: ProcessGrid) -> anyhow::Result<f64> {
    let n = source.n();
    let (nb, _) = l.tile_size();
    let nt = l.tile_rows();
    let r: Collection<f64> = rt.tiled_matrix("R", n, n, nb, Distribution::BlockCyclic2d(grid))?;
    let gen = generate_class("residual.generate", source);
    let update = TaskClass::new("residual.gemm", |ctx| {
        let (m, k) = ctx.shape(0)?;
        let (n, _) = ctx.shape(1)?;
        tile::gemm_nt(m, n, k, ctx.tile(0)?, ctx.tile(1)?, ctx.tile_mut(2)?)?;
        Ok(())
    })
    .with_cuda(|ctx| {
        let (m, k) = ctx.shape(0)?;
        let (n, _) = ctx.shape(1)?;
        unsafe { gpu_kernels(ctx)?.gemm_nt(m, n, k, ctx.ptr(0)?, ctx.ptr(1)?, ctx.ptr(2)?)? };
        Ok(())
    });
    // Diagonal tiles: R_jj −= L_jk·L_jkᵀ reads one tile twice, so it has its own class.
    let diag = TaskClass::new("residual.diag", |ctx| {
        let (m, k) = ctx.shape(0)?;
        let l = ctx.tile::<f64>(0)?;
        tile::gemm_nt(m, m, k, l, l, ctx.tile_mut(1)?)?;
        Ok(())
    })
    .with_cuda(|ctx| {
        let (m, k) = ctx.shape(0)?;
        let l = ctx.ptr(0)?;
        unsafe { gpu_kernels(ctx)?.gemm_nt(m, m, k, l, l, ctx.ptr(1)?)? };
        Ok(())
    });
    let nb_arg = [nb as i64];
    for j in 0..nt {
        for i in j..nt {
            rt.submit(Task::new(&gen, &[r.write(i, j)]).args(&nb_arg))?;
            for k in 0..=j {
                if i == j {
                    rt.insert(&diag, &[l.read(j, k), r.rw(j, j)])?;
                } else {
                    rt.insert(&update, &[l.read(i, k), l.read(j, k), r.rw(i, j)])?;
                }
            }
        }
    }
    rt.wait()?;
    let (mut rr, mut aa) = (0.0, 0.0);
    for j in 0..nt {
        for i in j..nt {
            if r.owner(i, j)? != rt.rank() {
                continue;
            }
            let (rows, cols) = r.tile_shape(i, j)?;
            let w = if i == j { 1.0 } else { 2.0 };
            rr += w * tile::sum_squares(rows, cols, &rt.tile(&r, i, j)?)?;
            let mut a = vec![0.0; rows * cols];
            source.fill(i * nb, j * nb, rows, cols, &mut a)?;
            aa += w * tile::sum_squares(rows, cols, &a)?;
        }
    }
    let rr = global_sum(rt, rr)?;
    let aa = global_sum(rt, aa)?;
    Ok(rr.sqrt() / (aa.sqrt() * n as f64 * f64::EPSILON))
}

/// cuSOLVER's `dpotrf` of the same generated matrix on this rank's first visible GPU, in the
/// same process (the anchor of the GPU runs).
fn gpu_baseline(source: &Source) -> anyhow::Result<f64> {
    match source {
        Source::Spd { seed, n } => Ok(ferry_kernels::cuda::cusolver_dpotrf_baseline(0, *n, *seed)?.seconds),
        Source::Gp { .. } => bail!("--compare-dense on a GPU needs the generated matrix (no --points)"),
    }
}

/// faer's dense Cholesky of the same matrix with as many threads as the tiled run had.
fn dense_baseline(source: &Source, threads: usize) -> anyhow::Result<f64> {
    let n = source.n();
    let mut a = vec![0.0; n * n];
    source.fill(0, 0, n, n, &mut a)?;
    let t0 = Instant::now();
    tile::dense_cholesky(n, &mut a, threads)?;
    Ok(t0.elapsed().as_secs_f64())
}
