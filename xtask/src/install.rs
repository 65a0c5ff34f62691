//! `cargo xtask install-capi --prefix DIR`: builds the C ABI (`libferry.so`) and installs it with
//! its header and a pkg-config file: `DIR/lib/libferry.so`, `DIR/include/ferry.h`,
//! `DIR/lib/pkgconfig/ferry.pc`. Then `PKG_CONFIG_PATH=DIR/lib/pkgconfig pkg-config --cflags
//! --libs ferry` gives what `mpicc` needs.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

use crate::util;

#[derive(Args)]
pub struct InstallArgs {
    /// Installation prefix.
    #[arg(long)]
    prefix: PathBuf,
    /// Install the debug build instead of the release build.
    #[arg(long)]
    debug: bool,
}

pub fn run(args: InstallArgs) -> Result<()> {
    let root = util::root();
    let mut build = util::cargo();
    build.args(["build", "-p", "ferry-capi"]);
    if !args.debug {
        build.arg("--release");
    }
    util::run(&mut build)?;
    let profile = if args.debug { "debug" } else { "release" };
    let prefix = std::path::absolute(&args.prefix).context("resolving --prefix")?;
    let (lib, inc, pc) = (prefix.join("lib"), prefix.join("include"), prefix.join("lib/pkgconfig"));
    for d in [&lib, &inc, &pc] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let so = root.join("target").join(profile).join("libferry.so");
    std::fs::copy(&so, lib.join("libferry.so")).with_context(|| format!("copying {}", so.display()))?;
    let header = root.join("crates/ferry-capi/include/ferry.h");
    std::fs::copy(&header, inc.join("ferry.h")).with_context(|| format!("copying {}", header.display()))?;
    let template =
        std::fs::read_to_string(root.join("crates/ferry-capi/ferry.pc.in")).context("reading ferry.pc.in")?;
    let text = template
        .replace("@PREFIX@", &prefix.to_string_lossy())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    std::fs::write(pc.join("ferry.pc"), text).context("writing ferry.pc")?;
    eprintln!(
        "xtask install-capi: installed into {} (PKG_CONFIG_PATH={})",
        prefix.display(),
        pc.display()
    );
    Ok(())
}
