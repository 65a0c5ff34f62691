//! Collections, distributions, tiles, versions and copies.
//!
//! This layer knows tiles and ranks; it knows neither tasks nor MPI.

pub(crate) mod buffer;
pub(crate) mod collection;
pub(crate) mod copy;
pub(crate) mod directory;
pub(crate) mod distribution;
pub(crate) mod host_pool;
pub(crate) mod rankset;

pub use collection::{Access, Collection, MAX_TILES, MAX_TILE_BYTES};
pub use distribution::{Distribution, ProcessGrid};
pub use ferry_base::AccessMode;
