//! A rank that stops making progress does not hang the job: the watchdog turns a task that never
//! returns into an error on every rank, and a rank killed mid-run ends the job within seconds.

mod common;

use common::*;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A task that never returns on rank 1: the watchdog on every rank reports what it waits for
/// and the job ends with an error within the limit (plus start-up), instead of hanging; also
/// where the inserting threads run tasks (`FERRY_INSERTER_HELPS=on`), whose stuck body the
/// watchdog ends the job around.
#[test]
fn watchdog_turns_a_hang_into_an_error() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    for helps in ["off", "on"] {
        let t0 = Instant::now();
        let r = mpirun(
            2,
            &exe,
            &["--seed", "5", "--stall-rank", "1"],
            &[("FERRY_WATCHDOG_S", "3"), ("FERRY_INSERTER_HELPS", helps)],
        );
        assert!(!r.ok, "helps {helps}: a hung run must fail");
        assert!(
            r.stderr.contains("watchdog: no progress for 3 s"),
            "helps {helps}: {}",
            r.stderr
        );
        assert!(
            r.stderr.contains("unfinished") && r.stderr.contains("MPI:"),
            "helps {helps}: the report names what is waited for:\n{}",
            r.stderr
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "helps {helps}: took {:?}",
            t0.elapsed()
        );
    }
}

/// A rank killed mid-run: the others do not hang; the job ends within seconds and the launcher
/// names the rank that died. (The watchdog is off here, so the launcher's handling is what is
/// tested.)
#[test]
fn a_killed_rank_ends_the_job_quickly() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    // Seed 5 puts the stalled task on rank 1; `--tasks 301` (same first 300 tasks) makes the
    // command line unique, to find the rank processes (not mpirun, whose line starts with it).
    let (mut cmd, _session) = mpirun_command();
    cmd.args(["-np", "2"]);
    cmd.args(["-x", "FERRY_WATCHDOG_S"])
        .arg(&exe)
        .args(["--seed", "5", "--tasks", "301", "--stall-rank", "1"]);
    cmd.env("FERRY_WATCHDOG_S", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().expect("mpirun");
    // Wait until both ranks run, then kill one of them.
    let t0 = Instant::now();
    let pids = loop {
        let out = Command::new("pgrep")
            .args(["-f", r"^\S*oracle .*tasks 301"])
            .output()
            .expect("pgrep");
        let pids: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(String::from)
            .collect();
        if pids.len() >= 2 || t0.elapsed() > Duration::from_secs(30) {
            break pids;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(pids.len() >= 2, "rank processes not found: {pids:?}");
    std::thread::sleep(Duration::from_millis(500));
    let victim = pids.last().expect("a pid");
    let _ = Command::new("kill").args(["-9", victim]).status();
    let killed = Instant::now();
    let out = wait_with_timeout(child);
    assert!(!out.status.success());
    assert!(
        killed.elapsed() < Duration::from_secs(30),
        "the job took {:?} to end",
        killed.elapsed()
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("process rank") && stderr.contains("signal 9"),
        "{stderr}"
    );
}
