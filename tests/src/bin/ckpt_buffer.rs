//! Checkpoint into a caller's buffer and restore from it, run under mpirun by
//! `tests/it/checkpoint.rs` (emulated devices) and on the GPU machine (`FERRY_DEVICES=cuda`):
//! device-resident tiles go straight into the buffer (the heap grows by no more than a small
//! constant beyond the buffer), a corrupted buffer is refused with every tile left as it was,
//! and the intact one restores the data. The tiles are the generated SPD matrix, whose CPU and
//! CUDA generators give the same bits.

use anyhow::{bail, ensure, Context};
use ferry::{CollectionRef, Distribution, ProcessGrid, Runtime, TaskClass};

#[global_allocator]
static ALLOC: ferry_examples::alloc::Counting = ferry_examples::alloc::Counting;

/// Matrix order and tile size.
const N: usize = 256;
const NB: usize = 64;

/// Tile `(i, j)` of the SPD matrix of `seed`, computed on the host.
fn expected(seed: u64, i: usize, j: usize) -> Vec<f64> {
    let mut t = vec![0.0; NB * NB];
    ferry_kernels::spd::spd_tile(seed, N, i * NB, j * NB, NB, NB, &mut t).expect("tile shape");
    t
}

fn main() -> std::process::ExitCode {
    let rt = match Runtime::builder().from_env().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ckpt_buffer: error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match run(&rt) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ckpt_buffer: error on rank {}: {e:#}", rt.rank());
            drop(rt);
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(rt: &Runtime) -> anyhow::Result<()> {
    let grid = ProcessGrid::squarest(rt.size());
    let a = rt.tiled_matrix::<f64>("a", N, N, NB, Distribution::BlockCyclic2d(grid))?;
    // A GPU class: with devices its body runs there, so the tiles are device-resident when the
    // checkpoint is taken.
    let fill = TaskClass::new("fill", |ctx| {
        let (i, j) = ctx.coords(0)?;
        let seed = ctx.args()[0] as u64;
        ferry_kernels::spd::spd_tile(seed, N, i * NB, j * NB, NB, NB, ctx.tile_mut::<f64>(0)?)?;
        Ok(())
    })
    .with_cuda(|ctx| {
        let (i, j) = ctx.coords(0)?;
        let seed = ctx.args()[0] as u64;
        let out = ctx.ptr(0)?;
        // SAFETY: the task's NB×NB tile on the stream's device.
        unsafe { ferry_examples::gpu_kernels(ctx)?.spd_tile(seed, N, i * NB, j * NB, NB, NB, out)? };
        Ok(())
    });
    let fill_all = |seed: u64| -> anyhow::Result<()> {
        let args = [seed as i64];
        for i in 0..a.tile_rows() {
            for j in 0..a.tile_cols() {
                rt.submit(ferry::Task::new(&fill, &[a.write(i, j)]).args(&args))?;
            }
        }
        Ok(rt.wait()?)
    };
    let check = |seed: u64, what: &str| -> anyhow::Result<()> {
        if let Some(tiles) = rt.gather(&a, 0)? {
            for (k, t) in tiles.iter().enumerate() {
                let (i, j) = (k / a.tile_cols(), k % a.tile_cols());
                ensure!(*t == expected(seed, i, j), "{what}: tile ({i}, {j}) differs");
            }
        }
        Ok(())
    };
    fill_all(1)?;
    let colls = [CollectionRef::from(&a)];
    let mut buf = vec![0u8; rt.checkpoint_size(&colls)];
    let (used, added) = ferry_examples::alloc::measure(|| rt.checkpoint_into(5, &colls, &mut buf));
    let used = used.context("checkpoint_into")?;
    let mine = (a.tile_rows() * a.tile_cols()).div_ceil(rt.size()) * NB * NB * 8;
    ensure!(used >= mine.min(NB * NB * 8), "{used} bytes used for this rank's tiles");
    fill_all(2)?;
    // A flipped byte in a tile: refused on every rank, nothing changed.
    let mut bad = buf[..used].to_vec();
    bad[4096 + 100] ^= 0x20;
    match rt.restore_from(&bad, &colls) {
        Ok(_) => bail!("a corrupted buffer was accepted"),
        Err(e) => ensure!(e.to_string().contains("checksum"), "unexpected error: {e}"),
    }
    check(2, "after the refused restore")?;
    // A truncated one too.
    ensure!(
        rt.restore_from(&buf[..used - 10], &colls).is_err(),
        "a truncated buffer was accepted"
    );
    let step = rt.restore_from(&buf[..used], &colls).context("restore_from")?;
    ensure!(step == 5, "step {step}");
    check(1, "after the restore")?;
    let added = rt.allgather_u64(added)?.into_iter().max().unwrap_or(0);
    if rt.rank() == 0 {
        println!(
            "ckpt_buffer ok: {used} bytes on rank 0 ({} devices), heap added at most {added} bytes on any rank",
            rt.devices().len()
        );
    }
    Ok(())
}
