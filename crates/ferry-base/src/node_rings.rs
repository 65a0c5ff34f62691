//! A rank's inbound rings in shared memory: one [`crate::ring`] per rank of its node, at the
//! index of that rank's local rank, in one mapping that the node's other ranks map to write into
//! the ring kept for them. The communication engine carries active messages between ranks of a
//! node on them; the task runtime's control ring its descriptors and acknowledgements.
//!
//! The mapping starts with a header (a magic word and a random nonce that the owner also
//! publishes), so that a peer that opens another process's file by the same pid and descriptor
//! (ranks in separate PID namespaces that report the same host name) finds out and stays on MPI.

use crate::ring::{self, Consumer, Producer};
use crate::shm::{SharedMem, ShmHandle};

/// Marks the start of a rank's mapping of rings ("ferryrng").
const MAGIC: u64 = u64::from_le_bytes(*b"ferryrng");
/// Bytes before the first ring: the magic and the mapping's nonce, padded to a slot.
const HEADER: usize = 128;

/// What a rank publishes of its inbound rings at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RingCaps {
    /// The mapping of its inbound rings.
    pub handle: ShmHandle,
    /// The random number the mapping's header holds too.
    pub nonce: u64,
    /// Its local rank: the index of the ring it reads in every other rank's mapping.
    pub local_rank: u32,
    /// Rings in its mapping (its node's rank count).
    pub rings: u32,
}

impl RingCaps {
    /// Bytes of [`RingCaps::to_bytes`].
    pub const BYTES: usize = ShmHandle::BYTES + 16;

    /// As bytes, for a start-up exchange of fixed layout.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..ShmHandle::BYTES].copy_from_slice(&self.handle.to_bytes());
        out[ShmHandle::BYTES..ShmHandle::BYTES + 8].copy_from_slice(&self.nonce.to_le_bytes());
        out[ShmHandle::BYTES + 8..ShmHandle::BYTES + 12].copy_from_slice(&self.local_rank.to_le_bytes());
        out[ShmHandle::BYTES + 12..].copy_from_slice(&self.rings.to_le_bytes());
        out
    }

    /// Reads [`RingCaps::to_bytes`]; `None` for bytes of another length or no handle.
    pub fn from_bytes(b: &[u8]) -> Option<RingCaps> {
        if b.len() != Self::BYTES {
            return None;
        }
        let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        Some(RingCaps {
            handle: ShmHandle::from_bytes(&b[..ShmHandle::BYTES])?,
            nonce: u64::from_le_bytes(b[ShmHandle::BYTES..ShmHandle::BYTES + 8].try_into().expect("8 bytes")),
            local_rank: word(ShmHandle::BYTES + 8),
            rings: word(ShmHandle::BYTES + 12),
        })
    }
}

/// This rank's inbound rings, created before the ranks exchange what they can do, so that every
/// ring is ready before any peer can write into it.
pub struct Inbound {
    mem: SharedMem,
    local_rank: u32,
    rings: u32,
    nonce: u64,
}

/// The first byte of ring `k` in a mapping of rings.
fn ring_at(mem: &SharedMem, k: usize) -> *mut u8 {
    // SAFETY: callers check `k` against the mapping's ring count, which its length covers.
    unsafe { mem.base().add(HEADER + k * ring::RING_BYTES) }
}

/// The end that writes into the ring a peer keeps for this rank, with the peer's mapping it
/// points into.
pub struct PeerRing {
    /// The producer (one per ring: the owner serializes its pushes).
    pub ring: Producer,
    /// The peer's mapping, kept while the producer points into it.
    _mem: SharedMem,
}

