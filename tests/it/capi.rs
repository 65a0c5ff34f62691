//! ferry's C ABI from C and C++: the C stencil on 1–3 ranks is bit-identical to the Rust one,
//! misuse returns the documented status codes, MPI initialised by the caller stays initialised,
//! the header compiles as C++, and the installed pkg-config file builds a program.
//!
//! The programs are compiled here with `mpicc`/`mpicxx` against `target/<profile>/libferry.so`
//! (built by `cargo build --workspace --lib`, which `cargo xtask test` runs).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-capi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Removes a directory when dropped, unwinding included.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Compiles `src` with `compiler` against the header and the library; returns the executable.
fn compile(compiler: &str, src: &str, extra: &[&str], out: &str) -> PathBuf {
    let lib = bin_dir();
    assert!(
        lib.join("libferry.so").exists(),
        "{} is missing: run `cargo build --workspace --lib` first (cargo xtask test does)",
        lib.join("libferry.so").display()
    );
    let exe = tmp(out);
    let o = Command::new(compiler)
        .arg(repo_root().join(src))
        .args(extra)
        .arg(format!("-I{}", repo_root().join("crates/ferry-capi/include").display()))
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lferry", "-lm", "-o"])
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("{compiler} must be installed (libopenmpi-dev, gcc, g++): {e}"));
    assert!(
        o.status.success(),
        "{compiler} {src} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    exe
}

fn mpirun(np: usize, exe: &Path, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let (mut cmd, _session) = common::mpirun_command();
    cmd.args(["--bind-to", "none", "-np", &np.to_string()]);
    for (k, _) in env {
        cmd.args(["-x", k]);
    }
    let out = cmd
        .arg(exe)
        .args(args)
        .envs(env.iter().copied())
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .stdin(Stdio::null())
        .output()
        .expect("mpirun must be installed");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn field(stdout: &str, key: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().last())
        .unwrap_or_else(|| panic!("no `{key}` line in:\n{stdout}"))
        .to_string()
}

/// Asserts that `stdout` has a `log det` line within `rel` (relative) of `want`; `what` names the run.
fn assert_log_det(stdout: &str, want: f64, rel: f64, what: &str) {
    let got: f64 = field(stdout, "log det").parse().expect("a log det");
    assert!(
        (got - want).abs() <= rel * want.abs().max(1.0),
        "{what}: log det {got}, STF {want}\n{stdout}"
    );
}

