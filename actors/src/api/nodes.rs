//! Nodes through the API: registering, listing, cordoning, draining and forgetting them, and
//! placing a new sandbox on one (`crate::nodes` holds the registry and the placement rule).
//!
//! A registered node is a `Kind::Node` record whose id is the node's own; the record of the
//! local node (a fixed id, [`LOCAL_RECORD`]) exists only once it has been cordoned or
//! uncordoned, and holds that choice for every gateway of the store.

use std::collections::BTreeMap;
use std::sync::Arc;

use prost::Message;
use sbx_driver_api::ComputeDriver;
use sbx_proto::v1::{Node, Sandbox, SandboxSpec, Workspace};
use sbx_storage::{Kind, LabelSelector, NewRecord, Record, Scope, StoreError};
use uuid::Uuid;

use super::Gateway;
use crate::error::{ActorError, Result};
use crate::nodes::{Ask, LOCAL, Nodes, asks_of, node_id_of};
use crate::records::{StoredSandbox, now_ms, timestamp};
use crate::scan::all_records;
use crate::validate::SandboxSelector;

/// The id of the local node's record (what `cordon local` writes).
pub const LOCAL_RECORD: Uuid = Uuid::from_u128(0x5b78_0000_0000_4000_8000_6c6f_6361_6c00);

/// Which node a request names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeSelector {
    Id(Uuid),
    Name(String),
}

/// A placement made for a create: released unless [`Placed::keep`] is called (the create
/// failed or was dropped).
pub(super) struct Placed {
    nodes: Arc<Nodes>,
    pub node: Option<Uuid>,
    pub node_name: String,
    pub driver: Arc<dyn ComputeDriver>,
    pub ask: Ask,
    /// What is reserved on the node now.
    reserved: (u64, u64),
    kept: bool,
}

impl Placed {
    /// The sandbox's limits are final (defaults applied, perhaps lower than reserved): the
    /// reservation becomes them.
    pub fn settle(&mut self, spec: &SandboxSpec) {
        let now = asks_of(&Sandbox {
            spec: Some(spec.clone()),
            ..Default::default()
        });
        self.nodes.lower(
            self.node,
            self.reserved.0.saturating_sub(now.0),
            self.reserved.1.saturating_sub(now.1),
        );
        self.reserved = (self.reserved.0.min(now.0), self.reserved.1.min(now.1));
    }

