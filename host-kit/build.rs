//! Builds `sbx-agent` (the `agent` crate) as a static executable, for the drivers to install
//! into every sandbox: an image may have no libc, or another one, so the agent links its own.
//!
//! It is a nested `cargo build` of the workspace's own `sbx-agent` package, release profile,
//! with `-C target-feature=+crt-static`, into `<target>/sbx-agent/` (beside the outer build's
//! profiles, shared by all of them, so `cargo build`, `cargo test` and `cargo clippy` reuse one
//! copy). Offline and locked: the outer build has already resolved and fetched the same
//! lockfile, which holds the agent's dependencies. `SBX_AGENT_BIN` (a path) skips the build
//! and embeds that file instead.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SBX_AGENT_BIN");
    let manifest_dir =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let workspace = manifest_dir
        .parent()
        .expect("drivers/ is in the workspace")
        .to_path_buf();
    // The agent and the crates of ours it is built from.
    for krate in ["agent", "archive"] {
        for watched in ["src", "Cargo.toml"] {
            let path = workspace.join(krate).join(watched);
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join("Cargo.lock").display()
    );

    let binary = match std::env::var_os("SBX_AGENT_BIN") {
        Some(given) => PathBuf::from(given),
        None => build_static_agent(&workspace),
    };
    println!("cargo:rustc-env=SBX_AGENT_BINARY={}", binary.display());
}

fn build_static_agent(workspace: &Path) -> PathBuf {
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out (or with a triple before the profile).
    let target_dir = out_dir
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "build"))
        .and_then(|build| build.parent())
        .and_then(|profile| profile.parent())
        .map(|t| t.join("sbx-agent"))
        .unwrap_or_else(|| out_dir.join("sbx-agent"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args([
            "build",
            "--release",
            "--frozen",
            "-p",
            "sbx-agent",
            "--bin",
            "sbx-agent",
        ])
        .arg("--target")
        .arg(&target)
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's per-package variables would mislead the nested build's own build
    // scripts; the jobserver (CARGO_MAKEFLAGS) and CARGO_HOME are kept.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        let outer = (key.starts_with("CARGO_") && key != "CARGO_HOME" && key != "CARGO_MAKEFLAGS")
            || matches!(
                key.as_str(),
                "TARGET"
                    | "HOST"
                    | "OUT_DIR"
                    | "NUM_JOBS"
                    | "OPT_LEVEL"
                    | "PROFILE"
                    | "DEBUG"
                    | "RUSTFLAGS"
                    | "RUSTC_WORKSPACE_WRAPPER"
            );
        if outer {
            cmd.env_remove(&key);
        }
    }
    cmd.env(
        "CARGO_ENCODED_RUSTFLAGS",
        ["-Ctarget-feature=+crt-static", "-Cstrip=symbols"].join("\u{1f}"),
    );
    let status = cmd.status().expect("running cargo for sbx-agent");
    assert!(
        status.success(),
        "building the static sbx-agent failed ({status}); see the output above"
    );
    target_dir.join(&target).join("release").join("sbx-agent")
}
