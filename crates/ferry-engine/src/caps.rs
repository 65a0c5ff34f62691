//! What the engine can do, in general and per peer.

use ferry_base::error::Rank;

/// How data moves between this rank and a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Route {
    /// Host memory to host memory through MPI (eager below the library's threshold,
    /// rendezvous above).
    HostMpi,
    /// Device memory of ranks of one node: a peer copy from or into the other's memory, mapped
    /// through CUDA IPC once per allocation.
    Ipc,
    /// Device memory handed to a CUDA-aware MPI.
    GpuDirect,
    /// Device memory staged through the pinned bounce buffers, in chunks.
    Staged,
    /// Host memory of ranks of one node in a single copy: the origin reads (get) or writes
    /// (put) the target's registration with `process_vm_readv` / `process_vm_writev` (Cross
    /// Memory Attach, `cma.rs`), under a lease on it, with no MPI message before the copy.
    Cma,
}

impl Route {
    /// Its name in reports and benchmark records.
    pub fn name(self) -> &'static str {
        match self {
            Route::HostMpi => "host-mpi",
            Route::Ipc => "ipc",
            Route::GpuDirect => "gpu-direct",
            Route::Staged => "staged",
            Route::Cma => "cma",
        }
    }
}

/// What this rank knows about a peer (PaRSEC's `capabilities`, per peer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCaps {
    /// The peer.
    pub rank: Rank,
    /// Whether it runs on this rank's node (same MPI processor name).
    pub same_node: bool,
    /// The routes data can take to it: host memory's (MPI, then the single copy when there is
    /// one), then device memory's.
    pub routes: Vec<Route>,
    /// Device memory moves to and from it by GPU-direct (both ranks' MPI takes device
    /// pointers), else staged.
    pub gpu_direct: bool,
    /// Device memory moves to and from it by peer copies through IPC (same node, both with
    /// devices and IPC allowed); takes precedence over GPU-direct and staging when both regions
    /// are device memory.
    pub ipc: bool,
    /// Host memory moves to and from it in a single copy through Cross Memory Attach (same
    /// node, `EngineConfig::cma` on both ranks, and this rank's probe of the peer's memory
    /// succeeded at start-up); takes precedence over MPI when both regions are host memory.
    pub cma: bool,
}

/// What the engine as a whole can do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineCaps {
    /// One-sided put and get (emulated over two-sided MPI with the engine's own protocol).
    pub one_sided: bool,
    /// Tagged two-sided send and receive of registered regions.
    pub two_sided: bool,
    /// Any thread may call any operation concurrently.
    pub multithreaded: bool,
    /// Non-contiguous layouts (MPI datatypes): not supported; regions are contiguous bytes.
    pub noncontiguous: bool,
    /// `MPIX_Query_cuda_support()`, when the library has it.
    pub cuda_aware_mpi: Option<bool>,
    /// Whether this rank hands device memory to MPI (`EngineConfig::gpu_direct` and the
    /// library's answer).
    pub gpu_direct: bool,
    /// Devices whose memory may be registered, and how they are driven (`"cuda"`,
    /// `"emulated"`; 0 and `"none"` without).
    pub devices: usize,
    /// See `devices`.
    pub device_kind: &'static str,
    /// The MPI library's version string.
    pub mpi_library: String,
    /// Largest active-message payload, bytes.
    pub am_max_payload: usize,
    /// One past the largest tag users may register for active messages.
    pub am_user_tags: u32,
    /// One past the largest tag of two-sided sends and receives.
    pub two_sided_tags: u32,
}
