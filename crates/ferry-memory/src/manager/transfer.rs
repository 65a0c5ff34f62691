//! The device side of transfers between ranks: comm-in reservations, pins that keep a source
//! block in place while a send or a peer process reads it, and asynchronous copies whose
//! completion the transfer layer waits for (chunks through bounce buffers, IPC pulls).
//!
//! The manager knows neither ranks nor messages here: it reserves, pins and copies on request
//! and calls back when an event has completed.

use super::held::Wait;
use super::phases::Phase;
use super::{key, Manager, Then, ALIGN};
use crate::data::copy::TileCopy;
use ferry_base::traffic::TrafficPath;
use ferry_device::{Backend, BatchCopy, DeviceError, Mem, Stream};
use smallvec::SmallVec;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// A pinned device block of a copy: where a transfer reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// Local device index.
    pub dev: usize,
    /// Offset of the block in the device's pool.
    pub offset: u64,
    /// Device address of the block (what a CUDA-aware MPI receives).
    pub addr: u64,
}

/// Called on the manager thread with the outcome of a reservation; returns the copy to start
/// next, if any (the pull or upload into the reserved block), which the manager enqueues at once
/// rather than after a second trip through its command channel.
pub type OnPlaced = Box<dyn FnOnce(Option<Placed>) -> Option<(CopyOp, Then)> + Send>;

/// comm-in: what a copy into a block that `Manager::reserve` pinned for `copy` does to the
/// copy's state when it ends. On success the manager marks the data valid in the block (and in
/// host memory too when `host_too`: the copy's source was the tile's own host buffer), releases
/// the pin and files the copy in its LRU, all before the copy's `then` runs, so that whatever
/// `then` releases sees the data where it is; on failure it releases the pin.
pub struct Fill {
    /// The copy the data lands for.
    pub copy: Arc<TileCopy>,
    /// Whether the host buffer holds the same data (the copy's source was it).
    pub host_too: bool,
}

/// comm-in ahead: the GPU consumers of a copy's destination, which may be launched behind the
/// copy (their stream waits for its event) as soon as it is enqueued, rather than after the
/// manager has seen it complete and the graph has released them — a completion poll, a
/// hand-off and a pass of the manager less on the path of every halo.
pub struct Ahead {
    /// What the consumers' [`GpuTask::after`](super::GpuTask) names: a key of its own, disjoint
    /// from task sequence numbers (see [`COMM_IN_KEYS`]).
    pub key: u64,
    /// The tile copy the copy fills: consumers staging it in find it arriving.
    pub copy: Arc<TileCopy>,
    /// Releases the consumers, bound to the copy's device (its argument); says whether it
    /// released any.
    pub release: Box<dyn FnOnce(usize) -> bool + Send>,
}

/// A value that a signal word of a device will reach once a launched task has completed
/// ([`super::LaunchSite::signal`]): what a peer process orders its pull of the task's output
/// after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal {
    /// Local device index.
    pub dev: usize,
    /// The signal word (the task's exec stream), below [`ferry_device::SIGNAL_SLOTS`].
    pub slot: usize,
    /// The value, ≥ 1.
    pub value: u64,
}

/// An acknowledgement word of this rank's device and the value that a consumer's comm stream
/// writes there once its IPC pull has read the block (`ferry-transfer/src/ack.rs`): a task that
/// overwrites the block waits for it on the device ([`super::GpuTask::acks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAck {
    /// Local device index.
    pub dev: usize,
    /// The word, below [`ferry_device::ACK_WORDS`].
    pub word: u32,
    /// The value, ≥ 1 (a word's values rise with each transfer that uses it).
    pub value: u64,
}

/// The first key of comm-in copies in [`Ahead::key`] (task sequence numbers stay below it).
pub const COMM_IN_KEYS: u64 = 1 << 63;

/// The comm stream on which no copy waits for a producer's signal (`Manager::enqueue_copies`
/// moves such batches off it): whatever is enqueued there waits for nothing but the copies
/// ahead of it. The copies of the staged path go there — they hold bounce buffers and receive
/// windows that other transfers, of other ranks too, wait for, so they must not wait behind a
/// pull that waits for some producer's kernel — and so do acknowledged IPC pulls.
pub const SIGNAL_FREE_STREAM: Stream = Stream::Comm(0);

