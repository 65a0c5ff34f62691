//! The IPC route: device memory of two ranks of one node moves by a peer copy on the origin's
//! device, from or into the target's memory mapped through CUDA IPC (emulated devices: shared
//! memory), instead of through MPI.
//!
//! 1. The origin asks (`GetRequest` / `PutRequest` with the IPC flag), naming the target's
//!    registration, range and the operation's tag.
//! 2. The target checks and pins the range, and grants it (`IpcGrant`): the exported allocation
//!    and the range's place in it. A refusal is a `GetRefused` / `PutDone` with the reason, as
//!    on the other routes.
//! 3. The origin maps the allocation (once: later grants of the same allocation reuse the
//!    mapping) and copies on its device's stream: target to local for a get, local to target for
//!    a put.
//! 4. Once the copy has completed, the origin releases the range (`IpcRelease`, with the reason
//!    when the copy failed). A get then completes at the origin (and notifies the target as any
//!    get does); the target of a put unpins, delivers the notification to its handler (the data
//!    is in place) and answers `PutDone`, which completes the put at the origin.
//!
//! The pin holds the target's registration (it cannot be unregistered) from the grant until
//! the release, so the origin never copies from or into memory whose registration has ended.
//!
//! Most operations skip steps 1, 2 and 4: the origin leases the target's registration from the
//! table the target publishes in shared memory (`lease.rs`), copies at once, and tells the
//! target afterwards (`LeaseDone`, which carries a put's notification). The grant protocol
//! serves what the table does not cover.

use crate::am::AmMessage;
use crate::engine::Shared;
use crate::engine::{Completion, Notify};
use crate::error::{EngineError, Result};
use crate::handle::MemHandle;
use crate::lease::Lease;
use crate::one_sided::Pending;
use crate::registry::Pinned;
use crate::stats::Counters;
use crate::wire::{self, Request};
use ferry_base::error::Rank;
use ferry_base::region::MemRegion;
use ferry_base::traffic::TrafficPath;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// A range the target granted, until the origin's release.
pub(crate) struct Granted {
    region: Pinned,
    /// For a put, its notification (`None` for a get).
    put_notify: Option<Option<(u16, Vec<u8>)>>,
}

impl Shared {
    /// Whether a payload between a local region (on `device`, or host memory) and `remote`
    /// takes the IPC route: device memory on both sides, and the peer mapped through IPC.
    pub(crate) fn ipc_route(&self, device: Option<usize>, remote: &MemHandle, peer: Rank) -> bool {
        device.is_some() && remote.kind.device().is_some() && self.ipc_to(peer)
    }

    /// A lease on `remote` (on the IPC or the single-copy route), when its owner published it
    /// and it is open.
    pub(crate) fn lease(&self, remote: &MemHandle) -> Option<Lease> {
        // Peer copies without leases (`EngineConfig::ipc_leases` false) always ask for a grant,
        // even where the peer's table is mapped for single copies of host memory.
        if remote.kind.device().is_some() && !self.ipc_leases {
            return None;
        }
        self.peer_leases
            .get(remote.rank as usize)?
            .as_ref()?
            .acquire(remote.id, remote.generation)
    }

