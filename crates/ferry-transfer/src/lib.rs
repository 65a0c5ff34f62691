//! Moving one tile version from the rank that holds it to the rank that needs it, over the
//! payload path the pair uses:
//!
//! | route | sender | receiver |
//! |---|---|---|
//! | host | stage the tile out to host memory, send it whole | receive into host memory |
//! | staged | host data: chunks straight from the host buffer; device data: per chunk, device→host into a bounce buffer on a comm stream, then send (chunk k+1's copy overlaps chunk k's send) | chunks into the host buffer; for a device consumer, one host→device copy into a block reserved once they have all landed, or, past [`staged_recv::WINDOW`] chunks, each chunk through one of a few buffers of its own and uploaded into a block reserved when the first lands |
//! | gpu-direct | a descriptor, then the device block itself (pinned until the send completes) | on the descriptor, reserve a device block and receive straight into it |
//! | ipc | a 48-byte descriptor of where the block lies in its pool (pinned until acknowledged) | a copy from the producer's pool, mapped once at start-up, into the reserved block; then an acknowledgement |
//!
//! Both sides pick the route from what every rank published at start-up ([`route::Caps`]), so
//! the messages of a transfer always match: same tag, same count, same order.
//!
//! comm-in — the receiver reserving device memory for a tile that a GPU task will consume, so the
//! data lands where it is used — happens only once the data is on its way: when the descriptor
//! arrives (gpu-direct and IPC: the producer sends it when the tile is ready), or when the last
//! chunk has landed (staged; the first chunk, for a tile of many). A reservation made at
//! insertion would hold device memory for data that its producer cannot make without device
//! memory of its own: two ranks whose pools fill with each other's pending receives deadlock (the
//! oracle under memory pressure found exactly that).
//! A reservation that cannot be made at once (nothing evictable) falls back to host memory, so a
//! receive never waits for memory either (it could hold up its sender's window; `ferry-comm/src/window.rs`).
//!
//! This layer knows copies, devices and peers; it uses the GPU manager for device work and the
//! MPI thread for messages, and calls `done` once the transfer is over on this side. The
//! protocol's small messages (descriptors, acknowledgements) go through shared-memory rings
//! instead of MPI between ranks of one node ([`mailbox`], `FERRY_CONTROL_RING`).

#![warn(missing_docs)]

pub mod ack;
pub mod bounce;
pub mod mailbox;
pub mod packed;
mod recv;
mod region;
pub mod route;
mod self_check;
mod send;
mod staged_recv;
pub mod wire;

pub use ack::DeviceAcks;
pub use route::{GpuDirect, TransferPath};

use bounce::BouncePool;
use ferry_base::error::{FerryError, Rank};
use ferry_base::traffic::TrafficPath;
use ferry_device::{Stream, COMM_STREAMS};
use ferry_engine::{EngineHandle, Lane, MemRegion, Message};
use ferry_memory::counters::MemoryCounters;
use ferry_memory::data::copy::TileCopy;
use ferry_memory::manager::{Ahead, DeviceAck, GpuCmd, GpuHandle, Placed};
use route::Routes;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// Bytes of an IPC acknowledgement (no content: its arrival is the message).
const ACK_BYTES: usize = 8;

/// Called once a transfer is over on this side.
pub use ferry_base::join::Done;
use ferry_base::join::Join;

/// The `transfer` span of a tile through the control ring (`kind`: send or recv), with the
/// fields of the MPI loop's: the completion runs inside it.
fn ring_span(kind: &'static str, peer: Rank, tag: i32, bytes: usize) -> tracing::Span {
    tracing::info_span!("transfer", kind, path = TrafficPath::HostRing.name(), peer, tag, bytes)
}

/// Reports a failure that no transfer's `done` can carry any more (an acknowledgement sent
/// after its transfer was already reported complete): it fails the run.
pub type LateError = Arc<dyn Fn(FerryError) + Send + Sync>;

/// Remote pools mapped for IPC: `(peer rank, peer device)` → the id to copy from, per local
/// device (looked up for every IPC pull: a hash without SipHash's cost).
pub type IpcMap = rustc_hash::FxHashMap<(Rank, usize), Vec<usize>>;

