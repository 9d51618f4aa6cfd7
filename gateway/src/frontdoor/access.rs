//! The front door's half of authorization ([`crate::auth`]): the workspace a call is about,
//! checked against the caller before the call acts, for every transport.
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

use super::{Failure, FrontDoor};
use crate::auth::{Caller, Role};

/// A refusal of `caller.require` as a front-door failure.
pub(super) fn refused(status: tonic::Status) -> Failure {
    super::forward::failure_of(&status)
}

/// An actor error as this caller may see it: for a scoped caller, no word of other
/// workspaces — a name not found says nowhere else it exists, and a name-only lookup that
/// other workspaces would make ambiguous is simply not found.
pub fn hide(caller: &Caller, e: ActorError) -> ActorError {
    match e {
        // The names it may have meant are of the workspace named, which the caller was
        // checked for before the lookup: they stay.
        ActorError::SandboxNotFound { what, similar, .. } if caller.is_scoped() => {
            ActorError::SandboxNotFound {
                what,
                hint: String::new(),
                similar,
            }
        }
        ActorError::AmbiguousName { name, .. } if caller.is_scoped() => {
            ActorError::SandboxNotFound {
                what: format!("{name:?} in workspace \"{DEFAULT_WORKSPACE}\""),
                hint: String::new(),
                similar: Vec::new(),
            }
        }
        e => e,
    }
}

