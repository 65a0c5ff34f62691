//! Emulated GPUs: device memory is a host allocation of fixed capacity, each stream is a thread
//! that executes its operations in order, events are flags set when a stream reaches them, and a
//! kernel is the task class's CPU body run on the device copy.
//!
//! It exists so that CI, which has no GPU, walks every stage of the GPU task lifecycle —
//! allocation failure, eviction, staging, peer copies, asynchronous completion — with real data.
//! Deterministic fault injection: the k-th pool allocations fail (`FERRY_EMU_FAIL_ALLOC`), the
//! k-th single copies fail when enqueued (`FERRY_EMU_FAIL_COPY`), and every stream operation may
//! complete late by a pseudo-random delay (`FERRY_EMU_DELAY_US`). It is not evidence that the
//! CUDA backend works.

use super::{Backend, BatchCopy, DeviceError, Launch, Mem, Stream};
use crossbeam::channel::{self, Receiver, Sender};
use ferry_base::shm::SharedMem;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Completion flag of an emulated event, and when its stream passed it.
pub struct EmuEvent {
    done: AtomicBool,
    at: std::sync::OnceLock<Instant>,
    lock: Mutex<()>,
    cv: Condvar,
}

impl EmuEvent {
    fn new() -> Arc<EmuEvent> {
        Arc::new(EmuEvent {
            done: AtomicBool::new(false),
            at: std::sync::OnceLock::new(),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        })
    }
    fn set(&self) {
        let _ = self.at.set(Instant::now());
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
    }
    fn block(&self) {
        let mut g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        while !self.done.load(Ordering::Acquire) {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Raw copy arguments, moved to a stream thread.
struct RawCopy {
    dst: *mut u8,
    src: *const u8,
    len: usize,
    check: Option<u64>,
}
// SAFETY: the manager keeps both ranges alive and unaliased until the stream passes the
// operation (the Backend safety contract).
unsafe impl Send for RawCopy {}

/// A signal word in shared memory (this process's pool or a peer's mapping of its own).
struct Word(*const AtomicU64);
// SAFETY: the word lies in a mapping that outlives the streams (they are joined before it is
// unmapped), 8-byte aligned (signal areas start on a 256-byte boundary of a page-aligned map).
unsafe impl Send for Word {}

impl Word {
    fn get(&self) -> &AtomicU64 {
        // SAFETY: see the `Send` impl.
        unsafe { &*self.0 }
    }
}

enum Op {
    Copy(RawCopy),
    Launch(Launch),
    Record(Arc<EmuEvent>),
    Wait(Arc<EmuEvent>),
    /// Store a value (release: what the stream did before is visible to whoever sees it).
    Signal(Word, u64),
    /// Block the stream until the word holds at least the value.
    WaitSignal(Word, u64),
}

struct EmuStream {
    tx: Option<Sender<Op>>,
    thread: Option<JoinHandle<()>>,
}

/// Another process's emulated pool, mapped by someone else (the communication engine, through
/// `/proc/<pid>/fd/<fd>`) for local device `device`: its address here and its bytes.
struct RemoteMem {
    device: usize,
    base: usize,
    len: usize,
}

struct EmuDevice {
    /// Device memory: a shared mapping, so that other ranks of the node can map it too (the
    /// emulated counterpart of CUDA IPC) — page-aligned, zeroed.
    mem: Arc<SharedMem>,
    /// Counts `mem` as emulated device memory of this device while the backend lives, so the
    /// communication engine's emulated copier can register and export it.
    _adopted: crate::copier::EmulatedMemory,
    capacity: u64,
    streams: Vec<EmuStream>, // see Stream::index
}

type Errors = Arc<Mutex<HashMap<(usize, u64), String>>>;

/// A set of emulated devices of one rank.
pub struct EmuBackend {
    devices: Vec<EmuDevice>,
    remote: Vec<RemoteMem>,
    exec: usize,
    errors: Errors,
    /// Set when the backend is dropped: a stream blocked on a peer's signal word gives up (the
    /// peer may have failed), so shutdown after an error does not hang.
    closing: Arc<AtomicBool>,
    fail_alloc: Vec<u64>,
    allocs: u64,
    fail_copy: Vec<u64>,
    copies: u64,
    /// Completion queries answered (`Backend::done`): what the manager's polling costs on CUDA,
    /// where a query of a completed event takes 1.3–1.5 µs.
    pub queries: u64,
}

/// Settings of the emulated devices.
#[derive(Debug, Clone)]
pub struct EmuConfig {
    /// Devices of the rank.
    pub devices: usize,
    /// Bytes of each device's pool.
    pub capacity: u64,
    /// Exec streams per device.
    pub exec_streams: usize,
    /// 1-based indices of pool allocation attempts that fail.
    pub fail_alloc: Vec<u64>,
    /// 1-based indices of single copies whose enqueueing fails.
    pub fail_copy: Vec<u64>,
    /// Upper bound of the per-operation completion delay, µs (0: none).
    pub delay_us: u64,
    /// Seeds the delays (the rank, so ranks differ but runs repeat).
    pub seed: u64,
}

impl EmuBackend {
    /// Emulated devices as `cfg` says: a pool of shared memory per device (so that the node's
    /// other ranks can map it, as CUDA IPC would) and a thread per stream.
    ///
    /// # Errors
    /// The shared memory cannot be made.
    pub fn new(cfg: &EmuConfig) -> Result<EmuBackend, DeviceError> {
        let errors: Errors = Arc::default();
        let closing = Arc::new(AtomicBool::new(false));
        let mut devices = Vec::with_capacity(cfg.devices);
        for d in 0..cfg.devices {
            let mem =
                SharedMem::create(c"ferry-emu-pool", super::pool_allocation(cfg.capacity) as usize).map_err(|e| {
                    DeviceError::Cuda {
                        op: "emulated device pool",
                        msg: e.to_string(),
                    }
                })?;
            let mut streams = Vec::new();
            for k in 0..Stream::count(cfg.exec_streams) {
                let (tx, rx) = channel::unbounded();
                let errors = errors.clone();
                let closing = closing.clone();
                let seed = cfg.seed.wrapping_mul(0x9e37_79b9).wrapping_add((d * 64 + k) as u64);
                let delay = cfg.delay_us;
                let thread = std::thread::Builder::new()
                    .name(format!("ferry-emu{d}-s{k}"))
                    .spawn(move || stream_main(rx, errors, closing, seed, delay))
                    .map_err(|e| DeviceError::Cuda {
                        op: "emu stream",
                        msg: e.to_string(),
                    })?;
                streams.push(EmuStream {
                    tx: Some(tx),
                    thread: Some(thread),
                });
            }
            let mem = Arc::new(mem);
            devices.push(EmuDevice {
                _adopted: crate::copier::EmulatedMemory::adopt(d, mem.clone()),
                mem,
                capacity: cfg.capacity,
                streams,
            });
        }
        Ok(EmuBackend {
            devices,
            remote: Vec::new(),
            exec: cfg.exec_streams,
            errors,
            closing,
            fail_alloc: cfg.fail_alloc.clone(),
            allocs: 0,
            fail_copy: cfg.fail_copy.clone(),
            copies: 0,
            queries: 0,
        })
    }

    fn push(&self, d: usize, s: Stream, op: Op) -> Result<(), DeviceError> {
        let tx = self.devices[d].streams[s.index()]
            .tx
            .as_ref()
            .ok_or(DeviceError::Cuda {
                op: "emu stream",
                msg: "stream closed".into(),
            })?;
        tx.send(op).map_err(|_| DeviceError::Cuda {
            op: "emu stream",
            msg: "stream thread ended".into(),
        })
    }

    fn ptr(&self, d: usize, off: u64) -> *mut u8 {
        // SAFETY: offsets come from the pool, which stays inside the capacity.
        unsafe { self.devices[d].mem.base().add(off as usize) }
    }
}

/// Held by an emulated kernel that writes a part of a tile ([`ferry_base::AccessMode::ReadWritePart`]).
static PART_BODIES: Mutex<()> = Mutex::new(());

fn stream_main(rx: Receiver<Op>, errors: Errors, closing: Arc<AtomicBool>, mut seed: u64, delay_us: u64) {
    while let Ok(op) = rx.recv() {
        // Dropped with operations still queued (shutdown after an error): their buffers may be
        // gone already, so they are discarded, not run.
        if closing.load(Ordering::Relaxed) {
            continue;
        }
        if delay_us > 0 {
            seed = ferry_base::hash::mix(seed.wrapping_add(1));
            std::thread::sleep(Duration::from_micros(seed % delay_us.saturating_add(1)));
        }
        match op {
            // SAFETY: see RawCopy.
            Op::Copy(c) => unsafe {
                if let Some(h) = c.check {
                    let now = ferry_base::hash::bytes(std::slice::from_raw_parts(c.src, c.len));
                    if now != h {
                        tracing::error!(
                            "coherence: peer source changed between issue and execution ({} bytes)",
                            c.len
                        );
                    }
                }
                std::ptr::copy_nonoverlapping(c.src, c.dst, c.len)
            },
            Op::Launch(l) => {
                // Members of a group of part writers may be in flight together on two streams
                // (that is the point, on CUDA), but here each body gets `&mut` of the whole
                // tile: they take turns.
                let _turn = l
                    .tiles
                    .iter()
                    .any(|t| t.mode.is_part())
                    .then(|| PART_BODIES.lock().unwrap_or_else(|p| p.into_inner()));
                if let Err(msg) = l.kernel.run_emulated(&l.tiles, &l.args, l.seq, l.rank) {
                    errors
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert((l.device, l.seq), msg);
                }
            }
            Op::Record(e) => e.set(),
            Op::Wait(e) => e.block(),
            Op::Signal(w, v) => w.get().store(v, Ordering::Release),
            Op::WaitSignal(w, v) => {
                // Another process sets it: poll, backing off to 20 µs naps (a CI machine has
                // two cores for many stream threads).
                let mut spins = 0u32;
                while w.get().load(Ordering::Acquire) < v && !closing.load(Ordering::Relaxed) {
                    spins += 1;
                    if spins < 64 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(20));
                    }
                }
            }
        }
    }
}

impl EmuBackend {
    fn resolve(&self, d: usize, m: Mem, len: usize) -> Result<*mut u8, DeviceError> {
        match m {
            Mem::Pool(off) if off as usize + len <= self.devices[d].mem.len() => Ok(self.ptr(d, off)),
            Mem::Pool(off) => Err(DeviceError::Body(format!(
                "{len} bytes at {off} lie outside the pool of device {d}"
            ))),
            Mem::Host(p) => Ok(p),
            Mem::Remote { pool, off } => match self.remote.get(pool) {
                Some(r) if r.device == d && off as usize + len <= r.len => {
                    // The attacher vouches that `len` bytes at `base` stay mapped (`ipc_attach`);
                    // bounds checked just above.
                    Ok((r.base + off as usize) as *mut u8)
                }
                _ => Err(DeviceError::Body(format!(
                    "remote pool {pool} is not mapped for device {d}, or {len} bytes at {off} lie outside it"
                ))),
            },
        }
    }
}

impl Drop for EmuBackend {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Relaxed);
        for d in &mut self.devices {
            for s in &mut d.streams {
                s.tx.take();
            }
            for s in &mut d.streams {
                if let Some(t) = s.thread.take() {
                    let _ = t.join();
                }
            }
        }
    }
}

