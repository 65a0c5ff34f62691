//! The sending side of each route.

use super::bounce::Slot;
use super::region::{DeviceRegion, Small};
use super::wire::Desc;
use super::{Done, Join, Transport};
use ferry_base::error::{FerryError, Rank};
use ferry_base::traffic::TrafficPath;
use ferry_device::Mem;
use ferry_engine::{Lane, MemRegion};
use ferry_memory::data::copy::TileCopy;
use ferry_memory::manager::{CopyOp, DeviceAck, GpuCmd, Placed, Signal, SIGNAL_FREE_STREAM};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

impl Transport {
    /// Host route: the whole tile from host memory, staged out first if only a device holds it.
    pub(super) fn send_host(self: &Arc<Self>, copy: Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        let t = self.clone();
        self.when_on_host(vec![copy.clone()], done, move |done| {
            t.send_host_tile(&copy, peer, tag, done)
        });
    }

    /// Host route: a tile of one ring slot to a rank of this node goes through the control
    /// ring ([`Transport::tile_ring`]), and its send is over once the slot is written; any
    /// other, whole over MPI ([`Transport::send_whole_host`]). (The host route only: another
    /// route's receiver waits for a host tile over MPI.)
    fn send_host_tile(&self, copy: &Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        let Some(m) = self.tile_ring(peer, copy.bytes()) else {
            return self.send_whole_host(copy, peer, tag, done);
        };
        let buf = copy.lock().host_buf(copy.bytes());
        // SAFETY: the graph orders every write of the copy after its sends: nothing writes the
        // buffer while this reads it.
        let bytes = unsafe { std::slice::from_raw_parts(buf.ptr() as *const u8, buf.len()) };
        if let Some(done) = m.send_tile_here(peer, tag, bytes, done) {
            let _g = super::ring_span("send", peer, tag, bytes.len()).entered();
            done(Ok(()));
        }
    }

    /// Runs `then` once every copy in `copies` is valid in host memory (staging device-only
    /// ones out, loading disk-only ones back). With a host budget the caller has pinned their
    /// host memory ([`Transport::hold_host`]).
    pub(super) fn when_on_host(
        self: &Arc<Self>,
        copies: Vec<Arc<TileCopy>>,
        done: Done,
        then: impl FnOnce(Done) + Send + 'static,
    ) {
        let stale: Vec<Arc<TileCopy>> = copies.into_iter().filter(|c| !c.lock().host_valid).collect();
        if stale.is_empty() {
            return then(done);
        }
        self.residency.to_host(
            stale,
            Box::new(move |r| match r {
                Ok(()) => then(done),
                Err(e) => done(Err(e)),
            }),
        );
    }

    /// One message of the whole host buffer (host path by size).
    fn send_whole_host(&self, copy: &Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        let buf = copy.lock().host_buf(copy.bytes());
        let (path, eager) = self.host_path(copy.bytes());
        self.message(true, buf, peer, tag, Lane::Data, path, true, eager, done);
    }

    /// Staged route.
    pub(super) fn send_staged(self: &Arc<Self>, copy: Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        if copy.lock().host_valid || self.gpu.is_none() || self.bounce.is_none() {
            return self.staged_from_host(&copy, peer, tag, done);
        }
        match self.pin_valid(&copy) {
            Some(p) => self.staged_from_device(copy, p, peer, tag, done),
            // No device holds it: the host does.
            None => self.staged_from_host(&copy, peer, tag, done),
        }
    }

    /// Chunks straight from the host buffer.
    fn staged_from_host(self: &Arc<Self>, copy: &Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        let len = copy.bytes();
        let buf = copy.lock().host_buf(len);
        let chunks = self.chunks(len);
        let t = self.clone();
        let join = Join::new(
            chunks.len(),
            Box::new(move |r| {
                if r.is_ok() {
                    t.count(TrafficPath::Staged, 0, 1, true);
                }
                done(r)
            }),
        );
        let eager = len <= self.eager_bytes;
        let region = |off, len| -> Arc<dyn MemRegion> {
            Arc::new(super::region::Slice {
                buf: buf.clone(),
                off,
                len,
            })
        };
        self.staged_chunks(true, region, chunks, peer, tag, eager, &join);
    }

    /// Per chunk: a bounce buffer, a device→host copy on [`SIGNAL_FREE_STREAM`], then the send;
    /// the buffer goes back when the send completes. Chunk k+1 asks for its buffer right after
    /// chunk k's copy is enqueued, so copies and sends overlap as far as the pool allows.
    fn staged_from_device(self: &Arc<Self>, copy: Arc<TileCopy>, at: Placed, peer: Rank, tag: i32, done: Done) {
        let len = copy.bytes();
        let chunks = self.chunks(len);
        let t = self.clone();
        let c = copy.clone();
        let join = Join::new(
            chunks.len(),
            Box::new(move |r| {
                t.gpu(GpuCmd::Unpin { copy: c, dev: at.dev });
                if r.is_ok() {
                    t.count(TrafficPath::Staged, 0, 1, true);
                }
                done(r)
            }),
        );
        let step = Arc::new(StagedSend {
            t: self.clone(),
            at,
            peer,
            tag,
            eager: len <= self.eager_bytes,
            chunks,
            join,
            in_order: Mutex::new(InOrder::default()),
            _copy: copy,
        });
        StagedSend::next(step, 0);
    }

