//! The Rust API of the actor runtime: what the gRPC layer calls.
//!
//! A request by id is authoritative; a request by (workspace, name) resolves inside that
//! workspace only; a name-only request that is not in `default` but exists elsewhere is refused
//! deterministically (never resolved by choosing one).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef, RpcReplyPort};
use sbx_drivers::image::{PullOptions, PullProgress};
use sbx_drivers::{DriverStream, ExecInputStream, pb};
use sbx_proto::names::DEFAULT_WORKSPACE;
use sbx_proto::v1::{EventType, Image, Phase, Sandbox, SandboxEvent, SandboxSpec, Workspace};
use sbx_storage::{Kind, LabelSelector, ListQuery, ObjectStore, Scope};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use uuid::Uuid;

use crate::config::{Config, DriverSet, Shared};
use crate::error::{ActorError, Result};
use crate::events::{EventHub, HistoryBounds, LiveError};
use crate::images::{ImageSelector, Images, StoredImage};
use crate::lease::LeaseTable;
use crate::reconciler::{ReconcilerMsg, SweepReport};
use crate::records::{StoredSandbox, StoredWorkspace};
use crate::root::{GatewayRoot, RootMsg};
use crate::route::{Route, Router, ask};
use crate::sandbox::SandboxMsg;
use crate::startup::StartupTracker;
use crate::validate::{self, SandboxSelector, WorkspaceSelector};
use crate::workspace::WorkspaceMsg;

/// The largest page a list returns, whatever was asked.
pub const MAX_PAGE_SIZE: u32 = 1000;

/// Events a watch holds on their way to its client, at most: its own copies (the history's
/// are shared), so with 256 KiB specs 4 are 1 MiB per watch that does not read. The hub
/// never waits for a watcher, so a deeper buffer would only pipeline, not unblock.
const WATCH_BUFFER: usize = 4;
const DEFAULT_PAGE_SIZE: u32 = 100;

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
    pub tty: Option<pb::Tty>,
}

/// A running actor tree over a store and a set of drivers.
pub struct Gateway {
    shared: Arc<Shared>,
    root: ActorRef<RootMsg>,
    /// Taken by the first shutdown.
    root_task: std::sync::Mutex<Option<JoinHandle<()>>>,
    router: Router,
    /// Image records, the image store and the lock between image deletes and sandbox creates.
    images: Images,
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
        let images = Images::new(Arc::clone(&store), &config);
        images.probe_drivers(&drivers).await;
        let shared = Arc::new(Shared {
            events: EventHub::new(
                HistoryBounds {
                    max_events: config.event_history,
                    max_bytes: config.event_history_bytes,
                },
                horizon,
            ),
            attach_permits: Semaphore::new(config.attach_concurrency.max(1)),
            store,
            drivers,
            config,
            leases: Arc::new(LeaseTable::default()),
            startup: StartupTracker::default(),
        });
        // The root's own share, released when it has spawned every supervisor.
        shared.startup.add(1);
        let (root, root_task) = Actor::spawn(None, GatewayRoot, Arc::clone(&shared))
            .await
            .map_err(|e| ActorError::Internal(format!("the gateway root did not start: {e}")))?;
        Ok(Gateway {
            router: Router { root: root.clone() },
            shared,
            root,
            root_task: std::sync::Mutex::new(Some(root_task)),
            images,
        })
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

