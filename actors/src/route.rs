//! Finding the actor that owns a workspace or a sandbox, by UUID.
//!
//! The registries live in the supervisors (the root knows its workspace supervisors, each
//! supervisor knows its sandbox actors), never in ractor's global name registry, whose names
//! are freed only when an old actor is dropped and so race with restarts.

use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{ActorRef, RpcReplyPort};
use uuid::Uuid;

use crate::error::{ActorError, Result};
use crate::root::RootMsg;
use crate::sandbox::SandboxMsg;
use crate::workspace::WorkspaceMsg;

/// Where a request for one UUID goes.
pub enum Route<M> {
    Actor(ActorRef<M>),
    /// The actor failed and its supervisor restarts it; ask again shortly.
    Restarting,
    /// Nobody owns this UUID (it was deleted, or never existed).
    Unknown,
}

/// How long a routing question may take; routing never waits behind a driver call.
const ROUTE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct Router {
    pub(crate) root: ActorRef<RootMsg>,
}

impl Router {
    pub async fn workspace(&self, ws: Uuid) -> Result<Route<WorkspaceMsg>> {
        ask(&self.root, |reply| RootMsg::Route { id: ws, reply }).await
    }

    pub async fn sandbox(&self, ws: Uuid, id: Uuid) -> Result<Route<SandboxMsg>> {
        match self.workspace(ws).await? {
            Route::Actor(sup) => match sup
                .call(
                    |reply| WorkspaceMsg::Route { id, reply },
                    Some(ROUTE_TIMEOUT),
                )
                .await
            {
                Ok(CallResult::Success(route)) => Ok(route),
                // The supervisor went away while we asked: it is being restarted.
                _ => Ok(Route::Restarting),
            },
            Route::Restarting => Ok(Route::Restarting),
            Route::Unknown => Ok(Route::Unknown),
        }
    }
}

/// Asks an actor and waits for its answer; an actor that is gone is `Unavailable`.
pub async fn ask<M, R>(actor: &ActorRef<M>, build: impl FnOnce(RpcReplyPort<R>) -> M) -> Result<R>
where
    M: ractor::Message,
    R: Send + 'static,
{
    match actor.call(build, Some(ROUTE_TIMEOUT)).await {
        Ok(CallResult::Success(r)) => Ok(r),
        Ok(CallResult::Timeout) => Err(ActorError::Unavailable(
            "the gateway's actor tree did not answer in time".into(),
        )),
        Ok(CallResult::SenderError) | Err(_) => Err(ActorError::Unavailable(
            "the gateway's actor tree is shutting down".into(),
        )),
    }
}
