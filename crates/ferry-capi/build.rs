//! Generates `ferry.h` from the `extern "C"` items of this crate (cbindgen) into `OUT_DIR`; the
//! checked-in copy in `include/` must equal it (a unit test compares them), so the header a C
//! program compiles against is always the one the library exports.

fn main() {
    let crate_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("ferry.h");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let config = cbindgen::Config::from_file(format!("{crate_dir}/cbindgen.toml")).expect("cbindgen.toml parses");
    match cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
    {
        Ok(b) => {
            b.write_to_file(&out);
        }
        Err(e) => {
            // A header that cannot be generated must not break the library build; the header
            // test then fails with this message.
            println!("cargo:warning=cbindgen: {e}");
            std::fs::write(&out, format!("/* cbindgen failed: {e} */\n")).expect("OUT_DIR is writable");
        }
    }
}
