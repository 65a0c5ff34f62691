//! Task Bench on plain MPI, the baseline `taskbench` is measured against: the reference's
//! `nonblock` scheme. Points are owned in blocks; each timestep every rank posts one `MPI_Irecv`
//! per remote input and one `MPI_Isend` per remote consumer, copies local inputs, waits for all,
//! then runs its tasks. The whole run is done twice and the second is reported (the first warms
//! up). Accepts Task Bench's command line.

use ferry_examples::taskbench::pattern::{Intervals, Points};
use ferry_examples::taskbench::{execute_point, prepare_scratch, App, GraphConfig};
use mpi::ffi;
use mpi::topology::Communicator;
use mpi::traits::*;
use smallvec::SmallVec;
use std::os::raw::{c_int, c_void};

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let app = match App::parse(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    // The core leaves flags it does not know to the driver; this one takes none of its own: a
    // misspelt flag must not run the default graph under a normal-looking summary.
    if let Some(flag) = app.extra.first() {
        eprintln!("error: unknown flag \"{flag}\" (taskbench-mpi takes Task Bench's flags only)");
        return std::process::ExitCode::from(2);
    }
    let Some(universe) = mpi::initialize() else {
        eprintln!("taskbench-mpi: MPI is already initialised");
        return std::process::ExitCode::FAILURE;
    };
    let world = universe.world();
    let (rank, size) = (world.rank() as i64, world.size() as i64);
    if rank == 0 {
        print!("{}", app.display());
    }
    // Buffers, scratch and each point's dependencies are set up before the clock starts and
    // serve both runs, as the reference's are.
    let mut prepared: Vec<Prepared> = app.graphs.iter().map(|g| Prepared::new(g, rank, size)).collect();
    let mut elapsed = 0.0;
    for _rep in 0..2 {
        world.barrier();
        let t0 = mpi::time();
        for (g, prep) in app.graphs.iter().zip(prepared.iter_mut()) {
            if let Err(e) = run_graph(g, prep, rank, size, &world) {
                eprintln!("taskbench-mpi: rank {rank}: {e}");
                world.abort(1);
            }
        }
        world.barrier();
        elapsed = mpi::time() - t0;
    }
    if rank == 0 {
        print!("{}", app.report(elapsed));
    }
    std::process::ExitCode::SUCCESS
}

/// `MPI_TAG_UB` of `comm` (the standard's minimum, 32 767, when the attribute is missing).
fn tag_upper_bound(comm: ffi::MPI_Comm) -> i32 {
    let mut val: *mut c_int = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: MPI_TAG_UB is a predefined attribute whose value is a pointer to int.
    unsafe {
        ffi::MPI_Comm_get_attr(
            comm,
            ffi::MPI_TAG_UB as c_int,
            &mut val as *mut *mut c_int as *mut c_void,
            &mut flag,
        );
        if flag != 0 && !val.is_null() {
            *val
        } else {
            32767
        }
    }
}

/// The points of `intervals`, in order.
fn points(intervals: &Intervals) -> Points {
    intervals.iter().flat_map(|iv| iv.0..=iv.1).collect()
}

/// Block ownership, the same rule as ferry's `Block2d` over a 1 × size grid.
fn owner(p: i64, w: i64, size: i64) -> i64 {
    p * size / w
}

/// What a rank needs to run one graph, made before the timing: its points, each point's
/// dependencies and consumers per dependence set (the reference caches them too), and the
/// buffers of outputs, inputs and scratch.
struct Prepared {
    mine: Vec<i64>,
    deps: Vec<Vec<Points>>,
    rdeps: Vec<Vec<Points>>,
    outputs: Vec<Vec<u8>>,
    inputs: Vec<Vec<Vec<u8>>>,
    scratch: Vec<Vec<u8>>,
}

impl Prepared {
    fn new(g: &GraphConfig, rank: i64, size: i64) -> Prepared {
        let s = &g.shape;
        let w = s.width;
        let ob = g.output_bytes as usize;
        let mine: Vec<i64> = (0..w).filter(|&p| owner(p, w, size) == rank).collect();
        let dsets = s.dependence_sets().max(1);
        let deps: Vec<Vec<Points>> = (0..dsets)
            .map(|d| mine.iter().map(|&p| points(&s.dependencies(d, p))).collect())
            .collect();
        let rdeps: Vec<Vec<Points>> = (0..dsets)
            .map(|d| mine.iter().map(|&p| points(&s.reverse_dependencies(d, p))).collect())
            .collect();
        // A step's inputs are its dependencies clipped to the previous step's points: at most
        // the largest dependence list (the reference sizes its buffers the same way).
        let max_inputs = deps.iter().flatten().map(|d| d.len()).max().unwrap_or(0);
        let mut scratch: Vec<Vec<u8>> = mine.iter().map(|_| vec![0u8; g.scratch_bytes as usize]).collect();
        for sc in &mut scratch {
            prepare_scratch(sc);
        }
        Prepared {
            outputs: mine.iter().map(|_| vec![0u8; ob]).collect(),
            inputs: mine.iter().map(|_| vec![vec![0u8; ob]; max_inputs]).collect(),
            scratch,
            deps,
            rdeps,
            mine,
        }
    }
}

