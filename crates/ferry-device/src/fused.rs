//! Fused launches: a sequence of kernels over one set of tiles, launched as a single unit. On a
//! CUDA device the sequence is captured into a CUDA graph the first time and launched with one
//! `cuGraphLaunch` afterwards, its independent kernels on several streams (`cuda/graph.rs`); on
//! an emulated device its kernels run in order.
//!
//! The layer above hands the GPU manager one launch instead of one per kernel: one allocation,
//! one stage-in, one event and one completion for the whole sequence. The task runtime fuses
//! the GPU tasks of a replayed trace this way.
//!
//! A captured graph is launched again only for the same device and the same tile addresses,
//! and — where a body read them through its context — the same arguments and sequence numbers;
//! otherwise the sequence is captured again (and the graph updated in place where its shape
//! allows). A body must therefore enqueue the same work whenever it sees the same tiles,
//! arguments and sequence number: the usual condition of CUDA graph capture.

use crate::{CudaTaskContext, Kernel, LaunchArgs, TileView};
use ferry_base::error::{Rank, TaskError};
use ferry_base::AccessMode;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// Counters of fused launches, shared by the [`Fused`] sequences of one runtime.
#[derive(Debug, Default)]
pub struct FusedCounters {
    /// Fused launches.
    pub launches: AtomicU64,
    /// CUDA graphs captured: at a sequence's first launch, and at each launch whose tile
    /// addresses (or arguments and sequence numbers that a body reads) differ from the last
    /// capture's.
    pub captures: AtomicU64,
    /// Of those, the captures that updated the instantiated graph in place
    /// (`cuGraphExecUpdate`) instead of instantiating a new one.
    pub updates: AtomicU64,
    /// Launches that ran their kernels one after another on one stream instead: on emulated
    /// devices, and where a body cannot be captured.
    pub direct: AtomicU64,
}

/// One kernel of a fused sequence.
pub struct FusedPart {
    /// What runs.
    pub kernel: Arc<dyn Kernel>,
    /// Its tiles, in its argument order: the index of each among the fused launch's tiles, and
    /// how this kernel uses it.
    pub tiles: SmallVec<[(u32, AccessMode); 6]>,
    /// Its sequence number less the fused launch's.
    pub seq_offset: u64,
}

/// A sequence of kernels launched as one (see the module documentation).
pub struct Fused {
    name: String,
    parts: Vec<FusedPart>,
    /// Per part, the earlier parts it must follow: those that access one of its tiles where
    /// either writes (read after write, write after read, write after write).
    deps: Vec<SmallVec<[u32; 4]>>,
    counters: Arc<FusedCounters>,
    /// The last capture (touched by the GPU manager's thread only; the lock makes it `Sync`).
    pub(crate) graph: Mutex<crate::cuda::graph::Cache>,
}

impl Fused {
    /// A fused sequence named `name` (for errors) of `parts`, in the order they must appear to
    /// run; `counters` counts its launches.
    pub fn new(name: String, parts: Vec<FusedPart>, counters: Arc<FusedCounters>) -> Fused {
        let deps = dependencies(&parts);
        Fused {
            name,
            parts,
            deps,
            counters,
            graph: Mutex::default(),
        }
    }

    /// The sequence's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its kernels.
    pub fn parts(&self) -> &[FusedPart] {
        &self.parts
    }

    /// The earlier parts that part `k` follows (indices, ascending).
    ///
    /// # Panics
    /// When `k` is not a part's index.
    pub fn deps(&self, k: usize) -> &[u32] {
        &self.deps[k]
    }

    pub(crate) fn counters(&self) -> &FusedCounters {
        &self.counters
    }

