//! The correctness oracle of the whole runtime: a random task graph (random tiles, random
//! read/write sets, random placements) whose task bodies mix a hash of their inputs into their
//! outputs. Run under `mpirun`, the final tiles gathered on rank 0 must equal a sequential
//! execution of the same sequence, bit for bit. Any missed dependency, wrong transfer, lost
//! write-back or reordering changes the hashes.
//!
//! Part writes (`rw_part`) are among the modes: the k-th of a run of consecutive part writes of
//! a tile owns the elements `e ≡ k (mod PARTS)`, reads and writes only those, and may run
//! alongside the run's other members; a lost part, or a member that saw another's write,
//! changes the hashes too.
//!
//! Exit status 0 and a line `oracle ok ...` on success; 1 and a message otherwise.

use anyhow::{bail, Context};
use clap::Parser;
use ferry::{Access, Distribution, ProcessGrid, Runtime, Task, TaskClass, TaskContext, TaskError};

#[derive(Parser, Debug)]
struct Args {
    /// Seed of the graph.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Number of tasks.
    #[arg(long, default_value_t = 300)]
    tasks: usize,
    /// Most tiles a task accesses.
    #[arg(long, default_value_t = 4)]
    max_access: usize,
    /// Probability (percent) that a task is placed on a random rank instead of owner-computes.
    #[arg(long, default_value_t = 15)]
    override_pct: u64,
    /// Make rank 1 insert a different sequence (to test mismatch detection).
    #[arg(long)]
    mismatch: bool,
    /// Make rank 1 insert a task with a different argument only (same transfers: caught by the
    /// graph hash at `wait`).
    #[arg(long)]
    mismatch_args: bool,
    /// Make the task in the middle of the sequence hang (sleep for an hour) on this rank, to test
    /// the watchdog.
    #[arg(long)]
    stall_rank: Option<i32>,
    /// Make the task in the middle of the sequence fail (its body returns an error) on the
    /// rank that runs it, to test that every rank's `wait` then fails instead of hanging.
    #[arg(long)]
    fail_middle: bool,
    /// Insert in several epochs separated by `wait`.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Insert each epoch's tasks this many times in a row (with other task ids, so other
    /// results), to exercise traces.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Insert each repetition as a trace (`Runtime::trace`, one id per epoch): the first records,
    /// later ones replay.
    #[arg(long)]
    replay: bool,
    /// In the last repetition of the first epoch, change the middle task's first access on this
    /// rank (-1: on every rank), to test that a replay refuses a sequence other than its
    /// recording.
    #[arg(long)]
    replay_differs: Option<i32>,
    /// Every task GPU-capable and no part writes (read-write instead): on one rank with one
    /// device, each replayed repetition then runs as one fused launch.
    #[arg(long)]
    fusable: bool,
    /// After inserting the first epoch, this rank's program gives up without `wait` (it drops
    /// the runtime, half a second later: its tasks have run by then) while the others wait and
    /// then stop: to test that shutdown makes the `wait` its program owes them.
    #[arg(long)]
    give_up_on: Option<i32>,
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn mix(h: u64, v: u64) -> u64 {
    let mut s = h.rotate_left(7) ^ v;
    splitmix(&mut s)
}

/// Collection layout: (rows, cols, tile rows, tile cols), ragged on purpose.
const LAYOUTS: [(usize, usize, usize, usize); 3] = [(9, 7, 4, 3), (5, 11, 2, 4), (13, 1, 3, 1)];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    R,
    W,
    Rw,
    /// The k-th member of a run of part writes: elements `e ≡ k (mod PARTS)`.
    Part(usize),
}

/// Most members of a run of part writes (each owns one residue class of the elements).
const PARTS: usize = 4;

impl Mode {
    /// How a task's argument encodes it: 0 R, 1 W, 2 RW, 3 + k part k.
    fn code(self) -> i64 {
        match self {
            Mode::R => 0,
            Mode::W => 1,
            Mode::Rw => 2,
            Mode::Part(k) => 3 + k as i64,
        }
    }

    /// The mode of [`Mode::code`] `c`.
    fn from_code(c: i64) -> Mode {
        match c {
            0 => Mode::R,
            1 => Mode::W,
            2 => Mode::Rw,
            p => Mode::Part((p - 3) as usize),
        }
    }
}

#[derive(Clone, Debug)]
struct Acc {
    coll: usize,
    i: usize,
    j: usize,
    mode: Mode,
}

