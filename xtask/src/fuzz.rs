//! `cargo xtask fuzz`: the coverage-guided fuzz targets of `fuzz/` (AFL++ through cargo-afl, on
//! the stable toolchain), each for a bounded time from the corpus kept in `fuzz/corpus/`. Fails
//! when a target crashed or hung; prints executions, speed and edge coverage per target and
//! writes them to `target/fuzz/fuzz.json`.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::Path;

use crate::util;

/// The targets, as named in `fuzz/Cargo.toml`, with what they decode.
pub const TARGETS: [(&str, &str); 2] = [
    ("wire", "IPC transfer descriptors (transfer::wire)"),
    (
        "checkpoint",
        "checkpoint manifests and rank files (checkpoint::format, checkpoint::read)",
    ),
];

/// The cargo-afl release the targets are built with.
const CARGO_AFL: &str = "0.18.2";

#[derive(Args)]
pub struct FuzzArgs {
    /// Seconds per target.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Only this target (default: all).
    #[arg(long)]
    pub target: Option<String>,
}

/// One target's outcome, from AFL++'s `fuzzer_stats`.
#[derive(Debug, serde::Serialize)]
struct Outcome {
    target: String,
    seconds: u64,
    execs: u64,
    execs_per_s: f64,
    edges_found: u64,
    total_edges: u64,
    corpus: u64,
    crashes: u64,
    hangs: u64,
}

fn stat(stats: &str, key: &str) -> Option<f64> {
    stats
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == key))
        .and_then(|(_, v)| v.trim().trim_end_matches('%').parse().ok())
}

pub fn run(args: FuzzArgs) -> Result<()> {
    let have_afl = util::cargo()
        .args(["afl", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_afl {
        // Installing cargo-afl also builds the AFL++ runtime for this rustc.
        util::run(util::cargo().args(["install", "cargo-afl", "--locked", "--version", CARGO_AFL]))?;
    }
    // cargo-afl builds the AFL++ runtime once per rustc: after a toolchain update, `cargo afl`
    // runs but cannot build until it has been rebuilt.
    let runtime_built = util::cargo()
        .args(["afl", "config", "--build"])
        .output()
        .map(|o| o.status.success() || String::from_utf8_lossy(&o.stderr).contains("already built"));
    if !runtime_built.unwrap_or(false) {
        util::run(util::cargo().args(["afl", "config", "--build", "--force"]))?;
    }
    let manifest = util::root().join("fuzz/Cargo.toml");
    util::run(
        util::cargo()
            .args(["afl", "build", "--release", "--manifest-path"])
            .arg(&manifest),
    )?;
    let out_root = util::target_dir("fuzz")?;
    let mut outcomes = Vec::new();
    for (name, what) in TARGETS {
        if args.target.as_deref().is_some_and(|t| t != name) {
            continue;
        }
        eprintln!("xtask fuzz: {name}: {what}, {} s", args.seconds);
        let out = out_root.join(name);
        let _ = std::fs::remove_dir_all(&out);
        let log = std::fs::File::create(out_root.join(format!("{name}.log")))?;
        let status = util::cargo()
            .args(["afl", "fuzz", "-i"])
            .arg(util::root().join("fuzz/corpus").join(name))
            .arg("-o")
            .arg(&out)
            .args(["-V", &args.seconds.to_string()])
            .arg(util::root().join("fuzz/target/release").join(name))
            // No screen, no CPU-governor or core-dump-handler checks (containers, CI), no core
            // binding (a 2-core runner may have none free).
            .envs([
                ("AFL_NO_UI", "1"),
                ("AFL_SKIP_CPUFREQ", "1"),
                ("AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES", "1"),
                ("AFL_NO_AFFINITY", "1"),
            ])
            .stdout(log.try_clone()?)
            .stderr(log)
            .status()
            .context("running cargo afl fuzz")?;
        let stats_path = out.join("default/fuzzer_stats");
        let stats = std::fs::read_to_string(&stats_path).with_context(|| {
            format!(
                "{name}: no {} (afl-fuzz exited with {status}; see target/fuzz/{name}.log)",
                stats_path.display()
            )
        })?;
        let get = |k| stat(&stats, k).unwrap_or(0.0);
        outcomes.push(Outcome {
            target: name.into(),
            seconds: args.seconds,
            execs: get("execs_done") as u64,
            execs_per_s: get("execs_done") / args.seconds.max(1) as f64,
            edges_found: get("edges_found") as u64,
            total_edges: get("total_edges") as u64,
            corpus: get("corpus_count") as u64,
            crashes: get("saved_crashes") as u64,
            hangs: get("saved_hangs") as u64,
        });
    }
    println!(
        "{:<12} {:>8} {:>12} {:>10} {:>14} {:>8} {:>8} {:>6}",
        "target", "seconds", "executions", "execs/s", "edges", "corpus", "crashes", "hangs"
    );
    for o in &outcomes {
        println!(
            "{:<12} {:>8} {:>12} {:>10.0} {:>6}/{:<7} {:>8} {:>8} {:>6}",
            o.target, o.seconds, o.execs, o.execs_per_s, o.edges_found, o.total_edges, o.corpus, o.crashes, o.hangs
        );
    }
    std::fs::write(out_root.join("fuzz.json"), serde_json::to_vec_pretty(&outcomes)?)?;
    let bad: Vec<&Outcome> = outcomes.iter().filter(|o| o.crashes > 0 || o.hangs > 0).collect();
    if !bad.is_empty() {
        for o in &bad {
            eprintln!(
                "xtask fuzz: {}: {} crashes, {} hangs: inputs in {}",
                o.target,
                o.crashes,
                o.hangs,
                Path::new("target/fuzz").join(&o.target).join("default").display()
            );
        }
        bail!("fuzzing found crashes or hangs");
    }
    Ok(())
}
