//! Exercises the communication engine (`ferry-engine`) under `mpirun`; each scenario asserts
//! bytes, counts and errors on every rank and exits non-zero on the first failure. The
//! `engine` integration test runs every scenario on 2–4 ranks.

use anyhow::{anyhow, bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use ferry_engine::{
    AmMessage, Completions, Devices, Engine, EngineConfig, EngineError, GpuDirect, MemHandle, MemKind, Notify,
    PlacedRequest, Progress, MEM_HANDLE_BYTES,
};
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Scenario {
    /// Gets and puts of several sizes between every rank and its neighbours, one and eight in
    /// flight, with notifications checked against the landed bytes.
    PutGet,
    /// Tagged sends and receives around the ring, in order per tag.
    TwoSided,
    /// Active-message order per (source, tag), and messages held until a handler exists.
    AmOrder,
    /// Four threads of each rank start operations concurrently.
    Threads,
    /// Every bad input refused with its error, nothing lost, the engine still usable.
    BadInput,
    /// Callbacks queued for the caller's `progress`, run only there, on that thread.
    CallerProgress,
    /// The engine on a communicator the caller split, MPI initialised and finalized by it.
    CallerComm,
    /// The communication layer driven by the caller: once its loop has stopped, a command
    /// posted on a handle of it (a poller added by a thread that found the engine open just
    /// before it finalized) fails at the post, and what it carried is dropped there — the
    /// poller closed at once, not left in a channel nobody reads.
    DriverEnd,
    /// Gets and puts between host and device memory (emulated devices, or CUDA with
    /// `--cuda`), across chunk boundaries, staged or GPU-direct; and device memory misdeclared.
    Device,
    /// Bounce buffers that cannot be pinned (emulated devices failing every pinned allocation,
    /// `Faults::pin_fail`): staged gets and puts of device memory fail with the reason, on the
    /// origin's side at once, on the target's side as a refusal the origin hears; none hangs,
    /// and host memory still moves.
    PinFail,
    /// Gets into new memory the engine places on a device, falling back to pinned host memory
    /// past the device budget (`--budget`), forwarded on, freed when dropped.
    Placed,
    /// Placed gets into the framework's own device memory through a placer it installed,
    /// which evicts its own cached data to make room, places groups all or none, and gets
    /// every placement back once when it is dropped.
    Placer,
    /// Stream-ordered gets into device memory: with `--cuda`, a copy enqueued on the stream
    /// right after the call (no host wait) reads the landed bytes, and a refused get releases
    /// the stream; on emulated devices, the same calls and their completions.
    Stream,
    /// A neighbour's device registration mapped here (`map_peer`, with `--ipc`): the same
    /// memory both ways (bytes written by the owner read through the mapping, bytes written
    /// through it read by the owner), one mapping per allocation, the registration held while
    /// mapped (its unregister busy) and free to end after; this rank's own, host, ended
    /// registrations and absent devices refused.
    PeerMap,
    /// Tagged messages of unregistered memory on both lanes around the ring, in order per
    /// (peer, lane, tag) with the lanes kept apart, counted on their paths; bad peers and tags
    /// refused; `agree` with one rank failing and with none; clock synchronisation; a poller
    /// run by the loop. With `--no-am`, every operation that needs active messages refused.
    Messages,
}

#[derive(Parser)]
struct Args {
    #[arg(value_enum)]
    scenario: Scenario,
    /// Drive progress from this program's calls (`Progress::Caller`) instead of the engine's
    /// thread: a thread of this program calls `progress` all along.
    #[arg(long)]
    driven: bool,
    /// Shared progress (`Progress::Shared`): the engine's thread a backstop, this program's
    /// blocking calls and its `progress` calls (with `--driven`, a thread calling it all along)
    /// driving the loop themselves.
    #[arg(long)]
    shared: bool,
    /// With `--shared`: the backstop's period, µs (`EngineConfig::backstop_us`).
    #[arg(long)]
    backstop_us: Option<u64>,
    /// Use the CUDA devices instead of two emulated ones (device scenario).
    #[arg(long)]
    cuda: bool,
    /// Hand device memory to MPI (`force`) instead of staging it (`off`).
    #[arg(long, default_value = "off")]
    gpu_direct: String,
    /// Bytes per chunk of staged payloads.
    #[arg(long, default_value_t = 64 << 10)]
    chunk: usize,
    /// Bounce buffers per direction.
    #[arg(long, default_value_t = 2)]
    slots: usize,
    /// Let device memory of ranks of one node move by peer copies through IPC.
    #[arg(long)]
    ipc: bool,
    /// With `--ipc`: always ask the target for a grant (no leases from its shared-memory table).
    #[arg(long)]
    no_leases: bool,
    /// Bytes of device memory the engine may allocate per device.
    #[arg(long)]
    budget: Option<usize>,
    /// Bytes of each device's placement arena (0: placed gets allocate their own memory).
    #[arg(long, default_value_t = 256 << 20)]
    arena: usize,
    /// Peers' allocations kept mapped once idle (`EngineConfig::ipc_keep_mappings`).
    #[arg(long, default_value_t = ferry_engine::IPC_KEEP_MAPPINGS)]
    keep_mappings: usize,
    /// Start without active messages (`EngineConfig::active_messages` false).
    #[arg(long)]
    no_am: bool,
    /// Start without active messages on rank 0 only: every rank's start must fail.
    #[arg(long)]
    no_am_on_rank0: bool,
    /// Send every active message over MPI (`EngineConfig::am_rings` false), none through the
    /// node's shared-memory rings.
    #[arg(long)]
    no_rings: bool,
    /// The longest active message through the rings, bytes (`EngineConfig::am_ring_max_bytes`).
    #[arg(long, default_value_t = ferry_engine::AM_RING_MAX_BYTES)]
    am_ring_max: usize,
    /// Move host memory between ranks of one node over MPI (`EngineConfig::cma` false), never
    /// by single copies through Cross Memory Attach.
    #[arg(long)]
    no_cma: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let r = match args.scenario {
        Scenario::CallerComm => caller_comm(),
        Scenario::DriverEnd => driver_end(),
        s => Engine::start(EngineConfig {
            completions: if matches!(s, Scenario::CallerProgress) {
                Completions::Caller
            } else {
                Completions::ProgressThread
            },
            backstop_us: args.backstop_us,
            progress: match (args.shared, args.driven) {
                (true, _) => Progress::Shared,
                (false, true) => Progress::Caller,
                (false, false) => Progress::Thread,
            },
            devices: if args.cuda {
                Devices::Cuda
            } else if matches!(
                s,
                Scenario::Device
                    | Scenario::Placed
                    | Scenario::Placer
                    | Scenario::Stream
                    | Scenario::PeerMap
                    | Scenario::PinFail
            ) {
                Devices::Emulated(2)
            } else {
                Devices::None
            },
            gpu_direct: args.gpu_direct.parse().unwrap_or(GpuDirect::Off),
            bounce_chunk: args.chunk,
            bounce_slots: args.slots,
            ipc: args.ipc,
            ipc_leases: !args.no_leases,
            device_budget: args.budget,
            placement_arena: args.arena,
            ipc_keep_mappings: args.keep_mappings,
            active_messages: !(args.no_am || (args.no_am_on_rank0 && world_rank() == 0)),
            am_rings: !args.no_rings,
            am_ring_max_bytes: args.am_ring_max,
            cma: !args.no_cma,
            faults: ferry_engine::Faults {
                pin_fail: matches!(s, Scenario::PinFail),
                ..Default::default()
            },
            ..Default::default()
        })
        .map_err(|e| anyhow!("start: {e}"))
        .and_then(|e| {
            let rank = e.rank();
            // With caller-driven progress, a thread of this program drives it while the
            // scenario runs (the scenario's own waits do not call `progress`).
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let driver = args.driven.then(|| {
                let (h, stop) = (e.handle(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(SeqCst) {
                        if h.progress() == 0 {
                            std::thread::yield_now();
                        }
                    }
                })
            });
            let r = match s {
                Scenario::PutGet => put_get(&e, !args.no_cma),
                Scenario::TwoSided => two_sided(&e),
                Scenario::AmOrder => am_order(&e, if args.no_rings { 0 } else { args.am_ring_max }),
                Scenario::Threads => threads(&e),
                Scenario::BadInput => bad_input(&e),
                Scenario::CallerProgress => caller_progress(&e),
                Scenario::Device => device(
                    &e,
                    args.gpu_direct == "force",
                    args.ipc,
                    !args.no_leases,
                    args.keep_mappings,
                ),
                Scenario::PinFail => pin_fail(&e),
                Scenario::Placed => placed(&e, args.budget, args.arena),
                Scenario::Placer => placer(&e),
                Scenario::Stream => stream(&e, args.cuda, args.ipc && !args.no_leases),
                Scenario::Messages => messages(&e, args.no_am, args.driven && !args.shared),
                Scenario::PeerMap => peer_map(&e),
                Scenario::CallerComm | Scenario::DriverEnd => unreachable!(),
            };
            // (The bad-input scenario ends with the engine poisoned on purpose.)
            let r = match s {
                Scenario::BadInput => r,
                _ => r.and_then(|_| e.barrier().map_err(|x| anyhow!("final barrier: {x}"))),
            };
            stop.store(true, SeqCst);
            if let Some(d) = driver {
                let _ = d.join();
            }
            if let Err(x) = &r {
                // Said before finalizing: a rank that fails leaves its peers in a collective,
                // and finalizing may then wait for them until the test's bound.
                eprintln!("engine_check {s:?}: rank {rank}: {x:#}");
            }
            let fin = e.finalize().map_err(|x| anyhow!("finalize: {x}"));
            r.and(fin).with_context(|| format!("rank {rank}"))
        }),
    };
    match r {
        Ok(()) => {
            println!("engine_check {:?}: ok", args.scenario);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("engine_check {:?}: {e:#}", args.scenario);
            ExitCode::FAILURE
        }
    }
}

/// The byte at `i` of rank `r`'s source data in round `k`.
fn pattern(r: i32, k: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (r as usize * 7 + k * 13)) as u8
}

