//! The I/O thread: spills host copies to disk when the host budget is exceeded, loads them back
//! on demand, and prefetches what the next tasks read. It never calls MPI or CUDA.

use super::{disk_only, HostTier, Then};
use crate::data::copy::TileCopy;
use crossbeam::channel::{Receiver, RecvTimeoutError};
use ferry_base::error::FerryError;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests to the I/O thread.
pub enum IoCmd {
    /// The host budget is exceeded: evict down to the low-water mark.
    Relieve,
    /// Bring these copies back from disk (a consumer waits since `since`).
    Load {
        /// The copies.
        copies: Vec<Arc<TileCopy>>,
        /// Called when they are all in host memory.
        then: Then,
        /// When the consumer began to wait.
        since: Instant,
    },
    /// The prefetch window changed.
    Prefetch,
    /// End the thread.
    Shutdown,
}

/// While over budget with nothing evictable (everything in use), look again this often.
const RETRY: Duration = Duration::from_millis(1);

pub(super) fn run(tier: &Arc<HostTier>, rx: Receiver<IoCmd>, fail: Box<dyn Fn(FerryError) + Send>) {
    let mut failed = false;
    loop {
        let over = !failed && tier.used() > tier.limit;
        let first = if over {
            match rx.recv_timeout(RETRY) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        };
        // Loads first: somebody waits for them; eviction and prefetching can wait a little.
        for cmd in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
            match cmd {
                IoCmd::Relieve => tier.pressure.store(false, Relaxed),
                IoCmd::Load { copies, then, since } => {
                    let r = copies.iter().try_for_each(|c| load(tier, c, false));
                    let c = &tier.counters.tier;
                    c.demand_loads.fetch_add(copies.len() as u64, Relaxed);
                    c.demand_wait_ns.fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
                    then(r);
                }
                IoCmd::Prefetch => {}
                IoCmd::Shutdown => return,
            }
        }
        if !failed && tier.used() > tier.limit {
            if let Err(e) = relieve(tier) {
                tracing::error!(error = %e, "disk tier failed");
                failed = true;
                fail(e);
            }
        }
        if !failed {
            prefetch(tier);
        }
    }
}

/// What eviction did with one LRU entry.
enum Evicted {
    /// Freed, or the entry was stale.
    Done,
    /// In use, or dirty without a disk tier: stays on the LRU.
    Kept,
}

/// Evicts in LRU order down to the low-water mark.
fn relieve(tier: &HostTier) -> Result<(), FerryError> {
    let mut kept = Vec::new();
    let mut result = Ok(());
    while tier.used() > tier.low_water {
        let Some((w, stamp)) = tier.pop_lru() else { break };
        let Some(copy) = w.upgrade() else { continue };
        match evict(tier, &copy, stamp) {
            Ok(Evicted::Done) => {}
            Ok(Evicted::Kept) => kept.push((w, stamp)),
            Err(e) => {
                kept.push((w, stamp));
                result = Err(e);
                break;
            }
        }
    }
    tier.push_front_lru(kept);
    result
}

fn evict(tier: &HostTier, copy: &Arc<TileCopy>, stamp: u64) -> Result<Evicted, FerryError> {
    let mut s = copy.lock();
    if s.host_stamp != stamp {
        return Ok(Evicted::Done);
    }
    let Some(host) = s.host.clone() else {
        return Ok(Evicted::Done);
    };
    // Any other holder of the buffer (a transfer, a copy, a task's body) is using it (two
    // references: the copy's and `host`).
    if s.host_in_use(1) {
        return Ok(Evicted::Kept);
    }
    let c = &tier.counters.tier;
    if !s.host_valid || s.disk_valid || s.dev.iter().any(|d| d.valid) {
        // Stale, or valid elsewhere too: drop it.
        s.host = None;
        s.host_valid = false;
        c.host_drops.fetch_add(1, Relaxed);
        return Ok(Evicted::Done);
    }
    let Some(disk) = &tier.disk else {
        return Ok(Evicted::Kept);
    };
    let bytes = copy.bytes();
    let slot = match s.disk {
        Some(b) => b,
        None => {
            let b = disk.reserve(bytes)?;
            s.disk = Some(b);
            b
        }
    };
    let buf = host;
    let generation = s.generation;
    s.host_pins += 1;
    drop(s);
    let t0 = Instant::now();
    // SAFETY: the buffer is pinned; a writer that starts meanwhile changes the generation (or is
    // still running, `host_writers`), and then the slot is not marked valid below.
    let r = disk.write(slot, unsafe { buf.bytes() });
    let ns = t0.elapsed().as_nanos() as u64;
    let mut s = copy.lock();
    s.host_pins -= 1;
    r?;
    c.spills.fetch_add(1, Relaxed);
    c.spill_bytes.fetch_add(bytes as u64, Relaxed);
    c.spill_ns.fetch_add(ns, Relaxed);
    if s.generation == generation && s.host_writers == 0 && s.host_valid {
        s.disk_valid = true;
        let ours = s.host.as_ref().is_some_and(|h| Arc::ptr_eq(h, &buf));
        if ours && !s.host_in_use(1) {
            s.host = None;
            s.host_valid = false;
            return Ok(Evicted::Done);
        }
    }
    Ok(Evicted::Kept)
}

/// Brings one copy back from its disk slot if its data is only there. A demand load serves the
/// consumer that asked, possibly the copy's next writer (dispatched, waiting for this): the
/// graph orders it after every other user. A prefetch serves nobody yet, so it stays away from
/// a copy with a writer dispatched (its load would race the write).
fn load(tier: &HostTier, copy: &Arc<TileCopy>, prefetch: bool) -> Result<(), FerryError> {
    let Some(disk) = &tier.disk else { return Ok(()) };
    let quiet = |s: &crate::data::copy::CopyState| !prefetch || s.host_writers == 0;
    let s = copy.lock();
    if !disk_only(&s) || !quiet(&s) {
        return Ok(());
    }
    let slot = s.disk.expect("valid on disk means a slot");
    let generation = s.generation;
    let bytes = copy.bytes();
    let buf = Arc::new(s.fresh_host_buf(bytes));
    drop(s);
    let t0 = Instant::now();
    // SAFETY: the buffer is new and not shared yet.
    let out = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), bytes) };
    disk.read(slot, out)?;
    let ns = t0.elapsed().as_nanos() as u64;
    let mut s = copy.lock();
    if s.generation == generation && disk_only(&s) && quiet(&s) {
        s.host = Some(buf);
        s.host_valid = true;
        s.touch_host();
    }
    let c = &tier.counters.tier;
    c.loads.fetch_add(1, Relaxed);
    c.load_bytes.fetch_add(bytes as u64, Relaxed);
    c.load_ns.fetch_add(ns, Relaxed);
    if prefetch {
        c.prefetches.fetch_add(1, Relaxed);
    }
    Ok(())
}

/// Loads what the next tasks read while the budget has room: eviction stops at the low-water
/// mark, so the band between it and the budget is the prefetcher's.
fn prefetch(tier: &HostTier) {
    if tier.disk.is_none() {
        return;
    }
    for w in tier.prefetch.upcoming() {
        let Some(copy) = w.upgrade() else { continue };
        if tier.used() + copy.bytes() as u64 > tier.limit {
            break;
        }
        if let Err(e) = load(tier, &copy, true) {
            // A consumer's own load will meet the error again and report it.
            tracing::warn!(error = %e, "prefetch failed");
            break;
        }
    }
}
