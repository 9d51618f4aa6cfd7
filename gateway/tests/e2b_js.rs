//! The E2B API (`sbxd serve --e2b-listen`) driven by the unmodified E2B JS SDK (`e2b` from
//! npm, pinned in `.ci/run`) under Node.js, through a real sbxd on the process driver with
//! token authentication: create with metadata and a timeout, commands (output, exit codes,
//! envs, cwd, streaming, a background command listed and killed), files (write, read, list,
//! exists, rename, makeDir, remove, 5 MB byte-exact), getInfo, list by metadata, a second
//! key's workspace isolation, a wrong key refused, setTimeout that deletes, kill
//! (`tests/e2b/smoke.mjs`). The Python SDK's fuller run is `e2b_sdk.rs`.
//!
//! Needs Node.js (`SBX_E2B_NODE`, else `node` on PATH) and the SDK in `target/e2b-node` (what
//! `.ci/run` makes: `npm install --prefix target/e2b-node e2b@2.51.0`). Either missing fails
//! the test, saying how to install it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{DataDir, e2b_sbxd, run_bounded, token};

/// How `.ci/run` installs the SDK (the pinned version).
const INSTALL_SDK: &str = "npm install --prefix target/e2b-node e2b@2.51.0 --no-audit --no-fund";

fn node() -> PathBuf {
    if let Some(path) = std::env::var_os("SBX_E2B_NODE") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "SBX_E2B_NODE is {}, which is not a file",
            path.display()
        );
        return path;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("node"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "Node.js is not installed: no `node` on PATH (set SBX_E2B_NODE, or: apt-get \
                 install nodejs npm, then {INSTALL_SDK})"
            )
        })
}

/// The folder the SDK was installed into (`npm install --prefix`).
fn sdk_prefix() -> PathBuf {
    let prefix = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/e2b-node");
    let manifest = prefix.join("node_modules/e2b/package.json");
    assert!(
        manifest.is_file(),
        "the E2B JS SDK is not at {} (run, at the repository's root: {INSTALL_SDK})",
        manifest.display()
    );
    prefix
}

#[test]
fn the_e2b_js_sdk_drives_sbx_unmodified() {
    let node = node();
    let prefix = sdk_prefix();
    let data = DataDir::new();
    let (d, addr) = e2b_sbxd(data.path(), "process", &[]);
    let admin = token(data.path(), "admin", "admin", None, false);
    for ws in ["a", "b"] {
        let made = run_bounded(
            Command::new(common::SBX)
                .args(["workspace", "create", ws])
                .env("SBX_ENDPOINT", d.endpoint())
                .env("SBX_TOKEN", &admin),
            "sbx workspace create",
        );
        assert_eq!(made.code, 0, "{made:?}");
    }
    let key_a = token(data.path(), "agent-a", "editor", Some("a"), true);
    let key_b = token(data.path(), "agent-b", "editor", Some("b"), true);
    let url = format!("http://{addr}");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2b/smoke.mjs");
    let run = run_bounded(
        Command::new(&node)
            .arg(&script)
            .env("E2B_NODE_PREFIX", &prefix)
            .env("E2B_API_URL", &url)
            .env("E2B_SANDBOX_URL", &url)
            .env_remove("E2B_API_KEY")
            .env_remove("E2B_ACCESS_TOKEN")
            .env_remove("E2B_DOMAIN")
            .env_remove("E2B_DEBUG")
            .env("KEY_A", &key_a)
            .env("KEY_B", &key_b),
        "the E2B JS SDK script",
    );
    eprintln!("{}{}", run.stdout, run.stderr);
    assert_eq!(run.code, 0, "sbxd log:\n{}", d.log_text());
    assert!(run.stdout.ends_with("done\n"), "{run:?}");
    // What the SDK made is gone, workloads and all: one sandbox timed out, the other killed.
    let began = std::time::Instant::now();
    while !common::all_workload_pids(data.path()).is_empty() {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(20),
            "workloads left: {:?}",
            common::all_workload_pids(data.path())
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
