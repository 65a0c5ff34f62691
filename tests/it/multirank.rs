//! Multi-rank tests: each launches `mpirun --oversubscribe -np N` on the oracle or an example
//! binary and checks its results. MPI can be initialised once per process, so every run is a
//! process of its own.

mod common;

use common::*;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn oracle_one_rank() {
    oracle(1, 0..6, &[], &[]);
    oracle(1, 6..10, &[], &[("FERRY_WORKERS", "3")]);
}

#[test]
fn oracle_two_ranks() {
    oracle(2, 10..18, &[], &[]);
    oracle(2, 18..22, &["--epochs", "5"], &[("FERRY_WORKERS", "2")]);
}

#[test]
fn oracle_three_ranks() {
    oracle(3, 30..36, &["--override-pct", "40"], &[]);
}

#[test]
fn oracle_four_ranks() {
    oracle(4, 40..46, &["--max-access", "6"], &[("FERRY_WORKERS", "2")]);
}

/// Every payload over the eager bound, a send window of one: the rendezvous path and the window
/// queue carry everything, and the statistics must show it.
#[test]
fn oracle_rendezvous_path_with_window_of_one() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let env = [
        ("FERRY_EAGER_BYTES", "0"),
        ("FERRY_MAX_SENDS", "1"),
        ("FERRY_MAX_SENDS_PER_PEER", "1"),
    ];
    for (np, seed) in [(2, 50), (3, 51), (4, 52)] {
        let r = mpirun(np, &exe, &["--seed", &seed.to_string()], &env);
        assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
        assert!(
            r.stdout.contains("host-eager=0 "),
            "eager path must be unused: {}",
            r.stdout
        );
        assert!(
            !r.stdout.contains("host-rendezvous=0\n"),
            "rendezvous path must carry the bytes: {}",
            r.stdout
        );
    }
}

/// A submission window of a few nodes: insertion blocks again and again on every rank, and
/// the random graphs still give the sequential run's tiles and the predicted traffic — on the
/// host, with every send rendezvous through a send window of one, and on emulated devices
/// under memory pressure (where transfers, evictions and stage-outs all have to finish without
/// the inserter running ahead).
#[test]
fn oracle_with_a_tiny_submission_window() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    type Env<'a> = &'a [(&'a str, &'a str)];
    let runs: [(usize, u64, Env); 5] = [
        (2, 60, &[("FERRY_SUBMIT_WINDOW", "1")]),
        (3, 61, &[("FERRY_SUBMIT_WINDOW", "4")]),
        (4, 62, &[("FERRY_SUBMIT_WINDOW", "8"), ("FERRY_WORKERS", "2")]),
        // Every payload rendezvous and one send in flight: a send posted ahead of its receive
        // (whose rank waits in its window) holds the only slot; the window's stall limit must
        // let that rank go on and post it.
        (
            3,
            64,
            &[
                ("FERRY_SUBMIT_WINDOW", "2"),
                ("FERRY_EAGER_BYTES", "0"),
                ("FERRY_MAX_SENDS", "1"),
                ("FERRY_MAX_SENDS_PER_PEER", "1"),
            ],
        ),
        (
            2,
            63,
            &[
                ("FERRY_SUBMIT_WINDOW", "6"),
                ("FERRY_DEVICES", "emu:2"),
                ("FERRY_DEVICE_MEM", "2K"),
                ("FERRY_EMU_DELAY_US", "100"),
            ],
        ),
    ];
    for (np, seed, env) in runs {
        let r = mpirun(
            np,
            &exe,
            &["--seed", &seed.to_string(), "--tasks", "250", "--epochs", "2"],
            env,
        );
        assert!(
            r.ok && r.stdout.contains("oracle ok"),
            "np={np} seed={seed} {env:?}\n{}\n{}",
            r.stdout,
            r.stderr
        );
        let stalls = number_after(&r.stdout, "window_stalls=").expect("the oracle prints window_stalls");
        assert!(
            stalls >= 10,
            "a window of a few nodes must block insertion: {}",
            r.stdout
        );
    }
}

/// A rank whose submission window is full before the receive that its peer's only send slot
/// waits for (`window_escape`): without the window's stall limit this job hangs (checked by
/// hand with the limit raised to a minute); with it, rank 1 goes on and both tiles arrive.
#[test]
fn a_full_window_does_not_deadlock_the_send_window() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_window_escape"));
    let env = [
        ("FERRY_WORKERS", "2"),
        ("FERRY_EAGER_BYTES", "0"),
        ("FERRY_MAX_SENDS", "1"),
        ("FERRY_MAX_SENDS_PER_PEER", "1"),
        ("FERRY_WATCHDOG_S", "20"),
    ];
    let r = mpirun(2, &exe, &[], &env);
    assert!(
        r.ok && r.stdout.contains("window escape ok"),
        "{}\n{}",
        r.stdout,
        r.stderr
    );
    let overruns = number_after(&r.stdout, "overruns ").expect("window_escape prints its overruns");
    assert!(
        overruns >= 1,
        "rank 1 must have gone on past its full window: {}",
        r.stdout
    );
}

#[test]
fn graph_mismatch_is_detected() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    // Same transfers, different task arguments: only the sequence hash can tell.
    let r = mpirun(2, &exe, &["--seed", "3", "--mismatch-args"], &[]);
    assert!(!r.ok, "a mismatched graph must fail");
    assert!(r.stderr.contains("task graph mismatch between ranks"), "{}", r.stderr);
    // The report names the first task the ranks disagree on, as each rank inserted it.
    assert!(r.stderr.contains("first differing task: #"), "{}", r.stderr);
    assert!(r.stderr.contains("rank 1 inserted `mix"), "{}", r.stderr);
    // Different access modes: transfers disagree in size before `wait`.
    let r = mpirun(3, &exe, &["--seed", "4", "--mismatch"], &[]);
    assert!(!r.ok, "a mismatched graph must fail");
    assert!(
        r.stderr.contains("disagree") || r.stderr.contains("mismatch") || r.stderr.contains("MPI error"),
        "{}",
        r.stderr
    );
}

#[test]
fn unknown_ferry_variable_is_refused() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let r = mpirun(1, &exe, &[], &[("FERRY_WROKERS", "2")]);
    assert!(!r.ok);
    assert!(r.stderr.contains("unknown variable FERRY_WROKERS"), "{}", r.stderr);
}

