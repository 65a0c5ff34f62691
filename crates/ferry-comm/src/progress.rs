//! The MPI progress loop.
//!
//! One iteration: drain the command channel (post receives at once, sends through the window),
//! `MPI_Testsome` over every request in flight, run the callbacks of finished ones, advance the
//! collective in progress. With nothing in flight the thread blocks on the channel; with requests
//! in flight but no progress it spins briefly, then naps on the channel with a growing timeout
//! (capped by `FERRY_PROGRESS_SLEEP_US`) so that a new command still wakes it at once — or, when
//! the rank's threads outnumber its cores ([`Cmd::YieldWhenIdle`]), yields its core in every
//! idle pass instead, so that the worker it waits for runs, and it runs again as soon as the
//! core is free.

use super::am_buf::{AmBuf, AmPool, AM_COPY_OUT};
use super::collective::Allgather;
use super::matching::Matching;
use super::mpi::{self as raw, Arrived, Finished, RawComm, RawRequest, RawStatus};
use super::window::SendWindow;
use super::{Channel, Cmd, GatherReply, InitInfo, Transfer};
use crate::CommConfig;
use crate::CommCounters;
use ::mpi::environment::Threading;
use ::mpi::raw::AsRaw;
use ::mpi::topology::Communicator;
use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};
use ferry_base::error::{FerryError, Result};
use ferry_base::faults::Jitter;
use ferry_base::traffic::{ActiveClock, TrafficPath};
use std::collections::VecDeque;
use std::os::raw::c_int;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Polls without sleeping this many times after the last progress before napping.
const SPINS_BEFORE_NAP: u32 = 64;
/// How long after its last work the thread yields instead of napping while a poller expects a
/// message ([`ferry_base::poller::Polled::expecting`]): an IPC transfer's descriptor or
/// acknowledgement comes back within tens of µs of what caused it, and a nap would see it only
/// when it ends (up to `FERRY_PROGRESS_SLEEP_US`).
const POLL_YIELD_FOR: Duration = Duration::from_micros(500);

/// Active-message receives posted ahead (`MPI_Irecv` from any source with any tag): a message
/// lands straight in one, as a ping-pong's pre-posted receive does, instead of waiting in MPI's
/// unexpected queue for a probe and a second receive (and, past the eager limit, for a
/// rendezvous started only then).
const AM_POSTED: usize = 16;

/// How long shutdown waits for each cancelled active-message receive to complete (a deadline of
/// its own: the sends' flush before it may have used all of theirs).
const AM_CANCEL_LIMIT: Duration = Duration::from_millis(100);

/// An active-message receive posted ahead, and its buffer.
struct PostedAm {
    /// Room for the largest message (length 0 until a message has landed), from the pool.
    buf: AmBuf,
    req: RawRequest,
}

/// How long an orderly shutdown waits for the sends still in flight ([`Loop::flush_sends`]).
const FLUSH_LIMIT: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Send,
    Recv,
}

struct Inflight {
    dir: Dir,
    t: Transfer,
    posted: Instant,
}

pub(super) struct Loop {
    comm: RawComm,
    /// The acknowledgement communicator ([`super::Channel::Ack`]).
    ack: RawComm,
    /// Payloads of one-sided operations ([`super::Channel::OneSided`]).
    one_sided: RawComm,
    /// Active messages ([`super::Channel::Am`]).
    am: RawComm,
    /// Receives active messages; until there is one, they wait in MPI's queue.
    listener: Option<super::AmListener>,
    /// The active-message receives posted ahead, in posting order (= arrival order of their
    /// messages): a message is handed on once every one before it has been.
    am_posted: VecDeque<PostedAm>,
    /// Where the posted receives' buffers come from (set with the first [`Cmd::Listen`]); its
    /// buffer size is the largest active message.
    am_pool: Option<Arc<AmPool>>,
    /// Only for the start-up clock synchronisation (`clock.rs`).
    clock_comm: RawComm,
    rank: i32,
    cfg: CommConfig,
    counters: Arc<CommCounters>,
    clock: ActiveClock,
    /// Requests moving data (sends, and receives whose message has arrived), tested each pass.
    reqs: Vec<RawRequest>,
    ops: Vec<Inflight>,
    /// Receives waiting for their message, and messages waiting for their receive.
    matching: Matching,
    window: SendWindow<Transfer>,
    collectives: VecDeque<(Vec<u8>, GatherReply)>,
    active: Option<Allgather>,
    size: usize,
    indices: Vec<c_int>,
    statuses: Vec<RawStatus>,
    finished: Vec<Finished>,
    /// Fault injection: finished requests held back until their time, and the delay source.
    delayed: Vec<(Instant, Inflight, Finished)>,
    jitter: Jitter,
    /// Run in every pass ([`Cmd::Poller`]).
    pollers: Vec<Box<dyn ferry_base::poller::Poller>>,
    /// Some poller expected more at its last run.
    polls_expected: bool,
    /// Whether the last pass ended after its pollers found work, before MPI.
    mpi_deferred: bool,
    /// Yield the core while waiting instead of spinning and napping ([`Cmd::YieldWhenIdle`]).
    yield_when_idle: bool,
    /// Whether the loop's own thread drives it, whose busy time (`CommCounters::busy_ns`) is
    /// worth a clock reading per pass; a caller that polls it between its own work does not
    /// keep that count, and saves the reading (a tenth of a small message's round trip).
    timed: bool,
    /// How the loop is driven: only a loop with its own thread can hand its driving over to
    /// the rank's idle threads ([`Cmd::ShareProgress`]).
    driven: Driven,
    /// MPI lets any thread call it, one at a time (`MPI_THREAD_SERIALIZED` or above): the
    /// loop may be driven from other threads than the one that set it up.
    serialized: bool,
    /// A [`Cmd::ShareProgress`] taken in the last pass, for [`Loop::serve`] to act on.
    share_asked: Option<(super::ShareReply, std::time::Duration)>,
    /// The loop is shared already (`shared.rs`).
    shared: bool,
}

