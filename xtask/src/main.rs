//! Build automation for the ferry workspace. Run it as `cargo xtask <command>`.

mod bench;
mod cpuload;
mod demo;
mod fuzz;
mod gaps;
mod install;
mod metg;
mod plot;
mod results;
mod test;
mod trace;
mod util;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Build automation for the ferry workspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Factorize the covariance matrix of the GeoNames cities with the `cholesky` example
    /// under mpirun (installs system dependencies and builds in release mode first).
    Demo(demo::DemoArgs),
    /// Check formatting, run clippy, build all binaries and run the whole test suite
    /// with cargo-nextest (the multi-rank tests launch mpirun themselves).
    Test(test::TestArgs),
    /// Run an example binary at several rank counts and summarize the timings.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// METG(50%) of ferry and of plain MPI on Task Bench, interleaved, medians (current figures:
    /// `docs/results.md`).
    Metg(metg::MetgArgs),
    /// Generate `docs/results.md` (one table per workload and machine) from the JSON records in
    /// `docs/records/`; `--check` fails when the page is not what the records give.
    Results(results::ResultsArgs),
    /// Build the C ABI and install libferry.so, ferry.h and ferry.pc under a prefix.
    InstallCapi(install::InstallArgs),
    /// Run the coverage-guided fuzz targets (AFL++ via cargo-afl) for a bounded time each.
    Fuzz(fuzz::FuzzArgs),
    /// Merge per-rank Chrome traces (`trace-rank*.json`) into one file with one process per rank.
    TraceMerge(trace::TraceMergeArgs),
    /// Per device, the gaps between the kernels of one task class and how late the GPU manager
    /// launched them, from per-rank traces (`FERRY_TRACE`).
    TraceGaps(gaps::TraceGapsArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Test(args) => test::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::TraceMerge(args) => trace::run(args),
        Command::TraceGaps(args) => gaps::run(args),
        Command::InstallCapi(args) => install::run(args),
        Command::Metg(args) => metg::run(args),
        Command::Results(args) => results::run(args),
        Command::Fuzz(args) => fuzz::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            // Propagate a child's exit status where there is one.
            let code = err
                .downcast_ref::<util::CommandFailed>()
                .and_then(|f| f.code)
                .and_then(|c| u8::try_from(c).ok())
                .filter(|&c| c != 0)
                .unwrap_or(1);
            ExitCode::from(code)
        }
    }
}
