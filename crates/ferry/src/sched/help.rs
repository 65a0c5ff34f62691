//! The inserting thread as a part-time worker: on a rank per core, `submit` is a task
//! scheduling point (as a task construct is in OpenMP), where the thread that inserts runs a
//! progress pass and the jobs that are ready.
//!
//! Why: a rank whose one core holds its worker and its inserting thread can run its tasks only
//! while the inserting thread does not run (the idle worker gives way to it,
//! [`super::IdleWait::YieldToInserter`]). Insertion then runs first, on its own, and the graph
//! afterwards, one message latency per hop; neither hides behind the other. Handing the core
//! back and forth instead costs two context switches per hop (about 2.7 µs on the CI VM, more
//! than the hop). The inserting thread that looks after the graph itself between insertions
//! hides the hops' latency behind insertion, with no switch at all.

use super::{Job, Spawner};
use crossbeam::deque::Steal;
use std::sync::Arc;

impl<J: Job> Spawner<J> {
    /// Runs, on the calling thread (which is not one of the pool's workers), one round of the
    /// pool's idle work (a progress pass, unless another thread is making one) and then up to
    /// `max_jobs` ready jobs, taken as a thief takes them (the global queue first, then the
    /// workers' deques); returns how many jobs it ran.
    ///
    /// Each job runs as worker `as_worker`, which the caller chooses outside the pool's
    /// indices (the pool's size: "not a worker") so that per-worker state stays the workers'
    /// own. What a job leaves to drop ([`Job::Spent`]) is dropped at once: the caller is not
    /// on the path from one task to the next.
    pub(crate) fn help(&self, cx: &Arc<J::Context>, as_worker: usize, max_jobs: usize) -> usize {
        let shared = &self.shared;
        if let Some(w) = &shared.idle_work {
            w.run();
        }
        let mut ran = 0;
        while ran < max_jobs {
            let Some(job) = steal(shared) else { break };
            drop(job.run(as_worker, cx));
            ran += 1;
        }
        ran
    }

    /// Whether the pool's idle workers give way to the inserting thread
    /// ([`super::IdleWait::YieldToInserter`]): the set-up in which that thread helps.
    pub(crate) fn yields_to_inserter(&self) -> bool {
        matches!(self.shared.idle_wait, super::IdleWait::YieldToInserter(_))
    }
}

/// One ready job from anywhere in the pool, or `None` when none is queued.
fn steal<J>(shared: &super::Shared<J>) -> Option<J> {
    loop {
        let mut retry = false;
        match shared.injector.steal() {
            Steal::Success(j) => return Some(j),
            Steal::Retry => retry = true,
            Steal::Empty => {}
        }
        if let Some(j) = super::steal_from_deques(shared, 0, shared.stealers.len(), &mut retry) {
            return Some(j);
        }
        if !retry {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{IdleWait, IdleWork, Job, Pool};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    /// Records the worker index it ran as.
    struct Mark(Arc<Mutex<Vec<usize>>>);
    impl Job for Mark {
        type Context = ();
        type Spent = ();
        fn run(self, worker: usize, _cx: &Arc<()>) -> Option<()> {
            self.0.lock().unwrap().push(worker);
            Some(())
        }
    }

    /// Counts its rounds.
    struct Rounds(AtomicUsize);
    impl IdleWork for Rounds {
        fn run(&self) -> bool {
            self.0.fetch_add(1, Ordering::SeqCst);
            false
        }
        fn pending(&self) -> bool {
            false
        }
        fn queued(&self) -> bool {
            false
        }
    }

    /// The calling thread runs the queued jobs, at most `max_jobs` a call, as the index it
    /// names, after one round of the idle work per call; with nothing queued it runs none.
    #[test]
    fn a_helping_thread_runs_queued_jobs_as_the_index_it_names() {
        let rounds = Arc::new(Rounds(AtomicUsize::new(0)));
        // Not started: nothing but the helping thread takes the jobs.
        let pool: Pool<Mark> = Pool::new(2, Vec::new(), IdleWait::Spin, Some(rounds.clone() as Arc<dyn IdleWork>));
        let spawner = pool.spawner();
        let ran = Arc::new(Mutex::new(Vec::new()));
        for _ in 0..10 {
            spawner.spawn(Mark(ran.clone()));
        }
        let cx = Arc::new(());
        assert_eq!(spawner.help(&cx, 2, 4), 4);
        assert_eq!(spawner.help(&cx, 2, 4), 4);
        assert_eq!(spawner.help(&cx, 2, 4), 2);
        assert_eq!(spawner.help(&cx, 2, 4), 0);
        assert_eq!(*ran.lock().unwrap(), vec![2; 10]);
        assert_eq!(rounds.0.load(Ordering::SeqCst), 4, "one round of idle work per call");
        assert!(!spawner.yields_to_inserter());
    }

    /// Jobs that a started pool's workers and a helping thread take between them all run once.
    #[test]
    fn workers_and_a_helping_thread_share_the_jobs() {
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let mut pool: Pool<Mark> = Pool::new(1, Vec::new(), IdleWait::YieldToInserter(flag), None);
        pool.start(Arc::new(())).unwrap();
        let spawner = pool.spawner();
        assert!(spawner.yields_to_inserter());
        let ran = Arc::new(Mutex::new(Vec::new()));
        let cx = Arc::new(());
        let mut helped = 0;
        for _ in 0..2000 {
            spawner.spawn(Mark(ran.clone()));
            helped += spawner.help(&cx, 1, 4);
        }
        pool.stop();
        let ran = ran.lock().unwrap();
        assert_eq!(ran.len(), 2000, "every job ran once");
        assert_eq!(ran.iter().filter(|&&w| w == 1).count(), helped);
        assert!(ran.iter().all(|&w| w <= 1), "{ran:?}");
    }
}
