//! Service endpoints: a port of a sandbox that sbxd's HTTP listener routes to. An endpoint is
//! owned by its sandbox's id (deleted in the sandbox's delete transaction, never seen by a
//! new sandbox of the same name, never a blocker once its sandbox is gone); the listener
//! resolves a Host to the endpoint on every request and forwards by the endpoint's stored
//! sandbox id.

use std::collections::BTreeMap;

use prost::Message;
use sbx_proto::v1::ServiceEndpoint;
use sbx_storage::{Kind, LabelSelector, NewRecord, Record, StoreError};
use uuid::Uuid;

use super::Gateway;
use crate::error::{ActorError, Result};
use crate::owned::{self, ServiceBody};
use crate::records::{now_ms, timestamp};
use crate::validate::{self, SandboxSelector};

/// The name an endpoint gets when the request names none.
pub const DEFAULT_SERVICE_NAME: &str = "web";

/// Where a routed request goes: a sandbox (by id) and a port on its loopback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceTarget {
    pub sandbox_id: Uuid,
    pub port: u32,
}

fn not_found(what: String) -> ActorError {
    ActorError::ObjectNotFound {
        kind: "service",
        what,
    }
}

impl Gateway {
    /// The Host an endpoint answers to.
    pub fn service_host(&self, service: &str, sandbox: &str, workspace: &str) -> String {
        format!(
            "{service}--{sandbox}--{workspace}.{}",
            self.shared.config.service_domain
        )
    }

    fn service_message(
        &self,
        record: &Record,
        sandbox: &str,
        workspace: &str,
    ) -> Result<ServiceEndpoint> {
        let body: ServiceBody = owned::decode(record)?;
        Ok(ServiceEndpoint {
            id: record.id.to_string(),
            sandbox_id: record.owner.map(|o| o.to_string()).unwrap_or_default(),
            sandbox: sandbox.to_string(),
            workspace: workspace.to_string(),
            name: record.name.clone(),
            port: body.port,
            host: self.service_host(&record.name, sandbox, workspace),
            created_at: Some(timestamp(record.created_at_ms)),
            resource_version: record.resource_version,
            workspace_id: record.workspace.map(|w| w.to_string()).unwrap_or_default(),
        })
    }

    /// Exposes `port` of a sandbox as endpoint `name` (empty: "web").
    pub async fn expose_service(
        &self,
        sel: &SandboxSelector,
        port: u32,
        name: &str,
    ) -> Result<ServiceEndpoint> {
        let name = if name.is_empty() {
            DEFAULT_SERVICE_NAME
        } else {
            name
        };
        validate::service(name, port)?;
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        let existing =
            owned::owned_records(self.shared.store.as_ref(), sb.id(), Kind::Service).await?;
        if existing.len() >= crate::limits::MAX_SERVICES {
            return Err(ActorError::InvalidArgument(format!(
                "the sandbox has {} service endpoints; at most {} are allowed",
                existing.len(),
                crate::limits::MAX_SERVICES
            )));
        }
        let record = NewRecord {
            id: Uuid::new_v4(),
            kind: Kind::Service,
            workspace: Some(sb.workspace_id()),
            name: name.to_string(),
            owner: Some(sb.id()),
            labels: BTreeMap::new(),
            created_at_ms: now_ms(),
            body: ServiceBody { port }.encode_to_vec(),
        };
        let written = self
            .shared
            .store
            .create(record)
            .await
            .map_err(|e| match e {
                StoreError::AlreadyExists { existing, .. } => ActorError::NameTaken {
                    kind: "service",
                    name: name.to_string(),
                    scope: format!(" on sandbox {:?}", sb.sandbox.name),
                    existing: existing.to_string(),
                },
                StoreError::OwnerNotFound { .. } => super::not_found_id(sb.id()),
                other => other.into(),
            })?;
        tracing::info!(sandbox = %sb.id(), service = name, port, "service endpoint exposed");
        self.service_message(&written, &sb.sandbox.name, &sb.sandbox.workspace)
    }

    pub async fn get_service(&self, sel: &SandboxSelector, name: &str) -> Result<ServiceEndpoint> {
        validate::name("service", name)?;
        let sb = self.resolve_sandbox(sel).await?;
        let record = self
            .shared
            .store
            .get_by_name(Kind::Service, Some(sb.id()), name)
            .await?
            .ok_or_else(|| not_found(format!("{name:?} of sandbox {:?}", sb.sandbox.name)))?;
        self.service_message(&record, &sb.sandbox.name, &sb.sandbox.workspace)
    }

