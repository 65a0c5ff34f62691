//! Devices: the abstraction over CUDA and emulated GPUs, their memory pools, and the GPU manager
//! thread that walks GPU tasks through their lifecycle.
//!
//! This layer knows streams, events, pools and kernels; it knows neither ranks nor MPI. The
//! graph layer hands it ready GPU tasks and staging requests; it hands back completions.

pub(crate) mod cuda;
pub(crate) mod emu;
pub(crate) mod manager;
pub(crate) mod pool;
mod signal_mirror;
mod sm_copy;
mod spec;

pub use spec::DeviceSpec;

use crate::error::Rank;
use crate::graph::TaskClass;
use std::sync::atomic::AtomicU64;

/// Streams per device reserved for transfers between ranks (staged chunks, IPC pulls), so that
/// several transfers overlap (ANCHORS.md: IPC copies reach 318 GB/s at 4 MiB with 8 in flight on
/// 4 streams, far less on one).
pub(crate) const COMM_STREAMS: usize = 4;

/// Signal words per device: 64-bit counters past the end of each device pool, in the same
/// allocation (so the IPC mapping that peers make of the pool covers them too). Word `k` counts
/// the offers made after tasks launched on exec stream `k` (see [`Backend::signal`]).
pub(crate) const SIGNAL_SLOTS: usize = 32;

/// Acknowledgement words per device, after the signal words in the same area: a consumer's
/// comm stream writes one after its IPC pull of a block of this device's pool, and the tasks
/// that overwrite the block wait for it on the device (`transfer/ack.rs`).
pub(crate) const ACK_WORDS: usize = 1024;

/// Bytes of the signal area that follows each pool: the signal words, then the acknowledgement
/// words.
pub(crate) const SIGNAL_BYTES: u64 = ((SIGNAL_SLOTS + ACK_WORDS) * 8) as u64;

/// Offset of signal word `slot` from the base of a pool of `pool_bytes` bytes: the area starts at
/// the first 256-byte boundary past the pool, so a peer computes it from the pool size it was
/// told at start-up.
pub(crate) fn signal_offset(pool_bytes: u64, slot: usize) -> u64 {
    pool_bytes.next_multiple_of(256) + 8 * slot as u64
}

/// Offset of acknowledgement word `word` (below [`ACK_WORDS`]) from the base of a pool of
/// `pool_bytes` bytes.
pub(crate) fn ack_offset(pool_bytes: u64, word: usize) -> u64 {
    signal_offset(pool_bytes, SIGNAL_SLOTS + word)
}

/// Bytes to allocate for a pool of `pool_bytes` and its signal area.
pub(crate) fn pool_allocation(pool_bytes: u64) -> u64 {
    signal_offset(pool_bytes, 0) + SIGNAL_BYTES
}

/// A stream of one device. Each device has one input stream (host→device and peer copies in),
/// one output stream (device→host), [`COMM_STREAMS`] streams for transfers between ranks, and
/// `exec` streams for kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Stream {
    In,
    Out,
    Comm(usize),
    Exec(usize),
}

impl Stream {
    /// Position among a device's streams: In, Out, the comm streams, then the exec streams.
    pub(crate) fn index(self) -> usize {
        match self {
            Stream::In => 0,
            Stream::Out => 1,
            Stream::Comm(k) => 2 + k,
            Stream::Exec(k) => 2 + COMM_STREAMS + k,
        }
    }

    /// Number of streams of a device with `exec` exec streams.
    pub(crate) fn count(exec: usize) -> usize {
        2 + COMM_STREAMS + exec
    }
}

