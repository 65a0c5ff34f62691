//! Fuzz target: the checkpoint reader. The first byte picks the decoder (even: a manifest, odd: a
//! rank file, walked tile by tile with every checksum), the rest is the file. Any bytes: an
//! error or a checkpoint, never a panic, never an allocation beyond the input's size.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        if let Some((&pick, file)) = data.split_first() {
            let _ = if pick % 2 == 0 {
                ferry::__fuzz::checkpoint_manifest(file)
            } else {
                ferry::__fuzz::checkpoint_rank_file(file)
            };
        }
    });
}
