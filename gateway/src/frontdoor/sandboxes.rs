//! The sandbox calls of the front door that the E2B door makes: create (through the image
//! mirror, then waiting on the watch until the sandbox is usable), delete, ttl, pause,
//! resume and exec — each checked, audited, and forwarded to the workspace's holder when the
//! workspace is served by another gateway of the store ([`super::forward`]). Reads (get,
//! list) are the store's and served where they are asked.

use std::time::Duration;

use futures::StreamExt;
use sbx_actors::{ExecInputs, ExecOptions, SandboxFilter, SandboxSelector};
use sbx_proto::v1::{self, Phase, Sandbox, SandboxRef, SandboxSpec};

use super::{Class, Failure, FrontDoor, forward};
use crate::auth::{Caller, Role};

/// Who calls, as the front door takes it: the caller authentication made, and the bearer
/// token it proved itself with (what a call forwarded to the holder carries; `None` when the
/// caller was known otherwise).
#[derive(Clone, Copy)]
pub struct Call<'a> {
    pub caller: &'a Caller,
    pub bearer: Option<&'a str>,
}

/// An exec's output as it comes, from this gateway's sandbox or the holder's.
pub type ExecStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<v1::ExecOutput, Failure>> + Send>>;

/// The reference of a selector, as a forwarded request names the sandbox.
fn reference(sel: &SandboxSelector) -> SandboxRef {
    match sel {
        SandboxSelector::Id(id) => SandboxRef {
            id: id.to_string(),
            ..Default::default()
        },
        SandboxSelector::Name { workspace, name } => SandboxRef {
            workspace: workspace.clone().unwrap_or_default(),
            name: name.clone(),
            ..Default::default()
        },
    }
}

/// What [`FrontDoor::suspend_or_wake`] does: E2B's pause (with its memory, or its files
/// only: a stop) and the connect that undoes either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suspend {
    Pause,
    Resume,
    Stop,
    Start,
}

/// How long a connect waits for a sandbox it started again to be Ready.
const START_WITHIN: Duration = Duration::from_secs(120);

impl FrontDoor {
    /// The holder to forward a failed call to, when the failure is `Elsewhere`.
    fn holder_for(&self, call: Call<'_>, failure: Failure) -> Result<forward::Holder, Failure> {
        let Some(address) = failure.holder() else {
            return Err(failure);
        };
        forward::holder(self.peers.as_deref(), address, call.bearer, &failure)
    }

    /// Creates sandbox `name` in `workspace` (editor there): the image fetched from the
    /// mirror first when this gateway lacks it, made here or by the workspace's holder.
    pub async fn create_sandbox(
        &self,
        call: Call<'_>,
        workspace: Option<&str>,
        name: &str,
        spec: SandboxSpec,
        action: &str,
    ) -> Result<Sandbox, Failure> {
        let ws = workspace.unwrap_or(sbx_proto::names::DEFAULT_WORKSPACE);
        self.require_by_name(call.caller, ws, Role::Editor).await?;
        if let Some(mirror) = &self.mirror {
            mirror.fetch_for(&self.gateway, workspace, &spec).await;
        }
        let created = match self
            .gateway
            .create_sandbox(workspace, name, spec.clone())
            .await
        {
            Ok(created) => created,
            Err(e) => {
                let mut holder = self.holder_for(call, FrontDoor::failure(call.caller, e))?;
                let request = v1::CreateSandboxRequest {
                    workspace: workspace.unwrap_or_default().to_string(),
                    name: name.to_string(),
                    spec: Some(spec),
                    ..Default::default()
                };
                let answer = holder.create_sandbox(request).await;
                answer.map_err(forward::from_holder)?.into_inner()
            }
        };
        audit(call.caller, action, &created.id);
        Ok(created)
    }

    /// Deletes the sandbox `sel` names (editor in its workspace).
    pub async fn delete_sandbox(
        &self,
        call: Call<'_>,
        sel: &SandboxSelector,
        action: &str,
    ) -> Result<(), Failure> {
        self.sandbox_access(call.caller, sel, Role::Editor).await?;
        if let Err(e) = self.gateway.delete_sandbox(sel).await {
            let mut holder = self.holder_for(call, FrontDoor::failure(call.caller, e))?;
            let request = v1::DeleteSandboxRequest {
                sandbox: Some(reference(sel)),
            };
            let answer = holder.delete_sandbox(request).await;
            answer.map_err(forward::from_holder)?;
        }
        audit(call.caller, action, &describe(sel));
        Ok(())
    }

