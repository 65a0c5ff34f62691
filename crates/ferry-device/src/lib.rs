//! # ferry-device
//!
//! Devices: the [`Backend`] abstraction over CUDA GPUs ([`cuda`]) and emulated ones ([`emu`],
//! so that CI runs every device path without a GPU), the sub-allocator of their memory pools
//! ([`pool`]), the signal words that ranks of one node synchronise through, and the copy kernel.
//!
//! This layer knows streams, events, pools and kernels; it knows neither tasks nor MPI. The
//! GPU manager (in `ferry-memory`) drives a backend from its own thread; what it launches is a
//! [`Kernel`] over [`TileView`]s. It is the only crate of the workspace, with `ferry-kernels`,
//! that depends on `cudarc`.

#![warn(missing_docs)]

pub mod copier;
pub mod cuda;
pub mod emu;
pub mod fused;
mod mapping_cache;
pub mod pool;
mod signal_mirror;
mod sm_copy;
mod spec;

pub use cuda::CudaTaskContext;
/// cudarc, re-exported so that the layers above and CUDA kernel bodies use the same version.
pub use cudarc;
pub use ferry_base::error::DeviceError;
pub use spec::DeviceSpec;

use ferry_base::error::{Rank, TaskError};
use ferry_base::AccessMode;
use std::any::TypeId;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Streams per device reserved for transfers between ranks (staged chunks, IPC pulls), so that
/// several transfers overlap (between two H200, IPC copies of 4 MiB with 8 in flight reach
/// 318 GB/s on 4 streams, far less on one).
pub const COMM_STREAMS: usize = 4;

/// Signal words per device: 64-bit counters past the end of each device pool, in the same
/// allocation (so the IPC mapping that peers make of the pool covers them too). Word `k` counts
/// the offers made after tasks launched on exec stream `k` (see [`Backend::signal`]).
pub const SIGNAL_SLOTS: usize = 32;

/// Acknowledgement words per device, after the signal words in the same area: a consumer's
/// comm stream writes one after its IPC pull of a block of this device's pool, and the tasks
/// that overwrite the block wait for it on the device (`ferry-transfer/src/ack.rs`).
pub const ACK_WORDS: usize = 1024;

/// Bytes of the signal area that follows each pool: the signal words, then the acknowledgement
/// words.
pub const SIGNAL_BYTES: u64 = ((SIGNAL_SLOTS + ACK_WORDS) * 8) as u64;

/// Offset of signal word `slot` from the base of a pool of `pool_bytes` bytes: the area starts at
/// the first 256-byte boundary past the pool, so a peer computes it from the pool size it was
/// told at start-up.
pub fn signal_offset(pool_bytes: u64, slot: usize) -> u64 {
    pool_bytes.next_multiple_of(256) + 8 * slot as u64
}

/// Offset of acknowledgement word `word` (below [`ACK_WORDS`]) from the base of a pool of
/// `pool_bytes` bytes.
pub fn ack_offset(pool_bytes: u64, word: usize) -> u64 {
    signal_offset(pool_bytes, SIGNAL_SLOTS + word)
}

/// Bytes to allocate for a pool of `pool_bytes` and its signal area.
pub fn pool_allocation(pool_bytes: u64) -> u64 {
    signal_offset(pool_bytes, 0) + SIGNAL_BYTES
}

/// A stream of one device. Each device has one input stream (host→device and peer copies in),
/// one output stream (device→host), [`COMM_STREAMS`] streams for transfers between ranks, and
/// `exec` streams for kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// The input stream: host→device and peer copies in.
    In,
    /// The output stream: device→host.
    Out,
    /// Comm stream `k` (below [`COMM_STREAMS`]): transfers between ranks.
    Comm(usize),
    /// Exec stream `k`: kernels (0 is the high-priority one).
    Exec(usize),
}

impl Stream {
    /// Position among a device's streams: In, Out, the comm streams, then the exec streams.
    pub fn index(self) -> usize {
        match self {
            Stream::In => 0,
            Stream::Out => 1,
            Stream::Comm(k) => 2 + k,
            Stream::Exec(k) => 2 + COMM_STREAMS + k,
        }
    }

    /// Number of streams of a device with `exec` exec streams.
    pub fn count(exec: usize) -> usize {
        2 + COMM_STREAMS + exec
    }
}

