//! What a host driver (oci, process) does with the gateway's network for its sandboxes: the
//! same steps whichever runs the workload — attach at a launch, the live policy update and
//! its status, the denials in a snapshot, the names told again to a restarted resolver, and
//! the release at delete.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;

use uuid::Uuid;

use crate::internal;
use crate::records::{HostRecord, RecordCache};
use sbx_driver_api::{DriverError, pb};
use sbx_network::{Attachment, Network, parse_allowlist, requested, status};

/// A host driver's record that says whether (and with what list) its sandbox is on the
/// gateway's network: `None` is loopback only.
pub trait NetworkedRecord: HostRecord {
    fn network_allow(&self) -> Option<&Vec<String>>;
    fn set_network_allow(&mut self, allow: Option<Vec<String>>);
}

/// The sandbox's place on the gateway's network (made if it has none yet, its policy
/// applied), or `None` for loopback only. A sandbox made on the network runs on it or not at
/// all: never a silent downgrade to loopback, nor an upgrade past its policy.
pub async fn attach(
    network: Option<&Arc<Network>>,
    id: Uuid,
    allow: Option<&Vec<String>>,
) -> Result<Option<Attachment>, DriverError> {
    attach_with(network, id, allow, Network::attach).await
}

/// [`attach`] for a workload with a kernel of its own, which holds its address itself (a vm
/// guest: `sbx_network::guest`).
pub async fn attach_guest(
    network: Option<&Arc<Network>>,
    id: Uuid,
    allow: Option<&Vec<String>>,
) -> Result<Option<Attachment>, DriverError> {
    attach_with(network, id, allow, Network::attach_guest).await
}

async fn attach_with(
    network: Option<&Arc<Network>>,
    id: Uuid,
    allow: Option<&Vec<String>>,
    how: fn(
        &Network,
        Uuid,
        &[sbx_network::AllowEntry],
    ) -> Result<Attachment, sbx_network::NetworkError>,
) -> Result<Option<Attachment>, DriverError> {
    let Some(allow) = allow else {
        return Ok(None);
    };
    let Some(net) = network else {
        return Err(DriverError::FailedPrecondition(format!(
            "sandbox {id} was made on the gateway's network with an egress policy, and this \
             sbxd has no network: start sbxd with the same --network-cidr and --network-name"
        )));
    };
    let entries =
        parse_allowlist(allow).map_err(|e| DriverError::InvalidArgument(e.to_string()))?;
    let net = Arc::clone(net);
    let attached = tokio::task::spawn_blocking(move || how(&net, id, &entries))
        .await
        .map_err(|e| internal("attaching the sandbox's network", e))?
        .map_err(|e| DriverError::Unavailable(format!("the sandbox's network: {e}")))?;
    Ok(Some(attached))
}

/// Writes `dir/resolv.conf` naming the gateway's resolver (bound at `/etc/resolv.conf`
/// inside the sandbox).
pub fn write_resolv_conf(dir: &Path, gateway: Ipv4Addr) -> Result<(), DriverError> {
    std::fs::write(dir.join(RESOLV_FILE), format!("nameserver {gateway}\n"))
        .map_err(|e| internal("writing the sandbox's resolv.conf", e))
}

/// The run directory's file that a networked sandbox sees as `/etc/resolv.conf`.
pub const RESOLV_FILE: &str = "resolv.conf";

