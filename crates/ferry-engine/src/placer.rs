//! Placement into the framework's own device memory: a [`Placer`] that the framework installs
//! ([`EngineHandle::set_placer`]) supplies the memory of placed gets from its pool, evicting its
//! own data to make room when it must (PaRSEC's GPU memory manager with its LRU of data copies,
//! a TTG device allocator). The engine then never allocates device memory for placements: the
//! framework keeps the one account of what its devices hold.
//!
//! Without a placer, placements come from the engine's own arena (`arena.rs`).

use crate::engine::EngineHandle;
use std::sync::{Arc, RwLock};

/// Device memory for placed gets, from the framework that installed it.
///
/// Both calls may run on any thread that starts a placed get or drops a [`crate::Placed`]; they
/// must not wait for an engine event (a completion that needs the progress the caller may be
/// providing) and must not call the engine's collectives.
pub trait Placer: Send + Sync {
    /// Device addresses of new memory on `device` for each length of `lens` (bytes, each at
    /// least 1), all of them or none (`None`: no room for all of them at once, even after
    /// evicting what the framework may evict). The engine registers each address as device
    /// memory of `device`; the memory must stay allocated until [`Placer::release`] is called
    /// for it.
    fn place(&self, device: usize, lens: &[usize]) -> Option<Vec<u64>>;

    /// The placement at `addr` of `len` bytes on `device` is over (its [`crate::Placed`] was
    /// dropped and its registration has ended): the memory is the framework's again. Called
    /// once per address [`Placer::place`] returned, or never for memory still registered when
    /// the process ends.
    fn release(&self, device: usize, addr: u64, len: usize);
}

/// The installed placer, if any (read at every placed get).
#[derive(Default)]
pub(crate) struct PlacerSlot(RwLock<Option<Arc<dyn Placer>>>);

impl PlacerSlot {
    pub(crate) fn get(&self) -> Option<Arc<dyn Placer>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, p: Option<Arc<dyn Placer>>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = p;
    }
}

impl EngineHandle {
    /// Installs `placer` (`None`: removes it): from now on, placed gets take device memory from
    /// it and fall back to pinned host memory when it has no room, instead of the engine's arena
    /// and allocations. Placements made before keep their memory, and are released to whoever
    /// supplied them.
    pub fn set_placer(&self, placer: Option<Arc<dyn Placer>>) {
        self.shared().placer.set(placer);
    }
}
