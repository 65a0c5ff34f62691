//! Log lines on stderr and, with `FERRY_TRACE=DIR`, one Chrome/Perfetto trace per rank
//! (`DIR/trace-rank{r}.json`; merge them with `cargo xtask trace-merge DIR`).

use crate::config::Config;
use ferry_base::error::{FerryError, Rank, Result};
use std::sync::OnceLock;
use std::time::Instant;
use tracing_subscriber::filter::EnvFilter;
use tracing_subscriber::prelude::*;

pub(crate) use ferry_base::trace_clock::now_us;

/// The clock the ranks synchronise: the trace clock ([`now_us`]) when this rank writes a trace,
/// else µs since this rank's first call (a rank without a trace file only needs a clock that
/// runs at the same rate).
fn clock_us() -> f64 {
    static START: OnceLock<Instant> = OnceLock::new();
    now_us().unwrap_or_else(|| START.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e6)
}

/// Marks in every rank's trace an instant of its clock with the reading of rank 0's clock at the
/// same instant (`ts_us`, `ref_us`; `rtt_us` bounds the error at half of it), measured by
/// ping-pong with rank 0 (`ferry-comm/src/clock.rs`), so that `cargo xtask trace-merge` can put the ranks
/// on one clock (each rank's trace counts from its own start). Every rank takes part, tracing or
/// not (ranks of one job may differ in `FERRY_TRACE`).
///
/// # Errors
/// A message of the ping-pong failed.
pub(crate) fn sync_clocks(engine: &ferry_engine::EngineHandle) -> Result<()> {
    let pair = engine.sync_clocks(clock_us)?;
    if now_us().is_some() {
        tracing::info!(
            target: "ferry::clock",
            ts_us = pair.local_us,
            ref_us = pair.rank0_us,
            rtt_us = pair.rtt_us,
            "clock.sync"
        );
    }
    Ok(())
}

/// Keeps the trace file open; dropping it flushes the file.
pub(crate) struct TraceGuard {
    // In a mutex only to make the runtime `Sync` (the guard holds a `Cell`); it is never locked,
    // just dropped at shutdown, which flushes the trace.
    chrome: std::sync::Mutex<Option<tracing_chrome::FlushGuard>>,
}

impl Drop for TraceGuard {
    fn drop(&mut self) {
        // The file is closed: a later runtime of this process writes none (the subscriber is
        // global and installed once), so it must not time device work for it either.
        if self.chrome.get_mut().map(|g| g.is_some()).unwrap_or(true) {
            ferry_base::trace_clock::set_running(false);
        }
    }
}

/// Installs the global subscriber. When the application already installed one, ferry's spans go
/// to it and no file is written.
pub(crate) fn init(cfg: &Config, rank: Rank) -> Result<TraceGuard> {
    let filter = EnvFilter::try_new(&cfg.log_filter)
        .map_err(|e| FerryError::Config(format!("FERRY_LOG={:?}: {e}", cfg.log_filter)))?;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_thread_names(true)
        .with_filter(filter);
    let (chrome, guard) = match &cfg.trace_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|error| FerryError::Io {
                path: dir.display().to_string(),
                error,
            })?;
            let path = dir.join(format!("trace-rank{rank}.json"));
            // Opened here, not by the layer (whose `file` panics when the file cannot be created:
            // a directory of that name, no write permission).
            let file = std::fs::File::create(&path).map_err(|error| FerryError::Io {
                path: path.display().to_string(),
                error,
            })?;
            let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
                .writer(file)
                .include_args(true)
                .build();
            // The layer's clock starts as `build` returns (after it has opened the file and
            // started its writer thread, milliseconds): this origin is at most a few ns later.
            ferry_base::trace_clock::set_origin();
            let filter = EnvFilter::try_new(&cfg.trace_filter)
                .map_err(|e| FerryError::Config(format!("FERRY_TRACE_FILTER={:?}: {e}", cfg.trace_filter)))?;
            (Some(layer.with_filter(filter)), Some(guard))
        }
        None => (None, None),
    };
    let writes_trace = chrome.is_some();
    let installed = tracing_subscriber::registry().with(fmt).with(chrome).try_init().is_ok();
    if installed && writes_trace {
        ferry_base::trace_clock::set_running(true);
    }
    Ok(TraceGuard {
        chrome: std::sync::Mutex::new(if installed { guard } else { None }),
    })
}