/// Removes the sandbox's namespace, veth, rules and address lease (at delete).
pub async fn release(
    network: Option<&Arc<Network>>,
    id: Uuid,
    allow: Option<&Vec<String>>,
    driver: &str,
) -> Result<(), DriverError> {
    match (network, allow) {
        (Some(net), Some(_)) => {
            let net = Arc::clone(net);
            tokio::task::spawn_blocking(move || net.detach(id))
                .await
                .map_err(|e| internal("detaching the sandbox's network", e))?
                .map_err(|e| DriverError::Internal(format!("removing the sandbox's network: {e}")))
        }
        (None, Some(_)) => {
            tracing::warn!(
                sandbox_id = %id,
                "a networked sandbox deleted by an sbxd without --network-cidr: its namespace \
                 (/run/netns/<name>-<id>), veth, rules and address lease (drivers/{driver}/\
                 network/leases/) are left behind; remove them by hand or run sbxd with its \
                 network"
            );
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Tells a just-opened network the lists of the sandboxes a driver found (the table still
/// holds them; its resolver must know them again).
pub fn restore<'a>(
    network: Option<&Arc<Network>>,
    records: impl IntoIterator<Item = (Uuid, Option<&'a Vec<String>>)>,
) {
    let Some(net) = network else { return };
    for (id, allow) in records {
        let Some(allow) = allow else { continue };
        match parse_allowlist(allow) {
            Ok(entries) => net.restore(id, &entries),
            Err(e) => {
                tracing::warn!(sandbox_id = %id, error = %e, "a stored network policy no longer parses")
            }
        }
    }
}

/// Puts what the sandbox's policy refused lately into its snapshot.
pub fn note_denials(
    network: Option<&Arc<Network>>,
    id: Uuid,
    allow: Option<&Vec<String>>,
    snapshot: &mut pb::Snapshot,
) {
    if let (Some(net), Some(_)) = (network, allow) {
        let (denied, last) = net.denial_summary(id);
        snapshot.network_denied = denied;
        snapshot.network_last_denial = last;
    }
}

/// What the network refused the sandbox past its budgets: `(DNS queries, connections)`;
/// zeros without a network.
pub fn budget_refusals(network: Option<&Arc<Network>>, id: Uuid) -> (u64, u64) {
    network.map_or((0, 0), |net| {
        let r = net.budget_refusals(id);
        (r.dns_queries, r.connections)
    })
}

/// Replaces a networked sandbox's allowlist: the record first, then the firewall (a driver
/// killed between the two applies the record's list at the next attach).
pub async fn update<R: NetworkedRecord>(
    records: &RecordCache<R>,
    network: Option<&Arc<Network>>,
    req: pb::UpdateNetworkRequest,
) -> Result<pb::NetworkStatus, DriverError> {
    let id = sbx_driver_api::parse_sandbox_id(&req.sandbox_id)?;
    let _serialised = records.lock(id).await;
    let mut record = records.require(id)?;
    let asked = requested(req.policy.as_ref(), network)?;
    let (Some(allow), Some(_), Some(net)) = (asked, record.network_allow(), network) else {
        return Err(DriverError::FailedPrecondition(format!(
            "sandbox {id} was made with network mode none (or the update asks for none): the \
             mode of a sandbox's network is fixed at create; only a policy's allowlist can \
             change"
        )));
    };
    let entries =
        parse_allowlist(&allow).map_err(|e| DriverError::InvalidArgument(e.to_string()))?;
    let count = allow.len();
    record.set_network_allow(Some(allow));
    records.save(&record)?;
    let applied = {
        let net = Arc::clone(net);
        tokio::task::spawn_blocking(move || match net.address_of(id) {
            // Not attached yet (made stopped): the list applies at its first start.
            None => Ok(()),
            Some(_) => net.set_policy(id, &entries),
        })
        .await
        .map_err(|e| internal("applying the policy", e))?
    };
    applied.map_err(|e| DriverError::Unavailable(format!("applying the policy: {e}")))?;
    tracing::info!(sandbox_id = %id, entries = count, "network policy updated");
    status(Some(net), id, record.network_allow())
}

/// The sandbox's network as the driver contract tells it.
pub async fn get<R: NetworkedRecord>(
    records: &RecordCache<R>,
    network: Option<&Arc<Network>>,
    req: pb::GetNetworkRequest,
) -> Result<pb::NetworkStatus, DriverError> {
    let id = sbx_driver_api::parse_sandbox_id(&req.sandbox_id)?;
    let record = records.require(id)?;
    let net = network.cloned();
    tokio::task::spawn_blocking(move || status(net.as_deref(), id, record.network_allow()))
        .await
        .map_err(|e| internal("reading the network", e))?
}
