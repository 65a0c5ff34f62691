//! The on-disk format of a checkpoint: one file per rank and a manifest that ties them together.
//!
//! Rank file `rank-{r}.ckpt`:
//!
//! | bytes | content |
//! |---|---|
//! | 0..48 | preamble: magic `FERRYCK\0`, format version (u32), 0 (u32), footer offset (u64), footer length (u64), footer CRC-32 (u32), preamble CRC-32 over bytes 0..36 (u32), 8 zero bytes |
//! | 48..4096 | zeros |
//! | 4096.. | tile data, each tile at the offset its footer entry gives (64-byte aligned) |
//! | footer | postcard-encoded [`Footer`]: step, rank, rank count, collections (name, shape, tiling, element type, distribution), per tile its offset, length and CRC-32 |
//!
//! Manifest `manifest.ckpt`: magic `FERRYMF\0`, version (u32), body length (u32), body CRC-32
//! (u32), then the postcard-encoded [`Manifest`] (step, rank count, collections, per rank file:
//! name, length, footer CRC). A rank file from another checkpoint does not match its manifest
//! entry. All integers little-endian. Every decoder here is bounds-checked and returns a message
//! instead of panicking: the bytes may be truncated, corrupt or foreign.

use serde::{Deserialize, Serialize};

/// Rank-file magic.
pub(crate) const MAGIC: [u8; 8] = *b"FERRYCK\0";
/// Manifest magic.
pub(crate) const MANIFEST_MAGIC: [u8; 8] = *b"FERRYMF\0";
/// Format version written; readers refuse others.
pub(crate) const VERSION: u32 = 1;
/// Where tile data starts in a rank file.
pub(crate) const DATA_START: u64 = 4096;
/// Tile data alignment in a rank file.
pub(crate) const TILE_ALIGN: u64 = 64;
/// Bytes of the preamble.
pub(crate) const PREAMBLE_BYTES: usize = 48;
/// Largest footer or manifest body accepted (a corrupt length must not allocate gigabytes).
const MAX_META_BYTES: u64 = 1 << 30;

/// A collection as the checkpoint describes it (what the restoring program must match).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CollMeta {
    pub(crate) name: String,
    pub(crate) m: u64,
    pub(crate) n: u64,
    pub(crate) mb: u64,
    pub(crate) nb: u64,
    pub(crate) elem_size: u64,
    pub(crate) elem_name: String,
    /// The distribution it was written under (for the record: any distribution can restore).
    pub(crate) dist: String,
}

impl CollMeta {
    /// Whether a program's collection `other` can take this one's tiles: same name, shape,
    /// tiling and element type (the distribution may differ).
    pub(crate) fn compatible(&self, other: &CollMeta) -> bool {
        (
            &self.name,
            self.m,
            self.n,
            self.mb,
            self.nb,
            self.elem_size,
            &self.elem_name,
        ) == (
            &other.name,
            other.m,
            other.n,
            other.mb,
            other.nb,
            other.elem_size,
            &other.elem_name,
        )
    }
}

/// One tile in a rank file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TileEntry {
    /// Index into the footer's collections.
    pub(crate) coll: u32,
    /// Linear tile index in its collection.
    pub(crate) index: u32,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) crc: u32,
}

/// The footer of a rank file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Footer {
    pub(crate) step: u64,
    pub(crate) rank: u32,
    pub(crate) ranks: u32,
    pub(crate) colls: Vec<CollMeta>,
    pub(crate) tiles: Vec<TileEntry>,
}

/// One rank file as the manifest knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RankFile {
    pub(crate) name: String,
    pub(crate) len: u64,
    pub(crate) footer_crc: u32,
}

/// The manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub(crate) step: u64,
    pub(crate) ranks: u32,
    pub(crate) colls: Vec<CollMeta>,
    pub(crate) files: Vec<RankFile>,
}

/// The preamble of a rank file whose footer lies at `offset`.
pub(crate) fn preamble(footer_offset: u64, footer: &[u8]) -> [u8; PREAMBLE_BYTES] {
    let mut p = [0u8; PREAMBLE_BYTES];
    p[0..8].copy_from_slice(&MAGIC);
    p[8..12].copy_from_slice(&VERSION.to_le_bytes());
    p[16..24].copy_from_slice(&footer_offset.to_le_bytes());
    p[24..32].copy_from_slice(&(footer.len() as u64).to_le_bytes());
    p[32..36].copy_from_slice(&crc32fast::hash(footer).to_le_bytes());
    let c = crc32fast::hash(&p[0..36]);
    p[36..40].copy_from_slice(&c.to_le_bytes());
    p
}

