//! `sbx.v1.WorkspaceService` over the actor API.

use sbx_actors::WorkspaceSelector;
use sbx_proto::v1::workspace_service_server::WorkspaceService;
use sbx_proto::v1::{
    CreateWorkspaceRequest, DeleteWorkspaceRequest, DeleteWorkspaceResponse, GetWorkspaceRequest,
    ListWorkspacesRequest, ListWorkspacesResponse, Workspace,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::access::{audit, error_for};
use super::status::actor_error_to_status;
use crate::auth::{self, Role};

#[tonic::async_trait]
impl WorkspaceService for SbxService {
    async fn create_workspace(
        &self,
        request: Request<CreateWorkspaceRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        // A workspace that does not exist yet is no scoped grant's: only a gateway-wide admin
        // makes one (a scoped admin of a deleted one must not make its successor).
        caller.require_gateway(Role::Admin)?;
        let created = self
            .gateway
            .create_workspace(&req.name, req.labels)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "create workspace", &created.id);
        Ok(Response::new(created))
    }

    async fn set_workspace_network(
        &self,
        request: Request<sbx_proto::v1::SetWorkspaceNetworkRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        self.workspace_access(&caller, &sel, Role::Admin).await?;
        let workspace = self
            .gateway
            .set_workspace_network(&sel, req.default_network)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "set workspace default network", &workspace.id);
        Ok(Response::new(workspace))
    }

    async fn set_workspace_limits(
        &self,
        request: Request<sbx_proto::v1::SetWorkspaceLimitsRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        self.workspace_access(&caller, &sel, Role::Admin).await?;
        let workspace = self
            .gateway
            .set_workspace_limits(&sel, req.default_resources)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "set workspace default limits", &workspace.id);
        Ok(Response::new(workspace))
    }

    async fn set_workspace_lifetime(
        &self,
        request: Request<sbx_proto::v1::SetWorkspaceLifetimeRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        self.workspace_access(&caller, &sel, Role::Admin).await?;
        let workspace = self
            .gateway
            .set_workspace_lifetime(&sel, req.default_lifetime)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "set workspace default lifetime", &workspace.id);
        Ok(Response::new(workspace))
    }

    async fn get_workspace(
        &self,
        request: Request<GetWorkspaceRequest>,
    ) -> Result<Response<Workspace>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = WorkspaceSelector::from_ref(&req.workspace.unwrap_or_default())
            .map_err(|e| actor_error_to_status(&e))?;
        self.workspace_access(&caller, &sel, Role::Viewer).await?;
        self.gateway
            .get_workspace(&sel)
            .await
            .map(Response::new)
            .map_err(|e| error_for(&caller, e))
    }

    async fn list_workspaces(
        &self,
        request: Request<ListWorkspacesRequest>,
    ) -> Result<Response<ListWorkspacesResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let (workspaces, next_page_token) = super::access::visible_page(
            req.page_size,
            &req.page_token,
            |size, token| {
                let (gateway, selector) = (&self.gateway, &req.label_selector);
                async move { gateway.list_workspaces(selector, size, &token).await }
            },
            |ws: &Workspace| caller.sees(&ws.id),
        )
        .await
        .map_err(|e| error_for(&caller, e))?;
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
        self.workspace_access(&caller, &sel, Role::Admin).await?;
        audit(&caller, "delete workspace", &format!("{sel:?}"));
        let deleted = self
            .gateway
            .delete_workspace(&sel, req.cascade)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(DeleteWorkspaceResponse { deleted }))
    }
}
