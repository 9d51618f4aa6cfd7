//! `sbx.v1.ProviderService` over the actor API.
//!
//! A provider is checked against the caller in its own workspace (by name: the request's;
//! by id: the provider's, [`SbxService::provider_access`]); an attachment, against the
//! sandbox's. Creating, updating and deleting a provider changes credentials, so each is
//! editor and audited with the provider's id; no answer or log line here carries a value.

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
use super::access::{audit, error_for};
use super::sandboxes::{describe, qualified, selector};
use super::status::actor_error_to_status;
use crate::auth::{self, Role};

/// The selector of a request's provider reference (a missing one is empty: INVALID_ARGUMENT).
fn provider_selector(r: Option<ProviderRef>) -> Result<ProviderSelector, Status> {
    ProviderSelector::from_ref(&r.unwrap_or_default()).map_err(|e| actor_error_to_status(&e))
}

/// A provider selector in the audit log: the id, or workspace/name.
fn describe_provider(sel: &ProviderSelector) -> String {
    match sel {
        ProviderSelector::Id(id) => id.to_string(),
        ProviderSelector::Name { workspace, name } => qualified(workspace.as_deref(), name),
    }
}

/// An empty workspace in a request means "default".
fn workspace_of(workspace: &str) -> Option<&str> {
    (!workspace.is_empty()).then_some(workspace)
}

#[tonic::async_trait]
impl ProviderService for SbxService {
    async fn create_provider(
        &self,
        request: Request<CreateProviderRequest>,
    ) -> Result<Response<Provider>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let workspace = workspace_of(&req.workspace);
        self.require_by_name(
            &caller,
            workspace.unwrap_or(sbx_proto::names::DEFAULT_WORKSPACE),
            Role::Editor,
        )
        .await?;
        let created = self
            .gateway
            .create_provider(
                workspace,
                &req.name,
                &req.r#type,
                req.credentials,
                req.config,
            )
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "create provider", &created.id);
        Ok(Response::new(created))
    }

    async fn get_provider(
        &self,
        request: Request<GetProviderRequest>,
    ) -> Result<Response<Provider>, Status> {
        let caller = auth::caller(&request)?;
        let sel = provider_selector(request.into_inner().provider)?;
        self.provider_access(&caller, &sel, Role::Viewer).await?;
        self.gateway
            .get_provider(&sel)
            .await
            .map(Response::new)
            .map_err(|e| error_for(&caller, e))
    }

    async fn list_providers(
        &self,
        request: Request<ListProvidersRequest>,
    ) -> Result<Response<ListProvidersResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        self.list_access(&caller, &req.workspace, req.all_workspaces)
            .await?;
        let workspace = workspace_of(&req.workspace);
        let (providers, next_page_token) = super::access::visible_page(
            req.page_size,
            &req.page_token,
            |size, token| {
                let gateway = &self.gateway;
                async move {
                    gateway
                        .list_providers(workspace, req.all_workspaces, size, &token)
                        .await
                }
            },
            |p: &Provider| caller.sees(&p.workspace_id),
        )
        .await
        .map_err(|e| error_for(&caller, e))?;
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
        self.provider_access(&caller, &sel, Role::Editor).await?;
        let updated = self
            .gateway
            .update_provider(
                &sel,
                req.set_credentials,
                &req.remove_credentials,
                req.set_config,
                &req.remove_config,
            )
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "update provider", &updated.id);
        Ok(Response::new(updated))
    }

    async fn delete_provider(
        &self,
        request: Request<DeleteProviderRequest>,
    ) -> Result<Response<DeleteProviderResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = provider_selector(req.provider)?;
        self.provider_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "delete provider", &describe_provider(&sel));
        let (deleted, detached) = self
            .gateway
            .delete_provider(&sel, req.force)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(DeleteProviderResponse { deleted, detached }))
    }

    async fn attach_provider(
        &self,
        request: Request<AttachProviderRequest>,
    ) -> Result<Response<ProviderAttachment>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let attached = self
            .gateway
            .attach_provider(&sel, &req.provider)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(
            &caller,
            "attach provider",
            &format!("{} to {}", attached.provider_id, attached.sandbox_id),
        );
        Ok(Response::new(attached))
    }

    async fn detach_provider(
        &self,
        request: Request<DetachProviderRequest>,
    ) -> Result<Response<DetachProviderResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(
            &caller,
            "detach provider",
            &format!(
                "{} from {}",
                sbx_actors::limits::truncate(&req.provider, 200),
                describe(&sel)
            ),
        );
        let detached = self
            .gateway
            .detach_provider(&sel, &req.provider)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(DetachProviderResponse { detached }))
    }

    async fn list_attachments(
        &self,
        request: Request<ListAttachmentsRequest>,
    ) -> Result<Response<ListAttachmentsResponse>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        let attachments = self
            .gateway
            .list_attachments(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(ListAttachmentsResponse { attachments }))
    }
}