fn wait_until(what: &str, cond: impl Fn() -> bool) -> Result<()> {
    let t0 = Instant::now();
    while !cond() {
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(())
}

/// A heap buffer registered with the engine (unregistered by the scenario).
struct Buf {
    data: Vec<u8>,
    h: MemHandle,
}

fn buf(e: &Engine, data: Vec<u8>) -> Result<Buf> {
    let mut data = data;
    // SAFETY: `data` lives in the returned Buf, which every scenario keeps until after the
    // final barrier (or unregisters first); nothing writes it while operations are in flight.
    let h = unsafe { e.register(data.as_mut_ptr(), data.len(), MemKind::Host)? };
    Ok(Buf { data, h })
}

/// Every rank's handles, exchanged with an allgather.
fn exchange(e: &Engine, mine: &[MemHandle]) -> Result<Vec<Vec<MemHandle>>> {
    let bytes: Vec<u8> = mine.iter().flat_map(|h| h.to_bytes()).collect();
    e.allgather(&bytes)?
        .iter()
        .map(|b| {
            b.chunks(MEM_HANDLE_BYTES)
                .map(|c| e.mem_handle(c).map_err(|x| anyhow!("{x}")))
                .collect()
        })
        .collect()
}

type Done = Arc<AtomicUsize>;

fn counting(done: &Done, errors: &Arc<Mutex<Vec<String>>>) -> impl FnOnce(ferry_engine::Result<()>) + Send + 'static {
    let (done, errors) = (done.clone(), errors.clone());
    move |r| {
        if let Err(x) = r {
            errors.lock().unwrap().push(x.to_string());
        }
        done.fetch_add(1, SeqCst);
    }
}

fn put_get(e: &Engine, cma: bool) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let from = (rank + 1) % size; // whose data this rank gets
    let to = (rank + size - 1) % size; // whose inbox this rank puts into
    let putter = (rank + 1) % size; // who puts into this rank's inbox
    let get_notes = Arc::new(AtomicUsize::new(0));
    let put_notes = Arc::new(Mutex::new(Vec::<(i32, Vec<u8>)>::new()));
    let inbox_ptr = Arc::new(Mutex::new((0usize, 0usize)));
    {
        let g = get_notes.clone();
        e.register_handler(7, move |m: AmMessage| {
            assert_eq!(m.bytes.len(), 4);
            g.fetch_add(1, SeqCst);
        })?;
        let (p, inbox) = (put_notes.clone(), inbox_ptr.clone());
        e.register_handler(8, move |m: AmMessage| {
            // The notification comes after the data has landed: snapshot the inbox now.
            let (ptr, len) = *inbox.lock().unwrap();
            // SAFETY: the inbox outlives the scenario; the put that wrote it has completed.
            let seen = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }.to_vec();
            p.lock().unwrap().push((m.source, seen));
        })?;
    }
    let sizes = [1usize, 8, 4099, 1 << 20, (4 << 20) + 5];
    let errors = Arc::new(Mutex::new(Vec::new()));
    let mut total_ops = 0u64;
    // Gets (and as many puts) large enough for the single-copy route, and their bytes.
    let (mut single_ops, mut single_bytes) = (0u64, 0u64);
    for (k, &len) in sizes.iter().enumerate() {
        for in_flight in [1usize, 8] {
            let chunk = len.div_ceil(in_flight);
            let src = buf(e, (0..len).map(|i| pattern(rank, k, i)).collect())?;
            let mut dst = buf(e, vec![0u8; len])?;
            let mut inbox = buf(e, vec![0u8; len])?;
            *inbox_ptr.lock().unwrap() = (inbox.data.as_ptr() as usize, len);
            put_notes.lock().unwrap().clear();
            // Read before the exchange: a peer whose exchange ends first may read this rank's
            // data (and notify) before this rank's own exchange returns.
            let notes_before = get_notes.load(SeqCst);
            let all = exchange(e, &[src.h, inbox.h])?;
            let done = Arc::new(AtomicUsize::new(0));
            let mut ops = 0;
            for off in (0..len).step_by(chunk) {
                let n = chunk.min(len - off);
                if n >= ferry_engine::CMA_MIN_BYTES {
                    single_ops += 1;
                    single_bytes += n as u64;
                }
                let note = Notify {
                    tag: 7,
                    bytes: rank.to_le_bytes().to_vec(),
                };
                e.get(
                    &dst.h,
                    off,
                    &all[from as usize][0],
                    off,
                    n,
                    Some(note),
                    counting(&done, &errors),
                )?;
                ops += 1;
            }
            // Puts go one at a time when notifications snapshot the inbox (each must see its
            // own bytes); with 8 in flight, the snapshot is checked only after the last.
            for off in (0..len).step_by(chunk) {
                let n = chunk.min(len - off);
                let note = Notify {
                    tag: 8,
                    bytes: vec![k as u8],
                };
                e.put(
                    &src.h,
                    off,
                    &all[to as usize][1],
                    off,
                    n,
                    Some(note),
                    counting(&done, &errors),
                )?;
                ops += 1;
            }
            total_ops += ops as u64 / 2;
            wait_until("put/get completions", || done.load(SeqCst) >= ops)
                .with_context(|| format!("{len} bytes, {in_flight} in flight:\n{}", e.report()))?;
            e.barrier()?;
            wait_until("get notifications", || get_notes.load(SeqCst) >= notes_before + ops / 2)?;
            wait_until("put notifications", || put_notes.lock().unwrap().len() >= ops / 2)?;
            std::thread::sleep(Duration::from_millis(5));
            ensure!(
                done.load(SeqCst) == ops,
                "{} completions for {ops} operations",
                done.load(SeqCst)
            );
            ensure!(
                get_notes.load(SeqCst) == notes_before + ops / 2,
                "get notifications: {} for {}",
                get_notes.load(SeqCst) - notes_before,
                ops / 2
            );
            let errs = errors.lock().unwrap().clone();
            ensure!(errs.is_empty(), "failed operations: {errs:?}");
            let want_dst: Vec<u8> = (0..len).map(|i| pattern(from, k, i)).collect();
            let want_inbox: Vec<u8> = (0..len).map(|i| pattern(putter, k, i)).collect();
            ensure!(
                dst.data == want_dst,
                "get of {len} bytes ({in_flight} in flight): wrong bytes"
            );
            ensure!(
                inbox.data == want_inbox,
                "put of {len} bytes ({in_flight} in flight): wrong bytes"
            );
            let notes = put_notes.lock().unwrap().clone();
            ensure!(
                notes.iter().all(|(s, _)| *s == putter),
                "put notification from the wrong rank"
            );
            // The last notification saw the whole inbox in place (its own bytes had landed, and
            // with one in flight they are all of them).
            if in_flight == 1 {
                ensure!(
                    notes[0].1 == want_inbox,
                    "the put's notification ran before its data landed"
                );
            }
            e.barrier()?;
            for b in [&src, &dst, &inbox] {
                e.unregister(&b.h)?;
            }
            dst.data.clear();
            inbox.data.clear();
        }
    }
    let s = e.stats();
    ensure!(
        s.gets == total_ops && s.puts == total_ops,
        "stats: {s:?}, want {total_ops} each"
    );
    ensure!(
        s.am_sent == total_ops && s.notifications == total_ops,
        "notifications: {s:?}"
    );
    let bytes: u64 = sizes.iter().map(|&l| 2 * l as u64).sum();
    ensure!(
        s.bytes_got == bytes && s.bytes_put == bytes,
        "bytes: {s:?}, want {bytes} each"
    );
    ensure!(s.gets_served == s.gets && s.puts_served == s.puts, "served: {s:?}");
    ensure!(s.registrations == 0, "registrations left: {s:?}");
    // The route of host memory: single copies with the node's peers when the engine says it
    // reaches them (every get and put of at least `CMA_MIN_BYTES`, and every byte of those, on
    // both ends), none when it is off.
    let single = |p: i32| e.peer(p).map(|c| c.routes.contains(&ferry_engine::Route::Cma));
    let (to_from, to_to) = (single(from)?, single(to)?);
    ensure!(
        cma || !(to_from || to_to),
        "the single-copy route is off, yet offered: {:?}",
        e.peer(from)?
    );
    let path = e.traffic().path(ferry_engine::TrafficPath::Cma);
    let (sent, recv) = (path.bytes_sent.load(SeqCst), path.bytes_recv.load(SeqCst));
    let want = if to_from && to_to { 2 * single_bytes } else { 0 };
    ensure!(
        (to_from == to_to) && s.single_copies == if to_from { 2 * single_ops } else { 0 },
        "single copies: {} (routes to {from}: {to_from}, to {to}: {to_to}; {single_ops} gets and puts large enough)",
        s.single_copies
    );
    ensure!(
        sent == want && recv == want,
        "bytes on the cma path: {sent} sent, {recv} received, want {want} each"
    );
    println!(
        "engine_check put-get: rank {rank}: host memory by {}",
        if to_from { "single copies" } else { "MPI" }
    );
    Ok(())
}

fn two_sided(e: &Engine) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let n = 64usize;
    let len = 3000usize;
    let src = buf(e, (0..n * len).map(|i| pattern(rank, i / len, i)).collect())?;
    let dst = buf(e, vec![0u8; n * len])?;
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    // Two tags; messages of one tag land in posting order.
    for i in 0..n {
        e.recv(&dst.h, i * len, len, prev, (i % 2) as u32, counting(&done, &errors))?;
    }
    e.barrier()?;
    for i in 0..n {
        e.send(&src.h, i * len, len, next, (i % 2) as u32, counting(&done, &errors))?;
    }
    wait_until("two-sided completions", || done.load(SeqCst) >= 2 * n)?;
    let errs = errors.lock().unwrap().clone();
    ensure!(errs.is_empty(), "failed: {errs:?}");
    let want: Vec<u8> = (0..n * len).map(|i| pattern(prev, i / len, i)).collect();
    ensure!(dst.data == want, "two-sided bytes differ");
    let s = e.stats();
    ensure!(s.sends == n as u64 && s.recvs == n as u64, "{s:?}");
    ensure!(
        s.bytes_sent == (n * len) as u64 && s.bytes_received == (n * len) as u64,
        "{s:?}"
    );
    // A message of another length fails its receive, and nothing else.
    let small = buf(e, vec![0u8; 16])?;
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    e.recv(&small.h, 0, 16, prev, 99, move |r| {
        *g.lock().unwrap() = Some(r.map_err(|x| x.to_string()))
    })?;
    e.send(&src.h, 0, 8, next, 99, |_| {})?;
    wait_until("the mismatched receive", || got.lock().unwrap().is_some())?;
    let r = got.lock().unwrap().take().unwrap();
    ensure!(
        matches!(&r, Err(m) if m.contains("8") && m.contains("16")),
        "mismatched receive: {r:?}"
    );
    e.barrier()?;
    for b in [&src, &dst, &small] {
        e.unregister(&b.h)?;
    }
    Ok(())
}

/// Sequence numbers received, per (source, tag), in delivery order.
type Seen = HashMap<(i32, u16), Vec<u32>>;

/// The length of `am_order`'s long message number `i`: 20 KiB and a few bytes, varying.
fn large_am_len(i: u32) -> usize {
    (20 << 10) + (i as usize * 7) % 61
}

