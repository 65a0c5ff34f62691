//! A node of the local dependency graph: a task, a send or a receive, with a counter of
//! unfinished predecessors and the list of its successors.
//!
//! The protocol is the classic one of STF runtimes (Quark, StarPU): a node starts with one extra
//! "insertion" reference so it cannot fire while edges are still being added; `add_dep` adds an
//! edge unless the predecessor already finished; `release` drops one reference and hands the node
//! to its executor when the count reaches zero; `complete` marks a node finished and releases its
//! successors. No lock is held across a wait: the successor list's mutex only guards a push or a
//! take.
//!
//! Launch-ahead: a GPU task's successors that are GPU tasks themselves need not wait for it to
//! *finish*. Once it is *launched* ([`Node::launched`]), they are released early, bound to its
//! device and told its sequence number ([`Early`]); the GPU manager then orders them after it on
//! the device (a stream waits for its event) instead of the host waiting for its completion and
//! launching them afterwards — one host round trip less per edge of a chain.

use super::task::{TaskArgs, TaskClass, TileArg, TileArgs};
use ferry_base::error::Rank;
use ferry_memory::data::copy::TileCopy;
pub(crate) use ferry_memory::manager::{AckWaits, AfterSeqs, DeviceAck};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The edges of a node being inserted: each predecessor it waits for, once.
///
/// A task reaches one predecessor through several tiles as a rule (on every step of a stencil,
/// it reads what the tasks of the step before wrote and overwrites a tile that they read), and
/// [`Node::add_dep`] takes the predecessor's lock — a cache line of the worker that runs or
/// finished it — even for an edge it then finds already made. The first [`EDGES_SEEN`]
/// predecessors met are kept here by address, and a repeat among them costs a compare. (An
/// address cannot be reused while the node's edges are added: no node is made meanwhile. A
/// predecessor past the first [`EDGES_SEEN`] — a writer after many readers — is not looked up,
/// so the cost stays linear; a repeat of it is an edge twice, which `add_dep` mostly catches
/// and which is harmless anyway: the node is released once per entry.)
pub(crate) struct Edges<'a> {
    node: &'a Arc<Node>,
    seen: SmallVec<[*const Node; 8]>,
}

/// Predecessors an [`Edges`] remembers.
const EDGES_SEEN: usize = 16;

impl<'a> Edges<'a> {
    /// The edges of `node`, none yet.
    pub(crate) fn new(node: &'a Arc<Node>) -> Edges<'a> {
        Edges {
            node,
            seen: SmallVec::new(),
        }
    }

    /// The node whose edges these are.
    pub(crate) fn node(&self) -> &'a Arc<Node> {
        self.node
    }

    /// Makes the node wait for `pred` ([`Node::add_dep`]) unless it already does.
    pub(crate) fn after(&mut self, pred: &Arc<Node>) {
        let p = Arc::as_ptr(pred);
        if self.seen.contains(&p) {
            return;
        }
        if self.seen.len() < EDGES_SEEN {
            self.seen.push(p);
        }
        self.node.add_dep(pred);
    }
}

/// What a node does once its predecessors have finished.
pub(crate) enum Work {
    Task {
        class: TaskClass,
        tiles: TileArgs,
        args: TaskArgs,
        seq: u64,
        priority: i32,
        /// The device acknowledgements it could wait for: unfinished sends, over the IPC route,
        /// of the versions of tiles it overwrites, counted at its insertion (only where device
        /// acknowledgements are on; saturates at 255).
        ack_waits: u8,
        /// Whether its tiles are small enough for its worker to drop its references later
        /// (`dispatch::SpentTask`), decided at insertion, where their sizes are at hand.
        small: bool,
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

/// A node's successors, inline up to 4: most nodes of a task graph have few, and one heap
/// allocation per node (made by the inserting thread, freed by a worker) was a measurable part
/// of an empty task's cost.
#[derive(Default)]
struct Successors {
    done: bool,
    list: SmallVec<[Arc<Node>; 4]>,
}

/// The successors that became ready when a node finished.
pub(crate) type Ready = SmallVec<[Arc<Node>; 4]>;

pub(crate) struct Node {
    pending: AtomicUsize,
    /// Mirrors `Successors::done` for [`Node::is_done`]: the inserting thread asks it of every
    /// node it holds per access, and a load leaves the line shared where taking the lock would
    /// pull it away from the worker that finishes the node.
    finished: AtomicBool,
    succ: Mutex<Successors>,
    work: Mutex<Option<Work>>,
    early: Mutex<Option<Early>>,
}

/// How a node was released early by launched GPU tasks: the device they run on (all of them:
/// an edge from a task on another device waits for completion as usual) and their sequence
/// numbers, which the GPU manager orders the node after — and by IPC sends of tiles it
/// overwrites from that device, whose consumers acknowledge on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Early {
    pub(crate) device: usize,
    pub(crate) after: AfterSeqs,
    pub(crate) acks: AckWaits,
}

/// What an early release orders the released node after, on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EarlyDep {
    /// A launched GPU task (its sequence number) or a comm-in copy (its key).
    Launched(u64),
    /// A consumer's device acknowledgement of an IPC send (`ferry-transfer/src/ack.rs`).
    Acked(DeviceAck),
}

