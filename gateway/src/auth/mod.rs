//! Who may talk to the gateway, and to which workspace.
//!
//! **Who.** Every call is authenticated before any handler runs, by [`AuthLayer`], from one of:
//! - a bearer token (`authorization: Bearer sbx_…`), looked up in the identities file
//!   ([`tokens`]: stored as hashes, compared in constant time, revocable, expiring);
//! - a verified client certificate (mutual TLS), whose subject common name names an identity
//!   of that file;
//! - on the Unix socket, the caller's uid (peer credentials): the socket's owner — the uid
//!   sbxd runs as — is a gateway-wide admin.
//!
//! With `--auth none` (accepted only on the Unix socket or a loopback address) every caller
//! is a gateway-wide admin. Health and reflection need no credential and say nothing about
//! tenants.
//!
//! **What.** Each RPC is declared once, in [`need`], by its gRPC path: what it needs —
//! any identity, a gateway-wide grant, or a role in a workspace. A path the table does not
//! know is refused (`PERMISSION_DENIED`), so an RPC added later cannot be forgotten: it is
//! closed until declared. The layer checks the role; the workspace a call is about is in
//! its message, so the handlers check it with the [`Caller`] the layer put in the request's
//! extensions ([`Caller::require`]), before they act. A caller scoped to workspace A gets
//! `PERMISSION_DENIED` for a name in B and `NOT_FOUND` for an id in B (the same answer as
//! for an id nobody has, so whether it exists is not revealed); lists and watches across
//! workspaces show only the workspaces it may see.
//!
//! Roles, each including the one before: **viewer** (get, list, watch, logs; providers,
//! attachments, settings and service endpoints read), **editor** (create, start, stop,
//! restart, delete sandboxes; exec, cp, port-forward; create, update, delete, attach and
//! detach providers, set and delete settings, expose and delete services), **admin**
//! (create and delete the workspace itself). A gateway-wide grant (no workspace named) holds
//! its role in every workspace. Images belong to a workspace or to the gateway: a viewer of a
//! workspace lists and reads its images and the gateway's; a pull, an import or a build
//! writes images (and fetches from anywhere the gateway reaches), so it needs a gateway-wide
//! editor, and lands in the workspace it names — the gateway's (`publish`) only for a
//! gateway-wide admin; deleting needs an admin of the image's workspace, a gateway-wide admin
//! for the gateway's.
//!
//! **Audit.** Every call that changes something, and every exec, copy and port-forward, is
//! logged by the layer as one `sbx::audit` line: who (identity and how it was proven), the
//! method, the outcome (the gRPC code). Handlers add the object's id. No secret is logged.

pub mod tokens;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use serde::{Deserialize, Serialize};
use tonic::codegen::Service;
use tonic::codegen::http;
use tonic::{Code, Status};
use uuid::Uuid;

pub use tokens::{Identities, StoredIdentity};

/// How often an open stream checks that its caller's identity is still valid.
pub const RECHECK: Duration = Duration::from_secs(1);

/// A role, each including the ones before it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Viewer,
    Editor,
    Admin,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Viewer => "viewer",
            Role::Editor => "editor",
            Role::Admin => "admin",
        })
    }
}

/// What an RPC needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Nothing: health, reflection.
    Nothing,
    /// Any authenticated caller.
    Anyone,
    /// A gateway-wide grant with at least this role.
    Gateway(Role),
    /// At least this role in the workspace the call is about (checked by the handler).
    Workspace(Role),
}

