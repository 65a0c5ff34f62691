//! Receive-side placement (PaRSEC's RGET, TTG's "receive into device"): a get into new memory
//! that the engine allocates on the device the caller names, falling back to pinned host memory
//! when the device has no room (its budget, `EngineConfig::device_budget`, or the device itself
//! is full), and telling the caller where the bytes landed.
//!
//! Where the memory comes from, in order: the device's placement arena (`arena.rs`: one
//! allocation per device carved by a best-fit pool, so neither an allocation nor a device-wide
//! `cuMemFree` synchronization per get), an allocation of its own when the arena has no room,
//! then pinned host memory.
//!
//! A task's inputs are placed together with [`EngineHandle::get_placed_all`]: all of them on the
//! device, or all of them in host memory, never part on the device while the rest waits for room
//! (two tasks each holding part of what the other needs is the deadlock that rules this out).
//!
//! The memory is allocated when the get starts (the origin asks for data that is on its way),
//! registered like any other, and handed to the completion as a [`Placed`]: its handle can be
//! shipped to peers at once (a framework forwarding the tile to a second GPU, say). Dropping the
//! `Placed` ends the registration and frees the memory (back to the arena's pool).

use crate::arena::ArenaBlock;
use crate::engine::{DeviceBuffer, EngineHandle, Notify};
use crate::error::{EngineError, Result};
use crate::handle::{MemHandle, MemKind};
use crate::placer::Placer;
use ferry_device::copier::Free;
use std::sync::{Arc, Mutex};

/// Where a placed get's bytes landed.
pub(crate) enum PlacedMemory {
    /// Memory from the framework's [`Placer`], given back to it on drop.
    Framework {
        device: usize,
        addr: u64,
        len: usize,
        placer: Arc<dyn Placer>,
    },
    /// A block of the device's placement arena.
    Arena(ArenaBlock),
    /// Device memory of its own: the arena had no room.
    Device(DeviceBuffer),
    /// Pinned host memory: the device had no room.
    Host {
        /// Its address.
        ptr: *mut u8,
        /// Frees it.
        free: Option<Free>,
    },
}

// SAFETY: the host buffer is owned by this value and handed to one user at a time.
unsafe impl Send for PlacedMemory {}

/// One get of [`EngineHandle::get_placed_all`]: `len` bytes at `offset` of `remote`, and the
/// notification its owner receives once they have landed here.
#[derive(Debug, Clone)]
pub struct PlacedRequest {
    /// The remote registration read.
    pub remote: MemHandle,
    /// Bytes from its start.
    pub offset: usize,
    /// Bytes read (at least 1).
    pub len: usize,
    /// Delivered to the owner's handler after the landing, as for [`EngineHandle::get`].
    pub notify: Option<Notify>,
}

/// The memory a placed get filled, registered with the engine. Dropping it ends the
/// registration and frees the memory (a registration still in use by operations is leaked
/// rather than freed under them, with an error logged).
pub struct Placed {
    engine: EngineHandle,
    handle: MemHandle,
    memory: Option<PlacedMemory>,
    len: usize,
}

impl Placed {
    /// Its registration (this rank's), e.g. to ship to a peer.
    pub fn handle(&self) -> &MemHandle {
        &self.handle
    }

    /// The device it is on, or `None` for the host fallback.
    pub fn device(&self) -> Option<usize> {
        match self.memory.as_ref() {
            Some(PlacedMemory::Framework { device, .. }) => Some(*device),
            Some(PlacedMemory::Arena(b)) => Some(b.device()),
            Some(PlacedMemory::Device(b)) => Some(b.device()),
            _ => None,
        }
    }

    /// Whether it lies in the device's placement arena (else in an allocation of its own, or
    /// in host memory).
    pub fn in_arena(&self) -> bool {
        matches!(self.memory, Some(PlacedMemory::Arena(_)))
    }

    /// Its address: a device address on the device, a host pointer otherwise.
    pub fn addr(&self) -> u64 {
        match self.memory.as_ref() {
            Some(PlacedMemory::Framework { addr, .. }) => *addr,
            Some(PlacedMemory::Arena(b)) => b.ptr(),
            Some(PlacedMemory::Device(b)) => b.ptr(),
            Some(PlacedMemory::Host { ptr, .. }) => *ptr as u64,
            None => 0,
        }
    }

