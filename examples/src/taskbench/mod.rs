//! A Task Bench-compatible core (Slaughter et al., "Task Bench: A Parameterized Benchmark for
//! Evaluating Parallel Runtime Performance", SC20): the command line, the dependence patterns,
//! the kernels, the per-task input validation and the summary lines, shared by the `taskbench`
//! driver on ferry and the `taskbench-mpi` baseline. Written from the reference's documented
//! behaviour; output lines match its format so its METG scripts could read ours.

pub mod kernel;
pub mod pattern;
pub mod random;

use kernel::{Kernel, KernelType};
use pattern::{Pattern, Shape};
use std::fmt::Write as _;

/// The value every 8-byte word of a scratch buffer starts as.
pub const MAGIC: u64 = 0x5C4A7C8B;

/// One task graph of the run (each `-and` starts another).
#[derive(Debug, Clone, PartialEq)]
pub struct GraphConfig {
    pub shape: Shape,
    pub kernel: Kernel,
    /// Bytes each task outputs (≥ 16: pairs of `(timestep, point)`).
    pub output_bytes: i64,
    /// Bytes of scratch memory per point.
    pub scratch_bytes: i64,
}

impl GraphConfig {
    fn new(graph_index: i64) -> GraphConfig {
        GraphConfig {
            shape: Shape {
                graph_index,
                pattern: Pattern::Trivial,
                steps: 4,
                width: 4,
                radix: 3,
                period: -1,
                fraction: 0.25,
            },
            kernel: Kernel {
                kind: KernelType::Empty,
                iterations: 0,
                samples: 16,
                imbalance: 0.0,
            },
            output_bytes: 16,
            scratch_bytes: 0,
        }
    }

    fn close(&mut self) -> Result<(), String> {
        if self.shape.period < 0 {
            self.shape.period = if self.shape.pattern.needs_period() { 3 } else { 0 };
        }
        if self.kernel.kind == KernelType::MemoryBound && self.scratch_bytes == 0 {
            return Err("error: Kernel \"memory_bound\" requires a non-zero -scratch".into());
        }
        if self.scratch_bytes % 8 != 0 {
            return Err("error: Invalid flag \"-scratch\": must be a multiple of 8".into());
        }
        self.shape.check()
    }

    /// Tasks of the graph.
    pub fn tasks(&self) -> i64 {
        (0..self.shape.steps).map(|t| self.shape.width_at(t)).sum()
    }

    /// Dependencies of the graph (edges between existing tasks).
    pub fn dependencies(&self) -> i128 {
        let s = &self.shape;
        (0..s.steps)
            .flat_map(|t| (s.offset(t)..s.offset(t) + s.width_at(t)).map(move |p| (t, p)))
            .map(|(t, p)| s.inputs(t, p).len() as i128)
            .sum()
    }

    fn each_task(&self) -> impl Iterator<Item = (i64, i64)> + '_ {
        let s = &self.shape;
        (0..s.steps).flat_map(move |t| (s.offset(t)..s.offset(t) + s.width_at(t)).map(move |p| (t, p)))
    }
}

/// The whole run: its graphs and global flags.
#[derive(Debug, Clone, PartialEq)]
pub struct App {
    pub graphs: Vec<GraphConfig>,
    /// `-nodes`: used only to estimate local and remote dependencies.
    pub nodes: i64,
    pub verbose: i64,
    /// Arguments the core does not know (left for the driver, like the reference does).
    pub extra: Vec<String>,
}

/// Most points per timestep (`-width`, also `-nodes`): 2^24. The reference takes any `long`;
/// bounds here keep the patterns' index arithmetic and the task count within 64 bits (totals
/// that can pass it — dependencies, FLOPs, bytes — are summed as `i128`).
pub const MAX_WIDTH: i64 = 1 << 24;
/// Most timesteps (`-steps`, also `-period`): 2^31.
pub const MAX_STEPS: i64 = 1 << 31;
/// Most kernel iterations per task (`-iter`): 2^40 (a compute-bound task of 2^40 iterations
/// runs for hours).
pub const MAX_ITER: i64 = 1 << 40;
/// Largest `-output` and `-scratch` in bytes: one MPI message, whose count is an `int`
/// (`ferry::MAX_TILE_BYTES`).
pub const MAX_BYTES: i64 = i32::MAX as i64;

