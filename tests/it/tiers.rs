//! Memory tiers under mpirun: devices with room for a few tiles, a host budget smaller than the
//! data, a disk tier — results stay those of the CPU run, the traffic between tiers shows in the
//! statistics, spill files are gone afterwards, and what cannot work fails with a clear error.
//! Also the device tier's peer copies: one network transfer per rank, not per device.
//! A generous watchdog bounds every run: a deadlock or livelock fails the test as an error.

mod common;

use common::*;
use std::path::{Path, PathBuf};

/// A fresh, empty spill directory for one test.
fn spill_dir(tag: &str) -> PathBuf {
    let d = tmp(&format!("spill-{tag}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("spill dir");
    d
}

fn assert_empty(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir).expect("spill dir").collect();
    assert!(
        left.is_empty(),
        "spill files left behind in {}: {left:?}",
        dir.display()
    );
}

/// `key=N` from the oracle's summary line.
fn count(stdout: &str, key: &str) -> u64 {
    stdout
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {stdout}"))
}

const WATCHDOG: (&str, &str) = ("FERRY_WATCHDOG_S", "60");

/// The random-graph oracle (≈ 1 KiB of tiles in all) with a host budget of a few tiles and a
/// disk tier, with and without
/// emulated devices of a few tiles, on 1–3 ranks; and with the host tier taken out
/// (`FERRY_LAYERS=device,disk`: every copy nobody uses goes to disk at once).
#[test]
fn oracle_through_host_budget_and_disk() {
    type Env<'a> = &'a [(&'a str, &'a str)];
    let cases: [(usize, Env, u64); 5] = [
        (1, &[("FERRY_HOST_MEM_LIMIT", "400")], 100),
        (2, &[("FERRY_HOST_MEM_LIMIT", "200")], 102),
        (
            3,
            &[
                ("FERRY_HOST_MEM_LIMIT", "128"),
                ("FERRY_DEVICES", "emu:1"),
                ("FERRY_DEVICE_MEM", "2K"),
            ],
            104,
        ),
        (
            2,
            &[
                ("FERRY_HOST_MEM_LIMIT", "200"),
                ("FERRY_DEVICES", "emu:2"),
                ("FERRY_DEVICE_MEM", "2K"),
            ],
            106,
        ),
        (
            2,
            &[
                ("FERRY_LAYERS", "device,disk"),
                ("FERRY_DEVICES", "emu:2"),
                ("FERRY_DEVICE_MEM", "2K"),
            ],
            108,
        ),
    ];
    for (k, (np, env, seed)) in cases.into_iter().enumerate() {
        let dir = spill_dir(&format!("oracle-{k}"));
        let d = dir.to_string_lossy().into_owned();
        let mut env: Vec<(&str, &str)> = env.to_vec();
        env.extend([("FERRY_SPILL_DIR", d.as_str()), WATCHDOG, ("FERRY_EMU_DELAY_US", "50")]);
        for s in [seed, seed + 1] {
            let ss = s.to_string();
            let r = mpirun(
                np,
                &PathBuf::from(env!("CARGO_BIN_EXE_oracle")),
                &["--seed", &ss, "--tasks", "250"],
                &env,
            );
            assert!(
                r.ok && r.stdout.contains("oracle ok"),
                "np={np} {env:?} seed {s}\n{}\n{}",
                r.stdout,
                r.stderr
            );
            assert!(
                count(&r.stdout, "spills") > 0,
                "np={np} {env:?}: nothing spilled\n{}",
                r.stdout
            );
            assert!(
                count(&r.stdout, "loads") > 0,
                "np={np} {env:?}: nothing loaded back\n{}",
                r.stdout
            );
        }
        assert_empty(&dir);
    }
}

fn tier(rec: &serde_json::Value, key: &str) -> u64 {
    rec["tier"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("no tier.{key} in {rec}"))
}

/// Cholesky (8×8 tiles) with devices of 5 tiles and a host budget of 6 tiles over a disk tier,
/// on 1–3 ranks: the log-determinant of the CPU run, disk traffic in the statistics, no spill
/// file left.
#[test]
fn cholesky_out_of_core_through_every_tier() {
    let cpu = run_json(
        "cholesky",
        1,
        &["--n", "1000", "--nb", "128", "--devices", "none"],
        &[],
        "tiers-cpu",
    );
    let want = cpu["logdet"].as_f64().unwrap();
    for np in 1..=3 {
        let dir = spill_dir(&format!("cholesky-{np}"));
        let d = dir.to_string_lossy().into_owned();
        let env = [
            ("FERRY_DEVICE_MEM", "640K"),
            ("FERRY_HOST_MEM_LIMIT", "768K"),
            ("FERRY_SPILL_DIR", d.as_str()),
            WATCHDOG,
        ];
        let args = ["--n", "1000", "--nb", "128", "--devices", "emu:1", "--check", "exact"];
        let rec = run_json("cholesky", np, &args, &env, &format!("tiers-{np}"));
        let got = rec["logdet"].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 1e-9 * want.abs(),
            "np={np}: log det {got} vs CPU {want}"
        );
        assert!(rec["residual"].as_f64().unwrap() < 1.0, "np={np}: {rec}");
        assert!(
            tier(&rec, "spills") > 0 && tier(&rec, "loads") > 0,
            "np={np}: no disk traffic: {}",
            rec["tier"]
        );
        assert!(
            tier(&rec, "spill_bytes") >= tier(&rec, "spills") * 8 * 1000,
            "np={np}: {}",
            rec["tier"]
        );
        assert_empty(&dir);
    }
}

