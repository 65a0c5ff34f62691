//! What an inserted graph needs in memory on one rank, per tier.

use std::fmt;

/// Memory a graph needs on one rank, per tier: [`crate::Runtime::estimate_memory`].
///
/// Counted from the inserted sequence as if it ran in order: the working set is the peak of the
/// bytes of tile copies this rank holds (its own tiles, versions received from other ranks,
/// outputs of its tasks; a copy leaves the count when a newer version supersedes it). Tasks that
/// run concurrently may keep a superseded copy a little longer, so treat the figures as a
/// close estimate, not a bound. All sizes in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Peak bytes of tile copies held on this rank.
    pub working_set_bytes: u64,
    /// The largest task's tiles together.
    pub largest_task_bytes: u64,
    /// The largest GPU task's tiles together (0: no GPU task runs on a device here): each must
    /// fit on one device.
    pub largest_gpu_task_bytes: u64,
    /// Pool bytes of each local device.
    pub device_capacity_bytes: Vec<u64>,
    /// The host budget in force (`None`: unlimited).
    pub host_limit_bytes: Option<u64>,
    /// The disk tier's budget (`None`: no disk tier).
    pub disk_budget_bytes: Option<u64>,
    /// Peak the devices will hold: the working set, up to their capacity (0 without GPU tasks).
    pub device_bytes: u64,
    /// Peak host memory for what the devices do not hold, up to the host budget.
    pub host_bytes: u64,
    /// What neither holds: it must spill to disk.
    pub disk_bytes: u64,
}

impl MemoryEstimate {
    pub(crate) fn new(
        fp: crate::graph::inserter::Footprint,
        device_capacity_bytes: Vec<u64>,
        host_limit_bytes: Option<u64>,
        disk_budget_bytes: Option<u64>,
    ) -> MemoryEstimate {
        let ws = fp.peak;
        let devices: u64 = device_capacity_bytes.iter().sum();
        let device_bytes = if fp.largest_gpu_task > 0 { ws.min(devices) } else { 0 };
        let rest = ws - device_bytes;
        let host_bytes = host_limit_bytes.map_or(rest, |l| rest.min(l));
        MemoryEstimate {
            working_set_bytes: ws,
            largest_task_bytes: fp.largest_task,
            largest_gpu_task_bytes: fp.largest_gpu_task,
            device_capacity_bytes,
            host_limit_bytes,
            disk_budget_bytes,
            device_bytes,
            host_bytes,
            disk_bytes: rest - host_bytes,
        }
    }

    /// What will stop the graph from running here, in words (empty: it fits): a GPU task larger
    /// than every device, data to spill without a disk tier, or more than its budget.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let largest_device = self.device_capacity_bytes.iter().copied().max().unwrap_or(0);
        if self.largest_gpu_task_bytes > largest_device {
            p.push(format!(
                "a GPU task needs {} bytes at once, more than the largest device pool ({largest_device} bytes)",
                self.largest_gpu_task_bytes
            ));
        }
        match self.disk_budget_bytes {
            None if self.disk_bytes > 0 => p.push(format!(
                "{} bytes fit neither on the devices nor in the host budget, and there is no disk tier (FERRY_SPILL_DIR)",
                self.disk_bytes
            )),
            Some(b) if self.disk_bytes > b => p.push(format!(
                "{} bytes must spill to disk, more than its budget of {b} bytes (FERRY_SPILL_BYTES)",
                self.disk_bytes
            )),
            _ => {}
        }
        p
    }
}

impl fmt::Display for MemoryEstimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "working set {:.1} MiB (largest task {:.1} MiB): device {:.1} MiB, host {:.1} MiB, disk {:.1} MiB",
            mib(self.working_set_bytes),
            mib(self.largest_task_bytes),
            mib(self.device_bytes),
            mib(self.host_bytes),
            mib(self.disk_bytes)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::inserter::Footprint;

    #[test]
    fn tiers_fill_in_order_and_problems_are_named() {
        let fp = Footprint {
            live: 0,
            peak: 100,
            largest_task: 30,
            largest_gpu_task: 30,
        };
        let e = MemoryEstimate::new(fp, vec![40], Some(25), Some(50));
        assert_eq!((e.device_bytes, e.host_bytes, e.disk_bytes), (40, 25, 35));
        assert!(e.problems().is_empty());
        let e = MemoryEstimate::new(fp, vec![20], Some(25), None);
        let p = e.problems();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p[0].contains("GPU task needs 30") && p[1].contains("no disk tier"),
            "{p:?}"
        );
    }
}