/// One end of a device copy ([`Backend::copy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mem {
    /// Offset in the pool of the device the copy is enqueued on.
    Pool(u64),
    /// Host memory (pinned for an asynchronous copy at full rate).
    Host(*mut u8),
    /// Offset in another process's device pool, mapped once ([`Backend::ipc_open`]); the id is
    /// what `ipc_open` returned for the device the copy is enqueued on.
    Remote { pool: usize, off: u64 },
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
pub(crate) unsafe fn copy_each<B: Backend + ?Sized>(
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
pub(crate) struct BatchCopy {
    pub(crate) dst: Mem,
    pub(crate) src: Mem,
    pub(crate) len: usize,
}

/// Errors of the device layer, turned into [`crate::FerryError::Device`] at the border.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// No CUDA driver library could be loaded.
    #[error("no CUDA driver: libcuda could not be loaded (use --devices none or emu:K)")]
    NoDriver,
    /// The driver loaded but reports no GPU.
    #[error("the CUDA driver reports no GPU")]
    NoDevices,
    /// A CUDA call failed.
    #[error("CUDA error in {op}: {msg}")]
    Cuda {
        /// The operation.
        op: &'static str,
        /// The driver's message.
        msg: String,
    },
    /// A task cannot fit on a device even when it is empty.
    #[error("task `{class}` needs {need} bytes of device memory, but device {device} holds only {capacity}")]
    TooLarge {
        /// Task class.
        class: String,
        /// Bytes of all its tiles.
        need: u64,
        /// The device.
        device: usize,
        /// Pool capacity.
        capacity: u64,
    },
    /// A GPU body reported an error.
    #[error("GPU body failed: {0}")]
    Body(String),
}

/// One tile of a launch: its device address (`ptr`) and shape — the same view a CPU body gets
/// of host memory (an emulated kernel *is* the CPU body).
pub(crate) use crate::graph::task::TileView as LaunchTile;

/// A GPU task body to run on a stream.
pub(crate) struct Launch {
    pub(crate) class: TaskClass,
    pub(crate) tiles: Vec<LaunchTile>,
    pub(crate) args: crate::graph::task::TaskArgs,
    pub(crate) seq: u64,
    pub(crate) rank: Rank,
    pub(crate) device: usize,
}

/// A device backend: the operations the GPU manager needs, all asynchronous (enqueued on a
/// stream, completion observed through events). Called only from the GPU manager thread.
///
/// # Safety contract of the copy operations
/// Host pointers must stay valid, and device ranges allocated, until an event recorded after the
/// operation on the same stream has completed; the manager keeps the buffers alive that long.
pub(crate) trait Backend: Send + 'static {
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

    /// Whether the pool mapped as `remote` ([`Backend::ipc_open`]) came with a host mirror of its
    /// signal words that could not be mapped here (its offered pulls then cannot be held on the
    /// host, and those asking for a device acknowledgement fail).
    fn ipc_mirror_missing(&self, _remote: usize) -> bool {
        false
    }

    /// Whether device `d` publishes a host mirror of its signal words with its pool
    /// ([`Backend::ipc_export`]), so that the node's other ranks can see its signals on the host
    /// ([`Backend::signal_mirror`]).
    fn publishes_signal_mirror(&self, _d: usize) -> bool {
        false
    }

    /// An opaque handle that lets another process of the node map device `d`'s pool
    /// ([`Backend::ipc_open`]), or `None` when the backend cannot export it.
    fn ipc_export(&self, d: usize) -> Option<Vec<u8>>;

    /// Maps another process's pool from its [`Backend::ipc_export`] handle for copies enqueued on
    /// device `d`; returns the id [`Mem::Remote`] names it by. Costly (≈10 ms for CUDA): once per
    /// peer pool, at start-up.
    ///
    /// # Errors
    /// A malformed handle, or the driver or kernel refusing the mapping.
    fn ipc_open(&mut self, d: usize, handle: &[u8]) -> Result<usize, DeviceError>;

    /// Debugging aid (emulated devices): a hash of `len` bytes at pool offset `off` of `d`.
    fn debug_hash(&self, _d: usize, _off: u64, _len: usize) -> Option<u64> {
        None
    }

    /// Fault injection: whether the next pool allocation on `d` must fail (emulated devices).
    fn fail_alloc(&mut self, _d: usize) -> bool {
        false
    }
}
