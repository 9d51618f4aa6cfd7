//! `BuildImage`: an image from a Dockerfile, built by the gateway with its own parts.
//!
//! A client of the actors' [`Gateway`], above it: every RUN is a sandbox created, watched and
//! deleted through the same calls as any other, and every image a step makes is recorded
//! through the gateway's image store. The pure parts are the image crate's
//! (`sbx_images::build`): the Dockerfile parser and the COPY layer from the build context.
//!
//! - The Dockerfile is parsed by `parse-dockerfile` ([`dockerfile`]); FROM names an image
//!   of the store (pulled first when the store lacks it) or `scratch`.
//! - Each RUN runs in a sandbox of the caller's workspace, created through the same path as
//!   any other (the driver's boundary, the workspace's limits, no network unless the build's
//!   `allow` admits some), from an image holding the build's state so far (its Env,
//!   WorkingDir and User are the Dockerfile's). Its output is streamed to the caller. Once it
//!   has ended with status 0, what it changed in its root filesystem is read from the driver
//!   as an OCI layer (`CopyFromRequest.changes`) and becomes the next image's top layer; the
//!   sandbox is deleted however the step ends (and carries a ttl that deletes it should the
//!   gateway die first). See `run.rs`.
//! - COPY and ADD make their layer from the build context, without running anything
//!   ([`context`]).
//! - ENV, ARG, WORKDIR, USER, ENTRYPOINT, CMD, LABEL, EXPOSE and SHELL change the config only
//!   (`state.rs`).
//!
//! **Cache.** Every step has a key: the sha256 of the key before it and of what the step is
//! (its text, the ARG values it sees, for RUN the network the build allows it in normal form,
//! for COPY the layer it makes); the first key is the build's workspace id and the base
//! image's digest. An image a step made is recorded as `sbx.local/build-cache:<key>` *in the
//! build's workspace* (a name of the gateway's own: no client writes one, so nobody plants a
//! step's result under a key computed offline), and a step whose key names an image of that
//! workspace is answered from it without running — never from another workspace's. So a
//! second build of the same Dockerfile and context in the same workspace runs nothing, and a
//! change re-runs the steps from the first that sees it. The cache images are ordinary images
//! of the workspace (`sbx image list` shows them, `sbx image delete` removes them). The
//! result names the entries its steps made or took (`Image.build_cache`, record ids): deleting
//! it deletes those no other image's build names; `sbx image prune` removes the rest. See
//! `cache.rs`.
//!
//! **Scope.** The result lands in the build's workspace under its name, or the gateway's when
//! published (`BuildRequest::publish`, a gateway-wide admin's; the gateway checks who asks).
//! A build cancelled (its caller went away, or was revoked) deletes the step it runs and
//! records nothing more: not the step's cache image, not the result.

mod cache;
mod run;
mod state;
mod steps;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sbx_actors::{Gateway, ImageScope, Result};
use sbx_proto::v1::Image;
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::context::Context;

/// The name cache images are recorded under (the key as the tag).
pub use sbx_actors::BUILD_CACHE_REPOSITORY as CACHE_REPOSITORY;
/// The label a build's RUN sandboxes carry (its value: the sandbox's name); no exec, copy
/// into or forward reaches a sandbox with it (the actors check it).
pub use sbx_actors::validate::BUILD_LABEL;
/// The build's pure parts: the Dockerfile parser and the COPY layer.
pub use sbx_images::build::{context, dockerfile};

/// The longest one RUN may take unless the request says otherwise.
pub const DEFAULT_RUN_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// What a build is asked.
#[derive(Debug, Clone, Default)]
pub struct BuildRequest {
    pub workspace: Option<String>,
    pub name: Option<String>,
    pub dockerfile: String,
    pub build_args: BTreeMap<String, String>,
    pub allow: Vec<String>,
    pub no_cache: bool,
    pub driver: String,
    pub run_timeout: Option<Duration>,
    /// The context tar, spooled (None: no context; a COPY then finds nothing).
    pub context: Option<PathBuf>,
    /// The result is the gateway's (for every workspace), not the workspace's.
    pub publish: bool,
    /// Cancelled when the build's caller went away: the running RUN's sandbox is deleted and
    /// the build ends there.
    pub cancel: tokio_util::sync::CancellationToken,
}

/// What a build says while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildEvent {
    Step {
        index: u32,
        count: u32,
        text: String,
        cached: bool,
    },
    Log {
        data: Vec<u8>,
        stderr: bool,
    },
}

/// One build under way: what every step needs besides the state.
struct Build<'a> {
    gateway: &'a Gateway,
    req: &'a BuildRequest,
    events: &'a mpsc::Sender<BuildEvent>,
    /// Where the cache steps are, and whose images FROM and RUN see.
    scope: ImageScope,
    workspace_id: Uuid,
    /// Where the layers steps make are written (the image store's spool).
    spool: PathBuf,
    context: Arc<Context>,
    /// What RUN may reach, in normal form: part of its key.
    allowance: String,
    /// Names this build's RUN sandboxes.
    build_id: String,
    count: u32,
    /// The cache entries (record ids) the steps made or took: the result names them.
    cache_ids: std::sync::Mutex<Vec<String>>,
}

/// `gateway.build_image(request, events)`: a build as a call on the gateway it builds with.
pub trait BuildImage {
    /// Builds an image (see the crate docs); `events` hears each step and each RUN's output.
    fn build_image(
        &self,
        req: BuildRequest,
        events: mpsc::Sender<BuildEvent>,
    ) -> impl Future<Output = Result<Image>> + Send;
}

impl BuildImage for Gateway {
    fn build_image(
        &self,
        req: BuildRequest,
        events: mpsc::Sender<BuildEvent>,
    ) -> impl Future<Output = Result<Image>> + Send {
        steps::build_image(self, req, events)
    }
}
