//! Helpers for running child processes from the workspace root.

use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, Result};

/// Environment that lets Open MPI run as root and with more ranks than cores.
pub const OMPI_ENV: [(&str, &str); 3] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
];

/// A child process that ran but did not succeed.
#[derive(Debug)]
pub struct CommandFailed {
    pub what: String,
    /// Exit code, `None` when killed by a signal.
    pub code: Option<i32>,
}

impl fmt::Display for CommandFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.code {
            Some(code) => write!(f, "{} failed with exit status {code}", self.what),
            None => write!(f, "{} was killed by a signal", self.what),
        }
    }
}

impl std::error::Error for CommandFailed {}

/// The workspace root (the parent of the xtask package).
pub fn root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask lives inside the workspace")
            .to_path_buf()
    })
}

/// A command that runs in the workspace root.
pub fn cmd(program: impl AsRef<OsStr>) -> Command {
    let mut c = Command::new(program);
    c.current_dir(root());
    c
}

/// `cargo`, the same one that runs xtask when invoked through `cargo xtask`.
pub fn cargo() -> Command {
    cmd(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Whether this process runs with effective user id 0 (asks `id -u`).
pub fn is_root() -> bool {
    static ROOT_USER: OnceLock<bool> = OnceLock::new();
    *ROOT_USER.get_or_init(|| {
        Command::new("id")
            .arg("-u")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .is_some_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
    })
}

/// `mpirun --oversubscribe [--allow-run-as-root] -np <np>`, run in the workspace root.
pub fn mpirun(np: u32) -> Command {
    let mut c = cmd("mpirun");
    // No core binding: a rank bound to one core would see one CPU and start one worker.
    c.args(["--oversubscribe", "--bind-to", "none"]);
    if is_root() {
        c.arg("--allow-run-as-root");
    }
    c.arg("-np").arg(np.to_string());
    c
}

/// The command line of `c`, for logging.
pub fn describe(c: &Command) -> String {
    std::iter::once(c.get_program())
        .chain(c.get_args())
        .map(|s| {
            let s = s.to_string_lossy();
            if s.is_empty() || s.contains(char::is_whitespace) {
                format!("'{s}'")
            } else {
                s.into_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Run `c` with inherited stdio; an error unless it exits successfully.
pub fn run(c: &mut Command) -> Result<()> {
    let what = describe(c);
    eprintln!("$ {what}");
    let status = c.status().with_context(|| format!("could not start `{what}`"))?;
    if status.success() {
        Ok(())
    } else {
        Err(CommandFailed {
            what: format!("`{what}`"),
            code: status.code(),
        }
        .into())
    }
}

/// Run `ci/install-deps.sh`.
pub fn install_deps() -> Result<()> {
    run(cmd("bash").arg("ci/install-deps.sh"))
}

/// Installs the cargo tools only (`ci/install-deps.sh --tools`): for `--no-deps`, where the
/// system libraries come from elsewhere but cargo-nextest is still needed.
pub fn install_tools() -> Result<()> {
    run(cmd("bash").args(["ci/install-deps.sh", "--tools"]))
}

/// Create `dir` (relative to the workspace root) and return its absolute path.
pub fn target_dir(sub: &str) -> Result<PathBuf> {
    let dir = root().join("target").join(sub);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Prints the free space of the file system holding the workspace (from `df`): a full build with
/// its tests, the MPICH build and the fuzz targets need several GB, and a full disk otherwise
/// shows up only as a linker's bus error.
pub fn report_free_disk() {
    let out = Command::new("df").args(["-Pk"]).arg(root()).output();
    let free_kib = out.ok().and_then(|o| {
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        text.lines().nth(1)?.split_whitespace().nth(3)?.parse::<u64>().ok()
    });
    match free_kib {
        Some(kib) => {
            let gib = kib as f64 / (1024.0 * 1024.0);
            eprintln!("xtask: {gib:.1} GiB free on the disk of {}", root().display());
            if gib < 10.0 {
                eprintln!("xtask: warning: the build and tests need about 10 GiB; they may fail for lack of space");
            }
        }
        None => eprintln!("xtask: could not read the free disk space (df)"),
    }
}
