//! A GPU task whose body panics: the run fails with that task's error (`TaskFailed`, naming
//! the panic, on the rank that ran it; an error naming it on the others), the rank's GPU
//! manager survives it, and the runtime shuts down cleanly. On
//! emulated devices the CPU body stands in for the kernel; on CUDA (`FERRY_DEVICES=cuda`, the
//! GPU machine) the CUDA body runs on the GPU manager thread, which must not unwind. Prints
//! `panicking body reported` and exits 0 when all of that held (the `failures` test
//! `a_panicking_gpu_body_fails_its_task`).

use ferry::{Distribution, FerryError, Runtime, Task, TaskClass};
use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(()) => {
            println!("panicking body reported");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("body_panic: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let rt = Runtime::builder().from_env().build()?;
    anyhow::ensure!(!rt.devices().is_empty(), "no device: set FERRY_DEVICES=emu:1 or cuda");
    let a = rt.tiled_matrix::<f64>("a", 64, 64, 32, Distribution::OnRank(0))?;
    let fine = TaskClass::new("fine", |ctx| {
        ctx.tile_mut::<f64>(0)?.fill(1.0);
        Ok(())
    })
    .with_cuda(|_| Ok(()));
    let bad = TaskClass::new("bad", |_| panic!("deliberate panic in a task body"))
        .with_cuda(|_| panic!("deliberate panic in a task body"));
    // A healthy task first: the device path works before the failure.
    rt.submit(Task::new(&fine, &[a.rw(0, 0)]))?;
    rt.wait()?;
    rt.submit(Task::new(&bad, &[a.rw(1, 1)]))?;
    // Rank 0 ran it: its error is the task's. Other ranks' name rank 0's failure.
    match rt.wait() {
        Err(FerryError::TaskFailed { class, msg, .. })
            if rt.rank() == 0 && class == "bad" && msg.contains("panicked") && msg.contains("deliberate panic") => {}
        Err(e) if rt.rank() != 0 && e.to_string().contains("deliberate panic") => {}
        Err(e) => anyhow::bail!("the panicking task failed with an unexpected error: {e}"),
        Ok(()) => anyhow::bail!("the panicking task's run succeeded"),
    }
    // Later calls report the run as failed (not a dead GPU manager), and shutdown returns.
    match rt.wait() {
        Err(e) if !e.to_string().contains("GPU manager") => {}
        Err(e) => anyhow::bail!("after the failure: {e}"),
        Ok(()) => anyhow::bail!("a failed run's later wait succeeded"),
    }
    let _ = rt.shutdown();
    Ok(())
}
