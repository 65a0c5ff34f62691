//! Traces (`Runtime::trace`): replayed sequences give the same results as plain insertion — the
//! random-graph oracle on 1–4 ranks, with epochs, emulated devices under memory pressure and
//! injected faults, each epoch's tasks inserted several times and every repetition after the
//! recording replayed —, the API's refusals, and a replay given a sequence other than its
//! recording fails with an error naming the first differing task, on every rank or on one.

mod common;

use common::*;
use std::path::PathBuf;

/// Runs the oracle with `--repeat 4 --replay` and checks that replay carried the later
/// repetitions: every rank inserts every task, so the ranks replay at least two of the four
/// repetitions of each epoch (the first records; the second records again when the first left
/// the tiles it reads with other holders).
fn oracle_replayed(np: usize, seed: u64, env: &[(&str, &str)]) {
    let tasks = 120u64;
    let args = ["--tasks", "120", "--epochs", "2", "--repeat", "4", "--replay"];
    let out = oracle_ok(np, seed, &args, env);
    let count = |name: &str| number_after(&out, name).unwrap_or_else(|| panic!("no {name} in {out}"));
    let (replayed, records) = (count("replayed_tasks="), count("trace_records="));
    let np = np as u64;
    assert!(
        replayed >= np * 2 * tasks && replayed + records * tasks / 2 == np * 4 * tasks,
        "np={np} seed={seed}: {replayed} tasks replayed, {records} recordings\n{out}"
    );
}

#[test]
fn oracle_replays_bit_exact_on_one_to_four_ranks() {
    for (np, seed) in [(1, 200), (2, 201), (3, 202), (4, 203)] {
        oracle_replayed(np, seed, &[("FERRY_WORKERS", "2")]);
    }
}

/// Emulated devices with room for a few tiles, failed allocations and late completions: the
/// replayed graph's receives land on devices, tiles are evicted and written back, and the
/// results stay exact.
#[test]
fn oracle_replays_under_device_memory_pressure_and_faults() {
    for (np, seed) in [(1, 210), (2, 211), (3, 212)] {
        oracle_replayed(
            np,
            seed,
            &[
                ("FERRY_DEVICES", "emu:2"),
                ("FERRY_DEVICE_MEM", "2K"),
                ("FERRY_EMU_FAIL_ALLOC", "2,3,5,8,13,21,34"),
                ("FERRY_EMU_DELAY_US", "100"),
                ("FERRY_FAULTS", "mpi-delay:200,sched-jitter:100"),
            ],
        );
    }
}

/// The stencil traced against untraced, bit for bit, with the recordings and replays counted; the
/// refusals inside a trace; a replay that ends early (`trace_checks`).
#[test]
fn trace_api_checks() {
    for (np, devices) in [(1, "none"), (2, "none"), (3, "none"), (1, "emu:1"), (2, "emu:1")] {
        trace_checks(np, &[], &[("FERRY_DEVICES", devices)], "trace checks ok");
    }
}

/// Runs `trace_checks` with `args` on `np` ranks (a run failed on purpose does not abort) and
/// checks that it succeeds and prints `expect`.
fn trace_checks(np: usize, args: &[&str], env: &[(&str, &str)], expect: &str) {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_trace_checks"));
    let mut env = env.to_vec();
    env.push(("FERRY_ABORT_ON_ERROR", "0"));
    let r = mpirun(np, &exe, args, &env);
    assert!(
        r.ok && r.stdout.contains(expect),
        "np={np} {args:?} {env:?}\n{}\n{}",
        r.stdout,
        r.stderr
    );
}

/// The last repetition differs from the recording on every rank: each rank's replay fails at
/// the same task, naming it as inserted and as recorded.
#[test]
fn a_replay_that_differs_everywhere_names_the_task() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let args = [
        "--seed",
        "7",
        "--tasks",
        "120",
        "--repeat",
        "3",
        "--replay",
        "--replay-differs=-1",
    ];
    for np in [1, 2] {
        let r = mpirun(np, &exe, &args, &[]);
        assert!(!r.ok, "a replay of another sequence must fail\n{}", r.stdout);
        assert!(
            r.stderr.contains("trace 0 does not replay its recording"),
            "{}",
            r.stderr
        );
        // 120 tasks in 2 epochs: the middle task of an epoch's 60.
        assert!(r.stderr.contains("task 30 of the sequence is `mix"), "{}", r.stderr);
        assert!(r.stderr.contains("the recording has `mix"), "{}", r.stderr);
    }
}

