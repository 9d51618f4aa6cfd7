//! The E2B API's control plane (`sbxd serve --e2b-listen ADDR`): the REST calls the unmodified
//! E2B SDKs make (`e2b` on PyPI and npm, 2.x) to create, find, list, time out, pause, resume
//! and kill sandboxes, translated onto the same `Gateway` calls the gRPC API makes — no second
//! path to a sandbox.
//!
//! - **Who calls:** the SDK's `X-API-KEY` is an sbx token (`sbxd token create`), checked as a
//!   bearer token is, and scoped as every token is: a key of workspace A never sees or touches
//!   B's sandboxes. A sandbox is created in the key's workspace (its one grant), else in
//!   `default`. With `--auth none`, every key is a gateway-wide admin.
//! - **Ids:** an E2B sandbox id is the sbx sandbox's UUID in its simple form (32 lowercase hex
//!   digits: `[a-z0-9]`, no `-`), so it names the sandbox by its identity, never by a name.
//! - **Templates are images:** `templateID` is a name given by `--e2b-template NAME=IMAGE`, else
//!   an image reference; `base` (the SDK's default) is the gateway's default image. On a driver
//!   without images it names nothing and is kept only to be answered back.
//! - **Lifetimes:** `timeout` (300 s unless given) is the sandbox's ttl; it deletes, or pauses
//!   with `autoPause`; `set_timeout` is `SetSandboxTtl`; `pause` and `connect` are pause and
//!   resume (`connect` of a running sandbox answers 200 and only ever extends its deadline).
//! - **Answers:** every error is JSON `{"code": STATUS, "message": …}` (the SDKs read both),
//!   with `Should-Retry: false` (the SDKs would otherwise retry 5xx on their own).
//!
//! The in-sandbox daemon's API (E2B's "envd") is `e2b_envd`: the processes of `commands` and
//! `pty`, `files` and a sandbox's ports; `e2b_watch` watches directories.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use sbx_actors::{ActorError, Gateway, SandboxFilter, SandboxSelector};
use sbx_proto::v1::{Lifetime, LifetimeAction, Phase, Sandbox, SandboxSpec};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::auth::{Authenticator, Caller, Role};

pub(super) type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// The largest request body the control plane reads (a create's metadata and variables).
const MAX_BODY: usize = 1 << 20;

/// A sandbox's lifetime when the create gives no `timeout`: E2B's default.
const DEFAULT_TIMEOUT_SECONDS: u64 = 300;

/// The in-sandbox daemon's version the sandboxes report: what the SDKs gate the features
/// served here on (commands with `stdin: false` from 0.3.0, the default user from 0.4.0,
/// `close_stdin` from 0.5.2; file uploads as octet streams would need 0.5.7).
const ENVD_VERSION: &str = "0.5.2";

/// What the E2B listener needs.
#[derive(Clone)]
pub struct E2b {
    pub gateway: Arc<Gateway>,
    pub auth: Arc<Authenticator>,
    /// `--e2b-template NAME=IMAGE`.
    pub templates: Arc<BTreeMap<String, String>>,
    /// The gateway's secret key: each sandbox's access token is an HMAC under it.
    pub secrets: Arc<sbx_actors::Sealer>,
    /// The processes started through the in-sandbox API (`e2b_envd`).
    pub processes: Arc<super::e2b_envd::Processes>,
    /// The sync SDK's directory watchers (`e2b_watch`).
    pub watchers: Arc<super::e2b_watch::Watchers>,
    /// `--e2b-domain`: requests are routed by Host as well.
    pub domain: Option<String>,
}

/// Serves the E2B API on `listener` (over TLS when `tls` is given, under `limits`) until
/// `shutdown`.
pub async fn serve(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: super::connections::Limits,
    e2b: E2b,
    shutdown: CancellationToken,
) {
    super::service_routes::serve_http1(listener, "e2b", tls, limits, shutdown, move |req| {
        let e2b = e2b.clone();
        async move {
            match handle(&e2b, req).await {
                Ok(response) => response,
                Err(e) => e.response(),
            }
        }
    })
    .await
}

