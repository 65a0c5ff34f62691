//! Receive-side placement (PaRSEC's RGET, TTG's "receive into device"): a get into new memory
//! that the engine allocates on the device the caller names, falling back to pinned host memory
//! when the device has no room (its budget, `EngineConfig::device_budget`, or the device itself
//! is full), and telling the caller where the bytes landed.
//!
//! The memory is allocated when the get starts (the origin asks for data that is on its way),
//! registered like any other, and handed to the completion as a [`Placed`]: its handle can be
//! shipped to peers at once (a framework forwarding the tile to a second GPU, say). Dropping the
//! `Placed` ends the registration and frees the memory.

use crate::engine::{DeviceBuffer, EngineHandle, Notify};
use crate::error::{EngineError, Result};
use crate::handle::{MemHandle, MemKind};
use ferry_device::copier::Free;

/// Where a placed get's bytes landed.
pub enum PlacedMemory {
    /// Device memory of the device asked for.
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
            Some(PlacedMemory::Device(b)) => Some(b.device()),
            _ => None,
        }
    }

    /// Its address: a device address on the device, a host pointer otherwise.
    pub fn addr(&self) -> u64 {
        match self.memory.as_ref() {
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
            Ok(()) | Err(EngineError::Finalized) | Err(EngineError::NotRegistered { .. }) => {
                if let Some(PlacedMemory::Host { free: Some(f), .. }) = self.memory.take() {
                    f();
                }
                // Device memory is freed by its buffer's drop.
            }
            Err(e) => {
                tracing::error!("placed memory kept (leaked): {e}");
                std::mem::forget(self.memory.take());
            }
        }
    }
}

impl EngineHandle {
    /// Reads `len` bytes at `remote_offset` of `remote` into new memory on `device`, or, when
    /// the device has no room, into new pinned host memory; `done` receives it, registered, once
    /// the bytes have landed (then `notify` reaches the target, as for [`EngineHandle::get`]).
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
        let s = self.shared();
        s.check_open()?;
        s.check_remote(remote)?;
        remote.check_range(remote_offset, len)?;
        let memory = match s.alloc_device(device, len) {
            Ok(b) => PlacedMemory::Device(b),
            Err(EngineError::DeviceFull { .. }) | Err(EngineError::Device(_)) => {
                let st = s.staging_or_error()?;
                let (ptr, free) = st
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .copier_mut()
                    .alloc_pinned(len)?;
                PlacedMemory::Host { ptr, free: Some(free) }
            }
            Err(e) => return Err(e),
        };
        let (ptr, kind) = match &memory {
            PlacedMemory::Device(b) => (b.ptr() as *mut u8, MemKind::Device(device as u32)),
            PlacedMemory::Host { ptr, .. } => (*ptr, MemKind::Host),
        };
        // SAFETY: fresh memory of `len` bytes that the returned `Placed` owns and frees only
        // after unregistering it.
        let handle = unsafe { self.register(ptr, len, kind)? };
        let placed = Placed {
            engine: self.clone(),
            handle,
            memory: Some(memory),
            len,
        };
        let local = placed.handle;
        self.get(&local, 0, remote, remote_offset, len, notify, move |r| {
            done(r.map(|()| placed));
        })
    }
}
