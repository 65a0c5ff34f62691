//! Task Bench's kernels (`-kernel`): what a task computes, and the FLOPs and bytes it counts.

use super::random;

/// A kernel type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelType {
    /// Nothing.
    Empty,
    /// An integer recurrence, `iter` steps.
    BusyWait,
    /// `iter` copies of scratch-buffer chunks (half onto half).
    MemoryBound,
    /// 64 lanes of `a = a·a + a`, `iter` times.
    ComputeBound,
    /// 32 lanes of `c += a·b`, `iter` times.
    ComputeBound2,
    /// `compute_bound` with a per-task iteration count varied by `imbalance`.
    LoadImbalance,
}

impl KernelType {
    /// Every kernel with its `-kernel` name.
    pub const ALL: [(KernelType, &'static str); 6] = [
        (KernelType::Empty, "empty"),
        (KernelType::BusyWait, "busy_wait"),
        (KernelType::MemoryBound, "memory_bound"),
        (KernelType::ComputeBound, "compute_bound"),
        (KernelType::ComputeBound2, "compute_bound2"),
        (KernelType::LoadImbalance, "load_imbalance"),
    ];

    /// The `-kernel` name.
    pub fn name(self) -> &'static str {
        KernelType::ALL.iter().find(|(k, _)| *k == self).map_or("?", |(_, n)| n)
    }

    /// Parses a `-kernel` name.
    pub fn parse(s: &str) -> Option<KernelType> {
        KernelType::ALL.iter().find(|(_, n)| *n == s).map(|(k, _)| *k)
    }
}

/// A kernel with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Kernel {
    pub kind: KernelType,
    pub iterations: i64,
    pub samples: i64,
    pub imbalance: f64,
}

/// The kernels' lanes, cache-line aligned: the lanes go through memory once per iteration (so
/// the optimizer cannot fold the loop), and an unaligned array made the same kernel 35% slower on
/// a worker thread's stack than on the main thread's.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes([f64; 64]);

/// Keeps a value alive so the optimizer cannot drop the computation.
#[inline(never)]
fn sink<T>(x: T) -> T {
    std::hint::black_box(x)
}

impl Kernel {
    /// The iteration count of task `(t, p)` of graph `graph` (varies only for `load_imbalance`).
    pub fn iterations_for(&self, graph: i64, t: i64, p: i64) -> i64 {
        match self.kind {
            KernelType::LoadImbalance => {
                let u = random::uniform(&[graph, t, p]);
                ((1.0 + (u - 0.5) * self.imbalance) * self.iterations as f64).round() as i64
            }
            _ => self.iterations,
        }
    }

    /// Runs the kernel for task `(t, p)`; `scratch` is the point's scratch buffer.
    pub fn execute(&self, graph: i64, t: i64, p: i64, scratch: &mut [u8]) {
        let iters = self.iterations_for(graph, t, p);
        match self.kind {
            KernelType::Empty => {}
            KernelType::BusyWait => {
                let mut acc: u64 = 113;
                for _ in 0..iters {
                    acc = acc * 139 % 2147483647;
                }
                sink(acc);
            }
            KernelType::MemoryBound => memory_bound(scratch, self.samples.max(1) as usize, iters as usize, t),
            KernelType::ComputeBound | KernelType::LoadImbalance => {
                let mut a = Lanes([0f64; 64]);
                for (k, x) in a.0.iter_mut().enumerate() {
                    *x = 1.0 + (k % 4) as f64;
                }
                for _ in 0..iters {
                    for x in a.0.iter_mut() {
                        *x = *x * *x + *x;
                    }
                    a = sink(a);
                }
                sink(a.0.iter().product::<f64>());
            }
            KernelType::ComputeBound2 => {
                let (a, b) = (1.2345f64, 1.010101f64);
                let mut c = Lanes([0f64; 64]);
                for _ in 0..iters {
                    for x in c.0[..32].iter_mut() {
                        *x += a * b;
                    }
                    c = sink(c);
                }
                sink(c.0[..32].iter().sum::<f64>());
            }
        }
    }

    /// FLOPs task `(t, p)` counts.
    pub fn flops(&self, graph: i64, t: i64, p: i64) -> i64 {
        let it = self.iterations_for(graph, t, p);
        match self.kind {
            KernelType::ComputeBound | KernelType::LoadImbalance => 2 * 64 * it + 64,
            KernelType::ComputeBound2 => 2 * 32 * it,
            _ => 0,
        }
    }

    /// Bytes task `(t, p)` counts (memory_bound: the chunks it copies).
    pub fn bytes(&self, scratch_bytes: i64) -> i128 {
        match self.kind {
            KernelType::MemoryBound => {
                i128::from(scratch_bytes) * i128::from(self.iterations) / i128::from(self.samples.max(1))
            }
            _ => 0,
        }
    }
}

/// `iter` chunk copies over consecutive chunks of `scratch` (cut in `samples` chunks), starting
/// where timestep `t` left off; each copies the first half of its chunk onto the second.
fn memory_bound(scratch: &mut [u8], samples: usize, iter: usize, t: i64) {
    if scratch.is_empty() || iter == 0 {
        return;
    }
    let chunk = scratch.len() / samples;
    if chunk < 2 {
        return;
    }
    let start = (t as usize).wrapping_mul(iter) % samples;
    for k in 0..iter {
        let c = (start + k) % samples;
        let region = &mut scratch[c * chunk..(c + 1) * chunk];
        let half = chunk / 2;
        let (a, b) = region.split_at_mut(half);
        b[..half].copy_from_slice(&a[..half]);
    }
    sink(scratch[0]);
}
