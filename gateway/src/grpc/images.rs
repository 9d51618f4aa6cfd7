//! `sbx.v1.ImageService`: adapters over the front door's image reads and deletes
//! ([`crate::frontdoor`]); pulls, imports and builds are `image_adds`'s.

use sbx_actors::ImageSelector;
use sbx_proto::v1::image_service_server::ImageService;
use sbx_proto::v1::{
    BuildImageInput, BuildImageOutput, DeleteImageRequest, DeleteImageResponse, GetImageRequest,
    Image, ImportImageRequest, ImportImageResponse, ListImagesRequest, ListImagesResponse,
    PruneImagesRequest, PruneImagesResponse, PullImageRequest, PullImageResponse,
};
use tonic::{Request, Response, Status, Streaming};

use super::SbxService;
use super::status::{actor_error_to_status, failed};
use super::streams::ResponseStream;
use crate::auth;

/// What an `ImageRef` names, and the workspace it is seen from (empty: "default").
fn selector(image: Option<sbx_proto::v1::ImageRef>) -> Result<(ImageSelector, String), Status> {
    let r = image.unwrap_or_default();
    let sel = ImageSelector::parse(&r.id, &r.reference).map_err(|e| actor_error_to_status(&e))?;
    Ok((sel, workspace_or_default(r.workspace)))
}

/// An empty workspace in a request means "default".
pub(super) fn workspace_or_default(workspace: String) -> String {
    match workspace.is_empty() {
        true => sbx_proto::names::DEFAULT_WORKSPACE.to_string(),
        false => workspace,
    }
}

#[tonic::async_trait]
impl ImageService for SbxService {
    type PullImageStream = ResponseStream<PullImageResponse>;

    async fn pull_image(
        &self,
        request: Request<PullImageRequest>,
    ) -> Result<Response<Self::PullImageStream>, Status> {
        self.pull(request).await
    }

    async fn import_image(
        &self,
        request: Request<Streaming<ImportImageRequest>>,
    ) -> Result<Response<ImportImageResponse>, Status> {
        self.import(request).await
    }

    async fn list_images(
        &self,
        request: Request<ListImagesRequest>,
    ) -> Result<Response<ListImagesResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let workspace = workspace_or_default(req.workspace);
        let page = self
            .front
            .list_images(
                &caller,
                &workspace,
                req.all_workspaces,
                req.page_size,
                &req.page_token,
            )
            .await
            .map_err(failed)?;
        Ok(Response::new(ListImagesResponse {
            images: page.items,
            next_page_token: page.next_page_token,
        }))
    }

    async fn get_image(
        &self,
        request: Request<GetImageRequest>,
    ) -> Result<Response<Image>, Status> {
        let caller = auth::caller(&request)?;
        let (sel, workspace) = selector(request.into_inner().image)?;
        let image = self.front.get_image(&caller, &sel, &workspace).await;
        image.map(Response::new).map_err(failed)
    }

    type BuildImageStream = ResponseStream<BuildImageOutput>;

    async fn build_image(
        &self,
        request: Request<Streaming<BuildImageInput>>,
    ) -> Result<Response<Self::BuildImageStream>, Status> {
        self.build(request).await
    }

    async fn delete_image(
        &self,
        request: Request<DeleteImageRequest>,
    ) -> Result<Response<DeleteImageResponse>, Status> {
        let caller = auth::caller(&request)?;
        let (sel, workspace) = selector(request.into_inner().image)?;
        let deleted = self.front.delete_image(&caller, &sel, &workspace).await;
        let deleted = deleted.map_err(failed)?;
        Ok(Response::new(DeleteImageResponse { deleted }))
    }

    async fn prune_images(
        &self,
        request: Request<PruneImagesRequest>,
    ) -> Result<Response<PruneImagesResponse>, Status> {
        let caller = auth::caller(&request)?;
        let PruneImagesRequest {
            workspace,
            all,
            gateway: gateways_own,
        } = request.into_inner();
        let workspace = workspace_or_default(workspace);
        let pruned = self
            .front
            .prune_images(&caller, &workspace, all, gateways_own)
            .await
            .map_err(failed)?;
        Ok(Response::new(PruneImagesResponse {
            removed: pruned.removed,
            bytes_freed: pruned.bytes_freed,
        }))
    }
}
