//! What happened to sandboxes (`crate::journal`'s records), oldest first: a workspace's or
//! every workspace's in pages, or one sandbox's whole (at most `Config::events_per_sandbox`).

use sbx_proto::v1::Event;
use sbx_storage::Kind;

use super::{Gateway, Listed, SandboxFilter};
use crate::error::{ActorError, Result};
use crate::validate::SandboxSelector;

impl Gateway {
    /// One page of the events of the sandboxes `filter` names, oldest first.
    pub async fn list_events(
        &self,
        filter: &SandboxFilter,
        page_size: u32,
        page_token: &str,
    ) -> Result<Listed<Event>> {
        let scope = self.scope(filter).await?;
        self.list_page(Kind::Event, scope, "", page_size, page_token, decode)
            .await
    }

    /// Every event kept of one sandbox, oldest first.
    pub async fn sandbox_events(&self, sel: &SandboxSelector) -> Result<Vec<Event>> {
        let sb = self.resolve_sandbox(sel).await?;
        let store = &self.shared.store;
        let mut events = Vec::new();
        for id in store.owned(sb.id()).await? {
            if let Some(record) = store.get(id).await?
                && record.kind == Kind::Event
            {
                events.push(decode(record)?);
            }
        }
        // The owner index keeps creation order; the events' own times say the same, but two
        // in one millisecond keep the index's order.
        events.sort_by_key(|e| e.time.map(|t| (t.seconds, t.nanos)));
        Ok(events)
    }
}

fn decode(record: sbx_storage::Record) -> Result<Event> {
    crate::journal::decode(&record)
        .ok_or_else(|| ActorError::Internal(format!("event record {} does not decode", record.id)))
}
