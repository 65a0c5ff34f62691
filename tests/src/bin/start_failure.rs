//! A start-up that fails after every thread of the rank has started
//! (`FERRY_FAULTS=start-fail:1`, standing in for a watchdog thread that cannot be spawned or a
//! failed GPU-direct self-check): `build` returns the error, no thread of the failed runtime is
//! left running (GPU manager, emulated streams, I/O thread, workers, watchdog, MPI thread), and
//! a second runtime then starts in the same process and runs a GPU task. On one rank it prints
//! `start-up failure left no thread` and exits 0; on several ranks the failure aborts the job
//! (the others wait for this rank in the clock synchronisation). The `failures` test
//! `a_failed_start_stops_every_thread` runs it with emulated devices and a host tier.
//!
//! MPI is initialised here, so that each runtime uses it and leaves it up, and a second runtime
//! can start in the same process.

use ferry::{Config, Distribution, FerryError, Runtime, Task, TaskClass};
use std::process::ExitCode;

fn main() -> ExitCode {
    let Some((_universe, _)) = mpi::initialize_with_threading(mpi::Threading::Multiple) else {
        eprintln!("start_failure: MPI could not be initialised");
        return ExitCode::FAILURE;
    };
    match run() {
        Ok(()) => {
            println!("start-up failure left no thread");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("start_failure: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Names of this process's threads that ferry started (`ferry-…`), from `/proc/self/task`.
fn ferry_threads() -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for t in std::fs::read_dir("/proc/self/task")? {
        // A thread may end between the listing and the read: skip it.
        if let Ok(n) = std::fs::read_to_string(t?.path().join("comm")) {
            let n = n.trim_end().to_string();
            if n.starts_with("ferry-") {
                names.push(n);
            }
        }
    }
    names.sort();
    Ok(names)
}

fn run() -> anyhow::Result<()> {
    let before = ferry_threads()?;
    anyhow::ensure!(before.is_empty(), "ferry threads before any runtime: {before:?}");
    let config = Config::from_env()?;
    // Fault injection is set as its variable says: it is no field of the public `Config`.
    let mut failing = config.clone();
    failing.apply_vars([("FERRY_FAULTS", "start-fail:1")])?;
    match Runtime::builder().config(failing).build() {
        Err(FerryError::Config(m)) if m.contains("start-fail") => {}
        Err(e) => anyhow::bail!("the failed start-up returned another error: {e}"),
        Ok(_) => anyhow::bail!("start-up succeeded despite FERRY_FAULTS=start-fail:1"),
    }
    let left = ferry_threads()?;
    anyhow::ensure!(left.is_empty(), "threads left by the failed start-up: {left:?}");

    let rt = Runtime::builder().config(config).build()?;
    // The failed runtime really started what this one starts (else the check above proves
    // nothing): a GPU manager, an I/O thread, workers. A thread takes its name itself once it
    // runs, so one spawned last (the watchdog) may still carry its parent's name for a moment
    // on a loaded machine: look again for up to 5 s before concluding that it is missing.
    const WANT: [&str; 5] = ["ferry-gpu", "ferry-io", "ferry-worker-0", "ferry-watchdog", "ferry-mpi"];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut running = ferry_threads()?;
    while !WANT.iter().all(|w| running.iter().any(|n| n == w)) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
        running = ferry_threads()?;
    }
    for want in WANT {
        anyhow::ensure!(
            running.iter().any(|n| n == want),
            "{want} not among the second runtime's threads {running:?}: set FERRY_DEVICES=emu:1 and FERRY_HOST_MEM_LIMIT"
        );
    }
    // A tile of 32 × 32 `f32`, filled with 2.5 on the device (CUDA) or by the CPU body
    // (emulated devices).
    let a = rt.tiled_matrix::<f32>("a", 32, 32, 32, Distribution::OnRank(0))?;
    let fill = TaskClass::new("fill", |ctx| {
        ctx.tile_mut::<f32>(0)?.fill(2.5);
        Ok(())
    })
    .with_cuda(|ctx| {
        let (rows, cols) = ctx.shape(0)?;
        let fills = [(ctx.ptr(0)?, rows * cols, 2.5f32.to_bits())];
        // SAFETY: the tile's device buffer holds `rows × cols` words, on this task's stream.
        unsafe { ferry_kernels::fill::fill_u32(ctx.stream(), &fills) }.map_err(|e| e.to_string().into())
    });
    rt.submit(Task::new(&fill, &[a.write(0, 0)]))?;
    rt.wait()?;
    let tile = rt.tile(&a, 0, 0)?;
    anyhow::ensure!(
        tile.len() == 32 * 32 && tile.iter().all(|&x| x == 2.5),
        "the second runtime's task did not fill its tile"
    );
    rt.shutdown()?;
    Ok(())
}
