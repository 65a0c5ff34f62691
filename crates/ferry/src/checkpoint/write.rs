//! Writing one rank's checkpoint file: every local tile streamed from wherever its current data
//! lives, with bounded extra host memory.
//!
//! - Host-resident tiles are written straight from their host buffers.
//! - Device-resident tiles go through the bounce pool: per piece (a chunk of a large tile, or a
//!   batch of consecutive small tiles — RNG states, halos — that fit one bounce buffer), one
//!   device→host copy per tile segment on a comm stream into a bounce buffer, then one write.
//!   Pieces ask for buffers up front; the pool hands them out in order as writes give them
//!   back, so the copies of the next pieces overlap the write of the current one and the host
//!   memory taken is the pool's, allocated once at start-up: a device-resident collection is
//!   never mirrored on the host.
//! - Tiles only the disk tier holds are copied from the spill file through one buffer of at most
//!   a bounce chunk.
//!
//! The file is written under a temporary name, synced, and renamed.

use super::format::{self, CollMeta, Footer, TileEntry, DATA_START, TILE_ALIGN};
use crate::stats::TrafficPath;
use ferry_base::error::FerryError;
use ferry_device::{DeviceError, Mem, Stream};
use ferry_engine::MemRegion;
use ferry_memory::data::copy::TileCopy;
use ferry_memory::manager::{CopyOp, GpuCmd, GpuHandle};
use ferry_memory::tier::DiskStore;
use ferry_transfer::bounce::{BouncePool, Slot};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What the writer may read from.
pub(crate) struct Sources {
    pub(crate) gpu: Option<GpuHandle>,
    pub(crate) bounce: Option<Arc<BouncePool>>,
    pub(crate) disk: Option<Arc<DiskStore>>,
}

/// One local tile to write.
pub(crate) struct Item {
    /// Index into the footer's collections.
    pub(crate) coll: u32,
    pub(crate) index: u32,
    pub(crate) copy: Arc<TileCopy>,
}

/// Bytes written per source.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Written {
    pub(crate) from_host: u64,
    pub(crate) from_device: u64,
    pub(crate) from_disk: u64,
    /// Bytes of the largest buffer allocated for the disk path (0: none).
    pub(crate) scratch: u64,
    /// Device→host copies issued and pieces written through the bounce pool.
    pub(crate) device_copies: u64,
    pub(crate) pieces: u64,
}

/// A part of one tile inside a piece.
struct Seg {
    item: usize,
    /// Offset in the tile.
    at: u64,
    /// Offset in the bounce buffer.
    slot_at: usize,
    len: usize,
}