fn value<'a>(args: &'a [String], k: usize, flag: &str) -> Result<&'a str, String> {
    args.get(k + 1)
        .map(|s| s.as_str())
        .ok_or_else(|| format!("error: Flag \"{flag}\" requires an argument"))
}

fn int(flag: &str, v: &str) -> Result<i64, String> {
    v.trim()
        .parse()
        .map_err(|_| format!("error: Invalid flag \"{flag} {v}\": expected an integer"))
}

fn float(flag: &str, v: &str) -> Result<f64, String> {
    v.trim()
        .parse()
        .map_err(|_| format!("error: Invalid flag \"{flag} {v}\": expected a number"))
}

fn require(ok: bool, flag: &str, v: &str, rule: &str) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("error: Invalid flag \"{flag} {v}\" must be {rule}"))
    }
}

impl App {
    /// Parses Task Bench's command line (`args` without the program name).
    ///
    /// # Errors
    /// The reference's message for a missing or invalid value, an unknown `-type` or `-kernel`,
    /// or a graph whose settings do not combine.
    pub fn parse(args: &[String]) -> Result<App, String> {
        let mut app = App {
            graphs: Vec::new(),
            nodes: 0,
            verbose: 0,
            extra: Vec::new(),
        };
        let mut g = GraphConfig::new(0);
        let mut k = 0;
        while k < args.len() {
            let flag = args[k].as_str();
            let mut takes = true;
            match flag {
                "-steps" => {
                    let v = value(args, k, flag)?;
                    g.shape.steps = int(flag, v)?;
                    require(
                        (1..=MAX_STEPS).contains(&g.shape.steps),
                        flag,
                        v,
                        &format!("between 1 and {MAX_STEPS}"),
                    )?;
                }
                "-width" => {
                    let v = value(args, k, flag)?;
                    g.shape.width = int(flag, v)?;
                    require(
                        (1..=MAX_WIDTH).contains(&g.shape.width),
                        flag,
                        v,
                        &format!("between 1 and {MAX_WIDTH}"),
                    )?;
                }
                "-type" => {
                    let v = value(args, k, flag)?;
                    g.shape.pattern = Pattern::parse(v).ok_or_else(|| format!("error: Invalid flag \"-type {v}\""))?;
                }
                "-radix" => {
                    let v = value(args, k, flag)?;
                    g.shape.radix = int(flag, v)?;
                    require(g.shape.radix >= 0, flag, v, ">= 0")?;
                }
                "-period" => {
                    let v = value(args, k, flag)?;
                    g.shape.period = int(flag, v)?;
                    require(
                        (0..=MAX_STEPS).contains(&g.shape.period),
                        flag,
                        v,
                        &format!("between 0 and {MAX_STEPS}"),
                    )?;
                }
                "-fraction" => {
                    let v = value(args, k, flag)?;
                    g.shape.fraction = float(flag, v)?;
                    require((0.0..=1.0).contains(&g.shape.fraction), flag, v, "between 0 and 1")?;
                }
                "-kernel" => {
                    let v = value(args, k, flag)?;
                    g.kernel.kind =
                        KernelType::parse(v).ok_or_else(|| format!("error: Invalid flag \"-kernel {v}\""))?;
                }
                "-iter" => {
                    let v = value(args, k, flag)?;
                    g.kernel.iterations = int(flag, v)?;
                    require(
                        (0..=MAX_ITER).contains(&g.kernel.iterations),
                        flag,
                        v,
                        &format!("between 0 and {MAX_ITER}"),
                    )?;
                }
                "-output" => {
                    let v = value(args, k, flag)?;
                    g.output_bytes = int(flag, v)?;
                    require(
                        (16..=MAX_BYTES).contains(&g.output_bytes),
                        flag,
                        v,
                        &format!("between 16 and {MAX_BYTES}"),
                    )?;
                }
                "-scratch" => {
                    let v = value(args, k, flag)?;
                    g.scratch_bytes = int(flag, v)?;
                    require(
                        (0..=MAX_BYTES).contains(&g.scratch_bytes),
                        flag,
                        v,
                        &format!("between 0 and {MAX_BYTES}"),
                    )?;
                }
                "-sample" => {
                    let v = value(args, k, flag)?;
                    g.kernel.samples = int(flag, v)?;
                    require(g.kernel.samples >= 0, flag, v, ">= 0")?;
                }
                "-imbalance" => {
                    let v = value(args, k, flag)?;
                    g.kernel.imbalance = float(flag, v)?;
                    require((0.0..=2.0).contains(&g.kernel.imbalance), flag, v, "between 0 and 2")?;
                }
                "-nodes" => {
                    let v = value(args, k, flag)?;
                    app.nodes = int(flag, v)?;
                    require(
                        (1..=MAX_WIDTH).contains(&app.nodes),
                        flag,
                        v,
                        &format!("between 1 and {MAX_WIDTH}"),
                    )?;
                }
                "-and" => {
                    takes = false;
                    g.close()?;
                    let next = GraphConfig::new(app.graphs.len() as i64 + 1);
                    app.graphs.push(std::mem::replace(&mut g, next));
                }
                "-v" => {
                    takes = false;
                    app.verbose += 1;
                }
                "-vv" => {
                    takes = false;
                    app.verbose += 2;
                }
                "-skip-graph-validation" => takes = false,
                _ => {
                    takes = false;
                    app.extra.push(args[k].clone());
                }
            }
            k += if takes { 2 } else { 1 };
        }
        g.close()?;
        app.graphs.push(g);
        Ok(app)
    }

