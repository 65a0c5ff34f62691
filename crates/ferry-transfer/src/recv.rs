//! The receiving side of each route. The copy is fresh (a receive lands in a new buffer), so
//! nothing else reads it until `done` has run — except the GPU consumers that comm-in ahead
//! launched behind the copy that fills it, which the GPU manager orders after that copy on the
//! device and finalizes after its completion. Validity is set before `done`, so the consumers
//! released by `done` see where the data is: by the GPU manager for a copy into a reserved block
//! (`CopyOp::fills`), here otherwise.

use super::region::{DeviceRegion, Small, TileLanding, TileLandingSlice};
use super::route::Route;
use super::staged_recv::{StagedRecv, WINDOW};
use super::wire::{Desc, DESC_BYTES};
use super::{Done, Join, Transport};
use ferry_base::error::{FerryError, Rank};
use ferry_base::traffic::TrafficPath;
use ferry_device::Mem;
use ferry_engine::{Lane, MemRegion};
use ferry_memory::data::copy::{Location, TileCopy};
use ferry_memory::manager::{Ahead, CopyOp, Fill, GpuCmd, Placed, Then};
use std::sync::Arc;

/// The whole host buffer of the fresh `copy` as the region a receive lands in (made when the
/// receive is matched, [`TileLanding`]), and `done` wrapped to give the buffer back should the
/// receive fail (what it left is not the tile's data). `ring`: the receive of transfer
/// `(peer, tag)` through the control ring, whose `done` runs inside a `transfer` span as the
/// MPI loop's completions do (traces show every transfer).
fn whole_landing(copy: &Arc<TileCopy>, done: Done, ring: Option<(Rank, i32)>) -> (Arc<TileLandingSlice>, Done) {
    let landing = TileLanding::new(copy.clone());
    let region = Arc::new(TileLandingSlice {
        landing: landing.clone(),
        off: 0,
        len: copy.bytes(),
    });
    let len = copy.bytes();
    let done: Done = Box::new(move |r| {
        if r.is_err() {
            landing.discard();
        }
        let span = ring.map(|(peer, tag)| super::ring_span("recv", peer, tag, len));
        let _g = span.as_ref().map(tracing::Span::enter);
        done(r)
    });
    (region, done)
}

impl Transport {
    /// The data is valid in the reserved block of `dev` (and in host memory too when
    /// `host_too`): set it now, so the consumers `done` releases see it; the manager releases the
    /// pin and files the copy in its LRU.
    pub(super) fn mark_landed(&self, copy: &Arc<TileCopy>, dev: usize, host_too: bool) {
        let generation = {
            let mut s = copy.lock();
            s.produced_at(Location::Device(dev));
            s.host_valid = host_too;
            s.generation
        };
        self.gpu(GpuCmd::Landed {
            copy: copy.clone(),
            dev,
            generation,
        });
    }

    /// Host route: a tile of one ring slot from a rank of this node comes through the control
    /// ring ([`Transport::tile_ring`], as its sender sends it); any other, whole over MPI
    /// ([`Transport::recv_whole_host`]).
    pub(super) fn recv_host(&self, copy: &Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        match self.tile_ring(peer, copy.bytes()) {
            Some(m) => {
                let (region, done) = whole_landing(copy, done, Some((peer, tag)));
                m.want_tile(peer, tag, region, done)
            }
            None => self.recv_whole_host(copy, peer, tag, done),
        }
    }

    /// One message into the host buffer (host path by size), made when the message is matched
    /// ([`TileLanding`]).
    pub(super) fn recv_whole_host(&self, copy: &Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        let (path, eager) = self.host_path(copy.bytes());
        let (region, done) = whole_landing(copy, done, None);
        self.message(false, region, peer, tag, Lane::Data, path, true, eager, done);
    }

