//! A ring of bytes in shared memory from one process to another of the same node: where the
//! payloads of messages too long for a [`crate::ring`] slot lie, while a slot of the message
//! ring says where (copy-in, copy-out, as the shared-memory transports of MPI libraries carry
//! mid-sized messages).
//!
//! One producer and one consumer, and payloads are consumed in the order they were written,
//! because the slots that name them are. The producer keeps `head`, the bytes written so far
//! (a `u64` that never wraps), in its own process; the consumer publishes `tail`, the bytes it
//! has freed so far, in a cache line of the ring's header that only it writes.
//!
//! - **Write.** A payload of `len` bytes goes at `head mod CAP` (`head` rounded up to a cache
//!   line) when it fits before the end of the ring, else at the start of the next lap (the bytes skipped count as used), so that every
//!   payload is contiguous and the consumer can hand it on as one slice. It also goes to the
//!   next lap's start when the ring is empty (`tail` = `head`): messages that go one at a time
//!   (a ping-pong, a request and its reply) then reuse the ring's first bytes, which are still in
//!   both processes' caches, instead of walking the whole ring through memory. There is room
//!   when the payload's end minus `tail` is at most `CAP`. Payloads of [`STREAM_MIN`] bytes or
//!   more are written with non-temporal stores on x86-64 (below). The producer then publishes the slot that
//!   names the payload's start and length; the slot's release store orders the payload's bytes
//!   before it.
//! - **Read.** The consumer reads the slot (acquire), reads the payload, then stores
//!   `tail = start + len` (release). Only after the producer's acquire load of `tail` sees that
//!   may it write there again.
//!
//! The ring needs no lock and no per-payload header. A position that is not the next payload's
//! (a corrupt slot) is refused, not read.
//!
//! **Non-temporal stores.** Written the ordinary way, a payload sits modified in the writer's
//! cache, and the reader then pulls every line of it from the other core one by one, which is
//! slower than reading memory. Written with non-temporal stores, the lines go to memory,
//! leaving no modified copy behind, and the reader streams them with the hardware prefetcher
//! (`engine-bench` round trips from 4 KiB: `docs/results.md`). Below a few KiB the payload is
//! better left in cache. An `sfence` orders the stores before the slot that publishes them.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes before a ring's data: the consumer's `tail`, alone in its two cache lines (adjacent-line
/// prefetch would otherwise pull the data's first line along with it).
pub const HEADER: usize = 128;
/// Payloads start on cache lines of this many bytes, so that no line holds two of them.
const LINE: u64 = 64;
/// Payloads of at least this many bytes are written with non-temporal stores (x86-64).
pub const STREAM_MIN: usize = 4096;

/// Bytes of shared memory a ring of `capacity` data bytes takes (its header included), rounded
/// up to 128 so that rings laid out one after another stay aligned.
pub const fn ring_bytes(capacity: usize) -> usize {
    HEADER + capacity.div_ceil(128) * 128
}

/// The consumer's position, in the header.
fn tail_of(base: *mut u8) -> &'static AtomicU64 {
    // SAFETY: callers pass the base of a prepared ring, 128-byte aligned, mapped while they
    // live; the word is only ever accessed atomically. The `'static` never escapes the owner
    // of the mapping (producer or consumer), which outlives every use.
    unsafe { &*(base as *const AtomicU64) }
}

/// Copies `src` to `dst` with non-temporal stores, 64 bytes at a time (the last partial line
/// the ordinary way), then fences them, so that a later store that publishes them is ordered
/// after them (x86's release stores do not order non-temporal ones).
///
/// # Safety
/// `dst` is 16-byte aligned and valid for `src.len()` bytes of writes.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: &[u8], dst: *mut u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let lines = src.len() / 64;
    // SAFETY: every access is within `src` or the caller's `dst` range; stores are 16-byte
    // aligned (the caller's alignment plus multiples of 16); SSE2 is part of x86-64.
    unsafe {
        for k in 0..lines {
            let s = src.as_ptr().add(k * 64) as *const __m128i;
            let d = dst.add(k * 64) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        let done = lines * 64;
        std::ptr::copy_nonoverlapping(src.as_ptr().add(done), dst.add(done), src.len() - done);
        _mm_sfence();
    }
}

