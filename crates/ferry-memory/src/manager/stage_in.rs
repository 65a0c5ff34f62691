//! Stage-in: the tiles a task reads reach its device before its kernel runs.
//!
//! Each tile read and not valid on the task's device comes, in this order of preference, from
//! a device that is staging it in now (wait for that, then a peer copy), from a device holding
//! it with a peer link (peer copy), from the host (H2D), or — valid only on a device without a
//! link — through the host (D2H, then H2D). A tile already arriving on the device for another
//! task (or being written there by a task launched ahead) is waited for, never copied twice.
//! Every copy goes on the device's input stream, behind one event the exec stream waits for.

use super::{key, GpuTask, Manager};
use crate::data::buffer::TileBuf;
use crate::data::copy::{CopyState, TileCopy};
use ferry_base::traffic::TrafficPath;
use ferry_device::{Backend, DeviceError, Stream};
use smallvec::SmallVec;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Events a launch waits for (inline: made for every GPU task, on the manager thread).
pub(super) type Waits<E> = SmallVec<[Arc<E>; 4]>;

/// What [`Manager::stage_in`] enqueued.
pub(super) struct StagedIn<E> {
    /// The input stream's event after the copies (`None` when nothing was copied).
    pub(super) staged: Option<Arc<E>>,
    /// The paths the copies took (their active clocks run until `staged`).
    pub(super) staging: SmallVec<[TrafficPath; 4]>,
    /// Source copies of peer and device→host copies, pinned on their device.
    pub(super) sources: Vec<(Arc<TileCopy>, usize)>,
    /// Events the exec stream must wait for: `staged`, and tiles arriving for others (taken by
    /// the launch for `exec`).
    pub(super) waits: Waits<E>,
    /// Host buffers read by H2D copies: alive until the task ends.
    pub(super) keep: Vec<Arc<TileBuf>>,
    /// The stage-in's start event and bytes (GPU timeline).
    pub(super) stage_timed: Option<(E, u64)>,
}

impl<B: Backend> Manager<B> {
    /// Stage-in of `t` on `d` (its blocks are allocated): every tile it reads that is not
    /// valid there is copied in on the input stream — over a peer link from another device
    /// that holds it or is staging it in, else from the host (through the host when only a
    /// device without a link holds it) — or waited for when it is already arriving. What the
    /// exec stream must wait for is in [`StagedIn::waits`].
    ///
    /// # Errors
    /// A failed driver call; the pins already taken on source copies stay (as before the
    /// task fails).
    pub(super) fn stage_in(&mut self, d: usize, t: &GpuTask) -> Result<StagedIn<B::Event>, DeviceError> {
        let stage_span =
            tracing::info_span!("gpu.stage_in", class = t.kernel.name(), seq = t.seq, device = d).entered();
        let mut staging = SmallVec::new();
        let mut sources = Vec::new();
        let mut waits = Waits::new();
        let mut keep = Vec::new();
        let mut copied: SmallVec<[usize; 4]> = SmallVec::new();
        // GPU timeline: the stage-in's start (before its first copy) and its bytes.
        let mut stage_timed: Option<(B::Event, u64)> = None;
        for (k, x) in t.tiles.iter().enumerate() {
            if !x.mode.reads() {
                continue;
            }
            let s = x.copy.lock();
            if s.dev[d].valid {
                continue;
            }
            if let Some(ev) = self.fly.arriving.get(&key(&x.copy, d)) {
                waits.push(ev.clone());
                continue;
            }
            let dst = s.dev[d].block.expect("allocated").offset;
            let bytes = x.copy.bytes();
            let peer = if self.tune.peer_copies {
                self.best_peer(&s, d)
            } else {
                None
            };
            let pending = if peer.is_none() && self.tune.peer_copies {
                self.arriving_elsewhere(&x.copy, d)
            } else {
                None
            };
            if let Some((e, ev)) = pending {
                // Another device is staging this very data in: wait for it there and copy it
                // over the peer link, rather than a second host→device copy.
                let mut s = s;
                let src = s.dev[e].block.expect("a tile being staged in has a block").offset;
                s.dev[e].pins += 1;
                drop(s);
                sources.push((x.copy.clone(), e));
                self.b.wait(d, Stream::In, &ev)?;
                self.begin_stage(d, &mut stage_timed, bytes);
                // SAFETY: as for a peer copy below; the stream waits for the source's stage-in.
                unsafe { self.b.peer_pending(d, Stream::In, dst, e, src, bytes)? };
                self.count_peer(e, d, bytes);
                staging.push(TrafficPath::DevicePeer);
            } else if let Some(e) = peer {
                let src = s.dev[e].block.expect("valid copies have a block").offset;
                let mut s = s;
                s.dev[e].pins += 1;
                drop(s);
                sources.push((x.copy.clone(), e));
                self.begin_stage(d, &mut stage_timed, bytes);
                // SAFETY: both blocks are allocated and the source is valid (not written while a
                // reader runs); the copies stay alive while the task runs.
                unsafe { self.b.peer(d, Stream::In, dst, e, src, bytes)? };
                self.count_peer(e, d, bytes);
                staging.push(TrafficPath::DevicePeer);
            } else if s.host_valid {
                self.count_duplicate(&x.copy, &s, d);
                let mut s = s;
                let host = s.host_buf(bytes);
                drop(s);
                self.begin_stage(d, &mut stage_timed, bytes);
                // SAFETY: `keep` holds the host buffer until the task ends.
                unsafe { self.b.h2d(d, Stream::In, dst, host.as_ptr(), bytes)? };
                keep.push(host);
                self.count(TrafficPath::HostToDevice, bytes);
                staging.push(TrafficPath::HostToDevice);
            } else {
                // Valid only on a device without a peer link to `d` (or peer copies are off):
                // through the host.
                self.count_duplicate(&x.copy, &s, d);
                let e = (0..s.dev.len())
                    .find(|&e| s.dev[e].valid)
                    .ok_or_else(|| DeviceError::Body("tile has no valid copy".into()))?;
                let src = s.dev[e].block.expect("valid copies have a block").offset;
                let mut s = s;
                s.dev[e].pins += 1;
                drop(s);
                sources.push((x.copy.clone(), e));
                let host = x.copy.lock().host_buf(bytes);
                // SAFETY: as above; the In stream of `d` waits for the D2H event.
                unsafe { self.b.d2h(e, Stream::Out, host.as_ptr(), src, bytes)? };
                let ev = self.b.record(e, Stream::Out)?;
                self.b.wait(d, Stream::In, &ev)?;
                self.begin_stage(d, &mut stage_timed, bytes);
                // SAFETY: as above.
                unsafe { self.b.h2d(d, Stream::In, dst, host.as_ptr(), bytes)? };
                keep.push(host);
                self.count(TrafficPath::DeviceToHost, bytes);
                self.count(TrafficPath::HostToDevice, bytes);
                // Both legs are in flight until the stage-in event: both paths' clocks run.
                staging.push(TrafficPath::DeviceToHost);
                staging.push(TrafficPath::HostToDevice);
            }
            copied.push(k);
        }
        let staged = if copied.is_empty() {
            None
        } else {
            let ev = Arc::new(self.b.record(d, Stream::In)?);
            for &k in &copied {
                self.fly.arriving.insert(key(&t.tiles[k].copy, d), ev.clone());
            }
            waits.push(ev.clone());
            Some(ev)
        };
        drop(stage_span);
        Ok(StagedIn {
            staged,
            staging,
            sources,
            waits,
            keep,
            stage_timed,
        })
    }

