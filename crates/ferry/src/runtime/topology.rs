//! What a rank found at start-up: node, CPUs, devices and their links, the MPI library, the
//! route to every other rank. `ferry-info` prints it.

use ferry_base::error::Rank;
use std::fmt;

/// The machine as one rank sees it ([`crate::Runtime::topology`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// This rank, the rank count, and this rank's place among its node's ranks.
    pub rank: Rank,
    /// Ranks in the job.
    pub size: usize,
    /// This rank's index among the ranks of its node, and their number.
    pub local: (usize, usize),
    /// The node's name.
    pub host: String,
    /// CPUs this rank may run on (its affinity mask), and NUMA nodes of the machine (from
    /// `/sys/devices/system/node/online`; 1 where the system does not say).
    pub cpus: usize,
    /// See `cpus`.
    pub numa_nodes: usize,
    /// CPU workers of this rank.
    pub workers: usize,
    /// Whether this rank's idle threads yield their cores instead of spinning
    /// (`FERRY_YIELD_WHEN_IDLE`; under `auto`, when its threads outnumber its cores).
    pub yield_when_idle: bool,
    /// Whether idle workers drive MPI progress, the progress thread only a backstop
    /// (`FERRY_MPI_PROGRESS`; under `auto`, when idle threads yield and the rank has peers).
    pub shared_progress: bool,
    /// Whether the inserting thread runs ready tasks and progress passes between insertions
    /// (`FERRY_INSERTER_HELPS`; under `auto`, when idle workers give way to it: a rank per core
    /// without devices).
    pub inserter_helps: bool,
    /// The MPI library's version line.
    pub mpi_library: String,
    /// `MPIX_Query_cuda_support()`, when the library has it.
    pub mpi_cuda_support: Option<bool>,
    /// Whether this rank hands device memory to MPI (`FERRY_GPU_DIRECT`).
    pub gpu_direct: bool,
    /// Local devices, described.
    pub devices: Vec<String>,
    /// Per (a, b): the rank of the peer link from device a to b (lower is faster; CUDA's
    /// performance rank), `None` without one.
    pub links: Vec<Vec<Option<u32>>>,
    /// Where the runtime's threads were placed (`FERRY_BIND`), one line each.
    pub binding: Vec<String>,
    /// Per other rank: its node and the payload route to it.
    pub routes: Vec<(Rank, String, String)>,
}

/// NUMA nodes listed in `/sys/devices/system/node/online` (`0-3`, `0,2`), or 1.
pub(crate) fn numa_nodes() -> usize {
    let Ok(s) = std::fs::read_to_string("/sys/devices/system/node/online") else {
        return 1;
    };
    let n: usize = s
        .trim()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap_or(0) + 1 - a.parse::<usize>().unwrap_or(0),
            None => 1,
        })
        .sum();
    n.max(1)
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "rank {} of {} on {} (local rank {} of {}), {} CPUs available, {} NUMA nodes, {} workers",
            self.rank, self.size, self.host, self.local.0, self.local.1, self.cpus, self.numa_nodes, self.workers
        )?;
        writeln!(
            f,
            "idle threads: {}",
            if self.yield_when_idle {
                "yield their cores (more threads than cores)"
            } else {
                "spin, then sleep"
            }
        )?;
        writeln!(
            f,
            "MPI progress: {}",
            if self.shared_progress {
                "driven by idle workers, the progress thread a backstop"
            } else {
                "the progress thread"
            }
        )?;
        writeln!(
            f,
            "inserting thread: {}",
            if self.inserter_helps {
                "runs ready tasks between insertions"
            } else {
                "inserts only"
            }
        )?;
        let cuda = match self.mpi_cuda_support {
            Some(true) => "takes device pointers (MPIX_Query_cuda_support = 1)",
            Some(false) => "does not say it takes device pointers (MPIX_Query_cuda_support = 0)",
            None => "has no MPIX_Query_cuda_support",
        };
        writeln!(f, "MPI: {}", self.mpi_library.lines().next().unwrap_or(""))?;
        writeln!(
            f,
            "  {cuda}; GPU-direct {}",
            if self.gpu_direct { "in use" } else { "not used" }
        )?;
        if self.devices.is_empty() {
            writeln!(f, "devices: none")?;
        }
        for (d, name) in self.devices.iter().enumerate() {
            writeln!(f, "device {d}: {name}")?;
        }
        if self.devices.len() > 1 {
            write!(f, "peer links (rank, lower is faster; - none):\n     ")?;
            for b in 0..self.devices.len() {
                write!(f, " {b:>4}")?;
            }
            writeln!(f)?;
            for (a, row) in self.links.iter().enumerate() {
                write!(f, "  {a:>3}")?;
                for (b, l) in row.iter().enumerate() {
                    match l {
                        _ if a == b => write!(f, "    ·")?,
                        Some(r) => write!(f, " {r:>4}")?,
                        None => write!(f, "    -")?,
                    }
                }
                writeln!(f)?;
            }
        }
        for line in &self.binding {
            writeln!(f, "placement: {line}")?;
        }
        for (peer, host, route) in &self.routes {
            writeln!(f, "route to rank {peer} ({host}): {route}")?;
        }
        Ok(())
    }
}
