//! The receiving side of each route. The copy is fresh (a receive lands in a new buffer), so
//! nothing else reads it until `done` has run; validity is set here, before `done`, so the
//! consumers released by `done` see where the data is.

use super::region::{DeviceRegion, Slice, Small};
use super::route::Route;
use super::wire::{Desc, DESC_BYTES};
use super::{Done, Join, Transport};
use crate::comm::Channel;
use crate::data::copy::{Location, TileCopy};
use crate::device::manager::{CopyOp, GpuCmd, Placed};
use crate::device::Mem;
use crate::error::{FerryError, Rank};
use crate::stats::Path;
use std::sync::Arc;

impl Transport {
    /// Receives over `route`, into the device block `placed` when comm-in reserved one.
    pub(super) fn recv_into(
        self: &Arc<Self>,
        route: Route,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        placed: Option<Placed>,
        done: Done,
    ) {
        match (route, placed) {
            (Route::Host, _) | (Route::GpuDirect, None) => {
                if let Some(p) = placed {
                    self.gpu(GpuCmd::Unpin { copy: copy.clone(), dev: p.dev });
                }
                self.recv_whole_host(&copy, peer, tag, done)
            }
            (Route::GpuDirect, Some(p)) => {
                let len = copy.bytes();
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
                self.message(false, region, peer, tag, Channel::Data, Path::GpuDirect, true, false, done);
            }
            (Route::Staged, placed) => self.recv_staged(copy, peer, tag, placed, done),
            (Route::Ipc, placed) => self.recv_ipc(copy, peer, tag, placed, done),
        }
    }

    /// The data is valid in the reserved block of `dev` (and in host memory too when
    /// `host_too`): set it now, so the consumers `done` releases see it; the manager releases the
    /// pin and files the copy in its LRU.
    fn mark_landed(&self, copy: &Arc<TileCopy>, dev: usize, host_too: bool) {
        {
            let mut s = copy.lock();
            s.produced_at(Location::Device(dev));
            s.host_valid = host_too;
        }
        self.gpu(GpuCmd::Landed {
            copy: copy.clone(),
            dev,
            host_too,
        });
    }

    /// One message into the host buffer (host path by size).
    fn recv_whole_host(&self, copy: &Arc<TileCopy>, peer: Rank, tag: i32, done: Done) {
        let buf = copy.lock().host_buf(copy.bytes());
        let (path, eager) = self.host_path(copy.bytes());
        self.message(false, buf, peer, tag, Channel::Data, path, true, eager, done);
    }

    /// Staged: chunks into the host buffer; with a reserved block, each chunk continues to the
    /// device as soon as it has landed.
    fn recv_staged(self: &Arc<Self>, copy: Arc<TileCopy>, peer: Rank, tag: i32, placed: Option<Placed>, done: Done) {
        let len = copy.bytes();
        let buf = copy.lock().host_buf(len);
        let chunks = self.chunks(len);
        let t = self.clone();
        let c = copy.clone();
        let join = Join::new(
            chunks.len(),
            Box::new(move |r| {
                match (r.is_ok(), placed) {
                    (true, Some(p)) => t.mark_landed(&c, p.dev, true),
                    (false, Some(p)) => t.gpu(GpuCmd::Unpin { copy: c, dev: p.dev }),
                    _ => {}
                }
                if r.is_ok() {
                    t.count_tile(Path::Staged, false);
                }
                done(r)
            }),
        );
        let stream = self.comm_stream();
        for (off, n) in chunks {
            let j = join.clone();
            let region = Arc::new(Slice {
                buf: buf.clone(),
                off,
                len: n,
            });
            let t = self.clone();
            let b = buf.clone();
            let landed: Done = Box::new(move |r| match (r, placed) {
                (Ok(()), Some(p)) => {
                    let op = CopyOp {
                        dev: p.dev,
                        stream,
                        // SAFETY (of the pointer arithmetic): off + n <= len.
                        src: Mem::Host(unsafe { b.as_ptr().add(off) }),
                        dst: Mem::Pool(p.offset + off as u64),
                        len: n,
                        path: Path::HostToDevice,
                        counted: true,
                    };
                    t.gpu(GpuCmd::Copy {
                        op,
                        then: Box::new(move |r| {
                            drop(b);
                            j.arrive(r.map_err(FerryError::Device))
                        }),
                    });
                }
                (r, _) => j.arrive(r),
            });
            self.message(false, region, peer, tag, Channel::Data, Path::Staged, false, len <= self.eager_bytes, landed);
        }
    }

