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
    BuildImageInput, BuildImageOutput, BuildLog, BuildStep, DeleteImageRequest,
    DeleteImageResponse, GetImageRequest, Image, ImportImageRequest, ImportImageResponse,
    ListImagesRequest, ListImagesResponse, PullImageRequest, PullImageResponse, PullLayerBytes,
    PullLayerDone, PullResolved, build_image_input, build_image_output, import_image_request,
    pull_image_response, pull_progress,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::SbxService;
use super::access::audit;
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

/// An image added by a pull or a build, pushed to the image mirror (when the gateway has one)
/// before it is answered.
async fn mirrored(
    result: Result<Image, ActorError>,
    mirror: Option<&std::sync::Arc<super::mirror::ImageMirror>>,
) -> Result<Image, ActorError> {
    match (result, mirror) {
        (Ok(image), Some(mirror)) => mirror
            .push_added(std::slice::from_ref(&image))
            .await
            .map(|()| image),
        (result, _) => result,
    }
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
            let result = mirrored(result, mirror.as_ref()).await;
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
        let (spool, received) = self
            .spool_upload(
                &mut stream,
                |m: ImportImageRequest| match m.part {
                    Some(import_image_request::Part::Chunk(bytes)) => Some(bytes),
                    _ => None,
                },
                "only the first message of an import is a header; the rest are chunks",
                &if name.is_empty() {
                    "the import".to_string()
                } else {
                    format!("the import of {name}")
                },
            )
            .await?;
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
        let sel = selector(request.into_inner().image)?;
        let deleted = self.gateway.delete_image(&sel).await.map_err(status)?;
        Ok(Response::new(DeleteImageResponse { deleted }))
    }
}

impl SbxService {
    /// Writes the byte chunks of an upload (what `chunk` finds in each message; a message
    /// without one is refused with `not_chunk`) to a new file in the image spool, up to the
    /// gateway's import limit. Answers the file (removed when dropped) and its size.
    async fn spool_upload<M, S>(
        &self,
        stream: &mut S,
        chunk: impl Fn(M) -> Option<Vec<u8>>,
        not_chunk: &str,
        what: &str,
    ) -> Result<(tempfile::NamedTempFile, u64), Status>
    where
        S: futures::Stream<Item = Result<M, Status>> + Unpin,
    {
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
            let Some(bytes) = chunk(msg?) else {
                return Err(status(ActorError::InvalidArgument(not_chunk.into())));
            };
            received += bytes.len() as u64;
            if received > limit {
                return Err(status(ActorError::Image {
                    kind: ImageFailure::InvalidArgument,
                    message: format!("{what} is over the gateway's limit of {limit} bytes"),
                }));
            }
            file.write_all(&bytes).map_err(|e| {
                status(ActorError::Internal(format!(
                    "writing the upload to {}: {e}",
                    spool.path().display()
                )))
            })?;
        }
        Ok((spool, received))
    }

    /// `BuildImage` (see `sbx_actors::build`): the start, the context spooled, then the
    /// build, its steps and output streamed as they come.
    pub(super) async fn build(
        &self,
        request: Request<Streaming<BuildImageInput>>,
    ) -> Result<Response<ResponseStream<BuildImageOutput>>, Status> {
        use build_image_input::Input;
        use build_image_output::Output;
        let caller = crate::auth::caller(&request)?;
        let mut stream = caller.until_revoked(request.into_inner());
        let start = match stream.next().await {
            Some(Ok(BuildImageInput {
                input: Some(Input::Start(start)),
            })) => start,
            Some(Err(e)) => return Err(e),
            _ => {
                return Err(status(ActorError::InvalidArgument(
                    "a build starts with its start message (the Dockerfile and options)".into(),
                )));
            }
        };
        let workspace = (!start.workspace.is_empty()).then(|| start.workspace.clone());
        self.require_by_name(
            &caller,
            workspace
                .as_deref()
                .unwrap_or(sbx_proto::names::DEFAULT_WORKSPACE),
            crate::auth::Role::Editor,
        )
        .await?;
        if !start.name.is_empty() {
            sbx_actors::image_record_name(&start.name).map_err(status)?;
        }
        let (context, received) = self
            .spool_upload(
                &mut stream,
                |m: BuildImageInput| match m.input {
                    Some(Input::Context(bytes)) => Some(bytes),
                    _ => None,
                },
                "only the first message of a build is its start; the rest are the context",
                "the build context",
            )
            .await?;
        if !caller.still_valid() {
            return Err(Status::unauthenticated(format!(
                "{} was revoked or expired during the upload; nothing is built",
                caller.name
            )));
        }
        audit(
            &caller,
            "build image",
            if start.name.is_empty() {
                "(unnamed)"
            } else {
                &start.name
            },
        );
        let req = sbx_actors::build::BuildRequest {
            workspace,
            name: (!start.name.is_empty()).then(|| start.name.clone()),
            dockerfile: start.dockerfile,
            build_args: start.build_args.into_iter().collect(),
            allow: start.allow,
            no_cache: start.no_cache,
            driver: start.driver,
            run_timeout: (start.run_timeout_seconds > 0)
                .then(|| std::time::Duration::from_secs(start.run_timeout_seconds.into())),
            context: (received > 0).then(|| context.path().to_path_buf()),
            cancel: tokio_util::sync::CancellationToken::new(),
        };
        let cancel = req.cancel.clone();
        let (tx, rx) = mpsc::channel(PROGRESS_BUFFER);
        let (events_tx, mut events) = mpsc::channel(PROGRESS_BUFFER);
        let gateway = self.gateway.clone();
        let mirror = self.image_mirror.clone();
        tokio::spawn(async move {
            // Held until the build is over: the context's file.
            let _context = context;
            let relay_tx = tx.clone();
            let relay = tokio::spawn(async move {
                while let Some(event) = events.recv().await {
                    let output = match event {
                        sbx_actors::build::BuildEvent::Step {
                            index,
                            count,
                            text,
                            cached,
                        } => Output::Step(BuildStep {
                            index,
                            count,
                            instruction: text,
                            cached,
                        }),
                        sbx_actors::build::BuildEvent::Log { data, stderr } => {
                            Output::Log(BuildLog { data, stderr })
                        }
                    };
                    let msg = BuildImageOutput {
                        output: Some(output),
                    };
                    if relay_tx.send(Ok(msg)).await.is_err() {
                        return;
                    }
                }
            });
            let build = gateway.build_image(req, events_tx);
            tokio::pin!(build);
            let result = tokio::select! {
                result = &mut build => result,
                () = tx.closed() => {
                    // The build ends at its next step, deleting the RUN sandbox it runs.
                    tracing::info!("the build's caller went away; the build ends");
                    cancel.cancel();
                    let _ = (&mut build).await;
                    relay.abort();
                    return;
                }
            };
            // Every event is passed on before the result.
            let _ = relay.await;
            let result = mirrored(result, mirror.as_ref()).await;
            let last = result.map_err(status).map(|image| BuildImageOutput {
                output: Some(Output::Image(image)),
            });
            let _ = tx.send(last).await;
        });
        Ok(Response::new(forward(
            ReceiverStream::new(rx),
            self.shutdown.clone(),
        )))
    }
}