impl Node {
    /// A node holding its insertion reference.
    pub(crate) fn new(work: Work) -> Arc<Node> {
        Arc::new(Node {
            pending: AtomicUsize::new(1),
            finished: AtomicBool::new(false),
            succ: Mutex::default(),
            work: Mutex::new(Some(work)),
            early: Mutex::new(None),
        })
    }

    /// Whether the node is a task that `accept` accepts, given its class and tiles (looked at
    /// before it is dispatched).
    pub(crate) fn is_task_where(&self, accept: impl Fn(&TaskClass, &[TileArg]) -> bool) -> bool {
        matches!(&*self.work.lock().unwrap_or_else(|p| p.into_inner()), Some(Work::Task { class, tiles, .. }) if accept(class, tiles))
    }

    /// Whether the node is a task that could wait for at least `min` device acknowledgements
    /// (counted at its insertion) and that `accept` accepts, given its class and tiles (looked
    /// at before it is dispatched).
    pub(crate) fn is_task_awaiting(&self, min: usize, accept: impl Fn(&TaskClass, &[TileArg]) -> bool) -> bool {
        matches!(&*self.work.lock().unwrap_or_else(|p| p.into_inner()), Some(Work::Task { class, tiles, ack_waits, .. }) if usize::from(*ack_waits) >= min && accept(class, tiles))
    }

    /// Launch-ahead: this node, a GPU task with sequence number `seq`, was launched on
    /// `device`: [`Node::release_early`] with [`EarlyDep::Launched`].
    pub(crate) fn launched(&self, device: usize, seq: u64, eligible: impl Fn(&Node) -> bool) -> (Ready, bool) {
        self.release_early(device, EarlyDep::Launched(seq), eligible)
    }

    /// Early release: what this node stands for on `device` is ordered there by `dep` — a GPU
    /// task launched, or an IPC send whose consumer acknowledges on the device. Each successor
    /// that `eligible` accepts and that nothing on another device has released early yet is
    /// released now (and leaves the list, so that [`Node::complete`] does not release it
    /// again), bound to `device` and ordered after `dep`; the others stay for `complete`.
    /// Returns the successors that became ready, and whether any successor was released early.
    pub(crate) fn release_early(
        &self,
        device: usize,
        dep: EarlyDep,
        eligible: impl Fn(&Node) -> bool,
    ) -> (Ready, bool) {
        let mut ready = Ready::new();
        let mut s = self.succ.lock().unwrap_or_else(|p| p.into_inner());
        if s.done {
            return (ready, false);
        }
        let before = s.list.len();
        s.list.retain(|n| {
            if !eligible(n) {
                return true;
            }
            {
                let mut e = n.early.lock().unwrap_or_else(|p| p.into_inner());
                let x = match &mut *e {
                    Some(x) if x.device != device => return true,
                    Some(x) => x,
                    None => e.insert(Early {
                        device,
                        after: AfterSeqs::new(),
                        acks: AckWaits::new(),
                    }),
                };
                match dep {
                    EarlyDep::Launched(seq) => x.after.push(seq),
                    EarlyDep::Acked(a) => x.acks.push(a),
                }
            }
            if n.release() {
                ready.push(n.clone());
            }
            false
        });
        let any = s.list.len() < before;
        (ready, any)
    }

