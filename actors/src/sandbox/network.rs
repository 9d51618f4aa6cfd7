//! The sandbox's network while it lives: a live allowlist update (the record first, then the
//! driver, the record put back if the driver cannot), and the denials and budget refusals a
//! driver reports, recorded once per change.

use ractor::ActorProcessingErr;
use sbx_driver_api::pb;
use sbx_proto::v1::{DesiredState, EventType};

use super::record::tell;
use super::{SandboxActor, SandboxState, desired, refuse_if_deleting};
use crate::error::{ActorError, Result};
use crate::records::StoredSandbox;

impl SandboxActor {
    /// A live policy update: the new allowlist is written to the sandbox's record first, then
    /// the driver applies it; if the driver cannot, the record is put back (both say the old
    /// list) and the driver's error is the answer.
    pub(super) async fn update_network(
        &self,
        st: &mut SandboxState,
        policy: sbx_proto::v1::NetworkPolicy,
    ) -> Result<pb::NetworkStatus> {
        use sbx_proto::v1::NetworkMode;
        refuse_if_deleting(st, "change the network of")?;
        let name = st.stored.sandbox.name.clone();
        let current = st
            .stored
            .sandbox
            .spec
            .as_ref()
            .and_then(|s| s.network.clone());
        if current.as_ref().map(|n| n.mode()) != Some(NetworkMode::Policy) {
            return Err(ActorError::FailedPrecondition(format!(
                "sandbox {name:?} was made with network mode none: the mode is fixed at create \
                 (make a new sandbox with --network policy)"
            )));
        }
        if policy.mode() != NetworkMode::Policy {
            return Err(ActorError::FailedPrecondition(format!(
                "the network mode of sandbox {name:?} is fixed at create: give mode policy with \
                 the new allowlist (an empty one denies everything)"
            )));
        }
        let driver = self.driver(st)?;
        let write = |st: &mut SandboxState, network: Option<sbx_proto::v1::NetworkPolicy>| {
            if let Some(spec) = st.stored.sandbox.spec.as_mut() {
                spec.network = network;
            }
        };
        write(st, Some(policy.clone()));
        let written = st.shared.store.update(st.stored.to_update()).await;
        match written {
            Ok(record) => st.stored = StoredSandbox::from_record(record)?,
            Err(e) => {
                write(st, current);
                return Err(e.into());
            }
        }
        st.shared
            .events
            .publish(EventType::Modified, st.stored.sandbox.clone());
        let request = pb::UpdateNetworkRequest {
            sandbox_id: st.stored.id().to_string(),
            policy: Some(pb::NetworkPolicy {
                mode: policy.mode,
                allow: policy.allow,
            }),
        };
        match driver.update_network(request).await {
            Ok(status) => Ok(status),
            Err(e) => {
                write(st, current);
                match st.shared.store.update(st.stored.to_update()).await {
                    Ok(record) => {
                        st.stored = StoredSandbox::from_record(record)?;
                        st.shared
                            .events
                            .publish(EventType::Modified, st.stored.sandbox.clone());
                    }
                    Err(put_back) => tracing::warn!(
                        sandbox_id = %st.stored.id(),
                        error = %put_back,
                        "the driver refused a network update and the old policy could not be written back"
                    ),
                }
                Err(e.into())
            }
        }
    }

    /// Records what the driver last saw the sandbox's egress policy refuse, and what the host
    /// refused it past its budgets, if that changed:
    /// one write and one MODIFIED event per change, and the driver's look is itself at most
    /// every few seconds (a sandbox hammering a refused port costs that, not a write per
    /// packet).
    pub(super) async fn note_denials(
        &self,
        st: &mut SandboxState,
        s: &pb::Snapshot,
    ) -> Result<(), ActorProcessingErr> {
        let last = s
            .network_last_denial
            .clone()
            .map(crate::translate::public_denial);
        let refusals = s
            .budget_refusals
            .map(crate::translate::public_refusals)
            .filter(|r| *r != sbx_proto::v1::BudgetRefusals::default());
        let sandbox = &st.stored.sandbox;
        if desired(st) == DesiredState::Deleted
            || (sandbox.network_denied == s.network_denied
                && sandbox.network_last_denial == last
                && sandbox.budget_refusals == refusals)
        {
            return Ok(());
        }
        let before = sandbox.network_denied;
        let refused_before = sandbox.budget_refusals;
        st.stored.sandbox.network_denied = s.network_denied;
        st.stored.sandbox.network_last_denial = last;
        st.stored.sandbox.budget_refusals = refusals;
        self.persist(st).await?;
        let event = st.journal.note_denials(
            before,
            s.network_denied,
            st.stored.sandbox.network_last_denial.as_ref(),
        );
        tell(st, event);
        let event = st.journal.note_refusals(
            refused_before.as_ref(),
            st.stored.sandbox.budget_refusals.as_ref(),
        );
        tell(st, event);
        Ok(())
    }
}