    /// Its bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes (never: a get moves at least one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Placed {
    fn drop(&mut self) {
        match self.engine.unregister(&self.handle) {
            // The memory goes back (`PlacedMemory`'s drop).
            Ok(()) | Err(EngineError::Finalized) | Err(EngineError::NotRegistered { .. }) => drop(self.memory.take()),
            Err(e) => {
                tracing::error!("placed memory kept (leaked): {e}");
                std::mem::forget(self.memory.take());
            }
        }
    }
}

impl Drop for PlacedMemory {
    /// Gives the memory back: host memory freed, the framework's released to its placer (device
    /// memory of the engine's goes back by its buffer's or arena block's own drop). Also what
    /// happens to the memory of a group that failed before its gets started.
    fn drop(&mut self) {
        match self {
            PlacedMemory::Host { free, .. } => {
                if let Some(f) = free.take() {
                    f()
                }
            }
            PlacedMemory::Framework {
                device,
                addr,
                len,
                placer,
            } => placer.release(*device, *addr, *len),
            PlacedMemory::Arena(_) | PlacedMemory::Device(_) => {}
        }
    }
}

impl EngineHandle {
    /// Reads `len` bytes at `remote_offset` of `remote` into new memory on `device` (its
    /// placement arena, else an allocation of its own), or, when the device has no room, into
    /// new pinned host memory; `done` receives it, registered, once the bytes have landed (then
    /// `notify` reaches the target, as for [`EngineHandle::get`]).
    ///
    /// # Errors
    /// At once: as [`EngineHandle::get`], and [`EngineError::NoDevices`] without devices or for
    /// an absent `device`, [`EngineError::Device`] when neither device nor pinned host memory
    /// can be had. Through `done`: as [`EngineHandle::get`].
    #[allow(clippy::too_many_arguments)]
    pub fn get_placed(
        &self,
        device: usize,
        remote: &MemHandle,
        remote_offset: usize,
        len: usize,
        notify: Option<Notify>,
        done: impl FnOnce(Result<Placed>) + Send + 'static,
    ) -> Result<()> {
        let request = PlacedRequest {
            remote: *remote,
            offset: remote_offset,
            len,
            notify,
        };
        self.get_placed_all(device, std::slice::from_ref(&request), move |r| {
            done(r.map(|mut v| v.pop().expect("one placement per request")))
        })
    }

