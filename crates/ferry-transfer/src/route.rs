//! Which payload path each pair of ranks uses, decided identically on both sides from what every
//! rank published at start-up: no transfer ever needs to ask.

use ferry_base::error::{FerryError, Rank, Result};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

pub use ferry_engine::GpuDirect;

/// The payload path between two ranks as configured (`FERRY_TRANSFER_PATH`): ferry's choice per
/// pair (`Auto`), or one [`Route`] for every pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TransferPath {
    /// Per pair: IPC within a node when both ranks have devices, else GPU-direct when both can,
    /// else staged when either has devices, else host.
    #[default]
    Auto,
    /// Whole tiles through host memory (device data is staged out first).
    Host,
    /// Chunks; device data through the bounce pool, pipelined.
    Staged,
    /// Device memory handed to a CUDA-aware MPI.
    GpuDirect,
    /// Peer copies from the producer's pool, mapped once (ranks of one node).
    Ipc,
}

impl std::str::FromStr for TransferPath {
    type Err = FerryError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransferPath::Auto),
            "host" => Ok(TransferPath::Host),
            "staged" => Ok(TransferPath::Staged),
            "gpu-direct" | "direct" => Ok(TransferPath::GpuDirect),
            "ipc" => Ok(TransferPath::Ipc),
            _ => Err(FerryError::Config(format!(
                "FERRY_TRANSFER_PATH={s:?}: expected auto, host, staged, gpu-direct or ipc"
            ))),
        }
    }
}

/// What one rank publishes at start-up.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Caps {
    /// Node name (ranks with equal names can map each other's memory).
    pub host: String,
    /// Local devices.
    pub devices: u32,
    /// Whether this rank hands device memory to MPI.
    pub gpu_direct: bool,
    /// Per device, the handle another process of the node maps its pool with (empty: none).
    pub ipc: Vec<Vec<u8>>,
    /// Per device, bytes of its pool (bounds for the offsets its IPC descriptors announce).
    pub pool_bytes: Vec<u64>,
    /// The chunk size of this rank's staged sends: its receivers cut their receives the same way
    /// (ranks may be configured differently).
    pub chunk: u64,
    /// The path this rank was asked to use (`FERRY_TRANSFER_PATH`): it must be the same on every
    /// rank, or two ranks would speak different protocols.
    pub want: TransferPath,
    /// This rank's `FERRY_PACK_BYTES` (the smallest over the ranks applies everywhere).
    pub pack_bytes: u64,
    /// The PCI addresses (domain, bus, device) of its devices, those the backend knows one for
    /// (CUDA; none for emulated devices): ranks of one node whose lists meet drive the same
    /// physical GPU.
    pub pci: Vec<(u32, u8, u8)>,
    /// Its control rings (`FERRY_CONTROL_RING`), when the ring is on and it shares its node.
    pub mailbox: Option<super::mailbox::MailboxCaps>,
    /// Its `FERRY_EAGER_BYTES`: a pair sends its host tiles through the control ring only up to
    /// the smaller of the two (both sides must pick the same transport for a tile).
    pub eager_bytes: u64,
}

impl Caps {
    fn can_ipc(&self) -> bool {
        self.devices > 0 && self.ipc.len() == self.devices as usize && self.ipc.iter().all(|h| !h.is_empty())
    }
}

/// The route a pair of ranks resolved to at start-up: what [`TransferPath`] (the setting, which
/// may leave the choice to ferry) became for that pair given both ranks' capabilities. The
/// statistics count finer [`ferry_base::traffic::TrafficPath`]s (eager and rendezvous host
/// messages, copies within a rank, control messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Route {
    /// Whole tiles through host memory.
    Host = 0,
    /// Chunks; device data through the bounce pool.
    Staged = 1,
    /// Device memory handed to a CUDA-aware MPI.
    GpuDirect = 2,
    /// Copies from the producer's pool, mapped once (ranks of one node).
    Ipc = 3,
}

impl Route {
    fn from_u8(v: u8) -> Route {
        match v {
            1 => Route::Staged,
            2 => Route::GpuDirect,
            3 => Route::Ipc,
            _ => Route::Host,
        }
    }
}

/// The route to every peer; changeable only at a point where no transfer is in flight
/// ([`crate::Runtime::set_transfer_path`]).
pub struct Routes {
    rank: Rank,
    caps: Vec<Caps>,
    per_peer: Vec<AtomicU8>,
    /// Per peer, [`Routes::offer_capable`]: decided once here, read per launch.
    offer_to: Vec<bool>,
    /// Some entry of `offer_to` is true.
    offer_peers: bool,
}