    pub async fn list_workspaces(
        &self,
        label_selector: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<Listed<Workspace>> {
        let page = self
            .list_page(
                Kind::Workspace,
                Scope::All,
                label_selector,
                page_size,
                page_token,
            )
            .await?;
        let items = page
            .records
            .into_iter()
            .map(|r| StoredWorkspace::from_record(r).map(|w| w.workspace))
            .collect::<Result<_>>()?;
        Ok(Listed {
            items,
            next_page_token: page.next_cursor.unwrap_or_default(),
        })
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
        Ok(self
            .ask_workspace(ws.id(), |reply| WorkspaceMsg::Delete { cascade, reply })
            .await?
            .unwrap_or(false))
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
        mut spec: SandboxSpec,
        stopped: bool,
    ) -> Result<Sandbox> {
        validate::name("sandbox", name)?;
        validate::spec_bounds(&spec)?;
        self.refuse_if_disk_full()?;
        // Output only: the pin is the gateway's to set.
        spec.image_digest.clear();
        let driver = Arc::clone(self.shared.drivers.get(&spec.driver)?);
        if spec.driver.is_empty() {
            spec.driver = self.shared.drivers.default_name().to_string();
        }
        // Held until the sandbox record is written, so that the pinned image outlives the
        // race with an image delete.
        let mut _pin = None;
        let mut image = None;
        if self
            .images
            .driver_has_images(&spec.driver, driver.as_ref())
            .await?
        {
            let (guard, default) = self.images.pin(&mut spec).await?;
            _pin = Some(guard);
            image = Some(default);
        }
        validate::spec(&spec, image.as_ref())?;
        let ws_name = workspace.unwrap_or(DEFAULT_WORKSPACE);
        validate::name("workspace", ws_name)?;
        let ws = self
            .resolve_workspace(&WorkspaceSelector::Name(ws_name.to_string()))
            .await?;
        let create = |reply| WorkspaceMsg::CreateSandbox {
            name: name.to_string(),
            spec: spec.clone(),
            stopped,
            reply,
        };
        self.ask_workspace(ws.id(), create)
            .await?
            .ok_or_else(|| ActorError::WorkspaceNotFound(format!("{ws_name:?}")))
    }

    pub async fn get_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        Ok(self.resolve_sandbox(sel).await?.sandbox)
    }

    pub async fn list_sandboxes(
        &self,
        filter: &SandboxFilter,
        page_size: u32,
        page_token: &str,
    ) -> Result<Listed<Sandbox>> {
        let scope = self.scope(filter).await?;
        let page = self
            .list_page(
                Kind::Sandbox,
                scope,
                &filter.label_selector,
                page_size,
                page_token,
            )
            .await?;
        let items = page
            .records
            .into_iter()
            .map(|r| StoredSandbox::from_record(r).map(|s| s.sandbox))
            .collect::<Result<_>>()?;
        Ok(Listed {
            items,
            next_page_token: page.next_cursor.unwrap_or_default(),
        })
    }

