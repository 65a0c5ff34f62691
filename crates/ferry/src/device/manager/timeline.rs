//! The GPU timeline: when each operation ran on each stream, measured with device events while a
//! trace is written (`FERRY_TRACE`).
//!
//! The manager records an event before an operation (kernel, stage-in, stage-out, write-back,
//! transfer copy) on its stream; the operation's own completion event ends it. Once both have
//! completed, the span is placed on the trace's clock through a per-device *anchor*: an event
//! whose trace time is known. The first anchor is recorded at start-up on an idle stream and
//! polled from the host until it has completed, its trace time bracketed by the queries to a
//! few µs (`anchor_event`); later anchors are the start events of recent operations, whose
//! trace times were computed from the previous anchor. Moving the anchor keeps every measured interval short, which matters because
//! CUDA reports intervals as `f32` milliseconds (0.25 µs resolution at 2 s, 8 µs at 60 s).
//!
//! Each span becomes one `ferry::gpu` trace event with the stream's track name, the start and
//! the duration in µs; `cargo xtask trace-merge` turns them into one track per stream.

use crate::device::{Backend, Stream, COMM_STREAMS};

/// Interval after which the anchor moves to a newer event (µs).
const REANCHOR_US: f64 = 1e6;

struct Anchor<E> {
    event: E,
    /// Trace time of `event` (µs since the trace began).
    at_us: f64,
}

/// Per-device anchors and track names.
pub(super) struct Timeline<E> {
    /// Per device, the track name of each stream (`cuda:0 exec 3`), by `Stream::index`.
    tracks: Vec<Vec<String>>,
    anchors: Vec<Anchor<E>>,
    /// Whether a failure was already logged (logged once, then the span is just dropped).
    warned: bool,
}

/// What a span reports besides its times.
pub(super) struct OpInfo<'a> {
    /// Operation name: the task class for kernels, else the kind of copy.
    pub(super) op: &'a str,
    /// Task sequence number (0 when the operation has none).
    pub(super) seq: u64,
    /// Bytes moved (0 for kernels).
    pub(super) bytes: u64,
}

impl<E> Timeline<E> {
    /// Turns timing on in `b` and anchors every device; `None` (the trace has no GPU tracks)
    /// when no trace is written or the backend cannot time events.
    pub(super) fn start<B: Backend<Event = E>>(b: &mut B, names: &[String]) -> Option<Self> {
        crate::runtime::trace::now_us()?;
        b.enable_timing();
        let mut anchors = Vec::with_capacity(names.len());
        for d in 0..names.len() {
            let anchored = anchor_event(b, d).and_then(|(e, at_us)| {
                // A backend that cannot time events has no timeline.
                Ok(b.elapsed_us(&e, &e)?.map(|_| Anchor { event: e, at_us }))
            });
            match anchored {
                Ok(Some(a)) => anchors.push(a),
                Ok(None) => return None,
                Err(e) => {
                    tracing::warn!(device = d, error = %e, "no GPU timeline in the trace");
                    return None;
                }
            }
        }
        let streams: Vec<Stream> = [Stream::In, Stream::Out]
            .into_iter()
            .chain((0..COMM_STREAMS).map(Stream::Comm))
            .chain((0..b.exec_streams().max(1)).map(Stream::Exec))
            .collect();
        let tracks = names
            .iter()
            .map(|dev| {
                let mut t = vec![String::new(); streams.len()];
                for s in &streams {
                    t[s.index()] = format!("{dev} {}", stream_name(*s));
                }
                t
            })
            .collect();
        Some(Timeline {
            tracks,
            anchors,
            warned: false,
        })
    }

    /// Starts an operation about to be enqueued on stream `s` of device `d`: the event that
    /// marks its start (`None` if it could not be recorded: the span is left out).
    pub(super) fn begin<B: Backend<Event = E>>(&mut self, b: &mut B, d: usize, s: Stream) -> Option<E> {
        match b.record(d, s) {
            Ok(e) => Some(e),
            Err(e) => {
                self.warn(&e);
                None
            }
        }
    }

