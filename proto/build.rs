//! Generates the Rust code of the two contracts.
//!
//! protoc comes from the `protoc-bin-vendored` crate unless `$PROTOC` names one, so a fresh
//! machine needs no system protoc.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = match std::env::var_os("PROTOC") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => protoc_bin_vendored::protoc_bin_path()?,
    };
    let well_known = protoc_bin_vendored::include_path()?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);

    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("sbx_descriptor.bin"))
        .compile_with_config(
            config,
            &[
                PathBuf::from("proto/sbx/v1/sbx.proto"),
                PathBuf::from("proto/sbx/driver/v1/driver.proto"),
            ],
            &[PathBuf::from("proto"), well_known],
        )?;
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-env-changed=PROTOC");
    Ok(())
}
