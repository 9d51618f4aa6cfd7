//! A sandbox's network: its policy, address and recent denials (read from its driver by
//! id), and live updates of its allowlist (through the sandbox's actor, which persists the
//! new list before the driver applies it).

use sbx_driver_api::{ComputeDriver, pb};
use sbx_proto::v1::{NetworkMode, NetworkPolicy, SandboxNetwork, SandboxSpec};

use super::Gateway;
use crate::error::{ActorError, Result};
use crate::protocol::SandboxMsg;
use crate::validate::{self, SandboxSelector};

impl Gateway {
    /// A create asking for mode policy from a driver without a network is refused before
    /// anything is written (never a sandbox parked in Error, never a policy ignored).
    pub(super) async fn refuse_network_without_driver(
        &self,
        spec: &SandboxSpec,
        driver: &dyn ComputeDriver,
    ) -> Result<()> {
        let wants = spec
            .network
            .as_ref()
            .is_some_and(|n| n.mode() == NetworkMode::Policy);
        if !wants {
            return Ok(());
        }
        let caps = self
            .images
            .driver_capabilities(&spec.driver, driver)
            .await?;
        if !caps.network {
            return Err(ActorError::FailedPrecondition(format!(
                "driver {:?} gives sandboxes no network (the oci driver does, with sbxd serve \
                 --network-cidr): only network mode none",
                spec.driver
            )));
        }
        Ok(())
    }

    /// Sets (Some) or clears (None) a workspace's default network policy, through its
    /// supervisor (ordered with its delete).
    pub async fn set_workspace_network(
        &self,
        sel: &crate::validate::WorkspaceSelector,
        policy: Option<NetworkPolicy>,
    ) -> Result<sbx_proto::v1::Workspace> {
        if let Some(p) = &policy {
            validate::network(p)?;
        }
        self.refuse_if_disk_full()?;
        let ws = self.resolve_workspace(sel).await?;
        self.router
            .call_workspace(ws.id(), |reply| {
                crate::protocol::WorkspaceMsg::SetDefaultNetwork {
                    policy: policy.clone(),
                    reply,
                }
            })
            .await?
            .ok_or_else(|| ActorError::WorkspaceNotFound(format!("{:?}", ws.workspace.name)))
    }

    /// The sandbox's network as its driver sees it now.
    pub async fn get_sandbox_network(&self, sel: &SandboxSelector) -> Result<SandboxNetwork> {
        let sb = self.resolve_sandbox(sel).await?;
        self.router.refuse_unless_held(sb.workspace_id()).await?;
        let driver = self.shared.drivers.for_sandbox(&sb.sandbox)?;
        let status = driver
            .get_network(pb::GetNetworkRequest {
                sandbox_id: sb.id().to_string(),
            })
            .await?;
        Ok(network_message(sb.id(), status))
    }

    /// Replaces a networked sandbox's allowlist, live.
    pub async fn update_sandbox_network(
        &self,
        sel: &SandboxSelector,
        policy: NetworkPolicy,
    ) -> Result<SandboxNetwork> {
        validate::network(&policy)?;
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        let status = self
            .router
            .call_sandbox(sb.workspace_id(), sb.id(), |reply| {
                SandboxMsg::UpdateNetwork {
                    policy: policy.clone(),
                    reply,
                }
            })
            .await?
            .ok_or_else(|| super::not_found_id(sb.id()))?;
        Ok(network_message(sb.id(), status))
    }
}

fn network_message(id: uuid::Uuid, status: pb::NetworkStatus) -> SandboxNetwork {
    SandboxNetwork {
        sandbox_id: id.to_string(),
        policy: status.policy.map(|p| NetworkPolicy {
            mode: p.mode,
            allow: p.allow,
        }),
        address: status.address,
        gateway: status.gateway,
        denials: status
            .denials
            .into_iter()
            .map(crate::translate::public_denial)
            .collect(),
    }
}
