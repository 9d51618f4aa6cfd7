//! The gateway root: spawns a workspace supervisor per workspace at startup, creates new
//! workspaces, routes requests to supervisors by UUID, restarts failed supervisors, and owns
//! the reconciler.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use sbx_proto::names::DEFAULT_WORKSPACE;
use sbx_proto::v1::{Workspace, WorkspacePhase};
use sbx_storage::{Kind, LabelSelector, Scope, StoreError};
use uuid::Uuid;

use crate::config::Shared;
use crate::error::{ActorError, Result};
use crate::protocol::ReconcilerMsg;
use crate::protocol::{RootMsg, Route, WorkspaceMsg};
use crate::reconciler::{Reconciler, ReconcilerArgs};
use crate::records::{StoredWorkspace, new_workspace_record};
use crate::sandbox::DELETED;
use crate::scan::all_records;
use crate::supervision::{ChildEnd, RestartDecision, RestartHistory, child_end};
use crate::workspace::{WorkspaceArgs, WorkspaceSupervisor};

pub struct GatewayRoot;

pub struct RootState {
    shared: Arc<Shared>,
    supervisors: HashMap<Uuid, Supervised>,
    by_actor: HashMap<ActorId, Uuid>,
    reconciler: Option<ActorRef<ReconcilerMsg>>,
    reconciler_history: RestartHistory,
}

struct Supervised {
    actor: Option<ActorRef<WorkspaceMsg>>,
    history: RestartHistory,
}

