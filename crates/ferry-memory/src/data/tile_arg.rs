//! The tiles a piece of work touches, as the data layer hands them to whoever runs it: each
//! tile's copy, shape and access mode.

use crate::data::copy::TileCopy;
use ferry_base::AccessMode;
use ferry_device::TileView;
use std::any::TypeId;
use std::sync::Arc;

/// The tiles of one task, in argument order. A `Vec`, not inline storage: moving a larger node
/// payload from insertion to the worker cost more instructions than the allocation it saves.
pub type TileArgs = Vec<TileArg>;

/// One tile of a task (CPU or GPU): the copy it uses and how.
pub struct TileArg {
    /// The copy the task reads or writes.
    pub copy: Arc<TileCopy>,
    /// Rows (row-major, `cols` elements per row).
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// How the task uses the tile.
    pub mode: AccessMode,
    /// The element type.
    pub elem: TypeId,
    /// The element type's name, for errors.
    pub elem_name: &'static str,
    /// Tile coordinates `(i, j)` in its collection.
    pub coords: (usize, usize),
}

impl TileArg {
    /// The view a body gets of this tile when its copy is at `ptr` (host buffer or device block).
    #[inline]
    pub fn view(&self, ptr: *mut u8) -> TileView {
        TileView {
            ptr,
            bytes: self.copy.bytes(),
            rows: self.rows,
            cols: self.cols,
            mode: self.mode,
            elem: self.elem,
            elem_name: self.elem_name,
            coords: self.coords,
        }
    }
}
