//! A fused launch on a CUDA device ([`crate::fused`]). The parts run fork-join over the
//! device's exec streams, so that independent parts overlap: each part on the stream of a
//! predecessor whose newest part it is, else on the next stream round-robin, after events of its
//! predecessors on other streams.
//!
//! The first launch runs them so, directly: bodies create their per-stream library handles and
//! workspaces then, outside a capture (where an allocation would become a node of the graph).
//! The second captures the same enqueueing into a CUDA graph (`cuStreamBeginCapture`, relaxed
//! mode) and instantiates it; later launches are one `cuGraphLaunch` on the launch's stream
//! while the tiles keep their addresses (and the arguments and sequence numbers a body read stay
//! the same). Otherwise the parts are captured again, and the instantiated graph is updated in
//! place (`cuGraphExecUpdate`) when its shape allows, else instantiated anew.
//!
//! A launch of the graph is ordered after the work already on the exec streams it was captured
//! on, and before the work enqueued there next, as the direct enqueueing is: its nodes use those
//! streams' library handles and workspaces.
//!
//! A capture that fails, holds memory nodes or cannot be instantiated runs the launch directly
//! instead; after [`CAPTURE_ATTEMPTS`] such failures the sequence always runs directly, with a
//! warning.

use super::context::{READ_ARGS, READ_SEQ};
use super::{cuda_err, CudaTaskContext};
use crate::fused::Fused;
use crate::DeviceError;
use cudarc::driver::{result, sys, CudaContext};
use ferry_base::error::TaskError;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The last capture of a fused sequence.
#[derive(Default)]
pub(crate) struct Cache {
    captured: Option<Captured>,
    /// The sequence has run once (directly).
    warm: bool,
    /// Captures that failed where running the parts directly did not.
    failures: u32,
}

/// An instantiated graph and what it was captured for.
struct Captured {
    device: usize,
    ptrs: Vec<usize>,
    /// The launch's arguments and sequence number, where a body read them.
    args: Option<Vec<i64>>,
    seq: Option<u64>,
    /// The exec streams the parts were captured on: their library handles and workspaces are
    /// in the graph's nodes, so a launch is ordered with the other work on those streams.
    lanes: Vec<usize>,
    graph: sys::CUgraph,
    /// `None` for a graph without nodes (bodies that enqueue nothing): nothing to launch.
    exec: Option<sys::CUgraphExec>,
    /// Keeps the context alive until the handles are destroyed.
    ctx: Arc<CudaContext>,
}

// SAFETY: CUDA graph handles may be used from any thread with their context bound; only the GPU
// manager's thread launches them, and `Drop` binds the context first.
unsafe impl Send for Captured {}

