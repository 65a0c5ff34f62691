//! Leases: the IPC route without a message before the copy.
//!
//! Every rank that exports device memory publishes its device registrations in a table in
//! shared memory (`memfd`, mapped by the other ranks of its node at start-up). A slot holds
//! one word — the registration's generation, an open bit and a count of remote pins — beside
//! the registration's length and its exported allocation (the CUDA IPC handle and offset).
//!
//! - **Owner** ([`LeaseTable`]): `register` writes the length and export, then opens the word
//!   with the generation (release store). `unregister` closes it with a compare-and-swap that
//!   succeeds only while no remote pin is held, so a registration that a peer is copying from
//!   or into answers [`crate::EngineError::Busy`], as one with local operations in flight does.
//! - **Origin** ([`PeerLeases::acquire`]): one compare-and-swap adds a pin if the word still
//!   holds the handle's generation and is open; the export is read under that pin (the owner
//!   cannot rewrite the slot meanwhile), the peer copy runs, and dropping the [`Lease`] after
//!   the copy has completed takes the pin back.
//!
//! A get or put on the IPC route thus costs the origin a compare-and-swap and the copy, and no
//! round trip through the target's progress loop: the grant protocol of `ipc.rs` (request,
//! grant, release) remains for what the table does not cover (slots past its size, an export
//! that does not fit, a stale handle, whose refusal the target words) and for peers whose table
//! could not be mapped. The target still learns of each leased operation afterwards
//! (`LeaseDone`, one-way), for its counters and a put's notification.
//!
//! The scheme is the shared-memory counterpart of a registration cache with remote keys
//! (UCX's `cuda_ipc` transport, MPICH's IPC handle cache), made safe against a registration
//! that ends while a peer uses it: the pin, not the user's discipline, keeps it alive.

use crate::error::{EngineError, Result};
use ferry_base::shm::{SharedMem, ShmHandle};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Slots in a table: registrations with a larger slot number take the grant protocol.
const SLOTS: usize = 1 << 14;
/// Bytes per slot: the word (8), the length (8), the export's length (4, then 4 spare), the
/// export.
const SLOT_BYTES: usize = 128;
const EXPORT_AT: usize = 24;
const EXPORT_MAX: usize = SLOT_BYTES - EXPORT_AT;
/// The word's open bit (bits 63..32 hold the generation, bits 30..0 the remote pins).
const OPEN: u64 = 1 << 31;
const PINS: u64 = OPEN - 1;

fn open_word(generation: u32) -> u64 {
    (u64::from(generation) << 32) | OPEN
}

/// The slot `id` of a mapped table: its word, length, export length and export bytes.
struct Slot {
    base: *mut u8,
}

impl Slot {
    fn of(mem: &SharedMem, id: u32) -> Option<Slot> {
        let id = id as usize;
        // SAFETY: `id < SLOTS` and the table maps SLOTS * SLOT_BYTES bytes.
        (id < SLOTS && mem.len() >= SLOTS * SLOT_BYTES).then(|| Slot {
            base: unsafe { mem.base().add(id * SLOT_BYTES) },
        })
    }

    fn word(&self) -> &AtomicU64 {
        // SAFETY: 8-aligned (the mapping is page-aligned, slots are 128 bytes), inside the
        // mapping, which lives as long as the table that made this slot; shared memory is only
        // ever accessed atomically at this offset.
        unsafe { AtomicU64::from_ptr(self.base.cast()) }
    }

    fn len(&self) -> &AtomicU64 {
        // SAFETY: as for `word`, at offset 8.
        unsafe { AtomicU64::from_ptr(self.base.add(8).cast()) }
    }

    fn export_len(&self) -> &AtomicU32 {
        // SAFETY: as for `word`, at offset 16 (4-aligned).
        unsafe { AtomicU32::from_ptr(self.base.add(16).cast()) }
    }

    fn export(&self) -> *mut u8 {
        // SAFETY: offset EXPORT_AT of the slot, EXPORT_MAX bytes before its end.
        unsafe { self.base.add(EXPORT_AT) }
    }
}

/// This rank's table of device registrations, which the other ranks of its node map.
pub(crate) struct LeaseTable {
    mem: SharedMem,
}

