//! Authentication and authorization of sbxd, black box: the real `sbxd` (sim driver) with
//! `--auth token`, the real `sbx`, tonic clients and a stock Python grpcio client.
//!
//! - Every RPC of the public API (enumerated from `sbx_proto::FILE_DESCRIPTOR_SET`, package
//!   `sbx.v1`, so a new RPC is covered without editing this file) answers `UNAUTHENTICATED`
//!   to a call without a credential, in its streaming shape; health and reflection answer.
//! - Roles and workspaces: a viewer of A cannot create in A; an editor of A is refused B's
//!   sandbox by name (`PERMISSION_DENIED`), does not find it by id (`NOT_FOUND`, word for word
//!   what an unknown id gets), and sees none of B in `list -A` nor in `watch -A`.
//! - A revoked token fails at the next call and ends an open watch within a few seconds
//!   (the gateway rechecks every second); a `--ttl 3s` token works, then fails.
//! - Mutual TLS: a client certificate of the gateway's CA names its identity; one of another
//!   CA, or one without an identity, is refused; a server name the certificate lacks is
//!   refused with the name in the error.
//! - The Unix socket is 0600: another local user reaches it (the directories are traversable)
//!   but cannot connect; its owner needs no token.
//! - A stock Python grpcio client works over TLS with a bearer token.
//! - Malformed, oversized (16 KiB) and non-text `authorization` values are refused, and the
//!   gateway serves on.
//!
//! `auth_cost` (ignored; `--run-ignored only`) measures GetSandbox over TLS + token against
//! plain loopback with `--auth none` (the goal: at most 1.15× the latency).

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{CliRun, CliStream, SBX, Sbxd, run_bounded, sbx};
use prost::Message;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteSandboxRequest, GetSandboxRequest,
    SandboxRef, StopSandboxRequest,
};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

/// How long one gRPC call of these tests may take.
const CALL: Duration = Duration::from_secs(10);
/// How long an open stream may outlive its identity: the gateway rechecks every second
/// (`auth::RECHECK`), the rest is slack for a loaded machine.
const STREAM_END: Duration = Duration::from_secs(5);

/// sbxd on 127.0.0.1:0 (sim driver) that wants credentials, with `extra` flags.
fn secured(data: &Path, extra: &[&str]) -> Sbxd {
    let mut args = vec!["--auth", "token"];
    args.extend_from_slice(extra);
    Sbxd::start(data, "sim", &args)
}

/// `sbxd token create` on `data`: the identity's token (None with `--cert-only`).
fn identity(data: &Path, name: &str, role: &str, workspaces: &[&str], extra: &[&str]) -> String {
    let mut command = common::sbxd_command();
    command
        .args(["token", "create", "--data-dir"])
        .arg(data)
        .args(["--name", name, "--role", role])
        .args(extra);
    for w in workspaces {
        command.args(["--workspace", w]);
    }
    let made = run_bounded(&mut command, &format!("sbxd token create --name {name}"));
    assert_eq!(made.code, 0, "token create {name}: {made:?}");
    made.stdout.lines().last().unwrap_or_default().to_string()
}

fn revoke(data: &Path, name: &str) {
    let gone = run_bounded(
        common::sbxd_command()
            .args(["token", "revoke", "--data-dir"])
            .arg(data)
            .arg(name),
        &format!("sbxd token revoke {name}"),
    );
    assert_eq!(gone.code, 0, "token revoke {name}: {gone:?}");
}

/// `sbx --token TOKEN ARGS…` against `endpoint`.
fn sbx_as(endpoint: &str, token: &str, args: &[&str]) -> CliRun {
    let mut all = vec!["--token", token];
    all.extend_from_slice(args);
    sbx(endpoint, &all)
}

/// Asserts that a CLI run failed with `words` (lowercase) in its error.
fn assert_refused(run: &CliRun, words: &str) {
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr.to_lowercase().contains(words),
        "expected {words:?} in the error: {run:?}"
    );
}

/// Adds `authorization: Bearer TOKEN` to every call.
#[derive(Clone)]
struct Bearer(AsciiMetadataValue);

impl Bearer {
    fn new(token: &str) -> Bearer {
        Bearer(format!("Bearer {token}").parse().expect("a token is ASCII"))
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

type Authed = InterceptedService<Channel, Bearer>;

fn sandboxes_as(channel: &Channel, token: &str) -> SandboxServiceClient<Authed> {
    SandboxServiceClient::with_interceptor(channel.clone(), Bearer::new(token))
}

/// One RPC of the public API: its path and streaming shape.
#[derive(Debug, Clone)]
struct Rpc {
    path: String,
    client_streaming: bool,
    server_streaming: bool,
}

impl Rpc {
    fn new(path: &str, client_streaming: bool, server_streaming: bool) -> Rpc {
        Rpc {
            path: path.to_string(),
            client_streaming,
            server_streaming,
        }
    }
}

/// Every RPC of package `sbx.v1`, from the descriptors sbxd serves.
fn public_rpcs() -> Vec<Rpc> {
    let set = prost_types::FileDescriptorSet::decode(sbx_proto::FILE_DESCRIPTOR_SET)
        .expect("sbx_proto::FILE_DESCRIPTOR_SET decodes");
    let mut rpcs = Vec::new();
    for file in set.file.iter().filter(|f| f.package() == "sbx.v1") {
        for service in &file.service {
            for method in &service.method {
                rpcs.push(Rpc::new(
                    &format!("/sbx.v1.{}/{}", service.name(), method.name()),
                    method.client_streaming(),
                    method.server_streaming(),
                ));
            }
        }
    }
    rpcs
}

/// Calls `rpc` with empty messages (one, then the end, where the client streams) and
/// `authorization` if given: Ok once the answer or the first streamed message arrives,
/// else the status; `DEADLINE_EXCEEDED` from here when nothing comes within `limit`.
async fn call_empty(
    channel: &Channel,
    rpc: &Rpc,
    authorization: Option<&AsciiMetadataValue>,
    limit: Duration,
) -> Result<(), Status> {
    let request = |message| with_authorization(message, authorization);
    let streamed = || with_authorization(futures::stream::iter([()]), authorization);
    let path: PathAndQuery = rpc.path.parse().expect("a gRPC path");
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    let call = async move {
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
        match (rpc.client_streaming, rpc.server_streaming) {
            (false, false) => grpc.unary(request(()), path, codec).await.map(drop),
            (false, true) => {
                let mut stream = grpc
                    .server_streaming(request(()), path, codec)
                    .await?
                    .into_inner();
                stream.message().await.map(drop)
            }
            (true, false) => grpc
                .client_streaming(streamed(), path, codec)
                .await
                .map(drop),
            (true, true) => {
                let mut stream = grpc.streaming(streamed(), path, codec).await?.into_inner();
                stream.message().await.map(drop)
            }
        }
    };
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer within the limit")))
}

fn with_authorization<T>(message: T, authorization: Option<&AsciiMetadataValue>) -> Request<T> {
    let mut req = Request::new(message);
    if let Some(value) = authorization {
        req.metadata_mut().insert("authorization", value.clone());
    }
    req
}

fn bearer_value(token: &str) -> AsciiMetadataValue {
    format!("Bearer {token}").parse().expect("a token is ASCII")
}

/// 1. No credential: every public RPC answers UNAUTHENTICATED (a viewer's token, as the
/// control, never does); health and reflection need none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_public_rpc_wants_a_credential() {
    let data = tempfile::tempdir().expect("temp dir");
    let d = secured(data.path(), &[]);
    let viewer = identity(data.path(), "viewer", "viewer", &["a"], &[]);
    let channel = d.channel().await;
    let rpcs = public_rpcs();
    // The 23 of the auth table when this was written; more is fine.
    assert!(rpcs.len() >= 23, "only {} sbx.v1 RPCs found", rpcs.len());
    let mut wrong = Vec::new();
    for rpc in &rpcs {
        let anonymous = call_empty(&channel, rpc, None, CALL).await;
        match &anonymous {
            Err(status) if status.code() == Code::Unauthenticated => {
                assert!(
                    status.message().contains("no credential"),
                    "{}: {status:?}",
                    rpc.path
                );
            }
            other => wrong.push(format!("{} without credential: {other:?}", rpc.path)),
        }
        // The control: the same call with a credential gets past authentication (it may be
        // refused, invalid, or still streaming after 3 s).
        let control = call_empty(&channel, rpc, Some(&bearer_value(&viewer)), CALL / 3).await;
        if matches!(&control, Err(s) if s.code() == Code::Unauthenticated) {
            wrong.push(format!("{} with a viewer token: {control:?}", rpc.path));
        }
    }
    assert!(wrong.is_empty(), "wrong answers:\n{}", wrong.join("\n"));
    // A method nobody declared or made serves nothing, with or without a credential.
    let undeclared = Rpc::new("/sbx.v1.SandboxService/NoSuchMethod", false, false);
    let anonymous = call_empty(&channel, &undeclared, None, CALL).await;
    assert!(
        matches!(&anonymous, Err(s) if matches!(s.code(), Code::Unauthenticated | Code::PermissionDenied)),
        "{anonymous:?}"
    );
    let known = call_empty(&channel, &undeclared, Some(&bearer_value(&viewer)), CALL).await;
    assert!(
        matches!(&known, Err(s) if matches!(s.code(), Code::Unimplemented | Code::PermissionDenied)),
        "{known:?}"
    );
    // Health and reflection without a credential.
    d.assert_healthy().await;
    let reflection = Rpc::new(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        true,
        true,
    );
    let reflected = call_empty(&channel, &reflection, None, CALL).await;
    assert!(
        !matches!(&reflected, Err(s) if s.code() == Code::Unauthenticated
            || s.code() == Code::DeadlineExceeded),
        "reflection without a credential: {reflected:?}"
    );
}

/// The JSON lines `stream` prints until one satisfies `done` (that one included), at most
/// `limit`.
fn lines_until(stream: &CliStream, limit: Duration, done: impl Fn(&str) -> bool) -> Vec<String> {
    let deadline = Instant::now() + limit;
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Some(line) = stream.next_line(left) else {
            break;
        };
        let finished = done(&line);
        seen.push(line);
        if finished {
            return seen;
        }
    }
    panic!("no matching line within {limit:?}; saw {seen:#?}");
}

