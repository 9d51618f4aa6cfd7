//! `sbx.v1.IdentityService`: adapters over the front door's identities (`sbxd token` over the
//! API, for a gateway-wide admin: the layer's table, [`crate::auth::need`], says so before any
//! of this runs).

use std::time::Duration;

use sbx_proto::v1::identity_service_server::IdentityService;
use sbx_proto::v1::{
    CreateIdentityRequest, CreateIdentityResponse, Identity, ListIdentitiesRequest,
    ListIdentitiesResponse, RevokeIdentityRequest, RevokeIdentityResponse,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::status::failed;
use crate::auth::{self, tokens::StoredIdentity};
use crate::frontdoor::IdentityRequest;

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

#[tonic::async_trait]
impl IdentityService for SbxService {
    async fn create_identity(
        &self,
        request: Request<CreateIdentityRequest>,
    ) -> Result<Response<CreateIdentityResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let new = IdentityRequest {
            name: req.name,
            role: req.role,
            workspaces: req.workspaces,
            ttl: (req.ttl_seconds > 0).then(|| Duration::from_secs(req.ttl_seconds)),
            with_token: !req.cert_only,
            e2b: req.e2b_key,
        };
        let made = self.front.create_identity(&caller, new).await;
        let (stored, token) = made.map_err(failed)?;
        Ok(Response::new(CreateIdentityResponse {
            identity: Some(identity(stored)),
            token: token.unwrap_or_default(),
        }))
    }

    async fn list_identities(
        &self,
        _request: Request<ListIdentitiesRequest>,
    ) -> Result<Response<ListIdentitiesResponse>, Status> {
        let identities = self.front.list_identities().map_err(failed)?;
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
        let gone = self.front.revoke_identity(&caller, name).await;
        let gone = gone.map_err(failed)?;
        Ok(Response::new(RevokeIdentityResponse {
            identity: Some(identity(gone)),
        }))
    }
}
