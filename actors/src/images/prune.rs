//! `sbx image prune` and the build cache that goes with a built image (`sbx image rm`).
//!
//! - A build's result names the cache entries its steps made or took (`Image.build_cache`,
//!   record ids, written by `sbx-build`). Deleting it deletes, under the same write lock as
//!   the delete, each of those no other image's build names and no sandbox pins; what
//!   cannot go stays for a prune.
//! - A prune removes the records of one scope (a workspace's own, or the gateway's) that no
//!   sandbox of any workspace pins: the build cache only (`sbx.local/build-cache:*`, and the
//!   content no record names, which a collection takes anyway), or with `all` every one but
//!   the default image and the built-in one. It takes the write lock a sandbox create pins
//!   its image under, so no create loses its image to a prune; the bytes it reports are its
//!   own collection's, begun before the records went.

use std::collections::BTreeSet;

use sbx_storage::{Kind, Scope, StoreError};
use uuid::Uuid;

use super::{
    BUILD_CACHE_REPOSITORY, ImageScope, Images, StoredImage, list_every_page, record_name,
};
use crate::error::{ActorError, Result};
use crate::records::StoredSandbox;

/// What [`Images::prune`] removed: the records' names (sorted) and the bytes their content
/// took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pruned {
    pub removed: Vec<String>,
    pub bytes_freed: u64,
}

impl Images {
    /// With a built image gone (under the write lock): the build cache entries it names
    /// (record ids) that no other image's build names and no sandbox pins. One that cannot be
    /// deleted stays, for `sbx image prune`.
    pub(super) async fn drop_build_cache(&self, ids: &[String], pinned: &BTreeSet<String>) {
        if ids.is_empty() {
            return;
        }
        let named: BTreeSet<String> = match self.list().await {
            Ok(rest) => rest.into_iter().flat_map(|s| s.image.build_cache).collect(),
            Err(e) => {
                tracing::warn!("the build cache of a deleted image stays: {e}");
                return;
            }
        };
        let prefix = format!("{BUILD_CACHE_REPOSITORY}:");
        let mut dropped = 0;
        for id in ids.iter().filter(|id| !named.contains(*id)) {
            let Ok(id) = Uuid::parse_str(id) else {
                continue;
            };
            let record = match self.store.get(id).await {
                Ok(Some(r)) if r.kind == Kind::Image && r.name.starts_with(&prefix) => r,
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!(%id, "a build cache entry of a deleted image stays: {e}");
                    continue;
                }
            };
            match StoredImage::from_record(record) {
                Ok(entry) if !pinned.contains(&entry.image.digest) => {
                    match self
                        .store
                        .delete(entry.record.id, entry.record.resource_version)
                        .await
                    {
                        Ok(_) | Err(StoreError::NotFound { .. }) => dropped += 1,
                        Err(e) => {
                            tracing::warn!(image = %entry.image.name, "a build cache entry of a deleted image stays: {e}")
                        }
                    }
                }
                _ => {}
            }
        }
        if dropped > 0 {
            tracing::info!(
                steps = dropped,
                "the deleted image's build cache went with it"
            );
        }
    }

    /// `sbx image prune`: removes the image records of `scope` itself (a workspace's own, or
    /// the gateway's) that no sandbox of any workspace pins — the build cache
    /// (`sbx.local/build-cache:*`) only, or with `all` every one except the default image
    /// and the built-in one — then the content nothing keeps. All under the write lock: no
    /// create is between pinning an image and writing its sandbox, no add between its content
    /// and its record. The bytes are the collection's own count, begun before the records
    /// went: a concurrent collection cannot take them first.
    pub async fn prune(&self, scope: ImageScope, all: bool) -> Result<Pruned> {
        let content = self.content()?.clone();
        let _one = self.collecting.lock().await;
        let collection = content.begin_collection().ok_or_else(|| {
            ActorError::Unavailable(
                "another collection of the image store is under way; try again".into(),
            )
        })?;
        let prefix = format!("{BUILD_CACHE_REPOSITORY}:");
        let protected: BTreeSet<String> = [crate::config::DEFAULT_IMAGE, &self.default_image]
            .into_iter()
            .filter_map(|n| record_name(n).ok())
            .collect();
        let mut removed = Vec::new();
        let mut keep = BTreeSet::new();
        {
            let _exclusive = self.lock.write().await;
            for record in list_every_page(self.store.as_ref(), Kind::Sandbox, Scope::All).await? {
                let sb = StoredSandbox::from_record(record)?.sandbox;
                if let Some(spec) = sb.spec.filter(|s| !s.image_digest.is_empty()) {
                    keep.insert(spec.image_digest);
                }
            }
            for stored in self.list().await? {
                let name = &stored.image.name;
                let goes = stored.record.owner == scope.owner()
                    && !keep.contains(&stored.image.digest)
                    && !protected.contains(name)
                    && (all || name.starts_with(&prefix));
                if !goes {
                    keep.insert(stored.image.digest);
                    continue;
                }
                match self
                    .store
                    .delete(stored.record.id, stored.record.resource_version)
                    .await
                {
                    Ok(_) | Err(StoreError::NotFound { .. }) => removed.push(stored.image.name),
                    Err(e) => {
                        tracing::warn!(image = %name, "prune: the image stays: {e}");
                        keep.insert(stored.image.digest);
                    }
                }
            }
        }
        // Digests sandboxes pin are all in `keep`, and so is every image that stays.
        let keep: Vec<String> = keep.into_iter().collect();
        let report = tokio::task::spawn_blocking(move || collection.remove_unreferenced(&keep))
            .await
            .map_err(|e| ActorError::Internal(format!("image store collection task: {e}")))??;
        removed.sort();
        tracing::info!(
            ?scope,
            all,
            images = removed.len(),
            bytes = report.bytes_freed,
            "images pruned"
        );
        Ok(Pruned {
            removed,
            bytes_freed: report.bytes_freed,
        })
    }
}