fn event_of(line: &str) -> (String, String) {
    let event: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    let field = |f: &str| event["sandbox"][f].as_str().unwrap_or_default().to_string();
    (field("workspace"), field("name"))
}

/// 2. Roles and workspaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_and_workspaces_bound_what_a_caller_sees_and_does() {
    let data = tempfile::tempdir().expect("temp dir");
    let d = secured(data.path(), &[]);
    let ep = d.endpoint();
    let admin = identity(data.path(), "root", "admin", &[], &[]);
    for ws in ["a", "b"] {
        sbx_as(&ep, &admin, &["workspace", "create", ws]).ok();
    }
    for (ws, name) in [("a", "sa"), ("b", "sb")] {
        sbx_as(
            &ep,
            &admin,
            &[
                "sandbox", "create", "-w", ws, "-n", name, "--", "sleep", "1000",
            ],
        )
        .ok();
    }
    let viewer = identity(data.path(), "view-a", "viewer", &["a"], &[]);
    let editor = identity(data.path(), "edit-a", "editor", &["a"], &[]);
    let channel = d.channel().await;

    // A viewer of A reads A, and changes nothing there.
    let created = sbx_as(
        &ep,
        &viewer,
        &["sandbox", "create", "-w", "a", "-n", "v1", "--", "true"],
    );
    assert_refused(&created, "permission_denied");
    assert!(created.stderr.contains("view-a"), "{created:?}");
    let err = sandboxes_as(&channel, &viewer)
        .create_sandbox(CreateSandboxRequest {
            workspace: "a".into(),
            name: "v2".into(),
            ..Default::default()
        })
        .await
        .expect_err("a viewer creates nothing");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("an editor"), "{err:?}");
    let got = sbx_as(
        &ep,
        &viewer,
        &["sandbox", "get", "-w", "a", "sa", "-o", "json"],
    )
    .json();
    assert_eq!(got["name"], "sa");
    let listed = sbx_as(&ep, &viewer, &["sandbox", "list", "-w", "a", "-o", "json"]).json();
    let names: Vec<_> = listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| s["name"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(names, ["sa"], "{listed}");
    assert_refused(
        &sbx_as(&ep, &viewer, &["sandbox", "delete", "-w", "a", "sa"]),
        "permission_denied",
    );

    // An editor of A: B's sandbox by name is refused, by id not found like an unknown id.
    let sb_id = sbx_as(
        &ep,
        &admin,
        &["sandbox", "get", "-w", "b", "sb", "-o", "json"],
    )
    .json()["id"]
        .as_str()
        .expect("an id")
        .to_string();
    assert_refused(
        &sbx_as(&ep, &editor, &["sandbox", "get", "-w", "b", "sb"]),
        "permission_denied",
    );
    let mut as_editor = sandboxes_as(&channel, &editor);
    let by_name = |name: &str, ws: &str| SandboxRef {
        workspace: ws.into(),
        name: name.into(),
        ..Default::default()
    };
    let by_id = |id: &str| SandboxRef {
        id: id.into(),
        ..Default::default()
    };
    let err = as_editor
        .get_sandbox(GetSandboxRequest {
            sandbox: Some(by_name("sb", "b")),
        })
        .await
        .expect_err("B is not the editor's");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // The same answer whether the name exists in B or not.
    let err_none = as_editor
        .get_sandbox(GetSandboxRequest {
            sandbox: Some(by_name("nobody", "b")),
        })
        .await
        .expect_err("B is not the editor's");
    assert_eq!(err_none.code(), Code::PermissionDenied, "{err_none:?}");
    let unknown = uuid::Uuid::new_v4().to_string();
    let not_found = |id: &str| {
        let mut client = as_editor.clone();
        let id = id.to_string();
        async move {
            client
                .get_sandbox(GetSandboxRequest {
                    sandbox: Some(by_id(&id)),
                })
                .await
                .expect_err("not the editor's to see")
        }
    };
    let hidden = not_found(&sb_id).await;
    let absent = not_found(&unknown).await;
    common::assert_status(&hidden, Code::NotFound, "SANDBOX_NOT_FOUND");
    common::assert_status(&absent, Code::NotFound, "SANDBOX_NOT_FOUND");
    assert_eq!(
        hidden.message().replace(&sb_id, "ID"),
        absent.message().replace(&unknown, "ID"),
        "an id in B must read like an id nobody has"
    );
    let err = as_editor
        .delete_sandbox(DeleteSandboxRequest {
            sandbox: Some(by_id(&sb_id)),
        })
        .await
        .expect_err("the editor of A deletes nothing in B");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    sbx_as(&ep, &admin, &["sandbox", "get", "-w", "b", "sb"]).ok();
    assert_refused(
        &sbx_as(&ep, &editor, &["sandbox", "get", "--id", &sb_id]),
        "not found",
    );
    // Every other verb on B's sandbox, by name: refused before it acts.
    let local = data.path().join("local-file");
    std::fs::write(&local, "x").expect("a local file");
    let local = local.to_str().expect("a path").to_string();
    for verb in [
        &["sandbox", "start", "-w", "b", "sb"][..],
        &["sandbox", "stop", "-w", "b", "sb"],
        &["sandbox", "restart", "-w", "b", "sb"],
        &["sandbox", "delete", "-w", "b", "sb"],
        &["sandbox", "logs", "-w", "b", "sb"],
        &["sandbox", "exec", "-w", "b", "sb", "--", "true"],
        &["sandbox", "cp", "-w", "b", "sb:/sandbox/x", "/dev/null"],
        &["sandbox", "cp", "-w", "b", &local, "sb:/sandbox/x"],
    ] {
        let answer = sbx_as(&ep, &editor, verb);
        assert_refused(&answer, "permission_denied");
        assert!(answer.stderr.contains("\"b\""), "{verb:?}: {answer:?}");
    }
    let err = as_editor
        .stop_sandbox(StopSandboxRequest {
            sandbox: Some(by_id(&sb_id)),
        })
        .await
        .expect_err("the editor of A stops nothing in B");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let still = sbx_as(
        &ep,
        &admin,
        &["sandbox", "get", "-w", "b", "sb", "-o", "json"],
    )
    .json();
    assert_eq!(still["phase"], "Ready", "B's sandbox was touched: {still}");
    // An editor changes sandboxes in A, not the workspace itself.
    sbx_as(
        &ep,
        &editor,
        &[
            "sandbox", "create", "-w", "a", "-n", "e1", "--", "sleep", "1000",
        ],
    )
    .ok();
    let err = WorkspaceServiceClient::with_interceptor(channel.clone(), Bearer::new(&editor))
        .create_workspace(CreateWorkspaceRequest {
            name: "a2".into(),
            ..Default::default()
        })
        .await
        .expect_err("creating a workspace needs an admin");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // Across workspaces: A's only.
    let all = sbx_as(&ep, &editor, &["sandbox", "list", "-A", "-o", "json"]).json();
    let mut seen: Vec<_> = all
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| {
            format!(
                "{}/{}",
                s["workspace"].as_str().unwrap_or_default(),
                s["name"].as_str().unwrap_or_default()
            )
        })
        .collect();
    seen.sort();
    assert_eq!(seen, ["a/e1", "a/sa"], "{all}");
    let watch = CliStream::start(
        &ep,
        &["--token", &editor, "sandbox", "watch", "-A", "-o", "json"],
    );
    let mut events = lines_until(&watch, CALL, |l| event_of(l).1 == "sa");
    // B's first, then A's: events come in order, so B's would be seen before A's.
    sbx_as(
        &ep,
        &admin,
        &[
            "sandbox", "create", "-w", "b", "-n", "sb2", "-d", "--", "sleep", "1000",
        ],
    )
    .ok();
    sbx_as(
        &ep,
        &admin,
        &[
            "sandbox", "create", "-w", "a", "-n", "sa2", "-d", "--", "sleep", "1000",
        ],
    )
    .ok();
    events.extend(lines_until(&watch, CALL, |l| event_of(l).1 == "sa2"));
    // And whatever follows within half a second.
    while let Some(line) = watch.next_line(Duration::from_millis(500)) {
        events.push(line);
    }
    let leaked: Vec<_> = events.iter().filter(|l| event_of(l).0 != "a").collect();
    assert!(leaked.is_empty(), "the editor of A saw {leaked:#?}");
    // The admin's watch does see B (the filter, not the events, made the difference).
    let admin_watch = CliStream::start(
        &ep,
        &["--token", &admin, "sandbox", "watch", "-A", "-o", "json"],
    );
    lines_until(&admin_watch, CALL, |l| {
        event_of(l) == ("b".into(), "sb2".into())
    });
}

