//! What a CUDA kernel body sees: [`CudaTaskContext`].

use super::TileView;
use cudarc::driver::CudaStream;
use ferry_base::error::TaskError;
use rustc_hash::FxHashMap as HashMap;
use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell, RefMut};
use std::sync::Arc;

/// Per exec stream cache of library handles (cuBLAS, cuSOLVER, modules…), keyed by type.
#[derive(Default)]
pub(super) struct Resources {
    pub(super) map: RefCell<HashMap<TypeId, Box<dyn Any>>>,
}

/// What a CUDA task body sees: its stream, the device addresses and shapes of its tiles, its
/// arguments, and a per-stream cache for library handles.
///
/// The body runs on the GPU manager thread and must only *enqueue* work on
/// [`CudaTaskContext::stream`]; the manager records an event after it and releases the task's
/// successors when the event completes.
pub struct CudaTaskContext<'a> {
    pub(super) stream: &'a Arc<CudaStream>,
    pub(super) tiles: &'a [TileView],
    pub(super) args: &'a [i64],
    pub(super) seq: u64,
    pub(super) device: usize,
    pub(super) resources: &'a Resources,
    /// The device's exec streams and their caches, and which of them `stream` is: a fused
    /// launch (`cuda/graph.rs`) captures its parts over them.
    pub(super) lanes: &'a [Arc<CudaStream>],
    pub(super) lane_resources: &'a [Resources],
    pub(super) lane: usize,
    /// What the body read: [`READ_ARGS`], [`READ_SEQ`]. A captured CUDA graph depends on the
    /// arguments and the sequence number only where a body read them.
    pub(super) read: Cell<u8>,
}

/// [`CudaTaskContext::read`]: the body read its arguments.
pub(super) const READ_ARGS: u8 = 1;
/// [`CudaTaskContext::read`]: the body read its sequence number.
pub(super) const READ_SEQ: u8 = 2;

impl<'a> CudaTaskContext<'a> {
    /// The exec stream to enqueue on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
    /// Device address (`CUdeviceptr`) of tile `k`, in access order.
    ///
    /// # Errors
    /// `k` out of range.
    pub fn ptr(&self, k: usize) -> Result<u64, TaskError> {
        self.tile(k).map(|t| t.ptr as u64)
    }
    /// `(rows, cols)` of tile `k`.
    ///
    /// # Errors
    /// `k` out of range.
    pub fn shape(&self, k: usize) -> Result<(usize, usize), TaskError> {
        self.tile(k).map(|t| (t.rows, t.cols))
    }
    /// Tile coordinates `(i, j)` of access `k`.
    ///
    /// # Errors
    /// `k` out of range.
    pub fn coords(&self, k: usize) -> Result<(usize, usize), TaskError> {
        self.tile(k).map(|t| t.coords)
    }
    fn tile(&self, k: usize) -> Result<&TileView, TaskError> {
        self.tiles
            .get(k)
            .ok_or_else(|| format!("tile index {k} out of range: the task has {} tiles", self.tiles.len()).into())
    }
    /// Number of tiles.
    pub fn num_tiles(&self) -> usize {
        self.tiles.len()
    }
    /// Scalar arguments.
    pub fn args(&self) -> &[i64] {
        self.read.set(self.read.get() | READ_ARGS);
        self.args
    }
    /// Position of the task in the inserted sequence.
    pub fn seq(&self) -> u64 {
        self.read.set(self.read.get() | READ_SEQ);
        self.seq
    }
    /// Index of the device among this rank's devices.
    pub fn device(&self) -> usize {
        self.device
    }
    /// A per-stream value of type `T` (e.g. a cuBLAS handle bound to this stream), created by
    /// `init` on first use and kept for the life of the runtime.
    ///
    /// # Errors
    /// `init`'s error, or a nested call for the same `T` while the first borrow is alive.
    pub fn resource<T: 'static>(
        &self,
        init: impl FnOnce(&Arc<CudaStream>) -> Result<T, TaskError>,
    ) -> Result<RefMut<'_, T>, TaskError> {
        let mut map = self
            .resources
            .map
            .try_borrow_mut()
            .map_err(|_| "resource already borrowed")?;
        if let std::collections::hash_map::Entry::Vacant(e) = map.entry(TypeId::of::<T>()) {
            e.insert(Box::new(init(self.stream)?));
        }
        RefMut::filter_map(map, |m| {
            m.get_mut(&TypeId::of::<T>()).and_then(|b| b.downcast_mut::<T>())
        })
        .map_err(|_| "resource has an unexpected type".into())
    }
}
