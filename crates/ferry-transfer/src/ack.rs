//! Device acknowledgements of IPC sends: the consumer's comm stream writes a word of the
//! producer's signal area once its pull has read the block, and the producer's tasks that
//! overwrite the block wait for that word on the device — instead of for the consumer's host
//! acknowledgement, which needs the consumer's completion poll, a control message, the
//! producer's polling thread, the graph's release and a launch (a round trip of tens of µs on
//! the path of every tile that is sent and then rewritten: `transfer --tasks per-round`, the
//! halos of a stencil).
//!
//! The producer takes a word per send from [`AckWords`] and names it, with the value to write,
//! in the descriptor (`wire::Desc::Pool::ack`); the send's successors that overwrite the tile
//! on the device are then released at once (by the task layer, `ferry`), their streams waiting for the
//! word (`GpuTask::acks`). The host acknowledgement still comes: it unpins the block, completes
//! the send, and gives the word back. The consumer writes the word before the event whose
//! completion sends the host acknowledgement, so a word is never written after it was given
//! back; each use of a word writes a value higher than the last, so a task waiting for
//! an older use of a word that was since reused is released too ("at least" comparison).
//!
//! Deadlock freedom: an acknowledgement waits on the device for nothing but its own pull, and
//! an acknowledged pull waits on the device for nothing at all. Sends whose data is complete ask
//! for one; sends offered at launch (whose pulls must follow the producer's signal) ask only
//! where the producer publishes its signal words on the host (`ferry-device/src/signal_mirror.rs`), and
//! the consumer holds such a pull on the host until the signal shows there
//! (`ferry-memory/src/manager/held.rs`, with no time limit) instead of making its stream wait. The
//! consumer enqueues acknowledged pulls on a comm stream that no signal-waiting pull uses
//! (`Manager::enqueue_copies`). So no chain of device waits leads from a task back to an
//! acknowledgement it waits for.

use ferry_base::error::{FerryError, Result};
use ferry_device::ACK_WORDS;
use ferry_memory::manager::DeviceAck;
use std::sync::Mutex;

/// When IPC sends ask for device acknowledgements (`FERRY_DEVICE_ACK`).
///
/// A task released by device acknowledgements is launched before its tiles are read, its
/// stream waiting for the words. That takes the host acknowledgement's round trip (the
/// consumer's completion poll, a control message, the producer's polling thread, the graph's
/// release, a launch) off the path of a tile that is sent and then rewritten; but a stream's
/// wait wakes 12–15 µs after the word lands on H200 (`transfer --wake-probe`), about what the
/// round trip costs, and each acknowledged transfer costs both GPU managers more work. On 2×
/// H200 (medians, GB/s) tasks that rewrite one sent tile lost
/// with them (IPC, one task per tile, 4 MiB × 8 in flight: 252 against 292; the 4096² stencil
/// with renaming off: 0.077 against 0.066 s), and tasks that rewrite a round of tiles won (one
/// task per round, under `Auto` against `Off`: 1 MiB × 8 173.7 against 133.6, 4 MiB × 8 328.5
/// against 301.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeviceAcks {
    /// For tasks that could wait for at least two acknowledgements: counted at the task's
    /// insertion, the unfinished sends over the IPC route of the versions of the tiles it
    /// overwrites (a round of tiles written by one task, round after round). Sends offered at
    /// launch ask only where every rank can see every peer's signal mirror (agreed at
    /// start-up; otherwise they go without).
    #[default]
    Auto,
    /// For every GPU task that overwrites a tile an IPC send still reads; a signal mirror that
    /// cannot be mapped fails start-up.
    On,
    /// Never: overwriting tasks wait for the host acknowledgement.
    Off,
}

/// [`DeviceAcks::Auto`]: the fewest device acknowledgements a task must be able to wait for
/// (counted at its insertion) to be released by them.
pub const AUTO_MIN_WAITS: usize = 2;

impl DeviceAcks {
    /// The fewest acknowledgements a task must be able to wait for to be released by them
    /// (`None`: never).
    pub fn min_waits(self) -> Option<usize> {
        match self {
            DeviceAcks::Auto => Some(AUTO_MIN_WAITS),
            DeviceAcks::On => Some(1),
            DeviceAcks::Off => None,
        }
    }
}

impl std::str::FromStr for DeviceAcks {
    type Err = FerryError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceAcks::Auto),
            "on" | "1" | "yes" | "true" => Ok(DeviceAcks::On),
            "off" | "0" | "no" | "false" => Ok(DeviceAcks::Off),
            _ => Err(FerryError::Config(format!(
                "FERRY_DEVICE_ACK={s:?}: expected auto, on or off"
            ))),
        }
    }
}

