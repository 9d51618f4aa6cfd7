//! The workspace supervisor: owns the sandbox actors of one workspace.
//!
//! Creating a sandbox and deleting the workspace both pass through its mailbox, so they cannot
//! interleave: once deletion has begun (`Terminating`, persisted) every create is refused, and a
//! create accepted before it is finished before the deletion looks at what remains.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use sbx_driver_api::pb;
use sbx_proto::v1::{DesiredState, EventType, Phase, Sandbox, SandboxSpec, WorkspacePhase};
use sbx_storage::{Kind, LabelSelector, Scope, StoreError};
use uuid::Uuid;

use crate::config::Shared;
use crate::error::{ActorError, Result, disk_full_in};
use crate::protocol::{Route, SandboxMsg, WorkspaceMsg};
use crate::records::{StoredSandbox, StoredWorkspace, new_sandbox_record};
use crate::route::{Patience, ROUTE_TIMEOUT, call_until};
use crate::sandbox::{DELETED, SandboxActor, SandboxArgs};
use crate::scan::all_records;
use crate::supervision::{ChildEnd, RestartDecision, RestartHistory, backoff, child_end};

pub struct WorkspaceSupervisor;

pub struct WorkspaceArgs {
    pub id: Uuid,
    pub shared: Arc<Shared>,
    pub report_attach: bool,
}

/// How often a sandbox actor that ended while this gateway's hold on the workspace was off
/// is looked at again (gateways sharing a store).
const HOLD_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

pub struct WorkspaceState {
    shared: Arc<Shared>,
    ws: StoredWorkspace,
    children: HashMap<Uuid, Child>,
    /// Which sandbox a supervision event is about.
    by_actor: HashMap<ActorId, Uuid>,
    /// Callers waiting for the deletion in progress.
    pending_deletes: Vec<RpcReplyPort<Result<bool>>>,
    cascade_running: bool,
    cascade_rounds: u32,
    report_attach: bool,
}

struct Child {
    /// None while the actor is being restarted.
    actor: Option<ActorRef<SandboxMsg>>,
    history: RestartHistory,
}

