//! Payloads of one-sided operations, over the route their pair of regions takes.
//!
//! | local and remote regions | route | messages |
//! |---|---|---|
//! | both host memory | host MPI | one |
//! | device memory on either side, MPI takes device pointers on both ranks | GPU-direct | one, from or into device memory |
//! | device memory on either side, otherwise | staged | one per chunk of [`crate::EngineConfig::bounce_chunk`] bytes |
//!
//! A staged payload moves in chunks, all under the operation's tag (MPI keeps their order). On
//! the side whose region is device memory each chunk goes through a pinned bounce buffer:
//! sending, device→host copy into the buffer and then the send from it (chunk k+1's copy overlaps
//! chunk k's send); receiving, the receive into the buffer and then the host→device copy. The side
//! whose region is host memory sends or receives its chunks in place. Both sides count the same
//! chunks: the origin decides the route and tells the target in its request.
//!
//! Bounce buffers come from two fixed pools per rank, one for sends and one for receives: a send's
//! buffer comes back when its receiver has taken the chunk, a receive's when its copy to the device
//! has completed, which needs nothing from any peer; so buffers always come back and no two ranks
//! can wait on each other's. The extra host memory of staged transfers is exactly the pools.
//!
//! Device copies are polled by the progress loop ([`EnginePoller`]), in the order they were issued.

use crate::delivery::Delivery;
use crate::engine::{InFlight, Shared};
use crate::error::{EngineError, Result};
use crate::stream::StreamWords;
use ferry_base::error::{FerryError, Rank};
use ferry_base::join::{Done, Join};
use ferry_base::poller::{Polled, Poller};
use ferry_base::region::{Bytes, MemRegion};
use ferry_base::traffic::TrafficPath;
use ferry_device::copier::{Copier, CopyDir, Free, Ticket};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Called with a bounce buffer once one is free.
type Waiter = Box<dyn FnOnce(Slot) + Send>;
/// Called once a device copy has completed (or failed).
pub(crate) type CopyDone = Box<dyn FnOnce(std::result::Result<(), ferry_base::error::DeviceError>) + Send>;

/// A peer's allocation mapped for a copy: the device and the export (inline: a copy allocates
/// nothing for it).
type Mapped = (usize, [u8; ferry_device::copier::EXPORT_BYTES]);

/// Which pool a buffer belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pool {
    Send = 0,
    Recv = 1,
}

struct SlotPool {
    /// Address of buffer 0; 0 until pinned ([`Staging::pin_pool`]).
    base: usize,
    slots: usize,
    free: Vec<usize>,
    waiters: VecDeque<Waiter>,
}

/// A bounce buffer held by one chunk.
pub(crate) struct Slot {
    pool: Pool,
    index: usize,
    ptr: usize,
}

/// The device side of staged transfers: the copier, the two bounce pools, the copies in flight.
pub(crate) struct Staging {
    copier: Box<dyn Copier>,
    chunk: usize,
    pools: [SlotPool; 2],
    /// With, for a peer copy, the mapping it uses (closed once the copy has completed).
    copies: VecDeque<(Ticket, Option<Mapped>, CopyDone)>,
    /// The words callers' streams wait on (`stream.rs`).
    words: StreamWords,
    /// Frees the pools' memory.
    free: Vec<Free>,
    /// Set once a copy or a stream word has been issued: until then the poller has nothing
    /// here to look at and skips the lock (an engine whose devices serve only registrations
    /// and peer mappings, as ferry's task runtime's, never issues one).
    used: Arc<AtomicBool>,
}

// SAFETY: the pools' memory is owned by the staging state and handed to one chunk at a time.
unsafe impl Send for Staging {}

impl Drop for Staging {
    fn drop(&mut self) {
        let freeable = self.words.release_all(self.copier.as_mut());
        for f in std::mem::take(&mut self.words).into_frees(freeable) {
            f();
        }
        for f in self.free.drain(..) {
            f();
        }
    }
}