impl Routes {
    /// Plans the routes of `rank` under `want`.
    ///
    /// # Errors
    /// A forced path that some pair cannot use, naming the pair and why.
    pub fn plan(rank: Rank, caps: Vec<Caps>, want: TransferPath) -> Result<Routes> {
        if let Some((r, c)) = caps.iter().enumerate().find(|(_, c)| c.want != want) {
            return Err(FerryError::Config(format!(
                "FERRY_TRANSFER_PATH differs between ranks: {want:?} on rank {rank}, {:?} on rank {r} (set it the same everywhere)",
                c.want
            )));
        }
        let mut r = Routes {
            rank,
            per_peer: caps.iter().map(|_| AtomicU8::new(Route::Host as u8)).collect(),
            caps,
            offer_to: Vec::new(),
            offer_peers: false,
        };
        r.offer_to = (0..r.caps.len())
            .map(|p| p != rank as usize && r.ipc_capable(p as Rank) && !r.shares_gpu(p as Rank))
            .collect();
        r.offer_peers = r.offer_to.contains(&true);
        r.set(want)?;
        Ok(r)
    }

    /// Re-plans every route under `want` (all or nothing).
    ///
    /// # Errors
    /// As [`Routes::plan`].
    pub fn set(&self, want: TransferPath) -> Result<()> {
        let me = &self.caps[self.rank as usize];
        let mut routes = Vec::with_capacity(self.caps.len());
        for (p, them) in self.caps.iter().enumerate() {
            routes.push(if p == self.rank as usize {
                Route::Host
            } else {
                pair_route(me, them, want).map_err(|why| {
                    FerryError::Config(format!(
                        "FERRY_TRANSFER_PATH={want:?} between ranks {} and {p}: {why}",
                        self.rank
                    ))
                })?
            });
        }
        for (slot, r) in self.per_peer.iter().zip(routes) {
            slot.store(r as u8, Relaxed);
        }
        Ok(())
    }

    /// The route to `peer`.
    pub fn get(&self, peer: Rank) -> Route {
        Route::from_u8(self.per_peer[peer as usize].load(Relaxed))
    }

    /// Largest tile packed with others into one message on host and staged routes (0: never):
    /// the smallest `FERRY_PACK_BYTES` of all ranks, so every rank decides alike.
    pub fn pack_bytes(&self) -> u64 {
        self.caps.iter().map(|c| c.pack_bytes).min().unwrap_or(0)
    }

    /// What `peer` published.
    pub fn caps(&self, peer: Rank) -> &Caps {
        &self.caps[peer as usize]
    }

    /// Whether some peer could take sends offered at their producer's launch
    /// ([`Routes::offer_capable`], whatever the routes are now).
    pub fn any_offer_capable(&self) -> bool {
        self.offer_peers
    }

    /// Whether sends to `peer` may be offered at their producer's launch when its route is IPC:
    /// it could use the route, and it drives none of this rank's GPUs.
    ///
    /// An offered pull waits on the consumer's GPU for the producer's signal
    /// (`cuStreamWaitValue64`). Two processes on one GPU without MPS run in turns (time
    /// slices); a context whose stream waits there, with kernels queued behind the wait, keeps
    /// its turn until the slice ends while the producer that would write the signal cannot run.
    /// On one H100, the two-rank slab stencil with launch-ahead took 2.2 ms per step that way
    /// against 0.25 ms without offers.
    pub fn offer_capable(&self, peer: Rank) -> bool {
        self.offer_to[peer as usize]
    }

    /// Whether `peer` runs on this rank's node and drives a GPU this rank drives too (ranks
    /// outnumbering a node's GPUs). Backends that know no PCI address (emulated devices) never
    /// share.
    pub fn shares_gpu(&self, peer: Rank) -> bool {
        let (me, them) = (&self.caps[self.rank as usize], &self.caps[peer as usize]);
        me.host == them.host && me.pci.iter().any(|a| them.pci.contains(a))
    }

    /// Whether `peer` shares this rank's node and both can map each other's device pools.
    pub fn ipc_capable(&self, peer: Rank) -> bool {
        let (me, them) = (&self.caps[self.rank as usize], &self.caps[peer as usize]);
        me.host == them.host && me.can_ipc() && them.can_ipc()
    }
}