impl Actor for WorkspaceSupervisor {
    type Msg = WorkspaceMsg;
    type State = WorkspaceState;
    type Arguments = WorkspaceArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<WorkspaceMsg>,
        args: WorkspaceArgs,
    ) -> Result<WorkspaceState, ActorProcessingErr> {
        let record = args
            .shared
            .store
            .get(args.id)
            .await?
            .ok_or_else(|| format!("workspace {} has no record", args.id))?;
        Ok(WorkspaceState {
            ws: StoredWorkspace::from_record(record)?,
            shared: args.shared,
            children: HashMap::new(),
            by_actor: HashMap::new(),
            pending_deletes: Vec::new(),
            cascade_running: false,
            cascade_rounds: 0,
            report_attach: args.report_attach,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
    ) -> Result<(), ActorProcessingErr> {
        let ids = sandbox_ids(&st.shared, st.ws.id()).await?;
        let report = std::mem::take(&mut st.report_attach);
        if report {
            st.shared.startup.add(ids.len());
        }
        for id in ids {
            st.children.insert(
                id,
                Child {
                    actor: None,
                    history: RestartHistory::default(),
                },
            );
            if !self.spawn_child(&myself, st, id, report).await && report {
                st.shared.startup.attached();
            }
        }
        if report {
            st.shared.startup.attached();
        }
        if st.ws.workspace.phase() == WorkspacePhase::Terminating {
            tracing::info!(workspace = %st.ws.workspace.name, "resuming the deletion of a terminating workspace");
            self.start_cascade(&myself, st, Duration::ZERO).await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<WorkspaceMsg>,
        msg: WorkspaceMsg,
        st: &mut WorkspaceState,
    ) -> Result<(), ActorProcessingErr> {
        let result = self.handle_msg(myself, msg, st).await;
        match result {
            Err(e) if disk_full_in(&e).is_some() => {
                // Not written, so not so: the workspace stays as its record says (a deletion
                // not begun), the supervisor and its children alive. A caller whose reply went
                // with the message is answered DiskFull by `Gateway`.
                st.ws = StoredWorkspace::from_record(st.ws.record.clone())?;
                tracing::warn!(workspace = %st.ws.workspace.name, error = %e, "a workspace write was not made: the store's disk is full");
                Ok(())
            }
            other => other,
        }
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<WorkspaceMsg>,
        evt: SupervisionEvent,
        st: &mut WorkspaceState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, failure) = match child_end(evt, DELETED) {
            Some(ChildEnd::Deleted(cell)) => {
                if let Some(id) = st.by_actor.remove(&cell.get_id())
                    && current_actor_is(st, id, &cell)
                {
                    st.children.remove(&id);
                }
                return Ok(());
            }
            Some(ChildEnd::Abnormal(cell, what)) => (cell, what),
            None => return Ok(()),
        };
        let Some(id) = st.by_actor.remove(&cell.get_id()) else {
            return Ok(());
        };
        if !current_actor_is(st, id, &cell) {
            // An older incarnation: a newer actor already serves this sandbox.
            return Ok(());
        }
        let ws = st.ws.id();
        if st.shared.ownership.is_some() && st.shared.drivers.nodes().fence_of(ws).is_none() {
            // This gateway let the workspace go (a node refused its token, or its lease was
            // not renewed): nothing of it restarts here; the root stops this supervisor.
            tracing::warn!(sandbox = %id, workspace = %st.ws.workspace.name, "sandbox actor {failure}; not restarted: this gateway no longer holds the workspace");
            if let Some(child) = st.children.get_mut(&id) {
                child.actor = None;
            }
            // Looked at again in a while: a hold that lapsed for a moment and was renewed
            // gets its actor back; a workspace let go has its supervisor stopped first.
            myself.send_after(HOLD_RECHECK, move || WorkspaceMsg::RespawnChild(id));
            return Ok(());
        }
        tracing::warn!(sandbox = %id, workspace = %st.ws.workspace.name, "sandbox actor {failure}; restarting it from its record");
        st.shared.config.metrics.actor_restarted("sandbox");
        self.child_down(&myself, st, id)
    }
}

impl WorkspaceSupervisor {
    async fn handle_msg(
        &self,
        myself: ActorRef<WorkspaceMsg>,
        msg: WorkspaceMsg,
        st: &mut WorkspaceState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WorkspaceMsg::CreateSandbox {
                name,
                spec,
                stopped,
                providers,
                node,
                reply,
            } => {
                let (node_id, node) = node;
                // A ttl counts from creation.
                let ttl = spec.lifetime.as_ref().map_or(0, |l| l.ttl_seconds);
                let expires_at =
                    crate::lifetime::after(std::time::SystemTime::now(), ttl).map(Into::into);
                let sandbox = Sandbox {
                    name,
                    node,
                    node_id: node_id.map(|id| id.to_string()).unwrap_or_default(),
                    spec: Some(spec),
                    generation: 1,
                    expires_at,
                    ..Default::default()
                };
                let result = self
                    .create_sandbox(&myself, st, sandbox, stopped, providers)
                    .await;
                let _ = reply.send(result);
            }
            WorkspaceMsg::Route { id, reply } => {
                let route = match st.children.get(&id) {
                    Some(Child { actor: Some(a), .. }) => Route::Actor(a.clone()),
                    Some(Child { actor: None, .. }) => Route::Restarting,
                    None => Route::Unknown,
                };
                let _ = reply.send(route);
            }
            WorkspaceMsg::Children(reply) => {
                let _ = reply.send(st.children.keys().copied().collect());
            }
            WorkspaceMsg::CreateProvider { record, reply } => {
                let result = if st.ws.workspace.phase() == WorkspacePhase::Terminating {
                    Err(ActorError::WorkspaceTerminating(
                        st.ws.workspace.name.clone(),
                    ))
                } else {
                    let name = record.name.clone();
                    st.shared.store.create(record).await.map_err(|e| match e {
                        StoreError::AlreadyExists { existing, .. } => ActorError::NameTaken {
                            kind: "provider",
                            name,
                            scope: format!(" in workspace {:?}", st.ws.workspace.name),
                            existing: existing.to_string(),
                        },
                        other => other.into(),
                    })
                };
                let _ = reply.send(result);
            }
            WorkspaceMsg::SetDefaultNetwork { policy, reply } => {
                let result =
                    Self::update_workspace(st, |w| w.default_network = policy.clone()).await?;
                let _ = reply.send(result);
            }
            WorkspaceMsg::SetDefaultResources { resources, reply } => {
                let result =
                    Self::update_workspace(st, |w| w.default_resources = resources).await?;
                let _ = reply.send(result);
            }
            WorkspaceMsg::SetDefaultLifetime { lifetime, reply } => {
                let result =
                    Self::update_workspace(st, move |w| w.default_lifetime = lifetime).await?;
                let _ = reply.send(result);
            }
            WorkspaceMsg::Supervise(id) => self.supervise(&myself, st, id).await,
            WorkspaceMsg::Delete { cascade, reply } => {
                self.delete(&myself, st, cascade, reply).await?
            }
            WorkspaceMsg::CascadeFinished => {
                st.cascade_running = false;
                self.finish_delete(&myself, st).await?;
            }
            WorkspaceMsg::RespawnChild(id) => {
                if st.children.get(&id).is_some_and(|c| c.actor.is_none()) {
                    if st.shared.ownership.is_some()
                        && st.shared.drivers.nodes().fence_of(st.ws.id()).is_none()
                    {
                        myself.send_after(HOLD_RECHECK, move || WorkspaceMsg::RespawnChild(id));
                    } else {
                        self.spawn_child(&myself, st, id, false).await;
                    }
                }
            }
            WorkspaceMsg::Adopt {
                driver,
                snapshot,
                reply,
            } => {
                let result = self.adopt(&myself, st, driver, snapshot).await;
                let _ = reply.send(result);
            }
        }
        Ok(())
    }

    /// Spawns the actor of sandbox `id`; false when it could not start (a restart is then
    /// scheduled, unless the sandbox no longer exists).
    async fn spawn_child(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
        id: Uuid,
        report_attach: bool,
    ) -> bool {
        let args = SandboxArgs {
            id,
            shared: Arc::clone(&st.shared),
            report_attach,
        };
        match Actor::spawn_linked(None, SandboxActor, args, myself.get_cell()).await {
            Ok((actor, _)) => {
                st.by_actor.insert(actor.get_id(), id);
                if let Some(child) = st.children.get_mut(&id) {
                    child.actor = Some(actor);
                } else {
                    st.children.insert(
                        id,
                        Child {
                            actor: Some(actor),
                            history: RestartHistory::default(),
                        },
                    );
                }
                true
            }
            Err(e) => {
                match st.shared.store.get(id).await {
                    Ok(None) => {
                        st.children.remove(&id);
                    }
                    _ => {
                        tracing::warn!(sandbox = %id, "sandbox actor did not start: {e}; retrying");
                        // A spawn fails when the previous actor still holds the lease or the
                        // store is briefly unavailable: wait longer than a plain restart.
                        let delay = backoff(
                            st.shared.config.sandbox_restarts.base_backoff,
                            st.shared.config.sandbox_restarts.max_backoff,
                            3,
                        );
                        myself.send_after(delay, move || WorkspaceMsg::RespawnChild(id));
                    }
                }
                false
            }
        }
    }

    /// Registers sandbox `id` as a child with no restart history and spawns its actor.
    async fn start_new_child(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
        id: Uuid,
    ) {
        st.children.insert(
            id,
            Child {
                actor: None,
                history: RestartHistory::default(),
            },
        );
        self.spawn_child(myself, st, id, false).await;
    }

    /// Changes the workspace's record by `change` and writes it (put back as it was when the
    /// write is refused); refused while the workspace terminates. The outer error is the
    /// actor's own (a written record it cannot read back).
    async fn update_workspace(
        st: &mut WorkspaceState,
        change: impl FnOnce(&mut sbx_proto::v1::Workspace),
    ) -> std::result::Result<Result<sbx_proto::v1::Workspace>, ActorProcessingErr> {
        if st.ws.workspace.phase() == WorkspacePhase::Terminating {
            return Ok(Err(ActorError::WorkspaceTerminating(
                st.ws.workspace.name.clone(),
            )));
        }
        let before = st.ws.workspace.clone();
        change(&mut st.ws.workspace);
        match st.shared.store.update(st.ws.to_update()).await {
            Ok(written) => {
                st.ws = StoredWorkspace::from_record(written)?;
                Ok(Ok(st.ws.workspace.clone()))
            }
            Err(e) => {
                st.ws.workspace = before;
                Ok(Err(e.into()))
            }
        }
    }

    /// Starts an actor for sandbox `id` if its record is in this workspace and no actor of
    /// this supervisor serves it (read again here: a record deleted since it was seen is left).
    async fn supervise(&self, myself: &ActorRef<WorkspaceMsg>, st: &mut WorkspaceState, id: Uuid) {
        if st.children.contains_key(&id) {
            return;
        }
        match st.shared.store.get(id).await {
            Ok(Some(record))
                if record.kind == Kind::Sandbox && record.workspace == Some(st.ws.id()) =>
            {
                tracing::warn!(sandbox = %id, workspace = %st.ws.workspace.name, "a sandbox record had no actor (written by a create that outlived its supervisor); starting one");
                self.start_new_child(myself, st, id).await;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(sandbox = %id, workspace = %st.ws.workspace.name, "cannot read the record of an unsupervised sandbox: {e}; the next sweep asks again")
            }
        }
    }

    fn child_down(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
        id: Uuid,
    ) -> Result<(), ActorProcessingErr> {
        let policy = st.shared.config.sandbox_restarts;
        let Some(child) = st.children.get_mut(&id) else {
            return Ok(());
        };
        child.actor = None;
        match child.history.on_failure(&policy, Instant::now()) {
            RestartDecision::RestartAfter(delay) => {
                myself.send_after(delay, move || WorkspaceMsg::RespawnChild(id));
                Ok(())
            }
            RestartDecision::Escalate => Err(format!(
                "sandbox actor {id} restarted more than {} times in {:?}; escalating",
                policy.max_restarts, policy.window
            )
            .into()),
        }
    }

    async fn create_sandbox(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
        mut sandbox: Sandbox,
        stopped: bool,
        providers: Vec<Uuid>,
    ) -> Result<Sandbox> {
        sandbox.set_desired_state(if stopped {
            DesiredState::Stopped
        } else {
            DesiredState::Running
        });
        self.add_sandbox(myself, st, Uuid::new_v4(), sandbox, &providers)
            .await
    }

    async fn adopt(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
        driver: String,
        snap: pb::Snapshot,
    ) -> Result<Sandbox> {
        let id = sbx_driver_api::parse_sandbox_id(&snap.sandbox_id)?;
        // `driver` is where the reconciler found it: a local driver, or a node.
        let nodes = st.shared.drivers.nodes();
        let (driver, node_id, node) = match crate::nodes::node_of_place(&driver) {
            Some(node) => (
                nodes.driver_of_node(node).unwrap_or_default(),
                node.to_string(),
                nodes.name_of(Some(node)).unwrap_or_default(),
            ),
            None => (driver, String::new(), crate::nodes::LOCAL.to_string()),
        };
        let sandbox = Sandbox {
            name: snap.name.clone(),
            node,
            node_id,
            spec: Some(SandboxSpec {
                driver,
                ..Default::default()
            }),
            generation: snap.generation,
            reason: "Adopted".into(),
            message: "found running in the driver without a record; adopted (its spec is unknown)"
                .into(),
            ..Default::default()
        };
        self.add_sandbox(myself, st, id, sandbox, &[]).await
    }

    /// Writes a new sandbox record (Provisioning; wanted running unless `sandbox` says
    /// stopped) in this workspace, attaches `providers`, and spawns its actor (so its first
    /// start has their credentials). Refused while the workspace is terminating; a provider
    /// gone meanwhile undoes the create.
    async fn add_sandbox(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
        id: Uuid,
        mut sandbox: Sandbox,
        providers: &[Uuid],
    ) -> Result<Sandbox> {
        if st.ws.workspace.phase() == WorkspacePhase::Terminating {
            return Err(ActorError::WorkspaceTerminating(
                st.ws.workspace.name.clone(),
            ));
        }
        sandbox.workspace = st.ws.workspace.name.clone();
        sandbox.workspace_id = st.ws.id().to_string();
        if sandbox.desired_state() != DesiredState::Stopped {
            sandbox.set_desired_state(DesiredState::Running);
        }
        sandbox.set_phase(Phase::Provisioning);
        let record = st
            .shared
            .store
            .create(new_sandbox_record(id, st.ws.id(), &sandbox))
            .await
            .map_err(|e| match e {
                StoreError::AlreadyExists { existing, .. } => ActorError::NameTaken {
                    kind: "sandbox",
                    name: sandbox.name.clone(),
                    scope: format!(" in workspace {:?}", st.ws.workspace.name),
                    existing: existing.to_string(),
                },
                StoreError::WorkspaceNotFound { .. } => {
                    ActorError::WorkspaceNotFound(format!("{:?}", st.ws.workspace.name))
                }
                other => other.into(),
            })?;
        for provider in providers {
            if let Err(e) =
                crate::owned::attach(st.shared.store.as_ref(), st.ws.id(), id, *provider).await
            {
                // Nothing ran yet: the record (and any attachment made) goes, and the create
                // answers why.
                if let Err(undo) = st.shared.store.delete(id, record.resource_version).await {
                    tracing::warn!(sandbox = %id, error = %undo, "could not undo a create whose provider was gone; the reconciler's supervision picks it up");
                }
                return Err(e);
            }
        }
        let stored = StoredSandbox::from_record(record)?;
        st.shared
            .events
            .publish(EventType::Added, stored.sandbox.clone());
        self.start_new_child(myself, st, id).await;
        Ok(stored.sandbox)
    }

    async fn delete(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
        cascade: bool,
        reply: RpcReplyPort<Result<bool>>,
    ) -> Result<(), ActorProcessingErr> {
        if st.ws.workspace.phase() == WorkspacePhase::Terminating {
            // A deletion is already under way; this caller waits for it too.
            st.pending_deletes.push(reply);
            return Ok(());
        }
        let blockers = match blockers(&st.shared, &st.ws).await {
            Ok(b) => b,
            Err(e) => {
                let _ = reply.send(Err(e));
                return Ok(());
            }
        };
        let remaining = blockers.len();
        if remaining > 0 && !cascade {
            let _ = reply.send(Err(ActorError::WorkspaceNotEmpty {
                name: st.ws.workspace.name.clone(),
                remaining,
                blockers,
            }));
            return Ok(());
        }
        st.ws.workspace.set_phase(WorkspacePhase::Terminating);
        let written = st.shared.store.update(st.ws.to_update()).await?;
        st.ws = StoredWorkspace::from_record(written)?;
        st.pending_deletes.push(reply);
        if remaining == 0 {
            self.finish_delete(myself, st).await
        } else {
            self.start_cascade(myself, st, Duration::ZERO).await;
            Ok(())
        }
    }

    /// Asks every sandbox of the workspace to delete itself, from a task, so that this mailbox
    /// stays free for routing and supervision meanwhile.
    async fn start_cascade(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
        delay: Duration,
    ) {
        if st.cascade_running {
            return;
        }
        st.cascade_running = true;
        st.cascade_rounds += 1;
        let children: Vec<Uuid> = st.children.keys().copied().collect();
        let supervisor = myself.clone();
        let timeout = st.shared.config.request_timeout;
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            futures::stream::iter(children)
                .for_each_concurrent(16, |id| {
                    let supervisor = supervisor.clone();
                    async move { delete_child(&supervisor, id, timeout).await }
                })
                .await;
            let _ = supervisor.cast(WorkspaceMsg::CascadeFinished);
        });
    }

    /// Deletes the workspace record once no sandbox remains, checked by UUID and version.
    async fn finish_delete(
        &self,
        myself: &ActorRef<WorkspaceMsg>,
        st: &mut WorkspaceState,
    ) -> Result<(), ActorProcessingErr> {
        let remaining = sandbox_ids(&st.shared, st.ws.id()).await?;
        // With its sandboxes gone (their attachments with them), the workspace's providers
        // go; one still referred to (a sandbox that came back) keeps the cascade going.
        let kept_providers = if remaining.is_empty() {
            delete_providers(&st.shared, st.ws.id()).await?
        } else {
            0
        };
        if !remaining.is_empty() || kept_providers > 0 {
            let delay = backoff(
                Duration::from_millis(100),
                Duration::from_secs(5),
                st.cascade_rounds.min(10),
            );
            tracing::info!(workspace = %st.ws.workspace.name, remaining = remaining.len(), kept_providers, "sandboxes or providers remain; cascading again in {delay:?}");
            for id in remaining {
                if let std::collections::hash_map::Entry::Vacant(slot) = st.children.entry(id) {
                    slot.insert(Child {
                        actor: None,
                        history: RestartHistory::default(),
                    });
                    self.spawn_child(myself, st, id, false).await;
                }
            }
            self.start_cascade(myself, st, delay).await;
            return Ok(());
        }
        match st
            .shared
            .store
            .delete(st.ws.id(), st.ws.record.resource_version)
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        tracing::info!(workspace = %st.ws.workspace.name, id = %st.ws.id(), "workspace deleted");
        for reply in st.pending_deletes.drain(..) {
            let _ = reply.send(Ok(true));
        }
        myself.stop(Some(DELETED.to_string()));
        Ok(())
    }
}

