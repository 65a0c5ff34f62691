//! Offered pulls held on the host until their producer's signal shows in its host mirror.
//!
//! A pull offered at its producer's launch may read its source only once the producer's
//! kernel has finished. Where the producer publishes a host mirror of its signal words
//! ([`Backend::signal_mirror`], `ferry-device/src/signal_mirror.rs`), the manager holds such a batch
//! back instead of making its stream wait on the device, reads the mirror once a pass, and
//! enqueues the batch with no wait the pass it sees the value: one driver call less per batch,
//! and a wake-up about as fast as a spinning thread's rather than a stream wait's (12–14 µs on
//! H200). A batch still held after [`Manager::hold_for`] (`FERRY_OFFER_POLL_US`) — a long
//! producer kernel — goes to the device with its wait as before, so that neither this thread
//! spins long on it nor the pull starts late.
//!
//! A pull whose signal has shown waits for nothing: its signal is cleared and it joins the
//! device's other such copies in one batch (`flush_copies` batches only copies that wait for
//! the same word), one launch of the copy kernel for the pulls of several producer tasks.

use super::transfer::Batch;
use super::{Backend, DeviceError, Manager};
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::time::Instant;

/// A batch of pulls waiting for one producer signal word to reach a value.
pub(super) struct Held {
    ops: Batch,
    word: *const AtomicU64,
    value: u64,
    /// When it goes to the device with its wait, still held; `None` for a batch that asks for
    /// device acknowledgements, which never waits on the device (see `wait_or_hold`).
    until: Option<Instant>,
}

// SAFETY: `word` points into a mapping the backend owns (valid as long as it); only the
// manager thread, which owns both, reads it.
unsafe impl Send for Held {}

/// Offered pulls held by the manager, oldest first.
#[derive(Default)]
pub(super) struct HeldPulls {
    batches: VecDeque<Held>,
}

impl HeldPulls {
    pub(super) fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Batches held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.batches.len()
    }

    /// Every held batch, for a shutdown.
    pub(super) fn take_all(&mut self) -> impl Iterator<Item = Batch> {
        std::mem::take(&mut self.batches).into_iter().map(|h| h.ops)
    }
}

/// How a batch that waits for a producer's signal is to be enqueued.
pub(super) enum Wait {
    /// The signal has been seen in its host mirror: no wait.
    Seen,
    /// On the device, for the signal word.
    Device,
}

/// Whether the word at `word` holds at least `value`.
fn reached(word: *const AtomicU64, value: u64) -> bool {
    // SAFETY: a word of a mapping the backend keeps for its whole life (`Held`'s contract).
    // Acquire: what the producer's kernel wrote is visible once the value is (the producer's
    // stream put a memory barrier before writing it).
    unsafe { &*word }.load(Acquire) >= value
}

impl<B: Backend> Manager<B> {
    /// For a batch of offered pulls whose stream would wait for `(at, value)` on device `dev`:
    /// no wait when the producer's host mirror shows the value already; otherwise the batch is
    /// held (returned `None`) when a mirror exists and holding is on, or waits on the device.
    ///
    /// A batch that asks for device acknowledgements is held until its signal shows, however
    /// long: its acknowledgement writes must follow copies that wait for nothing on the device
    /// (an acknowledgement behind a stream wait for some producer's signal could close a cycle
    /// of device waits, `Manager::enqueue_copies`). Its producer asked only because it
    /// publishes a mirror; one this rank could not map fails the batch with an error.
    pub(super) fn wait_or_hold(&mut self, ops: Batch, dev: usize, at: super::Mem, value: u64) -> Option<(Batch, Wait)> {
        let acked = ops.iter().any(|(op, _)| op.ack.is_some());
        let Some(word) = self.b.signal_mirror(dev, at) else {
            if acked {
                let e = DeviceError::Body(
                    "a peer asked for a device acknowledgement of a send offered at launch, but its signal mirror is not mapped here (the start-up agreement should have turned such acknowledgements off: FERRY_DEVICE_ACK=off works around it)".into(),
                );
                self.fail_copies(ops, e);
                return None;
            }
            return Some((ops, Wait::Device));
        };
        if reached(word, value) {
            return Some((ops, Wait::Seen));
        }
        if self.tune.hold_for.is_zero() && !acked {
            return Some((ops, Wait::Device));
        }
        self.xfer.held.batches.push_back(Held {
            ops,
            word,
            value,
            until: (!acked).then(|| Instant::now() + self.tune.hold_for),
        });
        None
    }

    /// Clears the signal of every pending copy whose producer's host mirror shows it already
    /// (counted as seen), so that [`Manager::flush_copies`] batches it with the device's other
    /// copies that wait for nothing.
    pub(super) fn clear_seen_waits(&mut self) {
        for (op, _) in &mut self.xfer.pending_copies {
            let Some((at, value)) = op.after else { continue };
            if self.b.signal_mirror(op.dev, at).is_some_and(|w| reached(w, value)) {
                op.after = None;
                self.counters.device(op.dev).offers_seen.fetch_add(1, Relaxed);
            }
        }
    }

    /// Moves the held batches whose signal has shown to the pending copies, their signals
    /// cleared (counted as seen), and enqueues those whose time is up (waiting on the device);
    /// returns whether it moved or enqueued any.
    pub(super) fn release_held(&mut self) -> bool {
        if self.xfer.held.is_empty() {
            return false;
        }
        let mut now = None;
        let mut any = false;
        let mut k = 0;
        while k < self.xfer.held.batches.len() {
            let h = &self.xfer.held.batches[k];
            let wait = if reached(h.word, h.value) {
                Wait::Seen
            } else if h.until.is_some_and(|u| *now.get_or_insert_with(Instant::now) >= u) {
                Wait::Device
            } else {
                k += 1;
                continue;
            };
            let h = self.xfer.held.batches.remove(k).expect("k is in range");
            let dev = h.ops[0].0.dev;
            match wait {
                // Batchable pulls join the pass's other copies that wait for nothing; one that
                // goes alone (into a host buffer, or too long to share a batch) goes as it came.
                Wait::Seen if h.ops.iter().all(|(op, _)| self.batchable(op)) => {
                    self.counters
                        .device(dev)
                        .offers_seen
                        .fetch_add(h.ops.len() as u64, Relaxed);
                    self.xfer.pending_copies.extend(h.ops.into_iter().map(|(mut op, then)| {
                        op.after = None;
                        (op, then)
                    }));
                }
                Wait::Seen => self.issue_waited(h.ops, wait),
                Wait::Device => {
                    self.counters.device(dev).offers_held_out.fetch_add(1, Relaxed);
                    self.issue_waited(h.ops, wait);
                }
            }
            any = true;
        }
        any
    }
}
