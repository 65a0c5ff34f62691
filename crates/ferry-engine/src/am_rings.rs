//! Active messages between ranks of one node through shared-memory rings
//! ([`ferry_base::node_rings`]), beside MPI: the shared-memory transport that MPI libraries
//! themselves use on a node (Open MPI's `vader`, UCX's `sm`), minus the MPI calls. The sending
//! thread itself writes the message into the rings the peer keeps for this rank, with no
//! hand-off to the progress thread and no MPI call; the peer's progress loop finds it in its
//! next pass with one load.
//!
//! - A message of up to [`ring::PAYLOAD`] bytes goes in one slot of the message ring.
//! - A longer one, up to the engine's limit for the rings ([`crate::EngineConfig::am_ring_max_bytes`]),
//!   is copied into the pair's byte ring ([`ferry_base::byte_ring`]), and one slot says where;
//!   the receiver copies it out into a buffer of its own (the engine's pool for long ones) and
//!   frees the bytes. Copy in, copy out: from 109 bytes to 64 KiB that costs less than several
//!   slots, and less than MPI's rendezvous.
//! - Without byte rings (the limit at most [`PARTS_MAX`]), a message of up to [`PARTS_MAX`]
//!   bytes goes in consecutive slots; the receiver joins the parts.
//!
//! **Order.** Delivery order per (source, tag) is send order whatever the transport. A message
//! too long for the rings goes over MPI (MPI keeps those in order), and every slot carries how
//! many of the sender's messages to this peer went over MPI before it. The receiver
//! delivers a slot only once it has delivered that many MPI messages from the source, and, when
//! an MPI message arrives, first delivers the slots sent before it. Those are in the ring by
//! then: a sender hands a message to MPI only once everything it sent to the peer before is in
//! the ring (an MPI message waits behind a full ring's overflow like any other), and MPI's
//! delivery of the later message orders it after those stores.
//!
//! **Full rings.** A message that finds the message ring or the byte ring full waits, in order,
//! in an overflow that the progress loop pushes on: the sender never blocks (a progress thread
//! that blocked on a full ring while its own filled would deadlock with its peer's).
//!
//! **Pairs.** Two ranks use their rings only when each mapped the other's (agreed at start-up);
//! otherwise every message between them goes over MPI.