    /// Sets the sandbox's ttl to `seconds` from now (editor in its workspace).
    pub async fn set_sandbox_ttl(
        &self,
        call: Call<'_>,
        sel: &SandboxSelector,
        seconds: u64,
        action: &str,
    ) -> Result<Sandbox, Failure> {
        self.sandbox_access(call.caller, sel, Role::Editor).await?;
        let sandbox = match self.gateway.set_sandbox_ttl(sel, seconds).await {
            Ok(sandbox) => sandbox,
            Err(e) => {
                let mut holder = self.holder_for(call, FrontDoor::failure(call.caller, e))?;
                let request = v1::SetSandboxTtlRequest {
                    sandbox: Some(reference(sel)),
                    ttl_seconds: seconds,
                };
                let answer = holder.set_sandbox_ttl(request).await;
                answer.map_err(forward::from_holder)?.into_inner()
            }
        };
        audit(call.caller, action, &describe(sel));
        Ok(sandbox)
    }

    /// Pauses, resumes, stops or starts the sandbox (editor in its workspace), here or on
    /// the workspace's holder.
    pub async fn suspend_or_wake(
        &self,
        call: Call<'_>,
        sel: &SandboxSelector,
        change: Suspend,
        action: &str,
    ) -> Result<Sandbox, Failure> {
        self.sandbox_access(call.caller, sel, Role::Editor).await?;
        let local = match change {
            Suspend::Pause => self.gateway.pause_sandbox(sel).await,
            Suspend::Resume => self.gateway.resume_sandbox(sel).await,
            Suspend::Stop => self.gateway.stop_sandbox(sel).await,
            Suspend::Start => self.gateway.start_sandbox(sel).await,
        };
        let sandbox = match local {
            Ok(sandbox) => sandbox,
            Err(e) => {
                let mut holder = self.holder_for(call, FrontDoor::failure(call.caller, e))?;
                let sandbox = Some(reference(sel));
                let answer = match change {
                    Suspend::Pause => {
                        holder
                            .pause_sandbox(v1::PauseSandboxRequest { sandbox })
                            .await
                    }
                    Suspend::Stop => {
                        holder
                            .stop_sandbox(v1::StopSandboxRequest { sandbox })
                            .await
                    }
                    Suspend::Start => {
                        holder
                            .start_sandbox(v1::StartSandboxRequest { sandbox })
                            .await
                    }
                    Suspend::Resume => {
                        holder
                            .resume_sandbox(v1::ResumeSandboxRequest { sandbox })
                            .await
                    }
                };
                answer.map_err(forward::from_holder)?.into_inner()
            }
        };
        audit(call.caller, action, &describe(sel));
        Ok(sandbox)
    }

    /// Runs `command` in the sandbox (editor in its workspace) with `input` as its stdin,
    /// signals and sizes, here or on the workspace's holder.
    pub async fn exec(
        &self,
        call: Call<'_>,
        sel: &SandboxSelector,
        command: Vec<String>,
        opts: ExecOptions,
        input: ExecInputs,
    ) -> Result<ExecStream, Failure> {
        self.sandbox_access(call.caller, sel, Role::Editor).await?;
        // The input goes to whichever end runs the command: held here until the local call
        // has answered, so a refusal that names the holder still has all of it.
        let (tx, rx) = tokio::sync::mpsc::channel::<v1::exec_input::Input>(16);
        tokio::spawn(async move {
            let mut input = input;
            while let Some(item) = input.next().await {
                if tx.send(item).await.is_err() {
                    break;
                }
            }
        });
        let (local_tx, local_rx) = tokio::sync::mpsc::channel(16);
        let local_input: ExecInputs =
            Box::pin(tokio_stream::wrappers::ReceiverStream::new(local_rx));
        let request = v1::ExecRequest {
            sandbox: Some(reference(sel)),
            command: command.clone(),
            env: opts.env.clone(),
            timeout_seconds: opts.timeout_seconds,
            workdir: opts.workdir.clone(),
            stdin: opts.stdin,
            tty: opts.tty.clone(),
            user: opts.user.clone(),
        };
        match self.gateway.exec_io(sel, command, opts, local_input).await {
            Ok(output) => {
                tokio::spawn(pipe(rx, local_tx));
                let caller = call.caller.clone();
                Ok(Box::pin(output.map(move |r| {
                    r.map_err(|e| FrontDoor::failure(&caller, e))
                })))
            }
            Err(e) => {
                let mut holder = self.holder_for(call, FrontDoor::failure(call.caller, e))?;
                let start = v1::ExecInput {
                    input: Some(v1::exec_input::Input::Start(request)),
                };
                let rest = tokio_stream::wrappers::ReceiverStream::new(rx)
                    .map(|input| v1::ExecInput { input: Some(input) });
                let messages = futures::stream::iter([start]).chain(rest);
                let answer = holder.exec(messages).await;
                let output = answer.map_err(forward::from_holder)?.into_inner();
                Ok(Box::pin(output.map(|r| r.map_err(forward::from_holder))))
            }
        }
    }