impl Captured {
    fn matches(&self, ctx: &CudaTaskContext<'_>) -> bool {
        self.device == ctx.device
            && self.ptrs.len() == ctx.tiles.len()
            && self.ptrs.iter().zip(ctx.tiles).all(|(&p, t)| p == t.ptr as usize)
            && self.args.as_deref().is_none_or(|a| a == ctx.args)
            && self.seq.is_none_or(|s| s == ctx.seq)
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: handles this value owns, with their context bound; errors leave a leak only.
        unsafe {
            if let Some(exec) = self.exec.take() {
                let _ = result::graph::exec_destroy(exec);
            }
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// Captures that may fail (where running the parts directly works) before a sequence is run
/// directly for good.
const CAPTURE_ATTEMPTS: u32 = 2;

/// Launches `f` on `ctx`'s stream (see the module documentation).
pub(crate) fn launch(f: &Fused, ctx: &CudaTaskContext<'_>) -> Result<(), TaskError> {
    let per_part = f.split_args(ctx.args)?;
    let mut cache = f.graph.lock().unwrap_or_else(|p| p.into_inner());
    // The first launch runs the parts directly, over the same streams a capture uses: bodies
    // create their per-stream library handles and workspaces then, not inside a capture
    // (where an allocation would become a node of the graph).
    if !cache.warm || cache.failures >= CAPTURE_ATTEMPTS {
        cache.warm = true;
        return direct(f, ctx, &per_part);
    }
    if let Some(c) = cache.captured.as_ref().filter(|c| c.matches(ctx)) {
        return run(c, ctx);
    }
    let captured = enqueue(f, ctx, &per_part, true).and_then(|(graph, read, lanes)| {
        let graph = graph.ok_or("cuStreamEndCapture returned no graph")?;
        let nodes = check_nodes(graph).inspect_err(|_| {
            // SAFETY: the graph the capture produced, owned here.
            let _ = unsafe { result::graph::destroy(graph) };
        })?;
        let previous = cache.captured.take();
        instantiate(graph, nodes, previous, ctx, read, lanes, f).map_err(|e| e.to_string())
    });
    match captured {
        Ok(c) => {
            f.counters().captures.fetch_add(1, Relaxed);
            let c = cache.captured.insert(c);
            run(c, ctx)
        }
        Err(capture_error) => {
            // Nothing of a failed capture or instantiation ran: the parts run directly; if they
            // succeed so, the graph (not a body) is what failed.
            direct(f, ctx, &per_part)?;
            cache.failures += 1;
            cache.captured = None;
            if cache.failures >= CAPTURE_ATTEMPTS {
                tracing::warn!(fused = f.name(), error = %capture_error, "a fused sequence cannot be captured into a CUDA graph: its kernels are launched one by one");
            }
            Ok(())
        }
    }
}

/// The number of nodes of a captured graph; refuses one with memory nodes: a body allocated
/// (or freed) stream-ordered memory while captured, which a graph launched again and again
/// cannot repeat.
fn check_nodes(graph: sys::CUgraph) -> Result<usize, String> {
    let mut n = 0usize;
    // SAFETY: a null array asks for the count.
    let counted = unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) };
    if counted != sys::CUresult::CUDA_SUCCESS {
        // A count of a captured graph without nodes (bodies that enqueue nothing) failed with
        // CUDA_ERROR_INVALID_VALUE on H100 (driver 580): ask with room for one node instead.
        let mut one = [std::ptr::null_mut(); 1];
        let mut m = 1usize;
        // SAFETY: an array of `m` entries.
        unsafe { sys::cuGraphGetNodes(graph, one.as_mut_ptr(), &mut m) }
            .result()
            .map_err(|e| format!("cuGraphGetNodes: {e}"))?;
        if m == 0 {
            return Ok(0);
        }
        return Err(format!("cuGraphGetNodes: {counted:?}"));
    }
    if n == 0 {
        return Ok(0);
    }
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: an array of `n` entries.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }
        .result()
        .map_err(|e| format!("cuGraphGetNodes: {e}"))?;
    for &node in nodes.iter().take(n) {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut t) }
            .result()
            .map_err(|e| format!("cuGraphNodeGetType: {e}"))?;
        if matches!(
            t,
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC | sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE
        ) {
            return Err("a body allocated or freed device memory while captured".into());
        }
    }
    Ok(n)
}

/// Launches a captured graph on `ctx`'s stream, after the work already on the exec streams it
/// was captured on and before the work enqueued there next: its nodes use those streams'
/// library handles and workspaces, which kernels enqueued there directly use too.
fn run(c: &Captured, ctx: &CudaTaskContext<'_>) -> Result<(), TaskError> {
    let Some(exec) = c.exec else {
        return Ok(());
    };
    let origin = ctx.stream.cu_stream();
    let others: Vec<sys::CUstream> = c
        .lanes
        .iter()
        .filter(|&&l| l != ctx.lane)
        .filter_map(|&l| ctx.lanes.get(l).map(|s| s.cu_stream()))
        .collect();
    let order = |from: sys::CUstream, to: sys::CUstream| -> Result<(), TaskError> {
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| TaskError::from(format!("cuEventCreate: {e}")))?;
        // SAFETY: streams of the bound context; the event is destroyed once the wait is
        // enqueued (the driver releases it when it has completed).
        let r = unsafe {
            result::event::record(ev, from)
                .and_then(|()| result::stream::wait_event(to, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT))
        };
        // SAFETY: as above.
        let _ = unsafe { result::event::destroy(ev) };
        r.map_err(|e| TaskError::from(format!("ordering a graph launch with its streams: {e}")))
    };
    for &s in &others {
        order(s, origin)?;
    }
    // SAFETY: an instantiated graph of this context (bound by the launch) and a live stream.
    unsafe { result::graph::launch(exec, origin) }.map_err(|e| TaskError::from(format!("cuGraphLaunch: {e}")))?;
    for &s in &others {
        order(origin, s)?;
    }
    Ok(())
}

