//! Pollers: what a service thread (the MPI thread) runs in every pass of its loop, for work that
//! arrives without a command on its channel — messages that another process writes into shared
//! memory (`ferry-transfer/src/mailbox.rs`).

/// Run in every pass of a service thread's loop. Neither method may block; callbacks they run
/// may post commands to any thread, their own included.
pub trait Poller: Send {
    /// Takes what came, sends what waited, runs the callbacks due.
    fn poll(&mut self) -> Polled;

    /// Whether messages wait to be sent (an orderly shutdown keeps polling until none do).
    fn sending(&self) -> bool;

    /// The thread is ending: fail whatever still waits, and drop what keeps others alive.
    fn close(&mut self);
}

/// What a [`Poller::poll`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Polled {
    /// It ran callbacks or moved messages.
    pub worked: bool,
    /// It waits for messages (or for room to send them): the thread must keep polling — it may
    /// yield or nap, not block until a command comes. A poller that expects nothing and then
    /// has work must wake its thread with a command.
    pub expecting: bool,
}

/// Polls every poller once: whether one worked, whether one expects more.
pub fn poll_all(pollers: &mut [Box<dyn Poller>]) -> (bool, bool) {
    let (mut worked, mut expecting) = (false, false);
    for p in pollers {
        let r = p.poll();
        worked |= r.worked;
        expecting |= r.expecting;
    }
    (worked, expecting)
}