/// Whether `cell` is the actor the registry has for sandbox `id` (a supervision event can
/// arrive after a newer actor for the same sandbox took over, e.g. a sandbox deleted and
/// then adopted under the same id).
fn current_actor_is(st: &WorkspaceState, id: Uuid, cell: &ractor::ActorCell) -> bool {
    st.children.get(&id).is_some_and(|child| {
        child
            .actor
            .as_ref()
            .is_none_or(|a| a.get_id() == cell.get_id())
    })
}

/// Deletes one sandbox through its actor, riding out the actor's restarts, and keeping at
/// it (an error answered is asked again) with a backoff from 10 ms to 2 s until `timeout`.
/// Ends quietly: the supervisor's next round sees what remains.
async fn delete_child(supervisor: &ActorRef<WorkspaceMsg>, id: Uuid, timeout: Duration) {
    let patience = Patience {
        timeout,
        pause: |attempt| {
            backoff(
                Duration::from_millis(10),
                Duration::from_secs(2),
                attempt.min(10),
            )
        },
        retry_errors: true,
    };
    let locate = || async move {
        Ok(
            match supervisor
                .call(
                    |reply| WorkspaceMsg::Route { id, reply },
                    Some(ROUTE_TIMEOUT),
                )
                .await
            {
                Ok(CallResult::Success(route)) => route,
                // The supervisor is gone; its successor resumes the cascade.
                _ => Route::Unknown,
            },
        )
    };
    let done = call_until(
        ("sandbox", id),
        patience,
        locate,
        SandboxMsg::Delete,
        || Ok(()),
    )
    .await;
    if let Err(e) = done {
        tracing::info!(sandbox = %id, "cascade delete not done yet: {e}");
    }
}

