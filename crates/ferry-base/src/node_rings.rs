//! A rank's inbound rings in shared memory: one [`crate::ring`] per rank of its node, at the
//! index of that rank's local rank, in one mapping that the node's other ranks map to write into
//! the ring kept for them; optionally, after them, one [`crate::byte_ring`] per rank too, for
//! payloads longer than a slot. The communication engine carries active messages between ranks
//! of a node on them; the task runtime's control ring its descriptors and acknowledgements.
//!
//! The mapping starts with a header (a magic word and a random nonce that the owner also
//! publishes), so that a peer that opens another process's file by the same pid and descriptor
//! (ranks in separate PID namespaces that report the same host name) finds out and stays on MPI.

use crate::byte_ring::{self, ByteReader, ByteWriter};
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
    /// Data bytes of each byte ring after the message rings (0: none).
    pub payload: u32,
}

impl RingCaps {
    /// Bytes of [`RingCaps::to_bytes`].
    pub const BYTES: usize = ShmHandle::BYTES + 20;

    /// As bytes, for a start-up exchange of fixed layout.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..ShmHandle::BYTES].copy_from_slice(&self.handle.to_bytes());
        out[ShmHandle::BYTES..ShmHandle::BYTES + 8].copy_from_slice(&self.nonce.to_le_bytes());
        out[ShmHandle::BYTES + 8..ShmHandle::BYTES + 12].copy_from_slice(&self.local_rank.to_le_bytes());
        out[ShmHandle::BYTES + 12..ShmHandle::BYTES + 16].copy_from_slice(&self.rings.to_le_bytes());
        out[ShmHandle::BYTES + 16..].copy_from_slice(&self.payload.to_le_bytes());
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
            payload: word(ShmHandle::BYTES + 16),
        })
    }
}

/// This rank's inbound rings, created before the ranks exchange what they can do, so that every
/// ring is ready before any peer can write into it.
pub struct Inbound {
    mem: SharedMem,
    local_rank: u32,
    rings: u32,
    payload: u32,
    nonce: u64,
}

/// The first byte of ring `k` in a mapping of rings.
fn ring_at(mem: &SharedMem, k: usize) -> *mut u8 {
    // SAFETY: callers check `k` against the mapping's ring count, which its length covers.
    unsafe { mem.base().add(HEADER + k * ring::RING_BYTES) }
}

/// Bytes of a mapping of `rings` message rings and, with `payload` > 0, as many byte rings of
/// `payload` data bytes.
fn mapping_bytes(rings: u32, payload: u32) -> usize {
    let byte_rings = if payload > 0 {
        rings as usize * byte_ring::ring_bytes(payload as usize)
    } else {
        0
    };
    HEADER + rings as usize * ring::RING_BYTES + byte_rings
}

/// The first byte of byte ring `k` in a mapping of `rings` message rings with byte rings of
/// `payload` data bytes.
fn byte_ring_at(mem: &SharedMem, rings: u32, payload: u32, k: usize) -> *mut u8 {
    // SAFETY: callers check `k` against the ring count and `payload` > 0; the mapping's length
    // covers them (`mapping_bytes`).
    unsafe {
        mem.base()
            .add(HEADER + rings as usize * ring::RING_BYTES + k * byte_ring::ring_bytes(payload as usize))
    }
}

/// The end that writes into the ring a peer keeps for this rank, with the peer's mapping it
/// points into.
pub struct PeerRing {
    /// The producer (one per ring: the owner serializes its pushes).
    pub ring: Producer,
    /// The writer of the byte ring the peer keeps for this rank, where its mapping has them.
    pub payload: Option<ByteWriter>,
    /// The peer's mapping, kept while the producer points into it.
    _mem: SharedMem,
}