/// What each RPC of the public API needs, by gRPC path, and whether it is audited; `None`
/// for a path nobody declared (refused).
pub fn need(path: &str) -> Option<(Need, bool)> {
    use Need::*;
    use Role::*;
    if path.starts_with("/grpc.health.v1.Health/")
        || path.starts_with("/grpc.reflection.v1.ServerReflection/")
        || path.starts_with("/grpc.reflection.v1alpha.ServerReflection/")
    {
        return Some((Nothing, false));
    }
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    let declared = match (service, method) {
        ("sbx.v1.GatewayService", "GetGatewayInfo") => (Anyone, false),
        ("sbx.v1.WorkspaceService", "CreateWorkspace") => (Gateway(Admin), true),
        ("sbx.v1.WorkspaceService", "GetWorkspace") => (Workspace(Viewer), false),
        ("sbx.v1.WorkspaceService", "ListWorkspaces") => (Workspace(Viewer), false),
        ("sbx.v1.WorkspaceService", "DeleteWorkspace") => (Workspace(Admin), true),
        ("sbx.v1.WorkspaceService", "SetWorkspaceNetwork") => (Workspace(Admin), true),
        ("sbx.v1.WorkspaceService", "SetWorkspaceLimits") => (Workspace(Admin), true),
        ("sbx.v1.WorkspaceService", "SetWorkspaceLifetime") => (Workspace(Admin), true),
        ("sbx.v1.SandboxService", "CreateSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "GetSandbox") => (Workspace(Viewer), false),
        ("sbx.v1.SandboxService", "ListSandboxes") => (Workspace(Viewer), false),
        ("sbx.v1.SandboxService", "StartSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "StopSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "RestartSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "DeleteSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "SetSandboxTtl") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "PauseSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "ResumeSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "WatchSandboxes") => (Workspace(Viewer), false),
        ("sbx.v1.SandboxService", "Exec") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "Logs") => (Workspace(Viewer), false),
        ("sbx.v1.SandboxService", "CopyFromSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "CopyToSandbox") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "PortForward") => (Workspace(Editor), true),
        ("sbx.v1.SandboxService", "GetSandboxNetwork") => (Workspace(Viewer), false),
        ("sbx.v1.SandboxService", "GetSandboxStats") => (Workspace(Viewer), false),
        ("sbx.v1.SandboxService", "WatchSandboxStats") => (Workspace(Viewer), false),
        ("sbx.v1.SandboxService", "ListEvents") => (Workspace(Viewer), false),
        // What a sandbox may reach is a security decision: editor, and audited.
        ("sbx.v1.SandboxService", "UpdateSandboxNetwork") => (Workspace(Editor), true),
        // Providers hold credentials: every change is editor and audited.
        ("sbx.v1.ProviderService", "CreateProvider") => (Workspace(Editor), true),
        ("sbx.v1.ProviderService", "GetProvider") => (Workspace(Viewer), false),
        ("sbx.v1.ProviderService", "ListProviders") => (Workspace(Viewer), false),
        ("sbx.v1.ProviderService", "UpdateProvider") => (Workspace(Editor), true),
        ("sbx.v1.ProviderService", "DeleteProvider") => (Workspace(Editor), true),
        ("sbx.v1.ProviderService", "AttachProvider") => (Workspace(Editor), true),
        ("sbx.v1.ProviderService", "DetachProvider") => (Workspace(Editor), true),
        ("sbx.v1.ProviderService", "ListAttachments") => (Workspace(Viewer), false),
        ("sbx.v1.SettingService", "SetSettings") => (Workspace(Editor), true),
        ("sbx.v1.SettingService", "GetSetting") => (Workspace(Viewer), false),
        ("sbx.v1.SettingService", "ListSettings") => (Workspace(Viewer), false),
        ("sbx.v1.SettingService", "DeleteSetting") => (Workspace(Editor), true),
        ("sbx.v1.ServiceEndpointService", "ExposeService") => (Workspace(Editor), true),
        ("sbx.v1.ServiceEndpointService", "GetService") => (Workspace(Viewer), false),
        ("sbx.v1.ServiceEndpointService", "ListServices") => (Workspace(Viewer), false),
        ("sbx.v1.ServiceEndpointService", "DeleteService") => (Workspace(Editor), true),
        // Fetch from wherever the gateway reaches and write its disk: a gateway-wide editor,
        // into the workspace named (checked by the handler; publishing needs an admin).
        ("sbx.v1.ImageService", "PullImage") => (Gateway(Editor), true),
        ("sbx.v1.ImageService", "ImportImage") => (Gateway(Editor), true),
        // Writes images and runs sandboxes in a workspace (checked too).
        ("sbx.v1.ImageService", "BuildImage") => (Gateway(Editor), true),
        // A workspace's images and the gateway's, as its viewer sees them.
        ("sbx.v1.ImageService", "ListImages") => (Workspace(Viewer), false),
        ("sbx.v1.ImageService", "GetImage") => (Workspace(Viewer), false),
        // An admin of the image's workspace; a gateway-wide admin for the gateway's.
        ("sbx.v1.ImageService", "DeleteImage") => (Workspace(Admin), true),
        // The same: an admin of the workspace pruned; a gateway-wide admin for the gateway's.
        ("sbx.v1.ImageService", "PruneImages") => (Workspace(Admin), true),
        ("sbx.v1.IdentityService", "CreateIdentity") => (Gateway(Admin), true),
        ("sbx.v1.IdentityService", "ListIdentities") => (Gateway(Admin), false),
        ("sbx.v1.IdentityService", "RevokeIdentity") => (Gateway(Admin), true),
        // Nodes are the gateway's machines: a gateway-wide admin's, every change audited.
        ("sbx.v1.NodeService", "AddNode") => (Gateway(Admin), true),
        ("sbx.v1.NodeService", "GetNode") => (Gateway(Admin), false),
        ("sbx.v1.NodeService", "ListNodes") => (Gateway(Admin), false),
        ("sbx.v1.NodeService", "CordonNode") => (Gateway(Admin), true),
        ("sbx.v1.NodeService", "DrainNode") => (Gateway(Admin), true),
        ("sbx.v1.NodeService", "RemoveNode") => (Gateway(Admin), true),
        _ => return None,
    };
    Some(declared)
}

