//! How `sbxd serve` reaches nodes: each registered node's `sbxd node` over TCP, with the
//! gateway's client certificate (mutual TLS) when it is given (`--node-tls-*`), as an
//! [`sbx_actors::nodes::NodeLink`] the actor layer places sandboxes on and calls. With an
//! image mirror, every create names it (see `sbx_drivers::remote::images`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use sbx_actors::nodes::{NodeDialer, NodeLink, NodeReport, NodeTiming};
use sbx_drivers::remote::RemoteDriver;
use sbx_drivers::remote::images::ImageSource;
use sbx_drivers::{ComputeDriver, DriverError};
use sbx_proto::v1::NodeCapacity;
use tonic::async_trait;
use uuid::Uuid;

use super::DaemonError;

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Nodes")]
pub struct NodeClientArgs {
    /// The CA that signed the nodes' certificates (PEM): calls to nodes go over TLS, checked
    /// against it. Without it, calls to nodes are plain TCP (which only a node on loopback
    /// with `--auth none` takes).
    #[arg(long, env = "SBX_NODE_TLS_CA", value_name = "PEM")]
    pub node_tls_ca: Option<PathBuf>,

    /// The gateway's client certificate for nodes (PEM; mutual TLS, which nodes off loopback
    /// require), with --node-tls-key. `sbxd certs init --client gateway` makes one.
    #[arg(long, env = "SBX_NODE_TLS_CERT", value_name = "PEM", requires_all = ["node_tls_key", "node_tls_ca"])]
    pub node_tls_cert: Option<PathBuf>,

    /// The key of --node-tls-cert (PEM).
    #[arg(
        long,
        env = "SBX_NODE_TLS_KEY",
        value_name = "PEM",
        requires = "node_tls_cert"
    )]
    pub node_tls_key: Option<PathBuf>,

    /// Seconds a node may stay silent before its sandboxes read as Unknown (they are left
    /// where they are, and are as they were once it answers).
    #[arg(long, env = "SBX_NODE_GRACE", value_name = "SECS", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub node_grace: u64,
}

impl NodeClientArgs {
    /// The dialer these flags describe, each call bounded by `call_timeout`; `gateway`: this
    /// gateway's id among those sharing a store, named in its fenced calls.
    pub fn dialer(
        &self,
        call_timeout: Duration,
        gateway: Option<Uuid>,
    ) -> Result<RemoteNodeDialer, DaemonError> {
        let tls = match &self.node_tls_ca {
            None => None,
            Some(ca) => {
                let identity = self
                    .node_tls_cert
                    .as_deref()
                    .zip(self.node_tls_key.as_deref());
                Some(
                    crate::tls::client_config(Some(ca), identity, None)
                        .map_err(|e| DaemonError::Setup(format!("--node-tls-*: {e}")))?,
                )
            }
        };
        Ok(RemoteNodeDialer {
            tls,
            call_timeout,
            gateway,
            image_source: None,
        })
    }

    pub fn timing(&self) -> NodeTiming {
        let grace = Duration::from_secs(self.node_grace);
        NodeTiming {
            probe_every: Duration::from_secs(2).min(grace / 2),
            ready_within: Duration::from_secs(5).min(grace),
            grace,
        }
    }
}

/// Dials nodes over TCP (TLS when configured).
pub struct RemoteNodeDialer {
    tls: Option<tonic::transport::ClientTlsConfig>,
    call_timeout: Duration,
    gateway: Option<Uuid>,
    /// The image mirror every create on a node names (`--image-mirror`).
    image_source: Option<Arc<ImageSource>>,
}

impl RemoteNodeDialer {
    /// Creates on nodes name `source`'s mirror as where to fetch an image the node lacks
    /// (`sbx_drivers::remote::images`).
    pub fn with_image_source(mut self, source: Option<Arc<ImageSource>>) -> Self {
        self.image_source = source;
        self
    }
}

impl NodeDialer for RemoteNodeDialer {
    fn dial(&self, endpoint: &str) -> Result<Arc<dyn NodeLink>, DriverError> {
        let mut driver =
            RemoteDriver::connect_tcp_lazy(endpoint, self.tls.clone(), self.call_timeout)?;
        if let Some(gateway) = self.gateway {
            driver = driver.as_gateway(gateway);
        }
        if let Some(source) = &self.image_source {
            driver = driver.with_image_source(Arc::clone(source));
        }
        Ok(Arc::new(RemoteNode {
            driver: Arc::new(driver),
        }))
    }
}

struct RemoteNode {
    driver: Arc<RemoteDriver>,
}

#[async_trait]
impl NodeLink for RemoteNode {
    fn driver(&self) -> Arc<dyn ComputeDriver> {
        self.driver.clone()
    }

    fn fenced(&self, workspace: Uuid, token: u64) -> Arc<dyn ComputeDriver> {
        Arc::new(self.driver.fenced(workspace, token))
    }

    async fn report(&self) -> Result<NodeReport, DriverError> {
        let info = self.driver.node_info().await?;
        let node_id = Uuid::parse_str(&info.node_id).map_err(|_| {
            DriverError::Internal(format!(
                "the node answered a malformed id {:?}",
                info.node_id
            ))
        })?;
        let capacity = info.capacity.unwrap_or_default();
        Ok(NodeReport {
            node_id,
            name: info.name,
            drivers: info.drivers,
            labels: info.labels.into_iter().collect(),
            capacity: NodeCapacity {
                cpu_millis: capacity.cpu_millicores,
                memory_bytes: capacity.memory_bytes,
                disk_bytes: capacity.disk_bytes,
                max_sandboxes: capacity.max_sandboxes,
            },
            sandboxes: info.sandboxes,
        })
    }
}