    pub async fn start_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        self.command(&sb, SandboxMsg::Start)
            .await?
            .ok_or_else(|| not_found_id(sb.id()))
    }

    pub async fn stop_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        self.command(&sb, SandboxMsg::Stop)
            .await?
            .ok_or_else(|| not_found_id(sb.id()))
    }

    pub async fn restart_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        self.command(&sb, SandboxMsg::Restart)
            .await?
            .ok_or_else(|| not_found_id(sb.id()))
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

    /// A stream of sandbox events. `resource_version` 0 starts with an ADDED event for every
    /// current sandbox; N resumes after version N.
    pub async fn watch(
        &self,
        filter: &SandboxFilter,
        resource_version: u64,
    ) -> Result<ReceiverStream<Result<SandboxEvent>>> {
        let scope = self.scope(filter).await?;
        let selector = parse_selector(&filter.label_selector)?;
        // Every version a client was given was committed first: one beyond the store's is
        // none the gateway gave out, and a watch from it would wait for ever in silence.
        if resource_version > 0 {
            let newest = self.shared.store.current_revision().await?;
            if resource_version > newest {
                return Err(ActorError::ResourceVersionInFuture {
                    requested: resource_version,
                    newest,
                });
            }
        }
        let sub = self.shared.events.subscribe(resource_version)?;
        let mut initial = Vec::new();
        let mut floor: HashMap<String, u64> = HashMap::new();
        if resource_version == 0 {
            let mut cursor = None;
            loop {
                let q = ListQuery {
                    kind: Kind::Sandbox,
                    scope,
                    selector: selector.clone(),
                    limit: 1000,
                    cursor,
                };
                let page = self.shared.store.list(q).await?;
                for record in page.records {
                    let sb = StoredSandbox::from_record(record)?.sandbox;
                    floor.insert(sb.id.clone(), sb.resource_version);
                    initial.push(SandboxEvent {
                        r#type: EventType::Added as i32,
                        resource_version: sb.resource_version,
                        sandbox: Some(sb),
                    });
                }
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
        }
        let wanted = move |ev: &SandboxEvent| -> bool {
            let Some(sb) = &ev.sandbox else { return false };
            let in_scope = match &scope {
                Scope::All => true,
                Scope::Workspace(ws) => sb.workspace_id == ws.to_string(),
            };
            let labels: BTreeMap<String, String> = sb
                .spec
                .as_ref()
                .map(|s| s.labels.clone().into_iter().collect())
                .unwrap_or_default();
            in_scope
                && selector.matches(&labels)
                && ev.resource_version > resource_version
                && floor.get(&sb.id).is_none_or(|rv| ev.resource_version > *rv)
        };
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        tokio::spawn(async move {
            for ev in initial {
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
            let mut last = resource_version;
            let mut sub = sub;
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    received = sub.recv() => match received {
                        Ok(ev) => {
                            if !wanted(&ev) {
                                continue;
                            }
                            last = last.max(ev.resource_version);
                            // The history's copy is shared; this watcher's is made only for
                            // an event it sends.
                            if tx.send(Ok(SandboxEvent::clone(&ev))).await.is_err() {
                                return;
                            }
                        }
                        Err(LiveError::FellBehind { .. }) => {
                            let _ = tx.send(Err(ActorError::Unavailable(format!(
                                "the watch fell behind; resume from resource version {last}"
                            )))).await;
                            return;
                        }
                        Err(LiveError::Closed) => return,
                    }
                }
            }
        });
        Ok(ReceiverStream::new(rx))
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

    /// Runs a command inside a Ready sandbox, with no input.
    pub async fn exec(
        &self,
        sel: &SandboxSelector,
        command: Vec<String>,
        env: HashMap<String, String>,
        timeout_seconds: u32,
    ) -> Result<DriverStream<pb::ExecOutput>> {
        let opts = ExecOptions {
            env,
            timeout_seconds,
            ..ExecOptions::default()
        };
        self.exec_io(sel, command, opts, sbx_drivers::no_exec_input())
            .await
    }

    /// Runs a command inside a Ready sandbox with `input` (stdin, terminal sizes, signals) as
    /// the caller sends it. A request for stdin or a terminal from a driver that has neither
    /// is UNIMPLEMENTED, said before anything runs.
    pub async fn exec_io(
        &self,
        sel: &SandboxSelector,
        command: Vec<String>,
        opts: ExecOptions,
        input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>> {
        validate::exec(&command, &opts.env, &opts.workdir)?;
        let sb = self.resolve_sandbox(sel).await?;
        require_ready(&sb.sandbox, "exec into")?;
        let driver = self.driver_of(&sb)?;
        let request = pb::ExecRequest {
            sandbox_id: sb.id().to_string(),
            command,
            env: opts.env,
            timeout_seconds: opts.timeout_seconds,
            workdir: opts.workdir,
            stdin: opts.stdin,
            tty: opts.tty,
        };
        Ok(driver.exec_io(request, input).await?)
    }

    /// A path of a Ready sandbox as a tar stream.
    pub async fn copy_from(
        &self,
        sel: &SandboxSelector,
        path: String,
    ) -> Result<DriverStream<pb::CopyChunk>> {
        let path = copy_path(path)?;
        let sb = self.resolve_sandbox(sel).await?;
        require_settled(&sb.sandbox, "copy from")?;
        let driver = self.driver_of(&sb)?;
        let req = pb::CopyFromRequest {
            sandbox_id: sb.id().to_string(),
            path,
        };
        Ok(driver.copy_from(req).await?)
    }

    /// Unpacks the tar `data` in a sandbox at `path` (Ready, or stopped where its driver
    /// can copy then).
    pub async fn copy_to(
        &self,
        sel: &SandboxSelector,
        path: String,
        data: sbx_drivers::ByteStream,
    ) -> Result<pb::CopyToResponse> {
        let path = copy_path(path)?;
        let sb = self.resolve_sandbox(sel).await?;
        require_settled(&sb.sandbox, "copy into")?;
        let driver = self.driver_of(&sb)?;
        let req = pb::CopyToStart {
            sandbox_id: sb.id().to_string(),
            path,
        };
        Ok(driver.copy_to(req, data).await?)
    }

    /// A TCP connection to `port` on a Ready sandbox's loopback.
    pub async fn port_forward(
        &self,
        sel: &SandboxSelector,
        port: u32,
        input: sbx_drivers::ForwardInputStream,
    ) -> Result<DriverStream<pb::PortForwardOutput>> {
        if port == 0 || port > u32::from(u16::MAX) {
            return Err(ActorError::InvalidArgument(format!(
                "port {port} is not a TCP port (1-65535)"
            )));
        }
        let sb = self.resolve_sandbox(sel).await?;
        require_ready(&sb.sandbox, "forward a port of")?;
        let driver = self.driver_of(&sb)?;
        let req = pb::PortForwardStart {
            sandbox_id: sb.id().to_string(),
            port,
        };
        Ok(driver.port_forward(req, input).await?)
    }

    /// The sandbox's log as `req` asks (follow, tail, timestamps, since); its `sandbox_id`
    /// is set here, to the sandbox `sel` names.
    pub async fn logs(
        &self,
        sel: &SandboxSelector,
        req: pb::LogsRequest,
    ) -> Result<DriverStream<pb::LogChunk>> {
        let sb = self.resolve_sandbox(sel).await?;
        let driver = self.driver_of(&sb)?;
        let req = pb::LogsRequest {
            sandbox_id: sb.id().to_string(),
            ..req
        };
        Ok(driver.logs(req).await?)
    }

    // ---- images ----------------------------------------------------------------------------

    /// Pulls an image and records it under its normalised name (re-tagging an existing record).
    pub async fn pull_image(
        &self,
        reference: &str,
        options: &PullOptions,
        progress: &(dyn Fn(PullProgress) + Send + Sync),
    ) -> Result<Image> {
        self.images.pull(reference, options, progress).await
    }

    /// Imports an image file; `name` (name:tag) overrides the names the archive carries.
    pub async fn import_image(&self, path: &Path, name: Option<&str>) -> Result<Vec<Image>> {
        self.images.import(path, name).await
    }

    /// Records the built-in busybox image under `name` unless a record of it exists
    /// (`None` then).
    pub async fn ensure_busybox_image(&self, busybox: &Path, name: &str) -> Result<Option<Image>> {
        self.images.ensure_busybox(busybox, name).await
    }

    /// Where an import upload is spooled, and the largest upload accepted.
    pub fn image_spool(&self) -> Result<(PathBuf, u64)> {
        self.images.spool()
    }

    /// Whether the named driver (empty: the default) runs sandboxes from images.
    pub async fn driver_has_images(&self, driver: &str) -> Result<bool> {
        let d = Arc::clone(self.shared.drivers.get(driver)?);
        let name = if driver.is_empty() {
            self.shared.drivers.default_name()
        } else {
            driver
        };
        self.images.driver_has_images(name, d.as_ref()).await
    }

    pub async fn get_image(&self, sel: &ImageSelector) -> Result<Image> {
        self.images.get(sel).await
    }

    /// Image records in creation order, a page at a time.
    pub async fn list_images(&self, page_size: u32, page_token: &str) -> Result<Listed<Image>> {
        let page = self
            .list_page(Kind::Image, Scope::All, "", page_size, page_token)
            .await?;
        let items = page
            .records
            .into_iter()
            .map(|r| StoredImage::from_record(r).map(|s| s.image))
            .collect::<Result<_>>()?;
        Ok(Listed {
            items,
            next_page_token: page.next_cursor.unwrap_or_default(),
        })
    }

    /// Deletes an image record, refused while a sandbox pins its digest. False for an id with
    /// no record.
    pub async fn delete_image(&self, sel: &ImageSelector) -> Result<bool> {
        self.images.delete(sel).await
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

    /// Sends a lifecycle command to a sandbox's actor and waits for its answer, riding out
    /// restarts of the actor (commands are idempotent, so a retry is safe). `None` when the
    /// sandbox no longer exists.
    async fn command<R: Send + 'static>(
        &self,
        sb: &StoredSandbox,
        msg: fn(RpcReplyPort<Result<R>>) -> SandboxMsg,
    ) -> Result<Option<R>> {
        let ws = sb
            .record
            .workspace
            .ok_or_else(|| ActorError::Internal(format!("sandbox {} has no workspace", sb.id())))?;
        let id = sb.id();
        let deadline = tokio::time::Instant::now() + self.shared.config.request_timeout;
        loop {
            match self.router.sandbox(ws, id).await? {
                Route::Actor(actor) => {
                    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
                    match actor.call(msg, Some(remaining)).await {
                        Ok(CallResult::Success(r)) => return r.map(Some),
                        Ok(CallResult::Timeout) => return Err(self.timed_out("sandbox", id)),
                        // The actor died while it held the request; its supervisor restarts it
                        // (a write that met a full disk in the middle answers that, at once).
                        Ok(CallResult::SenderError) | Err(_) => self.refuse_if_disk_full()?,
                    }
                }
                Route::Restarting => {}
                Route::Unknown => {
                    if self.shared.store.get(id).await?.is_none() {
                        return Ok(None);
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(self.timed_out("sandbox", id));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sends a request to a workspace's supervisor and waits for its answer, riding out the
    /// supervisor's restarts. `None` when the workspace no longer has a supervisor (deleted).
    async fn ask_workspace<R: Send + 'static>(
        &self,
        ws: Uuid,
        build: impl Fn(RpcReplyPort<Result<R>>) -> WorkspaceMsg,
    ) -> Result<Option<R>> {
        let deadline = tokio::time::Instant::now() + self.shared.config.request_timeout;
        loop {
            match self.router.workspace(ws).await? {
                Route::Actor(sup) => {
                    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
                    match sup.call(&build, Some(remaining)).await {
                        Ok(CallResult::Success(r)) => return r.map(Some),
                        Ok(CallResult::Timeout) => return Err(self.timed_out("workspace", ws)),
                        // The supervisor went away mid-request (restart or deletion): ask again
                        // (a write that met a full disk in the middle answers that, at once).
                        Ok(CallResult::SenderError) | Err(_) => self.refuse_if_disk_full()?,
                    }
                }
                Route::Restarting => {}
                Route::Unknown => return Ok(None),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(self.timed_out("workspace", ws));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn timed_out(&self, what: &str, id: Uuid) -> ActorError {
        ActorError::Unavailable(format!(
            "{what} {id} did not answer within {:?}",
            self.shared.config.request_timeout
        ))
    }

    /// Refuses a lifecycle write up front while the store refuses writes for lack of space
    /// (checked now: one `statvfs`), so that no actor starts a step it cannot record, and a
    /// caller is answered at once instead of waiting out its deadline.
    fn refuse_if_disk_full(&self) -> Result<()> {
        match self.shared.store.disk_full() {
            Some(full) => Err(full.into()),
            None => Ok(()),
        }
    }

    fn driver_of(&self, sb: &StoredSandbox) -> Result<Arc<dyn sbx_drivers::ComputeDriver>> {
        let name = sb
            .sandbox
            .spec
            .as_ref()
            .map(|s| s.driver.as_str())
            .unwrap_or("");
        Ok(Arc::clone(self.shared.drivers.get(name)?))
    }

    async fn resolve_workspace(&self, sel: &WorkspaceSelector) -> Result<StoredWorkspace> {
        let record = match sel {
            WorkspaceSelector::Id(id) => self
                .shared
                .store
                .get(*id)
                .await?
                .filter(|r| r.kind == Kind::Workspace),
            WorkspaceSelector::Name(name) => {
                self.shared
                    .store
                    .get_by_name(Kind::Workspace, None, name)
                    .await?
            }
        };
        match record {
            Some(r) => StoredWorkspace::from_record(r),
            None => Err(ActorError::WorkspaceNotFound(match sel {
                WorkspaceSelector::Id(id) => format!("with id {id}"),
                WorkspaceSelector::Name(name) => format!("{name:?}"),
            })),
        }
    }

    async fn resolve_sandbox(&self, sel: &SandboxSelector) -> Result<StoredSandbox> {
        match sel {
            SandboxSelector::Id(id) => match self
                .shared
                .store
                .get(*id)
                .await?
                .filter(|r| r.kind == Kind::Sandbox)
            {
                Some(r) => StoredSandbox::from_record(r),
                None => Err(not_found_id(*id)),
            },
            SandboxSelector::Name { workspace, name } => {
                let ws_name = workspace.as_deref().unwrap_or(DEFAULT_WORKSPACE);
                let ws = self
                    .resolve_workspace(&WorkspaceSelector::Name(ws_name.to_string()))
                    .await?;
                if let Some(r) = self
                    .shared
                    .store
                    .get_by_name(Kind::Sandbox, Some(ws.id()), name)
                    .await?
                {
                    return StoredSandbox::from_record(r);
                }
                let what = format!("{name:?} in workspace {ws_name:?}");
                if workspace.is_some() {
                    return Err(ActorError::SandboxNotFound {
                        what,
                        hint: String::new(),
                    });
                }
                // A name-only request: say where the name does exist, never pick one.
                let elsewhere = self.workspaces_with_sandbox(name).await?;
                match elsewhere.len() {
                    0 => Err(ActorError::SandboxNotFound {
                        what,
                        hint: String::new(),
                    }),
                    1 => Err(ActorError::SandboxNotFound {
                        what,
                        hint: format!(
                            " (a sandbox of that name is in workspace {:?}; name the workspace)",
                            elsewhere[0]
                        ),
                    }),
                    _ => Err(ActorError::AmbiguousName {
                        name: name.clone(),
                        workspaces: elsewhere,
                    }),
                }
            }
        }
    }

    /// The names, sorted, of the workspaces that hold a sandbox called `name`.
    async fn workspaces_with_sandbox(&self, name: &str) -> Result<Vec<String>> {
        let mut found = Vec::new();
        let mut cursor = None;
        loop {
            let mut q = ListQuery::new(Kind::Workspace, Scope::All, 1000);
            q.cursor = cursor;
            let page = self.shared.store.list(q).await?;
            for ws in &page.records {
                if self
                    .shared
                    .store
                    .get_by_name(Kind::Sandbox, Some(ws.id), name)
                    .await?
                    .is_some()
                {
                    found.push(ws.name.clone());
                }
            }
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        found.sort();
        Ok(found)
    }

    async fn scope(&self, filter: &SandboxFilter) -> Result<Scope> {
        if filter.all_workspaces {
            return Ok(Scope::All);
        }
        let name = filter
            .workspace
            .as_deref()
            .filter(|w| !w.is_empty())
            .unwrap_or(DEFAULT_WORKSPACE);
        validate::name("workspace", name)?;
        Ok(Scope::Workspace(
            self.resolve_workspace(&WorkspaceSelector::Name(name.to_string()))
                .await?
                .id(),
        ))
    }

    async fn list_page(
        &self,
        kind: Kind,
        scope: Scope,
        label_selector: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<sbx_storage::Page> {
        let limit = match page_size {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        } as usize;
        validate::page_token(page_token)?;
        let cursor = (!page_token.is_empty()).then(|| page_token.to_string());
        let q = ListQuery {
            kind,
            scope,
            selector: parse_selector(label_selector)?,
            limit,
            cursor,
        };
        self.shared.store.list(q).await.map_err(|e| match e {
            sbx_storage::StoreError::Invalid { .. } => ActorError::InvalidArgument(e.to_string()),
            other => other.into(),
        })
    }
}

fn parse_selector(text: &str) -> Result<LabelSelector> {
    validate::selector(text)
}

fn not_found_id(id: Uuid) -> ActorError {
    ActorError::SandboxNotFound {
        what: format!("with id {id}"),
        hint: String::new(),
    }
}

fn require_ready(sb: &Sandbox, what: &str) -> Result<()> {
    if sb.phase() != Phase::Ready {
        return Err(ActorError::FailedPrecondition(format!(
            "cannot {what} sandbox {:?}: it is {:?}, not Ready",
            sb.name,
            sb.phase()
        )));
    }
    Ok(())
}

/// A copy goes to the running workload's agent, or, where the driver can
/// (`copy_when_stopped`), to the files of a sandbox that does not run: Ready, or settled
/// without a workload (Stopped, Completed, Error). A sandbox on its way between the two is
/// refused: its files are about to change hands.
fn require_settled(sb: &Sandbox, what: &str) -> Result<()> {
    match sb.phase() {
        Phase::Ready | Phase::Stopped | Phase::Completed | Phase::Error => Ok(()),
        phase => Err(ActorError::FailedPrecondition(format!(
            "cannot {what} sandbox {:?}: it is {phase:?}; wait until it is Ready or Stopped",
            sb.name
        ))),
    }
}

/// A path for a copy: absolute, without NUL, at most 4096 bytes.
fn copy_path(path: String) -> Result<String> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > 4096 {
        return Err(ActorError::InvalidArgument(format!(
            "the sandbox path {} is not an absolute path (at most 4096 bytes, no NUL)",
            crate::limits::quote(&path)
        )));
    }
    Ok(path)
}