/// The acknowledgement words of this rank's devices not in use by a send, and the last value
/// each was given.
pub struct AckWords {
    devices: Vec<Mutex<Words>>,
    /// Sends offered at their producer's launch may ask too: every device of this rank
    /// publishes a host mirror of its signal words, so the consumer holds such a pull on the
    /// host until its signal shows there and never makes a stream wait for it.
    offered: bool,
    /// The fewest acknowledgements a task must be able to wait for to be released by them
    /// ([`DeviceAcks::min_waits`]).
    min_waits: usize,
}

struct Words {
    /// Words not in use (taken from the end: the most recently returned first).
    free: Vec<u32>,
    /// Per word, the value of its last use.
    last: Vec<u64>,
}

impl AckWords {
    /// All [`ACK_WORDS`] words of each of `devices` devices free, none used yet (the words start
    /// at zero: the first value given is 1); `offered`: sends offered at launch may ask too
    /// (every device publishes a signal mirror, [`AckWords::offered`]).
    pub fn new(devices: usize, offered: bool, min_waits: usize) -> AckWords {
        AckWords {
            devices: (0..devices)
                .map(|_| {
                    Mutex::new(Words {
                        free: (0..ACK_WORDS as u32).rev().collect(),
                        last: vec![0; ACK_WORDS],
                    })
                })
                .collect(),
            offered,
            min_waits,
        }
    }

    /// A free word of device `dev` and its next value; `None` when all are in use (the send
    /// then goes without a device acknowledgement) or `dev` is out of range.
    pub fn take(&self, dev: usize) -> Option<DeviceAck> {
        let mut w = self.devices.get(dev)?.lock().unwrap_or_else(|p| p.into_inner());
        let word = w.free.pop()?;
        let value = &mut w.last[word as usize];
        *value += 1;
        Some(DeviceAck {
            dev,
            word,
            value: *value,
        })
    }

    /// Whether sends offered at their producer's launch may ask for a device acknowledgement.
    pub fn offered(&self) -> bool {
        self.offered
    }

    /// The fewest acknowledgements a task must be able to wait for to be released by them.
    pub fn min_waits(&self) -> usize {
        self.min_waits
    }

    /// Gives back the word of `a`, whose consumer has written it (its host acknowledgement has
    /// come).
    pub fn give(&self, a: DeviceAck) {
        if let Some(m) = self.devices.get(a.dev) {
            let mut w = m.lock().unwrap_or_else(|p| p.into_inner());
            debug_assert!(
                !w.free.contains(&a.word),
                "acknowledgement word {} given back twice",
                a.word
            );
            w.free.push(a.word);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words are handed out once at a time, values rise with each use of a word, and the pool
    /// runs dry after `ACK_WORDS` takes.
    #[test]
    fn words_are_exclusive_and_values_rise() {
        let w = AckWords::new(2, false, 1);
        let a = w.take(1).expect("a free word");
        assert_eq!((a.dev, a.value), (1, 1));
        let b = w.take(1).expect("another");
        assert_ne!(a.word, b.word);
        w.give(a);
        let c = w.take(1).expect("the word given back");
        assert_eq!((c.word, c.value), (a.word, 2), "a reused word gets a higher value");
        let mut held = vec![b, c];
        while let Some(x) = w.take(1) {
            held.push(x);
        }
        assert_eq!(held.len(), ACK_WORDS);
        let mut words: Vec<u32> = held.iter().map(|x| x.word).collect();
        words.sort_unstable();
        words.dedup();
        assert_eq!(words.len(), ACK_WORDS, "no word given twice");
        assert!(w.take(0).is_some(), "devices have their own words");
        assert!(w.take(2).is_none(), "no such device");
    }

    /// `FERRY_DEVICE_ACK` parses its three settings (and the usual spellings of on and off),
    /// and refuses the rest by name.
    #[test]
    fn modes_parse() {
        for (s, m) in [
            ("auto", DeviceAcks::Auto),
            ("ON", DeviceAcks::On),
            ("1", DeviceAcks::On),
            ("off", DeviceAcks::Off),
            ("no", DeviceAcks::Off),
        ] {
            assert_eq!(s.parse::<DeviceAcks>().unwrap(), m, "{s}");
        }
        let e = "sometimes".parse::<DeviceAcks>().unwrap_err().to_string();
        assert!(e.contains("FERRY_DEVICE_ACK") && e.contains("sometimes"), "{e}");
        assert_eq!(DeviceAcks::default().min_waits(), Some(AUTO_MIN_WAITS));
        assert_eq!(DeviceAcks::Off.min_waits(), None);
    }
}
