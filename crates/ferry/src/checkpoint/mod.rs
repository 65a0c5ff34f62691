//! Checkpoint and restart of distributed collections, device-resident data included.
//!
//! [`crate::Runtime::checkpoint`] is a collective point of the task flow: it waits until every
//! task inserted before it has run (the state of the sequence at that point), then each rank
//! streams the tiles it owns into its own file (`write`: host data straight from its buffers,
//! device data through the bounded bounce pool, spilled data from the disk tier), and rank 0
//! writes a manifest that names every rank file with its length and footer checksum (`format`).
//! Files are written under temporary names, synced and renamed, so a checkpoint directory holds
//! either a complete file or none.
//!
//! [`crate::Runtime::restore`] reads the manifest and every rank file's footer, so any rank count
//! can restore any checkpoint: each rank finds the tiles it owns now wherever they were written
//! (`read`). Every tile is checked against its CRC-32 on every rank, and the ranks agree that
//! all succeeded, before anything changes; then the data enters the task flow as one write task
//! per tile on its owner, so restored tiles are ordinary new versions (staged to devices by the
//! tasks that read them next).
//!
//! Device random-number-generator states are tiles like any other: a task keeps its generator's
//! 32-byte state (`ferry_kernels::rng::PhiloxState`) in a tile it reads and writes, on the device
//! when it runs there, and the checkpoint takes it from there through the bounce pool — batched
//! with its neighbours into one buffer and one write, never one copy per state.

mod format;
mod read;
mod write;

use crate::graph::{Task, TaskClass};
use crate::runtime::Runtime;
use ferry_base::error::{FerryError, Result};
use ferry_memory::data::collection::CollectionDesc;
use ferry_memory::data::{Access, AccessMode, Collection};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A collection of any element type, for [`Runtime::checkpoint`] and [`Runtime::restore`]:
/// `CollectionRef::from(&u)`.
#[derive(Debug, Clone)]
pub struct CollectionRef {
    desc: Arc<CollectionDesc>,
}

impl<T> From<&Collection<T>> for CollectionRef {
    fn from(c: &Collection<T>) -> CollectionRef {
        CollectionRef { desc: c.desc.clone() }
    }
}

impl CollectionRef {
    fn meta(&self) -> format::CollMeta {
        let d = &self.desc;
        format::CollMeta {
            name: d.name.clone(),
            m: d.m as u64,
            n: d.n as u64,
            mb: d.mb as u64,
            nb: d.nb as u64,
            elem_size: d.elem_size as u64,
            elem_name: d.elem_name.to_string(),
            dist: format!("{:?}", d.dist),
        }
    }
}

/// What one rank's part of a checkpoint took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CheckpointReport {
    /// Tiles this rank wrote.
    pub tiles: usize,
    /// Bytes of the rank file (tiles, padding, footer).
    pub file_bytes: u64,
    /// Tile bytes taken from host buffers, from devices (through the bounce pool), from the
    /// disk tier.
    pub from_host: u64,
    /// See `from_host`.
    pub from_device: u64,
    /// See `from_host`.
    pub from_disk: u64,
    /// Device→host copies issued, and the bounce-buffer writes they were batched into.
    pub device_copies: u64,
    /// See `device_copies`.
    pub device_pieces: u64,
    /// Host memory the checkpoint allocated for data beyond the bounce pool (a buffer of at most
    /// one bounce chunk, for tiles on the disk tier only).
    pub scratch_bytes: u64,
    /// Bytes of the bounce pool (allocated at start-up) that device data went through.
    pub bounce_bytes: u64,
    /// Seconds from the end of the preceding wait until every rank's file and the manifest were
    /// in place.
    pub seconds: f64,
}

