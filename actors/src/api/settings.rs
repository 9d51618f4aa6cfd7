//! Settings of a sandbox: typed key/values owned by its id. Writes go through the sandbox's
//! actor (its mailbox orders them with its delete: a write that arrives after the delete finds
//! no actor and no record, and is NOT_FOUND; the store refuses an owned record whose owner is
//! gone, so none can outlive it). Reads go to the store.

use std::collections::{BTreeMap, HashMap};

use sbx_proto::v1::Setting;
use sbx_storage::{Kind, Record};

use super::{DEFAULT_PAGE_SIZE, Gateway, Listed, MAX_PAGE_SIZE};
use crate::error::{ActorError, Result};
use crate::owned::{self, SettingBody};
use crate::protocol::SandboxMsg;
use crate::records::timestamp;
use crate::validate::{self, SandboxSelector};

fn setting_message(record: &Record) -> Result<Setting> {
    let body: SettingBody = owned::decode(record)?;
    Ok(Setting {
        sandbox_id: record.owner.map(|o| o.to_string()).unwrap_or_default(),
        key: record.name.clone(),
        value: body.value,
        updated_at: Some(timestamp(record.updated_at_ms)),
        resource_version: record.resource_version,
    })
}

fn not_found(key: &str, sandbox: &str) -> ActorError {
    ActorError::ObjectNotFound {
        kind: "setting",
        what: format!("{} of sandbox {sandbox}", crate::limits::quote(key)),
    }
}

impl Gateway {
    /// Sets settings of a sandbox, all checked before any is written.
    pub async fn set_settings(
        &self,
        sel: &SandboxSelector,
        values: HashMap<String, String>,
    ) -> Result<Vec<Setting>> {
        if values.is_empty() {
            return Err(ActorError::InvalidArgument(
                "no setting given (KEY=VALUE)".into(),
            ));
        }
        if values.len() > crate::limits::MAX_SETTINGS {
            return Err(ActorError::InvalidArgument(format!(
                "{} settings given; a sandbox has at most {}",
                values.len(),
                crate::limits::MAX_SETTINGS
            )));
        }
        for (k, v) in &values {
            validate::setting(k, v)?;
        }
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        let values: BTreeMap<String, String> = values.into_iter().collect();
        let written = self
            .router
            .call_sandbox(sb.workspace_id(), sb.id(), |reply| {
                SandboxMsg::SetSettings {
                    values: values.clone(),
                    reply,
                }
            })
            .await?
            .ok_or_else(|| super::not_found_id(sb.id()))?;
        written.iter().map(setting_message).collect()
    }

    pub async fn get_setting(&self, sel: &SandboxSelector, key: &str) -> Result<Setting> {
        validate::name("setting key", key)?;
        let sb = self.resolve_sandbox(sel).await?;
        let record = self
            .shared
            .store
            .get_by_name(Kind::Setting, Some(sb.id()), key)
            .await?
            .ok_or_else(|| not_found(key, &sb.sandbox.name))?;
        setting_message(&record)
    }

    /// A sandbox's settings in key order, a page at a time (the token is the last key).
    pub async fn list_settings(
        &self,
        sel: &SandboxSelector,
        page_size: u32,
        page_token: &str,
    ) -> Result<Listed<Setting>> {
        validate::page_token(page_token)?;
        let limit = match page_size {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        } as usize;
        let sb = self.resolve_sandbox(sel).await?;
        let mut records =
            owned::owned_records(self.shared.store.as_ref(), sb.id(), Kind::Setting).await?;
        records.sort_by(|a, b| a.name.cmp(&b.name));
        let start = records.partition_point(|r| r.name.as_str() <= page_token);
        let page: Vec<&Record> = records[start..].iter().take(limit).collect();
        let next_page_token = if start + page.len() < records.len() {
            page.last().map(|r| r.name.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Listed {
            items: page
                .into_iter()
                .map(setting_message)
                .collect::<Result<_>>()?,
            next_page_token,
        })
    }

    /// Deletes one setting; false when the sandbox has no such key.
    pub async fn delete_setting(&self, sel: &SandboxSelector, key: &str) -> Result<bool> {
        validate::name("setting key", key)?;
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        self.router
            .call_sandbox(sb.workspace_id(), sb.id(), |reply| {
                SandboxMsg::DeleteSetting {
                    key: key.to_string(),
                    reply,
                }
            })
            .await?
            .ok_or_else(|| super::not_found_id(sb.id()))
    }
}
