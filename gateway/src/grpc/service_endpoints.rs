//! `sbx.v1.ServiceEndpointService`: adapters over the front door's service endpoints
//! ([`crate::frontdoor`]), which checks a call naming a sandbox against its workspace and
//! filters a list across workspaces to what the caller sees.

use sbx_proto::v1::service_endpoint_service_server::ServiceEndpointService;
use sbx_proto::v1::{
    DeleteServiceRequest, DeleteServiceResponse, ExposeServiceRequest, GetServiceRequest,
    ListServicesRequest, ListServicesResponse, ServiceEndpoint,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::sandboxes::selector;
use super::status::failed;
use crate::auth;

#[tonic::async_trait]
impl ServiceEndpointService for SbxService {
    async fn expose_service(
        &self,
        request: Request<ExposeServiceRequest>,
    ) -> Result<Response<ServiceEndpoint>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let exposed = self
            .front
            .expose_service(&caller, &sel, req.port, &req.name)
            .await;
        exposed.map(Response::new).map_err(failed)
    }

    async fn get_service(
        &self,
        request: Request<GetServiceRequest>,
    ) -> Result<Response<ServiceEndpoint>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let endpoint = self.front.get_service(&caller, &sel, &req.name).await;
        endpoint.map(Response::new).map_err(failed)
    }

    async fn list_services(
        &self,
        request: Request<ListServicesRequest>,
    ) -> Result<Response<ListServicesResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sandbox = match req.sandbox {
            Some(r) => Some(selector(Some(r))?),
            None => None,
        };
        let services = self
            .front
            .list_services(
                &caller,
                sandbox.as_ref(),
                &req.workspace,
                req.all_workspaces,
            )
            .await
            .map_err(failed)?;
        Ok(Response::new(ListServicesResponse { services }))
    }

    async fn delete_service(
        &self,
        request: Request<DeleteServiceRequest>,
    ) -> Result<Response<DeleteServiceResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let deleted = self.front.delete_service(&caller, &sel, &req.name).await;
        let deleted = deleted.map_err(failed)?;
        Ok(Response::new(DeleteServiceResponse { deleted }))
    }
}
