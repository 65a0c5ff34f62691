//! Writes the seed corpus (`fuzz/corpus/<target>/<name>`): valid inputs from ferry's own
//! encoders. `cargo run --manifest-path fuzz/Cargo.toml --bin seeds -- fuzz/corpus`.

fn main() -> std::io::Result<()> {
    let root = std::env::args().nth(1).unwrap_or_else(|| "fuzz/corpus".into());
    for (target, name, bytes) in ferry::__fuzz::seeds() {
        let dir = std::path::Path::new(&root).join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(name), bytes)?;
    }
    Ok(())
}
