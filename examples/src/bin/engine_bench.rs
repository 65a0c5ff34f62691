//! OSU-style benchmark of the communication engine (`ferry-engine`) against raw MPI in the
//! same run, on exactly 2 ranks.
//!
//! | measurement | engine | anchor (raw MPI, the same process and communicator's group) |
//! |---|---|---|
//! | active-message round trip | rank 0 sends, rank 1's handler answers on its progress thread | `MPI_Send`/`MPI_Recv` ping-pong of the same size between the main threads |
//! | message round trip | two-sided `send_message` / `recv_message` (eager, data lane: the task runtime's path for tiles); rank 1 answers from its receive's completion | the same ping-pong |
//! | get, W in flight | rank 0 gets W × S bytes from rank 1's registered memory and waits for the W completions | osu_bw: rank 1 posts W `MPI_Isend`s, rank 0 W `MPI_Irecv`s, `MPI_Waitall`, a 4-byte acknowledgement back |
//! | put, W in flight | rank 0 puts W × S bytes into rank 1's memory and waits for the W completions (data in place) | the same osu_bw pattern, rank 0 to rank 1 |
//!
//! Every repetition runs each measurement once, interleaved, and the table reports medians. For
//! W = 1 the time per operation is the latency (a get and an osu_bw step are both one round trip:
//! request and data, or data and acknowledgement). As in OSU's benchmarks, the W operations of a
//! step share one buffer. MPI is initialised here with `MPI_THREAD_MULTIPLE` (the engine's
//! caller-initialised mode); both sides therefore pay the same thread-safety costs of the library.
//!
//! `mpirun -np 2 engine-bench [--reps 5] [--max-size 256MiB] [--json FILE]`

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use ferry_engine::{
    Bytes, CallerComm, Done, Engine, EngineConfig, EngineHandle, Lane, MemHandle, MemKind, Message, Progress,
    TrafficPath, MEM_HANDLE_BYTES,
};
use mpi::ffi;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use serde::Serialize;
use std::os::raw::{c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Active messages, put and get of ferry's engine against raw MPI (2 ranks)")]
struct Args {
    /// Interleaved repetitions of every measurement (medians are reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Smallest message, bytes.
    #[arg(long, default_value_t = 8)]
    min_size: usize,
    /// Largest message, bytes (sizes go up by 4×, and the largest is included).
    #[arg(long, default_value_t = 256 << 20)]
    max_size: usize,
    /// Operations in flight per step (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    windows: Vec<usize>,
    /// Bytes moved per measurement and size at most (fewer steps for large sizes), MiB.
    #[arg(long, default_value_t = 256)]
    volume_mib: usize,
    /// Who drives the engine's progress: its own thread, or the benchmark's main thread
    /// (polling `progress` while it waits, as the raw MPI anchor polls MPI).
    #[arg(long, value_enum, default_value = "thread")]
    progress: ProgressArg,
    /// Where the buffers are: host memory, or device memory (the engine's device route; the
    /// anchor hands device pointers to MPI, which must then be CUDA-aware).
    #[arg(long, value_enum, default_value = "host")]
    memory: Memory,
    /// The route (an override for benchmarks): `auto` (the engine's choice); for host memory
    /// `cma` (single copies through Cross Memory Attach, required) or `host-mpi` (MPI only);
    /// for device memory `ipc` (peer copies on one node, leasing the target's registration),
    /// `ipc-grant` (peer copies, each granted by the target first), `gpu-direct` (to MPI,
    /// forced), `staged` (bounce buffers).
    #[arg(long, default_value = "auto")]
    route: String,
    /// Whether the engine's progress thread yields its core when idle (`on`, `off`; default:
    /// the engine decides from the cores per rank).
    #[arg(long)]
    yield_when_idle: Option<Switch>,
    /// With `--memory device`: also placed gets (`get_placed` into new memory on this rank's
    /// device, dropped after each step) against plain gets into a registered buffer.
    #[arg(long)]
    placed: bool,
    /// The engine's placement arena per device, MiB (0: each placed get allocates its own).
    #[arg(long, default_value_t = 256)]
    placement_arena_mib: usize,
    /// Send every active message over MPI instead of through the node's shared-memory rings
    /// (`EngineConfig::am_rings` false): the comparison for what the rings save.
    #[arg(long)]
    no_rings: bool,
    /// The longest active message through the rings, bytes (`EngineConfig::am_ring_max_bytes`;
    /// longer ones go over MPI): 1080 keeps them in ring slots only, with no byte rings.
    #[arg(long, default_value_t = ferry_engine::AM_RING_MAX_BYTES)]
    am_ring_max: usize,
    /// Write a results record (docs/records format) here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The machine, for the record.
    #[arg(long, default_value = "2-core CI-class VM")]
    machine: String,
    /// The commit that was built, for the record.
    #[arg(long, default_value = "0000000")]
    commit: String,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ProgressArg {
    Thread,
    Caller,
    /// The engine's thread as a backstop; the benchmark's main thread drives while it waits.
    Shared,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Memory {
    Host,
    Device,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Switch {
    On,
    Off,
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("engine-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A measurement's figure per repetition: seconds per step.
#[derive(Default, Clone)]
struct Samples(Vec<f64>);

impl Samples {
    fn median(&self) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    fn range(&self) -> [f64; 2] {
        let lo = self.0.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = self.0.iter().copied().fold(0.0, f64::max);
        [lo, hi]
    }
}

/// Until `c` reaches `n`: progresses the engine (when the caller drives it), else spins, then
/// yields.
/// Idle polls of `wait_for` before it yields its core between polls (set from `--progress`).
static SPINS_BEFORE_YIELD: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(200);

fn wait_for(e: &Engine, c: &AtomicUsize, n: usize) {
    // Driving progress, as MPI_Recv waits in the anchor: polling, giving the core up only
    // after a long quiet spell. With the engine's own thread progressing, polling here only
    // takes the core from it where cores are few: give it up soon.
    let limit = SPINS_BEFORE_YIELD.load(Relaxed);
    let mut spins = 0u32;
    while c.load(Acquire) < n {
        if e.progress() > 0 {
            spins = 0;
            continue;
        }
        if spins < limit {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s < max {
        v.push(s);
        s *= 4;
    }
    v.push(max);
    v
}

/// Steps of a measurement of `bytes` per step: `volume` bytes in all, between 5 and 2000.
fn steps(bytes: usize, volume: usize) -> usize {
    (volume / bytes.max(1)).clamp(5, 2000)
}

struct Bench<'a> {
    e: &'a Engine,
    raw: SimpleCommunicator,
    rank: i32,
    /// The buffers (host, or device memory the anchor hands to a CUDA-aware MPI).
    src: *mut u8,
    dst: *mut u8,
    src_h: MemHandle,
    dst_h: MemHandle,
    peer_src: MemHandle,
    peer_dst: MemHandle,
    done: Arc<AtomicUsize>,
}

impl Bench<'_> {
    /// Engine: rank 0 runs `steps` steps of `w` gets (or puts) of `s` bytes; seconds per step.
    fn one_sided(&self, put: bool, s: usize, w: usize, steps: usize) -> Result<f64> {
        self.e.barrier()?;
        let mut t = 0.0;
        if self.rank == 0 {
            self.done.store(0, Release);
            let t0 = Instant::now();
            for k in 0..steps {
                for _ in 0..w {
                    let d = self.done.clone();
                    let cb = move |r: ferry_engine::Result<()>| {
                        if let Err(e) = r {
                            eprintln!("engine-bench: operation failed: {e}");
                            std::process::exit(1);
                        }
                        d.fetch_add(1, Release);
                    };
                    if put {
                        self.e.put(&self.src_h, 0, &self.peer_dst, 0, s, None, cb)?;
                    } else {
                        self.e.get(&self.dst_h, 0, &self.peer_src, 0, s, None, cb)?;
                    }
                }
                wait_for(self.e, &self.done, (k + 1) * w);
            }
            t = t0.elapsed().as_secs_f64() / steps as f64;
        }
        self.e.barrier()?;
        Ok(t)
    }

    /// Engine: rank 0 runs `steps` steps of `w` placed gets of `s` bytes into new memory on
    /// `device`, dropping the placements at the end of each step (the memory goes back);
    /// seconds per step.
    fn placed(&self, device: usize, s: usize, w: usize, steps: usize) -> Result<f64> {
        self.e.barrier()?;
        let mut t = 0.0;
        if self.rank == 0 {
            let held = Arc::new(std::sync::Mutex::new(Vec::with_capacity(w)));
            self.done.store(0, Release);
            let t0 = Instant::now();
            for k in 0..steps {
                for _ in 0..w {
                    let (d, held) = (self.done.clone(), held.clone());
                    self.e
                        .get_placed(device, &self.peer_src, 0, s, None, move |r| match r {
                            Ok(p) => {
                                held.lock().unwrap_or_else(|e| e.into_inner()).push(p);
                                d.fetch_add(1, Release);
                            }
                            Err(e) => {
                                eprintln!("engine-bench: placed get failed: {e}");
                                std::process::exit(1);
                            }
                        })?;
                }
                wait_for(self.e, &self.done, (k + 1) * w);
                held.lock().unwrap_or_else(|e| e.into_inner()).clear();
            }
            t = t0.elapsed().as_secs_f64() / steps as f64;
        }
        self.e.barrier()?;
        Ok(t)
    }

    /// Raw MPI, osu_bw: `steps` steps of `w` messages of `s` bytes from `from` to the other
    /// rank and a 4-byte acknowledgement back; seconds per step (on rank 0).
    fn mpi_bw(&mut self, from: i32, s: usize, w: usize, steps: usize) -> Result<f64> {
        self.raw.barrier();
        let peer = 1 - self.rank;
        let comm = self.raw.as_raw();
        let mut reqs = vec![unsafe { ffi::RSMPI_REQUEST_NULL }; w];
        let mut ack = [0u8; 4];
        let t0 = Instant::now();
        for _ in 0..steps {
            for r in reqs.iter_mut() {
                // SAFETY: the buffers outlive the requests, completed by MPI_Waitall below.
                let rc = unsafe {
                    if self.rank == from {
                        ffi::MPI_Isend(
                            self.src as *const c_void,
                            s as c_int,
                            ffi::RSMPI_UINT8_T,
                            peer,
                            1,
                            comm,
                            r,
                        )
                    } else {
                        ffi::MPI_Irecv(
                            self.dst as *mut c_void,
                            s as c_int,
                            ffi::RSMPI_UINT8_T,
                            peer,
                            1,
                            comm,
                            r,
                        )
                    }
                };
                ensure!(rc == 0, "MPI_Isend/Irecv failed ({rc})");
            }
            // SAFETY: `reqs` holds w valid requests.
            let rc = unsafe { ffi::MPI_Waitall(w as c_int, reqs.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) };
            ensure!(rc == 0, "MPI_Waitall failed ({rc})");
            if self.rank == from {
                self.raw.process_at_rank(peer).receive_into(&mut ack[..]);
            } else {
                self.raw.process_at_rank(peer).send(&ack[..]);
            }
        }
        let t = t0.elapsed().as_secs_f64() / steps as f64;
        self.raw.barrier();
        Ok(t)
    }

    /// Engine: active-message round trips of `s` bytes; seconds per round trip.
    fn am_round_trip(&self, s: usize, steps: usize) -> Result<f64> {
        self.e.barrier()?;
        let payload = vec![7u8; s];
        let mut t = 0.0;
        if self.rank == 0 {
            self.done.store(0, Release);
            let t0 = Instant::now();
            for k in 0..steps {
                self.e.send_am(1, 1, &payload)?;
                wait_for(self.e, &self.done, k + 1);
            }
            t = t0.elapsed().as_secs_f64() / steps as f64;
        }
        self.e.barrier()?;
        Ok(t)
    }

    /// Engine: two-sided message round trips of `s` bytes (`recv_message` / `send_message`,
    /// eager: the path the task runtime's tiles take between ranks); rank 1 answers each message
    /// from its receive's completion, inside the pass that completed it; seconds per round trip.
    fn message_round_trip(&self, s: usize, steps: usize) -> Result<f64> {
        let h = self.e.handle();
        let peer = 1 - self.rank;
        let bufs = (Bytes::new(vec![7u8; s]), Bytes::new(vec![0u8; s]));
        let got = Arc::new(AtomicUsize::new(0));
        self.e.barrier()?;
        let mut t = 0.0;
        if self.rank == 1 {
            Answer {
                h,
                peer,
                bufs,
                got: got.clone(),
                left: steps,
            }
            .post()?;
            wait_for(self.e, &got, steps);
        } else {
            let t0 = Instant::now();
            for k in 0..steps {
                let g = got.clone();
                h.recv_message(message(
                    bufs.1.clone(),
                    peer,
                    done_then(move || _ = g.fetch_add(1, Release)),
                ))?;
                h.send_message(message(bufs.0.clone(), peer, done_then(|| ())))?;
                wait_for(self.e, &got, k + 1);
            }
            t = t0.elapsed().as_secs_f64() / steps as f64;
        }
        self.e.barrier()?;
        Ok(t)
    }

    /// Raw MPI ping-pong of `s` bytes between the main threads; seconds per round trip.
    fn mpi_ping_pong(&mut self, s: usize, steps: usize) -> Result<f64> {
        self.raw.barrier();
        let peer = self.raw.process_at_rank(1 - self.rank);
        let t0 = Instant::now();
        for _ in 0..steps {
            // SAFETY: host buffers of at least `s` bytes (active messages run on host memory).
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(self.src as *const u8, s),
                    std::slice::from_raw_parts_mut(self.dst, s),
                )
            };
            if self.rank == 0 {
                peer.send(src);
                peer.receive_into(dst);
            } else {
                peer.receive_into(dst);
                peer.send(src);
            }
        }
        let t = t0.elapsed().as_secs_f64() / steps as f64;
        self.raw.barrier();
        Ok(t)
    }
}

#[derive(Serialize)]
struct Record {
    workload: String,
    machine: String,
    command: String,
    commit: String,
    date: String,
    results: Vec<Row>,
}

#[derive(Serialize)]
struct Row {
    metric: String,
    unit: String,
    better: String,
    figure: f64,
    range: [f64; 2],
    anchor: Anchor,
    notes: String,
}

#[derive(Serialize)]
struct Anchor {
    name: String,
    figure: f64,
    range: [f64; 2],
}

/// A two-sided message of [`Bench::message_round_trip`] (tag 9, data lane, eager).
fn message(region: Arc<Bytes>, peer: i32, done: Done) -> Message {
    Message {
        region,
        peer,
        tag: 9,
        lane: Lane::Data,
        path: TrafficPath::HostEager,
        counts: true,
        eager: true,
        done,
    }
}

/// A message's completion: ends the benchmark on an error, else runs `then`.
fn done_then(then: impl FnOnce() + Send + 'static) -> Done {
    Box::new(move |r| {
        if let Err(e) = r {
            eprintln!("engine-bench: message failed: {e}");
            std::process::exit(1);
        }
        then();
    })
}

/// Rank 1's side of [`Bench::message_round_trip`]: a posted receive whose completion sends the
/// answer and posts the next receive, `left` times.
struct Answer {
    h: EngineHandle,
    peer: i32,
    /// (send, receive) buffers.
    bufs: (Arc<Bytes>, Arc<Bytes>),
    got: Arc<AtomicUsize>,
    left: usize,
}

impl Answer {
    fn post(self) -> Result<()> {
        if self.left == 0 {
            return Ok(());
        }
        let (h, recv) = (self.h.clone(), self.bufs.1.clone());
        let peer = self.peer;
        h.recv_message(message(
            recv,
            peer,
            done_then(move || {
                self.got.fetch_add(1, Release);
                let sent = self
                    .h
                    .send_message(message(self.bufs.0.clone(), peer, done_then(|| ())));
                let next = Answer {
                    left: self.left - 1,
                    ..self
                };
                if let Err(e) = sent.map_err(anyhow::Error::from).and_then(|_| next.post()) {
                    eprintln!("engine-bench: answer failed: {e}");
                    std::process::exit(1);
                }
            }),
        ))?;
        Ok(())
    }
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    ensure!(args.reps > 0, "--reps must be at least 1");
    ensure!(
        args.min_size > 0 && args.min_size <= args.max_size,
        "--min-size must be in 1..=--max-size"
    );
    ensure!(args.windows.iter().all(|&w| w > 0), "--windows must be positive");
    ensure!(args.max_size <= i32::MAX as usize, "--max-size over an MPI count");
    let (universe, threading) =
        mpi::initialize_with_threading(mpi::Threading::Multiple).context("MPI could not be initialised")?;
    if threading != mpi::Threading::Multiple {
        bail!("the MPI library provides {threading:?}; the engine beside raw MPI needs Multiple");
    }
    let world = universe.world();
    ensure!(
        world.size() == 2,
        "run on exactly 2 ranks (mpirun -np 2), not {}",
        world.size()
    );
    let raw = world.duplicate();
    if matches!(args.progress, ProgressArg::Caller | ProgressArg::Shared) {
        SPINS_BEFORE_YIELD.store(20_000, Relaxed);
    }
    let e = Engine::start(EngineConfig {
        communicator: Some(CallerComm(world.as_raw())),
        yield_when_idle: args.yield_when_idle.map(|s| matches!(s, Switch::On)),
        devices: match args.memory {
            Memory::Host => ferry_engine::Devices::None,
            Memory::Device => ferry_engine::Devices::Auto,
        },
        gpu_direct: match args.route.as_str() {
            "auto" | "ipc" | "ipc-grant" | "cma" | "host-mpi" => ferry_engine::GpuDirect::Auto,
            "gpu-direct" => ferry_engine::GpuDirect::Force,
            "staged" => ferry_engine::GpuDirect::Off,
            r => bail!("--route {r}: expected auto, cma, host-mpi, ipc, ipc-grant, gpu-direct or staged"),
        },
        cma: args.route != "host-mpi",
        ipc: matches!(args.route.as_str(), "auto" | "ipc" | "ipc-grant"),
        ipc_leases: args.route != "ipc-grant",
        placement_arena: args.placement_arena_mib << 20,
        am_rings: !args.no_rings,
        am_ring_max_bytes: args.am_ring_max,
        progress: match args.progress {
            ProgressArg::Thread => Progress::Thread,
            ProgressArg::Caller => Progress::Caller,
            ProgressArg::Shared => Progress::Shared,
        },
        ..Default::default()
    })?;
    let rank = e.rank();
    let single_copy = e.peer(1 - rank)?.routes.contains(&ferry_engine::Route::Cma);
    ensure!(
        args.route != "cma" || single_copy,
        "--route cma: no single copies with the peer (see the engine's log: the probe failed)"
    );
    // The buffers: host memory, or device memory of this rank's device.
    let mut host = (vec![1u8; args.max_size], vec![0u8; args.max_size]);
    let mut device_bufs = None;
    let (src, dst, kind) = match args.memory {
        Memory::Host => (host.0.as_mut_ptr(), host.1.as_mut_ptr(), MemKind::Host),
        Memory::Device => {
            let n = e.capabilities().devices;
            ensure!(n > 0, "--memory device: this rank has no devices");
            let dev = rank as usize % n;
            let (a, b) = (e.alloc_device(dev, args.max_size)?, e.alloc_device(dev, args.max_size)?);
            // SAFETY: fresh device buffers of max_size bytes.
            unsafe { e.device_write(dev, a.ptr(), &host.0)? };
            let p = (a.ptr() as *mut u8, b.ptr() as *mut u8);
            device_bufs = Some((a, b));
            (p.0, p.1, MemKind::Device(dev as u32))
        }
    };
    // SAFETY: both buffers outlive the engine's use of them (unregistered before they drop);
    // the benchmark does not read what the transfers write.
    let (src_h, dst_h) = unsafe {
        (
            e.register(src, args.max_size, kind)?,
            e.register(dst, args.max_size, kind)?,
        )
    };
    let mine: Vec<u8> = [src_h, dst_h].iter().flat_map(|h| h.to_bytes()).collect();
    let all = e.allgather(&mine)?;
    let theirs = &all[1 - rank as usize];
    let peer_src = e.mem_handle(&theirs[..MEM_HANDLE_BYTES])?;
    let peer_dst = e.mem_handle(&theirs[MEM_HANDLE_BYTES..])?;
    let done = Arc::new(AtomicUsize::new(0));
    // Rank 1 answers each active message from its handler; rank 0 counts the answers.
    let h: EngineHandle = e.handle();
    let d = done.clone();
    e.register_handler(1, move |m| {
        if let Err(err) = h.send_am(2, m.source, &m.bytes) {
            eprintln!("engine-bench: answer failed: {err}");
        }
    })?;
    e.register_handler(2, move |_| {
        d.fetch_add(1, Release);
    })?;
    let mut b = Bench {
        e: &e,
        raw,
        rank,
        src,
        dst,
        src_h,
        dst_h,
        peer_src,
        peer_dst,
        done,
    };
    let volume = args.volume_mib << 20;
    let mut rows = Vec::new();
    let mut print =
        |rank: i32, metric: String, unit: &str, better: &str, f: &Samples, a: &Samples, anchor: &str, scale: f64| {
            if rank != 0 {
                return;
            }
            let (fm, am) = (f.median() * scale, a.median() * scale);
            let (fr, ar) = (f.range(), a.range());
            let ratio = fm / am;
            println!("{metric:<44} {fm:>12.3} {unit:<5} {anchor:<28} {am:>12.3} {unit:<5} {ratio:>6.3}×",);
            rows.push(Row {
                metric,
                unit: unit.into(),
                better: better.into(),
                figure: fm,
                range: [fr[0] * scale, fr[1] * scale],
                anchor: Anchor {
                    name: anchor.into(),
                    figure: am,
                    range: [ar[0] * scale, ar[1] * scale],
                },
                notes: format!("medians of {} interleaved repetitions", f.0.len()),
            });
        };
    if rank == 0 {
        let c = e.capabilities();
        println!(
            "{} ranks, MPI {}; {} repetitions, medians; devices: {} {}, gpu-direct {}, routes to rank 1: {:?}",
            e.size(),
            c.mpi_library,
            args.reps,
            c.devices,
            c.device_kind,
            c.gpu_direct,
            e.peer(1)?.routes
        );
        println!(
            "{:<44} {:>18} {:<28} {:>18} {:>7}",
            "measurement", "engine", "anchor", "", "ratio"
        );
    }
    // Active-message round trips, up to the payload limit (host memory runs only).
    let am_sizes = if args.memory == Memory::Host {
        sizes(args.min_size, args.max_size.min(ferry_engine::AM_MAX_PAYLOAD))
    } else {
        Vec::new()
    };
    for s in am_sizes {
        let n = steps(s, volume).min(1000);
        let (mut f, mut a) = (Samples::default(), Samples::default());
        let mut m = Samples::default();
        for _ in 0..args.reps {
            f.0.push(b.am_round_trip(s, n)?);
            m.0.push(b.message_round_trip(s, n)?);
            a.0.push(b.mpi_ping_pong(s, n)?);
        }
        print(
            rank,
            format!("active-message round trip, {}", human(s)),
            "µs",
            "lower",
            &f,
            &a,
            "MPI ping-pong",
            1e6,
        );
        print(
            rank,
            format!("message round trip, {}", human(s)),
            "µs",
            "lower",
            &m,
            &a,
            "MPI ping-pong",
            1e6,
        );
    }
    // Gets and puts against osu_bw.
    for &w in &args.windows {
        for s in sizes(args.min_size, args.max_size) {
            let n = steps(s * w, volume);
            let (mut g, mut p, mut a, mut ap) = (
                Samples::default(),
                Samples::default(),
                Samples::default(),
                Samples::default(),
            );
            for _ in 0..args.reps {
                g.0.push(b.one_sided(false, s, w, n)?);
                a.0.push(b.mpi_bw(1, s, w, n)?);
                p.0.push(b.one_sided(true, s, w, n)?);
                ap.0.push(b.mpi_bw(0, s, w, n)?);
            }
            let bw = |x: &Samples| Samples(x.0.iter().map(|t| (s * w) as f64 / t / 1e9).collect());
            if w == 1 {
                print(
                    rank,
                    format!("get latency, {}", human(s)),
                    "µs",
                    "lower",
                    &g,
                    &a,
                    "osu_bw step, 1 in flight",
                    1e6,
                );
                print(
                    rank,
                    format!("put latency, {}", human(s)),
                    "µs",
                    "lower",
                    &p,
                    &ap,
                    "osu_bw step, 1 in flight",
                    1e6,
                );
            }
            let anchor = format!("osu_bw, {w} in flight");
            print(
                rank,
                format!("get bandwidth, {} × {w}", human(s)),
                "GB/s",
                "higher",
                &bw(&g),
                &bw(&a),
                &anchor,
                1.0,
            );
            print(
                rank,
                format!("put bandwidth, {} × {w}", human(s)),
                "GB/s",
                "higher",
                &bw(&p),
                &bw(&ap),
                &anchor,
                1.0,
            );
        }
    }
    // Placed gets against plain gets into a registered buffer, same route, same run.
    if args.placed && args.memory == Memory::Device {
        let dev = rank as usize % e.capabilities().devices.max(1);
        for &w in &args.windows {
            for s in sizes(args.min_size, args.max_size) {
                let n = steps(s * w, volume);
                let (mut pl, mut g) = (Samples::default(), Samples::default());
                for _ in 0..args.reps {
                    pl.0.push(b.placed(dev, s, w, n)?);
                    g.0.push(b.one_sided(false, s, w, n)?);
                }
                print(
                    rank,
                    format!("placed get, {} × {w}", human(s)),
                    "µs",
                    "lower",
                    &pl,
                    &g,
                    "get into a registered buffer",
                    1e6,
                );
            }
        }
    }
    e.barrier()?;
    e.unregister(&b.src_h)?;
    e.unregister(&b.dst_h)?;
    let Bench { raw, .. } = b;
    drop(raw);
    drop(device_bufs);
    e.finalize()?;
    if rank == 0 {
        if let Some(path) = &args.json {
            let record = Record {
                workload: format!(
                    "communication engine ({}) against raw MPI, {}, 2 ranks",
                    match args.progress {
                        ProgressArg::Thread => "its own progress thread",
                        ProgressArg::Caller => "progress driven by the caller",
                        ProgressArg::Shared => "shared progress: the caller drives, its thread a backstop",
                    },
                    match (args.memory, args.route.as_str()) {
                        (Memory::Host, _) if single_copy => "host memory, single copies (Cross Memory Attach)",
                        (Memory::Host, _) => "host memory over MPI",
                        (Memory::Device, "ipc") => "device memory, peer copies through CUDA IPC (leases)",
                        (Memory::Device, "ipc-grant") =>
                            "device memory, peer copies through CUDA IPC (a grant per copy)",
                        (Memory::Device, "gpu-direct") => "device memory, GPU-direct MPI",
                        (Memory::Device, "staged") => "device memory, staged through bounce buffers",
                        (Memory::Device, _) => "device memory, the engine's choice of route",
                    }
                ),
                machine: args.machine.clone(),
                command: format!(
                    "mpirun -np 2 engine-bench {}",
                    std::env::args().skip(1).collect::<Vec<_>>().join(" ")
                ),
                commit: args.commit.clone(),
                date: ferry_examples::today(),
                results: rows,
            };
            ferry_examples::write_json(path, &record)?;
        }
    }
    Ok(())
}
