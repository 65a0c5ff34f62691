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
use crate::error::Rank;
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

type Key = (Channel, Rank, i32);

/// Wanted receives and early messages, by channel, peer and tag.
#[derive(Default)]
pub(super) struct Matching {
    /// Receives whose message has not arrived, oldest first, with when they were wanted.
    wanted: HashMap<Key, VecDeque<(Transfer, Instant)>>,
    /// Messages that arrived before their receive was wanted, in arrival order.
    early: HashMap<Key, VecDeque<Arrived>>,
    /// Receives in `wanted`, per channel (data, acknowledgements).
    waiting: [usize; 2],
}

fn slot(c: Channel) -> usize {
    match c {
        Channel::Data => 0,
        Channel::Ack => 1,
    }
}

impl Matching {
    /// A receive of `t` on `channel`: returns it with its message when that has arrived
    /// already; otherwise it waits for it.
    pub(super) fn want(&mut self, channel: Channel, t: Transfer) -> Option<(Transfer, Arrived)> {
        let key = (channel, t.peer, t.tag);
        if let Some(m) = pop(&mut self.early, &key) {
            return Some((t, m));
        }
        self.wanted.entry(key).or_default().push_back((t, Instant::now()));
        self.waiting[slot(channel)] += 1;
        None
    }

    /// A message arrived on `channel`: returns it with the receive it is for, when that is
    /// wanted; otherwise it is kept until it is.
    /// The third value is when the receive was wanted.
    pub(super) fn arrived(&mut self, channel: Channel, m: Arrived) -> Option<(Transfer, Arrived, Instant)> {
        let key = (channel, m.source, m.tag);
        match pop(&mut self.wanted, &key) {
            Some((t, at)) => {
                self.waiting[slot(channel)] -= 1;
                Some((t, m, at))
            }
            None => {
                self.early.entry(key).or_default().push_back(m);
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
        self.wanted.values().flatten().map(|(t, at)| (t, *at))
    }

    /// The waiting receives, taken out (the early messages stay).
    pub(super) fn drain_wanted(&mut self) -> Vec<Transfer> {
        self.waiting = [0; 2];
        self.wanted
            .drain()
            .flat_map(|(_, q)| q.into_iter().map(|(t, _)| t))
            .collect()
    }

    /// Everything still here (shutdown): the waiting receives and the early messages.
    pub(super) fn drain(&mut self) -> (Vec<Transfer>, Vec<Arrived>) {
        self.waiting = [0; 2];
        let wanted = self
            .wanted
            .drain()
            .flat_map(|(_, q)| q.into_iter().map(|(t, _)| t))
            .collect();
        let early = self.early.drain().flat_map(|(_, q)| q).collect();
        (wanted, early)
    }
}

/// The front of `key`'s queue, dropping the queue when it empties (keys are mostly used once:
/// one tag per transfer).
fn pop<T>(map: &mut HashMap<Key, VecDeque<T>>, key: &Key) -> Option<T> {
    let q = map.get_mut(key)?;
    let x = q.pop_front();
    if q.is_empty() {
        map.remove(key);
    }
    x
}