/// With `--e2b-domain`: the sandbox id and port a Host of the form `PORT-ID.DOMAIN` names
/// (`api.DOMAIN`, and anything else, is the control plane's: `None`).
fn routed_host(host: &str, domain: &str) -> Option<(String, u16)> {
    let host = host.rsplit_once(':').map_or(host, |(name, port)| {
        if port.chars().all(|c| c.is_ascii_digit()) {
            name
        } else {
            host
        }
    });
    let label = host
        .to_ascii_lowercase()
        .strip_suffix(&format!(".{}", domain.to_ascii_lowercase()))?
        .to_string();
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
    (!id.is_empty() && !id.contains('.')).then(|| (id.to_string(), port))
}

/// An answer that is an error: its HTTP status and message.
#[derive(Debug)]
pub(super) struct Failure {
    status: StatusCode,
    message: String,
}

impl Failure {
    fn new(status: StatusCode, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }

    fn response(self) -> Response<Body> {
        let mut response = json_response(
            self.status,
            &json!({"code": self.status.as_u16(), "message": self.message}),
        );
        response
            .headers_mut()
            .insert("should-retry", "false".parse().expect("a header value"));
        response
    }
}

impl From<ActorError> for Failure {
    fn from(e: ActorError) -> Failure {
        let status = match &e {
            ActorError::SandboxNotFound { .. }
            | ActorError::WorkspaceNotFound(_)
            | ActorError::ObjectNotFound { .. } => StatusCode::NOT_FOUND,
            ActorError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
            ActorError::NameTaken { .. } => StatusCode::CONFLICT,
            ActorError::FailedPrecondition(_) | ActorError::WorkspaceTerminating(_) => {
                StatusCode::BAD_REQUEST
            }
            ActorError::DiskFull { .. } => StatusCode::INSUFFICIENT_STORAGE,
            ActorError::Unavailable(_) | ActorError::HeldElsewhere { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Failure::new(status, e.to_string())
    }
}

pub(super) fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(value.to_string()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        "application/json".parse().expect("a header value"),
    );
    response
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::new())
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response
}

/// The caller the request's `X-API-KEY` names (an sbx token). Grants `sbxd token create`
/// wrote since the identities were last read are bound first, as for a gRPC call.
async fn caller(e2b: &E2b, req: &Request<Incoming>) -> Result<Caller, Failure> {
    if e2b.auth.has_unbound() {
        e2b.auth.bind_unbound().await;
    }
    let key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty());
    // The key is checked as a bearer token is, by the same authenticator.
    let mut probe = hyper::Request::new(());
    if let Some(key) = key.filter(|_| !e2b.auth.none) {
        let value = format!("Bearer {key}")
            .parse()
            .map_err(|_| Failure::new(StatusCode::UNAUTHORIZED, "the API key is not text"))?;
        probe
            .headers_mut()
            .insert(hyper::header::AUTHORIZATION, value);
    } else if key.is_none() && !e2b.auth.none {
        return Err(Failure::new(
            StatusCode::UNAUTHORIZED,
            "no API key: give an sbx token (sbxd token create) as the X-API-KEY header \
             (E2B_API_KEY)",
        ));
    }
    let caller = e2b
        .auth
        .authenticate(&probe)
        .map_err(|status| Failure::new(StatusCode::UNAUTHORIZED, status.message().to_string()))?;
    prove(req);
    Ok(caller)
}

/// The request's connection carried an authenticated call (`connections::ConnProof`).
pub(super) fn prove<B>(req: &Request<B>) {
    if let Some(proof) = req.extensions().get::<super::connections::ConnProof>() {
        proof.prove();
    }
}

/// The workspace a caller's new sandboxes go to: its one granted workspace, else `default`.
fn workspace_of(caller: &Caller) -> Result<Option<String>, Failure> {
    match &caller.grants {
        None => Ok(None),
        Some(grants) if grants.len() == 1 => Ok(grants.values().next().cloned()),
        Some(_) => Err(Failure::new(
            StatusCode::BAD_REQUEST,
            format!(
                "the key of {} holds several workspaces: give it one (an E2B key names where its \
                 sandboxes go)",
                caller.name
            ),
        )),
    }
}

