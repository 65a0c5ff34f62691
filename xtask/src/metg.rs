//! `cargo xtask metg`: the minimum effective task granularity (METG, Slaughter et al., SC20) of
//! ferry and of the plain-MPI baseline, measured in the same run.
//!
//! A sweep of Task Bench's `compute_bound` kernel from large to small tasks on one pattern; at
//! each size both systems run interleaved, `--reps` times each, and the medians count (this
//! machine class has slow phases). Efficiency = achieved FLOP/s ÷ a peak shared by both systems
//! (the best median FLOP/s of any run); time per task = elapsed × cores ÷ tasks. METG(50%) is the
//! smallest time per task still at ≥ 50% efficiency, interpolated linearly to the 50% crossing as
//! Task Bench's `chart_metg.py` does. Also measured: the floor, time per task with the `empty`
//! kernel. Writes `target/metg/metg.json`, the plot `target/metg/metg.png`, and prints a table.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::collections::BTreeMap;

use crate::util;

#[derive(Args)]
pub struct MetgArgs {
    /// Ranks of the MPI baseline (one per core, as Task Bench runs MPI).
    #[arg(long, default_value_t = 2)]
    np: u32,
    /// Ranks of ferry (Task Bench runs task runtimes with one rank per node and a worker per
    /// core); each gets cores ÷ ranks workers.
    #[arg(long, default_value_t = 1)]
    ferry_np: u32,
    /// Repetitions per size and system (medians are used).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Task Bench dependence pattern.
    #[arg(long, default_value = "stencil_1d")]
    pattern: String,
    /// Timesteps per run.
    #[arg(long, default_value_t = 1000)]
    steps: u64,
    /// Points per timestep (default: the cores used, one task per core per step).
    #[arg(long)]
    width: Option<u64>,
    /// Cores the run uses, for time per task (default: the rank count).
    #[arg(long)]
    cores: Option<u64>,
    /// Largest task: 2^max_log2 kernel iterations.
    #[arg(long, default_value_t = 16)]
    max_log2: u32,
    /// Smallest task: 2^min_log2 iterations.
    #[arg(long, default_value_t = 0)]
    min_log2: u32,
    /// Use the binaries already built.
    #[arg(long)]
    no_build: bool,
    /// Task Bench's own MPI implementation as the baseline: a Task Bench checkout with
    /// `mpi/nonblock` built (`make -C DIR/core && make -C DIR/mpi nonblock`), or that binary
    /// itself. Without it the port `taskbench-mpi` stands in, and the output says so.
    #[arg(long)]
    reference: Option<std::path::PathBuf>,
    /// Whole sweeps to run one after the other: this machine class has phases that last longer
    /// than a sweep, so one ratio says little; each sweep prints its table, and a last line
    /// gives every sweep's ratio.
    #[arg(long, default_value_t = 1)]
    sweeps: usize,
    /// Instead of the METG sweep: ferry as MPI users launch everything, a rank per core with
    /// one worker each, against one rank with a worker per core, at each size of the sweep
    /// (interleaved, medians); writes `target/metg/rank-per-core.json`.
    #[arg(long)]
    rank_per_core: bool,
    /// Also run ferry with its steps inserted as traces (`taskbench -replay`: the dependence
    /// analysis recorded once and replayed), interleaved in the same sweep as a third system
    /// (`ferry+replay`); with `--rank-per-core`, the ranks with replay as a fourth column.
    #[arg(long)]
    replay: bool,
}

/// A sweep during which other processes or the hypervisor took more than this fraction of the
/// cores' time is reported as shared (a build or a helper beside it moves METG by 2× and more).
const SHARED: f64 = 0.05;

fn shared(l: &crate::cpuload::Load) -> bool {
    l.other + l.steal > SHARED
}

/// What one sweep found: its JSON record, and METG per system (µs).
struct Sweep {
    record: serde_json::Value,
    ferry: Option<f64>,
    ferry_replay: Option<f64>,
    mpi: Option<f64>,
    /// Whether others used the machine during the sweep ([`SHARED`]).
    shared: bool,
}

/// What one run printed.
#[derive(Clone, Copy, Debug)]
struct Sample {
    elapsed: f64,
    flops: f64,
    /// `B/s` × elapsed: the bytes the kernels count (memory_bound).
    bytes: f64,
    tasks: f64,
}