    /// Reports an operation whose completion event `end` has completed; `start` came from
    /// [`Timeline::begin`] on the same stream.
    pub(super) fn end<B: Backend<Event = E>>(
        &mut self,
        b: &mut B,
        d: usize,
        s: Stream,
        start: E,
        end: &E,
        info: OpInfo<'_>,
    ) {
        let measured = b
            .elapsed_us(&self.anchors[d].event, &start)
            .and_then(|from_anchor| Ok((from_anchor, b.elapsed_us(&start, end)?)));
        let (from_anchor, dur) = match measured {
            Ok((Some(a), Some(x))) => (a, x),
            Ok(_) => return,
            Err(e) => return self.warn(&e),
        };
        let ts_us = self.anchors[d].at_us + from_anchor;
        tracing::info!(
            target: "ferry::gpu",
            track = %self.tracks[d][s.index()],
            op = %info.op,
            seq = info.seq,
            bytes = info.bytes,
            ts_us,
            dur_us = dur.max(0.0),
            "gpu.op"
        );
        if from_anchor > REANCHOR_US {
            self.anchors[d] = Anchor {
                event: start,
                at_us: ts_us,
            };
        }
    }

    fn warn(&mut self, e: &crate::device::DeviceError) {
        if !self.warned {
            self.warned = true;
            tracing::warn!(error = %e, "a GPU operation could not be timed; its span is left out of the trace");
        }
    }
}

/// Records an event on the idle `In` stream of `d` and finds when it completed on the trace's
/// clock: between the start of the last query that found it pending (or, if the first query
/// found it done, the moment before it was recorded) and the end of the first that found it
/// done. Tries up to eight times for a bracket of at most 4 µs (a first query or a preempted
/// thread widens it) and keeps the narrowest; its midpoint is the anchor's time. A blocking
/// wait instead placed every span ≈ 20 µs late on H200, where the waiting thread woke that long
/// after the event (docs/benchmarks.md, session 22).
fn anchor_event<B: Backend>(b: &mut B, d: usize) -> Result<(B::Event, f64), crate::device::DeviceError> {
    let now = || crate::runtime::trace::now_us().unwrap_or(0.0);
    let mut best: Option<(B::Event, f64, f64)> = None;
    for _ in 0..8 {
        let before = now();
        let e = b.record(d, Stream::In)?;
        let mut pending_at = before;
        let done_at = loop {
            let t = now();
            if b.done(&e)? {
                break now();
            }
            pending_at = t;
            if t - before > 1e6 {
                // A wedged device: wait, and accept a late anchor rather than none.
                b.synchronize(&e)?;
                break now();
            }
        };
        let width = done_at - pending_at;
        let at = (pending_at + done_at) / 2.0;
        if best.as_ref().is_none_or(|(_, _, w)| width < *w) {
            best = Some((e, at, width));
        }
        if width <= 4.0 {
            break;
        }
    }
    let (e, at, _) = best.expect("at least one try");
    Ok((e, at))
}

/// The track name of a stream, after its device's: `in`, `out`, `comm K`, `exec K`.
pub(super) fn stream_name(s: Stream) -> String {
    match s {
        Stream::In => "in".into(),
        Stream::Out => "out".into(),
        Stream::Comm(k) => format!("comm {k}"),
        Stream::Exec(k) => format!("exec {k}"),
    }
}

impl<B: Backend> super::Manager<B> {
    /// GPU timeline: the start event of an operation about to be enqueued on stream `s` of `d`
    /// (`None` when the timeline is off).
    pub(super) fn begin_op(&mut self, d: usize, s: Stream) -> Option<B::Event> {
        self.timeline.as_mut()?.begin(&mut self.b, d, s)
    }

    /// GPU timeline: reports an operation that `begin_op` started and whose completion event
    /// `end` has completed.
    pub(super) fn end_op(&mut self, d: usize, s: Stream, start: Option<B::Event>, end: &B::Event, info: OpInfo<'_>) {
        if let (Some(tl), Some(start)) = (self.timeline.as_mut(), start) {
            tl.end(&mut self.b, d, s, start, end, info);
        }
    }
}
