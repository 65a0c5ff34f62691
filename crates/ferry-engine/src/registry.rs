//! This rank's memory registrations: slots with generations, and the pins that operations in
//! flight hold on them.
//!
//! A slot is reused after its registration is removed; the generation (unique per registration
//! in this process) tells a handle of the old registration from one of the new, so a stale
//! handle is refused instead of reading someone else's memory. A registration with operations in
//! flight cannot be removed: each operation holds a [`Pinned`] region until its completion.

use crate::error::{EngineError, Result};
use crate::handle::{MemHandle, MemKind};
use crate::lease::LeaseTable;
use ferry_base::error::Rank;
use ferry_base::region::MemRegion;
use std::sync::{Arc, Mutex};

struct Entry {
    ptr: usize,
    len: usize,
    kind: MemKind,
    /// Device memory exported for peer copies at registration (`ipc.rs`): the allocation's
    /// handle with the registration's place in it.
    export: Option<Arc<[u8]>>,
    /// The registration is in this rank's lease table, where peers lease it (`lease.rs`): device
    /// memory with its export, to map; host memory with its address, for single copies.
    leased: bool,
    generation: u32,
    /// Operations in flight that read or write it.
    pins: usize,
}

#[derive(Default)]
struct Table {
    slots: slab::Slab<Entry>,
    next_generation: u32,
}

/// The registrations of this rank.
pub(crate) struct Registry {
    rank: Rank,
    job: u64,
    table: Mutex<Table>,
    /// Where registrations are published for the node's peers (`lease.rs`): exported device
    /// memory (the IPC route) and host memory (the single-copy route, `cma.rs`).
    leases: Option<LeaseTable>,
    /// Which kinds go into `leases`.
    publish: Publish,
}

/// Which registrations a rank publishes in its lease table.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Publish {
    /// Exported device memory, for leased peer copies (`EngineConfig::ipc_leases`).
    pub device: bool,
    /// Host memory, with its address, for single copies (`EngineConfig::cma`).
    pub host: bool,
}

/// A byte range of a registration that an operation in flight reads or writes; the
/// registration cannot be removed while it lives.
pub(crate) struct Pinned {
    registry: Arc<Registry>,
    id: u32,
    ptr: usize,
    len: usize,
    /// The device, for device memory.
    pub(crate) device: Option<usize>,
    /// The registration's export and this range's offset in the registration.
    pub(crate) export: Option<(Arc<[u8]>, usize)>,
}

// SAFETY: the memory belongs to the caller, who promised at registration that it stays valid and
// that nobody else writes it in a conflicting way while operations on it are in flight.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

// SAFETY: a range of a registration, which the caller promised at `register` (an unsafe
// function) stays valid and untouched by conflicting accesses while operations are in flight;
// the pin keeps the registration from ending meanwhile.
unsafe impl MemRegion for Pinned {
    fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut t = self.registry.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = t.slots.get_mut(self.id as usize) {
            e.pins -= 1;
        }
    }
}

