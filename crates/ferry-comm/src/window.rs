//! Flow control of rendezvous sends: a bounded number in flight per rank and per destination.
//!
//! Only sends are bounded. Receives are posted as soon as the consumer has placed the
//! destination, which in ferry is at insertion time: a receive that waited for a window slot
//! could keep its sender's window full and deadlock two ranks that each wait for the other.

use ferry_base::error::Rank;
use std::collections::VecDeque;

/// A send waiting for a window slot.
pub(super) struct Waiting<T> {
    pub(super) peer: Rank,
    pub(super) item: T,
}

/// Counts rendezvous sends in flight and queues the rest in arrival order.
pub(super) struct SendWindow<T> {
    max_total: usize,
    max_per_peer: usize,
    in_flight: usize,
    per_peer: Vec<usize>,
    queue: VecDeque<Waiting<T>>,
}

impl<T> SendWindow<T> {
    pub(super) fn new(size: usize, max_total: usize, max_per_peer: usize) -> Self {
        SendWindow {
            max_total,
            max_per_peer,
            in_flight: 0,
            per_peer: vec![0; size],
            queue: VecDeque::new(),
        }
    }

    fn fits(&self, peer: Rank) -> bool {
        self.in_flight < self.max_total && self.per_peer[peer as usize] < self.max_per_peer
    }

    /// Returns the item when it may be posted now (and counts it), or queues it.
    pub(super) fn admit(&mut self, peer: Rank, item: T) -> Option<T> {
        if self.queue.is_empty() && self.fits(peer) {
            self.take(peer);
            Some(item)
        } else {
            self.queue.push_back(Waiting { peer, item });
            None
        }
    }

    fn take(&mut self, peer: Rank) {
        self.in_flight += 1;
        self.per_peer[peer as usize] += 1;
    }

    /// Releases the slot of a finished send to `peer` and returns the queued sends that now fit,
    /// oldest first (a send to a peer whose own window is full does not block the others).
    pub(super) fn release(&mut self, peer: Rank) -> Vec<T> {
        self.in_flight -= 1;
        self.per_peer[peer as usize] -= 1;
        let mut ready = Vec::new();
        let mut k = 0;
        while k < self.queue.len() && self.in_flight < self.max_total {
            let p = self.queue[k].peer;
            if self.fits(p) {
                let w = self.queue.remove(k).expect("index checked");
                self.take(p);
                ready.push(w.item);
            } else {
                k += 1;
            }
        }
        ready
    }

    /// Sends queued but not posted.
    pub(super) fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Drops every queued send (shutdown after an error).
    pub(super) fn drain(&mut self) -> Vec<T> {
        self.queue.drain(..).map(|w| w.item).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_total_and_per_peer() {
        let mut w = SendWindow::new(3, 3, 2);
        assert_eq!(w.admit(1, 'a'), Some('a'));
        assert_eq!(w.admit(1, 'b'), Some('b'));
        assert_eq!(w.admit(1, 'c'), None); // per-peer bound
        assert_eq!(w.admit(2, 'd'), None); // FIFO: queue not empty
        assert_eq!(w.queued(), 2);
        // Releasing a slot of peer 1 lets 'c' go, and 'd' fits the total bound too.
        assert_eq!(w.release(1), vec!['c', 'd']);
        assert_eq!(w.admit(2, 'e'), None); // total bound of 3 reached
        assert_eq!(w.release(2), vec!['e']);
    }
}
