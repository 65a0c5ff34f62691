//! The GPU timeline: when each operation ran on each stream, measured with device events while a
//! trace is written (`FERRY_TRACE`).
//!
//! The manager records an event before an operation (kernel, stage-in, stage-out, write-back,
//! transfer copy) on its stream; the operation's own completion event ends it. Once both have
//! completed, the span is placed on the trace's clock through a per-device *anchor*: an event
//! whose trace time is known. The first anchor is recorded at start-up on an idle stream and
//! polled from the host until it has completed, its trace time bracketed by the queries to a
//! few µs (`anchor_event`).
//!
//! The device's event clock and the host's drift apart by a few µs per second (on H200, two
//! GPUs of one host drifted differently: spans 5 and 30 µs off 8 s after start-up),
//! so the anchor is renewed every [`REPROBE_US`] while the manager runs: a *probe* event is
//! recorded and the manager's loop queries it between its other work ([`Timeline::tick`]);
//! when one query found it pending and the next, at most [`PROBE_WIDTH_US`] later, found it
//! done, it becomes the anchor (a wider bracket is dropped and the next probe tried). Between
//! probes, an anchor older than [`REANCHOR_US`] moves to the start event of a recent operation,
//! which keeps every measured interval short: CUDA reports intervals as `f32` milliseconds
//! (0.25 µs resolution at 2 s, 8 µs at 60 s).
//!
//! Each span becomes one `ferry::gpu` trace event with the stream's track name, the start and
//! the duration in µs; `cargo xtask trace-merge` turns them into one track per stream.

use ferry_device::{Backend, Stream, COMM_STREAMS};

/// Interval after which the anchor moves to a newer event (µs).
const REANCHOR_US: f64 = 1e6;

/// Interval between probes that renew a device's anchor from the host clock (µs).
const REPROBE_US: f64 = 20_000.0;

/// Widest bracket (µs) between the query that found a probe pending and the one that found it
/// done for the probe to become the anchor (its time is the bracket's midpoint).
const PROBE_WIDTH_US: f64 = 4.0;

/// How long (µs) a tick that records a probe keeps querying it before going back to the
/// manager's other work: ≤ 0.25% of the manager's time at one probe per [`REPROBE_US`].
const PROBE_SPIN_US: f64 = 50.0;

struct Anchor<E> {
    event: E,
    /// Trace time of `event` (µs since the trace began).
    at_us: f64,
}

/// A probe event in flight: recorded on the device's `In` stream, queried by [`Timeline::tick`].
struct Probe<E> {
    event: E,
    /// Trace time of the start of the last query that found it pending (at first, of the
    /// record call).
    pending_at: f64,
}