impl Registry {
    pub(crate) fn new(rank: Rank, job: u64, leases: Option<LeaseTable>, publish: Publish) -> Registry {
        Registry {
            rank,
            job,
            table: Mutex::new(Table::default()),
            leases,
            publish,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `len` bytes at `ptr`.
    pub(crate) fn add(&self, ptr: *mut u8, len: usize, kind: MemKind, export: Option<Vec<u8>>) -> Result<MemHandle> {
        if ptr.is_null() {
            return Err(EngineError::InvalidArgument("registering a null pointer".into()));
        }
        if len == 0 {
            return Err(EngineError::InvalidArgument("registering 0 bytes".into()));
        }
        let mut t = self.lock();
        let generation = t.next_generation;
        t.next_generation = t.next_generation.wrapping_add(1);
        let id = t.slots.insert(Entry {
            ptr: ptr as usize,
            len,
            kind,
            export: export.map(Arc::from),
            leased: false,
            generation,
            pins: 0,
        });
        let id = match u32::try_from(id) {
            Ok(id) => id,
            Err(_) => {
                t.slots.remove(id);
                return Err(EngineError::InvalidArgument("more than 2^32 registrations".into()));
            }
        };
        // Host memory is published with its address (peers read and write it by single
        // copies), exported device memory with its export (peers map it).
        let published: Option<Vec<u8>> = match kind {
            MemKind::Host if self.publish.host => Some((ptr as u64).to_le_bytes().to_vec()),
            MemKind::Device(_) if self.publish.device => t.slots[id as usize].export.as_deref().map(<[u8]>::to_vec),
            _ => None,
        };
        if let (Some(table), Some(x)) = (&self.leases, published) {
            let leased = table.publish(id, generation, len, &x);
            t.slots[id as usize].leased = leased;
        }
        Ok(MemHandle {
            rank: self.rank,
            id,
            generation,
            len,
            kind,
            job: self.job,
        })
    }

    /// Whether this rank's registration `h` is in its lease table (peers may map it).
    pub(crate) fn leased(&self, h: &MemHandle) -> Result<bool> {
        self.check_owner(h)?;
        let t = self.lock();
        match t.slots.get(h.id as usize) {
            Some(e) if e.generation == h.generation => Ok(e.leased),
            _ => Err(self.not_registered(h.id, h.generation)),
        }
    }

    /// Removes the registration of `h`.
    pub(crate) fn remove(&self, h: &MemHandle) -> Result<()> {
        self.check_owner(h)?;
        let mut t = self.lock();
        match t.slots.get(h.id as usize) {
            Some(e) if e.generation == h.generation => {
                if e.pins > 0 {
                    return Err(EngineError::Busy { id: h.id, ops: e.pins });
                }
                // Peers copying from or into it through a lease hold it too.
                if let Some(table) = &self.leases {
                    table
                        .close(h.id, h.generation)
                        .map_err(|ops| EngineError::Busy { id: h.id, ops })?;
                }
                t.slots.remove(h.id as usize);
                Ok(())
            }
            _ => Err(self.not_registered(h.id, h.generation)),
        }
    }

    fn check_owner(&self, h: &MemHandle) -> Result<()> {
        if h.rank != self.rank {
            return Err(EngineError::WrongOwner {
                owner: h.rank,
                wanted: self.rank,
            });
        }
        Ok(())
    }

    fn not_registered(&self, id: u32, generation: u32) -> EngineError {
        EngineError::NotRegistered {
            rank: self.rank,
            id,
            generation,
        }
    }

    /// Pins `offset..offset + len` of this rank's registration `h` for an operation.
    pub(crate) fn pin(self: &Arc<Self>, h: &MemHandle, offset: usize, len: usize) -> Result<Pinned> {
        self.check_owner(h)?;
        self.pin_id(h.id, h.generation, offset, len)
    }

    /// As [`Registry::pin`], for a registration named by a peer's request (slot and generation).
    pub(crate) fn pin_id(self: &Arc<Self>, id: u32, generation: u32, offset: usize, len: usize) -> Result<Pinned> {
        let mut t = self.lock();
        let e = match t.slots.get_mut(id as usize) {
            Some(e) if e.generation == generation => e,
            _ => return Err(self.not_registered(id, generation)),
        };
        match offset.checked_add(len) {
            Some(end) if end <= e.len && len > 0 => {}
            _ => {
                return Err(EngineError::OutOfBounds {
                    offset,
                    len,
                    region: e.len,
                })
            }
        }
        e.pins += 1;
        Ok(Pinned {
            registry: self.clone(),
            id,
            ptr: e.ptr + offset,
            len,
            device: e.kind.device(),
            export: e.export.clone().map(|x| (x, offset)),
        })
    }

    /// At finalize: no peer may lease a registration any more (`LeaseTable::close_all`);
    /// returns the peers' pins still held after `wait`.
    pub(crate) fn close_leases(&self, wait: std::time::Duration) -> u64 {
        self.leases.as_ref().map_or(0, |t| t.close_all(wait))
    }

    /// Registrations alive now.
    pub(crate) fn count(&self) -> usize {
        self.lock().slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_busy_and_foreign_handles_are_refused() {
        let r = Arc::new(Registry::new(2, 77, None, Publish::default()));
        let mut a = vec![0u8; 64];
        let h = r.add(a.as_mut_ptr(), 64, MemKind::Host, None).unwrap();
        let p = r.pin(&h, 8, 8).unwrap();
        assert_eq!(p.ptr() as usize, a.as_ptr() as usize + 8);
        assert!(matches!(r.remove(&h), Err(EngineError::Busy { ops: 1, .. })));
        drop(p);
        r.remove(&h).unwrap();
        assert!(matches!(r.pin(&h, 0, 1), Err(EngineError::NotRegistered { .. })));
        assert!(matches!(r.remove(&h), Err(EngineError::NotRegistered { .. })));
        // The slot is reused; the old handle stays dead.
        let h2 = r.add(a.as_mut_ptr(), 32, MemKind::Host, None).unwrap();
        assert_eq!(h2.id, h.id);
        assert!(matches!(r.pin(&h, 0, 1), Err(EngineError::NotRegistered { .. })));
        assert!(matches!(r.pin(&h2, 0, 33), Err(EngineError::OutOfBounds { .. })));
        let other = MemHandle { rank: 1, ..h2 };
        assert!(matches!(
            r.pin(&other, 0, 1),
            Err(EngineError::WrongOwner { owner: 1, wanted: 2 })
        ));
        assert!(matches!(
            r.add(std::ptr::null_mut(), 8, MemKind::Host, None),
            Err(EngineError::InvalidArgument(_))
        ));
        assert_eq!(r.count(), 1);
    }
}
