//! Task Bench on ferry: the graphs of Task Bench's command line inserted as a sequential task
//! flow. Point `p` of a graph owns an output tile, double-buffered by timestep parity (task
//! `(t, p)` reads its inputs' tiles of `t − 1` and writes its own of `t`), and a scratch tile;
//! tiles are spread over the ranks in blocks, and ferry infers every transfer. Each task checks
//! that its inputs hold the `(t − 1, dependency)` pairs their producers wrote, so a wrong
//! dependency or transfer fails the run. The run is done twice and the second reported, as the
//! MPI baseline does.
//!
//! Extra flags: `-json PATH` writes the summary and the transfer counts as JSON (rank 0); `-gpu`
//! gives the task class a GPU body, so that with `FERRY_DEVICES` every task walks the GPU
//! lifecycle: on emulated devices the CPU body (with its validation) is the kernel, on CUDA the
//! body launches nothing — the rate of empty GPU tasks (`GPU tasks/s` is printed); `-gpu-kernel`
//! does the same with one launch of an empty kernel per task on CUDA.

use anyhow::{bail, Context};

// Task insertion and execution allocate on different threads; glibc's arenas then contend on
// every cross-thread free (perf: a fifth of the inserting thread's time in malloc, free and their
// futexes). mimalloc's per-thread heaps free remotely without a lock.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
use ferry::{Collection, Distribution, ProcessGrid, Runtime, Task, TaskClass};
use ferry_examples::taskbench::{c_exp, execute_point, prepare_scratch, App, GraphConfig};
use ferry_examples::{main_with_runtime, write_json};
use serde::Serialize;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

