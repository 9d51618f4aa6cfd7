//! The tonic service of sbxd: `sbx.v1` GatewayService, WorkspaceService, SandboxService,
//! ProviderService, SettingService, ServiceEndpointService, ImageService and IdentityService,
//! plus gRPC health and reflection.
//!
//! The handlers are adapters over the front door ([`crate::frontdoor`]): each takes the
//! caller, parses its request into domain arguments, calls one front-door method and encodes
//! the answer or maps the [`Failure`](crate::frontdoor::Failure) ([`status::status_of`], the
//! one place failures become gRPC statuses). Access, audit, hiding and paging are the door's
//! (`scripts/check-structure` fails on a handler that does them itself). Streams (watch, exec,
//! logs, a pull's progress, a build's output) are forwarded by a task that ends them with `UNAVAILABLE` when sbxd shuts down, so
//! that a client following a stream never holds shutdown up.

mod identities;
mod image_adds;
mod images;
mod info;
mod nodes;
mod providers;
mod sandboxes;
mod service_endpoints;
mod settings;
pub mod status;
mod streams;
mod workspaces;

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

use crate::frontdoor::FrontDoor;
pub use crate::frontdoor::ImageMirror;
pub use status::{ERROR_DOMAIN, actor_error_to_status};

/// The `sbx.v1` services over one actor tree.
#[derive(Clone)]
pub struct SbxService {
    /// The transport-free layer every handler calls (access, audit, hiding, errors, the
    /// image mirror, the identities), shared with the other doors.
    front: FrontDoor,
    /// Cancelled when sbxd begins to shut down: every open stream then ends with UNAVAILABLE,
    /// so that graceful shutdown does not wait for clients that follow a stream for ever.
    shutdown: CancellationToken,
}

impl SbxService {
    /// The services over `front` (shared with the other doors: its mirror, peers and
    /// identities included); their streams end when `shutdown` is cancelled.
    pub fn new(front: FrontDoor, shutdown: CancellationToken) -> Self {
        SbxService { front, shutdown }
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