// SAFETY: the mapping is process-wide memory; every access to shared words is atomic, and the
// export bytes are written only while the slot is closed (no reader holds a pin).
unsafe impl Send for LeaseTable {}
unsafe impl Sync for LeaseTable {}

impl LeaseTable {
    /// A new, empty table.
    ///
    /// # Errors
    /// The system call that failed (`memfd_create`, `ftruncate`, `mmap`).
    pub(crate) fn create() -> std::io::Result<LeaseTable> {
        Ok(LeaseTable {
            mem: SharedMem::create(c"ferry-engine-leases", SLOTS * SLOT_BYTES)?,
        })
    }

    /// What the other ranks of the node map it with.
    pub(crate) fn handle(&self) -> Option<ShmHandle> {
        self.mem.handle()
    }

    /// Publishes registration `(id, generation)` of `len` bytes with its export; returns
    /// whether it is in the table (a slot past the table, or an export too long, is not: peers
    /// then take the grant protocol).
    pub(crate) fn publish(&self, id: u32, generation: u32, len: usize, export: &[u8]) -> bool {
        let Some(slot) = Slot::of(&self.mem, id) else {
            return false;
        };
        if export.len() > EXPORT_MAX {
            return false;
        }
        // The slot is closed (never used, or closed by `close` with no pin held), so no peer
        // reads the bytes written here until the release store below opens it.
        slot.len().store(len as u64, Ordering::Relaxed);
        slot.export_len().store(export.len() as u32, Ordering::Relaxed);
        // SAFETY: EXPORT_MAX bytes at `export()` belong to this slot; nobody reads them now.
        unsafe { std::ptr::copy_nonoverlapping(export.as_ptr(), slot.export(), export.len()) };
        slot.word().store(open_word(generation), Ordering::Release);
        true
    }

    /// Closes registration `(id, generation)`: `Err(pins)` while peers hold pins on it (it
    /// stays open), `Ok` once closed or when it was never published.
    pub(crate) fn close(&self, id: u32, generation: u32) -> Result<(), usize> {
        let Some(slot) = Slot::of(&self.mem, id) else {
            return Ok(());
        };
        let word = slot.word();
        let mut w = word.load(Ordering::Acquire);
        loop {
            if w & !PINS != open_word(generation) {
                return Ok(());
            }
            if w & PINS > 0 {
                return Err((w & PINS) as usize);
            }
            match word.compare_exchange_weak(w, 0, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(now) => w = now,
            }
        }
    }

    /// At finalize: closes every slot, so that no peer can pin a registration of an engine that
    /// has ended (the memory is the caller's again). Slots with pins held lose their open bit at
    /// once; then up to `wait` for those copies to end. Returns the pins still held.
    pub(crate) fn close_all(&self, wait: std::time::Duration) -> u64 {
        let words = || (0..SLOTS as u32).filter_map(|id| Slot::of(&self.mem, id));
        for slot in words() {
            slot.word().fetch_and(!OPEN, Ordering::AcqRel);
        }
        let t0 = std::time::Instant::now();
        loop {
            let held: u64 = words().map(|s| s.word().load(Ordering::Acquire) & PINS).sum();
            if held == 0 || t0.elapsed() >= wait {
                return held;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
}

/// A peer's table, mapped here.
pub(crate) struct PeerLeases {
    mem: SharedMem,
}

// SAFETY: as for `LeaseTable`.
unsafe impl Send for PeerLeases {}
unsafe impl Sync for PeerLeases {}

impl PeerLeases {
    /// Maps the table a peer of this node published.
    ///
    /// # Errors
    /// As [`SharedMem::open`], and a table of the wrong size.
    pub(crate) fn open(h: ShmHandle) -> std::io::Result<PeerLeases> {
        let mem = SharedMem::open(h)?;
        if mem.len() < SLOTS * SLOT_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a lease table of {} bytes", mem.len()),
            ));
        }
        Ok(PeerLeases { mem })
    }

