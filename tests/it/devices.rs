//! Devices (emulated: CI has no GPU; the CUDA paths are checked on the GPU machine): the oracle,
//! Cholesky and the stencil on 1–2 emulated devices per rank give the CPU results, device-resident
//! tiles are not staged out, a missing CUDA driver is an error, and `ferry-info` describes each
//! rank's devices and routes.

mod common;

use common::*;
use std::path::PathBuf;

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
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
            acked += n.unwrap_or_else(|| panic!("no count: {}", r.stdout));
        }
        if ack == "on" {
            assert!(acked > 0, "no task was released on a device acknowledgement");
        }
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
