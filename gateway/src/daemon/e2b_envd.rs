//! E2B's in-sandbox daemon API ("envd"), what the SDKs' `commands`, `pty` and `files` speak,
//! served by the E2B listener for requests that carry `E2b-Sandbox-Id` (the SDK sends it on
//! every in-sandbox call; REST calls never do): `GET /health`; the Connect protocol's
//! `process.Process` (`Start`, `Connect`, `List`, `SendInput`, `CloseStdin`, `SendSignal`,
//! `Update`) and `filesystem.Filesystem` (`Stat`, `ListDir`, `MakeDir`, `Move`, `Remove`; the
//! watcher calls are `e2b_watch`'s) in their JSON form; `/files` (download, multipart upload);
//! and, for an `E2b-Sandbox-Port` other than [`ENVD_PORT`], a server in the sandbox. Nothing new listens inside the sandbox: a process is an exec through the gateway (the
//! same call as `sbx sandbox exec`), with stdin, a terminal and signals.
//!
//! - **Access:** each sandbox's `envdAccessToken` (answered by create and connect) is an HMAC of
//!   its id under the gateway's token key (`Sealer::token`); a call without the right
//!   `X-Access-Token` is `unauthenticated`.
//! - **Processes:** a started process gets a pid of this gateway's own (per sandbox, from 1):
//!   the SDK addresses processes by pid, an exec has none. It runs until it ends, whoever
//!   listens: a client that goes away leaves it running, reachable again by `Connect(pid)`
//!   (output from then on). `connect-timeout-ms` bounds its life, as envd's does.
//! - **Streams:** `application/connect+json`, HTTP 200, 5-byte envelopes; `start{pid}` first,
//!   output as base64 `data`, then `end{exitCode, exited, status}`, then the end-of-stream
//!   frame (an error ends the stream in band, as Connect says).
//! - **A sandbox that is gone** (deleted, paused, not Ready): `/health` answers 502 with "was
//!   not found", as E2B's proxy does, so `is_running()` is false.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use sbx_actors::{ExecOptions, SandboxSelector};
use sbx_proto::v1::{Phase, Sandbox, exec_input, exec_output};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use uuid::Uuid;

use super::e2b::{Body, E2b};

/// The largest request the daemon API reads (a SendInput's bytes, base64).
const MAX_REQUEST: usize = 8 << 20;

/// The in-sandbox daemon's port: `E2b-Sandbox-Port` names it (or nothing does) for the calls
/// served here; any other port is a server inside the sandbox.
pub const ENVD_PORT: u32 = 49983;

/// E2B's header for the token of a sandbox's other ports.
const TRAFFIC_TOKEN: &str = "e2b-traffic-access-token";

/// Events kept for a slow listener of one process before it lags (and is ended).
const EVENT_BUFFER: usize = 4096;

/// The processes this gateway started in sandboxes, by sandbox and pid.
#[derive(Default)]
pub struct Processes {
    by_sandbox: Mutex<HashMap<Uuid, Table>>,
}

#[derive(Default)]
struct Table {
    next_pid: u32,
    running: HashMap<u32, Arc<Process>>,
}

struct Process {
    config: Value,
    tag: Option<String>,
    input: mpsc::Sender<exec_input::Input>,
    events: broadcast::Sender<Value>,
}

impl Processes {
    fn add(&self, sandbox: Uuid, process: Process) -> (u32, Arc<Process>) {
        let mut all = sbx_drivers::locked(&self.by_sandbox);
        let table = all.entry(sandbox).or_default();
        table.next_pid += 1;
        let pid = table.next_pid;
        let process = Arc::new(process);
        table.running.insert(pid, Arc::clone(&process));
        (pid, process)
    }

    fn get(&self, sandbox: Uuid, pid: u32) -> Option<Arc<Process>> {
        sbx_drivers::locked(&self.by_sandbox)
            .get(&sandbox)
            .and_then(|t| t.running.get(&pid).cloned())
    }

    fn remove(&self, sandbox: Uuid, pid: u32) {
        let mut all = sbx_drivers::locked(&self.by_sandbox);
        if let Some(table) = all.get_mut(&sandbox) {
            table.running.remove(&pid);
        }
    }

    fn list(&self, sandbox: Uuid) -> Vec<Value> {
        sbx_drivers::locked(&self.by_sandbox)
            .get(&sandbox)
            .map(|t| {
                let mut all: Vec<(u32, Value)> = t
                    .running
                    .iter()
                    .map(|(pid, p)| {
                        let mut info = json!({"config": p.config, "pid": pid});
                        if let Some(tag) = &p.tag {
                            info["tag"] = json!(tag);
                        }
                        (*pid, info)
                    })
                    .collect();
                all.sort_by_key(|(pid, _)| *pid);
                all.into_iter().map(|(_, v)| v).collect()
            })
            .unwrap_or_default()
    }
}

/// File transfers (`/files`) one key may have at once…
pub const PER_CALLER: usize = 8;
/// …and the gateway in all.
pub const PER_GATEWAY: usize = 64;

/// The file transfers under way, in all and by key.
#[derive(Debug, Default)]
pub struct Transfers {
    by_caller: Mutex<HashMap<String, usize>>,
}

/// A transfer's turn, given back when it ends (a download's when its last byte is sent).
pub struct Turn {
    transfers: Arc<Transfers>,
    caller: String,
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut by = sbx_drivers::locked(&self.transfers.by_caller);
        if let Some(n) = by.get_mut(&self.caller) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                by.remove(&self.caller);
            }
        }
    }
}

impl Transfers {
    /// A turn for `caller`, unless it or the gateway has as many transfers as it may.
    pub fn enter(self: &Arc<Self>, caller: &str) -> Option<Turn> {
        let mut by = sbx_drivers::locked(&self.by_caller);
        let all: usize = by.values().sum();
        let mine = by.get(caller).copied().unwrap_or(0);
        if mine >= PER_CALLER || all >= PER_GATEWAY {
            return None;
        }
        *by.entry(caller.to_string()).or_insert(0) += 1;
        Some(Turn {
            transfers: Arc::clone(self),
            caller: caller.to_string(),
        })
    }
}

/// How long a request's body may take to arrive whole (its head has its own deadline): a
/// body dripped a byte at a time holds its connection no longer.
pub(super) const BODY_DEADLINE: Duration = Duration::from_secs(30);

