//! A bounded ring of small messages from one process to another of the same node, laid out in
//! shared memory ([`crate::shm`]): the carrier of the engine's active messages between ranks of a
//! node and of the task runtime's control ring ([`crate::node_rings`] lays them out per rank).
//!
//! After D. Vyukov's bounded MPMC queue (1024cores.net, "Bounded MPMC queue"), reduced to one
//! producer and one consumer. Each slot holds a sequence word. The producer at position `p` may
//! fill slot `p mod SLOTS` once its sequence reads `p`; it writes the message, then stores
//! `p + 1` (release). The consumer at position `c` takes slot `c mod SLOTS` once its sequence
//! reads `c + 1` (acquire), copies the message out, then stores `c + SLOTS` (release), which
//! frees the slot for the producer's next lap. Neither side reads a shared head or tail: each
//! keeps its position in its own process, and a slot's cache lines move between the two
//! processes only when the slot is used.

use std::sync::atomic::{AtomicU64, Ordering};

/// Slots per ring.
pub const SLOTS: usize = 512;
/// Bytes per slot: the sequence word, the message's header and its payload, two cache lines so
/// that neighbouring slots never share one.
const SLOT_BYTES: usize = 128;
/// The longest payload a message carries, bytes (an IPC descriptor is 48): what the slot
/// leaves after its 20 bytes of sequence word and header.
pub const PAYLOAD: usize = 108;
/// Bytes of one ring in shared memory.
pub const RING_BYTES: usize = SLOTS * SLOT_BYTES;

/// One slot, as laid out in shared memory.
#[repr(C, align(128))]
struct Slot {
    seq: AtomicU64,
    channel: u8,
    len: u8,
    tag: i32,
    aux: u32,
    payload: [u8; PAYLOAD],
}

const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_BYTES);

/// A message taken from a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// The sender's channel number (what the mailbox matches on, with the tag).
    pub channel: u8,
    /// The sender's tag.
    pub tag: i32,
    /// A word of the sender's own protocol (0 unless it says otherwise).
    pub aux: u32,
    len: u8,
    payload: [u8; PAYLOAD],
}

impl Message {
    /// The payload's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.payload[..usize::from(self.len).min(PAYLOAD)]
    }
}

/// The sending end of a ring: lives in the sending process, over its mapping of the receiver's
/// memory. Only one `Producer` may exist per ring.
pub struct Producer {
    slots: *mut Slot,
    pos: u64,
}

// SAFETY: the pointer is into a mapping that its owner keeps alive; a `Producer` is used by one
// thread at a time (its owner's lock).
unsafe impl Send for Producer {}

impl Producer {
    /// The producer of the ring at `base`.
    ///
    /// # Safety
    /// `base` is 128-byte aligned and points to [`RING_BYTES`] of shared memory that [`prepare`]
    /// has prepared (before this producer's first push) and that stays mapped while the producer
    /// lives; no other producer writes to it.
    pub unsafe fn new(base: *mut u8) -> Producer {
        Producer {
            slots: base as *mut Slot,
            pos: 0,
        }
    }

    /// Enqueues a message; `false` when the ring is full (the consumer has not yet taken the
    /// message one lap back). `bytes` longer than [`PAYLOAD`] are refused with `false` too: the
    /// caller checks lengths first.
    pub fn push(&mut self, channel: u8, tag: i32, bytes: &[u8]) -> bool {
        self.push_with(channel, tag, 0, bytes)
    }

    /// As [`Producer::push`], with a word of the caller's protocol ([`Message::aux`]).
    pub fn push_with(&mut self, channel: u8, tag: i32, aux: u32, bytes: &[u8]) -> bool {
        if bytes.len() > PAYLOAD {
            return false;
        }
        // The slot is only ever touched through raw pointers and a reference to its atomic:
        // the other process writes its plain fields while this one holds no reference to them.
        // SAFETY: the index is below SLOTS; the mapping lives (the constructor's contract).
        let s = unsafe { self.slots.add((self.pos % SLOTS as u64) as usize) };
        // SAFETY: as above; the atomic may be shared.
        let seq = unsafe { &(*s).seq };
        if seq.load(Ordering::Acquire) != self.pos {
            return false;
        }
        // SAFETY: the slot is ours until its sequence is published below: the consumer reads
        // its fields only after an acquire load that sees `pos + 1`.
        unsafe {
            std::ptr::addr_of_mut!((*s).channel).write(channel);
            std::ptr::addr_of_mut!((*s).len).write(bytes.len() as u8);
            std::ptr::addr_of_mut!((*s).tag).write(tag);
            std::ptr::addr_of_mut!((*s).aux).write(aux);
            let p = std::ptr::addr_of_mut!((*s).payload) as *mut u8;
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
        }
        seq.store(self.pos + 1, Ordering::Release);
        self.pos += 1;
        true
    }
}

/// The receiving end of a ring: lives in the receiving process, whose shared memory holds the
/// ring. Only one `Consumer` may exist per ring.
pub struct Consumer {
    slots: *mut Slot,
    pos: u64,
}

// SAFETY: as for `Producer`: one thread at a time (its owner's lock).
unsafe impl Send for Consumer {}

