//! `cargo xtask trace-merge`: combine per-rank Chrome traces into one (see the `ferry-trace`
//! crate for what the merged trace holds).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct TraceMergeArgs {
    /// Directory holding the `trace-rank<N>.json` files.
    dir: PathBuf,
    /// Output file [default: <dir>/trace-merged.json].
    #[arg(short, long)]
    output: Option<PathBuf>,
}

pub fn run(args: TraceMergeArgs) -> Result<()> {
    let merged = ferry_trace::merge_dir(&args.dir)?;
    for (path, dropped) in &merged.repaired {
        eprintln!(
            "{}: warning: trace was not terminated; appended `]`{}",
            path.display(),
            if *dropped {
                " and dropped a partial last event"
            } else {
                ""
            }
        );
    }
    for ((rank, path, count), (_, shift)) in merged.ranks.iter().zip(&merged.shifts) {
        let clock = match shift {
            Some(dt) => format!("clock shifted by {dt:+.1} µs"),
            None => "no clock mark: clock left as it was".into(),
        };
        eprintln!("{}: rank {rank}, {count} events, {clock}", path.display());
    }
    let out = args.output.unwrap_or_else(|| args.dir.join("trace-merged.json"));
    ferry_trace::write_array(&out, &merged.events)?;
    eprintln!(
        "wrote {} ({} ranks, {} events, {} GPU stream tracks with {} operations)",
        out.display(),
        merged.ranks.len(),
        merged.events.len(),
        merged.stream_tracks,
        merged.stream_ops
    );
    Ok(())
}