    /// The sandbox's record is written: it holds the reservation from now on (released when
    /// it is deleted).
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Placed {
    fn drop(&mut self) {
        if !self.kept {
            self.nodes
                .release(self.node, self.reserved.0, self.reserved.1);
        }
    }
}

fn node_body(node: &Node) -> Vec<u8> {
    let mut body = node.clone();
    // Runtime figures are not stored: they are what the node says when asked.
    body.allocated = None;
    body.state = 0;
    body.message.clear();
    body.last_seen = None;
    body.created_at = None;
    body.resource_version = 0;
    body.encode_to_vec()
}

fn node_from_record(record: &Record) -> Result<Node> {
    let mut node = Node::decode(record.body.as_slice()).map_err(|e| {
        ActorError::Internal(format!("node record {} does not decode: {e}", record.id))
    })?;
    node.id = record.id.to_string();
    node.name = record.name.clone();
    node.created_at = Some(timestamp(record.created_at_ms));
    node.resource_version = record.resource_version;
    Ok(node)
}

/// Makes the registry hold the nodes the store holds: a node registered (through any gateway
/// of the store) is dialed and held, a held one has its cordon and labels updated, one removed
/// is let go. Answers the local node's cordon when its record exists. At start, and then
/// every probe round, so gateways sharing a store see each other's `node add|cordon|remove`.
pub(crate) async fn sync_nodes(
    store: &dyn sbx_storage::ObjectStore,
    nodes: &Nodes,
) -> Result<Option<bool>> {
    let mut local_cordoned = None;
    let mut seen = std::collections::HashSet::new();
    // Only what was held before the list can have been removed since: a node this gateway
    // adds while the list is read is not let go (nor its count of what it holds).
    let held_before: Vec<Uuid> = nodes.drivers().into_iter().map(|(id, _)| id).collect();
    for record in all_records(store, Kind::Node, Scope::All, &LabelSelector::everything()).await? {
        let node = node_from_record(&record)?;
        if record.id == LOCAL_RECORD {
            local_cordoned = Some(node.cordoned);
            continue;
        }
        seen.insert(record.id);
        if nodes.holds(record.id) {
            nodes.update_stored(&node);
            continue;
        }
        match nodes.dial(&node.endpoint) {
            Ok(link) => nodes.insert(node, link, false),
            Err(e) => tracing::error!(node = %node.name, endpoint = %node.endpoint,
                "cannot reach this node's endpoint: {e}"),
        }
    }
    for id in held_before {
        if !seen.contains(&id) {
            nodes.remove(id);
        }
    }
    Ok(local_cordoned)
}

/// Loads the registered nodes (each dialed, none waited for), the local node's cordon, and
/// what every sandbox asks of its node. At start, before any actor asks for a sandbox's
/// driver.
pub(super) async fn load_nodes(shared: &crate::config::Shared) -> Result<()> {
    let nodes = shared.drivers.nodes();
    let store = &*shared.store;
    let local_cordoned = sync_nodes(store, nodes)
        .await?
        .unwrap_or(shared.config.local_node_cordoned);
    // The local node: the gateway's drivers, with no capacity of its own to place
    // against (it is the gateway's machine, bounded by sbxd's limits as before).
    let local_drivers = shared.drivers.iter().map(|(n, _)| n.clone()).collect();
    nodes.set_local(
        local_drivers,
        sbx_proto::v1::NodeCapacity::default(),
        local_cordoned,
    );
    for record in all_records(
        store,
        Kind::Sandbox,
        Scope::All,
        &LabelSelector::everything(),
    )
    .await?
    {
        match StoredSandbox::from_record(record) {
            Ok(s) => nodes.count(&s.sandbox),
            Err(e) => tracing::warn!("skipping an undecodable sandbox record: {e}"),
        }
    }
    Ok(())
}

impl Gateway {
    /// Places a new sandbox of `spec` in `ws`: the node and its driver, reserved.
    pub(super) fn place(&self, spec: &SandboxSpec, ws: &Workspace) -> Result<Placed> {
        let drivers = &self.shared.drivers;
        let nodes = drivers.nodes();
        let driver = drivers.name_or_default(&spec.driver).to_string();
        // A driver no node has: the error of old, naming the gateway's drivers.
        if nodes.drivers().is_empty() && spec.node.is_empty() && spec.node_selector.is_empty() {
            drivers.resolve(&driver)?;
        }
        let (cpu_millis, memory_bytes) =
            super::limits::asked(spec, ws, &self.shared.config.default_resources);
        let ask = Ask {
            driver,
            cpu_millis,
            memory_bytes,
            node: (!spec.node.is_empty()).then(|| spec.node.clone()),
            selector: spec.node_selector.clone().into_iter().collect(),
        };
        let (node, node_name) = nodes.reserve(&ask).map_err(ActorError::NoNodeFits)?;
        let placed = Placed {
            nodes: Arc::clone(nodes),
            node,
            node_name,
            driver: match node {
                Some(id) => nodes.link_of(id),
                None => drivers
                    .resolve(&ask.driver)
                    .ok()
                    .map(|(_, d)| Arc::clone(d)),
            }
            .ok_or_else(|| ActorError::Internal("the placed node has no driver".into()))?,
            reserved: (cpu_millis, memory_bytes),
            ask,
            kept: false,
        };
        Ok(placed)
    }

