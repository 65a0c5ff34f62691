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
                sink(compute_bound(iters));
            }
            KernelType::ComputeBound2 => {
                sink(compute_bound2(iters));
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

/// `memory_bound`: `iter` sample copies over the point's scratch buffer cut in `samples`
/// samples, starting at sample `(t · iter) mod samples`, as Task Bench's
/// `execute_kernel_memory` (`core/core_kernel.cc`): consecutive samples are copied as one run,
/// the first half of the run onto its second half (to the end of the buffer, then whole
/// buffers, then the rest), so a task copies `iter · sample_bytes / 2` bytes in at most
/// `2 + iter / samples` copies.
fn memory_bound(scratch: &mut [u8], samples: usize, iter: usize, t: i64) {
    let sample_bytes = scratch.len() / samples.max(1);
    if sample_bytes == 0 || iter == 0 {
        return;
    }
    let copy = |scratch: &mut [u8], first: usize, n: usize| {
        let run = &mut scratch[first * sample_bytes..(first + n) * sample_bytes];
        let half = run.len() / 2;
        run.copy_within(0..half, half);
    };
    let index = |done: usize| ((t as i128 * iter as i128 + done as i128).rem_euclid(samples as i128)) as usize;
    let first = index(0);
    let head = iter.min(samples - first);
    copy(scratch, first, head);
    let mut done = head;
    while done + samples <= iter {
        copy(scratch, index(done), samples);
        done += samples;
    }
    if done < iter {
        copy(scratch, index(done), iter - done);
    }
    sink(scratch[0]);
}

/// `compute_bound`: 64 lanes of `a = a·a + a`, `iter` times, as Task Bench's
/// `execute_kernel_compute` (`core/core_kernel.cc`): sixteen 4-lane registers and a fused
/// multiply-add each where the CPU has AVX2 and FMA (checked at run time, once per process by
/// the standard library's cache), else 64 scalar lanes with a multiply and an add. Returns the
/// product of the lanes, which the caller keeps alive; the lanes stay in registers (the loop is
/// not folded: each iteration depends on the last, and floating-point arithmetic is not
/// reassociated).
pub fn compute_bound(iter: i64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has both features the function is compiled for.
        return unsafe { compute_bound_fma(iter) };
    }
    // The vector path's lanes in memory order (`_mm256_set_pd` lists the highest lane first).
    let mut a = [0f64; 64];
    for (k, x) in a.iter_mut().enumerate() {
        *x = 4.0 - (k % 4) as f64;
    }
    for _ in 0..iter {
        for x in a.iter_mut() {
            *x = *x * *x + *x;
        }
    }
    a.iter().product()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn compute_bound_fma(iter: i64) -> f64 {
    use std::arch::x86_64::{__m256d, _mm256_fmadd_pd, _mm256_set_pd};
    let mut a: [__m256d; 16] = [_mm256_set_pd(1.0, 2.0, 3.0, 4.0); 16];
    for _ in 0..iter {
        for x in a.iter_mut() {
            *x = _mm256_fmadd_pd(*x, *x, *x);
        }
    }
    // SAFETY: sixteen 4-lane f64 vectors are 64 f64, same size, no invalid bit patterns.
    let lanes: [f64; 64] = unsafe { std::mem::transmute(a) };
    lanes.iter().product()
}

/// `compute_bound2`: 32 lanes of `c += a·b`, `iter` times, as Task Bench's
/// `execute_kernel_compute2`: eight 4-lane registers where the CPU has AVX2 (the reference is
/// built with `-mavx2 -mfma` there, and its compiler keeps the lanes in registers), else 32
/// scalar lanes. Returns the sum of the lanes, in lane order.
pub fn compute_bound2(iter: i64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has the feature the function is compiled for.
        return unsafe { compute_bound2_avx2(iter) };
    }
    let (a, b) = (1.2345f64, 1.010101f64);
    let mut c = [0f64; 32];
    for _ in 0..iter {
        for x in c.iter_mut() {
            *x += a * b;
        }
    }
    c.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn compute_bound2_avx2(iter: i64) -> f64 {
    use std::arch::x86_64::{__m256d, _mm256_add_pd, _mm256_mul_pd, _mm256_set1_pd, _mm256_setzero_pd};
    let (a, b) = (_mm256_set1_pd(1.2345), _mm256_set1_pd(1.010101));
    let mut c: [__m256d; 8] = [_mm256_setzero_pd(); 8];
    for _ in 0..iter {
        for x in c.iter_mut() {
            *x = _mm256_add_pd(*x, _mm256_mul_pd(a, b));
        }
    }
    // SAFETY: eight 4-lane f64 vectors are 32 f64, same size, no invalid bit patterns.
    let lanes: [f64; 32] = unsafe { std::mem::transmute(c) };
    lanes.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product of 16 copies of `group`, multiplied in lane order.
    fn product(group: [f64; 4]) -> f64 {
        (0..64).fold(1.0, |p, k| p * group[k % 4])
    }

    /// Whichever path the CPU takes computes the recurrence lane by lane (two iterations keep
    /// the lanes exact integers, so a fused and an unfused multiply-add agree: 4→20→420,
    /// 3→12→156, 2→6→42, 1→2→6).
    #[test]
    fn compute_bound_matches_the_recurrence() {
        assert_eq!(compute_bound(0), product([4.0, 3.0, 2.0, 1.0]));
        assert_eq!(compute_bound(2), product([420.0, 156.0, 42.0, 6.0]));
    }

    #[test]
    fn compute_bound2_accumulates() {
        let step = 1.2345f64 * 1.010101;
        let c = (0..3).fold(0.0, |c, _| c + step);
        assert_eq!(compute_bound2(3), (0..32).fold(0.0, |s, _| s + c));
    }
}
