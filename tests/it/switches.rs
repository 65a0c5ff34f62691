//! The launch and transfer switches, each on and off on emulated devices: launch-ahead, comm-in
//! ahead, stream affinity, offers at launch, device acknowledgements and renaming past sends give
//! the same bits (or the same results) as without them, and do happen when on, never when off.
//! Also the idle-thread switch (`FERRY_YIELD_WHEN_IDLE`) and who drives MPI progress
//! (`FERRY_MPI_PROGRESS`): chosen for a rank per core, reported.

mod common;

use common::*;

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

/// `ferry-info` on `np` ranks with extra mpirun arguments (`--bind-to ...`) and variables.
fn info_run(np: usize, mpirun_args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let (mut cmd, _session) = mpirun_command();
    cmd.args(["-np", &np.to_string()]).args(mpirun_args);
    for (k, _) in env {
        cmd.args(["-x", k]);
    }
    cmd.arg(bin("ferry-info"))
        .envs(env.iter().copied())
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .current_dir(repo_root())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = wait_with_timeout(cmd.spawn().expect("mpirun"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A rank per core (two ranks bound to a core each) makes idle threads yield their cores, and
/// rank 0 says so once; `FERRY_YIELD_WHEN_IDLE=off` keeps them spinning, and a value it does not
/// know is refused; a rank whose worker and inserting thread each have a core spins
/// (`ferry_base::idle::oversubscribed`).
#[test]
fn idle_threads_yield_on_a_rank_per_core() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores >= 2 {
        let (ok, stdout, stderr) = info_run(2, &["--bind-to", "core"], &[]);
        assert!(ok, "{stdout}\n{stderr}");
        assert_eq!(
            stdout.matches("idle threads: yield their cores").count(),
            2,
            "each rank has one core:\n{stdout}"
        );
        assert_eq!(
            stderr
                .matches("idle threads yield their cores instead of spinning")
                .count(),
            1,
            "rank 0 says so once:\n{stderr}"
        );
        // Their idle workers drive MPI progress, the progress thread a backstop.
        assert_eq!(
            stdout
                .matches("MPI progress: driven by idle workers, the progress thread a backstop")
                .count(),
            2,
            "{stdout}"
        );
        // Their idle workers give way to the inserting thread, which runs ready tasks itself.
        assert_eq!(
            stdout
                .matches("inserting thread: runs ready tasks between insertions")
                .count(),
            2,
            "{stdout}"
        );
        // Asked for, the progress thread alone.
        let (ok, stdout, stderr) = info_run(2, &["--bind-to", "core"], &[("FERRY_MPI_PROGRESS", "thread")]);
        assert!(ok, "{stdout}\n{stderr}");
        assert_eq!(
            stdout.matches("MPI progress: the progress thread").count(),
            2,
            "{stdout}"
        );
        // One rank, one worker, unbound: the worker and the inserting thread have a core each.
        let (ok, stdout, stderr) = info_run(1, &["--bind-to", "none"], &[("FERRY_WORKERS", "1")]);
        assert!(ok, "{stdout}\n{stderr}");
        assert!(stdout.contains("idle threads: spin"), "{stdout}");
        assert!(stdout.contains("inserting thread: inserts only"), "{stdout}");
    }
    let (ok, stdout, stderr) = info_run(2, &["--bind-to", "core"], &[("FERRY_YIELD_WHEN_IDLE", "off")]);
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("idle threads: spin").count(), 2, "{stdout}");
    assert!(!stderr.contains("yield their cores"), "{stderr}");
    // Threads that spin have cores: the progress thread drives MPI alone, unless asked.
    assert_eq!(
        stdout.matches("MPI progress: the progress thread").count(),
        2,
        "{stdout}"
    );
    let (ok, stdout, stderr) = info_run(
        2,
        &["--bind-to", "core"],
        &[("FERRY_YIELD_WHEN_IDLE", "off"), ("FERRY_MPI_PROGRESS", "shared")],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.matches("MPI progress: driven by idle workers").count(),
        2,
        "{stdout}"
    );
    let (ok, _, stderr) = info_run(1, &[], &[("FERRY_MPI_PROGRESS", "workers")]);
    assert!(!ok);
    assert!(stderr.contains("expected auto, thread or shared"), "{stderr}");

    let (ok, _, stderr) = info_run(1, &[], &[("FERRY_YIELD_WHEN_IDLE", "sometimes")]);
    assert!(!ok);
    assert!(stderr.contains("expected auto, on or off"), "{stderr}");
    let (ok, _, stderr) = info_run(1, &[], &[("FERRY_INSERTER_HELPS", "often")]);
    assert!(!ok);
    assert!(
        stderr.contains("FERRY_INSERTER_HELPS") && stderr.contains("expected auto, on or off"),
        "{stderr}"
    );
}

/// The inserting thread's scheduling points (`FERRY_INSERTER_HELPS`): on 1–3 CPU ranks of one
/// worker each, with it on and off, the stencil gives the one-rank bits; on, the inserting
/// threads do run tasks, off they run none.
#[test]
fn the_inserting_thread_runs_ready_tasks_with_the_same_bits() {
    let args = ["--n", "48", "--nb", "6", "--iters", "10", "--devices", "none"];
    let one = run_json("stencil", 1, &args, &[("FERRY_INSERTER_HELPS", "off")], "helps-one");
    for np in [1, 2, 3] {
        let (on, off) = stencil_on_off(np, &args, &[("FERRY_WORKERS", "1")], "FERRY_INSERTER_HELPS", "helps");
        assert_eq!(on["checksum"], one["checksum"], "np={np}: {on}");
        assert_eq!(off["checksum"], one["checksum"], "np={np}: {off}");
        assert!(on["inserter_jobs"].as_u64().unwrap() > 0, "np={np}: {on}");
        assert_eq!(off["inserter_jobs"].as_u64(), Some(0), "np={np}: {off}");
    }
}
