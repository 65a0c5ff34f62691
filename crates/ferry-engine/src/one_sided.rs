//! Put and get between registered regions, over two-sided MPI.
//!
//! **Get** (origin reads the target's region): the origin posts the receive of the payload into
//! its own region under a fresh tag, then asks the target (`GetRequest`); the target checks the
//! handle and range and sends the bytes with that tag. Once they have landed, the origin sends
//! the notification to the target's handler (its data has been read) and runs its completion.
//! A target that refuses (a stale handle, a range outside the region) says why (`GetRefused`)
//! and sends 0 bytes with the tag, so that the origin's receive ends; the two travel on
//! different communicators, so the origin waits for both before it reports the refusal.
//!
//! **Put** (origin writes the target's region): the origin sends the request with the
//! notification (`PutRequest`) and the payload under a fresh tag; the target posts the receive
//! into its region, and once the bytes have landed delivers the notification to its own handler
//! and answers (`PutDone`). The origin's completion runs when its send has completed and the
//! answer is in: the data is in place at the target. A refused put is received into scratch
//! memory (so the payload does not block the pair) and answered with the reason.
//!
//! Payloads travel on their own communicator ([`ferry_comm::Channel::OneSided`]) under tags
//! that the origin numbers round-robin, even for gets and odd for puts: two operations in
//! flight between one pair never share a tag, whichever rank started them.

use crate::delivery::Delivery;
use crate::engine::{check_payload, check_user_tag, Completion, EngineHandle, Notify, Shared};
use crate::error::{EngineError, Result};
use crate::handle::MemHandle;
use crate::registry::Pinned;
use crate::staged::Pool;
use crate::stats::Counters;
use crate::wire::{self, Request};
use crate::AmMessage;
use ferry_base::error::{FerryError, Rank};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// A one-sided operation waiting for its peer.
pub(crate) enum Pending {
    Get {
        done: Completion,
        len: usize,
        notify: Option<Notify>,
        /// The target's reason, when it refused.
        refused: Option<String>,
        /// The payload ended with 0 bytes (a refusal whose reason is still on its way).
        landed_empty: bool,
        /// The local region, for a peer copy (the IPC route; `ipc.rs`).
        ipc: Option<Pinned>,
    },
    Put {
        done: Completion,
        len: usize,
        /// The local region, for a peer copy (the IPC route; `ipc.rs`).
        ipc: Option<Pinned>,
        /// The local send's outcome, once known.
        sent: Option<std::result::Result<(), FerryError>>,
        /// The target's answer, once in.
        answered: Option<std::result::Result<(), String>>,
    },
}

impl Pending {
    /// Ends the operation with `e`.
    pub(crate) fn fail(self, e: EngineError, delivery: &Delivery) {
        let done = match self {
            Pending::Get { done, .. } | Pending::Put { done, .. } => done,
        };
        delivery.deliver(Box::new(move || done(Err(e))));
    }
}

fn tags_exhausted(peer: Rank) -> EngineError {
    EngineError::InvalidArgument(format!(
        "more one-sided operations in flight to rank {peer} than payload tags"
    ))
}

fn check_notify(n: &Option<Notify>) -> Result<()> {
    if let Some(n) = n {
        check_user_tag(n.tag)?;
        check_payload(n.bytes.len())?;
    }
    Ok(())
}

impl EngineHandle {
    /// Reads `len` bytes at `remote_offset` of `remote` (another rank's registration, or this
    /// rank's) into `local` at `local_offset`. `done` runs once the bytes have landed (or the
    /// operation failed); then, with `notify`, the target's handler for `notify.tag` receives
    /// `notify.bytes` (its data has been read).
    ///
    /// # Errors
    /// Returned at once, with nothing started: [`EngineError::OutOfBounds`] or
    /// [`EngineError::InvalidArgument`] (0 bytes) for either range, [`EngineError::WrongOwner`]
    /// when `local` is not this rank's, [`EngineError::NotRegistered`] for a stale `local`,
    /// [`EngineError::ForeignHandle`], [`EngineError::TagOutOfRange`],
    /// [`EngineError::PayloadTooLarge`] for the notification, [`EngineError::Finalized`],
    /// [`EngineError::Device`] when a staged transfer of device memory needs this rank's bounce
    /// buffers and they cannot be pinned (pinned memory exhausted).
    /// Through `done`: [`EngineError::Remote`] when the target refused (a stale handle, a range
    /// outside the registration, its own bounce buffers that cannot be pinned),
    /// [`EngineError::Comm`] when MPI failed.
    #[allow(clippy::too_many_arguments)]
    pub fn get(
        &self,
        local: &MemHandle,
        local_offset: usize,
        remote: &MemHandle,
        remote_offset: usize,
        len: usize,
        notify: Option<Notify>,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) -> Result<()> {
        self.get_ordered(
            local,
            local_offset,
            remote,
            remote_offset,
            len,
            notify,
            None,
            Box::new(done),
        )
    }

