//! Active messages between ranks of one node through shared-memory rings
//! ([`ferry_base::node_rings`]), beside MPI: the shared-memory transport that MPI libraries
//! themselves use on a node (Open MPI's `vader`, UCX's `sm`), minus the MPI calls. A message
//! that fits a ring slot ([`ring::PAYLOAD`] bytes) is written into the ring the peer keeps for
//! this rank by the sending thread itself, with no hand-off to the progress thread and no MPI
//! call; the peer's progress loop finds it in its next pass with one load.
//!
//! **Order.** Delivery order per (source, tag) is send order whatever the transport: a message
//! too long for a slot goes over MPI as before, and a marker takes its place in the ring. The
//! receiver reads each source's ring in order; at a marker it waits for the source's next MPI
//! message (MPI keeps those in order), delivers it, and only then reads on. MPI messages from
//! a source whose ring is used are held until their marker is read. A sender enqueues the MPI
//! send and pushes its marker under one lock per peer, so the k-th marker always names the k-th
//! MPI message, however many threads send.
//!
//! **Full rings.** A message that finds the ring full waits, in order, in an overflow that the
//! progress loop pushes on: the sender never blocks (a progress thread that blocked on a full
//! ring while its own filled would deadlock with its peer's).
//!
//! **Pairs.** Two ranks use their rings only when each mapped the other's (agreed at start-up);
//! otherwise every message between them goes over MPI.

use ferry_base::error::Rank;
use ferry_base::node_rings::{Inbound, PeerRing, RingCaps};
use ferry_base::ring::{self, Consumer};
use ferry_comm::AmBuf;
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A slot holding the message's bytes.
const BYTES: u8 = 1;
/// A slot standing for the source's next active message over MPI.
const MARKER: u8 = 2;

/// A message waiting for room in the ring: kind, tag, bytes.
type Overflow = (u8, i32, SmallVec<[u8; ring::PAYLOAD]>);

/// The writing end into one peer's ring.
struct Out {
    peer: PeerRing,
    overflow: VecDeque<Overflow>,
}

/// The reading end of one peer's ring.
struct In {
    ring: Consumer,
    /// Its active messages that came over MPI, until their marker is read.
    mpi: VecDeque<(i32, AmBuf)>,
    /// A marker was read whose message has not yet come over MPI: the ring waits for it.
    waiting: bool,
}

/// The rings of one rank with the peers of its node it shares them with.
pub(crate) struct AmRings {
    /// Kept mapped while the consumers read it.
    _inbound: Inbound,
    /// Per rank: the writing end (any thread, under its lock), where the pair uses rings.
    out: Vec<Option<Mutex<Out>>>,
    /// Per rank: the reading end (the progress loop's), where the pair uses rings.
    inn: Mutex<Vec<Option<In>>>,
    /// Messages in overflows: the loop keeps pushing while there are any.
    queued: AtomicUsize,
}

/// An active message read from a ring (or released by its marker): source, tag, bytes.
pub(crate) type Arrived = (Rank, i32, AmBuf);

impl AmRings {
    /// This rank's inbound rings, made before the start-up exchange (`None` when they cannot be
    /// made: every message then goes over MPI).
    pub(crate) fn inbound(local_rank: usize, local_size: usize) -> Option<Inbound> {
        (local_size > 1)
            .then(|| {
                Inbound::create(c"ferry-am-rings", local_rank as u32, local_size as u32)
                    .map_err(|e| tracing::info!("active messages on the node go over MPI (no rings: {e})"))
                    .ok()
            })
            .flatten()
    }

    /// Maps the rings that `peers` (rank, their caps, on this node) published: the ranks whose
    /// rings this rank could map, and the writing ends.
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
    /// [`AmRings::open`] mapped), for a job of `size` ranks; `None` when there is none.
    pub(crate) fn new(inbound: Inbound, pairs: Vec<(Rank, u32, PeerRing)>, size: usize) -> Option<AmRings> {
        let mut out: Vec<Option<Mutex<Out>>> = (0..size).map(|_| None).collect();
        let mut inn: Vec<Option<In>> = (0..size).map(|_| None).collect();
        for (r, local, peer) in pairs {
            // SAFETY: one consumer per ring (each peer has one local rank), and `_inbound`
            // keeps the mapping while the consumers live.
            let Some(ring) = (unsafe { inbound.consumer(local) }) else {
                continue;
            };
            out[r as usize] = Some(Mutex::new(Out {
                peer,
                overflow: VecDeque::new(),
            }));
            inn[r as usize] = Some(In {
                ring,
                mpi: VecDeque::new(),
                waiting: false,
            });
        }
        out.iter().any(Option::is_some).then(|| AmRings {
            _inbound: inbound,
            out,
            inn: Mutex::new(inn),
            queued: AtomicUsize::new(0),
        })
    }

