//! CPU workers and their ready queues: a global injector, one FIFO deque per worker, and work
//! stealing between workers (crossbeam-deque, after rayon-core's registry).
//!
//! Workers never block on transfers: a task reaches a worker only once every input is in place.
//! They call MPI only through their idle work ([`IdleWork`]), when the rank shares the driving
//! of its progress loop with them.

mod help;
mod sleep;

use crossbeam::deque::{Injector, Steal, Stealer, Worker};
use sleep::Sleep;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A unit of CPU work.
pub(crate) trait Job: Send + 'static {
    /// What every job of a pool runs with (the dispatcher). Each worker holds one reference to
    /// it for its whole life, so a job carries none: a count in the job, taken by the thread
    /// that made it ready and dropped by the one that ran it, was a cache line handed between
    /// cores on every hand-off of a fine-grained graph.
    type Context: Send + Sync + 'static;

    /// What a finished job may leave to its worker to drop later: references to state that
    /// other threads share (see [`Job::run`]).
    type Spent;

    /// Runs the job on worker `worker`. What it returns the worker keeps, and drops the next
    /// time it finds no job, or once it holds [`SPENT_BATCH`] of them: a fine-grained task's
    /// last references (its node, its tiles, its class) are reference counts that the
    /// inserting thread also writes, and dropping them one task at a time, on the way to the
    /// next task, bounced each of those cache lines between cores once per task.
    fn run(self, worker: usize, cx: &Arc<Self::Context>) -> Option<Self::Spent>;
}

/// Work besides jobs that idle workers do: driving the rank's MPI progress when the rank's
/// threads outnumber its cores (`ferry_comm::ProgressShare`), so that the thread waiting for a
/// message is the one that polls for it instead of a progress thread that needs its core.
pub(crate) trait IdleWork: Send + Sync {
    /// Does one round of the work unless another thread is doing it; whether it did anything.
    fn run(&self) -> bool;

    /// Whether the work expects more soon (requests in flight): an idle worker keeps doing it
    /// for up to [`DRIVE_FOR`] after its last progress instead of parking.
    fn pending(&self) -> bool;
    /// Whether work was handed to it that nobody has taken up yet (commands posted): a worker
    /// about to park does not.
    fn queued(&self) -> bool;
}

/// How long an idle worker keeps driving [`IdleWork`] that is pending but makes no progress
/// before it parks (the progress thread's own backstop then drives it): long enough to carry
/// a fine-grained graph across a peer's tasks of a few milliseconds, short enough not to hold
/// a core busy through a long wait.
const DRIVE_FOR: Duration = Duration::from_millis(5);

/// [`Shared::idle_driver`] when no worker does the idle work.
const NO_DRIVER: usize = usize::MAX;

/// The most spent jobs ([`Job::Spent`]) a worker holds before it drops them all.
pub(crate) const SPENT_BATCH: usize = 32;

/// How idle workers wait for their next job before they park.
#[derive(Clone, Debug)]
pub(crate) enum IdleWait {
    /// Spin, then yield the core: the rank's threads have cores of their own.
    Spin,
    /// Yield the core at once: the rank's threads outnumber its cores (`ferry_base::idle`),
    /// and a spinning worker would hold the core that the thread making its next job ready
    /// needs.
    Yield,
    /// Spin while the flag is down, yield while it is up: the workers have their cores, and
    /// the one thread they share them with is the inserting thread, whose flag
    /// (`Tracker::inserter_awake`) is down while it sleeps on the graph (a rank per core:
    /// the worker spins through the run once insertion is over, and gives way while it goes
    /// on). A yield costs a system call, and the wait for a message a pass and that call.
    YieldToInserter(Arc<AtomicBool>),
}

impl IdleWait {
    /// Whether an idle worker spins now.
    fn spins(&self) -> bool {
        match self {
            IdleWait::Spin => true,
            IdleWait::Yield => false,
            IdleWait::YieldToInserter(awake) => !awake.load(Ordering::Relaxed),
        }
    }

    /// Whether an idle worker past its spin gives its core up in each round: always, except
    /// on a core that only a sleeping inserting thread shares.
    fn gives_way(&self) -> bool {
        match self {
            IdleWait::YieldToInserter(awake) => awake.load(Ordering::Relaxed),
            IdleWait::Spin | IdleWait::Yield => true,
        }
    }
}

