//! The copy directory: for every tile of every collection, which version is newest and which
//! ranks hold it; for this rank, the local state of each tile it has a copy of.
//!
//! Every rank keeps the global part for *all* tiles, updated from the inserted sequence alone
//! (each rank sees the same sequence, so all ranks agree without talking). That costs O(1) per
//! access of every task, also for tasks that touch none of this rank's tiles: the constant-time
//! skip of the design.

use super::collection::CollectionDesc;
use super::rankset::RankSet;
use ferry_base::error::{FerryError, Rank, Result};
use std::collections::BTreeSet;
use std::sync::Arc;

/// What every rank knows about one tile.
#[derive(Debug, Clone)]
pub struct TileMeta {
    /// Number of writes inserted so far.
    pub version: u32,
    /// Rank that produced the newest version (the owner for version 0).
    pub writer: Rank,
    /// Ranks holding the newest version.
    pub valid_on: RankSet,
    /// The tile's owner (kept: the distribution's arithmetic is not free, and every write asks).
    owner: Rank,
    /// The tile is in `Directory::away` (so that a write on the owner, the usual case, leaves
    /// the set alone instead of searching it).
    away: bool,
}

/// A tile's address: collection id and linear tile index.
pub type TileKey = (u32, u32);

struct CollDir<L> {
    desc: Arc<CollectionDesc>,
    meta: Vec<TileMeta>,
    local: Vec<Option<L>>,
}

/// Global tile metadata plus a per-rank local payload `L` for every tile (the graph layer keeps
/// its dependency trackers and copy buffers there).
pub struct Directory<L> {
    rank: Rank,
    size: usize,
    colls: Vec<CollDir<L>>,
    /// Tiles whose newest version is not on their owner, in a deterministic order (ranks walk it
    /// identically when they bring tiles home).
    away: BTreeSet<TileKey>,
}

impl<L> Directory<L> {
    /// An empty directory of rank `rank` of `size`.
    pub fn new(rank: Rank, size: usize) -> Self {
        Directory {
            rank,
            size,
            colls: Vec::new(),
            away: BTreeSet::new(),
        }
    }

    /// Registers a collection; `init_local` builds the local payload of each tile this rank owns.
    ///
    /// # Errors
    /// [`FerryError::InvalidArgument`] when the entries of its tiles cannot be allocated (nothing
    /// is registered then).
    pub fn add(&mut self, desc: Arc<CollectionDesc>, mut init_local: impl FnMut(usize, usize) -> L) -> Result<()> {
        let count = desc.mt * desc.nt;
        let mut meta = Vec::new();
        let mut local = Vec::new();
        // Fallible: a collection of many small tiles costs every rank an entry per tile, and a
        // failed allocation would abort the process rather than return.
        if meta.try_reserve_exact(count).is_err() || local.try_reserve_exact(count).is_err() {
            return Err(FerryError::InvalidArgument(format!(
                "collection `{}`: no memory for the directory entries of its {count} tiles",
                desc.name
            )));
        }
        for idx in 0..count {
            let (i, j) = desc.coords(idx);
            let owner = desc.owner(i, j);
            meta.push(TileMeta {
                version: 0,
                writer: owner,
                valid_on: RankSet::single(self.size, owner),
                owner,
                away: false,
            });
            local.push((owner == self.rank).then(|| init_local(i, j)));
        }
        self.colls.push(CollDir { desc, meta, local });
        Ok(())
    }

    /// Whether no collection is registered.
    pub fn is_empty(&self) -> bool {
        self.colls.is_empty()
    }

    /// Number of collections registered.
    pub fn len(&self) -> usize {
        self.colls.len()
    }

    /// Collection `coll`, if registered.
    pub fn desc(&self, coll: u32) -> Option<&Arc<CollectionDesc>> {
        self.colls.get(coll as usize).map(|c| &c.desc)
    }

    /// What every rank knows of tile `key`: its newest version, writer and holders.
    ///
    /// # Panics
    /// `key` names no registered tile (keys come from the directory itself).
    pub fn meta(&self, key: TileKey) -> &TileMeta {
        &self.colls[key.0 as usize].meta[key.1 as usize]
    }

