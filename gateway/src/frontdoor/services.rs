//! A sandbox's service endpoints: an endpoint is its sandbox's, so a call naming a sandbox is
//! checked against the sandbox's workspace; a list without one is a list of a workspace
//! (viewer there) or of all (filtered to what the caller sees).

use sbx_actors::SandboxSelector;
use sbx_proto::v1::ServiceEndpoint;

use super::{Failure, FrontDoor, audit, describe};
use crate::auth::{Caller, Role};

impl FrontDoor {
    /// Exposes port `port` of the sandbox `sel` names as `name` (editor in its workspace).
    pub async fn expose_service(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        port: u32,
        name: &str,
    ) -> Result<ServiceEndpoint, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        let exposed = self.gateway.expose_service(sel, port, name).await;
        let exposed = exposed.map_err(|e| FrontDoor::failure(caller, e))?;
        audit(caller, "expose service", &exposed.id);
        Ok(exposed)
    }

    /// The endpoint `name` of the sandbox `sel` names (viewer in its workspace).
    pub async fn get_service(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        name: &str,
    ) -> Result<ServiceEndpoint, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        let endpoint = self.gateway.get_service(sel, name).await;
        endpoint.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// The endpoints of the sandbox `sandbox` names (viewer in its workspace), else of
    /// `workspace` (viewer there) or of all (`all_workspaces`); those of workspaces the
    /// caller does not see left out.
    pub async fn list_services(
        &self,
        caller: &Caller,
        sandbox: Option<&SandboxSelector>,
        workspace: &str,
        all_workspaces: bool,
    ) -> Result<Vec<ServiceEndpoint>, Failure> {
        match sandbox {
            Some(sel) => self.sandbox_access(caller, sel, Role::Viewer).await?,
            None => self.list_access(caller, workspace, all_workspaces).await?,
        }
        let named = (!workspace.is_empty()).then_some(workspace);
        let listed = self
            .gateway
            .list_services(sandbox, named, all_workspaces)
            .await;
        let services = listed.map_err(|e| FrontDoor::failure(caller, e))?;
        Ok(services
            .into_iter()
            .filter(|s| caller.sees(&s.workspace_id))
            .collect())
    }

    /// Deletes the endpoint `name` of the sandbox `sel` names (editor in its workspace);
    /// whether there was one.
    pub async fn delete_service(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        name: &str,
    ) -> Result<bool, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        audit(caller, "delete service", &describe(sel));
        let deleted = self.gateway.delete_service(sel, name).await;
        deleted.map_err(|e| FrontDoor::failure(caller, e))
    }
}