/// A `sbx sandbox watch -A` with `token` whose stderr is kept, for how it ended.
fn watch_with(endpoint: &str, token: &str, stderr: &Path) -> CliStream {
    let mut command = Command::new(SBX);
    command
        .args(["--token", token, "sandbox", "watch", "-A", "-o", "json"])
        .env("SBX_ENDPOINT", endpoint)
        .stderr(std::fs::File::create(stderr).expect("stderr file"));
    CliStream::spawn(command)
}

/// Waits for `watch` to end (at most [`STREAM_END`] after `since`), and asserts it ended
/// with UNAUTHENTICATED.
fn assert_watch_ended(watch: &mut CliStream, stderr: &Path, since: Instant, what: &str) {
    let status = watch.wait(STREAM_END);
    let took = since.elapsed();
    let said = std::fs::read_to_string(stderr).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{what}: {said}");
    assert!(
        said.contains("UNAUTHENTICATED") && said.contains("revoked or expired"),
        "{what}: {said}"
    );
    assert!(took <= STREAM_END, "{what}: the watch ended after {took:?}");
    eprintln!("{what}: the watch ended {took:?} after");
}

/// 3. Revoked and expired tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_and_expired_tokens_stop_at_once() {
    let data = tempfile::tempdir().expect("temp dir");
    let d = secured(data.path(), &[]);
    let ep = d.endpoint();
    let admin = identity(data.path(), "root", "admin", &[], &[]);
    sbx_as(
        &ep,
        &admin,
        &["sandbox", "create", "-n", "box", "--", "sleep", "1000"],
    )
    .ok();
    let short = identity(data.path(), "short", "viewer", &[], &[]);
    sbx_as(&ep, &short, &["sandbox", "list"]).ok();
    let stderr = data.path().join("watch.err");
    let mut watch = watch_with(&ep, &short, &stderr);
    lines_until(&watch, CALL, |l| event_of(l).1 == "box");
    revoke(data.path(), "short");
    let revoked = Instant::now();
    assert_refused(&sbx_as(&ep, &short, &["sandbox", "list"]), "not valid");
    assert_watch_ended(&mut watch, &stderr, revoked, "revoked");
    // Someone else's token is untouched.
    sbx_as(&ep, &admin, &["sandbox", "list"]).ok();

    // --ttl 3s: works at once, fails once it expired; its watch ends too.
    let made = Instant::now();
    let brief = identity(data.path(), "brief", "viewer", &[], &["--ttl", "3s"]);
    sbx_as(&ep, &brief, &["sandbox", "list"]).ok();
    let worked_for = made.elapsed();
    assert!(
        worked_for < Duration::from_secs(3),
        "the first call took {worked_for:?}"
    );
    let stderr = data.path().join("watch-ttl.err");
    let mut watch = watch_with(&ep, &brief, &stderr);
    lines_until(&watch, CALL, |l| event_of(l).1 == "box");
    let expiry = made + Duration::from_secs(3);
    assert_watch_ended(&mut watch, &stderr, expiry, "expired");
    let ended = made.elapsed();
    assert!(
        ended >= Duration::from_millis(2900),
        "the watch ended {ended:?} after a 3 s token was made"
    );
    let refused = sbx_as(&ep, &brief, &["sandbox", "list"]);
    assert_refused(&refused, "not valid");
    let listed = run_bounded(
        common::sbxd_command()
            .args(["token", "list", "--data-dir"])
            .arg(data.path()),
        "sbxd token list",
    );
    let line = listed
        .ok()
        .lines()
        .find(|l| l.starts_with("brief\t"))
        .unwrap_or_else(|| panic!("brief not listed: {listed:?}"))
        .to_string();
    assert!(line.ends_with("(expired)"), "{line}");
    assert!(
        !listed.stdout.contains("short"),
        "revoked yet listed: {listed:?}"
    );
}

