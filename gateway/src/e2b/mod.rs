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
//! Files: `control` is the control plane (REST), `envd` the in-sandbox daemon's API (E2B's
//! "envd": the processes of `commands` and `pty`, a sandbox's ports), `files` its files,
//! `watch` its directory watchers, `connect` the Connect protocol's framing they share and
//! `token` the sandboxes' access tokens. Each is an adapter over the front door
//! ([`crate::frontdoor`]): it parses HTTP, calls the front door and encodes the answer.

mod connect;
mod control;
pub mod envd;
mod files;
pub mod token;
pub mod watch;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use sbx_actors::ActorError;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::auth::Authenticator;
use crate::daemon::connections;
use crate::http::host_of;

pub use envd::Processes;
pub use files::Transfers;

pub(crate) type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// What the E2B listener needs.
#[derive(Clone)]
pub struct E2b {
    /// The front door: access, audit, hiding and errors as every transport has them.
    pub front: crate::frontdoor::FrontDoor,
    pub auth: Arc<Authenticator>,
    /// `--e2b-template NAME=IMAGE`.
    pub templates: Arc<BTreeMap<String, String>>,
    /// The gateway's secret key: each sandbox's access token is an HMAC under it.
    pub secrets: Arc<sbx_actors::Sealer>,
    /// The file transfers under way (`e2b_envd::Transfers`).
    pub transfers: Arc<files::Transfers>,
    /// The processes started through the in-sandbox API (`e2b_envd`).
    pub processes: Arc<envd::Processes>,
    /// The sync SDK's directory watchers (`e2b_watch`).
    pub watchers: Arc<watch::Watchers>,
    /// `--e2b-domain`: requests are routed by Host as well.
    pub domain: Option<String>,
    /// The caller of the in-sandbox call being served (its sandbox token's identity), and the
    /// key it proved itself with here: what the execs of the call run as.
    pub caller: Option<Arc<crate::auth::Caller>>,
    pub bearer: Option<Arc<str>>,
    /// The keys callers proved themselves with here, for calls of the in-sandbox API that
    /// the workspace's holder answers ([`Keys`]).
    pub keys: Arc<Keys>,
    /// Who each sandbox's calls that name no user run as ([`DefaultUsers`]).
    pub default_users: Arc<DefaultUsers>,
}

impl E2b {
    /// This door as the in-sandbox call of `caller` uses it.
    fn as_caller(&self, caller: crate::auth::Caller) -> E2b {
        E2b {
            bearer: self.keys.bearer_of(&caller).map(Into::into),
            caller: Some(Arc::new(caller)),
            ..self.clone()
        }
    }

    /// Runs `command` in the sandbox `uuid` as the call's caller, through the front door (here,
    /// or on the gateway holding the sandbox's workspace). A command that names no user runs
    /// as the sandbox's E2B default ([`DefaultUsers`]).
    pub(crate) async fn exec(
        &self,
        uuid: Uuid,
        command: Vec<String>,
        mut opts: sbx_actors::ExecOptions,
        input: sbx_actors::ExecInputs,
    ) -> Result<crate::frontdoor::ExecStream, crate::frontdoor::Failure> {
        if opts.user.is_empty() {
            opts.user = self.default_user(uuid).await;
        }
        self.exec_as_named(uuid, command, opts, input).await
    }

    /// Who the calls of sandbox `uuid` that name no user run as: `user` when the sandbox's
    /// own default user is root and it has an account `user`, else its own default (empty).
    /// Asked of the sandbox once, by a script as its default user, then remembered; a
    /// sandbox that cannot be asked now (not running, no `sh`) is asked again next time.
    async fn default_user(&self, uuid: Uuid) -> String {
        if let Some(known) = self.default_users.get(uuid) {
            return known;
        }
        const ASK: &str = r#"[ "$(id -u)" = 0 ] && id -u user >/dev/null 2>&1 && echo user"#;
        let command = ["sh", "-c", ASK].map(String::from).to_vec();
        let opts = sbx_actors::ExecOptions {
            timeout_seconds: 10,
            ..Default::default()
        };
        let none: sbx_actors::ExecInputs = Box::pin(futures::stream::empty());
        let Ok(mut output) = self.exec_as_named(uuid, command, opts, none).await else {
            return String::new();
        };
        let mut said = Vec::new();
        while let Some(Ok(out)) = futures::StreamExt::next(&mut output).await {
            match out.chunk {
                Some(sbx_proto::v1::exec_output::Chunk::Stdout(b)) if said.len() < 64 => {
                    said.extend_from_slice(&b)
                }
                Some(sbx_proto::v1::exec_output::Chunk::Exit(exit)) if !exit.timed_out => {
                    let user = if said == b"user\n" { "user" } else { "" };
                    self.default_users.remember(uuid, user);
                    return user.to_string();
                }
                _ => {}
            }
        }
        String::new()
    }

    /// [`E2b::exec`] with the user as `opts` names it (empty: the sandbox's own default).
    async fn exec_as_named(
        &self,
        uuid: Uuid,
        command: Vec<String>,
        opts: sbx_actors::ExecOptions,
        input: sbx_actors::ExecInputs,
    ) -> Result<crate::frontdoor::ExecStream, crate::frontdoor::Failure> {
        let Some(caller) = &self.caller else {
            return Err(crate::frontdoor::Failure::bare(
                crate::frontdoor::Class::Unauthenticated,
                "an in-sandbox call without the sandbox's token",
            ));
        };
        let call = crate::frontdoor::Call {
            caller,
            bearer: self.bearer.as_deref(),
        };
        let sel = sbx_actors::SandboxSelector::Id(uuid);
        self.front.exec(call, &sel, command, opts, input).await
    }
}