/// The sandbox an E2B id names, if the caller may act on it as `role`. A sandbox of a
/// workspace the caller does not hold is answered as absent (a key never learns of others').
async fn sandbox_of(e2b: &E2b, caller: &Caller, id: &str, role: Role) -> Result<Sandbox, Failure> {
    let not_found = || Failure::new(StatusCode::NOT_FOUND, format!("sandbox {id} was not found"));
    let uuid = e2b_id_to_uuid(id).ok_or_else(not_found)?;
    let sandbox = match e2b.gateway.get_sandbox(&SandboxSelector::Id(uuid)).await {
        Ok(s) => s,
        Err(ActorError::SandboxNotFound { .. }) => return Err(not_found()),
        Err(e) => return Err(e.into()),
    };
    if !caller.may(&sandbox.workspace_id, role) {
        return Err(not_found());
    }
    Ok(sandbox)
}

/// The E2B id of a sandbox: its UUID without dashes.
pub fn e2b_id(sandbox_id: &str) -> String {
    Uuid::parse_str(sandbox_id)
        .map(|u| u.simple().to_string())
        .unwrap_or_else(|_| sandbox_id.to_string())
}

/// The UUID an E2B id is (32 hex digits; a dashed UUID is taken too).
pub fn e2b_id_to_uuid(id: &str) -> Option<Uuid> {
    if id.len() != 32 && id.len() != 36 {
        return None;
    }
    Uuid::parse_str(id).ok()
}

async fn body_json<T: for<'de> Deserialize<'de> + Default>(
    req: Request<Incoming>,
) -> Result<T, Failure> {
    let bytes = Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            Failure::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body could not be read (at most {MAX_BODY} bytes): {e}"),
            )
        })?
        .to_bytes();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        Failure::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not the JSON asked: {e}"),
        )
    })
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: HashMap<String, String>,
    #[serde(default)]
    env_vars: HashMap<String, String>,
    #[serde(default)]
    auto_pause: bool,
    auto_resume: Option<AutoResume>,
}

#[derive(Debug, Default, Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

#[derive(Debug, Default, Deserialize)]
struct Timeout {
    timeout: Option<u64>,
}

async fn handle(e2b: &E2b, mut req: Request<Incoming>) -> Result<Response<Body>, Failure> {
    // E2B's own domain layout: PORT-ID.DOMAIN is a sandbox's port, as the headers say it.
    if let Some(domain) = &e2b.domain {
        let host = super::service_routes::host_of(&req);
        if let Some((id, port)) = routed_host(&host, domain) {
            let headers = req.headers_mut();
            for (name, value) in [
                ("e2b-sandbox-id", id),
                ("e2b-sandbox-port", port.to_string()),
            ] {
                let value = value.parse().map_err(|_| {
                    Failure::new(
                        StatusCode::BAD_REQUEST,
                        format!("the Host {host:?} names no sandbox"),
                    )
                })?;
                headers.insert(name, value);
            }
        }
    }
    // The in-sandbox API: the SDK names the sandbox in a header on every such call.
    if let Some(id) = req
        .headers()
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
    {
        return Ok(super::e2b_envd::handle(e2b, &id, req).await);
    }
    let caller = caller(e2b, &req).await?;
    let path = req.uri().path().trim_end_matches('/').to_string();
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let method = req.method().clone();
    // Calls that change a sandbox leave an audit line, as their gRPC counterparts do.
    let action = match (&method, parts.as_slice()) {
        (&Method::DELETE, ["sandboxes", id]) => Some(("e2b kill sandbox", *id)),
        (&Method::POST, ["sandboxes", id, "timeout"]) => Some(("e2b set sandbox timeout", *id)),
        (&Method::POST, ["sandboxes", id, "pause"]) => Some(("e2b pause sandbox", *id)),
        (&Method::POST, ["sandboxes", id, "connect"] | ["v2", "sandboxes", id, "connect"]) => {
            Some(("e2b connect sandbox", *id))
        }
        _ => None,
    };
    let answer = route(e2b, &caller, method, &parts, &path, req).await;
    if let (Some((action, object)), Ok(_)) = (action, &answer) {
        crate::service::audit(&caller, action, object);
    }
    answer
}