    /// Offers at launch: this node, a GPU task, was just launched. Takes out of its successor
    /// list those that `eligible` accepts and that wait for nothing but this node — if there is
    /// any and `ready()` then agrees (it makes what they need: it is not called when none is
    /// eligible, and when it says no, nothing changes) — and returns them released and ready,
    /// for the caller to run now rather than at [`Node::complete`].
    ///
    /// `ready` runs without the successor lock (it may make a driver call), so a successor that
    /// became eligible meanwhile may be taken too; nothing but the caller's thread removes
    /// successors of a launched node before it completes.
    pub(crate) fn offered(&self, eligible: impl Fn(&Node) -> bool, ready: impl FnOnce() -> bool) -> Vec<Arc<Node>> {
        // Only this node's edge left: releasing it makes the successor ready, so it can never
        // be dispatched the ordinary way while this node still runs.
        let alone = |n: &Node| n.pending.load(Ordering::Acquire) == 1 && eligible(n);
        let any = {
            let s = self.succ.lock().unwrap_or_else(|p| p.into_inner());
            !s.done && s.list.iter().any(|n| alone(n))
        };
        if !any || !ready() {
            return Vec::new();
        }
        let mut s = self.succ.lock().unwrap_or_else(|p| p.into_inner());
        if s.done {
            return Vec::new();
        }
        let mut out = Vec::new();
        s.list.retain(|n| {
            if !alone(n) {
                return true;
            }
            let fired = n.release();
            debug_assert!(fired, "a successor with one pending edge fires on its release");
            out.push(n.clone());
            false
        });
        out
    }

    /// Whether some successor not yet released is one that `eligible` accepts.
    pub(crate) fn has_successor_where(&self, eligible: impl Fn(&Node) -> bool) -> bool {
        let s = self.succ.lock().unwrap_or_else(|p| p.into_inner());
        !s.done && s.list.iter().any(|n| eligible(n))
    }

    /// Whether the node is a send that `accept` accepts, given its copy and peer.
    pub(crate) fn is_send_where(&self, accept: impl Fn(&Arc<TileCopy>, Rank) -> bool) -> bool {
        matches!(&*self.work.lock().unwrap_or_else(|p| p.into_inner()), Some(Work::Send { copy, peer, .. }) if accept(copy, *peer))
    }