/// `sbxd certs init --dir DIR ARGS…`.
fn certs_init(dir: &Path, args: &[&str]) {
    let made = run_bounded(
        common::sbxd_command()
            .args(["certs", "init", "--dir"])
            .arg(dir)
            .args(args),
        "sbxd certs init",
    );
    assert_eq!(made.code, 0, "certs init {}: {made:?}", dir.display());
}

fn pem(dir: &Path, file: &str) -> String {
    dir.join(file).display().to_string()
}

/// sbxd with `--auth token` over TLS: a server certificate of `sbxd certs init` in DATA/x,
/// no client CA. Answers it and the CA certificate's path.
fn tls_gateway(data: &Path) -> (Sbxd, String) {
    let x = data.join("x");
    certs_init(&x, &[]);
    let d = secured(
        data,
        &[
            "--tls-cert",
            &pem(&x, "server.pem"),
            "--tls-key",
            &pem(&x, "server-key.pem"),
        ],
    );
    (d, pem(&x, "ca.pem"))
}

/// `sbx --tls-ca CA --token TOKEN ARGS…` against `d` over TLS.
fn sbx_tls(d: &Sbxd, ca: &str, token: &str, args: &[&str]) -> CliRun {
    let mut all = vec!["--tls-ca", ca];
    all.extend_from_slice(args);
    sbx_as(&format!("https://{}", d.addr), token, &all)
}

/// 4. Mutual TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_name_identities() {
    let data = tempfile::tempdir().expect("temp dir");
    let x = data.path().join("x");
    let y = data.path().join("y");
    certs_init(&x, &["--client", "alice"]);
    certs_init(&x, &["--client", "bob"]);
    // Another CA, with a client of the same name.
    certs_init(&y, &["--client", "alice"]);
    let d = secured(
        data.path(),
        &[
            "--tls-cert",
            &pem(&x, "server.pem"),
            "--tls-key",
            &pem(&x, "server-key.pem"),
            "--tls-client-ca",
            &pem(&x, "ca.pem"),
        ],
    );
    let cert_only = identity(data.path(), "alice", "admin", &[], &["--cert-only"]);
    assert!(
        !cert_only.starts_with("sbx_"),
        "a token printed: {cert_only}"
    );
    let ep = format!("https://{}", d.addr);
    let with = |ca: &Path, client: Option<(&Path, &str)>, extra: &[&str], args: &[&str]| {
        let mut all = vec!["--tls-ca".to_string(), pem(ca, "ca.pem")];
        if let Some((dir, name)) = client {
            all.push("--tls-cert".into());
            all.push(pem(dir, &format!("client-{name}.pem")));
            all.push("--tls-key".into());
            all.push(pem(dir, &format!("client-{name}-key.pem")));
        }
        all.extend(extra.iter().map(|s| s.to_string()));
        all.extend(args.iter().map(|s| s.to_string()));
        sbx(&ep, &all.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let list = ["workspace", "list", "-o", "json"];
    let ok = with(&x, Some((&x, "alice")), &[], &list).json();
    assert_eq!(ok[0]["name"], "default", "{ok}");
    // alice is an admin: she creates.
    with(&x, Some((&x, "alice")), &[], &["workspace", "create", "w2"]).ok();

    // Alice of the other CA: the handshake refuses her.
    let other = with(&x, Some((&y, "alice")), &[], &list);
    assert_eq!(other.code, 1, "{other:?}");
    assert!(other.stdout.is_empty(), "{other:?}");
    eprintln!("another CA's client certificate: {}", other.stderr.trim());
    assert!(other.stderr.contains("client CA"), "no hint: {other:?}");
    // No certificate at all: the same.
    let none = with(&x, None, &[], &list);
    assert_eq!(none.code, 1, "{none:?}");
    assert!(none.stdout.is_empty(), "{none:?}");
    eprintln!("no client certificate: {}", none.stderr.trim());
    assert!(none.stderr.contains("client CA"), "no hint: {none:?}");
    // Bob's certificate is good, but bob is no identity.
    let bob = with(&x, Some((&x, "bob")), &[], &list);
    assert_refused(&bob, "unauthenticated");
    assert!(bob.stderr.contains("\"bob\""), "{bob:?}");
    // The server's certificate is for localhost and 127.0.0.1, not sbxd.example.
    let misnamed = with(
        &x,
        Some((&x, "alice")),
        &["--tls-server-name", "sbxd.example"],
        &list,
    );
    assert_refused(&misnamed, "not valid for name \"sbxd.example\"");
    // A CA that did not sign the server's certificate.
    let untrusted = with(&y, Some((&x, "alice")), &[], &list);
    assert_refused(&untrusted, "invalid peer certificate");
    // Revoked, alice's certificate no longer names anyone.
    revoke(data.path(), "alice");
    assert_refused(
        &with(&x, Some((&x, "alice")), &[], &list),
        "unauthenticated",
    );
}

/// Whether this process may run commands as another user (root, with runuser).
fn can_switch_user() -> bool {
    nix::unistd::geteuid().is_root()
        && Command::new("runuser")
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// 5. The Unix socket: 0600, its owner needs no token, another user cannot connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unix_socket_is_its_owners() {
    if !can_switch_user() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs as root with runuser (util-linux)"
        );
        eprintln!("skipped: needs root and runuser");
        return;
    }
    let tmp = tempfile::tempdir().expect("temp dir");
    // nobody must reach the socket's directory, so that only the socket's mode stops it.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o711))
        .expect("chmod the temp dir");
    for dir in tmp.path().ancestors() {
        let mode = std::fs::metadata(dir).expect("stat").mode();
        assert!(
            mode & 0o001 != 0,
            "{} is not traversable by others (mode {mode:o})",
            dir.display()
        );
    }
    let data = tmp.path().join("data");
    // Private at first: sbxd itself makes it traversable (0711).
    std::fs::create_dir(&data).expect("data dir");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let mut d = Sbxd::spawn(&data, "sim", "", &["--auth", "token"]);
    d.wait_serving();
    let socket = data.join("sbxd.sock");
    let ep = format!("unix://{}", socket.display());
    assert_eq!(d.addr, ep, "the address file");
    let meta = std::fs::symlink_metadata(&socket).expect("the socket");
    assert_eq!(meta.mode() & 0o777, 0o600, "the socket's mode");
    assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw());
    let data_mode = std::fs::metadata(&data).expect("data dir").mode() & 0o777;
    assert_eq!(data_mode, 0o711, "the data dir's mode ({data_mode:o})");

    let as_nobody = |args: &[&str]| {
        run_bounded(
            Command::new("runuser")
                .args(["-u", "nobody", "--"])
                .args(args),
            &format!("runuser -u nobody -- {args:?}"),
        )
    };
    let socket_arg = socket.display().to_string();
    let sees = as_nobody(&["test", "-S", &socket_arg]);
    assert_eq!(sees.code, 0, "nobody cannot even see the socket: {sees:?}");
    let refused = as_nobody(&[SBX, "--endpoint", &ep, "workspace", "list"]);
    assert_refused(&refused, "permission denied");
    assert!(refused.stdout.is_empty(), "{refused:?}");
    let version = as_nobody(&[SBX, "--endpoint", &ep, "version"]);
    assert!(
        version.stdout.contains("permission denied") && !version.stdout.contains("Server Version"),
        "{version:?}"
    );
    // A token does not open the socket either: the mode comes first.
    let admin = identity(&data, "root", "admin", &[], &[]);
    let with_token = as_nobody(&[
        SBX,
        "--endpoint",
        &ep,
        "--token",
        &admin,
        "workspace",
        "list",
    ]);
    assert_refused(&with_token, "permission denied");
    // The owner: no token needed.
    let listed = sbx(&ep, &["workspace", "list", "-o", "json"]).json();
    assert_eq!(listed[0]["name"], "default", "{listed}");
    sbx(
        &ep,
        &["sandbox", "create", "-n", "mine", "--", "sleep", "1000"],
    )
    .ok();
}

