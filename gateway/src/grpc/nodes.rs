//! `sbx.v1.NodeService`: the machines sandboxes run on, for a gateway-wide admin (the auth
//! layer's table, [`crate::auth::need`], says so before any of this runs); adapters over the
//! front door's nodes.

use sbx_actors::NodeSelector;
use sbx_proto::v1::node_service_server::NodeService;
use sbx_proto::v1::{
    AddNodeRequest, CordonNodeRequest, DrainNodeRequest, DrainNodeResponse, GetNodeRequest,
    ListNodesRequest, ListNodesResponse, Node, NodeRef, RemoveNodeRequest, RemoveNodeResponse,
};
use tonic::{Request, Response, Status};
use uuid::Uuid;

use super::SbxService;
use super::status::failed;

/// The node a request names: by id when set (a malformed one is INVALID_ARGUMENT), else by
/// name.
fn selector(node: Option<NodeRef>) -> Result<NodeSelector, Status> {
    let node = node.unwrap_or_default();
    if !node.id.is_empty() {
        return Uuid::parse_str(&node.id)
            .map(NodeSelector::Id)
            .map_err(|_| Status::invalid_argument(format!("node id {:?} is not a UUID", node.id)));
    }
    if node.name.is_empty() {
        return Err(Status::invalid_argument("name the node (its name or id)"));
    }
    Ok(NodeSelector::Name(node.name))
}

#[tonic::async_trait]
impl NodeService for SbxService {
    async fn add_node(&self, request: Request<AddNodeRequest>) -> Result<Response<Node>, Status> {
        let req = request.into_inner();
        let labels = req.labels.into_iter().collect();
        let node = self.front.add_node(&req.name, &req.endpoint, labels).await;
        let node = node.map_err(failed)?;
        Ok(Response::new(node))
    }

    async fn get_node(&self, request: Request<GetNodeRequest>) -> Result<Response<Node>, Status> {
        let sel = selector(request.into_inner().node)?;
        let node = self.front.get_node(&sel).map_err(failed)?;
        Ok(Response::new(node))
    }

    async fn list_nodes(
        &self,
        _request: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        Ok(Response::new(ListNodesResponse {
            nodes: self.front.list_nodes(),
        }))
    }

    async fn cordon_node(
        &self,
        request: Request<CordonNodeRequest>,
    ) -> Result<Response<Node>, Status> {
        let req = request.into_inner();
        let sel = selector(req.node)?;
        let node = self.front.cordon_node(&sel, req.cordon).await;
        let node = node.map_err(failed)?;
        Ok(Response::new(node))
    }

    async fn drain_node(
        &self,
        request: Request<DrainNodeRequest>,
    ) -> Result<Response<DrainNodeResponse>, Status> {
        let req = request.into_inner();
        let sel = selector(req.node)?;
        let drained = self.front.drain_node(&sel, req.stop).await;
        let (node, stopped, running) = drained.map_err(failed)?;
        Ok(Response::new(DrainNodeResponse {
            node: Some(node),
            stopped,
            running,
        }))
    }

    async fn remove_node(
        &self,
        request: Request<RemoveNodeRequest>,
    ) -> Result<Response<RemoveNodeResponse>, Status> {
        let sel = selector(request.into_inner().node)?;
        let removed = self.front.remove_node(&sel).await.map_err(failed)?;
        Ok(Response::new(RemoveNodeResponse { removed }))
    }
}
