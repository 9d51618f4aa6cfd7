//! E2B's in-sandbox daemon API ("envd"), what the SDKs' `commands`, `pty` and `files` speak,
//! served by the E2B listener for requests that carry `E2b-Sandbox-Id` (the SDK sends it on
//! every in-sandbox call; REST calls never do): `GET /health`; the Connect protocol's
//! `process.Process` (`Start`, `Connect`, `List`, `SendInput`, `CloseStdin`, `SendSignal`,
//! `Update`) and `filesystem.Filesystem` (`Stat`, `ListDir`, `MakeDir`, `Move`, `Remove`; the
//! watcher calls are `watch`'s) in their JSON form; `/files` (download, multipart upload: `files`);
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
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use sbx_actors::ExecOptions;
use sbx_proto::v1::{Phase, Sandbox, exec_input, exec_output};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use uuid::Uuid;

use super::connect::*;
use super::files::*;
use super::{Body, E2b, drain, read_body};

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
    /// The output so far, for a `Connect` to replay ([`REPLAY_BYTES`] of it, the newest).
    output: Mutex<Replay>,
}

/// The size of an output event's data (stdout, stderr or pty, as sent: base64); None for
/// any other event.
fn output_len(event: &Value) -> Option<usize> {
    event["event"]["data"]
        .as_object()
        .and_then(|d| d.values().next())
        .and_then(Value::as_str)
        .map(str::len)
}

/// How much of a process's output a `Connect` replays: its newest 256 KiB (as sent, base64).
const REPLAY_BYTES: usize = 256 << 10;

/// A process's output events so far, the newest [`REPLAY_BYTES`] of them.
#[derive(Default)]
struct Replay {
    kept: std::collections::VecDeque<Value>,
    bytes: usize,
}

impl Process {
    /// Sends `event` to the process's listeners, keeping it for later ones if it is output
    /// (under the replay's lock: a `Connect` subscribing meanwhile sees it once, replayed or
    /// live, never twice or not at all).
    fn publish(&self, event: Value) {
        let mut replay = sbx_drivers::locked(&self.output);
        if let Some(size) = output_len(&event) {
            replay.kept.push_back(event.clone());
            replay.bytes += size;
            while replay.bytes > REPLAY_BYTES {
                let Some(old) = replay.kept.pop_front() else {
                    break;
                };
                replay.bytes = replay.bytes.saturating_sub(output_len(&old).unwrap_or(0));
            }
        }
        let _ = self.events.send(event);
    }