/// Prepares the ring at `base`: every slot free for the producer's first lap.
///
/// # Safety
/// `base` is 128-byte aligned and points to [`RING_BYTES`] of mapped memory that no producer or
/// consumer uses yet.
pub unsafe fn prepare(base: *mut u8) {
    let slots = base as *mut Slot;
    for k in 0..SLOTS {
        // SAFETY: in bounds (the contract); nobody else uses the ring yet.
        unsafe { (*slots.add(k)).seq.store(k as u64, Ordering::Relaxed) };
    }
    std::sync::atomic::fence(Ordering::Release);
}

impl Consumer {
    /// The consumer of the ring at `base`, from its first message on.
    ///
    /// # Safety
    /// `base` is 128-byte aligned and points to [`RING_BYTES`] of memory that [`prepare`] has
    /// prepared, that stays mapped while the consumer lives, and that no other consumer reads.
    pub unsafe fn new(base: *mut u8) -> Consumer {
        Consumer {
            slots: base as *mut Slot,
            pos: 0,
        }
    }

    /// Takes the oldest message, if one is there.
    pub fn pop(&mut self) -> Option<Message> {
        // SAFETY: the index is below SLOTS; the mapping lives (the constructor's contract).
        let s = unsafe { self.slots.add((self.pos % SLOTS as u64) as usize) };
        // SAFETY: as above; the atomic may be shared.
        let seq = unsafe { &(*s).seq };
        if seq.load(Ordering::Acquire) != self.pos + 1 {
            return None;
        }
        // SAFETY: the producer published the slot (the acquire load above) and does not touch
        // it again until the release store below.
        let m = unsafe {
            Message {
                channel: std::ptr::addr_of!((*s).channel).read(),
                tag: std::ptr::addr_of!((*s).tag).read(),
                aux: std::ptr::addr_of!((*s).aux).read(),
                len: std::ptr::addr_of!((*s).len).read(),
                payload: std::ptr::addr_of!((*s).payload).read(),
            }
        };
        seq.store(self.pos + SLOTS as u64, Ordering::Release);
        self.pos += 1;
        Some(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::SharedMem;

    /// Messages come out in order with their bytes through several laps; a full ring refuses a
    /// push until the consumer frees a slot; an over-long payload is refused.
    #[test]
    fn messages_arrive_in_order_across_laps() {
        let mem = SharedMem::create(c"ferry-ring-test", RING_BYTES).unwrap();
        // SAFETY: a fresh page-aligned mapping of RING_BYTES, alive for the test.
        let mut rx = unsafe {
            prepare(mem.base());
            Consumer::new(mem.base())
        };
        // A second mapping, as the sending process would have.
        let peer = SharedMem::open(mem.handle().unwrap()).unwrap();
        // SAFETY: the same ring, prepared above.
        let mut tx = unsafe { Producer::new(peer.base()) };
        assert!(rx.pop().is_none());
        let mut next = 0u32;
        for lap in 0..3 {
            for k in 0..SLOTS as u32 {
                let v = lap * 1000 + k;
                assert!(
                    tx.push((k % 2) as u8, v as i32, &v.to_le_bytes()),
                    "push {k} of lap {lap}"
                );
            }
            assert!(!tx.push(0, 0, &[1]), "a full ring refuses");
            for _ in 0..SLOTS {
                let m = rx.pop().unwrap();
                let want = (next / SLOTS as u32) * 1000 + next % SLOTS as u32;
                assert_eq!((m.channel, m.tag), ((next % 2) as u8, want as i32));
                assert_eq!(m.bytes(), want.to_le_bytes());
                next += 1;
            }
            assert!(rx.pop().is_none());
        }
        // One freed slot takes one more message.
        assert!(tx.push(1, 5, &[9; PAYLOAD]));
        assert_eq!(rx.pop().unwrap().bytes(), [9; PAYLOAD]);
        assert!(!tx.push(1, 5, &[0; PAYLOAD + 1]), "longer than a slot holds");
        assert!(rx.pop().is_none());
    }

    /// A producer and a consumer on two threads (as in two processes): every message arrives
    /// once, in order, while the ring keeps filling up.
    #[test]
    fn a_concurrent_producer_and_consumer_lose_nothing() {
        const N: u64 = 200_000;
        let mem = SharedMem::create(c"ferry-ring-test", RING_BYTES).unwrap();
        // SAFETY: as above.
        let mut rx = unsafe {
            prepare(mem.base());
            Consumer::new(mem.base())
        };
        let peer = SharedMem::open(mem.handle().unwrap()).unwrap();
        let sender = std::thread::spawn(move || {
            // SAFETY: the ring prepared above; `peer` moves here and lives until the end.
            let mut tx = unsafe { Producer::new(peer.base()) };
            let mut k = 0u64;
            while k < N {
                if tx.push(0, k as i32, &k.to_le_bytes()) {
                    k += 1;
                } else {
                    std::hint::spin_loop();
                }
            }
            drop(peer);
        });
        let mut k = 0u64;
        while k < N {
            if let Some(m) = rx.pop() {
                assert_eq!(m.bytes(), k.to_le_bytes());
                k += 1;
            }
        }
        sender.join().unwrap();
        assert!(rx.pop().is_none());
    }
}