/// The route between two ranks; symmetric, so both sides agree without talking.
fn pair_route(a: &Caps, b: &Caps, want: TransferPath) -> std::result::Result<Route, String> {
    let ipc = a.host == b.host && a.can_ipc() && b.can_ipc();
    let direct = a.gpu_direct && b.gpu_direct;
    let devices = a.devices > 0 || b.devices > 0;
    match want {
        TransferPath::Auto => Ok(if ipc {
            Route::Ipc
        } else if direct {
            Route::GpuDirect
        } else if devices {
            Route::Staged
        } else {
            Route::Host
        }),
        TransferPath::Host => Ok(Route::Host),
        TransferPath::Staged => Ok(Route::Staged),
        TransferPath::GpuDirect if direct => Ok(Route::GpuDirect),
        TransferPath::GpuDirect => Err("both ranks must hand device memory to MPI (devices, and FERRY_GPU_DIRECT=on or force, or auto with a CUDA-aware MPI)".into()),
        TransferPath::Ipc if ipc => Ok(Route::Ipc),
        TransferPath::Ipc if a.host != b.host => Err(format!("they run on different nodes ({} and {})", a.host, b.host)),
        TransferPath::Ipc => Err("both ranks need devices whose pools can be exported".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(host: &str, devices: u32, direct: bool, ipc: bool) -> Caps {
        Caps {
            host: host.into(),
            devices,
            gpu_direct: direct,
            ipc: (0..devices).map(|_| if ipc { vec![1] } else { vec![] }).collect(),
            pool_bytes: vec![1 << 20; devices as usize],
            chunk: 4 << 20,
            want: TransferPath::Auto,
            pack_bytes: 0,
            pci: Vec::new(),
            mailbox: None,
            eager_bytes: 64 << 10,
        }
    }

    #[test]
    fn auto_prefers_ipc_then_direct_then_staged() {
        let a = caps("n0", 1, true, true);
        assert_eq!(
            pair_route(&a, &caps("n0", 2, true, true), TransferPath::Auto),
            Ok(Route::Ipc)
        );
        assert_eq!(
            pair_route(&a, &caps("n1", 1, true, true), TransferPath::Auto),
            Ok(Route::GpuDirect)
        );
        assert_eq!(
            pair_route(&a, &caps("n1", 1, false, true), TransferPath::Auto),
            Ok(Route::Staged)
        );
        assert_eq!(
            pair_route(&a, &caps("n0", 0, false, false), TransferPath::Auto),
            Ok(Route::Staged)
        );
        let cpu = caps("n0", 0, false, false);
        assert_eq!(pair_route(&cpu, &cpu, TransferPath::Auto), Ok(Route::Host));
    }

    #[test]
    fn forced_paths_are_refused_where_impossible() {
        let a = caps("n0", 1, false, true);
        assert!(pair_route(&a, &caps("n1", 1, false, true), TransferPath::Ipc)
            .unwrap_err()
            .contains("different nodes"));
        assert!(pair_route(&a, &a, TransferPath::GpuDirect).is_err());
        let ipc = |mut c: Caps| {
            c.want = TransferPath::Ipc;
            c
        };
        let r = Routes::plan(
            0,
            vec![ipc(a.clone()), ipc(caps("n1", 1, false, true))],
            TransferPath::Ipc,
        );
        assert!(r.is_err());
        // Ranks asked for different paths: refused, naming both.
        let e = Routes::plan(0, vec![ipc(a.clone()), a.clone()], TransferPath::Ipc)
            .err()
            .unwrap();
        assert!(e.to_string().contains("differs between ranks"), "{e}");
        let r = Routes::plan(0, vec![ipc(a.clone()), ipc(a.clone())], TransferPath::Ipc).unwrap();
        assert_eq!(r.get(1), Route::Ipc);
        r.set(TransferPath::Staged).unwrap();
        assert_eq!(r.get(1), Route::Staged);
    }

    #[test]
    fn routes_are_symmetric() {
        let all = [
            caps("n0", 0, false, false),
            caps("n0", 1, true, true),
            caps("n0", 2, false, true),
            caps("n1", 1, true, false),
        ];
        for want in [TransferPath::Auto, TransferPath::Host, TransferPath::Staged] {
            for a in &all {
                for b in &all {
                    assert_eq!(pair_route(a, b, want), pair_route(b, a, want));
                }
            }
        }
    }

    /// Ranks on one node driving the same GPU (found by PCI address) keep the IPC route but
    /// take no offers at launch; ranks on distinct GPUs, or whose backend knows no address, do.
    #[test]
    fn ranks_sharing_a_gpu_take_no_offers() {
        let on = |host: &str, pci: &[(u32, u8, u8)]| {
            let mut c = caps(host, pci.len().max(1) as u32, false, true);
            c.pci = pci.to_vec();
            c
        };
        let (g0, g1) = ((0, 0x19, 0), (0, 0x3b, 0));
        let plan = |all: Vec<Caps>| Routes::plan(0, all, TransferPath::Auto).unwrap();
        let r = plan(vec![on("n0", &[g0]), on("n0", &[g0]), on("n0", &[g1]), on("n1", &[g0])]);
        assert!(r.shares_gpu(1) && !r.offer_capable(1));
        assert_eq!(r.get(1), Route::Ipc, "a shared GPU keeps the IPC route");
        assert!(!r.shares_gpu(2) && r.offer_capable(2));
        // Equal addresses on another node are another GPU.
        assert!(!r.shares_gpu(3));
        assert!(r.any_offer_capable());
        // Two GPUs per rank, one of them in common, is sharing too.
        let r = plan(vec![on("n0", &[g0, g1]), on("n0", &[g1])]);
        assert!(r.shares_gpu(1) && !r.any_offer_capable());
        // No addresses known (emulated devices): nothing is shared.
        let r = plan(vec![on("n0", &[]), on("n0", &[])]);
        assert!(!r.shares_gpu(1) && r.any_offer_capable());
    }
}
