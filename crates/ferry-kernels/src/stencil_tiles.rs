//! The tiled stencil on one GPU with no runtime: the anchor for ferry's per-step cost when one
//! GPU runs a step as many small tiles (`stencil --n 4096 --nb 512` on one rank: 64 tasks a step).
//!
//! The `n × n` grid is cut into `mb × nb` tiles as ferry cuts it (ragged at the bottom and right
//! edges). Each tile has a double-buffered field and four double-buffered edge rows or columns.
//! Per step and tile, one launch of ferry's own fused kernel
//! ([`crate::cuda::CudaTileKernels::jacobi_step_edges`]) reads the tile and its neighbours'
//! edges of the step before and writes the tile's new field and edges: the GPU work of ferry's
//! `stencil` step task, without insertion, a GPU manager, staging or events per task. One host
//! thread enqueues every step ahead and waits only at the end, on `streams` streams:
//!
//! - one stream: stream order alone orders the steps (the tiles of a step run one after the
//!   other);
//! - several: tile `k` runs on stream `k mod streams`, and waits for the events of its
//!   neighbours' previous step (whose edges it reads, and whose reads of the edge buffer it now
//!   overwrites), so the tiles of a step can run side by side, as ferry's exec streams let them.

use crate::cuda::{CudaKernelError, CudaTileKernels};
use crate::links::{drv, free_each, require_driver};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::sync::Arc;
use std::time::Instant;

/// One tile's buffers: `[field 0, field 1]`, and its edges by parity, `[north, south, west,
/// east]` each.
struct Tile {
    rows: usize,
    cols: usize,
    field: [u64; 2],
    edges: [[u64; 4]; 2],
    /// Recorded after its step `t` kernel, by parity of `t`.
    done: [sys::CUevent; 2],
}

/// Everything the anchor allocated, released by `Drop` once the streams have drained.
struct Grid {
    ctx: Arc<CudaContext>,
    streams: Vec<(Arc<CudaStream>, CudaTileKernels)>,
    tiles: Vec<Tile>,
    bufs: Vec<u64>,
    events: Vec<sys::CUevent>,
}

impl Grid {
    fn synchronize(&self) -> Result<(), CudaKernelError> {
        self.ctx.bind_to_thread().map_err(drv)?;
        for (s, _) in &self.streams {
            s.synchronize().map_err(drv)?;
        }
        Ok(())
    }

    /// A zeroed device buffer of `bytes` (kept for `Drop`).
    fn alloc(&mut self, bytes: usize) -> Result<u64, CudaKernelError> {
        // SAFETY: a plain allocation in the bound context, freed by `Drop`.
        let p = unsafe { result::malloc_sync(bytes.max(8)) }.map_err(drv)?;
        self.bufs.push(p);
        // SAFETY: the buffer just allocated, at least `bytes` long.
        unsafe { result::memset_d8_sync(p, 0, bytes.max(8)) }.map_err(drv)?;
        Ok(p)
    }

    fn event(&mut self) -> Result<sys::CUevent, CudaKernelError> {
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(drv)?;
        self.events.push(e);
        Ok(e)
    }
}

impl Drop for Grid {
    fn drop(&mut self) {
        if self.synchronize().is_err() {
            // A stream may still use them: leaking is the safe choice.
            return;
        }
        for e in self.events.drain(..) {
            // SAFETY: the streams have drained; nothing waits for the events any more.
            let _ = unsafe { result::event::destroy(e) };
        }
        // SAFETY: the streams have drained.
        unsafe { free_each(&self.ctx, std::mem::take(&mut self.bufs)) };
    }
}

