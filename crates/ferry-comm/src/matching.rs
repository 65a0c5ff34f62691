//! Receives matched on arrival.
//!
//! A task graph inserted ahead of its execution knows thousands of receives long before their
//! messages come. Posting them all with `MPI_Irecv` made every `MPI_Testsome` of the progress
//! loop scan thousands of requests: on the 2-rank CPU stencil, 2000 steps ran 1.8× slower per
//! step than 200, and `ompi_request_default_test_some` was 58% of the MPI thread's time. So a
//! receive is posted only when its message is there: the loop takes each arrival out of MPI's
//! matching with `MPI_Improbe` (any source, any tag), and pairs it with the oldest wanted receive
//! of the same channel, source and tag, or keeps it until that receive is wanted; the pair is
//! then received with `MPI_Imrecv`. MPI's order between messages of one source and tag is kept,
//! and so is its rendezvous: a large message moves only once it is received into its buffer.
//! Only requests that are moving data are tested.

use super::mpi::Arrived;
use super::{Channel, Transfer};
use ferry_base::error::Rank;
use ferry_base::fifo_map::FifoMap;
use std::time::Instant;

type Key = (Channel, Rank, i32);

/// Wanted receives and early messages, by channel, peer and tag.
#[derive(Default)]
pub(super) struct Matching {
    /// Receives whose message has not arrived, oldest first, with when they were wanted.
    wanted: FifoMap<Key, (Transfer, Instant)>,
    /// Messages that arrived before their receive was wanted, in arrival order.
    early: FifoMap<Key, Arrived>,
    /// Receives in `wanted`, per channel (data, acknowledgements, one-sided payloads).
    waiting: [usize; 3],
}

fn slot(c: Channel) -> usize {
    match c {
        Channel::Data => 0,
        Channel::Ack => 1,
        Channel::OneSided => 2,
        Channel::Am => unreachable!("active messages are never matched (progress.rs refuses their receives)"),
    }
}

impl Matching {
    /// A receive of `t` on `channel`: returns it with its message when that has arrived
    /// already; otherwise it waits for it.
    pub(super) fn want(&mut self, channel: Channel, t: Transfer) -> Option<(Transfer, Arrived)> {
        let key = (channel, t.peer, t.tag);
        if let Some(m) = self.early.pop(&key) {
            return Some((t, m));
        }
        self.wanted.push(key, (t, Instant::now()));
        self.waiting[slot(channel)] += 1;
        None
    }

    /// A message arrived on `channel`: returns it with the receive it is for, when that is
    /// wanted; otherwise it is kept until it is.
    /// The third value is when the receive was wanted.
    pub(super) fn arrived(&mut self, channel: Channel, m: Arrived) -> Option<(Transfer, Arrived, Instant)> {
        let key = (channel, m.source, m.tag);
        match self.wanted.pop(&key) {
            Some((t, at)) => {
                self.waiting[slot(channel)] -= 1;
                Some((t, m, at))
            }
            None => {
                self.early.push(key, m);
                None
            }
        }
    }

    /// Receives waiting for their message.
    pub(super) fn waiting(&self) -> usize {
        self.waiting.iter().sum()
    }

    /// Receives on `channel` waiting for their message. A channel without any need not be
    /// probed: what arrives there meanwhile stays in MPI's queue until a receive is wanted.
    pub(super) fn waiting_on(&self, channel: Channel) -> usize {
        self.waiting[slot(channel)]
    }

    /// The waiting receives, with when they were wanted (for reports).
    pub(super) fn wanted(&self) -> impl Iterator<Item = (&Transfer, Instant)> {
        self.wanted.iter().map(|(t, at)| (t, *at))
    }

    /// The waiting receives, taken out (the early messages stay).
    pub(super) fn drain_wanted(&mut self) -> Vec<Transfer> {
        self.waiting = [0; 3];
        self.wanted.drain().map(|(t, _)| t).collect()
    }

