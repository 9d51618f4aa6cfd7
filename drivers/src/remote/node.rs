//! A node: a driver served over TCP (plain on loopback, or TLS, mutual for `sbxd node`) with
//! `sbx.driver.v1.Node` beside `sbx.driver.v1.Driver` on the same listener, so that gateways
//! on other machines run sandboxes on this one.
//!
//! [`serve_node`] serves both; the node's identity ([`NodeIdentity`]: its id, name, labels
//! and capacity) is fixed at start, and each `Node/Info` asks the driver how many sandboxes
//! it holds. What the command line checks (`--auth`, the TLS files, the node id file) is
//! `sbxd node`'s, in the gateway crate.
//!
//! Unlike the Unix socket's [`super::serve`], connections are served by tonic's server
//! (which terminates TLS): they are its tasks, not the serve future's. A shutdown stops
//! accepting, lets calls in flight finish for [`SHUTDOWN_GRACE`] and then stops the server;
//! what a connection still holds ends with the process.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

use super::SHUTDOWN_GRACE;
use super::fence::Fences;
use super::images::NodeImages;
use super::server::DriverService;
use super::status::driver_error_to_status;
use crate::pb::driver_server::DriverServer;
use crate::pb::node_server::{Node, NodeServer};
use crate::{ComputeDriver, DriverError, pb};

/// How many calls one client connection may have in flight (a gateway holds a watch, logs
/// and exec streams for many sandboxes on one connection).
const MAX_CONCURRENT_STREAMS: u32 = 1024;

/// How often an idle connection is pinged (HTTP/2 and TCP keepalive), and how long an HTTP/2
/// ping may go unanswered before the connection is closed: a gateway that vanished from the
/// network does not hold its streams open for ever.
const KEEPALIVE: Duration = Duration::from_secs(20);

/// What a node says of itself, fixed at its start (see `NodeInfo` in driver.proto).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeIdentity {
    /// The UUID kept in the node's state dir.
    pub node_id: String,
    pub name: String,
    /// The version of the node's sbxd.
    pub version: String,
    /// The registry names of the drivers it serves.
    pub drivers: Vec<String>,
    pub labels: HashMap<String, String>,
    pub capacity: pb::Capacity,
}

/// `sbx.driver.v1.Node`: the identity, and the driver's count of sandboxes.
struct NodeService {
    identity: NodeIdentity,
    driver: Arc<dyn ComputeDriver>,
    fences: Arc<Fences>,
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn info(
        &self,
        _: Request<pb::NodeInfoRequest>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        let listed = self
            .driver
            .list()
            .await
            .map_err(|e| driver_error_to_status(&e))?;
        let id = &self.identity;
        Ok(Response::new(pb::NodeInfo {
            node_id: id.node_id.clone(),
            name: id.name.clone(),
            version: id.version.clone(),
            drivers: id.drivers.clone(),
            labels: id.labels.clone(),
            capacity: Some(id.capacity),
            sandboxes: u32::try_from(listed.len()).unwrap_or(u32::MAX),
            fenced_calls: self.fences.refused(),
            token_conflicts: self.fences.conflicts(),
        }))
    }
}

/// Serves `driver` (`sbx.driver.v1.Driver`) and `identity` (`sbx.driver.v1.Node`) on
/// `listener` until `shutdown` resolves; over TLS with `tls` (mutual TLS when it names a
/// client CA: a client without a certificate signed by it fails its handshake). With
/// `images` (the node's own image store, which `driver` runs images from), a create's image
/// the store lacks is fetched first from the mirror the create names
/// ([`super::images`]).
///
/// After `shutdown`: the listener is closed at once, calls in flight get [`SHUTDOWN_GRACE`]
/// to finish, then the server is stopped. The driver's workloads are left as they are.
/// Dropping the returned future stops the server too.
pub async fn serve_node(
    driver: Arc<dyn ComputeDriver>,
    identity: NodeIdentity,
    fences: Arc<Fences>,
    images: Option<Arc<NodeImages>>,
    listener: TcpListener,
    tls: Option<ServerTlsConfig>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DriverError> {
    let local = listener
        .local_addr()
        .map_err(|e| DriverError::Internal(format!("the node's listener: {e}")))?;
    let mut builder = Server::builder()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE));
    let secure = tls.is_some();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(|e| DriverError::InvalidArgument(format!("the node's TLS: {e}")))?;
    }
    let check = Arc::clone(&fences);
    let router = builder
        .add_service(DriverServer::with_interceptor(
            DriverService {
                driver: Arc::clone(&driver),
                images,
            },
            move |request: Request<()>| {
                check.check(request.metadata())?;
                Ok(request)
            },
        ))
        .add_service(NodeServer::new(NodeService {
            identity,
            driver,
            fences,
        }));
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(KEEPALIVE));
    let stopping = CancellationToken::new();
    let mut server = AbortOnDrop(tokio::spawn(
        router.serve_with_incoming_shutdown(incoming, stopping.clone().cancelled_owned()),
    ));
    tracing::debug!(listen = %local, tls = secure, "node serving");
    tokio::pin!(shutdown);
    let ended = tokio::select! {
        () = &mut shutdown => None,
        ended = &mut server.0 => Some(ended),
    };
    let ended = match ended {
        Some(ended) => ended,
        None => {
            stopping.cancel();
            match tokio::time::timeout(SHUTDOWN_GRACE, &mut server.0).await {
                Ok(ended) => ended,
                Err(_) => {
                    tracing::warn!("calls still in flight after the shutdown grace; cut");
                    server.0.abort();
                    Ok(Ok(()))
                }
            }
        }
    };
    tracing::debug!(listen = %local, "node stopped");
    match ended {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(DriverError::Unavailable(format!(
            "the node's server failed: {e}"
        ))),
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => Err(DriverError::Internal(format!(
            "the node's server task: {e}"
        ))),
    }
}

/// A server task, aborted when its owner (the serve future) is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