    /// The configuration banner (`Running Task Benchmark` …), as the reference prints it.
    pub fn display(&self) -> String {
        let mut s = String::from("Running Task Benchmark\n  Configuration:\n");
        for (i, g) in self.graphs.iter().enumerate() {
            let _ = writeln!(s, "    Task Graph {}:", i + 1);
            let _ = writeln!(s, "      Time Steps: {}", g.shape.steps);
            let _ = writeln!(s, "      Max Width: {}", g.shape.width);
            let _ = writeln!(s, "      Dependence Type: {}", g.shape.pattern.name());
            let _ = writeln!(s, "      Radix: {}", g.shape.radix);
            let _ = writeln!(s, "      Period: {}", g.shape.period);
            let _ = writeln!(s, "      Fraction Connected: {:.6}", g.shape.fraction);
            let _ = writeln!(s, "      Kernel:");
            let _ = writeln!(s, "        Type: {}", g.kernel.kind.name());
            let _ = writeln!(s, "        Iterations: {}", g.kernel.iterations);
            let _ = writeln!(s, "        Samples: {}", g.kernel.samples);
            let _ = writeln!(s, "        Imbalance: {:.6}", g.kernel.imbalance);
            let _ = writeln!(s, "      Output Bytes: {}", g.output_bytes);
            let _ = writeln!(s, "      Scratch Bytes: {}", g.scratch_bytes);
        }
        s
    }

    /// Total tasks over all graphs.
    pub fn tasks(&self) -> i64 {
        self.graphs.iter().map(GraphConfig::tasks).sum()
    }

    /// Total FLOPs over all graphs.
    pub fn flops(&self) -> i128 {
        self.graphs
            .iter()
            .map(|g| {
                g.each_task()
                    .map(|(t, p)| i128::from(g.kernel.flops(g.shape.graph_index, t, p)))
                    .sum::<i128>()
            })
            .sum()
    }

