//! Handles: C holds small integer ids, never pointers, so a stale, freed or made-up handle is a
//! lookup miss (`FERRY_ERR_INVALID_HANDLE`), not undefined behaviour. Objects live in one
//! process-wide table; each remembers the runtime it belongs to, and finalizing a runtime drops
//! its collections and classes with it.

use crate::collection::AnyCollection;
use crate::status::{fail, ferry_status, FERRY_ERR_INVALID_HANDLE};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// What a handle names.
#[derive(Clone)]
pub(crate) enum Object {
    Runtime(Arc<rt::Runtime>),
    Collection {
        owner: u64,
        coll: Arc<AnyCollection>,
    },
    Class {
        owner: u64,
        class: rt::TaskClass,
    },
    Kernel {
        owner: u64,
        kernel: Arc<crate::kernel::KernelSource>,
    },
    /// A communication engine (owned by no runtime).
    Engine(Arc<crate::engine::EngineObject>),
    /// Memory a placed get filled (`ferry_engine_get_placed`), until released.
    Placed(Arc<std::sync::Mutex<Option<eng::Placed>>>),
    /// A peer's device registration mapped here (`ferry_engine_map_peer`), until unmapped.
    PeerMapping {
        /// The engine that mapped it.
        engine: u64,
        /// Held for its drop, which unmaps.
        _mapping: Arc<eng::PeerMapping>,
    },
    /// GeoNames places (`ferry_places_load`), until freed.
    Places(Arc<Vec<ferry_kernels::geo::Place>>),
}

#[derive(Default)]
pub(crate) struct Registry {
    next: u64,
    objects: HashMap<u64, Object>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

pub(crate) fn lock() -> MutexGuard<'static, Option<Registry>> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// Stores `obj`; returns its id (never 0: 0 is the null handle).
pub(crate) fn insert(obj: Object) -> u64 {
    let mut g = lock();
    let r = g.get_or_insert_with(Registry::default);
    r.next += 1;
    let id = r.next;
    r.objects.insert(id, obj);
    id
}

/// Stores `obj`, which belongs to object `owner`, only while `owner` is in the table; gives it
/// back otherwise. One lock: an owner's removal followed by a sweep of what belongs to it (as
/// `ferry_engine_finalize` does) cannot miss an object stored by another thread meanwhile.
pub(crate) fn insert_owned(owner: u64, obj: Object) -> Result<u64, Object> {
    let mut g = lock();
    let r = g.get_or_insert_with(Registry::default);
    if !r.objects.contains_key(&owner) {
        return Err(obj);
    }
    r.next += 1;
    let id = r.next;
    r.objects.insert(id, obj);
    Ok(id)
}

/// A clone of object `id` (the table's lock is not held while the caller uses it).
pub(crate) fn get(id: u64) -> Option<Object> {
    lock().as_ref().and_then(|r| r.objects.get(&id).cloned())
}

/// Removes object `id` when `is` accepts it; returns it.
pub(crate) fn remove(id: u64, is: impl Fn(&Object) -> bool) -> Option<Object> {
    let mut g = lock();
    let r = g.as_mut()?;
    if !r.objects.get(&id).is_some_and(is) {
        return None;
    }
    r.objects.remove(&id)
}

/// Removes every object `is` accepts; returns them (dropped by the caller, outside the lock).
pub(crate) fn remove_all(is: impl Fn(&Object) -> bool) -> Vec<Object> {
    let mut g = lock();
    let Some(r) = g.as_mut() else { return Vec::new() };
    let ids: Vec<u64> = r.objects.iter().filter(|(_, o)| is(o)).map(|(&id, _)| id).collect();
    ids.into_iter().filter_map(|id| r.objects.remove(&id)).collect()
}

/// Removes runtime `id` and everything that belongs to it; returns the runtime.
pub(crate) fn remove_runtime(id: u64) -> Option<Arc<rt::Runtime>> {
    let mut g = lock();
    let r = g.as_mut()?;
    let rt = match r.objects.get(&id) {
        Some(Object::Runtime(rt)) => rt.clone(),
        _ => return None,
    };
    r.objects.retain(|&k, o| {
        k != id
            && !matches!(o, Object::Collection { owner, .. } | Object::Class { owner, .. } | Object::Kernel { owner, .. } if *owner == id)
    });
    Some(rt)
}

pub(crate) fn runtime(id: u64) -> Result<Arc<rt::Runtime>, ferry_status> {
    match get(id) {
        Some(Object::Runtime(rt)) => Ok(rt),
        _ => Err(fail(
            FERRY_ERR_INVALID_HANDLE,
            format!("{id} is not a live ferry_runtime"),
        )),
    }
}

pub(crate) fn collection(id: u64) -> Result<(u64, Arc<AnyCollection>), ferry_status> {
    match get(id) {
        Some(Object::Collection { owner, coll }) => Ok((owner, coll)),
        _ => Err(fail(
            FERRY_ERR_INVALID_HANDLE,
            format!("{id} is not a live ferry_collection"),
        )),
    }
}

pub(crate) fn class(id: u64) -> Result<(u64, rt::TaskClass), ferry_status> {
    match get(id) {
        Some(Object::Class { owner, class }) => Ok((owner, class)),
        _ => Err(fail(
            FERRY_ERR_INVALID_HANDLE,
            format!("{id} is not a live ferry_class"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object stored for a live owner is kept; once the owner is removed, storing another
    /// is refused and the object comes back (a finalize's sweep cannot miss it).
    #[test]
    fn objects_are_stored_only_beside_a_live_owner() {
        let places = || Object::Places(Arc::new(Vec::new()));
        let owner = insert(places());
        let kept = insert_owned(owner, places()).ok().expect("the owner is live");
        assert!(get(kept).is_some());
        assert!(remove(owner, |_| true).is_some());
        assert!(insert_owned(owner, places()).is_err(), "the owner is gone");
        assert!(remove(kept, |o| matches!(o, Object::Places(_))).is_some());
    }
}
