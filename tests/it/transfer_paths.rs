//! Transfer paths between ranks (issue 4): each forced in turn on emulated devices. Every path
//! gives the CPU results and carries the network bytes, control messages take the ring between
//! ranks of a node, late and reordered completions are absorbed, ranks with and without devices
//! mix, packed transfers keep results and traffic, and a path a pair cannot use is refused.

mod common;

use common::*;
use std::path::PathBuf;
use std::process::Stdio;

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
        ("host", &["host-eager", "host-rendezvous", "host-ring"][..]),
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
            let host =
                path_bytes(&rec, "host-eager") + path_bytes(&rec, "host-rendezvous") + path_bytes(&rec, "host-ring");
            if path == "gpu-direct" || path == "ipc" {
                let forced = path_bytes(&rec, path);
                assert!(host * 5 < forced, "{what}: {host} host bytes against {forced}: {rec}");
                let mut only = counted.to_vec();
                only.extend(["host-eager", "host-rendezvous", "host-ring"]);
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
            let (mut cmd, _session) = mpirun_command();
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

/// Small host tiles take the ring between ranks of a node: the stencil in 6 × 6 tiles on CPU
/// ranks sends halo edges of 48 bytes, each in one ring slot (`host-ring`), and whole tiles
/// (288 bytes, past a slot) over MPI. With `FERRY_CONTROL_RING=off`, or `FERRY_EAGER_BYTES`
/// under the edge's size, the same edges go over MPI. The checksum is the one-rank run's bit
/// for bit every way, and every way moves the same bytes between ranks, on 2 and 3 ranks.
#[test]
fn small_host_tiles_take_the_ring_between_ranks_of_a_node() {
    let sten = ["--n", "48", "--nb", "6", "--iters", "10", "--devices", "none"];
    let one = run_json("stencil", 1, &sten, &[], "tile-ring-1");
    let net = |rec: &serde_json::Value| -> u64 { NETWORK_PATHS.iter().map(|p| path_bytes(rec, p)).sum() };
    for np in [2, 3] {
        let on = run_json("stencil", np, &sten, &[], "tile-ring-on");
        let off = run_json("stencil", np, &sten, &[("FERRY_CONTROL_RING", "off")], "tile-ring-off");
        let not_eager = run_json("stencil", np, &sten, &[("FERRY_EAGER_BYTES", "32")], "tile-ring-eager");
        for (what, rec) in [("on", &on), ("off", &off), ("eager 32", &not_eager)] {
            assert_eq!(rec["checksum"], one["checksum"], "np={np} ring {what}: {rec}");
        }
        let ring = (path_messages(&on, "host-ring"), path_bytes(&on, "host-ring"));
        assert!(
            ring.0 > 0 && ring.1 == 48 * ring.0,
            "np={np}: edges of 48 bytes on the ring: {ring:?} {on}"
        );
        assert_eq!(path_bytes(&off, "host-ring"), 0, "np={np}: ring off: {off}");
        assert_eq!(
            path_bytes(&not_eager, "host-ring"),
            0,
            "np={np}: eager limit under the edge: {not_eager}"
        );
        assert_eq!(net(&on), net(&off), "np={np}: the same bytes cross either way");
        assert_eq!(net(&on), net(&not_eager), "np={np}: the same bytes cross either way");
        assert_eq!(
            path_bytes(&off, "host-eager") + path_bytes(&off, "host-rendezvous"),
            path_bytes(&on, "host-eager") + path_bytes(&on, "host-rendezvous") + ring.1,
            "np={np}: what the ring carries went over MPI without it"
        );
    }
}
