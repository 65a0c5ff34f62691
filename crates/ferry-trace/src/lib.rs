//! Merging ferry's per-rank traces into one Chrome/Perfetto trace.
//!
//! With `FERRY_TRACE=DIR`, every rank writes `DIR/trace-rank{r}.json`: a JSON array of Chrome
//! trace events (the [trace event format]) with one track per thread — the GPU manager, the MPI
//! progress thread, the workers, the I/O thread. The GPU manager also reports each operation it
//! timed on a device stream (kernels, stage-ins, stage-outs, write-backs, transfer copies) as an
//! instant event of category `ferry::gpu` whose arguments carry the stream's track name, the
//! start and the duration in µs on the trace's clock.
//!
//! [`merge_dir`] reads every rank's file and returns one trace in which each rank is a process
//! (`rank r`), each thread keeps its track, and each device stream becomes a track of its own
//! (`cuda:0 exec 2`, `emu:1 in`, …) holding its operations as complete (`X`) events, ordered
//! after the threads. A file that ends early (a rank killed before it flushed) is repaired by
//! closing the array, dropping a partly written last event.
//!
//! Each rank's trace counts time from that rank's own start. At start-up every rank measures its
//! clock against rank 0's by ping-pong and marks the result, an event of category `ferry::clock`
//! whose arguments say that its time `ts_us` was rank 0's `ref_us` (to within half of `rtt_us`,
//! the round trip of the sample kept: a few µs on one node). The merge shifts each rank's
//! timestamps by `ref_us − ts_us`, onto rank 0's clock, so cross-rank gaps (a kernel on one rank,
//! the copy of its output on another) are accurate to that bound. Traces of older versions mark
//! the end of an allgather instead (no `ref_us`): those marks are made to coincide with the first
//! rank's, accurate only to the allgather's exit skew (34–39 µs measured on one node).
//!
//! [trace event format]: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU

use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The category of the GPU manager's stream operations (the `target` of its trace events).
pub const GPU_CATEGORY: &str = "ferry::gpu";
/// The category of the clock mark every rank writes at the same instant.
pub const CLOCK_CATEGORY: &str = "ferry::clock";

/// Thread ids of stream tracks start here (the tracing layer numbers threads from 1).
const STREAM_TID_BASE: u64 = 1_000_000;

/// Errors of [`merge_dir`] and [`write_array`].
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A file or directory could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause, said in the message (not also the `source`: reports that print the
        /// chain, `{:#}`, said it twice).
        error: std::io::Error,
    },
    /// A file is not JSON, even after closing an unterminated array.
    #[error("{path}: not a JSON trace: {error}")]
    Parse {
        /// The path.
        path: PathBuf,
        /// The parser's message.
        error: serde_json::Error,
    },
    /// A file is JSON but neither an array of events nor an object with `traceEvents`.
    #[error("{0}: not a Chrome trace (neither an event array nor an object with traceEvents)")]
    NotATrace(PathBuf),
    /// The directory has no `trace-rank<N>.json`.
    #[error("no trace-rank<N>.json files in {0}")]
    NoTraces(PathBuf),
    /// Two files name the same rank.
    #[error("two files for rank {rank}: {first} and {second}")]
    DuplicateRank {
        /// The rank.
        rank: u32,
        /// One file.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
}

/// What [`merge_dir`] produced.
#[derive(Debug)]
pub struct Merged {
    /// The merged events, metadata first per rank.
    pub events: Vec<Value>,
    /// The ranks merged, ascending, with their input file and event count.
    pub ranks: Vec<(u32, PathBuf, usize)>,
    /// Stream tracks created, over all ranks.
    pub stream_tracks: usize,
    /// Stream operations placed on them.
    pub stream_ops: usize,
    /// Files that ended early and were closed: with whether a partial last event was dropped.
    pub repaired: Vec<(PathBuf, bool)>,
    /// Per rank merged, the shift applied to its timestamps (µs) to put it on the first rank's
    /// clock; `None` for a rank without a clock mark (left as it was).
    pub shifts: Vec<(u32, Option<f64>)>,
}

