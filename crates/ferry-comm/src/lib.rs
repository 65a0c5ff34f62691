//! # ferry-comm
//!
//! The communication layer: one MPI progress thread per rank that makes every MPI call, from
//! `MPI_Init_thread` to `MPI_Finalize` — or, on a rank whose threads outnumber its cores,
//! shares the driving of its loop with the rank's idle threads ([`ProgressShare`]).
//!
//! This layer knows memory regions (pointer, length) and peers, not tasks or tiles. Other threads
//! hand it [`Cmd`]s over an unbounded channel and learn about completion through callbacks that
//! run on the MPI thread. It is the only crate of the workspace that depends on `mpi`.

#![warn(missing_docs)]

mod am_buf;
pub use am_buf::{AmBuf, AmPool, AM_COPY_OUT};
mod clock;
pub use clock::ClockPair;
mod collective;
mod matching;
mod mpi;
pub mod outcome;
mod progress;
mod shared;
mod window;

pub use shared::{ProgressShare, TICK as SHARED_PROGRESS_TICK};

pub use ferry_base::traffic::TrafficPath;

use crossbeam::channel::{self, Receiver, Sender};
use ferry_base::error::{FerryError, Rank, Result};
use ferry_base::faults::Faults;
use ferry_base::traffic::Traffic;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

/// Whether device memory is handed to MPI (`FERRY_GPU_DIRECT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GpuDirect {
    /// When the library reports CUDA support (`MPIX_Query_cuda_support() == 1`).
    #[default]
    Auto,
    /// Required: start-up fails unless the library reports CUDA support.
    On,
    /// Trust the caller: the MPI takes device pointers at run time although the library does not
    /// say so (Open MPI built without CUDA running over a CUDA-enabled UCX). An MPI that cannot
    /// take them will crash on the first device transfer.
    Force,
    /// Never.
    Off,
}

impl std::str::FromStr for GpuDirect {
    type Err = FerryError;
    fn from_str(s: &str) -> ferry_base::error::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(GpuDirect::Auto),
            "on" | "1" | "yes" | "true" => Ok(GpuDirect::On),
            "force" => Ok(GpuDirect::Force),
            "off" | "0" | "no" | "false" => Ok(GpuDirect::Off),
            _ => Err(FerryError::Config(format!(
                "FERRY_GPU_DIRECT={s:?}: expected auto, on, force or off"
            ))),
        }
    }
}

/// The communication layer's options (the runtime assembles them from its configuration).
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Rendezvous sends in flight per rank (at least 1).
    pub max_sends: usize,
    /// Rendezvous sends in flight per destination rank (at least 1).
    pub max_sends_per_peer: usize,
    /// Longest nap of the MPI progress thread while requests are in flight, microseconds
    /// (`None`: 50).
    pub progress_sleep_us: Option<u64>,
    /// Injected faults (`mpi-delay`, `slow-link`).
    pub faults: Faults,
    /// Work on (duplicates of) this communicator instead of `MPI_COMM_WORLD`.
    pub communicator: Option<CallerComm>,
    /// Whether the loop's driving may be shared later ([`CommHandle::share_progress`]): when
    /// ferry initialises MPI it then asks for `MPI_THREAD_SERIALIZED` (and accepts
    /// `MPI_THREAD_FUNNELED`, refusing to share under it); otherwise for
    /// `MPI_THREAD_FUNNELED`. Some MPI libraries do more work per call at the higher level
    /// (Open MPI over UCX flushes more since 4.1.7 and 5.0.4).
    pub shareable: bool,
}

/// The communication layer's live counters: the traffic its thread moves, and its own busy
/// time and naps.
#[derive(Default)]
pub struct CommCounters {
    /// Bytes and messages per path that the MPI thread sent and received.
    pub traffic: Traffic,
    /// Nanoseconds the MPI thread spent doing MPI work (not counted when callers drive the loop).
    pub busy_ns: AtomicU64,
    /// Times the MPI thread blocked on its channel for want of work.
    pub naps: AtomicU64,
}

pub use ferry_base::region::MemRegion;

/// Called on the MPI thread when a transfer ends.
pub use ferry_base::join::Done;

