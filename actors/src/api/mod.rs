//! The Rust API of the actor runtime: what the gRPC layer calls.
//!
//! A request by id is authoritative; a request by (workspace, name) resolves inside that
//! workspace only; a name-only request that is not in `default` but exists elsewhere is refused
//! deterministically (never resolved by choosing one).
//!
//! [`Gateway`] is one type over four files, each an `impl Gateway` block: this one holds its
//! state, the workspace, sandbox and image calls, and the hooks for tests; `resolve.rs` turns
//! a selector into a record (name resolution); `watch.rs` assembles a watch (the initial list,
//! then the event history); `data.rs` holds what goes to a sandbox's driver directly, past the
//! actors (exec, copy, port-forward, logs). Lifecycle commands go to the actors through
//! [`Router`]'s call policy (`route.rs`); reads go to the store.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef, RpcReplyPort};
use sbx_driver_api::pb;
use sbx_images::{PullOptions, PullProgress};
use sbx_proto::names::DEFAULT_WORKSPACE;
use sbx_proto::v1::{Image, Sandbox, SandboxSpec, Workspace};
use sbx_storage::{Kind, ListQuery, ObjectStore, Scope};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::{Config, DriverSet, Shared};
use crate::error::{ActorError, Result};
use crate::events::{EventHub, HistoryBounds};
use crate::images::{ImageScope, ImageSelector, Images};
use crate::lease::LeaseTable;
use crate::protocol::{ReconcilerMsg, SweepReport};
use crate::protocol::{RootMsg, Route, SandboxMsg, WorkspaceMsg};
use crate::records::{StoredSandbox, StoredWorkspace};
use crate::root::GatewayRoot;
use crate::route::{Router, ask};
use crate::startup::StartupTracker;
use crate::validate::{self, SandboxSelector, WorkspaceSelector};

mod data;
mod derive;
pub use data::{ActorStream, ExecInputs, ForwardInputs, LogOptions};
mod events;
mod lifetimes;
mod limits;
pub(crate) mod network;
pub mod nodes;
mod providers;
mod resolve;
mod services;
mod settings;
mod stats;
mod watch;

use resolve::not_found_id;
pub use services::ServiceTarget;

/// The largest page a list returns, whatever was asked (a limit, kept with the others).
pub use crate::limits::MAX_PAGE_SIZE;

/// The page a list returns when it asks for none.
pub const DEFAULT_PAGE_SIZE: u32 = 100;

/// What an exec asks for beyond its command (see `sbx.v1.ExecRequest`).
#[derive(Debug, Clone, Default)]
pub struct ExecOptions {
    /// Set on top of the sandbox's own environment.
    pub env: HashMap<String, String>,
    /// 0: no timeout.
    pub timeout_seconds: u32,
    /// An absolute path inside the sandbox; empty: the sandbox's own working directory.
    pub workdir: String,
    /// The caller sends stdin.
    pub stdin: bool,
    /// Run on a terminal of this size and type.
    pub tty: Option<sbx_proto::v1::Tty>,
    /// Who the command runs as (`NAME`, `UID`, `NAME:GROUP`, `UID:GID`, as Docker's `exec
    /// -u`); empty: the sandbox's default user (its image's `User`, else root).
    pub user: String,
}

/// A running actor tree over a store and a set of drivers.
pub struct Gateway {
    shared: Arc<Shared>,
    root: ActorRef<RootMsg>,
    /// Taken by the first shutdown.
    root_task: std::sync::Mutex<Option<JoinHandle<()>>>,
    router: Router,
    /// Image records, the image store and the lock between image deletes and sandbox creates.
    pub(crate) images: Arc<Images>,
    /// Collects what a transfer left when it ended unrecorded, then drops the build cache of
    /// before image scopes (at start); aborted at shutdown.
    image_collector: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// Asks every node what it is, every few seconds; aborted at shutdown.
    node_probe: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// Reads the store's change log into the event hub (a store with one).
    change_follower: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// Claims and renews the workspace leases (gateways sharing a store); aborted at
    /// shutdown.
    lease_task: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// The usage samples kept of the sandboxes this gateway serves, and the task that takes
    /// them (aborted at shutdown).
    stats: Arc<crate::stats::StatsHistory>,
    stats_sampler: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// Drops the oldest events past `Config::events_max`, every minute (aborted at shutdown).
    event_sweeper: std::sync::Mutex<Option<JoinHandle<()>>>,
}

