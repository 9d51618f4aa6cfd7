//! `sbx.v1.ImageService`'s adds — pulls, imports and builds — as adapters over the front
//! door's ([`crate::frontdoor`]'s `image_adds`: who may add where, the spooled upload, the
//! ends at a caller's leaving or revocation, the mirror). Here: the request's messages into
//! the door's arguments (an upload's header or start, then its bytes), and its progress and
//! image into `sbx.v1` messages.

use futures::{Stream, StreamExt};
use sbx_actors::ActorError;
use sbx_drivers::image::{PullOptions, PullProgress, RegistryAuth};
use sbx_proto::v1::{
    BuildImageInput, BuildImageOutput, BuildLog, BuildStep, ImportImageRequest,
    ImportImageResponse, PullImageRequest, PullImageResponse, PullLayerBytes, PullLayerDone,
    PullResolved, build_image_input, build_image_output, import_image_request, pull_image_response,
    pull_progress,
};
use tonic::{Request, Response, Status, Streaming};

use super::SbxService;
use super::images::workspace_or_default;
use super::status::{actor_error_to_status, failed};
use super::streams::{ResponseStream, forward};
use crate::frontdoor::{Built, Failure, NewBuild, NewImport, Pulled};

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

/// A build's event or image as its `sbx.v1` message.
fn build_output(built: Built) -> BuildImageOutput {
    use build_image_output::Output;
    let output = match built {
        Built::Event(sbx_build::BuildEvent::Step {
            index,
            count,
            text,
            cached,
        }) => Output::Step(BuildStep {
            index,
            count,
            instruction: text,
            cached,
        }),
        Built::Event(sbx_build::BuildEvent::Log { data, stderr }) => {
            Output::Log(BuildLog { data, stderr })
        }
        Built::Image(image) => Output::Image(*image),
    };
    BuildImageOutput {
        output: Some(output),
    }
}

/// The bytes of an upload's messages after its first (what `chunk` finds in each; a message
/// without any is refused with `not_chunk`), as the front door reads them.
fn chunks<M: Send + 'static>(
    messages: impl Stream<Item = Result<M, Status>> + Send + 'static,
    chunk: fn(M) -> Option<Vec<u8>>,
    not_chunk: &'static str,
) -> impl Stream<Item = Result<Vec<u8>, Failure>> + Send + 'static {
    messages.map(move |m| match m {
        Ok(m) => chunk(m).ok_or_else(|| ActorError::InvalidArgument(not_chunk.into()).into()),
        Err(status) => Err(Failure::from(status)),
    })
}

/// `INVALID_ARGUMENT` (with its ErrorInfo) for a stream that does not start as it must.
fn bad_start(message: &str) -> Status {
    actor_error_to_status(&ActorError::InvalidArgument(message.into()))
}

impl SbxService {
    pub(super) async fn pull(
        &self,
        request: Request<PullImageRequest>,
    ) -> Result<Response<ResponseStream<PullImageResponse>>, Status> {
        use pull_image_response::Message;
        let caller = crate::auth::caller(&request)?;
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
        let workspace = workspace_or_default(req.workspace);
        let pulled = self
            .front
            .pull_image(&caller, req.reference, options, &workspace, req.publish)
            .await
            .map_err(failed)?;
        let messages = pulled.map(|item| {
            let message = match item.map_err(failed)? {
                Pulled::Progress(p) => Message::Progress(progress_message(p)),
                Pulled::Image(image) => Message::Image(*image),
            };
            Ok(PullImageResponse {
                message: Some(message),
            })
        });
        Ok(Response::new(forward(messages, self.shutdown.clone())))
    }

    pub(super) async fn import(
        &self,
        request: Request<Streaming<ImportImageRequest>>,
    ) -> Result<Response<ImportImageResponse>, Status> {
        use import_image_request::Part;
        let caller = crate::auth::caller(&request)?;
        // The stream ends at its caller's revocation from its first message on (the front
        // door ends the upload and the import at it too).
        let mut messages = caller.until_revoked(request.into_inner());
        let header = match messages.next().await {
            Some(Ok(ImportImageRequest {
                part: Some(Part::Header(h)),
            })) => h,
            Some(Err(e)) => return Err(e),
            _ => {
                return Err(bad_start(
                    "an import starts with a header message (the image's name, maybe empty)",
                ));
            }
        };
        let new = NewImport {
            name: (!header.name.is_empty()).then_some(header.name),
            workspace: workspace_or_default(header.workspace),
            publish: header.publish,
        };
        let upload = chunks(
            messages,
            |m| match m.part {
                Some(Part::Chunk(bytes)) => Some(bytes),
                _ => None,
            },
            "only the first message of an import is a header; the rest are chunks",
        );
        let images = self.front.import_image(&caller, new, upload).await;
        let images = images.map_err(failed)?;
        Ok(Response::new(ImportImageResponse { images }))
    }

    /// `BuildImage` (see `sbx_build`): the start, the context, then the build's steps and
    /// output as they come, and its image.
    pub(super) async fn build(
        &self,
        request: Request<Streaming<BuildImageInput>>,
    ) -> Result<Response<ResponseStream<BuildImageOutput>>, Status> {
        use build_image_input::Input;
        let caller = crate::auth::caller(&request)?;
        let mut messages = caller.until_revoked(request.into_inner());
        let start = match messages.next().await {
            Some(Ok(BuildImageInput {
                input: Some(Input::Start(start)),
            })) => start,
            Some(Err(e)) => return Err(e),
            _ => {
                return Err(bad_start(
                    "a build starts with its start message (the Dockerfile and options)",
                ));
            }
        };
        let new = NewBuild {
            workspace: (!start.workspace.is_empty()).then_some(start.workspace),
            name: (!start.name.is_empty()).then_some(start.name),
            dockerfile: start.dockerfile,
            build_args: start.build_args.into_iter().collect(),
            allow: start.allow,
            no_cache: start.no_cache,
            driver: start.driver,
            run_timeout: (start.run_timeout_seconds > 0)
                .then(|| std::time::Duration::from_secs(start.run_timeout_seconds.into())),
            publish: start.publish,
        };
        let context = chunks(
            messages,
            |m| match m.input {
                Some(Input::Context(bytes)) => Some(bytes),
                _ => None,
            },
            "only the first message of a build is its start; the rest are the context",
        );
        let built = self.front.build_image(&caller, new, context).await;
        let built = built.map_err(failed)?;
        let messages = built.map(|item| item.map(build_output).map_err(failed));
        Ok(Response::new(forward(messages, self.shutdown.clone())))
    }
}