    /// A get, stream-ordered on `stream` when given (`stream.rs`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn get_ordered(
        &self,
        local: &MemHandle,
        local_offset: usize,
        remote: &MemHandle,
        remote_offset: usize,
        len: usize,
        notify: Option<Notify>,
        stream: Option<u64>,
        done: Completion,
    ) -> Result<()> {
        let s = self.shared();
        let Started {
            region,
            peer,
            device,
            ipc,
            chunked,
            request,
        } = s.start(
            local,
            local_offset,
            remote,
            remote_offset,
            len,
            &notify,
            false,
            stream.is_some(),
        )?;
        if let Some(lease) = ipc.then(|| s.lease(remote)).flatten() {
            return s.leased_copy(region, lease, peer, remote_offset, false, notify, stream, done);
        }
        let single = stream
            .is_none()
            .then(|| s.cma_route(device, remote, peer, len))
            .flatten();
        if let Some((pid, lease)) = single.and_then(|pid| Some((pid, s.lease(remote)?))) {
            return s.single_copy(region, lease, peer, pid, remote_offset, false, notify, done);
        }
        // Any other route: the stream waits on a word written when the get completes.
        let word = match (stream, device) {
            (Some(st), Some(d)) => Some(
                s.staging_or_error()?
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .stream_word(d, st)?,
            ),
            _ => None,
        };
        let done: Completion = match word {
            Some(w) => Box::new(move |r| {
                crate::stream::signal(w);
                done(r)
            }),
            None => done,
        };
        let started = s.post_get(region, peer, device, ipc, chunked, request, len, notify, done);
        if let (Err(_), Some(w)) = (&started, word) {
            crate::stream::signal(w);
        }
        started
    }
}

impl Shared {
    /// The rest of a get on the grant protocol or a payload route (the local range pinned, the
    /// request made).
    #[allow(clippy::too_many_arguments)]
    fn post_get(
        self: &Arc<Self>,
        region: Pinned,
        peer: Rank,
        device: Option<usize>,
        ipc: bool,
        chunked: bool,
        request: Request,
        len: usize,
        notify: Option<Notify>,
        done: Completion,
    ) -> Result<()> {
        let s = self;
        let data_tag = request.data_tag;
        let (region, ipc_region) = if ipc {
            (None, Some(region))
        } else {
            (Some(region), None)
        };
        s.insert(
            peer,
            data_tag,
            Pending::Get {
                done,
                len,
                notify,
                refused: None,
                // A peer copy posts no receive: a refusal ends the operation at once.
                landed_empty: ipc,
                ipc: ipc_region,
            },
        )?;
        let s2 = s.clone();
        let landed = Box::new(move |r| s2.on_get_landed(peer, data_tag, r));
        let mut msg = Vec::with_capacity(32);
        request.encode(&mut msg);
        let posted = match region {
            Some(region) => s.recv_payload(Arc::new(region), device, peer, data_tag, chunked, landed),
            None => Ok(()),
        }
        .and_then(|_| s.post_am(peer, wire::GET_REQUEST, msg));
        if let Err(e) = posted {
            s.take_pending(peer, data_tag);
            return Err(e);
        }
        Ok(())
    }
}

