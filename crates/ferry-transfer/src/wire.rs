//! The one control message of the IPC protocol: the producer's descriptor of where the tile
//! lies. It crosses a process boundary, so decoding treats it as untrusted bytes: fixed size,
//! magic and version checked, every field bounds-checked by the caller against what the graph
//! says the transfer holds.

/// Bytes of an encoded descriptor.
pub const DESC_BYTES: usize = 48;
const MAGIC: [u8; 4] = *b"FRYD";
const VERSION: u8 = 3;

/// Where the producer's data is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Desc {
    /// In the producer's device pool `dev` at `offset`, pinned until the consumer acknowledges.
    /// `after`: offered at the producing task's launch — the data is complete only once the
    /// producer's signal word `.0` of device `dev` holds at least `.1` (a word below
    /// `ferry_device::SIGNAL_SLOTS`, a value ≥ 1: the receiver checks both). `ack`: the consumer
    /// writes value `.1` (≥ 1) into the producer's acknowledgement word `.0` of device `dev`
    /// (below `ferry_device::ACK_WORDS`) once its copy has read the block (`ack.rs`).
    Pool {
        /// The producer's device.
        dev: u16,
        /// Offset of the block in its pool.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Signal word and value the data waits for (see above).
        after: Option<(u32, u64)>,
        /// Acknowledgement word and value to write (see above).
        ack: Option<(u32, u64)>,
    },
    /// Only in the producer's host memory: the payload follows on the same tag as one message.
    Inline {
        /// Bytes.
        len: u64,
    },
}

/// Why a descriptor was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescError {
    #[error("descriptor of {0} bytes (expected {DESC_BYTES})")]
    /// Not [`DESC_BYTES`] long.
    Size(usize),
    #[error("bad magic {0:02x?}")]
    /// Not a ferry descriptor.
    Magic([u8; 4]),
    #[error("descriptor version {0} (this build speaks {VERSION})")]
    /// Another version of the protocol.
    Version(u8),
    #[error("unknown descriptor kind {0}")]
    /// An unknown kind.
    Kind(u8),
}

impl Desc {
    /// Whether the descriptor announces an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The payload length the descriptor announces.
    pub fn len(&self) -> u64 {
        match *self {
            Desc::Pool { len, .. } | Desc::Inline { len } => len,
        }
    }

    /// Little-endian: magic, version, kind (1: pool, 2: inline, 3: pool after a signal),
    /// device (u16), signal word (u32), offset, length, acknowledgement word (u32), signal
    /// value, acknowledgement value (0: none).
    pub fn encode(&self) -> [u8; DESC_BYTES] {
        let mut b = [0u8; DESC_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        let (kind, dev, offset, len, (slot, value), (word, ack)) = match *self {
            Desc::Pool {
                dev,
                offset,
                len,
                after,
                ack,
            } => (
                if after.is_some() { 3u8 } else { 1u8 },
                dev,
                offset,
                len,
                after.unwrap_or((0, 0)),
                ack.unwrap_or((0, 0)),
            ),
            Desc::Inline { len } => (2u8, 0, 0, len, (0, 0), (0, 0)),
        };
        b[5] = kind;
        b[6..8].copy_from_slice(&dev.to_le_bytes());
        b[8..12].copy_from_slice(&slot.to_le_bytes());
        b[12..20].copy_from_slice(&offset.to_le_bytes());
        b[20..28].copy_from_slice(&len.to_le_bytes());
        b[28..32].copy_from_slice(&word.to_le_bytes());
        b[32..40].copy_from_slice(&value.to_le_bytes());
        b[40..48].copy_from_slice(&ack.to_le_bytes());
        b
    }

    /// Decodes untrusted bytes; never panics.
    pub fn decode(b: &[u8]) -> Result<Desc, DescError> {
        if b.len() != DESC_BYTES {
            return Err(DescError::Size(b.len()));
        }
        let magic: [u8; 4] = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(DescError::Magic(magic));
        }
        if b[4] != VERSION {
            return Err(DescError::Version(b[4]));
        }
        let u64_at = |k: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[k..k + 8]);
            u64::from_le_bytes(w)
        };
        let dev = u16::from_le_bytes([b[6], b[7]]);
        let slot = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let word = u32::from_le_bytes([b[28], b[29], b[30], b[31]]);
        let (offset, len, value, ack) = (u64_at(12), u64_at(20), u64_at(32), u64_at(40));
        let ack = (ack != 0).then_some((word, ack));
        match b[5] {
            1 => Ok(Desc::Pool {
                dev,
                offset,
                len,
                after: None,
                ack,
            }),
            2 => Ok(Desc::Inline { len }),
            3 => Ok(Desc::Pool {
                dev,
                offset,
                len,
                after: Some((slot, value)),
                ack,
            }),
            k => Err(DescError::Kind(k)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for d in [
            Desc::Pool {
                dev: 3,
                offset: 1 << 40,
                len: 4 << 20,
                after: None,
                ack: None,
            },
            Desc::Pool {
                dev: 0,
                offset: 512,
                len: 1 << 20,
                after: None,
                ack: Some((1023, 7)),
            },
            Desc::Pool {
                dev: 1,
                offset: 256,
                len: 1 << 20,
                after: Some((5, u64::MAX - 3)),
                ack: Some((2, 1)),
            },
            Desc::Inline { len: 17 },
        ] {
            assert_eq!(Desc::decode(&d.encode()), Ok(d));
        }
    }

    #[test]
    fn rejects_bad_bytes_without_panicking() {
        let good = Desc::Inline { len: 8 }.encode();
        assert_eq!(Desc::decode(&good[..31]), Err(DescError::Size(31)));
        assert_eq!(
            Desc::decode(&[good.as_slice(), &[0]].concat()),
            Err(DescError::Size(DESC_BYTES + 1))
        );
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Desc::decode(&b), Err(DescError::Magic(_))));
        let mut b = good;
        b[4] = 9;
        assert_eq!(Desc::decode(&b), Err(DescError::Version(9)));
        let mut b = good;
        b[5] = 7;
        assert_eq!(Desc::decode(&b), Err(DescError::Kind(7)));
        // Random bytes of random lengths: never a panic, and anything that decodes re-encodes to
        // the same bytes' meaning (xorshift, fixed seed: the same 200 000 inputs every run).
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 56) as usize;
            let mut b: Vec<u8> = (0..len).map(|k| (x >> ((k % 8) * 8)) as u8 ^ k as u8).collect();
            if len == DESC_BYTES && x % 3 == 0 {
                b[..5].copy_from_slice(&[b'F', b'R', b'Y', b'D', VERSION]);
            }
            if let Ok(d) = Desc::decode(&b) {
                assert_eq!(Desc::decode(&d.encode()), Ok(d));
            }
        }
        // Every single-byte corruption either decodes to something or errors; never panics.
        for k in 0..DESC_BYTES {
            for v in [0u8, 0xff, 0x80] {
                let mut b = good;
                b[k] = v;
                let _ = Desc::decode(&b);
            }
        }
    }
}
