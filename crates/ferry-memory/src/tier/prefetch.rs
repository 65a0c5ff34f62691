//! Look-ahead along the inserted task sequence: which copies the next tasks of this rank read,
//! so that the I/O thread can bring spilled ones back before the tasks are dispatched.
//!
//! Insertion runs ahead of execution (often by the whole graph), so the tasks inserted but not
//! yet dispatched are exactly the future of the run, in order. The prefetcher keeps them by
//! sequence number and looks at the oldest `window` of them; dispatched tasks leave the set.

use crate::data::copy::TileCopy;
use std::collections::BTreeMap;
use std::sync::{Mutex, Weak};

/// Tasks remembered at most (beyond, insertions are not tracked: they are far in the future).
const MAX_TRACKED: usize = 1 << 16;

/// Tasks inserted and not yet dispatched, with the copies they read.
pub struct Prefetch {
    window: usize,
    pending: Mutex<BTreeMap<u64, Vec<Weak<TileCopy>>>>,
}

impl Prefetch {
    pub fn new(window: usize) -> Prefetch {
        Prefetch {
            window,
            pending: Mutex::new(BTreeMap::new()),
        }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Vec<Weak<TileCopy>>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records task `seq`; returns whether it falls inside the window (worth a look now).
    pub fn insert(&self, seq: u64, reads: Vec<Weak<TileCopy>>) -> bool {
        if self.window == 0 || reads.is_empty() {
            return false;
        }
        let mut p = self.pending();
        if p.len() >= MAX_TRACKED {
            return false;
        }
        p.insert(seq, reads);
        p.len() <= self.window
    }

    /// Forgets task `seq`; returns whether the window moved (a new task entered it).
    pub fn remove(&self, seq: u64) -> bool {
        let mut p = self.pending();
        p.remove(&seq).is_some() && p.len() >= self.window
    }

    /// The copies the oldest `window` pending tasks read, in task order.
    pub fn upcoming(&self) -> Vec<Weak<TileCopy>> {
        self.pending()
            .values()
            .take(self.window)
            .flat_map(|v| v.iter().cloned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn window_follows_the_oldest_pending_tasks() {
        let p = Prefetch::new(2);
        let copies: Vec<Arc<TileCopy>> = (0..4)
            .map(|_| TileCopy::host(8, &crate::data::copy::CopyEnv::default()))
            .collect();
        for (k, c) in copies.iter().enumerate() {
            p.insert(k as u64, vec![Arc::downgrade(c)]);
        }
        let up = p.upcoming();
        assert_eq!(up.len(), 2);
        assert!(Arc::ptr_eq(&up[0].upgrade().unwrap(), &copies[0]));
        assert!(p.remove(0));
        let up = p.upcoming();
        assert!(Arc::ptr_eq(&up[0].upgrade().unwrap(), &copies[1]));
        assert!(Arc::ptr_eq(&up[1].upgrade().unwrap(), &copies[2]));
    }
}