impl EngineHandle {
    /// Writes `len` bytes at `local_offset` of `local` into `remote` at `remote_offset`. `done`
    /// runs once the bytes are in place at the target (its answer is in; a peer copy under a
    /// lease without notification needs none: its completion is the proof) or the operation
    /// failed; before it answers, the target's handler for `notify.tag` receives `notify.bytes`.
    ///
    /// # Errors
    /// As [`EngineHandle::get`].
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &self,
        local: &MemHandle,
        local_offset: usize,
        remote: &MemHandle,
        remote_offset: usize,
        len: usize,
        notify: Option<Notify>,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) -> Result<()> {
        let s = self.shared();
        let Started {
            region,
            peer,
            device,
            ipc,
            chunked,
            request,
        } = s.start(local, local_offset, remote, remote_offset, len, &notify, true, false)?;
        if let Some(lease) = ipc.then(|| s.lease(remote)).flatten() {
            return s.leased_copy(region, lease, peer, remote_offset, true, notify, None, Box::new(done));
        }
        let single = s.cma_route(device, remote, peer, len);
        if let Some((pid, lease)) = single.and_then(|pid| Some((pid, s.lease(remote)?))) {
            return s.single_copy(region, lease, peer, pid, remote_offset, true, notify, Box::new(done));
        }
        let data_tag = request.data_tag;
        let mut msg = Vec::with_capacity(48);
        request.encode(&mut msg);
        wire::encode_notify(&mut msg, notify.as_ref().map(|n| (n.tag, n.bytes.as_slice())));
        s.insert(
            peer,
            data_tag,
            Pending::Put {
                done: Box::new(done),
                len,
                // A peer copy's answer comes after the copy: it alone ends the operation.
                sent: ipc.then_some(Ok(())),
                answered: None,
                ipc: None,
            },
        )?;
        let s2 = s.clone();
        let sent = Box::new(move |r| s2.on_put_sent(peer, data_tag, r));
        let posted = if ipc {
            s.set_ipc_region(peer, data_tag, region);
            s.post_am(peer, wire::PUT_REQUEST, msg)
        } else {
            // Bounce buffers pinned before the request: once it is out, the target waits for
            // the payload.
            s.stage_ready(device, chunked, Pool::Send)
                .and_then(|_| s.post_am(peer, wire::PUT_REQUEST, msg))
                .and_then(|_| s.send_payload(Arc::new(region), device, peer, data_tag, chunked, sent))
        };
        if let Err(e) = posted {
            s.take_pending(peer, data_tag);
            return Err(e);
        }
        Ok(())
    }
}

/// A put or get that passed its checks: the local range pinned, the route, and the request.
struct Started {
    region: Pinned,
    peer: Rank,
    device: Option<usize>,
    ipc: bool,
    chunked: bool,
    request: Request,
}

