//! The tonic service of sbxd: `sbx.v1` GatewayService, WorkspaceService, SandboxService,
//! ProviderService, SettingService, ServiceEndpointService, ImageService and IdentityService
//! over the actor API
//! ([`sbx_actors::Gateway`]), plus gRPC health and reflection.
//!
//! The handlers are thin: they turn a request into an actor-API call and its answer (or its
//! [`ActorError`](sbx_actors::ActorError), through [`status::actor_error_to_status`], the
//! one place errors become gRPC statuses) into a response. Streams (watch, exec, logs) are
//! forwarded by a task that ends them with `UNAVAILABLE` when sbxd shuts down, so that a
//! client following a stream never holds shutdown up.

mod access;
pub(crate) use access::audit;
mod identities;
mod images;
mod info;
mod mirror;
mod nodes;
mod providers;
mod sandboxes;
mod service_endpoints;
mod settings;
pub mod status;
mod streams;
mod workspaces;

use std::sync::Arc;

use sbx_actors::Gateway;
use sbx_actors::limits::{MAX_IMAGE_MESSAGE_BYTES, MAX_MESSAGE_BYTES};
use sbx_proto::v1::gateway_service_server::GatewayServiceServer;
use sbx_proto::v1::identity_service_server::IdentityServiceServer;
use sbx_proto::v1::image_service_server::ImageServiceServer;
use sbx_proto::v1::node_service_server::NodeServiceServer;
use sbx_proto::v1::provider_service_server::ProviderServiceServer;
use sbx_proto::v1::sandbox_service_server::SandboxServiceServer;
use sbx_proto::v1::service_endpoint_service_server::ServiceEndpointServiceServer;
use sbx_proto::v1::setting_service_server::SettingServiceServer;
use sbx_proto::v1::workspace_service_server::WorkspaceServiceServer;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

pub use mirror::ImageMirror;
pub use status::{ERROR_DOMAIN, actor_error_to_status};

/// The `sbx.v1` services over one actor tree.
#[derive(Clone)]
pub struct SbxService {
    gateway: Arc<Gateway>,
    /// Where the identities live (IdentityService), when the gateway keeps them.
    data_dir: Option<std::path::PathBuf>,
    /// Cancelled when sbxd begins to shut down: every open stream then ends with UNAVAILABLE,
    /// so that graceful shutdown does not wait for clients that follow a stream for ever.
    shutdown: CancellationToken,
    /// The image mirror (`--image-mirror`): pulls and imports are pushed to it, creates fetch
    /// from it what this gateway's store lacks.
    image_mirror: Option<Arc<ImageMirror>>,
}

impl SbxService {
    pub fn new(gateway: Arc<Gateway>, shutdown: CancellationToken) -> Self {
        SbxService {
            gateway,
            data_dir: None,
            shutdown,
            image_mirror: None,
        }
    }

    /// Pushes pulls and imports to `mirror`, and fetches from it what a create needs.
    pub fn with_image_mirror(mut self, mirror: Option<Arc<ImageMirror>>) -> Self {
        self.image_mirror = mirror;
        self
    }

    /// Serves IdentityService over the identities of data dir `dir`.
    pub fn with_identities(mut self, dir: &std::path::Path) -> Self {
        self.data_dir = Some(dir.to_path_buf());
        self
    }

    pub fn identity_server(&self) -> IdentityServiceServer<SbxService> {
        IdentityServiceServer::new(self.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    // The decode limits are the table's (`sbx_actors::limits`); a message over one is
    // RESOURCE_EXHAUSTED with reason REQUEST_TOO_LARGE (`status::ErrorInfoLayer`).

    pub fn workspace_server(&self) -> WorkspaceServiceServer<SbxService> {
        WorkspaceServiceServer::new(self.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn sandbox_server(&self) -> SandboxServiceServer<SbxService> {
        SandboxServiceServer::new(self.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn provider_server(&self) -> ProviderServiceServer<SbxService> {
        ProviderServiceServer::new(self.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn setting_server(&self) -> SettingServiceServer<SbxService> {
        SettingServiceServer::new(self.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn service_endpoint_server(&self) -> ServiceEndpointServiceServer<SbxService> {
        ServiceEndpointServiceServer::new(self.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn gateway_server(&self) -> GatewayServiceServer<SbxService> {
        GatewayServiceServer::new(self.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn node_server(&self) -> NodeServiceServer<SbxService> {
        NodeServiceServer::new(self.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn image_server(&self) -> ImageServiceServer<SbxService> {
        // An import chunk is at most 4 MiB (the CLI sends 1 MiB), plus its framing.
        ImageServiceServer::new(self.clone()).max_decoding_message_size(MAX_IMAGE_MESSAGE_BYTES)
    }
}

/// The service names the health service reports on, besides "" (the whole server).
pub const HEALTH_SERVICES: [&str; 9] = [
    sbx_proto::v1::gateway_service_server::SERVICE_NAME,
    sbx_proto::v1::workspace_service_server::SERVICE_NAME,
    sbx_proto::v1::sandbox_service_server::SERVICE_NAME,
    sbx_proto::v1::image_service_server::SERVICE_NAME,
    sbx_proto::v1::identity_service_server::SERVICE_NAME,
    sbx_proto::v1::provider_service_server::SERVICE_NAME,
    sbx_proto::v1::setting_service_server::SERVICE_NAME,
    sbx_proto::v1::service_endpoint_service_server::SERVICE_NAME,
    sbx_proto::v1::node_service_server::SERVICE_NAME,
];

/// Sets the health of "" and of every `sbx.v1` service at once.
pub async fn set_health(reporter: &HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    for name in HEALTH_SERVICES {
        reporter.set_service_status(name, status).await;
    }
}
