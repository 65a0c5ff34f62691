//! # ferry
//!
//! The communication and data-movement layer of a distributed task runtime: an MPI plugin that
//! task-based HPC frameworks link, and that `mpirun`-launched task graphs run on.
//!
//! Every rank inserts the same sequence of tasks on tiles of distributed collections
//! (sequential task flow). Each rank infers from that sequence which tasks it runs
//! (owner-computes), which tiles it sends to whom and which it receives; transfers need no
//! request/grant handshake. A dedicated progress thread makes every MPI call; CPU workers run
//! task bodies with work stealing.
//!
//! ```no_run
//! use ferry::{Distribution, Runtime, TaskClass};
//! # fn main() -> ferry::Result<()> {
//! let rt = Runtime::builder().from_env().build()?;
//! let grid = ferry::ProcessGrid::squarest(rt.size());
//! let a = rt.tiled_matrix::<f64>("a", 1024, 1024, 256, Distribution::BlockCyclic2d(grid))?;
//! let scale = TaskClass::new("scale", |ctx| {
//!     for x in ctx.tile_mut::<f64>(0)? { *x *= 2.0; }
//!     Ok(())
//! });
//! for i in 0..a.tile_rows() {
//!     for j in 0..a.tile_cols() {
//!         rt.insert(&scale, &[a.rw(i, j)])?;
//!     }
//! }
//! rt.wait()?;
//! # Ok(()) }
//! ```
//!
//! See `docs/architecture.md` for the design as built and `docs/configuration.md` for every knob.

#![warn(missing_docs)]

mod checkpoint;
pub mod config;
mod graph;
mod runtime;
mod sched;
pub mod stats;

/// Fault injection (`FERRY_FAULTS`), from the base layer.
pub use ferry_base::faults;

/// The decoders of untrusted bytes, for the fuzz targets (`fuzz/`) only; not part of the API.
/// Each returns whether the bytes were accepted, and must never panic.
#[doc(hidden)]
pub mod __fuzz {
    /// A transfer descriptor (48 bytes from another process).
    pub fn transfer_descriptor(bytes: &[u8]) -> bool {
        ferry_transfer::wire::Desc::decode(bytes).is_ok()
    }

    /// A checkpoint manifest file.
    pub fn checkpoint_manifest(bytes: &[u8]) -> bool {
        crate::checkpoint::fuzz_manifest(bytes)
    }

    /// A checkpoint rank file (or `checkpoint_into` bytes): preamble, footer, every tile's
    /// checksum.
    pub fn checkpoint_rank_file(bytes: &[u8]) -> bool {
        crate::checkpoint::fuzz_rank_file(bytes)
    }

    /// Valid inputs to start the fuzzers from: `(name, bytes)` per target (`wire`, `checkpoint`;
    /// checkpoint inputs carry the fuzz target's selector byte first).
    pub fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
        use ferry_transfer::wire::Desc;
        let mut v = vec![
            (
                "wire",
                "pool".into(),
                Desc::Pool {
                    dev: 1,
                    offset: 4096,
                    len: 65536,
                    after: None,
                    ack: None,
                }
                .encode()
                .to_vec(),
            ),
            (
                "wire",
                "pool-after".into(),
                Desc::Pool {
                    dev: 0,
                    offset: 1 << 20,
                    len: 1 << 20,
                    after: Some((2, 17)),
                    ack: Some((5, 3)),
                }
                .encode()
                .to_vec(),
            ),
            ("wire", "inline".into(), Desc::Inline { len: 8 }.encode().to_vec()),
        ];
        for (name, bytes) in crate::checkpoint::fuzz_seeds() {
            v.push(("checkpoint", name, bytes));
        }
        v
    }
}

pub use checkpoint::{CheckpointReport, CollectionRef};
pub use config::{Config, Layers};
pub use ferry_base::error::{FerryError, GraphMismatch, Rank, Result, TaskError};
pub use ferry_device::{CudaTaskContext, DeviceError, DeviceSpec};
pub use ferry_memory::data::{Access, AccessMode, Collection, Distribution, ProcessGrid, MAX_TILES, MAX_TILE_BYTES};
pub use ferry_transfer::{DeviceAcks, GpuDirect, TransferPath};
pub use graph::{CpuBody, CudaBody, RawTile, Task, TaskClass, TaskContext, TraceId, TraceMode};
pub use runtime::{MemoryEstimate, Runtime, RuntimeBuilder, Topology};
pub use stats::{DeviceStats, ManagerPhases, StatsSnapshot, TierStats, TrafficPath};

/// cudarc, re-exported so CUDA task bodies use the same version as ferry.
pub use ferry_device::cudarc;