/// Which communicator a message travels on. Payloads and the protocol's descriptors share the
/// data communicator (their order per tag matters); acknowledgements flow the other way with the
/// same tag, so they get a communicator of their own and never match a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// Payloads and the transfer protocol's descriptors.
    Data,
    /// Acknowledgements.
    Ack,
    /// Payloads of one-sided operations (a communication engine's put and get): their tags
    /// are the engine's, never a payload's of [`Channel::Data`]. Receives on it are posted at
    /// once (`MPI_Irecv`), not matched on arrival: the engine posts each just before its
    /// message is asked for.
    OneSided,
    /// Active messages: never matched against a wanted receive; each arrival is received
    /// whole and handed to the listener ([`Cmd::Listen`]).
    Am,
}

/// Receives every active message ([`Channel::Am`]) on the MPI thread, in arrival order:
/// `(source, tag, payload)`. Messages from one source with one tag arrive in the order they were
/// sent (MPI's non-overtaking rule; they all travel on one communicator). It must not block:
/// the MPI thread makes no progress while it runs.
pub type AmListener = Box<dyn FnMut(Rank, i32, AmBuf) + Send>;

/// A communicator the caller supplies (`MPI_Comm`, for instance from rsmpi's `as_raw()`): the
/// MPI thread duplicates it at start-up and works on the duplicates only, so the caller's own
/// traffic on it never matches ferry's. MPI must then be initialised by the caller, with
/// `MPI_THREAD_MULTIPLE`.
#[derive(Clone, Copy)]
pub struct CallerComm(pub RawComm);

/// The MPI library's communicator handle type (`MPI_Comm`: a pointer under Open MPI, an `int`
/// under MPICH).
pub type RawComm = ::mpi::ffi::MPI_Comm;

// SAFETY: an `MPI_Comm` is a handle (a pointer under Open MPI, an int under MPICH) that MPI lets
// any thread use under MPI_THREAD_MULTIPLE, which start-up requires when one is supplied.
unsafe impl Send for CallerComm {}
unsafe impl Sync for CallerComm {}

impl std::fmt::Debug for CallerComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallerComm(..)")
    }
}

/// A point-to-point message. The transfer layer chooses everything; this layer posts it.
pub struct Transfer {
    /// The memory sent from or received into.
    pub region: Arc<dyn MemRegion>,
    /// The other rank.
    pub peer: Rank,
    /// The MPI tag (both sides compute it).
    pub tag: i32,
    /// The communicator it travels on.
    pub channel: Channel,
    /// Statistics: the path the message's bytes are counted on.
    pub path: TrafficPath,
    /// Whether the message counts as one transfer of its path (a staged tile's chunks count
    /// their bytes each, the tile once, which the transfer layer does).
    pub counts: bool,
    /// Posted at once, outside the send window (small payloads and control messages). All
    /// messages of one tag must agree, so that none overtakes another queued in the window.
    pub eager: bool,
    /// Called on the MPI thread when it has completed or failed.
    pub done: Done,
}

/// How long a blocking call of a [`CommHandle`] whose loop is shared drives the loop without
/// progress before it sleeps on its reply between passes.
const WAIT_SPIN_FOR: std::time::Duration = std::time::Duration::from_millis(5);

/// Blocks on `rx` until `deadline` if given; `None` when the sender went away or the deadline
/// passed.
fn recv_until<T>(rx: &Receiver<T>, deadline: Option<std::time::Instant>) -> Option<T> {
    match deadline {
        Some(d) => rx.recv_deadline(d).ok(),
        None => rx.recv().ok(),
    }
}

/// Where the MPI thread answers [`Cmd::ShareProgress`].
pub type ShareReply = Sender<Result<ProgressShare>>;

/// Where the MPI thread answers an allgather.
pub type GatherReply = Sender<Result<Vec<Vec<u8>>>>;

