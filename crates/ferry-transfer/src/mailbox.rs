//! The control ring: the descriptors and acknowledgements of transfers between ranks of one node
//! go through shared memory instead of MPI (`FERRY_CONTROL_RING`), and so do the small host
//! tiles of the host route (one slot, [`TILE_MAX`] bytes at most: [`Mailbox::send_tile_here`],
//! [`Mailbox::want_tile`]).
//!
//! Why: a small tile's IPC transfer is a cycle of hand-offs — the producer's GPU manager → its
//! MPI thread → MPI → the consumer's MPI thread → the consumer's GPU manager, and back with the
//! acknowledgement — and the GPU work (a stamp, a pull) is a small part of it
//! (measured on one H100 with two ranks under MPS). Through the ring, whichever thread sends (the GPU manager
//! at a launch or a copy's completion) writes the message itself, with no hand-off and no MPI
//! call, and the receiving rank's MPI thread finds it in its next pass without a probe.
//!
//! A small tile is that cycle too, on the host route: over MPI its send is a hand-off to the
//! loop, an `MPI_Isend` and a completion a pass later, and its receive a probe, an
//! `MPI_Imrecv` and a completion, each pass a microsecond or so on a small VM: the latency of
//! a fine-grained graph whose ranks exchange one tile per step (Task Bench's `stencil_1d` on
//! a rank per core). Through the ring, the sending worker writes the slot and its send is over;
//! the receiver's pass copies the slot into the landing buffer and completes the receive.
//! Larger payloads never go through the ring (IPC pulls them; other routes send them over
//! MPI).
//!
//! Each rank holds, in one shared mapping, an inbound ring (`ferry_base::node_rings`) per rank of its node,
//! at the index of that rank's local rank, and maps each served peer's mapping to write into the
//! ring the peer keeps for it. Matching is that of `ferry-comm/src/matching.rs`: by peer, channel and tag,
//! the oldest wanted receive first; a message that comes before its receive is wanted waits for
//! it. Callbacks run on the polling thread (the MPI thread, which registers [`Mailbox::poll`] as
//! a [`ferry_base::poller::Poller`]), never on a thread that sends or wants — except that
//! [`Mailbox::send_here`] gives a message's callback back to its sender when the message went
//! straight into the ring.
//!
//! Both ranks of a pair use the ring for all their control messages, or neither does (decided
//! at start-up from what both could map), so a message never goes one way and its receive the
//! other.

use super::region::Small;
use super::Done;
use ferry_base::error::{FerryError, Rank, Result};
use ferry_base::fifo_map::FifoMap;
pub use ferry_base::node_rings::Inbound;
use ferry_base::node_rings::{PeerRing, RingCaps};
use ferry_base::poller::Polled;
use ferry_base::ring::{self, Consumer, Message};
use ferry_base::traffic::TrafficPath;
use ferry_engine::{Lane, MemRegion};
use ferry_memory::counters::MemoryCounters;
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

/// The longest tile that goes through the ring, bytes: one slot.
pub const TILE_MAX: usize = ring::PAYLOAD;
/// The ring channel of tiles; the lanes of control messages are 0 and 1 ([`channel_number`]).
const TILE_CHANNEL: u8 = 2;

/// `(peer, channel, tag)`.
type Key = (Rank, u8, i32);

/// A message that found its ring full, kept in order until there is room, with the callback
/// that says it left.
type Pending = (u8, i32, SmallVec<[u8; ring::PAYLOAD]>, Done);

/// What a peer publishes of its control rings at start-up.
pub type MailboxCaps = RingCaps;

/// This rank's inbound control rings, made before the ranks exchange what they can do.
///
/// # Errors
/// The shared memory could not be made (`Config` error naming the cause).
pub fn inbound(local_rank: u32, local_size: u32) -> Result<Inbound> {
    Inbound::create(c"ferry-control-rings", local_rank, local_size, 0)
        .map_err(|e| FerryError::Config(format!("control ring (FERRY_CONTROL_RING): {e}")))
}

/// Maps `peer`'s control rings: the end that writes into the one it keeps for this rank.
///
/// # Errors
/// As [`Inbound::open_peer`].
pub fn open_peer(inbound: &Inbound, peer: &MailboxCaps) -> std::io::Result<Outbound> {
    Ok(Outbound {
        peer: inbound.open_peer(peer)?,
        overflow: VecDeque::new(),
    })
}

