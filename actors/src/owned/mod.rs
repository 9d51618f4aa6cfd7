//! What belongs to a sandbox or a workspace besides the sandboxes themselves, and the one
//! ownership rule they all follow.
//!
//! - **Providers** (`Kind::Provider`): named credential sets of a workspace, their values
//!   sealed ([`sealer`]). Not owned by a sandbox: sandboxes refer to them.
//! - **Attachments** (`Kind::Attachment`): that a sandbox uses a provider. Owned by the
//!   sandbox, named by the provider's id, and *referring* to the provider (the store's
//!   reference index): the provider's existence is checked in the attachment's own create
//!   transaction, and the provider cannot be deleted while it lives. A provider deleted and
//!   made again under its old name is a new id that no attachment names.
//! - **Settings** (`Kind::Setting`) and **service endpoints** (`Kind::Service`): owned by the
//!   sandbox, named per owner.
//!
//! The rule: every owned record hangs off its owner's UUID in the store's owner index and is
//! deleted in the owner's delete transaction; nothing here is found by a sandbox's name after
//! it was resolved to an id once. Every scan for owned records or blockers reads to the end
//! ([`owned_records`], [`crate::scan::all_records`]).

pub mod sealer;

use std::collections::BTreeMap;

use futures::StreamExt;
use prost::Message;
use sbx_storage::{Kind, ObjectStore, Record};
use uuid::Uuid;

use crate::error::{ActorError, Result};
use sealer::Sealer;

/// A provider's body in the store.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProviderBody {
    #[prost(string, tag = "1")]
    pub r#type: String,
    #[prost(btree_map = "string, string", tag = "2")]
    pub config: BTreeMap<String, String>,
    /// Credential name → nonce ‖ ciphertext ‖ tag ([`Sealer::seal`]).
    #[prost(btree_map = "string, bytes", tag = "3")]
    pub sealed: BTreeMap<String, Vec<u8>>,
    /// Credential name → [`Sealer::fingerprint`] of its value.
    #[prost(btree_map = "string, string", tag = "4")]
    pub fingerprints: BTreeMap<String, String>,
}

/// A setting's body.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SettingBody {
    #[prost(string, tag = "1")]
    pub value: String,
}

/// A service endpoint's body.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ServiceBody {
    #[prost(uint32, tag = "1")]
    pub port: u32,
}

pub fn decode<M: Message + Default>(record: &Record) -> Result<M> {
    M::decode(record.body.as_slice()).map_err(|e| {
        ActorError::Internal(format!(
            "{} record {} does not decode: {e}",
            record.kind, record.id
        ))
    })
}

/// Every record of `kind` that `owner` owns, in creation order: the owner index read to its
/// end (a record deleted between the index and the read is skipped).
pub async fn owned_records(
    store: &dyn ObjectStore,
    owner: Uuid,
    kind: Kind,
) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    for id in store.owned(owner).await? {
        if let Some(record) = store.get(id).await?
            && record.kind == kind
        {
            out.push(record);
        }
    }
    Ok(out)
}

/// The environment variable a setting reaches the workload as: `SBX_SETTING_` and the key in
/// upper case with `-` as `_` (keys are DNS labels, so two keys never meet in one name).
pub fn setting_env_name(key: &str) -> String {
    format!("SBX_SETTING_{}", key.to_ascii_uppercase().replace('-', "_"))
}

/// What a run of sandbox `sandbox` (and each exec into it) gets on top of its spec's
/// environment: the credentials of every attached provider (in attachment order; a later
/// provider's variable of the same name wins), then its settings. An error names the
/// provider or credential that cannot be opened, never a value.
pub async fn run_env(
    store: &dyn ObjectStore,
    sealer: &Sealer,
    sandbox: Uuid,
) -> Result<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    let owned = store.owned(sandbox).await?;
    let mut settings = Vec::new();
    for id in owned {
        let Some(record) = store.get(id).await? else {
            continue;
        };
        match record.kind {
            Kind::Attachment => {
                // The reference index keeps the provider alive while this attachment is.
                let Some(&provider) = record.refs.first() else {
                    continue;
                };
                let Some(p) = store.get(provider).await? else {
                    return Err(ActorError::Internal(format!(
                        "attachment {} refers to provider {provider}, which has no record",
                        record.id
                    )));
                };
                let body: ProviderBody = decode(&p)?;
                for (name, sealed) in &body.sealed {
                    env.insert(name.clone(), sealer.open(provider, name, sealed)?);
                }
            }
            Kind::Setting => settings.push(record),
            _ => {}
        }
    }
    for record in settings {
        let body: SettingBody = decode(&record)?;
        env.insert(setting_env_name(&record.name), body.value);
    }
    check_run_env_size(&env)?;
    Ok(env)
}