/// Whether python3 can import grpc; panics under CI, where .ci/run installs python3-grpcio.
/// A stock client: TLS with the CA as its roots, the token as metadata, messages as bytes.
const PYTHON_CLIENT: &str = r#"
import sys, grpc
target, ca, token = sys.argv[1:4]
creds = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
channel = grpc.secure_channel(target, creds)
auth = (("authorization", "Bearer " + token),)
info = channel.unary_unary("/sbx.v1.GatewayService/GetGatewayInfo")(b"", metadata=auth, timeout=10)
print("info", b"sim" in info)
spaces = channel.unary_unary("/sbx.v1.WorkspaceService/ListWorkspaces")(b"", metadata=auth, timeout=10)
print("workspaces", b"default" in spaces)
events = channel.unary_stream("/sbx.v1.SandboxService/WatchSandboxes")(b"", metadata=auth, timeout=10)
print("watch", b"box" in next(events))
events.cancel()
try:
    channel.unary_unary("/sbx.v1.WorkspaceService/ListWorkspaces")(b"", timeout=10)
    print("anonymous OK")
except grpc.RpcError as e:
    print("anonymous", e.code().name)
"#;

/// 6. A stock Python grpcio client over TLS with a bearer token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_grpcio_client_works_with_tls_and_a_token() {
    let Some(python) = common::python_with_grpcio() else {
        return;
    };
    let data = tempfile::tempdir().expect("temp dir");
    let (d, ca) = tls_gateway(data.path());
    let token = identity(data.path(), "py", "editor", &[], &[]);
    sbx_tls(
        &d,
        &ca,
        &token,
        &["sandbox", "create", "-n", "box", "--", "sleep", "1000"],
    )
    .ok();
    let ran = run_bounded(
        Command::new(python).args(["-c", PYTHON_CLIENT, &d.addr, &ca, &token]),
        "the python grpcio client",
    );
    assert_eq!(
        ran.stdout, "info True\nworkspaces True\nwatch True\nanonymous UNAUTHENTICATED\n",
        "{ran:?}"
    );
}

/// 7. Bad `authorization` values: refused clearly, and the gateway serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_authorization_values_are_refused_not_fatal() {
    let data = tempfile::tempdir().expect("temp dir");
    let d = secured(data.path(), &[]);
    let admin = identity(data.path(), "root", "admin", &[], &[]);
    let info = Rpc::new("/sbx.v1.GatewayService/GetGatewayInfo", false, false);
    let ascii = |s: &str| AsciiMetadataValue::try_from(s).expect("a header value");
    let raw = |b: &[u8]| AsciiMetadataValue::try_from(b).expect("a header value");
    let long = format!("Bearer sbx_{}", "a".repeat(16 * 1024));
    let cases: Vec<(&str, AsciiMetadataValue)> = vec![
        ("Bearer xyz", ascii("Bearer xyz")),
        ("Basic scheme", ascii("Basic cm9vdDpyb290")),
        ("Bearer sbx_ unknown", ascii("Bearer sbx_0000000000000000")),
        (
            "a 300-byte token",
            ascii(&format!("Bearer sbx_{}", "a".repeat(300))),
        ),
        ("non-text bytes", raw(b"Bearer \xff\xfe\x80garbage\xc3\x28")),
        ("non-text bytes alone", raw(b"\x80\x81\x82\x83")),
        (
            "a valid token then garbage",
            raw(&[format!("Bearer {admin}").as_bytes(), b"\xff\xfe"].concat()),
        ),
        ("16 KiB", ascii(&long)),
    ];
    for (what, value) in &cases {
        // A fresh connection each: the HTTP/2 layer may close one over a header too large.
        let channel = d.channel().await;
        let answer = call_empty(&channel, &info, Some(value), CALL).await;
        match &answer {
            Err(s) if s.code() == Code::Unauthenticated => {
                assert!(!s.message().is_empty(), "{what}: {s:?}");
                eprintln!("{what}: UNAUTHENTICATED {:?}", s.message());
            }
            // Refused by HTTP/2 before the gateway sees it (hyper's 16 KiB header list).
            Err(s) if *what == "16 KiB" && s.message().contains("431") => {
                eprintln!("{what}: {:?} {:?}", s.code(), s.message());
            }
            other => panic!("{what}: {other:?}"),
        }
        d.assert_healthy().await;
        call_empty(&d.channel().await, &info, Some(&bearer_value(&admin)), CALL)
            .await
            .unwrap_or_else(|s| panic!("a valid call after {what}: {s:?}"));
    }
    assert!(
        !d.log_text().contains("panicked"),
        "sbxd panicked:\n{}",
        d.log_text()
    );
}

