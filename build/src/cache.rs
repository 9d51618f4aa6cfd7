//! The build cache: an image a step made is recorded as `sbx.local/build-cache:<key>` in the
//! build's workspace, and a step whose key names one there is answered from it (never from
//! another workspace's, nor from the gateway's). See the crate docs.

use std::path::Path;

use sbx_actors::{ImageWriter, Result};
use sbx_images::ImageInfo;

use crate::state::State;
use crate::{Build, CACHE_REPOSITORY};

/// The name the image of a step with this key is recorded under.
fn cache_name(key: &str) -> String {
    format!("{CACHE_REPOSITORY}:{key}")
}

impl Build<'_> {
    /// The image the workspace's cache holds for `key` (never the gateway's nor another
    /// workspace's), if its content is still there.
    async fn cached(&self, key: &str) -> Result<Option<ImageInfo>> {
        let Some(image) = self.gateway.own_image(&cache_name(key), self.scope).await? else {
            return Ok(None);
        };
        let Ok(info) = self.gateway.image_content(&image.digest).await else {
            return Ok(None);
        };
        self.used(image.id);
        Ok(Some(info))
    }

    /// Notes a cache entry (its record id) this build made or took: the result names them,
    /// and they go with it (`sbx image rm`) when no other image's build names them.
    fn used(&self, id: String) {
        let mut ids = self.cache_ids.lock().unwrap_or_else(|p| p.into_inner());
        if !ids.contains(&id) {
            ids.push(id);
        }
    }

    /// The cache entries this build made or took, in the order it met them.
    pub(crate) fn cache_entries(&self) -> Vec<String> {
        self.cache_ids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes the image the cache holds for the state's key, if any (true then).
    pub(crate) async fn take_cached(&self, state: &mut State) -> Result<bool> {
        match self.cached(&state.key).await? {
            Some(hit) => {
                state.took(hit);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Makes the state's config an image of its own (a RUN runs from it; the result is one).
    pub(crate) async fn commit(&self, state: &mut State) -> Result<()> {
        if state.committed {
            return Ok(());
        }
        let hit = match self.req.no_cache {
            true => None,
            false => self.cached(&state.key).await?,
        };
        if let Some(hit) = hit {
            state.image = Some(hit);
        } else {
            let (image, info) = self
                .gateway
                .derive_image(
                    &cache_name(&state.key),
                    state.image.clone(),
                    None,
                    state.config.clone(),
                    self.scope,
                    ImageWriter::Gateway,
                    self.req.cancel.clone(),
                )
                .await?;
            self.used(image.id);
            state.image = Some(info);
        }
        state.committed = true;
        Ok(())
    }

    /// A step's image: `layer` on `parent` with the state's config, recorded in the cache
    /// under the state's key.
    pub(crate) async fn derive(
        &self,
        state: &State,
        parent: Option<ImageInfo>,
        layer: &Path,
    ) -> Result<ImageInfo> {
        let (image, info) = self
            .gateway
            .derive_image(
                &cache_name(&state.key),
                parent,
                Some(layer.to_path_buf()),
                state.config.clone(),
                self.scope,
                ImageWriter::Gateway,
                self.req.cancel.clone(),
            )
            .await?;
        self.used(image.id);
        Ok(info)
    }
}