    /// The summary (`Total Tasks` … `B/s`), as the reference prints it.
    pub fn report(&self, elapsed: f64) -> String {
        let tasks = self.tasks();
        let deps: i128 = self.graphs.iter().map(GraphConfig::dependencies).sum();
        let flops = self.flops();
        let bytes: i128 = self
            .graphs
            .iter()
            .map(|g| i128::from(g.tasks()) * g.kernel.bytes(g.scratch_bytes))
            .sum();
        let mut s = String::new();
        let _ = writeln!(s, "Total Tasks {tasks}");
        let _ = writeln!(s, "Total Dependencies {deps}");
        let (local, nonlocal) = self.local_dependencies();
        if self.nodes > 0 {
            let _ = writeln!(s, "  Local Dependencies {local} (estimated)");
            let _ = writeln!(s, "  Nonlocal Dependencies {nonlocal} (estimated)");
            let _ = writeln!(s, "  Number of Nodes (used for estimate) {}", self.nodes);
        } else {
            let _ = writeln!(s, "  Unable to estimate local/nonlocal dependencies");
        }
        let _ = writeln!(s, "Total FLOPs {flops}");
        let _ = writeln!(s, "Total Bytes {bytes}");
        let _ = writeln!(s, "Elapsed Time {} seconds", c_exp(elapsed));
        let _ = writeln!(s, "FLOP/s {}", c_exp(flops as f64 / elapsed));
        let _ = writeln!(s, "B/s {}", c_exp(bytes as f64 / elapsed));
        let _ = writeln!(s, "Transfer (estimated):");
        if self.nodes > 0 {
            let ob = i128::from(self.graphs.first().map_or(16, |g| g.output_bytes));
            let _ = writeln!(s, "  Local Bytes {}", local * ob);
            let _ = writeln!(s, "  Nonlocal Bytes {}", nonlocal * ob);
            let _ = writeln!(s, "  Local Bandwidth {} B/s", c_exp((local * ob) as f64 / elapsed));
            let _ = writeln!(
                s,
                "  Nonlocal Bandwidth {} B/s",
                c_exp((nonlocal * ob) as f64 / elapsed)
            );
        } else {
            let _ = writeln!(s, "  Unable to estimate local/nonlocal transfer");
        }
        s
    }

    /// Dependencies whose two ends lie on one node or on two, points spread over `-nodes`
    /// nodes in blocks (an estimate, as in the reference).
    fn local_dependencies(&self) -> (i128, i128) {
        if self.nodes <= 0 {
            return (0, 0);
        }
        let (mut local, mut total) = (0, 0);
        for g in &self.graphs {
            let w = g.shape.width;
            let node = |p: i64| p * self.nodes / w;
            for (t, p) in g.each_task() {
                for d in g.shape.inputs(t, p) {
                    total += 1;
                    local += i128::from(node(d) == node(p));
                }
            }
        }
        (local, total - local)
    }
}

/// C's `%e`: six decimals and a signed exponent of at least two digits (`1.234560e-01`).
pub fn c_exp(x: f64) -> String {
    let s = format!("{x:.6e}");
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = match e.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', e),
            };
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// Checks the inputs of task `(t, p)` — input `k` must hold, in every 16-byte slot, the pair
/// `(t − 1, inputs[k])` its producer wrote — then writes `(t, p)` into every slot of `output`,
/// checks the scratch buffer's magic word and runs the kernel. This is the reference's
/// graph validation: a dependency delivered from the wrong task or timestep fails the task.
///
/// # Errors
/// Which input, slot and value were wrong; a wrong output or scratch size; a corrupt scratch.
pub fn execute_point(
    g: &GraphConfig,
    t: i64,
    p: i64,
    inputs: &[&[u8]],
    output: &mut [u8],
    scratch: &mut [u8],
) -> Result<(), String> {
    let want = g.shape.inputs(t, p);
    if inputs.len() != want.len() {
        return Err(format!(
            "task ({t}, {p}): {} inputs, expected {}",
            inputs.len(),
            want.len()
        ));
    }
    for (k, (buf, &dep)) in inputs.iter().zip(&want).enumerate() {
        if buf.len() as i64 != g.output_bytes {
            return Err(format!(
                "task ({t}, {p}): input {k} has {} bytes, expected {}",
                buf.len(),
                g.output_bytes
            ));
        }
        for (slot, pair) in buf.chunks_exact(16).enumerate() {
            let a = i64::from_le_bytes(pair[..8].try_into().expect("8 bytes"));
            let b = i64::from_le_bytes(pair[8..].try_into().expect("8 bytes"));
            if (a, b) != (t - 1, dep) {
                return Err(format!(
                    "task ({t}, {p}): input {k} slot {slot} holds ({a}, {b}), expected ({}, {dep})",
                    t - 1
                ));
            }
        }
    }
    if output.len() as i64 != g.output_bytes {
        return Err(format!(
            "task ({t}, {p}): output of {} bytes, expected {}",
            output.len(),
            g.output_bytes
        ));
    }
    for pair in output.chunks_exact_mut(16) {
        pair[..8].copy_from_slice(&t.to_le_bytes());
        pair[8..].copy_from_slice(&p.to_le_bytes());
    }
    if g.scratch_bytes > 0 {
        if scratch.len() as i64 != g.scratch_bytes {
            return Err(format!(
                "task ({t}, {p}): scratch of {} bytes, expected {}",
                scratch.len(),
                g.scratch_bytes
            ));
        }
        if u64::from_le_bytes(scratch[..8].try_into().expect("8 bytes")) != MAGIC {
            return Err(format!("task ({t}, {p}): scratch buffer corrupted"));
        }
    }
    g.kernel.execute(g.shape.graph_index, t, p, scratch);
    Ok(())
}