impl Staging {
    /// The copier and `slots` bounce buffers of `chunk` bytes per direction, each direction's
    /// pinned when it is first used: an engine that never stages (its devices' memory only
    /// registered and mapped by peers, or every peer GPU-direct) pins nothing.
    pub(crate) fn new(copier: Box<dyn Copier>, chunk: usize, slots: usize) -> Result<Staging> {
        let slots = slots.max(1);
        let pool = || SlotPool {
            base: 0,
            slots,
            free: (0..slots).rev().collect(),
            waiters: VecDeque::new(),
        };
        Ok(Staging {
            copier,
            chunk,
            pools: [pool(), pool()],
            copies: VecDeque::new(),
            words: StreamWords::default(),
            free: Vec::new(),
            used: Arc::default(),
        })
    }

    /// Pins pool `pool`'s buffers if they are not yet.
    fn pin_pool(&mut self, pool: Pool) -> Result<()> {
        let p = &self.pools[pool as usize];
        if p.base != 0 {
            return Ok(());
        }
        let bytes = self.chunk * p.slots;
        let (base, f) = self.copier.alloc_pinned(bytes).map_err(EngineError::Device)?;
        self.free.push(f);
        self.pools[pool as usize].base = base as usize;
        Ok(())
    }

    /// The flag the poller reads to skip an unused staging state.
    pub(crate) fn used(&self) -> Arc<AtomicBool> {
        self.used.clone()
    }

    pub(crate) fn copier(&self) -> &dyn Copier {
        self.copier.as_ref()
    }

    pub(crate) fn copier_mut(&mut self) -> &mut dyn Copier {
        self.copier.as_mut()
    }

    /// A word that `stream` (of `device`) now waits on until [`crate::stream::signal`] (the
    /// wait enqueued; the word taken back once the stream has passed it).
    pub(crate) fn stream_word(&mut self, device: usize, stream: u64) -> Result<usize> {
        self.used.store(true, Ordering::Relaxed);
        let w = self.words.take(self.copier.as_mut())?;
        // SAFETY: the caller vouches for the stream (`get_on_stream`); the word stays
        // allocated until its ticket completes (`StreamWords::poll`, and the drop above).
        match unsafe { self.copier.stream_wait_word(device, stream, w as *mut u32) } {
            Ok(t) => {
                self.words.retire(t, w);
                Ok(w)
            }
            Err(e) => {
                // The wait may have been enqueued before the failure (the event after it is
                // what failed): release the stream, and never hand the word out again.
                crate::stream::signal(w);
                Err(FerryError::from(e).into())
            }
        }
    }

    /// Moves the completions of the copies that have completed, in issue order, with their
    /// outcomes, into `ready` (to be run outside the lock).
    fn take_completed(&mut self, ready: &mut Vec<(CopyDone, std::result::Result<(), ferry_base::error::DeviceError>)>) {
        while let Some((t, _, _)) = self.copies.front() {
            let r = match self.copier.done(t) {
                Ok(false) => break,
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            };
            let (_, mapped, done) = self.copies.pop_front().expect("front exists");
            if let Some((device, exported)) = mapped {
                self.copier.close(device, &exported);
            }
            ready.push((done, r));
        }
    }

