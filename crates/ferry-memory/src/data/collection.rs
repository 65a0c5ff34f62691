//! Distributed collections of tiles and the accesses tasks declare on them.

use super::distribution::Distribution;
use ferry_base::error::{FerryError, Rank, Result};
use ferry_base::AccessMode;
use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::Arc;

/// Largest tile in bytes: one MPI message carries a tile, and MPI counts are `int`.
pub const MAX_TILE_BYTES: usize = i32::MAX as usize;

/// Most tiles in one collection: 2^26 (67 108 864). Every rank keeps a directory entry per tile
/// of every collection (about 140 bytes: version, writer, the ranks holding it), so this bounds
/// that bookkeeping at about 9 GiB per rank; a larger tile grid is refused when the collection
/// is made rather than aborting the process in an allocation.
pub const MAX_TILES: usize = 1 << 26;

/// The shape and placement of a collection, shared by its handles and the runtime.
#[derive(Debug)]
pub struct CollectionDesc {
    /// The collection's number in its runtime (the same on every rank: collections are made in
    /// the same order everywhere).
    pub id: u32,
    /// The runtime that made it ([`CollectionDesc::in_runtime`]; 0 until then): ids are reused
    /// by the next runtime of a process, this is not.
    pub runtime: u64,
    /// The name given at creation (errors and traces).
    pub name: String,
    /// Elements per column (rows) and per row (columns) of the whole collection.
    pub m: usize,
    /// Elements per row (columns) of the whole collection.
    pub n: usize,
    /// Tile rows and columns (the last tile row/column may be smaller: ragged).
    pub mb: usize,
    /// Tile columns.
    pub nb: usize,
    /// Tiles per column and per row.
    pub mt: usize,
    /// Tiles per row.
    pub nt: usize,
    /// Which rank owns each tile.
    pub dist: Distribution,
    /// Bytes of one element.
    pub elem_size: usize,
    /// The element type, checked when a body borrows a tile.
    pub elem_type: TypeId,
    /// The element type's name, for errors.
    pub elem_name: &'static str,
}

impl CollectionDesc {
    /// Validates and builds a description. `size` is the communicator size.
    #[allow(clippy::too_many_arguments)]
    pub fn new<T: 'static>(
        id: u32,
        name: &str,
        m: usize,
        n: usize,
        mb: usize,
        nb: usize,
        dist: Distribution,
        size: usize,
    ) -> Result<CollectionDesc> {
        let bad = |msg: String| Err(FerryError::InvalidArgument(format!("collection `{name}`: {msg}")));
        if m == 0 || n == 0 {
            return bad(format!("shape {m}×{n} is empty"));
        }
        if mb == 0 || nb == 0 {
            return bad(format!("tile shape {mb}×{nb} is empty"));
        }
        if mb > m || nb > n {
            return bad(format!("tile {mb}×{nb} is larger than the collection {m}×{n}"));
        }
        let elem_size = std::mem::size_of::<T>();
        if std::mem::align_of::<T>() > 8 {
            return bad("element alignment above 8 bytes is not supported".into());
        }
        match mb.checked_mul(nb).and_then(|e| e.checked_mul(elem_size)) {
            Some(b) if b <= MAX_TILE_BYTES => {}
            _ => return bad(format!("a {mb}×{nb} tile exceeds {MAX_TILE_BYTES} bytes")),
        }
        let (mt, nt) = (m.div_ceil(mb), n.div_ceil(nb));
        if mt.checked_mul(nt).is_none_or(|t| t > MAX_TILES) {
            return bad(format!(
                "{mt}×{nt} tiles are too many (at most {MAX_TILES}: every rank keeps an entry per tile)"
            ));
        }
        dist.validate(size)
            .map_err(|e| FerryError::InvalidArgument(format!("collection `{name}`: {e}")))?;
        Ok(CollectionDesc {
            id,
            runtime: 0,
            name: name.to_string(),
            m,
            n,
            mb,
            nb,
            mt,
            nt,
            dist,
            elem_size,
            elem_type: TypeId::of::<T>(),
            elem_name: std::any::type_name::<T>(),
        })
    }

    /// The description as registered by runtime `runtime` (its inserter's instance number).
    pub fn in_runtime(mut self, runtime: u64) -> Self {
        self.runtime = runtime;
        self
    }

    /// Rows and columns of tile `(i, j)`; the last row/column of tiles may be ragged.
    #[inline]
    pub fn tile_shape(&self, i: usize, j: usize) -> (usize, usize) {
        (self.mb.min(self.m - i * self.mb), self.nb.min(self.n - j * self.nb))
    }

    /// Bytes of tile `(i, j)`.
    #[inline]
    pub fn tile_bytes(&self, i: usize, j: usize) -> usize {
        let (r, c) = self.tile_shape(i, j);
        r * c * self.elem_size
    }

    /// Owner of tile `(i, j)`.
    #[inline]
    pub fn owner(&self, i: usize, j: usize) -> Rank {
        self.dist.owner(i, j, self.mt, self.nt)
    }

    /// Linear index of tile `(i, j)`, or an error when outside.
    #[inline]
    pub fn index(&self, i: usize, j: usize) -> Result<usize> {
        if i >= self.mt || j >= self.nt {
            return Err(FerryError::TileOutOfBounds {
                collection: self.name.clone(),
                i,
                j,
                mt: self.mt,
                nt: self.nt,
            });
        }
        Ok(i * self.nt + j)
    }

    /// `(i, j)` of a linear index.
    pub fn coords(&self, idx: usize) -> (usize, usize) {
        (idx / self.nt, idx % self.nt)
    }
}