/// What goes through one bounce buffer: `len` bytes of the file from `file_at`.
struct Piece {
    file_at: u64,
    len: usize,
    segs: Vec<Seg>,
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> FerryError {
    FerryError::Checkpoint {
        path: path.display().to_string(),
        msg: format!("{what}: {e}"),
    }
}

/// The offset of each item in a rank file, and where the data ends.
fn layout(items: &[Item]) -> (Vec<u64>, u64) {
    let mut offsets = Vec::with_capacity(items.len());
    let mut end = DATA_START;
    for it in items {
        offsets.push(end);
        end = (end + it.copy.bytes() as u64).div_ceil(TILE_ALIGN) * TILE_ALIGN;
    }
    (offsets, end)
}

/// The most bytes a rank file of tiles of `sizes` bytes (with collection and tile ids) can take:
/// data, padding, and the footer with the longest CRC encodings.
pub(crate) fn size_bound(sizes: &[(u32, u32, u64)], header: (u64, u32, u32), colls: Vec<CollMeta>) -> usize {
    let mut end = DATA_START;
    let mut tiles = Vec::with_capacity(sizes.len());
    for &(coll, index, len) in sizes {
        tiles.push(TileEntry {
            coll,
            index,
            offset: end,
            len,
            crc: u32::MAX,
        });
        end = (end + len).div_ceil(TILE_ALIGN) * TILE_ALIGN;
    }
    let footer = Footer {
        step: header.0,
        rank: header.1,
        ranks: header.2,
        colls,
        tiles,
    };
    end as usize + postcard::to_allocvec(&footer).map_or(0, |v| v.len())
}

/// Writes `items` into the caller's `buf`, in the rank-file format: device data is copied by the
/// GPU manager straight to its final place in `buf` (no bounce buffer, no mirror), host data
/// copied, disk data read into place. Returns the bytes used.
///
/// # Errors
/// [`FerryError::InvalidArgument`] when `buf` is too small; device or disk errors.
pub(crate) fn write_buffer(
    src: &Sources,
    items: &[Item],
    (step, rank, ranks): (u64, u32, u32),
    colls: Vec<CollMeta>,
    buf: &mut [u8],
) -> Result<(usize, Written), FerryError> {
    let (offsets, end) = layout(items);
    let sizes: Vec<(u32, u32, u64)> = items.iter().map(|i| (i.coll, i.index, i.copy.bytes() as u64)).collect();
    let need = size_bound(&sizes, (step, rank, ranks), colls.clone());
    if buf.len() < need {
        return Err(FerryError::InvalidArgument(format!(
            "checkpoint buffer of {} bytes, this rank's part needs up to {need} (Runtime::checkpoint_size)",
            buf.len()
        )));
    }
    buf[..end as usize].fill(0);
    let places: Vec<Option<At>> = items.iter().map(|it| locate(&it.copy)).collect();
    let mut w = Written::default();
    let base = buf.as_mut_ptr();
    let (tx, rx) = crossbeam::channel::unbounded::<Result<(), DeviceError>>();
    let mut posted = 0usize;
    let mut result: Result<(), FerryError> = Ok(());
    for (k, place) in places.iter().enumerate() {
        let (off, len) = (offsets[k] as usize, items[k].copy.bytes());
        match place {
            Some(At::Host(h)) => {
                // SAFETY: nothing runs (after a wait); the Arc keeps the buffer alive.
                buf[off..off + len].copy_from_slice(unsafe { h.bytes() });
                w.from_host += len as u64;
            }
            Some(At::Disk(slot)) => match &src.disk {
                Some(d) => {
                    if let Err(e) = d.read(*slot, &mut buf[off..off + len]) {
                        result = Err(e);
                        break;
                    }
                    w.from_disk += len as u64;
                }
                None => {
                    result = Err(FerryError::InvalidArgument(
                        "a tile lies on a disk tier that is gone".into(),
                    ));
                    break;
                }
            },
            Some(At::Device { dev, offset }) => {
                let Some(gpu) = &src.gpu else {
                    result = Err(FerryError::InvalidArgument(
                        "a tile lies on a device that is gone".into(),
                    ));
                    break;
                };
                let stream = Stream::Comm(k % ferry_device::COMM_STREAMS);
                // SAFETY (of the add): inside `buf`, which outlives the copy (drained below).
                let dst = Mem::Host(unsafe { base.add(off) });
                let op = CopyOp::plain(*dev, stream, Mem::Pool(*offset), dst, len, TrafficPath::DeviceToHost);
                let tx = tx.clone();
                match gpu.post(GpuCmd::Copy {
                    op,
                    then: Box::new(move |r| {
                        let _ = tx.send(r);
                    }),
                }) {
                    Ok(()) => {
                        posted += 1;
                        w.from_device += len as u64;
                        w.device_copies += 1;
                    }
                    Err(e) => {
                        result = Err(FerryError::Device(e));
                        break;
                    }
                }
            }
            None => {
                result = Err(FerryError::InvalidArgument(format!(
                    "tile {} of collection #{} has no current copy on this rank",
                    items[k].index, items[k].coll
                )));
                break;
            }
        }
    }
    // Every posted copy must land before `buf` is handed back, error or not. Only the posted
    // copies' callbacks hold a sender now: should the GPU manager die (a bug), dropping them
    // unrun, the receive fails instead of waiting forever.
    drop(tx);
    for _ in 0..posted {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => result = result.and(Err(FerryError::Device(e))),
            Err(_) => result = result.and(Err(FerryError::ThreadLost("gpu"))),
        }
    }
    unpin(src, items, &places);
    result?;
    let tiles = items
        .iter()
        .enumerate()
        .map(|(k, it)| {
            let (off, len) = (offsets[k] as usize, it.copy.bytes());
            TileEntry {
                coll: it.coll,
                index: it.index,
                offset: offsets[k],
                len: len as u64,
                crc: crc32fast::hash(&buf[off..off + len]),
            }
        })
        .collect();
    let footer = Footer {
        step,
        rank,
        ranks,
        colls,
        tiles,
    };
    let fb =
        postcard::to_allocvec(&footer).map_err(|e| FerryError::InvalidArgument(format!("encoding the footer: {e}")))?;
    let e = end as usize;
    buf[e..e + fb.len()].copy_from_slice(&fb);
    buf[..format::PREAMBLE_BYTES].copy_from_slice(&format::preamble(end, &fb));
    Ok((e + fb.len(), w))
}