/// A variable that is not UTF-8: another program's is ignored, a `FERRY_*` one is refused with a
/// clear error (`std::env::vars` would panic on either).
#[test]
fn environment_that_is_not_utf8_is_handled() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let run = |name: &str| {
        let mut cmd = Command::new("mpirun");
        cmd.args(["--oversubscribe", "-np", "1"]);
        if unsafe_is_root() {
            cmd.arg("--allow-run-as-root");
        }
        cmd.arg(&exe)
            .args(["--seed", "1"])
            .env(name, OsStr::from_bytes(b"2\xff"))
            .current_dir(repo_root())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = wait_with_timeout(cmd.spawn().expect("mpirun"));
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, stderr) = run("SOME_OTHER_TOOL");
    assert!(ok, "another program's variable must not matter:\n{stderr}");
    let (ok, stderr) = run("FERRY_WORKERS");
    assert!(!ok, "a FERRY_* value that is not UTF-8 must be refused");
    assert!(stderr.contains("FERRY_WORKERS: not valid UTF-8"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

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

fn cholesky(np: usize, args: &[&str]) -> serde_json::Value {
    let out = tmp(&format!(
        "cholesky-{np}-{}.json",
        args.join("_").replace(['/', '.'], "")
    ));
    let o = out.to_string_lossy().into_owned();
    let mut a = args.to_vec();
    a.extend_from_slice(&["--json", &o]);
    let r = mpirun(np, &bin("cholesky"), &a, &[]);
    assert!(r.ok, "cholesky np={np} {args:?} failed\n{}\n{}", r.stdout, r.stderr);
    json(&out)
}

#[test]
fn cholesky_generated_on_one_to_four_ranks() {
    let mut logdets = Vec::new();
    // n = 300 with nb = 64: a ragged last tile row and column.
    for np in 1..=4 {
        let rec = cholesky(np, &["--n", "300", "--nb", "64", "--check", "exact"]);
        let res = rec["residual"].as_f64().expect("residual");
        // ‖A − LLᵀ‖_F / (‖A‖_F · n · ε) < 1, i.e. relative residual below n·ε ≈ 6.7e-14.
        assert!(res < 1.0, "np={np}: scaled residual {res}");
        assert!(res * 300.0 * f64::EPSILON < 1e-13, "np={np}: relative residual");
        logdets.push(rec["logdet"].as_f64().expect("logdet"));
        if np > 1 {
            let sent: u64 = rec["paths"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["bytes"].as_u64().unwrap())
                .sum();
            assert!(sent > 0, "np={np}: a distributed factorization moves tiles");
        }
    }
    for l in &logdets {
        assert!(
            (l - logdets[0]).abs() <= 1e-9 * logdets[0].abs(),
            "log det differs across rank counts: {logdets:?}"
        );
    }
}

#[test]
fn cholesky_geonames_covariance() {
    let points = repo_root().join("data/cities1000.csv");
    let p = points.to_string_lossy().into_owned();
    let args = [
        "--points",
        p.as_str(),
        "--count",
        "500",
        "--nb",
        "96",
        "--kernel",
        "matern32",
        "--order",
        "morton",
    ];
    let one = cholesky(1, &args);
    let two = cholesky(3, &args);
    for rec in [&one, &two] {
        assert!(rec["residual"].as_f64().unwrap() < 1.0, "{rec}");
        assert!(rec["loglik"].as_f64().unwrap().is_finite(), "{rec}");
    }
    let (a, b) = (one["loglik"].as_f64().unwrap(), two["loglik"].as_f64().unwrap());
    assert!((a - b).abs() <= 1e-8 * a.abs(), "log-likelihood differs: {a} vs {b}");
}

fn stencil(np: usize, args: &[&str]) -> serde_json::Value {
    let out = tmp(&format!("stencil-{np}-{}.json", args.join("_")));
    let o = out.to_string_lossy().into_owned();
    let mut a = args.to_vec();
    a.extend_from_slice(&["--json", &o]);
    let r = mpirun(np, &bin("stencil"), &a, &[]);
    assert!(r.ok, "stencil np={np} {args:?} failed\n{}\n{}", r.stdout, r.stderr);
    json(&out)
}

#[test]
fn stencil_bit_identical_across_ranks_and_tilings() {
    let reference = stencil(1, &["--n", "150", "--nb", "40", "--iters", "25"]);
    let sum = reference["checksum"].as_str().unwrap().to_string();
    assert!(reference["max_rel_error"].as_f64().unwrap() < 1e-12);
    for (np, nb) in [(2, "40"), (3, "40"), (4, "40"), (4, "33"), (2, "150")] {
        let rec = stencil(np, &["--n", "150", "--nb", nb, "--iters", "25"]);
        assert_eq!(
            rec["checksum"].as_str().unwrap(),
            sum,
            "np={np} nb={nb} differs from the single-rank run"
        );
    }
    // The step split into interior and ring tasks (--overlap): the same bits, with tiles thin
    // enough (nb 2 and the ragged last row of nb 33) that rings cover whole tiles, on CPU workers
    // and on emulated devices; the two write parts of the new field (concurrent, the default)
    // or one after the other (ordered). On devices, concurrent rings are placed while other
    // part writers of their tile are in flight (`parts_together`); ordered ones never are.
    for (np, nb, devices, overlap) in [
        (1, "40", "none", "concurrent"),
        (2, "33", "emu:2", "concurrent"),
        (2, "33", "emu:2", "ordered"),
        (3, "2", "none", "concurrent"),
        (2, "40", "emu:1", "concurrent"),
        (1, "40", "emu:1", "ordered"),
    ] {
        let flag = format!("--overlap={overlap}");
        let rec = stencil(
            np,
            &["--n", "150", "--nb", nb, "--iters", "25", &flag, "--devices", devices],
        );
        assert_eq!(
            rec["checksum"].as_str().unwrap(),
            sum,
            "{flag} np={np} nb={nb} {devices} differs from the single-rank run"
        );
        assert_eq!(rec["overlap"].as_str(), Some(overlap), "{rec}");
        let together = rec["parts_together"].as_u64().unwrap();
        match (devices, overlap) {
            ("none", _) | (_, "ordered") => assert_eq!(together, 0, "{flag} {devices}: {rec}"),
            _ => assert!(
                together > 0,
                "{flag} np={np} {devices}: no ring alongside its interior: {rec}"
            ),
        }
    }
    // Tiles that are not square (--mb): row slabs, one per rank (each with one neighbour),
    // three slabs over three ranks, and ragged tall tiles on four; plain and --overlap, on CPU
    // workers and on emulated devices.
    for (np, mb, nb, devices, overlap) in [
        (2, "75", "150", "emu:1", false),
        (2, "75", "150", "emu:1", true),
        (3, "50", "150", "none", true),
        (4, "64", "20", "none", false),
    ] {
        let mut a = vec![
            "--n",
            "150",
            "--mb",
            mb,
            "--nb",
            nb,
            "--iters",
            "25",
            "--devices",
            devices,
        ];
        if overlap {
            a.push("--overlap");
        }
        let rec = stencil(np, &a);
        assert_eq!(
            rec["checksum"].as_str().unwrap(),
            sum,
            "np={np} mb={mb} nb={nb} {devices} overlap={overlap} differs from the single-rank run"
        );
        assert_eq!(rec["mb"].as_u64(), Some(mb.parse().unwrap()), "{rec}");
        // Row slabs are split one per rank (the process grid follows the tile grid): halos
        // cross between the ranks.
        let moved: u64 = rec["paths"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| {
                !matches!(
                    p["path"].as_str(),
                    Some("h2d" | "d2h" | "peer" | "control" | "control-ring")
                )
            })
            .map(|p| p["bytes"].as_u64().unwrap())
            .sum();
        assert!(moved > 0, "np={np} mb={mb}: no halo crossed ranks: {rec}");
    }
}

/// The small `--overlap` stencil the launch and transfer switches are tested on: 96², tiles of
/// 24², 12 steps, on `devices`.
fn small_overlap(devices: &str) -> [&str; 9] {
    [
        "--n",
        "96",
        "--nb",
        "24",
        "--iters",
        "12",
        "--overlap",
        "--devices",
        devices,
    ]
}

/// Launch-ahead: GPU tasks released when the tasks they follow are launched give the same bits
/// as when they wait for them to finish, on one and two emulated devices per rank, and it does
/// happen (the interior → ring → interior chain of `--overlap` is all GPU tasks).
#[test]
fn launch_ahead_gives_the_same_bits() {
    for (np, devices) in [(1, "emu:1"), (2, "emu:2")] {
        let a = small_overlap(devices);
        let on = run_json(
            "stencil",
            np,
            &a,
            &[("FERRY_EMU_DELAY_US", "50"), ("FERRY_LAUNCH_AHEAD", "on")],
            "ahead-on",
        );
        let off = run_json("stencil", np, &a, &[("FERRY_LAUNCH_AHEAD", "off")], "ahead-off");
        assert_eq!(on["checksum"], off["checksum"], "np={np} {devices}");
        assert!(on["launched_ahead"].as_u64().unwrap() > 0, "np={np} {devices}: {on}");
        assert_eq!(off["launched_ahead"].as_u64(), Some(0), "np={np} {devices}: {off}");
    }
}

/// Runs the stencil on `np` ranks with `var` on, then off, on top of `env`: the two records.
fn stencil_on_off(
    np: usize,
    args: &[&str],
    env: &[(&'static str, &'static str)],
    var: &'static str,
    tag: &str,
) -> (serde_json::Value, serde_json::Value) {
    let run = |v: &'static str| {
        let mut e = env.to_vec();
        e.push((var, v));
        run_json("stencil", np, args, &e, &format!("{tag}-{v}"))
    };
    (run("on"), run("off"))
}

/// comm-in ahead: the ring tasks launched behind the IPC pull or the staged host→device copy of
/// their halo (before the copy is seen complete) give the same bits as when they wait for it,
/// and it does happen on both routes; off, nothing is launched ahead. Launch-ahead (which the
/// stencil driver turns on for `--overlap`) is off here, so that only comm-in ahead launches
/// early.
#[test]
fn comm_in_ahead_gives_the_same_bits() {
    let args = small_overlap("emu:1");
    for path in ["ipc", "staged"] {
        let env = [
            ("FERRY_EMU_DELAY_US", "50"),
            ("FERRY_TRANSFER_PATH", path),
            ("FERRY_LAUNCH_AHEAD", "off"),
        ];
        let (on, off) = stencil_on_off(2, &args, &env, "FERRY_COMM_IN_AHEAD", &format!("comm-in-{path}"));
        assert_eq!(on["checksum"], off["checksum"], "{path}");
        assert!(on["comm_in_ahead"].as_u64().unwrap() > 0, "{path}: {on}");
        assert_eq!(off["comm_in_ahead"].as_u64(), Some(0), "{path}: {off}");
        assert_eq!(on["launched_ahead"].as_u64(), Some(0), "{path}: {on}");
    }
}

/// Stream affinity under launch-ahead: tasks launched onto the stream of the task they follow,
/// ordered by the stream instead of by a wait for its event, give the same bits — with emulated
/// kernels completing up to 200 µs late, a successor not ordered after its predecessor would
/// read the previous step — and it does happen when on (a task of `--overlap` launched behind the
/// one before it on its tile), never when off. Two emulated devices per rank.
#[test]
fn stream_affinity_gives_the_same_bits() {
    let args = small_overlap("emu:2");
    let env = [("FERRY_EMU_DELAY_US", "200"), ("FERRY_LAUNCH_AHEAD", "on")];
    let (on, off) = stencil_on_off(2, &args, &env, "FERRY_STREAM_AFFINITY", "affinity");
    assert_eq!(on["checksum"], off["checksum"]);
    let ahead = on["launched_ahead"].as_u64().unwrap();
    let followed = on["followed"].as_u64().unwrap();
    assert!(followed > 0 && followed <= ahead, "{on}");
    assert_eq!(off["followed"].as_u64(), Some(0), "{off}");
    assert!(off["launched_ahead"].as_u64().unwrap() > 0, "{off}");
}

/// Offers at launch: IPC sends that leave when their producer is launched, the consumer's pull
/// waiting on its stream for the producer's signal, give the same bits as sends that wait for
/// the producer's completion — with emulated kernels completing up to 300 µs late, a pull that
/// did not wait would read the previous step's halo — and they do happen when on, never when
/// off. Plain and `--overlap` (whose ring tasks write the halo tiles). The consumer's pulls
/// either wait on the device or are held by its GPU manager until the producer's signal shows
/// in host memory (`FERRY_OFFER_POLL_US`): held without a time limit, none waits on the device;
/// never held, all whose signal was not there yet do; both give the same bits.
#[test]
fn offers_at_launch_give_the_same_bits() {
    for overlap in [false, true] {
        let mut args = vec!["--n", "96", "--nb", "24", "--iters", "12", "--devices", "emu:1"];
        if overlap {
            args.push("--overlap");
        }
        let env = [("FERRY_EMU_DELAY_US", "300"), ("FERRY_TRANSFER_PATH", "ipc")];
        let (on, off) = stencil_on_off(2, &args, &env, "FERRY_OFFER_AT_LAUNCH", &format!("offers-{overlap}"));
        let one = run_json("stencil", 1, &args, &env, &format!("offers-one-{overlap}"));
        assert_eq!(on["checksum"], one["checksum"], "overlap {overlap}");
        assert_eq!(off["checksum"], one["checksum"], "overlap {overlap}");
        assert!(on["offered_at_launch"].as_u64().unwrap() > 0, "{on}");
        assert_eq!(off["offered_at_launch"].as_u64(), Some(0), "{off}");
        assert_eq!(off["offers_seen"].as_u64(), Some(0), "{off}");
        let held = |us: &'static str| {
            let mut e = env.to_vec();
            e.extend([("FERRY_OFFER_AT_LAUNCH", "on"), ("FERRY_OFFER_POLL_US", us)]);
            run_json("stencil", 2, &args, &e, &format!("offers-held-{us}-{overlap}"))
        };
        let (always, never) = (held("1000000"), held("0"));
        for r in [&always, &never] {
            assert_eq!(r["checksum"], one["checksum"], "overlap {overlap}: {r}");
        }
        assert!(always["offers_seen"].as_u64().unwrap() > 0, "{always}");
        assert_eq!(always["offers_waited"].as_u64(), Some(0), "{always}");
        assert!(never["offers_waited"].as_u64().unwrap() > 0, "{never}");
    }
}

