//! `cargo xtask test`: formatting, lints, build and the full test suite.

use anyhow::{bail, Result};
use clap::Args;

use crate::util;

#[derive(Args)]
pub struct TestArgs {
    /// Skip the system packages of `ci/install-deps.sh` (Open MPI, hwloc or libclang installed
    /// some other way: from source, modules, another distribution); cargo-nextest is still
    /// installed when missing.
    #[arg(long)]
    no_deps: bool,
    /// Skip `cargo fmt --check`, `cargo clippy` and the check that `docs/results.md` is what
    /// `docs/records/` generates.
    #[arg(long)]
    no_lint: bool,
    /// Skip the fuzz targets (`cargo xtask fuzz`).
    #[arg(long)]
    no_fuzz: bool,
    /// Skip the communication engine's tests under MPICH (built against it in `target/mpich`).
    #[arg(long)]
    no_mpich: bool,
    /// Seconds each fuzz target runs.
    #[arg(long, default_value_t = 60)]
    fuzz_seconds: u64,
    /// Extra arguments for `cargo nextest run` (after `--`).
    #[arg(last = true)]
    nextest_args: Vec<String>,
}

pub fn run(args: TestArgs) -> Result<()> {
    util::report_free_disk();
    // The README's test command must work on a fresh machine, as `demo` does.
    if !args.no_deps {
        util::install_deps().map_err(|e| e.context("installing dependencies (skip with --no-deps)"))?;
    } else {
        util::install_tools().map_err(|e| e.context("installing cargo-nextest"))?;
    }
    let mut failed: Vec<&str> = Vec::new();
    let mut step = |name: &'static str, c: &mut std::process::Command| -> bool {
        eprintln!("xtask test: {name}");
        match util::run(c) {
            Ok(()) => true,
            Err(err) => {
                eprintln!("xtask test: step `{name}` failed: {err:#}");
                failed.push(name);
                false
            }
        }
    };

    // Lint failures are reported at the end; the tests still run.
    if !args.no_lint {
        step("fmt", util::cargo().args(["fmt", "--all", "--", "--check"]));
        step(
            "clippy",
            util::cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]),
        );
    }

    // The multi-rank tests look for the example binaries (and libferry.so, for the C programs)
    // next to their own executable.
    let built = step("build", util::cargo().args(["build", "--workspace", "--bins", "--lib"]));
    // The tests (and the mpiruns, spills and C programs they start) write under a scratch
    // directory of this run, removed when the run passes, so repeated runs don't fill the disk.
    let scratch = Scratch::new()?;
    if built {
        step(
            "nextest",
            util::cargo()
                .args(["nextest", "run", "--workspace", "--no-fail-fast"])
                .args(&args.nextest_args)
                .envs(util::OMPI_ENV)
                .env("TMPDIR", &scratch.0),
        );
    }

    // The engine's multi-rank tests again under MPICH (the MPI of Cray systems is MPICH-based):
    // rsmpi binds one MPI at build time, so they build in a target directory of their own.
    if !args.no_mpich {
        if util::run(std::process::Command::new("mpicc.mpich").arg("-show")).is_err() {
            eprintln!("xtask test: step `mpich` failed: mpicc.mpich not found (ci/install-deps.sh installs MPICH; skip with --no-mpich)");
            failed.push("mpich");
        } else {
            let mpich = [("MPICC", "mpicc.mpich"), ("CARGO_TARGET_DIR", "target/mpich")];
            if step(
                "mpich build",
                util::cargo().args(["build", "-p", "ferry-tests", "--bins"]).envs(mpich),
            ) {
                step(
                    "mpich engine tests",
                    util::cargo()
                        .args([
                            "nextest",
                            "run",
                            "-p",
                            "ferry-tests",
                            "--test",
                            "engine",
                            "--no-fail-fast",
                        ])
                        .envs(mpich)
                        .env("TEST_MPIEXEC", "mpiexec.mpich")
                        .env("TMPDIR", &scratch.0),
                );
            }
        }
    }

    // docs/results.md must be what docs/records/ generates (`cargo xtask results`).
    if !args.no_lint {
        eprintln!("xtask test: results");
        if let Err(err) = crate::results::check_default() {
            eprintln!("xtask test: step `results` failed: {err:#}");
            failed.push("results");
        }
    }

    if !args.no_fuzz {
        eprintln!("xtask test: fuzz");
        let fuzz = crate::fuzz::FuzzArgs {
            seconds: args.fuzz_seconds,
            target: None,
        };
        if let Err(err) = crate::fuzz::run(fuzz) {
            eprintln!("xtask test: step `fuzz` failed: {err:#}");
            failed.push("fuzz");
        }
    }

    if failed.is_empty() {
        scratch.remove();
        eprintln!("xtask test: all steps passed");
        Ok(())
    } else {
        if !built {
            eprintln!("xtask test: tests not run because the build failed");
        }
        bail!("failed steps: {}", failed.join(", "))
    }
}

/// The tests' temporary directory, `ferry-test-<pid>` in the system's: kept after a failed run,
/// for its files; removed after a run that passed. (Not under `target/`: Open MPI puts its
/// Unix sockets in the session directory, whose paths must stay under 108 bytes.)
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("ferry-test-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        eprintln!("xtask test: temporary files in {}", dir.display());
        Ok(Self(dir))
    }

    fn remove(&self) {
        if let Err(err) = std::fs::remove_dir_all(&self.0) {
            eprintln!("xtask test: could not remove {}: {err}", self.0.display());
        }
    }
}