/// A request body of at most `limit` bytes, read within [`BODY_DEADLINE`]; why not, else.
pub(super) async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, String> {
    match tokio::time::timeout(BODY_DEADLINE, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) => Err(format!("the request body (at most {limit} bytes): {e}")),
        Err(_) => Err(format!(
            "the request body did not arrive within {} s",
            BODY_DEADLINE.as_secs()
        )),
    }
}

/// Reads and drops what is left of a refused request's body — at most 64 KiB, for at most a
/// second — so that a client still sending it reads the refusal rather than a broken pipe.
async fn drain(body: Incoming) {
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        Limited::new(body, 64 << 10).collect(),
    )
    .await;
}

/// The in-sandbox calls served here, by path: what an audit line may call a request (any
/// other path is `other`).
const RPCS: &[&str] = &[
    "/files",
    "/health",
    "/process.Process/Start",
    "/process.Process/Connect",
    "/process.Process/List",
    "/process.Process/SendInput",
    "/process.Process/CloseStdin",
    "/process.Process/SendSignal",
    "/process.Process/Update",
    "/filesystem.Filesystem/Stat",
    "/filesystem.Filesystem/ListDir",
    "/filesystem.Filesystem/MakeDir",
    "/filesystem.Filesystem/Move",
    "/filesystem.Filesystem/Remove",
    "/filesystem.Filesystem/WatchDir",
    "/filesystem.Filesystem/CreateWatcher",
    "/filesystem.Filesystem/GetWatcherEvents",
    "/filesystem.Filesystem/RemoveWatcher",
];

/// A request's path as an audit line may say it.
fn rpc_label(path: &str) -> &str {
    RPCS.iter()
        .find(|r| **r == path)
        .copied()
        .unwrap_or("other")
}

/// The audit line of an in-sandbox call refused for its token (no caller to name but what
/// the refusal says).
fn audit_refused(id: &str, what: &str, why: &super::e2b_token::Refused) {
    tracing::info!(
        target: "sbx::audit",
        action = %format!("e2b {what}"),
        object = %super::e2b::e2b_id(id),
        reason = %why,
        "refused"
    );
}

/// A Connect error (unary): its code string and HTTP status.
pub(super) fn connect_error(code: &str, message: impl Into<String>) -> Response<Body> {
    let status = match code {
        "invalid_argument" | "failed_precondition" | "out_of_range" => StatusCode::BAD_REQUEST,
        "unauthenticated" => StatusCode::UNAUTHORIZED,
        "permission_denied" => StatusCode::FORBIDDEN,
        "not_found" => StatusCode::NOT_FOUND,
        "already_exists" | "aborted" => StatusCode::CONFLICT,
        "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
        "unimplemented" => StatusCode::NOT_IMPLEMENTED,
        "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    super::e2b::json_response(status, &json!({"code": code, "message": message.into()}))
}

/// The Connect code of a gateway error.
pub(super) fn code_of(e: &sbx_actors::ActorError) -> &'static str {
    use sbx_actors::ActorError as E;
    match e {
        E::SandboxNotFound { .. } | E::ObjectNotFound { .. } => "not_found",
        E::InvalidArgument(_) => "invalid_argument",
        E::FailedPrecondition(_) => "failed_precondition",
        E::Unavailable(_) | E::HeldElsewhere { .. } => "unavailable",
        E::Driver(d) if d.is_transient() => "unavailable",
        E::Driver(sbx_drivers::DriverError::InvalidArgument(_)) => "invalid_argument",
        E::Driver(sbx_drivers::DriverError::NotFound { .. }) => "not_found",
        _ => "internal",
    }
}

/// An enveloped stream message: flags, big-endian length, the JSON.
pub(super) fn frame(flags: u8, value: &Value) -> Bytes {
    let json = value.to_string().into_bytes();
    let mut out = Vec::with_capacity(json.len() + 5);
    out.push(flags);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    Bytes::from(out)
}

/// The messages of an enveloped request body (a streaming call's; one for Start and Connect).
fn unframe(mut body: &[u8]) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            return Err("a Connect envelope shorter than its 5-byte header".into());
        }
        let flags = body[0];
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if body.len() < 5 + len {
            return Err(format!(
                "a Connect envelope says {len} bytes and holds fewer"
            ));
        }
        if flags & 0x01 != 0 {
            return Err("compressed Connect messages are not accepted".into());
        }
        let message: Value = serde_json::from_slice(&body[5..5 + len])
            .map_err(|e| format!("a Connect message is not JSON: {e}"))?;
        if flags & 0x02 == 0 {
            out.push(message);
        }
        body = &body[5 + len..];
    }
    Ok(out)
}

/// A server stream's answer: HTTP 200, `application/connect+json`, the frames `frames` yields.
pub(super) fn stream_response(frames: mpsc::Receiver<Bytes>) -> Response<Body> {
    let frames = tokio_stream::wrappers::ReceiverStream::new(frames);
    let body = StreamBody::new(frames.map(|b| Ok::<_, std::convert::Infallible>(Frame::data(b))));
    let mut response = Response::new(BodyExt::map_err(body, |never| match never {}).boxed());
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        "application/connect+json".parse().expect("a header value"),
    );
    response
}

/// A server stream that is only an error (in band, as Connect streams answer).
pub(super) fn stream_error(code: &str, message: &str) -> Response<Body> {
    let end = frame(0x02, &json!({"error": {"code": code, "message": message}}));
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(end);
    stream_response(rx)
}

