//! The start-up check of GPU-direct: before any tile moves, a rank that will hand device memory
//! to MPI sends a patterned device block to itself and compares what arrives. An MPI that says it
//! takes device memory but mangles it is caught here, with a clear error, instead of as wrong
//! results later. (An MPI that cannot take device memory at all may crash on the check: that is
//! why `FERRY_GPU_DIRECT=on` first requires the library to report CUDA support, and `force` is
//! the caller's word.)

use super::region::{DeviceRegion, Small};
use super::Transport;
use crossbeam::channel::{self, Sender};
use ferry_base::error::{FerryError, Rank, Result};
use ferry_base::traffic::TrafficPath;
use ferry_device::pool::Block;
use ferry_device::{Mem, Stream};
use ferry_engine::Lane;
use ferry_memory::data::copy::TileCopy;
use ferry_memory::manager::{CopyOp, GpuCmd, Placed};
use std::sync::Arc;
use std::time::Duration;

/// Bytes of the check's block (small enough for the tiny emulated devices of the tests).
const CHECK_BYTES: usize = 256;
/// How long each step may take before the check counts as failed.
const STEP: Duration = Duration::from_secs(20);

impl Transport {
    /// Runs the check on this rank's first device (`devices` local devices, `release` where
    /// blocks go back); `tag` must be unused by anything else on the acknowledgement channel.
    ///
    /// # Errors
    /// [`FerryError::Config`] naming what went wrong: no device block, a failed copy or MPI
    /// call, a timeout, or data that arrived different from what was sent.
    pub fn gpu_direct_self_check(
        self: &Arc<Self>,
        rank: Rank,
        devices: usize,
        release: Option<Sender<(usize, Block)>>,
        tag: i32,
    ) -> Result<()> {
        let fail = |what: String| {
            FerryError::Config(format!(
                "FERRY_GPU_DIRECT self-check on rank {rank}: {what} (set FERRY_GPU_DIRECT=off to stage through host memory)"
            ))
        };
        let env = ferry_memory::data::copy::CopyEnv {
            devices,
            release,
            ..Default::default()
        };
        let copy = TileCopy::host(CHECK_BYTES, &env);
        let (tx, rx) = channel::bounded::<Option<Placed>>(1);
        self.gpu(GpuCmd::Reserve {
            copy: copy.clone(),
            then: Box::new(move |p| {
                let _ = tx.send(p);
                None
            }),
        });
        let placed = rx
            .recv_timeout(STEP)
            .map_err(|_| fail("the GPU manager did not answer".into()))?;
        let Some(placed) = placed else {
            // A device too small (or failing) for the check's block: the check cannot run, and
            // the transfers will tell. Not worth failing a run that may never use the path.
            tracing::warn!(
                rank,
                "GPU-direct self-check skipped: no device memory for its {CHECK_BYTES}-byte block"
            );
            return Ok(());
        };
        let result = self.self_check_on(rank, &placed, tag, &fail);
        self.gpu(GpuCmd::Unpin { copy, dev: placed.dev });
        result
    }

    fn self_check_on(&self, rank: Rank, placed: &Placed, tag: i32, fail: &dyn Fn(String) -> FerryError) -> Result<()> {
        let pattern: Vec<u8> = (0..CHECK_BYTES).map(|k| (k * 131 + 7) as u8).collect();
        let src = Small::new(&pattern);
        let (tx, rx) = channel::bounded::<std::result::Result<(), String>>(2);
        let t1 = tx.clone();
        let keep = src.clone();
        self.gpu(GpuCmd::Copy {
            op: CopyOp {
                counted: false,
                ..CopyOp::plain(
                    placed.dev,
                    Stream::In,
                    Mem::Host(ferry_engine::MemRegion::ptr(&*src)),
                    Mem::Pool(placed.offset),
                    CHECK_BYTES,
                    TrafficPath::HostToDevice,
                )
            },
            then: Box::new(move |r| {
                drop(keep);
                let _ = t1.send(r.map_err(|e| e.to_string()));
            }),
        });
        rx.recv_timeout(STEP)
            .map_err(|_| fail("filling the device block timed out".into()))?
            .map_err(|e| fail(format!("filling the device block: {e}")))?;
        let dst = Small::zeroed(CHECK_BYTES);
        let (t2, t3) = (tx.clone(), tx);
        self.message(
            false,
            dst.clone(),
            rank,
            tag,
            Lane::Control,
            TrafficPath::Control,
            false,
            true,
            Box::new(move |r| {
                let _ = t2.send(r.map_err(|e| e.to_string()));
            }),
        );
        let region = Arc::new(DeviceRegion {
            addr: placed.addr,
            len: CHECK_BYTES,
        });
        self.message(
            true,
            region,
            rank,
            tag,
            Lane::Control,
            TrafficPath::Control,
            false,
            true,
            Box::new(move |r| {
                let _ = t3.send(r.map_err(|e| e.to_string()));
            }),
        );
        for _ in 0..2 {
            rx.recv_timeout(STEP)
                .map_err(|_| fail("the device-memory message to itself did not complete".into()))?
                .map_err(|e| fail(format!("MPI refused device memory: {e}")))?;
        }
        // SAFETY: both messages have completed.
        let got = unsafe { dst.get() };
        match got.iter().zip(&pattern).position(|(a, b)| a != b) {
            None => {
                tracing::info!(rank, device = placed.dev, "GPU-direct self-check passed: device memory handed to MPI arrived intact");
                Ok(())
            }
            Some(k) => Err(fail(format!(
                "byte {k} of a device block sent through MPI arrived as {:#04x}, sent {:#04x}: this MPI does not handle device memory",
                got[k], pattern[k]
            ))),
        }
    }
}