    /// How the node was released early, if it was (taken once, when dispatching).
    pub(crate) fn take_early(&self) -> Option<Early> {
        self.early.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Makes `self` wait for `pred`, unless `pred` has already finished.
    pub(crate) fn add_dep(self: &Arc<Self>, pred: &Arc<Node>) {
        // A finished predecessor is seen without its lock: a load leaves the line shared with
        // the worker that finished it, where the lock's two writes would take it over.
        if pred.is_done() {
            return;
        }
        let mut s = pred.succ.lock().unwrap_or_else(|p| p.into_inner());
        // One edge per pair. The inserter's `Edges` skips the repeats it remembers; this catches
        // the rest that follow at once (edges are added one task at a time, so a repeat is the
        // list's last entry). A duplicate costs a count, a clone, a release — and spills the
        // inline list.
        if !s.done && !s.list.last().is_some_and(|l| Arc::ptr_eq(l, self)) {
            self.pending.fetch_add(1, Ordering::AcqRel);
            s.list.push(self.clone());
        }
    }

    /// Drops one reference; returns `true` when the node became ready (the caller dispatches it).
    #[must_use]
    pub(crate) fn release(&self) -> bool {
        self.pending.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Whether the node has finished. Once true it stays true (`add_dep` relies on that to skip
    /// the lock); false may be stale (pruning treats it as a hint).
    pub(crate) fn is_done(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Takes the work out (once, when dispatching).
    pub(crate) fn take_work(&self) -> Option<Work> {
        self.work.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Marks the node finished and returns the successors that became ready.
    pub(crate) fn complete(&self) -> Ready {
        let list = {
            let mut s = self.succ.lock().unwrap_or_else(|p| p.into_inner());
            s.done = true;
            self.finished.store(true, Ordering::Release);
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
        // Nor one that exists: the node waits for its predecessor once.
        let (e, f) = (Node::new(send()), Node::new(send()));
        f.add_dep(&e);
        f.add_dep(&e);
        assert!(!f.release());
        assert!(e.release());
        let ready = e.complete();
        assert_eq!(ready.len(), 1, "one edge, released once");
        assert!(Arc::ptr_eq(&ready[0], &f));
    }

    /// `Edges` makes one edge per predecessor however often it is met, and none to a finished
    /// one: the node fires exactly when its unfinished predecessors have all finished.
    #[test]
    fn edges_wait_for_each_predecessor_once() {
        let (a, b, done) = (Node::new(send()), Node::new(send()), Node::new(send()));
        assert!(done.release());
        assert!(done.complete().is_empty());
        let n = Node::new(send());
        let mut e = Edges::new(&n);
        for p in [&a, &b, &a, &done, &b, &a] {
            e.after(p);
        }
        assert_eq!(
            n.pending.load(Ordering::Acquire),
            3,
            "the insertion reference and two edges"
        );
        assert_eq!(a.succ.lock().unwrap().list.len(), 1);
        assert_eq!(b.succ.lock().unwrap().list.len(), 1);
        assert!(!n.release());
        assert!(a.release() && a.complete().is_empty());
        assert!(b.release());
        let ready = b.complete();
        assert_eq!(ready.len(), 1);
        assert!(Arc::ptr_eq(&ready[0], &n));
        // Past the predecessors it remembers, a repeat still makes no second edge when it
        // follows at once (`add_dep`'s own check), and the node still fires once, last.
        let preds: Vec<_> = (0..EDGES_SEEN + 4).map(|_| Node::new(send())).collect();
        let m = Node::new(send());
        let mut e = Edges::new(&m);
        for p in &preds {
            e.after(p);
            e.after(p);
        }
        assert_eq!(m.pending.load(Ordering::Acquire), 1 + preds.len());
        assert!(!m.release());
        for (k, p) in preds.iter().enumerate() {
            assert!(p.release());
            let ready = p.complete();
            assert_eq!(ready.len(), usize::from(k + 1 == preds.len()));
        }
    }

    /// Launch-ahead: eligible successors are released when a predecessor is launched, bound to
    /// its device; a second launched predecessor on the same device adds itself, one on another
    /// device leaves the edge for completion; `complete` does not release them twice.
    #[test]
    fn launched_releases_eligible_successors_early() {
        let (p, q, r) = (Node::new(send()), Node::new(send()), Node::new(send()));
        let (s, t) = (Node::new(send()), Node::new(send()));
        s.add_dep(&p);
        s.add_dep(&q);
        s.add_dep(&r);
        t.add_dep(&p);
        assert!(!s.release() && !t.release());
        let only_s = |n: &Node| std::ptr::eq(n, &*s);
        let none = |(ready, any): (Ready, bool)| (ready.is_empty(), any);
        assert_eq!(
            none(p.launched(0, 10, only_s)),
            (true, true),
            "s still waits for q and r"
        );
        assert_eq!(none(q.launched(0, 11, only_s)), (true, true), "s still waits for r");
        assert_eq!(
            none(r.launched(1, 12, only_s)),
            (true, false),
            "r runs on device 1: s waits for its end"
        );
        assert_eq!(
            *s.early.lock().unwrap(),
            Some(Early {
                device: 0,
                after: smallvec::smallvec![10, 11],
                acks: AckWaits::new(),
            })
        );
        // p's completion releases t (not eligible) and not s again.
        let ready = p.complete();
        assert_eq!(ready.len(), 1);
        assert!(Arc::ptr_eq(&ready[0], &t));
        assert!(q.complete().is_empty());
        let ready = r.complete();
        assert_eq!(ready.len(), 1);
        assert!(Arc::ptr_eq(&ready[0], &s));
        assert_eq!(s.take_early().map(|e| e.after.to_vec()), Some(vec![10, 11]));
        assert_eq!(s.take_early(), None);
    }
}