const C_FLAGS: &[&str] = &["-std=c11", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror"];

#[test]
fn c_stencil_is_bit_identical_to_the_rust_stencil_and_leaves_mpi_initialised() {
    let exe = compile("mpicc", "examples/c/stencil.c", C_FLAGS, "stencil_c");
    let args = ["--n", "150", "--nb", "40", "--iters", "25"];
    let (ok, rust, err) = mpirun(
        1,
        &bin_dir().join("stencil"),
        &[&args[..], &["--devices", "none"]].concat(),
        &[],
    );
    assert!(ok, "rust stencil failed:\n{rust}\n{err}");
    let want = field(&rust, "checksum");
    for np in 1..=3 {
        let (ok, out, err) = mpirun(np, &exe, &args, &[]);
        assert!(ok, "C stencil on {np} ranks failed:\n{out}\n{err}");
        assert_eq!(field(&out, "checksum"), want, "C stencil on {np} ranks:\n{out}");
        assert!(out.contains("mpi after ferry  still initialised"), "{out}");
    }
    // On emulated devices (the CPU body is the emulated kernel): the same bits.
    let (ok, out, err) = mpirun(2, &exe, &args, &[("FERRY_DEVICES", "emu:2")]);
    assert!(ok, "C stencil on emulated devices failed:\n{out}\n{err}");
    assert_eq!(field(&out, "checksum"), want, "C stencil on emu:2:\n{out}");
    // Ragged tiles and more steps on 2 ranks, against Rust on 3.
    let args = ["--n", "97", "--nb", "20", "--iters", "40"];
    let (ok, rust, err) = mpirun(
        3,
        &bin_dir().join("stencil"),
        &[&args[..], &["--devices", "none"]].concat(),
        &[],
    );
    assert!(ok, "{rust}\n{err}");
    let (ok, out, err) = mpirun(2, &exe, &args, &[]);
    assert!(ok, "{out}\n{err}");
    assert_eq!(field(&out, "checksum"), field(&rust, "checksum"));
}

#[test]
fn c_api_misuse_returns_the_documented_codes() {
    let exe = compile("mpicc", "tests/c/api_errors.c", C_FLAGS, "api_errors");
    // The program fails a run on purpose; without this, shutdown would end the job.
    let (ok, out, err) = mpirun(1, &exe, &[], &[("FERRY_ABORT_ON_ERROR", "0")]);
    assert!(ok && out.contains("api_errors ok"), "{out}\n{err}");
}

#[test]
fn ferry_refuses_a_callers_mpi_without_thread_multiple() {
    // The C stencil with MPI initialised as FUNNELED (a one-line variant compiled from the same
    // source): ferry must refuse with a clear message, not race the caller's thread.
    let src = std::fs::read_to_string(repo_root().join("examples/c/stencil.c")).expect("stencil.c");
    let funneled = src.replace("MPI_THREAD_MULTIPLE, &provided", "MPI_THREAD_FUNNELED, &provided");
    assert_ne!(src, funneled);
    let path = tmp("stencil_funneled.c");
    std::fs::write(&path, funneled).expect("write");
    let exe = compile("mpicc", path.to_str().unwrap(), C_FLAGS, "stencil_funneled");
    let (ok, out, err) = mpirun(1, &exe, &["--n", "16", "--nb", "8", "--iters", "1"], &[]);
    assert!(!ok, "must fail:\n{out}");
    assert!(
        err.contains("FERRY_ERR_MPI") && err.contains("MPI_THREAD_MULTIPLE"),
        "{err}"
    );
}

#[test]
fn header_compiles_as_cpp() {
    let exe = compile(
        "mpicxx",
        "tests/c/header_smoke.cpp",
        &["-std=c++17", "-Wall", "-Werror"],
        "smoke_cpp",
    );
    let out = Command::new(&exe).output().expect("run");
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "FERRY_OK body");
}

#[test]
fn installed_pkg_config_builds_the_c_example() {
    let prefix = tmp("prefix");
    // The installed library is the largest file the tests write: remove it however the test ends.
    let _cleanup = RemoveOnDrop(prefix.clone());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let o = Command::new(&cargo)
        .current_dir(repo_root())
        .args(["xtask", "install-capi", "--debug", "--prefix"])
        .arg(&prefix)
        .output()
        .expect("cargo xtask");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pc = Command::new("pkg-config")
        .args(["--cflags", "--libs", "ferry"])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .output()
        .expect("pkg-config must be installed");
    assert!(pc.status.success(), "{}", String::from_utf8_lossy(&pc.stderr));
    let flags = String::from_utf8_lossy(&pc.stdout).to_string();
    assert!(flags.contains("-lferry") && flags.contains("include"), "{flags}");
    let exe = tmp("stencil_pc");
    let o = Command::new("mpicc")
        .arg(repo_root().join("examples/c/stencil.c"))
        .args(C_FLAGS)
        .args(flags.split_whitespace())
        .args(["-lm", "-o"])
        .arg(&exe)
        .output()
        .expect("mpicc");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (ok, out, err) = mpirun(1, &exe, &["--n", "40", "--nb", "16", "--iters", "3"], &[]);
    assert!(ok && out.contains("checksum"), "{out}\n{err}");
}

#[test]
fn c_engine_moves_bytes_and_returns_the_documented_codes() {
    let exe = compile("mpicc", "tests/c/engine.c", C_FLAGS, "engine_c");
    for np in [2, 3] {
        for mode in [&[][..], &["--driven"][..], &["--no-cma"][..]] {
            let (ok, out, err) = mpirun(np, &exe, mode, &[]);
            assert!(
                ok && out.matches("engine_c ok").count() == np,
                "{np} ranks {mode:?}:\n{out}\n{err}"
            );
        }
    }
}

