//! `sbx.v1.ImageService` over the actor API.
//!
//! An import's bytes are spooled to a temp file in the image store's `tmp/` (the same file
//! system, so nothing is copied across devices) and imported from there; the upload is
//! refused (`INVALID_ARGUMENT`) once it passes the gateway's limit
//! (`Config::max_image_import_bytes`, 8 GiB by default) and the temp file is removed either
//! way. A pull's progress reaches the client as it goes; the pull itself runs in a task of
//! its own, so a client that goes away does not leave the store half-written (the pull
//! finishes and records the image). With an image mirror, what a pull or import recorded is
//! pushed to it before the answer (`super::mirror`).

use std::io::Write;

use futures::StreamExt;
use sbx_actors::{ActorError, ImageFailure, ImageSelector};
use sbx_drivers::image::{PullOptions, PullProgress, RegistryAuth};
use sbx_proto::v1::image_service_server::ImageService;
use sbx_proto::v1::{
    DeleteImageRequest, DeleteImageResponse, GetImageRequest, Image, ImportImageRequest,
    ImportImageResponse, ListImagesRequest, ListImagesResponse, PullImageRequest,
    PullImageResponse, PullLayerBytes, PullLayerDone, PullResolved, import_image_request,
    pull_image_response, pull_progress,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::SbxService;
use super::status::actor_error_to_status;
use super::streams::{ResponseStream, forward};

/// Progress messages buffered for a slow client; past that, byte counts are dropped (the
/// next one says more), never the final image.
const PROGRESS_BUFFER: usize = 256;

fn status(e: ActorError) -> Status {
    actor_error_to_status(&e)
}

fn selector(image: Option<sbx_proto::v1::ImageRef>) -> Result<ImageSelector, Status> {
    let r = image.unwrap_or_default();
    ImageSelector::parse(&r.id, &r.reference).map_err(status)
}

/// The public form of a pull progress event.
pub fn progress_message(p: PullProgress) -> sbx_proto::v1::PullProgress {
    use pull_progress::Event;
    let event = match p {
        PullProgress::Resolved {
            digest,
            layers,
            total_bytes,
        } => Event::Resolved(PullResolved {
            digest,
            layers: layers as u32,
            total_bytes,
        }),
        PullProgress::Layer {
            digest,
            done,
            total,
        } => Event::Layer(PullLayerBytes {
            digest,
            done,
            total,
        }),
        PullProgress::LayerCached { digest, size } => Event::Cached(PullLayerDone { digest, size }),
        PullProgress::LayerUnpacked { digest } => {
            Event::Unpacked(PullLayerDone { digest, size: 0 })
        }
    };
    sbx_proto::v1::PullProgress { event: Some(event) }
}

#[tonic::async_trait]
impl ImageService for SbxService {
    type PullImageStream = ResponseStream<PullImageResponse>;

    async fn pull_image(
        &self,
        request: Request<PullImageRequest>,
    ) -> Result<Response<Self::PullImageStream>, Status> {
        let req = request.into_inner();
        let auth = if req.username.is_empty() && req.password.is_empty() {
            RegistryAuth::Anonymous
        } else {
            RegistryAuth::Basic {
                username: req.username,
                password: req.password,
            }
        };
        let options = PullOptions {
            insecure: req.insecure,
            auth,
        };
        let (tx, rx) = mpsc::channel(PROGRESS_BUFFER);
        let gateway = self.gateway.clone();
        let mirror = self.image_mirror.clone();
        tokio::spawn(async move {
            let progress_tx = tx.clone();
            let progress = move |p: PullProgress| {
                let msg = PullImageResponse {
                    message: Some(pull_image_response::Message::Progress(progress_message(p))),
                };
                let _ = progress_tx.try_send(Ok(msg));
            };
            // A caller that goes away ends its pull (the answer's stream is dropped then).
            let result = tokio::select! {
                result = gateway.pull_image(&req.reference, &options, &progress) => result,
                () = tx.closed() => {
                    tracing::info!(reference = %req.reference, "the pull's caller went away; the pull ends");
                    return;
                }
            };
            // Pushed to the image mirror before it is answered (see `super::mirror`).
            let result = match (result, &mirror) {
                (Ok(image), Some(mirror)) => mirror
                    .push_added(std::slice::from_ref(&image))
                    .await
                    .map(|()| image),
                (result, _) => result,
            };
            let last = result.map_err(status).map(|image| PullImageResponse {
                message: Some(pull_image_response::Message::Image(image)),
            });
            let _ = tx.send(last).await;
        });
        Ok(Response::new(forward(
            ReceiverStream::new(rx),
            self.shutdown.clone(),
        )))
    }

    async fn import_image(
        &self,
        request: Request<Streaming<ImportImageRequest>>,
    ) -> Result<Response<ImportImageResponse>, Status> {
        let caller = crate::auth::caller(&request)?;
        // The upload ends at its caller's revocation (checked every second), and nothing of
        // it is imported then.
        let mut stream = caller.until_revoked(request.into_inner());
        let name = match stream.next().await {
            Some(Ok(ImportImageRequest {
                part: Some(import_image_request::Part::Header(h)),
            })) => h.name,
            Some(Err(e)) => return Err(e),
            _ => {
                return Err(status(ActorError::InvalidArgument(
                    "an import starts with a header message (the image's name, maybe empty)".into(),
                )));
            }
        };
        if !name.is_empty() {
            sbx_actors::image_record_name(&name).map_err(status)?;
        }
        let (dir, limit) = self.gateway.image_spool().map_err(status)?;
        let spool = tempfile::Builder::new()
            .prefix("upload-")
            .tempfile_in(&dir)
            .map_err(|e| {
                status(ActorError::Internal(format!(
                    "cannot create an upload file in {}: {e}",
                    dir.display()
                )))
            })?;
        let mut file = spool.as_file();
        let mut received: u64 = 0;
        while let Some(msg) = stream.next().await {
            let chunk = match msg?.part {
                Some(import_image_request::Part::Chunk(bytes)) => bytes,
                _ => {
                    return Err(status(ActorError::InvalidArgument(
                        "only the first message of an import is a header; the rest are chunks"
                            .into(),
                    )));
                }
            };
            received += chunk.len() as u64;
            if received > limit {
                return Err(status(ActorError::Image {
                    kind: ImageFailure::InvalidArgument,
                    message: format!(
                        "the import is over the gateway's limit of {limit} bytes{}",
                        if name.is_empty() {
                            String::new()
                        } else {
                            format!(" (image {name})")
                        }
                    ),
                }));
            }
            file.write_all(&chunk).map_err(|e| {
                status(ActorError::Internal(format!(
                    "writing the upload to {}: {e}",
                    spool.path().display()
                )))
            })?;
        }
        if received == 0 {
            return Err(status(ActorError::InvalidArgument(
                "the import sent no bytes".into(),
            )));
        }
        if !caller.still_valid() {
            return Err(Status::unauthenticated(format!(
                "{} was revoked or expired during the upload; nothing is imported",
                caller.name
            )));
        }
        let name = (!name.is_empty()).then_some(name);
        let images = self
            .gateway
            .import_image(spool.path(), name.as_deref())
            .await
            .map_err(status)?;
        if let Some(mirror) = &self.image_mirror {
            mirror.push_added(&images).await.map_err(status)?;
        }
        Ok(Response::new(ImportImageResponse { images }))
    }

    async fn list_images(
        &self,
        request: Request<ListImagesRequest>,
    ) -> Result<Response<ListImagesResponse>, Status> {
        let req = request.into_inner();
        let page = self
            .gateway
            .list_images(req.page_size, &req.page_token)
            .await
            .map_err(status)?;
        Ok(Response::new(ListImagesResponse {
            images: page.items,
            next_page_token: page.next_page_token,
        }))
    }

    async fn get_image(
        &self,
        request: Request<GetImageRequest>,
    ) -> Result<Response<Image>, Status> {
        let sel = selector(request.into_inner().image)?;
        self.gateway
            .get_image(&sel)
            .await
            .map(Response::new)
            .map_err(status)
    }

    async fn delete_image(
        &self,
        request: Request<DeleteImageRequest>,
    ) -> Result<Response<DeleteImageResponse>, Status> {
        let sel = selector(request.into_inner().image)?;
        let deleted = self.gateway.delete_image(&sel).await.map_err(status)?;
        Ok(Response::new(DeleteImageResponse { deleted }))
    }
}
