//! Stock gRPC clients on sbxd's Unix socket, with no options: grpc-python from PyPI (which
//! sends the socket's path as the `:authority`, refused by the HTTP/2 server underneath until
//! `daemon/h2_authority.rs`) runs the README's Python example, Node's `@grpc/grpc-js` makes,
//! runs in and deletes a sandbox, and grpc-go (Debian's, which sends the path too) makes and
//! deletes one. All with token authentication on, as the socket's owner (an admin there).
//!
//! Needs the clients `.ci/run` installs: `SBX_GRPC_PYTHON`, else `target/grpc-venv/bin/python`
//! (`python3 -m venv target/grpc-venv && target/grpc-venv/bin/pip install grpcio==1.85.3
//! grpcio-tools==1.85.1`), and `SBX_GRPC_NODE_MODULES`, else `target/grpc-node/node_modules`
//! (`npm install --prefix target/grpc-node @grpc/grpc-js@1.14.7 @grpc/proto-loader@0.8.1`),
//! and `go` with grpc-go in /usr/share/gocode (`apt-get install golang-go
//! golang-google-grpc-dev`; `SBX_GO` names another `go`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{DataDir, Sbxd, run_bounded};

fn in_target(var: &str, default: &str, install: &str) -> PathBuf {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(default)
    });
    assert!(
        path.exists(),
        "{} is missing (set {var}, or: {install})",
        path.display()
    );
    path
}

fn proto_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/proto")
}

/// sbxd on its Unix socket only, with tokens required (the socket's owner is an admin), and
/// what the authority fix does logged.
fn socket_sbxd(data: &Path) -> (Sbxd, PathBuf) {
    let mut d = Sbxd::spawn_with_env(
        data,
        "process",
        "",
        &[],
        &[
            ("SBX_AUTH", "token"),
            ("SBX_LOG", "info,sbx_gateway::daemon::h2_authority=debug"),
        ],
    );
    d.wait_serving();
    let socket = data.join("sbxd.sock");
    assert_eq!(d.addr, format!("unix://{}", socket.display()));
    (d, socket)
}

#[test]
fn stock_grpc_python_on_the_unix_socket_runs_the_readme_example() {
    let python = in_target(
        "SBX_GRPC_PYTHON",
        "target/grpc-venv/bin/python",
        "python3 -m venv target/grpc-venv && target/grpc-venv/bin/pip install grpcio==1.85.3 grpcio-tools==1.85.1",
    );
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/python/agent.py");
    let code = std::fs::read_to_string(&example).unwrap();
    assert!(
        common::readme().contains(&code),
        "README.md must show examples/python/agent.py as it is"
    );

    // The stubs, made as the README says.
    let stubs = tempfile::tempdir().unwrap();
    let made = run_bounded(
        Command::new(&python)
            .args(["-m", "grpc_tools.protoc", "-I"])
            .arg(proto_root())
            .arg(format!("--python_out={}", stubs.path().display()))
            .arg(format!("--grpc_python_out={}", stubs.path().display()))
            .arg("sbx/v1/sbx.proto"),
        "grpc_tools.protoc",
    );
    assert_eq!(made.code, 0, "{made:?}");

    let data = DataDir::new();
    let (d, socket) = socket_sbxd(data.path());
    let ran = run_bounded(
        Command::new(&python)
            .arg(&example)
            .arg("py-agent")
            .env("SBX_ENDPOINT", format!("unix://{}", socket.display()))
            .env("PYTHONPATH", stubs.path()),
        "the README's Python example",
    );
    assert_eq!(ran.code, 0, "{ran:?}\n{}", d.log_text());
    assert_eq!(ran.stdout, "('6\\n', 3)\nb'hello\\n'\n", "{ran:?}");
    // This grpcio sent the socket's path as the authority, and was served.
    assert!(
        d.log_text().contains("taken as localhost"),
        "{}",
        d.log_text()
    );
    // The example deleted its sandbox.
    let left = common::sbx(
        &format!("unix://{}", socket.display()),
        &["sandbox", "list", "-o", "json"],
    );
    assert_eq!(left.json(), serde_json::json!([]), "{left:?}");
}

#[test]
fn stock_grpc_js_on_the_unix_socket_makes_runs_and_deletes() {
    let modules = in_target(
        "SBX_GRPC_NODE_MODULES",
        "target/grpc-node/node_modules",
        "npm install --prefix target/grpc-node @grpc/grpc-js@1.14.7 @grpc/proto-loader@0.8.1",
    );
    let data = DataDir::new();
    let (d, socket) = socket_sbxd(data.path());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/grpc/client.mjs");
    let ran = run_bounded(
        Command::new("node")
            .arg(script)
            .arg(&modules)
            .arg(proto_root())
            .arg(&socket)
            .arg("js-box"),
        "the grpc-js client",
    );
    assert_eq!(ran.code, 0, "{ran:?}\n{}", d.log_text());
    assert_eq!(
        ran.stdout, "driver process\nphase PHASE_READY\nexec \"from-node\\n\" 5\ndeleted true\n",
        "{ran:?}"
    );
}

#[test]
fn stock_grpc_go_on_the_unix_socket_makes_and_deletes() {
    // Built here, offline, from Debian's packages (golang-go, golang-google-grpc-dev: grpc-go
    // 1.33 in GOPATH mode), as `.ci/run` installs them.
    let go = std::env::var_os("SBX_GO")
        .map(PathBuf::from)
        .unwrap_or_else(|| "go".into());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/grpc/go/client.go");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("grpc-go");
    let binary = out.join("client");
    let built = run_bounded(
        Command::new(&go)
            .args(["build", "-o"])
            .arg(&binary)
            .arg(&src)
            .env("GO111MODULE", "off")
            .env("GOPATH", "/usr/share/gocode")
            .env("GOCACHE", out.join("cache"))
            .env("GOFLAGS", ""),
        "go build of the grpc-go client",
    );
    assert_eq!(
        built.code, 0,
        "{built:?} (apt-get install golang-go golang-google-grpc-dev)"
    );
    let data = DataDir::new();
    let (d, socket) = socket_sbxd(data.path());
    let ran = run_bounded(
        Command::new(&binary).arg(&socket).arg("go-box"),
        "the grpc-go client",
    );
    assert_eq!(ran.code, 0, "{ran:?}\n{}", d.log_text());
    assert_eq!(
        ran.stdout, "driver process\ncreated go-box phase 2\ndeleted true\n",
        "{ran:?}"
    );
    // grpc-go sent the socket's path as the authority (its dialer's target), and was served.
    assert!(
        d.log_text().contains("taken as localhost"),
        "{}",
        d.log_text()
    );
}