/// Merges the `trace-rank<N>.json` files of `dir` (see the crate documentation).
///
/// # Errors
/// [`MergeError::NoTraces`] when there are none; [`MergeError::DuplicateRank`] when two files
/// name one rank (`trace-rank1.json` and `trace-rank-1.json`); an unreadable or malformed file.
pub fn merge_dir(dir: &Path) -> Result<Merged, MergeError> {
    let io = |error| MergeError::Io {
        path: dir.to_path_buf(),
        error,
    };
    let mut inputs: Vec<(u32, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if let Some(rank) = path.file_name().and_then(|n| n.to_str()).and_then(rank_of) {
            inputs.push((rank, path));
        }
    }
    if inputs.is_empty() {
        return Err(MergeError::NoTraces(dir.to_path_buf()));
    }
    inputs.sort();
    if let Some(w) = inputs.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(MergeError::DuplicateRank {
            rank: w[0].0,
            first: w[0].1.clone(),
            second: w[1].1.clone(),
        });
    }
    let mut merged = Merged {
        events: Vec::new(),
        ranks: Vec::new(),
        stream_tracks: 0,
        stream_ops: 0,
        repaired: Vec::new(),
        shifts: Vec::new(),
    };
    let mut reference: Option<f64> = None;
    for (rank, path) in inputs {
        let (mut events, repaired) = read_events(&path)?;
        let shift = clock_mark(&events).map(|mark| match mark {
            Mark::Measured { local, rank0 } => rank0 - local,
            Mark::Common(at) => *reference.get_or_insert(at) - at,
        });
        if let Some(dt) = shift.filter(|dt| *dt != 0.0) {
            shift_times(&mut events, dt);
        }
        merged.shifts.push((rank, shift));
        if let Some(dropped) = repaired {
            merged.repaired.push((path.clone(), dropped));
        }
        merged.ranks.push((rank, path, events.len()));
        merged.events.push(json!({
            "ph": "M",
            "name": "process_name",
            "pid": rank,
            "args": { "name": format!("rank {rank}") },
        }));
        merged.events.push(json!({
            "ph": "M",
            "name": "process_sort_index",
            "pid": rank,
            "args": { "sort_index": rank },
        }));
        let mut streams = StreamTracks::default();
        for mut event in events {
            let Value::Object(map) = &mut event else { continue };
            // Our own process name replaces any the rank wrote.
            if is_meta(map, "process_name") {
                continue;
            }
            if let Some(op) = streams.convert(rank, map) {
                merged.events.push(op);
                continue;
            }
            map.insert("pid".into(), json!(rank));
            merged.events.push(event);
        }
        merged.stream_ops += streams.ops;
        merged.stream_tracks += streams.tids.len();
        merged.events.extend(streams.metadata(rank));
    }
    Ok(merged)
}

/// A rank's clock mark.
enum Mark {
    /// Its clock read `local` when rank 0's read `rank0` (the ping-pong's mark).
    Measured { local: f64, rank0: f64 },
    /// An instant common to all ranks, at `.0` on this rank's clock (older traces).
    Common(f64),
}

/// A rank's clock mark, if its trace has one.
fn clock_mark(events: &[Value]) -> Option<Mark> {
    let e = events.iter().find(|e| e["cat"] == CLOCK_CATEGORY)?;
    let local = number(&e["args"]["ts_us"]).or_else(|| e["ts"].as_f64())?;
    Some(match number(&e["args"]["ref_us"]) {
        Some(rank0) => Mark::Measured { local, rank0 },
        None => Mark::Common(local),
    })
}

/// Adds `dt` µs to every timestamp of one rank: the events' own and the GPU operations' starts.
fn shift_times(events: &mut [Value], dt: f64) {
    for e in events {
        if let Some(ts) = e["ts"].as_f64() {
            e["ts"] = json!(ts + dt);
        }
        let marked = e["cat"] == GPU_CATEGORY || e["cat"] == CLOCK_CATEGORY;
        if let (true, Some(ts)) = (marked, number(&e["args"]["ts_us"])) {
            e["args"]["ts_us"] = json!(ts + dt);
        }
    }
}

fn is_meta(map: &Map<String, Value>, name: &str) -> bool {
    map.get("ph").and_then(Value::as_str) == Some("M") && map.get("name").and_then(Value::as_str) == Some(name)
}

/// The stream tracks of one rank: track name → thread id, in order of appearance.
#[derive(Default)]
struct StreamTracks {
    tids: BTreeMap<String, u64>,
    ops: usize,
}

