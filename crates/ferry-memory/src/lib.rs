//! # ferry-memory
//!
//! The data and memory layer: where each tile's copies live and how they move between the
//! tiers of one rank.
//!
//! - [`data`]: tile copies and their validity per location (host, each device, disk), the
//!   directory of versions, collections and their distributions, the registered host pool.
//! - [`tier`]: the host-memory budget with LRU eviction, the disk tier that host copies spill
//!   to, and the I/O thread that moves them.
//! - [`manager`]: the GPU manager thread, which owns every stream, event and pool of the
//!   rank's devices and walks GPU work through alloc → stage-in → exec → stage-out → finalize,
//!   and serves the transfer layer's device copies.
//! - [`counters`]: this layer's statistics.
//!
//! This layer knows tiles, copies, devices and memory, and no task graph: a [`manager::GpuTask`]
//! is a [`ferry_device::Kernel`] over tile copies with completion callbacks, which the task
//! layer (`ferry`) fills in; it knows no MPI either.

#![warn(missing_docs)]

pub mod counters;
pub mod data;
pub mod manager;
pub mod tier;
