//! Any request to any gateway: two gateways share one PostgreSQL and A holds the workspace;
//! every request sent to B — a create, a get, a log stream, an exec whose stdin comes after
//! the request was forwarded, a delete — is forwarded to A and answered as A answers it, while
//! B's own actors serve nothing of the workspace.

mod common;

use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::ha::SharedStore;
use common::{DataDir, SBX, Sbxd, eventually, sbx};

/// `sbx sandbox exec -i NAME -- sh -c 'read line; echo got-$line'` through `d`, its stdin
/// written a moment after the call began (so it travels as a later message of the stream),
/// and its output, within 30 s.
fn exec_with_late_stdin(d: &Sbxd, name: &str) -> String {
    let mut child = Command::new(SBX)
        .args([
            "sandbox",
            "exec",
            "-i",
            name,
            "--",
            "sh",
            "-c",
            "read line; echo got-$line",
        ])
        .env("SBX_ENDPOINT", d.endpoint())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sbx");
    std::thread::sleep(Duration::from_millis(500));
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"ping\n").unwrap();
    drop(stdin);
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if began.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the exec through B did not end within 30 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "exec through B: {status:?} {out} {err}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_to_a_gateway_that_does_not_hold_the_workspace_is_served_by_its_holder() {
    let store = SharedStore::start();
    let url = store.database("forward").await;
    let a_data = DataDir::new();
    let a = Sbxd::start(
        a_data.path(),
        "process",
        &[
            "--store",
            &url,
            "--store-password-file",
            &store.password_file,
        ],
    );
    let b_data = DataDir::new();
    let b = Sbxd::start(
        b_data.path(),
        "process",
        &[
            "--store",
            &url,
            "--store-password-file",
            &store.password_file,
        ],
    );

    // A create sent to B: A creates it (its actor, its driver).
    let created = sbx(
        &b.endpoint(),
        &[
            "sandbox",
            "create",
            "f1",
            "-o",
            "json",
            "--",
            "sh",
            "-c",
            "echo hello-from-f1; exec sleep 100",
        ],
    );
    assert_eq!(created.code, 0, "{created:?}\n{}", b.log_text());
    let id = created.json()["id"].as_str().unwrap().to_string();
    assert_eq!(
        common::workload_pids_in(&a_data.path().join("drivers/process"), &id).len(),
        1,
        "the workload runs on A's driver"
    );
    assert!(
        common::workload_pids_in(&b_data.path().join("drivers/process"), &id).is_empty(),
        "and not on B's"
    );
    assert!(
        !b.log_text().contains("serving the workspace"),
        "B took the workspace: {}",
        b.log_text()
    );
    assert!(
        a.log_text().contains(&id),
        "A's actor never saw the sandbox:\n{}",
        a.log_text()
    );

    // A get, a log stream and an exec through B: A's answers.
    let got = sbx(&b.endpoint(), &["sandbox", "get", "f1", "-o", "json"]).json();
    assert_eq!(got["id"], id.as_str());
    assert_eq!(got["phase"], "Ready");
    let logs = eventually(Duration::from_secs(20), "f1's log through B", || async {
        let logs = sbx(&b.endpoint(), &["sandbox", "logs", "f1"]);
        eprintln!("{logs:?}");
        (logs.code == 0 && logs.stdout.contains("hello-from-f1")).then_some(logs)
    })
    .await;
    assert!(logs.stdout.contains("hello-from-f1"), "{logs:?}");
    assert_eq!(exec_with_late_stdin(&b, "f1").trim(), "got-ping");

    // A stop, a start and a delete through B.
    let stopped = sbx(&b.endpoint(), &["sandbox", "stop", "f1", "-o", "json"]);
    assert_eq!(stopped.code, 0, "{stopped:?}");
    assert_eq!(stopped.json()["phase"], "Stopped");
    let started = sbx(&b.endpoint(), &["sandbox", "start", "f1", "-o", "json"]);
    assert_eq!(started.code, 0, "{started:?}");
    assert_eq!(started.json()["phase"], "Ready");
    let deleted = sbx(&b.endpoint(), &["sandbox", "delete", "f1"]);
    assert_eq!(deleted.code, 0, "{deleted:?}");
    let left = a.all_sandboxes().await;
    assert!(left.is_empty(), "{left:?}");
    assert!(common::all_workload_pids(a_data.path()).is_empty());
    // B never served the workspace: everything went to A.
    assert!(!b.log_text().contains("serving the workspace"));
}

