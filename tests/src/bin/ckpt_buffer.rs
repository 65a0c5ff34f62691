//! Checkpoint into a caller's buffer and restore from it, run under mpirun by
//! `tests/it/checkpoint.rs`: device-resident tiles (emulated devices) go straight into the
//! buffer (the heap grows by no more than a small constant beyond the buffer), a corrupted
//! buffer is refused with every tile left as it was, and the intact one restores the data.

use anyhow::{bail, ensure, Context};
use ferry::{CollectionRef, Distribution, ProcessGrid, Runtime, TaskClass};

#[global_allocator]
static ALLOC: ferry_examples::alloc::Counting = ferry_examples::alloc::Counting;

fn value(i: usize, j: usize, e: usize, salt: f64) -> f64 {
    (i * 1000 + j * 10) as f64 + e as f64 * 1e-3 + salt
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
    let a = rt.tiled_matrix::<f64>("a", 256, 256, 64, Distribution::BlockCyclic2d(grid))?;
    // A GPU-capable class: on emulated devices its body runs there, so the tiles are
    // device-resident when the checkpoint is taken.
    let fill = TaskClass::new("fill", |ctx| {
        let (i, j) = ctx.coords(0)?;
        let salt = f64::from_bits(ctx.args()[0] as u64);
        for (e, x) in ctx.tile_mut::<f64>(0)?.iter_mut().enumerate() {
            *x = value(i, j, e, salt);
        }
        Ok(())
    })
    .with_cuda(|_| Err("no CUDA body: use emulated devices".into()));
    let fill_all = |salt: f64| -> anyhow::Result<()> {
        let args = [salt.to_bits() as i64];
        for i in 0..a.tile_rows() {
            for j in 0..a.tile_cols() {
                rt.submit(ferry::Task::new(&fill, &[a.write(i, j)]).args(&args))?;
            }
        }
        Ok(rt.wait()?)
    };
    let check = |salt: f64, what: &str| -> anyhow::Result<()> {
        if let Some(tiles) = rt.gather(&a, 0)? {
            for (k, t) in tiles.iter().enumerate() {
                let (i, j) = (k / a.tile_cols(), k % a.tile_cols());
                for (e, &x) in t.iter().enumerate() {
                    ensure!(x == value(i, j, e, salt), "{what}: tile ({i}, {j}) element {e} is {x}");
                }
            }
        }
        Ok(())
    };
    fill_all(0.0)?;
    let colls = [CollectionRef::from(&a)];
    let mut buf = vec![0u8; rt.checkpoint_size(&colls)];
    let base = ferry_examples::alloc::start();
    let used = rt.checkpoint_into(5, &colls, &mut buf).context("checkpoint_into")?;
    let added = ferry_examples::alloc::added_since(base);
    let mine = (a.tile_rows() * a.tile_cols()).div_ceil(rt.size()) * 64 * 64 * 8;
    ensure!(used >= mine.min(64 * 64 * 8), "{used} bytes used for this rank's tiles");
    fill_all(1.0)?;
    // A flipped byte in a tile: refused on every rank, nothing changed.
    let mut bad = buf[..used].to_vec();
    bad[4096 + 100] ^= 0x20;
    match rt.restore_from(&bad, &colls) {
        Ok(_) => bail!("a corrupted buffer was accepted"),
        Err(e) => ensure!(e.to_string().contains("checksum"), "unexpected error: {e}"),
    }
    check(1.0, "after the refused restore")?;
    // A truncated one too.
    ensure!(
        rt.restore_from(&buf[..used - 10], &colls).is_err(),
        "a truncated buffer was accepted"
    );
    let step = rt.restore_from(&buf[..used], &colls).context("restore_from")?;
    ensure!(step == 5, "step {step}");
    check(0.0, "after the restore")?;
    let added = rt.allgather_u64(added)?.into_iter().max().unwrap_or(0);
    if rt.rank() == 0 {
        println!("ckpt_buffer ok: {used} bytes on rank 0, heap added at most {added} bytes on any rank");
    }
    Ok(())
}