    /// A get (`put` false) or put between `local` and the leased registration at
    /// `remote_offset`, as one peer copy: `done` runs once it has completed, after the target
    /// has been told (`LeaseDone`) and, for a get, notified.
    ///
    /// # Errors
    /// A range past the leased allocation, an export that cannot be mapped, a copy that cannot
    /// be issued: nothing has been copied, and the lease is given back.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn leased_copy(
        self: &Arc<Self>,
        local: Pinned,
        lease: Lease,
        peer: Rank,
        remote_offset: usize,
        put: bool,
        notify: Option<Notify>,
        stream: Option<u64>,
        done: Completion,
    ) -> Result<()> {
        let len = local.len();
        let device = local
            .device
            .ok_or_else(|| EngineError::InvalidArgument("a peer copy of host memory".into()))?;
        lease.check_range(remote_offset, len)?;
        let exported = ferry_device::copier::shift_export(&lease.export, remote_offset as u64)?;
        let room = ferry_device::copier::exported_len(&exported)?;
        if len as u64 > room {
            return Err(EngineError::InvalidArgument(format!(
                "a leased allocation of {room} bytes for a copy of {len}"
            )));
        }
        let here = local.ptr() as u64;
        let st = self.staging_or_error()?;
        let mut g = st.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the local range is pinned by the operation, the remote one by the lease, both
        // held until the copy's completion runs (below).
        let t = unsafe { g.peer_copy(device, &exported, here, len, put)? };
        // A stream-ordered get: the caller's stream waits for the copy's event.
        // SAFETY: the caller vouches for the stream (`get_on_stream`).
        if let Err(e) = stream.map_or(Ok(()), |st| unsafe { g.copier_mut().stream_wait(device, st, &t) }) {
            // The call fails (`done` never runs), but the copy is issued: both ranges stay
            // held until it has completed.
            g.push_peer_copy(
                t,
                device,
                &exported,
                Box::new(move |_| {
                    drop(lease);
                    drop(local);
                }),
            );
            return Err(e.into());
        }
        let s = self.clone();
        g.push_peer_copy(
            t,
            device,
            &exported,
            Box::new(move |r| {
                // The copy is over: neither side's memory is touched any more.
                drop(lease);
                drop(local);
                s.on_leased_copy(peer, put, len, TrafficPath::Ipc, r.map_err(Into::into), notify, done);
            }),
        );
        Ok(())
    }

    /// The origin's end of a leased copy on `path` (a peer copy on the IPC route, on the
    /// progress thread; a single copy of host memory, on the caller's thread).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_leased_copy(
        self: &Arc<Self>,
        peer: Rank,
        put: bool,
        len: usize,
        path: TrafficPath,
        r: Result<()>,
        notify: Option<Notify>,
        done: Completion,
    ) {
        if r.is_err() {
            return self.delivery.deliver(Box::new(move || done(r)));
        }
        let single = path == TrafficPath::Cma;
        Counters::add(
            if single {
                &self.counters.single_copies
            } else {
                &self.counters.leased_copies
            },
            1,
        );
        let path = self.comm_counters().traffic.path(path);
        let (b, n) = if put {
            (&path.bytes_sent, &path.sends)
        } else {
            (&path.bytes_recv, &path.recvs)
        };
        b.fetch_add(len as u64, Relaxed);
        n.fetch_add(1, Relaxed);
        if put {
            if let Some(n) = notify {
                // A put with a notification ends when the target answers, after its handler
                // has the notification, as on the other routes: it waits as any put does.
                let tag = self.data_tag(true);
                let waiting = Pending::Put {
                    done,
                    len,
                    ipc: None,
                    sent: Some(Ok(())),
                    answered: None,
                };
                if !self.insert_or_fail(peer, tag, waiting) {
                    return;
                }
                let report = wire::encode_lease_done(true, single, len as u64, tag, Some((n.tag, n.bytes.as_slice())));
                if let Err(e) = self.post_am(peer, wire::LEASE_DONE, report) {
                    if let Some(p) = self.take_pending(peer, tag) {
                        p.fail(e, &self.delivery);
                    }
                }
                return;
            }
            Counters::add(&self.counters.puts, 1);
            Counters::add(&self.counters.bytes_put, len as u64);
        } else {
            Counters::add(&self.counters.gets, 1);
            Counters::add(&self.counters.bytes_got, len as u64);
        }
        let report = wire::encode_lease_done(put, single, len as u64, wire::NO_ANSWER, None);
        if let Err(e) = self.post_am(peer, wire::LEASE_DONE, report) {
            tracing::error!(peer, "report of a peer copy not sent: {e}");
        }
        if let (false, Some(n)) = (put, notify) {
            // A get's notification goes to the target's handler as on the other routes.
            match self.post_am(peer, i32::from(n.tag), n.bytes) {
                Ok(()) => Counters::add(&self.counters.am_sent, 1),
                Err(e) => tracing::error!(peer, "notification of a get not sent: {e}"),
            }
        }
        self.delivery.deliver(Box::new(move || done(r)));
    }

    /// The target's side of a leased copy: counted, and a put's notification delivered.
    pub(crate) fn on_lease_done(self: &Arc<Self>, source: Rank, bytes: &[u8]) -> Result<()> {
        let wire::LeaseDone {
            put,
            single,
            len,
            answer,
            notify,
        } = wire::decode_lease_done(bytes)?;
        let path = self
            .comm_counters()
            .traffic
            .path(if single { TrafficPath::Cma } else { TrafficPath::Ipc });
        if put {
            Counters::add(&self.counters.puts_served, 1);
            path.bytes_recv.fetch_add(len, Relaxed);
            path.recvs.fetch_add(1, Relaxed);
            if let Some((tag, bytes)) = notify {
                Counters::add(&self.counters.notifications, 1);
                self.handlers.arrived(
                    AmMessage {
                        source,
                        tag,
                        bytes: bytes.into(),
                    },
                    &self.delivery,
                );
            }
            if answer != wire::NO_ANSWER {
                self.post_am(source, wire::PUT_DONE, wire::encode_reply(answer, Ok(())))?;
            }
        } else {
            Counters::add(&self.counters.gets_served, 1);
            path.bytes_sent.fetch_add(len, Relaxed);
            path.sends.fetch_add(1, Relaxed);
        }
        Ok(())
    }

    /// Keeps the local region of the put `(peer, tag)` for its peer copy.
    pub(crate) fn set_ipc_region(&self, peer: Rank, tag: u32, region: Pinned) {
        let mut region = Some(region);
        self.update(peer, tag, |p| {
            if let Pending::Put { ipc, .. } = p {
                *ipc = region.take();
            }
            false
        });
    }

    /// The target's side of step 2: check, pin and export the range, or refuse.
    pub(crate) fn grant(
        self: &Arc<Self>,
        source: Rank,
        rq: &Request,
        put_notify: Option<Option<(u16, Vec<u8>)>>,
    ) -> Result<()> {
        let is_put = put_notify.is_some();
        let granted = self
            .registry
            .pin_id(rq.id, rq.generation, rq.offset as usize, rq.len as usize)
            .and_then(|region| {
                if region.device.is_none() {
                    return Err(EngineError::InvalidArgument("a peer copy of host memory".into()));
                }
                let exported = match &region.export {
                    // Exported at registration: move the offset to this range.
                    Some((x, offset)) => ferry_device::copier::shift_export(x, *offset as u64)?,
                    None => self
                        .staging_or_error()?
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .copier_mut()
                        .export(region.ptr() as u64)?,
                };
                Ok((region, exported))
            });
        match granted {
            Ok((region, exported)) => {
                {
                    let mut g = self.granted.lock().unwrap_or_else(|e| e.into_inner());
                    g.insert((source, rq.data_tag), Granted { region, put_notify });
                    self.in_flight.granted.store(g.len(), Relaxed);
                }
                let mut msg = rq.data_tag.to_le_bytes().to_vec();
                msg.extend_from_slice(&exported);
                self.post_am(source, wire::IPC_GRANT, msg)
            }
            Err(e) => {
                Counters::add(&self.counters.refused, 1);
                let refusal = wire::encode_reply(rq.data_tag, Err(e.to_string()));
                self.post_am(source, if is_put { wire::PUT_DONE } else { wire::GET_REFUSED }, refusal)
            }
        }
    }

    /// The origin's side of steps 3 and 4.
    pub(crate) fn on_ipc_grant(self: &Arc<Self>, source: Rank, bytes: &[u8]) -> Result<()> {
        if bytes.len() < 4 {
            return Err(EngineError::InvalidArgument(format!(
                "IPC grant of {} bytes",
                bytes.len()
            )));
        }
        let tag = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        let exported = &bytes[4..];
        // The local range (kept in the pending operation) and the direction.
        let mut local = None;
        self.update(source, tag, |p| {
            local = match p {
                Pending::Get { ipc: Some(r), .. } => Some((r.ptr() as u64, r.len(), r.device, false)),
                Pending::Put { ipc: Some(r), .. } => Some((r.ptr() as u64, r.len(), r.device, true)),
                _ => None,
            };
            false
        });
        let Some((ptr, len, Some(device), is_put)) = local else {
            return Err(EngineError::InvalidArgument(format!(
                "IPC grant for tag {tag} from rank {source}, which this rank did not ask for"
            )));
        };
        let s = self.clone();
        let copied = move |r: std::result::Result<(), ferry_base::error::DeviceError>| {
            let path = s.comm_counters().traffic.path(TrafficPath::Ipc);
            if r.is_ok() {
                let (b, n) = if is_put {
                    (&path.bytes_sent, &path.sends)
                } else {
                    (&path.bytes_recv, &path.recvs)
                };
                b.fetch_add(len as u64, Relaxed);
                n.fetch_add(1, Relaxed);
            }
            let release = wire::encode_reply(tag, r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
            if let Err(e) = s.post_am(source, wire::IPC_RELEASE, release) {
                tracing::error!(peer = source, "release of a peer copy not sent: {e}");
            }
            if !is_put {
                // A get ends here: the bytes are in place.
                s.on_get_landed(source, tag, r.map_err(Into::into));
            }
            // A put ends with the target's answer to the release.
        };
        let room = ferry_device::copier::exported_len(exported).map_err(EngineError::from);
        let started = room
            .and_then(|room| {
                if (len as u64) > room {
                    return Err(EngineError::InvalidArgument(format!(
                        "a grant of {room} bytes for a copy of {len}"
                    )));
                }
                self.staging_or_error()
            })
            .and_then(|st| {
                let mut g = st.lock().unwrap_or_else(|e| e.into_inner());
                // SAFETY: the local range is pinned by the pending operation, the remote one by the
                // target's grant, until the copy's completion runs.
                let t = unsafe { g.peer_copy(device, exported, ptr, len, is_put)? };
                g.push_peer_copy(t, device, exported, Box::new(copied));
                Ok(())
            });
        if let Err(e) = started {
            // Release the target's range, and end the operation with the reason.
            let release = wire::encode_reply(tag, Err(e.to_string()));
            self.post_am(source, wire::IPC_RELEASE, release)?;
            if !is_put {
                if let Some(p) = self.take_pending(source, tag) {
                    p.fail(e, &self.delivery);
                }
            }
        }
        Ok(())
    }

    /// The target's side of step 4.
    pub(crate) fn on_ipc_release(self: &Arc<Self>, source: Rank, bytes: &[u8]) -> Result<()> {
        let (tag, outcome) = wire::decode_reply(bytes)?;
        let released = {
            let mut g = self.granted.lock().unwrap_or_else(|e| e.into_inner());
            let r = g.remove(&(source, tag));
            self.in_flight.granted.store(g.len(), Relaxed);
            r
        };
        let Some(g) = released else {
            return Err(EngineError::InvalidArgument(format!(
                "IPC release for tag {tag} from rank {source}, which this rank did not grant"
            )));
        };
        let len = g.region.len() as u64;
        let path = self.comm_counters().traffic.path(TrafficPath::Ipc);
        let Some(notify) = g.put_notify else {
            // A get: the origin has read the range.
            drop(g.region);
            if outcome.is_ok() {
                Counters::add(&self.counters.gets_served, 1);
                path.bytes_sent.fetch_add(len, Relaxed);
                path.sends.fetch_add(1, Relaxed);
            }
            return Ok(());
        };
        drop(g.region);
        if outcome.is_ok() {
            Counters::add(&self.counters.puts_served, 1);
            path.bytes_recv.fetch_add(len, Relaxed);
            path.recvs.fetch_add(1, Relaxed);
            if let Some((ntag, bytes)) = notify {
                Counters::add(&self.counters.notifications, 1);
                let m = AmMessage {
                    source,
                    tag: ntag,
                    bytes: bytes.into(),
                };
                self.handlers.arrived(m, &self.delivery);
            }
        }
        self.post_am(source, wire::PUT_DONE, wire::encode_reply(tag, outcome))
    }
}