/// The comm stream of acknowledged IPC pulls (see `Manager::enqueue_copies`).
const ACK_STREAM: Stream = SIGNAL_FREE_STREAM;

/// Copies enqueued together (one batch: one device, one awaited signal word), inline for the
/// usual handful.
pub(super) type Batch = SmallVec<[(CopyOp, Then); 8]>;

/// An asynchronous copy for a transfer.
pub struct CopyOp {
    /// The device whose stream runs it.
    pub dev: usize,
    /// The stream.
    pub stream: Stream,
    /// Where the bytes go.
    pub dst: Mem,
    /// Where they come from.
    pub src: Mem,
    /// Bytes.
    pub len: usize,
    /// The path whose active time the copy counts towards.
    pub path: TrafficPath,
    /// Whether its bytes and one operation are counted on `path` too (IPC pulls are counted by
    /// the transfer layer as whole tiles).
    pub counted: bool,
    /// The copy depends on nothing enqueued before it on its stream (an IPC pull: its source
    /// was complete before its descriptor left, its destination was just reserved). Such copies
    /// that reach the manager together are enqueued as one batch on one stream of their device,
    /// behind one event: a driver call and an event query for all of them instead of per copy.
    pub independent: bool,
    /// Consumers of the destination block to launch behind the copy (comm-in into a reserved
    /// device block only).
    pub ahead: Option<Ahead>,
    /// A peer's signal word and the value the copy waits for (an IPC pull offered at its
    /// producer's launch: the source is complete only once the word reaches the value).
    pub after: Option<(Mem, u64)>,
    /// The producer's acknowledgement word ([`Mem::Remote`]) and the value to write there once
    /// the copy has read its source (an IPC pull whose producer orders the block's next writers
    /// after it on the device). See `Manager::enqueue_copies` for where the write goes.
    pub ack: Option<(Mem, u64)>,
    /// The reserved block the copy fills (comm-in), landed or unpinned by the manager when the
    /// copy ends.
    pub fills: Option<Fill>,
}

impl CopyOp {
    /// A copy of `len` bytes from `src` to `dst` on `stream` of device `dev`, counted on `path`,
    /// that depends on nothing but its stream's order and fills no reserved block: what staged
    /// chunks, checkpoint streaming and uploads of single buffers make.
    pub fn plain(dev: usize, stream: Stream, src: Mem, dst: Mem, len: usize, path: TrafficPath) -> CopyOp {
        CopyOp {
            dev,
            stream,
            dst,
            src,
            len,
            path,
            counted: true,
            independent: false,
            ahead: None,
            after: None,
            ack: None,
            fills: None,
        }
    }
}

/// A copy in flight and who to tell.
pub(super) struct CopyInFlight<E> {
    /// Shared by the copies of one batch.
    event: Arc<E>,
    dev: usize,
    stream: Stream,
    path: TrafficPath,
    then: Then,
    /// Its start event and bytes (GPU timeline).
    timed: Option<(E, usize)>,
    /// comm-in ahead: the key its early consumers wait for, and the copy it fills (both
    /// announced until it completes).
    ahead: Option<(u64, (usize, usize))>,
    /// The reserved block it fills.
    fills: Option<Fill>,
}

