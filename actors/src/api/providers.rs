//! Providers (credential sets of a workspace) and their attachments to sandboxes.
//!
//! A provider's credentials are sealed before they reach the store and opened only to build
//! a run's or an exec's environment (`owned::run_env`); no answer here carries a value, only
//! names and fingerprints. A sandbox refers to a provider by id, through an attachment the
//! store checks against the provider in one transaction; the provider cannot be deleted while
//! one exists (`StoreError::Referenced`), so there is no dangling attachment to find later.

use std::collections::{BTreeMap, HashMap};

use prost::Message;
use sbx_proto::v1::{CredentialInfo, Provider, ProviderAttachment};
use sbx_storage::{Kind, NewRecord, Record, StoreError};
use uuid::Uuid;

use super::{Gateway, Listed};
use crate::error::{ActorError, Result};
use crate::owned::{self, ProviderBody};
use crate::protocol::WorkspaceMsg;
use crate::records::{StoredWorkspace, now_ms, timestamp};
use crate::validate::{self, ProviderSelector, SandboxSelector, WorkspaceSelector};

/// How often a provider write is tried again when a concurrent write changed it first.
const CAS_ATTEMPTS: usize = 8;

/// A provider as the public API shows it: names and fingerprints of its credentials, never
/// a value.
fn provider_message(record: &Record, workspace: &str) -> Result<Provider> {
    let body: ProviderBody = owned::decode(record)?;
    Ok(Provider {
        id: record.id.to_string(),
        workspace: workspace.to_string(),
        workspace_id: record.workspace.map(|w| w.to_string()).unwrap_or_default(),
        name: record.name.clone(),
        r#type: body.r#type,
        credentials: body
            .fingerprints
            .into_iter()
            .map(|(name, fingerprint)| CredentialInfo { name, fingerprint })
            .collect(),
        config: body.config.into_iter().collect(),
        created_at: Some(timestamp(record.created_at_ms)),
        updated_at: Some(timestamp(record.updated_at_ms)),
        resource_version: record.resource_version,
    })
}

fn not_found(what: String) -> ActorError {
    ActorError::ObjectNotFound {
        kind: "provider",
        what,
    }
}

