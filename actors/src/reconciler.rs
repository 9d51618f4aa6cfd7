//! The reconciler: a level-triggered sweep that compares each driver's workloads with the
//! store and routes every observation to the sandbox actor that owns the id. A record whose
//! supervisor knows no actor for it (a create committed after the supervisor that asked for it
//! died and its replacement listed the workspace: store writes outlive their futures) is handed
//! to that supervisor, which starts one — otherwise nothing would ever drive it.
//!
//! **Invariant:** the reconciler never deletes anything, and never finds a sandbox by name.
//! One bad record is logged and skipped; the sweep goes on with the rest.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use sbx_driver_api::{ComputeDriver, pb};
use sbx_proto::names::validate_name;
use sbx_storage::{Kind, LabelSelector, Scope};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::config::Shared;
use crate::error::{ActorError, Result};
use crate::protocol::{ReconcilerMsg, RootMsg, Route, SandboxMsg, SweepReport, WorkspaceMsg};
use crate::records::StoredSandbox;
use crate::route::{Router, ask};
use crate::scan::all_records;
use crate::validate;

pub struct Reconciler;

pub struct ReconcilerArgs {
    pub shared: Arc<Shared>,
    pub root: ActorRef<RootMsg>,
}

pub struct ReconcilerState {
    shared: Arc<Shared>,
    router: Router,
    /// The tasks that forward driver watch streams; ended with the reconciler.
    watchers: Vec<JoinHandle<()>>,
    ticker: Option<JoinHandle<()>>,
    /// Workloads the last sweep found without a record.
    unknown: HashSet<Uuid>,
}

impl Actor for Reconciler {
    type Msg = ReconcilerMsg;
    type State = ReconcilerState;
    type Arguments = ReconcilerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ReconcilerMsg>,
        args: ReconcilerArgs,
    ) -> Result<ReconcilerState, ActorProcessingErr> {
        let watchers = args
            .shared
            .drivers
            .iter()
            .map(|(name, driver)| spawn_watcher(name.clone(), Arc::clone(driver), myself.clone()))
            .collect();
        let interval = args.shared.config.reconcile_interval;
        let ticker = (!interval.is_zero())
            .then(|| myself.send_interval(interval, || ReconcilerMsg::Sweep(None)));
        Ok(ReconcilerState {
            router: Router::new(args.root, &args.shared),
            shared: args.shared,
            watchers,
            ticker,
            unknown: HashSet::new(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ReconcilerMsg>,
        st: &mut ReconcilerState,
    ) -> Result<(), ActorProcessingErr> {
        stop_tasks(st);
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<ReconcilerMsg>,
        msg: ReconcilerMsg,
        st: &mut ReconcilerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ReconcilerMsg::Sweep(reply) => {
                let report = sweep(st).await;
                if !report.skipped.is_empty() || !report.driver_errors.is_empty() {
                    tracing::warn!(
                        observed = report.observed,
                        absent = report.absent,
                        adopted = report.adopted,
                        skipped = %report.skipped.join("; "),
                        driver_errors = %report.driver_errors.join("; "),
                        "reconciler sweep had problems"
                    );
                } else {
                    tracing::debug!(
                        observed = report.observed,
                        absent = report.absent,
                        adopted = report.adopted,
                        deferred = report.deferred,
                        "reconciler sweep"
                    );
                }
                if let Some(reply) = reply {
                    let _ = reply.send(report);
                }
            }
            ReconcilerMsg::Watched(event) => {
                let Ok(id) = sbx_driver_api::parse_sandbox_id(
                    event
                        .snapshot
                        .as_ref()
                        .map(|s| s.sandbox_id.as_str())
                        .unwrap_or(""),
                ) else {
                    return Ok(());
                };
                // Unknown ids wait for the next sweep, which adopts or skips them.
                if let Ok(Some(record)) = st.shared.store.get(id).await {
                    let observation = if event.deleted { None } else { event.snapshot };
                    if let Err(e) = route_observation(&st.router, record, observation).await {
                        tracing::debug!(sandbox = %id, "watch event not routed: {e}");
                    }
                }
            }
        }
        Ok(())
    }
}

impl Drop for ReconcilerState {
    fn drop(&mut self) {
        stop_tasks(self);
    }
}

fn stop_tasks(st: &mut ReconcilerState) {
    for task in st.watchers.drain(..) {
        task.abort();
    }
    if let Some(t) = st.ticker.take() {
        t.abort();
    }
}

/// Forwards one driver's watch stream to the reconciler, subscribing again after an error.
fn spawn_watcher(
    name: String,
    driver: Arc<dyn ComputeDriver>,
    reconciler: ActorRef<ReconcilerMsg>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut delay = Duration::from_millis(100);
        loop {
            match driver.watch().await {
                Ok(mut stream) => {
                    delay = Duration::from_millis(100);
                    while let Some(item) = stream.next().await {
                        match item {
                            Ok(event) => {
                                if reconciler
                                    .cast(ReconcilerMsg::Watched(Box::new(event)))
                                    .is_err()
                                {
                                    return;
                                }
                            }
                            Err(e) => {
                                tracing::debug!(driver = %name, "watch stream error: {e}");
                                break;
                            }
                        }
                    }
                }
                Err(e) => tracing::debug!(driver = %name, "watch failed: {e}"),
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(10));
        }
    })
}

