//! First-in-first-out queues by key: how receives meet their messages, in MPI's matching
//! (`ferry-comm/src/matching.rs`: by channel, source and tag) and in the control ring's
//! (`ferry-transfer/src/mailbox.rs`). A key's entries leave in the order they came; a key whose queue
//! empties is dropped.
//!
//! A key holds one entry as a rule — ferry gives each transfer a tag of its own — so that entry
//! lives in the map's own slot, and a `VecDeque` (an allocation) is made only for a key that
//! gets a second entry before its first has left.

use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;
use std::collections::VecDeque;
use std::hash::Hash;

/// Queues of `T` by key `K`.
pub struct FifoMap<K, T> {
    map: FxHashMap<K, Queue<T>>,
}

/// A key's queue.
enum Queue<T> {
    One(T),
    Many(VecDeque<T>),
}

impl<K, T> Default for FifoMap<K, T> {
    fn default() -> Self {
        FifoMap {
            map: FxHashMap::default(),
        }
    }
}

impl<K: Hash + Eq, T> FifoMap<K, T> {
    /// Appends `x` to `key`'s queue.
    pub fn push(&mut self, key: K, x: T) {
        match self.map.entry(key) {
            Entry::Vacant(v) => {
                v.insert(Queue::One(x));
            }
            Entry::Occupied(mut o) => {
                // Through an empty placeholder (no allocation): the entry is moved, not cloned.
                let q = o.get_mut();
                *q = match std::mem::replace(q, Queue::Many(VecDeque::new())) {
                    Queue::One(first) => Queue::Many(VecDeque::from([first, x])),
                    Queue::Many(mut d) => {
                        d.push_back(x);
                        Queue::Many(d)
                    }
                };
            }
        }
    }

    /// The oldest entry of `key`, taken out; the key goes with its last entry.
    pub fn pop(&mut self, key: &K) -> Option<T> {
        match self.map.get_mut(key)? {
            Queue::Many(d) if d.len() > 1 => d.pop_front(),
            _ => match self.map.remove(key)? {
                Queue::One(x) => Some(x),
                Queue::Many(mut d) => d.pop_front(),
            },
        }
    }

    /// Every entry, each key's oldest first (keys in no particular order).
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.map.values().flat_map(|q| {
            let (one, many) = match q {
                Queue::One(x) => (Some(x), None),
                Queue::Many(d) => (None, Some(d.iter())),
            };
            one.into_iter().chain(many.into_iter().flatten())
        })
    }

    /// Whether no key holds an entry.
    pub fn is_empty(&self) -> bool {
        // A key leaves the map with its last entry.
        self.map.is_empty()
    }

    /// How many entries there are, over all keys.
    pub fn len(&self) -> usize {
        self.map
            .values()
            .map(|q| match q {
                Queue::One(_) => 1,
                Queue::Many(d) => d.len(),
            })
            .sum()
    }

    /// Every entry, taken out (as [`FifoMap::iter`] orders them).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.map.drain().flat_map(|(_, q)| {
            let (one, many) = match q {
                Queue::One(x) => (Some(x), None),
                Queue::Many(d) => (None, Some(d)),
            };
            one.into_iter().chain(many.into_iter().flatten())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries leave each key in the order they came, across the one-entry and many-entry
    /// forms; an emptied key is gone; the count and the drain see every entry.
    #[test]
    fn each_key_is_first_in_first_out() {
        let mut m: FifoMap<(u8, i32), u32> = FifoMap::default();
        m.push((0, 1), 10);
        m.push((0, 2), 20);
        m.push((0, 1), 11);
        m.push((0, 1), 12);
        assert_eq!(m.len(), 4);
        assert_eq!(m.pop(&(0, 1)), Some(10));
        assert_eq!(m.pop(&(0, 1)), Some(11));
        m.push((0, 1), 13);
        assert_eq!(m.pop(&(0, 1)), Some(12));
        assert_eq!(m.pop(&(0, 1)), Some(13));
        assert_eq!(m.pop(&(0, 1)), None);
        assert!(!m.map.contains_key(&(0, 1)), "an emptied key is dropped");
        assert_eq!(m.iter().copied().collect::<Vec<_>>(), [20]);
        m.push((1, 1), 30);
        m.push((1, 1), 31);
        let mut all: Vec<u32> = m.drain().collect();
        all.sort();
        assert_eq!(all, [20, 30, 31]);
        assert_eq!(m.len(), 0);
        assert_eq!(m.pop(&(0, 2)), None);
    }
}