/// Serves one in-sandbox call; `id` is the request's `E2b-Sandbox-Id`.
pub async fn handle(e2b: &E2b, id: &str, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let Some(uuid) = super::e2b::e2b_id_to_uuid(id) else {
        return gone(id);
    };
    let sandbox = match e2b.gateway.get_sandbox(&SandboxSelector::Id(uuid)).await {
        Ok(s) => s,
        Err(_) => return gone(id),
    };
    // The caller the request's sandbox token stands for (`e2b_token`): the identity whose
    // key the token was minted for, while that key and its grant last.
    let verified = |header: &str| {
        let token = req
            .headers()
            .get(header)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        super::e2b_token::verify(e2b, token, &sandbox.id, &sandbox.workspace_id)
    };
    let port = match req.headers().get("e2b-sandbox-port") {
        None => ENVD_PORT,
        Some(v) => match v.to_str().ok().and_then(|p| p.trim().parse::<u16>().ok()) {
            Some(p) if p > 0 => u32::from(p),
            _ => {
                return super::e2b::json_response(
                    StatusCode::BAD_REQUEST,
                    &json!({"code": 400, "message": "E2b-Sandbox-Port is not a TCP port (1-65535)"}),
                );
            }
        },
    };
    if port != ENVD_PORT {
        // A server in the sandbox: reached by who holds the sandbox's access token (as the
        // SDK's X-Access-Token, or E2B's traffic token header), never by anyone who can guess
        // an id. Neither token goes on into the sandbox.
        let caller = match verified("x-access-token").or_else(|_| verified(TRAFFIC_TOKEN)) {
            Ok(caller) => caller,
            Err(why) => {
                audit_refused(&sandbox.id, "port forward", &why);
                return super::e2b::json_response(
                    StatusCode::UNAUTHORIZED,
                    &json!({"code": 401, "message": format!(
                        "port {port} of sandbox {id} wants the sandbox's access token \
                         (X-Access-Token or {TRAFFIC_TOKEN})"
                    )}),
                );
            }
        };
        super::e2b::prove(&req);
        crate::service::audit(
            &caller,
            "e2b port forward",
            &format!("{}:{port}", super::e2b::e2b_id(&sandbox.id)),
        );
        let mut req = req;
        for header in [
            "x-access-token",
            TRAFFIC_TOKEN,
            "e2b-sandbox-id",
            "e2b-sandbox-port",
        ] {
            req.headers_mut().remove(header);
        }
        return super::service_routes::forward(
            &e2b.gateway,
            uuid,
            port,
            req,
            super::service_routes::Wake::AsCaller,
        )
        .await;
    }
    // Every call, /health included, wants the token: nobody learns whether a sandbox is
    // there without it.
    let caller = match verified("x-access-token") {
        Ok(caller) => caller,
        Err(why) => {
            audit_refused(&sandbox.id, rpc_label(&path), &why);
            // A client still sending its body would see a broken pipe, not the refusal:
            // what a small request still sends is read (bounded) before the answer.
            drain(req.into_body()).await;
            return connect_error(
                "unauthenticated",
                "the sandbox's access token (X-Access-Token) is missing or wrong",
            );
        }
    };
    super::e2b::prove(&req);
    if path == "/health" {
        return health(&sandbox, id);
    }
    crate::service::audit(
        &caller,
        &format!("e2b {}", rpc_label(&path)),
        &super::e2b::e2b_id(&sandbox.id),
    );
    if path == "/files" {
        // Bounded per caller and per gateway: a file streams in constant memory, but each
        // holds an exec, a connection and a task for its length.
        let Some(turn) = e2b.transfers.enter(&caller.name) else {
            return file_error(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "too many file transfers at once (at most {PER_CALLER} of one key, \
                     {PER_GATEWAY} in all): try again when one has ended"
                ),
            );
        };
        return files(e2b, uuid, req, turn).await;
    }
    let streaming = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/connect+json"));
    // Seconds between keepalive events on a process stream, as the client asks (1 s to 1 h).
    let keepalive = req
        .headers()
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|s| Duration::from_secs(s.clamp(1, 3600)));
    let timeout_ms: Option<u64> = req
        .headers()
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let bytes = match read_body(req.into_body(), MAX_REQUEST).await {
        Ok(b) => b,
        Err(e) => return connect_error("resource_exhausted", e),
    };
    let message = if streaming {
        match unframe(&bytes) {
            Ok(mut messages) if messages.len() == 1 => messages.remove(0),
            Ok(messages) => {
                return stream_error(
                    "invalid_argument",
                    &format!("one request message expected, got {}", messages.len()),
                );
            }
            Err(e) => return stream_error("invalid_argument", &e),
        }
    } else {
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) => v,
            Err(e) => {
                return connect_error("invalid_argument", format!("the request is not JSON: {e}"));
            }
        }
    };
    match path.as_str() {
        "/process.Process/Start" if streaming => {
            start(e2b, &sandbox, uuid, &message, timeout_ms, keepalive).await
        }
        "/process.Process/Connect" if streaming => connect(e2b, uuid, &message, keepalive),
        "/process.Process/List" => super::e2b::json_response(
            StatusCode::OK,
            &json!({"processes": e2b.processes.list(uuid)}),
        ),
        "/process.Process/SendInput"
        | "/process.Process/CloseStdin"
        | "/process.Process/SendSignal"
        | "/process.Process/Update" => unary(e2b, uuid, &path, &message).await,
        "/filesystem.Filesystem/Stat"
        | "/filesystem.Filesystem/ListDir"
        | "/filesystem.Filesystem/MakeDir"
        | "/filesystem.Filesystem/Move"
        | "/filesystem.Filesystem/Remove" => filesystem(e2b, uuid, &path, &message).await,
        "/filesystem.Filesystem/WatchDir" if streaming => {
            super::e2b_watch::stream(e2b, uuid, &message, keepalive).await
        }
        "/filesystem.Filesystem/CreateWatcher"
        | "/filesystem.Filesystem/GetWatcherEvents"
        | "/filesystem.Filesystem/RemoveWatcher" => {
            super::e2b_watch::unary(e2b, uuid, &path, &message).await
        }
        _ => connect_error("unimplemented", format!("{path} is not served here")),
    }
}

/// `/health`: 204 while the sandbox runs, else 502 saying it "was not found".
fn health(sandbox: &Sandbox, id: &str) -> Response<Body> {
    if sandbox.phase() == Phase::Ready {
        let mut r = Response::new(
            Full::new(Bytes::new())
                .map_err(|never| match never {})
                .boxed(),
        );
        *r.status_mut() = StatusCode::NO_CONTENT;
        return r;
    }
    gone(id)
}

/// What E2B's proxy answers for a sandbox that does not run.
fn gone(id: &str) -> Response<Body> {
    super::e2b::json_response(
        StatusCode::BAD_GATEWAY,
        &json!({"sandboxId": id, "message": "The sandbox was not found", "code": 502}),
    )
}

