//! Task classes, sequential insertion, dependency inference and placement.
//!
//! This layer knows tiles, ranks and locations; it hands memory regions to the communication
//! layer and jobs to the workers, and knows neither MPI nor CUDA.

pub(crate) mod cpu_graph;
pub(crate) mod dispatch;
pub(crate) mod epoch;
pub(crate) mod inserter;
pub(crate) mod node;
mod recent;
pub(crate) mod replay;
pub(crate) mod task;
pub(crate) mod tracker;
pub(crate) mod window;

pub use replay::{TraceId, TraceMode};
pub use task::{CpuBody, CudaBody, RawTile, Task, TaskClass, TaskContext};
