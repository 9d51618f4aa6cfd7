//! A sandbox's life as the gRPC door asks for it: made (through the image mirror), read,
//! listed, started, stopped, paused, resumed, restarted, given a ttl or a network policy, and
//! deleted. Each call is checked against the sandbox's workspace first (editor to change it,
//! viewer to read it) and audited; a workspace held by another gateway of the store answers
//! `Elsewhere`, which the gRPC door's forwarding layer sends on to the holder.

use sbx_actors::{SandboxFilter, SandboxSelector};
use sbx_proto::names::DEFAULT_WORKSPACE;
use sbx_proto::v1::{self, Sandbox, SandboxSpec};

use super::{Failure, FrontDoor, audit, describe, visible_page};
use crate::auth::{Caller, Role};

/// A sandbox to make: where, its name and spec, whether it stays stopped, and the providers
/// attached to it as it is made.
pub struct NewSandbox<'a> {
    pub workspace: Option<&'a str>,
    pub name: &'a str,
    pub spec: SandboxSpec,
    pub stopped: bool,
    pub providers: &'a [String],
}

/// A change of a sandbox's state, each audited as its own action.
#[derive(Clone, Copy)]
pub enum SandboxChange {
    Start,
    Stop,
    Pause,
    Resume,
    Restart,
    /// Its ttl, in seconds from now.
    Ttl(u64),
}

impl FrontDoor {
    /// Makes a sandbox (editor in its workspace): the image fetched from the mirror first
    /// when this gateway lacks it.
    pub async fn new_sandbox(
        &self,
        caller: &Caller,
        new: NewSandbox<'_>,
    ) -> Result<Sandbox, Failure> {
        let ws = new.workspace.unwrap_or(DEFAULT_WORKSPACE);
        self.require_by_name(caller, ws, Role::Editor).await?;
        if let Some(mirror) = &self.mirror {
            mirror
                .fetch_for(&self.gateway, new.workspace, &new.spec)
                .await;
        }
        let created = self
            .gateway
            .create_sandbox_with(
                new.workspace,
                new.name,
                new.spec,
                new.stopped,
                new.providers,
            )
            .await;
        let created = created.map_err(|e| FrontDoor::failure(caller, e))?;
        audit(caller, "create sandbox", &created.id);
        Ok(created)
    }

    /// The sandbox `sel` names (viewer in its workspace).
    pub async fn get_sandbox(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
    ) -> Result<Sandbox, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        let sandbox = self.gateway.get_sandbox(sel).await;
        sandbox.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// One page of the sandboxes `filter` names (of one workspace: viewer there; of all:
    /// those the caller sees, the page filled from later ones), and the token of the next.
    pub async fn list_sandbox_page(
        &self,
        caller: &Caller,
        filter: &SandboxFilter,
        page_size: u32,
        token: &str,
    ) -> Result<(Vec<Sandbox>, String), Failure> {
        let workspace = filter.workspace.as_deref().unwrap_or_default();
        self.list_access(caller, workspace, filter.all_workspaces)
            .await?;
        let gateway = &self.gateway;
        visible_page(
            page_size,
            token,
            |size, token| async move { gateway.list_sandboxes(filter, size, &token).await },
            |sb: &Sandbox| caller.sees(&sb.workspace_id),
        )
        .await
        .map_err(|e| FrontDoor::failure(caller, e))
    }

    /// The network of the sandbox `sel` names (viewer in its workspace).
    pub async fn get_sandbox_network(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
    ) -> Result<v1::SandboxNetwork, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        let network = self.gateway.get_sandbox_network(sel).await;
        network.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// Sets the network policy of the sandbox `sel` names (editor in its workspace).
    pub async fn update_sandbox_network(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        policy: v1::NetworkPolicy,
    ) -> Result<v1::SandboxNetwork, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        let entries = policy.allow.len();
        let network = self.gateway.update_sandbox_network(sel, policy).await;
        let network = network.map_err(|e| FrontDoor::failure(caller, e))?;
        let action = format!("update sandbox network ({entries} allow entries)");
        audit(caller, &action, &network.sandbox_id);
        Ok(network)
    }

    /// Changes the state of the sandbox `sel` names (editor in its workspace).
    pub async fn change_sandbox(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        change: SandboxChange,
    ) -> Result<Sandbox, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        let gateway = &self.gateway;
        let (changed, action) = match change {
            SandboxChange::Start => (gateway.start_sandbox(sel).await, "start sandbox"),
            SandboxChange::Stop => (gateway.stop_sandbox(sel).await, "stop sandbox"),
            SandboxChange::Pause => (gateway.pause_sandbox(sel).await, "pause sandbox"),
            SandboxChange::Resume => (gateway.resume_sandbox(sel).await, "resume sandbox"),
            SandboxChange::Restart => (gateway.restart_sandbox(sel).await, "restart sandbox"),
            SandboxChange::Ttl(seconds) => (
                gateway.set_sandbox_ttl(sel, seconds).await,
                "set sandbox ttl",
            ),
        };
        let sandbox = changed.map_err(|e| FrontDoor::failure(caller, e))?;
        audit(caller, action, &sandbox.id);
        Ok(sandbox)
    }

    /// Deletes the sandbox `sel` names and all it owns (editor in its workspace; audited
    /// before it acts); whether there was one.
    pub async fn remove_sandbox(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
    ) -> Result<bool, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        audit(caller, "delete sandbox", &describe(sel));
        let deleted = self.gateway.delete_sandbox(sel).await;
        deleted.map_err(|e| FrontDoor::failure(caller, e))
    }
}