/// The end that writes into a peer's ring for this rank.
pub struct Outbound {
    /// The producer, with the peer's mapping it points into.
    peer: PeerRing,
    /// Messages that found the ring full, in order (sent before any newer one).
    overflow: VecDeque<Pending>,
}

impl Outbound {
    /// Pushes what waits in the overflow, in order, while there is room; the callbacks of what
    /// left go to `sent`. Returns how many left.
    fn flush(&mut self, sent: &mut Vec<(Done, Result<()>)>) -> usize {
        let mut pushed = 0;
        while let Some((channel, tag, bytes, _)) = self.overflow.front() {
            if !self.peer.ring.push(*channel, *tag, bytes) {
                break;
            }
            if let Some((.., done)) = self.overflow.pop_front() {
                sent.push((done, Ok(())));
                pushed += 1;
            }
        }
        pushed
    }
}

/// A receive waiting for its message: the memory it lands in (a control message's
/// [`Small`], or a tile's landing buffer) and what runs once it has.
struct Want {
    buf: Arc<dyn MemRegion>,
    done: Done,
}

/// What the polling thread shares with the threads that send and want.
#[derive(Default)]
struct State {
    /// Receives whose message has not come, oldest first.
    wanted: FifoMap<Key, Want>,
    /// Messages that came before their receive was wanted, in arrival order.
    early: FifoMap<Key, Message>,
    /// Receives in `wanted`.
    waiting: usize,
    /// Callbacks due (completed sends, receives matched by `want`): run by the next poll.
    due: Vec<(Done, Result<()>)>,
    /// Set by a poll that expected nothing (its thread may block): the next `want` or send
    /// wakes it.
    parked: bool,
    /// Per served peer, in rank order: the reading end (the polling thread's).
    consumers: Vec<(Rank, Consumer)>,
}

/// The control rings of one rank with the peers it serves.
pub struct Mailbox {
    /// Kept mapped while the consumers read it.
    _inbound: Inbound,
    /// Per served peer, in rank order: the writing end (any thread, under its lock).
    out: Vec<(Rank, Mutex<Outbound>)>,
    state: Mutex<State>,
    /// Messages waiting in the outbound overflows: the poll looks at the writing ends only
    /// when some do (it runs in every pass of the MPI thread).
    queued: AtomicUsize,
    /// Wakes the polling thread (posts it an empty command); set once it exists.
    waker: OnceLock<Box<dyn Fn() + Send + Sync>>,
    counters: Arc<MemoryCounters>,
}

fn channel_number(c: Lane) -> u8 {
    match c {
        Lane::Data => 0,
        Lane::Control => 1,
    }
}

/// Where a message of ring channel `c` is counted.
fn path_of(c: u8) -> TrafficPath {
    if c == TILE_CHANNEL {
        TrafficPath::HostRing
    } else {
        TrafficPath::ControlRing
    }
}

impl Mailbox {
    /// The mailbox of a rank whose `inbound` rings serve `peers`: `(rank, its local rank, the
    /// writing end into its ring for this rank)`.
    pub fn new(inbound: Inbound, peers: Vec<(Rank, u32, Outbound)>, counters: Arc<MemoryCounters>) -> Mailbox {
        let mut consumers = Vec::with_capacity(peers.len());
        let mut out = Vec::with_capacity(peers.len());
        for (rank, local, o) in peers {
            // SAFETY: only this consumer reads ring `local`, and `_inbound` keeps it mapped.
            let Some(c) = (unsafe { inbound.consumer(local) }) else {
                debug_assert!(false, "`Inbound::open_peer` checks the peer's local rank");
                continue;
            };
            consumers.push((rank, c));
            out.push((rank, Mutex::new(o)));
        }
        Mailbox {
            _inbound: inbound,
            out,
            state: Mutex::new(State {
                consumers,
                ..State::default()
            }),
            queued: AtomicUsize::new(0),
            waker: OnceLock::new(),
            counters,
        }
    }

    /// Installs what wakes the polling thread (once).
    pub fn set_waker(&self, wake: Box<dyn Fn() + Send + Sync>) {
        let _ = self.waker.set(wake);
    }

    /// Whether control messages with `peer` go through its ring.
    pub fn serves(&self, peer: Rank) -> bool {
        self.out.iter().any(|(r, _)| *r == peer)
    }

