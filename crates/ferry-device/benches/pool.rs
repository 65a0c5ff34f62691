//! Micro-benchmark of the device-pool sub-allocator (`ferry_device::pool::Pool`).
//!
//! Workload: tile allocations of a tiled Cholesky on a device that holds only a fraction of the
//! matrix. A 1 GiB pool with 256-byte alignment; requests are full tiles of `nb² · 8` bytes for
//! `nb` in {256, 512, 1024} (three in four) or ragged edge tiles of `nb · r · 8` bytes with a
//! random `r < nb` (one in four). The working set slides: allocate until an allocation fails,
//! then evict a quarter of the live tiles, drawn at random from the oldest half (LRU-ish), and
//! retry; stop after 200,000 successful operations (allocations + frees).
//!
//! The op sequence is generated once (with the pool itself deciding where allocations fail), then
//! replayed 7 times against a fresh pool and against the system allocator
//! (`std::alloc::alloc`/`dealloc`, same sizes, 256-byte alignment) as an anchor. Runs of
//! consecutive allocations and of consecutive frees are timed as batches with `Instant`.
//!
//! Run: `cargo bench -p ferry-device --bench pool`. Prints a markdown table and writes
//! `target/bench/pool.json` (under `$CARGO_TARGET_DIR` when that is set).

use ferry_device::pool::{Block, Pool};
use std::alloc::{alloc, dealloc, Layout};
use std::collections::VecDeque;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

const CAPACITY: u64 = 1 << 30;
const ALIGN: u64 = 256;
const OPS: usize = 200_000;
const REPS: usize = 7;
const SEED: u64 = 0x5eed_f0e1_2345_6789;

/// Xorshift64*: deterministic, no dependency.
struct XorShift(u64);
impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A run of operations of one kind.
enum Batch {
    /// (id, bytes) per allocation; ids are dense from 0.
    Alloc(Vec<(usize, u64)>),
    /// Ids of the blocks to free.
    Free(Vec<usize>),
}

struct Trace {
    batches: Vec<Batch>,
    /// Requested bytes per id.
    sizes: Vec<u64>,
    allocs: usize,
    frees: usize,
    /// (used/capacity, fragmentation) at each failed allocation.
    failures: Vec<(f64, f64)>,
}

fn tile_bytes(rng: &mut XorShift) -> u64 {
    let nb = [256u64, 512, 1024][rng.below(3) as usize];
    if rng.below(4) == 0 {
        nb * (1 + rng.below(nb - 1)) * 8
    } else {
        nb * nb * 8
    }
}

fn generate() -> Trace {
    let mut rng = XorShift(SEED);
    let mut pool = Pool::new(CAPACITY, ALIGN);
    let mut live: VecDeque<(usize, Block)> = VecDeque::new();
    let mut t = Trace {
        batches: Vec::new(),
        sizes: Vec::new(),
        allocs: 0,
        frees: 0,
        failures: Vec::new(),
    };
    let mut batch: Vec<(usize, u64)> = Vec::new();
    let mut pending = tile_bytes(&mut rng);
    while t.allocs + t.frees < OPS {
        if let Some(b) = pool.alloc(pending) {
            let id = t.sizes.len();
            t.sizes.push(pending);
            batch.push((id, pending));
            live.push_back((id, b));
            t.allocs += 1;
            pending = tile_bytes(&mut rng);
            continue;
        }
        t.failures
            .push((pool.used() as f64 / pool.capacity() as f64, pool.fragmentation()));
        t.batches.push(Batch::Alloc(std::mem::take(&mut batch)));
        let evict = (live.len() / 4).max(1).min(OPS - t.allocs - t.frees);
        let mut freed = Vec::with_capacity(evict);
        for _ in 0..evict {
            let window = live.len().div_ceil(2) as u64;
            let (id, b) = live.remove(rng.below(window) as usize).expect("live block");
            pool.free(b);
            freed.push(id);
        }
        t.frees += freed.len();
        t.batches.push(Batch::Free(freed));
        // `pending` is retried: the runtime needs that tile next.
    }
    t.batches.push(Batch::Alloc(batch));
    t.batches.retain(|b| !matches!(b, Batch::Alloc(v) if v.is_empty()));
    t
}

/// Total (alloc ns, free ns) of one replay against a fresh pool.
fn replay_pool(t: &Trace) -> (u128, u128) {
    let mut pool = Pool::new(CAPACITY, ALIGN);
    let mut blocks = vec![Block { offset: 0, len: 0 }; t.sizes.len()];
    let (mut alloc_ns, mut free_ns) = (0u128, 0u128);
    for batch in &t.batches {
        let start = Instant::now();
        match batch {
            Batch::Alloc(v) => {
                for &(id, len) in v {
                    blocks[id] = black_box(pool.alloc(black_box(len))).expect("replay diverged");
                }
                alloc_ns += start.elapsed().as_nanos();
            }
            Batch::Free(v) => {
                for &id in v {
                    pool.free(black_box(blocks[id]));
                }
                free_ns += start.elapsed().as_nanos();
            }
        }
    }
    black_box(&pool);
    (alloc_ns, free_ns)
}