/// Every method of the public API (`sbx.v1`), by gRPC path, from the service descriptors.
static PUBLIC_METHODS: std::sync::LazyLock<BTreeSet<String>> = std::sync::LazyLock::new(|| {
    let Ok(fds) =
        <prost_types::FileDescriptorSet as prost::Message>::decode(sbx_proto::FILE_DESCRIPTOR_SET)
    else {
        return BTreeSet::new();
    };
    fds.file
        .iter()
        .filter(|f| f.package() == "sbx.v1")
        .flat_map(|f| {
            f.service.iter().flat_map(move |svc| {
                svc.method
                    .iter()
                    .map(move |m| format!("/{}.{}/{}", f.package(), svc.name(), m.name()))
            })
        })
        .collect()
});

/// The methods served besides the API's own: health and reflection.
const SERVED_BESIDES: [&str; 4] = [
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// What a request's path may be called in a metric's label or an audit line: the method, if
/// it is one this gateway serves (the API's, health's, reflection's), else `other` — so that
/// no caller grows a label set or a log line by what it sends.
pub fn method_label(path: &str) -> &str {
    if PUBLIC_METHODS.contains(path) || SERVED_BESIDES.contains(&path) {
        path
    } else {
        "other"
    }
}

/// How a caller proved who it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    Token,
    Certificate,
    /// The Unix socket's owner uid.
    SocketOwner(u32),
    /// `--auth none`.
    NoAuth,
    /// An E2B sandbox access token, minted for the named identity's key
    /// (`daemon::e2b_token`): the caller is that identity, for that one sandbox.
    SandboxToken,
}

impl std::fmt::Display for Proof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Proof::Token => f.write_str("token"),
            Proof::Certificate => f.write_str("client certificate"),
            Proof::SocketOwner(uid) => write!(f, "socket owner uid {uid}"),
            Proof::NoAuth => f.write_str("--auth none"),
            Proof::SandboxToken => f.write_str("E2B sandbox token"),
        }
    }
}

/// The authenticated caller of one call, in the request's extensions.
#[derive(Debug, Clone)]
pub struct Caller {
    pub name: String,
    pub proof: Proof,
    pub role: Role,
    /// The workspaces the caller's grants hold, by id, each with its name (for messages);
    /// `None`: every workspace. A grant holds the workspace it was made for, never another one
    /// made later under its name.
    pub grants: Option<BTreeMap<Uuid, String>>,
    /// For a stored identity: where to ask whether it is still valid.
    check: Option<Arc<Authenticator>>,
    /// The token's hash, for [`Caller::still_valid`].
    token_sha256: Option<String>,
}