    /// Peers served, in rank order.
    pub fn peers(&self) -> Vec<Rank> {
        self.out.iter().map(|(r, _)| *r).collect()
    }

    /// Sends the bytes of `buf` to `peer` on `channel` with `tag`; `done` runs in the poll after
    /// the bytes are in the ring (at once, or once it has room: they wait in order meanwhile).
    pub fn send(&self, peer: Rank, channel: Lane, tag: i32, buf: &Small, done: Done) {
        // SAFETY: a buffer being sent has no receive in flight.
        let bytes = unsafe { buf.get() };
        if let Some((done, r)) = self.push(peer, channel_number(channel), tag, bytes, move || done) {
            self.later(done(), r);
        }
    }

    /// As [`Mailbox::send`], but a message that goes straight into the ring gives `done` back
    /// unrun: the sending thread knows at once that it is sent and runs `done` itself, or drops
    /// it, sparing the hand-off to the polling thread (an acknowledgement, whose completion
    /// nobody waits for; a descriptor, whose sender carries on where it is). `None`: the message
    /// waits for room, or was refused, and `done` runs on the polling thread as for `send`.
    pub fn send_here(&self, peer: Rank, channel: Lane, tag: i32, bytes: &[u8], done: Done) -> Option<Done> {
        self.push_here(peer, channel_number(channel), tag, bytes, done)
    }

    /// Sends the tile `bytes` (at most [`TILE_MAX`]) of transfer `tag` to `peer`, counted on
    /// [`TrafficPath::HostRing`]; `done` comes back unrun when the slot went straight into the
    /// ring, as for [`Mailbox::send_here`]. Its receive is [`Mailbox::want_tile`]: tiles have a
    /// channel of their own, so a tile never matches a control message of the same tag.
    pub fn send_tile_here(&self, peer: Rank, tag: i32, bytes: &[u8], done: Done) -> Option<Done> {
        self.push_here(peer, TILE_CHANNEL, tag, bytes, done)
    }

    fn push_here(&self, peer: Rank, c: u8, tag: i32, bytes: &[u8], done: Done) -> Option<Done> {
        match self.push(peer, c, tag, bytes, move || done) {
            Some((done, Ok(()))) => Some(done()),
            None => None,
            Some((done, r)) => {
                self.later(done(), r);
                None
            }
        }
    }

    /// Sends `bytes` as [`Mailbox::send_here`] does a message whose completion nobody waits for
    /// (an acknowledgement), but makes its callback with `done` only if it needs one: when the
    /// message must wait for room (the callback then runs on the polling thread once it is in the
    /// ring) or is refused. The usual message goes straight into the ring and allocates nothing
    /// (the callback was a box allocated and freed per IPC transfer on the GPU manager).
    pub fn send_unwatched(&self, peer: Rank, channel: Lane, tag: i32, bytes: &[u8], done: impl FnOnce() -> Done) {
        if let Some((done, r @ Err(_))) = self.push(peer, channel_number(channel), tag, bytes, done) {
            self.later(done(), r);
        }
    }

    /// Puts a message into `peer`'s ring, or behind the older ones that wait for room (`None`:
    /// the callback, made by `done`, waits with it). `Some` gives `done` back unmade with the
    /// outcome: in the ring, or refused.
    fn push<D: FnOnce() -> Done>(&self, peer: Rank, c: u8, tag: i32, bytes: &[u8], done: D) -> Option<(D, Result<()>)> {
        let r = match self.out.iter().find(|(r, _)| *r == peer) {
            None => Err(FerryError::Protocol {
                peer,
                tag,
                msg: "no control ring with this rank".into(),
            }),
            Some(_) if bytes.len() > ring::PAYLOAD => Err(FerryError::Protocol {
                peer,
                tag,
                msg: format!(
                    "a control message of {} bytes (a ring slot holds {})",
                    bytes.len(),
                    ring::PAYLOAD
                ),
            }),
            Some((_, o)) => {
                let pc = self.counters.path(path_of(c));
                pc.bytes_sent.fetch_add(bytes.len() as u64, Relaxed);
                pc.sends.fetch_add(1, Relaxed);
                let mut o = o.lock().unwrap_or_else(|p| p.into_inner());
                if o.overflow.is_empty() && o.peer.ring.push(c, tag, bytes) {
                    Ok(())
                } else {
                    // Behind the older ones; the poller pushes them as the peer makes room, and
                    // `done` runs then.
                    o.overflow.push_back((c, tag, SmallVec::from_slice(bytes), done()));
                    self.queued.fetch_add(1, Relaxed);
                    drop(o);
                    self.wake_if_parked();
                    return None;
                }
            }
        };
        Some((done, r))
    }

