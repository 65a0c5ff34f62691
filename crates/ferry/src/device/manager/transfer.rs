//! The device side of transfers between ranks: comm-in reservations, pins that keep a source
//! block in place while a send or a peer process reads it, and asynchronous copies whose
//! completion the transfer layer waits for (chunks through bounce buffers, IPC pulls).
//!
//! The manager knows neither ranks nor messages here: it reserves, pins and copies on request
//! and calls back when an event has completed.

use super::{Manager, Then, ALIGN};
use crate::data::copy::TileCopy;
use crate::device::{Backend, DeviceError, Mem, Stream};
use crate::stats::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// A pinned device block of a copy: where a transfer reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    /// Local device index.
    pub(crate) dev: usize,
    /// Offset of the block in the device's pool.
    pub(crate) offset: u64,
    /// Device address of the block (what a CUDA-aware MPI receives).
    pub(crate) addr: u64,
}

/// Called on the manager thread with the outcome of a reservation or pin.
pub(crate) type OnPlaced = Box<dyn FnOnce(Option<Placed>) + Send>;

/// An asynchronous copy for a transfer.
pub(crate) struct CopyOp {
    pub(crate) dev: usize,
    pub(crate) stream: Stream,
    pub(crate) dst: Mem,
    pub(crate) src: Mem,
    pub(crate) len: usize,
    /// The path whose active time the copy counts towards.
    pub(crate) path: Path,
    /// Whether its bytes and one operation are counted on `path` too (IPC pulls are counted by
    /// the transfer layer as whole tiles).
    pub(crate) counted: bool,
}

/// A copy in flight and who to tell.
pub(super) struct CopyInFlight<E> {
    event: E,
    dev: usize,
    stream: Stream,
    path: Path,
    then: Then,
    /// Its start event and bytes (GPU timeline).
    timed: Option<(E, usize)>,
}

impl<B: Backend> Manager<B> {
    /// comm-in: reserves and pins a block for `copy` on the least loaded device that has room
    /// (evicting unpinned copies if needed). `None` when no device can take it now: the transfer
    /// then lands in host memory rather than wait, because a receive that waits for device memory
    /// could hold up its sender's window (see `comm/window.rs`).
    pub(super) fn reserve(&mut self, copy: &Arc<TileCopy>) -> Option<Placed> {
        let n = self.pools.len();
        let bytes = copy.bytes() as u64;
        let need = bytes.div_ceil(ALIGN) * ALIGN;
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&d| {
            (
                self.load[d],
                std::cmp::Reverse(self.pools[d].capacity() - self.pools[d].used()),
            )
        });
        for d in order {
            if need > self.pools[d].capacity() {
                continue;
            }
            let mut block = (!self.b.fail_alloc(d)).then(|| self.pools[d].alloc(bytes)).flatten();
            if block.is_none() && self.evict(d, need) {
                block = self.pools[d].alloc(bytes);
            }
            let Some(block) = block else {
                self.counters.device(d).alloc_failures.fetch_add(1, Relaxed);
                continue;
            };
            let mut s = copy.lock();
            if let Some(old) = s.dev[d].block.replace(block) {
                // A fresh copy has no block; keep the invariant anyway.
                drop(s);
                self.pools[d].free(old);
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

    /// Releases a pin taken by [`Manager::reserve`] or by the transfer layer.
    pub(super) fn unpin(&mut self, copy: &Arc<TileCopy>, dev: usize) {
        copy.lock().dev[dev].pins -= 1;
        if !self.waiting.is_empty() {
            self.retry_waiting();
        }
    }

    /// Data arrived in the reserved block on `dev` as version `generation`: the pin is released
    /// and the copy joins the LRU.
    pub(super) fn landed(&mut self, copy: &Arc<TileCopy>, dev: usize, generation: u64) {
        let mut s = copy.lock();
        // Validity was set by the transfer layer before it released the consumers, which may
        // already have written a newer version (on the host, or here): setting it again now
        // would mark stale data current. Only the debugging hash is still due, for this version.
        if crate::config::check_coherence() && s.generation == generation {
            s.debug_hash = s.dev[dev]
                .block
                .and_then(|b| self.b.debug_hash(dev, b.offset, copy.bytes()));
        }
        s.dev[dev].pins -= 1;
        self.next_stamp += 1;
        s.dev[dev].lru_stamp = self.next_stamp;
        drop(s);
        self.lru[dev].push_back((Arc::downgrade(copy), self.next_stamp));
        if !self.waiting.is_empty() {
            self.retry_waiting();
        }
    }

    /// Enqueues a copy and calls `then` when it has completed.
    pub(super) fn start_copy(&mut self, op: CopyOp, then: Then) {
        // SAFETY: the transfer layer keeps both ends alive (pinned blocks, bounce slots and host
        // buffers captured by `then`) until `then` runs after the event.
        let timed = self.begin_op(op.dev, op.stream).map(|e| (e, op.len));
        let r = unsafe { self.b.copy(op.dev, op.stream, op.dst, op.src, op.len) }
            .and_then(|_| self.b.record(op.dev, op.stream));
        match r {
            Ok(event) => {
                if op.counted {
                    self.count(op.path, op.len);
                }
                self.clock.start(op.path);
                self.copies.push_back(CopyInFlight {
                    event,
                    dev: op.dev,
                    stream: op.stream,
                    path: op.path,
                    then,
                    timed,
                });
            }
            Err(e) => then(Err(e)),
        }
    }

    /// Completes the copies whose events have passed, in issue order (the chunks of one staged
    /// send are issued on one stream, so their sends are posted in order). Returns whether any
    /// completed.
    pub(super) fn poll_copies(&mut self) -> bool {
        let mut any = false;
        // A stream whose older copy is still running: its later copies wait for their turn even if
        // their events pass meanwhile, so completions of one stream are reported in order.
        let mut blocked: Vec<(usize, Stream)> = Vec::new();
        let mut k = 0;
        while k < self.copies.len() {
            let c = &self.copies[k];
            if blocked.contains(&(c.dev, c.stream)) {
                k += 1;
                continue;
            }
            let done = match self.b.done(&c.event) {
                Ok(d) => d.then_some(Ok(())),
                Err(e) => Some(Err(e)),
            };
            match done {
                Some(r) => {
                    let c = self.copies.remove(k).expect("index checked");
                    self.clock.stop(c.path, &self.counters);
                    if let Some((start, bytes)) = c.timed {
                        let info = super::timeline::OpInfo {
                            op: c.path.name(),
                            seq: 0,
                            bytes: bytes as u64,
                        };
                        self.end_op(c.dev, c.stream, Some(start), &c.event, info);
                    }
                    (c.then)(r);
                    any = true;
                }
                None => {
                    blocked.push((c.dev, c.stream));
                    k += 1;
                }
            }
        }
        any
    }

    /// Fails every copy in flight (shutdown after an error).
    pub(super) fn abandon_copies(&mut self) {
        for c in self.copies.drain(..) {
            (c.then)(Err(DeviceError::Body("runtime shut down".into())));
        }
    }
}
