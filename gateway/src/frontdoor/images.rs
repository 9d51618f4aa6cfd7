//! The reads and deletes of images. Reads see the workspace named (its viewer) and the
//! gateway's; a list across workspaces sees the gateway's and those of every workspace the
//! caller sees. A delete needs an admin of the image's workspace (a gateway-wide admin for
//! the gateway's): the image is looked up first, then deleted by its id. A prune needs the
//! same: an admin of the workspace it prunes, a gateway-wide admin for the gateway's own
//! images. Pulls, imports and builds are `image_adds`'s.

use sbx_actors::{ActorError, ImageScope, ImageSelector, Listed, PrunedImages};
use sbx_proto::v1::Image;

use super::access::refused;
use super::{Failure, FrontDoor, audit};
use crate::auth::{Caller, Role};

impl FrontDoor {
    /// The images `caller` sees from `workspace`: its viewers see its images and the
    /// gateway's.
    async fn read_scope(&self, caller: &Caller, workspace: &str) -> Result<ImageScope, Failure> {
        self.require_by_name(caller, workspace, Role::Viewer)
            .await?;
        let scope = self.gateway.image_scope(Some(workspace), false).await;
        scope.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// One page of the images seen from `workspace` (viewer there: its own and the
    /// gateway's), or across workspaces (`all_workspaces`: the gateway's and those of every
    /// workspace the caller sees).
    pub async fn list_images(
        &self,
        caller: &Caller,
        workspace: &str,
        all_workspaces: bool,
        page_size: u32,
        token: &str,
    ) -> Result<Listed<Image>, Failure> {
        let page = if all_workspaces {
            self.gateway
                .list_images(page_size, token, |owner| {
                    owner.is_none_or(|id| caller.sees(&id.to_string()))
                })
                .await
        } else {
            let own = match self.read_scope(caller, workspace).await? {
                ImageScope::Workspace(id) => Some(id),
                ImageScope::Gateway => None,
            };
            self.gateway
                .list_images(page_size, token, |owner| owner.is_none() || owner == own)
                .await
        };
        page.map_err(Failure::from)
    }

    /// The image `sel` names, seen from `workspace` (viewer there).
    pub async fn get_image(
        &self,
        caller: &Caller,
        sel: &ImageSelector,
        workspace: &str,
    ) -> Result<Image, Failure> {
        let scope = self.read_scope(caller, workspace).await?;
        let image = self.gateway.get_image(sel, scope).await;
        image.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// Deletes the image `sel` names, seen from `workspace` (an admin of its workspace; a
    /// gateway-wide admin for the gateway's); whether there was one.
    pub async fn delete_image(
        &self,
        caller: &Caller,
        sel: &ImageSelector,
        workspace: &str,
    ) -> Result<bool, Failure> {
        let scope = self.read_scope(caller, workspace).await?;
        let image = match self.gateway.get_image(sel, scope).await {
            Ok(image) => image,
            Err(ActorError::ImageNotFound(_)) if matches!(sel, ImageSelector::Id(_)) => {
                return Ok(false);
            }
            Err(e) => return Err(FrontDoor::failure(caller, e)),
        };
        let allowed = match (image.workspace.is_empty(), scope) {
            (false, ImageScope::Workspace(id)) => {
                caller.require(workspace, Some(&id.to_string()), Role::Admin)
            }
            _ => caller.require_gateway(Role::Admin),
        };
        allowed.map_err(refused)?;
        let id = uuid::Uuid::parse_str(&image.id)
            .map_err(|e| Failure::from(ActorError::Internal(format!("an image id: {e}"))))?;
        let deleted = self
            .gateway
            .delete_image(&ImageSelector::Id(id), scope)
            .await;
        let deleted = deleted.map_err(|e| FrontDoor::failure(caller, e))?;
        audit(caller, "delete image", &image.id);
        Ok(deleted)
    }

    /// Removes the images of `workspace` (an admin of it) or, with `gateway`, the gateway's
    /// own (a gateway-wide admin) that no sandbox pins: the build cache, or with `all` every
    /// one but the default image; then the content nothing keeps.
    pub async fn prune_images(
        &self,
        caller: &Caller,
        workspace: &str,
        all: bool,
        gateway: bool,
    ) -> Result<PrunedImages, Failure> {
        let scope = if gateway {
            caller.require_gateway(Role::Admin).map_err(refused)?;
            ImageScope::Gateway
        } else {
            let scope = self.read_scope(caller, workspace).await?;
            let ImageScope::Workspace(id) = scope else {
                return Err(Failure::from(ActorError::Internal(
                    "a workspace's image scope is the workspace's".into(),
                )));
            };
            caller
                .require(workspace, Some(&id.to_string()), Role::Admin)
                .map_err(refused)?;
            scope
        };
        let pruned = self.gateway.prune_images(scope, all).await;
        let pruned = pruned.map_err(|e| FrontDoor::failure(caller, e))?;
        let what = match scope {
            ImageScope::Gateway => "the gateway's".to_string(),
            ImageScope::Workspace(_) => workspace.to_string(),
        };
        audit(
            caller,
            "prune images",
            &format!(
                "{what}: {} removed, {} bytes freed",
                pruned.removed.len(),
                pruned.bytes_freed
            ),
        );
        Ok(pruned)
    }
}
