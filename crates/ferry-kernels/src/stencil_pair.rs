//! The 4096²-class Jacobi stencil on two GPUs with no runtime: the anchor that ferry's per-step
//! overhead is measured against (issue 8: "the stencil's per-step runtime overhead on 2 GPUs").
//!
//! One host thread drives both GPUs of one process. The `n × n` grid is cut into two row slabs
//! of `n / 2` rows, one per GPU, each with one neighbour; per step each GPU pulls its
//! neighbour's edge row (`n` `f64`, a peer copy on a stream of its own) and updates its slab with
//! ferry's own kernels ([`crate::cuda::CudaTileKernels`]), ordered only by CUDA events: the GPU
//! work of ferry's `stencil --mb n/2 --nb n` on two ranks, without task insertion, GPU managers,
//! MPI threads or messages. Every step is enqueued ahead (the host only waits for the end), so
//! the time per step is what the GPUs and the links need for that structure.
//!
//! Three structures ([`Structure`]): the `stencil` example's two, and one that ferry's tile-level
//! dependencies cannot express yet (the interior and the ring of a step write disjoint parts of
//! one tile at the same time, as in NVIDIA's multi-GPU Jacobi sample). Unlike ferry, the ring's
//! stream has the default priority (one slab per GPU: nothing else runs there to preempt).

use crate::cuda::{CudaKernelError, CudaTileKernels};
use crate::links::{drv, enable_peer_access, free_each, require_driver};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::sync::Arc;
use std::time::Instant;

/// How a step is split into kernels and ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Structure {
    /// One fused step kernel per slab, which writes its new edge; the neighbour's pull of step
    /// t + 1 waits for it (`stencil` without `--overlap`).
    Plain,
    /// An interior kernel on one stream, then a ring kernel on another after it and after the
    /// pull: the halo of step t is pulled during step t's interior (`stencil --overlap`: the ring
    /// writes the tile the interior wrote, so it follows it).
    Overlap,
    /// As `Overlap`, but the ring of step t waits only for step t − 1 (its interior and ring) and
    /// the pull, not for step t's interior: the two kernels of a step run at the same time on
    /// disjoint cells of the new field.
    Concurrent,
}

/// Events per kind and GPU, reused in turn: a wait captures an event's latest record when it is
/// enqueued, so a ring of a few is enough.
const EVENTS: usize = 4;

/// One GPU's slab: its streams, kernels, buffers and events.
struct Slab {
    ctx: Arc<CudaContext>,
    /// Interior (or the whole step); the ring; the halo pull.
    exec: Arc<CudaStream>,
    ring: Arc<CudaStream>,
    comm: Arc<CudaStream>,
    k_exec: CudaTileKernels,
    k_ring: CudaTileKernels,
    /// `[field 0, field 1, edge 0, edge 1, halo]`: the double-buffered field (`n/2 × n`), its
    /// inner edge row by parity (`n`), and the neighbour's edge row pulled here (`n`).
    bufs: Vec<u64>,
    /// Per kind (`step` = the step's last kernel, `interior`, `halo` = the pull), [`EVENTS`] each.
    step: Vec<sys::CUevent>,
    interior: Vec<sys::CUevent>,
    halo: Vec<sys::CUevent>,
}

impl Slab {
    /// Everything for one GPU; what was made before a failure is released by `Drop`.
    fn new(ordinal: usize, rows: usize, cols: usize) -> Result<Slab, CudaKernelError> {
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        let (exec, ring, comm) = (
            ctx.new_stream().map_err(drv)?,
            ctx.new_stream().map_err(drv)?,
            ctx.new_stream().map_err(drv)?,
        );
        let (k_exec, k_ring) = (CudaTileKernels::new(exec.clone())?, CudaTileKernels::new(ring.clone())?);
        let mut slab = Slab {
            ctx,
            exec,
            ring,
            comm,
            k_exec,
            k_ring,
            bufs: Vec::new(),
            step: Vec::new(),
            interior: Vec::new(),
            halo: Vec::new(),
        };
        slab.ctx.bind_to_thread().map_err(drv)?;
        for k in 0..5 {
            let bytes = if k < 2 { rows * cols * 8 } else { cols * 8 };
            // SAFETY: a plain allocation in the bound context, freed by `Drop`.
            let p = unsafe { result::malloc_sync(bytes) }.map_err(drv)?;
            slab.bufs.push(p);
            // SAFETY: the buffer just allocated, `bytes` long.
            unsafe { result::memset_d8_sync(p, 0, bytes) }.map_err(drv)?;
        }
        for _ in 0..EVENTS {
            for kind in [&mut slab.step, &mut slab.interior, &mut slab.halo] {
                kind.push(result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(drv)?);
            }
        }
        Ok(slab)
    }

