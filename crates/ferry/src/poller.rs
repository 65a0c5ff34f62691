//! Pollers: functions that a service thread (the MPI thread or the GPU manager) runs in every
//! pass of its loop, for work that arrives without a command on its channel — messages that
//! another process writes into shared memory (`transfer/mailbox.rs`).

/// A function run in every pass of a service thread's loop. It must not block; its callbacks
/// may post commands to any thread, its own included.
pub(crate) type Poller = Box<dyn FnMut() -> Polled + Send>;

/// What a [`Poller`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Polled {
    /// It ran callbacks or moved messages.
    pub(crate) worked: bool,
    /// It waits for messages (or for room to send them): the thread must keep polling — it may
    /// yield or nap, not block until a command comes. A poller that expects nothing and then
    /// has work must wake its thread with a command.
    pub(crate) expecting: bool,
}

/// Runs every poller once: whether one worked, whether one expects more.
pub(crate) fn run_all(pollers: &mut [Poller]) -> (bool, bool) {
    let (mut worked, mut expecting) = (false, false);
    for p in pollers {
        let r = p();
        worked |= r.worked;
        expecting |= r.expecting;
    }
    (worked, expecting)
}