/// Bytes of message `i` of the mid-sized kind: 109 to 1,008 (2 to 10 ring slots of 108).
fn mid_am_len(i: u32) -> usize {
    109 + (i as usize * 37) % 900
}

/// Bytes of message `i` of the longest kind: 60 KiB and a few bytes (a byte ring of 1 MiB holds
/// 16 of them).
fn huge_am_len(i: u32) -> usize {
    (60 << 10) + (i as usize * 13) % 97
}

/// Bytes of message `i` of active-message order checks.
fn am_len(i: u32) -> usize {
    match i % 16 {
        5 => large_am_len(i),
        9 => mid_am_len(i),
        13 => huge_am_len(i),
        _ => 4,
    }
}

/// Active messages from every rank to every rank (itself included), of four kinds (4 bytes;
/// 2–10 ring slots; 20 KiB; 60 KiB), on two tags and a third whose handler comes late: each
/// arrives intact and in order per (source, tag), and exactly those of at most `ring_max` bytes
/// (0: rings off) to other ranks go through the rings.
fn am_order(e: &Engine, ring_max: usize) -> Result<()> {
    let (rank, size) = (e.rank(), e.size());
    const N: u32 = 2000;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    for tag in [1u16, 2] {
        let s = seen.clone();
        e.register_handler(tag, move |m| {
            let mut v = u32::from_le_bytes(m.bytes[..4].try_into().unwrap());
            // A long message comes in a buffer of the engine's pool, which earlier messages
            // used (from MPI or a byte ring): it must hold this message's bytes, and no more
            // (else the order check fails). A mid-sized one came in several ring slots (or over
            // MPI), joined at the receiver.
            let long = matches!(v % 16, 5 | 13);
            let intact = m.bytes.len() == am_len(v)
                && (!long || m.bytes.is_pooled())
                && m.bytes[4..].iter().all(|&b| b == v as u8);
            if !intact {
                v = u32::MAX;
            }
            s.lock().unwrap().entry((m.source, m.tag)).or_default().push(v);
        })?;
    }
    e.barrier()?;
    // Tag 3 has no handler yet: its messages are held.
    // Two of every 16 messages are past MPI's eager size (received without blocking, while the
    // small ones behind them wait) and past a ring slot (through the byte ring, which they
    // fill), one more spans several slots, each of a length and bytes of its own: order and
    // contents must hold across all kinds.
    for peer in 0..size as i32 {
        for i in 0..N {
            let tag = 1 + (i % 2) as u16;
            let mut payload = i.to_le_bytes().to_vec();
            payload.resize(am_len(i), i as u8);
            e.send_am(tag, peer, &payload)?;
            if i < 50 {
                e.send_am(3, peer, &i.to_le_bytes())?;
            }
        }
    }
    let expect = size * N as usize;
    wait_until("active messages", || {
        seen.lock().unwrap().values().map(Vec::len).sum::<usize>() >= expect
    })?;
    e.barrier()?;
    wait_until("held messages", || e.stats().held_messages as usize == size * 50)?;
    let s = seen.clone();
    e.register_handler(3, move |m| {
        let v = u32::from_le_bytes(m.bytes[..4].try_into().unwrap());
        s.lock().unwrap().entry((m.source, m.tag)).or_default().push(v);
    })?;
    wait_until("held messages delivered", || {
        seen.lock().unwrap().values().map(Vec::len).sum::<usize>() >= expect + size * 50
    })?;
    let seen = seen.lock().unwrap();
    for src in 0..size as i32 {
        for tag in [1u16, 2] {
            let want: Vec<u32> = (0..N).filter(|i| 1 + (i % 2) as u16 == tag).collect();
            ensure!(seen[&(src, tag)] == want, "rank {rank}: order from {src} on tag {tag}");
        }
        ensure!(
            seen[&(src, 3)] == (0..50).collect::<Vec<u32>>(),
            "held order from {src}"
        );
    }
    let st = e.stats();
    ensure!(st.held_messages == 0, "{st:?}");
    ensure!(st.am_received == (expect + size * 50) as u64, "{st:?}");
    ensure!(st.am_sent == (expect + size * 50) as u64, "{st:?}");
    // Every message of at most `ring_max` bytes went through the rings to each other rank (all
    // on this node), the longer ones over MPI, in order with them; none with the rings off.
    let fit = (0..N).filter(|&i| am_len(i) <= ring_max).count() as u64 + if ring_max > 0 { 50 } else { 0 };
    let want = (size as u64 - 1) * fit;
    ensure!(
        st.am_ring_sent == want,
        "{} through rings, expected {want}",
        st.am_ring_sent
    );
    Ok(())
}

fn threads(e: &Engine) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let peer = (rank + 1) % size;
    const T: usize = 4;
    const OPS: usize = 200;
    const LEN: usize = 1024;
    let srcs: Vec<Buf> = (0..T)
        .map(|t| buf(e, (0..OPS * LEN).map(|i| pattern(rank, t, i)).collect()))
        .collect::<Result<_>>()?;
    let dsts: Vec<Buf> = (0..T).map(|_| buf(e, vec![0u8; OPS * LEN])).collect::<Result<_>>()?;
    let mine: Vec<MemHandle> = srcs.iter().map(|b| b.h).collect();
    let all = exchange(e, &mine)?;
    let ams = Arc::new(AtomicUsize::new(0));
    let a = ams.clone();
    e.register_handler(5, move |_| {
        a.fetch_add(1, SeqCst);
    })?;
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|sc| {
        for t in 0..T {
            let (done, errors, all, dst) = (&done, &errors, &all, dsts[t].h);
            sc.spawn(move || -> Result<()> {
                for i in 0..OPS {
                    let off = i * LEN;
                    if i % 2 == 0 {
                        e.get(
                            &dst,
                            off,
                            &all[peer as usize][t],
                            off,
                            LEN,
                            None,
                            counting(done, errors),
                        )?;
                    } else {
                        // Reads this rank's own source into its destination through the engine
                        // (a get from itself), concurrently with the remote gets.
                        e.get(
                            &dst,
                            off,
                            &all[rank as usize][t],
                            off,
                            LEN,
                            None,
                            counting(done, errors),
                        )?;
                    }
                    e.send_am(5, peer, &[t as u8])?;
                }
                Ok(())
            });
        }
    });
    wait_until("concurrent gets", || done.load(SeqCst) >= T * OPS)?;
    wait_until("concurrent active messages", || ams.load(SeqCst) >= T * OPS)?;
    let errs = errors.lock().unwrap().clone();
    ensure!(errs.is_empty(), "failed: {errs:?}");
    for (t, d) in dsts.iter().enumerate() {
        for i in 0..OPS {
            let owner = if i % 2 == 0 { peer } else { rank };
            let want: Vec<u8> = (i * LEN..(i + 1) * LEN).map(|j| pattern(owner, t, j)).collect();
            ensure!(
                d.data[i * LEN..(i + 1) * LEN] == want[..],
                "thread {t} op {i}: wrong bytes"
            );
        }
    }
    e.barrier()?;
    Ok(())
}

/// Runs `op` and waits for its completion; the completion's outcome.
fn outcome(
    op: impl FnOnce(Box<dyn FnOnce(ferry_engine::Result<()>) + Send>) -> ferry_engine::Result<()>,
) -> Result<std::result::Result<(), EngineError>> {
    let slot = Arc::new(Mutex::new(None));
    let s = slot.clone();
    op(Box::new(move |r| *s.lock().unwrap() = Some(r)))?;
    wait_until("a completion", || slot.lock().unwrap().is_some())?;
    let r = slot.lock().unwrap().take().unwrap();
    Ok(r)
}

fn bad_input(e: &Engine) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let peer = (rank + 1) % size;
    let a = buf(e, vec![1u8; 256])?;
    // Large, so that the refused put below moves by rendezvous.
    let gone = buf(e, vec![2u8; 4 << 20])?;
    let guard = buf(e, vec![3u8; 256])?;
    let all = exchange(e, &[a.h, gone.h])?;
    let (remote, remote_gone) = (all[peer as usize][0], all[peer as usize][1]);
    // Handles that are not handles, or of another job.
    let bytes = remote.to_bytes();
    ensure!(matches!(e.mem_handle(&bytes[..10]), Err(EngineError::BadHandle(_))));
    let mut foreign = bytes;
    foreign[30] ^= 0xff;
    ensure!(matches!(e.mem_handle(&foreign), Err(EngineError::ForeignHandle { .. })));
    // Ranges.
    let nop = |_| {};
    ensure!(matches!(
        e.get(&a.h, 0, &remote, 200, 100, None, nop),
        Err(EngineError::OutOfBounds { .. })
    ));
    ensure!(matches!(
        e.get(&a.h, 200, &remote, 0, 100, None, nop),
        Err(EngineError::OutOfBounds { .. })
    ));
    ensure!(matches!(
        e.put(&a.h, 0, &remote, usize::MAX, 2, None, nop),
        Err(EngineError::OutOfBounds { .. })
    ));
    ensure!(matches!(
        e.get(&a.h, 0, &remote, 0, 0, None, nop),
        Err(EngineError::InvalidArgument(_))
    ));
    // A remote handle used as a local one.
    if size > 1 {
        ensure!(matches!(
            e.get(&remote, 0, &remote, 0, 8, None, nop),
            Err(EngineError::WrongOwner { .. })
        ));
        ensure!(matches!(e.unregister(&remote), Err(EngineError::WrongOwner { .. })));
    }
    // Tags and payloads.
    ensure!(matches!(
        e.register_handler(20000, |_| {}),
        Err(EngineError::TagOutOfRange { .. })
    ));
    e.register_handler(9, |_| {})?;
    ensure!(matches!(e.register_handler(9, |_| {}), Err(EngineError::TagTaken(9))));
    ensure!(matches!(e.unregister_handler(10), Err(EngineError::UnknownTag(10))));
    ensure!(matches!(
        e.send_am(9, peer, &vec![0u8; ferry_engine::AM_MAX_PAYLOAD + 1]),
        Err(EngineError::PayloadTooLarge { .. })
    ));
    ensure!(matches!(
        e.send_am(9, 99, b"x"),
        Err(EngineError::NoSuchPeer { peer: 99, .. })
    ));
    let big = Notify {
        tag: 9,
        bytes: vec![0; ferry_engine::AM_MAX_PAYLOAD + 1],
    };
    ensure!(matches!(
        e.get(&a.h, 0, &remote, 0, 8, Some(big), nop),
        Err(EngineError::PayloadTooLarge { .. })
    ));
    ensure!(matches!(
        e.send(&a.h, 0, 8, peer, u32::MAX, nop),
        Err(EngineError::InvalidArgument(_))
    ));
    // Device memory on an engine without devices.
    let mut spare = [0u8; 8];
    // SAFETY: refused; nothing is kept.
    ensure!(matches!(
        unsafe { e.register(spare.as_mut_ptr(), 8, MemKind::Device(0)) },
        Err(EngineError::NoDevices(_))
    ));
    ensure!(matches!(e.alloc_device(0, 8), Err(EngineError::NoDevices(_))));
    // A registration unregistered by its owner: refused there, with the reason, and the
    // memory next to it untouched.
    e.unregister(&gone.h)?;
    ensure!(matches!(e.unregister(&gone.h), Err(EngineError::NotRegistered { .. })));
    e.barrier()?;
    let r = outcome(|d| e.get(&a.h, 0, &remote_gone, 0, 64, None, d))?;
    ensure!(
        matches!(&r, Err(EngineError::Remote { reason, .. }) if reason.contains("not registered")),
        "get from an unregistered region: {r:?}"
    );
    ensure!(a.data.iter().all(|&b| b == 1), "a refused get wrote the destination");
    let big = buf(e, vec![9u8; 4 << 20])?;
    let r = outcome(|d| e.put(&big.h, 0, &remote_gone, 0, 4 << 20, None, d))?;
    ensure!(
        matches!(&r, Err(EngineError::Remote { reason, .. }) if reason.contains("not registered")),
        "put into an unregistered region: {r:?}"
    );
    e.unregister(&big.h)?;
    e.barrier()?;
    ensure!(guard.data.iter().all(|&b| b == 3), "a refused put wrote memory");
    ensure!(e.stats().refused == 2, "refusals counted: {:?}", e.stats());
    // The engine still works; a completion may unregister the memory its operation used.
    let tmp = buf(e, vec![0u8; 64])?;
    let h = e.handle();
    let tmp_h = tmp.h;
    let r = outcome(|d| {
        e.get(&tmp.h, 0, &remote, 0, 64, None, move |r| {
            let r = r.and_then(|()| h.unregister(&tmp_h));
            d(r)
        })
    })?;
    ensure!(
        r.is_ok(),
        "a good get after refusals, unregistering in its completion: {r:?}"
    );
    let r = outcome(|d| e.get(&a.h, 0, &remote, 0, 64, None, d))?;
    ensure!(r.is_ok(), "a good get after refusals: {r:?}");
    e.barrier()?;
    // A handler that panics poisons the engine, and says so (the last barrier comes first:
    // a poisoned engine takes no collective).
    e.barrier()?;
    e.register_handler(11, |_| panic!("handler 11 fails on purpose"))?;
    e.send_am(11, rank, b"x")?;
    wait_until("the panic to be noticed", || e.send_am(9, rank, b"y").is_err())?;
    let err = e.send_am(9, rank, b"z").unwrap_err();
    ensure!(
        matches!(&err, EngineError::CallbackPanicked(m) if m.contains("on purpose")),
        "after a panic: {err}"
    );
    // Unregistering still works after the panic; the barrier does not (the engine refuses).
    e.unregister(&a.h)?;
    e.unregister(&guard.h)?;
    ensure!(matches!(e.barrier(), Err(EngineError::CallbackPanicked(_))));
    Ok(())
}