    /// The arguments of a fused launch from each part's, in part order: each part's count,
    /// then its arguments.
    pub fn pack_args<'a>(per_part: impl IntoIterator<Item = &'a [i64]>) -> LaunchArgs {
        let mut out = LaunchArgs::new();
        for a in per_part {
            Fused::pack_part(&mut out, a);
        }
        out
    }

    /// Appends the next part's arguments to `out`, in [`Fused::pack_args`]' format (for a
    /// caller that gets the parts one at a time).
    pub fn pack_part(out: &mut LaunchArgs, args: &[i64]) {
        out.push(args.len() as i64);
        out.extend_from_slice(args);
    }

    /// Each part's arguments out of a fused launch's ([`Fused::pack_args`]).
    ///
    /// # Errors
    /// Arguments that were not packed for this sequence.
    pub(crate) fn split_args<'a>(&self, args: &'a [i64]) -> Result<SmallVec<[&'a [i64]; 16]>, TaskError> {
        split_args(args, self.parts.len()).ok_or_else(|| self.bad_args(args.len()))
    }

    fn bad_args(&self, len: usize) -> TaskError {
        format!(
            "fused `{}`: {len} arguments are not those of its {} parts (Fused::pack_args)",
            self.name,
            self.parts.len()
        )
        .into()
    }

    /// Part `k`'s tiles out of the fused launch's `tiles`, each with the part's own access mode.
    ///
    /// # Errors
    /// A tile index past `tiles`.
    pub(crate) fn part_tiles(&self, k: usize, tiles: &[TileView]) -> Result<SmallVec<[TileView; 8]>, TaskError> {
        self.parts[k]
            .tiles
            .iter()
            .map(|&(u, mode)| {
                let t = tiles.get(u as usize).ok_or_else(|| {
                    TaskError::from(format!(
                        "fused `{}`: part {k} names tile {u} of {}",
                        self.name,
                        tiles.len()
                    ))
                })?;
                Ok(TileView { mode, ..t.clone() })
            })
            .collect()
    }

    /// Runs the parts one after another on host memory (an emulated device's copies, standing
    /// in for the kernels).
    ///
    /// # Errors
    /// The first part's failure, naming it; malformed arguments or tiles.
    pub fn run_emulated(&self, tiles: &[TileView], args: &[i64], seq: u64, rank: Rank) -> Result<(), String> {
        self.counters.launches.fetch_add(1, Relaxed);
        self.counters.direct.fetch_add(1, Relaxed);
        let per_part = self.split_args(args).map_err(|e| e.to_string())?;
        for (k, p) in self.parts.iter().enumerate() {
            let views = self.part_tiles(k, tiles).map_err(|e| e.to_string())?;
            p.kernel
                .run_emulated(&views, per_part[k], seq + p.seq_offset, rank)
                .map_err(|e| format!("`{}` (part {k} of fused `{}`): {e}", p.kernel.name(), self.name))?;
        }
        Ok(())
    }

    /// Enqueues the sequence on `ctx`'s stream as one CUDA graph (captured on first use; see the
    /// module documentation).
    ///
    /// # Errors
    /// A part's failure, naming it; a failed driver call; malformed arguments or tiles.
    pub fn run_cuda(&self, ctx: &CudaTaskContext<'_>) -> Result<(), TaskError> {
        self.counters.launches.fetch_add(1, Relaxed);
        crate::cuda::graph::launch(self, ctx)
    }
}

/// Each of `parts` parts' arguments out of arguments packed by [`Fused::pack_args`]; `None`
/// when they were not packed for that many parts (a count past the end, a negative count,
/// arguments left over).
pub fn split_args(args: &[i64], parts: usize) -> Option<SmallVec<[&[i64]; 16]>> {
    Some(packed_ranges(args, parts)?.into_iter().map(|r| &args[r]).collect())
}

/// [`split_args`] as index ranges into `args` (for a caller that keeps the arguments and
/// slices them later).
pub fn packed_ranges(args: &[i64], parts: usize) -> Option<SmallVec<[std::ops::Range<usize>; 16]>> {
    let mut out = SmallVec::with_capacity(parts);
    let mut at = 0usize;
    for _ in 0..parts {
        let n = args.get(at).copied().and_then(|n| usize::try_from(n).ok())?;
        let end = at.checked_add(1 + n).filter(|&e| e <= args.len())?;
        out.push(at + 1..end);
        at = end;
    }
    (at == args.len()).then_some(out)
}

