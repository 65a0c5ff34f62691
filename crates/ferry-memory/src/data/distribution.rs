//! Which rank owns which tile.

use ferry_base::error::{FerryError, Rank, Result};
use std::fmt;
use std::str::FromStr;

/// A P×Q grid of processes; rank `r` sits at row `r / q`, column `r % q` (row-major, as in
/// ScaLAPACK's default `BLACS_GRIDINIT(..., 'R', ...)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProcessGrid {
    /// Process rows.
    pub p: usize,
    /// Process columns.
    pub q: usize,
}

impl ProcessGrid {
    /// A `p`×`q` grid.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when `p` or `q` is 0, or `p·q` does not fit a `usize`.
    pub fn new(p: usize, q: usize) -> Result<ProcessGrid> {
        if p == 0 || q == 0 {
            return Err(FerryError::InvalidArgument(format!("process grid {p}x{q} is empty")));
        }
        if p.checked_mul(q).is_none() {
            return Err(FerryError::InvalidArgument(format!(
                "process grid {p}x{q} is too large"
            )));
        }
        Ok(ProcessGrid { p, q })
    }

    /// The grid of `size` ranks that is as square as possible, with `p ≤ q`
    /// (e.g. 1→1×1, 2→1×2, 4→2×2, 6→2×3, 7→1×7).
    pub fn squarest(size: usize) -> ProcessGrid {
        let size = size.max(1);
        let mut p = (size as f64).sqrt() as usize;
        while p > 1 && size % p != 0 {
            p -= 1;
        }
        let p = p.max(1);
        ProcessGrid { p, q: size / p }
    }

    /// Number of ranks in the grid (`usize::MAX` for a grid too large to count, which
    /// [`Distribution::validate`] refuses).
    pub fn size(&self) -> usize {
        self.p.saturating_mul(self.q)
    }
}

impl FromStr for ProcessGrid {
    type Err = FerryError;

    /// Parses `PxQ` (also `P×Q` and `P,Q`).
    fn from_str(s: &str) -> Result<ProcessGrid> {
        let bad = || FerryError::InvalidArgument(format!("grid {s:?}: expected PxQ, e.g. 2x3"));
        let (p, q) = s.split_once(['x', 'X', '×', ',']).ok_or_else(bad)?;
        ProcessGrid::new(
            p.trim().parse().map_err(|_| bad())?,
            q.trim().parse().map_err(|_| bad())?,
        )
    }
}

impl fmt::Display for ProcessGrid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.p, self.q)
    }
}

/// How the tiles of a 2D collection are spread over ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Distribution {
    /// 2D block-cyclic: tile `(i, j)` belongs to grid position `(i mod P, j mod Q)`, i.e. rank
    /// `(i mod P)·Q + (j mod Q)` (ScaLAPACK users' guide, §4.3). The distribution of dense
    /// factorizations: it balances the shrinking trailing matrix.
    BlockCyclic2d(ProcessGrid),
    /// 2D block: the `mt` tile rows are cut into `P` contiguous bands of near-equal size, the `nt`
    /// tile columns into `Q`; tile `(i, j)` belongs to band `(⌊i·P/mt⌋, ⌊j·Q/nt⌋)`. The
    /// distribution of stencils: only band borders cross ranks.
    Block2d(ProcessGrid),
    /// Every tile on one rank.
    OnRank(Rank),
}

impl Distribution {
    /// Shorthand for [`Distribution::BlockCyclic2d`] of a `p`×`q` grid (0s are rejected when the
    /// collection is created).
    pub fn block_cyclic_2d(p: usize, q: usize) -> Distribution {
        Distribution::BlockCyclic2d(ProcessGrid { p, q })
    }

    /// Shorthand for [`Distribution::Block2d`] of a `p`×`q` grid.
    pub fn block_2d(p: usize, q: usize) -> Distribution {
        Distribution::Block2d(ProcessGrid { p, q })
    }

    /// Checks that the distribution fits a communicator of `size` ranks.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when the grid's size differs from `size` or a rank is out
    /// of range.
    pub fn validate(&self, size: usize) -> Result<()> {
        match self {
            Distribution::BlockCyclic2d(g) | Distribution::Block2d(g) => {
                if g.p == 0 || g.q == 0 || g.p.checked_mul(g.q) != Some(size) {
                    return Err(FerryError::InvalidArgument(format!(
                        "process grid {g} does not have the job's {size} ranks"
                    )));
                }
            }
            Distribution::OnRank(r) => {
                if *r < 0 || *r as usize >= size {
                    return Err(FerryError::InvalidArgument(format!(
                        "rank {r} does not exist in a job of {size} ranks"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Owner of tile `(i, j)` of an `mt`×`nt` tile array, for `i < mt`, `j < nt` and a
    /// distribution that passed [`Distribution::validate`]. Anything else gives some rank
    /// (never a panic): collections check both before they ask.
    #[inline]
    pub fn owner(&self, i: usize, j: usize, mt: usize, nt: usize) -> Rank {
        match *self {
            Distribution::BlockCyclic2d(g) => {
                let (p, q) = (g.p.max(1), g.q.max(1));
                ((i % p).wrapping_mul(q).wrapping_add(j % q)) as Rank
            }
            Distribution::Block2d(g) => {
                let bi = i.wrapping_mul(g.p) / mt.max(1);
                let bj = j.wrapping_mul(g.q) / nt.max(1);
                (bi.wrapping_mul(g.q).wrapping_add(bj)) as Rank
            }
            Distribution::OnRank(r) => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squarest_grids() {
        let g = |n| {
            let g = ProcessGrid::squarest(n);
            (g.p, g.q)
        };
        assert_eq!(
            [g(1), g(2), g(3), g(4), g(6), g(7), g(9)],
            [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (1, 7), (3, 3)]
        );
    }

    #[test]
    fn parse_grid() {
        assert_eq!("2x3".parse::<ProcessGrid>().unwrap(), ProcessGrid { p: 2, q: 3 });
        assert!("2x0".parse::<ProcessGrid>().is_err());
        assert!("23".parse::<ProcessGrid>().is_err());
    }

    #[test]
    fn owners() {
        let d = Distribution::block_cyclic_2d(2, 2);
        assert_eq!(d.owner(3, 2, 8, 8), 2);
        let b = Distribution::block_2d(2, 1);
        let owners: Vec<_> = (0..5).map(|i| b.owner(i, 0, 5, 1)).collect();
        assert_eq!(owners, [0, 0, 0, 1, 1]);
        assert!(d.validate(3).is_err());
        assert!(Distribution::OnRank(2).validate(2).is_err());
    }

    /// A grid whose rank count overflows is refused, not wrapped into a valid-looking size.
    #[test]
    fn oversized_grids_are_refused() {
        assert!(ProcessGrid::new(usize::MAX, 2).is_err());
        assert!("4294967296x4294967296".parse::<ProcessGrid>().is_err());
        // p = 2^63 + 1, q = 2 wraps to 2 in plain arithmetic.
        let wraps = Distribution::block_cyclic_2d((1 << 63) + 1, 2);
        assert!(wraps.validate(2).is_err());
        assert_eq!(ProcessGrid { p: usize::MAX, q: 2 }.size(), usize::MAX);
        // Unvalidated distributions still answer without panicking.
        let _ = Distribution::block_cyclic_2d(0, 0).owner(3, 4, 8, 8);
        let _ = Distribution::block_2d(usize::MAX, usize::MAX).owner(3, 4, 8, 8);
    }
}