/// Writes `items` to `path` (via `path.tmp`) with the footer's metadata; returns the file's
/// length, its footer CRC and what was written from where.
pub(crate) fn write_file(
    src: &Sources,
    items: &[Item],
    (step, rank, ranks): (u64, u32, u32),
    colls: Vec<CollMeta>,
    path: &Path,
) -> Result<(u64, u32, Written), FerryError> {
    // Layout: tiles in order, each 64-byte aligned, from DATA_START.
    let (offsets, end) = layout(items);
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let file = File::create(&tmp).map_err(|e| io_err(&tmp, "creating", e))?;
    let mut crcs: Vec<Vec<(u64, u64, u32)>> = vec![Vec::new(); items.len()];
    let mut written = Written::default();
    let result = stream(src, items, &offsets, &file, &tmp, &mut crcs, &mut written);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // Per tile: its segments' CRCs combined in order.
    let mut tiles = Vec::with_capacity(items.len());
    for (k, it) in items.iter().enumerate() {
        let mut parts = std::mem::take(&mut crcs[k]);
        parts.sort_by_key(|p| p.0);
        let mut h = crc32fast::Hasher::new();
        for (_, len, crc) in parts {
            h.combine(&crc32fast::Hasher::new_with_initial_len(crc, len));
        }
        tiles.push(TileEntry {
            coll: it.coll,
            index: it.index,
            offset: offsets[k],
            len: it.copy.bytes() as u64,
            crc: h.finalize(),
        });
    }
    let footer = Footer {
        step,
        rank,
        ranks,
        colls,
        tiles,
    };
    let fb = postcard::to_allocvec(&footer).map_err(|e| FerryError::Checkpoint {
        path: tmp.display().to_string(),
        msg: format!("encoding the footer: {e}"),
    })?;
    let finish = || -> std::io::Result<()> {
        file.write_all_at(&fb, end)?;
        file.write_all_at(&format::preamble(end, &fb), 0)?;
        file.sync_all()
    };
    if let Err(e) = finish() {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(&tmp, "writing", e));
    }
    std::fs::rename(&tmp, path).map_err(|e| io_err(path, "renaming the finished file", e))?;
    Ok((end + fb.len() as u64, crc32fast::hash(&fb), written))
}

/// Where the current data of a copy is, pinned when on a device.
enum At {
    Host(Arc<ferry_memory::data::buffer::TileBuf>),
    Device { dev: usize, offset: u64 },
    Disk(ferry_device::pool::Block),
}

fn locate(copy: &Arc<TileCopy>) -> Option<At> {
    let mut s = copy.lock();
    if s.host_valid {
        // A copy valid on the host with no buffer yet holds zeros: materialise them.
        return Some(At::Host(s.host_buf(copy.bytes())));
    }
    if let Some(d) = (0..s.dev.len()).find(|&d| s.dev[d].valid) {
        let b = s.dev[d].block?;
        s.dev[d].pins += 1;
        return Some(At::Device {
            dev: d,
            offset: b.offset,
        });
    }
    if s.disk_valid {
        return s.disk.map(At::Disk);
    }
    None
}

#[allow(clippy::too_many_arguments)]
fn stream(
    src: &Sources,
    items: &[Item],
    offsets: &[u64],
    file: &File,
    path: &Path,
    crcs: &mut [Vec<(u64, u64, u32)>],
    w: &mut Written,
) -> Result<(), FerryError> {
    let places: Vec<Option<At>> = items.iter().map(|it| locate(&it.copy)).collect();
    let r = stream_located(src, items, offsets, &places, file, path, crcs, w);
    unpin(src, items, &places);
    r
}