/// Total (alloc ns, free ns) of one replay against the system allocator.
fn replay_system(t: &Trace) -> (u128, u128) {
    let layout = |len: u64| Layout::from_size_align(len as usize, ALIGN as usize).expect("layout");
    let mut ptrs: Vec<*mut u8> = vec![std::ptr::null_mut(); t.sizes.len()];
    let (mut alloc_ns, mut free_ns) = (0u128, 0u128);
    for batch in &t.batches {
        let start = Instant::now();
        match batch {
            Batch::Alloc(v) => {
                for &(id, len) in v {
                    // SAFETY: the layout has a non-zero size.
                    ptrs[id] = black_box(unsafe { alloc(layout(black_box(len))) });
                }
                alloc_ns += start.elapsed().as_nanos();
                for &(id, _) in v {
                    assert!(!ptrs[id].is_null(), "system allocation failed");
                }
            }
            Batch::Free(v) => {
                for &id in v {
                    // SAFETY: ptrs[id] was allocated above with this layout and is freed once.
                    unsafe { dealloc(black_box(ptrs[id]), layout(t.sizes[id])) };
                    ptrs[id] = std::ptr::null_mut();
                }
                free_ns += start.elapsed().as_nanos();
            }
        }
    }
    for (id, p) in ptrs.into_iter().enumerate() {
        if !p.is_null() {
            // SAFETY: still-live allocation from this replay, freed once (untimed).
            unsafe { dealloc(p, layout(t.sizes[id])) };
        }
    }
    (alloc_ns, free_ns)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn json_list(v: &[f64]) -> String {
    let items: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
    format!("[{}]", items.join(", "))
}

struct Row {
    name: &'static str,
    alloc_ns: Vec<f64>,
    free_ns: Vec<f64>,
    op_ns: Vec<f64>,
}

fn main() {
    let t = generate();
    let (allocs, frees) = (t.allocs as f64, t.frees as f64);
    let mut results = [
        Row {
            name: "ferry Pool (best-fit)",
            alloc_ns: vec![],
            free_ns: vec![],
            op_ns: vec![],
        },
        Row {
            name: "system allocator (anchor)",
            alloc_ns: vec![],
            free_ns: vec![],
            op_ns: vec![],
        },
    ];
    for _ in 0..REPS {
        for (r, replay) in results
            .iter_mut()
            .zip([replay_pool as fn(&Trace) -> (u128, u128), replay_system])
        {
            let (a, f) = replay(&t);
            r.alloc_ns.push(a as f64 / allocs);
            r.free_ns.push(f as f64 / frees);
            r.op_ns.push((a + f) as f64 / (allocs + frees));
        }
    }

    let n_fail = t.failures.len() as f64;
    let mean = |f: fn(&(f64, f64)) -> f64| t.failures.iter().map(f).sum::<f64>() / n_fail;
    let max = |f: fn(&(f64, f64)) -> f64| t.failures.iter().map(f).fold(0.0, f64::max);
    let (util_mean, util_max) = (mean(|x| x.0), max(|x| x.0));
    let (frag_mean, frag_max) = (mean(|x| x.1), max(|x| x.1));

    println!(
        "pool bench: capacity 1 GiB, align {ALIGN}, {} allocs + {} frees, {} failed allocations, median of {REPS}\n",
        t.allocs,
        t.frees,
        t.failures.len()
    );
    println!("| allocator | ns/alloc | ns/free | ns/op |");
    println!("|---|---:|---:|---:|");
    for r in &results {
        println!(
            "| {} | {:.1} | {:.1} | {:.1} |",
            r.name,
            median(r.alloc_ns.clone()),
            median(r.free_ns.clone()),
            median(r.op_ns.clone())
        );
    }
    println!("\n| at failed allocation | mean | max |");
    println!("|---|---:|---:|");
    println!("| utilisation (used/capacity) | {util_mean:.4} | {util_max:.4} |");
    println!("| fragmentation (1 - largest/free) | {frag_mean:.4} | {frag_max:.4} |");

    let runs: Vec<String> = results
        .iter()
        .map(|r| {
            format!(
                "    {{\"allocator\": \"{}\", \"ns_per_alloc\": {:.2}, \"ns_per_free\": {:.2}, \"ns_per_op\": {:.2}, \
                 \"ns_per_alloc_reps\": {}, \"ns_per_free_reps\": {}}}",
                r.name,
                median(r.alloc_ns.clone()),
                median(r.free_ns.clone()),
                median(r.op_ns.clone()),
                json_list(&r.alloc_ns),
                json_list(&r.free_ns)
            )
        })
        .collect();
    let json = format!(
        "{{\n  \"bench\": \"pool\",\n  \"params\": {{\"capacity\": {CAPACITY}, \"align\": {ALIGN}, \"ops\": {OPS}, \
         \"reps\": {REPS}, \"seed\": {SEED}}},\n  \"allocs\": {},\n  \"frees\": {},\n  \"failures\": {},\n  \
         \"utilisation_at_failure\": {{\"mean\": {util_mean:.6}, \"max\": {util_max:.6}}},\n  \
         \"fragmentation_at_failure\": {{\"mean\": {frag_mean:.6}, \"max\": {frag_max:.6}}},\n  \"results\": [\n{}\n  ]\n}}\n",
        t.allocs,
        t.frees,
        t.failures.len(),
        runs.join(",\n")
    );
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"),
        PathBuf::from,
    );
    let dir = target.join("bench");
    std::fs::create_dir_all(&dir).expect("creating target/bench");
    let path = dir.join("pool.json");
    std::fs::write(&path, json).expect("writing pool.json");
    println!("\nrecord written to {}", path.display());
}
