//! Memory shared between the processes of one node: an anonymous file (`memfd`) mapped by the
//! process that creates it and, through `/proc/<pid>/fd/<fd>`, by the other ranks of the node.
//!
//! What lives there: the pools of emulated devices (the emulated counterpart of CUDA IPC) and the
//! control rings between ranks of one node (`ferry-transfer/src/ring.rs`). Linux only, like `memfd`.

use std::ffi::CString;
use std::io;

/// A shared mapping, page-aligned and zeroed when created. Unmapped (and, for the creator, its
/// file closed) on drop; another process's mapping stays valid until that process unmaps it.
#[derive(Debug)]
pub struct SharedMem {
    base: *mut u8,
    len: usize,
    /// The creator's descriptor of the file (what others open through `/proc`); `None` for a
    /// mapping of another process's file.
    fd: Option<libc::c_int>,
}

// SAFETY: plain memory; what is stored in it is synchronised by its users (atomics, stream
// order).
unsafe impl Send for SharedMem {}
// SAFETY: as above; `SharedMem` itself is never mutated after creation.
unsafe impl Sync for SharedMem {}

/// What another process needs to map a [`SharedMem`]: the creator's process id, the file's
/// descriptor there, and the length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShmHandle {
    /// Process id of the creator.
    pub pid: u32,
    /// The segment's file descriptor in the creator's process.
    pub fd: i32,
    /// Bytes of the segment.
    pub len: u64,
}

impl ShmHandle {
    /// Bytes of [`ShmHandle::to_bytes`].
    pub const BYTES: usize = 16;

    /// Little-endian `pid`, `fd`, `len`.
    pub fn to_bytes(self) -> [u8; Self::BYTES] {
        let mut h = [0u8; Self::BYTES];
        h[0..4].copy_from_slice(&self.pid.to_le_bytes());
        h[4..8].copy_from_slice(&self.fd.to_le_bytes());
        h[8..16].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// The inverse of [`ShmHandle::to_bytes`]; `None` for a slice of another length.
    pub fn from_bytes(b: &[u8]) -> Option<ShmHandle> {
        let b: &[u8; Self::BYTES] = b.try_into().ok()?;
        Some(ShmHandle {
            pid: u32::from_le_bytes(b[0..4].try_into().ok()?),
            fd: i32::from_le_bytes(b[4..8].try_into().ok()?),
            len: u64::from_le_bytes(b[8..16].try_into().ok()?),
        })
    }
}

impl SharedMem {
    /// Creates and maps `len` bytes (at least 1), zeroed. `name` shows in `/proc/<pid>/fd`.
    ///
    /// # Errors
    /// The failing system call (`memfd_create`, `ftruncate`, `mmap`) and the OS error.
    pub fn create(name: &std::ffi::CStr, len: usize) -> io::Result<SharedMem> {
        let len = len.max(1);
        let fail = |op: &str| {
            io::Error::new(
                io::Error::last_os_error().kind(),
                format!("{op}: {}", io::Error::last_os_error()),
            )
        };
        // SAFETY: plain system calls; every result is checked.
        unsafe {
            let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC);
            if fd < 0 {
                return Err(fail("memfd_create"));
            }
            if libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = fail("ftruncate");
                libc::close(fd);
                return Err(e);
            }
            match map(fd, len) {
                Ok(base) => Ok(SharedMem {
                    base,
                    len,
                    fd: Some(fd),
                }),
                Err(e) => {
                    libc::close(fd);
                    Err(e)
                }
            }
        }
    }

    /// Maps another process's [`SharedMem`] through `/proc/<pid>/fd/<fd>`.
    ///
    /// # Errors
    /// An empty handle, a file shorter than the handle says, or the failing system call
    /// (`open`, `fstat`, `mmap`) with the OS error and the path (a process that has exited, or
    /// one this process may not trace, cannot be opened).
    pub fn open(h: ShmHandle) -> io::Result<SharedMem> {
        let bad = |msg: String| io::Error::new(io::ErrorKind::InvalidInput, msg);
        if h.len == 0 {
            return Err(bad("a shared-memory handle of 0 bytes".into()));
        }
        let len = usize::try_from(h.len).map_err(|_| bad(format!("{} bytes do not fit this process", h.len)))?;
        let path = CString::new(format!("/proc/{}/fd/{}", h.pid, h.fd)).map_err(|e| bad(e.to_string()))?;
        // SAFETY: plain system calls; every result is checked; the mapping is undone in Drop.
        unsafe {
            let f = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if f < 0 {
                let e = io::Error::last_os_error();
                return Err(io::Error::new(
                    e.kind(),
                    format!("open {}: {e}", path.to_string_lossy()),
                ));
            }
            // A file shorter than the handle says (not the creator's, or truncated) would make
            // reads past its end fault (SIGBUS) instead of failing here.
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(f, &mut st) != 0 || (st.st_size as u64) < h.len {
                libc::close(f);
                return Err(bad(format!(
                    "{} holds {} bytes, fewer than the {} its handle announces",
                    path.to_string_lossy(),
                    st.st_size,
                    h.len
                )));
            }
            let r = map(f, len);
            libc::close(f);
            Ok(SharedMem {
                base: r.map_err(|e| io::Error::new(e.kind(), format!("{e} ({})", path.to_string_lossy())))?,
                len,
                fd: None,
            })
        }
    }

    /// The first byte of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Whether the mapping is empty (never, for a segment that was created or opened).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// What another process of the node maps this with; `None` for a mapping of another
    /// process's memory.
    pub fn handle(&self) -> Option<ShmHandle> {
        self.fd.map(|fd| ShmHandle {
            pid: std::process::id(),
            fd,
            len: self.len as u64,
        })
    }
}

