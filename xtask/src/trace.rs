//! `cargo xtask trace-merge`: combine per-rank Chrome traces into one.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

#[derive(Args)]
pub struct TraceMergeArgs {
    /// Directory holding the `trace-rank<N>.json` files.
    dir: PathBuf,
    /// Output file [default: <dir>/trace-merged.json].
    #[arg(short, long)]
    output: Option<PathBuf>,
}

pub fn run(args: TraceMergeArgs) -> Result<()> {
    let mut inputs: Vec<(u32, PathBuf)> = Vec::new();
    let entries = std::fs::read_dir(&args.dir).with_context(|| format!("reading {}", args.dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some(rank) = rank_of(name) {
            inputs.push((rank, path));
        }
    }
    if inputs.is_empty() {
        bail!("no trace-rank<N>.json files in {}", args.dir.display());
    }
    inputs.sort();
    if let Some(w) = inputs.windows(2).find(|w| w[0].0 == w[1].0) {
        bail!(
            "two files for rank {}: {} and {}",
            w[0].0,
            w[0].1.display(),
            w[1].1.display()
        );
    }

    let mut merged: Vec<Value> = Vec::new();
    for (rank, path) in &inputs {
        let events = read_events(path)?;
        let count = events.len();
        merged.push(json!({
            "ph": "M",
            "name": "process_name",
            "pid": rank,
            "args": { "name": format!("rank {rank}") },
        }));
        for mut event in events {
            if let Value::Object(map) = &mut event {
                // Our own process_name replaces any the rank wrote.
                if map.get("ph").and_then(Value::as_str) == Some("M")
                    && map.get("name").and_then(Value::as_str) == Some("process_name")
                {
                    continue;
                }
                map.insert("pid".into(), json!(rank));
            }
            merged.push(event);
        }
        eprintln!("{}: rank {rank}, {count} events", path.display());
    }

    let out = args.output.unwrap_or_else(|| args.dir.join("trace-merged.json"));
    write_array(&out, &merged)?;
    eprintln!(
        "wrote {} ({} ranks, {} events)",
        out.display(),
        inputs.len(),
        merged.len()
    );
    Ok(())
}

/// The rank in a file name `trace-rank<N>.json` (a `-` or `_` before N is allowed).
fn rank_of(name: &str) -> Option<u32> {
    let digits = name
        .strip_prefix("trace-rank")?
        .strip_suffix(".json")?
        .trim_start_matches(['-', '_']);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The events of a Chrome trace: a JSON array, an object with `traceEvents`, or an array whose
/// closing `]` (and possibly a partly written last event) is missing because the process died.
fn read_events(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value = match serde_json::from_str::<Value>(&text) {
        Ok(v) => v,
        Err(err) => match repair_unterminated(&text) {
            Some((v, dropped)) => {
                eprintln!(
                    "{}: warning: trace was not terminated; appended `]`{}",
                    path.display(),
                    if dropped {
                        " and dropped a partial last event"
                    } else {
                        ""
                    }
                );
                v
            }
            None => {
                return Err(err).with_context(|| format!("parsing {}", path.display()));
            }
        },
    };
    match value {
        Value::Array(events) => Ok(events),
        Value::Object(mut obj) => match obj.remove("traceEvents") {
            Some(Value::Array(events)) => Ok(events),
            _ => bail!("{}: object without a traceEvents array", path.display()),
        },
        _ => bail!("{}: not a Chrome trace", path.display()),
    }
}

/// Close an unterminated JSON array of events. Returns the value and whether a partial
/// trailing event had to be dropped.
fn repair_unterminated(text: &str) -> Option<(Value, bool)> {
    let body = text.trim_end();
    if !body.trim_start().starts_with('[') {
        return None;
    }
    let close = |s: &str| {
        let s = s.trim_end().trim_end_matches(',');
        serde_json::from_str::<Value>(&format!("{s}]")).ok()
    };
    if let Some(v) = close(body) {
        return Some((v, false));
    }
    // Cut back to an earlier `}` that ends a complete event; give up after a few tries.
    let mut end = body.len();
    for _ in 0..64 {
        end = body[..end].rfind('}')?;
        if let Some(v) = close(&body[..=end]) {
            return Some((v, true));
        }
    }
    None
}

/// Write `events` as a JSON array, one event per line.
fn write_array(path: &Path, events: &[Value]) -> Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::new(file);
    writeln!(w, "[")?;
    for (i, event) in events.iter().enumerate() {
        serde_json::to_writer(&mut w, event)?;
        writeln!(w, "{}", if i + 1 < events.len() { "," } else { "" })?;
    }
    writeln!(w, "]")?;
    w.flush().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_from_file_name() {
        assert_eq!(rank_of("trace-rank0.json"), Some(0));
        assert_eq!(rank_of("trace-rank-12.json"), Some(12));
        assert_eq!(rank_of("trace-rank.json"), None);
        assert_eq!(rank_of("trace-merged.json"), None);
        assert_eq!(rank_of("trace-rank1.json.tmp"), None);
    }

    #[test]
    fn repairs_killed_trace() {
        let (v, dropped) = repair_unterminated("[\n{\"ph\":\"B\"},\n").unwrap();
        assert_eq!(v, json!([{"ph": "B"}]));
        assert!(!dropped);
        let (v, dropped) =
            repair_unterminated("[\n{\"ph\":\"B\",\"args\":{\"a\":1}},\n{\"ph\":\"E\",\"args\":{\"a\":1}").unwrap();
        assert_eq!(v, json!([{"ph": "B", "args": {"a": 1}}]));
        assert!(dropped);
        assert!(repair_unterminated("{\"traceEvents\":[").is_none());
    }
}
