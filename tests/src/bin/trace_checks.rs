//! Traces (`Runtime::trace`) checked on 1–4 ranks: a 1D stencil whose steps are traced (two
//! ids, one per buffer parity) gives the untraced run's tiles bit for bit, its later steps
//! replayed (with one emulated device per rank: on one rank, fused into one launch per replay;
//! with classes rebuilt for every step, task by task); a sequence whose tiles changed holders
//! since its recording is recorded again; what
//! cannot be part of a trace (a `wait`, a new collection, a route change, a nested trace) is
//! refused while one is open, without harm to the run; and, last, a replay given fewer tasks
//! than its recording fails the run with `TraceMismatch`.
//!
//! With `--fail-in-fused` (one rank), instead: a body that fails inside a fused replay fails the
//! run with an error that names the failing task (its class and sequence number on a CPU rank,
//! whose fused replays run each task as itself; its class and place in the launch on a device).
//!
//! Prints `trace checks ok` on success; exits 1 with a message otherwise.

use anyhow::{bail, ensure, Context};
use ferry::{
    Collection, Distribution, FerryError, ProcessGrid, Runtime, Task, TaskClass, TaskContext, TaskError, TraceMode,
};

/// Tiles of the stencil's row (two per rank, so every step sends halos both ways).
const TILES_PER_RANK: usize = 2;
/// Elements per tile.
const TILE: usize = 16;