/// The last repetition differs on rank 1 only: rank 1's replay fails and says why, and the job
/// ends (the failed rank aborts it at shutdown, `FERRY_ABORT_ON_ERROR`) instead of leaving the
/// other ranks waiting for transfers rank 1 never posts.
#[test]
fn a_replay_that_differs_on_one_rank_ends_the_job() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let args = [
        "--seed",
        "8",
        "--tasks",
        "120",
        "--repeat",
        "3",
        "--replay",
        "--replay-differs",
        "1",
    ];
    for np in [2, 3] {
        let r = mpirun(np, &exe, &args, &[]);
        assert!(!r.ok, "a replay of another sequence must fail\n{}", r.stdout);
        assert!(
            r.stderr.contains("oracle: error on rank 1") && r.stderr.contains("does not replay its recording"),
            "{}",
            r.stderr
        );
    }
}

/// The stencil with every step traced is bit-identical to the single-rank untraced run (CPU
/// workers, emulated devices, `--overlap`'s part writes), its later steps replayed.
#[test]
fn stencil_replayed_is_bit_identical() {
    let reference = stencil(1, &["--n", "150", "--nb", "40", "--iters", "25"]);
    let sum = reference["checksum"].as_str().unwrap().to_string();
    for (np, nb, devices, overlap) in [
        (1, "40", "none", None),
        (2, "33", "none", None),
        (3, "40", "emu:2", Some("--overlap=concurrent")),
        (4, "33", "none", Some("--overlap=ordered")),
    ] {
        let mut args = vec![
            "--n",
            "150",
            "--nb",
            nb,
            "--iters",
            "25",
            "--devices",
            devices,
            "--replay",
        ];
        args.extend(overlap);
        let rec = stencil(np, &args);
        assert_eq!(rec["checksum"].as_str().unwrap(), sum, "np={np} {args:?}");
        let tiles = 150usize.div_ceil(nb.parse().unwrap()).pow(2);
        let per_step = tiles * if overlap.is_some() { 2 } else { 1 };
        // Steps 0 and 1 record, the other 23 replay, on every rank.
        assert_eq!(
            rec["replayed_tasks"].as_u64().unwrap(),
            (np * 23 * per_step) as u64,
            "np={np} {args:?}"
        );
    }
}

/// Repeated factorizations, the first recorded and the others replayed, give the untraced
/// run's log det and residual exactly, on CPU workers and emulated devices.
#[test]
fn cholesky_replayed_is_bit_identical() {
    for (np, devices) in [(2, "none"), (3, "emu:2")] {
        let base = ["--n", "600", "--nb", "64", "--reps", "3", "--devices", devices];
        let plain = cholesky(np, &base);
        let mut args = base.to_vec();
        args.push("--replay");
        let traced = cholesky(np, &args);
        for field in ["logdet", "residual"] {
            assert_eq!(plain[field], traced[field], "np={np} {devices}: {field}");
        }
        assert_eq!(plain["replayed_tasks"].as_u64(), Some(0));
        // 10 tile columns: 10 potrf, 45 trsm, 45 syrk, 120 gemm per factorization; two replayed.
        assert_eq!(
            traced["replayed_tasks"].as_u64(),
            Some(np as u64 * 2 * 220),
            "np={np} {devices}"
        );
    }
}

/// On one rank with one (emulated) device, every replayed step of the stencil runs as one fused
/// launch, and on a CPU rank as one static graph on the workers, bit-identical to the untraced
/// run; `FERRY_TRACE_GRAPHS=off` replays task by task, and what cannot fuse does not: part
/// writes (`--overlap`), two devices, tiles larger than half the device pool, a CPU rank with
/// the coherence check.
#[test]
fn stencil_fused_replays_are_bit_identical() {
    let base = ["--n", "150", "--nb", "40", "--iters", "25"];
    let reference = stencil(1, &base);
    let sum = reference["checksum"].as_str().unwrap().to_string();
    let tiles = 150usize.div_ceil(40).pow(2) as u64;
    let with = |extra: &[&'static str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(&["--replay"]);
        args.extend_from_slice(extra);
        args
    };
    /// Arguments, environment, replays fused (steps 2..25, or none).
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, u64);
    let cases: [Case; 8] = [
        (with(&["--devices", "emu:1"]), vec![], 23),
        // A CPU rank: each replay a static graph on the workers.
        (with(&["--devices", "none"]), vec![("FERRY_WORKERS", "2")], 23),
        (with(&["--devices", "none"]), vec![("FERRY_TRACE_GRAPHS", "off")], 0),
        // A coherence check keeps host buffers replaceable: no fusion on the CPU.
        (with(&["--devices", "none"]), vec![("FERRY_CHECK_COHERENCE", "1")], 0),
        (with(&["--devices", "emu:1"]), vec![("FERRY_TRACE_GRAPHS", "off")], 0),
        (with(&["--devices", "emu:1", "--overlap=concurrent"]), vec![], 0),
        (with(&["--devices", "emu:2"]), vec![], 0),
        // 16 tiles of 40×40 doubles and their edges: more than half of 256 KiB.
        (with(&["--devices", "emu:1"]), vec![("FERRY_DEVICE_MEM", "256K")], 0),
    ];
    for (args, env, fused) in cases {
        let rec = stencil_env(1, &args, &env);
        assert_eq!(rec["checksum"].as_str().unwrap(), sum, "{args:?} {env:?}");
        assert_eq!(
            rec["replayed_tasks"].as_u64(),
            Some(
                23 * tiles
                    * if args.iter().any(|a| a.starts_with("--overlap")) {
                        2
                    } else {
                        1
                    }
            ),
            "{args:?} {env:?}"
        );
        assert_eq!(rec["fused_replays"].as_u64(), Some(fused), "{args:?} {env:?}");
        assert_eq!(rec["fused_tasks"].as_u64(), Some(fused * tiles), "{args:?} {env:?}");
    }
}

