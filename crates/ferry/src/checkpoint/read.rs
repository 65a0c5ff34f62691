//! Reading a checkpoint back: the manifest, every rank file's footer (so that any rank count can
//! restore any checkpoint: each rank finds its tiles wherever they were written), and the tiles
//! this rank owns now, each checked against its CRC before anything is changed.

use super::format::{self, CollMeta, Footer, Manifest, PREAMBLE_BYTES};
use ferry_base::error::FerryError;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The name of a rank's file in a checkpoint directory.
pub(crate) fn rank_file(rank: u32) -> String {
    format!("rank-{rank}.ckpt")
}

/// The manifest's name.
pub(crate) const MANIFEST: &str = "manifest.ckpt";

fn err(path: &Path, msg: impl Into<String>) -> FerryError {
    FerryError::Checkpoint {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

/// Where a rank file's bytes are: a file, or a caller's buffer.
pub(crate) enum Bytes<'a> {
    File(File),
    Buffer(&'a [u8]),
}

impl Bytes<'_> {
    fn read_exact_at(&self, out: &mut [u8], at: u64) -> std::io::Result<()> {
        match self {
            Bytes::File(f) => f.read_exact_at(out, at),
            Bytes::Buffer(b) => {
                let src = usize::try_from(at)
                    .ok()
                    .and_then(|a| b.get(a..a.checked_add(out.len())?))
                    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
                out.copy_from_slice(src);
                Ok(())
            }
        }
    }
}

/// An opened checkpoint: its manifest, and per rank file its bytes and its footer.
pub(crate) struct Opened<'a> {
    pub(crate) dir: PathBuf,
    pub(crate) manifest: Manifest,
    files: Vec<(Bytes<'a>, Footer)>,
    /// (collection name, tile index) → (file, entry index).
    index: HashMap<(String, u32), (usize, usize)>,
}

impl<'a> Opened<'a> {
    /// A rank file's bytes in a caller's buffer (what `Runtime::checkpoint_into` wrote), as a
    /// checkpoint of its own: its footer stands for the manifest.
    ///
    /// # Errors
    /// [`FerryError::Checkpoint`]: truncated, corrupt, another format version.
    pub(crate) fn from_buffer(buf: &'a [u8]) -> Result<Opened<'a>, FerryError> {
        let name = Path::new("<buffer>");
        let (footer, _) = read_footer(&Bytes::Buffer(buf), buf.len() as u64, name)?;
        let manifest = Manifest {
            step: footer.step,
            ranks: 1,
            colls: footer.colls.clone(),
            files: Vec::new(),
        };
        let mut index = HashMap::new();
        for (e, t) in footer.tiles.iter().enumerate() {
            index.insert((footer.colls[t.coll as usize].name.clone(), t.index), (0, e));
        }
        Ok(Opened {
            dir: name.to_path_buf(),
            manifest,
            files: vec![(Bytes::Buffer(buf), footer)],
            index,
        })
    }

    /// Opens and checks the manifest and every rank file's preamble and footer.
    ///
    /// # Errors
    /// [`FerryError::Checkpoint`] naming the file: missing, truncated, corrupt, another format
    /// version, or a rank file that does not belong to this manifest.
    pub(crate) fn open(dir: &Path) -> Result<Opened<'static>, FerryError> {
        let mpath = dir.join(MANIFEST);
        let bytes = std::fs::read(&mpath).map_err(|e| err(&mpath, format!("cannot read the manifest: {e}")))?;
        let manifest = format::decode_manifest(&bytes).map_err(|m| err(&mpath, m))?;
        if manifest.files.len() != manifest.ranks as usize {
            return Err(err(&mpath, "corrupt: the rank count and the file list disagree"));
        }
        let mut files = Vec::with_capacity(manifest.files.len());
        let mut index = HashMap::new();
        for (r, rf) in manifest.files.iter().enumerate() {
            if rf.name.contains('/') || rf.name.contains("..") {
                return Err(err(&mpath, format!("corrupt: file name {:?}", rf.name)));
            }
            let path = dir.join(&rf.name);
            let file = File::open(&path).map_err(|e| err(&path, format!("rank {r}'s file is missing: {e}")))?;
            let len = file.metadata().map_err(|e| err(&path, e.to_string()))?.len();
            if len != rf.len {
                return Err(err(
                    &path,
                    format!("truncated or replaced: {len} bytes, the manifest says {}", rf.len),
                ));
            }
            let file = Bytes::File(file);
            let (footer, crc) = read_footer(&file, len, &path)?;
            if crc != rf.footer_crc {
                return Err(err(
                    &path,
                    "belongs to another checkpoint (footer differs from the manifest's)",
                ));
            }
            if footer.rank as usize != r || footer.step != manifest.step || footer.ranks != manifest.ranks {
                return Err(err(
                    &path,
                    "belongs to another checkpoint (rank, step or rank count differ)",
                ));
            }
            for (e, t) in footer.tiles.iter().enumerate() {
                let name = footer.colls[t.coll as usize].name.clone();
                index.insert((name, t.index), (r, e));
            }
            files.push((file, footer));
        }
        Ok(Opened {
            dir: dir.to_path_buf(),
            manifest,
            files,
            index,
        })
    }

    /// Checks that the checkpoint holds `want` with the same shape and element type.
    ///
    /// # Errors
    /// [`FerryError::Checkpoint`] describing both shapes, or the missing collection.
    pub(crate) fn check_collection(&self, want: &CollMeta) -> Result<(), FerryError> {
        let mpath = self.dir.join(MANIFEST);
        let Some(have) = self.manifest.colls.iter().find(|c| c.name == want.name) else {
            let names: Vec<&str> = self.manifest.colls.iter().map(|c| c.name.as_str()).collect();
            return Err(err(
                &mpath,
                format!("has no collection `{}` (it has {names:?})", want.name),
            ));
        };
        if !have.compatible(want) {
            return Err(err(
                &mpath,
                format!(
                    "collection `{}` does not match the program: checkpoint {}×{} in {}×{} tiles of {} ({} bytes), program {}×{} in {}×{} tiles of {} ({} bytes)",
                    want.name,
                    have.m, have.n, have.mb, have.nb, have.elem_name, have.elem_size,
                    want.m, want.n, want.mb, want.nb, want.elem_name, want.elem_size
                ),
            ));
        }
        Ok(())
    }

    /// Reads every tile every file lists and checks its CRC (the fuzz target's walk).
    ///
    /// # Errors
    /// The first tile that cannot be read or does not match its checksum.
    pub(crate) fn verify_all(&self) -> Result<(), FerryError> {
        for (_, footer) in &self.files {
            for t in &footer.tiles {
                let name = &footer.colls[t.coll as usize].name;
                let len = usize::try_from(t.len).map_err(|_| err(&self.dir, "tile length overflows"))?;
                self.read_tile(name, t.index, len)?;
            }
        }
        Ok(())
    }

    /// Reads tile `index` of collection `name` (`len` bytes) and checks its CRC.
    ///
    /// # Errors
    /// [`FerryError::Checkpoint`]: the tile is missing, has another size, cannot be read, or its
    /// bytes do not match their checksum.
    pub(crate) fn read_tile(&self, name: &str, index: u32, len: usize) -> Result<Vec<u8>, FerryError> {
        let mpath = self.dir.join(MANIFEST);
        let &(f, e) = self
            .index
            .get(&(name.to_string(), index))
            .ok_or_else(|| err(&mpath, format!("tile {index} of `{name}` is in no rank file")))?;
        let (file, footer) = &self.files[f];
        let path = if matches!(file, Bytes::Buffer(_)) {
            self.dir.clone()
        } else {
            self.dir.join(rank_file(f as u32))
        };
        let t = &footer.tiles[e];
        if t.len as usize != len {
            return Err(err(
                &path,
                format!("tile {index} of `{name}` has {} bytes, the program's has {len}", t.len),
            ));
        }
        let mut data = vec![0u8; len];
        file.read_exact_at(&mut data, t.offset)
            .map_err(|e| err(&path, format!("reading tile {index} of `{name}`: {e}")))?;
        if crc32fast::hash(&data) != t.crc {
            return Err(err(
                &path,
                format!("tile {index} of `{name}` is corrupt (checksum mismatch)"),
            ));
        }
        Ok(data)
    }
}

/// Reads and checks the preamble and footer of a rank file of `len` bytes; returns the footer
/// and its CRC.
fn read_footer(b: &Bytes<'_>, len: u64, path: &Path) -> Result<(Footer, u32), FerryError> {
    let mut pre = [0u8; PREAMBLE_BYTES];
    b.read_exact_at(&mut pre, 0)
        .map_err(|e| err(path, format!("truncated: {e}")))?;
    let (off, flen, crc) = format::read_preamble(&pre, len).map_err(|m| err(path, m))?;
    let mut fb = vec![0u8; flen as usize];
    b.read_exact_at(&mut fb, off)
        .map_err(|e| err(path, format!("truncated: {e}")))?;
    let footer = format::decode_footer(&fb, crc, off).map_err(|m| err(path, m))?;
    Ok((footer, crc))
}