fn u32_at(b: &[u8], k: usize) -> u32 {
    u32::from_le_bytes(b[k..k + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], k: usize) -> u64 {
    u64::from_le_bytes(b[k..k + 8].try_into().expect("8 bytes"))
}

/// Where the footer lies and its CRC, from a preamble, checked against the file length.
pub(crate) fn read_preamble(p: &[u8], file_len: u64) -> Result<(u64, u64, u32), String> {
    if p.len() < PREAMBLE_BYTES || file_len < DATA_START {
        return Err(format!("truncated: {file_len} bytes, shorter than a preamble"));
    }
    if p[0..8] != MAGIC {
        return Err("not a ferry checkpoint file (bad magic)".into());
    }
    if crc32fast::hash(&p[0..36]) != u32_at(p, 36) {
        return Err("corrupt preamble (checksum mismatch)".into());
    }
    let version = u32_at(p, 8);
    if version != VERSION {
        return Err(format!("format version {version}, this ferry reads version {VERSION}"));
    }
    let (off, len, crc) = (u64_at(p, 16), u64_at(p, 24), u32_at(p, 32));
    if len > MAX_META_BYTES || off < DATA_START || off.checked_add(len).is_none_or(|end| end > file_len) {
        return Err(format!(
            "truncated or corrupt: footer of {len} bytes at {off} does not fit the file's {file_len} bytes"
        ));
    }
    Ok((off, len, crc))
}

/// Decodes a footer and checks that its tiles lie inside the data region `[DATA_START, end)`.
pub(crate) fn decode_footer(bytes: &[u8], crc: u32, end: u64) -> Result<Footer, String> {
    if crc32fast::hash(bytes) != crc {
        return Err("corrupt footer (checksum mismatch)".into());
    }
    let f: Footer = postcard::from_bytes(bytes).map_err(|e| format!("unreadable footer: {e}"))?;
    for t in &f.tiles {
        let inside = t.offset >= DATA_START && t.offset.checked_add(t.len).is_some_and(|e| e <= end);
        if !inside || t.coll as usize >= f.colls.len() {
            return Err(format!(
                "corrupt footer: tile {} of collection {} at {}+{} lies outside the data",
                t.index, t.coll, t.offset, t.len
            ));
        }
    }
    Ok(f)
}

/// A manifest file's bytes.
pub(crate) fn encode_manifest(m: &Manifest) -> Result<Vec<u8>, String> {
    let body = postcard::to_allocvec(m).map_err(|e| format!("encoding the manifest: {e}"))?;
    let mut out = Vec::with_capacity(20 + body.len());
    out.extend_from_slice(&MANIFEST_MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes a manifest file's bytes.
pub(crate) fn decode_manifest(b: &[u8]) -> Result<Manifest, String> {
    if b.len() < 20 {
        return Err(format!("truncated: {} bytes", b.len()));
    }
    if b[0..8] != MANIFEST_MAGIC {
        return Err("not a ferry checkpoint manifest (bad magic)".into());
    }
    let version = u32_at(b, 8);
    if version != VERSION {
        return Err(format!("format version {version}, this ferry reads version {VERSION}"));
    }
    let len = u32_at(b, 12) as usize;
    let body = b
        .get(20..20 + len)
        .ok_or_else(|| format!("truncated: body of {len} bytes announced, {} present", b.len() - 20))?;
    if crc32fast::hash(body) != u32_at(b, 16) {
        return Err("corrupt manifest (checksum mismatch)".into());
    }
    postcard::from_bytes(body).map_err(|e| format!("unreadable manifest: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            step: 7,
            ranks: 2,
            colls: vec![CollMeta {
                name: "u".into(),
                m: 10,
                n: 10,
                mb: 5,
                nb: 5,
                elem_size: 8,
                elem_name: "f64".into(),
                dist: "BlockCyclic2d(1x2)".into(),
            }],
            files: vec![RankFile {
                name: "rank-0.ckpt".into(),
                len: 5000,
                footer_crc: 1,
            }],
        }
    }

    #[test]
    fn manifest_round_trips_and_every_corruption_is_refused() {
        let b = encode_manifest(&manifest()).unwrap();
        assert_eq!(decode_manifest(&b).unwrap(), manifest());
        for k in 0..b.len() {
            let mut c = b.clone();
            c[k] ^= 0x10;
            assert!(decode_manifest(&c).is_err(), "flipped byte {k} accepted");
        }
        for n in 0..b.len() {
            assert!(decode_manifest(&b[..n]).is_err(), "truncation to {n} accepted");
        }
    }

    #[test]
    fn preamble_checks_magic_version_and_bounds() {
        let footer = postcard::to_allocvec(&Footer {
            step: 1,
            rank: 0,
            ranks: 1,
            colls: manifest().colls,
            tiles: vec![TileEntry {
                coll: 0,
                index: 3,
                offset: DATA_START,
                len: 200,
                crc: 9,
            }],
        })
        .unwrap();
        let off = DATA_START + 256;
        let p = preamble(off, &footer);
        let len = off + footer.len() as u64;
        let (o, l, crc) = read_preamble(&p, len).unwrap();
        assert_eq!((o, l), (off, footer.len() as u64));
        let f = decode_footer(&footer, crc, o).unwrap();
        assert_eq!(f.tiles[0].index, 3);
        assert!(read_preamble(&p, len - 1).unwrap_err().contains("truncated"));
        let mut q = p;
        q[8] = 2;
        assert!(
            read_preamble(&q, len).is_err(),
            "a changed version fails the preamble checksum"
        );
        let mut q = p;
        q[0] = b'X';
        assert!(read_preamble(&q, len).unwrap_err().contains("magic"));
        assert!(decode_footer(&footer, crc, DATA_START + 100)
            .unwrap_err()
            .contains("outside"));
        let mut g = footer.clone();
        g[0] ^= 1;
        assert!(decode_footer(&g, crc, o).unwrap_err().contains("checksum"));
    }
}