#[derive(Serialize)]
struct Record {
    example: &'static str,
    ranks: usize,
    workers: usize,
    tasks: i64,
    flops: i128,
    elapsed_s: f64,
    /// Of `elapsed_s`, the time rank 0's main thread spent inserting the tasks (the tasks run
    /// meanwhile; on a fine-grained graph this bounds the rate).
    insertion_s: f64,
    /// Tile transfers between ranks in the timed repetition, and what the graphs imply.
    messages: u64,
    expected_messages: u64,
    bytes: u64,
    expected_bytes: u64,
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let app = match App::parse(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let mut json = None;
    let mut gpu = false;
    let mut gpu_kernel = false;
    let mut replay = None;
    let mut k = 0;
    while k < app.extra.len() {
        match app.extra[k].as_str() {
            "-json" if k + 1 < app.extra.len() => {
                json = Some(std::path::PathBuf::from(&app.extra[k + 1]));
                k += 2;
            }
            "-json" => {
                eprintln!("error: Flag \"-json\" requires a path");
                return std::process::ExitCode::from(2);
            }
            "-gpu" => {
                gpu = true;
                k += 1;
            }
            "-gpu-kernel" => {
                gpu = true;
                gpu_kernel = true;
                k += 1;
            }
            "-replay" => {
                replay = Some(replay.unwrap_or(DEFAULT_REPLAY_STEPS));
                k += 1;
            }
            "-replay-steps" => match app.extra.get(k + 1).and_then(|v| v.parse::<i64>().ok()) {
                Some(n) if n > 0 => {
                    replay = Some(n);
                    k += 2;
                }
                _ => {
                    eprintln!("error: Flag \"-replay-steps\" requires a positive number of steps");
                    return std::process::ExitCode::from(2);
                }
            },
            other => {
                eprintln!(
                    "error: unknown flag \"{other}\" (Task Bench's flags, -json PATH, -gpu, -gpu-kernel, -replay and -replay-steps N)"
                );
                return std::process::ExitCode::from(2);
            }
        }
    }
    // Task Bench's tasks are CPU tasks: no devices unless FERRY_DEVICES says so (the runtime
    // reads it, and refuses a value it cannot parse) or `-gpu` asks for the GPU lifecycle (then
    // a GPU when there is one).
    let devices = match std::env::var_os("FERRY_DEVICES") {
        Some(_) => None,
        None if gpu => Some(ferry::DeviceSpec::Auto),
        None => Some(ferry::DeviceSpec::None),
    };
    main_with_runtime("taskbench", devices, None, |rt| {
        run(rt, &app, json.as_deref(), gpu.then_some(gpu_kernel), replay)
    })
}

/// Steps per trace with `-replay` alone.
const DEFAULT_REPLAY_STEPS: i64 = 16;

/// The tiles of one graph.
struct Tiles {
    out: [Collection<u8>; 2],
    scratch: Option<Collection<u8>>,
}

/// `replay`: insert the steps in traces of this many steps (`Runtime::trace`), each named by
/// the dependence structure of its steps, so blocks of the same structure replay one recording.
/// `gpu`: run the tasks on a device, launching an empty kernel each (`Some(true)`) or nothing
/// (`Some(false)`).
fn run(
    rt: &Runtime,
    app: &App,
    json: Option<&std::path::Path>,
    gpu: Option<bool>,
    replay: Option<i64>,
) -> anyhow::Result<()> {
    let (gpu, gpu_kernel) = (gpu.is_some(), gpu == Some(true));
    if gpu && rt.devices().is_empty() {
        bail!("-gpu: no device to run the tasks on (no GPU found, or FERRY_DEVICES=none); set FERRY_DEVICES=cuda or emu:K");
    }
    let size = rt.size();
    let grid = ProcessGrid::new(1, size)?;
    let dist = Distribution::Block2d(grid);
    let mut tiles = Vec::new();
    let mut classes = Vec::new();
    for (gi, g) in app.graphs.iter().enumerate() {
        let w = g.shape.width as usize;
        let ob = g.output_bytes as usize;
        let row = |bytes: usize, flag: &str| {
            w.checked_mul(bytes)
                .ok_or_else(|| anyhow::anyhow!("-width {w} × {flag} {bytes} bytes does not fit in memory"))
        };
        let out = [
            rt.tile_grid::<u8>(&format!("g{gi}.out0"), 1, row(ob, "-output")?, 1, ob, dist)?,
            rt.tile_grid::<u8>(&format!("g{gi}.out1"), 1, row(ob, "-output")?, 1, ob, dist)?,
        ];
        let scratch = if g.scratch_bytes > 0 {
            let sb = g.scratch_bytes as usize;
            Some(rt.tile_grid::<u8>(&format!("g{gi}.scratch"), 1, row(sb, "-scratch")?, 1, sb, dist)?)
        } else {
            None
        };
        tiles.push(Tiles { out, scratch });
        let cfg = Arc::new(g.clone());
        let has_scratch = g.scratch_bytes > 0;
        // args: [t, p]; accesses: output (write), scratch (rw) if any, then the inputs in order.
        let point = TaskClass::new(&format!("point{gi}"), move |ctx| {
            let (t, p) = (ctx.args()[0], ctx.args()[1]);
            let first_input = if has_scratch { 2 } else { 1 };
            let inputs: smallvec::SmallVec<[&[u8]; 8]> = (first_input..ctx.num_tiles())
                .map(|k| ctx.tile::<u8>(k))
                .collect::<Result<_, _>>()?;
            let out = ctx.tile_mut::<u8>(0)?;
            let mut none: [u8; 0] = [];
            let scratch = if has_scratch {
                ctx.tile_mut::<u8>(1)?
            } else {
                &mut none[..]
            };
            execute_point(&cfg, t, p, &inputs, out, scratch).map_err(|e| e.into())
        });
        // The GPU body of `-gpu`: an empty task (the rate of the GPU lifecycle itself); of
        // `-gpu-kernel`: one launch of a kernel that does nothing.
        let point = match (gpu, gpu_kernel) {
            (true, false) => point.with_cuda(|_ctx| Ok(())),
            (true, true) => point.with_cuda(|ctx| {
                ferry_examples::gpu_kernels(ctx)?.empty().map_err(|e| e.to_string())?;
                Ok(())
            }),
            (false, _) => point,
        };
        classes.push(point);
    }
    let init = TaskClass::new("scratch.init", |ctx| {
        prepare_scratch(ctx.tile_mut::<u8>(0)?);
        Ok(())
    });
    for (g, tl) in app.graphs.iter().zip(&tiles) {
        if let Some(sc) = &tl.scratch {
            for p in 0..g.shape.width as usize {
                rt.insert(&init, &[sc.write(0, p)])?;
            }
        }
    }
    if rt.rank() == 0 {
        print!("{}", app.display());
    }
    let max_steps = app.graphs.iter().map(|g| g.shape.steps).max().unwrap_or(0);
    let mut elapsed = 0.0;
    let mut insertion = 0.0;
    let mut before = rt.stats();
    // With -replay: the blocks of steps and their traces' ids, worked out before the timing (an
    // application knows the structure of its steps; the ids cost a pass over every dependency).
    let blocks: Vec<(std::ops::Range<i64>, u64)> = match replay {
        None => Vec::new(),
        Some(block) => (0..max_steps)
            .step_by(block as usize)
            .map(|first| {
                let steps = first..(first + block).min(max_steps);
                (steps.clone(), structure_id(app, steps))
            })
            .collect(),
    };
    for _rep in 0..2 {
        rt.wait()?;
        before = rt.stats();
        let t0 = Instant::now();
        // Graphs advance together, timestep by timestep, so independent graphs overlap.
        let insert_steps = |rt: &Runtime, steps: std::ops::Range<i64>| -> ferry::Result<()> {
            for t in steps {
                for ((g, tl), class) in app.graphs.iter().zip(&tiles).zip(&classes) {
                    insert_step(rt, g, tl, class, t)?;
                }
            }
            Ok(())
        };
        if replay.is_none() {
            insert_steps(rt, 0..max_steps)?;
        }
        for (steps, id) in &blocks {
            rt.trace(*id, |rt| insert_steps(rt, steps.clone()))?;
        }
        insertion = t0.elapsed().as_secs_f64();
        rt.wait()?;
        elapsed = t0.elapsed().as_secs_f64();
    }
    let after = rt.stats();
    let net = |s: &ferry::StatsSnapshot| -> (u64, u64) {
        ferry::TrafficPath::NETWORK
            .iter()
            .map(|&p| (s.path(p).sends, s.path(p).bytes_sent))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    let (m1, b1) = net(&after);
    let (m0, b0) = net(&before);
    let sent = [m1 - m0, b1 - b0];
    let all: Vec<u64> = sent
        .iter()
        .map(|&v| rt.allgather_u64(v).map(|x| x.into_iter().sum()))
        .collect::<Result<_, _>>()?;
    let (exp_m, exp_b) = expected_transfers(app, size);
    if rt.rank() == 0 {
        print!("{}", app.report(elapsed));
        println!(
            "Insertion Time {} seconds (rank 0 inserting; the tasks run meanwhile; its submission window was full {} times, {} seconds)",
            c_exp(insertion),
            after.window_stalls - before.window_stalls,
            c_exp(after.window_stall_s - before.window_stall_s)
        );
        println!(
            "Transfers {} messages {} bytes (the graphs imply {exp_m} / {exp_b})",
            all[0], all[1]
        );
        if replay.is_some() {
            println!(
                "Replay {} tasks replayed, {} traces recorded, {} fused launches of {} tasks (rank 0, the timed repetition)",
                after.replayed_tasks - before.replayed_tasks,
                after.trace_records - before.trace_records,
                after.fused_replays - before.fused_replays,
                after.fused_tasks - before.fused_tasks
            );
        }
        if gpu && !rt.devices().is_empty() {
            let rate = app.tasks() as f64 / elapsed;
            println!("GPU tasks/s {rate:.0} ({} devices on rank 0)", rt.devices().len());
        }
        if let Some(path) = json {
            write_json(
                path,
                &Record {
                    example: "taskbench",
                    ranks: size,
                    workers: rt.workers(),
                    tasks: app.tasks(),
                    flops: app.flops(),
                    elapsed_s: elapsed,
                    insertion_s: insertion,
                    messages: all[0],
                    expected_messages: exp_m,
                    bytes: all[1],
                    expected_bytes: exp_b,
                },
            )
            .context("writing the JSON record")?;
        }
    }
    if (all[0], all[1]) != (exp_m, exp_b) {
        bail!(
            "moved {} messages / {} bytes, the graphs imply {exp_m} / {exp_b}",
            all[0],
            all[1]
        );
    }
    Ok(())
}

/// A name for the dependence structure of `steps` of every graph: steps of the same buffer
/// parity, offset, width and inputs insert the same tasks but for their arguments.
fn structure_id(app: &App, steps: std::ops::Range<i64>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for t in steps {
        for g in &app.graphs {
            let s = &g.shape;
            if t >= s.steps {
                continue;
            }
            (t % 2, s.offset(t), s.width_at(t)).hash(&mut h);
            for p in s.offset(t)..s.offset(t) + s.width_at(t) {
                s.inputs(t, p).hash(&mut h);
            }
        }
    }
    h.finish()
}

fn insert_step(rt: &Runtime, g: &GraphConfig, tl: &Tiles, class: &TaskClass, t: i64) -> ferry::Result<()> {
    let s = &g.shape;
    if t >= s.steps {
        return Ok(());
    }
    let (cur, prev) = (&tl.out[(t % 2) as usize], &tl.out[((t + 1) % 2) as usize]);
    for p in s.offset(t)..s.offset(t) + s.width_at(t) {
        let mut acc: smallvec::SmallVec<[ferry::Access; 8]> = smallvec::smallvec![cur.write(0, p as usize)];
        if let Some(sc) = &tl.scratch {
            acc.push(sc.rw(0, p as usize));
        }
        acc.extend(s.inputs(t, p).into_iter().map(|d| prev.read(0, d as usize)));
        rt.submit(Task::new(class, &acc).args(&[t, p]))?;
    }
    Ok(())
}

/// One message per (tile version, consuming rank ≠ owner) in one repetition: what ferry's
/// directory should send (a version reaches each rank once, however many of its tasks read it).
fn expected_transfers(app: &App, size: usize) -> (u64, u64) {
    let (mut m, mut b) = (0u64, 0u64);
    for g in &app.graphs {
        let s = &g.shape;
        let w = s.width as usize;
        let owner = |p: i64| p as usize * size / w;
        let mut seen = HashSet::new();
        for t in 1..s.steps {
            for p in s.offset(t)..s.offset(t) + s.width_at(t) {
                for d in s.inputs(t, p) {
                    if owner(d) != owner(p) && seen.insert((t - 1, d, owner(p))) {
                        m += 1;
                        b += g.output_bytes as u64;
                    }
                }
            }
        }
    }
    (m, b)
}
