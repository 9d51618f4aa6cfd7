//! sbx-actors: the supervision tree of the sbx gateway, on ractor.
//!
//! ```text
//! GatewayRoot
//!  ├── Reconciler                    level-triggered sweep: store ⇄ drivers
//!  ├── WorkspaceSupervisor(ws-uuid)  one per workspace; owns its sandbox actors
//!  │    ├── SandboxActor(sb-uuid)    one per sandbox; the only writer of its record
//!  │    └── …
//!  └── …
//! ```
//!
//! [`Gateway`] is the API the gRPC layer calls.

mod api;
mod change_log;
mod config;
mod error;
mod events;
mod images;
pub mod journal;
mod lease;
pub mod lifecycle;
pub mod lifetime;
pub mod limits;
pub mod metrics;
pub mod nodes;
pub mod owned;
pub mod ownership;
mod protocol;
mod reconciler;
mod records;
mod root;
mod route;
mod sandbox;
mod scan;
mod startup;
pub mod stats;
pub mod supervision;
mod translate;
pub mod validate;
mod workspace;

pub use api::nodes::{LOCAL_RECORD, NodeSelector};
pub use api::{
    ActorStream, DEFAULT_PAGE_SIZE, ExecInputs, ExecOptions, ForwardInputs, Gateway, Listed,
    LogOptions, MAX_PAGE_SIZE, SandboxFilter, ServiceTarget,
};
pub use config::{Config, DEFAULT_IMAGE, DriverSet, LifetimeSettings, OwnershipSettings};
pub use error::{ActorError, ImageFailure, Result};
pub use images::{
    BUILD_CACHE_REPOSITORY, Built as BuiltImage, ImageScope, ImageSelector, Pruned as PrunedImages,
    RESERVED_PREFIX as IMAGE_RESERVED_PREFIX, Writer as ImageWriter, image_message,
    is_reserved as image_name_is_reserved, record_name as image_record_name,
    reserved as image_name_reserved,
};
pub use owned::sealer::Sealer;
pub use protocol::SweepReport;
pub use protocol::{SandboxMsg, WorkspaceMsg};
/// A copy's bytes, and the upload that makes them from a client stream (the driver
/// boundary's, passed through: bytes are bytes on both sides).
pub use sbx_driver_api::{ByteStream, upload};
pub use supervision::RestartPolicy;
pub use validate::{ProviderSelector, SandboxSelector, WorkspaceSelector};