/// Work for the MPI thread.
pub enum Cmd {
    /// Post a send.
    Send(Transfer),
    /// Post a receive (matched on arrival).
    Recv(Transfer),
    /// Gathers one byte string from every rank, in rank order, on every rank.
    Allgather {
        /// This rank's bytes.
        data: Vec<u8>,
        /// Where every rank's bytes come back.
        reply: Sender<Result<Vec<Vec<u8>>>>,
    },
    /// Puts this rank's clock against rank 0's (`clock.rs`); every rank must send it, at
    /// start-up. `now` reads the clock, µs.
    SyncClocks {
        /// The clock to measure, µs.
        now: fn() -> f64,
        /// Where the pair comes back.
        reply: Sender<Result<ClockPair>>,
    },
    /// Describe what is in flight (for the watchdog).
    Report {
        /// Where the report goes.
        reply: Sender<String>,
    },
    /// From now on, receive every active message ([`Channel::Am`]) and hand it to this
    /// listener (replacing any earlier one). Until a listener is installed, active messages
    /// wait in MPI's queue. Every active message of the job must be at most
    /// [`AmPool::buf_len`] bytes: the receives are posted ahead, into buffers of the pool.
    Listen {
        /// Where the messages go.
        listener: AmListener,
        /// The buffers of the posted receives, sized for the largest active message any rank
        /// sends (senders may take theirs from it too).
        pool: Arc<AmPool>,
    },
    /// Run this once on the MPI thread, in command order (work that must not interleave with
    /// the listener's deliveries).
    Run(Box<dyn FnOnce() + Send>),
    /// Run this in every pass from now on.
    Poller(Box<dyn ferry_base::poller::Poller>),
    /// Nothing to do but a pass: a poller has work for it while the thread may be blocked.
    Wake,
    /// From now on, while requests are in flight but nothing happens, give the core up
    /// (`sched_yield`) instead of spinning and napping: the rank's threads outnumber its cores
    /// (`ferry_base::idle`), and the thread whose work this one waits for needs the core.
    YieldWhenIdle(bool),
    /// From now on, let any thread drive the loop ([`ProgressShare::try_pass`]) and keep the
    /// progress thread as a backstop (`shared.rs`): for a rank whose threads outnumber its
    /// cores. Answered with the share, or with an error when MPI runs below
    /// `MPI_THREAD_SERIALIZED` or the loop has no thread of its own ([`start_driven`]).
    /// Use [`CommHandle::share_progress`].
    ShareProgress {
        /// Where the share (or the refusal) goes.
        reply: ShareReply,
        /// The backstop's period.
        tick: std::time::Duration,
    },
    /// Finalize; with `abort`, `MPI_Abort` the job instead (after an error).
    Shutdown {
        /// `MPI_Abort` instead of finalizing.
        abort: bool,
    },
}

/// What the MPI thread learnt at start-up.
#[derive(Debug, Clone)]
pub struct InitInfo {
    /// This rank in the job.
    pub rank: Rank,
    /// Ranks in the job.
    pub size: usize,
    /// This rank among those of its node.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_size: usize,
    /// The MPI library's version string.
    pub library: String,
    /// `MPI_TAG_UB`: the largest tag.
    pub tag_ub: i32,
    /// `MPIX_Query_cuda_support()`, when the library has it.
    pub cuda_support: Option<bool>,
    /// This node's name (ranks with the same name share memory).
    pub host: String,
}

/// The other threads' side of the MPI thread.
#[derive(Clone)]
pub struct CommHandle {
    tx: Sender<Cmd>,
    /// Set once the loop's driving is shared ([`CommHandle::share_progress`]): the blocking
    /// calls below then drive it while they wait, instead of waiting for the progress thread's
    /// next tick.
    share: Arc<OnceLock<ProgressShare>>,
}

impl CommHandle {
    fn new(tx: Sender<Cmd>) -> CommHandle {
        CommHandle {
            tx,
            share: Arc::new(OnceLock::new()),
        }
    }

    /// Queues a command; fails only when the MPI thread has gone.
    pub fn post(&self, cmd: Cmd) -> Result<()> {
        let shutdown = matches!(cmd, Cmd::Shutdown { .. });
        self.tx.send(cmd).map_err(|_| FerryError::ThreadLost("mpi"))?;
        if let Some(share) = self.share.get() {
            if shutdown {
                share.wake_owner();
            } else {
                share.posted();
            }
        }
        Ok(())
    }