/// Device acknowledgements: a tile sent over IPC and then overwritten on its device (`transfer`'s
/// stamps, round after round; the stencil's edges with renaming off) gives the same results when
/// the overwriting task is launched at once, its stream waiting for the consumer's
/// acknowledgement word — with emulated operations completing up to 300 µs late, a stamp that
/// did not wait would overwrite a tile its pull had not read yet, and the emulated sink, which
/// checks every tile it reads, would fail the run (as it does with the waits left out,
/// `FERRY_FAULTS=skip-ack-wait:1`). The overwriters do wait on the device when on (and each
/// consumer wrote at least as many words), never when off — with offers at launch too, whose
/// acknowledged pulls the consumer holds until the producer's signal shows on the host (none of
/// them waits on the device). Under `auto` (the default) only tasks that could wait for two
/// acknowledgements or more wait on the device: the stamps of a round of 8 tiles, not those of
/// one tile, nor the stencil's tasks, which rewrite one sent edge each on two ranks.
#[test]
fn device_acks_give_the_same_results() {
    for (ack, offers) in [("on", "off"), ("on", "on"), ("off", "off"), ("auto", "on")] {
        let rec = run_json(
            "transfer",
            2,
            &[
                "--devices",
                "emu:1",
                "--paths",
                "ipc",
                "--sizes",
                "64K",
                "--inflight",
                "1,8",
                "--volume",
                "2M",
                "--tasks",
                "per-tile,per-round",
            ],
            &[
                ("FERRY_EMU_DELAY_US", "300"),
                ("FERRY_DEVICE_ACK", ack),
                ("FERRY_OFFER_AT_LAUNCH", offers),
            ],
            &format!("device-ack-{ack}-offers-{offers}"),
        );
        let rows = rec["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 4, "{rec}");
        for row in rows {
            let [acked, written] = [0, 1].map(|k| row["device_acks"][k].as_u64().unwrap());
            let [seen, waited] = [0, 1].map(|k| row["offers"][k].as_u64().unwrap());
            let transfers = row["transfers"].as_u64().unwrap();
            // A stamp of a round at 8 in flight rewrites 4 tiles (alternate rounds stamp the two
            // halves), each still read by its IPC send: 4 acknowledgements it could wait for.
            let several = row["tasks"] == "per-round" && row["inflight"].as_u64() == Some(8);
            if ack == "on" || (ack == "auto" && several) {
                assert!(acked > 0, "no stamp waited for an acknowledgement: {row}");
                assert!(written >= acked, "{row}");
                if offers == "on" {
                    assert!(seen > 0, "no offered pull was seen on the host: {row}");
                }
                // Only pulls that asked for no acknowledgement (a last round's) ever wait on
                // the device.
                assert!(waited <= transfers - written, "an acknowledged pull waited: {row}");
            } else {
                assert_eq!([acked, written], [0, 0], "{row}");
            }
        }
    }
    // The check has teeth: stamps that skip their wait overwrite tiles before their pulls.
    let r = mpirun(
        2,
        &bin("transfer"),
        &[
            "--devices",
            "emu:1",
            "--paths",
            "ipc",
            "--sizes",
            "64K",
            "--inflight",
            "8",
            "--volume",
            "4M",
            "--tasks",
            "per-round",
        ],
        &[
            ("FERRY_EMU_DELAY_US", "300"),
            ("FERRY_DEVICE_ACK", "on"),
            ("FERRY_OFFER_AT_LAUNCH", "off"),
            ("FERRY_FAULTS", "skip-ack-wait:1"),
        ],
    );
    assert!(
        !r.ok && r.stderr.contains("expected stamp"),
        "{}\n{}",
        r.stdout,
        r.stderr
    );
    let args = [
        "--n",
        "96",
        "--nb",
        "24",
        "--iters",
        "12",
        "--devices",
        "emu:1",
        "--overlap",
    ];
    let env = [
        ("FERRY_EMU_DELAY_US", "300"),
        ("FERRY_TRANSFER_PATH", "ipc"),
        ("FERRY_RENAME_SENT", "off"),
    ];
    let (on, off) = stencil_on_off(2, &args, &env, "FERRY_DEVICE_ACK", "device-ack-stencil");
    let one = run_json("stencil", 1, &args, &env, "device-ack-stencil-one");
    assert_eq!(on["checksum"], one["checksum"]);
    assert_eq!(off["checksum"], one["checksum"]);
    assert!(on["acked_on_device"].as_u64().unwrap() > 0, "{on}");
    assert_eq!(off["acked_on_device"].as_u64(), Some(0), "{off}");
    // Under `auto` (the default), a stencil task rewrites one sent edge at a time on two
    // ranks: it waits for the host acknowledgement.
    let mut e = env.to_vec();
    e.push(("FERRY_DEVICE_ACK", "auto"));
    let auto = run_json("stencil", 2, &args, &e, "device-ack-stencil-auto");
    assert_eq!(auto["checksum"], one["checksum"]);
    assert_eq!(auto["acked_on_device"].as_u64(), Some(0), "{auto}");
}

/// Renaming past sends: the stencil's edges (write-only, double-buffered, each sent to the
/// neighbour) are written into fresh copies while the previous sends still read the old ones;
/// same bits as without, on the routes whose sends end with the peer's acknowledgement (ipc)
/// or with their last message (staged, host), on 2 and 3 ranks; with it off nothing is renamed.
#[test]
fn renaming_past_sends_gives_the_same_bits() {
    let args = small_overlap("emu:1");
    let one = run_json("stencil", 1, &args, &[], "rename-one");
    for (np, path) in [(2, "ipc"), (3, "staged"), (2, "host")] {
        let env = [("FERRY_EMU_DELAY_US", "100"), ("FERRY_TRANSFER_PATH", path)];
        let (on, off) = stencil_on_off(np, &args, &env, "FERRY_RENAME_SENT", &format!("rename-{path}"));
        assert_eq!(on["checksum"], one["checksum"], "{path}");
        assert_eq!(off["checksum"], one["checksum"], "{path}");
        assert!(on["renamed"].as_u64().unwrap() > 0, "{path}: {on}");
        assert_eq!(off["renamed"].as_u64(), Some(0), "{path}: {off}");
    }
}

/// `stencil --anchor` needs CUDA devices: elsewhere it says so, runs as without it (same bits)
/// and records no anchor.
#[test]
fn stencil_anchor_without_cuda_is_skipped_with_a_message() {
    let args = [
        "--n",
        "64",
        "--mb",
        "32",
        "--nb",
        "64",
        "--iters",
        "6",
        "--overlap",
        "--devices",
        "emu:1",
    ];
    let plain = stencil(2, &args);
    let out = tmp("stencil-anchor-emu.json");
    let o = out.to_string_lossy().into_owned();
    let mut a = args.to_vec();
    a.extend_from_slice(&["--anchor", "--json", &o]);
    let r = mpirun(2, &bin("stencil"), &a, &[]);
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("--anchor needs CUDA devices"), "{}", r.stderr);
    assert!(!r.stdout.contains("anchor "), "{}", r.stdout);
    let rec = json(&out);
    assert_eq!(rec["checksum"], plain["checksum"]);
    assert!(
        rec["anchor_seconds"].is_null() && rec["anchor_concurrent_seconds"].is_null(),
        "{rec}"
    );
}

