//! Task Bench (issue 8): every pattern on 1–4 ranks validates its dependencies and transfers, and
//! its counts equal the MPI baseline's.

mod common;

use common::*;

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
    let r = mpirun(1, &bin("taskbench"), &["-replay-steps", "0"], &[]);
    assert!(!r.ok && r.stderr.contains("-replay-steps"), "{}", r.stderr);
    let r = mpirun(1, &bin("taskbench"), &["-type", "stencil_2d"], &[]);
    assert!(
        !r.ok && r.stderr.contains("Invalid flag \"-type stencil_2d\""),
        "{}",
        r.stderr
    );
}

/// The patterns again with their steps inserted as traces of two and of five steps
/// (`-replay-steps`): each trace is named by its steps' dependence structure, so patterns whose
/// dependencies change from step to step (tree, fft, spread, random_nearest) record each kind of
/// block once and replay it where it recurs; every task still validates its inputs and the
/// transfers equal what the graph implies. In the timed repetition, every block replays, and on
/// these CPU ranks runs fused, its sends and receives parts of the fused graph: rank 0 runs its
/// own tasks (a share of them, and some for every block of two steps or more) in fused launches.
#[test]
fn taskbench_patterns_validate_with_replay() {
    let patterns = [
        "stencil_1d",
        "tree",
        "fft",
        "spread",
        "random_nearest",
        "dom",
        "all_to_all",
    ];
    for (k, pattern) in patterns.iter().enumerate() {
        let np = 2 + k % 3;
        for block in ["2", "5"] {
            let args = [
                "-steps",
                "12",
                "-width",
                "7",
                "-type",
                pattern,
                "-radix",
                "3",
                "-kernel",
                "busy_wait",
                "-iter",
                "20",
                "-replay-steps",
                block,
            ];
            let r = mpirun(np, &bin("taskbench"), &args, &[]);
            assert!(
                r.ok,
                "taskbench {pattern} -replay-steps {block} np={np} failed\n{}\n{}",
                r.stdout, r.stderr
            );
            let replayed = number_after(&r.stdout, "Replay ").expect("a Replay line");
            let tasks = number_after(&r.stdout, "Total Tasks ").expect("Total Tasks");
            // Every rank inserts every task; rank 0 reports its own count: all of them.
            assert_eq!(replayed, tasks, "{pattern} -replay-steps {block}: {}", r.stdout);
            let moved = transfers(&r.stdout);
            assert_eq!(
                moved.0, moved.1,
                "{pattern} -replay-steps {block}: transfers as implied: {}",
                r.stdout
            );
            let fused = number_after(&r.stdout, "traces recorded, ").expect("fused launches");
            let fused_tasks = number_after(&r.stdout, "fused launches of ").expect("fused tasks");
            assert!(
                fused > 0 && fused_tasks >= 2 * fused && fused_tasks <= tasks,
                "{pattern} -replay-steps {block}: {fused} fused launches of {fused_tasks} tasks: {}",
                r.stdout
            );
        }
    }
    // Two graphs at once, the second with scratch tiles (read before written: part of the
    // traces' entry): the blocks of both graphs are traced together.
    let args = [
        "-steps",
        "10",
        "-width",
        "5",
        "-type",
        "fft",
        "-kernel",
        "busy_wait",
        "-iter",
        "10",
        "-and",
        "-steps",
        "7",
        "-width",
        "4",
        "-type",
        "stencil_1d",
        "-kernel",
        "memory_bound",
        "-scratch",
        "1024",
        "-iter",
        "2",
        "-replay-steps",
        "3",
    ];
    let r = mpirun(3, &bin("taskbench"), &args, &[]);
    assert!(
        r.ok,
        "taskbench -and -scratch -replay-steps 3\n{}\n{}",
        r.stdout, r.stderr
    );
    let replayed = number_after(&r.stdout, "Replay ").expect("a Replay line");
    let tasks = number_after(&r.stdout, "Total Tasks ").expect("Total Tasks");
    assert_eq!(replayed, tasks, "{}", r.stdout);
}

/// The `Transfers` line's (messages, bytes) moved and what the graphs imply.
fn transfers(stdout: &str) -> ((u64, u64), (u64, u64)) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("Transfers "))
        .unwrap_or_else(|| panic!("a Transfers line: {stdout}"));
    let n: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .map(|w| w.parse().unwrap())
        .collect();
    assert_eq!(n.len(), 4, "{line}");
    ((n[0], n[1]), (n[2], n[3]))
}
