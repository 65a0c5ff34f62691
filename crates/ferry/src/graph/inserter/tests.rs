use super::*;
use crate::graph::task::TaskClass;
use ferry_memory::data::{Access, Distribution};

/// A recent task keeps its tiles as keys (two cache lines in all); its description gives
/// their coordinates.
#[test]
fn recent_tasks_are_described_with_their_tiles() {
    let desc = Arc::new(
        CollectionDesc::new::<f64>(0, "a", 4, 4, 2, 2, Distribution::block_cyclic_2d(1, 2), 2).expect("valid"),
    );
    let mut dir: Directory<LocalTile> = Directory::new(0, 2);
    dir.add(desc.clone(), |i, j| {
        LocalTile::new(TileCopy::host(desc.tile_bytes(i, j), &CopyEnv::default()))
    })
    .expect("small collection");
    let class = TaskClass::new("gemm", |_| Ok(()));
    let acc = [
        Access {
            coll: 0,
            runtime: 0,
            i: 1,
            j: 0,
            mode: AccessMode::Read,
        },
        Access {
            coll: 0,
            runtime: 0,
            i: 1,
            j: 1,
            mode: AccessMode::ReadWrite,
        },
    ];
    let keys: Vec<TileKey> = acc
        .iter()
        .map(|a| (0, desc.index(a.i, a.j).expect("in range") as u32))
        .collect();
    let task = Task::new(&class, &acc).args(&[4, -2]);
    let mut names = rustc_hash::FxHashMap::default();
    names.insert(class.inner.name_hash, class.inner.name_arc.clone());
    let r = Recent::new(7, &task, &keys, 1);
    assert_eq!(
        r.describe(&names, &dir),
        "`gemm` on rank 1: R c0(1,0) RW c0(1,1) args [4, -2]"
    );
    assert!(std::mem::size_of::<Recent>() <= 128, "two cache lines");
}

/// The device acknowledgements a write could wait for: the unfinished sends that could
/// carry one; a part writer joining an open group counts what its first member did (the
/// group's sends are gone from the tile by then); a finished send, a send that cannot carry
/// one, and the next whole version count nothing.
#[test]
fn writes_count_the_acknowledgements_they_could_wait_for() {
    let copy = || TileCopy::host(8, &CopyEnv::default());
    let node = |c: &Arc<TileCopy>| {
        Node::new(Work::Send {
            copy: c.clone(),
            peer: 1,
            tag: 0,
        })
    };
    let c = copy();
    let mut lt = LocalTile::new(c.clone());
    let [ipc, ipc_done, staged] = [node(&c), node(&c), node(&c)];
    for (s, acked) in [(&ipc, true), (&ipc_done, true), (&staged, false)] {
        lt.add_reader(&mut Edges::new(s));
        lt.sends.push((s.clone(), acked));
    }
    let _ = ipc_done.complete();
    assert_eq!(lt.ack_waits(false), 1);
    assert_eq!(lt.ack_waits(true), 1, "no group open yet: the sends themselves");
    // The first part writer opens a group and takes the tile's sends with it.
    let first = node(&c);
    lt.add_writer(&mut Edges::new(&first), true, false);
    assert!(lt.sends.is_empty());
    assert_eq!(lt.ack_waits(true), 1, "a member joining the group");
    assert_eq!(lt.ack_waits(false), 0, "a whole write after the group");
    // A whole writer ends the version: nothing is sent of the next one.
    lt.add_writer(&mut Edges::new(&node(&c)), false, false);
    assert_eq!(lt.ack_waits(true), 0);
}