/// Releases the device pins [`locate`] took.
fn unpin(src: &Sources, items: &[Item], places: &[Option<At>]) {
    for (it, p) in items.iter().zip(places) {
        if let (Some(At::Device { dev, .. }), Some(gpu)) = (p, &src.gpu) {
            let _ = gpu.post(GpuCmd::Unpin {
                copy: it.copy.clone(),
                dev: *dev,
            });
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn stream_located(
    src: &Sources,
    items: &[Item],
    offsets: &[u64],
    places: &[Option<At>],
    file: &File,
    path: &Path,
    crcs: &mut [Vec<(u64, u64, u32)>],
    w: &mut Written,
) -> Result<(), FerryError> {
    let missing = |k: usize| FerryError::Checkpoint {
        path: path.display().to_string(),
        msg: format!(
            "tile {} of collection #{} has no current copy on this rank",
            items[k].index, items[k].coll
        ),
    };
    // Device pieces: issue them all; the bounce pool serves them in order.
    let chunk = src.bounce.as_ref().map_or(4 << 20, |b| b.chunk());
    let pieces = device_pieces(items, offsets, places, chunk);
    let (tx, rx) = crossbeam::channel::unbounded::<(usize, Result<Slot, DeviceError>)>();
    if !pieces.is_empty() {
        let (Some(pool), Some(gpu)) = (&src.bounce, &src.gpu) else {
            return Err(missing(pieces[0].segs[0].item));
        };
        let pieces = Arc::new(pieces_meta(&pieces, places));
        for p in 0..pieces.len() {
            let (tx, gpu, pieces) = (tx.clone(), gpu.clone(), pieces.clone());
            pool.acquire(Box::new(move |mut slot: Slot| {
                let piece = &pieces[p];
                slot.truncate(piece.len);
                // SAFETY: the slot is ours and `piece.len` bytes long; padding between tiles is
                // zeroed so that the file's bytes do not depend on the pool's history.
                unsafe { std::ptr::write_bytes(slot.ptr(), 0, piece.len) };
                let left = Arc::new(std::sync::atomic::AtomicUsize::new(piece.copies.len()));
                let failed = Arc::new(std::sync::Mutex::new(None));
                let slot = Arc::new(std::sync::Mutex::new(Some(slot)));
                let base = slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|s| s.ptr());
                let base = base.expect("slot present");
                for &(dev, dev_at, slot_at, len) in &piece.copies {
                    let stream = Stream::Comm(p % ferry_device::COMM_STREAMS);
                    // SAFETY (of the add): inside the slot.
                    let dst = Mem::Host(unsafe { base.add(slot_at) });
                    let op = CopyOp::plain(dev, stream, Mem::Pool(dev_at), dst, len, TrafficPath::DeviceToHost);
                    let (left, failed, slot, done) = (left.clone(), failed.clone(), slot.clone(), tx.clone());
                    let then = Box::new(move |r: Result<(), DeviceError>| {
                        if let Err(e) = r {
                            failed.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                        }
                        if left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
                            let s = slot.lock().unwrap_or_else(|e| e.into_inner()).take().expect("once");
                            let r = match failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
                                Some(e) => Err(e),
                                None => Ok(s),
                            };
                            let _ = done.send((p, r));
                        }
                    });
                    if let Err(e) = gpu.post(GpuCmd::Copy { op, then }) {
                        let _ = tx.send((p, Err(e)));
                        return;
                    }
                }
            }));
        }
    }
    drop(tx);
    // Meanwhile: host-resident tiles straight from their buffers, disk-only ones via scratch.
    let mut scratch: Vec<u8> = Vec::new();
    for (k, place) in places.iter().enumerate() {
        let len = items[k].copy.bytes();
        match place {
            Some(At::Host(buf)) => {
                // SAFETY: nothing runs (the checkpoint follows a wait); the Arc keeps it alive.
                let bytes = unsafe { buf.bytes() };
                file.write_all_at(bytes, offsets[k])
                    .map_err(|e| io_err(path, "writing", e))?;
                crcs[k].push((0, len as u64, crc32fast::hash(bytes)));
                w.from_host += len as u64;
            }
            Some(At::Disk(slot)) => {
                let disk = src.disk.as_ref().ok_or_else(|| missing(k))?;
                let step = len.min(chunk);
                if scratch.len() < step {
                    scratch.resize(step, 0);
                    w.scratch = w.scratch.max(step as u64);
                }
                let mut at = 0;
                while at < len {
                    let n = step.min(len - at);
                    let part = ferry_device::pool::Block {
                        offset: slot.offset + at as u64,
                        len: n as u64,
                    };
                    disk.read(part, &mut scratch[..n])?;
                    file.write_all_at(&scratch[..n], offsets[k] + at as u64)
                        .map_err(|e| io_err(path, "writing", e))?;
                    crcs[k].push((at as u64, n as u64, crc32fast::hash(&scratch[..n])));
                    at += n;
                }
                w.from_disk += len as u64;
            }
            Some(At::Device { .. }) => {}
            None => return Err(missing(k)),
        }
    }
    // The device pieces, as their copies land.
    for (p, r) in rx {
        let slot = r.map_err(FerryError::Device)?;
        let piece = &pieces[p];
        // SAFETY: the copies into the slot have completed.
        let bytes = unsafe { std::slice::from_raw_parts(slot.ptr(), piece.len) };
        file.write_all_at(bytes, piece.file_at)
            .map_err(|e| io_err(path, "writing", e))?;
        for s in &piece.segs {
            let part = &bytes[s.slot_at..s.slot_at + s.len];
            crcs[s.item].push((s.at, s.len as u64, crc32fast::hash(part)));
            w.from_device += s.len as u64;
        }
        w.device_copies += piece.segs.len() as u64;
        w.pieces += 1;
        drop(slot);
    }
    Ok(())
}