fn run_graph(
    g: &GraphConfig,
    prep: &mut Prepared,
    rank: i64,
    size: i64,
    world: &impl Communicator,
) -> Result<(), String> {
    let s = &g.shape;
    let w = s.width;
    let ob = g.output_bytes as usize;
    let Prepared {
        mine,
        deps,
        rdeps,
        outputs,
        inputs,
        scratch,
    } = prep;
    let mine: &[i64] = mine;
    let index = |p: i64| (p - mine[0]) as usize;
    let comm = world.as_raw();
    // A message's tag names its two points by their places in their owners' blocks, as the
    // reference does: unique among one step's messages between two ranks, which is all MPI's
    // matching needs (each step waits for all of its messages). It must fit this MPI's tag
    // space (at least 32 767; more on most libraries): checked per message, so that a graph
    // with few remote edges (or none, on one rank) runs at any width.
    let per = (w + size - 1) / size;
    let first = |r: i64| (r * w + size - 1) / size;
    let place = |p: i64| p - first(owner(p, w, size));
    let tag_ub = i64::from(tag_upper_bound(comm));
    let tag = |p: i64, q: i64| -> Result<c_int, String> {
        let t = place(p) * per + place(q);
        if t > tag_ub {
            return Err(format!(
                "-width {w} on {size} ranks: the message from point {p} to point {q} needs MPI tag {t}; this MPI allows {tag_ub} ({per} points per rank)"
            ));
        }
        Ok(t as c_int)
    };
    let mut n_inputs = vec![0usize; mine.len()];
    let mut reqs: Vec<ffi::MPI_Request> = Vec::new();
    for t in 0..s.steps {
        reqs.clear();
        let (last_o, last_w) = (s.offset(t - 1), s.width_at(t - 1));
        let (o, wd) = (s.offset(t), s.width_at(t));
        for (i, &p) in mine.iter().enumerate() {
            n_inputs[i] = 0;
            if !s.exists(t, p) {
                continue;
            }
            for &d in &deps[s.dset(t) as usize][i] {
                if d < last_o || d >= last_o + last_w {
                    continue;
                }
                let k = n_inputs[i];
                n_inputs[i] += 1;
                let od = owner(d, w, size);
                if od == rank {
                    inputs[i][k].copy_from_slice(&outputs[index(d)]);
                } else {
                    let buf = &mut inputs[i][k];
                    // SAFETY: `buf` stays allocated and untouched until MPI_Waitall below.
                    let mut r = unsafe { ffi::RSMPI_REQUEST_NULL };
                    let rc = unsafe {
                        ffi::MPI_Irecv(
                            buf.as_mut_ptr() as *mut c_void,
                            ob as c_int,
                            ffi::RSMPI_UINT8_T,
                            od as c_int,
                            tag(d, p)?,
                            comm,
                            &mut r,
                        )
                    };
                    if rc != 0 {
                        return Err(format!("MPI_Irecv failed ({rc})"));
                    }
                    reqs.push(r);
                }
            }
        }
        for (i, &p) in mine.iter().enumerate() {
            if !s.exists(t - 1, p) {
                continue;
            }
            for &q in &rdeps[s.dset(t) as usize][i] {
                if q < o || q >= o + wd || owner(q, w, size) == rank {
                    continue;
                }
                let buf = &outputs[i];
                let mut r = unsafe { ffi::RSMPI_REQUEST_NULL };
                // SAFETY: `buf` is not written until MPI_Waitall below.
                let rc = unsafe {
                    ffi::MPI_Isend(
                        buf.as_ptr() as *const c_void,
                        ob as c_int,
                        ffi::RSMPI_UINT8_T,
                        owner(q, w, size) as c_int,
                        tag(p, q)?,
                        comm,
                        &mut r,
                    )
                };
                if rc != 0 {
                    return Err(format!("MPI_Isend failed ({rc})"));
                }
                reqs.push(r);
            }
        }
        if !reqs.is_empty() {
            // SAFETY: every request in `reqs` is live; statuses are ignored.
            let rc = unsafe { ffi::MPI_Waitall(reqs.len() as c_int, reqs.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) };
            if rc != 0 {
                return Err(format!("MPI_Waitall failed ({rc})"));
            }
        }
        for (i, &p) in mine.iter().enumerate() {
            if !s.exists(t, p) {
                continue;
            }
            let ins: SmallVec<[&[u8]; 8]> = inputs[i][..n_inputs[i]].iter().map(|v| v.as_slice()).collect();
            execute_point(g, t, p, &ins, &mut outputs[i], &mut scratch[i])?;
        }
    }
    Ok(())
}
