//! The E2B SDK against the sbx CLI on one sbxd (process driver), interleaved: `commands.run`
//! against `sbx sandbox exec`, create to a command run against `sbx sandbox create` + exec,
//! 50 MB `files.write`/`read` against `sbx sandbox cp` (`tests/e2b/bench.py`). Ignored; run with
//! `cargo test -p sbx-gateway --test e2b_bench -- --ignored --nocapture` (the SDK as
//! `e2b_sdk.rs` finds it).

mod common;

use std::path::Path;
use std::process::Command;

use common::{DataDir, SBX, Sbxd, run_bounded};

#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn the_e2b_sdk_against_the_sbx_cli() {
    let python = std::env::var_os("SBX_E2B_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/e2b-venv/bin/python")
        });
    let data = DataDir::new();
    let e2b_file = data.path().join("e2b-addr");
    let e2b_arg = e2b_file.display().to_string();
    let d = Sbxd::start(
        data.path(),
        "process",
        &[
            "--auth",
            "token",
            "--e2b-listen",
            "127.0.0.1:0",
            "--e2b-addr-file",
            &e2b_arg,
        ],
    );
    let token = |name: &str, role: &str, ws: Option<&str>| {
        let mut command = common::sbxd_command();
        command
            .args(["token", "create", "--data-dir"])
            .arg(data.path())
            .args(["--name", name, "--role", role]);
        if let Some(w) = ws {
            command.args(["--workspace", w]);
        }
        let made = run_bounded(&mut command, "sbxd token create");
        assert_eq!(made.code, 0, "{made:?}");
        made.stdout.lines().last().unwrap_or_default().to_string()
    };
    let admin = token("admin", "admin", None);
    let ep = d.endpoint();
    let made = run_bounded(
        Command::new(SBX)
            .args(["workspace", "create", "w"])
            .env("SBX_ENDPOINT", &ep)
            .env("SBX_TOKEN", &admin),
        "sbx workspace create",
    );
    assert_eq!(made.code, 0, "{made:?}");
    let key = token("bench", "editor", Some("w"));
    let url = format!(
        "http://{}",
        std::fs::read_to_string(&e2b_file).unwrap().trim()
    );
    let run = run_bounded(
        Command::new(python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2b/bench.py"))
            .env("E2B_API_URL", &url)
            .env("E2B_SANDBOX_URL", &url)
            .env("KEY", &key)
            .env("SBX", SBX)
            .env("SBX_ENDPOINT", &ep)
            .env("SBX_TOKEN", &admin),
        "the E2B benchmark",
    );
    println!("{}{}", run.stdout, run.stderr);
    assert_eq!(run.code, 0);
}