/// Copies a payload into the ring: non-temporal stores for long ones on x86-64.
///
/// # Safety
/// `dst` is 64-byte aligned and valid for `src.len()` bytes of writes.
unsafe fn copy_in(src: &[u8], dst: *mut u8) {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAM_MIN {
        // SAFETY: the caller's contract, which covers 16-byte alignment.
        unsafe { stream_copy(src, dst) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
}

/// Prepares the ring at `base`: empty, every byte free for the producer.
///
/// # Safety
/// `base` is 128-byte aligned and points to [`ring_bytes`] of mapped memory that no producer or
/// consumer uses yet.
pub unsafe fn prepare(base: *mut u8) {
    tail_of(base).store(0, Ordering::Release);
}

/// The writing end: lives in the sending process, over its mapping of the receiver's memory.
/// Only one may exist per ring.
pub struct ByteWriter {
    base: *mut u8,
    capacity: u64,
    head: u64,
    /// The consumer's `tail` as last read (it only grows): read again while it is behind `head`.
    tail: u64,
}

// SAFETY: the pointer is into a mapping that its owner keeps alive; a writer is used by one
// thread at a time (its owner's lock).
unsafe impl Send for ByteWriter {}

impl ByteWriter {
    /// The writer of the ring at `base`, of `capacity` data bytes (rounded down to a multiple of
    /// 64; a reader of the same ring rounds the same way).
    ///
    /// # Safety
    /// `base` is 128-byte aligned and points to [`ring_bytes`]`(capacity)` bytes of shared memory
    /// that [`prepare`] prepared before this writer's first write and that stays mapped while it
    /// lives; no other writer writes there.
    pub unsafe fn new(base: *mut u8, capacity: usize) -> ByteWriter {
        ByteWriter {
            base,
            capacity: capacity as u64 / LINE * LINE,
            head: 0,
            tail: 0,
        }
    }

    /// Data bytes of the ring: the longest payload it takes.
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Copies `bytes` into the ring and returns the position of their first byte, which the slot
    /// that announces them carries to [`ByteReader::take`]; `None` when the ring has no room for
    /// them now (the consumer has not freed enough yet) or they are longer than
    /// [`ByteWriter::capacity`]. The bytes are the consumer's once that slot is published (a
    /// release store after this call).
    pub fn write(&mut self, bytes: &[u8]) -> Option<u64> {
        let len = bytes.len() as u64;
        if len > self.capacity {
            return None;
        }
        if self.tail != self.head {
            self.tail = tail_of(self.base).load(Ordering::Acquire);
        }
        let empty = self.tail == self.head;
        let head = self.head.next_multiple_of(LINE);
        let off = head % self.capacity;
        let start = if off != 0 && (empty || off + len > self.capacity) {
            head + (self.capacity - off)
        } else {
            head
        };
        let end = start + len;
        // An empty ring has room for any payload up to its capacity, wherever it goes; else
        // the bytes from `tail` to the payload's end, skipped ones included, must fit.
        if !empty && end - self.tail > self.capacity {
            return None;
        }
        // SAFETY: `start mod capacity + len <= capacity`, so the bytes lie in the ring's data;
        // the consumer has freed them (the acquire load of `tail` above, or an earlier one) and
        // reads them only after the slot that names them is published.
        // The address is 64-byte aligned: the mapping is page-aligned, HEADER and `capacity`
        // are multiples of 64, and so is `start`.
        unsafe { copy_in(bytes, self.base.add(HEADER + (start % self.capacity) as usize)) };
        self.head = end;
        Some(start)
    }
}

/// The reading end: lives in the receiving process, whose shared memory holds the ring. Only
/// one may exist per ring.
pub struct ByteReader {
    base: *mut u8,
    capacity: u64,
    tail: u64,
}

// SAFETY: as for `ByteWriter`: one thread at a time (its owner's lock).
unsafe impl Send for ByteReader {}

impl ByteReader {
    /// The reader of the ring at `base`, of `capacity` data bytes (rounded down to a multiple of
    /// 64, as the writer does), from its first payload on.
    ///
    /// # Safety
    /// `base` is 128-byte aligned and points to [`ring_bytes`]`(capacity)` bytes of memory that
    /// [`prepare`] prepared, that stays mapped while the reader lives, and that no other reader
    /// reads.
    pub unsafe fn new(base: *mut u8, capacity: usize) -> ByteReader {
        ByteReader {
            base,
            capacity: capacity as u64 / LINE * LINE,
            tail: 0,
        }
    }

    /// Hands the payload of `len` bytes at `start` (what [`ByteWriter::write`] returned, carried
    /// by a slot whose publication the caller has observed) to `read`, then frees it for the writer.
    /// `None`, with nothing read or freed, for a position where the next payload cannot be:
    /// payloads are taken in the order they were written, and the next one starts where the
    /// last ended, or at the next lap's start.
    pub fn take<R>(&mut self, start: u64, len: usize, read: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let len64 = len as u64;
        // Where the writer put it: right after the last payload, or at the next lap's start
        // (when it did not fit before the ring's end, or found the ring empty).
        let tail = self.tail.next_multiple_of(LINE);
        let after = tail % self.capacity;
        let lap = tail + (self.capacity - after) % self.capacity;
        let fits = after + len64 <= self.capacity;
        if !((start == tail && fits) || start == lap) || len64 > self.capacity {
            return None;
        }
        let off = start % self.capacity;
        // SAFETY: in the ring's data (checked above); the writer published these bytes before
        // the slot the caller read, and does not write them again until `tail` passes them.
        let r = read(unsafe { std::slice::from_raw_parts(self.base.add(HEADER + off as usize), len) });
        self.tail = start + len64;
        tail_of(self.base).store(self.tail, Ordering::Release);
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::SharedMem;

    /// A writer and a reader over two mappings (as two processes): payloads come back intact
    /// across laps, including those that skip the ring's end; a full ring refuses until the
    /// reader frees; positions that are not the next payload's are refused.
    #[test]
    fn payloads_come_back_intact_across_laps() {
        const CAP: usize = 1000;
        let mem = SharedMem::create(c"ferry-byte-ring-test", ring_bytes(CAP)).unwrap();
        let peer = SharedMem::open(mem.handle().unwrap()).unwrap();
        // SAFETY: a fresh page-aligned mapping of ring_bytes(CAP), alive for the test; one
        // writer and one reader.
        let (mut w, mut r) = unsafe {
            prepare(mem.base());
            (ByteWriter::new(peer.base(), CAP), ByteReader::new(mem.base(), CAP))
        };
        // Rounded down to whole cache lines.
        assert_eq!(w.capacity(), 960);
        let cap = w.capacity() as u64;
        assert!(w.write(&[0; CAP + 1]).is_none(), "longer than the ring");
        let mut sent = std::collections::VecDeque::new();
        let mut next = 0u8;
        for round in 0..200 {
            // Lengths that do not divide the capacity, so payloads keep skipping the end.
            let len = 1 + (round * 37) % 400;
            let payload: Vec<u8> = (0..len).map(|k| next.wrapping_add(k as u8)).collect();
            next = next.wrapping_add(1);
            match w.write(&payload) {
                Some(at) => sent.push_back((at, payload)),
                None => {
                    assert!(!sent.is_empty(), "an empty ring takes any payload that fits");
                    // Free the oldest and retry: it must fit once everything is freed.
                    while let Some((at, p)) = sent.pop_front() {
                        assert_eq!(r.take(at, p.len(), |b| b.to_vec()).unwrap(), p);
                    }
                    let at = w.write(&payload).expect("room in an empty ring");
                    sent.push_back((at, payload));
                }
            }
            if let Some((at, p)) = sent.front() {
                assert!(r.take(*at + 1, p.len(), |_| ()).is_none(), "not where the next one is");
            }
            // Every third round the reader catches up.
            if round % 3 == 0 {
                while let Some((at, p)) = sent.pop_front() {
                    assert!(
                        at % cap + p.len() as u64 <= cap && at % 64 == 0,
                        "contiguous, on a line"
                    );
                    assert_eq!(r.take(at, p.len(), |b| b.to_vec()).unwrap(), p);
                    assert!(r.take(at, p.len(), |_| ()).is_none(), "already freed");
                }
            }
        }
        for (at, p) in sent {
            assert_eq!(r.take(at, p.len(), |b| b.to_vec()).unwrap(), p);
        }
        let at = w.write(&[5; 10]).unwrap();
        assert!(r.take(at + cap, 10, |_| ()).is_none(), "a lap ahead");
        assert!(r.take(at, CAP + 1, |_| ()).is_none(), "longer than the ring");
        assert_eq!(r.take(at, 10, |b| b.to_vec()).unwrap(), [5; 10]);
        // Empty again: the next payload starts over at the ring's first byte, a lap on.
        let again = w.write(&[6; 3]).unwrap();
        assert_eq!((again % cap, again > at), (0, true));
        assert_eq!(r.take(again, 3, |b| b.to_vec()).unwrap(), [6; 3]);
    }

    /// A writer and a reader on two threads: every payload arrives once, in order, with its
    /// bytes, while the ring keeps filling up; long payloads (non-temporal stores on x86-64)
    /// among short ones, of lengths that are not whole lines.
    #[test]
    fn a_concurrent_writer_and_reader_lose_nothing() {
        const CAP: usize = 32 << 10;
        const N: u64 = 20_000;
        let mem = SharedMem::create(c"ferry-byte-ring-test", ring_bytes(CAP)).unwrap();
        let peer = SharedMem::open(mem.handle().unwrap()).unwrap();
        // SAFETY: as above.
        let mut r = unsafe {
            prepare(mem.base());
            ByteReader::new(mem.base(), CAP)
        };
        let (tx, rx) = std::sync::mpsc::sync_channel::<(u64, usize)>(64);
        let writer = std::thread::spawn(move || {
            // SAFETY: the ring prepared above; `peer` moves here and lives until the end.
            let mut w = unsafe { ByteWriter::new(peer.base(), CAP) };
            for k in 0..N {
                let len = 1 + (k as usize * 2731) % 9000;
                let payload: Vec<u8> = (0..len).map(|i| (k as usize + i) as u8).collect();
                let at = loop {
                    if let Some(at) = w.write(&payload) {
                        break at;
                    }
                    std::hint::spin_loop();
                };
                tx.send((at, len)).unwrap();
            }
            drop(peer);
        });
        for k in 0..N {
            let (at, len) = rx.recv().unwrap();
            let ok = r
                .take(at, len, |b| {
                    b.iter().enumerate().all(|(i, &x)| x == (k as usize + i) as u8)
                })
                .unwrap();
            assert!(ok, "payload {k}");
        }
        writer.join().unwrap();
    }
}