impl<B: Backend> Manager<B> {
    /// comm-in: reserves and pins a block for `copy` on the least loaded device that has room
    /// (evicting unpinned copies if needed). `None` when no device can take it now: the transfer
    /// then lands in host memory rather than wait, because a receive that waits for device memory
    /// could hold up its sender's window (see `ferry-comm/src/window.rs`).
    pub(super) fn reserve(&mut self, copy: &Arc<TileCopy>) -> Option<Placed> {
        let n = self.mem.pools.len();
        let bytes = copy.bytes() as u64;
        let need = bytes.div_ceil(ALIGN) * ALIGN;
        // Inline: this runs for every comm-in, and rarely for more than a handful of devices.
        let mut order: SmallVec<[usize; 8]> = (0..n).collect();
        order.sort_by_key(|&d| {
            (
                self.adm.load[d],
                std::cmp::Reverse(self.mem.pools[d].capacity() - self.mem.pools[d].used()),
            )
        });
        for d in order {
            if need > self.mem.pools[d].capacity() {
                continue;
            }
            let mut block = (!self.b.fail_alloc(d))
                .then(|| self.mem.pools[d].alloc(bytes))
                .flatten();
            if block.is_none() && self.evict(d, need) {
                block = self.mem.pools[d].alloc(bytes);
            }
            let Some(block) = block else {
                self.counters.device(d).alloc_failures.fetch_add(1, Relaxed);
                continue;
            };
            let mut s = copy.lock();
            if let Some(old) = s.dev[d].block.replace(block) {
                // A fresh copy has no block; keep the invariant anyway.
                drop(s);
                self.mem.pools[d].free(old);
                s = copy.lock();
            }
            s.dev[d].pins += 1;
            return Some(Placed {
                dev: d,
                offset: block.offset,
                addr: self.b.addr(d, block.offset),
            });
        }
        None
    }

    /// Releases a pin taken by `Manager::reserve` or by the transfer layer.
    pub(super) fn unpin(&mut self, copy: &Arc<TileCopy>, dev: usize) {
        copy.lock().dev[dev].pins -= 1;
        if !self.adm.waiting.is_empty() {
            self.retry_waiting();
        }
    }

    /// Data arrived in the reserved block on `dev` as version `generation`: the pin is released
    /// and the copy joins the LRU.
    pub(super) fn landed(&mut self, copy: &Arc<TileCopy>, dev: usize, generation: u64) {
        let mut s = copy.lock();
        // Validity was set before the consumers were released (by `settle_fill` just before, or
        // by the transfer layer for a GPU-direct receive, which posts this), and they may
        // already have written a newer version (on the host, or here): setting it again now
        // would mark stale data current. Only the debugging hash is still due, for this version.
        if ferry_base::debug::check_coherence() && s.generation == generation {
            s.debug_hash = s.dev[dev]
                .block
                .and_then(|b| self.b.debug_hash(dev, b.offset, copy.bytes()));
        }
        s.dev[dev].pins -= 1;
        self.mem.next_stamp += 1;
        s.dev[dev].lru_stamp = self.mem.next_stamp;
        drop(s);
        self.mem.lru[dev].push_back((Arc::downgrade(copy), self.mem.next_stamp));
        if !self.adm.waiting.is_empty() {
            self.retry_waiting();
        }
    }

    /// The end of a copy that fills a reserved block (see [`Fill`]): lands it on success,
    /// releases its pin on failure.
    fn settle_fill(&mut self, fill: Fill, dev: usize, ok: bool) {
        if !ok {
            return self.unpin(&fill.copy, dev);
        }
        let generation = {
            let mut s = fill.copy.lock();
            s.produced_at(crate::data::copy::Location::Device(dev));
            s.host_valid = fill.host_too;
            s.generation
        };
        self.landed(&fill.copy, dev, generation);
    }

    /// Enqueues a copy and calls `then` when it has completed. A small independent copy waits
    /// for [`Manager::flush_copies`] (at the next command that is not one, or once the pass has
    /// drained the commands), which batches it with the others that came meanwhile.
    pub(super) fn start_copy(&mut self, op: CopyOp, then: Then) {
        if self.batchable(&op) {
            self.xfer.pending_copies.push((op, then));
        } else {
            self.issue_copies(smallvec::smallvec![(op, then)]);
        }
    }

    /// Whether `op` waits to be batched with others. A batch shares one event (one record and
    /// one query for all its copies, ≈ 1.5 µs of manager time saved per copy on H200) and one
    /// stream: copies longer than the backend runs concurrently within a batch
    /// ([`Backend::batch_copy_max`]) go alone, each on its own comm stream.
    pub(super) fn batchable(&self, op: &CopyOp) -> bool {
        op.independent && op.len <= self.b.batch_copy_max()
    }