/// The most sandboxes [`DefaultUsers`] remembers (a new one past it forgets them all).
const MAX_DEFAULT_USERS: usize = 10_000;

/// Who each sandbox's envd calls that name no user run as: E2B runs them as its templates'
/// `user` (in /home/user, relative paths resolved there), so a sandbox whose own default is
/// root and that has an account `user` (the built-in image has) runs them as `user`; an
/// image that names another USER, or has no `user`, keeps its own default. Memory only, by
/// sandbox id (ids are never reused); an account added later is not seen.
#[derive(Default)]
pub struct DefaultUsers {
    by_sandbox: std::sync::Mutex<std::collections::HashMap<Uuid, &'static str>>,
}

impl DefaultUsers {
    fn get(&self, uuid: Uuid) -> Option<String> {
        sbx_drivers::locked(&self.by_sandbox)
            .get(&uuid)
            .map(|u| u.to_string())
    }

    fn remember(&self, uuid: Uuid, user: &'static str) {
        let mut by = sbx_drivers::locked(&self.by_sandbox);
        if by.len() >= MAX_DEFAULT_USERS {
            by.clear();
        }
        by.insert(uuid, user);
    }
}

/// The most keys [`Keys`] holds (one per identity; a new one past it replaces them all).
const MAX_KEYS: usize = 10_000;

/// The API key each identity last proved itself with on this gateway's control plane. An
/// in-sandbox call carries the sandbox's token, which names the identity but is no
/// credential another gateway takes; when the sandbox's workspace is held by another
/// gateway, the call is forwarded there as the identity, with the key it gave here. A key is
/// used only while it is the identity's key now (its hash is the caller's binding): a revoked
/// or replaced key is never sent on. Memory only: after a restart, the SDK's next control
/// call (`connect`, `set_timeout`) gives it again.
#[derive(Default)]
pub struct Keys {
    by_name: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

impl Keys {
    /// Keeps `key`, which `caller` just proved itself with.
    pub fn remember(&self, caller: &crate::auth::Caller, key: &str) {
        let mut by = sbx_drivers::locked(&self.by_name);
        if by.len() >= MAX_KEYS && !by.contains_key(&caller.name) {
            by.clear();
        }
        by.insert(caller.name.clone(), key.to_string());
    }

    /// The key `caller` (known by a sandbox token) proved itself with here, while it is its
    /// key.
    pub fn bearer_of(&self, caller: &crate::auth::Caller) -> Option<String> {
        use sha2::{Digest, Sha256};
        let by = sbx_drivers::locked(&self.by_name);
        let key = by.get(&caller.name)?;
        (hex::encode(Sha256::digest(key.as_bytes())) == caller.key_binding()).then(|| key.clone())
    }
}

/// Serves the E2B API on `listener` (over TLS when `tls` is given, under `limits`) until
/// `shutdown`.
pub async fn serve(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: connections::Limits,
    e2b: E2b,
    shutdown: CancellationToken,
) {
    crate::http::serve_http1(listener, "e2b", tls, limits, shutdown, move |req| {
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

async fn handle(e2b: &E2b, mut req: Request<Incoming>) -> Result<Response<Body>, Failure> {
    // E2B's own domain layout: PORT-ID.DOMAIN is a sandbox's port, as the headers say it.
    if let Some(domain) = &e2b.domain {
        let host = host_of(&req);
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
        return Ok(envd::handle(e2b, &id, req).await);
    }
    control::handle(e2b, req).await
}

/// An answer that is an error: its HTTP status and message.
#[derive(Debug)]
pub(crate) struct Failure {
    status: StatusCode,
    message: String,
    /// The front door's reason (`SANDBOX_NOT_FOUND`…), as gRPC's ErrorInfo says it.
    reason: Option<String>,
}

impl Failure {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
            reason: None,
        }
    }

    pub(super) fn response(self) -> Response<Body> {
        let mut body = json!({"code": self.status.as_u16(), "message": self.message});
        if let Some(reason) = self.reason {
            body["reason"] = json!(reason);
        }
        let mut response = json_response(self.status, &body);
        response
            .headers_mut()
            .insert("should-retry", "false".parse().expect("a header value"));
        response
    }
}

impl From<ActorError> for Failure {
    fn from(e: ActorError) -> Failure {
        crate::frontdoor::Failure::from(e).into()
    }
}

/// A front-door failure as the control plane answers it: its class's HTTP status
/// ([`crate::frontdoor::Class::http_status`]), its message and its reason.
impl From<crate::frontdoor::Failure> for Failure {
    fn from(f: crate::frontdoor::Failure) -> Failure {
        let status = StatusCode::from_u16(f.class.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Failure {
            status,
            message: f.message,
            reason: (!f.reason.is_empty()).then_some(f.reason),
        }
    }
}

pub(crate) fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
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

pub(crate) fn empty(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::new())
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response
}

/// The request's connection carried an authenticated call (`connections::ConnProof`).
pub(crate) fn prove<B>(req: &Request<B>) {
    if let Some(proof) = req.extensions().get::<connections::ConnProof>() {
        proof.prove();
    }
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

/// How long a request's body may take to arrive whole (its head has its own deadline): a
/// body dripped a byte at a time holds its connection no longer.
pub(crate) const BODY_DEADLINE: Duration = Duration::from_secs(30);

/// A request body of at most `limit` bytes, read within [`BODY_DEADLINE`]; why not, else.
pub(crate) async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, String> {
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
pub(crate) async fn drain(body: Incoming) {
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        Limited::new(body, 64 << 10).collect(),
    )
    .await;
}

/// `k=v&k2=v2` with each part percent-decoded (`+` a space).
pub(crate) fn form_pairs(query: &str) -> Vec<(String, String)> {
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
}
