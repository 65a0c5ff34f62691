//! A set of ranks: which ranks hold the newest version of a tile.

use ferry_base::error::Rank;

/// A set of ranks as a bitmap: one word inline for up to 64 ranks, spilling to the heap beyond.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankSet {
    /// Up to 64 ranks: bit `r` is rank `r`.
    Small(u64),
    /// More ranks: word `r / 64`, bit `r % 64`.
    Large(Box<[u64]>),
}

impl RankSet {
    /// The set `{r}` for a communicator of `size` ranks.
    pub fn single(size: usize, r: Rank) -> RankSet {
        let mut s = if size <= 64 {
            RankSet::Small(0)
        } else {
            RankSet::Large(vec![0; size.div_ceil(64)].into_boxed_slice())
        };
        s.insert(r);
        s
    }

    /// Whether `r` is in the set.
    pub fn contains(&self, r: Rank) -> bool {
        let r = r as usize;
        match self {
            RankSet::Small(w) => r < 64 && w & (1 << r) != 0,
            RankSet::Large(ws) => ws.get(r / 64).is_some_and(|w| w & (1 << (r % 64)) != 0),
        }
    }

    /// Adds `r`.
    pub fn insert(&mut self, r: Rank) {
        let r = r as usize;
        match self {
            RankSet::Small(w) => *w |= 1 << r,
            RankSet::Large(ws) => ws[r / 64] |= 1 << (r % 64),
        }
    }

    /// Makes the set `{r}`.
    #[inline]
    pub fn reset_to(&mut self, r: Rank) {
        match self {
            RankSet::Small(w) => *w = 0,
            RankSet::Large(ws) => ws.iter_mut().for_each(|w| *w = 0),
        }
        self.insert(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_sets() {
        for size in [4usize, 64, 200] {
            let mut s = RankSet::single(size, 3);
            assert!(s.contains(3) && !s.contains(2));
            s.insert((size - 1) as Rank);
            assert!(s.contains((size - 1) as Rank));
            s.reset_to(0);
            assert!(s.contains(0) && !s.contains(3));
        }
    }
}