/// A page of a list.
#[derive(Debug, Clone)]
pub struct Listed<T> {
    pub items: Vec<T>,
    /// Empty on the last page.
    pub next_page_token: String,
}

/// Which sandboxes a list or a watch covers.
#[derive(Debug, Clone, Default)]
pub struct SandboxFilter {
    /// `None` with `all_workspaces` false means "default".
    pub workspace: Option<String>,
    pub all_workspaces: bool,
    pub label_selector: String,
}

impl Gateway {
    /// Starts the actor tree: the root loads every workspace and spawns its supervisor, which
    /// spawns an actor per sandbox; each actor re-attaches to its workload by id. Use
    /// [`Gateway::wait_attached`] before reporting anything as Ready.
    pub async fn start(
        store: Arc<dyn ObjectStore>,
        drivers: DriverSet,
        config: Config,
    ) -> Result<Gateway> {
        let horizon = store.current_revision().await?;
        // A store shared by gateways keeps a change log: the events are every gateway's
        // writes, read from it; from the last `event_history` revisions it holds, so a watch
        // resumes on this gateway from a version another gave out.
        let change_log = match store.change_log_start().await? {
            Some(start) => Some(start.max(horizon.saturating_sub(config.event_history as u64))),
            None => None,
        };
        let bounds = HistoryBounds {
            max_events: config.event_history,
            max_bytes: config.event_history_bytes,
        };
        let images = Arc::new(Images::new(Arc::clone(&store), &config));
        images.probe_drivers(&drivers).await;
        let image_collector = {
            let images = Arc::clone(&images);
            tokio::spawn(async move {
                if let Err(e) = images.migrate(crate::images::BUILD_CACHE_REPOSITORY).await
                    && !matches!(e, ActorError::FailedPrecondition(_))
                {
                    tracing::warn!("image records at start: {e}");
                }
                images.collect_forever().await;
            })
        };
        let ownership = config.ownership.as_ref().map(|o| {
            Arc::new(crate::ownership::Ownership::new(
                Arc::clone(&store),
                o.gateway,
                o.address.clone(),
                o.period,
            ))
        });
        let shared = Arc::new(Shared {
            events: match change_log {
                Some(from) => EventHub::fed_by_store(bounds, from),
                None => EventHub::new(bounds, horizon),
            },
            attach_permits: Arc::new(Semaphore::new(config.attach_concurrency.max(1))),
            store,
            drivers,
            config,
            leases: Arc::new(LeaseTable::default()),
            startup: StartupTracker::default(),
            ownership,
            event_writes: Default::default(),
            activity: Default::default(),
        });
        if shared.ownership.is_some() {
            shared.drivers.nodes().set_fencing();
        }
        nodes::load_nodes(&shared).await?;
        // The root's own share, released when it has spawned every supervisor.
        shared.startup.add(1);
        let (root, root_task) = Actor::spawn(None, GatewayRoot, Arc::clone(&shared))
            .await
            .map_err(|e| ActorError::Internal(format!("the gateway root did not start: {e}")))?;
        let change_follower = change_log.map(|from| {
            tokio::spawn(crate::change_log::follow_change_log(
                Arc::clone(&shared),
                from,
            ))
        });
        let stats = Arc::new(crate::stats::StatsHistory::new(shared.config.stats));
        let stats_sampler = tokio::spawn(crate::stats::sample_forever(
            Arc::clone(&shared),
            Arc::clone(&stats),
        ));
        let sweeping = Arc::clone(&shared);
        let event_sweeper = tokio::spawn(async move {
            loop {
                crate::journal::sweep(&sweeping).await;
                tokio::time::sleep(crate::journal::SWEEP_EVERY).await;
            }
        });
        let gateway = Gateway {
            router: Router::new(root.clone(), &shared),
            shared,
            root,
            root_task: std::sync::Mutex::new(Some(root_task)),
            images,
            node_probe: std::sync::Mutex::new(None),
            change_follower: std::sync::Mutex::new(change_follower),
            lease_task: std::sync::Mutex::new(None),
            stats,
            stats_sampler: std::sync::Mutex::new(Some(stats_sampler)),
            event_sweeper: std::sync::Mutex::new(Some(event_sweeper)),
            image_collector: std::sync::Mutex::new(Some(image_collector)),
        };
        if let Some(ownership) = &gateway.shared.ownership {
            let (first_round, claimed) = tokio::sync::oneshot::channel();
            let task = crate::ownership::hold_leases(
                Arc::clone(ownership),
                Arc::clone(&gateway.shared.store),
                Arc::clone(gateway.shared.drivers.nodes()),
                gateway.root.clone(),
                first_round,
            );
            *gateway.lease_task.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(tokio::spawn(task));
            // Serve only once the first round has claimed what this gateway serves (a
            // restarted gateway renews its own leases there), so that its first requests do
            // not meet a workspace it is about to take; at most a lease period.
            let period = gateway
                .shared
                .config
                .ownership
                .as_ref()
                .map_or(Duration::from_secs(10), |o| o.period);
            if tokio::time::timeout(period, claimed).await.is_err() {
                tracing::warn!(
                    "the first lease round did not end within {period:?}; serving anyway"
                );
            }
        }
        let nodes = Arc::clone(gateway.shared.drivers.nodes());
        let store = Arc::clone(&gateway.shared.store);
        let timeout = gateway.shared.config.driver_call_timeout;
        *gateway.node_probe.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(tokio::spawn(async move {
                let every = nodes.timing().probe_every;
                loop {
                    // What other gateways of the store registered, cordoned or removed.
                    match nodes::sync_nodes(&*store, &nodes).await {
                        Ok(Some(cordoned)) => nodes.set_local_cordoned(cordoned),
                        Ok(None) => {}
                        Err(e) => tracing::warn!("cannot read the nodes from the store: {e}"),
                    }
                    // Not awaited: a node that hangs until the timeout must not delay the
                    // next round for the others (it is skipped while its probe is pending).
                    let probing = Arc::clone(&nodes);
                    tokio::spawn(async move { probing.probe_all(timeout.min(every * 2)).await });
                    tokio::time::sleep(every).await;
                }
            }));
        Ok(gateway)
    }

