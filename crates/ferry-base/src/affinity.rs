//! Thread placement (`FERRY_BIND`): the GPU manager on a core near its first GPU, the MPI
//! progress thread near the network interface, the CPU workers on the remaining cores of the
//! rank's CPU set — so that the two polling threads neither share a core with each other nor
//! with a worker, and each sits on the socket of the device it drives.
//!
//! Topology from hwloc through hwlocality (the hwloc2 crate panics on NUMA and PCI queries and
//! cannot see I/O devices). Threads are bound by their Linux thread id, after they have all
//! started; each records its id and role when it starts ([`note_thread`]). Placement never fails
//! a run: without a usable topology, or with a single core, threads stay unbound and the reason
//! is logged; with two cores the workers are spread and the polling threads stay unbound
//! ([`plan`]).

use hwlocality::cpu::binding::CpuBindingFlags;
use hwlocality::cpu::cpuset::CpuSet;
use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::OSDeviceType;
use hwlocality::topology::builder::TypeFilter;
use hwlocality::Topology;
use std::sync::Mutex;

/// What a thread does, for placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The MPI progress thread.
    Mpi,
    /// The GPU manager thread.
    Gpu,
    /// CPU worker `k`.
    Worker(usize),
}

/// Threads that have started, with their Linux thread ids (one runtime per process).
static THREADS: Mutex<Vec<(Role, i32)>> = Mutex::new(Vec::new());

/// Records the calling thread's role and id; called first thing by each runtime thread.
pub fn note_thread(role: Role) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let mut t = THREADS.lock().unwrap_or_else(|p| p.into_inner());
    t.retain(|(r, _)| *r != role);
    t.push((role, tid));
}

/// The cores chosen for each role.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placement {
    /// Core of the MPI progress thread.
    pub mpi: Option<usize>,
    /// Core of the GPU manager.
    pub gpu: Option<usize>,
    /// Cores of the workers, by worker index.
    pub workers: Vec<usize>,
}

/// Chooses cores from `allowed` (the rank's CPU set, in order): the GPU manager on the first
/// allowed core local to the GPU (else the last allowed core), the MPI thread on the first
/// allowed core local to the NIC that is not the GPU manager's (else the next free one), the
/// workers round-robin over the rest.
///
/// With two allowed cores there is no room to give the polling threads cores of their own:
/// they stay unbound, and only the workers are spread, one per core. Left to the OS, two
/// workers of a two-core rank sometimes end up on one core (a wake-up places one beside the
/// other while the inserting and MPI threads hold the second core, and the balancer, which
/// counts threads, sees two per core and leaves them): each step of a fine-grained graph then
/// waits for a `sched_yield` hand-over between them.
///
/// With one allowed core (a rank per core: the launcher bound it there, or [`share`] gave it
/// its share of an unbound node), the workers are bound to it and the other threads stay
/// unbound. Left to the OS, the workers of two such ranks sometimes share one core for a
/// whole run while the other runs their idle inserting and MPI threads (Task Bench's
/// `stencil_1d` on 2 ranks of a 2-core VM: 1.4 ms or 4 ms for the same 1,000 steps, by run).
/// `None` without cores.
pub fn plan(
    allowed: &[usize],
    gpu_local: &[usize],
    nic_local: &[usize],
    workers: usize,
    gpu: bool,
) -> Option<Placement> {
    match allowed.len() {
        0 => return None,
        1 => {
            return Some(Placement {
                mpi: None,
                gpu: None,
                workers: vec![allowed[0]; workers],
            })
        }
        2 => {
            return Some(Placement {
                mpi: None,
                gpu: None,
                workers: (0..workers).map(|k| allowed[k % 2]).collect(),
            })
        }
        _ => {}
    }
    let gpu_core = gpu.then(|| {
        allowed
            .iter()
            .copied()
            .find(|c| gpu_local.contains(c))
            .unwrap_or(allowed[allowed.len() - 1])
    });
    let free = |c: &usize| Some(*c) != gpu_core;
    let mpi = allowed
        .iter()
        .copied()
        .filter(free)
        .find(|c| nic_local.contains(c))
        .or_else(|| allowed.iter().copied().find(free))?;
    let rest: Vec<usize> = allowed
        .iter()
        .copied()
        .filter(|c| *c != mpi && Some(*c) != gpu_core)
        .collect();
    if rest.is_empty() {
        return None;
    }
    Some(Placement {
        mpi: Some(mpi),
        gpu: gpu_core,
        workers: (0..workers).map(|k| rest[k % rest.len()]).collect(),
    })
}

fn cores(set: &CpuSet) -> Vec<usize> {
    set.iter_set().map(usize::from).collect()
}

/// The cores of `allowed` this rank may use: all of them when the launcher bound the rank to
/// a subset of the machine, else (every rank of the node sees the whole machine) the
/// `local_rank`-th of `local_size` equal contiguous shares, so that ranks of one node do not
/// bind their threads to the same cores. `None` when such unbound ranks outnumber the cores:
/// every rank would bind its threads to the same first cores.
pub fn share(allowed: &[usize], machine: usize, (local_rank, local_size): (usize, usize)) -> Option<Vec<usize>> {
    if local_size <= 1 || allowed.len() < machine {
        return Some(allowed.to_vec());
    }
    if allowed.len() < local_size {
        return None;
    }
    let n = allowed.len() / local_size;
    Some(allowed[local_rank * n..(local_rank + 1) * n].to_vec())
}

