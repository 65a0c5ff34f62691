//! Host memory of one tile copy.

use super::host_pool::HostPool;
use crate::data::budget::HostBudget;
use ferry_device::pool::Block;
use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Host memory for one copy of a tile: `bytes` bytes, 8-byte aligned, zero-initialised — except
/// a receive's landing buffer ([`TileBuf::landing_in`]), which its receive writes whole before it
/// becomes the copy's data (a failed receive takes it back: `ferry-transfer/src/region.rs`).
///
/// The buffer is shared (`Arc<TileBuf>`) between the tasks and transfers that use the copy. It
/// hands out raw slices without locking: *the task graph is the lock*. The inserter orders every
/// writer of a copy after all earlier readers and writers of that copy (RAW, WAR, WAW edges), so
/// while a writer runs nobody else touches the buffer. Every `unsafe` accessor below relies on that
/// invariant, which the task layer's inserter (`ferry`) maintains.
pub struct TileBuf {
    backing: Backing,
    bytes: usize,
    /// The host budget this buffer is charged to, if one is in force.
    charged: Option<Arc<dyn HostBudget>>,
}

enum Backing {
    /// Pageable heap memory.
    Heap(UnsafeCell<Box<[u64]>>),
    /// Pageable heap memory left uninitialised, for a receive to write whole before anything
    /// reads it ([`TileBuf::landing_in`]).
    Scratch(UnsafeCell<Box<[MaybeUninit<u64>]>>),
    /// A block of the registered (pinned) host pool.
    Pinned {
        pool: Arc<HostPool>,
        block: Block,
        ptr: *mut u8,
    },
}

// SAFETY: access is serialised by the dependency graph (see the type's documentation).
unsafe impl Sync for TileBuf {}
// SAFETY: the buffer owns plain memory with no thread affinity.
unsafe impl Send for TileBuf {}

impl TileBuf {
    /// A zeroed buffer of `bytes` bytes in pageable memory.
    pub fn zeroed(bytes: usize) -> TileBuf {
        TileBuf {
            backing: Backing::Heap(UnsafeCell::new(vec![0u64; bytes.div_ceil(8)].into_boxed_slice())),
            bytes,
            charged: None,
        }
    }

    /// A zeroed buffer from the pinned pool when there is one with room, else pageable, charged
    /// to the host budget `tier` when one is in force (until the buffer is dropped).
    pub fn zeroed_in(pool: Option<&Arc<HostPool>>, bytes: usize, budget: Option<&Arc<dyn HostBudget>>) -> TileBuf {
        Self::from_pool(pool, bytes, budget, true)
    }

    /// A buffer for data about to be written whole before anyone reads it (a receive's landing
    /// area, taken on the MPI thread when the message is matched): as [`TileBuf::zeroed_in`],
    /// except that nothing is zeroed — a block of the pinned pool keeps whatever bytes it held,
    /// and pageable memory is left uninitialised. Zeroing cost a pass over the memory (≈ 25 ms
    /// per 256 MiB; the allocator reuses freed memory, so `calloc` zeroes too), on the thread
    /// that also moves every message. Reading it ([`TileBuf::bytes`]) before it is written is
    /// undefined behaviour.
    pub fn landing_in(pool: Option<&Arc<HostPool>>, bytes: usize, budget: Option<&Arc<dyn HostBudget>>) -> TileBuf {
        Self::from_pool(pool, bytes, budget, false)
    }

    /// `bytes` bytes of uninitialised pageable memory (see [`TileBuf::landing_in`]).
    fn scratch(bytes: usize) -> TileBuf {
        TileBuf {
            backing: Backing::Scratch(UnsafeCell::new(Box::new_uninit_slice(bytes.div_ceil(8)))),
            bytes,
            charged: None,
        }
    }

    fn from_pool(
        pool: Option<&Arc<HostPool>>,
        bytes: usize,
        budget: Option<&Arc<dyn HostBudget>>,
        zero: bool,
    ) -> TileBuf {
        let alloc = |p: &Arc<HostPool>| if zero { p.alloc(bytes) } else { p.alloc_unzeroed(bytes) };
        let mut b = match pool.and_then(|p| alloc(p).map(|(block, ptr)| (p, block, ptr))) {
            Some((pool, block, ptr)) => TileBuf {
                backing: Backing::Pinned {
                    pool: pool.clone(),
                    block,
                    ptr,
                },
                bytes,
                charged: None,
            },
            None if zero => TileBuf::zeroed(bytes),
            None => TileBuf::scratch(bytes),
        };
        if let Some(t) = budget {
            t.charge(bytes);
            b.charged = Some(t.clone());
        }
        b
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Start of the memory, for transfers.
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.backing {
            // SAFETY: only the pointer is taken; no reference is created.
            Backing::Heap(words) => unsafe { (*words.get()).as_mut_ptr().cast() },
            // SAFETY: as above.
            Backing::Scratch(words) => unsafe { (*words.get()).as_mut_ptr().cast() },
            Backing::Pinned { ptr, .. } => *ptr,
        }
    }

    /// The bytes, read-only.
    ///
    /// # Safety
    /// No writer of this copy may run concurrently (guaranteed for a task's read accesses and for
    /// sends by the dependency graph), and a landing buffer must have been written whole.
    pub unsafe fn bytes(&self) -> &[u8] {
        std::slice::from_raw_parts(self.as_ptr(), self.bytes)
    }
}

impl Drop for TileBuf {
    fn drop(&mut self) {
        if let Some(t) = &self.charged {
            t.uncharge(self.bytes);
        }
        if let Backing::Pinned { pool, block, .. } = &self.backing {
            pool.free(*block);
        }
    }
}

impl std::fmt::Debug for TileBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TileBuf({} bytes)", self.bytes)
    }
}

/// A tile's host buffer is what a host transfer sends from or receives into.
// SAFETY: the buffer's own memory of `len` bytes, alive as long as the `TileBuf`; the runtime
// hands it to one receive at a time, or to sends and readers only (the tile's access modes).
unsafe impl ferry_base::region::MemRegion for TileBuf {
    fn ptr(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn len(&self) -> usize {
        TileBuf::len(self)
    }
}