/// The communicators the loop works on, and MPI itself when ferry initialised it: freed in
/// order, on the thread that drives the loop, before `MPI_Finalize`.
pub(super) struct Comms {
    universe: Option<::mpi::environment::Universe>,
    world: ::mpi::topology::SimpleCommunicator,
    comm: ::mpi::topology::SimpleCommunicator,
    ack: ::mpi::topology::SimpleCommunicator,
    one_sided: ::mpi::topology::SimpleCommunicator,
    am: ::mpi::topology::SimpleCommunicator,
    clock_comm: ::mpi::topology::SimpleCommunicator,
    local: ::mpi::topology::SimpleCommunicator,
}

impl Comms {
    /// Frees the communicators, then finalizes MPI when ferry initialised it (a caller's MPI
    /// stays initialised).
    fn free(self) {
        let Comms {
            universe,
            world,
            comm,
            ack,
            one_sided,
            am,
            clock_comm,
            local,
        } = self;
        drop(local);
        drop(clock_comm);
        drop(am);
        drop(one_sided);
        drop(ack);
        drop(comm);
        drop(world);
        drop(universe);
    }

    /// `MPI_Abort` on the job's communicator.
    fn abort(&self) -> ! {
        raw::abort(self.world.as_raw(), 1)
    }
}

/// How the loop is driven; decides the threading level ferry asks of MPI when it initialises
/// it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Driven {
    /// By its own thread, the only one that calls MPI (`MPI_THREAD_FUNNELED`).
    Thread,
    /// By its owner's calls from any thread, one at a time (`MPI_THREAD_SERIALIZED` at least).
    Caller,
}