    /// At finalize: waits up to `wait` for the copies in flight and runs their completions
    /// (a leased copy then gives its pins back and ends with its outcome); returns the
    /// completions of copies still running, which must not run while the device uses the memory.
    pub(crate) fn finish_copies(st: &Mutex<Staging>, wait: std::time::Duration) -> Vec<CopyDone> {
        let t0 = std::time::Instant::now();
        loop {
            let mut ready = Vec::new();
            let left = {
                let mut g = st.lock().unwrap_or_else(|e| e.into_inner());
                g.take_completed(&mut ready);
                if g.copies.is_empty() || t0.elapsed() >= wait {
                    Some(g.copies.drain(..).map(|(_, _, d)| d).collect::<Vec<_>>())
                } else {
                    None
                }
            };
            // Outside the lock: a completion may issue engine work (which fails now).
            for (done, r) in ready {
                done(r);
            }
            if let Some(left) = left {
                return left;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Queues a copy issued on the copier: `done` runs when the poller sees it complete.
    pub(crate) fn push_copy(&mut self, t: Ticket, done: CopyDone) {
        self.used.store(true, Ordering::Relaxed);
        self.copies.push_back((t, None, done));
    }

    /// Issues a peer copy on `device` between `here` (local device memory) and the allocation
    /// a peer exported (`exported`, mapped for it): into the peer's memory when `put`, else
    /// from it; `done` runs when the poller sees it complete, after the mapping is let go of
    /// (it then stays open only while the copier keeps idle ones).
    ///
    /// # Safety
    /// Both ranges are valid device memory for `len` bytes, held (pinned, leased or granted)
    /// until `done` runs.
    ///
    /// # Errors
    /// A mapping the driver refuses, a copy it cannot issue: nothing is held then.
    pub(crate) unsafe fn peer_copy(
        &mut self,
        device: usize,
        exported: &[u8],
        here: u64,
        len: usize,
        put: bool,
    ) -> std::result::Result<Ticket, ferry_base::error::DeviceError> {
        let remote = self.copier.open(device, exported)?;
        let (dst, src) = if put { (remote, here) } else { (here, remote) };
        match self.copier.copy_device(device, dst, src, len) {
            Ok(t) => Ok(t),
            Err(e) => {
                self.copier.close(device, exported);
                Err(e)
            }
        }
    }

    /// Queues a copy of [`Staging::peer_copy`]: `done` runs once it has completed, after its
    /// mapping of `exported` on `device` is let go of.
    pub(crate) fn push_peer_copy(&mut self, t: Ticket, device: usize, exported: &[u8], done: CopyDone) {
        self.used.store(true, Ordering::Relaxed);
        let mut x = [0u8; ferry_device::copier::EXPORT_BYTES];
        // `peer_copy` opened it, so it parsed: it is an export of this length.
        let n = exported.len().min(x.len());
        x[..n].copy_from_slice(&exported[..n]);
        self.copies.push_back((t, Some((device, x)), done));
    }
}

/// Runs in every pass of the progress loop: completes the device copies of staged transfers
/// and peer copies, in the order they were issued, and tells the loop to keep polling (yield,
/// not nap) while one-sided operations are in flight: their answers arrive as active messages,
/// which cannot end a nap, and a nap of up to `progress_sleep_us` would be added to each.
pub(crate) struct EnginePoller {
    pub(crate) shared: std::sync::Weak<Shared>,
    /// What the pass looks at first: an engine whose staging state (if any) has issued
    /// nothing yet, with no callback queued and nothing in flight (ferry's runtime, which sends
    /// messages and maps peers, all the time) costs the loop these loads, not an upgrade of
    /// `shared` per pass.
    pub(crate) delivery: Arc<Delivery>,
    pub(crate) in_flight: Arc<InFlight>,
    /// [`Staging::used`], when there is a staging state.
    pub(crate) staging_used: Option<Arc<AtomicBool>>,
    /// The active-message rings with the node's peers, read in every pass (`am_rings.rs`).
    pub(crate) rings: Option<Arc<crate::am_rings::AmRings>>,
    /// What the rings delivered in this pass (kept to reuse its allocation).
    pub(crate) ready: Vec<crate::am_rings::Arrived>,
}

impl Poller for EnginePoller {
    fn poll(&mut self) -> Polled {
        let rings = self.poll_rings();
        let polled = self.poll_rest();
        Polled {
            worked: polled.worked || rings.worked,
            expecting: polled.expecting || rings.expecting,
        }
    }

    fn sending(&self) -> bool {
        // Messages in a ring's overflow (and the MPI sends behind them): an orderly shutdown
        // keeps the loop polling until they have left.
        self.rings.as_ref().is_some_and(|r| r.waiting())
    }

    fn close(&mut self) {}
}

impl EnginePoller {
    /// Reads the active-message rings and hands what is due to the handlers.
    fn poll_rings(&mut self) -> Polled {
        let Some(r) = &self.rings else {
            return Polled {
                worked: false,
                expecting: false,
            };
        };
        let queued = r.poll(&mut self.ready);
        let worked = !self.ready.is_empty();
        if worked {
            match self.shared.upgrade() {
                Some(s) => {
                    for (source, tag, bytes) in self.ready.drain(..) {
                        s.dispatch_am(source, tag, bytes);
                    }
                }
                None => self.ready.clear(),
            }
        }
        Polled {
            worked,
            expecting: queued,
        }
    }

    /// Completes callbacks and device copies.
    fn poll_rest(&mut self) -> Polled {
        let staging_idle = self.staging_used.as_ref().is_none_or(|u| !u.load(Ordering::Relaxed));
        if staging_idle && self.delivery.is_empty() && !self.in_flight.any() {
            return Polled {
                worked: false,
                expecting: false,
            };
        }
        let Some(s) = self.shared.upgrade() else {
            return Polled {
                worked: false,
                expecting: false,
            };
        };
        // Callbacks of what completed since the last pass (never inside the completion itself).
        let ran = s.delivery.drain_on_progress() > 0;
        let in_flight = s.in_flight.any();
        let Some(st) = &s.staging else {
            return Polled {
                worked: ran,
                expecting: in_flight,
            };
        };
        let mut ready = Vec::new();
        let copying = {
            let mut g = st.lock().unwrap_or_else(|e| e.into_inner());
            let g = &mut *g;
            g.words.poll(g.copier.as_mut());
            g.take_completed(&mut ready);
            !g.copies.is_empty()
        };
        let worked = ran || !ready.is_empty();
        for (done, r) in ready {
            done(r);
        }
        Polled {
            worked,
            expecting: copying || in_flight,
        }
    }
}

/// A part of a region that a chunk's message reads or writes; keeps the whole region (and its
/// registration pin) alive.
struct Span {
    ptr: usize,
    len: usize,
    _whole: Arc<dyn MemRegion>,
}

// SAFETY: as the region it is part of.
unsafe impl Send for Span {}
unsafe impl Sync for Span {}

// SAFETY: a part of a region (itself a `MemRegion`) that `_whole` keeps alive.
unsafe impl MemRegion for Span {
    fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A bounce buffer as the region of one chunk's message.
struct SlotRegion {
    ptr: usize,
    len: usize,
}

// SAFETY: the buffer is held by one chunk until its message completes.
unsafe impl Send for SlotRegion {}
unsafe impl Sync for SlotRegion {}

// SAFETY: a bounce buffer of the staging pools, held by one chunk until the slot is returned.
unsafe impl MemRegion for SlotRegion {
    fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// `(offset, length)` of the chunks of `len` bytes.
pub(crate) fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(len - i * chunk)))
}

impl Shared {
    fn staging(&self) -> Result<&Mutex<Staging>> {
        self.staging
            .as_ref()
            .ok_or_else(|| EngineError::NoDevices("a staged transfer on a rank without devices".into()))
    }

    /// The bytes per chunk of staged payloads.
    pub(crate) fn chunk(&self) -> usize {
        self.bounce_chunk
    }

    /// Makes sure a payload on `device` (`None`: host memory) moved `chunked` can go through the
    /// bounce buffers of `pool`: pins them now if that payload is staged and they are not yet.
    /// For the side of a one-sided protocol that has already told its peer to expect the
    /// payload (a target answering a request, an origin about to send one): a failure here
    /// becomes a refusal the peer hears, where one in the middle of the payload would leave the
    /// peer waiting.
    ///
    /// # Errors
    /// The copier's failure to pin (pinned memory exhausted), as [`EngineError::Device`].
    pub(crate) fn stage_ready(&self, device: Option<usize>, chunked: bool, pool: Pool) -> Result<()> {
        if !(chunked && device.is_some()) {
            return Ok(());
        }
        let st = self.staging()?;
        st.lock().unwrap_or_else(|e| e.into_inner()).pin_pool(pool)
    }

    /// Hands a buffer of `pool` to `then`, now or once one is free.
    fn acquire(&self, pool: Pool, then: Waiter) -> Result<()> {
        let st = self.staging()?;
        let slot = {
            let mut g = st.lock().unwrap_or_else(|e| e.into_inner());
            g.pin_pool(pool)?;
            let chunk = g.chunk;
            let p = &mut g.pools[pool as usize];
            match p.free.pop() {
                Some(index) => Slot {
                    pool,
                    index,
                    ptr: p.base + index * chunk,
                },
                None => {
                    p.waiters.push_back(then);
                    return Ok(());
                }
            }
        };
        then(slot);
        Ok(())
    }

    /// Gives a buffer back: to the oldest waiter, or to its pool.
    fn release(&self, slot: Slot) {
        let Some(st) = &self.staging else { return };
        let waiter = {
            let mut g = st.lock().unwrap_or_else(|e| e.into_inner());
            let p = &mut g.pools[slot.pool as usize];
            match p.waiters.pop_front() {
                Some(w) => w,
                None => {
                    p.free.push(slot.index);
                    return;
                }
            }
        };
        waiter(slot);
    }

    /// Starts a device copy; `then` runs when the poller sees it complete (or at once with the
    /// error when it cannot start).
    fn start_copy(&self, device: usize, dir: CopyDir, dev: usize, host: usize, len: usize, then: CopyDone) {
        let st = match self.staging() {
            Ok(st) => st,
            Err(_) => {
                return then(Err(ferry_base::error::DeviceError::Body(
                    "no devices on this rank".into(),
                )))
            }
        };
        let mut g = st.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: `dev` is registered device memory and `host` a bounce buffer this chunk holds;
        // both stay untouched until the copy's completion runs.
        match unsafe { g.copier.copy(device, dir, dev as u64, host as *mut u8, len) } {
            Ok(t) => g.push_copy(t, then),
            Err(e) => {
                drop(g);
                then(Err(e));
            }
        }
    }

    /// What both directions do without bounce buffers: the payload whole (host memory, or
    /// device memory handed to MPI), or in chunks sent or received in place from host memory.
    /// Hands `done` back when the region is device memory that must be staged.
    #[allow(clippy::too_many_arguments)]
    fn post_unstaged(
        &self,
        recv: bool,
        region: &Arc<dyn MemRegion>,
        device: Option<usize>,
        peer: Rank,
        tag: u32,
        chunked: bool,
        done: Done,
    ) -> Result<Option<Done>> {
        if !chunked {
            let path = if device.is_some() {
                TrafficPath::GpuDirect
            } else {
                crate::engine::payload_path(region.len())
            };
            self.post_payload_on(recv, path, region.clone(), peer, tag, done)?;
            return Ok(None);
        }
        if device.is_some() {
            return Ok(Some(done));
        }
        let parts: Vec<(usize, usize)> = chunks(region.len(), self.chunk()).collect();
        let join = Join::new(parts.len(), done);
        let base = region.ptr() as usize;
        for (off, len) in parts {
            let join = join.clone();
            let span = Arc::new(Span {
                ptr: base + off,
                len,
                _whole: region.clone(),
            });
            self.post_payload_on(
                recv,
                TrafficPath::Staged,
                span,
                peer,
                tag,
                Box::new(move |r| join.arrive(r)),
            )?;
        }
        Ok(None)
    }

    /// Sends the payload `region` (on `device`, or host memory) to `peer` under `tag`, whole or
    /// in chunks (`chunked`); `done` runs once every message has left (with the first error).
    pub(crate) fn send_payload(
        self: &Arc<Self>,
        region: Arc<dyn MemRegion>,
        device: Option<usize>,
        peer: Rank,
        tag: u32,
        chunked: bool,
        done: Done,
    ) -> Result<()> {
        let (Some(d), Some(done)) = (
            device,
            self.post_unstaged(false, &region, device, peer, tag, chunked, done)?,
        ) else {
            return Ok(());
        };
        let parts: Vec<(usize, usize)> = chunks(region.len(), self.chunk()).collect();
        let join = Join::new(parts.len(), done);
        let base = region.ptr() as usize;
        for (off, len) in parts {
            let join = join.clone();
            let s = self.clone();
            let keep = region.clone();
            self.acquire(
                Pool::Send,
                Box::new(move |slot: Slot| {
                    let host = slot.ptr;
                    let s2 = s.clone();
                    s.start_copy(
                        d,
                        CopyDir::DeviceToHost,
                        base + off,
                        host,
                        len,
                        Box::new(move |r| {
                            drop(keep);
                            // A chunk whose copy failed still goes out, empty, so that the
                            // receiver's count of chunks holds; the error is reported here.
                            let (region, err): (Arc<dyn MemRegion>, _) = match r {
                                Ok(()) => (Arc::new(SlotRegion { ptr: host, len }), None),
                                Err(e) => (Bytes::new(Vec::new()), Some(FerryError::from(e))),
                            };
                            let s3 = s2.clone();
                            let sent = Box::new(move |r: ferry_base::error::Result<()>| {
                                s3.release(slot);
                                join.arrive(match err {
                                    Some(e) => Err(e),
                                    None => r,
                                });
                            });
                            if let Err(e) = s2.post_payload_on(false, TrafficPath::Staged, region, peer, tag, sent) {
                                tracing::error!(peer, tag, "staged chunk not sent: {e}");
                            }
                        }),
                    );
                }),
            )?;
        }
        Ok(())
    }

    /// Receives the payload from `peer` under `tag` into `region` (on `device`, or host memory),
    /// whole or in chunks (`chunked`); `done` runs once every byte is in place (with the first
    /// error).
    pub(crate) fn recv_payload(
        self: &Arc<Self>,
        region: Arc<dyn MemRegion>,
        device: Option<usize>,
        peer: Rank,
        tag: u32,
        chunked: bool,
        done: Done,
    ) -> Result<()> {
        let (Some(d), Some(done)) = (
            device,
            self.post_unstaged(true, &region, device, peer, tag, chunked, done)?,
        ) else {
            return Ok(());
        };
        let parts: Vec<(usize, usize)> = chunks(region.len(), self.chunk()).collect();
        let join = Join::new(parts.len(), done);
        let base = region.ptr() as usize;
        for (off, len) in parts {
            let join = join.clone();
            let s = self.clone();
            let keep = region.clone();
            self.acquire(
                Pool::Recv,
                Box::new(move |slot: Slot| {
                    let host = slot.ptr;
                    let s2 = s.clone();
                    let landed = Box::new(move |r: ferry_base::error::Result<()>| {
                        if let Err(e) = r {
                            s2.release(slot);
                            return join.arrive(Err(e));
                        }
                        let s3 = s2.clone();
                        s2.start_copy(
                            d,
                            CopyDir::HostToDevice,
                            base + off,
                            host,
                            len,
                            Box::new(move |r| {
                                drop(keep);
                                s3.release(slot);
                                join.arrive(r.map_err(FerryError::from));
                            }),
                        );
                    });
                    let region = Arc::new(SlotRegion { ptr: host, len });
                    if let Err(e) = s.post_payload_on(true, TrafficPath::Staged, region, peer, tag, landed) {
                        tracing::error!(peer, tag, "staged chunk receive not posted: {e}");
                    }
                }),
            )?;
        }
        Ok(())
    }

    /// Answers a refused request whose payload would have come in `n` messages: `n` empty ones.
    pub(crate) fn send_empty(&self, peer: Rank, tag: u32, n: usize) -> Result<()> {
        for _ in 0..n {
            self.post_payload_on(
                false,
                TrafficPath::Control,
                Bytes::new(Vec::new()),
                peer,
                tag,
                Box::new(|_| {}),
            )?;
        }
        Ok(())
    }

    /// Takes the `len`-byte payload of a refused put, in its messages, without keeping it:
    /// each is received into an empty buffer (MPI reports the truncation, and the message is
    /// consumed), so a large refused put costs no memory; `done` runs once all have arrived.
    pub(crate) fn discard_payload(
        self: &Arc<Self>,
        peer: Rank,
        tag: u32,
        len: usize,
        chunked: bool,
        done: Done,
    ) -> Result<()> {
        let parts: Vec<(usize, usize)> = if chunked {
            chunks(len, self.chunk()).collect()
        } else {
            vec![(0, len)]
        };
        let join = Join::new(parts.len(), done);
        for (_, n) in parts {
            let join = join.clone();
            let scratch = Bytes::new(vec![0u8; n]);
            self.post_payload_on(
                true,
                TrafficPath::Control,
                scratch,
                peer,
                tag,
                Box::new(move |r| join.arrive(r)),
            )?;
        }
        Ok(())
    }
}
