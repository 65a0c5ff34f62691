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