    /// IPC: read the producer's descriptor, copy from its mapped pool, acknowledge.
    fn recv_ipc(self: &Arc<Self>, copy: Arc<TileCopy>, peer: Rank, tag: i32, placed: Option<Placed>, done: Done) {
        let desc_buf = Small::zeroed(DESC_BYTES);
        let t = self.clone();
        let d = desc_buf.clone();
        let on_desc: Done = Box::new(move |r| {
            if let Err(e) = r {
                if let Some(p) = placed {
                    t.gpu(GpuCmd::Unpin { copy, dev: p.dev });
                }
                return done(Err(e));
            }
            // SAFETY: the receive into the buffer has completed.
            let desc = Desc::decode(unsafe { d.get() });
            t.on_descriptor(copy, peer, tag, placed, desc, done);
        });
        self.message(false, desc_buf, peer, tag, Channel::Data, Path::Control, true, true, on_desc);
    }

    fn on_descriptor(
        self: &Arc<Self>,
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        placed: Option<Placed>,
        desc: Result<Desc, super::wire::DescError>,
        done: Done,
    ) {
        let len = copy.bytes();
        let bad = |msg: String| FerryError::Protocol { peer, tag, msg };
        let checked = desc.map_err(|e| bad(e.to_string())).and_then(|desc| {
            if desc.len() != len as u64 {
                return Err(bad(format!("announces {} bytes, the tile has {len}", desc.len())));
            }
            Ok(desc)
        });
        let desc = match checked {
            Ok(d) => d,
            Err(e) => {
                if let Some(p) = placed {
                    self.gpu(GpuCmd::Unpin { copy, dev: p.dev });
                }
                return done(Err(e));
            }
        };
        match desc {
            Desc::Inline { .. } => {
                // The block stays reserved (not valid): the consumer's stage-in fills it from host.
                if let Some(p) = placed {
                    self.gpu(GpuCmd::Unpin {
                        copy: copy.clone(),
                        dev: p.dev,
                    });
                }
                self.recv_whole_host(&copy, peer, tag, done)
            }
            Desc::Pool { dev, offset, len: n } => {
                let local = placed.map_or(0, |p| p.dev);
                let caps = self.routes.caps(peer);
                let capacity = caps.pool_bytes.get(dev as usize).copied().unwrap_or(0);
                let remote = self.ipc.get(&(peer, dev as usize)).and_then(|v| v.get(local)).copied();
                let remote = match remote {
                    Some(r) if offset.checked_add(n).is_some_and(|end| end <= capacity) => r,
                    Some(_) => {
                        return self.fail_ipc(copy, placed, done, bad(format!(
                            "{n} bytes at offset {offset} lie outside device {dev}'s pool of {capacity} bytes"
                        )))
                    }
                    None => {
                        return self.fail_ipc(copy, placed, done, bad(format!(
                            "device {dev} of rank {peer} is not mapped here"
                        )))
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
                    src: Mem::Remote { pool: remote, off: offset },
                    len,
                    path: Path::Ipc,
                    counted: false,
                };
                let t = self.clone();
                self.gpu(GpuCmd::Copy {
                    op,
                    then: Box::new(move |r| {
                        drop(host);
                        if let Err(e) = r {
                            return t.fail_ipc(copy, placed, done, FerryError::Device(e));
                        }
                        if let Some(p) = placed {
                            t.mark_landed(&copy, p.dev, false);
                        }
                        t.count(Path::Ipc, len, false);
                        // The producer unpins its block on this acknowledgement.
                        t.message(true, Small::zeroed(8), peer, tag, Channel::Ack, Path::Control, true, true, done);
                    }),
                });
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