/// The stencil with devices of 6 tiles, CPU-only and on emulated devices, with a host budget and
/// a disk tier: bit-identical to the plain CPU run on 1–3 ranks.
#[test]
fn stencil_through_every_tier_is_bit_identical() {
    let args = ["--n", "128", "--nb", "32", "--iters", "12"];
    let plain = run_json(
        "stencil",
        1,
        &[&args[..], &["--devices", "none"]].concat(),
        &[],
        "tiers-plain",
    );
    let want = plain["checksum"].as_str().unwrap().to_string();
    for (np, dev) in [(1, "emu:1"), (2, "emu:2"), (3, "none")] {
        let dir = spill_dir(&format!("stencil-{np}"));
        let d = dir.to_string_lossy().into_owned();
        let env = [
            ("FERRY_DEVICE_MEM", "48K"),
            ("FERRY_HOST_MEM_LIMIT", "40K"),
            ("FERRY_SPILL_DIR", d.as_str()),
            WATCHDOG,
        ];
        let rec = run_json(
            "stencil",
            np,
            &[&args[..], &["--devices", dev]].concat(),
            &env,
            &format!("tiers-{np}"),
        );
        assert_eq!(rec["checksum"].as_str().unwrap(), want, "np={np} {dev}");
        assert!(tier(&rec, "spills") > 0, "np={np} {dev}: {}", rec["tier"]);
        assert_empty(&dir);
    }
}

/// The snapshot workload: every step's field kept, then read back in reverse. With room on the
/// device and in host memory for a fraction of the snapshots, older ones spill to disk; the
/// backward pass gives the in-memory run's bits, loads spilled snapshots back, and some of them
/// arrive ahead of their task (prefetched).
#[test]
fn snapshots_spill_and_the_backward_pass_is_exact() {
    let args = ["--n", "128", "--nb", "32", "--iters", "20", "--save-snapshots"];
    let plain = run_json(
        "stencil",
        2,
        &[&args[..], &["--devices", "none"]].concat(),
        &[],
        "snap-plain",
    );
    let want = plain["backward"]["checksum"].as_str().unwrap().to_string();
    assert!(plain["backward"]["max_rel_error"].as_f64().unwrap() < 1e-12);
    let dir = spill_dir("snapshots");
    let d = dir.to_string_lossy().into_owned();
    let env = [
        ("FERRY_DEVICE_MEM", "256K"),
        ("FERRY_HOST_MEM_LIMIT", "256K"),
        ("FERRY_SPILL_DIR", d.as_str()),
        WATCHDOG,
    ];
    let rec = run_json(
        "stencil",
        2,
        &[&args[..], &["--devices", "emu:1"]].concat(),
        &env,
        "snap-tiers",
    );
    assert_eq!(rec["backward"]["checksum"].as_str().unwrap(), want);
    assert_eq!(rec["checksum"], plain["checksum"]);
    let b = &rec["backward"];
    let (waited, prefetched) = (b["waited"].as_u64().unwrap(), b["prefetched"].as_u64().unwrap());
    assert!(tier(&rec, "spills") > 0 && waited + prefetched > 0, "{rec}");
    assert!(prefetched > 0, "the backward pass must be prefetched ahead: {b}");
    assert_empty(&dir);
}

/// Runs a Cholesky that must spill with `env` added, and expects it to fail with every one of
/// `needles` in its error, within the watchdog's bound, leaving no spill file.
fn disk_tier_fails(tag: &str, env: &[(&str, &str)], needles: &[&str]) {
    let dir = spill_dir(tag);
    let d = dir.to_string_lossy().into_owned();
    let mut all = vec![
        ("FERRY_HOST_MEM_LIMIT", "64K"),
        ("FERRY_SPILL_DIR", d.as_str()),
        WATCHDOG,
    ];
    all.extend_from_slice(env);
    let args = ["--n", "1000", "--nb", "128", "--devices", "none"];
    let r = mpirun(1, &bin("cholesky"), &args, &all);
    assert!(!r.ok, "{tag}: must fail:\n{}", r.stdout);
    for n in needles {
        assert!(r.stderr.contains(n), "{tag}: {n:?} missing from\n{}", r.stderr);
    }
    assert_empty(&dir);
}

/// A disk tier too small for what must spill: the run ends with an error naming the spill
/// space.
#[test]
fn full_spill_space_is_a_clear_error() {
    disk_tier_fails(
        "full",
        &[("FERRY_SPILL_BYTES", "128K")],
        &["spill space full", "FERRY_SPILL_BYTES"],
    );
}

