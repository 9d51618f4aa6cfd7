//! A sandbox's settings: they are the sandbox's, so every call is checked against the
//! sandbox's workspace (viewer to read, editor to set or delete); a set or delete is audited
//! before it acts (the line says what was allowed, whatever the store then answers).

use std::collections::HashMap;

use sbx_actors::{Listed, SandboxSelector};
use sbx_proto::v1::Setting;

use super::{Failure, FrontDoor, audit, describe};
use crate::auth::{Caller, Role};

impl FrontDoor {
    /// Sets `values` on the sandbox `sel` names (editor in its workspace).
    pub async fn set_settings(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        values: HashMap<String, String>,
    ) -> Result<Vec<Setting>, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        audit(caller, "set settings", &describe(sel));
        let set = self.gateway.set_settings(sel, values).await;
        set.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// The setting `key` of the sandbox `sel` names (viewer in its workspace).
    pub async fn get_setting(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        key: &str,
    ) -> Result<Setting, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        let setting = self.gateway.get_setting(sel, key).await;
        setting.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// One page of the settings of the sandbox `sel` names (viewer in its workspace).
    pub async fn list_settings(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        page_size: u32,
        token: &str,
    ) -> Result<Listed<Setting>, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        let page = self.gateway.list_settings(sel, page_size, token).await;
        page.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// Deletes the setting `key` of the sandbox `sel` names (editor in its workspace);
    /// whether there was one.
    pub async fn delete_setting(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        key: &str,
    ) -> Result<bool, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        audit(caller, "delete setting", &describe(sel));
        let deleted = self.gateway.delete_setting(sel, key).await;
        deleted.map_err(|e| FrontDoor::failure(caller, e))
    }
}