/// `sorted`'s value at percentile `p` (0–100).
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// GetSandbox latency over TLS + bearer token against plain loopback with `--auth none`: two
/// sbxds side by side (sim driver), 500 calls each on persistent channels, interleaved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: cargo nextest run -p sbx-gateway --test auth --run-ignored only auth_cost --no-capture"]
async fn auth_cost() {
    const CALLS: usize = 500;
    let secure_data = tempfile::tempdir().expect("temp dir");
    let plain_data = tempfile::tempdir().expect("temp dir");
    let (secure, ca) = tls_gateway(secure_data.path());
    let plain = Sbxd::start(plain_data.path(), "sim", &[]);
    let token = identity(secure_data.path(), "bench", "viewer", &[], &[]);
    let admin = identity(secure_data.path(), "root", "admin", &[], &[]);
    sbx_tls(
        &secure,
        &ca,
        &admin,
        &["sandbox", "create", "-n", "s", "--", "sleep", "1000"],
    )
    .ok();
    sbx(
        &plain.endpoint(),
        &["sandbox", "create", "-n", "s", "--", "sleep", "1000"],
    )
    .ok();

    let tls = sbx_gateway::tls::client_config(Some(Path::new(&ca)), None, Some("localhost"))
        .expect("the client TLS configuration");
    let channel = Channel::from_shared(format!("https://{}", secure.addr))
        .expect("endpoint")
        .tls_config(tls)
        .expect("TLS")
        .connect()
        .await
        .expect("connect over TLS");
    let mut secure_client = sandboxes_as(&channel, &token);
    let mut plain_client = plain.sandboxes().await;
    let request = || GetSandboxRequest {
        sandbox: Some(SandboxRef {
            name: "s".into(),
            ..Default::default()
        }),
    };
    for _ in 0..50 {
        secure_client.get_sandbox(request()).await.expect("warm up");
        plain_client.get_sandbox(request()).await.expect("warm up");
    }
    let mut secure_times = Vec::with_capacity(CALLS);
    let mut plain_times = Vec::with_capacity(CALLS);
    for i in 0..CALLS {
        // Alternate which goes first, so neither always runs on a warmer cache.
        for first in [i % 2 == 0, i % 2 != 0] {
            let began = Instant::now();
            if first {
                secure_client
                    .get_sandbox(request())
                    .await
                    .expect("GetSandbox over TLS");
                secure_times.push(began.elapsed());
            } else {
                plain_client
                    .get_sandbox(request())
                    .await
                    .expect("GetSandbox plain");
                plain_times.push(began.elapsed());
            }
        }
    }
    secure_times.sort();
    plain_times.sort();
    let row = |name: &str, t: &[Duration]| {
        println!(
            "{name:<22} {:>10.1?} {:>10.1?} {:>10.1?}",
            percentile(t, 50),
            percentile(t, 99),
            t.iter().sum::<Duration>() / t.len() as u32
        )
    };
    println!("GetSandbox, {CALLS} calls each, interleaved, persistent channels (sim driver)");
    println!("{:<22} {:>10} {:>10} {:>10}", "", "p50", "p99", "mean");
    row("TLS + bearer token", &secure_times);
    row("loopback --auth none", &plain_times);
    let ratio =
        |p| percentile(&secure_times, p).as_secs_f64() / percentile(&plain_times, p).as_secs_f64();
    println!(
        "ratio TLS+token / plain: p50 {:.2}x, p99 {:.2}x (goal: at most 1.15x)",
        ratio(50),
        ratio(99)
    );
}

/// The commands `sbxd certs init` prints work as pasted: the serve line listens (TLS, client
/// certificates required) and the client line, with its certificate's identity, reaches it.
/// Only the port changes (7070 → a free one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commands_certs_init_prints_work_as_pasted() {
    let data = tempfile::tempdir().expect("temp dir");
    let x = data.path().join("x");
    let made = run_bounded(
        common::sbxd_command()
            .args(["certs", "init", "--dir"])
            .arg(&x)
            .args(["--client", "alice"]),
        "sbxd certs init",
    );
    assert_eq!(made.code, 0, "{made:?}");
    let line = |start: &str| -> Vec<String> {
        let found = made
            .stdout
            .lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} line in:\n{}", made.stdout));
        found.split_whitespace().map(String::from).collect()
    };
    let serve = line("sbxd serve ");
    assert!(
        serve
            .windows(2)
            .any(|w| w == ["--listen", "127.0.0.1:7070"]),
        "{serve:?}"
    );
    let extra: Vec<String> = serve[2..]
        .iter()
        .map(|a| a.replace("127.0.0.1:7070", "127.0.0.1:0"))
        .collect();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut d = Sbxd::spawn_with_env(data.path(), "sim", "", &extra, &[("SBX_AUTH", "token")]);
    d.wait_serving();
    identity(data.path(), "alice", "viewer", &[], &["--cert-only"]);
    let port = d.addr.rsplit(':').next().unwrap().to_string();
    let client = line("sbx --tls-ca ");
    assert!(
        client
            .windows(2)
            .any(|w| w == ["--endpoint", "https://localhost:7070"]),
        "{client:?}"
    );
    let client: Vec<String> = client[1..]
        .iter()
        .map(|a| a.replace("localhost:7070", &format!("localhost:{port}")))
        .collect();
    let ran = run_bounded(
        Command::new(common::SBX).args(&client),
        "the printed sbx line",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(
        ran.stdout.contains("sim") && !ran.stdout.contains("not reachable"),
        "{ran:?}"
    );
}

