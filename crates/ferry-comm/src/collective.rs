//! Non-blocking allgather of variable-size byte strings, polled by the progress loop.
//!
//! Two steps: `MPI_Iallgather` of the lengths, then `MPI_Iallgatherv` of the bytes. Every
//! collective ferry needs (graph hash check, barrier, statistics, sums) is built on this one.

use super::mpi::{self, RawComm, RawRequest};
use super::GatherReply;
use ferry_base::error::{FerryError, Result};
use std::os::raw::c_int;

enum Step {
    Lengths,
    Bytes,
}

/// One allgather in progress. Buffers live in boxes so their addresses stay put while MPI uses
/// them.
pub(super) struct Allgather {
    step: Step,
    req: RawRequest,
    send: Box<[u8]>,
    my_len: Box<u64>,
    lens: Box<[u64]>,
    counts: Box<[c_int]>,
    displs: Box<[c_int]>,
    recv: Box<[u8]>,
    reply: GatherReply,
}

impl Allgather {
    pub(super) fn start(mut data: Vec<u8>, size: usize, comm: RawComm, reply: GatherReply) -> Option<Allgather> {
        let len = data.len() as u64;
        // See the note on `recv` below: keep at least one byte allocated.
        data.reserve_exact(1);
        data.push(0);
        let mut a = Allgather {
            step: Step::Lengths,
            req: mpi::null_request(),
            my_len: Box::new(len),
            send: data.into_boxed_slice(),
            lens: vec![0u64; size].into_boxed_slice(),
            counts: vec![0; size].into_boxed_slice(),
            displs: vec![0; size].into_boxed_slice(),
            recv: Box::new([]),
            reply,
        };
        // SAFETY: my_len and lens live in `a`, which outlives the request.
        match unsafe { mpi::iallgather_u64(&*a.my_len, a.lens.as_mut_ptr(), comm) } {
            Ok(req) => {
                a.req = req;
                Some(a)
            }
            Err(e) => {
                let _ = a.reply.send(Err(e));
                None
            }
        }
    }

    /// Advances; returns `true` when finished (the reply has been sent).
    pub(super) fn poll(&mut self, comm: RawComm) -> bool {
        match self.poll_inner(comm) {
            Ok(false) => false,
            Ok(true) => true,
            Err(e) => {
                let _ = self.reply.send(Err(e));
                true
            }
        }
    }

    fn poll_inner(&mut self, comm: RawComm) -> Result<bool> {
        if !mpi::test(&mut self.req)? {
            return Ok(false);
        }
        match self.step {
            Step::Lengths => {
                let mut off: usize = 0;
                for (k, &l) in self.lens.iter().enumerate() {
                    self.counts[k] = l as c_int;
                    self.displs[k] = off as c_int;
                    off += l as usize;
                }
                if off > i32::MAX as usize {
                    return Err(FerryError::InvalidArgument(format!(
                        "allgather of {off} bytes exceeds MPI's int counts"
                    )));
                }
                // Never hand MPI an empty allocation: its dangling address (0x1) is Open MPI's
                // MPI_IN_PLACE.
                self.recv = vec![0u8; off.max(1)].into_boxed_slice();
                // SAFETY: every buffer lives in self, which outlives the request.
                self.req = unsafe {
                    mpi::iallgatherv(
                        &self.send,
                        *self.my_len as usize,
                        self.recv.as_mut_ptr(),
                        self.counts.as_ptr(),
                        self.displs.as_ptr(),
                        comm,
                    )?
                };
                self.step = Step::Bytes;
                Ok(false)
            }
            Step::Bytes => {
                let parts = self
                    .counts
                    .iter()
                    .zip(self.displs.iter())
                    .map(|(&c, &d)| self.recv[d as usize..(d + c) as usize].to_vec())
                    .collect();
                let _ = self.reply.send(Ok(parts));
                Ok(true)
            }
        }
    }

    /// Abandons the collective at shutdown after an error.
    pub(super) fn cancel(mut self) {
        let _ = self.reply.send(Err(FerryError::Poisoned(
            "runtime shut down during a collective".into(),
        )));
        mpi::cancel(&mut self.req);
    }
}