    /// Whether active messages with `peer` go through its ring.
    pub(crate) fn serves(&self, peer: Rank) -> bool {
        self.out.get(peer as usize).is_some_and(Option::is_some)
    }

    /// Writes an active message to `peer` into its ring (or its overflow, in order), when the
    /// pair uses rings and the bytes fit a slot; `false` otherwise (nothing sent). Never blocks.
    pub(crate) fn send_small(&self, peer: Rank, tag: i32, bytes: &[u8]) -> bool {
        match self.out.get(peer as usize) {
            Some(Some(o)) if bytes.len() <= ring::PAYLOAD => {
                self.push(&mut o.lock().unwrap_or_else(|e| e.into_inner()), BYTES, tag, bytes);
                true
            }
            _ => false,
        }
    }

    /// Sends an active message to `peer` over MPI (`over_mpi` enqueues it for the progress
    /// loop, without a pass on this thread: it runs under the peer's lock), with its marker in
    /// the ring when the pair uses rings. Never blocks.
    ///
    /// # Errors
    /// What `over_mpi` returns; nothing was sent then.
    pub(crate) fn send_large<E>(
        &self,
        peer: Rank,
        tag: i32,
        over_mpi: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let Some(Some(o)) = self.out.get(peer as usize) else {
            return over_mpi();
        };
        let mut o = o.lock().unwrap_or_else(|e| e.into_inner());
        over_mpi()?;
        self.push(&mut o, MARKER, tag, &[]);
        Ok(())
    }

    /// Into the ring, or its overflow when the ring is full or the overflow not yet empty.
    fn push(&self, o: &mut Out, kind: u8, tag: i32, bytes: &[u8]) {
        if o.overflow.is_empty() && o.peer.ring.push(kind, tag, bytes) {
            return;
        }
        o.overflow.push_back((kind, tag, SmallVec::from_slice(bytes)));
        self.queued.fetch_add(1, Ordering::Relaxed);
    }

    /// An active message from `source` that came over MPI: held until its marker when the pair
    /// uses rings (what that releases is added to `ready`), else given back.
    pub(crate) fn arrived_over_mpi(
        &self,
        source: Rank,
        tag: i32,
        bytes: AmBuf,
        ready: &mut Vec<Arrived>,
    ) -> Option<AmBuf> {
        let mut inn = self.inn.lock().unwrap_or_else(|e| e.into_inner());
        let Some(Some(i)) = inn.get_mut(source as usize) else {
            return Some(bytes);
        };
        i.mpi.push_back((tag, bytes));
        drain(source, i, ready);
        None
    }

    /// One pass: pushes what waits in the overflows, and reads every ring; the messages due are
    /// added to `ready`. Returns whether messages still wait for room (the loop must keep
    /// polling).
    pub(crate) fn poll(&self, ready: &mut Vec<Arrived>) -> bool {
        if self.queued.load(Ordering::Relaxed) > 0 {
            for o in self.out.iter().flatten() {
                let mut g = o.lock().unwrap_or_else(|e| e.into_inner());
                let o = &mut *g;
                while let Some((kind, tag, bytes)) = o.overflow.front() {
                    if !o.peer.ring.push(*kind, *tag, bytes) {
                        break;
                    }
                    o.overflow.pop_front();
                    self.queued.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        let mut inn = self.inn.lock().unwrap_or_else(|e| e.into_inner());
        for (source, i) in inn.iter_mut().enumerate() {
            if let Some(i) = i {
                drain(source as Rank, i, ready);
            }
        }
        self.queued.load(Ordering::Relaxed) > 0
    }
}

/// Reads `source`'s ring in order while it can: a slot's bytes are due at once; a marker
/// releases the source's next MPI message, or makes the ring wait for it.
fn drain(source: Rank, i: &mut In, ready: &mut Vec<Arrived>) {
    loop {
        if i.waiting {
            let Some((tag, bytes)) = i.mpi.pop_front() else {
                return;
            };
            ready.push((source, tag, bytes));
            i.waiting = false;
        }
        let Some(m) = i.ring.pop() else {
            return;
        };
        match m.channel {
            BYTES => ready.push((source, m.tag, AmBuf::from(m.bytes().to_vec()))),
            _ => i.waiting = true,
        }
    }
}
