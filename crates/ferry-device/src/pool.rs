//! Sub-allocator of a device memory pool.
//!
//! At start-up ferry reserves one region per GPU (a fraction of its free memory) and carves tile
//! allocations out of it. This module manages offsets into that region only: it knows nothing of
//! CUDA, and the GPU manager turns a [`Block`] into a device pointer by adding the region's base.
//!
//! # Algorithm
//!
//! Free ranges are kept twice: in a `BTreeMap<offset, len>` (address order, to find the
//! neighbours of a freed block) and in a `BTreeSet<(len, offset)>` (size order, for the best-fit
//! search). Allocated blocks sit in a `HashMap<offset, len>` so that [`Pool::free`] can validate
//! what it is handed.
//!
//! * [`Pool::alloc`] rounds the request up to the alignment, takes the *smallest* free range at
//!   least that large (the lowest offset among equal sizes), carves the block from the start of
//!   that range and puts the remainder back.
//! * [`Pool::free`] checks the block is live, then merges it with the free ranges that end where
//!   it starts and start where it ends, so free ranges are always maximal (never adjacent).
//!
//! Both are O(log n) in the number of free ranges (plus an expected O(1) hash lookup).
//!
//! # Why best-fit
//!
//! Tiles come in a few large sizes (full tiles) and many smaller ones (ragged edge tiles,
//! workspaces). Best-fit serves a small request from the smallest hole that fits, leaving the
//! large ranges intact for large tiles, whereas first-fit or next-fit tend to nibble at whichever
//! large range comes first. Wilson, Johnstone, Neely and Boles, "Dynamic Storage Allocation: A
//! Survey and Critical Review" (IWMM 1995), find best-fit (with address-ordered first-fit) among
//! the least fragmenting placement policies on real traces; the size-ordered tree makes it as
//! cheap as first-fit here.
//!
//! # Concurrency
//!
//! A pool is owned and used only by the GPU manager thread of its device, so it does no locking:
//! mutation goes through `&mut self`, and sharing it between threads would need an outer lock.
//!
//! The GPU manager (`ferry-memory`) owns one per device; `benches/pool.rs` measures it.

use std::collections::{BTreeMap, BTreeSet};

/// An allocation: offset into the region and its (rounded) length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Block {
    /// Offset of the first byte from the start of the region; a multiple of the pool's alignment.
    pub offset: u64,
    /// Length in bytes, rounded up to the pool's alignment.
    pub len: u64,
}

/// Best-fit sub-allocator of offsets in `[0, capacity)`.
#[derive(Debug)]
pub struct Pool {
    capacity: u64,
    align: u64,
    /// Free ranges by offset: offset → len. Never two adjacent ranges.
    free_by_offset: BTreeMap<u64, u64>,
    /// The same free ranges by size: (len, offset).
    free_by_size: BTreeSet<(u64, u64)>,
    /// Live blocks: offset → len.
    allocated: rustc_hash::FxHashMap<u64, u64>,
    used: u64,
}

impl Pool {
    /// A pool over `[0, capacity)`; every block is aligned to `align` bytes (a power of two, e.g.
    /// 256). A `capacity` that is not a multiple of `align` is rounded down to one (the tail could
    /// never hold an aligned block), and [`Pool::capacity`] reports the rounded value.
    ///
    /// # Panics
    ///
    /// If `align` is not a power of two.
    pub fn new(capacity: u64, align: u64) -> Pool {
        assert!(align.is_power_of_two(), "pool alignment {align} is not a power of two");
        let capacity = capacity & !(align - 1);
        let mut pool = Pool {
            capacity,
            align,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            allocated: rustc_hash::FxHashMap::default(),
            used: 0,
        };
        if capacity > 0 {
            pool.insert_free(0, capacity);
        }
        pool
    }

