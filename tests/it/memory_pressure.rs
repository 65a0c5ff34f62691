//! Memory pressure on devices (emulated: CI has no GPU; the CUDA paths are checked on the GPU
//! machine) and in the pinned host pool: devices with room for a few tiles and failing
//! allocations evict, write back and wait with exact results and nothing stale for the coherence
//! checker; a task larger than the device is a clear error; a tiny host pool falls back to pageable
//! memory.

mod common;

use common::*;
use std::path::PathBuf;

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
