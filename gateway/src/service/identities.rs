//! `sbx.v1.IdentityService`: `sbxd token` over the API, for a gateway-wide admin (the
//! layer's table, [`crate::auth::need`], says so before any of this runs).

use std::time::Duration;

use sbx_proto::v1::identity_service_server::IdentityService;
use sbx_proto::v1::{
    CreateIdentityRequest, CreateIdentityResponse, Identity, ListIdentitiesRequest,
    ListIdentitiesResponse, RevokeIdentityRequest, RevokeIdentityResponse,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::access::audit;
use crate::auth::tokens::{self, NewIdentity, StoredIdentity, TokenError};
use crate::auth::{self, Role};

fn timestamp(ms: u64) -> Option<sbx_proto::Timestamp> {
    (ms != 0).then(|| sbx_proto::Timestamp {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    })
}

fn identity(id: StoredIdentity) -> Identity {
    Identity {
        name: id.name,
        role: id.role.to_string(),
        workspaces: id.workspaces.into_iter().collect(),
        has_token: !id.token_sha256.is_empty(),
        created_at: timestamp(id.created_at_ms),
        expires_at: timestamp(id.expires_at_ms),
    }
}

fn status(e: TokenError) -> Status {
    match e {
        TokenError::Invalid(m) => Status::invalid_argument(m),
        e @ TokenError::Exists(_) => Status::already_exists(e.to_string()),
        e @ TokenError::Unknown { .. } => Status::not_found(e.to_string()),
        e => {
            tracing::error!(error = %e, "the identities file");
            Status::unavailable("the gateway cannot read or write its identities; see its log")
        }
    }
}

fn role(text: &str) -> Result<Role, Status> {
    match text {
        "viewer" => Ok(Role::Viewer),
        "editor" => Ok(Role::Editor),
        "admin" => Ok(Role::Admin),
        other => Err(Status::invalid_argument(format!(
            "role {:?}: expected viewer, editor or admin",
            sbx_actors::limits::truncate(other, 100)
        ))),
    }
}

impl SbxService {
    fn identities_dir(&self) -> Result<&std::path::Path, Status> {
        self.data_dir
            .as_deref()
            .ok_or_else(|| Status::unimplemented("this gateway keeps no identities"))
    }
}

#[tonic::async_trait]
impl IdentityService for SbxService {
    async fn create_identity(
        &self,
        request: Request<CreateIdentityRequest>,
    ) -> Result<Response<CreateIdentityResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        // Each grant holds its workspace's id, resolved now: a workspace made later under the
        // same name is a stranger to it.
        let mut workspace_ids = std::collections::BTreeMap::new();
        for name in &req.workspaces {
            let id = self
                .gateway
                .workspace_id(name)
                .await
                .map_err(|e| super::access::error_for(&caller, e))?;
            if id.is_none() {
                return Err(Status::not_found(format!(
                    "no workspace is named {name:?}: a grant holds a workspace that exists \
                     (create it first)"
                )));
            }
            workspace_ids.insert(name.clone(), id);
        }
        let new = NewIdentity {
            name: req.name,
            role: role(&req.role)?,
            workspaces: req.workspaces.into_iter().collect(),
            workspace_ids,
            ttl: (req.ttl_seconds > 0).then(|| Duration::from_secs(req.ttl_seconds)),
            with_token: !req.cert_only,
            e2b: req.e2b_key,
        };
        let data = self.identities_dir()?.to_path_buf();
        let made = new.clone();
        let token = tokio::task::spawn_blocking(move || tokens::create(&data, &made))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(status)?;
        audit(&caller, "create identity", &new.name);
        let data = self.identities_dir()?;
        let stored = tokens::list(data)
            .map_err(status)?
            .into_iter()
            .find(|i| i.name == new.name)
            .ok_or_else(|| Status::aborted("the identity was revoked as it was made"))?;
        Ok(Response::new(CreateIdentityResponse {
            identity: Some(identity(stored)),
            token: token.unwrap_or_default(),
        }))
    }

    async fn list_identities(
        &self,
        _request: Request<ListIdentitiesRequest>,
    ) -> Result<Response<ListIdentitiesResponse>, Status> {
        let identities = tokens::list(self.identities_dir()?).map_err(status)?;
        Ok(Response::new(ListIdentitiesResponse {
            identities: identities.into_iter().map(identity).collect(),
        }))
    }

    async fn revoke_identity(
        &self,
        request: Request<RevokeIdentityRequest>,
    ) -> Result<Response<RevokeIdentityResponse>, Status> {
        let caller = auth::caller(&request)?;
        let name = request.into_inner().name;
        let data = self.identities_dir()?.to_path_buf();
        let gone = tokio::task::spawn_blocking(move || tokens::revoke(&data, &name))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(status)?;
        audit(&caller, "revoke identity", &gone.name);
        Ok(Response::new(RevokeIdentityResponse {
            identity: Some(identity(gone)),
        }))
    }
}
