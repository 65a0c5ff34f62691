//! Runtime configuration: set in code through [`crate::RuntimeBuilder`] or from `FERRY_*`
//! environment variables. This module is the one place that lists them; `docs/configuration.md`
//! repeats the table for users.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `FERRY_WORKERS` | CPU worker threads per rank | cores ÷ ranks on the node, at least 1 |
//! | `FERRY_EAGER_BYTES` | payloads up to this size are sent at once, outside the send window | `64K` |
//! | `FERRY_MAX_SENDS` | rendezvous sends in flight per rank | `64` |
//! | `FERRY_MAX_SENDS_PER_PEER` | rendezvous sends in flight per destination | `16` |
//! | `FERRY_PROGRESS_SLEEP_US` | longest nap of the MPI thread while requests are in flight, µs | `50` |
//! | `FERRY_TRACE` | directory for one Chrome/Perfetto trace per rank (`trace-rank{r}.json`) | off |
//! | `FERRY_LOG` | `tracing` filter for log lines on stderr (e.g. `info`, `ferry=debug`) | `warn` |
//! | `FERRY_ABORT_ON_ERROR` | after an error that leaves transfers in flight, end with `MPI_Abort` | `1` |
//!
//! Sizes take an optional binary suffix: `K`, `M`, `G` (powers of 1024). Booleans are
//! `1/0/true/false/on/off/yes/no`. An unknown `FERRY_*` variable is an error, so a misspelt knob
//! never goes unnoticed.

use crate::error::{FerryError, Result};
use std::path::PathBuf;

/// Every variable this module understands, with a one-line description (for error messages).
pub const VARIABLES: &[(&str, &str)] = &[
    ("FERRY_WORKERS", "CPU worker threads per rank"),
    ("FERRY_EAGER_BYTES", "eager payload threshold in bytes (K/M/G suffixes)"),
    ("FERRY_MAX_SENDS", "rendezvous sends in flight per rank"),
    ("FERRY_MAX_SENDS_PER_PEER", "rendezvous sends in flight per destination"),
    (
        "FERRY_PROGRESS_SLEEP_US",
        "longest idle nap of the MPI thread, microseconds",
    ),
    ("FERRY_TRACE", "directory for per-rank Chrome traces"),
    ("FERRY_LOG", "tracing filter for stderr logs"),
    (
        "FERRY_ABORT_ON_ERROR",
        "MPI_Abort after an error with transfers in flight",
    ),
];

/// The runtime's knobs. Construct with [`Config::default`] and adjust, or read from the
/// environment with [`Config::from_env`].
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// CPU worker threads; `None` picks cores ÷ node-local ranks (at least 1).
    pub workers: Option<usize>,
    /// Payloads of at most this many bytes are posted immediately, outside the send window.
    pub eager_bytes: usize,
    /// Rendezvous sends in flight per rank (≥ 1).
    pub max_sends: usize,
    /// Rendezvous sends in flight per destination rank (≥ 1).
    pub max_sends_per_peer: usize,
    /// Longest nap of the MPI progress thread while requests are in flight, in microseconds.
    pub progress_sleep_us: u64,
    /// Directory for per-rank Chrome traces; `None` disables tracing to file.
    pub trace_dir: Option<PathBuf>,
    /// `tracing` env-filter directive for stderr logs.
    pub log_filter: String,
    /// Call `MPI_Abort` at shutdown after an error that leaves transfers in flight.
    pub abort_on_error: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workers: None,
            eager_bytes: 64 << 10,
            max_sends: 64,
            max_sends_per_peer: 16,
            progress_sleep_us: 50,
            trace_dir: None,
            log_filter: "warn".into(),
            abort_on_error: true,
        }
    }
}