fn main() -> std::process::ExitCode {
    let rt = match Runtime::builder().from_env().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("trace_checks: error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let fail_in_fused = std::env::args().any(|a| a == "--fail-in-fused");
    match if fail_in_fused {
        fail_in_fused_replay(&rt)
    } else {
        run(&rt)
    } {
        Ok(()) => {
            if rt.rank() == 0 {
                println!("trace checks ok");
            }
            // The last check failed the run on purpose: no abort at shutdown for that.
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            let line = format!("trace_checks: error on rank {}: {e:#}\n", rt.rank());
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            drop(rt);
            std::process::ExitCode::FAILURE
        }
    }
}

/// A three-point stencil on a row of tiles: `next[p] = f(cur[p-1], cur[p], cur[p+1])`.
fn step_class() -> TaskClass {
    TaskClass::new("step", step_body)
}

fn step_body(ctx: &TaskContext<'_>) -> Result<(), TaskError> {
    let t = ctx.args()[0] as u64;
    let n = ctx.num_tiles();
    let mut acc = vec![0u64; TILE];
    for k in 1..n {
        for (a, x) in acc.iter_mut().zip(ctx.tile::<u64>(k)?) {
            *a = a.rotate_left(5) ^ x.wrapping_mul(0x9e37_79b9_7f4a_7c15 ^ t);
        }
    }
    ctx.tile_mut::<u64>(0)?.copy_from_slice(&acc);
    Ok(())
}

fn insert_step(rt: &Runtime, class: &TaskClass, buf: &[Collection<u64>; 2], t: usize) -> ferry::Result<()> {
    let (cur, next) = (&buf[t % 2], &buf[(t + 1) % 2]);
    let n = cur.tile_rows();
    for p in 0..n {
        let mut acc = vec![next.write(p, 0)];
        for q in p.saturating_sub(1)..(p + 2).min(n) {
            acc.push(cur.read(q, 0));
        }
        rt.submit(Task::new(class, &acc).args(&[t as i64]))?;
    }
    Ok(())
}

/// The step class with a GPU body: on emulated devices its CPU body stands in for the kernel.
fn gpu_step_class() -> TaskClass {
    step_class().with_cuda(|_| Err("trace_checks runs on emulated devices only".into()))
}

/// Runs `steps` steps, traced or not; returns every tile of the final buffer (on rank 0).
fn stencil(rt: &Runtime, steps: usize, traced: bool, name: &str) -> anyhow::Result<Option<Vec<Vec<u64>>>> {
    stencil_of(rt, steps, traced, name, &step_class, false, 0)
}

/// [`stencil`] with the step class `make` gives: made once, or anew for every step (`rebuild`);
/// its traces are `ids` and `ids + 1` (one per buffer parity).
fn stencil_of(
    rt: &Runtime,
    steps: usize,
    traced: bool,
    name: &str,
    make: &dyn Fn() -> TaskClass,
    rebuild: bool,
    ids: u64,
) -> anyhow::Result<Option<Vec<Vec<u64>>>> {
    let n = TILES_PER_RANK * rt.size();
    let dist = Distribution::Block2d(ProcessGrid::new(rt.size(), 1)?);
    let buf = [
        rt.tile_grid::<u64>(&format!("{name}.a"), n * TILE, 1, TILE, 1, dist)?,
        rt.tile_grid::<u64>(&format!("{name}.b"), n * TILE, 1, TILE, 1, dist)?,
    ];
    let init = TaskClass::new("init", |ctx| {
        let p = ctx.args()[0] as u64;
        for (e, x) in ctx.tile_mut::<u64>(0)?.iter_mut().enumerate() {
            *x = p * 1000 + e as u64;
        }
        Ok(())
    });
    for p in 0..n {
        rt.submit(Task::new(&init, &[buf[0].write(p, 0)]).args(&[p as i64]))?;
    }
    let mut class = make();
    for t in 0..steps {
        if rebuild {
            class = make();
        }
        if traced {
            // One id per parity: the two kinds of step are different sequences.
            rt.trace(ids + (t % 2) as u64, |rt| insert_step(rt, &class, &buf, t))?;
        } else {
            insert_step(rt, &class, &buf, t)?;
        }
    }
    rt.wait()?;
    Ok(rt.gather(&buf[steps % 2], 0)?)
}

/// The step at which [`fail_in_fused_replay`]'s body fails (a replayed, fused step), on tile 1.
const FAILING_STEP: i64 = 7;

/// A traced stencil on one rank whose step fails at [`FAILING_STEP`] on tile 1: `wait` returns
/// the failure, naming the task.
fn fail_in_fused_replay(rt: &Runtime) -> anyhow::Result<()> {
    ensure!(rt.size() == 1, "--fail-in-fused runs on one rank");
    let failing = || {
        let class = TaskClass::new("step", move |ctx| {
            if ctx.args()[0] == FAILING_STEP && ctx.coords(0)?.0 == 1 {
                return Err(format!("planted failure at seq {}", ctx.seq()).into());
            }
            step_body(ctx)
        });
        if rt.devices().is_empty() {
            class
        } else {
            class.with_cuda(|_| Err("trace_checks runs on emulated devices only".into()))
        }
    };
    let before = rt.stats();
    let r = stencil_of(rt, 12, true, "failing", &failing, false, 300);
    let fused = rt.stats().fused_replays - before.fused_replays;
    // Insertion order: 2 init tasks, then 2 tasks a step.
    let seq = 2 + 2 * FAILING_STEP as u64 + 1;
    match r.map_err(|e| e.downcast::<FerryError>()) {
        Err(Ok(FerryError::TaskFailed { class, seq: s, msg, .. })) => {
            let named = if rt.devices().is_empty() {
                class == "step" && s == seq && msg == format!("planted failure at seq {seq}")
            } else {
                msg.contains("`step` (part") && msg.contains(&format!("planted failure at seq {seq}"))
            };
            ensure!(
                named && fused > 0,
                "the failure in a fused replay ({fused} fused) reads: class {class}, seq {s}: {msg}"
            );
            println!("fused failure reported: class {class} seq {s}: {msg}");
            Ok(())
        }
        other => bail!("expected the planted failure, got {other:?}"),
    }
}

fn expect_invalid(r: ferry::Result<impl std::fmt::Debug>, what: &str, needle: &str) -> anyhow::Result<()> {
    match r {
        Err(FerryError::InvalidArgument(m)) if m.contains(needle) => Ok(()),
        other => bail!("{what}: expected an invalid-argument error saying `{needle}`, got {other:?}"),
    }
}

fn run(rt: &Runtime) -> anyhow::Result<()> {
    let steps = 40;
    // 1. Bit for bit against the untraced run, most steps replayed.
    let plain = stencil(rt, steps, false, "plain")?;
    let before = rt.stats();
    let traced = stencil(rt, steps, true, "traced")?;
    let after = rt.stats();
    ensure!(plain == traced, "the traced stencil differs from the untraced one");
    let tasks_per_step = (TILES_PER_RANK * rt.size()) as u64;
    let replayed = after.replayed_tasks - before.replayed_tasks;
    let records = after.trace_records - before.trace_records;
    // Steps 0 and 1 record (one id each); every later step finds the tiles it reads as its
    // recording did (just written by their owners) and replays. Every rank counts every task.
    ensure!(
        records == 2 && replayed == (steps as u64 - 2) * tasks_per_step,
        "{records} recordings and {replayed} replayed tasks for {steps} traced steps of {tasks_per_step} tasks"
    );
    if let Some(tiles) = &traced {
        ensure!(tiles.len() == TILES_PER_RANK * rt.size() && tiles.iter().all(|t| t.len() == TILE));
    }

    // 1b. With one device per rank, or none, a rank runs its part of a replay as one fused task
    // (on a device, one launch, emulated by the bodies in order, when it moves nothing between
    // ranks; on the CPU, a static graph on the workers whose parts include its halo sends and
    // receives), bit for bit; a class rebuilt for every step replays task by task instead.
    if rt.devices().len() <= 1 {
        let before = rt.stats();
        let fused = stencil_of(rt, steps, true, "fused", &gpu_step_class, false, 100)?;
        let after = rt.stats();
        ensure!(plain == fused, "the fused replays differ from the untraced stencil");
        let (launches, tasks) = (
            after.fused_replays - before.fused_replays,
            after.fused_tasks - before.fused_tasks,
        );
        // One rank, or CPU ranks: every replayed step fuses, each rank's own tasks. Device
        // ranks: each step sends halos, nothing fuses.
        let fuses = rt.size() == 1 || rt.devices().is_empty();
        let expect = if fuses { steps as u64 - 2 } else { 0 };
        ensure!(
            launches == expect && tasks == expect * TILES_PER_RANK as u64,
            "{launches} fused launches of {tasks} tasks for {steps} traced steps on {} ranks",
            rt.size()
        );
        let before = rt.stats();
        let rebuilt = stencil_of(rt, steps, true, "rebuilt", &gpu_step_class, true, 200)?;
        let after = rt.stats();
        ensure!(
            plain == rebuilt,
            "the replays with rebuilt classes differ from the untraced stencil"
        );
        ensure!(
            after.fused_replays == before.fused_replays
                && after.replayed_tasks - before.replayed_tasks == (steps as u64 - 2) * tasks_per_step,
            "rebuilt classes: {} fused launches, {} replayed tasks",
            after.fused_replays - before.fused_replays,
            after.replayed_tasks - before.replayed_tasks
        );
    }

    // 2. Refused inside a trace, and the trace still usable afterwards.
    let class = step_class();
    let n = TILES_PER_RANK * rt.size();
    let dist = Distribution::Block2d(ProcessGrid::new(rt.size(), 1)?);
    let buf = [
        rt.tile_grid::<u64>("misuse.a", n * TILE, 1, TILE, 1, dist)?,
        rt.tile_grid::<u64>("misuse.b", n * TILE, 1, TILE, 1, dist)?,
    ];
    expect_invalid(rt.end_trace(), "end_trace with no trace open", "without an open trace")?;
    ensure!(rt.begin_trace(7)? == TraceMode::Record, "a first use records");
    expect_invalid(rt.begin_trace(8), "a nested trace", "traces do not nest")?;
    expect_invalid(rt.wait(), "wait inside a trace", "wait inside trace 7")?;
    expect_invalid(
        rt.tile_grid::<u64>("late", TILE, 1, TILE, 1, dist),
        "a collection inside a trace",
        "creating a collection inside trace 7",
    )?;
    expect_invalid(
        rt.set_transfer_path(ferry::TransferPath::Auto),
        "a route change inside a trace",
        "set_transfer_path inside trace 7",
    )?;
    insert_step(rt, &class, &buf, 0)?;
    ensure!(rt.end_trace()? == n, "the recording holds the step's {n} tasks");
    // Step 1 writes buffer a again, so step 2 reads it held as step 0 did.
    insert_step(rt, &class, &buf, 1)?;
    ensure!(rt.begin_trace(7)? == TraceMode::Replay, "the same step replays");
    insert_step(rt, &class, &buf, 2)?;
    expect_invalid(
        rt.gather(&buf[0], 0),
        "a gather inside a trace",
        "gather inside trace 7",
    )?;
    expect_invalid(
        rt.tile(&buf[0], 0, 0),
        "a read of a tile inside a trace",
        "a read of a tile inside trace 7",
    )?;
    rt.end_trace()?;
    // A body that fails, or panics, while recording: the recording is dropped, the next use
    // records again (the task it did insert runs as inserted).
    let first = [buf[1].write(0, 0), buf[0].read(0, 0), buf[0].read(1, 0)];
    let r: Result<(), FerryError> = rt.trace(9, |rt| {
        rt.submit(Task::new(&class, &first).args(&[4]))?;
        Err(FerryError::InvalidArgument("the body gave up".into()))
    });
    ensure!(
        matches!(&r, Err(FerryError::InvalidArgument(m)) if m == "the body gave up"),
        "the body's error comes back: {r:?}"
    );
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.trace(10, |rt| -> ferry::Result<()> {
            rt.submit(Task::new(&class, &first).args(&[5]))?;
            panic!("the body panicked on purpose");
        })
    }));
    ensure!(r.is_err(), "the panic comes back");
    for id in [9, 10] {
        ensure!(
            rt.begin_trace(id)? == TraceMode::Record,
            "trace {id}: a failed body's recording is dropped"
        );
        insert_step(rt, &class, &buf, 4)?;
        rt.end_trace()?;
    }
    rt.wait().context("after the refusals")?;
    // A route change drops the recordings: the next use records.
    rt.set_transfer_path(ferry::TransferPath::Auto)?;
    ensure!(
        rt.begin_trace(7)? == TraceMode::Record,
        "recordings are dropped with the routes"
    );
    insert_step(rt, &class, &buf, 0)?;
    rt.end_trace()?;
    rt.wait()?;

    // 3. Last: a replay that ends early fails the run, naming the missing task.
    ensure!(rt.begin_trace(7)? == TraceMode::Replay, "the step replays");
    let acc = [buf[1].write(0, 0), buf[0].read(0, 0), buf[0].read(1, 0)];
    rt.submit(Task::new(&class, &acc).args(&[9]))?;
    match rt.end_trace() {
        Err(FerryError::TraceMismatch { trace: 7, detail })
            if detail.contains("the sequence ended after 1 tasks") && detail.contains("`step`") => {}
        other => bail!("a replay that ends early: expected TraceMismatch, got {other:?}"),
    }
    match rt.wait() {
        Err(FerryError::TraceMismatch { .. }) | Err(FerryError::Poisoned(_)) => {}
        other => bail!("wait after a failed replay: expected the replay's error, got {other:?}"),
    }
    Ok(())
}