/// Cuts the device-resident tiles into pieces of at most `chunk` bytes: a large tile in chunks,
/// consecutive small ones batched into one piece.
fn device_pieces(items: &[Item], offsets: &[u64], places: &[Option<At>], chunk: usize) -> Vec<Piece> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut open: Option<Piece> = None;
    for (k, place) in places.iter().enumerate() {
        if !matches!(place, Some(At::Device { .. })) {
            if let Some(p) = open.take() {
                pieces.push(p);
            }
            continue;
        }
        let len = items[k].copy.bytes();
        if len > chunk {
            if let Some(p) = open.take() {
                pieces.push(p);
            }
            let mut at = 0;
            while at < len {
                let n = chunk.min(len - at);
                pieces.push(Piece {
                    file_at: offsets[k] + at as u64,
                    len: n,
                    segs: vec![Seg {
                        item: k,
                        at: at as u64,
                        slot_at: 0,
                        len: n,
                    }],
                });
                at += n;
            }
            continue;
        }
        // Batch: the piece spans the file from its first tile to this tile's end.
        if let Some(p) = &open {
            if (offsets[k] + len as u64 - p.file_at) as usize > chunk {
                pieces.push(open.take().expect("checked"));
            }
        }
        let p = open.get_or_insert_with(|| Piece {
            file_at: offsets[k],
            len: 0,
            segs: Vec::new(),
        });
        let slot_at = (offsets[k] - p.file_at) as usize;
        p.segs.push(Seg {
            item: k,
            at: 0,
            slot_at,
            len,
        });
        p.len = slot_at + len;
    }
    if let Some(p) = open {
        pieces.push(p);
    }
    pieces
}

/// What the bounce-buffer callbacks need of each piece: its length and its device copies
/// `(device, pool offset, offset in the buffer, bytes)`.
struct PieceCopies {
    len: usize,
    copies: Vec<(usize, u64, usize, usize)>,
}

fn pieces_meta(pieces: &[Piece], places: &[Option<At>]) -> Vec<PieceCopies> {
    pieces
        .iter()
        .map(|p| PieceCopies {
            len: p.len,
            copies: p
                .segs
                .iter()
                .map(|s| match &places[s.item] {
                    Some(At::Device { dev, offset }) => (*dev, offset + s.at, s.slot_at, s.len),
                    _ => unreachable!("pieces hold device-resident tiles only"),
                })
                .collect(),
        })
        .collect()
}
