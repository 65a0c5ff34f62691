//! `ferry-info`: what ferry sees on each rank — node, CPUs, NUMA nodes, devices and the peer
//! links between them, the MPI library and whether it takes device pointers, the payload route
//! to every other rank, the pinned host pool, and the configuration in force. Run it the way the job will run:
//! `mpirun -np 4 ferry-info --devices auto`.

use clap::Parser;
use ferry::{DeviceSpec, Runtime};

#[derive(Parser, Debug)]
#[command(about = "Print what ferry sees on each rank (run under mpirun)")]
struct Args {
    /// Devices to open: none, cuda, emu:K or auto. Default: FERRY_DEVICES, else auto.
    #[arg(long)]
    devices: Option<DeviceSpec>,
    /// Also print the whole configuration in force.
    #[arg(long)]
    config: bool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    ferry_examples::set_verbosity(false, true);
    ferry_examples::main_with_runtime("ferry-info", args.devices, None, |rt| show(rt, &args))
}

fn show(rt: &Runtime, args: &Args) -> anyhow::Result<()> {
    // One rank at a time, so that the blocks do not interleave.
    for r in 0..rt.size() as i32 {
        if r == rt.rank() {
            let mut out = format!("== rank {r}\n{}", rt.topology());
            // The runtime started, so every FERRY_* variable read.
            let set: Vec<String> = ferry::config::ferry_vars()?
                .into_iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let st = rt.stats();
            if st.pinned_bytes > 0 {
                out += &format!(
                    "pinned host pool: {} MiB, {} MiB of it not pinned yet (FERRY_HOST_PIN_AT_START)\n",
                    st.pinned_bytes >> 20,
                    st.pinned_pending_bytes >> 20
                );
            }
            out += &format!(
                "FERRY_* set: {}\n",
                if set.is_empty() { "none".into() } else { set.join(" ") }
            );
            if args.config {
                out += &format!("configuration: {:#?}\n", rt.config());
            }
            print!("{out}");
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
        rt.allgather_u64(0)?;
    }
    Ok(())
}
