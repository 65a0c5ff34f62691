//! `cargo xtask trace-gaps`: how long each device waited between the kernels of one task class,
//! and whether the GPU manager had launched the next one by then, from per-rank traces
//! (`FERRY_TRACE`).
//!
//! For a chain of kernels that should run back to back (the stencil's interiors, one per step),
//! two numbers per step tell whether the device or the host was the bound:
//! - *gap*: the kernel's start minus the previous kernel's end, on the same device (device time
//!   spent on other work or idle);
//! - *launch lag*: when the manager's launch call returned (`gpu.exec` ends) minus the previous
//!   kernel's end. Positive: the device had finished the previous kernel before the next was
//!   even launched, so the host was late.
//!
//! Kernel times come from the `ferry::gpu` spans (device events placed on the trace clock);
//! launch times from the manager's `gpu.exec` spans; both are on one rank's clock, so no merge
//! is needed.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;

#[derive(Args)]
pub struct TraceGapsArgs {
    /// Directory holding the `trace-rank<N>.json` files.
    dir: PathBuf,
    /// Task class whose kernels form the chain (e.g. `step.interior`).
    #[arg(long, default_value = "step.interior")]
    op: String,
}

/// One kernel of the chain on a device.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Kernel {
    seq: u64,
    start: f64,
    end: f64,
}

/// Per step after the first: `(gap, launch lag)` in µs; the launch lag is `None` when the
/// trace holds no launch for that task.
fn steps(kernels: &[Kernel], launched: &HashMap<u64, f64>) -> Vec<(f64, Option<f64>)> {
    kernels
        .windows(2)
        .map(|w| {
            let (prev, k) = (w[0], w[1]);
            (k.start - prev.end, launched.get(&k.seq).map(|t| t - prev.end))
        })
        .collect()
}

/// The `q`-quantile (0..=1) of `v` by nearest rank; `v` must not be empty.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let k = ((v.len() - 1) as f64 * q).round() as usize;
    v[k]
}

fn arg<'a>(e: &'a Value, key: &str) -> Option<&'a str> {
    e.get("args")?.get(key)?.as_str()
}

fn num(e: &Value, key: &str) -> Option<f64> {
    arg(e, key)?.parse().ok()
}

/// The chain's kernels per device (the track's prefix, `cuda:0`), sorted by start.
type Chains = BTreeMap<String, Vec<Kernel>>;

/// One rank's chains, and the launch time of every task of the class (µs, trace clock).
fn read_rank(path: &Path, op: &str) -> Result<(Chains, HashMap<u64, f64>)> {
    let (events, _) = ferry_trace::read_events(path).with_context(|| format!("reading {}", path.display()))?;
    let mut chains: Chains = BTreeMap::new();
    let mut launched = HashMap::new();
    let quoted = format!("\"{op}\"");
    for e in &events {
        let name = e.get("name").and_then(Value::as_str).unwrap_or("");
        if e.get("cat").and_then(Value::as_str) == Some("ferry::gpu") && arg(e, "op") == Some(op) {
            let (Some(start), Some(dur), Some(seq), Some(track)) =
                (num(e, "ts_us"), num(e, "dur_us"), num(e, "seq"), arg(e, "track"))
            else {
                continue;
            };
            // `cuda:0 exec 2` → `cuda:0`: the chain is per device, across its streams.
            let device = track.split_whitespace().next().unwrap_or(track).to_string();
            chains.entry(device).or_default().push(Kernel {
                seq: seq as u64,
                start,
                end: start + dur,
            });
        } else if name == "gpu.exec"
            && e.get("ph").and_then(Value::as_str) == Some("E")
            && arg(e, "class") == Some(quoted.as_str())
        {
            if let (Some(seq), Some(ts)) = (num(e, "seq"), e.get("ts").and_then(Value::as_f64)) {
                launched.insert(seq as u64, ts);
            }
        }
    }
    for k in chains.values_mut() {
        k.sort_by(|a, b| a.start.total_cmp(&b.start));
    }
    Ok((chains, launched))
}

pub fn run(args: TraceGapsArgs) -> Result<()> {
    let mut files: Vec<(u32, PathBuf)> = std::fs::read_dir(&args.dir)
        .with_context(|| format!("reading {}", args.dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let r = ferry_trace::rank_of(p.file_name()?.to_str()?)?;
            Some((r, p))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("no trace-rank<N>.json in {}", args.dir.display());
    }
    println!(
        "{:<5} {:<8} {:>6} {:>9} {:>26} {:>26} {:>10}",
        "rank", "device", "steps", "period", "gap p10/p50/p90 µs", "launch lag p10/p50/p90 µs", "host late"
    );
    let mut any = false;
    for (rank, path) in &files {
        let (chains, launched) = read_rank(path, &args.op)?;
        for (device, kernels) in &chains {
            let s = steps(kernels, &launched);
            if s.is_empty() {
                continue;
            }
            any = true;
            let mut gaps: Vec<f64> = s.iter().map(|x| x.0).collect();
            let mut lags: Vec<f64> = s.iter().filter_map(|x| x.1).collect();
            let late = lags.iter().filter(|&&l| l > 0.0).count();
            let period = (kernels[kernels.len() - 1].start - kernels[0].start) / (kernels.len() - 1) as f64;
            let three = |v: &mut Vec<f64>| {
                if v.is_empty() {
                    "-".to_string()
                } else {
                    format!(
                        "{:.1} / {:.1} / {:.1}",
                        quantile(v, 0.1),
                        quantile(v, 0.5),
                        quantile(v, 0.9)
                    )
                }
            };
            println!(
                "{rank:<5} {device:<8} {:>6} {period:>9.1} {:>26} {:>26} {:>9.0}%",
                s.len(),
                three(&mut gaps),
                three(&mut lags),
                if lags.is_empty() {
                    0.0
                } else {
                    100.0 * late as f64 / lags.len() as f64
                }
            );
        }
    }
    if !any {
        bail!(
            "no two kernels of `{}` on one device in {} (is the trace's filter keeping ferry::gpu?)",
            args.op,
            args.dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_and_launch_lags_per_step() {
        let k = |seq, start, end| Kernel { seq, start, end };
        let kernels = [k(1, 0.0, 10.0), k(3, 12.0, 20.0), k(5, 30.0, 40.0)];
        // Task 3 was launched before task 1 ended (ahead); task 5 only after task 3 ended.
        let launched = HashMap::from([(3, 5.0), (5, 26.0)]);
        assert_eq!(steps(&kernels, &launched), vec![(2.0, Some(-5.0)), (10.0, Some(6.0))]);
        assert_eq!(steps(&kernels[..1], &launched), vec![]);
        assert_eq!(steps(&kernels[..2], &HashMap::new()), vec![(2.0, None)]);
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&mut v, 0.0), 1.0);
        assert_eq!(quantile(&mut v, 0.5), 3.0);
        assert_eq!(quantile(&mut v, 1.0), 5.0);
    }
}