    /// Enqueues the independent copies gathered since the last call: one batch per device and
    /// awaited signal word, on the stream of its first copy (a lone copy goes as it came).
    pub(super) fn flush_copies(&mut self) {
        // Offered pulls whose producer's signal already shows on the host wait for nothing:
        // they join the batch of the device's other such copies, whatever word they named.
        self.clear_seen_waits();
        while !self.xfer.pending_copies.is_empty() {
            // One batch per device and signal word: pulls offered after one producer stream's
            // tasks wait for the last of them (whose signals rise in that stream's order), and
            // a pull whose data is ready never waits for another producer's kernel.
            // Acknowledged pulls (which wait for no signal) batch only with each other: they go
            // on the acknowledgement stream (see `enqueue_copies`).
            // An acknowledged pull waits for its own signal value only: held for a later value
            // of its word, its acknowledgement could wait for a producer task that itself waits
            // on the device for that acknowledgement (`held.rs`).
            let group = |op: &CopyOp| {
                let acked = op.ack.is_some();
                let value = op.after.filter(|_| acked).map_or(0, |(_, v)| v);
                (op.dev, op.after.map(|(word, _)| word), acked, value)
            };
            // Taken in place: the list keeps its capacity, and the usual single group costs no
            // allocation (this runs for every run of IPC pulls).
            let g = group(&self.xfer.pending_copies[0].0);
            let batch: Batch = if self.xfer.pending_copies.iter().all(|(op, _)| group(op) == g) {
                self.xfer.pending_copies.drain(..).collect()
            } else {
                let mut batch = Batch::new();
                let mut k = 0;
                while k < self.xfer.pending_copies.len() {
                    if group(&self.xfer.pending_copies[k].0) == g {
                        batch.push(self.xfer.pending_copies.remove(k));
                    } else {
                        k += 1;
                    }
                }
                batch
            };
            self.issue_copies(batch);
        }
    }

    /// Enqueues `ops` (all of one device) on the stream of the first, behind one event.
    fn issue_copies(&mut self, ops: Batch) {
        self.timed(Phase::Copies, |m| m.enqueue_copies(ops));
    }

    /// Device acknowledgements go right behind the batch's copies, before its event, so that
    /// the consumer's own completion (and its host acknowledgement, on which the producer reuses
    /// the word) implies them. The write must wait for nothing but those copies: behind a wait
    /// for some producer's signal, it would wait for that producer's task, which may itself
    /// wait on the device for this acknowledgement — a cycle of device waits that nothing
    /// breaks (descriptors of different producers reach this thread in no set order). So
    /// acknowledged pulls wait for no signal on the device (an offered one is held on the host
    /// until its signal shows in the producer's mirror, `held.rs`), and they go on
    /// [`ACK_STREAM`], which no batch that waits for a signal ever uses: every operation there
    /// is a copy or a write that waits for nothing.
    fn enqueue_copies(&mut self, ops: Batch) {
        let Some((first, _)) = ops.first() else { return };
        let dev = first.dev;
        // Offered pulls read their source only once its producer has signalled. A batch's
        // pulls all wait on one word (`flush_copies`), whose values rise in the producer's
        // stream order: one wait for the highest covers them all.
        let highest = ops
            .iter()
            .filter_map(|(op, _)| op.after)
            .reduce(|a, b| if b.1 > a.1 { b } else { a });
        debug_assert!(
            ops.iter()
                .filter_map(|(op, _)| op.after)
                .all(|(at, _)| Some(at) == highest.map(|h| h.0)),
            "a batch waits on one signal word"
        );
        match highest {
            None => self.enqueue_batch(ops, None),
            Some((at, value)) => {
                if let Some((ops, wait)) = self.wait_or_hold(ops, dev, at, value) {
                    self.enqueue_batch(ops, Some(wait));
                }
            }
        }
    }

    /// Fails the copies of `ops` with `e`: their reserved blocks are unpinned, their callbacks
    /// get the error.
    pub(super) fn fail_copies(&mut self, ops: Batch, e: DeviceError) {
        for (op, then) in ops {
            if let Some(f) = op.fills {
                self.settle_fill(f, op.dev, false);
            }
            then(Err(e.clone()));
        }
    }