impl Caller {
    /// A gateway-wide admin that needs no store (the socket owner, `--auth none`).
    pub fn admin(name: &str, proof: Proof) -> Caller {
        Caller {
            name: name.to_string(),
            proof,
            role: Role::Admin,
            grants: None,
            check: None,
            token_sha256: None,
        }
    }

    fn stored(id: StoredIdentity, proof: Proof, check: Arc<Authenticator>) -> Caller {
        Caller {
            grants: id.granted(),
            name: id.name,
            token_sha256: (proof == Proof::Token).then_some(id.token_sha256),
            proof,
            role: id.role,
            check: Some(check),
        }
    }

    /// What a token minted for this caller is bound to besides its name: the hash of the key
    /// it authenticated with (empty for a caller with no stored token). A new key for the
    /// name, or none, is another binding.
    pub fn key_binding(&self) -> &str {
        self.token_sha256.as_deref().unwrap_or("")
    }

    /// Whether the caller's grant is for some workspaces only.
    pub fn is_scoped(&self) -> bool {
        self.grants.is_some()
    }

    /// Whether the caller holds `role` in the workspace whose id is `workspace_id`.
    pub fn may(&self, workspace_id: &str, role: Role) -> bool {
        self.role >= role
            && self.grants.as_ref().is_none_or(|grants| {
                Uuid::parse_str(workspace_id).is_ok_and(|id| grants.contains_key(&id))
            })
    }

    /// Whether the caller may see the workspace whose id is `workspace_id` at all (as a viewer).
    pub fn sees(&self, workspace_id: &str) -> bool {
        self.may(workspace_id, Role::Viewer)
    }

    /// `PERMISSION_DENIED` unless the caller holds `role` in the workspace named `name`, whose
    /// id is `id` (`None`: no workspace has that name, which a scoped grant never holds),
    /// saying which role in which workspace is missing and who asked.
    pub fn require(&self, name: &str, id: Option<&str>, role: Role) -> Result<(), Status> {
        let held = match (&self.grants, id) {
            (None, _) => self.role >= role,
            (Some(_), Some(id)) => self.may(id, role),
            (Some(_), None) => false,
        };
        if held {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "{} ({}) is not {} {role} in workspace {name:?}",
            self.name,
            self.proof,
            article(role)
        )))
    }

    /// `PERMISSION_DENIED` unless the grant is gateway-wide with `role`.
    pub fn require_gateway(&self, role: Role) -> Result<(), Status> {
        if self.grants.is_none() && self.role >= role {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "{} ({}) needs a gateway-wide {role} grant for this (it has {} in {})",
            self.name,
            self.proof,
            self.role,
            self.scope()
        )))
    }

    fn scope(&self) -> String {
        match &self.grants {
            None => "every workspace".to_string(),
            Some(ws) if ws.is_empty() => "no workspace".to_string(),
            Some(ws) => ws.values().cloned().collect::<Vec<_>>().join(","),
        }
    }

    /// Whether the identity behind this call is still there and unexpired (revoked or expired
    /// ends an open stream).
    pub fn still_valid(&self) -> bool {
        let Some(check) = &self.check else {
            return true;
        };
        let found = match (&self.proof, &self.token_sha256) {
            (Proof::Token, Some(hash)) => check.identities.by_token_hash(hash),
            _ => check.identities.by_name(&self.name),
        };
        matches!(found, Ok(Some(id)) if id.name == self.name)
    }

    /// Answers (`UNAUTHENTICATED`, saying what ends) once the caller's identity is revoked or
    /// expires, checked every [`RECHECK`]; never for a caller with nothing to revoke (the
    /// socket's owner, `--auth none`). What a long call races its work against: a pull, a
    /// build, an import.
    pub async fn revoked(&self, what: &str) -> Status {
        if self.check.is_none() {
            return std::future::pending().await;
        }
        loop {
            tokio::time::sleep(RECHECK).await;
            if !self.still_valid() {
                return Status::unauthenticated(format!(
                    "{} was revoked or expired; {what} ends and nothing of it is kept",
                    self.name
                ));
            }
        }
    }

    /// `stream`, ended with `UNAUTHENTICATED` once the caller's identity is revoked or expires
    /// (checked every [`RECHECK`]). Its errors are gRPC statuses or anything made of one (a
    /// front-door `Failure`).
    pub fn until_revoked<T, E, S>(
        &self,
        stream: S,
    ) -> Pin<Box<dyn Stream<Item = Result<T, E>> + Send>>
    where
        T: Send + 'static,
        E: From<Status> + Send + 'static,
        S: Stream<Item = Result<T, E>> + Send + 'static,
    {
        use futures::StreamExt;
        if self.check.is_none() {
            return Box::pin(stream);
        }
        let caller = self.clone();
        let revoked = Box::pin(async move {
            loop {
                tokio::time::sleep(RECHECK).await;
                if !caller.still_valid() {
                    return Status::unauthenticated(format!(
                        "{} was revoked or expired; the stream ends",
                        caller.name
                    ));
                }
            }
        });
        let state = (Box::pin(stream), Some(revoked));
        Box::pin(futures::stream::unfold(
            state,
            |(mut stream, revoked)| async move {
                let mut revoked = revoked?;
                tokio::select! {
                    item = stream.next() => item.map(|item| (item, (stream, Some(revoked)))),
                    status = &mut revoked => Some((Err(status.into()), (stream, None))),
                }
            },
        ))
    }
}