/// With tokens: a bearer token travels with the forwarded request and the holder checks it
/// again against its identities (every gateway of a store holds the same identities file); a
/// caller without a credential, or without the role, is refused by the gateway it asked,
/// before anything is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bearer_token_travels_with_a_forwarded_request_and_is_checked_again() {
    let store = SharedStore::start();
    let url = store.database("tokens").await;
    let a_data = DataDir::new();
    let token = |name: &str, role: &str| {
        let made = common::run_bounded(
            common::sbxd_command()
                .args(["token", "create", "--data-dir"])
                .arg(a_data.path())
                .args(["--name", name, "--role", role]),
            "sbxd token create",
        );
        assert_eq!(made.code, 0, "{made:?}");
        made.stdout.lines().last().unwrap().to_string()
    };
    let editor = token("ed", "editor");
    let viewer = token("vi", "viewer");
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
        "--auth",
        "token",
    ];
    let a = Sbxd::start(a_data.path(), "sim", &flags);
    let b = Sbxd::start(b_data.path(), "sim", &flags);
    let as_ = |tok: &str, args: &[&str]| {
        let mut all = vec!["--token", tok];
        all.extend_from_slice(args);
        sbx(&b.endpoint(), &all)
    };

    let created = as_(&editor, &["sandbox", "create", "t1", "--", "sleep", "100"]);
    assert_eq!(created.code, 0, "{created:?}\n{}", b.log_text());
    assert!(!b.log_text().contains("serving the workspace"));
    // A's audit names the editor: A checked the token itself.
    assert!(
        a.log_text().lines().any(|l| l.contains("sbx::audit")
            && l.contains("who=ed")
            && l.contains("CreateSandbox")),
        "A's audit of the forwarded create:\n{}",
        a.log_text()
    );
    let refused = as_(&viewer, &["sandbox", "stop", "t1"]);
    assert_ne!(refused.code, 0, "a viewer stopped a sandbox: {refused:?}");
    assert!(
        refused.stderr.to_lowercase().contains("permission"),
        "{refused:?}"
    );
    let anonymous = sbx(&b.endpoint(), &["sandbox", "get", "t1"]);
    assert_ne!(anonymous.code, 0, "{anonymous:?}");
    let deleted = as_(&editor, &["sandbox", "delete", "t1"]);
    assert_eq!(deleted.code, 0, "{deleted:?}");
}

/// A tenant learns nothing of the store's gateways: when the workspace's holder cannot be
/// reached (A, SIGKILLed, still within its lease), B's answer to a workspace-scoped caller is
/// `UNAVAILABLE` without A's id or address; a gateway-wide caller is told where the holder is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_holder_is_named_to_no_tenant() {
    let store = SharedStore::start();
    let url = store.database("unreachable").await;
    let a_data = DataDir::new();
    let token = |name: &str, role: &str, workspace: Option<&str>| {
        let mut command = common::sbxd_command();
        command
            .args(["token", "create", "--data-dir"])
            .arg(a_data.path())
            .args(["--name", name, "--role", role]);
        if let Some(w) = workspace {
            command.args(["--workspace", w]);
        }
        let made = common::run_bounded(&mut command, "sbxd token create");
        assert_eq!(made.code, 0, "{made:?}");
        made.stdout.lines().last().unwrap().to_string()
    };
    let tenant = token("tenant", "editor", Some("default"));
    let admin = token("root", "admin", None);
    let b_data = DataDir::new();
    let auth_dir = b_data.path().join("auth");
    std::fs::create_dir_all(&auth_dir).unwrap();
    std::fs::set_permissions(
        &auth_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let flags = [
        "--store",
        url.as_str(),
        "--store-password-file",
        store.password_file.as_str(),
        "--auth",
        "token",
        "--lease-seconds",
        "30",
    ];
    let mut a = Sbxd::start(a_data.path(), "sim", &flags);
    // The grants are bound to the workspace's id at A's start; B reads the same file after.
    let copied = auth_dir.join("identities.json");
    std::fs::copy(a_data.path().join("auth/identities.json"), &copied).unwrap();
    std::fs::set_permissions(&copied, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let b = Sbxd::start(b_data.path(), "sim", &flags);
    let on_b = |tok: &str, args: &[&str]| {
        let mut all = vec!["--token", tok];
        all.extend_from_slice(args);
        sbx(&b.endpoint(), &all)
    };
    let created = on_b(&tenant, &["sandbox", "create", "u1", "--", "sleep", "100"]);
    assert_eq!(created.code, 0, "{created:?}\n{}", b.log_text());
    let a_address = a.endpoint().trim_start_matches("http://").to_string();
    a.sigkill();
    // A stop goes to the workspace's holder (a read is the store's, and B answers it).
    let told = on_b(&tenant, &["sandbox", "stop", "u1"]);
    assert_ne!(told.code, 0, "{told:?}");
    assert!(
        !told.stderr.contains(&a_address) && !told.stderr.contains("HELD_ELSEWHERE"),
        "a tenant was told where the holder is: {told:?}"
    );
    assert!(told.stderr.contains("another gateway"), "{told:?}");
    let admin_told = on_b(&admin, &["sandbox", "stop", "u1"]);
    assert_ne!(admin_told.code, 0, "{admin_told:?}");
    assert!(
        admin_told.stderr.contains(&a_address) || admin_told.stderr.contains("HELD_ELSEWHERE"),
        "a gateway-wide caller is told where the holder is: {admin_told:?}"
    );
}