fn caller_progress(e: &Engine) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let peer = (rank + 1) % size;
    let me = std::thread::current().id();
    let ran_on = Arc::new(Mutex::new(Vec::new()));
    let r = ran_on.clone();
    e.register_handler(4, move |_| r.lock().unwrap().push(std::thread::current().id()))?;
    let a = buf(e, vec![5u8; 4096])?;
    let b = buf(e, vec![0u8; 4096])?;
    let all = exchange(e, &[a.h])?;
    let done = Arc::new(AtomicUsize::new(0));
    let d = done.clone();
    let r = ran_on.clone();
    e.get(&b.h, 0, &all[peer as usize][0], 0, 4096, None, move |res| {
        res.unwrap();
        r.lock().unwrap().push(std::thread::current().id());
        d.fetch_add(1, SeqCst);
    })?;
    e.send_am(4, peer, b"hi")?;
    // Nothing runs until this thread calls progress.
    std::thread::sleep(Duration::from_millis(100));
    ensure!(
        done.load(SeqCst) == 0 && ran_on.lock().unwrap().is_empty(),
        "a callback ran outside progress"
    );
    let t0 = Instant::now();
    while ran_on.lock().unwrap().len() < 2 {
        e.progress();
        ensure!(t0.elapsed() < Duration::from_secs(60), "callbacks never queued");
        std::thread::sleep(Duration::from_micros(100));
    }
    ensure!(
        ran_on.lock().unwrap().iter().all(|t| *t == me),
        "a callback ran on another thread"
    );
    ensure!(b.data.iter().all(|&x| x == 5), "get bytes");
    e.barrier()?;
    e.unregister(&a.h)?;
    e.unregister(&b.h)?;
    Ok(())
}

fn caller_comm() -> Result<()> {
    use mpi::traits::*;
    let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Multiple).context("MPI init")?;
    let world = universe.world();
    let (wrank, wsize) = (world.rank(), world.size());
    let color = mpi::topology::Color::with_value(wrank % 2);
    let half = world.split_by_color(color).context("split")?;
    let e = Engine::start(EngineConfig {
        communicator: Some(ferry_engine::CallerComm(half.as_raw())),
        ..Default::default()
    })
    .map_err(|x| anyhow!("start on a split communicator: {x}"))?;
    ensure!(
        e.rank() == half.rank() && e.size() as i32 == half.size(),
        "engine rank/size"
    );
    ensure!(e.size() as i32 == (wsize + 1 - wrank % 2) / 2, "half size");
    // The caller's own traffic on the world, concurrently with the engine's.
    let mut sum = 0i32;
    world.all_reduce_into(&wrank, &mut sum, mpi::collective::SystemOperation::sum());
    ensure!(sum == wsize * (wsize - 1) / 2, "caller's allreduce");
    let a = buf(&e, vec![wrank as u8; 1000])?;
    let b = buf(&e, vec![0u8; 1000])?;
    let all = exchange(&e, &[a.h])?;
    let peer = (e.rank() + 1) % e.size() as i32;
    let r = outcome(|d| e.get(&b.h, 0, &all[peer as usize][0], 0, 1000, None, d))?;
    ensure!(r.is_ok(), "{r:?}");
    // The peer in the half is world rank 2·peer + colour.
    let want = (2 * peer + wrank % 2) as u8;
    ensure!(b.data.iter().all(|&x| x == want), "bytes from the half's peer");
    e.barrier()?;
    e.unregister(&a.h)?;
    e.unregister(&b.h)?;
    e.finalize().map_err(|x| anyhow!("{x}"))?;
    // MPI is still the caller's.
    ensure!(mpi::environment::is_initialized() && !mpi::environment::is_finalized());
    world.barrier();
    Ok(())
}

fn driver_end() -> Result<()> {
    /// A poller that counts its closes (and closes when dropped, as the C API's does).
    struct Closing(Arc<AtomicUsize>, bool);
    impl ferry_base::poller::Poller for Closing {
        fn poll(&mut self) -> ferry_base::poller::Polled {
            ferry_base::poller::Polled {
                worked: false,
                expecting: false,
            }
        }
        fn sending(&self) -> bool {
            false
        }
        fn close(&mut self) {
            if !std::mem::replace(&mut self.1, true) {
                self.0.fetch_add(1, SeqCst);
            }
        }
    }
    impl Drop for Closing {
        fn drop(&mut self) {
            ferry_base::poller::Poller::close(self);
        }
    }
    let cfg = ferry_comm::CommConfig {
        max_sends: 4,
        max_sends_per_peer: 4,
        progress_sleep_us: None,
        faults: Default::default(),
        communicator: None,
        shareable: false,
    };
    let (h, mut d, _) = ferry_comm::start_driven(&cfg, Arc::new(Default::default())).map_err(|e| anyhow!("{e}"))?;
    let closes = Arc::new(AtomicUsize::new(0));
    h.post(ferry_comm::Cmd::Poller(Box::new(Closing(closes.clone(), false))))
        .map_err(|e| anyhow!("a poller before the stop: {e}"))?;
    d.pass();
    ensure!(closes.load(SeqCst) == 0, "the added poller is polled, not closed");
    d.stop();
    ensure!(closes.load(SeqCst) == 1, "the stop closes the loop's poller");
    let r = h.post(ferry_comm::Cmd::Poller(Box::new(Closing(closes.clone(), false))));
    ensure!(r.is_err(), "a poller posted after the stop is refused");
    ensure!(closes.load(SeqCst) == 2, "the refused poller is closed at once");
    ensure!(
        h.post(ferry_comm::Cmd::Wake).is_err(),
        "any command after the stop is refused"
    );
    Ok(())
}

fn pin_fail(e: &Engine) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let next = (rank + 1) % size;
    let dev = (rank as usize) % e.capabilities().devices.max(1);
    let len = (200 << 10) + 5;
    let dmem = e.alloc_device(dev, len)?;
    // SAFETY: a device buffer that outlives its registration (unregistered below).
    let d = unsafe { e.register(dmem.ptr() as *mut u8, len, MemKind::Device(dev as u32))? };
    let host = buf(e, (0..len).map(|i| pattern(rank, 0, i)).collect())?;
    let all = exchange(e, &[d, host.h])?;
    let (their_dev, their_host) = (&all[next as usize][0], &all[next as usize][1]);
    ensure!(
        !e.peer(next)?.gpu_direct && !e.peer(next)?.ipc,
        "the route must be staged"
    );
    // The origin's own bounce buffers: refused at the call, nothing sent.
    let r = e.get(&d, 0, their_host, 0, len, None, |_| panic!("a refused get completed"));
    ensure!(
        matches!(&r, Err(ferry_engine::EngineError::Device(x)) if x.to_string().contains("pin-fail")),
        "get into device memory: {r:?}"
    );
    let r = e.put(&d, 0, their_host, 0, len, None, |_| panic!("a refused put completed"));
    ensure!(
        matches!(&r, Err(ferry_engine::EngineError::Device(x)) if x.to_string().contains("pin-fail")),
        "put from device memory: {r:?}"
    );
    // The target's: each completes once, with its refusal.
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    e.barrier()?;
    e.get(&host.h, 0, their_dev, 0, len, None, counting(&done, &errors))?;
    e.put(&host.h, 0, their_dev, 0, len, None, counting(&done, &errors))?;
    wait_until("refusals", || done.load(SeqCst) >= 2)?;
    {
        let errs = errors.lock().unwrap();
        ensure!(
            errs.len() == 2 && errs.iter().all(|x| x.contains("pin-fail")),
            "the target's refusals: {errs:?}"
        );
    }
    e.barrier()?;
    // Host memory still moves: a second buffer of this rank gets the next rank's (which no
    // operation writes).
    let inbox = buf(e, vec![0u8; len])?;
    let got = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    e.get(&inbox.h, 0, their_host, 0, len, None, counting(&got, &errors))?;
    wait_until("a host get", || got.load(SeqCst) >= 1)?;
    ensure!(
        errors.lock().unwrap().is_empty(),
        "host get: {:?}",
        errors.lock().unwrap()
    );
    ensure!(
        inbox.data.iter().enumerate().all(|(i, &b)| b == pattern(next, 0, i)),
        "host get: wrong bytes"
    );
    e.barrier()?;
    let st = e.stats();
    ensure!(st.refused >= 2, "the target counts its refusals: {st:?}");
    e.unregister(&d)?;
    e.unregister(&host.h)?;
    e.unregister(&inbox.h)?;
    Ok(())
}