fn article(role: Role) -> &'static str {
    match role {
        Role::Admin | Role::Editor => "an",
        _ => "a",
    }
}

/// A workspace's id by its name now: `Ok(None)` when no workspace has it.
pub type WorkspaceLookup = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = Result<Option<Uuid>, String>> + Send>>
        + Send
        + Sync,
>;

/// How sbxd authenticates.
pub struct Authenticator {
    pub identities: Identities,
    /// `--auth none`: everyone is a gateway-wide admin.
    pub none: bool,
    /// The uid that owns the Unix socket (sbxd's): a gateway-wide admin there.
    pub owner_uid: u32,
    /// Where grants written by name (`sbxd token create`) find their workspace's id; set once
    /// the gateway's store is open. Unset, such grants hold nothing.
    pub workspaces: std::sync::OnceLock<WorkspaceLookup>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("identities", &self.identities)
            .field("none", &self.none)
            .field("owner_uid", &self.owner_uid)
            .finish_non_exhaustive()
    }
}

impl Authenticator {
    /// The live identity `name` as the caller of an E2B sandbox token, with its key's binding
    /// ([`Caller::key_binding`]); `None` when no live identity has that name (revoked,
    /// expired, never made). Under `--auth none`, `anonymous` is the gateway-wide admin.
    pub fn token_holder(self: &Arc<Self>, name: &str) -> Result<Option<(Caller, String)>, Status> {
        if self.none && name == "anonymous" {
            return Ok(Some((
                Caller::admin("anonymous", Proof::SandboxToken),
                String::new(),
            )));
        }
        let Some(id) = self.identities.by_name(name).map_err(|e| {
            tracing::error!(error = %e, "the identities file cannot be read");
            Status::unavailable("the gateway cannot read its identities; see its log")
        })?
        else {
            return Ok(None);
        };
        let binding = id.token_sha256.clone();
        let mut caller = Caller::stored(id, Proof::Token, Arc::clone(self));
        caller.proof = Proof::SandboxToken;
        Ok(Some((caller, binding)))
    }

    /// Whether the identities hold a grant not bound to a workspace's id yet, and something
    /// to bind it with.
    pub fn has_unbound(&self) -> bool {
        self.workspaces.get().is_some()
            && self
                .identities
                .unbound()
                .is_ok_and(|names| !names.is_empty())
    }

