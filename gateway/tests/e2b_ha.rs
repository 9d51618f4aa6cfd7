//! E2B on every gateway of a cluster: two gateways share one PostgreSQL and A holds the
//! workspace; the unmodified E2B SDK (Python), pointed at B only, creates a sandbox, runs a
//! command in it and kills it. B's front door forwards each call that changes the sandbox to A
//! over `sbx.v1` gRPC with the caller's key, and A checks the key itself.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::ha::SharedStore;
use common::{DataDir, Sbxd, run_bounded};

fn python() -> PathBuf {
    let path = std::env::var_os("SBX_E2B_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/e2b-venv/bin/python")
        });
    assert!(
        path.exists(),
        "the E2B SDK's python is not at {} (set SBX_E2B_PYTHON)",
        path.display()
    );
    path
}

/// What the SDK does through B: create, run a command, kill, each checked.
const SCRIPT: &str = r#"
import os
from e2b import Sandbox
box = Sandbox.create(timeout=120, api_key=os.environ["KEY"])
print("created", box.sandbox_id, flush=True)
ran = box.commands.run("echo hello-from-$((6*7))")
assert ran.exit_code == 0 and ran.stdout.strip() == "hello-from-42", ran
print("ran", ran.stdout.strip(), flush=True)
box.kill()
assert not any(s.sandbox_id == box.sandbox_id for s in Sandbox.list(api_key=os.environ["KEY"]).next_items())
print("done", flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_sdk_is_served_by_a_gateway_that_does_not_hold_the_workspace() {
    let python = python();
    let store = SharedStore::start();
    let url = store.database("e2bha").await;
    let a_data = DataDir::new();
    let key = common::token(a_data.path(), "agent", "editor", None, true);
    // B holds the same identities: the file copied, as an operator would.
    let b_data = DataDir::new();
    let auth_dir = b_data.path().join("auth");
    std::fs::create_dir_all(&auth_dir).unwrap();
    std::fs::set_permissions(
        &auth_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let copied = auth_dir.join("identities.json");
    std::fs::copy(a_data.path().join("auth/identities.json"), &copied).unwrap();
    std::fs::set_permissions(&copied, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let flags = [
        "--store",
        url.as_str(),
        "--store-password-file",
        store.password_file.as_str(),
    ];
    let mut a_flags = flags.to_vec();
    a_flags.extend(["--auth", "token"]);
    let a = Sbxd::start(a_data.path(), "process", &a_flags);
    let (b, b_e2b) = common::e2b_sbxd(b_data.path(), "process", &flags);
    let e2b_url = format!("http://{b_e2b}");
    let run = run_bounded(
        Command::new(&python)
            .args(["-c", SCRIPT])
            .env("E2B_API_URL", &e2b_url)
            .env("E2B_SANDBOX_URL", &e2b_url)
            .env_remove("E2B_API_KEY")
            .env_remove("E2B_DEBUG")
            .env("KEY", &key),
        "the E2B SDK through B",
    );
    assert_eq!(
        run.code,
        0,
        "{}{}\nB's log:\n{}",
        run.stdout,
        run.stderr,
        b.log_text()
    );
    assert!(run.stdout.ends_with("done\n"), "{run:?}");
    // B serves nothing of the workspace: A made, ran and deleted the sandbox, and A checked
    // the key itself (its audit names the identity).
    assert!(!b.log_text().contains("serving the workspace"));
    let a_log = a.log_text();
    for rpc in ["CreateSandbox", "Exec", "DeleteSandbox"] {
        assert!(
            a_log
                .lines()
                .any(|l| l.contains("sbx::audit") && l.contains("who=agent") && l.contains(rpc)),
            "A's audit of the forwarded {rpc}:\n{a_log}"
        );
    }
}