    /// [`CommHandle::post`], then, when the loop is shared ([`CommHandle::share_progress`]), one
    /// pass of it on this thread at once, which takes the command; none when another thread is
    /// in a pass (its pass, or the next, takes the command) or when this one is (inside a
    /// completion callback, where the pass under way takes it).
    ///
    /// For the sends on a graph's critical path: posted by a worker as a task finishes, a send
    /// otherwise waited until that worker next ran out of jobs to drive the loop, behind
    /// whichever task it ran next (the progress thread, which would take it at once, is only a
    /// backstop under shared progress).
    ///
    /// # Errors
    /// As [`CommHandle::post`].
    pub fn post_now(&self, cmd: Cmd) -> Result<()> {
        let Some(share) = self.share.get().filter(|_| !matches!(cmd, Cmd::Shutdown { .. })) else {
            return self.post(cmd);
        };
        self.tx.send(cmd).map_err(|_| FerryError::ThreadLost("mpi"))?;
        // A sleeping driver is woken only when this thread cannot take the command itself (a
        // wake-up it does not need is a context switch on a shared core).
        share.mark_queued();
        if share.try_pass().is_none() {
            share.posted();
        }
        Ok(())
    }

    /// Hands the driving of the progress loop to whichever threads call
    /// [`ProgressShare::try_pass`] (idle workers), keeping the progress thread as a backstop
    /// that drives it when nobody has for `tick` ([`SHARED_PROGRESS_TICK`], 200 µs, is what
    /// ferry uses unless told otherwise; 1 µs to 1 s). For a rank whose threads outnumber its
    /// cores; see `shared.rs`. From then on this handle's blocking calls
    /// ([`CommHandle::allgather`], [`CommHandle::sync_clocks`], [`CommHandle::report`]) drive
    /// the loop themselves while they wait. A second call returns the first share (its tick).
    ///
    /// # Errors
    /// [`FerryError::Config`] when MPI runs below `MPI_THREAD_SERIALIZED`, the loop is driven
    /// by its owner's calls ([`start_driven`]: call this only on a loop made by [`start`]), or
    /// `tick` is out of range; [`FerryError::ThreadLost`] when the MPI thread has gone.
    pub fn share_progress(&self, tick: std::time::Duration) -> Result<ProgressShare> {
        if let Some(share) = self.share.get() {
            return Ok(share.clone());
        }
        if !(std::time::Duration::from_micros(1)..=std::time::Duration::from_secs(1)).contains(&tick) {
            return Err(FerryError::Config(format!(
                "cannot share MPI progress: a backstop tick of {} µs (1 µs to 1 s)",
                tick.as_micros()
            )));
        }
        let (reply, rx) = channel::bounded(1);
        self.post(Cmd::ShareProgress { reply, tick })?;
        let share = rx.recv().map_err(|_| FerryError::ThreadLost("mpi"))??;
        Ok(self.share.get_or_init(|| share).clone())
    }

    /// Waits for a reply of the loop, until `deadline` if given; drives the loop meanwhile
    /// when its driving is shared. `None` when the loop dropped the reply or the deadline
    /// passed.
    fn wait_reply<T>(&self, rx: &Receiver<T>, deadline: Option<std::time::Instant>) -> Option<T> {
        let Some(share) = self.share.get() else {
            return recv_until(rx, deadline);
        };
        // The waiter drives the loop only while nobody else does. Where idle workers drive it,
        // one of their passes delivers the reply, and a waiter that drove too would take turns
        // with them on the loop's lock and, on a rank whose threads share a core (the only
        // ranks whose loop is shared by default), on the core: a collective waiting for a
        // slower rank would slow the very tasks that rank waits for. Nor does it spin for long
        // without progress of its own: the progress thread's backstop drives the loop too. In
        // both cases it sleeps on the reply, a tick at a time, and drives again only after a
        // whole tick in which nobody did.
        let mut last_work = std::time::Instant::now();
        // The pass count after this thread's last look, and whether other threads drive.
        let mut seen = share.passes();
        let mut others = false;
        loop {
            match rx.try_recv() {
                Ok(v) => return Some(v),
                Err(channel::TryRecvError::Disconnected) => return None,
                Err(channel::TryRecvError::Empty) => {}
            }
            let now = std::time::Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            let passes = share.passes();
            others |= passes != seen;
            seen = passes;
            if others || last_work.elapsed() >= WAIT_SPIN_FOR {
                let nap = deadline.map_or(share.tick(), |d| share.tick().min(d - now));
                match rx.recv_timeout(nap) {
                    Ok(v) => return Some(v),
                    Err(channel::RecvTimeoutError::Disconnected) => return None,
                    Err(channel::RecvTimeoutError::Timeout) => {}
                }
                let passes = share.passes();
                others = passes != seen;
                seen = passes;
                if others {
                    continue;
                }
            }
            let pass = share.try_pass();
            seen = share.passes();
            match pass {
                Some(Passed::Worked) => last_work = std::time::Instant::now(),
                // The progress thread finishes the loop, which answers or drops the reply.
                Some(Passed::Stopped) => return recv_until(rx, deadline),
                Some(Passed::Idle) => std::thread::yield_now(),
                // Another thread is in a pass: it drives.
                None => others = true,
            }
        }
    }