async fn sweep(st: &mut ReconcilerState) -> SweepReport {
    let mut report = SweepReport::default();
    let mut unknown = HashSet::new();
    let timeout = st.shared.config.driver_call_timeout;
    for (name, driver) in st.shared.drivers.places() {
        let name = &name;
        let driver = &driver;
        let listed = match tokio::time::timeout(timeout, driver.list()).await {
            Ok(Ok(listed)) => listed,
            Ok(Err(e)) => {
                report.driver_errors.push(format!("{name}: {e}"));
                continue;
            }
            Err(_) => {
                report
                    .driver_errors
                    .push(format!("{name}: list did not answer within {timeout:?}"));
                continue;
            }
        };
        let mut seen = HashSet::new();
        for snapshot in listed {
            let id_text = snapshot.sandbox_id.clone();
            match observe_one(st, name, driver, snapshot).await {
                Ok(Seen::Routed(id)) => {
                    seen.insert(id);
                    report.observed += 1;
                }
                Ok(Seen::Adopted(id)) => {
                    seen.insert(id);
                    report.adopted += 1;
                }
                Ok(Seen::Unknown(id)) => {
                    unknown.insert(id);
                    report.deferred += 1;
                }
                Err(e) => {
                    tracing::warn!(driver = %name, sandbox = %id_text, "skipping a driver record: {e}");
                    report.skipped.push(format!("{name}/{id_text}: {e}"));
                }
            }
        }
        match records_of_driver(&st.shared, name).await {
            Ok(records) => {
                for stored in records.into_iter().filter(|s| !seen.contains(&s.id())) {
                    let id = stored.id();
                    match route_observation(&st.router, stored.record, None).await {
                        Ok(()) => report.absent += 1,
                        Err(e) => report.skipped.push(format!("{name}/{id}: {e}")),
                    }
                }
            }
            Err(e) => report
                .driver_errors
                .push(format!("{name}: listing the store: {e}")),
        }
    }
    st.unknown = unknown;
    report
}

enum Seen {
    Routed(Uuid),
    Adopted(Uuid),
    /// No record, first sighting: looked at again by the next sweep.
    Unknown(Uuid),
}

