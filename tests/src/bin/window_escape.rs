//! What the submission window's stall limit (`graph/window.rs`) exists for: a blocked inserter
//! and the send window together. Run on two ranks with every payload rendezvous and one send
//! in flight and two workers (`FERRY_EAGER_BYTES=0 FERRY_MAX_SENDS=1 FERRY_WORKERS=2`; the
//! `submission_window` test `a_full_window_does_not_deadlock_the_send_window`). Rank 1 gets a
//! window of one node, rank 0 none. The sequence:
//!
//! 1. rank 0 writes tile `p`, slowly;
//! 2. rank 1 reads `p` — its window is full from here on, until `p` has come;
//! 3. rank 0 writes tile `x`, at once;
//! 4. rank 1 reads `x`.
//!
//! Rank 0's send of `x` is ready first and takes the only send slot; it completes only once
//! rank 1 posts the receive of `x`, which rank 1 inserts only past its full window; the send of
//! `p`, which would empty that window, queues behind it. Without the stall limit the job hangs;
//! with it rank 1 goes on after 50 ms without progress, and both tiles arrive.

use ferry::{Config, Distribution, Runtime, Task, TaskClass};
use std::process::ExitCode;
use std::time::Duration;

/// Elements of each 1 MiB tile: large enough to be a rendezvous message in MPI too.
const ELEMS: usize = 128 * 1024;

fn main() -> ExitCode {
    match run() {
        Ok(Some(line)) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("window_escape: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<Option<String>> {
    // Open MPI tells each process its rank before MPI starts; the window is per process.
    let second = std::env::var("OMPI_COMM_WORLD_RANK").is_ok_and(|r| r == "1");
    let mut config = Config::from_env()?;
    config.submit_window = usize::from(second);
    let rt = Runtime::builder().config(config).build()?;
    anyhow::ensure!(rt.size() == 2, "window_escape runs on exactly two ranks");
    let a = rt.tile_grid::<u64>("a", 128, 2 * 1024, 128, 1024, Distribution::OnRank(0))?;
    let b = rt.tile_grid::<u64>("b", 128, 2 * 1024, 128, 1024, Distribution::OnRank(1))?;
    anyhow::ensure!(a.tile_rows() == 1 && a.tile_cols() == 2, "two tiles of 1 MiB");
    let fill = TaskClass::new("fill", |ctx| {
        std::thread::sleep(Duration::from_millis(ctx.args()[1] as u64));
        ctx.tile_mut::<u64>(0)?.fill(ctx.args()[0] as u64);
        Ok(())
    });
    let take = TaskClass::new("take", |ctx| {
        let want = ctx.args()[0] as u64;
        let got = ctx.tile::<u64>(0)?;
        if got.len() != ELEMS || got.iter().any(|&v| v != want) {
            return Err(format!("tile read by `take` does not hold {want}").into());
        }
        ctx.tile_mut::<u64>(1)?.copy_from_slice(got);
        Ok(())
    });
    rt.submit(Task::new(&fill, &[a.write(0, 0)]).args(&[7, 300]))?;
    rt.submit(Task::new(&take, &[a.read(0, 0), b.write(0, 0)]).args(&[7]))?;
    rt.submit(Task::new(&fill, &[a.write(0, 1)]).args(&[9, 0]))?;
    rt.submit(Task::new(&take, &[a.read(0, 1), b.write(0, 1)]).args(&[9]))?;
    rt.wait()?;
    if rt.rank() == 1 {
        for (j, want) in [(0, 7u64), (1, 9)] {
            let t = rt.tile(&b, 0, j)?;
            anyhow::ensure!(t.iter().all(|&v| v == want), "tile {j} of b does not hold {want}");
        }
    }
    let stats = rt.gather_stats()?;
    let line = (rt.rank() == 0).then(|| {
        format!(
            "window escape ok: rendezvous bytes {} stalls {} overruns {}",
            stats
                .iter()
                .map(|s| s.path(ferry::TrafficPath::HostRendezvous).bytes_sent)
                .sum::<u64>(),
            stats.iter().map(|s| s.window_stalls).sum::<u64>(),
            stats.iter().map(|s| s.window_overruns).sum::<u64>()
        )
    });
    rt.shutdown()?;
    Ok(line)
}