/// Sets settings of sandbox `sandbox` in workspace `ws` (called by the sandbox's actor, the
/// only writer of its settings): each key created or updated in turn. The bounds of the whole
/// ([`crate::limits::MAX_SETTINGS`], [`crate::limits::MAX_SETTINGS_BYTES`]) are checked
/// against what is stored first, so a refused request changes nothing.
pub async fn write_settings(
    store: &dyn ObjectStore,
    ws: Uuid,
    sandbox: Uuid,
    values: &BTreeMap<String, String>,
) -> Result<Vec<Record>> {
    let existing = owned_records(store, sandbox, Kind::Setting).await?;
    let mut sizes: BTreeMap<String, usize> = BTreeMap::new();
    for r in &existing {
        let body: SettingBody = decode(r)?;
        sizes.insert(r.name.clone(), r.name.len() + body.value.len());
    }
    for (k, v) in values {
        sizes.insert(k.clone(), k.len() + v.len());
    }
    if sizes.len() > crate::limits::MAX_SETTINGS {
        return Err(ActorError::InvalidArgument(format!(
            "the sandbox would have {} settings; at most {} are allowed",
            sizes.len(),
            crate::limits::MAX_SETTINGS
        )));
    }
    let total: usize = sizes.values().sum();
    if total > crate::limits::MAX_SETTINGS_BYTES {
        return Err(ActorError::InvalidArgument(format!(
            "the sandbox's settings would be {total} bytes (keys and values); at most {} are allowed",
            crate::limits::MAX_SETTINGS_BYTES
        )));
    }
    let by_name: BTreeMap<&str, &Record> = existing.iter().map(|r| (r.name.as_str(), r)).collect();
    // Each key is its own write; many in flight share the store's group commit (one
    // transaction and one flush per batch), so 10,000 keys cost a few batches, not 10,000
    // flushes.
    let mut writes: Vec<futures::future::BoxFuture<'_, Result<Record>>> =
        Vec::with_capacity(values.len());
    for (key, value) in values {
        let old = by_name.get(key.as_str()).map(|r| (*r).clone());
        writes.push(Box::pin(async move {
            let body = SettingBody {
                value: value.clone(),
            }
            .encode_to_vec();
            match old {
                Some(mut r) => {
                    r.body = body;
                    r.updated_at_ms = crate::records::now_ms();
                    Ok(store.update(r).await?)
                }
                None => store
                    .create(sbx_storage::NewRecord {
                        id: Uuid::new_v4(),
                        kind: Kind::Setting,
                        workspace: Some(ws),
                        name: key.clone(),
                        owner: Some(sandbox),
                        labels: BTreeMap::new(),
                        created_at_ms: crate::records::now_ms(),
                        body,
                    })
                    .await
                    .map_err(|e| match e {
                        sbx_storage::StoreError::OwnerNotFound { .. } => {
                            ActorError::SandboxNotFound {
                                what: format!("with id {sandbox}"),
                                hint: String::new(),
                                similar: Vec::new(),
                            }
                        }
                        other => other.into(),
                    }),
            }
        }));
    }
    futures::stream::iter(writes)
        .buffered(SETTING_WRITES_IN_FLIGHT)
        .collect::<Vec<Result<Record>>>()
        .await
        .into_iter()
        .collect()
}

/// Settings writes of one request in flight at once.
const SETTING_WRITES_IN_FLIGHT: usize = 256;

/// Deletes setting `key` of sandbox `sandbox`; whether it existed.
pub async fn delete_setting(store: &dyn ObjectStore, sandbox: Uuid, key: &str) -> Result<bool> {
    let Some(r) = store.get_by_name(Kind::Setting, Some(sandbox), key).await? else {
        return Ok(false);
    };
    match store.delete(r.id, r.resource_version).await {
        Ok(_) | Err(sbx_storage::StoreError::NotFound { .. }) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

/// The size of a run environment as `execve` counts it (`NAME=value` and a NUL each),
/// refused over [`crate::limits::MAX_RUN_ENV_BYTES`].
pub fn check_run_env_size(env: &BTreeMap<String, String>) -> Result<()> {
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if total > crate::limits::MAX_RUN_ENV_BYTES {
        return Err(ActorError::FailedPrecondition(format!(
            "the sandbox's credentials and settings are {total} bytes as environment variables; \
             at most {} are allowed (detach a provider or delete settings)",
            crate::limits::MAX_RUN_ENV_BYTES
        )));
    }
    Ok(())
}

/// Attaches provider `provider` to sandbox `sandbox` of workspace `ws`: one store create that
/// checks, in its transaction, that the provider exists in that workspace and the sandbox
/// exists. Attaching again answers the attachment there is.
pub async fn attach(
    store: &dyn ObjectStore,
    ws: Uuid,
    sandbox: Uuid,
    provider: Uuid,
) -> Result<Record> {
    let name = provider.to_string();
    if let Some(existing) = store
        .get_by_name(Kind::Attachment, Some(sandbox), &name)
        .await?
    {
        return Ok(existing);
    }
    let attached = owned_records(store, sandbox, Kind::Attachment).await?.len();
    if attached >= crate::limits::MAX_ATTACHMENTS {
        return Err(ActorError::InvalidArgument(format!(
            "the sandbox has {attached} providers attached; at most {} are allowed",
            crate::limits::MAX_ATTACHMENTS
        )));
    }
    let record = sbx_storage::NewRecord {
        id: Uuid::new_v4(),
        kind: Kind::Attachment,
        workspace: Some(ws),
        name: name.clone(),
        owner: Some(sandbox),
        labels: BTreeMap::new(),
        created_at_ms: crate::records::now_ms(),
        body: Vec::new(),
    };
    match store.create_referring(record, vec![provider]).await {
        Ok(r) => Ok(r),
        Err(sbx_storage::StoreError::ReferenceNotFound { .. }) => Err(ActorError::ObjectNotFound {
            kind: "provider",
            what: format!("with id {provider} (it was deleted)"),
        }),
        Err(sbx_storage::StoreError::OwnerNotFound { .. }) => Err(ActorError::SandboxNotFound {
            what: format!("with id {sandbox}"),
            hint: String::new(),
            similar: Vec::new(),
        }),
        Err(sbx_storage::StoreError::AlreadyExists { .. }) => store
            .get_by_name(Kind::Attachment, Some(sandbox), &name)
            .await?
            .ok_or_else(|| {
                ActorError::Unavailable("the attachment changed meanwhile; retry".into())
            }),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setting_names_become_distinct_env_names() {
        assert_eq!(
            setting_env_name("approval-mode"),
            "SBX_SETTING_APPROVAL_MODE"
        );
        assert_eq!(setting_env_name("x1"), "SBX_SETTING_X1");
    }
}
