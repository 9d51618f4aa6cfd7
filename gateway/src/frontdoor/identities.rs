//! The identities of the gateway (`sbxd token` over the API): made, listed and revoked in the
//! identities file of its data dir, for a gateway-wide admin (the auth layer's table,
//! [`crate::auth::need`], says so before any of this runs). A made or revoked identity is
//! audited; its token is answered once and kept nowhere but as its hash.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{Class, Failure, FrontDoor, audit};
use crate::auth::tokens::{self, NewIdentity, StoredIdentity, TokenError};
use crate::auth::{Caller, Role};

/// An identity to make.
#[derive(Debug, Clone, Default)]
pub struct IdentityRequest {
    pub name: String,
    /// `viewer`, `editor` or `admin`.
    pub role: String,
    /// The workspaces granted, by name (none: every workspace).
    pub workspaces: Vec<String>,
    /// How long it lives (`None`: for ever).
    pub ttl: Option<Duration>,
    /// Also a token (else the identity is for a client certificate only).
    pub with_token: bool,
    /// The token in E2B's API-key form.
    pub e2b: bool,
}

/// The failure of the identities file: what the caller did wrong, or (logged) that the
/// gateway cannot read or write it.
fn failure(e: TokenError) -> Failure {
    match e {
        TokenError::Invalid(m) => Failure::bare(Class::InvalidArgument, m),
        e @ TokenError::Exists(_) => Failure::bare(Class::AlreadyExists, e.to_string()),
        e @ TokenError::Unknown { .. } => Failure::bare(Class::NotFound, e.to_string()),
        e => {
            tracing::error!(error = %e, "the identities file");
            Failure::bare(
                Class::Unavailable,
                "the gateway cannot read or write its identities; see its log",
            )
        }
    }
}

fn role(text: &str) -> Result<Role, Failure> {
    match text {
        "viewer" => Ok(Role::Viewer),
        "editor" => Ok(Role::Editor),
        "admin" => Ok(Role::Admin),
        other => Err(Failure::invalid(format!(
            "role {:?}: expected viewer, editor or admin",
            sbx_actors::limits::truncate(other, 100)
        ))),
    }
}

/// What a blocking task that failed to finish answers.
fn joined(e: tokio::task::JoinError) -> Failure {
    Failure::bare(Class::Internal, e.to_string())
}

impl FrontDoor {
    /// Keeps the identities in data dir `dir` (without one, the identity calls are
    /// `UNIMPLEMENTED`).
    pub fn with_identities(mut self, dir: &Path) -> Self {
        self.data_dir = Some(dir.to_path_buf());
        self
    }

    fn identities_dir(&self) -> Result<&Path, Failure> {
        self.data_dir
            .as_deref()
            .ok_or_else(|| Failure::bare(Class::Unimplemented, "this gateway keeps no identities"))
    }

    /// Makes the identity `req` asks for: as it is stored, and its token (once; `None` for
    /// one without).
    pub async fn create_identity(
        &self,
        caller: &Caller,
        req: IdentityRequest,
    ) -> Result<(StoredIdentity, Option<String>), Failure> {
        // Each grant holds its workspace's id, resolved now: a workspace made later under the
        // same name is a stranger to it.
        let mut workspace_ids = BTreeMap::new();
        for name in &req.workspaces {
            let id = self.gateway.workspace_id(name).await;
            let id = id.map_err(|e| FrontDoor::failure(caller, e))?;
            if id.is_none() {
                return Err(Failure::bare(
                    Class::NotFound,
                    format!(
                        "no workspace is named {name:?}: a grant holds a workspace that exists \
                         (create it first)"
                    ),
                ));
            }
            workspace_ids.insert(name.clone(), id);
        }
        let new = NewIdentity {
            name: req.name,
            role: role(&req.role)?,
            workspaces: req.workspaces.into_iter().collect(),
            workspace_ids,
            ttl: req.ttl,
            with_token: req.with_token,
            e2b: req.e2b,
        };
        let data: PathBuf = self.identities_dir()?.to_path_buf();
        let made = new.clone();
        let token = tokio::task::spawn_blocking(move || tokens::create(&data, &made))
            .await
            .map_err(joined)?
            .map_err(failure)?;
        audit(caller, "create identity", &new.name);
        let stored = tokens::list(self.identities_dir()?)
            .map_err(failure)?
            .into_iter()
            .find(|i| i.name == new.name)
            .ok_or_else(|| {
                Failure::bare(Class::Aborted, "the identity was revoked as it was made")
            })?;
        Ok((stored, token))
    }

    /// Every identity of the gateway, as stored (hashes of tokens only).
    pub fn list_identities(&self) -> Result<Vec<StoredIdentity>, Failure> {
        tokens::list(self.identities_dir()?).map_err(failure)
    }

    /// Revokes the identity named `name`; what it was.
    pub async fn revoke_identity(
        &self,
        caller: &Caller,
        name: String,
    ) -> Result<StoredIdentity, Failure> {
        let data = self.identities_dir()?.to_path_buf();
        let gone = tokio::task::spawn_blocking(move || tokens::revoke(&data, &name))
            .await
            .map_err(joined)?
            .map_err(failure)?;
        audit(caller, "revoke identity", &gone.name);
        Ok(gone)
    }
}