    /// The gateway's metrics, their states read now (sandboxes by phase and driver from the
    /// store, the watch history), in the OpenMetrics text format. A store that does not
    /// answer leaves the sandbox gauges as they were last read (the error is logged).
    pub async fn metrics_text(&self) -> String {
        let metrics = &self.shared.config.metrics;
        let everything = sbx_storage::LabelSelector::everything();
        match crate::scan::all_records(
            &*self.shared.store,
            Kind::Sandbox,
            sbx_storage::Scope::All,
            &everything,
        )
        .await
        {
            Ok(records) => {
                let mut counts: std::collections::BTreeMap<(String, String), i64> =
                    std::collections::BTreeMap::new();
                let mut denied = 0u64;
                let nodes = self.shared.drivers.nodes();
                for record in records {
                    let Ok(stored) = crate::records::StoredSandbox::from_record(record) else {
                        continue;
                    };
                    // As the API shows it: Unknown while its node is silent past its grace.
                    let sb = &nodes.present(stored.sandbox);
                    let driver = self.driver_name(sb);
                    *counts
                        .entry((format!("{:?}", sb.phase()), driver))
                        .or_default() += 1;
                    denied += sb.network_denied;
                }
                metrics.network_denials.set(denied as i64);
                metrics.sandboxes.clear();
                for ((phase, driver), n) in counts {
                    metrics
                        .sandboxes
                        .get_or_create(&crate::metrics::SandboxLabels { phase, driver })
                        .set(n);
                }
            }
            Err(e) => tracing::warn!("metrics: cannot count the sandboxes: {e}"),
        }
        if let Some(stats) = self.shared.store.commit_stats() {
            metrics.store_stats(&stats);
        }
        for (outcome, n) in sbx_network::resolver::outcome_counts() {
            let counter = metrics
                .resolver_answers
                .get_or_create(&crate::metrics::OutcomeLabels {
                    outcome: outcome.to_string(),
                });
            counter.inc_by(n.saturating_sub(counter.get()));
        }
        let (subscribers, events, bytes) = self.shared.events.stats();
        metrics.watch_subscribers.set(subscribers as i64);
        metrics.watch_history_events.set(events as i64);
        metrics.watch_history_bytes.set(bytes as i64);
        metrics.encode()
    }