/// Contradictory tier settings are refused at start-up with the reason.
#[test]
fn tier_settings_are_checked() {
    let r = mpirun(
        1,
        &bin("stencil"),
        &["--n", "64", "--nb", "32", "--iters", "1"],
        &[("FERRY_LAYERS", "device,gpu")],
    );
    assert!(!r.ok && r.stderr.contains("unknown tier"), "{}", r.stderr);
    let r = mpirun(
        1,
        &bin("stencil"),
        &["--n", "64", "--nb", "32", "--iters", "1"],
        &[("FERRY_LAYERS", "device,host"), ("FERRY_SPILL_DIR", "/tmp")],
    );
    assert!(!r.ok && r.stderr.contains("leaves out the disk tier"), "{}", r.stderr);
}

fn devices_sum(rec: &serde_json::Value, key: &str) -> u64 {
    rec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d[key].as_u64().unwrap())
        .sum()
}

fn network_messages(rec: &serde_json::Value) -> u64 {
    rec["paths"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| NETWORK_PATHS.contains(&p["path"].as_str().unwrap()))
        .map(|p| p["messages"].as_u64().unwrap())
        .sum()
}

/// Two emulated devices per rank, 2–3 ranks: a tile a rank receives crosses the network once per
/// rank, not once per device — the messages equal those of one device per rank — and reaches
/// the second device by a peer copy: no host→device copy of data another device held or was
/// staging in. With `FERRY_PEER_COPY=off` (the comparison switch) the same tiles go host→device
/// again, the network traffic is unchanged, and the results are the same.
#[test]
fn one_network_transfer_per_rank_and_peer_copies_between_its_devices() {
    for np in [2, 3] {
        let args = ["--n", "1024", "--nb", "128", "--check", "none"];
        let tag = |t: &str| format!("peer-{np}-{t}");
        let one = run_json(
            "cholesky",
            np,
            &[&args[..], &["--devices", "emu:1"]].concat(),
            &[],
            &tag("one"),
        );
        let two = run_json(
            "cholesky",
            np,
            &[&args[..], &["--devices", "emu:2"]].concat(),
            &[],
            &tag("two"),
        );
        let off = run_json(
            "cholesky",
            np,
            &[&args[..], &["--devices", "emu:2"]].concat(),
            &[("FERRY_PEER_COPY", "off")],
            &tag("off"),
        );
        assert_eq!(
            network_messages(&two),
            network_messages(&one),
            "np={np}: network messages"
        );
        assert_eq!(
            network_messages(&off),
            network_messages(&one),
            "np={np}: network messages (off)"
        );
        assert!(path_bytes(&two, "peer") > 0, "np={np}: no peer copy: {two}");
        assert_eq!(devices_sum(&two, "host_duplicates"), 0, "np={np}: {}", two["devices"]);
        assert_eq!(path_bytes(&off, "peer"), 0, "np={np}: peer copies while off");
        assert!(devices_sum(&off, "host_duplicates") > 0, "np={np}: {}", off["devices"]);
        for rec in [&two, &off] {
            let (a, b) = (one["logdet"].as_f64().unwrap(), rec["logdet"].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-9 * a.abs(), "np={np}: log det {b} vs {a}");
        }
    }
}

/// Launch-ahead on a rank with two devices binds a released successor to its predecessor's
/// device only where its largest data already is. The row-slab stencil (one slab per device)
/// then moves only edge rows between the devices, as without launch-ahead; before, a ring
/// released by the neighbouring slab's ring (through the edge tile they share) ran on the
/// neighbour's device and pulled its whole slab across every step.
#[test]
fn launch_ahead_on_two_devices_moves_only_edges() {
    let base = [
        "--devices",
        "emu:2",
        "--n",
        "256",
        "--mb",
        "128",
        "--nb",
        "256",
        "--iters",
        "50",
        "-q",
    ];
    for overlap in [Some("--overlap=ordered"), Some("--overlap=concurrent"), None] {
        let args: Vec<&str> = base.iter().copied().chain(overlap).collect();
        let overlap = overlap.unwrap_or("plain");
        let tag = |la: &str| format!("la2-{}-{la}", overlap.trim_start_matches("--"));
        let off = run_json("stencil", 1, &args, &[("FERRY_LAUNCH_AHEAD", "off")], &tag("off"));
        let on = run_json("stencil", 1, &args, &[("FERRY_LAUNCH_AHEAD", "on")], &tag("on"));
        assert!(
            on["launched_ahead"].as_u64().unwrap() > 0,
            "{overlap}: nothing launched ahead: {on}"
        );
        assert_eq!(on["checksum"], off["checksum"], "{overlap}");
        let edges = path_bytes(&off, "peer");
        assert!(edges > 0, "{overlap}: no peer copy without launch-ahead: {off}");
        assert_eq!(
            path_bytes(&on, "peer"),
            edges,
            "{overlap}: peer bytes with launch-ahead"
        );
    }
}

/// A failing write to the spill file (injected) ends the run with the disk tier's error, not a
/// hang or a wrong result.
#[test]
fn failing_spill_write_is_a_clear_error() {
    disk_tier_fails(
        "diskfail",
        &[("FERRY_FAULTS", "disk-fail:3")],
        &["injected failure", "disk tier"],
    );
}
