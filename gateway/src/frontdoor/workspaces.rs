//! Workspaces: made only by a gateway-wide admin (a workspace that does not exist yet is no
//! scoped grant's), read by a viewer, deleted by an admin of it, listed as the caller sees
//! them (pages filled from what it may see: [`super::visible_page`]). Their defaults — their
//! sandboxes' network policy, resource limits and lifetime — are set by one front-door call
//! (an admin of the workspace; audited naming which), as the three gRPC calls that set them
//! differ only in what they set.

use std::collections::HashMap;

use sbx_actors::WorkspaceSelector;
use sbx_proto::v1::{Lifetime, NetworkPolicy, Resources, Workspace};

use super::access::refused;
use super::{Failure, FrontDoor, audit, visible_page};
use crate::auth::{Caller, Role};

/// One default of a workspace's sandboxes, to set (`None`: the gateway's own again).
pub enum WorkspaceDefault {
    Network(Option<NetworkPolicy>),
    Limits(Option<Resources>),
    Lifetime(Option<Lifetime>),
}

impl FrontDoor {
    /// Sets one default of the workspace `sel` names (admin there).
    pub async fn set_workspace_default(
        &self,
        caller: &Caller,
        sel: &WorkspaceSelector,
        default: WorkspaceDefault,
    ) -> Result<Workspace, Failure> {
        self.workspace_access(caller, sel, Role::Admin).await?;
        let (set, action) = match default {
            WorkspaceDefault::Network(policy) => (
                self.gateway.set_workspace_network(sel, policy).await,
                "set workspace default network",
            ),
            WorkspaceDefault::Limits(resources) => (
                self.gateway.set_workspace_limits(sel, resources).await,
                "set workspace default limits",
            ),
            WorkspaceDefault::Lifetime(lifetime) => (
                self.gateway.set_workspace_lifetime(sel, lifetime).await,
                "set workspace default lifetime",
            ),
        };
        let workspace = set.map_err(|e| FrontDoor::failure(caller, e))?;
        audit(caller, action, &workspace.id);
        Ok(workspace)
    }
}

impl FrontDoor {
    /// Makes workspace `name` (a gateway-wide admin only: a scoped admin of a deleted one
    /// must not make its successor).
    pub async fn create_workspace(
        &self,
        caller: &Caller,
        name: &str,
        labels: HashMap<String, String>,
    ) -> Result<Workspace, Failure> {
        caller.require_gateway(Role::Admin).map_err(refused)?;
        let created = self.gateway.create_workspace(name, labels).await;
        let created = created.map_err(|e| FrontDoor::failure(caller, e))?;
        audit(caller, "create workspace", &created.id);
        Ok(created)
    }

    /// The workspace `sel` names (viewer there).
    pub async fn get_workspace(
        &self,
        caller: &Caller,
        sel: &WorkspaceSelector,
    ) -> Result<Workspace, Failure> {
        self.workspace_access(caller, sel, Role::Viewer).await?;
        let workspace = self.gateway.get_workspace(sel).await;
        workspace.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// One page of the workspaces `label_selector` matches that the caller sees, and the
    /// token of the next.
    pub async fn list_workspaces(
        &self,
        caller: &Caller,
        label_selector: &str,
        page_size: u32,
        token: &str,
    ) -> Result<(Vec<Workspace>, String), Failure> {
        let gateway = &self.gateway;
        visible_page(
            page_size,
            token,
            |size, token| async move {
                gateway.list_workspaces(label_selector, size, &token).await
            },
            |ws: &Workspace| caller.sees(&ws.id),
        )
        .await
        .map_err(|e| FrontDoor::failure(caller, e))
    }

    /// Deletes the workspace `sel` names (admin there), with what is in it when `cascade`;
    /// whether there was one.
    pub async fn delete_workspace(
        &self,
        caller: &Caller,
        sel: &WorkspaceSelector,
        cascade: bool,
    ) -> Result<bool, Failure> {
        self.workspace_access(caller, sel, Role::Admin).await?;
        audit(caller, "delete workspace", &format!("{sel:?}"));
        let deleted = self.gateway.delete_workspace(sel, cascade).await;
        deleted.map_err(|e| FrontDoor::failure(caller, e))
    }
}
