//! The handlers' half of authorization ([`crate::auth`]): the workspace a call is about,
//! checked against the caller before the call acts.
//!
//! Grants hold workspaces by id. By name, the workspace is in the request: for a scoped
//! caller its name is resolved to the workspace that has it now, and a caller without the
//! role there — or when no workspace has the name — is refused (`PERMISSION_DENIED`) before
//! the object is looked up, so the answer is the same whether it exists or not. By id, the
//! object is looked up first: one in a workspace the caller may not see is `NOT_FOUND`, word
//! for word what an id nobody has gets. Not-found answers lose their hint (where else a name
//! exists) unless the caller sees every workspace.

use sbx_actors::{ActorError, ProviderSelector, SandboxSelector, WorkspaceSelector};
use sbx_proto::names::DEFAULT_WORKSPACE;
use tonic::Status;

use super::SbxService;
use super::status::actor_error_to_status;
use crate::auth::{Caller, Role};

/// The gRPC status of an actor error, as this caller may see it: for a scoped caller, no
/// word of other workspaces — a name not found says nowhere else it exists, and a name-only
/// lookup that other workspaces would make ambiguous is simply not found.
pub fn error_for(caller: &Caller, e: ActorError) -> Status {
    let e = match e {
        ActorError::SandboxNotFound { what, .. } if caller.is_scoped() => {
            ActorError::SandboxNotFound {
                what,
                hint: String::new(),
            }
        }
        ActorError::AmbiguousName { name, .. } if caller.is_scoped() => {
            ActorError::SandboxNotFound {
                what: format!("{name:?} in workspace \"{DEFAULT_WORKSPACE}\""),
                hint: String::new(),
            }
        }
        e => e,
    };
    actor_error_to_status(&e)
}

/// One page of a list across workspaces as a scoped caller sees it: pages are read on from
/// `token` (each asking only for what is still missing) until `page_size` items it `sees` or
/// the end, so how many objects of other workspaces there are shows neither in the items nor
/// in how the pages come (a page of foreign objects would come back empty, with a next
/// page). Bounded by the number of objects: every page read moves the cursor on.
pub(super) async fn visible_page<T, F, Fut>(
    page_size: u32,
    token: &str,
    mut fetch: F,
    sees: impl Fn(&T) -> bool,
) -> Result<(Vec<T>, String), ActorError>
where
    F: FnMut(u32, String) -> Fut,
    Fut: std::future::Future<Output = Result<sbx_actors::Listed<T>, ActorError>>,
{
    let want = match page_size {
        0 => sbx_actors::DEFAULT_PAGE_SIZE,
        n => n.min(sbx_actors::MAX_PAGE_SIZE),
    } as usize;
    let mut items = Vec::new();
    let mut token = token.to_string();
    loop {
        let missing = (want - items.len()) as u32;
        let page = fetch(missing, token).await?;
        items.extend(page.items.into_iter().filter(|item| sees(item)));
        token = page.next_page_token;
        if items.len() >= want || token.is_empty() {
            return Ok((items, token));
        }
    }
}

/// The audit line of an allowed call that names its object (the layer logs the outcome).
pub fn audit(caller: &Caller, action: &str, object: &str) {
    tracing::info!(
        target: "sbx::audit",
        who = %caller.name,
        proof = %caller.proof,
        action,
        object,
        "allowed"
    );
}

/// What an id the caller may not see answers: the same as an id nobody has.
fn unseen_sandbox(id: uuid::Uuid) -> Status {
    actor_error_to_status(&ActorError::SandboxNotFound {
        what: format!("with id {id}"),
        hint: String::new(),
    })
}

impl SbxService {
    /// `PERMISSION_DENIED` unless `caller` holds `role` in the workspace named `name` now (a
    /// gateway-wide caller needs no lookup).
    pub(super) async fn require_by_name(
        &self,
        caller: &Caller,
        name: &str,
        role: Role,
    ) -> Result<(), Status> {
        if !caller.is_scoped() {
            return caller.require(name, None, role);
        }
        let id = self
            .gateway
            .workspace_id(name)
            .await
            .map_err(|e| error_for(caller, e))?;
        caller.require(name, id.map(|id| id.to_string()).as_deref(), role)
    }

