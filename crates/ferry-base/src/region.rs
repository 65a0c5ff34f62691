//! Memory regions: what the communication layer reads and writes, and the layers above hand it.

/// Memory that a transfer reads or writes. The region must stay valid, and be used by no one
/// else in a conflicting way, until the transfer's callback has run; holding it in an `Arc`
/// inside the command keeps it alive that long.
///
/// # Safety
/// `ptr()` and `len()` describe memory that is valid for reads and writes of `len()` bytes for
/// as long as the region lives (a receive writes it from another thread, a device-aware MPI may
/// read device memory there), and that nobody else reads or writes while a transfer holds the
/// region, except as the implementor documents (a send's buffer may be read alongside). Both
/// return the same values for the region's whole life. Code that hands a region to a transfer
/// relies on this to let MPI write it; a safe implementation that returned any other pointer
/// would let safe code write anywhere.
pub unsafe trait MemRegion: Send + Sync {
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
    /// The vector's buffer and length, taken once: reading them through the vector while a
    /// receive writes the buffer would make a reference to it alias the receive's writes.
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is written only by the one receive that holds it (the MPI thread) and read
// after that receive has completed.
unsafe impl Send for Bytes {}
unsafe impl Sync for Bytes {}

impl Bytes {
    /// A buffer holding `v`.
    pub fn new(mut v: Vec<u8>) -> std::sync::Arc<Bytes> {
        let (ptr, len) = (v.as_mut_ptr(), v.len());
        std::sync::Arc::new(Bytes {
            bytes: std::cell::UnsafeCell::new(v),
            ptr,
            len,
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

// SAFETY: the vector's own buffer of `len` bytes, which lives (and does not move) as long as the
// region; only the transfer that holds it touches it until `into_vec` gets it back.
unsafe impl MemRegion for Bytes {
    fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}