/// A distributed 2D array of tiles of `T`, created by `Runtime::tiled_matrix` or
/// `Runtime::tile_grid`. Cheap to clone.
///
/// The collection is `m`×`n` elements cut into tiles of `mb`×`nb` elements (the last tile row and
/// column may be smaller). Within a tile, elements are stored contiguously, `rows × cols` of them;
/// whether that is row- or column-major is the task bodies' convention (the Cholesky example uses
/// column-major, the stencil row-major). Each tile has one owner rank given by the distribution.
pub struct Collection<T> {
    /// Its shape and placement.
    pub desc: Arc<CollectionDesc>,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for Collection<T> {
    fn clone(&self) -> Self {
        Collection {
            desc: self.desc.clone(),
            _elem: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for Collection<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = &self.desc;
        write!(
            f,
            "Collection(`{}`, {}×{} in {}×{} tiles of {}×{} {})",
            d.name, d.m, d.n, d.mt, d.nt, d.mb, d.nb, d.elem_name
        )
    }
}

impl<T> Collection<T> {
    /// A handle on the collection `desc` describes (the runtime makes it; `T` must be its element type).
    pub fn from_desc(desc: Arc<CollectionDesc>) -> Self {
        Collection {
            desc,
            _elem: PhantomData,
        }
    }

    /// Name given at creation.
    pub fn name(&self) -> &str {
        &self.desc.name
    }
    /// Elements per column (rows) of the whole collection.
    pub fn rows(&self) -> usize {
        self.desc.m
    }
    /// Elements per row (columns) of the whole collection.
    pub fn cols(&self) -> usize {
        self.desc.n
    }
    /// Tiles per column (`⌈m / mb⌉`).
    pub fn tile_rows(&self) -> usize {
        self.desc.mt
    }
    /// Tiles per row (`⌈n / nb⌉`).
    pub fn tile_cols(&self) -> usize {
        self.desc.nt
    }
    /// Nominal tile shape `(mb, nb)`.
    pub fn tile_size(&self) -> (usize, usize) {
        (self.desc.mb, self.desc.nb)
    }
    /// Shape `(rows, cols)` of tile `(i, j)`, ragged at the last row/column.
    ///
    /// # Errors
    /// [`FerryError::TileOutOfBounds`].
    pub fn tile_shape(&self, i: usize, j: usize) -> Result<(usize, usize)> {
        self.desc.index(i, j)?;
        Ok(self.desc.tile_shape(i, j))
    }
    /// Owner rank of tile `(i, j)`.
    ///
    /// # Errors
    /// [`FerryError::TileOutOfBounds`].
    pub fn owner(&self, i: usize, j: usize) -> Result<Rank> {
        self.desc.index(i, j)?;
        Ok(self.desc.owner(i, j))
    }
    /// The distribution given at creation.
    pub fn distribution(&self) -> Distribution {
        self.desc.dist
    }

    /// A read access to tile `(i, j)` (bounds are checked when the task is inserted).
    pub fn read(&self, i: usize, j: usize) -> Access {
        self.access(i, j, AccessMode::Read)
    }
    /// A write access to tile `(i, j)`: the task overwrites the tile without reading it.
    pub fn write(&self, i: usize, j: usize) -> Access {
        self.access(i, j, AccessMode::Write)
    }
    /// A read-write access to tile `(i, j)`.
    pub fn rw(&self, i: usize, j: usize) -> Access {
        self.access(i, j, AccessMode::ReadWrite)
    }
    /// A read-write access to a *part* of tile `(i, j)`, disjoint from the parts that the other
    /// tasks of its group use: see [`AccessMode::ReadWritePart`]. The caller guarantees the
    /// disjointness; ferry does not check it.
    pub fn rw_part(&self, i: usize, j: usize) -> Access {
        self.access(i, j, AccessMode::ReadWritePart)
    }
    fn access(&self, i: usize, j: usize, mode: AccessMode) -> Access {
        Access {
            coll: self.desc.id,
            runtime: self.desc.runtime,
            i,
            j,
            mode,
        }
    }
}

/// One tile a task uses, and how. Built with [`Collection::read`], [`Collection::write`],
/// [`Collection::rw`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Access {
    /// The collection's id.
    pub coll: u32,
    /// The runtime of the collection ([`CollectionDesc::runtime`]): an access through a handle
    /// of an earlier runtime is refused, not applied to whatever collection has its id now.
    pub runtime: u64,
    /// Tile row.
    pub i: usize,
    /// Tile column.
    pub j: usize,
    /// How the task uses the tile.
    pub mode: AccessMode,
}

impl Access {
    /// The access mode.
    pub fn mode(&self) -> AccessMode {
        self.mode
    }
    /// Tile coordinates `(i, j)`.
    pub fn tile(&self) -> (usize, usize) {
        (self.i, self.j)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes whose tile grid or tiles are too large are refused with a message, before any
    /// rank allocates anything for them.
    #[test]
    fn oversized_tile_grids_and_tiles_are_refused() {
        let dist = Distribution::block_cyclic_2d(1, 1);
        let err = |r: Result<CollectionDesc>| match r {
            Err(FerryError::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        // 2^13 × 2^14 one-element tiles: one tile grid past MAX_TILES.
        let m = err(CollectionDesc::new::<u8>(0, "wide", 1 << 13, 1 << 14, 1, 1, dist, 1));
        assert!(
            m.contains("tiles are too many") && m.contains(&MAX_TILES.to_string()),
            "{m}"
        );
        // Exactly MAX_TILES tiles is accepted (as a description: nothing is allocated here).
        let ok = CollectionDesc::new::<u8>(0, "edge", 1 << 13, 1 << 13, 1, 1, dist, 1).expect("at the limit");
        assert_eq!(ok.mt * ok.nt, MAX_TILES);
        let m = err(CollectionDesc::new::<f64>(
            0,
            "big",
            1 << 16,
            1 << 16,
            1 << 15,
            1 << 15,
            dist,
            1,
        ));
        assert!(m.contains("exceeds"), "{m}");
        let m = err(CollectionDesc::new::<f64>(0, "empty", 0, 4, 1, 1, dist, 1));
        assert!(m.contains("empty"), "{m}");
    }
}
