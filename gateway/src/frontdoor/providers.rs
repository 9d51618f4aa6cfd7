//! Providers (credentials a sandbox may be given) and their attachments. A provider is
//! checked against the caller in its own workspace (by name: the request's; by id: the
//! provider's, [`FrontDoor::provider_access`]); an attachment, against the sandbox's.
//! Creating, updating and deleting a provider changes credentials, so each is editor and
//! audited with the provider's id; no answer or log line here carries a value.

use std::collections::HashMap;

use sbx_actors::{ProviderSelector, SandboxSelector};
use sbx_proto::names::DEFAULT_WORKSPACE;
use sbx_proto::v1::{Provider, ProviderAttachment};

use super::{Failure, FrontDoor, audit, describe, visible_page};
use crate::auth::{Caller, Role};

/// What an update changes of a provider: credentials and config set or removed by key.
pub struct ProviderChange {
    pub set_credentials: HashMap<String, String>,
    pub remove_credentials: Vec<String>,
    pub set_config: HashMap<String, String>,
    pub remove_config: Vec<String>,
}

/// A provider selector in the audit log: the id, or workspace/name.
fn describe_provider(sel: &ProviderSelector) -> String {
    match sel {
        ProviderSelector::Id(id) => id.to_string(),
        ProviderSelector::Name { workspace, name } => format!(
            "{}/{name}",
            workspace.as_deref().unwrap_or(DEFAULT_WORKSPACE)
        ),
    }
}

impl FrontDoor {
    /// Makes provider `name` of type `kind` in `workspace` (editor there).
    pub async fn create_provider(
        &self,
        caller: &Caller,
        workspace: Option<&str>,
        name: &str,
        kind: &str,
        credentials: HashMap<String, String>,
        config: HashMap<String, String>,
    ) -> Result<Provider, Failure> {
        let ws = workspace.unwrap_or(DEFAULT_WORKSPACE);
        self.require_by_name(caller, ws, Role::Editor).await?;
        let created = self
            .gateway
            .create_provider(workspace, name, kind, credentials, config)
            .await;
        let created = created.map_err(|e| FrontDoor::failure(caller, e))?;
        audit(caller, "create provider", &created.id);
        Ok(created)
    }

    /// The provider `sel` names (viewer in its workspace).
    pub async fn get_provider(
        &self,
        caller: &Caller,
        sel: &ProviderSelector,
    ) -> Result<Provider, Failure> {
        self.provider_access(caller, sel, Role::Viewer).await?;
        let provider = self.gateway.get_provider(sel).await;
        provider.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// One page of the providers of `workspace` (viewer there) or of all (filtered to what
    /// the caller sees), and the token of the next.
    pub async fn list_providers(
        &self,
        caller: &Caller,
        workspace: &str,
        all_workspaces: bool,
        page_size: u32,
        token: &str,
    ) -> Result<(Vec<Provider>, String), Failure> {
        self.list_access(caller, workspace, all_workspaces).await?;
        let named = (!workspace.is_empty()).then_some(workspace);
        let gateway = &self.gateway;
        visible_page(
            page_size,
            token,
            |size, token| async move {
                gateway
                    .list_providers(named, all_workspaces, size, &token)
                    .await
            },
            |p: &Provider| caller.sees(&p.workspace_id),
        )
        .await
        .map_err(|e| FrontDoor::failure(caller, e))
    }

    /// Changes the provider `sel` names (editor in its workspace).
    pub async fn update_provider(
        &self,
        caller: &Caller,
        sel: &ProviderSelector,
        change: ProviderChange,
    ) -> Result<Provider, Failure> {
        self.provider_access(caller, sel, Role::Editor).await?;
        let updated = self
            .gateway
            .update_provider(
                sel,
                change.set_credentials,
                &change.remove_credentials,
                change.set_config,
                &change.remove_config,
            )
            .await;
        let updated = updated.map_err(|e| FrontDoor::failure(caller, e))?;
        audit(caller, "update provider", &updated.id);
        Ok(updated)
    }

    /// Deletes the provider `sel` names (editor in its workspace), detaching it first when
    /// `force`: whether there was one, and the sandboxes it was detached from.
    pub async fn delete_provider(
        &self,
        caller: &Caller,
        sel: &ProviderSelector,
        force: bool,
    ) -> Result<(bool, Vec<String>), Failure> {
        self.provider_access(caller, sel, Role::Editor).await?;
        audit(caller, "delete provider", &describe_provider(sel));
        let deleted = self.gateway.delete_provider(sel, force).await;
        deleted.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// Attaches provider `provider` to the sandbox `sel` names (editor in its workspace).
    pub async fn attach_provider(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        provider: &str,
    ) -> Result<ProviderAttachment, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        let attached = self.gateway.attach_provider(sel, provider).await;
        let attached = attached.map_err(|e| FrontDoor::failure(caller, e))?;
        let object = format!("{} to {}", attached.provider_id, attached.sandbox_id);
        audit(caller, "attach provider", &object);
        Ok(attached)
    }

    /// Detaches provider `provider` from the sandbox `sel` names (editor in its workspace);
    /// whether it was attached.
    pub async fn detach_provider(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        provider: &str,
    ) -> Result<bool, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        let object = format!(
            "{} from {}",
            sbx_actors::limits::truncate(provider, 200),
            describe(sel)
        );
        audit(caller, "detach provider", &object);
        let detached = self.gateway.detach_provider(sel, provider).await;
        detached.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// The providers attached to the sandbox `sel` names (viewer in its workspace).
    pub async fn list_attachments(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
    ) -> Result<Vec<ProviderAttachment>, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        let attachments = self.gateway.list_attachments(sel).await;
        attachments.map_err(|e| FrontDoor::failure(caller, e))
    }
}
