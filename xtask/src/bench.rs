//! `cargo xtask bench`: scaling runs of the example binaries under mpirun.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Map, Value};

use crate::util;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Scaling of the `cholesky` example, with a dense single-rank faer factorization for comparison.
    Cholesky(CholeskyArgs),
    /// Scaling of the `stencil` example.
    Stencil(StencilArgs),
}

/// Options shared by all benchmarks.
#[derive(Args)]
pub struct Common {
    /// Rank counts to run, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    ranks: Vec<u32>,
    /// Repetitions per rank count (interleaved: all rank counts once, then again).
    #[arg(long, default_value_t = 3)]
    reps: u32,
}

#[derive(Args)]
pub struct CholeskyArgs {
    /// Matrix order.
    #[arg(long, default_value_t = 2048)]
    n: u32,
    /// Tile size.
    #[arg(long, default_value_t = 256)]
    nb: u32,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
pub struct StencilArgs {
    /// Grid side length.
    #[arg(long, default_value_t = 4096)]
    n: u32,
    /// Block side length.
    #[arg(long, default_value_t = 512)]
    nb: u32,
    /// Number of iterations.
    #[arg(long, default_value_t = 100)]
    iters: u32,
    #[command(flatten)]
    common: Common,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Cholesky(a) => {
            let args = vec![
                "--n".to_string(),
                a.n.to_string(),
                "--nb".to_string(),
                a.nb.to_string(),
                "--compare-dense".to_string(),
            ];
            let params = json!({ "n": a.n, "nb": a.nb });
            let runs = measure("cholesky", &args, &a.common)?;
            report_cholesky(&runs);
            write_summary("cholesky", params, &a.common, &runs, cholesky_rows(&runs))
        }
        BenchCommand::Stencil(a) => {
            let args = vec![
                "--n".to_string(),
                a.n.to_string(),
                "--nb".to_string(),
                a.nb.to_string(),
                "--iters".to_string(),
                a.iters.to_string(),
            ];
            let params = json!({ "n": a.n, "nb": a.nb, "iters": a.iters });
            let runs = measure("stencil", &args, &a.common)?;
            report_stencil(&runs);
            write_summary("stencil", params, &a.common, &runs, stencil_rows(&runs))
        }
    }
}

/// JSON records per rank count, in run order.
type Runs = BTreeMap<u32, Vec<Map<String, Value>>>;

/// Build the release binary, then run it `reps` times at each rank count.
fn measure(bin: &str, args: &[String], common: &Common) -> Result<Runs> {
    if common.ranks.is_empty() || common.ranks.contains(&0) {
        bail!("--ranks needs positive rank counts");
    }
    util::run(util::cargo().args(["build", "--release", "-p", "ferry-examples", "--bin", bin]))?;
    let dir = util::target_dir("bench")?;
    let mut runs = Runs::new();
    for rep in 0..common.reps {
        for &r in &common.ranks {
            let name = format!("{bin}-r{r}-rep{rep}.json");
            let path = dir.join(&name);
            // A stale file from an earlier run must not be mistaken for this one's output.
            if path.exists() {
                std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
            }
            util::run(
                util::mpirun(r)
                    .arg(format!("target/release/{bin}"))
                    .args(args)
                    .arg("--json")
                    .arg(format!("target/bench/{name}")),
            )?;
            let record = read_record(&path)?;
            runs.entry(r).or_default().push(record);
        }
    }
    Ok(runs)
}

/// Read the result record a benchmark binary wrote: one JSON object, an array of objects
/// (the last one is taken) or JSON lines (the last line is taken).
fn read_record(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value = match serde_json::from_str::<Value>(&text) {
        Ok(v) => v,
        Err(_) => {
            let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
            serde_json::from_str(last).with_context(|| format!("parsing {}", path.display()))?
        }
    };
    let value = match value {
        Value::Array(items) => items.into_iter().next_back().unwrap_or(Value::Null),
        v => v,
    };
    match value {
        Value::Object(map) => Ok(map),
        _ => bail!("{}: expected a JSON object record", path.display()),
    }
}

/// Median of the values of `field` in `records`, ignoring records that lack it.
fn median(records: &[Map<String, Value>], field: &str) -> Option<f64> {
    let mut xs: Vec<f64> = records
        .iter()
        .filter_map(|r| r.get(field).and_then(Value::as_f64))
        .filter(|x| x.is_finite())
        .collect();
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let mid = xs.len() / 2;
    Some(if xs.len() % 2 == 1 {
        xs[mid]
    } else {
        (xs[mid - 1] + xs[mid]) / 2.0
    })
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Median seconds at one rank, the baseline for speed-ups.
fn baseline(runs: &Runs) -> Option<f64> {
    runs.get(&1).and_then(|r| median(r, "seconds"))
}

fn fmt(x: Option<f64>, prec: usize) -> String {
    x.map_or_else(|| "-".to_string(), |x| format!("{x:.prec$}"))
}

fn fmt_sci(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_string(), |x| format!("{x:.3e}"))
}

fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain(std::iter::once(header[i].len()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| {
        let cells: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
        println!("| {} |", cells.join(" | "));
    };
    line(header.to_vec());
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    println!("|-{}-|", rule.join("-|-"));
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

fn cholesky_rows(runs: &Runs) -> Vec<Value> {
    let base = baseline(runs);
    runs.iter()
        .map(|(&r, recs)| {
            let secs = median(recs, "seconds");
            let gflops = median(recs, "gflops");
            let dense = median(recs, "dense_gflops");
            json!({
                "ranks": r,
                "runs": recs.len(),
                "median_seconds": secs,
                "median_gflops": gflops,
                "speedup": ratio(base, secs),
                "median_dense_seconds": median(recs, "dense_seconds"),
                "median_dense_gflops": dense,
                "ratio_ferry_faer": ratio(gflops, dense),
            })
        })
        .collect()
}

fn report_cholesky(runs: &Runs) {
    let base = baseline(runs);
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|(&r, recs)| {
            let secs = median(recs, "seconds");
            let gflops = median(recs, "gflops");
            let dense = median(recs, "dense_gflops");
            vec![
                r.to_string(),
                fmt(secs, 4),
                fmt(gflops, 2),
                fmt(ratio(base, secs), 2),
                fmt(dense, 2),
                fmt(ratio(gflops, dense), 2),
            ]
        })
        .collect();
    print_table(
        &[
            "ranks",
            "median s",
            "median GFLOP/s",
            "speed-up vs 1 rank",
            "dense-faer GFLOP/s (1 rank)",
            "ratio ferry/faer",
        ],
        &rows,
    );
}

fn stencil_rows(runs: &Runs) -> Vec<Value> {
    let base = baseline(runs);
    runs.iter()
        .map(|(&r, recs)| {
            let secs = median(recs, "seconds");
            let speedup = ratio(base, secs);
            json!({
                "ranks": r,
                "runs": recs.len(),
                "median_seconds": secs,
                "median_cell_updates_per_s": median(recs, "cell_updates_per_s"),
                "speedup": speedup,
                "efficiency": speedup.map(|s| s / f64::from(r)),
            })
        })
        .collect()
}

fn report_stencil(runs: &Runs) {
    let base = baseline(runs);
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|(&r, recs)| {
            let secs = median(recs, "seconds");
            let speedup = ratio(base, secs);
            vec![
                r.to_string(),
                fmt(secs, 4),
                fmt_sci(median(recs, "cell_updates_per_s")),
                fmt(speedup, 2),
                fmt(speedup.map(|s| s / f64::from(r)), 2),
            ]
        })
        .collect();
    print_table(
        &[
            "ranks",
            "median s",
            "median cell updates/s",
            "speed-up vs 1 rank",
            "efficiency",
        ],
        &rows,
    );
}

/// Write `target/bench/<bin>-summary.json` with the parameters, the table and the raw records.
fn write_summary(bin: &str, params: Value, common: &Common, runs: &Runs, rows: Vec<Value>) -> Result<()> {
    let raw: Map<String, Value> = runs
        .iter()
        .map(|(r, recs)| {
            let recs = recs.iter().cloned().map(Value::Object).collect();
            (r.to_string(), Value::Array(recs))
        })
        .collect();
    let summary = json!({
        "bench": bin,
        "params": params,
        "ranks": common.ranks,
        "reps": common.reps,
        "rows": rows,
        "raw": raw,
    });
    let path = util::target_dir("bench")?.join(format!("{bin}-summary.json"));
    let text = serde_json::to_string_pretty(&summary)?;
    std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    println!("summary written to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn median_ignores_missing_fields() {
        let recs = vec![
            rec(json!({"seconds": 3.0})),
            rec(json!({"seconds": 1.0, "gflops": 5.0})),
            rec(json!({"seconds": 2.0})),
            rec(json!({})),
        ];
        assert_eq!(median(&recs, "seconds"), Some(2.0));
        assert_eq!(median(&recs, "gflops"), Some(5.0));
        assert_eq!(median(&recs, "dense_gflops"), None);
        assert_eq!(fmt(median(&recs, "dense_gflops"), 2), "-");
    }
}