impl Actor for GatewayRoot {
    type Msg = RootMsg;
    type State = RootState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        _myself: ActorRef<RootMsg>,
        shared: Arc<Shared>,
    ) -> Result<RootState, ActorProcessingErr> {
        ensure_default_workspace(&shared).await?;
        Ok(RootState {
            shared,
            supervisors: HashMap::new(),
            by_actor: HashMap::new(),
            reconciler: None,
            reconciler_history: RestartHistory::default(),
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<RootMsg>,
        st: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        if st.shared.ownership.is_some() {
            // Gateways sharing the store: the lease task says which workspaces to serve.
            st.shared.startup.attached();
            self.spawn_reconciler(&myself, st).await;
            return Ok(());
        }
        let ids: Vec<Uuid> = all_records(
            &*st.shared.store,
            Kind::Workspace,
            Scope::All,
            &LabelSelector::everything(),
        )
        .await?
        .iter()
        .map(|r| r.id)
        .collect();
        st.shared.startup.add(ids.len());
        tracing::info!(workspaces = ids.len(), "starting workspace supervisors");
        for id in ids {
            st.supervisors.insert(
                id,
                Supervised {
                    actor: None,
                    history: RestartHistory::default(),
                },
            );
            if !self.spawn_supervisor(&myself, st, id, true).await {
                st.shared.startup.attached();
            }
        }
        // The root's own share of the startup count (see `Gateway::start`).
        st.shared.startup.attached();
        self.spawn_reconciler(&myself, st).await;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<RootMsg>,
        msg: RootMsg,
        st: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RootMsg::CreateWorkspace {
                name,
                labels,
                reply,
            } => {
                let result = self.create_workspace(&myself, st, name, labels).await;
                let _ = reply.send(result);
            }
            RootMsg::Route { id, reply } => {
                let route = match st.supervisors.get(&id) {
                    Some(Supervised { actor: Some(a), .. }) => Route::Actor(a.clone()),
                    Some(Supervised { actor: None, .. }) => Route::Restarting,
                    None => Route::Unknown,
                };
                let _ = reply.send(route);
            }
            RootMsg::RespawnSupervisor(id) => {
                if st.supervisors.get(&id).is_some_and(|s| s.actor.is_none()) {
                    self.spawn_supervisor(&myself, st, id, false).await;
                }
            }
            RootMsg::Hold(id) => {
                if let std::collections::hash_map::Entry::Vacant(entry) = st.supervisors.entry(id) {
                    tracing::info!(workspace = %id, "serving the workspace (its lease is ours)");
                    entry.insert(Supervised {
                        actor: None,
                        history: RestartHistory::default(),
                    });
                    self.spawn_supervisor(&myself, st, id, false).await;
                }
            }
            RootMsg::LetGo(id) => {
                if let Some(sup) = st.supervisors.remove(&id) {
                    tracing::warn!(workspace = %id, "letting the workspace go (its lease is not ours)");
                    if let Some(actor) = sup.actor {
                        st.by_actor.remove(&actor.get_id());
                        actor.stop(Some("the workspace's lease is another gateway's".into()));
                    }
                }
            }
            RootMsg::RespawnReconciler => {
                if st.reconciler.is_none() {
                    self.spawn_reconciler(&myself, st).await;
                }
            }
            RootMsg::Reconciler(reply) => {
                let _ = reply.send(st.reconciler.clone());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<RootMsg>,
        evt: SupervisionEvent,
        st: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, what) = match child_end(evt, DELETED) {
            Some(ChildEnd::Deleted(cell)) => {
                if let Some(id) = st.by_actor.remove(&cell.get_id()) {
                    st.supervisors.remove(&id);
                }
                return Ok(());
            }
            Some(ChildEnd::Abnormal(cell, what)) => (cell, what),
            None => return Ok(()),
        };
        if st
            .reconciler
            .as_ref()
            .is_some_and(|r| r.get_id() == cell.get_id())
        {
            st.reconciler = None;
            tracing::warn!("reconciler {what}; restarting it");
            let delay = match st
                .reconciler_history
                .on_failure(&st.shared.config.workspace_restarts, Instant::now())
            {
                RestartDecision::RestartAfter(d) => d,
                RestartDecision::Escalate => st.shared.config.workspace_restarts.max_backoff,
            };
            myself.send_after(delay, || RootMsg::RespawnReconciler);
            return Ok(());
        }
        let Some(id) = st.by_actor.remove(&cell.get_id()) else {
            return Ok(());
        };
        let policy = st.shared.config.workspace_restarts;
        let Some(sup) = st.supervisors.get_mut(&id) else {
            return Ok(());
        };
        sup.actor = None;
        // The root is the top of the tree: past the intensity limit it keeps restarting, at the
        // longest backoff, rather than give up on a workspace.
        let delay = match sup.history.on_failure(&policy, Instant::now()) {
            RestartDecision::RestartAfter(d) => d,
            RestartDecision::Escalate => {
                tracing::error!(workspace = %id, "workspace supervisor keeps failing; restarting at the longest backoff");
                policy.max_backoff
            }
        };
        tracing::warn!(workspace = %id, "workspace supervisor {what}; restarting it in {delay:?}");
        st.shared.config.metrics.actor_restarted("workspace");
        myself.send_after(delay, move || RootMsg::RespawnSupervisor(id));
        Ok(())
    }
}

impl GatewayRoot {
    async fn spawn_supervisor(
        &self,
        myself: &ActorRef<RootMsg>,
        st: &mut RootState,
        id: Uuid,
        report_attach: bool,
    ) -> bool {
        let args = WorkspaceArgs {
            id,
            shared: Arc::clone(&st.shared),
            report_attach,
        };
        match Actor::spawn_linked(None, WorkspaceSupervisor, args, myself.get_cell()).await {
            Ok((actor, _)) => {
                st.by_actor.insert(actor.get_id(), id);
                st.supervisors
                    .entry(id)
                    .or_insert(Supervised {
                        actor: None,
                        history: RestartHistory::default(),
                    })
                    .actor = Some(actor);
                true
            }
            Err(e) => {
                if let Ok(None) = st.shared.store.get(id).await {
                    st.supervisors.remove(&id);
                } else {
                    tracing::warn!(workspace = %id, "workspace supervisor did not start: {e}; retrying");
                    let delay = st.shared.config.workspace_restarts.max_backoff;
                    myself.send_after(delay, move || RootMsg::RespawnSupervisor(id));
                }
                false
            }
        }
    }

    async fn spawn_reconciler(&self, myself: &ActorRef<RootMsg>, st: &mut RootState) {
        let args = ReconcilerArgs {
            shared: Arc::clone(&st.shared),
            root: myself.clone(),
        };
        match Actor::spawn_linked(None, Reconciler, args, myself.get_cell()).await {
            Ok((actor, _)) => st.reconciler = Some(actor),
            Err(e) => {
                tracing::error!("reconciler did not start: {e}; retrying");
                myself.send_after(st.shared.config.workspace_restarts.max_backoff, || {
                    RootMsg::RespawnReconciler
                });
            }
        }
    }

    async fn create_workspace(
        &self,
        myself: &ActorRef<RootMsg>,
        st: &mut RootState,
        name: String,
        labels: BTreeMap<String, String>,
    ) -> Result<Workspace> {
        let id = Uuid::new_v4();
        let mut workspace = Workspace {
            name: name.clone(),
            labels: labels.into_iter().collect(),
            ..Default::default()
        };
        workspace.set_phase(WorkspacePhase::Active);
        let record = st
            .shared
            .store
            .create(new_workspace_record(id, &workspace))
            .await
            .map_err(|e| match e {
                StoreError::AlreadyExists { existing, .. } => ActorError::NameTaken {
                    kind: "workspace",
                    name: name.clone(),
                    scope: String::new(),
                    existing: existing.to_string(),
                },
                other => other.into(),
            })?;
        let stored = StoredWorkspace::from_record(record)?;
        if let Some(ownership) = &st.shared.ownership {
            // A new workspace is served by the gateway that made it, from the start.
            match ownership.claim(id, crate::records::now_ms()).await? {
                crate::ownership::Claim::Held(held) => {
                    let nodes = st.shared.drivers.nodes();
                    nodes.set_fence(id, Some(held.token));
                    nodes.hold_until(
                        id,
                        crate::ownership::valid_until(
                            &held,
                            ownership.period.as_millis() as u64 / 3,
                        ),
                    );
                }
                crate::ownership::Claim::HeldBy { holder, .. } => {
                    // Another gateway's lease loop saw the new record first: it serves it.
                    tracing::info!(workspace = %id, %holder, "a new workspace, served by another gateway");
                    return Ok(stored.workspace);
                }
            }
        }
        st.supervisors.insert(
            id,
            Supervised {
                actor: None,
                history: RestartHistory::default(),
            },
        );
        self.spawn_supervisor(myself, st, id, false).await;
        Ok(stored.workspace)
    }
}

async fn ensure_default_workspace(shared: &Shared) -> Result<()> {
    if shared
        .store
        .get_by_name(Kind::Workspace, None, DEFAULT_WORKSPACE)
        .await?
        .is_some()
    {
        return Ok(());
    }
    let mut workspace = Workspace {
        name: DEFAULT_WORKSPACE.into(),
        ..Default::default()
    };
    workspace.set_phase(WorkspacePhase::Active);
    match shared
        .store
        .create(new_workspace_record(Uuid::new_v4(), &workspace))
        .await
    {
        Ok(_) | Err(StoreError::AlreadyExists { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