fn device(e: &Engine, direct: bool, ipc: bool, leases: bool, keep: usize) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let caps = e.capabilities();
    ensure!(caps.devices >= 1, "no devices: {caps:?}");
    let peer = e.peer(next)?;
    ensure!(
        peer.gpu_direct == direct && peer.ipc == ipc,
        "peer caps {peer:?}, gpu-direct wanted {direct}, ipc {ipc}"
    );
    let dev = (rank as usize) % caps.devices;
    let sizes = [1usize, (100 << 10) + 3, (1 << 20) + 7];
    let errors = Arc::new(Mutex::new(Vec::new()));
    for (k, &len) in sizes.iter().enumerate() {
        // This rank's data on its device and in host memory; two device and a host destination.
        let src_dev = e.alloc_device(dev, len)?;
        let dst_dev = e.alloc_device(dev, len)?;
        let dst_dev2 = e.alloc_device(dev, len)?;
        let want: Vec<u8> = (0..len).map(|i| pattern(rank, k, i)).collect();
        // SAFETY: buffers of `len` bytes on `dev`, used by nothing else now.
        unsafe {
            e.device_write(dev, src_dev.ptr(), &want)?;
            e.device_write(dev, dst_dev.ptr(), &vec![0u8; len])?;
            e.device_write(dev, dst_dev2.ptr(), &vec![0u8; len])?;
        }
        let src_host = buf(e, want.clone())?;
        let dst_host = buf(e, vec![0u8; len])?;
        // SAFETY: device buffers that outlive their registrations (unregistered below).
        let (sd, dd, dd2) = unsafe {
            (
                e.register(src_dev.ptr() as *mut u8, len, MemKind::Device(dev as u32))?,
                e.register(dst_dev.ptr() as *mut u8, len, MemKind::Device(dev as u32))?,
                e.register(dst_dev2.ptr() as *mut u8, len, MemKind::Device(dev as u32))?,
            )
        };
        let all = exchange(e, &[sd, src_host.h, dd, dst_host.h, dd2])?;
        let done = Arc::new(AtomicUsize::new(0));
        // Gets: device <- next's device (IPC when allowed), host <- next's device.
        e.get(&dd, 0, &all[next as usize][0], 0, len, None, counting(&done, &errors))?;
        e.get(
            &dst_host.h,
            0,
            &all[next as usize][0],
            0,
            len,
            None,
            counting(&done, &errors),
        )?;
        e.barrier()?;
        wait_until("device gets", || done.load(SeqCst) >= 2)?;
        e.barrier()?;
        let want_next: Vec<u8> = (0..len).map(|i| pattern(next, k, i)).collect();
        let mut back = vec![0u8; len];
        // SAFETY: as above; the gets into it have completed.
        unsafe { e.device_read(dev, dst_dev.ptr(), &mut back)? };
        ensure!(back == want_next, "get device <- device, {len} bytes: wrong bytes");
        ensure!(
            dst_host.data == want_next,
            "get host <- device, {len} bytes: wrong bytes"
        );
        // Puts into prev: host -> its second device destination, device -> its host destination,
        // device -> its device destination (IPC when allowed; the same bytes its get read).
        e.put(
            &src_host.h,
            0,
            &all[prev as usize][4],
            0,
            len,
            None,
            counting(&done, &errors),
        )?;
        e.put(&sd, 0, &all[prev as usize][3], 0, len, None, counting(&done, &errors))?;
        e.put(&sd, 0, &all[prev as usize][2], 0, len, None, counting(&done, &errors))?;
        wait_until("device puts", || done.load(SeqCst) >= 5)?;
        e.barrier()?;
        let errs = errors.lock().unwrap().clone();
        ensure!(errs.is_empty(), "failed: {errs:?}");
        // SAFETY: as above; the puts into them have completed (barrier).
        unsafe { e.device_read(dev, dst_dev.ptr(), &mut back)? };
        ensure!(back == want_next, "put device <- device, {len} bytes: wrong bytes");
        unsafe { e.device_read(dev, dst_dev2.ptr(), &mut back)? };
        ensure!(back == want_next, "put device <- host, {len} bytes: wrong bytes");
        ensure!(
            dst_host.data == want_next,
            "put host <- device, {len} bytes: wrong bytes"
        );
        for h in [&sd, &dd, &dd2, &src_host.h, &dst_host.h] {
            e.unregister(h)?;
        }
    }
    // Bytes received per path: each size arrived five times here (two gets, three puts),
    // three of them into device memory, two of those from device memory. Staged: all five in
    // chunks. GPU-direct: the three into device memory handed to MPI (the other two land in host
    // memory). IPC: the two between device memories as peer copies, the other three staged.
    let t = e.traffic();
    let got = |p| t.path(p).bytes_recv.load(SeqCst);
    use ferry_base::traffic::TrafficPath as P;
    let (staged, direct_bytes, ipc_bytes) = (got(P::Staged), got(P::GpuDirect), got(P::Ipc));
    let per_size: u64 = sizes.iter().map(|&l| l as u64).sum();
    let want = match (ipc, direct) {
        (true, false) => (3 * per_size, 0, 2 * per_size),
        (false, true) => (0, 3 * per_size, 0),
        (false, false) => (5 * per_size, 0, 0),
        (true, true) => (0, per_size, 2 * per_size),
    };
    ensure!(
        (staged, direct_bytes, ipc_bytes) == want,
        "bytes received staged / gpu-direct / ipc: {staged} / {direct_bytes} / {ipc_bytes}, want {want:?}"
    );
    // The two peer copies per size that this rank started (a get and a put between device
    // memories) took leases, with no grant asked, unless leases are off.
    let leased = e.stats().leased_copies;
    let want_leased = if ipc && leases { 2 * sizes.len() as u64 } else { 0 };
    ensure!(
        leased == want_leased,
        "leased peer copies: {leased}, want {want_leased}"
    );
    if ipc {
        // A put with a notification between device memories: under a lease it ends only when
        // the target has answered, after its handler got the notification.
        let notes = Arc::new(AtomicUsize::new(0));
        let n2 = notes.clone();
        e.register_handler(9, move |m: AmMessage| {
            assert_eq!(m.bytes, b"landed");
            n2.fetch_add(1, SeqCst);
        })?;
        let from = e.alloc_device(dev, 64)?;
        let into = e.alloc_device(dev, 64)?;
        // SAFETY: device memory that outlives its registrations (unregistered below).
        let (fh, ih) = unsafe {
            (
                e.register(from.ptr() as *mut u8, 64, MemKind::Device(dev as u32))?,
                e.register(into.ptr() as *mut u8, 64, MemKind::Device(dev as u32))?,
            )
        };
        // Counted before the handles are exchanged: no peer can put here before that.
        let notes_before = e.stats().notifications;
        let all = exchange(e, &[ih])?;
        let put_done = Arc::new(AtomicUsize::new(0));
        let before = e.stats();
        e.put(
            &fh,
            0,
            &all[prev as usize][0],
            0,
            64,
            Some(Notify {
                tag: 9,
                bytes: b"landed".to_vec(),
            }),
            counting(&put_done, &errors),
        )?;
        wait_until("put with a notification", || put_done.load(SeqCst) == 1)?;
        wait_until("its notification", || notes.load(SeqCst) == 1)?;
        let after = e.stats();
        ensure!(
            after.puts == before.puts + 1 && after.leased_copies == before.leased_copies + u64::from(leases),
            "a notified device put: {before:?} -> {after:?}"
        );
        e.barrier()?;
        let notes = e.stats().notifications;
        ensure!(
            notes == notes_before + 1,
            "notifications here: {notes}, want {}",
            notes_before + 1
        );
        e.unregister(&fh)?;
        e.unregister(&ih)?;
        e.unregister_handler(9)?;
        // A handle whose registration has ended misses the lease and is refused by its owner.
        let gone = e.alloc_device(dev, 64)?;
        // SAFETY: device memory that outlives its registration, which ends below.
        let h = unsafe { e.register(gone.ptr() as *mut u8, 64, MemKind::Device(dev as u32))? };
        let into = e.alloc_device(dev, 64)?;
        // SAFETY: as above.
        let into_h = unsafe { e.register(into.ptr() as *mut u8, 64, MemKind::Device(dev as u32))? };
        let all = exchange(e, &[h])?;
        e.unregister(&h)?;
        e.barrier()?;
        let outcome = Arc::new(Mutex::new(None));
        let o = outcome.clone();
        let leased_then = e.stats().leased_copies;
        e.get(&into_h, 0, &all[next as usize][0], 0, 64, None, move |r| {
            *o.lock().unwrap() = Some(r)
        })?;
        wait_until("get of an ended registration", || outcome.lock().unwrap().is_some())?;
        let r = outcome.lock().unwrap().take().unwrap();
        ensure!(
            matches!(&r, Err(EngineError::Remote { reason, .. }) if reason.contains("not registered")),
            "get through IPC of an ended registration: {r:?}"
        );
        ensure!(e.stats().leased_copies == leased_then, "a stale handle was leased");
        e.barrier()?;
        e.unregister(&into_h)?;
    }
    // Device memory misdeclared, or on a device this rank does not have.
    let host = buf(e, vec![0u8; 64])?;
    let d = e.alloc_device(dev, 64)?;
    // SAFETY: the registrations are refused; nothing is kept.
    unsafe {
        ensure!(
            matches!(e.register(host.data.as_ptr() as *mut u8, 64, MemKind::Device(dev as u32)), Err(EngineError::InvalidArgument(m)) if m.contains("host memory")),
            "host memory registered as device memory"
        );
        ensure!(
            matches!(e.register(d.ptr() as *mut u8, 64, MemKind::Host), Err(EngineError::InvalidArgument(m)) if m.contains("registered as host")),
            "device memory registered as host memory"
        );
        ensure!(
            matches!(
                e.register(d.ptr() as *mut u8, 64, MemKind::Device(77)),
                Err(EngineError::NoDevices(_))
            ),
            "a device this rank does not have"
        );
        if caps.devices > 1 {
            let other = (dev + 1) % caps.devices;
            ensure!(
                matches!(e.register(d.ptr() as *mut u8, 64, MemKind::Device(other as u32)), Err(EngineError::InvalidArgument(m)) if m.contains("registered as device")),
                "memory of one device registered as another's"
            );
        }
        let h = e.register(d.ptr() as *mut u8, 64, MemKind::Device(dev as u32))?;
        if !direct {
            ensure!(
                matches!(e.send(&h, 0, 64, next, 1, |_| {}), Err(EngineError::NoDevices(m)) if m.contains("GPU-direct")),
                "two-sided device memory without GPU-direct"
            );
        }
        e.unregister(&h)?;
    }
    e.unregister(&host.h)?;
    e.barrier()?;
    // Peers' allocations mapped for the copies above (a fresh pair per size): once idle, kept
    // up to the bound and closed past it.
    let mapped = e.stats().ipc_mappings as usize;
    if ipc {
        ensure!(mapped <= keep, "{mapped} mappings open, at most {keep} kept");
        ensure!(keep < 6 || mapped >= 6, "{mapped} mappings kept of 6 or more");
    } else {
        ensure!(mapped == 0, "{mapped} mappings without the IPC route");
    }
    Ok(())
}