    /// Enqueues a batch that [`Manager::release_held`] let go.
    pub(super) fn issue_waited(&mut self, ops: Batch, wait: Wait) {
        self.timed(Phase::Copies, |m| m.enqueue_batch(ops, Some(wait)));
    }

    /// Enqueues `ops` behind one event; `wait`: how a batch of offered pulls is ordered after
    /// its producer's signal (`None` for copies that wait for none).
    fn enqueue_batch(&mut self, ops: Batch, wait: Option<Wait>) {
        let Some((first, _)) = ops.first() else { return };
        let (dev, mut stream) = (first.dev, first.stream);
        let acked = ops.iter().any(|(op, _)| op.ack.is_some());
        // Only a wait on the device counts: a batch whose signal was seen waits for nothing.
        let waits = matches!(wait, Some(Wait::Device));
        debug_assert!(
            !(acked && waits),
            "acknowledged pulls wait for no signal (`flush_copies`)"
        );
        if acked {
            stream = ACK_STREAM;
        } else if waits && stream == ACK_STREAM {
            stream = Stream::Comm(1 % ferry_device::COMM_STREAMS);
        }
        let bytes: usize = ops.iter().map(|(op, _)| op.len).sum();
        let timed = self.begin_op(dev, stream);
        let batch: SmallVec<[BatchCopy; 8]> = ops
            .iter()
            .map(|(op, _)| BatchCopy {
                dst: op.dst,
                src: op.src,
                len: op.len,
            })
            .collect();
        let c = self.counters.device(dev);
        let waits = match wait {
            None => Ok(()),
            Some(Wait::Seen) => {
                c.offers_seen.fetch_add(ops.len() as u64, Relaxed);
                Ok(())
            }
            Some(Wait::Device) => {
                c.offers_waited.fetch_add(ops.len() as u64, Relaxed);
                let (at, value) = ops
                    .iter()
                    .filter_map(|(op, _)| op.after)
                    .reduce(|a, b| if b.1 > a.1 { b } else { a })
                    .expect("a batch that waits has a signal");
                self.b.wait_signal(dev, stream, at, value)
            }
        };
        // SAFETY: the transfer layer keeps both ends alive (pinned blocks, bounce slots and host
        // buffers captured by `then`) until `then` runs after the event; only independent copies
        // (distinct reserved destinations) come in batches of more than one.
        let acks: SmallVec<[(Mem, u64); 8]> = ops.iter().filter_map(|(op, _)| op.ack).collect();
        let r = waits
            .and_then(|_| unsafe {
                // Acknowledged pulls: copies and words in one launch where the backend can.
                if !acks.is_empty() && self.b.copy_batch_acked(dev, stream, &batch, &acks)? {
                    return Ok(true);
                }
                match batch.as_slice() {
                    [one] => self.b.copy(dev, stream, one.dst, one.src, one.len),
                    many => self.b.copy_batch(dev, stream, many),
                }
                .map(|_| false)
            })
            .and_then(|written| {
                for &(at, value) in &acks {
                    if !written {
                        self.b.write_signal(dev, stream, at, value)?;
                    }
                    self.counters.device(dev).acks_written.fetch_add(1, Relaxed);
                }
                Ok(())
            })
            .and_then(|_| self.b.record(dev, stream));
        let event = match r {
            Ok(e) => Arc::new(e),
            Err(e) => {
                // The copies may have been enqueued before the step that failed (a word's
                // write, the event): their reserved blocks are unpinned below, so none may
                // still be written into. (After a device fault this returns the fault at once.)
                let _ = self.b.sync_stream(dev, stream);
                return self.fail_copies(ops, e);
            }
        };
        if ops.len() > 1 {
            let c = self.counters.device(dev);
            c.copy_batches.fetch_add(1, Relaxed);
            c.batched_copies.fetch_add(ops.len() as u64, Relaxed);
        }
        // The GPU timeline shows a batch as one span of all its bytes, on the first copy.
        let mut timed = timed.map(|e| (e, bytes));
        for (mut op, then) in ops {
            let ahead = op.ahead.take().and_then(|a| self.launch_behind(dev, &event, a));
            if op.counted {
                self.count(op.path, op.len);
            }
            self.clock.start(op.path);
            self.xfer.copies.push_back(CopyInFlight {
                event: event.clone(),
                dev,
                stream,
                path: op.path,
                then,
                timed: timed.take(),
                ahead,
                fills: op.fills,
            });
        }
    }

