//! Failures that end a run with an error, on every rank and without a hang: a start-up step that
//! fails (a trace file that cannot be created; a failure after every thread started, which stops
//! them all), a stale collection handle, a GPU task body that panics, a task that fails on one
//! rank.

mod common;

use common::*;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A trace file that cannot be created is an I/O error naming it, on every rank, not a panic.
#[test]
fn unwritable_trace_file_is_an_error() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let d = tmp("trace-unwritable");
    let _ = std::fs::remove_dir_all(&d);
    // A directory where rank 0's file should go.
    std::fs::create_dir_all(d.join("trace-rank0.json")).expect("tmp dir");
    let dir = d.to_string_lossy().into_owned();
    let r = mpirun(2, &exe, &["--seed", "1"], &[("FERRY_TRACE", dir.as_str())]);
    assert!(!r.ok, "the run must fail");
    assert!(r.stderr.contains("trace-rank0.json"), "{}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
}

/// A collection handle of a runtime that was shut down, used with the next one: an error, not
/// an index out of bounds (`stale_handle`).
#[test]
fn stale_handles_are_refused() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_stale_handle"));
    for np in [1, 2] {
        let r = mpirun(np, &exe, &[], &[]);
        assert!(r.ok, "np {np}:\n{}\n{}", r.stdout, r.stderr);
        assert!(r.stdout.contains("stale handles refused"), "{}", r.stdout);
    }
}

/// A start-up that fails after every thread started (`start_failure`,
/// `FERRY_FAULTS=start-fail:1` set by the binary on its first runtime): on one rank the error
/// returns, no `ferry-…` thread is left, and a second runtime starts and runs a GPU task in the
/// same process; on two ranks the job is aborted with the error said first, rather than left
/// waiting for the failed rank.
#[test]
fn a_failed_start_stops_every_thread() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_start_failure"));
    let env = [("FERRY_DEVICES", "emu:1"), ("FERRY_HOST_MEM_LIMIT", "64M")];
    let r = mpirun(1, &exe, &[], &env);
    assert!(r.ok, "np 1:\n{}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("start-up failure left no thread"), "{}", r.stdout);
    let r = mpirun(2, &exe, &[], &env);
    assert!(!r.ok, "np 2 must abort:\n{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("start-fail:1") && r.stderr.contains("aborting the job"),
        "np 2:\n{}",
        r.stderr
    );
}

/// A GPU task whose body panics fails its task (`TaskFailed` naming the panic, an error naming
/// it on the other rank) instead of ending the GPU manager's thread, and the runtime shuts
/// down (`body_panic`, emulated devices; the CUDA body is checked on the GPU machine).
#[test]
fn a_panicking_gpu_body_fails_its_task() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_body_panic"));
    for np in [1, 2] {
        let r = mpirun(
            np,
            &exe,
            &[],
            &[
                ("FERRY_DEVICES", "emu:1"),
                ("FERRY_ABORT_ON_ERROR", "0"),
                ("RUST_BACKTRACE", "0"),
            ],
        );
        assert!(r.ok, "np {np}:\n{}\n{}", r.stdout, r.stderr);
        assert_eq!(r.stdout.matches("panicking body reported").count(), np, "{}", r.stdout);
    }
}

/// A rank whose program drops the runtime without the `wait` the others make (as a program
/// that gives up at an insertion refused after a failure does) makes it in its shutdown: the
/// others' `wait` returns, and the job ends.
#[test]
fn a_rank_that_gives_up_before_wait_makes_it_at_shutdown() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    for np in [2, 3] {
        let t0 = Instant::now();
        let r = mpirun(
            np,
            &exe,
            &["--seed", "5", "--epochs", "1", "--give-up-on", "1"],
            &[("FERRY_WATCHDOG_S", "0")],
        );
        assert!(r.ok, "np {np}: {}", r.stderr);
        for rank in (0..np).filter(|&r| r != 1) {
            assert!(
                r.stderr.contains(&format!("oracle: rank {rank} waited")),
                "np {np}, rank {rank}: {}",
                r.stderr
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "np {np} took {:?}",
            t0.elapsed()
        );
    }
}

/// A task that fails on one rank fails every rank's `wait` — the failing rank's with the task's
/// error, the others' naming that rank — and no rank hangs in `wait`'s closing collective,
/// even with `FERRY_ABORT_ON_ERROR=0` (no `MPI_Abort` to end the job for them).
#[test]
fn a_task_failing_on_one_rank_fails_every_wait() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    for np in [2, 3] {
        let t0 = Instant::now();
        let r = mpirun(
            np,
            &exe,
            &["--seed", "5", "--fail-middle", "--epochs", "1"],
            &[("FERRY_ABORT_ON_ERROR", "0"), ("FERRY_WATCHDOG_S", "0")],
        );
        assert!(!r.ok, "the run must fail");
        assert!(r.stderr.contains("injected failure"), "{}", r.stderr);
        // Every rank's wait fails (the others' naming the failing rank), none hangs.
        for rank in 0..np {
            assert!(
                r.stderr.contains(&format!("oracle: error on rank {rank}:")),
                "np {np}, rank {rank}: {}",
                r.stderr
            );
        }
        assert!(r.stderr.matches("failed: task `mix`").count() >= np - 1, "{}", r.stderr);
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "np {np} took {:?}",
            t0.elapsed()
        );
    }
}