fn field(out: &str, key: &str) -> Option<f64> {
    out.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l[key.len()..].split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn run_once(exe: &std::path::Path, np: u32, workers: u64, args: &[String]) -> Result<Sample> {
    run_once_with(exe, np, workers, args, &[])
}

/// [`run_once`] with `env` set for every rank besides `FERRY_WORKERS`.
fn run_once_with(
    exe: &std::path::Path,
    np: u32,
    workers: u64,
    args: &[String],
    env: &[(&str, &str)],
) -> Result<Sample> {
    let bin = exe.display();
    let w = workers.to_string();
    let mut cmd = util::mpirun(np);
    cmd.args(["-x", "FERRY_WORKERS"]);
    for (k, _) in env {
        cmd.args(["-x", k]);
    }
    let out = cmd
        .arg(exe)
        .args(args)
        .envs(util::OMPI_ENV)
        .envs(env.iter().copied())
        .env("FERRY_WORKERS", &w)
        .output()
        .with_context(|| format!("running {bin}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{bin} {} failed:\n{stdout}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    match (
        field(&stdout, "Elapsed Time"),
        field(&stdout, "Total FLOPs"),
        field(&stdout, "Total Tasks"),
    ) {
        (Some(elapsed), Some(flops), Some(tasks)) => Ok(Sample {
            elapsed,
            flops,
            bytes: field(&stdout, "B/s").unwrap_or(0.0) * elapsed,
            tasks,
        }),
        _ => bail!("{bin}: no Task Bench summary in:\n{stdout}"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// METG at `threshold` from `(time per task, efficiency)` rows sorted from the largest task to
/// the smallest (Task Bench's `chart_metg.py`: the smallest time still at the threshold,
/// interpolated linearly towards the next, smaller size that falls below it). `None` when no
/// size reaches the threshold.
pub fn metg(rows: &[(f64, f64)], threshold: f64) -> Option<f64> {
    let best = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.1 >= threshold)
        .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0))?
        .0;
    let (t0, e0) = rows[best];
    match rows.get(best + 1) {
        Some(&(t1, e1)) if t1 < t0 && e1 < threshold && e0 > e1 => Some(t1 + (t0 - t1) * (threshold - e1) / (e0 - e1)),
        _ => Some(t0),
    }
}

/// The two systems a sweep compares: ferry's `taskbench`, and the MPI baseline (Task Bench's
/// own `mpi/nonblock` with `--reference`, else the port), with the baseline's label.
struct Systems {
    ferry: std::path::PathBuf,
    mpi: std::path::PathBuf,
    mpi_label: String,
}

impl Systems {
    fn new(reference: Option<&std::path::Path>) -> Result<Systems> {
        let release = util::root().join("target/release");
        let (mpi, mpi_label) = match reference {
            Some(r) => {
                let bin = if r.is_dir() {
                    r.join("mpi/nonblock")
                } else {
                    r.to_path_buf()
                };
                if !bin.is_file() {
                    bail!(
                        "--reference {}: no {} (build Task Bench's MPI version there: make -C DIR/core && make -C DIR/mpi nonblock)",
                        r.display(),
                        bin.display()
                    );
                }
                let label = format!("Task Bench mpi/nonblock ({})", bin.display());
                (bin, label)
            }
            None => (
                release.join("taskbench-mpi"),
                "taskbench-mpi, the port of Task Bench's mpi/nonblock (no --reference given)".to_string(),
            ),
        };
        Ok(Systems {
            ferry: release.join("taskbench"),
            mpi,
            mpi_label,
        })
    }

    fn exe(&self, sys: &str) -> &std::path::Path {
        if sys.starts_with("taskbench") && sys != MPI {
            &self.ferry
        } else {
            &self.mpi
        }
    }
}

/// The sweep's systems: ferry, the MPI baseline, ferry with replay.
const FERRY: &str = "taskbench";
const MPI: &str = "taskbench-mpi";
const REPLAY: &str = "taskbench-replay";

/// The command line of `sys` for a run: `base`, and `-replay` for [`REPLAY`].
fn system_args(sys: &str, base: Vec<String>) -> Vec<String> {
    let mut a = base;
    if sys == REPLAY {
        a.push("-replay".into());
    }
    a
}

/// Each Task Bench kernel at 2^14 iterations (memory_bound: 2^6 samples of 16 KiB) on one
/// core, in the port (through `taskbench-mpi` and ferry's `taskbench`, one rank, one worker)
/// and, with `--reference`, in Task Bench's own build: FLOP/s (B/s for memory_bound, tasks/s
/// for busy_wait), medians of `reps`, interleaved. The port's kernels must do the reference's
/// work at its speed; this table is where that is checked.
fn kernels(args: &MetgArgs, systems: &Systems) -> Result<serde_json::Value> {
    let cases: [(&str, &[&str], &str); 4] = [
        ("compute_bound", &["-steps", "500", "-iter", "16384"], "FLOP/s"),
        ("compute_bound2", &["-steps", "500", "-iter", "16384"], "FLOP/s"),
        ("busy_wait", &["-steps", "500", "-iter", "16384"], "tasks/s"),
        (
            "memory_bound",
            &["-steps", "500", "-iter", "64", "-scratch", "262144", "-sample", "16"],
            "B/s",
        ),
    ];
    let port = util::root().join("target/release/taskbench-mpi");
    let mut runs: Vec<(&str, &std::path::Path)> = vec![("port", port.as_path()), ("ferry", systems.ferry.as_path())];
    if args.reference.is_some() {
        runs.push(("reference", systems.mpi.as_path()));
    }
    println!("Kernels on one core (medians of {}):", args.reps);
    println!(
        "{:<15} {:>8} {:>12} {:>12} {:>12} {:>10}",
        "kernel", "unit", "port", "ferry", "reference", "port/ref"
    );
    let mut rec = serde_json::Map::new();
    for (kernel, extra, unit) in cases {
        let mut a: Vec<String> = ["-width", "1", "-type", "trivial", "-kernel", kernel]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        let mut per: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        for _ in 0..args.reps {
            for (name, exe) in &runs {
                let s = run_once(exe, 1, 1, &a)?;
                let figure = match unit {
                    "FLOP/s" => s.flops / s.elapsed,
                    "B/s" => s.bytes / s.elapsed,
                    _ => s.tasks / s.elapsed,
                };
                per.entry(name).or_default().push(figure);
            }
        }
        let m: BTreeMap<&str, f64> = per.into_iter().map(|(k, v)| (k, median(v))).collect();
        let show = |k: &str| m.get(k).map_or("-".to_string(), |v| format!("{v:.3e}"));
        let ratio = m.get("reference").map(|r| m["port"] / r);
        println!(
            "{kernel:<15} {unit:>8} {:>12} {:>12} {:>12} {:>10}",
            show("port"),
            show("ferry"),
            show("reference"),
            ratio.map_or("-".to_string(), |r| format!("{r:.3}"))
        );
        rec.insert(
            kernel.to_string(),
            json!({"unit": unit, "medians": m, "port_over_reference": ratio}),
        );
    }
    if args.reference.is_none() {
        println!("(no --reference: the port's kernels are not compared with Task Bench's here)");
    }
    Ok(serde_json::Value::Object(rec))
}

/// Task Bench's command line for one run of the sweep: `args`' steps and pattern, `width`
/// points, `iter` iterations of `kernel`.
fn taskbench_args(args: &MetgArgs, width: u64, kernel: &str, iter: u64) -> Vec<String> {
    let (steps, width, iter) = (args.steps.to_string(), width.to_string(), iter.to_string());
    [
        "-steps",
        &steps,
        "-width",
        &width,
        "-type",
        &args.pattern,
        "-kernel",
        kernel,
        "-iter",
        &iter,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// `--rank-per-core`: `cores` ranks × 1 worker against 1 rank × `cores` workers, per size; the
/// ranks run twice, interleaved, with MPI progress as `auto` chooses (idle workers drive it on a
/// rank per core) and with the progress thread alone (`FERRY_MPI_PROGRESS=thread`). With
/// `--replay`, both sides also run with `-replay`, and the replayed ranks are compared with the
/// replayed workers (the same program on both sides) as well as with the plain ones.
fn rank_per_core(args: &MetgArgs, systems: &Systems) -> Result<()> {
    let cores = args.cores.unwrap_or(args.np as u64);
    let width = args.width.unwrap_or(cores);
    let mut rows = Vec::new();
    println!(
        "Rank per core: {cores} ranks × 1 worker against 1 rank × {cores} workers, {} × {width} {} tasks, medians of {}",
        args.steps, args.pattern, args.reps
    );
    println!(
        "{:>5} {:>14} {:>14} {:>14} {:>8} {:>8}{}",
        "log2",
        "ranks s",
        "thread s",
        "workers s",
        "ratio",
        "thread",
        if args.replay {
            format!(" {:>14} {:>8} {:>14} {:>8}", "replay s", "replay", "w. replay s", "r/r")
        } else {
            String::new()
        }
    );
    for k in (args.min_log2..=args.max_log2).rev() {
        let a = taskbench_args(args, width, "compute_bound", 1u64 << k);
        let (mut ranks, mut thread, mut workers, mut replay) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut workers_replay = Vec::new();
        for _ in 0..args.reps {
            ranks.push(run_once(&systems.ferry, cores as u32, 1, &a)?.elapsed);
            if args.replay {
                let r = system_args(REPLAY, a.clone());
                replay.push(run_once(&systems.ferry, cores as u32, 1, &r)?.elapsed);
                workers_replay.push(run_once(&systems.ferry, 1, cores, &r)?.elapsed);
            }
            thread
                .push(run_once_with(&systems.ferry, cores as u32, 1, &a, &[("FERRY_MPI_PROGRESS", "thread")])?.elapsed);
            workers.push(run_once(&systems.ferry, 1, cores, &a)?.elapsed);
        }
        let (r, t, w) = (median(ranks), median(thread), median(workers));
        let p = (!replay.is_empty()).then(|| median(replay));
        let wp = (!workers_replay.is_empty()).then(|| median(workers_replay));
        println!(
            "{k:>5} {r:>14.4e} {t:>14.4e} {w:>14.4e} {:>8.2} {:>8.2}{}",
            r / w,
            t / w,
            p.zip(wp).map_or(String::new(), |(p, wp)| format!(
                " {p:>14.4e} {:>8.2} {wp:>14.4e} {:>8.2}",
                p / w,
                p / wp
            ))
        );
        rows.push(json!({"log2_iter": k, "ranks_s": r, "ranks_thread_progress_s": t, "workers_s": w, "ratio": r / w, "ratio_thread_progress": t / w, "ranks_replay_s": p, "ratio_replay": p.map(|p| p / w), "workers_replay_s": wp, "ratio_replay_to_workers_replay": p.zip(wp).map(|(p, wp)| p / wp)}));
    }
    let path = util::target_dir("metg")?.join("rank-per-core.json");
    let rec = json!({"cores": cores, "steps": args.steps, "width": width, "pattern": args.pattern, "reps": args.reps, "rows": rows});
    std::fs::write(&path, serde_json::to_vec_pretty(&rec)?).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("metg: record in {}", path.display());
    Ok(())
}

pub fn run(args: MetgArgs) -> Result<()> {
    if !args.no_build {
        util::run(util::cargo().args(["build", "--release", "-p", "ferry-examples", "--bins"]))?;
    }
    let systems = Systems::new(args.reference.as_deref())?;
    if args.rank_per_core {
        return rank_per_core(&args, &systems);
    }
    let kernel_record = kernels(&args, &systems)?;
    if args.sweeps == 0 {
        bail!("--sweeps must be at least 1");
    }
    let dir = util::target_dir("metg")?;
    let mut sweeps = Vec::with_capacity(args.sweeps);
    for n in 1..=args.sweeps {
        if args.sweeps > 1 {
            eprintln!("metg: sweep {n} of {}", args.sweeps);
        }
        sweeps.push(sweep(&args, &systems, &dir)?);
    }
    let ratios: Vec<Option<f64>> = sweeps.iter().map(|s| s.ferry.zip(s.mpi).map(|(a, b)| a / b)).collect();
    let replay_ratios: Vec<Option<f64>> = sweeps
        .iter()
        .map(|s| s.ferry_replay.zip(s.mpi).map(|(a, b)| a / b))
        .collect();
    if args.sweeps > 1 {
        let shown: Vec<String> = ratios
            .iter()
            .map(|r| r.map_or("-".into(), |r| format!("{r:.2}×")))
            .collect();
        let known: Vec<f64> = ratios.iter().flatten().copied().collect();
        let shared_sweeps: Vec<String> = sweeps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.shared)
            .map(|(k, _)| (k + 1).to_string())
            .collect();
        println!(
            "METG(50%) ratio per sweep: {}; median {}; at most 3× in {} of {}{}",
            shown.join(", "),
            if known.is_empty() {
                "-".to_string()
            } else {
                format!("{:.2}×", median(known.clone()))
            },
            known.iter().filter(|&&r| r <= 3.0).count(),
            args.sweeps,
            if shared_sweeps.is_empty() {
                String::new()
            } else {
                format!(" (shared machine in sweep {})", shared_sweeps.join(", "))
            }
        );
        if args.replay {
            let shown: Vec<String> = replay_ratios
                .iter()
                .map(|r| r.map_or("-".into(), |r| format!("{r:.2}×")))
                .collect();
            let known: Vec<f64> = replay_ratios.iter().flatten().copied().collect();
            println!(
                "METG(50%) ratio per sweep with replay: {}; median {}",
                shown.join(", "),
                if known.is_empty() {
                    "-".to_string()
                } else {
                    format!("{:.2}×", median(known))
                }
            );
        }
    }
    let mut rec = if args.sweeps == 1 {
        sweeps.pop().map(|s| s.record).unwrap_or_default()
    } else {
        json!({
            "sweeps": sweeps.into_iter().map(|s| s.record).collect::<Vec<_>>(),
            "ratios": ratios,
            "replay_ratios": args.replay.then_some(replay_ratios),
        })
    };
    rec["kernels"] = kernel_record;
    rec["baseline"] = json!(systems.mpi_label);
    let path = dir.join("metg.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&rec)?).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("metg: record in {}", path.display());
    Ok(())
}

/// One sweep: the floor, then every size from the largest task down, both systems
/// interleaved; prints its table and writes its plot (`metg.png`, the latest sweep's).
fn sweep(args: &MetgArgs, bins: &Systems, dir: &std::path::Path) -> Result<Sweep> {
    let cores = args.cores.unwrap_or(args.np as u64);
    let width = args.width.unwrap_or(cores);
    let systems: Vec<&str> = if args.replay {
        vec![FERRY, MPI, REPLAY]
    } else {
        vec![FERRY, MPI]
    };
    let systems = systems.as_slice();
    let ranks = |sys: &str| if sys == MPI { args.np } else { args.ferry_np };
    let workers = (cores / args.ferry_np.max(1) as u64).max(1);
    let start = crate::cpuload::stamp();
    let base = |sys: &str, kernel: &str, iter: u64| system_args(sys, taskbench_args(args, width, kernel, iter));
    // Floor: the empty kernel.
    let mut floor: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for _ in 0..args.reps {
        for &sys in systems {
            let s = run_once(bins.exe(sys), ranks(sys), workers, &base(sys, "empty", 0))?;
            floor
                .entry(sys)
                .or_default()
                .push(s.elapsed * cores as f64 / s.tasks * 1e6);
        }
    }
    // The sweep, interleaved: per size, per repetition, both systems.
    let mut samples: BTreeMap<(u32, &str), Vec<Sample>> = BTreeMap::new();
    for k in (args.min_log2..=args.max_log2).rev() {
        let iter = 1u64 << k;
        eprintln!("metg: 2^{k} iterations");
        for _ in 0..args.reps {
            for &sys in systems {
                samples.entry((k, sys)).or_default().push(run_once(
                    bins.exe(sys),
                    ranks(sys),
                    workers,
                    &base(sys, "compute_bound", iter),
                )?);
            }
        }
    }
    let med = |k: u32, sys: &str| -> (f64, f64, f64) {
        let v = &samples[&(k, sys)];
        (median(v.iter().map(|s| s.elapsed).collect()), v[0].flops, v[0].tasks)
    };
    let peak = samples
        .keys()
        .map(|&(k, sys)| {
            let (e, f, _) = med(k, sys);
            f / e
        })
        .fold(0.0, f64::max);
    println!(
        "METG sweep: ferry {} rank(s) × {workers} workers, MPI {} ranks, {cores} cores, {} × {} {} tasks, {} repetitions (medians); shared peak {:.3e} FLOP/s\nMPI baseline: {}",
        args.ferry_np, args.np, args.steps, width, args.pattern, args.reps, peak, bins.mpi_label
    );
    let mut header = format!(
        "{:>5} {:>12} {:>12} {:>8} {:>12} {:>12} {:>8}",
        "log2", "ferry µs/t", "ferry s", "eff", "mpi µs/t", "mpi s", "eff"
    );
    if args.replay {
        header += &format!(" {:>12} {:>12} {:>8}", "replay µs/t", "replay s", "eff");
    }
    println!("{header}");
    let mut table = Vec::new();
    let mut rows: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for k in (args.min_log2..=args.max_log2).rev() {
        let mut line = format!("{k:>5}");
        let mut rec = json!({"log2_iter": k});
        for &sys in systems {
            let (e, f, tasks) = med(k, sys);
            let tpt = e * cores as f64 / tasks * 1e6;
            let eff = f / e / peak;
            rows.entry(sys).or_default().push((tpt, eff));
            line += &format!(" {tpt:>12.2} {e:>12.4e} {eff:>8.3}");
            rec[sys] = json!({"elapsed_s": e, "time_per_task_us": tpt, "efficiency": eff});
        }
        println!("{line}");
        table.push(rec);
    }
    let m: BTreeMap<&str, Option<f64>> = systems.iter().map(|&s| (s, metg(&rows[s], 0.5))).collect();
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}×", a / b),
        _ => "-".into(),
    };
    let f: BTreeMap<&str, f64> = systems.iter().map(|&s| (s, median(floor[s].clone()))).collect();
    let show = |x: Option<f64>| x.map_or("not reached".to_string(), |v| format!("{v:.2} µs"));
    println!(
        "METG(50%): ferry {}, MPI {}; ratio {}",
        show(m["taskbench"]),
        show(m["taskbench-mpi"]),
        match (m["taskbench"], m["taskbench-mpi"]) {
            (Some(a), Some(b)) => format!("{:.2}×", a / b),
            _ => "-".into(),
        }
    );
    println!(
        "floor (empty kernel) per task: ferry {:.2} µs, MPI {:.2} µs",
        f["taskbench"], f["taskbench-mpi"]
    );
    if args.replay {
        println!(
            "with replay: METG(50%) {}, ratio {}; floor {:.2} µs per task, {:.2}× MPI's",
            show(m[REPLAY]),
            ratio(m[REPLAY], m[MPI]),
            f[REPLAY],
            f[REPLAY] / f[MPI]
        );
    }
    let load = start.zip(crate::cpuload::stamp()).and_then(|(a, b)| a.until(&b));
    let was_shared = load.is_some_and(|l| shared(&l));
    if let Some(l) = load {
        println!(
            "machine during the sweep: other processes {:.1}% of the cores, steal {:.1}%{}",
            l.other * 100.0,
            l.steal * 100.0,
            if was_shared {
                " — shared: compare this sweep with care"
            } else {
                ""
            }
        );
    }
    let record = json!({
        "np": args.np, "ferry_np": args.ferry_np, "ferry_workers": workers, "cores": cores, "steps": args.steps, "width": width, "pattern": args.pattern,
        "reps": args.reps, "peak_flops": peak, "rows": table,
        "metg_us": {"ferry": m["taskbench"], "mpi": m["taskbench-mpi"], "ferry_replay": m.get(REPLAY).copied().flatten()},
        "floor_us": {"ferry": f["taskbench"], "mpi": f["taskbench-mpi"], "ferry_replay": f.get(REPLAY).copied()},
        "machine": load.map(|l| json!({"other_cpu": l.other, "steal": l.steal, "shared": was_shared})),
    });
    let png = dir.join("metg.png");
    let mut curves = vec![
        crate::plot::Curve {
            name: "ferry",
            points: &rows["taskbench"],
            metg: m["taskbench"],
        },
        crate::plot::Curve {
            name: if args.reference.is_some() {
                "MPI (Task Bench nonblock)"
            } else {
                "MPI (port of nonblock)"
            },
            points: &rows["taskbench-mpi"],
            metg: m["taskbench-mpi"],
        },
    ];
    if args.replay {
        curves.push(crate::plot::Curve {
            name: "ferry+replay",
            points: &rows[REPLAY],
            metg: m[REPLAY],
        });
    }
    crate::plot::metg_png(
        &png,
        &format!("METG, Task Bench {} ({cores} cores, {} reps)", args.pattern, args.reps),
        &curves,
    )?;
    eprintln!("metg: plot in {}", png.display());
    Ok(Sweep {
        record,
        ferry: m["taskbench"],
        ferry_replay: m.get(REPLAY).copied().flatten(),
        mpi: m["taskbench-mpi"],
        shared: was_shared,
    })
}

#[cfg(test)]
mod tests {
    use super::metg;

    #[test]
    fn metg_interpolates_to_the_threshold() {
        // Largest task first: efficiency falls as tasks shrink.
        let rows = [(100.0, 0.95), (10.0, 0.8), (1.0, 0.3)];
        // Between (1, 0.3) and (10, 0.8): 0.5 lies 0.2/0.5 of the way from 1 to 10.
        assert!((metg(&rows, 0.5).unwrap() - 4.6).abs() < 1e-9);
        assert_eq!(metg(&[(10.0, 0.6)], 0.5), Some(10.0));
        assert_eq!(metg(&[(10.0, 0.4)], 0.5), None);
    }
}