/// One page of a list across workspaces as a scoped caller sees it: pages are read on from
/// `token` (each asking only for what is still missing) until `page_size` items it `sees` or
/// the end, so how many objects of other workspaces there are shows neither in the items nor
/// in how the pages come (a page of foreign objects would come back empty, with a next
/// page). Bounded by the number of objects: every page read moves the cursor on.
pub async fn visible_page<T, F, Fut>(
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
fn unseen_sandbox(id: uuid::Uuid) -> Failure {
    Failure::from(ActorError::SandboxNotFound {
        what: format!("with id {id}"),
        hint: String::new(),
        similar: Vec::new(),
    })
}

impl FrontDoor {
    /// `PERMISSION_DENIED` unless `caller` holds `role` in the workspace named `name` now (a
    /// gateway-wide caller needs no lookup).
    pub async fn require_by_name(
        &self,
        caller: &Caller,
        name: &str,
        role: Role,
    ) -> Result<(), Failure> {
        if !caller.is_scoped() {
            return caller.require(name, None, role).map_err(refused);
        }
        let id = self
            .gateway
            .workspace_id(name)
            .await
            .map_err(|e| FrontDoor::failure(caller, e))?;
        caller
            .require(name, id.map(|id| id.to_string()).as_deref(), role)
            .map_err(refused)
    }

    /// Whether `caller` holds `role` where the sandbox `sel` names is.
    pub async fn sandbox_access(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        role: Role,
    ) -> Result<(), Failure> {
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
                    Err(e) => return Err(FrontDoor::failure(caller, e)),
                };
                if !caller.sees(&sandbox.workspace_id) {
                    return Err(unseen_sandbox(*id));
                }
                caller
                    .require(&sandbox.workspace, Some(&sandbox.workspace_id), role)
                    .map_err(refused)
            }
        }
    }

    /// The sandbox `sel` names, when `caller` holds `role` in its workspace: one of a
    /// workspace the caller may not see is not found, as one nobody has.
    pub async fn sandbox(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        role: Role,
    ) -> Result<sbx_proto::v1::Sandbox, Failure> {
        if let SandboxSelector::Name { .. } = sel {
            self.sandbox_access(caller, sel, role).await?;
        }
        let sandbox = match self.gateway.get_sandbox(sel).await {
            Ok(sandbox) => sandbox,
            Err(ActorError::SandboxNotFound { .. }) if let SandboxSelector::Id(id) = sel => {
                return Err(unseen_sandbox(*id));
            }
            Err(e) => return Err(FrontDoor::failure(caller, e)),
        };
        if let SandboxSelector::Id(id) = sel
            && !caller.sees(&sandbox.workspace_id)
        {
            return Err(unseen_sandbox(*id));
        }
        caller
            .require(&sandbox.workspace, Some(&sandbox.workspace_id), role)
            .map_err(refused)?;
        Ok(sandbox)
    }

    /// Whether `caller` holds `role` in the workspace of the provider `sel` names: by name,
    /// the request's workspace; by id, the provider's own (one the caller may not see is
    /// NOT_FOUND, as for an id nobody has).
    pub async fn provider_access(
        &self,
        caller: &Caller,
        sel: &ProviderSelector,
        role: Role,
    ) -> Result<(), Failure> {
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
                    Failure::from(ActorError::ObjectNotFound {
                        kind: "provider",
                        what: format!("with id {id}"),
                    })
                };
                let provider = match self.gateway.get_provider(sel).await {
                    Ok(provider) => provider,
                    Err(ActorError::ObjectNotFound { .. }) => return Err(unseen()),
                    Err(e) => return Err(FrontDoor::failure(caller, e)),
                };
                if !caller.sees(&provider.workspace_id) {
                    return Err(unseen());
                }
                caller
                    .require(&provider.workspace, Some(&provider.workspace_id), role)
                    .map_err(refused)
            }
        }
    }

    /// Whether `caller` holds `role` in the workspace `sel` names.
    pub async fn workspace_access(
        &self,
        caller: &Caller,
        sel: &WorkspaceSelector,
        role: Role,
    ) -> Result<(), Failure> {
        match sel {
            WorkspaceSelector::Name(name) => self.require_by_name(caller, name, role).await,
            WorkspaceSelector::Id(id) => {
                if !caller.is_scoped() && caller.role >= role {
                    return Ok(());
                }
                let unseen =
                    || Failure::from(ActorError::WorkspaceNotFound(format!("with id {id}")));
                let workspace = match self.gateway.get_workspace(sel).await {
                    Ok(workspace) => workspace,
                    Err(ActorError::WorkspaceNotFound(_)) => return Err(unseen()),
                    Err(e) => return Err(FrontDoor::failure(caller, e)),
                };
                if !caller.sees(&workspace.id) {
                    return Err(unseen());
                }
                caller
                    .require(&workspace.name, Some(&workspace.id), role)
                    .map_err(refused)
            }
        }
    }

    /// A list or watch of one workspace needs viewer there; across workspaces it is filtered
    /// ([`Caller::sees`]) instead.
    pub async fn list_access(
        &self,
        caller: &Caller,
        workspace: &str,
        all_workspaces: bool,
    ) -> Result<(), Failure> {
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::auth::Proof;
    use crate::frontdoor::Class;

    fn scoped() -> Caller {
        let mut caller = Caller::admin("tenant", Proof::Token);
        caller.role = Role::Editor;
        caller.grants = Some(BTreeMap::from([(uuid::Uuid::new_v4(), "alpha".into())]));
        caller
    }

    /// A scoped caller's not-found says nowhere else the name exists, and an ambiguity other
    /// workspaces make is simply not found; a gateway-wide caller hears it all.
    #[test]
    fn scoped_callers_hear_nothing_of_other_workspaces() {
        let hinted = || ActorError::SandboxNotFound {
            what: "\"web\" in workspace \"alpha\"".into(),
            hint: " (a sandbox \"web\" exists in workspace \"beta\")".into(),
            similar: Vec::new(),
        };
        let admin = Caller::admin("root", Proof::Token);
        assert!(
            FrontDoor::failure(&admin, hinted())
                .message
                .contains("beta")
        );
        let hidden = FrontDoor::failure(&scoped(), hinted());
        assert!(!hidden.message.contains("beta"), "{hidden:?}");
        assert_eq!(hidden.class, Class::NotFound);
        let ambiguous = || ActorError::AmbiguousName {
            name: "web".into(),
            workspaces: vec!["alpha".into(), "beta".into()],
        };
        assert_eq!(
            FrontDoor::failure(&admin, ambiguous()).reason,
            "AMBIGUOUS_NAME"
        );
        let hidden = FrontDoor::failure(&scoped(), ambiguous());
        assert_eq!(
            (hidden.class, hidden.reason.as_str()),
            (Class::NotFound, "SANDBOX_NOT_FOUND")
        );
        assert!(!hidden.message.contains("beta"), "{hidden:?}");
    }

    /// A page of a scoped caller is filled from later pages, whatever others hold between.
    #[tokio::test]
    async fn a_scoped_page_is_full_and_says_nothing_of_others() {
        // 30 objects, every third one the caller's: pages of 4 are read on until 4 are seen.
        let fetch = |size: u32, token: String| async move {
            let start: usize = token.parse().unwrap_or(0);
            let end = (start + size as usize).min(30);
            Ok(sbx_actors::Listed {
                items: (start..end).collect::<Vec<usize>>(),
                next_page_token: if end < 30 {
                    end.to_string()
                } else {
                    String::new()
                },
            })
        };
        let (items, next) = visible_page(4, "", fetch, |i| i % 3 == 0).await.unwrap();
        assert_eq!(items, vec![0, 3, 6, 9]);
        let (rest, last) = visible_page(100, &next, fetch, |i| i % 3 == 0)
            .await
            .unwrap();
        assert_eq!(rest, vec![12, 15, 18, 21, 24, 27]);
        assert!(last.is_empty());
    }
}
