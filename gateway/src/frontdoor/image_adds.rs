//! The adds of images — pulls, imports and builds — for every door: who may add where, the
//! spooled upload, the driving of the add as its caller stays, the audit line and the push to
//! the image mirror. A door parses its request into the arguments here (a byte stream for an
//! upload) and encodes what comes back (progress as it goes, then the image).
//!
//! An import's bytes (and a build's context) are spooled to a temp file in the image store's
//! `tmp/` (the same file system, so nothing is copied across devices) and imported from there;
//! the upload is refused (`INVALID_ARGUMENT`) once it passes the gateway's limit
//! (`Config::max_image_import_bytes`, 8 GiB by default), or (`IMAGE_STORE_FULL`) before it
//! would leave less than `--image-min-free` free, and the temp file is removed either way. A
//! pull's progress reaches the caller as it goes (up to [`PROGRESS_BUFFER`] messages behind;
//! past that, byte counts are dropped, never the image); the pull itself runs in a task of its
//! own.
//!
//! **Who.** A pull, an import or a build lands in the workspace it names (the caller must be
//! its editor; the auth layer wants a gateway-wide editor for any) or, `publish`, in the
//! gateway's images (a gateway-wide admin). A name of `sbx.local/*` is refused from every
//! client before anything is read.
//!
//! **Ends.** A pull, an import and a build end when their caller goes away (the stream they
//! answer is dropped) and when the caller's identity is revoked or expires (checked every
//! second, `auth::RECHECK`, as every stream is; an upload too): the add is cancelled (a running
//! RUN's sandbox is deleted, a download or an unpack stops at its next chunk or file), nothing
//! more of it is recorded, and what it wrote is collected. A revoked caller gets
//! `UNAUTHENTICATED`. With an image mirror, what a pull, an import or a build recorded is
//! pushed to it before the answer (`super::mirror`).

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use sbx_actors::{ActorError, Gateway, ImageFailure, ImageScope};
use sbx_build::{BuildEvent, BuildImage as _};
use sbx_drivers::image::{PullOptions, PullProgress};
use sbx_proto::v1::Image;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::access::refused;
use super::{Class, Failure, FrontDoor, FrontStream, audit, mirror::ImageMirror};
use crate::auth::{Caller, Role};

/// Progress messages buffered for a slow caller; past that, a pull's byte counts are dropped
/// (the next one says more) and a build waits, never the final image.
pub const PROGRESS_BUFFER: usize = 256;

/// What a pull answers as it goes: its progress, then the image.
#[derive(Debug)]
pub enum Pulled {
    Progress(PullProgress),
    Image(Box<Image>),
}

/// What a build answers as it goes: its steps and their output, then the image.
#[derive(Debug)]
pub enum Built {
    Event(BuildEvent),
    Image(Box<Image>),
}

/// Where an import lands and what it is called.
#[derive(Debug, Clone, Default)]
pub struct NewImport {
    /// The image's name (`None`: the names the archive holds).
    pub name: Option<String>,
    /// The workspace it lands in (when not `publish`).
    pub workspace: String,
    /// The gateway's images rather than the workspace's.
    pub publish: bool,
}

/// A build: its Dockerfile and options (the context comes as bytes beside it).
#[derive(Debug, Clone, Default)]
pub struct NewBuild {
    /// The workspace it runs in and lands in (`None`: "default").
    pub workspace: Option<String>,
    /// The built image's name (`None`: unnamed).
    pub name: Option<String>,
    pub dockerfile: String,
    pub build_args: BTreeMap<String, String>,
    pub allow: Vec<String>,
    pub no_cache: bool,
    pub driver: String,
    pub run_timeout: Option<Duration>,
    /// The gateway's images rather than the workspace's.
    pub publish: bool,
}

/// `PERMISSION_DENIED` for a name the gateway keeps for itself (`sbx.local/*`), before
/// anything is fetched or uploaded; the normal form of a valid name.
fn client_name(name: &str) -> Result<String, Failure> {
    let normal = sbx_actors::image_record_name(name)?;
    if sbx_actors::image_name_is_reserved(&normal) {
        return Err(sbx_actors::image_name_reserved(&normal).into());
    }
    Ok(normal)
}

/// An image added by a pull or a build, pushed to the image mirror (when the gateway has one)
/// before it is answered.
async fn mirrored(
    result: Result<Image, ActorError>,
    mirror: Option<&Arc<ImageMirror>>,
) -> Result<Image, ActorError> {
    match (result, mirror) {
        (Ok(image), Some(mirror)) => mirror
            .push_added(std::slice::from_ref(&image))
            .await
            .map(|()| image),
        (result, _) => result,
    }
}