/// A stream of the CUDA device `dev` (its primary context, the engine's), and a copy of `len`
/// bytes of device memory at `src` into host memory enqueued on it, waited for.
#[derive(Default)]
struct UserStream {
    cuda: Option<(Arc<cudarc::driver::CudaContext>, Arc<cudarc::driver::CudaStream>)>,
}

impl UserStream {
    fn new(cuda: bool, dev: usize) -> Result<UserStream> {
        if !cuda {
            return Ok(UserStream::default());
        }
        let ctx = cudarc::driver::CudaContext::new(dev).map_err(|e| anyhow!("CUDA context: {e:?}"))?;
        let stream = ctx.new_stream().map_err(|e| anyhow!("CUDA stream: {e:?}"))?;
        Ok(UserStream {
            cuda: Some((ctx, stream)),
        })
    }

    /// The `CUstream` as the engine takes it (0 for emulated devices, which ignore it).
    fn raw(&self) -> u64 {
        self.cuda.as_ref().map_or(0, |(_, s)| s.cu_stream() as u64)
    }

    /// With CUDA: the bytes at `src` as a copy on the stream sees them, read with no host wait
    /// for the engine in between. `None` on emulated devices.
    fn read_in_order(&self, src: u64, len: usize) -> Result<Option<Vec<u8>>> {
        let Some((ctx, stream)) = &self.cuda else {
            return Ok(None);
        };
        ctx.bind_to_thread().map_err(|e| anyhow!("{e:?}"))?;
        use cudarc::driver::result;
        // Pinned memory, so that the copy is enqueued and the call returns at once (a pageable
        // copy would block this thread inside the driver until the stream reached it).
        // SAFETY: a fresh allocation of `len` bytes, freed below after the stream is synchronized.
        let host = unsafe { result::malloc_host(len, 0) }.map_err(|e| anyhow!("cuMemHostAlloc: {e:?}"))?;
        // SAFETY: `src` is device memory of `len` bytes that outlives the copy; `host` holds
        // `len` bytes until it is freed below, after the synchronization.
        let copied = unsafe {
            let dst = std::slice::from_raw_parts_mut(host as *mut u8, len);
            result::memcpy_dtoh_async(dst, src, stream.cu_stream())
                .map_err(|e| anyhow!("cuMemcpyDtoHAsync: {e:?}"))
                .and_then(|_| stream.synchronize().map_err(|e| anyhow!("cuStreamSynchronize: {e:?}")))
                .map(|_| std::slice::from_raw_parts(host as *const u8, len).to_vec())
        };
        // SAFETY: allocated above, no longer in use.
        let _ = unsafe { result::free_host(host) };
        copied.map(Some)
    }
}

fn stream(e: &Engine, cuda: bool, leases: bool) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let next = (rank + 1) % size;
    let dev = rank as usize % e.capabilities().devices.max(1);
    let user = UserStream::new(cuda, dev)?;
    // Large enough that a copy not ordered after the get would read the zeros first.
    let len = (16 << 20) + 3;
    let want: Vec<u8> = (0..len).map(|i| pattern(rank, 3, i)).collect();
    let src = e.alloc_device(dev, len)?;
    let dst = e.alloc_device(dev, len)?;
    // SAFETY: buffers of `len` bytes on `dev`, used by nothing else now.
    unsafe {
        e.device_write(dev, src.ptr(), &want)?;
        e.device_write(dev, dst.ptr(), &vec![0u8; len])?;
    }
    // SAFETY: device buffers that outlive their registrations (unregistered below).
    let (sh, dh) = unsafe {
        (
            e.register(src.ptr() as *mut u8, len, MemKind::Device(dev as u32))?,
            e.register(dst.ptr() as *mut u8, len, MemKind::Device(dev as u32))?,
        )
    };
    let all = exchange(e, &[sh])?;
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let leased_before = e.stats().leased_copies;
    let direct_path = |e: &Engine| {
        e.traffic()
            .path(ferry_base::traffic::TrafficPath::GpuDirect)
            .bytes_recv
            .load(SeqCst)
    };
    let direct_before = direct_path(e);
    e.get_on_stream(
        &dh,
        0,
        &all[next as usize][0],
        0,
        len,
        None,
        user.raw(),
        counting(&done, &errors),
    )?;
    let want_next: Vec<u8> = (0..len).map(|i| pattern(next, 3, i)).collect();
    if let Some(seen) = user.read_in_order(dst.ptr(), len)? {
        ensure!(
            seen == want_next,
            "a copy ordered after the get on its stream read other bytes"
        );
    }
    wait_until("stream-ordered get", || done.load(SeqCst) == 1)?;
    let errs = errors.lock().unwrap().clone();
    ensure!(errs.is_empty(), "stream-ordered get failed: {errs:?}");
    let mut back = vec![0u8; len];
    // SAFETY: as above; the get has completed.
    unsafe { e.device_read(dev, dst.ptr(), &mut back)? };
    ensure!(back == want_next, "stream-ordered get: wrong bytes");
    // On the IPC route with leases the stream waited for the peer copy's event; otherwise
    // for the word the completion wrote.
    let leased = e.stats().leased_copies - leased_before;
    ensure!(
        leased == u64::from(leases),
        "leased copies: {leased}, want {}",
        u64::from(leases)
    );
    // Never handed to MPI as device memory, even where GPU-direct is allowed.
    ensure!(direct_path(e) == direct_before, "a stream-ordered get went GPU-direct");
    // Host memory is no stream's destination.
    let host = buf(e, vec![0u8; 64])?;
    ensure!(
        matches!(
            e.get_on_stream(&host.h, 0, &all[next as usize][0], 0, 64, None, user.raw(), |_| {}),
            Err(EngineError::InvalidArgument(m)) if m.contains("device destination")
        ),
        "a stream-ordered get into host memory"
    );
    // A refused get releases the stream: a copy after it completes, and `done` says why.
    e.barrier()?;
    e.unregister(&sh)?;
    e.barrier()?;
    let refused = Arc::new(Mutex::new(None));
    let r2 = refused.clone();
    e.get_on_stream(&dh, 0, &all[next as usize][0], 0, 64, None, user.raw(), move |r| {
        *r2.lock().unwrap() = Some(r)
    })?;
    user.read_in_order(dst.ptr(), 64)?;
    wait_until("refused stream-ordered get", || refused.lock().unwrap().is_some())?;
    let r = refused.lock().unwrap().take().unwrap();
    ensure!(
        matches!(&r, Err(EngineError::Remote { reason, .. }) if reason.contains("not registered")),
        "stream-ordered get of an ended registration: {r:?}"
    );
    e.barrier()?;
    e.unregister(&dh)?;
    e.unregister(&host.h)?;
    e.barrier()?;
    Ok(())
}

/// The bytes of a placement whose get has landed, wherever it landed (device or host memory).
fn placed_bytes(e: &Engine, p: &ferry_engine::Placed) -> Result<Vec<u8>> {
    let mut bytes = vec![0u8; p.len()];
    match p.device() {
        // SAFETY: a landed placement of `len` bytes on device `d`.
        Some(d) => unsafe { e.device_read(d, p.addr(), &mut bytes)? },
        // SAFETY: host memory of `len` bytes, landed.
        None => bytes.copy_from_slice(unsafe { std::slice::from_raw_parts(p.addr() as *const u8, p.len()) }),
    }
    Ok(bytes)
}

/// A framework's device pool as the placer scenario sees it: `slots` parts of `PART` bytes in
/// one allocation, some of them holding the framework's own data, which it may evict.
struct SlotPlacer {
    device: usize,
    base: u64,
    part: usize,
    slots: Mutex<Vec<Slot>>,
    released: AtomicUsize,
    evicted: AtomicUsize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Slot {
    Free,
    Placed,
    /// The framework's own data: evicted when a placement needs the room.
    Cached,
}

impl ferry_engine::Placer for SlotPlacer {
    fn place(&self, device: usize, lens: &[usize]) -> Option<Vec<u64>> {
        if device != self.device || lens.iter().any(|&l| l > self.part) {
            return None;
        }
        let mut slots = self.slots.lock().unwrap();
        let room = slots.iter().filter(|s| **s != Slot::Placed).count();
        if room < lens.len() {
            return None;
        }
        // Free slots first, then evict.
        let mut order: Vec<usize> = (0..slots.len()).filter(|&i| slots[i] == Slot::Free).collect();
        order.extend((0..slots.len()).filter(|&i| slots[i] == Slot::Cached));
        let taken: Vec<usize> = order.into_iter().take(lens.len()).collect();
        for &i in &taken {
            if slots[i] == Slot::Cached {
                self.evicted.fetch_add(1, SeqCst);
            }
            slots[i] = Slot::Placed;
        }
        Some(taken.iter().map(|&i| self.base + (i * self.part) as u64).collect())
    }

