//! Injected faults (`FERRY_FAULTS`, late device completions, failing device allocations) that the
//! runtime absorbs leave the oracle's, Cholesky's and the stencil's results exact; a malformed
//! fault list is refused.

mod common;

use common::*;
use std::path::PathBuf;

/// Faults the runtime is meant to absorb — late and reordered MPI completions, perturbed worker
/// timing, a slow link, late device completions and failing device allocations — leave every
/// result exact: the oracle on 1–4 ranks, and both examples.
#[test]
fn absorbable_faults_leave_results_exact() {
    for (np, faults, seed) in [
        (2, "mpi-delay:300", 110),
        (3, "sched-jitter:200", 111),
        (4, "slow-link:100", 112),
        (2, "mpi-delay:200,sched-jitter:100,slow-link:200", 113),
        (1, "sched-jitter:300", 114),
    ] {
        oracle(np, seed..seed + 2, &[], &[("FERRY_FAULTS", faults)]);
    }
    let env = [
        ("FERRY_FAULTS", "mpi-delay:200,sched-jitter:100"),
        ("FERRY_EMU_DELAY_US", "100"),
        ("FERRY_EMU_FAIL_ALLOC", "2,5,9"),
    ];
    let out = tmp("faults-cholesky.json");
    let o = out.to_string_lossy().into_owned();
    let r = mpirun(
        3,
        &bin("cholesky"),
        &["--n", "300", "--nb", "64", "--devices", "emu:2", "--json", &o],
        &env,
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert!(json(&out)["residual"].as_f64().unwrap() < 1.0);
    let reference = stencil(1, &["--n", "100", "--nb", "25", "--iters", "10", "--devices", "none"]);
    let out = tmp("faults-stencil.json");
    let o = out.to_string_lossy().into_owned();
    let r = mpirun(
        2,
        &bin("stencil"),
        &[
            "--n",
            "100",
            "--nb",
            "25",
            "--iters",
            "10",
            "--devices",
            "emu:1",
            "--json",
            &o,
        ],
        &env,
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert_eq!(
        json(&out)["checksum"],
        reference["checksum"],
        "faults changed the stencil's bits"
    );
}

#[test]
fn malformed_fault_list_is_refused() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let r = mpirun(1, &exe, &[], &[("FERRY_FAULTS", "disk-full:1")]);
    assert!(!r.ok);
    assert!(r.stderr.contains("FERRY_FAULTS item \"disk-full:1\""), "{}", r.stderr);
}
