//! Where ready nodes go: tasks to the CPU workers, sends and receives to the MPI thread; and how
//! their completion flows back into the graph.

use super::node::{Node, Work};
use super::task::{TaskClass, TaskContext, TileArg};
use super::tracker::Tracker;
use crate::comm::{Cmd, CommHandle, MemRegion, Transfer};
use crate::data::buffer::TileBuf;
use crate::error::{FerryError, Rank, Result};
use crate::sched::{Job, Spawner};
use crate::stats::Counters;
use std::cell::RefCell;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

impl MemRegion for TileBuf {
    fn ptr(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn len(&self) -> usize {
        TileBuf::len(self)
    }
}

/// Shared by every thread that finishes nodes.
pub(crate) struct Dispatch {
    pub(crate) rank: Rank,
    pub(crate) spawner: Spawner<ReadyTask>,
    pub(crate) comm: CommHandle,
    pub(crate) tracker: Arc<Tracker>,
    pub(crate) counters: Arc<Counters>,
}

impl Dispatch {
    /// Drops the insertion reference of a freshly built node, dispatching it if it is ready.
    pub(crate) fn release(self: &Arc<Self>, node: Arc<Node>) {
        if node.release() {
            self.dispatch(node);
        }
    }

    fn dispatch(self: &Arc<Self>, node: Arc<Node>) {
        let Some(work) = node.take_work() else { return };
        match work {
            Work::Task {
                class,
                tiles,
                args,
                seq,
            } => self.spawner.spawn(ReadyTask {
                node,
                dispatch: self.clone(),
                class,
                tiles,
                args,
                seq,
            }),
            Work::Send { buf, peer, tag } => self.post_transfer(node, buf, peer, tag, true),
            Work::Recv { buf, peer, tag } => self.post_transfer(node, buf, peer, tag, false),
        }
    }

    fn post_transfer(self: &Arc<Self>, node: Arc<Node>, buf: Arc<TileBuf>, peer: Rank, tag: i32, send: bool) {
        let d = self.clone();
        let n = node.clone();
        let t = Transfer {
            region: buf,
            peer,
            tag,
            done: Box::new(move |r| d.finish(&n, r)),
        };
        let cmd = if send { Cmd::Send(t) } else { Cmd::Recv(t) };
        if let Err(e) = self.comm.post(cmd) {
            self.finish(&node, Err(e));
        }
    }

    /// Records the end of a node (successfully or not) and dispatches the successors it freed.
    pub(crate) fn finish(self: &Arc<Self>, node: &Node, result: Result<()>) {
        if let Err(e) = result {
            self.tracker.fail(e);
        }
        for next in node.complete() {
            self.dispatch(next);
        }
        self.tracker.done_one();
    }
}

/// A task whose inputs are all in place, queued for a CPU worker.
pub(crate) struct ReadyTask {
    node: Arc<Node>,
    dispatch: Arc<Dispatch>,
    class: TaskClass,
    tiles: Vec<TileArg>,
    args: Vec<i64>,
    seq: u64,
}

impl Job for ReadyTask {
    fn run(self, worker: usize) {
        let ReadyTask {
            node,
            dispatch,
            class,
            tiles,
            args,
            seq,
        } = self;
        // After an error the run is over: drain the graph without running bodies.
        let result = if dispatch.tracker.is_poisoned() {
            Ok(())
        } else {
            let name = class.name();
            let span = tracing::info_span!("task", class = name, seq);
            let _g = span.enter();
            let ctx = TaskContext {
                tiles: &tiles,
                args: &args,
                seq,
                rank: dispatch.rank,
                worker,
                borrows: RefCell::new(vec![0; tiles.len()]),
            };
            let t0 = Instant::now();
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (class.inner.cpu)(&ctx)));
            let ns = t0.elapsed().as_nanos() as u64;
            class.record(ns);
            if let Some(w) = dispatch.counters.workers.get(worker) {
                w.tasks.fetch_add(1, Relaxed);
                w.busy_ns.fetch_add(ns, Relaxed);
            }
            let failed = |msg: String| FerryError::TaskFailed {
                class: name.to_string(),
                seq,
                rank: dispatch.rank,
                msg,
            };
            match out {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(failed(e.to_string())),
                Err(panic) => Err(failed(panic_message(&panic))),
            }
        };
        drop(tiles);
        dispatch.finish(&node, result);
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".into()
    }
}
