//! Process-wide debugging switches read from the environment once.

/// Whether `FERRY_CHECK_COHERENCE` is on (read once per process): the GPU manager and the CPU
/// workers then hash every tile copy where it changes hands and log `coherence:` errors when a
/// location marked current holds other data. A debugging aid for the emulated backend (it reads
/// device memory directly), costly; the tests run the oracle with it.
#[inline]
pub fn check_coherence() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("FERRY_CHECK_COHERENCE")
            .ok()
            .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "on" | "yes"))
            .unwrap_or(false)
    })
}