    /// Everything still here (shutdown): the waiting receives and the early messages.
    pub(super) fn drain(&mut self) -> (Vec<Transfer>, Vec<Arrived>) {
        self.waiting = [0; 3];
        let wanted = self.wanted.drain().map(|(t, _)| t).collect();
        let early = self.early.drain().collect();
        (wanted, early)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemRegion;
    use ferry_base::traffic::TrafficPath;
    use std::sync::{Arc, Mutex};

    struct Buf(usize);
    // SAFETY: never handed to MPI: the matching tests only read its length.
    unsafe impl MemRegion for Buf {
        fn ptr(&self) -> *mut u8 {
            std::ptr::null_mut()
        }
        fn len(&self) -> usize {
            self.0
        }
    }

    /// A receive of `len` bytes from `peer` with `tag`; its completion appends `len` to `log`.
    fn recv(peer: Rank, tag: i32, len: usize, log: &Arc<Mutex<Vec<usize>>>) -> Transfer {
        let log = log.clone();
        Transfer {
            region: Arc::new(Buf(len)),
            peer,
            tag,
            channel: Channel::Data,
            path: TrafficPath::Control,
            counts: false,
            eager: true,
            done: Box::new(move |_| log.lock().unwrap().push(len)),
        }
    }

    fn message(source: Rank, tag: i32, len: usize) -> Arrived {
        Arrived {
            // SAFETY: reading an initialised constant of the rsmpi shim (no MPI call).
            msg: unsafe { mpi::ffi::RSMPI_MESSAGE_NULL },
            source,
            tag,
            len,
        }
    }

    /// Arrivals pair with the oldest wanted receive of their channel, source and tag, whichever
    /// comes first; messages of one source and tag keep their order; other channels, sources and
    /// tags never match.
    #[test]
    fn pairs_in_order_per_channel_source_and_tag() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut m = Matching::default();
        // Wanted first, then the message.
        assert!(m.want(Channel::Data, recv(1, 7, 10, &log)).is_none());
        assert!(m.want(Channel::Data, recv(1, 7, 11, &log)).is_none());
        assert_eq!(
            (m.waiting(), m.waiting_on(Channel::Data), m.waiting_on(Channel::Ack)),
            (2, 2, 0)
        );
        assert!(m.arrived(Channel::Ack, message(1, 7, 10)).is_none(), "another channel");
        assert!(m.arrived(Channel::Data, message(2, 7, 10)).is_none(), "another source");
        let (t, a, _) = m.arrived(Channel::Data, message(1, 7, 10)).expect("pairs");
        assert_eq!((t.region.len(), a.len), (10, 10), "the oldest receive first");
        let (t, _, _) = m.arrived(Channel::Data, message(1, 7, 11)).expect("pairs");
        assert_eq!(t.region.len(), 11);
        assert_eq!(m.waiting(), 0);
        // The message first, then the receive.
        let (t, a) = m.want(Channel::Data, recv(2, 7, 12, &log)).expect("arrived earlier");
        assert_eq!((t.region.len(), a.source), (12, 2));
        let (t, a) = m.want(Channel::Ack, recv(1, 7, 13, &log)).expect("arrived earlier");
        assert_eq!((t.region.len(), a.tag), (13, 7));
        // Shutdown: what is left.
        assert!(m.want(Channel::Data, recv(3, 1, 14, &log)).is_none());
        assert!(m.arrived(Channel::Data, message(4, 2, 15)).is_none());
        let (wanted, early) = m.drain();
        assert_eq!((wanted.len(), early.len(), m.waiting()), (1, 1, 0));
        assert!(log.lock().unwrap().is_empty(), "nothing completes here");
    }

    /// A reused tag keeps arrival order through the queue's growth from one entry to many and
    /// back, and shutdown takes out every entry of a long queue.
    #[test]
    fn a_reused_tag_keeps_arrival_order() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut m = Matching::default();
        for len in [20, 21, 22] {
            assert!(m.arrived(Channel::Data, message(1, 3, len)).is_none());
        }
        for len in [20, 21] {
            let (_, a) = m.want(Channel::Data, recv(1, 3, len, &log)).expect("arrived earlier");
            assert_eq!(a.len, len, "oldest message first");
        }
        assert!(m.arrived(Channel::Data, message(1, 3, 23)).is_none());
        for len in [22, 23] {
            let (_, a) = m.want(Channel::Data, recv(1, 3, len, &log)).expect("arrived earlier");
            assert_eq!(a.len, len);
        }
        for len in [30, 31, 32] {
            assert!(m.want(Channel::Ack, recv(2, 5, len, &log)).is_none());
        }
        assert_eq!(m.wanted().count(), 3);
        let (wanted, early) = m.drain();
        let lens: Vec<usize> = wanted.iter().map(|t| t.region.len()).collect();
        assert_eq!((lens, early.len()), (vec![30, 31, 32], 0));
    }
}