#[derive(Clone, Debug)]
struct TaskDesc {
    id: u64,
    acc: Vec<Acc>,
    on: Option<i32>,
}

fn gen_graph(args: &Args, size: usize) -> Vec<TaskDesc> {
    let mut s = args.seed;
    let mut tasks = Vec::with_capacity(args.tasks);
    // Per tile: members of the current run of part writes (any other access ends it).
    let mut runs: std::collections::HashMap<(usize, usize, usize), usize> = Default::default();
    for id in 0..args.tasks as u64 {
        let n = 1 + (splitmix(&mut s) as usize) % args.max_access;
        let mut acc: Vec<Acc> = Vec::new();
        while acc.len() < n {
            let coll = (splitmix(&mut s) as usize) % LAYOUTS.len();
            let (m, nn, mb, nb) = LAYOUTS[coll];
            let (i, j) = (
                (splitmix(&mut s) as usize) % m.div_ceil(mb),
                (splitmix(&mut s) as usize) % nn.div_ceil(nb),
            );
            if acc.iter().any(|a| a.coll == coll && a.i == i && a.j == j) {
                continue;
            }
            let run = runs.entry((coll, i, j)).or_default();
            let mode = match splitmix(&mut s) % 4 {
                0 => Mode::R,
                1 => Mode::W,
                3 if *run < PARTS && !args.fusable => Mode::Part(*run),
                _ => Mode::Rw,
            };
            *run = if let Mode::Part(k) = mode { k + 1 } else { 0 };
            acc.push(Acc { coll, i, j, mode });
        }
        let on = (splitmix(&mut s) % 100 < args.override_pct).then(|| (splitmix(&mut s) % size as u64) as i32);
        tasks.push(TaskDesc { id, acc, on });
    }
    tasks
}

/// The task body: one hash over the task id and every input, then every output tile is filled
/// from it (RW tiles also fold in their old values; a part write touches its elements only and
/// folds in their old values).
fn body(id: u64, inputs: &[&[u64]], outputs: &mut [(&mut [u64], Mode)]) {
    let mut h = mix(0x5eed, id);
    for t in inputs {
        for &x in t.iter() {
            h = mix(h, x);
        }
    }
    for (k, (t, mode)) in outputs.iter_mut().enumerate() {
        for (e, x) in t.iter_mut().enumerate() {
            let old = match *mode {
                Mode::Part(p) if e % PARTS != p => continue,
                Mode::W => 0,
                _ => *x,
            };
            *x = mix(mix(h, old), (k * 1_000_003 + e) as u64);
        }
    }
}

/// Initial tile value, the same for the runtime and the reference.
fn init_value(coll: usize, idx: usize, e: usize) -> u64 {
    mix(mix(coll as u64 + 1, idx as u64), e as u64)
}

fn reference(graph: &[TaskDesc]) -> Vec<Vec<Vec<u64>>> {
    let mut data: Vec<Vec<Vec<u64>>> = LAYOUTS
        .iter()
        .enumerate()
        .map(|(c, &(m, n, mb, nb))| {
            let (mt, nt) = (m.div_ceil(mb), n.div_ceil(nb));
            (0..mt * nt)
                .map(|idx| {
                    let (i, j) = (idx / nt, idx % nt);
                    let len = mb.min(m - i * mb) * nb.min(n - j * nb);
                    (0..len).map(|e| init_value(c, idx, e)).collect()
                })
                .collect()
        })
        .collect();
    for t in graph {
        let idx = |a: &Acc| {
            let (_, n, _, nb) = LAYOUTS[a.coll];
            a.i * n.div_ceil(nb) + a.j
        };
        let inputs: Vec<Vec<u64>> = t
            .acc
            .iter()
            .filter(|a| matches!(a.mode, Mode::R | Mode::Rw))
            .map(|a| data[a.coll][idx(a)].clone())
            .collect();
        let mut outs: Vec<(Vec<u64>, Mode, usize, usize)> = t
            .acc
            .iter()
            .filter(|a| a.mode != Mode::R)
            .map(|a| (data[a.coll][idx(a)].clone(), a.mode, a.coll, idx(a)))
            .collect();
        let in_refs: Vec<&[u64]> = inputs.iter().map(|v| v.as_slice()).collect();
        let mut out_refs: Vec<(&mut [u64], Mode)> = outs
            .iter_mut()
            .map(|(v, mode, _, _)| (v.as_mut_slice(), *mode))
            .collect();
        body(t.id, &in_refs, &mut out_refs);
        for (v, _, c, i) in outs {
            data[c][i] = v;
        }
    }
    data
}