/// One end of a device copy ([`Backend::copy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mem {
    /// Offset in the pool of the device the copy is enqueued on.
    Pool(u64),
    /// Host memory (pinned for an asynchronous copy at full rate).
    Host(*mut u8),
    /// Offset in another process's device pool, mapped once ([`Backend::ipc_open`]); the id is
    /// what `ipc_open` returned for the device the copy is enqueued on.
    Remote {
        /// The mapped pool's id.
        pool: usize,
        /// Offset in that pool.
        off: u64,
    },
}

// SAFETY: a plain address; whoever enqueues the copy keeps the memory alive (the Backend contract).
unsafe impl Send for Mem {}

/// Enqueues `ops` one [`Backend::copy`] at a time: a batch where the backend has no batch call.
///
/// # Errors
/// As [`Backend::copy`]; copies before the failing one stay enqueued.
///
/// # Safety
/// As [`Backend::copy_batch`].
pub unsafe fn copy_each<B: Backend + ?Sized>(
    b: &mut B,
    d: usize,
    s: Stream,
    ops: &[BatchCopy],
) -> Result<(), DeviceError> {
    for op in ops {
        b.copy(d, s, op.dst, op.src, op.len)?;
    }
    Ok(())
}

/// One copy of a [`Backend::copy_batch`]: `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy)]
pub struct BatchCopy {
    /// Where the bytes go.
    pub dst: Mem,
    /// Where they come from.
    pub src: Mem,
    /// Bytes.
    pub len: usize,
}

/// One tile as a body sees it: memory (host, or a device's) and shape. The same view serves a
/// CPU body on host memory and a launch on device memory (an emulated kernel *is* the CPU body).
#[derive(Debug, Clone)]
pub struct TileView {
    /// Address of the first element: host memory, or device memory (a device address as a
    /// pointer) for a CUDA launch.
    pub ptr: *mut u8,
    /// Bytes of the tile's memory.
    pub bytes: usize,
    /// Rows (row-major, `cols` elements per row).
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// How the body uses the tile.
    pub mode: AccessMode,
    /// The element type, checked when a body borrows the tile as a slice.
    pub elem: TypeId,
    /// The element type's name, for errors.
    pub elem_name: &'static str,
    /// Tile coordinates `(i, j)` in its collection.
    pub coords: (usize, usize),
}

// SAFETY: a view is a pointer into memory owned by a tile copy (host buffer or device block)
// that the task graph and the GPU manager keep alive and unaliased while a body uses it; it moves
// to the thread that runs the body (a worker or an emulated stream).
unsafe impl Send for TileView {}

