//! Name resolution: a selector to the record it means. By id: that record or nothing. By
//! name: inside one workspace only (none named: `default`). A name-only request that is not in
//! `default` is never resolved by choice: it is refused, naming the workspaces that do hold
//! that name.

use sbx_storage::{Kind, LabelSelector, Scope};
use uuid::Uuid;

use super::{Gateway, SandboxFilter};
use crate::error::{ActorError, Result};
use crate::records::{StoredSandbox, StoredWorkspace};
use crate::scan::all_records;
use crate::validate::{self, SandboxSelector, WorkspaceSelector};

impl Gateway {
    pub(super) async fn resolve_workspace(
        &self,
        sel: &WorkspaceSelector,
    ) -> Result<StoredWorkspace> {
        let record = match sel {
            WorkspaceSelector::Id(id) => self
                .shared
                .store
                .get(*id)
                .await?
                .filter(|r| r.kind == Kind::Workspace),
            WorkspaceSelector::Name(name) => {
                self.shared
                    .store
                    .get_by_name(Kind::Workspace, None, name)
                    .await?
            }
        };
        match record {
            Some(r) => StoredWorkspace::from_record(r),
            None => Err(ActorError::WorkspaceNotFound(match sel {
                WorkspaceSelector::Id(id) => format!("with id {id}"),
                WorkspaceSelector::Name(name) => format!("{name:?}"),
            })),
        }
    }

    pub(super) async fn resolve_sandbox(&self, sel: &SandboxSelector) -> Result<StoredSandbox> {
        match sel {
            SandboxSelector::Id(id) => match self
                .shared
                .store
                .get(*id)
                .await?
                .filter(|r| r.kind == Kind::Sandbox)
            {
                Some(r) => StoredSandbox::from_record(r),
                None => Err(not_found_id(*id)),
            },
            SandboxSelector::Name { workspace, name } => {
                let ws_name = validate::workspace_or_default(workspace.as_deref());
                let ws = self
                    .resolve_workspace(&WorkspaceSelector::Name(ws_name.to_string()))
                    .await?;
                if let Some(r) = self
                    .shared
                    .store
                    .get_by_name(Kind::Sandbox, Some(ws.id()), name)
                    .await?
                {
                    return StoredSandbox::from_record(r);
                }
                let what = format!("{name:?} in workspace {ws_name:?}");
                if workspace.is_some() {
                    return Err(ActorError::SandboxNotFound {
                        what,
                        hint: String::new(),
                        similar: self.similar_sandbox_names(ws.id(), name).await?,
                    });
                }
                // A name-only request: say where the name does exist, never pick one.
                let elsewhere = self.workspaces_with_sandbox(name).await?;
                match elsewhere.len() {
                    0 => Err(ActorError::SandboxNotFound {
                        what,
                        hint: String::new(),
                        similar: self.similar_sandbox_names(ws.id(), name).await?,
                    }),
                    1 => Err(ActorError::SandboxNotFound {
                        what,
                        hint: format!(
                            " (a sandbox of that name is in workspace {:?}; name the workspace)",
                            elsewhere[0]
                        ),
                        similar: Vec::new(),
                    }),
                    _ => Err(ActorError::AmbiguousName {
                        name: name.clone(),
                        workspaces: elsewhere,
                    }),
                }
            }
        }
    }

    /// The names of workspace `ws`'s sandboxes a typo of `name` may have meant (see
    /// [`sbx_proto::names::similar`]): read only when a name was not found.
    async fn similar_sandbox_names(&self, ws: Uuid, name: &str) -> Result<Vec<String>> {
        let sandboxes = all_records(
            &*self.shared.store,
            Kind::Sandbox,
            Scope::Workspace(ws),
            &LabelSelector::everything(),
        )
        .await?;
        Ok(sbx_proto::names::similar(
            name,
            sandboxes.iter().map(|r| r.name.as_str()),
        ))
    }

    /// The names, sorted, of the workspaces that hold a sandbox called `name`.
    pub(super) async fn workspaces_with_sandbox(&self, name: &str) -> Result<Vec<String>> {
        let mut found = Vec::new();
        let workspaces = all_records(
            &*self.shared.store,
            Kind::Workspace,
            Scope::All,
            &LabelSelector::everything(),
        )
        .await?;
        for ws in workspaces {
            if self
                .shared
                .store
                .get_by_name(Kind::Sandbox, Some(ws.id), name)
                .await?
                .is_some()
            {
                found.push(ws.name);
            }
        }
        found.sort();
        Ok(found)
    }

    pub(super) async fn scope(&self, filter: &SandboxFilter) -> Result<Scope> {
        if filter.all_workspaces {
            return Ok(Scope::All);
        }
        let name = validate::workspace_or_default(filter.workspace.as_deref());
        validate::name("workspace", name)?;
        Ok(Scope::Workspace(
            self.resolve_workspace(&WorkspaceSelector::Name(name.to_string()))
                .await?
                .id(),
        ))
    }
}

pub(super) fn not_found_id(id: Uuid) -> ActorError {
    ActorError::SandboxNotFound {
        what: format!("with id {id}"),
        hint: String::new(),
        similar: Vec::new(),
    }
}
