//! Mappings of other processes' device memory (CUDA IPC handles; shared memory for emulated
//! devices), kept open while copies use them and, once idle, up to a bound: the least recently
//! used idle mapping is closed first.
//!
//! Opening a CUDA IPC handle costs milliseconds, so a copier keeps an allocation mapped between
//! copies. But an allocation whose owner has freed it stays mapped — and, under CUDA, its device
//! memory stays allocated — until the mapping is closed, so an unbounded cache grows with every
//! allocation a long-running framework ever exposed to this process. Registration caches of
//! MPI libraries (MPICH's IPC handle cache, UCX's `cuda_ipc` cache) bound theirs the same way.

use rustc_hash::FxHashMap;

/// One mapping and its use.
struct Entry<M> {
    mapping: M,
    /// Where the allocation is mapped here.
    base: u64,
    /// Copies issued on it that have not completed.
    users: usize,
    /// The cache's clock at its last use (LRU order among the idle).
    last_use: u64,
}

/// An exported handle (every export's handle is padded to this many bytes).
pub(crate) const HANDLE: usize = 64;

/// A key: the device and the handle, looked up per copy with no allocation.
type Key = (usize, [u8; HANDLE]);

fn key(device: usize, handle: &[u8]) -> Key {
    let mut k = [0u8; HANDLE];
    let n = handle.len().min(HANDLE);
    k[..n].copy_from_slice(&handle[..n]);
    (device, k)
}

/// Open mappings by (device, exported handle).
pub(crate) struct MappingCache<M> {
    entries: FxHashMap<Key, Entry<M>>,
    /// Idle mappings kept open at most.
    keep_idle: usize,
    /// Entries with no user.
    idle: usize,
    clock: u64,
}

impl<M> MappingCache<M> {
    /// An empty cache that keeps at most `keep_idle` idle mappings open.
    pub(crate) fn new(keep_idle: usize) -> MappingCache<M> {
        MappingCache {
            entries: FxHashMap::default(),
            keep_idle,
            idle: 0,
            clock: 0,
        }
    }

    /// The base of the mapping of `handle` on `device`, opened by `open` (the mapping and its
    /// base) when there is none; counts one more user either way.
    ///
    /// # Errors
    /// `open`'s.
    pub(crate) fn acquire<E>(
        &mut self,
        device: usize,
        handle: &[u8],
        open: impl FnOnce() -> Result<(M, u64), E>,
    ) -> Result<u64, E> {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(&key(device, handle)) {
            if e.users == 0 {
                self.idle -= 1;
            }
            e.users += 1;
            e.last_use = self.clock;
            return Ok(e.base);
        }
        let (mapping, base) = open()?;
        self.entries.insert(
            key(device, handle),
            Entry {
                mapping,
                base,
                users: 1,
                last_use: self.clock,
            },
        );
        Ok(base)
    }

    /// One user of `handle`'s mapping on `device` fewer (its copy has completed); returns the
    /// mappings to close now: idle ones past the bound, least recently used first. A release
    /// of a mapping that is not open, or has no user, changes nothing.
    pub(crate) fn release(&mut self, device: usize, handle: &[u8]) -> Vec<(usize, M)> {
        if let Some(e) = self.entries.get_mut(&key(device, handle)) {
            if e.users > 0 {
                e.users -= 1;
                if e.users == 0 {
                    self.idle += 1;
                }
            }
        }
        self.evict()
    }

    /// Sets the bound; returns the mappings to close now.
    pub(crate) fn set_keep_idle(&mut self, keep_idle: usize) -> Vec<(usize, M)> {
        self.keep_idle = keep_idle;
        self.evict()
    }

    /// Open mappings (idle or in use).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every idle mapping, for closing when the copier ends. Mappings that copies still use
    /// (copies that never completed, whose completions their owner leaked) are leaked with them:
    /// closing one would pull the memory from under a copy the device may still run.
    pub(crate) fn drain(&mut self) -> Vec<(usize, M)> {
        self.idle = 0;
        let mut out = Vec::new();
        for ((d, _), e) in self.entries.drain() {
            if e.users == 0 {
                out.push((d, e.mapping));
            } else {
                std::mem::forget(e.mapping);
            }
        }
        out
    }

    fn evict(&mut self) -> Vec<(usize, M)> {
        let mut out = Vec::new();
        while self.idle > self.keep_idle {
            // Linear in the open mappings, which the bound keeps few beyond those in use.
            let Some(key) = self
                .entries
                .iter()
                .filter(|(_, e)| e.users == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k)
            else {
                break;
            };
            let e = self.entries.remove(&key).expect("found above");
            self.idle -= 1;
            out.push((key.0, e.mapping));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(n: &mut u32, base: u64) -> impl FnOnce() -> Result<(u32, u64), ()> + '_ {
        move || {
            *n += 1;
            Ok((*n, base))
        }
    }

    /// Mapped once while in use; idle mappings past the bound close, least recently used first;
    /// one in use never closes.
    #[test]
    fn idle_mappings_past_the_bound_close_in_lru_order() {
        let mut c = MappingCache::new(1);
        let mut opened = 0;
        assert_eq!(c.acquire(0, b"a", open(&mut opened, 100)), Ok(100));
        assert_eq!(c.acquire(0, b"a", open(&mut opened, 999)), Ok(100), "reused");
        assert_eq!(opened, 1);
        assert_eq!(c.acquire(1, b"a", open(&mut opened, 200)), Ok(200), "another device");
        assert_eq!(c.acquire(0, b"b", open(&mut opened, 300)), Ok(300));
        assert_eq!(c.len(), 3);
        assert!(c.release(0, b"a").is_empty(), "a still has a user");
        assert!(c.release(0, b"a").is_empty(), "one idle is kept");
        // b goes idle too: two idle past a bound of one, and a (used longest ago) closes.
        assert_eq!(c.release(0, b"b"), vec![(0, 1)]);
        assert_eq!(c.len(), 2);
        // A release without a user, or of nothing open, changes nothing.
        assert!(c.release(0, b"a").is_empty() && c.release(5, b"z").is_empty());
        // The idle b is reused (no open), and the bound of 0 closes what is idle, not what is
        // in use.
        assert_eq!(c.acquire(0, b"b", open(&mut opened, 999)), Ok(300));
        assert!(c.set_keep_idle(0).is_empty());
        assert_eq!(c.release(0, b"b"), vec![(0, 3)]);
        assert_eq!(c.release(1, b"a"), vec![(1, 2)]);
        assert_eq!(c.len(), 0);
        // At the end, idle mappings close and those in use are left alone.
        let mut c = MappingCache::new(4);
        c.acquire(0, b"x", open(&mut opened, 10)).unwrap();
        c.acquire(0, b"y", open(&mut opened, 20)).unwrap();
        assert!(c.release(0, b"x").is_empty());
        assert_eq!(c.drain(), vec![(0, opened - 1)], "only the idle x");
        // An open that fails leaves nothing behind.
        assert_eq!(c.acquire(0, b"c", || Err::<(u32, u64), _>(())), Err(()));
        assert_eq!(c.len(), 0);
    }
}
