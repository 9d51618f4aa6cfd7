//! Finding the actor that owns a workspace or a sandbox, by UUID, and calling it.
//!
//! The registries live in the supervisors (the root knows its workspace supervisors, each
//! supervisor knows its sandbox actors), never in ractor's global name registry, whose names
//! are freed only when an old actor is dropped and so race with restarts.
//!
//! A call rides out the restarts of the actor it is for: [`call_until`] is the one policy
//! every request follows. It asks where the actor is, calls it with what remains of one
//! deadline (a client's request: `Config::request_timeout`, 120 s by default), and when the
//! actor is restarting or died holding the request (the supervisor restarts it from its
//! record; every command is idempotent, so asking again is safe) it pauses and asks again —
//! 10 ms for a client's request ([`Patience::request`]), a backoff for a cascade delete. An
//! actor that died because its write met a full disk is answered at once (`DiskFull`), not
//! waited out.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{ActorRef, RpcReplyPort};
use sbx_storage::ObjectStore;
use uuid::Uuid;

use crate::config::Shared;
use crate::error::{ActorError, Result};
use crate::protocol::{RootMsg, Route, SandboxMsg, WorkspaceMsg};

/// How long a routing question may take; routing never waits behind a driver call.
pub(crate) const ROUTE_TIMEOUT: Duration = Duration::from_secs(10);

/// The pause between two attempts of a client's request: short, because what it waits for
/// (a restart from the record) takes milliseconds.
const REQUEST_PAUSE: Duration = Duration::from_millis(10);

#[derive(Clone)]
pub struct Router {
    pub(crate) root: ActorRef<RootMsg>,
    /// Whether a sandbox the tree does not know still has a record, and whether the disk is
    /// full. The store, not the shared context: `Gateway::shutdown` waits for every holder of
    /// that to let go, and the gateway holds its router for good.
    store: Arc<dyn ObjectStore>,
    /// The deadline of a call, restarts included.
    request_timeout: Duration,
    /// Gateways sharing a store: which workspaces this one holds (their fences). A call for
    /// one it does not hold is answered at once, naming the holder.
    held: Option<Arc<crate::nodes::Nodes>>,
    /// This gateway's id among those sharing the store.
    me: Option<Uuid>,
    /// Counts the commands sent to sandbox actors and not yet answered.
    metrics: Arc<crate::metrics::Metrics>,
}

/// How long a call waits for its actor, and how it paces its attempts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Patience {
    /// The deadline of the whole call, restarts included; each attempt is given what remains.
    pub timeout: Duration,
    /// The pause after attempt `n` (from 1) before the next.
    pub pause: fn(u32) -> Duration,
    /// Whether an error the actor answers is asked again until the deadline (a cascade delete,
    /// which keeps at it) rather than answered (a client's request: the error is the answer).
    pub retry_errors: bool,
}

impl Patience {
    /// A client's request: up to `timeout`, asking again every 10 ms; an error the actor
    /// answers is the answer.
    pub fn request(timeout: Duration) -> Patience {
        Patience {
            timeout,
            pause: |_| REQUEST_PAUSE,
            retry_errors: false,
        }
    }
}

impl Router {
    pub(crate) fn new(root: ActorRef<RootMsg>, shared: &Shared) -> Router {
        Router {
            root,
            store: Arc::clone(&shared.store),
            request_timeout: shared.config.request_timeout,
            held: shared
                .ownership
                .as_ref()
                .map(|_| Arc::clone(shared.drivers.nodes())),
            me: shared.ownership.as_ref().map(|o| o.gateway()),
            metrics: Arc::clone(&shared.config.metrics),
        }
    }

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

    /// Gateways sharing a store: `HeldElsewhere` naming the holder when this gateway does not
    /// hold `ws` (sbxd forwards the request there), `Unavailable` when nobody holds it yet.
    pub(crate) async fn refuse_unless_held(&self, ws: Uuid) -> Result<()> {
        let Some(nodes) = &self.held else {
            return Ok(());
        };
        if nodes.fence_of(ws).is_some() {
            return Ok(());
        }
        let holder = crate::ownership::holder_of(&*self.store, ws).await?;
        Err(match holder {
            // The lease still names this gateway, whose hold lapsed or was let go a moment
            // ago: being handed over (never forwarded to itself).
            Some((gateway, _)) if Some(gateway) == self.me => ActorError::Unavailable(format!(
                "workspace {ws} is being handed over between gateways; ask again"
            )),
            Some((gateway, address)) => ActorError::HeldElsewhere {
                workspace: ws,
                gateway,
                address,
            },
            None => ActorError::Unavailable(format!(
                "workspace {ws} is not served by any gateway yet; ask again"
            )),
        })
    }

