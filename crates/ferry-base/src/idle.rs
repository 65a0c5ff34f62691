//! How a rank's threads wait when they have nothing to do: spin, or yield their core.
//!
//! ferry's polling threads (CPU workers, the MPI progress thread, the GPU manager) spin for a
//! few microseconds before they sleep, because a fine-grained graph hands them their next piece
//! of work within microseconds and a sleeper takes a system call to wake. That is right when each
//! thread has a core; it is ruinous when a rank's threads share fewer cores than there are of
//! them, as under `mpirun -np <cores>` (a rank per core, one worker each): an idle worker that
//! spins holds the one core that the progress thread needs to receive the message the worker is
//! waiting for. Open MPI has the same switch for its own busy-waiting, `mpi_yield_when_idle`,
//! which it turns on when it oversubscribes a node; ferry decides from the rank's CPU set and the
//! ranks of its node ([`oversubscribed`]) and `FERRY_YIELD_WHEN_IDLE`.

/// Cores one rank of a node can count on: its CPU set (`cpuset`, what
/// `sched_getaffinity` allows), or its share of the node's online CPUs (`online ÷ local_ranks`)
/// when that is smaller — ranks that were not bound share one CPU set, and each of them sees
/// all of it.
///
/// `local_ranks` of 0 counts as 1. The result may be below 1 (more ranks than CPUs).
pub fn cores_per_rank(cpuset: usize, online: usize, local_ranks: usize) -> f64 {
    let share = online.max(1) as f64 / local_ranks.max(1) as f64;
    (cpuset.max(1) as f64).min(share)
}

/// Whether a rank's threads must yield their cores when idle instead of spinning: its
/// `workers` alone outnumber its cores ([`cores_per_rank`]), or it has fewer cores than one
/// worker and its `helpers` (the threads besides the workers that the graph's critical path
/// runs through: the inserting thread, the MPI progress thread, the GPU manager), each on a core
/// of its own.
///
/// The second test, rather than all threads against the cores, is what separates a rank per
/// core (`mpirun -np <cores>`: one core for a worker, the inserting thread and the progress
/// thread) from a rank whose default workers fill its many cores beside a GPU manager: there the
/// workers are mostly idle, spinning costs nothing, and a parked worker's wake-up would slow the
/// hand-off of every GPU task.
pub fn oversubscribed(workers: usize, helpers: usize, cpuset: usize, online: usize, local_ranks: usize) -> bool {
    let cores = cores_per_rank(cpuset, online, local_ranks);
    workers as f64 > cores || cores < (1 + helpers) as f64
}

/// CPUs online on this machine (`sysconf(_SC_NPROCESSORS_ONLN)`; 1 if it does not say).
pub fn online_cpus() -> usize {
    // SAFETY: sysconf reads a system value and touches no memory of ours.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_per_core_is_oversubscribed() {
        // mpirun -np 2 on 2 cores, bound: one core each for a worker, the inserting thread and
        // the progress thread.
        assert!(oversubscribed(1, 2, 1, 2, 2));
        // Unbound: both ranks see both cores, and share them.
        assert!(oversubscribed(1, 2, 2, 2, 2));
        // Four ranks on two cores: half a core per rank.
        assert!(oversubscribed(1, 2, 2, 2, 4));
        // More workers than cores.
        assert!(oversubscribed(4, 1, 2, 2, 1));
    }

    #[test]
    fn a_rank_with_its_cores_is_not() {
        // One rank, two workers, two cores, the inserting thread, no peers to progress.
        assert!(!oversubscribed(2, 1, 2, 2, 1));
        // One rank of 16 cores with 16 workers, the inserting thread and a GPU manager.
        assert!(!oversubscribed(16, 2, 16, 16, 1));
        // Two ranks sharing 16 cores, 8 workers each, with peers and a GPU each.
        assert!(!oversubscribed(8, 3, 16, 16, 2));
        // Eight ranks of 16 cores each on a 128-core node.
        assert!(!oversubscribed(16, 2, 16, 128, 8));
        assert_eq!(cores_per_rank(16, 128, 8), 16.0);
        assert_eq!(cores_per_rank(0, 0, 0), 1.0);
    }

    #[test]
    fn online_cpus_is_at_least_the_cpu_set() {
        let set = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(online_cpus() >= set);
    }
}
