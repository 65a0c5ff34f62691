//! The placement arena: device memory for placed gets, reserved once per device at its first
//! placed get and carved with ferry-device's best-fit [`Pool`] (the sub-allocator of the
//! runtime's device pools).
//!
//! Why not one `cuMemAlloc` per placed get: `cuMemFree` synchronizes the whole device, so a
//! framework that drops a placed tile while its kernels run would stall every stream, and an
//! allocation costs tens of microseconds against the sub-microsecond of a pool. One allocation
//! also means one CUDA IPC export and, on each peer of the node, one mapping opened for all the
//! placements it will read (mappings are opened once per allocation, never per transfer).
//!
//! Size: `EngineConfig::placement_arena` bytes, capped by what `EngineConfig::device_budget`
//! leaves on the device when the arena is made. A request the arena cannot hold falls back to an
//! allocation of its own, then to pinned host memory (`placement.rs`). The arena is freed when
//! the engine's last handle is dropped, after every placement in it (each holds the arena).

use crate::engine::{DeviceBuffer, Shared};
use crate::error::{EngineError, Result};
use ferry_device::pool::{Block, Pool};
use std::sync::{Arc, Mutex};

/// Alignment of placements in the arena, bytes: CUDA's allocation granularity for the copy
/// engines' best rate and for any element type a framework may read there.
const ALIGN: u64 = 256;

/// The arenas of a rank's devices, each made at its first use.
pub(crate) struct Arenas {
    /// Bytes each arena asks for (`EngineConfig::placement_arena`; 0: no arenas).
    size: usize,
    per_device: Vec<Mutex<ArenaSlot>>,
}

/// One device's arena: not tried yet, made, or not to be had (then placements allocate their
/// own memory, as without arenas).
enum ArenaSlot {
    Untried,
    Made(Arc<Arena>),
    Unavailable,
}

/// The device memory of one arena and the pool of its offsets.
pub(crate) struct Arena {
    /// Its device address and device.
    base: u64,
    device: usize,
    /// Its CUDA IPC export, made once (`None`: no IPC, or it cannot be exported); a block's is
    /// this one shifted to the block's offset.
    export: Option<Vec<u8>>,
    pool: Mutex<Pool>,
    /// Owns the memory (freed on drop); behind a lock only so that the arena is `Sync` (a
    /// buffer's free function is `Send`, not `Sync`), never locked.
    _buffer: Mutex<DeviceBuffer>,
}

/// A placement's bytes in an arena; the block goes back to the pool on drop.
pub(crate) struct ArenaBlock {
    arena: Arc<Arena>,
    block: Block,
}

impl Arenas {
    /// Arenas of `size` bytes (0: none) for `devices` devices.
    pub(crate) fn new(size: usize, devices: usize) -> Arenas {
        Arenas {
            size,
            per_device: (0..devices).map(|_| Mutex::new(ArenaSlot::Untried)).collect(),
        }
    }

    /// Blocks for every length of `lens` in `device`'s arena, all or none (`None`: no arena, or
    /// not room for all of them at once). A group never holds part of the arena while it waits
    /// for the rest, so two groups cannot each hold half of what the other needs.
    pub(crate) fn take_all(&self, shared: &Shared, device: usize, lens: &[usize]) -> Option<Vec<ArenaBlock>> {
        let arena = self.arena(shared, device)?;
        let mut pool = arena.pool.lock().unwrap_or_else(|e| e.into_inner());
        let mut blocks = Vec::with_capacity(lens.len());
        for &len in lens {
            match pool.alloc(len as u64) {
                Some(block) => blocks.push(block),
                None => {
                    for b in blocks {
                        pool.free(b);
                    }
                    return None;
                }
            }
        }
        drop(pool);
        Some(
            blocks
                .into_iter()
                .map(|block| ArenaBlock {
                    arena: arena.clone(),
                    block,
                })
                .collect(),
        )
    }

    /// `device`'s arena, made now if this is its first use.
    fn arena(&self, shared: &Shared, device: usize) -> Option<Arc<Arena>> {
        if self.size == 0 {
            return None;
        }
        let mut slot = self.per_device.get(device)?.lock().unwrap_or_else(|e| e.into_inner());
        match &*slot {
            ArenaSlot::Made(a) => return Some(a.clone()),
            ArenaSlot::Unavailable => return None,
            ArenaSlot::Untried => {}
        }
        match Self::make(shared, device, self.size) {
            Ok(a) => {
                *slot = ArenaSlot::Made(a.clone());
                Some(a)
            }
            // The budget is spent for now: try again at a later placed get.
            Err(EngineError::DeviceFull { .. }) => None,
            Err(e) => {
                tracing::warn!(
                    device,
                    bytes = self.size,
                    "no placement arena ({e}): placed gets allocate their own memory"
                );
                *slot = ArenaSlot::Unavailable;
                None
            }
        }
    }

    fn make(shared: &Shared, device: usize, size: usize) -> Result<Arc<Arena>> {
        let used = shared
            .device_used
            .get(device)
            .map_or(0, |u| u.load(std::sync::atomic::Ordering::Acquire));
        let left = shared.device_budget.map_or(usize::MAX, |b| b.saturating_sub(used));
        let bytes = (size.min(left) as u64 & !(ALIGN - 1)) as usize;
        if bytes == 0 {
            return Err(EngineError::DeviceFull {
                device,
                need: size,
                used,
                budget: shared.device_budget.unwrap_or(0),
            });
        }
        let buffer = shared.alloc_device(device, bytes)?;
        let export = if shared.ipc_enabled {
            shared
                .staging_or_error()?
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .copier_mut()
                .export(buffer.ptr())
                .map_err(|e| tracing::info!(device, "the placement arena cannot be exported for peer copies: {e}"))
                .ok()
        } else {
            None
        };
        Ok(Arc::new(Arena {
            base: buffer.ptr(),
            device,
            export,
            pool: Mutex::new(Pool::new(bytes as u64, ALIGN)),
            _buffer: Mutex::new(buffer),
        }))
    }

    /// Bytes of placements in `device`'s arena now, and its capacity (0, 0 without one).
    pub(crate) fn usage(&self, device: usize) -> (u64, u64) {
        let Some(slot) = self.per_device.get(device) else {
            return (0, 0);
        };
        match &*slot.lock().unwrap_or_else(|e| e.into_inner()) {
            ArenaSlot::Made(a) => {
                let p = a.pool.lock().unwrap_or_else(|e| e.into_inner());
                (p.used(), p.capacity())
            }
            _ => (0, 0),
        }
    }
}

impl ArenaBlock {
    /// Its device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.arena.base + self.block.offset
    }

    /// Its device.
    pub(crate) fn device(&self) -> usize {
        self.arena.device
    }

    /// Its CUDA IPC export: the arena's, at the block's offset (no driver call).
    pub(crate) fn export(&self) -> Option<Vec<u8>> {
        let e = self.arena.export.as_ref()?;
        ferry_device::copier::shift_export(e, self.block.offset).ok()
    }
}

impl Drop for ArenaBlock {
    fn drop(&mut self) {
        self.arena
            .pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free(self.block);
    }
}