/// Initialises MPI unless the caller has, and sets up the loop and its communicators.
pub(super) fn init(cfg: CommConfig, counters: Arc<CommCounters>, driven: Driven) -> Result<(Loop, Comms, InitInfo)> {
    // MPI initialised by the caller (a framework that links ferry): use it, and leave it
    // initialised at shutdown. The caller's threads may call MPI concurrently with ferry's, so
    // it must have asked for MPI_THREAD_MULTIPLE. Otherwise ferry initialises MPI (funneled when
    // its thread makes every call, serialized when the caller's calls drive it) and finalizes it
    // at shutdown.
    if ::mpi::environment::is_finalized() {
        return Err(FerryError::MpiInit(
            "MPI has been finalized in this process (a runtime that initialised MPI itself finalizes it at shutdown; to start ferry several times, initialise MPI yourself with MPI_THREAD_MULTIPLE)".into(),
        ));
    }
    let mut serialized = true;
    let universe = if ::mpi::environment::is_initialized() {
        let provided = ::mpi::environment::threading_support();
        if provided != Threading::Multiple {
            return Err(FerryError::MpiInit(format!(
                "MPI was initialised by the caller with {provided:?}; ferry calls MPI alongside the caller's threads, so initialise with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let ferry initialise MPI"
            )));
        }
        None
    } else {
        // A loop with its own thread that may be shared asks for serialized calls although
        // funneled would do: a rank whose threads outnumber its cores then lets its idle
        // workers drive the loop ([`Cmd::ShareProgress`]).
        let (asked, least) = match driven {
            Driven::Thread if cfg.shareable => (Threading::Serialized, Threading::Funneled),
            Driven::Thread => (Threading::Funneled, Threading::Funneled),
            Driven::Caller => (Threading::Serialized, Threading::Serialized),
        };
        let Some((universe, provided)) = ::mpi::initialize_with_threading(asked) else {
            return Err(FerryError::MpiInit(
                "MPI could not be initialised in this process".into(),
            ));
        };
        if provided < least {
            return Err(FerryError::MpiInit(format!(
                "the MPI library provides {provided:?}; ferry needs at least {least:?} here"
            )));
        }
        serialized = provided >= Threading::Serialized;
        Some(universe)
    };
    // The job's communicator: the caller's (duplicated: its own traffic never matches ferry's)
    // or the world.
    let world = match cfg.communicator {
        Some(caller) => {
            if universe.is_some() {
                return Err(FerryError::MpiInit(
                    "a communicator was supplied, but MPI was not initialised by the caller (initialise it with MPI_THREAD_MULTIPLE before handing ferry a communicator)".into(),
                ));
            }
            let c = raw::dup(caller.0)?;
            // SAFETY: a fresh intra-communicator that only this loop holds.
            unsafe { <::mpi::topology::SimpleCommunicator as ::mpi::raw::FromRaw>::from_raw(c) }
        }
        None => ::mpi::topology::SimpleCommunicator::world().duplicate(),
    };
    let comm = world.duplicate();
    comm.set_name("ferry");
    let ack = world.duplicate();
    ack.set_name("ferry-ack");
    let one_sided = world.duplicate();
    one_sided.set_name("ferry-one-sided");
    let am = world.duplicate();
    am.set_name("ferry-am");
    // The clock synchronisation's ping-pong, on a communicator nothing else probes.
    let clock_comm = world.duplicate();
    clock_comm.set_name("ferry-clock");
    let local = world.split_shared(world.rank());
    let info = InitInfo {
        rank: comm.rank(),
        size: comm.size() as usize,
        local_rank: local.rank() as usize,
        local_size: local.size() as usize,
        library: ::mpi::environment::library_version()
            .map(|s| s.trim_end_matches('\0').lines().next().unwrap_or("").to_string())
            .unwrap_or_default(),
        tag_ub: tag_upper_bound(comm.as_raw()),
        cuda_support: raw::query_cuda_support(),
        host: ::mpi::environment::processor_name().unwrap_or_default(),
    };
    [&comm, &ack, &one_sided, &am]
        .iter()
        .try_for_each(|c| raw::errors_return(c.as_raw()))?;
    let size = info.size;
    let faults = cfg.faults;
    let lp = Loop {
        comm: comm.as_raw(),
        ack: ack.as_raw(),
        one_sided: one_sided.as_raw(),
        am: am.as_raw(),
        listener: None,
        am_posted: VecDeque::new(),
        am_pool: None,
        clock_comm: clock_comm.as_raw(),
        rank: info.rank,
        window: SendWindow::new(size, cfg.max_sends, cfg.max_sends_per_peer),
        cfg,
        counters,
        clock: ActiveClock::new(),
        reqs: Vec::new(),
        ops: Vec::new(),
        matching: Matching::default(),
        collectives: VecDeque::new(),
        active: None,
        size,
        indices: Vec::new(),
        statuses: Vec::new(),
        finished: Vec::new(),
        delayed: Vec::new(),
        jitter: Jitter::new(info.rank as u64, faults.mpi_delay_us),
        pollers: Vec::new(),
        polls_expected: false,
        mpi_deferred: false,
        yield_when_idle: false,
        timed: matches!(driven, Driven::Thread),
        driven,
        serialized,
        share_asked: None,
        shared: false,
    };
    let comms = Comms {
        universe,
        world,
        comm,
        ack,
        one_sided,
        am,
        clock_comm,
        local,
    };
    Ok((lp, comms, info))
}

/// The body of the MPI thread.
pub(super) fn run(cfg: CommConfig, rx: Receiver<Cmd>, init_tx: Sender<Result<InitInfo>>, counters: Arc<CommCounters>) {
    ferry_base::affinity::note_thread(ferry_base::affinity::Role::Mpi);
    ferry_base::naps::precise();
    let (mut lp, comms, info) = match init(cfg, counters, Driven::Thread) {
        Ok(x) => x,
        Err(e) => {
            let _ = init_tx.send(Err(e));
            return;
        }
    };
    if init_tx.send(Ok(info)).is_err() {
        lp.cancel_all();
        comms.free();
        return;
    }
    match lp.serve(&rx) {
        Served::Stop(abort) => lp.finish(abort, comms),
        Served::Share(reply, tick) => super::shared::serve(lp, comms, rx, reply, tick),
    }
}

/// Why [`Loop::serve`] returned.
pub(super) enum Served {
    /// A shutdown (with `abort`), sends flushed unless aborting.
    Stop(bool),
    /// The rank's idle threads are to drive the loop from now on ([`Cmd::ShareProgress`]).
    Share(super::ShareReply, std::time::Duration),
}

/// What one pass of the loop found.
pub(super) enum Pass {
    /// It ran; whether anything happened.
    Ran(bool),
    /// A shutdown was asked for (with `abort`), or every sender has gone (an abort).
    Stop(bool),
}

fn tag_upper_bound(comm: RawComm) -> i32 {
    let mut val: *mut c_int = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: MPI_TAG_UB is a predefined attribute whose value is a pointer to int.
    unsafe {
        ::mpi::ffi::MPI_Comm_get_attr(
            comm,
            ::mpi::ffi::MPI_TAG_UB as c_int,
            &mut val as *mut *mut c_int as *mut std::os::raw::c_void,
            &mut flag,
        );
        if flag != 0 && !val.is_null() {
            *val
        } else {
            32767 // the standard's guaranteed minimum
        }
    }
}

