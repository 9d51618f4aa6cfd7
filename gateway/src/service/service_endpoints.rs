//! `sbx.v1.ServiceEndpointService` over the actor API: an endpoint is its sandbox's, so a
//! call naming a sandbox is checked against the sandbox's workspace; a list without one is a
//! list of a workspace (viewer there) or of all (filtered to what the caller sees).

use sbx_proto::v1::service_endpoint_service_server::ServiceEndpointService;
use sbx_proto::v1::{
    DeleteServiceRequest, DeleteServiceResponse, ExposeServiceRequest, GetServiceRequest,
    ListServicesRequest, ListServicesResponse, ServiceEndpoint,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::access::{audit, error_for};
use super::sandboxes::{describe, selector};
use crate::auth::{self, Role};

#[tonic::async_trait]
impl ServiceEndpointService for SbxService {
    async fn expose_service(
        &self,
        request: Request<ExposeServiceRequest>,
    ) -> Result<Response<ServiceEndpoint>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let exposed = self
            .gateway
            .expose_service(&sel, req.port, &req.name)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "expose service", &exposed.id);
        Ok(Response::new(exposed))
    }

    async fn get_service(
        &self,
        request: Request<GetServiceRequest>,
    ) -> Result<Response<ServiceEndpoint>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        self.gateway
            .get_service(&sel, &req.name)
            .await
            .map(Response::new)
            .map_err(|e| error_for(&caller, e))
    }

    async fn list_services(
        &self,
        request: Request<ListServicesRequest>,
    ) -> Result<Response<ListServicesResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sandbox = match req.sandbox {
            Some(r) => {
                let sel = selector(Some(r))?;
                self.sandbox_access(&caller, &sel, Role::Viewer).await?;
                Some(sel)
            }
            None => {
                self.list_access(&caller, &req.workspace, req.all_workspaces)
                    .await?;
                None
            }
        };
        let services = self
            .gateway
            .list_services(
                sandbox.as_ref(),
                (!req.workspace.is_empty()).then_some(req.workspace.as_str()),
                req.all_workspaces,
            )
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(ListServicesResponse {
            services: services
                .into_iter()
                .filter(|s| caller.sees(&s.workspace_id))
                .collect(),
        }))
    }

    async fn delete_service(
        &self,
        request: Request<DeleteServiceRequest>,
    ) -> Result<Response<DeleteServiceResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "delete service", &describe(&sel));
        let deleted = self
            .gateway
            .delete_service(&sel, &req.name)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(DeleteServiceResponse { deleted }))
    }
}
