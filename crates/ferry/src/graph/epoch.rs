//! The per-task hashes of an epoch (the tasks since the last `wait`), kept to name the first
//! task on which ranks that inserted different graphs disagree — in bounded memory.
//!
//! The first [`EXACT`] tasks of an epoch keep a hash each (8 MiB). Past them, only one hash per
//! block of [`BLOCK`] tasks is kept (the fold of the block's task hashes: 8 bytes per 1 024
//! tasks), so an epoch of 10⁹ tasks holds 16 MiB instead of 8 GB; a difference that lies there
//! is located to its block. With the submission window bounding the graph itself
//! (`graph/window.rs`), this keeps a long epoch's memory flat but for that trickle.

use ferry_base::hash;

/// Tasks of an epoch whose hashes are kept one by one.
pub(crate) const EXACT: usize = 1 << 20;
/// Tasks per kept hash past the first [`EXACT`].
pub(crate) const BLOCK: u64 = 1024;

/// Where the first difference between ranks' epochs lies, relative to the epoch's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Difference {
    /// At this task.
    Task(u64),
    /// Somewhere in tasks `[lo, hi)` (past the tasks hashed one by one).
    Within(u64, u64),
}

/// The hashes of the tasks inserted since the epoch began.
#[derive(Debug, Default)]
pub(crate) struct EpochHashes {
    /// One per task, for the first [`EXACT`] tasks.
    tasks: Vec<u64>,
    /// One per full block of [`BLOCK`] tasks after those.
    blocks: Vec<u64>,
    /// The fold of the current, partial block, and its task count.
    open: u64,
    open_len: u64,
}

impl EpochHashes {
    /// Records the next task's hash.
    #[inline]
    pub(crate) fn push(&mut self, h: u64) {
        if self.tasks.len() < EXACT {
            self.tasks.push(h);
            return;
        }
        self.open = hash::fold(self.open, h);
        self.open_len += 1;
        if self.open_len == BLOCK {
            self.blocks.push(self.open);
            (self.open, self.open_len) = (0, 0);
        }
    }

    /// Tasks recorded.
    pub(crate) fn len(&self) -> u64 {
        self.tasks.len() as u64 + self.blocks.len() as u64 * BLOCK + self.open_len
    }

    /// Starts a new epoch (keeps the allocations).
    pub(crate) fn clear(&mut self) {
        self.tasks.clear();
        self.blocks.clear();
        (self.open, self.open_len) = (0, 0);
    }

    /// The recorded hashes as bytes, for an allgather: the task count, then the task hashes,
    /// then the block hashes and the partial block's, little-endian words.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let words = 1 + self.tasks.len() + self.blocks.len() + usize::from(self.open_len > 0);
        let mut out = Vec::with_capacity(words * 8);
        out.extend_from_slice(&self.len().to_le_bytes());
        for w in self.tasks.iter().chain(&self.blocks) {
            out.extend_from_slice(&w.to_le_bytes());
        }
        if self.open_len > 0 {
            out.extend_from_slice(&self.open.to_le_bytes());
        }
        out
    }

    /// The first difference between the ranks' [`EpochHashes::encode`]d epochs (the first
    /// position where a rank's hash differs from rank 0's, or where one rank's epoch ends
    /// before another's); `None` when all agree, or when a record is malformed.
    pub(crate) fn first_difference(records: &[Vec<u8>]) -> Option<Difference> {
        let decoded: Option<Vec<(u64, Vec<u64>)>> = records.iter().map(|r| decode(r)).collect();
        let decoded = decoded?;
        let longest = decoded.iter().map(|(n, _)| *n).max()?;
        // Position `k` of the word lists covers tasks `span(k)`.
        let span = |k: u64| -> (u64, u64) {
            let exact = EXACT as u64;
            if k < exact {
                (k, k + 1)
            } else {
                let lo = exact + (k - exact) * BLOCK;
                (lo, lo + BLOCK)
            }
        };
        let words = decoded.iter().map(|(_, w)| w.len()).max()? as u64;
        (0..words).find_map(|k| {
            let (lo, hi) = span(k);
            // A rank whose epoch ends inside the span has a partial block there: its word
            // differs, and so does its count, which the span's end takes into account.
            let first = &decoded[0];
            let differs = decoded.iter().any(|(n, w)| {
                w.get(k as usize) != first.1.get(k as usize) || (*n).clamp(lo, hi) != first.0.clamp(lo, hi)
            });
            differs.then(|| {
                let hi = hi.min(longest);
                if hi - lo == 1 {
                    Difference::Task(lo)
                } else {
                    Difference::Within(lo, hi)
                }
            })
        })
    }
}

