//! The disk tier's store: one spill file per rank in the spill directory, sub-allocated in
//! page-aligned slots under a byte budget.
//!
//! A tile gets a slot the first time it spills and keeps it while its copy lives (a later
//! version is written over the old one: no allocator churn, no fragmentation growth from
//! rewrites); the slot goes back when the copy is dropped. The file is unlinked from the moment
//! it is created (`O_TMPFILE` where the file system has it): its space goes back when the
//! process ends, however it ends — a job killed by `MPI_Abort` or a signal leaves no spill file
//! behind. It is sparse, so the budget bounds the disk space the run may take without reserving
//! it up front.

use ferry_base::error::FerryError;
use ferry_device::pool::{Block, Pool};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Slot alignment: a page, so reads and writes of whole tiles never share a page.
const SLOT_ALIGN: u64 = 4096;

/// The spill file of one rank.
pub struct DiskStore {
    dir: PathBuf,
    file: std::fs::File,
    slots: Mutex<Pool>,
    /// Most bytes of slots reserved at once.
    pub peak: AtomicU64,
    /// Fault injection: the 1-based write that fails (0: none), and writes so far.
    fail_write: u64,
    writes: AtomicU64,
}

impl DiskStore {
    /// Creates the spill file in `dir` (created if missing) with room for `budget` bytes.
    ///
    /// # Errors
    /// [`FerryError::Spill`] when the directory cannot be created or written.
    /// `fail_write`: fault injection, the 1-based write that fails (`FERRY_FAULTS=disk-fail:N`;
    /// 0: none).
    pub fn open(dir: &Path, budget: u64, rank: i32, fail_write: u64) -> Result<DiskStore, FerryError> {
        let err = |msg: String| FerryError::Spill {
            dir: dir.display().to_string(),
            msg,
        };
        std::fs::create_dir_all(dir).map_err(|e| err(format!("cannot create the spill directory: {e}")))?;
        let file =
            tempfile::tempfile_in(dir).map_err(|e| err(format!("cannot create the spill file of rank {rank}: {e}")))?;
        Ok(DiskStore {
            dir: dir.to_path_buf(),
            file,
            slots: Mutex::new(Pool::new(budget, SLOT_ALIGN)),
            peak: AtomicU64::new(0),
            fail_write,
            writes: AtomicU64::new(0),
        })
    }

    /// Bytes free on the file system holding `dir` (its parent when `dir` does not exist yet),
    /// for the default budget.
    pub fn free_space(dir: &Path) -> Option<u64> {
        let probe = std::iter::successors(Some(dir), |p| p.parent()).find(|p| p.exists())?;
        let c = std::ffi::CString::new(probe.as_os_str().as_encoded_bytes()).ok()?;
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a NUL-terminated path and `s` a valid out-parameter.
        if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
            return None;
        }
        Some(s.f_bavail as u64 * s.f_frsize as u64)
    }

    /// The spill directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn error(&self, msg: String) -> FerryError {
        FerryError::Spill {
            dir: self.dir.display().to_string(),
            msg,
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for `bytes` bytes.
    ///
    /// # Errors
    /// [`FerryError::Spill`] when the budget has no room left: the spill directory is full.
    pub fn reserve(&self, bytes: usize) -> Result<Block, FerryError> {
        let mut slots = self.slots();
        match slots.alloc(bytes as u64) {
            Some(b) => {
                self.peak.fetch_max(slots.used(), Relaxed);
                Ok(b)
            }
            None => Err(self.error(format!(
                "spill space full: {} of {} bytes (FERRY_SPILL_BYTES) in use, no room for a tile of {bytes} bytes more",
                slots.used(),
                slots.capacity()
            ))),
        }
    }

    /// Gives a slot back.
    pub fn release(&self, b: Block) {
        self.slots().free(b);
    }

    /// Writes `data` into slot `b`.
    ///
    /// # Errors
    /// [`FerryError::Spill`] on a write error (a full file system says so).
    pub fn write(&self, b: Block, data: &[u8]) -> Result<(), FerryError> {
        debug_assert!(data.len() as u64 <= b.len);
        if self.writes.fetch_add(1, Relaxed) + 1 == self.fail_write {
            return Err(self.error(format!(
                "writing {} bytes to the spill file: injected failure (FERRY_FAULTS=disk-fail:{})",
                data.len(),
                self.fail_write
            )));
        }
        self.file
            .write_all_at(data, b.offset)
            .map_err(|e| self.error(format!("writing {} bytes to the spill file: {e}", data.len())))
    }

    /// Reads slot `b` into `out`.
    ///
    /// # Errors
    /// [`FerryError::Spill`] on a read error.
    pub fn read(&self, b: Block, out: &mut [u8]) -> Result<(), FerryError> {
        debug_assert!(out.len() as u64 <= b.len);
        self.file
            .read_exact_at(out, b.offset)
            .map_err(|e| self.error(format!("reading {} bytes from the spill file: {e}", out.len())))
    }
}

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DiskStore({})", self.dir.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_round_trip_and_the_budget_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let d = DiskStore::open(dir.path(), 3 * 4096, 0, 0).unwrap();
        let a = d.reserve(5000).unwrap();
        let data: Vec<u8> = (0..5000).map(|i| (i % 251) as u8).collect();
        d.write(a, &data).unwrap();
        let mut back = vec![0u8; 5000];
        d.read(a, &mut back).unwrap();
        assert_eq!(back, data);
        let err = d.reserve(8192).unwrap_err().to_string();
        assert!(err.contains("spill space full") && err.contains("8192"), "{err}");
        d.release(a);
        assert!(d.reserve(8192).is_ok());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the spill file has no name: nothing is left behind, however the process ends"
        );
    }
}