    /// Pins the peer's registration `(id, generation)` if it is published and open: the lease,
    /// with the registration's length and export. `None` when it is not (past the table, never
    /// published, or ended: the grant protocol then decides, and words a refusal).
    pub(crate) fn acquire(self: &Arc<Self>, id: u32, generation: u32) -> Option<Lease> {
        let slot = Slot::of(&self.mem, id)?;
        let word = slot.word();
        let mut w = word.load(Ordering::Acquire);
        loop {
            if w & !PINS != open_word(generation) || w & PINS == PINS {
                return None;
            }
            match word.compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => w = now,
            }
        }
        // Under the pin the owner cannot close the slot, so these are the bytes it published
        // before opening it (the acquire above pairs with its release store).
        let n = (slot.export_len().load(Ordering::Relaxed) as usize).min(EXPORT_MAX);
        let mut export = vec![0u8; n];
        // SAFETY: `n` bytes inside the slot, not written while the pin is held.
        unsafe { std::ptr::copy_nonoverlapping(slot.export(), export.as_mut_ptr(), n) };
        Some(Lease {
            table: self.clone(),
            id,
            len: slot.len().load(Ordering::Relaxed),
            export,
        })
    }
}

/// A pin on a peer's registration: it cannot end while this lives.
pub(crate) struct Lease {
    table: Arc<PeerLeases>,
    id: u32,
    /// The registration's length, bytes.
    pub(crate) len: u64,
    /// The registration's exported allocation ([`ferry_device::copier::Copier::export`]).
    pub(crate) export: Vec<u8>,
}

impl Lease {
    /// Checks that `len` bytes at `offset` lie inside the leased registration.
    ///
    /// # Errors
    /// [`EngineError::OutOfBounds`] otherwise.
    pub(crate) fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end as u64 <= self.len => Ok(()),
            _ => Err(EngineError::OutOfBounds {
                offset,
                len,
                region: self.len as usize,
            }),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(slot) = Slot::of(&self.table.mem, self.id) {
            slot.word().fetch_sub(1, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One process plays both sides (the table mapped twice): publish, lease, a close refused
    /// while pinned, then a stale generation and a reused slot.
    #[test]
    fn pins_hold_a_registration_open_and_stale_generations_miss() {
        let owner = LeaseTable::create().unwrap();
        let peer = Arc::new(PeerLeases::open(owner.handle().unwrap()).unwrap());
        assert!(peer.acquire(3, 7).is_none(), "nothing published yet");
        assert!(owner.publish(3, 7, 4096, b"export-bytes"));
        let lease = peer.acquire(3, 7).expect("published and open");
        assert_eq!((lease.len, lease.export.as_slice()), (4096, &b"export-bytes"[..]));
        let second = peer.acquire(3, 7).unwrap();
        assert!(peer.acquire(3, 8).is_none(), "another generation");
        assert_eq!(owner.close(3, 7), Err(2));
        drop(lease);
        assert_eq!(owner.close(3, 7), Err(1));
        drop(second);
        assert_eq!(owner.close(3, 7), Ok(()));
        assert!(peer.acquire(3, 7).is_none(), "closed");
        assert_eq!(owner.close(3, 7), Ok(()), "closing twice is harmless");
        // The slot reused by a new registration: the old handle's generation stays out.
        assert!(owner.publish(3, 9, 64, b"x"));
        assert!(peer.acquire(3, 7).is_none());
        assert_eq!(peer.acquire(3, 9).unwrap().len, 64);
        // Past the table, or an export too long: not published.
        assert!(!owner.publish(SLOTS as u32, 1, 8, b"x"));
        assert!(!owner.publish(4, 1, 8, &[0u8; EXPORT_MAX + 1]));
        assert!(peer.acquire(4, 1).is_none());
        // Finalize: every slot closed; a pin still held is reported, then released.
        assert!(owner.publish(5, 2, 8, b"y"));
        let held = peer.acquire(5, 2).unwrap();
        assert_eq!(owner.close_all(std::time::Duration::from_millis(1)), 1);
        assert!(
            peer.acquire(5, 2).is_none() && peer.acquire(3, 9).is_none(),
            "closed at finalize"
        );
        drop(held);
        assert_eq!(owner.close_all(std::time::Duration::ZERO), 0);
    }
}