/// The image side of the authorization matrix: every image RPC and a create from an image,
/// by each of 7 callers (gateway-wide admin, editor, viewer; admin, editor, viewer of `a`;
/// editor of `b`), on images of `a`, of `b` and of the gateway, by name and by id — each cell's
/// answer against the rule ([`image_rule`]), with no mismatch, and every NOT_FOUND of another
/// workspace's image word for word an unknown id's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_matrix_has_no_mismatch() {
    use sbx_proto::v1::image_service_client::ImageServiceClient;
    use sbx_proto::v1::{
        BuildImageInput, BuildImageStart, DeleteImageRequest, GetImageRequest, ImageRef,
        ImportImageHeader, ImportImageRequest, ListImagesRequest, PruneImagesRequest,
        PullImageRequest, build_image_input, import_image_request,
    };

    let data = tempfile::tempdir().expect("temp dir");
    let d = secured(data.path(), &["--sim-images"]);
    let ep = d.endpoint();
    let root = identity(data.path(), "root", "admin", &[], &[]);
    for ws in ["a", "b"] {
        sbx_as(&ep, &root, &["workspace", "create", ws]).ok();
    }
    let callers: Vec<(Caller, String)> = [
        (Caller::Gateway(Role::Admin), "root", "admin", None),
        (Caller::Gateway(Role::Editor), "g-editor", "editor", None),
        (Caller::Gateway(Role::Viewer), "g-viewer", "viewer", None),
        (
            Caller::Scoped("a", Role::Admin),
            "a-admin",
            "admin",
            Some("a"),
        ),
        (
            Caller::Scoped("a", Role::Editor),
            "a-editor",
            "editor",
            Some("a"),
        ),
        (
            Caller::Scoped("a", Role::Viewer),
            "a-viewer",
            "viewer",
            Some("a"),
        ),
        (
            Caller::Scoped("b", Role::Editor),
            "b-editor",
            "editor",
            Some("b"),
        ),
    ]
    .into_iter()
    .map(|(caller, name, role, ws)| {
        let token = match name {
            "root" => root.clone(),
            _ => identity(data.path(), name, role, ws.as_slice(), &[]),
        };
        (caller, token)
    })
    .collect();
    let channel = d.channel().await;
    let images =
        |token: &str| ImageServiceClient::with_interceptor(channel.clone(), Bearer::new(token));
    let rootfs = |marker: &str| {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(marker.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_cksum();
        b.append_data(&mut h, "marker", marker.as_bytes()).unwrap();
        b.into_inner().unwrap()
    };
    let import = |token: String, name: String, workspace: &str, publish: bool, marker: &str| {
        let mut client = images(&token);
        let header = ImportImageRequest {
            part: Some(import_image_request::Part::Header(ImportImageHeader {
                name,
                workspace: workspace.to_string(),
                publish,
            })),
        };
        let chunk = ImportImageRequest {
            part: Some(import_image_request::Part::Chunk(rootfs(marker))),
        };
        async move {
            client
                .import_image(futures::stream::iter([header, chunk]))
                .await
                .map(|r| r.into_inner().images.remove(0))
        }
    };
    // One image of each scope, by root; a fresh one for each delete cell.
    let counter = std::cell::Cell::new(0);
    let next = || {
        counter.set(counter.get() + 1);
        counter.get()
    };
    let fixture = |scope: Target| {
        let n = next();
        let name = format!("m{n}:v1");
        let (ws, publish) = match scope {
            Target::A => ("a", false),
            Target::B => ("b", false),
            Target::Gateway => ("", true),
        };
        import(root.clone(), name, ws, publish, &format!("{n}"))
    };
    let mut held = std::collections::HashMap::new();
    for target in [Target::A, Target::B, Target::Gateway] {
        held.insert(target, fixture(target).await.expect("a fixture image"));
    }
    let nobodys = uuid::Uuid::new_v4().to_string();
    let unknown_id = |caller_home: &str, token: &str| {
        let mut client = images(token);
        let (home, id) = (caller_home.to_string(), nobodys.clone());
        async move {
            client
                .get_image(GetImageRequest {
                    image: Some(ImageRef {
                        id,
                        workspace: home,
                        ..Default::default()
                    }),
                })
                .await
                .unwrap_err()
                .message()
                .to_string()
        }
    };

    let mut cells = 0;
    let mut mismatches = Vec::new();
    let mut check =
        |caller: Caller, rpc: &str, cell: &str, expect: Expect, got: Result<(), tonic::Status>| {
            cells += 1;
            let ok = match (&expect, &got) {
                (Expect::Allowed, Ok(())) => true,
                // Past authorization, refused for another reason (no such registry here).
                (Expect::Allowed, Err(s)) => !matches!(
                    s.code(),
                    Code::PermissionDenied | Code::NotFound | Code::Unauthenticated
                ),
                (Expect::Denied, Err(s)) => s.code() == Code::PermissionDenied,
                (Expect::NotFound, Err(s)) => s.code() == Code::NotFound,
                _ => false,
            };
            if !ok {
                mismatches.push(format!(
                    "{caller:?} {rpc} {cell}: expected {expect:?}, got {:?}",
                    got.map_err(|s| (s.code(), s.message().to_string()))
                ));
            }
        };
    for (caller, token) in &callers {
        let caller = *caller;
        let home = caller.home();
        // Get and delete: by name from the image's workspace; by id from the caller's.
        for rpc in ["GetImage", "DeleteImage"] {
            for target in [Target::A, Target::B, Target::Gateway] {
                for by_id in [false, true] {
                    let image = match rpc {
                        "GetImage" => held[&target].clone(),
                        _ => fixture(target).await.expect("a fixture image"),
                    };
                    let image_ref = match by_id {
                        true => ImageRef {
                            id: image.id.clone(),
                            workspace: home.to_string(),
                            ..Default::default()
                        },
                        false => ImageRef {
                            reference: image.name.clone(),
                            workspace: target.workspace(home).to_string(),
                            ..Default::default()
                        },
                    };
                    let mut client = images(token);
                    let got = match rpc {
                        "GetImage" => client
                            .get_image(GetImageRequest {
                                image: Some(image_ref),
                            })
                            .await
                            .map(drop),
                        // By id, one the caller may not see is "not deleted", as an id
                        // nobody has.
                        _ => client
                            .delete_image(DeleteImageRequest {
                                image: Some(image_ref),
                            })
                            .await
                            .and_then(|r| match r.into_inner().deleted {
                                true => Ok(()),
                                false => Err(tonic::Status::not_found("not deleted")),
                            }),
                    };
                    let expect = image_rule(caller, rpc, target, by_id);
                    // Another workspace's id answers as an id nobody has.
                    if let (Expect::NotFound, Err(s), "GetImage") = (&expect, &got, rpc) {
                        let unknown = unknown_id(home, token).await;
                        assert_eq!(
                            s.message().replace(&image.id, "ID"),
                            unknown.replace(&nobodys, "ID"),
                            "{caller:?} {rpc} {target:?}: the answer tells it exists"
                        );
                    }
                    check(
                        caller,
                        rpc,
                        &format!("{target:?} by_id={by_id}"),
                        expect,
                        got,
                    );
                }
            }
        }
        // Lists: a workspace's (a, b), and every one the caller sees.
        for (cell, workspace, all) in [("a", "a", false), ("b", "b", false), ("-A", "", true)] {
            let got = images(token)
                .list_images(ListImagesRequest {
                    workspace: workspace.into(),
                    all_workspaces: all,
                    ..Default::default()
                })
                .await
                .map(|r| r.into_inner().images);
            if let Ok(listed) = &got {
                for image in listed {
                    assert!(
                        image.workspace.is_empty() || caller.sees(&image.workspace),
                        "{caller:?} lists {}'s {}",
                        image.workspace,
                        image.name
                    );
                }
                assert!(
                    listed.iter().any(|i| i.workspace.is_empty()),
                    "{caller:?} {cell}: the gateway's images are listed"
                );
            }
            let target = match cell {
                "a" => Target::A,
                "b" => Target::B,
                _ => Target::Gateway,
            };
            check(
                caller,
                "ListImages",
                cell,
                image_rule(caller, "ListImages", target, false),
                got.map(drop),
            );
        }
        // Writes: into a, into b, published, and a name of the gateway's own.
        for (cell, workspace, publish, reserved) in [
            ("into a", "a", false, false),
            ("into b", "b", false, false),
            ("published", "", true, false),
            ("sbx.local", "a", false, true),
        ] {
            let expect = match reserved {
                true => Expect::Denied,
                false => image_rule(
                    caller,
                    "write",
                    match workspace {
                        "a" => Target::A,
                        "b" => Target::B,
                        _ => Target::Gateway,
                    },
                    false,
                ),
            };
            let n = next();
            let name = match reserved {
                true => format!("sbx.local/planted:{n}"),
                false => format!("w{n}:v1"),
            };
            let pulled = images(token)
                .pull_image(PullImageRequest {
                    // A registry nobody serves: an allowed pull fails past authorization.
                    reference: match reserved {
                        true => name.clone(),
                        false => format!("127.0.0.1:1/{name}"),
                    },
                    workspace: workspace.into(),
                    publish,
                    ..Default::default()
                })
                .await;
            let got = match pulled {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    loop {
                        match stream.message().await {
                            Ok(Some(_)) => continue,
                            Ok(None) => break Ok(()),
                            Err(s) => break Err(s),
                        }
                    }
                }
                Err(s) => Err(s),
            };
            check(caller, "PullImage", cell, expect, got);
            let got = import(token.clone(), name.clone(), workspace, publish, cell)
                .await
                .map(drop);
            check(caller, "ImportImage", cell, expect, got);
            let start = BuildImageInput {
                input: Some(build_image_input::Input::Start(BuildImageStart {
                    workspace: workspace.into(),
                    name: format!("{name}-built"),
                    dockerfile: "FROM sbx.local/busybox:latest\nLABEL cell=yes\n".into(),
                    publish,
                    ..Default::default()
                })),
            };
            let built = images(token)
                .build_image(futures::stream::iter([start]))
                .await;
            let got = match built {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    loop {
                        match stream.message().await {
                            Ok(Some(_)) => continue,
                            Ok(None) => break Ok(()),
                            Err(s) => break Err(s),
                        }
                    }
                }
                Err(s) => Err(s),
            };
            check(caller, "BuildImage", cell, expect, got);
        }
        // A create in the caller's home, from an image of a, of b, of the gateway.
        for target in [Target::A, Target::B, Target::Gateway] {
            for by_digest in [false, true] {
                let image = &held[&target];
                let reference = match by_digest {
                    true => image.digest.clone(),
                    false => image.name.clone(),
                };
                let n = next();
                let got = sandboxes_as(&channel, token)
                    .create_sandbox(CreateSandboxRequest {
                        workspace: home.into(),
                        name: format!("c{n}"),
                        spec: Some(sbx_proto::v1::SandboxSpec {
                            image: reference,
                            command: vec!["sleep".into(), "1".into()],
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                    .await
                    .map(drop);
                check(
                    caller,
                    "CreateSandbox",
                    &format!("{target:?} by_digest={by_digest}"),
                    image_rule(caller, "CreateSandbox", target, by_digest),
                    got,
                );
            }
        }
        // Prune (the build cache only: every fixture stays): a workspace's, or the gateway's.
        for target in [Target::A, Target::B, Target::Gateway] {
            let request = PruneImagesRequest {
                workspace: target.workspace(home).into(),
                all: false,
                gateway: target == Target::Gateway,
            };
            let got = images(token).prune_images(request).await.map(drop);
            check(
                caller,
                "PruneImages",
                &format!("{target:?}"),
                image_rule(caller, "PruneImages", target, false),
                got,
            );
        }
    }
    eprintln!("{cells} image cells, {} mismatches", mismatches.len());
    assert!(cells >= 200, "only {cells} cells");
    assert!(
        mismatches.is_empty(),
        "mismatches:\n{}",
        mismatches.join("\n")
    );
}

/// One caller of the image matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Caller {
    /// A gateway-wide grant of this role.
    Gateway(Role),
    /// This role in this workspace only.
    Scoped(&'static str, Role),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    Viewer,
    Editor,
    Admin,
}

impl Caller {
    /// The workspace a call of this caller is made from (a gateway-wide one: `a`).
    fn home(self) -> &'static str {
        match self {
            Caller::Gateway(_) => "a",
            Caller::Scoped(ws, _) => ws,
        }
    }

    fn role(self) -> Role {
        match self {
            Caller::Gateway(r) | Caller::Scoped(_, r) => r,
        }
    }

    /// Holds `role` in `workspace`.
    fn holds(self, workspace: &str, role: Role) -> bool {
        match self {
            Caller::Gateway(r) => r >= role,
            Caller::Scoped(ws, r) => ws == workspace && r >= role,
        }
    }

    fn sees(self, workspace: &str) -> bool {
        self.holds(workspace, Role::Viewer)
    }
}

/// Whose image a cell is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Target {
    A,
    B,
    Gateway,
}

