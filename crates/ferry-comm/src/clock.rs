//! Putting every rank's trace on rank 0's clock.
//!
//! Each rank's trace counts from its own start. At start-up rank 0 plays ping-pong with every
//! other rank `r` on a communicator of its own: it notes its clock `t0`, sends, `r` answers at
//! once with its clock `t1`, and rank 0 notes `t2` on receipt. Assuming the two legs take equal
//! time, `r`'s `t1` happened at rank 0's `(t0 + t2) / 2`; the error is at most half the round
//! trip `t2 − t0`, so of [`ROUNDS`] samples the one with the shortest round trip is kept
//! (Cristian, "Probabilistic clock synchronization", Distributed Computing 3, 1989). Rank 0 sends
//! `r` the pair, and each rank marks it in its trace (`ferry::clock`), for `cargo xtask
//! trace-merge` to shift the rank onto rank 0's clock.
//!
//! An earlier mark at the end of an allgather was off by the ranks' exit skew, which includes
//! the hand-off from the MPI thread to the waiting thread: 34–39 µs on the GPU machine, with
//! messages that appeared to arrive before they were sent.

use super::mpi::{self as raw, RawComm};
use ferry_base::error::{FerryError, Rank};
use std::time::Instant;

/// Ping-pong rounds per rank; the fastest is kept.
pub(super) const ROUNDS: usize = 16;
const TAG: i32 = 1;
/// How long the whole synchronisation may take before it fails (a rank that never joins, for
/// instance because its start-up failed, must not leave the others' MPI threads waiting).
const DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// This rank's clock reading and the reading of rank 0's clock at the same instant, µs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClockPair {
    /// This rank's clock, µs.
    pub local_us: f64,
    /// Rank 0's clock at the same instant, µs.
    pub rank0_us: f64,
    /// Round trip of the sample kept (the pair's uncertainty is half of it), µs; 0 on rank 0.
    pub rtt_us: f64,
}

/// Runs the ping-pong on `comm` (every rank of it must call this); `now` reads this rank's
/// clock in µs. Holds the MPI thread until done: for start-up, with nothing else in flight.
///
/// # Errors
/// A failed send or receive, or a rank that has not answered within [`DEADLINE`].
pub(super) fn sync(comm: RawComm, rank: Rank, size: usize, now: &dyn Fn() -> f64) -> Result<ClockPair, FerryError> {
    let deadline = Instant::now() + DEADLINE;
    if rank != 0 {
        let mut ping = [0.0];
        for _ in 0..ROUNDS {
            recv(&mut ping, 0, comm, deadline)?;
            send(&[now()], 0, comm, deadline)?;
        }
        let mut best = [0.0; 3];
        recv(&mut best, 0, comm, deadline)?;
        return Ok(ClockPair {
            local_us: best[0],
            rank0_us: best[1],
            rtt_us: best[2],
        });
    }
    for r in 1..size as Rank {
        // (remote t1, midpoint on this clock, round trip)
        let mut best = (0.0, 0.0, f64::INFINITY);
        let mut pong = [0.0];
        for _ in 0..ROUNDS {
            let t0 = now();
            send(&[t0], r, comm, deadline)?;
            recv(&mut pong, r, comm, deadline)?;
            let t2 = now();
            if t2 - t0 < best.2 {
                best = (pong[0], (t0 + t2) / 2.0, t2 - t0);
            }
        }
        send(&[best.0, best.1, best.2], r, comm, deadline)?;
    }
    let t = now();
    Ok(ClockPair {
        local_us: t,
        rank0_us: t,
        rtt_us: 0.0,
    })
}

/// Sends `vals` to `peer` and waits for it until `deadline`.
fn send(vals: &[f64], peer: Rank, comm: RawComm, deadline: Instant) -> Result<(), FerryError> {
    // SAFETY: `vals` outlives the request, which `wait_until` completes or cancels.
    let mut req = unsafe { raw::isend(vals.as_ptr().cast(), std::mem::size_of_val(vals), peer, TAG, comm)? };
    raw::wait_until(&mut req, "MPI_Isend", peer, TAG, deadline)
}

/// Receives `out.len()` values from `peer`, waiting until `deadline`.
fn recv(out: &mut [f64], peer: Rank, comm: RawComm, deadline: Instant) -> Result<(), FerryError> {
    // SAFETY: `out` outlives the request, which `wait_until` completes or cancels.
    let mut req = unsafe { raw::irecv(out.as_mut_ptr().cast(), std::mem::size_of_val(out), peer, TAG, comm)? };
    raw::wait_until(&mut req, "MPI_Irecv", peer, TAG, deadline)
}
