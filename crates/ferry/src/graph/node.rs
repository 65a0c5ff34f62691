//! A node of the local dependency graph: a task, a send or a receive, with a counter of
//! unfinished predecessors and the list of its successors.
//!
//! The protocol is the classic one of STF runtimes (Quark, StarPU): a node starts with one extra
//! "insertion" reference so it cannot fire while edges are still being added; `add_dep` adds an
//! edge unless the predecessor already finished; `release` drops one reference and hands the node
//! to its executor when the count reaches zero; `complete` marks a node finished and releases its
//! successors. No lock is held across a wait: the successor list's mutex only guards a push or a
//! take.

use super::task::{TaskClass, TileArg};
use crate::data::copy::TileCopy;
use crate::error::Rank;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What a node does once its predecessors have finished.
pub(crate) enum Work {
    Task {
        class: TaskClass,
        tiles: Vec<TileArg>,
        args: Vec<i64>,
        seq: u64,
        priority: i32,
    },
    Send {
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
    },
    Recv {
        copy: Arc<TileCopy>,
        peer: Rank,
        tag: i32,
        /// The task that consumes it runs on a device: comm-in reserves device memory for it.
        to_device: bool,
    },
    /// Several small tiles for one peer as one message (`FERRY_PACK_BYTES`).
    SendPacked {
        copies: Vec<Arc<TileCopy>>,
        peer: Rank,
        tag: i32,
    },
    /// Their receipt, into fresh copies.
    RecvPacked {
        copies: Vec<Arc<TileCopy>>,
        peer: Rank,
        tag: i32,
    },
}

#[derive(Default)]
struct Successors {
    done: bool,
    list: Vec<Arc<Node>>,
}

pub(crate) struct Node {
    pending: AtomicUsize,
    succ: Mutex<Successors>,
    work: Mutex<Option<Work>>,
}

impl Node {
    /// A node holding its insertion reference.
    pub(crate) fn new(work: Work) -> Arc<Node> {
        Arc::new(Node {
            pending: AtomicUsize::new(1),
            succ: Mutex::default(),
            work: Mutex::new(Some(work)),
        })
    }

    /// Makes `self` wait for `pred`, unless `pred` has already finished.
    pub(crate) fn add_dep(self: &Arc<Self>, pred: &Arc<Node>) {
        let mut s = pred.succ.lock().unwrap_or_else(|p| p.into_inner());
        if !s.done {
            self.pending.fetch_add(1, Ordering::AcqRel);
            s.list.push(self.clone());
        }
    }

    /// Drops one reference; returns `true` when the node became ready (the caller dispatches it).
    #[must_use]
    pub(crate) fn release(&self) -> bool {
        self.pending.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Whether the node has finished.
    pub(crate) fn is_done(&self) -> bool {
        self.succ.lock().unwrap_or_else(|p| p.into_inner()).done
    }

    /// Takes the work out (once, when dispatching).
    pub(crate) fn take_work(&self) -> Option<Work> {
        self.work.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Marks the node finished and returns the successors that became ready.
    pub(crate) fn complete(&self) -> Vec<Arc<Node>> {
        let list = {
            let mut s = self.succ.lock().unwrap_or_else(|p| p.into_inner());
            s.done = true;
            std::mem::take(&mut s.list)
        };
        list.into_iter().filter(|n| n.release()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send() -> Work {
        Work::Send {
            copy: TileCopy::host(8, &Default::default()),
            peer: 0,
            tag: 0,
        }
    }

    #[test]
    fn fires_after_all_predecessors() {
        let a = Node::new(send());
        let b = Node::new(send());
        let c = Node::new(send());
        c.add_dep(&a);
        c.add_dep(&b);
        assert!(!c.release()); // insertion reference dropped, two edges left
        assert!(a.release() && b.release());
        assert!(a.complete().is_empty());
        let ready = b.complete();
        assert_eq!(ready.len(), 1);
        assert!(Arc::ptr_eq(&ready[0], &c));
        // An edge to a finished node is not added.
        let d = Node::new(send());
        d.add_dep(&a);
        assert!(d.release());
    }
}