    fn release(&self, device: usize, addr: u64, len: usize) {
        let i = ((addr - self.base) as usize) / self.part;
        let mut slots = self.slots.lock().unwrap();
        assert!(
            device == self.device && len <= self.part && slots[i] == Slot::Placed,
            "release of {addr:#x} ({len} bytes on {device}): slot {i} is {:?}",
            slots[i]
        );
        slots[i] = Slot::Free;
        self.released.fetch_add(1, SeqCst);
    }
}

fn placer(e: &Engine) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let next = (rank + 1) % size;
    const PART: usize = 100 << 10;
    let dev = rank as usize % e.capabilities().devices.max(1);
    let src = buf(e, (0..4 * PART).map(|i| pattern(rank, 0, i)).collect())?;
    let all = exchange(e, &[src.h])?;
    let remote = all[next as usize][0];
    let want = |i: usize| -> Vec<u8> { (i * PART..(i + 1) * PART).map(|j| pattern(next, 0, j)).collect() };
    // The framework's pool: three parts, the last holding its own data.
    let pool = e.alloc_device(dev, 3 * PART)?;
    let p = Arc::new(SlotPlacer {
        device: dev,
        base: pool.ptr(),
        part: PART,
        slots: Mutex::new(vec![Slot::Free, Slot::Free, Slot::Cached]),
        released: AtomicUsize::new(0),
        evicted: AtomicUsize::new(0),
    });
    e.set_placer(Some(p.clone()));
    let inside = |x: &ferry_engine::Placed| {
        x.device() == Some(dev) && x.addr() >= pool.ptr() && x.addr() < pool.ptr() + (3 * PART) as u64
    };
    let group = |parts: &[usize]| -> Result<Vec<ferry_engine::Placed>> {
        let requests: Vec<PlacedRequest> = parts
            .iter()
            .map(|&i| PlacedRequest {
                remote,
                offset: i * PART,
                len: PART,
                notify: None,
            })
            .collect();
        let slot = Arc::new(Mutex::new(None));
        let s2 = slot.clone();
        e.get_placed_all(dev, &requests, move |r| *s2.lock().unwrap() = Some(r))?;
        wait_until("a group of placed gets", || slot.lock().unwrap().is_some())?;
        let got = slot.lock().unwrap().take().unwrap().map_err(|x| anyhow!("{x}"))?;
        for (x, &i) in got.iter().zip(parts) {
            ensure!(placed_bytes(e, x)? == want(i), "placed part {i}: wrong bytes");
        }
        Ok(got)
    };
    // Three parts, one at a time: the pool's two free slots, then its cached data evicted.
    let mut held = Vec::new();
    for i in 0..3 {
        held.extend(group(&[i])?);
    }
    ensure!(held.iter().all(inside), "placements outside the framework's pool");
    ensure!(p.evicted.load(SeqCst) == 1, "evictions: {}", p.evicted.load(SeqCst));
    // The pool is full of placements: the next one lands in host memory.
    let extra = group(&[3])?;
    ensure!(
        extra[0].device().is_none(),
        "a fourth placement on {:?}",
        extra[0].device()
    );
    drop(extra);
    ensure!(p.released.load(SeqCst) == 0, "host memory released to the placer");
    held.clear();
    ensure!(
        p.released.load(SeqCst) == 3,
        "released {} of 3",
        p.released.load(SeqCst)
    );
    // Groups: three fit (all in the pool), four do not (all in host memory, none in the pool).
    let three = group(&[0, 1, 2])?;
    ensure!(three.iter().all(inside), "a group of three outside the pool");
    drop(three);
    let four = group(&[0, 1, 2, 3])?;
    ensure!(
        four.iter().all(|x| x.device().is_none()),
        "a group of four split: {:?}",
        four.iter().map(|x| x.device()).collect::<Vec<_>>()
    );
    drop(four);
    ensure!(
        p.released.load(SeqCst) == 6,
        "released {} of 6",
        p.released.load(SeqCst)
    );
    // Without the placer, the engine places again (its arena).
    e.set_placer(None);
    let own = group(&[1])?;
    ensure!(own[0].in_arena(), "without a placer: not in the arena");
    drop(own);
    ensure!(
        e.stats().registrations == 1,
        "registrations left: {}",
        e.stats().registrations
    );
    e.barrier()?;
    e.unregister(&src.h)?;
    drop(pool);
    Ok(())
}