/// Runs the parts without a graph, over the streams a capture would use.
fn direct(f: &Fused, ctx: &CudaTaskContext<'_>, per_part: &[&[i64]]) -> Result<(), TaskError> {
    f.counters().direct.fetch_add(1, Relaxed);
    enqueue(f, ctx, per_part, false).map(drop).map_err(TaskError::from)
}

/// Makes an executable graph of `graph` (of `nodes` nodes: none, nothing to launch): the previous capture's, updated in place, when it was
/// for the same device and the update is accepted; else a new instantiation.
#[allow(clippy::too_many_arguments)]
fn instantiate(
    graph: sys::CUgraph,
    nodes: usize,
    previous: Option<Captured>,
    ctx: &CudaTaskContext<'_>,
    read: u8,
    lanes: Vec<usize>,
    f: &Fused,
) -> Result<Captured, DeviceError> {
    let fresh = |exec| Captured {
        device: ctx.device,
        ptrs: ctx.tiles.iter().map(|t| t.ptr as usize).collect(),
        args: (read & READ_ARGS != 0).then(|| ctx.args.to_vec()),
        seq: (read & READ_SEQ != 0).then_some(ctx.seq),
        lanes: lanes.clone(),
        graph,
        exec,
        ctx: ctx.stream.context().clone(),
    };
    if nodes == 0 {
        return Ok(fresh(None));
    }
    if let Some(mut old) = previous.filter(|p| p.device == ctx.device) {
        if let Some(exec) = old.exec {
            // SAFETY: an executable graph and a graph of the same context.
            let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
            let r = unsafe { sys::cuGraphExecUpdate_v2(exec, graph, &mut info) };
            if r == sys::CUresult::CUDA_SUCCESS {
                old.exec = None;
                f.counters().updates.fetch_add(1, Relaxed);
                return Ok(fresh(Some(exec)));
            }
        }
        // Dropping `old` destroys its graph and executable graph.
    }
    // SAFETY: a complete graph of the bound context; on failure it is destroyed here.
    match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
        Ok(exec) => Ok(fresh(Some(exec))),
        Err(e) => {
            // SAFETY: the graph is this function's.
            let _ = unsafe { result::graph::destroy(graph) };
            Err(cuda_err("cuGraphInstantiate")(e))
        }
    }
}

/// Runs part `k`'s body on `part` (its context), catching a panic as the part's failure.
fn run_part(f: &Fused, k: usize, part: &CudaTaskContext<'_>) -> Result<(), TaskError> {
    let p = &f.parts()[k];
    let name = p.kernel.name();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.kernel.run_cuda(part)));
    let e = match r {
        Ok(Some(Ok(()))) => return Ok(()),
        Ok(None) => "has no CUDA body".to_string(),
        Ok(Some(Err(e))) => e.to_string(),
        Err(panic) => format!("panicked: {}", ferry_base::error::panic_message(&*panic)),
    };
    Err(format!("`{name}` (part {k} of fused `{}`): {e}", f.name()).into())
}