    /// Best-fit allocation of `len` bytes (rounded up to the alignment; `len` 0 allocates one
    /// alignment unit). `None` when no free range is large enough.
    pub fn alloc(&mut self, len: u64) -> Option<Block> {
        let len = len.max(1).checked_add(self.align - 1)? & !(self.align - 1);
        let &(range_len, offset) = self.free_by_size.range((len, 0)..).next()?;
        self.remove_free(offset, range_len);
        if range_len > len {
            self.insert_free(offset + len, range_len - len);
        }
        self.allocated.insert(offset, len);
        self.used += len;
        Some(Block { offset, len })
    }

    /// Returns a block and coalesces it with its free neighbours. Freeing a block that is not
    /// allocated (double free, wrong length, foreign block) is a logic error: it panics in debug
    /// builds and is ignored in release builds, leaving the pool untouched.
    pub fn free(&mut self, b: Block) {
        if self.allocated.get(&b.offset) != Some(&b.len) {
            debug_assert!(false, "freeing {b:?}, which is not an allocated block of this pool");
            return;
        }
        self.allocated.remove(&b.offset);
        self.used -= b.len;

        let (mut offset, mut len) = (b.offset, b.len);
        if let Some((&prev_off, &prev_len)) = self.free_by_offset.range(..offset).next_back() {
            if prev_off + prev_len == offset {
                self.remove_free(prev_off, prev_len);
                offset = prev_off;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.free_by_offset.get(&(offset + len)) {
            self.remove_free(offset + len, next_len);
            len += next_len;
        }
        self.insert_free(offset, len);
    }

    /// Size of the region in bytes (rounded down to the alignment).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes in allocated blocks (rounded lengths).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Length of the largest single free range: the largest allocation that would succeed now.
    pub fn largest_free(&self) -> u64 {
        self.free_by_size.last().map_or(0, |&(len, _)| len)
    }

    /// External fragmentation: `1 − largest_free / total_free` (0 when nothing is free).
    pub fn fragmentation(&self) -> f64 {
        let total_free = self.capacity - self.used;
        if total_free == 0 {
            0.0
        } else {
            1.0 - self.largest_free() as f64 / total_free as f64
        }
    }

    /// Number of live blocks.
    pub fn allocations(&self) -> usize {
        self.allocated.len()
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.insert(offset, len);
        self.free_by_size.insert((len, offset));
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.remove(&offset);
        self.free_by_size.remove(&(len, offset));
    }

    /// Checks every structural invariant; panics on the first violation.
    #[cfg(test)]
    fn check_invariants(&self) {
        assert_eq!(self.free_by_offset.len(), self.free_by_size.len());
        for (&off, &len) in &self.free_by_offset {
            assert!(self.free_by_size.contains(&(len, off)));
        }
        let mut ranges: Vec<(u64, u64, bool)> = self.free_by_offset.iter().map(|(&o, &l)| (o, l, true)).collect();
        ranges.extend(self.allocated.iter().map(|(&o, &l)| (o, l, false)));
        ranges.sort_unstable();
        // Free and allocated ranges tile [0, capacity) exactly; no two free ranges are adjacent.
        let mut end = 0;
        let mut prev_free = false;
        for &(off, len, is_free) in &ranges {
            assert_eq!(off, end, "gap or overlap at {off}");
            assert!(len > 0 && len % self.align == 0 && off % self.align == 0);
            assert!(!(prev_free && is_free), "adjacent free ranges at {off}");
            end = off + len;
            prev_free = is_free;
        }
        assert_eq!(end, self.capacity);
        assert_eq!(self.used, self.allocated.values().sum::<u64>());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_and_rounding() {
        let mut p = Pool::new(4096, 256);
        let a = p.alloc(1).unwrap();
        assert_eq!(a, Block { offset: 0, len: 256 });
        let b = p.alloc(0).unwrap();
        assert_eq!(b, Block { offset: 256, len: 256 });
        let c = p.alloc(257).unwrap();
        assert_eq!(c, Block { offset: 512, len: 512 });
        let d = p.alloc(256).unwrap();
        assert_eq!(d, Block { offset: 1024, len: 256 });
        assert_eq!(p.used(), 1280);
        assert_eq!(p.allocations(), 4);
        assert_eq!(p.largest_free(), 4096 - 1280);
        p.check_invariants();

        // Capacity not a multiple of the alignment is rounded down.
        let p = Pool::new(1000, 256);
        assert_eq!(p.capacity(), 768);
        assert_eq!(p.largest_free(), 768);
        // Requests near u64::MAX do not overflow.
        let mut p = Pool::new(1 << 20, 256);
        assert_eq!(p.alloc(u64::MAX), None);
        assert_eq!(p.alloc(u64::MAX - 100), None);
        p.check_invariants();
    }

    #[test]
    fn exhaustion_returns_none() {
        let mut p = Pool::new(1024, 256);
        let blocks: Vec<_> = (0..4).map(|_| p.alloc(200).unwrap()).collect();
        assert_eq!(p.alloc(1), None);
        assert_eq!(p.used(), 1024);
        assert_eq!(p.largest_free(), 0);
        assert_eq!(p.fragmentation(), 0.0);
        p.free(blocks[1]);
        assert_eq!(p.alloc(257), None, "a 256-byte hole cannot hold 512 bytes");
        assert_eq!(p.alloc(256), Some(blocks[1]));
        assert_eq!(Pool::new(0, 256).alloc(0), None);
        assert_eq!(Pool::new(100, 256).alloc(0), None);
    }

    #[test]
    fn free_and_coalesce_restores_one_range() {
        let mut p = Pool::new(8 * 256, 256);
        let blocks: Vec<_> = (0..8).map(|_| p.alloc(256).unwrap()).collect();
        // Free in an order that exercises merging with the left, the right and both neighbours.
        for &i in &[1, 3, 2, 6, 7, 0, 5, 4] {
            p.free(blocks[i]);
            p.check_invariants();
        }
        assert_eq!(p.used(), 0);
        assert_eq!(p.allocations(), 0);
        assert_eq!(p.largest_free(), p.capacity());
        assert_eq!(p.free_by_offset.len(), 1);
        assert_eq!(p.fragmentation(), 0.0);
    }

    #[test]
    fn fragmentation_metric() {
        let mut p = Pool::new(4 * 256, 256);
        let b: Vec<_> = (0..4).map(|_| p.alloc(256).unwrap()).collect();
        p.free(b[0]);
        p.free(b[2]);
        // Two free holes of 256: largest 256 of 512 free.
        assert_eq!(p.largest_free(), 256);
        assert!((p.fragmentation() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn best_fit_picks_smallest_fitting_hole() {
        let mut p = Pool::new(64 * 256, 256);
        // Layout: [h1: 4 units][x][h2: 2 units][x][h3: 3 units][x][rest]
        let h1 = p.alloc(4 * 256).unwrap();
        let _x1 = p.alloc(256).unwrap();
        let h2 = p.alloc(2 * 256).unwrap();
        let _x2 = p.alloc(256).unwrap();
        let h3 = p.alloc(3 * 256).unwrap();
        let _x3 = p.alloc(256).unwrap();
        p.free(h1);
        p.free(h2);
        p.free(h3);
        p.check_invariants();
        // 2 units: the 2-unit hole exactly, though the 4-unit hole comes first.
        assert_eq!(p.alloc(2 * 256).unwrap().offset, h2.offset);
        // 1 unit: the 3-unit hole is now the smallest that fits; carved from its start.
        assert_eq!(p.alloc(256).unwrap().offset, h3.offset);
        // 3 units: the 4-unit hole (the remaining 2 units of h3 are too small).
        assert_eq!(p.alloc(3 * 256).unwrap().offset, h1.offset);
        // Equal sizes: the lowest offset wins. Holes left: h1+3 (1 unit), h3+1 (2 units).
        let mut q = Pool::new(16 * 256, 256);
        let b: Vec<_> = (0..8).map(|_| q.alloc(256).unwrap()).collect();
        q.free(b[5]);
        q.free(b[1]);
        q.free(b[3]);
        assert_eq!(q.alloc(1).unwrap().offset, b[1].offset);
        assert_eq!(q.alloc(1).unwrap().offset, b[3].offset);
        q.check_invariants();
    }

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "not an allocated block"))]
    fn invalid_free_is_rejected() {
        let mut p = Pool::new(4096, 256);
        let a = p.alloc(512).unwrap();
        let _b = p.alloc(512).unwrap();
        p.free(a);
        // Double free, wrong length, never-allocated offset: all ignored in release.
        p.free(a);
        p.free(Block { offset: 512, len: 256 });
        p.free(Block { offset: 3072, len: 256 });
        p.check_invariants();
        assert_eq!(p.used(), 512);
        assert_eq!(p.allocations(), 1);
    }

    /// Xorshift64* (Vigna): enough randomness for tests, no dependency.
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

    #[test]
    fn randomized_against_reference_model() {
        const ALIGN: u64 = 256;
        const SLOTS: u64 = 1024;
        let capacity = SLOTS * ALIGN;
        for seed in [0x9e37_79b9_7f4a_7c15_u64, 1, 0xdead_beef] {
            let mut rng = XorShift(seed);
            let mut p = Pool::new(capacity, ALIGN);
            // Reference model: one bool per alignment unit.
            let mut slots = vec![false; SLOTS as usize];
            let mut live: Vec<Block> = Vec::new();
            for step in 0..10_000 {
                let alloc = live.is_empty() || rng.below(100) < 55;
                if alloc {
                    // Mostly small requests, some large, some unaligned and zero.
                    let len = match rng.below(10) {
                        0 => 0,
                        1..=6 => rng.below(8 * ALIGN),
                        7 | 8 => rng.below(64 * ALIGN),
                        _ => rng.below(256 * ALIGN),
                    };
                    let rounded = len.max(1).div_ceil(ALIGN) * ALIGN;
                    let free_units = slots.iter().filter(|s| !**s).count() as u64;
                    let largest_before = p.largest_free();
                    match p.alloc(len) {
                        Some(b) => {
                            assert_eq!(b.len, rounded);
                            assert_eq!(b.offset % ALIGN, 0);
                            assert!(b.offset + b.len <= capacity, "block {b:?} outside capacity");
                            for s in &mut slots[(b.offset / ALIGN) as usize..((b.offset + b.len) / ALIGN) as usize] {
                                assert!(!*s, "step {step}: block {b:?} overlaps a live block");
                                *s = true;
                            }
                            live.push(b);
                        }
                        None => {
                            assert!(largest_before < rounded, "step {step}: alloc({len}) failed with room");
                            assert!(rounded > ALIGN || free_units == 0);
                        }
                    }
                } else {
                    let b = live.swap_remove(rng.below(live.len() as u64) as usize);
                    for s in &mut slots[(b.offset / ALIGN) as usize..((b.offset + b.len) / ALIGN) as usize] {
                        assert!(*s);
                        *s = false;
                    }
                    p.free(b);
                }
                assert_eq!(p.used(), live.iter().map(|b| b.len).sum::<u64>());
                assert_eq!(p.allocations(), live.len());
                // Largest free range equals the longest run of free slots in the model.
                let (mut run, mut longest) = (0u64, 0u64);
                for &s in &slots {
                    run = if s { 0 } else { run + 1 };
                    longest = longest.max(run);
                }
                assert_eq!(p.largest_free(), longest * ALIGN, "step {step}");
                if step % 97 == 0 {
                    p.check_invariants();
                }
            }
            p.check_invariants();
            while let Some(b) = live.pop() {
                p.free(b);
            }
            p.check_invariants();
            assert_eq!(p.used(), 0);
            assert_eq!(p.largest_free(), capacity);
            assert_eq!(p.fragmentation(), 0.0);
        }
    }
}