    /// Binds every grant written by name to the workspace of that name now (none: a dead
    /// grant). A name that could not be looked up stays unbound (holding nothing) and is tried
    /// again at the next call.
    pub async fn bind_unbound(&self) {
        let (Some(lookup), Ok(names)) = (self.workspaces.get(), self.identities.unbound()) else {
            return;
        };
        let mut ids = BTreeMap::new();
        for name in names {
            match lookup(name.clone()).await {
                Ok(id) => {
                    ids.insert(name, id);
                }
                Err(e) => tracing::warn!(workspace = %name, error = %e, "a grant stays unbound"),
            }
        }
        match self.identities.bind(&ids) {
            Ok(0) => {}
            Ok(bound) => tracing::info!(
                grants = bound,
                "identities' workspace grants bound to the workspaces' ids (a workspace made \
                 later under the same name is not theirs)"
            ),
            Err(e) => tracing::error!(error = %e, "the identities' grants could not be bound"),
        }
    }
}

/// A bearer token from the request's `authorization` metadata: `Ok(None)` without one.
fn bearer(headers: &http::HeaderMap) -> Result<Option<&str>, Status> {
    let Some(value) = headers.get(http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let value = value
        .to_str()
        .map_err(|_| Status::unauthenticated("the authorization metadata is not text"))?;
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .ok_or_else(|| {
            Status::unauthenticated("the authorization metadata must be \"Bearer <token>\"")
        })?
        .trim();
    if token.is_empty()
        || token.len() > tokens::MAX_TOKEN_BYTES
        || !(token.starts_with(tokens::TOKEN_PREFIX) || token.starts_with(tokens::E2B_TOKEN_PREFIX))
    {
        return Err(Status::unauthenticated(
            "the bearer token is malformed (sbx tokens begin with sbx_, or e2b_ in E2B's key form)",
        ));
    }
    Ok(Some(token))
}

impl Authenticator {
    /// Who is calling, from the request's metadata and connection.
    pub fn authenticate<B>(self: &Arc<Self>, req: &http::Request<B>) -> Result<Caller, Status> {
        let store_error = |e: tokens::TokenError| {
            tracing::error!(error = %e, "the identities file cannot be read");
            Status::unavailable("the gateway cannot read its identities; see its log")
        };
        if let Some(token) = bearer(req.headers())? {
            return match self.identities.by_token(token).map_err(store_error)? {
                Some(id) => Ok(Caller::stored(id, Proof::Token, self.clone())),
                None => Err(Status::unauthenticated(
                    "the bearer token is not valid (unknown, revoked or expired)",
                )),
            };
        }
        if let Some(subject) = crate::tls::peer_identity_http(req) {
            return match self.identities.by_name(&subject).map_err(store_error)? {
                Some(id) => Ok(Caller::stored(id, Proof::Certificate, self.clone())),
                None => Err(Status::unauthenticated(format!(
                    "the client certificate's subject {subject:?} is no identity of this \
                     gateway (sbxd token create --name {subject} --cert-only …)"
                ))),
            };
        }
        if let Some(uid) = peer_uid(req)
            && uid == self.owner_uid
        {
            return Ok(Caller::admin(
                &format!("uid {uid}"),
                Proof::SocketOwner(uid),
            ));
        }
        if self.none {
            return Ok(Caller::admin("anonymous", Proof::NoAuth));
        }
        Err(Status::unauthenticated(
            "no credential: give a bearer token (authorization: Bearer …), a client \
             certificate, or call as the socket's owner",
        ))
    }
}

/// The request's connection carried an authenticated call (`connections::prove`, by its two
/// addresses, over TLS or not).
fn prove_connection<B>(req: &http::Request<B>) {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let info = req.extensions().get::<TcpConnectInfo>().or_else(|| {
        req.extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .map(|tls| tls.get_ref())
    });
    if let Some((Some(local), Some(remote))) = info.map(|i| (i.local_addr(), i.remote_addr())) {
        crate::daemon::connections::prove(local, remote);
    }
}

/// The caller's uid on the Unix socket.
fn peer_uid<B>(req: &http::Request<B>) -> Option<u32> {
    req.extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|info| info.peer_cred)
        .map(|cred| cred.uid())
}

/// The layer that authenticates every call, checks [`need`], puts the [`Caller`] in the
/// request's extensions and writes the audit line.
#[derive(Debug, Clone)]
pub struct AuthLayer(pub Arc<Authenticator>);

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            auth: self.0.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Arc<Authenticator>,
}

