//! Log lines on stderr and, with `FERRY_TRACE=DIR`, one Chrome/Perfetto trace per rank
//! (`DIR/trace-rank{r}.json`; merge them with `cargo xtask trace-merge DIR`).

use crate::config::Config;
use crate::error::{FerryError, Rank, Result};
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::prelude::*;

/// Keeps the trace file open; dropping it flushes the file.
pub(crate) struct TraceGuard {
    // In a mutex only to make the runtime `Sync` (the guard holds a `Cell`); it is never locked,
    // just dropped at shutdown, which flushes the trace.
    _chrome: std::sync::Mutex<Option<tracing_chrome::FlushGuard>>,
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
            std::fs::create_dir_all(dir).map_err(|source| FerryError::Io {
                path: dir.display().to_string(),
                source,
            })?;
            let path = dir.join(format!("trace-rank{rank}.json"));
            let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
                .file(path)
                .include_args(true)
                .build();
            (Some(layer.with_filter(LevelFilter::INFO)), Some(guard))
        }
        None => (None, None),
    };
    let installed = tracing_subscriber::registry().with(fmt).with(chrome).try_init().is_ok();
    Ok(TraceGuard {
        _chrome: std::sync::Mutex::new(if installed { guard } else { None }),
    })
}
