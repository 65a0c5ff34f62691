//! The receiving side of a staged transfer whose consumer runs on a device, for tiles of more
//! than [`WINDOW`] chunks: chunk by chunk through `WINDOW` host buffers of its own, each
//! uploaded into the tile's device block as soon as its chunk has landed, then reused for a later
//! chunk. The host memory a receive holds is `WINDOW` chunks, whatever the tile's size, and
//! only once its data arrives (the buffers are taken when their first chunk is matched:
//! [`Landing`]); the upload of one chunk overlaps the arrival of the next.
//!
//! Why not the whole tile in host memory first: a receive is posted when its consumer is
//! inserted, and with the submission window every receive of the inserted rounds is posted at
//! once. Eight 256 MiB tiles in flight over five rounds wanted 10 GiB of landing buffers; the
//! pinned host pool held 4, later buffers were pageable, and an upload from pageable memory holds
//! the GPU manager for its whole length (2× H200: 21–28 ms per tile, the staged rate halved).
//!
//! # Deadlock freedom
//!
//! Receives still never wait for memory or for other transfers: the first `WINDOW` chunks'
//! receives are posted with the transfer, and chunk `k + WINDOW`'s once chunk `k` has been
//! uploaded, which waits for nothing but chunk `k`'s message and a host→device copy (the block is
//! reserved when chunk 0 lands, at once or not at all: see below; the uploads go on the comm
//! stream where no copy waits for a producer's signal, [`SIGNAL_FREE_STREAM`], so none waits
//! behind an IPC pull that waits for some producer's kernel). A sender posts a transfer's
//! chunks in order, and both the bounce pool and the send window (`ferry-comm/src/window.rs`) admit sends
//! first come, first served. So the receive of a chunk send in flight is posted, or will be once
//! the chunk `WINDOW` places before it — admitted earlier, hence sent — has landed: every chunk
//! send completes, bounce buffers come back, and the argument of `bounce.rs` (receives
//! are always posted) holds with "posted once the chunks before it have arrived".
//!
//! # Where the data goes
//!
//! comm-in reserves the device block when chunk 0 lands (the data is on its way: see the
//! transfer module). When no device can take the tile now, the transfer goes on into the tile's
//! host buffer, as a host-consumed staged receive does: the chunks already landed are copied
//! there, the others are received straight into it, and the tile is valid on the host.
//!
//! The data is marked valid in the block once every upload has completed (not by the last
//! upload's [`Fill`](ferry_memory::manager::Fill): an earlier upload that failed must not be
//! covered by a later one that succeeded), so the consumers wait for the receive to finish
//! rather than being launched behind the copy (comm-in ahead): one completion poll, small beside
//! the transfer of a tile this large.

use super::region::{Landing, LandingSlice, Slice};
use super::{Done, Transport};
use ferry_base::error::{FerryError, Rank};
use ferry_base::traffic::TrafficPath;
use ferry_device::Mem;
use ferry_engine::MemRegion;
use ferry_memory::data::buffer::TileBuf;
use ferry_memory::data::copy::TileCopy;
use ferry_memory::manager::{CopyOp, GpuCmd, Placed, Then, SIGNAL_FREE_STREAM};
use std::sync::{Arc, Mutex, MutexGuard};

/// Chunks of one staged receive in host memory at once. Four: one landing while one uploads,
/// with two to spare for the jitter of the MPI thread's and the GPU manager's reaction times
/// (the upload of a 1 MiB chunk, the default, takes ~20 µs on H200; its arrival several times
/// that).
pub(super) const WINDOW: usize = 4;

/// Where the tile's data goes.
enum Dest {
    /// No chunk has landed yet.
    Unknown,
    /// Chunk 0 has landed; the GPU manager is reserving a block.
    Reserving,
    /// Into this reserved, pinned block.
    Device(Placed),
    /// Into the tile's host buffer (no device could take the tile).
    Host(Arc<TileBuf>),
}

struct State {
    dest: Dest,
    /// The next chunk to post a receive for.
    next: usize,
    /// Chunks landed before the destination was known: (chunk, its buffer).
    pending: Vec<(usize, Arc<Landing>)>,
    /// Chunks whose data is at its destination.
    settled: usize,
    /// Receives posted, uploads enqueued and the reservation, not yet over.
    outstanding: usize,
    /// The first failure.
    err: Option<FerryError>,
    done: Option<Done>,
}

/// One windowed staged receive (see the module documentation).
pub(super) struct StagedRecv {
    t: Arc<Transport>,
    copy: Arc<TileCopy>,
    peer: Rank,
    tag: i32,
    /// `(offset, length)` of each chunk, cut by the sender's chunk size.
    chunks: Vec<(usize, usize)>,
    eager: bool,
    state: Mutex<State>,
}