fn expect_error(exe: &str, args: &[&str], np: usize, needle: &str) {
    let r = mpirun(np, &bin(exe), args, &[]);
    assert!(!r.ok, "{exe} {args:?} must fail");
    assert!(
        r.stderr.contains(needle),
        "{exe} {args:?}: expected {needle:?} in\n{}",
        r.stderr
    );
    assert!(
        !r.stdout.contains("GFLOP/s") && !r.stdout.contains("cell updates"),
        "no work may start: {}",
        r.stdout
    );
}

#[test]
fn bad_arguments_fail_before_any_work() {
    expect_error("cholesky", &["--n", "0"], 1, "--n must be at least 1");
    expect_error(
        "cholesky",
        &["--n", "100", "--nb", "200"],
        1,
        "--nb 200 must be between 1 and n = 100",
    );
    expect_error(
        "cholesky",
        &["--n", "100", "--nb", "10", "--grid", "3x3"],
        2,
        "--grid 3x3 needs 9 ranks but the job has 2",
    );
    expect_error(
        "cholesky",
        &["--points", "no/such/file.csv", "--count", "10"],
        1,
        "no such file",
    );
    expect_error("cholesky", &["--n", "100", "--devices", "gpu"], 1, "--devices");
    expect_error("cholesky", &["--n", "100", "--frobnicate"], 1, "--frobnicate");
    expect_error("cholesky", &["--n", "100", "--grid", "2y2"], 1, "expected PxQ");
    expect_error("stencil", &["--n", "100", "--nb", "50", "--alpha", "0.3"], 1, "stable");
    expect_error("stencil", &["--n", "10", "--nb", "11"], 1, "nb ≤ n");
}

// ---- Devices (emulated: CI has no GPU; the CUDA paths are checked on the GPU machine) ----

/// GPU-capable tasks on 1 and 2 emulated devices per rank, 1–3 ranks: results equal the
/// sequential run (odd tasks run on devices, even ones on CPU workers, so tiles move both ways).
#[test]
fn oracle_on_emulated_devices() {
    for (np, k, seeds) in [(1, 1, 60..63), (1, 2, 63..66), (2, 2, 66..69), (3, 1, 69..71)] {
        let devices = format!("emu:{k}");
        oracle(np, seeds, &[], &[("FERRY_DEVICES", devices.as_str())]);
    }
}

/// Device acknowledgements on random graphs (emulated devices over IPC, completions up to
/// 300 µs late, part writes among the modes): a task released on an acknowledgement that ran
/// before its tile's pull, or a part writer released without waiting for the sends its group
/// follows, changes the hashes. Under `on` some tasks are released that way on these seeds.
#[test]
fn oracle_with_device_acknowledgements() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    for ack in ["on", "auto"] {
        let mut acked = 0;
        for seed in 66..70 {
            let env = [
                ("FERRY_DEVICES", "emu:1"),
                ("FERRY_TRANSFER_PATH", "ipc"),
                ("FERRY_EMU_DELAY_US", "300"),
                ("FERRY_DEVICE_ACK", ack),
            ];
            let r = mpirun(2, &exe, &["--seed", &seed.to_string(), "--tasks", "250"], &env);
            assert!(
                r.ok && r.stdout.contains("oracle ok"),
                "{ack} seed {seed}\n{}\n{}",
                r.stdout,
                r.stderr
            );
            let n = r
                .stdout
                .split("acked_on_device=")
                .nth(1)
                .and_then(|s| s.trim().parse::<u64>().ok());
            acked += n.unwrap_or_else(|| panic!("no count: {}", r.stdout));
        }
        if ack == "on" {
            assert!(acked > 0, "no task was released on a device acknowledgement");
        }
    }
}

/// Devices with room for a few tiles, allocation failures and late completions injected: the
/// GPU manager evicts, writes back and waits, and the results stay exact.
#[test]
fn oracle_under_device_memory_pressure_and_faults() {
    for (np, k, mem, seed) in [
        (1, 1, "1K", 80),
        (1, 2, "2K", 81),
        (2, 1, "1K", 82),
        (2, 2, "3K", 83),
        (3, 2, "2K", 84),
    ] {
        let devices = format!("emu:{k}");
        let env = [
            ("FERRY_DEVICES", devices.as_str()),
            ("FERRY_DEVICE_MEM", mem),
            ("FERRY_EMU_FAIL_ALLOC", "2,3,5,8,13,21,34"),
            ("FERRY_EMU_DELAY_US", "150"),
        ];
        oracle(np, seed..seed + 2, &[], &env);
    }
}

#[test]
fn cholesky_on_emulated_devices_matches_cpu() {
    let cpu = cholesky(1, &["--n", "400", "--nb", "64", "--devices", "none"]);
    for (np, dev) in [(1, "emu:1"), (1, "emu:2"), (2, "emu:2"), (3, "emu:1")] {
        let rec = cholesky(np, &["--n", "400", "--nb", "64", "--devices", dev, "--check", "exact"]);
        assert!(rec["residual"].as_f64().unwrap() < 1.0, "np={np} {dev}: {rec}");
        let (a, b) = (cpu["logdet"].as_f64().unwrap(), rec["logdet"].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-9 * a.abs(), "np={np} {dev}: log det {b} vs CPU {a}");
    }
}

/// A tile produced on a device and consumed there is never staged out: on one emulated device,
/// the generated matrix is produced and factorized on the device, and only the diagonal tiles
/// the log-determinant reads come back (7 tiles of 64×64 doubles, the last 16×16).
#[test]
fn device_resident_tiles_are_not_staged_out() {
    let rec = cholesky(
        1,
        &["--n", "400", "--nb", "64", "--devices", "emu:1", "--check", "none"],
    );
    let diag: u64 = 6 * 64 * 64 * 8 + 16 * 16 * 8;
    assert_eq!(path_bytes(&rec, "h2d"), 0, "nothing starts on the host: {rec}");
    assert_eq!(
        path_bytes(&rec, "d2h"),
        diag,
        "only the diagonal tiles leave the device: {rec}"
    );
}

/// Room for 5 tiles of 128×128 doubles on the device, 8×8 tiles of matrix: eviction and
/// write-back carry the factorization, and it stays exact.
#[test]
fn cholesky_out_of_core_on_a_small_emulated_device() {
    let r = mpirun(
        1,
        &bin("cholesky"),
        &["--n", "1000", "--nb", "128", "--devices", "emu:1", "--check", "exact"],
        &[("FERRY_DEVICE_MEM", "640K")],
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("residual"), "{}", r.stdout);
    let evictions: u64 = r
        .stdout
        .lines()
        .filter(|l| l.contains("emu0"))
        // The device row ends with: tasks, ahead, evictions, writebacks, cleanings, oom, waits.
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len().checked_sub(5).and_then(|k| f[k].parse::<u64>().ok())
        })
        .sum();
    assert!(evictions > 0, "the device must have evicted:\n{}", r.stdout);
}

#[test]
fn task_larger_than_the_device_is_a_clear_error() {
    let r = mpirun(
        1,
        &bin("cholesky"),
        &["--n", "512", "--nb", "128", "--devices", "emu:1"],
        &[("FERRY_DEVICE_MEM", "200K")],
    );
    assert!(!r.ok);
    assert!(
        r.stderr.contains("needs") && r.stderr.contains("bytes of device memory"),
        "{}",
        r.stderr
    );
}

#[test]
fn stencil_on_emulated_devices_is_bit_identical_to_cpu() {
    let cpu = stencil(1, &["--n", "120", "--nb", "30", "--iters", "15", "--devices", "none"]);
    for (np, dev) in [(1, "emu:1"), (1, "emu:2"), (2, "emu:2"), (3, "emu:1")] {
        let rec = stencil(np, &["--n", "120", "--nb", "30", "--iters", "15", "--devices", dev]);
        assert_eq!(rec["checksum"], cpu["checksum"], "np={np} {dev}");
    }
}

#[test]
fn missing_cuda_is_reported_not_panicked() {
    let r = mpirun(
        1,
        &bin("stencil"),
        &["--n", "64", "--nb", "32", "--devices", "cuda"],
        &[],
    );
    assert!(!r.ok);
    assert!(
        r.stderr.contains("no CUDA driver") || r.stderr.contains("no GPU"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
}

/// The coherence checker (FERRY_CHECK_COHERENCE) hashes every copy where it changes hands;
/// under eviction, write-back, peer copies and injected faults it must find nothing stale.
#[test]
fn coherence_checker_finds_nothing_stale() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    for (np, seed) in [(1, 100), (1, 101), (2, 102), (3, 103)] {
        let env = [
            ("FERRY_DEVICES", "emu:2"),
            ("FERRY_DEVICE_MEM", "2K"),
            ("FERRY_CHECK_COHERENCE", "1"),
            ("FERRY_EMU_DELAY_US", "100"),
            ("FERRY_EMU_FAIL_ALLOC", "3,9,27"),
            ("FERRY_LOG", "error"),
            // Half of the runs with launch-ahead, whose early successors the checker must see
            // through too.
            ("FERRY_LAUNCH_AHEAD", if seed % 2 == 1 { "on" } else { "off" }),
        ];
        let r = mpirun(np, &exe, &["--seed", &seed.to_string()], &env);
        assert!(
            r.ok && r.stdout.contains("oracle ok"),
            "np={np} seed={seed}\n{}\n{}",
            r.stdout,
            r.stderr
        );
        assert!(!r.stderr.contains("coherence:"), "stale data found:\n{}", r.stderr);
    }
}

/// Host buffers come from the registered host pool while it has room and from pageable memory
/// after; a pool of 4 KiB forces both within one run, and results stay exact.
#[test]
fn oracle_with_a_tiny_host_pool() {
    for (np, seed) in [(1, 90), (2, 91)] {
        let env = [
            ("FERRY_DEVICES", "emu:2"),
            ("FERRY_HOST_PINNED_BYTES", "4K"),
            ("FERRY_DEVICE_MEM", "2K"),
        ];
        oracle(np, seed..seed + 2, &[], &env);
    }
}

/// A task that never returns on rank 1: the watchdog on every rank reports what it waits for
/// and the job ends with an error within the limit (plus start-up), instead of hanging.
#[test]
fn watchdog_turns_a_hang_into_an_error() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let t0 = Instant::now();
    let r = mpirun(
        2,
        &exe,
        &["--seed", "5", "--stall-rank", "1"],
        &[("FERRY_WATCHDOG_S", "3")],
    );
    assert!(!r.ok, "a hung run must fail");
    assert!(r.stderr.contains("watchdog: no progress for 3 s"), "{}", r.stderr);
    assert!(
        r.stderr.contains("unfinished") && r.stderr.contains("MPI:"),
        "the report names what is waited for:\n{}",
        r.stderr
    );
    assert!(t0.elapsed() < Duration::from_secs(60), "took {:?}", t0.elapsed());
}