    /// Records that `rank` now holds the newest version of `key` (after a transfer).
    pub fn mark_valid(&mut self, key: TileKey, rank: Rank) {
        let m = &mut self.colls[key.0 as usize].meta[key.1 as usize];
        m.valid_on.insert(rank);
        if m.owner == rank {
            set_away(&mut self.away, &mut m.away, key, false);
        }
    }

    /// Records a new version of `key` produced on `writer`.
    #[inline]
    pub fn record_write(&mut self, key: TileKey, writer: Rank) {
        let m = &mut self.colls[key.0 as usize].meta[key.1 as usize];
        m.version = m.version.wrapping_add(1);
        m.writer = writer;
        m.valid_on.reset_to(writer);
        let away = m.owner != writer;
        set_away(&mut self.away, &mut m.away, key, away);
    }

    /// Sets what every rank knows of `key` to a state recorded earlier: `writes` more versions,
    /// the newest on `writer`, held by `valid_on` (a replayed sequence of tasks leaves its tiles
    /// as its recording did, without the per-access updates of [`Directory::record_write`] and
    /// [`Directory::mark_valid`]).
    pub fn restore(&mut self, key: TileKey, writes: u32, writer: Rank, valid_on: &RankSet) {
        let m = &mut self.colls[key.0 as usize].meta[key.1 as usize];
        m.version = m.version.wrapping_add(writes);
        m.writer = writer;
        m.valid_on.clone_from(valid_on);
        let away = !m.valid_on.contains(m.owner);
        set_away(&mut self.away, &mut m.away, key, away);
    }

    /// Tiles whose newest version is away from their owner, in key order.
    pub fn away(&self) -> Vec<TileKey> {
        self.away.iter().copied().collect()
    }

    /// This rank's payload of tile `key`, if it holds one.
    pub fn local(&self, key: TileKey) -> Option<&L> {
        self.colls[key.0 as usize].local[key.1 as usize].as_ref()
    }

    /// This rank's payload slot of tile `key`.
    pub fn local_mut(&mut self, key: TileKey) -> &mut Option<L> {
        &mut self.colls[key.0 as usize].local[key.1 as usize]
    }
}

/// Keeps `key`'s flag (`flag`, in its meta) and its membership of the away set (`set`) at
/// `away`; the set is touched only when the flag changes.
#[inline]
fn set_away(set: &mut BTreeSet<TileKey>, flag: &mut bool, key: TileKey, away: bool) {
    if away != *flag {
        *flag = away;
        if away {
            set.insert(key);
        } else {
            set.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Distribution;

    #[test]
    fn versions_writers_and_away_set() {
        let desc =
            Arc::new(CollectionDesc::new::<f64>(0, "a", 4, 4, 2, 2, Distribution::block_cyclic_2d(1, 2), 2).unwrap());
        let mut d: Directory<()> = Directory::new(0, 2);
        d.add(desc, |_, _| ()).expect("small collection");
        // Tile (0,1) is owned by rank 1; rank 0 holds nothing of it locally.
        assert!(d.local((0, 1)).is_none() && d.local((0, 0)).is_some());
        assert_eq!(d.meta((0, 1)).writer, 1);
        d.record_write((0, 1), 0);
        assert_eq!(d.meta((0, 1)).version, 1);
        assert_eq!(d.away(), vec![(0, 1)]);
        d.mark_valid((0, 1), 1);
        assert!(d.away().is_empty());
        assert!(d.meta((0, 1)).valid_on.contains(0));
        // Away again, then back by a write on the owner; a second write away, a write on a
        // non-owner of another tile: the set follows every change, in key order.
        d.record_write((0, 1), 0);
        d.record_write((0, 0), 1);
        assert_eq!(d.away(), vec![(0, 0), (0, 1)]);
        d.record_write((0, 1), 0);
        assert_eq!(d.away(), vec![(0, 0), (0, 1)]);
        d.record_write((0, 1), 1);
        assert_eq!(d.away(), vec![(0, 0)]);
        d.mark_valid((0, 0), 1);
        assert_eq!(d.away(), vec![(0, 0)], "valid on a non-owner: still away");
        d.mark_valid((0, 0), 0);
        assert!(d.away().is_empty());
        assert_eq!(d.meta((0, 1)).version, 4);
    }
}
