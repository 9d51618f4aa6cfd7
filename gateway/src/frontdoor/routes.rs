//! Requests routed to a sandbox's port by HTTP, not by an API call: a service endpoint's
//! (`NAME--SANDBOX--WORKSPACE.<domain>`, `sbx service expose`), which nobody authenticates,
//! and an E2B `E2b-Sandbox-Port` one, whose caller the sandbox's access token names.
//!
//! The front door decides what such a request may do to a paused sandbox: a caller's resumes
//! it as the caller's own use would (`auto_resume`); an unauthenticated one only as the
//! sandbox's `wake_on_request` allows. Another gateway of the store holding the sandbox is a
//! `Class::Elsewhere` failure, never forwarded: the door answers it without naming the
//! holder.

use sbx_actors::{ActorError, ForwardInputs, SandboxSelector, ServiceTarget};
use sbx_proto::v1::PortForwardOutput;
use uuid::Uuid;

use super::data::front_stream;
use super::{Failure, FrontDoor, FrontStream};
use crate::auth::Caller;

/// The reason of a [`route_service`](FrontDoor::route_service) failure for a Host under
/// another domain than the gateway's service domain (class `Class::NotFound`).
pub const MISDIRECTED: &str = "HOST_NOT_UNDER_DOMAIN";

impl FrontDoor {
    /// The endpoint a request's Host names, read from the store now: its sandbox's **id** and
    /// port (a sandbox made again under the same name has no endpoint until one is exposed for
    /// it). No caller: service endpoints are not authenticated. A Host naming no endpoint is
    /// `Class::NotFound` (reason [`MISDIRECTED`] when it is under another domain), one two
    /// endpoints could answer `Class::FailedPrecondition`.
    pub async fn route_service(&self, host: &str) -> Result<ServiceTarget, Failure> {
        let routed = self.gateway.route_service_host(host).await;
        routed.map_err(route_failure)
    }

    /// A connection to `port` of the sandbox `sandbox_id`, for an HTTP request routed there:
    /// `by` a caller (a paused sandbox resumes as at any use of the caller's), or by nobody
    /// authenticated (it wakes only as its `wake_on_request` allows). The caller's access is
    /// the door's credential for this one sandbox (the E2B sandbox token), checked before.
    pub async fn forward_request(
        &self,
        by: Option<&Caller>,
        sandbox_id: Uuid,
        port: u32,
        input: ForwardInputs,
    ) -> Result<FrontStream<PortForwardOutput>, Failure> {
        let sel = SandboxSelector::Id(sandbox_id);
        let opened = match by {
            Some(_) => self.gateway.port_forward(&sel, port, input).await,
            None => self.gateway.routed_forward(&sel, port, input).await,
        };
        let output = opened.map_err(|e| match by {
            Some(caller) => FrontDoor::failure(caller, e),
            None => Failure::from(e),
        })?;
        Ok(front_stream(output))
    }
}

/// The failure of a Host that routes nowhere: the actor's, its reason [`MISDIRECTED`] when the
/// Host is under another domain.
pub(crate) fn route_failure(err: ActorError) -> Failure {
    let misdirected = matches!(
        &err,
        ActorError::ObjectNotFound { what, .. } if what.contains("not under")
    );
    let mut failure = Failure::from(err);
    if misdirected {
        failure.reason = MISDIRECTED.to_string();
    }
    failure
}
