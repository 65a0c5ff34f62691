//! Short naps of the polling threads.
//!
//! The GPU manager and the MPI progress thread poll, and while work is in flight but nothing
//! happens they nap for microseconds (`FERRY_GPU_POLL_US`, `FERRY_PROGRESS_SLEEP_US`: 1 µs with
//! CUDA devices). Linux lets a timed sleep end up to the thread's *timer slack* late, 50 µs by
//! default, so that wake-ups can be coalesced: a "1 µs" nap took 54 µs on the CI-class VM
//! (3.6 µs with a slack of 1 ns). A kernel that finished, or a message that arrived, during such
//! a nap was noticed up to 50 µs late, on the critical path of every halo exchange. The polling
//! threads therefore ask for the smallest slack (`prctl(PR_SET_TIMERSLACK)`, Linux ≥ 2.6.28).

/// Makes the calling thread's timed sleeps end on time: timer slack of 1 ns. Best effort:
/// returns whether the kernel took it (a failure leaves naps as they were, only later).
pub fn precise() -> bool {
    // SAFETY: PR_SET_TIMERSLACK takes a value and touches only the calling thread.
    let r = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "timer slack unchanged");
    }
    r == 0
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    /// The calling thread's timer slack, ns (`None` if the kernel does not say).
    fn slack_ns() -> Option<u64> {
        // SAFETY: PR_GET_TIMERSLACK reads the calling thread's own setting.
        let r = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
        (r >= 0).then_some(r as u64)
    }

    /// After `precise`, the thread's slack is 1 ns (another thread's stays as it was), and its
    /// 1 µs naps end sooner than the default slack of 50 µs would let them. The timing is
    /// compared by the fastest nap of many, which a loaded machine cannot make faster.
    #[test]
    fn naps_end_on_time() {
        let fastest = || {
            (0..200)
                .map(|_| {
                    let t = Instant::now();
                    std::thread::sleep(Duration::from_micros(1));
                    t.elapsed()
                })
                .min()
                .expect("naps taken")
        };
        let before = std::thread::spawn(move || (slack_ns(), fastest())).join().unwrap();
        let after = std::thread::spawn(move || {
            assert!(super::precise());
            (slack_ns(), fastest())
        })
        .join()
        .unwrap();
        assert_eq!(after.0, Some(1));
        assert_ne!(before.0, Some(1), "a thread that did not ask keeps its slack");
        assert!(
            after.1 < Duration::from_micros(40),
            "fastest precise nap took {:?}",
            after.1
        );
    }
}