    /// Whether `caller` holds `role` where the sandbox `sel` names is.
    pub(super) async fn sandbox_access(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        role: Role,
    ) -> Result<(), Status> {
        match sel {
            SandboxSelector::Name { workspace, .. } => {
                let name = workspace.as_deref().unwrap_or(DEFAULT_WORKSPACE);
                self.require_by_name(caller, name, role).await
            }
            SandboxSelector::Id(id) => {
                if !caller.is_scoped() && caller.role >= role {
                    return Ok(());
                }
                let sandbox = match self.gateway.get_sandbox(sel).await {
                    Ok(sandbox) => sandbox,
                    Err(ActorError::SandboxNotFound { .. }) => return Err(unseen_sandbox(*id)),
                    Err(e) => return Err(error_for(caller, e)),
                };
                if !caller.sees(&sandbox.workspace_id) {
                    return Err(unseen_sandbox(*id));
                }
                caller.require(&sandbox.workspace, Some(&sandbox.workspace_id), role)
            }
        }
    }

    /// Whether `caller` holds `role` in the workspace of the provider `sel` names: by name,
    /// the request's workspace; by id, the provider's own (one the caller may not see is
    /// NOT_FOUND, as for an id nobody has).
    pub(super) async fn provider_access(
        &self,
        caller: &Caller,
        sel: &ProviderSelector,
        role: Role,
    ) -> Result<(), Status> {
        match sel {
            ProviderSelector::Name { workspace, .. } => {
                let name = workspace.as_deref().unwrap_or(DEFAULT_WORKSPACE);
                self.require_by_name(caller, name, role).await
            }
            ProviderSelector::Id(id) => {
                if !caller.is_scoped() && caller.role >= role {
                    return Ok(());
                }
                let unseen = || {
                    actor_error_to_status(&ActorError::ObjectNotFound {
                        kind: "provider",
                        what: format!("with id {id}"),
                    })
                };
                let provider = match self.gateway.get_provider(sel).await {
                    Ok(provider) => provider,
                    Err(ActorError::ObjectNotFound { .. }) => return Err(unseen()),
                    Err(e) => return Err(error_for(caller, e)),
                };
                if !caller.sees(&provider.workspace_id) {
                    return Err(unseen());
                }
                caller.require(&provider.workspace, Some(&provider.workspace_id), role)
            }
        }
    }

    /// Whether `caller` holds `role` in the workspace `sel` names.
    pub(super) async fn workspace_access(
        &self,
        caller: &Caller,
        sel: &WorkspaceSelector,
        role: Role,
    ) -> Result<(), Status> {
        match sel {
            WorkspaceSelector::Name(name) => self.require_by_name(caller, name, role).await,
            WorkspaceSelector::Id(id) => {
                if !caller.is_scoped() && caller.role >= role {
                    return Ok(());
                }
                let unseen = || {
                    actor_error_to_status(&ActorError::WorkspaceNotFound(format!("with id {id}")))
                };
                let workspace = match self.gateway.get_workspace(sel).await {
                    Ok(workspace) => workspace,
                    Err(ActorError::WorkspaceNotFound(_)) => return Err(unseen()),
                    Err(e) => return Err(error_for(caller, e)),
                };
                if !caller.sees(&workspace.id) {
                    return Err(unseen());
                }
                caller.require(&workspace.name, Some(&workspace.id), role)
            }
        }
    }

    /// A list or watch of one workspace needs viewer there; across workspaces it is filtered
    /// ([`Caller::sees`]) instead.
    pub(super) async fn list_access(
        &self,
        caller: &Caller,
        workspace: &str,
        all_workspaces: bool,
    ) -> Result<(), Status> {
        if all_workspaces {
            return Ok(());
        }
        let workspace = if workspace.is_empty() {
            DEFAULT_WORKSPACE
        } else {
            workspace
        };
        self.require_by_name(caller, workspace, Role::Viewer).await
    }
}