/// `Start`: the command as an exec of the sandbox, its events to this caller and to any later
/// `Connect`.
async fn start(
    e2b: &E2b,
    sandbox: &Sandbox,
    uuid: Uuid,
    message: &Value,
    timeout_ms: Option<u64>,
    keepalive: Option<Duration>,
) -> Response<Body> {
    let process = &message["process"];
    let Some(cmd) = process["cmd"].as_str().filter(|c| !c.is_empty()) else {
        return stream_error("invalid_argument", "process.cmd is required");
    };
    let mut command = vec![cmd.to_string()];
    for arg in process["args"].as_array().into_iter().flatten() {
        match arg.as_str() {
            Some(a) => command.push(a.to_string()),
            None => return stream_error("invalid_argument", "process.args must be strings"),
        }
    }
    let mut env = HashMap::new();
    for (k, v) in process["envs"].as_object().into_iter().flatten() {
        match v.as_str() {
            Some(v) => {
                env.insert(k.clone(), v.to_string());
            }
            None => return stream_error("invalid_argument", "process.envs must be strings"),
        }
    }
    let pty = message["pty"]["size"]
        .as_object()
        .map(|size| sbx_proto::v1::Tty {
            rows: size.get("rows").and_then(Value::as_u64).unwrap_or(24) as u32,
            cols: size.get("cols").and_then(Value::as_u64).unwrap_or(80) as u32,
            term: String::new(),
        });
    // envd's default: stdin open unless asked otherwise (the SDK's run() sends false).
    let stdin = message["stdin"].as_bool().unwrap_or(true) || pty.is_some();
    // A relative cwd is under the home directory, as envd takes it: the command starts in a
    // shell that goes there first (an absolute one is the exec's own working directory).
    let cwd = process["cwd"].as_str().unwrap_or("").to_string();
    let workdir = if cwd.is_empty() || cwd.starts_with('/') {
        cwd
    } else {
        let mut wrapped = vec![
            "/bin/sh".to_string(),
            "-c".to_string(),
            r#"cd "$HOME" 2>/dev/null || cd /; cd -- "$1" && shift && exec "$@""#.to_string(),
            "sh".to_string(),
            cwd,
        ];
        wrapped.append(&mut command);
        command = wrapped;
        String::new()
    };
    let opts = ExecOptions {
        env,
        timeout_seconds: timeout_ms
            .map_or(0, |ms| ms.div_ceil(1000).min(u64::from(u32::MAX)) as u32),
        workdir,
        stdin,
        tty: pty.clone(),
    };
    let (input_tx, input_rx) = mpsc::channel::<exec_input::Input>(64);
    let inputs: sbx_actors::ExecInputs =
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(input_rx));
    let output = match e2b
        .gateway
        .exec_io(&SandboxSelector::Id(uuid), command, opts, inputs)
        .await
    {
        Ok(o) => o,
        Err(e) => return stream_error(code_of(&e), &e.to_string()),
    };
    let (events, first) = broadcast::channel(EVENT_BUFFER);
    let (pid, _) = e2b.processes.add(
        uuid,
        Process {
            config: process.clone(),
            tag: message["tag"].as_str().map(str::to_string),
            input: input_tx,
            events: events.clone(),
        },
    );
    tracing::debug!(sandbox = %sandbox.id, pid, "e2b: a process started");
    let processes = Arc::clone(&e2b.processes);
    let on_terminal = pty.is_some();
    tokio::spawn(async move {
        let mut output = output;
        let mut ended = false;
        while let Some(item) = output.next().await {
            let event = match item {
                Ok(chunk) => match chunk.chunk {
                    Some(exec_output::Chunk::Stdout(b)) if on_terminal => {
                        json!({"event": {"data": {"pty": B64.encode(b)}}})
                    }
                    Some(exec_output::Chunk::Stdout(b)) => {
                        json!({"event": {"data": {"stdout": B64.encode(b)}}})
                    }
                    Some(exec_output::Chunk::Stderr(b)) => {
                        json!({"event": {"data": {"stderr": B64.encode(b)}}})
                    }
                    // The request's deadline ended it: a Connect error, as envd's own deadline
                    // is (the SDKs raise their timeout error on it).
                    Some(exec_output::Chunk::Exit(exit)) if exit.timed_out => {
                        ended = true;
                        json!({"error": {
                            "code": "deadline_exceeded",
                            "message": "the command ran past its timeout and was killed",
                        }})
                    }
                    Some(exec_output::Chunk::Exit(exit)) => {
                        ended = true;
                        end_event(&exit)
                    }
                    None => continue,
                },
                Err(e) => {
                    ended = true;
                    json!({"error": {"code": code_of(&e), "message": e.to_string()}})
                }
            };
            let _ = events.send(event);
        }
        if !ended {
            let _ = events.send(json!({"error": {"code": "unavailable", "message": "the connection to the process ended"}}));
        }
        processes.remove(uuid, pid);
    });
    listen(pid, first, keepalive)
}

fn end_event(exit: &sbx_proto::v1::ExecExit) -> Value {
    let (code, status) = if exit.signal != 0 {
        (-1, format!("signal: {}", signal_name(exit.signal)))
    } else {
        (exit.code, format!("exit status {}", exit.code))
    };
    let mut end = json!({"exitCode": code, "exited": exit.signal == 0, "status": status});
    if code != 0 {
        end["error"] = json!(status);
    }
    json!({"event": {"end": end}})
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        9 => "killed",
        15 => "terminated",
        2 => "interrupt",
        _ => "signaled",
    }
}

