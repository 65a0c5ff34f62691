//! Transfer paths between ranks (issue 4), forced on emulated devices, measured with the
//! `transfer` driver: staged transfers of 64 MiB tiles through two bounce buffers (host memory
//! bounded, a receive without device room landing on the host, a failed chunk copy ending the run
//! at once), tasks per tile and per round, and batched IPC pulls with the consumer timed by
//! phase.

mod common;

use common::*;
use std::time::Instant;

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