struct Shared<J> {
    /// How idle workers wait ([`IdleWait`]).
    idle_wait: IdleWait,
    /// What idle workers do besides looking for jobs ([`IdleWork`]).
    idle_work: Option<Arc<dyn IdleWork>>,
    /// The worker doing the idle work, [`NO_DRIVER`] when none is: one at a time, and the same
    /// one for as long as it stays idle. Idle workers taking turns would move the progress
    /// loop's state between their cores' caches at every pass, and contend for its lock.
    idle_driver: AtomicUsize,
    injector: Injector<J>,
    stealers: Vec<Stealer<J>>,
    sleep: Sleep,
    /// Set when the graph drained (see [`Spawner::quiesce`]), cleared by the next spawn: idle
    /// workers stop spinning.
    quiet: AtomicBool,
    stop: AtomicBool,
    /// Distinguishes this pool's workers from another pool's in the thread-local below.
    id: usize,
}

thread_local! {
    /// `(pool id, worker index)` of the current thread, when it is a worker.
    static CURRENT: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

/// A pool of CPU worker threads running [`Job`]s.
pub(crate) struct Pool<J: Job> {
    shared: Arc<Shared<J>>,
    threads: Vec<JoinHandle<()>>,
    /// The workers' deques and park counters until [`Pool::start`] hands them to their threads.
    unstarted: Vec<(Worker<J>, Option<Arc<AtomicU64>>)>,
}

/// Cheap handle that submits jobs to a [`Pool`].
pub(crate) struct Spawner<J: Job> {
    shared: Arc<Shared<J>>,
}

impl<J: Job> Clone for Spawner<J> {
    fn clone(&self) -> Self {
        Spawner {
            shared: self.shared.clone(),
        }
    }
}

impl<J: Job> Pool<J> {
    /// A pool of `n` workers, not started: its [`Spawner`]s queue jobs, which run once
    /// [`Pool::start`] has started the workers (the context they need is made with a spawner).
    ///
    /// `naps`: a counter per worker, in worker order, of the times it parked for want of work
    /// (statistics); workers past its end count nowhere. `idle_wait`: whether idle workers spin
    /// before they give their cores up. `idle_work`: what idle workers do besides looking for
    /// jobs.
    pub(crate) fn new(
        n: usize,
        naps: Vec<Arc<AtomicU64>>,
        idle_wait: IdleWait,
        idle_work: Option<Arc<dyn IdleWork>>,
    ) -> Pool<J> {
        static NEXT_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        let locals: Vec<Worker<J>> = (0..n).map(|_| Worker::new_fifo()).collect();
        let shared = Arc::new(Shared {
            idle_wait,
            idle_work,
            idle_driver: AtomicUsize::new(NO_DRIVER),
            injector: Injector::new(),
            stealers: locals.iter().map(Worker::stealer).collect(),
            sleep: Sleep::new(),
            quiet: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        });
        let mut naps = naps.into_iter();
        let unstarted = locals.into_iter().map(|l| (l, naps.next())).collect();
        Pool {
            shared,
            threads: Vec::new(),
            unstarted,
        }
    }

    /// Starts the workers, named `ferry-worker-{i}`, each holding `cx` for the jobs it runs.
    /// Does nothing the second time.
    ///
    /// Returns once every worker has recorded its thread for placement
    /// (`ferry_base::affinity::note_thread`), so that binding the threads right after sees them
    /// all.
    ///
    /// # Errors
    /// The thread that could not be spawned; the workers started before it are stopped.
    pub(crate) fn start(&mut self, cx: Arc<J::Context>) -> std::io::Result<()> {
        let started = Arc::new((std::sync::Mutex::new(0usize), std::sync::Condvar::new()));
        let unstarted = std::mem::take(&mut self.unstarted);
        let spawning = unstarted.len();
        for (i, (local, naps)) in unstarted.into_iter().enumerate() {
            let sh = self.shared.clone();
            let cx = cx.clone();
            let up = started.clone();
            let t = std::thread::Builder::new()
                .name(format!("ferry-worker-{i}"))
                .spawn(move || worker_main(sh, local, i, naps, cx, up));
            match t {
                Ok(t) => self.threads.push(t),
                Err(e) => {
                    self.stop();
                    return Err(e);
                }
            }
        }
        // Bounded: a worker that cannot even start its loop would otherwise hang start-up.
        let (n, cv) = &*started;
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut g = n.lock().unwrap_or_else(|p| p.into_inner());
        while *g < spawning && Instant::now() < deadline {
            g = cv
                .wait_timeout(g, Duration::from_millis(10))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    pub(crate) fn spawner(&self) -> Spawner<J> {
        Spawner {
            shared: self.shared.clone(),
        }
    }

    /// Stops the workers after the jobs already queued and joins them (a pool that never
    /// started drops its queued jobs unrun). Idempotent.
    pub(crate) fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.sleep.wake_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl<J: Job> Drop for Pool<J> {
    fn drop(&mut self) {
        self.stop();
    }
}

impl<J: Job> Spawner<J> {
    /// Queues a job: on the current worker's own deque when called from a worker of this pool
    /// (successors run where their input was just produced), else on the global injector.
    pub(crate) fn spawn(&self, job: J) {
        let shared = &self.shared;
        let local = CURRENT.with(|c| c.get()).filter(|(id, _)| *id == shared.id);
        match local {
            Some(_) => LOCAL.with(|l| {
                let l = l.get();
                if l.is_null() {
                    shared.injector.push(job);
                } else {
                    // SAFETY: the pointer was set by worker_main of this pool on this thread and
                    // stays valid until it returns; only this thread uses it.
                    unsafe { (*(l as *const Worker<J>)).push(job) }
                }
            }),
            None => shared.injector.push(job),
        }
        // Read first: the line stays shared between the cores until a drain sets the flag.
        if shared.quiet.load(Ordering::Relaxed) {
            shared.quiet.store(false, Ordering::Relaxed);
        }
        shared.sleep.wake_one();
    }

    /// What wakes one parked worker, if any, without a job for it: its idle work
    /// ([`IdleWork`]) has something to do. It holds the pool weakly: the idle work that keeps
    /// it would otherwise keep the pool alive in a cycle.
    pub(crate) fn idle_waker(&self) -> impl Fn() + Send + Sync + 'static {
        let pool = Arc::downgrade(&self.shared);
        move || {
            if let Some(shared) = pool.upgrade() {
                if shared.idle_work.is_some() {
                    shared.sleep.wake_one();
                }
            }
        }
    }

    /// Tells idle workers that no job is coming soon (every inserted task finished): they
    /// skip the rest of their spin and give their cores up. The thread waiting for the graph
    /// then does not wait for a spinning worker's core — up to the whole spin at the end of
    /// every `wait` (one `wait` in two on the 2-core CI VM, when the spin was 0.2 ms). The next
    /// spawn clears it.
    pub(crate) fn quiesce(&self) {
        self.shared.quiet.store(true, Ordering::Relaxed);
    }
}

thread_local! {
    /// The current worker's local deque (type-erased; set and read only by `worker_main`'s
    /// thread for the pool recorded in `CURRENT`).
    static LOCAL: Cell<*const ()> = const { Cell::new(std::ptr::null()) };
}

fn find_job<J>(local: &Worker<J>, shared: &Shared<J>, me: usize) -> Option<J> {
    if let Some(j) = local.pop() {
        return Some(j);
    }
    loop {
        let mut retry = false;
        match shared.injector.steal_batch_and_pop(local) {
            Steal::Success(j) => return Some(j),
            Steal::Retry => retry = true,
            Steal::Empty => {}
        }
        let n = shared.stealers.len();
        if let Some(j) = steal_from_deques(shared, me + 1, n.saturating_sub(1), &mut retry) {
            return Some(j);
        }
        if !retry {
            return None;
        }
    }
}

/// A job stolen from `count` of the workers' deques, visited from `first` on (wrapping round),
/// or `None`; sets `retry` when a deque was contended.
fn steal_from_deques<J>(shared: &Shared<J>, first: usize, count: usize, retry: &mut bool) -> Option<J> {
    let n = shared.stealers.len();
    for k in 0..count {
        match shared.stealers[(first + k) % n].steal() {
            Steal::Success(j) => return Some(j),
            Steal::Retry => *retry = true,
            Steal::Empty => {}
        }
    }
    None
}

/// Spins on `has_work` for up to [`SPIN_FOR`] (or until the pool is quiesced), then yields its
/// core ([`idle_yield`]); whether work showed up.
fn idle_spin<J>(shared: &Shared<J>, me: usize) -> bool {
    let start = Instant::now();
    // `has_work` after every spin-loop hint (a few loads of lines that stay in this core's
    // cache until a push changes them), the clock every 16th: a new job is seen within tens
    // of ns. After 64 hints between looks (0.8 µs on the CI VM), the wait for the next step's
    // task cost Task Bench's `stencil_1d` (width 2, 1 µs tasks) 0.4 µs per step.
    let mut k = 0u32;
    loop {
        if has_work(shared) || shared.stop.load(Ordering::Relaxed) {
            return true;
        }
        if drive_idle_work(shared, me) {
            continue;
        }
        k = k.wrapping_add(1);
        if k % 16 == 0
            && (shared.quiet.load(Ordering::Relaxed) || start.elapsed() >= SPIN_FOR || !shared.idle_wait.spins())
        {
            break;
        }
        std::hint::spin_loop();
    }
    idle_yield(shared, me)
}

/// Yields the core for at least [`YIELD_FOR`] and [`YIELD_ROUNDS`] rounds, looking for work
/// after each; whether work showed up. Alone, the idle wait of a worker that must not spin
/// ([`Shared::spin`]). On a core that other threads of the rank
/// share, each yield runs them (the progress thread receiving this worker's next input); on
/// an idle core it returns at once, and the worker parks after the rounds.
///
/// With [`IdleWork`], each round does a round of it first, and yields only when that did
/// nothing; the rounds go on past [`YIELD_FOR`] while the work is pending, up to [`DRIVE_FOR`]
/// after its last progress.
fn idle_yield<J>(shared: &Shared<J>, me: usize) -> bool {
    // The clock is read only once the rounds are done, and then every [`CLOCK_EVERY`] rounds:
    // a worker driving the idle work goes round in a few hundred ns, and a reading per round
    // was a tenth of its time. After work, the time counts again from the next reading.
    let mut since = Some(Instant::now());
    let mut rounds = 0;
    loop {
        if drive_idle_work(shared, me) {
            since = None;
            rounds = 0;
        } else {
            if rounds >= YIELD_ROUNDS && rounds % CLOCK_EVERY == 0 {
                let elapsed = since.get_or_insert_with(Instant::now).elapsed();
                let driving = shared.idle_driver.load(Ordering::Relaxed) == me;
                let more = elapsed < YIELD_FOR
                    || (driving && elapsed < DRIVE_FOR && shared.idle_work.as_ref().is_some_and(|w| w.pending()));
                if !more {
                    return false;
                }
            }
            if shared.idle_wait.gives_way() {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            rounds += 1;
        }
        if has_work(shared) || shared.stop.load(Ordering::Relaxed) {
            return true;
        }
    }
}

/// How long an idle worker spins before it yields its core: a fine-grained graph releases its
/// next task within microseconds, and a parked worker takes a futex wake-up (several µs on a
/// VM) to come back; longer spins only take the core from threads that have work (the
/// inserting thread, other ranks). Time, not a count of spin-loop hints: a hint takes 12 ns on
/// the CI VM and about 40 ns on recent server cores.
const SPIN_FOR: Duration = Duration::from_micros(50);
/// Rounds between clock readings in [`idle_yield`] once [`YIELD_ROUNDS`] are done.
const CLOCK_EVERY: u32 = 8;
/// `yield_now` rounds before a worker parks.
const YIELD_ROUNDS: u32 = 16;
/// The least time those rounds take. A yielding worker leaves its core to any thread that has
/// work (the inserting thread after a `wait`) yet still sees a new job within a system call,
/// where a parked one would need a futex wake-up: two tasks and a `wait` took 60–90 µs in 7–9
/// runs of 20 when workers parked after 16 quick yields, in 3–5 runs of 20 with this floor.
const YIELD_FOR: Duration = Duration::from_micros(100);

/// A round of the idle work by worker `me`, when it is the worker doing it or none is;
/// whether it did anything.
fn drive_idle_work<J>(shared: &Shared<J>, me: usize) -> bool {
    let Some(w) = &shared.idle_work else {
        return false;
    };
    let driver = shared.idle_driver.load(Ordering::Relaxed);
    if driver != me
        && (driver != NO_DRIVER
            || shared
                .idle_driver
                .compare_exchange(NO_DRIVER, me, Ordering::Relaxed, Ordering::Relaxed)
                .is_err())
    {
        return false;
    }
    w.run()
}

/// Worker `me` stops doing the idle work (it found a job, or parks): another idle worker
/// takes it up.
fn leave_idle_work<J>(shared: &Shared<J>, me: usize) {
    if shared.idle_work.is_some() && shared.idle_driver.load(Ordering::Relaxed) == me {
        shared.idle_driver.store(NO_DRIVER, Ordering::Relaxed);
    }
}

fn has_work<J>(shared: &Shared<J>) -> bool {
    !shared.injector.is_empty() || shared.stealers.iter().any(|s| !s.is_empty())
}

fn worker_main<J: Job>(
    shared: Arc<Shared<J>>,
    local: Worker<J>,
    me: usize,
    naps: Option<Arc<AtomicU64>>,
    cx: Arc<J::Context>,
    started: Arc<(std::sync::Mutex<usize>, std::sync::Condvar)>,
) {
    ferry_base::affinity::note_thread(ferry_base::affinity::Role::Worker(me));
    {
        let (n, cv) = &*started;
        *n.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        cv.notify_all();
    }
    drop(started);
    CURRENT.with(|c| c.set(Some((shared.id, me))));
    LOCAL.with(|l| l.set(&local as *const Worker<J> as *const ()));
    let mut spent: Vec<J::Spent> = Vec::with_capacity(SPENT_BATCH);
    loop {
        if let Some(job) = find_job(&local, &shared, me) {
            leave_idle_work(&shared, me);
            if let Some(s) = job.run(me, &cx) {
                spent.push(s);
                if spent.len() >= SPENT_BATCH {
                    spent.clear();
                }
            }
            continue;
        }
        // Idle: the time to drop what the jobs left, off the path from one task to the next.
        spent.clear();
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        // Before parking, look again for a while: fine-grained graphs release their next task
        // within microseconds, and a parked worker takes a futex wake-up (several µs on a VM) to
        // come back. Spin first, then yield the core (ranks may share cores), then park.
        let found = if shared.idle_wait.spins() {
            idle_spin(&shared, me)
        } else {
            idle_yield(&shared, me)
        };
        if found {
            continue;
        }
        leave_idle_work(&shared, me);
        // Work queued for the idle work is looked at again once registered as a sleeper: a
        // command posted since the last look then either sees the sleeper and wakes it
        // ([`Spawner::idle_waker`]) or is seen here.
        let parked = shared.sleep.sleep(|| {
            has_work(&shared)
                || shared.stop.load(Ordering::SeqCst)
                || shared.idle_work.as_ref().is_some_and(|w| w.queued())
        });
        if let (true, Some(n)) = (parked, &naps) {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }
    LOCAL.with(|l| l.set(std::ptr::null()));
    CURRENT.with(|c| c.set(None));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A pool of `n` workers, started (their context is nothing).
    fn started<J: Job<Context = ()>>(n: usize, naps: Vec<Arc<AtomicU64>>) -> Pool<J> {
        let mut pool = Pool::new(n, naps, IdleWait::Spin, None);
        pool.start(Arc::new(())).unwrap();
        pool
    }

    struct Count(Arc<AtomicUsize>, Option<Spawner<Count>>, usize);
    impl Job for Count {
        type Context = ();
        type Spent = ();
        fn run(self, _w: usize, _cx: &Arc<()>) -> Option<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            if self.2 > 0 {
                if let Some(s) = &self.1 {
                    s.spawn(Count(self.0.clone(), self.1.clone(), self.2 - 1));
                }
            }
            None
        }
    }

    /// Idle work that makes a job ready in each round while it has arrivals left, as a pass of
    /// the MPI loop does when a message lands.
    struct Arrivals {
        left: AtomicUsize,
        runs: AtomicUsize,
        /// Workers inside `run` now, and the most there ever were at once.
        inside: AtomicUsize,
        most_inside: AtomicUsize,
        ran: Arc<AtomicUsize>,
        spawner: std::sync::OnceLock<Spawner<Count>>,
    }
    impl IdleWork for Arrivals {
        fn run(&self) -> bool {
            let n = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_inside.fetch_max(n, Ordering::SeqCst);
            std::hint::spin_loop();
            self.inside.fetch_sub(1, Ordering::SeqCst);
            self.runs.fetch_add(1, Ordering::SeqCst);
            let took = self
                .left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if took {
                if let Some(sp) = self.spawner.get() {
                    sp.spawn(Count(self.ran.clone(), None, 0));
                }
            }
            took
        }
        fn pending(&self) -> bool {
            self.left.load(Ordering::SeqCst) > 0
        }
        fn queued(&self) -> bool {
            false
        }
    }

    /// Idle workers, spinning, yielding (a rank per core) or giving way to an inserting thread
    /// that wakes and sleeps meanwhile, drive the idle work, one at a time, and the jobs it
    /// makes ready run: nothing else in the test spawns them.
    #[test]
    fn idle_workers_drive_idle_work() {
        let awake = Arc::new(AtomicBool::new(true));
        let modes = [
            IdleWait::Yield,
            IdleWait::Spin,
            IdleWait::YieldToInserter(awake.clone()),
        ];
        for (workers, idle_wait) in modes.iter().flat_map(|m| [(1, m.clone()), (3, m.clone())]) {
            let ran = Arc::new(AtomicUsize::new(0));
            let work = Arc::new(Arrivals {
                left: AtomicUsize::new(0),
                runs: AtomicUsize::new(0),
                inside: AtomicUsize::new(0),
                most_inside: AtomicUsize::new(0),
                ran: ran.clone(),
                spawner: std::sync::OnceLock::new(),
            });
            let mut pool: Pool<Count> = Pool::new(workers, Vec::new(), idle_wait.clone(), Some(work.clone()));
            let _ = work.spawner.set(pool.spawner());
            pool.start(Arc::new(())).unwrap();
            work.left.store(500, Ordering::SeqCst);
            // A spawn wakes the worker in case it parked before the arrivals were set.
            pool.spawner().spawn(Count(ran.clone(), None, 0));
            let t = std::time::Instant::now();
            while ran.load(Ordering::SeqCst) < 501 && t.elapsed().as_secs() < 20 {
                // The inserting thread wakes and sleeps: the workers spin, then give way.
                awake.fetch_xor(true, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            pool.stop();
            let case = format!("{workers} worker(s), {idle_wait:?}");
            assert_eq!(ran.load(Ordering::SeqCst), 501, "{case}: every arrival's job ran");
            assert_eq!(work.left.load(Ordering::SeqCst), 0, "{case}");
            assert!(work.runs.load(Ordering::SeqCst) >= 500, "{case}");
            assert_eq!(
                work.most_inside.load(Ordering::SeqCst),
                1,
                "{case}: one worker at a time"
            );
        }
    }

    /// A worker that shares its core with the inserting thread spins while it sleeps and
    /// gives way while it is awake; the other policies do not look at it.
    #[test]
    fn workers_give_way_to_an_awake_inserter_only() {
        let awake = Arc::new(AtomicBool::new(true));
        let w = IdleWait::YieldToInserter(awake.clone());
        assert!(!w.spins() && w.gives_way());
        awake.store(false, Ordering::Relaxed);
        assert!(w.spins() && !w.gives_way());
        assert!(IdleWait::Spin.spins() && IdleWait::Spin.gives_way());
        assert!(!IdleWait::Yield.spins() && IdleWait::Yield.gives_way());
    }

    #[test]
    fn runs_every_job_including_spawned_ones() {
        let mut pool: Pool<Count> = started(3, Vec::new());
        let n = Arc::new(AtomicUsize::new(0));
        let sp = pool.spawner();
        for _ in 0..100 {
            sp.spawn(Count(n.clone(), Some(sp.clone()), 9));
        }
        let t = std::time::Instant::now();
        while n.load(Ordering::SeqCst) < 1000 && t.elapsed().as_secs() < 20 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        pool.stop();
        assert_eq!(n.load(Ordering::SeqCst), 1000);
    }

    /// Idle workers park after their spin and yield, and count it; a spawn wakes one.
    #[test]
    fn idle_workers_count_their_parks() {
        let naps: Vec<Arc<AtomicU64>> = (0..2).map(|_| Arc::new(AtomicU64::new(0))).collect();
        let mut pool: Pool<Count> = started(2, naps.clone());
        let parked = |naps: &[Arc<AtomicU64>]| naps.iter().all(|n| n.load(Ordering::Relaxed) > 0);
        let t = std::time::Instant::now();
        while !parked(&naps) && t.elapsed().as_secs() < 20 {
            std::thread::sleep(SPIN_FOR + YIELD_FOR + std::time::Duration::from_millis(2));
        }
        assert!(parked(&naps), "both idle workers parked");
        let n = Arc::new(AtomicUsize::new(0));
        pool.spawner().spawn(Count(n.clone(), None, 0));
        while n.load(Ordering::SeqCst) < 1 && t.elapsed().as_secs() < 20 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        pool.stop();
        assert_eq!(n.load(Ordering::SeqCst), 1, "a parked pool still runs a spawned job");
    }

    /// A pool that has not started queues what is spawned, runs it once started, and stops
    /// whether or not it started.
    #[test]
    fn jobs_spawned_before_the_start_run_after_it() {
        let idle: Pool<Count> = Pool::new(2, Vec::new(), IdleWait::Spin, None);
        drop(idle);
        let mut pool: Pool<Count> = Pool::new(2, Vec::new(), IdleWait::Spin, None);
        let n = Arc::new(AtomicUsize::new(0));
        pool.spawner().spawn(Count(n.clone(), None, 0));
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(n.load(Ordering::SeqCst), 0, "no worker yet");
        pool.start(Arc::new(())).unwrap();
        let t = std::time::Instant::now();
        while n.load(Ordering::SeqCst) < 1 && t.elapsed().as_secs() < 20 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // A second start starts nothing and returns at once.
        let again = std::time::Instant::now();
        pool.start(Arc::new(())).unwrap();
        assert!(again.elapsed() < std::time::Duration::from_secs(1));
        assert_eq!(pool.threads.len(), 2);
        pool.stop();
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }

    /// Counts its drops.
    struct Dropped(Arc<AtomicUsize>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A job whose worker holds what it leaves; it records the most its worker held (jobs that
    /// ran, less what was dropped, both counted by that one worker).
    struct Leaves(Arc<AtomicUsize>, Arc<AtomicUsize>, Arc<AtomicUsize>);
    impl Job for Leaves {
        type Context = ();
        type Spent = Dropped;
        fn run(self, _w: usize, _cx: &Arc<()>) -> Option<Dropped> {
            let ran = self.0.fetch_add(1, Ordering::SeqCst) + 1;
            let held = ran - self.1.load(Ordering::SeqCst);
            self.2.fetch_max(held, Ordering::SeqCst);
            Some(Dropped(self.1))
        }
    }

    /// What finished jobs leave is dropped once their worker finds nothing to do, and at most
    /// `SPENT_BATCH` of it is held while jobs keep coming.
    #[test]
    fn spent_jobs_are_dropped_when_their_worker_idles() {
        let mut pool: Pool<Leaves> = started(1, Vec::new());
        let [ran, dropped, most] = [(); 3].map(|_| Arc::new(AtomicUsize::new(0)));
        let sp = pool.spawner();
        let n = 3 * SPENT_BATCH + 5;
        for _ in 0..n {
            sp.spawn(Leaves(ran.clone(), dropped.clone(), most.clone()));
        }
        let t = std::time::Instant::now();
        while dropped.load(Ordering::SeqCst) < n && t.elapsed().as_secs() < 20 {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        assert_eq!(ran.load(Ordering::SeqCst), n);
        assert!(
            most.load(Ordering::SeqCst) <= SPENT_BATCH,
            "a worker holds at most a batch"
        );
        assert_eq!(dropped.load(Ordering::SeqCst), n, "an idle worker holds nothing");
        pool.stop();
    }

    #[test]
    fn a_quiesced_pool_still_runs_what_comes_next() {
        let mut pool: Pool<Count> = started(2, Vec::new());
        let n = Arc::new(AtomicUsize::new(0));
        let sp = pool.spawner();
        let wait_for = |want: usize| {
            let t = std::time::Instant::now();
            while n.load(Ordering::SeqCst) < want && t.elapsed().as_secs() < 20 {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        };
        for round in 1..=50 {
            sp.quiesce();
            assert!(sp.shared.quiet.load(Ordering::Relaxed));
            sp.spawn(Count(n.clone(), Some(sp.clone()), 3));
            // The spawn lifts the quiesce; the job and its spawned chain run.
            assert!(!sp.shared.quiet.load(Ordering::Relaxed));
            wait_for(4 * round);
            assert_eq!(n.load(Ordering::SeqCst), 4 * round);
            if round % 10 == 0 {
                // Long enough for the workers to park: a spawn must wake them.
                std::thread::sleep(SPIN_FOR + YIELD_FOR + std::time::Duration::from_millis(2));
            }
        }
        pool.stop();
    }
}
