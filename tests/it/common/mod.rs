//! Helpers shared by the multi-rank test binaries: finding the workspace's binaries, running
//! them under `mpirun` with a hang bound, reading their JSON records. MPI can be initialised once
//! per process, so every run is a process of its own.

#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The traffic paths that carry tile payloads between ranks, as the records name them (the
/// runtime's transfers; `cma`, the engine's single copies, is not among them).
pub const NETWORK_PATHS: [&str; 6] = [
    "host-eager",
    "host-rendezvous",
    "host-ring",
    "staged",
    "gpu-direct",
    "ipc",
];

/// Generous bound on one MPI run: a hang fails the test instead of the CI job.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// The directory holding the workspace's binaries (`target/<profile>`), found from this test's
/// own executable (`target/<profile>/deps/<test>-…`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>")
        .to_path_buf()
}

pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace --bins` first (cargo xtask test does)",
        p.display()
    );
    p
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

pub struct Run {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// `mpirun --oversubscribe` (with `--allow-run-as-root` as root) in a session directory of its
/// own, removed when the returned guard is dropped: Open MPI creates its session directory under
/// the temporary directory, and two mpiruns starting at the same moment can race on its
/// creation ("mkdir ... File exists", then `orte_init` fails).
pub fn mpirun_command() -> (Command, SessionDir) {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "ferry-mpirun-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("a session directory for mpirun");
    // Another MPI's launcher (`TEST_MPIEXEC=mpiexec.mpich`, for tests built against MPICH):
    // it takes no Open MPI options and passes the whole environment on by itself.
    if let Some(launcher) = other_launcher() {
        return (Command::new(launcher), SessionDir(dir));
    }
    let mut cmd = Command::new("mpirun");
    cmd.arg("--oversubscribe").env("OMPI_MCA_orte_tmpdir_base", &dir);
    if unsafe_is_root() {
        cmd.arg("--allow-run-as-root");
    }
    (cmd, SessionDir(dir))
}

/// The launcher of another MPI library than Open MPI, from `TEST_MPIEXEC` (the tests were then
/// built against that library: `cargo xtask test` runs the engine's tests under MPICH so).
pub fn other_launcher() -> Option<String> {
    std::env::var("TEST_MPIEXEC").ok().filter(|s| !s.is_empty())
}

/// An mpirun's session directory; removed on drop (keep it until the run has ended).
pub struct SessionDir(PathBuf);

impl Drop for SessionDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn mpirun(np: usize, exe: &PathBuf, args: &[&str], env: &[(&str, &str)]) -> Run {
    let (mut cmd, _session) = mpirun_command();
    cmd.args(["-np", &np.to_string()]);
    if other_launcher().is_none() {
        for (k, _) in env {
            cmd.args(["-x", k]);
        }
    }
    cmd.arg(exe)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(repo_root());
    cmd.env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd
        .spawn()
        .expect("mpirun must be installed (libopenmpi-dev openmpi-bin)");
    let out = wait_with_timeout(child);
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

pub fn unsafe_is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

pub fn wait_with_timeout(mut child: std::process::Child) -> Output {
    let t0 = Instant::now();
    loop {
        match child.try_wait().expect("waiting for mpirun") {
            Some(_) => return child.wait_with_output().expect("collecting output"),
            None if t0.elapsed() > RUN_TIMEOUT => {
                let _ = child.kill();
                let out = child.wait_with_output().expect("collecting output");
                panic!(
                    "mpirun did not finish within {RUN_TIMEOUT:?} (hang)\nstdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The whole number printed right after the first `marker` in `text` (e.g. `"overruns "` in
/// `"… overruns 2"`); `None` when the marker or a number after it is missing.
pub fn number_after(text: &str, marker: &str) -> Option<u64> {
    text.split(marker).nth(1)?.split_whitespace().next()?.parse().ok()
}

pub fn json(path: &PathBuf) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("valid JSON record")
}

pub fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

pub fn oracle(np: usize, seeds: std::ops::Range<u64>, extra: &[&str], env: &[(&str, &str)]) {
    for seed in seeds {
        let mut args = vec!["--tasks", "250"];
        args.extend_from_slice(extra);
        oracle_ok(np, seed, &args, env);
    }
}

/// Runs the oracle once with `--seed seed` and `args` (a later `--tasks` wins), asserts that it
/// reports `oracle ok`, and returns its standard output.
pub fn oracle_ok(np: usize, seed: u64, args: &[&str], env: &[(&str, &str)]) -> String {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let s = seed.to_string();
    let mut all = vec!["--seed", &s];
    all.extend_from_slice(args);
    let r = mpirun(np, &exe, &all, env);
    assert!(
        r.ok && r.stdout.contains("oracle ok"),
        "oracle np={np} seed={seed} {args:?} env={env:?} failed\n{}\n{}",
        r.stdout,
        r.stderr
    );
    r.stdout
}

/// Field `field` of path `name` in a record's `paths` table (0 when the path is absent).
fn path_field(rec: &serde_json::Value, name: &str, field: &str) -> u64 {
    rec["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["path"] == name)
        .map_or(0, |p| p[field].as_u64().unwrap())
}

/// Bytes a record counts on path `name`, all ranks.
pub fn path_bytes(rec: &serde_json::Value, name: &str) -> u64 {
    path_field(rec, name, "bytes")
}

/// Messages a record counts on path `name`, all ranks.
pub fn path_messages(rec: &serde_json::Value, name: &str) -> u64 {
    path_field(rec, name, "messages")
}

pub fn run_json(exe: &str, np: usize, args: &[&str], env: &[(&str, &str)], tag: &str) -> serde_json::Value {
    let out = tmp(&format!("{exe}-{np}-{tag}.json"));
    let o = out.to_string_lossy().into_owned();
    let mut a = args.to_vec();
    a.extend_from_slice(&["--json", &o]);
    let r = mpirun(np, &bin(exe), &a, env);
    assert!(
        r.ok,
        "{exe} np={np} {args:?} {env:?} failed\n{}\n{}",
        r.stdout, r.stderr
    );
    json(&out)
}

/// Runs the `cholesky` example on `np` ranks with `args`: its JSON record.
pub fn cholesky(np: usize, args: &[&str]) -> serde_json::Value {
    let out = tmp(&format!(
        "cholesky-{np}-{}.json",
        args.join("_").replace(['/', '.'], "")
    ));
    let o = out.to_string_lossy().into_owned();
    let mut a = args.to_vec();
    a.extend_from_slice(&["--json", &o]);
    let r = mpirun(np, &bin("cholesky"), &a, &[]);
    assert!(r.ok, "cholesky np={np} {args:?} failed\n{}\n{}", r.stdout, r.stderr);
    json(&out)
}

/// Runs the `stencil` example on `np` ranks with `args`: its JSON record.
pub fn stencil(np: usize, args: &[&str]) -> serde_json::Value {
    stencil_env(np, args, &[])
}

/// [`stencil`] with extra environment variables.
pub fn stencil_env(np: usize, args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let tag: String = env.iter().map(|(k, v)| format!("_{k}={v}")).collect();
    let out = tmp(&format!("stencil-{np}-{}{tag}.json", args.join("_")));
    let o = out.to_string_lossy().into_owned();
    let mut a = args.to_vec();
    a.extend_from_slice(&["--json", &o]);
    let r = mpirun(np, &bin("stencil"), &a, env);
    assert!(
        r.ok,
        "stencil np={np} {args:?} {env:?} failed\n{}\n{}",
        r.stdout, r.stderr
    );
    json(&out)
}