/// Messages and bytes the sequence must move: a transfer each time a rank that lacks the newest
/// version of a tile reads it (once per version and rank), plus the write-backs to owners at each
/// `wait`, plus the final gather on rank 0. Computed independently of the runtime's directory.
fn expected_traffic(graph: &[TaskDesc], colls: &[ferry::Collection<u64>], per_epoch: usize) -> (u64, u64) {
    use std::collections::{BTreeMap, BTreeSet};
    let key = |a: &Acc| (a.coll, a.i, a.j);
    let bytes_of = |(c, i, j): (usize, usize, usize)| {
        let (r, k) = colls[c].tile_shape(i, j).expect("in range");
        (r * k * 8) as u64
    };
    let owner = |(c, i, j): (usize, usize, usize)| colls[c].owner(i, j).expect("in range");
    // Per tile: the ranks holding the newest version (absent: only the owner).
    let mut valid: BTreeMap<(usize, usize, usize), BTreeSet<i32>> = BTreeMap::new();
    let (mut msgs, mut bytes) = (0u64, 0u64);
    let mut bring = |valid: &mut BTreeMap<(usize, usize, usize), BTreeSet<i32>>, k, to| {
        let set = valid.entry(k).or_insert_with(|| BTreeSet::from([owner(k)]));
        if set.insert(to) {
            msgs += 1;
            bytes += bytes_of(k);
        }
    };
    for chunk in graph.chunks(per_epoch) {
        for t in chunk {
            let exec = t.on.unwrap_or_else(|| {
                let a = t.acc.iter().find(|a| a.mode != Mode::R).unwrap_or(&t.acc[0]);
                owner(key(a))
            });
            for a in t.acc.iter().filter(|a| a.mode != Mode::W) {
                bring(&mut valid, key(a), exec);
            }
            for a in t.acc.iter().filter(|a| a.mode != Mode::R) {
                valid.insert(key(a), BTreeSet::from([exec]));
            }
        }
        // `wait` brings every tile home.
        let keys: Vec<_> = valid.keys().copied().collect();
        for k in keys {
            bring(&mut valid, k, owner(k));
        }
    }
    // The final gather reads every tile on rank 0.
    for (c, coll) in colls.iter().enumerate() {
        for i in 0..coll.tile_rows() {
            for j in 0..coll.tile_cols() {
                bring(&mut valid, (c, i, j), 0);
            }
        }
    }
    (msgs, bytes)
}

/// `(rank, task id)` whose body hangs, when testing the watchdog (`--stall-rank`); -1: none.
static STALL: [std::sync::atomic::AtomicI64; 2] = [
    std::sync::atomic::AtomicI64::new(-1),
    std::sync::atomic::AtomicI64::new(-1),
];

/// The task id whose body fails (`--fail-middle`); -1: none.
static FAIL: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(-1);

/// The body of the `mix` tasks: args are the task id, then one mode per tile ([`Mode::code`]).
fn mix_body(ctx: &TaskContext<'_>) -> Result<(), TaskError> {
    if ctx.args()[0] == FAIL.load(std::sync::atomic::Ordering::Relaxed) {
        return Err("injected failure (--fail-middle)".into());
    }
    let stall = |k: usize| STALL[k].load(std::sync::atomic::Ordering::Relaxed);
    if i64::from(ctx.rank()) == stall(0) && ctx.args()[0] == stall(1) {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
    let id = ctx.args()[0] as u64;
    let modes = &ctx.args()[1..];
    // Outputs first (RW tiles keep a copy of their old contents, which are inputs too),
    // then the inputs in access order.
    let mut outputs = Vec::new();
    let mut old: Vec<(usize, Vec<u64>)> = Vec::new();
    for (k, &m) in modes.iter().enumerate() {
        let mode = Mode::from_code(m);
        if mode == Mode::R {
            continue;
        }
        let t = ctx.tile_mut::<u64>(k)?;
        if mode == Mode::Rw {
            old.push((k, t.to_vec()));
        }
        outputs.push((t, mode));
    }
    let mut inputs: Vec<&[u64]> = Vec::new();
    for (k, &m) in modes.iter().enumerate() {
        match Mode::from_code(m) {
            Mode::R => inputs.push(ctx.tile::<u64>(k)?),
            Mode::Rw => inputs.push(&old.iter().find(|(kk, _)| *kk == k).expect("copied above").1),
            _ => {}
        }
    }
    body(id, &inputs, &mut outputs);
    Ok(())
}

fn main() {
    let args = Args::parse();
    let rt = match Runtime::builder().from_env().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("oracle: error: {e}");
            std::process::exit(1);
        }
    };
    // Report before the runtime shuts down: after an error, shutdown ends the MPI job.
    if let Err(e) = run(&rt, &args) {
        // One write for the whole line: `eprintln!` writes its pieces one by one to the
        // unbuffered stderr, and the ranks' lines interleaved mid-line under mpirun.
        let line = format!("oracle: error on rank {}: {e:#}\n", rt.rank());
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        drop(rt);
        std::process::exit(1);
    }
}