impl Inbound {
    /// A mapping of `local_size` rings (named `name` where the system shows it), each prepared
    /// for its first lap, for the rank of local rank `local_rank`; with `payload` > 0, also a
    /// byte ring of `payload` data bytes per rank.
    ///
    /// # Errors
    /// The shared memory could not be made.
    pub fn create(name: &std::ffi::CStr, local_rank: u32, local_size: u32, payload: u32) -> std::io::Result<Inbound> {
        let rings = local_size.max(1);
        let mem = SharedMem::create(name, mapping_bytes(rings, payload))?;
        for k in 0..rings as usize {
            // SAFETY: ring k lies within the fresh, page-aligned mapping; no producer exists yet.
            unsafe { ring::prepare(ring_at(&mem, k)) };
            if payload > 0 {
                // SAFETY: as above, for byte ring k.
                unsafe { byte_ring::prepare(byte_ring_at(&mem, rings, payload, k)) };
            }
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
            payload,
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
            payload: self.payload,
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

    /// The reading end of the byte ring that the rank of local rank `local` writes into; `None`
    /// past the mapping's rings, for this rank's own, or without byte rings.
    ///
    /// # Safety
    /// At most one reader per byte ring exists at a time, and it does not outlive `self`.
    pub unsafe fn payload_reader(&self, local: u32) -> Option<ByteReader> {
        if local >= self.rings || local == self.local_rank || self.payload == 0 {
            return None;
        }
        let at = byte_ring_at(&self.mem, self.rings, self.payload, local as usize);
        // SAFETY: byte ring `local` lies in the mapping and was prepared by `create`; the
        // caller vouches for one reader that `self` outlives.
        Some(unsafe { ByteReader::new(at, self.payload as usize) })
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
        let need = mapping_bytes(peer.rings, peer.payload);
        if need > mem.len() {
            return Err(invalid(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the peer's rings take {} bytes, fewer than its {} rings of {} payload bytes need",
                    mem.len(),
                    peer.rings,
                    peer.payload
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
        let payload = (peer.payload > 0).then(|| {
            let at = byte_ring_at(&mem, peer.rings, peer.payload, self.local_rank as usize);
            // SAFETY: as above, for the byte ring at this rank's local rank.
            unsafe { ByteWriter::new(at, peer.payload as usize) }
        });
        Ok(PeerRing {
            ring,
            payload,
            _mem: mem,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks of a node: each writes into the ring the other keeps for it, and reads its own;
    /// a peer's caps with the wrong nonce, or without a ring for this rank, are refused.
    #[test]
    fn peers_write_into_each_others_rings() {
        let a = Inbound::create(c"ferry-rings-test", 0, 2, 4096).unwrap();
        let b = Inbound::create(c"ferry-rings-test", 1, 2, 4096).unwrap();
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
        // The byte rings: a payload written into b's ring for a, read back at b.
        // SAFETY: one reader per byte ring, dropped before the mappings.
        let mut bytes_at_b = unsafe { b.payload_reader(0).unwrap() };
        // SAFETY: a rank has no byte ring for itself.
        assert!(unsafe { b.payload_reader(1) }.is_none());
        let long = vec![0xabu8; 3000];
        let at = a_to_b.payload.as_mut().unwrap().write(&long).unwrap();
        assert!(a_to_b.ring.push_with(5, 9, 0, &at.to_le_bytes()));
        let m = at_b.pop().unwrap();
        let start = u64::from_le_bytes(m.bytes().try_into().unwrap());
        assert_eq!(bytes_at_b.take(start, long.len(), |p| p.to_vec()).unwrap(), long);
        let forged = RingCaps {
            nonce: cb.nonce ^ 1,
            ..cb
        };
        assert!(
            a.open_peer(&forged).is_err(),
            "a mapping whose header is not the peer's"
        );
        let lone = Inbound::create(c"ferry-rings-test", 0, 1, 0).unwrap();
        assert!(lone.open_peer(&cb).is_err(), "a mapping with no ring for the peer");
        // SAFETY: no byte rings in this mapping.
        assert!(unsafe { lone.payload_reader(0) }.is_none());
        let oversold = RingCaps {
            payload: cb.payload * 2,
            ..cb
        };
        assert!(a.open_peer(&oversold).is_err(), "byte rings past the mapping's end");
    }
}