impl Gateway {
    /// Creates a provider in a workspace (none named: `default`), its credentials sealed.
    pub async fn create_provider(
        &self,
        workspace: Option<&str>,
        name: &str,
        kind: &str,
        credentials: HashMap<String, String>,
        config: HashMap<String, String>,
    ) -> Result<Provider> {
        validate::name("provider", name)?;
        let credentials: BTreeMap<String, String> = credentials.into_iter().collect();
        let config: BTreeMap<String, String> = config.into_iter().collect();
        validate::provider(kind, &credentials, &config)?;
        self.refuse_if_disk_full()?;
        let ws_name = validate::workspace_or_default(workspace);
        validate::name("workspace", ws_name)?;
        let ws = self
            .resolve_workspace(&WorkspaceSelector::Name(ws_name.to_string()))
            .await?;
        let id = Uuid::new_v4();
        let mut body = ProviderBody {
            r#type: kind.to_string(),
            config,
            ..Default::default()
        };
        self.seal_into(id, &mut body, &credentials)?;
        let record = NewRecord {
            id,
            kind: Kind::Provider,
            workspace: Some(ws.id()),
            name: name.to_string(),
            owner: None,
            labels: BTreeMap::new(),
            created_at_ms: now_ms(),
            body: body.encode_to_vec(),
        };
        let written = self
            .router
            .call_workspace(ws.id(), |reply| WorkspaceMsg::CreateProvider {
                record: record.clone(),
                reply,
            })
            .await?
            .ok_or_else(|| ActorError::WorkspaceNotFound(format!("{ws_name:?}")))?;
        tracing::info!(provider = %id, name, workspace = ws_name, r#type = kind, credentials = ?credentials.keys().collect::<Vec<_>>(), "provider created");
        provider_message(&written, &ws.workspace.name)
    }

    pub async fn get_provider(&self, sel: &ProviderSelector) -> Result<Provider> {
        let (record, ws) = self.resolve_provider(sel).await?;
        provider_message(&record, &ws.workspace.name)
    }

    /// Providers of one workspace (none named: `default`) or of all, in creation order.
    pub async fn list_providers(
        &self,
        workspace: Option<&str>,
        all_workspaces: bool,
        page_size: u32,
        page_token: &str,
    ) -> Result<Listed<Provider>> {
        let scope = self
            .scope(&super::SandboxFilter {
                workspace: workspace.map(str::to_string),
                all_workspaces,
                label_selector: String::new(),
            })
            .await?;
        let page = self
            .list_page(Kind::Provider, scope, "", page_size, page_token, Ok)
            .await?;
        let mut names: HashMap<Uuid, String> = HashMap::new();
        let mut items = Vec::with_capacity(page.items.len());
        for record in page.items {
            let ws = record.workspace.unwrap_or_default();
            if let std::collections::hash_map::Entry::Vacant(slot) = names.entry(ws) {
                let name = match self.resolve_workspace(&WorkspaceSelector::Id(ws)).await {
                    Ok(w) => w.workspace.name,
                    Err(_) => String::new(),
                };
                slot.insert(name);
            }
            items.push(provider_message(&record, &names[&ws])?);
        }
        Ok(Listed {
            items,
            next_page_token: page.next_page_token,
        })
    }

    /// Sets and removes credentials and config entries of a provider (compare-and-swap,
    /// retried on a concurrent change). Attached sandboxes see the change at their next start
    /// and exec.
    pub async fn update_provider(
        &self,
        sel: &ProviderSelector,
        set_credentials: HashMap<String, String>,
        remove_credentials: &[String],
        set_config: HashMap<String, String>,
        remove_config: &[String],
    ) -> Result<Provider> {
        self.refuse_if_disk_full()?;
        let set_credentials: BTreeMap<String, String> = set_credentials.into_iter().collect();
        let set_config: BTreeMap<String, String> = set_config.into_iter().collect();
        for _ in 0..CAS_ATTEMPTS {
            let (mut record, ws) = self.resolve_provider(sel).await?;
            let mut body: ProviderBody = owned::decode(&record)?;
            for name in remove_credentials {
                body.sealed.remove(name);
                body.fingerprints.remove(name);
            }
            for key in remove_config {
                body.config.remove(key);
            }
            body.config.extend(set_config.clone());
            // Checked as a whole: the credentials' sizes are known by name only now, so the
            // check runs over the new values and placeholders of the kept ones' names.
            let mut check: BTreeMap<String, String> = body
                .sealed
                .keys()
                .map(|k| (k.clone(), String::new()))
                .collect();
            check.extend(set_credentials.clone());
            validate::provider(&body.r#type, &check, &body.config)?;
            self.seal_into(record.id, &mut body, &set_credentials)?;
            record.body = body.encode_to_vec();
            record.updated_at_ms = now_ms();
            match self.shared.store.update(record).await {
                Ok(written) => {
                    tracing::info!(provider = %written.id, name = %written.name, set = ?set_credentials.keys().collect::<Vec<_>>(), removed = ?remove_credentials, "provider updated");
                    return provider_message(&written, &ws.workspace.name);
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(StoreError::NotFound { id }) => {
                    return Err(not_found(format!("with id {id} (deleted meanwhile)")));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ActorError::Unavailable(
            "the provider kept changing under the update; retry".into(),
        ))
    }

    /// Deletes a provider. Refused while sandboxes are attached (naming every one as
    /// workspace/name) unless `force`, which detaches them first (each logged). Answers
    /// whether it was deleted (false for an id with no provider) and whom `force` detached.
    pub async fn delete_provider(
        &self,
        sel: &ProviderSelector,
        force: bool,
    ) -> Result<(bool, Vec<String>)> {
        self.refuse_if_disk_full()?;
        let mut detached = Vec::new();
        for _ in 0..CAS_ATTEMPTS {
            let (record, ws) = match self.resolve_provider(sel).await {
                Ok(found) => found,
                Err(ActorError::ObjectNotFound { .. })
                    if matches!(sel, ProviderSelector::Id(_)) =>
                {
                    return Ok((false, detached));
                }
                Err(e) => return Err(e),
            };
            let referrers = self.shared.store.referrers(record.id).await?;
            if !referrers.is_empty() {
                let users = self.attachment_users(&referrers).await?;
                if !force {
                    return Err(ActorError::ProviderInUse {
                        provider: format!("{}/{}", ws.workspace.name, record.name),
                        users: users.into_iter().map(|(_, who)| who).collect(),
                    });
                }
                for (attachment, who) in users {
                    match self
                        .shared
                        .store
                        .delete(attachment.id, attachment.resource_version)
                        .await
                    {
                        Ok(_) | Err(StoreError::NotFound { .. }) => {
                            tracing::info!(provider = %record.id, name = %record.name, sandbox = %who, "provider detached by a forced delete");
                            detached.push(who);
                        }
                        Err(StoreError::Conflict { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            match self
                .shared
                .store
                .delete(record.id, record.resource_version)
                .await
            {
                Ok(_) => {
                    tracing::info!(provider = %record.id, name = %record.name, workspace = %ws.workspace.name, "provider deleted");
                    detached.sort();
                    detached.dedup();
                    return Ok((true, detached));
                }
                Err(StoreError::NotFound { .. }) => return Ok((false, detached)),
                // An attach (or a change) landed between the look and the delete: look again.
                Err(StoreError::Referenced { .. }) | Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ActorError::Unavailable(
            "sandboxes kept attaching to the provider during its delete; retry".into(),
        ))
    }

    /// Attaches a provider of the sandbox's workspace (by name or id) to the sandbox.
    pub async fn attach_provider(
        &self,
        sandbox: &SandboxSelector,
        provider: &str,
    ) -> Result<ProviderAttachment> {
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sandbox).await?;
        let ws = self
            .resolve_workspace(&WorkspaceSelector::Id(sb.workspace_id()))
            .await?;
        let p = self.resolve_provider_in(&ws, provider).await?;
        let attachment =
            owned::attach(self.shared.store.as_ref(), sb.workspace_id(), sb.id(), p.id).await?;
        tracing::info!(provider = %p.id, name = %p.name, sandbox = %sb.id(), "provider attached");
        Ok(ProviderAttachment {
            sandbox_id: sb.id().to_string(),
            provider_id: p.id.to_string(),
            provider_name: p.name,
            created_at: Some(timestamp(attachment.created_at_ms)),
        })
    }

    /// Detaches a provider (by name or id) from a sandbox; false when it was not attached.
    pub async fn detach_provider(&self, sandbox: &SandboxSelector, provider: &str) -> Result<bool> {
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sandbox).await?;
        let ws = self
            .resolve_workspace(&WorkspaceSelector::Id(sb.workspace_id()))
            .await?;
        let p = self.resolve_provider_in(&ws, provider).await?;
        let Some(attachment) = self
            .shared
            .store
            .get_by_name(Kind::Attachment, Some(sb.id()), &p.id.to_string())
            .await?
        else {
            return Ok(false);
        };
        match self
            .shared
            .store
            .delete(attachment.id, attachment.resource_version)
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => {
                tracing::info!(provider = %p.id, name = %p.name, sandbox = %sb.id(), "provider detached");
                Ok(true)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The providers attached to a sandbox, in attachment order.
    pub async fn list_attachments(
        &self,
        sandbox: &SandboxSelector,
    ) -> Result<Vec<ProviderAttachment>> {
        let sb = self.resolve_sandbox(sandbox).await?;
        let mut out = Vec::new();
        for a in owned::owned_records(self.shared.store.as_ref(), sb.id(), Kind::Attachment).await?
        {
            let Some(&provider) = a.refs.first() else {
                continue;
            };
            let name = self
                .shared
                .store
                .get(provider)
                .await?
                .map(|p| p.name)
                .unwrap_or_default();
            out.push(ProviderAttachment {
                sandbox_id: sb.id().to_string(),
                provider_id: provider.to_string(),
                provider_name: name,
                created_at: Some(timestamp(a.created_at_ms)),
            });
        }
        Ok(out)
    }

    /// A provider of workspace `ws` by id or name: an id of a provider elsewhere is not
    /// found (a sandbox only uses its own workspace's providers).
    pub(super) async fn resolve_provider_in(
        &self,
        ws: &StoredWorkspace,
        name_or_id: &str,
    ) -> Result<Record> {
        let found = match Uuid::parse_str(name_or_id) {
            Ok(id) => self
                .shared
                .store
                .get(id)
                .await?
                .filter(|r| r.kind == Kind::Provider && r.workspace == Some(ws.id())),
            Err(_) => {
                validate::name("provider", name_or_id)?;
                self.shared
                    .store
                    .get_by_name(Kind::Provider, Some(ws.id()), name_or_id)
                    .await?
            }
        };
        found.ok_or_else(|| {
            not_found(format!(
                "{} in workspace {:?}",
                crate::limits::quote(name_or_id),
                ws.workspace.name
            ))
        })
    }

    async fn resolve_provider(&self, sel: &ProviderSelector) -> Result<(Record, StoredWorkspace)> {
        match sel {
            ProviderSelector::Id(id) => {
                let record = self
                    .shared
                    .store
                    .get(*id)
                    .await?
                    .filter(|r| r.kind == Kind::Provider)
                    .ok_or_else(|| not_found(format!("with id {id}")))?;
                let ws = self
                    .resolve_workspace(&WorkspaceSelector::Id(record.workspace.unwrap_or_default()))
                    .await?;
                Ok((record, ws))
            }
            ProviderSelector::Name { workspace, name } => {
                let ws_name = validate::workspace_or_default(workspace.as_deref());
                let ws = self
                    .resolve_workspace(&WorkspaceSelector::Name(ws_name.to_string()))
                    .await?;
                let record = self.resolve_provider_in(&ws, name).await?;
                Ok((record, ws))
            }
        }
    }

    /// The attachments `ids` as (record, "workspace/sandbox"), sorted by the latter.
    async fn attachment_users(&self, ids: &[Uuid]) -> Result<Vec<(Record, String)>> {
        let mut out = Vec::new();
        for id in ids {
            let Some(a) = self.shared.store.get(*id).await? else {
                continue;
            };
            let who = match a.owner {
                Some(sb) => match self.shared.store.get(sb).await? {
                    Some(s) => {
                        let ws = match s.workspace {
                            Some(w) => self
                                .resolve_workspace(&WorkspaceSelector::Id(w))
                                .await
                                .map(|w| w.workspace.name)
                                .unwrap_or_default(),
                            None => String::new(),
                        };
                        format!("{ws}/{}", s.name)
                    }
                    None => format!("sandbox {sb}"),
                },
                None => format!("record {id}"),
            };
            out.push((a, who));
        }
        out.sort_by(|a, b| a.1.cmp(&b.1));
        Ok(out)
    }

    /// Seals `credentials` into `body` (replacing those of the same names), with their
    /// fingerprints.
    fn seal_into(
        &self,
        provider: Uuid,
        body: &mut ProviderBody,
        credentials: &BTreeMap<String, String>,
    ) -> Result<()> {
        let sealer = &self.shared.config.secrets;
        for (name, value) in credentials {
            body.sealed
                .insert(name.clone(), sealer.seal(provider, name, value)?);
            body.fingerprints
                .insert(name.clone(), sealer.fingerprint(value));
        }
        Ok(())
    }
}