/// The Cholesky's replayed factorizations fused into one task each, on one emulated device (one
/// launch) and on the CPU workers (a static graph): the untraced log det and residual exactly.
#[test]
fn cholesky_fused_replays_are_bit_identical() {
    for devices in ["emu:1", "none"] {
        let base = ["--n", "600", "--nb", "64", "--reps", "3", "--devices", devices];
        let plain = cholesky(1, &base);
        let mut args = base.to_vec();
        args.push("--replay");
        let fused = cholesky(1, &args);
        for field in ["logdet", "residual"] {
            assert_eq!(plain[field], fused[field], "{devices}: {field}");
        }
        assert_eq!(fused["fused_replays"].as_u64(), Some(2), "{devices}");
        assert_eq!(fused["fused_tasks"].as_u64(), Some(2 * 220), "{devices}");
    }
}

/// A body that fails inside a fused replay fails the run with an error naming it: on a CPU
/// rank its class and sequence number, on an emulated device its class inside the launch.
#[test]
fn a_failure_inside_a_fused_replay_names_the_task() {
    for devices in ["none", "emu:1"] {
        trace_checks(
            1,
            &["--fail-in-fused"],
            &[("FERRY_DEVICES", devices), ("FERRY_WORKERS", "2")],
            "fused failure reported: class ",
        );
    }
}

/// The oracle with every task GPU-capable and no part writes, on one rank with one emulated
/// device, failed allocations, late completions and scheduling jitter: every replayed
/// repetition runs as one fused launch and the results stay exact; with a device pool too small
/// for an epoch's tiles (more than half of it), nothing fuses and the results stay exact. On a
/// CPU rank with two workers and scheduling jitter, every replayed repetition runs as one static
/// graph, exact.
#[test]
fn oracle_fused_replays_are_bit_exact_under_faults() {
    let args = [
        "--tasks",
        "120",
        "--epochs",
        "2",
        "--repeat",
        "4",
        "--replay",
        "--fusable",
    ];
    let device = |mem| {
        vec![
            ("FERRY_DEVICES", "emu:1"),
            ("FERRY_DEVICE_MEM", mem),
            ("FERRY_EMU_FAIL_ALLOC", "2,3,5,8,13"),
            ("FERRY_EMU_DELAY_US", "100"),
            ("FERRY_FAULTS", "sched-jitter:100"),
        ]
    };
    // A CPU rank with two workers, whose fused replays run their tasks in parallel.
    let cpu = vec![
        ("FERRY_DEVICES", "none"),
        ("FERRY_WORKERS", "2"),
        ("FERRY_FAULTS", "sched-jitter:100"),
    ];
    for (mem, env, fused) in [("64K", device("64K"), 6), ("2K", device("2K"), 0), ("cpu", cpu, 6)] {
        let out = oracle_ok(1, 220, &args, &env);
        let count = |name: &str| number_after(&out, name).unwrap_or_else(|| panic!("no {name} in {out}"));
        // Two epochs of 60 tasks, each recorded once and replayed three times.
        assert_eq!(count("replayed_tasks="), 360, "{mem}\n{out}");
        assert_eq!(count("fused_replays="), fused, "{mem}\n{out}");
        assert_eq!(count("fused_tasks="), fused * 60, "{mem}\n{out}");
    }
}