/// One control-plane call of `caller`, by method and path parts.
async fn route(
    e2b: &E2b,
    caller: &Caller,
    method: Method,
    parts: &[&str],
    path: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, Failure> {
    match (method, parts) {
        (Method::POST, ["sandboxes"] | ["v2", "sandboxes"]) => create(e2b, caller, req).await,
        (Method::GET, ["v2", "sandboxes"] | ["sandboxes"]) => list(e2b, caller, &req).await,
        (Method::GET, ["sandboxes", id, "metrics"]) => {
            let sandbox = sandbox_of(e2b, caller, id, Role::Viewer).await?;
            metrics(e2b, &sandbox, req.uri().query().unwrap_or("")).await
        }
        (Method::GET, ["sandboxes", id]) => {
            let sandbox = sandbox_of(e2b, caller, id, Role::Viewer).await?;
            Ok(json_response(StatusCode::OK, &detail(&sandbox)))
        }
        (Method::DELETE, ["sandboxes", id]) => {
            let sandbox = sandbox_of(e2b, caller, id, Role::Editor).await?;
            let uuid = Uuid::parse_str(&sandbox.id)
                .map_err(|_| Failure::new(StatusCode::NOT_FOUND, "no such sandbox"))?;
            e2b.gateway
                .delete_sandbox(&SandboxSelector::Id(uuid))
                .await?;
            Ok(empty(StatusCode::NO_CONTENT))
        }
        (Method::POST, ["sandboxes", id, "timeout"]) => {
            let sandbox = sandbox_of(e2b, caller, id, Role::Editor).await?;
            let body: Timeout = body_json(req).await?;
            let seconds = body
                .timeout
                .ok_or_else(|| Failure::new(StatusCode::BAD_REQUEST, "timeout is required"))?;
            e2b.gateway
                .set_sandbox_ttl(&selector(&sandbox)?, seconds.max(1))
                .await?;
            Ok(empty(StatusCode::NO_CONTENT))
        }
        (Method::POST, ["sandboxes", id, "pause"]) => {
            let sandbox = sandbox_of(e2b, caller, id, Role::Editor).await?;
            if sandbox.phase() == Phase::Paused {
                return Err(Failure::new(
                    StatusCode::CONFLICT,
                    format!("sandbox {id} is already paused"),
                ));
            }
            e2b.gateway.pause_sandbox(&selector(&sandbox)?).await?;
            Ok(empty(StatusCode::NO_CONTENT))
        }
        (Method::POST, ["sandboxes", id, "connect"] | ["v2", "sandboxes", id, "connect"]) => {
            connect(e2b, caller, id, req).await
        }
        (method, _) => Err(Failure::new(
            StatusCode::NOT_FOUND,
            format!("no E2B call {method} {path} here"),
        )),
    }
}

fn selector(sandbox: &Sandbox) -> Result<SandboxSelector, Failure> {
    Uuid::parse_str(&sandbox.id)
        .map(SandboxSelector::Id)
        .map_err(|_| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "a sandbox without an id"))
}

/// `POST /v2/sandboxes`: made, started, answered once Ready (201).
async fn create(
    e2b: &E2b,
    caller: &Caller,
    req: Request<Incoming>,
) -> Result<Response<Body>, Failure> {
    let idempotency = req
        .headers()
        .get("idempotency-key")
        .map(|v| v.as_bytes().to_vec())
        .filter(|k| !k.is_empty());
    let new: NewSandbox = body_json(req).await?;
    let workspace = workspace_of(caller)?;
    let ws_name = workspace.clone().unwrap_or_else(|| "default".to_string());
    let ws = e2b
        .gateway
        .get_workspace(&sbx_actors::WorkspaceSelector::Name(ws_name.clone()))
        .await?;
    caller
        .require(&ws_name, Some(&ws.id), Role::Editor)
        .map_err(|s| Failure::new(StatusCode::FORBIDDEN, s.message().to_string()))?;
    let template = new.template_id.unwrap_or_else(|| "base".to_string());
    let image = match e2b.templates.get(&template) {
        Some(image) => image.clone(),
        None if template == "base" => String::new(),
        None => template.clone(),
    };
    let timeout = new.timeout.unwrap_or(DEFAULT_TIMEOUT_SECONDS).max(1);
    let mut labels: HashMap<String, String> = new.metadata;
    labels.insert("e2b.template".into(), template_label(&template));
    let spec = SandboxSpec {
        command: vec!["sleep".into(), "infinity".into()],
        env: new.env_vars,
        labels,
        image,
        lifetime: Some(Lifetime {
            ttl_seconds: timeout,
            on_ttl: if new.auto_pause {
                LifetimeAction::Pause
            } else {
                LifetimeAction::Delete
            } as i32,
            auto_resume: new.auto_resume.map(|a| a.enabled),
            ..Default::default()
        }),
        ..Default::default()
    };
    // A create with an Idempotency-Key (the SDKs retry creates on 429 and 5xx) is named by the
    // key and the caller: a retry meets the name the first one took, in the workspace's own
    // supervisor, and is answered that sandbox instead of making a second.
    let name = match &idempotency {
        Some(key) => idempotent_name(&caller.name, key),
        None => format!("e2b-{}", &Uuid::new_v4().simple().to_string()[..12]),
    };
    let created = match e2b
        .gateway
        .create_sandbox(Some(&ws_name), &name, spec)
        .await
    {
        Ok(created) => created,
        Err(ActorError::NameTaken { .. }) if idempotency.is_some() => {
            e2b.gateway
                .get_sandbox(&SandboxSelector::Name {
                    workspace: Some(ws_name.clone()),
                    name: name.clone(),
                })
                .await?
        }
        Err(e) => return Err(e.into()),
    };
    crate::service::audit(caller, "e2b create sandbox", &e2b_id(&created.id));
    let ready = ready(e2b, &created).await?;
    let mut answer = sandbox_answer(e2b, &ready, &template);
    answer["alias"] = json!(template);
    Ok(json_response(StatusCode::CREATED, &answer))
}