    /// comm-in ahead: releases the consumers of the copy filling `a.copy` on `dev`, bound to
    /// `dev`, and if it released any, announces the copy as arriving with `event`: their
    /// streams wait for `event`, and they are finalized only once the copy has completed
    /// (`poll_copies` withdraws the announcement first). The released consumers are posted to
    /// this thread, so they see the announcement however it is ordered here. Returns what to
    /// withdraw then, `None` when no consumer was released.
    fn launch_behind(&mut self, dev: usize, event: &Arc<B::Event>, a: Ahead) -> Option<(u64, (usize, usize))> {
        if !self.timed(Phase::Callbacks, |_| (a.release)(dev)) {
            return None;
        }
        self.counters.device(dev).comm_in_ahead.fetch_add(1, Relaxed);
        let k = key(&a.copy, dev);
        self.fly.arriving.insert(k, event.clone());
        self.fly.launched.insert(a.key, event.clone());
        Some((a.key, k))
    }

    /// Withdraws what [`Manager::launch_behind`] announced for a copy that has completed
    /// (or failed: its early consumers are then finalized with whatever the block holds, and
    /// the receive fails with the copy's error, which fails the run).
    fn withdraw(&mut self, ahead: Option<(u64, (usize, usize))>, event: &Arc<B::Event>) {
        if let Some((k, tile)) = ahead {
            self.fly.launched.remove(&k);
            if self.fly.arriving.get(&tile).is_some_and(|e| Arc::ptr_eq(e, event)) {
                self.fly.arriving.remove(&tile);
            }
        }
    }

    /// comm-in ahead: the keys of copies in flight whose consumers, launched behind them, have
    /// completed — and so have the copies, which their streams waited for. When both have
    /// finished by the time this thread looks (it is busy), one query of the consumer's event
    /// settles both, instead of one for each (≈ 1.4 µs per query that finds its event
    /// complete on H200). Per exec queue, the newest task that follows such a copy is asked;
    /// complete, every task before it in the queue is too (marked, so not asked again).
    pub(super) fn consumers_done(&mut self) -> SmallVec<[u64; 8]> {
        let mut keys = SmallVec::new();
        if !self.xfer.copies.iter().any(|c| c.ahead.is_some()) {
            return keys;
        }
        let follows = |launched: &rustc_hash::FxHashMap<u64, _>, r: &super::Running<B::Event>| {
            r.task
                .after
                .iter()
                .any(|k| *k >= COMM_IN_KEYS && launched.contains_key(k))
        };
        for q in 0..self.fly.running.len() {
            let Some(i) = self.fly.running[q]
                .iter()
                .rposition(|r| !r.done && follows(&self.fly.launched, r))
            else {
                continue;
            };
            if !matches!(self.b.done(&self.fly.running[q][i].exec), Ok(true)) {
                continue;
            }
            for r in self.fly.running[q].iter_mut().take(i + 1) {
                r.done = true;
                keys.extend(r.task.after.iter().copied().filter(|k| *k >= COMM_IN_KEYS));
            }
        }
        keys
    }