impl Target {
    /// The workspace a lookup of it by name is made from: its own (the gateway's: the
    /// caller's home).
    fn workspace(self, home: &'static str) -> &'static str {
        match self {
            Target::A => "a",
            Target::B => "b",
            Target::Gateway => home,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Allowed,
    Denied,
    NotFound,
}

/// The rule (design.md §11 and §14, `auth::need`, `grpc::images`), as a table: what
/// `caller` gets for `rpc` on `target`'s image (by id or digest when `by_id`).
fn image_rule(caller: Caller, rpc: &str, target: Target, by_id: bool) -> Expect {
    use Expect::*;
    let home = caller.home();
    // What a lookup from the caller's home sees: its images and the gateway's.
    let seen_from_home = match target {
        Target::Gateway => true,
        Target::A => home == "a",
        Target::B => home == "b",
    };
    let owner = match target {
        Target::A => Some("a"),
        Target::B => Some("b"),
        Target::Gateway => None,
    };
    match rpc {
        "GetImage" | "DeleteImage" => {
            let needed = if rpc == "GetImage" {
                Role::Viewer
            } else {
                Role::Admin
            };
            // The layer: the role, somewhere.
            if caller.role() < needed {
                return Denied;
            }
            let from = if by_id { home } else { target.workspace(home) };
            if !caller.sees(from) {
                return Denied;
            }
            if by_id && !seen_from_home {
                return NotFound;
            }
            if rpc == "DeleteImage" {
                let may = match owner {
                    None => matches!(caller, Caller::Gateway(Role::Admin)),
                    Some(ws) => caller.holds(ws, Role::Admin),
                };
                if !may {
                    return Denied;
                }
            }
            Allowed
        }
        // An admin of the workspace pruned; a gateway-wide admin for the gateway's own.
        "PruneImages" => match owner {
            None if matches!(caller, Caller::Gateway(Role::Admin)) => Allowed,
            Some(ws) if caller.holds(ws, Role::Admin) => Allowed,
            _ => Denied,
        },
        "ListImages" => match target {
            // All workspaces: filtered, never refused.
            Target::Gateway => Allowed,
            _ if caller.sees(owner.unwrap_or_default()) => Allowed,
            _ => Denied,
        },
        "write" => match (caller, target) {
            (Caller::Gateway(Role::Admin), _) => Allowed,
            (Caller::Gateway(Role::Editor), Target::A | Target::B) => Allowed,
            _ => Denied,
        },
        "CreateSandbox" => {
            if !caller.holds(home, Role::Editor) {
                return Denied;
            }
            match seen_from_home {
                true => Allowed,
                false => NotFound,
            }
        }
        _ => unreachable!("{rpc}"),
    }
}

/// A token is never asked for on the command line: `--token` works and says on stderr that
/// every user can read it there (`ps`); `--token-file` and SBX_TOKEN work without a word; a
/// token file that is missing is named in the error.
#[test]
fn the_cli_takes_a_token_from_a_file_or_the_environment_and_warns_of_one_in_argv() {
    let data = common::DataDir::new();
    let d = secured(data.path(), &[]);
    let token = identity(data.path(), "cli-user", "admin", &[], &[]);
    let file = data.path().join("token");
    std::fs::write(&file, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let flag = sbx(&d.endpoint(), &["--token", &token, "workspace", "list"]);
    assert_eq!(flag.code, 0, "{flag:?}");
    assert!(
        flag.stderr.contains("every user of this machine can read")
            && flag.stderr.contains("SBX_TOKEN")
            && flag.stderr.contains("--token-file"),
        "{flag:?}"
    );
    assert!(
        !flag.stderr.contains(&token),
        "the warning shows the token: {flag:?}"
    );
    let from_file = sbx(
        &d.endpoint(),
        &["--token-file", file.to_str().unwrap(), "workspace", "list"],
    );
    assert_eq!(from_file.code, 0, "{from_file:?}");
    assert!(!from_file.stderr.contains("warning"), "{from_file:?}");
    let from_env = run_bounded(
        Command::new(SBX)
            .args(["workspace", "list"])
            .env("SBX_ENDPOINT", d.endpoint())
            .env("SBX_TOKEN", &token),
        "sbx workspace list",
    );
    assert_eq!(from_env.code, 0, "{from_env:?}");
    assert!(!from_env.stderr.contains("warning"), "{from_env:?}");
    let missing = sbx(
        &d.endpoint(),
        &["--token-file", "/nonexistent/token", "workspace", "list"],
    );
    assert_ne!(missing.code, 0);
    assert!(missing.stderr.contains("/nonexistent/token"), "{missing:?}");
    let help = sbx(&d.endpoint(), &["--help"]);
    assert!(help.stdout.contains("--token-file"), "{help:?}");
}