    /// What the MPI thread has in flight, or `None` when it does not answer within `timeout`.
    pub fn report(&self, timeout: std::time::Duration) -> Option<String> {
        let (reply, rx) = channel::bounded(1);
        self.post(Cmd::Report { reply }).ok()?;
        self.wait_reply(&rx, Some(std::time::Instant::now() + timeout))
    }

    /// Measures this rank's clock `now` (µs) against rank 0's; every rank must call it once, at
    /// start-up, before any transfer (see `clock.rs`).
    ///
    /// # Errors
    /// A failed message, or the MPI thread gone.
    pub fn sync_clocks(&self, now: fn() -> f64) -> Result<ClockPair> {
        let (reply, rx) = channel::bounded(1);
        self.post(Cmd::SyncClocks { now, reply })?;
        self.wait_reply(&rx, None).ok_or(FerryError::ThreadLost("mpi"))?
    }

    /// Starts an allgather of `data`; its outcome arrives on the returned channel (for a loop
    /// its owner drives, which must keep calling [`Driver::pass`] meanwhile).
    pub fn allgather_start(&self, data: Vec<u8>) -> Result<Receiver<Result<Vec<Vec<u8>>>>> {
        let (reply, rx) = channel::bounded(1);
        self.post(Cmd::Allgather { data, reply })?;
        Ok(rx)
    }

    /// Blocking allgather of `data` (called from the main thread).
    pub fn allgather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let (reply, rx) = channel::bounded(1);
        self.post(Cmd::Allgather { data, reply })?;
        self.wait_reply(&rx, None).ok_or(FerryError::ThreadLost("mpi"))?
    }
}

/// The MPI progress loop of a rank that drives it with its own calls ([`Driver::pass`])
/// instead of a thread of ferry's: whichever thread calls it makes the MPI calls, one thread at
/// a time (the `&mut`). Commands reach it through the [`CommHandle`] as they reach the thread.
pub struct Driver {
    state: Option<(progress::Loop, progress::Comms)>,
    rx: Receiver<Cmd>,
}

// SAFETY: the loop holds MPI handles, which MPI lets any thread use one at a time when it runs
// at MPI_THREAD_SERIALIZED or above, as `start_driven` makes sure; `&mut self` serialises.
unsafe impl Send for Driver {}

/// What one [`Driver::pass`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Passed {
    /// Something happened (a command, an arrival, a completion).
    Worked,
    /// Nothing happened.
    Idle,
    /// The loop has stopped (a shutdown command, or [`Driver::stop`]); MPI is finalized if ferry
    /// initialised it.
    Stopped,
}

impl Driver {
    /// One pass of the progress loop: the commands queued, arrivals, requests, collectives;
    /// completion callbacks and the listener run on the calling thread.
    pub fn pass(&mut self) -> Passed {
        let Some((lp, _)) = self.state.as_mut() else {
            return Passed::Stopped;
        };
        match lp.pass(&self.rx) {
            progress::Pass::Ran(true) => Passed::Worked,
            progress::Pass::Ran(false) => Passed::Idle,
            progress::Pass::Stop(abort) => {
                self.end(abort);
                Passed::Stopped
            }
        }
    }