/// A process's events as a Connect stream: `start{pid}`, what comes, the end-of-stream frame.
fn listen(
    pid: u32,
    mut events: broadcast::Receiver<Value>,
    keepalive: Option<Duration>,
) -> Response<Body> {
    let frames = async_stream(move |tx: mpsc::Sender<Bytes>| async move {
        if tx
            .send(frame(0, &json!({"event": {"start": {"pid": pid}}})))
            .await
            .is_err()
        {
            return;
        }
        // A process silent for long still says it lives, every interval the client asked for
        // (`Keepalive-Ping-Interval`), so that no reader times out on a quiet command.
        let mut ticks = keepalive.map(|every| {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            let received = tokio::select! {
                // The client left: this listener ends now, not at the process's next output.
                _ = tx.closed() => return,
                received = events.recv() => received,
                _ = async {
                    match ticks.as_mut() {
                        Some(t) => t.tick().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if tx.send(frame(0, &json!({"event": {"keepalive": {}}}))).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            match received {
                Ok(event) if event.get("error").is_some() => {
                    let _ = tx.send(frame(0x02, &event)).await;
                    return;
                }
                Ok(event) => {
                    let last = event["event"].get("end").is_some();
                    if tx.send(frame(0, &event)).await.is_err() {
                        return;
                    }
                    if last {
                        let _ = tx.send(frame(0x02, &json!({}))).await;
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    let _ = tx
                        .send(frame(
                            0x02,
                            &json!({"error": {"code": "resource_exhausted", "message": format!("this listener fell {n} events behind the process's output")}}),
                        ))
                        .await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => {
                    let _ = tx.send(frame(0x02, &json!({}))).await;
                    return;
                }
            }
        }
    });
    stream_response(frames)
}

/// A stream fed by a task (`body` sends into it); the task ends with the stream's reader.
pub(super) fn async_stream<F, Fut>(body: F) -> mpsc::Receiver<Bytes>
where
    F: FnOnce(mpsc::Sender<Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(body(tx));
    rx
}

fn pid_of(message: &Value) -> Option<u32> {
    message["process"]["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
}

/// `Connect(pid)`: the process's events from now on.
fn connect(e2b: &E2b, uuid: Uuid, message: &Value, keepalive: Option<Duration>) -> Response<Body> {
    match pid_of(message).and_then(|pid| e2b.processes.get(uuid, pid).map(|p| (pid, p))) {
        Some((pid, process)) => listen(pid, process.events.subscribe(), keepalive),
        None => stream_error("not_found", "no process with that pid runs in this sandbox"),
    }
}

/// SendInput, CloseStdin, SendSignal, Update: input to a running process.
async fn unary(e2b: &E2b, uuid: Uuid, path: &str, message: &Value) -> Response<Body> {
    let Some(process) = pid_of(message).and_then(|pid| e2b.processes.get(uuid, pid)) else {
        return connect_error("not_found", "no process with that pid runs in this sandbox");
    };
    let input = match path {
        "/process.Process/SendInput" => {
            let data = message["input"]["stdin"]
                .as_str()
                .or_else(|| message["input"]["pty"].as_str())
                .unwrap_or("");
            match B64.decode(data) {
                Ok(bytes) => exec_input::Input::Stdin(bytes),
                Err(e) => {
                    return connect_error("invalid_argument", format!("input is not base64: {e}"));
                }
            }
        }
        "/process.Process/CloseStdin" => exec_input::Input::CloseStdin(true),
        "/process.Process/SendSignal" => {
            let signal = match &message["signal"] {
                Value::String(s) if s == "SIGNAL_SIGKILL" => 9,
                Value::String(s) if s == "SIGNAL_SIGTERM" => 15,
                Value::Number(n) if matches!(n.as_i64(), Some(9 | 15)) => {
                    n.as_i64().unwrap_or(9) as i32
                }
                other => {
                    return connect_error(
                        "invalid_argument",
                        format!("signal {other} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM"),
                    );
                }
            };
            exec_input::Input::Signal(signal)
        }
        _ => {
            let size = &message["pty"]["size"];
            exec_input::Input::Resize(sbx_proto::v1::TerminalSize {
                rows: size["rows"].as_u64().unwrap_or(24) as u32,
                cols: size["cols"].as_u64().unwrap_or(80) as u32,
            })
        }
    };
    if process.input.send(input).await.is_err() {
        return connect_error("not_found", "the process has ended");
    }
    super::e2b::json_response(StatusCode::OK, &json!({}))
}

// ---------------------------------------------------------------------------------------------
// Files: each operation is a short script run as an exec in the sandbox (its own userland's
// `stat`, `find`, `mkdir`, `mv`, `rm`, `cat`), relative paths resolved against the exec's
// `$HOME`. Its exit status says which refusal it was.

/// The largest upload one `/files` POST takes (the SDK sends a file in one request).
const MAX_UPLOAD: u64 = 1 << 30;

/// The exit statuses the scripts use: not found, not a directory (or a directory where a
/// file is wanted), already exists.
const NOT_FOUND: i32 = 44;
const NOT_A_DIRECTORY: i32 = 45;
const EXISTS: i32 = 46;
const NOT_A_FILE: i32 = 47;

/// Every script's start: `$p` is `$1` made absolute against `$HOME` (or `/`); `entry PATH`
/// prints `PATH|TYPE|SIZE|MODE|PERMISSIONS|OWNER|GROUP|MTIME`.
const PRELUDE: &str = r#"cd "$HOME" 2>/dev/null || cd /
abs() { case "$1" in /*) printf '%s' "$1";; *) printf '%s/%s' "${PWD%/}" "$1";; esac; }
p=$(abs "$1")
entry() { printf '%s|' "$1"; stat -c '%F|%s|%a|%A|%U|%G|%Y' -- "$1"; }
"#;

/// What a script answered: exit status, stdout, stderr.
pub(super) struct Ran {
    pub(super) code: i32,
    pub(super) stdout: Vec<u8>,
    pub(super) stderr: String,
}

/// How much of a script's output the gateway holds, and for how long the script may run: the
/// sandbox writes that output (its own `stat`, `find`, `cat`), so neither may be its to set.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    pub(super) stdout: usize,
    pub(super) seconds: u32,
}

/// A listing or a file's facts: 16 MiB of output, a minute.
pub(super) const FACTS: Bounds = Bounds {
    stdout: 16 << 20,
    seconds: 60,
};

/// How long a file's bytes may take in or out (they stream: nothing of them is gathered).
const CONTENT_SECONDS: u32 = 600;

/// What an upload's script answers (the path it wrote): a line.
const WRITTEN: Bounds = Bounds {
    stdout: 64 << 10,
    seconds: CONTENT_SECONDS,
};

/// What a script's stderr keeps (it only goes into messages).
const MAX_STDERR: usize = 64 << 10;

/// The output of a script started by [`start_script`].
type ScriptOutput = std::pin::Pin<
    Box<
        dyn futures::Stream<Item = Result<sbx_proto::v1::ExecOutput, sbx_actors::ActorError>>
            + Send,
    >,
>;

/// Starts `body` (after [`PRELUDE`]) with `args` in the sandbox for at most `seconds`; with
/// `stdin`, what that channel carries is its input (a `CloseStdin` ends it). Its output as it
/// comes, for the caller to pace (an exec's output is bounded end to end: the sandbox waits
/// while the caller does not read).
async fn start_script(
    e2b: &E2b,
    uuid: Uuid,
    body: &str,
    args: &[&str],
    stdin: Option<mpsc::Receiver<exec_input::Input>>,
    seconds: u32,
) -> Result<ScriptOutput, sbx_actors::ActorError> {
    let mut command = vec![
        "sh".to_string(),
        "-c".to_string(),
        format!("{PRELUDE}{body}"),
        "sh".to_string(),
    ];
    command.extend(args.iter().map(|a| a.to_string()));
    let feeding = stdin.is_some();
    let rx = stdin.unwrap_or_else(|| mpsc::channel(1).1);
    let opts = ExecOptions {
        stdin: feeding,
        timeout_seconds: seconds,
        ..Default::default()
    };
    let output = e2b
        .gateway
        .exec_io(
            &SandboxSelector::Id(uuid),
            command,
            opts,
            Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)),
        )
        .await?;
    Ok(Box::pin(output))
}

/// Runs `body` (after [`PRELUDE`]) with `args` in the sandbox, `stdin` as its input, within
/// `bounds`: output past them ends the script, refused as `FailedPrecondition`.
pub(super) async fn script(
    e2b: &E2b,
    uuid: Uuid,
    body: &str,
    args: &[&str],
    stdin: Option<Bytes>,
    bounds: Bounds,
) -> Result<Ran, sbx_actors::ActorError> {
    let input = stdin.map(|data| {
        let (tx, rx) = mpsc::channel::<exec_input::Input>(8);
        tokio::spawn(async move {
            for piece in data.chunks(64 * 1024) {
                if tx
                    .send(exec_input::Input::Stdin(piece.to_vec()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            let _ = tx.send(exec_input::Input::CloseStdin(true)).await;
        });
        rx
    });
    let mut output = start_script(e2b, uuid, body, args, input, bounds.seconds).await?;
    collect(&mut output, bounds).await
}

/// What a script said until it ended, within `bounds`.
async fn collect(output: &mut ScriptOutput, bounds: Bounds) -> Result<Ran, sbx_actors::ActorError> {
    let (mut stdout, mut stderr, mut code) = (Vec::new(), Vec::new(), -1);
    while let Some(chunk) = output.next().await {
        match chunk?.chunk {
            Some(exec_output::Chunk::Stdout(b)) => {
                if stdout.len() + b.len() > bounds.stdout {
                    // Dropping the stream ends the exec.
                    return Err(sbx_actors::ActorError::FailedPrecondition(format!(
                        "the answer is larger than the {} bytes the gateway takes",
                        bounds.stdout
                    )));
                }
                stdout.extend(b)
            }
            Some(exec_output::Chunk::Stderr(b)) => {
                let room = MAX_STDERR.saturating_sub(stderr.len());
                stderr.extend(&b[..b.len().min(room)]);
            }
            Some(exec_output::Chunk::Exit(exit)) if exit.timed_out => {
                return Err(sbx_actors::ActorError::FailedPrecondition(format!(
                    "the sandbox did not answer within {} s",
                    bounds.seconds
                )));
            }
            Some(exec_output::Chunk::Exit(exit)) => code = exit.code,
            None => {}
        }
    }
    Ok(Ran {
        code,
        stdout,
        stderr: String::from_utf8_lossy(&stderr).trim().to_string(),
    })
}

/// An `entry` line as an `EntryInfo` (the path may hold `|`: the fields are split from the
/// right).
fn entry_info(line: &str) -> Option<Value> {
    let mut fields: Vec<&str> = line.rsplitn(8, '|').collect();
    if fields.len() != 8 {
        return None;
    }
    fields.reverse();
    let path = fields[0];
    let kind = match fields[1] {
        "directory" => "FILE_TYPE_DIRECTORY",
        "symbolic link" => "FILE_TYPE_SYMLINK",
        t if t.contains("file") => "FILE_TYPE_FILE",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let mode = u32::from_str_radix(fields[3], 8).unwrap_or(0);
    let mtime: u64 = fields[7].trim().parse().unwrap_or(0);
    let name = path.rsplit('/').next().unwrap_or(path);
    Some(json!({
        "name": name,
        "type": kind,
        "path": path,
        "size": fields[2],
        "mode": mode,
        "permissions": fields[4],
        "owner": fields[5],
        "group": fields[6],
        // The sandbox's `stat` says it: a time past what the clock holds is none.
        "modifiedTime": sbx_agent::log::rfc3339_nanos(
            std::time::UNIX_EPOCH
                .checked_add(std::time::Duration::from_secs(mtime))
                .unwrap_or(std::time::UNIX_EPOCH)
        ),
    }))
}

/// A script's refusal as a Connect error.
pub(super) fn refused(ran: &Ran, path: &str) -> Response<Body> {
    match ran.code {
        NOT_FOUND => connect_error("not_found", format!("path '{path}' does not exist")),
        NOT_A_DIRECTORY => connect_error(
            "invalid_argument",
            format!("path '{path}' is not a directory"),
        ),
        EXISTS => connect_error("already_exists", format!("path '{path}' already exists")),
        _ => connect_error("internal", format!("{path}: {}", ran.stderr)),
    }
}

/// Stat, ListDir, MakeDir, Move, Remove.
async fn filesystem(e2b: &E2b, uuid: Uuid, rpc: &str, message: &Value) -> Response<Body> {
    let text = |field: &str| message[field].as_str().unwrap_or("").to_string();
    let (body, args, key): (&str, Vec<String>, &str) = match rpc {
        "/filesystem.Filesystem/Stat" => (
            r#"[ -e "$p" ] || [ -L "$p" ] || exit 44; entry "$p""#,
            vec![text("path")],
            "entry",
        ),
        "/filesystem.Filesystem/ListDir" => {
            let depth = message["depth"].as_u64().unwrap_or(1).clamp(1, 64);
            (
                r#"[ -e "$p" ] || exit 44; [ -d "$p" ] || exit 45
find "$p" -mindepth 1 -maxdepth "$2" | while IFS= read -r f; do entry "$f"; done"#,
                vec![text("path"), depth.to_string()],
                "entries",
            )
        }
        "/filesystem.Filesystem/MakeDir" => (
            r#"[ -e "$p" ] && exit 46; mkdir -p -- "$p" && entry "$p""#,
            vec![text("path")],
            "entry",
        ),
        "/filesystem.Filesystem/Move" => (
            r#"[ -e "$p" ] || [ -L "$p" ] || exit 44; d=$(abs "$2")
mkdir -p -- "$(dirname -- "$d")" && mv -- "$p" "$d" && entry "$d""#,
            vec![text("source"), text("destination")],
            "entry",
        ),
        // Removing what is not there succeeds, as envd's does.
        _ => (r#"rm -rf -- "$p""#, vec![text("path")], ""),
    };
    if args.iter().any(String::is_empty) {
        return connect_error("invalid_argument", "a path is required");
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let ran = match script(e2b, uuid, body, &refs, None, FACTS).await {
        Ok(r) => r,
        Err(e) => return connect_error(code_of(&e), e.to_string()),
    };
    if ran.code != 0 {
        return refused(&ran, &args[0]);
    }
    let out = String::from_utf8_lossy(&ran.stdout);
    let mut entries: Vec<Value> = out.lines().filter_map(entry_info).collect();
    // By path, as envd lists (`find` answers in the directory's own order).
    entries.sort_by(|a, b| a["path"].as_str().cmp(&b["path"].as_str()));
    let answer = match key {
        "entries" => json!({"entries": entries}),
        "entry" => match entries.into_iter().next() {
            Some(e) => json!({"entry": e}),
            None => return connect_error("internal", format!("no entry for {}", args[0])),
        },
        _ => json!({}),
    };
    super::e2b::json_response(StatusCode::OK, &answer)
}

/// A `/files` refusal: JSON `{code, message}` with its HTTP status.
fn file_error(status: StatusCode, message: String) -> Response<Body> {
    super::e2b::json_response(
        status,
        &json!({"code": status.as_u16(), "message": message}),
    )
}

/// `GET /files?path=P` (the file's bytes) and `POST /files[?path=P]` (multipart: each `file`
/// part written to its path, the query's or the part's filename).
async fn files(e2b: &E2b, uuid: Uuid, req: Request<Incoming>, turn: Turn) -> Response<Body> {
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .map(|q| super::e2b::form_pairs(q).into_iter().collect())
        .unwrap_or_default();
    let path = query.get("path").cloned().unwrap_or_default();
    if req.method() == hyper::Method::GET {
        return download(e2b, uuid, &path, turn).await;
    }
    let boundary = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|c| multer::parse_boundary(c).ok());
    let Some(boundary) = boundary else {
        return file_error(
            StatusCode::BAD_REQUEST,
            "an upload is multipart/form-data with `file` parts".into(),
        );
    };
    let stream = http_body_util::BodyStream::new(req.into_body()).filter_map(|frame| async move {
        match frame {
            Ok(f) => f.into_data().ok().map(Ok::<Bytes, hyper::Error>),
            Err(e) => Some(Err(e)),
        }
    });
    let constraints =
        multer::Constraints::new().size_limit(multer::SizeLimit::new().whole_stream(MAX_UPLOAD));
    let mut multipart = multer::Multipart::with_constraints(stream, boundary, constraints);
    let mut written = Vec::new();
    loop {
        let field = match multipart.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return file_error(StatusCode::BAD_REQUEST, format!("the upload: {e}")),
        };
        let target = if path.is_empty() {
            field.file_name().unwrap_or("").to_string()
        } else {
            path.clone()
        };
        if target.is_empty() {
            return file_error(StatusCode::BAD_REQUEST, "a file part names no path".into());
        }
        let ran = match upload(e2b, uuid, &target, field).await {
            Ok(r) => r,
            Err(response) => return response,
        };
        if ran.code != 0 {
            return file_error(
                StatusCode::BAD_REQUEST,
                format!("cannot write '{target}': {}", ran.stderr),
            );
        }
        let full = String::from_utf8_lossy(&ran.stdout).to_string();
        let name = full.rsplit('/').next().unwrap_or(&full).to_string();
        written.push(json!({"path": full, "name": name, "type": "file"}));
    }
    if written.is_empty() {
        return file_error(
            StatusCode::BAD_REQUEST,
            "the upload holds no file part".into(),
        );
    }
    super::e2b::json_response(StatusCode::OK, &Value::Array(written))
}

/// One file part of an upload written to `target` as it arrives: its chunks are the input of
/// the sandbox's `cat` (a bounded channel: the client's upload waits while the sandbox
/// writes), so no file is held whole in the gateway. Like envd, it writes in place: an upload
/// cut short leaves what arrived. The script's answer, or the response that says why not.
async fn upload(
    e2b: &E2b,
    uuid: Uuid,
    target: &str,
    mut field: multer::Field<'_>,
) -> Result<Ran, Response<Body>> {
    let (tx, rx) = mpsc::channel::<exec_input::Input>(4);
    let mut output = start_script(
        e2b,
        uuid,
        r#"[ -d "$p" ] && exit 45; mkdir -p -- "$(dirname -- "$p")" && cat > "$p" && printf '%s' "$p""#,
        &[target],
        Some(rx),
        CONTENT_SECONDS,
    )
    .await
    .map_err(|e| file_error(StatusCode::BAD_GATEWAY, e.to_string()))?;
    let feed = async move {
        loop {
            match field.chunk().await {
                Ok(Some(bytes)) => {
                    for piece in bytes.chunks(64 * 1024) {
                        if tx
                            .send(exec_input::Input::Stdin(piece.to_vec()))
                            .await
                            .is_err()
                        {
                            // The script ended early; what it said tells why.
                            return Ok(());
                        }
                    }
                }
                Ok(None) => {
                    let _ = tx.send(exec_input::Input::CloseStdin(true)).await;
                    return Ok(());
                }
                Err(e) => {
                    return Err(file_error(
                        StatusCode::BAD_REQUEST,
                        format!("the upload: {e}"),
                    ));
                }
            }
        }
    };
    let ran = async {
        collect(&mut output, WRITTEN)
            .await
            .map_err(|e| file_error(StatusCode::BAD_GATEWAY, e.to_string()))
    };
    // A broken upload ends the script (its output stream, dropped, ends the exec).
    let ((), ran) = futures::future::try_join(feed, ran).await?;
    Ok(ran)
}

/// `GET /files?path=P`: the file's bytes as the sandbox's `cat` writes them, streamed (the
/// sandbox waits while the client does not read: nothing of the file is held whole), or why
/// not. A file that fails part-way (removed, unreadable) ends the body with an error, so the
/// client sees a broken transfer, never a short file as a whole one.
async fn download(e2b: &E2b, uuid: Uuid, path: &str, turn: Turn) -> Response<Body> {
    if path.is_empty() {
        return file_error(StatusCode::BAD_REQUEST, "path is required".into());
    }
    let ran = match script(
        e2b,
        uuid,
        // A regular file only (through links): a device or a FIFO is no file's bytes.
        r#"[ -e "$p" ] || exit 44; [ -d "$p" ] && exit 45; [ -f "$p" ] || exit 47; printf ok"#,
        &[path],
        None,
        FACTS,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return file_error(StatusCode::BAD_GATEWAY, e.to_string()),
    };
    match ran.code {
        0 => {
            let output = match start_script(
                e2b,
                uuid,
                r#"exec cat -- "$p""#,
                &[path],
                None,
                CONTENT_SECONDS,
            )
            .await
            {
                Ok(o) => o,
                Err(e) => return file_error(StatusCode::BAD_GATEWAY, e.to_string()),
            };
            type Error = Box<dyn std::error::Error + Send + Sync>;
            let frames = output.filter_map(|item| async move {
                match item.map(|o| o.chunk) {
                    Ok(Some(exec_output::Chunk::Stdout(b))) => {
                        Some(Ok::<_, Error>(Frame::data(Bytes::from(b))))
                    }
                    Ok(Some(exec_output::Chunk::Exit(exit))) if exit.code == 0 => None,
                    Ok(Some(exec_output::Chunk::Exit(exit))) => Some(Err(format!(
                        "the file's read ended with status {}{}",
                        exit.code,
                        if exit.timed_out { " (timed out)" } else { "" }
                    )
                    .into())),
                    Ok(_) => None,
                    Err(e) => Some(Err(e.to_string().into())),
                }
            });
            // Through a channel of two chunks (a body must be Sync; the exec's stream is not):
            // the pace is still the client's, and a client gone ends the exec.
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Error>>(2);
            tokio::spawn(async move {
                // The transfer's turn lasts as long as its bytes flow.
                let _turn = turn;
                let mut frames = std::pin::pin!(frames);
                while let Some(frame) = frames.next().await {
                    if tx.send(frame).await.is_err() {
                        return;
                    }
                }
            });
            let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            let mut r = Response::new(BodyExt::boxed(body));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                "application/octet-stream".parse().expect("a header value"),
            );
            r
        }
        NOT_FOUND => file_error(
            StatusCode::NOT_FOUND,
            format!("path '{path}' does not exist"),
        ),
        NOT_A_DIRECTORY => file_error(
            StatusCode::BAD_REQUEST,
            format!("path '{path}' is a directory"),
        ),
        NOT_A_FILE => file_error(
            StatusCode::BAD_REQUEST,
            format!("path '{path}' is not a regular file"),
        ),
        _ => file_error(StatusCode::INTERNAL_SERVER_ERROR, ran.stderr),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key has at most PER_CALLER transfers at once, the gateway PER_GATEWAY; a turn
    /// ended is given back.
    #[test]
    fn file_transfers_are_bounded_per_key_and_in_all() {
        let transfers = Arc::new(Transfers::default());
        let mine: Vec<Turn> = (0..PER_CALLER)
            .map(|_| transfers.enter("a").expect("a turn"))
            .collect();
        assert!(transfers.enter("a").is_none(), "past the key's bound");
        let mut others = Vec::new();
        for i in 0..(PER_GATEWAY - PER_CALLER) {
            others.push(
                transfers
                    .enter(&format!("k{}", i % 7))
                    .expect("another key's turn"),
            );
        }
        assert!(transfers.enter("b").is_none(), "past the gateway's bound");
        drop(mine);
        assert!(transfers.enter("a").is_some(), "a turn given back");
    }

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let one = frame(0, &json!({"a": 1}));
        let end = frame(0x02, &json!({}));
        let both = [one.as_ref(), end.as_ref()].concat();
        assert_eq!(unframe(&both).unwrap(), vec![json!({"a": 1})]);
        assert!(unframe(&one[..3]).is_err());
        assert!(unframe(&one[..one.len() - 1]).is_err());
        let mut compressed = one.to_vec();
        compressed[0] = 1;
        assert!(unframe(&compressed).is_err());
        let mut not_json = frame(0, &json!("x")).to_vec();
        not_json[5] = b'{';
        assert!(unframe(&not_json).is_err());
    }

    #[test]
    fn entries_read_as_envd_says_them() {
        let e = entry_info("/home/a|b.txt|regular file|12|644|-rw-r--r--|root|root|0").unwrap();
        assert_eq!(e["path"], "/home/a|b.txt");
        assert_eq!(e["name"], "a|b.txt");
        assert_eq!(e["type"], "FILE_TYPE_FILE");
        assert_eq!(
            (e["size"].clone(), e["mode"].clone()),
            (json!("12"), json!(420))
        );
        let d = entry_info("/d|directory|4096|755|drwxr-xr-x|u|g|5").unwrap();
        assert_eq!(d["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(entry_info("garbage"), None);
    }

    #[test]
    fn ends_say_the_exit_as_envd_does() {
        let exit = |code, signal| sbx_proto::v1::ExecExit {
            code,
            signal,
            timed_out: false,
        };
        assert_eq!(
            end_event(&exit(0, 0)),
            json!({"event": {"end": {"exitCode": 0, "exited": true, "status": "exit status 0"}}})
        );
        assert_eq!(
            end_event(&exit(3, 0))["event"]["end"]["error"],
            "exit status 3"
        );
        let killed = end_event(&exit(-1, 9));
        assert_eq!(killed["event"]["end"]["exitCode"], -1);
        assert_eq!(killed["event"]["end"]["status"], "signal: killed");
    }
}