fn placed(e: &Engine, budget: Option<usize>, arena: usize) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let next = (rank + 1) % size;
    const PART: usize = 100 << 10;
    let dev = rank as usize % e.capabilities().devices.max(1);
    let src = buf(e, (0..3 * PART).map(|i| pattern(rank, 0, i)).collect())?;
    let mut inbox = buf(e, vec![0u8; PART])?;
    let all = exchange(e, &[src.h])?;
    let remote = all[next as usize][0];
    let want = |i: usize| -> Vec<u8> { (i * PART..(i + 1) * PART).map(|j| pattern(next, 0, j)).collect() };
    // Three parts: with a budget of 2.5 parts the third lands in host memory.
    let slots: Arc<Mutex<Vec<Option<ferry_engine::Placed>>>> = Arc::new(Mutex::new((0..3).map(|_| None).collect()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    for i in 0..3 {
        let (slots, errors) = (slots.clone(), errors.clone());
        e.get_placed(dev, &remote, i * PART, PART, None, move |r| match r {
            Ok(p) => slots.lock().unwrap()[i] = Some(p),
            Err(x) => errors.lock().unwrap().push(x.to_string()),
        })?;
    }
    wait_until("placed gets", || {
        slots.lock().unwrap().iter().all(Option::is_some) || !errors.lock().unwrap().is_empty()
    })?;
    let errs = errors.lock().unwrap().clone();
    ensure!(errs.is_empty(), "placed gets failed: {errs:?}");
    {
        let placed = slots.lock().unwrap();
        let places: Vec<Option<usize>> = placed.iter().map(|p| p.as_ref().unwrap().device()).collect();
        let expect_host = budget.is_some_and(|b| b < 3 * PART);
        ensure!(
            places[..2] == [Some(dev), Some(dev)] && places[2] == if expect_host { None } else { Some(dev) },
            "placements {places:?} (budget {budget:?})"
        );
        // With an arena (capped by the budget), the device placements are blocks of it.
        let arenas: Vec<bool> = placed.iter().map(|p| p.as_ref().unwrap().in_arena()).collect();
        let on_device = |p: &Option<usize>| p.is_some();
        ensure!(
            arenas == places.iter().map(|p| on_device(p) && arena > 0).collect::<Vec<_>>(),
            "in the arena: {arenas:?}, placements {places:?} (arena {arena})"
        );
        let (used, capacity) = e.placement_arena(dev);
        let in_arena = arenas.iter().filter(|&&a| a).count() as u64;
        ensure!(
            used == in_arena * PART as u64
                && capacity
                    == if arena == 0 {
                        0
                    } else {
                        budget.unwrap_or(arena).min(arena) as u64
                    },
            "arena usage {used} of {capacity} with {in_arena} parts in it"
        );
        for (i, p) in placed.iter().enumerate() {
            ensure!(
                placed_bytes(e, p.as_ref().unwrap())? == want(i),
                "placed part {i}: wrong bytes"
            );
        }
        // The placed memory is registered: forward part 0 (on the device) into this rank's inbox.
        let r = outcome(|d| e.put(placed[0].as_ref().unwrap().handle(), 0, &inbox.h, 0, PART, None, d))?;
        ensure!(r.is_ok(), "forwarding placed memory: {r:?}");
        ensure!(inbox.data == want(0), "forwarded bytes");
        // A peer reads placed memory too (through IPC with --ipc: the arena's export at the
        // block's offset): the previous rank's part 1 holds this rank's second part.
        let prev = (rank + size - 1) % size;
        let theirs = exchange(e, &[*placed[1].as_ref().unwrap().handle()])?;
        inbox.data.fill(0);
        let r = outcome(|d| e.get(&inbox.h, 0, &theirs[prev as usize][0], 0, PART, None, d))?;
        ensure!(r.is_ok(), "reading a peer's placed memory: {r:?}");
        let mine: Vec<u8> = (PART..2 * PART).map(|j| pattern(rank, 0, j)).collect();
        ensure!(inbox.data == mine, "a peer's placed memory: wrong bytes");
        e.barrier()?;
    }
    // Dropped: registrations end, the budget comes back, a new get lands on the device again.
    let regs = e.stats().registrations;
    slots.lock().unwrap().clear();
    ensure!(e.stats().registrations == regs - 3, "placed registrations not ended");
    let again = Arc::new(Mutex::new(None));
    let a = again.clone();
    e.get_placed(dev, &remote, 2 * PART, PART, None, move |r| {
        *a.lock().unwrap() = Some(r)
    })?;
    wait_until("a placed get after the drop", || again.lock().unwrap().is_some())?;
    let p = again.lock().unwrap().take().unwrap().map_err(|x| anyhow!("{x}"))?;
    ensure!(p.device() == Some(dev), "after the drop, placed on {:?}", p.device());
    drop(p);
    ensure!(
        e.placement_arena(dev).0 == 0,
        "the arena keeps {} bytes",
        e.placement_arena(dev).0
    );
    // A task's three inputs placed together: all on the device when all fit, else all in host
    // memory (never two on the device and the third waiting).
    let requests: Vec<PlacedRequest> = (0..3)
        .map(|i| PlacedRequest {
            remote,
            offset: i * PART,
            len: PART,
            notify: None,
        })
        .collect();
    let group = Arc::new(Mutex::new(None));
    let g = group.clone();
    e.get_placed_all(dev, &requests, move |r| *g.lock().unwrap() = Some(r))?;
    wait_until("a group of placed gets", || group.lock().unwrap().is_some())?;
    let all = group.lock().unwrap().take().unwrap().map_err(|x| anyhow!("{x}"))?;
    let places: Vec<Option<usize>> = all.iter().map(|p| p.device()).collect();
    let fits = budget.is_none_or(|b| b >= 3 * PART);
    ensure!(
        places == vec![if fits { Some(dev) } else { None }; 3],
        "a group placed at {places:?} (budget {budget:?})"
    );
    for (i, p) in all.iter().enumerate() {
        ensure!(placed_bytes(e, p)? == want(i), "group part {i}: wrong bytes");
    }
    drop(all);
    ensure!(e.placement_arena(dev).0 == 0, "the group's blocks not returned");
    ensure!(matches!(
        e.get_placed_all(dev, &[], |_| {}),
        Err(EngineError::InvalidArgument(_))
    ));
    ensure!(matches!(
        e.get_placed(77, &remote, 0, 8, None, |_| {}),
        Err(EngineError::NoDevices(_))
    ));
    e.barrier()?;
    inbox.data.fill(0);
    e.unregister(&src.h)?;
    e.unregister(&inbox.h)?;
    Ok(())
}

/// This process's rank in `MPI_COMM_WORLD`, from the launcher's environment (before MPI is up).
fn peer_map(e: &Engine) -> Result<()> {
    let (rank, size) = (e.rank(), e.size() as i32);
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let caps = e.capabilities();
    ensure!(caps.devices >= 1, "no devices: {caps:?}");
    ensure!(
        e.peer(next)?.ipc,
        "rank {next} is not on the IPC route (run with --ipc)"
    );
    let dev = rank as usize % caps.devices;
    let len = (256 << 10) + 5;
    let mem = e.alloc_device(dev, len)?;
    let mine: Vec<u8> = (0..len).map(|i| pattern(rank, 0, i)).collect();
    // SAFETY: `len` bytes on `dev`, used by nothing else now.
    unsafe { e.device_write(dev, mem.ptr(), &mine)? };
    // SAFETY: the buffer outlives its registration (unregistered below).
    let h = unsafe { e.register(mem.ptr() as *mut u8, len, MemKind::Device(dev as u32))? };
    ensure!(e.exported(&h)?, "a device registration with IPC on was not exported");
    let host = buf(e, vec![0u8; 64])?;
    ensure!(!e.exported(&host.h)?, "a host registration was exported");
    let all = exchange(e, &[h, host.h])?;
    let theirs = all[next as usize][0];
    let refused = |what: &str, r: ferry_engine::Result<ferry_engine::PeerMapping>, ok: fn(&EngineError) -> bool| match r
    {
        Err(x) if ok(&x) => Ok(()),
        other => Err(anyhow!("{what}: {other:?}")),
    };
    refused("map_peer of this rank's own registration", e.map_peer(&h, dev), |x| {
        matches!(x, EngineError::InvalidArgument(_))
    })?;
    refused(
        "map_peer of host memory",
        e.map_peer(&all[next as usize][1], dev),
        |x| matches!(x, EngineError::InvalidArgument(_)),
    )?;
    refused("map_peer on an absent device", e.map_peer(&theirs, caps.devices), |x| {
        matches!(x, EngineError::NoDevices(_))
    })?;
    let m = e.map_peer(&theirs, dev)?;
    ensure!(
        m.len() == len && m.peer() == next && m.device() == dev,
        "mapping {m:?} of {len} bytes of rank {next}"
    );
    let second = e.map_peer(&theirs, dev)?;
    ensure!(
        second.addr() == m.addr(),
        "a second mapping of one allocation opened it again"
    );
    ensure!(e.stats().ipc_mappings >= 1, "no mapping open: {:?}", e.stats());
    let mut back = vec![0u8; len];
    // SAFETY: the mapping of `len` bytes on `dev`; its owner writes it no more until the
    // barriers below.
    unsafe { e.device_read(dev, m.addr(), &mut back)? };
    ensure!(
        back.iter().enumerate().all(|(i, &b)| b == pattern(next, 0, i)),
        "the mapping does not hold rank {next}'s bytes"
    );
    e.barrier()?;
    // Every rank holds a mapping of its successor's registration now: this one is held.
    match e.unregister(&h) {
        Err(EngineError::Busy { .. }) => {}
        other => bail!("unregister while a peer maps it: {other:?}"),
    }
    e.barrier()?;
    let mark: Vec<u8> = (0..len).map(|i| pattern(rank, 1, i)).collect();
    // SAFETY: as above; the owner reads it only after the barrier below.
    unsafe { e.device_write(dev, m.addr(), &mark)? };
    drop(second);
    drop(m);
    e.barrier()?;
    // SAFETY: this rank's own buffer; its predecessor wrote it before the barrier.
    unsafe { e.device_read(dev, mem.ptr(), &mut back)? };
    ensure!(
        back.iter().enumerate().all(|(i, &b)| b == pattern(prev, 1, i)),
        "rank {prev}'s writes through its mapping did not land in this rank's memory"
    );
    e.unregister(&h)?;
    e.barrier()?;
    refused("map_peer of an ended registration", e.map_peer(&theirs, dev), |x| {
        matches!(x, EngineError::NotRegistered { .. })
    })?;
    Ok(())
}

fn world_rank() -> i32 {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// A poller that counts the passes that ran it.
struct CountingPoller(Arc<AtomicUsize>);

impl ferry_engine::Poller for CountingPoller {
    fn poll(&mut self) -> ferry_engine::Polled {
        self.0.fetch_add(1, SeqCst);
        ferry_engine::Polled {
            worked: false,
            expecting: false,
        }
    }
    fn sending(&self) -> bool {
        false
    }
    fn close(&mut self) {}
}

fn messages(e: &Engine, no_am: bool, caller_driven: bool) -> Result<()> {
    use ferry_engine::{Bytes, Lane, Message, TrafficPath};
    let (rank, size) = (e.rank(), e.size() as i32);
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let polls = Arc::new(AtomicUsize::new(0));
    e.add_poller(Box::new(CountingPoller(polls.clone())))?;
    // Message k on lane l has a length of its own, so that one matched out of order fails its
    // receive (lengths must agree) or lands the wrong bytes.
    let n = 16usize;
    let len = |lane: usize, k: usize| 100 + 37 * k + 1000 * lane;
    let fill =
        |r: i32, lane: usize, k: usize| -> Vec<u8> { (0..len(lane, k)).map(|i| pattern(r, 2 * k + lane, i)).collect() };
    let lanes = [Lane::Data, Lane::Control];
    let done = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let count = |done: &Done| -> ferry_engine::Done {
        let (done, errors) = (done.clone(), errors.clone());
        Box::new(move |r| {
            if let Err(x) = r {
                errors.lock().unwrap().push(x.to_string());
            }
            done.fetch_add(1, SeqCst);
        })
    };
    let msg = |region: Arc<dyn ferry_engine::MemRegion>, peer: i32, lane: Lane, done: ferry_engine::Done| Message {
        region,
        peer,
        tag: 7,
        lane,
        path: TrafficPath::HostEager,
        counts: true,
        eager: true,
        done,
    };
    // Receives on both lanes, with the same tag, posted before any send.
    let mut landing = Vec::new();
    for k in 0..n {
        for (l, &lane) in lanes.iter().enumerate() {
            let b = Bytes::new(vec![0u8; len(l, k)]);
            e.recv_message(msg(b.clone(), prev, lane, count(&done)))?;
            landing.push((l, k, b));
        }
    }
    let before = e.traffic().path(TrafficPath::HostEager).bytes_sent.load(SeqCst);
    e.barrier()?;
    // The control lane's messages go first: they must not match the data lane's receives.
    for (l, &lane) in lanes.iter().enumerate().rev() {
        for k in 0..n {
            e.send_message(msg(Bytes::new(fill(rank, l, k)), next, lane, count(&done)))?;
        }
    }
    wait_until("message completions", || done.load(SeqCst) >= 4 * n)?;
    let errs = errors.lock().unwrap().clone();
    ensure!(errs.is_empty(), "messages failed: {errs:?}");
    for (l, k, b) in landing {
        let mut b = b;
        let got = loop {
            match Bytes::into_vec(b) {
                Ok(v) => break v,
                Err(back) => {
                    b = back;
                    std::thread::yield_now();
                }
            }
        };
        ensure!(
            got == fill(prev, l, k),
            "message {k} on lane {l} from rank {prev}: wrong bytes"
        );
    }
    let sent: usize = (0..n).map(|k| len(0, k) + len(1, k)).sum();
    let after = e.traffic().path(TrafficPath::HostEager).bytes_sent.load(SeqCst);
    ensure!(
        after - before == sent as u64,
        "counted {} bytes sent, sent {sent}",
        after - before
    );
    // Bad peers and tags are refused at once, and their callbacks dropped unrun.
    let ran = Arc::new(AtomicUsize::new(0));
    let flag = |ran: &Arc<AtomicUsize>| -> ferry_engine::Done {
        let ran = ran.clone();
        Box::new(move |_| {
            ran.fetch_add(1, SeqCst);
        })
    };
    let tag_ub = e.mpi_info().tag_ub;
    for (peer, tag, want) in [
        (size, 1, "not in the job"),
        (next, -1, "outside 0..="),
        (next, tag_ub.saturating_add(1), "outside 0..="),
    ] {
        if tag == tag_ub && tag_ub == i32::MAX {
            continue;
        }
        let m = Message {
            tag,
            ..msg(Bytes::new(vec![0; 4]), peer, Lane::Data, flag(&ran))
        };
        match e.send_message(m) {
            Err(x) if x.to_string().contains(want) => {}
            other => bail!("a message to rank {peer} with tag {tag}: {other:?}"),
        }
    }
    ensure!(ran.load(SeqCst) == 0, "a refused message ran its callback");
    // Agreement: rank 1 (or 0 alone) fails; then every rank succeeds.
    let failing = 1.min(size - 1);
    let mine = if rank == failing {
        Err(format!("disk full on {rank}"))
    } else {
        Ok(vec![rank as u8])
    };
    match e.agree(&mine)? {
        Err((r, m)) if r == failing as usize && m == format!("disk full on {failing}") => {}
        other => bail!("agree with rank {failing} failing: {other:?}"),
    }
    let all = e
        .agree(&Ok(vec![rank as u8; 3]))?
        .map_err(|x| anyhow!("agree: {x:?}"))?;
    ensure!(
        all == (0..size).map(|r| vec![r as u8; 3]).collect::<Vec<_>>(),
        "agreed payloads {all:?}"
    );
    // Clock synchronisation: rank 0 is its own reference; the others measured a round trip.
    fn now_us() -> f64 {
        static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        T0.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e6
    }
    let pair = e.sync_clocks(now_us)?;
    ensure!(
        pair.rtt_us.is_finite() && (rank == 0) == (pair.rtt_us == 0.0) && pair.local_us.is_finite(),
        "clock pair {pair:?}"
    );
    e.barrier()?;
    ensure!(polls.load(SeqCst) > 0, "the poller never ran");
    // A loop the caller drives has nothing to share (and asking must not wait for it).
    if caller_driven {
        match e.share_progress(Duration::from_micros(200)) {
            Err(EngineError::InvalidArgument(m)) if m.contains("Progress::Caller") => {}
            other => bail!("share_progress of a caller-driven engine: {:?}", other.map(|_| ())),
        }
    }
    if no_am {
        let refused = |what: &str, r: ferry_engine::Result<()>| -> Result<()> {
            match r {
                Err(EngineError::InvalidArgument(m)) if m.contains("active messages are off") => Ok(()),
                other => bail!("{what} without active messages: {other:?}"),
            }
        };
        refused("send_am", e.send_am(1, next, b"x"))?;
        refused("register_handler", e.register_handler(1, |_| {}))?;
        let b = buf(e, vec![0u8; 64])?;
        let theirs = exchange(e, std::slice::from_ref(&b.h))?;
        refused("get", e.get(&b.h, 0, &theirs[next as usize][0], 0, 64, None, |_| {}))?;
        refused("put", e.put(&b.h, 0, &theirs[next as usize][0], 0, 64, None, |_| {}))?;
        e.barrier()?;
        e.unregister(&b.h)?;
    }
    Ok(())
}
