//! The front door: what every API of sbxd does for a call, whatever the transport — gRPC
//! (`grpc`), the E2B control plane and in-sandbox API (`e2b`), the routed service endpoints
//! (`routes`) — so that no transport does it a second time, and the doors cannot drift apart.
//!
//! A [`FrontDoor`] method takes the caller (authentication's outcome: a [`Caller`], made by
//! the transport from its own credential — a bearer token, an E2B key, a sandbox token) and
//! domain arguments, and answers a domain result or one [`Failure`] (a class, a reason, a
//! message and metadata: [`error`]). It alone owns:
//!
//! - **access** (`access`): the workspace a call is about, checked against the caller before
//!   the call acts; by name before the lookup (the answer is the same whether the object
//!   exists or not), by id after it (an object of a workspace the caller may not see is not
//!   found, word for word as an id nobody has);
//! - **audit**: the `sbx::audit` line of an allowed call that names its object;
//! - **hiding**: a scoped caller's not-found answers say nothing of other workspaces;
//! - **paging**: a scoped caller's page of a list across workspaces is filled from the pages
//!   it may see, so how many objects others have shows nowhere;
//! - **the classification of errors** ([`error`]): each transport maps a class once;
//! - **the adds of images** (`image_adds`): the spooled upload, the driving of a pull, an
//!   import or a build while its caller stays (cancelled when it leaves or is revoked), and
//!   the push to the image mirror;
//! - **the identities** (`identities`) of the data dir.
//!
//! An adapter (a tonic handler, an E2B route, the service endpoints' route) parses its request into domain arguments, calls
//! one front-door method and encodes the answer or the failure; it never names the actor API
//! (`Gateway`), the access checks or `audit` itself.

mod access;
mod data;
pub mod error;
pub mod forward;
mod identities;
mod image_adds;
#[cfg(test)]
mod image_adds_tests;
mod images;
mod info;
mod lifecycle;
mod mirror;
mod nodes;
mod providers;
pub mod routes;
mod sandboxes;
mod services;
mod settings;
mod workspaces;

use std::sync::Arc;

use sbx_actors::Gateway;

pub use access::{audit, hide, visible_page};
pub use data::FrontStream;
pub use error::{Class, Failure};
pub use identities::IdentityRequest;
pub use image_adds::{Built, NewBuild, NewImport, Pulled};
pub use lifecycle::{NewSandbox, SandboxChange};
pub use mirror::ImageMirror;
pub use providers::ProviderChange;
pub use sandboxes::{Call, ExecStream, Suspend, describe};
pub use workspaces::WorkspaceDefault;

use crate::auth::Caller;

/// The transport-free layer of sbxd over one actor tree (see the module docs).
#[derive(Clone)]
pub struct FrontDoor {
    gateway: Arc<Gateway>,
    /// The image mirror (`--image-mirror`): a create fetches from it what this gateway's
    /// store lacks, whatever door it came by.
    mirror: Option<Arc<mirror::ImageMirror>>,
    /// The other gateways of the store, when calls for a workspace held elsewhere are
    /// forwarded to its holder ([`forward`]).
    peers: Option<Arc<crate::daemon::forward::Peers>>,
    /// The data dir whose identities file the identity calls read and write
    /// ([`FrontDoor::with_identities`]); none, and they are unimplemented.
    data_dir: Option<std::path::PathBuf>,
}

impl FrontDoor {
    pub fn new(gateway: Arc<Gateway>) -> FrontDoor {
        FrontDoor {
            gateway,
            mirror: None,
            peers: None,
            data_dir: None,
        }
    }

    /// Fetches from `mirror` what a create needs and this gateway lacks.
    pub fn with_mirror(mut self, mirror: Option<Arc<mirror::ImageMirror>>) -> Self {
        self.mirror = mirror;
        self
    }

    /// Forwards calls for workspaces held elsewhere through `peers`.
    pub fn with_peers(mut self, peers: Option<Arc<crate::daemon::forward::Peers>>) -> Self {
        self.peers = peers;
        self
    }

    /// The actor API under the door, for the front door's tests: no door reaches it
    /// (`scripts/check-structure`).
    #[cfg(test)]
    fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// The failure of an actor error as `caller` may see it ([`hide`]).
    pub fn failure(caller: &Caller, err: sbx_actors::ActorError) -> Failure {
        Failure::from(hide(caller, err))
    }
}