    /// GPU timeline: the stage-in of a task starts before its first copy; counts its bytes.
    fn begin_stage(&mut self, d: usize, timed: &mut Option<(B::Event, u64)>, bytes: usize) {
        match timed {
            Some((_, total)) => *total += bytes as u64,
            None => *timed = self.begin_op(d, Stream::In).map(|e| (e, bytes as u64)),
        }
    }

    /// The device to copy a tile valid on several devices from, into `d`: the best link
    /// (the backend's rank: NVLink before PCIe), then the least loaded source — never plain
    /// index order, which sends every copy through device 0.
    fn best_peer(&self, s: &CopyState, d: usize) -> Option<usize> {
        (0..s.dev.len())
            .filter(|&e| e != d && s.dev[e].valid && s.dev[e].block.is_some())
            .filter_map(|e| self.b.link_rank(e, d).map(|r| (r, self.adm.load[e], e)))
            .min()
            .map(|(_, _, e)| e)
    }

    /// A device with a peer link to `d` that is staging `copy` in now, and the event that ends it.
    fn arriving_elsewhere(&self, copy: &Arc<TileCopy>, d: usize) -> Option<(usize, Arc<B::Event>)> {
        (0..self.mem.pools.len())
            .filter(|&e| e != d)
            .filter_map(|e| Some((self.b.link_rank(e, d)?, e)))
            .filter_map(|(r, e)| self.fly.arriving.get(&key(copy, e)).map(|ev| (r, e, ev.clone())))
            .min_by_key(|(r, e, _)| (*r, *e))
            .map(|(_, e, ev)| (e, ev))
    }

    /// Counts a host→device stage-in of data that a linked device holds or is staging in: what
    /// a peer copy would have saved (peer copies off, or a race with eviction).
    fn count_duplicate(&self, copy: &Arc<TileCopy>, s: &CopyState, d: usize) {
        let linked = (0..s.dev.len()).any(|e| {
            e != d && self.b.peer_link(e, d) && (s.dev[e].valid || self.fly.arriving.contains_key(&key(copy, e)))
        });
        if linked {
            self.counters.device(d).host_duplicates.fetch_add(1, Relaxed);
        }
    }

    fn count_peer(&mut self, from: usize, to: usize, bytes: usize) {
        self.count(TrafficPath::DevicePeer, bytes);
        if let Some(c) = self.counters.device(to).peer_from.get(from) {
            c.fetch_add(bytes as u64, Relaxed);
        }
    }
}