    /// Staged. A tile of more than [`WINDOW`] chunks for a device consumer goes chunk by chunk
    /// through a few buffers of its own into a device block ([`StagedRecv`]). Otherwise: chunks
    /// into the host buffer (made when the first chunk is matched, [`TileLanding`]); for a
    /// device consumer, once all have landed, one host→device copy into a block reserved then
    /// (comm-in), after which the host buffer is given back: it was only the staging area (kept
    /// as a second valid copy, every tile in transit held its buffer until superseded).
    pub(super) fn recv_staged(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        to_device: bool,
        ahead: Option<Ahead>,
        done: Done,
    ) {
        let len = copy.bytes();
        let chunk = self.chunk_from(peer);
        let chunks = super::chunks(len, chunk);
        let eager = len <= self.eager_bytes;
        if to_device && chunks.len() > WINDOW {
            return StagedRecv::start(self, copy, peer, tag, chunks, chunk, eager, done);
        }
        let landing = TileLanding::new(copy.clone());
        let t = self.clone();
        let c = copy.clone();
        let l = landing.clone();
        let join = Join::new(
            chunks.len(),
            Box::new(move |r| {
                if r.is_ok() {
                    t.count(TrafficPath::Staged, 0, 1, false);
                }
                if r.is_err() {
                    l.discard();
                }
                if r.is_err() || !to_device {
                    return done(r);
                }
                let t2 = t.clone();
                // Every chunk has landed, so the buffer exists: the staging area of the copy.
                let b = l.buf().clone();
                drop(l);
                t.gpu(GpuCmd::Reserve {
                    copy: c.clone(),
                    then: Box::new(move |placed| {
                        let Some(p) = placed else {
                            done(Ok(()));
                            return None;
                        };
                        let went_ahead = ahead.is_some();
                        let staged = c.clone();
                        let op = CopyOp {
                            dev: p.dev,
                            stream: t2.comm_stream(),
                            src: Mem::Host(b.as_ptr()),
                            dst: Mem::Pool(p.offset),
                            len,
                            path: TrafficPath::HostToDevice,
                            counted: true,
                            independent: false,
                            ahead,
                            after: None,
                            ack: None,
                            // Valid on the device only: the host buffer goes back below.
                            fills: Some(Fill {
                                copy: c,
                                host_too: false,
                            }),
                        };
                        let then: Then = Box::new(move |r| {
                            drop(b);
                            if r.is_ok() {
                                staged.lock().release_stale_host();
                            }
                            if let Err(e) = r {
                                // Consumers launched behind the copy have read the block: the
                                // receive fails with it.
                                if went_ahead {
                                    return done(Err(FerryError::Device(e)));
                                }
                                // Otherwise the data is on the host anyway.
                                tracing::warn!(error = %e, "comm-in copy failed; the tile stays on the host");
                            }
                            done(Ok(()))
                        });
                        Some((op, then))
                    }),
                });
            }),
        );
        let region = |off, len| -> Arc<dyn MemRegion> {
            Arc::new(TileLandingSlice {
                landing: landing.clone(),
                off,
                len,
            })
        };
        self.staged_chunks(false, region, chunks, peer, tag, eager, &join);
    }

    /// gpu-direct and IPC: the producer's descriptor first; comm-in reserves a device block only
    /// now that the data is ready and on its way.
    pub(super) fn recv_announced(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        to_device: bool,
        ahead: Option<Ahead>,
        done: Done,
    ) {
        let desc_buf = Small::zeroed(DESC_BYTES);
        let t = self.clone();
        let d = desc_buf.clone();
        let direct = self.routes.get(peer) == Route::GpuDirect;
        let on_desc: Done = Box::new(move |r| {
            if let Err(e) = r {
                return done(Err(e));
            }
            // SAFETY: the receive into the buffer has completed.
            let desc = Desc::decode(unsafe { d.get() });
            let len = copy.bytes();
            let desc = match desc {
                Ok(x) if x.len() == len as u64 => x,
                Ok(x) => {
                    return done(Err(FerryError::Protocol {
                        peer,
                        tag,
                        msg: format!("announces {} bytes, the tile has {len}", x.len()),
                    }))
                }
                Err(e) => {
                    return done(Err(FerryError::Protocol {
                        peer,
                        tag,
                        msg: e.to_string(),
                    }))
                }
            };
            // Inline data over an MPI that cannot take device memory lands on the host.
            let place = to_device && (direct || matches!(desc, Desc::Pool { .. }));
            if !place {
                if let Some((op, then)) = t.on_descriptor(copy, peer, tag, None, desc, None, done) {
                    t.gpu(GpuCmd::Copy { op, then });
                }
                return;
            }
            let t2 = t.clone();
            let c = copy.clone();
            t.gpu(GpuCmd::Reserve {
                copy,
                then: Box::new(move |placed| t2.on_descriptor(c, peer, tag, placed, desc, ahead, done)),
            });
        });
        self.control(false, desc_buf, peer, tag, Lane::Data, on_desc);
    }