    /// Places the inputs of one task together: each request's bytes are read into new memory,
    /// all of it on `device` or, when the device has no room for all of them at once, all of it
    /// in pinned host memory (so a task never holds part of the device while it waits for room
    /// for the rest). `done` receives the placements in request order once every get has
    /// landed, or the first failure (the placements already made are then freed).
    ///
    /// # Errors
    /// At once (nothing started, `done` dropped unrun): as [`EngineHandle::get_placed`], for
    /// any request; [`EngineError::InvalidArgument`] for no requests. Every request is checked
    /// before the first get starts, so the only error after that is the engine ending
    /// meanwhile ([`EngineError::Finalized`], [`EngineError::CallbackPanicked`]): it is
    /// returned, the gets already started run to their end with nobody told, and their
    /// placements are given back. Through `done`: as [`EngineHandle::get`].
    pub fn get_placed_all(
        &self,
        device: usize,
        requests: &[PlacedRequest],
        done: impl FnOnce(Result<Vec<Placed>>) + Send + 'static,
    ) -> Result<()> {
        let s = self.shared();
        s.check_open()?;
        s.check_am()?;
        if requests.is_empty() {
            return Err(EngineError::InvalidArgument("get_placed_all with no requests".into()));
        }
        for r in requests {
            s.check_remote(&r.remote)?;
            r.remote.check_range(r.offset, r.len)?;
        }
        let lens: Vec<usize> = requests.iter().map(|r| r.len).collect();
        let memory = self.reserve(device, &lens)?;
        let mut placed = Vec::with_capacity(requests.len());
        for (m, &len) in memory.into_iter().zip(&lens) {
            let dev = MemKind::Device(device as u32);
            // SAFETY: fresh memory of `len` bytes that the `Placed` owns and frees only after
            // unregistering it; an arena block's kind and export are the arena's.
            let handle = unsafe {
                match &m {
                    PlacedMemory::Framework { addr, .. } => self.register(*addr as *mut u8, len, dev)?,
                    PlacedMemory::Arena(b) => self.register_placed(b.ptr() as *mut u8, len, dev, b.export())?,
                    PlacedMemory::Device(b) => self.register(b.ptr() as *mut u8, len, dev)?,
                    PlacedMemory::Host { ptr, .. } => self.register(*ptr, len, MemKind::Host)?,
                }
            };
            placed.push(Placed {
                engine: self.clone(),
                handle,
                memory: Some(m),
                len,
            });
        }
        let locals: Vec<MemHandle> = placed.iter().map(|p| p.handle).collect();
        let group = Arc::new(Mutex::new(Group {
            placed: placed.into_iter().map(Some).collect(),
            left: requests.len(),
            failed: None,
            done: Some(Box::new(done)),
        }));
        for (r, local) in requests.iter().zip(locals) {
            let g = group.clone();
            let started = self.get(&local, 0, &r.remote, r.offset, r.len, r.notify.clone(), move |res| {
                Group::landed(&g, res)
            });
            if let Err(e) = started {
                // The gets already started complete into a group with nobody to tell.
                let mut g = group.lock().unwrap_or_else(|p| p.into_inner());
                g.done = None;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Memory for `lens`, all on `device` (the arena, else allocations of their own) or all in
    /// pinned host memory.
    fn reserve(&self, device: usize, lens: &[usize]) -> Result<Vec<PlacedMemory>> {
        let s = self.shared();
        if device >= s.device_used.len() {
            return Err(EngineError::NoDevices(format!(
                "device {device} (this rank has {})",
                s.device_used.len()
            )));
        }
        if let Some(placer) = s.placer.get() {
            // The framework governs its devices' memory: it places, or the group goes to host
            // memory.
            if let Some(addrs) = placer.place(device, lens) {
                if addrs.len() == lens.len() {
                    return Ok(addrs
                        .into_iter()
                        .zip(lens)
                        .map(|(addr, &len)| PlacedMemory::Framework {
                            device,
                            addr,
                            len,
                            placer: placer.clone(),
                        })
                        .collect());
                }
                // A placer that broke its contract: give back what it handed out.
                tracing::error!(
                    device,
                    asked = lens.len(),
                    got = addrs.len(),
                    "the placer placed part of a group"
                );
                for (addr, &len) in addrs.iter().zip(lens) {
                    placer.release(device, *addr, len);
                }
            }
            return self.reserve_host(lens);
        }
        if let Some(blocks) = s.arenas.take_all(s, device, lens) {
            return Ok(blocks.into_iter().map(PlacedMemory::Arena).collect());
        }
        let mut own = Vec::with_capacity(lens.len());
        for &len in lens {
            match s.alloc_device(device, len) {
                Ok(b) => own.push(PlacedMemory::Device(b)),
                Err(EngineError::DeviceFull { .. }) | Err(EngineError::Device(_)) => {
                    own.clear(); // all or none on the device
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if own.len() == lens.len() {
            return Ok(own);
        }
        self.reserve_host(lens)
    }

    /// Pinned host memory for `lens`.
    fn reserve_host(&self, lens: &[usize]) -> Result<Vec<PlacedMemory>> {
        let st = self.shared().staging_or_error()?;
        let mut host = Vec::with_capacity(lens.len());
        for &len in lens {
            let (ptr, free) = st
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .copier_mut()
                .alloc_pinned(len)?;
            host.push(PlacedMemory::Host { ptr, free: Some(free) });
        }
        Ok(host)
    }
}

/// What a group's caller is told: its placements in request order, or the first failure.
type GroupDone = Box<dyn FnOnce(Result<Vec<Placed>>) + Send>;

/// The gets of one [`EngineHandle::get_placed_all`] call, until the last has landed.
struct Group {
    placed: Vec<Option<Placed>>,
    left: usize,
    failed: Option<EngineError>,
    done: Option<GroupDone>,
}

impl Group {
    fn landed(group: &Arc<Mutex<Group>>, r: Result<()>) {
        let mut g = group.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = r {
            g.failed.get_or_insert(e);
        }
        g.left -= 1;
        if g.left > 0 {
            return;
        }
        let done = g.done.take();
        let failed = g.failed.take();
        let placed: Vec<Placed> = g.placed.drain(..).flatten().collect();
        drop(g);
        // Outside the lock: the callback may start new operations, and dropping placements
        // unregisters them.
        if let Some(done) = done {
            match failed {
                Some(e) => {
                    drop(placed);
                    done(Err(e))
                }
                None => done(Ok(placed)),
            }
        }
    }
}