use ferry_base::byte_ring::ByteReader;
use ferry_base::error::Rank;
use ferry_base::node_rings::{Inbound, PeerRing, RingCaps};
use ferry_base::ring::{self, Consumer};
use ferry_comm::{AmBuf, AmPool, Cmd, CommHandle};
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The longest active message that travels in several slots of the message ring, bytes (10
/// slots), where the pair has no byte ring. With one, every message longer than a slot goes
/// through it: one copy in and one copy out cost less than a second slot's sequence word.
pub(crate) const PARTS_MAX: usize = 10 * ring::PAYLOAD;
/// The ring channel of a slot that holds a whole message, or the last part of one.
const AM_LAST: u8 = 1;
/// The ring channel of a slot that holds a part of a message, more following.
const AM_PART: u8 = 2;
/// The ring channel of a slot that says where a message lies in the byte ring: its position
/// (`u64`) and length (`u32`), little-endian.
const AM_BYTES: u8 = 3;
/// Largest data bytes of one pair's byte ring.
const BYTE_RING_MAX: usize = 1 << 20;
/// Data bytes of byte rings a rank keeps for all its node's peers together, at most (above the
/// floor of two of the longest messages each).
const BYTE_RINGS_PER_RANK: usize = 16 << 20;

/// What waits in an overflow, in send order.
enum Overflow {
    /// A slot: channel, tag, MPI messages before it, bytes.
    Slot(u8, i32, u32, SmallVec<[u8; ring::PAYLOAD]>),
    /// A message for the byte ring, which was full: tag, MPI messages before it, bytes.
    Bytes(i32, u32, Vec<u8>),
    /// An MPI send, handed to the loop once the slots before it are in the ring.
    Mpi(Cmd),
}

/// The data bytes of each byte ring for a node of `local_size` ranks whose longest message
/// through the rings is `ring_max` bytes (0: no byte rings, every message fits the slots). Room
/// for two of the longest messages at least, 1 MiB at most, and in between 16 MiB shared among
/// the peers, in pages.
pub(crate) fn byte_ring_bytes(local_size: usize, ring_max: usize) -> u32 {
    if ring_max <= PARTS_MAX || local_size < 2 {
        return 0;
    }
    let share = BYTE_RINGS_PER_RANK / (local_size - 1);
    let bytes = share.min(BYTE_RING_MAX).max(2 * ring_max).next_multiple_of(4096);
    u32::try_from(bytes).unwrap_or(BYTE_RING_MAX as u32)
}

/// The writing end into one peer's rings.
struct Out {
    peer: PeerRing,
    overflow: VecDeque<Overflow>,
    /// Messages to this peer handed to MPI (or queued for it) so far, wrapping.
    mpi_sent: u32,
}

/// The reading end of one peer's rings.
struct In {
    ring: Consumer,
    /// Its byte ring, where the rings have them.
    bytes: Option<ByteReader>,
    /// Messages from this peer delivered from MPI so far, wrapping.
    mpi_seen: u32,
    /// A slot read but not yet due: it waits for an MPI message sent before it.
    held: Option<ring::Message>,
    /// The parts of a message read so far.
    parts: Vec<u8>,
}

/// The rings of one rank with the peers of its node it shares them with.
pub(crate) struct AmRings {
    /// Kept mapped while the consumers read it.
    _inbound: Inbound,
    /// Per rank: the writing end (any thread, under its lock), where the pair uses rings.
    out: Vec<Option<Mutex<Out>>>,
    /// The reading ends (the progress loop's) of the peers whose pair uses rings, by source.
    inn: Mutex<Vec<(Rank, In)>>,
    /// Per rank: its place in `inn`, where the pair uses rings.
    in_at: Vec<Option<u32>>,
    /// Entries in overflows: the loop keeps pushing while there are any.
    queued: AtomicUsize,
    /// Where the loop's flush hands the MPI sends that waited.
    comm: CommHandle,
    /// The longest message through the rings (slots or byte ring), bytes.
    ring_max: usize,
    /// Buffers of long messages copied out of byte rings.
    pool: Arc<AmPool>,
}

/// An active message read from a ring (or that came over MPI and is due): source, tag, bytes.
pub(crate) type Arrived = (Rank, i32, AmBuf);

impl AmRings {
    /// This rank's inbound rings, made before the start-up exchange (`None` when alone on its
    /// node, or when they cannot be made: every message then goes over MPI).
    /// `ring_max` is the longest message to go through them (its byte rings are sized for it).
    pub(crate) fn inbound(local_rank: usize, local_size: usize, ring_max: usize) -> Option<Inbound> {
        (local_size > 1)
            .then(|| {
                let bytes = byte_ring_bytes(local_size, ring_max);
                Inbound::create(c"ferry-am-rings", local_rank as u32, local_size as u32, bytes)
                    .map_err(|e| tracing::info!("active messages on the node go over MPI (no rings: {e})"))
                    .ok()
            })
            .flatten()
    }

    /// Maps the rings that `peers` (rank, their caps, on this node) published: the ranks whose
    /// rings this rank could map, their local ranks, and the writing ends.
    pub(crate) fn open(inbound: &Inbound, peers: &[(Rank, RingCaps)]) -> Vec<(Rank, u32, PeerRing)> {
        peers
            .iter()
            .filter_map(|(r, caps)| match inbound.open_peer(caps) {
                Ok(p) => Some((*r, caps.local_rank, p)),
                Err(e) => {
                    tracing::info!(peer = r, "active messages with this peer go over MPI (its rings: {e})");
                    None
                }
            })
            .collect()
    }

    /// The rings shared with `pairs` (the peers that mapped this rank's rings too, among those
    /// [`AmRings::open`] mapped), for a job of `size` ranks, carrying messages of up to
    /// `ring_max` bytes; `None` when there is none.
    pub(crate) fn new(
        inbound: Inbound,
        pairs: Vec<(Rank, u32, PeerRing)>,
        size: usize,
        ring_max: usize,
        comm: CommHandle,
        pool: Arc<AmPool>,
    ) -> Option<AmRings> {
        let mut out: Vec<Option<Mutex<Out>>> = (0..size).map(|_| None).collect();
        let mut inn: Vec<(Rank, In)> = Vec::new();
        let mut in_at: Vec<Option<u32>> = vec![None; size];
        for (r, local, peer) in pairs {
            // SAFETY: one consumer per ring (each peer has one local rank), and `_inbound`
            // keeps the mapping while the consumers live.
            let Some(ring) = (unsafe { inbound.consumer(local) }) else {
                continue;
            };
            // SAFETY: as above, for its byte ring.
            let bytes = unsafe { inbound.payload_reader(local) };
            out[r as usize] = Some(Mutex::new(Out {
                peer,
                overflow: VecDeque::new(),
                mpi_sent: 0,
            }));
            in_at[r as usize] = Some(inn.len() as u32);
            inn.push((
                r,
                In {
                    ring,
                    bytes,
                    mpi_seen: 0,
                    held: None,
                    parts: Vec::new(),
                },
            ));
        }
        out.iter().any(Option::is_some).then(|| AmRings {
            _inbound: inbound,
            out,
            inn: Mutex::new(inn),
            in_at,
            queued: AtomicUsize::new(0),
            comm,
            ring_max,
            pool,
        })
    }

    /// Whether messages wait in an overflow.
    pub(crate) fn waiting(&self) -> bool {
        self.queued.load(Ordering::Relaxed) > 0
    }

    /// Whether active messages with `peer` go through its ring.
    pub(crate) fn serves(&self, peer: Rank) -> bool {
        self.out.get(peer as usize).is_some_and(Option::is_some)
    }

    /// Writes an active message to `peer` into its rings (what finds them full goes to the
    /// overflow, in order) when the pair uses rings and the message fits them: in one slot up
    /// to [`ring::PAYLOAD`] bytes, else through the byte ring up to the engine's limit for the
    /// rings and the byte ring's capacity, else (no byte ring) in consecutive slots up to
    /// [`PARTS_MAX`]. `false` otherwise (nothing sent: it goes over MPI). Never blocks.
    pub(crate) fn send(&self, peer: Rank, tag: i32, bytes: &[u8]) -> bool {
        let Some(Some(o)) = self.out.get(peer as usize) else {
            return false;
        };
        if bytes.len() > self.ring_max {
            return false;
        }
        let mut g = o.lock().unwrap_or_else(|e| e.into_inner());
        let o = &mut *g;
        let before = o.mpi_sent;
        if bytes.len() > ring::PAYLOAD {
            let Some(w) = o.peer.payload.as_mut().filter(|w| w.capacity() >= bytes.len()) else {
                if bytes.len() > PARTS_MAX {
                    return false;
                }
                return self.push_parts(o, tag, bytes);
            };
            // In the byte ring, then its slot; or, behind others or with a ring full, in the
            // overflow (the bytes wait there when they have no room yet).
            let written = if o.overflow.is_empty() { w.write(bytes) } else { None };
            let entry = match written {
                Some(at) => {
                    let slot = bytes_slot(at, bytes.len());
                    if o.peer.ring.push_with(AM_BYTES, tag, before, &slot) {
                        return true;
                    }
                    Overflow::Slot(AM_BYTES, tag, before, SmallVec::from_slice(&slot))
                }
                None => Overflow::Bytes(tag, before, bytes.to_vec()),
            };
            o.overflow.push_back(entry);
            self.queued.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        self.push_parts(o, tag, bytes)
    }

    /// Writes a message of up to [`PARTS_MAX`] bytes into consecutive slots (what finds the
    /// ring full, or others waiting, goes to the overflow, in order). Under the peer's lock, so
    /// that the parts lie in consecutive slots.
    fn push_parts(&self, o: &mut Out, tag: i32, bytes: &[u8]) -> bool {
        let before = o.mpi_sent;
        let parts = bytes.len().div_ceil(ring::PAYLOAD).max(1);
        for k in 0..parts {
            let part = &bytes[(k * ring::PAYLOAD).min(bytes.len())..((k + 1) * ring::PAYLOAD).min(bytes.len())];
            let channel = if k + 1 == parts { AM_LAST } else { AM_PART };
            if o.overflow.is_empty() && o.peer.ring.push_with(channel, tag, before, part) {
                continue;
            }
            o.overflow
                .push_back(Overflow::Slot(channel, tag, before, SmallVec::from_slice(part)));
            self.queued.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// Sends `cmd`, an active message's MPI send to `peer`: through `post` at once, or, while
    /// slots sent before it wait in the overflow, after them (the loop posts it). Counted
    /// either way, so later slots wait for it at the receiver. Never blocks.
    ///
    /// # Errors
    /// What `post` returns; nothing was sent then.
    pub(crate) fn send_large<E>(&self, peer: Rank, cmd: Cmd, post: impl FnOnce(Cmd) -> Result<(), E>) -> Result<(), E> {
        let Some(Some(o)) = self.out.get(peer as usize) else {
            return post(cmd);
        };
        let mut o = o.lock().unwrap_or_else(|e| e.into_inner());
        if o.overflow.is_empty() {
            // Under the lock, so that no slot sent after it is counted before it.
            post(cmd)?;
        } else {
            o.overflow.push_back(Overflow::Mpi(cmd));
            self.queued.fetch_add(1, Ordering::Relaxed);
        }
        o.mpi_sent = o.mpi_sent.wrapping_add(1);
        Ok(())
    }

    /// An active message from `source` that came over MPI: when the pair uses rings, the slots
    /// sent before it, then it, then the slots that waited for it are added to `ready`; else
    /// it is given back.
    pub(crate) fn arrived_over_mpi(
        &self,
        source: Rank,
        tag: i32,
        bytes: AmBuf,
        ready: &mut Vec<Arrived>,
    ) -> Option<AmBuf> {
        let Some(&Some(at)) = self.in_at.get(source as usize) else {
            return Some(bytes);
        };
        let mut inn = self.inn.lock().unwrap_or_else(|e| e.into_inner());
        let i = &mut inn[at as usize].1;
        drain(source, i, &self.pool, ready);
        ready.push((source, tag, bytes));
        i.mpi_seen = i.mpi_seen.wrapping_add(1);
        drain(source, i, &self.pool, ready);
        None
    }

    /// One pass: pushes what waits in the overflows (and hands the MPI sends among them to the
    /// loop), and reads every ring; the messages due are added to `ready`. Returns whether
    /// entries still wait (the loop must keep polling).
    pub(crate) fn poll(&self, ready: &mut Vec<Arrived>) -> bool {
        if self.queued.load(Ordering::Relaxed) > 0 {
            for o in self.out.iter().flatten() {
                let mut g = o.lock().unwrap_or_else(|e| e.into_inner());
                let o = &mut *g;
                while let Some(front) = o.overflow.front_mut() {
                    if let Overflow::Bytes(tag, before, bytes) = front {
                        // Into the byte ring first; its slot then waits like any other.
                        let Some(at) = o.peer.payload.as_mut().and_then(|w| w.write(bytes)) else {
                            break;
                        };
                        *front = Overflow::Slot(
                            AM_BYTES,
                            *tag,
                            *before,
                            SmallVec::from_slice(&bytes_slot(at, bytes.len())),
                        );
                    }
                    if let Overflow::Slot(channel, tag, before, bytes) = front {
                        if !o.peer.ring.push_with(*channel, *tag, *before, bytes) {
                            break;
                        }
                    }
                    if let Some(Overflow::Mpi(cmd)) = o.overflow.pop_front() {
                        if let Err(e) = self.comm.post(cmd) {
                            tracing::error!("active message not sent: {e}");
                        }
                    }
                    self.queued.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        let mut inn = self.inn.lock().unwrap_or_else(|e| e.into_inner());
        for (source, i) in inn.iter_mut() {
            drain(*source, i, &self.pool, ready);
        }
        self.queued.load(Ordering::Relaxed) > 0
    }
}

/// The slot that says where a message lies in the byte ring.
fn bytes_slot(at: u64, len: usize) -> [u8; 12] {
    let mut slot = [0u8; 12];
    slot[..8].copy_from_slice(&at.to_le_bytes());
    slot[8..].copy_from_slice(&(len as u32).to_le_bytes());
    slot
}

/// The position and length a [`bytes_slot`] carries; a position no byte ring has for any other
/// slot (which [`ByteReader::take`] refuses).
fn read_bytes_slot(slot: &[u8]) -> (u64, usize) {
    match <[u8; 12]>::try_from(slot) {
        Ok(b) => (
            u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            u32::from_le_bytes(b[8..].try_into().expect("4 bytes")) as usize,
        ),
        Err(_) => (u64::MAX, 0),
    }
}

/// Delivers `source`'s messages in order while they are due: a slot waits (held) until as many
/// of the source's MPI messages as went before it have been delivered; the parts of a message
/// are joined, and it is delivered with its last; a message in the byte ring is copied out
/// (into a buffer of `pool` when long) and its bytes freed.
fn drain(source: Rank, i: &mut In, pool: &Arc<AmPool>, ready: &mut Vec<Arrived>) {
    loop {
        let Some(m) = i.held.take().or_else(|| i.ring.pop()) else {
            return;
        };
        // Ahead of the MPI messages seen (wrapping): not due yet.
        if (m.aux.wrapping_sub(i.mpi_seen) as i32) > 0 {
            i.held = Some(m);
            return;
        }
        if m.channel == AM_PART {
            i.parts.extend_from_slice(m.bytes());
            continue;
        }
        if m.channel == AM_BYTES {
            let (at, len) = read_bytes_slot(m.bytes());
            match i.bytes.as_mut().and_then(|r| r.take(at, len, |b| pool.copy_of(b))) {
                Some(b) => ready.push((source, m.tag, b)),
                // Only a peer that broke the protocol gets here (no byte ring, or a position
                // that is not the next): nothing to deliver, and nothing else to free.
                None => tracing::error!(
                    source,
                    tag = m.tag,
                    "active message dropped: its slot names bytes {at}+{len} that are not the next in the byte ring"
                ),
            }
            continue;
        }
        let bytes = if i.parts.is_empty() {
            m.bytes().to_vec()
        } else {
            let mut whole = std::mem::take(&mut i.parts);
            whole.extend_from_slice(m.bytes());
            whole
        };
        ready.push((source, m.tag, AmBuf::from(bytes)));
    }
}