/// Binds the runtime's threads (`auto`), returning one line per decision for the start-up log
/// and `ferry-info`. `gpu_pci`: the PCI address (domain, bus, device) of the first local GPU;
/// `local`: this rank's index among its node's ranks, and their number.
pub fn bind(workers: usize, gpu_pci: Option<(u32, u8, u8)>, has_gpu: bool, local: (usize, usize)) -> Vec<String> {
    let topo = match Topology::builder()
        .with_io_type_filter(TypeFilter::KeepImportant)
        .map_err(|e| e.to_string())
        .and_then(|b| b.build().map_err(|e| e.to_string()))
    {
        Ok(t) => t,
        Err(e) => return vec![format!("threads not bound: no topology ({e})")],
    };
    let allowed = match topo.cpu_binding(CpuBindingFlags::PROCESS) {
        Ok(s) => cores(&s),
        Err(_) => cores(&topo.allowed_cpuset()),
    };
    let Some(allowed) = share(&allowed, cores(&topo.allowed_cpuset()).len(), local) else {
        return vec![format!(
            "threads not bound: {} ranks share this node's {} core(s)",
            local.1,
            allowed.len()
        )];
    };
    let gpu_local: Vec<usize> = gpu_pci
        .and_then(|(dom, bus, dev)| topo.pci_device_by_bus_id(dom as _, bus, dev, 0))
        .and_then(|o| o.first_non_io_ancestor())
        .and_then(|o| o.cpuset())
        .map(|s| cores(&s))
        .unwrap_or_default();
    let nic_local: Vec<usize> = topo
        .os_devices()
        .find(|o| {
            matches!(
                o.attributes(),
                Some(ObjectAttributes::OSDevice(a)) if matches!(a.device_type(), OSDeviceType::OpenFabrics | OSDeviceType::Network)
            ) && o.name().is_some_and(|n| !n.to_string_lossy().starts_with("lo"))
        })
        .and_then(|o| o.first_non_io_ancestor())
        .and_then(|o| o.cpuset())
        .map(|s| cores(&s))
        .unwrap_or_default();
    let Some(p) = plan(&allowed, &gpu_local, &nic_local, workers, has_gpu) else {
        return vec!["threads not bound: no core allowed".to_string()];
    };
    let threads = THREADS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut lines = Vec::new();
    for (role, tid) in threads {
        let core = match role {
            Role::Mpi => p.mpi,
            Role::Gpu => p.gpu,
            Role::Worker(k) => p.workers.get(k).copied(),
        };
        let Some(core) = core else { continue };
        let set = CpuSet::from_range(core..=core);
        let r = topo.bind_process_cpu(tid as u32, &set, CpuBindingFlags::THREAD);
        let near = match role {
            Role::Gpu if gpu_local.contains(&core) => " (local to the GPU)",
            Role::Mpi if nic_local.contains(&core) => " (local to the NIC)",
            _ => "",
        };
        lines.push(match r {
            Ok(()) => format!("{role:?} thread on core {core}{near}"),
            Err(e) => format!("{role:?} thread not bound to core {core}: {e}"),
        });
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_threads_get_cores_of_their_own_near_their_devices() {
        let allowed: Vec<usize> = (0..8).collect();
        // GPU local to cores 4..8, NIC to 0..4.
        let p = plan(&allowed, &[4, 5, 6, 7], &[0, 1, 2, 3], 6, true).unwrap();
        assert_eq!((p.gpu, p.mpi), (Some(4), Some(0)));
        assert_eq!(p.workers, vec![1, 2, 3, 5, 6, 7]);
        // NIC and GPU on the same cores: still distinct cores.
        let p = plan(&allowed, &[0, 1], &[0, 1], 2, true).unwrap();
        assert_eq!((p.gpu, p.mpi), (Some(0), Some(1)));
        assert!(!p.workers.contains(&0) && !p.workers.contains(&1));
        // No GPU, no locality known: MPI on the first core, workers on the rest.
        let p = plan(&allowed[..3], &[], &[], 4, false).unwrap();
        assert_eq!((p.gpu, p.mpi, p.workers), (None, Some(0), vec![1, 2, 1, 2]));
        // Two cores: the workers spread, the polling threads unbound; one core: the workers
        // there, the polling threads unbound.
        let p = plan(&[2, 5], &[2], &[5], 3, true).unwrap();
        assert_eq!((p.gpu, p.mpi, p.workers), (None, None, vec![2, 5, 2]));
        let one = Placement {
            mpi: None,
            gpu: None,
            workers: vec![3, 3],
        };
        assert_eq!(plan(&[3], &[], &[], 2, true), Some(one));
        assert_eq!(plan(&[], &[], &[], 2, true), None);
    }

    #[test]
    fn ranks_of_a_node_share_the_machine_when_the_launcher_did_not_bind_them() {
        let all: Vec<usize> = (0..32).collect();
        assert_eq!(share(&all, 32, (1, 2)), Some((16..32).collect::<Vec<_>>()));
        assert_eq!(share(&all, 32, (0, 1)), Some(all.clone()));
        // Bound by mpirun to a subset: keep it.
        assert_eq!(share(&all[4..8], 32, (1, 2)), Some(vec![4, 5, 6, 7]));
        // More unbound ranks than cores: any binding would stack the ranks' threads.
        assert_eq!(share(&all[..4], 4, (5, 8)), None);
        assert_eq!(share(&all[..4], 4, (3, 4)), Some(vec![3]));
    }
}
