//! The machines sandboxes run on, for a gateway-wide admin: the auth layer's table
//! ([`crate::auth::need`]) refuses every other caller before a call reaches the door, so
//! these take none, and a failure is the actor error's as is (an admin sees it all).

use std::collections::BTreeMap;

use sbx_actors::NodeSelector;
use sbx_proto::v1::Node;

use super::{Failure, FrontDoor};

impl FrontDoor {
    /// Adds node `name` at `endpoint`.
    pub async fn add_node(
        &self,
        name: &str,
        endpoint: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Node, Failure> {
        let node = self.gateway.add_node(name, endpoint, labels).await;
        node.map_err(Failure::from)
    }

    /// The node `sel` names.
    pub fn get_node(&self, sel: &NodeSelector) -> Result<Node, Failure> {
        self.gateway.get_node(sel).map_err(Failure::from)
    }

    /// Every node.
    pub fn list_nodes(&self) -> Vec<Node> {
        self.gateway.list_nodes()
    }

    /// Cordons (`cordon`) or uncordons the node `sel` names.
    pub async fn cordon_node(&self, sel: &NodeSelector, cordon: bool) -> Result<Node, Failure> {
        let node = self.gateway.cordon_node(sel, cordon).await;
        node.map_err(Failure::from)
    }

    /// Cordons the node `sel` names and, when `stop`, stops its sandboxes: the node, how
    /// many were stopped and how many still run.
    pub async fn drain_node(
        &self,
        sel: &NodeSelector,
        stop: bool,
    ) -> Result<(Node, u32, u32), Failure> {
        let drained = self.gateway.drain_node(sel, stop).await;
        drained.map_err(Failure::from)
    }

    /// Removes the node `sel` names; whether there was one.
    pub async fn remove_node(&self, sel: &NodeSelector) -> Result<bool, Failure> {
        let removed = self.gateway.remove_node(sel).await;
        removed.map_err(Failure::from)
    }
}