impl StreamTracks {
    /// A complete event on its stream's track for a GPU manager's stream operation; `None` for
    /// any other event (or one without the arguments a stream operation has).
    fn convert(&mut self, rank: u32, map: &Map<String, Value>) -> Option<Value> {
        if map.get("cat").and_then(Value::as_str) != Some(GPU_CATEGORY) {
            return None;
        }
        let args = map.get("args")?.as_object()?;
        let track = args.get("track")?.as_str()?;
        let ts = number(args.get("ts_us")?)?;
        let dur = number(args.get("dur_us")?)?;
        let name = args.get("op").and_then(Value::as_str).unwrap_or("gpu");
        let int = |k: &str| args.get(k).and_then(number).map_or(Value::Null, |x| json!(x as u64));
        let next = STREAM_TID_BASE + self.tids.len() as u64;
        let tid = *self.tids.entry(track.to_string()).or_insert(next);
        self.ops += 1;
        Some(json!({
            "ph": "X",
            "cat": "gpu",
            "name": name,
            "pid": rank,
            "tid": tid,
            "ts": ts,
            "dur": dur,
            "args": { "seq": int("seq"), "bytes": int("bytes") },
        }))
    }

    /// Names of the stream tracks, sorted after the threads by device and stream.
    fn metadata(&self, rank: u32) -> Vec<Value> {
        let mut order: Vec<(&String, &u64)> = self.tids.iter().collect();
        order.sort_by_key(|(name, _)| track_order(name));
        let mut out = Vec::new();
        for (k, (name, tid)) in order.into_iter().enumerate() {
            out.push(json!({
                "ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                "args": { "name": name },
            }));
            out.push(json!({
                "ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                "args": { "sort_index": STREAM_TID_BASE + k as u64 },
            }));
        }
        out
    }
}

/// A number, or a string holding one (the tracing layer writes every field as a string).
fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// Sort key of a stream track `"<device> <stream> [k]"`: device, then in, out, comm, exec, then
/// the stream number as a number (`exec 10` after `exec 9`).
fn track_order(name: &str) -> (String, u8, u64, String) {
    let mut words = name.split(' ');
    let device = words.next().unwrap_or_default().to_string();
    let kind = match words.next() {
        Some("in") => 0,
        Some("out") => 1,
        Some("comm") => 2,
        Some("exec") => 3,
        _ => 4,
    };
    let k = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
    (device, kind, k, name.to_string())
}