/// The gRPC code of a finished call as far as the headers say (a trailers-only error
/// answer); a stream's or a unary success's status comes in trailers: `OK` is assumed.
fn code_of(headers: &http::HeaderMap) -> Code {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(Code::from)
        .unwrap_or(Code::Ok)
}

impl<S, B> Service<http::Request<B>> for AuthService<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    /// Grants `sbxd token create` wrote since the file was last read are bound first (see
    /// [`Authenticator::bind_unbound`]), so no call — this one included — runs before they hold
    /// the workspaces of their names as they are now.
    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if self.auth.has_unbound() {
            // The ready service goes with the request; a clone stays for the next poll_ready.
            let spare = self.inner.clone();
            let ready = std::mem::replace(&mut self.inner, spare);
            let auth = self.auth.clone();
            return Box::pin(async move {
                auth.bind_unbound().await;
                AuthService { inner: ready, auth }.authorized(req).await
            });
        }
        self.authorized(req)
    }
}

/// What the layer answers a call with.
type Answer<E> = Pin<Box<dyn Future<Output = Result<http::Response<tonic::body::Body>, E>> + Send>>;

impl<S> AuthService<S> {
    /// Authenticates the call, checks [`need`], and passes it on (or answers the refusal).
    fn authorized<B>(&mut self, mut req: http::Request<B>) -> Answer<S::Error>
    where
        S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
        S::Future: Send + 'static,
        B: Send + 'static,
    {
        let path = req.uri().path().to_string();
        let (need, audited) = match need(&path) {
            Some(declared) => declared,
            // A method of the API that the table forgot: closed until declared.
            None if PUBLIC_METHODS.contains(path.as_str()) => {
                let refused = Status::permission_denied(format!(
                    "{} is not a method this gateway declares who may call",
                    sbx_actors::limits::truncate(&path, 200)
                ));
                return Box::pin(async move { Ok(refused.into_http()) });
            }
            // No such method: tonic answers UNIMPLEMENTED, to an authenticated caller.
            None => (Need::Anyone, false),
        };
        if need == Need::Nothing {
            return Box::pin(self.inner.call(req));
        }
        let caller = match self.auth.authenticate(&req) {
            Ok(caller) => caller,
            Err(status) => {
                // A stranger's call: named only by a method this gateway serves.
                tracing::info!(
                    target: "sbx::audit",
                    method = %method_label(&path),
                    outcome = ?status.code(),
                    "refused: not authenticated"
                );
                return Box::pin(async move { Ok(status.into_http()) });
            }
        };
        let allowed = match need {
            Need::Nothing | Need::Anyone => Ok(()),
            Need::Gateway(role) => caller.require_gateway(role),
            // The workspace is the handler's to check; the role is checked here.
            Need::Workspace(role) if caller.role >= role => Ok(()),
            Need::Workspace(role) => Err(Status::permission_denied(format!(
                "{} ({}) is {} {} and this needs {} {role}",
                caller.name,
                caller.proof,
                article(caller.role),
                caller.role,
                article(role)
            ))),
        };
        if let Err(status) = allowed {
            tracing::info!(
                target: "sbx::audit",
                who = %caller.name,
                proof = %caller.proof,
                method = %method_label(&path),
                outcome = ?status.code(),
                "refused: not allowed"
            );
            return Box::pin(async move { Ok(status.into_http()) });
        }
        prove_connection(&req);
        let who = caller.name.clone();
        let proof = caller.proof.to_string();
        req.extensions_mut().insert(caller);
        let answer = self.inner.call(req);
        Box::pin(async move {
            let response = answer.await?;
            if audited {
                tracing::info!(
                    target: "sbx::audit",
                    who = %who,
                    proof = %proof,
                    method = %path,
                    outcome = ?code_of(response.headers()),
                    "call"
                );
            }
            Ok(response)
        })
    }
}