/// The body of a CUDA kernel launch: enqueues its kernels on [`CudaTaskContext::stream`] and
/// returns without synchronising (the GPU manager records an event after it).
pub type CudaBody = dyn Fn(&CudaTaskContext<'_>) -> Result<(), TaskError> + Send + Sync;

/// What a [`Launch`] runs, as the layer above hands it down: the device layer knows kernels and
/// the tiles they touch, not tasks (the task runtime implements this for its task classes).
pub trait Kernel: Send + Sync {
    /// The name errors give (a task class's).
    fn name(&self) -> &str;

    /// Enqueues the CUDA body on `ctx`'s stream; `None` when the kernel has no CUDA body.
    ///
    /// # Errors
    /// What the body reports.
    fn run_cuda(&self, ctx: &CudaTaskContext<'_>) -> Option<Result<(), TaskError>>;

    /// Runs the host body on `tiles` (on an emulated device: the device copies, in host
    /// memory, standing in for the kernel); returns the body's error or panic as text.
    ///
    /// # Errors
    /// The body's error or panic, as text.
    fn run_emulated(&self, tiles: &[TileView], args: &[i64], seq: u64, rank: Rank) -> Result<(), String>;
}

/// Scalar arguments of a launch, inline up to 6 (no allocation for most kernels).
pub type LaunchArgs = smallvec::SmallVec<[i64; 6]>;

/// A kernel to run on an exec stream of one device, with its tiles in device memory.
pub struct Launch {
    /// What runs.
    pub kernel: Arc<dyn Kernel>,
    /// The tiles, at their device addresses, in the kernel's argument order.
    pub tiles: Vec<TileView>,
    /// Scalar arguments.
    pub args: LaunchArgs,
    /// Sequence number of the launch (the inserted task's), which asynchronous errors are
    /// reported by ([`Backend::take_launch_error`]).
    pub seq: u64,
    /// This process's rank, which the body sees.
    pub rank: Rank,
    /// The device, among this process's.
    pub device: usize,
}

/// How a pinnable host region goes back (unpin and free, on the backend's terms).
pub type Release = Box<dyn FnOnce(*mut u8) + Send + Sync>;

/// Pins `len` bytes at `addr` (a part of a region, page-aligned), on the backend's terms: the
/// first part on the calling thread, the others on a pinning thread, in offset order. An error
/// stops the pinning: the rest stays held back.
pub type Pin = Box<dyn FnMut(usize, usize) -> Result<(), String> + Send>;

/// A device backend: the operations the GPU manager needs, all asynchronous (enqueued on a
/// stream, completion observed through events). Called only from the GPU manager thread.
///
/// # Safety contract of the copy operations
/// Host pointers must stay valid, and device ranges allocated, until an event recorded after the
/// operation on the same stream has completed; the manager keeps the buffers alive that long.
pub trait Backend: Send + 'static {
    /// A completion marker recorded on a stream.
    type Event: Send + 'static;

    /// Number of devices.
    fn devices(&self) -> usize;
    /// Human-readable description of device `d`.
    fn describe(&self, d: usize) -> String;
    /// Short name of device `d` as `FERRY_DEVICES` spells it (`cuda:1`, `emu:0`): the prefix of
    /// its stream tracks in a trace.
    fn label(&self, d: usize) -> String;
    /// Bytes of device `d`'s pool.
    fn pool_bytes(&self, d: usize) -> u64;
    /// Number of exec streams per device.
    fn exec_streams(&self) -> usize;
    /// Whether device `a` can copy directly to or from device `b` (a peer link).
    fn peer_link(&self, a: usize, b: usize) -> bool;
    /// The PCI address (domain, bus, device) of device `d`, when it has one (for placing the
    /// threads that drive it near it).
    fn pci_address(&self, _d: usize) -> Option<(u32, u8, u8)> {
        None
    }
    /// The relative quality of the peer link from `a` to `b`, lower is faster (CUDA: the
    /// driver's `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`); `None` without a link.
    fn link_rank(&self, a: usize, b: usize) -> Option<u32> {
        self.peer_link(a, b).then_some(0)
    }

    /// Host → device copy into pool offset `dst`.
    ///
    /// # Safety
    /// See the trait documentation.
    unsafe fn h2d(&mut self, d: usize, s: Stream, dst: u64, src: *const u8, len: usize) -> Result<(), DeviceError>;
    /// Device → host copy from pool offset `src`.
    ///
    /// # Safety
    /// See the trait documentation.
    unsafe fn d2h(&mut self, d: usize, s: Stream, dst: *mut u8, src: u64, len: usize) -> Result<(), DeviceError>;
    /// Peer copy from `(src_dev, src)` into `(d, dst)`, enqueued on a stream of `d`.
    ///
    /// # Safety
    /// See the trait documentation.
    unsafe fn peer(
        &mut self,
        d: usize,
        s: Stream,
        dst: u64,
        src_dev: usize,
        src: u64,
        len: usize,
    ) -> Result<(), DeviceError>;
    /// A peer copy whose source is still being written by work that the stream `s` of `d`
    /// already waits for (a stage-in on `src_dev`): the same copy as [`Backend::peer`], for
    /// backends that check sources at issue time (the emulated one, under
    /// `FERRY_CHECK_COHERENCE`) to skip that check.
    ///
    /// # Safety
    /// As [`Backend::peer`], with the source's data in place once the awaited work has completed.
    unsafe fn peer_pending(
        &mut self,
        d: usize,
        s: Stream,
        dst: u64,
        src_dev: usize,
        src: u64,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.peer(d, s, dst, src_dev, src, len)
    }
    /// Device address of pool offset `off` on device `d` (what a kernel receives).
    fn addr(&self, d: usize, off: u64) -> u64;

    /// Records an event on a stream.
    fn record(&mut self, d: usize, s: Stream) -> Result<Self::Event, DeviceError>;
    /// Makes the events recorded from now on measurable by [`Backend::elapsed_us`] (CUDA:
    /// events created without `CU_EVENT_DISABLE_TIMING`, which cost more to record; the GPU
    /// timeline turns this on only while a trace is written).
    fn enable_timing(&mut self) {}
    /// Microseconds of device time from event `a` to event `b`, both recorded after
    /// [`Backend::enable_timing`] and both completed; `None` when the backend cannot time events.
    /// CUDA resolves about 0.5 µs, and reports the span as `f32` milliseconds: the caller keeps
    /// spans short (seconds) for microsecond precision.
    ///
    /// # Errors
    /// An event that was not recorded with timing, or has not completed.
    fn elapsed_us(&mut self, _a: &Self::Event, _b: &Self::Event) -> Result<Option<f64>, DeviceError> {
        Ok(None)
    }
    /// Blocks the calling thread until `e` has completed.
    ///
    /// # Errors
    /// The device failed.
    fn synchronize(&mut self, e: &Self::Event) -> Result<(), DeviceError>;
    /// Blocks until everything enqueued on stream `s` of device `d` has run (an error path's
    /// fence: what it enqueued must not still be writing into memory it is about to give back).
    ///
    /// # Errors
    /// The device failed.
    fn sync_stream(&mut self, d: usize, s: Stream) -> Result<(), DeviceError> {
        let e = self.record(d, s)?;
        self.synchronize(&e)
    }
    /// Whether an event has completed (never blocks).
    fn done(&mut self, e: &Self::Event) -> Result<bool, DeviceError>;
    /// Makes a stream of `d` wait for an event (of any device).
    fn wait(&mut self, d: usize, s: Stream, e: &Self::Event) -> Result<(), DeviceError>;
    /// Enqueues a task body on an exec stream. Errors the body reports later (emulated kernels
    /// run asynchronously) come back through [`Backend::take_launch_error`].
    fn launch(&mut self, s: Stream, launch: Launch) -> Result<(), DeviceError>;
    /// The error of an asynchronous body, reported after its event completed.
    fn take_launch_error(&mut self, d: usize, seq: u64) -> Option<String>;

    /// Copies `len` bytes from `src` to `dst` on stream `s` of device `d` (any combination of the
    /// device's pool, host memory and mapped remote pools).
    ///
    /// # Safety
    /// See the trait documentation; both ranges must be in bounds.
    unsafe fn copy(&mut self, d: usize, s: Stream, dst: Mem, src: Mem, len: usize) -> Result<(), DeviceError>;

    /// Enqueues several independent copies on stream `s` of device `d` at once (CUDA:
    /// `cuMemcpyBatchAsync`, one driver call instead of one per copy). The copies may run in any
    /// order and concurrently with each other; all of them run after the work already on `s`.
    /// The default enqueues them one by one.
    ///
    /// # Errors
    /// As [`Backend::copy`]; after an error some copies may have been enqueued, so the caller
    /// fails all of them.
    ///
    /// # Safety
    /// As [`Backend::copy`], for each copy; no two copies may overlap a destination.
    unsafe fn copy_batch(&mut self, d: usize, s: Stream, ops: &[BatchCopy]) -> Result<(), DeviceError> {
        copy_each(self, d, s, ops)
    }

    /// Enqueues `ops` as [`Backend::copy_batch`] does and, behind them, writes each
    /// `(word, value)` of `acks` (peers' acknowledgement words, [`Mem::Remote`]) as
    /// [`Backend::write_signal`] would — where the backend can do both in one operation (CUDA:
    /// the copy kernel, whose last block writes the words: one launch instead of a launch and a
    /// driver call per word). Returns `Ok(false)`, having enqueued nothing, where it cannot (the
    /// caller then copies and writes separately).
    ///
    /// # Errors
    /// As [`Backend::copy_batch`]; copies before a failing launch stay enqueued.
    ///
    /// # Safety
    /// As [`Backend::copy_batch`].
    unsafe fn copy_batch_acked(
        &mut self,
        _d: usize,
        _s: Stream,
        _ops: &[BatchCopy],
        _acks: &[(Mem, u64)],
    ) -> Result<bool, DeviceError> {
        Ok(false)
    }

    /// The longest device-to-device copy that [`Backend::copy_batch`] still runs concurrently
    /// with the rest of its batch, bytes: longer independent copies go alone, each on its own
    /// stream. The default suits copy engines, which run a batch's copies one after another
    /// (IPC 4 MiB × 8 in batches lost 8% on H200 against a stream each).
    fn batch_copy_max(&self) -> usize {
        1 << 20
    }

    /// Writes `value` into signal word `slot` of device `d` (at [`signal_offset`] past its pool)
    /// once the work already on stream `s` has completed, with a memory barrier so that what
    /// that work wrote is visible to any reader that sees the value (CUDA:
    /// `cuStreamWriteValue64`). The caller keeps each word's values increasing.
    ///
    /// # Errors
    /// `slot` out of range, or the driver refusing stream memory operations.
    fn signal(&mut self, d: usize, s: Stream, slot: usize, value: u64) -> Result<(), DeviceError> {
        if slot >= SIGNAL_SLOTS {
            return Err(DeviceError::Body(format!("signal word {slot} out of range")));
        }
        let at = Mem::Pool(signal_offset(self.pool_bytes(d), slot));
        self.write_signal(d, s, at, value)
    }

    /// Writes `value` into the 64-bit word at `at` — a word of this device's signal area
    /// ([`Mem::Pool`] past the pool) or of a peer's ([`Mem::Remote`]) — once the work already on
    /// stream `s` of device `d` has completed, with a memory barrier as [`Backend::signal`].
    ///
    /// # Errors
    /// An unmapped or misaligned address, or the driver refusing stream memory operations.
    fn write_signal(&mut self, d: usize, s: Stream, at: Mem, value: u64) -> Result<(), DeviceError>;

    /// Makes stream `s` of device `d` wait until the 64-bit word at `at` — a peer's signal word,
    /// [`Mem::Remote`] — holds at least `value` (CUDA: `cuStreamWaitValue64` with
    /// `CU_STREAM_WAIT_VALUE_GEQ`).
    ///
    /// # Errors
    /// An unmapped or out-of-range address, or the driver refusing stream memory operations.
    fn wait_signal(&mut self, d: usize, s: Stream, at: Mem, value: u64) -> Result<(), DeviceError>;

    /// A host-readable copy of the peer's signal word `at` ([`Mem::Remote`], mapped for device
    /// `d`): a word that always holds a value the device word has reached — written by the
    /// producer's stream right after the device word, with the same memory barrier — so that
    /// the GPU manager can see an offered tile complete with a load instead of making a stream
    /// wait for it. `None` where there is none (the peer published no mirror, or `at` is not a
    /// signal word); the caller then waits on the device ([`Backend::wait_signal`]).
    ///
    /// The pointer stays valid as long as the backend (the mapping is released in its drop).
    fn signal_mirror(&self, _d: usize, _at: Mem) -> Option<*const AtomicU64> {
        None
    }

    /// Whether the pool attached as `remote` ([`Backend::ipc_attach`]) came with a host mirror of its
    /// signal words that could not be mapped here (its offered pulls then cannot be held on the
    /// host, and those asking for a device acknowledgement fail).
    fn ipc_mirror_missing(&self, _remote: usize) -> bool {
        false
    }

    /// Whether device `d` publishes a host mirror of its signal words
    /// ([`Backend::signal_mirror_export`]), so that the node's other ranks can see its signals on
    /// the host ([`Backend::signal_mirror`]).
    fn publishes_signal_mirror(&self, _d: usize) -> bool {
        false
    }

    /// An opaque handle of device `d`'s host mirror of its signal words, made now if it is not
    /// yet, for the node's other ranks to map with the pool ([`Backend::ipc_attach`]); `None`
    /// where there is none (its pulls then wait on the device). The pool itself is mapped by
    /// whoever maps device memory between processes (the communication engine).
    fn signal_mirror_export(&self, d: usize) -> Option<Vec<u8>>;

    /// Attaches another process's pool of `pool_bytes`, mapped on device `d` at `base` with its
    /// signal area ([`pool_allocation`] bytes in all), and its signal mirror's handle if it
    /// published one;
    /// returns the id [`Mem::Remote`] names it by. The mapping belongs to whoever made it and
    /// must outlive every copy that names the id (the backend never closes it).
    ///
    /// # Errors
    /// A malformed mirror handle (a mirror that cannot be mapped only costs speed:
    /// [`Backend::ipc_mirror_missing`]).
    fn ipc_attach(&mut self, d: usize, base: u64, pool_bytes: u64, mirror: Option<&[u8]>)
        -> Result<usize, DeviceError>;

    /// Debugging aid (emulated devices): a hash of `len` bytes at pool offset `off` of `d`.
    fn debug_hash(&self, _d: usize, _off: u64, _len: usize) -> Option<u64> {
        None
    }

    /// Fault injection: whether the next pool allocation on `d` must fail (emulated devices).
    fn fail_alloc(&mut self, _d: usize) -> bool {
        false
    }
}