    /// Registers the node answering at `endpoint` under `name`.
    pub async fn add_node(
        &self,
        name: &str,
        endpoint: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Node> {
        crate::validate::name("node", name)?;
        if name == LOCAL {
            return Err(ActorError::InvalidArgument(
                "\"local\" is the gateway's own node; give the node another name".into(),
            ));
        }
        sbx_storage::validate_labels(&labels)
            .map_err(|e| ActorError::InvalidArgument(e.to_string()))?;
        if endpoint.is_empty() {
            return Err(ActorError::InvalidArgument(
                "a node needs its endpoint (HOST:PORT of its sbxd node --listen)".into(),
            ));
        }
        let nodes = self.shared.drivers.nodes();
        let link = nodes
            .dial(endpoint)
            .map_err(|e| ActorError::InvalidArgument(format!("endpoint {endpoint:?}: {e}")))?;
        let timeout = self.shared.config.driver_call_timeout;
        let report = match tokio::time::timeout(timeout, link.report()).await {
            Ok(Ok(report)) => report,
            Ok(Err(e)) => {
                return Err(ActorError::Unavailable(format!(
                    "no node answers at {endpoint}: {e}"
                )));
            }
            Err(_) => {
                return Err(ActorError::Unavailable(format!(
                    "no node answered at {endpoint} within {timeout:?}"
                )));
            }
        };
        let node = Node {
            id: report.node_id.to_string(),
            name: name.to_string(),
            endpoint: endpoint.to_string(),
            labels: labels.clone().into_iter().collect(),
            drivers: report.drivers.clone(),
            capacity: Some(report.capacity),
            ..Default::default()
        };
        let record = NewRecord {
            id: report.node_id,
            kind: Kind::Node,
            workspace: None,
            name: name.to_string(),
            owner: None,
            labels,
            created_at_ms: now_ms(),
            body: node_body(&node),
        };
        let stored = self
            .shared
            .store
            .create(record)
            .await
            .map_err(|e| match e {
                StoreError::AlreadyExists { existing, .. } if existing == report.node_id => {
                    ActorError::FailedPrecondition(format!(
                        "the node at {endpoint} (id {existing}) is registered already"
                    ))
                }
                StoreError::AlreadyExists { existing, .. } => ActorError::NameTaken {
                    kind: "node",
                    name: name.to_string(),
                    scope: "the gateway".to_string(),
                    existing: existing.to_string(),
                },
                other => other.into(),
            })?;
        let node = node_from_record(&stored)?;
        nodes.insert(node.clone(), link, true);
        tracing::info!(node = %name, %endpoint, id = %report.node_id, "node added");
        self.get_node(&NodeSelector::Id(stored.id))
    }

    /// Every node, `local` first.
    pub fn list_nodes(&self) -> Vec<Node> {
        self.shared.drivers.nodes().list()
    }

    pub fn get_node(&self, sel: &NodeSelector) -> Result<Node> {
        self.list_nodes()
            .into_iter()
            .find(|n| match sel {
                NodeSelector::Id(id) => n.id == id.to_string(),
                NodeSelector::Name(name) => n.name == *name,
            })
            .ok_or_else(|| ActorError::ObjectNotFound {
                kind: "node",
                what: match sel {
                    NodeSelector::Id(id) => id.to_string(),
                    NodeSelector::Name(name) => format!("{name:?}"),
                },
            })
    }

    /// Cordons (`true`) or uncordons a node; persisted, so every gateway of the store and a
    /// restart keep it.
    pub async fn cordon_node(&self, sel: &NodeSelector, cordon: bool) -> Result<Node> {
        let shown = self.get_node(sel)?;
        let nodes = self.shared.drivers.nodes();
        let store = &self.shared.store;
        let id = if shown.name == LOCAL {
            LOCAL_RECORD
        } else {
            Uuid::parse_str(&shown.id)
                .map_err(|_| ActorError::Internal(format!("node id {:?}", shown.id)))?
        };
        // Compare-and-swap, again on a conflict (another gateway wrote it meanwhile).
        for _ in 0..10 {
            match store.get(id).await? {
                Some(mut record) => {
                    let mut node = node_from_record(&record)?;
                    node.cordoned = cordon;
                    record.body = node_body(&node);
                    record.updated_at_ms = now_ms();
                    match store.update(record).await {
                        Ok(written) => {
                            let node = node_from_record(&written)?;
                            if id == LOCAL_RECORD {
                                nodes.set_local_cordoned(cordon);
                            } else {
                                nodes.update_stored(&node);
                            }
                            return self.get_node(sel);
                        }
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                None if id == LOCAL_RECORD => {
                    let node = Node {
                        name: LOCAL.to_string(),
                        cordoned: cordon,
                        ..Default::default()
                    };
                    let record = NewRecord {
                        id,
                        kind: Kind::Node,
                        workspace: None,
                        name: LOCAL.to_string(),
                        owner: None,
                        labels: BTreeMap::new(),
                        created_at_ms: now_ms(),
                        body: node_body(&node),
                    };
                    match store.create(record).await {
                        Ok(_) => {
                            nodes.set_local_cordoned(cordon);
                            return self.get_node(sel);
                        }
                        Err(StoreError::AlreadyExists { .. }) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                None => {
                    return Err(ActorError::ObjectNotFound {
                        kind: "node",
                        what: shown.name,
                    });
                }
            }
        }
        Err(ActorError::Unavailable(format!(
            "node {:?} kept changing; try again",
            shown.name
        )))
    }

    /// The sandboxes placed on node `shown` (local: those with no node).
    async fn sandboxes_on(&self, shown: &Node) -> Result<Vec<StoredSandbox>> {
        let want = if shown.name == LOCAL {
            None
        } else {
            Uuid::parse_str(&shown.id).ok()
        };
        let records = all_records(
            &*self.shared.store,
            Kind::Sandbox,
            Scope::All,
            &LabelSelector::everything(),
        )
        .await?;
        Ok(records
            .into_iter()
            .filter_map(|r| StoredSandbox::from_record(r).ok())
            .filter(|s| node_id_of(&s.sandbox) == want)
            .collect())
    }

    /// Cordons the node, then (with `stop`) stops every sandbox on it that is wanted
    /// running. Answers the node, how many this call stopped, and how many still run.
    pub async fn drain_node(&self, sel: &NodeSelector, stop: bool) -> Result<(Node, u32, u32)> {
        let node = self.cordon_node(sel, true).await?;
        let mut stopped = 0;
        if stop {
            for sb in self.sandboxes_on(&node).await? {
                use sbx_proto::v1::DesiredState;
                if sb.sandbox.desired_state() == DesiredState::Running {
                    self.stop_sandbox(&SandboxSelector::Id(sb.id())).await?;
                    stopped += 1;
                }
            }
        }
        let running = self
            .sandboxes_on(&node)
            .await?
            .iter()
            .filter(|s| {
                use sbx_proto::v1::Phase;
                matches!(
                    s.sandbox.phase(),
                    Phase::Ready | Phase::Starting | Phase::Provisioning
                )
            })
            .count() as u32;
        Ok((self.get_node(sel)?, stopped, running))
    }

    /// Forgets a node that holds no sandbox. False for an id with no node.
    pub async fn remove_node(&self, sel: &NodeSelector) -> Result<bool> {
        let node = match self.get_node(sel) {
            Ok(node) => node,
            Err(ActorError::ObjectNotFound { .. }) if matches!(sel, NodeSelector::Id(_)) => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        if node.name == LOCAL {
            return Err(ActorError::FailedPrecondition(
                "the local node is the gateway's own drivers: cordon it instead".into(),
            ));
        }
        let held = self.sandboxes_on(&node).await?;
        if !held.is_empty() {
            let names: Vec<String> = held
                .iter()
                .take(5)
                .map(|s| format!("{}/{}", s.sandbox.workspace, s.sandbox.name))
                .collect();
            return Err(ActorError::FailedPrecondition(format!(
                "node {:?} holds {} sandbox(es) ({}{}); delete them first (their files are on it)",
                node.name,
                held.len(),
                names.join(", "),
                if held.len() > names.len() {
                    ", …"
                } else {
                    ""
                }
            )));
        }
        let id = Uuid::parse_str(&node.id)
            .map_err(|_| ActorError::Internal(format!("node id {:?}", node.id)))?;
        match self.shared.store.delete(id, node.resource_version).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(StoreError::Conflict { .. }) => {
                return Err(ActorError::Unavailable(format!(
                    "node {:?} changed meanwhile; try again",
                    node.name
                )));
            }
            Err(e) => return Err(e.into()),
        }
        self.shared.drivers.nodes().remove(id);
        tracing::info!(node = %node.name, "node removed");
        Ok(true)
    }
}