/// Seconds per step of the tiled stencil on GPU `ordinal`: an `n × n` grid in `mb × nb` tiles,
/// `steps` steps after 5 untimed ones, on `streams` streams. The field starts at zero: the time,
/// not the values, is the result.
///
/// # Errors
/// `Shape` when `n`, `mb`, `nb`, `steps` or `streams` is 0, or a tile is larger than the grid;
/// `Driver` without a driver, with an ordinal out of range, or when an allocation or launch
/// fails; `Nvrtc`/`Blas`/`Solver` as [`CudaTileKernels::new`].
pub fn seconds_per_step(
    ordinal: usize,
    n: usize,
    (mb, nb): (usize, usize),
    steps: usize,
    streams: usize,
) -> Result<f64, CudaKernelError> {
    if n == 0 || mb == 0 || nb == 0 || mb > n || nb > n || steps == 0 || streams == 0 {
        return Err(CudaKernelError::Shape(format!(
            "tiled stencil: n {n}, tiles {mb}×{nb}, steps {steps} and streams {streams} must be positive, tiles at most n"
        )));
    }
    require_driver()?;
    let ctx = CudaContext::new(ordinal).map_err(drv)?;
    let mut g = Grid {
        ctx: ctx.clone(),
        streams: Vec::new(),
        tiles: Vec::new(),
        bufs: Vec::new(),
        events: Vec::new(),
    };
    for _ in 0..streams {
        let s = ctx.new_stream().map_err(drv)?;
        let k = CudaTileKernels::new(s.clone())?;
        g.streams.push((s, k));
    }
    ctx.bind_to_thread().map_err(drv)?;
    let (mt, nt) = (n.div_ceil(mb), n.div_ceil(nb));
    for i in 0..mt {
        for j in 0..nt {
            let (rows, cols) = (mb.min(n - i * mb), nb.min(n - j * nb));
            let field = [g.alloc(rows * cols * 8)?, g.alloc(rows * cols * 8)?];
            let mut edges = [[0u64; 4]; 2];
            for e in &mut edges {
                *e = [
                    g.alloc(cols * 8)?,
                    g.alloc(cols * 8)?,
                    g.alloc(rows * 8)?,
                    g.alloc(rows * 8)?,
                ];
            }
            let done = [g.event()?, g.event()?];
            g.tiles.push(Tile {
                rows,
                cols,
                field,
                edges,
                done,
            });
        }
    }
    // The zeroing ran on the legacy default stream, which the tile streams do not wait for.
    ctx.synchronize().map_err(drv)?;
    const WARMUP: usize = 5;
    for t in 0..WARMUP {
        enqueue(&mut g, t, (mt, nt))?;
    }
    g.synchronize()?;
    let t0 = Instant::now();
    for t in WARMUP..WARMUP + steps {
        enqueue(&mut g, t, (mt, nt))?;
    }
    g.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / steps as f64)
}

/// Enqueues step `t` of every tile (`mt × nt` tiles, row-major).
fn enqueue(g: &mut Grid, t: usize, (mt, nt): (usize, usize)) -> Result<(), CudaKernelError> {
    const ALPHA: f64 = 0.2;
    let streams = g.streams.len();
    let (src, dst) = (t % 2, (t + 1) % 2);
    for i in 0..mt {
        for j in 0..nt {
            let k = i * nt + j;
            let neighbours = [
                (i > 0).then(|| (k - nt, 1)),
                (i + 1 < mt).then(|| (k + nt, 0)),
                (j > 0).then(|| (k - 1, 3)),
                (j + 1 < nt).then(|| (k + 1, 2)),
            ];
            // North halo: the north neighbour's south edge, and so on.
            let halos = neighbours.map(|nb| nb.map_or(0, |(o, side)| g.tiles[o].edges[src][side]));
            let (stream, kern) = &mut g.streams[k % streams];
            if streams > 1 && t > 0 {
                for (o, _) in neighbours.into_iter().flatten() {
                    if o % streams != k % streams {
                        // SAFETY: a live stream and event.
                        unsafe {
                            result::stream::wait_event(
                                stream.cu_stream(),
                                g.tiles[o].done[(t - 1) % 2],
                                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                            )
                        }
                        .map_err(drv)?;
                    }
                }
            }
            let tile = &g.tiles[k];
            // SAFETY: the tile's buffers and its neighbours' edges, of the shapes given, on this
            // context; ordered by the stream and the events above.
            unsafe {
                kern.jacobi_step_edges(
                    tile.rows,
                    tile.cols,
                    ALPHA,
                    tile.field[src],
                    halos,
                    tile.field[dst],
                    tile.edges[dst],
                )?
            };
            if streams > 1 {
                // SAFETY: a live stream and event.
                unsafe { result::event::record(tile.done[t % 2], stream.cu_stream()) }.map_err(drv)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bad sizes are refused before any driver call (so also on machines without a GPU).
    #[test]
    fn bad_sizes_are_refused_first() {
        for (n, mb, nb, steps, streams) in [
            (0, 1, 1, 1, 1),
            (64, 0, 8, 1, 1),
            (64, 8, 65, 1, 1),
            (64, 8, 8, 0, 1),
            (64, 8, 8, 1, 0),
        ] {
            let r = seconds_per_step(0, n, (mb, nb), steps, streams);
            assert!(
                matches!(r, Err(CudaKernelError::Shape(_))),
                "{n} {mb} {nb} {steps} {streams}: {r:?}"
            );
        }
    }
}