    /// Waits (at most `timeout`) until no event write is under way: events are written by
    /// tasks of their own, a moment after the changes they tell of. True when none is.
    pub async fn events_written(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while self
            .shared
            .event_writes
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0
        {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// The gateway's metrics, to count into (the API layer's requests).
    pub fn metrics(&self) -> std::sync::Arc<crate::metrics::Metrics> {
        std::sync::Arc::clone(&self.shared.config.metrics)
    }

    /// Waits until every sandbox loaded at startup has re-attached to its workload (or failed
    /// to and recorded why). False on timeout.
    pub async fn wait_attached(&self, timeout: Duration) -> bool {
        self.shared.startup.wait(timeout).await
    }

    /// How many sandboxes loaded at startup have not re-attached yet.
    pub fn pending_attach(&self) -> usize {
        self.shared.startup.pending()
    }

    /// Stops every actor and waits until each has let go of the store (so it can be
    /// reopened). Sandboxes keep running: nothing is asked of the drivers. False if some
    /// actor still held on after `timeout`.
    /// Requests in flight elsewhere end with `Unavailable`.
    pub async fn shutdown(&self) -> bool {
        self.shutdown_within(Duration::from_secs(10)).await
    }

    pub async fn shutdown_within(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        for task in [
            &self.node_probe,
            &self.lease_task,
            &self.change_follower,
            &self.stats_sampler,
            &self.event_sweeper,
            &self.image_collector,
        ] {
            if let Some(task) = task.lock().unwrap_or_else(|p| p.into_inner()).take() {
                task.abort();
            }
        }
        self.root.stop(None);
        let task = self
            .root_task
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(task) = task {
            let _ = tokio::time::timeout_at(deadline, task).await;
        }
        // Killed actors drop their state (and with it the shared context) a moment later.
        while Arc::strong_count(&self.shared) > 1 {
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    holders = Arc::strong_count(&self.shared) - 1,
                    "actors still hold the gateway context after shutdown"
                );
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// The workspaces this gateway serves by their lease (gateways sharing a store; empty
    /// otherwise).
    pub fn held_workspaces(&self) -> Vec<Uuid> {
        self.shared.drivers.nodes().held_workspaces()
    }

    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.shared.store
    }

    pub fn drivers(&self) -> &DriverSet {
        &self.shared.drivers
    }

    // ---- workspaces ------------------------------------------------------------------------

    pub async fn create_workspace(
        &self,
        name: &str,
        labels: HashMap<String, String>,
    ) -> Result<Workspace> {
        validate::name("workspace", name)?;
        validate::labels(&labels)?;
        self.refuse_if_disk_full()?;
        let labels: BTreeMap<String, String> = labels.into_iter().collect();
        ask(&self.root, |reply| RootMsg::CreateWorkspace {
            name: name.to_string(),
            labels,
            reply,
        })
        .await?
    }

    pub async fn get_workspace(&self, sel: &WorkspaceSelector) -> Result<Workspace> {
        Ok(self.resolve_workspace(sel).await?.workspace)
    }

    /// The id of the workspace named `name` now; `None` when no workspace has that name (what
    /// a grant made by name is bound to).
    pub async fn workspace_id(&self, name: &str) -> Result<Option<Uuid>> {
        match self
            .resolve_workspace(&WorkspaceSelector::Name(name.to_string()))
            .await
        {
            Ok(ws) => Ok(Some(ws.record.id)),
            Err(ActorError::WorkspaceNotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn list_workspaces(
        &self,
        label_selector: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<Listed<Workspace>> {
        self.list_page(
            Kind::Workspace,
            Scope::All,
            label_selector,
            page_size,
            page_token,
            |r| StoredWorkspace::from_record(r).map(|w| w.workspace),
        )
        .await
    }

    /// Deletes a workspace; with `cascade`, its sandboxes too. Answers false when there was
    /// no such workspace by id (a name that does not resolve is an error).
    pub async fn delete_workspace(&self, sel: &WorkspaceSelector, cascade: bool) -> Result<bool> {
        self.refuse_if_disk_full()?;
        let ws = match self.resolve_workspace(sel).await {
            Ok(ws) => ws,
            Err(ActorError::WorkspaceNotFound(_)) if matches!(sel, WorkspaceSelector::Id(_)) => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        if ws.workspace.name == DEFAULT_WORKSPACE {
            return Err(ActorError::FailedPrecondition(
                "the default workspace cannot be deleted".into(),
            ));
        }
        let deleted = self
            .router
            .call_workspace(ws.id(), |reply| WorkspaceMsg::Delete { cascade, reply })
            .await?
            .unwrap_or(false);
        if deleted {
            // Its images went with it (they are owned by its record): their content is
            // collected now, not at the next image delete.
            let images = Arc::clone(&self.images);
            tokio::spawn(async move { images.collect().await });
        }
        Ok(deleted)
    }

    // ---- sandboxes -------------------------------------------------------------------------

    /// Creates a sandbox and starts its workload. Answers once the record is durable
    /// (phase Provisioning, or later).
    pub async fn create_sandbox(
        &self,
        workspace: Option<&str>,
        name: &str,
        spec: SandboxSpec,
    ) -> Result<Sandbox> {
        self.create_sandbox_as(workspace, name, spec, false).await
    }

    /// Creates a sandbox, started unless `stopped`: a sandbox created stopped is made in its
    /// driver (its files exist, for a copy before the first start) and stays Stopped until
    /// started.
    pub async fn create_sandbox_as(
        &self,
        workspace: Option<&str>,
        name: &str,
        spec: SandboxSpec,
        stopped: bool,
    ) -> Result<Sandbox> {
        self.create_sandbox_with(workspace, name, spec, stopped, &[])
            .await
    }

    /// [`Gateway::create_sandbox_as`], with `providers` of the workspace (names or ids)
    /// attached before its first start: each resolved to its id once, here, and from then on
    /// referred to by that id only.
    pub async fn create_sandbox_with(
        &self,
        workspace: Option<&str>,
        name: &str,
        mut spec: SandboxSpec,
        stopped: bool,
        providers: &[String],
    ) -> Result<Sandbox> {
        validate::name("sandbox", name)?;
        if providers.len() > crate::limits::MAX_ATTACHMENTS {
            return Err(ActorError::InvalidArgument(format!(
                "{} providers named; at most {} can be attached",
                providers.len(),
                crate::limits::MAX_ATTACHMENTS
            )));
        }
        validate::spec_bounds(&spec)?;
        self.refuse_if_disk_full()?;
        // Output only: the pin is the gateway's to set.
        spec.image_digest.clear();
        let ws_name = validate::workspace_or_default(workspace);
        validate::name("workspace", ws_name)?;
        let ws = self
            .resolve_workspace(&WorkspaceSelector::Name(ws_name.to_string()))
            .await?;
        let mut placed = self.place(&spec, &ws.workspace)?;
        let driver = Arc::clone(&placed.driver);
        spec.driver = placed.ask.driver.clone();
        // Held until the sandbox record is written, so that the pinned image outlives the
        // race with an image delete.
        let mut _pin = None;
        let mut image = None;
        if self
            .images
            .driver_has_images(&spec.driver, driver.as_ref())
            .await?
        {
            let (guard, default) = self.images.pin(&mut spec, ws.id()).await?;
            _pin = Some(guard);
            image = Some(default);
        }
        validate::spec(&spec, image.as_ref())?;
        // No policy asked: the workspace's default, as it is now, copied in.
        let unset = spec.network.as_ref().is_none_or(|n| {
            n.mode() == sbx_proto::v1::NetworkMode::Unspecified && n.allow.is_empty()
        });
        if unset && ws.workspace.default_network.is_some() {
            spec.network = ws.workspace.default_network.clone();
        } else if unset
            && self
                .images
                .driver_capabilities(&spec.driver, driver.as_ref())
                .await?
                .network
        {
            // On a gateway with a network: an address and the resolver, no egress. What it
            // tried to reach is then in its denials (a name lookup too), not just lost.
            spec.network = Some(sbx_proto::v1::NetworkPolicy {
                mode: sbx_proto::v1::NetworkMode::Policy as i32,
                allow: Vec::new(),
            });
        }
        self.refuse_network_without_driver(&spec, driver.as_ref())
            .await?;
        self.apply_default_limits(&mut spec, &ws.workspace, driver.as_ref())
            .await?;
        self.settle_lifetime(&mut spec, &ws.workspace, driver.as_ref())
            .await?;
        placed.settle(&spec);
        let mut provider_ids = Vec::with_capacity(providers.len());
        for p in providers {
            let id = self.resolve_provider_in(&ws, p).await?.id;
            if !provider_ids.contains(&id) {
                provider_ids.push(id);
            }
        }
        let create = |reply| WorkspaceMsg::CreateSandbox {
            name: name.to_string(),
            spec: spec.clone(),
            stopped,
            providers: provider_ids.clone(),
            node: (placed.node, placed.node_name.clone()),
            reply,
        };
        let created = self
            .router
            .call_workspace(ws.id(), create)
            .await?
            .ok_or_else(|| ActorError::WorkspaceNotFound(format!("{ws_name:?}")))?;
        placed.keep();
        Ok(created)
    }

    /// A sandbox as it reads now (`Unknown` while its node has been silent past the grace
    /// period).
    pub async fn get_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        let sandbox = self.resolve_sandbox(sel).await?.sandbox;
        Ok(self.shared.drivers.nodes().present(sandbox))
    }

    pub async fn list_sandboxes(
        &self,
        filter: &SandboxFilter,
        page_size: u32,
        page_token: &str,
    ) -> Result<Listed<Sandbox>> {
        let scope = self.scope(filter).await?;
        let nodes = self.shared.drivers.nodes();
        self.list_page(
            Kind::Sandbox,
            scope,
            &filter.label_selector,
            page_size,
            page_token,
            |r| StoredSandbox::from_record(r).map(|s| nodes.present(s.sandbox)),
        )
        .await
    }

    pub async fn start_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        self.change_sandbox(sel, SandboxMsg::Start).await
    }

    pub async fn stop_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        self.change_sandbox(sel, SandboxMsg::Stop).await
    }

    pub async fn restart_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        self.change_sandbox(sel, SandboxMsg::Restart).await
    }

    /// Deletes a sandbox and everything it owns. Answers false when there was nothing to
    /// delete (an id with no sandbox); a name that does not resolve is an error.
    pub async fn delete_sandbox(&self, sel: &SandboxSelector) -> Result<bool> {
        self.refuse_if_disk_full()?;
        let sb = match self.resolve_sandbox(sel).await {
            Ok(sb) => sb,
            Err(ActorError::SandboxNotFound { .. }) if matches!(sel, SandboxSelector::Id(_)) => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        Ok(self
            .command(&sb, SandboxMsg::Delete)
            .await?
            .unwrap_or(false))
    }

    /// The default driver's name and every driver's capabilities (each asked with a 2 s
    /// deadline; one that does not answer carries the error instead).
    pub async fn drivers_info(
        &self,
    ) -> (
        String,
        Vec<(
            String,
            std::result::Result<pb::CapabilitiesResponse, String>,
        )>,
    ) {
        let mut out = Vec::new();
        for (name, driver) in self.shared.drivers.iter() {
            let caps =
                match tokio::time::timeout(Duration::from_secs(2), driver.capabilities()).await {
                    Ok(Ok(caps)) => Ok(caps),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("no answer within 2 s".to_string()),
                };
            out.push((name.clone(), caps));
        }
        (self.shared.drivers.default_name().to_string(), out)
    }

    // ---- images ----------------------------------------------------------------------------

    /// Where images of `workspace` (None: "default") are, or the gateway's own when
    /// `publish`.
    pub async fn image_scope(&self, workspace: Option<&str>, publish: bool) -> Result<ImageScope> {
        if publish {
            return Ok(ImageScope::Gateway);
        }
        let name = validate::workspace_or_default(workspace);
        let ws = self
            .resolve_workspace(&WorkspaceSelector::Name(name.to_string()))
            .await?;
        Ok(ImageScope::Workspace(ws.id()))
    }

    /// Pulls an image and records it in `into` under its normalised name (re-tagging a record
    /// of that name there); nothing is recorded once `cancel` is.
    pub async fn pull_image(
        &self,
        reference: &str,
        options: &PullOptions,
        progress: &(dyn Fn(PullProgress) + Send + Sync),
        into: ImageScope,
        cancel: CancellationToken,
    ) -> Result<Image> {
        self.images
            .pull(reference, options, progress, into, cancel)
            .await
    }

    /// Imports an image file into `into`; `name` (name:tag) overrides the names the archive
    /// carries. Nothing is recorded once `cancel` is.
    pub async fn import_image(
        &self,
        path: &Path,
        name: Option<&str>,
        into: ImageScope,
        cancel: CancellationToken,
    ) -> Result<Vec<Image>> {
        self.images.import(path, name, into, cancel).await
    }

    /// Records the built-in busybox image under `name` (the gateway's) unless a record of it
    /// exists (`None` then).
    pub async fn ensure_busybox_image(&self, busybox: &Path, name: &str) -> Result<Option<Image>> {
        self.images.ensure_busybox(busybox, name).await
    }

    /// Where an import upload is spooled, and the largest upload accepted.
    pub fn image_spool(&self) -> Result<(PathBuf, u64)> {
        self.images.spool()
    }

    /// The free space of the image store's filesystem, for an upload of `what` spooled into
    /// it (see `sbx_images::Room`).
    pub fn image_room(&self, what: &str) -> Result<sbx_images::Room> {
        Ok(self.images.content_store()?.room(what))
    }

    /// Whether the named driver (empty: the default) runs sandboxes from images.
    pub async fn driver_has_images(&self, driver: &str) -> Result<bool> {
        let (name, d) = self.shared.drivers.resolve(driver)?;
        self.images.driver_has_images(name, d.as_ref()).await
    }

    /// The image `sel` names as seen from `scope` (a workspace: its images, then the
    /// gateway's).
    pub async fn get_image(&self, sel: &ImageSelector, scope: ImageScope) -> Result<Image> {
        self.images.get(sel, scope).await
    }

    /// Image records in creation order, a page at a time: those whose owner `sees` admits
    /// (`None`: the gateway's; `Some`: a workspace's id).
    pub async fn list_images(
        &self,
        page_size: u32,
        page_token: &str,
        sees: impl Fn(Option<Uuid>) -> bool,
    ) -> Result<Listed<Image>> {
        let limit = match page_size {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        } as usize;
        validate::page_token(page_token)?;
        let (items, next_page_token) = self.images.list_page(limit, page_token, sees).await?;
        Ok(Listed {
            items,
            next_page_token,
        })
    }

    /// Deletes an image record (as seen from `scope`), refused while a sandbox pins its
    /// digest. False for an id with no record.
    pub async fn delete_image(&self, sel: &ImageSelector, scope: ImageScope) -> Result<bool> {
        self.images.delete(sel, scope).await
    }

    /// Removes the images of `scope` itself no sandbox pins (the build cache only, or with
    /// `all` every one but the default image), then the content nothing keeps; what went and
    /// the bytes freed.
    pub async fn prune_images(&self, scope: ImageScope, all: bool) -> Result<crate::PrunedImages> {
        self.images.prune(scope, all).await
    }

    // ---- for tests and operators -----------------------------------------------------------

    /// Runs one reconciler sweep now and answers what it did.
    pub async fn reconcile_now(&self) -> Result<SweepReport> {
        let reconciler = ask(&self.root, RootMsg::Reconciler)
            .await?
            .ok_or_else(|| ActorError::Unavailable("the reconciler is restarting".into()))?;
        match reconciler
            .call(
                |r| ReconcilerMsg::Sweep(Some(r)),
                Some(self.shared.config.request_timeout),
            )
            .await
        {
            Ok(CallResult::Success(report)) => Ok(report),
            _ => Err(ActorError::Unavailable(
                "the reconciler did not answer".into(),
            )),
        }
    }

    /// The live actor of a sandbox, if it has one right now.
    pub async fn sandbox_actor(&self, id: Uuid) -> Result<Option<ActorRef<SandboxMsg>>> {
        let Some(record) = self.shared.store.get(id).await? else {
            return Ok(None);
        };
        let Some(ws) = record.workspace else {
            return Ok(None);
        };
        Ok(match self.router.sandbox(ws, id).await? {
            Route::Actor(a) => Some(a),
            _ => None,
        })
    }

    /// The live supervisor of a workspace, if it has one right now.
    pub async fn workspace_supervisor(&self, ws: Uuid) -> Result<Option<ActorRef<WorkspaceMsg>>> {
        Ok(match self.router.workspace(ws).await? {
            Route::Actor(a) => Some(a),
            _ => None,
        })
    }

    /// The sandbox ids a workspace's supervisor owns right now.
    pub async fn supervised_sandboxes(&self, ws: Uuid) -> Result<Option<Vec<Uuid>>> {
        match self.workspace_supervisor(ws).await? {
            Some(sup) => Ok(Some(ask(&sup, WorkspaceMsg::Children).await?)),
            None => Ok(None),
        }
    }

    // ---- internals -------------------------------------------------------------------------

    /// Refuses a lifecycle write up front while the store's disk is full (see
    /// [`Router::refuse_if_disk_full`]).
    fn refuse_if_disk_full(&self) -> Result<()> {
        self.router.refuse_if_disk_full()
    }

    /// Start, stop or restart: refused while the disk is full, sent to the actor of the
    /// sandbox `sel` names, answered with the sandbox as the step left it.
    async fn change_sandbox(
        &self,
        sel: &SandboxSelector,
        msg: fn(RpcReplyPort<Result<Sandbox>>) -> SandboxMsg,
    ) -> Result<Sandbox> {
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        self.command(&sb, msg)
            .await?
            .ok_or_else(|| not_found_id(sb.id()))
    }

    /// Sends a lifecycle command to a sandbox's actor and waits for its answer (see
    /// [`Router::call_sandbox`]). `None` when the sandbox no longer exists.
    async fn command<R: Send + 'static>(
        &self,
        sb: &StoredSandbox,
        msg: impl Fn(RpcReplyPort<Result<R>>) -> SandboxMsg,
    ) -> Result<Option<R>> {
        let ws = sb
            .record
            .workspace
            .ok_or_else(|| ActorError::Internal(format!("sandbox {} has no workspace", sb.id())))?;
        self.router.call_sandbox(ws, sb.id(), msg).await
    }

    /// One page of a client's list (`page_size` 0: 100; at most `MAX_PAGE_SIZE`), each
    /// record decoded by `decode`.
    async fn list_page<T>(
        &self,
        kind: Kind,
        scope: Scope,
        label_selector: &str,
        page_size: u32,
        page_token: &str,
        decode: impl Fn(sbx_storage::Record) -> Result<T>,
    ) -> Result<Listed<T>> {
        let limit = match page_size {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        } as usize;
        validate::page_token(page_token)?;
        let cursor = (!page_token.is_empty()).then(|| page_token.to_string());
        let q = ListQuery {
            kind,
            scope,
            selector: validate::selector(label_selector)?,
            limit,
            cursor,
        };
        let page = self.shared.store.list(q).await.map_err(|e| match e {
            sbx_storage::StoreError::Invalid { .. } => ActorError::InvalidArgument(e.to_string()),
            other => other.into(),
        })?;
        Ok(Listed {
            items: page
                .records
                .into_iter()
                .map(decode)
                .collect::<Result<_>>()?,
            next_page_token: page.next_cursor.unwrap_or_default(),
        })
    }
}