    /// Receives the message from `peer` on `channel` with `tag` into `buf` (whose length is the
    /// message's); `done` runs on the polling thread once it has come.
    pub fn want(&self, peer: Rank, channel: Lane, tag: i32, buf: Arc<Small>, done: Done) {
        self.want_on(peer, channel_number(channel), tag, buf, done)
    }

    /// Receives the tile of transfer `tag` from `peer` ([`Mailbox::send_tile_here`]) into
    /// `landing`, whose length is the tile's; `done` runs on the polling thread once it has
    /// come (a length other than the landing's fails it with [`FerryError::SizeMismatch`]).
    pub fn want_tile(&self, peer: Rank, tag: i32, landing: Arc<dyn MemRegion>, done: Done) {
        self.want_on(peer, TILE_CHANNEL, tag, landing, done)
    }

    fn want_on(&self, peer: Rank, c: u8, tag: i32, buf: Arc<dyn MemRegion>, done: Done) {
        let key = (peer, c, tag);
        let wake = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let early = s.early.pop(&key);
            match early {
                Some(m) => {
                    let r = self.deliver(&m, peer, &*buf);
                    s.due.push((done, r));
                }
                None => {
                    s.wanted.push(key, Want { buf, done });
                    s.waiting += 1;
                }
            }
            std::mem::take(&mut s.parked)
        };
        if wake {
            self.wake();
        }
    }

    /// Reads every ring, matches what came, pushes what waited for room, and runs the callbacks
    /// due. Called by one thread (the MPI thread), in every pass.
    pub fn poll(&self) -> Polled {
        let mut worked = false;
        let mut due = Vec::new();
        {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let s = &mut *s;
            for (peer, c) in s.consumers.iter_mut() {
                while let Some(m) = c.pop() {
                    worked = true;
                    let pc = self.counters.path(path_of(m.channel));
                    pc.bytes_recv.fetch_add(m.bytes().len() as u64, Relaxed);
                    pc.recvs.fetch_add(1, Relaxed);
                    let key = (*peer, m.channel, m.tag);
                    let want = s.wanted.pop(&key);
                    match want {
                        Some(w) => {
                            s.waiting -= 1;
                            let r = self.deliver(&m, *peer, &*w.buf);
                            due.push((w.done, r));
                        }
                        None => s.early.push(key, m),
                    }
                }
            }
            due.append(&mut s.due);
            if self.queued.load(Relaxed) > 0 {
                for (_, o) in &self.out {
                    let pushed = o.lock().unwrap_or_else(|p| p.into_inner()).flush(&mut due);
                    self.queued.fetch_sub(pushed, Relaxed);
                }
            }
            let expecting = s.waiting > 0 || self.queued.load(Relaxed) > 0;
            s.parked = !expecting;
            worked |= !due.is_empty();
            if due.is_empty() {
                return Polled { worked, expecting };
            }
        }
        for (done, r) in due {
            done(r);
        }
        Polled {
            worked,
            expecting: true,
        }
    }

    /// Receives and messages waiting, for the watchdog's report.
    pub fn report(&self) -> String {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let early = s.early.len();
        format!(
            "  control ring ({:?}): {} receives waiting for their message, {} messages for their receive\n",
            self.peers(),
            s.waiting,
            early
        )
    }

    /// Copies `m` into `buf`; a length other than the buffer's is a protocol error (a control
    /// message), or a size mismatch (a tile: the ranks disagree about the graph, as a tile over
    /// MPI of the wrong size says).
    fn deliver(&self, m: &Message, peer: Rank, buf: &dyn MemRegion) -> Result<()> {
        let b = m.bytes();
        if b.len() != buf.len() && m.channel == TILE_CHANNEL {
            return Err(FerryError::SizeMismatch {
                peer,
                tag: m.tag,
                got: b.len(),
                expected: buf.len(),
            });
        }
        if b.len() != buf.len() {
            return Err(FerryError::Protocol {
                peer,
                tag: m.tag,
                msg: format!(
                    "a control message of {} bytes where {} were expected",
                    b.len(),
                    buf.len()
                ),
            });
        }
        // SAFETY: the buffer belongs to a receive not yet completed: nobody reads it until its
        // callback runs, after this copy.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), buf.ptr(), b.len()) };
        Ok(())
    }

    /// Wakes the polling thread if its last poll expected nothing (it may be blocked).
    fn wake_if_parked(&self) {
        let wake = std::mem::take(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()).parked);
        if wake {
            self.wake();
        }
    }

    /// Whether messages wait for room in a ring.
    pub fn sending(&self) -> bool {
        self.queued.load(Relaxed) > 0
    }

    /// The polling thread is ending: receives still wanted and messages still waiting for room
    /// fail, and the callbacks due run, so that nothing they hold (the transfer layer, buffers)
    /// outlives the run.
    pub fn close(&self) {
        let shut = || FerryError::Poisoned("runtime shut down".into());
        let mut due = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.early = FifoMap::default();
            s.waiting = 0;
            let mut due = std::mem::take(&mut s.due);
            due.extend(s.wanted.drain().map(|w| (w.done, Err(shut()))));
            due
        };
        for (_, o) in &self.out {
            let mut o = o.lock().unwrap_or_else(|p| p.into_inner());
            let drained = o.overflow.len();
            due.extend(o.overflow.drain(..).map(|(.., done)| (done, Err(shut()))));
            self.queued.fetch_sub(drained, Relaxed);
        }
        for (done, r) in due {
            done(r);
        }
    }

    /// Queues `done` for the next poll, waking the polling thread if it may be blocked.
    fn later(&self, done: Done, r: Result<()>) {
        let wake = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.due.push((done, r));
            std::mem::take(&mut s.parked)
        };
        if wake {
            self.wake();
        }
    }

    fn wake(&self) {
        if let Some(w) = self.waker.get() {
            w();
        }
    }
}

