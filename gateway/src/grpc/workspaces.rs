//! `sbx.v1.WorkspaceService`: adapters over the front door's workspaces
//! ([`crate::frontdoor`]).

use sbx_actors::WorkspaceSelector;
use sbx_proto::v1::workspace_service_server::WorkspaceService;
use sbx_proto::v1::{
    CreateWorkspaceRequest, DeleteWorkspaceRequest, DeleteWorkspaceResponse, GetWorkspaceRequest,
    ListWorkspacesRequest, ListWorkspacesResponse, Workspace,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::status::{actor_error_to_status, failed};
use crate::auth;
use crate::frontdoor::WorkspaceDefault;

#[tonic::async_trait]
impl WorkspaceService for SbxService {
    async fn create_workspace(
        &self,
        request: Request<CreateWorkspaceRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let created = self
            .front
            .create_workspace(&caller, &req.name, req.labels)
            .await;
        created.map(Response::new).map_err(failed)
    }

    async fn set_workspace_network(
        &self,
        request: Request<sbx_proto::v1::SetWorkspaceNetworkRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        let set = WorkspaceDefault::Network(req.default_network);
        let answer = self.front.set_workspace_default(&caller, &sel, set).await;
        answer.map(Response::new).map_err(failed)
    }

    async fn set_workspace_limits(
        &self,
        request: Request<sbx_proto::v1::SetWorkspaceLimitsRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        let set = WorkspaceDefault::Limits(req.default_resources);
        let answer = self.front.set_workspace_default(&caller, &sel, set).await;
        answer.map(Response::new).map_err(failed)
    }

    async fn set_workspace_lifetime(
        &self,
        request: Request<sbx_proto::v1::SetWorkspaceLifetimeRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        let set = WorkspaceDefault::Lifetime(req.default_lifetime);
        let answer = self.front.set_workspace_default(&caller, &sel, set).await;
        answer.map(Response::new).map_err(failed)
    }

    async fn get_workspace(
        &self,
        request: Request<GetWorkspaceRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        let workspace = self.front.get_workspace(&caller, &sel).await;
        workspace.map(Response::new).map_err(failed)
    }

    async fn list_workspaces(
        &self,
        request: Request<ListWorkspacesRequest>,
    ) -> Result<Response<ListWorkspacesResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let (workspaces, next_page_token) = self
            .front
            .list_workspaces(&caller, &req.label_selector, req.page_size, &req.page_token)
            .await
            .map_err(failed)?;
        Ok(Response::new(ListWorkspacesResponse {
            workspaces,
            next_page_token,
        }))
    }

    async fn delete_workspace(
        &self,
        request: Request<DeleteWorkspaceRequest>,
    ) -> Result<Response<DeleteWorkspaceResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        let deleted = self
            .front
            .delete_workspace(&caller, &sel, req.cascade)
            .await;
        let deleted = deleted.map_err(failed)?;
        Ok(Response::new(DeleteWorkspaceResponse { deleted }))
    }
}