/// `mmap` of `len` bytes of `fd`, shared and writable.
///
/// # Safety
/// `fd` is an open descriptor of a file of at least `len` bytes.
unsafe fn map(fd: libc::c_int, len: usize) -> io::Result<*mut u8> {
    // SAFETY: the caller's contract; the result is checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("mmap: {e}")));
    }
    Ok(base as *mut u8)
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // SAFETY: mapped (and opened) in `create`/`open`; the owner guarantees nothing uses it
        // any more.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
            if let Some(fd) = self.fd {
                libc::close(fd);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second mapping of the same file (what another rank does) sees the creator's writes and
    /// the creator sees its; handles survive their byte form; bad handles are refused.
    #[test]
    fn a_second_mapping_shares_the_bytes() {
        let a = SharedMem::create(c"ferry-test", 3 * 4096 + 5).unwrap();
        assert_eq!(a.len(), 3 * 4096 + 5);
        let h = a.handle().unwrap();
        assert_eq!(ShmHandle::from_bytes(&h.to_bytes()), Some(h));
        assert_eq!(ShmHandle::from_bytes(&[0u8; 15]), None);
        let b = SharedMem::open(h).unwrap();
        assert!(
            b.handle().is_none(),
            "a mapping of another's memory has no handle to give"
        );
        // SAFETY: both mappings are `len` bytes long.
        unsafe {
            assert_eq!(*a.base().add(4096), 0, "created zeroed");
            *a.base().add(4096) = 7;
            assert_eq!(*b.base().add(4096), 7);
            *b.base().add(3 * 4096 + 4) = 9;
            assert_eq!(*a.base().add(3 * 4096 + 4), 9);
        }
        let gone = ShmHandle { fd: -1, ..h };
        let e = SharedMem::open(gone).unwrap_err();
        assert!(e.to_string().contains("/proc/"), "{e}");
        assert!(SharedMem::open(ShmHandle { len: 0, ..h }).is_err());
        let long = SharedMem::open(ShmHandle { len: h.len + 1, ..h }).unwrap_err();
        assert!(long.to_string().contains("fewer than"), "{long}");
    }
}
