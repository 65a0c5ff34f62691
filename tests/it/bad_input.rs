//! What is refused with a clear error instead of run: ranks that insert different graphs
//! (`GraphMismatch` naming the first differing task), an unknown `FERRY_*` variable, a `FERRY_*`
//! value that is not UTF-8, and bad driver arguments (before any work starts).

mod common;

use common::*;
use std::path::PathBuf;
use std::process::Stdio;

#[test]
fn graph_mismatch_is_detected() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    // Same transfers, different task arguments: only the sequence hash can tell.
    let r = mpirun(2, &exe, &["--seed", "3", "--mismatch-args"], &[]);
    assert!(!r.ok, "a mismatched graph must fail");
    assert!(r.stderr.contains("task graph mismatch between ranks"), "{}", r.stderr);
    // The report names the first task the ranks disagree on, as each rank inserted it.
    assert!(r.stderr.contains("first differing task: #"), "{}", r.stderr);
    assert!(r.stderr.contains("rank 1 inserted `mix"), "{}", r.stderr);
    // Different access modes: transfers disagree in size before `wait`.
    let r = mpirun(3, &exe, &["--seed", "4", "--mismatch"], &[]);
    assert!(!r.ok, "a mismatched graph must fail");
    assert!(
        r.stderr.contains("disagree") || r.stderr.contains("mismatch") || r.stderr.contains("MPI error"),
        "{}",
        r.stderr
    );
}

#[test]
fn unknown_ferry_variable_is_refused() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let r = mpirun(1, &exe, &[], &[("FERRY_WROKERS", "2")]);
    assert!(!r.ok);
    assert!(r.stderr.contains("unknown variable FERRY_WROKERS"), "{}", r.stderr);
}

/// A variable that is not UTF-8: another program's is ignored, a `FERRY_*` one is refused with a
/// clear error (`std::env::vars` would panic on either).
#[test]
fn environment_that_is_not_utf8_is_handled() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let run = |name: &str| {
        let (mut cmd, _session) = mpirun_command();
        cmd.args(["-np", "1"]);
        cmd.arg(&exe)
            .args(["--seed", "1"])
            .env(name, OsStr::from_bytes(b"2\xff"))
            .current_dir(repo_root())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = wait_with_timeout(cmd.spawn().expect("mpirun"));
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, stderr) = run("SOME_OTHER_TOOL");
    assert!(ok, "another program's variable must not matter:\n{stderr}");
    let (ok, stderr) = run("FERRY_WORKERS");
    assert!(!ok, "a FERRY_* value that is not UTF-8 must be refused");
    assert!(stderr.contains("FERRY_WORKERS: not valid UTF-8"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

fn expect_error(exe: &str, args: &[&str], np: usize, needle: &str) {
    let r = mpirun(np, &bin(exe), args, &[]);
    assert!(!r.ok, "{exe} {args:?} must fail");
    assert!(
        r.stderr.contains(needle),
        "{exe} {args:?}: expected {needle:?} in\n{}",
        r.stderr
    );
    assert!(
        !r.stdout.contains("GFLOP/s") && !r.stdout.contains("cell updates"),
        "no work may start: {}",
        r.stdout
    );
}

#[test]
fn bad_arguments_fail_before_any_work() {
    expect_error("cholesky", &["--n", "0"], 1, "--n must be at least 1");
    expect_error(
        "cholesky",
        &["--n", "100", "--nb", "200"],
        1,
        "--nb 200 must be between 1 and n = 100",
    );
    expect_error(
        "cholesky",
        &["--n", "100", "--nb", "10", "--grid", "3x3"],
        2,
        "--grid 3x3 needs 9 ranks but the job has 2",
    );
    expect_error(
        "cholesky",
        &["--points", "no/such/file.csv", "--count", "10"],
        1,
        "no such file",
    );
    expect_error("cholesky", &["--n", "100", "--devices", "gpu"], 1, "--devices");
    expect_error("cholesky", &["--n", "100", "--frobnicate"], 1, "--frobnicate");
    expect_error("cholesky", &["--n", "100", "--grid", "2y2"], 1, "expected PxQ");
    expect_error("stencil", &["--n", "100", "--nb", "50", "--alpha", "0.3"], 1, "stable");
    expect_error("stencil", &["--n", "10", "--nb", "11"], 1, "nb ≤ n");
}
