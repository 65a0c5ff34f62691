//! How a task, a kernel or a transfer uses a tile: the access modes every layer speaks.

/// How a task uses a tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessMode {
    /// Reads the newest version.
    Read,
    /// Produces a new version without reading the old one.
    Write,
    /// Reads the newest version and produces the next.
    ReadWrite,
    /// Reads and writes a part of the tile that no other task of its *group* touches, and
    /// leaves the rest as it was.
    ///
    /// A group is a run of consecutive `ReadWritePart` accesses to one tile in insertion order
    /// (any other access to the tile, a transfer of it included, ends the run). Its members
    /// depend on what came before the group, as a writer does, and not on each other; whatever
    /// comes after depends on every member. So the members of a group may run at the same time
    /// — e.g. a stencil step's interior and its halo ring, on two streams of one GPU.
    ///
    /// Members run concurrently only where that is safe without aliasing: GPU tasks on one
    /// device (ferry binds a group in flight to one device of the rank). A member that runs on
    /// the host (a CPU task, or any task without devices) runs after the members before it, and
    /// those after it wait for it; on emulated devices the members' bodies run one at a time.
    /// Members on different ranks are correct but serialised by the transfer between them.
    ///
    /// After: OmpSs' `concurrent` clause and StarPU's `STARPU_COMMUTE` relax the order between
    /// accesses in the same way; here the accesses must also be disjoint, which the caller
    /// guarantees (ferry does not check it).
    ReadWritePart,
}

impl AccessMode {
    /// Whether the task reads the tile's previous contents.
    pub fn reads(self) -> bool {
        !matches!(self, AccessMode::Write)
    }
    /// Whether the task produces a new version (or a part of it).
    pub fn writes(self) -> bool {
        !matches!(self, AccessMode::Read)
    }
    /// Whether the task writes a part of the tile alongside the other members of its group
    /// ([`AccessMode::ReadWritePart`]).
    pub fn is_part(self) -> bool {
        matches!(self, AccessMode::ReadWritePart)
    }
}

/// Per item of a sequence that uses tiles, the earlier items it must follow: each tile's last
/// writer before it, and for an item that writes the tile also the readers since that writer
/// (read after write, write after read, write after write). This is the last-writer/readers
/// analysis of sequential task flow (StarPU's implicit data dependencies; Augonnet et al.,
/// "StarPU", CCPE 2011), applied within one sequence whose items name their tiles by index.
///
/// `items`: per item, its tiles as `(tile index, mode)`. Returns, per item, the indices of the
/// items it follows, ascending and without repeats. Part writes ([`AccessMode::ReadWritePart`])
/// count as writes here: callers that allow them must order their groups themselves.
pub fn sequence_dependencies<'a, I>(items: I) -> Vec<smallvec::SmallVec<[u32; 4]>>
where
    I: IntoIterator<Item = &'a [(u32, AccessMode)]>,
{
    use rustc_hash::FxHashMap;
    let mut writer: FxHashMap<u32, u32> = FxHashMap::default();
    let mut readers: FxHashMap<u32, smallvec::SmallVec<[u32; 4]>> = FxHashMap::default();
    let mut out = Vec::new();
    for (k, tiles) in items.into_iter().enumerate() {
        let mut d: smallvec::SmallVec<[u32; 4]> = smallvec::SmallVec::new();
        for &(u, mode) in tiles {
            if let Some(&w) = writer.get(&u) {
                d.push(w);
            }
            if mode.writes() {
                if let Some(rs) = readers.get(&u) {
                    d.extend_from_slice(rs);
                }
            }
        }
        for &(u, mode) in tiles {
            if mode.writes() {
                writer.insert(u, k as u32);
                readers.remove(&u);
            } else {
                readers.entry(u).or_default().push(k as u32);
            }
        }
        d.sort_unstable();
        d.dedup();
        out.push(d);
    }
    out
}
