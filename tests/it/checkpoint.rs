//! Checkpoint and restart under mpirun: the stochastic stencil (per-tile Philox generator states
//! kept in tiles, on emulated devices) checkpointed every few steps and restarted from each
//! checkpoint, on other rank counts and without devices, ends bit-identical to the uninterrupted
//! run; the checkpoint of device-resident tiles adds no more host memory than a small constant
//! beyond the bounce pool; every kind of bad checkpoint is refused with a clear error.

mod common;

use common::*;
use std::path::{Path, PathBuf};

const ARGS: [&str; 7] = ["--nb", "128", "--iters", "12", "--noise", "0.01", "-q"];
/// The grid size, separate so that a test can restart on another.
const N: [&str; 2] = ["--n", "512"];
/// A bounce pool of four 64 KiB buffers: a field tile (128 KiB) takes two pieces.
const SMALL_POOL: [(&str, &str); 2] = [("FERRY_BOUNCE_BYTES", "256K"), ("FERRY_BOUNCE_CHUNK", "64K")];

fn run(np: usize, extra: &[&str], tag: &str) -> serde_json::Value {
    let args: Vec<&str> = ARGS.iter().chain(&N).chain(extra).copied().collect();
    run_json("stencil", np, &args, &SMALL_POOL, tag)
}

fn fresh_dir(tag: &str) -> PathBuf {
    let d = tmp(&format!("ckpt-{tag}"));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A checkpointed run whose checkpoints the other tests use.
fn checkpointed(tag: &str) -> (PathBuf, serde_json::Value) {
    let dir = fresh_dir(tag);
    let d = dir.to_string_lossy().into_owned();
    let rec = run(
        2,
        &["--devices", "emu:1", "--checkpoint-every", "4", "--checkpoint-dir", &d],
        &format!("ckpt-{tag}"),
    );
    (dir, rec)
}

#[test]
fn restarts_are_bit_identical_on_any_rank_count() {
    let plain = run(2, &["--devices", "emu:1"], "plain");
    let want = plain["checksum"].as_str().unwrap().to_string();
    let (dir, rec) = checkpointed("restart");
    assert_eq!(rec["checksum"].as_str().unwrap(), want, "checkpointing changed the run");
    let cps = rec["checkpoints"].as_array().unwrap();
    assert_eq!(cps.len(), 2, "steps 4 and 8: {rec}");
    for c in cps {
        // The fields are device-resident: they go through the bounce pool, not a host mirror
        // (rank 0 owns 1 MiB of field tiles alone).
        let (added, dev) = (c["host_added"].as_u64().unwrap(), c["from_device"].as_u64().unwrap());
        assert!(dev >= 1 << 20, "device bytes checkpointed: {c}");
        assert!(
            added <= 256 << 10,
            "host memory added {added} bytes, more than the bounce pool: {c}"
        );
    }
    for (np, dev, step) in [
        (1, "none", 4),
        (2, "emu:1", 8),
        (3, "emu:1", 4),
        (3, "none", 8),
        (4, "emu:2", 8),
    ] {
        let from = dir.join(format!("step-{step}"));
        let f = from.to_string_lossy().into_owned();
        let r = run(
            np,
            &["--devices", dev, "--restart", &f],
            &format!("restart-{np}-{dev}-{step}"),
        );
        assert_eq!(r["restarted_from"].as_u64(), Some(step));
        assert_eq!(
            r["checksum"].as_str().unwrap(),
            want,
            "restart np={np} {dev} from step {step}"
        );
    }
}

/// Copies a checkpoint directory, lets `spoil` damage the copy, and expects the restart to fail
/// with `needle` in its error.
fn refused(from: &Path, tag: &str, spoil: impl FnOnce(&Path), extra: &[&str], needle: &str) {
    let bad = fresh_dir(tag);
    std::fs::create_dir_all(&bad).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), bad.join(e.file_name())).unwrap();
    }
    spoil(&bad);
    let b = bad.to_string_lossy().into_owned();
    let mut args: Vec<&str> = ARGS.to_vec();
    args.extend_from_slice(if extra.is_empty() { &N } else { extra });
    args.extend_from_slice(&["--devices", "none", "--restart", &b]);
    let r = mpirun(2, &bin("stencil"), &args, &SMALL_POOL);
    assert!(!r.ok, "{tag}: a bad checkpoint was accepted\n{}", r.stdout);
    assert!(r.stderr.contains(needle), "{tag}: expected {needle:?} in\n{}", r.stderr);
}

fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b);
    std::fs::write(path, b).unwrap();
}

#[test]
fn bad_checkpoints_are_refused_clearly() {
    let (dir, _) = checkpointed("bad");
    let good = dir.join("step-4");
    refused(
        &good,
        "truncated",
        |d| edit(&d.join("rank-1.ckpt"), |b| b.truncate(b.len() - 100)),
        &[],
        "truncated",
    );
    refused(
        &good,
        "flipped",
        |d| edit(&d.join("rank-0.ckpt"), |b| b[4096 + 1000] ^= 0x04),
        &[],
        "corrupt (checksum mismatch)",
    );
    refused(
        &good,
        "version",
        |d| {
            edit(&d.join("rank-0.ckpt"), |b| {
                b[8..12].copy_from_slice(&2u32.to_le_bytes());
                let c = crc32fast::hash(&b[0..36]);
                b[36..40].copy_from_slice(&c.to_le_bytes());
            })
        },
        &[],
        "format version 2",
    );
    refused(
        &good,
        "missing",
        |d| std::fs::remove_file(d.join("rank-1.ckpt")).unwrap(),
        &[],
        "rank 1's file is missing",
    );
    refused(
        &good,
        "foreign",
        |d| {
            std::fs::copy(dir.join("step-8/rank-1.ckpt"), d.join("rank-1.ckpt"))
                .map(|_| ())
                .unwrap()
        },
        &[],
        "truncated or replaced",
    );
    refused(&good, "shape", |_| {}, &["--n", "500"], "does not match the program");
    refused(
        &good,
        "manifest",
        |d| std::fs::remove_file(d.join("manifest.ckpt")).unwrap(),
        &[],
        "cannot read the manifest",
    );
}

/// Checkpoint into a caller's buffer: device data straight into it (the heap grows by a small
/// constant, not by the data), a corrupted or truncated buffer refused with nothing changed, the
/// intact one restored; on 1 and 2 ranks with emulated devices.
#[test]
fn checkpoint_into_a_buffer_and_back() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_ckpt_buffer"));
    for np in [1, 2] {
        let r = mpirun(
            np,
            &exe,
            &[],
            &[("FERRY_DEVICES", "emu:1"), ("FERRY_ABORT_ON_ERROR", "0")],
        );
        assert!(
            r.ok && r.stdout.contains("ckpt_buffer ok"),
            "np={np}\n{}\n{}",
            r.stdout,
            r.stderr
        );
        let added = number_after(&r.stdout, "at most ").expect("heap figure");
        // Rank 0 holds at least 256 KiB of tiles (16 tiles of 32 KiB over ≤ 2 ranks).
        assert!(
            added < 64 << 10,
            "np={np}: the heap grew by {added} bytes during the checkpoint"
        );
    }
}
