//! Stream-ordered completions: a get into device memory that a CUDA stream of the caller waits
//! for, so a GPU consumer can be enqueued right after the call, with no host round trip between
//! the data landing and the consumer starting.
//!
//! - **Peer copies** (the IPC route with a lease): the copy runs on the engine's stream and the
//!   caller's stream waits for its event (`cuStreamWaitEvent`); the GPU alone orders the two.
//! - **Every other route** (a granted peer copy, staged chunks): the bytes land through several
//!   copies and messages, which only the host sees complete. The caller's stream waits on a
//!   32-bit word in pinned host memory (`cuStreamWaitValue32`, ≥ 1), which the engine writes
//!   when the get's completion runs; an event recorded after the wait tells when the word may
//!   serve again.
//! - **Never GPU-direct**: where a plain get would hand the destination to a CUDA-aware MPI, a
//!   stream-ordered one is staged. The MPI library's own device work may wait for the device
//!   while the caller's stream waits for the get, and then neither ends: with Open MPI over
//!   UCX's `cuda_ipc` (two ranks on one H100 under MPS) a GPU-direct get whose destination's
//!   stream waited never completed, with the stream's wait the only difference. The staged
//!   route's copies are the engine's own, on its own stream.
//!
//! A get that fails releases the stream all the same (the word is written): the stream never
//! hangs on the engine, and the host completion says what went wrong.

use crate::engine::{EngineHandle, Notify};
use crate::error::{EngineError, Result};
use crate::handle::MemHandle;
use ferry_base::error::FerryError;
use ferry_device::copier::{Copier, Free, Ticket};
use std::sync::atomic::{AtomicU32, Ordering};

/// Words per pinned block.
const WORDS_PER_BLOCK: usize = 1024;

/// The pinned words that callers' streams wait on, and the waits not yet passed.
#[derive(Default)]
pub(crate) struct StreamWords {
    /// Each block's base address and what frees it.
    blocks: Vec<(usize, Free)>,
    /// Addresses of the words free to take.
    free: Vec<usize>,
    /// Words whose stream has not yet passed its wait, with the ticket that says when it has.
    retiring: Vec<(Ticket, usize)>,
}

// SAFETY: the blocks are pinned host memory owned by this pool; words are handed to one get at
// a time and touched through atomics.
unsafe impl Send for StreamWords {}

fn word(addr: usize) -> &'static AtomicU32 {
    // SAFETY: a 4-aligned word of a pinned block that lives until the pool is dropped, after
    // every user of the word (see `StreamWords::release_all`).
    unsafe { AtomicU32::from_ptr(addr as *mut u32) }
}

impl StreamWords {
    /// A word set to 0 (a new block of them when none is free).
    pub(crate) fn take(&mut self, copier: &mut dyn Copier) -> Result<usize> {
        if self.free.is_empty() {
            let (base, f) = copier.alloc_pinned(4 * WORDS_PER_BLOCK).map_err(FerryError::from)?;
            let base = base as usize;
            self.blocks.push((base, f));
            self.free.extend((0..WORDS_PER_BLOCK).rev().map(|k| base + 4 * k));
        }
        let w = self.free.pop().expect("a free word");
        word(w).store(0, Ordering::Relaxed);
        Ok(w)
    }

    /// The stream waiting on `w` will have passed it when `t` completes.
    pub(crate) fn retire(&mut self, t: Ticket, w: usize) {
        self.retiring.push((t, w));
    }

    /// Takes back the words whose streams have passed their waits; whether any.
    pub(crate) fn poll(&mut self, copier: &mut dyn Copier) -> bool {
        let before = self.retiring.len();
        let mut k = 0;
        while k < self.retiring.len() {
            match copier.done(&self.retiring[k].0) {
                Ok(false) => k += 1,
                Ok(true) => {
                    let (_, w) = self.retiring.swap_remove(k);
                    self.free.push(w);
                }
                // A stream in error: whether it has passed the wait is unknown, and its get may
                // still signal the word; the word is never handed out again.
                Err(_) => {
                    self.retiring.swap_remove(k);
                }
            }
        }
        self.retiring.len() != before
    }

    /// At the end: every word written (no stream waits forever), then up to a second for the
    /// streams to pass; whether the blocks may be freed (else they are leaked: a stream could
    /// still read them).
    pub(crate) fn release_all(&mut self, copier: &mut dyn Copier) -> bool {
        for (base, _) in &self.blocks {
            for k in 0..WORDS_PER_BLOCK {
                word(base + 4 * k).store(1, Ordering::Release);
            }
        }
        let t0 = std::time::Instant::now();
        while !self.retiring.is_empty() && t0.elapsed() < std::time::Duration::from_secs(1) {
            self.poll(copier);
            std::thread::yield_now();
        }
        self.retiring.is_empty()
    }

    /// The blocks' frees (empty when `release_all` found a stream still waiting).
    pub(crate) fn into_frees(self, freeable: bool) -> Vec<Free> {
        let frees: Vec<Free> = self.blocks.into_iter().map(|(_, f)| f).collect();
        if freeable {
            frees
        } else {
            std::mem::forget(frees);
            Vec::new()
        }
    }
}

/// Ends a word's wait: the stream proceeds.
pub(crate) fn signal(w: usize) {
    word(w).store(1, Ordering::Release);
}

impl EngineHandle {
    /// As [`EngineHandle::get`], into device memory, and stream-ordered: work that the caller
    /// enqueues on `stream` after this call returns runs once the bytes have landed, with no host
    /// round trip in between. `stream` is a `CUstream` of the destination's device (its context),
    /// as an integer (0: the legacy default stream). `done` still runs on the host as for `get`.
    /// On the IPC route the stream waits for the peer copy's event; on the others, on a word
    /// in pinned host memory that the engine writes when the get completes (with
    /// [`crate::Completions::Caller`], when `progress` runs its callback); it is never handed to
    /// a CUDA-aware MPI (GPU-direct): it is staged instead (see the module). A get that fails
    /// releases the stream too: `done` says why. Emulated devices run no streams: `stream` is
    /// ignored there (their copies complete when issued).
    ///
    /// # Errors
    /// As [`EngineHandle::get`]; [`EngineError::InvalidArgument`] when `local` is host memory;
    /// [`EngineError::Device`] when the driver refuses the stream (on the IPC route the copy may
    /// then have been issued: the destination may still be written).
    #[allow(clippy::too_many_arguments)]
    pub fn get_on_stream(
        &self,
        local: &MemHandle,
        local_offset: usize,
        remote: &MemHandle,
        remote_offset: usize,
        len: usize,
        notify: Option<Notify>,
        stream: u64,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) -> Result<()> {
        if local.kind.device().is_none() {
            return Err(EngineError::InvalidArgument(
                "a stream-ordered get needs a device destination (local is host memory)".into(),
            ));
        }
        self.get_ordered(
            local,
            local_offset,
            remote,
            remote_offset,
            len,
            notify,
            Some(stream),
            Box::new(done),
        )
    }
}