    /// E2B's connect: a paused sandbox is resumed, and its deadline moved to now +
    /// `timeout` when that is later (never earlier); answers the sandbox and whether it was
    /// resumed.
    pub async fn connect_sandbox(
        &self,
        call: Call<'_>,
        sel: &SandboxSelector,
        timeout: Option<u64>,
        action: &str,
    ) -> Result<(Sandbox, bool), Failure> {
        let sandbox = self.sandbox(call.caller, sel, Role::Editor).await?;
        // Paused with its memory: resumed; paused as its files only (stopped, as E2B's
        // `pause(keep_memory=False)` leaves it) or ended: started again from its files.
        let (paused, sandbox) = match sandbox.phase() {
            Phase::Paused | Phase::Pausing => {
                let resumed = self.suspend_or_wake(call, sel, Suspend::Resume, "");
                (true, resumed.await?)
            }
            Phase::Stopped | Phase::Stopping | Phase::Completed => {
                let started = self.suspend_or_wake(call, sel, Suspend::Start, "");
                let started = started.await?;
                let ready = self.wait_ready(call.caller, started, START_WITHIN);
                (true, ready.await?)
            }
            _ => (false, sandbox),
        };
        if let Some(timeout) = timeout {
            let wanted = std::time::SystemTime::now() + Duration::from_secs(timeout);
            let current = sandbox
                .expires_at
                .as_ref()
                .and_then(|t| std::time::SystemTime::try_from(*t).ok());
            if current.is_some_and(|c| c < wanted) {
                self.set_sandbox_ttl(call, sel, timeout.max(1), "").await?;
            }
        }
        audit(call.caller, action, &describe(sel));
        Ok((sandbox, paused))
    }

    /// Waits on the gateway's watch (at most `within`) until the sandbox is Ready, as
    /// `sbx sandbox create --wait` does: a sandbox that ends before it is Ready is a failure
    /// naming why. Each event is the store's, so a sandbox made by the workspace's holder is
    /// seen here too.
    pub async fn wait_ready(
        &self,
        caller: &Caller,
        sandbox: Sandbox,
        within: Duration,
    ) -> Result<Sandbox, Failure> {
        let filter = SandboxFilter {
            workspace: Some(sandbox.workspace.clone()),
            all_workspaces: false,
            label_selector: String::new(),
        };
        let id = sandbox.id.clone();
        let deadline = tokio::time::Instant::now() + within;
        let mut latest = sandbox;
        // From the version the sandbox was read at: no change after it is missed.
        let from = latest.resource_version;
        let mut events = self
            .gateway
            .watch(&filter, from)
            .await
            .map_err(|e| FrontDoor::failure(caller, e))?;
        loop {
            match settled(&latest) {
                Some(Ok(())) => return Ok(latest),
                Some(Err(failure)) => return Err(failure),
                None => {}
            }
            let event = match tokio::time::timeout_at(deadline, events.next()).await {
                Ok(Some(Ok(event))) => event,
                Ok(Some(Err(e))) => return Err(FrontDoor::failure(caller, e)),
                Ok(None) => {
                    return Err(Failure::new(
                        Class::Unavailable,
                        "UNAVAILABLE",
                        "the watch ended before the sandbox was Ready; ask again",
                    ));
                }
                Err(_) => {
                    return Err(Failure::new(
                        Class::DeadlineExceeded,
                        "SANDBOX_NOT_READY",
                        format!("sandbox {id} was not Ready within {} s", within.as_secs()),
                    ));
                }
            };
            if let Some(sandbox) = event.sandbox.filter(|s| s.id == id) {
                latest = sandbox;
            }
        }
    }
}