/// Per part, the earlier parts it depends on through a shared tile
/// ([`ferry_base::access::sequence_dependencies`]).
fn dependencies(parts: &[FusedPart]) -> Vec<SmallVec<[u32; 4]>> {
    ferry_base::access::sequence_dependencies(parts.iter().map(|p| &p.tiles[..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::any::TypeId;
    use std::sync::atomic::AtomicUsize;

    /// Adds its argument to every byte of its written tiles after checking that its read ones
    /// hold `expect`; records the order it ran in.
    struct Add {
        order: Arc<Mutex<Vec<(u64, i64)>>>,
        calls: AtomicUsize,
    }

    impl Kernel for Add {
        fn name(&self) -> &str {
            "add"
        }
        fn run_cuda(&self, _ctx: &CudaTaskContext<'_>) -> Option<Result<(), TaskError>> {
            None
        }
        fn run_emulated(&self, tiles: &[TileView], args: &[i64], seq: u64, _rank: Rank) -> Result<(), String> {
            self.calls.fetch_add(1, Relaxed);
            self.order.lock().unwrap().push((seq, args[0]));
            let sum: u32 = tiles
                .iter()
                .filter(|t| !t.mode.writes())
                // SAFETY: the test's buffers outlive the call.
                .map(|t| unsafe { *t.ptr } as u32)
                .sum();
            for t in tiles.iter().filter(|t| t.mode.writes()) {
                // SAFETY: as above.
                unsafe { *t.ptr = (sum as i64 + args[0]) as u8 };
            }
            Ok(())
        }
    }

    fn view(buf: &mut [u8; 8]) -> TileView {
        TileView {
            ptr: buf.as_mut_ptr(),
            bytes: 8,
            rows: 1,
            cols: 8,
            mode: AccessMode::ReadWrite,
            elem: TypeId::of::<u8>(),
            elem_name: "u8",
            coords: (0, 0),
        }
    }

    fn part(k: &Arc<Add>, tiles: &[(u32, AccessMode)], off: u64) -> FusedPart {
        FusedPart {
            kernel: k.clone(),
            tiles: tiles.iter().copied().collect(),
            seq_offset: off,
        }
    }

    /// Read after write, write after read and write after write within the sequence become
    /// dependencies; independent parts stay independent.
    #[test]
    fn dependencies_follow_the_tiles() {
        use AccessMode::{Read as R, ReadWrite as RW, Write as W};
        let k = Arc::new(Add {
            order: Default::default(),
            calls: AtomicUsize::new(0),
        });
        let parts = vec![
            part(&k, &[(0, W)], 0),          // 0
            part(&k, &[(1, W)], 1),          // 1: independent
            part(&k, &[(0, R), (2, W)], 2),  // 2: after 0
            part(&k, &[(0, R), (3, W)], 3),  // 3: after 0
            part(&k, &[(0, RW)], 4),         // 4: after 0, 2, 3
            part(&k, &[(2, R), (1, RW)], 5), // 5: after 2, 1
            part(&k, &[(4, R)], 6),          // 6: nothing
        ];
        let f = Fused::new("t".into(), parts, Default::default());
        let deps: Vec<Vec<u32>> = (0..7).map(|k| f.deps(k).to_vec()).collect();
        assert_eq!(
            deps,
            vec![vec![], vec![], vec![0], vec![0], vec![0, 2, 3], vec![1, 2], vec![]]
        );
    }

    /// The emulated launch runs every part once, in order, on its own tiles with its own modes,
    /// arguments and sequence number; malformed arguments are an error, not a panic.
    #[test]
    fn emulated_launch_runs_the_parts_in_order() {
        use AccessMode::{Read as R, Write as W};
        let order = Arc::new(Mutex::new(Vec::new()));
        let k = Arc::new(Add {
            order: order.clone(),
            calls: AtomicUsize::new(0),
        });
        let counters = Arc::new(FusedCounters::default());
        let parts = vec![
            part(&k, &[(0, W)], 0),
            part(&k, &[(0, R), (1, W)], 3),
            part(&k, &[(1, R), (0, R), (2, W)], 5),
        ];
        let f = Fused::new("t".into(), parts, counters.clone());
        let (mut a, mut b, mut c) = ([0u8; 8], [0u8; 8], [0u8; 8]);
        let tiles = [view(&mut a), view(&mut b), view(&mut c)];
        let args = Fused::pack_args([&[5i64][..], &[7], &[1]]);
        assert_eq!(&args[..], &[1, 5, 1, 7, 1, 1]);
        f.run_emulated(&tiles, &args, 100, 0).unwrap();
        // a = 5; b = a + 7 = 12; c = b + a + 1 = 18.
        assert_eq!((a[0], b[0], c[0]), (5, 12, 18));
        assert_eq!(*order.lock().unwrap(), vec![(100, 5), (103, 7), (105, 1)]);
        assert_eq!(counters.launches.load(Relaxed), 1);
        assert_eq!(counters.direct.load(Relaxed), 1);
        for bad in [&[1i64, 5, 1, 7][..], &[1, 5, 1, 7, 1, 1, 9], &[-1, 5, 1, 7, 1, 1], &[]] {
            let e = f.run_emulated(&tiles, bad, 100, 0).unwrap_err();
            assert!(e.contains("are not those of its 3 parts"), "{e}");
        }
        let e = f.run_emulated(&tiles[..2], &args, 100, 0).unwrap_err();
        assert!(e.contains("part 2 names tile 2 of 2"), "{e}");
        assert_eq!(k.calls.load(Relaxed), 3 + 2, "no part ran on malformed arguments");
    }
}