/// The name of the sandbox a create with Idempotency-Key `key` from `caller` makes: the same
/// for the same pair, and no other pair's (a SHA-256 of both, 20 hex digits).
fn idempotent_name(caller: &str, key: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(caller.as_bytes());
    h.update([0u8]);
    h.update(key);
    format!("e2b-idem-{}", &hex::encode(h.finalize())[..20])
}

/// A label value for a template name (an image reference holds `/`, `:` and `@`).
fn template_label(template: &str) -> String {
    let cleaned: String = template
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(63)
        .collect();
    cleaned
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// Waits (at most 120 s) until the sandbox is Ready; a sandbox that fails is an error naming why.
async fn ready(e2b: &E2b, sandbox: &Sandbox) -> Result<Sandbox, Failure> {
    let sel = selector(sandbox)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let now = e2b.gateway.get_sandbox(&sel).await?;
        match now.phase() {
            Phase::Ready => return Ok(now),
            Phase::Error | Phase::Completed | Phase::Stopped => {
                return Err(Failure::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!(
                        "sandbox {} did not start: {:?} ({}: {})",
                        e2b_id(&now.id),
                        now.phase(),
                        now.reason,
                        now.message
                    ),
                ));
            }
            _ => {}
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Failure::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!("sandbox {} was not Ready within 120 s", e2b_id(&now.id)),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn template_of(sandbox: &Sandbox) -> String {
    let spec = sandbox.spec.clone().unwrap_or_default();
    spec.labels.get("e2b.template").cloned().unwrap_or_else(|| {
        if spec.image.is_empty() {
            "base".into()
        } else {
            spec.image
        }
    })
}

/// What create and connect answer (E2B's `Sandbox`).
fn sandbox_answer(e2b: &E2b, sandbox: &Sandbox, template: &str) -> Value {
    json!({
        "templateID": template,
        "sandboxID": e2b_id(&sandbox.id),
        "clientID": "sbx",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": super::e2b_envd::access_token(e2b, &sandbox.id),
        "domain": null,
    })
}

fn rfc3339(t: Option<&sbx_proto::Timestamp>) -> String {
    let at = t
        .and_then(|t| SystemTime::try_from(*t).ok())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    sbx_agent::log::rfc3339_nanos(at)
}

/// E2B's `SandboxDetail` / `ListedSandbox` of a sandbox.
fn detail(sandbox: &Sandbox) -> Value {
    let spec = sandbox.spec.clone().unwrap_or_default();
    let resources = spec.resources.unwrap_or_default();
    let state = match sandbox.phase() {
        Phase::Paused | Phase::Pausing | Phase::Stopped | Phase::Completed => "paused",
        _ => "running",
    };
    // No deadline: the furthest a ttl may go (shown as a time the SDKs can parse).
    let end = sandbox
        .expires_at
        .as_ref()
        .map(|t| rfc3339(Some(t)))
        .unwrap_or_else(|| {
            sbx_agent::log::rfc3339_nanos(SystemTime::now() + Duration::from_secs(30 * 86_400))
        });
    let metadata: BTreeMap<String, String> = spec
        .labels
        .iter()
        .filter(|(k, _)| *k != "e2b.template")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    json!({
        "templateID": template_of(sandbox),
        "sandboxID": e2b_id(&sandbox.id),
        "clientID": "sbx",
        "alias": template_of(sandbox),
        "startedAt": rfc3339(sandbox.created_at.as_ref()),
        "endAt": end,
        "envdVersion": ENVD_VERSION,
        "cpuCount": resources.cpu_millis.div_ceil(1000).max(1),
        "memoryMB": resources.memory_bytes >> 20,
        "diskSizeMB": resources.disk_bytes >> 20,
        "state": state,
        "metadata": metadata,
    })
}

/// `GET /sandboxes/{id}/metrics?start=&end=` (unix seconds): the samples the gateway kept of
/// the sandbox's usage (`sbxd serve --stats-interval`, as `sbx sandbox stats --history`) and
/// one read now, those between `start` and `end`, oldest first, in E2B's `SandboxMetric`
/// form. CPU is counted against the sandbox's CPU limit, else the machine's cores; memory
/// against its limit, else the machine's memory. Page cache is not read (`memCache` 0).
async fn metrics(e2b: &E2b, sandbox: &Sandbox, query: &str) -> Result<Response<Body>, Failure> {
    let pairs: HashMap<String, String> = form_pairs(query).into_iter().collect();
    let bound = |name: &str| -> Result<Option<u64>, Failure> {
        pairs
            .get(name)
            .map(|v| {
                v.parse::<u64>().map_err(|_| {
                    Failure::new(
                        StatusCode::BAD_REQUEST,
                        format!("{name} is a time in unix seconds, not {v:?}"),
                    )
                })
            })
            .transpose()
    };
    let (start, end) = (bound("start")?, bound("end")?);
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    // Everything kept unless a start says how far back.
    let history = Duration::from_secs(start.map_or(7 * 86_400, |s| now.saturating_sub(s) + 1));
    let stats = e2b
        .gateway
        .sandbox_stats(&selector(sandbox)?, history)
        .await?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let memory = host_memory_bytes();
    let samples: Vec<Value> = stats
        .history
        .iter()
        .chain(stats.current.iter())
        .filter_map(|s| {
            let at = s.time.as_ref()?;
            let secs = u64::try_from(at.seconds).ok()?;
            if start.is_some_and(|b| secs < b) || end.is_some_and(|b| secs > b) {
                return None;
            }
            let cpu_count = if s.cpu_limit_cores > 0.0 {
                s.cpu_limit_cores.ceil() as u64
            } else {
                cores
            };
            let mem_total = if s.memory_limit_bytes > 0 {
                s.memory_limit_bytes
            } else {
                memory
            };
            Some(json!({
                "timestamp": rfc3339(Some(at)),
                "timestampUnix": secs,
                "cpuCount": cpu_count,
                "cpuUsedPct": (s.cpu_cores / cpu_count as f64 * 100.0).clamp(0.0, 100.0),
                "memUsed": s.memory_bytes,
                "memTotal": mem_total,
                "memCache": 0,
                "diskUsed": s.disk_used_bytes,
                "diskTotal": s.disk_limit_bytes,
            }))
        })
        .collect();
    Ok(json_response(StatusCode::OK, &Value::Array(samples)))
}

/// The machine's memory (`MemTotal` of /proc/meminfo), 0 when it cannot be read.
fn host_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// The most sandboxes one listing looks through (ten store pages).
const MAX_LISTED: usize = 10_000;

/// `GET /v2/sandboxes`: the caller's sandboxes, by `metadata` (`k=v&k2=v2`, each part
/// percent-encoded), `state` (`running,paused`), `template` (its id or alias) and
/// `startedAfter` (RFC 3339), newest first unless `order=asc`; `limit` a page, `nextToken`
/// the next (a cursor: the start time and id of the page's last sandbox, so a page never
/// repeats or skips one as sandboxes come and go).
async fn list(
    e2b: &E2b,
    caller: &Caller,
    req: &Request<Incoming>,
) -> Result<Response<Body>, Failure> {
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .map(|q| form_pairs(q).into_iter().collect())
        .unwrap_or_default();
    let bad = |what: String| Failure::new(StatusCode::BAD_REQUEST, what);
    let mut selector = Vec::new();
    if let Some(metadata) = query.get("metadata") {
        for (k, v) in form_pairs(metadata) {
            selector.push(format!("{k}={v}"));
        }
    }
    let states: Vec<String> = query
        .get("state")
        .map(|s| s.split(',').map(|p| p.trim().to_string()).collect())
        .unwrap_or_default();
    let limit: usize = query
        .get("limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(100)
        .clamp(1, 1000);
    let ascending = match query.get("order").map(String::as_str) {
        None | Some("" | "desc") => false,
        Some("asc") => true,
        Some(other) => return Err(bad(format!("order is asc or desc, not {other:?}"))),
    };
    let started_after = match query.get("startedAfter").filter(|t| !t.is_empty()) {
        None => None,
        Some(text) => Some(
            key_time(text)
                .ok_or_else(|| bad(format!("startedAfter is an RFC 3339 time, not {text:?}")))?,
        ),
    };
    let cursor = match query.get("nextToken").filter(|t| !t.is_empty()) {
        None => None,
        Some(token) => Some(
            parse_cursor(token)
                .ok_or_else(|| bad(format!("nextToken {token:?} is not one this listing gave")))?,
        ),
    };
    let filter = SandboxFilter {
        workspace: workspace_of(caller)?,
        all_workspaces: caller.grants.is_none() && workspace_of(caller)?.is_none(),
        label_selector: selector.join(","),
    };
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let page = e2b.gateway.list_sandboxes(&filter, 1000, &token).await?;
        all.extend(
            page.items
                .into_iter()
                .filter(|s| caller.sees(&s.workspace_id)),
        );
        token = page.next_page_token;
        if token.is_empty() || all.len() >= MAX_LISTED {
            break;
        }
    }
    let template = query.get("template").filter(|t| !t.is_empty());
    let mut keyed: Vec<((i64, i32, String), &Sandbox)> = all
        .iter()
        .filter(|s| template.is_none_or(|t| template_of(s) == template_label(t)))
        .map(|s| (sort_key(s), s))
        .filter(|(key, _)| started_after.is_none_or(|after| (key.0, key.1) >= after))
        .filter(|(key, _)| match &cursor {
            None => true,
            Some(c) if ascending => key > c,
            Some(c) => key < c,
        })
        .collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    if !ascending {
        keyed.reverse();
    }
    let mut listed = Vec::new();
    let mut last = None;
    let mut more = false;
    for (key, sandbox) in keyed {
        let d = detail(sandbox);
        if !states.is_empty() && !states.iter().any(|w| d["state"] == json!(w)) {
            continue;
        }
        if listed.len() == limit {
            more = true;
            break;
        }
        listed.push(d);
        last = Some(key);
    }
    let mut response = json_response(StatusCode::OK, &Value::Array(listed));
    if more
        && let Some((secs, nanos, id)) = last
        && let Ok(token) = format!("{secs}.{nanos:09}.{id}").parse()
    {
        response.headers_mut().insert("x-next-token", token);
    }
    Ok(response)
}

/// A sandbox's place in a listing: its start (creation) time, then its id.
fn sort_key(sandbox: &Sandbox) -> (i64, i32, String) {
    let at = sandbox.created_at.unwrap_or_default();
    (at.seconds, at.nanos, sandbox.id.clone())
}

/// A `nextToken`: `SECONDS.NANOS.ID`.
fn parse_cursor(token: &str) -> Option<(i64, i32, String)> {
    let mut parts = token.splitn(3, '.');
    let secs = parts.next()?.parse().ok()?;
    let nanos = parts.next()?.parse().ok()?;
    let id = parts.next()?.to_string();
    Uuid::parse_str(&id).ok()?;
    Some((secs, nanos, id))
}

/// An RFC 3339 time (one without an offset is taken as UTC) as (seconds, nanos).
fn key_time(text: &str) -> Option<(i64, i32)> {
    let parsed = text
        .parse::<sbx_proto::Timestamp>()
        .or_else(|_| format!("{text}Z").parse::<sbx_proto::Timestamp>())
        .ok()?;
    Some((parsed.seconds, parsed.nanos))
}

/// `POST /v2/sandboxes/{id}/connect`: a paused sandbox is resumed (201); a running one is
/// answered as it is (200), its deadline moved to now + `timeout` only when that is later.
async fn connect(
    e2b: &E2b,
    caller: &Caller,
    id: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, Failure> {
    let sandbox = sandbox_of(e2b, caller, id, Role::Editor).await?;
    let body: Timeout = body_json(req).await?;
    let sel = selector(&sandbox)?;
    let paused = matches!(sandbox.phase(), Phase::Paused | Phase::Pausing);
    let sandbox = if paused {
        e2b.gateway.resume_sandbox(&sel).await?
    } else {
        sandbox
    };
    if let Some(timeout) = body.timeout {
        let wanted = SystemTime::now() + Duration::from_secs(timeout);
        let current = sandbox
            .expires_at
            .as_ref()
            .and_then(|t| SystemTime::try_from(*t).ok());
        if current.is_some_and(|c| c < wanted) {
            e2b.gateway.set_sandbox_ttl(&sel, timeout.max(1)).await?;
        }
    }
    let status = if paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(json_response(
        status,
        &sandbox_answer(e2b, &sandbox, &template_of(&sandbox)),
    ))
}

/// `k=v&k2=v2` with each part percent-decoded (`+` a space).
pub(super) fn form_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = |b: u8| (b as char).to_digit(16);
                match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                    (Some(hi), Some(lo)) => {
                        out.push((hi * 16 + lo) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_the_uuid_without_dashes_and_nothing_else() {
        let u = Uuid::new_v4();
        let id = e2b_id(&u.to_string());
        assert_eq!(id.len(), 32);
        assert!(
            id.chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(e2b_id_to_uuid(&id), Some(u));
        for bad in ["", "web", "../etc", "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz"] {
            assert_eq!(e2b_id_to_uuid(bad), None, "{bad}");
        }
    }

    #[test]
    fn query_pairs_are_decoded_once_and_parts_again() {
        // What the Python SDK sends for metadata={"sandbox_test_id": "test 1"}.
        let outer = form_pairs("metadata=sandbox_test_id%3Dtest%25201&state=running%2Cpaused");
        assert_eq!(outer[0].1, "sandbox_test_id=test%201");
        assert_eq!(
            form_pairs(&outer[0].1),
            vec![("sandbox_test_id".into(), "test 1".into())]
        );
        assert_eq!(outer[1].1, "running,paused");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }

    #[test]
    fn hosts_under_the_domain_name_a_port_of_a_sandbox() {
        let id = "0123456789abcdef0123456789abcdef";
        for (host, want) in [
            (
                format!("49983-{id}.e2b.test"),
                Some((id.to_string(), 49983)),
            ),
            (
                format!("8080-{id}.E2B.test:443"),
                Some((id.to_string(), 8080)),
            ),
            ("api.e2b.test".to_string(), None),
            (format!("49983-{id}.other.test"), None),
            (format!("0-{id}.e2b.test"), None),
            (format!("99999-{id}.e2b.test"), None),
            (format!("x-{id}.e2b.test"), None),
            (format!("80-a.{id}.e2b.test"), None),
            ("e2b.test".to_string(), None),
        ] {
            assert_eq!(routed_host(&host, "e2b.test"), want, "{host}");
        }
    }

    #[test]
    fn cursors_and_times_read_back() {
        let id = Uuid::new_v4().to_string();
        let token = format!("{}.{:09}.{id}", 1_796_400_000, 5);
        assert_eq!(parse_cursor(&token), Some((1_796_400_000, 5, id.clone())));
        for bad in ["", "1.2", "1.2.not-an-id", "x.0.{id}"] {
            assert_eq!(parse_cursor(bad), None, "{bad}");
        }
        assert_eq!(key_time("2026-12-04T19:20:00Z"), Some((1_796_412_000, 0)));
        assert_eq!(
            key_time("2026-12-04T20:20:00.5+01:00"),
            Some((1_796_412_000, 500_000_000))
        );
        assert_eq!(key_time("2026-12-04T19:20:00"), Some((1_796_412_000, 0)));
        assert_eq!(key_time("yesterday"), None);
    }

    #[test]
    fn template_labels_are_label_values() {
        assert_eq!(template_label("base"), "base");
        assert_eq!(
            template_label("docker.io/library/debian:bookworm"),
            "docker.io_library_debian_bookworm"
        );
        assert_eq!(template_label("@@"), "");
    }
}