    /// What follows a descriptor, once comm-in has placed the destination (`placed`; `None`:
    /// host memory): the GPU-direct receive is posted here; the IPC pull is returned, for the
    /// caller to start (the GPU manager, when it calls this after the reservation, at once).
    #[allow(clippy::too_many_arguments)]
    fn on_descriptor(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        placed: Option<Placed>,
        desc: Desc,
        ahead: Option<Ahead>,
        done: Done,
    ) -> Option<(CopyOp, Then)> {
        let len = copy.bytes();
        let bad = |msg: String| FerryError::Protocol { peer, tag, msg };
        match desc {
            Desc::Inline { .. } => match placed {
                // gpu-direct: straight into the reserved block.
                Some(p) => {
                    let region = Arc::new(DeviceRegion { addr: p.addr, len });
                    let t = self.clone();
                    let done: Done = Box::new(move |r| {
                        if r.is_ok() {
                            t.mark_landed(&copy, p.dev, false);
                        } else {
                            t.gpu(GpuCmd::Unpin { copy, dev: p.dev });
                        }
                        done(r)
                    });
                    self.message(
                        false,
                        region,
                        peer,
                        tag,
                        Lane::Data,
                        TrafficPath::GpuDirect,
                        true,
                        false,
                        done,
                    );
                    None
                }
                None => {
                    self.recv_whole_host(&copy, peer, tag, done);
                    None
                }
            },
            Desc::Pool {
                dev,
                offset,
                len: n,
                after,
                ack,
            } => {
                let local = placed.map_or(0, |p| p.dev);
                let caps = self.routes.caps(peer);
                let capacity = caps.pool_bytes.get(dev as usize).copied().unwrap_or(0);
                if let Some((slot, value)) = after {
                    if slot as usize >= ferry_device::SIGNAL_SLOTS || value == 0 {
                        let msg = format!("signal word {slot} or value {value} out of range");
                        self.fail_ipc(copy, placed, done, bad(msg));
                        return None;
                    }
                }
                if let Some((word, value)) = ack {
                    if word as usize >= ferry_device::ACK_WORDS || value == 0 {
                        let msg = format!("acknowledgement word {word} or value {value} out of range");
                        self.fail_ipc(copy, placed, done, bad(msg));
                        return None;
                    }
                }
                let remote = self.ipc.get(&(peer, dev as usize)).and_then(|v| v.get(local)).copied();
                let remote = match remote {
                    Some(r) if offset.checked_add(n).is_some_and(|end| end <= capacity) => r,
                    Some(_) => {
                        let msg =
                            format!("{n} bytes at offset {offset} lie outside device {dev}'s pool of {capacity} bytes");
                        self.fail_ipc(copy, placed, done, bad(msg));
                        return None;
                    }
                    None => {
                        let msg = format!("device {dev} of rank {peer} is not mapped here");
                        self.fail_ipc(copy, placed, done, bad(msg));
                        return None;
                    }
                };
                let host = placed.is_none().then(|| copy.lock().host_buf(len));
                let dst = match (&host, placed) {
                    (Some(h), _) => Mem::Host(h.as_ptr()),
                    (None, Some(p)) => Mem::Pool(p.offset),
                    (None, None) => unreachable!("a host buffer is taken when nothing is placed"),
                };
                let op = CopyOp {
                    dev: local,
                    stream: self.comm_stream(),
                    dst,
                    src: Mem::Remote {
                        pool: remote,
                        off: offset,
                    },
                    len,
                    path: TrafficPath::Ipc,
                    counted: false,
                    // An IPC pull into a reserved block: batched with the others that come with it
                    // and wait for the same signal word (or for none), and its consumers launched
                    // behind it.
                    independent: placed.is_some(),
                    ahead: ahead.filter(|_| placed.is_some()),
                    after: after.map(|(slot, value)| {
                        let at = Mem::Remote {
                            pool: remote,
                            off: ferry_device::signal_offset(capacity, slot as usize),
                        };
                        (at, value)
                    }),
                    // Written once the pull has read the producer's block: its next writers wait
                    // for it on the producer's device.
                    ack: ack.map(|(word, value)| {
                        let at = Mem::Remote {
                            pool: remote,
                            off: ferry_device::ack_offset(capacity, word as usize),
                        };
                        (at, value)
                    }),
                    fills: placed.map(|_| Fill { copy, host_too: false }),
                };
                let t = self.clone();
                let then: Then = Box::new(move |r| {
                    drop(host);
                    // A reserved block was landed (or, on failure, unpinned) by the manager.
                    if let Err(e) = r {
                        return done(Err(FerryError::Device(e)));
                    }
                    t.count(TrafficPath::Ipc, len, 1, false);
                    // The producer unpins its block on this acknowledgement. The consumers
                    // need not wait for it to leave: they are released now, on this thread,
                    // which saves a hand-off to the MPI thread and back per transfer (the
                    // MPI thread flushes its sends at shutdown).
                    t.ack(peer, tag);
                    done(Ok(()))
                });
                Some((op, then))
            }
        }
    }

    fn fail_ipc(&self, copy: Arc<TileCopy>, placed: Option<Placed>, done: Done, e: FerryError) {
        if let Some(p) = placed {
            self.gpu(GpuCmd::Unpin { copy, dev: p.dev });
        }
        done(Err(e))
    }
}
