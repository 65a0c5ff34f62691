//! Memory regions a transfer hands to the MPI thread: slices of host buffers, device blocks
//! (GPU-direct), small owned control buffers.

use crate::comm::MemRegion;
use crate::data::buffer::TileBuf;
use std::cell::UnsafeCell;
use std::sync::Arc;

/// `len` bytes at `off` of a tile's host buffer (one chunk of a staged transfer).
pub(crate) struct Slice {
    pub(crate) buf: Arc<TileBuf>,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

impl MemRegion for Slice {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: `off + len <= buf.len()` by construction (the chunking of `super::chunks`).
        unsafe { self.buf.as_ptr().add(self.off) }
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A pinned device block, by address: only ever handed to an MPI that takes device memory.
pub(crate) struct DeviceRegion {
    pub(crate) addr: u64,
    pub(crate) len: usize,
}

impl MemRegion for DeviceRegion {
    fn ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A small owned buffer (descriptors, acknowledgements).
pub(crate) struct Small {
    bytes: UnsafeCell<Box<[u8]>>,
}

// SAFETY: written only by the MPI receive into it, read only after that completed (the
// completion callback runs on the MPI thread after the request finished).
unsafe impl Sync for Small {}
// SAFETY: plain memory.
unsafe impl Send for Small {}

impl Small {
    pub(crate) fn new(bytes: &[u8]) -> Arc<Small> {
        Arc::new(Small {
            bytes: UnsafeCell::new(bytes.into()),
        })
    }
    pub(crate) fn zeroed(len: usize) -> Arc<Small> {
        Small::new(&vec![0; len])
    }
    /// The contents.
    ///
    /// # Safety
    /// No receive into the buffer may be in flight.
    pub(crate) unsafe fn get(&self) -> &[u8] {
        &*self.bytes.get()
    }
}

impl MemRegion for Small {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: only the pointer is taken.
        unsafe { (*self.bytes.get()).as_mut_ptr() }
    }
    fn len(&self) -> usize {
        // SAFETY: the length never changes.
        unsafe { (&*self.bytes.get()).len() }
    }
}
