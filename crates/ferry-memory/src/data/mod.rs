//! Collections, distributions, tiles, versions and copies.
//!
//! This layer knows tiles and ranks; it knows neither tasks nor MPI.

pub mod budget;
pub mod buffer;
pub mod collection;
pub mod copy;
pub mod directory;
pub mod distribution;
pub mod host_pool;
pub mod rankset;
pub mod tile_arg;

pub use collection::{Access, Collection, MAX_TILES, MAX_TILE_BYTES};
pub use distribution::{Distribution, ProcessGrid};
pub use ferry_base::AccessMode;