impl Shared {
    /// The checks and choices a put and a get share: the engine open, the remote handle and
    /// range, the notification, the local range (pinned), the route and a payload tag.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        local: &MemHandle,
        local_offset: usize,
        remote: &MemHandle,
        remote_offset: usize,
        len: usize,
        notify: &Option<Notify>,
        put: bool,
        stream_ordered: bool,
    ) -> Result<Started> {
        self.check_open()?;
        self.check_am()?;
        self.check_remote(remote)?;
        remote.check_range(remote_offset, len)?;
        check_notify(notify)?;
        let region = self.registry.pin(local, local_offset, len)?;
        let peer = remote.rank;
        let device = region.device;
        let ipc = self.ipc_route(device, remote, peer);
        // A stream-ordered get never hands its destination to MPI: a CUDA-aware MPI may wait
        // for the device while the caller's stream waits for the get (seen with UCX's
        // cuda_ipc, which then never completes), so it takes the staged chunks instead, whose
        // copies are the engine's own.
        let chunked = !ipc && (self.chunked(device, remote, peer) || (stream_ordered && device.is_some()));
        let request = Request {
            id: remote.id,
            generation: remote.generation,
            offset: remote_offset as u64,
            len: len as u64,
            data_tag: self.data_tag(put),
            chunked,
            ipc,
        };
        Ok(Started {
            region,
            peer,
            device,
            ipc,
            chunked,
            request,
        })
    }

    /// Whether a payload between a local region (on `device`, or host memory) and `remote`
    /// moves in chunks through the bounce buffers: device memory on either side, and no
    /// GPU-direct between the pair.
    fn chunked(&self, device: Option<usize>, remote: &MemHandle, peer: Rank) -> bool {
        (device.is_some() || remote.kind.device().is_some()) && !self.gpu_direct_to(peer)
    }

    /// Messages of a payload of `len` bytes.
    fn messages(&self, len: u64, chunked: bool) -> usize {
        if chunked {
            (len as usize).div_ceil(self.chunk())
        } else {
            1
        }
    }

    pub(crate) fn insert(&self, peer: Rank, tag: u32, p: Pending) -> Result<()> {
        match self.try_insert(peer, tag, p) {
            None => Ok(()),
            Some(_) => Err(tags_exhausted(peer)),
        }
    }

    /// As [`Shared::insert`], for an operation already under way: when it cannot wait, it ends
    /// at once with the reason (its completion runs); whether it waits.
    pub(crate) fn insert_or_fail(&self, peer: Rank, tag: u32, p: Pending) -> bool {
        match self.try_insert(peer, tag, p) {
            None => true,
            Some(p) => {
                p.fail(tags_exhausted(peer), &self.delivery);
                false
            }
        }
    }

    /// Records `p` under `(peer, tag)`; hands it back when the tag is taken.
    fn try_insert(&self, peer: Rank, tag: u32, p: Pending) -> Option<Pending> {
        let mut m = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if m.contains_key(&(peer, tag)) {
            return Some(p);
        }
        m.insert((peer, tag), p);
        self.in_flight.pending.store(m.len(), Relaxed);
        None
    }

    pub(crate) fn take_pending(&self, peer: Rank, tag: u32) -> Option<Pending> {
        let mut m = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let p = m.remove(&(peer, tag));
        self.in_flight.pending.store(m.len(), Relaxed);
        p
    }

    /// Runs `f` on the pending operation of `(peer, tag)`; it returns whether the operation
    /// is over (then it is removed and handed back).
    pub(crate) fn update(&self, peer: Rank, tag: u32, f: impl FnOnce(&mut Pending) -> bool) -> Option<Pending> {
        let mut m = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let over = f(m.get_mut(&(peer, tag))?);
        if over {
            let p = m.remove(&(peer, tag));
            self.in_flight.pending.store(m.len(), Relaxed);
            p
        } else {
            None
        }
    }

    /// The origin's receive of a get ended (progress thread).
    pub(crate) fn on_get_landed(self: &Arc<Self>, peer: Rank, tag: u32, r: ferry_base::error::Result<()>) {
        let refusal = matches!(r, Err(FerryError::SizeMismatch { got: 0, .. }));
        let ended = self.update(peer, tag, |p| match p {
            Pending::Get {
                refused, landed_empty, ..
            } if refusal && refused.is_none() => {
                *landed_empty = true;
                false
            }
            _ => true,
        });
        let Some(Pending::Get {
            done,
            len,
            notify,
            refused,
            ..
        }) = ended
        else {
            return;
        };
        let outcome = match (r, refused) {
            (_, Some(reason)) => Err(EngineError::Remote { peer, reason }),
            (Ok(()), None) => {
                Counters::add(&self.counters.gets, 1);
                Counters::add(&self.counters.bytes_got, len as u64);
                if let Some(n) = notify {
                    match self.post_am(peer, i32::from(n.tag), n.bytes) {
                        Ok(()) => Counters::add(&self.counters.am_sent, 1),
                        Err(e) => tracing::error!(peer, "notification of a get not sent: {e}"),
                    }
                }
                Ok(())
            }
            (Err(e), None) => Err(e.into()),
        };
        self.delivery.deliver(Box::new(move || done(outcome)));
    }

    /// The target's refusal of a get (progress thread).
    pub(crate) fn on_get_refused(self: &Arc<Self>, source: Rank, bytes: &[u8]) -> Result<()> {
        let (tag, outcome) = wire::decode_reply(bytes)?;
        let reason = outcome.err().unwrap_or_default();
        let ended = self.update(source, tag, |p| match p {
            Pending::Get {
                refused, landed_empty, ..
            } => {
                *refused = Some(reason.clone());
                *landed_empty
            }
            Pending::Put { .. } => false,
        });
        if let Some(p) = ended {
            p.fail(EngineError::Remote { peer: source, reason }, &self.delivery);
        }
        Ok(())
    }

    /// A peer's get request (progress thread).
    pub(crate) fn on_get_request(self: &Arc<Self>, source: Rank, bytes: &[u8]) -> Result<()> {
        let (rq, _) = Request::decode(bytes)?;
        if rq.ipc {
            return self.grant(source, &rq, None);
        }
        // The range pinned, and the bounce buffers its payload goes through: either failure is
        // a refusal the origin hears (it has posted its receives).
        let pinned = self
            .registry
            .pin_id(rq.id, rq.generation, rq.offset as usize, rq.len as usize)
            .and_then(|region| {
                self.stage_ready(region.device, rq.chunked, Pool::Send)?;
                Ok(region)
            });
        match pinned {
            Ok(region) => {
                let s = self.clone();
                let tag = rq.data_tag;
                let sent = Box::new(move |r: ferry_base::error::Result<()>| match r {
                    Ok(()) => Counters::add(&s.counters.gets_served, 1),
                    Err(e) => {
                        // The origin received an empty chunk; it waits for the reason.
                        tracing::error!(peer = source, "payload of a get not sent: {e}");
                        let _ = s.post_am(source, wire::GET_REFUSED, wire::encode_reply(tag, Err(e.to_string())));
                    }
                });
                let device = region.device;
                self.send_payload(Arc::new(region), device, source, tag, rq.chunked, sent)
            }
            Err(e) => {
                Counters::add(&self.counters.refused, 1);
                self.post_am(
                    source,
                    wire::GET_REFUSED,
                    wire::encode_reply(rq.data_tag, Err(e.to_string())),
                )?;
                self.send_empty(source, rq.data_tag, self.messages(rq.len, rq.chunked))
            }
        }
    }

    /// A peer's put request (progress thread): the payload follows.
    pub(crate) fn on_put_request(self: &Arc<Self>, source: Rank, bytes: &[u8]) -> Result<()> {
        let (rq, rest) = Request::decode(bytes)?;
        let notify = wire::decode_notify(rest)?;
        if rq.ipc {
            return self.grant(source, &rq, Some(notify));
        }
        let s = self.clone();
        let tag = rq.data_tag;
        // As for a get: a range or bounce buffers that cannot be had refuse the put (its
        // payload, already on its way, is taken and dropped).
        let pinned = self
            .registry
            .pin_id(rq.id, rq.generation, rq.offset as usize, rq.len as usize)
            .and_then(|region| {
                self.stage_ready(region.device, rq.chunked, Pool::Recv)?;
                Ok(region)
            });
        match pinned {
            Ok(region) => {
                let landed = Box::new(move |r: ferry_base::error::Result<()>| {
                    let answer = match r {
                        Ok(()) => {
                            Counters::add(&s.counters.puts_served, 1);
                            if let Some((ntag, bytes)) = notify {
                                Counters::add(&s.counters.notifications, 1);
                                let m = AmMessage {
                                    source,
                                    tag: ntag,
                                    bytes: bytes.into(),
                                };
                                s.handlers.arrived(m, &s.delivery);
                            }
                            Ok(())
                        }
                        Err(e) => Err(e.to_string()),
                    };
                    if let Err(e) = s.post_am(source, wire::PUT_DONE, wire::encode_reply(tag, answer)) {
                        tracing::error!(peer = source, "answer to a put not sent: {e}");
                    }
                });
                let device = region.device;
                self.recv_payload(Arc::new(region), device, source, tag, rq.chunked, landed)
            }
            Err(e) => {
                Counters::add(&self.counters.refused, 1);
                let reason = e.to_string();
                // The payload is on its way: take it, into scratch, then say why.
                let landed = Box::new(move |_| {
                    if let Err(e) = s.post_am(source, wire::PUT_DONE, wire::encode_reply(tag, Err(reason))) {
                        tracing::error!(peer = source, "refusal of a put not sent: {e}");
                    }
                });
                self.discard_payload(source, tag, rq.len as usize, rq.chunked, landed)
            }
        }
    }

    /// The origin's send of a put ended (progress thread).
    fn on_put_sent(self: &Arc<Self>, peer: Rank, tag: u32, r: ferry_base::error::Result<()>) {
        let failed = r.is_err();
        let mut r = Some(r);
        let ended = self.update(peer, tag, |p| match p {
            Pending::Put { sent, answered, .. } => {
                *sent = r.take();
                answered.is_some() || failed
            }
            Pending::Get { .. } => false,
        });
        if let Some(p) = ended {
            self.finish_put(peer, p);
        }
    }

    /// The target's answer to a put (progress thread).
    pub(crate) fn on_put_done(self: &Arc<Self>, source: Rank, bytes: &[u8]) -> Result<()> {
        let (tag, outcome) = wire::decode_reply(bytes)?;
        let mut outcome = Some(outcome);
        let ended = self.update(source, tag, |p| match p {
            Pending::Put { sent, answered, .. } => {
                *answered = outcome.take();
                sent.is_some()
            }
            Pending::Get { .. } => false,
        });
        if let Some(p) = ended {
            self.finish_put(source, p);
        }
        Ok(())
    }

    fn finish_put(&self, peer: Rank, p: Pending) {
        let Pending::Put {
            done,
            len,
            sent,
            answered,
            ..
        } = p
        else {
            return;
        };
        let outcome = match (sent, answered) {
            (Some(Err(e)), _) => Err(e.into()),
            (_, Some(Err(reason))) => Err(EngineError::Remote { peer, reason }),
            _ => {
                Counters::add(&self.counters.puts, 1);
                Counters::add(&self.counters.bytes_put, len as u64);
                Ok(())
            }
        };
        self.delivery.deliver(Box::new(move || done(outcome)));
    }
}
