//! Memory handles: what a registration is called on every rank.
//!
//! A handle is a fixed-size byte string ([`MEM_HANDLE_BYTES`]) that a framework ships to a peer
//! inside its own messages (PaRSEC's `get_mem_handle_size` / `mem_retrieve` semantics): the
//! owner's rank, the registration's slot and generation, its length and kind, and the job's key.
//! The receiving side decodes it with [`crate::EngineHandle::mem_handle`], which refuses a string that is
//! not a handle or belongs to another job; whether the registration still exists is checked by
//! its owner when an operation reaches it.
//!
//! Layout, little-endian: magic `b"FRYM"` (4), version (2), kind (1), device (1), rank (4),
//! slot (4), generation (4), length (8), job key (8), reserved (4) = 40 bytes.

use crate::error::{EngineError, Result};
use ferry_base::error::Rank;

/// Bytes of an encoded [`MemHandle`].
pub const MEM_HANDLE_BYTES: usize = 40;
const MAGIC: [u8; 4] = *b"FRYM";
const VERSION: u16 = 1;

/// What kind of memory a registration covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemKind {
    /// Host memory (pageable or pinned), allocated by the caller.
    Host,
    /// Device memory of this device (its index among the devices the process sees, below 256),
    /// allocated by the caller (`cudaMalloc`, a pool of its own) or by the engine
    /// ([`crate::EngineHandle::alloc_device`]).
    Device(u32),
}

impl MemKind {
    fn code(self) -> (u8, u8) {
        match self {
            MemKind::Host => (0, 0),
            MemKind::Device(d) => (1, d as u8),
        }
    }

    fn decode(kind: u8, device: u8) -> Result<MemKind> {
        match kind {
            0 => Ok(MemKind::Host),
            1 => Ok(MemKind::Device(u32::from(device))),
            k => Err(EngineError::BadHandle(format!("unknown memory kind {k}"))),
        }
    }

    /// The device, for device memory.
    pub fn device(self) -> Option<usize> {
        match self {
            MemKind::Host => None,
            MemKind::Device(d) => Some(d as usize),
        }
    }
}

/// A registered region of some rank's memory, as any rank names it. Cheap to copy; valid on
/// every rank of the job that made it, until its owner unregisters it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemHandle {
    pub(crate) rank: Rank,
    pub(crate) id: u32,
    pub(crate) generation: u32,
    pub(crate) len: usize,
    pub(crate) kind: MemKind,
    pub(crate) job: u64,
}

impl MemHandle {
    /// The rank that registered the memory.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Registered bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region has no bytes (never: registration refuses empty regions).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The kind of memory.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The handle as the byte string peers decode with [`crate::EngineHandle::mem_handle`].
    pub fn to_bytes(&self) -> [u8; MEM_HANDLE_BYTES] {
        let mut b = [0u8; MEM_HANDLE_BYTES];
        let (kind, device) = self.kind.code();
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6] = kind;
        b[7] = device;
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b[12..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.generation.to_le_bytes());
        b[20..28].copy_from_slice(&(self.len as u64).to_le_bytes());
        b[28..36].copy_from_slice(&self.job.to_le_bytes());
        b
    }

    /// Decodes a handle that [`MemHandle::to_bytes`] made in a job with key `job`.
    ///
    /// # Errors
    /// [`EngineError::BadHandle`] for a string of the wrong length, magic, version or kind, or
    /// a negative rank; [`EngineError::ForeignHandle`] for a handle of another job.
    pub(crate) fn decode(bytes: &[u8], job: u64) -> Result<MemHandle> {
        let b: &[u8; MEM_HANDLE_BYTES] = bytes
            .try_into()
            .map_err(|_| EngineError::BadHandle(format!("{} bytes, a handle has {MEM_HANDLE_BYTES}", bytes.len())))?;
        if b[0..4] != MAGIC {
            return Err(EngineError::BadHandle("wrong magic".into()));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(EngineError::BadHandle(format!(
                "version {version}, this library reads {VERSION}"
            )));
        }
        let kind = MemKind::decode(b[6], b[7])?;
        let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let dword = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let rank = word(8) as i32;
        if rank < 0 {
            return Err(EngineError::BadHandle(format!("negative rank {rank}")));
        }
        let found = dword(28);
        if found != job {
            return Err(EngineError::ForeignHandle { found, expected: job });
        }
        let len = usize::try_from(dword(20)).map_err(|_| EngineError::BadHandle("length overflows".into()))?;
        Ok(MemHandle {
            rank,
            id: word(12),
            generation: word(16),
            len,
            kind,
            job,
        })
    }

    /// Checks that `offset..offset + len` lies inside the region and is not empty.
    pub(crate) fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        if len == 0 {
            return Err(EngineError::InvalidArgument("a transfer of 0 bytes".into()));
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(EngineError::OutOfBounds {
                offset,
                len,
                region: self.len,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h() -> MemHandle {
        MemHandle {
            rank: 3,
            id: 17,
            generation: 9,
            len: 1 << 33,
            kind: MemKind::Device(5),
            job: 0xfeed_beef_1234,
        }
    }

    #[test]
    fn round_trips() {
        let b = h().to_bytes();
        assert_eq!(MemHandle::decode(&b, 0xfeed_beef_1234).unwrap(), h());
    }

    #[test]
    fn refuses_what_is_not_a_handle_of_this_job() {
        let b = h().to_bytes();
        assert!(matches!(
            MemHandle::decode(&b[..39], 0xfeed_beef_1234),
            Err(EngineError::BadHandle(_))
        ));
        assert!(matches!(
            MemHandle::decode(&b, 1),
            Err(EngineError::ForeignHandle {
                found: 0xfeed_beef_1234,
                expected: 1
            })
        ));
        let mut bad = b;
        bad[0] = b'X';
        assert!(matches!(
            MemHandle::decode(&bad, 0xfeed_beef_1234),
            Err(EngineError::BadHandle(_))
        ));
        let mut bad = b;
        bad[6] = 99;
        assert!(matches!(
            MemHandle::decode(&bad, 0xfeed_beef_1234),
            Err(EngineError::BadHandle(_))
        ));
    }

    #[test]
    fn ranges() {
        let h = MemHandle { len: 100, ..h() };
        assert!(h.check_range(0, 100).is_ok());
        assert!(h.check_range(99, 1).is_ok());
        assert!(matches!(h.check_range(99, 2), Err(EngineError::OutOfBounds { .. })));
        assert!(matches!(
            h.check_range(usize::MAX, 2),
            Err(EngineError::OutOfBounds { .. })
        ));
        assert!(matches!(h.check_range(0, 0), Err(EngineError::InvalidArgument(_))));
    }
}
