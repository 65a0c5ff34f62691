//! Fuzz target: the 32-byte IPC transfer descriptor another process sends
//! (`transfer::wire::Desc::decode`). Any bytes: a descriptor or an error, never a panic.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = ferry::__fuzz::transfer_descriptor(data);
    });
}
