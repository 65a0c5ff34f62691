//! NVIDIA's own Cholesky on this process's GPUs: the anchor that ferry's distributed `cholesky`
//! is compared against on one node.
//!
//! Runs `cusolverMgPotrf` (cuSOLVERMg, the multi-GPU LAPACK of the CUDA toolkit) of the same
//! generated SPD matrix that `cholesky --n N --seed S` factors, spread over `--devices` in
//! column blocks of `--nb`; with `--dense`, also one single-GPU `cusolverDnDpotrf` on the first
//! device in the same process, so that the multi-GPU solver is checked against the one-GPU one
//! (time and log determinant). Prints a table; `--json PATH` writes the figures.
//!
//! ```text
//! potrf-anchor --n 32768 --nb 1024 --devices 0,1 --dense --json mg.json
//! ```
//!
//! Needs CUDA and `libcusolverMg`; without them it says which is missing and exits with 1.

use clap::Parser;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "cuSOLVERMg (and cuSOLVER) Cholesky of ferry's generated SPD matrix: the multi-GPU anchor")]
struct Args {
    /// Matrix order.
    #[arg(long, default_value_t = 32768)]
    n: usize,
    /// Column block size of cuSOLVERMg's 1D block-cyclic layout.
    #[arg(long, default_value_t = 1024)]
    nb: usize,
    /// CUDA ordinals to spread the matrix over, comma-separated (default: every visible GPU).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// Seed of the generated matrix (the `cholesky` default is 42).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also run one single-GPU `cusolverDnDpotrf` on the first device.
    #[arg(long)]
    dense: bool,
    /// Write the figures as JSON to this path.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// One solver's figures.
#[derive(Serialize, Debug)]
struct Row {
    solver: &'static str,
    devices: Vec<usize>,
    n: usize,
    nb: Option<usize>,
    seconds: f64,
    gflops: f64,
    log_det: f64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let devices = if args.devices.is_empty() {
        let count = ferry_kernels::cuda::visible_devices()?;
        if count == 0 {
            anyhow::bail!("no CUDA devices visible");
        }
        (0..count).collect()
    } else {
        args.devices.clone()
    };
    let mut rows = Vec::new();
    let mg = ferry_kernels::cuda::cusolvermg_dpotrf_baseline(&devices, args.n, args.nb, args.seed)?;
    rows.push(Row {
        solver: "cuSOLVERMg",
        devices: mg.devices.clone(),
        n: mg.n,
        nb: Some(mg.nb),
        seconds: mg.seconds,
        gflops: mg.gflops,
        log_det: mg.log_det,
    });
    if args.dense {
        let d = ferry_kernels::cuda::cusolver_dpotrf_baseline(devices[0], args.n, args.seed)?;
        rows.push(Row {
            solver: "cuSOLVER",
            devices: vec![devices[0]],
            n: d.n,
            nb: None,
            seconds: d.seconds,
            gflops: d.gflops,
            log_det: d.log_det,
        });
    }
    println!(
        "{:<11} {:>8} {:>7} {:>6} {:>10} {:>10} {:>22}",
        "solver", "devices", "n", "nb", "seconds", "GFLOP/s", "log det"
    );
    for r in &rows {
        let devs: Vec<String> = r.devices.iter().map(|d| d.to_string()).collect();
        println!(
            "{:<11} {:>8} {:>7} {:>6} {:>10.4} {:>10.1} {:>22.10e}",
            r.solver,
            devs.join(","),
            r.n,
            r.nb.map_or("-".to_string(), |b| b.to_string()),
            r.seconds,
            r.gflops,
            r.log_det
        );
    }
    if let [mg, dense] = &rows[..] {
        let rel = ((mg.log_det - dense.log_det) / dense.log_det).abs();
        println!(
            "cuSOLVERMg/cuSOLVER speed {:.3}, log det relative difference {rel:.2e}",
            dense.seconds / mg.seconds
        );
        if rel.is_nan() || rel >= 1e-9 {
            anyhow::bail!(
                "the two factorizations disagree: log det {} against {}",
                mg.log_det,
                dense.log_det
            );
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}