    /// Sends a request to a workspace's supervisor and waits for its answer, riding out the
    /// supervisor's restarts. `None` when the workspace no longer has a supervisor (deleted).
    pub async fn call_workspace<R: Send + 'static>(
        &self,
        ws: Uuid,
        build: impl Fn(RpcReplyPort<Result<R>>) -> WorkspaceMsg,
    ) -> Result<Option<R>> {
        self.refuse_unless_held(ws).await?;
        call_until(
            ("workspace", ws),
            Patience::request(self.request_timeout),
            || self.workspace(ws),
            build,
            || self.refuse_between_attempts(ws),
        )
        .await
    }

    /// Sends a command to a sandbox's actor and waits for its answer, riding out the actor's
    /// restarts. `None` when the sandbox no longer exists (no actor, and no record).
    pub async fn call_sandbox<R: Send + 'static>(
        &self,
        ws: Uuid,
        id: Uuid,
        build: impl Fn(RpcReplyPort<Result<R>>) -> SandboxMsg,
    ) -> Result<Option<R>> {
        self.refuse_unless_held(ws).await?;
        let _in_flight = crate::metrics::InFlight::enter(&self.metrics.sandbox_commands_in_flight);
        let locate = || async move {
            match self.sandbox(ws, id).await? {
                // Not known to its supervisor, but recorded: being created or restarted.
                Route::Unknown if self.store.get(id).await?.is_some() => Ok(Route::Restarting),
                route => Ok(route),
            }
        };
        call_until(
            ("sandbox", id),
            Patience::request(self.request_timeout),
            locate,
            build,
            || self.refuse_between_attempts(ws),
        )
        .await
    }

    /// Refuses a lifecycle write up front while the store refuses writes for lack of space
    /// (checked now: one `statvfs`), so that no actor starts a step it cannot record, and a
    /// caller is answered at once instead of waiting out its deadline.
    pub fn refuse_if_disk_full(&self) -> Result<()> {
        match self.store.disk_full() {
            Some(full) => Err(full.into()),
            None => Ok(()),
        }
    }

    /// Between the attempts of a call: the full-disk check, and (gateways sharing a store)
    /// whether this gateway still holds `ws` — one whose call a node refused under its token
    /// lets it go at once, and a request riding out its actors' restarts is answered then.
    fn refuse_between_attempts(&self, ws: Uuid) -> Result<()> {
        self.refuse_if_disk_full()?;
        match &self.held {
            Some(nodes) if nodes.fence_of(ws).is_none() => Err(ActorError::Unavailable(format!(
                "this gateway no longer holds workspace {ws} (a node refused its token: another \
                 gateway holds it now); ask again"
            ))),
            _ => Ok(()),
        }
    }
}

/// Calls the actor `locate` finds until it answers, `locate` says it is gone
/// (`Route::Unknown`: `None`), or `patience.timeout` passes (`Unavailable`, naming `target`).
/// When the actor drops the request (it died holding it), `refuse` says whether to give up at
/// once — the full-disk check — or ask again.
pub(crate) async fn call_until<M, R, L, F>(
    target: (&str, Uuid),
    patience: Patience,
    mut locate: L,
    build: impl Fn(RpcReplyPort<Result<R>>) -> M,
    refuse: impl Fn() -> Result<()>,
) -> Result<Option<R>>
where
    M: ractor::Message,
    R: Send + 'static,
    L: FnMut() -> F,
    F: Future<Output = Result<Route<M>>>,
{
    let (what, id) = target;
    let timed_out = || {
        ActorError::Unavailable(format!(
            "{what} {id} did not answer within {:?}",
            patience.timeout
        ))
    };
    let deadline = tokio::time::Instant::now() + patience.timeout;
    let mut attempt = 0u32;
    loop {
        let failed = match locate().await? {
            Route::Actor(actor) => {
                let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
                match actor.call(&build, Some(remaining)).await {
                    Ok(CallResult::Success(Ok(r))) => return Ok(Some(r)),
                    Ok(CallResult::Success(Err(e))) => Some(e),
                    Ok(CallResult::Timeout) => return Err(timed_out()),
                    // The actor died while it held the request; its supervisor restarts it
                    // (a write that met a full disk in the middle answers that, at once).
                    Ok(CallResult::SenderError) | Err(_) => refuse().err(),
                }
            }
            // Between attempts the same checks: a workspace this gateway let go meanwhile (or
            // a full disk) is answered at once, not waited out.
            Route::Restarting => match refuse() {
                Err(e) => return Err(e),
                Ok(()) => None,
            },
            Route::Unknown => {
                refuse()?;
                return Ok(None);
            }
        };
        if let Some(e) = failed {
            if !patience.retry_errors {
                return Err(e);
            }
            tracing::info!("{what} {id} did not do it yet: {e}; asking again");
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(timed_out());
        }
        attempt += 1;
        tokio::time::sleep((patience.pause)(attempt)).await;
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
