//! The image store's parts a client above the actors builds images with (the Dockerfile
//! build, `sbx-build`): the content of an image by digest, a new image from a parent and a
//! layer, a name recorded for an image, and a lookup of one workspace's own records (a
//! build's cache never answers from another workspace's, nor from the gateway's).
//!
//! Writing as [`Writer::Gateway`] may record a reserved name (`sbx.local/…`, the build
//! cache's): the gateway's own code does; a client's request passes [`Writer::Client`].

use std::path::PathBuf;

use sbx_images::{ImageConfig, ImageInfo, ImageStore};
use sbx_proto::v1::Image;
use tokio_util::sync::CancellationToken;

use super::Gateway;
use crate::error::Result;
use crate::images::{Built, ImageScope, Writer};

impl Gateway {
    /// What the image store holds of the image with this manifest digest.
    pub async fn image_content(&self, digest: &str) -> Result<ImageInfo> {
        self.images.content_of(digest).await
    }

    /// The image store itself (for reads that need no record, and its limits and room).
    pub fn image_content_store(&self) -> Result<ImageStore> {
        self.images.content_store()
    }

    /// The image recorded under `name` in `scope` itself (not the gateway's when `scope` is
    /// a workspace's): a build's cache step.
    pub async fn own_image(&self, name: &str, scope: ImageScope) -> Result<Option<Image>> {
        self.images.get_own(name, scope).await
    }

    /// A new image from `parent` (None: from scratch), `layer` on top (None: the config
    /// only) and `config`, recorded under `name` in `into` as `writer`; nothing is recorded
    /// once `cancel` is.
    #[allow(clippy::too_many_arguments)]
    pub async fn derive_image(
        &self,
        name: &str,
        parent: Option<ImageInfo>,
        layer: Option<PathBuf>,
        config: ImageConfig,
        into: ImageScope,
        writer: Writer,
        cancel: CancellationToken,
    ) -> Result<(Image, ImageInfo)> {
        self.images
            .derive(name, parent, layer, config, into, writer, cancel)
            .await
    }

    /// Records `name` in `built.into` as the image `info` is (a re-tag when it names
    /// another), as `built.writer`, naming the build cache entries its build made or took
    /// (deleted with it when nothing else names them); refused once `cancel` is.
    pub async fn tag_image(
        &self,
        name: &str,
        info: &ImageInfo,
        built: Built,
        cancel: CancellationToken,
    ) -> Result<Image> {
        self.images.tag(name, info, built, cancel).await
    }
}
