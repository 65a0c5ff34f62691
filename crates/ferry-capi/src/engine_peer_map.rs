//! Peer mappings from C (`ferry_engine_map_peer`, `_unmap_peer`, `_exported`): a peer's device
//! registration mapped into this process, for copies the framework issues on its own streams
//! (see `EngineHandle::map_peer` in `ferry-engine` and `docs/engine.md`, *Peer mappings*).

use crate::engine::{ferry_engine, ferry_mem_handle, mem, with};
use crate::registry::{self, Object};
use crate::status::*;
use crate::util::out;
use eng::EngineError;
use std::sync::Arc;

/// A peer's registration mapped here (0: none); unmapped by `ferry_engine_unmap_peer`, or by
/// `ferry_engine_finalize` of the engine that mapped it.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_peer_mapping {
    /// Opaque id.
    pub id: u64,
}

/// Maps `remote`, a peer's registration of device memory, on local device `device`: writes the
/// mapping (release it with `ferry_engine_unmap_peer`), the address of the registration's first
/// byte, valid on `device` in this process while mapped (a CUDA device pointer; a host address
/// on emulated devices), and its length (`out_addr`, `out_len` may be NULL). The registration
/// cannot end while mapped: its owner's `ferry_engine_unregister` answers `FERRY_ERR_BUSY`.
/// Ordering the copies through the address with the owner's use of the memory is the caller's
/// protocol.
///
/// Errors: `FERRY_ERR_INVALID_ARGUMENT` (this rank's own registration, host memory, a NULL
/// pointer), `FERRY_ERR_DEVICE` (no such device, no devices, or the peer is not on the IPC route:
/// another node, IPC off on either side; a mapping the driver refuses), `FERRY_ERR_INVALID_HANDLE`
/// (an ended registration, a handle of another job, a dead engine).
///
/// # Safety
/// `remote` is valid for a read; the out-pointers are valid for writes (or NULL where allowed).
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_map_peer(
    engine: ferry_engine,
    remote: *const ferry_mem_handle,
    device: u32,
    out_mapping: *mut ferry_peer_mapping,
    out_addr: *mut u64,
    out_len: *mut usize,
) -> ferry_status {
    with(engine, |h| {
        if out_mapping.is_null() {
            return Err(EngineError::InvalidArgument("out_mapping is null".into()));
        }
        let r = mem(h, remote, "remote")?;
        let m = h.map_peer(&r, device as usize)?;
        let (addr, len) = (m.addr(), m.len());
        // Only while the engine is live: a `ferry_engine_finalize` that ran meanwhile has
        // already dropped its mappings, and would not see this one.
        let id = registry::insert_owned(
            engine.id,
            Object::PeerMapping {
                engine: engine.id,
                _mapping: Arc::new(m),
            },
        )
        .map_err(|_| EngineError::Finalized)?;
        let null = |_| EngineError::InvalidArgument("a null out-pointer".into());
        out(out_mapping, ferry_peer_mapping { id }).map_err(null)?;
        if !out_addr.is_null() {
            out(out_addr, addr).map_err(null)?;
        }
        if !out_len.is_null() {
            out(out_len, len).map_err(null)?;
        }
        Ok(())
    })
}

/// Drops a mapping of `ferry_engine_map_peer` (`FERRY_ERR_INVALID_HANDLE` for one unmapped
/// already). The engine may keep the allocation mapped for later mappings (its idle bound).
#[no_mangle]
pub extern "C" fn ferry_engine_unmap_peer(mapping: ferry_peer_mapping) -> ferry_status {
    guard(
        || match registry::remove(mapping.id, |o| matches!(o, Object::PeerMapping { .. })) {
            Some(o) => {
                drop(o);
                FERRY_OK
            }
            None => fail(
                FERRY_ERR_INVALID_HANDLE,
                format!("{} is not a live ferry_peer_mapping", mapping.id),
            ),
        },
    )
}

/// Writes 1 to `out_exported` when `handle`, this rank's registration, can be mapped by the
/// node's peers (device memory, IPC on, an allocation the driver could export), else 0.
///
/// Errors: `FERRY_ERR_INVALID_HANDLE` (another rank's handle, an ended registration, a dead
/// engine), `FERRY_ERR_INVALID_ARGUMENT` (a NULL pointer).
///
/// # Safety
/// `handle` is valid for a read, `out_exported` for a write.
#[no_mangle]
pub unsafe extern "C" fn ferry_engine_exported(
    engine: ferry_engine,
    handle: *const ferry_mem_handle,
    out_exported: *mut i32,
) -> ferry_status {
    with(engine, |h| {
        let yes = h.exported(&mem(h, handle, "handle")?)?;
        out(out_exported, i32::from(yes)).map_err(|_| EngineError::InvalidArgument("out_exported is null".into()))
    })
}