/// `UNAUTHENTICATED` unless `caller` is still there after its upload: nothing is `done`.
fn still_valid(caller: &Caller, done: &str) -> Result<(), Failure> {
    if caller.still_valid() {
        return Ok(());
    }
    Err(Failure::bare(
        Class::Unauthenticated,
        format!(
            "{} was revoked or expired during the upload; nothing is {done}",
            caller.name
        ),
    ))
}

/// Writes the byte chunks of `upload` to a new file in the image store's spool, up to the
/// gateway's import limit and the store's free-space floor. Answers the file (removed when
/// dropped) and its size.
async fn spool_upload<S>(
    gateway: &Gateway,
    upload: &mut S,
    what: &str,
) -> Result<(tempfile::NamedTempFile, u64), Failure>
where
    S: Stream<Item = Result<Vec<u8>, Failure>> + Unpin,
{
    let (dir, limit) = gateway.image_spool()?;
    let spool = tempfile::Builder::new()
        .prefix("upload-")
        .tempfile_in(&dir)
        .map_err(|e| {
            ActorError::Internal(format!(
                "cannot create an upload file in {}: {e}",
                dir.display()
            ))
        })?;
    let mut file = spool.as_file();
    let mut room = gateway.image_room(what)?;
    let mut received: u64 = 0;
    while let Some(bytes) = upload.next().await {
        let bytes = bytes?;
        received += bytes.len() as u64;
        if received > limit {
            return Err(ActorError::Image {
                kind: ImageFailure::InvalidArgument,
                message: format!("{what} is over the gateway's limit of {limit} bytes"),
            }
            .into());
        }
        room.take(bytes.len() as u64, "the upload")
            .map_err(ActorError::from)?;
        file.write_all(&bytes).map_err(|e| {
            ActorError::Internal(format!(
                "writing the upload to {}: {e}",
                spool.path().display()
            ))
        })?;
    }
    Ok((spool, received))
}

