//! `sbx.v1.ProviderService`: adapters over the front door's providers
//! ([`crate::frontdoor`]), which checks each call against the provider's workspace (an
//! attachment, against the sandbox's) and audits every change of credentials.

use sbx_actors::ProviderSelector;
use sbx_proto::v1::provider_service_server::ProviderService;
use sbx_proto::v1::{
    AttachProviderRequest, CreateProviderRequest, DeleteProviderRequest, DeleteProviderResponse,
    DetachProviderRequest, DetachProviderResponse, GetProviderRequest, ListAttachmentsRequest,
    ListAttachmentsResponse, ListProvidersRequest, ListProvidersResponse, Provider,
    ProviderAttachment, ProviderRef, UpdateProviderRequest,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::sandboxes::selector;
use super::status::{actor_error_to_status, failed};
use crate::auth;
use crate::frontdoor::ProviderChange;

/// The selector of a request's provider reference (a missing one is empty: INVALID_ARGUMENT).
fn provider_selector(r: Option<ProviderRef>) -> Result<ProviderSelector, Status> {
    ProviderSelector::from_ref(&r.unwrap_or_default()).map_err(|e| actor_error_to_status(&e))
}

#[tonic::async_trait]
impl ProviderService for SbxService {
    async fn create_provider(
        &self,
        request: Request<CreateProviderRequest>,
    ) -> Result<Response<Provider>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        // An empty workspace in a request means "default".
        let workspace = (!req.workspace.is_empty()).then_some(req.workspace.as_str());
        let created = self
            .front
            .create_provider(
                &caller,
                workspace,
                &req.name,
                &req.r#type,
                req.credentials,
                req.config,
            )
            .await;
        created.map(Response::new).map_err(failed)
    }

    async fn get_provider(
        &self,
        request: Request<GetProviderRequest>,
    ) -> Result<Response<Provider>, Status> {
        let caller = auth::caller(&request)?;
        let sel = provider_selector(request.into_inner().provider)?;
        let provider = self.front.get_provider(&caller, &sel).await;
        provider.map(Response::new).map_err(failed)
    }

    async fn list_providers(
        &self,
        request: Request<ListProvidersRequest>,
    ) -> Result<Response<ListProvidersResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let (providers, next_page_token) = self
            .front
            .list_providers(
                &caller,
                &req.workspace,
                req.all_workspaces,
                req.page_size,
                &req.page_token,
            )
            .await
            .map_err(failed)?;
        Ok(Response::new(ListProvidersResponse {
            providers,
            next_page_token,
        }))
    }

    async fn update_provider(
        &self,
        request: Request<UpdateProviderRequest>,
    ) -> Result<Response<Provider>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = provider_selector(req.provider)?;
        let change = ProviderChange {
            set_credentials: req.set_credentials,
            remove_credentials: req.remove_credentials,
            set_config: req.set_config,
            remove_config: req.remove_config,
        };
        let updated = self.front.update_provider(&caller, &sel, change).await;
        updated.map(Response::new).map_err(failed)
    }

    async fn delete_provider(
        &self,
        request: Request<DeleteProviderRequest>,
    ) -> Result<Response<DeleteProviderResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = provider_selector(req.provider)?;
        let deleted = self.front.delete_provider(&caller, &sel, req.force).await;
        let (deleted, detached) = deleted.map_err(failed)?;
        Ok(Response::new(DeleteProviderResponse { deleted, detached }))
    }

    async fn attach_provider(
        &self,
        request: Request<AttachProviderRequest>,
    ) -> Result<Response<ProviderAttachment>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let attached = self
            .front
            .attach_provider(&caller, &sel, &req.provider)
            .await;
        attached.map(Response::new).map_err(failed)
    }

    async fn detach_provider(
        &self,
        request: Request<DetachProviderRequest>,
    ) -> Result<Response<DetachProviderResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let detached = self
            .front
            .detach_provider(&caller, &sel, &req.provider)
            .await;
        let detached = detached.map_err(failed)?;
        Ok(Response::new(DetachProviderResponse { detached }))
    }

    async fn list_attachments(
        &self,
        request: Request<ListAttachmentsRequest>,
    ) -> Result<Response<ListAttachmentsResponse>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        let attachments = self.front.list_attachments(&caller, &sel).await;
        let attachments = attachments.map_err(failed)?;
        Ok(Response::new(ListAttachmentsResponse { attachments }))
    }
}
