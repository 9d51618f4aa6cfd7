//! A watch of sandbox events: from version 0 the store's list of the sandboxes it covers as
//! ADDED events, then the live history; from version N the history after N (see `events.rs`
//! for the history's bounds). Each sandbox's listed version is a floor, so an event the list
//! already showed is not sent twice.

use std::collections::{BTreeMap, HashMap};

use sbx_proto::v1::{EventType, SandboxEvent};
use sbx_storage::{Kind, Scope};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{Gateway, SandboxFilter};
use crate::error::{ActorError, Result};
use crate::events::LiveError;
use crate::records::StoredSandbox;
use crate::scan::all_records;
use crate::validate;

/// Events a watch holds on their way to its client, at most: its own copies (the history's
/// are shared), so with 256 KiB specs 4 are 1 MiB per watch that does not read. The hub
/// never waits for a watcher, so a deeper buffer would only pipeline, not unblock.
const WATCH_BUFFER: usize = 4;

impl Gateway {
    /// A stream of sandbox events. `resource_version` 0 starts with an ADDED event for every
    /// current sandbox; N resumes after version N.
    pub async fn watch(
        &self,
        filter: &SandboxFilter,
        resource_version: u64,
    ) -> Result<ReceiverStream<Result<SandboxEvent>>> {
        let scope = self.scope(filter).await?;
        let selector = validate::selector(&filter.label_selector)?;
        // Every version a client was given was committed first: one beyond the store's is
        // none the gateway gave out, and a watch from it would wait for ever in silence.
        if resource_version > 0 {
            let newest = self.shared.store.current_revision().await?;
            if resource_version > newest {
                return Err(ActorError::ResourceVersionInFuture {
                    requested: resource_version,
                    newest,
                });
            }
        }
        let sub = self.shared.events.subscribe(resource_version)?;
        // From 0: what the list shows is the store at or after this revision, so an event at
        // or below it is already in the list — or of a sandbox gone before it, which the
        // client never saw (a hub fed by the store may still be catching up on such).
        let after = if resource_version == 0 {
            self.shared.store.current_revision().await?
        } else {
            resource_version
        };
        let mut initial = Vec::new();
        let mut floor: HashMap<String, u64> = HashMap::new();
        if resource_version == 0 {
            let records = all_records(&*self.shared.store, Kind::Sandbox, scope, &selector).await?;
            for record in records {
                let sb = StoredSandbox::from_record(record)?.sandbox;
                floor.insert(sb.id.clone(), sb.resource_version);
                initial.push(SandboxEvent {
                    r#type: EventType::Added as i32,
                    resource_version: sb.resource_version,
                    sandbox: Some(sb),
                });
            }
        }
        let wanted = move |ev: &SandboxEvent| -> bool {
            let Some(sb) = &ev.sandbox else { return false };
            let in_scope = match &scope {
                Scope::All => true,
                Scope::Workspace(ws) => sb.workspace_id == ws.to_string(),
            };
            let labels: BTreeMap<String, String> = sb
                .spec
                .as_ref()
                .map(|s| s.labels.clone().into_iter().collect())
                .unwrap_or_default();
            in_scope
                && selector.matches(&labels)
                && ev.resource_version > after
                && floor.get(&sb.id).is_none_or(|rv| ev.resource_version > *rv)
        };
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        tokio::spawn(async move {
            for ev in initial {
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
            let mut last = resource_version;
            let mut sub = sub;
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    received = sub.recv() => match received {
                        Ok(ev) => {
                            if !wanted(&ev) {
                                continue;
                            }
                            last = last.max(ev.resource_version);
                            // The history's copy is shared; this watcher's is made only for
                            // an event it sends.
                            if tx.send(Ok(SandboxEvent::clone(&ev))).await.is_err() {
                                return;
                            }
                        }
                        Err(LiveError::FellBehind { .. }) => {
                            let _ = tx.send(Err(ActorError::Unavailable(format!(
                                "the watch fell behind; resume from resource version {last}"
                            )))).await;
                            return;
                        }
                        Err(LiveError::Closed) => return,
                    }
                }
            }
        });
        Ok(ReceiverStream::new(rx))
    }
}