    /// The output so far and the events from now on, with nothing between them lost.
    fn join(&self) -> (Vec<Value>, broadcast::Receiver<Value>) {
        let replay = sbx_drivers::locked(&self.output);
        (
            replay.kept.iter().cloned().collect(),
            self.events.subscribe(),
        )
    }
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
fn audit_refused(id: &str, what: &str, why: &super::token::Refused) {
    tracing::info!(
        target: "sbx::audit",
        action = %format!("e2b {what}"),
        object = %super::e2b_id(id),
        reason = %why,
        "refused"
    );
}

/// Serves one in-sandbox call; `id` is the request's `E2b-Sandbox-Id`.
pub async fn handle(e2b: &E2b, id: &str, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let Some(uuid) = super::e2b_id_to_uuid(id) else {
        return gone(id);
    };
    let Some(sandbox) = e2b.front.sandbox_for_token(uuid).await else {
        return gone(id);
    };
    // The caller the request's sandbox token stands for (`e2b_token`): the identity whose
    // key the token was minted for, while that key and its grant last.
    let verified = |header: &str| {
        let token = req
            .headers()
            .get(header)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        super::token::verify(e2b, token, &sandbox.id, &sandbox.workspace_id)
    };
    let Some(port) = sandbox_port(req.headers()) else {
        return super::json_response(
            StatusCode::BAD_REQUEST,
            &json!({"code": 400, "message": "E2b-Sandbox-Port is not a TCP port (1-65535)"}),
        );
    };
    if port != ENVD_PORT {
        return to_port(e2b, &sandbox, id, port, req).await;
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
    super::prove(&req);
    if path == "/health" {
        return health(&sandbox, id);
    }
    let e2b = &e2b.as_caller(caller.clone());
    e2b.front.allowed(
        &caller,
        &format!("e2b {}", rpc_label(&path)),
        &super::e2b_id(&sandbox.id),
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
    // The user a command runs as: the SDK's `user=`, sent as `Basic base64(NAME:)`; none
    // is the sandbox's default user (its image's User).
    let user = match user_of(req.headers()) {
        Ok(user) => user,
        Err(message) => return connect_error("invalid_argument", message),
    };
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
            let call = Started {
                timeout_ms,
                keepalive,
                user,
            };
            start(e2b, &sandbox, uuid, &message, call).await
        }
        "/process.Process/Connect" if streaming => connect(e2b, uuid, &message, keepalive),
        "/process.Process/List" => super::json_response(
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
        | "/filesystem.Filesystem/Remove" => filesystem(e2b, uuid, &user, &path, &message).await,
        "/filesystem.Filesystem/WatchDir" if streaming => {
            super::watch::stream(e2b, uuid, &message, keepalive).await
        }
        "/filesystem.Filesystem/CreateWatcher"
        | "/filesystem.Filesystem/GetWatcherEvents"
        | "/filesystem.Filesystem/RemoveWatcher" => {
            super::watch::unary(e2b, uuid, &path, &message).await
        }
        _ => connect_error("unimplemented", format!("{path} is not served here")),
    }
}

/// A call to `port` of a sandbox (not envd's): a server in the sandbox, reached by who holds
/// the sandbox's access token (as the SDK's X-Access-Token, or E2B's traffic token header),
/// never by anyone who can guess an id. Neither token goes on into the sandbox.
async fn to_port(
    e2b: &E2b,
    sandbox: &Sandbox,
    id: &str,
    port: u32,
    req: Request<Incoming>,
) -> Response<Body> {
    let verified = |header: &str| {
        let token = req
            .headers()
            .get(header)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        super::token::verify(e2b, token, &sandbox.id, &sandbox.workspace_id)
    };
    let Ok(uuid) = Uuid::parse_str(&sandbox.id) else {
        return gone(id);
    };
    let caller = match verified("x-access-token").or_else(|_| verified(TRAFFIC_TOKEN)) {
        Ok(caller) => caller,
        Err(why) => {
            audit_refused(&sandbox.id, "port forward", &why);
            return super::json_response(
                StatusCode::UNAUTHORIZED,
                &json!({"code": 401, "message": format!(
                    "port {port} of sandbox {id} wants the sandbox's access token \
                     (X-Access-Token or {TRAFFIC_TOKEN})"
                )}),
            );
        }
    };
    super::prove(&req);
    e2b.front.allowed(
        &caller,
        "e2b port forward",
        &format!("{}:{port}", super::e2b_id(&sandbox.id)),
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
    let (up, input) = crate::http::bridge::inputs();
    match e2b
        .front
        .forward_request(Some(&caller), uuid, port, input)
        .await
    {
        Ok(output) => crate::http::bridge::send(req, up, output, uuid, port).await,
        Err(failure) => crate::http::bridge::refused(&failure),
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
    super::json_response(
        StatusCode::BAD_GATEWAY,
        &json!({"sandboxId": id, "message": "The sandbox was not found", "code": 502}),
    )
}

/// `Start`: the command as an exec of the sandbox, its events to this caller and to any later
/// `Connect`.
/// The port of the sandbox a request is for (`E2b-Sandbox-Port`; none: envd's), or `None`
/// when the header is there but no TCP port.
fn sandbox_port(headers: &hyper::HeaderMap) -> Option<u32> {
    match headers.get("e2b-sandbox-port") {
        None => Some(ENVD_PORT),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|p| p.trim().parse::<u16>().ok())
            .filter(|p| *p > 0)
            .map(u32::from),
    }
}

/// The user an envd call names: `Authorization: Basic base64(NAME:)` (E2B's SDKs send the
/// name with an empty password); no header is no user (the sandbox's default).
pub(super) fn user_of(headers: &hyper::HeaderMap) -> Result<String, String> {
    let Some(value) = headers.get(hyper::header::AUTHORIZATION) else {
        return Ok(String::new());
    };
    let bad = || "Authorization is not Basic base64(USER:), as E2B's SDKs send it".to_string();
    let text = value.to_str().map_err(|_| bad())?;
    let Some(encoded) = text.strip_prefix("Basic ") else {
        return Err(bad());
    };
    let decoded = B64.decode(encoded.trim()).map_err(|_| bad())?;
    let decoded = String::from_utf8(decoded).map_err(|_| bad())?;
    let name = decoded
        .split_once(':')
        .map_or(decoded.as_str(), |(name, _)| name);
    Ok(name.to_string())
}

/// What a process start takes besides its message: the call's deadline, keepalive and user.
struct Started {
    timeout_ms: Option<u64>,
    keepalive: Option<Duration>,
    user: String,
}

async fn start(
    e2b: &E2b,
    sandbox: &Sandbox,
    uuid: Uuid,
    message: &Value,
    call: Started,
) -> Response<Body> {
    let Started {
        timeout_ms,
        keepalive,
        user,
    } = call;
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
        user,
    };
    let (input_tx, input_rx) = mpsc::channel::<exec_input::Input>(64);
    let inputs: sbx_actors::ExecInputs =
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(input_rx));
    let output = match e2b.exec(uuid, command, opts, inputs).await {
        Ok(o) => o,
        Err(e) => return stream_error(code_of(&e), &e.to_string()),
    };
    let (events, first) = broadcast::channel(EVENT_BUFFER);
    let (pid, started) = e2b.processes.add(
        uuid,
        Process {
            config: process.clone(),
            tag: message["tag"].as_str().map(str::to_string),
            input: input_tx,
            events,
            output: Mutex::default(),
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
                    json!({"error": {"code": mid_stream_code(&e), "message": e.to_string()}})
                }
            };
            started.publish(event);
        }
        if !ended {
            started.publish(json!({"error": {"code": "unavailable", "message": "the connection to the process ended"}}));
        }
        processes.remove(uuid, pid);
    });
    listen(pid, Vec::new(), first, keepalive)
}

