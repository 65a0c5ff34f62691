//! Shared pieces of the example drivers: device selection, process-grid selection, JSON records,
//! and the error-reporting wrapper that prints an error *before* the runtime shuts down (a failed
//! rank ends the MPI job at shutdown, and the message must not be lost).

pub mod alloc;
pub mod progress;
pub mod taskbench;

static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Applies the drivers' `-v` / `-q` flags; call first thing in `main`, before any thread starts.
/// `verbose`: log at `info` (unless `FERRY_LOG` says otherwise) — the runtime's start-up
/// (routes, devices, pools). `quiet`: no progress bar and no statistics table.
pub fn set_verbosity(verbose: bool, quiet: bool) {
    if verbose && std::env::var_os("FERRY_LOG").is_none() {
        // SAFETY (of the environment write): called before any other thread exists.
        std::env::set_var("FERRY_LOG", "info");
    }
    QUIET.store(quiet, std::sync::atomic::Ordering::Relaxed);
}

/// Whether `-q` was given.
pub fn quiet() -> bool {
    QUIET.load(std::sync::atomic::Ordering::Relaxed)
}

use anyhow::{bail, Context};
use ferry::{CudaTaskContext, DeviceSpec, ProcessGrid, Runtime, StatsSnapshot, TaskError};
use ferry_kernels::cuda::CudaTileKernels;
use serde::Serialize;
use std::cell::RefMut;
use std::path::Path;

/// The CUDA tile kernels of the exec stream a task runs on (created on first use, then cached by
/// the runtime for the stream).
pub fn gpu_kernels<'a>(ctx: &'a CudaTaskContext<'_>) -> Result<RefMut<'a, CudaTileKernels>, TaskError> {
    ctx.resource(|s| CudaTileKernels::new(s.clone()).map_err(|e| Box::new(e) as TaskError))
}

/// Whether this rank's tasks run on real CUDA devices (not none, not emulated ones): where a
/// driver's bare-CUDA anchors can run.
pub fn on_cuda(rt: &Runtime) -> bool {
    !rt.devices().is_empty() && !rt.devices().iter().any(|d| d.starts_with("emu"))
}

/// The process grid: `--grid PxQ` when given (it must match the rank count), else the squarest.
pub fn process_grid(rt: &Runtime, grid: Option<ProcessGrid>) -> anyhow::Result<ProcessGrid> {
    match grid {
        Some(g) if g.size() != rt.size() => {
            bail!("--grid {g} needs {} ranks but the job has {}", g.size(), rt.size())
        }
        Some(g) => Ok(g),
        None => Ok(ProcessGrid::squarest(rt.size())),
    }
}

/// Writes `record` as pretty JSON to `path` (through a temporary file and a rename).
pub fn write_json<T: Serialize>(path: &Path, record: &T) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(record)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// Bytes moved per path, summed over ranks, for JSON records.
#[derive(Debug, Serialize)]
pub struct PathRecord {
    /// Path name.
    pub path: String,
    /// Bytes sent on it, all ranks.
    pub bytes: u64,
    /// Messages sent on it, all ranks.
    pub messages: u64,
}

/// Per-path totals of gathered statistics.
pub fn path_records(stats: &[StatsSnapshot]) -> Vec<PathRecord> {
    ferry::TrafficPath::ALL
        .iter()
        .map(|&p| PathRecord {
            path: p.name().to_string(),
            bytes: stats.iter().map(|s| s.path(p).bytes_sent).sum(),
            messages: stats.iter().map(|s| s.path(p).sends).sum(),
        })
        .collect()
}

/// The host and disk tiers' statistics summed over ranks (peaks: the largest rank's).
pub fn tier_record(stats: &[StatsSnapshot]) -> ferry::TierStats {
    let mut t = ferry::TierStats::default();
    for s in stats.iter().map(|s| &s.tier) {
        t.host_limit = t.host_limit.max(s.host_limit);
        t.host_peak = t.host_peak.max(s.host_peak);
        t.disk_peak = t.disk_peak.max(s.disk_peak);
        t.host_drops += s.host_drops;
        t.spills += s.spills;
        t.spill_bytes += s.spill_bytes;
        t.spill_s = t.spill_s.max(s.spill_s);
        t.loads += s.loads;
        t.load_bytes += s.load_bytes;
        t.load_s = t.load_s.max(s.load_s);
        t.prefetches += s.prefetches;
        t.demand_loads += s.demand_loads;
        t.demand_wait_s += s.demand_wait_s;
    }
    t
}

/// Starts the runtime on `devices` (when `None`: `FERRY_DEVICES`, else `auto`: CUDA when a GPU
/// is present) with `exec_streams` per device unless `FERRY_EXEC_STREAMS` says otherwise, runs
/// `body`, prints an error with the rank before shutting down, and turns the outcome into the
/// process exit status.
pub fn main_with_runtime(
    name: &str,
    devices: Option<DeviceSpec>,
    exec_streams: Option<usize>,
    body: impl FnOnce(&Runtime) -> anyhow::Result<()>,
) -> std::process::ExitCode {
    main_with_config(name, ferry::config::Config::default(), devices, exec_streams, body)
}

/// [`main_with_runtime`] from a driver's own `defaults` (the settings its task graph runs best
/// with), which the `FERRY_*` environment still overrides.
pub fn main_with_config(
    name: &str,
    defaults: ferry::config::Config,
    devices: Option<DeviceSpec>,
    exec_streams: Option<usize>,
    body: impl FnOnce(&Runtime) -> anyhow::Result<()>,
) -> std::process::ExitCode {
    let mut builder = Runtime::builder().config(defaults).from_env();
    if let (Some(n), None) = (exec_streams, std::env::var_os("FERRY_EXEC_STREAMS")) {
        builder = builder.exec_streams(n);
    }
    match devices {
        Some(d) => builder = builder.devices(d),
        None if std::env::var_os("FERRY_DEVICES").is_none() => builder = builder.devices(DeviceSpec::Auto),
        None => {}
    }
    let rt = match builder.build() {
        Ok(rt) => std::sync::Arc::new(rt),
        Err(e) => {
            eprintln!("{name}: error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // A progress bar on rank 0 when stderr is a terminal (and not -q).
    let bar = progress::Progress::start(&rt, name, quiet());
    let result = body(&rt);
    drop(bar);
    let result = result.and_then(|()| rt.shutdown().map_err(anyhow::Error::from));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error on rank {}: {e:#}", rt.rank());
            drop(rt);
            std::process::ExitCode::FAILURE
        }
    }
}

/// Today's date (UTC) as `YYYY-MM-DD`, for benchmark records.
///
/// Days since 1970-01-01 to a civil date by Howard Hinnant's `civil_from_days`
/// (<https://howardhinnant.github.io/date_algorithms.html>).
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