/// A framework that keeps its own graph, on the engine alone: the PTG-style Cholesky in C
/// (`examples/c/ptg_cholesky.c`) gives the STF `cholesky`'s log det on the same generated matrix,
/// on 1 to 4 ranks (2D block-cyclic, tiles pulled with gets after active-message announcements),
/// and a residual below 1.
#[test]
fn ptg_cholesky_in_c_on_the_engine_matches_the_stf_cholesky() {
    let exe = compile("mpicc", "examples/c/ptg_cholesky.c", C_FLAGS, "ptg_cholesky");
    let args = ["--n", "512", "--nb", "64", "--seed", "7"];
    let (ok, stf, err) = mpirun(
        1,
        &bin_dir().join("cholesky"),
        &[&args[..], &["--devices", "none"]].concat(),
        &[],
    );
    assert!(ok, "STF cholesky failed:\n{stf}\n{err}");
    let want: f64 = field(&stf, "log det").parse().expect("a log det");
    for np in [1, 2, 3, 4] {
        let (ok, out, err) = mpirun(np, &exe, &args, &[]);
        assert!(ok, "ptg_cholesky on {np} ranks failed:\n{out}\n{err}");
        assert_log_det(&out, want, 1e-6, &format!("ptg_cholesky on {np} ranks"));
        let line = out
            .lines()
            .find(|l| l.starts_with("residual"))
            .expect("a residual line");
        let r: f64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|x| x.parse().ok())
            .expect("a residual");
        assert!(r < 1.0, "residual {r} on {np} ranks");
    }
    // Tiles in device memory of the engine's emulated device: slabs registered once, pulls
    // between device registrations, A restored between repetitions.
    for np in [1, 2, 3] {
        let dev = [&args[..], &["--devices", "emulated", "--reps", "2"]].concat();
        let (ok, out, err) = mpirun(np, &exe, &dev, &[]);
        assert!(
            ok,
            "ptg_cholesky --devices emulated on {np} ranks failed:\n{out}\n{err}"
        );
        assert_log_det(
            &out,
            want,
            1e-6,
            &format!("ptg_cholesky --devices emulated on {np} ranks"),
        );
        assert!(out.contains("devices emulated"), "{out}");
    }
    // CUDA: where it cannot run (no CUDA libraries, no GPU), a clear error; where it can, the
    // same log det.
    let cuda = [&args[..], &["--devices", "cuda"]].concat();
    let (ok, out, err) = mpirun(1, &exe, &cuda, &[]);
    if ok {
        assert_log_det(&out, want, 1e-6, "--devices cuda");
    } else {
        assert!(
            err.contains("ptg_cholesky: --devices cuda: cannot load") || err.contains("FERRY_ERR_DEVICE"),
            "--devices cuda without CUDA:\n{out}\n{err}"
        );
    }
    let (ok, _, err) = mpirun(1, &exe, &[&args[..], &["--devices", "tpu"]].concat(), &[]);
    assert!(!ok && err.contains("unknown option or value --devices tpu"), "{err}");
}

/// The same with the GeoNames places (`--points`): the C program builds its tiles with
/// `ferry_places_covariance_tile` and factors the matrix the STF `cholesky --points` factors.
#[test]
fn ptg_cholesky_in_c_on_geonames_places_matches_the_stf_cholesky() {
    let exe = compile("mpicc", "examples/c/ptg_cholesky.c", C_FLAGS, "ptg_cholesky_points");
    let data = repo_root().join("data/cities1000.csv");
    let data = data.to_str().expect("a UTF-8 path");
    let args = [
        "--points", data, "--count", "384", "--nb", "64", "--order", "morton", "--kernel", "matern32",
    ];
    let (ok, stf, err) = mpirun(
        1,
        &bin_dir().join("cholesky"),
        &[&args[..], &["--devices", "none"]].concat(),
        &[],
    );
    assert!(ok, "STF cholesky failed:\n{stf}\n{err}");
    let want: f64 = field(&stf, "log det").parse().expect("a log det");
    for np in [1, 3] {
        let (ok, out, err) = mpirun(np, &exe, &args, &[]);
        assert!(ok, "ptg_cholesky --points on {np} ranks failed:\n{out}\n{err}");
        assert_log_det(&out, want, 1e-9, &format!("ptg_cholesky --points on {np} ranks"));
    }
    // A file that is not there: the documented status and the cause, no crash.
    let (ok, out, err) = mpirun(1, &exe, &["--points", "no/such/places.csv", "--nb", "64"], &[]);
    assert!(!ok, "a missing places file was accepted:\n{out}");
    assert!(
        err.contains("FERRY_ERR_IO") && err.contains("no/such/places.csv"),
        "{err}"
    );
}