    /// GPU-direct route: a descriptor (so the receiver places the destination only once the data
    /// is coming), then the device block itself when a device holds the data.
    pub(super) fn send_direct(self: &Arc<Self>, copy: Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        if copy.lock().host_valid || self.gpu.is_none() {
            return self.send_inline(&copy, peer, tag, done);
        }
        let (t, c) = (self, copy);
        match t.pin_valid(&c) {
            Some(p) => {
                let len = c.bytes();
                let join = Join::new(2, done);
                let j = join.clone();
                let desc = Desc::Inline { len: len as u64 };
                t.descriptor(&desc, peer, tag, Box::new(move |r| j.arrive(r)));
                let region = Arc::new(DeviceRegion { addr: p.addr, len });
                let t2 = t.clone();
                let done: Done = Box::new(move |r| {
                    t2.gpu(GpuCmd::Unpin { copy: c, dev: p.dev });
                    join.arrive(r)
                });
                t.message(
                    true,
                    region,
                    peer,
                    tag,
                    Lane::Data,
                    TrafficPath::GpuDirect,
                    true,
                    len <= t.eager_bytes,
                    done,
                );
            }
            None => t.send_inline(&c, peer, tag, done),
        }
    }

    /// IPC route: a descriptor of the pinned block; the block stays pinned until the consumer
    /// acknowledges its copy. Host-only data follows its descriptor inline. Returns the device
    /// acknowledgement the descriptor asks for, if any ([`Transport::send`]).
    pub(super) fn send_ipc(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        want_ack: bool,
        done: Done,
    ) -> Option<DeviceAck> {
        if self.gpu.is_none() {
            self.send_inline(&copy, peer, tag, done);
            return None;
        }
        match self.pin_valid(&copy) {
            Some(p) => self.offer_block(copy, p, None, peer, tag, want_ack, done),
            None => {
                self.send_inline(&copy, peer, tag, done);
                None
            }
        }
    }

    /// IPC route, offered at the launch of the GPU task that writes `copy` on device
    /// `after.dev`, before its data exists: the descriptor names the block the task is writing
    /// and the signal that passes once it has finished, and the consumer's pull waits on the
    /// device for that signal (`Desc::Pool::after`). The halo of a stencil then moves as soon as
    /// its kernel ends, with no host on the way: neither the producer's completion poll, its
    /// finalization and the graph's release of the send, nor the consumer's reaction to a
    /// descriptor, which now arrives while the kernel still runs. The block stays pinned until
    /// the consumer acknowledges, as for any IPC send.
    ///
    /// Called on the GPU manager's thread, from the launch. `done` gets an error if the task
    /// has no block on that device (the caller offers only tiles its task writes). With
    /// `want_ack`, asks for a device acknowledgement where this rank publishes its signals on
    /// the host (returned, as [`Transport::offer_block`] does).
    pub fn send_offered(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        after: Signal,
        want_ack: bool,
        done: Done,
    ) -> Option<DeviceAck> {
        let Some(p) = self.pin_block(&copy, after.dev) else {
            done(Err(FerryError::Device(ferry_device::DeviceError::Body(format!(
                "a send offered at launch found no block on device {}",
                after.dev
            )))));
            return None;
        };
        let offered = Some((after.slot as u32, after.value));
        self.offer_block(copy, p, offered, peer, tag, want_ack, done)
    }

    /// The descriptor of the pinned block `p` of `copy` (ready, or once signal `after` passes),
    /// and the wait for the consumer's acknowledgement, on which the block is unpinned. With
    /// `want_ack`, device acknowledgements on, no signal `after` (or signals published on the
    /// host, [`AckWords::offered`]) and a word free, the descriptor also asks the consumer to
    /// write that word after its pull (returned; given back with the host acknowledgement).
    #[allow(clippy::too_many_arguments)]
    fn offer_block(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        p: Placed,
        after: Option<(u32, u64)>,
        peer: Rank,
        tag: i32,
        want_ack: bool,
        done: Done,
    ) -> Option<DeviceAck> {
        let len = copy.bytes();
        let t = self.clone();
        // A send offered at launch asks only where this rank publishes its signals on the host:
        // its consumer then holds the pull until the signal shows there, and the
        // acknowledgement never follows a stream wait, which could close a cycle of device
        // waits (`Manager::enqueue_copies`, `ferry-memory/src/manager/held.rs`).
        let ack = self
            .acks
            .as_ref()
            .filter(|a| want_ack && (after.is_none() || a.offered()))
            .and_then(|a| a.take(p.dev));
        let join = Join::new(
            2,
            Box::new(move |r| {
                t.gpu(GpuCmd::Unpin { copy, dev: p.dev });
                if r.is_ok() {
                    t.count(TrafficPath::Ipc, len, 1, true);
                    // The consumer wrote the word before acknowledging. After a failure it may
                    // never write it: the word stays out of use.
                    if let (Some(a), Some(words)) = (ack, t.acks.as_ref()) {
                        words.give(a);
                    }
                }
                done(r)
            }),
        );
        let desc = Desc::Pool {
            dev: p.dev as u16,
            offset: p.offset,
            len: len as u64,
            after,
            ack: ack.map(|a| (a.word, a.value)),
        };
        let j = join.clone();
        self.control(
            false,
            Small::zeroed(super::ACK_BYTES),
            peer,
            tag,
            Lane::Control,
            Box::new(move |r| j.arrive(r)),
        );
        self.descriptor(&desc, peer, tag, Box::new(move |r| join.arrive(r)));
        ack
    }

