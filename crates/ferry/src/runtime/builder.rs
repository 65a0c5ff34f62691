//! Configuring and starting a runtime.

use super::Runtime;
use crate::config::Config;
use ferry_base::error::{FerryError, Result};

/// Configures and starts a [`Runtime`].
#[derive(Debug, Clone, Default)]
pub struct RuntimeBuilder {
    config: Config,
    env_error: Option<String>,
}

impl RuntimeBuilder {
    /// Applies the `FERRY_*` environment variables over the configuration so far (see
    /// [`crate::config`]). An invalid variable is reported by [`RuntimeBuilder::build`].
    pub fn from_env(mut self) -> Self {
        match crate::config::ferry_vars().and_then(|vars| self.config.apply_vars(vars)) {
            Ok(()) => {}
            // Kept as the message: `build` wraps it again.
            Err(FerryError::Config(m)) => self.env_error = Some(m),
            Err(e) => self.env_error = Some(e.to_string()),
        }
        self
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Selects the devices (overrides `FERRY_DEVICES`).
    pub fn devices(mut self, spec: crate::DeviceSpec) -> Self {
        self.config.devices = spec;
        self
    }

    /// Sets the exec streams per device (1 to [`crate::config::MAX_EXEC_STREAMS`]; overrides
    /// `FERRY_EXEC_STREAMS`; other values make `build` fail with [`crate::FerryError::Config`]). Compute-bound
    /// tile kernels gain from more concurrency (8: the CUDA default); memory-bound ones from fewer.
    pub fn exec_streams(mut self, n: usize) -> Self {
        self.config.exec_streams = Some(n);
        self
    }

    /// Sets the number of CPU workers (1 to [`crate::config::MAX_WORKERS`]; other values make
    /// `build` fail with [`crate::FerryError::Config`]).
    pub fn workers(mut self, n: usize) -> Self {
        self.config.workers = Some(n);
        self
    }

    /// Starts the MPI progress thread — which initialises MPI (funneled) unless the caller did
    /// (then ferry uses the caller's MPI, which must provide `MPI_THREAD_MULTIPLE`, and leaves it
    /// initialised at shutdown) —, the devices, the CPU workers and tracing.
    ///
    /// # Errors
    /// [`FerryError::Config`] for an invalid configuration or environment variable;
    /// [`FerryError::MpiInit`] when MPI was finalized already in this process, was initialised
    /// by the caller below `MPI_THREAD_MULTIPLE`, or provides less than `MPI_THREAD_FUNNELED`.
    pub fn build(self) -> Result<Runtime> {
        if let Some(e) = self.env_error {
            return Err(FerryError::Config(e));
        }
        Runtime::start(self.config)
    }
}
