//! A collection handle kept past its runtime's shutdown and used with the next runtime of the
//! process: reading a tile, checkpointing, gathering, restoring or inserting a task through it
//! is refused with an error, whether or not the new runtime has a collection of the same id;
//! and a restore that names a collection twice is refused before it reads anything (the
//! `failures` test `stale_handles_are_refused`).
//!
//! MPI is initialised here, so that each runtime uses it and leaves it up at shutdown, and a
//! second runtime can start in the same process.

use ferry::{Distribution, Runtime};
use std::process::ExitCode;

fn main() -> ExitCode {
    let Some((_universe, _)) = mpi::initialize_with_threading(mpi::Threading::Multiple) else {
        eprintln!("stale_handle: MPI could not be initialised");
        return ExitCode::FAILURE;
    };
    match run() {
        Ok(()) => {
            println!("stale handles refused");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("stale_handle: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let dist = Distribution::OnRank(0);
    let old = {
        let rt = Runtime::builder().from_env().build()?;
        // 4 × 4 tiles, collection id 0 of the first runtime.
        let a = rt.tiled_matrix::<f64>("a", 64, 64, 16, dist)?;
        rt.wait()?;
        rt.shutdown()?;
        a
    };
    let rt = Runtime::builder().from_env().build()?;
    // Id 0 again, with one tile: the old handle's (3, 3) lies past it, its (0, 0) is another
    // collection's tile.
    let b = rt.tiled_matrix::<f64>("b", 16, 16, 16, dist)?;
    rt.wait()?;
    if rt.rank() == 0 {
        rt.tile(&b, 0, 0)?;
        for (i, j) in [(3, 3), (0, 0)] {
            match rt.tile(&old, i, j) {
                Err(e @ ferry::FerryError::InvalidArgument(_))
                    if e.to_string().contains("belongs to another runtime") => {}
                Err(e) => anyhow::bail!("tile ({i}, {j}) of a stale handle: unexpected error {e}"),
                Ok(_) => anyhow::bail!("tile ({i}, {j}) of a stale handle was read"),
            }
        }
    }
    // One directory for all ranks: rank 0's process id names it.
    let pid = rt.allgather_u64(u64::from(std::process::id()))?[0];
    let dir = std::env::temp_dir().join(format!("ferry-stale-handle-{pid}"));
    match rt.checkpoint(&dir, 0, &[(&old).into()]) {
        Err(e @ ferry::FerryError::InvalidArgument(_)) if e.to_string().contains("belongs to another runtime") => {}
        Err(e) => anyhow::bail!("checkpoint of a stale handle: unexpected error {e}"),
        Ok(_) => anyhow::bail!("a stale handle was checkpointed"),
    }
    // A task through the stale handle: refused at insertion, not run on `b`'s tile 0 (which
    // has the old handle's collection id now).
    let touch = ferry::TaskClass::new("touch", |_| Ok(()));
    match rt.submit(ferry::Task::new(&touch, &[old.rw(0, 0)])) {
        Err(e @ ferry::FerryError::InvalidArgument(_)) if e.to_string().contains("another runtime") => {}
        Err(e) => anyhow::bail!("a task through a stale handle: unexpected error {e}"),
        Ok(()) => anyhow::bail!("a task through a stale handle was inserted"),
    }
    match rt.gather(&old, 0) {
        Err(e @ ferry::FerryError::InvalidArgument(_)) if e.to_string().contains("belongs to another runtime") => {}
        Err(e) => anyhow::bail!("gather of a stale handle: unexpected error {e}"),
        Ok(_) => anyhow::bail!("a stale handle was gathered"),
    }
    // Restores are refused before anything is read: a stale handle, and a collection named
    // twice (its tiles would get two writers, the second finding its data taken).
    rt.checkpoint(&dir, 7, &[(&b).into()])?;
    for (what, list) in [
        ("a stale handle", vec![(&old).into()]),
        ("a collection named twice", vec![(&b).into(), (&b).into()]),
    ] {
        let list: Vec<ferry::CollectionRef> = list;
        match rt.restore(&dir, &list) {
            Err(e @ ferry::FerryError::InvalidArgument(_))
                if e.to_string().contains("another runtime") || e.to_string().contains("listed twice") => {}
            Err(e) => anyhow::bail!("restore of {what}: unexpected error {e}"),
            Ok(_) => anyhow::bail!("restore of {what} went ahead"),
        }
    }
    // The runtime is still usable: the proper restore works.
    anyhow::ensure!(rt.restore(&dir, &[(&b).into()])? == 7, "restored step");
    let _ = std::fs::remove_dir_all(&dir);
    rt.shutdown()?;
    Ok(())
}
