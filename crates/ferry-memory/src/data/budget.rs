//! The host-memory budget as the data layer sees it: the seam between tile copies and the host
//! tier (`crate::tier`), which implements [`HostBudget`]. The data layer counts each host
//! buffer against the budget, files each use of a copy, and frees a copy's disk slot when the
//! copy goes; the tier decides what to evict and when.

use crate::data::copy::TileCopy;
use ferry_device::pool::Block;
use std::sync::{Arc, Weak};

/// A host-memory budget that copies' host buffers count against (the host tier).
///
/// Called from any thread that makes, uses or drops a copy's host buffer, often with that
/// copy's state locked: no method may lock a copy's state or block.
pub trait HostBudget: Send + Sync + std::fmt::Debug {
    /// A host buffer of `bytes` bytes exists now.
    fn charge(&self, bytes: usize);
    /// A host buffer of `bytes` bytes is gone.
    fn uncharge(&self, bytes: usize);
    /// The copy behind `me` was used: it becomes the most recently used; `stamp` (kept in the
    /// copy's state, which the caller holds locked) tells stale entries of the LRU from the
    /// current one.
    fn touch(&self, me: &Weak<TileCopy>, stamp: &mut u64);
    /// The copy that held `slot` of the disk tier is gone: the slot is free.
    fn release_disk(&self, slot: Block);
}

/// What a copy's state keeps of the host budget: the budget, and a handle on the copy itself
/// for its LRU.
#[derive(Debug, Clone)]
pub struct BudgetLink {
    /// The budget.
    pub budget: Arc<dyn HostBudget>,
    /// The copy itself, as the LRU files it.
    pub me: Weak<TileCopy>,
}
