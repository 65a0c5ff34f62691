//! The engine's benchmark binary (`engine-bench`) as a program: it runs every measurement and
//! writes its record. Its figures are checked only for being figures; performance claims live in
//! the records it writes (`docs/results.md`). A test binary of its own, because the engine's
//! tests also run under MPICH (`cargo xtask test`), which builds the tests' programs only.

mod common;

/// `engine-bench` (the engine's benchmark, not timed here) runs every measurement on 2 ranks
/// and writes a record with one row per measurement and size: active-message and two-sided
/// message round trips, get and put latency, and bandwidth per window, each with a positive
/// figure and its MPI anchor from the same run.
#[test]
fn the_engine_benchmark_writes_a_row_per_measurement_and_size() {
    let out = common::tmp("engine-bench.json");
    let r = common::mpirun(
        2,
        &common::bin("engine-bench"),
        &[
            "--progress",
            "caller",
            "--min-size",
            "8",
            "--max-size",
            "8192",
            "--windows",
            "1,8",
            "--reps",
            "1",
            "--volume-mib",
            "1",
            "--json",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(r.ok, "engine-bench failed\n{}\n{}", r.stdout, r.stderr);
    let rec = common::json(&out);
    let rows = rec["results"].as_array().expect("results");
    let metrics: Vec<&str> = rows.iter().map(|x| x["metric"].as_str().unwrap()).collect();
    // Sizes 8 B to 8 KiB by 4×: 8, 32, 128, 512, 2 KiB, 8 KiB.
    let sizes = ["8 B", "32 B", "128 B", "512 B", "2 KiB", "8 KiB"];
    for s in sizes {
        for m in [
            format!("active-message round trip, {s}"),
            format!("message round trip, {s}"),
            format!("get latency, {s}"),
            format!("put latency, {s}"),
            format!("get bandwidth, {s} × 1"),
            format!("put bandwidth, {s} × 8"),
        ] {
            assert_eq!(
                metrics.iter().filter(|x| **x == m).count(),
                1,
                "row {m:?} in {metrics:?}"
            );
        }
    }
    for row in rows {
        let (f, a) = (
            row["figure"].as_f64().unwrap(),
            row["anchor"]["figure"].as_f64().unwrap(),
        );
        assert!(f > 0.0 && f.is_finite() && a > 0.0 && a.is_finite(), "row {row}");
    }
}
