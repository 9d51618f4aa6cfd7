//! Writing the sandbox's record: only while this gateway holds its workspace's lease, checked
//! against the version last written, each write published as an event and noted in the
//! sandbox's journal; and the record's deletion, which releases the node's share.

use ractor::ActorProcessingErr;
use sbx_proto::v1::EventType;

use super::deadlines::keep_lifetime;
use super::{SandboxActor, SandboxState};
use crate::records::StoredSandbox;

impl SandboxActor {
    pub(super) async fn persist_if_changed(
        &self,
        st: &mut SandboxState,
    ) -> Result<(), ActorProcessingErr> {
        keep_lifetime(st);
        if st.stored.to_update().body != st.stored.record.body {
            self.persist(st).await?;
        }
        Ok(())
    }

    /// Writes the actor's view of the sandbox, checked against the version it last wrote.
    pub(super) async fn persist(&self, st: &mut SandboxState) -> Result<(), ActorProcessingErr> {
        refuse_unless_held(st)?;
        keep_lifetime(st);
        let before = StoredSandbox::from_record(st.stored.record.clone()).map(|s| s.sandbox);
        let written = st.shared.store.update(st.stored.to_update()).await?;
        st.stored = StoredSandbox::from_record(written)?;
        st.shared
            .events
            .publish(EventType::Modified, st.stored.sandbox.clone());
        if let Ok(before) = before {
            let event = st.journal.note(&before, &st.stored.sandbox);
            tell(st, event);
        }
        Ok(())
    }

    pub(super) async fn delete_record(
        &self,
        st: &mut SandboxState,
    ) -> Result<(), ActorProcessingErr> {
        refuse_unless_held(st)?;
        match st
            .shared
            .store
            .delete(st.stored.id(), st.stored.record.resource_version)
            .await
        {
            Ok(_) | Err(sbx_storage::StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        st.shared.activity.forget(st.stored.id());
        let (cpu, memory) = crate::nodes::asks_of(&st.stored.sandbox);
        st.shared.drivers.nodes().release(
            crate::nodes::node_id_of(&st.stored.sandbox),
            cpu,
            memory,
        );
        st.shared
            .events
            .publish(EventType::Deleted, st.stored.sandbox.clone());
        Ok(())
    }
}

/// Writes `event` of the sandbox, if there is one (`crate::journal::write`).
pub(super) fn tell(st: &mut SandboxState, event: Option<(&'static str, String, String)>) {
    if let Some((kind, reason, message)) = event {
        crate::journal::write(
            &st.shared,
            &mut st.journal,
            &st.stored.sandbox,
            (kind, &reason, &message),
        );
    }
}

/// Gateways sharing a store: a sandbox's record is written only while this gateway holds its
/// workspace's lease (as its lease loop last renewed it); a gateway that lost or could not
/// renew it writes nothing more about it.
pub(super) fn refuse_unless_held(st: &SandboxState) -> Result<(), ActorProcessingErr> {
    if st.shared.ownership.is_none() {
        return Ok(());
    }
    let ws = st.stored.workspace_id();
    if st.shared.drivers.nodes().fence_of(ws).is_some() {
        Ok(())
    } else {
        Err(format!(
            "workspace {ws} is not held by this gateway (its lease is another's, or was not \
             renewed in time): nothing written"
        )
        .into())
    }
}
