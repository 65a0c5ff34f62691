//! Traces (`FERRY_TRACE=DIR`): one Chrome trace per rank with task, transfer and window-stall
//! spans, and the merged trace of a run on emulated devices, with a track per thread and per
//! device stream on a common clock.

mod common;

use common::*;
use std::path::PathBuf;

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
        // The MPI thread's own track is checked below: with shared progress (`auto` on this
        // machine's rank per core) its spans may all land on the workers' tracks.
        &[
            ("FERRY_TRACE", d.as_str()),
            ("FERRY_SUBMIT_WINDOW", "2"),
            ("FERRY_MPI_PROGRESS", "thread"),
        ],
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
    // The MPI thread's track is checked below: it drives MPI progress itself, which on this
    // machine's rank per core the idle workers would (`FERRY_MPI_PROGRESS=auto`).
    let rec = run_json(
        "stencil",
        2,
        &a,
        &[("FERRY_TRACE", d.as_str()), ("FERRY_MPI_PROGRESS", "thread")],
        "trace-streams",
    );
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