/// The transfer layer of one rank.
pub struct Transport {
    engine: EngineHandle,
    gpu: Option<GpuHandle>,
    /// Brings copies to host memory from a device or the disk (shared with the CPU side).
    pub residency: ferry_memory::tier::Residency,
    /// The route to every peer.
    pub routes: Routes,
    bounce: Option<Arc<BouncePool>>,
    chunk: usize,
    eager_bytes: usize,
    ipc: IpcMap,
    /// Per local device, the address of its pool's offset 0.
    bases: Vec<u64>,
    counters: Arc<MemoryCounters>,
    next_stream: AtomicUsize,
    late_error: LateError,
    /// The control rings with the peers of this node that serve them (`FERRY_CONTROL_RING`).
    mailbox: Option<Arc<mailbox::Mailbox>>,
    /// Acknowledgement words for IPC sends acknowledged on the device (`FERRY_DEVICE_ACK`;
    /// `None`: off, or no devices).
    acks: Option<ack::AckWords>,
}

impl Transport {
    /// The transfer layer of one rank: its communication engine, GPU manager, host residency, routes,
    /// bounce pool, chunk and eager sizes, IPC mappings and control ring, as start-up set them up.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine: EngineHandle,
        gpu: Option<GpuHandle>,
        routes: Routes,
        bounce: Option<Arc<BouncePool>>,
        chunk: usize,
        eager_bytes: usize,
        ipc: IpcMap,
        bases: Vec<u64>,
        counters: Arc<MemoryCounters>,
        host_tier: Option<Arc<ferry_memory::tier::HostTier>>,
        late_error: LateError,
        mailbox: Option<Arc<mailbox::Mailbox>>,
        acks: Option<ack::AckWords>,
    ) -> Transport {
        Transport {
            engine,
            residency: ferry_memory::tier::Residency {
                gpu: gpu.clone(),
                host: host_tier,
            },
            gpu,
            routes,
            bounce,
            chunk,
            eager_bytes,
            ipc,
            bases,
            counters,
            next_stream: AtomicUsize::new(0),
            late_error,
            mailbox,
            acks,
        }
    }

    /// The bounce pool, when this rank has devices.
    pub fn bounce(&self) -> Option<&Arc<BouncePool>> {
        self.bounce.as_ref()
    }

    /// Sends the current data of `copy` to `peer` (a send node of the graph). Returns the
    /// device acknowledgement the consumer will write when it pulls the block over IPC (the
    /// tasks that overwrite the block may then be launched at once, waiting for it on the
    /// device: `ack.rs`), asked for only when `want_ack`; `None` for every other send.
    pub fn send(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        want_ack: bool,
        done: Done,
    ) -> Option<DeviceAck> {
        if self.residency.tier().is_none() {
            return self.send_routed(copy, peer, tag, want_ack, done);
        }
        // With a host budget: the host copy stays put while the send may read it, and data that
        // only the disk holds comes back first.
        let (done, on_disk) = self.hold_host(std::slice::from_ref(&copy), done);
        if !on_disk {
            return self.send_routed(copy, peer, tag, want_ack, done);
        }
        let t = self.clone();
        let c = copy.clone();
        self.residency.to_host(
            vec![copy],
            Box::new(move |r| match r {
                // Too late for an early release: the send's successors wait for its end.
                Ok(()) => drop(t.send_routed(c, peer, tag, false, done)),
                Err(e) => done(Err(e)),
            }),
        );
        None
    }

    /// Pins the host memory of `copies` until `done` runs (returned wrapped); also says whether
    /// some copy's data is only on disk.
    pub(crate) fn hold_host(&self, copies: &[Arc<TileCopy>], done: Done) -> (Done, bool) {
        let mut on_disk = false;
        for c in copies {
            let mut s = c.lock();
            s.host_pins += 1;
            on_disk |= ferry_memory::tier::disk_only(&s);
        }
        let held = copies.to_vec();
        let done: Done = Box::new(move |r| {
            for c in &held {
                c.lock().host_pins -= 1;
            }
            done(r)
        });
        (done, on_disk)
    }

    fn send_routed(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        want_ack: bool,
        done: Done,
    ) -> Option<DeviceAck> {
        match self.routes.get(peer) {
            route::Route::Host => self.send_host(copy, peer, tag, done),
            route::Route::Staged => self.send_staged(copy, peer, tag, done),
            route::Route::GpuDirect => self.send_direct(copy, peer, tag, done),
            route::Route::Ipc => return self.send_ipc(copy, peer, tag, want_ack, done),
        }
        None
    }

    /// Receives a tile from `peer` into the fresh copy `copy` (a receive node of the graph);
    /// `to_device`: the consuming task runs on a device, so comm-in places the data there.
    /// `ahead`: the consumers to launch behind the comm-in copy, when the data comes by a copy
    /// the GPU manager enqueues into a reserved block (IPC pull, staged host→device leg);
    /// otherwise they wait for `done` like every other successor.
    pub fn recv(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        to_device: bool,
        ahead: Option<Ahead>,
        done: Done,
    ) {
        let to_device = to_device && self.gpu.is_some();
        // With a host budget: data landing in host memory must not be evicted half-written.
        let done = if self.residency.tier().is_some() {
            self.hold_host(std::slice::from_ref(&copy), done).0
        } else {
            done
        };
        match self.routes.get(peer) {
            route::Route::Host => self.recv_host(&copy, peer, tag, done),
            route::Route::Staged => self.recv_staged(copy, peer, tag, to_device, ahead, done),
            route::Route::GpuDirect | route::Route::Ipc => self.recv_announced(copy, peer, tag, to_device, ahead, done),
        }
    }

    /// Whether IPC sends may ask for device acknowledgements (`FERRY_DEVICE_ACK`, devices here).
    pub fn device_acks(&self) -> bool {
        self.acks.is_some()
    }

    /// Whether a send to `peer` could ask for a device acknowledgement: they are on
    /// (`FERRY_DEVICE_ACK`) and its route is IPC.
    pub fn ackable(&self, peer: Rank) -> bool {
        self.acks.is_some() && self.routes.get(peer) == route::Route::Ipc
    }

    /// The fewest acknowledgements a GPU task must be able to wait for to be released by them
    /// (`FERRY_DEVICE_ACK`: 2 under `auto`, 1 under `on`; 0 when they are off, where nothing
    /// asks).
    pub fn ack_min_waits(&self) -> usize {
        self.acks.as_ref().map_or(0, |a| a.min_waits())
    }

    /// Whether sends of GPU tasks' outputs may be offered at their launch on this rank at all
    /// ([`Transport::send_offered`]): some peer could use the IPC route and drives other GPUs
    /// than this rank, and no host budget is in force (whose pins and loads a send arranges
    /// before it starts).
    pub fn offers_possible(&self) -> bool {
        self.gpu.is_some() && self.residency.tier().is_none() && self.routes.any_offer_capable()
    }

    /// Whether a send to `peer` may be offered at its producer's launch now: its route is IPC
    /// and it shares no GPU with this rank ([`route::Routes::offer_capable`]).
    pub fn offerable(&self, peer: Rank) -> bool {
        self.routes.get(peer) == route::Route::Ipc && self.routes.offer_capable(peer)
    }

    /// Pins a device block holding the current data of `copy`, here and now (`None`: only the
    /// host holds it). Pins live in the copy's state under its lock, where eviction checks them,
    /// so this needs no round trip through the GPU manager; the unpin goes through the manager,
    /// which may have tasks waiting for the memory.
    fn pin_valid(&self, copy: &Arc<TileCopy>) -> Option<Placed> {
        let mut s = copy.lock();
        let d = (0..s.dev.len()).find(|&d| s.dev[d].valid)?;
        self.pin_on(&mut s, d)
    }

    /// Pins the block of `copy` on device `d`, whatever it holds yet (`None`: no block there);
    /// as [`Transport::pin_valid`], without a round trip through the GPU manager.
    fn pin_block(&self, copy: &Arc<TileCopy>, d: usize) -> Option<Placed> {
        self.pin_on(&mut copy.lock(), d)
    }

    /// Pins the block on device `d` of the copy whose state `s` is (locked by the caller).
    fn pin_on(&self, s: &mut ferry_memory::data::copy::CopyState, d: usize) -> Option<Placed> {
        let slot = s.dev.get_mut(d)?;
        let block = slot.block?;
        slot.pins += 1;
        Some(Placed {
            dev: d,
            offset: block.offset,
            addr: self.bases[d] + block.offset,
        })
    }

    /// Host path for a tile of `len` bytes: eager up to the threshold, else rendezvous.
    fn host_path(&self, len: usize) -> (TrafficPath, bool) {
        if len <= self.eager_bytes {
            (TrafficPath::HostEager, true)
        } else {
            (TrafficPath::HostRendezvous, false)
        }
    }

    /// The chunks of a staged send of `len` bytes: `(offset, length)`, at least one.
    fn chunks(&self, len: usize) -> Vec<(usize, usize)> {
        chunks(len, self.chunk)
    }

    /// The chunk size of staged transfers from `peer`: the sender's (published at start-up), so
    /// ranks configured with different `FERRY_BOUNCE_CHUNK` agree on the chunks of a tile.
    fn chunk_from(&self, peer: Rank) -> usize {
        let c = self.routes.caps(peer).chunk as usize;
        if c > 0 {
            c
        } else {
            self.chunk
        }
    }

    /// A comm stream for the next transfer (all copies of one transfer use the same one, so they
    /// complete in order).
    fn comm_stream(&self) -> Stream {
        Stream::Comm(self.next_stream.fetch_add(1, Relaxed) % COMM_STREAMS)
    }

    #[allow(clippy::too_many_arguments)]
    fn message(
        &self,
        send: bool,
        region: Arc<dyn MemRegion>,
        peer: Rank,
        tag: i32,
        channel: Lane,
        path: TrafficPath,
        counts: bool,
        eager: bool,
        done: Done,
    ) {
        let m = Message {
            region,
            peer,
            tag,
            lane: channel,
            path,
            counts,
            eager,
            done,
        };
        // A send goes out at once (`EngineHandle::send_message`): under shared progress, the
        // worker that finished its data would otherwise post it only after the next task it runs.
        let posted = if send {
            self.engine.send_message(m)
        } else {
            self.engine.recv_message(m)
        };
        if let Err(e) = posted {
            // The message (and its callback) is gone; peers and tags come from the graph, so
            // only a finalized engine refuses one, and the run is over anyway.
            tracing::error!(error = %e, "transfer: the engine refused a message");
        }
    }

    /// Posts a GPU command. It fails only when the manager has ended, which happens only at
    /// shutdown or after a fatal error, when the run is failing anyway: logged.
    fn gpu(&self, cmd: GpuCmd) {
        let posted = self.gpu.as_ref().map(|g| g.post(cmd));
        if !matches!(posted, Some(Ok(()))) {
            tracing::error!("transfer: no GPU manager to take a device command");
        }
    }

    /// Posts the chunk messages of a staged transfer straight from (into) host memory, the
    /// region of each chunk `(offset, length)` given by `region`, each arriving at `join`.
    #[allow(clippy::too_many_arguments)]
    fn staged_chunks(
        &self,
        send: bool,
        region: impl Fn(usize, usize) -> Arc<dyn MemRegion>,
        chunks: Vec<(usize, usize)>,
        peer: Rank,
        tag: i32,
        eager: bool,
        join: &Arc<Join>,
    ) {
        for (off, len) in chunks {
            let j = join.clone();
            self.chunk_message(send, region(off, len), peer, tag, eager, Box::new(move |r| j.arrive(r)));
        }
    }

    /// One chunk of a staged transfer: a data message of `tag`, whose bytes count on
    /// [`TrafficPath::Staged`] (the tile itself is counted once it is over); `eager` as for the whole
    /// tile, so that no chunk overtakes another.
    fn chunk_message(&self, send: bool, region: Arc<dyn MemRegion>, peer: Rank, tag: i32, eager: bool, done: Done) {
        self.message(
            send,
            region,
            peer,
            tag,
            Lane::Data,
            TrafficPath::Staged,
            false,
            eager,
            done,
        );
    }

    /// The control ring to `peer`, when this rank's mailbox serves it.
    fn ring_to(&self, peer: Rank) -> Option<&Arc<mailbox::Mailbox>> {
        self.mailbox.as_ref().filter(|m| m.serves(peer))
    }

    /// The control ring that a host-route tile of `len` bytes to or from `peer` takes: one that
    /// serves the peer, when the tile fits one slot ([`mailbox::TILE_MAX`]) and is eager on
    /// both sides (`FERRY_EAGER_BYTES`, this rank's and the peer's). Both sides decide alike:
    /// the pair's mailbox is agreed at start-up, and both know the tile's length and both
    /// eager limits.
    fn tile_ring(&self, peer: Rank, len: usize) -> Option<&Arc<mailbox::Mailbox>> {
        let eager = self.routes.caps(peer).eager_bytes.min(self.eager_bytes as u64);
        (len <= mailbox::TILE_MAX && len as u64 <= eager)
            .then(|| self.ring_to(peer))
            .flatten()
    }

    /// A protocol message (descriptor or acknowledgement): small, posted at once; through the
    /// control ring with a peer it serves (counted on [`TrafficPath::ControlRing`]), else over MPI
    /// (counted on [`TrafficPath::Control`]).
    fn control(&self, send: bool, buf: Arc<region::Small>, peer: Rank, tag: i32, channel: Lane, done: Done) {
        if let Some(m) = self.ring_to(peer) {
            return if send {
                m.send(peer, channel, tag, &buf, done)
            } else {
                m.want(peer, channel, tag, buf, done)
            };
        }
        self.message(send, buf, peer, tag, channel, TrafficPath::Control, true, true, done);
    }

    /// Sends `bytes` as [`Transport::control`] does, except that a message that goes straight
    /// into the control ring gives `done` back unrun (see [`mailbox::Mailbox::send_here`]): the
    /// caller runs or drops it where it is, without a hand-off to the polling thread. `None`:
    /// `done` was handed on and runs there.
    fn control_here(&self, bytes: &[u8], peer: Rank, tag: i32, channel: Lane, done: Done) -> Option<Done> {
        match self.ring_to(peer) {
            Some(m) => m.send_here(peer, channel, tag, bytes, done),
            None => {
                self.control(true, region::Small::new(bytes), peer, tag, channel, done);
                None
            }
        }
    }

    /// The IPC acknowledgement of transfer `tag` to `peer` (its producer unpins the block on it):
    /// an empty message on the ack channel that nobody here waits for. A failure to send it
    /// fails the run through `late_error`.
    fn ack(&self, peer: Rank, tag: i32) {
        let done = || -> Done {
            let fail = self.late_error.clone();
            Box::new(move |r| {
                if let Err(e) = r {
                    fail(e)
                }
            })
        };
        match self.ring_to(peer) {
            // Made only if the acknowledgement must wait for room in the ring.
            Some(m) => m.send_unwatched(peer, Lane::Control, tag, &[0; ACK_BYTES], done),
            None => self.control(
                true,
                region::Small::new(&[0; ACK_BYTES]),
                peer,
                tag,
                Lane::Control,
                done(),
            ),
        }
    }

    /// Counts `tiles` tile transfers and `bytes` bytes on `path` for what the messages did not
    /// count themselves: staged tiles (their chunks counted the bytes), IPC tiles (no payload
    /// message), packed tiles (their carrier counts on [`TrafficPath::Packed`]).
    fn count(&self, path: TrafficPath, bytes: usize, tiles: usize, sent: bool) {
        let c = self.counters.path(path);
        let (b, n) = if sent {
            (&c.bytes_sent, &c.sends)
        } else {
            (&c.bytes_recv, &c.recvs)
        };
        b.fetch_add(bytes as u64, Relaxed);
        n.fetch_add(tiles as u64, Relaxed);
    }
}

/// `(offset, length)` of the chunks of `len` bytes in pieces of `chunk`: at least one.
pub fn chunks(len: usize, chunk: usize) -> Vec<(usize, usize)> {
    if len == 0 {
        return vec![(0, 0)];
    }
    (0..len.div_ceil(chunk))
        .map(|k| (k * chunk, chunk.min(len - k * chunk)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_tile() {
        assert_eq!(chunks(10, 4), vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(8, 4), vec![(0, 4), (4, 4)]);
        assert_eq!(chunks(3, 4), vec![(0, 3)]);
        assert_eq!(chunks(0, 4), vec![(0, 0)]);
    }
}
