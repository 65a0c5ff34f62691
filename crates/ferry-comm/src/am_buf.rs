//! Buffers of active messages, and the pool that recycles those of the largest size.
//!
//! Active messages are received into buffers posted ahead, each with room for the largest
//! message of the job, and a message of more than [`AM_COPY_OUT`] bytes is handed on in the
//! buffer it landed in (its handler owns it, and a new buffer is posted). A sender copies the
//! payload too (the call returns at once). Allocating those buffers per message costs more than
//! the message: a fresh buffer of tens of KiB is often new pages to the allocator (freed ones go
//! back to the kernel when they join the top of the heap), so the copy into it, or the receive,
//! page-faults on them, and at best it is memory whose lines are not in cache. A bounded pool of
//! buffers of the one large size, last in first out, makes both sides reuse warm memory: a
//! buffer goes back to its pool when its message is dropped, after its handler ran or its send
//! completed. Smaller messages use a buffer of their own length ([`AmPool::copy_of`]).

use ferry_base::region::MemRegion;
use std::cell::UnsafeCell;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

/// Messages of up to this many bytes are copied out of the buffer they landed in (which is
/// posted again); longer ones are handed on in it.
pub const AM_COPY_OUT: usize = 4096;

/// A bounded pool of buffers of one size (the largest active message): buffers given back
/// past its bound are freed. Last in, first out: the buffer taken is the one given back last,
/// whose lines are most likely still in cache (a first-in-first-out queue would cycle through
/// every free buffer).
pub struct AmPool {
    buf_len: usize,
    keep: usize,
    free: Mutex<Vec<Vec<u8>>>,
}

impl AmPool {
    /// A pool of buffers of `buf_len` bytes that keeps at most `keep` free ones (at least 1).
    pub fn new(buf_len: usize, keep: usize) -> Arc<AmPool> {
        Arc::new(AmPool {
            buf_len: buf_len.max(1),
            keep: keep.max(1),
            free: Mutex::new(Vec::with_capacity(keep.max(1))),
        })
    }

    /// The size of its buffers, bytes: the largest active message.
    pub fn buf_len(&self) -> usize {
        self.buf_len
    }

    /// Free buffers it holds now.
    pub fn free(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        // A panic while holding the lock leaves a vector of buffers: still usable.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty buffer with room for [`AmPool::buf_len`] bytes: a free one, or a new one.
    pub fn take(self: &Arc<Self>) -> AmBuf {
        let free = self.lock().pop();
        let buf = free.unwrap_or_else(|| Vec::with_capacity(self.buf_len));
        AmBuf {
            buf: UnsafeCell::new(buf),
            home: Some(self.clone()),
        }
    }

    /// A buffer holding a copy of `bytes`, for a send: from the pool when longer than a quarter
    /// of [`AmPool::buf_len`] (and at most all of it), else one of their length. A pooled buffer
    /// is held whole until the send completes: the bound keeps a queue of sends from holding more
    /// than four times their bytes.
    pub fn copy_of(self: &Arc<Self>, bytes: &[u8]) -> AmBuf {
        if bytes.len() <= (self.buf_len / 4).max(AM_COPY_OUT) || bytes.len() > self.buf_len {
            return AmBuf::from(bytes.to_vec());
        }
        let mut b = self.take();
        b.buf.get_mut().extend_from_slice(bytes);
        b
    }

    fn give_back(&self, mut buf: Vec<u8>) {
        if buf.capacity() == self.buf_len {
            buf.clear();
            let mut free = self.lock();
            // A full pool drops it: the bound holds.
            if free.len() < self.keep {
                free.push(buf);
            }
        }
    }
}

impl fmt::Debug for AmPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmPool")
            .field("buf_len", &self.buf_len)
            .field("free", &self.free())
            .finish()
    }
}

/// The bytes of an active message: read as a `[u8]` (`Deref`); its buffer goes back to its
/// [`AmPool`] when it is dropped, or is freed when it has none. As a [`MemRegion`] it is what a
/// send reads.
pub struct AmBuf {
    // In a cell because a region's pointer may be written through (a receive posted into it),
    // as with `ferry_base::region::Bytes`; ferry's own receives fill it through `&mut AmBuf`.
    buf: UnsafeCell<Vec<u8>>,
    home: Option<Arc<AmPool>>,
}