/// A rank killed mid-run: the others do not hang; the job ends within seconds and the launcher
/// names the rank that died. (The watchdog is off here, so the launcher's handling is what is
/// tested.)
#[test]
fn a_killed_rank_ends_the_job_quickly() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    // Seed 5 puts the stalled task on rank 1; `--tasks 301` (same first 300 tasks) makes the
    // command line unique, to find the rank processes (not mpirun, whose line starts with it).
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-np", "2"]);
    if unsafe_is_root() {
        cmd.arg("--allow-run-as-root");
    }
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

/// `FERRY_TRACE=DIR` writes one Chrome trace per rank, with a span per task body, per transfer
/// and per GPU lifecycle stage, a span per submission-window stall, and a track per thread.
#[test]
fn traces_are_written_per_rank() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let dir = tmp("traces");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    let r = mpirun(
        2,
        &exe,
        &["--seed", "3", "--tasks", "60"],
        &[("FERRY_TRACE", d.as_str()), ("FERRY_SUBMIT_WINDOW", "2")],
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    for rank in 0..2 {
        let path = dir.join(format!("trace-rank{rank}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let events: Vec<serde_json::Value> = serde_json::from_str(&text).expect("a JSON array of trace events");
        let named = |n: &str| events.iter().filter(|e| e["name"] == n).count();
        assert!(
            named("task") > 0 && named("transfer") > 0,
            "rank {rank}: task and transfer spans expected"
        );
        // A window of two nodes fills at once: the inserting thread's waits are spans too.
        assert!(
            named("submit.window_full") > 0,
            "rank {rank}: submission window stalls expected in the trace"
        );
        assert!(
            events.iter().any(|e| e["args"]["name"] == "ferry-mpi"),
            "rank {rank}: the MPI thread has a track"
        );
    }
}

/// The merged trace of a 2-rank stencil on emulated devices: one process per rank, a track per
/// thread, a track per device stream; every step kernel is on an exec stream's track, with a
/// start and a duration on the trace's clock, inside the run.
#[test]
fn merged_trace_has_a_track_per_thread_and_stream() {
    let dir = tmp("traces-streams");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    let (n, nb, iters) = (64usize, 16usize, 6usize);
    let args = [
        "--n",
        &n.to_string(),
        "--nb",
        &nb.to_string(),
        "--iters",
        &iters.to_string(),
        "--devices",
        "emu:2",
    ]
    .map(|s| s.to_string());
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let rec = run_json("stencil", 2, &a, &[("FERRY_TRACE", d.as_str())], "trace-streams");
    let reference = stencil(1, &["--n", "64", "--nb", "16", "--iters", "6", "--devices", "none"]);
    assert_eq!(rec["checksum"], reference["checksum"], "tracing changed the result");
    let merged = ferry_trace::merge_dir(&dir).expect("the traces merge");
    assert_eq!(merged.ranks.len(), 2);
    assert!(
        merged.shifts.iter().all(|(_, s)| s.is_some()),
        "every rank marks the common instant: {:?}",
        merged.shifts
    );
    let ev = &merged.events;
    // Each rank measured its clock against rank 0's by ping-pong: after the merge, its mark's
    // own time is rank 0's time at that instant, and the round trip kept is plausible.
    let num = |v: &serde_json::Value| v.as_f64().or_else(|| v.as_str()?.parse().ok());
    for rank in 0..2u64 {
        let mark = ev
            .iter()
            .find(|e| e["pid"] == rank && e["cat"] == ferry_trace::CLOCK_CATEGORY)
            .unwrap_or_else(|| panic!("rank {rank}: no clock mark"));
        let (at, r0, rtt) = (
            num(&mark["args"]["ts_us"]),
            num(&mark["args"]["ref_us"]),
            num(&mark["args"]["rtt_us"]),
        );
        let (Some(at), Some(r0), Some(rtt)) = (at, r0, rtt) else {
            panic!("rank {rank}: clock mark without ts_us, ref_us and rtt_us: {mark}");
        };
        assert!(
            (at - r0).abs() < 1e-3,
            "rank {rank}: mark at {at} µs is not rank 0's {r0} µs"
        );
        assert!((0.0..1e5).contains(&rtt), "rank {rank}: round trip {rtt} µs");
        if rank == 0 {
            assert_eq!(merged.shifts[0].1, Some(0.0), "rank 0 is the reference");
        }
    }
    for rank in 0..2u64 {
        let of_rank = |e: &&serde_json::Value| e["pid"] == rank;
        assert!(
            ev.iter()
                .filter(of_rank)
                .any(|e| e["name"] == "process_name" && e["args"]["name"] == format!("rank {rank}")),
            "rank {rank} is a process"
        );
        let tracks: Vec<&str> = ev
            .iter()
            .filter(of_rank)
            .filter(|e| e["name"] == "thread_name")
            .filter_map(|e| e["args"]["name"].as_str())
            .collect();
        for t in ["ferry-gpu", "ferry-mpi", "emu:0 in", "emu:1 in"] {
            assert!(tracks.contains(&t), "rank {rank}: no `{t}` track in {tracks:?}");
        }
        assert!(
            tracks.iter().any(|t| t.starts_with("emu:0 exec")) && tracks.iter().any(|t| t.starts_with("emu:1 exec")),
            "rank {rank}: exec stream tracks of both devices expected in {tracks:?}"
        );
        // Each rank owns half of the tiles; every step task ran on an exec stream.
        let steps: Vec<&serde_json::Value> = ev
            .iter()
            .filter(of_rank)
            .filter(|e| e["ph"] == "X" && e["name"] == "step")
            .collect();
        let tiles = (n / nb) * (n / nb);
        assert_eq!(
            steps.len(),
            iters * tiles / 2,
            "rank {rank}: one kernel span per step task"
        );
        let end = ev
            .iter()
            .filter(of_rank)
            .filter(|e| e["ph"] != "X")
            .filter_map(|e| e["ts"].as_f64())
            .fold(0.0, f64::max);
        for s in &steps {
            let (ts, dur) = (s["ts"].as_f64().unwrap(), s["dur"].as_f64().unwrap());
            assert!(
                ts > 0.0 && dur >= 0.0 && ts + dur <= end + 1e3,
                "rank {rank}: span {s} outside the run"
            );
        }
        // Stage-ins moved the initial tiles onto the devices.
        assert!(
            ev.iter()
                .filter(of_rank)
                .any(|e| e["ph"] == "X" && e["name"] == "stage-in" && e["args"]["bytes"].as_u64() > Some(0)),
            "rank {rank}: stage-in spans expected"
        );
    }
}

/// Faults the runtime is meant to absorb — late and reordered MPI completions, perturbed worker
/// timing, a slow link, late device completions and failing device allocations — leave every
/// result exact: the oracle on 1–4 ranks, and both examples.
#[test]
fn absorbable_faults_leave_results_exact() {
    for (np, faults, seed) in [
        (2, "mpi-delay:300", 110),
        (3, "sched-jitter:200", 111),
        (4, "slow-link:100", 112),
        (2, "mpi-delay:200,sched-jitter:100,slow-link:200", 113),
        (1, "sched-jitter:300", 114),
    ] {
        oracle(np, seed..seed + 2, &[], &[("FERRY_FAULTS", faults)]);
    }
    let env = [
        ("FERRY_FAULTS", "mpi-delay:200,sched-jitter:100"),
        ("FERRY_EMU_DELAY_US", "100"),
        ("FERRY_EMU_FAIL_ALLOC", "2,5,9"),
    ];
    let out = tmp("faults-cholesky.json");
    let o = out.to_string_lossy().into_owned();
    let r = mpirun(
        3,
        &bin("cholesky"),
        &["--n", "300", "--nb", "64", "--devices", "emu:2", "--json", &o],
        &env,
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert!(json(&out)["residual"].as_f64().unwrap() < 1.0);
    let reference = stencil(1, &["--n", "100", "--nb", "25", "--iters", "10", "--devices", "none"]);
    let out = tmp("faults-stencil.json");
    let o = out.to_string_lossy().into_owned();
    let r = mpirun(
        2,
        &bin("stencil"),
        &[
            "--n",
            "100",
            "--nb",
            "25",
            "--iters",
            "10",
            "--devices",
            "emu:1",
            "--json",
            &o,
        ],
        &env,
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert_eq!(
        json(&out)["checksum"],
        reference["checksum"],
        "faults changed the stencil's bits"
    );
}

#[test]
fn malformed_fault_list_is_refused() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let r = mpirun(1, &exe, &[], &[("FERRY_FAULTS", "disk-full:1")]);
    assert!(!r.ok);
    assert!(r.stderr.contains("FERRY_FAULTS item \"disk-full:1\""), "{}", r.stderr);
}

// ---- Transfer paths between ranks (issue 4): each forced in turn on emulated devices ----

const NETWORK_PATHS: [&str; 5] = ["host-eager", "host-rendezvous", "staged", "gpu-direct", "ipc"];

/// The network bytes of a record go to `want` only.
fn assert_only_path(rec: &serde_json::Value, want: &[&str], what: &str) {
    for p in NETWORK_PATHS {
        let b = path_bytes(rec, p);
        if want.contains(&p) {
            continue;
        }
        assert_eq!(b, 0, "{what}: {b} bytes on {p}, expected only {want:?}: {rec}");
    }
    let on: u64 = want.iter().map(|p| path_bytes(rec, p)).sum();
    assert!(on > 0, "{what}: no bytes on {want:?}: {rec}");
}

/// Every payload path, forced on every pair, gives the CPU run's results — Cholesky (log det and
/// residual), the stencil (bit-identical checksum) — and carries all of the network bytes (the
/// tiles that cross are device-resident, so no host path is needed). Chunks of 4 KiB through a
/// pool of two, so staged tiles of 32 KiB go in 8 pipelined chunks.
#[test]
fn each_transfer_path_gives_the_cpu_results() {
    let chol = ["--n", "400", "--nb", "64", "--check", "exact"];
    let cpu = run_json("cholesky", 1, &[&chol[..], &["--devices", "none"]].concat(), &[], "cpu");
    let sten = ["--n", "120", "--nb", "30", "--iters", "12"];
    let sten_cpu = run_json("stencil", 1, &[&sten[..], &["--devices", "none"]].concat(), &[], "cpu");
    for (path, counted) in [
        ("host", &["host-eager", "host-rendezvous"][..]),
        ("staged", &["staged"][..]),
        ("gpu-direct", &["gpu-direct"][..]),
        ("ipc", &["ipc"][..]),
    ] {
        let env = [
            ("FERRY_TRANSFER_PATH", path),
            ("FERRY_GPU_DIRECT", "force"),
            ("FERRY_BOUNCE_CHUNK", "4K"),
            ("FERRY_BOUNCE_BYTES", "8K"),
        ];
        for (np, dev) in [(2, "emu:1"), (3, "emu:2")] {
            let what = format!("cholesky {path} np={np} {dev}");
            let rec = run_json(
                "cholesky",
                np,
                &[&chol[..], &["--devices", dev]].concat(),
                &env,
                &format!("{path}-{dev}"),
            );
            assert!(rec["residual"].as_f64().unwrap() < 1.0, "{what}: {rec}");
            let (a, b) = (cpu["logdet"].as_f64().unwrap(), rec["logdet"].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-9 * a.abs(), "{what}: log det {b} vs CPU {a}");
            assert_only_path(&rec, counted, &what);
            let what = format!("stencil {path} np={np} {dev}");
            let rec = run_json(
                "stencil",
                np,
                &[&sten[..], &["--devices", dev]].concat(),
                &env,
                &format!("{path}-{dev}"),
            );
            assert_eq!(rec["checksum"], sten_cpu["checksum"], "{what}");
            // The initial edges are written by a CPU task (host-resident), so the first step's
            // halo exchange legitimately goes the host path under gpu-direct and ipc; every later
            // step's edges are device-resident and must take the forced path.
            let host = path_bytes(&rec, "host-eager") + path_bytes(&rec, "host-rendezvous");
            if path == "gpu-direct" || path == "ipc" {
                let forced = path_bytes(&rec, path);
                assert!(host * 5 < forced, "{what}: {host} host bytes against {forced}: {rec}");
                let mut only = counted.to_vec();
                only.extend(["host-eager", "host-rendezvous"]);
                assert_only_path(&rec, &only, &what);
            } else {
                assert_only_path(&rec, counted, &what);
            }
        }
    }
}

/// The control ring: between emulated ranks of one node on the IPC and gpu-direct routes, the
/// descriptors and acknowledgements go through shared memory (`control-ring`) and none over
/// MPI (`control`); with `FERRY_CONTROL_RING=off` the very same messages go over MPI.
/// Results are the same either way (the stencil's checksum bit for bit, Cholesky's log det), on
/// 2 and 3 ranks; over IPC every tile moved costs a descriptor and an acknowledgement (40 + 8
/// bytes) at least.
#[test]
fn control_messages_take_the_ring_between_ranks_of_a_node() {
    let chol = ["--n", "400", "--nb", "64", "--check", "exact", "--devices", "emu:1"];
    let sten = ["--n", "120", "--nb", "30", "--iters", "12", "--devices", "emu:1"];
    for path in ["ipc", "gpu-direct"] {
        for np in [2, 3] {
            for (exe, args) in [("stencil", &sten[..]), ("cholesky", &chol[..])] {
                let what = format!("{exe} {path} np={np}");
                // gpu-direct's start-up self-check sends over MPI whatever the ring says (its
                // bytes count on `control`): the IPC runs go without it.
                let direct = if path == "ipc" { "off" } else { "force" };
                let run = |ring: &str| {
                    let env = [
                        ("FERRY_TRANSFER_PATH", path),
                        ("FERRY_GPU_DIRECT", direct),
                        ("FERRY_CONTROL_RING", ring),
                    ];
                    run_json(exe, np, args, &env, &format!("ring-{ring}-{path}"))
                };
                let (on, off) = (run("on"), run("off"));
                for key in ["checksum", "logdet"] {
                    assert_eq!(on[key], off[key], "{what}: {key}");
                }
                assert_eq!(
                    path_messages(&on, "control"),
                    0,
                    "{what}: MPI control with the ring: {on}"
                );
                assert_eq!(path_messages(&off, "control-ring"), 0, "{what}: ring while off: {off}");
                let ring = (path_messages(&on, "control-ring"), path_bytes(&on, "control-ring"));
                let mpi = (path_messages(&off, "control"), path_bytes(&off, "control"));
                assert!(ring.0 > 0, "{what}: nothing on the ring: {on}");
                assert_eq!(ring.0, mpi.0, "{what}: the ring carried other messages than MPI did");
                if path == "ipc" {
                    assert_eq!(ring.1, mpi.1, "{what}: the ring carried other bytes than MPI did");
                    let tiles = path_messages(&on, "ipc");
                    assert!(tiles > 0, "{what}: {on}");
                    assert!(
                        ring.0 >= 2 * tiles && ring.1 >= 48 * tiles,
                        "{what}: {ring:?} for {tiles} tiles"
                    );
                }
            }
        }
    }
}

/// The random-graph oracle (CPU and GPU tasks mixed, so tiles cross from host and device memory
/// alike) under each forced path, with its own traffic prediction checked; then with devices that
/// hold only a few tiles and injected allocation failures (comm-in must never hold device memory
/// for data that is not yet coming: two ranks whose pools fill with each other's pending
/// receives deadlock — the first version of comm-in did).
#[test]
fn oracle_under_each_transfer_path() {
    for path in ["host", "staged", "gpu-direct", "ipc"] {
        for (np, mem, seeds) in [
            (2, "256M", 0..2),
            (4, "256M", 2..3),
            (2, "1K", 82..84),
            (3, "2K", 84..85),
        ] {
            oracle(
                np,
                seeds,
                &[],
                &[
                    ("FERRY_DEVICES", "emu:2"),
                    ("FERRY_DEVICE_MEM", mem),
                    ("FERRY_EMU_FAIL_ALLOC", "2,3,5,8,13,21,34"),
                    ("FERRY_TRANSFER_PATH", path),
                    ("FERRY_GPU_DIRECT", "force"),
                    ("FERRY_BOUNCE_CHUNK", "4K"),
                    ("FERRY_BOUNCE_BYTES", "8K"),
                    ("FERRY_WATCHDOG_S", "60"),
                ],
            );
        }
    }
}

/// `transfer` staged, 64 MiB tiles, two in flight, from an emulated device to one.
const STAGED_64_MIB: [&str; 10] = [
    "--devices",
    "emu:1",
    "--paths",
    "staged",
    "--sizes",
    "64M",
    "--inflight",
    "2",
    "--volume",
    "64M",
];

/// The staged transfers of [`two_bounce_buffers_move_64_mib_tiles`] ([`STAGED_64_MIB`]), through
/// 1 MiB chunks, with device memory `mem`.
fn staged_64_mib(mem: &str, tag: &str) -> serde_json::Value {
    run_json(
        "transfer",
        2,
        &STAGED_64_MIB,
        &[
            ("FERRY_BOUNCE_CHUNK", "1M"),
            ("FERRY_BOUNCE_BYTES", "2M"),
            ("FERRY_DEVICE_MEM", mem),
            ("FERRY_HOST_PINNED_BYTES", "64M"),
        ],
        tag,
    )
}

/// (peak bytes, pageable buffers) of the pinned host pool of `rank`, from a `transfer` record.
fn host_pool(rec: &serde_json::Value, rank: usize) -> (u64, u64) {
    let r = &rec["host_pool"][rank];
    (r[0].as_u64().unwrap(), r[1].as_u64().unwrap())
}

/// A bounce pool of two 1 MiB chunks moves 64 MiB tiles, two in flight, device to device, and
/// every stamp arrives (the emulated sink checks it); host memory taken by staging stays within
/// the pool on the sender, and within 4 chunks per arriving tile on the receiver: no receive
/// lands a whole tile in host memory (64 MiB tiles in a 64 MiB pinned pool would go pageable),
/// and receives posted ahead take nothing until their data comes (10 posted: 40 MiB if each took
/// its 4 chunks at once; two arrive at a time: 8 MiB).
#[test]
fn two_bounce_buffers_move_64_mib_tiles() {
    let rec = staged_64_mib("512M", "bounce");
    let (peak, pageable) = host_pool(&rec, 1);
    assert_eq!(pageable, 0, "receiver's host buffers went pageable: {rec}");
    assert!(peak > 0 && peak <= 16 << 20, "receiver's pinned peak {peak}: {rec}");
    let row = &rec["rows"][0];
    assert_eq!(row["path"], "staged", "{rec}");
    let sent = row["sent"].as_array().unwrap();
    assert_eq!(sent.len(), 1, "{rec}");
    assert_eq!(sent[0][0], "staged");
    assert_eq!(sent[0][1].as_u64().unwrap(), 5 * 2 * (64 << 20), "{rec}");
    let peak = rec["bounce_peak"][0].as_u64().unwrap();
    assert!(peak > 0 && peak <= 2 << 20, "bounce peak {peak}: {rec}");
    // Both ranks' GPU managers and MPI threads did work for every transfer, each counted on its
    // own thread (the MPI thread's busy time once overwrote the GPU manager's).
    for key in ["manager_us", "mpi_us"] {
        for r in 0..2 {
            let us = row[key][r].as_f64().unwrap();
            assert!(us > 0.0, "{key}[{r}] = {us}: {rec}");
        }
    }
    assert_ne!(row["manager_us"], row["mpi_us"], "{rec}");
}

/// A staged receive of many chunks whose consumer's device cannot take the tile when its first
/// chunk lands (100 MiB of device memory, two 64 MiB tiles in flight, each pinned until its sink
/// has read it) goes on into the tile's host buffer — visible as whole-tile buffers that no
/// longer fit the 64 MiB pinned pool — and every stamp still arrives (the sink checks each).
#[test]
fn a_staged_receive_without_device_room_lands_on_the_host() {
    let rec = staged_64_mib("100M", "bounce-host");
    let row = &rec["rows"][0];
    assert_eq!(row["sent"][0][0], "staged", "{rec}");
    assert_eq!(row["sent"][0][1].as_u64().unwrap(), 5 * 2 * (64 << 20), "{rec}");
    let (_, pageable) = host_pool(&rec, 1);
    assert!(pageable > 0, "no receive fell back to the host: {rec}");
}

/// A device copy of a staged transfer that fails — the sender's device→host copy of a chunk
/// into a bounce buffer, the receiver's upload of a chunk (both ranks fail their k-th copy) —
/// ends the run on both ranks with that error, at once: the sender still sends the chunk and the
/// receiver still takes every chunk, so neither waits for a message that never comes (before,
/// the job hung until the watchdog).
#[test]
fn a_failed_staged_copy_ends_the_run_with_its_error() {
    let exe = bin("transfer");
    for k in ["3", "40", "150"] {
        let t0 = Instant::now();
        let r = mpirun(
            2,
            &exe,
            &STAGED_64_MIB,
            &[
                ("FERRY_EMU_FAIL_COPY", k),
                ("FERRY_BOUNCE_CHUNK", "1M"),
                ("FERRY_BOUNCE_BYTES", "2M"),
                ("FERRY_DEVICE_MEM", "512M"),
                ("FERRY_WATCHDOG_S", "60"),
            ],
        );
        let secs = t0.elapsed().as_secs_f64();
        assert!(!r.ok, "copy {k} failed, the run did not:\n{}", r.stdout);
        let said = format!("injected failure of copy {k} (FERRY_EMU_FAIL_COPY)");
        assert!(r.stderr.contains(&said), "copy {k}: {}", r.stderr);
        assert!(
            !r.stderr.contains("watchdog"),
            "copy {k}: ended by the watchdog:\n{}",
            r.stderr
        );
        assert!(secs < 30.0, "copy {k}: {secs:.1} s to end");
    }
}

/// `transfer --tasks per-tile,per-round` on emulated devices: with a task per tile and with one
/// stamp and one sink task per round (each stamping and reading half the tiles in flight), every
/// stamp arrives (the emulated sink checks each tile it reads, and fails the run otherwise) and
/// every byte the measurement counts went on the forced path, for an even and an odd depth.
#[test]
fn per_round_tasks_move_every_tile() {
    for path in ["ipc", "staged"] {
        let rec = run_json(
            "transfer",
            2,
            &[
                "--devices",
                "emu:1",
                "--paths",
                path,
                "--sizes",
                "64K",
                "--inflight",
                "1,5,8",
                "--volume",
                "2M",
                "--tasks",
                "per-tile,per-round",
            ],
            &[],
            &format!("per-round-{path}"),
        );
        let rows = rec["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 6, "{rec}");
        for (row, tasks) in rows.iter().zip(["per-tile"; 3].into_iter().chain(["per-round"; 3])) {
            assert_eq!(row["tasks"], tasks, "{rec}");
            let k = row["inflight"].as_u64().unwrap();
            let rounds = row["rounds"].as_u64().unwrap();
            let transfers = row["transfers"].as_u64().unwrap();
            // Each tile moved `transfers / k` times: in that many rounds with a task per tile,
            // in twice as many with one task per side (the two halves take turns) once there
            // are two tiles to split.
            assert_eq!(transfers % k, 0, "{rec}");
            let halves = if tasks == "per-round" && k > 1 { 2 } else { 1 };
            assert_eq!(rounds, transfers / k * halves, "{rec}");
            let sent = row["sent"].as_array().unwrap();
            assert_eq!(sent.len(), 1, "{rec}");
            assert_eq!(sent[0][0], path, "{rec}");
            assert_eq!(sent[0][1].as_u64().unwrap(), transfers * (64 << 10), "{rec}");
        }
    }
}

/// Small IPC pulls (emulated pools in shared memory): every byte goes by IPC, runs of pulls go
/// in batches, every consumer is launched behind its pull, and the consumer's GPU-manager time
/// is broken down by phase only when `FERRY_GPU_PHASES` asks for it.
#[test]
fn ipc_pulls_are_batched_and_the_consumer_timed_by_phase() {
    let args = [
        "--devices",
        "emu:1",
        "--paths",
        "ipc",
        "--sizes",
        "64K",
        "--inflight",
        "8",
        "--volume",
        "4M",
    ];
    for phases in ["on", "off"] {
        let rec = run_json(
            "transfer",
            2,
            &args,
            &[("FERRY_GPU_PHASES", phases)],
            &format!("phases-{phases}"),
        );
        let row = &rec["rows"][0];
        let sent = row["sent"].as_array().unwrap();
        assert_eq!(sent.len(), 1, "{rec}");
        assert_eq!(sent[0][0], "ipc");
        // One untimed round, then the timed ones: the measurement counts the timed rounds.
        let rounds = row["rounds"].as_u64().unwrap();
        assert_eq!(sent[0][1].as_u64().unwrap(), rounds * 8 * (64 << 10), "{rec}");
        let share = row["batched"][0].as_f64().unwrap();
        assert!(share > 0.0 && share <= 1.0, "batched share {share}: {rec}");
        let us: Vec<f64> = row["consumer_phases_us"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[1].as_f64().unwrap())
            .collect();
        assert_eq!(us.len(), 6, "{rec}");
        assert!(us.iter().all(|&x| x >= 0.0), "{rec}");
        if phases == "on" {
            // Each pull is enqueued (copies), each consumer launched (launch), polled and
            // finalized.
            for (k, name) in [(0, "launch"), (2, "finalize"), (3, "poll"), (4, "copies")] {
                assert!(us[k] > 0.0, "{name}: {rec}");
            }
        } else {
            assert!(us.iter().all(|&x| x == 0.0), "timed while off: {rec}");
        }
    }
}

#[test]
fn gpu_direct_on_is_refused_when_mpi_cannot_take_device_memory() {
    let r = mpirun(
        2,
        &bin("stencil"),
        &["--n", "64", "--nb", "32", "--iters", "2", "--devices", "emu:1"],
        &[("FERRY_GPU_DIRECT", "on")],
    );
    assert!(!r.ok, "must be refused:\n{}", r.stdout);
    assert!(
        r.stderr.contains("FERRY_GPU_DIRECT=on") && r.stderr.contains("never hands device pointers"),
        "{}",
        r.stderr
    );
    // Forcing the GPU-direct path without GPU-direct is refused too, naming the pair.
    let r = mpirun(
        2,
        &bin("stencil"),
        &["--n", "64", "--nb", "32", "--iters", "2", "--devices", "emu:1"],
        &[("FERRY_TRANSFER_PATH", "gpu-direct")],
    );
    assert!(!r.ok);
    assert!(r.stderr.contains("between ranks"), "{}", r.stderr);
}

// ---- Task Bench (issue 8) ----

/// Every Task Bench pattern on 1–4 ranks: each task checks that its inputs hold the
/// `(timestep − 1, dependency)` pairs their producers wrote (a wrong dependency or transfer fails
/// the run), the tile transfers equal what the graph implies (one per version and consuming
/// rank; `taskbench` fails otherwise), and the summary's counts equal the MPI baseline's.
#[test]
fn taskbench_patterns_validate_on_one_to_four_ranks() {
    let patterns = [
        "trivial",
        "no_comm",
        "stencil_1d",
        "stencil_1d_periodic",
        "dom",
        "tree",
        "fft",
        "all_to_all",
        "nearest",
        "spread",
        "random_nearest",
    ];
    let total = |out: &str, key: &str| -> String {
        out.lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_else(|| panic!("no {key} in\n{out}"))
            .to_string()
    };
    for (k, pattern) in patterns.iter().enumerate() {
        let np = 1 + k % 4;
        // Two graphs at once (-and), with scratch memory and a wider output on the second.
        let args = [
            "-steps",
            "9",
            "-width",
            "7",
            "-type",
            pattern,
            "-radix",
            "3",
            "-kernel",
            "busy_wait",
            "-iter",
            "50",
            "-and",
            "-steps",
            "5",
            "-width",
            "5",
            "-type",
            "stencil_1d",
            "-output",
            "48",
            "-kernel",
            "memory_bound",
            "-scratch",
            "1024",
            "-iter",
            "3",
        ];
        let r = mpirun(np, &bin("taskbench"), &args, &[]);
        assert!(r.ok, "taskbench {pattern} np={np} failed\n{}\n{}", r.stdout, r.stderr);
        assert!(r.stdout.contains("Transfers"), "{}", r.stdout);
        // The inserting thread's share is part of the elapsed time.
        let secs = |key: &str| -> f64 {
            let line = r.stdout.lines().find(|l| l.starts_with(key)).expect(key);
            line[key.len()..]
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .expect(key)
        };
        let (ins, el) = (secs("Insertion Time"), secs("Elapsed Time"));
        assert!(ins > 0.0 && ins <= el, "insertion {ins} s of {el} s\n{}", r.stdout);
        let m = mpirun(np, &bin("taskbench-mpi"), &args, &[]);
        assert!(
            m.ok,
            "taskbench-mpi {pattern} np={np} failed\n{}\n{}",
            m.stdout, m.stderr
        );
        for key in ["Total Tasks", "Total Dependencies", "Total FLOPs", "Total Bytes"] {
            assert_eq!(total(&r.stdout, key), total(&m.stdout, key), "{pattern}: {key}");
        }
    }
    // Bad command lines are refused with Task Bench's message.
    let r = mpirun(1, &bin("taskbench"), &["-type", "stencil_2d"], &[]);
    assert!(
        !r.ok && r.stderr.contains("Invalid flag \"-type stencil_2d\""),
        "{}",
        r.stderr
    );
}

/// The transfer protocols under reordered and late completions (MPI requests reported up to
/// 300 µs late and out of order, emulated device operations up to 100 µs late, failing device
/// allocations): every path gives exact results — chunks, descriptors and acknowledgements may
/// complete in any order. The routes with control messages run with the control ring too
/// (whose messages the MPI delays do not reach) and without it (whose they do).
#[test]
fn transfer_paths_absorb_late_and_reordered_completions() {
    for (path, ring) in [
        ("staged", "on"),
        ("gpu-direct", "on"),
        ("gpu-direct", "off"),
        ("ipc", "on"),
        ("ipc", "off"),
    ] {
        oracle(
            3,
            120..122,
            &[],
            &[
                ("FERRY_DEVICES", "emu:2"),
                ("FERRY_TRANSFER_PATH", path),
                ("FERRY_CONTROL_RING", ring),
                ("FERRY_GPU_DIRECT", "force"),
                ("FERRY_BOUNCE_CHUNK", "4K"),
                ("FERRY_BOUNCE_BYTES", "8K"),
                ("FERRY_FAULTS", "mpi-delay:300,sched-jitter:100"),
                ("FERRY_EMU_DELAY_US", "100"),
                ("FERRY_EMU_FAIL_ALLOC", "3,7,11"),
            ],
        );
        let r = mpirun(
            2,
            &bin("cholesky"),
            &["--n", "320", "--nb", "64", "--devices", "emu:1", "--check", "exact"],
            &[
                ("FERRY_TRANSFER_PATH", path),
                ("FERRY_CONTROL_RING", ring),
                ("FERRY_GPU_DIRECT", "force"),
                ("FERRY_BOUNCE_CHUNK", "4K"),
                ("FERRY_BOUNCE_BYTES", "8K"),
                ("FERRY_FAULTS", "mpi-delay:300"),
                ("FERRY_EMU_DELAY_US", "100"),
            ],
        );
        assert!(
            r.ok && r.stdout.contains("residual"),
            "{path} ring {ring}:\n{}\n{}",
            r.stdout,
            r.stderr
        );
    }
}

/// A job of mixed ranks — one with two emulated devices and 4 KiB chunks, two CPU-only ones with
/// 12 KiB chunks (each rank's own `FERRY_*` settings, mpirun's MPMD form) — on each route that
/// such a pair can take: the Cholesky stays exact and the oracle's results and traffic match.
/// Chunk sizes travel with the start-up capabilities, so the receivers cut as their senders do
/// (they did not at first: a size mismatch on the first staged tile).
#[test]
fn mixed_device_and_cpu_ranks_with_different_chunk_sizes() {
    for path in ["auto", "staged", "host"] {
        for (exe, args) in [
            (bin("cholesky"), vec!["--n", "400", "--nb", "64", "--check", "exact"]),
            (PathBuf::from(env!("CARGO_BIN_EXE_oracle")), vec!["--seed", "7"]),
        ] {
            let mut cmd = Command::new("mpirun");
            cmd.arg("--oversubscribe");
            if unsafe_is_root() {
                cmd.arg("--allow-run-as-root");
            }
            let exe = exe.to_string_lossy().into_owned();
            let groups = [(1, "emu:2", "4K"), (2, "none", "12K")];
            for (k, (np, devices, chunk)) in groups.iter().enumerate() {
                if k > 0 {
                    cmd.arg(":");
                }
                cmd.args(["-np", &np.to_string()]);
                for (var, val) in [
                    ("FERRY_DEVICES", *devices),
                    ("FERRY_TRANSFER_PATH", path),
                    ("FERRY_BOUNCE_CHUNK", chunk),
                    ("FERRY_BOUNCE_BYTES", "24K"),
                ] {
                    cmd.args(["-x", &format!("{var}={val}")]);
                }
                cmd.arg(&exe).args(&args);
            }
            cmd.current_dir(repo_root())
                .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let out = wait_with_timeout(cmd.spawn().expect("mpirun"));
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && (stdout.contains("residual") || stdout.contains("oracle ok")),
                "{path} {exe}:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// Packed transfers (`FERRY_PACK_BYTES`, off by default): the random-graph oracle on 2–4 ranks,
/// with and without devices, on the host and staged routes, keeps its exact results and its
/// per-tile traffic prediction; Task Bench's all_to_all moves exactly the tiles its graph
/// implies.
#[test]
fn packed_transfers_keep_results_and_traffic() {
    for (np, devices, path) in [
        (2, "none", "auto"),
        (3, "none", "host"),
        (4, "emu:2", "staged"),
        (3, "emu:1", "host"),
    ] {
        oracle(
            np,
            130..132,
            &[],
            &[
                ("FERRY_PACK_BYTES", "64K"),
                ("FERRY_DEVICES", devices),
                ("FERRY_TRANSFER_PATH", path),
            ],
        );
    }
    let r = mpirun(
        2,
        &bin("taskbench"),
        &["-steps", "20", "-width", "8", "-type", "all_to_all", "-output", "256"],
        &[("FERRY_PACK_BYTES", "64K")],
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    let stencil_ref = stencil(1, &["--n", "90", "--nb", "30", "--iters", "6", "--devices", "none"]);
    let out = tmp("packed-stencil.json");
    let o = out.to_string_lossy().into_owned();
    let r = mpirun(
        3,
        &bin("stencil"),
        &[
            "--n",
            "90",
            "--nb",
            "30",
            "--iters",
            "6",
            "--devices",
            "none",
            "--json",
            &o,
        ],
        &[("FERRY_PACK_BYTES", "64K")],
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert_eq!(json(&out)["checksum"], stencil_ref["checksum"]);
}

/// `ferry-info` prints, per rank, the devices, the peer-link matrix, the route to every other
/// rank and the pinned host pool (its size from `FERRY_HOST_PINNED_BYTES`).
#[test]
fn ferry_info_describes_each_rank() {
    let r = mpirun(
        2,
        &bin("ferry-info"),
        &["--devices", "emu:2"],
        &[("FERRY_HOST_PINNED_BYTES", "32M")],
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    for needle in [
        "== rank 0",
        "== rank 1",
        "device 1: emu1",
        "peer links",
        "route to rank 1",
        "route to rank 0",
        "MPI: ",
        "pinned host pool: 32 MiB, 0 MiB of it not pinned yet",
    ] {
        assert!(r.stdout.contains(needle), "{needle:?} missing:\n{}", r.stdout);
    }
}
