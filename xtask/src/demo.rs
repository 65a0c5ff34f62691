//! `cargo xtask demo`: the Gaussian-process Cholesky demo on real data.

use anyhow::Result;
use clap::Args;

use crate::util;

#[derive(Args)]
pub struct DemoArgs {
    /// Number of cities (matrix order) taken from data/cities1000.csv.
    #[arg(long, default_value_t = 4096)]
    count: u32,
    /// Number of MPI ranks.
    #[arg(long, default_value_t = 2)]
    np: u32,
    /// Tile size.
    #[arg(long, default_value_t = 256)]
    nb: u32,
}

pub fn run(args: DemoArgs) -> Result<()> {
    util::install_deps()?;
    util::run(util::cargo().args(["build", "--release", "-p", "ferry-examples"]))?;
    util::target_dir("demo")?;
    util::run(
        util::mpirun(args.np)
            .arg("target/release/cholesky")
            .args(["--points", "data/cities1000.csv"])
            .arg("--count")
            .arg(args.count.to_string())
            .arg("--nb")
            .arg(args.nb.to_string())
            .args(["--json", "target/demo/cholesky.json"]),
    )
}
