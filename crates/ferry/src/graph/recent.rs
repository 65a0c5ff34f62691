//! The descriptions of the last tasks a rank inserted, kept so that a graph-mismatch report
//! can say what each rank inserted at the first differing task.

use super::inserter::LocalTile;
use super::task::Task;
use ferry_base::error::Rank;
use ferry_memory::data::directory::{Directory, TileKey};
use ferry_memory::data::AccessMode;
use std::sync::Arc;

/// How many recent task descriptions a rank keeps for graph-mismatch reports.
const RECENT_TASKS: usize = 4096;

/// A recent task, kept in two cache lines without heap allocation (at most `RECENT_ACCESSES`
/// accesses, as tile keys, and `RECENT_ARGS` arguments), formatted only for a report.
#[derive(Clone, Copy)]
pub(super) struct Recent {
    seq: u64,
    /// The class's name hash (names are looked up when a report is made: cloning the class's
    /// `Arc` per task would bounce its count between the inserting thread and the workers).
    class: u64,
    args: [i64; RECENT_ARGS],
    keys: [TileKey; RECENT_ACCESSES],
    modes: [AccessMode; RECENT_ACCESSES],
    exec: Rank,
    nacc: u8,
    nargs: u8,
    more_acc: bool,
}

const RECENT_ACCESSES: usize = 8;
const RECENT_ARGS: usize = 4;

impl Recent {
    /// A slot of the ring no task has filled yet (no task has sequence number `u64::MAX`).
    const VACANT: Recent = Recent {
        seq: u64::MAX,
        class: 0,
        args: [0; RECENT_ARGS],
        keys: [(0, 0); RECENT_ACCESSES],
        modes: [AccessMode::Read; RECENT_ACCESSES],
        exec: 0,
        nacc: 0,
        nargs: 0,
        more_acc: false,
    };

    /// `keys`: the task's tiles, in access order (as validated).
    pub(super) fn new(seq: u64, task: &Task<'_>, keys: &[TileKey], exec: Rank) -> Recent {
        let nacc = keys.len().min(RECENT_ACCESSES);
        let mut r = Recent {
            seq,
            class: task.class.inner.name_hash,
            args: [0; RECENT_ARGS],
            keys: [(0, 0); RECENT_ACCESSES],
            modes: [AccessMode::Read; RECENT_ACCESSES],
            exec,
            nacc: nacc as u8,
            nargs: task.args.len().min(RECENT_ARGS) as u8,
            more_acc: keys.len() > RECENT_ACCESSES,
        };
        r.keys[..nacc].copy_from_slice(&keys[..nacc]);
        for (m, a) in r.modes.iter_mut().zip(task.accesses) {
            *m = a.mode;
        }
        let nargs = r.nargs as usize;
        r.args[..nargs].copy_from_slice(&task.args[..nargs]);
        r
    }

    /// `` `gemm` on rank 1: R c0(3,1) R c0(2,1) RW c0(3,2) args [4] ``
    pub(super) fn describe(&self, names: &rustc_hash::FxHashMap<u64, Arc<str>>, dir: &Directory<LocalTile>) -> String {
        let name = names.get(&self.class).map_or("?", |n| &**n);
        let mut s = format!("`{name}` on rank {}:", self.exec);
        let n = self.nacc as usize;
        for (&(coll, idx), mode) in self.keys[..n].iter().zip(&self.modes[..n]) {
            let m = match mode {
                AccessMode::Read => "R",
                AccessMode::Write => "W",
                AccessMode::ReadWrite => "RW",
                AccessMode::ReadWritePart => "RWP",
            };
            match dir.desc(coll) {
                Some(d) => {
                    let (i, j) = d.coords(idx as usize);
                    s += &format!(" {m} c{coll}({i},{j})");
                }
                None => s += &format!(" {m} c{coll}[{idx}]"),
            }
        }
        if self.more_acc {
            s += " …";
        }
        if self.nargs > 0 {
            s += &format!(" args {:?}", &self.args[..self.nargs as usize]);
        }
        s
    }
}

/// The last [`RECENT_TASKS`] task descriptions: a ring allocated and written whole when the
/// runtime starts. Grown by doubling as tasks came in, its last growth (256 → 512 KiB) fell in
/// the 2049th task's insertion — where, with an allocator that asks for transparent huge pages
/// (mimalloc), the fresh memory's first touch stalled the inserting thread for 5–7 ms on the CI
/// VM (perf: `clear_page_erms` under `RawVec::grow_one`), in about half of Task Bench's timed
/// runs.
pub(super) struct RecentRing {
    slots: Box<[Recent]>,
    /// Where the next description goes.
    next: usize,
}

impl RecentRing {
    pub(super) fn new() -> RecentRing {
        RecentRing {
            slots: vec![Recent::VACANT; RECENT_TASKS].into_boxed_slice(),
            next: 0,
        }
    }

    /// Keeps `r`, in place of the oldest description once the ring is full.
    pub(super) fn push(&mut self, r: Recent) {
        self.slots[self.next] = r;
        self.next = (self.next + 1) % RECENT_TASKS;
    }

    /// The description of task `seq`, if it is among the last [`RECENT_TASKS`].
    pub(super) fn find(&self, seq: u64) -> Option<&Recent> {
        let vacant = seq == Recent::VACANT.seq;
        self.slots.iter().find(|r| r.seq == seq && !vacant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ring keeps exactly the last `RECENT_TASKS` descriptions, overwriting the oldest,
    /// and finds none for a task it never held (its vacant slots included).
    #[test]
    fn the_recent_ring_keeps_the_last_tasks_without_growing() {
        let mut ring = RecentRing::new();
        assert_eq!(ring.slots.len(), RECENT_TASKS, "allocated whole at start");
        assert!(ring.find(0).is_none() && ring.find(u64::MAX).is_none());
        let n = RECENT_TASKS as u64 + 904;
        for seq in 0..n {
            ring.push(Recent {
                seq,
                exec: (seq % 3) as Rank,
                ..Recent::VACANT
            });
            if seq == 10 {
                assert_eq!(ring.find(7).map(|r| r.exec), Some(1));
                assert!(ring.find(u64::MAX).is_none(), "vacant slots are never found");
            }
        }
        assert_eq!(ring.slots.len(), RECENT_TASKS, "never grows");
        let oldest = n - RECENT_TASKS as u64;
        assert!(ring.find(oldest - 1).is_none(), "overwritten");
        for seq in [oldest, oldest + 1, n / 2, n - 1] {
            let r = ring.find(seq).expect("among the last RECENT_TASKS");
            assert_eq!((r.seq, r.exec), (seq, (seq % 3) as Rank));
        }
        assert!(ring.find(n).is_none(), "not inserted yet");
    }
}
