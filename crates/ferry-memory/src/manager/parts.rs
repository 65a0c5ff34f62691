//! Groups of part writers ([`crate::data::AccessMode::ReadWritePart`]) on a rank with several
//! devices: the members of a group in flight write their parts into one device block, so they
//! must all run on one device.
//!
//! A copy counts its members placed and not finalized, and the device they were placed on
//! (`CopyState::part_writers`). A member placed while others are in flight goes to their
//! device. One that cannot — released early onto another device by launch-ahead, or bound by
//! two copies to two devices — is deferred until the members in flight are finalized, and then
//! placed as usual: it stages in the tile with the others' parts, as a read-write access would.

use super::{GpuTask, Manager};
use ferry_device::Backend;

/// Where a GPU task may go, given the part writers in flight.
pub(super) enum Binding {
    /// No tile of the task is written in parts by tasks in flight.
    Free,
    /// The task must run on this device.
    Bound(usize),
    /// Its tiles are bound to two devices: it waits until one group is finalized.
    Conflict,
}

impl<B: Backend> Manager<B> {
    /// Where the part writers in flight bind task `t` (`Free` for a task with no part writes).
    pub(super) fn part_binding(t: &GpuTask) -> Binding {
        let mut bound = None;
        for x in t.tiles.iter().filter(|x| x.mode.is_part()) {
            if let Some((e, n)) = x.copy.lock().part_writers {
                if n > 0 {
                    match bound {
                        Some(b) if b != e => return Binding::Conflict,
                        _ => bound = Some(e),
                    }
                }
            }
        }
        bound.map_or(Binding::Free, Binding::Bound)
    }

    /// Task `t`, placed on `d`, is one more part writer in flight there.
    pub(super) fn bind_parts(t: &GpuTask, d: usize) {
        for x in t.tiles.iter().filter(|x| x.mode.is_part()) {
            let mut s = x.copy.lock();
            let n = s.part_writers.map_or(0, |(_, n)| n);
            s.part_writers = Some((d, n + 1));
        }
    }

    /// Task `t` (finalized, or failed before it ran) is no longer a part writer in flight.
    /// Once a copy has none left, the tasks deferred for it are placed again.
    pub(super) fn unbind_parts(&mut self, t: &GpuTask) {
        let mut freed = false;
        for x in t.tiles.iter().filter(|x| x.mode.is_part()) {
            let mut s = x.copy.lock();
            if let Some((e, n)) = s.part_writers {
                let n = n.saturating_sub(1);
                s.part_writers = (n > 0).then_some((e, n));
                freed |= n == 0;
            }
        }
        if freed && !self.adm.part_deferred.is_empty() {
            for t in std::mem::take(&mut self.adm.part_deferred) {
                self.place(t);
            }
        }
    }
}