/// What keeps a workspace from being deleted without cascade, each as "kind workspace/name":
/// its sandboxes (and each one's service endpoints) and its providers, every one of them
/// (the scans read to the end).
async fn blockers(shared: &Shared, ws: &StoredWorkspace) -> Result<Vec<String>> {
    let store = shared.store.as_ref();
    let ws_name = &ws.workspace.name;
    let mut out = Vec::new();
    let everything = LabelSelector::default();
    for sb in crate::scan::all_records(store, Kind::Sandbox, Scope::Workspace(ws.id()), &everything)
        .await?
    {
        out.push(format!("sandbox {ws_name}/{}", sb.name));
        for svc in crate::owned::owned_records(store, sb.id, Kind::Service).await? {
            out.push(format!("service {ws_name}/{}/{}", sb.name, svc.name));
        }
    }
    for p in crate::scan::all_records(
        store,
        Kind::Provider,
        Scope::Workspace(ws.id()),
        &everything,
    )
    .await?
    {
        out.push(format!("provider {ws_name}/{}", p.name));
    }
    Ok(out)
}

/// Deletes every provider of a workspace; answers how many are still referred to (kept).
async fn delete_providers(shared: &Shared, ws: Uuid) -> Result<usize> {
    let store = shared.store.as_ref();
    let mut kept = 0;
    let providers = crate::scan::all_records(
        store,
        Kind::Provider,
        Scope::Workspace(ws),
        &LabelSelector::default(),
    )
    .await?;
    for p in providers {
        match store.delete(p.id, p.resource_version).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {
                tracing::info!(provider = %p.id, name = %p.name, "provider deleted with its workspace");
            }
            Err(StoreError::Referenced { .. }) | Err(StoreError::Conflict { .. }) => kept += 1,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(kept)
}

/// Every sandbox id in a workspace, from the store.
pub(crate) async fn sandbox_ids(shared: &Shared, ws: Uuid) -> Result<Vec<Uuid>> {
    let records = all_records(
        &*shared.store,
        Kind::Sandbox,
        Scope::Workspace(ws),
        &LabelSelector::everything(),
    )
    .await?;
    Ok(records.iter().map(|r| r.id).collect())
}