impl Loop {
    /// Serves commands until shutdown, or until its driving is to be shared.
    fn serve(&mut self, rx: &Receiver<Cmd>) -> Served {
        let mut idle_polls: u32 = 0;
        let mut nap = Duration::from_micros(1);
        let mut last_work = Instant::now();
        let max_nap = Duration::from_micros(self.cfg.progress_sleep_us.unwrap_or(50).max(1));
        loop {
            if let Some((reply, tick)) = self.share_asked.take() {
                return Served::Share(reply, tick);
            }
            match self.pass(rx) {
                Pass::Stop(abort) => return Served::Stop(self.flush_sends(abort, Some(rx))),
                Pass::Ran(true) => {
                    idle_polls = 0;
                    nap = Duration::from_micros(1);
                    last_work = Instant::now();
                    continue;
                }
                Pass::Ran(false) => {}
            }
            // Idle.
            let waiting = self.waiting();
            if self.yield_when_idle && waiting {
                std::thread::yield_now();
                continue;
            }
            // A message another process writes into a poller's ring cannot end a nap
            // (only a command can): while pollers expect one, the thread gives its core up in
            // turns instead, for a while after its last work, then naps.
            if self.polls_expected && idle_polls >= SPINS_BEFORE_NAP && last_work.elapsed() < POLL_YIELD_FOR {
                std::thread::yield_now();
                continue;
            }
            let next = if !waiting {
                self.counters.naps.fetch_add(1, Relaxed);
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else if idle_polls < SPINS_BEFORE_NAP {
                idle_polls += 1;
                std::hint::spin_loop();
                continue;
            } else {
                self.counters.naps.fetch_add(1, Relaxed);
                let r = rx.recv_timeout(nap);
                nap = (nap * 2).min(max_nap);
                r
            };
            match next {
                Ok(Cmd::Shutdown { abort }) => return Served::Stop(self.flush_sends(abort, Some(rx))),
                Ok(cmd) => {
                    idle_polls = 0;
                    nap = Duration::from_micros(1);
                    self.handle(cmd);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Served::Stop(true),
            }
        }
    }

    /// One pass: the commands queued, the arrivals, the requests moving data, the collectives.
    pub(super) fn pass(&mut self, rx: &Receiver<Cmd>) -> Pass {
        let t0 = self.timed.then(Instant::now);
        // 1. Commands.
        let mut worked = match self.commands(rx) {
            Ok(w) => w,
            Err(stop) => return stop,
        };
        // 2. Arrivals (the pollers': the control ring), then the requests moving data.
        if !self.pollers.is_empty() {
            let (w, expecting) = ferry_base::poller::poll_all(&mut self.pollers);
            worked |= w;
            self.polls_expected = expecting;
            // What a poller found (a message in a ring) may have readied work for the thread
            // that drives this pass: a worker's next task, a caller's awaited reply. The pass
            // ends here and leaves MPI to the next one, so that the work starts without
            // waiting for a probe and a test of every request; never twice in a row, so MPI
            // waits one pass at most.
            if w && !self.mpi_deferred {
                self.mpi_deferred = true;
                self.account(t0);
                return Pass::Ran(true);
            }
        }
        self.mpi_deferred = false;
        let mut arrived = self.probe();
        if !self.reqs.is_empty() {
            arrived |= self.test_requests();
        }
        if !self.delayed.is_empty() {
            arrived |= self.release_delayed();
        }
        worked |= arrived;
        // What those arrivals and completions set off (a poller's deferred callbacks, such as an
        // active-message handler, and the sends they post) goes out in this pass rather than
        // the next: a reply then costs one pass instead of three, which is most of a small
        // message's round trip.
        if arrived {
            if !self.pollers.is_empty() {
                let (_, expecting) = ferry_base::poller::poll_all(&mut self.pollers);
                self.polls_expected = expecting;
            }
            if let Err(stop) = self.commands(rx) {
                return stop;
            }
        }
        // 3. Collectives.
        if self.active.is_none() {
            if let Some((data, reply)) = self.collectives.pop_front() {
                self.active = Allgather::start(data, self.size, self.comm, reply);
                worked = true;
            }
        }
        if let Some(a) = self.active.as_mut() {
            if a.poll(self.comm) {
                self.active = None;
                worked = true;
            }
        }
        if worked {
            self.account(t0);
        }
        Pass::Ran(worked)
    }

    /// Adds the time since `t0` (when passes are timed) to the busy time.
    fn account(&self, t0: Option<Instant>) {
        if let Some(t0) = t0 {
            self.counters.busy_ns.fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
        }
    }

    /// Handles the queued commands; whether there were any, or the stop a shutdown command (or
    /// a closed channel) asks for.
    fn commands(&mut self, rx: &Receiver<Cmd>) -> Result<bool, Pass> {
        let mut worked = false;
        loop {
            match rx.try_recv() {
                Ok(Cmd::Shutdown { abort }) => return Err(Pass::Stop(abort)),
                Ok(cmd) => {
                    worked = true;
                    self.handle(cmd);
                }
                Err(crossbeam::channel::TryRecvError::Empty) => return Ok(worked),
                Err(crossbeam::channel::TryRecvError::Disconnected) => return Err(Pass::Stop(true)),
            }
        }
    }

    /// Whether anything is in flight or expected, so that the loop must keep polling.
    /// An active message cannot wake a blocked thread (only a command can): with a listener
    /// installed the thread always naps with a timeout instead.
    pub(super) fn waiting(&self) -> bool {
        self.polls_expected
            || self.listener.is_some()
            || !self.reqs.is_empty()
            || self.matching.waiting() > 0
            || self.active.is_some()
            || !self.collectives.is_empty()
            || !self.delayed.is_empty()
    }

    /// The end of the loop: `MPI_Abort` after an error, else every pending operation ended,
    /// the communicators freed, and MPI finalized when ferry initialised it.
    pub(super) fn finish(mut self, abort: bool, comms: Comms) {
        if abort {
            // Even with nothing in flight here, other ranks may be blocked on this one (a
            // transfer or a collective it will never join): finalizing would hang them,
            // aborting ends them.
            tracing::error!(
                rank = self.rank,
                in_flight = self.ops.len(),
                "aborting the MPI job after an error"
            );
            comms.abort();
        }
        // (Also every message matched but never received: MPI wants them received.)
        self.cancel_all();
        comms.free();
    }

    /// At an orderly stop of a loop its owner drives: lets the sends in flight complete.
    pub(super) fn flush(&mut self, rx: &Receiver<Cmd>) {
        self.flush_sends(false, Some(rx));
    }

    /// Marks the loop shared: a later [`Cmd::ShareProgress`] is refused.
    pub(super) fn mark_shared(&mut self) {
        self.shared = true;
    }

    /// Handles one command outside a pass ([`crate::Driver::submit`]; never a shutdown).
    pub(super) fn submit(&mut self, cmd: Cmd) {
        self.handle(cmd);
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Send(t) => {
                if t.eager {
                    self.post(Dir::Send, t);
                } else if let Some(t) = self.window.admit(t.peer, t) {
                    self.post(Dir::Send, t);
                }
            }
            Cmd::Recv(t) => self.post(Dir::Recv, t),
            Cmd::Allgather { data, reply } => self.collectives.push_back((data, reply)),
            Cmd::SyncClocks { now, reply } => {
                let _ = reply.send(super::clock::sync(self.clock_comm, self.rank, self.size, &now));
            }
            Cmd::Report { reply } => {
                let _ = reply.send(self.report());
            }
            Cmd::Listen { listener, pool } => {
                self.listener = Some(listener);
                self.post_am_receives(pool);
            }
            Cmd::Run(f) => f(),
            Cmd::Poller(p) => self.pollers.push(p),
            Cmd::Wake => {}
            Cmd::YieldWhenIdle(on) => self.yield_when_idle = on,
            Cmd::ShareProgress { reply, tick } => {
                let refusal = match (self.driven, self.serialized) {
                    _ if self.shared => Some("the progress loop is shared already"),
                    (Driven::Caller, _) => Some("the progress loop is driven by its owner's calls already"),
                    (Driven::Thread, false) => Some(
                        "the MPI library provides only MPI_THREAD_FUNNELED: no thread but the progress thread may call it",
                    ),
                    (Driven::Thread, true) => None,
                };
                match refusal {
                    Some(why) => {
                        let _ = reply.send(Err(FerryError::Config(format!("cannot share MPI progress: {why}"))));
                    }
                    None => self.share_asked = Some((reply, tick)),
                }
            }
            Cmd::Shutdown { .. } => unreachable!("handled by the loop"),
        }
    }

    /// Takes every message that has arrived out of MPI's matching and receives those whose
    /// receive is wanted (see `matching.rs`); whether any arrived.
    fn probe(&mut self) -> bool {
        let mut any = self.listener.is_some() && self.receive_active_messages();
        for (channel, comm) in [(Channel::Data, self.comm), (Channel::Ack, self.ack)] {
            if self.matching.waiting_on(channel) == 0 {
                continue;
            }
            loop {
                match raw::improbe(comm) {
                    Ok(Some(m)) => {
                        any = true;
                        if let Some((t, m, at)) = self.matching.arrived(channel, m) {
                            self.receive(t, m, at);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        // The library cannot say what arrived: no waiting receive can complete.
                        // (Messages matched already stay, to be received at shutdown.)
                        for t in self.matching.drain_wanted() {
                            (t.done)(Err(e.duplicate()));
                        }
                        return true;
                    }
                }
            }
        }
        any
    }

    /// Posts the active-message receives ([`AM_POSTED`] buffers of `pool`), at the first
    /// listener. Their pool and size hold for the life of the loop: a later listener that
    /// announces larger messages is refused the size (its messages past it would be cut), and
    /// logged.
    fn post_am_receives(&mut self, pool: Arc<AmPool>) {
        if let Some(posted) = &self.am_pool {
            if pool.buf_len() > posted.buf_len() {
                tracing::error!(
                    posted = posted.buf_len(),
                    asked = pool.buf_len(),
                    "active messages stay limited to the size of the receives posted for the first listener"
                );
            }
            return;
        }
        for _ in 0..AM_POSTED {
            self.post_am_receive(pool.take());
        }
        self.am_pool = Some(pool);
    }

    /// A buffer of the pool for the next posted receive.
    fn am_buf(&self) -> AmBuf {
        self.am_pool
            .as_ref()
            .expect("receives are posted after the pool is set")
            .take()
    }

    /// Posts one active-message receive into `buf` (its capacity; emptied first).
    fn post_am_receive(&mut self, mut buf: AmBuf) {
        let v = buf.vec_mut();
        v.clear();
        let (ptr, cap) = (v.as_mut_ptr(), v.capacity());
        // SAFETY: the buffer's heap memory does not move when the vector does; it lives in
        // `am_posted` until the receive completes (or is leaked at shutdown while it runs).
        match unsafe { raw::irecv_any(ptr, cap, self.am) } {
            Ok(req) => self.am_posted.push_back(PostedAm { buf, req }),
            Err(e) => tracing::error!("an active-message receive could not be posted: {e}"),
        }
    }

    /// Hands every active message that has landed to the listener, in arrival order; whether
    /// any landed. The receives were posted ahead with one envelope (any source, any tag), so
    /// MPI matches arrivals to them in posting order: delivering in posting order is arrival
    /// order, and a receive that has not completed holds back only those behind it (its
    /// message is on its way, or none has come yet and none has come for those behind either).
    fn receive_active_messages(&mut self) -> bool {
        let mut any = false;
        while let Some(front) = self.am_posted.front_mut() {
            let (source, tag, len) = match raw::test_received(&mut front.req) {
                Ok(Some(x)) => x,
                Ok(None) => break,
                Err(e) => {
                    // The request may still be live and writing its buffer: that one is leaked,
                    // a new one posted in its place.
                    tracing::error!("active message lost: {e}");
                    let p = self.am_posted.pop_front().expect("front exists");
                    p.buf.leak();
                    self.post_am_receive(self.am_buf());
                    continue;
                }
            };
            any = true;
            let PostedAm { mut buf, .. } = self.am_posted.pop_front().expect("front exists");
            let v = buf.vec_mut();
            // SAFETY: the receive into the buffer's capacity completed with `len` bytes (at most
            // the capacity: MPI would have failed it with a truncation): MPI wrote all of them.
            unsafe { v.set_len(len.min(v.capacity())) };
            let bytes = if len <= AM_COPY_OUT {
                let b = AmBuf::from(v.to_vec());
                self.post_am_receive(buf);
                b
            } else {
                self.post_am_receive(self.am_buf());
                buf
            };
            let pc = self.counters.traffic.path(TrafficPath::Control);
            pc.bytes_recv.fetch_add(bytes.len() as u64, Relaxed);
            pc.recvs.fetch_add(1, Relaxed);
            if let Some(l) = self.listener.as_mut() {
                l(source, tag, bytes);
            }
        }
        any
    }

    /// Receives the matched message `m` into `t`'s region; `wanted` is when the receive was
    /// posted by the transfer layer.
    fn receive(&mut self, t: Transfer, mut m: Arrived, wanted: Instant) {
        // SAFETY: as for `post`: `t`, stored in `ops`, keeps the region alive until the request
        // completes, and nobody touches it meanwhile.
        match unsafe { raw::imrecv(t.region.ptr(), t.region.len(), &mut m) } {
            Ok(req) => {
                self.clock.start(t.path);
                self.reqs.push(req);
                self.ops.push(Inflight {
                    dir: Dir::Recv,
                    t,
                    posted: wanted,
                });
            }
            Err(e) => {
                // The message is matched: it must still be received, into scratch.
                raw::discard(m, Instant::now() + FLUSH_LIMIT);
                (t.done)(Err(e))
            }
        }
    }

    fn post(&mut self, dir: Dir, t: Transfer) {
        let am_max = self.am_pool.as_ref().map(|p| p.buf_len());
        if let Some(max) = am_max.filter(|&m| dir == Dir::Send && t.channel == Channel::Am && t.region.len() > m) {
            // Every rank receives active messages into buffers of this size: it would be lost.
            let e =
                FerryError::InvalidArgument(format!("an active message of {} bytes (at most {max})", t.region.len()));
            return (t.done)(Err(e));
        }
        if dir == Dir::Recv && t.channel == Channel::Am {
            let e =
                FerryError::Poisoned("active messages are received by the listener, not by a posted receive".into());
            return (t.done)(Err(e));
        }
        if dir == Dir::Recv && t.channel == Channel::OneSided {
            return self.post_irecv(t);
        }
        if dir == Dir::Recv {
            if let Some((t, m)) = self.matching.want(t.channel, t) {
                self.receive(t, m, Instant::now());
            }
            return;
        }
        let (ptr, len, path) = (t.region.ptr(), t.region.len(), t.path);
        if dir == Dir::Send && self.cfg.faults.slow_link_mbps > 0 && path != TrafficPath::Control {
            // Fault injection: a slow link holds the MPI thread for the transfer time.
            std::thread::sleep(std::time::Duration::from_micros(
                len as u64 / self.cfg.faults.slow_link_mbps,
            ));
        }
        let comm = match t.channel {
            Channel::Data => self.comm,
            Channel::Ack => self.ack,
            Channel::OneSided => self.one_sided,
            Channel::Am => self.am,
        };
        // SAFETY: the region is kept alive by `t` (stored in `ops`) until the request completes,
        // and the graph layer guarantees nobody writes it meanwhile.
        let posted = unsafe { raw::isend(ptr, len, t.peer, t.tag, comm) };
        match posted {
            Ok(req) => {
                self.clock.start(path);
                self.reqs.push(req);
                self.ops.push(Inflight {
                    dir,
                    t,
                    posted: Instant::now(),
                });
            }
            Err(e) => (t.done)(Err(e)),
        }
    }

    /// Posts a receive at once with `MPI_Irecv` (one-sided payloads: the engine posts each
    /// right before it asks for its message, so few are outstanding, and a rendezvous can start
    /// as soon as the message's header arrives instead of a pass later).
    fn post_irecv(&mut self, t: Transfer) {
        // SAFETY: as for `post`: `t`, stored in `ops`, keeps the region alive until the request
        // completes, and nobody touches it meanwhile.
        match unsafe { raw::irecv(t.region.ptr(), t.region.len(), t.peer, t.tag, self.one_sided) } {
            Ok(req) => {
                self.clock.start(t.path);
                self.reqs.push(req);
                self.ops.push(Inflight {
                    dir: Dir::Recv,
                    t,
                    posted: Instant::now(),
                });
            }
            Err(e) => (t.done)(Err(e)),
        }
    }

    fn test_requests(&mut self) -> bool {
        let mut finished = std::mem::take(&mut self.finished);
        if let Err(e) = raw::testsome(&mut self.reqs, &mut self.indices, &mut self.statuses, &mut finished) {
            // A failing MPI_Testsome leaves every request in an unknown state: fail them all.
            for op in self.ops.drain(..) {
                (op.t.done)(Err(e.duplicate()));
            }
            self.reqs.clear();
            self.finished = finished;
            return true;
        }
        let any = !finished.is_empty();
        // Highest index first, so swap_remove never moves an entry still to be handled.
        for f in finished.drain(..).rev() {
            self.reqs.swap_remove(f.index);
            let op = self.ops.swap_remove(f.index);
            let delay = self.jitter.next_delay();
            if delay.is_zero() {
                self.complete(op, &f);
            } else {
                self.delayed.push((Instant::now() + delay, op, f));
            }
        }
        self.finished = finished;
        any
    }

    /// Reports the held-back completions that are due (fault injection).
    fn release_delayed(&mut self) -> bool {
        let now = Instant::now();
        let mut any = false;
        let mut k = 0;
        while k < self.delayed.len() {
            if self.delayed[k].0 <= now {
                let (_, op, f) = self.delayed.swap_remove(k);
                self.complete(op, &f);
                any = true;
            } else {
                k += 1;
            }
        }
        any
    }

    fn complete(&mut self, op: Inflight, f: &Finished) {
        let Inflight { dir, t, posted } = op;
        let path = t.path;
        self.clock.stop(path, &self.counters.traffic);
        let bytes = t.region.len();
        let result = match (f.error, dir) {
            (Some(code), _) => Err(FerryError::Mpi {
                op: if dir == Dir::Send { "MPI_Isend" } else { "MPI_Imrecv" },
                peer: t.peer,
                tag: t.tag,
                msg: raw::error_string(code),
            }),
            (None, Dir::Recv) if f.count != bytes => Err(FerryError::SizeMismatch {
                peer: t.peer,
                tag: t.tag,
                got: f.count,
                expected: bytes,
            }),
            (None, _) => Ok(()),
        };
        let pc = self.counters.traffic.path(path);
        let n = u64::from(t.counts);
        let kind = match dir {
            Dir::Send => {
                pc.bytes_sent.fetch_add(bytes as u64, Relaxed);
                pc.sends.fetch_add(n, Relaxed);
                "send"
            }
            Dir::Recv => {
                pc.bytes_recv.fetch_add(bytes as u64, Relaxed);
                pc.recvs.fetch_add(n, Relaxed);
                "recv"
            }
        };
        let span = tracing::info_span!(
            "transfer",
            kind,
            path = path.name(),
            peer = t.peer,
            tag = t.tag,
            bytes,
            us = tracing::field::Empty
        );
        // The clock is read only for a span that goes somewhere: a small message's whole round
        // trip is a few hundred ns.
        if !span.is_disabled() {
            span.record("us", posted.elapsed().as_secs_f64() * 1e6);
        }
        let _g = span.enter();
        let (peer, windowed) = (t.peer, dir == Dir::Send && !t.eager);
        (t.done)(result);
        if windowed {
            for next in self.window.release(peer) {
                self.post(Dir::Send, next);
            }
        }
    }

    /// In-flight transfers (oldest first, at most 16 listed), queued sends and collectives.
    fn report(&self) -> String {
        let mut ops: Vec<&Inflight> = self.ops.iter().collect();
        ops.sort_by_key(|o| o.posted);
        let mut s = format!(
            "  MPI: {} transfers in flight, {} receives waiting for their message, {} sends queued behind the window, {} collectives pending\n",
            self.ops.len(),
            self.matching.waiting(),
            self.window.queued(),
            self.collectives.len() + usize::from(self.active.is_some())
        );
        for o in ops.iter().take(16) {
            let dir = if o.dir == Dir::Send { "send to" } else { "receive from" };
            s += &format!(
                "    {dir} rank {} tag {} ({} bytes, posted {:.1} s ago)\n",
                o.t.peer,
                o.t.tag,
                o.t.region.len(),
                o.posted.elapsed().as_secs_f64()
            );
        }
        let mut wanted: Vec<(&Transfer, Instant)> = self.matching.wanted().collect();
        wanted.sort_by_key(|w| w.1);
        for (t, at) in wanted.iter().take(16) {
            s += &format!(
                "    receive from rank {} tag {} ({} bytes, waiting for the message for {:.1} s)\n",
                t.peer,
                t.tag,
                t.region.len(),
                at.elapsed().as_secs_f64()
            );
        }
        s
    }

    /// At an orderly shutdown, lets the sends still in flight complete (for at most
    /// [`FLUSH_LIMIT`]): messages a rank posts after its own work is done — acknowledgements of
    /// IPC copies, whose consumers were released before the acknowledgement left — must reach
    /// their peer, whose work is not done without them. Receives still pending are cancelled
    /// afterwards as before. Sends that pollers or callbacks post meanwhile (a message that
    /// waited for room in a ring, with an MPI send behind it) are taken from `rx` and go too.
    /// Returns `abort` unchanged.
    fn flush_sends(&mut self, abort: bool, rx: Option<&Receiver<Cmd>>) -> bool {
        if abort {
            return abort;
        }
        let until = Instant::now() + FLUSH_LIMIT;
        let take_sends = |l: &mut Self| {
            while let Some(Ok(cmd)) = rx.map(Receiver::try_recv) {
                if let Cmd::Send(_) = cmd {
                    l.handle(cmd);
                }
            }
        };
        // Messages waiting for room in a ring go first (their peer reads on).
        while self.pollers.iter().any(|p| p.sending()) && Instant::now() < until {
            let worked = ferry_base::poller::poll_all(&mut self.pollers).0;
            take_sends(self);
            if !worked {
                std::thread::yield_now();
            }
        }
        take_sends(self);
        self.settle(until, |l| l.ops.iter().any(|o| o.dir == Dir::Send));
        abort
    }

    /// Tests the requests in flight while `pending` holds, until `until` at the latest.
    fn settle(&mut self, until: Instant, pending: impl Fn(&Self) -> bool) {
        while pending(self) && Instant::now() < until {
            if !self.test_requests() {
                std::thread::yield_now();
            }
            if !self.delayed.is_empty() {
                self.release_delayed();
            }
        }
    }

    /// The end of the loop (after `flush_sends` unless aborting): ends everything still
    /// pending — nothing in an orderly shutdown, the rest of a failed run otherwise.
    fn cancel_all(&mut self) {
        let shut = || FerryError::Poisoned("runtime shut down".into());
        for p in &mut self.pollers {
            p.close();
        }
        for t in self.window.drain() {
            (t.done)(Err(shut()));
        }
        // One-sided payload receives were posted before their message came: cancel them, so
        // that no late message lands in memory their owners get back with the error below (a
        // cancelled receive completes). Every other receive in flight is of a message already
        // matched: MPI cannot cancel it, and its buffer must outlive it. Let the requests finish
        // for a while; a receive still running after that keeps its buffer (leaked), a send is
        // cancelled.
        for (req, op) in self.reqs.iter_mut().zip(&self.ops) {
            if op.dir == Dir::Recv && op.t.channel == Channel::OneSided {
                raw::cancel_receive(req);
            }
        }
        let until = Instant::now() + FLUSH_LIMIT;
        self.settle(until, |l| !l.reqs.is_empty());
        // Completions held back by fault injection are reported now.
        for (_, op, f) in std::mem::take(&mut self.delayed) {
            self.complete(op, &f);
        }
        for (mut req, op) in self.reqs.drain(..).zip(self.ops.drain(..)) {
            let Transfer { region, done, .. } = op.t;
            if op.dir == Dir::Recv {
                std::mem::forget(region);
            } else {
                raw::cancel(&mut req);
            }
            done(Err(shut()));
        }
        // The active-message receives posted ahead: cancelled; each then completes (cancelled,
        // or with a message that matched meanwhile, dropped) and its buffer goes back to the
        // pool, or, still running after the limit (or untestable), is leaked: a buffer MPI may
        // still write must not be handed out again.
        let am_until = Instant::now() + AM_CANCEL_LIMIT;
        for mut p in std::mem::take(&mut self.am_posted) {
            raw::cancel_receive(&mut p.req);
            loop {
                match raw::test(&mut p.req) {
                    Ok(true) => break,
                    Ok(false) if Instant::now() < am_until => std::thread::yield_now(),
                    _ => {
                        p.buf.leak();
                        break;
                    }
                }
            }
        }
        let (wanted, early) = self.matching.drain();
        for t in wanted {
            (t.done)(Err(shut()));
        }
        for m in early {
            raw::discard(m, until);
        }
        if let Some(a) = self.active.take() {
            a.cancel();
        }
    }
}