/// The caller of a request that went through [`AuthLayer`]. A request without one (a
/// handler reached some other way: a bug) is refused rather than served unchecked.
pub fn caller<T>(req: &tonic::Request<T>) -> Result<Caller, Status> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::internal("the call reached its handler unauthenticated"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scoped(role: Role, ws: &[(Uuid, &str)]) -> Caller {
        Caller {
            name: "t".into(),
            proof: Proof::Token,
            role,
            grants: Some(ws.iter().map(|(id, n)| (*id, n.to_string())).collect()),
            check: None,
            token_sha256: None,
        }
    }

    #[test]
    fn roles_include_the_ones_below_in_their_workspaces_only() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let (a, b) = (a.to_string(), b.to_string());
        let editor = scoped(Role::Editor, &[(a.parse().unwrap(), "a")]);
        assert!(editor.may(&a, Role::Viewer) && editor.may(&a, Role::Editor));
        assert!(!editor.may(&a, Role::Admin));
        assert!(!editor.may(&b, Role::Viewer));
        assert!(editor.require("a", Some(&a), Role::Editor).is_ok());
        // Another workspace, or one named as a granted one but not it, or none of that name.
        assert!(editor.require("b", Some(&b), Role::Viewer).is_err());
        assert!(editor.require("a", Some(&b), Role::Viewer).is_err());
        assert!(editor.require("a", None, Role::Viewer).is_err());
        assert!(!editor.may("not-an-id", Role::Viewer));
        assert!(editor.require_gateway(Role::Viewer).is_err());
        let admin = Caller::admin("root", Proof::NoAuth);
        assert!(admin.may(&b, Role::Admin));
        assert!(admin.require("gone", None, Role::Admin).is_ok());
        assert!(admin.require_gateway(Role::Admin).is_ok());
    }

    #[test]
    fn every_public_rpc_is_declared_and_unknown_paths_are_not() {
        // The public API's services (the driver contract is served elsewhere, not by sbxd).
        for path in PUBLIC_METHODS.iter() {
            let declared = need(path);
            assert!(declared.is_some(), "{path} is not declared");
            assert_ne!(declared.map(|d| d.0), Some(Need::Nothing), "{path}");
        }
        assert!(
            PUBLIC_METHODS.len() >= 39,
            "only {} methods found",
            PUBLIC_METHODS.len()
        );
        assert!(PUBLIC_METHODS.contains("/sbx.v1.SandboxService/Exec"));
        // Providers hold credentials: reads are viewer, every change editor and audited.
        use Need::Workspace;
        for (method, role, audited) in [
            ("CreateProvider", Role::Editor, true),
            ("UpdateProvider", Role::Editor, true),
            ("DeleteProvider", Role::Editor, true),
            ("AttachProvider", Role::Editor, true),
            ("GetProvider", Role::Viewer, false),
            ("ListProviders", Role::Viewer, false),
        ] {
            let path = format!("/sbx.v1.ProviderService/{method}");
            assert!(PUBLIC_METHODS.contains(&path), "{path}");
            assert_eq!(need(&path), Some((Workspace(role), audited)), "{path}");
        }
        assert_eq!(need("/sbx.v1.SandboxService/Nope"), None);
        assert_eq!(need("/nothing"), None);
        assert_eq!(
            need("/grpc.health.v1.Health/Check"),
            Some((Need::Nothing, false))
        );
    }

    #[test]
    fn malformed_bearer_metadata_is_unauthenticated() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(bearer(&headers).unwrap(), None);
        for bad in ["Basic abc", "Bearer ", "Bearer notours", "Bearer sbx_"] {
            headers.insert(http::header::AUTHORIZATION, bad.parse().unwrap());
            let answer = bearer(&headers);
            if bad == "Bearer sbx_" {
                assert_eq!(answer.unwrap(), Some("sbx_"));
                continue;
            }
            assert_eq!(
                answer.map_err(|s| s.code()),
                Err(Code::Unauthenticated),
                "{bad}"
            );
        }
        let long = format!("Bearer sbx_{}", "a".repeat(300));
        headers.insert(http::header::AUTHORIZATION, long.parse().unwrap());
        assert!(bearer(&headers).is_err());
    }
}
