//! # ferry-base
//!
//! The bottom of ferry's layered workspace: the vocabulary and helpers that every layer above
//! uses, and nothing that knows MPI, CUDA, tasks or graphs.
//!
//! | module | what |
//! |---|---|
//! | [`error`] | [`FerryError`], [`DeviceError`], [`Rank`], [`TaskError`] |
//! | [`access`] | [`AccessMode`]: how a task or a kernel uses a tile |
//! | [`faults`] | run-time fault injection (`FERRY_FAULTS`) |
//! | [`hash`] | splitmix64 mixing and byte hashing (graph hashes, deterministic jitter) |
//! | [`fifo_map`] | a map of FIFO queues (message matching) |
//! | [`poller`] | work a service thread polls for in every pass of its loop |
//! | [`region`] | [`region::MemRegion`]: memory a transfer reads or writes |
//! | [`shm`] | shared-memory segments between the processes of a node |
//! | [`ring`], [`byte_ring`], [`node_rings`] | message rings and payload rings between ranks of a node, in shared memory |
//! | [`affinity`], [`naps`] | thread placement (hwloc) and precise naps of polling threads |
//! | [`idle`] | whether idle threads spin or yield their cores (oversubscribed ranks) |
//! | [`traffic`] | bytes and transfers per [`traffic::TrafficPath`] a payload travels |
//! | [`trace_clock`] | the clock of ferry's per-rank trace files |
//! | [`join`] | a completion that fires once `n` parts have arrived |
//! | [`debug`] | process-wide debugging switches (`FERRY_CHECK_COHERENCE`) |
//!
//! The crates above it: `ferry-comm` (MPI), `ferry-device` (CUDA and emulated devices),
//! `ferry-memory` (data, tiers, the GPU manager), `ferry-transfer` (transfers between ranks) and
//! `ferry` (the task runtime); see `docs/architecture.md`.

#![warn(missing_docs)]

pub mod access;
pub mod affinity;
pub mod byte_ring;
pub mod cross_memory;
pub mod debug;
pub mod error;
pub mod faults;
pub mod fifo_map;
pub mod hash;
pub mod idle;
pub mod join;
pub mod naps;
pub mod node_rings;
pub mod poller;
pub mod region;
pub mod ring;
pub mod shm;
pub mod trace_clock;
pub mod traffic;

pub use access::AccessMode;
pub use error::{DeviceError, FerryError, GraphMismatch, Rank, Result, TaskError};