    /// Waits until this GPU's streams have drained.
    fn synchronize(&self) -> Result<(), CudaKernelError> {
        self.ctx.bind_to_thread().map_err(drv)?;
        for s in [&self.exec, &self.ring, &self.comm] {
            s.synchronize().map_err(drv)?;
        }
        Ok(())
    }
}

impl Drop for Slab {
    /// Frees the buffers and events once the streams have drained. The other slab's streams may
    /// read this one's edge buffer: [`seconds_per_step`] synchronizes both before either drops.
    fn drop(&mut self) {
        if self.synchronize().is_err() {
            // A stream may still use them: leaking is the safe choice.
            return;
        }
        for e in self.step.iter().chain(&self.interior).chain(&self.halo) {
            // SAFETY: the streams have drained; nothing waits for the events any more.
            let _ = unsafe { result::event::destroy(*e) };
        }
        // SAFETY: the streams have drained (and the other slab's, see above).
        unsafe { free_each(&self.ctx, std::mem::take(&mut self.bufs)) };
    }
}

fn wait(s: &CudaStream, e: sys::CUevent) -> Result<(), CudaKernelError> {
    // SAFETY: a live stream and event.
    unsafe { result::stream::wait_event(s.cu_stream(), e, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }.map_err(drv)
}

fn record(s: &CudaStream, e: sys::CUevent) -> Result<(), CudaKernelError> {
    // SAFETY: a live stream and event.
    unsafe { result::event::record(e, s.cu_stream()) }.map_err(drv)
}

/// Enqueues step `t` on both slabs (`top` holds rows `0..n/2`, `bottom` the rest).
fn enqueue_step(
    s: &mut [Slab; 2],
    t: usize,
    rows: usize,
    cols: usize,
    alpha: f64,
    structure: Structure,
) -> Result<(), CudaKernelError> {
    let (now, prev) = (t % EVENTS, (t + EVENTS - 1) % EVENTS);
    let (src, dst) = (t % 2, (t + 1) % 2);
    // The pulls: each GPU copies its neighbour's edge of step t − 1 into its halo, after that
    // step's last kernel there and after its own previous step (which read the halo).
    for g in 0..2 {
        let o = 1 - g;
        if t > 0 {
            let (from_ctx, from) = (s[o].ctx.clone(), s[o].bufs[2 + src]);
            let me = &s[g];
            me.ctx.bind_to_thread().map_err(drv)?;
            wait(&me.comm, s[o].step[prev])?;
            wait(&me.comm, me.step[prev])?;
            // SAFETY: both buffers are `cols` f64 on live contexts with peer access; ordered by
            // the events above and below.
            unsafe {
                result::memcpy_peer_async(
                    me.ctx.cu_ctx(),
                    me.bufs[4],
                    from_ctx.cu_ctx(),
                    from,
                    cols * 8,
                    me.comm.cu_stream(),
                )
            }
            .map_err(drv)?;
        }
        record(&s[g].comm, s[g].halo[now])?;
    }
    for g in 0..2 {
        let o = 1 - g;
        let other_pull = s[o].halo[prev];
        let me = &mut s[g];
        me.ctx.bind_to_thread().map_err(drv)?;
        let (u, out, halo, edge) = (me.bufs[src], me.bufs[dst], me.bufs[4], me.bufs[2 + dst]);
        // The top slab's neighbour is south of it, the bottom one's north.
        let (halos, edges) = if g == 0 {
            ([0, halo, 0, 0], [0, edge, 0, 0])
        } else {
            ([halo, 0, 0, 0], [edge, 0, 0, 0])
        };
        if structure != Structure::Plain {
            wait(&me.exec, me.step[prev])?;
            // SAFETY: the slab's buffers, of the shapes given, on this context; ordered above.
            unsafe { me.k_exec.jacobi_interior(rows, cols, alpha, u, out)? };
            record(&me.exec, me.interior[now])?;
            // Overlap: after this step's interior. Concurrent: after the previous one (whose
            // cells next to the ring it reads, and which read the ring cells it overwrites).
            let before = if structure == Structure::Overlap { now } else { prev };
            if t > 0 || structure == Structure::Overlap {
                wait(&me.ring, me.interior[before])?;
            }
            wait(&me.ring, me.halo[now])?;
            if t > 0 {
                // The edge buffer written now was read by the neighbour's previous pull.
                wait(&me.ring, other_pull)?;
            }
            // SAFETY: as above; the edge and halo rows are buffers of their own.
            unsafe { me.k_ring.jacobi_ring(rows, cols, alpha, u, halos, out, edges)? };
            record(&me.ring, me.step[now])?;
        } else {
            wait(&me.exec, me.halo[now])?;
            if t > 0 {
                wait(&me.exec, other_pull)?;
            }
            // SAFETY: as above.
            unsafe { me.k_exec.jacobi_step_edges(rows, cols, alpha, u, halos, out, edges)? };
            record(&me.exec, me.step[now])?;
        }
    }
    Ok(())
}

/// Seconds per step of the two-GPU row-slab stencil on an `n × n` grid (GPUs `a` and `b`),
/// `steps` steps after 5 untimed ones, split and ordered as `structure` says. The field starts at
/// zero: the time, not the values, is the result.
///
/// # Errors
/// `Shape` if `n` is odd or below 6, or `steps` is 0; `Driver` without a driver, with an ordinal
/// out of range, when peer access cannot be enabled or an allocation, copy or launch fails;
/// `Nvrtc`/`Blas`/`Solver` as [`CudaTileKernels::new`].
pub fn seconds_per_step(
    a: usize,
    b: usize,
    n: usize,
    steps: usize,
    structure: Structure,
) -> Result<f64, CudaKernelError> {
    if n < 6 || n % 2 != 0 || steps == 0 {
        return Err(CudaKernelError::Shape(format!(
            "stencil pair: n must be even and at least 6 (got {n}), steps at least 1 (got {steps})"
        )));
    }
    require_driver()?;
    let (rows, cols, alpha) = (n / 2, n, 0.1);
    let mut s = [Slab::new(a, rows, cols)?, Slab::new(b, rows, cols)?];
    // SAFETY: live contexts.
    unsafe {
        enable_peer_access(&s[0].ctx, &s[1].ctx)?;
        enable_peer_access(&s[1].ctx, &s[0].ctx)?;
    }
    let mut run = |from: usize, to: usize| -> Result<(), CudaKernelError> {
        for t in from..to {
            enqueue_step(&mut s, t, rows, cols, alpha, structure)?;
        }
        for slab in &s {
            slab.synchronize()?;
        }
        Ok(())
    };
    const WARMUP: usize = 5;
    let measured = run(0, WARMUP).and_then(|_| {
        let t0 = Instant::now();
        run(WARMUP, WARMUP + steps)?;
        Ok(t0.elapsed().as_secs_f64() / steps as f64)
    });
    // Each slab's pulls read the other's edge buffers: both drain before either is freed.
    for slab in &s {
        let _ = slab.synchronize();
    }
    drop(s);
    measured
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bad sizes are refused before any driver call (so also on machines without a GPU).
    #[test]
    fn bad_sizes_are_refused_first() {
        for (n, steps) in [(7, 10), (4, 10), (0, 10), (4096, 0)] {
            let r = seconds_per_step(0, 1, n, steps, Structure::Concurrent);
            assert!(
                matches!(r, Err(CudaKernelError::Shape(_))),
                "n {n}, steps {steps}: {r:?}"
            );
        }
    }
}