    /// Completes the copies whose events have passed, in issue order (the chunks of one staged
    /// send are issued on one stream, so their sends are posted in order); `implied`: keys of
    /// comm-in-ahead copies known complete without a query (`consumers_done`). Returns whether
    /// any completed.
    pub(super) fn poll_copies(&mut self, implied: &[u64]) -> bool {
        let mut any = false;
        let implied_done = |c: &CopyInFlight<B::Event>| c.ahead.is_some_and(|(k, _)| implied.contains(&k));
        // A stream whose older copy is still running: its later copies wait for their turn even if
        // their events pass meanwhile, so completions of one stream are reported in order.
        // Inline: this runs on every pass while copies are in flight, spinning passes included,
        // and a heap allocation per pass was most of the allocations per IPC transfer.
        let mut blocked: SmallVec<[(usize, Stream); 8]> = SmallVec::new();
        // The last event found complete: the other copies of its batch need no query.
        let mut passed: Option<Arc<B::Event>> = None;
        // As for tasks (`Manager::poll`): per stream holding several copies, the newest is asked
        // first; when it has passed, the copies of the stream there now need no query of their
        // own (their count, since callbacks run below).
        let mut settled: SmallVec<[((usize, Stream), usize); 8]> = SmallVec::new();
        // An event just found pending (the copies of a batch share one): not asked again in
        // this pass.
        let mut pending: Option<Arc<B::Event>> = None;
        for c in self.xfer.copies.iter().rev() {
            let at = (c.dev, c.stream);
            if !settled.iter().any(|(s, _)| *s == at) {
                let n = self.xfer.copies.iter().filter(|x| (x.dev, x.stream) == at).count();
                let state = if n > 1 && implied_done(c) {
                    Some(Ok(true))
                } else if n > 1 {
                    Some(self.b.done(&c.event))
                } else {
                    None
                };
                // Only an event known to be running is skipped below: one whose query failed
                // is asked again there, and its copies fail with the error.
                if matches!(state, Some(Ok(false))) {
                    pending = Some(c.event.clone());
                }
                let done = matches!(state, Some(Ok(true)));
                settled.push((at, if done { n } else { 0 }));
            }
        }
        let mut k = 0;
        while k < self.xfer.copies.len() {
            let c = &self.xfer.copies[k];
            if blocked.contains(&(c.dev, c.stream)) {
                k += 1;
                continue;
            }
            let known = settled
                .iter_mut()
                .find(|(s, n)| *s == (c.dev, c.stream) && *n > 0)
                .map(|(_, n)| *n -= 1)
                .is_some();
            let done = if known || passed.as_ref().is_some_and(|p| Arc::ptr_eq(p, &c.event)) {
                Some(Ok(()))
            } else if implied_done(c) {
                passed = Some(c.event.clone());
                Some(Ok(()))
            } else if pending.as_ref().is_some_and(|p| Arc::ptr_eq(p, &c.event)) {
                None
            } else {
                match self.b.done(&c.event) {
                    Ok(true) => {
                        passed = Some(c.event.clone());
                        Some(Ok(()))
                    }
                    Ok(false) => None,
                    Err(e) => Some(Err(e)),
                }
            };
            match done {
                Some(r) => {
                    let mut c = self.xfer.copies.remove(k).expect("index checked");
                    self.withdraw(c.ahead.take(), &c.event);
                    self.clock.stop(c.path, &self.counters.traffic);
                    if let Some((start, bytes)) = c.timed.take() {
                        let info = super::timeline::OpInfo {
                            op: c.path.name(),
                            seq: 0,
                            bytes: bytes as u64,
                        };
                        self.end_op(c.dev, c.stream, Some(start), &c.event, info);
                    }
                    if let Some(f) = c.fills.take() {
                        self.settle_fill(f, c.dev, r.is_ok());
                    }
                    any = true;
                    self.timed(Phase::Callbacks, |_| (c.then)(r));
                }
                None => {
                    blocked.push((c.dev, c.stream));
                    k += 1;
                }
            }
        }
        any
    }

    /// Fails every copy in flight or not yet enqueued (shutdown after an error).
    pub(super) fn abandon_copies(&mut self) {
        // Pins are lowered without `unpin`'s retry of the tasks waiting for memory: the manager
        // has decided to stop, and must not launch anything now.
        let held: Vec<_> = self.xfer.held.take_all().flatten().collect();
        for (op, then) in std::mem::take(&mut self.xfer.pending_copies).into_iter().chain(held) {
            if let Some(f) = op.fills {
                f.copy.lock().dev[op.dev].pins -= 1;
            }
            then(Err(DeviceError::Body("runtime shut down".into())));
        }
        for c in std::mem::take(&mut self.xfer.copies) {
            self.withdraw(c.ahead, &c.event);
            if let Some(f) = c.fills {
                f.copy.lock().dev[c.dev].pins -= 1;
            }
            (c.then)(Err(DeviceError::Body("runtime shut down".into())));
        }
    }
}

#[cfg(test)]
mod tests;