impl Backend for EmuBackend {
    type Event = Arc<EmuEvent>;

    fn devices(&self) -> usize {
        self.devices.len()
    }
    fn label(&self, d: usize) -> String {
        format!("emu:{d}")
    }
    fn describe(&self, d: usize) -> String {
        let c = self.devices[d].capacity;
        if c >= 1 << 20 {
            format!("emu{d} ({} MiB)", c >> 20)
        } else {
            format!("emu{d} ({} KiB)", c >> 10)
        }
    }
    fn pool_bytes(&self, d: usize) -> u64 {
        self.devices[d].capacity
    }
    fn exec_streams(&self) -> usize {
        self.exec
    }
    fn peer_link(&self, a: usize, b: usize) -> bool {
        a != b
    }
    unsafe fn h2d(&mut self, d: usize, s: Stream, dst: u64, src: *const u8, len: usize) -> Result<(), DeviceError> {
        self.push(
            d,
            s,
            Op::Copy(RawCopy {
                dst: self.ptr(d, dst),
                src,
                len,
                check: None,
            }),
        )
    }
    unsafe fn d2h(&mut self, d: usize, s: Stream, dst: *mut u8, src: u64, len: usize) -> Result<(), DeviceError> {
        self.push(
            d,
            s,
            Op::Copy(RawCopy {
                dst,
                src: self.ptr(d, src),
                len,
                check: None,
            }),
        )
    }
    unsafe fn peer(
        &mut self,
        d: usize,
        s: Stream,
        dst: u64,
        src_dev: usize,
        src: u64,
        len: usize,
    ) -> Result<(), DeviceError> {
        let srcp = self.ptr(src_dev, src);
        let check = ferry_base::debug::check_coherence()
            .then_some(())
            .map(|_| ferry_base::hash::bytes(std::slice::from_raw_parts(srcp, len)));
        self.push(
            d,
            s,
            Op::Copy(RawCopy {
                dst: self.ptr(d, dst),
                src: srcp,
                len,
                check,
            }),
        )
    }
    unsafe fn peer_pending(
        &mut self,
        d: usize,
        s: Stream,
        dst: u64,
        src_dev: usize,
        src: u64,
        len: usize,
    ) -> Result<(), DeviceError> {
        let op = Op::Copy(RawCopy {
            dst: self.ptr(d, dst),
            src: self.ptr(src_dev, src),
            len,
            check: None,
        });
        self.push(d, s, op)
    }
    fn addr(&self, d: usize, off: u64) -> u64 {
        self.ptr(d, off) as u64
    }
    unsafe fn copy(&mut self, d: usize, s: Stream, dst: Mem, src: Mem, len: usize) -> Result<(), DeviceError> {
        self.copies += 1;
        if self.fail_copy.contains(&self.copies) {
            return Err(DeviceError::Cuda {
                op: "emulated copy",
                msg: format!("injected failure of copy {} (FERRY_EMU_FAIL_COPY)", self.copies),
            });
        }
        let (dst, src) = (self.resolve(d, dst, len)?, self.resolve(d, src, len)?);
        self.push(
            d,
            s,
            Op::Copy(RawCopy {
                dst,
                src,
                len,
                check: None,
            }),
        )
    }
    fn write_signal(&mut self, d: usize, s: Stream, at: Mem, value: u64) -> Result<(), DeviceError> {
        let p = self.resolve(d, at, 8)?;
        if p as usize % 8 != 0 {
            return Err(DeviceError::Body("misaligned signal word".into()));
        }
        self.push(d, s, Op::Signal(Word(p as *const AtomicU64), value))
    }
    fn wait_signal(&mut self, d: usize, s: Stream, at: Mem, value: u64) -> Result<(), DeviceError> {
        let p = self.resolve(d, at, 8)?;
        if p as usize % 8 != 0 {
            return Err(DeviceError::Body("misaligned signal word".into()));
        }
        self.push(d, s, Op::WaitSignal(Word(p as *const AtomicU64), value))
    }
    unsafe fn copy_batch_acked(
        &mut self,
        d: usize,
        s: Stream,
        ops: &[BatchCopy],
        acks: &[(Mem, u64)],
    ) -> Result<bool, DeviceError> {
        // As the CUDA copy kernel does in one launch: the copies, then the words, in stream
        // order (so CI runs the manager's path where the backend writes them).
        // SAFETY: the caller's contract.
        unsafe { super::copy_each(self, d, s, ops)? };
        for &(at, value) in acks {
            self.write_signal(d, s, at, value)?;
        }
        Ok(true)
    }
    fn publishes_signal_mirror(&self, _d: usize) -> bool {
        true
    }
    fn signal_mirror(&self, d: usize, at: Mem) -> Option<*const AtomicU64> {
        // An emulated pool is host memory already: the word is its own mirror (its producer's
        // stream thread stores it with release order once the work before it has run).
        match at {
            Mem::Remote { .. } => self
                .resolve(d, at, 8)
                .ok()
                .filter(|p| *p as usize % 8 == 0)
                .map(|p| p as *const AtomicU64),
            _ => None,
        }
    }
    fn signal_mirror_export(&self, _d: usize) -> Option<Vec<u8>> {
        // An emulated pool is host memory: its signal words are their own mirror.
        None
    }
    fn ipc_attach(
        &mut self,
        d: usize,
        base: u64,
        pool_bytes: u64,
        _mirror: Option<&[u8]>,
    ) -> Result<usize, DeviceError> {
        if d >= self.devices.len() {
            return Err(DeviceError::Body(format!(
                "device {d} is not one of {}",
                self.devices.len()
            )));
        }
        self.remote.push(RemoteMem {
            device: d,
            base: base as usize,
            len: super::pool_allocation(pool_bytes) as usize,
        });
        Ok(self.remote.len() - 1)
    }
    fn record(&mut self, d: usize, s: Stream) -> Result<Self::Event, DeviceError> {
        let e = EmuEvent::new();
        self.push(d, s, Op::Record(e.clone()))?;
        Ok(e)
    }
    fn done(&mut self, e: &Self::Event) -> Result<bool, DeviceError> {
        self.queries += 1;
        Ok(e.done.load(Ordering::Acquire))
    }
    fn elapsed_us(&mut self, a: &Self::Event, b: &Self::Event) -> Result<Option<f64>, DeviceError> {
        match (a.at.get(), b.at.get()) {
            (Some(x), Some(y)) => Ok(Some(if y >= x {
                (*y - *x).as_secs_f64() * 1e6
            } else {
                -((*x - *y).as_secs_f64() * 1e6)
            })),
            _ => Err(DeviceError::Body(
                "elapsed time of an event that has not completed".into(),
            )),
        }
    }
    fn synchronize(&mut self, e: &Self::Event) -> Result<(), DeviceError> {
        e.block();
        Ok(())
    }
    fn wait(&mut self, d: usize, s: Stream, e: &Self::Event) -> Result<(), DeviceError> {
        self.push(d, s, Op::Wait(e.clone()))
    }
    fn launch(&mut self, s: Stream, launch: Launch) -> Result<(), DeviceError> {
        let d = launch.device;
        self.push(d, s, Op::Launch(launch))
    }
    fn debug_hash(&self, d: usize, off: u64, len: usize) -> Option<u64> {
        // SAFETY: debugging only; the range is inside the device memory.
        Some(ferry_base::hash::bytes(unsafe {
            std::slice::from_raw_parts(self.ptr(d, off), len)
        }))
    }
    fn take_launch_error(&mut self, d: usize, seq: u64) -> Option<String> {
        self.errors.lock().unwrap_or_else(|p| p.into_inner()).remove(&(d, seq))
    }
    fn fail_alloc(&mut self, _d: usize) -> bool {
        self.allocs += 1;
        self.fail_alloc.contains(&self.allocs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream waiting on a signal word (here its own pool's, mapped as a peer would map it)
    /// holds back what follows until another stream writes the value, and a smaller value does
    /// not release it.
    #[test]
    fn a_signal_wait_holds_the_stream_until_the_value() {
        let cfg = EmuConfig {
            devices: 1,
            capacity: 4096,
            exec_streams: 1,
            fail_alloc: Vec::new(),
            fail_copy: Vec::new(),
            delay_us: 0,
            seed: 1,
        };
        let mut b = EmuBackend::new(&cfg).unwrap();
        // Its own pool, attached as a peer's would be.
        let peer = b.ipc_attach(0, b.addr(0, 0), 4096, None).unwrap();
        let word = Mem::Remote {
            pool: peer,
            off: crate::signal_offset(4096, 3),
        };
        let mut out = [0u8; 4];
        b.wait_signal(0, Stream::Comm(0), word, 2).unwrap();
        // SAFETY: `out` outlives the synchronisation below.
        unsafe { b.copy(0, Stream::Comm(0), Mem::Host(out.as_mut_ptr()), Mem::Pool(0), 4) }.unwrap();
        let copied = b.record(0, Stream::Comm(0)).unwrap();
        let data = [7u8, 8, 9, 10];
        // SAFETY: `data` outlives the synchronisation below.
        unsafe { b.h2d(0, Stream::In, 0, data.as_ptr(), 4) }.unwrap();
        b.signal(0, Stream::In, 3, 1).unwrap();
        let first = b.record(0, Stream::In).unwrap();
        b.synchronize(&first).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(!b.done(&copied).unwrap(), "value 1 must not release a wait for 2");
        b.signal(0, Stream::In, 3, 2).unwrap();
        b.synchronize(&copied).unwrap();
        assert_eq!(out, data);
        assert!(b.signal(0, Stream::In, crate::SIGNAL_SLOTS, 1).is_err());
        let outside = Mem::Remote {
            pool: peer,
            off: crate::pool_allocation(4096),
        };
        assert!(b.wait_signal(0, Stream::Comm(1), outside, 1).is_err());
    }
}