/// The code of an error that ended a running process's stream: its connection to the
/// process ended (the sandbox stopped or was deleted under it, its agent went) is
/// `unavailable`, as envd says it when a sandbox is killed mid-command — the SDKs then ask
/// `/health` whether the sandbox is gone and say so; anything else keeps its own code.
fn mid_stream_code(e: &crate::frontdoor::Failure) -> &'static str {
    match e.class {
        crate::frontdoor::Class::Internal | crate::frontdoor::Class::Unavailable => "unavailable",
        _ => code_of(e),
    }
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
    replay: Vec<Value>,
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
        // What the process said before this listener came (a `Connect`'s replay).
        for event in replay {
            if tx.send(frame(0, &event)).await.is_err() {
                return;
            }
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

fn pid_of(message: &Value) -> Option<u32> {
    message["process"]["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
}

/// `Connect(pid)`: the process's output so far (its newest [`REPLAY_BYTES`]), then its events
/// from now on.
fn connect(e2b: &E2b, uuid: Uuid, message: &Value, keepalive: Option<Duration>) -> Response<Body> {
    match pid_of(message).and_then(|pid| e2b.processes.get(uuid, pid).map(|p| (pid, p))) {
        Some((pid, process)) => {
            let (replay, events) = process.join();
            listen(pid, replay, events, keepalive)
        }
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
    super::json_response(StatusCode::OK, &json!({}))
}

// ---------------------------------------------------------------------------------------------
// Files: each operation is a short script run as an exec in the sandbox (its own userland's
// `stat`, `find`, `mkdir`, `mv`, `rm`, `cat`), relative paths resolved against the exec's
// `$HOME`. Its exit status says which refusal it was.

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_connect_replays_the_newest_output_once_then_follows() {
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let process = Process {
            config: json!({}),
            tag: None,
            input: mpsc::channel(1).0,
            events,
            output: Mutex::default(),
        };
        let chunk = |i: usize| json!({"event": {"data": {"stdout": format!("{i:0>1024}")}}});
        // 300 KiB of output and a keepalive: the newest 256 KiB of output is kept, in order.
        for i in 0..300 {
            process.publish(chunk(i));
        }
        process.publish(json!({"event": {"keepalive": {}}}));
        let (replay, mut live) = process.join();
        assert_eq!(replay.len(), 256);
        assert_eq!(replay.first(), Some(&chunk(44)));
        assert_eq!(replay.last(), Some(&chunk(299)));
        // What comes after the join is live, not replayed again.
        process.publish(chunk(300));
        assert_eq!(live.try_recv().unwrap(), chunk(300));
        assert!(live.try_recv().is_err());
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