fn run(rt: &Runtime, args: &Args) -> anyhow::Result<()> {
    let size = rt.size();
    let mut graph = gen_graph(args, size);
    if args.mismatch && rt.rank() == 1 {
        graph[args.tasks / 2].acc[0].mode = Mode::Rw;
        graph[args.tasks / 2].id ^= 1;
    }
    if let Some(r) = args.stall_rank {
        STALL[0].store(i64::from(r), std::sync::atomic::Ordering::Relaxed);
        STALL[1].store((args.tasks / 2) as i64, std::sync::atomic::Ordering::Relaxed);
    }
    if args.fail_middle {
        FAIL.store((args.tasks / 2) as i64, std::sync::atomic::Ordering::Relaxed);
    }
    if args.mismatch_args && rt.rank() == 1 {
        graph[args.tasks / 2].id ^= 1;
    }
    let grid = ProcessGrid::squarest(size);
    let dists = [
        Distribution::BlockCyclic2d(grid),
        Distribution::Block2d(grid),
        Distribution::OnRank((size - 1) as i32),
    ];
    let colls: Vec<_> = LAYOUTS
        .iter()
        .enumerate()
        .map(|(c, &(m, n, mb, nb))| rt.tile_grid::<u64>(&format!("c{c}"), m, n, mb, nb, dists[c]))
        .collect::<Result<_, _>>()?;

    // Initialise every tile with a task on its owner.
    let init = TaskClass::new("init", |ctx| {
        let (c, idx) = (ctx.args()[0] as usize, ctx.args()[1] as usize);
        for (e, x) in ctx.tile_mut::<u64>(0)?.iter_mut().enumerate() {
            *x = init_value(c, idx, e);
        }
        Ok(())
    });
    for (c, coll) in colls.iter().enumerate() {
        for i in 0..coll.tile_rows() {
            for j in 0..coll.tile_cols() {
                let a = [coll.write(i, j)];
                rt.submit(Task::new(&init, &a).args(&[c as i64, (i * coll.tile_cols() + j) as i64]))?;
            }
        }
    }
    let mix_class = TaskClass::new("mix", mix_body);

    // On emulated devices the CPU body runs on the device copy; there is no CUDA version.
    let mix_gpu = TaskClass::new("mix.gpu", mix_body)
        .with_cuda(|_| Err("the oracle has no CUDA body: use FERRY_DEVICES=emu:K".into()));
    let per_epoch = graph.len().div_ceil(args.epochs.max(1));
    let repeat = args.repeat.max(1);
    // The sequence inserted: each epoch's tasks `repeat` times, task ids moved on by
    // `args.tasks` per repetition.
    let mut full = Vec::with_capacity(graph.len() * repeat);
    for chunk in graph.chunks(per_epoch.max(1)) {
        for r in 0..repeat {
            full.extend(chunk.iter().map(|t| TaskDesc {
                id: t.id + (r * args.tasks) as u64,
                ..t.clone()
            }));
        }
    }
    let insert = |rt: &Runtime, tasks: &[TaskDesc]| -> ferry::Result<()> {
        for t in tasks {
            let accesses: Vec<Access> = t
                .acc
                .iter()
                .map(|a| match a.mode {
                    Mode::R => colls[a.coll].read(a.i, a.j),
                    Mode::W => colls[a.coll].write(a.i, a.j),
                    Mode::Rw => colls[a.coll].rw(a.i, a.j),
                    Mode::Part(_) => colls[a.coll].rw_part(a.i, a.j),
                })
                .collect();
            let mut targs = vec![t.id as i64];
            targs.extend(t.acc.iter().map(|a| a.mode.code()));
            // Odd tasks are GPU-capable: with devices they run there, so tiles move between the
            // host and the devices in both directions.
            let class = if t.id % 2 == 1 || args.fusable {
                &mix_gpu
            } else {
                &mix_class
            };
            let mut task = Task::new(class, &accesses).args(&targs);
            if let Some(r) = t.on {
                task = task.on(r);
            }
            rt.submit(task)?;
        }
        Ok(())
    };
    let chunk_len = per_epoch.max(1);
    for (epoch, chunk) in full.chunks(chunk_len * repeat).enumerate() {
        for (r, tasks) in chunk.chunks(chunk_len).enumerate() {
            let mut tasks = tasks.to_vec();
            let last = r + 1 == chunk.len().div_ceil(chunk_len);
            if let (0, true, Some(who)) = (epoch, last, args.replay_differs) {
                if who < 0 || who == rt.rank() {
                    let mid = tasks.len() / 2;
                    let t = &mut tasks[mid];
                    t.acc[0].mode = if t.acc[0].mode == Mode::R { Mode::Rw } else { Mode::R };
                }
            }
            if args.replay {
                rt.trace(epoch as u64, |rt| insert(rt, &tasks))?;
            } else {
                insert(rt, &tasks)?;
            }
        }
        if let Some(who) = args.give_up_on {
            if who != rt.rank() {
                rt.wait().context("wait")?;
                eprintln!("oracle: rank {} waited", rt.rank());
            } else {
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            return Ok(());
        }
        rt.wait().context("wait")?;
    }
    let want = reference(&full);
    let expected = expected_traffic(&full, &colls, chunk_len * repeat);
    let mut bad = 0usize;
    for (c, coll) in colls.iter().enumerate() {
        if let Some(tiles) = rt.gather(coll, 0)? {
            for (idx, t) in tiles.iter().enumerate() {
                if *t != want[c][idx] {
                    bad += 1;
                    eprintln!("oracle: collection {c} tile {idx} differs from the sequential run");
                }
            }
        }
    }
    let stats = rt.gather_stats()?;
    if rt.rank() == 0 {
        if bad > 0 {
            bail!("{bad} tiles differ (seed {}, {} ranks)", args.seed, size);
        }
        // Network traffic only: the device paths (h2d, d2h, peer) are rank-local, control
        // messages are no payload.
        let net = ferry::TrafficPath::NETWORK;
        let sum = |f: &dyn Fn(&ferry::stats::PathStats) -> u64| -> u64 {
            stats.iter().flat_map(|s| net.iter().map(move |&p| f(s.path(p)))).sum()
        };
        let bytes = sum(&|p| p.bytes_sent);
        let recv = sum(&|p| p.bytes_recv);
        let messages = sum(&|p| p.sends);
        let tasks: u64 = stats.iter().map(|s| s.tasks()).sum();
        if (messages, bytes) != expected || recv != bytes {
            bail!(
                "traffic: {messages} messages / {bytes} bytes sent, {recv} bytes received; the copy directory predicts {} / {}",
                expected.0,
                expected.1
            );
        }
        let per_path: Vec<String> = ferry::TrafficPath::ALL
            .iter()
            .map(|&p| {
                format!(
                    "{}={}",
                    p.name(),
                    stats.iter().map(|s| s.path(p).bytes_sent).sum::<u64>()
                )
            })
            .collect();
        let tier = |f: &dyn Fn(&ferry::TierStats) -> u64| -> u64 { stats.iter().map(|s| f(&s.tier)).sum() };
        println!(
            "oracle ok: seed {} ranks {} workers {} tasks {} messages {} bytes {} {} spills={} loads={} prefetches={} window_stalls={} window_overruns={} acked_on_device={} trace_records={} replayed_tasks={} fused_replays={} fused_tasks={}",
            args.seed,
            size,
            rt.workers(),
            tasks,
            messages,
            bytes,
            per_path.join(" "),
            tier(&|t| t.spills),
            tier(&|t| t.loads),
            tier(&|t| t.prefetches),
            stats.iter().map(|s| s.window_stalls).sum::<u64>(),
            stats.iter().map(|s| s.window_overruns).sum::<u64>(),
            stats
                .iter()
                .flat_map(|s| &s.devices)
                .map(|d| d.acked_on_device)
                .sum::<u64>(),
            stats.iter().map(|s| s.trace_records).sum::<u64>(),
            stats.iter().map(|s| s.replayed_tasks).sum::<u64>(),
            stats.iter().map(|s| s.fused_replays).sum::<u64>(),
            stats.iter().map(|s| s.fused_tasks).sum::<u64>()
        );
    }
    rt.shutdown()?;
    Ok(())
}