/// The audit line of an allowed call (none when a larger call makes it and says its own).
fn audit(caller: &Caller, action: &str, object: &str) {
    if !action.is_empty() {
        super::audit(caller, action, object);
    }
}

/// Feeds the input on to the local exec, once it is known to run here.
async fn pipe(
    mut rx: tokio::sync::mpsc::Receiver<v1::exec_input::Input>,
    tx: tokio::sync::mpsc::Sender<v1::exec_input::Input>,
) {
    while let Some(item) = rx.recv().await {
        if tx.send(item).await.is_err() {
            break;
        }
    }
}

/// Whether a sandbox waited for is Ready (`Ok`), ended before it (a failure naming why), or
/// neither yet.
fn settled(sandbox: &Sandbox) -> Option<Result<(), Failure>> {
    match sandbox.phase() {
        Phase::Ready => Some(Ok(())),
        Phase::Error | Phase::Completed | Phase::Stopped => Some(Err(Failure::new(
            Class::FailedPrecondition,
            "SANDBOX_NOT_STARTED",
            format!(
                "sandbox {} did not start: {:?} ({}: {})",
                sandbox.id,
                sandbox.phase(),
                sandbox.reason,
                sandbox.message
            ),
        ))),
        _ => None,
    }
}

/// A selector in the audit log: the id, or workspace/name.
pub fn describe(sel: &SandboxSelector) -> String {
    match sel {
        SandboxSelector::Id(id) => id.to_string(),
        SandboxSelector::Name { workspace, name } => format!(
            "{}/{name}",
            workspace
                .as_deref()
                .unwrap_or(sbx_proto::names::DEFAULT_WORKSPACE)
        ),
    }
}

/// The reads and checks the E2B door makes besides the calls above.
impl FrontDoor {
    /// Whether `caller` may create sandboxes in workspace `workspace` (editor there): known
    /// from the credential alone, so a door checks it before it reads a request's body.
    pub async fn may_create_in(&self, caller: &Caller, workspace: &str) -> Result<(), Failure> {
        self.require_by_name(caller, workspace, Role::Editor).await
    }

    /// One page of the sandboxes `filter` names, as `caller` sees them (those of workspaces
    /// it does not see left out).
    pub async fn list_sandboxes(
        &self,
        caller: &Caller,
        filter: &SandboxFilter,
        page_size: u32,
        token: &str,
    ) -> Result<sbx_actors::Listed<Sandbox>, Failure> {
        let mut page = self
            .gateway
            .list_sandboxes(filter, page_size, token)
            .await
            .map_err(|e| FrontDoor::failure(caller, e))?;
        page.items.retain(|s| caller.sees(&s.workspace_id));
        Ok(page)
    }

    /// The usage samples kept of the sandbox `sel` names and one read now, `history` back
    /// (viewer in its workspace).
    pub async fn sandbox_stats(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        history: Duration,
    ) -> Result<v1::SandboxStats, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        self.gateway
            .sandbox_stats(sel, history)
            .await
            .map_err(|e| FrontDoor::failure(caller, e))
    }

    /// The sandbox an in-sandbox call names, looked up to check the call's sandbox token
    /// (which says who calls: there is no caller before it); `None` when there is none.
    pub async fn sandbox_for_token(&self, id: uuid::Uuid) -> Option<Sandbox> {
        self.gateway
            .get_sandbox(&SandboxSelector::Id(id))
            .await
            .ok()
    }

    /// The audit line of an in-sandbox call the sandbox's token allowed (the token is the
    /// access check: it names an editor of the sandbox's workspace).
    pub fn allowed(&self, caller: &Caller, action: &str, object: &str) {
        audit(caller, action, object);
    }
}
