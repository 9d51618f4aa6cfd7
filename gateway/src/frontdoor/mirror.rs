//! The gateway's side of the image mirror (`sbxd serve --image-mirror HOST:PORT[/PREFIX]`):
//! what it pulls or imports is pushed there before the pull or import answers, so that every
//! node fetches it by digest (see `sbx_drivers::remote::images`); what a create needs and its
//! own store lacks (an image another gateway of the store pulled) is fetched from there.
//!
//! A push that fails fails the pull or import, loudly (`UNAVAILABLE`, reason
//! `REGISTRY_UNAVAILABLE`), though the image is recorded (the gateway's own driver runs it):
//! the mirror is there for the nodes, and an image the nodes cannot fetch would fail later, on
//! some node, far from its cause. The error says so and what to do: pull or import again once
//! the mirror answers (nothing is downloaded or sent twice), or create a sandbox of it on a
//! node through this gateway, which pushes it first.

use std::sync::Arc;

use sbx_actors::{ActorError, Gateway, ImageFailure, ImageScope, ImageSelector};
use sbx_drivers::remote::images::ImageSource;
use sbx_proto::v1::{Image, SandboxSpec};

/// The mirror, the gateway's store behind it, and the image a spec without one runs.
pub struct ImageMirror {
    source: Arc<ImageSource>,
    default_image: String,
}

impl ImageMirror {
    /// `source`: the mirror and this gateway's store; `default_image`: `--default-image`.
    pub fn new(source: Arc<ImageSource>, default_image: String) -> ImageMirror {
        ImageMirror {
            source,
            default_image,
        }
    }

    /// What the node links name in their creates.
    pub fn source(&self) -> Arc<ImageSource> {
        Arc::clone(&self.source)
    }

    /// After a pull or an import: every image it recorded, pushed (each digest once).
    pub async fn push_added(&self, images: &[Image]) -> Result<(), ActorError> {
        let mut done: Vec<&str> = Vec::new();
        for image in images {
            if done.contains(&image.digest.as_str()) {
                continue;
            }
            done.push(&image.digest);
            if let Err(why) = self.source.push(&image.digest).await {
                let mirror = self.source.mirror();
                tracing::error!(image = %image.name, digest = %image.digest, %mirror, "the image is recorded but not in the image mirror: {why}");
                return Err(ActorError::Image {
                    kind: ImageFailure::RegistryUnavailable,
                    message: format!(
                        "image {} ({}) is recorded on this gateway but could not be copied to the \
                     image mirror {mirror}, so nodes that lack it cannot run it: {why}; pull or \
                     import it again once the mirror answers (nothing is downloaded or sent \
                     twice), or create a sandbox of it on a node through this gateway, which \
                     pushes it first",
                        image.name, image.digest
                    ),
                });
            }
        }
        Ok(())
    }

    /// Before a create: the image `spec` names (or the default image), fetched from the mirror
    /// into this gateway's store when it is recorded and the store lacks it (another gateway
    /// pulled it). Failures are logged only: the create then answers what it would without
    /// the mirror (the image's content is missing here), and a create on a driver without
    /// images needs none.
    pub async fn fetch_for(&self, gateway: &Gateway, workspace: Option<&str>, spec: &SandboxSpec) {
        let name = match spec.image.as_str() {
            "" => self.default_image.as_str(),
            named => named,
        };
        let Ok(selector) = ImageSelector::parse("", name) else {
            return;
        };
        // As the create will see it: the workspace's images, then the gateway's.
        let Ok(scope) = gateway.image_scope(workspace, false).await else {
            return;
        };
        let Ok(image) = gateway.get_image(&selector, scope).await else {
            return;
        };
        match self.source.fetch(&image.digest).await {
            Ok(true) => {
                tracing::info!(image = %image.name, digest = %image.digest, "fetched from the image mirror for a create")
            }
            Ok(false) => {}
            Err(why) => {
                tracing::warn!(image = %image.name, digest = %image.digest, mirror = %self.source.mirror(), "this gateway's image store lacks the image and the mirror cannot provide it: {why}")
            }
        }
    }

    /// At start: the default image, pushed when this gateway's store holds it (it is made
    /// here, not pulled; a node fetches it as any other). Logged, never fatal.
    pub async fn push_default(&self, gateway: &Gateway) {
        let Ok(selector) = ImageSelector::parse("", &self.default_image) else {
            return;
        };
        let Ok(image) = gateway.get_image(&selector, ImageScope::Gateway).await else {
            return;
        };
        // What a create on a node does first: push unless the mirror has it (a failure is
        // logged there).
        let _ = self.source.prepare(&image.digest).await;
    }
}