/// Fills a scratch buffer with [`MAGIC`] words.
pub fn prepare_scratch(scratch: &mut [u8]) {
    for w in scratch.chunks_exact_mut(8) {
        w.copy_from_slice(&MAGIC.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_graphs_and_rejects_bad_values() {
        let a = App::parse(&args(
            "-steps 10 -width 8 -type stencil_1d -kernel compute_bound -iter 64 -and -type spread -radix 2 -period 2",
        ))
        .unwrap();
        assert_eq!(a.graphs.len(), 2);
        assert_eq!(a.graphs[0].shape.steps, 10);
        assert_eq!(a.graphs[1].shape.graph_index, 1);
        assert_eq!(a.graphs[1].shape.period, 2);
        // spread's default period (3) needs ⌈width / radix⌉ ≥ 3.
        assert!(App::parse(&args("-type spread -radix 2"))
            .unwrap_err()
            .contains("at most 2"));
        assert_eq!(a.tasks(), 80 + 16);
        for bad in [
            "-steps 0",
            "-type nope",
            "-output 8",
            "-steps",
            "-fraction 2",
            "-type trivial -period 2",
            // Past the bounds that keep every count within 64 bits.
            "-width 16777217",
            "-steps 2147483649",
            "-iter 1099511627777",
            "-output 2147483648",
            "-scratch 2147483648",
            "-nodes 16777217",
            "-type random_nearest -period 2147483649",
        ] {
            assert!(App::parse(&args(bad)).is_err(), "{bad}");
        }
        // A period longer than the run: set-up checks only the sets the timesteps use (it used
        // to walk all of them, and never ended).
        let t = std::time::Instant::now();
        App::parse(&args("-steps 4 -width 8 -type random_nearest -period 1000000000")).unwrap();
        assert!(t.elapsed().as_secs() < 10);
        // Counts past 64 bits are reported, not wrapped.
        let big = App::parse(&args(
            "-steps 1000000 -width 1 -kernel memory_bound -scratch 2147483640 -iter 1099511627776 -sample 1",
        ))
        .unwrap();
        assert!(big.report(1.0).contains("Total Bytes 2361183232638729584640000000\n"));
        assert_eq!(App::parse(&args("-custom 1")).unwrap().extra, vec!["-custom", "1"]);
    }

    #[test]
    fn report_has_the_reference_lines() {
        let a = App::parse(&args(
            "-steps 4 -width 4 -type stencil_1d -kernel compute_bound -iter 2",
        ))
        .unwrap();
        let r = a.report(0.5);
        assert!(r.contains("Total Tasks 16\n"), "{r}");
        // stencil_1d on 4 points: 2 + 3 + 3 + 2 inputs per step after the first.
        assert!(r.contains("Total Dependencies 30\n"), "{r}");
        // compute_bound: 2·64·iter + 64 FLOPs per task.
        assert!(r.contains("Total FLOPs 5120\n"), "{r}");
        assert!(r.contains("Elapsed Time 5.000000e-01 seconds"), "{r}");
        assert_eq!(c_exp(1234.5), "1.234500e+03");
    }

    #[test]
    fn validation_catches_a_wrong_input() {
        let a = App::parse(&args("-steps 3 -width 3 -type stencil_1d")).unwrap();
        let g = &a.graphs[0];
        let mk = |t: i64, p: i64| {
            let mut o = vec![0u8; 16];
            execute_point(g, t, p, &[], &mut o, &mut []).ok();
            o
        };
        let (i0, i1) = (mk(0, 0), mk(0, 1));
        let mut out = vec![0u8; 16];
        assert!(execute_point(g, 1, 0, &[&i0, &i1], &mut out, &mut []).is_ok());
        let e = execute_point(g, 1, 0, &[&i1, &i0], &mut out, &mut []).unwrap_err();
        assert!(e.contains("input 0"), "{e}");
    }
}