impl FrontDoor {
    /// Where a pull or an import of `caller` lands: `workspace`, whose editor it must be, or
    /// the gateway's images when `publish` (a gateway-wide admin).
    async fn write_scope(
        &self,
        caller: &Caller,
        workspace: &str,
        publish: bool,
    ) -> Result<ImageScope, Failure> {
        self.require_by_name(caller, workspace, Role::Editor)
            .await?;
        if publish {
            caller.require_gateway(Role::Admin).map_err(refused)?;
        }
        let scope = self.gateway.image_scope(Some(workspace), publish).await;
        scope.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// Pulls `reference` into `workspace` (or the gateway's images, `publish`): its progress
    /// as it goes, then the image (pushed to the mirror first). The pull ends, keeping
    /// nothing, when the answer is dropped or the caller is revoked (its last answer then).
    pub async fn pull_image(
        &self,
        caller: &Caller,
        reference: String,
        options: PullOptions,
        workspace: &str,
        publish: bool,
    ) -> Result<FrontStream<Pulled>, Failure> {
        let parsed = sbx_proto::image_ref::parse(&reference)
            .map_err(|e| ActorError::InvalidImageReference(e.to_string()))?;
        client_name(&parsed.name())?;
        let into = self.write_scope(caller, workspace, publish).await?;
        let (tx, rx) = mpsc::channel(PROGRESS_BUFFER);
        let gateway = Arc::clone(&self.gateway);
        let mirror = self.mirror.clone();
        let caller = caller.clone();
        tokio::spawn(async move {
            let progress_tx = tx.clone();
            let progress = move |p: PullProgress| {
                let _ = progress_tx.try_send(Ok(Pulled::Progress(p)));
            };
            let cancel = CancellationToken::new();
            let pull = gateway.pull_image(&reference, &options, &progress, into, cancel.clone());
            tokio::pin!(pull);
            // A caller that goes away or is revoked ends its pull: cancelled, it records
            // nothing, and what it fetched is collected.
            let result = tokio::select! {
                result = &mut pull => result,
                () = tx.closed() => {
                    tracing::info!(reference = %reference, "the pull's caller went away; the pull ends");
                    cancel.cancel();
                    let _ = (&mut pull).await;
                    return;
                }
                revoked = caller.revoked("the pull") => {
                    tracing::info!(reference = %reference, who = %caller.name, "the pull's caller was revoked; the pull ends");
                    cancel.cancel();
                    let _ = (&mut pull).await;
                    let _ = tx.send(Err(revoked.into())).await;
                    return;
                }
            };
            // Pushed to the image mirror before it is answered (see `super::mirror`).
            let result = mirrored(result, mirror.as_ref()).await;
            let _ = tx
                .send(
                    result
                        .map(|image| Pulled::Image(Box::new(image)))
                        .map_err(Failure::from),
                )
                .await;
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    /// Imports the archive `upload` carries (an OCI or docker-save tar) as `new` says; the
    /// images it recorded (pushed to the mirror first). `upload` is not read before the
    /// import is allowed; it ends at the caller's revocation, and so does the import.
    pub async fn import_image<S>(
        &self,
        caller: &Caller,
        new: NewImport,
        upload: S,
    ) -> Result<Vec<Image>, Failure>
    where
        S: Stream<Item = Result<Vec<u8>, Failure>> + Send + 'static,
    {
        let mut upload = caller.until_revoked(upload);
        if let Some(name) = &new.name {
            client_name(name)?;
        }
        let into = self
            .write_scope(caller, &new.workspace, new.publish)
            .await?;
        let what = match &new.name {
            None => "the import".to_string(),
            Some(name) => format!("the import of {name}"),
        };
        let (spool, received) = spool_upload(&self.gateway, &mut upload, &what).await?;
        if received == 0 {
            return Err(ActorError::InvalidArgument("the import sent no bytes".into()).into());
        }
        still_valid(caller, "imported")?;
        // The import ends at its caller's revocation too: cancelled, nothing recorded.
        let cancel = CancellationToken::new();
        let import =
            self.gateway
                .import_image(spool.path(), new.name.as_deref(), into, cancel.clone());
        tokio::pin!(import);
        let images = tokio::select! {
            imported = &mut import => imported?,
            revoked = caller.revoked("the import") => {
                cancel.cancel();
                let _ = (&mut import).await;
                return Err(revoked.into());
            }
        };
        if let Some(mirror) = &self.mirror {
            mirror.push_added(&images).await?;
        }
        Ok(images)
    }

    /// Builds `new` (see `sbx_build`) from the context tar `context` carries (empty: none):
    /// its steps and their output as they come, then the image (pushed to the mirror
    /// first). The build ends at its next step, deleting the RUN sandbox it runs and keeping
    /// nothing more, when the answer is dropped or the caller is revoked.
    pub async fn build_image<S>(
        &self,
        caller: &Caller,
        new: NewBuild,
        context: S,
    ) -> Result<FrontStream<Built>, Failure>
    where
        S: Stream<Item = Result<Vec<u8>, Failure>> + Send + 'static,
    {
        let mut context = caller.until_revoked(context);
        let workspace = new.workspace.as_deref();
        let workspace = workspace.unwrap_or(sbx_proto::names::DEFAULT_WORKSPACE);
        self.require_by_name(caller, workspace, Role::Editor)
            .await?;
        if let Some(name) = &new.name {
            client_name(name)?;
        }
        if new.publish {
            caller.require_gateway(Role::Admin).map_err(refused)?;
        }
        let (spool, received) =
            spool_upload(&self.gateway, &mut context, "the build context").await?;
        still_valid(caller, "built")?;
        let name = new.name.as_deref().unwrap_or("(unnamed)");
        audit(caller, "build image", name);
        let req = sbx_build::BuildRequest {
            workspace: new.workspace,
            name: new.name,
            dockerfile: new.dockerfile,
            build_args: new.build_args,
            allow: new.allow,
            no_cache: new.no_cache,
            driver: new.driver,
            run_timeout: new.run_timeout,
            context: (received > 0).then(|| spool.path().to_path_buf()),
            publish: new.publish,
            cancel: CancellationToken::new(),
        };
        let (tx, rx) = mpsc::channel(PROGRESS_BUFFER);
        let run = Running {
            gateway: Arc::clone(&self.gateway),
            mirror: self.mirror.clone(),
            caller: caller.clone(),
            tx,
        };
        // The context's file is held until the build is over.
        tokio::spawn(run.build(req, spool));
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}

/// A build under way, in a task of its own: what it answers into.
struct Running {
    gateway: Arc<Gateway>,
    mirror: Option<Arc<ImageMirror>>,
    caller: Caller,
    tx: mpsc::Sender<Result<Built, Failure>>,
}

impl Running {
    /// Runs `req` to its end, passing on every event before the result; ends it early when
    /// the answer is dropped or the caller is revoked.
    async fn build(self, req: sbx_build::BuildRequest, _context: tempfile::NamedTempFile) {
        let Running {
            gateway,
            mirror,
            caller,
            tx,
        } = self;
        let cancel = req.cancel.clone();
        let (events_tx, mut events) = mpsc::channel(PROGRESS_BUFFER);
        let relay_tx = tx.clone();
        let relay = tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                if relay_tx.send(Ok(Built::Event(event))).await.is_err() {
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
            revoked = caller.revoked("the build") => {
                // The same, and the caller hears why; nothing more of it is recorded.
                tracing::info!(who = %caller.name, "the build's caller was revoked; the build ends");
                cancel.cancel();
                let _ = (&mut build).await;
                relay.abort();
                let _ = tx.send(Err(revoked.into())).await;
                return;
            }
        };
        // Every event is passed on before the result.
        let _ = relay.await;
        let result = mirrored(result, mirror.as_ref()).await;
        let _ = tx
            .send(
                result
                    .map(|image| Built::Image(Box::new(image)))
                    .map_err(Failure::from),
            )
            .await;
    }
}