    /// Handles `cmd` now, on the calling thread, when no command is queued before it (else, or
    /// once the loop has stopped, hands it back to be posted): a send then starts without
    /// waiting for the next pass, and commands keep their order.
    ///
    /// # Errors
    /// The command itself, not handled.
    pub fn submit(&mut self, cmd: Cmd) -> std::result::Result<(), Cmd> {
        match self.state.as_mut() {
            Some((lp, _)) if self.rx.is_empty() && !matches!(cmd, Cmd::Shutdown { .. }) => {
                lp.submit(cmd);
                Ok(())
            }
            _ => Err(cmd),
        }
    }

    /// Whether anything is in flight or expected (the owner should keep calling
    /// [`Driver::pass`]).
    pub fn waiting(&self) -> bool {
        self.state.as_ref().is_some_and(|(lp, _)| lp.waiting())
    }

    /// Stops the loop (as a shutdown command would): sends in flight may complete for a
    /// moment, everything else ends with an error, MPI is finalized if ferry initialised it.
    pub fn stop(&mut self) {
        self.end(false);
    }

    fn end(&mut self, abort: bool) {
        if let Some((mut lp, comms)) = self.state.take() {
            if !abort {
                lp.flush(&self.rx);
            }
            lp.finish(abort, comms);
            // The channel goes with the loop: a command posted from now on (a poller added on
            // another thread that checked the engine open just before it finalized) fails at
            // its `post` and is dropped there, rather than waiting unseen in a channel nobody
            // reads until the last handle goes. What was queued since the flush is dropped now.
            self.rx = channel::never();
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.end(false);
    }
}

/// Sets up the MPI progress loop on the calling thread, to be driven by the caller
/// ([`Driver::pass`]) instead of a thread of ferry's. Initialises MPI
/// (`MPI_THREAD_SERIALIZED`) unless the caller has (then with `MPI_THREAD_MULTIPLE`).
///
/// # Errors
/// As [`start`].
pub fn start_driven(cfg: &CommConfig, counters: Arc<CommCounters>) -> Result<(CommHandle, Driver, InitInfo)> {
    let (tx, rx): (Sender<Cmd>, Receiver<Cmd>) = channel::unbounded();
    let (lp, comms, info) = progress::init(cfg.clone(), counters, progress::Driven::Caller)?;
    Ok((
        CommHandle::new(tx),
        Driver {
            state: Some((lp, comms)),
            rx,
        },
        info,
    ))
}

/// Starts the MPI thread, which initialises MPI and waits until it reports rank and size. With
/// [`CommConfig::shareable`] it asks for `MPI_THREAD_SERIALIZED`, so that the loop's driving
/// may later be shared ([`CommHandle::share_progress`]), and accepts `MPI_THREAD_FUNNELED`
/// (the thread then makes every MPI call); otherwise it asks for `MPI_THREAD_FUNNELED`.
///
/// # Errors
/// [`FerryError::MpiInit`] when MPI was finalized already, was initialised by the caller with
/// less than `MPI_THREAD_MULTIPLE`, or provides less
/// than `MPI_THREAD_FUNNELED`.
pub fn start(cfg: &CommConfig, counters: Arc<CommCounters>) -> Result<(CommHandle, JoinHandle<()>, InitInfo)> {
    let (tx, rx): (Sender<Cmd>, Receiver<Cmd>) = channel::unbounded();
    let (init_tx, init_rx) = channel::bounded(1);
    let cfg = cfg.clone();
    let join = std::thread::Builder::new()
        .name("ferry-mpi".into())
        .spawn(move || progress::run(cfg, rx, init_tx, counters))
        .map_err(|e| FerryError::MpiInit(format!("cannot spawn the MPI thread: {e}")))?;
    match init_rx.recv() {
        Ok(Ok(info)) => Ok((CommHandle::new(tx), join, info)),
        Ok(Err(e)) => {
            let _ = join.join();
            Err(e)
        }
        Err(_) => {
            let _ = join.join();
            Err(FerryError::ThreadLost("mpi"))
        }
    }
}