    /// Sends the descriptor of a transfer: the first message of its tag on the data channel.
    /// Through the control ring, `done` runs here and now once the descriptor is in the ring,
    /// not after a hand-off to the polling thread. Every caller's `done` is an arrival at its
    /// transfer's `Join`, which takes its parts in any order and on any thread: if the other
    /// part (an IPC acknowledgement) came in between, the transfer completes here — for an
    /// offer at launch on the GPU manager's thread, which already completes receives.
    fn descriptor(&self, desc: &Desc, peer: Rank, tag: i32, done: Done) {
        if let Some(done) = self.control_here(&desc.encode(), peer, tag, Lane::Data, done) {
            done(Ok(()))
        }
    }

    /// A descriptor saying "inline", then the host buffer as one message.
    fn send_inline(&self, copy: &Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        let len = copy.bytes();
        let join = Join::new(2, done);
        let j = join.clone();
        let desc = Desc::Inline { len: len as u64 };
        self.descriptor(&desc, peer, tag, Box::new(move |r| j.arrive(r)));
        self.send_whole_host(copy, peer, tag, Box::new(move |r| join.arrive(r)));
    }
}

/// The state of one staged send from device memory.
struct StagedSend {
    t: Arc<Transport>,
    at: Placed,
    peer: Rank,
    tag: i32,
    eager: bool,
    chunks: Vec<(usize, usize)>,
    join: Arc<Join>,
    in_order: Mutex<InOrder>,
    /// Keeps the copy (and so its pinned block) alive until every chunk has been read.
    _copy: Arc<TileCopy>,
}

/// Chunks whose copy has ended, held until every chunk before them is sent: a copy that fails
/// when it is enqueued reports at once, before the copies ahead of it on the stream, and the
/// receiver pairs a tag's messages with its chunks by their order.
#[derive(Default)]
struct InOrder {
    /// The next chunk to send.
    next: usize,
    /// Chunks ready to go: the bounce buffer, and the copy's error if it failed.
    ready: BTreeMap<usize, (Arc<dyn MemRegion>, Option<FerryError>)>,
}

impl StagedSend {
    fn next(this: Arc<StagedSend>, k: usize) {
        let Some(&(off, len)) = this.chunks.get(k) else { return };
        let Some(pool) = this.t.bounce.clone() else {
            return this
                .join
                .arrive(Err(FerryError::Config("staged send without a bounce pool".into())));
        };
        let me = this.clone();
        pool.acquire(Box::new(move |mut slot: Slot| {
            slot.truncate(len);
            let (src, dst) = (Mem::Pool(me.at.offset + off as u64), Mem::Host(slot.ptr()));
            // The chunk holds a bounce buffer, which other transfers wait for: on the stream
            // where nothing waits for a producer's signal.
            let op = CopyOp::plain(me.at.dev, SIGNAL_FREE_STREAM, src, dst, len, TrafficPath::DeviceToHost);
            let s = me.clone();
            let slot: Arc<dyn MemRegion> = Arc::new(slot);
            me.t.gpu(GpuCmd::Copy {
                op,
                // Sent even when the copy failed (the buffer's stale bytes): the receiver takes
                // one message per chunk in order, and a missing one would leave it waiting, or
                // pair the next chunk with this one's receive. The transfer fails with the copy's
                // error, and the run with it.
                then: Box::new(move |r| s.copied(k, slot, r.err().map(FerryError::Device))),
            });
            StagedSend::next(me, k + 1);
        }));
    }

    /// Chunk `k`'s copy into `slot` has ended (`failed`: with that error): sends it and every
    /// chunk after it that is ready, in chunk order.
    fn copied(&self, k: usize, slot: Arc<dyn MemRegion>, failed: Option<FerryError>) {
        let mut o = self.in_order.lock().unwrap_or_else(|p| p.into_inner());
        o.ready.insert(k, (slot, failed));
        loop {
            let next = o.next;
            let Some((slot, failed)) = o.ready.remove(&next) else {
                break;
            };
            o.next += 1;
            let j = self.join.clone();
            // Under the lock: the messages reach the MPI thread in chunk order.
            let done: Done = Box::new(move |r| j.arrive(failed.map_or(r, Err)));
            self.t.chunk_message(true, slot, self.peer, self.tag, self.eager, done);
        }
    }
}