impl Config {
    /// Reads every `FERRY_*` variable of the process environment over the defaults.
    ///
    /// # Errors
    /// [`FerryError::Config`] for an unparsable value or an unknown `FERRY_*` variable.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        c.apply_vars(std::env::vars())?;
        Ok(c)
    }

    /// Applies `(name, value)` pairs over this configuration; names not starting with `FERRY_`
    /// are ignored. Used by [`Config::from_env`]; public so that tools can apply a saved
    /// environment.
    ///
    /// # Errors
    /// [`FerryError::Config`] for an unparsable value or an unknown `FERRY_*` variable.
    pub fn apply_vars<I, K, V>(&mut self, vars: I) -> Result<()>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        for (k, v) in vars {
            let (k, v) = (k.as_ref(), v.as_ref().trim());
            if !k.starts_with("FERRY_") {
                continue;
            }
            match k {
                "FERRY_WORKERS" => self.workers = Some(parse_count(k, v, 1)?),
                "FERRY_EAGER_BYTES" => self.eager_bytes = parse_size(k, v)?,
                "FERRY_MAX_SENDS" => self.max_sends = parse_count(k, v, 1)?,
                "FERRY_MAX_SENDS_PER_PEER" => self.max_sends_per_peer = parse_count(k, v, 1)?,
                "FERRY_PROGRESS_SLEEP_US" => self.progress_sleep_us = parse_count(k, v, 0)? as u64,
                "FERRY_TRACE" => self.trace_dir = (!v.is_empty()).then(|| PathBuf::from(v)),
                "FERRY_LOG" => self.log_filter = v.to_string(),
                "FERRY_ABORT_ON_ERROR" => self.abort_on_error = parse_bool(k, v)?,
                _ => {
                    let known: Vec<&str> = VARIABLES.iter().map(|(n, _)| *n).collect();
                    return Err(FerryError::Config(format!(
                        "unknown variable {k}; known: {}",
                        known.join(", ")
                    )));
                }
            }
        }
        self.validate()
    }

    /// Checks the invariants between fields.
    ///
    /// # Errors
    /// [`FerryError::Config`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if self.workers == Some(0) {
            return Err(FerryError::Config("workers must be at least 1".into()));
        }
        if self.max_sends == 0 || self.max_sends_per_peer == 0 {
            return Err(FerryError::Config("send windows must be at least 1".into()));
        }
        Ok(())
    }
}

fn parse_count(name: &str, v: &str, min: usize) -> Result<usize> {
    let n: usize = v
        .parse()
        .map_err(|_| FerryError::Config(format!("{name}={v:?}: expected a whole number")))?;
    if n < min {
        return Err(FerryError::Config(format!("{name}={n}: must be at least {min}")));
    }
    Ok(n)
}

/// Parses `123`, `64K`, `8M`, `1G` (binary multiples).
pub(crate) fn parse_size(name: &str, v: &str) -> Result<usize> {
    let bad = || FerryError::Config(format!("{name}={v:?}: expected bytes like 65536, 64K, 8M, 1G"));
    let (digits, shift) = match v.as_bytes().last().map(|b| b.to_ascii_uppercase()) {
        Some(b'K') => (&v[..v.len() - 1], 10),
        Some(b'M') => (&v[..v.len() - 1], 20),
        Some(b'G') => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    let n: usize = digits.trim().parse().map_err(|_| bad())?;
    n.checked_mul(1usize << shift).ok_or_else(bad)
}

fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(FerryError::Config(format!(
            "{name}={v:?}: expected 1/0/true/false/on/off"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_bools_parse() {
        assert_eq!(parse_size("X", "64K").unwrap(), 65536);
        assert_eq!(parse_size("X", "2m").unwrap(), 2 << 20);
        assert_eq!(parse_size("X", "17").unwrap(), 17);
        assert!(parse_size("X", "K").is_err());
        assert!(parse_bool("X", "maybe").is_err());
    }

    #[test]
    fn env_overrides_and_rejects_unknown() {
        let mut c = Config::default();
        c.apply_vars([("FERRY_WORKERS", "3"), ("FERRY_EAGER_BYTES", "1K"), ("PATH", "/bin")])
            .unwrap();
        assert_eq!(c.workers, Some(3));
        assert_eq!(c.eager_bytes, 1024);
        let err = c.apply_vars([("FERRY_WROKERS", "3")]).unwrap_err();
        assert!(err.to_string().contains("unknown variable FERRY_WROKERS"), "{err}");
        assert!(c.apply_vars([("FERRY_WORKERS", "0")]).is_err());
        assert!(c.apply_vars([("FERRY_MAX_SENDS", "-1")]).is_err());
    }
}
