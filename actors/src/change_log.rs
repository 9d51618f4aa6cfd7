//! The store's change log, read into the gateway's event hub: how a gateway on a shared store
//! (PostgreSQL) hears every gateway's writes (see [`crate::events`]). Its own module, above
//! both the hub and the actors' shared context, so that the hub does not name that context.

use std::sync::Arc;

use sbx_proto::v1::EventType;

use crate::config::Shared;

/// How often a gateway on a store with a change log looks for new changes when it found none.
pub const CHANGE_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Changes read from the store at once.
const CHANGE_BATCH: usize = 500;

/// Feeds the gateway's hub from the store's change log, after revision `after`, for ever: each sandbox
/// change as an event (created: ADDED, updated: MODIFIED, deleted: DELETED at the delete's
/// revision), in revision order. Polls every [`CHANGE_POLL`] while there is nothing new; a
/// store that does not answer is retried every second (watchers wait, nothing is skipped);
/// a log trimmed past where it was reading restarts the hub there (its watchers are told
/// they fell behind, and resume).
pub(crate) async fn follow_change_log(shared: Arc<Shared>, mut after: u64) {
    use sbx_storage::{ChangeOp, StoreError};
    let (store, hub) = (&shared.store, &shared.events);
    let mut failing = false;
    loop {
        match store.changes_after(after, CHANGE_BATCH).await {
            Ok(changes) => {
                if failing {
                    tracing::info!("reading the store's change log again");
                    failing = false;
                }
                let idle = changes.is_empty();
                for change in changes {
                    after = change.revision;
                    if change.record.kind != sbx_storage::Kind::Sandbox {
                        continue;
                    }
                    let id = change.record.id;
                    let mut sandbox = match crate::records::StoredSandbox::from_record(
                        change.record,
                    ) {
                        Ok(stored) => stored.sandbox,
                        Err(e) => {
                            tracing::warn!(sandbox = %id, revision = after, "a change the watch cannot read, skipped: {e}");
                            continue;
                        }
                    };
                    sandbox.resource_version = change.revision;
                    let kind = match change.op {
                        ChangeOp::Created => EventType::Added,
                        ChangeOp::Updated => EventType::Modified,
                        ChangeOp::Deleted => EventType::Deleted,
                    };
                    hub.append(kind, sandbox);
                }
                if idle {
                    tokio::time::sleep(CHANGE_POLL).await;
                }
            }
            Err(StoreError::ChangesTooOld { oldest, .. }) => {
                tracing::warn!(
                    "the store's change log was trimmed past revision {after}, where this \
                     gateway read; watches resume from {oldest}"
                );
                hub.restart_at(oldest);
                after = oldest;
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(
                        "cannot read the store's change log (retrying every second): {e}"
                    );
                    failing = true;
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
}