/// Enqueues the parts fork-join over the device's exec streams: each part on the stream of a
/// predecessor whose newest part it is (stream order then stands for the dependency), else on
/// the next stream round-robin, after events of its predecessors on other streams; every
/// stream joins the launch's stream at the end. With `capture`, into a graph (returned, with
/// what the bodies read: [`READ_ARGS`], [`READ_SEQ`]) instead of running. Also returns the
/// streams that took part.
///
/// # Errors
/// A body's failure or a driver call's; a capture is ended and its graph destroyed.
fn enqueue(
    f: &Fused,
    ctx: &CudaTaskContext<'_>,
    per_part: &[&[i64]],
    capture: bool,
) -> Result<(Option<sys::CUgraph>, u8, Vec<usize>), String> {
    let lanes = ctx.lanes;
    let origin = ctx.stream.cu_stream();
    let cu = |l: usize| lanes[l].cu_stream();
    let n = f.parts().len();
    let mut events: Vec<sys::CUevent> = Vec::with_capacity(n + lanes.len() + 1);
    let event = |events: &mut Vec<sys::CUevent>| -> Result<sys::CUevent, String> {
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| format!("cuEventCreate: {e}"))?;
        events.push(e);
        Ok(e)
    };
    if capture {
        // SAFETY: a stream of the bound context; the capture is ended below whatever happens.
        let r =
            unsafe { result::stream::begin_capture(origin, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) };
        r.map_err(|e| format!("cuStreamBeginCapture: {e}"))?;
    }
    let mut joined = vec![false; lanes.len()];
    joined[ctx.lane] = true;
    let mut read = 0u8;
    let body = (|| -> Result<(), String> {
        // The other streams start after what the launch's stream waits for (its stage-in).
        let fork = event(&mut events)?;
        // SAFETY: streams of the bound context; every event is destroyed below (the driver
        // releases one still pending once it completes).
        unsafe { result::event::record(fork, origin) }.map_err(|e| format!("cuEventRecord: {e}"))?;
        let mut lane_of = vec![0usize; n];
        let mut part_event = vec![std::ptr::null_mut(); n];
        let mut newest: Vec<Option<usize>> = vec![None; lanes.len()];
        // Round-robin over the non-priority streams (0 is the high-priority one).
        let mut next = 0usize;
        for k in 0..n {
            let deps = f.deps(k);
            let lane = deps
                .iter()
                .rev()
                .map(|&d| d as usize)
                .find(|&d| newest[lane_of[d]] == Some(d))
                .map(|d| lane_of[d])
                .unwrap_or_else(|| {
                    next += 1;
                    if lanes.len() > 1 {
                        1 + next % (lanes.len() - 1)
                    } else {
                        0
                    }
                });
            if !joined[lane] {
                // SAFETY: as above.
                unsafe { result::stream::wait_event(cu(lane), fork, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                    .map_err(|e| format!("cuStreamWaitEvent: {e}"))?;
                joined[lane] = true;
            }
            for &d in deps {
                if lane_of[d as usize] != lane {
                    // SAFETY: as above.
                    unsafe {
                        result::stream::wait_event(
                            cu(lane),
                            part_event[d as usize],
                            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                        )
                    }
                    .map_err(|e| format!("cuStreamWaitEvent: {e}"))?;
                }
            }
            let tiles = f.part_tiles(k, ctx.tiles).map_err(|e| e.to_string())?;
            let part = CudaTaskContext {
                stream: &lanes[lane],
                tiles: &tiles,
                args: per_part[k],
                seq: ctx.seq + f.parts()[k].seq_offset,
                resources: &ctx.lane_resources[lane],
                lane,
                read: Default::default(),
                ..*ctx
            };
            run_part(f, k, &part).map_err(|e| e.to_string())?;
            read |= part.read.get();
            let ev = event(&mut events)?;
            // SAFETY: as above.
            unsafe { result::event::record(ev, cu(lane)) }.map_err(|e| format!("cuEventRecord: {e}"))?;
            part_event[k] = ev;
            lane_of[k] = lane;
            newest[lane] = Some(k);
        }
        Ok(())
    })();
    // Join every stream that took part back into the launch's stream, whatever happened: the
    // manager's event after the launch must cover all of it, and a capture ends only with all
    // its streams joined.
    let mut join = || -> Result<(), String> {
        for l in (0..lanes.len()).filter(|&l| joined[l] && l != ctx.lane) {
            let ev = event(&mut events)?;
            // SAFETY: as above.
            unsafe {
                result::event::record(ev, cu(l)).map_err(|e| format!("cuEventRecord: {e}"))?;
                result::stream::wait_event(origin, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                    .map_err(|e| format!("cuStreamWaitEvent: {e}"))?;
            }
        }
        Ok(())
    };
    let joined_back = join();
    let ended = if capture {
        // SAFETY: the capture begun above.
        Some(unsafe { result::stream::end_capture(origin) })
    } else {
        None
    };
    for e in events {
        // SAFETY: events created above; the graph, or the streams waiting, keep what they need.
        let _ = unsafe { result::event::destroy(e) };
    }
    let graph = match ended {
        None => None,
        Some(Ok(g)) if !g.is_null() => Some(g),
        Some(Ok(_)) => None,
        Some(Err(e)) => {
            body.clone()?;
            joined_back.clone()?;
            return Err(format!("cuStreamEndCapture: {e}"));
        }
    };
    if let Err(e) = body.and(joined_back) {
        if let Some(g) = graph {
            // SAFETY: the graph the failed capture produced, owned here.
            let _ = unsafe { result::graph::destroy(g) };
        }
        return Err(e);
    }
    let lanes = (0..joined.len()).filter(|&l| joined[l]).collect();
    Ok((graph, read, lanes))
}