// SAFETY: the vector is written only through `&mut AmBuf` (filling it before it is shared, or
// the posted receive that owns it), or by a transfer given it as its region, which nobody
// reads until the transfer has completed; shared references otherwise only read it.
unsafe impl Sync for AmBuf {}

impl AmBuf {
    /// The message's bytes in a vector of their own (a pooled buffer is copied, and goes back to
    /// its pool as this drops).
    pub fn into_vec(mut self) -> Vec<u8> {
        if self.home.is_some() {
            return self.to_vec();
        }
        std::mem::take(self.buf.get_mut())
    }

    /// Whether its buffer goes back to a pool.
    pub fn is_pooled(&self) -> bool {
        self.home.is_some()
    }

    /// The vector, for a receive into its spare capacity.
    pub(crate) fn vec_mut(&mut self) -> &mut Vec<u8> {
        self.buf.get_mut()
    }

    /// Leaks the buffer's memory (a receive may still be writing it) without leaking its pool:
    /// the buffer is neither freed nor given back.
    pub(crate) fn leak(mut self) {
        std::mem::forget(std::mem::take(self.buf.get_mut()));
    }
}

impl From<Vec<u8>> for AmBuf {
    fn from(v: Vec<u8>) -> AmBuf {
        AmBuf {
            buf: UnsafeCell::new(v),
            home: None,
        }
    }
}

impl Deref for AmBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: see `Sync` above: no writer while a shared reference exists.
        unsafe { &*self.buf.get() }
    }
}

impl AsRef<[u8]> for AmBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for AmBuf {
    fn drop(&mut self) {
        if let Some(home) = self.home.take() {
            home.give_back(std::mem::take(self.buf.get_mut()));
        }
    }
}

impl Clone for AmBuf {
    /// A copy in a buffer of its own length (not pooled).
    fn clone(&self) -> AmBuf {
        AmBuf::from(self.to_vec())
    }
}

impl PartialEq for AmBuf {
    fn eq(&self, other: &AmBuf) -> bool {
        **self == **other
    }
}

impl Eq for AmBuf {}

impl PartialEq<[u8]> for AmBuf {
    fn eq(&self, other: &[u8]) -> bool {
        **self == *other
    }
}

impl<const N: usize> PartialEq<&[u8; N]> for AmBuf {
    fn eq(&self, other: &&[u8; N]) -> bool {
        **self == other[..]
    }
}

impl PartialEq<Vec<u8>> for AmBuf {
    fn eq(&self, other: &Vec<u8>) -> bool {
        **self == other[..]
    }
}

impl fmt::Debug for AmBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

// SAFETY: the buffer's own heap memory, alive as long as the `AmBuf` (a receive's buffer is
// leaked, not freed, when the receive cannot be cancelled); written only by the receive that
// holds it, read by the send that holds it.
unsafe impl MemRegion for AmBuf {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: only the pointer is taken, through a shared borrow of the vector.
        unsafe { (*self.buf.get()).as_ptr() as *mut u8 }
    }
    fn len(&self) -> usize {
        self.deref().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_messages_reuse_pooled_buffers_and_small_ones_do_not() {
        let pool = AmPool::new(16 << 10, 2);
        let big = vec![7u8; 10_000];
        let a = pool.copy_of(&big);
        assert!(a.is_pooled() && *a == big[..]);
        let ptr = a.as_ptr();
        drop(a);
        assert_eq!(pool.free(), 1);
        let b = pool.copy_of(&big[..5000]);
        assert_eq!(b.as_ptr(), ptr, "the freed buffer is reused");
        assert_eq!(b.len(), 5000);
        let small = pool.copy_of(b"hello");
        assert!(!small.is_pooled() && *small == b"hello"[..]);
        assert_eq!(small.clone().into_vec(), b"hello");
        assert_eq!(b.clone().into_vec().len(), 5000);
        drop((b, small));
        assert_eq!(pool.free(), 1);
    }

    #[test]
    fn the_pool_keeps_at_most_its_bound() {
        let pool = AmPool::new(8192, 2);
        let bufs: Vec<AmBuf> = (0..5).map(|_| pool.copy_of(&[1u8; 5000])).collect();
        drop(bufs);
        assert_eq!(pool.free(), 2);
        // Past the pool's size, a copy is a vector of its own.
        let over = pool.copy_of(&[0u8; 9000]);
        assert!(!over.is_pooled());
        assert_eq!(pool.free(), 2);
    }
}