/// Routes one driver record to its actor, or adopts it when the store has no record.
async fn observe_one(
    st: &ReconcilerState,
    driver_name: &str,
    driver: &Arc<dyn ComputeDriver>,
    snapshot: pb::Snapshot,
) -> Result<Seen> {
    let id = sbx_driver_api::parse_sandbox_id(&snapshot.sandbox_id)?;
    if let Some(record) = st.shared.store.get(id).await? {
        route_observation(&st.router, record, Some(snapshot)).await?;
        return Ok(Seen::Routed(id));
    }
    // No record. The list may be older than a deletion that finished since: adopt only what
    // the previous sweep saw too, and what the driver, asked again by id, still runs.
    if !st.unknown.contains(&id) {
        return Ok(Seen::Unknown(id));
    }
    let timeout = st.shared.config.driver_call_timeout;
    let request = pb::GetRequest {
        sandbox_id: id.to_string(),
    };
    let snapshot = match tokio::time::timeout(timeout, driver.get(request)).await {
        Ok(Ok(fresh)) if fresh.state() == pb::State::Running => fresh,
        Ok(Ok(_)) | Ok(Err(sbx_driver_api::DriverError::NotFound { .. })) => {
            return Ok(Seen::Unknown(id));
        }
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {
            return Err(ActorError::Unavailable(format!(
                "get did not answer within {timeout:?}"
            )));
        }
    };
    if st.shared.store.get(id).await?.is_some() {
        return Ok(Seen::Unknown(id));
    }
    // No record: adopt only with a valid workspace (empty means default) and name.
    let workspace = validate::workspace_or_default(Some(&snapshot.workspace)).to_string();
    validate_name(&workspace).map_err(|error| ActorError::InvalidName {
        what: "workspace",
        name: workspace.clone(),
        error,
    })?;
    validate_name(&snapshot.name).map_err(|error| ActorError::InvalidName {
        what: "sandbox",
        name: snapshot.name.clone(),
        error,
    })?;
    let ws = st
        .shared
        .store
        .get_by_name(Kind::Workspace, None, &workspace)
        .await?
        .ok_or_else(|| {
            ActorError::WorkspaceNotFound(format!("{workspace:?} (refusing to adopt into it)"))
        })?;
    // The driver knows the workspace by name only: a workload launched before the workspace of
    // that name was made belongs to an earlier one (deleted, its records lost), never to this.
    if let Some(started) = snapshot.started_at.as_ref().map(timestamp_ms)
        && started < ws.created_at_ms
    {
        return Err(ActorError::FailedPrecondition(format!(
            "a workload without a record, sandbox {id} ({workspace}/{}), started before workspace \
             {workspace:?} was made: it belongs to an earlier workspace of that name, and is not \
             adopted into this one (left running: delete it in the driver, or restore the store \
             that knew it)",
            snapshot.name
        )));
    }
    let Route::Actor(sup) = st.router.workspace(ws.id).await? else {
        return Err(ActorError::Unavailable(format!(
            "workspace {workspace:?} is restarting"
        )));
    };
    let driver = driver_name.to_string();
    ask(&sup, |reply| WorkspaceMsg::Adopt {
        driver,
        snapshot,
        reply,
    })
    .await??;
    tracing::info!(sandbox = %id, workspace = %workspace, "adopted a workload that had no record");
    Ok(Seen::Adopted(id))
}

/// Milliseconds since the Unix epoch of `t` (0 before it).
fn timestamp_ms(t: &sbx_proto::Timestamp) -> u64 {
    let ms = t.seconds.saturating_mul(1000) + i64::from(t.nanos / 1_000_000);
    u64::try_from(ms).unwrap_or(0)
}

async fn route_observation(
    router: &Router,
    record: sbx_storage::Record,
    snapshot: Option<pb::Snapshot>,
) -> Result<()> {
    if record.kind != Kind::Sandbox {
        return Err(ActorError::InvalidArgument(format!(
            "{} is not a sandbox",
            record.id
        )));
    }
    let ws = record
        .workspace
        .ok_or_else(|| ActorError::Internal(format!("sandbox {} has no workspace", record.id)))?;
    match router.sandbox(ws, record.id).await? {
        Route::Actor(actor) => actor
            .cast(SandboxMsg::Observe(snapshot.map(Box::new)))
            .map_err(|_| ActorError::Unavailable(format!("sandbox actor {} is gone", record.id))),
        // A restarting actor re-attaches by itself.
        Route::Restarting => Ok(()),
        // A record its supervisor does not know: deleted since it was read (the supervisor
        // reads it again and leaves it), or created by a supervisor that died before the
        // store answered and committed after its replacement listed the workspace. Nothing
        // else would ever drive the latter.
        Route::Unknown => match router.workspace(ws).await? {
            Route::Actor(sup) => sup.cast(WorkspaceMsg::Supervise(record.id)).map_err(|_| {
                ActorError::Unavailable(format!(
                    "the supervisor of workspace {ws} is gone (sandbox {})",
                    record.id
                ))
            }),
            Route::Restarting | Route::Unknown => Ok(()),
        },
    }
}

async fn records_of_driver(shared: &Shared, driver: &str) -> Result<Vec<StoredSandbox>> {
    let records = all_records(
        &*shared.store,
        Kind::Sandbox,
        Scope::All,
        &LabelSelector::everything(),
    )
    .await?;
    let mut out = Vec::new();
    for record in records {
        match StoredSandbox::from_record(record) {
            Ok(s) if shared.drivers.place_of(&s.sandbox) == driver => out.push(s),
            Ok(_) => {}
            Err(e) => tracing::warn!("skipping an undecodable sandbox record: {e}"),
        }
    }
    Ok(out)
}