/// The rank in a file name `trace-rank<N>.json` (a `-` or `_` before N is allowed).
pub fn rank_of(name: &str) -> Option<u32> {
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
/// The second value says whether the file was repaired, and if so whether an event was dropped.
///
/// # Errors
/// An unreadable file, or one that is not a trace even after repair.
pub fn read_events(path: &Path) -> Result<(Vec<Value>, Option<bool>), MergeError> {
    let text = std::fs::read_to_string(path).map_err(|error| MergeError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    let (value, repaired) = match serde_json::from_str::<Value>(&text) {
        Ok(v) => (v, None),
        Err(error) => match repair_unterminated(&text) {
            Some((v, dropped)) => (v, Some(dropped)),
            None => {
                return Err(MergeError::Parse {
                    path: path.to_path_buf(),
                    error,
                })
            }
        },
    };
    match value {
        Value::Array(events) => Ok((events, repaired)),
        Value::Object(mut obj) => match obj.remove("traceEvents") {
            Some(Value::Array(events)) => Ok((events, repaired)),
            _ => Err(MergeError::NotATrace(path.to_path_buf())),
        },
        _ => Err(MergeError::NotATrace(path.to_path_buf())),
    }
}

/// Closes an unterminated JSON array of events. Returns the value and whether a partial
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

/// Writes `events` as a JSON array, one event per line.
///
/// # Errors
/// The file cannot be created or written.
pub fn write_array(path: &Path, events: &[Value]) -> Result<(), MergeError> {
    let io = |error| MergeError::Io {
        path: path.to_path_buf(),
        error,
    };
    let file = File::create(path).map_err(io)?;
    let mut w = BufWriter::new(file);
    let mut write = || -> std::io::Result<()> {
        writeln!(w, "[")?;
        for (i, event) in events.iter().enumerate() {
            serde_json::to_writer(&mut w, event)?;
            writeln!(w, "{}", if i + 1 < events.len() { "," } else { "" })?;
        }
        writeln!(w, "]")?;
        w.flush()
    };
    write().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unreadable and malformed files name their path and say the cause once: the message
    /// carries it and no `source` repeats it (reports print the chain with `{:#}`).
    #[test]
    fn errors_say_their_cause_once() {
        let dir = std::env::temp_dir().join(format!("ferry-trace-errors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("trace-rank0.json");
        let e = read_events(&missing).unwrap_err();
        assert!(matches!(e, MergeError::Io { .. }), "{e}");
        let bad = dir.join("trace-rank1.json");
        std::fs::write(&bad, "{not json").unwrap();
        let p = read_events(&bad).unwrap_err();
        assert!(matches!(p, MergeError::Parse { .. }), "{p}");
        for (e, path) in [(&e, &missing), (&p, &bad)] {
            let s = e.to_string();
            assert!(s.contains(&path.display().to_string()), "{s}");
            assert!(std::error::Error::source(e).is_none(), "{s}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

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

    /// A rank whose mark says its 10 µs was rank 0's 80 µs moves by +70 µs, whatever the first
    /// rank's mark says; rank 0 stays.
    #[test]
    fn measured_marks_put_ranks_on_rank_zeros_clock() {
        let dir = std::env::temp_dir().join(format!("ferry-trace-clock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mark = |ts: f64, r0: f64| {
            json!({"ph": "i", "pid": 1, "tid": 1, "ts": ts + 1.0, "cat": CLOCK_CATEGORY, "name": "event",
                   "args": {"ts_us": ts.to_string(), "ref_us": r0.to_string(), "rtt_us": "3.0"}})
        };
        let b = |ts: f64| json!({"ph": "B", "pid": 1, "tid": 1, "ts": ts, "name": "x"});
        std::fs::write(
            dir.join("trace-rank0.json"),
            json!([b(5.0), mark(50.0, 50.0)]).to_string(),
        )
        .unwrap();
        std::fs::write(
            dir.join("trace-rank1.json"),
            json!([b(20.0), mark(10.0, 80.0)]).to_string(),
        )
        .unwrap();
        let m = merge_dir(&dir).unwrap();
        assert_eq!(m.shifts, [(0, Some(0.0)), (1, Some(70.0))]);
        assert!(m.events.iter().any(|e| e["pid"] == 1 && e["ts"] == 90.0));
        assert!(m.events.iter().any(|e| e["pid"] == 0 && e["ts"] == 5.0));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn stream_operations_become_tracks() {
        let dir = std::env::temp_dir().join(format!("ferry-trace-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let op = |track: &str, ts: f64| {
            json!({"ph": "i", "pid": 1, "tid": 2, "ts": ts + 5.0, "cat": GPU_CATEGORY, "name": "event",
                   "args": {"track": track, "op": "step", "seq": "7", "bytes": "0", "ts_us": ts.to_string(), "dur_us": "3.5"}})
        };
        let rank0 = json!([
            {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "ferry-gpu"}},
            op("emu:0 exec 10", 1.0), op("emu:0 exec 9", 2.0), op("emu:0 in", 3.0), op("emu:0 exec 9", 9.0),
            {"ph": "B", "pid": 1, "tid": 2, "ts": 1.0, "name": "gpu.exec", "cat": "ferry"},
            {"ph": "i", "pid": 1, "tid": 2, "ts": 100.5, "cat": "ferry::clock", "args": {"ts_us": "100.5"}},
        ]);
        std::fs::write(dir.join("trace-rank0.json"), rank0.to_string()).unwrap();
        // Rank 1 died before closing its array.
        std::fs::write(
            dir.join("trace-rank1.json"),
            // Its clock started 100 µs after rank 0's.
            "[{\"ph\":\"B\",\"pid\":1,\"tid\":1,\"ts\":2.0},\n\
             {\"ph\":\"i\",\"pid\":1,\"tid\":1,\"ts\":0.5,\"cat\":\"ferry::clock\",\"args\":{\"ts_us\":\"0.5\"}},\n{\"ph\":",
        )
        .unwrap();
        let m = merge_dir(&dir).unwrap();
        assert_eq!(m.shifts, [(0, Some(0.0)), (1, Some(100.0))]);
        assert!(
            m.events.iter().any(|e| e["pid"] == 1 && e["ts"] == 102.0),
            "rank 1 on rank 0's clock"
        );
        assert_eq!(m.ranks.iter().map(|r| r.0).collect::<Vec<_>>(), [0, 1]);
        assert_eq!((m.stream_tracks, m.stream_ops), (3, 4));
        assert_eq!(m.repaired.len(), 1);
        let spans: Vec<&Value> = m.events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(spans.len(), 4);
        assert!(spans
            .iter()
            .all(|e| e["pid"] == 0 && e["dur"] == 3.5 && e["name"] == "step"));
        assert_eq!(spans[0]["ts"], 1.0, "the stream's own start, not the report's time");
        let names: Vec<&str> = m
            .events
            .iter()
            .filter(|e| e["name"] == "thread_name" && e["tid"].as_u64().unwrap() >= STREAM_TID_BASE)
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["emu:0 in", "emu:0 exec 9", "emu:0 exec 10"]);
        assert!(m.events.iter().all(|e| e["pid"] == 0 || e["pid"] == 1));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