    /// The endpoints of one sandbox, or (`sandbox` None) of a workspace (none named:
    /// `default`) or of all.
    pub async fn list_services(
        &self,
        sandbox: Option<&SandboxSelector>,
        workspace: Option<&str>,
        all_workspaces: bool,
    ) -> Result<Vec<ServiceEndpoint>> {
        let store = self.shared.store.as_ref();
        let sandboxes = match sandbox {
            Some(sel) => vec![self.resolve_sandbox(sel).await?],
            None => {
                let scope = self
                    .scope(&super::SandboxFilter {
                        workspace: workspace.map(str::to_string),
                        all_workspaces,
                        label_selector: String::new(),
                    })
                    .await?;
                crate::scan::all_records(store, Kind::Sandbox, scope, &LabelSelector::default())
                    .await?
                    .into_iter()
                    .map(crate::records::StoredSandbox::from_record)
                    .collect::<Result<_>>()?
            }
        };
        let mut out = Vec::new();
        for sb in sandboxes {
            for r in owned::owned_records(store, sb.id(), Kind::Service).await? {
                out.push(self.service_message(&r, &sb.sandbox.name, &sb.sandbox.workspace)?);
            }
        }
        Ok(out)
    }

    pub async fn delete_service(&self, sel: &SandboxSelector, name: &str) -> Result<bool> {
        validate::name("service", name)?;
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        let Some(record) = self
            .shared
            .store
            .get_by_name(Kind::Service, Some(sb.id()), name)
            .await?
        else {
            return Ok(false);
        };
        match self
            .shared
            .store
            .delete(record.id, record.resource_version)
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// Where a request for endpoint `service` of sandbox `sandbox` in workspace `workspace`
    /// goes, read from the store now: the endpoint's own sandbox id and port.
    pub async fn resolve_service(
        &self,
        service: &str,
        sandbox: &str,
        workspace: &str,
    ) -> Result<ServiceTarget> {
        let sb = self
            .resolve_sandbox(&SandboxSelector::Name {
                workspace: Some(workspace.to_string()),
                name: sandbox.to_string(),
            })
            .await?;
        let record = self
            .shared
            .store
            .get_by_name(Kind::Service, Some(sb.id()), service)
            .await?
            .ok_or_else(|| not_found(format!("{service:?} of sandbox {workspace}/{sandbox}")))?;
        let body: ServiceBody = owned::decode(&record)?;
        Ok(ServiceTarget {
            sandbox_id: record.owner.ok_or_else(|| {
                ActorError::Internal(format!("service {} has no owner", record.id))
            })?,
            port: body.port,
        })
    }

    /// [`Gateway::resolve_service`] for a request's Host (`NAME--SANDBOX--WORKSPACE.<domain>`,
    /// any port after a `:` ignored, case-insensitive). Sandbox and workspace names may hold
    /// `--` themselves; every split is tried, and a Host two endpoints could answer is
    /// refused rather than resolved by choice.
    pub async fn route_service_host(&self, host: &str) -> Result<ServiceTarget> {
        let host = host.to_ascii_lowercase();
        let host = host.split(':').next().unwrap_or("");
        let suffix = format!(
            ".{}",
            self.shared.config.service_domain.to_ascii_lowercase()
        );
        let label = host.strip_suffix(&suffix).ok_or_else(|| {
            not_found(format!(
                "for Host {} (not under {})",
                crate::limits::quote(host),
                self.shared.config.service_domain
            ))
        })?;
        let (service, rest) = label
            .split_once("--")
            .ok_or_else(|| not_found(format!("for Host {}", crate::limits::quote(host))))?;
        let mut found = Vec::new();
        for (at, _) in rest.match_indices("--") {
            let (sandbox, workspace) = (&rest[..at], &rest[at + 2..]);
            if validate::name("sandbox", sandbox).is_err()
                || validate::name("workspace", workspace).is_err()
            {
                continue;
            }
            match self.resolve_service(service, sandbox, workspace).await {
                Ok(t) => found.push(t),
                Err(ActorError::ObjectNotFound { .. })
                | Err(ActorError::SandboxNotFound { .. })
                | Err(ActorError::WorkspaceNotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        match found.len() {
            1 => Ok(found.remove(0)),
            0 => Err(not_found(format!(
                "for Host {}",
                crate::limits::quote(host)
            ))),
            _ => Err(ActorError::FailedPrecondition(format!(
                "Host {} names more than one service endpoint; rename a sandbox or workspace",
                crate::limits::quote(host)
            ))),
        }
    }
}
