//! Packed transfers: the small tiles one task reads from one other rank travel as one message
//! (`FERRY_PACK_BYTES`; after Spark RAPIDS' bounce-buffer batching). Both sides know at insertion
//! which tiles go together, so the message needs no negotiation: a small header (magic, count,
//! each tile's length) that the receiver checks against what the graph says, then the payloads
//! in access order.
//!
//! Off by default: the transfer table suggested it would pay (16 tiles of 64 KiB in flight moved
//! at 0.75–0.92 GB/s against 1.55–2.64 GB/s for one 1 MiB message), but measured on Task Bench's
//! all_to_all on the GPU machine it is 1.6–1.9× slower: a packed send waits for the last of
//! its producers instead of leaving with each, and copies every tile twice.
//!
//! Tiles are counted on the host paths one by one (the graph's traffic stays comparable); the
//! carrier messages are counted on [`TrafficPath::Packed`].

use super::region::Small;
use super::{Done, Transport};
use ferry_base::error::{FerryError, Rank};
use ferry_base::traffic::TrafficPath;
use ferry_engine::Lane;
use ferry_memory::data::copy::TileCopy;
use std::sync::Arc;

const MAGIC: [u8; 4] = *b"FRYP";

/// Bytes of the header for `n` tiles: magic, count (u32), then one u64 length per tile.
pub fn header_bytes(n: usize) -> usize {
    8 + 8 * n
}

impl Transport {
    /// Sends the current data of `copies` to `peer` as one message (staging device-only copies
    /// out first).
    pub fn send_packed(self: &Arc<Self>, copies: Vec<Arc<TileCopy>>, peer: Rank, tag: i32, done: Done) {
        let done = if self.residency.tier().is_some() {
            self.hold_host(&copies, done).0
        } else {
            done
        };
        let t = self.clone();
        self.when_on_host(copies.clone(), done, move |done| {
            t.send_packed_now(&copies, peer, tag, done)
        });
    }

    fn send_packed_now(self: &Arc<Self>, copies: &[Arc<TileCopy>], peer: Rank, tag: i32, done: Done) {
        let lens: Vec<usize> = copies.iter().map(|c| c.bytes()).collect();
        let total: usize = lens.iter().sum();
        let mut msg = Vec::with_capacity(header_bytes(copies.len()) + total);
        msg.extend_from_slice(&MAGIC);
        msg.extend_from_slice(&(copies.len() as u32).to_le_bytes());
        for &l in &lens {
            msg.extend_from_slice(&(l as u64).to_le_bytes());
        }
        for c in copies {
            let buf = c.lock().host_buf(c.bytes());
            // SAFETY: the send node is a reader of every copy: no writer runs meanwhile.
            msg.extend_from_slice(unsafe { buf.bytes() });
        }
        let (path, eager) = self.host_path(msg.len());
        let t = self.clone();
        let done: Done = Box::new(move |r| {
            if r.is_ok() {
                t.count(path, lens.iter().sum(), lens.len(), true);
            }
            done(r)
        });
        self.message(
            true,
            Small::new(&msg),
            peer,
            tag,
            Lane::Data,
            TrafficPath::Packed,
            true,
            eager,
            done,
        );
    }

    /// Receives a packed message from `peer` into the fresh copies `copies` (host memory; a device
    /// consumer's stage-in takes it from there).
    pub fn recv_packed(self: &Arc<Self>, copies: Vec<Arc<TileCopy>>, peer: Rank, tag: i32, done: Done) {
        let done = if self.residency.tier().is_some() {
            self.hold_host(&copies, done).0
        } else {
            done
        };
        let lens: Vec<usize> = copies.iter().map(|c| c.bytes()).collect();
        let total = header_bytes(copies.len()) + lens.iter().sum::<usize>();
        let buf = Small::zeroed(total);
        let b = buf.clone();
        let t = self.clone();
        let (path, eager) = self.host_path(total);
        let on_msg: Done = Box::new(move |r| {
            if let Err(e) = r {
                return done(Err(e));
            }
            // SAFETY: the receive has completed.
            let bytes = unsafe { b.get() };
            if let Err(msg) = unpack(bytes, &copies) {
                return done(Err(FerryError::Protocol { peer, tag, msg }));
            }
            t.count(path, lens.iter().sum(), lens.len(), false);
            done(Ok(()))
        });
        self.message(
            false,
            buf,
            peer,
            tag,
            Lane::Data,
            TrafficPath::Packed,
            true,
            eager,
            on_msg,
        );
    }
}

/// Checks the header against the copies the graph expects and copies each payload into its
/// copy's host buffer. Untrusted bytes: every length is checked before use.
fn unpack(bytes: &[u8], copies: &[Arc<TileCopy>]) -> Result<(), String> {
    let n = copies.len();
    if bytes.len() < header_bytes(n) || bytes[..4] != MAGIC {
        return Err("packed message without its header".into());
    }
    let count = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
    if count != n {
        return Err(format!("packed message of {count} tiles, expected {n}"));
    }
    let mut off = header_bytes(n);
    for (k, c) in copies.iter().enumerate() {
        let at = 8 + 8 * k;
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[at..at + 8]);
        let len = u64::from_le_bytes(w) as usize;
        if len != c.bytes() || off + len > bytes.len() {
            return Err(format!("packed tile {k} of {len} bytes, expected {}", c.bytes()));
        }
        let buf = c.lock().host_buf(len);
        // SAFETY: the copy is fresh: nobody else uses it until the receive node finishes.
        unsafe { std::ptr::copy_nonoverlapping(bytes[off..off + len].as_ptr(), buf.as_ptr(), len) };
        off += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpack_checks_the_header() {
        let copies: Vec<Arc<TileCopy>> = (0..2).map(|k| TileCopy::host(8 + 8 * k, &Default::default())).collect();
        let mut msg = Vec::new();
        msg.extend_from_slice(&MAGIC);
        msg.extend_from_slice(&2u32.to_le_bytes());
        msg.extend_from_slice(&8u64.to_le_bytes());
        msg.extend_from_slice(&16u64.to_le_bytes());
        msg.extend((0..24).map(|x| x as u8));
        unpack(&msg, &copies).unwrap();
        let b = copies[1].lock().host_buf(16);
        assert_eq!(unsafe { b.bytes() }[0], 8);
        let mut bad = msg.clone();
        bad[8] = 9;
        assert!(unpack(&bad, &copies).unwrap_err().contains("tile 0"));
        assert!(unpack(&msg[..10], &copies).is_err());
        let mut bad = msg;
        bad[4] = 3;
        assert!(unpack(&bad, &copies).unwrap_err().contains("3 tiles"));
    }
}