impl StagedRecv {
    /// Posts the first [`WINDOW`] chunks' receives of the tile `copy` from `peer` into buffers
    /// of `chunk` bytes (the sender's chunk size, which cut `chunks`), each taken when its first
    /// chunk arrives ([`Landing`]: host memory only for the receives whose data is coming). `done` runs once the tile is on a device or in host memory.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        t: &Arc<Transport>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        chunks: Vec<(usize, usize)>,
        chunk: usize,
        eager: bool,
        done: Done,
    ) {
        let first = chunks.len().min(WINDOW);
        let buffers: Vec<Arc<Landing>> = (0..first).map(|_| Landing::new(&copy, chunk)).collect();
        let this = Arc::new(StagedRecv {
            t: t.clone(),
            copy,
            peer,
            tag,
            chunks,
            eager,
            state: Mutex::new(State {
                dest: Dest::Unknown,
                next: 0,
                pending: Vec::new(),
                settled: 0,
                outstanding: 0,
                err: None,
                done: Some(done),
            }),
        });
        let mut st = this.lock();
        for buf in buffers {
            this.post_next(&mut st, buf);
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Posts the receive of the next chunk into `buf` (a chunk buffer), or lets `buf` go when
    /// every chunk is posted.
    fn post_next(self: &Arc<Self>, st: &mut State, buf: Arc<Landing>) {
        let landing = buf.clone();
        self.post_chunk(st, move |_, len| Arc::new(LandingSlice { landing, len }), Some(buf));
    }

    /// Posts the receive of the next chunk straight into its place in the tile's host buffer.
    fn post_into_host(self: &Arc<Self>, st: &mut State, host: &Arc<TileBuf>) {
        let buf = host.clone();
        self.post_chunk(st, move |off, len| Arc::new(Slice { buf, off, len }), None);
    }

    /// Posts the receive of the next chunk, if any, into `region(offset, length)`; its landing
    /// reports `buf` (the chunk buffer, or `None`: the host buffer). Under the state's lock, so
    /// that the receives of one tag reach the MPI thread in chunk order, which is the order its
    /// messages match them in.
    fn post_chunk(
        self: &Arc<Self>,
        st: &mut State,
        region: impl FnOnce(usize, usize) -> Arc<dyn MemRegion>,
        buf: Option<Arc<Landing>>,
    ) {
        let k = st.next;
        let Some(&(off, len)) = self.chunks.get(k) else { return };
        st.next += 1;
        st.outstanding += 1;
        let me = self.clone();
        let done: Done = Box::new(move |r| me.landed(k, buf, r));
        self.t
            .chunk_message(false, region(off, len), self.peer, self.tag, self.eager, done);
    }

    /// Chunk `k` has landed in `buf` (`None`: straight in the tile's host buffer).
    ///
    /// After a failure the transfer still takes every chunk its sender sends, into the chunk
    /// buffers, and drops them: the sender's bounce buffers and window slots come back, and the
    /// run fails through the error, not through a sender waiting for receives that never come.
    fn landed(self: &Arc<Self>, k: usize, buf: Option<Arc<Landing>>, r: ferry_base::error::Result<()>) {
        let mut st = self.lock();
        st.outstanding -= 1;
        let ok = r.is_ok();
        if let Err(e) = r {
            st.err.get_or_insert(e);
        }
        let Some(buf) = buf else {
            st.settled += usize::from(ok);
            return self.finish_if_over(st);
        };
        if st.err.is_some() {
            self.post_next(&mut st, buf);
            return self.finish_if_over(st);
        }
        match &st.dest {
            Dest::Unknown => {
                st.dest = Dest::Reserving;
                st.pending.push((k, buf));
                st.outstanding += 1;
                drop(st);
                let me = self.clone();
                self.t.gpu(GpuCmd::Reserve {
                    copy: self.copy.clone(),
                    then: Box::new(move |placed| me.reserved(placed)),
                });
            }
            Dest::Reserving => st.pending.push((k, buf)),
            Dest::Device(p) => {
                let p = *p;
                let (op, then) = self.upload(&mut st, p, k, buf);
                self.t.gpu(GpuCmd::Copy { op, then });
            }
            // Posted into a chunk buffer before the reservation failed; every later chunk is
            // already posted into the host buffer (`reserved`).
            Dest::Host(h) => {
                let h = h.clone();
                self.copy_to_host(&h, k, &buf);
                st.settled += 1;
                self.finish_if_over(st);
            }
        }
    }

    /// The reservation's outcome (on the GPU manager's thread): the uploads of the chunks that
    /// have landed meanwhile; the first is returned for the manager to enqueue at once.
    fn reserved(self: &Arc<Self>, placed: Option<Placed>) -> Option<(CopyOp, Then)> {
        let mut st = self.lock();
        st.outstanding -= 1;
        let pending = std::mem::take(&mut st.pending);
        match placed {
            Some(p) => {
                st.dest = Dest::Device(p);
                let mut first = None;
                for (k, buf) in pending {
                    if st.err.is_some() {
                        // Failed meanwhile: the buffer takes the next chunk, to drop it.
                        self.post_next(&mut st, buf);
                        continue;
                    }
                    let up = self.upload(&mut st, p, k, buf);
                    match first {
                        None => first = Some(up),
                        Some(_) => self.t.gpu(GpuCmd::Copy { op: up.0, then: up.1 }),
                    }
                }
                if first.is_none() {
                    self.finish_if_over(st);
                }
                first
            }
            None if st.err.is_some() => {
                // Failed meanwhile: no host buffer for data that will not all come; the chunk
                // buffers take the rest, to drop it.
                st.dest = Dest::Unknown;
                for (_, buf) in pending {
                    self.post_next(&mut st, buf);
                }
                self.finish_if_over(st);
                None
            }
            None => {
                // No device can take the tile now: on into its host buffer, written whole — the
                // chunks landed so far (at most `WINDOW`, rarely: only under device memory
                // pressure) are copied there, on the manager's thread, and the rest are received
                // straight into it (after a later failure too, to take what the sender sends).
                let host = self.copy.lock().landing_host_buf(self.copy.bytes());
                st.dest = Dest::Host(host.clone());
                for (k, buf) in &pending {
                    self.copy_to_host(&host, *k, buf);
                    st.settled += 1;
                }
                while st.next < self.chunks.len() {
                    self.post_into_host(&mut st, &host);
                }
                self.finish_if_over(st);
                None
            }
        }
    }

    /// The upload of chunk `k` from `buf` into the block `p`; its completion posts the next
    /// chunk's receive into `buf`.
    fn upload(self: &Arc<Self>, st: &mut State, p: Placed, k: usize, buf: Arc<Landing>) -> (CopyOp, Then) {
        let (off, len) = self.chunks[k];
        st.outstanding += 1;
        let (src, dst) = (Mem::Host(buf.ptr()), Mem::Pool(p.offset + off as u64));
        let op = CopyOp::plain(p.dev, SIGNAL_FREE_STREAM, src, dst, len, TrafficPath::HostToDevice);
        let me = self.clone();
        let then: Then = Box::new(move |r| {
            let mut st = me.lock();
            st.outstanding -= 1;
            match r {
                Ok(()) => st.settled += 1,
                Err(e) => {
                    st.err.get_or_insert(FerryError::Device(e));
                }
            }
            // The next chunk (after a failure too: see `landed`).
            me.post_next(&mut st, buf);
            me.finish_if_over(st);
        });
        (op, then)
    }

    /// Copies chunk `k` from its buffer into the tile's host buffer.
    fn copy_to_host(&self, host: &TileBuf, k: usize, buf: &Landing) {
        let (off, len) = self.chunks[k];
        // SAFETY: the chunk's receive has completed, so nothing writes `buf`; `off + len` lies
        // inside the tile (the chunking), and this fresh copy's host buffer is written only by
        // this transfer until it reports done (the module documentation of `recv.rs`).
        unsafe { std::ptr::copy_nonoverlapping(buf.ptr(), host.as_ptr().add(off), len) };
    }

    /// Ends the transfer once every chunk's receive has been posted and nothing is outstanding:
    /// every chunk is at its destination, or something failed.
    fn finish_if_over(&self, mut st: MutexGuard<'_, State>) {
        if st.outstanding > 0 || st.next < self.chunks.len() {
            return;
        }
        debug_assert!(st.err.is_some() || st.settled == self.chunks.len());
        let Some(done) = st.done.take() else { return };
        let err = st.err.take();
        let dest = std::mem::replace(&mut st.dest, Dest::Unknown);
        drop(st);
        match (err, dest) {
            (None, Dest::Device(p)) => {
                self.t.count(TrafficPath::Staged, 0, 1, false);
                self.t.mark_landed(&self.copy, p.dev, false);
                done(Ok(()))
            }
            (None, _) => {
                self.t.count(TrafficPath::Staged, 0, 1, false);
                done(Ok(()))
            }
            (Some(e), Dest::Device(p)) => {
                self.t.gpu(GpuCmd::Unpin {
                    copy: self.copy.clone(),
                    dev: p.dev,
                });
                done(Err(e))
            }
            (Some(e), Dest::Host(h)) => {
                // Not written whole: it must not stay as the copy's data (`TileLanding::discard`).
                self.copy.lock().forget_host(&h);
                done(Err(e))
            }
            (Some(e), _) => done(Err(e)),
        }
    }
}