/// Per-device anchors and track names.
pub(super) struct Timeline<E> {
    /// Per device, the track name of each stream (`cuda:0 exec 3`), by `Stream::index`.
    tracks: Vec<Vec<String>>,
    anchors: Vec<Anchor<E>>,
    /// Per device, the probe in flight.
    probes: Vec<Option<Probe<E>>>,
    /// Per device, the trace time (µs) at which the next probe is due.
    next_probe: Vec<f64>,
    /// Anchors renewed by probes, over all devices.
    renewals: u64,
    /// How far (µs) the last renewed anchor had drifted from the one it replaced.
    last_shift_us: f64,
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
        ferry_base::trace_clock::now_us()?;
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
        let due = now() + REPROBE_US;
        Some(Timeline {
            tracks,
            probes: anchors.iter().map(|_| None).collect(),
            next_probe: vec![due; anchors.len()],
            anchors,
            renewals: 0,
            last_shift_us: 0.0,
            warned: false,
        })
    }

    /// Renews the anchors: records a probe on each device where one is due and queries it for
    /// up to [`PROBE_SPIN_US`] (an idle stream passes an event within a few µs); a probe still
    /// pending is queried again at later ticks. A narrowly bracketed probe becomes the anchor
    /// (reporting how far the old anchor had drifted, `gpu.anchor`). Called from the manager's
    /// loop between its other work; costs one clock read when nothing is due.
    pub(super) fn tick<B: Backend<Event = E>>(&mut self, b: &mut B) {
        let t = now();
        for d in 0..self.anchors.len() {
            match self.probes[d].take() {
                None if t >= self.next_probe[d] => {
                    // This device's bracket starts here, not with the tick (the devices before
                    // it may have spent the spin).
                    let before = now();
                    match b.record(d, Stream::In) {
                        Ok(event) => {
                            let mut p = Some(Probe {
                                event,
                                pending_at: before,
                            });
                            while let Some(q) = p.take() {
                                p = self.query(b, d, q);
                                if now() - before > PROBE_SPIN_US {
                                    break;
                                }
                            }
                            self.probes[d] = p;
                        }
                        Err(e) => {
                            self.next_probe[d] = t + REPROBE_US;
                            self.warn(&e);
                        }
                    }
                }
                None => {}
                Some(p) => self.probes[d] = self.query(b, d, p),
            }
        }
    }

    /// Queries probe `p` of device `d`: gives it back while it is pending; once done, makes it
    /// the anchor if the bracket is narrow, else schedules another probe soon.
    fn query<B: Backend<Event = E>>(&mut self, b: &mut B, d: usize, mut p: Probe<E>) -> Option<Probe<E>> {
        let q = now();
        match b.done(&p.event) {
            Ok(false) => {
                p.pending_at = q;
                Some(p)
            }
            Ok(true) => {
                let done_at = now();
                if done_at - p.pending_at <= PROBE_WIDTH_US {
                    self.next_probe[d] = done_at + REPROBE_US;
                    self.renew(b, d, p.event, (p.pending_at + done_at) / 2.0, done_at - p.pending_at);
                } else {
                    // Too wide a bracket (the manager was busy elsewhere): try again soon.
                    self.next_probe[d] = done_at + REPROBE_US / 20.0;
                }
                None
            }
            Err(e) => {
                self.next_probe[d] = q + REPROBE_US;
                self.warn(&e);
                None
            }
        }
    }

    /// Makes `event`, completed at trace time `at_us`, the anchor of device `d`.
    fn renew<B: Backend<Event = E>>(&mut self, b: &mut B, d: usize, event: E, at_us: f64, width_us: f64) {
        if let Ok(Some(from_anchor)) = b.elapsed_us(&self.anchors[d].event, &event) {
            let shift_us = at_us - (self.anchors[d].at_us + from_anchor);
            self.last_shift_us = shift_us;
            tracing::info!(target: "ferry::gpu", device = d, shift_us, width_us, "gpu.anchor");
        }
        self.renewals += 1;
        self.anchors[d] = Anchor { event, at_us };
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

    fn warn(&mut self, e: &ferry_device::DeviceError) {
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
/// after the event.
fn anchor_event<B: Backend>(b: &mut B, d: usize) -> Result<(B::Event, f64), ferry_device::DeviceError> {
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

/// The trace clock (µs), 0 when no trace is written.
fn now() -> f64 {
    ferry_base::trace_clock::now_us().unwrap_or(0.0)
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

    /// GPU timeline: renews the devices' clock anchors (a no-op when the timeline is off).
    pub(super) fn tick_timeline(&mut self) {
        if let Some(tl) = self.timeline.as_mut() {
            tl.tick(&mut self.b);
        }
    }

    /// GPU timeline: reports an operation that `begin_op` started and whose completion event
    /// `end` has completed.
    pub(super) fn end_op(&mut self, d: usize, s: Stream, start: Option<B::Event>, end: &B::Event, info: OpInfo<'_>) {
        if let (Some(tl), Some(start)) = (self.timeline.as_mut(), start) {
            tl.end(&mut self.b, d, s, start, end, info);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_device::emu::{EmuBackend, EmuConfig};
    use std::time::{Duration, Instant};

    /// Probes renew the anchor while the manager runs, and place events on the trace clock: the
    /// emulated device stamps its events with the host's clock (no drift), so each renewal's
    /// shift is the probe's own error, within its bracket.
    #[test]
    fn probes_renew_the_anchor_on_the_trace_clock() {
        ferry_base::trace_clock::start_for_tests();
        let cfg = EmuConfig {
            devices: 2,
            capacity: 1 << 20,
            exec_streams: 1,
            fail_alloc: Vec::new(),
            fail_copy: Vec::new(),
            delay_us: 0,
            seed: 0,
        };
        let mut b = EmuBackend::new(&cfg).expect("emulated devices");
        let names = ["emu:0".to_string(), "emu:1".to_string()];
        let mut tl = Timeline::start(&mut b, &names).expect("emulated events are timed");
        let (t0, mut shifts) = (Instant::now(), Vec::new());
        while shifts.len() < 6 && t0.elapsed() < Duration::from_secs(20) {
            let seen = tl.renewals;
            tl.tick(&mut b);
            if tl.renewals > seen {
                shifts.push(tl.last_shift_us);
            }
        }
        assert_eq!(shifts.len(), 6, "anchors renewed in {:?}", t0.elapsed());
        // Two devices at one probe per 20 ms each: 6 renewals take ≥ 40 ms.
        assert!(t0.elapsed() >= Duration::from_millis(40), "probes came too often");
        shifts.sort_by(f64::total_cmp);
        let median = (shifts[2] + shifts[3]) / 2.0;
        assert!(median.abs() <= 25.0, "shifts {shifts:?} µs");
    }
}