impl Inbound {
    /// A mapping of `local_size` rings (named `name` where the system shows it), each prepared
    /// for its first lap, for the rank of local rank `local_rank`.
    ///
    /// # Errors
    /// The shared memory could not be made.
    pub fn create(name: &std::ffi::CStr, local_rank: u32, local_size: u32) -> std::io::Result<Inbound> {
        let rings = local_size.max(1);
        let mem = SharedMem::create(name, HEADER + rings as usize * ring::RING_BYTES)?;
        for k in 0..rings as usize {
            // SAFETY: ring k lies within the fresh, page-aligned mapping; no producer exists yet.
            unsafe { ring::prepare(ring_at(&mem, k)) };
        }
        let nonce = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            h.finish()
        };
        // SAFETY: the header's 16 bytes lie at the start of the fresh, page-aligned mapping.
        unsafe {
            (mem.base() as *mut u64).write(MAGIC);
            (mem.base() as *mut u64).add(1).write(nonce);
        }
        Ok(Inbound {
            mem,
            local_rank,
            rings,
            nonce,
        })
    }

    /// What peers need to write here (`None`: a mapping that cannot be shared).
    pub fn caps(&self) -> Option<RingCaps> {
        self.mem.handle().map(|handle| RingCaps {
            handle,
            nonce: self.nonce,
            local_rank: self.local_rank,
            rings: self.rings,
        })
    }

    /// Rings in the mapping.
    pub fn rings(&self) -> u32 {
        self.rings
    }

    /// The reading end of the ring that the rank of local rank `local` writes into; `None` past
    /// the mapping's rings or for this rank's own.
    ///
    /// # Safety
    /// At most one consumer per ring exists at a time, and it does not outlive `self`.
    pub unsafe fn consumer(&self, local: u32) -> Option<Consumer> {
        if local >= self.rings || local == self.local_rank {
            return None;
        }
        // SAFETY: ring `local` lies in the mapping and was prepared by `create`; the caller
        // vouches for one consumer that `self` outlives.
        Some(unsafe { Consumer::new(ring_at(&self.mem, local as usize)) })
    }

    /// Maps `peer`'s rings and returns the end that writes into the one it keeps for this rank.
    ///
    /// # Errors
    /// The peer's mapping cannot be opened, is not the peer's (its header), or has no ring for
    /// this rank's local rank.
    pub fn open_peer(&self, peer: &RingCaps) -> std::io::Result<PeerRing> {
        let invalid = |kind, msg: String| std::io::Error::new(kind, msg);
        if peer.local_rank >= self.rings || peer.local_rank == self.local_rank {
            return Err(invalid(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "local rank {} has no ring of its own here ({} rings, this rank's local rank {})",
                    peer.local_rank, self.rings, self.local_rank
                ),
            ));
        }
        if self.local_rank >= peer.rings {
            return Err(invalid(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the peer has {} rings, none for local rank {}",
                    peer.rings, self.local_rank
                ),
            ));
        }
        let mem = SharedMem::open(peer.handle)?;
        let need = HEADER + peer.rings as usize * ring::RING_BYTES;
        if need > mem.len() {
            return Err(invalid(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the peer's rings take {} bytes, fewer than its {} rings need",
                    mem.len(),
                    peer.rings
                ),
            ));
        }
        // SAFETY: the header lies within the mapping (checked above).
        let (magic, nonce) = unsafe {
            (
                (mem.base() as *const u64).read(),
                (mem.base() as *const u64).add(1).read(),
            )
        };
        if (magic, nonce) != (MAGIC, peer.nonce) {
            return Err(invalid(
                std::io::ErrorKind::InvalidData,
                "the file mapped is not the peer's rings (another process of that pid and descriptor?)".into(),
            ));
        }
        // SAFETY: in bounds (checked); the peer prepared every ring before publishing its
        // handle; only this rank writes into the ring at its local rank; `mem` moves into the
        // result with the producer, which it keeps mapped.
        let ring = unsafe { Producer::new(ring_at(&mem, self.local_rank as usize)) };
        Ok(PeerRing { ring, _mem: mem })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks of a node: each writes into the ring the other keeps for it, and reads its own;
    /// a peer's caps with the wrong nonce, or without a ring for this rank, are refused.
    #[test]
    fn peers_write_into_each_others_rings() {
        let a = Inbound::create(c"ferry-rings-test", 0, 2).unwrap();
        let b = Inbound::create(c"ferry-rings-test", 1, 2).unwrap();
        let (ca, cb) = (a.caps().unwrap(), b.caps().unwrap());
        assert_eq!(RingCaps::from_bytes(&ca.to_bytes()), Some(ca));
        assert_eq!(RingCaps::from_bytes(&ca.to_bytes()[1..]), None);
        let mut a_to_b = a.open_peer(&cb).unwrap();
        let mut b_to_a = b.open_peer(&ca).unwrap();
        // SAFETY: one consumer per ring, dropped before the mappings.
        let (mut at_b, mut at_a) = unsafe { (b.consumer(0).unwrap(), a.consumer(1).unwrap()) };
        // SAFETY: a rank has no ring for itself.
        assert!(unsafe { a.consumer(0) }.is_none());
        assert!(a_to_b.ring.push(3, 7, b"to b"));
        assert!(b_to_a.ring.push(4, 8, b"to a"));
        let m = at_b.pop().unwrap();
        assert_eq!((m.channel, m.tag, m.bytes()), (3, 7, &b"to b"[..]));
        let m = at_a.pop().unwrap();
        assert_eq!((m.channel, m.tag, m.bytes()), (4, 8, &b"to a"[..]));
        assert!(at_a.pop().is_none() && at_b.pop().is_none());
        let forged = RingCaps {
            nonce: cb.nonce ^ 1,
            ..cb
        };
        assert!(
            a.open_peer(&forged).is_err(),
            "a mapping whose header is not the peer's"
        );
        let lone = Inbound::create(c"ferry-rings-test", 0, 1).unwrap();
        assert!(lone.open_peer(&cb).is_err(), "a mapping with no ring for the peer");
    }
}
