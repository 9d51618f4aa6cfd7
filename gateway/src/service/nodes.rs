//! `sbx.v1.NodeService`: the machines sandboxes run on, for a gateway-wide admin (the auth
//! layer's table, [`crate::auth::need`], says so before any of this runs). Every change is
//! audited.

use sbx_actors::NodeSelector;
use sbx_proto::v1::node_service_server::NodeService;
use sbx_proto::v1::{
    AddNodeRequest, CordonNodeRequest, DrainNodeRequest, DrainNodeResponse, GetNodeRequest,
    ListNodesRequest, ListNodesResponse, Node, NodeRef, RemoveNodeRequest, RemoveNodeResponse,
};
use tonic::{Request, Response, Status};
use uuid::Uuid;

use super::SbxService;
use super::status::actor_error_to_status;

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
        let node = self
            .gateway
            .add_node(&req.name, &req.endpoint, req.labels.into_iter().collect())
            .await
            .map_err(|e| actor_error_to_status(&e))?;
        Ok(Response::new(node))
    }

    async fn get_node(&self, request: Request<GetNodeRequest>) -> Result<Response<Node>, Status> {
        let sel = selector(request.into_inner().node)?;
        let node = self
            .gateway
            .get_node(&sel)
            .map_err(|e| actor_error_to_status(&e))?;
        Ok(Response::new(node))
    }

    async fn list_nodes(
        &self,
        _request: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        Ok(Response::new(ListNodesResponse {
            nodes: self.gateway.list_nodes(),
        }))
    }

    async fn cordon_node(
        &self,
        request: Request<CordonNodeRequest>,
    ) -> Result<Response<Node>, Status> {
        let req = request.into_inner();
        let sel = selector(req.node)?;
        let node = self
            .gateway
            .cordon_node(&sel, req.cordon)
            .await
            .map_err(|e| actor_error_to_status(&e))?;
        Ok(Response::new(node))
    }

    async fn drain_node(
        &self,
        request: Request<DrainNodeRequest>,
    ) -> Result<Response<DrainNodeResponse>, Status> {
        let req = request.into_inner();
        let sel = selector(req.node)?;
        let (node, stopped, running) = self
            .gateway
            .drain_node(&sel, req.stop)
            .await
            .map_err(|e| actor_error_to_status(&e))?;
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
        let removed = self
            .gateway
            .remove_node(&sel)
            .await
            .map_err(|e| actor_error_to_status(&e))?;
        Ok(Response::new(RemoveNodeResponse { removed }))
    }
}
