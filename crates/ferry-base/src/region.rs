//! Memory regions: what the communication layer reads and writes, and the layers above hand it.

/// Memory that a transfer reads or writes. The region must stay valid, and be used by no one
/// else in a conflicting way, until the transfer's callback has run; holding it in an `Arc`
/// inside the command keeps it alive that long.
pub trait MemRegion: Send + Sync {
    /// Start of the region.
    fn ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the region has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A heap buffer that a transfer sends from or receives into (active messages, scratch
/// receives). The buffer is written only by the receive it is handed to.
pub struct Bytes {
    bytes: std::cell::UnsafeCell<Vec<u8>>,
}

// SAFETY: the buffer is written only by the one receive that holds it (the MPI thread) and read
// after that receive has completed.
unsafe impl Send for Bytes {}
unsafe impl Sync for Bytes {}

impl Bytes {
    /// A buffer holding `v`.
    pub fn new(v: Vec<u8>) -> std::sync::Arc<Bytes> {
        std::sync::Arc::new(Bytes {
            bytes: std::cell::UnsafeCell::new(v),
        })
    }

    /// The buffer, once no transfer holds it any more (the communication layer lets go of a
    /// region after its callback has run); else `this` back.
    ///
    /// # Errors
    /// `this`, while another `Arc` of it (a transfer's) is alive.
    pub fn into_vec(this: std::sync::Arc<Bytes>) -> Result<Vec<u8>, std::sync::Arc<Bytes>> {
        std::sync::Arc::try_unwrap(this).map(|b| b.bytes.into_inner())
    }
}

impl MemRegion for Bytes {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: only the pointer is taken.
        unsafe { (*self.bytes.get()).as_mut_ptr() }
    }
    fn len(&self) -> usize {
        // SAFETY: the length never changes.
        unsafe { (&*self.bytes.get()).len() }
    }
}