impl CheckpointReport {
    /// Tile bytes written by this rank per second, GB/s (10⁹ B/s).
    pub fn gbps(&self) -> f64 {
        let b = self.from_host + self.from_device + self.from_disk;
        if self.seconds > 0.0 {
            b as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

/// Every rank's payload of an agreed step (`CommHandle::agree`), or a checkpoint error naming
/// the first rank where `what` failed.
fn agreed(all: ferry_engine::Agreed, what: &str) -> Result<Vec<Vec<u8>>> {
    all.map_err(|(r, msg)| FerryError::Checkpoint {
        path: format!("rank {r}"),
        msg: format!("{what} failed: {msg}"),
    })
}

impl Runtime {
    /// Writes `collections` to the checkpoint directory `dir` (created if needed; on a file
    /// system every rank sees), tagged with `step`. Collective: every rank calls it at the same
    /// point of the sequence. It first waits for every task inserted so far (the checkpoint is
    /// the state at that point), then each rank streams the tiles it owns into
    /// `dir/rank-{r}.ckpt` and rank 0 writes `dir/manifest.ckpt`. Device-resident tiles go
    /// through the bounce pool (`FERRY_BOUNCE_BYTES`): the extra host memory is the pool's,
    /// allocated at start-up, plus at most one bounce chunk for tiles on the disk tier.
    ///
    /// # Errors
    /// The error of the wait; [`FerryError::InvalidArgument`] for a collection named twice or one
    /// of another runtime;
    /// [`FerryError::Checkpoint`] when a file cannot be written (on every rank, naming the rank
    /// that failed). A failed checkpoint leaves no manifest: the directory is not restorable.
    pub fn checkpoint(&self, dir: &Path, step: u64, collections: &[CollectionRef]) -> Result<CheckpointReport> {
        self.refuse_in_trace("checkpoint")?;
        self.wait()?;
        let t0 = Instant::now();
        Self::check_names("checkpoint", collections)?;
        let rank = self.rank();
        // Failures from here on are this rank's alone (an error that reached it since the wait,
        // a file it cannot write): every rank still takes part in the allgather below, which
        // tells all of them.
        let items = self.owned_items(collections);
        let t = &self.dispatch.transport;
        let src = self.sources();
        let metas: Vec<format::CollMeta> = collections.iter().map(CollectionRef::meta).collect();
        let path = dir.join(read::rank_file(rank as u32));
        let mine = match &items {
            Ok(items) => std::fs::create_dir_all(dir)
                .map_err(|e| FerryError::Checkpoint {
                    path: dir.display().to_string(),
                    msg: format!("cannot create the directory: {e}"),
                })
                .and_then(|()| {
                    write::write_file(
                        &src,
                        items,
                        (step, rank as u32, self.size() as u32),
                        metas.clone(),
                        &path,
                    )
                }),
            Err(e) => Err(e.duplicate()),
        };
        let payload = match (&items, &mine) {
            (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
            (Ok(_), Ok((len, crc, _))) => Ok([len.to_le_bytes().as_slice(), &crc.to_le_bytes()].concat()),
        };
        let all = self.engine.agree(&payload)?;
        // This rank's own error first (an invalid argument stays one); then another rank's.
        let items = items?;
        let (file_bytes, _, written) = mine?;
        let all = agreed(all, "writing the rank files")?;
        // Rank 0 ties the files together; the others learn whether it did.
        let manifest = if rank == 0 {
            let files = all
                .iter()
                .enumerate()
                .map(|(r, b)| format::RankFile {
                    name: read::rank_file(r as u32),
                    len: u64::from_le_bytes(b[0..8].try_into().unwrap_or([0; 8])),
                    footer_crc: u32::from_le_bytes(b[8..12].try_into().unwrap_or([0; 4])),
                })
                .collect();
            let m = format::Manifest {
                step,
                ranks: self.size() as u32,
                colls: metas,
                files,
            };
            write_manifest(dir, &m).map(|()| Vec::new())
        } else {
            Ok(Vec::new())
        };
        agreed(self.engine.agree(&manifest)?, "writing the manifest")?;
        Ok(CheckpointReport {
            tiles: items.len(),
            file_bytes,
            from_host: written.from_host,
            from_device: written.from_device,
            from_disk: written.from_disk,
            device_copies: written.device_copies,
            device_pieces: written.pieces,
            scratch_bytes: written.scratch,
            bounce_bytes: t.bounce().map_or(0, |b| (b.slots() * b.chunk()) as u64),
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Refuses to write two collections of one name: a checkpoint keys its collections by name,
    /// so the second could not be told from the first when restoring. Depends on the list alone
    /// (every rank refuses it alike).
    fn check_names(op: &str, collections: &[CollectionRef]) -> Result<()> {
        let mut names: Vec<&str> = collections.iter().map(|c| c.desc.name.as_str()).collect();
        names.sort_unstable();
        if names.windows(2).any(|w| w[0] == w[1]) {
            return Err(FerryError::InvalidArgument(format!(
                "{op}: a collection is named twice in {names:?}"
            )));
        }
        Ok(())
    }

    /// Refuses a restore into a collection listed twice (its tiles would get two writers, the
    /// second finding its data taken) or into one of another runtime. Depends on the list and
    /// the collections registered alone — not on whether this rank's run has failed since the
    /// last `wait`, which the collective steps that follow report on every rank — so every rank
    /// refuses it alike, before any of them.
    fn check_restorable(&self, collections: &[CollectionRef]) -> Result<()> {
        let mut ids: Vec<u32> = collections.iter().map(|c| c.desc.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            let names: Vec<&str> = collections.iter().map(|c| c.desc.name.as_str()).collect();
            return Err(FerryError::InvalidArgument(format!(
                "restore: a collection is listed twice in {names:?}"
            )));
        }
        let ins = self.inserter_unchecked();
        collections.iter().try_for_each(|c| ins.check_own(&c.desc))
    }

    /// This rank's tiles of `collections`, in order.
    fn owned_items(&self, collections: &[CollectionRef]) -> Result<Vec<write::Item>> {
        let rank = self.rank();
        let ins = self.inserter()?;
        let mut items = Vec::new();
        for (c, coll) in collections.iter().enumerate() {
            let d = &coll.desc;
            ins.check_own(d)?;
            for idx in 0..d.mt * d.nt {
                let (i, j) = d.coords(idx);
                if d.owner(i, j) != rank {
                    continue;
                }
                if let Some(copy) = ins.local_copy((d.id, idx as u32)) {
                    items.push(write::Item {
                        coll: c as u32,
                        index: idx as u32,
                        copy,
                    });
                }
            }
        }
        Ok(items)
    }

    fn sources(&self) -> write::Sources {
        let t = &self.dispatch.transport;
        write::Sources {
            gpu: self.dispatch.gpu.clone(),
            bounce: t.bounce().cloned(),
            disk: t.residency.tier().and_then(|h| h.disk.clone()),
        }
    }

    /// The most bytes [`Runtime::checkpoint_into`] needs for this rank's tiles of `collections`.
    pub fn checkpoint_size(&self, collections: &[CollectionRef]) -> usize {
        let rank = self.rank();
        let mut sizes = Vec::new();
        for (c, coll) in collections.iter().enumerate() {
            let d = &coll.desc;
            for idx in 0..d.mt * d.nt {
                let (i, j) = d.coords(idx);
                if d.owner(i, j) == rank {
                    sizes.push((c as u32, idx as u32, d.tile_bytes(i, j) as u64));
                }
            }
        }
        let metas = collections.iter().map(CollectionRef::meta).collect();
        write::size_bound(&sizes, (u64::MAX, rank as u32, self.size() as u32), metas)
    }

    /// Serializes this rank's tiles of `collections` into the caller's `buf` (for messaging),
    /// in the format of a rank file, and returns the bytes used. Waits for the tasks inserted so
    /// far; not collective. Device-resident tiles are copied straight to their place in `buf`:
    /// no bounce buffer and no host mirror, so the extra host memory is `buf` itself.
    ///
    /// # Errors
    /// The error of the wait; [`FerryError::InvalidArgument`] when `buf` is smaller than
    /// [`Runtime::checkpoint_size`], a collection belongs to another runtime or two share a
    /// name; a device or disk-tier error.
    pub fn checkpoint_into(&self, step: u64, collections: &[CollectionRef], buf: &mut [u8]) -> Result<usize> {
        self.refuse_in_trace("checkpoint_into")?;
        self.wait()?;
        Self::check_names("checkpoint", collections)?;
        let items = self.owned_items(collections)?;
        let metas = collections.iter().map(CollectionRef::meta).collect();
        let header = (step, self.rank() as u32, self.size() as u32);
        write::write_buffer(&self.sources(), &items, header, metas, buf).map(|(n, _)| n)
    }

    /// Restores `collections` from what [`Runtime::checkpoint_into`] wrote on this rank (each
    /// rank passes its own bytes, holding at least the tiles it owns now) and returns the step.
    /// Collective, and checked like [`Runtime::restore`]: nothing changes unless every rank's
    /// bytes are intact and match.
    ///
    /// # Errors
    /// [`FerryError::Checkpoint`] for truncated, corrupt or mismatching bytes, on every rank;
    /// [`FerryError::InvalidArgument`] for a collection listed twice or one of another runtime.
    pub fn restore_from(&self, buf: &[u8], collections: &[CollectionRef]) -> Result<u64> {
        self.refuse_in_trace("restore_from")?;
        self.check_restorable(collections)?;
        self.wait()?;
        let loaded = read::Opened::from_buffer(buf)
            .and_then(|ck| load_tiles(&ck, collections, self.rank()))
            .map_err(|e| e.to_string());
        self.install(loaded, Path::new("<buffer>"), collections)
    }

    /// The step a checkpoint directory was written at (from its manifest alone), e.g. to know
    /// which buffers of a double-buffered scheme to restore.
    ///
    /// # Errors
    /// [`FerryError::Checkpoint`]: no manifest, or a corrupt one.
    pub fn checkpoint_step(dir: &Path) -> Result<u64> {
        let path = dir.join(read::MANIFEST);
        let bytes = std::fs::read(&path).map_err(|e| FerryError::Checkpoint {
            path: path.display().to_string(),
            msg: format!("cannot read the manifest: {e}"),
        })?;
        format::decode_manifest(&bytes)
            .map(|m| m.step)
            .map_err(|msg| FerryError::Checkpoint {
                path: path.display().to_string(),
                msg,
            })
    }

    /// Restores `collections` from the checkpoint in `dir` and returns its step. Collective.
    /// Waits for the tasks inserted so far, reads and checks everything (manifest, every rank
    /// file's footer, the shape of each collection against the program's, each tile this rank
    /// owns against its checksum) and only then, when every rank succeeded, gives each tile its
    /// checkpointed contents as a new version (a write task on its owner). The checkpoint may
    /// come from a different rank count or distribution: each rank reads its tiles wherever
    /// they were written.
    ///
    /// # Errors
    /// [`FerryError::Checkpoint`] naming the file and what is wrong (missing manifest or rank
    /// file, truncated, a flipped byte, another format version, a file of another checkpoint, a
    /// collection missing or of another shape); on every rank, and nothing is changed.
    /// [`FerryError::InvalidArgument`] for a collection listed twice or one of another runtime.
    pub fn restore(&self, dir: &Path, collections: &[CollectionRef]) -> Result<u64> {
        self.refuse_in_trace("restore")?;
        self.check_restorable(collections)?;
        self.wait()?;
        let loaded = read::Opened::open(dir)
            .and_then(|ck| load_tiles(&ck, collections, self.rank()))
            .map_err(|e| e.to_string());
        self.install(loaded, dir, collections)
    }

    /// Once every rank has its tiles' bytes: one write task per tile on its owner.
    fn install(
        &self,
        loaded: std::result::Result<(u64, TileData), String>,
        dir: &Path,
        collections: &[CollectionRef],
    ) -> Result<u64> {
        let flag = loaded.as_ref().map(|_| Vec::new()).map_err(Clone::clone);
        agreed(self.engine.agree(&flag)?, "reading the checkpoint")?;
        let (step, data) = loaded.map_err(|msg| FerryError::Checkpoint {
            path: dir.display().to_string(),
            msg,
        })?;
        let data = Arc::new(Mutex::new(data));
        let sink = data.clone();
        let class = TaskClass::new("ferry.restore", move |ctx| {
            let key = (ctx.args()[0] as u32, ctx.args()[1] as u32);
            let bytes = sink
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key)
                .ok_or("restored tile data missing")?;
            let t = ctx.raw_tile(0)?;
            if t.bytes != bytes.len() {
                return Err(format!("tile of {} bytes, checkpoint data of {}", t.bytes, bytes.len()).into());
            }
            // SAFETY: the task's own writable tile of `t.bytes` bytes.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), t.ptr, t.bytes) };
            Ok(())
        });
        for coll in collections {
            let d = &coll.desc;
            for idx in 0..d.mt * d.nt {
                let (i, j) = d.coords(idx);
                let access = Access {
                    coll: d.id,
                    runtime: d.runtime,
                    i,
                    j,
                    mode: AccessMode::Write,
                };
                let args = [i64::from(d.id), idx as i64];
                self.submit(Task::new(&class, std::slice::from_ref(&access)).args(&args))?;
            }
        }
        self.wait()?;
        Ok(step)
    }
}

/// Reads and checks everything this rank needs: the step and its owned tiles' bytes by
/// (collection id, tile index).
/// Fuzz entry: decodes a manifest.
pub(crate) fn fuzz_manifest(bytes: &[u8]) -> bool {
    format::decode_manifest(bytes).is_ok()
}

/// Fuzz entry: opens rank-file bytes and reads every tile they list, checking its CRC.
pub(crate) fn fuzz_rank_file(bytes: &[u8]) -> bool {
    read::Opened::from_buffer(bytes).is_ok_and(|ck| ck.verify_all().is_ok())
}

/// Fuzz seeds: a manifest and a rank file of two small collections, each behind its selector
/// byte (0: manifest, 1: rank file).
pub(crate) fn fuzz_seeds() -> Vec<(String, Vec<u8>)> {
    let coll = |name: &str, n: u64, nb: u64| format::CollMeta {
        name: name.into(),
        m: n,
        n,
        mb: nb,
        nb,
        elem_size: 8,
        elem_name: "f64".into(),
        dist: "BlockCyclic2d(1x1)".into(),
    };
    let colls = vec![coll("u", 8, 4), coll("rng", 2, 1)];
    // Tile data: four 4×4 f64 tiles of "u", then four 1×1 of "rng".
    let mut tiles = Vec::new();
    let mut data: Vec<u8> = Vec::new();
    let mut at = format::DATA_START;
    for (c, count, len) in [(0u32, 4u32, 128u64), (1, 4, 8)] {
        for index in 0..count {
            let bytes: Vec<u8> = (0..len).map(|k| (k as u32 * 7 + index * 13 + c) as u8).collect();
            let off = at;
            at = (at + len).div_ceil(format::TILE_ALIGN) * format::TILE_ALIGN;
            tiles.push(format::TileEntry {
                coll: c,
                index,
                offset: off,
                len,
                crc: crc32fast::hash(&bytes),
            });
            data.resize((off - format::DATA_START) as usize, 0);
            data.extend_from_slice(&bytes);
        }
    }
    data.resize((at - format::DATA_START) as usize, 0);
    let footer = format::Footer {
        step: 7,
        rank: 0,
        ranks: 1,
        colls: colls.clone(),
        tiles,
    };
    let fb = postcard::to_allocvec(&footer).unwrap_or_default();
    let mut file = vec![0u8; format::DATA_START as usize];
    file[..format::PREAMBLE_BYTES].copy_from_slice(&format::preamble(at, &fb));
    file.extend_from_slice(&data);
    file.extend_from_slice(&fb);
    let manifest = format::Manifest {
        step: 7,
        ranks: 1,
        colls,
        files: vec![format::RankFile {
            name: read::rank_file(0),
            len: file.len() as u64,
            footer_crc: crc32fast::hash(&fb),
        }],
    };
    let m = format::encode_manifest(&manifest).unwrap_or_default();
    vec![
        ("manifest".into(), [&[0u8][..], &m].concat()),
        ("rank-file".into(), [&[1u8][..], &file].concat()),
    ]
}

/// Tile bytes by (collection id, tile index).
type TileData = HashMap<(u32, u32), Vec<u8>>;

fn load_tiles(ck: &read::Opened<'_>, collections: &[CollectionRef], rank: i32) -> Result<(u64, TileData)> {
    let mut data = HashMap::new();
    for coll in collections {
        ck.check_collection(&coll.meta())?;
        let d = &coll.desc;
        for idx in 0..d.mt * d.nt {
            let (i, j) = d.coords(idx);
            if d.owner(i, j) != rank {
                continue;
            }
            let bytes = ck.read_tile(&d.name, idx as u32, d.tile_bytes(i, j))?;
            data.insert((d.id, idx as u32), bytes);
        }
    }
    Ok((ck.manifest.step, data))
}

fn write_manifest(dir: &Path, m: &format::Manifest) -> std::result::Result<(), String> {
    let bytes = format::encode_manifest(m)?;
    let path = dir.join(read::MANIFEST);
    let tmp = dir.join(format!("{}.tmp", read::MANIFEST));
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        // The renames are durable once the directory is.
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn fuzz_seeds_are_accepted() {
        for (name, bytes) in super::fuzz_seeds() {
            let ok = match bytes[0] {
                0 => super::fuzz_manifest(&bytes[1..]),
                _ => super::fuzz_rank_file(&bytes[1..]),
            };
            assert!(ok, "seed {name} refused");
        }
    }
}