/// A record of [`EpochHashes::encode`]: the task count and the words; `None` when malformed.
fn decode(r: &[u8]) -> Option<(u64, Vec<u64>)> {
    if r.len() < 8 || r.len() % 8 != 0 {
        return None;
    }
    let mut words = r
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
    let n = words.next()?;
    Some((n, words.collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch(hashes: impl IntoIterator<Item = u64>) -> EpochHashes {
        let mut e = EpochHashes::default();
        for h in hashes {
            e.push(h);
        }
        e
    }

    #[test]
    fn equal_epochs_have_no_difference() {
        let a = epoch(0..5000);
        assert_eq!(a.len(), 5000);
        assert_eq!(
            EpochHashes::first_difference(&[a.encode(), a.encode(), a.encode()]),
            None
        );
    }

    #[test]
    fn a_difference_among_the_first_tasks_is_exact() {
        let a = epoch(0..100);
        let b = epoch((0..100).map(|k| if k == 37 { 1_000_000 } else { k }));
        assert_eq!(
            EpochHashes::first_difference(&[a.encode(), b.encode()]),
            Some(Difference::Task(37))
        );
        // A shorter epoch differs where it ends.
        let c = epoch(0..60);
        assert_eq!(
            EpochHashes::first_difference(&[a.encode(), c.encode()]),
            Some(Difference::Task(60))
        );
        assert_eq!(
            EpochHashes::first_difference(&[c.encode(), a.encode()]),
            Some(Difference::Task(60))
        );
    }

    #[test]
    fn past_the_exact_tasks_memory_is_a_word_per_block_and_a_difference_is_its_block() {
        let n = EXACT as u64 + 10 * BLOCK + 5;
        let a = epoch(0..n);
        assert_eq!(a.len(), n);
        assert_eq!(a.blocks.len(), 10);
        assert_eq!(a.encode().len(), 8 * (1 + EXACT + 10 + 1));
        let bad = EXACT as u64 + 3 * BLOCK + 17;
        let b = epoch((0..n).map(|k| if k == bad { 7 } else { k }));
        let lo = EXACT as u64 + 3 * BLOCK;
        assert_eq!(
            EpochHashes::first_difference(&[a.encode(), b.encode()]),
            Some(Difference::Within(lo, lo + BLOCK))
        );
        // Epochs that end inside the same block at different tasks: that block, cut at the end.
        let c = epoch(0..n - 2);
        let lo = EXACT as u64 + 10 * BLOCK;
        assert_eq!(
            EpochHashes::first_difference(&[a.encode(), c.encode()]),
            Some(Difference::Within(lo, n))
        );
        // One rank a single task past the exact ones: that task, exactly.
        let e = epoch(0..EXACT as u64);
        let f = epoch(0..EXACT as u64 + 1);
        assert_eq!(
            EpochHashes::first_difference(&[e.encode(), f.encode()]),
            Some(Difference::Task(EXACT as u64))
        );
        // Cleared, the next epoch starts one by one again.
        let mut d = a;
        d.clear();
        d.push(1);
        assert_eq!((d.len(), d.encode().len()), (1, 16));
    }

    #[test]
    fn malformed_records_locate_nothing() {
        let a = epoch(0..3).encode();
        assert_eq!(EpochHashes::first_difference(&[a.clone(), vec![1, 2, 3]]), None);
        assert_eq!(EpochHashes::first_difference(&[a, Vec::new()]), None);
    }
}