/// The reading end of a mailbox as the MPI thread polls it.
pub struct Reader(pub Arc<Mailbox>);

impl ferry_base::poller::Poller for Reader {
    fn poll(&mut self) -> Polled {
        self.0.poll()
    }
    fn sending(&self) -> bool {
        self.0.sending()
    }
    fn close(&mut self) {
        self.0.close()
    }
}

/// Maps the rings that the node's other ranks published and agrees with each on whether to use
/// them: a pair uses its rings only when both ranks mapped the other's (a failure on one side
/// leaves both on MPI). `inbound`: this rank's rings, `None` without devices or with the ring
/// off. Collective: every rank calls it, with or without rings of its own.
///
/// # Errors
/// The agreement's allgather failed (MPI error).
pub fn connect(
    inbound: Option<Inbound>,
    routes: &super::route::Routes,
    me: Rank,
    size: usize,
    engine: &ferry_engine::EngineHandle,
    counters: &Arc<MemoryCounters>,
) -> Result<Option<Mailbox>> {
    let mut opened = Vec::new();
    if let Some(ib) = &inbound {
        let host = &routes.caps(me).host;
        for peer in (0..size as Rank).filter(|&p| p != me) {
            let c = routes.caps(peer);
            let Some(mc) = c.mailbox.filter(|_| c.host == *host) else {
                continue;
            };
            match open_peer(ib, &mc) {
                Ok(o) => opened.push((peer, mc.local_rank, o)),
                Err(e) => tracing::warn!(
                    rank = me,
                    peer,
                    error = %e,
                    "control ring: cannot map the peer's rings; control messages with it go over MPI"
                ),
            }
        }
    }
    let list: Vec<u8> = opened.iter().flat_map(|(p, _, _)| p.to_le_bytes()).collect();
    let all = engine.allgather(&list)?;
    let mapped_me = |peer: Rank| {
        all.get(peer as usize)
            .is_some_and(|b| b.chunks_exact(4).any(|c| c == me.to_le_bytes()))
    };
    let served: Vec<_> = opened.into_iter().filter(|(p, _, _)| mapped_me(*p)).collect();
    if served.is_empty() {
        return Ok(None);
    }
    Ok(inbound.map(|ib| Mailbox::new(ib, served, counters.clone())))
}

#[cfg(test)]
mod tests;
